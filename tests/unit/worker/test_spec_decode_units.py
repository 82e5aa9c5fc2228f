"""Speculative decoding pieces on their own: config parsing, the n-gram proposer, the rejection
sampler's exactness (chi-square against the target distribution) and the scheduler's draft
accounting (slots allocated, rejected ones rolled back, every block free at the end)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from support.schedulers import scheduler_for
from support.spec_stats import goodness_of_fit

from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig, may_speculate
from services.engine.request import Request
from services.worker.spec_decode.ngram_proposer import NgramProposer, longest_suffix_match
from services.worker.spec_decode.rejection_sampler import rejection_sample

# ------------------------------------------------------------------------------ config


def test_parse_ngram_defaults_and_json() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 3, 4, 4)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert (c.method, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 5)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 0}).disable_by_batch_size \
        == 0
    assert SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ("{not json", "JSON"),
])
def test_parse_errors_name_the_field(value, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


@pytest.mark.parametrize(("args", "flag"), [({"pipeline_parallel_size": 2}, "pipeline_parallel_size")])
def test_refused_combinations_name_the_flag(args: dict, flag: str) -> None:
    spec = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=flag):
        VllmConfig.from_engine_args(model=".", speculative_config=spec, **args)
    with pytest.raises(ValueError, match=flag):
        VllmConfig.from_engine_args(model=".", speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                    **args)


@pytest.mark.parametrize("spec", [{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 2}])
def test_both_methods_run_with_tensor_parallelism(spec: dict) -> None:
    """(tests/unit/offline/test_spec_decode_tp.py runs a draft model over two ranks.)"""
    config = VllmConfig.from_engine_args(model=".", speculative_config=spec, tensor_parallel_size=2)
    assert config.speculative_config.method == spec["method"]


def test_async_scheduling_auto_is_on_with_speculation_on_cuda_only() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert VllmConfig.from_engine_args(model=".", speculative_config=spec).resolve_async_scheduling("cuda") is True
    assert VllmConfig.from_engine_args(model=".", speculative_config=spec).resolve_async_scheduling("cpu") is False
    explicit = VllmConfig.from_engine_args(model=".", speculative_config=spec, async_scheduling=True)
    assert explicit.scheduler_config.async_scheduling is True


def test_may_speculate_excludes_history_dependent_processing() -> None:
    assert may_speculate(pb.SamplingParams(temperature=1.0), 0)
    assert may_speculate(pb.SamplingParams(logprobs=3, logit_bias={5: 1.0}), 0)
    assert not may_speculate(pb.SamplingParams(repetition_penalty=1.2), 0)
    assert not may_speculate(pb.SamplingParams(presence_penalty=0.5), 0)
    assert not may_speculate(pb.SamplingParams(seed=3), 0)
    assert not may_speculate(pb.SamplingParams(min_tokens=4), 3)
    assert may_speculate(pb.SamplingParams(min_tokens=4), 4)


# ------------------------------------------------------------------------------ n-gram proposer


def _brute_force(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    best_end, best_n = -1, 0
    for end in range(len(tokens) - 1):
        n = 0
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[len(tokens) - 1 - n]:
            n += 1
        if n >= min_n and n >= best_n:
            best_end, best_n = end, n
    return best_end, best_n


def test_longest_suffix_match_examples() -> None:
    t = np.array([1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4])
    assert longest_suffix_match(t, 1, 3) == (7, 2)  # "3 4" at 2..3 and 6..7: the latest wins
    assert longest_suffix_match(t, 3, 3) == (-1, 0)
    assert NgramProposer(3, 1, 3).propose_one(t) == [7, 3, 4]  # latest "3 4" before the end: at 6..7
    assert NgramProposer(2, 1, 3).propose_one(np.array([5])) == []
    assert NgramProposer(4, 2, 2).propose_one(np.array([1, 2, 1, 2])) == [1, 2]


def test_longest_suffix_match_agrees_with_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=rng.integers(1, 40))
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 4))
        assert longest_suffix_match(tokens, lo, hi) == _brute_force(tokens.tolist(), lo, hi)


# ------------------------------------------------------------------------------ rejection sampler


def test_greedy_accepts_while_draft_is_argmax() -> None:
    # Request 0: drafts [5, 6, 7] vs argmax [5, 6, 8, 9] -> accepts 2, then 8.
    # Request 1: drafts [1] vs argmax [1, 4] -> accepts 1, bonus 4. Request 2: drafts [3] vs [2, 0].
    argmax = torch.tensor([5, 6, 8, 9, 1, 4, 2, 0])
    drafts = torch.tensor([[5, 6, 7], [1, 0, 0], [3, 0, 0]])
    tokens, n = rejection_sample(argmax, None, np.array([3, 1, 1]), drafts, torch.tensor([True, True, True]))
    assert n.tolist() == [3, 2, 1]
    assert tokens.tolist() == [[5, 6, 8, -1], [1, 4, -1, -1], [2, -1, -1, -1]]


def _target(vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(vocab, generator=gen), dim=0)


@pytest.mark.parametrize("draft", ["point", "distribution"])
def test_random_rows_emit_exactly_the_target_distribution(draft: str) -> None:
    """Many copies of one request, two drafts each: the first emitted token must follow p1 and
    the second (given the first) p2, whether drafts are point masses or drawn from a draft q."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    vocab, reps = 6, 20000
    p1, p2 = _target(vocab, gen), _target(vocab, gen)
    if draft == "point":
        drafts = torch.tensor([[2, 3]]).repeat(reps, 1)  # a fixed guess, as an n-gram's
        draft_probs = None
    else:
        q = torch.stack([_target(vocab, gen), _target(vocab, gen)])  # [2, V]
        drafts = torch.stack([torch.multinomial(q[j], reps, replacement=True, generator=gen) for j in range(2)], 1)
        draft_probs = q[None].repeat(reps, 1, 1)
    # The second position's target is p2 whatever the first token was (a model that ignores it),
    # and the bonus position's target p3 = p1: enough to test the scheme's bookkeeping exactly.
    target = torch.stack([p1, p2, p1]).repeat(reps, 1)
    tokens, n = rejection_sample(target.argmax(-1), target, np.full(reps, 2), drafts,
                                 torch.zeros(reps, dtype=torch.bool), draft_probs)
    first = Counter(tokens[:, 0].tolist())
    second = Counter(tokens[n >= 2, 1].tolist())
    assert goodness_of_fit(first, dict(enumerate(p1.tolist()))) > 0.001
    assert goodness_of_fit(second, dict(enumerate(p2.tolist()))) > 0.001
    assert 0 < (n == 3).float().mean() < 1  # some rounds accept everything, some refuse


