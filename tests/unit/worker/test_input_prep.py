"""ModelRunner._prepare_inputs on a mixed ragged batch, and the torch attention backend
against a naive per-request dense causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.runners import runner_for

from services.common.proto import myvllm_pb2 as pb
from services.worker import model_runner
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.model_runner import MemoryBudgetError, ModelRunner

B = 4          # block size
NUM_BLOCKS = 32


def _sp() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=16, logprobs=-1)


def _new(rid: str, prompt: list[int], blocks: list[int], computed: int, outputs: list[int] = ()) -> pb.NewRequestData:
    return pb.NewRequestData(request_id=rid, prompt_token_ids=prompt, sampling=_sp(), block_ids=blocks,
                             num_computed_tokens=computed, output_token_ids=list(outputs))


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: str) -> ModelRunner:
    r = runner_for(tiny_llama_dir, dtype="float32", seed=0, max_num_seqs=8, max_model_len=64,
                   attention_backend="torch", device="cpu")
    r.init_kv_cache(NUM_BLOCKS, B)
    return r


def _reset(runner: ModelRunner) -> None:
    for rid in list(runner.input_batch.req_id_to_row):
        runner.input_batch.remove(rid)


# Requests of the mixed batch: (id, prompt, outputs, block ids (non-contiguous, unordered), computed, scheduled)
MIXED = [
    # a chunk with prior context: 9 tokens already in the cache (not block aligned), 6 more now
    # (a partial prefill: it must not sample)
    ("chunk", list(range(100, 120)), [], [7, 3, 12, 5, 20], 9, 6),
    # a fresh prefill of its whole 5-token prompt
    ("fresh", list(range(200, 205)), [], [9, 2], 0, 5),
    # decodes: prompt + generated tokens, only the last one is new
    ("dec1", list(range(300, 306)), [311, 312], [4, 11], 7, 1),
    ("dec2", list(range(400, 410)), [411, 412, 413, 414], [30, 1, 17, 8], 13, 1),
]


def _expected(reqs) -> dict[str, np.ndarray]:
    """The flat inputs computed the slow, obvious way (one token at a time)."""
    input_ids, positions, slots, logits_indices, qsl, seq_lens, ctx = [], [], [], [], [0], [], []
    for _rid, prompt, outputs, blocks, computed, n in reqs:
        tokens = prompt + outputs
        for pos in range(computed, computed + n):
            input_ids.append(tokens[pos])
            positions.append(pos)
            slots.append(blocks[pos // B] * B + pos % B)
        qsl.append(qsl[-1] + n)
        seq_lens.append(computed + n)
        ctx.append(computed)
        if computed + n == len(tokens):
            logits_indices.append(qsl[-1] - 1)
    return {k: np.asarray(v) for k, v in dict(input_ids=input_ids, positions=positions, slots=slots,
                                               logits_indices=logits_indices, qsl=qsl, seq_lens=seq_lens,
                                               ctx=ctx).items()}


def _prepare(runner: ModelRunner, reqs):
    _reset(runner)
    so = pb.SchedulerOutput(step_id=1)
    for rid, prompt, outputs, blocks, computed, n in reqs:
        so.new_requests.append(_new(rid, prompt, blocks, computed, outputs))
        so.num_scheduled_tokens.append(n)
    rows, num_scheduled = runner._apply_scheduler_output(so)
    assert num_scheduled.tolist() == list(so.num_scheduled_tokens)
    return rows, runner._prepare_inputs(rows, num_scheduled)


def test_prepare_inputs_mixed_batch(runner: ModelRunner) -> None:
    rows, (input_ids, positions, meta, samples, logits_indices) = _prepare(runner, MIXED)
    exp = _expected(MIXED)
    assert input_ids.tolist() == exp["input_ids"].tolist()
    assert positions.tolist() == exp["positions"].tolist()
    assert meta.slot_mapping.tolist() == exp["slots"].tolist()
    assert logits_indices.tolist() == exp["logits_indices"].tolist() == [10, 11, 12]
    assert samples.tolist() == [False, True, True, True]
    assert meta.num_tokens == 6 + 5 + 1 + 1
    assert meta.query_start_loc.tolist() == exp["qsl"].tolist()
    assert meta.seq_lens.tolist() == exp["seq_lens"].tolist()
    assert meta.context_lens.tolist() == exp["ctx"].tolist()
    assert meta.max_query_len == 6 and meta.max_seq_len == 15
    # Block table rows hold each request's blocks in order (one row per scheduled request).
    for i, (_rid, _p, _o, blocks, computed, n) in enumerate(MIXED):
        nb = -(-(computed + n) // B)
        assert meta.block_table[i, :nb].tolist() == blocks[:nb]
    # Slots of distinct tokens never collide, and none is in the null block.
    assert len(set(meta.slot_mapping.tolist())) == meta.num_tokens
    assert (meta.slot_mapping >= B).all()
    # The persistent batch moved on: computed tokens now include this step's.
    batch = runner.input_batch
    assert batch.num_computed_tokens[rows].tolist() == exp["seq_lens"].tolist()


def test_prepare_inputs_from_deltas(runner: ModelRunner) -> None:
    """A chunked prefill continued through CachedRequestData (only the new block ids)."""
    _reset(runner)
    prompt = list(range(500, 522))  # 22 tokens
    so1 = pb.SchedulerOutput(step_id=1, new_requests=[_new("r", prompt, [13, 6, 25], 0)], num_scheduled_tokens=[10])
    rows, _ = runner._apply_scheduler_output(so1)
    ids1, pos1, meta1, samples1, li1 = runner._prepare_inputs(rows, np.array([10]))
    assert pos1.tolist() == list(range(10)) and ids1.tolist() == prompt[:10]
    assert meta1.slot_mapping.tolist() == [13 * B + p % B if p < 4 else (6 * B + p % B if p < 8 else 25 * B + p % B)
                                           for p in range(10)]
    assert li1.numel() == 0 and samples1.tolist() == [False]
    so2 = pb.SchedulerOutput(step_id=2, cached_requests=[
        pb.CachedRequestData(request_id="r", new_block_ids=[2, 29, 10], num_computed_tokens=10)],
        num_scheduled_tokens=[12])
    rows, _ = runner._apply_scheduler_output(so2)
    ids2, pos2, meta2, samples2, li2 = runner._prepare_inputs(rows, np.array([12]))
    table = [13, 6, 25, 2, 29, 10]
    assert pos2.tolist() == list(range(10, 22))
    assert ids2.tolist() == prompt[10:]
    assert meta2.slot_mapping.tolist() == [table[p // B] * B + p % B for p in range(10, 22)]
    assert meta2.context_lens.tolist() == [10] and meta2.seq_lens.tolist() == [22]
    assert li2.tolist() == [11] and samples2.tolist() == [True]


def test_execute_mixed_batch_samples_only_finished_prefills(runner: ModelRunner) -> None:
    _reset(runner)
    so = pb.SchedulerOutput(step_id=7)
    for rid, prompt, outputs, blocks, _computed, _n in MIXED:
        # From scratch, the chunk request only gets part of its prompt: it must not sample.
        n = 9 if rid == "chunk" else len(prompt) + len(outputs)
        so.new_requests.append(_new(rid, prompt, blocks, 0, outputs))
        so.num_scheduled_tokens.append(n)
    out = runner.execute(so)
    assert out.step_id == 7
    assert list(out.request_ids) == ["fresh", "dec1", "dec2"]
    assert len(out.sampled_token_ids) == 3
    assert all(0 <= t < runner.vocab_size for t in out.sampled_token_ids)
    batch = runner.input_batch
    row = batch.req_id_to_row["dec2"]
    assert batch.num_tokens[row] == 10 + 4 + 1
    assert batch.token_ids[row, 14] == out.sampled_token_ids[2]


# --------------------------------------------------------------------------- attention


def _naive_attention(q, k_all, v_all, ctx: int, scale: float) -> torch.Tensor:
    """Dense causal attention for one request: q [n, H, D], k_all/v_all [ctx+n, KVH, D]."""
    n, num_heads, _ = q.shape
    group = num_heads // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
    v = v_all.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(ctx, ctx + n)[:, None]
    k_pos = torch.arange(ctx + n)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v.double()).float()


BATCHES = {
    "mixed": MIXED,
    "all_decode": [
        ("d1", list(range(300, 306)), [311, 312], [4, 11], 7, 1),
        ("d2", list(range(400, 410)), [411, 412, 413, 414, 415, 416, 417], [30, 1, 17, 8, 22], 16, 1),
        ("d3", [42], [43], [19], 1, 1),
    ],
    "prefills_only": [
        ("p1", list(range(100, 117)), [], [7, 3, 12, 5, 20], 0, 17),
        ("p2", list(range(200, 203)), [], [9], 0, 3),
        ("p3", list(range(300, 320)), [], [14, 2, 27, 6, 11], 10, 8),
        ("p4", list(range(400, 420)), [], [15, 16, 18], 4, 5),
    ],
}


def _backend(name: str):
    if name == "torch":
        return TorchAttentionBackend()
    from services.worker.attention.cpu_backend import CpuAttentionBackend
    try:
        return CpuAttentionBackend()
    except RuntimeError as e:  # no C compiler on this machine
        pytest.skip(f"cpu attention backend unavailable: {e}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_attention_backend_matches_naive_attention(runner: ModelRunner, name: str, backend: str) -> None:
    """The torch reference (and the cpu decode kernel) against dense per-request attention."""
    reqs = BATCHES[name]
    attn = _backend(backend)
    _rows, (_ids, _pos, meta, _s, _li) = _prepare(runner, reqs)
    meta.backend_data = attn.prepare(meta)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    scale = head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    # Garbage everywhere (stale KV of other requests): attention must read only its own slots.
    # (Finite: the engine zero-fills its cache, and masked-out NaNs would still poison SDPA.)
    kv_cache = 1e3 * torch.randn(2, NUM_BLOCKS, B, num_kv_heads, head_dim, generator=gen)
    T = meta.num_tokens
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    # Context already in the cache (earlier chunks / decoded tokens) at its paged slots.
    full_k, full_v = [], []
    start = 0
    for _rid, _p, _o, blocks, computed, n in reqs:
        ck = torch.randn(computed, num_kv_heads, head_dim, generator=gen)
        cv = torch.randn(computed, num_kv_heads, head_dim, generator=gen)
        for pos in range(computed):
            kv_cache[0, blocks[pos // B], pos % B] = ck[pos]
            kv_cache[1, blocks[pos // B], pos % B] = cv[pos]
        full_k.append(torch.cat([ck, k[start:start + n]]))
        full_v.append(torch.cat([cv, v[start:start + n]]))
        start += n
    out = attn.forward(q, k, v, kv_cache, meta, scale)
    assert out.shape == (T, num_heads, head_dim)
    assert torch.isfinite(out).all()
    start = 0
    for i, (_rid, _p, _o, blocks, computed, n) in enumerate(reqs):
        ref = _naive_attention(q[start:start + n], full_k[i], full_v[i], computed, scale)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-4)
        # This step's K/V landed in the cache at the slots the scheduler chose.
        for j in range(n):
            pos = computed + j
            assert torch.equal(kv_cache[0, blocks[pos // B], pos % B], k[start + j])
            assert torch.equal(kv_cache[1, blocks[pos // B], pos % B], v[start + j])
        start += n


def test_max_num_seqs_is_bounded_by_the_memory_its_batch_state_needs(runner: ModelRunner, monkeypatch) -> None:
    """max_num_seqs sizes the persistent batch and the sampler's vocab-wide penalty rows: a value
    whose state cannot fit next to the weights is refused before anything is allocated."""
    per_row = runner.batch_state_bytes(1)
    assert per_row >= 4 * runner.max_model_len + 5 * runner.vocab_size
    assert runner.batch_state_bytes(10) == 10 * per_row
    assert runner.batch_state_bytes(1, block_size=16) < per_row  # fewer block-table entries
    monkeypatch.setattr(model_runner, "_available_ram_bytes", lambda: 100 * per_row)
    with pytest.raises(MemoryBudgetError, match=r"max_num_seqs=1000 needs \d+ bytes of batch state"):
        runner.set_max_num_seqs(1000)
    assert runner.max_num_seqs == 8  # unchanged
    runner.set_max_num_seqs(16)  # within the budget
    assert runner.max_num_seqs == 16
    runner.set_max_num_seqs(8)
