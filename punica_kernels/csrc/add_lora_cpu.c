/* The fused LoRA term of one layer on the CPU, for decode-shaped batches and chat-length prefill
 * runs (cpu_native.MAX_RUN tokens per adapter at most): for every token t with slot s = slots[t] >= 0 and every slice l,
 *     y[t, off[l] : off[l] + N[l]] += scales[s] * (x[t] @ A_l[s, :r].T) @ B_l[s, :, :r].T,  r = ranks[s].
 * x [T, K] and y [T, ldy] fp32; slots [T] and ranks [S] int32; A_l [S, R, K], B_l [S, N_l, R] all of one weight type
 * (wtype): fp32, bf16 (half the bytes to read, widened to fp32 in registers) or int8 (a quarter:
 * rows quantized symmetrically, A_l[s, j, :] = q * A_rs[l][s, j] and B_l[s, n, :] = q * B_rs[l][s, n],
 * row scales fp32 [S, R] and [S, N_l]; slot s's B in rank pairs, see b_at); all
 * contiguous. Accumulation in fp32.
 *
 * Why by hand: a decode step reads every distinct adapter's matrices once, a few KB to tens of
 * KB each, so the work is a stream of short dot products that torch can only express as padded
 * batched GEMMs plus gathers (bench/RESULTS.md). Here consecutive tokens on the same slot (the
 * engine orders decodes by slot) form a run whose weights are read once while they are hot in
 * L1, and the (run, slice) items are split between threads in contiguous shares of equal cost.
 * With many adapters a step is bound by reading their weights (a few hundred short blocks), so
 * each thread prefetches its coming items into L2 (pf_cursor_t). OpenMP: the process's libgomp
 * is torch's (loaded first, same soname), so both share one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 8 /* tokens of one run handled per pass over its weights (a run may take several) */

#include "tessera_lora_hooks.h" /* tessera_lora_hooks_t: the fused entries of the base kernels */
#include "tessera_simd.h"       /* tessera_sum16 / tessera_sum8, immintrin.h */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 }; /* the weight types (wtype) */

/* element i of w as fp32 (w fp32 or, with bf16 set, bf16) */
ALWAYS_INLINE float weight_at(const void *w, int64_t i, int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)w)[i];
}

#ifdef __AVX512F__
/* 16 weights from element i of w (fp32, or bf16 widened by a shift: bf16 is fp32's top half) */
ALWAYS_INLINE __m512 load_w(const void *w, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_loadu_ps((const float *)w + i);
}

ALWAYS_INLINE __m512 maskz_load_w(__mmask16 m, const void *w, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* v[j] = sc * x . a[j] for j < r (rows of a are K long); v[j] = 0 for r <= j < 16*ceil(r/16).
 * Rows are read one after the other (one linear stream through the slot's matrix, which the
 * hardware prefetcher follows), with four accumulators per row for the FMA latency. */
ALWAYS_INLINE void shrink_row(const float *x, const void *a, int64_t K, int64_t r, float sc, float *v, int bf16) {
    for (int64_t j0 = 0; j0 < r; j0 += 16) {
        __m512 acc[16];
        int64_t left = r - j0 < 16 ? r - j0 : 16;
        for (int k = 0; k < 16; k++) {
            if (k >= left) {
                acc[k] = _mm512_setzero_ps();
                continue;
            }
            const int64_t row = (j0 + k) * K; /* element offset of the row in a */
            __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
            int64_t c = 0;
            for (; c + 64 <= K; c += 64) {
                p0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), load_w(a, row + c, bf16), p0);
                p1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16), load_w(a, row + c + 16, bf16), p1);
                p2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 32), load_w(a, row + c + 32, bf16), p2);
                p3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 48), load_w(a, row + c + 48, bf16), p3);
            }
            for (; c + 16 <= K; c += 16) p0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), load_w(a, row + c, bf16), p0);
            if (c < K) {
                __mmask16 m = (__mmask16)((1u << (K - c)) - 1);
                p1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + c), maskz_load_w(m, a, row + c, bf16), p1);
            }
            acc[k] = _mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3));
        }
        _mm512_storeu_ps(v + j0, _mm512_mul_ps(tessera_sum16(acc), _mm512_set1_ps(sc)));
    }
}

/* y[n] += v . b[n, :r] for n < n_out (rows of b are R long; lanes past r are never read). */
ALWAYS_INLINE void expand_row(const float *v, const void *b, int64_t R, int64_t r, int64_t n_out, float *y, int bf16) {
    int64_t n = 0;
    for (; n + 16 <= n_out; n += 16) {
        __m512 acc[16];
        for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < r; j0 += 16) {
            __mmask16 m = (__mmask16)(r - j0 >= 16 ? 0xFFFF : (1u << (r - j0)) - 1);
            __m512 vv = _mm512_maskz_loadu_ps(m, v + j0);
            for (int k = 0; k < 16; k++)
                acc[k] = _mm512_fmadd_ps(vv, maskz_load_w(m, b, (n + k) * R + j0, bf16), acc[k]);
        }
        _mm512_storeu_ps(y + n, _mm512_add_ps(_mm512_loadu_ps(y + n), tessera_sum16(acc)));
    }
    for (; n < n_out; n++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < r; j++) acc += v[j] * weight_at(b, n * R + j, bf16);
        y[n] += acc;
    }
}
#elif defined(TESSERA_AVX2)
/* 8 weights from element i of w (fp32, or bf16 widened by a shift) */
ALWAYS_INLINE __m256 load_w(const void *w, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

/* the first n < 8 weights from element i of w, zeros in the other lanes (nothing past them is read) */
ALWAYS_INLINE __m256 load_w_part(const void *w, int64_t i, int64_t n, int bf16) {
    float buf[8] = {0};
    for (int64_t k = 0; k < n; k++) buf[k] = weight_at(w, i + k, bf16);
    return _mm256_loadu_ps(buf);
}

/* bf16 weights, 16 at a time in one load, widened without a shuffle: a 32-bit lane holds weights
 * 2i (low half) and 2i + 1 (high half), so a shift gives the even ones and a mask the odd ones
 * (one integer op per 8 weights instead of a widening shuffle plus a shift). The activations are
 * split the same way (evens_odds), once per 16 and shared by all the rows that use them. */
ALWAYS_INLINE __m256 bf16_evens(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
ALWAYS_INLINE __m256 bf16_odds(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* (e, o) = (v[0], v[2], ..., v[14]), (v[1], v[3], ..., v[15]) */
ALWAYS_INLINE void evens_odds(const float *v, __m256 *e, __m256 *o) {
    const __m256 lo = _mm256_loadu_ps(v), hi = _mm256_loadu_ps(v + 8);
    /* per 128-bit lane: (lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6), then 64-bit pairs reordered */
    const __m256 ev = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 od = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), _MM_SHUFFLE(3, 1, 2, 0)));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), _MM_SHUFFLE(3, 1, 2, 0)));
}

