/*
 * A long prompt's running top-k of the DSA indexer (engine/mla/index_blocks.py): each slab of scores (a query
 * block against keys first.., index_tile_scores) merged into every row's best so far, kept as index_rank.h's keys
 * (higher score first, a NaN above every number, ties to the lower position: index_select's order), so the final
 * positions are the ones one ranking of the whole causal row gives. torch spent a compare, a compaction, two
 * concatenations and a sort per slab on it (~18% of a 26k-token agent request's first token).
 *
 * Per row only the scores that can enter are ranked: past the first slab those above the row's worst kept score;
 * in the first, those at least the topk-th largest of the slab's chunk maxima (topk chunks reach it, each with a
 * distinct score at least that high, so the row's topk-th best does too). Keys after a row's own position count
 * as -inf: below every score it sees, and among themselves by position, so they only fill a row that sees fewer
 * than topk keys.
 */
#include "index_choose.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "index_rank.h"
#include "split.h"

enum { CHOICE_ROWS = 16, MAX_CHUNK = 64 }; /* rows per block of the threads' split; keys per chunk at most */

typedef struct {
    const IndexChoice *c;
    int failed; /* a block without memory: set by any thread, read after the split */
} ChoiceJob;

/* Keys the row sees in this slab: those up to its own position. */
static int visible_keys(const IndexChoice *c, int row) {
    int visible = c->position + row + 1 - c->first;
    return visible < 0 ? 0 : visible > c->width ? c->width : visible;
}

/* The largest of scores[0, n) (n a multiple of 8), and whether one is NaN. x86: SSE2 (every x86-64 CPU has it),
 * two vectors of maxima; elsewhere eight scalar ones, so no compare waits on the one before. Which score is the
 * largest does not depend on how they are compared, so both give the same floor. */
#if defined(__x86_64__)
static float chunk_max(const float *scores, int n, int *nan) {
    __m128 a = _mm_loadu_ps(scores), b = _mm_loadu_ps(scores + 4), odd = _mm_setzero_ps();
    for (int t = 0; t < n; t += 8) {
        __m128 u = _mm_loadu_ps(scores + t), v = _mm_loadu_ps(scores + t + 4);
        odd = _mm_or_ps(odd, _mm_or_ps(_mm_cmpunord_ps(u, u), _mm_cmpunord_ps(v, v)));
        a = _mm_max_ps(u, a), b = _mm_max_ps(v, b); /* u > a ? u : a */
    }
    float most[8];
    _mm_storeu_ps(most, a), _mm_storeu_ps(most + 4, b);
    float best = most[0];
    for (int i = 1; i < 8; i++) best = most[i] > best ? most[i] : best;
    *nan |= _mm_movemask_ps(odd) != 0;
    return best;
}
#else
static float chunk_max(const float *scores, int n, int *nan) {
    float most[8];
    int any_nan = 0;
    for (int i = 0; i < 8; i++) most[i] = scores[i];
    for (int t = 0; t < n; t += 8)
        for (int i = 0; i < 8; i++) {
            float v = scores[t + i];
            any_nan |= v != v;
            most[i] = v > most[i] ? v : most[i];
        }
    float best = most[0];
    for (int i = 1; i < 8; i++) best = most[i] > best ? most[i] : best;
    *nan |= any_nan;
    return best;
}
#endif

/* The first slab's floor: the topk-th largest of the maxima of chunks of the visible scores (at least 4 topk
 * chunks of 8 to MAX_CHUNK keys, a multiple of 8; the keys past the last whole chunk one more); -inf where that
 * cut would not pay or a score is NaN (then every score is a candidate). maxima: room for visible / 8 + 1. */
static float chunk_floor(const float *scores, int visible, int topk, uint64_t *maxima) {
    int chunk = visible / (4 * topk) / 8 * 8, nan = 0, n = 0;
    chunk = chunk > MAX_CHUNK ? MAX_CHUNK : chunk;
    if (chunk < 8) return -INFINITY;
    int whole = visible / chunk * chunk;
    for (int begin = 0; begin < whole; begin += chunk) maxima[n++] = rank_key(chunk_max(scores + begin, chunk, &nan), 0);
    if (whole < visible) {
        float most = scores[whole];
        for (int t = whole; t < visible; t++) {
            nan |= scores[t] != scores[t];
            most = scores[t] > most ? scores[t] : most;
        }
        maxima[n++] = rank_key(most, 0);
    }
    if (nan) return -INFINITY;
    select_largest(maxima, n, topk);
    uint64_t floor_key = maxima[0];
    for (int i = 1; i < topk; i++) floor_key = maxima[i] < floor_key ? maxima[i] : floor_key;
    return rank_score(floor_key);
}

/* Row `row`: its kept keys and the slab's candidates into work, the topk best back into its ranks, best first. */
static void choose_row(const IndexChoice *c, int row, uint64_t *work) {
    const float *scores = c->slab + (size_t)row * c->slab_stride;
    uint64_t *best = c->ranks + (size_t)row * c->topk;
    int visible = visible_keys(c, row), n = 0;
    if (c->merged) {
        uint64_t worst = best[c->topk - 1];
        float worst_score = rank_score(worst); /* a score at most this never enters (its position is later) */
        for (int i = 0; i < c->topk; i++) work[n++] = best[i];
        for (int t = 0; t < visible; t++) {
            if (scores[t] <= worst_score) continue;
            uint64_t key = rank_key(scores[t], c->first + t);
            if (key > worst) work[n++] = key;
        }
    } else {
        float floor = chunk_floor(scores, visible, c->topk, work);
        int t = 0;
#if defined(__x86_64__)
        for (__m128 f = _mm_set1_ps(floor); t + 8 <= visible; t += 8) { /* 8 scores a compare, most all below */
            __m128 below = _mm_and_ps(_mm_cmplt_ps(_mm_loadu_ps(scores + t), f), _mm_cmplt_ps(_mm_loadu_ps(scores + t + 4), f));
            if (_mm_movemask_ps(below) == 15) continue;
            for (int i = t; i < t + 8; i++)
                if (!(scores[i] < floor)) work[n++] = rank_key(scores[i], c->first + i);
        }
#endif
        for (; t < visible; t++)
            if (!(scores[t] < floor)) work[n++] = rank_key(scores[t], c->first + t); /* NaN: in */
    }
    int kept = n < c->topk ? n : c->topk;
    if (kept < n) select_largest(work, n, kept);
    qsort(work, (size_t)kept, sizeof *work, descending);
    memcpy(best, work, sizeof *work * (size_t)kept);
    for (int i = kept; i < c->topk; i++) best[i] = rank_key(-INFINITY, c->first + visible + (i - kept)); /* fillers */
}

static void choose_block(void *arg, int b) {
    ChoiceJob *s = arg;
    const IndexChoice *c = s->c;
    uint64_t *work = malloc(sizeof *work * ((size_t)c->topk + (size_t)c->width));
    if (work == NULL) {
        __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int end = (b + 1) * CHOICE_ROWS < c->rows ? (b + 1) * CHOICE_ROWS : c->rows;
    for (int row = b * CHOICE_ROWS; row < end; row++) choose_row(c, row, work);
    free(work);
}

int index_tile_choose(const IndexChoice *c, int threads) {
    ChoiceJob s = {c, 0};
    split_run(choose_block, &s, (c->rows + CHOICE_ROWS - 1) / CHOICE_ROWS, threads);
    return s.failed ? -1 : 0;
}
