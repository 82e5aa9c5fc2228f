/* Paged decode attention's core, shared by the standalone kernel (attention/cpu_paged_decode.c)
 * and the whole-step decode kernel (models/c_step/decode_step.c): attend one request's query heads
 * of a range of KV heads, reading K/V in place through the block table. See cpu_paged_decode.c for
 * why it is organised this way. Everything here is static: each library gets its own copy. */
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

/* Software prefetch of the cache rows two 8-token groups ahead of the group being
 * consumed. Without it the loop is bound by memory latency (the out-of-order window holds ~1.5 KB
 * of loads at this arithmetic density), at about a third of what a plain streaming read of the
 * same rows reaches. The lines of that group are prefetched a slice per query head
 * (prefetch_part), spread over the group's work: issued in one burst, the prefetches queued behind
 * each other in the line-fill buffers (the burst itself was a tenth of the kernel's samples).
 * Spread out and two groups ahead, the loop reads about as fast as a plain streaming read of the
 * same rows; one burst, or three or more groups ahead, is slower.
 * AVX-512 builds' bf16 passes (16 lanes) prefetch three groups ahead, about as many bytes ahead
 * as fp32's two (the AVX2 build gained nothing measurable from three, so it stays at two). */
static inline int prefetch_groups(const int bf16) {
#ifdef __AVX512F__
    return bf16 ? 3 : 2;
#else
    (void)bf16;
    return 2;
#endif
}

typedef struct {
    const char *first; /* NULL: nothing to prefetch (the end of the request) */
    int rows;          /* 1 when the group is one contiguous span of lines */
    int lines;         /* cache lines per row (per span) */
    int64_t row_bytes;
} Prefetch;

