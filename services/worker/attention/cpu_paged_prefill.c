/* Paged prefill attention for CPUs: every prefill chunk of a step at once, causal, GQA, K/V read
 * in place from the paged cache (the chunk's own K/V are stored before attention runs), fp32 or
 * bf16 cache and queries, fp32 math with an online softmax (flash attention's order).
 *
 * Built at first use by cpu_backend.py through cpu/cbuild.py (a fixed x86-64 level, up to AVX-512
 * with bf16 dot products; -fopenmp on torch's own libgomp threads). The AVX-512 paths (scores and
 * values 16 lanes wide, bf16 scores by vdpbf16ps, the online softmax 16 keys and 16 rows at a
 * time) ran 6 x 272-token prefills 2.0x (fp32: 137 -> 273 GFLOPS) and 2.7x (bf16: 121 -> 323)
 * faster than the AVX2 build on the avx512_bf16 EPYC (round 8, BENCHMARKS.md).
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

/* Whether the scores use bf16 dot products (vdpbf16ps): bf16 queries and keys, pairs of
 * dimensions multiplied exactly and summed in fp32, half the instructions of widening to fp32 and
 * no conversion of the keys. The queries then stay unscaled bf16 (the scale is applied to the fp32
 * scores), so nothing is rounded that the fp32 path keeps. */
#ifdef __AVX512BF16__
#define DOT_BF16(bf16, D) ((bf16) && (D) % 16 == 0)
#else
#define DOT_BF16(bf16, D) 0
#endif

/* s[R, KT] = qs[R, D] . kt[D, KT] (fp32, queries pre-scaled). */
static inline __attribute__((always_inline)) void scores_f32(const float *restrict qs, const float *restrict kt,
                                                             float *restrict s, int R, const int D) {
#ifdef __AVX512F__
    /* 8 rows x 32 keys at a time: 16 accumulators, each query value broadcast from memory */
    for (int r = 0; r < R; r += 8) {
        __m512 acc[8][2];
        for (int u = 0; u < 8; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 ka = _mm512_loadu_ps(kt + (int64_t)d * KT), kb = _mm512_loadu_ps(kt + (int64_t)d * KT + 16);
            for (int u = 0; u < 8; u++) {
                const __m512 qv = _mm512_set1_ps(qs[(int64_t)(r + u) * D + d]);
                acc[u][0] = _mm512_fmadd_ps(qv, ka, acc[u][0]);
                acc[u][1] = _mm512_fmadd_ps(qv, kb, acc[u][1]);
            }
        }
        for (int u = 0; u < 8; u++) {
            _mm512_storeu_ps(s + (int64_t)(r + u) * KT, acc[u][0]);
            _mm512_storeu_ps(s + (int64_t)(r + u) * KT + 16, acc[u][1]);
        }
    }
#else
    /* 4 rows x 16 keys at a time */
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
#endif
}

/* s[R, KT] = scale * q[R, D] . k[D, KT] from bf16 queries ([R, D / 2] words, each row D floats
 * apart) and keys ([D / 2, KT] words), both as pairs of dimensions: 8 rows x 32 keys at a time. */
static inline __attribute__((always_inline)) void scores_bf16_pairs(const float *restrict qs,
                                                                    const float *restrict kt, float *restrict s,
                                                                    int R, const int D, float scale) {
#ifdef __AVX512BF16__
    const uint32_t *q32 = (const uint32_t *)qs, *k32 = (const uint32_t *)kt;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r += 8) {
        __m512 acc[8][2];
        for (int u = 0; u < 8; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; p++) {
            const __m512bh ka = (__m512bh)_mm512_loadu_si512(k32 + (int64_t)p * KT);
            const __m512bh kb = (__m512bh)_mm512_loadu_si512(k32 + (int64_t)p * KT + 16);
            for (int u = 0; u < 8; u++) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q32[(int64_t)(r + u) * D + p]);
                acc[u][0] = _mm512_dpbf16_ps(acc[u][0], qv, ka);
                acc[u][1] = _mm512_dpbf16_ps(acc[u][1], qv, kb);
            }
        }
        for (int u = 0; u < 8; u++) {
            _mm512_storeu_ps(s + (int64_t)(r + u) * KT, _mm512_mul_ps(acc[u][0], sc));
            _mm512_storeu_ps(s + (int64_t)(r + u) * KT + 16, _mm512_mul_ps(acc[u][1], sc));
        }
    }
#else
    (void)qs, (void)kt, (void)s, (void)R, (void)D, (void)scale;
#endif
}

