/*
 * A prompt's rows as tile GEMMs (q8_tiles.h has the numbers). q8_gemm puts a row's columns across the vector
 * lanes, so every 8 columns cost a conversion, a multiply and a multiply-add per (row, output row) pair beside
 * two dot products: on a VNNI host it runs at about a third of oneDNN's int8 GEMM. Here the lanes are 16
 * output rows: a chunk's codes of those 16 rows are loaded and transposed into 8 (int4: 16 after splitting the
 * nibbles) or 16 (int8) vectors once, and every row of x meets them with 16 dpbusd, each taking 4 bytes of the
 * row broadcast: a block's 32 products are one integer sum per lane, then one conversion and one multiply-add.
 *
 * dpbusd multiplies unsigned weight bytes by signed x bytes: int4 codes are the unsigned n (value n - 8) and
 * int8 codes go in as w + 128 (w xor 0x80), so a block's dot is the stored bytes' dot minus 8 or 128 times the
 * block's sum of xq, which q8_prepare keeps per block (-8 sum xq; int8: times 16). Exact either way.
 */
#include "q8_tiles.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nibble.h"
#include "q8_layout.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_X86 1
#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for an extended state component (Linux 5.16+) */
#define XFEATURE_XTILEDATA 18
#else
#define HAVE_X86 0
#endif

/* Rows of x per pass over a tile: their slots of a chunk stay in L1 while the tile's codes of the chunk are
 * transposed once for all of them; the float sums of a pass, [TILE_ROWS][16], 4 KB. */
#define TILE_ROWS 64

/* The scale block b of row o is multiplied by: its group's, 0 past the row's columns. */
static inline float block_scale(const Q8Matrix *m, int o, int b) {
    int first = b * Q8_BLOCK;
    return first < m->in ? scale_of(m, o, first / m->group) : 0.f;
}

/* The numbers of q8_tiles.h one product at a time: the reference every vector path gives the bytes of. */
static void tiles_scalar(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
    for (int o = begin; o < end; o++)
        for (int r = 0; r < x->rows; r++) {
            float acc = 0.f;
            for (int b = 0; b < 2 * x->chunks; b++) {
                const uint8_t *s = slot(x, r, b / 2);
                int first = b * Q8_BLOCK, dot = 0;
                for (int k = first; k < first + Q8_BLOCK && k < m->in; k++)
                    dot += weight_at(m, o, k) * ((const int8_t *)s)[x_position(m->kind, k % Q8_CHUNK)];
                float d = ((const float *)(s + SLOT_SCALES))[4 * (b % 2)];
                acc = fmaf((float)dot, d * block_scale(m, o, b), acc);
            }
            y[(size_t)r * ldy + (o - begin)] = acc;
        }
}

#if HAVE_X86
#define TILES_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define TILES_INLINE TILES_VNNI __attribute__((always_inline)) static inline
#define TILES_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

/* Row o's codes of chunk c (row-major: step bytes from c * step; interleaved: its place in the span). */
static inline const uint8_t *chunk_codes(const Q8Matrix *m, int o, int c) {
    size_t step = chunk_step_bytes(m->kind);
    if (m->interleaved)
        return span_at(m, o, c * Q8_CHUNK / Q8_SPAN) + (size_t)(4 * (c % (Q8_SPAN / Q8_CHUNK)) + o % 4) * step;
    return (const uint8_t *)m->w + (size_t)o * row_code_bytes(m->kind, m->in) + (size_t)c * step;
}

/* Where weight vector j meets x in a slot, and its block. int4: j < 8 the low nibbles of dword j (columns 8j,
 * 8j + 2, .., x's even half), j >= 8 the high ones (the odd half); int8: dword j, columns 4j..4j + 3. */
TILES_INLINE int x_offset(int kind, int j) {
    return kind == Q8_WEIGHTS_INT4 ? (j < 8 ? 4 * j : 32 + 4 * (j - 8)) : x_position(kind, 4 * j);
}
TILES_INLINE int block_of(int kind, int j) { return kind == Q8_WEIGHTS_INT4 ? j % 8 / 4 : j / 8; }

