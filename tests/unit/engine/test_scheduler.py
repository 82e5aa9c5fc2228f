"""The Scheduler driven directly with hand-made ModelRunnerOutputs (no model).

`FakeWorker` plays the worker's side of the incremental protocol: it keeps per-request state
only from what SchedulerOutputs tell it (full NewRequestData once, CachedRequestData deltas
after, finished ids to drop), so a missing or wrong delta shows up as a mismatch with the
scheduler's own block tables.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from support.schedulers import scheduler_for

from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler

EOS = 2
BS = 4  # block size
# Distinct token ranges per request unless a test asks otherwise: no accidental prefix-cache hits.
_first_tokens = itertools.count(1000, 1000)


def make_request(rid: str, prompt_len: int, max_tokens: int = 100, *, priority: int = 0,
                 arrival_time: float | None = None, first_token: int | None = None, **sampling) -> Request:
    sampling.setdefault("logprobs", -1)
    if first_token is None:
        first_token = next(_first_tokens)
    sp = pb.SamplingParams(max_tokens=max_tokens, **sampling)
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(rid, prompt, sp, frozenset({EOS}), max_tokens=max_tokens, priority=priority,
                   arrival_time=arrival_time)


def make_scheduler(num_blocks: int = 200, budget: int = 1000, max_num_seqs: int = 64, max_model_len: int = 512,
                   policy: str = "fcfs", block_size: int = BS) -> Scheduler:
    return scheduler_for(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_model_len, policy=policy)


class FakeWorker:
    """Mirrors the worker's persistent batch from SchedulerOutputs alone and samples tokens."""

    def __init__(self, sched: Scheduler, sample: Callable[[str, int], int] | None = None) -> None:
        self.sched = sched
        self.sample = sample or (lambda rid, n: 100 + n)  # never EOS by default
        self.state: dict[str, dict] = {}
        self.history: list[pb.SchedulerOutput] = []
        # What the worker's KV cache holds: block id → the token id whose K/V sits in each slot.
        self.kv: dict[int, list[int | None]] = {}

    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput:
        self.history.append(so)
        for rid in so.finished_request_ids:
            assert rid in self.state, f"told to drop {rid}, which the worker never had"
            del self.state[rid]
        items = list(so.new_requests) + list(so.cached_requests)
        assert len(items) == len(so.num_scheduled_tokens)
        assert len({i.request_id for i in items}) == len(items), "a request scheduled twice in one step"
        assert sum(so.num_scheduled_tokens) <= self.sched.max_num_batched_tokens
        assert len(items) <= self.sched.max_num_seqs
        out = pb.ModelRunnerOutput(step_id=so.step_id)
        hits: list[pb.NewRequestData] = []
        for item, n in zip(items, so.num_scheduled_tokens, strict=True):
            assert n > 0
            if isinstance(item, pb.NewRequestData):
                assert item.request_id not in self.state, f"{item.request_id} sent in full twice"
                st = self.state[item.request_id] = {
                    "tokens": list(item.prompt_token_ids) + list(item.output_token_ids),
                    "blocks": list(item.block_ids), "computed": item.num_computed_tokens}
                if item.num_computed_tokens:
                    hits.append(item)
            else:
                st = self.state[item.request_id]
                st["blocks"] += list(item.new_block_ids)
                assert item.num_computed_tokens == st["computed"], "worker and scheduler disagree"
            rid = item.request_id
            bs = self.sched.block_size
            for pos in range(st["computed"], st["computed"] + n):
                self.kv.setdefault(st["blocks"][pos // bs], [None] * bs)[pos % bs] = st["tokens"][pos]
            st["computed"] += n
            assert st["computed"] <= len(st["tokens"])
            # Every token computed this step has a slot in the worker's block table...
            assert len(st["blocks"]) * self.sched.block_size >= st["computed"]
            assert 0 not in st["blocks"]
            # ...which is exactly the scheduler's.
            assert st["blocks"] == self.sched.kv_cache_manager.block_ids(rid)
            if st["computed"] == len(st["tokens"]):
                tok = self.sample(rid, len(st["tokens"]) - self.sched.requests[rid].num_prompt_tokens)
                st["tokens"].append(tok)
                out.request_ids.append(rid)
                out.sampled_token_ids.append(tok)
        # Prefix-cache hits: once this step's K/V is stored (the worker stores every token's K/V
        # before any attention reads), the blocks handed over hold exactly the hit tokens' K/V.
        bs = self.sched.block_size
        for item in hits:
            st = self.state[item.request_id]
            for pos in range(item.num_computed_tokens):
                block = st["blocks"][pos // bs]
                assert self.kv.get(block, [None] * bs)[pos % bs] == st["tokens"][pos], \
                    f"{item.request_id}: hit on block {block} with wrong KV at position {pos}"
        # Every block registered in the prefix cache now holds a full block of written K/V.
        for block in self.sched.kv_cache_manager.block_pool.cached_blocks.values():
            assert None not in self.kv.get(block.block_id, [None]), f"cached block {block.block_id} not written"
        return out


def step(sched: Scheduler, worker: FakeWorker) -> tuple[pb.SchedulerOutput, list[pb.RequestOutput]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, worker.execute(so))


def scheduled(so: pb.SchedulerOutput) -> dict[str, int]:
    items = list(so.new_requests) + list(so.cached_requests)
    return {i.request_id: n for i, n in zip(items, so.num_scheduled_tokens, strict=True)}


def run_until_done(sched: Scheduler, worker: FakeWorker, max_steps: int = 1000) -> dict[str, pb.RequestOutput]:
    finals: dict[str, pb.RequestOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finals
        so, outs = step(sched, worker)
        assert so.num_scheduled_tokens, "no progress"
        for o in outs:
            if o.finish_reason:
                finals[o.request_id] = o
    raise AssertionError("did not finish")


def assert_all_blocks_free(sched: Scheduler) -> None:
    stats = sched.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert sched.kv_cache_manager.req_to_blocks == {}


# --------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_alone() -> None:
    sched = make_scheduler(budget=32)
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 100, max_tokens=3))
    chunks, sampled_at = [], []
    for i in range(4):
        so, outs = step(sched, worker)
        chunks.append(scheduled(so)["a"])
        if outs:
            sampled_at.append(i)
    assert chunks == [32, 32, 32, 4]
    assert sampled_at == [3]  # partial prefill chunks sample nothing
    so, _ = step(sched, worker)
    assert scheduled(so) == {"a": 1}


@pytest.mark.parametrize("budget,chunks", [(32, [31, 31, 31, 7]), (33, [32, 32, 32, 4])])
def test_chunked_prefill_mixed_with_decode(budget: int, chunks: list[int]) -> None:
    """A running decode gets its 1 token every step; the prefill takes the rest of the budget."""
    sched = make_scheduler(budget=budget)
    worker = FakeWorker(sched)
    sched.add_request(make_request("dec", 5, max_tokens=50))
    so, outs = step(sched, worker)
    assert scheduled(so) == {"dec": 5} and len(outs) == 1
    sched.add_request(make_request("pre", 100, max_tokens=5))
    got = []
    for _ in range(4):
        so, outs = step(sched, worker)
        s = scheduled(so)
        assert s["dec"] == 1
        assert sum(so.num_scheduled_tokens) <= budget
        got.append(s["pre"])
        # The decode is served before the waiting prefill.
        assert "dec" in [o.request_id for o in outs]
    assert got == chunks
    assert sum(got) == 100
    so, _ = step(sched, worker)
    assert scheduled(so) == {"dec": 1, "pre": 1}


def test_chunks_keep_decodes_going_with_several_long_prompts() -> None:
    sched = make_scheduler(budget=16)
    worker = FakeWorker(sched)
    sched.add_request(make_request("d1", 3, max_tokens=100))
    sched.add_request(make_request("d2", 3, max_tokens=100))
    step(sched, worker)
    sched.add_request(make_request("p1", 40, max_tokens=2))
    sched.add_request(make_request("p2", 40, max_tokens=2))
    seen = []
    for _ in range(5):
        so, _ = step(sched, worker)
        s = scheduled(so)
        assert s["d1"] == 1 and s["d2"] == 1
        assert sum(so.num_scheduled_tokens) == 16
        seen.append((s.get("p1", 0), s.get("p2", 0)))
    # p1 is served first (FCFS); p2 starts in the step where p1's last chunk leaves room.
    # p1 decodes once (max_tokens=2) while p2's prefill continues in the same steps.
    assert seen == [(14, 0), (14, 0), (12, 2), (1, 13), (0, 14)]
    so, _ = step(sched, worker)
    assert scheduled(so) == {"d1": 1, "d2": 1, "p2": 11}


def test_budget_smaller_than_decodes() -> None:
    sched = make_scheduler(budget=2)
    worker = FakeWorker(sched)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 1, max_tokens=4))
    so, _ = step(sched, worker)
    assert scheduled(so) == {"r0": 1, "r1": 1}
    so, _ = step(sched, worker)
    assert scheduled(so) == {"r0": 1, "r1": 1}  # running first: r2 must wait
    finals = run_until_done(sched, worker)
    assert set(finals) == {"r0", "r1", "r2"}
    assert_all_blocks_free(sched)


