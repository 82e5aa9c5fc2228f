"""Prefill/decode disaggregation's gateway and serve pieces without model processes: the router
picks prefill halves among prefill replicas and decodes elsewhere (prefill-only replicas only when
nothing else is up), disaggregates only what the decode replica has not cached; the prefill half
(with fake replica clients) hands its params on, tries the next prefill replica when one fails and
gives up to a local prefill otherwise, counting each outcome; Redis entries carry the role; serve's
flags become per-replica roles, and deploy refuses them."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from services.client.grpc_client import RequestRejected, SchedulerUnavailable
from services.common import redis_registry
from services.common.proto import myvllm_pb2 as pb
from services.entrypoints.topology import (
    LocalPlacement,
    Topology,
    add_topology_args,
    check_disaggregation,
    kv_transfer_config_of,
    num_replicas,
    processes,
)
from services.gateway.disaggregation import remote_prefill, wants_remote_prefill
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import ResumableRequest
from services.gateway.router import ReplicaRouter
from services.gateway.routing import RoutePrompt, RoutingConfig, RoutingPolicy

HANDLE = "mvkv-" + "a" * 32


def _router(roles: dict[str, str], policy: RoutingPolicy = RoutingPolicy.LOAD, min_tokens: int = 0) -> ReplicaRouter:
    router = ReplicaRouter(list(roles), routing=RoutingConfig(policy=policy, remote_prefill_min_tokens=min_tokens))
    for address, role in roles.items():
        router.replicas[address].kv_role = role
    return router


def test_prefills_go_to_prefill_replicas_and_decodes_elsewhere_while_any_is_up() -> None:
    router = _router({"p:1": "kv_producer", "d:1": "kv_consumer", "d:2": "kv_consumer"})
    prompt = RoutePrompt(list(range(100)))
    assert {router.pick(prompt=prompt).address for _ in range(6)} == {"d:1", "d:2"}
    assert {router.pick(prompt=prompt, prefill=True).address for _ in range(3)} == {"p:1"}
    router.replicas["p:1"].healthy = False
    with pytest.raises(SchedulerUnavailable, match="no prefill replica"):
        router.pick(prefill=True)
    for d in ("d:1", "d:2"):
        router.replicas[d].healthy = False
    router.replicas["p:1"].healthy = True
    assert router.pick(prompt=prompt).address == "p:1"  # a prefill replica is a whole engine
    assert router.ranked()[0].address == "p:1"
    router.replicas["d:2"].healthy = True
    assert [r.address for r in router.ranked()][:2] == ["d:2", "p:1"]


def test_only_uncached_prompts_on_a_replica_that_loads_are_disaggregated() -> None:
    router = _router({"p:1": "kv_producer", "d:1": "kv_consumer", "c:1": ""})
    decode, colocated = router.replicas["d:1"], router.replicas["c:1"]
    prompt = RoutePrompt(list(range(1000, 1040)))
    assert router.disaggregates(decode, prompt) and not router.disaggregates(colocated, prompt)
    decode.index.apply(pb.KvEventBatch(seq=1, snapshot=True, block_size=16, events=[  # 32 of 40 tokens cached
        pb.KvEvent(stored=pb.KvBlockStored(block_hash=h)) for h in prompt.hashes(16)[:2]]))
    assert not router.disaggregates(decode, prompt)
    assert not router.disaggregates(decode, RoutePrompt(list(range(16))))  # not more than a block to compute
    assert router.disaggregates(decode, RoutePrompt(list(range(17))))
    router.replicas["p:1"].healthy = False
    assert not router.disaggregates(decode, RoutePrompt(list(range(5000, 5100))))


def test_prompts_under_the_threshold_are_prefilled_where_they_decode() -> None:
    router = _router({"p:1": "kv_producer", "d:1": "kv_consumer"}, min_tokens=256)
    decode = router.replicas["d:1"]
    assert not router.disaggregates(decode, RoutePrompt(list(range(255))))
    assert router.disaggregates(decode, RoutePrompt(list(range(256))))
    with pytest.raises(ValueError, match="--routing-remote-prefill-min-tokens"):
        RoutingConfig(remote_prefill_min_tokens=-1)


class _FakeClient:
    """A prefill replica's client: answers with `final`, or raises `error`."""

    def __init__(self, final: pb.RequestOutput | None = None, error: BaseException | None = None) -> None:
        self.final, self.error, self.calls = final, error, []

    async def generate(self, prompt, sampling, **kwargs):
        self.calls.append((list(prompt), sampling, kwargs))
        if self.error is not None:
            raise self.error
        yield self.final


