"""Prometheus metrics for `/metrics`, written by prometheus_client's exposition.

Every metric is served under our name (`myvllm:*`, label `model_name`) and, where vLLM has the
same metric, also under vLLM's exact name and labels (`vllm:*`, labels `model_name` and
`engine`), so what reads a vLLM server (Grafana dashboards, HPA/KEDA on
`vllm:num_requests_waiting`, Kubernetes routers) reads this one. `engine` is "0": the gateway
reports its replicas' totals, which for the default one-replica deployment is that engine.

Latency histograms and token counts are measured here, per engine request, as tokens reach the
gateway; queue and cache numbers come from the scheduler's `Stats` at scrape time.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from services.common.metric_buckets import ITERATION_TOKENS_BUCKETS, BucketCounts
from services.common.proto import myvllm_pb2 as pb

# Bucket bounds as in vLLM's metrics, so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's request_latency_buckets serve its queue / prefill / decode / inference times too.
REQUEST_PHASE_BUCKETS = E2E_BUCKETS
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
N_PARAM_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's `finished_reason` values (vllm.v1.engine.FinishReason): each is served, from 0.
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
VLLM_ENGINE = "0"
# vLLM's labels for what its series split: why a request waits (the sum is num_requests_waiting),
# the engine's sleep state, where a prompt's tokens came from and where its cached tokens did.
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
# Why vLLM's frontend refuses a request: its queue of requests, or of their tokens, is full.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
REMOTE_PREFILL_OUTCOMES = ("transferred", "nothing_to_transfer", "failed", "no_prefill_replica")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's bounds for per-request token counts."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


class Histogram(BucketCounts):
    """A histogram served with cumulative buckets; `observe` is O(log buckets)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        super().__init__(buckets)
        self.name = name  # without the `myvllm:` / `vllm:` prefix
        self.help_text = help_text
        # (The count is the +Inf bucket's: the exposition derives `_count` from it.)

    @classmethod
    def of_counts(cls, name: str, help_text: str, buckets: tuple[float, ...], counts: Iterable[int],
                  total: float) -> Histogram:
        """A histogram counted elsewhere (an engine's, shipped in its Stats)."""
        histogram = cls(name, help_text, buckets)
        counts = list(counts)
        if len(counts) == len(histogram.counts):
            histogram.counts, histogram.sum = counts, float(total)
        return histogram

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        cumulative, out = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            out.append((floatToGoString(bound), cumulative))
        return out


