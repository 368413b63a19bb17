/*
 * One decode step's layers for a model whose routed experts are all resident, with int8 activations or
 * on the float32 path (engine/mla/fused_decode.py), each layer as the module path runs it:
 *
 *   attention  mla_project (attn_norm, projections, rope, the cache's new row), mla_output (attention,
 *              wo, residual): mla_decode.c
 *   FFN        h = ffn_norm(x); dense: x += mlp(h)
 *              MoE: route h; routed = sum of weight * expert(h) over the chosen experts in id order
 *              (q8_moe.c, or nibble_moe.c on float32 x; float64); x += (float)routed + shared(h)
 *
 * Why: between those kernels the module path ran ~0.4 ms of Python per layer (module calls, the
 * store's acquire and release, routing glue), a third of a token on the bench model once the experts
 * were resident (docs/benchmarks-log.md, "One call per decode step"). The kernels, their order and the
 * float32 residual adds are the module path's, so the bits are the same.
 */
#include "decode_step.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    float *h, *mlp;         /* [rows, dim]: the FFN's input and the dense or shared MLP's output */
    double *routed;         /* [rows, dim] */
    int64_t *ids, *sorted;  /* [rows, topk]: each row's experts; their union in id order */
    float *weights;         /* [rows, topk] */
    void *experts;          /* [rows * topk] Q8Expert or NibbleExpert: the union's matrices */
} Scratch;

#define EXPERT_BYTES (sizeof(Q8Expert) > sizeof(NibbleExpert) ? sizeof(Q8Expert) : sizeof(NibbleExpert))

/* The largest of every layer's sizes, so one scratch serves all. */
static void *scratch_for(const LayerPlan *const *plans, int n, int rows, Scratch *s) {
    size_t dim = 1, topk = 1;
    for (int l = 0; l < n; l++) {
        dim = (size_t)plans[l]->attn->dim > dim ? (size_t)plans[l]->attn->dim : dim;
        if (plans[l]->moe && (size_t)plans[l]->router.topk > topk) topk = (size_t)plans[l]->router.topk;
    }
    size_t r = (size_t)rows, floats = 2 * r * dim + r * topk;
    char *area = malloc(r * dim * sizeof(double) + r * topk * (2 * sizeof(int64_t) + EXPERT_BYTES) + floats * sizeof(float));
    if (area == NULL) return NULL;
    s->routed = (double *)area;
    s->ids = (int64_t *)(s->routed + r * dim), s->sorted = s->ids + r * topk;
    s->experts = s->sorted + r * topk;
    s->h = (float *)((char *)s->experts + r * topk * EXPERT_BYTES), s->mlp = s->h + r * dim, s->weights = s->mlp + r * dim;
    return area;
}

/* Row r's projections, rope and its cache's new row (into the carry's row r). */
static int project(const MlaWeights *w, const LayerStep *step, float *x, const float *cos, const float *sin,
                   const DecodeCarry *c, int r, int isa, int threads) {
    size_t last = (size_t)(step->total - 1);
    MlaProject p = {x, cos, sin, c->normed + r * c->normed_ld, c->q_latent + r * c->q_latent_ld,
                    c->q_nope + r * c->q_nope_ld, c->q_rope + r * c->q_rope_ld, step->latents + last * w->rank,
                    step->rope_keys + last * w->rope};
    return mla_project(w, &p, isa, threads);
}

/* Row r's attention over its cache (all of it, or DSA's chosen positions), wo, and x + that, in place. */
static int output(const MlaWeights *w, const LayerStep *step, float *x, const DecodeCarry *c, int r, int isa,
                  int threads) {
    int total = step->positions == NULL ? step->total : step->count;
    MlaOutput o = {c->q_nope + r * c->q_nope_ld, c->q_rope + r * c->q_rope_ld, step->latents, step->rope_keys,
                   step->positions, total, x, x};
    return mla_output(w, &o, isa, threads);
}

/* The union of the rows' experts in id order (how the module path adds them: engine/core/moe.py add_routed);
 * returns how many. */
static int union_experts(const LayerPlan *plan, int rows, Scratch *s) {
    int n = 0;
    for (int i = 0; i < rows * plan->router.topk; i++) { /* insertion sort of the distinct ids: a few dozen */
        int64_t id = s->ids[i];
        int j = n;
        while (j > 0 && s->sorted[j - 1] > id) j--;
        if (j > 0 && s->sorted[j - 1] == id) continue;
        memmove(s->sorted + j + 1, s->sorted + j, sizeof(int64_t) * (size_t)(n - j));
        s->sorted[j] = id, n++;
    }
    return n;
}

/* The union's n experts, their matrices from the layer's table, added into s->routed by the kernel of
 * their kind. */
