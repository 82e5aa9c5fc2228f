"""deploy/k8s/: the Kubernetes manifests `myvllm deploy k8s` writes for the reference topology
(2 engine replicas x 3 tensor-parallel ranks, CPU), checked offline: the committed files are
current, every object is valid against the Kubernetes API's own schemas (`kubernetes-validate`,
which ships them), and every container runs exactly the command `myvllm serve` runs for that
process, with only its addresses and ports swapped for the pods' DNS names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.entrypoints.cli import build_parser, main
from services.entrypoints.deploy.cli import GENERATED, IMAGE_MODEL_DIR
from services.entrypoints.topology import EXIT_GRACE_S
from services.gateway.options import DEFAULT_SHUTDOWN_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# The reference topology (docs/deployment.md "Kubernetes" regenerates it with these flags).
REFERENCE = ["--device", "cpu", "--tensor-parallel-size", "3", "--data-parallel-size", "2"]
# The oldest Kubernetes the manifests are meant for, and the newest the library knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())


def _objects(directory: Path) -> list[dict]:
    return [doc for path in sorted(directory.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _generate(tmp_path: Path, *flags: str) -> Path:
    out = tmp_path / "k8s"
    assert main(["deploy", "k8s", "--out", str(out), *flags]) == 0
    return out


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_committed_manifests_are_current(tmp_path: Path) -> None:
    out = _generate(tmp_path, *REFERENCE)
    committed = {p.name: p.read_text() for p in K8S.iterdir()}
    written = {p.name: p.read_text() for p in out.iterdir()}
    assert set(committed) == set(written)
    for name, text in written.items():
        assert committed[name] == text, (
            f"deploy/k8s/{name} is stale: myvllm deploy k8s --out deploy/k8s {shlex.join(REFERENCE)}")
    first = committed["gateway.yaml"].splitlines()[0]
    assert first == f"{GENERATED} k8s --out DIR {shlex.join(REFERENCE)}"


def test_a_regeneration_removes_the_files_of_replicas_that_are_gone(tmp_path: Path) -> None:
    out = _generate(tmp_path, "-dp", "3")
    (out / "mine.yaml").write_text("# not written by deploy\n")
    _generate(tmp_path, "-dp", "2")
    assert sorted(p.name for p in out.iterdir()) == ["disruption-budget.yaml", "engine-0.yaml", "engine-1.yaml",
                                                     "gateway.yaml", "mine.yaml", "redis.yaml"]


@pytest.mark.parametrize("flags", [
    REFERENCE,
    ["--device", "cuda", "-tp", "3", "-pp", "2", "-dp", "3", "--keda"],  # GPUs, pipeline stages, KEDA
    ["-dp", "2", "--api-key", "an-api-key-of-32-characters-0123"],  # with the Secret
    [],  # one replica, one rank: no redis
    ["-dp", "2", "--enable-expert-parallel", "--name", "moe", "--model", "/models/moe"],  # one expert-parallel group
])
def test_every_object_is_valid_against_the_kubernetes_schemas(tmp_path: Path, flags: list[str]) -> None:
    """Strict: an unknown or misplaced field fails too. KEDA's ScaledObject is a custom resource
    whose schema the library does not ship: test_keda_scaled_objects checks it."""
    objects = _objects(K8S if flags is REFERENCE else _generate(tmp_path, *flags))
    for obj in objects:
        if obj["apiVersion"] == "keda.sh/v1alpha1":
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


def test_the_schemas_catch_a_bad_object() -> None:
    """The validator is not a rubber stamp: a misplaced field or a wrong type fails."""
    deployment = _by_kind(_objects(K8S), "Deployment")["myvllm-gateway"]
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def _serve_commands() -> dict[str, list[str]]:
    """What `myvllm serve` runs for the reference topology (its own code path, with ports of our
    choosing and the model directory the image has)."""
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", *REFERENCE])
    commands = _serve_commands(args, IMAGE_MODEL_DIR, [[11, 12, 13], [21, 22, 23]], [10, 20], 6379)
    return {name: command for name, command, _ in commands}


def _container(obj: dict) -> dict:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


def _k8s_addresses(objects: list[dict]) -> dict[str, str]:
    """serve's process name -> the address its pod is dialled at, read off the manifests: a
    StatefulSet's pod N is `<set>-N.<serviceName>`, and that Service must be headless."""
    services = _by_kind(objects, "Service")
    addresses = {}
    for obj in _by_kind(objects, "StatefulSet").values():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        role, replica = labels["app.kubernetes.io/component"], labels["myvllm/engine-replica"]
        governing = services[obj["spec"]["serviceName"]]["spec"]
        assert governing["clusterIP"] == "None" and governing["publishNotReadyAddresses"] is True
        assert set(governing["selector"].items()) <= set(labels.items())
        port = _container(obj)["ports"][0]["containerPort"]
        for ordinal in range(obj["spec"]["replicas"]):
            name = f"worker-{replica}-rank{ordinal}" if role == "worker" else f"scheduler-{replica}"
            addresses[name] = f"{obj['metadata']['name']}-{ordinal}.{obj['spec']['serviceName']}:{port}"
    return addresses


