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
#include <immintrin.h>
#define HAVE_X86 1
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

/* The tile of output rows [o0, o0 + P) times rows [r0, r1) of x into y. sv: the tile's group scales [groups + 1][16],
 * the last row zeros (a block past the row's columns). */
TILES_INLINE void tile_vnni(int kind, const Q8Matrix *m, const Q8Rows *x, int o0, int P, const float *sv, int r0,
                            int r1, float *y, size_t ldy, int begin) {
    int groups = (m->in + m->group - 1) / m->group;
    size_t step = chunk_step_bytes(kind), row_bytes = row_code_bytes(kind, m->in);
    int full = m->interleaved ? x->chunks : (int)(row_bytes / step);
    static const uint8_t zeros[64] = {0}; /* the codes of rows past the tile's last */
    const Exchanges e = exchanges();
    const uint8_t *first = chunk_codes(m, o0, 0), *rows[Q8_TILE_OUTS], *tails[Q8_TILE_OUTS];
    ptrdiff_t offsets[Q8_TILE_OUTS]; /* each row's codes from the first row's, the same for every chunk */
    uint8_t tail[Q8_TILE_OUTS * 64];
    for (int i = 0; i < Q8_TILE_OUTS; i++) offsets[i] = i < P ? chunk_codes(m, o0 + i, 0) - first : 0;
    for (int i = 0; i < Q8_TILE_OUTS; i++) tails[i] = i < P ? tail + 64 * i : zeros, rows[i] = zeros;
    float facc[TILE_ROWS * Q8_TILE_OUTS];
    memset(facc, 0, sizeof(float) * (size_t)(r1 - r0) * Q8_TILE_OUTS);
    __m512i w[16];
    for (int c = 0; c < x->chunks; c++) {
        if (c < full) {
            const uint8_t *codes = chunk_codes(m, o0, c);
            for (int i = 0; i < P; i++) rows[i] = codes + offsets[i];
            load_chunk(kind, &e, rows, w);
        } else { /* a row-major row's last, partial chunk: zeroed copies, nothing past a row read */
            memset(tail, 0, sizeof tail);
            for (int i = 0; i < P; i++) memcpy(tail + 64 * i, chunk_codes(m, o0 + i, c), row_bytes - (size_t)c * step);
            load_chunk(kind, &e, tails, w);
        }
        int b0 = 2 * c * Q8_BLOCK, b1 = b0 + Q8_BLOCK; /* the chunk's blocks' first columns */
        const float *s0 = sv + (size_t)(b0 < m->in ? b0 / m->group : groups) * Q8_TILE_OUTS;
        const float *s1 = sv + (size_t)(b1 < m->in ? b1 / m->group : groups) * Q8_TILE_OUTS;
        chunk_rows(kind, w, _mm512_loadu_ps(s0), _mm512_loadu_ps(s1), x, c, r0, r1, facc);
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
#endif

int q8_tiles_fast(void) {
#if HAVE_X86
    return q8_vnni_available() && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

void q8_tiles_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy) {
#if HAVE_X86
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
