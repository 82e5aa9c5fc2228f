/* The whole decoder forward of a decode batch of more rows than decode_step.c takes, in one call,
 * on the weights gemm.c packed for the linear layers: every layer's RMSNorm, QKV projection,
 * RoPE, KV-cache write, paged attention, output projection, MLP, and the final norm. The LM head
 * stays the packed linear layer it is.
 *
 * Built at first use by decode_step.py (cpu/cbuild.py, up to the avx512_bf16 level as gemm.c is,
 * -ffp-contract=off so the elementwise arithmetic rounds exactly as cpu_ops.c's does: both use
 * row_ops.h; the projections are gemm_tile.h's, the attention paged_attend.h's).
 *
 * Why: from 16 rows up a decode step is GEMM-bound, and the GEMMs run near the machine's peak,
 * but the eager forward around them (~10 ops a layer, each a Python dispatch and an OpenMP region
 * of its own while the other threads spin at its barrier, the KV write an index_copy_) took
 * ~45% of the step on two cores (SmolLM2, 16 and 48 requests). Here one OpenMP region runs the
 * step: each projection is split over the threads by column blocks (each streams its own
 * blocks, as gemm() does), the row-wise ops are split by rows, and attention by (request, KV
 * head), with a unit doing that head's RoPE and KV write before it attends; threads meet at a
 * barrier only where the next stage needs every row of the previous one.
 */
#include <stdlib.h>

#include "gemm_tile.h"
#include "paged_attend.h"
#include "row_ops.h"
#include "step_model.h"
#include "threads.h"

/* Most rows (requests) a step may carry: each thread's share of a projection multiplies all rows
 * of x into one column block at a time, so x ([rows, intermediate]) should stay in L2. */
#define MAX_ROWS 256

/* Whether this build runs the step for fp32 (bf16 = 0) or bf16 (bf16 = 1): where gemm.c does. */
int packed_step_available(int bf16) { return tile_available(bf16); }

int packed_step_max_rows(void) { return MAX_ROWS; }

#ifdef __AVX512F__
/* This thread's share of y = x . W^T (+ bias) for all M rows: a contiguous range of W's column
 * blocks, the next block prefetched while the current one is multiplied (as gemm() does). */
static void gemm_share(const void *x, const void *packed, const void *bias, void *y, int M, int K, int N, int bf16,
                       int tid, int nth) {
    const int nb = N / NB, b0 = (int)((int64_t)nb * tid / nth), b1 = (int)((int64_t)nb * (tid + 1) / nth);
    const int64_t block_bytes = (int64_t)K * NB * (bf16 ? 2 : 4);
    for (int b = b0; b < b1; b++) {
        const char *next = b + 1 < b1 ? (const char *)packed + (b + 1) * block_bytes : NULL;
#ifdef __AVX512BF16__
        if (bf16) {
            rows_of_block(x, packed, bias, y, K, N, b, 0, M, next, 1);
            continue;
        }
#endif
        rows_of_block(x, packed, bias, y, K, N, b, 0, M, next, 0);
    }
}
#endif

/* x: [M, hidden] embeddings (model dtype), rows are requests; positions / slots: [M] int64 (the
 * new token's position and KV slot); block_table [M, bt_stride] and seq_lens [M] (int32, the new
 * token included) as for paged_decode; out: [M, hidden], the final norm's output. The layers'
 * projection pointers are gemm_pack's copies (every output size a multiple of NB). Returns 0, -1
 * when M is out of range, -2 when scratch memory could not be allocated, -3 when this build has
 * no step for the dtype. */
