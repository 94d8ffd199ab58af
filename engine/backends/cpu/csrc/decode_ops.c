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
 * Why by hand: a SmolLM2 decode step is 30 layers of tiny tensors, where torch's per-op dispatch
 * on dozens of ops a layer costs more than their arithmetic, plus gathers that copy every cached
 * K/V row before SDPA reads it (bench/RESULTS.md has the breakdown). Everything is fp32,
 * accumulated in fp32, in the same order for a row whatever else is in the batch (so a
 * sequence's output does not depend on its batch). Rows and (token, KV head) pairs are shared
 * between torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "tessera_simd.h" /* tessera_sum16 / tessera_sum8, immintrin.h */

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
#elif defined(TESSERA_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    s = tessera_hsum8(_mm256_add_ps(a0, a1));
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
#elif defined(TESSERA_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    s = tessera_hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#ifdef __AVX512F__
/* exp(x) of 16 lanes: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r (Cephes' expf
 * coefficients, ~2 ulp), scaled by 2^n. Inputs are clamped to expf's finite range. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif defined(TESSERA_AVX2)
/* exp16's method on 8 lanes; 2^n is built in the exponent field (n is within [-126, 127] after
 * the clamp, so it is a normal number). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

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
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, den), _mm512_loadu_ps(u + i)));
        }
#elif defined(TESSERA_AVX2)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Cache rows ahead of the one being read. Decode attention reads each sequence's rows from blocks
 * anywhere in a cache far larger than the CPU caches, and the hardware prefetcher cannot guess
 * those jumps: without this a wide decode step waits on memory longer than it computes. */
#define PREFETCH_ROWS 16

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(row + i, 0, 3);
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

/* s[g * ld + j] = scale * q[g] . K[j] for the G query heads q [G, D] sharing one KV head, over
 * the L cached keys at rows k_cache + (tslots[j] * Hkv + h) * D; s is [G, ld], ld >= L rounded up
 * to 16. Each key is read once for all G heads; the matching value rows (v_cache) are prefetched. */
static void head_scores(const float *q, int64_t G, const float *k_cache, const float *v_cache,
                        const int64_t *tslots, int64_t L,
                        int64_t Hkv, int64_t h, int64_t D, float scale, float *s, int64_t ld) {
    int64_t j0 = 0;
#ifdef __AVX512F__
    if (D % 16 == 0) {
        /* 16 keys at a time: 16 dot products as 16 accumulators, summed by one transpose-and-add */
        for (; j0 < L; j0 += 16) {
            const int64_t nk = L - j0 < 16 ? L - j0 : 16;
            const float *kr[16];
            for (int r = 0; r < 16; r++) kr[r] = k_cache + (tslots[j0 + (r < nk ? r : 0)] * Hkv + h) * D;
            /* the next keys' rows, wherever their blocks are, and these keys' values (read after
             * the softmax) */
            for (int64_t r = j0 + 16; r < L && r < j0 + 32; r++) prefetch_row(k_cache + (tslots[r] * Hkv + h) * D, D);
            for (int64_t r = j0; r < j0 + nk; r++) prefetch_row(v_cache + (tslots[r] * Hkv + h) * D, D);
            for (int64_t g = 0; g < G; g++) {
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 16) {
                    const __m512 qv = _mm512_loadu_ps(q + g * D + c);
                    for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[r] + c), acc[r]);
                }
                _mm512_storeu_ps(s + g * ld + j0, _mm512_mul_ps(tessera_sum16(acc), _mm512_set1_ps(scale)));
            }
        }
        return;
    }
#elif defined(TESSERA_AVX2)
    if (D % 8 == 0) {
        /* 8 keys at a time in 8 accumulators, summed by one transpose-and-add */
        for (; j0 + 8 <= L; j0 += 8) {
            const float *kr[8];
            for (int r = 0; r < 8; r++) kr[r] = k_cache + (tslots[j0 + r] * Hkv + h) * D;
            for (int64_t r = j0 + 8; r < L && r < j0 + 16; r++) prefetch_row(k_cache + (tslots[r] * Hkv + h) * D, D);
            for (int64_t r = j0; r < j0 + 8; r++) prefetch_row(v_cache + (tslots[r] * Hkv + h) * D, D);
            for (int64_t g = 0; g < G; g++) {
                __m256 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8) {
                    const __m256 qv = _mm256_loadu_ps(q + g * D + c);
                    for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[r] + c), acc[r]);
                }
                _mm256_storeu_ps(s + g * ld + j0, _mm256_mul_ps(tessera_sum8(acc), _mm256_set1_ps(scale)));
            }
        }
        /* the last L % 8 keys below, one at a time */
    }
