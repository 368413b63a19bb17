/*
 * 4-bit group-quantised matrix times a few float32 rows, straight from the container's record layout
 * (nibble.h; every record kind: int4 or fp4 codes, float16, bfloat16 or e8m0 scales, ragged groups).
 *
 *   y[r, o] = sum_g scale[o, g] * sum_{k in g} value(q[o, k]) * x[r, k]
 *
 * Why a kernel: dequantising the whole matrix to float32 first moves ~40 bytes of memory traffic per
 * 4-bit weight (0.5 byte); this reads each weight byte once and agrees with dequantise-then-matmul to
 * float rounding (not bit for bit: the summation order differs).
 *
 * A row is read in chunks of 64 bytes (128 columns): 16 dwords of 8 nibbles, dword d holding columns
 * 8d..8d+7. Shifting the chunk right by 4s puts every dword's nibble s (column 8d + s) in its low 4 bits,
 * and one 16-entry permute (AVX-512's vpermps; AVX2: two 8-entry ones and a blend on bit 3) maps those
 * to the code's float values, so 8 shifts and 8 lookups make a chunk's 128 weights: weight vector s
 * holds columns 8d + s, the order nibble_prepare gives x (x_slot). A lane's 8 columns sit in one group
 * (group % 8 == 0), so a chunk's products are summed per lane first and scaled once, by a vector of
 * the lanes' group scales.
 *
 * Why not the bf16-byte tables of the first kernel (two byte shuffles and three unpacks per 8 weights):
 * on the Intel host every shuffle takes port 5, which held the kernel to ~5 GB/s a core, compute-bound
 * where the memory gives 13; this takes one shuffle per 16 weights.
 *
 * x is prepared zero-padded to whole chunks, so an odd row's padding nibble and a tail chunk's zero
 * bytes contribute nothing; a row's last, partial chunk is copied to a zeroed buffer first: nothing
 * past a row's bytes, nor past its scales, is read. Columns go in blocks whose x (all rows) fits in L1
 * while every output row of the slice passes.
 *
 * aarch64 takes a NEON set, the AVX2 set lane for lane (neon8.h): the same bits (docs/kernels.md, "ARM (NEON)").
 */
#include "nibble.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif
#if defined(__aarch64__)
#include "neon8.h"
#define HAVE_NEON 1
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#else
#define HAVE_NEON 0
#endif

/* Element values as engine/kernels/quant.py's code_values gives them (int4: n - 8); all exact in bfloat16. */
static const float VALUES[N_CODES][16] = {
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f},
};

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

/* Where row r's column k sits in the prepared x, [chunks][rows][128] (a chunk's x for every row
 * together): in chunk k / 128, column j = k % 128 is nibble s = j % 8 of dword d = j / 8, so weight
 * vector s's lane d (chunk_rows' order). */
static inline size_t x_slot(size_t k, int r, int rows) {
    size_t j = k % CHUNK_COLS;
    return ((k / CHUNK_COLS) * (size_t)rows + (size_t)r) * CHUNK_COLS + 16 * (j % 8) + j / 8;
}

size_t nibble_work_floats(const NibbleMatrix *m, int rows) { return (size_t)rows * nibble_chunks(m) * CHUNK_COLS; }

void nibble_prepare(const NibbleMatrix *m, const float *x, int rows, float *xs) {
    size_t cols = nibble_chunks(m) * CHUNK_COLS;
    for (int r = 0; r < rows; r++) {
        const float *src = x + (size_t)r * m->in;
        for (size_t k = 0; k < cols; k++) xs[x_slot(k, r, rows)] = k < (size_t)m->in ? src[k] : 0.f;
    }
}

