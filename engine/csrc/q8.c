/*
 * Weights times rows of x quantised to int8: the products are integer dot products (AVX2 maddubs, or
 * one AVX-512 VNNI dpbusd where the CPU has it: the same exact integer sums, so the same bytes),
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
 * straight into maddubs (unsigned x signed) and the block's -8 sum xq is added once per block (an
 * exact integer correction prepared with x). A chunk's low nibbles are its even columns, the high
 * ones its odd columns, so x is prepared as [even columns | odd columns] per chunk; the first 16 bytes
 * of either half are block 0, the last 16 block 1, which puts block 0 in the low 128-bit lane of every
 * vector and block 1 in the high one. int8 weights keep that lane split by loading 16-byte pieces
 * (columns 0-15 | 32-47 and 16-31 | 48-63), x prepared in the same order; |w| x sign(x, w) makes the
 * unsigned x signed product maddubs needs.
 *
 * Each row of x is accumulated the same way whatever else is in the call: batch-invariant.
 *
 * aarch64: q8_neon.h's sets (SDOT where the CPU has dot-product, else widening NEON multiplies), AVX2's
 * lanes and order, so AVX2's bytes; x is prepared by the plain C loop there (the same bytes).
 */
#include "q8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "nibble.h"
#include "q8_layout.h"
#include "q8_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif
#if defined(__aarch64__)
#define HAVE_NEON 1
#else
#define HAVE_NEON 0
#endif

/* Rows of x per pass over a call's output rows: the tile's prepared x (16 rows x 128 bytes a chunk: 64 KB at
 * 2048 columns) and the call's weights stay in L2 while every output row meets them; one pass over all rows
 * streamed x from L3 or DRAM once per 4 output rows. A multiple of both Q8_RB. */
#ifndef Q8_ROW_TILE
#define Q8_ROW_TILE 16
#endif

size_t q8_work_bytes(int rows, int in) { return (size_t)rows * (size_t)slots_per_row(chunks_of(in)) * SLOT_BYTES; }

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
                /* lanes 0 and 4 carry the blocks' -8 sum xq: int4's correction (each lane's integer sum is added
                 * up at the end; q8_gemm's int8 weights start from zeros); q8_tiles.c's for either kind */
                off[l] = l % 4 == 0 ? -8 * sums[l / 4] : 0;
            }
        }
    }
}

size_t q8_span_bytes(int kind, int scale_kind, int group) {
    size_t scale_bytes = scale_kind == SCALE_E8M0 ? 1 : 2;
    return span_code_bytes(kind) + 4 * (size_t)(Q8_SPAN / group) * scale_bytes;
}

int q8_interleavable(int kind, int scale_kind, int in, int out, int group) {
    return (kind == Q8_WEIGHTS_INT4 || kind == Q8_WEIGHTS_INT8) && scale_kind >= 0 && scale_kind < N_SCALE_KINDS &&
           in >= Q8_SPAN && in % Q8_SPAN == 0 && out >= 4 && out % 4 == 0 && group >= Q8_CHUNK && group % Q8_CHUNK == 0 &&
           Q8_SPAN % group == 0;
}

static void gemm_scalar(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
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
                        float scale = scale_of(m, o, first / m->group);
                        total += (float)dot * (((const float *)(s + SLOT_SCALES))[4 * b] * scale);
                    }
                }
            }
            y[(size_t)r * ldy + (o - begin)] = total;
        }
}

#if HAVE_X86
#define prefetch_l2_line(p) _mm_prefetch((const char *)(p), _MM_HINT_T2)
#elif HAVE_NEON
#define prefetch_l2_line(p) __builtin_prefetch((p), 0, 2)
#endif

#if HAVE_X86 || HAVE_NEON
/* [start, start + bytes) into L2, a line at a time (the kernels' software prefetch: q8_body.h). Inlined: a call
 * inside the kernels' loops would spill their accumulators (measured: the interleaved kernel at half speed). */
__attribute__((always_inline)) static inline void prefetch_l2(const void *start, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) prefetch_l2_line((const char *)start + at);
}
#endif

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline

AVX2_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* q8_body.h's 8-lane types and helpers: lanes 0-3 block 0, 4-7 block 1 */
typedef __m256 Q8F;
typedef __m256i Q8I;
typedef __m256i Q8W;
AVX2_INLINE Q8F q8f_load(const float *p) { return _mm256_loadu_ps(p); }
AVX2_INLINE Q8F q8f_zero(void) { return _mm256_setzero_ps(); }
AVX2_INLINE Q8F q8f_dup(const float *p) { return _mm256_broadcast_ss(p); }
AVX2_INLINE Q8F q8f_pair(const float *a, const float *b) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(a)), _mm_broadcast_ss(b), 1);
}
/* acc + float(dot) * (d * sv), one fused multiply-add per lane */
AVX2_INLINE Q8F q8_accumulate(Q8F acc, Q8I dot, Q8F d, Q8F sv) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, sv), acc); }
AVX2_INLINE void halves8(const uint16_t *p, float *out) { _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))); }

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

