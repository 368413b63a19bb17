/*
 * The SIMD kernels' output bits on this machine, one line per case: a test (tests/test_engine/kernels/
 * test_neon_bits.py) builds it natively (x86: the AVX2 / AVX-512 loops) and with aarch64-linux-gnu-gcc,
 * runs the ARM build under qemu-aarch64 with and without dot-product (the NEON loops) and asserts that
 * every line is the same: the NEON paths give the x86 paths' bits. Not a benchmark.
 *
 *   gcc -O3 -ffp-contract=off -Iengine/csrc -o /tmp/bits tools/kernel_bits_harness.c engine/csrc/nibble.c \
 *       engine/csrc/q8.c engine/csrc/q8_tiles.c engine/csrc/bf16.c engine/csrc/decode_ops.c engine/csrc/index_select.c \
 *       engine/csrc/split.c engine/csrc/read_ahead.c -lm -lpthread && /tmp/bits
 *   aarch64-linux-gnu-gcc -static (same) && qemu-aarch64 -cpu max /tmp/bits; qemu-aarch64 -cpu cortex-a57 /tmp/bits
 *
 * Each line: kernel, case, FNV-1a of the SIMD result's bytes. The SIMD result is also checked against the
 * plain C one (a different summation order: to float rounding) and, where a kernel has two SIMD levels
 * that promise the same bytes (q8: AVX2 and VNNI, NEON and dot-product, the tile products' AVX-512 and plain C;
 * nibble: AVX2 and AVX-512), the
 * two against each other (the indexer's tiles: every path against the plain C loop, byte for byte); a failure
 * prints "FAIL" and the exit status is 1. The first line names the levels found (they differ between
 * machines: the test compares the other lines).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "decode_ops.h"
#include "index_select.h"
#include "nibble.h"
#include "q8.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { /* splitmix64: the same numbers on every machine */
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}
static float small(void) { return (float)((int)(next() % 4001) - 2000) / 1024.f; } /* exact in float */

static uint64_t fnv(const void *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

static int failures;

static void close_to(const char *what, const float *got, const float *want, size_t n) {
    float top = 0.f, worst = 0.f;
    for (size_t i = 0; i < n; i++) top = fmaxf(top, fabsf(want[i]));
    for (size_t i = 0; i < n; i++) worst = fmaxf(worst, fabsf(got[i] - want[i]));
    if (!(worst <= 1e-4f * (top > 1.f ? top : 1.f))) {
        printf("FAIL %s: SIMD vs plain C differ by %g (max |y| %g)\n", what, worst, top);
        failures++;
    }
}

static void same(const char *what, const void *a, const void *b, size_t bytes) {
    if (memcmp(a, b, bytes) != 0) {
        printf("FAIL %s: two paths that promise the same bytes differ\n", what);
        failures++;
    }
}

static void *scales_of(int kind, size_t n) {
    uint8_t *e = malloc(n * 2);
    uint16_t *h = (uint16_t *)e;
    for (size_t i = 0; i < n; i++) {
        uint16_t sign = (uint16_t)(next() % 2 ? 0x8000 : 0);
        if (kind == SCALE_F16) h[i] = sign | (uint16_t)(0x2c00 + next() % 1024);
        else if (kind == SCALE_BF16) h[i] = sign | (uint16_t)(0x3d00 + next() % 256);
        else e[i] = (uint8_t)(120 + next() % 10);
    }
    return e;
}

/* The float 4-bit kernel: simd 0 (plain C), 1 and 2, alone or not. */
static void nibble_case(int in, int out, int group, int rows, int code, int scale_kind, int alone) {
    NibbleMatrix m = {NULL, NULL, code, scale_kind, in, group};
    size_t bytes = (size_t)out * nibble_row_bytes(&m), n = (size_t)rows * out;
    uint8_t *q = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) q[i] = (uint8_t)next();
    m.q = q, m.scales = scales_of(scale_kind, (size_t)out * nibble_groups(&m));
    float *x = malloc(sizeof(float) * rows * in), *xs = malloc(sizeof(float) * nibble_work_floats(&m, rows));
    for (int i = 0; i < rows * in; i++) x[i] = small();
    nibble_prepare(&m, x, rows, xs);
    float *y[3];
    for (int simd = 0; simd < 3; simd++) y[simd] = malloc(sizeof(float) * n), nibble_gemm(&m, xs, rows, 0, out, simd, alone, y[simd]);
    char what[96];
    snprintf(what, sizeof what, "nibble in=%d out=%d group=%d rows=%d code=%d scales=%d alone=%d", in, out, group, rows, code, scale_kind, alone);
    close_to(what, y[1], y[0], n);
    same(what, y[1], y[2], n * sizeof(float));
    printf("%s %016llx\n", what, (unsigned long long)fnv(y[2], n * sizeof(float)));
    for (int simd = 0; simd < 3; simd++) free(y[simd]);
    free(q), free((void *)m.scales), free(x), free(xs);
}