static void gemm_scalar(const NibbleMatrix *m, const float *xs, int rows, int begin, int end, float *y) {
    size_t row_bytes = nibble_row_bytes(m);
    int groups = nibble_groups(m), n = end - begin;
    const float *values = VALUES[m->code];
    for (int o = begin; o < end; o++) {
        const uint8_t *qrow = m->q + (size_t)o * row_bytes;
        for (int r = 0; r < rows; r++) {
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                size_t first = (size_t)g * m->group, last = first + m->group < (size_t)m->in ? first + m->group : (size_t)m->in;
                float acc = 0.f;
                for (size_t k = first; k < last; k++) acc += values[(qrow[k / 2] >> (4 * (k % 2))) & 0x0F] * xs[x_slot(k, r, rows)];
                total += scale_at(m, (size_t)o * groups + g) * acc;
            }
            y[(size_t)r * n + (o - begin)] = total;
        }
    }
}

#if HAVE_X86 || HAVE_NEON
/* How many output rows ahead a pass asks for the codes (row_block's ahead). */
#define AHEAD_ROWS 2

/* Floats of x (all rows) per column block: 16 KiB, half of L1, the rest for the streaming weights. */
#define BLOCK_FLOATS 4096

/* Chunks per column block for R rows: x of one row is read once per output row, so it may take L1
 * (the codes stream past); more rows share the block. */
#define block_chunks(R) ((R) == 1 ? 2 * BLOCK_FLOATS / CHUNK_COLS : BLOCK_FLOATS / (CHUNK_COLS * (R)))

/* The largest column block in chunks, and its groups (group >= 8 on the SIMD path), plus one. */
#define MAX_BLOCK_CHUNKS block_chunks(1)
#define MAX_BLOCK_GROUPS (MAX_BLOCK_CHUNKS * CHUNK_COLS / 8 + 1)

/* Whether every lane of a chunk has the chunk's first group (groups of whole chunks, or one group a
 * row): one broadcast scale instead of a permute. */
static int broadcast_scales(const NibbleMatrix *m) { return m->group % CHUNK_COLS == 0 || nibble_groups(m) == 1; }

/* Whether the SIMD loops take the matrix: a lane's 8 columns in one group. */
static int simd_shape(const NibbleMatrix *m) { return broadcast_scales(m) || m->group % 8 == 0; }

/* A chunk's lanes' group scales, as indexes into the block's scales (row_scales): lane d (columns
 * 8d..8d+7) has scales[base + lane[d]]; the 8-lane sets read lanes 8-15 as scales[base_hi + hi[d]]. */
typedef struct {
    int32_t lane[16], hi[8];
    int base, base_hi;
#if HAVE_NEON
    uint8_t bytes[2][32]; /* NEON: lanes 0-7 (h 0) and 8-15 (h 1) as vqtbl2 byte indexes into their 8 floats */
#endif
} ChunkScales;

static void block_scales(const NibbleMatrix *m, size_t c0, size_t c1, ChunkScales *cs) {
    size_t first = c0 * CHUNK_COLS / m->group;
    for (size_t c = c0; c < c1; c++) {
        ChunkScales *s = cs + (c - c0);
        size_t start = c * CHUNK_COLS / m->group, within = c * CHUNK_COLS % m->group; /* column 0's place in its group */
        int32_t lane = 0;
        for (int d = 0; d < 16; d++, within += 8) { /* group % 8 == 0 (or broadcast_scales: lanes unused) */
            if (within >= (size_t)m->group) within -= (size_t)m->group, lane++;
            s->lane[d] = lane;
        }
        s->base = (int)(start - first);
        s->base_hi = s->base + s->lane[8];
        for (int d = 0; d < 8; d++) s->hi[d] = s->lane[8 + d] - s->lane[8];
#if HAVE_NEON
        for (int d = 0; d < 8; d++)
            for (int j = 0; j < 4; j++)
                s->bytes[0][4 * d + j] = (uint8_t)(4 * s->lane[d] + j), s->bytes[1][4 * d + j] = (uint8_t)(4 * s->hi[d] + j);
#endif
    }
}
#endif

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline
#define prefetch_t0(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* Row o's scales of groups first.. as float32 (0 past the row's last group: a tail chunk's padding
 * columns, where x is 0, and the lanes a chunk_lanes load reads beyond its groups; no scale past the
 * row is read). */
