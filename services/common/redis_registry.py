"""The replicas' registry in Redis: where it is, and which of its entries a gateway may trust.

Every scheduler started with a Redis URL writes one entry to the hash `myvllm:engines` (field:
its engine id; value: JSON {address, num_waiting, num_running, kv_cache_usage,
prefill_tokens_per_s, step_s, ts, mac}); every gateway reading that hash routes requests to the
addresses it finds there and presents them the internal token. Redis is therefore no trust root
of its own:

- **Entries are signed.** With an internal token (`--internal-token` / $MYVLLM_INTERNAL_TOKEN),
  a scheduler adds `mac`: HMAC-SHA256, keyed by a key derived from the token, over its engine
  id and every other field of the entry (canonical JSON). A gateway with a token takes only
  entries whose MAC checks out (compared in constant time): whoever can write to Redis without
  holding the token can neither add a replica, move one to another address, alter its load,
  nor reuse one entry's MAC for another. Such an entry is never dialled, so the token never
  reaches it.
- **Without a token nothing is signed**: entries carry no `mac`, and a gateway without a token
  takes them as before (it has no secret to leak, and nothing to check with). A gateway *with*
  a token refuses unsigned entries: its schedulers need the same token.
- **What a MAC cannot stop**: a signed entry copied back verbatim while it is still fresh (its
  `ts` within the gateway's max age, 5 s) names a genuine replica's address, nothing else.
- **Redis wants a password.** `myvllm serve` starts its redis-server with a random one per
  run; the URL carrying it (`redis://:PASSWORD@host:port/0`, any form redis-py accepts) reaches
  the scheduler and gateway through $MYVLLM_REDIS_URL, which `--redis` overrides, so it need
  not show on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from services.common.kv_transfer_config import ROLES

REDIS_URL_ENV = "MYVLLM_REDIS_URL"
# The hash every scheduler writes its entry to and every gateway reads.
ENGINES_KEY = "myvllm:engines"
MAC_FIELD = "mac"
# An entry's kv_role: its --kv-transfer-config role, "" (or absent) without one.
KV_ROLES = ("", *ROLES)
_KEY_LABEL = b"myvllm:engines entry MAC v1"
# A GrpcConnector producer's entry: its worker's address, as its kv_transfer_params name it. A
# consumer's worker presents the internal token only there (services/scheduler/kv_producers.py).
KV_ADDRESS_FIELD = "kv_address"
# Bound on a published measurement: far beyond any real rate or step time, and small enough that
# costs built from it stay finite.
MAX_MEASUREMENT = 1e12


def redis_url_from_env(url: str | None = None) -> str | None:
    """An explicit URL wins; else $MYVLLM_REDIS_URL; empty means none."""
    if url is None:
        url = os.environ.get(REDIS_URL_ENV)
    return url or None


def redact_redis_url(url: str) -> str:
    """`url` fit for a log line: any password replaced by `***`."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<redis URL>"


class BadEntry(ValueError):
    """A registry entry that must not be routed to; the message says why."""


def _entry_key(token: str) -> bytes:
    # A key of its own, derived from the token: a MAC is never the token used for anything else.
    return hmac.new(token.encode(), _KEY_LABEL, hashlib.sha256).digest()