/* Rows o..o+3's spans of a row-major int4 / int8 matrix in the interleaved layout (q8.h). */
static uint8_t *interleave(int kind, int scale_kind, int in, int out, int group, const uint8_t *w, const uint8_t *scales) {
    size_t step = kind == Q8_WEIGHTS_INT4 ? 32 : 64, row = kind == Q8_WEIGHTS_INT4 ? (size_t)in / 2 : (size_t)in;
    size_t span = q8_span_bytes(kind, scale_kind, group), sb = scale_kind == SCALE_E8M0 ? 1 : 2;
    int spans = in / Q8_SPAN, per = Q8_SPAN / group, chunks = Q8_SPAN / Q8_CHUNK;
    uint8_t *packed = malloc((size_t)(out / 4) * spans * span);
    for (int o = 0; o < out; o += 4)
        for (int sp = 0; sp < spans; sp++) {
            uint8_t *dst = packed + ((size_t)(o / 4) * spans + sp) * span;
            for (int c8 = 0; c8 < chunks; c8++)
                for (int p = 0; p < 4; p++)
                    memcpy(dst + (4 * c8 + p) * step, w + (size_t)(o + p) * row + (size_t)(sp * chunks + c8) * step, step);
            for (int p = 0; p < 4; p++)
                memcpy(dst + chunks * 4 * step + (size_t)p * per * sb, scales + ((size_t)(o + p) * (in / group) + sp * per) * sb, per * sb);
        }
    return packed;
}

/* Weights times int8 rows: isa 0, 1 and 2 (the last two promise the same bytes), the prepared x's bytes too. */
static void q8_case(int in, int out, int group, int rows, int kind, int scale_kind, int interleaved) {
    size_t row = kind == Q8_WEIGHTS_INT4 ? (size_t)(in + 1) / 2 : (size_t)in, n = (size_t)rows * out;
    size_t groups = (size_t)out * ((in + group - 1) / group);
    uint8_t *w = malloc(row * out);
    for (size_t i = 0; i < row * out; i++) w[i] = kind == Q8_WEIGHTS_INT4 ? (uint8_t)next() : (uint8_t)(int8_t)((int)(next() % 255) - 127);
    uint8_t *scales = scales_of(scale_kind, groups), *packed = NULL;
    Q8Matrix m = {w, scales, kind, scale_kind, in, group, 0};
    if (interleaved) m.w = packed = interleave(kind, scale_kind, in, out, group, w, scales), m.scales = NULL, m.interleaved = 1;
    float *x = malloc(sizeof(float) * rows * in);
    for (int i = 0; i < rows * in; i++) x[i] = small() * (i % 97 == 0 ? 40.f : 1.f);
    for (int i = 0; i < in && i < 32; i++) x[i] = 0.f; /* an all-zero block: scale 0 */
    Q8Rows xq[2];
    uint8_t *work[2];
    for (int simd = 0; simd < 2; simd++) work[simd] = malloc(q8_work_bytes(rows, in)), xq[simd].work = work[simd], q8_prepare(kind, x, rows, in, simd, &xq[simd]);
    char what[112];
    snprintf(what, sizeof what, "q8 in=%d out=%d group=%d rows=%d kind=%d scales=%d interleaved=%d", in, out, group, rows, kind, scale_kind, interleaved);
    if (memcmp(work[0], work[1], q8_work_bytes(rows, in)) != 0) printf("FAIL %s: prepared x differs from plain C's\n", what), failures++;
    float *y[5]; /* q8_gemm at each isa, then the tile products (q8_tiles.h) of the plain C loop and the best */
    for (int isa = 0; isa < 3; isa++) y[isa] = malloc(sizeof(float) * n), q8_gemm(&m, &xq[1], 0, out, isa, y[isa], (size_t)out);
    for (int t = 0; t < 2; t++) y[3 + t] = malloc(sizeof(float) * n), q8_gemm(&m, &xq[1], 0, out, 2 * t | Q8_TILES, y[3 + t], (size_t)out);
    close_to(what, y[1], y[0], n);
    close_to(what, y[3], y[0], n);
    same(what, y[1], y[2], n * sizeof(float));
    same(what, y[3], y[4], n * sizeof(float));
    printf("%s %016llx x %016llx t %016llx\n", what, (unsigned long long)fnv(y[2], n * sizeof(float)),
           (unsigned long long)fnv(work[0], q8_work_bytes(rows, in)), (unsigned long long)fnv(y[4], n * sizeof(float)));
    for (int i = 0; i < 5; i++) free(y[i]);
    free(w), free(scales), free(packed), free(x), free(work[0]), free(work[1]);
}

