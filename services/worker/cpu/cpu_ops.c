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
 */
#include "vec.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* below this one thread is faster than waking the others */

/* Row helpers, fp32 math; `bf16` rows are converted on load and rounded on store. */
static inline float sum_squares(const void *row, int n, int bf16) {
    f32x8 acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const f32x8 v = bf16 ? load8_bf16((const uint16_t *)row + i) : load8((const float *)row + i);
        acc += v * v;
    }
    float ss = 0.f;
    for (int j = 0; j < 8; j++) ss += acc[j];
    for (; i < n; i++) {
        const float v = bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
        ss += v * v;
    }
    return ss;
}

/* out = w * (x * inv): HF's order; bf16 rounds x * inv before the weight, like HF's cast. */
static inline void scale_row(const void *x, const void *w, void *out, int n, float inv, int bf16) {
    int i = 0;
    if (!bf16) {
        const float *xr = x, *wr = w;
        float *o = out;
        for (; i + 8 <= n; i += 8) store8(o + i, load8(wr + i) * (load8(xr + i) * inv));
        for (; i < n; i++) o[i] = wr[i] * (xr[i] * inv);
    } else {
        const uint16_t *xr = x, *wr = w;
        uint16_t *o = out;
        for (; i + 8 <= n; i += 8) store8_bf16(o + i, load8_bf16(wr + i) * round8_bf16(load8_bf16(xr + i) * inv));
        for (; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(wr[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

/* out[m] = w * (x[m] / rms(x[m])); x rows `x_stride` elements apart, out contiguous. */
void rms_norm(const void *x, int64_t x_stride, void *out, const void *w, int M, int H, float eps, int is_bf16,
              int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * H >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++) {
        const char *xr = (const char *)x + (size_t)m * x_stride * es;
        const float inv = 1.0f / sqrtf(sum_squares(xr, H, is_bf16) / (float)H + eps);
        scale_row(xr, w, (char *)out + (size_t)m * H * es, H, inv, is_bf16);
    }
}

/* residual[m] += x[m]; x[m] = w * (residual[m] / rms(residual[m])). Both [M, H] contiguous. */
void fused_add_rms_norm(void *x, void *residual, const void *w, int M, int H, float eps, int is_bf16,
                        int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * H >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++) {
        char *xr = (char *)x + (size_t)m * H * es, *rr = (char *)residual + (size_t)m * H * es;
        int i = 0;
        if (!is_bf16) {
            float *xf = (float *)xr, *rf = (float *)rr;
            for (; i + 8 <= H; i += 8) store8(rf + i, load8(rf + i) + load8(xf + i));
            for (; i < H; i++) rf[i] = rf[i] + xf[i];
        } else {
            uint16_t *xh = (uint16_t *)xr, *rh = (uint16_t *)rr;
            for (; i + 8 <= H; i += 8) store8_bf16(rh + i, load8_bf16(rh + i) + load8_bf16(xh + i));
            for (; i < H; i++) rh[i] = f32_to_bf16(bf16_to_f32(rh[i]) + bf16_to_f32(xh[i]));
        }
        const float inv = 1.0f / sqrtf(sum_squares(rr, H, is_bf16) / (float)H + eps);
        scale_row(rr, w, xr, H, inv, is_bf16);
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]; gu [M, 2I], out [M, I], both contiguous.
 * silu(g) = g / (1 + e^-g), torch's formula; bf16 rounds silu(g) before the multiply, as HF. */
void silu_and_mul(const void *gu, void *out, int M, int I, int is_bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)M * I >= PARALLEL_MIN_ELEMENTS)
    for (int m = 0; m < M; m++) {
        int i = 0;
        if (!is_bf16) {
            const float *g = (const float *)gu + (size_t)m * 2 * I, *u = g + I;
            float *o = (float *)out + (size_t)m * I;
            for (; i + 8 <= I; i += 8) {
                const f32x8 gv = load8(g + i);
                store8(o + i, (gv / (1.0f + exp8(-gv))) * load8(u + i));
            }
            for (; i < I; i++) o[i] = (g[i] / (1.0f + exp1(-g[i]))) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)gu + (size_t)m * 2 * I, *u = g + I;
            uint16_t *o = (uint16_t *)out + (size_t)m * I;
            for (; i + 8 <= I; i += 8) {
                const f32x8 gv = load8_bf16(g + i);
                store8_bf16(o + i, round8_bf16(gv / (1.0f + exp8(-gv))) * load8_bf16(u + i));
            }
            for (; i < I; i++) {
                const float gv = bf16_to_f32(g[i]);
                o[i] = f32_to_bf16(round_bf16(gv / (1.0f + exp1(-gv))) * bf16_to_f32(u[i]));
            }
        }
    }
}

/* One neox rotation of a head's pair of halves, fp32 or bf16 (each product and the sum rounded
 * to bf16 as HF's bf16 ops do, cos/sin cast to bf16 first as HF casts them). */
static inline void rotate(void *head, const float *c, const float *s, int half, int bf16) {
    int i = 0;
    if (!bf16) {
        float *v = head;
        for (; i + 8 <= half; i += 8) {
            const f32x8 x1 = load8(v + i), x2 = load8(v + half + i);
            store8(v + i, x1 * load8(c + i) + (-x2) * load8(s + i));
            store8(v + half + i, x2 * load8(c + half + i) + x1 * load8(s + half + i));
        }
        for (; i < half; i++) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] + (-x2) * s[i];
            v[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    } else {
        uint16_t *v = head;
        for (; i + 8 <= half; i += 8) {
            const f32x8 x1 = load8_bf16(v + i), x2 = load8_bf16(v + half + i);
            const f32x8 c1 = round8_bf16(load8(c + i)), s1 = round8_bf16(load8(s + i));
            const f32x8 c2 = round8_bf16(load8(c + half + i)), s2 = round8_bf16(load8(s + half + i));
            store8_bf16(v + i, round8_bf16(x1 * c1) + round8_bf16((-x2) * s1));
            store8_bf16(v + half + i, round8_bf16(x2 * c2) + round8_bf16(x1 * s2));
        }
        for (; i < half; i++) {
            const float x1 = bf16_to_f32(v[i]), x2 = bf16_to_f32(v[i + half]);
            const float c1 = round_bf16(c[i]), s1 = round_bf16(s[i]);
            const float c2 = round_bf16(c[i + half]), s2 = round_bf16(s[i + half]);
            v[i] = f32_to_bf16(round_bf16(x1 * c1) + round_bf16((-x2) * s1));
            v[i + half] = f32_to_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2));
        }
    }
}

/* Neox RoPE in place: x[t, h] (heads of D elements, rows `row_stride` elements apart) becomes
 * x * cos + rotate_half(x) * sin with cos/sin rows [D] (fp32 tables) at positions[t]. */
void rope_neox(void *x, int64_t row_stride, int T, int nheads, int D, const int64_t *positions,
               const float *cos_table, const float *sin_table, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)T * nheads * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * (int64_t)D, *s = sin_table + positions[t] * (int64_t)D;
        char *row = (char *)x + (size_t)t * row_stride * es;
        for (int h = 0; h < nheads; h++) rotate(row + (size_t)h * D * es, c, s, D / 2, is_bf16);
    }
}
