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
 * A row is read in chunks of 32 bytes (64 columns). Every nibble value (int4 n - 8, fp4 e2m1) is exact
 * in bfloat16, so two 16-entry byte tables (the value's bf16 low and high byte) and two in-lane unpacks
 * turn a chunk into 8 vectors of float32 bits: no int -> float conversion, no sign fix-up, the int4
 * offset already in (no per-group sums of x). The unpacks leave the columns in a fixed permutation
 * (x_slot), which nibble_prepare gives x too; a chunk meets 1, 2 or 4 group scales at known lanes, so
 * each weight vector is scaled (one multiply) and then serves every row (one FMA per row).
 *
 * x is prepared zero-padded to whole chunks, so an odd row's padding nibble and a tail chunk's zero
 * bytes contribute nothing; a row's last, partial chunk is copied to a zeroed buffer first: nothing
 * past a row's bytes, nor past its scales, is read. Columns go in blocks whose x (all rows) fits in L1
 * while every output row of the slice passes.
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

/* Element values as engine/quant.py's code_values gives them (int4: n - 8); all exact in bfloat16. */
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

/* Where row r's column k sits in the prepared x, [chunks][rows][64] (a chunk's x for every row
 * together): in chunk k / 64, byte b = (k % 64) / 2's nibble h = k % 2 lands in weight vector
 * 4h + (b % 16) / 4, lane b % 4 + 4 (b / 16) (chunk_fma's order). */
static inline size_t x_slot(size_t k, int r, int rows) {
    size_t b = (k % CHUNK_COLS) / 2, vector = 4 * (k % 2) + (b % 16) / 4, lane = b % 4 + 4 * (b / 16);
    return ((k / CHUNK_COLS) * (size_t)rows + (size_t)r) * CHUNK_COLS + 8 * vector + lane;
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

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline

/* Floats of x (all rows) per column block: 16 KiB, half of L1, the rest for the streaming weights. */
#define BLOCK_FLOATS 4096

/* How a chunk's 64 columns meet the group scales; the kernel is instantiated per layout. Lanes 0-3
 * of every weight vector come from the chunk's first 32 columns, lanes 4-7 from its last 32. */
enum {
    ONE_GROUP,   /* group a multiple of 64, or one group per row: one scale per chunk */
    TWO_GROUPS,  /* group 32: lanes 0-3 and 4-7 have a scale each */
    FOUR_GROUPS, /* group 16: and vectors q 0-1 and 2-3 differ */
    EIGHTS,      /* any other group % 8 == 0: a scale per vector q and lane half */
    N_LAYOUTS
};

/* The layout the AVX2 path uses, or -1 (the scalar path: a group that is no multiple of 8). */
static int scale_layout(const NibbleMatrix *m) {
    if (m->group % CHUNK_COLS == 0 || nibble_groups(m) == 1) return ONE_GROUP;
    if (m->group == 32) return TWO_GROUPS;
    if (m->group == 16) return FOUR_GROUPS;
    return m->group % 8 == 0 ? EIGHTS : -1;
}

/* Chunks per column block for R rows: x of one row is read once per output row, so it may take L1
 * (the codes stream past); more rows share the block. */
#define block_chunks(R) ((R) == 1 ? 2 * BLOCK_FLOATS / CHUNK_COLS : BLOCK_FLOATS / (CHUNK_COLS * (R)))

/* The largest column block in chunks, and its groups (group >= 8 on the AVX2 path), plus one. */
#define MAX_BLOCK_CHUNKS block_chunks(1)
#define MAX_BLOCK_GROUPS (MAX_BLOCK_CHUNKS * CHUNK_COLS / 8 + 1)

/* For each chunk of the column block starting at chunk c0: the block-local group of its 8 column
 * octets, at [4 * half + q] for columns 32 half + 8 q (weight vector q's lanes 4 half..4 half+3). */
static void block_groups(const NibbleMatrix *m, size_t c0, size_t c1, uint16_t slots[][8]) {
    size_t first = c0 * CHUNK_COLS / m->group;
    for (size_t c = c0; c < c1; c++)
        for (int i = 0; i < 8; i++) slots[c - c0][i] = (uint16_t)((c * CHUNK_COLS + 32 * (i / 4) + 8 * (i % 4)) / m->group - first);
}

/* Accumulators per (output, row): enough independent FMA chains (P outputs x RS rows x ACCS) to
 * cover the FMA latency (4 cycles, 2 a cycle), few enough to stay in the 16 registers. */
#define ACCS(P, RS) ((P) * (RS) >= 8 ? 1 : (P) * (RS) >= 4 ? 2 : (P) * (RS) == 2 ? 2 : 4)

/* Whether a chunk's products are summed before its scales are applied (one FMA per accumulator
 * instead of a multiply per weight vector): where the chunk has one scale vector (group 32 or >= 64)
 * and the extra chunk accumulators fit the registers (one row of x). */
#define SCALE_AFTER(layout, P, RS) (((layout) == ONE_GROUP || (layout) == TWO_GROUPS) && (P) * (RS) <= 2)

/* Where one output row's pass over a column block reads and writes. */
typedef struct {
    const uint8_t *q; /* the row's codes */
    const float *scales; /* the block's group scales (row_scales) */
    float *y; /* y[0][o]: rows of y are n apart */
} OutRow;

/* Rows of x per unpacking of a block's weights in the batch-invariant loops (rows_alone). */
#define ALONE_ROWS 2

/* The SIMD loops once per instruction set: AVX2, and AVX2 code compiled with AVX-512VL (same bits). */
#define NB_TARGET AVX2
#define NB_INLINE AVX2_INLINE
#define NB_NAME(name) name##_avx2
#include "nibble_body.h"
#undef NB_TARGET
#undef NB_INLINE
#undef NB_NAME

#define AVX512VL __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
#define NB_TARGET AVX512VL
#define NB_INLINE AVX512VL __attribute__((always_inline)) static inline
#define NB_NAME(name) name##_avx512vl
#include "nibble_body.h"
#undef NB_TARGET
#undef NB_INLINE
#undef NB_NAME
#endif

float nibble_scale(int scale_kind, const void *scales, size_t i) {
    NibbleMatrix m = {NULL, scales, CODE_INT4, scale_kind, 2, 2};
    return scale_at(&m, i);
}

/* 0 none, 1 AVX2 (with FMA and F16C), 2 AVX2 and AVX-512VL: the loops this CPU runs at best. */
static int simd_level(void) {
#if HAVE_X86
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        int vl = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
        level = avx2 ? 1 + vl : 0;
    }
    return level;
#else
    return 0;
#endif
}

int nibble_simd_available(void) { return simd_level() >= 1; }

int nibble_simd_wide(void) { return simd_level() >= 2; }

void nibble_gemm(const NibbleMatrix *m, const float *xs, int rows, int begin, int end, int simd, int alone, float *y) {
#if HAVE_X86
    int layout = scale_layout(m);
    if (simd && layout >= 0 && rows >= 1 && rows <= MAX_ROWS && nibble_simd_available()) {
        if (simd >= 2 && simd_level() >= 2)
            gemm_simd_avx512vl(m, layout, alone, xs, rows, begin, end, y);
        else
            gemm_simd_avx2(m, layout, alone, xs, rows, begin, end, y);
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
