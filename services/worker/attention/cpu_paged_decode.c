/* Paged decode attention for CPUs: one query token per request, K/V read in place from
 * the paged cache (no gather copy), GQA, fp32 or bf16 cache, fp32 math.
 *
 * Built at first use by cpu_backend.py through cpu/cbuild.py (a fixed x86-64 level, the best
 * this CPU runs up to AVX-512 with bf16 dot products; -O3 -fopenmp on torch's own libgomp
 * threads). The per-request attention itself is in cpu/paged_attend.h, shared with the
 * whole-step decode kernel (models/c_step/decode_step.c); this file splits a batch into units
 * over threads.
 *
 * Why it looks like this:
 * - Decode attention is bound by reading the cache (at 64 requests of ~400 tokens the fp32
 *   cache read per step is about twice the model's weights). For head sizes of 64 and 128
 *   (attend_blocked) a group of 8 cached tokens (8 contiguous rows) is consumed whole, every
 *   query head of it, before the next, and the following group is prefetched in software.
 *   Other head sizes take the plain loops (attend_impl).
 * - Threads come from OpenMP. The process's libgomp is torch's own (same soname, already
 *   loaded), so this kernel runs on the very worker threads torch's ops use instead of
 *   fighting them for the cores.
 * - Units are (request, range of KV heads): whole requests when there are enough of them
 *   to keep every thread busy, single KV heads otherwise (batch 1 still uses every thread).
 * - exp() is a polynomial (relative error ~2e-7) evaluated 8 lanes at a time with vector
 *   extensions, not libm's scalar call: there are ~10 scores per cached token.
 */
#include <stdlib.h>

#include "paged_attend.h"
#include "threads.h"

/* Returns 0, or -1 when scratch memory could not be allocated. q and out are fp32 or, with
 * io_bf16, bf16; the cache is fp32 or, with is_bf16, bf16. */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_table,
                 int64_t bt_stride, const int32_t *seq_lens, void *out, int B, int H, int KVH, int D, int BS,
                 float scale, int is_bf16, int io_bf16, int num_threads) {
    const Args a = {q, k_cache, v_cache, block_table, seq_lens, out, bt_stride, H, KVH, D, BS, is_bf16, io_bf16,
                    scale};
    if (num_threads < 1) num_threads = 1;
    int max_len = 0;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Whole requests when there are a few per thread; otherwise split them by KV head. */
    const int heads_per_unit = B >= 4 * num_threads ? KVH : 1;
    const int units_per_req = KVH / heads_per_unit, num_units = B * units_per_req;
    if (num_threads > num_units) num_threads = num_units > 0 ? num_units : 1;
    const int nh = heads_per_unit * (H / KVH);
    /* per thread: scores [nh, max_len], acc [nh, D], q rows [nh, D], a bf16 row [KVH, D] */
    const size_t per_thread = (size_t)nh * max_len + 2 * (size_t)nh * D + (size_t)KVH * D;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return -1;
    const AttendFn attend = select_attend(D);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int u = 0; u < num_units; u++) {
        float *mine = thread_scratch(scratch, per_thread);
        float *scores = mine, *acc = scores + (size_t)nh * max_len, *qrows = acc + (size_t)nh * D;
        float *tmp = qrows + (size_t)nh * D;
        const int b = u / units_per_req, kh0 = (u % units_per_req) * heads_per_unit;
        const int64_t first = ((int64_t)b * H + (int64_t)kh0 * (H / KVH)) * D; /* the unit's first q row */
        load_f32(q, first, nh * D, io_bf16, qrows);
        attend(&a, b, kh0, kh0 + heads_per_unit, qrows, scores, acc, tmp);
        store_from_f32(out, first, nh * D, io_bf16, acc);
    }
    free(scratch);
    return 0;
}

/* exp_neg over n values the way the kernel's softmax applies it (8 lanes at a time, the
 * scalar version on the tail): exported so the tests can check its accuracy directly. */
void exp_neg_lanes(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        f32x8 v;
        memcpy(&v, x + i, sizeof v);
        v = exp8(v);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] = exp1(x[i]);
}
