/* The whole decoder forward of a small decode batch (a few requests, one new token each) in one
 * call, for CPUs: every layer's RMSNorm, QKV projection, RoPE, KV-cache write, paged attention,
 * output projection, MLP, and the final norm; the LM head is `lm_head` below.
 *
 * Built at first use by decode_step.py (cpu/cbuild.py: a fixed x86-64 level, -fopenmp on torch's
 * own libgomp threads, -ffp-contract=off so the elementwise arithmetic rounds exactly as
 * cpu/cpu_ops.c's does: both use cpu/row_ops.h).
 *
 * Why: a batch-1 decode step is bound by reading the weights once (SmolLM2-135M in fp32: 540 MB
 * per token). Eagerly the step is ~120 oneDNN GEMV calls plus ~150 other ops and ctypes calls,
 * each a Python dispatch and an OpenMP region whose threads wake, split a small matrix and meet
 * at a barrier; that overhead is a large share of the batch-1 step. Here one OpenMP region runs the
 * whole step: each projection is split by output rows over the threads (each streams its own
 * contiguous part of the weight), and the threads meet at a barrier only where the next stage
 * needs every row of the previous one.
 *
 * Weights are the checkpoint's row-major [out, in] matrices (fp32 or bf16); products accumulate
 * in fp32 (8 lanes, fused multiply-adds, then a fixed pairwise lane sum) and are rounded to the
 * model's dtype once, as a linear layer's output is. *
 * Built with -DMYVLLM_QUANT_STEP (a library of its own, at quant_gemm.c's level) the step also
 * takes projections kept in GGUF blocks (StepModel.wtypes), run by quant_gemm.c's decode kernels
 * (quant_q8.h, quant_f32.h) on this thread's rows, so each output has the bits the layer-by-layer
 * quantized forward gives it. The dense build is left as it was: its level and code are unchanged.
 */
#include <stdlib.h>

#include "paged_attend.h"
#include "row_ops.h"
#include "step_model.h"
#include "threads.h"

/* Most rows (requests) a step may carry: beyond a few rows the dense projections stop being bound
 * by reading the weights and oneDNN's blocked GEMMs win. The quantized build's int8 products on
 * packed groups (quant_x16.h) are compute-bound kernels of their own, the same the layer-by-layer
 * forward runs, so it takes more: what it saves is the forward's per-layer Python and torch calls. */
#define DENSE_ROWS 8
#ifdef MYVLLM_QUANT_STEP
#define MAX_ROWS 16
#else
#define MAX_ROWS DENSE_ROWS
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

/* ---------------------------------------------------------------- projections */

static inline float wload1(const void *w, int64_t off, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[off]) : ((const float *)w)[off];
}

