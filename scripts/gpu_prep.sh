#!/usr/bin/env bash
# `make gpu-prep`: what `make gpu-check` needs on a GPU machine that has torch, triton and
# transformers but no network, prepared here: the generated protobuf modules (git-ignored) and,
# in .whl/ (git-excluded), the wheels of the protobuf and grpcio versions they were generated
# with, for the machine's Python (3.12, x86-64 manylinux). Prints the device call to make.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
make -s services/common/proto/myvllm_pb2.py
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PB=$($PY -c 'import google.protobuf as p; print(p.__version__)')
GRPC=$($PY -c 'import grpc; print(grpc.__version__)')
TARGET_PY=${GPU_PYTHON_VERSION:-3.12}
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "protobuf==$PB" "grpcio==$GRPC"
echo "[gpu-prep] .whl: $(ls .whl | tr '\n' ' ')($(du -sh .whl | cut -f1))"
echo "[gpu-prep] device call: carry [\".whl\", \"services/common/proto/myvllm_pb2.py\"," \
     "\"services/common/proto/myvllm_pb2_grpc.py\"], command \"bash scripts/gpu_check.sh\", timeout_s 540"
