"""The C kernels under AddressSanitizer: every kernel is built with `-fsanitize=address` (through
MYVLLM_KERNEL_CFLAGS, into a cache of its own) and the kernel tests run in a nested pytest with
libasan preloaded, so an out-of-bounds read or write in a kernel fails the run with ASan's report
instead of passing unseen. A deliberately overflowing kernel built the same way shows the
sanitizer is really on. Skipped where the compiler has no libasan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.cpu import cbuild

REPO = Path(__file__).resolve().parents[3]
KERNEL_TESTS = ["test_cpu_decode_kernel.py", "test_cpu_prefill_kernel.py", "test_cpu_decode_step.py",
                "test_cpu_gemm.py", "test_cpu_ops.py", "test_quant_kernels.py", "test_cpu_moe_kernel.py",
                "test_moe_packed_step.py", "test_lora_worker.py", "test_lora_packed_step.py"]
# Whole-model runs add minutes under ASan and no kernel path the kernel tests miss: the fused ops'
# (test_cpu_ops covers every op at every level), and SmolLM2's greedy runs with the C steps on and
# off, dense and on GGUF blocks (test_c_steps_match_the_eager_forward runs both dense steps at every
# row count the small step has a copy for, the packed one on decodes and prefill chunks, each with
# its LM head; test_the_quantized_step_matches_the_layer_by_layer_forward the quantized step at 1,
# 3, 7 and 8 rows; SmolLM2's head size, 64, has its own attention copy, which test_cpu_decode_kernel
# and test_cpu_prefill_kernel run at that size; the rest of the steps' code takes the head size as a
# plain number). Of the quantized step's SmolLM2 cases one stays: its rows of 576 and 1536 values
# are the only ones in the kernel tests that end in a part-filled chunk of quant_f32.h's fp32 GEMV
# (the tiny models' fit one chunk); the other three run the same code on that model (the int8
# products' loop has no chunks; the tiny models run both products in both dtypes), ~40 s each here.
DESELECT = " and ".join([
    "not the_model_with_fused_ops", "not test_greedy_tokens_are_the_same_with_the_step_on_and_off",
    "not test_greedy_tokens_on_gguf_weights_are_the_same_with_the_step_on_and_off",
    "not (test_the_quantized_step_matches_the_layer_by_layer_forward and smollm2 and not fp32-products-bfloat16)",
])
# The nested run: first every kernel at every level the kernel tests load, compiled side by side
# (gcc is single-threaded; the tests would build them one at a time as they first load them, ~40 s
# of the run with the sanitizer's instrumentation), through the loaders the tests use, so into the
# very files they then load from the cache; then pytest, in the same interpreter.
NESTED_RUN = """
import os, sys
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
from support.isa_levels import levels_here
from services.worker.attention import cpu_backend
from services.worker.cpu import cbuild, cpu_ops, gemm, moe_experts
from services.worker.models.c_step import decode_step, quant_step
from services.worker.quant import kernels as quant_kernels
# The quantized builds' levels: test_quant_kernels' (those with code of their own in quant_gemm.c)
# and the best one, which a model's layers and its quantized step load (level None: the same file).
quant_best = cbuild.isa_levels(highest=quant_kernels.HIGHEST_ISA)[0]
quant_levels = dict.fromkeys([quant_best, *(level for level in cbuild.isa_levels(highest=quant_kernels.HIGHEST_ISA)
                                            if level in ("amx_int8", "avx512_vnni", "avx512", "avx2", "x86-64"))])
builds = [(decode_step.load_library,)]  # the slowest to compile first
builds += [(quant_step.load_quant_library, level)
           for level in dict.fromkeys([quant_best, *levels_here(quant_kernels.HIGHEST_ISA)])]
builds += [(build, level) for level in levels_here(gemm.HIGHEST_ISA)
           for build in (decode_step.load_packed_library, gemm.PanelGemm.load, moe_experts.CpuMoeExperts.load)]
builds += [(build, level) for level in levels_here(cpu_backend.HIGHEST_ISA)
           for build in (cpu_backend.load_library, cpu_backend.load_prefill_library)]
builds += [(cpu_ops.CpuOps.build, level) for level in levels_here(cpu_ops.HIGHEST_ISA)]
builds += [(quant_kernels.QuantGemm.load, level) for level in quant_levels]
with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
    for done in [pool.submit(*build) for build in builds]:
        done.result()
import pytest
raise SystemExit(pytest.main(sys.argv[2:]))
"""
OVERFLOW_C = """#include <stdlib.h>
void write_past_the_end(int n) { volatile int *a = malloc(n * sizeof(int)); a[n] = 1; free((void *)a); }
"""


def _runtime(name: str) -> str | None:
    """The compiler's copy of a runtime library, or None (gcc prints the bare name when it has none)."""
    try:
        path = subprocess.run([cbuild.find_compiler(), f"-print-file-name={name}"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


LIBASAN = _runtime("libasan.so")
pytestmark = pytest.mark.skipif(LIBASAN is None, reason="the C compiler has no AddressSanitizer runtime")


@pytest.fixture(scope="module")
def asan_env(tmp_path_factory) -> dict[str, str]:
    # libstdc++ preloaded too: torch throws C++ exceptions, and ASan's __cxa_throw interceptor
    # needs the real one loaded when it starts.
    preload = [LIBASAN] + [lib for lib in [_runtime("libstdc++.so.6")] if lib]
    return dict(os.environ, PYTHONPATH=str(REPO), LD_PRELOAD=" ".join(preload),
                ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=23",
                MYVLLM_KERNEL_CFLAGS="-O1 -fsanitize=address -fno-omit-frame-pointer",
                MYVLLM_CACHE_DIR=str(tmp_path_factory.mktemp("asan-kernels")))


def test_the_sanitizer_catches_an_overflowing_kernel(asan_env: dict[str, str], tmp_path: Path) -> None:
    source = tmp_path / "overflow.c"
    source.write_text(OVERFLOW_C)
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from services.worker.cpu import cbuild; "
         "cbuild.build(Path(sys.argv[1])).write_past_the_end(4)", str(source)],
        cwd=REPO, env=asan_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 23, result.stderr[-2000:]
    assert "heap-buffer-overflow" in result.stderr


def test_kernel_tests_pass_under_address_sanitizer(asan_env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", NESTED_RUN, str(REPO / "tests"), "-q", "-p", "no:cacheprovider", "-k", DESELECT,
         *(str(REPO / "tests" / "unit" / "worker" / name) for name in KERNEL_TESTS)],
        cwd=REPO, env=asan_env, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    assert "AddressSanitizer" not in output, output[-5000:]
    assert result.returncode == 0, output[-5000:]
    print("\nunder AddressSanitizer: " + result.stdout.strip().splitlines()[-1])
