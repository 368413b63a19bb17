/* The DSA indexer's choice (index_select.c): per query row its scores over every key it sees and the top-k
 * of them, in one call instead of a dozen torch ops per block of rows and layer. */
#ifndef COLIBRI_INDEX_SELECT_H
#define COLIBRI_INDEX_SELECT_H

#include <stdint.h>

typedef struct {
    const float *q;       /* [rows, heads, dim] the roped query heads of consecutive positions */
    const float *weights; /* [rows, heads] their head weights */
    const float *keys;    /* [>= seen + rows - 1, dim] the layer's indexer keys */
    int rows, heads, dim, seen, topk; /* row r sees keys [0, seen + r): its own position is the last */
    float scale;          /* on each head's product before its ReLU: dim^-0.5 */
    int64_t *chosen;      /* [rows, topk]: per row the positions of its topk highest scores, highest first */
} IndexSelect;

/* score[t] = sum_h weights[h] * relu(scale * q[h] . keys[t]) for each row over the keys it sees, split over
 * `threads`; then the positions of its topk highest, highest first, a NaN above every number and among
 * equal scores the lower position first (engine/core/moe.py stable_topk_indices' order). A row that sees fewer
 * than topk keys takes them all, ranked, then the positions after its own in order (what a causal mask of
 * -inf gives the stable sort: fillers the attention's own mask removes). 0, or -1 without memory. */
int index_select(const IndexSelect *job, int threads);

/* Row `row`'s scores over the keys it sees into scores[0, seen + row): what index_select ranks (simd_path 1:
 * the AVX2 / AVX-512VL / NEON loops where the CPU has them, 0 the plain C loop). tools/kernel_bits_harness.c. */
void index_row_scores(const IndexSelect *job, int row, int simd_path, float *scores);

#endif
