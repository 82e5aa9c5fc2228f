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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
/* bf16 on AMX tiles (Intel's amx_bf16): the same packed blocks, 16 rows of x at a time.
 *
 * Why: from a few rows up a bf16 projection is bound by its multiply-adds, and one tdpbf16ps does
 * 16 x 16 x 32 of them in the tile unit, where vdpbf16ps does 32 per instruction; oneDNN's bf16
 * GEMMs take the tiles on such CPUs, so without them this GEMM (and the whole-step kernels built
 * on it) lost to oneDNN there.
 *
 * Tiles: A = 16 rows of x x 32 bf16 values of k (row-major x, its row stride); B = 16 pairs of k
 * x 16 output columns: a bf16 block's [K / 2][32][2] layout is exactly two such tiles side by side
 * (columns 0-15 in the first 64 bytes of each 128-byte pair row, 16-31 in the next), loaded with
 * a 128-byte stride, no repacking; C = 16 x 16 fp32. Two row groups share each B load (C tiles
 * 0-3, A tiles 4-5, B tiles 6-7). The tail of fewer than 16 rows takes the vdpbf16ps tile.
 *
 * Arithmetic: each output is one fp32 sum over k, accumulated by the tile unit a pair of k at a
 * time (products of bf16 values, exact in fp32; values below 2^-126 flushed to zero, as
 * vdpbf16ps does) in k order, plus the bias at the end, rounded once to bf16 (nearest even).
 * The order of the fp32 additions inside the unit differs from the vdpbf16ps tile's, so the two
 * agree to rounding, not to the bit; a given row count always takes the same path.
 *
 * Linux hands out the tiles' register state on request, per process (arch_prctl
 * ARCH_REQ_XCOMP_PERM); where that is refused the vdpbf16ps tiles run. */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TILE_AMX_BF16 1
#ifndef AMX_BF16_MIN_ROWS
#define AMX_BF16_MIN_ROWS 4 /* rows of x from which a bf16 GEMM takes the tiles */
#endif
#ifndef AMX_CHUNK
#define AMX_CHUNK 256
#endif

/* Whether this process may use the tiles (asked once). */
static int amx_bf16_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* This thread's tile shapes (other kernels in the process configure their own: set per call):
 * every tile 16 rows of 64 bytes, but C tiles 0, 1 and A tile 4 `tail` rows (a tail of rows). */
static inline void amx_bf16_configure(int tail) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)tail;
    _tile_loadconfig(&cfg);
}

/* C tiles c0, c1 (`rows` rows x columns 0-15, 16-31 of block b) + bias, rounded to bf16, into y's
 * rows [r0, r0 + rows). */
#define AMX_BF16_STORE(c0, c1, r0, rows)                                                 \
    do {                                                                                 \
        float cb[16 * NB] __attribute__((aligned(64)));                                  \
        _tile_stored(c0, cb, NB * 4);                                                    \
        _tile_stored(c1, cb + 16, NB * 4);                                               \
        for (int m = 0; m < (rows); m++) {                                               \
            __m512 y0 = _mm512_load_ps(cb + m * NB), y1 = _mm512_load_ps(cb + m * NB + 16); \
            if (bias) y0 = _mm512_add_ps(y0, b0), y1 = _mm512_add_ps(y1, b1);            \
            uint16_t *out = (uint16_t *)y + (int64_t)((r0) + m) * N + b * NB;            \
            store16_bf16(out, (f32x16)y0);                                               \
            store16_bf16(out + 16, (f32x16)y1);                                          \
        }                                                                                \
    } while (0)

/* Rows [m0, m1) of bf16 block b (rows_bf16's arguments; K a multiple of 32) on the tiles: pairs
 * of 16-row groups, then a group of 16, then the rows left (tiles configured that many rows high
 * for them, then back). */
static void rows_bf16_amx(const void *x, const void *packed, const void *bias, void *y, int K, int N, int b, int m0,
                          int m1, const char *next) {
    const char *block = (const char *)packed + (int64_t)b * K * NB * 2;
    const int64_t xs = (int64_t)K * 2; /* bytes per row of x */
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = (__m512)load16_bf16((const uint16_t *)bias + b * NB);
        b1 = (__m512)load16_bf16((const uint16_t *)bias + b * NB + 16);
    }
    while (m0 < m1) {
        const int two = m0 + 32 <= m1, rows = m1 - m0 < 16 ? m1 - m0 : 16;
        const char *a = (const char *)x + (int64_t)m0 * xs;
        if (rows < 16) amx_bf16_configure(rows);
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int k = 0; k < K; k += 32) {
            const char *w = block + (int64_t)k * 64; /* pair row k / 2, 128 bytes each */
            if (next) /* the next block's k-th 2 KB, all of it by the end of the first groups */
                for (int l = 0; l < 2048; l += 128) _mm_prefetch(next + (int64_t)k * 64 + l, _MM_HINT_T0);
            _tile_loadd(6, w, 128);
            _tile_loadd(7, w + 64, 128);
            _tile_loadd(4, a + k * 2, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, a + 16 * xs + k * 2, xs);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        next = NULL;
        AMX_BF16_STORE(0, 1, m0, rows);
        if (two) AMX_BF16_STORE(2, 3, m0 + 16, 16);
        if (rows < 16) amx_bf16_configure(16);
        m0 += two ? 32 : rows;
    }
}
#undef AMX_BF16_STORE
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
#ifdef TILE_AMX_BF16
    int chunk_rows = M_CHUNK, chunk_major = 0;
    if (bf16 && M >= AMX_BF16_MIN_ROWS && K % 32 == 0 && amx_bf16_usable()) {
        /* the tiles consume a block's rows so fast that re-reading the rows of x for every block
         * (block-major order) costs more than re-reading the blocks for every chunk of rows:
         * chunk-major, a chunk of x stays in L2 while the blocks stream past it */
        amx_bf16_configure(16);
        rows = rows_bf16_amx;
        chunk_rows = AMX_CHUNK;
        chunk_major = 1;
    }
#else
    const int chunk_rows = M_CHUNK, chunk_major = 0;
#endif
    const int chunks = (M + chunk_rows - 1) / chunk_rows, blocks = N / NB, units = blocks * chunks;
    const int64_t block_bytes = (int64_t)K * NB * (bf16 ? 2 : 4);
    const int u0 = (int)((int64_t)units * t / n), u1 = (int)((int64_t)units * (t + 1) / n);
    for (int u = u0; u < u1; u++) {
        const int b = chunk_major ? u % blocks : u / chunks, c = chunk_major ? u / blocks : u % chunks;
        const int m0 = c * chunk_rows, m1 = m0 + chunk_rows < M ? m0 + chunk_rows : M;
        /* the next unit's block, when it is another one */
        const int nb = chunk_major ? (u + 1) % blocks : (u + 1) / chunks;
        const char *next = u + 1 < u1 && nb != b ? (const char *)packed + nb * block_bytes : NULL;
        rows(x, packed, bias, y, K, N, b, m0, m1, next);
    }
}
#endif

#endif
