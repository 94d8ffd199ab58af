/* Weight-only int8 linear for decode batches on the CPU:
 *     y[m, n] = scales[n] * sum_k x[m, k] * w[n, k]
 * x [M, K] fp32, scales [N] fp32, y [M, N] fp32; w int8 in a blocked layout
 * [N/16][K/16][16 rows][16 k] (engine.model.cpu_int8.block_weight), N and K multiples of 16.
 *
 * Why by hand: at 1-4 rows the step streams through the weights, so the rate it reads them at is
 * its speed, and torch's _weight_int8pack_mm reads them well below memory speed. In the blocked
 * layout every 16 output rows are one contiguous stream (256 bytes per 16 k), which this loop
 * reads near memory speed (bench/RESULTS.md):
 * int8 widened to fp32 in registers, 16 accumulators per batch row (fp32 activations, no bf16
 * rounding), one transpose-and-add tree for the 16 sums. Row blocks are shared between torch's
 * OpenMP threads (the process's only libgomp). Software prefetch keeps the stream at memory speed.
 * The AVX-512 path serves 1-4 rows (wider batches go to the AMX kernel or a dense GEMM). On
 * AVX2-only CPUs the widening costs as much as the FMAs, so batch rows are taken in pairs that
 * share each widened weight; there this kernel is also the wide batches' fastest path (faster at
 * 32 rows than the dense fp32 copy's GEMM, bench/RESULTS.md).
 */
#include <stddef.h>
#include <stdint.h>

#include "tessera_lora_hooks.h" /* the fused entry's LoRA term (punica_kernels/csrc/add_lora_cpu.c) */
#include "tessera_simd.h"       /* tessera_sum16 / tessera_sum8, immintrin.h */

/* Software prefetch distance in the weight stream (into L2). Each call streams one layer's weights
 * (0.3-1.7 MB) once; the hardware prefetcher ramps up too slowly on streams that short. 16 KB
 * ahead into L2 was the best of the distances tried (2-64 KB, L1 or L2) inside a real decode step
 * (bench/RESULTS.md). Past the end of a thread's
 * rows it only touches the next rows or misses harmlessly (a prefetch never faults). */
#define PREFETCH_BYTES 16384

#ifdef TESSERA_AVX2
/* 8 int8 weights from p, as fp32 */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One row group (16 output rows, blocked stream blk of KB blocks) for batch rows m0 and m1: four
 * passes of 4 output rows, 8 accumulators (4 rows x 2 batch rows), so each weight is widened once
 * for both batch rows (widening costs as much as the FMAs on AVX2). The group's stream is 9-24 KB
 * for SmolLM2: the later passes find it in L1/L2. */
static void row_group_pair(const int8_t *blk, int64_t KB, const float *x0, const float *x1, const float *sc,
                           float *y0, float *y1, int prefetch) {
    for (int qr = 0; qr < 4; qr++) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t kb = 0; kb < KB; kb++) {
            const __m256 a0 = _mm256_loadu_ps(x0 + kb * 16), a1 = _mm256_loadu_ps(x0 + kb * 16 + 8);
            const __m256 b0 = _mm256_loadu_ps(x1 + kb * 16), b1 = _mm256_loadu_ps(x1 + kb * 16 + 8);
            const int8_t *p = blk + kb * 256 + qr * 64;
            if (prefetch && qr == 0)
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
            for (int r = 0; r < 4; r++) {
                const __m256 w0 = widen8(p + r * 16), w1 = widen8(p + r * 16 + 8);
                acc[r] = _mm256_fmadd_ps(a1, w1, _mm256_fmadd_ps(a0, w0, acc[r]));
                acc[4 + r] = _mm256_fmadd_ps(b1, w1, _mm256_fmadd_ps(b0, w0, acc[4 + r]));
            }
        }
        const __m256 s = tessera_sum8(acc); /* lanes 0-3: row m0's 4 outputs, 4-7: row m1's */
        const __m128 sc4 = _mm_loadu_ps(sc + qr * 4);
        _mm_storeu_ps(y0 + qr * 4, _mm_mul_ps(_mm256_castps256_ps128(s), sc4));
        _mm_storeu_ps(y1 + qr * 4, _mm_mul_ps(_mm256_extractf128_ps(s, 1), sc4));
    }
}