# --------------------------------------------------------------------------- admission


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 4, max_tokens=2))
    sched.add_request(make_request("b", 4, max_tokens=5))
    sched.add_request(make_request("c", 4, max_tokens=2))
    so, _ = step(sched, worker)
    assert set(scheduled(so)) == {"a", "b"}
    assert sched.num_running == 2 and sched.num_waiting == 1
    so, outs = step(sched, worker)  # a finishes at the end of this step
    assert set(scheduled(so)) == {"a", "b"}
    assert [o.request_id for o in outs if o.finish_reason] == ["a"]
    so, _ = step(sched, worker)
    assert scheduled(so) == {"b": 1, "c": 4}
    assert sched.num_running == 2


def test_running_first_then_waiting_in_order() -> None:
    sched = make_scheduler(budget=10)
    worker = FakeWorker(sched)
    sched.add_request(make_request("run", 3, max_tokens=100))
    step(sched, worker)
    sched.add_request(make_request("w1", 20, max_tokens=2))
    sched.add_request(make_request("w2", 3, max_tokens=2))
    so, _ = step(sched, worker)
    assert scheduled(so) == {"run": 1, "w1": 9}
    assert [r.request_id for r in so.new_requests] == ["w1"]
    assert [r.request_id for r in so.cached_requests] == ["run"]
    assert list(so.num_scheduled_tokens) == [9, 1]  # parallel to new_requests then cached_requests
    so, _ = step(sched, worker)
    assert scheduled(so) == {"run": 1, "w1": 9}
    so, _ = step(sched, worker)
    assert scheduled(so) == {"run": 1, "w1": 2, "w2": 3}