static int routed_experts(const LayerPlan *plan, const uint64_t *table, int rows, int n, Scratch *s, int isa,
                          int threads) {
    int k = plan->router.topk, dim = plan->attn->dim;
    if (plan->routed_floats) {
        NibbleExpert *experts = s->experts;
        for (int i = 0; i < n; i++) experts[i] = nibble_expert_at(table + (size_t)s->sorted[i] * 6, &plan->nibble);
        NibbleMoE moe = {experts, s->sorted, n, s->h, s->ids, s->weights, rows, k, dim, plan->nibble.w2.in, 0, 0.f, threads, 1, s->routed};
        return nibble_moe_run(&moe);
    }
    Q8Expert *experts = s->experts;
    for (int i = 0; i < n; i++) experts[i] = q8_expert_at(table + (size_t)s->sorted[i] * 6, &plan->routed);
    Q8MoE moe = {experts, s->sorted, n, s->h, s->ids, s->weights, rows, k, dim, plan->routed.inter, 0, 0.f, isa, threads, s->routed};
    return q8_moe_run(&moe);
}

/* The rows' routing (route_rows), run beside the shared expert's first job: it reads only the normed rows. */
typedef struct {
    const Router *router;
    const float *h;
    int rows;
    int64_t *ids;
    float *weights;
    int rc;
} Routing;

static void route_beside(void *arg) {
    Routing *r = arg;
    r->rc = route_rows(r->router, r->h, r->rows, r->ids, r->weights);
}

/* The FFN of every row; `ids` gets the layer's union (-1 after it). */
static int ffn(const LayerPlan *plan, const uint64_t *table, int rows, float *x, int64_t *ids, int topk_max, Scratch *s,
               int isa, int threads) {
    int dim = plan->attn->dim;
    size_t all = (size_t)rows * dim;
    rms_norm_rows(x, rows, dim, plan->ffn_norm, plan->ffn_eps, s->h);
    Routing routing = {&plan->router, s->h, rows, s->ids, s->weights, 0};
    SplitSide side = {route_beside, &routing};
    const SplitSide *beside = plan->moe ? &side : NULL; /* routing reads only h: it overlaps the job */
    if (plan->has_mlp && q8_mlp(&plan->mlp, s->h, rows, dim, plan->mlp_inter, 0, 0.f, isa, threads, beside, s->mlp) != 0)
        return -1;
    if (!plan->moe) {
        for (size_t i = 0; i < all; i++) x[i] = x[i] + s->mlp[i];
        return 0;
    }
    if (!plan->has_mlp) route_beside(&routing);
    if (routing.rc != 0) return -1;
    int n = union_experts(plan, rows, s);
    for (int i = 0; i < n && i < topk_max; i++) ids[i] = s->sorted[i];
    memset(s->routed, 0, sizeof(double) * all);
    if (routed_experts(plan, table, rows, n, s, isa, threads) != 0) return -1;
    for (size_t i = 0; i < all; i++) x[i] = x[i] + ((float)s->routed[i] + (plan->has_mlp ? s->mlp[i] : 0.f));
    return 0;
}

int decode_layers(const LayerPlan *const *plans, const LayerStep *steps, int n, int rows, float *x, const float *cos,
                  const float *sin, int64_t *ids, int topk_max, const DecodeCarry *carry, DecodePoint *at, int isa,
                  int threads) {
    Scratch s;
    void *area = scratch_for(plans, n, rows, &s);
    if (area == NULL) return -1;
    int rc = 0;
    for (int l = at->layer; l < n && rc == 0; l++) {
        const MlaWeights *w = plans[l]->attn;
        const LayerStep *step = steps + (size_t)l * rows;
        int half = w->rope / 2, dim = w->dim;
        if (l == at->layer && at->projected) {
            at->projected = 0; /* resumed: the indexer ran, its selections are in the steps */
        } else {
            for (int r = 0; r < rows && rc == 0; r++)
                rc = project(w, &step[r], x + (size_t)r * dim, cos + (size_t)r * half, sin + (size_t)r * half, carry, r,
                             isa, threads);
            if (rc == 0 && plans[l]->stops) {
                at->layer = l, at->projected = 1;
                free(area);
                return 1;
            }
        }
        for (int r = 0; r < rows && rc == 0; r++) rc = output(w, &step[r], x + (size_t)r * dim, carry, r, isa, threads);
        int64_t *layer_ids = ids + (size_t)l * topk_max;
        for (int i = 0; i < topk_max; i++) layer_ids[i] = -1;
        if (rc == 0) rc = ffn(plans[l], step[0].table, rows, x, layer_ids, topk_max, &s, isa, threads);
    }
    free(area);
    return rc;
}
