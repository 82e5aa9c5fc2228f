/* The integer products of quant_gemm.c on AMX tiles (Intel's amx_int8: Sapphire Rapids and later),
 * for Q4_0, Q4_1 and Q8_0 weights and 16 or more rows of x (prefill, batched decode).
 *
 * Why: those calls are compute-bound, and AVX-512 VNNI's vpdpbusd does 64 multiply-adds an
 * instruction, while one tdpbusd does 16 x 16 x (K bytes) of them in a tile unit of its own. Each
 * 32-value block has its own weight scale (per weight row) and x scale (per row of x), so a tile
 * product covers one block (K = 32 bytes), is stored, and is scaled in AVX-512 registers: for a
 * group of 16 weight rows and a chunk of 16 rows of x, per block, two tdpbusd (x's high and low
 * parts, quant_q8.h) and the scaling of 256 sums, where quant_x16.h takes 16 x 16 vpdpbusd.
 *
 * Tiles: A = 16 weight rows x 32 bytes (unsigned: Q4 nibbles 0 .. 15, Q8_0 stored q + 128, as
 * quant_x16.h packs them); B = 8 rows x 64 bytes: row c holds values 4c .. 4c + 3 of each of the 16
 * rows of x (the VNNI layout tdpbusd multiplies A's rows by); C = 16 x 16 int32, C[j][m] the block
 * sum of weight row j and x row m. The integer block sums are those of quant_x16.h, and each
 * output is accumulated by the same fp32 operations in the same order (d * dx times the sum, then
 * Q4_1's m * sx), so the results have quant_x16.h's bits.
 *
 * Linux hands out the tiles' register state on request, per process (arch_prctl
 * ARCH_REQ_XCOMP_PERM); where that is refused the VNNI kernels run.
 */
#ifndef MYVLLM_QUANT_AMX_H
#define MYVLLM_QUANT_AMX_H

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(X16_ZMM)
#define AMX_QUANT 1

#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant_blocks.h"
#include "quant_f32.h" /* qt_store_out */
#include "quant_q8.h"
#include "threads.h"

#define AMX_MIN_ROWS 16 /* rows of x from which qg_matmul takes the tiles */
#define AMX_W_BLOCK 640 /* packed weight block: 16 x 32 bytes, 16 fp32 d, 16 fp32 m */
#define AMX_X_BLOCK 1216 /* packed x block: 512 bytes high parts, 512 low, 16 fp32 dx, 16 sx, 16 int32 isum */

/* Whether this process may use the tiles (asked once). */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config_t;

/* Tiles 0, 1 and 5, 6: C (high, low parts) of even and odd blocks; 2: A; 3, 4: B (high, low parts). */
static void amx_configure(void) {
    amx_config_t cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
    cfg.colsb[0] = cfg.colsb[1] = 64;
    cfg.colsb[2] = 32;
    cfg.rows[3] = cfg.rows[4] = 8;
    cfg.colsb[3] = cfg.colsb[4] = 64;
    cfg.rows[5] = cfg.rows[6] = 16;
    cfg.colsb[5] = cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}

/* Chunk `ch` (rows 16 ch .. 16 ch + 15) of the M rows of x (quantized) in B's layout, by block;
 * rows past M are zeros. */
static void amx_pack_x(const q8_row_t *xq, int M, int K, int ch, uint8_t *out) {
    const int nb = K / QK;
    for (int b = 0; b < nb; b++) {
        uint8_t *o = out + ((int64_t)ch * nb + b) * AMX_X_BLOCK;
        uint32_t *hi = (uint32_t *)o, *lo = (uint32_t *)(o + 512);
        float *dx = (float *)(o + 1024), *sx = dx + 16;
        int32_t *isum = (int32_t *)(sx + 16);
        for (int m = 0; m < 16; m++) {
            const int row = ch * 16 + m;
            if (row < M) {
                const uint32_t *qh = (const uint32_t *)(xq[row].q + b * QK), *ql = (const uint32_t *)(xq[row].lo + b * QK);
                for (int c = 0; c < 8; c++) {
                    hi[c * 16 + m] = qh[c];
                    lo[c * 16 + m] = ql[c];
                }
                dx[m] = xq[row].dx[b], sx[m] = xq[row].sx[b], isum[m] = xq[row].isum[b];
            } else {
                for (int c = 0; c < 8; c++) hi[c * 16 + m] = lo[c * 16 + m] = 0;
                dx[m] = sx[m] = 0.f, isum[m] = 0;
            }
        }
    }
}