ALWAYS_INLINE __m256i load_bf16x16(const void *w, int64_t i) {
    return _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
}

/* As the AVX-512 shrink_row, 8 rows of a at a time: the 8 rows' dot products share each load of
 * x and are 8 independent FMA chains (AVX2 has 16 registers; 8 accumulators leave room for x and
 * the weights). v[j] = 0 for r <= j < 8*ceil(r/8). */
ALWAYS_INLINE void shrink_row(const float *x, const void *a, int64_t K, int64_t r, float sc, float *v, int bf16) {
    for (int64_t j0 = 0; j0 < r; j0 += 8) {
        const int64_t left = r - j0 < 8 ? r - j0 : 8;
        int64_t row[8]; /* rows past r repeat the block's first (read from L1, result dropped) */
        for (int k = 0; k < 8; k++) row[k] = (j0 + (k < left ? k : 0)) * K;
        __m256 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        int64_t c = 0;
        if (bf16) /* lanes hold even/odd partial sums: only their total matters */
            for (; c + 16 <= K; c += 16) {
                __m256 xe, xo;
                evens_odds(x + c, &xe, &xo);
                for (int k = 0; k < 8; k++) {
                    const __m256i w = load_bf16x16(a, row[k] + c);
                    acc[k] = _mm256_fmadd_ps(xo, bf16_odds(w), _mm256_fmadd_ps(xe, bf16_evens(w), acc[k]));
                }
            }
        for (; c + 8 <= K; c += 8) {
            const __m256 xv = _mm256_loadu_ps(x + c);
            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(xv, load_w(a, row[k] + c, bf16), acc[k]);
        }
        float out[8];
        _mm256_storeu_ps(out, _mm256_mul_ps(tessera_sum8(acc), _mm256_set1_ps(sc)));
        for (int k = 0; k < 8; k++) {
            float tail = 0.0f; /* K % 8 inputs */
            for (int64_t cc = c; cc < K; cc++) tail += x[cc] * weight_at(a, row[k] + cc, bf16);
            v[j0 + k] = k < left ? out[k] + sc * tail : 0.0f;
        }
    }
}

/* y[n] += v . b[n, :r] for n < n_out, 8 output rows at a time (lanes past r are never read). */
ALWAYS_INLINE void expand_row(const float *v, const void *b, int64_t R, int64_t r, int64_t n_out, float *y, int bf16) {
    const int64_t r16 = bf16 ? r / 16 * 16 : 0; /* ranks taken 16 at a time (bf16 even/odd) */
    __m256 ve[4], vo[4];                        /* r <= 64 */
    for (int64_t j0 = 0; j0 < r16; j0 += 16) evens_odds(v + j0, &ve[j0 / 16], &vo[j0 / 16]);
    int64_t n = 0;
    for (; n + 8 <= n_out; n += 8) {
        __m256 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        int64_t j0 = 0;
        for (; j0 < r16; j0 += 16)
            for (int k = 0; k < 8; k++) {
                const __m256i w = load_bf16x16(b, (n + k) * R + j0);
                acc[k] = _mm256_fmadd_ps(vo[j0 / 16], bf16_odds(w),
                                         _mm256_fmadd_ps(ve[j0 / 16], bf16_evens(w), acc[k]));
            }
        for (; j0 + 8 <= r; j0 += 8) {
            const __m256 vv = _mm256_loadu_ps(v + j0);
            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(vv, load_w(b, (n + k) * R + j0, bf16), acc[k]);
        }
        if (j0 < r) { /* v is zero past r (shrink_row) */
            const __m256 vv = _mm256_loadu_ps(v + j0);
            for (int k = 0; k < 8; k++)
                acc[k] = _mm256_fmadd_ps(vv, load_w_part(b, (n + k) * R + j0, r - j0, bf16), acc[k]);
        }
        _mm256_storeu_ps(y + n, _mm256_add_ps(_mm256_loadu_ps(y + n), tessera_sum8(acc)));
    }
    for (; n < n_out; n++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < r; j++) acc += v[j] * weight_at(b, n * R + j, bf16);
        y[n] += acc;
    }
}
#else
/* x . w[i : i + n] */
ALWAYS_INLINE float dot(const float *x, const void *w, int64_t i, int64_t n, int bf16) {
    float acc = 0.0f;
    for (int64_t k = 0; k < n; k++) acc += x[k] * weight_at(w, i + k, bf16);
    return acc;
}

ALWAYS_INLINE void shrink_row(const float *x, const void *a, int64_t K, int64_t r, float sc, float *v, int bf16) {
    for (int64_t j = 0; j < r; j++) v[j] = sc * dot(x, a, j * K, K, bf16);
}

ALWAYS_INLINE void expand_row(const float *v, const void *b, int64_t R, int64_t r, int64_t n_out, float *y, int bf16) {
    for (int64_t n = 0; n < n_out; n++) y[n] += dot(v, b, n * R, r, bf16);
}
#endif

/* int8 weights, applied a chunk of one slot's tokens at a time: for each token, v[j] = sc * a_rs[j]
 * * (x . a[j]) for j < r, then y[n] += b_rs[n] * (v . B[n, :r]), where the slot's B takes the first
 * N * r bytes of its [N, R] block (b_at): a slot then reads N * r bytes of B whatever the stack's
 * R, where [N, R] rows would pull in whole cache lines of padding (4x the bytes for rank 16 in a
 * rank-64 stack).
 *
 * With AVX2 the products run in integers: x (per token, in a pass before the work items) and v
 * (per token and slice) are rounded to int16 with one scale each (error at most 2^-16 of their
 * largest element), and vpmaddwd multiplies 16 of them by 16 sign-extended weights into 8 int32
 * pair sums: a third of the instructions of widening each weight to fp32 for an FMA (the compute
 * a many-adapter step's reads do not hide). The row scales and the two int16 scales are applied
 * to each row's sum. AVX-512BW builds take the 16-lane paths below where a block fills them
 * (bit-identical results). Without AVX2: fp32 on the dequantized weights. */

/* Where B[n, j] (output n of N, rank j of r) of a slot lies in its int8 B block: the ranks in
 * pairs (2p, 2p + 1), each pair a row of 2N bytes with output n's two weights side by side, and
 * an odd rank's last column a row of N bytes after them; N * r bytes in all
 * (punica_kernels.quantize.pack_int8_b). The expand multiplies a broadcast pair of v by 16 bytes
 * of a pair row, 8 outputs' sums in the lanes where they belong: no sums across lanes, and one
 * forward stream a pair. */
