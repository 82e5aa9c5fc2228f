"""Mixture-of-experts layers in the whole-step C kernel (models/c_step/packed_step.c): routing and
the experts' kernel (cpu/moe_share.h) inside the step's OpenMP region, against the eager forward
on tiny random Qwen3-MoE (renormalised top-k, a dense layer between two MoE ones, routing weights
in the model's dtype) and Mixtral (fp32 routing weights, an expert width of 48: padded blocks)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from support.packed_step_cases import packed_step_or_skip, step_meta
from support.runners import runner_for

from services.worker.attention.base import forward_context
from services.worker.model_runner import ModelRunner
from services.worker.models.c_step.decode_step import PackedStep, load_packed_library
from services.worker.models.moe import SparseMoeBlock

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")

BLOCK = 16
NUM_BLOCKS = 12 * 40 + 1  # room for 40 requests of up to 12 blocks


def _forward(runner: ModelRunner, ids: torch.Tensor, ctx: np.ndarray, num_new: np.ndarray, logits: bool = True):
    """The final hidden states and (`logits`) every token's logits."""
    meta = step_meta(runner, ctx, num_new)
    pos = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)]))
    with torch.inference_mode(), forward_context(runner.attn_backend, meta):
        hidden = runner.model(ids, pos)
        return hidden, runner.model.compute_logits(hidden) if logits else None


def _eager_with_router_ties(runner: ModelRunner, ids: torch.Tensor, ctx: np.ndarray, num_new: np.ndarray):
    """The eager forward, and which rows its routing leaves to torch's choice: a token whose
    router probabilities tie exactly at the k-th place in some layer (bf16 logits do, now and
    then), where torch's CPU topk picks either expert and the step the lower one, and every later
    token of its request (they attend to its K/V of the next layers); and how many tied."""
    blocks = runner.model.moe_blocks()
    tied = torch.zeros(int(num_new.sum()), dtype=torch.bool)

    def recording(block: SparseMoeBlock):
        forward = block.gate.forward

        def record(x: torch.Tensor) -> torch.Tensor:
            logits = forward(x)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).sort(dim=-1, descending=True).values
            tied.logical_or_(probs[:, block.top_k - 1] == probs[:, block.top_k])
            return logits
        return record

    for block in blocks:
        block.gate.forward = recording(block)
    try:
        hidden, logits = _forward(runner, ids, ctx, num_new)
    finally:
        for block in blocks:
            del block.gate.forward
    num_tied = int(tied.sum())
    starts = np.concatenate([[0], np.cumsum(num_new)])
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        first = tied[lo:hi].nonzero()
        if len(first):
            tied[lo + int(first[0]):hi] = True
    return hidden, logits, tied, num_tied


