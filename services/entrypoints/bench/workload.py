"""Shared pieces of the offline benchmarks (`myvllm bench throughput` / `bench latency`).

- the synthetic workload: random token-id prompts (`BenchRequest`, `random_requests`);
- the sampling knobs every request of a run shares (`SamplingKnobs`);
- the `Peer` interface every engine under test implements, and my-vllm's own peer
  (`MyVllmPeer`; HF and llama.cpp live in `hf_peer.py` / `llamacpp_peer.py`);
- `run_peer`: load → warm up → measure → free, one peer at a time;
- plain-text tables and the JSON dump.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from services.common.config import is_gguf_file
from services.common.sampling_params import SamplingParams

# Random prompt ids are drawn from [SAFE_TOKEN_ID_MIN, vocab_size - 1): the low ids of the
# SmolLM2 / Llama-style vocabularies are special tokens (bos, eos, chat markers, ...).
SAFE_TOKEN_ID_MIN = 100
_GREEDY_EPS = 1e-5  # the engine's sampler treats temperatures below this as greedy

T = TypeVar("T")


def log(message: str) -> None:
    """Progress for the person running the benchmark: stderr, so stdout stays the report."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: a prompt of token ids and exactly how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def model_vocab_size(model_dir: str) -> int:
    """The vocabulary size in the model directory's config.json, or a .gguf file's token list."""
    if is_gguf_file(model_dir):
        from gguf import GGUFReader

        return len(GGUFReader(model_dir).fields["tokenizer.ggml.tokens"].data)
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)


def random_requests(
    num_requests: int,
    input_len_min: int,
    input_len_max: int,
    output_len_min: int,
    output_len_max: int,
    vocab_size: int,
    seed: int,
    stream: int = 0,
) -> list[BenchRequest]:
    """`num_requests` requests with prompt and output lengths uniform in the inclusive ranges.

    Prompt ids are uniform in [SAFE_TOKEN_ID_MIN, vocab_size - 1). The same (seed, stream)
    always gives the same requests; different `stream`s give independent prompts (used for
    warm-up prompts that must not share a prefix with the measured ones).
    """
    if num_requests < 1:
        raise ValueError(f"the number of requests must be at least 1, got {num_requests}")
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(f"need 1 <= input-len-min <= input-len-max, got {input_len_min}..{input_len_max}")
    if not 1 <= output_len_min <= output_len_max:
        raise ValueError(f"need 1 <= output-len-min <= output-len-max, got {output_len_min}..{output_len_max}")
    if vocab_size - 1 <= SAFE_TOKEN_ID_MIN:
        raise ValueError(f"vocab_size {vocab_size} is too small for token ids from {SAFE_TOKEN_ID_MIN}")
    rng = np.random.default_rng([seed, stream])
    input_lens = rng.integers(input_len_min, input_len_max + 1, size=num_requests)
    output_lens = rng.integers(output_len_min, output_len_max + 1, size=num_requests)
    return [
        BenchRequest(rng.integers(SAFE_TOKEN_ID_MIN, vocab_size - 1, size=int(n)).tolist(), int(m))
        for n, m in zip(input_lens, output_lens, strict=True)
    ]


def warmup_request(vocab_size: int, seed: int) -> BenchRequest:
    """A tiny request (8 prompt tokens, 4 output tokens) from a stream of its own."""
    return random_requests(1, 8, 8, 4, 4, vocab_size, seed, stream=1)[0]


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingKnobs:
    """The sampling settings shared by every request of a run (default: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """my-vllm's `SamplingParams` for one request: exactly `max_tokens` tokens (`ignore_eos`)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, max_tokens=max_tokens, min_tokens=0, ignore_eos=True)

    def describe(self) -> str:
        if self == SamplingKnobs():
            return "greedy"
        fields = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty")
        return ", ".join(f"{f}={getattr(self, f)}" for f in fields if getattr(self, f) != getattr(SamplingKnobs, f))


# --------------------------------------------------------------------------- peers