/* Where the group prefetch_groups ahead of position `pos` lies, for this unit's KV heads. */
static inline Prefetch prefetch_plan(const Args *a, const void *cache, const int32_t *bt, int L, int pos, int kh0,
                                     int width, int64_t row, const int bf16) {
    Prefetch p = {NULL, 0, 0, 0};
    pos += prefetch_groups(bf16) * 8;
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

/* How a pass consumes the cache (kv_kind): fp32 rows, 8 lanes at a time or (AVX-512 builds) 16;
 * bf16 rows widened to fp32 (q and the outputs split into even | odd elements alike, see
 * attend_blocked); bf16 rows multiplied with a bf16 query by the CPU's bf16 dot-product instruction
 * (AVX512_BF16 builds, queries that are bf16 values: io_bf16). The bf16 kinds come last. */
enum { KV_F32, KV_F32_X16, KV_BF16, KV_BF16_DOT };

/* The 8-lane (AVX2) passes, every build's (AVX-512 builds: fp32 caches in units of whole requests,
 * see kv_kind). Dot products of q_h with 8 cached rows (row stride `row` elements from kbase): 8
 * independent accumulators, one per row, one transposing reduction. q: fp32 (split for KV_BF16). */
static inline __attribute__((always_inline)) f32x8 dots8_x8(const void *k, int64_t kbase, int64_t row,
                                                            const float *restrict q, const uint16_t *restrict qb,
                                                            const int D, const int kv) {
    (void)qb;
    const f32x8 zero = {0};
    f32x8 s[8] = {zero, zero, zero, zero, zero, zero, zero, zero};
    if (kv == KV_BF16) {
        for (int c = 0; c < D; c += 16) {
            const f32x8 qe = load8(q + c), qo = load8(q + c + 8);
            for (int t = 0; t < 8; t++) {
                f32x8 ke, ko;
                load16_bf16_split((const uint16_t *)k + kbase + t * row + c, &ke, &ko);
                s[t] += qe * ke;
                s[t] += qo * ko;
            }
        }
    } else {
        for (int c = 0; c < D; c += 8) {
            const f32x8 qc = load8(q + c);
            for (int t = 0; t < 8; t++) s[t] += qc * load8((const float *)k + kbase + t * row + c);
        }
    }
    return sum8x8(s);
}

/* The dot product of q_h with one cached row (the tail of a block). */
static inline __attribute__((always_inline)) float dot1_x8(const void *k, int64_t kbase, const float *restrict q,
                                                           const uint16_t *restrict qb, const int D, const int kv) {
    (void)qb;
    f32x8 s1 = {0};
    if (kv == KV_BF16) {
        for (int c = 0; c < D; c += 16) {
            f32x8 ke, ko;
            load16_bf16_split((const uint16_t *)k + kbase + c, &ke, &ko);
            s1 += load8(q + c) * ke;
            s1 += load8(q + c + 8) * ko;
        }
    } else {
        for (int c = 0; c < D; c += 8) s1 += load8(q + c) * load8((const float *)k + kbase + c);
    }
    float dot = 0.f;
    for (int i = 0; i < 8; i++) dot += s1[i];
    return dot;
}

/* acc[0..64) += sum over nt rows t of p[t] * v_t[0..64) (bf16 rows: acc split, see attend_blocked),
 * the 64 output lanes in registers over the rows. */
static inline __attribute__((always_inline)) void accumulate64_x8(const void *v, int64_t vbase, int64_t row,
                                                                  const float *restrict p, int nt, float *restrict acc,
                                                                  const int kv) {
    if (kv >= KV_BF16) {
        /* the even (e) and odd (o) lanes of the four 16-lane chunks, named one by one: as an
         * array GCC stored them back to the stack every token */
        f32x8 e0 = load8(acc), o0 = load8(acc + 8), e1 = load8(acc + 16), o1 = load8(acc + 24);
        f32x8 e2 = load8(acc + 32), o2 = load8(acc + 40), e3 = load8(acc + 48), o3 = load8(acc + 56);
        const uint16_t *restrict vrow = (const uint16_t *)v + vbase;
        for (int t = 0; t < nt; t++, vrow += row) {
            const f32x8 pt = broadcast8(p + t);
            f32x8 ve, vo;
            load16_bf16_split(vrow, &ve, &vo);
            e0 += pt * ve;
            o0 += pt * vo;
            load16_bf16_split(vrow + 16, &ve, &vo);
            e1 += pt * ve;
            o1 += pt * vo;
            load16_bf16_split(vrow + 32, &ve, &vo);
            e2 += pt * ve;
            o2 += pt * vo;
            load16_bf16_split(vrow + 48, &ve, &vo);
            e3 += pt * ve;
            o3 += pt * vo;
        }
        store8(acc, e0);
        store8(acc + 8, o0);
        store8(acc + 16, e1);
        store8(acc + 24, o1);
        store8(acc + 32, e2);
        store8(acc + 40, o2);
        store8(acc + 48, e3);
        store8(acc + 56, o3);
        return;
    }
    f32x8 o[8];
    memcpy(o, acc, sizeof o);
    for (int t = 0; t < nt; t++) {
        const f32x8 pt = broadcast8(p + t);
        for (int c = 0; c < 8; c++) o[c] += pt * load8((const float *)v + vbase + t * row + 8 * c);
    }
    memcpy(acc, o, sizeof o);
}

#ifdef __AVX512F__
/* The 16-lane passes of AVX-512 builds (the attention kernels' avx512 and avx512_bf16 levels,
 * cbuild.py; vec.h's f32x16 helpers): 32 bf16 values widened by one shift and one mask, or none
 * at all with bf16 dot products. Where each pays off: kv_kind. */
static inline f32x16 broadcast16(const float *p) { return (f32x16)_mm512_set1_ps(*p); }

#ifdef __AVX512BF16__
/* acc plus the products of 32 bf16 values of q and k, summed in pairs into 16 lanes (vdpbf16ps:
 * each product is exact in fp32, the sums round as fp32 FMAs do; inputs and results below
 * 2^-126 are flushed to zero). */
static inline f32x16 dot32_bf16(f32x16 acc, const uint16_t *q, const uint16_t *k) {
    return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k));
}
#endif

/* The lane sums of 8 vectors as one vector: out[i] = sum(v[i]). */
static inline f32x8 sum16x8(const f32x16 v[8]) {
    f32x8 h[8];
    for (int i = 0; i < 8; i++)
        h[i] = (f32x8)_mm512_castps512_ps256((__m512)v[i]) + (f32x8)_mm512_extractf32x8_ps((__m512)v[i], 1);
    return sum8x8(h);
}

/* Dot products of q_h with 8 cached rows (row stride `row` elements from kbase): 8 independent
 * accumulators, one per row. q: fp32 (split for KV_BF16); qb: q_h as bf16 (KV_BF16_DOT). */