int packed_step(const StepModel *md, int M, const void *x, const int64_t *positions, const int64_t *slots,
                const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out, int nthreads) {
    if (M < 1 || M > MAX_ROWS) return -1;
    if (!packed_step_available(md->bf16)) return -3;
#ifdef __AVX512F__
    const int H = md->hidden, NH = md->num_heads, KVH = md->num_kv_heads, D = md->head_dim, I = md->intermediate;
    const int G = NH / KVH, QKV = (NH + 2 * KVH) * D, bf16 = md->bf16;
    const size_t es = bf16 ? 2 : 4;
    if (nthreads < 1) nthreads = 1;
    int max_len = 0;
    for (int b = 0; b < M; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;

    /* per thread, fp32: attention scratch (scores, accumulators, the unit's q rows, a widened
     * cache row) */
    const size_t per_thread = (size_t)G * max_len + 2 * (size_t)G * D + (size_t)KVH * D + 16;
    const StepBuffers buf = step_buffers(md, M, x, per_thread, nthreads);
    if (buf.mem == NULL) return -2;
    void *const res = buf.res, *const h = buf.h, *const qkv = buf.qkv, *const att = buf.att, *const gu = buf.gu;
    void *const act = buf.act;
    float *const scratch = buf.scratch;
    const AttendFn attend = select_attend(D);

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = thread_id(), nth = team_size();
        float *scores = thread_scratch(scratch, per_thread), *acc = scores + (size_t)G * max_len;
        float *qrows = acc + (size_t)G * D, *tmp = qrows + (size_t)G * D;
        for (int l = 0; l < md->num_layers; l++) {
            const void *const *w = md->layers + (size_t)l * LAYER_PTRS;
            /* h = RMSNorm(residual), the previous layer's MLP output (in h) added first */
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                char *hm = (char *)h + (size_t)m * H * es, *rm = (char *)res + (size_t)m * H * es;
                if (l == 0)
                    rms_norm_row(rm, w[W_IN_NORM], hm, H, md->eps, bf16);
                else
                    add_rms_norm_row(hm, rm, w[W_IN_NORM], H, md->eps, bf16);
            }
            gemm_share(h, w[W_QKV], w[B_QKV], qkv, M, H, QKV, bf16, tid, nth);
#pragma omp barrier
            /* one (request, KV head) at a time: its q heads' and its k head's norms (Qwen3) and
             * RoPE, its K/V into the cache, then attention over the request's cached tokens */
            const Args a = {NULL, md->kv[2 * l], md->kv[2 * l + 1], block_table, seq_lens, NULL, bt_stride,
                            NH, KVH, D, md->block_size, bf16, bf16, md->scale};
#pragma omp for schedule(dynamic, 1)
            for (int u = 0; u < M * KVH; u++) {
                const int b = u / KVH, kh = u % KVH;
                char *row = (char *)qkv + (size_t)b * QKV * es;
                char *q = row + (size_t)kh * G * D * es, *k = row + (size_t)(NH + kh) * D * es;
                const char *v = row + (size_t)(NH + KVH + kh) * D * es;
                if (w[W_Q_NORM] != NULL) {
                    for (int g = 0; g < G; g++) rms_norm_row(q + (size_t)g * D * es, w[W_Q_NORM], q + (size_t)g * D * es,
                                                             D, md->eps, bf16);
                    rms_norm_row(k, w[W_K_NORM], k, D, md->eps, bf16);
                }
                const float *c = md->cos + positions[b] * (int64_t)D, *s = md->sin + positions[b] * (int64_t)D;
                rope_row(q, G, D, c, s, bf16);
                rope_row(k, 1, D, c, s, bf16);
                const size_t at = ((size_t)slots[b] * KVH + kh) * D * es;
                memcpy((char *)md->kv[2 * l] + at, k, (size_t)D * es);
                memcpy((char *)md->kv[2 * l + 1] + at, v, (size_t)D * es);
                load_f32(qkv, (int64_t)b * QKV + (int64_t)kh * G * D, G * D, bf16, qrows);
                attend(&a, b, kh, kh + 1, qrows, scores, acc, tmp);
                store_from_f32(att, (int64_t)b * NH * D + (int64_t)kh * G * D, G * D, bf16, acc);
            }
            gemm_share(att, w[W_O], w[B_O], h, M, NH * D, H, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++)
                add_rms_norm_row((char *)h + (size_t)m * H * es, (char *)res + (size_t)m * H * es, w[W_POST_NORM], H,
                                 md->eps, bf16);
            gemm_share(h, w[W_GATE_UP], w[B_GATE_UP], gu, M, H, 2 * I, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                const char *g = (const char *)gu + (size_t)m * 2 * I * es;
                silu_mul_row(g, g + (size_t)I * es, (char *)act + (size_t)m * I * es, I, bf16);
            }
            gemm_share(act, w[W_DOWN], w[B_DOWN], h, M, I, H, bf16, tid, nth);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            add_rms_norm_row((char *)h + (size_t)m * H * es, (char *)res + (size_t)m * H * es, md->final_norm, H,
                             md->eps, bf16);
    }
    memcpy(out, h, (size_t)M * H * es);
    free(buf.mem);
    return 0;
#else
    (void)positions, (void)x, (void)slots, (void)block_table, (void)bt_stride, (void)seq_lens, (void)out, (void)nthreads;
    return -3;
#endif
}
