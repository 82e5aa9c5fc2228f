/* The integer path of quant_gemm.c (and the quantized decode step) on Q4_0, Q4_1 and Q8_0 weights,
 * for any number of rows of x: x quantized per 32-value block as in quant_q8.h, integer dot
 * products on sixteen weight rows at once.
 *
 * Why sixteen at once: a kernel that sums one weight row's block in the lanes of a vector, then
 * adds the lanes up, does one block and one output at a time, and with many rows of x it is
 * compute-bound; even at one row it lost to this inside a decode step. Here a group of 16 weight
 * rows is first rearranged ("packed", into the thread's scratch, which stays in L1/L2) so that one
 * 64-byte vector holds 4 consecutive values of one block of each of the 16 rows: vpdpbusd against
 * 4 bytes of x broadcast to every lane then adds 4 products into each of 16 outputs, and 8 of them
 * give the 16 rows' block sums side by side, scaled by the 16 block scales in one multiply. The
 * packing is paid once per group and used by every row of x.
 *
 * Packed block of a group (16 weight rows, one 32-value block each), in the scratch:
 *   16 fp16 d | (Q4_1) 16 fp16 m | 8 chunks of 64 bytes: chunk c, lane j (4 bytes) = the unsigned
 *   8-bit quants of values 4c .. 4c + 3 of row j's block.
 * Unsigned: Q4_0 and Q4_1 nibbles are 0 .. 15 as stored; Q8_0 is stored q + 128 (the VNNI build;
 * vpdpbusd multiplies unsigned by signed bytes) and the offsets come out of the integer sums:
 * Q4_0's 8 * sum(qx), Q8_0's 128 * sum(qx) (exact in int32: |sum(qx)| <= 32 * 32385); Q4_1's m * dx * sum(qx) in fp32 as in
 * quant_q8.h. The AVX2 build keeps Q8_0 signed and multiplies |q| by x with q's sign (vpsignb), as
 * quant_q8.h does, since vpmaddubsw's int16 pair sums could saturate on q + 128.
 *
 * x comes in quant_q8.h's two int8 parts: each chunk takes two vpdpbusd (high and low parts) on
 * the same packed weights. The results differ from quant_q8.h's only in the order of the fp32
 * sums: the same quantized x, the same exact integer block sums.
 */
#ifndef MYVLLM_QUANT_X16_H
#define MYVLLM_QUANT_X16_H

#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "quant_f32.h" /* qt_store_out */
#include "quant_q8.h"

#ifdef __AVX2__
#define X16 16 /* weight rows per group */
#define X16_R 4 /* rows of x per pass over a packed group */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define X16_ZMM 1
#endif
#endif

/* Every int8 call takes this path, from one row of x: inside a whole decode step the packed groups
 * (their weights streamed, transposed in registers, then used by every row) beat a kernel that
 * sums one weight row in a vector's lanes, even at one row, with AVX-512 or AVX2 (measured on
 * SmolLM2's Q4_1 decode). */

#ifdef __AVX2__

/* Bytes of one packed block of a group, and of a whole packed group of K values. */
static inline int x16_block_bytes(int type) { return X16 * 2 * (type == QT_Q4_1 ? 2 : 1) + 8 * 64; }
static inline int64_t x16_group_bytes(int type, int K) { return (int64_t)(K / QK) * x16_block_bytes(type); }
/* The scratch a packed group of any type takes (Q4_1's, with its two scales per block, is the widest). */
static inline int64_t x16_scratch_bytes(int K) { return x16_group_bytes(QT_Q4_1, K); }

/* Block b of nb's share of the prefetches of the next group's `lines` cache lines: spread over the
 * packing, since a burst of them all at once fills the core's miss buffers and stalls it (measured:
 * 40% of a one-row decode step's packing time sat on the burst). */
static inline __attribute__((always_inline)) void x16_prefetch_share(const uint8_t *next, int64_t lines, int b,
                                                                     int nb) {
    for (int64_t l = lines * b / nb; l < lines * (b + 1) / nb; l++) _mm_prefetch((const char *)next + 64 * l, _MM_HINT_T0);
}

/* Byte offsets from row n0 of the group's 16 rows (rows at or past N repeat row N - 1). */
static inline void x16_row_offsets(int N, int n0, int64_t row_bytes, int32_t at[X16]) {
    for (int j = 0; j < X16; j++) at[j] = (int32_t)((n0 + j < N ? j : N - 1 - n0) * row_bytes);
}