ALWAYS_INLINE int64_t b_at(int64_t N, int64_t r, int64_t n, int64_t j) {
    return j / 2 * 2 * N + ((r & 1) && j == r - 1 ? n : 2 * n + (j & 1));
}

/* How far a thread's prefetches run ahead of its reads, in bytes: the int8 items of a
 * many-adapter step are short blocks (a few KB to tens of KB), too short for the hardware
 * prefetcher to reach full speed on each, so each thread walks the bytes its coming items read
 * and asks for them into L2 this far ahead. */
#define PF_AHEAD 16384

/* A thread's prefetch cursor over its share of the work items, in order: each item's A
 * block, then its B block (the first r * K and r * N bytes of the slot's, all an int8 item reads).
 * An item whose run continues the previous run's slot is skipped (the same weights, read one run
 * before). */
typedef struct {
    const int64_t *runs;
    int64_t nslices, end, q, K, R;
    const int32_t *ranks;
    const void *const *A, *const *B;
    const int64_t *N;
    const char *p;
    int64_t left, debt;
    int seg;
} pf_cursor_t;

/* Move c to the next block to prefetch; 0 when the thread's items are done. */
static int pf_next_block(pf_cursor_t *c) {
    for (;;) {
        if (c->seg == 0) {
            c->seg = 1;
        } else {
            c->seg = 0;
            c->q++;
        }
        if (c->q >= c->end) return 0;
        const int64_t run = c->q / c->nslices, l = c->q % c->nslices, s = c->runs[3 * run + 2], r = c->ranks[s];
        if (r == 0 || (run > 0 && c->runs[3 * run - 1] == s)) {
            c->seg = 1; /* the item's B next time round: on to the next item */
            continue;
        }
        c->p = c->seg == 0 ? (const char *)c->A[l] + s * c->R * c->K : (const char *)c->B[l] + s * c->N[l] * c->R;
        c->left = r * (c->seg == 0 ? c->K : c->N[l]);
        return 1;
    }
}

/* The thread has read `bytes` more of its items: prefetch into L2 as far again ahead (c NULL: nothing). */
ALWAYS_INLINE void pf_advance(pf_cursor_t *c, int64_t bytes) {
    if (c == NULL) return;
    c->debt += bytes;
    while (c->debt >= 64) {
        if (c->left <= 0 && !pf_next_block(c)) {
            c->debt = 0;
            return;
        }
        /* the whole lines owed within this block (or the block's rest), in a tight loop;
         * prefetcht1: into L2 (into L1 the lines would evict what is in use) */
        const int64_t n = (c->debt < c->left ? c->debt : c->left + 63) / 64 * 64;
        const char *p = c->p, *const e = p + n;
        for (; p < e; p += 64) __builtin_prefetch(p, 0, 2);
        c->p = e, c->left -= n, c->debt -= n;
    }
}

#ifdef TESSERA_HAS_AVX2
/* q[i] = round(src[i] / scale) (|q| <= 32767) for i < n, zeros from n up to pad; returns scale
 * (0 when src is all zero: q is all zero then). AVX-512 builds take 16 values a step where they can
 * (the same maximum, roundings and saturation: the same bits). */
static float quantize_i16(const float *src, int64_t n, int64_t pad, int16_t *q) {
    int64_t i = 0;
    float mx = 0.0f;
    /* The maximum in four independent chains (a max's latency is several cycles; one chain would
     * wait on it every vector); a maximum is exact in any order. */
#ifdef __AVX512F__
    __m512 mw0 = _mm512_setzero_ps(), mw1 = mw0, mw2 = mw0, mw3 = mw0;
    for (; i + 64 <= n; i += 64) {
        mw0 = _mm512_max_ps(mw0, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
        mw1 = _mm512_max_ps(mw1, _mm512_abs_ps(_mm512_loadu_ps(src + i + 16)));
        mw2 = _mm512_max_ps(mw2, _mm512_abs_ps(_mm512_loadu_ps(src + i + 32)));
        mw3 = _mm512_max_ps(mw3, _mm512_abs_ps(_mm512_loadu_ps(src + i + 48)));
    }
    for (; i + 16 <= n; i += 16) mw0 = _mm512_max_ps(mw0, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
    mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mw0, mw1), _mm512_max_ps(mw2, mw3)));
#endif
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mv = _mm256_setzero_ps(), mv1 = mv, mv2 = mv, mv3 = mv;
    for (; i + 32 <= n; i += 32) {
        mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
        mv1 = _mm256_max_ps(mv1, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i + 8)));
        mv2 = _mm256_max_ps(mv2, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i + 16)));
        mv3 = _mm256_max_ps(mv3, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i + 24)));
    }
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
    const float m8 = tessera_hmax8(_mm256_max_ps(_mm256_max_ps(mv, mv1), _mm256_max_ps(mv2, mv3)));
    mx = m8 > mx ? m8 : mx;
    for (; i < n; i++) mx = fabsf(src[i]) > mx ? fabsf(src[i]) : mx;
    const float scale = mx / 32767.0f, inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
    i = 0;
#ifdef __AVX512F__
    const __m512 iw = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) /* vpmovsdw saturates as packs does */
        _mm256_storeu_si256((__m256i *)(q + i),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), iw))));
#endif
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 16 <= n; i += 16) { /* packs interleaves 128-bit lanes; the permute restores the order */
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i), iv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), iv));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
    for (; i < n; i++) q[i] = (int16_t)lrintf(src[i] * inv);
    for (; i < pad; i++) q[i] = 0;
    return scale;
}

/* Tokens of one run whose products share each load of the weights: as many as keep the
 * expand's accumulators and weights in registers (32 with AVX-512, 16 with AVX2). */
#ifdef __AVX512BW__
#define TOK_BLOCK 4
#else
#define TOK_BLOCK 2
#endif

/* 16 int8 weights from w, sign-extended to int16 */
ALWAYS_INLINE __m256i load_i8x16(const int8_t *w) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
}

/* r[k] = sum of the 8 int32 lanes of v[k] (as tessera_sum8) */
ALWAYS_INLINE __m256i sum8_epi32(const __m256i v[8]) {
    const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

#ifdef __AVX512BW__
/* AVX-512BW (VNNI where present): the shrink's integer products 32 at a time (the expand is the
 * 8-lane code's in every build). Integer sums are exact in any order and converted to fp32 at the
 * same points as in the 8-lane code, so both give bit-identical results. */
#ifdef __AVX512VNNI__
/* acc += a . b in place. GCC 12 compiles _mm512_dpwssd_epi32 on loop-carried accumulators with
 * two register copies around each product (it does not tie the result to the accumulator); the
 * asm names one register for both. b may be a memory operand. */
ALWAYS_INLINE __m512i dp16_vnni(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define TESSERA_DP16(acc, a, b) dp16_vnni((acc), (a), (b))
#else
#define TESSERA_DP16(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

/* 32 int8 weights from w, sign-extended to int16 */
ALWAYS_INLINE __m512i load_i8x32(const int8_t *w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
}

/* _mm512_shuffle_ps on int32 lanes */
#define TESSERA_SHUF_PS(a, b, imm) \
    _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), (imm)))

