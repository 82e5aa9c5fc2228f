/* LoRA adapters' products per token for CPUs (Punica's BGMV): each token reads only its own
 * slot's A and B, where the dense masked GEMMs (lora/apply.py) multiply every slot's and mask all
 * but one: at decode sizes their dispatches and the slots' wasted products cost more than the
 * products a token needs. Built at first use by lora/cpu_lora.py (cpu/cbuild.py).
 *
 * Tables (lora/apply.py GroupTable, one layer): A [P * S * R (+ zero rows), K] part-major (part,
 * slot, rank rows), B [N, b_stride] block-diagonal over the P fused parts; part p owns output columns
 * [part_starts[p], part_starts[p + 1]). fp32 or bf16 (is_bf16: y, x, A and B alike); products
 * and sums in fp32, y rounded once. A token with slot -1 (the base model) is not touched. */
#include "vec.h"

#define MAX_PARTS 3

static inline float dot_any(const void *a, int64_t a_off, const float *restrict x, int n, const int bf16) {
    f32x8 acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += load8_any(a, a_off + i, bf16) * load8(x + i);
    float sum = lane_sum8(acc);
    for (; i < n; i++)
        sum += (bf16 ? bf16_to_f32(((const uint16_t *)a)[a_off + i]) : ((const float *)a)[a_off + i]) * x[i];
    return sum;
}

void lora_bgmv(void *y, int64_t y_stride, const void *x, int64_t x_stride, const void *a, const void *b,
               int64_t b_stride, const int32_t *slots, int T, int K, int N, int P, int S, int R,
               const int32_t *part_starts, int is_bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (T > 1)
    for (int t = 0; t < T; t++) {
        const int s = slots[t];
        if (s < 0) continue;
        float xs[K], u[MAX_PARTS * R];
        for (int k = 0; k < K; k++)
            xs[k] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[t * x_stride + k]) : ((const float *)x)[t * x_stride + k];
        for (int p = 0; p < P; p++)
            for (int r = 0; r < R; r++)
                u[p * R + r] = dot_any(a, ((int64_t)(p * S + s) * R + r) * K, xs, K, is_bf16);
        for (int p = 0; p < P; p++) {
            const int64_t col0 = (int64_t)(p * S + s) * R;
            for (int c = part_starts[p]; c < part_starts[p + 1]; c++) {
                const float delta = dot_any(b, c * b_stride + col0, u + p * R, R, is_bf16);
                if (is_bf16) {
                    uint16_t *yc = (uint16_t *)y + t * y_stride + c;
                    *yc = f32_to_bf16(bf16_to_f32(*yc) + delta);
                } else {
                    ((float *)y)[t * y_stride + c] += delta;
                }
            }
        }
    }
}