static inline void store_out(void *y, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* y[m, r] = x[m] . W[r] (+ bias[r]) for output rows [r0, r1): x fp32 [M, K]; W [N, K] and y
 * [M, N] in the model's dtype. One weight row at a time, so each thread reads its share of W as
 * a single sequential stream (four rows side by side stream slower: the hardware prefetcher
 * follows one stream best), each element multiplied into all M rows of x (read
 * from L1). S independent accumulators per x row over alternating 8-element chunks of K keep
 * enough FMAs in flight when M is small. The software prefetch PREFETCH_BYTES ahead asks for the
 * lines into every cache level (T0): a non-temporal prefetch (NTA) halved the stream's rate on a
 * Xeon (SmolLM2 fp32 batch-1 decode 48.7 against 23.5 ms per token). */
static inline __attribute__((always_inline)) void gemv_impl(const float *restrict x, const void *restrict W,
                                                            const void *restrict bias, void *restrict y, int K,
                                                            int N, int r0, int r1, const int M, const int S,
                                                            const int bf16) {
    const int es = bf16 ? 2 : 4, step = 8 * S;
    for (int r = r0; r < r1; r++) {
        const int64_t row = (int64_t)r * K;
        /* fixed-size arrays (not VLAs) with fully unrolled loops, so the accumulators live in
         * registers */
        f32x8 acc[4][DENSE_ROWS];
#pragma GCC unroll 4
        for (int j = 0; j < S; j++)
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) acc[j][m] = (f32x8){0};
        int k = 0;
        for (; k + step <= K; k += step) {
            const char *at = (const char *)W + (row + k) * es + PREFETCH_BYTES;
            for (int b = 0; b < step * es; b += 64) __builtin_prefetch(at + b, 0, 3);
#pragma GCC unroll 4
            for (int j = 0; j < S; j++) {
                const f32x8 w = load8_any(W, row + k + 8 * j, bf16);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) acc[j][m] = fma8(w, load8(x + (int64_t)m * K + k + 8 * j), acc[j][m]);
            }
        }
        for (; k + 8 <= K; k += 8) {
            const f32x8 w = load8_any(W, row + k, bf16);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) acc[0][m] = fma8(w, load8(x + (int64_t)m * K + k), acc[0][m]);
        }
        for (int m = 0; m < M; m++) {
            f32x8 total = acc[0][m];
            for (int j = 1; j < S; j++) total += acc[j][m];
            float sum = lane_sum8(total);
            for (int kk = k; kk < K; kk++) sum += x[(int64_t)m * K + kk] * wload1(W, row + kk, bf16);
            if (bias) sum += wload1(bias, r, bf16);
            store_out(y, (int64_t)m * N + r, sum, bf16);
        }
    }
}

#define GEMV_CASE(MM, SS)                                                                  \
    case MM:                                                                               \
        if (bf16)                                                                          \
            gemv_impl(x, W, bias, y, K, N, r0, r1, MM, SS, 1);                             \
        else                                                                               \
            gemv_impl(x, W, bias, y, K, N, r0, r1, MM, SS, 0);                             \
        break;

static void gemv_rows(const float *x, const void *W, const void *bias, void *y, int K, int N, int r0, int r1, int M,
                      int bf16) {
    switch (M) {
        GEMV_CASE(1, 4)
        GEMV_CASE(2, 2)
        GEMV_CASE(3, 2)
        GEMV_CASE(4, 2)
        GEMV_CASE(5, 1)
        GEMV_CASE(6, 1)
        GEMV_CASE(7, 1)
        GEMV_CASE(8, 1)
    default:
        break;
    }
}

#ifdef __AVX512BF16__
/* gemv_impl for bf16 weights and x (K a multiple of 32) with avx512_bf16: vdpbf16ps multiplies 32
 * bf16 pairs of x and W exactly and adds them into 16 fp32 lanes, so neither is widened (widening
 * the weights for fp32 FMAs held the bf16 decode well under the read bandwidth). Sums in another
 * order than gemv_impl's, each product exact. */
static inline __attribute__((always_inline)) void gemv_bf16_impl(const uint16_t *restrict x,
                                                                 const uint16_t *restrict W,
                                                                 const uint16_t *restrict bias, uint16_t *restrict y,
                                                                 int K, int N, int r0, int r1, const int M) {
    for (int r = r0; r < r1; r++) {
        const uint16_t *w = W + (int64_t)r * K;
        __m512 acc[DENSE_ROWS][2];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        int k = 0;
        for (; k + 64 <= K; k += 64) {
            const char *at = (const char *)(w + k) + PREFETCH_BYTES;
            __builtin_prefetch(at, 0, 3);
            __builtin_prefetch(at + 64, 0, 3);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const uint16_t *xm = x + (int64_t)m * K + k;
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xm), w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
            }
        }
        for (; k < K; k += 32) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
            for (int m = 0; m < M; m++)
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k), w0);
        }
        for (int m = 0; m < M; m++) {
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
            if (bias) sum += bf16_to_f32(bias[r]);
            y[(int64_t)m * N + r] = f32_to_bf16(sum);
        }
    }
}

