/* Row-level arithmetic of the fused elementwise ops, shared by cpu_ops.c (one op over many rows)
 * and models/c_step/decode_step.c (the whole decode step in one call), so both round exactly
 * alike. fp32 math; `bf16` rows are converted on load and rounded on store where HF's bf16 ops
 * round. Compile with -ffp-contract=off (no a*b+c fused into one rounding). */
#ifndef MYVLLM_ROW_OPS_H
#define MYVLLM_ROW_OPS_H

#include "vec.h"

static inline float sum_squares(const void *row, int n, int bf16) {
    f32x8 acc = {0};
    int i = 0;
    if (bf16) /* 16 at a time, split (vec.h): which lane sums which square does not matter */
        for (; i + 16 <= n; i += 16) {
            f32x8 e, o;
            load16_bf16_split((const uint16_t *)row + i, &e, &o);
            acc += e * e;
            acc += o * o;
        }
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
        for (; i + 16 <= n; i += 16) { /* split 16 at a time (vec.h): the same arithmetic per element */
            f32x8 xe, xo, we, wo;
            load16_bf16_split(xr + i, &xe, &xo);
            load16_bf16_split(wr + i, &we, &wo);
            store16_bf16_split(o + i, we * round8_bf16(xe * inv), wo * round8_bf16(xo * inv));
        }
        for (; i + 8 <= n; i += 8) store8_bf16(o + i, load8_bf16(wr + i) * round8_bf16(load8_bf16(xr + i) * inv));
        for (; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(wr[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

/* out = w * (x / rms(x)) over one row of n. */
static inline void rms_norm_row(const void *x, const void *w, void *out, int n, float eps, int bf16) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n, bf16) / (float)n + eps);
    scale_row(x, w, out, n, inv, bf16);
}

/* residual += x; x = w * (residual / rms(residual)): vLLM's residual form, HF's adds. */
static inline void add_rms_norm_row(void *x, void *residual, const void *w, int n, float eps, int bf16) {
    int i = 0;
    if (!bf16) {
        float *xf = (float *)x, *rf = (float *)residual;
        for (; i + 8 <= n; i += 8) store8(rf + i, load8(rf + i) + load8(xf + i));
        for (; i < n; i++) rf[i] = rf[i] + xf[i];
    } else {
        uint16_t *xh = (uint16_t *)x, *rh = (uint16_t *)residual;
        for (; i + 16 <= n; i += 16) {
            f32x8 re, ro, xe, xo;
            load16_bf16_split(rh + i, &re, &ro);
            load16_bf16_split(xh + i, &xe, &xo);
            store16_bf16_split(rh + i, re + xe, ro + xo);
        }
        for (; i + 8 <= n; i += 8) store8_bf16(rh + i, load8_bf16(rh + i) + load8_bf16(xh + i));
        for (; i < n; i++) rh[i] = f32_to_bf16(bf16_to_f32(rh[i]) + bf16_to_f32(xh[i]));
    }
    rms_norm_row(residual, w, x, n, eps, bf16);
}

/* out[i] = silu(g[i]) * u[i] over I values; silu(g) = g / (1 + e^-g), torch's formula; bf16
 * rounds silu(g) before the multiply, as HF. */
static inline void silu_mul_row(const void *gate, const void *up, void *out, int I, int bf16) {
    int i = 0;
    if (!bf16) {
        const float *g = gate, *u = up;
        float *o = out;
#ifdef __AVX512F__
        for (; i + 16 <= I; i += 16) {
            const f32x16 gv = load16(g + i);
            store16(o + i, (gv / (1.0f + exp16(-gv))) * load16(u + i));
        }
#endif
        for (; i + 8 <= I; i += 8) {
            const f32x8 gv = load8(g + i);
            store8(o + i, (gv / (1.0f + exp8(-gv))) * load8(u + i));
        }
        for (; i < I; i++) o[i] = (g[i] / (1.0f + exp1(-g[i]))) * u[i];
    } else {
        const uint16_t *g = gate, *u = up;
        uint16_t *o = out;
#ifdef __AVX512F__
        /* 32 at a time, split into even and odd elements (vec.h) */
        for (; i + 32 <= I; i += 32) {
            f32x16 ge, go, ue, uo;
            load32_bf16_split(g + i, &ge, &go);
            load32_bf16_split(u + i, &ue, &uo);
            store32_bf16_split(o + i, round16_bf16(ge / (1.0f + exp16(-ge))) * ue,
                               round16_bf16(go / (1.0f + exp16(-go))) * uo);
        }
#endif
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

/* Every one of a row's `nheads` heads of D rotated in place by cos/sin rows c, s ([D], fp32). */
static inline void rope_row(void *row, int nheads, int D, const float *c, const float *s, int bf16) {
    const size_t es = bf16 ? 2 : 4;
    for (int h = 0; h < nheads; h++) rotate((char *)row + (size_t)h * D * es, c, s, D / 2, bf16);
}

#endif
