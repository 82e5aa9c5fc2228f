"""The DP coordinator's wave state in Redis: the contract between the engines of a data-parallel
expert-parallel group, their coordinator and the gateways (docs/design.md, "Waves").

The engines of such a group step in lockstep while a *wave* runs and pause together when none
has work left (services/engine/step_loop.py). Redis holds:

- hash `myvllm:dp:<group>:wave`, fields `current_wave` (the wave running, or the next one to run
  while paused) and `engines_running` (0 / 1), `ts`, and `mac` when there is an internal token:
  written by the coordinator (the scheduler of DP rank 0), read by gateways and metrics;
- per engine `[waiting, running]`: its entry in `myvllm:engines` (services/scheduler/
  load_reporter.py), which also carries `dp_group` and `dp_rank`;
- channel `myvllm:dp:<group>:coordinator`, messages to the coordinator: `FIRST_REQ` {engine,
  wave} from a gateway that sends a request to a paused group, `START_WAVE` {engine, wave} from
  an engine that holds work while paused (a request that came with an older wave: the sender
  missed the wave's end; or one that arrived as the wave ended);
- channel `myvllm:dp:<group>:engines`, messages to every engine: `START_DP_WAVE` {wave,
  exclude} (the engine that asked is already stepping).

Messages are JSON objects; with an internal token each carries a MAC (HMAC-SHA256 over the
channel name and its other fields, services/common/redis_registry.py's scheme) and an engine or
gateway without the token's MAC drops it. Every message also carries `ts` (the sender's clock)
and `nonce` (random), both under the MAC: a receiver drops a message whose `ts` is more than
`MESSAGE_SKEW_S` from its own clock (stale) or whose nonce it has already taken (replayed), so a
captured message cannot start a paused group again, now or later (`MessageGuard`). Wave numbers
only grow: a group restarted by `serve` continues from the number in Redis, and no message moves
a wave number back.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections import OrderedDict

from services.common.redis_registry import BadEntry, json_object, sign_entry, verify_entry

FIRST_REQ = "FIRST_REQ"
START_WAVE = "START_WAVE"
START_DP_WAVE = "START_DP_WAVE"
_TO_COORDINATOR = (FIRST_REQ, START_WAVE)
MAX_WAVE = 2**62  # far beyond any real count; a bigger number is a forgery or a bug
# How far a message's `ts` may be from the receiver's clock: the clock skew between hosts plus
# Redis's delivery delay. A nonce is remembered for as long as its message could pass this check.
MESSAGE_SKEW_S = 5.0
# The nonces a receiver remembers at most. Legitimate messages come a few a second (one per wave
# start, one ask a second per engine holding work) and a replayer cannot make new ones, so only a
# holder of the token (who could sign anything anyway) can fill it; then the oldest is forgotten.
MAX_SEEN_NONCES = 4096
NONCE_BYTES = 12


def wave_key(group: str) -> str:
    return f"myvllm:dp:{group}:wave"


def coordinator_channel(group: str) -> str:
    return f"myvllm:dp:{group}:coordinator"


def engines_channel(group: str) -> str:
    return f"myvllm:dp:{group}:engines"


def _is_count(value: object, limit: int = MAX_WAVE) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def check_request_wave(wave: int) -> None:
    """Raises ValueError naming `dp_wave` unless `wave` is a wave number a request may carry."""
    if not _is_count(wave):
        raise ValueError(f"dp_wave {wave} is not a wave number (0 <= dp_wave < {MAX_WAVE})")


def encode_message(channel: str, message: dict, token: str | None) -> str:
    """`message` as published on `channel`, stamped with the time and a fresh nonce, signed when
    there is a token."""
    stamped = {**message, "ts": time.time(), "nonce": secrets.token_hex(NONCE_BYTES)}
    return json.dumps(sign_entry(stamped, channel, token))


def decode_message(channel: str, raw: bytes | str, token: str | None, num_engines: int) -> dict:
    """A message read from `channel`, checked; raises `BadEntry` for anything else (so a stray or
    forged message is dropped, never acted on)."""
    message = json_object(raw)
    verify_entry(message, channel, token)
    kind = message.get("type")
    expected = _TO_COORDINATOR if channel.endswith(":coordinator") else (START_DP_WAVE,)
    if kind not in expected:
        raise BadEntry(f"unexpected message type {kind!r} on {channel}")
    if not _is_count(message.get("wave")):
        raise BadEntry("wave is not a count")
    engine = message.get("exclude" if kind == START_DP_WAVE else "engine")
    if not (engine == -1 and kind == START_DP_WAVE) and not _is_count(engine, num_engines):
        raise BadEntry(f"engine {engine!r} is not one of the group's {num_engines}")
    ts = message.get("ts")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
        raise BadEntry("ts is not a time")
    nonce = message.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES or not all(c in "0123456789abcdef" for c in nonce):
        raise BadEntry("nonce is not a nonce")
    return message


class StaleMessage(BadEntry):
    """A well-formed message whose timestamp is outside the receiver's window."""


