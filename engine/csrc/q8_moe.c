/*
 * A MoE layer's routed experts with int8 activations, in three threaded phases instead of three
 * kernel calls and a handful of torch ops per expert:
 *
 *   A  g_e = x_e @ w1_e^T, u_e = x_e @ w3_e^T   every expert's two matrices, blocks of 64 output rows
 *   B  h_e = int8(silu(g_e) * u_e)              per expert
 *   C  y_e = h_e @ w2_e^T                       every expert's down matrix, blocks of 64 output rows
 *   D  out[r] += (double)(y_e[r] * weight)      blocks of 256 columns, experts in the given order
 *
 * x_e are the rows routed to expert e; x is quantised once for all rows and each expert's rows are
 * copied from it. Every row is computed the same way whatever the other rows are (the q8 kernels are
 * batch-invariant and B and D work per element), so rows of independent requests stay exact. The
 * term added is the float32 product y * weight, as engine/core/moe.py's RoutedSum adds it.
 */
#include "q8_moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nibble.h"
#include "split.h"
#include "moe_terms.h"

#define BLOCK_ROWS 64 /* output rows per block of phases A and C */
#define SUM_COLUMNS 256 /* columns per block of phase D */
#define PREPARE_ROWS 32 /* rows of x per block of its quantisation */

typedef struct {
    int rows; /* rows of x routed to this expert */
    int *row; /* [rows]: which rows */
    float *weight; /* [rows]: their gate weights */
    Q8Rows x, h; /* the rows quantised for w1/w3, and h for w2 */
    float *gate, *up; /* [rows, inter]; gate then holds h before it is quantised */
    float *y; /* [rows, dim] */
} Term;

typedef struct {
    const Q8MoE *moe;
    Term *terms;
    int blocks_per_matrix; /* phase A: per matrix; phase C: per expert */
    Q8Rows *x_all; /* every row of x quantised once, then copied into each expert's term */
} Phase;

static inline int blocks(int rows) { return (rows + BLOCK_ROWS - 1) / BLOCK_ROWS; }

/* Block b of phase A: expert b / (2 per), w1 or w3, 64 of its output rows. */
static void gate_up_block(void *arg, int b) {
    const Phase *p = arg;
    int per = p->blocks_per_matrix, e = b / (2 * per), up = (b / per) % 2, begin = (b % per) * BLOCK_ROWS;
    const Term *t = &p->terms[e];
    if (t->rows == 0) return;
    int end = begin + BLOCK_ROWS < p->moe->inter ? begin + BLOCK_ROWS : p->moe->inter;
    const Q8Expert *ex = &p->moe->experts[e];
    q8_gemm(up ? &ex->w3 : &ex->w1, &t->x, begin, end, p->moe->isa, (up ? t->up : t->gate) + begin, (size_t)p->moe->inter);
}

/* Phase B for expert e: h = silu(gate) * up, quantised for w2. */
static void swiglu_block(void *arg, int e) {
    const Phase *p = arg;
    const Q8MoE *moe = p->moe;
    Term *t = &p->terms[e];
    swiglu_in_place(t->gate, t->up, (size_t)t->rows * moe->inter, moe->clamp, moe->limit);
    if (t->rows) q8_prepare(moe->experts[e].w2.kind, t->gate, t->rows, moe->inter, moe->isa, &t->h);
}

/* Block b of phase C: expert b / per, 64 output rows of its w2. */
static void down_block(void *arg, int b) {
    const Phase *p = arg;
    int per = p->blocks_per_matrix, e = b / per, begin = (b % per) * BLOCK_ROWS;
    const Term *t = &p->terms[e];
    if (t->rows == 0) return;
    int end = begin + BLOCK_ROWS < p->moe->dim ? begin + BLOCK_ROWS : p->moe->dim;
    q8_gemm(&p->moe->experts[e].w2, &t->h, begin, end, p->moe->isa, t->y + begin, (size_t)p->moe->dim);
}

/* Phase D's columns [b SUM_COLUMNS, ..): every expert's terms, in the given order (each element's order, whatever
 * thread adds it). */
static void sum_block(void *arg, int b) {
    const Phase *p = arg;
    int c0 = b * SUM_COLUMNS, c1 = c0 + SUM_COLUMNS < p->moe->dim ? c0 + SUM_COLUMNS : p->moe->dim;
    for (int e = 0; e < p->moe->n_experts; e++) {
        const Term *t = &p->terms[e];
        add_terms_columns(p->moe->out, p->moe->dim, c0, c1, t->row, t->weight, t->rows, t->y);
    }
}

