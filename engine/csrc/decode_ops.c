/*
 * The small float ops of a decode step (engine/kernels/decode_ops.py).
 *
 * Between its weight-bound kernels a decode step runs ~100 small torch ops per layer (norms, the
 * router's score / bias / group mask / sort / gather, five bmm for one query's attention), each slow
 * once the kernels have streamed the caches out: on a 2-core box they cost as much as the expert
 * matmuls (docs/benchmarks-log.md, "Figures behind the code"). Here each is one call over float32 arrays.
 * The sums run in another order than torch's, so the results differ from the exact path by float
 * rounding: the int8 path (already lossy in its activations) takes them for every row, the exact path for
 * decode rows only (each row as its own step computes it, alone or in a batch).
 */
#include "decode_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nibble.h"
#include "split.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define HAVE_X86 0
#endif
#if defined(__aarch64__)
#include "neon8.h"
#define HAVE_NEON 1
#else
#define HAVE_NEON 0
#endif

/* ------------------------------------------------------------------ vector helpers, AVX2 or plain */

#if HAVE_X86
#define AVX2_INLINE AVX2 __attribute__((always_inline)) static inline

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[h] = a[h] . b for NH rows a[h] (n floats each): two accumulators over 16 columns a step, then the
 * tail in order; b's vectors loaded once for all the rows, each row's sum made alone as it would be. */
AVX2_INLINE void dots_avx2(int NH, const float *const a[4], const float *b, int n, float out[4]) {
    __m256 s0[4], s1[4];
    for (int h = 0; h < NH; h++) s0[h] = s1[h] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        __m256 b0 = _mm256_loadu_ps(b + k), b1 = _mm256_loadu_ps(b + k + 8);
        for (int h = 0; h < NH; h++) {
            s0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(a[h] + k), b0, s0[h]);
            s1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(a[h] + k + 8), b1, s1[h]);
        }
    }
    for (int h = 0; h < NH; h++) {
        float s = hsum8(_mm256_add_ps(s0[h], s1[h]));
        for (int i = k; i < n; i++) s += a[h][i] * b[i];
        out[h] = s;
    }
}

AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    const float *rows[4] = {a};
    float out[4];
    dots_avx2(1, rows, b, n, out);
    return out[0];
}

AVX2 static void axpy_avx2(float *y, float a, const float *x, int n) {
    __m256 va = _mm256_set1_ps(a);
    int k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(y + k, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + k), _mm256_loadu_ps(y + k)));
    for (; k < n; k++) y[k] += a * x[k];
}

/* 8 int8 codes as floats */
AVX2 static inline __m256 codes8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* sum_k q[k] * scale(k / group) * x[k] */
AVX2 static float dot_i8_avx2(const int8_t *q, const float *scales, int group, const float *x, int n) {
    float s = 0.f;
    for (int g0 = 0; g0 < n; g0 += group) {
        int end = g0 + group < n ? g0 + group : n, k = g0;
        __m256 acc = _mm256_setzero_ps();
        for (; k + 8 <= end; k += 8) acc = _mm256_fmadd_ps(codes8(q + k), _mm256_loadu_ps(x + k), acc);
        float part = hsum8(acc);
        for (; k < end; k++) part += (float)q[k] * x[k];
        s += part * scales[g0 / group];
    }
    return s;
}

/* y[k] += a * q[k] * scale(k / group) */
AVX2 static void axpy_i8_avx2(float *y, float a, const int8_t *q, const float *scales, int group, int n) {
    for (int g0 = 0; g0 < n; g0 += group) {
        int end = g0 + group < n ? g0 + group : n, k = g0;
        float as = a * scales[g0 / group];
        __m256 va = _mm256_set1_ps(as);
        for (; k + 8 <= end; k += 8) _mm256_storeu_ps(y + k, _mm256_fmadd_ps(va, codes8(q + k), _mm256_loadu_ps(y + k)));
        for (; k < end; k++) y[k] += as * (float)q[k];
    }
}
#endif

#if HAVE_NEON
/* The AVX2 helpers over NEON registers, lane for lane (neon8.h): the same bits. The heads of attend_one go
 * one at a time here (attend_head, whose numbers attend_heads_avx2's are, bit for bit). */
