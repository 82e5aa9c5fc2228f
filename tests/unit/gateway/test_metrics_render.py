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


def _values(text: str, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in _families(text)[name]}


def test_waiting_reasons_sleep_state_and_token_sources() -> None:
    metrics = GatewayMetrics("m")
    timer = metrics.timer(0.0)
    timer.on_prompt(30, num_cached_tokens=10)
    timer.on_tokens(1)
    timer.on_finish("stop")
    text = metrics.render(pb.Stats(num_waiting=5, num_waiting_deferred=2, prefix_cache_hits=10,
                                   kv_transfer_loaded_tokens=16), admission_rejections=3)
    assert _values(text, "vllm:num_requests_waiting_by_reason", "reason") == {"capacity": 3, "deferred": 2}
    assert _values(text, "vllm:engine_sleep_state", "sleep_state") == {"awake": 1, "weights_offloaded": 0,
                                                                       "discard_all": 0}
    assert _values(text, "vllm:prompt_tokens_by_source", "source") == {
        "local_compute": 4, "local_cache_hit": 10, "external_kv_transfer": 16}
    assert _values(text, "vllm:prompt_tokens_cached_by_source", "source") == {
        "device": 10, "host": 0, "disk": 0, "p2p": 16, "external_unspecified": 0}
    rejections = _families(text)["vllm:admission_rejections"]
    assert {s.labels["reason"]: s.value for s in rejections} == {"max_num_queued_reqs": 3, "max_num_queued_tokens": 0}
    assert all("engine" not in s.labels for s in rejections)  # (vLLM's frontend counter: by model only)


def test_per_request_preemptions_and_computed_prompt_tokens() -> None:
    metrics = GatewayMetrics("m")
    metrics.set_max_model_len(512)
    timer = metrics.timer(0.0)
    timer.on_prompt(30, num_cached_tokens=16)
    timer.on_tokens(2)
    timer.on_finish("stop", pb.RequestTimings(num_preemptions=2))
    assert metrics.request_num_preemptions.sum == 2 and sum(metrics.request_num_preemptions.counts) == 1
    assert metrics.request_prefill_kv_computed_tokens.sum == 14
    timer = metrics.timer(0.0)  # without the engine's timings (a request that failed): not observed
    timer.on_prompt(30)
    timer.on_finish("abort")
    assert sum(metrics.request_num_preemptions.counts) == 1


def test_cudagraph_capture_failures_are_a_counter() -> None:
    text = GatewayMetrics("m").render(pb.Stats(cudagraph_capture_failures=2))
    assert "myvllm:cudagraph_capture_failures_total" in text
    assert [line for line in text.splitlines()
            if line.startswith("myvllm:cudagraph_capture_failures_total{")][0].endswith(" 2.0")
