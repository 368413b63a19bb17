/*
 * The DSA indexer's choice for one decode row: a decode row sees every cached key (nothing to mask), so its
 * choice is the top-k of one row of scores. torch spent ~12 small ops a row and layer on it (the demo:
 * ~85 us a call over 300 keys, most of it dispatch); here the scores are one pass over the keys, split
 * over the kernels' threads, and the top-k a selection over order-keyed integers.
 *
 * Float32 as C sums it (8 heads at a time, one 8-wide accumulator each, their weighted ReLUs summed 8 wide):
 * not torch's einsum bits. Every decode row takes it, on the module path and in the one-call step alike (engine/indexer.py).
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
#else
#define HAVE_X86 0
#endif

enum { KEYS_PER_BLOCK = 256 }; /* the threads' share: 256 keys of 128 floats are 128 KiB */

typedef struct {
    const IndexSelect *job;
    float *scores; /* [total] */
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
    float score = hsum8(total);
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

static void score_block(void *arg, int b) {
    const ScoreJob *s = arg;
    const IndexSelect *j = s->job;
    int end = (b + 1) * KEYS_PER_BLOCK < j->total ? (b + 1) * KEYS_PER_BLOCK : j->total;
#if HAVE_X86
    int vector = nibble_simd_available();
#endif
    for (int t = b * KEYS_PER_BLOCK; t < end; t++) {
        const float *key = j->keys + (size_t)t * j->dim;
#if HAVE_X86
        if (vector) {
            s->scores[t] = score_avx2(j, key);
            continue;
        }
#endif
        s->scores[t] = score_plain(j, key);
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

int index_select(const IndexSelect *j, int threads) {
    float *scores = malloc(sizeof(float) * (size_t)j->total);
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)j->total);
    if (scores == NULL || keys == NULL) {
        free(scores), free(keys);
        return -1;
    }
    ScoreJob s = {j, scores};
    split_run(score_block, &s, (j->total + KEYS_PER_BLOCK - 1) / KEYS_PER_BLOCK, threads);
    for (int t = 0; t < j->total; t++) keys[t] = rank_key(scores[t], t);
    if (j->topk < j->total) select_largest(keys, j->total, j->topk);
    qsort(keys, (size_t)j->topk, sizeof *keys, descending);
    for (int i = 0; i < j->topk; i++) j->chosen[i] = (int64_t)(uint32_t)~(uint32_t)keys[i];
    free(scores), free(keys);
    return 0;
}