class Peer(Protocol):
    """An engine under test. `generate` runs the requests to exactly their output lengths and
    returns the wall-clock seconds it took; loading happens in the constructor (untimed)."""

    name: str

    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PeerSpec:
    """A peer not loaded yet: its name and how to build it."""

    name: str
    factory: Callable[[], Peer]


# my-vllm with the run's --speculative-config (the plain "my-vllm" peer runs without it).
SPEC_PEER = "my-vllm+spec"


class MyVllmPeer:
    """my-vllm through the offline `LLM`: one `generate` call with all requests.

    With `json_schema` every request's output is constrained to it (structured outputs); such
    an output may end before its requested length (its JSON is complete), so the peer counts
    the tokens it really generated in `num_output_tokens`.
    """

    name = "my-vllm"

    def __init__(self, engine_kwargs: dict[str, Any], json_schema: dict[str, Any] | None = None,
                 name: str = "my-vllm", lora_adapters: int = 0) -> None:
        from services.common.structured_outputs import StructuredOutputsParams
        from services.offline import LLM

        self.name = name
        self.structured_outputs = StructuredOutputsParams(json=json_schema) if json_schema is not None else None
        self.llm = LLM(**engine_kwargs)
        self.num_output_tokens: int | None = None
        # `lora_adapters` > 0: random adapters for the model, request i runs with adapter i % N.
        self.loras = []
        if lora_adapters:
            from services.entrypoints.bench.lora_adapters import write_random_adapters
            from services.offline import LoRARequest

            self._lora_dir = tempfile.TemporaryDirectory(prefix="myvllm-bench-lora-")
            paths = write_random_adapters(engine_kwargs["model"], self._lora_dir.name, lora_adapters)
            self.loras = [LoRARequest(f"bench-lora-{i}", i + 1, path) for i, path in enumerate(paths)]

    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [knobs.sampling_params(r.output_len) for r in requests]
        for p in params:
            p.structured_outputs = self.structured_outputs
        start = time.perf_counter()
        loras = [self.loras[i % len(self.loras)] for i in range(len(requests))] if self.loras else None
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        counts = [len(output.outputs[0].token_ids) for output in outputs]
        for request, got in zip(requests, counts, strict=True):
            if got > request.output_len or (got < request.output_len and self.structured_outputs is None):
                raise RuntimeError(f"my-vllm generated {got} tokens for a request of {request.output_len}")
        self.num_output_tokens = sum(counts)
        return elapsed

    def close(self) -> None:
        self.llm.close()  # model-parallel rank processes stop here, not at interpreter exit
        del self.llm
        if self.loras:
            self._lora_dir.cleanup()


def run_peer(spec: PeerSpec, warmup: BenchRequest, knobs: SamplingKnobs, measure: Callable[[Peer], T]) -> T:
    """Load one peer (untimed), run one tiny warm-up generate, `measure` it, then free it so the
    next peer gets the memory (and the caches) to itself."""
    log(f"loading {spec.name}")
    peer = spec.factory()
    try:
        log(f"warming up {spec.name}")
        peer.generate([warmup], knobs)
        log(f"measuring {spec.name}")
        return measure(peer)
    finally:
        peer.close()
        del peer
        gc.collect()


def torch_threads() -> int:
    """The intra-op thread count torch uses now (every peer runs with the same one)."""
    import torch

    return torch.get_num_threads()


def resolve_bench_dtype(dtype: str, model: str | None = None, quantization: str | None = None) -> str:
    """Fix "auto" once, before any peer loads, so every peer (and the report) runs the dtype
    my-vllm picks on this machine for `model` (services/offline/engine_dtype.py)."""
    from services.offline.engine_dtype import engine_dtype

    return engine_dtype(dtype, model, quantization)


def same_model(model_dir: str, other: str) -> bool:
    """Whether two model paths name the same directory."""
    return os.path.realpath(model_dir) == os.path.realpath(other)


# --------------------------------------------------------------------------- output


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write the figures of a run as indented JSON."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