/* The last two levels of tessera_sum16 on int32 lanes, from u[0], u[1] whose 128-bit lane j
 * holds (a, a', b, b') partial sums of rows 8i + j (a) and 8i + 4 + j (b): lane r = row r's sum. */
ALWAYS_INLINE __m512i sum16_tail_epi32(const __m512i u[2]) {
    const __m512i t = _mm512_add_epi32(TESSERA_SHUF_PS(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       TESSERA_SHUF_PS(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(idx, t);
}

/* from w[0..3], whose 128-bit lane j holds 4 partial sums of row 4i + j: lane r = row r's sum */
ALWAYS_INLINE __m512i sum16_rows4_epi32(const __m512i w[4]) {
    __m512i u[2];
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_epi32(TESSERA_SHUF_PS(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                TESSERA_SHUF_PS(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return sum16_tail_epi32(u);
}

/* r[k] = sum of the 16 int32 lanes of v[k], k < 16 (tessera_sum16's tree) */
ALWAYS_INLINE __m512i sum16_epi32(const __m512i v[16]) {
    __m512i w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return sum16_rows4_epi32(x);
}

/* The shrink of up to TOK_BLOCK tokens of one run for a block of 16 rows of a (rows past r
 * contribute nothing, results dropped). The rows go in groups of 16 (one token: the inputs are
 * read once for the block), 8 (two tokens) or 4 (three or four), at most 16 accumulators, one per
 * row and token: each step loads the tokens' next 32 inputs once for all the group's rows and each
 * row's next 32 weights once for all the tokens, so a product costs far less than one load (the
 * bound of a row at a time, which reloads the inputs for every row). A group reads its rows side
 * by side, one forward stream each. */
ALWAYS_INLINE void shrink_i8_16(int nt, const int16_t *const *xq, const float *xs, const int8_t *a, const float *rs,
                                int64_t K, int64_t r, int64_t j0, float sc, float (*v)[64], pf_cursor_t *pf) {
    const int64_t K16 = K / 16 * 16, left = r - j0 < 16 ? r - j0 : 16;
    const int G = nt == 1 ? 16 : nt <= 2 ? 8 : 4; /* rows per group: G * nt <= 16 accumulators */
    const int8_t *row[16];
    for (int k = 0; k < 16; k++) row[k] = a + (j0 + (k < left ? k : 0)) * K; /* past r: row 0, dropped */
    float tot[TOK_BLOCK][16] = {{0}};
    for (int64_t c0 = 0; c0 < K16; c0 += 4096) {
        const int64_t c1 = c0 + 4096 < K16 ? c0 + 4096 : K16;
        __m512i acc[TOK_BLOCK][16];
        for (int g = 0; g < 16; g += G) {
            __m512i q[16][TOK_BLOCK];
            for (int k = 0; k < G; k++)
                for (int t = 0; t < nt; t++) q[k][t] = _mm512_setzero_si512();
            if (g < left) { /* a group with a row of a (past r there is none) */
                const int64_t step_bytes = 32 * (left - g < G ? left - g : G); /* the group's bytes a step */
                int64_t c = c0;
                for (; c + 32 <= c1; c += 32) {
                    pf_advance(pf, step_bytes);
                    __m512i xv[TOK_BLOCK];
                    for (int t = 0; t < nt; t++) xv[t] = _mm512_loadu_si512((const void *)(xq[t] + c));
                    for (int k = 0; k < G; k++) {
                        const __m512i w = load_i8x32(row[g + k] + c);
                        for (int t = 0; t < nt; t++) q[k][t] = TESSERA_DP16(q[k][t], xv[t], w);
                    }
                }
                if (c < c1) { /* 16 inputs left */
                    pf_advance(pf, step_bytes / 2);
                    __m512i xv[TOK_BLOCK];
                    for (int t = 0; t < nt; t++)
                        xv[t] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(xq[t] + c)));
                    for (int k = 0; k < G; k++) {
                        const __m512i w = _mm512_zextsi256_si512(load_i8x16(row[g + k] + c));
                        for (int t = 0; t < nt; t++) q[k][t] = TESSERA_DP16(q[k][t], xv[t], w);
                    }
                }
            }
            for (int k = 0; k < G; k++)
                for (int t = 0; t < nt; t++) acc[t][g + k] = q[k][t];
        }
        for (int t = 0; t < nt; t++) {
            float out[16];
            _mm512_storeu_ps(out, _mm512_cvtepi32_ps(sum16_epi32(acc[t])));
            for (int k = 0; k < 16; k++) tot[t][k] += out[k];
        }
    }
    for (int t = 0; t < nt; t++)
        for (int k = 0; k < left; k++) {
            int64_t tail = 0; /* K % 16 inputs */
            for (int64_t c = K16; c < K; c++) tail += (int64_t)xq[t][c] * row[k][c];
            v[t][j0 + k] = sc * rs[j0 + k] * xs[t] * (tot[t][k] + (float)tail);
        }
}

#endif

/* v[t][j] = sc * rs[j] * xs[t] * (xq[t] . a[j]) for j < r and the nt <= TOK_BLOCK tokens of a
 * block, in blocks of 8 rows read row after row (the slot's matrix as one forward stream), two
 * accumulators per row and token; each 16 weights are loaded and widened once for all the tokens.
 * The int32 sums are moved to fp32 every 4096 inputs: |pair sum| <= 2 * 127 * 32767, 256 of them
 * fit. */
ALWAYS_INLINE void shrink_i8(int nt, const int16_t *const *xq, const float *xs, const int8_t *a, const float *rs,
                             int64_t K, int64_t r, float sc, float (*v)[64], pf_cursor_t *pf) {
    const int64_t K16 = K / 16 * 16;
    for (int64_t j0 = 0; j0 < r; j0 += 8) {
#ifdef __AVX512BW__
        if (r - j0 > 8) { /* more than 8 rows left: 16 at a time */
            shrink_i8_16(nt, xq, xs, a, rs, K, r, j0, sc, v, pf);
            j0 += 8;
            continue;
        }
#endif
        const int64_t left = r - j0 < 8 ? r - j0 : 8;
        const int8_t *row[8]; /* rows past r: the block's first, for the tail loop (result dropped) */
        for (int k = 0; k < 8; k++) row[k] = a + (j0 + (k < left ? k : 0)) * K;
        float tot[TOK_BLOCK][8] = {{0}};
        for (int64_t c0 = 0; c0 < K16; c0 += 4096) {
            const int64_t c1 = c0 + 4096 < K16 ? c0 + 4096 : K16;
            __m256i acc[TOK_BLOCK][8];
            for (int k = 0; k < 8; k++) {
                __m256i p0[TOK_BLOCK], p1[TOK_BLOCK];
                for (int t = 0; t < nt; t++) p0[t] = p1[t] = _mm256_setzero_si256();
                if (k < left) { /* a row of a (past r there is none) */
                    pf_advance(pf, c1 - c0);
                    int64_t c = c0;
                    for (; c + 32 <= c1; c += 32) {
                        const __m256i w0 = load_i8x16(row[k] + c), w1 = load_i8x16(row[k] + c + 16);
                        for (int t = 0; t < nt; t++) {
                            p0[t] = _mm256_add_epi32(
                                p0[t], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xq[t] + c)), w0));
                            p1[t] = _mm256_add_epi32(
                                p1[t], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xq[t] + c + 16)), w1));
                        }
                    }
                    if (c < c1) {
                        const __m256i w0 = load_i8x16(row[k] + c);
                        for (int t = 0; t < nt; t++)
                            p0[t] = _mm256_add_epi32(
                                p0[t], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xq[t] + c)), w0));
                    }
                }
                for (int t = 0; t < nt; t++) acc[t][k] = _mm256_add_epi32(p0[t], p1[t]);
            }
            for (int t = 0; t < nt; t++) {
                float out[8];
                _mm256_storeu_ps(out, _mm256_cvtepi32_ps(sum8_epi32(acc[t])));
                for (int k = 0; k < 8; k++) tot[t][k] += out[k];
            }
        }
        for (int t = 0; t < nt; t++)
            for (int k = 0; k < left; k++) {
                int64_t tail = 0; /* K % 16 inputs */
                for (int64_t c = K16; c < K; c++) tail += (int64_t)xq[t][c] * row[k][c];
                v[t][j0 + k] = sc * rs[j0 + k] * xs[t] * (tot[t][k] + (float)tail);
            }
    }
}

