/*
 * bf16 weights times float32 rows (bf16.h): one row's dot products with four accumulators, so FMA
 * latency does not serialise the loop; a few rows share each loaded weight vector.
 */
#include "bf16.h"

#include <string.h>

#include "nibble.h" /* MAX_ROWS */

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif
#if defined(__aarch64__)
#include "neon8.h"
#define HAVE_NEON 1
#else
#define HAVE_NEON 0
#endif

#if HAVE_X86
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void bf16_gemm_scalar(const uint16_t *w, const float *x, int rows, int in, int out, float *y) {
    for (int o = 0; o < out; o++) {
        const uint16_t *row = w + (size_t)o * in;
        for (int r = 0; r < rows; r++) {
            float acc = 0.f;
            for (int i = 0; i < in; i++) acc += bf16_to_float(row[i]) * x[(size_t)r * in + i];
            y[(size_t)r * out + o] = acc;
        }
    }
}

#if HAVE_X86
__attribute__((target("avx512f"))) static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The weight row `ahead` (or NULL) into L2, the 128 bytes matching columns [i, i + 64): spread over the
 * loop rather than in a burst. Some hosts' hardware prefetchers do not run far enough ahead of the rows'
 * one stream from DRAM (docs/kernels.md, "The interleaved stream prefetched"). Inlined: a call inside the
 * loops would spill their accumulators. */
__attribute__((always_inline)) static inline void prefetch_ahead(const uint16_t *ahead, int i) {
    if (ahead) _mm_prefetch((const char *)(ahead + i), _MM_HINT_T2), _mm_prefetch((const char *)(ahead + i + 32), _MM_HINT_T2);
}

/* in a multiple of 64. One row: four accumulators so FMA latency does not serialise the loop; a few
 * rows: each loaded weight vector is reused for every row. */
__attribute__((target("avx512f"))) static float dot1_avx512(const uint16_t *row, const float *x, int in,
                                                            const uint16_t *ahead) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 64) {
        prefetch_ahead(ahead, i);
        a0 = _mm512_fmadd_ps(load_bf16x16(row + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(load_bf16x16(row + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(load_bf16x16(row + i + 32), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(load_bf16x16(row + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* Two rows, each accumulated exactly as dot1_avx512 accumulates one (batch-invariant), sharing the
 * weight loads and conversions. */
__attribute__((target("avx512f"))) static void dot2_avx512(const uint16_t *row, const float *x0, const float *x1,
                                                           int in, const uint16_t *ahead, float *y0, float *y1) {
    __m512 a[2][4];
    for (int r = 0; r < 2; r++)
        for (int l = 0; l < 4; l++) a[r][l] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 64) {
        prefetch_ahead(ahead, i);
        for (int l = 0; l < 4; l++) {
            __m512 wv = load_bf16x16(row + i + 16 * l);
            a[0][l] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x0 + i + 16 * l), a[0][l]);
            a[1][l] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x1 + i + 16 * l), a[1][l]);
        }
    }
    *y0 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[0][2], a[0][3])));
    *y1 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[1][0], a[1][1]), _mm512_add_ps(a[1][2], a[1][3])));
}

/* alone: every row through the one-row computation (batch-invariant), two rows per weight pass. The row
 * AHEAD_ROWS on is prefetched on the first pass over a row while it is one of the caller's `readable`. */
#define AHEAD_ROWS 2
__attribute__((target("avx512f"))) static void bf16_gemm_avx512(const uint16_t *w, const float *x, int rows, int in,
                                                                 int out, int readable, int alone, float *y) {
    for (int o = 0; o < out; o++) {
        const uint16_t *row = w + (size_t)o * in;
        if (rows == 1 || alone) {
            const uint16_t *ahead = o + AHEAD_ROWS < readable ? row + (size_t)AHEAD_ROWS * in : NULL;
            int r = 0;
            for (; r + 1 < rows; r += 2, ahead = NULL)
                dot2_avx512(row, x + (size_t)r * in, x + (size_t)(r + 1) * in, in, ahead, y + (size_t)r * out + o,
                            y + (size_t)(r + 1) * out + o);
            if (r < rows) y[(size_t)r * out + o] = dot1_avx512(row, x + (size_t)r * in, in, ahead);
            continue;
        }
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int i = 0; i < in; i += 16) {
            __m512 wv = load_bf16x16(row + i);
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (size_t)r * in + i), acc[r]);
        }
        for (int r = 0; r < rows; r++) y[(size_t)r * out + o] = _mm512_reduce_add_ps(acc[r]);
    }
}

