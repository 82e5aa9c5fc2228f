/* The routed experts of a mixture-of-experts layer as work for an OpenMP team that already runs
 * (moe_experts.c's arithmetic and layout, described there): moe_plan, by one thread, groups every
 * (token, slot) pair by expert into caller-provided scratch; then moe_share, by every thread of
 * the team, gathers the grouped rows, runs phase 1 (gate/up GEMM, SiLU(gate) * up), phase 2 (down
 * GEMM) and each token's weighted sum, with a barrier between phases. Shared by moe_experts.c
 * (one call per layer, its own region) and models/c_step/packed_step.c (a whole step's region),
 * so both compute every output alike.
 *
 * Scratch: moe_scratch_bytes gives the worst case for T tokens of k slots over E experts (every
 * pair on a valid expert, every expert's group in its most chunks) and a team of `nthreads`, so a
 * caller can allocate once for a whole step. */
#ifndef MYVLLM_MOE_SHARE_H
#define MYVLLM_MOE_SHARE_H

#include <stdint.h>
#include <string.h>

#include "gemm_tile.h"
#include "row_ops.h"

/* An item's cost in rows' worth of work: streaming a block from memory costs about as much as
 * computing this many rows of it, so an item of one row is not counted as nearly free. */
#define STREAM_COST 16

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

/* A layer's grouping and work lists, in the caller's scratch (moe_plan fills it). */
typedef struct {
    int T, k, E, H, Ip, Hp, bf16;
    int rows;      /* pairs on an expert in [0, E) */
    int max_items; /* the larger phase's item count bound used to cap a team (moe_experts) */
    int n13, n2;   /* items of phase 1 and phase 2 */
    int *start;    /* [E + 1]: expert e's rows of the groups are [start[e], start[e + 1]) */
    int *pos;      /* [T * k]: pair i's row in the groups, -1 for an expert outside [0, E) */
    int *token_of; /* [T * k]: a row's token */
    int *slots;    /* [T * k]: each token's slots in ascending expert order */
    item_t *items13, *items2;
    char *xg, *h, *y; /* the grouped rows of x, SiLU(gate) * up, the down outputs */
    char *tiles;      /* per thread, a gate and an up tile of M_CHUNK rows */
} MoePlan;

static inline size_t moe_align64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* Most items a phase with `blocks` column blocks per expert can have for `pairs` pairs: each
 * expert's group in chunks of M_CHUNK rows, at most one part-filled chunk per expert. */
static inline size_t moe_max_items(int pairs, int E, int blocks) {
    return ((size_t)pairs / M_CHUNK + (size_t)E) * (size_t)blocks;
}

/* Bytes of scratch moe_plan may lay out (given 64-byte aligned) for a team of `nthreads`. */
static inline size_t moe_scratch_bytes(int T, int k, int E, int H, int Ip, int Hp, int bf16, int nthreads) {
    const size_t es = bf16 ? 2 : 4, pairs = (size_t)T * k;
    const size_t ints = moe_align64(((size_t)E + 1) * 2 * sizeof(int) + pairs * 3 * sizeof(int));
    const size_t items = moe_align64((moe_max_items((int)pairs, E, Ip / NB) + moe_max_items((int)pairs, E, Hp / NB)) *
                                     sizeof(item_t));
    const size_t rows = moe_align64(pairs * H * es) + moe_align64(pairs * Ip * es) + moe_align64(pairs * Hp * es);
    return ints + items + rows + 2 * (size_t)M_CHUNK * NB * es * (size_t)(nthreads < 1 ? 1 : nthreads);
}

/* Group the pairs of ids [T, k] (int64) by expert, stable (within an expert, in token order),
 * into `scratch` (moe_scratch_bytes of it, 64-byte aligned), and list each phase's items. One
 * thread runs it; the team's threads then run moe_share on the plan. */