def test_each_container_runs_serves_command_for_its_rank() -> None:
    """For each process serve starts (-dp 2 -tp 3): the container's command is serve's with the
    Python entry point as the image's `myvllm`, each bind address 0.0.0.0, each port the
    container's, and each address another process is dialled at its pod's DNS name. Nothing else
    may differ: no flag added, dropped or changed. A StatefulSet's ranks share one template, so
    every rank's command must map to that same one."""
    objects = _objects(K8S)
    serve = _serve_commands()
    addresses = _k8s_addresses(objects)
    sets = _by_kind(objects, "StatefulSet")
    containers = {}
    for replica in (0, 1):
        for rank in (0, 1, 2):
            containers[f"worker-{replica}-rank{rank}"] = _container(sets[f"myvllm-engine-{replica}-worker"])
        containers[f"scheduler-{replica}"] = _container(sets[f"myvllm-engine-{replica}-scheduler"])
    containers["gateway"] = _container(_by_kind(objects, "Deployment")["myvllm-gateway"])
    assert set(serve) == set(containers) | {"redis"}
    serve_ports = {f"worker-{replica}-rank{rank}": 10 * (replica + 1) + rank + 1 for replica in (0, 1)
                   for rank in (0, 1, 2)} | {"scheduler-0": 10, "scheduler-1": 20}
    swap = {f"127.0.0.1:{port}": addresses[name] for name, port in serve_ports.items()}

    for name, container in containers.items():
        command = serve[name]
        assert command[:3][1:] == ["-m", "services.entrypoints.cli"]
        expected = ["myvllm", *command[3:]]
        expected[expected.index("--host") + 1] = "0.0.0.0"  # in its own pod, reached through the pod network
        expected[expected.index("--port") + 1] = str(container["ports"][0]["containerPort"])
        expected = [",".join(swap.get(part, part) for part in arg.split(",")) for arg in expected]
        assert container["command"] == expected, name
        assert not any("127.0.0.1" in arg for arg in container["command"]), name
    # The schedulers' rank lists are those pods, in ordinal (= rank) order.
    scheduler = containers["scheduler-1"]["command"]
    assert scheduler[scheduler.index("--workers") + 1] == ",".join(
        f"myvllm-engine-1-worker-{rank}.myvllm-engine-1:50052" for rank in (0, 1, 2))
    assert sets["myvllm-engine-1-worker"]["spec"]["replicas"] == 3
    assert sets["myvllm-engine-1-worker"]["spec"]["podManagementPolicy"] == "Parallel"


def _secret_readers(objects: list[dict]) -> dict[str, set[str]]:
    """Container name -> the Secret keys it reads; no secret, nor a Redis URL, on a command line."""
    readers: dict[str, set[str]] = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        container = _container(obj)
        refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", []) if "valueFrom" in e}
        assert {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if "valueFrom" in e} <= {
            "myvllm-credentials"}
        readers[container["name"]] = readers.get(container["name"], set()) | refs
        assert not any(re.search(r"REPLACE_ME|redis://", arg) for arg in container["command"])
    return readers