#ifdef __AVX512BW__
/* expand_i8's AVX-512 blocks of 32 * W outputs (2W vectors of 16 a token, W <= 4) from output n
 * while a whole block fits; returns where it stopped. */
ALWAYS_INLINE int64_t expand_i8_512(int W, int nt, int64_t n, const int32_t (*pair)[32], const int16_t (*vq)[64],
                                    const float *vs, const int8_t *b, const float *rs, int64_t r, int64_t N,
                                    float *const *y, pf_cursor_t *pf) {
    const int64_t np = r / 2;
    const int odd = (int)(r & 1);
    const int8_t *last = b + np * 2 * N; /* odd r: the last column */
    for (; n + 32 * W <= N; n += 32 * W) { /* 2W x 32 bytes of each pair row */
        pf_advance(pf, 32 * W * r);
        __m512i acc[TOK_BLOCK][8];
        for (int t = 0; t < nt; t++)
            for (int i = 0; i < 2 * W; i++) acc[t][i] = _mm512_setzero_si512();
        for (int64_t p = 0; p < np; p++) {
            const int8_t *row = b + p * 2 * N + 2 * n;
            __m512i w[8];
            for (int i = 0; i < 2 * W; i++) w[i] = load_i8x32(row + 32 * i);
            for (int t = 0; t < nt; t++) {
                const __m512i vp = _mm512_set1_epi32(pair[t][p]);
                for (int i = 0; i < 2 * W; i++) acc[t][i] = TESSERA_DP16(acc[t][i], vp, w[i]);
            }
        }
        for (int i = 0; i < 2 * W; i++) {
            const __m512i l = odd ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(last + n + 16 * i)))
                                  : _mm512_setzero_si512();
            const __m512 rsv = _mm512_loadu_ps(rs + n + 16 * i);
            for (int t = 0; t < nt; t++) {
                if (!(vs[t] > 0.0f)) continue; /* an all-zero intermediate adds nothing */
                __m512i a = acc[t][i];
                if (odd) a = _mm512_add_epi32(a, _mm512_mullo_epi32(_mm512_set1_epi32(vq[t][r - 1]), l));
                const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(rsv, _mm512_set1_ps(vs[t])));
                _mm512_storeu_ps(y[t] + n + 16 * i, _mm512_add_ps(_mm512_loadu_ps(y[t] + n + 16 * i), s));
            }
        }
    }
    return n;
}
#endif

/* y[t][n] += rs[n] * vs[t] * (vq[t] . B[n, :r]) for n < N and the nt <= TOK_BLOCK tokens of a
 * block (layout: b_at). A broadcast pair (vq[t][2p], vq[t][2p + 1]) times a pair row's bytes is
 * one int32 sum per output in the lane where it belongs: no horizontal sums; each run of weights
 * is loaded and widened once for all the tokens. The integer sums are exact, so any order gives
 * the same bits; |sum| <= 64 * 127 * 32767: int32. */
ALWAYS_INLINE void expand_i8(int nt, const int16_t (*vq)[64], const float *vs, const int8_t *b, const float *rs,
                             int64_t r, int64_t N, float *const *y, pf_cursor_t *pf) {
    const int64_t np = r / 2;
    const int odd = (int)(r & 1);
    const int8_t *last = b + np * 2 * N; /* odd r: the last column */
    int32_t pair[TOK_BLOCK][32];
    for (int t = 0; t < nt; t++) memcpy(pair[t], vq[t], sizeof(int32_t) * (size_t)np);
    int64_t n = 0;
#ifdef __AVX512BW__
    /* One or two tokens: blocks of 64 outputs, so that 4 or 8 accumulators are in flight (with 32
     * a block each product would wait on the one before it), then 32 at a time. */
    n = expand_i8_512(nt <= 2 ? 2 : 1, nt, n, pair, vq, vs, b, rs, r, N, y, pf);
    n = expand_i8_512(1, nt, n, pair, vq, vs, b, rs, r, N, y, pf);
#else
    for (; n + 32 <= N; n += 32) { /* 32 outputs: 4 x 16 bytes of each pair row */
        pf_advance(pf, 32 * r);
        __m256i acc[TOK_BLOCK][4];
        for (int t = 0; t < nt; t++)
            for (int i = 0; i < 4; i++) acc[t][i] = _mm256_setzero_si256();
        for (int64_t p = 0; p < np; p++) {
            const int8_t *row = b + p * 2 * N + 2 * n;
            __m256i w[4];
            for (int i = 0; i < 4; i++) w[i] = load_i8x16(row + 16 * i);
            for (int t = 0; t < nt; t++) {
                const __m256i vp = _mm256_set1_epi32(pair[t][p]);
                for (int i = 0; i < 4; i++) acc[t][i] = _mm256_add_epi32(acc[t][i], _mm256_madd_epi16(vp, w[i]));
            }
        }
        for (int i = 0; i < 4; i++) {
            const __m256i l = odd ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(last + n + 8 * i)))
                                  : _mm256_setzero_si256();
            const __m256 rsv = _mm256_loadu_ps(rs + n + 8 * i);
            for (int t = 0; t < nt; t++) {
                if (!(vs[t] > 0.0f)) continue;
                __m256i a = acc[t][i];
                if (odd) a = _mm256_add_epi32(a, _mm256_mullo_epi32(_mm256_set1_epi32(vq[t][r - 1]), l));
                const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(rsv, _mm256_set1_ps(vs[t])));
                _mm256_storeu_ps(y[t] + n + 8 * i, _mm256_add_ps(_mm256_loadu_ps(y[t] + n + 8 * i), s));
            }
        }
    }
