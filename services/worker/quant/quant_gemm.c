/* Matrix products on GGUF quantized weights kept in their block format (Q4_0, Q4_1, Q8_0, Q4_K,
 * Q5_K, Q6_K), for CPU workers: y[M, N] = x[M, K] . W^T (+ bias), and the exact dequantization of
 * whole rows (embedding lookups). Built at first use by kernels.py (cpu/cbuild.py) with
 * -ffp-contract=off (quant_blocks.h's exact dequantization needs it).
 *
 * Why: decoding one token reads every weight once, so its time is the bytes read over the memory
 * bandwidth; a 4-bit block format is about a seventh of fp32's bytes. The weights are never
 * expanded to fp32 in memory: a chunk at a time is dequantized into L1 (decode) or a tile into L2
 * (prefill) and used there.
 *
 * Paths, by the number of rows of x:
 * - where asked (int8_dot) and the build has it for the type (Q4_0, Q4_1, Q8_0 with AVX2), x is
 *   quantized per 32-value block (two int8 parts, quant_q8.h) and the products are integer dot
 *   products on packed groups of 16 weight rows (quant_x16.h; from 16 rows on AMX tiles,
 *   quant_amx.h), each weight byte used for every row of x;
 * - otherwise (quant_f32.h), exact fp32 products: below TILE_MIN_ROWS qf_gemv_rows, GEMV_ROWS rows of
 *   x per pass over the weight rows; from there tile_rows, each weight byte read once per call.
 * All are split over the threads by weight rows (OpenMP, torch's pool).
 *
 * Measured against each other (time per call at M = 1 and 128 for SmolLM2's Q4_1 576x1536 and its
 * Q8_0 49152x576 LM head, and a decode step's 210 Q4_1 products, bytes read per second against
 * torch's t.sum() over 512 MB): the int8 path is several times faster than the fp32 one at M = 1,
 * whose exact dequantization through an L1 buffer is compute-bound, so decode takes the int8 path
 * by default (kernels.py's INT8_DOT). Prefetching the next group while one is packed matters on a
 * cold matrix (every layer's weights in a decode step): 16 rows at once are more streams than the
 * hardware prefetcher follows.
 */
#include <stdint.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "quant_f32.h"
#include "quant_q8.h"
#include "quant_x16.h"
#include "threads.h"
#include "quant_amx.h"

int qg_supported(int type) { return qt_supported(type); }

/* Floats of scratch qg_matmul needs for these sizes (the caller's buffer, reused across calls). */
/* Floats of each thread's own scratch: the fp32 path's tile, or the int8 path's packed group (the
 * widest type's, with room to align it to 64 bytes). */
static int64_t tile_floats(int K) {
    int64_t tile = (int64_t)K * NR + K;
#ifdef __AVX2__
    const int64_t packed = (x16_scratch_bytes(K) + 64 + 3) / 4;
    tile = tile > packed ? tile : packed;
#endif
    return tile;
}

int64_t qg_scratch_floats(int M, int K, int x_bf16, int num_threads) {
    const int64_t converted = x_bf16 ? (int64_t)M * K : 0, quantized = (int64_t)M * q8_row_bytes(K) / 4;
    return converted + quantized + (int64_t)num_threads * tile_floats(K);
}

/* Whether qg_matmul's int8_dot takes the int8 path for `type` in this build. */
int qg_int8_dot(int type) { return q8_covers(type); }

/* Whether calls of 16 or more rows on the int8 path run on AMX tiles (quant_amx.h) here. */
int qg_amx(void) {
#ifdef AMX_QUANT
    return amx_usable();
#else
    return 0;
#endif
}

/* out[i] = row rows[i] of W (all N rows when rows is NULL) dequantized to K floats. Returns 0, or -1
 * (nothing written) when a row index is outside [0, N). A lookup of a few rows (an embedding at
 * decode) runs on the calling thread: a team's fork would cost more than the rows. */
int qg_dequantize(int type, const uint8_t *w, int64_t row_bytes, int K, int64_t N, const int64_t *rows, int count,
                  float *out, int num_threads) {
    if (rows)
        for (int i = 0; i < count; i++)
            if (rows[i] < 0 || rows[i] >= N) return -1;
    if (num_threads < 1) num_threads = 1;
    const int blocks = K / qt_block_values(type);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= 4 * num_threads)
    for (int i = 0; i < count; i++)
        dequant_blocks(type, w + (rows ? rows[i] : i) * row_bytes, blocks, out + (int64_t)i * K);
    return 0;
}