AVX2 static void row_scales(const NibbleMatrix *m, int o, size_t first, size_t count, float *out) {
    size_t groups = (size_t)nibble_groups(m), s0 = (size_t)o * groups + first, have = first + count < groups ? count : groups - first;
    size_t i = 0;
    const uint16_t *halves = (const uint16_t *)m->scales + s0;
    switch (m->scale_kind) {
    case SCALE_F16:
        for (; i + 8 <= have; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + i))));
        for (; i < have; i++) out[i] = _cvtsh_ss(halves[i]);
        break;
    case SCALE_BF16:
        for (; i + 8 <= have; i += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(halves + i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
        for (; i < have; i++) out[i] = from_bits((uint32_t)halves[i] << 16);
        break;
    default:
        for (; i < have; i++) out[i] = e8m0_to_float(((const uint8_t *)m->scales)[s0 + i]);
    }
    for (i = have; i < count; i++) out[i] = 0.f;
}

/* The 8 lanes' sum, halves then pairs: both sets' last step (the AVX-512 set inlines it too). */
AVX2_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 16-lane set (AVX-512F/VL/BW): a chunk is one zmm of codes; weights are one vpermps of the
 * shifted codes into the code's 16 values. */
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
#define AVX512_INLINE AVX512 __attribute__((always_inline)) static inline
typedef struct {
    __m512 values;
} Table16;
AVX512_INLINE Table16 value_table_avx512(int code) { return (Table16){_mm512_loadu_ps(VALUES[code])}; }
AVX512_INLINE __m512i load_codes_avx512(const uint8_t *p, const Table16 *t) {
    (void)t;
    return _mm512_loadu_si512((const void *)p);
}
AVX512_INLINE __m512 weights_avx512(__m512i v, int s, const Table16 *t) {
    return _mm512_permutexvar_ps(s ? _mm512_srli_epi32(v, 4 * s) : v, t->values);
}
AVX512_INLINE __m512 load_x_avx512(const float *p) { return _mm512_loadu_ps(p); }
AVX512_INLINE __m512 fma_avx512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
AVX512_INLINE __m512 zero_avx512(void) { return _mm512_setzero_ps(); }
AVX512_INLINE __m512 add_avx512(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
AVX512_INLINE __m512 broadcast_avx512(const float *p) { return _mm512_set1_ps(*p); }
AVX512_INLINE __m512 chunk_lanes_avx512(const float *scales, const ChunkScales *cs, int h) {
    (void)h;
    return _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)cs->lane), _mm512_loadu_ps(scales + cs->base));
}
/* Lanes 0-7 + lanes 8-15, then hsum8: the 8-lane sets' order. */
AVX512_INLINE float total_avx512(__m512 acc[1][8], int r) {
    __m256 low = _mm512_castps512_ps256(acc[0][r]), high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0][r]), 1));
    return hsum8(_mm256_add_ps(low, high));
}
#define NB_TARGET AVX512
#define NB_INLINE AVX512_INLINE
#define NB_NAME(name) name##_avx512
#define NB_VEC __m512
#define NB_CODES __m512i
#define NB_TABLE Table16
#define NB_HALVES 1
#define NB_MAX_RS 8
#include "nibble_body.h"
#undef NB_TARGET
#undef NB_INLINE
#undef NB_NAME
#undef NB_VEC
#undef NB_CODES
#undef NB_TABLE
#undef NB_HALVES
#undef NB_MAX_RS

/* The 8-lane set (AVX2): a chunk is two ymm of codes, lanes 0-7 then 8-15, each a chain of its own (the
 * 16 registers hold two rows' accumulators); a weight is two 8-entry vpermps, the code's values 0-7
 * and 8-15, blended on the nibble's bit 3. */
