/* fp32 linear layers for AVX-512 CPUs: y[M, N] = x[M, K] . W^T (+ bias) with W packed once into
 * column blocks that stream from memory.
 *
 * Built at first use by gemm.py (cpu/cbuild.py at the avx512 level; on CPUs without AVX-512 the
 * library reports itself unavailable and the layers keep oneDNN's GEMMs).
 *
 * Why: in the engine every layer's weights stream from memory at each step (30 layers' weights do
 * not fit in any cache), and oneDNN's prepacked fp32 GEMMs lost a quarter to a half of their speed
 * to that at decode sizes: with each of SmolLM2's 30 layers' own weights, 2 threads on the
 * avx512_bf16 EPYC, oneDNN did 210 / 312 / 354 GFLOPS at 16 / 32 / 64 rows, this kernel 404 / 455 /
 * 484, and both ~485 at 512-2,048 rows (round 8, BENCHMARKS.md).
 *
 * Layout: W [N, K] becomes [N / 32][K][32]: a block of 32 output columns is one contiguous stream
 * of K x 128 bytes. A tile of up to 12 rows of x is multiplied into a block with 24 accumulators
 * (12 rows x two 16-lane halves), each x value broadcast from memory: 24 FMAs per 2 weight loads
 * and 12 broadcasts. The block (72 KB at K = 576) stays in L2 for the other tiles of its rows,
 * and the next block is prefetched, two lines per k, during the first tile.
 *
 * Arithmetic: each output is one fp32 accumulator over k = 0 .. K-1 in order, fused
 * multiply-adds, plus the bias at the end.
 */
#include <stdint.h>
#include <string.h>

#include "threads.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NB 32      /* output columns per block */
#define MT 12      /* rows of x per tile */
#define M_CHUNK 96 /* rows per unit of work: a unit is (block, chunk of rows) */

int gemm_available(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* W [N, K] row-major into [N / NB][K][NB]; N a multiple of NB. */
void gemm_pack(const float *W, float *packed, int N, int K) {
    for (int b = 0; b < N / NB; b++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NB; j++)
                packed[((int64_t)b * K + k) * NB + j] = W[(int64_t)(b * NB + j) * K + k];
}

#ifdef __AVX512F__
/* y[m0 .. m0 + mt, block b] for one tile of rows; `next` (or NULL): the block to prefetch. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const float *restrict block,
                                                       const float *restrict bias, float *restrict y, int K, int N,
                                                       int b, int m0, const int mt, const char *next) {
    __m512 a0[MT], a1[MT];
    for (int m = 0; m < mt; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    const float *restrict xr = x + (int64_t)m0 * K;
    for (int k = 0; k < K; k++) {
        if (next) { /* the next block's k-th 128 bytes: all of it by the end of this tile */
            _mm_prefetch(next + (int64_t)k * NB * 4, _MM_HINT_T0);
            _mm_prefetch(next + (int64_t)k * NB * 4 + 64, _MM_HINT_T0);
        }
        const __m512 w0 = _mm512_loadu_ps(block + (int64_t)k * NB), w1 = _mm512_loadu_ps(block + (int64_t)k * NB + 16);
        for (int m = 0; m < mt; m++) {
            const __m512 xv = _mm512_set1_ps(xr[(int64_t)m * K + k]);
            a0[m] = _mm512_fmadd_ps(xv, w0, a0[m]);
            a1[m] = _mm512_fmadd_ps(xv, w1, a1[m]);
        }
    }
    const __m512 b0 = bias ? _mm512_loadu_ps(bias + b * NB) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + b * NB + 16) : _mm512_setzero_ps();
    for (int m = 0; m < mt; m++) {
        float *yr = y + (int64_t)(m0 + m) * N + b * NB;
        _mm512_storeu_ps(yr, bias ? _mm512_add_ps(a0[m], b0) : a0[m]);
        _mm512_storeu_ps(yr + 16, bias ? _mm512_add_ps(a1[m], b1) : a1[m]);
    }
}

/* Rows [m0, m1) of block b: full tiles, then one of the 1-11 rows left (a copy per count, so
 * the accumulators stay in registers). */
static void rows_of_block(const float *x, const float *packed, const float *bias, float *y, int K, int N, int b,
                          int m0, int m1, const char *next) {
    const float *block = packed + (int64_t)b * K * NB;
    for (; m0 + MT <= m1; m0 += MT, next = NULL) tile(x, block, bias, y, K, N, b, m0, MT, next);
    switch (m1 - m0) {
#define REST(R) \
    case R: tile(x, block, bias, y, K, N, b, m0, R, next); break;
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
    }
}
#endif

/* y = x . W^T (+ bias): x [M, K] and y [M, N] contiguous fp32, packed from gemm_pack, bias [N] or
 * NULL. Units (block, chunk of M_CHUNK rows) in block-major order, a contiguous range per thread,
 * so each thread's next unit is usually the next block, which it prefetches. */
void gemm(const float *x, const float *packed, const float *bias, float *y, int M, int K, int N, int num_threads) {
#ifdef __AVX512F__
    const int nb = N / NB, chunks = (M + M_CHUNK - 1) / M_CHUNK, units = nb * chunks;
    if (num_threads > units) num_threads = units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int t = thread_id(), n = team_size();
        const int u0 = (int)((int64_t)units * t / n), u1 = (int)((int64_t)units * (t + 1) / n);
        for (int u = u0; u < u1; u++) {
            const int b = u / chunks, c = u % chunks;
            const int m0 = c * M_CHUNK, m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
            /* the next unit's block, when it is another one */
            const char *next = u + 1 < u1 && (u + 1) / chunks != b ? (const char *)(packed + (int64_t)(b + 1) * K * NB)
                                                                   : NULL;
            rows_of_block(x, packed, bias, y, K, N, b, m0, m1, next);
        }
    }
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
#endif
}
