/* Linear layers for AVX-512 CPUs: y[M, N] = x[M, K] . W^T (+ bias) with W packed once into column
 * blocks that stream from memory; fp32, and bf16 by the CPU's bf16 dot products (AVX512_BF16).
 *
 * Built at first use by gemm.py (cpu/cbuild.py, up to the amx_bf16 level; where the build has
 * no AVX-512, or no AVX512_BF16 for bf16, the library says so and the layers keep oneDNN's GEMMs).
 * On CPUs with AMX, bf16 products of 16 rows and more run on its tiles (gemm_tile.h).
 *
 * Why: in the engine every layer's weights stream from memory at each step (30 layers' weights do
 * not fit in any cache), and oneDNN's prepacked fp32 GEMMs lose much of their speed to that at
 * decode sizes (16-64 rows), while both reach the same peak at large row counts (BENCHMARKS.md,
 * "CPU kernels", has the measurements).
 *
 * Layout: W [N, K] becomes [N / 32][K][32] (bf16: [N / 32][K / 2][32][2], pairs of k side by side
 * as vdpbf16ps takes them): a block of 32 output columns is one contiguous stream of K x 128
 * (bf16: K x 64) bytes. A tile of up to 12 rows of x is multiplied into a block with 24 accumulators
 * (12 rows x two 16-lane halves), each x value broadcast from memory: 24 FMAs per 2 weight loads
 * and 12 broadcasts. The block (72 KB at K = 576) stays in L2 for the other tiles of its rows,
 * and the next block is prefetched, two lines per k, during the first tile.
 *
 * Arithmetic: each output is one fp32 accumulator over k = 0 .. K-1 in order, fused
 * multiply-adds (bf16: products of pairs of k exact, summed in fp32; vdpbf16ps flushes values
 * below 2^-126 to zero, as oneDNN's bf16 GEMMs on the same instruction do), plus the bias at the
 * end; bf16 outputs rounded once to bf16 (nearest even).
 */
#include <stdint.h>
#include <string.h>

#include "gemm_tile.h"
#include "threads.h"

/* Whether this build has the GEMM for fp32 (bf16 = 0) or bf16 (bf16 = 1). */
int gemm_available(int bf16) { return tile_available(bf16); }

/* Whether bf16 products of 16 rows and more run on AMX tiles (built for them, and the process
 * may use them). */
int gemm_amx_bf16(void) {
#ifdef TILE_AMX_BF16
    return amx_bf16_usable();
#else
    return 0;
#endif
}

/* W [N, K] row-major into [N / NB][K][NB] (fp32) or [N / NB][K / 2][NB][2] (bf16, K even); N a
 * multiple of NB. */
void gemm_pack(const void *W, void *packed, int N, int K, int bf16) {
    for (int b = 0; b < N / NB; b++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NB; j++) {
                const int64_t src = (int64_t)(b * NB + j) * K + k;
                if (bf16)
                    ((uint16_t *)packed)[(((int64_t)b * (K / 2) + k / 2) * NB + j) * 2 + k % 2] = ((const uint16_t *)W)[src];
                else
                    ((float *)packed)[((int64_t)b * K + k) * NB + j] = ((const float *)W)[src];
            }
}

/* y = x . W^T (+ bias): x [M, K] and y [M, N] contiguous in the layer's dtype (fp32, or bf16 with
 * K even), packed from gemm_pack, bias [N] or NULL; the work split over the threads as
 * gemm_share says. */
void gemm(const void *x, const void *packed, const void *bias, void *y, int M, int K, int N, int bf16,
          int num_threads) {
#ifdef __AVX512F__
#ifndef __AVX512BF16__
    if (bf16) return; /* gemm_available(1) said no */
#endif
    const int units = N / NB * ((M + M_CHUNK - 1) / M_CHUNK);
    if (num_threads > units) num_threads = units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    gemm_share(x, packed, bias, y, M, K, N, bf16, thread_id(), team_size());
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)bf16, (void)num_threads;
#endif
}