def test_secrets_reach_only_their_readers_and_none_is_committed() -> None:
    """The committed files hold no Secret, so nothing that looks like a value (a placeholder
    applied unedited would be a secret everyone knows): the user creates the Secret first, as
    each file's header says."""
    objects = _objects(K8S)
    assert not _by_kind(objects, "Secret") and not (K8S / "credentials.yaml").exists()
    for path in K8S.iterdir():
        text = path.read_text()
        assert "REPLACE_ME" not in text and "stringData" not in text, path.name
        assert "kubectl create secret generic myvllm-credentials --from-literal=internal-token=" in text, path.name
    readers = _secret_readers(objects)
    assert readers == {"worker": {"internal-token"}, "scheduler": {"internal-token", "redis-password"},
                       "gateway": {"internal-token", "redis-password", "api-key"}, "redis": {"redis-password"}}
    gateway_env = {e["name"]: e for e in _container(_by_kind(objects, "Deployment")["myvllm-gateway"])["env"]}
    assert gateway_env["MYVLLM_REDIS_URL"]["value"] == "redis://:$(MYVLLM_REDIS_PASSWORD)@myvllm-redis:6379/0"
    names = list(gateway_env)
    assert names.index("MYVLLM_REDIS_PASSWORD") < names.index("MYVLLM_REDIS_URL")  # $(VAR): defined before use


def test_an_api_key_given_goes_into_the_secret_file_only(tmp_path: Path) -> None:
    """`deploy k8s --api-key KEY` writes KEY to credentials.yaml (its owner's alone), with a random
    internal token and redis password that the services' own check accepts; no other file, nor
    any header, carries it; a regeneration without the key removes the file."""
    from services.common.secret_check import secret_problem

    key = "an-api-key-of-32-characters-0123"
    out = _generate(tmp_path, "-dp", "2", "--api-key", key)
    secret_file = out / "credentials.yaml"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in out.iterdir() if key in p.read_text()] == ["credentials.yaml"]
    (secret,) = _by_kind(_objects(out), "Secret").values()
    assert secret["metadata"]["name"] == "myvllm-credentials"
    values = secret["stringData"]
    assert values["api-key"] == key
    assert set(values) == {"internal-token", "api-key", "redis-password"}
    for name in ("internal-token", "redis-password"):
        assert re.fullmatch(r"[0-9a-f]{64}", values[name]) and secret_problem(values[name]) is None, name
    other = _generate(tmp_path / "again", "-dp", "2", "--api-key", key)
    assert _by_kind(_objects(other), "Secret")["myvllm-credentials"]["stringData"]["internal-token"] != values[
        "internal-token"]  # random per run, never a fixed value
    assert _secret_readers(_objects(out))["gateway"] == {"internal-token", "redis-password", "api-key"}
    _generate(tmp_path, "-dp", "2")
    assert not secret_file.exists()