typedef struct {
    __m256 low, high;
    int int4; /* int4 values are made by arithmetic, without the permutes */
} Table8;
AVX2_INLINE Table8 value_table_avx2(int code) {
    return (Table8){_mm256_loadu_ps(VALUES[code]), _mm256_loadu_ps(VALUES[code] + 8), code == CODE_INT4};
}
AVX2_INLINE __m256i load_codes_avx2(const uint8_t *p, const Table8 *t) {
    (void)t;
    return _mm256_loadu_si256((const __m256i *)p);
}
AVX2_INLINE __m256 weights_avx2(__m256i v, int s, const Table8 *t) {
    __m256i index = s ? _mm256_srli_epi32(v, 4 * s) : v;
    if (t->int4) { /* n - 8 as (2^23 + n) - (2^23 + 8): the float bits of 2^23 with n in the mantissa, exact */
        __m256i biased = _mm256_or_si256(_mm256_and_si256(index, _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(0x4B000000));
        return _mm256_sub_ps(_mm256_castsi256_ps(biased), _mm256_set1_ps(8388616.f));
    }
    __m256 low = _mm256_permutevar8x32_ps(t->low, index), high = _mm256_permutevar8x32_ps(t->high, index);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}
AVX2_INLINE __m256 load_x_avx2(const float *p) { return _mm256_loadu_ps(p); }
AVX2_INLINE __m256 fma_avx2(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
AVX2_INLINE __m256 zero_avx2(void) { return _mm256_setzero_ps(); }
AVX2_INLINE __m256 add_avx2(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
AVX2_INLINE __m256 broadcast_avx2(const float *p) { return _mm256_broadcast_ss(p); }
AVX2_INLINE __m256 chunk_lanes_avx2(const float *scales, const ChunkScales *cs, int h) {
    const int32_t *index = h ? cs->hi : cs->lane;
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(scales + (h ? cs->base_hi : cs->base)), _mm256_loadu_si256((const __m256i *)index));
}
AVX2_INLINE float total_avx2(__m256 acc[2][2], int r) { return hsum8(_mm256_add_ps(acc[0][r], acc[1][r])); }
#define NB_TARGET AVX2
#define NB_INLINE AVX2_INLINE
#define NB_NAME(name) name##_avx2
#define NB_VEC __m256
#define NB_CODES __m256i
#define NB_TABLE Table8
#define NB_HALVES 2
#define NB_MAX_RS 2
#include "nibble_body.h"
#undef NB_TARGET
#undef NB_INLINE
#undef NB_NAME
#undef NB_VEC
#undef NB_CODES
#undef NB_TABLE
#undef NB_HALVES
#undef NB_MAX_RS
#endif

#if HAVE_NEON
/* The NEON set (every aarch64 CPU): the AVX2 set lane for lane (neon8.h), a chunk two halves of 8 dword
 * lanes, each lane's products in the same order, so the same bits as AVX2 and AVX-512. */
#define prefetch_t0(p) __builtin_prefetch((p), 0, 3)
#define NEON_INLINE __attribute__((always_inline)) static inline

/* Row o's scales of groups first.. as float32, as the AVX2 row_scales (the conversions are exact). */
static void row_scales(const NibbleMatrix *m, int o, size_t first, size_t count, float *out) {
    size_t groups = (size_t)nibble_groups(m), s0 = (size_t)o * groups + first, have = first + count < groups ? count : groups - first;
    size_t i = 0;
    const uint16_t *halves = (const uint16_t *)m->scales + s0;
    switch (m->scale_kind) {
    case SCALE_F16:
        for (; i + 8 <= have; i += 8) f8_store(out + i, f8_from_halves(halves + i));
        for (; i < have; i++) out[i] = half_to_float(halves[i]);
        break;
    case SCALE_BF16:
        for (; i + 4 <= have; i += 4) vst1q_f32(out + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(halves + i), 16)));
        for (; i < have; i++) out[i] = from_bits((uint32_t)halves[i] << 16);
        break;
    default:
        for (; i < have; i++) out[i] = e8m0_to_float(((const uint8_t *)m->scales)[s0 + i]);
    }
    for (i = have; i < count; i++) out[i] = 0.f;
}

