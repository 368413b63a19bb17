/*
 * The C extension engine.kernels._kernels: the Python entry points and the thread split for the 4-bit
 * group-quantised kernels (nibble.c: every record kind, int4 / fp4 codes, float16 / bfloat16 / e8m0
 * scales, ragged groups), and for bf16 weights times float32 rows (bf16.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "nibble.h"
#include "q8.h"
#include "index_select.h"
#include "index_choose.h"
#include "nibble_moe.h"
#include "q8_moe.h"
#include "q8_tiles.h"
#include "decode_ops.h"
#include "split.h"
#include "read_ahead.h"

typedef struct {
    const NibbleMatrix *nibbles; /* a 4-bit matrix, or NULL for a bf16 one (w16) or a q8 one */
    const Q8Matrix *q8; /* weights times int8-quantised x (q8x), or NULL */
    const Q8Rows *q8x;
    const uint16_t *w16;
    const float *xs; /* 4-bit: nibble_prepare's x; bf16: x itself */
    float *y;
    int rows, in, out, begin, end;
    int isa_limit; /* the highest path allowed: 0 scalar, 1 AVX2, 2 AVX-512 (bf16, q8 VNNI); tests lower it */
    int alone; /* batch-invariant: each row of x computed exactly as alone (rows of independent requests) */
    const int *segments; /* bf16, or NULL: x's rows in runs of these lengths (n_segments), each computed as its
                            own call computes it (several requests' prompt chunks in one forward) */
    int n_segments;
} Slice;

/* Output rows [begin, end) into y's columns (y is [rows, out]). */
static void run_bf16_slice(const Slice *s) {
    if (s->segments == NULL) {
        bf16_gemm_rows(s->w16, s->xs, s->rows, s->in, s->begin, s->end, s->isa_limit, s->alone, s->y + s->begin,
                       (size_t)s->out);
        return;
    }
    size_t first = 0; /* each segment's rows MAX_ROWS at a time from its own first row, as its own call goes */
    for (int i = 0; i < s->n_segments; first += (size_t)s->segments[i++])
        bf16_gemm_rows(s->w16, s->xs + first * s->in, s->segments[i], s->in, s->begin, s->end, s->isa_limit, s->alone,
                       s->y + first * s->out + s->begin, (size_t)s->out);
}

static void run_slice(const Slice *s) {
    if (s->q8 != NULL) {
        q8_gemm(s->q8, s->q8x, s->begin, s->end, s->isa_limit, s->y + s->begin, (size_t)s->out);
        return;
    }
    if (s->nibbles == NULL) {
        run_bf16_slice(s);
        return;
    }
    int n = s->end - s->begin;
    float tmp[MAX_ROWS * 64];
    for (int o = 0; o < n; o += 64) {
        int m = n - o < 64 ? n - o : 64;
        nibble_gemm(s->nibbles, s->xs, s->rows, s->begin + o, s->begin + o + m, s->isa_limit, s->alone, tmp);
        for (int r = 0; r < s->rows; r++)
            memcpy(s->y + (size_t)r * s->out + s->begin + o, tmp + (size_t)r * m, (size_t)m * sizeof(float));
    }
}

/* Blocks of 64 output rows (the float kernels' buffer) shared between the threads (split.c); calls
 * under 512 output rows stay on the caller (a wake-up would cost more than the work). */
#define SPLIT_ROWS 64

static void run_block(void *job, int block) {
    Slice part = *(const Slice *)job;
    part.begin += block * SPLIT_ROWS;
    if (part.begin + SPLIT_ROWS < part.end) part.end = part.begin + SPLIT_ROWS;
    run_slice(&part);
}

static void run_split(const Slice *whole, int threads) {
    if (threads < 2 || whole->out < 512) {
        run_slice(whole);
        return;
    }
    split_run(run_block, (void *)whole, (whole->end - whole->begin + SPLIT_ROWS - 1) / SPLIT_ROWS, threads);
}

/* Fills m from gemm/dequant's common arguments; 0 with a ValueError naming what is unsupported. */
static int nibble_matrix(NibbleMatrix *m, unsigned long long q, unsigned long long scales, int in, int out, int group,
                         int code, int scale_kind, const char *what) {
    NibbleMatrix made = {(const uint8_t *)(uintptr_t)q, (const void *)(uintptr_t)scales, code, scale_kind, in, group};
    if (out < 1 || !nibble_matrix_valid(&made)) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported shape or kind in=%d out=%d group=%d code=%d scale=%d", what, in,
                     out, group, code, scale_kind);
        return 0;
    }
    *m = made;
    return 1;
}

