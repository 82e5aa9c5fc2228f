"""The KV connector's settings, vLLM's `kv_transfer_config` names (prefill/decode disaggregation).

`--kv-transfer-config '{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}'`: a
producer engine prefills requests that ask for it (do_remote_decode) and keeps their prompt's KV
for a consumer engine, which loads it instead of computing it (do_remote_prefill). Read by the
scheduler (which requests wait for remote KV, whose blocks it keeps until they are saved) and by
the worker (the transport): both must agree, as speculative_config must.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.config_fields import from_proto, to_proto, wire
from services.common.kv_transfer_params import HOST_RE
from services.common.proto import myvllm_pb2 as pb

# SharedMemoryConnector: segments in a tmpfs, between engines of one host. GrpcConnector: the
# producer's worker keeps them in its memory and serves them (Worker.FetchKV) to consumers on
# any host that reaches it.
CONNECTORS = ("SharedMemoryConnector", "GrpcConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# kv_connector_extra_config, per connector. segment_ttl_s: how long a saved segment may wait for
# its consumer before the producer's worker deletes it (a consumer that never comes must not leak
# memory). shm_dir: the directory shared-memory segments live in (a tmpfs: /dev/shm where there
# is one). fetch_timeout_s: how long a consumer's worker waits for a segment from the producer's
# (a producer that hangs costs that, then a local prefill). max_buffer_bytes: the most segment
# bytes a GrpcConnector producer holds (a save past it fails: its consumer prefills locally).
# producer_addresses: the producers' worker addresses ("host:port", as their params name them) a
# GrpcConnector consumer may fetch from, presenting the internal token (with a Redis registry,
# kv_producer entries signed with the token count too: services/engine/kv_connector.py).
EXTRA_KEYS = {
    "SharedMemoryConnector": {"shm_dir": str, "segment_ttl_s": (int, float)},
    "GrpcConnector": {"segment_ttl_s": (int, float), "fetch_timeout_s": (int, float), "max_buffer_bytes": int,
                      "producer_addresses": list},
}
POSITIVE_KEYS = ("segment_ttl_s", "fetch_timeout_s", "max_buffer_bytes")
DEFAULT_SEGMENT_TTL_S = 120.0
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_BUFFER_BYTES = 4 << 30


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's kv_transfer_config: which KV connector moves a prompt's KV between engines, and this
    engine's role in prefill/decode disaggregation."""

    kv_connector: str = field(metadata=wire(choices=CONNECTORS))
    kv_role: str = field(metadata=wire(choices=ROLES))
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, metadata=wire(
        example={"segment_ttl_s": 5.0}, comment='a JSON object (connector-specific settings), "" = none'))

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict (JSON object)")
        keys = EXTRA_KEYS[self.kv_connector]
        unknown = sorted(set(extra) - set(keys))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown field(s) {unknown} for "
                             f"{self.kv_connector}; known: {sorted(keys)}")
        for key, types in keys.items():
            if key in extra and (isinstance(extra[key], bool) or not isinstance(extra[key], types)):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} has the wrong type "
                                 f"({type(extra[key]).__name__})")
        for key in POSITIVE_KEYS:
            if key in extra and not extra[key] > 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be positive, "
                                 f"got {extra[key]}")
        if "shm_dir" in extra and not extra["shm_dir"]:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shm_dir must not be empty")
        for address in extra.get("producer_addresses", []):
            host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
            if not HOST_RE.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("kv_transfer_config.kv_connector_extra_config.producer_addresses: "
                                 f"{str(address)[:80]!r} is not host:port")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def segment_ttl_s(self) -> float:
        return float(self.kv_connector_extra_config.get("segment_ttl_s", DEFAULT_SEGMENT_TTL_S))

    @property
    def shm_dir(self) -> str | None:
        return self.kv_connector_extra_config.get("shm_dir")

    @property
    def fetch_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S))

    @property
    def max_buffer_bytes(self) -> int:
        return int(self.kv_connector_extra_config.get("max_buffer_bytes", DEFAULT_MAX_BUFFER_BYTES))

    @property
    def producer_addresses(self) -> frozenset[str]:
        return frozenset(self.kv_connector_extra_config.get("producer_addresses", ()))

    @property
    def crosses_hosts(self) -> bool:
        """Whether producer and consumer may run on different hosts (containers, pods)."""
        return self.kv_connector == "GrpcConnector"

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """From vLLM's dict (or its JSON text, as `--kv-transfer-config` takes it); None stays None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict (JSON object), got {type(value).__name__}")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown field(s) {unknown}; known: {sorted(known)}")
        for key in ("kv_connector", "kv_role"):
            if key not in value:
                raise ValueError(f"kv_transfer_config.{key} is required")
        return cls(kv_connector=value["kv_connector"], kv_role=value["kv_role"],
                   kv_connector_extra_config=dict(value.get("kv_connector_extra_config") or {}))

    @classmethod
    def from_proto(cls, message: pb.KVTransferConfig) -> KVTransferConfig:
        return from_proto(cls, message)

    def to_proto(self) -> pb.KVTransferConfig:
        return to_proto(self, pb.KVTransferConfig)
