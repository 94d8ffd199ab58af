/* AVX-512 helpers shared by the hand-written CPU kernels (punica_kernels/csrc/add_lora_cpu.c,
 * engine/model/csrc/int8_linear.c); punica_kernels.cbuild puts this folder on the include path. */
#ifndef TESSERA_SIMD_H
#define TESSERA_SIMD_H
#ifdef __AVX512F__
#include <immintrin.h>

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
