/*
 * Weights times rows of x quantised to int8: the products are integer dot products (AVX2 maddubs),
 * which is why llama.cpp's CPU decode is fast. The float kernels (nibble.c) spend most of their time
 * turning nibbles into float vectors; here a chunk of 32 packed bytes needs an and, a shift and an and
 * before it meets x, and 64 weights cost two multiply-adds per row.
 *
 *   y[r, o] = sum_b  s[o, g(b)] * d[r, b] * sum_{k in block b} w[o, k] * xq[r, k]
 *
 * x is quantised per block of 32 columns (d = absmax / 127, xq = round(x / d)); a weight group is a
 * multiple of 32 columns, so a block has one weight scale. Lossy in x only (the weights are the
 * container's records, as stored): an option, never the default (docs/quantization.md has its
 * perplexity).
 *
 * int4 weights (n - 8, n the nibble): sum (n - 8) xq = sum n xq - 8 sum xq, so the unsigned nibbles go
 * straight into maddubs (unsigned x signed) and the block's 8 sum xq is subtracted once per block (an
 * exact integer correction prepared with x). A chunk's low nibbles are its even columns, the high
 * ones its odd columns, so x is prepared as [even columns | odd columns] per chunk; the first 16 bytes
 * of either half are block 0, the last 16 block 1, which puts block 0 in the low 128-bit lane of every
 * vector and block 1 in the high one. int8 weights keep that lane split by loading 16-byte pieces
 * (columns 0-15 | 32-47 and 16-31 | 48-63), x prepared in the same order; |w| x sign(x, w) makes the
 * unsigned x signed product maddubs needs.
 *
 * Each row of x is accumulated the same way whatever else is in the call: batch-invariant.
 */
#include "q8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nibble.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* Per row and chunk in the work area: 64 int8 of x, 8 float block scales, 8 int32 offset corrections. */
#define SLOT_BYTES 128
#define SLOT_SCALES 64
#define SLOT_OFFSETS 96

static inline int chunks_of(int in) { return (in + Q8_CHUNK - 1) / Q8_CHUNK; }

size_t q8_work_bytes(int rows, int in) { return (size_t)rows * (size_t)chunks_of(in) * SLOT_BYTES; }

static inline uint8_t *slot(const Q8Rows *x, int r, int c) { return x->work + ((size_t)r * x->chunks + c) * SLOT_BYTES; }

/* Where column j (0..63) of a chunk goes in the prepared 64 bytes. */
static inline int x_position(int kind, int j) {
    if (kind == Q8_WEIGHTS_INT4) return j % 2 ? 32 + j / 2 : j / 2;
    int piece = j / 16; /* pieces 0 1 2 3 -> positions 0 2 1 3 */
    return 16 * (piece == 1 ? 2 : piece == 2 ? 1 : piece) + j % 16;
}

static void prepare_scalar(int kind, const float *x, int rows, int in, Q8Rows *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * in;
        for (int c = 0; c < out->chunks; c++) {
            uint8_t *s = slot(out, r, c);
            float scales[2];
            int sums[2] = {0, 0};
            for (int b = 0; b < 2; b++) {
                int first = c * Q8_CHUNK + b * Q8_BLOCK;
                float amax = 0.f;
                for (int k = first; k < first + Q8_BLOCK && k < in; k++) amax = fmaxf(amax, fabsf(xr[k]));
                float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
                for (int j = 0; j < Q8_BLOCK; j++) {
                    int k = first + j;
                    int q = k < in ? (int)nearbyintf(xr[k] * inv) : 0;
                    ((int8_t *)s)[x_position(kind, b * Q8_BLOCK + j)] = (int8_t)q;
                    sums[b] += q;
                }
                scales[b] = d;
            }
            float *sv = (float *)(s + SLOT_SCALES);
            int32_t *off = (int32_t *)(s + SLOT_OFFSETS);
            for (int l = 0; l < 8; l++) {
                sv[l] = scales[l / 4];
                /* int4: lanes 0 and 4 carry the blocks' -8 sum xq (each lane's integer sum is added up at the end) */
                off[l] = kind == Q8_WEIGHTS_INT4 && l % 4 == 0 ? 8 * sums[l / 4] : 0;
            }
        }
    }
}

