"""/metrics rendering details that need no stack: feature series only when the feature is on,
engine-counted histograms served from their Stats counts."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.common.metric_buckets import ITERATION_TOKENS_BUCKETS
from services.common.proto import myvllm_pb2 as pb
from services.gateway.metrics import GatewayMetrics


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_spec_decode_series_only_with_speculation_on() -> None:
    metrics = GatewayMetrics("m")
    off = _families(metrics.render(pb.Stats(block_size=16, num_total_blocks=9)))
    on = _families(metrics.render(pb.Stats(block_size=16, num_total_blocks=9, spec_decode_enabled=True,
                                           spec_decode_num_drafts=4)))
    spec = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "myvllm:spec_decode_num_drafts"}
    assert not spec & set(off)
    assert spec <= set(on)
    assert [s.value for s in on["vllm:spec_decode_num_drafts"]] == [4]


def test_iteration_tokens_come_from_the_engines_counts() -> None:
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[5], counts[-1] = 3, 2, 1  # 3 steps of 1 token, 2 of 65-128, 1 above 16384
    text = GatewayMetrics("m").render(pb.Stats(iteration_tokens_counts=counts, iteration_tokens_sum=20003))
    buckets = {s.labels["le"]: s.value for s in _families(text)["vllm:iteration_tokens_total"]
               if s.name.endswith("_bucket")}
    assert buckets["1.0"] == 3 and buckets["64.0"] == 3 and buckets["128.0"] == 5 and buckets["+Inf"] == 6


def test_a_request_without_timings_observes_no_phase() -> None:
    metrics = GatewayMetrics("m")
    timer = metrics.timer(0.0)
    timer.on_prompt(10, num_cached_tokens=4)
    timer.on_tokens(2)
    timer.on_finish("stop")
    assert metrics.request_queue_time.counts == [0] * len(metrics.request_queue_time.counts)
    assert metrics.prompt_tokens_cached == 4
    timer = metrics.timer(0.0)
    timer.on_prompt(10)
    timer.on_finish("stop", pb.RequestTimings(queued_s=0.1, prefill_s=0.2, decode_s=0.3, inference_s=0.5))
    assert sum(metrics.request_queue_time.counts) == 1 and metrics.request_inference_time.sum == 0.5
    assert metrics.time_per_prefill_token.sum == 0.2 / 10
