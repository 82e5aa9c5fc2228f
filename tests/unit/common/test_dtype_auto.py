"""`--dtype auto`: bf16 where the CPU has bf16 instructions, fp32 elsewhere, and it says why."""

from __future__ import annotations

import logging

import pytest

from services.common.config import VllmConfig, choose_cpu_dtype, resolve_dtype_name

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
