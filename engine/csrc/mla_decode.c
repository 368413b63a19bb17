/*
 * One query's MLA attention for a layer of an int8-activation model (engine/mla/decode.py), the torch
 * forward's steps in the same order:
 *
 *   project   h = attn_norm(x); [q_a | kv] = [wq_a | wkv_a] h  (one quantised h, one threaded job)
 *             q_a = q_norm(q_a); latent = kv_norm(kv[:rank]); q = wq_b q_a
 *             rotate each head's q_rope and the shared key kv[rank:]; the cache row is written
 *   output    attend (decode_ops.c attend_one) -> [H, v]; out = x + wo(attention)
 *
 * Why in C: a decode step ran ~25 torch ops and four kernel calls per layer here, each slow with the
 * interpreter's caches evicted by the kernels in between: on the bench model that Python took longer
 * per token than the weights it drove (docs/benchmarks-log.md, "Figures behind the code"). The float
 * rounding is C's (sums in other orders than torch): int8 path only.
 */
#include "mla_decode.h"

#include <stdlib.h>
#include <string.h>

#include "q8_moe.h"

/* Rotate one rope vector in[r] by the position's angles into out[r] (halves: x1 * cos - x2 * sin, then
 * x2 * cos + x1 * sin), as engine/core/rope.py apply_rope: each product rounded on its own (no fused
 * multiply-add), so the cache row has torch's bits. */
#if defined(__clang__) /* no optimize attribute; setup.py's -ffp-contract=off holds (clang fuses within one expression at most) */
#define UNFUSED
#else
#define UNFUSED __attribute__((optimize("fp-contract=off")))
#endif
UNFUSED static void rotate(const float *in, float *out, int r, const float *cos, const float *sin, int interleaved) {
    int half = r / 2;
    for (int i = 0; i < half; i++) {
        float x1 = interleaved ? in[2 * i] : in[i], x2 = interleaved ? in[2 * i + 1] : in[half + i];
        float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
        out[i] = a - b;
        out[half + i] = c + d;
    }
}

static int rows_out(const MlaWeights *w, int q_part) {
    return q_part ? w->heads * (w->nope + w->rope) : w->rank + w->rope;
}

int mla_project(const MlaWeights *w, const MlaProject *p, int isa, int threads) {
    int q_out = rows_out(w, 1), kv_out = rows_out(w, 0), qa_out = w->q_rank ? w->q_rank : q_out;
    size_t xa_bytes = q8_work_bytes(1, w->dim), xc_bytes = q8_work_bytes(1, w->q_rank ? w->q_rank : 1);
    size_t floats = (size_t)qa_out + kv_out + q_out;
    char *area = malloc(floats * sizeof(float) + 2 * xa_bytes + xc_bytes);
    if (area == NULL) return -1;
    float *qa = (float *)area, *kv = qa + qa_out, *q = kv + kv_out;
    uint8_t *work = (uint8_t *)(q + q_out);
    Q8Rows xc = {work + 2 * xa_bytes, 0, 0, 0};

    rms_norm_rows(p->x, 1, w->dim, w->attn_norm, w->eps, p->normed);
    q8_gemm_pair(&w->wq_a, qa_out, qa, &w->wkv_a, kv_out, kv, p->normed, 1, w->dim, work, isa, threads, NULL);

    rms_norm_rows(kv, 1, w->rank, w->kv_norm, w->latent_eps, p->latent);
    if (w->q_rank) {
        rms_norm_rows(qa, 1, w->q_rank, w->q_norm, w->latent_eps, p->q_latent);
        q8_prepare(w->wq_b.kind, p->q_latent, 1, w->q_rank, isa, &xc);
        Q8Product second = {&w->wq_b, &xc, q_out, q};
        q8_gemm_many(&second, 1, isa, threads, NULL);
    } else {
        q = qa;
    }
    for (int h = 0; h < w->heads; h++) {
        const float *head = q + (size_t)h * (w->nope + w->rope);
        memcpy(p->q_nope + (size_t)h * w->nope, head, sizeof(float) * (size_t)w->nope);
        rotate(head + w->nope, p->q_rope + (size_t)h * w->rope, w->rope, p->cos, p->sin, w->interleaved);
    }
    rotate(kv + w->rank, p->rope_key, w->rope, p->cos, p->sin, w->interleaved);
    free(area);
    return 0;
}

int mla_output(const MlaWeights *w, const MlaOutput *o, int isa, int threads) {
    size_t attended = (size_t)w->heads * w->value;
    char *area = malloc(sizeof(float) * (attended + w->dim) + q8_work_bytes(1, (int)attended));
    if (area == NULL) return -1;
    float *heads = (float *)area, *projected = heads + attended;
    AttendOne job = {o->q_nope, o->q_rope, o->latents, o->rope_keys, o->positions, o->total, w->heads, w->nope,
                     w->rope, w->value, w->rank, w->softmax_scale, w->kv_b, heads};
    if (attend_one(&job, threads) != 0) {
        free(area);
        return -1;
    }
    Q8Rows xq = {(uint8_t *)(projected + w->dim), 0, 0, 0};
    q8_prepare(w->wo.kind, heads, 1, (int)attended, isa, &xq);
    Q8Product product = {&w->wo, &xq, w->dim, projected};
    q8_gemm_many(&product, 1, isa, threads, NULL);
    for (int d = 0; d < w->dim; d++) o->out[d] = o->x[d] + projected[d];
    free(area);
    return 0;
}
