/* The decoder's small per-token ops on the CPU, each one call instead of 5-20 torch ops:
 *
 *   tessera_rms_norm:        h[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * w
 *   tessera_add_rms_norm:    x[m] += a[m];  h[m] = rms_norm(x[m])           (residual + norm)
 *   tessera_silu_mul:        out[m, i] = silu(gu[m, i]) * gu[m, I + i]        (SwiGLU gate)
 *   tessera_decode_attention: for each decode token t (one per sequence): rotate its q and k
 *       heads (RoPE, rotate-half layout), write its k and v to the cache at its slot, then for
 *       each query head g: out[t, g] = softmax(scale * q[t, g] . K[slots[t, :len[t]], g / G]) @ V[...]
 *       (G = query heads per KV head), reading the cache rows in place by slot.
 *
 * Why by hand: a SmolLM2 decode step is 30 layers of tiny tensors, and torch pays ~5-15 us of
 * dispatch per op on ~35 ops a layer (a third of a single-stream step), plus gathers that copy
 * every cached K/V row before SDPA reads it. Everything is fp32, accumulated in fp32, in the same
 * order for a row whatever else is in the batch (so a sequence's output does not depend on its
 * batch). Rows and (token, KV head) pairs are shared between torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "tessera_simd.h" /* immintrin.h where AVX-512 is on */

static float sum_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void norm_row(const float *x, const float *w, float eps, int64_t H, float *h) {
    const float r = 1.0f / sqrtf(sum_squares(x, H) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) h[i] = w[i] * (x[i] * r);
}

void tessera_rms_norm(int64_t M, int64_t H, const float *x, const float *w, float eps, float *h) {
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) norm_row(x + m * H, w, eps, H, h + m * H);
}

void tessera_add_rms_norm(int64_t M, int64_t H, float *x, const float *a, const float *w, float eps, float *h) {
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * H;
        const float *am = a + m * H;
        for (int64_t i = 0; i < H; i++) xm[i] += am[i];
        norm_row(xm, w, eps, H, h + m * H);
    }
}

void tessera_silu_mul(int64_t M, int64_t I, const float *gu, float *out) {
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* x [D] rotated in place: x[d] * cos[d] + rotate_half(x)[d] * sin[d], rotate_half(x) = (-x2, x1). */
static void rope(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[d + half];
        x[d] = a * cos[d] - b * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* qkv: [*, qkv_stride] rows of the step (decode tokens first), each q heads | k heads | v heads.
 * cos/sin: [nd, D] of each decode token's position. k_cache/v_cache: [slots, Hkv, D].
 * slots: [nd, slots_stride] int64 cache slot of each position; lens: [nd] context length
 * (the new token included; its slot is slots[t, lens[t] - 1]). out: [nd, Hq * D].
 * Returns 0, or -1 when a row's scratch could not be allocated (nothing is written then). */
int tessera_decode_attention(int64_t nd, int64_t Hq, int64_t Hkv, int64_t D, const float *qkv,
                             int64_t qkv_stride, const float *cos, const float *sin, float *k_cache,
                             float *v_cache, const int64_t *slots, int64_t slots_stride,
                             const int64_t *lens, float scale, float *out) {
    const int64_t G = Hq / Hkv;
    int64_t lmax = 0;
    for (int64_t t = 0; t < nd; t++) lmax = lens[t] > lmax ? lens[t] : lmax;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        /* per thread: scores [G, lmax], rotated q [G, D], output accumulators [G, D] */
        float *scratch = malloc(sizeof(float) * (size_t)(G * lmax + 2 * G * D));
        if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < nd * Hkv; task++) {
            if (scratch == NULL) continue;
            const int64_t t = task / Hkv, h = task % Hkv, L = lens[t];
            const float *row = qkv + t * qkv_stride;
            const float *cs = cos + t * D, *sn = sin + t * D;
            float *scores = scratch, *q = scratch + G * lmax, *acc = q + G * D;
            /* the new token's k (rotated) and v into its cache slot, before it is read */
            const int64_t slot = slots[t * slots_stride + L - 1];
            float *kc = k_cache + (slot * Hkv + h) * D, *vc = v_cache + (slot * Hkv + h) * D;
            const float *k_new = row + (Hq + h) * D, *v_new = row + (Hq + Hkv + h) * D;
            for (int64_t d = 0; d < D; d++) kc[d] = k_new[d], vc[d] = v_new[d];
            rope(kc, cs, sn, D);
            for (int64_t g = 0; g < G; g++) {
                for (int64_t d = 0; d < D; d++) q[g * D + d] = row[(h * G + g) * D + d];
                rope(q + g * D, cs, sn, D);
            }
            /* scores, reading each cached key once for the G query heads that share it */
            float mx[G];
            for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                const float *kj = k_cache + (slots[t * slots_stride + j] * Hkv + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float s = dot(q + g * D, kj, D) * scale;
                    scores[g * lmax + j] = s;
                    mx[g] = s > mx[g] ? s : mx[g];
                }
            }
            float denom[G];
            for (int64_t g = 0; g < G; g++) {
                float z = 0.0f;
                for (int64_t j = 0; j < L; j++) {
                    const float e = expf(scores[g * lmax + j] - mx[g]);
                    scores[g * lmax + j] = e;
                    z += e;
                }
                denom[g] = z;
                for (int64_t d = 0; d < D; d++) acc[g * D + d] = 0.0f;
            }
            for (int64_t j = 0; j < L; j++) {
                const float *vj = v_cache + (slots[t * slots_stride + j] * Hkv + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[g * lmax + j];
                    float *a = acc + g * D;
                    for (int64_t d = 0; d < D; d++) a[d] += p * vj[d];
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + t * Hq * D + (h * G + g) * D;
                const float inv = 1.0f / denom[g];
                for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