__attribute__((target("avx2,fma"))) static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The same for CPUs without AVX-512 (most desktop parts): 8 wide, in a multiple of 32. */
__attribute__((target("avx2,fma"))) static void bf16_gemm_avx2(const uint16_t *w, const float *x, int rows, int in,
                                                               int out, int alone, float *y) {
    for (int o = 0; o < out; o++) {
        const uint16_t *row = w + (size_t)o * in;
        /* alone (batch-invariant): rows two at a time, each accumulated exactly as a one-row call does
         * (four accumulators each), sharing the weight loads */
        for (int first = 0; first < rows;) {
            int group = rows == 1 || alone ? (rows - first >= 2 ? 2 : 1) : rows;
            int lanes = rows == 1 || alone ? 4 : 1; /* one row: four accumulators, 32 inputs per iteration */
            const float *xg = x + (size_t)first * in;
            __m256 acc[MAX_ROWS * 4];
            for (int k = 0; k < group * lanes; k++) acc[k] = _mm256_setzero_ps();
            for (int i = 0; i < in; i += 8 * lanes) {
                for (int l = 0; l < lanes; l++) {
                    __m256 wv = load_bf16x8(row + i + 8 * l);
                    for (int r = 0; r < group; r++)
                        acc[r * lanes + l] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xg + (size_t)r * in + i + 8 * l), acc[r * lanes + l]);
                }
            }
            for (int r = 0; r < group; r++) {
                __m256 sum = acc[r * lanes];
                for (int l = 1; l < lanes; l++) sum = _mm256_add_ps(sum, acc[r * lanes + l]);
                y[(size_t)(first + r) * out + o] = hsum256(sum);
            }
            first += group;
        }
    }
}
#endif

#if HAVE_NEON
/* 8 bf16 as floats: the 16 bits become the high half (exact) */
F8_INLINE F8 load_bf16x8_neon(const uint16_t *p) {
    uint16x8_t h = vld1q_u16(p);
    return (F8){vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(h, 16))};
}

/* bf16_gemm_avx2 over NEON registers, lane for lane (neon8.h): the same bits. in a multiple of 32. */
static void bf16_gemm_neon(const uint16_t *w, const float *x, int rows, int in, int out, int alone, float *y) {
    for (int o = 0; o < out; o++) {
        const uint16_t *row = w + (size_t)o * in;
        for (int first = 0; first < rows;) {
            int group = rows == 1 || alone ? (rows - first >= 2 ? 2 : 1) : rows;
            int lanes = rows == 1 || alone ? 4 : 1;
            const float *xg = x + (size_t)first * in;
            F8 acc[MAX_ROWS * 4];
            for (int k = 0; k < group * lanes; k++) acc[k] = f8_zero();
            for (int i = 0; i < in; i += 8 * lanes) {
                for (int l = 0; l < lanes; l++) {
                    F8 wv = load_bf16x8_neon(row + i + 8 * l);
                    for (int r = 0; r < group; r++)
                        acc[r * lanes + l] = f8_fma(wv, f8_load(xg + (size_t)r * in + i + 8 * l), acc[r * lanes + l]);
                }
            }
            for (int r = 0; r < group; r++) {
                F8 sum = acc[r * lanes];
                for (int l = 1; l < lanes; l++) sum = f8_add(sum, acc[r * lanes + l]);
                y[(size_t)(first + r) * out + o] = f8_hsum(sum);
            }
            first += group;
        }
    }
}
#endif

int bf16_isa(int in, int limit) {
#if HAVE_X86
    static int avx512 = -1, avx2 = -1;
    if (avx512 < 0) {
        __builtin_cpu_init();
        avx512 = __builtin_cpu_supports("avx512f") && isa_cap() >= 2;
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && isa_cap() >= 1;
    }
    if (limit >= 2 && avx512 && in % 64 == 0) return 2;
    if (limit >= 1 && avx2 && in % 32 == 0) return 1;
#elif HAVE_NEON /* level 1: the AVX2 loops' NEON twin (no 16-lane set: it would give AVX-512's other bits) */
    if (limit >= 1 && isa_cap() >= 1 && in % 32 == 0) return 1;
#else
    (void)in;
    (void)limit;
#endif
    return 0;
}

#define BLOCK_OUT 64 /* output rows per pass: the kernels write a [rows, 64] buffer, then y's columns */

/* Rows [0, rows <= MAX_ROWS) of x: output rows [begin, end) in passes of BLOCK_OUT. */
static void gemm_rows(const uint16_t *w, const float *x, int rows, int in, int begin, int end, int isa, int alone,
                      float *y, size_t ldy) {
    float tmp[MAX_ROWS * BLOCK_OUT];
    for (int o = begin; o < end; o += BLOCK_OUT) {
        int m = end - o < BLOCK_OUT ? end - o : BLOCK_OUT;
        const uint16_t *wb = w + (size_t)o * in;
#if HAVE_X86
        if (isa == 2)
            bf16_gemm_avx512(wb, x, rows, in, m, end - o, alone, tmp);
        else if (isa == 1)
            bf16_gemm_avx2(wb, x, rows, in, m, alone, tmp);
        else
#elif HAVE_NEON
        if (isa == 1)
            bf16_gemm_neon(wb, x, rows, in, m, alone, tmp);
        else
#endif
            bf16_gemm_scalar(wb, x, rows, in, m, tmp);
        for (int r = 0; r < rows; r++) memcpy(y + (size_t)r * ldy + (o - begin), tmp + (size_t)r * m, (size_t)m * sizeof(float));
    }
}

void bf16_gemm_rows(const uint16_t *w, const float *x, int rows, int in, int begin, int end, int isa_limit, int alone,
                    float *y, size_t ldy) {
    int isa = bf16_isa(in, isa_limit);
    for (int r = 0; r < rows; r += MAX_ROWS) /* alone: the same bits whatever rows go together */
        gemm_rows(w, x + (size_t)r * in, rows - r < MAX_ROWS ? rows - r : MAX_ROWS, in, begin, end, isa, alone,
                  y + (size_t)r * ldy, ldy);
}