def _final(handle: str = HANDLE) -> pb.RequestOutput:
    params = pb.KVTransferParams(do_remote_prefill=True, remote_handle=handle, remote_num_tokens=16 if handle else 0,
                                 remote_block_hash=b"h" * 32 if handle else b"")
    return pb.RequestOutput(request_id="x", new_token_ids=[5], finish_reason="length", kv_transfer_params=params)


def _prefill(router: ReplicaRouter, metrics: GatewayMetrics, request: ResumableRequest | None = None):
    request = request or ResumableRequest("r1", list(range(40)), pb.SamplingParams(temperature=0.7, max_tokens=9),
                                          cache_salt="s")
    return asyncio.run(remote_prefill(router, request, metrics))


def test_the_prefill_half_hands_its_params_on_and_falls_back_to_a_local_prefill() -> None:
    router = _router({"p:1": "kv_producer", "p:2": "kv_producer", "d:1": "kv_consumer"})
    metrics = GatewayMetrics("m")
    ok = _FakeClient(_final())
    router.replicas["p:1"].client = _FakeClient(error=SchedulerUnavailable("gone"))
    router.replicas["p:2"].client = ok
    params = _prefill(router, metrics)
    assert params.remote_handle == HANDLE and not router.replicas["p:1"].healthy
    prompt, sampling, kwargs = ok.calls[0]
    assert prompt == list(range(40)) and sampling.max_tokens == 1 and sampling.temperature == 0
    assert kwargs["kv_transfer_params"].do_remote_decode and kwargs["cache_salt"] == "s"
    assert kwargs["request_id"] == "r1-prefill"
    # An engine fault there: the next prefill replica (none left up): a local prefill.
    router.replicas["p:2"].client = _FakeClient(error=RequestRejected("r1", "worker died", pb.ENGINE_FAULT))
    assert _prefill(router, metrics) is None
    router.replicas["p:2"].client = _FakeClient(error=RequestRejected("r1", "too long", pb.INVALID_REQUEST))
    assert _prefill(router, metrics) is None
    router.replicas["p:2"].client = _FakeClient(_final(handle=""))
    assert _prefill(router, metrics) is None
    router.replicas["p:2"].healthy = False
    assert _prefill(router, metrics) is None
    assert metrics.remote_prefills == {"transferred": 1, "failed": 2, "nothing_to_transfer": 1,
                                       "no_prefill_replica": 1}
    assert 'myvllm:remote_prefills_total{model_name="m",outcome="failed"} 2.0' in metrics.render(None)


def test_resumed_and_prompt_logprobs_requests_prefill_where_they_decode() -> None:
    assert wants_remote_prefill(ResumableRequest("a", [1, 2], pb.SamplingParams()))
    assert not wants_remote_prefill(ResumableRequest("a", [1, 2], pb.SamplingParams(), output_token_ids=[3]))
    assert not wants_remote_prefill(ResumableRequest("a", [1, 2], pb.SamplingParams(prompt_logprobs=0)))


