"""Every committed deployment file (deploy/docker-compose*.yml, deploy/k8s/) describes a topology
`myvllm serve` would start: read off the committed YAML (compose services' `command`, Kubernetes
containers' `command`), each service's command line parses with the real `myvllm worker |
scheduler | gateway` parsers, each listens on a valid port at an address of its own, every
address a service dials is one another listens at, and the topology rebuilt from the commands
passes serve's own checks (services/entrypoints/topology.py's check_topology), the model's shapes read from
the shipped model the image converts (SmolLM2-135M: 9 attention heads, 3 KV heads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.entrypoints.cli import build_parser
from services.entrypoints.deploy.cli import IMAGE_MODEL_DIR
from services.entrypoints.engine_args import add_model_args
from services.entrypoints.topology import check_topology, forwarded_flags

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
COMMITTED = sorted(p.name for p in DEPLOY.glob("docker-compose*.yml")) + ["k8s"]


def _compose_services(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Service name -> (its command, the addresses it listens at)."""
    services = yaml.safe_load(path.read_text())["services"]
    out = {}
    for name, service in services.items():
        argv = [a.replace("$$", "$") for a in service["command"]]  # compose's escape of a literal `$`
        port = argv[argv.index("--port") + 1]
        out[name] = (argv, [f"{name}:{port}"])
    return out


def _k8s_services(directory: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Workload name -> (its container's command, the addresses its pods listen at: a StatefulSet's
    pod N is `<set>-N.<serviceName>`, a Deployment is reached through its Service's name)."""
    objects = [o for p in sorted(directory.glob("*.yaml")) for o in yaml.safe_load_all(p.read_text()) if o]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    out = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        argv = [a.replace("$$", "$") for a in container["command"]]  # Kubernetes' escape of a literal `$`
        port = argv[argv.index("--port") + 1]
        name = obj["metadata"]["name"]
        if obj["kind"] == "StatefulSet":
            addresses = [f"{name}-{i}.{obj['spec']['serviceName']}:{port}" for i in range(obj["spec"]["replicas"])]
        else:
            assert name in services, name
            addresses = [f"{name}:{port}"]
        out[name] = (argv, addresses)
    return out


def _parse(argv: list[str]):
    """The command line as its own service parses it (argparse exits on anything it refuses)."""
    assert argv[0] == "myvllm", argv
    return build_parser().parse_args(argv[1:])


@pytest.mark.parametrize("name", COMMITTED)
def test_each_committed_topology_passes_serves_checks(name: str, smollm2_dir: str) -> None:
    path = DEPLOY / name
    services = _k8s_services(path) if name == "k8s" else _compose_services(path)
    by_role: dict[str, list[tuple]] = {"worker": [], "scheduler": [], "gateway": []}
    listening: list[str] = []
    for argv, addresses in services.values():
        if argv[0] == "redis-server":
            port = int(argv[argv.index("--port") + 1])
        else:
            assert argv[1] in by_role, argv
            args = _parse(argv)
            port = args.port
            by_role[argv[1]].append((args, addresses))
        assert 1 <= port <= 65535, (argv[:2], port)
        listening += addresses
    assert len(listening) == len(set(listening)), "two services listen at one address"
    if name != "k8s":  # compose's ports stay distinct, so its commands also run side by side locally
        ports = [a.rsplit(":", 1)[1] for a in listening]
        assert len(ports) == len(set(ports)), ports

    workers, schedulers, (gateway,) = by_role["worker"], by_role["scheduler"], by_role["gateway"]
    worker_addresses = [a for _, addresses in workers for a in addresses]
    scheduler_addresses = [a for _, addresses in schedulers for a in addresses]
    # Every worker rank belongs to exactly one scheduler, which lists T x P of them.
    dialled = []
    for args, (address,) in schedulers:
        ranks = args.workers.split(",")
        assert len(ranks) == args.tensor_parallel_size * args.pipeline_parallel_size, (address, ranks)
        assert args.advertise_address == address
        dialled += ranks
    assert sorted(dialled) == sorted(worker_addresses)
    assert sorted(gateway[0].scheduler.split(",")) == sorted(scheduler_addresses)

    # One engine configuration for every rank; the scheduler's parallel flags agree with it.
    model_flags = {tuple(forwarded_flags(args, add_model_args)) for args, _ in workers}
    assert len(model_flags) == 1, model_flags
    worker = workers[0][0]
    for args, _ in schedulers:
        assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (
            worker.tensor_parallel_size, worker.pipeline_parallel_size)
    assert worker.data_parallel_size == len(schedulers)
    assert worker.model == gateway[0].model == IMAGE_MODEL_DIR  # the image's model: the shipped SmolLM2

    # serve's own checks on the rebuilt topology, the shapes read from the shipped model.
    serve = build_parser().parse_args(["serve", *model_flags.pop()])
    assert (serve.data_parallel_size, serve.tensor_parallel_size) == (len(schedulers), worker.tensor_parallel_size)
    check_topology(serve, worker.model, shapes_dir=smollm2_dir)
    # ... which are no rubber stamp: the same topology at -tp 2 (the model's 9 heads) is refused.
    serve.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="does not divide num_attention_heads=9"):
        check_topology(serve, worker.model, shapes_dir=smollm2_dir)