def test_waiting_head_blocks_later_requests() -> None:
    """FCFS: a waiting request that does not fit is not overtaken by a smaller one."""
    sched = make_scheduler(num_blocks=8)  # 7 usable
    worker = FakeWorker(sched)
    sched.add_request(make_request("big0", 16, max_tokens=3))   # 4 blocks (+1 when decoding)
    step(sched, worker)
    sched.add_request(make_request("big1", 16, max_tokens=3))   # needs 4, 2 left after big0's decode
    sched.add_request(make_request("small", 2, max_tokens=3))  # would fit
    so, _ = step(sched, worker)
    assert set(scheduled(so)) == {"big0"}
    assert sched.counters.num_preemptions == 0
    finals = run_until_done(sched, worker)
    assert set(finals) == {"big0", "big1", "small"}
    assert_all_blocks_free(sched)


def test_add_request_validation() -> None:
    sched = make_scheduler(num_blocks=5, max_model_len=32)  # 4 usable blocks = 16 tokens
    sched.add_request(make_request("a", 4, max_tokens=12))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 4, max_tokens=1))    # duplicate id
    with pytest.raises(ValueError):
        sched.add_request(make_request("b", 32, max_tokens=1))   # no room for one output token
    with pytest.raises(ValueError):
        sched.add_request(make_request("c", 10, max_tokens=7))   # 17 tokens could never fit the pool
    with pytest.raises(ValueError):
        sched.add_request(make_request("c2", 16, max_tokens=1))
    sched.add_request(make_request("d", 15, max_tokens=1))
    assert sched.num_waiting == 2
    assert set(sched.requests) == {"a", "d"}
    # max_model_len bounds what a request can need: 16 tokens at most, whatever max_tokens says.
    small = make_scheduler(num_blocks=5, max_model_len=16)
    small.add_request(make_request("e", 4, max_tokens=1000))


def test_prefix_hit_in_new_request_data() -> None:
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 10, max_tokens=2, first_token=10))
    run_until_done(sched, worker)
    sched.add_request(make_request("b", 13, max_tokens=2, first_token=10))  # same first 10 tokens (2 full blocks)
    so, _ = step(sched, worker)
    (new,) = so.new_requests
    assert new.num_computed_tokens == 8
    assert scheduled(so) == {"b": 5}
    assert list(new.prompt_token_ids) == list(range(10, 23))
    assert sched.stats()["prefix_cache_hits"] == 8


