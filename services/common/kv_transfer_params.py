"""A request's kv_transfer_params (vLLM's dict) <-> the proto message, checked.

vLLM's names: a request to a producer says {"do_remote_decode": True}; its final output carries
{"do_remote_prefill": True, "remote_handle": ..., "remote_num_tokens": ..., "remote_block_hash":
hex} for the consumer request, which brings them back unchanged. Offline, they travel in
SamplingParams.extra_args["kv_transfer_params"] (vLLM's place) and RequestOutput.kv_transfer_params.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from services.common.proto import myvllm_pb2 as pb

# A transfer handle names a shared-memory segment: nothing that could leave its directory.
HANDLE_RE = re.compile(r"^mvkv-[0-9a-f]{32}$")
HASH_BYTES = 32  # services/common/block_hash.py: sha256
KEYS = ("do_remote_decode", "do_remote_prefill", "remote_handle", "remote_num_tokens", "remote_block_hash",
        "remote_host", "remote_port")
# GrpcConnector's producer worker: a DNS name or an IP address (IPv6 in brackets or bare).
HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]"                             # [IPv6]
                     r"|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*"                       # bare IPv6
                     r"|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")  # DNS name or IPv4


def check_params(params: pb.KVTransferParams) -> None:
    """ValueError naming what is wrong with `params` (whatever engine receives them)."""
    if params.do_remote_decode and params.do_remote_prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
    if params.remote_handle and not HANDLE_RE.match(params.remote_handle):
        raise ValueError(f"kv_transfer_params.remote_handle {params.remote_handle[:80]!r} is not a transfer handle")
    if params.remote_num_tokens < 0:
        raise ValueError(f"kv_transfer_params.remote_num_tokens must be >= 0, got {params.remote_num_tokens}")
    if params.remote_num_tokens and not params.remote_handle:
        raise ValueError("kv_transfer_params.remote_num_tokens without remote_handle")
    if params.remote_handle and len(params.remote_block_hash) != HASH_BYTES:
        raise ValueError(f"kv_transfer_params.remote_block_hash must be {HASH_BYTES} bytes "
                         f"({2 * HASH_BYTES} hex digits) with a remote_handle")
    if bool(params.remote_host) != bool(params.remote_port) or (params.remote_host and not params.remote_handle):
        raise ValueError("kv_transfer_params.remote_host and remote_port go together, with a remote_handle")
    if params.remote_host and not HOST_RE.match(params.remote_host):
        raise ValueError(f"kv_transfer_params.remote_host {params.remote_host[:80]!r} is not a host name or address")
    if not 0 <= params.remote_port <= 65535:
        raise ValueError(f"kv_transfer_params.remote_port must be a port (1-65535), got {params.remote_port}")


def check_source(params: pb.KVTransferParams, allowed: Collection[str]) -> None:
    """ValueError unless the producer worker `params` name (if any) is in `allowed`: a consumer's
    worker presents the internal token to it, so it must be a producer of this deployment, never
    an address a request made up."""
    address = f"{params.remote_host}:{params.remote_port}"
    if params.remote_host and address not in allowed:
        raise ValueError(f"kv_transfer_params.remote_host/remote_port {address[:300]!r} is not a KV producer's "
                         "worker this engine knows (kv_connector_extra_config.producer_addresses, or a "
                         "kv_producer entry of the signed registry)")


def params_from_dict(value: dict[str, Any] | None) -> pb.KVTransferParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_params has unknown field(s) {unknown}; known: {list(KEYS)}")
    msg = pb.KVTransferParams()
    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in value:
            if not isinstance(value[key], bool):
                raise ValueError(f"kv_transfer_params.{key} must be a bool")
            setattr(msg, key, value[key])
    if value.get("remote_handle") is not None:
        if not isinstance(value["remote_handle"], str):
            raise ValueError("kv_transfer_params.remote_handle must be a string")
        msg.remote_handle = value["remote_handle"]
    if value.get("remote_num_tokens") is not None:
        n = value["remote_num_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**31:
            raise ValueError("kv_transfer_params.remote_num_tokens must be a non-negative integer")
        msg.remote_num_tokens = n
    if value.get("remote_block_hash") is not None:
        try:
            msg.remote_block_hash = bytes.fromhex(value["remote_block_hash"])
        except (TypeError, ValueError) as e:
            raise ValueError("kv_transfer_params.remote_block_hash must be hex text") from e
    if value.get("remote_host") is not None:
        if not isinstance(value["remote_host"], str):
            raise ValueError("kv_transfer_params.remote_host must be a string")
        msg.remote_host = value["remote_host"]
    if value.get("remote_port") is not None:
        port = value["remote_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port (1-65535)")
        msg.remote_port = port
    check_params(msg)
    return msg


def params_to_dict(msg: pb.KVTransferParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if msg.do_remote_decode:
        out["do_remote_decode"] = True
    if msg.do_remote_prefill:
        out["do_remote_prefill"] = True
    if msg.remote_handle:
        out.update(remote_handle=msg.remote_handle, remote_num_tokens=msg.remote_num_tokens,
                   remote_block_hash=msg.remote_block_hash.hex())
    if msg.remote_host:
        out.update(remote_host=msg.remote_host, remote_port=msg.remote_port)
    return out
