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

/* A long prompt's indexer scores without the top-k (engine/mla/index_blocks.py keeps a running one): for query
 * rows against a range of keys stored as columns, which a key block loads as whole vectors. */
typedef struct {
    const float *q;       /* [rows, heads, dim] the roped query heads */
    const float *weights; /* [rows, heads] their head weights */
    const float *keys_t;  /* [dim, key_stride] the keys as columns, the first one scored at column 0 */
    int rows, heads, dim, keys, key_stride; /* keys: columns scored, [0, keys) */
    float scale;          /* on each head's product before its ReLU: dim^-0.5 */
    float *scores;        /* [rows, score_stride]: row r's scores of the keys in its first `keys` */
    int score_stride;
} IndexTiles;

/* scores[r, t] = sum_h weights[r, h] * relu(scale * q[r, h] . keys_t[:, t]), each dot and the head sum fused
 * multiply-adds in order from zero, so the plain C loop (simd 0), AVX2, AVX-512 and NEON (simd 1, where the
 * CPU has them) give the same bits; split over `threads` in blocks of (row, 256 keys). No causal mask. */
void index_tile_scores(const IndexTiles *job, int simd, int threads);

#endif
