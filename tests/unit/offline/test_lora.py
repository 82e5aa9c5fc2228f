"""LoRA adapters against the oracle: greedy tokens of each adapter equal HF transformers + PEFT on
the same adapter (fp32, unmerged), with 4 adapters and base-only requests mixed in one batch, in
the default configuration, with chunked prefill and fewer slots than adapters (requests wait for
a slot, slots change adapters), and under preemption; the same prompt under different adapters
never shares prefix-cache blocks. Adapters: scripts/make_lora_adapters.py (random A and B, four
different ranks, target sets and scalings, rsLoRA among them)."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
import torch

from services.common.lora_adapter_config import AdapterConfigError
from services.common.sampling_params import SamplingParams
from services.entrypoints.bench.lora_adapters import write_random_adapters
from services.offline import LLM, LoRARequest

MAX_NEW_TOKENS = 24
BLOCK_SIZE = 16
NUM_ADAPTERS = 4
SHARED = list(range(1000, 1064))  # a 64-token prefix that five requests share, each under another adapter


@pytest.fixture(scope="module")
def adapters(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    paths = write_random_adapters(smollm2_dir, str(tmp_path_factory.mktemp("loras")), NUM_ADAPTERS)
    return [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [SHARED + [rng.randrange(3, 49152) for _ in range(rng.randint(0, 8))] for _ in range(5)]
    prompts += [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 120))] for _ in range(11)]
    return prompts


def _assignment(adapters: list[LoRARequest]) -> list[LoRARequest | None]:
    """Request i runs with adapter i % 5 - 1 (every fifth: the base model)."""
    return [None if i % 5 == 0 else adapters[i % 5 - 1] for i in range(16)]


@functools.lru_cache(maxsize=8)
def _hf(model_dir: str, adapter_path: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return base if adapter_path is None else PeftModel.from_pretrained(base, adapter_path).eval()


@torch.inference_mode()
def _oracle(model_dir: str, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    model = _hf(model_dir, lora.lora_path if lora is not None else None)
    ids, cache, new, pos = torch.tensor([prompt]), None, [], 0
    for _ in range(MAX_NEW_TOKENS):
        n = ids.shape[1]
        out = model(input_ids=ids, position_ids=torch.arange(pos, pos + n).unsqueeze(0), cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache, pos = out.cache, pos + n
        new.append(int(out.logits[0, -1].argmax()))
        ids = torch.tensor([[new[-1]]])
    return new


@pytest.fixture(scope="module")
def expected(smollm2_dir: str, adapters: list[LoRARequest]) -> list[list[int]]:
    return [_oracle(smollm2_dir, p, lora) for p, lora in zip(_prompts(), _assignment(adapters), strict=True)]


CONFIGS = {
    "defaults": {"max_loras": NUM_ADAPTERS},
    # Two slots for four adapters: requests wait for a slot, slots are refilled with other adapters.
    "chunked_two_slots": {"max_loras": 2, "max_cpu_loras": 2, "max_num_batched_tokens": 32},
    # Room for about half the batch at once: requests are preempted and resumed (maybe in another slot).
    "preemption": {"max_loras": NUM_ADAPTERS, "num_gpu_blocks_override": 1 + 8 * 9},
}


@pytest.mark.parametrize("config", CONFIGS)
def test_each_adapter_matches_peft_in_a_mixed_batch(smollm2_dir: str, adapters: list[LoRARequest],
                                                    expected: list[list[int]], config: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with LLM(smollm2_dir, dtype="float32", block_size=BLOCK_SIZE, enable_lora=True, max_lora_rank=16,
             **CONFIGS[config]) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                            lora_request=_assignment(adapters), use_tqdm=False)
        stats = llm.engine.scheduler.counters.as_dict()
    got = [list(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i in range(16) if got[i] != expected[i]]
    assert not wrong, [(i, got[i][:8], expected[i][:8]) for i in wrong]
    if config == "preemption":
        assert stats["num_preemptions"] > 0
    # The adapters matter: each changes the shared prompt's continuation (so the cache kept them apart).
    assert len({tuple(g) for g in got[:5]}) == 5


def test_adapter_and_engine_refusals(smollm2_dir: str, adapters: list[LoRARequest], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q_proj"]}))
    (broken / "adapter_model.safetensors").write_bytes(b"")
    llm = LLM(smollm2_dir, dtype="float32", enable_lora=True, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(AdapterConfigError, match="above --max-lora-rank"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=LoRARequest("big", 9, str(broken)))
    # A file that passes the config check but cannot be read fails its request in the worker, not the engine.
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params,
                        lora_request=[LoRARequest("broken", 9, str(broken)), None], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [] and len(outs[1].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(broken))
    plain = LLM(smollm2_dir, dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=adapters[0])
