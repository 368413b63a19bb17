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

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_INLINE __m256 halves(const float *first, const float *second) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(first)), _mm_broadcast_ss(second), 1);
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

/* Row o's scales of groups first.. as float32 (0 past the row's last group: a tail chunk's padding
 * columns, where x is 0; no scale past the row is read). */
AVX2 static void row_scales(const NibbleMatrix *m, int o, size_t first, size_t count, float *out) {
    size_t groups = (size_t)nibble_groups(m), s0 = (size_t)o * groups, have = first + count < groups ? count : groups - first;
    switch (m->scale_kind) {
    case SCALE_F16:
        for (size_t i = 0; i < have; i++) out[i] = _cvtsh_ss(((const uint16_t *)m->scales)[s0 + first + i]);
        break;
    case SCALE_BF16:
        for (size_t i = 0; i < have; i++) out[i] = from_bits((uint32_t)((const uint16_t *)m->scales)[s0 + first + i] << 16);
        break;
    default:
        for (size_t i = 0; i < have; i++) out[i] = e8m0_to_float(((const uint8_t *)m->scales)[s0 + first + i]);
    }
    for (size_t i = have; i < count; i++) out[i] = 0.f;
}

/* sv[q]: the scales of weight vectors q and 4 + q (chunk_weights), from the row's block scales. */
AVX2_INLINE void chunk_scales(int layout, const float *scales, const uint16_t slot[8], __m256 sv[4]) {
    switch (layout) {
    case ONE_GROUP: sv[0] = _mm256_broadcast_ss(scales + slot[0]); break;
    case TWO_GROUPS: sv[0] = halves(scales + slot[0], scales + slot[4]); break;
    case FOUR_GROUPS:
        sv[0] = halves(scales + slot[0], scales + slot[4]);
        sv[1] = halves(scales + slot[2], scales + slot[6]);
        break;
    default:
        for (int q = 0; q < 4; q++) sv[q] = halves(scales + slot[q], scales + slot[4 + q]);
    }
}

/* Which sv scales weight vector v. */
AVX2_INLINE int scale_index(int layout, int v) {
    return layout == FOUR_GROUPS ? (v % 4) / 2 : layout == EIGHTS ? v % 4 : 0;
}

/* The code's 16 values as bf16 bytes: tables[0] the low byte, tables[1] the high one (both lanes). */
AVX2_INLINE void value_tables(int code, __m256i tables[2]) {
    uint8_t low[16], high[16];
    for (int n = 0; n < 16; n++) {
        uint32_t bits;
        memcpy(&bits, &VALUES[code][n], sizeof bits); /* the low 16 bits are 0: bf16-exact */
        low[n] = (uint8_t)(bits >> 16);
        high[n] = (uint8_t)(bits >> 24);
    }
    tables[0] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)low));
    tables[1] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)high));
}

/* Accumulators per (output, row): enough independent FMA chains (P outputs x RS rows x ACCS) to
 * cover the FMA latency (4 cycles, 2 a cycle), few enough to stay in the 16 registers. */
#define ACCS(P, RS) ((P) * (RS) >= 8 ? 1 : (P) * (RS) >= 4 ? 2 : (P) * (RS) == 2 ? 2 : 4)

/* Whether a chunk's products are summed before its scales are applied (one FMA per accumulator
 * instead of a multiply per weight vector): where the chunk has one scale vector (group 32 or >= 64)
 * and the extra chunk accumulators fit the registers (one row of x). */
#define SCALE_AFTER(layout, P, RS) (((layout) == ONE_GROUP || (layout) == TWO_GROUPS) && (P) * (RS) <= 2)

/* One chunk of P (1, 2) output rows times RS rows of x (xc: the chunk's x of the first, rows 64 floats
 * apart) into acc[p][r][.]. 32 packed bytes -> 64 weights as 8 float vectors w[4h + q], h the nibble
 * (0 low = even column): lanes 0-3 from bytes 4q..4q+3, lanes 4-7 from bytes 16+4q.. (x_slot's order).
 * Each vector is scaled (or the chunk's sums are, SCALE_AFTER), then meets every row before the next
 * is made (few live registers); each x load serves both output rows. */
