/* The routed experts of a mixture-of-experts layer for CPUs with AVX2 or AVX-512, in one call:
 * every (token, slot) pair grouped by expert, each expert's gate/up GEMM with SiLU(gate) * up on
 * its group, its down GEMM, and each token's outputs, scaled by the routing weights, summed in
 * ascending expert order. fp32 and bf16: gemm.c's 16-lane tiles (gemm_tile.h; bf16 by the CPU's
 * bf16 dot products) where the build has them for the dtype, 8-lane tiles of the same layout
 * otherwise (AVX2; bf16 weights widened to fp32 in registers).
 *
 * Built at first use by moe_experts.py (cpu/cbuild.py, up to the avx512_bf16 level, with
 * -ffp-contract=off: no a*b+c fused into one rounding outside the GEMM tiles' explicit FMAs).
 *
 * Why: the torch path runs a GEMM pair per expert from Python, each a dispatch, and groups the
 * pairs with host-side counts; with many small experts (64, top-8) the loop and the syncs cost
 * more than the arithmetic at decode sizes. Here the grouping, both GEMMs, the activation and the
 * weighted sum are one OpenMP region on packed weights.
 *
 * Layout (packed once at load by moe_pack; gemm.c's blocks of NB = 32 output columns, its tiles):
 * - w13 [E, 2I, H] (gate rows, then up rows) becomes [E][Ip / 32][2][H][32]: for each block of 32
 *   intermediate columns its gate block, then its up block, so one work item computes both and
 *   applies SiLU(gate) * up while they are in L1;
 * - w2 [E, H, I] becomes [E][Hp / 32][Ip][32];
 * bf16 blocks hold pairs of k side by side ([K / 2][32][2]), as vdpbf16ps takes them. Ip and Hp
 * are I and H rounded up to whole blocks; the padding is zeros (gate = up = 0 gives SiLU(0) * 0 =
 * 0, which the down projection's zero rows then multiply), so any width works.
 *
 * Work: phase 1 over items (expert, block of 32 intermediate columns, chunk of M_CHUNK rows),
 * phase 2 over (expert, block of 32 hidden columns, chunk of rows), each phase's items split
 * into contiguous ranges of about equal cost over torch's threads (a thread prefetches its next
 * item's block, as gemm.c), then the per-token sums split over the tokens.
 *
 * Arithmetic, matching the torch path (moe.py's grouped_experts) at each rounding point: each
 * GEMM output is one fp32 accumulator over k in order (gemm_tile.h), rounded once to the
 * activations' dtype; SiLU(gate) * up as cpu_ops.c (row_ops.h: bf16 rounds SiLU before the
 * multiply); each pair's output times its routing weight (fp32 or bf16) rounded to the
 * activations' dtype, then added to the token's fp32 sum in ascending expert order, rounded once
 * at the end (bf16), as torch's index_add_ does (it accumulates bf16 in fp32). The GEMM sums run in another order than torch's (oneDNN's
 * blocked K), so fp32 results agree with it to rounding, not to the bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_tile.h"
#include "row_ops.h"
#include "threads.h"

/* An item's cost in rows' worth of work: streaming a block from memory costs about as much as
 * computing this many rows of it, so an item of one row is not counted as nearly free. */
#define STREAM_COST 16

/* Whether this build has the kernel for fp32 (bf16 = 0) or bf16 (bf16 = 1): from AVX2 on, both
 * (the 8-lane rows below where the build has no tiles of gemm_tile.h for the dtype). */
