"""Replica entries in Redis are signed (services/common/redis_registry.py): a scheduler with
the internal token adds an HMAC-SHA256 of its entry; a gateway with the token routes only to
entries whose MAC checks out, logging every other one once. No processes here: the gateway
with a real redis-server (with a password) and forged entries is in test_dp_routing.py,
serve's password-protected redis-server in test_scaling.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.common.redis_registry import (
    ENGINES_KEY,
    MAC_FIELD,
    BadEntry,
    parse_entry,
    read_engine_loads,
    redact_redis_url,
    redis_url_from_env,
    sign_entry,
    verify_entry,
)
from services.gateway.router import ReplicaRouter
from services.scheduler.load_reporter import LoadReporter

TOKEN = "registry-test-token"


def _entry(address: str = "10.0.0.1:50051", **fields: object) -> dict:
    return {"address": address, "num_waiting": 1, "num_running": 2, "kv_cache_usage": 0.25, "ts": 1700000000.5,
            **fields}


# ---------------------------------------------------------------------- sign / verify


def test_a_signed_entry_verifies_and_survives_the_json_round_trip() -> None:
    signed = sign_entry(_entry(), "replica-0", TOKEN)
    assert isinstance(signed[MAC_FIELD], str) and len(signed[MAC_FIELD]) == 64
    verify_entry(signed, "replica-0", TOKEN)
    verify_entry(json.loads(json.dumps(signed)), "replica-0", TOKEN)  # what a gateway reads back
    assert sign_entry(signed, "replica-0", TOKEN) == signed  # re-signing replaces the MAC, not adds to it


@pytest.mark.parametrize("change", [
    {"address": "10.6.6.6:50051"}, {"num_waiting": 0}, {"num_running": 3}, {"kv_cache_usage": 0.0},
    {"ts": 1700000009.5}, {"extra": "field"},
])
def test_a_tampered_field_fails(change: dict) -> None:
    signed = sign_entry(_entry(), "replica-0", TOKEN)
    with pytest.raises(BadEntry, match="MAC does not match"):
        verify_entry({**signed, **change}, "replica-0", TOKEN)


def test_another_key_fails() -> None:
    signed = sign_entry(_entry(), "replica-0", "some-other-token")
    with pytest.raises(BadEntry, match="MAC does not match"):
        verify_entry(signed, "replica-0", TOKEN)


def test_a_missing_or_malformed_mac_fails_when_the_gateway_has_a_token() -> None:
    unsigned = sign_entry(_entry(), "replica-0", None)
    assert MAC_FIELD not in unsigned
    with pytest.raises(BadEntry, match="unsigned"):
        verify_entry(unsigned, "replica-0", TOKEN)
    for mac in (123, "é" * 64, ""):
        with pytest.raises(BadEntry):
            verify_entry({**unsigned, MAC_FIELD: mac}, "replica-0", TOKEN)


def test_without_a_token_entries_are_unsigned_and_taken_as_they_are() -> None:
    verify_entry(_entry(), "replica-0", None)
    verify_entry(sign_entry(_entry(), "replica-0", TOKEN), "replica-0", None)  # nothing to check with


def test_a_mac_replayed_on_another_address_or_engine_id_fails() -> None:
    a = sign_entry(_entry("10.0.0.1:50051"), "replica-0", TOKEN)
    b = sign_entry(_entry("10.0.0.2:50051"), "replica-1", TOKEN)
    with pytest.raises(BadEntry, match="MAC does not match"):  # B's fields, A's MAC
        verify_entry({**b, MAC_FIELD: a[MAC_FIELD]}, "replica-1", TOKEN)
    with pytest.raises(BadEntry, match="MAC does not match"):  # A's MAC, fields re-addressed
        verify_entry({**a, "address": "10.6.6.6:50051"}, "replica-0", TOKEN)
    with pytest.raises(BadEntry, match="MAC does not match"):  # A's whole entry under another engine id
        verify_entry(a, "replica-9", TOKEN)


@pytest.mark.parametrize(("raw", "why"), [
    (b"not json {", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[1, 2]", "not a JSON object"),
    (json.dumps(_entry(address="")), "address"), (json.dumps(_entry(address=7)), "address"),
    (json.dumps(_entry(address="a b:1")), "address"), (json.dumps(_entry(num_waiting=True)), "counts"),
    (json.dumps(_entry(num_running=-1)), "counts"), (json.dumps(_entry(num_running="2")), "counts"),
    (json.dumps(_entry(ts=None)), "timestamp"), (json.dumps(_entry(ts=float("nan"))), "timestamp"),
    (json.dumps(_entry(kv_cache_usage=1.5)), "fraction"),
    (json.dumps({**_entry(), "dp_group": "a b", "dp_rank": 0}), "dp_group"),
    (json.dumps({**_entry(), "dp_group": 3, "dp_rank": 0}), "dp_group"),
    (json.dumps({**_entry(), "dp_group": "a:b", "dp_rank": 0}), "dp_group"),  # (it goes into key names)
    (json.dumps({**_entry(), "dp_group": "g", "dp_rank": -1}), "dp_rank"),
    (json.dumps({**_entry(), "dp_group": "g"}), "dp_rank"),
])
def test_a_malformed_entry_is_refused_with_a_reason(raw: bytes | str, why: str) -> None:
    with pytest.raises(BadEntry, match=why):
        parse_entry(raw)


def test_redis_urls_come_from_the_environment_and_are_logged_without_their_password(monkeypatch) -> None:
    monkeypatch.setenv("MYVLLM_REDIS_URL", "redis://:from-env@127.0.0.1:6379/0")
    assert redis_url_from_env() == "redis://:from-env@127.0.0.1:6379/0"
    assert redis_url_from_env("redis://h:1/0") == "redis://h:1/0"
    monkeypatch.setenv("MYVLLM_REDIS_URL", "")
    assert redis_url_from_env() is None
    assert redact_redis_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_redis_url("rediss://user:s3cret@[::1]:6380/1") == "rediss://user:***@[::1]:6380/1"
    assert redact_redis_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# ---------------------------------------------------------------------- reporter -> reader -> router


class FakeRedis:
    """The two hash commands the reporter and the reader use."""

    def __init__(self) -> None:
        self.hash: dict[bytes, bytes] = {}

    async def hset(self, key: str, field: str, value: str) -> None:
        assert key == ENGINES_KEY
        self.hash[field.encode()] = value.encode()

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        assert key == ENGINES_KEY
        return dict(self.hash)

    async def aclose(self) -> None:
        pass


async def _send(fake: FakeRedis, engine_id: str, address: str, token: str | None) -> None:
    """What a scheduler's reporter writes (num_waiting 1, num_running 2, KV usage 0.5)."""
    reporter = LoadReporter("redis://127.0.0.1:1", engine_id, address, token=token)  # never dialled
    reporter.client = fake
    await reporter._send(pb.Load(num_waiting=1, num_running=2, kv_cache_usage=0.5))