/* One chunk of a tile (w: its 16 weight vectors, sv: its two blocks' scales per lane) times R rows of x from r:
 * facc[row - r0] += the chunk's blocks in order, each fma(float(dot), d * s). R rows at once: one dpbusd chain
 * per row and block, 2R chains in flight (one row's two chains leave the VNNI unit waiting on their latency). */
TILES_INLINE void rows_step(int kind, int R, const __m512i w[16], __m512 sv0, __m512 sv1, const Q8Rows *x, int c, int r,
                            int r0, float *facc) {
    int scale = kind == Q8_WEIGHTS_INT4 ? 1 : 16;
    const uint8_t *s[4];
    __m512i dot[4][2];
#pragma GCC unroll 4
    for (int q = 0; q < R; q++) {
        s[q] = slot(x, r + q, c);
        const int32_t *offsets = (const int32_t *)(s[q] + SLOT_OFFSETS);
        dot[q][0] = _mm512_set1_epi32(offsets[0] * scale), dot[q][1] = _mm512_set1_epi32(offsets[4] * scale);
    }
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
#pragma GCC unroll 4
        for (int q = 0; q < R; q++) {
            __m512i xj = _mm512_set1_epi32(*(const int32_t *)(s[q] + x_offset(kind, j)));
            dot[q][block_of(kind, j)] = _mm512_dpbusd_epi32(dot[q][block_of(kind, j)], w[j], xj);
        }
#pragma GCC unroll 4
    for (int q = 0; q < R; q++) {
        const float *d = (const float *)(s[q] + SLOT_SCALES);
        float *f = facc + (size_t)(r + q - r0) * Q8_TILE_OUTS;
        __m512 acc = _mm512_loadu_ps(f);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[q][0]), _mm512_mul_ps(_mm512_set1_ps(d[0]), sv0), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[q][1]), _mm512_mul_ps(_mm512_set1_ps(d[4]), sv1), acc);
        _mm512_storeu_ps(f, acc);
    }
}

/* rows_step over rows [r0, r1), 4 at a time. */
TILES_INLINE void chunk_rows(int kind, const __m512i w[16], __m512 sv0, __m512 sv1, const Q8Rows *x, int c, int r0,
                             int r1, float *facc) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) rows_step(kind, 4, w, sv0, sv1, x, c, r, r0, facc);
    switch (r1 - r) { /* constant R: the loops above unroll into registers */
    case 3: rows_step(kind, 3, w, sv0, sv1, x, c, r, r0, facc); break;
    case 2: rows_step(kind, 2, w, sv0, sv1, x, c, r, r0, facc); break;
    case 1: rows_step(kind, 1, w, sv0, sv1, x, c, r, r0, facc); break;
    }
}

/* The tile's lanes after transpose8: lane p holds output row lane_row(p) of the tile (bits of p: r0 r3 r2 r1). */
static inline int lane_row(int p) { return (p & 7) << 1 | p >> 3; }

/* The index vectors of transpose8's three exchanges: swap[bit][0] and [1] the first and the second vector's. */
typedef struct {
    __m512i swap[3][2];
} Exchanges;

TILES_VNNI static Exchanges exchanges(void) {
    Exchanges e;
    for (int bit = 0; bit < 3; bit++) {
        int32_t first[16], second[16];
        for (int p = 0; p < 16; p++) { /* bit clear: keep the first vector's element; set: take the second's */
            int set = p >> bit & 1, partner = p ^ 1 << bit;
            first[p] = set ? 16 + partner : p, second[p] = set ? 16 + p : partner;
        }
        e.swap[bit][0] = _mm512_loadu_si512(first), e.swap[bit][1] = _mm512_loadu_si512(second);
    }
    return e;
}

