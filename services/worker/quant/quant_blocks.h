/* GGUF (ggml) quantized block formats and their exact dequantization, one block at a time.
 *
 * Each function computes every value with the same fp32 operations, in the same order, as the
 * `gguf` package's numpy reference (gguf.quants.dequantize, itself ggml's dequantize_row_*): the
 * library is built with -ffp-contract=off, so `d * q + m` stays a product and a sum, each rounded,
 * never one fused multiply-add. The loops are written in a shape GCC vectorizes (a fixed count of
 * independent lanes), which keeps them exact and makes them fast enough for the dequantizing paths
 * (embedding lookups, the prefill tiles, the fp32 decode path).
 */
#ifndef MYVLLM_QUANT_BLOCKS_H
#define MYVLLM_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

/* gguf.GGMLQuantizationType values */
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 };

#define QK 32   /* values per block of Q4_0, Q4_1, Q8_0 */
#define QK_K 256 /* values per super-block of the K-quants */

static inline int qt_supported(int type) {
    return type == QT_Q4_0 || type == QT_Q4_1 || type == QT_Q8_0 || type == QT_Q4_K || type == QT_Q5_K ||
           type == QT_Q6_K;
}

/* Values per block and bytes per block (gguf.GGML_QUANT_SIZES) */
static inline int qt_block_values(int type) { return type >= QT_Q4_K ? QK_K : QK; }

static inline int qt_block_bytes(int type) {
    switch (type) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    case QT_Q6_K: return 210;
    default: return 0;
    }
}

/* IEEE half to float, exact (every half is a float); NaN keeps its payload. */
static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        const float sub = (float)man * 0x1p-24f; /* subnormal half: exact in fp32 */
        memcpy(&bits, &sub, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_0: d (fp16), 16 bytes of nibbles; value i < 16 is the low nibble of byte i, value 16 + i the
 * high one; w = d * (q - 8). */
static inline void dequant_q4_0(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b);
    const uint8_t *qs = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((int)(qs[i] & 0xf) - 8);
        y[i + 16] = d * (float)((int)(qs[i] >> 4) - 8);
    }
}

/* Q4_1: d, m (fp16), 16 bytes of nibbles as Q4_0; w = d * q + m. */
static inline void dequant_q4_1(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    const uint8_t *qs = b + 4;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(qs[i] & 0xf) + m;
        y[i + 16] = d * (float)(qs[i] >> 4) + m;
    }
}

/* Q8_0: d (fp16), 32 int8; w = q * d. */
static inline void dequant_q8_0(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) y[i] = (float)qs[i] * d;
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: d, dmin (fp16), 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles: 8
 * sub-blocks of 32; sub-block 2j is the low nibbles of bytes 32j .. 32j+31, 2j+1 their high
 * nibbles; w = (d * sc) * q - (dmin * m). */
static inline void dequant_q4_k(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; i++) y[32 * j + i] = dl * (float)((q[i] >> shift) & 0xf) - ml;
    }
}

/* Q5_K: as Q4_K with 32 bytes of high bits after the scales: bit j of byte i is the fifth bit of
 * value i of sub-block j. */
static inline void dequant_q5_k(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; i++)
            y[32 * j + i] = dl * (float)(((q[i] >> shift) & 0xf) | (((qh[i] >> j) & 1) << 4)) - ml;
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d (fp16); two
 * halves of 128 values; in half h, value 32s + i (s < 4, i < 32) has the low nibble
 * (ql[64h + 32(s % 2) + i] >> 4(s / 2)) and the high pair (qh[32h + i] >> 2s); its scale is
 * scales[v / 16] for value v of the super-block; w = (d * scale) * (q - 32). */
static inline void dequant_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = fp16_to_f32(b + 208);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const uint8_t *lo = ql + 64 * h + 32 * (s % 2), *hi = qh + 32 * h;
            const int v0 = 128 * h + 32 * s;
            const float d0 = d * (float)scales[v0 / 16], d1 = d * (float)scales[v0 / 16 + 1];
            for (int i = 0; i < 32; i++) {
                const int q = (int)(((lo[i] >> (4 * (s / 2))) & 0xf) | (((hi[i] >> (2 * s)) & 3) << 4)) - 32;
                y[v0 + i] = (i < 16 ? d0 : d1) * (float)q;
            }
        }
}

/* `count` consecutive blocks of `type` at `blocks` into count * qt_block_values(type) floats. */
static void dequant_blocks(int type, const uint8_t *blocks, int count, float *y) {
    const int bytes = qt_block_bytes(type), values = qt_block_values(type);
    for (int i = 0; i < count; i++, blocks += bytes, y += values) switch (type) {
        case QT_Q4_0: dequant_q4_0(blocks, y); break;
        case QT_Q4_1: dequant_q4_1(blocks, y); break;
        case QT_Q8_0: dequant_q8_0(blocks, y); break;
        case QT_Q4_K: dequant_q4_k(blocks, y); break;
        case QT_Q5_K: dequant_q5_k(blocks, y); break;
        case QT_Q6_K: dequant_q6_k(blocks, y); break;
        default: break;
        }
}

#endif