AVX2_INLINE void chunk_fma(int P, int RS, int AR, int layout, const __m256i packed[2], const __m256i tables[2],
                           __m256 sv[2][4], const float *xc, __m256 acc[2][4][4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const int after = SCALE_AFTER(layout, P, AR), accs = ACCS(P, AR);
    __m256 sums[2][4][4]; /* SCALE_AFTER: the chunk's unscaled sums */
    __m256 (*into)[4][4] = after ? sums : acc;
    if (after)
        for (int p = 0; p < P; p++)
            for (int r = 0; r < RS; r++)
                for (int a = 0; a < accs; a++) sums[p][r][a] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i bf16[2][2]; /* [p]: bytes 0-7, 8-15 of each lane */
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(packed[p], 4) : packed[p], low4);
            __m256i lo = _mm256_shuffle_epi8(tables[0], nib), hi = _mm256_shuffle_epi8(tables[1], nib);
            bf16[p][0] = _mm256_unpacklo_epi8(lo, hi), bf16[p][1] = _mm256_unpackhi_epi8(lo, hi);
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            int v = 4 * h + q;
            __m256 w[2];
#pragma GCC unroll 2
            for (int p = 0; p < P; p++) {
                __m256i bits = q % 2 ? _mm256_unpackhi_epi16(zero, bf16[p][q / 2]) : _mm256_unpacklo_epi16(zero, bf16[p][q / 2]);
                w[p] = after ? _mm256_castsi256_ps(bits) : _mm256_mul_ps(_mm256_castsi256_ps(bits), sv[p][scale_index(layout, v)]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < RS; r++) {
                __m256 x = _mm256_loadu_ps(xc + CHUNK_COLS * r + 8 * v);
                if (P > 1) __asm__("" : "+x"(x)); /* one load for both outputs: keep gcc from folding it twice */
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) into[p][r][v % accs] = _mm256_fmadd_ps(w[p], x, into[p][r][v % accs]);
            }
        }
    }
    if (after)
        for (int p = 0; p < P; p++)
            for (int r = 0; r < RS; r++)
                for (int a = 0; a < accs; a++) acc[p][r][a] = _mm256_fmadd_ps(sums[p][r][a], sv[p][0], acc[p][r][a]);
}

/* Where one output row's pass over a column block reads and writes. */
typedef struct {
    const uint8_t *q; /* the row's codes */
    const float *scales; /* the block's group scales (row_scales) */
    float *y; /* y[0][o]: rows of y are n apart */
} OutRow;

/* y[r][o] += the column block [c0, c1) of P output rows times RS rows of x (xs: the first one's;
 * XR rows per chunk in xs). ahead (or NULL): the next two rows' codes for their block, asked for one
 * line per chunk: a column block reads a row in pieces, which the hardware prefetchers follow less
 * well than one stream, and spreading the requests keeps them from stalling the loop. */
AVX2_INLINE void block_dot(int P, int RS, int AR, int XR, int layout, const NibbleMatrix *m, const __m256i tables[2],
                           const OutRow out[2], const uint8_t *const *ahead, const uint16_t slots[][8], size_t c0,
                           size_t c1, const float *xs, size_t n) {
    size_t row_bytes = nibble_row_bytes(m), full = row_bytes / CHUNK_BYTES, c1_full = c1 < full ? c1 : full;
    __m256 acc[2][4][4], sv[2][4];
    __m256i packed[2];
#pragma GCC unroll 2
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RS; r++)
            for (int a = 0; a < ACCS(P, AR); a++) acc[p][r][a] = _mm256_setzero_ps();
    for (size_t c = c0; c < c1_full; c++) {
        if (ahead) _mm_prefetch((const char *)ahead[(c - c0) % 2] + (c - c0) / 2 * 64, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            packed[p] = _mm256_loadu_si256((const __m256i *)(out[p].q + c * CHUNK_BYTES));
            chunk_scales(layout, out[p].scales, slots[c - c0], sv[p]);
        }
        chunk_fma(P, RS, AR, layout, packed, tables, sv, xs + c * XR * CHUNK_COLS, acc);
    }
    if (c1 > c1_full) { /* the rows' last bytes, zero-padded to a chunk */
        uint8_t tail[2][CHUNK_BYTES] = {{0}};
        for (int p = 0; p < P; p++) {
            memcpy(tail[p], out[p].q + full * CHUNK_BYTES, row_bytes - full * CHUNK_BYTES);
            packed[p] = _mm256_loadu_si256((const __m256i *)tail[p]);
            chunk_scales(layout, out[p].scales, slots[full - c0], sv[p]);
        }
        chunk_fma(P, RS, AR, layout, packed, tables, sv, xs + full * XR * CHUNK_COLS, acc);
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RS; r++) {
            __m256 sum = acc[p][r][0];
            for (int a = 1; a < ACCS(P, AR); a++) sum = _mm256_add_ps(sum, acc[p][r][a]);
            out[p].y[r * n] += hsum8(sum);
        }
}

