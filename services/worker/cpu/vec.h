/* Vector helpers shared by the CPU kernels (cpu_ops.c, models/c_step/decode_step.c,
 * attention/cpu_paged_decode.c): fp32 lanes 8 at a time through GCC/clang vector extensions, bf16
 * conversions, e^x, a transposing lane sum. Included by each; cbuild.py puts this folder on the
 * include path and hashes this file into each library's cache key. */
#ifndef MYVLLM_VEC_H
#define MYVLLM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t i; float f; } u = {.i = ((uint32_t)x) << 16};
    return u.f;
}

/* Round to nearest even, as torch converts; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t i; } u = {.f = f};
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.i >> 16) | 0x40u);
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 8 lanes at a time through GCC/clang vector extensions: GCC does not vectorise the scalar
 * versions above (their bit casts go through memory), and a scalar loop here ran several times
 * slower than torch's ops. The scalar versions handle rows' tails (sizes not a multiple of 8). */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

static inline f32x8 load8_bf16(const uint16_t *p) {
#ifdef __AVX2__
    /* GCC's generic widening below compiled to a slower sequence: a bf16 GEMV streamed at well
     * under half the speed it reaches with these two instructions */
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    u16x8 h;
    memcpy(&h, p, sizeof h);
    return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
#endif
}

/* *p in all 8 lanes, one load-and-broadcast: GCC compiles the generic `(f32x8){0} + *p` to a
 * scalar add and a broadcast, an extra dependent instruction in the kernels' innermost loops. */
static inline f32x8 broadcast8(const float *p) {
#ifdef __AVX__
    return (f32x8)_mm256_broadcast_ss(p);
#else
    return (f32x8){0} + *p;
#endif
}

/* Transpose the 8x8 block of rows r[0..7] in place (r[i][j] <-> r[j][i]): three rounds of
 * shuffles in registers instead of 64 single-lane stores. */
static inline void transpose8x8(f32x8 r[8]) {
#ifdef __AVX__
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps((__m256)r[i], (__m256)r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps((__m256)r[i], (__m256)r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = (f32x8)_mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = (f32x8)_mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
#else
    for (int i = 0; i < 8; i++)
        for (int j = i + 1; j < 8; j++) {
            const float x = r[i][j];
            r[i][j] = r[j][i];
            r[j][i] = x;
        }
#endif
}

/* 8 lanes at element `offset` of an fp32 or (bf16) bf16 array, as fp32. */
static inline __attribute__((always_inline)) f32x8 load8_any(const void *p, int64_t offset, const int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)p + offset) : load8((const float *)p + offset);
}

/* The sum of 8 lanes in a fixed pairwise order (every machine of a build level sums alike). */
static inline float lane_sum8(f32x8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* bf16 rounding in fp32 lanes, one body for each vector width (F, U, I: the float, uint32 and
 * int32 vectors of as many lanes):
 * - ROUND_BITS(v): each lane's fp32 bits rounded to bf16 (nearest even, NaN stays a quiet NaN, as
 *   f32_to_bf16), the bf16 in the upper 16 bits of the lane (the lower 16 are garbage);
 * - ROUND(v): v rounded to bf16 precision, staying in fp32 lanes: no narrowing and widening back.
 *   NaN stays NaN: every NaN there comes from bf16 inputs, whose quiet bit is in the upper half
 *   the rounding keeps. */