int moe_available(int bf16) {
    (void)bf16;
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* Block `n0 / NB` of src [rows, cols] (row-major, `ld` elements between rows) into dst: K values
 * of each of NB columns (gemm.c's block layout), zeros past `rows` or `cols`. */
static void pack_block(const void *src, int64_t ld, int rows, int cols, int n0, int K, void *dst, int bf16) {
    for (int k = 0; k < K; k++)
        for (int j = 0; j < NB; j++) {
            const int n = n0 + j, inside = n < rows && k < cols;
            if (bf16)
                ((uint16_t *)dst)[((int64_t)(k / 2) * NB + j) * 2 + k % 2] =
                    inside ? ((const uint16_t *)src)[n * ld + k] : 0;
            else
                ((float *)dst)[(int64_t)k * NB + j] = inside ? ((const float *)src)[n * ld + k] : 0.f;
        }
}

/* w13 [E, 2I, H] and w2 [E, H, I] (row-major, the layer's dtype) into w13p [E][Ip / NB][2][H][NB]
 * and w2p [E][Hp / NB][Ip][NB] (bf16: H even; see the layout above). */
void moe_pack(const void *w13, const void *w2, void *w13p, void *w2p, int E, int H, int I, int Ip, int Hp, int bf16,
              int num_threads) {
    const size_t es = bf16 ? 2 : 4;
    const int64_t block13 = (int64_t)H * NB, block2 = (int64_t)Ip * NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int e = 0; e < E; e++) {
        const char *gate = (const char *)w13 + (size_t)e * 2 * I * H * es, *up = gate + (size_t)I * H * es;
        char *dst = (char *)w13p + (size_t)e * 2 * Ip * H * es;
        for (int b = 0; b < Ip / NB; b++) {
            pack_block(gate, H, I, H, b * NB, H, dst + (size_t)(2 * b) * block13 * es, bf16);
            pack_block(up, H, I, H, b * NB, H, dst + (size_t)(2 * b + 1) * block13 * es, bf16);
        }
        const char *down = (const char *)w2 + (size_t)e * H * I * es;
        for (int b = 0; b < Hp / NB; b++)
            pack_block(down, I, H, I, b * NB, Ip, (char *)w2p + ((size_t)e * Hp / NB + b) * block2 * es, bf16);
    }
}

#ifdef __AVX2__
#ifndef M_CHUNK
#define M_CHUNK 96 /* rows per unit of work, as gemm_tile.h's */
#endif

/* gemm_tile.h's tile in 8-lane vectors, for builds without its AVX-512 tile for the dtype (AVX2
 * machines; bf16 on AVX-512 ones without AVX512_BF16): rows [m0, m0 + mt) of x (mt <= MT8)
 * times one packed block (the same layout), 32 columns as four vectors per row, each output one
 * fp32 accumulator over k in order (bf16: the pair's two products fused one after the other).
 * Two rows, not more: 8 accumulators, the block's 4 vectors of a k (bf16: 2 at a time) and the
 * broadcasts fit AVX2's 16 registers. */
#define MT8 2
static inline __attribute__((always_inline)) void tile8(const void *restrict x, const void *restrict block,
                                                        void *restrict y, int K, int N, int b, int m0, const int mt,
                                                        const char *next, const int bf16) {
    f32x8 acc[MT8][4];
    for (int m = 0; m < mt; m++)
        for (int c = 0; c < 4; c++) acc[m][c] = (f32x8){0};
    if (bf16) {
        const uint16_t *xr = (const uint16_t *)x + (int64_t)m0 * K;
        for (int k = 0; k < K; k += 2) {
            if (next) { /* the next block's 128 bytes of this pair of k */
                _mm_prefetch(next + (int64_t)k * 64, _MM_HINT_T0);
                _mm_prefetch(next + (int64_t)k * 64 + 64, _MM_HINT_T0);
            }
            const uint16_t *w = (const uint16_t *)block + (int64_t)k * NB; /* [K / 2][NB][2] */
            f32x8 xe[MT8], xo[MT8];
            for (int m = 0; m < mt; m++) {
                xe[m] = (f32x8)_mm256_set1_ps(bf16_to_f32(xr[(int64_t)m * K + k]));
                xo[m] = (f32x8)_mm256_set1_ps(bf16_to_f32(xr[(int64_t)m * K + k + 1]));
            }
            for (int c = 0; c < 4; c++) {
                f32x8 we, wo;
                load16_bf16_split(w + c * 16, &we, &wo); /* columns 8c .. 8c + 7 at k and k + 1 */
                for (int m = 0; m < mt; m++) acc[m][c] = fma8(xo[m], wo, fma8(xe[m], we, acc[m][c]));
            }
        }
    } else {
        const float *xr = (const float *)x + (int64_t)m0 * K;
        for (int k = 0; k < K; k++) {
            if (next) {
                _mm_prefetch(next + (int64_t)k * 128, _MM_HINT_T0);
                _mm_prefetch(next + (int64_t)k * 128 + 64, _MM_HINT_T0);
            }
            const float *w = (const float *)block + (int64_t)k * NB;
            const f32x8 w0 = load8(w), w1 = load8(w + 8), w2 = load8(w + 16), w3 = load8(w + 24);
            for (int m = 0; m < mt; m++) {
                const f32x8 xv = broadcast8(xr + (int64_t)m * K + k);
                acc[m][0] = fma8(xv, w0, acc[m][0]);
                acc[m][1] = fma8(xv, w1, acc[m][1]);
                acc[m][2] = fma8(xv, w2, acc[m][2]);
                acc[m][3] = fma8(xv, w3, acc[m][3]);
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int c = 0; c < 4; c++) {
            const int64_t at = (int64_t)(m0 + m) * N + b * NB + c * 8;
            if (bf16)
                store8_bf16((uint16_t *)y + at, acc[m][c]);
            else
                store8((float *)y + at, acc[m][c]);
        }
}

/* rows_of_block in 8-lane tiles (gemm_tile.h's signature; no bias: the experts have none) */
static inline __attribute__((always_inline)) void rows8(const void *x, const void *packed, void *y, int K, int N,
                                                        int b, int m0, int m1, const char *next, const int bf16) {
    const void *block = (const char *)packed + (int64_t)b * K * NB * (bf16 ? 2 : 4);
    for (; m0 + MT8 <= m1; m0 += MT8, next = NULL) tile8(x, block, y, K, N, b, m0, MT8, next, bf16);
    if (m0 < m1) tile8(x, block, y, K, N, b, m0, 1, next, bf16);
}

static void rows8_f32(const void *x, const void *packed, const void *bias, void *y, int K, int N, int b, int m0,
                      int m1, const char *next) {
    (void)bias;
    rows8(x, packed, y, K, N, b, m0, m1, next, 0);
}

static void rows8_bf16(const void *x, const void *packed, const void *bias, void *y, int K, int N, int b, int m0,
                       int m1, const char *next) {
    (void)bias;
    rows8(x, packed, y, K, N, b, m0, m1, next, 1);
}

typedef void (*rows_fn)(const void *, const void *, const void *, void *, int, int, int, int, int, const char *);

/* One unit of GEMM work: rows [m0, m1) of expert e's group times its block b. */
typedef struct {
    int e, b, m0, m1;
} item_t;

/* Items of a phase with `blocks` column blocks per expert, expert-major then block-major (a
 * thread's next item is usually the next block, which it prefetches); returns how many. */
static int make_items(const int *start, int E, int blocks, item_t *items) {
    int n = 0;
    for (int e = 0; e < E; e++)
        for (int b = 0; b < blocks; b++)
            for (int m0 = 0; m0 < start[e + 1] - start[e]; m0 += M_CHUNK) {
                const int m1 = m0 + M_CHUNK < start[e + 1] - start[e] ? m0 + M_CHUNK : start[e + 1] - start[e];
                items[n++] = (item_t){e, b, m0, m1};
            }
    return n;
}

/* Thread t of nt's contiguous range [*lo, *hi) of the items: the ranges split the total cost
 * about evenly (an item belongs to the thread whose share holds its cost's start). */
static void item_range(const item_t *items, int n, int t, int nt, int *lo, int *hi) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += items[i].m1 - items[i].m0 + STREAM_COST;
    const int64_t from = total * t / nt, to = total * (t + 1) / nt;
    int64_t at = 0;
    *lo = *hi = n;
    for (int i = 0; i < n; i++) {
        if (at >= from && *lo == n) *lo = i;
        if (at >= to) {
            *hi = i;
            break;
        }
        at += items[i].m1 - items[i].m0 + STREAM_COST;
    }
    if (*hi < *lo) *hi = *lo;
}
#endif

/* out [T, H] = for each token, the sum over its k slots in ascending expert order of
 * weight * down(SiLU(gate(x)) * up(x)) of that slot's expert. x [T, H] and out contiguous in the
 * layer's dtype; w13p and w2p from moe_pack; weights [T, k] fp32 or bf16 (weights_bf16); ids
 * [T, k] int64, an id outside [0, E) (another rank's expert) adding nothing. Returns 0, or -1
 * where scratch memory could not be had (out is then untouched). */
int moe_experts(const void *x, const void *w13p, const void *w2p, const void *weights, const int64_t *ids, void *out,
                int T, int k, int E, int H, int Ip, int Hp, int bf16, int weights_bf16, int num_threads) {
#ifdef __AVX2__
    const size_t es = bf16 ? 2 : 4;
    const int pairs = T * k;
    /* Group the pairs by expert, stable (within an expert, in token order): pos[i] is pair i's
     * row in the group order, -1 for another rank's expert. */
    int *start = calloc((size_t)E + 1, sizeof(int));
    int *pos = malloc(((size_t)pairs * 3 + 1) * sizeof(int));
    if (start == NULL || pos == NULL) {
        free(start), free(pos);
        return -1;
    }
    int *token_of = pos + pairs, *slots = token_of + pairs; /* a row's token; each token's slots sorted */
    for (int i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < E) start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    const int rows = start[E];
    int *next_row = malloc(((size_t)E + 1) * sizeof(int));
    if (next_row == NULL) {
        free(start), free(pos);
        return -1;
    }
    memcpy(next_row, start, ((size_t)E + 1) * sizeof(int));
    for (int i = 0; i < pairs; i++) {
        pos[i] = ids[i] >= 0 && ids[i] < E ? next_row[ids[i]]++ : -1;
        if (pos[i] >= 0) token_of[pos[i]] = i / k;
    }
    free(next_row);
    /* Each token's slots in ascending expert order (ties: slot order), the order of the sum. */
    for (int t = 0; t < T; t++) {
        int *s = slots + (int64_t)t * k;
        for (int j = 0; j < k; j++) {
            int at = j;
            for (; at > 0 && ids[(int64_t)t * k + s[at - 1]] > ids[(int64_t)t * k + j]; at--) s[at] = s[at - 1];
            s[at] = j;
        }
    }
    /* Scratch: the grouped rows of x, SiLU(gate) * up, the down outputs, and per thread a gate
     * and an up tile of M_CHUNK rows. */
    const int blocks13 = Ip / NB, blocks2 = Hp / NB;
    int max_items = 0;
    for (int e = 0; e < E; e++) {
        const int chunks = (start[e + 1] - start[e] + M_CHUNK - 1) / M_CHUNK;
        max_items += chunks * (blocks13 > blocks2 ? blocks13 : blocks2);
    }
    if (num_threads > max_items) num_threads = max_items;
    if (num_threads < 1) num_threads = 1;
    const size_t xg_bytes = (size_t)rows * H * es, h_bytes = (size_t)rows * Ip * es, y_bytes = (size_t)rows * Hp * es;
    const size_t tile_bytes = (size_t)M_CHUNK * NB * es, items_bytes = (size_t)max_items * sizeof(item_t);
    const size_t align = 64, pad = align - 1;
    const size_t total = ((xg_bytes + pad) & ~pad) + ((h_bytes + pad) & ~pad) + ((y_bytes + pad) & ~pad) +
                         2 * tile_bytes * num_threads + 2 * items_bytes + align;
    char *scratch = aligned_alloc(align, (total + pad) & ~pad);
    if (scratch == NULL) {
        free(start), free(pos);
        return -1;
    }
    char *xg = scratch, *h = xg + ((xg_bytes + pad) & ~pad), *y = h + ((h_bytes + pad) & ~pad);
    char *tiles = y + ((y_bytes + pad) & ~pad);
    item_t *items13 = (item_t *)(tiles + 2 * tile_bytes * num_threads), *items2 = items13 + max_items;
    const int n13 = make_items(start, E, blocks13, items13), n2 = make_items(start, E, blocks2, items2);
    /* gemm_tile.h's 16-lane tiles where the build has them for the dtype, else the 8-lane ones */
    rows_fn gemm_rows = bf16 ? rows8_bf16 : rows8_f32;
#ifdef __AVX512F__
    if (!bf16) gemm_rows = rows_f32;
#endif
#ifdef __AVX512BF16__
    if (bf16) gemm_rows = rows_bf16;
#endif
    const int64_t block13 = (int64_t)H * NB * es, block2 = (int64_t)Ip * NB * es;

#pragma omp parallel num_threads(num_threads)
    {
        const int t = thread_id(), nt = team_size();
        /* gather: row r of the groups is x's row of its token */
        for (int r = (int)((int64_t)rows * t / nt); r < (int)((int64_t)rows * (t + 1) / nt); r++)
            memcpy(xg + (size_t)r * H * es, (const char *)x + (size_t)token_of[r] * H * es, (size_t)H * es);
#pragma omp barrier
        /* phase 1: h = SiLU(x . gate^T) * (x . up^T), a block of 32 columns at a time */
        char *gate_tile = tiles + 2 * tile_bytes * t, *up_tile = gate_tile + tile_bytes;
        int lo, hi;
        item_range(items13, n13, t, nt, &lo, &hi);
        for (int i = lo; i < hi; i++) {
            const item_t it = items13[i];
            const int64_t row0 = start[it.e] + it.m0;
            const char *gate = (const char *)w13p + ((int64_t)it.e * blocks13 + it.b) * 2 * block13, *up = gate + block13;
            const char *next = NULL;
            if (i + 1 < hi && (items13[i + 1].e != it.e || items13[i + 1].b != it.b))
                next = (const char *)w13p + ((int64_t)items13[i + 1].e * blocks13 + items13[i + 1].b) * 2 * block13;
            gemm_rows(xg + row0 * H * es, gate, NULL, gate_tile, H, NB, 0, 0, it.m1 - it.m0, up);
            gemm_rows(xg + row0 * H * es, up, NULL, up_tile, H, NB, 0, 0, it.m1 - it.m0, next);
            for (int m = 0; m < it.m1 - it.m0; m++)
                silu_mul_row(gate_tile + (size_t)m * NB * es, up_tile + (size_t)m * NB * es,
                             h + ((size_t)(row0 + m) * Ip + (size_t)it.b * NB) * es, NB, bf16);
        }
#pragma omp barrier
        /* phase 2: y = h . down^T */
        item_range(items2, n2, t, nt, &lo, &hi);
        for (int i = lo; i < hi; i++) {
            const item_t it = items2[i];
            const int64_t row0 = start[it.e] + it.m0;
            const char *down = (const char *)w2p + (int64_t)it.e * blocks2 * block2;
            const char *next = NULL;
            if (i + 1 < hi && (items2[i + 1].e != it.e || items2[i + 1].b != it.b))
                next = (const char *)w2p + ((int64_t)items2[i + 1].e * blocks2 + items2[i + 1].b) * block2;
            gemm_rows(h + row0 * Ip * es, down, NULL, y + row0 * Hp * es, Ip, Hp, it.b, 0, it.m1 - it.m0, next);
        }
#pragma omp barrier
        /* each token's sum of its pairs' weighted outputs, in ascending expert order */
        for (int tok = (int)((int64_t)T * t / nt); tok < (int)((int64_t)T * (t + 1) / nt); tok++) {
            const int *s = slots + (int64_t)tok * k;
            int c = 0;
            for (; c + 8 <= H; c += 8) {
                f32x8 acc = {0};
                for (int j = 0; j < k; j++) {
                    const int64_t pair = (int64_t)tok * k + s[j];
                    if (pos[pair] < 0) continue;
                    const float w = weights_bf16 ? bf16_to_f32(((const uint16_t *)weights)[pair])
                                                 : ((const float *)weights)[pair];
                    f32x8 scaled = load8_any(y, (int64_t)pos[pair] * Hp + c, bf16) * w;
                    acc += bf16 ? round8_bf16(scaled) : scaled;
                }
                if (bf16)
                    store8_bf16((uint16_t *)out + (int64_t)tok * H + c, acc);
                else
                    store8((float *)out + (int64_t)tok * H + c, acc);
            }
            for (; c < H; c++) {
                float acc = 0.f;
                for (int j = 0; j < k; j++) {
                    const int64_t pair = (int64_t)tok * k + s[j];
                    if (pos[pair] < 0) continue;
                    const float w = weights_bf16 ? bf16_to_f32(((const uint16_t *)weights)[pair])
                                                 : ((const float *)weights)[pair];
                    const int64_t at = (int64_t)pos[pair] * Hp + c;
                    const float scaled = (bf16 ? bf16_to_f32(((const uint16_t *)y)[at]) : ((const float *)y)[at]) * w;
                    acc += bf16 ? round_bf16(scaled) : scaled;
                }
                if (bf16)
                    ((uint16_t *)out)[(int64_t)tok * H + c] = f32_to_bf16(acc);
                else
                    ((float *)out)[(int64_t)tok * H + c] = acc;
            }
        }
    }
    free(scratch), free(start), free(pos);
    return 0;
#else
    (void)x, (void)w13p, (void)w2p, (void)weights, (void)ids, (void)out, (void)T, (void)k, (void)E, (void)H;
    (void)Ip, (void)Hp, (void)bf16, (void)weights_bf16, (void)num_threads;
    return -1;
#endif
}
