#!/usr/bin/env bash
# `make gpu-check`: the checks for an NVIDIA GPU machine that has torch and triton but maybe no
# network and nothing else. Needs nothing beyond this repository: no pip installs.
#
#   (a) kernels     tests/unit/worker/test_triton_kernels.py, test_fused_moe_triton.py, test_triton_ops.py and
#                   test_quant_triton.py compiled on CUDA (TRITON_INTERPRET unset)
#   (b) greedy      paged model + Triton attention vs a dense pure-torch reference (always), and the
#                   engine vs HF transformers (where the engine and transformers import)
#   (c) tp2         LLM(tensor_parallel_size=2), then LLM(pipeline_parallel_size=2), over NCCL vs HF
#                   transformers, when two GPUs are present (says so and skips otherwise)
#   (b') bf16       the engine in bf16 vs HF fp32, teacher-forced: top-1 agreement >= 99% over 32 tokens,
#                   logprob error bound (scripts/gpu_check_stages.py, as the next three)
#   (d) cudagraphs  CUDA graphs for pure-decode steps (full_decode_only) vs --enforce-eager: greedy token
#                   for token (near ties tolerated), and the decode time per step of each at batch 1 and 8
#   (d') moe_graphs, spec_graphs, pd: graphs vs eager with a tiny MoE, with speculative decoding (steps
#                   of 1 + k tokens per row), and on a P/D consumer loading its KV from a producer
#   (e) sampling    the sampler on the GPU under sync debug mode "error": no host sync
#   (f) throughput  Qwen3-0.6B-shaped random weights, 64 requests, lengths 100..512, output tok/s with
#                   --enforce-eager and with CUDA graphs (profiled runs: add --profile)
#   then a report: gpu_check.json and gpu_check.md (every stage's verdict, seconds and figures) under
#   $OUT when the device tool runs this, else build/gpu-check.
#
# What the GPU machine lacks travels with the repository: `make gpu-prep` (here, with network)
# generates the protobuf modules and downloads into .whl/ the wheels of the protobuf and grpcio
# versions they were generated for; this script installs .whl/*.whl into /tmp/site when present.
# The device call: carry [".whl", "services/common/proto/myvllm_pb2.py",
# "services/common/proto/myvllm_pb2_grpc.py"], command `bash scripts/gpu_check.sh`.
#
# Each stage runs under `timeout`; the limits add up to at most 6 minutes (360 s, checked by
# tests/unit/test_gpu_check_budget.py; tp2 skips at once on one GPU). A stage whose packages are missing says which and is skipped; a failing or timed-out
# stage makes the script exit non-zero.
# Without CUDA it runs the kernel tests under TRITON_INTERPRET=1 only.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# Wheels carried for what the machine lacks (make gpu-prep), installed beside its own packages.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        && echo "[gpu-check] installed $(ls .whl | tr '\n' ' ')into /tmp/site"
fi

# The python: the repo's .venv if its torch sees CUDA, else python3 / python; without CUDA anywhere,
# the first of them that imports torch and triton.
PROBE='
import torch
kind = "cuda" if torch.cuda.is_available() else "cpu"
try:
    import triton  # noqa: F401
except Exception:
    kind += "-notriton"
print(kind)'
PY=""
FALLBACK=""
for cand in "$ROOT/.venv/bin/python" python3 python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    status=$("$cand" -c "$PROBE" 2>/dev/null)
    case "$status" in
        cuda) PY=$cand; break ;;
        cpu) [ -z "$FALLBACK" ] && FALLBACK=$cand ;;
        cuda-notriton) echo "[gpu-check] note: $cand sees CUDA but cannot import triton" ;;
    esac
done
HAVE_CUDA=1
if [ -z "$PY" ]; then
    HAVE_CUDA=0
    PY=$FALLBACK
fi
if [ -z "$PY" ]; then
    echo "[gpu-check] FAIL: no python here imports both torch and triton (tried .venv/bin/python, python3, python)"
    exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_RESULTS=${GPU_CHECK_RESULTS:-$(mktemp -d /tmp/gpu-check-results.XXXX)}
VERDICTS=$GPU_CHECK_RESULTS/verdicts.tsv
: > "$VERDICTS"
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "[gpu-check] using $PY"

# The engine's protobuf modules are generated (git-ignored); make them if grpc_tools is here.
if [ ! -f services/common/proto/myvllm_pb2.py ] && "$PY" -c 'import grpc_tools' 2>/dev/null; then
    "$PY" -m grpc_tools.protoc -Iservices/common/proto=proto --python_out=. --grpc_python_out=. \
        --pyi_out=. proto/myvllm.proto && echo "[gpu-check] generated services/common/proto/myvllm_pb2*.py"
fi

timeout 10 "$PY" scripts/gpu_check.py probe

if [ "$HAVE_CUDA" = 0 ]; then
    TRITON_INTERPRET=1 timeout 300 "$PY" scripts/gpu_check.py kernels --interpret
    rc=$?
    [ $rc = 124 ] && echo "[gpu-check] kernels: FAIL (timed out after 300 s)"
    echo "CUDA is absent: ran the Triton kernels under TRITON_INTERPRET=1 only"
    exit $rc
fi

unset TRITON_INTERPRET
FAILED=0
SUMMARY=""
run_stage() {  # name, timeout in seconds, gpu_check.py arguments...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "[gpu-check] ===== $name (timeout ${limit} s)"
    timeout --kill-after=10 "$limit" "$PY" scripts/gpu_check.py "$@"
    local rc=$? verdict
    case $rc in
        0) verdict=PASS ;;
        77) verdict="SKIPPED (see above)" ;;
        124|137) verdict="FAIL (timed out after ${limit} s)"; FAILED=1 ;;
        *) verdict="FAIL (exit $rc)"; FAILED=1 ;;
    esac
    SUMMARY="$SUMMARY[gpu-check] $name: $verdict in $((SECONDS - start)) s"$'\n'
    printf '%s\t%s\t%s\n' "$name" "${verdict%% *}" "$((SECONDS - start))" >> "$VERDICTS"
}

run_stage kernels 75 kernels
run_stage greedy 45 greedy
run_stage bf16 30 bf16
run_stage tp2 10 tp2 --quick
run_stage cudagraphs 40 cudagraphs
run_stage moe_graphs 25 moe_graphs
run_stage spec_graphs 25 spec_graphs
run_stage pd 20 pd
run_stage sampling 15 sampling
run_stage throughput 60 throughput --max-len 512
echo "[gpu-check] ===== summary"
printf '%s' "$SUMMARY"
"$PY" scripts/gpu_check.py report --verdicts "$VERDICTS"
exit $FAILED
