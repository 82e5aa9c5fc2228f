"""Service entry points: `myvllm worker | scheduler | gateway | serve`.

`serve` (what `make up` runs) starts the three services as separate local processes,
waits until each is healthy, prints where the API is, restarts any service that exits
(services/entrypoints/supervisor.py), and stops them all on Ctrl-C. Its services share a random
internal token (generated per run, unless $MYVLLM_INTERNAL_TOKEN is set) and bind the
loopback interface, except the gateway (`--host`). With several replicas it starts a
redis-server with a random password (given to it on stdin, to the scheduler and gateway in
$MYVLLM_REDIS_URL: neither shows in `ps`). Which processes it starts, with which command lines,
is services/entrypoints/topology.py, which `myvllm deploy compose | k8s` write down too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from services.common.auth import TOKEN_ENV, token_from_env, token_metadata
from services.common.config import VllmConfig, check_model_dir, default_model_path
from services.common.grpc_utils import StartupError
from services.common.log_format import configure_service_logging
from services.common.redis_registry import REDIS_URL_ENV, redact_redis_url, redis_url_from_env
from services.common.secret_check import check_service_secrets, join_api_keys
from services.common.serve_connection import ServeConnection
from services.entrypoints.engine_args import (
    add_kv_transfer_arg,
    add_model_args,
    add_parallel_args,
    add_scheduler_service_args,
    add_scheduling_args,
    add_speculative_arg,
    engine_kwargs,
)
from services.entrypoints.model_source import resolve_model
from services.entrypoints.supervisor import ServiceGroup, ServiceProcess, stop_all
from services.entrypoints.topology import (
    API_KEY_ENV,
    DEFAULT_STARTUP_TIMEOUT_S,
    EXIT_GRACE_S,
    GATEWAY,
    REDIS,
    LocalPlacement,
    ProcessSpec,
    Topology,
    add_device_arg,
    add_served_model_name_arg,
    add_topology_args,
    check_topology,
    num_replicas,
    processes,
    redis_url,
)
from services.entrypoints.vllm_compat import add_model_positional, add_vllm_compat_args, model_of
from services.gateway.options import add_gateway_options


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _run_async(coro) -> int:
    configure_service_logging()
    try:
        asyncio.run(coro)
    except StartupError as e:
        return _fail(str(e))
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from services.common.proto import myvllm_pb2 as pb
    from services.worker.server import serve_worker

    model = args.model or default_model_path()
    try:
        check_model_dir(model)
    except FileNotFoundError as e:
        return _fail(str(e))
    root = args.allowed_model_root
    if root is not None and not os.path.isdir(root):
        return _fail(f"--allowed-model-root {root} is not a directory")
    try:
        check_service_secrets(internal_token=token_from_env(args.internal_token))
        config = VllmConfig.from_engine_args(**{**engine_kwargs(args), "model": model})
    except ValueError as e:
        return _fail(f"worker: {e}")
    own = pb.LoadModelRequest(config=config.to_proto())
    # A tensor-, pipeline- or data-parallel expert-parallel rank loads its shard once its scheduler
    # says which rank it is.
    parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1 or config.expert_parallel_group
    return _run_async(serve_worker(args.host, args.port, own, device=args.device,
                                   preload=not parallel, token=token_from_env(args.internal_token),
                                   allowed_model_root=root))


def _cmd_scheduler(args: argparse.Namespace) -> int:
    from services.scheduler.server import serve_scheduler

    # Model, dtype and the like belong to the worker; the scheduler adopts them from LoadModel.
    try:
        check_service_secrets(internal_token=token_from_env(args.internal_token),
                              redis_url=redis_url_from_env(args.redis))
        config = VllmConfig.from_engine_args(**engine_kwargs(args), model="")
    except ValueError as e:
        return _fail(f"scheduler: {e}")
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    return _run_async(serve_scheduler(args.host, args.port, config, workers, redis_url=redis_url_from_env(args.redis),
                                      engine_id=args.engine_id, advertise_address=args.advertise_address,
                                      token=token_from_env(args.internal_token), engine_timeout=args.engine_timeout,
                                      max_waiting_requests=args.max_waiting_requests,
                                      data_parallel_rank=args.data_parallel_rank,
                                      data_parallel_address=args.data_parallel_address, dp_group=args.dp_group))


def _cmd_gateway(args: argparse.Namespace) -> int:
    from services.gateway.options import gateway_options
    from services.gateway.server import serve_gateway

    configure_service_logging()
    model = args.model or default_model_path()
    try:
        check_model_dir(model)
        redis_url = redis_url_from_env(args.redis)
        check_service_secrets(internal_token=token_from_env(args.internal_token), api_key=args.api_key,
                              redis_url=redis_url)
        if not args.scheduler and not redis_url:
            return _fail("gateway: give --scheduler addresses, --redis to discover them, or both")
        serve_gateway(args.host, args.port, args.scheduler or "", model, served_model_name=args.served_model_name,
                      redis_url=redis_url, options=gateway_options(args))
    except (StartupError, FileNotFoundError, OSError, ValueError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        pass
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_healthy(services: list[ServiceProcess], check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for service in services:
            if service.exit_code is not None:
                raise StartupError(f"{service.name} exited with code {service.exit_code} during start-up "
                                   "(see its output above)")
        if check():
            return
        time.sleep(0.3)
    raise StartupError(f"{what} did not become healthy within {timeout:.0f}s")


def _grpc_healthy(address: str, service: str, token: str | None = None) -> bool:
    """Health of a worker or scheduler; the internal token defaults to $MYVLLM_INTERNAL_TOKEN."""
    import grpc

    from services.common.proto import myvllm_pb2 as pb
    from services.common.proto import myvllm_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.SchedulerStub(ch) if service == "scheduler" else pb_grpc.WorkerStub(ch)
        try:
            return stub.Health(pb.Empty(), timeout=1.0, metadata=token_metadata(token_from_env(token))).ok
        except grpc.RpcError:
            return False


def _http_healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _gateway_ready(base_url: str, num_replicas: int) -> bool:
    """The gateway answers /health and routes to all `num_replicas` replicas serve started (so
    the first requests after the banner see the whole topology, P/D roles included)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    if not _http_healthy(f"{base_url}/health"):
        return False
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return False
    routable = sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "myvllm:engine_replicas_routable" for sample in family.samples)
    return routable >= num_replicas