static float dot_neon(const float *a, const float *b, int n) {
    F8 s0 = f8_zero(), s1 = f8_zero();
    int k = 0;
    for (; k + 16 <= n; k += 16) s0 = f8_fma(f8_load(a + k), f8_load(b + k), s0), s1 = f8_fma(f8_load(a + k + 8), f8_load(b + k + 8), s1);
    float s = f8_hsum(f8_add(s0, s1));
    for (int i = k; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_neon(float *y, float a, const float *x, int n) {
    F8 va = f8_dup(a);
    int k = 0;
    for (; k + 8 <= n; k += 8) f8_store(y + k, f8_fma(va, f8_load(x + k), f8_load(y + k)));
    for (; k < n; k++) y[k] += a * x[k];
}

F8_INLINE F8 codes8_neon(const int8_t *q) { /* 8 int8 codes as floats */
    int16x8_t wide = vmovl_s8(vld1_s8(q));
    return (F8){vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_high_s16(wide))};
}

static float dot_i8_neon(const int8_t *q, const float *scales, int group, const float *x, int n) {
    float s = 0.f;
    for (int g0 = 0; g0 < n; g0 += group) {
        int end = g0 + group < n ? g0 + group : n, k = g0;
        F8 acc = f8_zero();
        for (; k + 8 <= end; k += 8) acc = f8_fma(codes8_neon(q + k), f8_load(x + k), acc);
        float part = f8_hsum(acc);
        for (; k < end; k++) part += (float)q[k] * x[k];
        s += part * scales[g0 / group];
    }
    return s;
}

static void axpy_i8_neon(float *y, float a, const int8_t *q, const float *scales, int group, int n) {
    for (int g0 = 0; g0 < n; g0 += group) {
        int end = g0 + group < n ? g0 + group : n, k = g0;
        float as = a * scales[g0 / group];
        F8 va = f8_dup(as);
        for (; k + 8 <= end; k += 8) f8_store(y + k, f8_fma(va, codes8_neon(q + k), f8_load(y + k)));
        for (; k < end; k++) y[k] += as * (float)q[k];
    }
}
#define VEC(name) name##_neon
#elif HAVE_X86
#define VEC(name) name##_avx2
#endif

/* The plain C helpers (every machine; simd() 0 or the harness's probe). */
static float dot_plain(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int k = 0; k < n; k++) s += a[k] * b[k];
    return s;
}

static void axpy_plain(float *y, float a, const float *x, int n) {
    for (int k = 0; k < n; k++) y[k] += a * x[k];
}

static float dot_i8_plain(const int8_t *q, const float *scales, int group, const float *x, int n) {
    float s = 0.f;
    for (int g0 = 0; g0 < n; g0 += group) {
        float part = 0.f;
        for (int k = g0; k < g0 + group && k < n; k++) part += (float)q[k] * x[k];
        s += part * scales[g0 / group];
    }
    return s;
}

static void axpy_i8_plain(float *y, float a, const int8_t *q, const float *scales, int group, int n) {
    for (int k = 0; k < n; k++) y[k] += a * scales[k / group] * (float)q[k];
}

static int simd(void) {
#if HAVE_X86 || HAVE_NEON
    static int known = -1;
    if (known < 0) known = nibble_simd_available();
    return known;
#else
    return 0;
#endif
}

/* x86: the AVX2 helpers; aarch64: their NEON twins */
static float dot(const float *a, const float *b, int n) {
#if HAVE_X86 || HAVE_NEON
    if (simd()) return VEC(dot)(a, b, n);
#endif
    return dot_plain(a, b, n);
}

static void axpy(float *y, float a, const float *x, int n) {
#if HAVE_X86 || HAVE_NEON
    if (simd()) {
        VEC(axpy)(y, a, x, n);
        return;
    }
#endif
    axpy_plain(y, a, x, n);
}

static float dot_i8(const int8_t *q, const float *scales, int group, const float *x, int n) {
#if HAVE_X86 || HAVE_NEON
    if (simd()) return VEC(dot_i8)(q, scales, group, x, n);
#endif
    return dot_i8_plain(q, scales, group, x, n);
}

static void axpy_i8(float *y, float a, const int8_t *q, const float *scales, int group, int n) {
#if HAVE_X86 || HAVE_NEON
    if (simd()) {
        VEC(axpy_i8)(y, a, q, scales, group, n);
        return;
    }
#endif
    axpy_i8_plain(y, a, q, scales, group, n);
}

