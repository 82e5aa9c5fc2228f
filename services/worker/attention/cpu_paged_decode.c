/* Paged decode attention for CPUs: one query token per request, K/V read in place from
 * the paged cache (no gather copy), GQA, fp32 or bf16 cache, fp32 math.
 *
 * Built at first use by cpu_backend.py (gcc -O3 -march=native); each call splits the
 * (request, kv head) pairs over `num_threads` pthreads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;            /* [B, H, D] */
    const void *k_cache;       /* [num_blocks, BS, KVH, D] */
    const void *v_cache;
    const int32_t *block_table; /* [B, bt_stride] */
    const int32_t *seq_lens;   /* [B] */
    float *out;                /* [B, H, D] */
    int64_t bt_stride;
    int B, H, KVH, D, BS, is_bf16, num_threads, thread_idx;
    float scale;
} Job;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Copy one cache row of D elements to fp32 (a no-op view for fp32 caches). */
static inline const float *row_f32(const void *cache, int64_t offset, int D, int is_bf16, float *tmp) {
    if (!is_bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    for (int d = 0; d < D; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

static void attend_one(const Job *j, int b, int kh, float *scores, float *acc, float *tmp) {
    const int G = j->H / j->KVH, D = j->D, L = j->seq_lens[b];
    const float *qb = j->q + ((int64_t)b * j->H + (int64_t)kh * G) * D;
    const int32_t *bt = j->block_table + (int64_t)b * j->bt_stride;
    for (int t = 0; t < L; t++) {
        int64_t off = (((int64_t)bt[t / j->BS] * j->BS + t % j->BS) * j->KVH + kh) * D;
        const float *k = row_f32(j->k_cache, off, D, j->is_bf16, tmp);
        for (int g = 0; g < G; g++) {
            const float *qg = qb + (int64_t)g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qg[d] * k[d];
            scores[(int64_t)g * L + t] = s * j->scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * L;
        float m = -INFINITY, sum = 0.f;
        for (int t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;
        for (int t = 0; t < L; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }
        float inv = 1.f / sum;
        for (int t = 0; t < L; t++) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int t = 0; t < L; t++) {
        int64_t off = (((int64_t)bt[t / j->BS] * j->BS + t % j->BS) * j->KVH + kh) * D;
        const float *v = row_f32(j->v_cache, off, D, j->is_bf16, tmp);
        for (int g = 0; g < G; g++) {
            float p = scores[(int64_t)g * L + t];
            float *ag = acc + (int64_t)g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ag[d] += p * v[d];
        }
    }
    float *ob = j->out + ((int64_t)b * j->H + (int64_t)kh * G) * D;
    memcpy(ob, acc, sizeof(float) * G * D);
}

static void *run_job(void *arg) {
    const Job *j = (const Job *)arg;
    int max_len = 0;
    for (int b = 0; b < j->B; b++) max_len = j->seq_lens[b] > max_len ? j->seq_lens[b] : max_len;
    const int G = j->H / j->KVH;
    float *scores = malloc(sizeof(float) * ((size_t)G * max_len + (size_t)G * j->D + j->D));
    float *acc = scores + (size_t)G * max_len;
    float *tmp = acc + (size_t)G * j->D;
    /* Interleaved (request, kv head) units: neighbours have similar lengths, so this balances. */
    for (int u = j->thread_idx; u < j->B * j->KVH; u += j->num_threads)
        attend_one(j, u / j->KVH, u % j->KVH, scores, acc, tmp);
    free(scores);
    return NULL;
}

int paged_decode(const float *q, const void *k_cache, const void *v_cache, const int32_t *block_table,
                 int64_t bt_stride, const int32_t *seq_lens, float *out, int B, int H, int KVH, int D, int BS,
                 float scale, int is_bf16, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    Job jobs[64];
    pthread_t threads[64];
    for (int i = 0; i < num_threads; i++) {
        jobs[i] = (Job){q, k_cache, v_cache, block_table, seq_lens, out, bt_stride,
                        B, H, KVH, D, BS, is_bf16, num_threads, i, scale};
    }
    for (int i = 1; i < num_threads; i++)
        if (pthread_create(&threads[i], NULL, run_job, &jobs[i]) != 0) return -1;
    run_job(&jobs[0]);
    for (int i = 1; i < num_threads; i++) pthread_join(threads[i], NULL);
    return 0;
}