def _redis_healthy(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0) as client:
            return bool(client.ping())
    except redis.exceptions.RedisError:
        return False


def _embedded_redis_url(port: int, password: str | None) -> str:
    return redis_url(f"127.0.0.1:{port}", password)


def _redis_config(password: str) -> bytes:
    """What the embedded redis-server reads on stdin (`redis-server -`): its password, which
    then shows neither in `ps` nor in a file."""
    return f"requirepass {password}\n".encode()


def _serve_plan(args: argparse.Namespace, model: str, worker_ports: list[list[int]],
               scheduler_ports: list[int], redis_port: int | None, redis_url: str | None = None,
               group_port: int | None = None) -> list[tuple[ProcessSpec, object]]:
    """Each service (services/entrypoints/topology.py: the same processes `deploy` writes down) and its health
    check, in start order: an embedded redis when there are several replicas, then each replica's
    worker ranks and scheduler, then the gateway. `redis_url` (credentials and all) is the one
    scheduler and gateway get in $MYVLLM_REDIS_URL (default: `--redis`, else the embedded
    redis-server's): no command carries it. `group_port`: the replicas are one expert-parallel
    group, whose rendezvous DP rank 0's scheduler hosts there."""
    if redis_port is not None:
        redis_url = redis_url or _embedded_redis_url(redis_port, None)
    redis_url = redis_url or args.redis
    topology = Topology(len(scheduler_ports), args.tensor_parallel_size, args.pipeline_parallel_size,
                        expert_parallel_group=group_port is not None, redis=bool(redis_url),
                        redis_server=redis_port is not None)
    placement = LocalPlacement(args.host, args.port, worker_ports, scheduler_ports, redis_port, group_port,
                               redis_executable=shutil.which("redis-server") or "redis-server")
    plan: list[tuple[ProcessSpec, object]] = []
    for spec in processes(args, model, topology, placement):
        if spec.role == REDIS:
            healthy = functools.partial(_redis_healthy, redis_url)
        elif spec.role == GATEWAY:
            healthy = functools.partial(_gateway_ready, f"http://127.0.0.1:{spec.port}", len(scheduler_ports))
        else:
            healthy = functools.partial(_grpc_healthy, f"127.0.0.1:{spec.port}", spec.role)
        plan.append((spec, healthy))
    return plan


def _serve_commands(args: argparse.Namespace, model: str, worker_ports: list[list[int]],
                    scheduler_ports: list[int], redis_port: int | None, redis_url: str | None = None,
                    group_port: int | None = None) -> list[tuple]:
    """(name, command, health check) of each service of `_serve_plan`, in start order."""
    return [(spec.name, list(spec.argv), healthy)
            for spec, healthy in _serve_plan(args, model, worker_ports, scheduler_ports, redis_port, redis_url,
                                             group_port)]


