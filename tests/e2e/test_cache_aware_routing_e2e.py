"""Cache-aware routing for real: two engine replicas (worker + scheduler processes) publishing
their load to a real redis-server and their KV events to a gateway that knows only Redis.

A request whose long prefix is cached on one replica goes there, again and again (load-only
or round-robin routing would alternate between the two idle replicas: run with
MYVLLM_TEST_ROUTING=load to see this test fail). Then that replica's scheduler is killed: the
gateway drops its prefix index and keeps answering from the other replica; once the scheduler
is started again the gateway's index of it resyncs from a fresh snapshot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
from support.replica import Replica
from test_dp_routing import _published_addresses

from services.gateway.options import GatewayOptions
from services.gateway.routing import RoutingConfig, RoutingPolicy
from services.gateway.server import BackgroundGateway

MODEL = "SmolLM2-135M-Instruct"
# Several hundred tokens shared by every request of one "tenant", then a short question.
PREFIX = "You are the support assistant of tenant seven. House rules: " + " ".join(
    f"rule {i} says item {i * 7 % 13} goes before item {i * 5 % 11}." for i in range(60))


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_requests_follow_their_cached_prefix_and_survive_its_scheduler_dying(smollm2_dir: str,
                                                                             redis_server: str) -> None:
    import openai

    policy = RoutingPolicy(os.environ.get("MYVLLM_TEST_ROUTING", "cache-aware"))  # the mutation check's knob
    replicas = [Replica(smollm2_dir, redis_server) for _ in range(2)]
    by_address = {r.address: r for r in replicas}
    try:
        for replica in replicas:
            replica.wait_ready()
        options = GatewayOptions(routing=RoutingConfig(policy))
        with BackgroundGateway("", smollm2_dir, redis_url=redis_server, options=options) as gateway:
            router = gateway.app.state.ctx.router
            _until(lambda: _published_addresses_now(redis_server) == set(by_address), "both replicas published")
            _until(lambda: set(router.replicas) == set(by_address) and all(
                r.index.synced or policy != RoutingPolicy.CACHE_AWARE for r in router.replicas.values()),
                "the gateway follows both replicas")
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=120)

            def ask(question: str) -> str:
                reply = client.completions.create(model=MODEL, prompt=f"{PREFIX} {question}", max_tokens=2,
                                                  temperature=0)
                return reply.choices[0].text

            def served(action: Callable[[], object]) -> dict[str, tuple[int, int]]:
                """(prompt tokens looked up, tokens hit) per replica while `action` ran."""
                before = {a: r.stats() for a, r in by_address.items()}
                action()
                after = {a: r.stats() for a, r in by_address.items()}
                return {a: (after[a].prefix_cache_queries - before[a].prefix_cache_queries,
                            after[a].prefix_cache_hits - before[a].prefix_cache_hits) for a in by_address}

            first = served(lambda: ask("Question 0: which item goes first?"))
            (owner,) = [a for a, (queried, _) in first.items() if queried > 0]
            prefix_tokens = first[owner][0]
            assert prefix_tokens > 300, f"the prompt is too short to matter: {prefix_tokens} tokens"
            if policy == RoutingPolicy.CACHE_AWARE:  # the gateway learnt what the owner cached
                _until(lambda: len(router.replicas[owner].index.hashes) >= prefix_tokens // 16 - 1,
                       "the owner's KV events reached the gateway", timeout_s=10)
            else:
                time.sleep(1.0)
            for i in range(1, 4):
                got = served(lambda i=i: ask(f"Question {i}: and which goes last?"))
                assert got[owner][1] >= prefix_tokens - 48, f"request {i} missed the cached prefix: {got}"
                assert all(q == 0 for a, (q, _) in got.items() if a != owner), \
                    f"request {i} was not routed to the replica holding its prefix ({owner}): {got}"

            metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
            predicted = _counter(metrics, "myvllm:routing_predicted_cached_tokens_total")
            actual = _counter(metrics, "myvllm:routing_actual_cached_tokens_total")
            assert predicted >= 3 * (prefix_tokens - 48) and actual >= predicted, (predicted, actual)

            # The owner's scheduler dies: its index is dropped, requests are still answered.
            victim = by_address[owner]
            victim.scheduler.kill()
            victim.scheduler.wait(timeout=10)
            _until(lambda: owner not in router.replicas or not router.replicas[owner].index.synced,
                   "the gateway dropped the dead replica's index", timeout_s=10)
            for i in range(2):
                assert ask(f"Question {10 + i}: still there?")  # (the other replica answers)

            # It comes back: the gateway subscribes again and resyncs from the snapshot.
            victim.start_scheduler()
            victim.wait_ready()
            _until(lambda: owner in router.replicas and router.replicas[owner].index.synced,
                   "the gateway resynced the restarted replica's index")
            assert ask("Question 20: back?")
    finally:
        for replica in replicas:
            replica.stop()


def _published_addresses_now(redis_url: str) -> set[str]:
    import asyncio

    return asyncio.run(_published_addresses(redis_url))


def _counter(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")