void q8_row_scales(const Q8Matrix *m, int o, int groups, float *out) { row_scales(m, o, groups, out); }

/* The gemm loops, once per instruction set: AVX2 multiplies bytes with maddubs + madd, AVX-512 VNNI
 * (with VL, on 256-bit vectors) with one dpbusd; both sums are exact integers, so the bytes agree. */
#define Q8_TARGET AVX2
#define Q8_INLINE AVX2_INLINE
#define Q8_VNNI 0
#define Q8_NAME(name) name##_avx2
#define Q8_RB 2
#include "q8_body.h"
#undef Q8_TARGET
#undef Q8_INLINE
#undef Q8_VNNI
#undef Q8_NAME
#undef Q8_RB

#define VNNI __attribute__((target("avx2,fma,f16c,avx512vl,avx512vnni")))
#define Q8_TARGET VNNI
#define Q8_INLINE VNNI __attribute__((always_inline)) static inline
#define Q8_VNNI 1
#define Q8_NAME(name) name##_vnni
#define Q8_RB 4
#include "q8_body.h"
#undef Q8_TARGET
#undef Q8_INLINE
#undef Q8_VNNI
#undef Q8_NAME
#undef Q8_RB
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
            _mm256_storeu_si256((__m256i *)(s + SLOT_OFFSETS), _mm256_setr_epi32(-8 * sums[0], 0, 0, 0, -8 * sums[1], 0, 0, 0));
        }
}
#endif

#if HAVE_NEON
#include "q8_neon.h"
#endif

void q8_prepare(int kind, const float *x, int rows, int in, int simd, Q8Rows *out) {
    out->rows = rows, out->chunks = chunks_of(in), out->kind = kind, out->floats = x;
    if (kind == Q8_WEIGHTS_BF16) return;
    if (out->chunks % 2 == 0) /* each row's spare slot (slots_per_row): zeros, so the work area's bytes are all set */
        for (int r = 0; r < rows; r++) memset(slot(out, r, out->chunks), 0, SLOT_BYTES);
#if HAVE_X86
    if (simd && nibble_simd_available()) {
        prepare_avx2(kind, x, rows, in, out);
        return;
    }
#endif
    (void)simd;
    prepare_scalar(kind, x, rows, in, out);
}

int q8_vnni_available(void) {
#if HAVE_X86
    static int known = -1;
    if (known < 0)
        known = nibble_simd_wide() && __builtin_cpu_supports("avx512vnni");
    return known;
#else
    return 0;
#endif
}

void q8_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy) {
    if (isa & Q8_TILES) { /* a prompt's rows (bf16 weights have one kind of product) */
        isa &= ~Q8_TILES;
        if (m->kind != Q8_WEIGHTS_BF16) {
            q8_tiles_gemm(m, x, begin, end, isa, y, ldy);
            return;
        }
    }
    if (isa > Q8_ISA_VNNI) isa = Q8_ISA_VNNI; /* Q8_ISA_AMX is the tile products' alone */
    if (m->kind == Q8_WEIGHTS_BF16) { /* Q8_ISA_* and bf16_isa's limits are the same ladder */
        bf16_gemm_rows(m->w, x->floats, x->rows, m->in, begin, end, isa, 1, y, ldy);
        return;
    }
#if HAVE_X86
    if (isa >= Q8_ISA_VNNI && q8_vnni_available()) {
        gemm_vnni(m, x, begin, end, y, ldy);
        return;
    }
    if (isa >= Q8_ISA_AVX2 && nibble_simd_available()) {
        gemm_avx2(m, x, begin, end, y, ldy);
        return;
    }
#elif HAVE_NEON /* Q8_ISA_VNNI's level: dot-product (SDOT), Q8_ISA_AVX2's: plain NEON; the same bytes */
    if (isa >= Q8_ISA_VNNI && nibble_simd_wide()) {
        gemm_dotprod(m, x, begin, end, y, ldy);
        return;
    }
    if (isa >= Q8_ISA_AVX2 && nibble_simd_available()) {
        gemm_neon(m, x, begin, end, y, ldy);
        return;
    }
#endif
    (void)isa;
    gemm_scalar(m, x, begin, end, y, ldy);
}