def test_probes_and_shutdown_follow_serve() -> None:
    """The gateway drains for serve's --shutdown-timeout (plus the exit grace serve gives it)
    after a short preStop; engine pods outlive that in their own preStop, as serve stops them
    only after the gateway; the probes are the services' own health checks."""
    objects = _objects(K8S)
    gateway = _by_kind(objects, "Deployment")["myvllm-gateway"]["spec"]["template"]["spec"]
    prestop = int(gateway["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert gateway["terminationGracePeriodSeconds"] == prestop + DEFAULT_SHUTDOWN_TIMEOUT_S + EXIT_GRACE_S
    assert gateway["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for obj in _by_kind(objects, "StatefulSet").values():
        pod = obj["spec"]["template"]["spec"]
        container = pod["containers"][0]
        engine_prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert engine_prestop >= gateway["terminationGracePeriodSeconds"]
        assert pod["terminationGracePeriodSeconds"] == engine_prestop + EXIT_GRACE_S
        role = container["name"]
        port = container["ports"][0]["containerPort"]
        check = ["python", "-m", "services.entrypoints.healthcheck", role, f"127.0.0.1:{port}"]
        assert container["readinessProbe"]["exec"]["command"] == check
        assert container["startupProbe"]["exec"]["command"] == check
        assert container["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})  # the reference runs on CPUs
    (budget,) = _by_kind(objects, "PodDisruptionBudget").values()
    assert budget["spec"]["maxUnavailable"] == 1


def test_cuda_workers_get_a_gpu_each(tmp_path: Path) -> None:
    objects = _objects(_generate(tmp_path, "--device", "cuda", "-tp", "3"))
    for obj in _by_kind(objects, "StatefulSet").values():
        container = _container(obj)
        if container["name"] == "worker":
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert container["command"][container["command"].index("--device") + 1] == "cuda"
        else:
            assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_keda_scaled_objects(tmp_path: Path) -> None:
    """KEDA's CRD is not among the Kubernetes schemas, so its required fields are checked here:
    each ScaledObject names a StatefulSet the manifests define, turns it wholly on or off
    (idle 0 < min = max = its full size) and reads the gateway's vllm:num_requests_waiting."""
    objects = _objects(_generate(tmp_path, "-dp", "3", "-tp", "3", "--keda"))
    sets = _by_kind(objects, "StatefulSet")
    scaled = _by_kind(objects, "ScaledObject")
    assert set(scaled) == {f"myvllm-engine-{r}-{kind}" for r in (1, 2) for kind in ("worker", "scheduler")}
    for obj in scaled.values():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet") and target["name"] in sets
        size = sets[target["name"]]["spec"]["replicas"]
        assert spec["idleReplicaCount"] == 0 < spec["minReplicaCount"] == spec["maxReplicaCount"] == size
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert set(meta) >= {"serverAddress", "query", "threshold"}
        assert meta["serverAddress"].startswith("http")
        assert "vllm:num_requests_waiting" in meta["query"]
        assert all(isinstance(meta[k], str) and float(meta[k]) > 0 for k in ("threshold", "activationThreshold"))
    # Replica 2 comes on only after replica 1.
    assert (float(scaled["myvllm-engine-2-worker"]["spec"]["triggers"][0]["metadata"]["activationThreshold"])
            > float(scaled["myvllm-engine-1-worker"]["spec"]["triggers"][0]["metadata"]["activationThreshold"]))


def test_deploy_refuses_what_serve_refuses(tmp_path: Path, capsys) -> None:
    assert main(["deploy", "k8s", "--out", str(tmp_path / "a"), "-tp", "0"]) == 1
    assert main(["deploy", "k8s", "--out", str(tmp_path / "b"), "--device", "tpu"]) == 1
    assert main(["deploy", "compose", "--out", str(tmp_path / "c.yml"), "--speculative-config", "{bad"]) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "c.yml").exists()
    assert "error:" in capsys.readouterr().err
    # The image's model (SmolLM2-135M: 9 attention heads) does not split over 2 ranks.
    assert main(["deploy", "k8s", "--out", str(tmp_path / "d"), "-tp", "2", "-dp", "2"]) == 1
    assert main(["deploy", "compose", "--out", str(tmp_path / "d.yml"), "-tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("--tensor-parallel-size 2 does not fit the model") == 2 and "num_attention_heads=9" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.yml").exists()


def test_deploy_never_drops_a_secret_it_is_given(tmp_path: Path, capsys) -> None:
    """k8s: a secret the services would refuse is refused here, naming the flag (not the value);
    compose: a secret on the command line is refused, since the file reads it from the environment."""
    assert main(["deploy", "k8s", "--out", str(tmp_path / "a"), "--api-key", "REPLACE_ME"]) == 1
    assert main(["deploy", "k8s", "--out", str(tmp_path / "b"), "--internal-token", "short-token"]) == 1
    err = capsys.readouterr().err
    assert "--api-key / $MYVLLM_API_KEY is a placeholder" in err and "REPLACE_ME" not in err
    assert "--internal-token / $MYVLLM_INTERNAL_TOKEN is shorter than 16 bytes" in err and "short-token" not in err
    # The full rule for a cluster's API key (serve and gateway only warn about a short one).
    assert main(["deploy", "k8s", "--out", str(tmp_path / "e"), "--api-key", "sk-short"]) == 1
    err = capsys.readouterr().err
    assert "--api-key / $MYVLLM_API_KEY is shorter than 16 bytes" in err and "sk-short" not in err
    assert main(["deploy", "compose", "--out", str(tmp_path / "c.yml"), "--api-key", "a" * 8 + "b" * 24]) == 1
    assert "--api-key: a compose file reads its secrets from the environment" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