/* P output rows: rows of x 4 at a time (the accumulators' register budget); the second pass reads
 * the block's codes again from L1. */
AVX2_INLINE void block_rows(int P, int R, int layout, const NibbleMatrix *m, const __m256i tables[2],
                            const OutRow out[2], const uint8_t *ahead[2], const uint16_t slots[][8], size_t c0,
                            size_t c1, const float *xs, size_t n) {
    if (R <= 4) {
        block_dot(P, R, R, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
        return;
    }
    OutRow rest[2] = {{out[0].q, out[0].scales, out[0].y + 4 * n}, {out[1].q, out[1].scales, out[1].y + 4 * n}};
    block_dot(P, 4, 4, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
    block_dot(P, R - 4, R - 4, R, layout, m, tables, rest, NULL, slots, c0, c1, xs + 4 * CHUNK_COLS, n);
}

/* Batch-invariant: each of the R rows of x accumulates exactly as a one-row call does (AR = 1: its
 * accumulators, scaling and the one-row column blocks), so a row's result does not depend on which other
 * rows share the call. Rows go ALONE_ROWS at a time through one unpacking of the block's weights (more
 * rows per unpacking spill the accumulators: measured slower at 4 rows). */
#define ALONE_ROWS 2
#define ALONE_DOT(P, RS) block_dot(P, RS, 1, R, layout, m, tables, row, next, slots, c0, c1, xr, n)
AVX2_INLINE void rows_alone(int P, int R, int layout, const NibbleMatrix *m, const __m256i tables[2],
                            const OutRow out[2], const uint8_t *ahead[2], const uint16_t slots[][8], size_t c0,
                            size_t c1, const float *xs, size_t n) {
    for (int r = 0; r < R; r += ALONE_ROWS) {
        OutRow row[2] = {{out[0].q, out[0].scales, out[0].y + r * n}, {out[1].q, out[1].scales, out[1].y + r * n}};
        const float *xr = xs + r * CHUNK_COLS;
        const uint8_t *const *next = r ? NULL : ahead;
        switch ((R - r < ALONE_ROWS ? R - r : ALONE_ROWS) + 2 * (P - 1)) {
        case 1: ALONE_DOT(1, 1); break;
        case 2: ALONE_DOT(1, 2); break;
        case 3: ALONE_DOT(2, 1); break;
        default: ALONE_DOT(2, 2); break;
        }
    }
}
#undef ALONE_DOT

/* R rows (a constant after inlining) times output rows [begin, end): column block by column block,
 * two output rows at a time; ``alone``: batch-invariant (rows_alone). */
AVX2_INLINE void rows_avx2(int R, int alone, int layout, const NibbleMatrix *m, const float *xs, int begin, int end,
                           float *y) {
    size_t row_bytes = nibble_row_bytes(m), chunks = nibble_chunks(m), n = (size_t)(end - begin);
    size_t block = alone ? block_chunks(1) : block_chunks(R);
    __m256i tables[2];
    uint16_t slots[MAX_BLOCK_CHUNKS][8];
    float scales[2][MAX_BLOCK_GROUPS];
    value_tables(m->code, tables);
    for (int r = 0; r < R; r++) memset(y + (size_t)r * n, 0, n * sizeof *y);
    for (size_t c0 = 0; c0 < chunks; c0 += block) {
        size_t c1 = c0 + block < chunks ? c0 + block : chunks;
        size_t first_group = c0 * CHUNK_COLS / m->group, n_groups = ((c1 * CHUNK_COLS - 1) / m->group) - first_group + 1;
        block_groups(m, c0, c1, slots);
        for (int o = begin; o < end; o += 2) {
            int pair = o + 1 < end;
            OutRow out[2];
            /* the next pair's codes for this block, or the first pair's for the next block */
            int next = o + 2 < end ? o + 2 : begin;
            size_t from = (o + 2 < end ? c0 : c1) * CHUNK_BYTES;
            const uint8_t *ahead[2] = {m->q + (size_t)next * row_bytes + from,
                                       m->q + (size_t)(next + 1 < end ? next + 1 : next) * row_bytes + from};
            for (int p = 0; p <= pair; p++) {
                row_scales(m, o + p, first_group, n_groups, scales[p]);
                out[p] = (OutRow){m->q + (size_t)(o + p) * row_bytes, scales[p], y + (o + p - begin)};
            }
            if (o + 2 >= end && c1 >= chunks) ahead[0] = ahead[1] = NULL; /* the slice's last pass */
            if (alone) rows_alone(pair + 1, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
            else if (pair) block_rows(2, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
            else block_rows(1, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
        }
    }
}

/* One instantiation per layout and row count (1..MAX_ROWS). */
AVX2_INLINE void layout_rows(int layout, int alone, const NibbleMatrix *m, const float *xs, int rows, int begin,
                             int end, float *y) {
    if (alone && rows > 1) {
        switch (rows) {
        case 2: rows_avx2(2, 1, layout, m, xs, begin, end, y); break;
        case 3: rows_avx2(3, 1, layout, m, xs, begin, end, y); break;
        case 4: rows_avx2(4, 1, layout, m, xs, begin, end, y); break;
        case 5: rows_avx2(5, 1, layout, m, xs, begin, end, y); break;
        case 6: rows_avx2(6, 1, layout, m, xs, begin, end, y); break;
        case 7: rows_avx2(7, 1, layout, m, xs, begin, end, y); break;
        default: rows_avx2(8, 1, layout, m, xs, begin, end, y); break;
        }
        return;
    }
    switch (rows) {
    case 1: rows_avx2(1, 0, layout, m, xs, begin, end, y); break;
    case 2: rows_avx2(2, 0, layout, m, xs, begin, end, y); break;
    case 3: rows_avx2(3, 0, layout, m, xs, begin, end, y); break;
    case 4: rows_avx2(4, 0, layout, m, xs, begin, end, y); break;
    case 5: rows_avx2(5, 0, layout, m, xs, begin, end, y); break;
    case 6: rows_avx2(6, 0, layout, m, xs, begin, end, y); break;
    case 7: rows_avx2(7, 0, layout, m, xs, begin, end, y); break;
    default: rows_avx2(8, 0, layout, m, xs, begin, end, y); break;
    }
}

AVX2 static void gemm_simd(const NibbleMatrix *m, int layout, int alone, const float *xs, int rows, int begin, int end,
                           float *y) {
    switch (layout) {
    case ONE_GROUP: layout_rows(ONE_GROUP, alone, m, xs, rows, begin, end, y); break;
    case TWO_GROUPS: layout_rows(TWO_GROUPS, alone, m, xs, rows, begin, end, y); break;
    case FOUR_GROUPS: layout_rows(FOUR_GROUPS, alone, m, xs, rows, begin, end, y); break;
    default: layout_rows(EIGHTS, alone, m, xs, rows, begin, end, y); break;
    }
}
#endif

float nibble_scale(int scale_kind, const void *scales, size_t i) {
    NibbleMatrix m = {NULL, scales, CODE_INT4, scale_kind, 2, 2};
    return scale_at(&m, i);
}

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

void nibble_gemm(const NibbleMatrix *m, const float *xs, int rows, int begin, int end, int simd, int alone, float *y) {
#if HAVE_X86
    int layout = scale_layout(m);
    if (simd && layout >= 0 && rows >= 1 && rows <= MAX_ROWS && nibble_simd_available()) {
        gemm_simd(m, layout, alone, xs, rows, begin, end, y);
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