/* Vectors v[a] and v[a | 1 << bit] exchange vector-index bit `bit` with lane bit `bit`. */
TILES_INLINE void swap_bit(const Exchanges *e, int bit, __m512i v[8]) {
#pragma GCC unroll 8
    for (int a = 0; a < 8; a++) {
        if (a >> bit & 1) continue;
        __m512i first = v[a], second = v[a | 1 << bit];
        v[a] = _mm512_permutex2var_epi32(first, e->swap[bit][0], second);
        v[a | 1 << bit] = _mm512_permutex2var_epi32(first, e->swap[bit][1], second);
    }
}

/* 8 dwords from `at` of each of 16 rows (row i's bytes at rows[i]) -> v[d]: dword d of every row, lane p holding
 * row lane_row(p). Loaded in pairs [row 2k | row 2k + 1] (lane bits: r0 d2 d1 d0, vector bits r3 r2 r1), then three
 * exchanges move d into the vector index and r3 r2 r1 into the lane. */
TILES_INLINE void transpose8(const Exchanges *e, const uint8_t *const rows[16], size_t at, __m512i v[8]) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(rows[2 * k] + at));
        __m256i b = _mm256_loadu_si256((const __m256i *)(rows[2 * k + 1] + at));
        v[k] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    }
    for (int bit = 2; bit >= 0; bit--) swap_bit(e, bit, v);
}

/* A chunk's codes of the tile's rows (rows[i]: row i's codes of the chunk, zeros past the tile's last row) as the 16
 * weight vectors rows_step takes. */
TILES_INLINE void load_chunk(int kind, const Exchanges *e, const uint8_t *const rows[16], __m512i w[16]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512i v[16];
    transpose8(e, rows, 0, v);
    if (kind == Q8_WEIGHTS_INT8) transpose8(e, rows, 32, v + 8); /* int8: 16 dwords a row */
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) {
        if (kind == Q8_WEIGHTS_INT4 && l == 8) break; /* int4: 8 dwords, two vectors each */
        if (kind == Q8_WEIGHTS_INT4) {
            w[l] = _mm512_and_si512(v[l], low4);
            w[8 + l] = _mm512_and_si512(_mm512_srli_epi32(v[l], 4), low4);
        } else {
            w[l] = _mm512_xor_si512(v[l], flip);
        }
    }
}

/* Where a tile's codes are: each of its P rows' chunk c at the first row's plus offsets[i] (the same for every
 * chunk), zeros past P; a row-major row's last, partial chunk copied zeroed into tail (nothing past a row read). */
typedef struct {
    int P, full; /* rows of the tile, chunks read in place */
    size_t step, row_bytes;
    ptrdiff_t offsets[Q8_TILE_OUTS];
    const uint8_t *rows[Q8_TILE_OUTS], *tails[Q8_TILE_OUTS];
    uint8_t tail[Q8_TILE_OUTS * 64];
} TileCodes;

static void tile_codes_init(TileCodes *t, int kind, const Q8Matrix *m, const Q8Rows *x, int o0, int P) {
    static const uint8_t zeros[64] = {0}; /* the codes of rows past the tile's last */
    t->P = P, t->step = chunk_step_bytes(kind), t->row_bytes = row_code_bytes(kind, m->in);
    t->full = m->interleaved ? x->chunks : (int)(t->row_bytes / t->step);
    const uint8_t *first = chunk_codes(m, o0, 0);
    for (int i = 0; i < Q8_TILE_OUTS; i++) t->offsets[i] = i < P ? chunk_codes(m, o0 + i, 0) - first : 0;
    for (int i = 0; i < Q8_TILE_OUTS; i++) t->tails[i] = i < P ? t->tail + 64 * i : zeros, t->rows[i] = zeros;
}

/* Chunk c's codes of the tile [o0, o0 + P) as rows_step's 16 weight vectors. */
TILES_INLINE void tile_chunk(int kind, TileCodes *t, const Exchanges *e, const Q8Matrix *m, int o0, int c,
                             __m512i w[16]) {
    if (c < t->full) {
        const uint8_t *codes = chunk_codes(m, o0, c);
        for (int i = 0; i < t->P; i++) t->rows[i] = codes + t->offsets[i];
        load_chunk(kind, e, t->rows, w);
    } else {
        memset(t->tail, 0, sizeof t->tail);
        for (int i = 0; i < t->P; i++)
            memcpy(t->tail + 64 * i, chunk_codes(m, o0 + i, c), t->row_bytes - (size_t)c * t->step);
        load_chunk(kind, e, t->tails, w);
    }
}

