/* Paged prefill attention for CPUs: every prefill chunk of a step at once, causal, GQA, K/V read
 * in place from the paged cache (the chunk's own K/V are stored before attention runs), fp32 or
 * bf16 cache and queries, fp32 math with an online softmax (flash attention's order).
 *
 * Built at first use by cpu_backend.py through cpu/cbuild.py (a fixed x86-64 level, up to AVX-512
 * with bf16 dot products; -fopenmp on torch's own libgomp threads). The AVX-512 paths (scores and
 * values 16 lanes wide, bf16 scores by vdpbf16ps, the online softmax 16 keys and 16 rows at a
 * time) run about twice as fast as the AVX2 build where the CPU has them (BENCHMARKS.md).
 *
 * Why: torch's SDPA spends a large share of its time on overhead at these shapes (prompts of
 * 32-512 tokens, 64-wide heads; BENCHMARKS.md). Here a unit of
 * work is (prefill, KV head, tile of QT query tokens): the tile's G * QT query rows (every query
 * head of the KV head) are scored against KT = 32 cached tokens at a time as a small matrix
 * product (keys transposed into L1 8 x 8 at a time in registers, each query value broadcast
 * across 16 keys: 8 independent accumulators), and the keys' values are accumulated with each
 * output row held in registers. 32 keys per step rather than 16 halve the online softmax's
 * per-row bookkeeping (max, rescale of the output rows); 64 wasted more on masked keys than it
 * saved, at every prompt mix tried.
 * Units go to threads dynamically (later tiles see more keys).
 */
#include <stdlib.h>

#include "prefill_attend.h"
#include "threads.h"

/* P prefill chunks: chunk p is query rows [q_start[p], q_start[p] + q_len[p]) of q and out, its
 * tokens at positions ctx_len[p] ... of the request whose block-table row is rows[p]. D must be
 * a multiple of 8. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_prefill(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                  const int32_t *block_table, int64_t bt_stride, const int32_t *rows, const int32_t *q_start,
                  const int32_t *q_len, const int32_t *ctx_len, void *out, int P, int H, int KVH, int D, int BS,
                  float scale, int is_bf16, int num_threads) {
    const PrefillArgs a = {q, k_cache, v_cache, block_table, out, q_stride, bt_stride, H, KVH, D, BS, is_bf16, scale};
    if (num_threads < 1) num_threads = 1;
    /* units: (chunk, KV head, tile), each chunk's later tiles (more keys) first, so that the
     * dynamic schedule ends evenly */
    int num_units = 0;
    for (int p = 0; p < P; p++) num_units += KVH * ((q_len[p] + QT - 1) / QT);
    if (num_units == 0) return 0;
    int32_t(*units)[3] = malloc(sizeof(*units) * (size_t)num_units);
    const int G = H / KVH, R = G * QT;
    const size_t per_thread = prefill_scratch_floats(G, D);
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (units == NULL || scratch == NULL) {
        free(units);
        free(scratch);
        return -1;
    }
    int n = 0;
    for (int p = 0; p < P; p++)
        for (int q0 = ((q_len[p] + QT - 1) / QT - 1) * QT; q0 >= 0; q0 -= QT)
            for (int kh = 0; kh < KVH; kh++) {
                units[n][0] = p;
                units[n][1] = q0;
                units[n][2] = kh;
                n++;
            }
    const PrefillUnitFn unit = select_prefill_unit(D);
    if (num_threads > num_units) num_threads = num_units;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int u = 0; u < num_units; u++) {
        float *mine = thread_scratch(scratch, per_thread);
        float *qs = mine, *kt = qs + (size_t)R * D, *vt = kt + (size_t)D * KT, *s = vt + (size_t)KT * D;
        float *o = s + (size_t)R * KT, *m = o + (size_t)R * D, *l = m + R, *c = l + R;
        const int p = units[u][0];
        unit(&a, block_table + (int64_t)rows[p] * bt_stride, q_start[p], q_len[p], ctx_len[p], units[u][1],
             units[u][2], qs, kt, vt, s, o, m, l, c);
    }
    free(units);
    free(scratch);
    return 0;
}