#endif
    for (; n + 8 <= N; n += 8) {
        pf_advance(pf, 8 * r);
        const __m256i l =
            odd ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(last + n))) : _mm256_setzero_si256();
        const __m256 rsv = _mm256_loadu_ps(rs + n);
        for (int t = 0; t < nt; t++) {
            if (!(vs[t] > 0.0f)) continue;
            __m256i acc = _mm256_setzero_si256();
            for (int64_t p = 0; p < np; p++)
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(pair[t][p]),
                                                              load_i8x16(b + p * 2 * N + 2 * n)));
            if (odd) acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_set1_epi32(vq[t][r - 1]), l));
            const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(rsv, _mm256_set1_ps(vs[t])));
            _mm256_storeu_ps(y[t] + n, _mm256_add_ps(_mm256_loadu_ps(y[t] + n), s));
        }
    }
    for (; n < N; n++)
        for (int t = 0; t < nt; t++) {
            if (!(vs[t] > 0.0f)) continue;
            int32_t acc = 0;
            for (int64_t j = 0; j < r; j++) acc += (int32_t)vq[t][j] * b[b_at(N, r, n, j)];
            y[t][n] += rs[n] * vs[t] * (float)acc;
        }
}

/* One block of nt <= TOK_BLOCK tokens of a run, tokens i0.. (nt a constant where inlined: the loops
 * over the tokens unroll and their accumulators stay in registers); xq, xs: the block's int16 x
 * rows and their scales. */
ALWAYS_INLINE void lora_block_i8(int nt, int64_t i0, const int16_t *xq, const float *xs, int64_t K, const int8_t *a,
                                 const float *a_rs, const int8_t *b, const float *b_rs, int64_t r, float sc,
                                 int64_t n_out, float *y, int64_t ldy, pf_cursor_t *pf) {
    const int16_t *xrow[TOK_BLOCK];
    float v[TOK_BLOCK][64], vs[TOK_BLOCK];
    int16_t vq[TOK_BLOCK][64];
    float *yrow[TOK_BLOCK];
    int any = 0;
    for (int t = 0; t < nt; t++) xrow[t] = xq + t * K, yrow[t] = y + (i0 + t) * ldy;
    shrink_i8(nt, xrow, xs, a, a_rs, K, r, sc, v, pf);
    for (int t = 0; t < nt; t++) any |= (vs[t] = quantize_i16(v[t], r, r, vq[t])) > 0.0f;
    if (any)
        expand_i8(nt, (const int16_t(*)[64])vq, vs, b, b_rs, r, n_out, yrow, pf);
    else
        pf_advance(pf, r * n_out);
}

/* The tokens [t0, t0 + n_tok) of one run, TOK_BLOCK at a time (xq, xs: the run's int16 x rows and
 * their scales); the prefetch cursor advances over the first block only (the later ones read the
 * same weights, now in cache). One-token blocks (a decode step's items, most of a many-adapter
 * step's work) take the common ranks 8, 16 and 32 as constants: the loops over rank pairs unroll
 * and the expand keeps the broadcast intermediate in registers across its outputs; other ranks
 * take the same code with r at run time (the same bits either way). */
ALWAYS_INLINE void lora_run_i8(int64_t t0, int64_t n_tok, const float *x, const int16_t *xq, const float *xs,
                               int64_t K, const int8_t *a, const float *a_rs, const int8_t *b, const float *b_rs,
                               int64_t r, float sc, int64_t n_out, float *y, int64_t ldy, pf_cursor_t *pf) {
    (void)x;
    for (int64_t i = t0; i < t0 + n_tok; i += TOK_BLOCK) {
        const int64_t nt = t0 + n_tok - i < TOK_BLOCK ? t0 + n_tok - i : TOK_BLOCK;
        pf_cursor_t *c = i == t0 ? pf : NULL;
        if (nt == 1 && r == 16)
            lora_block_i8(1, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, 16, sc, n_out, y, ldy, c);
        else if (nt == 1 && r == 8)
            lora_block_i8(1, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, 8, sc, n_out, y, ldy, c);
        else if (nt == 1 && r == 32)
            lora_block_i8(1, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, 32, sc, n_out, y, ldy, c);
        else if (nt == 1)
            lora_block_i8(1, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, r, sc, n_out, y, ldy, c);
        else if (nt == 2)
            lora_block_i8(2, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, r, sc, n_out, y, ldy, c);
        else if (nt == 3)
            lora_block_i8(3, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, r, sc, n_out, y, ldy, c);
        else
            lora_block_i8(TOK_BLOCK, i, xq + (i - t0) * K, xs + (i - t0), K, a, a_rs, b, b_rs, r, sc, n_out, y, ldy, c);
    }
}
#else
ALWAYS_INLINE void lora_run_i8(int64_t t0, int64_t n_tok, const float *x, const int16_t *xq, const float *xs,
                               int64_t K, const int8_t *a, const float *a_rs, const int8_t *b, const float *b_rs,
                               int64_t r, float sc, int64_t n_out, float *y, int64_t ldy, pf_cursor_t *pf) {
    (void)xq, (void)xs, (void)pf;
    float v[64];
    for (int64_t i = t0; i < t0 + n_tok; i++) {
        for (int64_t j = 0; j < r; j++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < K; c++) acc += x[i * K + c] * (float)a[j * K + c];
            v[j] = sc * a_rs[j] * acc;
        }
        for (int64_t n = 0; n < n_out; n++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < r; j++) acc += v[j] * (float)b[b_at(n_out, r, n, j)];
            y[i * ldy + n] += b_rs[n] * acc;
        }
    }
}
#endif

