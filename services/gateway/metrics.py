"""Prometheus metrics in the text exposition format (no client library needed).

Latency histograms are measured here, per engine request, as tokens reach the
gateway; queue and cache numbers come from the scheduler's `Stats` at scrape time.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from collections.abc import Mapping

from services.common.proto import myvllm_pb2 as pb

# Bucket bounds as in vLLM's metrics, so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v}"'.replace("\n", "\\n") for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) and not value.is_integer() else str(int(value))


class Histogram:
    """A cumulative-bucket histogram; `observe` is O(log buckets)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # last slot: above every bound (+Inf)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self._counts, strict=True):
            cumulative += count
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _number(bound)})} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_number(self.sum)}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return lines


def _single(name: str, kind: str, help_text: str, value: float, labels: dict[str, str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{_labels(labels)} {_number(value)}"]


class GatewayMetrics:
    """Everything `/metrics` reports for one served model."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.time_to_first_token = Histogram(
            "myvllm:time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "myvllm:inter_token_latency_seconds", "Time between consecutive token batches of a request.",
            ITL_BUCKETS)
        self.e2e_request_latency = Histogram(
            "myvllm:e2e_request_latency_seconds", "Time from request arrival to its end.", E2E_BUCKETS)
        self.request_success: dict[str, int] = defaultdict(int)  # by finish reason
        self.request_migrations = 0  # engine requests re-submitted after their replica failed
        # Cache-aware routing: prompt tokens the gateway expected the chosen replica to have
        # cached, and what its scheduler then reported (num_cached_tokens of the first output).
        self.routed_prompts = 0
        self.predicted_cached_tokens = 0
        self.actual_cached_tokens = 0

    def on_migration(self) -> None:
        self.request_migrations += 1

    def on_routed_prompt(self, predicted_cached_tokens: int, actual_cached_tokens: int) -> None:
        self.routed_prompts += 1
        self.predicted_cached_tokens += predicted_cached_tokens
        self.actual_cached_tokens += actual_cached_tokens

    @staticmethod
    def _spec_decode(stats: pb.Stats, labels: dict[str, str]) -> list[str]:
        """Speculative decoding counters (vLLM's names under myvllm:), acceptance by draft position."""
        lines = _single("myvllm:spec_decode_num_drafts_total", "counter", "Verification rounds (a request's "
                        "drafts checked in one step).", stats.spec_decode_num_drafts, labels)
        lines += _single("myvllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
                         stats.spec_decode_num_draft_tokens, labels)
        lines += _single("myvllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                         stats.spec_decode_num_accepted_tokens, labels)
        lines += ["# HELP myvllm:spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by position "
                  "in the draft (0 = first).",
                  "# TYPE myvllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
        lines += [f"myvllm:spec_decode_num_accepted_tokens_per_pos_total{_labels({**labels, 'position': str(j)})} "
                  f"{count}" for j, count in enumerate(stats.spec_decode_accepted_per_pos)]
        return lines

    def timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)

    def render(self, stats: pb.Stats | None, routed: Mapping[str, int] | None = None) -> str:
        """The exposition text; scheduler gauges and counters only if `stats` came back;
        engine requests routed to each replica (by address) when `routed` is given."""
        lines: list[str] = []
        labels = self.labels
        if stats is not None:
            lines += _single("myvllm:num_requests_running", "gauge", "Requests in the engine's running batch.",
                             stats.num_running, labels)
            lines += _single("myvllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                             stats.num_waiting, labels)
            lines += _single("myvllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0-1).",
                             stats.kv_cache_usage, labels)
            lines += _single("myvllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the "
                             "prefix cache.", stats.prefix_cache_queries, labels)
            lines += _single("myvllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                             stats.prefix_cache_hits, labels)
            lines += _single("myvllm:num_preemptions_total", "counter", "Requests preempted by the scheduler.",
                             stats.num_preemptions, labels)
            lines += _single("myvllm:grammar_compiles_total", "counter", "Structured-output grammars compiled "
                             "(grammar cache misses).", stats.grammar_compiles, labels)
            lines += _single("myvllm:grammar_compile_seconds_total", "counter", "Time spent compiling "
                             "structured-output grammars.", stats.grammar_compile_seconds, labels)
            lines += _single("myvllm:grammar_cache_hits_total", "counter", "Constrained requests whose grammar "
                             "was already compiled.", stats.grammar_cache_hits, labels)
            lines += _single("myvllm:grammar_compile_timeouts_total", "counter", "Structured-output grammars that "
                             "did not compile within --structured-outputs-compile-timeout.",
                             stats.grammar_compile_timeouts, labels)
            lines += _single("myvllm:grammar_row_waits_total", "counter", "Steps a constrained request sat out "
                             "because its allowed-token row was not filled yet.", stats.grammar_row_waits, labels)
            lines += self._spec_decode(stats, labels)
            lines += _single("myvllm:dp_dummy_steps_total", "counter", "Steps an engine of a data-parallel "
                             "expert-parallel group ran with nothing scheduled, so the group's MoE exchanges "
                             "matched.", stats.num_dummy_steps, labels)
            lines += _single("myvllm:dp_wave", "gauge", "The data-parallel expert-parallel group's current wave "
                             "(0 without such a group).", stats.dp_wave, labels)
            lines += _single("myvllm:dp_engines_running", "gauge", "1 while the data-parallel expert-parallel "
                             "group's wave runs, 0 while it is paused.", int(stats.dp_engines_running), labels)
        lines += _single("myvllm:scheduler_up", "gauge", "1 if the scheduler answered this scrape.",
                         int(stats is not None), labels)
        lines += ["# HELP myvllm:request_success_total Finished requests, by finish reason.",
                  "# TYPE myvllm:request_success_total counter"]
        for reason in sorted(set(self.request_success) | {"stop", "length", "abort"}):
            lines.append(f"myvllm:request_success_total{_labels({**labels, 'finished_reason': reason})} "
                         f"{self.request_success[reason]}")
        lines += _single("myvllm:request_migrations_total", "counter", "Requests re-submitted to a replica "
                         "after theirs failed (request migration).", self.request_migrations, labels)
        lines += _single("myvllm:routing_predicted_cached_tokens_total", "counter", "Prompt tokens the router "
                         "expected the chosen replica to have cached.", self.predicted_cached_tokens, labels)
        lines += _single("myvllm:routing_actual_cached_tokens_total", "counter", "Prompt tokens the chosen replica "
                         "served from its prefix cache (same requests).", self.actual_cached_tokens, labels)
        lines += _single("myvllm:routing_prompts_total", "counter", "Engine requests counted in the two above.",
                         self.routed_prompts, labels)
        if routed:
            lines += ["# HELP myvllm:replica_requests_total Engine requests routed to each replica.",
                      "# TYPE myvllm:replica_requests_total counter"]
            lines += [f"myvllm:replica_requests_total{_labels({**labels, 'replica': address})} {count}"
                      for address, count in sorted(routed.items())]
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency):
            lines += histogram.render(labels)
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Feeds one engine request's token arrivals into the latency histograms."""

    def __init__(self, metrics: GatewayMetrics, arrival_time: float) -> None:
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._last_token_time: float | None = None

    def on_tokens(self, num_tokens: int = 1) -> None:
        """A step's tokens arrived (several with speculative decoding: the wait is shared among
        them, one inter-token latency each; the first token's wait is the time to first token)."""
        now = time.monotonic()
        if self._last_token_time is None:
            self._metrics.time_to_first_token.observe(now - self._arrival_time)
            for _ in range(num_tokens - 1):
                self._metrics.inter_token_latency.observe(0.0)  # they arrived with the first
        else:
            for _ in range(num_tokens):
                self._metrics.inter_token_latency.observe((now - self._last_token_time) / num_tokens)
        self._last_token_time = now

    def on_finish(self, finish_reason: str) -> None:
        self._metrics.e2e_request_latency.observe(time.monotonic() - self._arrival_time)
        self._metrics.request_success[finish_reason] += 1