/* o[R, D] = o * corr_row + p[R, KT] . vt[nk, D] (the first nk keys). */
static inline __attribute__((always_inline)) void add_values(const float *restrict p, const float *restrict vt,
                                                             const float *restrict corr_row, float *restrict o,
                                                             int R, const int D, int nk) {
#ifdef __AVX512F__
    if (D % 64 == 0) {
        /* 4 rows x 64 lanes: 16 accumulators, each value vector loaded once for four rows */
        for (int r = 0; r < R; r += 4)
            for (int d0 = 0; d0 < D; d0 += 64) {
                __m512 acc[4][4];
                for (int u = 0; u < 4; u++) {
                    const __m512 corr = _mm512_set1_ps(corr_row[r + u]);
                    for (int c = 0; c < 4; c++)
                        acc[u][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)(r + u) * D + d0 + 16 * c), corr);
                }
                for (int t = 0; t < nk; t++) {
                    __m512 vv[4];
                    for (int c = 0; c < 4; c++) vv[c] = _mm512_loadu_ps(vt + (int64_t)t * D + d0 + 16 * c);
                    for (int u = 0; u < 4; u++) {
                        const __m512 w = _mm512_set1_ps(p[(int64_t)(r + u) * KT + t]);
                        for (int c = 0; c < 4; c++) acc[u][c] = _mm512_fmadd_ps(w, vv[c], acc[u][c]);
                    }
                }
                for (int u = 0; u < 4; u++)
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (int64_t)(r + u) * D + d0 + 16 * c, acc[u][c]);
            }
        return;
    }
#endif
    /* two rows at a time over 32-lane slices (2 x 4 accumulators: each value vector loaded once
     * for both rows) */
    for (int r = 0; r < R; r += 2) {
        const float *p0 = p + (int64_t)r * KT, *p1 = p0 + KT;
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

/* The causal mask and the online softmax over one step's scores s[R, KT] (keys j0 .. j0 + nk - 1;
 * row r = query token r / G at position pos0 + r / G, rows from nq tokens on are padding): each
 * row's scores become its weights p in place, its running max m and sum l are updated, corr_row
 * gets the factor its output rows are rescaled by (a row skipped keeps its output: p = 0, factor
 * 1). Masking is needed only where some key of the step lies past some row's position (the
 * diagonal tiles, the last one). Scratch after corr_row: 2 R floats. */
static inline __attribute__((always_inline)) void online_softmax(float *restrict s, float *restrict m,
                                                                 float *restrict l, float *restrict corr_row, int R,
                                                                 int G, int nq, int pos0, int j0, int nk) {
    const int may_mask = nk < KT || j0 + KT - 1 > pos0;
#ifdef __AVX512F__
    /* 32 keys as two 16-lane vectors, the masks in mask registers; each row's old max kept and the
     * rescaling factors e^(old - new) computed for 16 rows at a time afterwards (per row, a whole
     * vector exp for one value was a tenth of the kernel) */
    float *restrict m_old = corr_row + R, *restrict row_sum = m_old + R;
    const __m512i key0 = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(j0));
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        const int i = r / G;
        float *sr = s + (int64_t)r * KT;
        m_old[r] = m[r];
        row_sum[r] = 0.f;
        if (i >= nq) {
            memset(sr, 0, sizeof(float) * KT);
            continue;
        }
        __mmask16 see0 = 0xffff, see1 = 0xffff; /* the keys this row may see */
        if (may_mask) {
            const int pos = pos0 + i;
            const __m512i lim = _mm512_set1_epi32(pos < j0 + nk - 1 ? pos : j0 + nk - 1);
            see0 = _mm512_cmple_epi32_mask(key0, lim);
            see1 = _mm512_cmple_epi32_mask(key1, lim);
        }
        const __m512 s0 = _mm512_loadu_ps(sr), s1 = _mm512_loadu_ps(sr + 16);
        const float tile_max =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(neg_inf, see0, s0), _mm512_mask_mov_ps(neg_inf, see1, s1)));
        if (tile_max == -INFINITY) { /* every key of this step is in the future */
            memset(sr, 0, sizeof(float) * KT);
            continue;
        }
        const float m_new = fmaxf(m[r], tile_max);
        const f32x16 mv = (f32x16)_mm512_set1_ps(m_new);
        /* exp16 clamps its argument, so masked lanes are zeroed after it */
        const __m512 p0 = _mm512_maskz_mov_ps(see0, (__m512)exp16((f32x16)s0 - mv));
        const __m512 p1 = _mm512_maskz_mov_ps(see1, (__m512)exp16((f32x16)s1 - mv));
        _mm512_storeu_ps(sr, p0);
        _mm512_storeu_ps(sr + 16, p1);
        row_sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        m[r] = m_new;
    }
    /* R is a multiple of 16 (G * QT); a row that has seen no key yet has l = 0 and output 0, so its
     * factor only has to be finite: 0 where the old max is -inf (also avoids -inf - -inf) */
    for (int r = 0; r < R; r += 16) {
        const __m512 old = _mm512_loadu_ps(m_old + r), cur = _mm512_loadu_ps(m + r);
        const __mmask16 had = _mm512_cmp_ps_mask(old, neg_inf, _CMP_NEQ_OQ);
        const __m512 corr = _mm512_maskz_mov_ps(had, (__m512)exp16((f32x16)_mm512_sub_ps(old, cur)));
        const __mmask16 seen = _mm512_cmp_ps_mask(cur, neg_inf, _CMP_NEQ_OQ); /* skipped rows: factor 1 */
        const __m512 factor = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), seen, corr);
        _mm512_storeu_ps(corr_row + r, factor);
        _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), factor, _mm512_loadu_ps(row_sum + r)));
    }