/* Weight row o's value at column k (before its group's scale). */
static inline int weight_at(const Q8Matrix *m, int o, int k) {
    if (m->kind == Q8_WEIGHTS_INT8) return ((const int8_t *)m->w)[(size_t)o * m->in + k];
    const uint8_t *row = (const uint8_t *)m->w + (size_t)o * ((m->in + 1) / 2);
    return ((row[k / 2] >> (4 * (k % 2))) & 0x0F) - 8;
}

static void gemm_scalar(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group;
    for (int o = begin; o < end; o++)
        for (int r = 0; r < x->rows; r++) {
            float total = 0.f;
            for (int c = 0; c < x->chunks; c++) {
                const uint8_t *s = slot(x, r, c);
                for (int b = 0; b < 2; b++) {
                    int first = c * Q8_CHUNK + b * Q8_BLOCK, dot = 0;
                    for (int k = first; k < first + Q8_BLOCK && k < m->in; k++)
                        dot += weight_at(m, o, k) * ((const int8_t *)s)[x_position(x->kind, k - c * Q8_CHUNK)];
                    if (first < m->in) {
                        float scale = nibble_scale(m->scale_kind, m->scales, (size_t)o * groups + first / m->group);
                        total += (float)dot * (((const float *)(s + SLOT_SCALES))[4 * b] * scale);
                    }
                }
            }
            y[(size_t)r * ldy + (o - begin)] = total;
        }
}

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline

AVX2_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Row o's group scales as float32, and a 0 after them (the group of a block past the row). */
AVX2 static void row_scales(const Q8Matrix *m, int o, int groups, float *out) {
    int g = 0;
    if (m->scale_kind == SCALE_F16) {
        const uint16_t *first = (const uint16_t *)m->scales + (size_t)o * groups;
        for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(first + g))));
        for (; g < groups; g++) out[g] = _cvtsh_ss(first[g]);
    } else {
        for (; g < groups; g++) out[g] = nibble_scale(m->scale_kind, m->scales, (size_t)o * groups + g);
    }
    out[groups] = 0.f;
}

/* A chunk's weights as two vectors of unsigned (int4) or signed (int8) bytes, block 0 in the low lanes:
 * int4: the low nibbles (even columns) and the high ones; int8: columns 0-15|32-47 and 16-31|48-63. */
AVX2_INLINE void chunk_weights(int kind, const uint8_t *p, __m256i v[2]) {
    if (kind == Q8_WEIGHTS_INT4) {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        __m256i packed = _mm256_loadu_si256((const __m256i *)p);
        v[0] = _mm256_and_si256(packed, low4);
        v[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    } else {
        v[0] = _mm256_loadu2_m128i((const __m128i *)(p + 32), (const __m128i *)p);
        v[1] = _mm256_loadu2_m128i((const __m128i *)(p + 48), (const __m128i *)(p + 16));
    }
}

/* The chunk's integer sums per lane (lanes 0-3 block 0, 4-7 block 1) for one row's prepared x. */
AVX2_INLINE __m256i chunk_dot(int kind, const __m256i w[2], const uint8_t *s) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i x0 = _mm256_loadu_si256((const __m256i *)s), x1 = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i p0, p1;
    if (kind == Q8_WEIGHTS_INT4) {
        p0 = _mm256_maddubs_epi16(w[0], x0);
        p1 = _mm256_maddubs_epi16(w[1], x1);
    } else {
        p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w[0], w[0]), _mm256_sign_epi8(x0, w[0]));
        p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w[1], w[1]), _mm256_sign_epi8(x1, w[1]));
    }
    __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
    return kind == Q8_WEIGHTS_INT4 ? _mm256_sub_epi32(sum, _mm256_loadu_si256((const __m256i *)(s + SLOT_OFFSETS))) : sum;
}

/* acc[p][r] += chunk c of P output rows (codes at rows[p], group scales sc[p]; the chunk's blocks are in
 * groups gi[2c], gi[2c + 1]) times RB rows of x. */
