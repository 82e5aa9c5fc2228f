/* Paged decode attention for CPUs: one query token per request, K/V read in place from
 * the paged cache (no gather copy), GQA, fp32 or bf16 cache, fp32 math.
 *
 * Built at first use by cpu_backend.py (gcc -O3 -march=x86-64-v3 -fopenmp on AVX2 machines).
 *
 * Why it looks like this:
 * - Decode attention is bound by reading the cache (at 64 requests of ~400 tokens the fp32
 *   cache read per step is about twice the model's weights), so the unit of work reads whole
 *   contiguous cache rows: one token's K (or V) for every KV head of the unit is one
 *   contiguous run and a block of them is one contiguous run, which the hardware prefetcher
 *   follows. (Software prefetching of the next block measured 4x slower: it filled the
 *   line-fill buffers and stalled.)
 * - Threads come from OpenMP. The process's libgomp is torch's own (same soname, already
 *   loaded), so this kernel runs on the very worker threads torch's ops use instead of
 *   fighting them for the cores.
 * - Units are (request, range of KV heads): whole requests when there are enough of them
 *   to keep every thread busy, single KV heads otherwise (batch 1 still uses every thread).
 * - exp() is a polynomial (relative error ~2e-7) evaluated 8 lanes at a time with vector
 *   extensions, not libm's scalar call: there are ~10 scores per cached token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const float *q;             /* [B, H, D] */
    const void *k_cache;        /* [num_blocks, BS, KVH, D] */
    const void *v_cache;
    const int32_t *block_table; /* [B, bt_stride] */
    const int32_t *seq_lens;    /* [B] */
    float *out;                 /* [B, H, D] */
    int64_t bt_stride;
    int H, KVH, D, BS, is_bf16;
    float scale;
} Args;

/* e^x for x <= 0 (scores minus their max): Cephes-style range reduction + degree-6 poly. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* exp_neg on 8 lanes (GCC/clang vector extensions): GCC will not vectorise the scalar version
 * (its int-to-float bit cast goes through memory), and a scalar exp per score was ~15% of the
 * kernel. Same polynomial; rounding to nearest by the 1.5 * 2^23 trick instead of floor(y + .5). */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 exp_neg8(f32x8 x) {
    const f32x8 zero = {0};
    const f32x8 lowest = zero - 87.0f;
    const i32x8 clamp = x < lowest;  /* all-ones lanes where x is below the clamp */
    x = (f32x8)(((i32x8)x & ~clamp) | ((i32x8)lowest & clamp));
    const f32x8 y = x * 1.44269504088896341f;
    const f32x8 n = (y + 12582912.0f) - 12582912.0f;
    const f32x8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    f32x8 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32x8 two_n = (__builtin_convertvector(n, i32x8) + 127) << 23;
    return p * (f32x8)two_n;
}

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t i; float f; } u = {.i = ((uint32_t)x) << 16};
    return u.f;
}

/* Pointer to `n` cache elements at `offset` as fp32: in place for fp32 caches, converted
 * into `tmp` for bf16 ones. */
