/*
 * Python entry points of the fused decode steps (mla_decode.c, q8_moe.c's q8_mlp), added to engine.kernels._kernels by kernels.c. A
 * layer's weights are described once (mla_weights: a capsule owning the C struct, its arrays kept
 * alive by the Python object that holds it); each step then passes only the per-token pointers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_step.h"
#include "mla_decode.h"
#include "nibble.h"
#include "q8_moe.h"

#define CAPSULE "colibri.MlaWeights"

static void free_weights(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, CAPSULE)); }

static const void *ptr(unsigned long long address) { return (const void *)(uintptr_t)address; }

/* A matrix from (w, scales, kind, scale_kind, in, group) (bf16: scales and group ignored); 0 with a
 * ValueError when unsupported. */
static int matrix(PyObject *spec, Q8Matrix *m, const char *name) {
    unsigned long long w, scales;
    int kind, scale_kind, in, group, interleaved;
    if (!PyArg_ParseTuple(spec, "KKiiiip", &w, &scales, &kind, &scale_kind, &in, &group, &interleaved)) return 0;
    int coded = kind >= 0 && kind < N_Q8_WEIGHTS && scale_kind >= 0 && scale_kind < N_SCALE_KINDS && group >= Q8_BLOCK &&
                group % Q8_BLOCK == 0;
    /* an interleaved matrix's row count is its packer's (whole 4-row blocks); the rest is checked here */
    if (in < 1 || !(coded || kind == Q8_WEIGHTS_BF16) || (interleaved && !q8_interleavable(kind, scale_kind, in, 4, group))) {
        PyErr_Format(PyExc_ValueError, "%s: kind=%d scale=%d in=%d group=%d interleaved=%d", name, kind, scale_kind, in,
                     group, interleaved);
        return 0;
    }
    Q8Matrix made = {ptr(w), ptr(scales), kind, scale_kind, in, group, interleaved};
    *m = made;
    return 1;
}

/* mla_weights((dim, heads, nope, rope, value, rank, q_rank, interleaved), (eps, latent_eps, softmax_scale),
 * (attn_norm, q_norm or 0, kv_norm), wq_a, wkv_a, wq_b or None, wo, (kv_b, kv_b scales, group)) -> capsule.
 * Each matrix is (w, scales, kind, scale_kind, in, group); kv_b is int8 codes with float32 scales per
 * group columns, or (group 0, scales 0) float32. */
static PyObject *py_mla_weights(PyObject *self, PyObject *args) {
    MlaWeights w = {0};
    PyObject *dims, *floats, *norms, *wq_a, *wkv_a, *wq_b, *wo, *kv_b;
    unsigned long long attn_norm, q_norm, kv_norm, kv_codes, kv_scales;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOOO!", &PyTuple_Type, &dims, &PyTuple_Type, &floats, &PyTuple_Type, &norms,
                          &wq_a, &wkv_a, &wq_b, &wo, &PyTuple_Type, &kv_b))
        return NULL;
    if (!PyArg_ParseTuple(dims, "iiiiiiip", &w.dim, &w.heads, &w.nope, &w.rope, &w.value, &w.rank, &w.q_rank,
                          &w.interleaved) ||
        !PyArg_ParseTuple(floats, "fff", &w.eps, &w.latent_eps, &w.softmax_scale) ||
        !PyArg_ParseTuple(norms, "KKK", &attn_norm, &q_norm, &kv_norm) ||
        !PyArg_ParseTuple(kv_b, "KKi", &kv_codes, &kv_scales, &w.kv_b.group))
        return NULL;
    if (w.dim < 1 || w.heads < 1 || w.nope < 1 || w.rope < 2 || w.rope % 2 || w.value < 1 || w.rank < 1 || w.q_rank < 0 ||
        (w.q_rank > 0) != (q_norm != 0 && wq_b != Py_None) || w.kv_b.group < 0 || (w.kv_b.group == 0) != (kv_scales == 0)) {
        PyErr_Format(PyExc_ValueError, "mla_weights: dim=%d heads=%d nope=%d rope=%d value=%d rank=%d q_rank=%d group=%d",
                     w.dim, w.heads, w.nope, w.rope, w.value, w.rank, w.q_rank, w.kv_b.group);
        return NULL;
    }
    if (!matrix(wq_a, &w.wq_a, "mla_weights: wq_a") || !matrix(wkv_a, &w.wkv_a, "mla_weights: wkv_a") ||
        !matrix(wo, &w.wo, "mla_weights: wo") || (w.q_rank && !matrix(wq_b, &w.wq_b, "mla_weights: wq_b")))
        return NULL;
    w.attn_norm = ptr(attn_norm), w.q_norm = ptr(q_norm), w.kv_norm = ptr(kv_norm);
    w.kv_b.w = ptr(kv_codes), w.kv_b.scales = ptr(kv_scales), w.kv_b.int8 = w.kv_b.group > 0;
    MlaWeights *held = malloc(sizeof w);
    if (held == NULL) return PyErr_NoMemory();
    *held = w;
    PyObject *capsule = PyCapsule_New(held, CAPSULE, free_weights);
    if (capsule == NULL) free(held);
    return capsule;
}