def _service_env(spec: ProcessSpec, values: dict[str, str | None]) -> dict[str, str] | None:
    """A service's environment: serve's own (the internal token is in it), plus the secrets among
    `values` that this service reads (None: inherit serve's unchanged)."""
    extra = {name: values[name] for name in spec.env if values.get(name)}
    return dict(os.environ, **extra) if extra else None


def _topology(args: argparse.Namespace, redis_port: int | None) -> str:
    d, t, p = args.data_parallel_size, args.tensor_parallel_size, args.pipeline_parallel_size
    kind = f"{args.prefill_replicas} prefill + {args.decode_replicas} decode" if args.prefill_replicas \
        else "data parallel"
    parts = [f"{d} engine replica{'s' if d > 1 else ''} ({kind})",
             f"{t * p} worker rank{'s' if t * p > 1 else ''} each "
             f"({t} tensor parallel x {p} pipeline stage{'s' if p > 1 else ''})"]
    if redis_port is not None:
        parts.append(f"redis on 127.0.0.1:{redis_port}")
    elif args.redis:
        parts.append(f"redis at {redact_redis_url(args.redis)}")
    return "topology: " + ", ".join(parts) + ", 1 gateway"


def _cmd_serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # SIGINT raises KeyboardInterrupt (services.entrypoints.cli)
    try:  # (the services get directories: a repo id is looked up here, once)
        model = model_of(args)
        if args.tokenizer:
            args.tokenizer = resolve_model(args.tokenizer, download_dir=args.download_dir)
    except FileNotFoundError as e:
        return _fail(str(e))
    try:  # a bad --speculative-config (or a flag it does not combine with) fails here, not in a service
        check_topology(args, model)
        # (A short API key is warned about once, by the gateway serve starts with it.)
        check_service_secrets(internal_token=token_from_env(args.internal_token), api_key=args.api_key,
                              redis_url=redis_url_from_env(args.redis), warn_weak_api_key=False)
    except ValueError as e:
        return _fail(str(e))
    args.data_parallel_size = num_replicas(args)  # (P/D: serve starts and routes P + D replicas)
    if not _port_free(args.host, args.port):
        return _fail(f"port {args.port} on {args.host} is already in use (pick another with --port)")
    if args.data_parallel_size > 1 and (args.worker_port or args.scheduler_port):
        return _fail("--worker-port / --scheduler-port name one replica's ports; leave them out with "
                     "--data-parallel-size > 1")
    args.redis = redis_url_from_env(args.redis)  # --redis, else $MYVLLM_REDIS_URL
    if args.data_parallel_size > 1 and not args.redis and shutil.which("redis-server") is None:
        return _fail("--data-parallel-size > 1 starts a redis-server (none on PATH; `make setup` installs it) "
                     "unless --redis URL names one")
    # Replica r's workers (rank order, stage-major) and scheduler; --worker-port is rank 0's, the others
    # follow it.
    num_ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    worker_ports = [[args.worker_port + rank if args.worker_port else free_port()
                     for rank in range(num_ranks)] for _ in range(args.data_parallel_size)]
    scheduler_ports = [args.scheduler_port or free_port() for _ in range(args.data_parallel_size)]
    redis_port = free_port() if args.data_parallel_size > 1 and not args.redis else None
    expert_parallel_group = args.enable_expert_parallel and args.data_parallel_size > 1
    group_port = free_port() if expert_parallel_group else None
    # One secret per run, shared by the three services (and this process's health checks)
    # through the environment, so it never shows in `ps`.
    os.environ[TOKEN_ENV] = args.internal_token or token_from_env() or secrets.token_urlsafe(32)
    # The embedded redis-server wants a password, new each run, which reaches it on stdin and
    # the scheduler and gateway (alone) in $MYVLLM_REDIS_URL, like any --redis URL.
    redis_password = secrets.token_urlsafe(32) if redis_port is not None else None
    redis_url = _embedded_redis_url(redis_port, redis_password) if redis_port is not None else args.redis
    os.environ.pop(REDIS_URL_ENV, None)
    # The Redis URL reaches schedulers and gateway, the API key the gateway alone, through their
    # environment (services/entrypoints/topology.py says who reads which).
    secret_env = {REDIS_URL_ENV: redis_url, API_KEY_ENV: join_api_keys(args.api_key)}
    services: list[ServiceProcess] = []
    *engine_plan, (gateway_spec, gateway_healthy) = _serve_plan(
        args, model, worker_ports, scheduler_ports, redis_port, redis_url, group_port)  # the gateway comes last
    # The gateway waits for its schedulers by itself (as after a scheduler restart), so it starts
    # with the first worker: its imports and tokenizer load overlap the model load instead of
    # following it. It stays last in `services` (stopped first, supervised last).
    gateway = ServiceProcess(gateway_spec.name, list(gateway_spec.argv), env=_service_env(gateway_spec, secret_env))
    connection_file: Path | None = None
    try:
        print(_topology(args, redis_port), flush=True)
        if expert_parallel_group:  # a scheduler sets its ranks up only once every engine's ranks are up
            engine_plan.sort(key=lambda planned: planned[0].name.startswith("scheduler"))
        starting: list[tuple[str, object]] = []
        for spec, healthy in engine_plan:
            name = spec.name
            services.append(ServiceProcess(name, list(spec.argv), env=_service_env(spec, secret_env),
                                           stdin_data=_redis_config(redis_password) if name == "redis" else None))
            services[-1].start()
            if gateway.proc is None and name.startswith("worker"):
                gateway.start()
            starting.append((name, healthy))
            if not (expert_parallel_group and name.startswith("scheduler")):  # (those all start, then are waited for)
                _wait_healthy(services + ([gateway] if gateway.proc else []), healthy, name, args.startup_timeout)
                starting.clear()
        for name, healthy in starting:
            _wait_healthy(services + [gateway], healthy, name, args.startup_timeout)
        services.append(gateway)
        _wait_healthy(services, gateway_healthy, gateway_spec.name, args.startup_timeout)
        host = "localhost" if args.host in ("0.0.0.0", "127.0.0.1") else args.host
        base = f"http://{host}:{args.port}/v1"
        served = (args.served_model_name or [os.path.basename(os.path.normpath(model))])[0]
        print(f"my-vllm is serving {served} at {base}", flush=True)
        print(f"  {_curl_example(base, served, args.api_key)}", flush=True)
        connection_file = _write_connection(args, scheduler_ports)
        print("Press Ctrl-C to stop.", flush=True)
        units: list[ServiceProcess | ServiceGroup] = services
        if expert_parallel_group:  # its engines' workers and schedulers restart together
            members = [s for s in services if s.name.startswith(("worker", "scheduler"))]
            units = [s for s in services if s not in members]
            units.insert(len(units) - 1, ServiceGroup("expert-parallel group", members))  # (the gateway stays last)
        while True:  # a service that exits is restarted: a single-host deployment heals itself
            for unit in units:
                unit.supervise()
            time.sleep(0.5)
    except StartupError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        _ignore_stop_signals()
        print("stopping...", file=sys.stderr)
        return 0
    finally:
        _ignore_stop_signals()
        if connection_file is not None:
            connection_file.unlink(missing_ok=True)
        if gateway.proc is not None and gateway not in services:  # start-up failed after it started
            services.append(gateway)
        _drain_gateway(services, args.shutdown_timeout)
        stop_all(services, grace_s=EXIT_GRACE_S)


