"""A docker-compose file from serve's processes: one compose service per process, named as serve
names it, running serve's command with compose addresses (services/entrypoints/topology.py's
ComposePlacement). Secrets come from the shell's environment through compose's interpolation:
compose refuses to start without the internal token and (with several replicas) redis' password."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.auth import TOKEN_ENV
from services.common.redis_registry import REDIS_URL_ENV
from services.entrypoints.topology import (
    API_KEY_ENV,
    GATEWAY,
    REDIS,
    SCHEDULER,
    WORKER,
    ComposePlacement,
    ProcessSpec,
    healthcheck_command,
    redis_url,
)

REDIS_PASSWORD_ENV = "MYVLLM_REDIS_PASSWORD"
# What each secret is in a compose file: required (`:?` fails `up` naming it) or, for the API
# key, empty by default (no key: fine while the gateway is published on loopback only).
COMPOSE_ENV = {
    TOKEN_ENV: "${MYVLLM_INTERNAL_TOKEN:?set MYVLLM_INTERNAL_TOKEN to a shared secret}",
    API_KEY_ENV: "${MYVLLM_API_KEY:-}",
}
HEALTH_INTERVAL_S = 5
# Memory only: a worker sizes its threads to the host's cores, which a CPU quota (`cpus:`) would
# not change, so a quota below them would throttle every step. The worker's is its weights plus
# the CPU KV cache (2 GiB by default): a larger model or --kv-cache-memory needs more.
MEMORY_LIMITS = {WORKER: "4g", SCHEDULER: "2g", GATEWAY: "2g", REDIS: "256m"}


@dataclass(frozen=True)
class ComposeOptions:
    image: str
    device: str | None  # "cuda": each worker reserves one GPU
    startup_timeout_s: float
    # compose's `build:` for the first worker (context relative to the file); None: no build, the
    # image is built apart
    build: dict | None = None


def _escape(argv: Sequence[str], keep: str | None) -> list[str]:
    """Compose interpolates `$` in every value: a literal one in a flag (a chat template, say)
    is written `$$`. `keep` is the placement's own reference (redis' password), left as it is."""
    return [a if a == keep else a.replace("$", "$$") for a in argv]


def _healthcheck(spec: ProcessSpec, retries: int) -> dict:
    return {"test": ["CMD", *healthcheck_command(spec)], "interval": f"{HEALTH_INTERVAL_S}s",
            "timeout": f"{HEALTH_INTERVAL_S}s", "retries": retries}


def _resources(role: str, device: str | None) -> dict:
    resources: dict = {"limits": {"memory": MEMORY_LIMITS[role]}}
    if role == WORKER and device == "cuda":
        resources["reservations"] = {"devices": [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]}
    return {"resources": resources}


def compose_file(specs: Sequence[ProcessSpec], placement: ComposePlacement, options: ComposeOptions) -> dict:
    """The compose document (a dict, in the order compose files are usually read)."""
    by_role: dict[str, list[ProcessSpec]] = {}
    for spec in specs:
        by_role.setdefault(spec.role, []).append(spec)
    redis = by_role.get(REDIS, [None])[0]
    env_values = dict(COMPOSE_ENV)
    if redis is not None:
        env_values[REDIS_URL_ENV] = redis_url(redis.address, placement.redis_password)
    # Services poll until healthy for as long as serve waits for each of them.
    retries = max(1, math.ceil(options.startup_timeout_s / HEALTH_INTERVAL_S))
    healthy = {"condition": "service_healthy"}
    services: dict[str, dict] = {}
    first_worker = by_role[WORKER][0].name
    for spec in specs:
        if spec.role == REDIS:
            services[spec.name] = {
                "image": "redis:7",
                "restart": "unless-stopped",
                # redis-server replaces its process title, so the password does not stay in `ps`.
                "command": _escape(spec.argv, placement.redis_password),
                # the healthcheck's redis-cli authenticates with it
                "environment": {"REDISCLI_AUTH": f"${{{REDIS_PASSWORD_ENV}}}"},
                "healthcheck": _healthcheck(spec, 10),
                "deploy": _resources(REDIS, None),
            }
            continue
        service: dict = {"image": options.image}
        if spec.name == first_worker and options.build is not None:
            service["build"] = options.build  # one service builds the image, the others wait for it
        service["restart"] = "unless-stopped"  # a single-host deployment heals itself, as serve's does
        service["command"] = _escape(spec.argv, None)
        service["environment"] = {name: env_values[name] for name in spec.env}
        service["healthcheck"] = _healthcheck(spec, retries)
        depends: dict[str, dict] = {}
        if spec.role == WORKER and spec.name != first_worker:
            depends[first_worker] = {"condition": "service_started"}
        elif spec.role == SCHEDULER:
            depends |= {w.name: healthy for w in by_role[WORKER] if w.replica == spec.replica}
        elif spec.role == GATEWAY:
            depends |= {s.name: healthy for s in by_role[SCHEDULER]}
        if redis is not None and REDIS_URL_ENV in spec.env:
            depends[redis.name] = healthy
        if depends:
            service["depends_on"] = depends
        if spec.role == GATEWAY:
            # Published on this host's loopback unless told otherwise (then set MYVLLM_API_KEY too).
            service["ports"] = [f"${{MYVLLM_PUBLISH_ADDRESS:-127.0.0.1}}:{spec.port}:{spec.port}"]
        service["deploy"] = _resources(spec.role, options.device)
        services[spec.name] = service
    return {"name": "myvllm", "services": services}


USAGE = """\
Use (secrets from the shell's environment; hex: they go into a URL):
  export MYVLLM_INTERNAL_TOKEN=$(openssl rand -hex 32)   # the services' shared secret
  export MYVLLM_REDIS_PASSWORD=$(openssl rand -hex 32)   # redis' password (several replicas)
  docker compose -f {path} up {build}
The API is published on this host's loopback only; to serve other hosts set an API key and the
address:  MYVLLM_API_KEY=... MYVLLM_PUBLISH_ADDRESS=0.0.0.0 docker compose ...
Worker and scheduler listen inside the compose network only and refuse calls without the token.
{build_note}"""
# USAGE's last line: how the image gets built, with `build:` (its context relative to this file) or without.
BUILD_NOTE = "`build:` builds {image} from the repository (its context relative to this file; or `make image`)."
NO_BUILD_NOTE = "Build {image} first: `make image` in a my-vllm checkout (this file has no `build:`)."