def test_same_step_siblings_share_blocks() -> None:
    """Two requests with one prompt submitted together: the second hits the first's blocks in
    the same step (they are cached when allocated; the worker writes K/V before attending)."""
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 13, max_tokens=3, first_token=500))
    sched.add_request(make_request("b", 13, max_tokens=3, first_token=500))
    so, outs = step(sched, worker)
    assert [r.num_computed_tokens for r in so.new_requests] == [0, 12]
    assert scheduled(so) == {"a": 13, "b": 1}
    assert len(outs) == 2
    a_ids, b_ids = sched.kv_cache_manager.block_ids("a"), sched.kv_cache_manager.block_ids("b")
    assert a_ids[:3] == b_ids[:3] and a_ids[3] != b_ids[3]
    assert [blk.ref_cnt for blk in sched.kv_cache_manager.req_to_blocks["a"]] == [2, 2, 2, 1]
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


# --------------------------------------------------------------------------- incremental output


def test_incremental_scheduler_output() -> None:
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sp_kwargs = dict(temperature=0.5, top_k=7, seed=3)
    sched.add_request(make_request("a", 6, max_tokens=10, first_token=10, **sp_kwargs))
    so1, _ = step(sched, worker)
    (new,) = so1.new_requests
    assert not so1.cached_requests
    assert new.request_id == "a"
    assert list(new.prompt_token_ids) == list(range(10, 16))
    assert new.sampling.top_k == 7 and new.sampling.seed == 3 and new.sampling.max_tokens == 10
    assert list(new.block_ids) == sched.kv_cache_manager.block_ids("a")[:2]
    assert len(new.block_ids) == 2
    assert new.num_computed_tokens == 0
    assert list(new.output_token_ids) == []
    assert so1.step_id == 1
    # Then only deltas: no new block while tokens 6, 7 fit block 1; one new block id at token 8.
    expect_new_blocks = {7: 0, 8: 0, 9: 1, 10: 0}
    for step_no, num_computed in ((2, 6), (3, 7), (4, 8), (5, 9)):
        so, _ = step(sched, worker)
        assert so.step_id == step_no
        assert not so.new_requests
        (cached,) = so.cached_requests
        assert cached.request_id == "a"
        assert cached.num_computed_tokens == num_computed
        assert len(cached.new_block_ids) == expect_new_blocks[num_computed + 1]
        if cached.new_block_ids:
            assert list(cached.new_block_ids) == sched.kv_cache_manager.block_ids("a")[-1:]
        assert list(so.num_scheduled_tokens) == [1]
        assert not so.finished_request_ids


def test_finished_ids_sent_once() -> None:
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=3))
    so, outs = step(sched, worker)
    assert [o.finish_reason for o in outs] == ["length", ""]
    so, _ = step(sched, worker)
    assert list(so.finished_request_ids) == ["a"]
    so, _ = step(sched, worker)
    assert list(so.finished_request_ids) == []


def test_token_counters_count_as_vllms_stats_logger() -> None:
    """A prompt counts whole once its first token comes out (not per prefill chunk), every
    generated token counts (the stats line's throughputs: services/gateway/stats_log.py)."""
    sched = make_scheduler(budget=8)
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 20, max_tokens=3))
    step(sched, worker)  # a prefill chunk: no token yet
    assert (sched.stats()["prompt_tokens"], sched.stats()["generation_tokens"]) == (0, 0)
    run_until_done(sched, worker)
    sched.add_request(make_request("b", 5, max_tokens=2))
    run_until_done(sched, worker)
    assert (sched.stats()["prompt_tokens"], sched.stats()["generation_tokens"]) == (25, 5)


# --------------------------------------------------------------------------- preemption


def _fill_three(sched: Scheduler, worker: FakeWorker, max_tokens=(16, 16, 16)) -> None:
    """a, b, c with 8-token prompts: exactly 6 blocks after their prefill."""
    for rid, mt in zip("abc", max_tokens, strict=True):
        sched.add_request(make_request(rid, 8, max_tokens=mt, first_token={"a": 10, "b": 30, "c": 50}[rid]))
    so, outs = step(sched, worker)
    assert scheduled(so) == {"a": 8, "b": 8, "c": 8} and len(outs) == 3
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0


