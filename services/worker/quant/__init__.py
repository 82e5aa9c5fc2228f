"""Weights kept quantized in memory: GGUF block formats (read from a .gguf, or made at load by
`--quantization int8`), the layers that hold them and the one dispatch (`ops.quant_matmul`)
through which every quantized product runs.

- gguf_model.py: a .gguf file's config, tokenizer source and tensors, named as HF checkpoints
  (gguf_moe.py: the mixture-of-experts families' config fields and expert tensors);
- torch_dequant.py: vectorised torch dequantization of the block formats (bit-exact vs gguf-py);
- linear.py / embedding.py / experts.py: the modules holding raw blocks (experts.py: an MoE
  layer's experts, run through ops.py per expert);
- kernels.py / quant_gemm.c: the CPU kernels computing on the blocks (dequantized in registers);
- ops.py: how a quantized matmul runs (the C kernels on CPU, else dequantize then F.linear);
- install.py: swapping a built model's linear layers and embedding for quantized ones.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The block formats kept quantized; other GGUF tensor types are dense (F32, F16, BF16) and load
# as today.
QUANT_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
DENSE_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def block_size(qtype: int) -> int:
    """Weights per block (along the input dimension) of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def type_size(qtype: int) -> int:
    """Bytes per block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` weights (a whole number of blocks)."""
    if in_features % block_size(qtype):
        raise ValueError(f"{GGMLQuantizationType(qtype).name}: {in_features} inputs are not a whole number of "
                         f"{block_size(qtype)}-weight blocks")
    return in_features // block_size(qtype) * type_size(qtype)
