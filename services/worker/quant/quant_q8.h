/* The integer-product path of quant_gemm.c for Q4_0, Q4_1 and Q8_0 weights, with AVX2 or better:
 * each 32-value block of a row of x is quantized to 16 bits held as two int8 parts (q8_row:
 * x ~ dx * (254 * hi + lo), hi = round(x / (254 dx)) within [-127, 127], lo the rounded remainder,
 * also within [-127, 127]), and a weight block's dot product with it is two sums of 32 uint8/int8
 * products, exact in int32, by AVX-512 VNNI's vpdpbusd or AVX2's vpmaddubsw + vpmaddwd, joined in
 * int32 as 254 * sum(w hi) + sum(w lo); then one fp32 multiply-add per block by d * dx.
 *
 * Why two parts, not llama.cpp's one: one int8 part moves each value by up to 1/254 of its block's
 * largest, and over SmolLM2's 30 layers that moved the logprobs of greedy tokens by up to 0.24 from
 * the same weights' exact products and changed the greedy text of 4 of 16 short prompts within 8
 * tokens; with the second part each value moves by at most 1/64516 of the block's largest and the
 * logprobs stay within 1e-2. The products cost twice the integer multiplies; the weights, which a
 * decode step waits on, are read and unpacked once.
 *
 * The offsets of Q4_0 (q - 8) and Q4_1 (+ m) are taken out of the integer sums: Q4_0 subtracts
 * 8 * dx * sum(qx) per block, Q4_1 adds m * dx * sum(qx) (qx = 254 hi + lo). Both offsets multiply
 * the quantized x, so a block's product is exactly that of the dequantized weights with dx * qx.
 *
 * Error: x is replaced by dx * qx, off by at most dx / 2 per value (dx = max|x| / 32258), so each
 * block adds up to dx / 2 * sum |w| on top of the fp32 rounding of the per-block products and sums.
 */
#ifndef MYVLLM_QUANT_Q8_H
#define MYVLLM_QUANT_Q8_H

#include <math.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "quant_f32.h" /* qt_store_out */

/* The weight of the high part: x ~ dx * (Q8_HI * hi + lo). */
#define Q8_HI 254

/* A row of x quantized by 32-value blocks: K int8 high parts q, K int8 low parts lo and, per block,
 * dx, dx * sum(qx) (Q4_1's offset), 8 * dx * sum(qx) (Q4_0's) and sum(qx) (quant_x16.h's integer
 * offsets), qx = Q8_HI * q + lo. */
typedef struct {
    int8_t *q, *lo;
    float *dx, *sx, *off8;
    int32_t *isum;
} q8_row_t;

/* Bytes one quantized row of K values takes in the scratch (a multiple of 64). */
static inline int64_t q8_row_bytes(int K) { return (2 * (int64_t)K + 4 * 4 * (K / QK) + 63) / 64 * 64; }

static inline q8_row_t q8_row_at(void *base, int K) {
    const int nb = K / QK;
    float *f = (float *)base;
    int8_t *q = (int8_t *)(f + 4 * nb);
    q8_row_t r = {q, q + K, f, f + nb, f + 2 * nb, (int32_t *)(f + 3 * nb)};
    return r;
}

static inline void q8_quantize_row(const float *x, int K, q8_row_t r) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same values as the loop below */
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int b = 0; b < K / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float dx = amax / (127.f * Q8_HI), dh = amax / 127.f;
        const __m512 idh = _mm512_set1_ps(dh != 0.f ? 1.f / dh : 0.f), idx = _mm512_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512 xv = h ? x1 : x0;
            const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(xv, idh));
            /* x - dx * (254 hi) in one rounding: the remainder lo rounds is that of dx * qx itself */
            const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(hi, _mm512_set1_epi32(Q8_HI))),
                                                 _mm512_set1_ps(dx), xv);
            const __m512i lo = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(rest, idx))));
            _mm_storeu_si128((__m128i *)(r.q + b * QK + 16 * h), _mm512_cvtsepi32_epi8(hi));
            _mm_storeu_si128((__m128i *)(r.lo + b * QK + 16 * h), _mm512_cvtsepi32_epi8(lo));
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_mullo_epi32(hi, _mm512_set1_epi32(Q8_HI)), lo));
        }
        const int isum = _mm512_reduce_add_epi32(sum);
        r.dx[b] = dx;
        r.sx[b] = dx * (float)isum;
        r.off8[b] = 8.f * dx * (float)isum;
        r.isum[b] = isum;
    }
    return;
