/*
 * A MoE layer's routed 4-bit experts with float32 activations (the default, exact path), in three threaded
 * phases instead of three kernel calls and a handful of torch ops per expert:
 *
 *   A  g_e = x_e @ w1_e^T, u_e = x_e @ w3_e^T   every expert's two matrices, blocks of 64 output rows
 *   B  h_e = silu(g_e) * u_e                    per expert, laid out for w2
 *   C  y_e = h_e @ w2_e^T                       every expert's down matrix, blocks of 64 output rows
 *   D  out[r] += (double)(y_e[r] * weight)      on the caller, experts in the given order
 *
 * x_e are the rows routed to expert e, laid out for the kernel (nibble_prepare) in groups of MAX_ROWS.
 * Decode rows (alone): every product is nibble_gemm's alone one, what a one-row kernel call gives the row,
 * so rows of independent requests stay exact. A prompt's rows: each group through the multi-row loops,
 * the bits engine/kernels/quant.py's matmul gives the expert's rows (kernel_matmul, MAX_ROWS rows a call). Several
 * prompt chunks (segments): an expert's rows of each chunk grouped from that chunk's first, as the chunk's
 * own call groups them, while the expert's weights are read once for all of them.
 */
#include "nibble_moe.h"

#include <stdlib.h>
#include <string.h>

#include "split.h"
#include "moe_terms.h"

#define BLOCK_ROWS 64 /* output rows per block of phases A and C: nibble_gemm's buffer below */

typedef struct {
    int rows; /* rows of x routed to this expert */
    int groups; /* the kernel calls they go through */
    int *group; /* [groups]: rows in each (MAX_ROWS at most), in row order */
    int *row; /* [rows]: which rows */
    float *weight; /* [rows]: their gate weights */
    float *xs, *hs; /* x for w1/w3 and h for w2, nibble_prepare'd per group of MAX_ROWS rows */
    float *gate, *up; /* [rows, inter]; gate then holds h */
    float *y; /* [rows, dim] */
} Term;

typedef struct {
    const NibbleMoE *moe;
    Term *terms;
    int blocks_per_matrix; /* phase A: per matrix; phase C: per expert */
} Phase;

static inline int blocks(int n) { return (n + BLOCK_ROWS - 1) / BLOCK_ROWS; }

/* y [rows, out] (row stride `out`) rows [begin, end) = the prepared rows times m, one call per group. */
static void product(const NibbleMatrix *m, const float *prepared, const Term *t, int begin, int end, float *y, int out,
                    int alone) {
    float tmp[MAX_ROWS * BLOCK_ROWS];
    size_t group_floats = nibble_work_floats(m, MAX_ROWS);
    int n = end - begin;
    for (int i = 0, first = 0; i < t->groups; first += t->group[i++]) {
        int g = t->group[i];
        nibble_gemm(m, prepared + (size_t)i * group_floats, g, begin, end, 2, alone, tmp);
        for (int r = 0; r < g; r++) memcpy(y + (size_t)(first + r) * out + begin, tmp + (size_t)r * n, n * sizeof(float));
    }
}

/* x [rows, in] (row stride in) -> prepared, group by group, each group's layout nibble_prepare's. */
static void prepare_groups(const NibbleMatrix *m, const float *x, const Term *t, float *prepared) {
    size_t group_floats = nibble_work_floats(m, MAX_ROWS);
    for (int i = 0, first = 0; i < t->groups; first += t->group[i++])
        nibble_prepare(m, x + (size_t)first * m->in, t->group[i], prepared + (size_t)i * group_floats);
}

/* Block b of phase A: expert b / (2 per), w1 or w3, 64 of its output rows. */
static void gate_up_block(void *arg, int b) {
    const Phase *p = arg;
    int per = p->blocks_per_matrix, e = b / (2 * per), up = (b / per) % 2, begin = (b % per) * BLOCK_ROWS;
    const Term *t = &p->terms[e];
    if (t->rows == 0) return;
    int inter = p->moe->inter, end = begin + BLOCK_ROWS < inter ? begin + BLOCK_ROWS : inter;
    const NibbleExpert *ex = &p->moe->experts[e];
    product(up ? &ex->w3 : &ex->w1, t->xs, t, begin, end, up ? t->up : t->gate, inter, p->moe->alone);
}

/* Phase B for expert e: h = silu(gate) * up, prepared for w2. */
static void swiglu_block(void *arg, int e) {
    const Phase *p = arg;
    const NibbleMoE *moe = p->moe;
    Term *t = &p->terms[e];
    swiglu_in_place(t->gate, t->up, (size_t)t->rows * moe->inter, moe->clamp, moe->limit);
    prepare_groups(&moe->experts[e].w2, t->gate, t, t->hs);
}

/* Block b of phase C: expert b / per, 64 output rows of its w2. */
static void down_block(void *arg, int b) {
    const Phase *p = arg;
    int per = p->blocks_per_matrix, e = b / per, begin = (b % per) * BLOCK_ROWS;
    const Term *t = &p->terms[e];
    if (t->rows == 0) return;
    int dim = p->moe->dim, end = begin + BLOCK_ROWS < dim ? begin + BLOCK_ROWS : dim;
    product(&p->moe->experts[e].w2, t->hs, t, begin, end, t->y, dim, p->moe->alone);
}

