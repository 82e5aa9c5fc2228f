"""The my-vllm image's name and where it is built from: `myvllm:<version>-cpu` and
`myvllm:<version>-cuda`, the version the package's (pyproject.toml), so that compose files,
Kubernetes manifests and `make image` name the same images."""

from __future__ import annotations

import os
import tomllib
from importlib import metadata
from pathlib import Path

IMAGE_REPOSITORY = "myvllm"
# The checkout this package was imported from (an editable install, or the source tree itself).
REPO_ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = "deploy/Dockerfile"  # relative to the build context, the repository root
# The PyTorch wheel index each image installs torch from (deploy/Dockerfile's TORCH_INDEX): the CPU
# build keeps the CPU image free of the multi-GB CUDA libraries.
TORCH_INDEX = {"cpu": "https://download.pytorch.org/whl/cpu", "cuda": "https://download.pytorch.org/whl/cu128"}


def package_version() -> str:
    """The version in pyproject.toml (what `make image` tags with); the installed distribution's
    when the package runs without its source tree."""
    pyproject = REPO_ROOT / "pyproject.toml"
    if pyproject.is_file():
        with open(pyproject, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    return metadata.version("my-vllm")


def variant(device: str | None) -> str:
    """The image variant a deployment on `device` runs: cuda, else cpu (serve's default device)."""
    return "cuda" if device == "cuda" else "cpu"


def image_name(device: str | None) -> str:
    return f"{IMAGE_REPOSITORY}:{package_version()}-{variant(device)}"


def build_context(out_dir: str) -> dict[str, str] | None:
    """A compose `build:` for a file written into `out_dir`: the repository root as a path relative
    to that directory (compose resolves it from the file's own directory), or None when this package
    was installed without its source tree (then the image is built apart: `make image`)."""
    if not (REPO_ROOT / DOCKERFILE).is_file():
        return None
    context = os.path.relpath(REPO_ROOT, os.path.abspath(out_dir))
    return {"context": context, "dockerfile": DOCKERFILE}