def _signed_bytes(engine_id: str, entry: dict) -> bytes:
    fields = {k: v for k, v in entry.items() if k != MAC_FIELD}
    return json.dumps([engine_id, fields], sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def entry_mac(token: str, engine_id: str, entry: dict) -> str:
    """The MAC of `entry` (every field but `mac`) published under `engine_id`, hex."""
    return hmac.new(_entry_key(token), _signed_bytes(engine_id, entry), hashlib.sha256).hexdigest()


def sign_entry(entry: dict, engine_id: str, token: str | None) -> dict:
    """`entry` as its scheduler publishes it: with its MAC when there is a token, else unsigned."""
    fields = {k: v for k, v in entry.items() if k != MAC_FIELD}
    if token:
        fields[MAC_FIELD] = entry_mac(token, engine_id, fields)
    return fields


def verify_entry(entry: dict, engine_id: str, token: str | None) -> None:
    """Raises `BadEntry` unless `entry` may be routed to by a gateway holding `token`: with a
    token, its MAC must match (constant-time); without one, any entry passes."""
    if not token:
        return
    mac = entry.get(MAC_FIELD)
    if mac is None:
        raise BadEntry("unsigned (no MAC) while this gateway has an internal token: "
                       "its scheduler needs the same --internal-token")
    if not isinstance(mac, str) or not mac.isascii():
        raise BadEntry("malformed MAC")
    try:
        want = entry_mac(token, engine_id, entry)
    except (TypeError, ValueError):
        raise BadEntry("fields that cannot be signed") from None
    if not hmac.compare_digest(want, mac):
        raise BadEntry("MAC does not match (forged, altered, or signed with another token)")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _address(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 255 and value.isprintable() \
        and not any(c.isspace() for c in value)


def measurement(value: object) -> float:
    """A replica's measured pace (prefill_tokens_per_s, step_s) as routing may use it: a finite
    number in (0, MAX_MEASUREMENT], else 0.0 (not measured: the router falls back). Never a
    reason to refuse an entry: an older scheduler publishes none, a fresh one 0 until it steps."""
    if not _number(value) or not 0.0 < value <= MAX_MEASUREMENT:
        return 0.0
    return float(value)


def json_object(raw: bytes | str) -> dict:
    """`raw` parsed as a JSON object; `BadEntry` for anything else."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadEntry("not JSON") from None
    if not isinstance(value, dict):
        raise BadEntry("not a JSON object")
    return value


def is_group_name(value: object) -> bool:
    """A data-parallel expert-parallel group's name (it goes into Redis key names:
    services/common/dp_wave.py): printable, no spaces or ':', at most 64 characters."""
    return isinstance(value, str) and 0 < len(value) <= 64 and value.isprintable() \
        and not any(c.isspace() or c == ":" for c in value)


def parse_entry(raw: bytes | str) -> dict:
    """One registry value as a dict with the fields a gateway reads, type-checked; raises
    `BadEntry` for anything else (so one bad entry never stops the others being read)."""
    entry = json_object(raw)
    address = entry.get("address")
    if not _address(address):
        raise BadEntry("no usable address")
    if not _count(entry.get("num_waiting")) or not _count(entry.get("num_running")):
        raise BadEntry("num_waiting / num_running are not counts")
    if not _number(entry.get("ts")):
        raise BadEntry("no timestamp")
    usage = entry.get("kv_cache_usage", 0.0)
    if not _number(usage) or not 0.0 <= usage <= 1.0:
        raise BadEntry("kv_cache_usage is not a fraction")
    if entry.get("kv_role", "") not in KV_ROLES:
        raise BadEntry("kv_role is not a KV transfer role")
    kv_address = entry.get(KV_ADDRESS_FIELD)  # a GrpcConnector producer's worker
    if kv_address is not None and not _address(kv_address):
        raise BadEntry(f"{KV_ADDRESS_FIELD} is not an address")
    group = entry.get("dp_group")  # an engine of a data-parallel expert-parallel group (common/dp_wave.py)
    if group is not None and not is_group_name(group):
        raise BadEntry("dp_group is not a name")
    if group is not None and (not _count(entry.get("dp_rank")) or entry["dp_rank"] >= 4096):
        raise BadEntry("dp_rank is not a rank")
    return entry


async def read_engine_loads(client: Any, max_age_s: float = 10.0, token: str | None = None,
                            on_reject: Callable[[str, str | None, str], None] | None = None) -> dict[str, dict]:
    """Fresh load entries of every replica, by engine id: the well-formed ones whose `ts` is
    within `max_age_s` and, when `token` is given, whose MAC checks out. Every other entry but a
    stale one is left out with `on_reject(engine id, address or None, why)`."""
    entries = await client.hgetall(ENGINES_KEY)
    now = time.time()
    loads = {}
    for field, raw in entries.items():
        engine_id = field.decode(errors="replace") if isinstance(field, bytes) else field
        address = None
        try:
            value = parse_entry(raw)
            address = value["address"]
            if now - value["ts"] > max_age_s:
                continue  # stale: its scheduler stopped publishing (or a leftover of an earlier run)
            verify_entry(value, engine_id, token)
        except BadEntry as e:
            if on_reject is not None:
                on_reject(engine_id, address, str(e))
            continue
        loads[engine_id] = value
    return loads


def kv_producer_addresses(entries: dict[str, dict]) -> frozenset[str]:
    """The producers' worker addresses among `entries` (as `read_engine_loads` returns them)."""
    return frozenset(e[KV_ADDRESS_FIELD] for e in entries.values()
                     if KV_ADDRESS_FIELD in e and e.get("kv_role") in ("kv_producer", "kv_both"))