def test_fcfs_preempts_last_running() -> None:
    sched = make_scheduler(num_blocks=7)  # 6 usable
    worker = FakeWorker(sched)
    _fill_three(sched, worker, max_tokens=(2, 16, 16))
    c = sched.requests["c"]
    # Every request needs a 3rd block for its 2nd output: c (last running) is the victim.
    so, outs = step(sched, worker)
    assert scheduled(so) == {"a": 1, "b": 1}
    assert list(so.finished_request_ids) == ["c"]  # the worker drops c's state
    assert sched.counters.num_preemptions == 1 and sched.stats()["num_preemptions"] == 1
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert c.timings().num_preemptions == 1  # (its final output reports it: vLLM's request_num_preemptions)
    assert sched.kv_cache_manager.block_ids("c") == []
    assert list(sched.waiting) == [c]
    assert c not in sched.running
    assert [o.request_id for o in outs] == ["a", "b"]
    assert outs[0].finish_reason == "length"  # a is done and frees 3 blocks
    # c comes back in full: prompt + the token it had generated, recomputed from scratch.
    so, outs = step(sched, worker)
    (new,) = so.new_requests
    assert new.request_id == "c"
    assert list(new.prompt_token_ids) == list(range(50, 58))
    assert list(new.output_token_ids) == [100]
    assert new.num_computed_tokens == 0  # its cached blocks were reused by a and b
    assert scheduled(so) == {"b": 1, "c": 9}
    assert list(so.finished_request_ids) == ["a"]
    assert c.status == RequestStatus.RUNNING
    # c's next token continues its sequence.
    assert [o.new_token_ids[0] for o in outs if o.request_id == "c"] == [101]


def test_preempted_request_goes_to_head_of_waiting() -> None:
    sched = make_scheduler(num_blocks=7)
    worker = FakeWorker(sched)
    _fill_three(sched, worker)
    sched.add_request(make_request("late", 2, max_tokens=2))
    step(sched, worker)
    assert [r.request_id for r in sched.waiting] == ["c", "late"]


def test_several_preemptions_in_one_step_keep_fcfs_order() -> None:
    sched = make_scheduler(num_blocks=7)
    worker = FakeWorker(sched)
    _fill_three(sched, worker)  # a, b, c hold 2 full blocks each; the pool is empty
    a = sched.requests["a"]
    # Give a 4 more uncomputed tokens so it needs 2 new blocks in one step: c (last) is
    # preempted first and frees 2, then b needs a block and, now last, preempts itself.
    for tok in (200, 201, 202, 203):
        a.append_output_token(tok)
    worker.state["a"]["tokens"] += [200, 201, 202, 203]
    so, _ = step(sched, worker)
    assert sorted(so.finished_request_ids) == ["b", "c"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b (earlier) stays ahead of c
    assert scheduled(so) == {"a": 5}


def test_preemption_skips_waiting_admission() -> None:
    sched = make_scheduler(num_blocks=7)
    worker = FakeWorker(sched)
    _fill_three(sched, worker)
    sched.add_request(make_request("tiny", 1, max_tokens=2))
    so, _ = step(sched, worker)
    # After preempting c, 1 block was left over; still nobody waiting is admitted this step.
    assert "tiny" not in scheduled(so) and "c" not in scheduled(so)


def test_preempted_request_recovers_its_cached_prefix() -> None:
    sched = make_scheduler(num_blocks=8)  # 7 usable
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 8, max_tokens=6))
    sched.add_request(make_request("b", 12, max_tokens=16))
    # Steps 1-5: a fills 3 blocks (13 tokens), b 4 blocks (17 tokens): the pool is full.
    for _ in range(5):
        so, _ = step(sched, worker)
        assert set(scheduled(so)) == {"a", "b"}
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0
    # Step 6: a needs a 4th block → b preempted; a takes b's last block and finishes.
    so, outs = step(sched, worker)
    assert list(so.finished_request_ids) == ["b"]
    assert [o.finish_reason for o in outs] == ["length"]
    hits_before = sched.stats()["prefix_cache_hits"]
    # Step 7: b comes back; its first 3 blocks are still cached, only the rest is recomputed.
    so, _ = step(sched, worker)
    (new,) = so.new_requests
    assert new.request_id == "b"
    assert len(new.output_token_ids) == 5
    assert new.num_computed_tokens == 3 * BS
    assert scheduled(so) == {"b": 12 + 5 - 3 * BS}
    assert sched.stats()["prefix_cache_hits"] - hits_before == 3 * BS
    assert sched.requests["b"].num_preemptions == 1