#define DEFINE_BF16_ROUNDING(ROUND_BITS, ROUND, F, U, I)                                              \
    static inline U ROUND_BITS(F v) {                                                                 \
        const U bits = (U)v;                                                                          \
        /* a signed compare (AVX2 has no unsigned one): both sides are below 2^31 */                  \
        const U is_nan = (U)((I)(bits & 0x7fffffffu) > 0x7f800000);                                   \
        return ((bits + 0x7fffu + ((bits >> 16) & 1u)) & ~is_nan) | ((bits | 0x00400000u) & is_nan);  \
    }                                                                                                 \
    static inline F ROUND(F v) {                                                                      \
        const U bits = (U)v;                                                                          \
        return (F)((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);                             \
    }

DEFINE_BF16_ROUNDING(bf16_round_bits, round8_bf16, f32x8, u32x8, i32x8)

static inline u16x8 to_bf16x8(f32x8 v) {
    const u32x8 h = bf16_round_bits(v) >> 16; /* each lane < 2^16 */
#ifdef __AVX2__
    /* 32 -> 16 bit lanes: AVX2 has no truncating move (vpmovdw is AVX-512), and GCC's generic
     * conversion went lane by lane; an unsigned saturating pack of in-range lanes is the same. */
    const __m128i lo = _mm256_castsi256_si128((__m256i)h), hi = _mm256_extracti128_si256((__m256i)h, 1);
    return (u16x8)_mm_packus_epi32(lo, hi);
#else
    return __builtin_convertvector(h, u16x8);
#endif
}

static inline void store8_bf16(uint16_t *p, f32x8 v) {
    const u16x8 h = to_bf16x8(v);
    memcpy(p, &h, sizeof h);
}

/* 16 bf16 values as two fp32 vectors: the even elements (each 32-bit lane's low half shifted
 * up) and the odd ones (its high half, masked): two instructions for 16 values. */
static inline void load16_bf16_split(const uint16_t *p, f32x8 *even, f32x8 *odd) {
    u32x8 raw;
    memcpy(&raw, p, sizeof raw);
    *even = (f32x8)(raw << 16);
    *odd = (f32x8)(raw & 0xffff0000u);
}

/* The inverse: even and odd elements rounded to bf16 (bf16_round_bits) and stored as 16 values
 * in order, each 32-bit lane holding one of each. About half the instructions of two
 * store8_bf16 (no narrowing pack across lanes). */
static inline void store16_bf16_split(uint16_t *p, f32x8 even, f32x8 odd) {
    const u32x8 both = (bf16_round_bits(odd) & 0xffff0000u) | (bf16_round_bits(even) >> 16);
    memcpy(p, &both, sizeof both);
}

/* a * b + c with one rounding where the CPU has FMA (x86-64-v3 has), whatever the build's
 * -ffp-contract: the fused ops' libraries turn contraction off (their products and sums round
 * where HF's do), but exp8's polynomial has no torch counterpart to match, and unfused it was
 * a third of SiLU·up's instructions; the decode step's GEMV accumulates with it. */
static inline __attribute__((always_inline)) f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#ifdef __FMA__
    return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline f32x8 min8(f32x8 a, f32x8 b) {
#ifdef __AVX__
    return (f32x8)_mm256_min_ps((__m256)a, (__m256)b);
#else
    const i32x8 lt = a < b; /* b where either is NaN, as minps */
    return (f32x8)(((i32x8)a & lt) | ((i32x8)b & ~lt));
#endif
}

static inline f32x8 max8(f32x8 a, f32x8 b) {
#ifdef __AVX__
    return (f32x8)_mm256_max_ps((__m256)a, (__m256)b);
#else
    const i32x8 gt = a > b;
    return (f32x8)(((i32x8)a & gt) | ((i32x8)b & ~gt));
#endif
}

/* e^x for x in [-87, 89] (clamped; inf from about 88.7 on, as expf): Cephes-style range
 * reduction + degree-6 polynomial, relative error ~2e-7. One body for each vector width (F: the
 * float vector, I: the int32 vector of as many lanes, and their min, max and fma), so that 8 and
 * 16 lanes compute the same values. */
#define DEFINE_EXP(NAME, F, I, MIN, MAX, FMA)                                                              \
    static inline F NAME(F x) {                                                                            \
        const F zero = {0};                                                                                \
        x = MIN(MAX(x, zero - 87.0f), zero + 89.0f);                                                       \
        const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */         \
        const F r = x - n * 0.693359375f + n * 2.12194440e-4f;                                             \
        F p = zero + 1.9875691500e-4f;                                                                     \
        p = FMA(p, r, zero + 1.3981999507e-3f);                                                            \
        p = FMA(p, r, zero + 8.3334519073e-3f);                                                            \
        p = FMA(p, r, zero + 4.1665795894e-2f);                                                            \
        p = FMA(p, r, zero + 1.6666665459e-1f);                                                            \
        p = FMA(p, r, zero + 5.0000001201e-1f);                                                            \
        p = FMA(p * r, r, r) + 1.0f;                                                                       \
        const I two_n = (__builtin_convertvector(n, I) + 127) << 23;                                       \
        return p * (F)two_n;                                                                               \
    }

DEFINE_EXP(exp8, f32x8, i32x8, min8, max8, fma8)

static inline float exp1(float x) {
    f32x8 v = {x};
    return exp8(v)[0];
}

/* The lane sums of 8 vectors as one vector: out[i] = sum(v[i]). */
static inline f32x8 sum8x8(const f32x8 v[8]) {
#ifdef __AVX2__
    const __m256 t0 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), t1 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), t3 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (per 128-bit half), u1 likewise for 4..7 */
    return (f32x8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    f32x8 out;
    for (int i = 0; i < 8; i++) {
        float s = 0.f;
        for (int j = 0; j < 8; j++) s += v[i][j];
        out[i] = s;
    }
    return out;
#endif
}

#ifdef __AVX512F__
/* 16 lanes (zmm), for the kernels' AVX-512 paths (built at cbuild's avx512 levels). The same
 * arithmetic per element as the 8-lane helpers above, so either width gives the same bits. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 min16(f32x16 a, f32x16 b) { return (f32x16)_mm512_min_ps((__m512)a, (__m512)b); }
static inline f32x16 max16(f32x16 a, f32x16 b) { return (f32x16)_mm512_max_ps((__m512)a, (__m512)b); }
static inline __attribute__((always_inline)) f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

DEFINE_EXP(exp16, f32x16, i32x16, min16, max16, fma16)

static inline f32x16 load16(const float *p) { return (f32x16)_mm512_loadu_ps(p); }
static inline void store16(float *p, f32x16 v) { _mm512_storeu_ps(p, (__m512)v); }

DEFINE_BF16_ROUNDING(bf16_round_bits16, round16_bf16, f32x16, u32x16, i32x16)

static inline f32x16 load16_bf16(const uint16_t *p) {
    return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}

/* 32 -> 16 bit lanes in one instruction (vpmovdw), where AVX2 needed a pack across halves */
static inline void store16_bf16(uint16_t *p, f32x16 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)(bf16_round_bits16(v) >> 16)));
}

/* load16_bf16_split and store16_bf16_split, 32 values: even and odd elements as two vectors */
static inline void load32_bf16_split(const uint16_t *p, f32x16 *even, f32x16 *odd) {
    const u32x16 raw = (u32x16)_mm512_loadu_si512(p);
    *even = (f32x16)(raw << 16);
    *odd = (f32x16)(raw & 0xffff0000u);
}

static inline void store32_bf16_split(uint16_t *p, f32x16 even, f32x16 odd) {
    const u32x16 both = (bf16_round_bits16(odd) & 0xffff0000u) | (bf16_round_bits16(even) >> 16);
    _mm512_storeu_si512(p, (__m512i)both);
}
#endif

#endif
