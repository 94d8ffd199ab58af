/* SIMD helpers shared by the hand-written CPU kernels (punica_kernels/csrc/add_lora_cpu.c,
 * the C files under engine/model/csrc); punica_kernels.cbuild puts this folder on the include path.
 *
 * Each kernel has an AVX-512 path (16 fp32 lanes), an AVX2 + FMA path (8 lanes, 16 registers:
 * loops keep at most 8 accumulators) and a plain C path; `-march=native` picks one at build time.
 * TESSERA_AVX2 is defined where the AVX2 path is the one compiled (no AVX-512);
 * TESSERA_HAS_AVX2 wherever AVX2 + FMA can be used (AVX-512 CPUs too), with the 8-lane helpers
 * below, for code that has one 8-lane version for both. */
#ifndef TESSERA_SIMD_H
#define TESSERA_SIMD_H
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TESSERA_AVX2 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TESSERA_HAS_AVX2 1

/* r[k] = sum of the 8 lanes of v[k], for k = 0..7 (a transpose-and-add tree: 7 adds of
 * interleaved pairs instead of 8 horizontal reductions). */
static inline __m256 tessera_sum8(const __m256 v[8]) {
    /* pairs of rows: lanes hold partial sums of (v0, v1), (v2, v3), ... interleaved */
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    /* per 128-bit half: [s0 s1 s2 s3] of rows 0-3 (resp. 4-7), low half's lanes then high's */
    const __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);
    /* add the two 128-bit halves: rows 0-3 from b0, rows 4-7 from b1 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* the sum of v's 8 lanes */
static inline float tessera_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* the largest of v's 8 lanes */
static inline float tessera_hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
#ifdef __AVX512F__

/* r[k] = sum of the 16 lanes of v[k], for k = 0..15: a transpose-and-add tree (15 shuffles and
 * adds in all) instead of 16 horizontal reductions. */
static inline __m512 tessera_sum16(__m512 v[16]) {
    __m512 w[8], u[4], s[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* t[4k + m] holds the sum of v[4m + k] */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, t);
}
#endif
#endif
