/* The int8 decode path of quant_gemm.c (llama.cpp's scheme) for Q4_0, Q4_1 and Q8_0 weights, with
 * AVX2 or better: each 32-value block of a row of x is quantized to int8 (q8_row: dx = max|x| /
 * 127, qx = round(x / dx)), and a weight block's dot product with it is a sum of 32 int8 x int8
 * (or uint8 nibble x int8) products, exact in int32, by AVX-512 VNNI's vpdpbusd or AVX2's
 * vpmaddubsw + vpmaddwd; then one fp32 multiply-add per block by d * dx.
 *
 * The offsets of Q4_0 (q - 8) and Q4_1 (+ m) are taken out of the integer sums: Q4_0 subtracts
 * 8 * dx * sum(qx) per block, Q4_1 adds m * dx * sum(qx) (llama.cpp's Q8_1 sum). Both offsets
 * multiply the quantized x, so a block's product is exactly that of the dequantized weights with
 * dx * qx, and x's rounding error meets the weights themselves: taking Q4_1's offset on the exact
 * sum(x) instead leaves that error on d * q, which runs from 0 to 15 d where the weights straddle
 * 0, and cost SmolLM2's Q4_1 file 1.6% of perplexity (18.65 against 18.37 exact; this way 18.45).
 *
 * Error: x is replaced by dx * qx, off by at most dx / 2 per value, so each block adds up to
 * dx / 2 * sum |w| on top of the fp32 rounding of the per-block products and sums.
 */
#ifndef MYVLLM_QUANT_Q8_H
#define MYVLLM_QUANT_Q8_H

#include <math.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "quant_f32.h" /* qt_store_out */

/* A row of x quantized by 32-value blocks: K int8 values and, per block, dx, dx * sum(qx) (Q4_1's
 * offset), 8 * dx * sum(qx) (Q4_0's) and sum(qx) (quant_x16.h's integer offsets). */
typedef struct {
    int8_t *q;
    float *dx, *sx, *off8;
    int32_t *isum;
} q8_row_t;

/* Bytes one quantized row of K values takes in the scratch (a multiple of 64). */
static inline int64_t q8_row_bytes(int K) { return ((int64_t)K + 4 * 4 * (K / QK) + 63) / 64 * 64; }

static inline q8_row_t q8_row_at(void *base, int K) {
    const int nb = K / QK;
    float *f = (float *)base;
    q8_row_t r = {(int8_t *)(f + 4 * nb), f, f + nb, f + 2 * nb, (int32_t *)(f + 3 * nb)};
    return r;
}

static inline void q8_quantize_row(const float *x, int K, q8_row_t r) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same values as the loop below */
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int b = 0; b < K / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(r.q + b * QK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(r.q + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
        const int isum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
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
        const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
        int isum = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)lrintf(xb[i] * id); /* within [-127, 127] */
            r.q[b * QK + i] = (int8_t)q;
            isum += q;
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
    const __m256i low4 = _mm256_set1_epi8(0x0f);
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
            __m256i u, s[4];
            if (type == QT_Q8_0) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u = _mm256_sign_epi8(q, q); /* |q| as unsigned (-128 -> 128) */
                for (int r = 0; r < R; r++)
                    s[r] = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq[r].q + b * QK)), q);
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == QT_Q4_1 ? 4 : 2)));
                u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                for (int r = 0; r < R; r++) s[r] = _mm256_loadu_si256((const __m256i *)(xq[r].q + b * QK));
            }
            const float m = type == QT_Q4_1 ? fp16_to_f32(blk + 2) : 0.f;
            for (int r = 0; r < R; r++) {
                const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, s[r]));
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