#ifdef X16_ZMM
/* out[c] (c = 0 .. 3), lane j = the c-th 4-byte word of the 16 bytes at base + at[j] + off: each
 * row's bytes in one load, and a 16 x 4 transpose of 4-byte words by permutes (16-lane gathers
 * cost several times as much, and a decode step at one row spends most of its time packing). */
static inline __attribute__((always_inline)) void x16_transpose(const uint8_t *base, const int32_t *at, int64_t off,
                                                                __m512i out[4]) {
    __m512i z[4];
    for (int k = 0; k < 4; k++) {
        z[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(base + at[4 * k] + off)));
        for (int i = 1; i < 4; i++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(base + at[4 * k + i] + off));
            z[k] = i == 1 ? _mm512_inserti32x4(z[k], v, 1) : i == 2 ? _mm512_inserti32x4(z[k], v, 2)
                                                                  : _mm512_inserti32x4(z[k], v, 3);
        }
    }
    /* z[k] lane 4 i + c = word c of row 4 k + i; lanes 0 .. 7 of a pair's permute: rows of z[2p], z[2p + 1] */
    for (int c = 0; c < 4; c++) {
        const __m512i idx = _mm512_set_epi32(28 + c, 24 + c, 20 + c, 16 + c, 12 + c, 8 + c, 4 + c, c,
                                             28 + c, 24 + c, 20 + c, 16 + c, 12 + c, 8 + c, 4 + c, c);
        const __m512i lo = _mm512_permutex2var_epi32(z[0], idx, z[1]), hi = _mm512_permutex2var_epi32(z[2], idx, z[3]);
        out[c] = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
    }
}

/* x16_pack's AVX-512 form: the scales by one gather, the quants by x16_transpose. */
static inline __attribute__((always_inline)) void x16_pack_zmm(int type, const uint8_t *w, int64_t row_bytes, int K,
                                                               int N, int n0, uint8_t *out, const uint8_t *next,
                                                               int64_t next_lines) {
    const int nb = K / QK, bytes = qt_block_bytes(type), qs = type == QT_Q4_1 ? 4 : 2;
    const uint8_t *base = w + (int64_t)n0 * row_bytes;
    int32_t at[X16];
    x16_row_offsets(N, n0, row_bytes, at);
    const __m512i idx = _mm512_loadu_si512((const void *)at);
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const int scales = X16 * 2 * (type == QT_Q4_1 ? 2 : 1);
    for (int b = 0; b < nb; b++, out += x16_block_bytes(type)) {
        x16_prefetch_share(next, next_lines, b, nb);
        const int64_t blk = (int64_t)b * bytes;
        /* the scales: d (and Q4_1's m) are the block's first one (two) fp16 */
        const __m512i head = _mm512_i32gather_epi32(idx, (const void *)(base + blk), 1);
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(head));
        if (type == QT_Q4_1) _mm256_storeu_si256((__m256i *)(out + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        uint8_t *q = out + scales;
        __m512i v[4];
        if (type == QT_Q8_0) {
            for (int h = 0; h < 2; h++) {
                x16_transpose(base, at, blk + qs + 16 * h, v);
                for (int c = 0; c < 4; c++) _mm512_storeu_si512((void *)(q + 64 * (4 * h + c)), _mm512_xor_si512(v[c], flip));
            }
        } else {
            x16_transpose(base, at, blk + qs, v);
            for (int c = 0; c < 4; c++) {
                _mm512_storeu_si512((void *)(q + 64 * c), _mm512_and_si512(v[c], low4));
                _mm512_storeu_si512((void *)(q + 64 * (c + 4)), _mm512_and_si512(_mm512_srli_epi16(v[c], 4), low4));
            }
        }
    }
}
#else
/* x16_transpose's AVX2 form for 8 rows: out[c], lane j = the c-th 4-byte word of the 16 bytes at
 * base + at[j] + off (rows j and j + 4 share a register, then a 4 x 4 transpose per 128-bit lane). */
static inline __attribute__((always_inline)) void x16_transpose_ymm(const uint8_t *base, const int32_t *at,
                                                                    int64_t off, __m256i out[4]) {
    __m256i r[4];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(base + at[i] + off))),
                                       _mm_loadu_si128((const __m128i *)(base + at[i + 4] + off)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* x16_pack's AVX2 form: two halves of 8 rows, each transposed from row loads; the scales copied. */
static inline __attribute__((always_inline)) void x16_pack_ymm(int type, const uint8_t *w, int64_t row_bytes, int K,
                                                               int N, int n0, uint8_t *out, const uint8_t *next,
                                                               int64_t next_lines) {
    const int nb = K / QK, bytes = qt_block_bytes(type), qs = type == QT_Q4_1 ? 4 : 2;
    const uint8_t *base = w + (int64_t)n0 * row_bytes;
    int32_t at[X16];
    x16_row_offsets(N, n0, row_bytes, at);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int scales = X16 * 2 * (type == QT_Q4_1 ? 2 : 1);
    for (int b = 0; b < nb; b++, out += x16_block_bytes(type)) {
        x16_prefetch_share(next, next_lines, b, nb);
        const int64_t blk = (int64_t)b * bytes;
        for (int j = 0; j < X16; j++) {
            memcpy(out + 2 * j, base + at[j] + blk, 2);
            if (type == QT_Q4_1) memcpy(out + X16 * 2 + 2 * j, base + at[j] + blk + 2, 2);
        }
        uint8_t *q = out + scales;
        __m256i v[4];
        for (int h = 0; h < 2; h++) {
            if (type == QT_Q8_0) {
                for (int half = 0; half < 2; half++) {
                    x16_transpose_ymm(base, at + 8 * h, blk + qs + 16 * half, v);
                    for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(q + 64 * (4 * half + c) + 32 * h), v[c]);
                }
            } else {
                x16_transpose_ymm(base, at + 8 * h, blk + qs, v);
                for (int c = 0; c < 4; c++) {
                    _mm256_storeu_si256((__m256i *)(q + 64 * c + 32 * h), _mm256_and_si256(v[c], low4));
                    _mm256_storeu_si256((__m256i *)(q + 64 * (c + 4) + 32 * h),
                                        _mm256_and_si256(_mm256_srli_epi16(v[c], 4), low4));
                }
            }
        }
    }
}
#endif

