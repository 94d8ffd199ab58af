/* How a base linear's kernel (engine/backends/cpu/csrc: the int8 and Q4_1 kernels) adds the CPU
 * LoRA kernel's term (add_lora_cpu.c) to its own output inside its own call: one call from Python
 * and one OpenMP region for both products instead of two of each.
 *
 * The LoRA library exports one `tessera_lora_hooks` (cpu_native passes its address to the base
 * kernel's fused entry); the base kernel sees the call, the step and the stack only as opaque
 * pointers. A fused entry:
 *     prepare(stack, step, ldy, x, y, ranks, &call, &one)    before its region; rc != 0: refuse
 *     call == NULL: nothing to add (no token has an adapter); else, in one region, after the
 *     base product's barrier: part(call, tid, nth) on every thread, or part(call, 0, 1) on
 *     thread 0 alone where `one` is set.
 * The result is bit-identical to the base product followed by the LoRA call on its own. */
#ifndef TESSERA_LORA_HOOKS_H
#define TESSERA_LORA_HOOKS_H
#include <stdint.h>

typedef struct {
    /* Checks and lays out one call (y[t, :] rows ldy apart += the LoRA term of x on the stack for
     * the step's tokens) in the step's scratch: 0, or the LoRA call's error code (-1 a rank
     * outside the stack, -2 no memory). *call: NULL when no token has an adapter; *one: 1 when
     * the call runs on one thread (a single work item), 0 when every thread of the region takes
     * a share. */
    int (*prepare)(const void *stack, void *step, int64_t ldy, const float *x, float *y, const int32_t *ranks,
                   void **call, int *one);
    /* Adds share `share` of `shares` of the term: every share must be run, each on its own thread
     * (they write disjoint outputs and wait for nothing), and `shares` may not exceed
     * omp_get_max_threads() as it was at prepare (a region of the caller's default team). */
    void (*part)(void *call, int64_t share, int64_t shares);
} tessera_lora_hooks_t;

#ifdef _OPENMP
#include <omp.h>
/* In a fused entry's region, after the base product's barrier: this thread's share of the term. */
static inline void tessera_lora_fused_part(const tessera_lora_hooks_t *h, void *call, int one) {
    if (!one)
        h->part(call, omp_get_thread_num(), omp_get_num_threads());
    else if (omp_get_thread_num() == 0)
        h->part(call, 0, 1);
}
#endif

#endif
