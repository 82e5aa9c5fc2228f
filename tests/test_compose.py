"""deploy/docker-compose.yml, run without Docker: each service's own command becomes a local
process (service hostnames → 127.0.0.1, published ports → free ports, /models → ours), each
healthcheck is run as written, then a chat completion goes through the whole mesh."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import redis
import yaml
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "docker-compose.yml"


def _start_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            visit(dep)
        order.append(name)

    for name in services:
        visit(name)
    return order


class _Localizer:
    """Rewrites compose arguments for processes on this machine."""

    def __init__(self, services: dict, models_dir: str) -> None:
        self.hosts = set(services)
        self.ports: dict[str, str] = {}
        for args in self._all_args(services):
            for port in re.findall(r"(?:--port\s|:)(\d{4,5})\b", " ".join(args)):
                self.ports.setdefault(port, str(free_port()))
        self.models_dir = models_dir

    @staticmethod
    def _all_args(services: dict):
        for svc in services.values():
            yield svc["command"]
            yield svc["healthcheck"]["test"][1:]

    def arg(self, a: str) -> str:
        a = a.replace("/models/SmolLM2-135M-Instruct", self.models_dir)
        for host in self.hosts:
            a = re.sub(rf"(^|//){host}:(?=\d)", r"\g<1>127.0.0.1:", a)
        if a in self.ports:
            return self.ports[a]
        return re.sub(r":(\d{4,5})\b", lambda m: ":" + self.ports.get(m.group(1), m.group(1)), a)

    def command(self, args: list[str]) -> list[str]:
        args = [self.arg(a) for a in args]
        if args[0] == "myvllm":
            return [sys.executable, "-m", "services.cli", *args[1:]]
        if args[0] == "python":
            return [sys.executable, *args[1:]]
        return args


def test_compose_services_serve_a_chat_completion(smollm2_dir):
    from openai import OpenAI

    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"gateway", "scheduler", "worker", "redis"} <= set(services)
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # Faults heal: each service restarts when it exits. Worker and scheduler bind every
    # interface only because compose says so (their default is loopback), and need the token.
    assert all(svc.get("restart") == "unless-stopped" for svc in services.values())
    for name in ("worker", "scheduler"):
        assert services[name]["command"][services[name]["command"].index("--host") + 1] == "0.0.0.0"
        assert "MYVLLM_INTERNAL_TOKEN" in services[name]["environment"]
    loc = _Localizer(services, smollm2_dir)
    procs: list[subprocess.Popen] = []
    # What compose's `environment:` gives every myvllm service (the healthchecks run inside them).
    env = dict(os.environ, PYTHONPATH=str(REPO), MYVLLM_INTERNAL_TOKEN="compose-test-token")
    try:
        for name in _start_order(services):
            svc = services[name]
            procs.append(subprocess.Popen(loc.command(svc["command"]), cwd=REPO, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            check = loc.command(svc["healthcheck"]["test"][1:])
            deadline = time.monotonic() + 180
            while subprocess.run(check, cwd=REPO, env=env, capture_output=True).returncode != 0:
                assert procs[-1].poll() is None, f"{name} exited: {procs[-1].stderr.read().decode()[-2000:]}"
                assert time.monotonic() < deadline, f"{name} never became healthy"
                time.sleep(0.5)

        gateway_port = loc.ports["8000"]
        client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=16)
        assert "Paris" in reply.choices[0].message.content
        # The scheduler published its replica's load for DP routing, under the address it
        # advertises (which the gateway, also reading redis, dials).
        r = redis.Redis(host="127.0.0.1", port=int(loc.ports["6379"]))
        entries = [json.loads(v) for v in r.hgetall("myvllm:engines").values()]
        assert [e["address"] for e in entries] == [f"127.0.0.1:{loc.ports['50051']}"]
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
