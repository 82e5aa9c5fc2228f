"""The pooling runner's settings, vLLM's names: `runner`, `convert` and `pooler_config`.

Shared by the offline `LLM`, `serve`, the scheduler, the worker and the gateway: `--pooler-config`
(a dict or its JSON text) becomes a `PoolerConfig`, then the proto message inside ModelConfig.
The rules that tie them together (pooling implies convert "embed" on a causal LM, prefix caching
off) live in `VllmConfig` (services/common/config.py), once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.config_fields import from_proto, to_proto, wire
from services.common.proto import myvllm_pb2 as pb

RUNNERS = ("generate", "pooling")
CONVERTS = ("none", "embed")
POOLING_TYPES = ("LAST", "MEAN")

# What a generation route answers on a pooling engine, and /v1/embeddings on a generate one
# (the engine refuses the same requests with the same words, so a raw gRPC client reads them too).
POOLING_ONLY_MESSAGE = ("this model runs the pooling runner (--runner pooling): it serves embeddings only "
                        "(/v1/embeddings, LLM.embed); generation requests are refused")
GENERATE_ONLY_MESSAGE = ("embeddings need the pooling runner: serve the model with --runner pooling "
                         "(LLM(..., runner=\"pooling\")); this one runs the generate runner")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's PoolerConfig: how a pooling model turns a prompt's hidden states into one vector.
    Defaults as vLLM's for decoder LMs served as embedding models (e.g. Qwen3-Embedding): the last
    token, L2-normalized."""

    pooling_type: str = field(default="LAST", metadata=wire(
        choices=POOLING_TYPES, comment="the prompt's last token (LAST) or the mean over every prompt token (MEAN)"))
    normalize: bool = field(default=True, metadata=wire(comment="L2-normalize the pooled vector"))

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
        """From vLLM's dict (or its JSON text, as `--pooler-config` takes it); None stays None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {sorted(unknown)} (known: pooling_type, normalize)")
        pooling_type = value.get("pooling_type", "LAST")
        return cls(pooling_type=pooling_type.upper() if isinstance(pooling_type, str) else pooling_type,
                   normalize=value.get("normalize", True))

    def to_proto(self) -> pb.PoolerConfig:
        return to_proto(self, pb.PoolerConfig)

    @classmethod
    def from_proto(cls, message: pb.PoolerConfig) -> PoolerConfig:
        return from_proto(cls, message)

def dimensions_error(dimensions: int, hidden_size: int, is_matryoshka: bool,
                     matryoshka_dimensions: list[int] | tuple[int, ...] = ()) -> str | None:
    """Why a request may not ask for `dimensions` (None: it may; 0 = the full size). vLLM's rule:
    only a model whose HF config says it was trained Matryoshka-style (`is_matryoshka`, or a
    `matryoshka_dimensions` list) may cut its embeddings, and only to a listed size if it lists
    them. The engine answers it as a 400; the worker refuses a step that carries it anyway."""
    if dimensions == 0:
        return None
    if not is_matryoshka:
        return (f"dimensions: this model does not support Matryoshka representation (no is_matryoshka or "
                f"matryoshka_dimensions in its config): changing the output dimensions would give poor results; "
                f"leave dimensions out for the full {hidden_size}")
    if not 1 <= dimensions <= hidden_size:
        return f"dimensions: {dimensions} outside [1, {hidden_size}] (the model's hidden size)"
    if matryoshka_dimensions and dimensions not in matryoshka_dimensions:
        return f"dimensions: {dimensions} is not one of the model's matryoshka_dimensions {list(matryoshka_dimensions)}"
    return None


def matryoshka_of(hf_config: Any) -> tuple[bool, list[int]]:
    """(is_matryoshka, matryoshka_dimensions) from an HF config, as vLLM reads them."""
    dims = getattr(hf_config, "matryoshka_dimensions", None) or []
    return bool(getattr(hf_config, "is_matryoshka", False) or dims), [int(d) for d in dims]


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams as the offline `LLM.embed` takes them (the HTTP API's `dimensions`)."""

    dimensions: int | None = None

    def to_proto(self) -> pb.PoolingParams:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        return pb.PoolingParams(dimensions=self.dimensions or 0)