AVX2_INLINE void chunk_step(int kind, int P, int RB, const uint8_t *const rows[4], const float *const sc[4],
                            const int *gi, const uint8_t *const s[2], int c, size_t step, size_t ahead, __m256 acc[4][2]) {
    __m256 d[2];
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++) d[r] = _mm256_loadu_ps((const float *)(s[r] + (size_t)c * SLOT_BYTES + SLOT_SCALES));
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        __m256i w[2];
        /* the next P output rows, same columns: a few short rows interleaved are not a stream the
         * hardware prefetchers follow well (measured: 3.3 -> see docs/kernels.md) */
        if (ahead) _mm_prefetch((const char *)(rows[p] + ahead + (size_t)c * step), _MM_HINT_T0);
        chunk_weights(kind, rows[p] + (size_t)c * step, w);
        __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc[p] + gi[2 * c])),
                                         _mm_broadcast_ss(sc[p] + gi[2 * c + 1]), 1);
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) {
            __m256 dot = _mm256_cvtepi32_ps(chunk_dot(kind, w, s[r] + (size_t)c * SLOT_BYTES));
            acc[p][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d[r], sv), acc[p][r]);
        }
    }
}

/* P output rows (P <= 4) times RB rows of x from row r0: one accumulator per pair, each chunk's weights
 * unpacked once for all of them; a row's last, partial chunk is read through zeroed copies (nothing
 * past a row is touched). */
AVX2_INLINE void rows_block(int kind, int P, int RB, const Q8Matrix *m, const Q8Rows *x, int o, int r0, int end,
                            float *const scales[4], const int *gi, float *y, size_t ldy, int begin) {
    size_t row_bytes = kind == Q8_WEIGHTS_INT4 ? (size_t)(m->in + 1) / 2 : (size_t)m->in;
    size_t step = kind == Q8_WEIGHTS_INT4 ? 32 : 64;
    int full = (int)(row_bytes / step);
    const uint8_t *rows[4];
    const float *sc[4] = {scales[0], scales[1], scales[2], scales[3]};
    const uint8_t *s[2] = {slot(x, r0, 0), slot(x, r0 + RB - 1, 0)};
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        rows[p] = (const uint8_t *)m->w + (size_t)(o + p) * row_bytes;
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) acc[p][r] = _mm256_setzero_ps();
    }
    size_t ahead = r0 == 0 && o + 2 * P <= end ? (size_t)P * row_bytes : 0; /* the first pass over these rows */
    for (int c = 0; c < full; c++) chunk_step(kind, P, RB, rows, sc, gi, s, c, step, ahead, acc);
    if (full < x->chunks) {
        uint8_t tails[4][64] = {{0}};
        const uint8_t *tail_rows[4];
        for (int p = 0; p < P; p++) {
            memcpy(tails[p], rows[p] + (size_t)full * step, row_bytes - (size_t)full * step);
            tail_rows[p] = tails[p] - (size_t)full * step; /* chunk_step adds full * step back */
        }
        chunk_step(kind, P, RB, tail_rows, sc, gi, s, full, step, 0, acc);
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) y[(size_t)(r0 + r) * ldy + (o + p - begin)] = hsum(acc[p][r]);
}

#define ROWS_BLOCK(P, RB) rows_block(kind, P, RB, m, x, o, r0, end, scales, gi, y, ldy, begin)
AVX2_INLINE void gemm_kind(int kind, const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *const scales[4],
                           const int *gi, float *y, size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group;
    for (int o = begin; o < end; o += 4) {
        int P = end - o < 4 ? end - o : 4;
        for (int p = 0; p < P; p++) row_scales(m, o + p, groups, scales[p]);
        for (int r0 = 0; r0 < x->rows; r0 += 2) {
            switch (P * 2 + (x->rows - r0 < 2 ? 1 : 2) - 1) {
            case 2: ROWS_BLOCK(1, 1); break;
            case 3: ROWS_BLOCK(1, 2); break;
            case 4: ROWS_BLOCK(2, 1); break;
            case 5: ROWS_BLOCK(2, 2); break;
            case 6: ROWS_BLOCK(3, 1); break;
            case 7: ROWS_BLOCK(3, 2); break;
            case 8: ROWS_BLOCK(4, 1); break;
            default: ROWS_BLOCK(4, 2); break;
            }
        }
    }
}
#undef ROWS_BLOCK

