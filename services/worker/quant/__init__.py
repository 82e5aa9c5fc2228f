"""Matrix products on GGUF weights kept in their quantized block format (kernels.py, quant_gemm.c)."""