# ------------------------------------------------------------------------------ scheduler


def _request(rid: str, prompt_len: int, max_tokens: int = 20) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), pb.SamplingParams(), frozenset({2}), max_tokens=max_tokens)


def _runner_output(so: pb.SchedulerOutput, tokens: dict[str, list[int]], drafts: dict[str, list[int]]):
    out = pb.ModelRunnerOutput(step_id=so.step_id)
    for rid, toks in tokens.items():
        out.request_ids.append(rid)
        out.sampled_token_ids.extend(toks)
        out.num_sampled_tokens.append(len(toks))
        out.spec_token_ids.append(pb.TokenIds(ids=drafts.get(rid, [])))
    return out


def test_scheduler_schedules_drafts_and_rolls_rejected_back() -> None:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    sched = scheduler_for(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      speculative_config=spec)
    req = _request("a", 6)
    sched.add_request(req)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [6]
    sched.update_from_output(so, _runner_output(so, {"a": [100]}, {"a": [101, 102, 103]}))
    assert req.spec_token_ids == [101, 102, 103] and req.num_computed_tokens == 6
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [4]  # the new token + 3 drafts
    assert list(so.cached_requests[0].spec_token_ids) == [101, 102, 103]
    assert len(sched.kv_cache_manager.block_ids("a")) == 3  # 11 tokens of slots -> 3 blocks of 4
    # Drafts 101 accepted, 102 refused (recovered token 200): 2 of 4 positions kept.
    outs = sched.update_from_output(so, _runner_output(so, {"a": [101, 200]}, {"a": [7]}))
    assert list(outs[0].new_token_ids) == [101, 200]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert req.spec_token_ids == [7]
    stats = sched.stats()
    assert (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]) == (3, 1)
    assert stats["spec_decode_accepted_per_pos"] == [1, 0, 0]
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [2]  # token 200 (its slot recomputed) + draft 7
    sched.abort_requests(["a"])
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 19