/* Pack weight rows n0 .. n0 + 15 (rows at or past N repeat row N - 1: their outputs are dropped). */
static void x16_pack(int type, const uint8_t *w, int64_t row_bytes, int K, int N, int n0, uint8_t *out) {
    /* the next group's rows (contiguous bytes) into the cache while this one is packed: 16 rows at
     * once are more streams than the hardware prefetcher follows */
    const uint8_t *next = w + (int64_t)(n0 + X16) * row_bytes;
    const int64_t lines = n0 + X16 < N ? ((int64_t)(N - n0 - X16 < X16 ? N - n0 - X16 : X16) * row_bytes + 63) / 64 : 0;
#ifdef X16_ZMM
    if (type == QT_Q4_0) return x16_pack_zmm(QT_Q4_0, w, row_bytes, K, N, n0, out, next, lines);
    if (type == QT_Q4_1) return x16_pack_zmm(QT_Q4_1, w, row_bytes, K, N, n0, out, next, lines);
    return x16_pack_zmm(QT_Q8_0, w, row_bytes, K, N, n0, out, next, lines);
#else
    if (type == QT_Q4_0) return x16_pack_ymm(QT_Q4_0, w, row_bytes, K, N, n0, out, next, lines);
    if (type == QT_Q4_1) return x16_pack_ymm(QT_Q4_1, w, row_bytes, K, N, n0, out, next, lines);
    return x16_pack_ymm(QT_Q8_0, w, row_bytes, K, N, n0, out, next, lines);
#endif
}

/* y[r, n0 .. n0 + 15] for R rows of x (quantized) against a packed group; y row stride N, outputs at
 * or past N not stored. */
