"""LoRA in the engine core, driven with hand-made ModelRunnerOutputs (no model, no adapter
weights): admission, adapter-keyed prefix caching, the worker's slot table as the scheduler
assigns it, adapters the worker failed to load, and the adapters in the stats."""

from __future__ import annotations

import itertools

import pytest
from support.schedulers import scheduler_for

from services.common.block_hash import adapter_key, block_hashes
from services.common.config import LoRAConfig, VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.engine.engine_core import EngineCore
from services.engine.lora_slots import LoraSlots
from services.engine.request import Request
from services.engine.request_limits import InvalidRequest
from services.engine.scheduler import Scheduler

BS = 4
_first_tokens = itertools.count(1000, 1000)


def adapter(name: str, int_id: int) -> pb.LoRARequest:
    return pb.LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=f"/adapters/{name}")


X, Y, Z = adapter("x", 1), adapter("y", 2), adapter("z", 3)


def make_request(rid: str, lora: pb.LoRARequest | None = None, prompt_len: int = 6, max_tokens: int = 50,
                 first_token: int | None = None) -> Request:
    first = next(_first_tokens) if first_token is None else first_token
    return Request(rid, list(range(first, first + prompt_len)), pb.SamplingParams(max_tokens=max_tokens),
                   frozenset({2}), max_tokens=max_tokens, lora_request=lora)


def make_scheduler(max_loras: int = 2, num_blocks: int = 200, budget: int = 1000, enable_lora: bool = True,
                   max_num_seqs: int = 64) -> Scheduler:
    return scheduler_for(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, max_model_len=256,
                         lora_config=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras))


def step(sched: Scheduler, fail: dict[str, str] | None = None) -> tuple[pb.SchedulerOutput, list[pb.RequestOutput]]:
    """One step; the worker samples token 7 for every request whose tokens are all computed, and
    leaves out the new requests named in `fail` (their adapter failed to load)."""
    so = sched.schedule()
    out = pb.ModelRunnerOutput(step_id=so.step_id)
    for item in [*so.new_requests, *so.cached_requests]:
        if fail and item.request_id in fail:
            out.lora_load_failures.add(request_id=item.request_id, error=fail[item.request_id])
            continue
        request = sched.requests[item.request_id]
        if request.num_computed_tokens == request.num_tokens:
            out.request_ids.append(item.request_id)
            out.sampled_token_ids.append(7)
    return so, sched.update_from_output(so, out)


def new_slots(so: pb.SchedulerOutput) -> dict[str, tuple[str, int]]:
    """The new requests of a step: id -> (adapter name, slot)."""
    return {d.request_id: (d.lora_request.lora_name, d.lora_slot) for d in so.new_requests
            if d.HasField("lora_request")}


def scheduled_ids(so: pb.SchedulerOutput) -> set[str]:
    return {d.request_id for d in [*so.new_requests, *so.cached_requests]}


def assert_slots_consistent(sched: Scheduler) -> None:
    """Every running request with an adapter holds the slot that holds its adapter, and the users
    of each slot are exactly the running requests that hold it."""
    slots = sched.lora
    users = [0] * slots.max_loras
    for request in sched.running:
        if request.lora_request is not None:
            assert slots.held[request.lora_slot] == request.lora_request.lora_int_id
            users[request.lora_slot] += 1
        else:
            assert request.lora_slot is None
    assert users == slots.users
    for request in sched.waiting:
        assert request.lora_slot is None


# --------------------------------------------------------------------------- admission


def _core(enable_lora: bool) -> EngineCore:
    config = VllmConfig.from_engine_args(model="unused", enable_lora=enable_lora, max_loras=2)
    return EngineCore(config, pb.ModelInfo(max_model_len=64, vocab_size=100, eos_token_ids=[2], device="cpu"),
                      num_blocks=32)


def _generate(rid: str, lora: pb.LoRARequest | None) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=[5] * 6, sampling=pb.SamplingParams(max_tokens=4),
                              lora_request=lora)


def test_an_adapter_is_refused_by_an_engine_without_lora() -> None:
    core = _core(enable_lora=False)
    with pytest.raises(InvalidRequest, match="--enable-lora"):
        core.add_request(_generate("a", X))
    core.add_request(_generate("base", None))  # the base model still serves
    assert core.scheduler.requests["base"].lora_request is None
    core.structured_output.close()