static void gemv_bf16_rows(const uint16_t *x, const void *W, const void *bias, void *y, int K, int N, int r0, int r1,
                           int M) {
    switch (M) {
#define GEMV_BF16_CASE(MM) \
    case MM: gemv_bf16_impl(x, W, bias, y, K, N, r0, r1, MM); break;
        GEMV_BF16_CASE(1)
        GEMV_BF16_CASE(2)
        GEMV_BF16_CASE(3)
        GEMV_BF16_CASE(4)
        GEMV_BF16_CASE(5)
        GEMV_BF16_CASE(6)
        GEMV_BF16_CASE(7)
        GEMV_BF16_CASE(8)
#undef GEMV_BF16_CASE
    default:
        break;
    }
}
#endif

/* This thread's share of a projection: x ([M, K], model dtype) widened into its own fp32
 * scratch xf (bf16 with avx512_bf16: read as it is), then its contiguous range of output rows (a
 * multiple of 8 rows per thread), at most DENSE_ROWS rows of x per pass. */
static void gemv_share(const void *x, const void *W, const void *bias, void *y, int K, int N, int M, int bf16,
                       float *restrict xf, int tid, int nth) {
    const int per = ((N + nth - 1) / nth + 7) / 8 * 8;
    const int r0 = tid * per, r1 = r0 + per < N ? r0 + per : N;
    const size_t es = bf16 ? 2 : 4;
#ifdef __AVX512BF16__
    if (bf16 && K % 32 == 0) {
        for (int m0 = 0; m0 < M && r0 < r1; m0 += DENSE_ROWS)
            gemv_bf16_rows((const uint16_t *)x + (size_t)m0 * K, W, bias, (char *)y + (size_t)m0 * N * es, K, N, r0,
                           r1, M - m0 < DENSE_ROWS ? M - m0 : DENSE_ROWS);
        return;
    }
#endif
    load_f32(x, 0, M * K, bf16, xf);
    for (int m0 = 0; m0 < M && r0 < r1; m0 += DENSE_ROWS)
        gemv_rows(xf + (size_t)m0 * K, W, bias, (char *)y + (size_t)m0 * N * es, K, N, r0, r1,
                  M - m0 < DENSE_ROWS ? M - m0 : DENSE_ROWS, bf16);
}

#ifdef MYVLLM_QUANT_STEP
#include "quant_q8.h"
#include "quant_x16.h"
#include "quant_amx.h"

/* Bytes of per-thread scratch for M rows of x quantized to int8 and a packed group of weights (K at
 * most `widest`): quant_x16.h's, or quant_amx.h's packed x and group. */
#define XQ_BYTES(M, widest) ((size_t)(M) * (size_t)q8_row_bytes(widest) + X16_SCRATCH(widest) + AMX_SCRATCH(M, widest))
#ifdef __AVX2__
#define X16_SCRATCH(widest) ((size_t)x16_scratch_bytes(widest) + 64)
#else
#define X16_SCRATCH(widest) ((size_t)0)
#endif
#ifdef AMX_QUANT
#define AMX_SCRATCH(M, widest) ((M) >= AMX_MIN_ROWS ? amx_x_bytes(M, widest) + amx_w_bytes(widest) + 64 : (size_t)0)
#else
#define AMX_SCRATCH(M, widest) ((size_t)0)
#endif

static inline void *out_rows(void *y, int m0, int N, int bf16) {
    return (char *)y + (size_t)m0 * N * (bf16 ? 2 : 4);
}

/* This thread's share of a projection whose weight W is N rows of `type` blocks (row_bytes each),
 * through the kernels qg_matmul runs for the same M, so each output has its bits: where int8_dot
 * and the build have them for the type, integer dot products on x quantized per 32-value block
 * (packed groups of 16 weight rows, a share of the groups per thread; AMX tiles from 16 rows);
 * else the exact fp32 row GEMV, which qg_matmul runs below TILE_MIN_ROWS only (the
 * step then takes fewer rows: decode_step.py). Every thread quantizes the few rows of x itself, as
 * it widens them: cheaper than another barrier. bias: fp32 or NULL. */