#else
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
            const int pos = pos0 + i, lim = pos < j0 + nk - 1 ? pos : j0 + nk - 1;
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
#endif
}

/* One unit: prefill with block-table row `bt`, query tokens [q0, q0 + QT) of its chunk (absolute
 * position ctx + i), query heads of KV head kh. Scratch: qs [R, D], kt [D, KT], vt [KT, D],
 * s [R, KT], o [R, D], m [R], l [R], corr_row [3 R] with R = G * QT. */
static inline __attribute__((always_inline)) void prefill_unit(const Args *a, const int32_t *bt, int q_row0,
                                                               int q_len, int ctx, int q0, int kh, float *restrict qs,
                                                               float *restrict kt, float *restrict vt,
                                                               float *restrict s, float *restrict o,
                                                               float *restrict m, float *restrict l,
                                                               float *restrict corr_row, const int D) {
    const int G = a->H / a->KVH, R = G * QT, bf16 = a->bf16;
    const int64_t krow = (int64_t)a->KVH * D; /* elements per cached token */
    const int nq = q_len - q0 < QT ? q_len - q0 : QT;
    /* the tile's query rows (row r = token i * G + head g), scaled; padding rows zero. With bf16
     * dot products the rows stay bf16 (pairs of values as 32-bit words, scaled in the scores). */
    for (int i = 0; i < QT; i++) {
        for (int g = 0; g < G; g++) {
            float *dst = qs + (int64_t)(i * G + g) * D;
            const int64_t src = (int64_t)(q_row0 + q0 + i) * a->q_stride + (int64_t)(kh * G + g) * D;
            if (i >= nq)
                memset(dst, 0, sizeof(float) * (size_t)D);
            else if (DOT_BF16(bf16, D))
                memcpy(dst, (const uint16_t *)a->q + src, sizeof(uint16_t) * (size_t)D);
            else
                for (int d = 0; d < D; d += 8) store8(dst + d, load8_any(a->q, src + d, bf16) * a->scale);
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
        /* keys transposed [D, KT] (8 keys x 8 dims at a time, in registers; with bf16 dot
         * products bf16 pairs [D / 2, KT]) and values [KT, D] fp32; missing keys zero (masked
         * below) */
        for (int t0 = 0; t0 < KT; t0 += 8) {
            int64_t at[8];
            for (int t = 0; t < 8; t++) {
                const int j = j0 + t0 + t;
                at[t] = t0 + t < nk ? ((int64_t)bt[j / a->BS] * a->BS + j % a->BS) * krow + (int64_t)kh * D : -1;
            }
            if (DOT_BF16(bf16, D)) {
                /* bf16 keys as [D / 2, KT] 32-bit words (a pair of dimensions each), transposed
                 * 8 x 8 words at a time: the bits move, nothing is converted */
                for (int d = 0; d < D; d += 16) {
                    f32x8 rows[8];
                    for (int t = 0; t < 8; t++)
                        rows[t] = at[t] >= 0 ? load8((const float *)((const uint16_t *)a->k_cache + at[t] + d))
                                             : (f32x8){0};
                    transpose8x8(rows);
                    for (int e = 0; e < 8; e++) store8(kt + (int64_t)(d / 2 + e) * KT + t0, rows[e]);
                }
            } else {
                for (int d = 0; d < D; d += 8) {
                    f32x8 rows[8];
                    for (int t = 0; t < 8; t++)
                        rows[t] = at[t] >= 0 ? load8_any(a->k_cache, at[t] + d, bf16) : (f32x8){0};
                    transpose8x8(rows);
                    for (int e = 0; e < 8; e++) store8(kt + (int64_t)(d + e) * KT + t0, rows[e]);
                }
            }
            for (int t = 0; t < 8; t++) {
                float *dst = vt + (int64_t)(t0 + t) * D;
                if (at[t] >= 0)
                    for (int d = 0; d < D; d += 8) store8(dst + d, load8_any(a->v_cache, at[t] + d, bf16));
                else
                    memset(dst, 0, sizeof(float) * (size_t)D);
            }
        }
        if (DOT_BF16(bf16, D))
            scores_bf16_pairs(qs, kt, s, R, D, a->scale);
        else
            scores_f32(qs, kt, s, R, D);
        online_softmax(s, m, l, corr_row, R, G, nq, ctx + q0, j0, nk);
        add_values(s, vt, corr_row, o, R, D, nk);
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
                              5 * (size_t)R + 32;
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