def _publish(fake: FakeRedis, engine_id: str, address: str, token: str | None) -> None:
    asyncio.run(_send(fake, engine_id, address, token))


def test_the_reader_takes_only_what_the_token_signed() -> None:
    fake = FakeRedis()
    _publish(fake, "good", "10.0.0.1:1", TOKEN)
    _publish(fake, "unsigned", "10.0.0.2:1", None)
    _publish(fake, "other-key", "10.0.0.3:1", "another-token")
    fake.hash[b"garbage"] = b"\x00not json"
    stale = sign_entry(_entry("10.0.0.4:1", ts=time.time() - 60), "stale", TOKEN)
    fake.hash[b"stale"] = json.dumps(stale).encode()
    rejected: list[tuple] = []

    loads = asyncio.run(read_engine_loads(fake, token=TOKEN, on_reject=lambda *r: rejected.append(r)))
    assert {k: v["address"] for k, v in loads.items()} == {"good": "10.0.0.1:1"}
    assert loads["good"]["num_waiting"] == 1 and loads["good"]["kv_cache_usage"] == 0.5
    assert sorted((engine_id, address) for engine_id, address, _ in rejected) == [
        ("garbage", None), ("other-key", "10.0.0.3:1"), ("unsigned", "10.0.0.2:1")]  # stale: silently
    # A gateway without a token takes every well-formed fresh entry, signed or not.
    assert set(asyncio.run(read_engine_loads(fake))) == {"good", "unsigned", "other-key"}


def test_the_router_never_adds_a_refused_entry_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeRedis()
    _publish(fake, "good", "10.0.0.1:1", TOKEN)
    forged = {**json.loads(fake.hash[b"good"]), "address": "10.6.6.6:1"}  # a real MAC, re-addressed
    fake.hash[b"forged"] = json.dumps(forged).encode()

    async def scenario() -> None:
        router = ReplicaRouter([], redis_url="redis://127.0.0.1:1", internal_token=TOKEN)  # never dialled
        router._redis = fake
        try:
            for _ in range(4):
                await _send(fake, "good", "10.0.0.1:1", TOKEN)  # fresh loads, the forged entry kept fresh too
                fake.hash[b"forged"] = json.dumps({**forged, "ts": time.time()}).encode()
                await router.refresh()
            assert list(router.replicas) == ["10.0.0.1:1"]
        finally:
            await router.close()

    with caplog.at_level(logging.WARNING, logger="services.gateway.router"):
        asyncio.run(scenario())
    refused = [r.getMessage() for r in caplog.records if "ignoring redis entry" in r.getMessage()]
    assert len(refused) == 1 and "'forged'" in refused[0] and "10.6.6.6:1" in refused[0], refused
