/* Weight-only int8 linear for wide decode batches (tens of rows) on CPUs with AMX:
 *     y[m, n] = scales[n] * sum_k bf16(x[m, k]) * w[n, k]
 * x [M, K] fp32 (rounded to bf16, as the bf16 dense path rounds it), scales [N] fp32, y [M, N]
 * fp32; w int8 in AMX's pair-interleaved tile layout [N/16][K/32][16 pairs][16 n][2]
 * (engine.model.cpu_int8.tile_weight), N a multiple of 16 and K of 32.
 *
 * Why by hand: a 32-row decode step on the bf16 dense copy is bound by reading 2 bytes a weight,
 * and oneDNN's AMX GEMM streams them well below memory speed. This kernel reads the int8
 * weights (1 byte each), widens each 16 x 32 tile to bf16 in registers (int8 values are exact in
 * bf16) and multiplies it on the tile unit with fp32 accumulation, then applies the per-channel
 * scale: the exact product of the quantized weights, in half the bytes. The weight stream is
 * prefetched ahead as in int8_linear.c. Output column blocks are shared between torch's OpenMP
 * threads; each configures its own tiles.
 *
 * tessera_int8_linear_amx_lora adds a LoRA term to the product in the same call and parallel region
 * (punica_kernels/csrc/tessera_lora_hooks.h).
 *
 * tessera_amx_init() asks Linux for the AMX tile state (once per process) and answers 0 when
 * the kernel may run; without AMX (compiled for another CPU, or refused) it answers -1 and
 * tessera_int8_linear_amx is never called.
 */
#include <stdint.h>
#include <string.h>

#include "tessera_lora_hooks.h" /* the fused entry's LoRA term (punica_kernels/csrc/add_lora_cpu.c) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PREFETCH_BYTES 16384
#define MAX_ROWS 64 /* 4 accumulator tiles of 16 rows; wider calls loop over 64-row chunks */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int tessera_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-3 C (16 x 16 fp32), 4 B, 5 A */
    _tile_loadconfig(&cfg);
}

/* 512 int8 (one tile, already pair-interleaved) -> 512 bf16 */
static inline void widen_tile(const int8_t *src, uint16_t *dst) {
    for (int i = 0; i < 512; i += 32) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(src + i));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
        _mm512_storeu_si512((void *)(dst + i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* x's rows as bf16 (round to nearest even, as torch's .to(bfloat16)) into xb; rows M..MP-1 zero */
static void x_to_bf16(int64_t M, int64_t MP, int64_t K, const float *x, uint16_t *xb) {
    for (int64_t m = 0; m < MP; m++)
        for (int64_t k = 0; k < K; k += 32) {
            __m512 a = _mm512_setzero_ps(), b = a;
            if (m < M) a = _mm512_loadu_ps(x + m * K + k), b = _mm512_loadu_ps(x + m * K + k + 16);
            _mm512_storeu_si512((void *)(xb + m * K + k), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
}

/* Output columns nb*16..nb*16+15 of all M rows (tiles configured by the caller; wt, c scratch). */
static inline void amx_block(int64_t nb, int64_t M, int64_t MP, int64_t K, int64_t N, const int8_t *w,
                             const float *scales, float *y, const uint16_t *xb, uint16_t *wt, float *c) {
    const int64_t KB = K / 32;
    const int8_t *blk = w + nb * KB * 512;
    for (int64_t m0 = 0; m0 < MP; m0 += MAX_ROWS) {
        const int64_t mt = (MP - m0) / 16 < 4 ? (MP - m0) / 16 : 4;
        const uint16_t *xm = xb + m0 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; kb++) {
            const int8_t *p = blk + kb * 512;
            if (m0 == 0)
                for (int l = 0; l < 8; l++) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * l), _MM_HINT_T1);
            widen_tile(p, wt);
            _tile_loadd(4, wt, 64);
#define XB xm
            switch (mt) { /* tile numbers must be constants */
            case 4: _tile_loadd(5, XB + 3 * 16 * K + kb * 32, K * 2); _tile_dpbf16ps(3, 5, 4); /* fallthrough */
            case 3: _tile_loadd(5, XB + 2 * 16 * K + kb * 32, K * 2); _tile_dpbf16ps(2, 5, 4); /* fallthrough */
            case 2: _tile_loadd(5, XB + 1 * 16 * K + kb * 32, K * 2); _tile_dpbf16ps(1, 5, 4); /* fallthrough */
            default: _tile_loadd(5, XB + kb * 32, K * 2); _tile_dpbf16ps(0, 5, 4);
            }
#undef XB
        }
        for (int64_t t = 0; t < mt; t++) {
            switch (t) {
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64);
            }
            const __m512 s = _mm512_loadu_ps(scales + nb * 16);
            for (int64_t r = 0; r < 16 && m0 + t * 16 + r < M; r++)
                _mm512_storeu_ps(y + (m0 + t * 16 + r) * N + nb * 16, _mm512_mul_ps(_mm512_load_ps(c + r * 16), s));
        }
    }
}

/* The product, then (call not NULL) the LoRA term's shares of `call` in the same region, after the
 * base tiles' barrier (tessera_lora_hooks.h). */
static void amx_product(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w, const float *scales,
                        float *y, uint16_t *xb, const tessera_lora_hooks_t *h, void *call, int one) {
    const int64_t NB = N / 16, MP = (M + 15) / 16 * 16;
    x_to_bf16(M, MP, K, x, xb);
#pragma omp parallel
    {
        configure_tiles();
        uint16_t wt[512] __attribute__((aligned(64)));
        float c[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < NB; nb++) amx_block(nb, M, MP, K, N, w, scales, y, xb, wt, c);
        _tile_release();
        if (call != NULL) tessera_lora_fused_part(h, call, one);
    }
}

void tessera_int8_linear_amx(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                             const float *scales, float *y, uint16_t *xb /* [ceil(M/16)*16, K] scratch */) {
    amx_product(M, K, N, x, w, scales, y, xb, NULL, NULL, 0);
}

/* The same product, then y += the LoRA term of x on `stack` for the step's tokens, in one parallel
 * region. Returns 0 or the LoRA call's error code (nothing written). */
int tessera_int8_linear_amx_lora(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                                 const float *scales, float *y, uint16_t *xb, const tessera_lora_hooks_t *h,
                                 const void *stack, void *step, const int32_t *ranks) {
    void *call;
    int one;
    const int rc = h->prepare(stack, step, N, x, y, ranks, &call, &one);
    if (rc == 0) amx_product(M, K, N, x, w, scales, y, xb, h, call, one);
    return rc;
}

#else /* no AMX in this build: never used */

int tessera_amx_init(void) { return -1; }

void tessera_int8_linear_amx(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                             const float *scales, float *y, uint16_t *xb) {
    (void)M, (void)K, (void)N, (void)x, (void)w, (void)scales, (void)y, (void)xb;
}

int tessera_int8_linear_amx_lora(int64_t M, int64_t K, int64_t N, const float *x, const int8_t *w,
                                 const float *scales, float *y, uint16_t *xb, const tessera_lora_hooks_t *h,
                                 const void *stack, void *step, const int32_t *ranks) {
    (void)M, (void)K, (void)N, (void)x, (void)w, (void)scales, (void)y, (void)xb, (void)h, (void)stack, (void)step,
        (void)ranks;
    return -1;
}

#endif