/* The scales block b of the tile's rows is multiplied by (sv: tile_scales'): its group's row, zeros past in. */
static inline const float *block_scales(const Q8Matrix *m, const float *sv, int b) {
    int first = b * Q8_BLOCK, groups = (m->in + m->group - 1) / m->group;
    return sv + (size_t)(first < m->in ? first / m->group : groups) * Q8_TILE_OUTS;
}

/* The tile of output rows [o0, o0 + P) times rows [r0, r1) of x into y. sv: the tile's group scales [groups + 1][16],
 * the last row zeros (a block past the row's columns). */
TILES_INLINE void tile_vnni(int kind, const Q8Matrix *m, const Q8Rows *x, int o0, int P, const float *sv, int r0,
                            int r1, float *y, size_t ldy, int begin) {
    const Exchanges e = exchanges();
    TileCodes codes;
    tile_codes_init(&codes, kind, m, x, o0, P);
    float facc[TILE_ROWS * Q8_TILE_OUTS];
    memset(facc, 0, sizeof(float) * (size_t)(r1 - r0) * Q8_TILE_OUTS);
    __m512i w[16];
    for (int c = 0; c < x->chunks; c++) {
        tile_chunk(kind, &codes, &e, m, o0, c, w);
        __m512 s0 = _mm512_loadu_ps(block_scales(m, sv, 2 * c)), s1 = _mm512_loadu_ps(block_scales(m, sv, 2 * c + 1));
        chunk_rows(kind, w, s0, s1, x, c, r0, r1, facc);
    }
    for (int r = r0; r < r1; r++)
        for (int p = 0; p < Q8_TILE_OUTS; p++)
            if (lane_row(p) < P) y[(size_t)r * ldy + (o0 + lane_row(p) - begin)] = facc[(r - r0) * Q8_TILE_OUTS + p];
}

/* Row o's group scales as floats (out [groups + 8]): an interleaved matrix's f16 scales 8 at a time, a row-major
 * matrix's as q8_gemm reads them (q8_row_scales), the rest one by one. */
