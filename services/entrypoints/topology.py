"""The processes of a my-vllm deployment, in one place: `myvllm serve` starts them, `myvllm deploy
compose` and `myvllm deploy k8s` write them down.

A topology (D engine replicas of T x P worker ranks each, one gateway, a redis when D > 1)
becomes a list of `ProcessSpec`: each process's name, role, replica and rank, its command line,
the port it listens on, the address the others dial it at, and the secrets it reads from its
environment. Where the processes run is a `Placement`, which supplies only the command's first
words, bind hosts, ports and the hosts the others dial:

- `LocalPlacement` (serve): this Python, loopback, ports picked free on this machine;
- `ComposePlacement`: the `myvllm` command of the image, each service dialled by its compose name;
- `KubernetesPlacement`: the same command, each pod dialled by its stable DNS name (StatefulSet
  pod `<set>-<ordinal>.<headless service>`, the gateway and redis by their Service names).

Every flag comes from the same rules whatever the placement, so a container's command is exactly
what serve runs for that process with its addresses and ports swapped (tests/e2e/test_deploy_k8s.py
checks that), and a serve flag added here reaches compose and Kubernetes too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.auth import TOKEN_ENV
from services.common.config import VllmConfig
from services.common.kv_transfer_config import KVTransferConfig
from services.common.parallel_shapes import check_tensor_parallel_shapes, read_model_shapes
from services.common.redis_registry import REDIS_URL_ENV
from services.common.secret_check import API_KEY_ENV
from services.entrypoints.engine_args import (
    add_engine_args,
    add_kv_transfer_arg,
    add_model_args,
    add_parallel_args,
    add_scheduler_service_args,
    add_scheduling_args,
    add_speculative_arg,
    engine_kwargs,
)
from services.gateway.lora_registry import LoraRegistry, parse_lora_module
from services.gateway.options import CREDENTIAL_OPTIONS, add_gateway_options

REDIS, WORKER, SCHEDULER, GATEWAY = "redis", "worker", "scheduler", "gateway"
# Not a process: the rendezvous of a data-parallel expert-parallel group, which DP rank 0's
# scheduler hosts (a port of its own on that scheduler's host).
GROUP = "group"
DEFAULT_STARTUP_TIMEOUT_S = 300.0
# How long serve gives a stopped service to exit before it kills it (after the gateway's own
# --shutdown-timeout drain); Kubernetes' grace periods add the same.
EXIT_GRACE_S = 10.0


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """The worker's device: `myvllm worker`'s flag, which serve and deploy forward to each worker."""
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def add_served_model_name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API: requests may name any, responses report the first "
                        "(default: the model directory's name)")


def add_topology_args(p: argparse.ArgumentParser) -> None:
    """serve's flags that shape the processes it starts (so also `deploy compose | k8s`'s)."""
    add_served_model_name_arg(p)
    add_device_arg(p)
    add_scheduler_service_args(p)
    add_gateway_options(p)
    add_engine_args(p)
    add_disaggregation_args(p)


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                   help="prefill/decode disaggregation: P engine replicas that prefill (kv_producer) and "
                        "--decode-replicas D that decode (kv_consumer), instead of --data-parallel-size; the "
                        "gateway sends each request's prompt to a prefill replica (by its cached prefix), then the "
                        "request to a decode replica (by load), which loads the prompt's KV from shared memory "
                        "(one host) instead of computing it. --kv-transfer-config, if given, supplies the "
                        "connector settings (its kv_role is set per replica)")
    p.add_argument("--decode-replicas", type=int, default=0, metavar="D",
                   help="with --prefill-replicas: the decode replicas (kv_consumer)")


def check_disaggregation(args: argparse.Namespace) -> None:
    """With --prefill-replicas P --decode-replicas D: check the combination (ValueError naming
    the flag). The deployment is then P + D replicas (`num_replicas`; their roles:
    `kv_transfer_config_of`)."""
    p, d = args.prefill_replicas, args.decode_replicas
    if not p and not d:
        return
    if p < 1 or d < 1:
        raise ValueError("--prefill-replicas and --decode-replicas go together, each at least 1")
    if args.data_parallel_size != 1:
        raise ValueError("--prefill-replicas P --decode-replicas D make P + D replicas: leave --data-parallel-size "
                         "out")
    if args.enable_expert_parallel:
        raise ValueError("--prefill-replicas does not combine with --enable-expert-parallel (lockstep replicas)")
    if args.runner != "generate":
        raise ValueError("--prefill-replicas needs --runner generate (pooling requests have no decode)")
    KVTransferConfig.parse(kv_transfer_config_of(args, 0))  # the connector settings given, if any, are valid


def check_topology(args: argparse.Namespace, model: str, shapes_dir: str | None = None) -> None:
    """serve's checks of its flags before it starts anything, which `deploy` runs before it writes
    anything (ValueError naming the flag): sizes of at least 1, disaggregation flags that combine,
    an engine configuration the flags make, and a tensor-parallel size the model's shapes split
    over. `model`: the model directory as the processes see it; `shapes_dir`: where this machine
    reads its config.json (default `model`; none there: the worker checks when it loads)."""
    if min(args.data_parallel_size, args.tensor_parallel_size, args.pipeline_parallel_size) < 1:
        raise ValueError("--data-parallel-size, --tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    check_disaggregation(args)
    check_lora_modules(args)
    VllmConfig.from_engine_args(**{**engine_kwargs(args), "model": model,
                                   "kv_transfer_config": kv_transfer_config_of(args, 0)})
    shapes_dir = shapes_dir or model
    shapes = read_model_shapes(shapes_dir)
    if shapes is not None:
        tp = args.tensor_parallel_size
        # The ranks that split an MoE layer's experts (services/worker/parallel.py's init_parallel).
        expert_parallel = bool(args.enable_expert_parallel) and (num_replicas(args) > 1 or tp > 1)
        try:
            check_tensor_parallel_shapes(shapes, tp, expert_parallel=expert_parallel)
        except ValueError as e:
            raise ValueError(f"--tensor-parallel-size {tp} does not fit the model ({shapes_dir}): {e}") from None


def check_lora_modules(args: argparse.Namespace) -> None:
    """--lora-modules needs --enable-lora, and each adapter must be one the engine takes (its rank
    within --max-lora-rank): checked here, where both the gateway's and the engine's flags are."""
    if not args.lora_modules:
        return
    if not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine then holds the adapters)")
    LoraRegistry([parse_lora_module(text) for text in args.lora_modules], args.lora_root, args.max_lora_rank)


def num_replicas(args: argparse.Namespace) -> int:
    """Engine replicas: P + D with --prefill-replicas P --decode-replicas D, else --data-parallel-size."""
    p = getattr(args, "prefill_replicas", 0)
    return p + args.decode_replicas if p else args.data_parallel_size


def kv_transfer_config_of(args: argparse.Namespace, replica: int, producer_workers: Sequence[str] = ()) -> str | None:
    """Replica `replica`'s --kv-transfer-config: with --prefill-replicas P, the first P replicas are
    kv_producer and the others kv_consumer, with --kv-transfer-config's connector settings (else
    SharedMemoryConnector's defaults); otherwise --kv-transfer-config as given. A GrpcConnector
    consumer is told `producer_workers`, the producers' worker addresses: the only ones its worker
    fetches from (presenting the internal token), Redis or not."""
    if not getattr(args, "prefill_replicas", 0):
        return args.kv_transfer_config
    try:
        base = json.loads(args.kv_transfer_config) if args.kv_transfer_config else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
    if not isinstance(base, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    role = "kv_producer" if replica < args.prefill_replicas else "kv_consumer"
    config = {"kv_connector": "SharedMemoryConnector", **base, "kv_role": role}
    if role == "kv_consumer" and producer_workers and config["kv_connector"] == "GrpcConnector":
        extra = config.get("kv_connector_extra_config") or {}
        config["kv_connector_extra_config"] = {**extra, "producer_addresses": [
            *extra.get("producer_addresses", []), *producer_workers]}
    return json.dumps(config)


def forwarded_flags(args: argparse.Namespace, add_args: Callable[[argparse.ArgumentParser], None],
                    exclude: Sequence[str] = ()) -> list[str]:
    """The flags `add_args` defines, as given (defaults and the `exclude`d dests left out): what
    serve passes on to the service that reads them, so no serve flag is dropped on the way."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        if action.dest in exclude:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        option = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false: the flag itself is the value
            if value == action.const:
                flags.append(option)
        elif isinstance(value, list):  # nargs="+": each value an argument
            flags += [option, *map(str, value)]
        else:
            flags += [option, str(value)]
    return flags


