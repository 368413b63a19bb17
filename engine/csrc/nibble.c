/*
 * 4-bit group-quantised matrix times a few float32 rows, straight from the container's record layout
 * (nibble.h; every record kind: int4 or fp4 codes, float16, bfloat16 or e8m0 scales, ragged groups).
 *
 *   y[r, o] = sum_g scale[o, g] * sum_{k in g} value(q[o, k]) * x[r, k]
 *
 * Why a kernel: dequantising the whole matrix to float32 first moves ~40 bytes of memory traffic per
 * 4-bit weight (0.5 byte); this reads each weight byte once. Each group is summed on its own before
 * its scale is applied, in float32, so the result agrees with dequantise-then-matmul to float rounding
 * (not bit for bit: the summation order differs). int4's "- 8" is folded out of the group's sum:
 * sum (n - 8) x = sum n x - 8 sum x, with sum x per group computed once per row.
 *
 * x is de-interleaved per group (evens, then odds) so the low and the high nibbles of 8 bytes meet 8
 * contiguous floats each; an odd width's padding nibble meets a 0 there and contributes nothing. A
 * group's bytes go 16 or 8 at a time through AVX2, the rest (a ragged last group) through a scalar
 * tail: nothing past a row's bytes is read.
 */
#include "nibble.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* Each code's 16 nibble values as the matmul sums them: int4 n (the "- 8" folded out), fp4 e2m1. */
static const float FOLD_VALUES[N_CODES][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f},
};
static const float FOLD_OFFSET[N_CODES] = {8.f, 0.f};

static inline float from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 31) return from_bits(sign | 0x7F800000 | (mant << 13));
    if (exp != 0) return from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
    if (mant == 0) return from_bits(sign);
    exp = 127 - 15 + 1; /* subnormal: normalise */
    while ((mant & 0x400) == 0) {
        mant <<= 1;
        exp--;
    }
    return from_bits(sign | (exp << 23) | ((mant & 0x3FF) << 13));
}

/* e8m0: 2^(e - 127); e = 0 is 2^-127, a float32 subnormal; 255 is NaN (OCP MX). */
static inline float e8m0_to_float(uint8_t e) {
    if (e == 255) return NAN;
    return from_bits(e ? (uint32_t)e << 23 : 0x00400000u);
}

static inline float scale_at(const NibbleMatrix *m, size_t i) {
    switch (m->scale_kind) {
    case SCALE_F16: return half_to_float(((const uint16_t *)m->scales)[i]);
    case SCALE_BF16: return from_bits((uint32_t)((const uint16_t *)m->scales)[i] << 16);
    default: return e8m0_to_float(((const uint8_t *)m->scales)[i]);
    }
}

/* Bytes of group g in a row of row_bytes (the last group may have fewer). */
static inline int group_bytes(const NibbleMatrix *m, size_t row_bytes, int g) {
    size_t first = (size_t)g * (m->group / 2), left = row_bytes - first;
    return left < (size_t)(m->group / 2) ? (int)left : m->group / 2;
}

size_t nibble_work_floats(const NibbleMatrix *m, int rows) {
    return (size_t)rows * (2 * nibble_row_bytes(m) + (size_t)nibble_groups(m));
}

void nibble_prepare(const NibbleMatrix *m, const float *x, int rows, float *xs, float *sums) {
    size_t row_bytes = nibble_row_bytes(m), stride = 2 * row_bytes;
    int groups = nibble_groups(m);
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < groups; g++) {
            size_t first = (size_t)g * m->group;
            int cols = m->in - (int)first < m->group ? m->in - (int)first : m->group, half = group_bytes(m, row_bytes, g);
            const float *src = x + (size_t)r * m->in + first;
            float *dst = xs + (size_t)r * stride + first, s = 0.f;
            for (int j = 0; j < half; j++) {
                float even = src[2 * j], odd = 2 * j + 1 < cols ? src[2 * j + 1] : 0.f;
                dst[j] = even;
                dst[half + j] = odd;
                s += even + odd;
            }
            sums[(size_t)r * groups + g] = FOLD_OFFSET[m->code] * s;
        }
    }
}

/* The scalar dot of `bytes` bytes of one group with its de-interleaved x (evens xg, odds xg + half). */
static inline float group_dot_scalar(const float *table, const uint8_t *qg, const float *xg, int half, int from) {
    float acc = 0.f;
    for (int j = from; j < half; j++) acc += table[qg[j] & 0x0F] * xg[j] + table[qg[j] >> 4] * xg[half + j];
    return acc;
}