@pytest.mark.parametrize(("lora", "field"), [
    (pb.LoRARequest(lora_name="", lora_int_id=1, lora_path="/a"), "lora_request.lora_name"),
    (pb.LoRARequest(lora_name="a", lora_int_id=0, lora_path="/a"), "lora_request.lora_int_id"),
    (pb.LoRARequest(lora_name="a", lora_int_id=-3, lora_path="/a"), "lora_request.lora_int_id"),
    (pb.LoRARequest(lora_name="a", lora_int_id=1, lora_path=""), "lora_request.lora_path"),
    (pb.LoRARequest(lora_name="a" * 257, lora_int_id=1, lora_path="/a"), "lora_request.lora_name"),
    (pb.LoRARequest(lora_name="a", lora_int_id=1, lora_path="/" * 4097), "lora_request.lora_path"),
])
def test_a_malformed_adapter_is_refused_naming_the_field(lora: pb.LoRARequest, field: str) -> None:
    core = _core(enable_lora=True)
    with pytest.raises(InvalidRequest, match=field):
        core.add_request(_generate("a", lora))
    assert core.scheduler.requests == {}
    core.structured_output.close()


def test_the_request_carries_its_adapter_to_the_worker() -> None:
    core = _core(enable_lora=True)
    core.add_request(_generate("a", X))
    assert core.scheduler.requests["a"].lora_request == X
    so = core.schedule()
    assert so.new_requests[0].lora_request == X and so.new_requests[0].lora_slot == 0
    core.structured_output.close()


# --------------------------------------------------------------------------- prefix cache


def test_block_hashes_are_keyed_by_the_adapter_as_the_gateway_keys_them() -> None:
    sched = make_scheduler()
    requests = {name: make_request(name, lora, prompt_len=12, first_token=500)
                for name, lora in (("base", None), ("x", X), ("y", Y))}
    for request in requests.values():
        sched.kv_cache_manager.get_computed_blocks(request)
    hashes = {name: request.block_hashes for name, request in requests.items()}
    assert len({h[0] for h in hashes.values()}) == 3  # the first block differs, so every later one does
    assert len({h[2] for h in hashes.values()}) == 3
    tokens = list(range(500, 512))
    assert hashes["x"] == block_hashes(tokens, BS, None, adapter_key("x", 1))
    assert hashes["base"] == block_hashes(tokens, BS)


def test_one_adapters_kv_serves_only_requests_of_that_adapter() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("x1", X, prompt_len=13, max_tokens=1, first_token=500))
    step(sched)
    for rid, lora in (("x2", X), ("y", Y), ("base", None)):
        sched.add_request(make_request(rid, lora, prompt_len=13, max_tokens=1, first_token=500))
    so, _ = step(sched)
    cached = {d.request_id: d.num_computed_tokens for d in so.new_requests}
    assert cached == {"x2": 12, "y": 0, "base": 0}
    # the name loaded again for other weights (another path: another id) shares nothing either
    sched.add_request(make_request("x-new", adapter("x", 7), prompt_len=13, max_tokens=1, first_token=500))
    so, _ = step(sched)
    assert [(d.request_id, d.num_computed_tokens) for d in so.new_requests] == [("x-new", 0)]


def test_kv_events_carry_the_adapter_keyed_hashes() -> None:
    stored: list[bytes] = []

    class Sink:
        def stored(self, block_hash: bytes, parent_hash: bytes) -> None:
            stored.append(block_hash)

        def removed(self, block_hash: bytes) -> None:
            pass

        def cleared(self) -> None:
            pass

    sched = make_scheduler()
    sched.kv_cache_manager.block_pool.events = Sink()
    sched.add_request(make_request("x", X, prompt_len=8, max_tokens=1, first_token=500))
    step(sched)
    assert stored == block_hashes(list(range(500, 508)), BS, None, adapter_key("x", 1))


# --------------------------------------------------------------------------- slots


