/* One decode step of a layer's MLA attention for int8-activation models, in two calls instead of a few
 * dozen torch ops and kernel calls (mla_decode.c): the projections up to the cache's new row, then
 * attention over the cache and the output projection with the residual. A DSA layer runs its indexer
 * between the two. */
#ifndef COLIBRI_MLA_DECODE_H
#define COLIBRI_MLA_DECODE_H

#include <stdint.h>

#include "decode_ops.h"
#include "q8.h"

typedef struct {
    int dim, heads, nope, rope, value, rank, q_rank; /* q_rank 0: no q LoRA, wq_a is wq */
    int interleaved;       /* rope pairs (2i, 2i + 1), else halves; the output is halves either way */
    float eps, latent_eps; /* attn_norm's; q_norm's and kv_norm's */
    float softmax_scale;
    const float *attn_norm, *q_norm, *kv_norm; /* [dim], [q_rank] (or NULL), [rank] */
    Q8Matrix wq_a;  /* [q_rank, dim], or wq [H (n + r), dim] */
    Q8Matrix wkv_a; /* [rank + rope, dim] */
    Q8Matrix wq_b;  /* [H (n + r), q_rank] */
    Q8Matrix wo;    /* [dim, H v] */
    KvB kv_b;       /* wkv_b [H (n + v), rank], float32 or int8 records */
} MlaWeights;

typedef struct {
    const float *x;          /* [dim] the layer's input */
    const float *cos, *sin;  /* [rope / 2] at this position */
    float *normed;           /* out [dim]: attn_norm(x) */
    float *q_latent;         /* out [q_rank]: q_norm(wq_a normed), or unused without q LoRA */
    float *q_nope, *q_rope;  /* out [H, n] and [H, r], the rope part rotated */
    float *latent, *rope_key; /* out: the cache's new row, kv_norm(latent) [rank] and the rotated key [rope] */
} MlaProject;

/* 0, or -1 without memory (nothing written). */
int mla_project(const MlaWeights *w, const MlaProject *p, int isa, int threads);

typedef struct {
    const float *q_nope, *q_rope;      /* from mla_project */
    const float *latents, *rope_keys;  /* the cache [T, rank], [T, rope], the new row included */
    const int64_t *positions;          /* [total] DSA's chosen positions, or NULL: all T */
    int total;                         /* T, or the number of positions */
    const float *x;                    /* [dim] the layer's input */
    float *out;                        /* [dim] x + wo(attention) */
} MlaOutput;

/* 0, or -1 without memory (nothing written). */
int mla_output(const MlaWeights *w, const MlaOutput *o, int isa, int threads);

#endif