void decode_ops_probe(int simd_path, const float *a, const float *b, const int8_t *q, const float *scales, int group, int n,
                      float *out) {
    int fast = simd_path && simd();
    out[0] = fast ? dot(a, b, n) : dot_plain(a, b, n);
    out[1] = fast ? dot_i8(q, scales, group, b, n) : dot_i8_plain(q, scales, group, b, n);
    out[2] = out[3] = 0.f;
    memcpy(out + 4, b, sizeof(float) * (size_t)n);
    memcpy(out + 4 + n, b, sizeof(float) * (size_t)n);
    if (fast) axpy(out + 4, 0.375f, a, n), axpy_i8(out + 4 + n, -1.25f, q, scales, group, n);
    else axpy_plain(out + 4, 0.375f, a, n), axpy_i8_plain(out + 4 + n, -1.25f, q, scales, group, n);
}

/* ------------------------------------------------------------------------------------ RMSNorm */

void rms_norm_rows(const float *x, int rows, int dim, const float *w, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        float inv = 1.f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        for (int k = 0; k < dim; k++) o[k] = w[k] * (xr[k] * inv);
    }
}

/* ---------------------------------------------------------------- the DSA indexer's key and queries */

/* LayerNorm of x [dim] into out, summed in double: the mean, then the variance around it (biased). */
static void layer_norm(const float *x, int dim, const float *w, const float *b, float eps, float *out) {
    double sum = 0., squares = 0.;
    for (int k = 0; k < dim; k++) sum += x[k];
    double mean = sum / dim;
    for (int k = 0; k < dim; k++) squares += (x[k] - mean) * (x[k] - mean);
    float inv = (float)(1. / sqrt(squares / dim + eps));
    for (int k = 0; k < dim; k++) out[k] = ((x[k] - (float)mean) * inv) * w[k] + b[k];
}

/* The first `rope` values of v [dim] rotated in place by cos/sin [rope / 2] (see IndexFinish). */
static void rotate(float *v, int rope, int interleaved, const float *cos, const float *sin) {
    float x1[rope / 2 + 1], x2[rope / 2 + 1];
    for (int i = 0; i < rope / 2; i++) {
        x1[i] = interleaved ? v[2 * i] : v[i];
        x2[i] = interleaved ? v[2 * i + 1] : v[rope / 2 + i];
    }
    for (int i = 0; i < rope / 2; i++) {
        float a = x1[i] * cos[i], b = x2[i] * sin[i], c = x2[i] * cos[i], d = x1[i] * sin[i];
        v[i] = a - b; /* each product rounded on its own, as torch's separate ops round them */
        v[rope / 2 + i] = c + d;
    }
}

void index_finish_rows(const IndexFinish *how, const float *x, int rows, int heads, int dim, float *out) {
    int half = how->rope / 2;
    for (int r = 0; r < rows; r++) {
        size_t at = (size_t)(r % how->period) * half; /* row r's position among the period's angles */
        const float *cos = how->cos + at, *sin = how->sin + at;
        for (int h = 0; h < heads; h++) {
            const float *v = x + ((size_t)r * heads + h) * dim;
            float *o = out + ((size_t)r * heads + h) * dim;
            if (how->ln_weight)
                layer_norm(v, dim, how->ln_weight, how->ln_bias, how->eps, o);
            else
                memcpy(o, v, sizeof(float) * dim);
            rotate(o, how->rope, how->interleaved, cos, sin);
        }
    }
}

/* ------------------------------------------------------------------------------------- router */

static float score_of(int kind, float logit) {
    if (kind == SCORE_SIGMOID) return 1.f / (1.f + expf(-logit));
    if (kind == SCORE_SQRTSOFTPLUS) return sqrtf(logit > 20.f ? logit : log1pf(expf(logit)));
    return logit; /* softmax: normalised over the row afterwards */
}

/* Whether value a at index ia ranks before b at ib: higher first, the lower index among equals. */
static inline int ranks_before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

/* The k best of values [n] (NaN-free), best first, into chosen [k]; `allowed` NULL or a mask [n]. */
static void best_k(const float *values, const unsigned char *allowed, int n, int k, int *chosen) {
    int found = 0;
    for (int i = 0; i < n; i++) {
        if (allowed && !allowed[i]) continue;
        int at = found < k ? found++ : k;
        if (at == k && !ranks_before(values[i], i, values[chosen[k - 1]], chosen[k - 1])) continue;
        if (at == k) at = k - 1;
        while (at > 0 && ranks_before(values[i], i, values[chosen[at - 1]], chosen[at - 1])) {
            chosen[at] = chosen[at - 1];
            at--;
        }
        chosen[at] = i;
    }
}