def test_lru_slot_choice_and_reuse_in_the_slot_table() -> None:
    slots = LoraSlots(3)
    ada = {i: adapter(f"a{i}", i) for i in range(1, 7)}
    assert [slots.acquire(ada[a]) for a in (1, 2, 3)] == [0, 1, 2]
    for slot in (2, 0, 1):  # released in this order: slot 2 is the least recently used
        slots.release(slot)
    assert slots.acquire(ada[1]) == 0  # an adapter still loaded keeps its slot
    slots.release(0)
    assert slots.acquire(ada[4]) == 2
    assert slots.acquire(ada[5]) == 1  # slot 0 was used later than slot 1
    assert 2 not in slots.held and slots.acquire(ada[2]) == 0  # evicted: it takes the free slot
    assert slots.acquire(ada[6]) is None  # every slot in use
    with pytest.raises(RuntimeError):
        LoraSlots(1).release(0)


def test_requests_of_one_adapter_share_its_slot_and_a_third_adapter_waits() -> None:
    sched = make_scheduler(max_loras=2)
    for rid, lora in (("x1", X), ("y1", Y), ("x2", X), ("z1", Z), ("base", None)):
        sched.add_request(make_request(rid, lora))
    so, _ = step(sched)
    assert new_slots(so) == {"x1": ("x", 0), "y1": ("y", 1), "x2": ("x", 0)}
    # z waits for a slot; the base-model request behind it is never held back.
    assert scheduled_ids(so) == {"x1", "y1", "x2", "base"}
    assert [r.request_id for r in sched.waiting] == ["z1"]
    assert_slots_consistent(sched)
    so, _ = step(sched)
    assert "z1" not in scheduled_ids(so)
    sched.abort_requests(["y1"])  # y's slot is free now
    so, _ = step(sched)
    assert new_slots(so) == {"z1": ("z", 1)}
    assert_slots_consistent(sched)


def test_a_slot_in_use_is_never_given_to_another_adapter() -> None:
    sched = make_scheduler(max_loras=2)
    adapters = [adapter(f"a{i}", i + 1) for i in range(5)]
    for i in range(20):
        sched.add_request(make_request(f"r{i}", adapters[i % 5], max_tokens=1 + i % 4))
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        step(sched)
        # (A slot given to another adapter while a running request uses it would break this.)
        assert_slots_consistent(sched)
        assert len({r.lora_request.lora_name for r in sched.running if r.lora_request is not None}) <= 2
    assert not sched.has_unfinished_requests()
    assert sched.lora.users == [0, 0]


def test_a_preempted_request_gives_its_slot_back_and_gets_one_on_resume() -> None:
    # 10 usable blocks: two requests growing to 38 tokens (10 blocks each) run out as they decode.
    sched = make_scheduler(max_loras=2, num_blocks=11)
    sched.add_request(make_request("x", X, prompt_len=8, max_tokens=30))
    sched.add_request(make_request("y", Y, prompt_len=8, max_tokens=30))
    resumed = None
    for _ in range(60):
        so, _ = step(sched)
        assert_slots_consistent(sched)
        victim = next((r for r in sched.waiting if r.num_preemptions), None)
        if victim is not None:
            assert victim.lora_slot is None
            held = sched.lora.users
            assert held[sched.lora.held.index(victim.lora_request.lora_int_id)] == 0
        if resumed is None and any(sched.requests[r].num_preemptions for r in new_slots(so)):
            resumed = new_slots(so)
        if not sched.has_unfinished_requests():
            break
    assert resumed, "no request was preempted and resumed"
    assert sched.lora.users == [0, 0]


# --------------------------------------------------------------------------- worker failures


def test_an_adapter_the_worker_could_not_load_fails_its_requests_only() -> None:
    sched = make_scheduler(max_loras=2)
    sched.add_request(make_request("bad", X, prompt_len=9, first_token=500))
    sched.add_request(make_request("ok", Y, prompt_len=9))
    so, outs = step(sched, fail={"bad": "adapter_config.json not found"})
    failed = [o for o in outs if o.request_id == "bad"]
    assert len(failed) == 1
    assert failed[0].finish_reason == "abort" and failed[0].error_kind == pb.INVALID_REQUEST
    assert "'x'" in failed[0].error and "adapter_config.json not found" in failed[0].error
    assert "bad" not in sched.requests
    assert sched.lora.users == [0, 1]
    # Its blocks are free and their hashes gone: its KV was never computed.
    for block_hash in block_hashes(list(range(500, 509)), BS, None, adapter_key("x", 1)):
        assert sched.kv_cache_manager.block_pool.get_cached_block(block_hash) is None
    # The worker left it out of the step (it never held it): nothing to drop; the rest keeps going.
    so, outs = step(sched)
    assert "bad" not in so.finished_request_ids and scheduled_ids(so) == {"ok"}
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert sched.kv_cache_manager.block_pool.num_free_blocks == sched.kv_cache_manager.block_pool.num_blocks - 1