# (cached tokens, new tokens) per request: decodes of 1, 5 and 40 requests, then prefill chunks
# alone and among decodes (first and later chunks; one shorter than a tile; one of 150 tokens,
# whose experts' groups span more than one chunk of rows).
CASES = [
    (np.array([9]), np.array([1])),
    (np.array([5, 28, 51, 74, 97]), np.ones(5, np.int64)),
    (np.array([5 + (23 * i) % 180 for i in range(40)]), np.ones(40, np.int64)),
    (np.array([0, 20, 40]), np.array([37, 16, 5])),
    (np.array([30, 7, 100, 64, 5, 0, 50, 9, 120, 3]), np.array([1, 1, 1, 1, 1, 1, 1, 1, 33, 70])),
    (np.array([0]), np.array([150])),
]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_packed_step_runs_moe_layers_as_the_eager_forward(tiny_model_dir, arch: str, dtype: str,
                                                              renormalize: bool) -> None:
    """After eager prefills, one step through the packed step and through the eager layers: the
    same final hidden states and greedy tokens. `renormalize` sets every block's routing (and the
    step, rebuilt from the blocks, follows it)."""
    runner = runner_for(tiny_model_dir(arch), dtype=dtype, seed=0)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    packed_step_or_skip(runner)
    blocks = [layer.mlp for layer in runner.model._stage() if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(block.experts.packed for block in blocks)
    for block in blocks:
        block.renormalize = renormalize
    step = runner.model.packed_step = PackedStep(runner.model, load_packed_library())
    assert runner.model.decode_step is None  # decode_step.c has no MoE layers: every step is the packed one's
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    calls: list[int] = []
    original = step.forward
    step.forward = lambda *a: calls.append(1) or original(*a)
    for ctx, num_new in CASES:
        setup = np.maximum(ctx, 1)  # the cached tokens (a placeholder where none: the step overwrites it)
        runner.model.packed_step = None
        _forward(runner, torch.randint(0, vocab, (int(setup.sum()),), generator=gen), np.zeros(len(ctx), np.int64),
                 setup, logits=False)
        runner.model.packed_step = step
        ids = torch.randint(0, vocab, (int(num_new.sum()),), generator=gen)
        before = len(calls)
        got_hidden, got_logits = _forward(runner, ids, ctx, num_new)
        assert len(calls) == before + 1
        runner.model.packed_step = None
        want_hidden, want_logits, tied, num_tied = _eager_with_router_ties(runner, ids, ctx, num_new)
        runner.model.packed_step = step
        assert num_tied <= max(1, len(tied) // 20) and (dtype == "bfloat16" or not num_tied)
        got_hidden, want_hidden, got_logits, want_logits = (t[~tied] for t in (got_hidden, want_hidden, got_logits,
                                                                               want_logits))
        scale = float(want_hidden.float().abs().max())
        if dtype == "float32":  # both sum in fp32, in their own orders
            torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5 * scale)
        else:  # bf16: another order of sums may flip roundings, a few bf16 steps at most
            torch.testing.assert_close(got_hidden.float(), want_hidden.float(), rtol=0.05, atol=0.02 * scale)
        # The same greedy token wherever the top two logits are further apart than the two
        # sides' largest difference could move them (bf16 steps can swap near-ties).
        top2 = want_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * float((got_logits - want_logits).abs().max())
        assert decided.float().mean() > 0.5
        assert torch.equal(got_logits.argmax(-1)[decided], want_logits.argmax(-1)[decided])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_moe_model_gets_the_packed_step(tiny_model_dir, arch: str) -> None:
    """Routed experts on one rank with no shared expert: the packed step takes the model's steps
    (every one: the small decode step has no MoE layers)."""
    runner = runner_for(tiny_model_dir(arch), dtype="float32", seed=0)
    step = packed_step_or_skip(runner)
    assert runner.model.decode_step is None
    assert step._model.num_experts == 8 and step._model.top_k == 2
    assert all(block.router_weight is not None for block in runner.model.moe_blocks())


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_moe_layers_the_step_does_not_run_keep_the_eager_path(tiny_model_dir, arch: str) -> None:
    """A shared expert (Qwen2-MoE), whole-projection q/k norms and clipped q/k/v (OLMoE): no C step."""
    runner = runner_for(tiny_model_dir(arch), dtype="float32", seed=0)
    assert runner.model.packed_step is None and runner.model.decode_step is None


def test_a_block_the_step_cannot_run_keeps_it_off(tiny_model_dir) -> None:
    """Experts left unpacked, or on other ranks: `supports` says no."""
    runner = runner_for(tiny_model_dir("qwen3_moe"), dtype="float32", seed=0)
    packed_step_or_skip(runner)
    lib = load_packed_library()
    block = runner.model.moe_blocks()[0]
    assert PackedStep.supports(runner.model, lib)
    block.num_local_experts = 4
    assert not PackedStep.supports(runner.model, lib)
    block.num_local_experts = block.num_experts
    block.experts.packed = False
    assert not PackedStep.supports(runner.model, lib)