static void gemm_scalar(const NibbleMatrix *m, const float *xs, const float *sums, int rows, int begin, int end,
                        float *y) {
    size_t row_bytes = nibble_row_bytes(m), stride = 2 * row_bytes;
    int groups = nibble_groups(m), n = end - begin;
    const float *table = FOLD_VALUES[m->code];
    for (int o = begin; o < end; o++) {
        const uint8_t *qrow = m->q + (size_t)o * row_bytes;
        for (int r = 0; r < rows; r++) {
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                size_t first = (size_t)g * (m->group / 2);
                float acc = group_dot_scalar(table, qrow + first, xs + (size_t)r * stride + 2 * first,
                                             group_bytes(m, row_bytes, g), 0);
                total += scale_at(m, (size_t)o * groups + g) * (acc - sums[(size_t)r * groups + g]);
            }
            y[(size_t)r * n + (o - begin)] = total;
        }
    }
}

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Exactly 8 bytes -> the 8 low nibbles (even columns) and the 8 high nibbles (odd columns) as floats.
 * int4: the nibble itself (the offset is folded out). fp4: vpermps reads the low 3 bits of each lane,
 * the magnitude's index; the nibble's bit 3 is OR-ed in as the float's sign bit. */
AVX2_INLINE void unpack8(int code, const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (code == CODE_INT4) {
        *lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
        *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        return;
    }
    const __m256 magnitudes = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    __m256i lo_sign = _mm256_and_si256(_mm256_slli_epi32(bytes, 28), sign);
    __m256i hi_sign = _mm256_and_si256(_mm256_slli_epi32(bytes, 24), sign);
    *lo = _mm256_or_ps(_mm256_permutevar8x32_ps(magnitudes, bytes), _mm256_castsi256_ps(lo_sign));
    *hi = _mm256_or_ps(_mm256_permutevar8x32_ps(magnitudes, _mm256_srli_epi32(bytes, 4)), _mm256_castsi256_ps(hi_sign));
}

AVX2_INLINE float scale_of(int scale_kind, const void *scales, size_t i) {
    if (scale_kind == SCALE_F16) return _cvtsh_ss(((const uint16_t *)scales)[i]);
    if (scale_kind == SCALE_BF16) return from_bits((uint32_t)((const uint16_t *)scales)[i] << 16);
    return e8m0_to_float(((const uint8_t *)scales)[i]);
}

/* One group's dot with x as a vector (its horizontal sum is the group's sum), whole 8-byte steps only:
 * returns in *done the bytes it took. Two chains (even, odd columns) so FMA latency overlaps. */
AVX2_INLINE __m256 group_dot8(int code, const uint8_t *qg, const float *xg, int half, int *done) {
    __m256 lo, hi, lo1, hi1;
    int j = 0;
    if (half < 8) {
        *done = 0;
        return _mm256_setzero_ps();
    }
    unpack8(code, qg, &lo, &hi);
    __m256 even = _mm256_mul_ps(lo, _mm256_loadu_ps(xg)), odd = _mm256_mul_ps(hi, _mm256_loadu_ps(xg + half));
    for (j = 8; j + 16 <= half; j += 16) {
        unpack8(code, qg + j, &lo, &hi);
        unpack8(code, qg + j + 8, &lo1, &hi1);
        even = _mm256_fmadd_ps(lo1, _mm256_loadu_ps(xg + j + 8), _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + j), even));
        odd = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(xg + half + j + 8), _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + half + j), odd));
    }
    if (j + 8 <= half) {
        unpack8(code, qg + j, &lo, &hi);
        even = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + j), even);
        odd = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + half + j), odd);
        j += 8;
    }
    *done = j;
    return _mm256_add_ps(even, odd);
}

/* One row (decode): each group's vector dot is scaled into a vector total (one horizontal sum per
 * output); code and scale kind are constants after inlining. Whole groups take the lean loop, a
 * ragged last group adds the scalar tail. */