/* One layer's stacks, what every call on them shares (built once per stack by cpu_native, so a
 * call passes six arguments instead of seventeen: ctypes converts each one on every call). Field
 * order and types match cpu_native.StackArgs. A_rs and B_rs (per-slice row scales) are read for
 * int8 only. */
typedef struct {
    int64_t K, R, nslices, wtype;
    const float *scales;
    const void *const *A, *const *B;
    const int64_t *N, *off;
    const float *const *A_rs, *const *B_rs;
} lora_stack_t;

/* What one call's threads share: the stack, the activations and the call's run list. */
typedef struct {
    const lora_stack_t *st;
    int64_t T, ldy, nruns, work;
    const float *x;
    float *y;
    const int32_t *ranks;
    const int64_t *runs, *cum; /* (start, end, slot) per run; cum[p]: the cost of the items before p */
    int16_t *xq;               /* int8 weights with AVX2: the x rows as int16 and their scales */
    float *xs;
    int16_t *pq;               /* and per thread (npriv of them) room for one run's rows and scales */
    float *ps;
    int64_t npriv;
} lora_call_t;

/* Thread tid of nth's part of a call (nth <= c->npriv): one contiguous share of the (run, slice)
 * items, those whose cost midpoint falls in its part of the total. The items are run-major (a
 * run's slices one after the other: its x rows stay in L1 across them, and a slot's weights are
 * read in slot order). With int8 weights a thread rounds the x rows of each run it meets to
 * int16 itself, into the call's rows where it holds the run's first item, else (a run begun in
 * the share before) into its own room: no thread waits for another's rows, and none reads rows
 * another core wrote. A thread knows its coming items, so it prefetches them (pf_cursor_t; int8
 * items, the engine's storage). */
static void lora_call_part(const lora_call_t *c, int64_t tid, int64_t nth) {
    const lora_stack_t *st = c->st;
    const int64_t K = st->K, R = st->R, wtype = st->wtype, nslices = st->nslices, work = c->work;
    const int64_t *N = st->N, *off = st->off, *runs = c->runs, *cum = c->cum;
    const int32_t *ranks = c->ranks;
    const void *const *A = st->A, *const *B = st->B;
    const int64_t es = wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1; /* bytes per weight */
    int64_t lo = 0;
    while (lo < work && (cum[lo] + cum[lo + 1]) * nth < 2 * cum[work] * tid) lo++;
    int64_t hi = lo;
    while (hi < work && (cum[hi] + cum[hi + 1]) * nth < 2 * cum[work] * (tid + 1)) hi++;
    pf_cursor_t pfc = {runs, nslices, hi, lo - 1, K, R, ranks, A, B, N, NULL, 0, 0, 1};
    pf_cursor_t *pf = wtype == W_I8 ? &pfc : NULL;
    pf_advance(pf, PF_AHEAD);
    int16_t *xq_run = NULL; /* int8 with AVX2: the current run's int16 x rows and their scales */
    float *xs_run = NULL;
#ifdef TESSERA_HAS_AVX2
    int64_t rounded = -1; /* the run they are of */
#endif
    for (int64_t p = lo; p < hi; p++) {
        const int64_t *run = runs + 3 * (p / nslices);
        const int64_t l = p % nslices, t0 = run[0], n_tok = run[1] - run[0], s = run[2];
        const int64_t r = ranks[s], n_out = N[l];
        const float sc = st->scales[s];
        if (r == 0) continue;
        float v[CHUNK][64];
        const void *a = (const char *)A[l] + s * R * K * es;
        const void *b = (const char *)B[l] + s * n_out * R * es;
        float *yl = c->y + off[l];
        const float *x = c->x;
        const int64_t ldy = c->ldy;
        /* The run's tokens (at most CHUNK) read the slot's weights in turn (int8: TOK_BLOCK tokens
         * a pass), hot in L1/L2 after the first. One call site per weight type so each is
         * compiled for it. */
        if (wtype == W_I8) {
#ifdef TESSERA_HAS_AVX2
            if (p / nslices != rounded) {
                rounded = p / nslices;
                const int own = p % nslices == 0; /* else the run's first item is in an earlier share */
                xq_run = own ? c->xq + t0 * K : c->pq + tid * CHUNK * K;
                xs_run = own ? c->xs + t0 : c->ps + tid * CHUNK;
                for (int64_t i = 0; i < n_tok; i++) xs_run[i] = quantize_i16(x + (t0 + i) * K, K, K, xq_run + i * K);
            }
#endif
            lora_run_i8(t0, n_tok, x, xq_run, xs_run, K, a, st->A_rs[l] + s * R, b, st->B_rs[l] + s * n_out, r, sc,
                        n_out, yl, ldy, pf);
        } else if (wtype == W_BF16) {
            for (int64_t i = 0; i < n_tok; i++) shrink_row(x + (t0 + i) * K, a, K, r, sc, v[i], 1);
            for (int64_t i = 0; i < n_tok; i++) expand_row(v[i], b, R, r, n_out, yl + (t0 + i) * ldy, 1);
        } else {
            for (int64_t i = 0; i < n_tok; i++) shrink_row(x + (t0 + i) * K, a, K, r, sc, v[i], 0);
            for (int64_t i = 0; i < n_tok; i++) expand_row(v[i], b, R, r, n_out, yl + (t0 + i) * ldy, 0);
        }
    }
}

/* One step's tokens as all its calls share them (cpu_native.StepCall binds one a step): the token
 * slots, their runs (consecutive tokens of one slot, at most CHUNK each) and the scratch a call
 * needs (its items' costs; int8: the x rows as int16), kept for the step's later calls. A call in
 * a decode step comes right after a base matmul has streamed megabytes through L2, so what it
 * touches is mostly misses: built once, the run list and the scratch cost a call no allocation
 * and no pass over the slots but the rank check. */
typedef struct {
    int64_t T, nruns;
    const int32_t *slots;
    int64_t *runs; /* (start, end, slot) per run */
    char *scratch;
    size_t cap;
    lora_call_t call; /* the call a base kernel's fused entry prepared (tessera_lora_hooks) */
} lora_step_t;

/* The step of T tokens on `slots` (read by every call: it must outlive the step), or NULL without
 * memory. */