typedef struct {
    uint32x4_t lo, hi; /* 8 dwords of codes: lanes 0-3, 4-7 */
} Codes8;
typedef struct {
    uint8x16x4_t values; /* the code's 16 floats' bytes, for vqtbl4q_u8 (fp4) */
    int int4;
} TableNeon;
NEON_INLINE TableNeon value_table_neon(int code) {
    return (TableNeon){vld1q_u8_x4((const uint8_t *)VALUES[code]), code == CODE_INT4};
}
/* int4: every nibble n stored as n ^ 8, whose signed value is n - 8 (weights_neon sign-extends it) */
NEON_INLINE Codes8 load_codes_neon(const uint8_t *p, const TableNeon *t) {
    uint32x4_t lo = vld1q_u32((const uint32_t *)p), hi = vld1q_u32((const uint32_t *)(p + 16));
    if (t->int4) {
        uint32x4_t flip = vdupq_n_u32(0x88888888u);
        lo = veorq_u32(lo, flip), hi = veorq_u32(hi, flip);
    }
    return (Codes8){lo, hi};
}
/* nibble s of each dword as its float value: int4 by shifting it to the top and back, signed (exact);
 * fp4 by a byte lookup of the value's 4 bytes */
NEON_INLINE float32x4_t weights4_neon(uint32x4_t v, int s, const TableNeon *t) {
    if (t->int4) {
        int32x4_t top = s == 7 ? vreinterpretq_s32_u32(v) : vshlq_s32(vreinterpretq_s32_u32(v), vdupq_n_s32(28 - 4 * s));
        return vcvtq_f32_s32(vshlq_s32(top, vdupq_n_s32(-28)));
    }
    uint32x4_t n = vandq_u32(vshlq_u32(v, vdupq_n_s32(-4 * s)), vdupq_n_u32(0x0F));
    uint32x4_t index = vmlaq_u32(vdupq_n_u32(0x03020100u), n, vdupq_n_u32(0x04040404u));
    return vreinterpretq_f32_u8(vqtbl4q_u8(t->values, vreinterpretq_u8_u32(index)));
}
NEON_INLINE F8 weights_neon(Codes8 v, int s, const TableNeon *t) { return (F8){weights4_neon(v.lo, s, t), weights4_neon(v.hi, s, t)}; }
NEON_INLINE F8 load_x_neon(const float *p) { return f8_load(p); }
NEON_INLINE F8 fma_neon(F8 a, F8 b, F8 c) { return f8_fma(a, b, c); }
NEON_INLINE F8 zero_neon(void) { return f8_zero(); }
NEON_INLINE F8 add_neon(F8 a, F8 b) { return f8_add(a, b); }
NEON_INLINE F8 broadcast_neon(const float *p) { return f8_dup(*p); }
NEON_INLINE F8 chunk_lanes_neon(const float *scales, const ChunkScales *cs, int h) {
    uint8x16x2_t eight = vld1q_u8_x2((const uint8_t *)(scales + (h ? cs->base_hi : cs->base)));
    return (F8){vreinterpretq_f32_u8(vqtbl2q_u8(eight, vld1q_u8(cs->bytes[h]))),
                vreinterpretq_f32_u8(vqtbl2q_u8(eight, vld1q_u8(cs->bytes[h] + 16)))};
}
NEON_INLINE float total_neon(F8 acc[2][2], int r) { return f8_hsum(f8_add(acc[0][r], acc[1][r])); }
#define NB_TARGET
#define NB_INLINE NEON_INLINE
#define NB_NAME(name) name##_neon
#define NB_VEC F8
#define NB_CODES Codes8
#define NB_TABLE TableNeon
#define NB_HALVES 2
#define NB_MAX_RS 2
#include "nibble_body.h"
#undef NB_TARGET
#undef NB_INLINE
#undef NB_NAME
#undef NB_VEC
#undef NB_CODES
#undef NB_TABLE
#undef NB_HALVES
#undef NB_MAX_RS
#endif

