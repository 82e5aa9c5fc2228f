"""The --quantization methods (what services/worker/quant implements)."""

import argparse

# gguf: a .gguf file's blocks kept as they are; int8: an HF checkpoint's linear layers made Q8_0
# blocks at load. Other methods vLLM names (awq, gptq, fp8, ...) are refused at the command line.
QUANTIZATION_METHODS = ("gguf", "int8")


def quantization_method(value: str) -> str:
    """--quantization's value: one of ours, else one line saying what serves instead (vLLM's
    awq, gptq, fp8, ... checkpoints need kernels we lack)."""
    if value in QUANTIZATION_METHODS:
        return value
    raise argparse.ArgumentTypeError(
        f"{value} checkpoints are not supported: serve a .gguf file (gguf), or an unquantized checkpoint, "
        "optionally quantized at load (int8)")