static inline __attribute__((always_inline)) f32x8 dots8_x16(const void *k, int64_t kbase, int64_t row,
                                                             const float *restrict q, const uint16_t *restrict qb,
                                                             const int D, const int kv) {
    (void)qb; /* KV_BF16_DOT's, in AVX512_BF16 builds */
    f32x16 s[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
    if (kv == KV_BF16_DOT) {
#ifdef __AVX512BF16__
        for (int c = 0; c < D; c += 32)
            for (int t = 0; t < 8; t++) s[t] = dot32_bf16(s[t], qb + c, (const uint16_t *)k + kbase + t * row + c);
#endif
    } else if (kv == KV_BF16) {
        for (int c = 0; c < D; c += 32) {
            const f32x16 qe = load16(q + c), qo = load16(q + c + 16);
            for (int t = 0; t < 8; t++) {
                f32x16 ke, ko;
                load32_bf16_split((const uint16_t *)k + kbase + t * row + c, &ke, &ko);
                s[t] += qe * ke;
                s[t] += qo * ko;
            }
        }
    } else {
        for (int c = 0; c < D; c += 16) {
            const f32x16 qc = load16(q + c);
            for (int t = 0; t < 8; t++) s[t] += qc * load16((const float *)k + kbase + t * row + c);
        }
    }
    return sum16x8(s);
}

/* The dot product of q_h with one cached row (the tail of a block). */
static inline __attribute__((always_inline)) float dot1_x16(const void *k, int64_t kbase, const float *restrict q,
                                                            const uint16_t *restrict qb, const int D, const int kv) {
    (void)qb;
    f32x16 s = {0};
    for (int c = 0; c < D; c += 32) {
        if (kv == KV_BF16_DOT) {
#ifdef __AVX512BF16__
            s = dot32_bf16(s, qb + c, (const uint16_t *)k + kbase + c);
#endif
        } else if (kv == KV_BF16) {
            f32x16 ke, ko;
            load32_bf16_split((const uint16_t *)k + kbase + c, &ke, &ko);
            s += load16(q + c) * ke;
            s += load16(q + c + 16) * ko;
        } else {
            s += load16(q + c) * load16((const float *)k + kbase + c);
            s += load16(q + c + 16) * load16((const float *)k + kbase + c + 16);
        }
    }
    return _mm512_reduce_add_ps((__m512)s);
}

/* acc[0..64) += sum over nt rows t of p[t] * v_t[0..64) (bf16 rows: acc split, see attend_blocked),
 * the 64 output lanes in registers over the rows. */
static inline __attribute__((always_inline)) void accumulate64_x16(const void *v, int64_t vbase, int64_t row,
                                                                   const float *restrict p, int nt, float *restrict acc,
                                                                   const int kv) {
    f32x16 o0 = load16(acc), o1 = load16(acc + 16), o2 = load16(acc + 32), o3 = load16(acc + 48);
    if (kv >= KV_BF16) {
        const uint16_t *restrict vrow = (const uint16_t *)v + vbase;
        for (int t = 0; t < nt; t++, vrow += row) {
            const f32x16 pt = broadcast16(p + t);
            f32x16 ve, vo;
            load32_bf16_split(vrow, &ve, &vo);
            o0 += pt * ve;
            o1 += pt * vo;
            load32_bf16_split(vrow + 32, &ve, &vo);
            o2 += pt * ve;
            o3 += pt * vo;
        }
    } else {
        const float *restrict vrow = (const float *)v + vbase;
        for (int t = 0; t < nt; t++, vrow += row) {
            const f32x16 pt = broadcast16(p + t);
            o0 += pt * load16(vrow);
            o1 += pt * load16(vrow + 16);
            o2 += pt * load16(vrow + 32);
            o3 += pt * load16(vrow + 48);
        }
    }
    store16(acc, o0);
    store16(acc + 16, o1);
    store16(acc + 32, o2);
    store16(acc + 48, o3);
}
#endif

#ifdef __AVX512F__
#define SPLIT_CHUNK 32 /* elements per even | odd chunk of a split row */
#else
#define SPLIT_CHUNK 16
#endif

/* The 16-lane passes where the build has them and kv asks for them, the 8-lane ones otherwise. */
static inline __attribute__((always_inline)) f32x8 dots8(const void *k, int64_t kbase, int64_t row,
                                                         const float *restrict q, const uint16_t *restrict qb,
                                                         const int D, const int kv) {
#ifdef __AVX512F__
    if (kv != KV_F32) return dots8_x16(k, kbase, row, q, qb, D, kv);
#endif
    return dots8_x8(k, kbase, row, q, qb, D, kv);
}

static inline __attribute__((always_inline)) float dot1(const void *k, int64_t kbase, const float *restrict q,
                                                        const uint16_t *restrict qb, const int D, const int kv) {
#ifdef __AVX512F__
    if (kv != KV_F32) return dot1_x16(k, kbase, q, qb, D, kv);
#endif
    return dot1_x8(k, kbase, q, qb, D, kv);
}

static inline __attribute__((always_inline)) void accumulate64(const void *v, int64_t vbase, int64_t row,
                                                               const float *restrict p, int nt, float *restrict acc,
                                                               const int kv) {
#ifdef __AVX512F__
    if (kv != KV_F32) {
        accumulate64_x16(v, vbase, row, p, nt, acc, kv);
        return;
    }
#endif
    accumulate64_x8(v, vbase, row, p, nt, acc, kv);
}

/* x[0..SPLIT_CHUNK) into dst as [x0 x2 .. | x1 x3 ..], the order load16_bf16_split (AVX2) or
 * load32_bf16_split (AVX-512) yields. */
static inline void split_chunk(const float *restrict x, float *restrict dst) {
    for (int i = 0; i < SPLIT_CHUNK / 2; i++) {
        dst[i] = x[2 * i];
        dst[SPLIT_CHUNK / 2 + i] = x[2 * i + 1];
    }
}

/* The inverse of split_chunk, in place. */
static inline void interleave_chunk(float *x) {
    float tmp[SPLIT_CHUNK];
    for (int i = 0; i < SPLIT_CHUNK / 2; i++) {
        tmp[2 * i] = x[i];
        tmp[2 * i + 1] = x[SPLIT_CHUNK / 2 + i];
    }
    memcpy(x, tmp, sizeof tmp);
}

/* attend_impl for head sizes that are multiples of 64, reorganised so that neither pass is
 * bound by arithmetic latency (the straightforward loops above read at about a third of what one
 * core can read):
 * - scores: 8 tokens at a time per query head, one accumulator per token (8 independent FMA
 *   chains instead of one dependent chain per dot product), one transposing reduction per 8
 *   (dots8);
 * - values: per query head, its output row held in registers (64 lanes) across a group's
 *   tokens instead of loaded and stored for every token (accumulate64).
 * A block of K (or V) rows is read from memory once and re-read from L1 by the other query
 * heads of its KV head (GQA). */
static inline __attribute__((always_inline)) void attend_blocked(const Args *a, int b, int kh0, int kh1,
                                                                 const float *restrict q, float *restrict scores,
                                                                 float *restrict acc, const int D, const int kv) {
    const int G = a->H / a->KVH, BS = a->BS, L = a->seq_lens[b];
    const int nkv = kh1 - kh0, nh = nkv * G, bf16 = kv >= KV_BF16;
    const int64_t row = (int64_t)a->KVH * D; /* elements per cached token */
    const int32_t *bt = a->block_table + (int64_t)b * a->bt_stride;
    const int nblocks = (L + BS - 1) / BS;
    /* bf16 caches: 16 cached values (AVX-512: 32) are widened with one shift and one mask (even
     * and odd elements, see load16_bf16_split) instead of two widening loads, so each chunk of the
     * queries is split alike here, and the outputs are accumulated split and put back in
     * order at the end: fewer instructions per cached value, so the loop stays bound by memory. */
    float qsplit[kv == KV_BF16 ? nh * D : 1];
    if (kv == KV_BF16)
        for (int i = 0; i < nh * D; i += SPLIT_CHUNK) split_chunk(q + i, qsplit + i);
    /* KV_BF16_DOT: the queries as the bf16 values they are (io_bf16: exact) */
    uint16_t qb[kv == KV_BF16_DOT ? nh * D : 1];
    if (kv == KV_BF16_DOT)
        for (int i = 0; i < nh * D; i++) qb[i] = f32_to_bf16(q[i]);
    const float *qs = kv == KV_BF16 ? qsplit : q;

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
                const int64_t kbase = base + (int64_t)t0 * row + (int64_t)(h / G) * D;
                const uint16_t *qbh = kv == KV_BF16_DOT ? qb + (int64_t)h * D : qb;
                const f32x8 r = dots8(a->k_cache, kbase, row, qs + (int64_t)h * D, qbh, D, kv) * a->scale;
                memcpy(scores + (int64_t)h * L + (int64_t)blk * BS + t0, &r, sizeof r);
            }
        }
        for (; t0 < n; t0++) {
            for (int h = 0; h < nh; h++) {
                const int64_t kbase = base + (int64_t)t0 * row + (int64_t)(h / G) * D;
                const uint16_t *qbh = kv == KV_BF16_DOT ? qb + (int64_t)h * D : qb;
                scores[(int64_t)h * L + (int64_t)blk * BS + t0] =
                    dot1(a->k_cache, kbase, qs + (int64_t)h * D, qbh, D, kv) * a->scale;
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
                for (int d0 = 0; d0 < D; d0 += 64)
                    accumulate64(a->v_cache, base + (int64_t)t0 * row + (int64_t)(h / G) * D + d0, row, ph, nt,
                                 acc + (int64_t)h * D + d0, kv);
            }
        }
    }

    for (int h = 0; h < nh; h++) {
        if (bf16) /* back from even | odd halves to element order */
            for (int c = 0; c < D; c += SPLIT_CHUNK) interleave_chunk(acc + (int64_t)h * D + c);
        for (int d = 0; d < D; d++) acc[(int64_t)h * D + d] *= inv_sum[h];
    }
}

