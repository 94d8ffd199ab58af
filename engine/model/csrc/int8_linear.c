/* Weight-only int8 linear for decode-sized batches (1-4 rows) on the CPU:
 *     y[m, n] = scales[n] * sum_k x[m, k] * w[n, k]
 * x [M, K] fp32, scales [N] fp32, y [M, N] fp32; w int8 in a blocked layout
 * [N/16][K/16][16 rows][16 k] (engine.model.cpu_int8.block_weight), N and K multiples of 16.
 *
 * Why by hand: at 1-4 rows the step streams through the weights, and torch's
 * _weight_int8pack_mm reads them at ~13-15 GB/s here. In the blocked layout every 16 output rows
 * are one contiguous stream (256 bytes per 16 k), which this loop reads at ~30 GB/s (2x, M=1):
 * int8 widened to fp32 in registers, 16 accumulators per batch row (fp32 activations, no bf16
 * rounding), one transpose-and-add tree for the 16 sums. Row blocks are shared between torch's
 * OpenMP threads (the process's only libgomp). Software prefetch keeps the stream at memory speed.
 */
#include <stdint.h>

#include "tessera_simd.h" /* tessera_sum16 / tessera_sum8, immintrin.h */

/* Software prefetch distance in the weight stream (into L2). Each call streams one layer's weights
 * (0.3-1.7 MB) once; the hardware prefetcher ramps up too slowly on streams that short, and a
 * step's 120 calls left each core at ~8 GB/s. 16 KB ahead into L2 measured best of 2-64 KB (L1
 * or L2) inside a real decode step: ~16 -> ~24 GB/s (bench/RESULTS.md). Past the end of a thread's
 * rows it only touches the next rows or misses harmlessly (a prefetch never faults). */
#define PREFETCH_BYTES 16384

void tessera_int8_linear_f32(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                             const float *scales, float *y) {
    const int64_t NB = N / 16, KB = K / 16;
#pragma omp parallel for schedule(static) if (NB > 1)
    for (int64_t nb = 0; nb < NB; nb++) {
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
#elif defined(TESSERA_AVX2)
            /* 8 accumulators: the block's 16 rows in two halves, each a pass over the 16 rows'
             * stream (K/16 blocks of 256 bytes; a row group's whole stream is 9-24 KB for
             * SmolLM2, so the second half finds it in L1/L2) */
            for (int half = 0; half < 2; half++) {
                __m256 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
                for (int64_t kb = 0; kb < KB; kb++) {
                    const __m256 x0 = _mm256_loadu_ps(xm + kb * 16), x1 = _mm256_loadu_ps(xm + kb * 16 + 8);
                    const int8_t *p = blk + kb * 256 + half * 128;
                    if (m == 0 && half == 0)
                        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
                    for (int r = 0; r < 8; r++) {
                        const __m128i q = _mm_loadu_si128((const __m128i *)(p + r * 16));
                        acc[r] = _mm256_fmadd_ps(x0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), acc[r]);
                        acc[r] = _mm256_fmadd_ps(x1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), acc[r]);
                    }
                }
                const int64_t n0 = nb * 16 + half * 8;
                _mm256_storeu_ps(y + m * N + n0, _mm256_mul_ps(tessera_sum8(acc), _mm256_loadu_ps(scales + n0)));
            }
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
}
