"""Our /metrics against vLLM's own: every `vllm:` series vLLM 0.32's OpenAI server exports
(tests/data/vllm_metrics_0.32.txt, recorded from a live vLLM by scripts/record_vllm_metrics.py)
is exported here under the same name with the same label names, unless it is listed below
with the reason it does not apply. Ours are rendered from the gateway's metrics code with a
scheduler's Stats and one finished request, as a scrape after some traffic sees them."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.common.metric_buckets import ITERATION_TOKENS_BUCKETS
from services.common.proto import myvllm_pb2 as pb
from services.gateway.metrics import GatewayMetrics

RECORDED = Path(__file__).resolve().parents[2] / "data" / "vllm_metrics_0.32.txt"

# vLLM's series that have no counterpart here, by metric name (every sample suffix of it).
NOT_APPLICABLE = {
    "vllm:mm_cache_queries": "the multi-modal input cache: no multi-modal models are served",
    "vllm:mm_cache_hits": "the multi-modal input cache: no multi-modal models are served",
    "vllm:estimated_flops_per_gpu": "vLLM's analytic per-GPU FLOP estimate of each step (its model-FLOPs "
                                    "utilization logging); nothing here models a step's FLOPs",
    "vllm:estimated_read_bytes_per_gpu": "as estimated_flops_per_gpu: an analytic estimate of memory traffic",
    "vllm:estimated_write_bytes_per_gpu": "as estimated_flops_per_gpu: an analytic estimate of memory traffic",
}
# Series exported with a different set of label names, and why.
LABELS_DIFFER = {
    "vllm:cache_config_info": "an info gauge whose labels are vLLM's CacheConfig fields (mamba_*, kv_offloading_*, "
                              "hash_block_size, ...); ours carries the ones this engine has (block_size, cache_dtype, "
                              "enable_prefix_caching, num_gpu_blocks) and, like every series here, model_name",
}


def _metric_name(sample_name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count)$", "", sample_name)


def _recorded() -> dict[str, set[str]]:
    """vLLM's series: sample name -> label names."""
    series = {}
    for line in RECORDED.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, labels = line.partition("{")
            series[name] = set(filter(None, labels.rstrip("}").split(",")))
    return series


def _ours() -> dict[str, set[str]]:
    """Our vllm: series after one finished request, with a scheduler's Stats."""
    metrics = GatewayMetrics("SmolLM2-135M-Instruct")
    metrics.set_max_model_len(2048)
    metrics.on_prompt_choices(2)
    timer = metrics.timer(0.0)
    timer.on_prompt(12, num_cached_tokens=4)
    timer.on_tokens(3)
    timer.on_finish("length", pb.RequestTimings(queued_s=0.1, prefill_s=0.2, decode_s=0.3, inference_s=0.5,
                                                num_preemptions=1), max_tokens=3)
    metrics.on_prompt_done(3)
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[1] = 4
    stats = pb.Stats(block_size=16, num_total_blocks=99, num_free_blocks=90, num_waiting=3, num_waiting_deferred=1,
                     num_running=2, prefix_cache_queries=40, prefix_cache_hits=8, iteration_tokens_counts=counts,
                     iteration_tokens_sum=20, enable_prefix_caching=True)
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render(stats, admission_rejections=1)):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_vllm_series_that_applies_is_exported_with_its_labels() -> None:
    recorded, ours = _recorded(), _ours()
    print(f"vLLM 0.32 exports {len(recorded)} vllm: series; we export {len(ours)} "
          f"({len([n for n in recorded if _metric_name(n) in NOT_APPLICABLE])} of vLLM's do not apply)")
    assert set(NOT_APPLICABLE) | set(LABELS_DIFFER) <= {_metric_name(n) for n in recorded}, "a stale exception"
    missing, labels_differ = [], []
    for name, labels in sorted(recorded.items()):
        if _metric_name(name) in NOT_APPLICABLE:
            continue
        if name not in ours:
            missing.append(name)
        elif _metric_name(name) in LABELS_DIFFER:
            assert ours[name] - {"model_name"} <= labels, (name, ours[name] - labels)
        elif ours[name] != labels:
            labels_differ.append((name, sorted(labels), sorted(ours[name])))
    assert not missing, f"vLLM's series we do not export: {missing}"
    assert not labels_differ, f"(name, vLLM's label names, ours): {labels_differ}"


def test_the_series_that_do_not_apply_are_not_exported() -> None:
    """A series listed as not applying must not be half there either."""
    ours = {_metric_name(name) for name in _ours()}
    assert not ours & set(NOT_APPLICABLE)