typedef void (*AttendFn)(const Args *, int, int, int, const float *, float *, float *, float *);

/* How attend_blocked consumes the cache for a unit of nkv KV heads. AVX-512 builds against the
 * AVX2 build, the kernel alone (64 requests x ~400 tokens over shuffled blocks, and batch 1 x 400
 * tokens, whose units are single KV heads read from L3):
 * - bf16 caches, 16 lanes: 32 cached values widened by one shift and one mask, and with bf16
 *   queries (io_bf16) no widening of K at all: vdpbf16ps (dot32_bf16); the V pass stays fp32.
 *   Fewer instructions per cached value: faster than widening K, at batch 1 and at 64 requests.
 * - fp32 caches: with many requests the kernel is memory bound and the 8-lane passes (compiled
 *   at x86-64-v4) ran a little faster than 16 lanes. Units of one KV head (a few requests) are
 *   bound by the arithmetic: 16 lanes there. */
static inline int kv_kind(const Args *a, int nkv) {
#ifdef __AVX512BF16__
    if (a->is_bf16 && a->io_bf16) return KV_BF16_DOT;
#endif
    if (a->is_bf16) return KV_BF16;
#ifdef __AVX512F__
    if (nkv == 1) return KV_F32_X16;
#endif
    (void)nkv;
    return KV_F32;
}

