/* The whole decoder forward of a step in one call, on the weights gemm.c packed for the linear
 * layers: every layer's RMSNorm, QKV projection, RoPE, KV-cache write, attention (paged decode for
 * requests bringing one token, paged prefill tiles for chunks of more), output projection, MLP
 * (or a mixture-of-experts layer's routing and experts: moe_route.h, cpu/moe_share.h), and the
 * final norm; the LM head stays the packed linear layer it is. Decode batches of a few
 * requests go to decode_step.c instead (row-major weights, bound by reading them).
 *
 * Built at first use by decode_step.py (cpu/cbuild.py, up to the avx512_bf16 level as cpu/gemm.c
 * is, -ffp-contract=off so the elementwise arithmetic rounds exactly as cpu/cpu_ops.c's does: both
 * use cpu/row_ops.h; the projections are cpu/gemm_tile.h's, the attention cpu/paged_attend.h's and
 * cpu/prefill_attend.h's).
 *
 * Why: from 16 rows up a step is GEMM-bound, and the GEMMs run near the machine's peak, but the
 * eager forward around them (~10 ops a layer, each a Python dispatch and an OpenMP region of its
 * own while the other threads spin at its barrier, the KV write an index_copy_) takes a large
 * share of a decode step of many requests. Here one OpenMP region runs the step: each
 * projection is split over the threads as gemm() splits it, the row-wise ops by rows,
 * attention by (request, KV head) for decodes and (chunk, KV head, query tile) for prefills;
 * threads meet at a barrier only where the next stage needs every row of the previous one.
 */
#include <stdlib.h>

#include "gemm_tile.h"
#include "lora_step.h"
#include "moe_route.h"
#include "moe_share.h"
#include "paged_attend.h"
#include "prefill_attend.h"
#include "row_ops.h"
#include "step_model.h"
#include "threads.h"

/* Most tokens a step may carry (the engine's default token budget per step). */
#define MAX_TOKENS 2048

/* Whether this build runs the step for fp32 (bf16 = 0) or bf16 (bf16 = 1): where gemm.c does. */
int packed_step_available(int bf16) { return tile_available(bf16); }

int packed_step_max_tokens(void) { return MAX_TOKENS; }

/* A unit of attention work: request b; q0 < 0 for a decode (one query token), else the first
 * query token of a prefill tile; KV heads [kh, kh + nkh). */
typedef struct {
    int b, q0, kh, nkh;
} Unit;

/* T tokens of B requests: request b's tokens are rows [query_start[b], query_start[b + 1]) of x
 * (model dtype, [T, hidden] embeddings), at positions[t] with KV slots slots[t] (int64);
 * seq_lens[b] (its context and these tokens) and block_table [B, bt_stride] (int32) as for
 * paged attention; out: [T, hidden], the final norm's output. The layers' projection pointers
 * are gemm_pack's copies (every output size a multiple of NB); head_dim a multiple of 8. A layer
 * with a router runs its experts (one rank holding every expert, no shared expert) where a
 * dense layer runs its MLP. lora (or NULL): the adapters' slot tables, token_slots [T] each
 * token's slot (-1: the base model; NULL: no token of the step uses an adapter).
 * Returns 0, -1 when T or B is out of range, -2 when memory could not be allocated, -3 when
 * this build has no step for the dtype. */