/* mla_project(weights, x, cos, sin, normed, q_latent, q_nope, q_rope, latent, rope_key, isa, threads). */
static PyObject *py_mla_project(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long x, cos, sin, normed, q_latent, q_nope, q_rope, latent, rope_key;
    int isa, threads, rc;
    if (!PyArg_ParseTuple(args, "OKKKKKKKKKii", &capsule, &x, &cos, &sin, &normed, &q_latent, &q_nope, &q_rope, &latent,
                          &rope_key, &isa, &threads))
        return NULL;
    const MlaWeights *w = PyCapsule_GetPointer(capsule, CAPSULE);
    if (w == NULL) return NULL;
    MlaProject p = {ptr(x), ptr(cos), ptr(sin), (float *)(uintptr_t)normed, (float *)(uintptr_t)q_latent,
                    (float *)(uintptr_t)q_nope, (float *)(uintptr_t)q_rope, (float *)(uintptr_t)latent,
                    (float *)(uintptr_t)rope_key};
    (void)q8_vnni_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    rc = mla_project(w, &p, isa, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* mla_output(weights, q_nope, q_rope, latents, rope_keys, positions or 0, total, x, out, isa, threads). */
static PyObject *py_mla_output(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long q_nope, q_rope, latents, rope_keys, positions, x, out;
    int total, isa, threads, rc;
    if (!PyArg_ParseTuple(args, "OKKKKKiKKii", &capsule, &q_nope, &q_rope, &latents, &rope_keys, &positions, &total, &x,
                          &out, &isa, &threads))
        return NULL;
    const MlaWeights *w = PyCapsule_GetPointer(capsule, CAPSULE);
    if (w == NULL) return NULL;
    if (total < 1) {
        PyErr_Format(PyExc_ValueError, "mla_output: total=%d", total);
        return NULL;
    }
    MlaOutput o = {ptr(q_nope), ptr(q_rope), ptr(latents), ptr(rope_keys), ptr(positions), total, ptr(x),
                   (float *)(uintptr_t)out};
    Py_BEGIN_ALLOW_THREADS
    rc = mla_output(w, &o, isa, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* q8_mlp(w1, w3, w2, x, rows, dim, inter, clamp, limit, out, isa, threads): out float32 [rows, dim] =
 * w2(silu(w1 x) * w3 x) for x float32 [rows, dim]; each matrix (w, scales, kind, scale_kind, in, group). */
static PyObject *py_q8_mlp(PyObject *self, PyObject *args) {
    PyObject *w1, *w3, *w2;
    unsigned long long x, out;
    int rows, dim, inter, clamp, isa, threads, rc;
    float limit;
    if (!PyArg_ParseTuple(args, "OOOKiiipfKii", &w1, &w3, &w2, &x, &rows, &dim, &inter, &clamp, &limit, &out, &isa,
                          &threads))
        return NULL;
    Q8Expert e;
    if (!matrix(w1, &e.w1, "q8_mlp: w1") || !matrix(w3, &e.w3, "q8_mlp: w3") || !matrix(w2, &e.w2, "q8_mlp: w2"))
        return NULL;
    if (rows < 1 || dim < 1 || inter < 1 || e.w1.in != dim || e.w3.in != dim || e.w2.in != inter) {
        PyErr_Format(PyExc_ValueError, "q8_mlp: rows=%d dim=%d inter=%d, matrices in=%d,%d,%d", rows, dim, inter, e.w1.in,
                     e.w3.in, e.w2.in);
        return NULL;
    }
    (void)q8_vnni_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    rc = q8_mlp(&e, ptr(x), rows, dim, inter, clamp, limit, isa, threads, NULL, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define PLAN_CAPSULE "colibri.LayerPlan"

static void free_plan(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, PLAN_CAPSULE)); }

/* The SwiGLU MLP (w1, w3, w2) of a layer_plan, each matrix as matrix() takes it. */
static int mlp(PyObject *spec, LayerPlan *plan) {
    PyObject *w1, *w3, *w2;
    if (!PyArg_ParseTuple(spec, "OOOi", &w1, &w3, &w2, &plan->mlp_inter)) return 0;
    plan->has_mlp = 1;
    return matrix(w1, &plan->mlp.w1, "layer_plan: w1") && matrix(w3, &plan->mlp.w3, "layer_plan: w3") &&
           matrix(w2, &plan->mlp.w2, "layer_plan: w2");
}

/* The routed experts' layout (family, inter, kind13, kind2, scale_kind, group13, group2, interleaved) of a MoE
 * layer_plan: family 0 int8 activations (kinds Q8_WEIGHTS_*; interleaved: q8.h's layout), 1 float32 x (kinds
 * nibble.h's CODE_*, interleaved 0). */
static int routed_layout(PyObject *layout, LayerPlan *plan, int dim) {
    int inter, kind13, kind2, scale_kind, group13, group2, interleaved;
    if (!PyArg_ParseTuple(layout, "iiiiiiii", &plan->routed_floats, &inter, &kind13, &kind2, &scale_kind, &group13,
                          &group2, &interleaved))
        return 0;
    int valid;
    if (plan->routed_floats) {
        NibbleMatrix w13 = {NULL, NULL, kind13, scale_kind, dim, group13}, w2 = {NULL, NULL, kind2, scale_kind, inter, group2};
        NibbleExpert like = {w13, w13, w2};
        plan->nibble = like;
        valid = plan->routed_floats == 1 && interleaved == 0 && nibble_matrix_valid(&w13) && nibble_matrix_valid(&w2);
    } else {
        Q8Layout l = {dim, inter, kind13, kind2, scale_kind, group13, group2, interleaved};
        plan->routed = l;
        valid = q8_layout_valid(&l);
    }
    if (!valid)
        PyErr_Format(PyExc_ValueError, "layer_plan: experts' family=%d inter=%d kinds=%d,%d scale=%d groups=%d,%d "
                     "interleaved=%d", plan->routed_floats, inter, kind13, kind2, scale_kind, group13, group2, interleaved);
    return valid;
}

/* The router and the routed experts' layout of a MoE layer_plan. */
static int routed(PyObject *router, PyObject *layout, LayerPlan *plan, int dim) {
    Router *r = &plan->router;
    unsigned long long weight, bias;
    if (!PyArg_ParseTuple(router, "KKiiiiipfi", &weight, &bias, &r->experts, &r->score, &r->groups, &r->topk_groups,
                          &r->topk, &r->normalise, &r->scale, &r->ld))
        return 0;
    r->weight = ptr(weight), r->bias = ptr(bias), r->dim = dim;
    if (r->ld < dim || !router_valid(r)) {
        PyErr_Format(PyExc_ValueError, "layer_plan: experts=%d groups=%d topk=%d", r->experts, r->groups, r->topk);
        return 0;
    }
    return routed_layout(layout, plan, dim);
}

/* layer_plan(mla_weights capsule, ffn_norm, ffn_eps, mlp or None, router or None, layout or None, stops) -> capsule.
 * mlp: (w1, w3, w2, inter), the dense MLP or the shared expert; router: (weight, bias or 0, experts, score,
 * groups, topk_groups, topk, normalise, scale, row stride); layout: the routed experts' (family, inter, kind13, kind2,
 * scale_kind, group13, group2, interleaved) (routed_layout). A MoE layer has a router and a layout; stops: a DSA layer with its own indexer, which
 * decode_layers hands back to the caller once every row's projections are done. The caller keeps the mla capsule alive. */
static PyObject *py_layer_plan(PyObject *self, PyObject *args) {
    PyObject *attn, *mlp_spec, *router, *layout;
    unsigned long long norm;
    LayerPlan plan = {0};
    if (!PyArg_ParseTuple(args, "OKfOOOp", &attn, &norm, &plan.ffn_eps, &mlp_spec, &router, &layout, &plan.stops))
        return NULL;
    plan.attn = PyCapsule_GetPointer(attn, CAPSULE);
    if (plan.attn == NULL) return NULL;
    plan.ffn_norm = ptr(norm);
    plan.moe = router != Py_None;
    if ((mlp_spec != Py_None && !mlp(mlp_spec, &plan)) || (plan.moe && !routed(router, layout, &plan, plan.attn->dim)))
        return NULL;
    if ((!plan.moe && !plan.has_mlp) || (plan.has_mlp && (plan.mlp.w1.in != plan.attn->dim || plan.mlp.w2.in != plan.mlp_inter))) {
        PyErr_SetString(PyExc_ValueError, "layer_plan: a dense layer needs its MLP, of the attention's width");
        return NULL;
    }
    LayerPlan *held = malloc(sizeof plan);
    if (held == NULL) return PyErr_NoMemory();
    *held = plan;
    PyObject *capsule = PyCapsule_New(held, PLAN_CAPSULE, free_plan);
    if (capsule == NULL) free(held);
    return capsule;
}

/* decode_layers(plans, steps, rows, x, cos, sin, ids, topk_max, carry, at, isa, threads): plans a tuple of n
 * layer_plan capsules; steps the address of uint64 [n, rows, 6] (per layer and row: the expert table or 0,
 * the row's cache latents, rope keys, positions with the new one, DSA's chosen positions (int64) or 0, their
 * count); x float32 [rows, dim] in place; cos, sin float32 [rows, rope / 2]; ids int64 [n, topk_max] out;
 * carry the addresses of float32 normed, q latent, q nope, q rope, then each one's floats per row (at least
 * the widest layer's dim, q_rank, heads * nope, heads * rope), each [rows, its ld]; at (layer, projected)
 * where to start (decode_step.h). -> None when the step is done, or the layer whose projections it stopped
 * after (for its indexer). */
static PyObject *py_decode_layers(PyObject *self, PyObject *args) {
    PyObject *plans;
    unsigned long long steps, x, cos, sin, ids;
    unsigned long long normed, q_latent, q_nope, q_rope;
    Py_ssize_t lds[4];
    DecodePoint at;
    int rows, topk_max, isa, threads, rc;
    if (!PyArg_ParseTuple(args, "O!KiKKKKi(KKKKnnnn)(ip)ii", &PyTuple_Type, &plans, &steps, &rows, &x, &cos, &sin,
                          &ids, &topk_max, &normed, &q_latent, &q_nope, &q_rope, &lds[0], &lds[1], &lds[2], &lds[3],
                          &at.layer, &at.projected, &isa, &threads))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(plans);
    if (rows < 1 || n < 1 || at.layer < 0 || at.layer >= n)
        return PyErr_Format(PyExc_ValueError, "decode_layers: rows=%d layers=%zd from layer %d", rows, n, at.layer);
    const LayerPlan **held = malloc(sizeof(LayerPlan *) * (size_t)n);
    LayerStep *step = malloc(sizeof(LayerStep) * (size_t)n * rows);
    if (held == NULL || step == NULL) {
        free(held), free(step);
        return PyErr_NoMemory();
    }
    const uint64_t *given = ptr(steps);
    for (Py_ssize_t l = 0; l < n; l++) {
        held[l] = PyCapsule_GetPointer(PyTuple_GET_ITEM(plans, l), PLAN_CAPSULE);
        const MlaWeights *w = held[l] == NULL ? NULL : held[l]->attn;
        int bad = w == NULL || (held[l]->moe && held[l]->router.topk * rows > topk_max) || lds[0] < w->dim ||
                  lds[1] < (w->q_rank > 1 ? w->q_rank : 1) || lds[2] < (Py_ssize_t)w->heads * w->nope ||
                  lds[3] < (Py_ssize_t)w->heads * w->rope;
        for (int r = 0; r < rows && !bad; r++) {
            const uint64_t *g = given + ((size_t)l * rows + r) * 6;
            LayerStep one = {ptr(g[0]), (float *)(uintptr_t)g[1], (float *)(uintptr_t)g[2], (int)g[3],
                             (const int64_t *)(uintptr_t)g[4], (int)g[5]};
            step[(size_t)l * rows + r] = one;
            bad = one.total < 1 || one.latents == NULL || (held[l]->moe && one.table == NULL) ||
                  (one.positions != NULL && (one.count < 1 || one.count > one.total));
        }
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError,
                             "decode_layers: layer %zd: no expert table, cache, room for ids or carry, or a bad selection", l);
            free(held), free(step);
            return NULL;
        }
    }
    DecodeCarry carry = {(float *)(uintptr_t)normed, (float *)(uintptr_t)q_latent, (float *)(uintptr_t)q_nope,
                         (float *)(uintptr_t)q_rope, (size_t)lds[0], (size_t)lds[1], (size_t)lds[2], (size_t)lds[3]};
    (void)q8_vnni_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    rc = decode_layers(held, step, (int)n, rows, (float *)(uintptr_t)x, ptr(cos), ptr(sin), (int64_t *)(uintptr_t)ids,
                       topk_max, &carry, &at, isa, threads);
    Py_END_ALLOW_THREADS
    free(held), free(step);
    if (rc < 0) return PyErr_NoMemory();
    if (rc == 1) return PyLong_FromLong(at.layer);
    Py_RETURN_NONE;
}

PyMethodDef py_decode_methods[] = {
    {"layer_plan", py_layer_plan, METH_VARARGS, "a layer's weights for decode_layers (a capsule)."},
    {"decode_layers", py_decode_layers, METH_VARARGS, "one decode step through every layer, experts resident."},
    {"q8_mlp", py_q8_mlp, METH_VARARGS, "one SwiGLU MLP with int8 activations: gate and up as one job, then down."},
    {"mla_weights", py_mla_weights, METH_VARARGS, "a layer's MLA weights for the fused decode steps (a capsule)."},
    {"mla_project", py_mla_project, METH_VARARGS, "one query's MLA projections, rope and the cache's new row."},
    {"mla_output", py_mla_output, METH_VARARGS, "one query's attention over the cache, wo and the residual."},
    {NULL, NULL, 0, NULL},
};