def test_drafts_stop_at_max_tokens_and_a_stop_token_ends_the_list() -> None:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    sched = scheduler_for(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      speculative_config=spec)
    req = _request("a", 5, max_tokens=3)
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, _runner_output(so, {"a": [50]}, {"a": [51, 52, 53, 54]}))
    so = sched.schedule()
    assert list(so.cached_requests[0].spec_token_ids) == [51]  # 2 outputs left: one draft + the bonus
    outs = sched.update_from_output(so, _runner_output(so, {"a": [51, 2]}, {}))
    assert list(outs[0].new_token_ids) == [51, 2] and outs[0].finish_reason == "stop"
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 19


def test_disable_by_batch_size_drops_drafts() -> None:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    sched = scheduler_for(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      speculative_config=spec)
    for rid in "ab":
        sched.add_request(_request(rid, 5))
    so = sched.schedule()
    assert so.skip_drafts  # two running: the rule holds from the first step
    sched.update_from_output(so, _runner_output(so, {"a": [50], "b": [60]}, {"a": [1, 2], "b": [3, 4]}))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [1, 1]
    assert all(not c.spec_token_ids for c in so.cached_requests)
    assert so.skip_drafts  # and the worker is told not to propose any after this step


# ------------------------------------------------------------------------------ attention


def _reference_attention(q, kv_cache, meta, scale):
    """Each query token at position p attends to positions 0..p of its row, read from the cache."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    for i in range(len(meta.seq_lens_np)):
        for t in range(int(meta.query_start_loc_np[i]), int(meta.query_start_loc_np[i + 1])):
            pos = int(meta.context_lens_np[i]) + t - int(meta.query_start_loc_np[i])
            blocks = meta.block_table[i, :pos // bs + 1].long()
            keys = k_cache[blocks].flatten(0, 1)[:pos + 1].repeat_interleave(group, dim=1)  # [L, H, D]
            values = v_cache[blocks].flatten(0, 1)[:pos + 1].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,lhd->hl", q[t], keys) * scale, dim=-1)
            out[t] = torch.einsum("hl,lhd->hd", weights, values)
    return out


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_short_queries_after_a_context_attend_as_decode_entries(backend_name: str) -> None:
    """Verification rows (k+1 query tokens after a context) go the decode way, token by token,
    next to plain decodes and prefills, and match exact causal attention."""
    from services.worker.attention.base import AttentionMetadata
    from services.worker.attention.selector import get_attention_backend
    from services.worker.attention.torch_backend import SHORT_QUERY_AS_DECODES

    backend = get_attention_backend(backend_name, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    bs, heads, kvh, dim, num_blocks = 4, 4, 2, 8, 40
    # (context, query) per row: a decode, a verification of 5, a prefill chunk after a context,
    # a fresh prompt of 3 (stays a prefill: no context), one of SHORT_QUERY_AS_DECODES after a context.
    rows = [(9, 1), (13, 5), (6, 11), (0, 3), (5, SHORT_QUERY_AS_DECODES)]
    ctx = np.array([c for c, _ in rows])
    qlen = np.array([n for _, n in rows])
    seq = ctx + qlen
    qsl = np.concatenate([[0], np.cumsum(qlen)])
    max_blocks = int(-(-seq.max() // bs))
    perm = torch.randperm(num_blocks - 1, generator=gen)[:len(rows) * max_blocks] + 1
    block_table = perm.view(len(rows), max_blocks).int().numpy()
    positions = np.concatenate([np.arange(c, c + n) for c, n in rows])
    req = np.repeat(np.arange(len(rows)), qlen)
    slots = block_table[req, positions // bs].astype(np.int64) * bs + positions % bs
    meta = AttentionMetadata.from_host(slots, qsl, seq, ctx, block_table, bs, "cpu")
    meta.backend_data = backend.prepare(meta)
    kv_cache = torch.randn(2, num_blocks, bs, kvh, dim, generator=gen)
    t = int(qsl[-1])
    q, k, v = (torch.randn(t, h, dim, generator=gen) for h in (heads, kvh, kvh))
    out = backend.forward(q, k, v, kv_cache, meta, dim ** -0.5)
    plan = meta.backend_data
    assert plan.decode_token_idx.numel() == 1 + 5 + SHORT_QUERY_AS_DECODES
    assert len(plan.prefills) == 2
    torch.testing.assert_close(out, _reference_attention(q, kv_cache, meta, dim ** -0.5), atol=1e-5, rtol=1e-4)