class _Scrape:
    """The metric families of one scrape (prometheus_client's collector interface)."""

    def __init__(self, model_name: str) -> None:
        self.names = {"myvllm:": {"model_name": model_name},
                      "vllm:": {"model_name": model_name, "engine": VLLM_ENGINE}}
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return self.families

    def add(self, kind: str, name: str, help_text: str, value: float, vllm: bool = False) -> None:
        """One gauge or counter (`name` without `_total`), under vLLM's name too if `vllm`."""
        self.add_labelled(kind, name, help_text, None, [(None, value)], vllm)

    def add_labelled(self, kind: str, name: str, help_text: str, label: str | None,
                     samples: Iterable[tuple[str | None, float]], vllm: bool = False,
                     vllm_samples: Iterable[tuple[str | None, float]] | None = None) -> None:
        """A gauge or counter with one more label (`label`), a sample per value of it; under
        vLLM's name too if `vllm` (with `vllm_samples` there, where they differ)."""
        family_class = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        by_prefix = {"myvllm:": list(samples)}
        if vllm or vllm_samples is not None:
            by_prefix["vllm:"] = by_prefix["myvllm:"] if vllm_samples is None else list(vllm_samples)
        for prefix, prefix_samples in by_prefix.items():
            labels = self.names[prefix]
            family = family_class(prefix + name, help_text, labels=[*labels, *([label] if label else [])])
            for extra, value in prefix_samples:
                family.add_metric([*labels.values(), *([extra] if label else [])], value)
            self.families.append(family)

    def add_frontend_counter(self, name: str, help_text: str, label: str,
                             samples: Iterable[tuple[str, float]]) -> None:
        """A counter of the HTTP frontend's, not an engine's: vLLM labels it by model alone."""
        samples = list(samples)
        for prefix in ("myvllm:", "vllm:"):
            family = CounterMetricFamily(prefix + name, help_text, labels=["model_name", label])
            for value_of_label, value in samples:
                family.add_metric([self.names[prefix]["model_name"], value_of_label], value)
            self.families.append(family)

    def add_info(self, name: str, help_text: str, info: Mapping[str, str], vllm: bool = True) -> None:
        """vLLM's info gauge: 1, the information in its labels (under ours, and vLLM's name if `vllm`)."""
        for prefix in ("myvllm:", "vllm:") if vllm else ("myvllm:",):
            labels = {**self.names[prefix], **info}
            family = GaugeMetricFamily(prefix + name, help_text, labels=list(labels))
            family.add_metric(list(labels.values()), 1)
            self.families.append(family)

    def add_lora_info(self, stats: pb.Stats) -> None:
        """vLLM's lora_requests_info: the adapters of running and waiting requests and the slots, in
        its labels (names comma-joined), its value the time of the scrape (vLLM's gauge labels
        neither model nor engine)."""
        labels = {"max_lora": str(stats.max_lora), "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
                  "running_lora_adapters": ",".join(stats.running_lora_adapters)}
        for prefix in ("myvllm:", "vllm:"):
            family = GaugeMetricFamily(prefix + "lora_requests_info", "Running requests' and waiting requests' "
                                       "LoRA adapters, and the adapters one step may run.", labels=list(labels))
            family.add_metric(list(labels.values()), time.time())
            self.families.append(family)

    def add_histogram(self, histogram: Histogram, vllm: bool = False) -> None:
        for prefix in ("myvllm:", "vllm:") if vllm else ("myvllm:",):
            labels = self.names[prefix]
            family = HistogramMetricFamily(prefix + histogram.name, histogram.help_text, labels=list(labels))
            family.add_metric(list(labels.values()), histogram.cumulative_buckets(), histogram.sum)
            self.families.append(family)

    def text(self) -> str:
        return generate_latest(self).decode()  # type: ignore[arg-type]  # (any object with collect())