int packed_step(const StepModel *md, int T, int B, const void *x, const int64_t *positions, const int64_t *slots,
                const int32_t *query_start, const int32_t *seq_lens, const int32_t *block_table, int64_t bt_stride,
                const LoraTables *lora, const int32_t *token_slots, void *out, int nthreads) {
    if (T < 1 || T > MAX_TOKENS || B < 1 || B > T) return -1;
    if (!packed_step_available(md->bf16)) return -3;
#ifdef __AVX512F__
    const int H = md->hidden, NH = md->num_heads, KVH = md->num_kv_heads, D = md->head_dim, I = md->intermediate;
    const int G = NH / KVH, QKV = (NH + 2 * KVH) * D, bf16 = md->bf16;
    const size_t es = bf16 ? 2 : 4;
    if (nthreads < 1) nthreads = 1;
    int max_len = 0, num_decodes = 0, num_tiles = 0;
    for (int b = 0; b < B; b++) {
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
        const int q_len = query_start[b + 1] - query_start[b];
        if (q_len == 1)
            num_decodes++;
        else
            num_tiles += (q_len + QT - 1) / QT;
    }
    /* a decode unit: a whole request when there are a few per thread (a cached token's K/V of
     * every head are one contiguous row), a single KV head otherwise (as paged_decode splits) */
    const int decode_heads = num_decodes >= 4 * nthreads ? KVH : 1;
    const int num_units = KVH * num_tiles + num_decodes * (KVH / decode_heads);
    /* units: prefill tiles first, each chunk's later tiles (more keys) first, then the decodes,
     * so that the dynamic schedule ends evenly */
    Unit *units = malloc(sizeof(Unit) * (size_t)num_units);
    if (units == NULL) return -2;
    int n = 0;
    for (int b = 0; b < B; b++) {
        const int q_len = query_start[b + 1] - query_start[b];
        for (int q0 = q_len == 1 ? -QT : ((q_len + QT - 1) / QT - 1) * QT; q0 >= 0; q0 -= QT)
            for (int kh = 0; kh < KVH; kh++) units[n++] = (Unit){b, q0, kh, 1};
    }
    for (int b = 0; b < B; b++)
        if (query_start[b + 1] - query_start[b] == 1)
            for (int kh = 0; kh < KVH; kh += decode_heads) units[n++] = (Unit){b, -1, kh, decode_heads};

    /* per thread, fp32: attention scratch, a decode unit's (scores, accumulators, q rows, a
     * widened cache row) or a prefill unit's, whichever is larger */
    const size_t unit_heads = (size_t)G * decode_heads;
    const size_t decode_scratch = unit_heads * max_len + 2 * unit_heads * D + (size_t)KVH * D + 16;
    const size_t prefill_scratch = prefill_scratch_floats(G, D);
    const size_t per_thread = decode_scratch > prefill_scratch ? decode_scratch : prefill_scratch;
    const StepBuffers buf = step_buffers(md, T, x, per_thread, nthreads);
    /* mixture-of-experts layers: each token's expert ids and weights, the router's
     * probabilities, and the experts' scratch at its most for this step (planned per layer) */
    const int E = md->num_experts, K = md->top_k;
    const size_t moe_bytes = E > 0 ? moe_align64((size_t)T * K * (sizeof(int64_t) + sizeof(float))) +
                                         moe_align64((size_t)T * E * sizeof(float)) +
                                         moe_scratch_bytes(T, K, E, H, md->moe_ip, md->moe_hp, bf16, nthreads)
                                   : 0;
    char *moe_mem = E > 0 ? aligned_alloc(64, moe_align64(moe_bytes)) : NULL;
    /* the adapters' scratch: every slot's rank columns, and a projection's products, per token */
    if (token_slots == NULL) lora = NULL;
    int lora_width = 0, widest_out = QKV > 2 * I ? QKV : 2 * I;
    widest_out = widest_out > H ? widest_out : H;
    for (int g = 0; lora != NULL && g < LORA_GROUPS; g++)
        lora_width = lora->width[g] > lora_width ? lora->width[g] : lora_width;
    char *lora_mem = lora != NULL ? malloc((size_t)T * (lora_width + widest_out) * es) : NULL;
    void *const shrunk = lora_mem, *const lo = lora_mem ? lora_mem + (size_t)T * lora_width * es : NULL;
    if (buf.mem == NULL || (E > 0 && moe_mem == NULL) || (lora != NULL && lora_mem == NULL)) {
        free(buf.mem), free(moe_mem), free(units), free(lora_mem);
        return -2;
    }
    int64_t *expert_ids = (int64_t *)moe_mem;
    float *expert_weights = (float *)(moe_mem + (size_t)T * K * sizeof(int64_t));
    float *router_probs = (float *)(moe_mem + moe_align64((size_t)T * K * (sizeof(int64_t) + sizeof(float))));
    char *moe_scratch = (char *)router_probs + moe_align64((size_t)T * E * sizeof(float));
    MoePlan moe_plan_of_layer; /* shared: one thread plans, the team runs it */
    void *const res = buf.res, *const h = buf.h, *const qkv = buf.qkv, *const att = buf.att, *const gu = buf.gu;
    void *const act = buf.act;
    float *const scratch = buf.scratch;
    const AttendFn attend = select_attend(D);
    const PrefillUnitFn prefill = select_prefill_unit(D);

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = thread_id(), nth = team_size();
        float *mine = thread_scratch(scratch, per_thread);
        /* decode units' scratch */
        float *scores = mine, *acc = scores + unit_heads * max_len, *qrows = acc + unit_heads * D;
        float *tmp = qrows + unit_heads * D;
        /* prefill units' scratch */
        const size_t R = (size_t)G * QT;
        float *qs = mine, *kt = qs + R * D, *vt = kt + (size_t)D * KT, *s = vt + (size_t)KT * D, *o = s + R * KT;
        float *m = o + R * D, *l = m + R, *corr = l + R;
        for (int layer = 0; layer < md->num_layers; layer++) {
            const void *const *w = md->layers + (size_t)layer * LAYER_PTRS;
            void *const k_cache = md->kv[2 * layer], *const v_cache = md->kv[2 * layer + 1];
            /* h = RMSNorm(residual), the previous layer's MLP output (in h) added first */
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                char *ht = (char *)h + (size_t)t * H * es, *rt = (char *)res + (size_t)t * H * es;
                if (layer == 0)
                    rms_norm_row(rt, w[W_IN_NORM], ht, H, md->eps, bf16);
                else
                    add_rms_norm_row(ht, rt, w[W_IN_NORM], H, md->eps, bf16);
            }
            gemm_share(h, w[W_QKV], w[B_QKV], qkv, T, H, QKV, bf16, tid, nth);
            if (lora) lora_share(lora, LORA_QKV, layer, token_slots, h, H, qkv, QKV, T, shrunk, lo, bf16, tid, nth);
#pragma omp barrier
            /* each token: its heads' norms (Qwen3), RoPE on its q and k heads, its K/V into the
             * cache; every token's before any attention (a prefill tile reads its chunk's keys) */
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                char *row = (char *)qkv + (size_t)t * QKV * es;
                if (w[W_Q_NORM] != NULL)
                    for (int hd = 0; hd < NH + KVH; hd++) {
                        char *head = row + (size_t)hd * D * es;
                        rms_norm_row(head, hd < NH ? w[W_Q_NORM] : w[W_K_NORM], head, D, md->eps, bf16);
                    }
                rope_row(row, NH + KVH, D, md->cos + positions[t] * (int64_t)D, md->sin + positions[t] * (int64_t)D,
                         bf16);
                const size_t kv_bytes = (size_t)KVH * D * es, at = (size_t)slots[t] * kv_bytes;
                memcpy((char *)k_cache + at, row + (size_t)NH * D * es, kv_bytes);
                memcpy((char *)v_cache + at, row + (size_t)(NH + KVH) * D * es, kv_bytes);
            }
            const Args da = {NULL, k_cache, v_cache, block_table, seq_lens, NULL, bt_stride,
                             NH, KVH, D, md->block_size, bf16, bf16, md->scale};
            const PrefillArgs pa = {qkv, k_cache, v_cache, block_table, att, QKV, bt_stride,
                                    NH, KVH, D, md->block_size, bf16, md->scale};
