/* What a whole-step decode kernel needs to know of the model: its sizes, each layer's weight
 * pointers and the KV cache. Shared by decode_step.c (row-major weights, small batches) and
 * packed_step.c (gemm.c's packed weights, larger batches); decode_step.py fills it. */
#ifndef MYVLLM_STEP_MODEL_H
#define MYVLLM_STEP_MODEL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Per-layer weight pointers, in this order (NULL where the model has none). A mixture-of-experts
 * layer (packed_step.c only) has no dense MLP but W_ROUTER (the router [E, hidden], row-major in
 * the model's dtype) and its experts as cpu/moe_experts.c packs them (W_EXPERTS13, W_EXPERTS2). */
enum { W_IN_NORM, W_QKV, B_QKV, W_Q_NORM, W_K_NORM, W_O, B_O, W_POST_NORM, W_GATE_UP, B_GATE_UP, W_DOWN, B_DOWN,
       W_ROUTER, W_EXPERTS13, W_EXPERTS2, LAYER_PTRS };

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, bf16;
    float eps, scale;
    const void *const *layers; /* [num_layers * LAYER_PTRS] */
    void *const *kv;           /* [num_layers * 2]: each layer's K and V cache [blocks, BS, KVH, D] */
    const void *final_norm;    /* [hidden] */
    const float *cos, *sin;    /* RoPE tables, fp32 [max_position, head_dim] */
    /* Projections kept in GGUF blocks (read only by decode_step.c's quantized build; NULL for a
     * dense model): per layer slot, its weight's block type (0: dense, in the model's dtype) and
     * the bytes of one weight row; a quantized weight's bias is fp32, as quant_gemm.c takes it.
     * int8_dot: decode-sized products on Q4_0/Q4_1/Q8_0 quantize x to int8 (quant_q8.h). */
    const int *wtypes;        /* [num_layers * LAYER_PTRS] */
    const int64_t *row_bytes; /* [num_layers * LAYER_PTRS] */
    int int8_dot;
    /* Mixture-of-experts layers (0 experts: none): experts, slots per token, the experts' padded
     * intermediate and hidden widths (moe_experts.c's Ip and Hp), whether the top-k weights are
     * renormalised over the k, and whether they stay fp32 (else rounded to the model's dtype). */
    int num_experts, top_k, moe_ip, moe_hp, renormalize, weights_fp32;
} StepModel;

/* A step's working memory, one allocation: shared, in the model's dtype, the residual stream, h
 * (norm output / projection output), qkv, the attention output, gate_up and the activation, each
 * [M, its width]; then, 64-byte aligned, `per_thread` fp32 scratch values for each thread. */
typedef struct {
    char *mem;
    void *res, *h, *qkv, *att, *gu, *act;
    float *scratch;
} StepBuffers;

/* Allocates the buffers (mem NULL when out of memory) and copies the input rows x into res. */
static inline StepBuffers step_buffers(const StepModel *md, int M, const void *x, size_t per_thread, int nthreads) {
    const int H = md->hidden, QD = md->num_heads * md->head_dim, I = md->intermediate;
    const size_t es = md->bf16 ? 2 : 4, QKV = (size_t)(md->num_heads + 2 * md->num_kv_heads) * md->head_dim;
    const size_t shared_elems = (size_t)M * (2 * H + QKV + QD + 3 * I);
    StepBuffers b = {0};
    b.mem = malloc(shared_elems * es + sizeof(float) * per_thread * (size_t)nthreads + 64);
    if (b.mem == NULL) return b;
    b.res = b.mem;
    b.h = b.mem + (size_t)M * H * es;
    b.qkv = (char *)b.h + (size_t)M * H * es;
    b.att = (char *)b.qkv + (size_t)M * QKV * es;
    b.gu = (char *)b.att + (size_t)M * QD * es;
    b.act = (char *)b.gu + (size_t)M * 2 * I * es;
    b.scratch = (float *)(((uintptr_t)((char *)b.act + (size_t)M * I * es) + 63) & ~(uintptr_t)63);
    memcpy(b.res, x, (size_t)M * H * es);
    return b;
}

#endif