static inline const float *as_f32(const void *cache, int64_t offset, int n, int is_bf16, float *restrict tmp) {
    if (!is_bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    for (int i = 0; i < n; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

/* Attend request b's query heads of KV heads [kh0, kh1). scores: [nh, L], acc: [nh, D],
 * tmp: [KVH * D] scratch for bf16 rows. Always inlined into per-head-size copies below, so
 * the common head sizes get loops of a known length (25% faster than a runtime D). */
static inline __attribute__((always_inline)) void attend_impl(const Args *a, int b, int kh0, int kh1,
                                                              float *restrict scores, float *restrict acc,
                                                              float *restrict tmp, const int D) {
    const int G = a->H / a->KVH, BS = a->BS, L = a->seq_lens[b];
    const int nkv = kh1 - kh0, nh = nkv * G, width = nkv * D;
    const int64_t row = (int64_t)a->KVH * D; /* elements per cached token */
    const float *restrict q = a->q + ((int64_t)b * a->H + (int64_t)kh0 * G) * D;
    const int32_t *bt = a->block_table + (int64_t)b * a->bt_stride;
    const int nblocks = (L + BS - 1) / BS;

    /* Pass 1: scores[h, t] = scale * q_h . k_t */
    for (int blk = 0; blk < nblocks; blk++) {
        const int64_t base = (int64_t)bt[blk] * BS * row + (int64_t)kh0 * D;
        const int n = L - blk * BS < BS ? L - blk * BS : BS;
        for (int t = 0; t < n; t++) {
            const float *restrict k = as_f32(a->k_cache, base + t * row, width, a->is_bf16, tmp);
            const int pos = blk * BS + t;
            for (int j = 0; j < nkv; j++) {
                const float *restrict kj = k + (int64_t)j * D;
                for (int h = j * G; h < (j + 1) * G; h++) {
                    const float *restrict qh = q + (int64_t)h * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++) s += qh[d] * kj[d];
                    scores[(int64_t)h * L + pos] = s * a->scale;
                }
            }
        }
    }

    /* Softmax numerators; the 1/sum is applied to the output at the end. */
    float inv_sum[nh];
    for (int h = 0; h < nh; h++) {
        float *restrict sh = scores + (int64_t)h * L;
        float m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < L; t++) m = sh[t] > m ? sh[t] : m;
        f32x8 sum8 = {0};
        int t = 0;
        for (; t + 8 <= L; t += 8) {
            f32x8 v;
            memcpy(&v, sh + t, sizeof v);
            v = exp_neg8(v - m);
            memcpy(sh + t, &v, sizeof v);
            sum8 += v;
        }
        for (int i = 0; i < 8; i++) sum += sum8[i];
        for (; t < L; t++) {
            sh[t] = exp_neg(sh[t] - m);
            sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
    }

    /* Pass 2: acc[h] = sum_t p[h, t] * v_t */
    memset(acc, 0, sizeof(float) * (size_t)nh * D);
    for (int blk = 0; blk < nblocks; blk++) {
        const int64_t base = (int64_t)bt[blk] * BS * row + (int64_t)kh0 * D;
        const int n = L - blk * BS < BS ? L - blk * BS : BS;
        for (int t = 0; t < n; t++) {
            const float *restrict v = as_f32(a->v_cache, base + t * row, width, a->is_bf16, tmp);
            const int pos = blk * BS + t;
            for (int j = 0; j < nkv; j++) {
                const float *restrict vj = v + (int64_t)j * D;
                for (int h = j * G; h < (j + 1) * G; h++) {
                    const float p = scores[(int64_t)h * L + pos];
                    float *restrict ah = acc + (int64_t)h * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += p * vj[d];
                }
            }
        }
    }

    float *restrict o = a->out + ((int64_t)b * a->H + (int64_t)kh0 * G) * D;
    for (int h = 0; h < nh; h++)
        for (int d = 0; d < D; d++) o[(int64_t)h * D + d] = acc[(int64_t)h * D + d] * inv_sum[h];
}

static void attend_d64(const Args *a, int b, int kh0, int kh1, float *s, float *acc, float *tmp) {
    attend_impl(a, b, kh0, kh1, s, acc, tmp, 64);
}
static void attend_d128(const Args *a, int b, int kh0, int kh1, float *s, float *acc, float *tmp) {
    attend_impl(a, b, kh0, kh1, s, acc, tmp, 128);
}
static void attend_any(const Args *a, int b, int kh0, int kh1, float *s, float *acc, float *tmp) {
    attend_impl(a, b, kh0, kh1, s, acc, tmp, a->D);
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, const int32_t *block_table,
                 int64_t bt_stride, const int32_t *seq_lens, float *out, int B, int H, int KVH, int D, int BS,
                 float scale, int is_bf16, int num_threads) {
    const Args a = {q, k_cache, v_cache, block_table, seq_lens, out, bt_stride, H, KVH, D, BS, is_bf16, scale};
    if (num_threads < 1) num_threads = 1;
    int max_len = 0;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Whole requests when there are a few per thread; otherwise split them by KV head. */
    const int heads_per_unit = B >= 4 * num_threads ? KVH : 1;
    const int units_per_req = KVH / heads_per_unit, num_units = B * units_per_req;
    if (num_threads > num_units) num_threads = num_units > 0 ? num_units : 1;
    const int nh = heads_per_unit * (H / KVH);
    const size_t per_thread = (size_t)nh * max_len + (size_t)nh * D + (size_t)KVH * D;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return -1;
    void (*attend)(const Args *, int, int, int, float *, float *, float *) =
        D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int u = 0; u < num_units; u++) {
#ifdef _OPENMP
        float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *mine = scratch;
#endif
        const int b = u / units_per_req, kh0 = (u % units_per_req) * heads_per_unit;
        attend(&a, b, kh0, kh0 + heads_per_unit, mine, mine + (size_t)nh * max_len,
               mine + (size_t)nh * max_len + (size_t)nh * D);
    }
    free(scratch);
    return 0;
}

/* exp_neg over n values the way the kernel's softmax applies it (8 lanes at a time, the
 * scalar version on the tail): exported so the tests can check its accuracy directly. */
void exp_neg_lanes(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        f32x8 v;
        memcpy(&v, x + i, sizeof v);
        v = exp_neg8(v);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] = exp_neg(x[i]);
}
