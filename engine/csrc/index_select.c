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
 * decode, on the module path and in the one-call step alike (engine/indexer.py).
 */
#include "index_select.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

enum { KEYS_PER_BLOCK = 256 }; /* the threads' share: 256 keys of 128 floats are 128 KiB */

typedef struct {
    const IndexSelect *job;
    int blocks_per_row; /* key blocks of the row that sees the most */
    float *scores;      /* [rows, seen + rows - 1]: row r's first seen + r */
    uint64_t *ranks;    /* the same shape: rank_key of each score */
} ScoreJob;

static float relu(float v) { return v < 0.f ? 0.f : v; } /* NaN stays NaN, as torch's relu */

#if HAVE_X86
AVX2 static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum of v[0]], ..., [sum of v[7]] as one vector. */
AVX2 static __m256 sums8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* score += each head's weighted ReLU from head h on, one by one (the heads past a multiple of 8). */
AVX2 static float heads_after(const IndexSelect *j, const float *key, int h, float score) {
    int dim = j->dim, whole = dim / 8 * 8;
    for (; h < j->heads; h++) {
        const float *q = j->q + (size_t)h * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int k = 0; k < whole; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + k), _mm256_loadu_ps(key + k), acc);
        float dot = hsum8(acc);
        for (int k = whole; k < dim; k++) dot += q[k] * key[k];
        score += j->weights[h] * relu(dot * j->scale);
    }
    return score;
}

/* Heads 8 at a time, one accumulator each over the key's floats (its tail through a masked load), their
 * eight sums at once; the heads past a multiple of 8 one by one. */
AVX2 static float score_avx2(const IndexSelect *j, const float *key) {
    static const int lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    int dim = j->dim, whole = dim / 8 * 8;
    __m256i tail = _mm256_loadu_si256((const __m256i *)(lanes + 8 - dim % 8));
    __m256 total = _mm256_setzero_ps(), zero = _mm256_setzero_ps(), scale = _mm256_set1_ps(j->scale);
    int h = 0;
    for (; h + 8 <= j->heads; h += 8) {
        const float *q = j->q + (size_t)h * dim;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int k = 0; k < whole; k += 8) {
            __m256 kv = _mm256_loadu_ps(key + k);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)i * dim + k), kv, acc[i]);
        }
        if (whole < dim) {
            __m256 kv = _mm256_maskload_ps(key + whole, tail);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_maskload_ps(q + (size_t)i * dim + whole, tail), kv, acc[i]);
        }
        __m256 relu = _mm256_max_ps(zero, _mm256_mul_ps(sums8(acc), scale)); /* a NaN stays NaN */
        total = _mm256_fmadd_ps(_mm256_loadu_ps(j->weights + h), relu, total);
    }
    return heads_after(j, key, h, hsum8(total));
}

/* score_avx2 for keys[0 .. 3) (rows dim floats apart) at once: AVX2 code given AVX-512VL's 32 registers, so
 * 24 accumulators (8 heads x 3 keys) share each load of a head's query values (2.2 FMAs a load, not 0.9).
 * Each key's products and their order, its sums and its tail are score_avx2's: the same bits. */
AVX512VL static void score3_avx512vl(const IndexSelect *j, const float *keys, float out[3]) {
    static const int lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    int dim = j->dim, whole = dim / 8 * 8;
    __m256i tail = _mm256_loadu_si256((const __m256i *)(lanes + 8 - dim % 8));
    __m256 total[3], zero = _mm256_setzero_ps(), scale = _mm256_set1_ps(j->scale);
    for (int t = 0; t < 3; t++) total[t] = _mm256_setzero_ps();
    int h = 0;
    for (; h + 8 <= j->heads; h += 8) {
        const float *q = j->q + (size_t)h * dim;
        __m256 acc[3][8];
        for (int t = 0; t < 3; t++)
            for (int i = 0; i < 8; i++) acc[t][i] = _mm256_setzero_ps();
        for (int k = 0; k < whole; k += 8) {
            __m256 k0 = _mm256_loadu_ps(keys + k), k1 = _mm256_loadu_ps(keys + dim + k);
            __m256 k2 = _mm256_loadu_ps(keys + 2 * (size_t)dim + k);
            for (int i = 0; i < 8; i++) {
                __m256 qv = _mm256_loadu_ps(q + (size_t)i * dim + k);
                acc[0][i] = _mm256_fmadd_ps(qv, k0, acc[0][i]);
                acc[1][i] = _mm256_fmadd_ps(qv, k1, acc[1][i]);
                acc[2][i] = _mm256_fmadd_ps(qv, k2, acc[2][i]);
            }
        }
        for (int t = 0; t < 3; t++) {
            if (whole < dim) {
                __m256 kv = _mm256_maskload_ps(keys + (size_t)t * dim + whole, tail);
                for (int i = 0; i < 8; i++)
                    acc[t][i] = _mm256_fmadd_ps(_mm256_maskload_ps(q + (size_t)i * dim + whole, tail), kv, acc[t][i]);
            }
            __m256 relu = _mm256_max_ps(zero, _mm256_mul_ps(sums8(acc[t]), scale));
            total[t] = _mm256_fmadd_ps(_mm256_loadu_ps(j->weights + h), relu, total[t]);
        }
    }
    for (int t = 0; t < 3; t++) out[t] = heads_after(j, keys + (size_t)t * dim, h, hsum8(total[t]));
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
    int vector = nibble_simd_available();
    if (nibble_simd_wide())
        for (; begin + 3 <= end; begin += 3) score3_avx512vl(&one, j->keys + (size_t)begin * j->dim, scores + begin);
#endif
    for (int t = begin; t < end; t++) {
        const float *key = j->keys + (size_t)t * j->dim;
#if HAVE_X86
        if (vector) {
            scores[t] = score_avx2(&one, key);
            continue;
        }
#endif
        scores[t] = score_plain(&one, key);
    }
}

/* A score and its position as one integer whose order is the choice's: higher score first (any NaN above
 * every number, -0 equal to +0), then the lower position. */
static uint64_t rank_key(float score, int position) {
    uint32_t bits;
    if (isnan(score)) bits = UINT32_MAX;
    else {
        if (score == 0.f) score = 0.f;
        memcpy(&bits, &score, sizeof bits);
        bits = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    }
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)position;
}

static void swap(uint64_t *a, uint64_t *b) {
    uint64_t t = *a;
    *a = *b, *b = t;
}

/* Moves the k largest of keys[0, n) to keys[0, k) (in no order): quickselect with a median-of-three pivot. */
static void select_largest(uint64_t *keys, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (keys[mid] > keys[lo]) swap(&keys[mid], &keys[lo]);
        if (keys[hi] > keys[lo]) swap(&keys[hi], &keys[lo]);
        if (keys[mid] > keys[hi]) swap(&keys[mid], &keys[hi]); /* keys[hi]: the median of the three */
        uint64_t pivot = keys[hi];
        int store = lo;
        for (int i = lo; i < hi; i++)
            if (keys[i] > pivot) swap(&keys[i], &keys[store++]);
        swap(&keys[store], &keys[hi]); /* [lo, store) above the pivot, store the pivot, then the rest */
        if (store == k - 1 || store == k) return;
        if (store < k) lo = store + 1;
        else hi = store - 1;
    }
}

static int descending(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
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
    for (int i = 0; i < ranked; i++) chosen[i] = (int64_t)(uint32_t)~(uint32_t)ranks[i];
    for (int i = ranked; i < j->topk; i++) chosen[i] = seen + (i - ranked); /* the masked positions, in order */
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