#endif
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float dx = amax / (127.f * Q8_HI), dh = amax / 127.f;
        const float idh = dh != 0.f ? 1.f / dh : 0.f, idx = dx != 0.f ? 1.f / dx : 0.f;
        int isum = 0;
        for (int i = 0; i < QK; i++) {
            const int hi = (int)lrintf(xb[i] * idh); /* within [-127, 127] */
            int lo = (int)lrintf(fmaf(-(float)(Q8_HI * hi), dx, xb[i]) * idx); /* [-127, 127] but for rounding */
            lo = lo > 127 ? 127 : lo < -127 ? -127 : lo;
            r.q[b * QK + i] = (int8_t)hi;
            r.lo[b * QK + i] = (int8_t)lo;
            isum += Q8_HI * hi + lo;
        }
        r.dx[b] = dx;
        r.sx[b] = dx * (float)isum;
        r.off8[b] = 8.f * dx * (float)isum;
        r.isum[b] = isum;
    }
}

#ifdef __AVX2__
/* 8 int32 sums of 4 products each of u (unsigned) by s (signed) bytes: u <= 128 and |s| <= 127, so
 * vpmaddubsw's int16 pair sums never saturate. */
static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#define Q8_PREFETCH 1024

/* Weight rows n0 .. n1 of `type` against R (1 .. 4) quantized rows of x; y row stride N. */
static inline __attribute__((always_inline)) void q8_gemv_rows(int type, const q8_row_t *xq, const uint8_t *w,
                                                               int64_t row_bytes, int K, int N, int n0, int n1,
                                                               const float *bias, void *y, int bf16, const int R) {
    const int nb = K / QK, bytes = qt_block_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(0x0f), hi_weight = _mm256_set1_epi32(Q8_HI);
    for (int n = n0; n < n1; n++) {
        const uint8_t *blk = w + (int64_t)n * row_bytes;
        /* two accumulators per row (even and odd blocks) against the FMA latency */
        __m256 acc[4][2];
        float off[4] = {0.f, 0.f, 0.f, 0.f};
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++, blk += bytes) {
            /* the bytes Q8_PREFETCH ahead (the next rows): a row is a few hundred bytes, too short
             * a stream for the hardware prefetcher to run ahead of on a cold matrix */
            _mm_prefetch((const char *)blk + Q8_PREFETCH, _MM_HINT_T0);
            const float d = fp16_to_f32(blk);
            __m256i u, s[4], l[4];
            if (type == QT_Q8_0) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u = _mm256_sign_epi8(q, q); /* |q| as unsigned (-128 -> 128) */
                for (int r = 0; r < R; r++) {
                    s[r] = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq[r].q + b * QK)), q);
                    l[r] = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq[r].lo + b * QK)), q);
                }
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == QT_Q4_1 ? 4 : 2)));
                u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                for (int r = 0; r < R; r++) {
                    s[r] = _mm256_loadu_si256((const __m256i *)(xq[r].q + b * QK));
                    l[r] = _mm256_loadu_si256((const __m256i *)(xq[r].lo + b * QK));
                }
            }
            const float m = type == QT_Q4_1 ? fp16_to_f32(blk + 2) : 0.f;
            for (int r = 0; r < R; r++) {
                const __m256i qs = _mm256_add_epi32(_mm256_mullo_epi32(dot_u8s8(u, s[r]), hi_weight), dot_u8s8(u, l[r]));
                const __m256 p = _mm256_cvtepi32_ps(qs);
                acc[r][b & 1] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * xq[r].dx[b]), acc[r][b & 1]);
                if (type == QT_Q4_1)
                    off[r] += m * xq[r].sx[b];
                else if (type == QT_Q4_0)
                    off[r] -= d * xq[r].off8[b];
            }
        }
        for (int r = 0; r < R; r++)
            qt_store_out(y, (int64_t)r * N + n, hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + off[r], bias, n, bf16);
    }
}

static inline void q8_gemv_any(int type, const q8_row_t *xq, const uint8_t *w, int64_t row_bytes, int K, int N, int n0,
                               int n1, const float *bias, void *y, int bf16, int R) {
#define Q8_CASE(T, RR) q8_gemv_rows(T, xq, w, row_bytes, K, N, n0, n1, bias, y, bf16, RR)
#define Q8_TYPE(T)                      \
    switch (R) {                        \
    case 1: Q8_CASE(T, 1); break;       \
    case 2: Q8_CASE(T, 2); break;       \
    case 3: Q8_CASE(T, 3); break;       \
    default: Q8_CASE(T, 4); break;      \
    }
    if (type == QT_Q4_0) {
        Q8_TYPE(QT_Q4_0)
    } else if (type == QT_Q4_1) {
        Q8_TYPE(QT_Q4_1)
    } else {
        Q8_TYPE(QT_Q8_0)
    }
#undef Q8_TYPE
#undef Q8_CASE
}
#endif

/* Whether the int8 path covers `type` in this build. */
static inline int q8_covers(int type) {
#ifdef __AVX2__
    return type == QT_Q4_0 || type == QT_Q4_1 || type == QT_Q8_0;
#else
    (void)type;
    return 0;
#endif
}

#endif
