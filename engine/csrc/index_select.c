/*
 * The DSA indexer's choice: each query row's top-k of its scores over the keys it sees (its own position and
 * those before: a causal mask becomes a shorter row). torch spent ~12 ops a block on it (the demo: ~85 us a
 * decode row over 300 keys, most of it dispatch; a long prompt's blocks, einsums and a top-k over masked
 * rows); here the scores are one pass over each row's keys, split over the kernels' threads in blocks of
 * (row, 256 keys), and each row's top-k a selection over order-keyed integers.
 *
 * Float32 as C sums it (8 heads at a time, one 8-wide accumulator each, their weighted ReLUs summed 8 wide):
 * not torch's einsum bits. Where the CPU has AVX-512VL the same AVX2 code takes three keys at a time in its
 * 32 registers (each query load feeds three FMAs), each key's bits unchanged. Every row takes it, prompt and
 * decode, on the module path and in the one-call step alike (engine/mla/indexer.py).
 */
#include "index_select.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "index_rank.h"
#include "nibble.h"
#include "split.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512VL __attribute__((target("avx2,fma,avx512f,avx512vl")))
#else
#define HAVE_X86 0
#endif
#if defined(__aarch64__)
#include "neon8.h"
#define HAVE_NEON 1
#else
#define HAVE_NEON 0
#endif

enum { KEYS_PER_BLOCK = 256 }; /* the threads' share: 256 keys of 128 floats are 128 KiB */

typedef struct {
    const IndexSelect *job;
    int blocks_per_row; /* key blocks of the row that sees the most */
    float *scores;      /* [rows, seen + rows - 1]: row r's first seen + r */
    uint64_t *ranks;    /* the same shape: rank_key of each score */
} ScoreJob;

static float relu(float v) { return v < 0.f ? 0.f : v; } /* NaN stays NaN, as torch's relu */

#if HAVE_X86
/* The scoring loops once per instruction set (index_score_body.h): AVX2, and the same AVX2 code compiled with
 * AVX-512VL, whose 32 registers hold three keys' accumulators (same operations, same order: same bits). */
#define IS_TARGET AVX2
#define IS_INLINE AVX2 __attribute__((always_inline)) static inline
#define IS_NAME(name) name##_avx2
#include "index_score_body.h"
#undef IS_TARGET
#undef IS_INLINE
#undef IS_NAME

#define IS_TARGET AVX512VL
#define IS_INLINE AVX512VL __attribute__((always_inline)) static inline
#define IS_NAME(name) name##_avx512vl
#include "index_score_body.h"
#undef IS_TARGET
#undef IS_INLINE
#undef IS_NAME
#endif

#if HAVE_NEON
/* index_score_body.h's score_keys for one key over NEON registers, lane for lane (neon8.h): the same bits. */
F8_INLINE F8 sums8_neon(const F8 v[8]) { /* hadd, hadd, then the 128-bit halves added: lane i sums v[i] */
    float32x4_t a = vaddq_f32(vpaddq_f32(vpaddq_f32(v[0].lo, v[1].lo), vpaddq_f32(v[2].lo, v[3].lo)),
                              vpaddq_f32(vpaddq_f32(v[0].hi, v[1].hi), vpaddq_f32(v[2].hi, v[3].hi)));
    float32x4_t b = vaddq_f32(vpaddq_f32(vpaddq_f32(v[4].lo, v[5].lo), vpaddq_f32(v[6].lo, v[7].lo)),
                              vpaddq_f32(vpaddq_f32(v[4].hi, v[5].hi), vpaddq_f32(v[6].hi, v[7].hi)));
    return (F8){a, b};
}

F8_INLINE F8 tail8(const float *p, int n) { /* _mm256_maskload_ps of the first n: zeros after */
    float padded[8] = {0};
    memcpy(padded, p, sizeof(float) * (size_t)n);
    return f8_load(padded);
}

F8_INLINE F8 max_ps(F8 a, F8 b) { /* _mm256_max_ps: a > b ? a : b (b where either is NaN) */
    return (F8){vbslq_f32(vcgtq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), a.hi, b.hi)};
}

static float score1_neon(const IndexSelect *j, const float *key) {
    int dim = j->dim, whole = dim / 8 * 8, h = 0;
    F8 total = f8_zero(), scale = f8_dup(j->scale);
    for (; h + 8 <= j->heads; h += 8) {
        const float *q = j->q + (size_t)h * dim;
        F8 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = f8_zero();
        for (int k = 0; k < whole; k += 8) {
            F8 kv = f8_load(key + k);
            for (int i = 0; i < 8; i++) acc[i] = f8_fma(f8_load(q + (size_t)i * dim + k), kv, acc[i]);
        }
        if (whole < dim) {
            F8 kv = tail8(key + whole, dim - whole);
            for (int i = 0; i < 8; i++) acc[i] = f8_fma(tail8(q + (size_t)i * dim + whole, dim - whole), kv, acc[i]);
        }
        total = f8_fma(f8_load(j->weights + h), max_ps(f8_zero(), f8_mul(sums8_neon(acc), scale)), total);
    }
    float score = f8_hsum(total);
    for (; h < j->heads; h++) { /* heads_after */
        const float *q = j->q + (size_t)h * dim;
        F8 acc = f8_zero();
        for (int k = 0; k < whole; k += 8) acc = f8_fma(f8_load(q + k), f8_load(key + k), acc);
        float dot = f8_hsum(acc);
        for (int k = whole; k < dim; k++) dot += q[k] * key[k];
        score += j->weights[h] * relu(dot * j->scale);
    }
    return score;
}
#endif