TILES_VNNI static void group_scales(const Q8Matrix *m, int o, int groups, float *out) {
    int per = Q8_SPAN / m->group;
    if (!m->interleaved) {
        q8_row_scales(m, o, groups, out);
    } else if (m->scale_kind == SCALE_F16 && per == 8) {
        for (int s = 0; s < groups / per; s++) {
            const uint16_t *h = (const uint16_t *)(span_at(m, o, s) + span_code_bytes(m->kind)) + (size_t)(o % 4) * per;
            _mm256_storeu_ps(out + per * s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
        }
    } else {
        for (int g = 0; g < groups; g++) out[g] = scale_of(m, o, g);
    }
}

/* The group scales of output rows [o0, o0 + P) as the tile reads them: sv [groups + 1][16] (lanes as lane_row),
 * zeros past P and in the last row. row: groups + 8 floats of room. */
TILES_VNNI static void tile_scales(const Q8Matrix *m, int o0, int P, int groups, float *row, float *sv) {
    memset(sv, 0, sizeof(float) * (size_t)(groups + 1) * Q8_TILE_OUTS);
    int lane_of[Q8_TILE_OUTS];
    for (int p = 0; p < Q8_TILE_OUTS; p++) lane_of[lane_row(p)] = p;
    for (int i = 0; i < P; i++) {
        group_scales(m, o0 + i, groups, row);
        for (int g = 0; g < groups; g++) sv[(size_t)g * Q8_TILE_OUTS + lane_of[i]] = row[g];
    }
}

/* Output rows [begin, end) a tile at a time, each tile's scales read once and its codes once per TILE_ROWS rows. */
TILES_VNNI static void tiles_vnni(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *work, float *y,
                                  size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group;
    float *sv = work, *row = work + (size_t)(groups + 1) * Q8_TILE_OUTS;
    for (int o0 = begin; o0 < end; o0 += Q8_TILE_OUTS) {
        int P = end - o0 < Q8_TILE_OUTS ? end - o0 : Q8_TILE_OUTS;
        tile_scales(m, o0, P, groups, row, sv);
        for (int r0 = 0; r0 < x->rows; r0 += TILE_ROWS) {
            int r1 = x->rows - r0 < TILE_ROWS ? x->rows : r0 + TILE_ROWS;
            if (m->kind == Q8_WEIGHTS_INT4)
                tile_vnni(Q8_WEIGHTS_INT4, m, x, o0, P, sv, r0, r1, y, ldy, begin);
            else
                tile_vnni(Q8_WEIGHTS_INT8, m, x, o0, P, sv, r0, r1, y, ldy, begin);
        }
    }
}
/* ---------------------------------------------------------------- AMX: the same numbers, a block as one tile product
 *
 * TDPBSSD multiplies a tile of 16 rows of x (A: 16 x 32 signed bytes, a block's columns) by the block's weights of
 * the 16 output rows (B: 8 x 64 bytes, 4 columns of each output row per dword, lanes as lane_row: the vectors
 * load_chunk makes, made signed), giving C [16 rows of x][16 lanes] int32: each the block's exact dot, the same
 * integer as the dpbusd chains' (which add the -8 / -128 sum xq corrections to unsigned codes). Each C row is then
 * one conversion and one multiply-add by d * s, in block order, as in rows_step. A block's A row is the prepared
 * slot's two 16-byte pieces of its columns (q8_layout.h x_position): slot[16h, 16h + 16) and slot[32 + 16h, ..);
 * x is copied so once per call. */
/* Tiles (literal numbers: the intrinsics paste them into the instructions): 0 and 1 C (a chunk's two blocks, so one
 * block's product overlaps the other's conversion), 2 A, 3 B. */
#define AMX_BLOCK_BYTES 512 /* an A tile (16 x 32) or a B tile (8 x 64) */
/* Fewer rows take the AVX-512 path: a call packs x and every tile's weights, and a group of 16 rows costs as much
 * however few are real (tools/bench_q8_tiles.py, int4 1024 x 2048, 2 threads, the Sapphire Rapids host, under
 * load: 4 rows 43 vs 87 GMAC/s, 16 rows 161 vs 178; idle: 64 rows 236 vs 226, 256 rows 295 vs 252). */
#define AMX_MIN_ROWS 64

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_permitted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return 0; /* AMX-TILE, -INT8 */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; /* Linux grants the state */
}

/* x rows [16 g, 16 g + 16) as A tiles, block after block ([groups of 16][blocks][16][32]), and their block scales
 * ([..][blocks][16]); rows past x's are zeros. A chunk's 64 bytes are its pieces 0 2 | 1 3 once the 16-byte pieces
 * are reordered: block 0's A row, then block 1's. */
TILES_AMX static void amx_pack_x(const Q8Rows *x, int8_t *xa, float *xd) {
    int blocks = 2 * x->chunks, row_groups = (x->rows + 15) / 16, last = x->rows % 16;
    const __m512i pieces = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    if (last != 0) /* the last group's rows past x: zero products */
        for (int b = 0; b < blocks; b++) {
            size_t at = (size_t)(row_groups - 1) * blocks + (size_t)b;
            memset(xa + at * AMX_BLOCK_BYTES + (size_t)last * 32, 0, (size_t)(16 - last) * 32);
            memset(xd + at * 16 + last, 0, sizeof(float) * (size_t)(16 - last));
        }
    for (int r = 0; r < x->rows; r++) {
        size_t first = (size_t)(r / 16) * blocks;
        for (int c = 0; c < x->chunks; c++) {
            const uint8_t *s = slot(x, r, c);
            __m512i both = _mm512_permutexvar_epi64(pieces, _mm512_loadu_si512(s));
            int8_t *a0 = xa + (first + 2 * (size_t)c) * AMX_BLOCK_BYTES + (size_t)(r % 16) * 32;
            _mm256_storeu_si256((__m256i *)a0, _mm512_castsi512_si256(both));
            _mm256_storeu_si256((__m256i *)(a0 + AMX_BLOCK_BYTES), _mm512_extracti64x4_epi64(both, 1));
            const float *d = (const float *)(s + SLOT_SCALES);
            xd[(first + 2 * (size_t)c) * 16 + (size_t)(r % 16)] = d[0];
            xd[(first + 2 * (size_t)c + 1) * 16 + (size_t)(r % 16)] = d[4];
        }
    }
}