class GatewayMetrics:
    """Everything `/metrics` reports for one served model."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Time between consecutive token batches of a request.", ITL_BUCKETS)
        self.e2e_request_latency = Histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its end.", E2E_BUCKETS)
        self.request_time_per_output_token = Histogram(
            "request_time_per_output_token_seconds", "Per request: time from its first token to its end over the "
            "tokens after the first.", ITL_BUCKETS)
        # Where each engine request's time went, on the engine's clock (its final output's timings).
        self.request_queue_time = Histogram(
            "request_queue_time_seconds", "Time spent in the WAITING phase (arrival to first scheduled).",
            REQUEST_PHASE_BUCKETS)
        self.request_prefill_time = Histogram(
            "request_prefill_time_seconds", "Time spent in the PREFILL phase (first scheduled to first token).",
            REQUEST_PHASE_BUCKETS)
        self.request_decode_time = Histogram(
            "request_decode_time_seconds", "Time spent in the DECODE phase (first token to last).",
            REQUEST_PHASE_BUCKETS)
        self.request_inference_time = Histogram(
            "request_inference_time_seconds", "Time spent in the RUNNING phase (first scheduled to last token).",
            REQUEST_PHASE_BUCKETS)
        self.time_per_prefill_token = Histogram(
            "time_per_prefill_token_request_seconds", "Per request: prefill time over its prompt tokens.",
            PREFILL_TOKEN_BUCKETS)
        self.request_params_n = Histogram("request_params_n", "The n request parameter (choices per prompt).",
                                          N_PARAM_BUCKETS)
        self.request_num_preemptions = Histogram("request_num_preemptions", "Times each finished request was "
                                                 "preempted.", REQUEST_PREEMPTIONS_BUCKETS)
        # Per-request token counts, bucketed up to the context limit (once the gateway knows it).
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.request_params_max_tokens: Histogram | None = None
        self.request_max_num_generation_tokens: Histogram | None = None
        self.request_prefill_kv_computed_tokens: Histogram | None = None
        self.prompt_tokens_cached = 0  # prompt tokens served by the prefix cache
        self.request_success: dict[str, int] = defaultdict(int)  # by finish reason
        self.prompt_tokens = 0  # of engine requests that got their first output
        self.generation_tokens = 0
        self.request_migrations = 0  # engine requests re-submitted after their replica failed
        # Cache-aware routing: prompt tokens the gateway expected the chosen replica to have
        # cached, and what its scheduler then reported (num_cached_tokens of the first output).
        self.routed_prompts = 0
        self.predicted_cached_tokens = 0
        self.actual_cached_tokens = 0
        # Prefill/decode disaggregation: prefill halves by outcome (services/gateway/disaggregation.py).
        self.remote_prefills: dict[str, int] = dict.fromkeys(REMOTE_PREFILL_OUTCOMES, 0)

    def set_max_model_len(self, max_model_len: int) -> None:
        """The engine's context limit is known: the per-request token histograms can exist."""
        if self.request_prompt_tokens is None:
            buckets = one_two_five_buckets(max_model_len)
            self.request_prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                                   buckets)
            self.request_generation_tokens = Histogram("request_generation_tokens", "Tokens generated per finished "
                                                       "request.", buckets)
            self.request_params_max_tokens = Histogram("request_params_max_tokens", "The max_tokens request "
                                                       "parameter, where given.", buckets)
            self.request_max_num_generation_tokens = Histogram(
                "request_max_num_generation_tokens", "Per prompt: the most tokens any of its n choices generated.",
                buckets)
            self.request_prefill_kv_computed_tokens = Histogram(
                "request_prefill_kv_computed_tokens", "Prompt tokens each finished request computed (its prompt "
                "less the tokens the prefix cache served).", buckets)

    def on_prompt_choices(self, n: int) -> None:
        self.request_params_n.observe(n)

    def on_prompt_done(self, max_generated: int) -> None:
        if self.request_max_num_generation_tokens is not None:
            self.request_max_num_generation_tokens.observe(max_generated)

    def on_migration(self) -> None:
        self.request_migrations += 1

    def on_remote_prefill(self, outcome: str) -> None:
        self.remote_prefills[outcome] += 1

    def on_routed_prompt(self, predicted_cached_tokens: int, actual_cached_tokens: int) -> None:
        self.routed_prompts += 1
        self.predicted_cached_tokens += predicted_cached_tokens
        self.actual_cached_tokens += actual_cached_tokens

    def timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)

    @staticmethod
    def _scheduler(scrape: _Scrape, stats: pb.Stats) -> None:
        scrape.add("gauge", "num_requests_running", "Requests in the engine's running batch.", stats.num_running,
                   vllm=True)
        scrape.add("gauge", "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting, vllm=True)
        scrape.add_labelled("gauge", "num_requests_waiting_by_reason", "Waiting requests by reason: capacity (for "
                            "room in the batch or the KV cache), deferred (passed over until their grammar compiles "
                            "or their prompt's KV arrives from a producer).", "reason",
                            zip(WAITING_REASONS, (stats.num_waiting - stats.num_waiting_deferred,
                                                  stats.num_waiting_deferred), strict=True), vllm=True)
        # (No sleep mode here: the engine is always awake.)
        scrape.add_labelled("gauge", "engine_sleep_state", "The engine's sleep state: awake 1 while it serves.",
                            "sleep_state", ((state, int(state == "awake")) for state in SLEEP_STATES), vllm=True)
        scrape.add("gauge", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage,
                   vllm=True)
        scrape.add("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   stats.prefix_cache_queries, vllm=True)
        scrape.add("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits,
                   vllm=True)
        # Where cached prompt tokens came from: this engine's blocks (device), a prefill replica's,
        # loaded by the KV connector (p2p), or the KV tier's files (disk).
        cached = {"device": stats.prefix_cache_hits, "p2p": stats.kv_transfer_loaded_tokens,
                  "disk": stats.kv_tier_hits}
        scrape.add_labelled("counter", "prompt_tokens_cached_by_source", "Prompt tokens not computed, by where "
                            "their KV came from: device (the prefix cache), p2p (loaded from a prefill replica), "
                            "disk (loaded from the KV tier).",
                            "source", ((source, cached.get(source, 0)) for source in CACHE_HIT_SOURCES), vllm=True)
        # The KV tier (--kv-offloading-size): vLLM's names for a connector's lookups, and ours for the rest.
        scrape.add("counter", "external_prefix_cache_queries", "Prompt tokens past the prefix cache's hits looked "
                   "up in the KV tier.", stats.kv_tier_queries, vllm=True)
        scrape.add("counter", "external_prefix_cache_hits", "Of those, tokens whose KV was loaded from the KV tier.",
                   stats.kv_tier_hits, vllm=True)
        scrape.add_labelled("counter", "kv_tier_loads", "KV tier loads: done (ok) and refused (failed: a file "
                            "missing, corrupt or foreign; the request computed its prompt).", "outcome",
                            (("ok", stats.kv_tier_loads), ("failed", stats.kv_tier_load_failures)))
        scrape.add("gauge", "kv_tier_blocks", "KV blocks the tier holds.", stats.kv_tier_blocks)
        scrape.add_labelled("counter", "kv_tier_offered_blocks", "Blocks the KV tier took in (stored: filled by a "
                            "step or evicted from the KV cache, and those a restarted worker found on disk) or "
                            "dropped (its write queue was full).", "outcome",
                            (("stored", stats.kv_tier_stored_blocks), ("dropped", stats.kv_tier_offers_dropped)))
        scrape.add("counter", "kv_tier_loaded_bytes", "KV bytes loaded from the tier.", stats.kv_tier_loaded_bytes)
        scrape.add("counter", "kv_tier_load_seconds", "Time the workers' load threads spent reading the tier.",
                   stats.kv_tier_load_seconds)
        scrape.add("counter", "num_preemptions", "Requests preempted by the scheduler.", stats.num_preemptions,
                   vllm=True)
        if stats.max_lora:
            scrape.add_lora_info(stats)
        scrape.add("counter", "grammar_compiles", "Structured-output grammars compiled (grammar cache misses).",
                   stats.grammar_compiles)
        scrape.add("counter", "grammar_compile_seconds", "Time spent compiling structured-output grammars.",
                   stats.grammar_compile_seconds)
        scrape.add("counter", "grammar_cache_hits", "Constrained requests whose grammar was already compiled.",
                   stats.grammar_cache_hits)
        scrape.add("counter", "grammar_compile_timeouts", "Structured-output grammars that did not compile within "
                   "--structured-outputs-compile-timeout.", stats.grammar_compile_timeouts)
        scrape.add("counter", "grammar_row_waits", "Steps a constrained request sat out because its allowed-token "
                   "row was not filled yet.", stats.grammar_row_waits)
        if stats.spec_decode_enabled:  # (vLLM serves them only with a speculative config)
            GatewayMetrics._spec_decode(scrape, stats)
        scrape.add_histogram(Histogram.of_counts(
            "iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS,
            stats.iteration_tokens_counts, stats.iteration_tokens_sum), vllm=True)
        scrape.add_info("cache_config_info", "The engine's cache configuration.", {
            "block_size": str(stats.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(stats.enable_prefix_caching),
            "num_gpu_blocks": str(stats.num_total_blocks + 1)})
        # (ours alone: vLLM serves no such metric) what `bench serve --base-url` reports the server runs
        scrape.add_info("model_config_info", "The engine's model configuration.", {
            "dtype": stats.dtype, "attention_backend": stats.attention_backend}, vllm=False)
        scrape.add("counter", "cudagraph_capture_failures", "CUDA graph captures that failed at start-up in "
                   "automatic mode (the worker then ran its decode steps eager).", stats.cudagraph_capture_failures)
        scrape.add("counter", "dp_dummy_steps", "Steps an engine of a data-parallel expert-parallel group ran with "
                   "nothing scheduled, so the group's MoE exchanges matched.", stats.num_dummy_steps)
        scrape.add("gauge", "dp_wave", "The data-parallel expert-parallel group's current wave (0 without such a "
                   "group).", stats.dp_wave)
        scrape.add("gauge", "dp_engines_running", "1 while the data-parallel expert-parallel group's wave runs, 0 "
                   "while it is paused.", int(stats.dp_engines_running))
        scrape.add_labelled("counter", "dp_wave_messages_dropped", "DP wave messages the engines and coordinator "
                            "dropped: sent outside the allowed clock skew (stale), or a nonce already taken "
                            "(replayed).", "reason",
                            (("stale", stats.dp_wave_messages_stale), ("replayed", stats.dp_wave_messages_replayed)))
        # Prefill/decode disaggregation (the KV connector), summed over the replicas.
        scrape.add("counter", "kv_transfer_saves", "Prompt KV segments written by prefill replicas (saves reported "
                   "done).", stats.kv_transfer_saves)
        scrape.add("counter", "kv_transfer_loads", "Prompt KV segments loaded by decode replicas.",
                   stats.kv_transfer_loads)
        scrape.add("counter", "kv_transfer_load_failures", "KV loads that failed (the request then computed its "
                   "prompt itself).", stats.kv_transfer_load_failures)
        scrape.add("counter", "kv_transfer_loaded_tokens", "Prompt tokens whose KV was loaded instead of computed.",
                   stats.kv_transfer_loaded_tokens)
        scrape.add_labelled("counter", "kv_transfer_bytes", "KV bytes written (save) and read (load) by the "
                            "workers' transfer threads.", "direction",
                            (("save", stats.kv_transfer_saved_bytes), ("load", stats.kv_transfer_loaded_bytes)))
        scrape.add_labelled("counter", "kv_transfer_seconds", "Time the workers' transfer threads spent writing "
                            "(save) and reading (load) KV segments.", "direction",
                            (("save", stats.kv_transfer_save_seconds), ("load", stats.kv_transfer_load_seconds)))

    @staticmethod
    def _spec_decode(scrape: _Scrape, stats: pb.Stats) -> None:
        scrape.add("counter", "spec_decode_num_drafts", "Verification rounds (a request's drafts checked in one "
                   "step).", stats.spec_decode_num_drafts, vllm=True)
        scrape.add("counter", "spec_decode_num_draft_tokens", "Draft tokens verified.",
                   stats.spec_decode_num_draft_tokens, vllm=True)
        scrape.add("counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                   stats.spec_decode_num_accepted_tokens, vllm=True)
        scrape.add_labelled("counter", "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                            "position in the draft (0 = first).", "position",
                            ((str(j), count) for j, count in enumerate(stats.spec_decode_accepted_per_pos)),
                            vllm=True)

    def _prompt_token_sources(self, scrape: _Scrape, stats: pb.Stats | None) -> None:
        """vLLM's prompt_tokens_by_source: the gateway's prompt and cache-hit counts, and the
        tokens the replicas loaded from prefill replicas or their KV tier (their Stats); the rest
        were computed."""
        loaded = stats.kv_transfer_loaded_tokens + stats.kv_tier_hits if stats is not None else 0
        computed = max(self.prompt_tokens - self.prompt_tokens_cached - loaded, 0)
        scrape.add_labelled("counter", "prompt_tokens_by_source", "Prompt tokens by source: computed here "
                            "(local_compute), served by the prefix cache (local_cache_hit), loaded from a prefill "
                            "replica or the KV tier (external_kv_transfer).", "source",
                            zip(PROMPT_TOKEN_SOURCES, (computed, self.prompt_tokens_cached, loaded), strict=True),
                            vllm=True)

    def render(self, stats: pb.Stats | None, routed: Mapping[str, int] | None = None,
               routable: Mapping[str, int] | None = None, admission_rejections: int = 0) -> str:
        """The exposition text; scheduler gauges and counters only if `stats` came back;
        engine requests routed to each replica (by address) when `routed` is given, the replicas
        routed to now (by KV role) when `routable` is; `admission_rejections`: requests refused
        because the gateway's queue (--max-queued-requests) was full."""
        scrape = _Scrape(self.model_name)
        if stats is not None:
            self._scheduler(scrape, stats)
        scrape.add("gauge", "scheduler_up", "1 if the scheduler answered this scrape.", int(stats is not None))
        # Ours: the reasons seen (stop, length and abort always); vLLM's: its five, and any other seen.
        scrape.add_labelled("counter", "request_success", "Finished requests, by finish reason.", "finished_reason",
                            ((r, self.request_success[r]) for r in sorted({*self.request_success, "stop", "length",
                                                                            "abort"})),
                            vllm_samples=((r, self.request_success[r]) for r in sorted({*self.request_success,
                                                                                       *VLLM_FINISH_REASONS})))
        scrape.add("counter", "prompt_tokens", "Prompt tokens of the engine requests that started.",
                   self.prompt_tokens, vllm=True)
        scrape.add("counter", "generation_tokens", "Tokens generated.", self.generation_tokens, vllm=True)
        scrape.add("counter", "prompt_tokens_cached", "Prompt tokens served by the prefix cache (of the engine "
                   "requests that started).", self.prompt_tokens_cached, vllm=True)
        self._prompt_token_sources(scrape, stats)
        # (No limit on queued tokens here: that reason stays 0.)
        scrape.add_frontend_counter("admission_rejections", "Requests refused because the gateway's queue was "
                                    "full (--max-queued-requests: max_num_queued_reqs).", "reason",
                                    zip(ADMISSION_REASONS, (admission_rejections, 0), strict=True))
        scrape.add("counter", "request_migrations", "Requests re-submitted to a replica after theirs failed "
                   "(request migration).", self.request_migrations)
        scrape.add("counter", "routing_predicted_cached_tokens", "Prompt tokens the router expected the chosen "
                   "replica to have cached.", self.predicted_cached_tokens)
        scrape.add("counter", "routing_actual_cached_tokens", "Prompt tokens the chosen replica served from its "
                   "prefix cache (same requests).", self.actual_cached_tokens)
        scrape.add("counter", "routing_prompts", "Engine requests counted in the two above.", self.routed_prompts)
        scrape.add_labelled("counter", "remote_prefills", "Requests sent to a prefill replica before their decode "
                            "replica (P/D disaggregation), by outcome: transferred (the decode replica loaded "
                            "the prompt's KV), nothing_to_transfer (a prompt under a block), failed or "
                            "no_prefill_replica (the decode replica computed the prompt).", "outcome",
                            sorted(self.remote_prefills.items()))
        if routable is not None:
            # (`serve` waits for every replica it started to show here before it says it serves.)
            scrape.add_labelled("gauge", "engine_replicas_routable", "Engine replicas requests are routed to "
                                "now (answering, load heard), by KV role (none: no KV connector).", "kv_role",
                                sorted(routable.items()))
        if routed:
            scrape.add_labelled("counter", "replica_requests", "Engine requests routed to each replica.", "replica",
                                sorted(routed.items()))
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.request_time_per_output_token, self.request_prompt_tokens,
                          self.request_generation_tokens, self.request_queue_time, self.request_prefill_time,
                          self.request_decode_time, self.request_inference_time, self.time_per_prefill_token,
                          self.request_params_n, self.request_params_max_tokens,
                          self.request_max_num_generation_tokens, self.request_num_preemptions,
                          self.request_prefill_kv_computed_tokens):
            if histogram is not None:
                scrape.add_histogram(histogram, vllm=True)
        return scrape.text()


class RequestTimer:
    """Feeds one engine request's token arrivals into the latency histograms and token counters."""

    def __init__(self, metrics: GatewayMetrics, arrival_time: float) -> None:
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._num_prompt_tokens: int | None = None
        self._num_cached_tokens = 0
        self._num_generated = 0

    @property
    def num_generated(self) -> int:
        return self._num_generated

    def on_prompt(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> None:
        """The engine reported the request's prompt length and its tokens served by the prefix
        cache (counted once, also if it migrates)."""
        if self._num_prompt_tokens is None:
            self._num_prompt_tokens = num_prompt_tokens
            self._num_cached_tokens = num_cached_tokens
            self._metrics.prompt_tokens += num_prompt_tokens
            self._metrics.prompt_tokens_cached += num_cached_tokens

    def on_tokens(self, num_tokens: int = 1) -> None:
        """A step's tokens arrived (several with speculative decoding: the wait is shared among
        them, one inter-token latency each; the first token's wait is the time to first token)."""
        now = time.monotonic()
        self._metrics.generation_tokens += num_tokens
        self._num_generated += num_tokens
        if self._last_token_time is None:
            self._first_token_time = now
            self._metrics.time_to_first_token.observe(now - self._arrival_time)
            for _ in range(num_tokens - 1):
                self._metrics.inter_token_latency.observe(0.0)  # they arrived with the first
        else:
            for _ in range(num_tokens):
                self._metrics.inter_token_latency.observe((now - self._last_token_time) / num_tokens)
        self._last_token_time = now

    def on_finish(self, finish_reason: str, timings: pb.RequestTimings | None = None,
                  max_tokens: int | None = None) -> None:
        """The request ended; `timings`: the engine's account of where its time went (its final
        output's); `max_tokens`: the parameter, where the client gave it."""
        metrics, now = self._metrics, time.monotonic()
        if timings is not None:
            metrics.request_queue_time.observe(timings.queued_s)
            metrics.request_prefill_time.observe(timings.prefill_s)
            metrics.request_decode_time.observe(timings.decode_s)
            metrics.request_inference_time.observe(timings.inference_s)
            metrics.request_num_preemptions.observe(timings.num_preemptions)
            if metrics.request_prefill_kv_computed_tokens is not None:
                metrics.request_prefill_kv_computed_tokens.observe((self._num_prompt_tokens or 0)
                                                                   - self._num_cached_tokens)
            if self._num_prompt_tokens:
                metrics.time_per_prefill_token.observe(timings.prefill_s / self._num_prompt_tokens)
        if max_tokens is not None and metrics.request_params_max_tokens is not None:
            metrics.request_params_max_tokens.observe(max_tokens)
        metrics.e2e_request_latency.observe(now - self._arrival_time)
        metrics.request_success[finish_reason] += 1
        if self._num_generated > 1:
            metrics.request_time_per_output_token.observe((now - self._first_token_time) / (self._num_generated - 1))
        if metrics.request_prompt_tokens is not None and metrics.request_generation_tokens is not None:
            metrics.request_prompt_tokens.observe(self._num_prompt_tokens or 0)
            metrics.request_generation_tokens.observe(self._num_generated)