/* One row group for a single batch row: two passes of 8 output rows, 8 accumulators. */
static void row_group_one(const int8_t *blk, int64_t KB, const float *x, const float *sc, float *y, int prefetch) {
    for (int half = 0; half < 2; half++) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t kb = 0; kb < KB; kb++) {
            const __m256 a0 = _mm256_loadu_ps(x + kb * 16), a1 = _mm256_loadu_ps(x + kb * 16 + 8);
            const int8_t *p = blk + kb * 256 + half * 128;
            if (prefetch && half == 0)
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(a1, widen8(p + r * 16 + 8), _mm256_fmadd_ps(a0, widen8(p + r * 16), acc[r]));
        }
        _mm256_storeu_ps(y + half * 8, _mm256_mul_ps(tessera_sum8(acc), _mm256_loadu_ps(sc + half * 8)));
    }
}

/* Output rows nb * 16 .. nb * 16 + 15 for every batch row. */
static inline void int8_block(int64_t nb, int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                              const float *scales, float *y) {
    const int64_t KB = K / 16;
    for (int64_t m = 0; m < M; m += 2) {
        const int8_t *blk = w + nb * KB * 256;
        if (m + 1 < M)
            row_group_pair(blk, KB, x + m * K, x + (m + 1) * K, scales + nb * 16, y + m * N + nb * 16,
                           y + (m + 1) * N + nb * 16, m == 0);
        else
            row_group_one(blk, KB, x + m * K, scales + nb * 16, y + m * N + nb * 16, m == 0);
    }
}
#else
/* Output rows nb * 16 .. nb * 16 + 15 for every batch row. */
static inline void int8_block(int64_t nb, int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                              const float *scales, float *y) {
    const int64_t KB = K / 16;
    const int8_t *blk = w + nb * KB * 256;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
#ifdef __AVX512F__
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t kb = 0; kb < KB; kb++) {
            const __m512 xv = _mm512_loadu_ps(xm + kb * 16);
            const int8_t *p = blk + kb * 256;
            if (m == 0) /* the first row streams the weights in; later rows find them in L1/L2 */
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_fmadd_ps(
                    xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + r * 16)))),
                    acc[r]);
        }
        _mm512_storeu_ps(y + m * N + nb * 16, _mm512_mul_ps(tessera_sum16(acc), _mm512_loadu_ps(scales + nb * 16)));
#else
        float acc[16] = {0};
        for (int64_t kb = 0; kb < KB; kb++) {
            const int8_t *p = blk + kb * 256;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) acc[r] += xm[kb * 16 + c] * (float)p[r * 16 + c];
        }
        for (int r = 0; r < 16; r++) y[m * N + nb * 16 + r] = acc[r] * scales[nb * 16 + r];
#endif
    }
}
#endif

void tessera_int8_linear_f32(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                             const float *scales, float *y) {
    const int64_t NB = N / 16;
#pragma omp parallel for schedule(static) if (NB > 1)
    for (int64_t nb = 0; nb < NB; nb++) int8_block(nb, M, K, N, x, w, scales, y);
}

/* The same product, then y += the LoRA term of x on `stack` for the step's tokens, in one
 * parallel region (tessera_lora_hooks.h: the base rows, a barrier, the LoRA term's shares).
 * Returns 0 or the LoRA call's error code (nothing written). */
int tessera_int8_linear_lora_f32(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                                 const float *scales, float *y, const tessera_lora_hooks_t *h, const void *stack,
                                 void *step, const int32_t *ranks) {
    void *call;
    int one;
    const int rc = h->prepare(stack, step, N, x, y, ranks, &call, &one);
    if (rc != 0) return rc;
    if (call == NULL) {
        tessera_int8_linear_f32(M, K, N, x, w, scales, y);
        return 0;
    }
    const int64_t NB = N / 16;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < NB; nb++) int8_block(nb, M, K, N, x, w, scales, y);
        tessera_lora_fused_part(h, call, one);
    }
    return 0;
}

