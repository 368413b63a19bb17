/* A whole decode step's layers in one call, for models whose routed experts are all resident, with int8
 * activations or on the float32 path (decode_step.c): per layer the fused MLA steps, the FFN norm, the
 * router, the routed experts and the shared expert (or the dense MLP), and the residuals, with no Python
 * between layers. */
#ifndef COLIBRI_DECODE_STEP_H
#define COLIBRI_DECODE_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "decode_ops.h"
#include "mla_decode.h"
#include "nibble_moe.h"
#include "q8_moe.h"

/* What a layer's step reads, described once (engine/mla/fused_decode.py). */
typedef struct {
    const MlaWeights *attn;
    const float *ffn_norm; /* [dim] */
    float ffn_eps;
    int moe;               /* 0: a dense SwiGLU MLP (`mlp`); 1: router, routed experts, optional shared (`mlp`) */
    int has_mlp;           /* the dense MLP, or the shared expert where moe */
    Q8Expert mlp;
    int mlp_inter;
    Router router;         /* moe only; router.topk is the layer's top-k */
    int routed_floats;     /* moe only: 0 the routed experts run with int8 activations (q8_moe.c, `routed`), 1 on
                            * float32 x (nibble_moe.c, `nibble`) */
    Q8Layout routed;       /* their layout, int8 activations */
    NibbleExpert nibble;   /* their layout, float32 x: the matrices' shapes and kinds (addresses unused) */
    int stops;             /* a DSA layer with its own indexer: the step returns after the rows' projections */
} LayerPlan;

/* What a layer's step reads of one row this token. */
typedef struct {
    const uint64_t *table; /* moe only: [router.experts, 6] each expert's w1, scales, w3, scales, w2, scales */
    float *latents;        /* the row's cache [total, rank], its last row written by this step */
    float *rope_keys;      /* [total, rope] */
    int total;             /* positions in the cache, the new one included */
    const int64_t *positions; /* DSA: the [count] cached positions this row attends to, or NULL: all of them */
    int count;
} LayerStep;

/* Where a step resumes or stopped: before layer `layer`, or, with `projected`, after every row's projections
 * at `layer` (a DSA layer: the indexer ran on them in between, its selections are now in the rows' steps). */
typedef struct {
    int layer, projected;
} DecodePoint;

/* What the rows' attention carries from their projections to their outputs, across a stop: per row the
 * attention norm's output and the q latent (what a DSA indexer reads), q's nope and rope parts; row r's at
 * r * its ld floats. */
typedef struct {
    float *normed, *q_latent, *q_nope, *q_rope;
    size_t normed_ld, q_latent_ld, q_nope_ld, q_rope_ld;
} DecodeCarry;

/* The rows x [rows, dim] (in: their embeddings, out: the hidden states before the final norm) through n
 * layers from `at` on, row r at the position whose rope angles are cos, sin [rows, rope / 2], with steps [n, rows].
 * Per layer every row's projections (each writes its cache row), then every row's attention (rows of one
 * sequence, a verify step, see the rows before them: written by then), then the FFN over all rows: each
 * routed expert of their union once for every row routed to it. ids [n, topk_max] gets each MoE layer's union in id order (-1 after it, and on dense
 * layers). The same kernels in the same order as the module path (engine/mla/model.py forward_rows), each row's
 * bits its solo step's (the kernels are batch-invariant). A layer that `stops`
 * returns 1 after the rows' projections with `at` set there: the caller runs the indexer on `carry` and
 * calls again from `at` (steps, carry, x as it left them). 0 when done, or -1 without memory (x and the
 * caches then hold a partial step). */
int decode_layers(const LayerPlan *const *plans, const LayerStep *steps, int n, int rows, float *x, const float *cos,
                  const float *sin, int64_t *ids, int topk_max, const DecodeCarry *carry, DecodePoint *at, int isa,
                  int threads);

#endif
