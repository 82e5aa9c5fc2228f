"""The KV tier's scheduler side (services/engine/kv_tier.py) driven with hand-made worker answers:
evicted cached blocks are offered in the step's metadata; a prefix the tier holds (as the worker
reported) is loaded into fresh blocks instead of computed, never the block of the last prompt
token; a failed load makes the request compute its prompt, once; the view follows the reports."""

from __future__ import annotations

from support.schedulers import scheduler_for

from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler

BS = 4


def request(rid: str, first: int, prompt_len: int = 13, max_tokens: int = 1) -> Request:
    return Request(rid, list(range(first, first + prompt_len)), pb.SamplingParams(max_tokens=max_tokens),
                   frozenset({2}), max_tokens=max_tokens)


def make(num_blocks: int = 9) -> Scheduler:
    return scheduler_for(num_blocks=num_blocks, block_size=BS, max_model_len=64, kv_offloading_size=1.0)


def run(sched: Scheduler, report: pb.ModelRunnerOutput | None = None) -> pb.SchedulerOutput:
    """One step: every request with all its tokens computed samples token 7; `report`'s tier and
    load fields ride along."""
    so = sched.schedule()
    out = pb.ModelRunnerOutput(step_id=so.step_id)
    if report is not None:
        out.MergeFrom(report)
    for item in [*so.new_requests, *so.cached_requests]:
        r = sched.requests[item.request_id]
        if r.num_computed_tokens == r.num_tokens:
            out.request_ids.append(item.request_id)
            out.sampled_token_ids.append(7)
    sched.update_from_output(so, out)
    return so


def finish(sched: Scheduler, r: Request) -> list[pb.SchedulerOutput]:
    sched.add_request(r)
    steps = []
    while sched.has_unfinished_requests() and len(steps) < 20:
        steps.append(run(sched))
    return steps


def test_evicted_cached_blocks_are_offered_with_their_hashes() -> None:
    sched = make(num_blocks=9)  # 8 usable blocks
    a = request("a", 100, prompt_len=13)  # 3 full blocks cached, a 4th partial
    finish(sched, a)
    hashes = list(a.block_hashes[:3])
    pool = sched.kv_cache_manager.block_pool
    ids = [pool.get_cached_block(h).block_id for h in hashes]
    # A prompt needing every block evicts a's cached ones: they are offered, in eviction order.
    b = request("b", 500, prompt_len=29)
    sched.add_request(b)
    so = sched.schedule()
    meta = so.kv_connector_metadata
    assert set(meta.offload_block_hashes) == set(hashes)
    assert dict(zip(meta.offload_block_hashes, meta.offload_block_ids, strict=True)) == dict(zip(hashes, ids,
                                                                                                 strict=True))
    assert sched.stats()["kv_tier_offered_blocks"] == 3
    # Blocks the tier already holds are not offered again.
    sched2 = make(num_blocks=9)
    finish(sched2, request("a", 100, prompt_len=13))
    sched2.kv.connector.observe(pb.ModelRunnerOutput(kv_tier_stored=hashes))
    sched2.add_request(request("b", 500, prompt_len=29))
    assert not sched2.schedule().kv_connector_metadata.offload_block_ids


def test_a_prefix_the_tier_holds_is_loaded_not_computed() -> None:
    sched = make(num_blocks=40)
    a = request("a", 100, prompt_len=16)  # 4 full blocks; the 4th holds the last token
    finish(sched, a)
    hashes = list(a.block_hashes[:4])
    sched.kv_cache_manager.block_pool.reset_prefix_cache()  # (the pool forgot them: as if evicted)
    sched.kv.connector.observe(pb.ModelRunnerOutput(kv_tier_stored=hashes))
    b = request("b", 100, prompt_len=16)
    sched.add_request(b)
    so = sched.schedule()
    assert not so.num_scheduled_tokens  # parked for its load
    (load,) = so.kv_connector_metadata.loads
    assert load.request_id == "b" and not load.handle and load.first_block == 0
    assert list(load.block_hashes) == hashes[:3]  # never the last token's block
    assert list(load.block_ids) == sched.kv_cache_manager.block_ids("b")[:3]
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # While it loads, steps carry (empty) metadata so the worker can report it.
    so = run(sched)
    assert so.HasField("kv_connector_metadata") and not so.num_scheduled_tokens
    run(sched, pb.ModelRunnerOutput(finished_recving=["b"], kv_loaded_bytes=300))
    so = run(sched)
    assert list(so.num_scheduled_tokens) == [4]  # only the last block's tokens are computed
    assert [d.num_computed_tokens for d in so.new_requests] == [12]
    stats = sched.stats()
    assert stats["kv_tier_loads"] == 1 and stats["kv_tier_hits"] == 12 and stats["kv_tier_loaded_bytes"] == 300
    # The loaded blocks are cached again: a third request hits them in the pool.
    c = request("c", 100, prompt_len=16)
    sched.add_request(c)
    so = sched.schedule()
    assert [d.num_computed_tokens for d in so.new_requests] == [12]


def test_a_failed_load_computes_the_prompt_once_and_a_removed_block_is_not_asked_for() -> None:
    sched = make(num_blocks=40)
    a = request("a", 100, prompt_len=16)
    finish(sched, a)
    hashes = list(a.block_hashes[:4])
    sched.kv_cache_manager.block_pool.reset_prefix_cache()
    sched.kv.connector.observe(pb.ModelRunnerOutput(kv_tier_stored=hashes))
    b = request("b", 100, prompt_len=16)
    sched.add_request(b)
    run(sched)
    so = run(sched, pb.ModelRunnerOutput(failed_recving=["b"], kv_tier_removed=hashes[:1]))
    assert not so.kv_connector_metadata.loads
    so = run(sched)
    assert [d.num_computed_tokens for d in so.new_requests] == [0] and list(so.num_scheduled_tokens) == [16]
    assert sched.stats()["kv_tier_load_failures"] == 1
    assert sched.stats()["kv_tier_blocks"] == 3
    # With its first block gone from the tier, a later prompt finds no run to load.
    while sched.has_unfinished_requests():
        run(sched)
    sched.kv_cache_manager.block_pool.reset_prefix_cache()
    c = request("c", 100, prompt_len=16)
    sched.add_request(c)
    so = sched.schedule()
    assert not so.kv_connector_metadata.loads


def test_blocks_a_step_fills_are_stored_through_unless_the_tier_has_them() -> None:
    sched = make(num_blocks=40)
    a = request("a", 100, prompt_len=13)
    sched.add_request(a)
    so = sched.schedule()
    meta = so.kv_connector_metadata
    assert list(meta.store_block_hashes) == list(a.block_hashes[:3])  # the full blocks this step fills
    assert list(meta.store_block_ids) == sched.kv_cache_manager.block_ids("a")[:3]
    assert not meta.offload_block_ids
    sched.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, request_ids=["a"], sampled_token_ids=[7],
                                                      kv_tier_stored=list(a.block_hashes[:3])))
    # The same prompt again, its blocks loaded from the tier and cached: nothing is stored again.
    sched.kv_cache_manager.block_pool.reset_prefix_cache()
    b = request("b", 100, prompt_len=13)
    sched.add_request(b)
    stored = []
    for _ in range(6):
        so = run(sched, pb.ModelRunnerOutput(finished_recving=["b"]) if "b" in sched.kv.connector.loading else None)
        stored += so.kv_connector_metadata.store_block_hashes
    assert sched.stats()["kv_tier_loads"] == 1 and not sched.has_unfinished_requests()
    assert not set(stored) & set(a.block_hashes[:3])
