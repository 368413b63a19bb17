/* A MoE layer's routed experts with int8 activations (q8_moe.c): every expert's gate and up matrices
 * as one threaded job, SwiGLU, every down matrix as a second job, then the gate-weighted sum. */
#ifndef COLIBRI_Q8_MOE_H
#define COLIBRI_Q8_MOE_H

#include <stdint.h>

#include "q8.h"
#include "split.h"

/* One SwiGLU expert: gate w1 and up w3 [inter, dim], down w2 [dim, inter]; w1 and w3 of one kind. */
typedef struct {
    Q8Matrix w1, w3, w2;
} Q8Expert;

/* What a layer's routed experts share: width, code kinds (w1/w3, w2), scale kind, group sizes, and whether
 * their three matrices are in q8.h's interleaved layout (each matrix's codes and scales at its codes'
 * address; the scale addresses are unused). */
typedef struct {
    int dim, inter, kind13, kind2, scale_kind, group13, group2, interleaved;
} Q8Layout;

/* 1 when the q8 kernels take experts of this layout (interleaved: when both shapes are q8_interleavable). */
int q8_layout_valid(const Q8Layout *layout);

/* The expert whose six arrays are at m (w1, its scales, w3, its scales, w2, its scales). */
Q8Expert q8_expert_at(const uint64_t m[6], const Q8Layout *layout);

typedef struct {
    const Q8Expert *experts; /* in the order their terms are added */
    const int64_t *expert_ids; /* [n_experts]: the id each expert has in `ids` */
    int n_experts;
    const float *x; /* [rows, dim] */
    const int64_t *ids; /* [rows, topk]: each row's routed experts */
    const float *weights; /* [rows, topk]: their gate weights */
    int rows, topk, dim, inter;
    int clamp; /* 1: DeepSeek-V4's swiglu limit (gate <= limit, |up| <= limit) */
    float limit;
    int isa, threads; /* isa: q8.h Q8_ISA_*, the best instruction set to use */
    double *out; /* [rows, dim]: out[r] += weight * expert(x[r]) for each listed expert r routed to */
} Q8MoE;

/* Runs the layer; 0 when done, -1 when its work area could not be allocated (nothing was added). */
int q8_moe_run(const Q8MoE *moe);

/* One matrix of a q8_gemm_many job: y [x->rows, out] = x times m's rows. */
typedef struct {
    const Q8Matrix *m;
    const Q8Rows *x;
    int out;
    float *y;
} Q8Product;

#define Q8_MAX_PRODUCTS 8

/* Several products (at most Q8_MAX_PRODUCTS), their output rows in blocks of 64, as one threaded job:
 * matrices that read the same input (a layer's q and kv projections) share one wake-up and one split.
 * side (or NULL): the caller's work beside the job (split_run_beside). */
void q8_gemm_many(const Q8Product *products, int n, int isa, int threads, const SplitSide *side);

/* ya = a x and yb = b x for x [rows, in] (a.in == b.in), as one q8_gemm_many job: x is quantised once,
 * or once per weight layout when the two differ. work: q8_work_bytes(rows, in) * 2 bytes. */
void q8_gemm_pair(const Q8Matrix *a, int out_a, float *ya, const Q8Matrix *b, int out_b, float *yb, const float *x,
                  int rows, int in, uint8_t *work, int isa, int threads, const SplitSide *side);

/* y [rows, dim] = w2(silu(w1 x) * w3 x) for x [rows, dim] (a shared expert, a dense layer's FFN): the
 * gate and up matrices as one threaded job (side, or NULL, beside it: split_run_beside), the down matrix
 * as a second; clamped as q8_moe with a limit. 0, or -1 without memory (nothing written, side not run). */
int q8_mlp(const Q8Expert *e, const float *x, int rows, int dim, int inter, int clamp, float limit, int isa,
           int threads, const SplitSide *side, float *y);

#endif