class ReplayedMessage(BadEntry):
    """A well-formed message whose nonce the receiver has already taken."""


class MessageGuard:
    """One receiver's check of decoded messages' freshness: `ts` within `MESSAGE_SKEW_S` of now,
    nonce not seen before. Each nonce is kept until its message would be stale anyway (then it
    is forgotten), so the seen-set is bounded by the messages of one window. Counts what it drops."""

    def __init__(self, skew_s: float = MESSAGE_SKEW_S, max_seen: int = MAX_SEEN_NONCES) -> None:
        self.skew_s, self.max_seen = skew_s, max_seen
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when to forget it, in arrival order
        self.num_stale = 0
        self.num_replayed = 0

    def admit(self, message: dict, now: float | None = None) -> None:
        """Raises `StaleMessage` or `ReplayedMessage` (and counts it) unless `message` is fresh
        and new; a fresh new one is remembered."""
        now = time.time() if now is None else now
        while self._seen and next(iter(self._seen.values())) <= now:
            self._seen.popitem(last=False)
        ts, nonce = message["ts"], message["nonce"]
        if abs(now - ts) > self.skew_s:
            self.num_stale += 1
            raise StaleMessage(f"sent at {ts:.3f}, {now - ts:+.1f}s from this clock (more than {self.skew_s:g}s)")
        if nonce in self._seen:
            self.num_replayed += 1
            raise ReplayedMessage(f"nonce {nonce} already taken (a replayed message)")
        if len(self._seen) >= self.max_seen:
            self._seen.popitem(last=False)
        # A message stamped ts passes the check until ts + skew; arrivals come in time order, so
        # the front of the dict is always the first to forget (ts <= now + skew).
        self._seen[nonce] = now + 2 * self.skew_s


def wave_entry(current_wave: int, engines_running: bool, token: str | None, group: str) -> dict[str, str]:
    """The wave hash's fields as the coordinator writes them."""
    entry = sign_entry({"current_wave": current_wave, "engines_running": int(engines_running), "ts": time.time()},
                       wave_key(group), token)
    return {k: json.dumps(v) if not isinstance(v, str) else v for k, v in entry.items()}


def parse_wave_entry(fields: dict, token: str | None, group: str) -> tuple[int, bool] | None:
    """(current_wave, engines_running) from the wave hash; None when absent or not to be trusted."""
    if not fields:
        return None
    try:
        decoded = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                   for k, v in fields.items()}
        entry = {k: (v if k == "mac" else json.loads(v)) for k, v in decoded.items()}
        verify_entry(entry, wave_key(group), token)
    except (ValueError, UnicodeDecodeError, BadEntry):
        return None
    wave, running = entry.get("current_wave"), entry.get("engines_running")
    if not _is_count(wave) or running not in (0, 1):
        return None
    return wave, bool(running)