def test_waiting_requests_never_preempt() -> None:
    sched = make_scheduler(num_blocks=7)
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 16, max_tokens=3))  # 4 blocks, 5 after its first output
    step(sched, worker)
    a = sched.requests["a"]
    sched.add_request(make_request("b", 12, max_tokens=3, priority=-5))  # needs 3 blocks; 2 free
    for _ in range(2):
        so, _ = step(sched, worker)
        assert set(scheduled(so)) == {"a"}
        assert sched.counters.num_preemptions == 0
        assert sched.requests["b"].status == RequestStatus.WAITING
    assert a.status == RequestStatus.FINISHED_LENGTH
    so, _ = step(sched, worker)  # a finished in the previous step
    assert set(scheduled(so)) == {"b"}


@pytest.mark.parametrize("policy,victim", [("fcfs", "h"), ("priority", "l")])
def test_victim_by_policy(policy: str, victim: str) -> None:
    """running = [l (priority 9, admitted first), h (priority 0)]: FCFS takes h, priority takes l.

    Under priority, l has already been scheduled in the step when h runs out of blocks, so
    l must be taken out of the step again (its tokens returned to the budget).
    """
    sched = make_scheduler(num_blocks=5, policy=policy)  # 4 usable
    worker = FakeWorker(sched)
    sched.add_request(make_request("l", 5, max_tokens=6, priority=9, arrival_time=1.0))
    step(sched, worker)  # l: 2 blocks, 6 tokens
    sched.add_request(make_request("h", 8, max_tokens=6, priority=0, arrival_time=2.0))
    so, _ = step(sched, worker)  # l decodes inside block 1; h admitted with 2 blocks → pool full
    assert scheduled(so) == {"l": 1, "h": 8}
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0
    assert [r.request_id for r in sched.running] == ["l", "h"]
    so, _ = step(sched, worker)  # l fits its blocks, h needs a 3rd one
    assert list(so.finished_request_ids) == [victim]
    assert sched.requests[victim].status == RequestStatus.PREEMPTED
    assert sched.requests[victim].num_computed_tokens == 0
    survivor = {"l": "h", "h": "l"}[victim]
    assert scheduled(so) == {survivor: 1}
    assert [c.request_id for c in so.cached_requests] == [survivor]
    assert sum(so.num_scheduled_tokens) == 1
    assert [r.request_id for r in sched.running] == [survivor]
    assert list(sched.waiting) == [sched.requests[victim]]
    assert sched.kv_cache_manager.block_ids(victim) == []
    # The victim comes back in full once there is room again.
    finals = run_until_done(sched, worker, max_steps=2000)
    assert set(finals) == {"l", "h"}
    assert_all_blocks_free(sched)


def test_priority_victim_ties_broken_by_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=5, policy="priority")
    worker = FakeWorker(sched)
    # x is admitted first but arrived later than y (same priority): x is the victim.
    sched.add_request(make_request("x", 7, max_tokens=9, priority=5, arrival_time=10.0))
    step(sched, worker)
    sched.add_request(make_request("y", 7, max_tokens=9, priority=5, arrival_time=5.0))
    step(sched, worker)
    assert [r.request_id for r in sched.running] == ["x", "y"]
    so, _ = step(sched, worker)
    assert list(so.finished_request_ids) == ["x"]
    assert scheduled(so) == {"y": 1}


def test_priority_waiting_order_and_preempted_requeue() -> None:
    sched = make_scheduler(num_blocks=5, policy="priority", max_num_seqs=1)
    sched.add_request(make_request("p5", 3, max_tokens=4, priority=5, arrival_time=1.0))
    sched.add_request(make_request("p1", 3, max_tokens=4, priority=1, arrival_time=2.0))
    sched.add_request(make_request("p1b", 3, max_tokens=4, priority=1, arrival_time=3.0))
    sched.add_request(make_request("p0", 3, max_tokens=4, priority=0, arrival_time=4.0))
    assert [r.request_id for r in sched.waiting] == ["p0", "p1", "p1b", "p5"]