static inline __attribute__((always_inline)) void x16_rows(int type, const q8_row_t *xq, const uint8_t *packed,
                                                           int K, int N, int n0, const float *bias, void *y, int bf16,
                                                           const int R) {
    const int nb = K / QK, step = x16_block_bytes(type), qoff = X16 * 2 * (type == QT_Q4_1 ? 2 : 1);
    const int corr = type == QT_Q4_0 ? 8 : 0;
    float out[X16_R][X16];
#ifdef X16_ZMM
    const int corr8 = type == QT_Q8_0 ? 128 : corr;
    __m512 acc[X16_R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *pb = packed;
    for (int b = 0; b < nb; b++, pb += step) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        const __m512 m = type == QT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32)))
                                         : _mm512_setzero_ps();
        __m512i wq[8];
        for (int c = 0; c < 8; c++) wq[c] = _mm512_loadu_si512((const void *)(pb + qoff + 64 * c));
        for (int r = 0; r < R; r++) {
            /* the high parts' sums in s0, the low parts' in s1 */
            const int32_t *xw = (const int32_t *)(xq[r].q + b * QK), *lw = (const int32_t *)(xq[r].lo + b * QK);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], _mm512_set1_epi32(xw[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], _mm512_set1_epi32(lw[0]));
            for (int c = 1; c < 8; c++) {
                s0 = _mm512_dpbusd_epi32(s0, wq[c], _mm512_set1_epi32(xw[c]));
                s1 = _mm512_dpbusd_epi32(s1, wq[c], _mm512_set1_epi32(lw[c]));
            }
            __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(s0, _mm512_set1_epi32(Q8_HI)), s1);
            if (corr8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(corr8 * xq[r].isum[b]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xq[r].dx[b])), _mm512_cvtepi32_ps(s), acc[r]);
            if (type == QT_Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq[r].sx[b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
#else
    /* two halves of 8 weight rows; int16 pair sums (vpmaddubsw) widened per chunk */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[X16_R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *pb = packed;
        for (int b = 0; b < nb; b++, pb += step) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16 * h)));
            const __m256 m = type == QT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 32 + 16 * h)))
                                             : _mm256_setzero_ps();
            __m256i wq[8];
            for (int c = 0; c < 8; c++) wq[c] = _mm256_loadu_si256((const __m256i *)(pb + qoff + 64 * c + 32 * h));
            for (int r = 0; r < R; r++) {
                const int32_t *xw = (const int32_t *)(xq[r].q + b * QK), *lw = (const int32_t *)(xq[r].lo + b * QK);
                __m256i sh = _mm256_setzero_si256(), sl = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    __m256i u = wq[c], v = _mm256_set1_epi32(xw[c]), vl = _mm256_set1_epi32(lw[c]);
                    if (type == QT_Q8_0) {
                        v = _mm256_sign_epi8(v, u);
                        vl = _mm256_sign_epi8(vl, u);
                        u = _mm256_sign_epi8(u, u);
                    }
                    sh = _mm256_add_epi32(sh, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones));
                    sl = _mm256_add_epi32(sl, _mm256_madd_epi16(_mm256_maddubs_epi16(u, vl), ones));
                }
                __m256i s = _mm256_add_epi32(_mm256_mullo_epi32(sh, _mm256_set1_epi32(Q8_HI)), sl);
                if (corr) s = _mm256_sub_epi32(s, _mm256_set1_epi32(corr * xq[r].isum[b]));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xq[r].dx[b])), _mm256_cvtepi32_ps(s), acc[r]);
                if (type == QT_Q4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq[r].sx[b]), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
#endif
    const int cols = N - n0 < X16 ? N - n0 : X16;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < cols; j++) qt_store_out(y, (int64_t)r * N + n0 + j, out[r][j], bias, n0 + j, bf16);
}

/* Every row of x (M, quantized) against a packed group: X16_R rows per pass. */
static inline __attribute__((always_inline)) void x16_group(int type, const q8_row_t *xq, int M, const uint8_t *packed, int K, int N, int n0,
                      const float *bias, void *y, int bf16) {
    const size_t es = bf16 ? 2 : 4;
    int r0 = 0;
    for (; r0 + X16_R <= M; r0 += X16_R)
        x16_rows(type, xq + r0, packed, K, N, n0, bias, (char *)y + (size_t)r0 * N * es, bf16, X16_R);
    char *yr = (char *)y + (size_t)r0 * N * es;
    switch (M - r0) {
    case 3: x16_rows(type, xq + r0, packed, K, N, n0, bias, yr, bf16, 3); break;
    case 2: x16_rows(type, xq + r0, packed, K, N, n0, bias, yr, bf16, 2); break;
    case 1: x16_rows(type, xq + r0, packed, K, N, n0, bias, yr, bf16, 1); break;
    default: break;
    }
}

static inline void x16_group_any(int type, const q8_row_t *xq, int M, const uint8_t *packed, int K, int N, int n0,
                                 const float *bias, void *y, int bf16) {
    if (type == QT_Q4_0)
        x16_group(QT_Q4_0, xq, M, packed, K, N, n0, bias, y, bf16);
    else if (type == QT_Q4_1)
        x16_group(QT_Q4_1, xq, M, packed, K, N, n0, bias, y, bf16);
    else
        x16_group(QT_Q8_0, xq, M, packed, K, N, n0, bias, y, bf16);
}
#endif

#endif
