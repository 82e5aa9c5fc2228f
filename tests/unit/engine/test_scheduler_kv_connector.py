"""The scheduler's KV connector state machine (P/D disaggregation), driven with hand-made
ModelRunnerOutputs: a consumer request waits for remote KV holding its blocks, not the batch; a
finished or failed load makes it schedulable (with those tokens computed, or none); a producer
request's blocks outlive it until its save is reported; aborts in either state never free blocks a
transfer still writes or reads."""

from __future__ import annotations

from support.schedulers import scheduler_for

from services.common.block_hash import block_hashes
from services.common.kv_transfer_config import KVTransferConfig
from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_connector import new_handle
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler

BS = 4
EOS = 2


def make_scheduler(role: str, num_blocks: int = 64, budget: int = 1000) -> Scheduler:
    return scheduler_for(num_blocks=num_blocks, block_size=BS, max_num_seqs=16, max_num_batched_tokens=budget,
                     max_model_len=256, kv_transfer_config=KVTransferConfig(
                         kv_connector="SharedMemoryConnector", kv_role=role))


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def remote_params(tokens: list[int], num_tokens: int | None = None) -> pb.KVTransferParams:
    n = (len(tokens) - 1) // BS * BS if num_tokens is None else num_tokens
    return pb.KVTransferParams(do_remote_prefill=True, remote_handle=new_handle(), remote_num_tokens=n,
                               remote_block_hash=block_hashes(tokens, BS)[n // BS - 1])


def request(rid: str, tokens: list[int], params: pb.KVTransferParams | None, max_tokens: int = 5) -> Request:
    return Request(rid, tokens, pb.SamplingParams(max_tokens=max_tokens, logprobs=-1), frozenset({EOS}),
                   max_tokens=max_tokens, kv_transfer_params=params)


def sampled(so: pb.SchedulerOutput, token: int = 7, **transfers) -> pb.ModelRunnerOutput:
    ids = [r.request_id for r in so.new_requests] + [r.request_id for r in so.cached_requests]
    return pb.ModelRunnerOutput(step_id=so.step_id, request_ids=ids, sampled_token_ids=[token] * len(ids),
                                **transfers)


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.num_free_blocks


def test_consumer_waits_for_remote_kv_holding_blocks_then_computes_the_rest() -> None:
    s = make_scheduler("kv_consumer")
    total = free_blocks(s)
    tokens = prompt(14)  # 3 full blocks are remote (12 tokens); 2 tokens computed here
    params = remote_params(tokens)
    s.add_request(request("c", tokens, params))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [] and not so.new_requests
    r = s.kv.waiting_for_remote["c"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not s.waiting and not s.running
    block_ids = s.kv_cache_manager.block_ids("c")
    assert len(block_ids) == 3 and free_blocks(s) == total - 3
    (load,) = so.kv_connector_metadata.loads
    assert (load.request_id, load.handle, load.first_block) == ("c", params.remote_handle, 0)
    assert list(load.block_ids) == block_ids and list(load.block_hashes) == block_hashes(tokens, BS)[:3]
    # Not in the prefix cache before the load is done: nobody may read those blocks yet.
    assert s.kv_cache_manager.block_pool.get_cached_block(load.block_hashes[0]) is None
    # While the load runs, steps carry only the connector's (empty) metadata: the worker reports.
    so2 = s.schedule()
    assert so2.HasField("kv_connector_metadata") and not so2.kv_connector_metadata.loads
    assert s.has_unfinished_requests()
    s.update_from_output(so2, pb.ModelRunnerOutput(step_id=so2.step_id, finished_recving=["c"]))
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 12
    assert s.kv_cache_manager.block_pool.get_cached_block(load.block_hashes[2]) is not None
    so3 = s.schedule()
    (new,) = so3.new_requests
    assert new.num_computed_tokens == 12 and list(so3.num_scheduled_tokens) == [2]
    assert list(new.block_ids)[:3] == block_ids
    assert not so3.HasField("kv_connector_metadata")  # nothing pending any more
    s.update_from_output(so3, sampled(so3))
    assert s.kv.connector.num_loads == 1 and s.kv.connector.num_loaded_tokens == 12


def test_a_failed_load_computes_the_prompt_here_and_never_loads_again() -> None:
    s = make_scheduler("kv_consumer")
    total = free_blocks(s)
    tokens = prompt(14)
    s.add_request(request("c", tokens, remote_params(tokens)))
    so = s.schedule()
    s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, failed_recving=["c"]))
    r = s.requests["c"]
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 and free_blocks(s) == total
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [14] and so.new_requests[0].num_computed_tokens == 0
    assert not so.kv_connector_metadata.loads
    assert s.kv.connector.num_load_failures == 1


def test_local_prefix_hits_load_only_the_rest() -> None:
    s = make_scheduler("kv_consumer")
    tokens = prompt(14)
    s.add_request(request("warm", tokens[:9], None, max_tokens=1))  # caches 2 blocks of the prefix
    so = s.schedule()
    s.update_from_output(so, sampled(so))
    s.add_request(request("c", tokens, remote_params(tokens)))
    so = s.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert load.first_block == 2 and len(load.block_ids) == 1
    assert s.kv.waiting_for_remote["c"].num_computed_tokens == 8


def test_params_that_do_not_match_the_prompt_are_discarded_unread() -> None:
    s = make_scheduler("kv_consumer")
    tokens = prompt(14)
    wrong = remote_params(prompt(14, start=5000))
    s.add_request(request("c", tokens, wrong))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [14]
    assert list(so.kv_connector_metadata.discard_handles) == [wrong.remote_handle]
    whole = prompt(16, start=9000)
    too_many = remote_params(whole, num_tokens=16)  # the last token is never remote
    s.add_request(request("d", whole, too_many))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [16] and list(so.kv_connector_metadata.discard_handles) == [
        too_many.remote_handle]


def test_an_abort_while_loading_frees_the_blocks_only_when_the_load_ends() -> None:
    s = make_scheduler("kv_consumer")
    total = free_blocks(s)
    tokens = prompt(14)
    s.add_request(request("c", tokens, remote_params(tokens)))
    so = s.schedule()
    assert [r.request_id for r in s.abort_requests(["c"])] == ["c"]
    assert "c" not in s.kv.waiting_for_remote and free_blocks(s) == total - 3  # the worker still writes them
    assert s.has_unfinished_requests()
    so = s.schedule()
    s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, finished_recving=["c"]))
    assert free_blocks(s) == total and not s.kv.finishing and not s.has_unfinished_requests()