static void quant_share(int type, int64_t row_bytes, int int8_dot, const void *x, const void *W, const float *bias,
                        void *y, int K, int N, int M, int bf16, float *restrict xf, void *xq_mem, int tid, int nth) {
#ifdef __AVX2__
    if (int8_dot && q8_covers(type)) { /* this thread's groups of 16 rows */
        const int groups = (N + X16 - 1) / X16, per = (groups + nth - 1) / nth;
        const int g0 = tid * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 >= g1) return;
        load_f32(x, 0, M * K, bf16, xf);
        q8_row_t xq[MAX_ROWS];
        for (int m = 0; m < M; m++) {
            xq[m] = q8_row_at((char *)xq_mem + m * q8_row_bytes(K), K);
            q8_quantize_row(xf + (int64_t)m * K, K, xq[m]);
        }
        const uintptr_t at = (uintptr_t)((char *)xq_mem + (size_t)M * q8_row_bytes(K));
        uint8_t *packed = (uint8_t *)((at + 63) & ~(uintptr_t)63);
#ifdef AMX_QUANT
        if (M >= AMX_MIN_ROWS && amx_usable()) { /* the tiles: this thread packs all of x for itself */
            uint8_t *pw = packed + ((amx_x_bytes(M, K) + 63) & ~(size_t)63);
            for (int ch = 0; ch < (M + 15) / 16; ch++) amx_pack_x(xq, M, K, ch, packed);
            amx_groups(type, W, row_bytes, packed, M, K, N, g0, g1, bias, y, bf16, pw);
            return;
        }
#endif
        for (int g = g0; g < g1; g++) {
            x16_pack(type, W, row_bytes, K, N, g * X16, packed);
            x16_group_any(type, xq, M, packed, K, N, g * X16, bias, y, bf16);
        }
        return;
    }
#endif
    const int per = ((N + nth - 1) / nth + 7) / 8 * 8;
    const int r0 = tid * per, r1 = r0 + per < N ? r0 + per : N;
    if (r0 >= r1) return;
    load_f32(x, 0, M * K, bf16, xf);
    (void)xq_mem;
    (void)int8_dot;
    for (int m0 = 0; m0 < M; m0 += GEMV_ROWS) {
        const int R = M - m0 < GEMV_ROWS ? M - m0 : GEMV_ROWS;
        qf_gemv_any(type, xf + (int64_t)m0 * K, K, W, row_bytes, K, N, r0, r1, bias, out_rows(y, m0, N, bf16), bf16,
                    R);
    }
}
#else
#define XQ_BYTES(M, widest) ((size_t)0)
#endif

/* This thread's share of layer l's projection `slot` (its bias in the next slot): x [M, K] -> y
 * [M, N]; xq: the quantized build's int8 rows of x. */
static inline void project(const StepModel *md, int l, int slot, const void *x, void *y, int K, int N, int M,
                           float *restrict xf, void *xq, int tid, int nth) {
    const void *const *w = md->layers + (size_t)l * LAYER_PTRS;
#ifdef MYVLLM_QUANT_STEP
    const int at = l * LAYER_PTRS + slot, type = md->wtypes ? md->wtypes[at] : 0;
    if (type) {
        quant_share(type, md->row_bytes[at], md->int8_dot, x, w[slot], w[slot + 1], y, K, N, M, md->bf16, xf, xq,
                    tid, nth);
        return;
    }
#else
    (void)xq;
#endif
    gemv_share(x, w[slot], w[slot + 1], y, K, N, M, md->bf16, xf, tid, nth);
}

/* ---------------------------------------------------------------- the step */

/* x: [M, hidden] embeddings (model dtype), rows are requests; positions / slots: [M] int64 (the
 * new token's position and KV slot); block_table [M, bt_stride] and seq_lens [M] (int32, the new
 * token included) as for paged_decode; out: [M, hidden], the final norm's output. Returns 0, -1
 * when M is out of range, -2 when scratch memory could not be allocated. */