def _curl_example(base_url: str, served_model_name: str, api_keys: list[str] | None) -> str:
    """The banner's ready-to-paste request: with --api-key, it carries the first key (the API
    answers 401 without one)."""
    auth = f' -H "Authorization: Bearer {api_keys[0]}"' if api_keys else ""
    body = json.dumps({"model": served_model_name, "messages": [{"role": "user", "content": "Hello!"}]})
    return f"curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def _write_connection(args: argparse.Namespace, scheduler_ports: list[int]) -> Path | None:
    """Tell gRPC SDK clients on this machine where the schedulers are and the run's token
    (services/common/serve_connection.py), and say so in the banner."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "127.0.0.1", "localhost") else args.host
    connection = ServeConnection([f"{host}:{port}" for port in scheduler_ports], os.environ[TOKEN_ENV], args.port,
                                 os.getpid())
    try:
        path = connection.write()
    except OSError as e:
        print(f"  (gRPC SDK: could not write the connection file: {e})", flush=True)
        return None
    print(f"  gRPC SDK: services.client.Client() connects to the scheduler at {connection.schedulers[0]} (its "
          f"address and this run's internal token are in {path}, readable by you alone)", flush=True)
    return path


def _stop_on_sigterm(*_) -> None:
    """`kill` (SIGTERM) stops the children too, exactly like Ctrl-C."""
    _ignore_stop_signals()
    raise KeyboardInterrupt


def _ignore_stop_signals() -> None:
    """Once shutting down, a second SIGTERM or Ctrl-C (a supervisor or `make` repeating it) must
    not cut the orderly stop short: the services run in sessions of their own and would be left
    running. The stop itself escalates to SIGKILL where a service does not exit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _drain_gateway(services: list[ServiceProcess], shutdown_timeout_s: float) -> None:
    """Shutdown order: the gateway first, alone, so its in-flight requests can still finish
    on the engine (it exits once they are done, or after its --shutdown-timeout); only
    then do the scheduler and worker go."""
    for service in services:
        if service.name == "gateway" and service.exit_code is None:
            service.stop()
            # its own drain deadline, plus uvicorn's exit; stop_all escalates after that
            service.wait_or_kill(time.monotonic() + shutdown_timeout_s + EXIT_GRACE_S)


