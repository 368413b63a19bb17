/*
 * One decode step's layers for an int8-activation model whose routed experts are all resident
 * (engine/fused_decode.py), each layer as the module path runs it:
 *
 *   attention  mla_project (attn_norm, projections, rope, the cache's new row), mla_output (attention,
 *              wo, residual): mla_decode.c
 *   FFN        h = ffn_norm(x); dense: x += mlp(h)
 *              MoE: route h; routed = sum of weight * expert(h) over the chosen experts in id order
 *              (q8_moe.c, float64); x += (float)routed + shared(h)
 *
 * Why: between those kernels the module path ran ~0.4 ms of Python per layer (module calls, the
 * store's acquire and release, routing glue), a third of a token on the bench model once the experts
 * were resident (docs/benchmarks.md, "One call per decode step"). The kernels, their order and the
 * float32 residual adds are the module path's, so the bits are the same.
 */
#include "decode_step.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    float *normed, *q_latent, *q_nope, *q_rope; /* mla_project's outputs */
    float *h, *mlp;                             /* [dim]: the FFN's input and the dense or shared MLP's output */
    double *routed;                             /* [dim] */
    int64_t *sorted;                            /* [topk]: the chosen experts in id order */
    float *weights;                             /* [topk] */
    Q8Expert *experts;                          /* [topk] */
} Scratch;

/* The largest of every layer's sizes, so one scratch serves all. */
static void *scratch_for(const LayerPlan *const *plans, int n, Scratch *s) {
    size_t dim = 1, q_rank = 1, nope = 1, rope = 1, topk = 1;
    for (int l = 0; l < n; l++) {
        const MlaWeights *w = plans[l]->attn;
        dim = (size_t)w->dim > dim ? (size_t)w->dim : dim;
        q_rank = (size_t)w->q_rank > q_rank ? (size_t)w->q_rank : q_rank;
        nope = (size_t)w->heads * w->nope > nope ? (size_t)w->heads * w->nope : nope;
        rope = (size_t)w->heads * w->rope > rope ? (size_t)w->heads * w->rope : rope;
        if (plans[l]->moe && (size_t)plans[l]->router.topk > topk) topk = (size_t)plans[l]->router.topk;
    }
    size_t floats = 3 * dim + q_rank + nope + rope + topk;
    char *area = malloc(dim * sizeof(double) + topk * (sizeof(int64_t) + sizeof(Q8Expert)) + floats * sizeof(float));
    if (area == NULL) return NULL;
    s->routed = (double *)area;
    s->sorted = (int64_t *)(s->routed + dim);
    s->experts = (Q8Expert *)(s->sorted + topk);
    s->normed = (float *)(s->experts + topk);
    s->q_latent = s->normed + dim, s->q_nope = s->q_latent + q_rank, s->q_rope = s->q_nope + nope;
    s->h = s->q_rope + rope, s->mlp = s->h + dim, s->weights = s->mlp + dim;
    return area;
}

static int attention(const MlaWeights *w, const LayerStep *step, float *x, const float *cos, const float *sin,
                     int total, Scratch *s, int isa, int threads) {
    float *latent = step->latents + (size_t)(total - 1) * w->rank, *rope_key = step->rope_keys + (size_t)(total - 1) * w->rope;
    MlaProject p = {x, cos, sin, s->normed, s->q_latent, s->q_nope, s->q_rope, latent, rope_key};
    if (mla_project(w, &p, isa, threads) != 0) return -1;
    MlaOutput o = {s->q_nope, s->q_rope, step->latents, step->rope_keys, NULL, total, x, x}; /* out[d] = x[d] + ..., in place */
    return mla_output(w, &o, isa, threads);
}

/* The chosen experts in id order (how the module path adds them: engine/moe.py add_routed) with their
 * matrices from the layer's table. */
static void chosen_experts(const LayerPlan *plan, const uint64_t *table, const int64_t *ids, Scratch *s) {
    int k = plan->router.topk, dim = plan->router.dim, inter = plan->routed_inter;
    for (int i = 0; i < k; i++) { /* insertion sort: top-k is a handful */
        int64_t id = ids[i];
        int j = i;
        for (; j > 0 && s->sorted[j - 1] > id; j--) s->sorted[j] = s->sorted[j - 1];
        s->sorted[j] = id;
    }
    for (int i = 0; i < k; i++) {
        const uint64_t *m = table + (size_t)s->sorted[i] * 6;
        Q8Matrix w1 = {(const void *)(uintptr_t)m[0], (const void *)(uintptr_t)m[1], plan->kind13, plan->scale_kind, dim, plan->group13};
        Q8Matrix w3 = {(const void *)(uintptr_t)m[2], (const void *)(uintptr_t)m[3], plan->kind13, plan->scale_kind, dim, plan->group13};
        Q8Matrix w2 = {(const void *)(uintptr_t)m[4], (const void *)(uintptr_t)m[5], plan->kind2, plan->scale_kind, inter, plan->group2};
        s->experts[i].w1 = w1, s->experts[i].w3 = w3, s->experts[i].w2 = w2;
    }
}

static int ffn(const LayerPlan *plan, const uint64_t *table, float *x, int64_t *ids, Scratch *s, int isa, int threads) {
    int dim = plan->attn->dim;
    rms_norm_rows(x, 1, dim, plan->ffn_norm, plan->ffn_eps, s->h);
    if (plan->has_mlp && q8_mlp(&plan->mlp, s->h, 1, dim, plan->mlp_inter, 0, 0.f, isa, threads, s->mlp) != 0) return -1;
    if (!plan->moe) {
        for (int d = 0; d < dim; d++) x[d] = x[d] + s->mlp[d];
        return 0;
    }
    int k = plan->router.topk;
    if (route_rows(&plan->router, s->h, 1, ids, s->weights) != 0) return -1;
    chosen_experts(plan, table, ids, s);
    memset(s->routed, 0, sizeof(double) * (size_t)dim);
    Q8MoE moe = {s->experts, s->sorted, k, s->h, ids, s->weights, 1, k, dim, plan->routed_inter, 0, 0.f, isa, threads, s->routed};
    if (q8_moe_run(&moe) != 0) return -1;
    for (int d = 0; d < dim; d++) x[d] = x[d] + ((float)s->routed[d] + (plan->has_mlp ? s->mlp[d] : 0.f));
    return 0;
}

int decode_layers(const LayerPlan *const *plans, const LayerStep *steps, int n, float *x, const float *cos,
                  const float *sin, int total, int64_t *ids, int topk_max, int isa, int threads) {
    Scratch s;
    void *area = scratch_for(plans, n, &s);
    if (area == NULL) return -1;
    int rc = 0;
    for (int l = 0; l < n && rc == 0; l++) {
        int64_t *layer_ids = ids + (size_t)l * topk_max;
        for (int i = 0; i < topk_max; i++) layer_ids[i] = -1;
        rc = attention(plans[l]->attn, &steps[l], x, cos, sin, total, &s, isa, threads);
        if (rc == 0) rc = ffn(plans[l], steps[l].table, x, layer_ids, &s, isa, threads);
    }
    free(area);
    return rc;
}