int decode_step(const StepModel *md, int M, const void *x, const int64_t *positions, const int64_t *slots,
                const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out, int nthreads) {
    if (M < 1 || M > MAX_ROWS) return -1;
    const int H = md->hidden, NH = md->num_heads, KVH = md->num_kv_heads, D = md->head_dim, I = md->intermediate;
    const int G = NH / KVH, QKV = (NH + 2 * KVH) * D, bf16 = md->bf16;
    const size_t es = bf16 ? 2 : 4;
    if (nthreads < 1) nthreads = 1;
    int max_len = 0;
    for (int b = 0; b < M; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;

    /* per thread, fp32: a widened input row block and attention scratch */
    int widest = H > NH * D ? H : NH * D;
    widest = widest > I ? widest : I;
    const size_t attend_floats = (size_t)G * max_len + 2 * (size_t)G * D + (size_t)KVH * D + 16;
    const size_t per_thread = (size_t)M * widest + attend_floats + (XQ_BYTES(M, widest) + 3) / 4;
    const StepBuffers buf = step_buffers(md, M, x, per_thread, nthreads);
    if (buf.mem == NULL) return -2;
    void *const res = buf.res, *const h = buf.h, *const qkv = buf.qkv, *const att = buf.att, *const gu = buf.gu;
    void *const act = buf.act;
    float *const scratch = buf.scratch;

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = thread_id(), nth = team_size();
        float *xf = thread_scratch(scratch, per_thread);
        float *scores = xf + (size_t)M * widest, *acc = scores + (size_t)G * max_len, *qrows = acc + (size_t)G * D;
        float *tmp = qrows + (size_t)G * D;
        void *xq = scores + attend_floats;
        for (int l = 0; l < md->num_layers; l++) {
            const void *const *w = md->layers + (size_t)l * LAYER_PTRS;
            /* h = RMSNorm(residual), the previous layer's MLP output (in h) added first */
#pragma omp single
            for (int m = 0; m < M; m++) {
                char *hm = (char *)h + (size_t)m * H * es, *rm = (char *)res + (size_t)m * H * es;
                if (l == 0)
                    rms_norm_row(rm, w[W_IN_NORM], hm, H, md->eps, bf16);
                else
                    add_rms_norm_row(hm, rm, w[W_IN_NORM], H, md->eps, bf16);
            }
            project(md, l, W_QKV, h, qkv, H, QKV, M, xf, xq, tid, nth);
#pragma omp barrier
            /* per-head norms (Qwen3), RoPE on the q and k heads, K/V into the cache */
#pragma omp single
            for (int m = 0; m < M; m++) {
                char *row = (char *)qkv + (size_t)m * QKV * es;
                if (w[W_Q_NORM] != NULL) {
                    for (int hd = 0; hd < NH + KVH; hd++) {
                        char *head = row + (size_t)hd * D * es;
                        rms_norm_row(head, hd < NH ? w[W_Q_NORM] : w[W_K_NORM], head, D, md->eps, bf16);
                    }
                }
                rope_row(row, NH + KVH, D, md->cos + positions[m] * (int64_t)D, md->sin + positions[m] * (int64_t)D,
                         bf16);
                const size_t kv_bytes = (size_t)KVH * D * es, at = (size_t)slots[m] * kv_bytes;
                memcpy((char *)md->kv[2 * l] + at, row + (size_t)NH * D * es, kv_bytes);
                memcpy((char *)md->kv[2 * l + 1] + at, row + (size_t)(NH + KVH) * D * es, kv_bytes);
            }
            /* attention, one (request, KV head) unit at a time */
            const Args a = {NULL, md->kv[2 * l], md->kv[2 * l + 1], block_table, seq_lens, NULL, bt_stride,
                            NH, KVH, D, md->block_size, bf16, bf16, md->scale};
            const AttendFn attend = select_attend(D);
#pragma omp for schedule(dynamic, 1)
            for (int u = 0; u < M * KVH; u++) {
                const int b = u / KVH, kh = u % KVH;
                load_f32(qkv, (int64_t)b * QKV + (int64_t)kh * G * D, G * D, bf16, qrows);
                attend(&a, b, kh, kh + 1, qrows, scores, acc, tmp);
                store_from_f32(att, (int64_t)b * NH * D + (int64_t)kh * G * D, G * D, bf16, acc);
            }
            project(md, l, W_O, att, h, NH * D, H, M, xf, xq, tid, nth);
#pragma omp barrier
#pragma omp single
            for (int m = 0; m < M; m++)
                add_rms_norm_row((char *)h + (size_t)m * H * es, (char *)res + (size_t)m * H * es, w[W_POST_NORM], H,
                                 md->eps, bf16);
            project(md, l, W_GATE_UP, h, gu, H, 2 * I, M, xf, xq, tid, nth);
#pragma omp barrier
#pragma omp single
            for (int m = 0; m < M; m++) {
                const char *g = (const char *)gu + (size_t)m * 2 * I * es;
                silu_mul_row(g, g + (size_t)I * es, (char *)act + (size_t)m * I * es, I, bf16);
            }
            project(md, l, W_DOWN, act, h, I, H, M, xf, xq, tid, nth);
#pragma omp barrier
        }
    }
    for (int m = 0; m < M; m++)
        add_rms_norm_row((char *)h + (size_t)m * H * es, (char *)res + (size_t)m * H * es, md->final_norm, H, md->eps,
                         bf16);
    memcpy(out, h, (size_t)M * H * es);
    free(buf.mem);
    return 0;
}