/* Bytes of the packed x (M rows of K values), and of one thread's packed weight group and sums. */
static inline size_t amx_x_bytes(int M, int K) { return (size_t)((M + 15) / 16) * (size_t)(K / QK) * AMX_X_BLOCK; }
static inline size_t amx_w_bytes(int K) { return (size_t)(K / QK) * AMX_W_BLOCK + 4096; }

/* Weight rows n0 .. n0 + 15 (rows at or past N repeat row N - 1) into A's layout, by block. */
static inline __attribute__((always_inline)) void amx_pack_w(int type, const uint8_t *w, int64_t row_bytes, int K,
                                                             int N, int n0, uint8_t *out) {
    const int nb = K / QK, bytes = qt_block_bytes(type), qs = type == QT_Q4_1 ? 4 : 2;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < 16; j++) {
        const uint8_t *blk = w + (int64_t)(n0 + j < N ? n0 + j : N - 1) * row_bytes;
        uint8_t *o = out + 32 * j;
        for (int b = 0; b < nb; b++, blk += bytes, o += AMX_W_BLOCK) {
            float *d = (float *)(o - 32 * j + 512);
            d[j] = fp16_to_f32(blk);
            d[16 + j] = type == QT_Q4_1 ? fp16_to_f32(blk + 2) : 0.f;
            if (type == QT_Q8_0) {
                _mm256_storeu_si256((__m256i *)o, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), flip));
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + qs));
                _mm_storeu_si128((__m128i *)o, _mm_and_si128(raw, low4));
                _mm_storeu_si128((__m128i *)(o + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
            }
        }
    }
}

/* Block sums of one packed block into sums[0 .. 256) (high parts) and sums[256 .. 512) (low), on the
 * C tiles of even (0, 1) or odd (5, 6) blocks: two pairs, so the tiles of block b + 1 run while the
 * vector units scale block b's sums (tile numbers are part of the instructions, hence two copies). */
#define AMX_BLOCK_SUMS(CH, CL, pw, px, sums) \
    do {                                      \
        _tile_zero(CH);                       \
        _tile_zero(CL);                       \
        _tile_loadd(2, pw, 32);               \
        _tile_loadd(3, px, 64);               \
        _tile_loadd(4, (px) + 512, 64);       \
        _tile_dpbusd(CH, 2, 3);               \
        _tile_dpbusd(CL, 2, 4);               \
        _tile_stored(CH, sums, 64);           \
        _tile_stored(CL, (sums) + 256, 64);   \
    } while (0)

/* y[m0 .. m0 + rows, n0 .. n0 + 15] from a packed weight group and a packed chunk of x; y row stride
 * N, outputs at or past N (or past the chunk's `rows`) not stored. `sums`: 1024 int32, 64-aligned. */
