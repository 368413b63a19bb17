/* A MoE layer's routed 4-bit experts with float32 activations (nibble_moe.c): the exact path's counterpart
 * of q8_moe.h, every expert's gate and up matrices as one threaded job, SwiGLU, every down matrix as a
 * second job, then the gate-weighted sum. */
#ifndef COLIBRI_NIBBLE_MOE_H
#define COLIBRI_NIBBLE_MOE_H

#include <stdint.h>

#include "nibble.h"

/* One SwiGLU expert: gate w1 and up w3 [inter, dim], down w2 [dim, inter]. */
typedef struct {
    NibbleMatrix w1, w3, w2;
} NibbleExpert;

/* The expert whose six arrays are at m (w1, its scales, w3, its scales, w2, its scales), of the layout
 * `like` (an expert whose matrices' shapes and kinds are those, its addresses unused). */
NibbleExpert nibble_expert_at(const uint64_t m[6], const NibbleExpert *like);

typedef struct {
    const NibbleExpert *experts; /* in the order their terms are added */
    const int64_t *expert_ids; /* [n_experts]: the id each expert has in `ids` */
    int n_experts;
    const float *x; /* [rows, dim] */
    const int64_t *ids; /* [rows, topk]: each row's routed experts */
    const float *weights; /* [rows, topk]: their gate weights */
    int rows, topk, dim, inter;
    int clamp; /* 1: DeepSeek-V4's swiglu limit (gate <= limit, |up| <= limit) */
    float limit;
    int threads;
    int alone; /* 1: every product nibble_gemm's batch-invariant one (decode rows); 0: a prompt's rows, each
                  expert's in groups of MAX_ROWS through the multi-row loops, as engine/kernels/quant.py's matmul */
    double *out; /* [rows, dim]: out[r] += (double)(weight * expert(x[r])) for each listed expert r routed to */
    const int *segments; /* without alone, or NULL: x's rows in runs of these lengths (n_segments), several prompt
                            chunks, an expert's rows of each grouped as that chunk's own call groups them */
    int n_segments;
} NibbleMoE;

/* Runs the layer; 0 when done, -1 when its work area could not be allocated (nothing was added). With
 * alone, a row's terms are those of its one-row call; without, those of kernel calls on its expert's rows
 * in ascending order, MAX_ROWS at a time (with segments: from the first of each segment's). */
int nibble_moe_run(const NibbleMoE *moe);

#endif