/* Four output rows at a time; rows of x two at a time (the accumulators stay in registers). */
AVX2 static void gemm_avx2(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group, blocks = 2 * x->chunks;
    float *buffer = malloc(sizeof(float) * 4 * (size_t)(groups + 1) + sizeof(int) * (size_t)blocks);
    if (buffer == NULL) {
        gemm_scalar(m, x, begin, end, y, ldy);
        return;
    }
    float *scales[4] = {buffer, buffer + (groups + 1), buffer + 2 * (groups + 1), buffer + 3 * (groups + 1)};
    int *gi = (int *)(buffer + 4 * (groups + 1)); /* each block's group, for every output row alike */
    for (int b = 0; b < blocks; b++) gi[b] = b * Q8_BLOCK < m->in ? b * Q8_BLOCK / m->group : groups;
    if (m->kind == Q8_WEIGHTS_INT4)
        gemm_kind(Q8_WEIGHTS_INT4, m, x, begin, end, scales, gi, y, ldy);
    else
        gemm_kind(Q8_WEIGHTS_INT8, m, x, begin, end, scales, gi, y, ldy);
    free(buffer);
}
/* 32 floats -> 32 int8 round(x * inv) in order (|x * inv| <= 127: no saturation); *sum += their sum. */
AVX2_INLINE __m256i quantize_block(const float *x, float inv, int *sum) {
    __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), scale));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *sum = _mm_cvtsi128_si32(t);
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX2_INLINE float block_absmax(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The same bytes as prepare_scalar (the same float operations; cvtps rounds to nearest even). */
AVX2 static void prepare_avx2(int kind, const float *x, int rows, int in, Q8Rows *out) {
    const __m256i evens_first = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    float padded[Q8_CHUNK];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < out->chunks; c++) {
            const float *xc = x + (size_t)r * in + (size_t)c * Q8_CHUNK;
            if ((c + 1) * Q8_CHUNK > in) { /* the row's last, partial chunk: zeros past in */
                memset(padded, 0, sizeof padded);
                memcpy(padded, xc, sizeof(float) * (size_t)(in - c * Q8_CHUNK));
                xc = padded;
            }
            uint8_t *s = slot(out, r, c);
            __m256i v[2];
            int sums[2];
            float scales[2];
            for (int b = 0; b < 2; b++) {
                float amax = block_absmax(xc + b * Q8_BLOCK);
                scales[b] = amax / 127.f;
                v[b] = quantize_block(xc + b * Q8_BLOCK, amax > 0.f ? 127.f / amax : 0.f, &sums[b]);
            }
            if (kind == Q8_WEIGHTS_INT4) { /* per 128-bit lane evens then odds, then gather the halves */
                for (int b = 0; b < 2; b++) v[b] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v[b], evens_first), 0xD8);
            }
            _mm256_storeu_si256((__m256i *)s, _mm256_permute2x128_si256(v[0], v[1], 0x20));
            _mm256_storeu_si256((__m256i *)(s + 32), _mm256_permute2x128_si256(v[0], v[1], 0x31));
            _mm256_storeu_ps((float *)(s + SLOT_SCALES),
                             _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(scales[0])), _mm_set1_ps(scales[1]), 1));
            int off0 = kind == Q8_WEIGHTS_INT4 ? 8 * sums[0] : 0, off1 = kind == Q8_WEIGHTS_INT4 ? 8 * sums[1] : 0;
            _mm256_storeu_si256((__m256i *)(s + SLOT_OFFSETS), _mm256_setr_epi32(off0, 0, 0, 0, off1, 0, 0, 0));
        }
}
#endif

void q8_prepare(int kind, const float *x, int rows, int in, int simd, Q8Rows *out) {
    out->rows = rows, out->chunks = chunks_of(in), out->kind = kind;
#if HAVE_X86
    if (simd && nibble_simd_available()) {
        prepare_avx2(kind, x, rows, in, out);
        return;
    }
#endif
    (void)simd;
    prepare_scalar(kind, x, rows, in, out);
}

void q8_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int simd, float *y, size_t ldy) {
#if HAVE_X86
    if (simd && nibble_simd_available()) {
        gemm_avx2(m, x, begin, end, y, ldy);
        return;
    }
#endif
    (void)simd;
    gemm_scalar(m, x, begin, end, y, ldy);
}