/* The tile's weights of every block as B tiles ([blocks][8][64], signed): int4 block h is vectors 4h.. 4h + 3 (even
 * columns) and 8 + 4h.. (odd), each n - 8; int8 block h is vectors 8h.. 8h + 7 as stored (w xor 0x80 undone). */
TILES_AMX static inline __attribute__((always_inline)) void amx_pack_weights(int kind, const Q8Matrix *m,
                                                                             const Q8Rows *x, int o0, int P, int8_t *wb) {
    const Exchanges e = exchanges();
    TileCodes codes;
    tile_codes_init(&codes, kind, m, x, o0, P);
    __m512i w[16];
    for (int c = 0; c < x->chunks; c++) {
        tile_chunk(kind, &codes, &e, m, o0, c, w);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 8; k++) {
                int j = kind == Q8_WEIGHTS_INT4 ? (k < 4 ? 4 * h + k : 8 + 4 * h + k - 4) : 8 * h + k;
                __m512i v = kind == Q8_WEIGHTS_INT4 ? _mm512_sub_epi8(w[j], _mm512_set1_epi8(8))
                                                    : _mm512_xor_si512(w[j], _mm512_set1_epi8((char)0x80));
                _mm512_storeu_si512(wb + (size_t)(2 * c + h) * AMX_BLOCK_BYTES + 64 * k, v);
            }
    }
}

/* One block's conversion: acc[r] = fma(float(C[r]), d[r] * s, acc[r]) for the 16 rows. */
TILES_AMX static inline void amx_accumulate(const int32_t *dots, const float *d, __m512 s, __m512 acc[16]) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(dots + 16 * r)),
                                 _mm512_mul_ps(_mm512_set1_ps(d[r]), s), acc[r]);
}

