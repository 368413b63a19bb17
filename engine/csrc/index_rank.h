/* The DSA indexer's order as integers (index_select.c, index_choose.c): a score and its position packed so that
 * a larger key is the better choice, and the selection and sort over such keys. */
#ifndef COLIBRI_INDEX_RANK_H
#define COLIBRI_INDEX_RANK_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* A score and its position as one integer whose order is the choice's: higher score first (any NaN above
 * every number, -0 equal to +0), then the lower position. */
static inline uint64_t rank_key(float score, int position) {
    uint32_t bits;
    if (isnan(score)) bits = UINT32_MAX;
    else {
        if (score == 0.f) score = 0.f;
        memcpy(&bits, &score, sizeof bits);
        bits = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    }
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)position;
}

static inline void swap(uint64_t *a, uint64_t *b) {
    uint64_t t = *a;
    *a = *b, *b = t;
}

/* Moves the k largest of keys[0, n) to keys[0, k) (in no order): quickselect with a median-of-three pivot. */
static inline void select_largest(uint64_t *keys, int n, int k) {
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

static inline int descending(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The score a rank key holds (NaN for a NaN's key; -0 comes back as +0). */
static inline float rank_score(uint64_t key) {
    uint32_t bits = (uint32_t)(key >> 32);
    if (bits == UINT32_MAX) return NAN;
    bits = bits & 0x80000000u ? bits & 0x7FFFFFFFu : ~bits; /* rank_key's map, undone */
    float score;
    memcpy(&score, &bits, sizeof score);
    return score;
}

/* The position a rank key holds. */
static inline int64_t rank_position(uint64_t key) { return (int64_t)(uint32_t)~(uint32_t)key; }

#endif
