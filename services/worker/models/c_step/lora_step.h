/* LoRA adapters inside the packed step (packed_step.c): the products lora/apply.py adds in the
 * eager forward, on the same slot tables packed for gemm.c, so that a step whose requests use
 * adapters keeps the one-call step. Per projection, after its base GEMM:
 *   shrunk = x . A^T            every slot's rank columns ([T, width], part-major: part, slot, rank)
 *   shrunk[t] masked            all but token t's own slot's columns zeroed (all of a base token's)
 *   y += shrunk . B^T           B block-diagonal over the fused parts, scaling folded in
 * Two dense GEMMs per projection, work proportional to the slots rather than to the adapters a
 * step uses (as the eager products); the masked zeros add nothing. */
#ifndef MYVLLM_LORA_STEP_H
#define MYVLLM_LORA_STEP_H

#include <stdint.h>
#include <string.h>

#include "gemm_tile.h"

/* The fused projections an adapter may change, in the tables' order. */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_GROUPS };

typedef struct {
    const void *const *a; /* [num_layers * LORA_GROUPS]: packed A [width, in] (NULL: group not adapted) */
    const void *const *b; /* [num_layers * LORA_GROUPS]: packed B [out, width] */
    int width[LORA_GROUPS]; /* A's rows: parts * slots * rank, padded to a multiple of NB */
    int parts[LORA_GROUPS];
    int slots, rank;
} LoraTables;

#ifdef __AVX512F__
/* Zero all but slot s's rank columns of each part (every column where s < 0). */
static inline void lora_mask_row(char *row, int s, int width, int parts, int slots, int rank, size_t es) {
    if (s < 0) {
        memset(row, 0, (size_t)width * es);
        return;
    }
    int kept_end = 0;
    for (int p = 0; p < parts; p++) {
        const int start = (p * slots + s) * rank;
        memset(row + (size_t)kept_end * es, 0, (size_t)(start - kept_end) * es);
        kept_end = start + rank;
    }
    memset(row + (size_t)kept_end * es, 0, (size_t)(width - kept_end) * es);
}

/* y += d, n a multiple of 32; bf16 rounded once, as torch's add_ of two bf16 tensors. */
static inline void lora_add_row(void *y, const void *d, int n, int bf16) {
    for (int i = 0; i < n; i += 16) {
        if (bf16) {
            uint16_t *yp = (uint16_t *)y + i;
            store16_bf16(yp, (f32x16)_mm512_add_ps((__m512)load16_bf16(yp), (__m512)load16_bf16((const uint16_t *)d + i)));
        } else {
            float *yp = (float *)y + i;
            _mm512_storeu_ps(yp, _mm512_add_ps(_mm512_loadu_ps(yp), _mm512_loadu_ps((const float *)d + i)));
        }
    }
}

/* Called by every thread of the step's team right after the base projection y = x . W^T
 * (x [T, K], y [T, N]): adds the adapters' products to y; returns with y complete (the team
 * met at a barrier). shrunk [T, width] and lo [T, N]: the step's LoRA scratch. */
static inline void lora_share(const LoraTables *lt, int group, int layer, const int32_t *token_slots, const void *x,
                              int K, void *y, int N, int T, void *shrunk, void *lo, int bf16, int tid, int nth) {
    const void *a = lt->a[(size_t)layer * LORA_GROUPS + group], *b = lt->b[(size_t)layer * LORA_GROUPS + group];
    if (a == NULL) return; /* (the same for every thread) */
    const int W = lt->width[group];
    const size_t es = bf16 ? 2 : 4;
    /* x is whole (the base projection read it): the shrink needs no barrier first */
    gemm_share(x, a, NULL, shrunk, T, K, W, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        lora_mask_row((char *)shrunk + (size_t)t * W * es, token_slots[t], W, lt->parts[group], lt->slots, lt->rank, es);
    gemm_share(shrunk, b, NULL, lo, T, W, N, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) lora_add_row((char *)y + (size_t)t * N * es, (char *)lo + (size_t)t * N * es, N, bf16);
}
#endif

#endif