lora_step_t *tessera_lora_step_new(int64_t T, const int32_t *slots) {
    lora_step_t *sp = calloc(1, sizeof(lora_step_t));
    if (sp == NULL) return NULL;
    sp->runs = malloc(sizeof(int64_t) * 3 * (size_t)(2 * T + 1)); /* <= ceil(T / CHUNK) + slot changes */
    if (sp->runs == NULL) {
        free(sp);
        return NULL;
    }
    sp->T = T, sp->slots = slots;
    for (int64_t t = 0; t < T;) {
        const int32_t s = slots[t];
        int64_t e = t + 1;
        while (e < T && slots[e] == s) e++;
        if (s >= 0)
            for (int64_t c = t; c < e; c += CHUNK) {
                sp->runs[3 * sp->nruns] = c;
                sp->runs[3 * sp->nruns + 1] = c + CHUNK < e ? c + CHUNK : e;
                sp->runs[3 * sp->nruns + 2] = s;
                sp->nruns++;
            }
        t = e;
    }
    return sp;
}

void tessera_lora_step_free(lora_step_t *sp) {
    if (sp == NULL) return;
    free(sp->scratch);
    free(sp->runs);
    free(sp);
}

/* Lays out the call y += the LoRA term of x on stack st for the step's tokens (x [T, K], y rows ldy
 * apart) in *call, its items' costs and its int16 rows in the step's scratch. Returns 0, -1 if a
 * rank is outside [0, R] or wtype is unknown, or -2 without memory for the scratch (nothing is
 * written then). */
static int lora_prepare(const lora_stack_t *st, lora_step_t *sp, int64_t ldy, const float *x, float *y,
                        const int32_t *ranks, lora_call_t *call) {
    const int64_t K = st->K, R = st->R, nslices = st->nslices, wtype = st->wtype, T = sp->T, nruns = sp->nruns;
    const int64_t *N = st->N, *runs = sp->runs;
    const int32_t *slots = sp->slots;
    if (R > 64 || wtype < W_F32 || wtype > W_I8) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0 && (ranks[slots[t]] < 0 || ranks[slots[t]] > R)) return -1;
    /* The scratch: the items' cumulative costs and (int8 with AVX2) the int16 x rows and their
     * scales, then a run's rows and scales for each thread a region may have (lora_call_part),
     * grown to the step's largest call. */
    const int64_t tq = wtype == W_I8 ? T : 0, npriv = wtype == W_I8 ? omp_get_max_threads() : 0;
    const size_t n_cum = (sizeof(int64_t) * (size_t)(nruns * nslices + 1) + 63) / 64 * 64;
    const size_t n_xq = (sizeof(int16_t) * (size_t)(tq * K) + 63) / 64 * 64;
    const size_t n_xs = (sizeof(float) * (size_t)tq + 63) / 64 * 64;
    const size_t n_pq = (sizeof(int16_t) * (size_t)(npriv * CHUNK * K) + 63) / 64 * 64;
    const size_t need = n_cum + n_xq + n_xs + n_pq + sizeof(float) * (size_t)(npriv * CHUNK + 1);
    if (need > sp->cap) {
        char *mem = malloc(need);
        if (mem == NULL) return -2;
        free(sp->scratch);
        sp->scratch = mem, sp->cap = need;
    }
    int64_t *cum = (int64_t *)sp->scratch;
    /* Items run-major (p = run * nslices + l); an item's cost: the bytes it reads per token, times
     * its tokens plus one (its weights' first read). A call none of whose runs' slots has a rank
     * here (an adapter without this layer's modules, e.g. attention-only) has no work: nothing to
     * round or share. */
    int64_t work = nruns * nslices, ranked = 0;
    cum[0] = 0;
    for (int64_t p = 0; p < work; p++) {
        const int64_t *run = runs + 3 * (p / nslices);
        ranked |= ranks[run[2]];
        cum[p + 1] = cum[p] + ranks[run[2]] * (K + N[p % nslices]) * (run[1] - run[0] + 1) + 1;
    }
    if (ranked == 0) work = 0;
    char *const q = sp->scratch + n_cum;
    const lora_call_t c = {st, T, ldy, nruns, work, x, y, ranks, runs, cum, (int16_t *)q, (float *)(q + n_xq),
                           (int16_t *)(q + n_xq + n_xs), (float *)(q + n_xq + n_xs + n_pq), npriv};
    *call = c;
    return 0;
}

/* One token's items stay on the calling thread (a few microseconds each, about what waking the
 * other threads costs); from two tokens up the threads share them (bench/RESULTS.md, session 28:
 * in the engine, steps of 2, 4 and 8 streams spent less in these calls). */
static int lora_one_thread(const lora_call_t *c) { return c->work <= 1 || c->T < 2; }

/* y += the LoRA term of x on stack st for the step's tokens (x [T, K], y rows ldy apart). Returns
 * as lora_prepare (nothing is written on an error). */
int tessera_lora_step_call(const lora_stack_t *st, lora_step_t *sp, int64_t ldy, const float *x, float *y,
                           const int32_t *ranks) {
    lora_call_t call;
    const int rc = lora_prepare(st, sp, ldy, x, y, ranks, &call);
    if (rc != 0) return rc;
    if (!lora_one_thread(&call)) {
#pragma omp parallel
        lora_call_part(&call, omp_get_thread_num(), omp_get_num_threads());
    } else if (call.work > 0) {
        lora_call_part(&call, 0, 1);
    }
    return 0;
}

/* -- the hooks of the base kernels' fused entries (tessera_lora_hooks.h) ------------------------ */

/* Inside a base kernel's region the threads are already awake, so a call's items are shared from
 * two items up whatever its token count (a one-token call's q, k and v slices, its gate and up),
 * where a call on its own keeps one token's items on the calling thread (lora_one_thread). */
static int hook_prepare(const void *stack, void *step, int64_t ldy, const float *x, float *y, const int32_t *ranks,
                        void **call, int *one) {
    lora_step_t *sp = step;
    const int rc = lora_prepare(stack, sp, ldy, x, y, ranks, &sp->call);
    *call = rc == 0 && sp->call.work > 0 ? &sp->call : NULL;
    *one = *call == NULL || sp->call.work <= 1;
    return rc;
}

static void hook_part(void *call, int64_t share, int64_t shares) { lora_call_part(call, share, shares); }

const tessera_lora_hooks_t tessera_lora_hooks = {hook_prepare, hook_part};

/* One call on its own (a step of one call): as tessera_lora_step_call; -2 also without memory for
 * the run list. */
int tessera_add_lora_f32(const lora_stack_t *st, int64_t T, int64_t ldy, const float *x, float *y,
                         const int32_t *slots, const int32_t *ranks) {
    lora_step_t *sp = tessera_lora_step_new(T, slots);
    if (sp == NULL) return -2;
    const int rc = tessera_lora_step_call(st, sp, ldy, x, y, ranks);
    tessera_lora_step_free(sp);
    return rc;
}