def test_producer_saves_the_prompt_blocks_and_frees_them_when_saved() -> None:
    s = make_scheduler("kv_producer", budget=6)
    total = free_blocks(s)
    tokens = prompt(11)  # 2 full blocks saved ((11 - 1) // 4); chunked over two steps
    s.add_request(request("p", tokens, pb.KVTransferParams(do_remote_decode=True), max_tokens=1))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [6] and not so.kv_connector_metadata.saves  # prompt not done
    s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id))
    so = s.schedule()
    (save,) = so.kv_connector_metadata.saves
    assert save.request_id == "p" and list(save.block_ids) == s.kv_cache_manager.block_ids("p")[:2]
    assert list(save.block_hashes) == block_hashes(tokens, BS)[:2]
    # Its final output waits for the save: the consumer it names must find a whole segment.
    assert s.update_from_output(so, sampled(so)) == []
    assert "p" in s.kv.finishing and free_blocks(s) < total and s.has_unfinished_requests()
    so = s.schedule()
    assert s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id)) == []  # not yet saved
    so = s.schedule()
    (out,) = s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, finished_sending=["p"]))
    assert out.finish_reason == "length" and list(out.new_token_ids) == [7]
    assert out.kv_transfer_params == pb.KVTransferParams(
        do_remote_prefill=True, remote_handle=save.handle, remote_num_tokens=8,
        remote_block_hash=block_hashes(tokens, BS)[1])
    assert free_blocks(s) == total and not s.kv.finishing and not s.has_unfinished_requests()


def test_a_producer_request_aborted_while_its_output_waits_for_the_save_discards_the_segment() -> None:
    s = make_scheduler("kv_producer")
    total = free_blocks(s)
    s.add_request(request("p", prompt(11), pb.KVTransferParams(do_remote_decode=True), max_tokens=1))
    so = s.schedule()
    (save,) = so.kv_connector_metadata.saves
    assert s.update_from_output(so, sampled(so)) == []  # held
    (aborted,) = s.abort_requests(["p"])
    assert aborted.request_id == "p" and s.abort_requests(["p"]) == []
    so = s.schedule()
    assert s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, finished_sending=["p"])) == []
    assert free_blocks(s) == total
    so = s.schedule()
    assert list(so.kv_connector_metadata.discard_handles) == [save.handle]
    assert not s.has_unfinished_requests()


def test_producer_prompt_shorter_than_a_block_saves_nothing() -> None:
    s = make_scheduler("kv_producer")
    s.add_request(request("p", prompt(4), pb.KVTransferParams(do_remote_decode=True), max_tokens=1))
    so = s.schedule()
    assert not so.HasField("kv_connector_metadata")
    (out,) = s.update_from_output(so, sampled(so))
    assert out.kv_transfer_params == pb.KVTransferParams(do_remote_prefill=True)
    assert not s.kv.finishing and not s.has_unfinished_requests()