/* Rows [16 g, 16 g + R) of x times the packed tile [o0, o0 + P) into y. */
TILES_AMX static void amx_rows(const Q8Matrix *m, int blocks, const int8_t *xa, const float *xd, const int8_t *wb,
                               const float *sv, int R, int o0, int P, float *y, size_t ldy) {
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    int32_t dots[2][256] __attribute__((aligned(64)));
    for (int b = 0; b < blocks; b += 2) { /* blocks come in pairs (a chunk's two) */
        _tile_zero(0);
        _tile_loadd(2, xa + (size_t)b * AMX_BLOCK_BYTES, 32);
        _tile_loadd(3, wb + (size_t)b * AMX_BLOCK_BYTES, 64);
        _tile_dpbssd(0, 2, 3);
        _tile_zero(1);
        _tile_loadd(2, xa + (size_t)(b + 1) * AMX_BLOCK_BYTES, 32);
        _tile_loadd(3, wb + (size_t)(b + 1) * AMX_BLOCK_BYTES, 64);
        _tile_dpbssd(1, 2, 3);
        _tile_stored(0, dots[0], 64);
        amx_accumulate(dots[0], xd + (size_t)b * 16, _mm512_loadu_ps(block_scales(m, sv, b)), acc);
        _tile_stored(1, dots[1], 64);
        amx_accumulate(dots[1], xd + (size_t)(b + 1) * 16, _mm512_loadu_ps(block_scales(m, sv, b + 1)), acc);
    }
    float out[16][16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
    for (int r = 0; r < R; r++)
        for (int p = 0; p < Q8_TILE_OUTS; p++)
            if (lane_row(p) < P) y[(size_t)r * ldy + (o0 + lane_row(p))] = out[r][p];
}

/* tiles_vnni's product on the AMX unit. work: tiles_vnni's scales, then xa, xd and wb (amx_work_bytes). */
TILES_AMX static void tiles_amx(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *work, float *y,
                                size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group, blocks = 2 * x->chunks, row_groups = (x->rows + 15) / 16;
    float *sv = work, *row = work + (size_t)(groups + 1) * Q8_TILE_OUTS;
    int8_t *xa = (int8_t *)(row + groups + 8 + 16); /* 64-byte aligned: see amx_work_bytes */
    xa += (64 - (uintptr_t)xa % 64) % 64;
    float *xd = (float *)(xa + (size_t)row_groups * blocks * AMX_BLOCK_BYTES);
    int8_t *wb = (int8_t *)(xd + (size_t)row_groups * blocks * 16);
    amx_pack_x(x, xa, xd);
    TileConfig config = {.palette = 1};
    config.rows[0] = config.rows[1] = config.rows[2] = 16, config.rows[3] = 8;
    config.colsb[0] = config.colsb[1] = config.colsb[3] = 64, config.colsb[2] = 32;
    _tile_loadconfig(&config);
    for (int o0 = begin; o0 < end; o0 += Q8_TILE_OUTS) {
        int P = end - o0 < Q8_TILE_OUTS ? end - o0 : Q8_TILE_OUTS;
        tile_scales(m, o0, P, groups, row, sv);
        if (m->kind == Q8_WEIGHTS_INT4) /* a constant kind: load_chunk's loops unroll */
            amx_pack_weights(Q8_WEIGHTS_INT4, m, x, o0, P, wb);
        else
            amx_pack_weights(Q8_WEIGHTS_INT8, m, x, o0, P, wb);
        for (int g = 0; g < row_groups; g++) {
            int R = x->rows - 16 * g < 16 ? x->rows - 16 * g : 16;
            amx_rows(m, blocks, xa + (size_t)g * blocks * AMX_BLOCK_BYTES, xd + (size_t)g * blocks * 16, wb, sv, R,
                     o0 - begin, P, y + (size_t)(16 * g) * ldy, ldy);
        }
    }
    _tile_release();
}

static size_t amx_work_bytes(const Q8Matrix *m, const Q8Rows *x) {
    size_t groups = (size_t)(m->in + m->group - 1) / (size_t)m->group, blocks = 2 * (size_t)x->chunks;
    size_t row_groups = ((size_t)x->rows + 15) / 16;
    return sizeof(float) * ((groups + 1) * Q8_TILE_OUTS + groups + 8 + 16) + 64 +
           row_groups * blocks * (AMX_BLOCK_BYTES + 16 * sizeof(float)) + blocks * AMX_BLOCK_BYTES;
}
#endif

int q8_amx_available(void) {
#if HAVE_X86
    static int known = -1;
    if (known < 0) known = q8_tiles_fast() && isa_amx_allowed() && amx_permitted();
    return known;
#else
    return 0;
#endif
}

int q8_tiles_fast(void) {
#if HAVE_X86
    return q8_vnni_available() && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

void q8_tiles_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy) {
#if HAVE_X86
    if (isa >= Q8_ISA_AMX && q8_amx_available() && x->rows >= AMX_MIN_ROWS && end > begin) {
        float *work = malloc(amx_work_bytes(m, x));
        if (work != NULL) {
            tiles_amx(m, x, begin, end, work, y, ldy);
            free(work);
            return;
        }
    }
    if (isa >= Q8_ISA_VNNI && q8_tiles_fast() && x->rows > 0 && end > begin) {
        int groups = (m->in + m->group - 1) / m->group;
        float *work = malloc(sizeof(float) * ((size_t)(groups + 1) * Q8_TILE_OUTS + (size_t)groups + 8));
        if (work != NULL) {
            tiles_vnni(m, x, begin, end, work, y, ldy);
            free(work);
            return;
        }
    }
#endif
    (void)isa;
    tiles_scalar(m, x, begin, end, y, ldy);
}
