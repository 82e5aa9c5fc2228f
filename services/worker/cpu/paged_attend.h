/* Paged decode attention's core, shared by the standalone kernel (attention/cpu_paged_decode.c)
 * and the whole-step decode kernel (decode_step.c): attend one request's query heads of a range
 * of KV heads, reading K/V in place through the block table. See cpu_paged_decode.c for why it
 * is organised this way. Everything here is static: each library gets its own copy. */
#ifndef MYVLLM_PAGED_ATTEND_H
#define MYVLLM_PAGED_ATTEND_H

#include "vec.h"

typedef struct {
    const void *q;              /* [B, H, D], fp32 or bf16 (io_bf16) */
    const void *k_cache;        /* [num_blocks, BS, KVH, D] */
    const void *v_cache;
    const int32_t *block_table; /* [B, bt_stride] */
    const int32_t *seq_lens;    /* [B] */
    void *out;                  /* [B, H, D], q's dtype */
    int64_t bt_stride;
    int H, KVH, D, BS, is_bf16, io_bf16;
    float scale;
} Args;

/* Pointer to `n` cache elements at `offset` as fp32: in place for fp32 caches, converted
 * into `tmp` for bf16 ones. */
static inline const float *as_f32(const void *cache, int64_t offset, int n, int is_bf16, float *restrict tmp) {
    if (!is_bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    for (int i = 0; i < n; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

/* Softmax numerators of each of the nh rows of scores ([nh, L]) in place; inv_sum[h] = 1/sum
 * (applied to the output at the end). */
static inline void softmax_rows(float *restrict scores, int nh, int L, float *restrict inv_sum) {
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
            v = exp8(v - m);
            memcpy(sh + t, &v, sizeof v);
            sum8 += v;
        }
        for (int i = 0; i < 8; i++) sum += sum8[i];
        for (; t < L; t++) {
            sh[t] = exp1(sh[t] - m);
            sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
    }
}

/* Attend request b's query heads of KV heads [kh0, kh1). scores: [nh, L], acc: [nh, D],
 * tmp: [KVH * D] scratch for bf16 rows. Always inlined into per-head-size copies below, so
 * the common head sizes get loops of a known length (25% faster than a runtime D). */
static inline __attribute__((always_inline)) void attend_impl(const Args *a, int b, int kh0, int kh1,
                                                              const float *restrict q, float *restrict scores,
                                                              float *restrict acc, float *restrict tmp, const int D) {
    const int G = a->H / a->KVH, BS = a->BS, L = a->seq_lens[b];
    const int nkv = kh1 - kh0, nh = nkv * G, width = nkv * D;
    const int64_t row = (int64_t)a->KVH * D; /* elements per cached token */
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
    softmax_rows(scores, nh, L, inv_sum);

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

    for (int h = 0; h < nh; h++)
        for (int d = 0; d < D; d++) acc[(int64_t)h * D + d] *= inv_sum[h];
}

/* Software prefetch of the cache rows PREFETCH_GROUPS 8-token groups ahead of the group being
 * consumed. Without it the loop is bound by memory latency (the out-of-order window holds ~1.5 KB
 * of loads at this arithmetic density): ~12 GB/s per core against ~35 GB/s for a plain streaming
 * read on the same machine. The lines of that group are prefetched a slice per query head
 * (prefetch_part), spread over the group's work: issued in one burst, the prefetches queued behind
 * each other in the line-fill buffers (the burst itself was a tenth of the kernel's samples).
 * Measured on 64 requests x ~400 tokens x 30 layers, 2 threads (BENCHMARKS.md, round 7): one
 * group ahead in one burst 23 GB/s fp32 / 18 bf16; spread, two groups ahead 34-46 / 25 (a plain
 * read of the same rows: 38-41); one group spread 34-40, three or more groups a little less. */
#define PREFETCH_GROUPS 2

typedef struct {
    const char *first; /* NULL: nothing to prefetch (the end of the request) */
    int rows;          /* 1 when the group is one contiguous span of lines */
    int lines;         /* cache lines per row (per span) */
    int64_t row_bytes;
} Prefetch;

/* Where the group PREFETCH_GROUPS ahead of position `pos` lies, for this unit's KV heads. */
static inline Prefetch prefetch_plan(const Args *a, const void *cache, const int32_t *bt, int L, int pos, int kh0,
                                     int width, int64_t row, const int bf16) {
    Prefetch p = {NULL, 0, 0, 0};
    pos += PREFETCH_GROUPS * 8;
    if (pos >= L) return p;
    const int es = bf16 ? 2 : 4;
    p.first = (const char *)cache + ((int64_t)bt[pos / a->BS] * a->BS * row + (int64_t)(pos % a->BS) * row +
                                     (int64_t)kh0 * (row / a->KVH)) * es;
    p.rows = L - pos < 8 ? L - pos : 8;
    p.row_bytes = row * es;
    /* Rows holding every KV head (whole-request units) make the group one span of lines. With a
     * block size that is not a multiple of 8 the span may run past its block into whatever
     * follows: a prefetch never faults, so that only costs a wasted line. */
    if (width == row) {
        p.lines = (int)((p.rows * p.row_bytes + 63) / 64);
        p.rows = 1;
    } else {
        p.lines = (int)((width * es + 63) / 64);
    }
    return p;
}

/* The part-th of nparts slices of the planned group's lines. */
static inline void prefetch_part(const Prefetch *p, int part, int nparts) {
    if (p->first == NULL) return;
    if (p->rows == 1) {
        for (int i = part * p->lines / nparts; i < (part + 1) * p->lines / nparts; i++)
            __builtin_prefetch(p->first + (int64_t)i * 64, 0, 3);
        return;
    }
    for (int r = part * p->rows / nparts; r < (part + 1) * p->rows / nparts; r++)
        for (int l = 0; l < p->lines; l++) __builtin_prefetch(p->first + r * p->row_bytes + (int64_t)l * 64, 0, 3);
}

/* x[0..16) into dst as [x0 x2 .. x14 | x1 x3 .. x15], the order load16_bf16_split yields. */
static inline void split16(const float *restrict x, float *restrict dst) {
    for (int i = 0; i < 8; i++) {
        dst[i] = x[2 * i];
        dst[8 + i] = x[2 * i + 1];
    }
}

/* The inverse of split16, in place. */
static inline void interleave16(float *x) {
    float tmp[16];
    for (int i = 0; i < 8; i++) {
        tmp[2 * i] = x[i];
        tmp[2 * i + 1] = x[8 + i];
    }
    memcpy(x, tmp, sizeof tmp);
}

/* attend_impl for head sizes that are multiples of 64, reorganised so that neither pass is
 * bound by arithmetic latency (the straightforward loops above ran at ~10 GB/s per core, a
 * third of what one core can read):
 * - scores: 8 tokens at a time per query head, one accumulator per token (8 independent FMA
 *   chains instead of one dependent chain per dot product), one transposing reduction per 8;
 * - values: per query head, its output row held in 8 registers (64 lanes) across a block's
 *   tokens instead of loaded and stored for every token.
 * A block of K (or V) rows is read from memory once and re-read from L1 by the other query
 * heads of its KV head (GQA). */
static inline __attribute__((always_inline)) void attend_blocked(const Args *a, int b, int kh0, int kh1,
                                                                 const float *restrict q, float *restrict scores,
                                                                 float *restrict acc, const int D, const int bf16) {
    const int G = a->H / a->KVH, BS = a->BS, L = a->seq_lens[b];
    const int nkv = kh1 - kh0, nh = nkv * G;
    const int64_t row = (int64_t)a->KVH * D; /* elements per cached token */
    const int32_t *bt = a->block_table + (int64_t)b * a->bt_stride;
    const int nblocks = (L + BS - 1) / BS;
    const f32x8 zero = {0};
    /* bf16 caches: 16 cached values are widened with one shift and one mask (even and odd
     * elements, see load16_bf16_split) instead of two widening loads, so each 16-lane chunk of
     * the queries is split alike here, and the outputs are accumulated split and put back in
     * order at the end. 64 requests x ~400 tokens x 30 layers: 22.4 -> 17.3 ms (26 -> 34 GB/s),
     * batch 1: 0.71 -> 0.52 ms (round 7, BENCHMARKS.md). */
    float qsplit[bf16 ? nh * D : 1];
    if (bf16)
        for (int i = 0; i < nh * D; i += 16) split16(q + i, qsplit + i);

    /* Pass 1: scores[h, t] = scale * q_h . k_t, a group of 8 cached tokens (8 contiguous rows)
     * at a time, every query head of the group before the next. */
    for (int blk = 0; blk < nblocks; blk++) {
        const int64_t base = (int64_t)bt[blk] * BS * row + (int64_t)kh0 * D;
        const int n = L - blk * BS < BS ? L - blk * BS : BS;
        int t0 = 0;
        for (; t0 + 8 <= n; t0 += 8) {
            const Prefetch pf = prefetch_plan(a, a->k_cache, bt, L, blk * BS + t0, kh0, nkv * D, row, bf16);
            for (int h = 0; h < nh; h++) {
                prefetch_part(&pf, h, nh);
                const float *restrict qh = (bf16 ? qsplit : q) + (int64_t)h * D;
                const int64_t kbase = base + (int64_t)t0 * row + (int64_t)(h / G) * D;
                f32x8 s[8] = {zero, zero, zero, zero, zero, zero, zero, zero};
                if (bf16) {
                    for (int c = 0; c < D; c += 16) {
                        const f32x8 qe = load8(qh + c), qo = load8(qh + c + 8);
                        for (int t = 0; t < 8; t++) {
                            f32x8 ke, ko;
                            load16_bf16_split((const uint16_t *)a->k_cache + kbase + t * row + c, &ke, &ko);
                            s[t] += qe * ke;
                            s[t] += qo * ko;
                        }
                    }
                } else {
                    for (int c = 0; c < D; c += 8) {
                        const f32x8 qc = load8(qh + c);
                        for (int t = 0; t < 8; t++) s[t] += qc * load8((const float *)a->k_cache + kbase + t * row + c);
                    }
                }
                const f32x8 r = sum8x8(s) * a->scale;
                memcpy(scores + (int64_t)h * L + (int64_t)blk * BS + t0, &r, sizeof r);
            }
        }
        for (; t0 < n; t0++) {
            for (int h = 0; h < nh; h++) {
                const float *restrict qh = (bf16 ? qsplit : q) + (int64_t)h * D;
                const int64_t kbase = base + (int64_t)t0 * row + (int64_t)(h / G) * D;
                f32x8 s1 = zero;
                if (bf16) {
                    for (int c = 0; c < D; c += 16) {
                        f32x8 ke, ko;
                        load16_bf16_split((const uint16_t *)a->k_cache + kbase + c, &ke, &ko);
                        s1 += load8(qh + c) * ke;
                        s1 += load8(qh + c + 8) * ko;
                    }
                } else {
                    for (int c = 0; c < D; c += 8) s1 += load8(qh + c) * load8((const float *)a->k_cache + kbase + c);
                }
                float dot = 0.f;
                for (int i = 0; i < 8; i++) dot += s1[i];
                scores[(int64_t)h * L + (int64_t)blk * BS + t0] = dot * a->scale;
            }
        }
    }

    float inv_sum[nh];
    softmax_rows(scores, nh, L, inv_sum);

    /* Pass 2: acc[h] = sum_t p[h, t] * v_t, a group of up to 8 cached tokens at a time, each
     * query head's 64 output lanes in registers over the group. */
    for (int i = 0; i < nh * D; i++) acc[i] = 0.f;
    for (int blk = 0; blk < nblocks; blk++) {
        const int64_t base = (int64_t)bt[blk] * BS * row + (int64_t)kh0 * D;
        const int n = L - blk * BS < BS ? L - blk * BS : BS;
        for (int t0 = 0; t0 < n; t0 += 8) {
            const int nt = n - t0 < 8 ? n - t0 : 8;
            const Prefetch pf = prefetch_plan(a, a->v_cache, bt, L, blk * BS + t0, kh0, nkv * D, row, bf16);
            for (int h = 0; h < nh; h++) {
                prefetch_part(&pf, h, nh);
                const float *restrict ph = scores + (int64_t)h * L + (int64_t)blk * BS + t0;
                for (int d0 = 0; d0 < D; d0 += 64) {
                    const int64_t vbase = base + (int64_t)t0 * row + (int64_t)(h / G) * D + d0;
                    float *restrict ah = acc + (int64_t)h * D + d0;
                    if (bf16) {
                        /* the even (e) and odd (o) lanes of the four 16-lane chunks, named one by
                         * one: as an array GCC stored them back to the stack every token */
                        f32x8 e0 = load8(ah), o0 = load8(ah + 8), e1 = load8(ah + 16), o1 = load8(ah + 24);
                        f32x8 e2 = load8(ah + 32), o2 = load8(ah + 40), e3 = load8(ah + 48), o3 = load8(ah + 56);
                        const uint16_t *restrict vrow = (const uint16_t *)a->v_cache + vbase;
                        for (int t = 0; t < nt; t++, vrow += row) {
                            const f32x8 p = broadcast8(ph + t);
                            f32x8 ve, vo;
                            load16_bf16_split(vrow, &ve, &vo);
                            e0 += p * ve;
                            o0 += p * vo;
                            load16_bf16_split(vrow + 16, &ve, &vo);
                            e1 += p * ve;
                            o1 += p * vo;
                            load16_bf16_split(vrow + 32, &ve, &vo);
                            e2 += p * ve;
                            o2 += p * vo;
                            load16_bf16_split(vrow + 48, &ve, &vo);
                            e3 += p * ve;
                            o3 += p * vo;
                        }
                        store8(ah, e0);
                        store8(ah + 8, o0);
                        store8(ah + 16, e1);
                        store8(ah + 24, o1);
                        store8(ah + 32, e2);
                        store8(ah + 40, o2);
                        store8(ah + 48, e3);
                        store8(ah + 56, o3);
                        continue;
                    }
                    f32x8 o[8];
                    memcpy(o, ah, sizeof o);
                    for (int t = 0; t < nt; t++) {
                        const f32x8 p = broadcast8(ph + t);
                        for (int c = 0; c < 8; c++) o[c] += p * load8((const float *)a->v_cache + vbase + t * row + 8 * c);
                    }
                    memcpy(ah, o, sizeof o);
                }
            }
        }
    }

    for (int h = 0; h < nh; h++) {
        if (bf16) /* back from even | odd halves to element order */
            for (int c = 0; c < D; c += 16) interleave16(acc + (int64_t)h * D + c);
        for (int d = 0; d < D; d++) acc[(int64_t)h * D + d] *= inv_sum[h];
    }
}

typedef void (*AttendFn)(const Args *, int, int, int, const float *, float *, float *, float *);

static void attend_d64(const Args *a, int b, int kh0, int kh1, const float *q, float *s, float *acc, float *tmp) {
    (void)tmp;
    if (a->is_bf16) attend_blocked(a, b, kh0, kh1, q, s, acc, 64, 1);
    else attend_blocked(a, b, kh0, kh1, q, s, acc, 64, 0);
}
static void attend_d128(const Args *a, int b, int kh0, int kh1, const float *q, float *s, float *acc, float *tmp) {
    (void)tmp;
    if (a->is_bf16) attend_blocked(a, b, kh0, kh1, q, s, acc, 128, 1);
    else attend_blocked(a, b, kh0, kh1, q, s, acc, 128, 0);
}
static void attend_any(const Args *a, int b, int kh0, int kh1, const float *q, float *s, float *acc, float *tmp) {
    attend_impl(a, b, kh0, kh1, q, s, acc, tmp, a->D);
}

/* n values between q's / out's dtype (fp32 or bf16) and fp32 scratch: bf16 queries and outputs
 * are converted here, per unit, instead of by torch ops around the call. */
static void load_f32(const void *src, int64_t offset, int n, int bf16, float *restrict dst) {
    int i = 0;
    if (!bf16) {
        memcpy(dst, (const float *)src + offset, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)src + offset;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8_bf16(h + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(h[i]);
}

static void store_from_f32(void *dst, int64_t offset, int n, int bf16, const float *restrict src) {
    int i = 0;
    if (!bf16) {
        memcpy((float *)dst + offset, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)dst + offset;
    for (; i + 8 <= n; i += 8) store8_bf16(h + i, load8(src + i));
    for (; i < n; i++) h[i] = f32_to_bf16(src[i]);
}

/* The attend function for head size D: specialised copies for 64 and 128. */
static inline AttendFn select_attend(int D) { return D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any; }

#endif