def test_an_aborted_producer_request_keeps_its_blocks_until_saved_then_its_segment_is_discarded() -> None:
    s = make_scheduler("kv_producer")
    total = free_blocks(s)
    s.add_request(request("p", prompt(11), pb.KVTransferParams(do_remote_decode=True), max_tokens=1))
    so = s.schedule()
    (save,) = so.kv_connector_metadata.saves
    s.abort_requests(["p"])
    assert "p" in s.kv.finishing and free_blocks(s) < total
    s.update_from_output(so, sampled(so))  # (its token is dropped: aborted)
    so = s.schedule()
    s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, finished_sending=["p"]))
    assert free_blocks(s) == total
    so = s.schedule()
    assert list(so.kv_connector_metadata.discard_handles) == [save.handle]  # nobody will come for it
    assert not s.has_unfinished_requests()


def test_a_worker_failure_forgets_every_transfer_and_frees_every_block() -> None:
    s = make_scheduler("kv_both")
    total = free_blocks(s)
    tokens = prompt(14)
    s.add_request(request("c", tokens, remote_params(tokens)))
    s.add_request(request("p", prompt(11, start=7000), pb.KVTransferParams(do_remote_decode=True), max_tokens=1))
    so = s.schedule()
    assert so.kv_connector_metadata.loads and so.kv_connector_metadata.saves
    s.update_from_output(so, sampled(so))
    s.abort_requests(list(s.requests))
    (held,) = s.take_held_outputs()  # "p" ended, waiting for a save the dead worker never reports
    assert held.request_id == "p" and held.kv_transfer_params.remote_handle
    s.forget_worker_state()
    assert free_blocks(s) == total and not s.kv.finishing and not s.has_unfinished_requests()


def test_loads_in_flight_are_bounded_by_max_num_seqs_and_the_pool() -> None:
    s = scheduler_for(num_blocks=64, block_size=BS, max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=256,
                  kv_transfer_config=KVTransferConfig(kv_connector="SharedMemoryConnector", kv_role="kv_consumer"))
    for i in range(3):
        tokens = prompt(14, start=1000 * (i + 1))
        s.add_request(request(f"c{i}", tokens, remote_params(tokens)))
    so = s.schedule()
    assert [load.request_id for load in so.kv_connector_metadata.loads] == ["c0", "c1"]
    assert [r.request_id for r in s.waiting] == ["c2"] and s.num_waiting == 3
    # Waiting for their loads (vLLM's "deferred" waiting reason); c2 waits for capacity.
    assert s.num_waiting_deferred == 2 and s.stats()["num_waiting_deferred"] == 2
    s.update_from_output(so, pb.ModelRunnerOutput(step_id=so.step_id, finished_recving=["c0"]))
    so = s.schedule()
    assert [r.request_id for r in so.new_requests] == ["c0"]
    assert [load.request_id for load in so.kv_connector_metadata.loads] == ["c2"]
    # A pool too small for the load: the request waits (no load, no blocks), and asks again later.
    small = make_scheduler("kv_consumer", num_blocks=6)
    small.add_request(request("r", prompt(14, start=50000), None))
    so = small.schedule()
    small.update_from_output(so, sampled(so))  # "r" holds 4 of the 5 blocks
    tokens = prompt(14)
    small.add_request(request("big", tokens, remote_params(tokens)))
    so = small.schedule()
    assert not so.kv_connector_metadata.loads and small.requests["big"].kv_load_decided is False
    assert small.requests["big"].status == RequestStatus.WAITING and not small.kv_cache_manager.block_ids("big")


def test_a_request_asking_for_prompt_logprobs_computes_its_prompt_and_discards_the_segment() -> None:
    s = make_scheduler("kv_consumer")
    tokens = prompt(14)
    params = remote_params(tokens)
    r = Request("c", tokens, pb.SamplingParams(max_tokens=5, logprobs=-1, prompt_logprobs=1), frozenset({EOS}),
                max_tokens=5, kv_transfer_params=params)
    s.add_request(r)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == [14] and not so.kv_connector_metadata.loads
    assert list(so.kv_connector_metadata.discard_handles) == [params.remote_handle]