float nibble_scale(int scale_kind, const void *scales, size_t i) {
    NibbleMatrix m = {NULL, scales, CODE_INT4, scale_kind, 2, 2};
    return scale_at(&m, i);
}

/* COLIBRI_STREAM_ISA read once: 1 avx2 / neon, 2 avx512 (AVX-512 without AMX), 3 no cap. */
static int isa_env_level(void) {
    static int level = -1;
    if (level < 0) {
        const char *value = getenv("COLIBRI_STREAM_ISA");
        int lowest = value != NULL && (strcmp(value, "avx2") == 0 || strcmp(value, "neon") == 0);
        level = lowest ? 1 : value != NULL && strcmp(value, "avx512") == 0 ? 2 : 3;
    }
    return level;
}

int isa_cap(void) { return isa_env_level() < 2 ? 1 : 2; }

int isa_amx_allowed(void) { return isa_env_level() > 2; }

#if HAVE_NEON
/* Whether the CPU has the dot-product instructions (SDOT/UDOT, FEAT_DotProd; 1) and the int8 matrix ones
 * (SMMLA, FEAT_I8MM; 2), from the kernel's hardware capabilities (Linux) or sysctl (macOS). */
int arm_features(void) {
    static int found = -1;
    if (found < 0) {
#if defined(__linux__)
        unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
        found = ((hw & (1ul << 20)) ? 1 : 0) | ((hw2 & (1ul << 13)) ? 2 : 0); /* HWCAP_ASIMDDP, HWCAP2_I8MM */
#elif defined(__APPLE__)
        int dp = 0, i8mm = 0;
        size_t size = sizeof dp;
        if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &dp, &size, NULL, 0) != 0) dp = 0;
        size = sizeof i8mm;
        if (sysctlbyname("hw.optional.arm.FEAT_I8MM", &i8mm, &size, NULL, 0) != 0) i8mm = 0;
        found = (dp ? 1 : 0) | (i8mm ? 2 : 0);
#else
        found = 0;
#endif
    }
    return found;
}
#else
int arm_features(void) { return 0; }
#endif

#if HAVE_X86
/* F16C (CPUID leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know the name. */
static int x86_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

/* The loops this CPU runs at best, capped. x86: 0 none, 1 AVX2 (with FMA and F16C), 2 AVX2 and AVX-512 (F,
 * VL, BW). aarch64: 1 NEON (every such CPU), 2 NEON with dot-product (the q8 kernel's SDOT loops). */
static int simd_level(void) {
    static int level = -1;
    if (level < 0) {
#if HAVE_X86
        __builtin_cpu_init();
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && x86_f16c();
        int vl = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
        int found = avx2 ? 1 + vl : 0;
#elif HAVE_NEON
        int found = 1 + (arm_features() & 1);
#else
        int found = 0;
#endif
        level = found < isa_cap() ? found : isa_cap();
    }
    return level;
}

int nibble_simd_available(void) { return simd_level() >= 1; }

int nibble_simd_wide(void) { return simd_level() >= 2; }

void nibble_gemm(const NibbleMatrix *m, const float *xs, int rows, int begin, int end, int simd, int alone, float *y) {
#if HAVE_X86
    if (simd && simd_shape(m) && rows >= 1 && rows <= MAX_ROWS && nibble_simd_available()) {
        if (simd >= 2 && simd_level() >= 2)
            gemm_simd_avx512(m, alone, xs, rows, begin, end, y);
        else
            gemm_simd_avx2(m, alone, xs, rows, begin, end, y);
        return;
    }
#elif HAVE_NEON
    if (simd && simd_shape(m) && rows >= 1 && rows <= MAX_ROWS && nibble_simd_available()) {
        gemm_simd_neon(m, alone, xs, rows, begin, end, y);
        return;
    }
#endif
    (void)simd;
    (void)alone; /* the scalar path computes each row alone anyway */
    gemm_scalar(m, xs, rows, begin, end, y);
}

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