/* gemm(q_ptr, scales_ptr, x_ptr, y_ptr, rows, in, out, group, workspace_ptr, isa_limit, threads, code,
 * scale_kind, alone): y[rows, out] = x[rows, in] @ dequant(q, scales)^T. All pointers are addresses of
 * contiguous buffers; the workspace holds work_floats(rows, in, group) floats. isa_limit: 2 the best
 * available, 1 at most AVX2, 0 scalar (nibble_gemm's simd). alone: batch-invariant. */
static PyObject *py_gemm(PyObject *self, PyObject *args) {
    unsigned long long q, scales, x, y, work;
    int rows, in, out, group, isa_limit, threads = 1, code = CODE_INT4, scale_kind = SCALE_F16, alone = 0;
    if (!PyArg_ParseTuple(args, "KKKKiiiiKi|iiip", &q, &scales, &x, &y, &rows, &in, &out, &group, &work, &isa_limit,
                          &threads, &code, &scale_kind, &alone))
        return NULL;
    NibbleMatrix m;
    if (!nibble_matrix(&m, q, scales, in, out, group, code, scale_kind, "nibble gemm")) return NULL;
    if (rows < 1 || rows > MAX_ROWS) {
        PyErr_Format(PyExc_ValueError, "nibble gemm: unsupported shape rows=%d (1..%d)", rows, MAX_ROWS);
        return NULL;
    }
    float *xs = (float *)(uintptr_t)work;
    (void)nibble_simd_available(); /* detect the CPU once, before any helper thread looks */
    Slice whole = {&m, NULL, NULL, NULL, xs, (float *)(uintptr_t)y, rows, in, out, 0, out, isa_limit, alone};
    Py_BEGIN_ALLOW_THREADS
    nibble_prepare(&m, (const float *)(uintptr_t)x, rows, xs);
    run_split(&whole, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* work_floats(rows, in, group): the floats gemm's workspace needs. */
static PyObject *py_work_floats(PyObject *self, PyObject *args) {
    int rows, in, group;
    if (!PyArg_ParseTuple(args, "iii", &rows, &in, &group)) return NULL;
    NibbleMatrix m = {NULL, NULL, CODE_INT4, SCALE_F16, in, group};
    if (rows < 1 || in < 1 || group < 2) {
        PyErr_Format(PyExc_ValueError, "nibble work_floats: unsupported shape rows=%d in=%d group=%d", rows, in, group);
        return NULL;
    }
    return PyLong_FromSize_t(nibble_work_floats(&m, rows));
}

/* dequant(q_ptr, scales_ptr, out_ptr, out, in, group, code, scale_kind): float32 [out, in] = value *
 * scale, the same float operations as the torch reference, so the result is bit-identical to it. */
static PyObject *py_dequant(PyObject *self, PyObject *args) {
    unsigned long long q, scales, dst;
    int out, in, group, code = CODE_INT4, scale_kind = SCALE_F16;
    if (!PyArg_ParseTuple(args, "KKKiii|ii", &q, &scales, &dst, &out, &in, &group, &code, &scale_kind)) return NULL;
    NibbleMatrix m;
    if (!nibble_matrix(&m, q, scales, in, out, group, code, scale_kind, "nibble dequant")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    nibble_dequant(&m, out, (float *)(uintptr_t)dst);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Whether n_segments runs of at least one row (segments, int32) cover `rows` rows; else a ValueError. */
static int segments_cover(const int *segments, int n_segments, int rows, const char *what) {
    long long covered = 0;
    for (int i = 0; i < n_segments; i++) covered += segments[i] >= 1 ? segments[i] : -(long long)rows - 1;
    if (n_segments > 0 && covered != rows) {
        PyErr_Format(PyExc_ValueError, "%s: %d segments of at least one row must cover rows=%d", what, n_segments, rows);
        return 0;
    }
    return 1;
}

/* bf16_gemm(w_ptr, x_ptr, y_ptr, rows, in, out, isa_limit, threads, alone, segments_ptr, n_segments):
 * y[rows, out] = x[rows, in] @ w^T for w bf16 [out, in]; contiguous buffers. isa_limit: 2 best available, 1 at
 * most AVX2, 0 scalar. alone: batch-invariant (each row as a one-row call computes it). Any number of rows,
 * MAX_ROWS at a time: the bits of one call per MAX_ROWS rows. segments (int32 [n_segments], summing to rows;
 * 0: none): x's rows in runs, each with the bits of its own call. */
static PyObject *py_bf16_gemm(PyObject *self, PyObject *args) {
    unsigned long long w, x, y, segments = 0;
    int rows, in, out, isa_limit, threads = 1, alone = 0, n_segments = 0;
    if (!PyArg_ParseTuple(args, "KKKiiii|ipKi", &w, &x, &y, &rows, &in, &out, &isa_limit, &threads, &alone, &segments,
                          &n_segments))
        return NULL;
    if (rows < 1 || in < 1 || out < 1) {
        PyErr_Format(PyExc_ValueError, "bf16 gemm: unsupported shape rows=%d in=%d out=%d", rows, in, out);
        return NULL;
    }
    const int *runs = n_segments > 0 ? (const int *)(uintptr_t)segments : NULL;
    if (!segments_cover(runs, n_segments, rows, "bf16 gemm")) return NULL;
    (void)bf16_isa(in, 2); /* detect the CPU once, before any helper thread looks */
    Slice whole = {NULL, NULL, NULL, (const uint16_t *)(uintptr_t)w, (const float *)(uintptr_t)x, (float *)(uintptr_t)y,
                   rows, in, out, 0, out, isa_limit, alone, runs, n_segments};
    Py_BEGIN_ALLOW_THREADS
    run_split(&whole, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* q8_gemm(w_ptr, scales_ptr, x_ptr, y_ptr, rows, in, out, group, isa, threads, kind, scale_kind[, interleaved]):
 * y[rows, out] = quantise_int8(x[rows, in]) @ dequant(w, scales)^T (q8.c); kind 0 int4 nibbles, 1 int8;
 * group a multiple of 32; isa: the best instruction set to use (q8.h Q8_ISA_*, each the same bytes);
 * interleaved 1: w is in q8.h's interleaved layout (scales_ptr unused). Each row is computed as alone
 * (batch-invariant). */
static PyObject *py_q8_gemm(PyObject *self, PyObject *args) {
    unsigned long long w, scales, x, y;
    int rows, in, out, group, isa, threads, kind, scale_kind, interleaved = 0;
    if (!PyArg_ParseTuple(args, "KKKKiiiiiiii|p", &w, &scales, &x, &y, &rows, &in, &out, &group, &isa, &threads,
                          &kind, &scale_kind, &interleaved))
        return NULL;
    if (rows < 1 || in < 1 || out < 1 || group < Q8_BLOCK || group % Q8_BLOCK || kind < 0 || kind >= N_Q8_WEIGHTS ||
        scale_kind < 0 || scale_kind >= N_SCALE_KINDS || (interleaved && !q8_interleavable(kind, scale_kind, in, out, group))) {
        PyErr_Format(PyExc_ValueError,
                     "q8 gemm: unsupported shape or kind rows=%d in=%d out=%d group=%d kind=%d scale=%d interleaved=%d", rows,
                     in, out, group, kind, scale_kind, interleaved);
        return NULL;
    }
    Q8Matrix m = {(const void *)(uintptr_t)w, (const void *)(uintptr_t)scales, kind, scale_kind, in, group, interleaved};
    Q8Rows xq = {malloc(q8_work_bytes(rows, in)), 0, 0, kind};
    if (xq.work == NULL) return PyErr_NoMemory();
    (void)q8_vnni_available(); /* detect the CPU once, before any helper thread looks */
    Slice whole = {NULL, &m, &xq, NULL, NULL, (float *)(uintptr_t)y, rows, in, out, 0, out, isa, 1};
    Py_BEGIN_ALLOW_THREADS
    q8_prepare(kind, (const float *)(uintptr_t)x, rows, in, isa, &xq);
    run_split(&whole, threads);
    Py_END_ALLOW_THREADS
    free(xq.work);
    Py_RETURN_NONE;
}

/* q8_moe(x_ptr, rows, dim, inter, ids_ptr, weights_ptr, topk, expert_ids_ptr, n_experts, mats_ptr, kind13,
 * kind2, scale_kind, group13, group2, interleaved, clamp, limit, out_ptr, isa, threads): a MoE layer's
 * routed experts with int8 activations (q8_moe.c). x float32 [rows, dim], ids int64 and weights float32
 * [rows, topk], expert_ids int64 [n_experts], mats int64 [n_experts, 6] (addresses of w1, its scales,
 * w3, its scales, w2, its scales; interleaved: the three matrices in q8.h's interleaved layout, the scale
 * addresses unused), out float64 [rows, dim] (added to). */
static PyObject *py_q8_moe(PyObject *self, PyObject *args) {
    unsigned long long x, ids, weights, expert_ids, mats, out;
    int rows, dim, inter, topk, n_experts, kind13, kind2, scale_kind, group13, group2, interleaved, clamp, isa, threads;
    float limit;
    if (!PyArg_ParseTuple(args, "KiiiKKiKiKiiiiippfKii", &x, &rows, &dim, &inter, &ids, &weights, &topk, &expert_ids,
                          &n_experts, &mats, &kind13, &kind2, &scale_kind, &group13, &group2, &interleaved, &clamp,
                          &limit, &out, &isa, &threads))
        return NULL;
    Q8Layout layout = {dim, inter, kind13, kind2, scale_kind, group13, group2, interleaved};
    if (rows < 1 || topk < 1 || n_experts < 0 || !q8_layout_valid(&layout)) {
        PyErr_Format(PyExc_ValueError, "q8 moe: unsupported shape or kind rows=%d dim=%d inter=%d topk=%d kinds=%d,%d "
                     "scale=%d groups=%d,%d interleaved=%d", rows, dim, inter, topk, kind13, kind2, scale_kind, group13,
                     group2, interleaved);
        return NULL;
    }
    Q8Expert *experts = malloc(sizeof(Q8Expert) * (size_t)(n_experts > 0 ? n_experts : 1));
    if (experts == NULL) return PyErr_NoMemory();
    const uint64_t *p = (const uint64_t *)(uintptr_t)mats;
    for (int e = 0; e < n_experts; e++) experts[e] = q8_expert_at(p + (size_t)e * 6, &layout);
    Q8MoE moe = {experts, (const int64_t *)(uintptr_t)expert_ids, n_experts, (const float *)(uintptr_t)x,
                 (const int64_t *)(uintptr_t)ids, (const float *)(uintptr_t)weights, rows, topk, dim, inter, clamp,
                 limit, isa, threads, (double *)(uintptr_t)out};
    int status;
    (void)q8_vnni_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    status = q8_moe_run(&moe);
    Py_END_ALLOW_THREADS
    free(experts);
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* nibble_moe(x_ptr, rows, ids_ptr, weights_ptr, topk, expert_ids_ptr, n_experts, mats_ptr, (dim, inter, code13,
 * code2, scale_kind, group13, group2), clamp, limit, out_ptr, threads, alone, segments_ptr, n_segments): a MoE
 * layer's routed 4-bit experts with float32 activations (nibble_moe.c), the arrays as q8_moe's; alone: decode
 * rows' products; segments (int32 [n_segments] covering rows; 0: none): several prompt chunks' rows. */
static PyObject *py_nibble_moe(PyObject *self, PyObject *args) {
    unsigned long long x, ids, weights, expert_ids, mats, out, segments = 0;
    int rows, topk, n_experts, clamp, threads, alone, dim, inter, code13, code2, scale_kind, group13, group2;
    int n_segments = 0;
    float limit;
    PyObject *layout;
    if (!PyArg_ParseTuple(args, "KiKKiKiKO!pfKip|Ki", &x, &rows, &ids, &weights, &topk, &expert_ids, &n_experts, &mats,
                          &PyTuple_Type, &layout, &clamp, &limit, &out, &threads, &alone, &segments, &n_segments) ||
        !PyArg_ParseTuple(layout, "iiiiiii", &dim, &inter, &code13, &code2, &scale_kind, &group13, &group2))
        return NULL;
    const int *runs = n_segments > 0 ? (const int *)(uintptr_t)segments : NULL;
    if (!segments_cover(runs, n_segments, rows, "nibble moe")) return NULL;
    NibbleMatrix w13, w2;
    if (!nibble_matrix(&w13, 0, 0, dim, inter, group13, code13, scale_kind, "nibble moe: w1/w3") ||
        !nibble_matrix(&w2, 0, 0, inter, dim, group2, code2, scale_kind, "nibble moe: w2"))
        return NULL;
    if (rows < 1 || topk < 1 || n_experts < 0) {
        PyErr_Format(PyExc_ValueError, "nibble moe: rows=%d topk=%d experts=%d", rows, topk, n_experts);
        return NULL;
    }
    NibbleExpert *experts = malloc(sizeof(NibbleExpert) * (size_t)(n_experts > 0 ? n_experts : 1));
    if (experts == NULL) return PyErr_NoMemory();
    const uint64_t *m = (const uint64_t *)(uintptr_t)mats;
    NibbleExpert like = {w13, w13, w2};
    for (int e = 0; e < n_experts; e++) experts[e] = nibble_expert_at(m + (size_t)e * 6, &like);
    NibbleMoE moe = {experts, (const int64_t *)(uintptr_t)expert_ids, n_experts, (const float *)(uintptr_t)x,
                     (const int64_t *)(uintptr_t)ids, (const float *)(uintptr_t)weights, rows, topk, dim, inter, clamp,
                     limit, threads, alone, (double *)(uintptr_t)out, runs, runs != NULL ? n_segments : 0};
    int status;
    (void)nibble_simd_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    status = nibble_moe_run(&moe);
    Py_END_ALLOW_THREADS
    free(experts);
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* read_ahead(ranges, threads): ranges a sequence of (address, bytes); the helper thread reads them into the
 * caches while it has no kernel block to run, replacing the previous request (split.h split_read_ahead). The
 * caller keeps the memory alive until its next request. */
static PyObject *py_read_ahead(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "read_ahead: ranges must be a sequence of (address, bytes)");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    const void **starts = malloc(sizeof(void *) * (size_t)(n > 0 ? n : 1));
    size_t *lengths = malloc(sizeof(size_t) * (size_t)(n > 0 ? n : 1));
    int ok = starts != NULL && lengths != NULL;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned long long address, bytes;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KK", &address, &bytes);
        if (ok) starts[i] = (const void *)(uintptr_t)address, lengths[i] = (size_t)bytes;
    }
    if (ok && split_read_ahead(starts, lengths, (int)n, threads) != 0) PyErr_NoMemory(), ok = 0;
    else if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    free(starts), free(lengths);
    Py_DECREF(fast);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_bytes_read_ahead(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(read_ahead_bytes_read());
}

/* cores_shared(max_age_ns): the helper thread's last verdict on its core, True/False, None if none that recent. */
static PyObject *py_cores_shared(PyObject *self, PyObject *args) {
    long max_age;
    if (!PyArg_ParseTuple(args, "l", &max_age)) return NULL;
    int verdict = split_cores_shared(max_age);
    if (verdict < 0) Py_RETURN_NONE;
    return PyBool_FromLong(verdict);
}

/* split_probe(helper_ns, helper_sleeps, fresh): split.c's solo rule checked (tests): blocks the helper ran of a
 * two-block job. */
static PyObject *py_split_probe(PyObject *self, PyObject *args) {
    long helper_ns;
    int sleeps, fresh, helper_blocks;
    if (!PyArg_ParseTuple(args, "lpp", &helper_ns, &sleeps, &fresh)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    helper_blocks = split_probe(helper_ns, sleeps, fresh);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(helper_blocks);
}

/* split_solo_ns(): the length of split.c's last solo period (tests). */
static PyObject *py_split_solo_ns(PyObject *self, PyObject *unused) { return PyLong_FromLong(split_solo_ns()); }

/* split_give_load(helper_share, yield_lost, solo_ns): split.c's load signals given, not measured (tests). */
static PyObject *py_split_give_load(PyObject *self, PyObject *args) {
    double share;
    int yield_lost;
    long solo_ns;
    if (!PyArg_ParseTuple(args, "dil", &share, &yield_lost, &solo_ns)) return NULL;
    split_give_load(share, yield_lost, solo_ns);
    Py_RETURN_NONE;
}

/* split_end_solo(ago_ns): split.c's solo period ended ago_ns ago (tests). */
static PyObject *py_split_end_solo(PyObject *self, PyObject *args) {
    long ago_ns;
    if (!PyArg_ParseTuple(args, "l", &ago_ns)) return NULL;
    split_end_solo(ago_ns);
    Py_RETURN_NONE;
}

/* rms_norm(x_ptr, rows, dim, w_ptr, eps, out_ptr): float32 [rows, dim] (decode_ops.c). */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    int rows, dim;
    float eps;
    if (!PyArg_ParseTuple(args, "KiiKfK", &x, &rows, &dim, &w, &eps, &out)) return NULL;
    if (rows < 0 || dim < 1) {
        PyErr_Format(PyExc_ValueError, "rms_norm: rows=%d dim=%d", rows, dim);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows((const float *)(uintptr_t)x, rows, dim, (const float *)(uintptr_t)w, eps, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* index_finish(x_ptr, rows, heads, dim, ln_weight_ptr or 0, ln_bias_ptr, eps, rope, interleaved, cos_ptr, sin_ptr,
 * period, out_ptr): the DSA indexer's key (with its LayerNorm) or query heads after their projection, float32
 * [rows, heads, dim], roped at angles [period, rope / 2] (decode_ops.c). */
static PyObject *py_index_finish(PyObject *self, PyObject *args) {
    unsigned long long x, ln_weight, ln_bias, cos, sin, out;
    int rows, heads, dim, rope, interleaved, period;
    float eps;
    if (!PyArg_ParseTuple(args, "KiiiKKfiiKKiK", &x, &rows, &heads, &dim, &ln_weight, &ln_bias, &eps, &rope,
                          &interleaved, &cos, &sin, &period, &out))
        return NULL;
    int bad_rope = rope < 0 || rope > dim || rope % 2;
    if (rows < 0 || heads < 1 || dim < 1 || bad_rope || period < 1 || (ln_weight && !ln_bias)) {
        PyErr_Format(PyExc_ValueError, "index_finish: rows=%d heads=%d dim=%d rope=%d period=%d", rows, heads, dim,
                     rope, period);
        return NULL;
    }
    IndexFinish how = {(const float *)(uintptr_t)ln_weight, (const float *)(uintptr_t)ln_bias, eps, rope,
                       interleaved, period, (const float *)(uintptr_t)cos, (const float *)(uintptr_t)sin};
    /* microseconds: the GIL kept (a release lets a waiting thread in for up to the switch interval) */
    index_finish_rows(&how, (const float *)(uintptr_t)x, rows, heads, dim, (float *)(uintptr_t)out);
    Py_RETURN_NONE;
}

/* route(x_ptr, rows, weight_ptr, bias_ptr or 0, experts, dim, score, groups, topk_groups, topk, normalise,
 * scale, ids_ptr, weights_ptr): the router of rows of x float32 [rows, dim] (decode_ops.c); ids int64 and
 * weights float32 [rows, topk]. */
static PyObject *py_route(PyObject *self, PyObject *args) {
    unsigned long long x, w, bias, ids, weights;
    int rows, experts, dim, score, groups, topk_groups, topk, normalise, ld;
    float scale;
    if (!PyArg_ParseTuple(args, "KiKKiiiiiipfKKi", &x, &rows, &w, &bias, &experts, &dim, &score, &groups, &topk_groups,
                          &topk, &normalise, &scale, &ids, &weights, &ld))
        return NULL;
    Router router = {(const float *)(uintptr_t)w, (const float *)(uintptr_t)bias, experts, dim, score, groups,
                     topk_groups, topk, normalise, scale, ld};
    if (rows < 0 || ld < dim || !router_valid(&router)) {
        PyErr_Format(PyExc_ValueError, "route: experts=%d groups=%d topk_groups=%d topk=%d score=%d", experts, groups,
                     topk_groups, topk, score);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = route_rows(&router, (const float *)(uintptr_t)x, rows, (int64_t *)(uintptr_t)ids, (float *)(uintptr_t)weights);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* attend_one(q_nope_ptr, q_rope_ptr, latents_ptr, rope_keys_ptr, positions_ptr or 0, total, heads, nope, rope,
 * value, rank, softmax_scale, kv_b_ptr, kv_b_scales_ptr or 0 (float32: kv_b float32), group, out_ptr, threads):
 * absorbed MLA attention for one query (decode_ops.c). */
static PyObject *py_attend_one(PyObject *self, PyObject *args) {
    unsigned long long q_nope, q_rope, latents, rope_keys, positions, kv_b, kv_b_scales, out;
    int total, heads, nope, rope, value, rank, group, threads;
    float softmax_scale;
    if (!PyArg_ParseTuple(args, "KKKKKiiiiiifKKiKi", &q_nope, &q_rope, &latents, &rope_keys, &positions, &total, &heads,
                          &nope, &rope, &value, &rank, &softmax_scale, &kv_b, &kv_b_scales, &group, &out, &threads))
        return NULL;
    if (total < 1 || heads < 1 || nope < 1 || rope < 0 || value < 1 || rank < 1 || (kv_b_scales && group < 1)) {
        PyErr_Format(PyExc_ValueError, "attend_one: total=%d heads=%d nope=%d rope=%d value=%d rank=%d group=%d", total,
                     heads, nope, rope, value, rank, group);
        return NULL;
    }
    AttendOne job = {(const float *)(uintptr_t)q_nope, (const float *)(uintptr_t)q_rope,
                     (const float *)(uintptr_t)latents, (const float *)(uintptr_t)rope_keys,
                     (const int64_t *)(uintptr_t)positions, total, heads, nope, rope, value, rank, softmax_scale,
                     {(const void *)(uintptr_t)kv_b, (const float *)(uintptr_t)kv_b_scales, kv_b_scales != 0, group},
                     (float *)(uintptr_t)out};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attend_one(&job, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* index_select(q_ptr, weights_ptr, keys_ptr, rows, heads, dim, seen, topk, scale, chosen_ptr, threads): the DSA
 * indexer's choice for consecutive query rows (index_select.c), row r seeing keys [0, seen + r); q float32
 * [rows, heads, dim], weights [rows, heads], keys [seen + rows - 1, dim], chosen int64 [rows, topk]. */
static PyObject *py_index_select(PyObject *self, PyObject *args) {
    unsigned long long q, weights, keys, chosen;
    int rows, heads, dim, seen, topk, threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKiiiiifKi", &q, &weights, &keys, &rows, &heads, &dim, &seen, &topk, &scale, &chosen,
                          &threads))
        return NULL;
    if (rows < 1 || heads < 1 || dim < 1 || seen < 1 || topk < 1) {
        PyErr_Format(PyExc_ValueError, "index_select: rows=%d heads=%d dim=%d seen=%d topk=%d", rows, heads, dim, seen,
                     topk);
        return NULL;
    }
    IndexSelect job = {(const float *)(uintptr_t)q, (const float *)(uintptr_t)weights, (const float *)(uintptr_t)keys,
                       rows, heads, dim, seen, topk, scale, (int64_t *)(uintptr_t)chosen};
    int rc;
    (void)nibble_simd_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    rc = index_select(&job, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* index_tile_scores(q_ptr, weights_ptr, keys_t_ptr, rows, heads, dim, keys, key_stride, scale, scores_ptr,
 * score_stride, simd, threads): a long prompt's DSA indexer scores (index_select.c), float32: q [rows, heads, dim],
 * weights [rows, heads], keys_t [dim, key_stride] from the first key scored, scores [rows, score_stride]. */
static PyObject *py_index_tile_scores(PyObject *self, PyObject *args) {
    unsigned long long q, weights, keys_t, scores;
    int rows, heads, dim, keys, key_stride, score_stride, simd, threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKiiiiifKiii", &q, &weights, &keys_t, &rows, &heads, &dim, &keys, &key_stride, &scale,
                          &scores, &score_stride, &simd, &threads))
        return NULL;
    if (rows < 1 || heads < 1 || dim < 1 || keys < 1 || key_stride < keys || score_stride < keys) {
        PyErr_Format(PyExc_ValueError, "index_tile_scores: rows=%d heads=%d dim=%d keys=%d key_stride=%d score_stride=%d",
                     rows, heads, dim, keys, key_stride, score_stride);
        return NULL;
    }
    IndexTiles job = {(const float *)(uintptr_t)q, (const float *)(uintptr_t)weights, (const float *)(uintptr_t)keys_t,
                      rows, heads, dim, keys, key_stride, scale, (float *)(uintptr_t)scores, score_stride};
    (void)nibble_simd_available(); /* detect the CPU once, before any helper thread looks */
    Py_BEGIN_ALLOW_THREADS
    index_tile_scores(&job, simd, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* index_tile_choose(slab_ptr, rows, width, slab_stride, first, position, topk, merged, ranks_ptr, threads): a long
 * prompt's running top-k (index_choose.c): slab float32 [rows, slab_stride] (keys first .. first + width), ranks
 * uint64 [rows, topk] (read where merged, written). */
static PyObject *py_index_tile_choose(PyObject *self, PyObject *args) {
    unsigned long long slab, ranks;
    int rows, width, slab_stride, first, position, topk, merged, threads, rc;
    if (!PyArg_ParseTuple(args, "KiiiiiipKi", &slab, &rows, &width, &slab_stride, &first, &position, &topk, &merged,
                          &ranks, &threads))
        return NULL;
    if (rows < 1 || topk < 1 || width < 1 || slab_stride < width || first < 0 || (!merged && width < topk)) {
        PyErr_Format(PyExc_ValueError, "index_tile_choose: rows=%d width=%d slab_stride=%d first=%d topk=%d merged=%d",
                     rows, width, slab_stride, first, topk, merged);
        return NULL;
    }
    IndexChoice choice = {(const float *)(uintptr_t)slab, rows, width, slab_stride, first, position, topk, merged,
                          (uint64_t *)(uintptr_t)ranks};
    Py_BEGIN_ALLOW_THREADS
    rc = index_tile_choose(&choice, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", py_rms_norm, METH_VARARGS, "out = w * x / sqrt(mean(x^2) + eps) per row, float32."},
    {"route", py_route, METH_VARARGS, "a MoE router's expert ids and weights for rows of x, float32."},
    {"attend_one", py_attend_one, METH_VARARGS, "absorbed MLA attention of one query over the compressed cache."},
    {"index_finish", py_index_finish, METH_VARARGS, "the DSA indexer's key or query heads normed and roped, float32."},
    {"index_select", py_index_select, METH_VARARGS, "the DSA indexer's top-k positions for query rows."},
    {"index_tile_scores", py_index_tile_scores, METH_VARARGS, "a long prompt's DSA indexer scores, keys as columns."},
    {"index_tile_choose", py_index_tile_choose, METH_VARARGS, "a long prompt's DSA indexer running top-k, one slab."},
    {"bytes_read_ahead", py_bytes_read_ahead, METH_NOARGS, "bytes the helper thread has read ahead into the caches, ever."},
    {"cores_shared", py_cores_shared, METH_VARARGS, "the helper thread's last verdict on its core (None: none that recent)."},
    {"split_probe", py_split_probe, METH_VARARGS, "blocks the helper ran of a two-block job whose helper block sleeps or spins (tests)."},
    {"split_solo_ns", py_split_solo_ns, METH_NOARGS, "the length of the last solo period in ns (tests)."},
    {"split_give_load", py_split_give_load, METH_VARARGS, "the thread split's load signals given, not measured (tests)."},
    {"split_end_solo", py_split_end_solo, METH_VARARGS, "the thread split's solo period ended ago_ns ago (tests)."},
    {"read_ahead", py_read_ahead, METH_VARARGS, "read these (address, bytes) ranges into the caches on the idle helper thread."},
    {"nibble_moe", py_nibble_moe, METH_VARARGS, "a MoE layer's routed 4-bit SwiGLU experts, float32 x, added to out."},
    {"q8_moe", py_q8_moe, METH_VARARGS, "a MoE layer's routed SwiGLU experts with int8 activations, added to out."},
    {"q8_gemm", py_q8_gemm, METH_VARARGS, "y[rows, out] = int8(x[rows, in]) @ dequant(w, scales)^T, integer dot products."},
    {"dequant", py_dequant, METH_VARARGS, "float32 [out, in] from 4-bit group-quantised q and its scales."},
    {"gemm", py_gemm, METH_VARARGS, "y[rows, out] = x[rows, in] @ dequant(q, scales)^T for 4-bit group-quantised q."},
    {"work_floats", py_work_floats, METH_VARARGS, "floats of workspace gemm needs for (rows, in, group)."},
    {"bf16_gemm", py_bf16_gemm, METH_VARARGS, "y[rows, out] = x[rows, in] @ w^T for bf16 w [out, in], float32 x and y."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

extern PyMethodDef py_decode_methods[]; /* py_decode.c: the fused decode steps */

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    pthread_atfork(NULL, NULL, split_after_fork);
    if (m && PyModule_AddFunctions(m, py_decode_methods) != 0) Py_CLEAR(m);
    if (m) PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS);
    /* the entry points and signatures of this build (engine/kernels/native.py checks it): raise both together */
    if (m) PyModule_AddIntConstant(m, "ABI_VERSION", 8);
    /* 2 AVX-512, 1 AVX2 or NEON, 0 none: without SIMD the bf16 path would be slower than float32 matmul. */
    if (m) PyModule_AddIntConstant(m, "BF16_SIMD", bf16_isa(64, 2));
    /* 1: the int8-activation kernels multiply with AVX-512 VNNI's dpbusd (else AVX2 maddubs, or C) */
    if (m) PyModule_AddIntConstant(m, "Q8_VNNI", q8_vnni_available());
    if (m) PyModule_AddIntConstant(m, "Q8_TILES_FAST", q8_tiles_fast());
    /* 1: a prompt's tile products run on the AMX unit (AMX-INT8, granted by Linux) */
    if (m) PyModule_AddIntConstant(m, "Q8_AMX", q8_amx_available());
    /* the loops the quantised kernels take (x86: 2 AVX-512, 1 AVX2; aarch64: 2 NEON with dot-product, 1 NEON;
     * 0 plain C), COLIBRI_STREAM_ISA's cap applied */
    if (m) PyModule_AddIntConstant(m, "SIMD_LEVEL", nibble_simd_available() + nibble_simd_wide());
    /* 1 where COLIBRI_STREAM_ISA=avx2 (x86) or =neon (aarch64) held the kernels to those loops when the extension
     * loaded, else 2 */
    if (m) PyModule_AddIntConstant(m, "ISA_CAP", isa_cap());
    /* aarch64: bit 0 dot-product, bit 1 i8mm, as the CPU reports them (uncapped); 0 elsewhere */
    if (m) PyModule_AddIntConstant(m, "ARM_FEATURES", arm_features());
    return m;
}
