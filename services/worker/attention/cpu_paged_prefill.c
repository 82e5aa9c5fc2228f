/* Paged prefill attention for CPUs: every prefill chunk of a step at once, causal, GQA, K/V read
 * in place from the paged cache (the chunk's own K/V are stored before attention runs), fp32 or
 * bf16 cache and queries, fp32 math with an online softmax (flash attention's order).
 *
 * Built at first use by cpu_backend.py through cpu/cbuild.py (a fixed x86-64 level, -fopenmp on
 * torch's own libgomp threads).
 *
 * Why: torch's SDPA ran these shapes (prompts of 32-512 tokens, 64-wide heads) at 50-90 GFLOPS on
 * two cores, about a fifth of the attention's time per step spent on overhead. Here a unit of
 * work is (prefill, KV head, tile of QT query tokens): the tile's G * QT query rows (every query
 * head of the KV head) are scored against KT = 32 cached tokens at a time as a small matrix
 * product (keys transposed into L1 8 x 8 at a time in registers, each query value broadcast
 * across 16 keys: 8 independent accumulators), and the keys' values are accumulated with each
 * output row held in registers. 32 keys per step rather than 16 halve the online softmax's
 * per-row bookkeeping (max, rescale of the output rows); 64 wasted more on masked keys than it
 * saved (6 x 272 tokens, fp32: 16 keys 127, 32 keys 128-132, 64 keys 116 GFLOPS; at 8 x 128 tokens
 * 114 / 115 / 98).
 * Units go to threads dynamically (later tiles see more keys).
 */
#include <stdlib.h>

#include "vec.h"
#include "threads.h"

#define QT 16 /* query tokens per tile */
#define KT 32 /* keys per step (a multiple of 16) */
#define NV (KT / 8) /* vectors per row of scores */

typedef struct {
    const void *q;             /* [T, H, D] rows q_stride elements apart */
    const void *k_cache;       /* [num_blocks, BS, KVH, D] */
    const void *v_cache;
    const int32_t *block_table; /* [B, bt_stride] */
    void *out;                 /* [T, H, D] contiguous */
    int64_t q_stride, bt_stride;
    int H, KVH, D, BS, bf16;
    float scale;
} Args;

static inline float hmax8(f32x8 v) {
#ifdef __AVX__
    __m256 x = _mm256_max_ps((__m256)v, _mm256_permute2f128_ps((__m256)v, (__m256)v, 1));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0x4e));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0xb1));
    return _mm256_cvtss_f32(x);
#else
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

static inline f32x8 max8(f32x8 a, f32x8 b) {
#ifdef __AVX__
    return (f32x8)_mm256_max_ps((__m256)a, (__m256)b);
#else
    const i32x8 gt = a > b;
    return (f32x8)(((i32x8)a & gt) | ((i32x8)b & ~gt));
#endif
}


/* One unit: prefill with block-table row `bt`, query tokens [q0, q0 + QT) of its chunk (absolute
 * position ctx + i), query heads of KV head kh. Scratch: qs [R, D], kt [D, KT], vt [KT, D],
 * s [R, KT], o [R, D], m [R], l [R], corr_row [R] with R = G * QT. */
