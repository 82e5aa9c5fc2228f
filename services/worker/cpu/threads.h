/* OpenMP thread helpers shared by the CPU kernels (models/c_step/decode_step.c,
 * attention/cpu_paged_decode.c, attention/cpu_paged_prefill.c), with serial fallbacks for a build
 * without OpenMP. */
#ifndef MYVLLM_THREADS_H
#define MYVLLM_THREADS_H

#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* This thread's slice of a scratch array holding `per_thread` floats per thread. */
static inline float *thread_scratch(float *scratch, size_t per_thread) {
    return scratch + per_thread * (size_t)thread_id();
}

#endif
