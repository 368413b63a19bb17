/* The small float ops of a decode step in C (decode_ops.c): RMSNorm, the router, absorbed MLA attention for
 * one query, the DSA indexer's key and query heads after their projection. Float32 throughout, rounding as
 * C sums it (not as torch does): every row of the int8 path, decode rows of the exact path
 * (engine/kernels/decode_ops.py small_ops_take). */
#ifndef COLIBRI_DECODE_OPS_H
#define COLIBRI_DECODE_OPS_H

#include <stdint.h>

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for rows r of x [rows, dim]. */
void rms_norm_rows(const float *x, int rows, int dim, const float *w, float eps, float *out);

/* The DSA indexer's vectors after their projection, rows [rows, heads, dim] of positions (row r at angles
 * cos/sin [r % period, rope / 2]): with ln_weight, each row's LayerNorm (ln_weight, ln_bias, eps: the key);
 * then each head's first `rope` values rotated, engine/core/rope.py apply_rope's output (half-split: x1 * cos -
 * x2 * sin, then x2 * cos + x1 * sin, x1/x2 the even/odd values if interleaved, else the halves), the rest
 * as they are. out may not alias x. */
typedef struct {
    const float *ln_weight, *ln_bias; /* [dim], or NULL: no norm */
    float eps;
    int rope, interleaved, period;
    const float *cos, *sin; /* [period, rope / 2] */
} IndexFinish;

void index_finish_rows(const IndexFinish *how, const float *x, int rows, int heads, int dim, float *out);

enum { SCORE_SIGMOID = 0, SCORE_SOFTMAX = 1, SCORE_SQRTSOFTPLUS = 2 };

typedef struct {
    const float *weight; /* [experts, dim] router weight */
    const float *bias;   /* [experts] correction bias (steers the choice only), or NULL */
    int experts, dim, score, groups, topk_groups, topk, normalise;
    float scale; /* route_scale */
    int ld;      /* floats from one expert's weight row to the next; 0: dim (rows padded for alignment are wider) */
} Router;

/* Per row of x [rows, dim]: scores of every expert, the top-k of the biased scores (ties: the lower
 * index) within the best topk_groups groups (a group ranked by the sum of its two best biased scores),
 * ids [rows, topk] from the highest, weights [rows, topk] the unbiased scores (normalised if asked)
 * times scale. 0, or -1 without memory. */
int route_rows(const Router *router, const float *x, int rows, int64_t *ids, float *weights);

/* 1 when route_rows takes this router: known score, groups that split the experts evenly into at least two
 * each, top-k within the allowed groups, rows at least dim floats apart. */
int router_valid(const Router *router);

/* wkv_b [H * (n + v), c]: per head n rows of its k part, then v rows of its v part; float32 or int8
 * codes with one float32 scale per `group` columns. */
typedef struct {
    const void *w;
    const float *scales; /* int8 only: [H * (n + v), ceil(c / group)] */
    int int8, group;
} KvB;

typedef struct {
    const float *q_nope;   /* [H, n] */
    const float *q_rope;   /* [H, r], roped */
    const float *latents;  /* [T, c], normalised */
    const float *rope_keys; /* [T, r], roped */
    const int64_t *positions; /* [K] the positions attended to (DSA), or NULL: all T */
    int total;             /* T, or K with positions */
    int heads, nope, rope, value, rank;
    float softmax_scale;
    KvB kv_b;
    float *out; /* [H, v] */
} AttendOne;

/* softmax(scale * (q_nope W_k . latents + q_rope . rope_keys)) . latents W_v^T per head, the heads
 * split over `threads`. 0, or -1 without memory. */
int attend_one(const AttendOne *job, int threads);

/* tools/kernel_bits_harness.c's window on the vector helpers: out[0] = a . b, out[1] = the int8 row q (group
 * scales) . b, out[2..3] = 0, out[4..4+n) = b + 0.375 a, out[4+n..4+2n) = b - 1.25 q*scales; simd_path 0 the
 * plain C helpers, 1 the AVX2 / NEON ones where the CPU has them. */
void decode_ops_probe(int simd_path, const float *a, const float *b, const int8_t *q, const float *scales, int group, int n,
                      float *out);

#endif