static void route_one(const Router *rt, const float *x, float *scores, float *biased, unsigned char *allowed,
                      int *chosen, int64_t *ids, float *weights) {
    int n = rt->experts;
    for (int e = 0; e < n; e++) scores[e] = score_of(rt->score, dot(rt->weight + (size_t)e * (rt->ld ? rt->ld : rt->dim), x, rt->dim));
    if (rt->score == SCORE_SOFTMAX) {
        float top = scores[0], sum = 0.f;
        for (int e = 1; e < n; e++) top = scores[e] > top ? scores[e] : top;
        for (int e = 0; e < n; e++) sum += scores[e] = expf(scores[e] - top);
        for (int e = 0; e < n; e++) scores[e] /= sum;
    }
    for (int e = 0; e < n; e++) biased[e] = scores[e] + (rt->bias ? rt->bias[e] : 0.f);
    const unsigned char *mask = NULL;
    if (rt->groups > 1) {
        int per = n / rt->groups, two[2];
        float group_scores[256];
        int best_groups[256];
        for (int g = 0; g < rt->groups; g++) {
            best_k(biased + g * per, NULL, per, 2, two);
            group_scores[g] = biased[g * per + two[0]] + biased[g * per + two[1]];
        }
        best_k(group_scores, NULL, rt->groups, rt->topk_groups, best_groups);
        memset(allowed, 0, (size_t)n);
        for (int j = 0; j < rt->topk_groups; j++) memset(allowed + best_groups[j] * per, 1, (size_t)per);
        mask = allowed;
    }
    best_k(biased, mask, n, rt->topk, chosen);
    float total = 0.f;
    for (int j = 0; j < rt->topk; j++) total += weights[j] = scores[chosen[j]];
    for (int j = 0; j < rt->topk; j++) {
        ids[j] = chosen[j];
        weights[j] = (rt->normalise ? weights[j] / (total + 1e-20f) : weights[j]) * rt->scale;
    }
}

int router_valid(const Router *rt) {
    int per = rt->groups > 0 ? rt->experts / rt->groups : 0;
    return rt->dim >= 1 && (rt->ld == 0 || rt->ld >= rt->dim) && rt->experts >= 1 && rt->score >= 0 &&
           rt->score <= SCORE_SQRTSOFTPLUS && rt->groups >= 1 && rt->groups <= 256 && rt->experts % rt->groups == 0 &&
           (rt->groups == 1 || (per >= 2 && rt->topk_groups >= 1 && rt->topk_groups <= rt->groups)) && rt->topk >= 1 &&
           rt->topk <= (rt->groups > 1 ? rt->topk_groups * per : rt->experts);
}

int route_rows(const Router *rt, const float *x, int rows, int64_t *ids, float *weights) {
    int n = rt->experts;
    float *scores = malloc(sizeof(float) * 2 * (size_t)n + (size_t)n + sizeof(int) * (size_t)rt->topk);
    if (scores == NULL) return -1;
    float *biased = scores + n;
    int *chosen = (int *)(biased + n);
    unsigned char *allowed = (unsigned char *)(chosen + rt->topk);
    for (int r = 0; r < rows; r++)
        route_one(rt, x + (size_t)r * rt->dim, scores, biased, allowed, chosen, ids + (size_t)r * rt->topk,
                  weights + (size_t)r * rt->topk);
    free(scores);
    return 0;
}

/* -------------------------------------------------------------------- absorbed attention, 1 query */

typedef struct {
    const AttendOne *job;
    int groups;  /* int8 wkv_b: scales per row */
    float *work; /* per head: q latent [c], scores [T], mixed [c] */
    int per_block; /* heads a block of the split computes together */
} AttendJob;

static const float *latent_at(const AttendOne *a, int t) {
    size_t p = a->positions ? (size_t)a->positions[t] : (size_t)t;
    return a->latents + p * a->rank;
}

static const float *rope_key_at(const AttendOne *a, int t) {
    size_t p = a->positions ? (size_t)a->positions[t] : (size_t)t;
    return a->rope_keys + p * a->rope;
}