/* bf16 weights times float rows: limit 1 (AVX2 / NEON: the same loops) against 0. */
static void bf16_case(int in, int out, int rows, int alone) {
    size_t n = (size_t)rows * out;
    uint16_t *w = malloc(sizeof(uint16_t) * in * out);
    for (int i = 0; i < in * out; i++) w[i] = (uint16_t)((next() % 2 ? 0x8000 : 0) | (0x3c00 + next() % 0x300));
    float *x = malloc(sizeof(float) * rows * in), *y0 = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);
    for (int i = 0; i < rows * in; i++) x[i] = small();
    bf16_gemm_rows(w, x, rows, in, 0, out, 0, alone, y0, (size_t)out);
    bf16_gemm_rows(w, x, rows, in, 0, out, 1, alone, y1, (size_t)out);
    char what[64];
    snprintf(what, sizeof what, "bf16 in=%d out=%d rows=%d alone=%d", in, out, rows, alone);
    close_to(what, y1, y0, n);
    printf("%s %016llx\n", what, (unsigned long long)fnv(y1, n * sizeof(float)));
    free(w), free(x), free(y0), free(y1);
}

/* The fused decode step's vector ops (decode_ops.h's test entry). */
static void decode_ops_case(int n, int group) {
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n), *s = malloc(sizeof(float) * (n / group + 1));
    int8_t *q = malloc((size_t)n);
    for (int i = 0; i < n; i++) a[i] = small(), b[i] = small(), q[i] = (int8_t)((int)(next() % 255) - 127);
    for (int i = 0; i <= n / group; i++) s[i] = small() / 64.f;
    float out[2][4 + 2 * 4096];
    for (int simd = 0; simd < 2; simd++) decode_ops_probe(simd, a, b, q, s, group, n, out[simd]);
    char what[48];
    snprintf(what, sizeof what, "decode_ops n=%d group=%d", n, group);
    close_to(what, out[1], out[0], 4 + 2 * (size_t)n);
    printf("%s %016llx\n", what, (unsigned long long)fnv(out[1], sizeof(float) * (4 + 2 * (size_t)n)));
    free(a), free(b), free(s), free(q);
}

/* The DSA indexer's scores of one row (index_select.h), heads past a multiple of 8 and dims with a tail too. */
static void index_case(int heads, int dim, int seen, int rows) {
    size_t nq = (size_t)rows * heads * dim, nk = (size_t)(seen + rows - 1) * dim;
    float *q = malloc(sizeof(float) * nq), *w = malloc(sizeof(float) * rows * heads), *keys = malloc(sizeof(float) * nk);
    for (size_t i = 0; i < nq; i++) q[i] = small();
    for (size_t i = 0; i < nk; i++) keys[i] = small();
    for (int i = 0; i < rows * heads; i++) w[i] = small() / 8.f;
    IndexSelect j = {q, w, keys, rows, heads, dim, seen, 1, 1.f / sqrtf((float)dim), NULL};
    float *a = malloc(sizeof(float) * (seen + rows)), *b = malloc(sizeof(float) * (seen + rows));
    char what[64];
    snprintf(what, sizeof what, "index heads=%d dim=%d seen=%d", heads, dim, seen);
    uint64_t h = 0;
    for (int r = 0; r < rows; r++) {
        index_row_scores(&j, r, 0, a), index_row_scores(&j, r, 1, b);
        close_to(what, b, a, (size_t)(seen + r));
        h = h * 31 + fnv(b, sizeof(float) * (size_t)(seen + r));
    }
    printf("%s %016llx\n", what, (unsigned long long)h);
    free(q), free(w), free(keys), free(a), free(b);
}

/* A long prompt's indexer scores (index_select.h index_tile_scores): a column slice of a wider key matrix, key
 * counts off the vector widths; every path promises the plain C loop's bytes. */