AVX2_INLINE void gemv_avx2(int code, int scale_kind, const NibbleMatrix *m, const float *xs, const float *sums,
                           int begin, int end, float *y) {
    size_t row_bytes = nibble_row_bytes(m);
    int groups = nibble_groups(m), half = m->group / 2;
    int whole = (size_t)groups * half == row_bytes ? groups : groups - 1, last_half = group_bytes(m, row_bytes, groups - 1);
    const float *table = FOLD_VALUES[code];
    for (int o = begin; o < end; o++) {
        const uint8_t *qrow = m->q + (size_t)o * row_bytes;
        size_t s0 = (size_t)o * groups;
        __m256 total = _mm256_setzero_ps();
        float rest = 0.f; /* scalar tails minus the folded offsets, scaled */
        for (int g = 0; g < whole; g++) {
            int done;
            __m256 dot = group_dot8(code, qrow + (size_t)g * half, xs + (size_t)g * m->group, half, &done);
            float scale = scale_of(scale_kind, m->scales, s0 + g);
            total = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale), total);
            float tail = done < half ? group_dot_scalar(table, qrow + (size_t)g * half, xs + (size_t)g * m->group, half, done) : 0.f;
            if (code == CODE_INT4 || done < half) rest += scale * (tail - sums[g]);
        }
        if (whole < groups) {
            int g = groups - 1, done;
            const uint8_t *qg = qrow + (size_t)g * half;
            const float *xg = xs + (size_t)g * m->group;
            __m256 dot = group_dot8(code, qg, xg, last_half, &done);
            float scale = scale_of(scale_kind, m->scales, s0 + g);
            total = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale), total);
            rest += scale * (group_dot_scalar(table, qg, xg, last_half, done) - sums[g]);
        }
        y[o - begin] = hsum8(total) + rest;
    }
}

/* R (2..4) rows, two output rows at a time: each x vector loaded serves both output rows (x of a few
 * rows outgrows L1, so loads, not FMAs, would bound a one-output loop). Weights are scaled before the
 * FMAs (w = value * scale), so no per-group sums are kept: R and the pair are constants after
 * inlining and the 2R accumulators stay in registers. */
AVX2_INLINE void gemm_avx2(int code, int scale_kind, int R, const NibbleMatrix *m, const float *xs, const float *sums, int begin,
                           int end, float *y, int y_stride) {
    size_t row_bytes = nibble_row_bytes(m), stride = 2 * row_bytes;
    int groups = nibble_groups(m);
    const float *table = FOLD_VALUES[code];
    for (int o = begin; o < end; o += 2) {
        int o1 = o + 1 < end ? o + 1 : o; /* an odd count: the last row is computed twice, stored once */
        const uint8_t *q0 = m->q + (size_t)o * row_bytes, *q1 = m->q + (size_t)o1 * row_bytes;
        /* two rows: even and odd columns in separate accumulators, so FMA latency overlaps */
        __m256 acc0[4], acc1[4], odd0[2], odd1[2];
        float rest0[4], rest1[4];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps(), rest0[r] = rest1[r] = 0.f;
        for (int r = 0; r < 2; r++) odd0[r] = odd1[r] = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++) {
            size_t first = (size_t)g * (m->group / 2);
            int half = group_bytes(m, row_bytes, g), j = 0;
            float s0 = scale_of(scale_kind, m->scales, (size_t)o * groups + g);
            float s1 = scale_of(scale_kind, m->scales, (size_t)o1 * groups + g);
            __m256 scale0 = _mm256_set1_ps(s0), scale1 = _mm256_set1_ps(s1);
            for (; j + 8 <= half; j += 8) {
                __m256 lo0, hi0, lo1, hi1;
                unpack8(code, q0 + first + j, &lo0, &hi0);
                unpack8(code, q1 + first + j, &lo1, &hi1);
                lo0 = _mm256_mul_ps(lo0, scale0), hi0 = _mm256_mul_ps(hi0, scale0);
                lo1 = _mm256_mul_ps(lo1, scale1), hi1 = _mm256_mul_ps(hi1, scale1);
                for (int r = 0; r < R; r++) {
                    const float *xg = xs + (size_t)r * stride + 2 * first;
                    __m256 even = _mm256_loadu_ps(xg + j), odd = _mm256_loadu_ps(xg + half + j);
                    if (R <= 2) {
                        acc0[r] = _mm256_fmadd_ps(lo0, even, acc0[r]), odd0[r] = _mm256_fmadd_ps(hi0, odd, odd0[r]);
                        acc1[r] = _mm256_fmadd_ps(lo1, even, acc1[r]), odd1[r] = _mm256_fmadd_ps(hi1, odd, odd1[r]);
                    } else {
                        acc0[r] = _mm256_fmadd_ps(hi0, odd, _mm256_fmadd_ps(lo0, even, acc0[r]));
                        acc1[r] = _mm256_fmadd_ps(hi1, odd, _mm256_fmadd_ps(lo1, even, acc1[r]));
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const float *xg = xs + (size_t)r * stride + 2 * first;
                float tail0 = 0.f, tail1 = 0.f;
                if (j < half) {
                    tail0 = group_dot_scalar(table, q0 + first, xg, half, j);
                    tail1 = group_dot_scalar(table, q1 + first, xg, half, j);
                }
                if (code == CODE_INT4 || j < half) {
                    rest0[r] += s0 * (tail0 - sums[(size_t)r * groups + g]);
                    rest1[r] += s1 * (tail1 - sums[(size_t)r * groups + g]);
                }
            }
        }
        for (int r = 0; r < R && R <= 2; r++) acc0[r] = _mm256_add_ps(acc0[r], odd0[r]), acc1[r] = _mm256_add_ps(acc1[r], odd1[r]);
        for (int r = 0; r < R; r++) {
            y[(size_t)r * y_stride + (o - begin)] = hsum8(acc0[r]) + rest0[r];
            if (o1 != o) y[(size_t)r * y_stride + (o1 - begin)] = hsum8(acc1[r]) + rest1[r];
        }
    }
}

/* Rows in blocks of up to 4; one instantiation per code, scale kind and block height (the bodies are
 * inlined into this function with constant arguments). */
AVX2_INLINE void row_blocks(int code, int scale_kind, const NibbleMatrix *m, const float *xs, const float *sums,
                            int rows, int begin, int end, float *y) {
    size_t stride = 2 * nibble_row_bytes(m);
    int groups = nibble_groups(m), n = end - begin;
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const float *xb = xs + (size_t)r0 * stride, *sb = sums + (size_t)r0 * groups;
        float *yb = y + (size_t)r0 * n;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: gemv_avx2(code, scale_kind, m, xb, sb, begin, end, yb); break;
        case 2: gemm_avx2(code, scale_kind, 2, m, xb, sb, begin, end, yb, n); break;
        case 3: gemm_avx2(code, scale_kind, 3, m, xb, sb, begin, end, yb, n); break;
        default: gemm_avx2(code, scale_kind, 4, m, xb, sb, begin, end, yb, n); break;
        }
    }
}

