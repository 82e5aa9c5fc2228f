"""Service entry points: `myvllm worker | scheduler | gateway | serve`.

`serve` (what `make up` runs) starts the three services as separate local processes,
waits until each is healthy, prints where the API is, and stops them all on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from services.common.config import EngineConfig, check_model_dir, default_model_path
from services.common.grpc_utils import StartupError


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _run_async(coro) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
    load = pb.LoadModelRequest(model=model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len or 0,
                               attention_backend=args.attention_backend or "", max_num_seqs=args.max_num_seqs,
                               compile_model=getattr(args, "compile_model", False))
    return _run_async(serve_worker(args.host, args.port, load, device=args.device))


def _cmd_scheduler(args: argparse.Namespace) -> int:
    from services.cli import engine_kwargs
    from services.scheduler.server import serve_scheduler

    kwargs = engine_kwargs(args)
    # Model, dtype and the like belong to the worker; the scheduler forwards them only if given.
    kwargs["model"] = args.model or ""
    config = EngineConfig(**kwargs)
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    return _run_async(serve_scheduler(args.host, args.port, config, workers, redis_url=args.redis,
                                      engine_id=args.engine_id, advertise_address=args.advertise_address))


def _cmd_gateway(args: argparse.Namespace) -> int:
    from services.gateway.server import serve_gateway

    model = args.model or default_model_path()
    try:
        check_model_dir(model)
        if not args.scheduler and not args.redis:
            return _fail("gateway: give --scheduler addresses, --redis to discover them, or both")
        serve_gateway(args.host, args.port, args.scheduler or "", model, served_model_name=args.served_model_name,
                      redis_url=args.redis)
    except (StartupError, FileNotFoundError, OSError) as e:
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


def _wait_healthy(procs: list[tuple[str, subprocess.Popen]], check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise StartupError(f"{name} exited with code {p.returncode} during start-up (see its output above)")
        if check():
            return
        time.sleep(0.3)
    raise StartupError(f"{what} did not become healthy within {timeout:.0f}s")


def _grpc_healthy(address: str, service: str) -> bool:
    import grpc

    from services.common.proto import myvllm_pb2 as pb
    from services.common.proto import myvllm_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.SchedulerStub(ch) if service == "scheduler" else pb_grpc.WorkerStub(ch)
        try:
            return stub.Health(pb.Empty(), timeout=1.0).ok
        except grpc.RpcError:
            return False


def _http_healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _cmd_serve(args: argparse.Namespace) -> int:
    model = args.model or default_model_path()
    try:
        check_model_dir(model)
    except FileNotFoundError as e:
        return _fail(str(e))
    if not _port_free(args.host, args.port):
        return _fail(f"port {args.port} on {args.host} is already in use (pick another with --port)")
    worker_port = args.worker_port or free_port()
    scheduler_port = args.scheduler_port or free_port()
    py = [sys.executable, "-m", "services.cli"]
    engine_flags = ["--dtype", args.dtype, "--seed", str(args.seed), "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        engine_flags += ["--max-model-len", str(args.max_model_len)]
    if args.attention_backend:
        engine_flags += ["--attention-backend", args.attention_backend]
    if getattr(args, "compile_model", False):
        engine_flags.append("--compile")
    sched_flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
                   "--scheduling-policy", args.scheduling_policy]
    if not args.enable_prefix_caching:
        sched_flags.append("--no-enable-prefix-caching")
    if args.async_scheduling is not None:
        sched_flags.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.num_gpu_blocks_override:
        sched_flags += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    if args.kv_cache_memory_bytes:
        sched_flags += ["--kv-cache-memory", str(args.kv_cache_memory_bytes)]
    commands = [
        ("worker", py + ["worker", "--host", "127.0.0.1", "--port", str(worker_port), "--model", model] + engine_flags),
        ("scheduler", py + ["scheduler", "--host", "127.0.0.1", "--port", str(scheduler_port),
                            "--workers", f"127.0.0.1:{worker_port}"] + sched_flags),
        ("gateway", py + ["gateway", "--host", args.host, "--port", str(args.port),
                          "--scheduler", f"127.0.0.1:{scheduler_port}", "--model", model]
         + (["--served-model-name", args.served_model_name] if args.served_model_name else [])),
    ]
    procs: list[tuple[str, subprocess.Popen]] = []
    # `kill` (SIGTERM) stops the children too, exactly like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    checks = {
        "worker": lambda: _grpc_healthy(f"127.0.0.1:{worker_port}", "worker"),
        "scheduler": lambda: _grpc_healthy(f"127.0.0.1:{scheduler_port}", "scheduler"),
        "gateway": lambda: _http_healthy(f"http://127.0.0.1:{args.port}/health"),
    }
    try:
        for name, cmd in commands:
            procs.append((name, subprocess.Popen(cmd, start_new_session=True)))
            _wait_healthy(procs, checks[name], name, args.startup_timeout)
        host = "localhost" if args.host in ("0.0.0.0", "127.0.0.1") else args.host
        base = f"http://{host}:{args.port}/v1"
        served = args.served_model_name or os.path.basename(os.path.normpath(model))
        print(f"my-vllm is serving {served} at {base}", flush=True)
        print(f"  curl {base}/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        while True:
            for name, p in procs:
                if p.poll() is not None:
                    raise StartupError(f"{name} exited with code {p.returncode}")
            time.sleep(0.5)
    except StartupError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr)
        return 0
    finally:
        _stop_all(procs)


def _stop_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    for _, p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for _, p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def add_subcommands(sub, add_engine_args) -> None:
    w = sub.add_parser("worker", help="run a worker service (weights, KV cache, forward passes)")
    w.add_argument("--host", default="0.0.0.0")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    add_engine_args(w)
    w.set_defaults(func=_cmd_worker)

    s = sub.add_parser("scheduler", help="run a scheduler service (queues, KV block accounting)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--workers", required=True, help="worker address host:port (one; TP is not implemented)")
    s.add_argument("--redis", default=None, help="redis URL to publish this replica's load to (DP routing)")
    s.add_argument("--engine-id", default=None, help="this replica's name in redis (default: its address)")
    s.add_argument("--advertise-address", default=None,
                   help="host:port gateways should dial, published in redis (default: host:port, with a wildcard "
                        "host replaced by this machine's hostname)")
    add_engine_args(s)
    s.set_defaults(func=_cmd_scheduler)

    g = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--scheduler", default=None,
                   help="scheduler address host:port; several (comma-separated) = data-parallel replicas")
    g.add_argument("--redis", default=None,
                   help="redis URL: also route to every replica that publishes its load there (DP)")
    g.add_argument("--model", default=None, help="model directory (for the tokenizer and chat template)")
    g.add_argument("--served-model-name", default=None)
    g.set_defaults(func=_cmd_gateway)

    v = sub.add_parser("serve", help="start worker, scheduler and gateway locally and serve the OpenAI API")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--worker-port", type=int, default=None)
    v.add_argument("--scheduler-port", type=int, default=None)
    v.add_argument("--served-model-name", default=None)
    v.add_argument("--startup-timeout", type=float, default=300.0)
    add_engine_args(v)
    v.set_defaults(func=_cmd_serve)
