/* A mixture-of-experts layer's routing of one token, as models/moe.py's `route` computes it after
 * the router's linear layer: logits = h . router^T (one fp32 sum per expert, rounded to the
 * model's dtype as the torch router's output is), softmax over the experts in fp32, the top k
 * (descending), optionally renormalised over the k, the weights rounded to the model's dtype
 * unless they stay fp32. For packed_step.c (AVX-512 builds). */
#ifndef MYVLLM_MOE_ROUTE_H
#define MYVLLM_MOE_ROUTE_H

#include <math.h>
#include <stdint.h>

#include "vec.h"

#ifdef __AVX512F__
/* The dot product of an fp32 or bf16 row of n values with another of the same dtype, in fp32. */
static inline float dot_row(const void *a, const void *b, int n, int bf16) {
    f32x16 acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const f32x16 x = bf16 ? load16_bf16((const uint16_t *)a + i) : load16((const float *)a + i);
        const f32x16 y = bf16 ? load16_bf16((const uint16_t *)b + i) : load16((const float *)b + i);
        acc = fma16(x, y, acc);
    }
    float sum = _mm512_reduce_add_ps((__m512)acc);
    for (; i < n; i++)
        sum += bf16 ? bf16_to_f32(((const uint16_t *)a)[i]) * bf16_to_f32(((const uint16_t *)b)[i])
                    : ((const float *)a)[i] * ((const float *)b)[i];
    return sum;
}

/* Token row h [H] (model dtype) through the router [E, H]: its k experts (ids, int64) and their
 * weights (fp32 values, already rounded to bf16 where the layer's weights are bf16). probs: E
 * floats of scratch. Exact ties at the k-th place go to the lower expert index (torch's CPU topk
 * picks either; the order among the chosen k does not matter, the experts' sum runs in
 * ascending expert order). */
static inline void route_row(const void *h, const void *router, int H, int E, int k, int bf16, int renormalize,
                             int weights_fp32, float *probs, int64_t *ids, float *weights) {
    const size_t es = bf16 ? 2 : 4;
    float max = -INFINITY;
    for (int e = 0; e < E; e++) {
        const float logit = dot_row(h, (const char *)router + (size_t)e * H * es, H, bf16);
        probs[e] = bf16 ? round_bf16(logit) : logit;
        max = probs[e] > max ? probs[e] : max;
    }
    float sum = 0.f;
    for (int e = 0; e < E; e++) {
        probs[e] = expf(probs[e] - max);
        sum += probs[e];
    }
    for (int e = 0; e < E; e++) probs[e] /= sum;
    float chosen = 0.f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
        ids[j] = best;
        weights[j] = probs[best];
        chosen += probs[best];
        probs[best] = -1.f; /* taken */
    }
    for (int j = 0; j < k; j++) {
        const float w = renormalize ? weights[j] / chosen : weights[j];
        weights[j] = bf16 && !weights_fp32 ? round_bf16(w) : w;
    }
}
#endif

#endif