/* The range of `total` items thread t of n takes. */
static inline void share(int total, int t, int n, int *lo, int *hi) {
    *lo = (int)((int64_t)total * t / n);
    *hi = (int)((int64_t)total * (t + 1) / n);
}

/* y = x . W^T (+ bias): x [M, K] fp32 or (x_bf16) bf16, contiguous; W N rows of row_bytes bytes of
 * blocks of `type` (K a multiple of its block); bias [N] fp32 or NULL; y [M, N] in x's dtype;
 * scratch: qg_scratch_floats(M, K, x_bf16, num_threads) floats. */
void qg_matmul(int type, const void *x, int x_bf16, const uint8_t *w, int64_t row_bytes, const float *bias, void *y,
               int M, int N, int K, float *scratch, int num_threads, int int8_dot) {
    if (num_threads < 1) num_threads = 1;
    const float *xf = (const float *)x;
    float *thread_scratch_base = scratch;
    if (x_bf16) {
        float *conv = scratch;
        const int64_t total = (int64_t)M * K;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < total; i++) conv[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = conv;
        thread_scratch_base = scratch + total;
    }
    if (int8_dot && q8_covers(type)) {
#ifdef __AVX2__
        q8_row_t *xq = malloc(sizeof(q8_row_t) * (size_t)M);
        if (xq == NULL) return;
        char *xq_mem = (char *)thread_scratch_base;
        const int64_t xq_bytes = q8_row_bytes(K);
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int m = 0; m < M; m++) {
            xq[m] = q8_row_at(xq_mem + m * xq_bytes, K);
            q8_quantize_row(xf + (int64_t)m * K, K, xq[m]);
        }
#ifdef AMX_QUANT
        if (M >= AMX_MIN_ROWS && amx_usable() && amx_matmul(type, xq, M, w, row_bytes, bias, y, x_bf16, N, K, num_threads) == 0) {
            free(xq);
            return;
        }
#endif
        float *packed_base = (float *)(xq_mem + (int64_t)M * xq_bytes);
        const int groups = (N + X16 - 1) / X16, team = num_threads > groups ? groups : num_threads;
#pragma omp parallel num_threads(team)
        {
            const uintptr_t at = (uintptr_t)(packed_base + (int64_t)thread_id() * tile_floats(K));
            uint8_t *packed = (uint8_t *)((at + 63) & ~(uintptr_t)63);
            int g0, g1;
            share(groups, thread_id(), team_size(), &g0, &g1);
            for (int g = g0; g < g1; g++) {
                x16_pack(type, w, row_bytes, K, N, g * X16, packed);
                x16_group_any(type, xq, M, packed, K, N, g * X16, bias, y, x_bf16);
            }
        }
        free(xq);
#endif
        return;
    }
    if (M < TILE_MIN_ROWS) {
        if (num_threads > N) num_threads = N;
#pragma omp parallel num_threads(num_threads)
        {
            int n0, n1;
            share(N, thread_id(), team_size(), &n0, &n1);
            for (int r0 = 0; r0 < M; r0 += GEMV_ROWS) {
                const int R = M - r0 < GEMV_ROWS ? M - r0 : GEMV_ROWS;
                void *yr = x_bf16 ? (void *)((uint16_t *)y + (int64_t)r0 * N) : (void *)((float *)y + (int64_t)r0 * N);
                qf_gemv_any(type, xf + (int64_t)r0 * K, K, w, row_bytes, K, N, n0, n1, bias, yr, x_bf16, R);
            }
        }
        return;
    }
    const int groups = (N + NR - 1) / NR;
    if (num_threads > groups) num_threads = groups;
#pragma omp parallel num_threads(num_threads)
    {
        float *tile = thread_scratch_base + (int64_t)thread_id() * tile_floats(K), *row = tile + (int64_t)K * NR;
        int g0, g1;
        share(groups, thread_id(), team_size(), &g0, &g1);
        for (int g = g0; g < g1; g++) {
            const int n0 = g * NR, rows = N - n0 < NR ? N - n0 : NR;
            fill_tile(type, w, row_bytes, K, n0, rows, tile, row);
            tile_rows(xf, M, K, tile, n0, rows, N, bias, y, x_bf16);
        }
    }
}