/* Rows [b PREPARE_ROWS, ..) of x quantised into x_all. */
static void prepare_block(void *arg, int b) {
    const Phase *p = arg;
    const Q8MoE *moe = p->moe;
    int r0 = b * PREPARE_ROWS, n = moe->rows - r0 < PREPARE_ROWS ? moe->rows - r0 : PREPARE_ROWS;
    Q8Rows part = {p->x_all->work + (size_t)r0 * q8_work_bytes(1, moe->dim), 0, 0, 0, NULL};
    q8_prepare(moe->experts[0].w1.kind, moe->x + (size_t)r0 * moe->dim, n, moe->dim, moe->isa, &part);
}

/* Expert e's rows of x_all copied into its term (assign_rows has listed them). */
static void gather_block(void *arg, int e) {
    const Phase *p = arg;
    const Term *t = &p->terms[e];
    size_t row_bytes = q8_work_bytes(1, p->moe->dim);
    for (int i = 0; i < t->rows; i++)
        memcpy(t->x.work + (size_t)i * row_bytes, p->x_all->work + (size_t)t->row[i] * row_bytes, row_bytes);
}

/* Bytes of one expert's work area for n rows (rows, weights, x and h quantised, gate, up, y). */
static size_t term_bytes(const Q8MoE *moe, int n) {
    size_t floats = (size_t)n * (2 * (size_t)moe->inter + (size_t)moe->dim);
    return (size_t)n * (sizeof(int) + sizeof(float)) + q8_work_bytes(n, moe->dim) + q8_work_bytes(n, moe->inter) +
           floats * sizeof(float) + 64;
}

/* Which rows each expert takes, and its part of the work area (one allocation, freed by the caller); x_all holds
 * the layout of the rows (gather_block copies them). */
static void *assign_rows(const Q8MoE *moe, Term *terms, const Q8Rows *x_all) {
    size_t total = 0;
    for (int e = 0; e < moe->n_experts; e++) {
        terms[e].rows = rows_routed(moe->ids, moe->rows * moe->topk, moe->expert_ids[e]);
        total += term_bytes(moe, terms[e].rows);
    }
    char *area = malloc(total > 0 ? total : 1), *at = area;
    if (area == NULL) return NULL;
    for (int e = 0; e < moe->n_experts; e++) {
        Term *t = &terms[e];
        int n = t->rows;
        t->row = (int *)at, at += (size_t)n * sizeof(int);
        t->weight = (float *)at, at += (size_t)n * sizeof(float);
        at += (64 - (uintptr_t)at % 64) % 64; /* what follows is read as vectors */
        t->gate = (float *)at, at += (size_t)n * moe->inter * sizeof(float);
        t->up = (float *)at, at += (size_t)n * moe->inter * sizeof(float);
        t->y = (float *)at, at += (size_t)n * moe->dim * sizeof(float);
        t->x = *x_all, t->x.work = (uint8_t *)at, t->x.rows = n, at += q8_work_bytes(n, moe->dim);
        t->h.work = (uint8_t *)at, at += q8_work_bytes(n, moe->inter);
        int i = 0;
        for (int r = 0; r < moe->rows; r++)
            for (int s = 0; s < moe->topk; s++)
                if (moe->ids[(size_t)r * moe->topk + s] == moe->expert_ids[e])
                    t->row[i] = r, t->weight[i] = moe->weights[(size_t)r * moe->topk + s], i++;
    }
    return area;
}

int q8_layout_valid(const Q8Layout *l) {
    int valid = l->dim >= 1 && l->inter >= 1 && l->kind13 >= 0 && l->kind13 < N_Q8_WEIGHTS && l->kind2 >= 0 &&
                l->kind2 < N_Q8_WEIGHTS && l->scale_kind >= 0 && l->scale_kind < N_SCALE_KINDS &&
                l->group13 >= Q8_BLOCK && l->group13 % Q8_BLOCK == 0 && l->group2 >= Q8_BLOCK && l->group2 % Q8_BLOCK == 0;
    if (!valid) return 0;
    if (l->interleaved == 0) return 1;
    return l->interleaved == 1 && q8_interleavable(l->kind13, l->scale_kind, l->dim, l->inter, l->group13) &&
           q8_interleavable(l->kind2, l->scale_kind, l->inter, l->dim, l->group2);
}

Q8Expert q8_expert_at(const uint64_t m[6], const Q8Layout *l) {
    Q8Expert e = {
        {(const void *)(uintptr_t)m[0], (const void *)(uintptr_t)m[1], l->kind13, l->scale_kind, l->dim, l->group13, l->interleaved},
        {(const void *)(uintptr_t)m[2], (const void *)(uintptr_t)m[3], l->kind13, l->scale_kind, l->dim, l->group13, l->interleaved},
        {(const void *)(uintptr_t)m[4], (const void *)(uintptr_t)m[5], l->kind2, l->scale_kind, l->inter, l->group2, l->interleaved},
    };
    return e;
}

