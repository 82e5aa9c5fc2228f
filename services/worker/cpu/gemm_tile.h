/* The tile kernel of the packed GEMM (gemm.c's layout and arithmetic, described there), shared by
 * gemm.c (one linear layer per call) and models/c_step/packed_step.c (a whole decode step on the
 * same packed weights), so both compute every output alike. */
#ifndef MYVLLM_GEMM_TILE_H
#define MYVLLM_GEMM_TILE_H

#include <stdint.h>

#include "vec.h"

#define NB 32 /* output columns per block */
#define MT 12 /* rows of x per tile */

/* Whether this build has the tiles for fp32 (bf16 = 0) or bf16 (bf16 = 1). */
static inline int tile_available(int bf16) {
#ifdef __AVX512BF16__
    (void)bf16;
    return 1;
#elif defined(__AVX512F__)
    return !bf16;
#else
    (void)bf16;
    return 0;
#endif
}

#ifdef __AVX512F__
/* y[m0 .. m0 + mt, block b] for one tile of rows; `next` (or NULL): the block to prefetch. x, y,
 * block and bias in the layer's dtype (bf16: fp32 accumulators, one rounding at the end). */
static inline __attribute__((always_inline)) void tile(const void *restrict x, const void *restrict block,
                                                       const void *restrict bias, void *restrict y, int K, int N,
                                                       int b, int m0, const int mt, const char *next, const int bf16) {
    __m512 a0[MT], a1[MT];
    for (int m = 0; m < mt; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    /* k steps of 128 bytes of the block: one k (fp32) or a pair (bf16) */
    const int steps = bf16 ? K / 2 : K;
    for (int k = 0; k < steps; k++) {
        if (next) { /* the next block's k-th 128 bytes: all of it by the end of this tile */
            _mm_prefetch(next + (int64_t)k * 128, _MM_HINT_T0);
            _mm_prefetch(next + (int64_t)k * 128 + 64, _MM_HINT_T0);
        }
        const char *w = (const char *)block + (int64_t)k * 128;
        if (bf16) {
#ifdef __AVX512BF16__
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 64);
            const uint32_t *xr = (const uint32_t *)x + (int64_t)m0 * (K / 2) + k; /* pairs of x values */
            for (int m = 0; m < mt; m++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[(int64_t)m * (K / 2)]);
                a0[m] = _mm512_dpbf16_ps(a0[m], xv, w0);
                a1[m] = _mm512_dpbf16_ps(a1[m], xv, w1);
            }
#endif
        } else {
            const __m512 w0 = _mm512_loadu_ps((const float *)w), w1 = _mm512_loadu_ps((const float *)w + 16);
            const float *xr = (const float *)x + (int64_t)m0 * K + k;
            for (int m = 0; m < mt; m++) {
                const __m512 xv = _mm512_set1_ps(xr[(int64_t)m * K]);
                a0[m] = _mm512_fmadd_ps(xv, w0, a0[m]);
                a1[m] = _mm512_fmadd_ps(xv, w1, a1[m]);
            }
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias && bf16) {
        b0 = (__m512)load16_bf16((const uint16_t *)bias + b * NB);
        b1 = (__m512)load16_bf16((const uint16_t *)bias + b * NB + 16);
    } else if (bias) {
        b0 = _mm512_loadu_ps((const float *)bias + b * NB);
        b1 = _mm512_loadu_ps((const float *)bias + b * NB + 16);
    }
    for (int m = 0; m < mt; m++) {
        const int64_t at = (int64_t)(m0 + m) * N + b * NB;
        const __m512 y0 = bias ? _mm512_add_ps(a0[m], b0) : a0[m], y1 = bias ? _mm512_add_ps(a1[m], b1) : a1[m];
        if (bf16) {
            store16_bf16((uint16_t *)y + at, (f32x16)y0);
            store16_bf16((uint16_t *)y + at + 16, (f32x16)y1);
        } else {
            _mm512_storeu_ps((float *)y + at, y0);
            _mm512_storeu_ps((float *)y + at + 16, y1);
        }
    }
}

/* Rows [m0, m1) of block b: full tiles, then one of the 1-11 rows left (a copy per count, so
 * the accumulators stay in registers). */
static inline __attribute__((always_inline)) void rows_of_block(const void *x, const void *packed, const void *bias,
                                                                void *y, int K, int N, int b, int m0, int m1,
                                                                const char *next, const int bf16) {
    const void *block = (const char *)packed + (int64_t)b * K * NB * (bf16 ? 2 : 4);
    for (; m0 + MT <= m1; m0 += MT, next = NULL) tile(x, block, bias, y, K, N, b, m0, MT, next, bf16);
    switch (m1 - m0) {
#define REST(R) \
    case R: tile(x, block, bias, y, K, N, b, m0, R, next, bf16); break;
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
    }
}

/* rows_of_block for each dtype, not inlined (one copy each, called per unit) */
static void rows_f32(const void *x, const void *packed, const void *bias, void *y, int K, int N, int b, int m0,
                     int m1, const char *next) {
    rows_of_block(x, packed, bias, y, K, N, b, m0, m1, next, 0);
}

#ifdef __AVX512BF16__
static void rows_bf16(const void *x, const void *packed, const void *bias, void *y, int K, int N, int b, int m0,
                      int m1, const char *next) {
    rows_of_block(x, packed, bias, y, K, N, b, m0, m1, next, 1);
}
#endif

#define M_CHUNK 96 /* rows per unit of work: a unit is (block, chunk of rows) */

/* Thread t of n's share of y = x . W^T (+ bias) (gemm()'s arguments): units (block, chunk of
 * M_CHUNK rows) in block-major order, a contiguous range per thread, so each thread's next unit
 * is usually the next block, which it prefetches. */
static inline void gemm_share(const void *x, const void *packed, const void *bias, void *y, int M, int K, int N,
                              int bf16, int t, int n) {
    void (*rows)(const void *, const void *, const void *, void *, int, int, int, int, int, const char *) = rows_f32;
#ifdef __AVX512BF16__
    if (bf16) rows = rows_bf16;
#endif
    const int chunks = (M + M_CHUNK - 1) / M_CHUNK, units = N / NB * chunks;
    const int64_t block_bytes = (int64_t)K * NB * (bf16 ? 2 : 4);
    const int u0 = (int)((int64_t)units * t / n), u1 = (int)((int64_t)units * (t + 1) / n);
    for (int u = u0; u < u1; u++) {
        const int b = u / chunks, c = u % chunks;
        const int m0 = c * M_CHUNK, m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
        /* the next unit's block, when it is another one */
        const char *next = u + 1 < u1 && (u + 1) / chunks != b ? (const char *)packed + (b + 1) * block_bytes : NULL;
        rows(x, packed, bias, y, K, N, b, m0, m1, next);
    }
}
#endif

#endif