static float score_plain(const IndexSelect *j, const float *key) {
    float score = 0.f;
    for (int h = 0; h < j->heads; h++) {
        const float *q = j->q + (size_t)h * j->dim;
        float dot = 0.f;
        for (int k = 0; k < j->dim; k++) dot += q[k] * key[k];
        score += j->weights[h] * relu(dot * j->scale);
    }
    return score;
}

static int seen_by(const IndexSelect *j, int row) { return j->seen + row; }

static size_t row_stride(const IndexSelect *j) { return (size_t)j->seen + (size_t)j->rows - 1; }

/* Block b: row b / blocks_per_row, its keys [256 * (b % blocks_per_row), +256) it sees. */
static void score_block(void *arg, int b) {
    const ScoreJob *s = arg;
    const IndexSelect *j = s->job;
    int row = b / s->blocks_per_row, begin = b % s->blocks_per_row * KEYS_PER_BLOCK, seen = seen_by(j, row);
    int end = begin + KEYS_PER_BLOCK < seen ? begin + KEYS_PER_BLOCK : seen;
    IndexSelect one = *j; /* the row's query heads and weights */
    one.q = j->q + (size_t)row * j->heads * j->dim, one.weights = j->weights + (size_t)row * j->heads;
    float *scores = s->scores + (size_t)row * row_stride(j);
#if HAVE_X86
    if (nibble_simd_wide()) {
        for (; begin + 3 <= end; begin += 3) score3_avx512vl(&one, j->keys + (size_t)begin * j->dim, scores + begin);
        for (; begin < end; begin++) score1_avx512vl(&one, j->keys + (size_t)begin * j->dim, scores + begin);
        return;
    }
    if (nibble_simd_available()) {
        for (; begin < end; begin++) score1_avx2(&one, j->keys + (size_t)begin * j->dim, scores + begin);
        return;
    }
#elif HAVE_NEON
    if (nibble_simd_available()) {
        for (; begin < end; begin++) scores[begin] = score1_neon(&one, j->keys + (size_t)begin * j->dim);
        return;
    }
#endif
    for (int t = begin; t < end; t++) scores[t] = score_plain(&one, j->keys + (size_t)t * j->dim);
}

/* Row `row`'s choice from its scores: the topk highest ranked (or all it sees, then the positions after). */
static void choose_row(void *arg, int row) {
    const ScoreJob *s = arg;
    const IndexSelect *j = s->job;
    int seen = seen_by(j, row), ranked = seen < j->topk ? seen : j->topk;
    const float *scores = s->scores + (size_t)row * row_stride(j);
    uint64_t *ranks = s->ranks + (size_t)row * row_stride(j);
    int64_t *chosen = j->chosen + (size_t)row * j->topk;
    for (int t = 0; t < seen; t++) ranks[t] = rank_key(scores[t], t);
    if (ranked < seen) select_largest(ranks, seen, ranked);
    qsort(ranks, (size_t)ranked, sizeof *ranks, descending);
    for (int i = 0; i < ranked; i++) chosen[i] = rank_position(ranks[i]);
    for (int i = ranked; i < j->topk; i++) chosen[i] = seen + (i - ranked); /* the masked positions, in order */
}

void index_row_scores(const IndexSelect *j, int row, int simd_path, float *scores) {
    IndexSelect one = *j; /* the row alone: row 0 of a one-row job that sees what it sees */
    one.q = j->q + (size_t)row * j->heads * j->dim, one.weights = j->weights + (size_t)row * j->heads;
    one.rows = 1, one.seen = seen_by(j, row);
    if (simd_path) {
        ScoreJob s = {&one, (int)((row_stride(&one) + KEYS_PER_BLOCK - 1) / KEYS_PER_BLOCK), scores, NULL};
        for (int b = 0; b < s.blocks_per_row; b++) score_block(&s, b);
        return;
    }
    for (int t = 0; t < one.seen; t++) scores[t] = score_plain(&one, j->keys + (size_t)t * j->dim);
}