/* logits [M, N] (model dtype) = x [M, K] . W [N, K]^T: the LM head of a small batch over the
 * vocabulary rows, split over the threads. Returns 0, -1 when M is out of range, -2 without
 * memory. */
int lm_head(const void *x, const void *W, void *y, int M, int K, int N, int bf16, int nthreads) {
    if (M < 1 || M > MAX_ROWS) return -1;
    if (nthreads < 1) nthreads = 1;
    float *xf = malloc(sizeof(float) * (size_t)M * K * (size_t)nthreads);
    if (xf == NULL) return -2;
#pragma omp parallel num_threads(nthreads)
    gemv_share(x, W, NULL, y, K, N, M, bf16, xf + (size_t)M * K * thread_id(), thread_id(), team_size());
    free(xf);
    return 0;
}

#ifdef MYVLLM_QUANT_STEP
/* lm_head on a weight of `type` blocks (row_bytes per row): the LM head (or tied embedding) kept in
 * GGUF blocks. */
int lm_head_quant(int type, int64_t row_bytes, int int8_dot, const void *x, const void *W, void *y, int M, int K,
                  int N, int bf16, int nthreads) {
    if (M < 1 || M > MAX_ROWS) return -1;
    if (nthreads < 1) nthreads = 1;
    const size_t per_thread = (size_t)M * K + (XQ_BYTES(M, K) + 3) / 4;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)nthreads);
    if (scratch == NULL) return -2;
#pragma omp parallel num_threads(nthreads)
    {
        float *xf = thread_scratch(scratch, per_thread);
        quant_share(type, row_bytes, int8_dot, x, W, NULL, y, K, N, M, bf16, xf, xf + (size_t)M * K, thread_id(),
                    team_size());
    }
    free(scratch);
    return 0;
}

/* Rows from which qg_matmul takes its tiles: the quantized step takes fewer (its products are
 * the row GEMVs the layer-by-layer forward runs below that). */
int quant_tile_min_rows(void) { return TILE_MIN_ROWS; }

/* Whether the integer products (quant_x16.h, any row count) cover `type` in this build. */
int quant_int8_dot(int type) { return q8_covers(type); }
#endif

int max_rows(void) { return MAX_ROWS; }