#pragma omp for schedule(dynamic, 1)
            for (int u = 0; u < num_units; u++) {
                const Unit un = units[u];
                const int row0 = query_start[un.b];
                if (un.q0 < 0) {
                    const int nq = un.nkh * G * D;
                    load_f32(qkv, (int64_t)row0 * QKV + (int64_t)un.kh * G * D, nq, bf16, qrows);
                    attend(&da, un.b, un.kh, un.kh + un.nkh, qrows, scores, acc, tmp);
                    store_from_f32(att, (int64_t)row0 * NH * D + (int64_t)un.kh * G * D, nq, bf16, acc);
                } else {
                    const int q_len = query_start[un.b + 1] - row0;
                    prefill(&pa, block_table + (int64_t)un.b * bt_stride, row0, q_len, seq_lens[un.b] - q_len, un.q0,
                            un.kh, qs, kt, vt, s, o, m, l, corr);
                }
            }
            gemm_share(att, w[W_O], w[B_O], h, T, NH * D, H, bf16, tid, nth);
            if (lora) lora_share(lora, LORA_O, layer, token_slots, att, NH * D, h, H, T, shrunk, lo, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                add_rms_norm_row((char *)h + (size_t)t * H * es, (char *)res + (size_t)t * H * es, w[W_POST_NORM], H,
                                 md->eps, bf16);
            if (w[W_ROUTER] != NULL) {
                /* the experts' sum of each token into h, where a dense layer's down projection goes */
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++)
                    route_row((char *)h + (size_t)t * H * es, w[W_ROUTER], H, E, K, bf16, md->renormalize,
                              md->weights_fp32, router_probs + (size_t)t * E, expert_ids + (size_t)t * K,
                              expert_weights + (size_t)t * K);
#pragma omp single
                moe_plan(&moe_plan_of_layer, moe_scratch, expert_ids, T, K, E, H, md->moe_ip, md->moe_hp, bf16);
                moe_share(&moe_plan_of_layer, h, w[W_EXPERTS13], w[W_EXPERTS2], expert_weights, 0, h, tid, nth);
#pragma omp barrier
                continue;
            }
            gemm_share(h, w[W_GATE_UP], w[B_GATE_UP], gu, T, H, 2 * I, bf16, tid, nth);
            if (lora) lora_share(lora, LORA_GATE_UP, layer, token_slots, h, H, gu, 2 * I, T, shrunk, lo, bf16, tid, nth);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const char *g = (const char *)gu + (size_t)t * 2 * I * es;
                silu_mul_row(g, g + (size_t)I * es, (char *)act + (size_t)t * I * es, I, bf16);
            }
            gemm_share(act, w[W_DOWN], w[B_DOWN], h, T, I, H, bf16, tid, nth);
            if (lora) lora_share(lora, LORA_DOWN, layer, token_slots, act, I, h, H, T, shrunk, lo, bf16, tid, nth);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            add_rms_norm_row((char *)h + (size_t)t * H * es, (char *)res + (size_t)t * H * es, md->final_norm, H,
                             md->eps, bf16);
    }
    memcpy(out, h, (size_t)T * H * es);
    free(buf.mem);
    free(moe_mem);
    free(units);
    free(lora_mem);
    return 0;
#else
    (void)x, (void)positions, (void)slots, (void)query_start, (void)seq_lens, (void)block_table, (void)bt_stride;
    (void)lora, (void)token_slots, (void)out, (void)nthreads;
    return -3;
#endif
}
