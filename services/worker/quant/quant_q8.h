/* The quantized x of quant_gemm.c's integer products (quant_x16.h, quant_amx.h) for Q4_0, Q4_1 and
 * Q8_0 weights, with AVX2 or better: each 32-value block of a row of x is quantized to 16 bits
 * held as two int8 parts (q8_row: x ~ dx * (254 * hi + lo), hi = round(x / (254 dx)) within [-127, 127], lo the rounded remainder,
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
 * dx, dx * sum(qx) (Q4_1's offset) and sum(qx) (Q4_0's and Q8_0's integer offsets), qx = Q8_HI * q
 * + lo. */
typedef struct {
    int8_t *q, *lo;
    float *dx, *sx;
    int32_t *isum;
} q8_row_t;

/* Bytes one quantized row of K values takes in the scratch (a multiple of 64). */
static inline int64_t q8_row_bytes(int K) { return (2 * (int64_t)K + 3 * 4 * (K / QK) + 63) / 64 * 64; }

static inline q8_row_t q8_row_at(void *base, int K) {
    const int nb = K / QK;
    float *f = (float *)base;
    int8_t *q = (int8_t *)(f + 3 * nb);
    q8_row_t r = {q, q + K, f, f + nb, (int32_t *)(f + 2 * nb)};
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
        r.isum[b] = isum;
    }
}

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