static inline __attribute__((always_inline)) void prefill_unit(const Args *a, const int32_t *bt, int q_row0,
                                                               int q_len, int ctx, int q0, int kh, float *restrict qs,
                                                               float *restrict kt, float *restrict vt,
                                                               float *restrict s, float *restrict o,
                                                               float *restrict m, float *restrict l,
                                                               float *restrict corr_row, const int D) {
    const int G = a->H / a->KVH, R = G * QT, bf16 = a->bf16;
    const int64_t krow = (int64_t)a->KVH * D; /* elements per cached token */
    const int nq = q_len - q0 < QT ? q_len - q0 : QT;
    /* the tile's query rows (row r = token i * G + head g), scaled; padding rows zero */
    for (int i = 0; i < QT; i++) {
        for (int g = 0; g < G; g++) {
            float *dst = qs + (int64_t)(i * G + g) * D;
            if (i < nq) {
                const int64_t src = (int64_t)(q_row0 + q0 + i) * a->q_stride + (int64_t)(kh * G + g) * D;
                for (int d = 0; d < D; d += 8) store8(dst + d, load8_any(a->q, src + d, bf16) * a->scale);
            } else {
                memset(dst, 0, sizeof(float) * (size_t)D);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * (size_t)R * D);
    const int last_pos = ctx + q0 + nq - 1; /* the tile's last query sees keys [0, last_pos] */
    for (int j0 = 0; j0 <= last_pos; j0 += KT) {
        const int nk = last_pos + 1 - j0 < KT ? last_pos + 1 - j0 : KT;
        /* keys transposed [D, KT] (8 keys x 8 dims at a time, in registers) and values [KT, D],
         * fp32; missing keys zero (masked below) */
        for (int t0 = 0; t0 < KT; t0 += 8) {
            int64_t at[8];
            for (int t = 0; t < 8; t++) {
                const int j = j0 + t0 + t;
                at[t] = t0 + t < nk ? ((int64_t)bt[j / a->BS] * a->BS + j % a->BS) * krow + (int64_t)kh * D : -1;
            }
            for (int d = 0; d < D; d += 8) {
                f32x8 rows[8];
                for (int t = 0; t < 8; t++) rows[t] = at[t] >= 0 ? load8_any(a->k_cache, at[t] + d, bf16) : (f32x8){0};
                transpose8x8(rows);
                for (int e = 0; e < 8; e++) store8(kt + (int64_t)(d + e) * KT + t0, rows[e]);
            }
            for (int t = 0; t < 8; t++) {
                float *dst = vt + (int64_t)(t0 + t) * D;
                if (at[t] >= 0)
                    for (int d = 0; d < D; d += 8) store8(dst + d, load8_any(a->v_cache, at[t] + d, bf16));
                else
                    memset(dst, 0, sizeof(float) * (size_t)D);
            }
        }
        /* s = qs . kt, 4 rows x 16 keys at a time */
        for (int k0 = 0; k0 < KT; k0 += 16)
            for (int r = 0; r < R; r += 4) {
                f32x8 acc[4][2] = {{{0}}};
                for (int d = 0; d < D; d++) {
                    const f32x8 ka = load8(kt + (int64_t)d * KT + k0), kb = load8(kt + (int64_t)d * KT + k0 + 8);
                    for (int u = 0; u < 4; u++) {
                        const f32x8 qv = broadcast8(qs + (int64_t)(r + u) * D + d);
                        acc[u][0] += qv * ka;
                        acc[u][1] += qv * kb;
                    }
                }
                for (int u = 0; u < 4; u++) {
                    store8(s + (int64_t)(r + u) * KT + k0, acc[u][0]);
                    store8(s + (int64_t)(r + u) * KT + k0 + 8, acc[u][1]);
                }
            }
        /* causal mask, online softmax, o = o * correction + p . v. Masking is needed only where
         * some key of the tile lies past some row's position (the diagonal tiles, the last one). */
        const int may_mask = nk < KT || j0 + KT - 1 > ctx + q0;
        const i32x8 key0 = (i32x8){0, 1, 2, 3, 4, 5, 6, 7} + j0;
        const f32x8 neg_inf = (f32x8){0} - INFINITY;
        for (int r = 0; r < R; r++) {
            const int i = r / G;
            float *sr = s + (int64_t)r * KT;
            corr_row[r] = 1.f; /* a row skipped below keeps its output: p = 0, no rescaling */
            if (i >= nq) {
                memset(sr, 0, sizeof(float) * KT);
                continue;
            }
            f32x8 sv[NV];
            i32x8 out[NV]; /* all-ones lanes: keys this row must not see */
            for (int c = 0; c < NV; c++) {
                sv[c] = load8(sr + 8 * c);
                out[c] = (i32x8){0};
            }
            if (may_mask) {
                const int pos = ctx + q0 + i, lim = pos < j0 + nk - 1 ? pos : j0 + nk - 1;
                for (int c = 0; c < NV; c++) {
                    out[c] = key0 + 8 * c > lim;
                    sv[c] = (f32x8)(((i32x8)sv[c] & ~out[c]) | ((i32x8)neg_inf & out[c]));
                }
            }
            f32x8 vmax = sv[0];
            for (int c = 1; c < NV; c++) vmax = max8(vmax, sv[c]);
            const float tile_max = hmax8(vmax);
            if (tile_max == -INFINITY) { /* every key of this tile is in the future */
                memset(sr, 0, sizeof(float) * KT);
                continue;
            }
            const float m_new = fmaxf(m[r], tile_max);
            const float corr = m[r] == -INFINITY ? 0.f : exp1(m[r] - m_new);
            /* exp8 clamps its argument, so masked lanes are zeroed after it */
            f32x8 sum = (f32x8){0};
            for (int c = 0; c < NV; c++) {
                sv[c] = (f32x8)((i32x8)exp8(sv[c] - m_new) & ~out[c]);
                sum += sv[c];
                store8(sr + 8 * c, sv[c]); /* the row's weights p, in place of its scores */
            }
            l[r] = l[r] * corr + lane_sum8(sum);
            m[r] = m_new;
            corr_row[r] = corr;
        }
        /* o = o * corr + p . v, two rows at a time over 32-lane slices (2 x 4 accumulators: each
         * value vector loaded once for both rows) */
        for (int r = 0; r < R; r += 2) {
            const float *p0 = s + (int64_t)r * KT, *p1 = p0 + KT;
            float *o0 = o + (int64_t)r * D, *o1 = o0 + D;
            for (int d0 = 0; d0 < D; d0 += 32) {
                const int w = D - d0 < 32 ? (D - d0) / 8 : 4;
                f32x8 a0[4], a1[4];
                for (int c = 0; c < w; c++) {
                    a0[c] = load8(o0 + d0 + 8 * c) * corr_row[r];
                    a1[c] = load8(o1 + d0 + 8 * c) * corr_row[r + 1];
                }
                for (int t = 0; t < nk; t++) {
                    const f32x8 w0 = broadcast8(p0 + t), w1 = broadcast8(p1 + t);
                    for (int c = 0; c < w; c++) {
                        const f32x8 vv = load8(vt + (int64_t)t * D + d0 + 8 * c);
                        a0[c] += w0 * vv;
                        a1[c] += w1 * vv;
                    }
                }
                for (int c = 0; c < w; c++) {
                    store8(o0 + d0 + 8 * c, a0[c]);
                    store8(o1 + d0 + 8 * c, a1[c]);
                }
            }
        }
    }
    /* normalise and store this tile's rows of out ([T, H, D] contiguous) */
    for (int i = 0; i < nq; i++) {
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float inv = 1.f / l[r];
            const int64_t dst = ((int64_t)(q_row0 + q0 + i) * a->H + (int64_t)(kh * G + g)) * D;
            for (int d = 0; d < D; d += 8) {
                const f32x8 v = load8(o + (int64_t)r * D + d) * inv;
                if (bf16)
                    store8_bf16((uint16_t *)a->out + dst + d, v);
                else
                    store8((float *)a->out + dst + d, v);
            }
        }
    }
}

typedef void (*UnitFn)(const Args *, const int32_t *, int, int, int, int, int, float *, float *, float *, float *,
                       float *, float *, float *, float *);

#define UNIT_FN(NAME, DD)                                                                                          \
    static void NAME(const Args *a, const int32_t *bt, int q_row0, int q_len, int ctx, int q0, int kh, float *qs,  \
                     float *kt, float *vt, float *s, float *o, float *m, float *l, float *c) {                     \
        prefill_unit(a, bt, q_row0, q_len, ctx, q0, kh, qs, kt, vt, s, o, m, l, c, DD);                           \
    }
UNIT_FN(unit_d64, 64)
UNIT_FN(unit_d128, 128)

static void unit_any(const Args *a, const int32_t *bt, int q_row0, int q_len, int ctx, int q0, int kh, float *qs,
                     float *kt, float *vt, float *s, float *o, float *m, float *l, float *c) {
    prefill_unit(a, bt, q_row0, q_len, ctx, q0, kh, qs, kt, vt, s, o, m, l, c, a->D);
}

/* P prefill chunks: chunk p is query rows [q_start[p], q_start[p] + q_len[p]) of q and out, its
 * tokens at positions ctx_len[p] ... of the request whose block-table row is rows[p]. D must be
 * a multiple of 8. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_prefill(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                  const int32_t *block_table, int64_t bt_stride, const int32_t *rows, const int32_t *q_start,
                  const int32_t *q_len, const int32_t *ctx_len, void *out, int P, int H, int KVH, int D, int BS,
                  float scale, int is_bf16, int num_threads) {
    const Args a = {q, k_cache, v_cache, block_table, out, q_stride, bt_stride, H, KVH, D, BS, is_bf16, scale};
    if (num_threads < 1) num_threads = 1;
    /* units: (chunk, KV head, tile), each chunk's later tiles (more keys) first, so that the
     * dynamic schedule ends evenly */
    int num_units = 0;
    for (int p = 0; p < P; p++) num_units += KVH * ((q_len[p] + QT - 1) / QT);
    if (num_units == 0) return 0;
    int32_t(*units)[3] = malloc(sizeof(*units) * (size_t)num_units);
    const int G = H / KVH, R = G * QT;
    const size_t per_thread = (size_t)R * D + (size_t)D * KT + (size_t)KT * D + (size_t)R * KT + (size_t)R * D +
                              3 * (size_t)R + 32;
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
    const UnitFn unit = D == 64 ? unit_d64 : D == 128 ? unit_d128 : unit_any;
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
