/* The DSA indexer's choice for one decode row (index_select.c): its scores over every cached key and the
 * top-k of them, in one call instead of a dozen torch ops per row and layer. */
#ifndef COLIBRI_INDEX_SELECT_H
#define COLIBRI_INDEX_SELECT_H

#include <stdint.h>

typedef struct {
    const float *q;       /* [heads, dim] the row's roped query heads */
    const float *weights; /* [heads] its head weights */
    const float *keys;    /* [total, dim] the layer's indexer keys, the row's own position last */
    int heads, dim, total, topk;
    float scale;          /* on each head's product before its ReLU: dim^-0.5 */
    int64_t *chosen;      /* [topk]: the positions of the topk highest scores, highest first */
} IndexSelect;

/* score[t] = sum_h weights[h] * relu(scale * q[h] . keys[t]), the keys split over `threads`; then the
 * positions of the topk highest, highest first, a NaN above every number and among equal scores the lower
 * position first (engine/moe.py stable_topk_indices' order). topk <= total. 0, or -1 without memory. */
int index_select(const IndexSelect *job, int threads);

#endif