def test_preemption_storm_completes_and_frees_everything() -> None:
    sched = make_scheduler(num_blocks=12, budget=16)  # 11 usable blocks
    worker = FakeWorker(sched)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=12, first_token=10 + 40 * i))
    finals = run_until_done(sched, worker)
    assert set(finals) == {f"r{i}" for i in range(6)}
    assert all(f.finish_reason == "length" for f in finals.values())
    assert sched.counters.num_preemptions > 0
    # Every request produced exactly its 12 tokens in order despite recomputation.
    for i in range(6):
        assert worker.state.get(f"r{i}") is None or len(worker.state[f"r{i}"]["tokens"]) == 5 + 3 * i + 12
    assert_all_blocks_free(sched)


# --------------------------------------------------------------------------- abort


def test_abort_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=20)
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 9, max_tokens=20))
    sched.add_request(make_request("b", 5, max_tokens=20))
    step(sched, worker)
    sched.add_request(make_request("w", 5, max_tokens=20))  # waiting, never scheduled
    free_before = sched.kv_cache_manager.block_pool.num_free_blocks
    aborted = sched.abort_requests(["a", "w", "nope"])
    assert [r.request_id for r in aborted] == ["a", "w"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.kv_cache_manager.block_pool.num_free_blocks == free_before + 3
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.num_waiting == 0
    so, _ = step(sched, worker)
    assert list(so.finished_request_ids) == ["a"]  # w was never sent to the worker
    assert scheduled(so) == {"b": 1}
    assert sched.abort_requests(["a"]) == []  # already gone
    sched.abort_requests(["b"])
    assert_all_blocks_free(sched)
    assert not sched.has_unfinished_requests()


def test_abort_while_step_runs_drops_its_token() -> None:
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    so = sched.schedule()
    runner_out = worker.execute(so)
    sched.abort_requests(["a"])
    outs = sched.update_from_output(so, runner_out)
    assert [o.request_id for o in outs] == ["b"]
    assert sched.requests.get("a") is None


def test_abort_preempted_request() -> None:
    sched = make_scheduler(num_blocks=7)
    worker = FakeWorker(sched)
    _fill_three(sched, worker)
    step(sched, worker)  # c preempted
    assert sched.requests["c"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.abort_requests(["c"])] == ["c"]
    assert sched.num_waiting == 0
    so, _ = step(sched, worker)
    assert "c" not in so.finished_request_ids  # already dropped at preemption


# --------------------------------------------------------------------------- finish reasons


def _run_single(req: Request, tokens: list[int], max_model_len: int = 512):
    sched = make_scheduler(max_model_len=max_model_len)
    worker = FakeWorker(sched, sample=lambda rid, n: tokens[n] if n < len(tokens) else 100 + n)
    sched.add_request(req)
    outs = []
    while sched.has_unfinished_requests():
        _, o = step(sched, worker)
        outs += o
    assert_all_blocks_free(sched)
    return outs


def test_stop_on_eos() -> None:
    outs = _run_single(make_request("a", 3, max_tokens=10), [11, 12, EOS, 13])
    assert [o.new_token_ids[0] for o in outs] == [11, 12, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == EOS
    assert all(o.finish_reason == "" for o in outs[:-1])
    assert outs[-1].num_prompt_tokens == 3


def test_stop_token_ids() -> None:
    outs = _run_single(make_request("a", 3, max_tokens=10, stop_token_ids=[77, 78]), [11, 78, 12])
    assert [o.new_token_ids[0] for o in outs] == [11, 78]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == 78


def test_no_stop_before_min_tokens() -> None:
    req = make_request("a", 3, max_tokens=10, min_tokens=3, stop_token_ids=[77])
    outs = _run_single(req, [EOS, 77, EOS, 14])
    # EOS / stop ids among the first min_tokens outputs are ignored; the 3rd output may stop.
    assert [o.new_token_ids[0] for o in outs] == [EOS, 77, EOS]
    assert outs[-1].finish_reason == "stop"


def test_ignore_eos() -> None:
    outs = _run_single(make_request("a", 3, max_tokens=4, ignore_eos=True), [EOS, EOS, 11, EOS])
    assert [o.new_token_ids[0] for o in outs] == [EOS, EOS, 11, EOS]
    assert outs[-1].finish_reason == "length" and outs[-1].stop_token_id == -1


def test_ignore_eos_keeps_stop_token_ids() -> None:
    outs = _run_single(make_request("a", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[77]), [EOS, 77])
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == 77


def test_length_by_max_tokens() -> None:
    outs = _run_single(make_request("a", 5, max_tokens=6), [])
    assert len(outs) == 6
    assert outs[-1].finish_reason == "length"
    assert outs[-1].stop_token_id == -1


def test_length_by_max_model_len() -> None:
    outs = _run_single(make_request("a", 10, max_tokens=100), [], max_model_len=16)
    assert len(outs) == 6  # prompt 10 + 6 = 16 tokens
    assert outs[-1].finish_reason == "length"


def test_stop_takes_precedence_on_last_allowed_token() -> None:
    outs = _run_single(make_request("a", 3, max_tokens=2), [11, EOS])
    assert outs[-1].finish_reason == "stop"


# --------------------------------------------------------------------------- randomized


class Driver:
    """Runs steps like the offline LLM: with async scheduling (depth 2) step N+1 is scheduled,
    with output placeholders, before step N's sampled tokens are processed."""

    def __init__(self, sched: Scheduler, worker: FakeWorker, depth: int) -> None:
        self.sched, self.worker, self.depth = sched, worker, depth
        self.in_flight: list[tuple[pb.SchedulerOutput, pb.ModelRunnerOutput]] = []

    def busy(self) -> bool:
        return self.sched.has_unfinished_requests() or bool(self.in_flight)

    def step(self) -> list[pb.RequestOutput]:
        while len(self.in_flight) < self.depth and self.sched.has_unfinished_requests():
            so = self.sched.schedule()
            if not so.num_scheduled_tokens:
                break
            self.in_flight.append((so, self.worker.execute(so)))  # the worker runs steps in order
        assert self.in_flight, "no progress"
        so, runner_output = self.in_flight.pop(0)
        return self.sched.update_from_output(so, runner_output)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_invariants(policy: str, seed: int, async_scheduling: bool) -> None:
    """Arrivals over time, shared prefixes, a small pool and budget, aborts: every invariant
    FakeWorker checks holds at every step, every request gets exactly its tokens, and all
    blocks come back."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    num_blocks = rng.randint(80, 120) // block_size + 1
    capacity = (num_blocks - 1) * block_size
    sched = scheduler_for(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.choice([3, 8]),
                      max_num_batched_tokens=rng.choice([6, 16, 64]), max_model_len=72, policy=policy,
                      async_scheduling=async_scheduling)
    worker = FakeWorker(sched)
    driver = Driver(sched, worker, depth=2 if async_scheduling else 1)
    prefixes = [[rng.randrange(10, 90) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    specs = {}
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 90) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, min(24, capacity - len(prompt), 72 - len(prompt)))
        specs[f"r{i}"] = (prompt, max_tokens, rng.randint(0, 3))
    arrivals = list(specs)
    tokens: dict[str, list[int]] = {rid: [] for rid in specs}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    for _ in range(3000):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if arrivals:
                rid = arrivals.pop(0)
                prompt, max_tokens, priority = specs[rid]
                sp = pb.SamplingParams(max_tokens=max_tokens, logprobs=-1)
                sched.add_request(Request(rid, prompt, sp, frozenset({EOS}), max_tokens=max_tokens,
                                          priority=priority, arrival_time=float(rid[1:])))
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            assert [r.request_id for r in sched.abort_requests([victim])] == [victim]
            aborted.add(victim)
        if not driver.busy():
            if not arrivals:
                break
            continue
        for o in driver.step():
            assert o.request_id not in finish, "output after the finish"
            tokens[o.request_id] += list(o.new_token_ids)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    else:
        pytest.fail("workload did not finish")
    for rid, (_prompt, max_tokens, _priority) in specs.items():
        if rid in aborted:
            assert rid not in finish
            continue
        assert finish[rid] == "length"
        assert tokens[rid] == [100 + n for n in range(max_tokens)], rid
    assert_all_blocks_free(sched)
    assert sched.requests == {}


def test_waiting_requests_whose_grammar_compiles_are_deferred() -> None:
    """vLLM's waiting reasons: a request passed over until its grammar compiles is "deferred",
    the others wait for capacity (stats carry the deferred count)."""
    sched = make_scheduler()
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 4))
    sched.requests["a"].grammar = SimpleNamespace(is_compiling=True)  # (only what the count reads)
    assert (sched.num_waiting, sched.num_waiting_deferred, sched.stats()["num_waiting_deferred"]) == (2, 1, 1)
    sched.requests["a"].grammar = SimpleNamespace(is_compiling=False)
    assert sched.num_waiting_deferred == 0