def test_a_failure_reported_after_the_next_step_was_scheduled_uncaches_both_steps_blocks() -> None:
    # Async scheduling: the next step (the prompt's second chunk) is scheduled before the worker
    # reports that the adapter failed; neither chunk's blocks hold KV.
    sched = scheduler_for(num_blocks=64, block_size=BS, max_num_batched_tokens=8, max_model_len=256,
                          async_scheduling=True, lora_config=LoRAConfig(enable_lora=True, max_loras=2))
    sched.add_request(make_request("bad", X, prompt_len=16, first_token=700))
    first = sched.schedule()
    second = sched.schedule()
    assert scheduled_ids(second) == {"bad"}
    pool = sched.kv_cache_manager.block_pool
    hashes = block_hashes(list(range(700, 716)), BS, None, adapter_key("x", 1))
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    runner = pb.ModelRunnerOutput(step_id=first.step_id)
    runner.lora_load_failures.add(request_id="bad", error="no such adapter")
    outs = sched.update_from_output(first, runner)
    assert [o.request_id for o in outs] == ["bad"] and outs[0].error_kind == pb.INVALID_REQUEST
    assert all(pool.get_cached_block(h) is None for h in hashes)
    assert sched.update_from_output(second, pb.ModelRunnerOutput(step_id=second.step_id)) == []
    assert pool.num_free_blocks == pool.num_blocks - 1 and sched.lora.users == [0, 0]


def test_a_failure_for_a_request_aborted_meanwhile_is_ignored() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", X))
    so = sched.schedule()
    sched.abort_requests(["a"])
    runner = pb.ModelRunnerOutput(step_id=so.step_id)
    runner.lora_load_failures.add(request_id="a", error="gone")
    assert sched.update_from_output(so, runner) == []


# --------------------------------------------------------------------------- stats


def test_stats_name_the_running_and_waiting_adapters() -> None:
    core = _core(enable_lora=True)
    for rid, lora in (("x1", X), ("y1", Y), ("x2", X), ("z1", Z), ("base", None)):
        core.add_request(_generate(rid, lora))
    stats = core.stats()
    assert stats.max_lora == 2
    assert list(stats.running_lora_adapters) == [] and list(stats.waiting_lora_adapters) == ["x", "y", "z"]
    core.schedule()
    stats = core.stats()
    assert list(stats.running_lora_adapters) == ["x", "y"] and list(stats.waiting_lora_adapters) == ["z"]
    core.structured_output.close()


def test_stats_without_lora_have_no_slots() -> None:
    core = _core(enable_lora=False)
    stats = core.stats()
    assert stats.max_lora == 0 and not stats.running_lora_adapters and not stats.waiting_lora_adapters
    core.structured_output.close()


def test_a_finished_request_releases_its_slot() -> None:
    sched = make_scheduler(max_loras=1)
    sched.add_request(make_request("x", X, max_tokens=2))
    sched.add_request(make_request("y", Y, max_tokens=2))
    seen = []
    for _ in range(10):
        so, _ = step(sched)
        seen += list(new_slots(so).items())
        if not sched.has_unfinished_requests():
            break
    assert seen == [("x", ("x", 0)), ("y", ("y", 0))]
    assert sched.requests == {} and sched.lora.users == [0]


def test_a_lost_worker_leaves_every_slot_empty() -> None:
    core = _core(enable_lora=True)
    core.add_request(_generate("x", X))
    core.schedule()
    outputs = core.fail_all("worker died")
    assert [o.request_id for o in outputs] == ["x"]
    slots = core.scheduler.lora
    assert slots.users == [0, 0] and slots.held == [0, 0]
    core.structured_output.close()
