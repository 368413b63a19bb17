/* A long prompt's running top-k of the DSA indexer (index_choose.c). */
#ifndef COLIBRI_INDEX_CHOOSE_H
#define COLIBRI_INDEX_CHOOSE_H

#include <stdint.h>

/* A long prompt's running top-k (index_choose.c): per row its topk best keys so far (index_rank.h's rank_key,
 * best first), merged with a slab of its scores. */
typedef struct {
    const float *slab;  /* [rows, slab_stride]: row r's scores of keys first .. first + width */
    int rows, width, slab_stride, first;
    int position;       /* row r's own position is position + r: the keys after it count as -inf */
    int topk;
    int merged;         /* 0: the first slab (width >= topk; ranks written), 1: ranks hold each row's topk best */
    uint64_t *ranks;    /* [rows, topk] */
} IndexChoice;

/* Each row's topk best of its kept keys and the slab's, best first: index_select's order (higher score, a NaN
 * above every number, ties to the lower position), the keys after a row's position as -inf fillers; split over
 * `threads` in blocks of rows. 0, or -1 without memory (ranks then partly merged). */
int index_tile_choose(const IndexChoice *choice, int threads);

#endif