int q8_moe_run(const Q8MoE *moe) {
    if (moe->n_experts == 0) return 0;
    Term *terms = calloc((size_t)moe->n_experts, sizeof(Term));
    Q8Rows x_all = {malloc(q8_work_bytes(moe->rows, moe->dim)), 0, 0, 0, NULL};
    void *area = NULL;
    Phase p = {moe, terms, blocks(moe->inter), &x_all};
    if (terms != NULL && x_all.work != NULL) {
        q8_prepare(moe->experts[0].w1.kind, moe->x, 0, moe->dim, moe->isa, &x_all); /* the layout; rows below */
        x_all.rows = moe->rows;
        split_run(prepare_block, &p, (moe->rows + PREPARE_ROWS - 1) / PREPARE_ROWS, moe->threads);
        area = assign_rows(moe, terms, &x_all);
    }
    if (area == NULL) {
        free(terms), free(x_all.work);
        return -1;
    }
    split_run(gather_block, &p, moe->n_experts, moe->threads);
    split_run(gate_up_block, &p, moe->n_experts * 2 * p.blocks_per_matrix, moe->threads);
    split_run(swiglu_block, &p, moe->n_experts, moe->threads);
    p.blocks_per_matrix = blocks(moe->dim);
    split_run(down_block, &p, moe->n_experts * p.blocks_per_matrix, moe->threads);
    split_run(sum_block, &p, (moe->dim + SUM_COLUMNS - 1) / SUM_COLUMNS, moe->threads);
    free(area), free(terms), free(x_all.work);
    return 0;
}

/* ---------------------------------------------------------------- several matrices, one job */

typedef struct {
    const Q8Product *products;
    int n, isa;
    int first[Q8_MAX_PRODUCTS + 1]; /* product i's blocks are [first[i], first[i + 1]) */
} Many;

static void many_block(void *arg, int b) {
    const Many *job = arg;
    int i = 0;
    while (b >= job->first[i + 1]) i++;
    const Q8Product *p = &job->products[i];
    int begin = (b - job->first[i]) * BLOCK_ROWS, end = begin + BLOCK_ROWS < p->out ? begin + BLOCK_ROWS : p->out;
    q8_gemm(p->m, p->x, begin, end, job->isa, p->y + begin, (size_t)p->out);
}

void q8_gemm_many(const Q8Product *products, int n, int isa, int threads, const SplitSide *side) {
    Many job = {products, n, isa, {0}};
    for (int i = 0; i < n; i++) job.first[i + 1] = job.first[i] + blocks(products[i].out);
    split_run_beside(many_block, &job, job.first[n], threads, side);
}

void q8_gemm_pair(const Q8Matrix *a, int out_a, float *ya, const Q8Matrix *b, int out_b, float *yb, const float *x,
                  int rows, int in, uint8_t *work, int isa, int threads, const SplitSide *side) {
    Q8Rows xa = {work, 0, 0, 0}, xb = {work + q8_work_bytes(rows, in), 0, 0, 0};
    q8_prepare(a->kind, x, rows, in, isa, &xa);
    const Q8Rows *for_b = &xa;
    if (b->kind != a->kind) { /* another layout of the same x */
        q8_prepare(b->kind, x, rows, in, isa, &xb);
        for_b = &xb;
    }
    Q8Product pair[2] = {{a, &xa, out_a, ya}, {b, for_b, out_b, yb}};
    q8_gemm_many(pair, 2, isa, threads, side);
}

/* ---------------------------------------------------------------- one SwiGLU MLP */

int q8_mlp(const Q8Expert *e, const float *x, int rows, int dim, int inter, int clamp, float limit, int isa,
           int threads, const SplitSide *side, float *y) {
    size_t x_bytes = q8_work_bytes(rows, dim), h_bytes = q8_work_bytes(rows, inter);
    size_t hidden = (size_t)rows * inter;
    char *area = malloc(2 * hidden * sizeof(float) + 2 * x_bytes + h_bytes);
    if (area == NULL) return -1;
    float *gate = (float *)area, *up = gate + hidden;
    uint8_t *work = (uint8_t *)(up + hidden);
    Q8Rows h = {work + 2 * x_bytes, 0, 0, 0};
    q8_gemm_pair(&e->w1, inter, gate, &e->w3, inter, up, x, rows, dim, work, isa, threads, side);
    swiglu_in_place(gate, up, hidden, clamp, limit);
    q8_prepare(e->w2.kind, gate, rows, inter, isa, &h);
    Q8Product down = {&e->w2, &h, dim, y};
    q8_gemm_many(&down, 1, isa, threads, NULL);
    free(area);
    return 0;
}