/* row `row` of wkv_b times x [c], or y [c] += a * row */
static float kv_b_dot(const AttendJob *j, size_t row, const float *x) {
    const AttendOne *a = j->job;
    if (!a->kv_b.int8) return dot((const float *)a->kv_b.w + row * a->rank, x, a->rank);
    return dot_i8((const int8_t *)a->kv_b.w + row * a->rank, a->kv_b.scales + row * j->groups, a->kv_b.group, x, a->rank);
}

static void kv_b_axpy(const AttendJob *j, size_t row, float s, float *y) {
    const AttendOne *a = j->job;
    if (!a->kv_b.int8) {
        axpy(y, s, (const float *)a->kv_b.w + row * a->rank, a->rank);
        return;
    }
    axpy_i8(y, s, (const int8_t *)a->kv_b.w + row * a->rank, a->kv_b.scales + row * j->groups, a->kv_b.group, a->rank);
}

/* Head h's query latent: q_nope[h] W_k[h] -> [c] */
static void query_latent(const AttendJob *j, int h, float *q_latent) {
    const AttendOne *a = j->job;
    size_t first = (size_t)h * (a->nope + a->value); /* head h's first row of wkv_b */
    memset(q_latent, 0, sizeof(float) * (size_t)a->rank);
    for (int i = 0; i < a->nope; i++) kv_b_axpy(j, first + i, a->q_nope[(size_t)h * a->nope + i], q_latent);
}

/* scores[t] -> softmax(scores) in place (the max subtracted; each divided by the sum) */
static void softmax_in_place(float *scores, int T) {
    float top = -INFINITY, sum = 0.f;
    for (int t = 0; t < T; t++) top = scores[t] > top ? scores[t] : top;
    for (int t = 0; t < T; t++) sum += scores[t] = expf(scores[t] - top);
    for (int t = 0; t < T; t++) scores[t] = scores[t] / sum;
}

/* out[h, :] = mixed W_v[h]^T */
static void head_output(const AttendJob *j, int h, const float *mixed) {
    const AttendOne *a = j->job;
    size_t first = (size_t)h * (a->nope + a->value) + a->nope;
    for (int v = 0; v < a->value; v++) a->out[(size_t)h * a->value + v] = kv_b_dot(j, first + v, mixed);
}

/* Head h's work area: q latent [c], scores [T], mixed [c] */
static float *head_work(const AttendJob *j, int h) {
    return j->work + (size_t)h * (2 * (size_t)j->job->rank + j->job->total);
}

/* One head alone: the portable path */
static void attend_head(const AttendJob *j, int h) {
    const AttendOne *a = j->job;
    int c = a->rank, T = a->total;
    float *q_latent = head_work(j, h), *scores = q_latent + c, *mixed = scores + T;
    query_latent(j, h, q_latent);
    const float *q_rope = a->q_rope + (size_t)h * a->rope;
    for (int t = 0; t < T; t++)
        scores[t] = (dot(q_latent, latent_at(a, t), c) + dot(q_rope, rope_key_at(a, t), a->rope)) * a->softmax_scale;
    softmax_in_place(scores, T);
    memset(mixed, 0, sizeof(float) * (size_t)c);
    for (int t = 0; t < T; t++) axpy(mixed, scores[t], latent_at(a, t), c);
    head_output(j, h, mixed);
}

#if HAVE_X86
/* y[h] = sum_t p[h][t] * latent_t for NH heads, as axpy_avx2 from zeros over t in order would make it
 * (per element the same fused multiply-adds in the same order). Rows go in blocks that stay in L2, each
 * block in strips of 16 columns: a strip of a latent row is loaded once for all the heads and the sums
 * stay in registers across the block's rows. */