/* attend_blocked's copy for head size D and the unit's kind (kv_kind). */
static inline __attribute__((always_inline)) void attend_kind(const Args *a, int b, int kh0, int kh1, const float *q,
                                                              float *s, float *acc, const int D) {
    switch (kv_kind(a, kh1 - kh0)) {
#ifdef __AVX512BF16__
    case KV_BF16_DOT: attend_blocked(a, b, kh0, kh1, q, s, acc, D, KV_BF16_DOT); break;
#endif
#ifdef __AVX512F__
    case KV_F32_X16: attend_blocked(a, b, kh0, kh1, q, s, acc, D, KV_F32_X16); break;
#endif
    case KV_BF16: attend_blocked(a, b, kh0, kh1, q, s, acc, D, KV_BF16); break;
    default: attend_blocked(a, b, kh0, kh1, q, s, acc, D, KV_F32);
    }
}

static void attend_d64(const Args *a, int b, int kh0, int kh1, const float *q, float *s, float *acc, float *tmp) {
    (void)tmp;
    attend_kind(a, b, kh0, kh1, q, s, acc, 64);
}
static void attend_d128(const Args *a, int b, int kh0, int kh1, const float *q, float *s, float *acc, float *tmp) {
    (void)tmp;
    attend_kind(a, b, kh0, kh1, q, s, acc, 128);
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
