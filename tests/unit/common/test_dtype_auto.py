"""`--dtype auto`: fp32 on a CPU without bf16 instructions; with them bf16, or with a checkpoint
to time, whichever of bf16 and fp32 its GEMMs run faster; and it says why."""

from __future__ import annotations

import logging

import pytest

from services.common.config import VllmConfig, choose_cpu_dtype, default_model_path, resolve_dtype_name
from services.common.cpu_dtype_probe import (
    GemmTimings,
    choose_dtype_by_timings,
    gemm_shape,
    measure_gemm_timings,
    probe_model,
)

AVX2_EPYC = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}           # no bf16 instructions
AVX512_BF16_EPYC = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
NEOVERSE_V1 = {"fp", "asimd", "sve", "bf16"}                             # Arm /proc/cpuinfo "Features"


@pytest.mark.parametrize(("flags", "expected"), [
    (AVX2_EPYC, "float32"),
    (AVX512_BF16_EPYC, "bfloat16"),
    (SAPPHIRE_RAPIDS, "bfloat16"),
    (NEOVERSE_V1, "bfloat16"),
    (set(), "float32"),
])
def test_choose_cpu_dtype(flags: set[str], expected: str) -> None:
    chosen, why = choose_cpu_dtype(flags)
    assert chosen == expected
    assert ("no bf16" in why) == (expected == "float32")


@pytest.fixture
def dtype_log(caplog: pytest.LogCaptureFixture):
    # The dtype logger does not propagate (it prints on its own); let caplog see it here.
    logger = logging.getLogger("myvllm.dtype")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="myvllm.dtype"):
            yield caplog
    finally:
        logger.propagate = False


def test_auto_on_avx2_cpu_picks_fp32_and_says_why(dtype_log: pytest.LogCaptureFixture) -> None:
    assert resolve_dtype_name("auto", "cpu", AVX2_EPYC) == "float32"
    assert "dtype auto -> float32" in dtype_log.text and "no bf16 instructions" in dtype_log.text


def test_auto_on_bf16_cpu_picks_bf16_and_says_why(dtype_log: pytest.LogCaptureFixture) -> None:
    assert resolve_dtype_name("auto", "cpu", AVX512_BF16_EPYC) == "bfloat16"
    assert "dtype auto -> bfloat16" in dtype_log.text and "avx512_bf16" in dtype_log.text


def test_bf16_asked_on_cpu_without_bf16_warns(dtype_log: pytest.LogCaptureFixture) -> None:
    assert resolve_dtype_name("bfloat16", "cpu", AVX2_EPYC) == "bfloat16"
    assert any(r.levelno == logging.WARNING and "slower" in r.getMessage() for r in dtype_log.records)


def test_explicit_dtypes_pass_through_quietly(dtype_log: pytest.LogCaptureFixture) -> None:
    assert resolve_dtype_name("float32", "cpu", AVX512_BF16_EPYC) == "float32"
    assert resolve_dtype_name("bfloat16", "cpu", AVX512_BF16_EPYC) == "bfloat16"
    assert not dtype_log.records


def test_auto_on_cuda() -> None:
    assert resolve_dtype_name("auto", "cuda", cuda_bf16=True) == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", cuda_bf16=False) == "float16"


def test_engine_default_is_auto_as_in_vllm() -> None:
    """vLLM's default: bf16 on CPUs with bf16 instructions (where our bf16 step is the faster
    one, BENCHMARKS.md "dtype"), fp32 on the others; an explicit dtype still wins."""
    import argparse

    from services.entrypoints.engine_args import add_model_args

    assert VllmConfig.from_engine_args(model="x").model_config.dtype == "auto"
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"


# --------------------------------------------------------------------------- measured on CPU


def _timings(fp32_m1: float, bf16_m1: float, fp32_m64: float, bf16_m64: float) -> GemmTimings:
    return GemmTimings(hidden=576, intermediate=1536, fp32_m1=fp32_m1, bf16_m1=bf16_m1, fp32_m64=fp32_m64,
                       bf16_m64=bf16_m64)