static void tile_case(int heads, int dim, int keys, int rows) {
    int stride = keys + 5;
    size_t nq = (size_t)rows * heads * dim, nk = (size_t)dim * stride, ns = (size_t)rows * keys;
    float *q = malloc(sizeof(float) * nq), *w = malloc(sizeof(float) * rows * heads), *kt = malloc(sizeof(float) * nk);
    float *a = malloc(sizeof(float) * ns), *b = malloc(sizeof(float) * ns);
    for (size_t i = 0; i < nq; i++) q[i] = small();
    for (size_t i = 0; i < nk; i++) kt[i] = small();
    for (int i = 0; i < rows * heads; i++) w[i] = small() / 8.f;
    IndexTiles j = {q, w, kt + 3, rows, heads, dim, keys, stride, 1.f / sqrtf((float)dim), a, keys};
    index_tile_scores(&j, 0, 1);
    j.scores = b;
    index_tile_scores(&j, 1, 2);
    char what[64];
    snprintf(what, sizeof what, "index tiles heads=%d dim=%d keys=%d", heads, dim, keys);
    same(what, a, b, sizeof(float) * ns);
    printf("%s %016llx\n", what, (unsigned long long)fnv(b, sizeof(float) * ns));
    free(q), free(w), free(kt), free(a), free(b);
}

int main(void) {
    printf("levels simd=%d wide=%d q8-vnni=%d bf16=%d\n", nibble_simd_available(), nibble_simd_wide(), q8_vnni_available(), bf16_isa(64, 2));
    /* test_int4_kernel's shapes, every record kind, and ragged ones: odd widths, partial groups and chunks */
    const int groups[] = {32, 64, 128};
    const int rows_of[] = {1, 2, 5, 8};
    for (int g = 0; g < 3; g++)
        for (int r = 0; r < 4; r++) nibble_case(256, 96, groups[g], rows_of[r], CODE_INT4, SCALE_F16, r % 2);
    for (int code = 0; code < N_CODES; code++)
        for (int sk = 0; sk < N_SCALE_KINDS; sk++)
            for (int alone = 0; alone < 2; alone++) {
                nibble_case(200, 33, 8, 3, code, sk, alone);     /* groups of 8: a scale per lane */
                nibble_case(1000, 17, 40, 5, code, sk, alone);   /* groups across chunks, a partial last one */
                nibble_case(129, 7, 64, 2, code, sk, alone);     /* an odd width: a padding nibble */
                nibble_case(384, 9, 384, 1, code, sk, alone);    /* one group a row: broadcast */
                nibble_case(4352, 5, 128, 8, code, sk, alone);   /* several column blocks */
                nibble_case(96, 4, 6, 2, code, sk, alone);       /* group % 8 != 0: the plain C loops */
            }
    /* test_q8's SHAPES (out, in, group, rows), both weight kinds, every scale kind; the interleaved layout */
    const int shapes[][4] = {{64, 2048, 64, 1}, {130, 200, 32, 3}, {7, 96, 96, 8}, {33, 1000, 64, 5}, {5, 40, 64, 2}, {12, 256, 128, 19}};
    for (int s = 0; s < 6; s++)
        for (int kind = 0; kind < N_Q8_WEIGHTS; kind++)
            for (int sk = 0; sk < N_SCALE_KINDS; sk++) q8_case(shapes[s][1], shapes[s][0], shapes[s][2], shapes[s][3], kind, sk, 0);
    for (int kind = 0; kind < N_Q8_WEIGHTS; kind++)
        for (int rows = 1; rows <= 5; rows += 2) {
            q8_case(1024, 12, 64, rows, kind, SCALE_F16, 1);
            q8_case(1536, 8, 128, rows, kind, SCALE_BF16, 1);
            q8_case(512, 4, 512, rows, kind, SCALE_E8M0, 1);
        }
    /* bf16: widths a multiple of 32 (the SIMD loops) and not (plain C), one row, several, alone or not */
    const int bf16_shapes[][3] = {{64, 70, 1}, {96, 33, 3}, {256, 130, 8}, {4096, 9, 2}, {40, 7, 5}, {512, 65, 11}};
    for (int s = 0; s < 6; s++)
        for (int alone = 0; alone < 2; alone++) bf16_case(bf16_shapes[s][0], bf16_shapes[s][1], bf16_shapes[s][2], alone);
    const int ops[][2] = {{64, 32}, {200, 40}, {7, 7}, {4096, 128}, {1000, 64}};
    for (int s = 0; s < 5; s++) decode_ops_case(ops[s][0], ops[s][1]);
    const int index_shapes[][3] = {{64, 128, 300}, {8, 64, 40}, {13, 20, 7}, {16, 7, 600}};
    for (int s = 0; s < 4; s++) index_case(index_shapes[s][0], index_shapes[s][1], index_shapes[s][2], 3);
    const int tile_shapes[][3] = {{64, 128, 300}, {16, 32, 513}, {13, 20, 7}, {8, 7, 33}, {1, 1, 1}, {19, 33, 40}};
    for (int s = 0; s < 6; s++) tile_case(tile_shapes[s][0], tile_shapes[s][1], tile_shapes[s][2], 3);
    printf("%s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
