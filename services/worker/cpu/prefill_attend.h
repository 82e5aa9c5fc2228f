/* The unit of work of the paged prefill attention (attention/cpu_paged_prefill.c explains its
 * design): one prefill chunk's tile of QT query tokens against every key it sees, for the query
 * heads of one KV head. Shared by cpu_paged_prefill.c (the attention of a step's prefill chunks)
 * and models/c_step/packed_step.c (a whole step in one call). */
#ifndef MYVLLM_PREFILL_ATTEND_H
#define MYVLLM_PREFILL_ATTEND_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

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
} PrefillArgs;

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
static inline __attribute__((always_inline)) void prefill_unit(const PrefillArgs *a, const int32_t *bt, int q_row0,
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

typedef void (*PrefillUnitFn)(const PrefillArgs *, const int32_t *, int, int, int, int, int, float *, float *, float *, float *,
                       float *, float *, float *, float *);

#define UNIT_FN(NAME, DD)                                                                                          \
    static void NAME(const PrefillArgs *a, const int32_t *bt, int q_row0, int q_len, int ctx, int q0, int kh, float *qs,  \
                     float *kt, float *vt, float *s, float *o, float *m, float *l, float *c) {                     \
        prefill_unit(a, bt, q_row0, q_len, ctx, q0, kh, qs, kt, vt, s, o, m, l, c, DD);                           \
    }
UNIT_FN(unit_d64, 64)
UNIT_FN(unit_d128, 128)

static void unit_any(const PrefillArgs *a, const int32_t *bt, int q_row0, int q_len, int ctx, int q0, int kh, float *qs,
                     float *kt, float *vt, float *s, float *o, float *m, float *l, float *c) {
    prefill_unit(a, bt, q_row0, q_len, ctx, q0, kh, qs, kt, vt, s, o, m, l, c, a->D);
}

static inline PrefillUnitFn select_prefill_unit(int D) { return D == 64 ? unit_d64 : D == 128 ? unit_d128 : unit_any; }

/* fp32 scratch one thread needs for a unit: qs [R, D], kt [D, KT], vt [KT, D], s [R, KT], o [R, D],
 * m, l [R] and corr_row [3 R], R = G * QT. */
static inline size_t prefill_scratch_floats(int G, int D) {
    const size_t R = (size_t)G * QT;
    return R * D + (size_t)D * KT + (size_t)KT * D + R * KT + R * D + 5 * R + 32;
}

#endif
