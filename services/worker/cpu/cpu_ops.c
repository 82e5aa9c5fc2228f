/* Fused elementwise ops of a decoder layer for CPUs: RMSNorm (with the residual add folded
 * in), SiLU(gate) * up, and neox RoPE applied in place. fp32 or bf16 tensors.
 *
 * Built at first use by cpu_ops.py (cpu/cbuild.py: a fixed x86-64 level, -fopenmp on torch's
 * own libgomp threads, and -ffp-contract=off: no a*b+c is fused into one rounding).
 *
 * Why: eagerly each of these is several torch ops (RMSNorm's pow/mean/rsqrt/mul/mul, RoPE's
 * two muls, a cat, a neg and an add, SiLU then a mul, the residual add), each a dispatch and a
 * pass over memory. On the standard throughput workload they were about a fifth of the step.
 * Here each is one pass.
 *
 * Arithmetic: each op rounds where HF transformers' eager code rounds, so fp32 results equal
 * torch's up to the order of RMSNorm's sum of squares and exp()'s last bits, and bf16 results
 * round to bf16 at the same points as HF's bf16 ops (the residual add, the normalised value
 * before the weight, SiLU before the multiply, each RoPE product and their sum).
 *
 * The per-row arithmetic is in row_ops.h, shared with the whole-step decode kernel
 * (models/c_step/decode_step.c), so both paths round alike.
 */
#include "row_ops.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* below this one thread is faster than waking the others */

/* out[m] = w * (x[m] / rms(x[m])); x rows `x_stride` elements apart, out contiguous. */
void rms_norm(const void *x, int64_t x_stride, void *out, const void *w, int M, int H, float eps, int is_bf16,
              int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * H >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++)
        rms_norm_row((const char *)x + (size_t)m * x_stride * es, w, (char *)out + (size_t)m * H * es, H, eps, is_bf16);
}

/* residual[m] += x[m]; x[m] = w * (residual[m] / rms(residual[m])). Both [M, H] contiguous. */
void fused_add_rms_norm(void *x, void *residual, const void *w, int M, int H, float eps, int is_bf16,
                        int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * H >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++)
        add_rms_norm_row((char *)x + (size_t)m * H * es, (char *)residual + (size_t)m * H * es, w, H, eps, is_bf16);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]; gu [M, 2I], out [M, I], both contiguous. */
void silu_and_mul(const void *gu, void *out, int M, int I, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * I >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++) {
        const char *g = (const char *)gu + (size_t)m * 2 * I * es;
        silu_mul_row(g, g + (size_t)I * es, (char *)out + (size_t)m * I * es, I, is_bf16);
    }
}

/* Neox RoPE in place: x[t, h] (heads of D elements, rows `row_stride` elements apart) becomes
 * x * cos + rotate_half(x) * sin with cos/sin rows [D] (fp32 tables) at positions[t]. */
void rope_neox(void *x, int64_t row_stride, int T, int nheads, int D, const int64_t *positions,
               const float *cos_table, const float *sin_table, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)T * nheads * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++)
        rope_row((char *)x + (size_t)t * row_stride * es, nheads, D, cos_table + positions[t] * (int64_t)D,
                 sin_table + positions[t] * (int64_t)D, is_bf16);
}

static inline int any_lane(i32x8 mask) {
#ifdef __AVX__
    return _mm256_movemask_ps((__m256)mask) != 0;
#else
    int any = 0;
    for (int k = 0; k < 8; k++) any |= mask[k];
    return any;
#endif
}

/* The first index of row's largest value, or of its first NaN if it holds one: torch.max(dim)'s
 * index. Two passes over the row (one vocabulary row stays in the L2 between them): the largest
 * value with 8-lane maxima (and whether any lane saw a NaN), then the first index holding it.
 * max8 drops NaNs, hence the separate check; -0.0 and 0.0 compare equal, so the first wins. */
static int64_t argmax_row(const void *row, int n, int bf16) {
    const float *f = row;
    const uint16_t *h = row;
    f32x8 m0 = broadcast8(&(const float){-__builtin_inff()}), m1 = m0;
    i32x8 nan = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const f32x8 a = bf16 ? load8_bf16(h + i) : load8(f + i), b = bf16 ? load8_bf16(h + i + 8) : load8(f + i + 8);
        m0 = max8(m0, a), m1 = max8(m1, b);
        nan |= (a != a) | (b != b);
    }
    float best = -__builtin_inff();
    int has_nan = 0;
    for (int j = 0; j < 8; j++) {
        best = m0[j] > best ? m0[j] : best;
        best = m1[j] > best ? m1[j] : best;
        has_nan |= nan[j];
    }
    for (int j = i; j < n; j++) {
        const float v = bf16 ? bf16_to_f32(h[j]) : f[j];
        has_nan |= v != v;
        best = v > best ? v : best;
    }
    const f32x8 target = broadcast8(&best);
    int j = 0;
    for (; j + 8 <= n; j += 8) { /* the first block of 8 that holds it, then its lane */
        const f32x8 v = bf16 ? load8_bf16(h + j) : load8(f + j);
        if (any_lane(has_nan ? v != v : v == target)) break;
    }
    for (; j < n; j++) {
        const float v = bf16 ? bf16_to_f32(h[j]) : f[j];
        if (has_nan ? v != v : v == best) return j;
    }
    return 0; /* an empty row (a row of -inf returns 0 above: -inf == best) */
}

/* ids[m] = argmax_row(x[m]) for M rows of N values, `stride` elements apart (int64 ids). */
void argmax_rows(const void *x, int64_t stride, int M, int N, int64_t *ids, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * N >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++) ids[m] = argmax_row((const char *)x + (size_t)m * stride * es, N, is_bf16);
}
