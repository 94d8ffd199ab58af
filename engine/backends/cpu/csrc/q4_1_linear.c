/* Weight-only linear on the GGUF file's own Q4_1 blocks, for single-stream decode on the CPU:
 *     y[m, n] = sum_b ( d[n, b] * sum_{i<32} q[n, 32b + i] * x[m, 32b + i] + mn[n, b] * sum_{i<32} x[m, 32b + i] )
 * i.e. x @ W.T with W[n, 32b + i] = d[n, b] * q + mn[n, b], q in 0..15: the weights llama.cpp
 * quantized, exactly (no re-quantization). x [M, K] fp32, y [M, N] fp32, N % 16 == 0, K % 32 == 0.
 * w: per 16 output rows and 32 inputs, 320 bytes (engine.model.cpu_q4.block_weight):
 *     16 rows x 16 bytes of nibbles (ggml's order: byte j holds inputs j (low) and j + 16 (high)),
 *     then the 16 rows' d as fp16, then their mins as fp16.
 * xsum: scratch [M, K / 32].
 *
 * Why by hand: single-stream decode streams every weight once a token, so bytes are the cost.
 * Q4_1 is 0.625 bytes a weight against int8's 1 (a SmolLM2 token: ~66 MB instead of 106 MB).
 * The 16 rows' products of a block are summed by one transpose-and-add, scaled by the rows' d and
 * offset by their min times the block's sum of x. The weight stream is prefetched ahead as in
 * int8_linear.c; row groups are shared between torch's OpenMP threads.
 */
#include <stddef.h>
#include <stdint.h>

#include "tessera_lora_hooks.h" /* the fused entry's LoRA term (punica_kernels/csrc/add_lora_cpu.c) */
#include "tessera_simd.h"

#define PREFETCH_BYTES 16384

int tessera_q4_1_available(void) {
#if (defined(__AVX512F__) || defined(TESSERA_AVX2)) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__F16C__)
static void q4_xsum(int64_t M, int64_t K, const float *x, float *xsum) {
    const int64_t KB = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t kb = 0; kb < KB; kb++)
            xsum[m * KB + kb] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(x + m * K + kb * 32), _mm512_loadu_ps(x + m * K + kb * 32 + 16)));
}

/* Output rows nb * 16 .. nb * 16 + 15 for every batch row. */
static inline void q4_block(int64_t nb, int64_t M, int64_t K, int64_t N, const float *x, const uint8_t *w,
                            float *y, const float *xsum) {
    const int64_t KB = K / 32;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const uint8_t *blk = w + nb * KB * 320;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t kb = 0; kb < KB; kb++) {
            const uint8_t *p = blk + kb * 320;
            if (m == 0)
                for (int l = 0; l < 5; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
            const __m512 xl = _mm512_loadu_ps(xm + kb * 32), xh = _mm512_loadu_ps(xm + kb * 32 + 16);
            __m512 part[16];
            for (int r = 0; r < 16; r++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(p + r * 16));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4)));
                part[r] = _mm512_fmadd_ps(lo, xl, _mm512_mul_ps(hi, xh));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
            const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
            acc = _mm512_fmadd_ps(d, tessera_sum16(part), acc);
            acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * KB + kb]), acc);
        }
        _mm512_storeu_ps(y + m * N + nb * 16, acc);
    }
}
#elif defined(TESSERA_AVX2) && defined(__F16C__)
static void q4_xsum(int64_t M, int64_t K, const float *x, float *xsum) {
    const int64_t KB = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t kb = 0; kb < KB; kb++) {
            const float *xb = x + m * K + kb * 32;
            xsum[m * KB + kb] = tessera_hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                                            _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
        }
}

/* Output rows nb * 16 .. nb * 16 + 15 for every batch row, as above with 8 lanes: the 16 rows in
 * two halves of 8 (8 partial sums fit AVX2's 16 registers beside the block's 32 inputs); the
 * second half's pass over the group's stream finds it in L1/L2. */
static inline void q4_block(int64_t nb, int64_t M, int64_t K, int64_t N, const float *x, const uint8_t *w,
                            float *y, const float *xsum) {
    const int64_t KB = K / 32;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const uint8_t *blk = w + nb * KB * 320;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        for (int half = 0; half < 2; half++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t kb = 0; kb < KB; kb++) {
                const uint8_t *p = blk + kb * 320;
                if (m == 0 && half == 0)
                    for (int l = 0; l < 5; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
                const float *xb = xm + kb * 32;
                const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
                const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
                __m256 part[8];
                for (int r = 0; r < 8; r++) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(p + (half * 8 + r) * 16));
                    const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
                    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0);
                    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), x1, t);
                    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, t);
                    part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), x3, t);
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + half * 16)));
                const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + half * 16)));
                acc = _mm256_fmadd_ps(d, tessera_sum8(part), acc);
                acc = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * KB + kb]), acc);
            }
            _mm256_storeu_ps(y + m * N + nb * 16 + half * 8, acc);
        }
    }
}
#else
static void q4_xsum(int64_t M, int64_t K, const float *x, float *xsum) { (void)M, (void)K, (void)x, (void)xsum; }
static inline void q4_block(int64_t nb, int64_t M, int64_t K, int64_t N, const float *x, const uint8_t *w,
                            float *y, const float *xsum) {
    (void)nb, (void)M, (void)K, (void)N, (void)x, (void)w, (void)y, (void)xsum; /* never called: not available */
}
#endif

void tessera_q4_1_linear_f32(int64_t M, int64_t K, int64_t N, const float *x, const uint8_t *w, float *y,
                             float *xsum) {
    const int64_t NB = N / 16;
    q4_xsum(M, K, x, xsum);
#pragma omp parallel for schedule(static) if (NB > 1)
    for (int64_t nb = 0; nb < NB; nb++) q4_block(nb, M, K, N, x, w, y, xsum);
}

/* The same product, then y += the LoRA term of x on `stack` for the step's tokens, in one
 * parallel region, as int8_linear.c's tessera_int8_linear_lora_f32. Returns 0 or the LoRA call's
 * error code (nothing written). */
int tessera_q4_1_linear_lora_f32(int64_t M, int64_t K, int64_t N, const float *x, const uint8_t *w, float *y,
                                 float *xsum, const tessera_lora_hooks_t *h, const void *stack, void *step,
                                 const int32_t *ranks) {
    void *call;
    int one;
    const int rc = h->prepare(stack, step, N, x, y, ranks, &call, &one);
    if (rc != 0) return rc;
    if (call == NULL) {
        tessera_q4_1_linear_f32(M, K, N, x, w, y, xsum);
        return 0;
    }
    const int64_t NB = N / 16;
    q4_xsum(M, K, x, xsum);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < NB; nb++) q4_block(nb, M, K, N, x, w, y, xsum);
        tessera_lora_fused_part(h, call, one);
    }
    return 0;
}
