"""The whole-step decode kernel (services/worker/cpu/decode_step.c) against the eager forward."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from services.worker.attention.base import AttentionMetadata, forward_context
from services.worker.cpu.decode_step import CpuDecodeStep
from services.worker.model_runner import ModelRunner

# Only a machine without a C compiler may skip: a build failure where one exists is a failure.
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")

BLOCK = 16


def _meta(runner: ModelRunner, ctx: np.ndarray, num_new: np.ndarray) -> AttentionMetadata:
    """Request i owns blocks 1 + 12i .. 12i + 12 and brings num_new[i] tokens after ctx[i]."""
    tables = np.arange(1, 1 + 12 * len(ctx), dtype=np.int32).reshape(len(ctx), 12)
    rows = np.repeat(np.arange(len(ctx)), num_new)
    pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)])
    slots = tables[rows, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    qsl = np.concatenate([[0], np.cumsum(num_new)])
    meta = AttentionMetadata.from_host(slots, qsl, ctx + num_new, ctx, tables, BLOCK, "cpu")
    meta.backend_data = runner.attn_backend.prepare(meta)
    return meta


def _forward(runner: ModelRunner, ids: torch.Tensor, ctx: np.ndarray, num_new: np.ndarray):
    meta = _meta(runner, ctx, num_new)
    pos = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)]))
    with torch.inference_mode(), forward_context(runner.attn_backend, meta):
        hidden = runner.model(ids, pos)
        return hidden, runner.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_matches_the_eager_forward(tiny_model_dir, arch: str, dtype: str) -> None:
    """After eager prefills of different lengths, one decode token per request through the C
    step and through the eager layers: the same final hidden states, logits and cached K/V
    (llama: tied head; qwen2: q/k/v biases, untied head; qwen3: q/k norms)."""
    runner = ModelRunner(tiny_model_dir(arch), dtype=dtype, seed=0)
    runner.init_kv_cache(128, BLOCK)
    step = runner.model.decode_step
    assert isinstance(step, CpuDecodeStep)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    calls: list[int] = []
    original = step.forward
    step.forward = lambda *a: calls.append(1) or original(*a)
    for rows in sorted({1, 3, step.max_rows}):
        ctx = np.array([5 + 23 * i for i in range(rows)])  # 5 .. 97 cached tokens, ragged blocks
        _forward(runner, torch.randint(0, vocab, (int(ctx.sum()),), generator=gen), np.zeros(rows, np.int64), ctx)
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        one = np.ones(rows, np.int64)
        before = len(calls)
        got_hidden, got_logits = _forward(runner, ids, ctx, one)
        assert len(calls) == before + 1
        caches = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
        runner.model.decode_step = None
        want_hidden, want_logits = _forward(runner, ids, ctx, one)
        runner.model.decode_step = step
        # Both sides sum in fp32 in their own order (this kernel's lanes, oneDNN's blocking, which
        # differs between AVX2, AVX-512 and AMX machines): bounds relative to each tensor's scale,
        # ~10x what was observed (fp32: 5.5e-5 of hidden values up to 30).
        if dtype == "float32":
            for got, want in ((got_hidden, want_hidden), (got_logits, want_logits)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * float(want.abs().max()))
        else:  # bf16: a different summation order may flip roundings, a few bf16 steps at most
            scale = float(want_hidden.float().abs().max())
            torch.testing.assert_close(got_hidden.float(), want_hidden.float(), rtol=0.05, atol=0.02 * scale)
            torch.testing.assert_close(got_logits, want_logits, rtol=0.05, atol=0.05)
        # The same greedy token wherever the top two logits are further apart than the two
        # sides' largest difference could move them (bf16 steps can swap near-ties).
        top2 = want_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * float((got_logits - want_logits).abs().max())
        assert torch.equal(got_logits.argmax(-1)[decided], want_logits.argmax(-1)[decided])
        for got_cache, layer in zip(caches, runner.model.attention_layers(), strict=True):
            # The eager pass rewrote the same slots: each layer's K/V of the new tokens agree.
            want_cache = layer.kv_cache.float()
            tol = (1e-4, 2e-5) if dtype == "float32" else (0.05, 0.02)
            torch.testing.assert_close(got_cache.float(), want_cache, rtol=tol[0],
                                       atol=tol[1] * float(want_cache.abs().max()))


def test_the_step_takes_only_small_all_decode_batches(tiny_model_dir) -> None:
    runner = ModelRunner(tiny_model_dir("llama"), dtype="float32", seed=0)
    runner.init_kv_cache(128, BLOCK)
    step = runner.model.decode_step
    assert step.applies(_meta(runner, np.full(step.max_rows, 3), np.ones(step.max_rows, np.int64)))
    assert not step.applies(_meta(runner, np.full(step.max_rows + 1, 3), np.ones(step.max_rows + 1, np.int64)))
    assert not step.applies(_meta(runner, np.array([3, 0]), np.array([1, 4])))  # a prefill among them
    assert not step.applies(_meta(runner, np.array([3]), np.array([2])))  # two new tokens (drafts)


def test_the_step_is_off_where_its_weight_copy_would_not_fit(tiny_model_dir, monkeypatch) -> None:
    # 2 MB: room for one sequence's batch state, not for the step's copy of the weights (1/10 of it).
    monkeypatch.setattr("services.worker.model_runner._available_ram_bytes", lambda: 2 << 20)
    runner = ModelRunner(tiny_model_dir("llama"), dtype="float32", seed=0, max_num_seqs=1)
    assert runner.model.decode_step is None
    monkeypatch.undo()
    monkeypatch.setenv("MYVLLM_CPU_DECODE_STEP", "0")
    assert ModelRunner(tiny_model_dir("llama"), dtype="float32", seed=0).model.decode_step is None
    monkeypatch.delenv("MYVLLM_CPU_DECODE_STEP")
    assert ModelRunner(tiny_model_dir("llama"), dtype="float32", seed=0).model.decode_step is not None


def test_greedy_tokens_are_the_same_with_the_step_on_and_off(smollm2_dir, monkeypatch) -> None:
    """SmolLM2 in fp32 through the offline LLM: batches of 1-3 decoding requests run the step;
    greedy output is token-identical to the eager forward's."""
    from services.common.sampling_params import SamplingParams
    from services.sdk import LLM

    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(on: bool) -> list[list[int]]:
        monkeypatch.setenv("MYVLLM_CPU_DECODE_STEP", "1" if on else "0")
        llm = LLM(smollm2_dir, dtype="float32", seed=0)
        assert (llm.worker.runner.model.decode_step is not None) == on
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
        return out

    assert run(True) == run(False)
