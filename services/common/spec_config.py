"""Speculative decoding settings, vLLM's `speculative_config` names, and which requests may speculate.

Shared by the offline `LLM`, `serve`, the scheduler and the worker: the dict (or JSON text)
a user writes becomes a `SpeculativeConfig`, then the proto message the worker loads it from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.config_fields import from_proto, to_proto, wire
from services.common.proto import myvllm_pb2 as pb

METHODS = ("ngram", "draft_model")
# The most draft tokens a request may carry per step (each costs a logits row and, for random
# rows, a [vocab] distribution in the rejection sampler).
MAX_SPECULATIVE_TOKENS = 16
# disable_by_batch_size when the config leaves it out: never off, as in vLLM. Verifying k drafts
# costs each request k more positions; since those attend through the decode kernel (one entry
# per token) `bench throughput`'s 64 requests gain from n-gram drafts (BENCHMARKS.md, "Speculative
# decoding"), but a workload whose drafts are mostly refused may want a limit.
DEFAULT_DISABLE_BY_BATCH_SIZE = 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config names. The worker proposes up to num_speculative_tokens drafts per
    request after each step; the scheduler schedules them as extra tokens of the request."""

    method: str = field(metadata=wire(choices=METHODS))
    num_speculative_tokens: int
    prompt_lookup_max: int = field(default=0, metadata=wire(comment="ngram: longest suffix matched"))
    prompt_lookup_min: int = field(default=0, metadata=wire(comment="ngram: shortest suffix matched"))
    model: str = field(default="", metadata=wire(comment="draft_model: the draft's HF directory (same tokenizer)"))
    # No drafts while at least this many requests run (0: never off): verifying k drafts costs
    # k extra positions per request, which a large batch pays in throughput.
    disable_by_batch_size: int = field(default=DEFAULT_DISABLE_BY_BATCH_SIZE, metadata=wire(
        comment="no drafts while this many requests run (0 = never off)"))

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1 or hi < lo:
                raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max for ngram, "
                                 f"got prompt_lookup_min={lo!r}, prompt_lookup_max={hi!r}")
        elif not self.model:
            raise ValueError("speculative_config.model (the draft model's directory) is required for draft_model")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ValueError(f"speculative_config.disable_by_batch_size must be a non-negative integer, "
                             f"got {self.disable_by_batch_size!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, as `--speculative-config` takes it); None stays None.

        ngram defaults as in vLLM: prompt_lookup_max 5 if unset, prompt_lookup_min = max when unset.
        disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE when unset, 0 = never off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        args = dict(value)
        if "method" not in args:
            # vLLM infers the method: a model means a draft model, prompt lookup means ngram.
            args["method"] = "draft_model" if args.get("model") else "ngram"
        if "num_speculative_tokens" not in args:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if args["method"] == "ngram":
            hi = args.get("prompt_lookup_max") or args.get("prompt_lookup_min") or 5
            args["prompt_lookup_max"] = hi
            args.setdefault("prompt_lookup_min", hi)
        args["model"] = args.get("model") or ""
        if args.get("disable_by_batch_size") is None:
            args["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
        return cls(**args)

    @classmethod
    def from_proto(cls, message: pb.SpeculativeConfig) -> SpeculativeConfig:
        return from_proto(cls, message)

    def to_proto(self) -> pb.SpeculativeConfig:
        return to_proto(self, pb.SpeculativeConfig)

def may_speculate(sampling: pb.SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may come from verified drafts, exactly as without them.

    Verification samples every draft position from the same processed distribution, which is
    only right when that processing does not depend on the tokens before it in this step:
    penalties, bad words (their prefixes) and grammars do, min_tokens does until it is reached;
    a seeded request keeps its per-position random stream only without speculation. Such
    requests simply get no drafts (the rest of the batch still speculates).
    """
    return not (sampling.repetition_penalty not in (0.0, 1.0) or sampling.frequency_penalty
                or sampling.presence_penalty or len(sampling.bad_words) or sampling.HasField("seed")
                or sampling.HasField("structured_outputs") or num_output_tokens < sampling.min_tokens)
