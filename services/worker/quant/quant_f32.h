/* The fp32 paths of quant_gemm.c: weights dequantized exactly (quant_blocks.h) into a small buffer
 * in L1 or L2, then multiplied with fp32 activations by fused multiply-adds. The products are those
 * of x with the exact dequantized weights, so each output's error is that of an fp32 dot product.
 *
 * - qf_gemv_rows: a few rows of x (1 .. GEMV_ROWS) against weight rows n0 .. n1: each weight row is
 *   dequantized a chunk of CHUNK values at a time onto the stack and multiplied with every row of
 *   x while the chunk sits in L1: the weights are read once per GEMV_ROWS rows of x.
 * - tile_rows: many rows of x against a group of NR weight rows: the group is dequantized once
 *   into a [K][NR] tile (per thread, in the caller's scratch) and every row of x runs over it, MT
 *   rows at a time with MT x NR accumulators in registers (gemm_tile.h's scheme with NR = 16).
 */
#ifndef MYVLLM_QUANT_F32_H
#define MYVLLM_QUANT_F32_H

#include <stdint.h>

#include "quant_blocks.h"
#include "vec.h"

/* 16 fp32 lanes at every level: one zmm with AVX-512, two ymm with AVX2, four xmm below. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) v16f v16_load(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a * b + c, fused (one rounding) where the CPU has FMA: the build turns contraction off for the
 * exact dequantization, so the fused product is asked for explicitly. */
static inline __attribute__((always_inline)) v16f v16_fma(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    union { v16f v; __m256 h[2]; } ua = {a}, ub = {b}, uc = {c}, r;
    r.h[0] = _mm256_fmadd_ps(ua.h[0], ub.h[0], uc.h[0]);
    r.h[1] = _mm256_fmadd_ps(ua.h[1], ub.h[1], uc.h[1]);
    return r.v;
#else
    return a * b + c;
#endif
}

static inline float v16_sum(v16f v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* One output value: the sum, plus the bias, stored as fp32 or (bf16) rounded once to bf16. */
static inline void qt_store_out(void *y, int64_t at, float v, const float *bias, int n, int bf16) {
    if (bias) v += bias[n];
    if (bf16)
        ((uint16_t *)y)[at] = f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

#define CHUNK 256   /* weight values dequantized at a time by qf_gemv_rows (a multiple of every block) */
#define GEMV_ROWS 4 /* rows of x per pass over the weights in qf_gemv_rows */

/* y[0 .. R, n0 .. n1) for R rows of x (fp32, row stride ldx) and weight rows n0 .. n1 of `w`
 * (row_bytes bytes each); y has row stride N. */
static inline __attribute__((always_inline)) void qf_gemv_rows(int type, const float *x, int64_t ldx,
                                                            const uint8_t *w, int64_t row_bytes, int K, int N,
                                                            int n0, int n1, const float *bias, void *y, int bf16,
                                                            const int R) {
    float buf[CHUNK] __attribute__((aligned(64)));
    const int per_block = qt_block_values(type), bytes = qt_block_bytes(type);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        /* two accumulators per row of x: two independent chains of FMAs */
        v16f acc[GEMV_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (v16f){0};
        for (int k0 = 0; k0 < K; k0 += CHUNK) {
            const int count = K - k0 < CHUNK ? K - k0 : CHUNK; /* a multiple of 32 */
            dequant_blocks(type, row + (int64_t)(k0 / per_block) * bytes, count / per_block, buf);
            for (int i = 0; i < count; i += 32) {
                const v16f w0 = v16_load(buf + i), w1 = v16_load(buf + i + 16);
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * ldx + k0 + i;
                    acc[r][0] = v16_fma(w0, v16_load(xr), acc[r][0]);
                    acc[r][1] = v16_fma(w1, v16_load(xr + 16), acc[r][1]);
                }
            }
        }
        for (int r = 0; r < R; r++) qt_store_out(y, (int64_t)r * N + n, v16_sum(acc[r][0] + acc[r][1]), bias, n, bf16);
    }
}

/* qf_gemv_rows for any R up to GEMV_ROWS (a copy per count, so the accumulators stay in registers) */
static inline void qf_gemv_any(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int K, int N,
                            int n0, int n1, const float *bias, void *y, int bf16, int R) {
    switch (R) {
    case 1: qf_gemv_rows(type, x, ldx, w, row_bytes, K, N, n0, n1, bias, y, bf16, 1); break;
    case 2: qf_gemv_rows(type, x, ldx, w, row_bytes, K, N, n0, n1, bias, y, bf16, 2); break;
    case 3: qf_gemv_rows(type, x, ldx, w, row_bytes, K, N, n0, n1, bias, y, bf16, 3); break;
    default: qf_gemv_rows(type, x, ldx, w, row_bytes, K, N, n0, n1, bias, y, bf16, 4); break;
    }
}

/* Rows of x from which products take the tiles (fewer: the row GEMVs, qf_gemv_rows or quant_q8.h's) */
#define TILE_MIN_ROWS 8
#define NR 16 /* weight rows per tile: one vector of outputs */
#ifdef __AVX512F__
#define MT 12 /* rows of x per pass over a tile: 12 zmm accumulators */
#else
#define MT 6 /* 12 ymm accumulators with AVX2 */
#endif

/* Weight rows n0 .. n0 + rows (rows <= NR) dequantized into tile[K][NR] (zeros past `rows`); `row`
 * holds K floats of scratch. */
static inline void fill_tile(int type, const uint8_t *w, int64_t row_bytes, int K, int n0, int rows, float *tile,
                             float *row) {
    for (int r = 0; r < NR; r++) {
        if (r < rows) dequant_blocks(type, w + (int64_t)(n0 + r) * row_bytes, K / qt_block_values(type), row);
        for (int k = 0; k < K; k++) tile[(int64_t)k * NR + r] = r < rows ? row[k] : 0.f;
    }
}

/* y[m0 .. m0 + mt, n0 .. n0 + rows) from the tile: acc[m] = sum_k x[m0 + m][k] * tile[k]. */
static inline __attribute__((always_inline)) void tile_pass(const float *x, int K, const float *tile, int m0,
                                                            const int mt, int n0, int rows, int N,
                                                            const float *bias, void *y, int bf16) {
    v16f acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = (v16f){0};
    const float *xr = x + (int64_t)m0 * K;
    for (int k = 0; k < K; k++) {
        const v16f wv = v16_load(tile + (int64_t)k * NR);
        for (int m = 0; m < mt; m++) acc[m] = v16_fma((v16f){0} + xr[(int64_t)m * K + k], wv, acc[m]);
    }
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) qt_store_out(y, (int64_t)(m0 + m) * N + n0 + r, acc[m][r], bias, n0 + r, bf16);
}

/* All M rows of x against the tile of weight rows n0 .. n0 + rows. */
static inline void tile_rows(const float *x, int M, int K, const float *tile, int n0, int rows, int N,
                             const float *bias, void *y, int bf16) {
    int m0 = 0;
    for (; m0 + MT <= M; m0 += MT) tile_pass(x, K, tile, m0, MT, n0, rows, N, bias, y, bf16);
    switch (M - m0) {
#define REST(R) \
    case R: tile_pass(x, K, tile, m0, R, n0, rows, N, bias, y, bf16); break;
        REST(1) REST(2) REST(3) REST(4) REST(5)
#if MT > 6
        REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#endif
#undef REST
    default: break;
    }
}

#endif