#endif
    (void)v_cache; /* prefetched on the vector paths only */
    for (int64_t j = j0; j < L; j++) {
        const float *kj = k_cache + (tslots[j] * Hkv + h) * D;
        for (int64_t g = 0; g < G; g++) s[g * ld + j] = dot(q + g * D, kj, D) * scale;
    }
}

/* acc[g] = sum_j p[g * ld + j] * V[j] for the G heads over the L cached values at rows
 * v_cache + (tslots[j] * Hkv + h) * D; acc is [G, D]. (head_scores prefetched these rows.) */
static void head_values(const float *p, int64_t ld, int64_t G, const float *v_cache, const int64_t *tslots,
                        int64_t L, int64_t Hkv, int64_t h, int64_t D, float *acc) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        /* one 16-wide slice of the output at a time, in 4 register accumulators (keys j..j+3) so
         * the FMAs do not wait on each other */
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < D; c += 16) {
                const float *pg = p + g * ld;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int64_t j = 0;
#define V_ROW(jj) _mm512_loadu_ps(v_cache + (tslots[jj] * Hkv + h) * D + c)
                for (; j + 4 <= L; j += 4) {
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j]), V_ROW(j), a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j + 1]), V_ROW(j + 1), a1);
                    a2 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j + 2]), V_ROW(j + 2), a2);
                    a3 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j + 3]), V_ROW(j + 3), a3);
                }
                for (; j < L; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j]), V_ROW(j), a0);
#undef V_ROW
                _mm512_storeu_ps(acc + g * D + c, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            }
        return;
    }
#elif defined(TESSERA_AVX2)
    if (D % 8 == 0) {
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < D; c += 8) {
                const float *pg = p + g * ld;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int64_t j = 0;
#define V_ROW(jj) _mm256_loadu_ps(v_cache + (tslots[jj] * Hkv + h) * D + c)
                for (; j + 4 <= L; j += 4) {
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), V_ROW(j), a0);
                    a1 = _mm256_fmadd_ps(_mm256_set1_ps(pg[j + 1]), V_ROW(j + 1), a1);
                    a2 = _mm256_fmadd_ps(_mm256_set1_ps(pg[j + 2]), V_ROW(j + 2), a2);
                    a3 = _mm256_fmadd_ps(_mm256_set1_ps(pg[j + 3]), V_ROW(j + 3), a3);
                }
                for (; j < L; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), V_ROW(j), a0);
#undef V_ROW
                _mm256_storeu_ps(acc + g * D + c, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            }
        return;
    }
#endif
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < L; j++) {
        const float *vj = v_cache + (tslots[j] * Hkv + h) * D;
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += p[g * ld + j] * vj[d];
    }
}

/* s[0:L] <- exp(s - max(s)) (entries past L may hold anything and are left undefined); returns
 * the sum of the L exponentials. */
static float softmax_numerators(float *s, int64_t L) {
    float mx = -INFINITY, z = 0.0f;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= L; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    mx = _mm512_reduce_max_ps(mv);
#elif defined(TESSERA_AVX2)
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= L; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    mx = tessera_hmax8(mv);
#endif
    for (; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    j = 0;
#ifdef __AVX512F__
    __m512 zv = _mm512_setzero_ps();
    const __m512 mxv = _mm512_set1_ps(mx);
    for (; j + 16 <= L; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mxv));
        _mm512_storeu_ps(s + j, e);
        zv = _mm512_add_ps(zv, e);
    }
    z = _mm512_reduce_add_ps(zv);
#elif defined(TESSERA_AVX2)
    __m256 zv = _mm256_setzero_ps();
    const __m256 mxv = _mm256_set1_ps(mx);
    for (; j + 8 <= L; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
        _mm256_storeu_ps(s + j, e);
        zv = _mm256_add_ps(zv, e);
    }
    z = tessera_hsum8(zv);
#endif
    for (; j < L; j++) {
        s[j] = expf(s[j] - mx);
        z += s[j];
    }
    return z;
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
    lmax = (lmax + 15) / 16 * 16; /* head_scores writes whole blocks of 16 keys */
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
            const int64_t *tslots = slots + t * slots_stride;
            head_scores(q, G, k_cache, v_cache, tslots, L, Hkv, h, D, scale, scores, lmax);
            float denom[G];
            for (int64_t g = 0; g < G; g++) denom[g] = softmax_numerators(scores + g * lmax, L);
            head_values(scores, lmax, G, v_cache, tslots, L, Hkv, h, D, acc);
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