int index_select(const IndexSelect *j, int threads) {
    size_t cells = (size_t)j->rows * row_stride(j);
    float *scores = malloc(sizeof(float) * cells);
    uint64_t *ranks = malloc(sizeof(uint64_t) * cells);
    if (scores == NULL || ranks == NULL) {
        free(scores), free(ranks);
        return -1;
    }
    ScoreJob s = {j, (int)((row_stride(j) + KEYS_PER_BLOCK - 1) / KEYS_PER_BLOCK), scores, ranks};
    split_run(score_block, &s, j->rows * s.blocks_per_row, threads);
    split_run(choose_row, &s, j->rows, threads);
    free(scores), free(ranks);
    return 0;
}

/* ---------------------------------------------------------------- a long prompt's scores (index_tile_scores) */
/* One score as every vector path computes each of its lanes (index_tile_body.h). */
static float tile_score_plain(const IndexTiles *j, const float *q, const float *w, int t) {
    float total = 0.f;
    for (int h = 0; h < j->heads; h++) {
        float dot = 0.f;
        for (int d = 0; d < j->dim; d++) dot = fmaf(q[(size_t)h * j->dim + d], j->keys_t[(size_t)d * j->key_stride + t], dot);
        total = fmaf(w[h], relu(dot * j->scale), total);
    }
    return total;
}

#if HAVE_X86
#define IT_TARGET __attribute__((target("avx2,fma,avx512f")))
#define IT_NAME(name) name##_avx512
#define IT_VEC __m512
#define IT_ZERO _mm512_setzero_ps
#define IT_DUP _mm512_set1_ps
#define IT_LOAD _mm512_loadu_ps
#define IT_STORE _mm512_storeu_ps
#define IT_FMA _mm512_fmadd_ps
#define IT_MUL _mm512_mul_ps
#define IT_RELU _mm512_max_ps /* (zero, x): zero > x ? zero : x, a NaN stays NaN, as relu() */
#define IT_LANES 16
#define IT_KV 2
#define IT_HEADS 8
#include "index_tile_body.h"
#undef IT_TARGET
#undef IT_NAME
#undef IT_VEC
#undef IT_ZERO
#undef IT_DUP
#undef IT_LOAD
#undef IT_STORE
#undef IT_FMA
#undef IT_MUL
#undef IT_RELU
#undef IT_LANES
#undef IT_KV
#undef IT_HEADS

#define IT_TARGET AVX2
#define IT_NAME(name) name##_avx2
#define IT_VEC __m256
#define IT_ZERO _mm256_setzero_ps
#define IT_DUP _mm256_set1_ps
#define IT_LOAD _mm256_loadu_ps
#define IT_STORE _mm256_storeu_ps
#define IT_FMA _mm256_fmadd_ps
#define IT_MUL _mm256_mul_ps
#define IT_RELU _mm256_max_ps
#define IT_LANES 8
#define IT_KV 3
#define IT_HEADS 4 /* 12 accumulators of 16 registers: more in flight than 8 x 1 */
#include "index_tile_body.h"
#endif

#if HAVE_NEON
#define IT_TARGET
#define IT_NAME(name) name##_neon
#define IT_VEC F8
#define IT_ZERO f8_zero
#define IT_DUP f8_dup
#define IT_LOAD f8_load
#define IT_STORE f8_store
#define IT_FMA f8_fma
#define IT_MUL f8_mul
#define IT_RELU max_ps /* _mm256_max_ps's rule, lane for lane */
#define IT_LANES 8
#define IT_KV 1
#define IT_HEADS 8
#include "index_tile_body.h"
#endif

typedef struct {
    const IndexTiles *job;
    int simd, blocks_per_row;
} TileJob;

static void tile_block(void *arg, int b) {
    const TileJob *s = arg;
    const IndexTiles *j = s->job;
    int row = b / s->blocks_per_row, begin = b % s->blocks_per_row * KEYS_PER_BLOCK;
    int end = begin + KEYS_PER_BLOCK < j->keys ? begin + KEYS_PER_BLOCK : j->keys;
#if HAVE_X86
    if (s->simd && nibble_simd_wide()) {
        tile_row_avx512(j, row, begin, end);
        return;
    }
    if (s->simd && nibble_simd_available()) {
        tile_row_avx2(j, row, begin, end);
        return;
    }
#elif HAVE_NEON
    if (s->simd && nibble_simd_available()) {
        tile_row_neon(j, row, begin, end);
        return;
    }
#endif
    const float *q = j->q + (size_t)row * j->heads * j->dim, *w = j->weights + (size_t)row * j->heads;
    float *out = j->scores + (size_t)row * j->score_stride;
    for (int t = begin; t < end; t++) out[t] = tile_score_plain(j, q, w, t);
}

void index_tile_scores(const IndexTiles *j, int simd, int threads) {
    TileJob s = {j, simd, (j->keys + KEYS_PER_BLOCK - 1) / KEYS_PER_BLOCK};
    split_run(tile_block, &s, j->rows * s.blocks_per_row, threads);
}