def test_a_request_whose_save_is_in_flight_is_never_preempted() -> None:
    """Async scheduling keeps a max_tokens=1 producer request running for the next step, where it is
    the newest and so the first victim: its blocks must stay held (the worker still reads them)."""
    s = scheduler_for(num_blocks=6, block_size=BS, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=256,
                  async_scheduling=True, kv_transfer_config=KVTransferConfig(
                      kv_connector="SharedMemoryConnector", kv_role="kv_producer"))
    s.add_request(request("d", prompt(8, start=5000), None, max_tokens=10))  # 2 blocks, then a 3rd
    s.add_request(request("p", prompt(11), pb.KVTransferParams(do_remote_decode=True), max_tokens=1))  # 3 blocks
    so1 = s.schedule()
    (save,) = so1.kv_connector_metadata.saves
    p_blocks = s.kv_cache_manager.block_ids("p")
    assert free_blocks(s) == 0
    so2 = s.schedule()  # "d" needs a block for its next token; "p" is the newest running request
    p, d = s.requests["p"], s.requests["d"]
    assert p.num_preemptions == 0 and p.status == RequestStatus.RUNNING
    assert s.kv_cache_manager.block_ids("p") == p_blocks
    assert all(s.kv_cache_manager.block_pool.blocks[b].ref_cnt > 0 for b in save.block_ids)
    # Nobody else to preempt: "d" waits for the save, holding its blocks (not preempting itself).
    assert d.num_preemptions == 0 and d.status == RequestStatus.RUNNING and not so2.cached_requests
    s.update_from_output(so1, sampled(so1))
    assert "p" in s.kv.finishing  # ended; its blocks wait for the save
    s.update_from_output(so2, pb.ModelRunnerOutput(step_id=so2.step_id))
    so3 = s.schedule()
    assert not so3.cached_requests and s.kv_cache_manager.block_ids("p") == p_blocks  # still saving
    (out,) = s.update_from_output(so3, pb.ModelRunnerOutput(step_id=so3.step_id, finished_sending=["p"]))
    assert out.request_id == "p" and out.kv_transfer_params.remote_handle == save.handle
    assert not s.kv.finishing and free_blocks(s) == 3
    so4 = s.schedule()  # "d" goes on, in a block "p" gave back
    (cached,) = so4.cached_requests
    assert cached.request_id == "d" and list(so4.num_scheduled_tokens) == [1] and d.num_preemptions == 0


def test_blocks_being_saved_stay_held_under_preemption_pressure_with_async_scheduling() -> None:
    """A fake worker two steps deep reports each save a few steps after it was sent; decoding
    requests grow into a tiny pool alongside producer prefills. At every step, every block of a
    save in flight is held (never freed, so never another request's), and everything completes."""
    s = scheduler_for(num_blocks=10, block_size=BS, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
                  async_scheduling=True, kv_transfer_config=KVTransferConfig(
                      kv_connector="SharedMemoryConnector", kv_role="kv_both"))
    pool = s.kv_cache_manager.block_pool
    for i in range(4):
        s.add_request(request(f"d{i}", prompt(6, start=10000 + 100 * i), None, max_tokens=16))
        s.add_request(request(f"p{i}", prompt(13, start=20000 + 100 * i), pb.KVTransferParams(do_remote_decode=True),
                              max_tokens=1))
    in_flight: list[pb.SchedulerOutput] = []
    saves: dict[str, tuple[list[int], int]] = {}  # request id -> (block ids, step it reports in)
    finished: dict[str, pb.RequestOutput] = {}
    preempted_while_saving = 0
    for step in range(400):
        if not s.has_unfinished_requests() and not in_flight:
            break
        so = s.schedule()
        for save in so.kv_connector_metadata.saves:
            saves[save.request_id] = (list(save.block_ids), step + 3)
        for rid, (block_ids, _) in saves.items():
            assert all(pool.blocks[b].ref_cnt > 0 for b in block_ids), f"step {step}: {rid}'s saved blocks freed"
            r = s.requests.get(rid)
            preempted_while_saving += r is not None and r.status == RequestStatus.PREEMPTED
        in_flight.append(so)
        if len(in_flight) < 2 and s.has_unfinished_requests():
            continue
        done = in_flight.pop(0)
        reported = [rid for rid, (_, due) in saves.items() if due <= step]
        for rid in reported:
            del saves[rid]
        for out in s.update_from_output(done, sampled(done, finished_sending=reported)):
            if out.finish_reason:
                finished[out.request_id] = out
    assert preempted_while_saving == 0 and s.counters.num_preemptions > 0  # there was pressure
    assert sorted(finished) == sorted(f"{k}{i}" for k in "dp" for i in range(4))
    assert all(finished[f"p{i}"].kv_transfer_params.remote_handle for i in range(4))
    assert free_blocks(s) == pool.num_blocks - 1 and not s.kv.finishing