static inline void moe_plan(MoePlan *p, char *scratch, const int64_t *ids, int T, int k, int E, int H, int Ip, int Hp,
                     int bf16) {
    const size_t es = bf16 ? 2 : 4;
    const int pairs = T * k;
    *p = (MoePlan){.T = T, .k = k, .E = E, .H = H, .Ip = Ip, .Hp = Hp, .bf16 = bf16};
    p->start = (int *)scratch;
    int *next_row = p->start + E + 1;
    p->pos = next_row + E + 1;
    p->token_of = p->pos + pairs;
    p->slots = p->token_of + pairs;
    char *at = scratch + moe_align64(((size_t)E + 1) * 2 * sizeof(int) + (size_t)pairs * 3 * sizeof(int));
    const int blocks13 = Ip / NB, blocks2 = Hp / NB;
    const size_t max13 = moe_max_items(pairs, E, blocks13), max2 = moe_max_items(pairs, E, blocks2);
    p->items13 = (item_t *)at;
    p->items2 = p->items13 + max13;
    at += moe_align64((max13 + max2) * sizeof(item_t));
    p->xg = at;
    p->h = p->xg + moe_align64((size_t)pairs * H * es);
    p->y = p->h + moe_align64((size_t)pairs * Ip * es);
    p->tiles = p->y + moe_align64((size_t)pairs * Hp * es);

    int *start = p->start, *pos = p->pos, *token_of = p->token_of, *slots = p->slots;
    memset(start, 0, ((size_t)E + 1) * sizeof(int));
    for (int i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < E) start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    p->rows = start[E];
    memcpy(next_row, start, ((size_t)E + 1) * sizeof(int));
    for (int i = 0; i < pairs; i++) {
        pos[i] = ids[i] >= 0 && ids[i] < E ? next_row[ids[i]]++ : -1;
        if (pos[i] >= 0) token_of[pos[i]] = i / k;
    }
    /* Each token's slots in ascending expert order (ties: slot order), the order of the sum. */
    for (int t = 0; t < T; t++) {
        int *s = slots + (int64_t)t * k;
        for (int j = 0; j < k; j++) {
            int to = j;
            for (; to > 0 && ids[(int64_t)t * k + s[to - 1]] > ids[(int64_t)t * k + j]; to--) s[to] = s[to - 1];
            s[to] = j;
        }
    }
    p->max_items = 0;
    for (int e = 0; e < E; e++) {
        const int chunks = (start[e + 1] - start[e] + M_CHUNK - 1) / M_CHUNK;
        p->max_items += chunks * (blocks13 > blocks2 ? blocks13 : blocks2);
    }
    p->n13 = make_items(start, E, blocks13, p->items13);
    p->n2 = make_items(start, E, blocks2, p->items2);
}

/* Thread t of the team of nt's share of out [T, H] = for each token, the sum over its k slots in
 * ascending expert order of weight * down(SiLU(gate(x)) * up(x)) of that slot's expert (x [T, H]
 * and out contiguous in the layer's dtype; w13p and w2p from moe_pack; weights [T, k] fp32, or
 * bf16 where weights_bf16). Every thread of the team calls it (it holds the team's barriers; none
 * after the sum: the caller's next stage meets where it needs every token). out may be x: every
 * row of x is read (gathered) before the first barrier, and out written after the last. */
static inline void moe_share(const MoePlan *p, const void *x, const void *w13p, const void *w2p, const void *weights,
                      int weights_bf16, void *out, int t, int nt) {
    const int T = p->T, k = p->k, H = p->H, Ip = p->Ip, Hp = p->Hp, bf16 = p->bf16, rows = p->rows;
    const size_t es = bf16 ? 2 : 4;
    const int blocks13 = Ip / NB, blocks2 = Hp / NB, n13 = p->n13, n2 = p->n2;
    const int *start = p->start, *pos = p->pos, *token_of = p->token_of, *slots = p->slots;
    const item_t *items13 = p->items13, *items2 = p->items2;
    char *xg = p->xg, *h = p->h, *y = p->y;
    const size_t tile_bytes = (size_t)M_CHUNK * NB * es;
    /* gemm_tile.h's 16-lane tiles where the build has them for the dtype, else the 8-lane ones */
    rows_fn gemm_rows = bf16 ? rows8_bf16 : rows8_f32;
#ifdef __AVX512F__
    if (!bf16) gemm_rows = rows_f32;
#endif
#ifdef __AVX512BF16__
    if (bf16) gemm_rows = rows_bf16;
#endif
    const int64_t block13 = (int64_t)H * NB * es, block2 = (int64_t)Ip * NB * es;

    /* gather: row r of the groups is x's row of its token */
    for (int r = (int)((int64_t)rows * t / nt); r < (int)((int64_t)rows * (t + 1) / nt); r++)
        memcpy(xg + (size_t)r * H * es, (const char *)x + (size_t)token_of[r] * H * es, (size_t)H * es);
#pragma omp barrier
    /* phase 1: h = SiLU(x . gate^T) * (x . up^T), a block of 32 columns at a time */
    char *gate_tile = p->tiles + 2 * tile_bytes * t, *up_tile = gate_tile + tile_bytes;
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
                const float w =
                    weights_bf16 ? bf16_to_f32(((const uint16_t *)weights)[pair]) : ((const float *)weights)[pair];
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
                const float w =
                    weights_bf16 ? bf16_to_f32(((const uint16_t *)weights)[pair]) : ((const float *)weights)[pair];
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
#endif

#endif