static inline __attribute__((always_inline)) void amx_chunk(int type, const uint8_t *pw, const uint8_t *px, int nb,
                                                            int rows, int N, int n0, int m0, const float *bias,
                                                            void *y, int bf16, int32_t *sums) {
    const int corr8 = type == QT_Q8_0 ? 128 : type == QT_Q4_0 ? 8 : 0;
    const __m512i hi_weight = _mm512_set1_epi32(Q8_HI);
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    AMX_BLOCK_SUMS(0, 1, pw, px, sums);
    for (int b = 0; b < nb; b++, pw += AMX_W_BLOCK, px += AMX_X_BLOCK) {
        if (b + 1 < nb) {
            if (b & 1)
                AMX_BLOCK_SUMS(0, 1, pw + AMX_W_BLOCK, px + AMX_X_BLOCK, sums);
            else
                AMX_BLOCK_SUMS(5, 6, pw + AMX_W_BLOCK, px + AMX_X_BLOCK, sums + 512);
        }
        const int32_t *bs = sums + 512 * (b & 1);
        const float *d = (const float *)(pw + 512), *xs = (const float *)(px + 1024);
        const __m512 dx = _mm512_loadu_ps(xs), sx = _mm512_loadu_ps(xs + 16);
        const __m512i corr = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(xs + 32)), _mm512_set1_epi32(corr8));
        for (int j = 0; j < 16; j++) {
            __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512((const void *)(bs + 16 * j)), hi_weight),
                                         _mm512_load_si512((const void *)(bs + 256 + 16 * j)));
            if (corr8) s = _mm512_sub_epi32(s, corr);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[j]), dx), _mm512_cvtepi32_ps(s), acc[j]);
            if (type == QT_Q4_1) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d[16 + j]), sx, acc[j]);
        }
    }
    float out[16][16];
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(out[j], acc[j]);
    const int cols = N - n0 < 16 ? N - n0 : 16;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < cols; j++) qt_store_out(y, (int64_t)(m0 + m) * N + n0 + j, out[j][m], bias, n0 + j, bf16);
}

static inline __attribute__((always_inline)) void amx_groups_of(int type, const uint8_t *w, int64_t row_bytes,
                                                                const uint8_t *px, int M, int K, int N, int g0, int g1,
                                                                const float *bias, void *y, int bf16, uint8_t *pw) {
    const int nb = K / QK, chunks = (M + 15) / 16;
    int32_t *sums = (int32_t *)(pw + (size_t)nb * AMX_W_BLOCK);
    for (int g = g0; g < g1; g++) {
        amx_pack_w(type, w, row_bytes, K, N, g * 16, pw);
        for (int ch = 0; ch < chunks; ch++)
            amx_chunk(type, pw, px + (int64_t)ch * nb * AMX_X_BLOCK, nb, M - ch * 16 < 16 ? M - ch * 16 : 16, N, g * 16,
                      ch * 16, bias, y, bf16, sums);
    }
}

/* Weight groups g0 .. g1 (16 rows each) against the packed x (amx_pack_x), on this thread's tiles;
 * pw: amx_w_bytes(K) bytes, 64-aligned. */
static void amx_groups(int type, const uint8_t *w, int64_t row_bytes, const uint8_t *px, int M, int K, int N, int g0,
                       int g1, const float *bias, void *y, int bf16, uint8_t *pw) {
    if (g0 >= g1) return;
    amx_configure();
    if (type == QT_Q4_0)
        amx_groups_of(QT_Q4_0, w, row_bytes, px, M, K, N, g0, g1, bias, y, bf16, pw);
    else if (type == QT_Q4_1)
        amx_groups_of(QT_Q4_1, w, row_bytes, px, M, K, N, g0, g1, bias, y, bf16, pw);
    else
        amx_groups_of(QT_Q8_0, w, row_bytes, px, M, K, N, g0, g1, bias, y, bf16, pw);
    _tile_release();
}

/* y = x . W^T (+ bias) for M >= AMX_MIN_ROWS rows of x already quantized (xq), over the threads;
 * returns 0, or -1 where memory could not be had (nothing written). */
static int amx_matmul(int type, const q8_row_t *xq, int M, const uint8_t *w, int64_t row_bytes, const float *bias,
                      void *y, int bf16, int N, int K, int num_threads) {
    const int chunks = (M + 15) / 16, groups = (N + 15) / 16;
    uint8_t *px = aligned_alloc(64, amx_x_bytes(M, K));
    if (px == NULL) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int ch = 0; ch < chunks; ch++) amx_pack_x(xq, M, K, ch, px);
    const int team = num_threads > groups ? groups : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        uint8_t *pw = aligned_alloc(64, amx_w_bytes(K));
        if (pw == NULL) {
            failed = 1;
        } else {
            const int t = thread_id(), n = team_size();
            amx_groups(type, w, row_bytes, px, M, K, N, (int)((int64_t)groups * t / n),
                       (int)((int64_t)groups * (t + 1) / n), bias, y, bf16, pw);
            free(pw);
        }
    }
    free(px);
    return failed ? -1 : 0;
}
#endif

#endif
