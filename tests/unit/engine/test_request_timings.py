"""The engine's account of a request's time (vLLM's queue / prefill / decode / inference) and
its tokens per step."""

from __future__ import annotations

import time

from support.schedulers import scheduler_for

from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request


def _request(rid: str, max_tokens: int) -> Request:
    return Request(rid, list(range(1, 9)), pb.SamplingParams(), frozenset(), max_tokens=max_tokens)


def test_the_final_output_carries_the_phases_in_order() -> None:
    sched = scheduler_for(num_blocks=16, block_size=4, max_num_seqs=1)
    first, second = _request("a", 2), _request("b", 2)
    sched.add_request(first)
    sched.add_request(second)  # waits for a batch slot while `first` runs
    outputs = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        time.sleep(0.01)
        ids = [r.request_id for r in so.new_requests] + [r.request_id for r in so.cached_requests]
        runner = pb.ModelRunnerOutput(step_id=so.step_id, request_ids=ids, sampled_token_ids=[7] * len(ids))
        outputs += sched.update_from_output(so, runner)
    final = {o.request_id: o.timings for o in outputs if o.finish_reason}
    assert set(final) == {"a", "b"}
    for t in final.values():
        assert t.queued_s >= 0 and t.prefill_s > 0 and t.decode_s > 0
        assert abs(t.inference_s - (t.prefill_s + t.decode_s)) < 1e-6
    assert final["b"].queued_s > final["a"].queued_s + 0.015  # `b` queued through `a`'s two steps
