/* The routed experts of a mixture-of-experts layer for CPUs with AVX2 or AVX-512, in one call:
 * every (token, slot) pair grouped by expert, each expert's gate/up GEMM with SiLU(gate) * up on
 * its group, its down GEMM, and each token's outputs, scaled by the routing weights, summed in
 * ascending expert order. fp32 and bf16: gemm.c's 16-lane tiles (gemm_tile.h; bf16 by the CPU's
 * bf16 dot products) where the build has them for the dtype, 8-lane tiles of the same layout
 * otherwise (AVX2; bf16 weights widened to fp32 in registers).
 *
 * Built at first use by moe_experts.py (cpu/cbuild.py, up to the avx512_bf16 level, with
 * -ffp-contract=off: no a*b+c fused into one rounding outside the GEMM tiles' explicit FMAs).
 *
 * Why: the torch path runs a GEMM pair per expert from Python, each a dispatch, and groups the
 * pairs with host-side counts; with many small experts (64, top-8) the loop and the syncs cost
 * more than the arithmetic at decode sizes. Here the grouping, both GEMMs, the activation and the
 * weighted sum are one OpenMP region on packed weights.
 *
 * Layout (packed once at load by moe_pack; gemm.c's blocks of NB = 32 output columns, its tiles):
 * - w13 [E, 2I, H] (gate rows, then up rows) becomes [E][Ip / 32][2][H][32]: for each block of 32
 *   intermediate columns its gate block, then its up block, so one work item computes both and
 *   applies SiLU(gate) * up while they are in L1;
 * - w2 [E, H, I] becomes [E][Hp / 32][Ip][32];
 * bf16 blocks hold pairs of k side by side ([K / 2][32][2]), as vdpbf16ps takes them. Ip and Hp
 * are I and H rounded up to whole blocks; the padding is zeros (gate = up = 0 gives SiLU(0) * 0 =
 * 0, which the down projection's zero rows then multiply), so any width works.
 *
 * Work (moe_share.h: planned by one thread, then shared by the team): phase 1 over items
 * (expert, block of 32 intermediate columns, chunk of M_CHUNK rows), phase 2 over (expert,
 * block of 32 hidden columns, chunk of rows), each phase's items split
 * into contiguous ranges of about equal cost over torch's threads (a thread prefetches its next
 * item's block, as gemm.c), then the per-token sums split over the tokens.
 *
 * Arithmetic, matching the torch path (moe.py's grouped_experts) at each rounding point: each
 * GEMM output is one fp32 accumulator over k in order (gemm_tile.h), rounded once to the
 * activations' dtype; SiLU(gate) * up as cpu_ops.c (row_ops.h: bf16 rounds SiLU before the
 * multiply); each pair's output times its routing weight (fp32 or bf16) rounded to the
 * activations' dtype, then added to the token's fp32 sum in ascending expert order, rounded once
 * at the end (bf16), as torch's index_add_ does (it accumulates bf16 in fp32). The GEMM sums run in another order than torch's (oneDNN's
 * blocked K), so fp32 results agree with it to rounding, not to the bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_share.h"
#include "threads.h"

/* Whether this build has the kernel for fp32 (bf16 = 0) or bf16 (bf16 = 1): from AVX2 on, both
 * (moe_share.h's 8-lane rows where the build has no tiles of gemm_tile.h for the dtype). */
int moe_available(int bf16) {
    (void)bf16;
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* Block `n0 / NB` of src [rows, cols] (row-major, `ld` elements between rows) into dst: K values
 * of each of NB columns (gemm.c's block layout), zeros past `rows` or `cols`. */
static void pack_block(const void *src, int64_t ld, int rows, int cols, int n0, int K, void *dst, int bf16) {
    for (int k = 0; k < K; k++)
        for (int j = 0; j < NB; j++) {
            const int n = n0 + j, inside = n < rows && k < cols;
            if (bf16)
                ((uint16_t *)dst)[((int64_t)(k / 2) * NB + j) * 2 + k % 2] =
                    inside ? ((const uint16_t *)src)[n * ld + k] : 0;
            else
                ((float *)dst)[(int64_t)k * NB + j] = inside ? ((const float *)src)[n * ld + k] : 0.f;
        }
}

/* w13 [E, 2I, H] and w2 [E, H, I] (row-major, the layer's dtype) into w13p [E][Ip / NB][2][H][NB]
 * and w2p [E][Hp / NB][Ip][NB] (bf16: H even; see the layout above). */
void moe_pack(const void *w13, const void *w2, void *w13p, void *w2p, int E, int H, int I, int Ip, int Hp, int bf16,
              int num_threads) {
    const size_t es = bf16 ? 2 : 4;
    const int64_t block13 = (int64_t)H * NB, block2 = (int64_t)Ip * NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int e = 0; e < E; e++) {
        const char *gate = (const char *)w13 + (size_t)e * 2 * I * H * es, *up = gate + (size_t)I * H * es;
        char *dst = (char *)w13p + (size_t)e * 2 * Ip * H * es;
        for (int b = 0; b < Ip / NB; b++) {
            pack_block(gate, H, I, H, b * NB, H, dst + (size_t)(2 * b) * block13 * es, bf16);
            pack_block(up, H, I, H, b * NB, H, dst + (size_t)(2 * b + 1) * block13 * es, bf16);
        }
        const char *down = (const char *)w2 + (size_t)e * H * I * es;
        for (int b = 0; b < Hp / NB; b++)
            pack_block(down, I, H, I, b * NB, Ip, (char *)w2p + ((size_t)e * Hp / NB + b) * block2 * es, bf16);
    }
}

/* out [T, H] = for each token, the sum over its k slots in ascending expert order of
 * weight * down(SiLU(gate(x)) * up(x)) of that slot's expert. x [T, H] and out contiguous in the
 * layer's dtype; w13p and w2p from moe_pack; weights [T, k] fp32 or bf16 (weights_bf16); ids
 * [T, k] int64, an id outside [0, E) (another rank's expert) adding nothing. Returns 0, or -1
 * where scratch memory could not be had (out is then untouched). */
int moe_experts(const void *x, const void *w13p, const void *w2p, const void *weights, const int64_t *ids, void *out,
                int T, int k, int E, int H, int Ip, int Hp, int bf16, int weights_bf16, int num_threads) {
#ifdef __AVX2__
    char *scratch = aligned_alloc(64, moe_align64(moe_scratch_bytes(T, k, E, H, Ip, Hp, bf16, num_threads)));
    if (scratch == NULL) return -1;
    MoePlan plan;
    moe_plan(&plan, scratch, ids, T, k, E, H, Ip, Hp, bf16);
    if (num_threads > plan.max_items) num_threads = plan.max_items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    moe_share(&plan, x, w13p, w2p, weights, weights_bf16, out, thread_id(), team_size());
    free(scratch);
    return 0;
#else
    (void)x, (void)w13p, (void)w2p, (void)weights, (void)ids, (void)out, (void)T, (void)k, (void)E, (void)H;
    (void)Ip, (void)Hp, (void)bf16, (void)weights_bf16, (void)num_threads;
    return -1;
#endif
}