def redis_url(address: str, password: str | None) -> str:
    """What schedulers and gateway get in $MYVLLM_REDIS_URL (never on a command line)."""
    return f"redis://{f':{password}@' if password else ''}{address}/0"


@dataclass(frozen=True)
class Topology:
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # --data-parallel-size > 1 with --enable-expert-parallel: the replicas are one torch.distributed
    # group, whose rendezvous DP rank 0's scheduler hosts.
    expert_parallel_group: bool = False
    # Schedulers publish their load to a redis (gateways read it) ...
    redis: bool = False
    # ... which is one of the deployment's processes (else --redis names one of the user's).
    redis_server: bool = False

    @property
    def ranks(self) -> int:
        """Worker ranks per engine replica (stage-major: stage 0's T ranks, then stage 1's, ...)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def of(cls, args: argparse.Namespace, *, redis_server: bool, external_redis: bool = False) -> Topology:
        check_disaggregation(args)
        pd = getattr(args, "prefill_replicas", 0)
        if pd and not KVTransferConfig.parse(kv_transfer_config_of(args, 0)).crosses_hosts:
            raise ValueError("--prefill-replicas / --decode-replicas with SharedMemoryConnector need one host's "
                             "shared memory (myvllm serve); containers and pods do not share /dev/shm: use "
                             "--kv-transfer-config '{\"kv_connector\": \"GrpcConnector\"}'")
        d = num_replicas(args)
        return cls(d, args.tensor_parallel_size, args.pipeline_parallel_size,
                   expert_parallel_group=bool(args.enable_expert_parallel) and d > 1,
                   redis=redis_server or external_redis, redis_server=redis_server)

    def worker_name(self, replica: int, rank: int) -> str:
        return f"worker{self._suffix(replica)}" + (f"-rank{rank}" if self.ranks > 1 else "")

    def scheduler_name(self, replica: int) -> str:
        return f"scheduler{self._suffix(replica)}"

    def _suffix(self, replica: int) -> str:
        return f"-{replica}" if self.data_parallel_size > 1 else ""


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # serve's name for it (also its compose service name)
    role: str  # REDIS, WORKER, SCHEDULER or GATEWAY
    replica: int | None  # the engine replica (DP rank) of a worker or scheduler
    rank: int | None  # a worker's rank within its replica (stage-major)
    argv: tuple[str, ...]
    bind_host: str
    port: int
    address: str  # host:port the other processes dial
    # The environment variables it reads its secrets from (the placement supplies the values):
    # secrets never go on a command line, which `ps` shows.
    env: tuple[str, ...] = field(default=())


class Placement(Protocol):
    """Where the processes run: the only source of command prefixes, bind hosts, ports and dial
    hosts (the substitution that turns serve's command lines into a container's)."""

    command: tuple[str, ...]  # how a `myvllm` command starts
    redis_executable: str
    # How redis-server's argv names its password (`--requirepass` VALUE); None: it reads it on stdin.
    redis_password: str | None

    def bind_host(self, role: str) -> str: ...

    def port(self, role: str, replica: int = 0, rank: int = 0) -> int: ...

    def dial_host(self, name: str, role: str, replica: int = 0, rank: int = 0) -> str: ...


@dataclass(frozen=True)
class LocalPlacement:
    """serve's: every service on this machine, on loopback (the gateway on `--host`), at ports
    picked beforehand: `worker_ports[replica][rank]`, `scheduler_ports[replica]`."""

    gateway_host: str
    gateway_port: int
    worker_ports: Sequence[Sequence[int]]
    scheduler_ports: Sequence[int]
    redis_port: int | None = None
    group_port: int | None = None
    redis_executable: str = "redis-server"
    command: tuple[str, ...] = (sys.executable, "-m", "services.entrypoints.cli")
    redis_password: str | None = None  # the embedded redis-server reads its password on stdin

    def bind_host(self, role: str) -> str:
        # Worker and scheduler ports are internal: loopback only, whatever the gateway binds.
        return self.gateway_host if role == GATEWAY else "127.0.0.1"

    def port(self, role: str, replica: int = 0, rank: int = 0) -> int:
        ports = {WORKER: lambda: self.worker_ports[replica][rank], SCHEDULER: lambda: self.scheduler_ports[replica],
                 GATEWAY: lambda: self.gateway_port, REDIS: lambda: self.redis_port, GROUP: lambda: self.group_port}
        return ports[role]()

    def dial_host(self, name: str, role: str, replica: int = 0, rank: int = 0) -> str:
        return "127.0.0.1"


# The ports of containerised services. In Kubernetes each pod has an address of its own, so every
# rank listens on the same port (one pod template serves all of a StatefulSet's ranks).
GATEWAY_PORT, SCHEDULER_PORT, WORKER_PORT, REDIS_PORT, GROUP_PORT = 8000, 50051, 50052, 6379, 50050


@dataclass(frozen=True)
class ComposePlacement:
    """A compose network: each service is dialled by its name. Ports stay distinct across services
    (replica r's scheduler at 50051 + 100 r, its rank k at 50052 + 100 r + k), so that the file's
    commands also run side by side as local processes (tests/e2e/test_compose.py)."""

    command: tuple[str, ...] = ("myvllm",)
    redis_executable: str = "redis-server"
    redis_password: str | None = "${MYVLLM_REDIS_PASSWORD:?set MYVLLM_REDIS_PASSWORD to a secret}"

    def bind_host(self, role: str) -> str:
        return "0.0.0.0"  # inside the compose network; only the gateway's port is published

    def port(self, role: str, replica: int = 0, rank: int = 0) -> int:
        return {WORKER: WORKER_PORT + 100 * replica + rank, SCHEDULER: SCHEDULER_PORT + 100 * replica,
                GATEWAY: GATEWAY_PORT, REDIS: REDIS_PORT, GROUP: GROUP_PORT}[role]

    def dial_host(self, name: str, role: str, replica: int = 0, rank: int = 0) -> str:
        return name


@dataclass(frozen=True)
class KubernetesPlacement:
    """A Kubernetes namespace. Object names derive from `name` (one deployment per name):
    replica r's ranks are StatefulSet `<name>-engine-<r>-worker` (pod ordinal = rank), its
    scheduler StatefulSet `<name>-engine-<r>-scheduler` (one pod), both under the headless
    Service `<name>-engine-<r>`, so each pod is dialled by `<pod>.<name>-engine-<r>` (short names:
    the pod's DNS search path adds the namespace). The gateway and redis are Services."""

    name: str = "myvllm"
    command: tuple[str, ...] = ("myvllm",)
    redis_executable: str = "redis-server"
    # Kubernetes expands $(VAR) in a container's command from its env (the Secret's value).
    redis_password: str | None = "$(MYVLLM_REDIS_PASSWORD)"

    def bind_host(self, role: str) -> str:
        return "0.0.0.0"

    def port(self, role: str, replica: int = 0, rank: int = 0) -> int:
        return {WORKER: WORKER_PORT, SCHEDULER: SCHEDULER_PORT, GATEWAY: GATEWAY_PORT, REDIS: REDIS_PORT,
                GROUP: GROUP_PORT}[role]

    def dial_host(self, name: str, role: str, replica: int = 0, rank: int = 0) -> str:
        if role == WORKER:
            return f"{self.worker_set(replica)}-{rank}.{self.engine_service(replica)}"
        if role in (SCHEDULER, GROUP):
            # A pod's own name, not a Service's virtual IP: the scheduler's rendezvous store (and an
            # expert-parallel group's) listen on ports no Service lists.
            return f"{self.scheduler_set(replica)}-0.{self.engine_service(replica)}"
        return {GATEWAY: self.gateway, REDIS: self.redis}[role]

    def engine_service(self, replica: int) -> str:
        return f"{self.name}-engine-{replica}"

    def worker_set(self, replica: int) -> str:
        return f"{self.name}-engine-{replica}-worker"

    def scheduler_set(self, replica: int) -> str:
        return f"{self.name}-engine-{replica}-scheduler"

    @property
    def gateway(self) -> str:
        return f"{self.name}-gateway"

    @property
    def redis(self) -> str:
        return f"{self.name}-redis"


def processes(args: argparse.Namespace, model: str, topology: Topology, placement: Placement) -> list[ProcessSpec]:
    """Every process of the topology, in start order: redis (when it is one of them), then each
    replica's worker ranks and its scheduler, then the gateway. `args`: serve's flags
    (add_topology_args); `model`: the model directory as the processes see it."""
    cli = list(placement.command)

    def spec(name: str, role: str, argv: list[str], replica: int | None = None, rank: int | None = None,
             env: tuple[str, ...] = ()) -> ProcessSpec:
        port = placement.port(role, replica or 0, rank or 0)
        host = placement.dial_host(name, role, replica or 0, rank or 0)
        return ProcessSpec(name, role, replica, rank, tuple(argv), placement.bind_host(role), port,
                           f"{host}:{port}", env)

    def listen(role: str, replica: int = 0, rank: int = 0) -> list[str]:
        return ["--host", placement.bind_host(role), "--port", str(placement.port(role, replica, rank))]

    specs: list[ProcessSpec] = []
    if topology.redis_server:
        password = placement.redis_password
        # `-` first: the rest of its configuration (the password) comes on stdin.
        argv = [placement.redis_executable] + (["-"] if password is None else []) \
            + ["--port", str(placement.port(REDIS)), "--bind", placement.bind_host(REDIS), "--save", "",
               "--appendonly", "no"] + (["--requirepass", password] if password is not None else [])
        specs.append(spec(REDIS, REDIS, argv))
    redis_env = (REDIS_URL_ENV,) if topology.redis else ()
    group = None
    if topology.expert_parallel_group:
        group_host = placement.dial_host(topology.scheduler_name(0), GROUP, 0)
        group = f"{group_host}:{placement.port(GROUP)}"
    schedulers: list[ProcessSpec] = []
    producer_workers: list[str] = []  # (the prefill replicas come first)
    for replica in range(topology.data_parallel_size):
        # Its flags: its KV transfer role (a prefill or decode replica of a disaggregated deployment,
        # each an engine of its own), the model directory as its processes see it.
        pd = {"data_parallel_size": 1} if getattr(args, "prefill_replicas", 0) else {}
        replica_args = argparse.Namespace(**{**vars(args), "model": model, **pd,
                                             "kv_transfer_config": kv_transfer_config_of(args, replica,
                                                                                         producer_workers)})
        worker_flags = [flag for add in (add_model_args, add_speculative_arg, add_device_arg, add_kv_transfer_arg)
                        for flag in forwarded_flags(replica_args, add)]
        ranks = [spec(topology.worker_name(replica, rank), WORKER,
                      cli + ["worker"] + listen(WORKER, replica, rank) + worker_flags, replica, rank, (TOKEN_ENV,))
                 for rank in range(topology.ranks)]
        if replica < getattr(args, "prefill_replicas", 0):
            producer_workers.append(ranks[0].address)
        name = topology.scheduler_name(replica)
        address = f"{placement.dial_host(name, SCHEDULER, replica)}:{placement.port(SCHEDULER, replica)}"
        # --advertise-address: where gateways (from redis) and its ranks (the rendezvous) reach it;
        # serve's is the default (its bind address), spelled out so that every placement says it.
        argv = cli + ["scheduler"] + listen(SCHEDULER, replica) \
            + ["--workers", ",".join(r.address for r in ranks), "--advertise-address", address] \
            + (["--engine-id", f"replica-{replica}"] if topology.redis else []) \
            + (["--data-parallel-rank", str(replica), "--data-parallel-address", group] if group else []) \
            + forwarded_flags(replica_args, add_scheduling_args) + forwarded_flags(args, add_scheduler_service_args) \
            + forwarded_flags(replica_args, add_parallel_args)
        schedulers.append(spec(name, SCHEDULER, argv, replica, env=(TOKEN_ENV, *redis_env)))
        specs += ranks + [schedulers[-1]]
    gateway = cli + ["gateway"] + listen(GATEWAY) + ["--scheduler", ",".join(s.address for s in schedulers),
                                                     "--model", model] \
        + (["--served-model-name", *args.served_model_name] if args.served_model_name else []) \
        + forwarded_flags(args, add_gateway_options, exclude=CREDENTIAL_OPTIONS)  # those go by environment
    specs.append(spec(GATEWAY, GATEWAY, gateway, env=(TOKEN_ENV, *redis_env, API_KEY_ENV)))
    return specs


def healthcheck_command(spec: ProcessSpec) -> list[str]:
    """The check a container runs inside itself (compose healthchecks, Kubernetes exec probes):
    `services.entrypoints.healthcheck` (it presents the internal token from the environment), redis-cli for
    redis (REDISCLI_AUTH in its environment)."""
    if spec.role == REDIS:
        return ["redis-cli", "-p", str(spec.port), "ping"]
    return ["python", "-m", "services.entrypoints.healthcheck", spec.role, f"127.0.0.1:{spec.port}"]
