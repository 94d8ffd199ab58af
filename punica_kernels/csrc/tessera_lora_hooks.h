/* How a base linear's kernel (engine/backends/cpu/csrc: the int8 and Q4_1 kernels) adds the CPU
 * LoRA kernel's term (add_lora_cpu.c) to its own output inside its own parallel region: one call
 * from Python and one OpenMP region for both products instead of two of each, and the adapter
 * weights prefetched while the base weights stream (a decode step's adapter blocks are cold: the
 * base matmuls between two LoRA calls push them out of L2 and L3).
 *
 * The LoRA library exports one `tessera_lora_hooks` (cpu_native passes its address to the base
 * kernel's fused entry); the base kernel sees the call, the step and the stack only as opaque
 * pointers. A fused entry:
 *     prepare(stack, step, ldy, x, y, ranks, &call, &one)    before its region; rc != 0: refuse
 *     call == NULL: nothing to add (no token has an adapter); else, in one region:
 *     a thread that takes a share (every thread, or only thread 0 where `one` is set):
 *         prefetch_start(call, share, shares, state); prefetch(state, bytes) as its base rows go
 *     a barrier (the base output complete), then part(call, share, shares) on those threads.
 * The result is bit-identical to the base product followed by the LoRA call on its own. */
#ifndef TESSERA_LORA_HOOKS_H
#define TESSERA_LORA_HOOKS_H
#include <stdint.h>

/* Bytes of a thread's prefetch state (a prefetch cursor), kept on the base kernel's stack. */
#define TESSERA_LORA_PF_STATE_BYTES 256

typedef struct {
    /* Checks and lays out one call (y[t, :] rows ldy apart += the LoRA term of x on the stack for
     * the step's tokens) in the step's scratch: 0, or the LoRA call's error code (-1 a rank
     * outside the stack, -2 no memory). *call: NULL when no token has an adapter; *one: 1 when
     * the call runs on one thread (share 0 of 1: a single work item), 0 when every thread of the
     * region takes a share. */
    int (*prepare)(const void *stack, void *step, int64_t ldy, const float *x, float *y, const int32_t *ranks,
                   void **call, int *one);
    /* Starts a thread's prefetch of its share's weights; returns the bytes it will prefetch
     * (at most a cap, so a share wider than L2 is not pushed out by its own prefetches). */
    int64_t (*prefetch_start)(void *call, int64_t share, int64_t shares, void *state);
    /* Prefetches the next `bytes` of the share (nothing past its end). */
    void (*prefetch)(void *state, int64_t bytes);
    /* Adds the share's part of the term (share `share` of `shares`; with shares > 1 every thread
     * of the region must call it: it holds a barrier). */
    void (*part)(void *call, int64_t share, int64_t shares);
} tessera_lora_hooks_t;

#endif