AVX2_INLINE void code_blocks(int code, const NibbleMatrix *m, const float *xs, const float *sums, int rows, int begin,
                             int end, float *y) {
    if (m->scale_kind == SCALE_F16) row_blocks(code, SCALE_F16, m, xs, sums, rows, begin, end, y);
    else if (m->scale_kind == SCALE_BF16) row_blocks(code, SCALE_BF16, m, xs, sums, rows, begin, end, y);
    else row_blocks(code, SCALE_E8M0, m, xs, sums, rows, begin, end, y);
}

AVX2 static void gemm_simd(const NibbleMatrix *m, const float *xs, const float *sums, int rows, int begin, int end,
                           float *y) {
    if (m->code == CODE_FP4) code_blocks(CODE_FP4, m, xs, sums, rows, begin, end, y);
    else code_blocks(CODE_INT4, m, xs, sums, rows, begin, end, y);
}
#endif

int nibble_simd_available(void) {
#if HAVE_X86
    static int supported = -1;
    if (supported < 0) {
        __builtin_cpu_init();
        supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return supported;
#else
    return 0;
#endif
}

void nibble_gemm(const NibbleMatrix *m, const float *xs, const float *sums, int rows, int begin, int end, int simd,
                 float *y) {
#if HAVE_X86
    if (simd && nibble_simd_available()) {
        gemm_simd(m, xs, sums, rows, begin, end, y);
        return;
    }
#endif
    (void)simd;
    gemm_scalar(m, xs, sums, rows, begin, end, y);
}

/* Element values as engine/quant.py's code_values gives them (int4: n - 8, exact in float32). */
static const float VALUES[N_CODES][16] = {
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f},
};

void nibble_dequant(const NibbleMatrix *m, int out, float *w) {
    size_t row_bytes = nibble_row_bytes(m);
    int groups = nibble_groups(m);
    const float *values = VALUES[m->code];
    for (int o = 0; o < out; o++) {
        for (int g = 0; g < groups; g++) {
            float scale = scale_at(m, (size_t)o * groups + g);
            size_t first = (size_t)g * m->group;
            int cols = m->in - (int)first < m->group ? m->in - (int)first : m->group;
            const uint8_t *qg = m->q + (size_t)o * row_bytes + first / 2;
            float *wg = w + (size_t)o * m->in + first;
            int j = 0;
            for (; 2 * j + 1 < cols; j++) {
                wg[2 * j] = values[qg[j] & 0x0F] * scale;
                wg[2 * j + 1] = values[qg[j] >> 4] * scale;
            }
            if (2 * j < cols) wg[2 * j] = values[qg[j] & 0x0F] * scale; /* an odd row's last column */
        }
    }
}