def test_redis_entries_carry_a_known_role_only() -> None:
    entry = {"address": "h:1", "num_waiting": 0, "num_running": 0, "ts": 1.0}
    assert redis_registry.parse_entry(json.dumps({**entry, "kv_role": "kv_consumer"}))["kv_role"] == "kv_consumer"
    assert "kv_role" not in redis_registry.parse_entry(json.dumps(entry))
    with pytest.raises(redis_registry.BadEntry, match="kv_role"):
        redis_registry.parse_entry(json.dumps({**entry, "kv_role": "boss"}))


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_topology_args(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_make_per_replica_roles_and_deploy_refuses_them() -> None:
    args = _serve_args("--prefill-replicas", "2", "--decode-replicas", "1", "--kv-transfer-config",
                       '{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", '
                       '"kv_connector_extra_config": {"segment_ttl_s": 30}}')
    check_disaggregation(args)
    assert num_replicas(args) == 3
    roles = [json.loads(kv_transfer_config_of(args, r)) for r in range(3)]
    assert [r["kv_role"] for r in roles] == ["kv_producer", "kv_producer", "kv_consumer"]
    assert all(r["kv_connector_extra_config"] == {"segment_ttl_s": 30} for r in roles)
    plain = _serve_args("--prefill-replicas", "1", "--decode-replicas", "1")
    check_disaggregation(plain)
    assert json.loads(kv_transfer_config_of(plain, 0)) == {"kv_connector": "SharedMemoryConnector",
                                                           "kv_role": "kv_producer"}
    for argv, message in ((("--prefill-replicas", "1"), "go together"),
                          (("--prefill-replicas", "1", "--decode-replicas", "1", "-dp", "2"), "data-parallel-size"),
                          (("--prefill-replicas", "1", "--decode-replicas", "1", "--runner", "pooling"), "generate"),
                          (("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-config", "[1]"),
                           "JSON object")):
        with pytest.raises(ValueError, match=message):
            check_disaggregation(_serve_args(*argv))
    with pytest.raises(ValueError, match="GrpcConnector"):
        Topology.of(_serve_args("--prefill-replicas", "1", "--decode-replicas", "1"), redis_server=True)
    grpc = _serve_args("--prefill-replicas", "1", "--decode-replicas", "2", "--kv-transfer-config",
                       '{"kv_connector": "GrpcConnector"}')
    assert Topology.of(grpc, redis_server=True).data_parallel_size == 3


def test_each_replica_s_worker_and_scheduler_get_the_same_engine_flags() -> None:
    args = _serve_args("--prefill-replicas", "1", "--decode-replicas", "1")
    check_disaggregation(args)
    args.data_parallel_size = num_replicas(args)  # (as serve does)
    topology = Topology(2, redis=True, redis_server=True)
    placement = LocalPlacement("127.0.0.1", 8000, [[9000], [9001]], [9100, 9101], redis_port=9200)
    specs = processes(args, "/m", topology, placement)
    for replica, role in enumerate(("kv_producer", "kv_consumer")):
        worker, scheduler = [s for s in specs if s.replica == replica]
        for spec in (worker, scheduler):
            flags = list(spec.argv)
            assert json.loads(flags[flags.index("--kv-transfer-config") + 1])["kv_role"] == role
            assert "--data-parallel-size" not in flags  # (each an engine of its own)


def test_grpc_decode_replicas_are_told_the_prefill_replicas_workers() -> None:
    """The only addresses a GrpcConnector consumer's worker fetches KV from (with the token)."""
    args = _serve_args("--prefill-replicas", "2", "--decode-replicas", "1", "--kv-transfer-config",
                       '{"kv_connector": "GrpcConnector"}')
    check_disaggregation(args)
    args.data_parallel_size = num_replicas(args)
    placement = LocalPlacement("127.0.0.1", 8000, [[9000], [9001], [9002]], [9100, 9101, 9102], redis_port=9200)
    specs = processes(args, "/m", Topology(3, redis=True, redis_server=True), placement)
    for replica in range(3):
        for spec in [s for s in specs if s.replica == replica]:
            flags = list(spec.argv)
            extra = json.loads(flags[flags.index("--kv-transfer-config") + 1]).get("kv_connector_extra_config", {})
            assert extra == ({} if replica < 2 else {"producer_addresses": ["127.0.0.1:9000", "127.0.0.1:9001"]})


def test_replicas_count_as_routable_once_their_load_and_role_are_heard() -> None:
    """What `serve` waits for before it prints its banner: a replica whose scheduler has not
    answered yet (or went down) is not counted, so no request after the banner finds a P/D
    topology half known."""

    class LoadClient:
        def __init__(self, role: str, up: bool) -> None:
            self.role, self.up = role, up

        async def get_load(self) -> pb.Load:
            if not self.up:
                raise SchedulerUnavailable("not yet")
            return pb.Load(num_waiting=0, num_running=0, kv_role=self.role)

    router = ReplicaRouter(["p:1", "d:1"])
    clients = {"p:1": LoadClient("kv_producer", up=False), "d:1": LoadClient("kv_consumer", up=True)}
    for address, client in clients.items():
        router.replicas[address].client = client
    assert router.routable() == {}  # nothing heard yet, though both start out "healthy"
    asyncio.run(router.refresh())
    assert router.routable() == {"kv_consumer": 1}
    clients["p:1"].up = True
    asyncio.run(router.refresh())
    assert router.routable() == {"kv_consumer": 1, "kv_producer": 1}
    text = GatewayMetrics("m").render(None, routable=router.routable())
    assert 'myvllm:engine_replicas_routable{kv_role="kv_producer",model_name="m"} 1.0' in text
    single = ReplicaRouter(["c:1"])  # the one-replica deployment polls no load: up unless marked down
    assert single.routable() == {"none": 1}
    single.mark_down(single.replicas["c:1"], SchedulerUnavailable("gone"))
    assert single.routable() == {}
