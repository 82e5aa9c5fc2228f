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
gateway without the token's MAC drops it. Wave numbers only grow: a group restarted by `serve`
continues from the number in Redis.
"""

from __future__ import annotations

import json
import time

from services.common.redis_registry import BadEntry, json_object, sign_entry, verify_entry

FIRST_REQ = "FIRST_REQ"
START_WAVE = "START_WAVE"
START_DP_WAVE = "START_DP_WAVE"
_TO_COORDINATOR = (FIRST_REQ, START_WAVE)
MAX_WAVE = 2**62  # far beyond any real count; a bigger number is a forgery or a bug


def wave_key(group: str) -> str:
    return f"myvllm:dp:{group}:wave"


def coordinator_channel(group: str) -> str:
    return f"myvllm:dp:{group}:coordinator"


def engines_channel(group: str) -> str:
    return f"myvllm:dp:{group}:engines"


def _is_count(value: object, limit: int = MAX_WAVE) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def encode_message(channel: str, message: dict, token: str | None) -> str:
    """`message` as published on `channel`, signed when there is a token."""
    return json.dumps(sign_entry(message, channel, token))


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
    return message


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