AVX2_INLINE void mix_avx2(int NH, const AttendOne *a, const float *const p[4], float *const y[4]) {
    enum { BLOCK_T = 64 }; /* 64 rows of a 512-float latent: 128 KB */
    int c = a->rank, T = a->total, vectors = c / 8 * 8;
    for (int h = 0; h < NH; h++) memset(y[h], 0, sizeof(float) * (size_t)c);
    for (int t0 = 0; t0 < T; t0 += BLOCK_T) {
        int t1 = t0 + BLOCK_T < T ? t0 + BLOCK_T : T;
        for (int k = 0; k < vectors; k += 16) {
            int two = k + 16 <= vectors; /* else one vector: the last 8 of a multiple of 8 */
            __m256 y0[4], y1[4];
            for (int h = 0; h < NH; h++) {
                y0[h] = _mm256_loadu_ps(y[h] + k);
                y1[h] = two ? _mm256_loadu_ps(y[h] + k + 8) : y0[h];
            }
            for (int t = t0; t < t1; t++) {
                const float *x = latent_at(a, t) + k;
                __m256 x0 = _mm256_loadu_ps(x), x1 = two ? _mm256_loadu_ps(x + 8) : x0;
                for (int h = 0; h < NH; h++) {
                    __m256 va = _mm256_set1_ps(p[h][t]);
                    y0[h] = _mm256_fmadd_ps(va, x0, y0[h]);
                    if (two) y1[h] = _mm256_fmadd_ps(va, x1, y1[h]);
                }
            }
            for (int h = 0; h < NH; h++) {
                _mm256_storeu_ps(y[h] + k, y0[h]);
                if (two) _mm256_storeu_ps(y[h] + k + 8, y1[h]);
            }
        }
        for (int h = 0; h < NH; h++) /* the columns past the last whole vector, as axpy_avx2's tail */
            for (int t = t0; t < t1; t++)
                for (int i = vectors; i < c; i++) y[h][i] += p[h][t] * latent_at(a, t)[i];
    }
}

/* Heads h0 .. h0 + NH - 1 together: every latent row read once for them, twice in all (their scores,
 * then their mix) rather than twice per head; each head's numbers are attend_head's, bit for bit. */
AVX2_INLINE void attend_heads_avx2(int NH, const AttendJob *j, int h0) {
    const AttendOne *a = j->job;
    int c = a->rank, T = a->total;
    const float *q_latent[4], *q_rope[4], *p[4];
    float *scores[4], *mixed[4], dl[4], dr[4];
    for (int h = 0; h < NH; h++) {
        float *work = head_work(j, h0 + h);
        q_latent[h] = work, scores[h] = work + c, mixed[h] = work + c + T, p[h] = scores[h];
        query_latent(j, h0 + h, work);
        q_rope[h] = a->q_rope + (size_t)(h0 + h) * a->rope;
    }
    for (int t = 0; t < T; t++) {
        dots_avx2(NH, q_latent, latent_at(a, t), c, dl);
        dots_avx2(NH, q_rope, rope_key_at(a, t), a->rope, dr);
        for (int h = 0; h < NH; h++) scores[h][t] = (dl[h] + dr[h]) * a->softmax_scale;
    }
    for (int h = 0; h < NH; h++) softmax_in_place(scores[h], T);
    mix_avx2(NH, a, p, mixed);
    for (int h = 0; h < NH; h++) head_output(j, h0 + h, mixed[h]);
}

AVX2 static void attend_heads(const AttendJob *j, int h0, int n) {
    switch (n) { /* a constant count: the head loops unroll into registers */
    case 1: attend_heads_avx2(1, j, h0); return;
    case 2: attend_heads_avx2(2, j, h0); return;
    case 3: attend_heads_avx2(3, j, h0); return;
    default: attend_heads_avx2(4, j, h0); return;
    }
}
#endif

enum { HEADS_PER_BLOCK = 4 }; /* 8 accumulators for the scores, 8 for a mix strip: AVX2's 16 registers */

static void attend_block(void *arg, int b) {
    const AttendJob *j = arg;
    int h0 = b * j->per_block, n = j->job->heads - h0 < j->per_block ? j->job->heads - h0 : j->per_block;
#if HAVE_X86
    if (simd()) {
        attend_heads(j, h0, n);
        return;
    }
#endif
    for (int h = h0; h < h0 + n; h++) attend_head(j, h);
}

int attend_one(const AttendOne *a, int threads) {
    AttendJob j = {a, a->kv_b.int8 ? (a->rank + a->kv_b.group - 1) / a->kv_b.group : 0, NULL, 1};
    j.work = malloc(sizeof(float) * (size_t)a->heads * (2 * (size_t)a->rank + a->total));
    if (j.work == NULL) return -1;
    /* up to 4 heads a block, fewer where that would leave a thread without a block */
    int per_thread = a->heads / (threads > 1 ? threads : 1);
    j.per_block = per_thread < 1 ? 1 : per_thread > HEADS_PER_BLOCK ? HEADS_PER_BLOCK : per_thread;
    split_run(attend_block, &j, (a->heads + j.per_block - 1) / j.per_block, threads);
    free(j.work);
    return 0;
}