@pytest.mark.parametrize(("timings", "expected"), [
    # AMX: bf16 products faster at both sizes.
    (_timings(40e-6, 25e-6, 400e-6, 100e-6), "bfloat16"),
    # AVX-512 bf16 without AMX: half the fp32 rate batched outweighs a modest M=1 gain.
    (_timings(40e-6, 30e-6, 400e-6, 800e-6), "float32"),
    # ... while halved bytes that double M=1's speed balance it (a tie keeps bf16's smaller memory).
    (_timings(40e-6, 20e-6, 400e-6, 800e-6), "bfloat16"),
    # bf16 converted in software: slower everywhere.
    (_timings(40e-6, 90e-6, 400e-6, 2000e-6), "float32"),
])
def test_choose_dtype_by_timings(timings: GemmTimings, expected: str) -> None:
    chosen, why = choose_dtype_by_timings(timings)
    assert chosen == expected
    assert "M=1" in why and "M=64" in why and "geometric mean" in why and "576x1536" in why


def test_auto_measures_on_a_bf16_cpu_and_logs_the_figures(dtype_log: pytest.LogCaptureFixture) -> None:
    calls = []

    def probe() -> GemmTimings:
        calls.append(1)
        return _timings(40e-6, 30e-6, 400e-6, 800e-6)

    assert resolve_dtype_name("auto", "cpu", SAPPHIRE_RAPIDS, probe=probe) == "float32"
    assert calls == [1]
    [record] = dtype_log.records
    assert record.levelno == logging.INFO and "dtype auto -> float32" in record.getMessage()
    assert "0.50x at M=64" in record.getMessage() and "M=1 fp32 40 us, bf16 30 us" in record.getMessage()


def test_auto_measures_nothing_without_bf16_instructions_or_timings(dtype_log: pytest.LogCaptureFixture) -> None:
    def no_probe() -> GemmTimings:
        raise AssertionError("measured")

    assert resolve_dtype_name("auto", "cpu", AVX2_EPYC, probe=no_probe) == "float32"
    assert resolve_dtype_name("float32", "cpu", SAPPHIRE_RAPIDS, probe=no_probe) == "float32"
    assert resolve_dtype_name("auto", "cuda", probe=no_probe) == "bfloat16"
    # Nothing to time (a GGUF file, a config without the sizes): the flag rule.
    assert resolve_dtype_name("auto", "cpu", SAPPHIRE_RAPIDS, probe=lambda: None) == "bfloat16"
    assert "bf16 instructions (avx512_bf16, amx_bf16)" in dtype_log.text
    assert probe_model("model.Q4_1.gguf") is None


def test_the_worker_probe_times_its_own_linear_kernel(smollm2_dir: str) -> None:
    from services.worker.models.cpu_linear import dtype_probe

    timings = dtype_probe(smollm2_dir)()
    assert (timings.hidden, timings.intermediate) == (576, 1536)
    assert min(timings.fp32_m1, timings.bf16_m1, timings.fp32_m64, timings.bf16_m64) > 0


def test_gemm_shape(tmp_path) -> None:
    assert gemm_shape(default_model_path()) == (576, 1536)
    assert gemm_shape(None) is None
    assert gemm_shape(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text('{"text_config": {"hidden_size": 8, "intermediate_size": 16}}')
    assert gemm_shape(str(tmp_path)) == (8, 16)


def test_measure_gemm_timings_is_quick_and_positive() -> None:
    import time

    start = time.perf_counter()
    timings = measure_gemm_timings(64, 96, repeats=2)
    assert time.perf_counter() - start < 5  # well under a second on an idle machine
    assert (timings.hidden, timings.intermediate) == (64, 96)
    assert min(timings.fp32_m1, timings.bf16_m1, timings.fp32_m64, timings.bf16_m64) > 0


def test_a_cpu_worker_settles_auto_by_measuring(smollm2_dir: str, dtype_log: pytest.LogCaptureFixture) -> None:
    """The offline LLM's single-rank worker times its model's GEMMs where the CPU has bf16
    instructions, and runs the dtype it logged."""
    from services.common.config import cpu_flags
    from services.offline import LLM

    llm = LLM(model=smollm2_dir, max_model_len=64)
    try:
        [line] = [r.getMessage() for r in dtype_log.records if "dtype auto ->" in r.getMessage()]
        chosen = line.split("dtype auto -> ", 1)[1].split(":", 1)[0]
        assert chosen in ("float32", "bfloat16")
        if choose_cpu_dtype(cpu_flags())[0] == "bfloat16":
            assert "576x1536 products" in line and "geometric mean" in line
        else:
            assert "no bf16 instructions" in line
        assert llm.engine.model_info.dtype == chosen
    finally:
        llm.close()