def _add_internal_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--internal-token", default=None,
                   help=f"shared secret every RPC must carry (default: ${TOKEN_ENV}; unset = no check)")


def add_subcommands(sub) -> None:
    w = sub.add_parser("worker", help="run a worker service (weights, KV cache, forward passes)")
    w.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    w.add_argument("--port", type=int, required=True, help="port to listen on")
    add_device_arg(w)
    w.add_argument("--allowed-model-root", default=None,
                   help="LoadModel may also load model directories under this one (default: only --model)")
    _add_internal_token_arg(w)
    add_model_args(w)
    add_speculative_arg(w)
    add_kv_transfer_arg(w)
    w.set_defaults(func=_cmd_worker)

    s = sub.add_parser("scheduler", help="run a scheduler service (queues, KV block accounting)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, required=True, help="port to listen on")
    s.add_argument("--workers", required=True,
                   help="worker address host:port; several (comma-separated, in rank order: the tensor-parallel "
                        "ranks of stage 0, then of stage 1, ...) = one engine's ranks")
    s.add_argument("--redis", default=None,
                   help=f"redis URL to publish this replica's load to (DP routing; default: ${REDIS_URL_ENV}); "
                        "credentials as redis-py takes them: redis://:PASSWORD@host:port/0 (the env var keeps "
                        "them out of `ps`)")
    s.add_argument("--engine-id", default=None, help="this replica's name in redis (default: its address)")
    s.add_argument("--data-parallel-rank", type=int, default=0,
                   help="with --data-parallel-size D > 1 and --enable-expert-parallel: this engine's rank in the "
                        "group (0 hosts the group's rendezvous and its DP coordinator)")
    s.add_argument("--data-parallel-address", default=None,
                   help="HOST:PORT where DP rank 0's scheduler hosts the expert-parallel group's rendezvous (every "
                        "engine of the group gives the same)")
    s.add_argument("--dp-group", default="default",
                   help="the expert-parallel group's name in redis (its wave state: myvllm:dp:NAME:wave)")
    s.add_argument("--advertise-address", default=None,
                   help="host:port gateways should dial, published in redis (default: host:port, with a wildcard "
                        "host replaced by this machine's hostname)")
    _add_internal_token_arg(s)
    add_scheduler_service_args(s)
    add_scheduling_args(s)
    add_parallel_args(s)
    s.set_defaults(func=_cmd_scheduler)

    g = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: loopback only; 0.0.0.0 for every interface, with --api-key)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--scheduler", default=None,
                   help="scheduler address host:port; several (comma-separated) = data-parallel replicas")
    g.add_argument("--redis", default=None,
                   help=f"redis URL: also route to every replica that publishes its load there (DP; default: "
                        f"${REDIS_URL_ENV}; may carry credentials, redis://:PASSWORD@host:port/0)")
    g.add_argument("--model", default=None, help="model directory (for the tokenizer and chat template)")
    add_served_model_name_arg(g)
    add_gateway_options(g)
    g.set_defaults(func=_cmd_gateway)

    v = sub.add_parser("serve", help="start worker, scheduler and gateway locally and serve the OpenAI API")
    v.add_argument("--host", default="127.0.0.1", help="address the gateway binds (the other services: loopback)")
    v.add_argument("--port", type=int, default=8000, help="the API's port (the gateway's)")
    v.add_argument("--worker-port", type=int, default=None,
                   help="the worker's port (rank 0's with tensor parallelism; the other ranks take the next ones)")
    v.add_argument("--scheduler-port", type=int, default=None,
                   help="the scheduler's port (default: a free one)")
    v.add_argument("--redis", default=None, help=f"redis URL for the replicas' load (default: ${REDIS_URL_ENV}, else "
                                                 "an embedded redis-server with a random password when "
                                                 "--data-parallel-size > 1)")
    v.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   help="seconds each service may take to become healthy")
    add_topology_args(v)  # also `myvllm deploy`'s (services/deploy)
    add_model_positional(v)
    add_vllm_compat_args(v)
    v.set_defaults(func=_cmd_serve)
