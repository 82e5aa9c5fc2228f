"""THE acceptance test: greedy token ids identical to HF transformers (fp32).

For each model (SmolLM2 and the tiny Qwen2 / Qwen3 checkpoints), 16 prompts of 1 to 600 tokens
(random ids from a fixed seed; lengths 1 and 600 included; several of them sharing a 200-token
prefix) are submitted together and generate 64 tokens each with ignore_eos, in each configuration:

- defaults;
- chunked: max_num_batched_tokens=32, chunked prefill mixed with decodes in the same steps;
- preemption: a KV pool that holds every request alone (with its 64 outputs) but only ~3/4 of
  them together;
- prefix: one request first computes the shared 200-token prefix, then the 16 prompts hit it;
- compiled (tiny models only: compiling SmolLM2's 30 layers takes minutes): the forward through
  torch.compile (`compile_model=True`), with the chunked configuration's mixed steps.

The HF reference is computed once per (model, prompt) and shared by the configurations.
SmolLM2 is ~100x the tiny models' cost on CPU, so most of its prompts are short (the 1- and
600-token ones and the 200-token shared prefix still included) to keep this file quick.
"""

from __future__ import annotations

import random

import pytest
from support.hf_reference import hf_greedy, hf_greedy_batched

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM

MAX_NEW_TOKENS = 64
BLOCK_SIZE = 16
NUM_PROMPTS = 16
PREFIX_LEN = 200
VOCAB_LOW, VOCAB_HIGH = 3, 49152  # keep clear of the special ids at the bottom of the vocab

MODELS = ["smollm2", "tiny_qwen2", "tiny_qwen3"]
CONFIGS = ["defaults", "chunked", "preemption", "prefix"]
CASES = [(m, c) for c in CONFIGS for m in MODELS] + [("tiny_qwen3", "compiled")]


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def _prompts(model: str) -> tuple[list[list[int]], list[int]]:
    """The model's 16 prompts, and the indices of those that share the 200-token prefix.

    The 600-token prompt comes first: under FCFS preemption it is the oldest request, so the
    victims are the cheaper later ones."""
    rng = random.Random(1234)
    if model == "smollm2":
        num_shared, max_suffix, max_other = 4, 40, 48
    else:
        num_shared, max_suffix, max_other = 6, 400, 599
    prefix = _random_prompt(rng, PREFIX_LEN)
    shared = [prefix + _random_prompt(rng, rng.randint(1, max_suffix)) for _ in range(num_shared - 1)]
    shared.append(list(prefix))  # the bare prefix too: its last block must still be computed
    others = [_random_prompt(rng, rng.randint(2, max_other)) for _ in range(NUM_PROMPTS - 2 - num_shared)]
    prompts = [_random_prompt(rng, 600), _random_prompt(rng, 1)]
    shared_idx = []
    # Interleave the shared-prefix prompts with the others.
    for i in range(max(len(shared), len(others))):
        if i < len(shared):
            shared_idx.append(len(prompts))
            prompts.append(shared[i])
        if i < len(others):
            prompts.append(others[i])
    return prompts, shared_idx


def _num_blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def _engine_args(config: str, prompts: list[list[int]], num_shared: int) -> dict:
    if config == "chunked":
        return {"max_num_batched_tokens": 32}
    if config == "compiled":
        return {"max_num_batched_tokens": 32, "compile_model": True}
    if config == "preemption":
        need = [_num_blocks(len(p) + MAX_NEW_TOKENS) for p in prompts]
        # Blocks all requests hold at the end when they run together (the shared prefix once).
        total = sum(need) - (num_shared - 1) * (PREFIX_LEN // BLOCK_SIZE)
        # Every request fits alone with all its outputs, but only ~3/4 of them together: most
        # run concurrently (few steps), and the last ones admitted get preempted as they grow.
        usable = max(max(need) + 1, 3 * total // 4)
        assert usable < total
        return {"num_gpu_blocks_override": usable + 1}  # + the null block
    return {}


@pytest.fixture(scope="module")
def hf_cache() -> dict:
    return {}


def _reference(cache: dict, model_dir: str, prompts: list[list[int]], batched: bool) -> list[list[int]]:
    """hf_greedy with a per-(model, prompt) cache: each prompt is run through HF once per module."""
    missing = [p for p in prompts if (model_dir, tuple(p)) not in cache]
    unique = list({tuple(p): p for p in missing}.values())
    if unique:
        # SmolLM2 is ~100x a tiny model's cost: its reference runs batched (by length). The tiny
        # random models keep the one-at-a-time loop: their flat logits have near-ties that
        # padding's different rounding could flip.
        reference = (hf_greedy_batched(model_dir, unique, MAX_NEW_TOKENS) if batched
                     else hf_greedy(model_dir, unique, MAX_NEW_TOKENS, ignore_eos=True))
        for p, out in zip(unique, reference, strict=True):
            assert len(out) == MAX_NEW_TOKENS
            cache[(model_dir, tuple(p))] = out
    return [cache[(model_dir, tuple(p))] for p in prompts]


def _diff(got: list[list[int]], expected: list[list[int]], prompts: list[list[int]]) -> list[str]:
    mismatches = []
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g != e:
            first = next((j for j, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), min(len(g), len(e)))
            mismatches.append(f"prompt {i} (len {len(prompts[i])}): first diff at token {first} "
                              f"(engine {g[first:first + 4]} vs HF {e[first:first + 4]}), engine len {len(g)}")
    return mismatches


@pytest.mark.parametrize(("model", "config"), CASES)
def test_greedy_matches_hf(request: pytest.FixtureRequest, hf_cache: dict, model: str, config: str) -> None:
    model_dir = request.getfixturevalue(f"{model}_dir")
    prompts, shared_idx = _prompts(model)
    lengths = [len(p) for p in prompts]
    assert len(prompts) >= 16 and min(lengths) == 1 and max(lengths) == 600
    assert all(prompts[i][:PREFIX_LEN] == prompts[shared_idx[0]][:PREFIX_LEN] for i in shared_idx)

    expected = _reference(hf_cache, model_dir, prompts, batched=model == "smollm2")

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    # fp32 explicitly: the default dtype ("auto") is bf16 on CPUs with bf16 instructions.
    llm = LLM(model_dir, seed=0, dtype="float32", block_size=BLOCK_SIZE,
              **_engine_args(config, prompts, len(shared_idx)))
    try:
        if config == "compiled":
            assert llm.worker.runner.compiled is not None and llm.worker.runner.compiled.enabled
        if config == "prefix":
            # One request computes the shared prefix first; its blocks stay cached once it is done.
            warm_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            (warm,) = llm.generate({"prompt_token_ids": prompts[shared_idx[0]]}, warm_params, use_tqdm=False)
            assert list(warm.outputs[0].token_ids) == expected[shared_idx[0]][:1]
            hits_before = llm.stats()["prefix_cache_hits"]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.close()

    assert [o.prompt_token_ids for o in outputs] == prompts
    mismatches = _diff([list(o.outputs[0].token_ids) for o in outputs], expected, prompts)
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} prompts differ from HF:\n" + "\n".join(mismatches)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)

    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    if config == "preemption":
        assert stats["num_preemptions"] > 0, stats
    else:
        assert stats["num_preemptions"] == 0, stats
    if config == "prefix":
        assert stats["prefix_cache_hits"] > 0, stats
        # Every shared-prefix prompt found at least the prefix's 12 full blocks.
        full_prefix_blocks = PREFIX_LEN // BLOCK_SIZE
        assert stats["prefix_cache_hits"] - hits_before >= len(shared_idx) * full_prefix_blocks * BLOCK_SIZE, stats