/* Floats of a prepared area of m for `groups` groups, as prepare_groups lays them. */
static size_t prepared_floats(const NibbleMatrix *m, int groups) { return (size_t)groups * nibble_work_floats(m, MAX_ROWS); }

/* Bytes of one expert's work area for n rows in `groups` groups. */
static size_t term_bytes(const NibbleMoE *moe, const NibbleExpert *ex, int n, int groups) {
    size_t floats = (size_t)n * (2 * (size_t)moe->inter + 2 * (size_t)moe->dim) + prepared_floats(&ex->w1, groups) +
                    prepared_floats(&ex->w2, groups);
    return (size_t)n * (sizeof(int) + sizeof(float)) + (size_t)groups * sizeof(int) + floats * sizeof(float) + 64;
}

/* The rows routed to expert `id` in ascending order and their groups: MAX_ROWS at a time, a new group at the
 * first row of each segment (moe->segments; none: one run of every row). Counts them into t->rows and
 * t->groups; fills t->row, t->weight and t->group where they are set. */
static void route_rows(const NibbleMoE *moe, int64_t id, Term *t) {
    int n = 0, groups = 0, in_group = 0, segment = 0;
    int segment_end = moe->n_segments > 0 ? moe->segments[0] : moe->rows;
    for (int r = 0; r < moe->rows; r++) {
        while (r == segment_end && segment + 1 < moe->n_segments) segment_end += moe->segments[++segment], in_group = 0;
        for (int s = 0; s < moe->topk; s++) {
            if (moe->ids[(size_t)r * moe->topk + s] != id) continue;
            if (in_group == 0 || in_group == MAX_ROWS) groups++, in_group = 0;
            if (t->group != NULL) t->group[groups - 1] = ++in_group;
            else in_group++;
            if (t->row != NULL) t->row[n] = r, t->weight[n] = moe->weights[(size_t)r * moe->topk + s];
            n++;
        }
    }
    t->rows = n, t->groups = groups;
}

/* Which rows each expert takes, their x prepared, and its part of the work area (one allocation, freed by the
 * caller); the x rows are gathered into each term's y, which phase C overwrites. */
static void *assign_rows(const NibbleMoE *moe, Term *terms) {
    size_t total = 0;
    for (int e = 0; e < moe->n_experts; e++) {
        route_rows(moe, moe->expert_ids[e], &terms[e]);
        total += term_bytes(moe, &moe->experts[e], terms[e].rows, terms[e].groups);
    }
    char *area = malloc(total > 0 ? total : 1), *at = area;
    if (area == NULL) return NULL;
    for (int e = 0; e < moe->n_experts; e++) {
        Term *t = &terms[e];
        const NibbleExpert *ex = &moe->experts[e];
        int n = t->rows;
        t->row = (int *)at, at += (size_t)n * sizeof(int);
        t->weight = (float *)at, at += (size_t)n * sizeof(float);
        t->group = (int *)at, at += (size_t)t->groups * sizeof(int);
        at += (64 - (uintptr_t)at % 64) % 64; /* what follows is read as vectors */
        t->gate = (float *)at, at += (size_t)n * moe->inter * sizeof(float);
        t->up = (float *)at, at += (size_t)n * moe->inter * sizeof(float);
        t->y = (float *)at, at += (size_t)n * moe->dim * sizeof(float);
        t->xs = (float *)at, at += prepared_floats(&ex->w1, t->groups) * sizeof(float);
        t->hs = (float *)at, at += prepared_floats(&ex->w2, t->groups) * sizeof(float);
        route_rows(moe, moe->expert_ids[e], t);
        for (int i = 0; i < n; i++)
            memcpy(t->y + (size_t)i * moe->dim, moe->x + (size_t)t->row[i] * moe->dim, moe->dim * sizeof(float));
        prepare_groups(&ex->w1, t->y, t, t->xs); /* w1 and w3 read x alike: one layout for both */
    }
    return area;
}

int nibble_moe_run(const NibbleMoE *moe) {
    if (moe->n_experts == 0) return 0;
    Term *terms = calloc((size_t)moe->n_experts, sizeof(Term));
    void *area = terms != NULL ? assign_rows(moe, terms) : NULL;
    if (area == NULL) {
        free(terms);
        return -1;
    }
    Phase p = {moe, terms, blocks(moe->inter)};
    split_run(gate_up_block, &p, moe->n_experts * 2 * p.blocks_per_matrix, moe->threads);
    split_run(swiglu_block, &p, moe->n_experts, moe->threads);
    p.blocks_per_matrix = blocks(moe->dim);
    split_run(down_block, &p, moe->n_experts * p.blocks_per_matrix, moe->threads);
    for (int e = 0; e < moe->n_experts; e++) /* in the given order */
        add_terms(moe->out, moe->dim, terms[e].row, terms[e].weight, terms[e].rows, terms[e].y);
    free(area), free(terms);
    return 0;
}

NibbleExpert nibble_expert_at(const uint64_t m[6], const NibbleExpert *like) {
    NibbleExpert e = *like;
    e.w1.q = (const uint8_t *)(uintptr_t)m[0], e.w1.scales = (const void *)(uintptr_t)m[1];
    e.w3.q = (const uint8_t *)(uintptr_t)m[2], e.w3.scales = (const void *)(uintptr_t)m[3];
    e.w2.q = (const uint8_t *)(uintptr_t)m[4], e.w2.scales = (const void *)(uintptr_t)m[5];
    return e;
}
