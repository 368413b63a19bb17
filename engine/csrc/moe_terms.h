/* What the fused routed-expert calls (q8_moe.c, nibble_moe.c) do alike around their matmuls: count an
 * expert's rows, SwiGLU, and add the gate-weighted terms. */
#ifndef COLIBRI_MOE_TERMS_H
#define COLIBRI_MOE_TERMS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* How many of the n routing slots (ids) name expert_id. */
static inline int rows_routed(const int64_t *ids, int n, int64_t expert_id) {
    int rows = 0;
    for (int i = 0; i < n; i++) rows += ids[i] == expert_id;
    return rows;
}

/* gate[i] = silu(gate[i]) * up[i] for n values, both clamped first with a limit (DeepSeek-V4). Each value
 * on its own: the result of a row does not depend on the other rows. */
static inline void swiglu_in_place(float *gate, const float *up, size_t n, int clamp, float limit) {
    for (size_t i = 0; i < n; i++) {
        float g = gate[i], u = up[i];
        if (clamp) {
            g = g > limit ? limit : g;
            u = u > limit ? limit : u < -limit ? -limit : u;
        }
        gate[i] = g / (1.f + expf(-g)) * u;
    }
}

/* Columns [c0, c1) of out[row[i]] += (double)(y[i] * weight[i]) for an expert's n rows (y [n, dim]): the float32
 * product, added in float64, as engine/core/moe.py's RoutedSum adds it. An element's terms are added in the order
 * of the calls, whichever columns a call takes. */
static inline void add_terms_columns(double *out, int dim, int c0, int c1, const int *row, const float *weight, int n,
                                     const float *y) {
    for (int i = 0; i < n; i++) {
        double *into = out + (size_t)row[i] * dim;
        const float *term = y + (size_t)i * dim;
        for (int d = c0; d < c1; d++) into[d] += (double)(term[d] * weight[i]);
    }
}

static inline void add_terms(double *out, int dim, const int *row, const float *weight, int n, const float *y) {
    add_terms_columns(out, dim, 0, dim, row, weight, n, y);
}

#endif
