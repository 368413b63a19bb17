/*
 * The q8 kernel (engine/csrc/q8.c) on cold int4 matrices, row-major vs the interleaved layout (q8.h), under
 * three ways of sharing the work between threads: each thread its own matrices; one matrix at a time split
 * in 64-row blocks taken by turns (the engine's split), threads joined after each matrix; one matrix at a
 * time in contiguous halves. Prints GB/s of codes and scales (medians and bests of the sweeps) and checks
 * that both layouts give the same bytes. docs/kernels.md, "The interleaved layout".
 *
 *   gcc -O3 -Iengine/csrc -o /tmp/q8_layout tools/q8_layout_harness.c engine/csrc/q8.c engine/csrc/q8_tiles.c engine/csrc/nibble.c \
 *       engine/csrc/bf16.c -lpthread -lm && /tmp/q8_layout [threads=2] [sweeps=7]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nibble.h"
#include "q8.h"

#define OUT 1024
#define IN 2048
#define GROUP 64
#define MATRICES 360 /* ~400 MB: far past the caches */
#define SPLIT_ROWS 64

enum { OWN, BY_TURNS, HALVES, N_SHARES };
static const char *SHARES[N_SHARES] = {"own matrices", "64-row blocks by turns", "contiguous halves"};

static uint8_t *codes, *interleaved;
static uint16_t *scales;
static float *ys;
static Q8Rows x;
static size_t codes_bytes = (size_t)OUT * IN / 2, scale_count = (size_t)OUT * (IN / GROUP), packed_bytes;
static int threads;
static volatile int arrived;

static void interleave(const uint8_t *q, const uint16_t *s, uint8_t *out) {
    size_t span = q8_span_bytes(Q8_WEIGHTS_INT4, SCALE_F16, GROUP);
    int spans = IN / Q8_SPAN, per = Q8_SPAN / GROUP, chunks = Q8_SPAN / Q8_CHUNK;
    for (int o = 0; o < OUT; o += 4)
        for (int sp = 0; sp < spans; sp++) {
            uint8_t *dst = out + ((size_t)(o / 4) * spans + sp) * span;
            for (int c8 = 0; c8 < chunks; c8++)
                for (int p = 0; p < 4; p++)
                    memcpy(dst + (4 * c8 + p) * 32, q + (size_t)(o + p) * (IN / 2) + (size_t)(sp * chunks + c8) * 32, 32);
            uint16_t *sd = (uint16_t *)(dst + chunks * 4 * 32);
            for (int p = 0; p < 4; p++)
                for (int g = 0; g < per; g++) sd[p * per + g] = s[(size_t)(o + p) * (IN / GROUP) + sp * per + g];
        }
}

static Q8Matrix matrix(int layout, int m) {
    Q8Matrix made = {codes + m * codes_bytes, scales + m * scale_count, Q8_WEIGHTS_INT4, SCALE_F16, IN, GROUP, 0};
    if (layout) made.w = interleaved + m * packed_bytes, made.scales = NULL, made.interleaved = 1;
    return made;
}

static void rows(int layout, int m, int begin, int end) {
    Q8Matrix mat = matrix(layout, m);
    for (int b = begin; b < end; b += SPLIT_ROWS) q8_gemm(&mat, &x, b, b + SPLIT_ROWS, Q8_ISA_VNNI, ys + (size_t)m * OUT + b, OUT);
}

static void join(int m) { /* spinning, as the engine's helper does between calls */
    __atomic_add_fetch(&arrived, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&arrived, __ATOMIC_SEQ_CST) < (m + 1) * threads) {
    }
}

typedef struct { int layout, share, t; } Job;

static void *work(void *arg) {
    const Job *j = arg;
    for (int m = 0; m < MATRICES; m++) {
        if (j->share == OWN) {
            if (m % threads == j->t) rows(j->layout, m, 0, OUT);
            continue;
        }
        if (j->share == HALVES) rows(j->layout, m, j->t * OUT / threads, (j->t + 1) * OUT / threads);
        else
            for (int b = j->t * SPLIT_ROWS; b < OUT; b += threads * SPLIT_ROWS) rows(j->layout, m, b, b + SPLIT_ROWS);
        join(m);
    }
    return NULL;
}

static double sweep(int layout, int share) {
    pthread_t ids[16];
    Job jobs[16];
    struct timespec a, b;
    arrived = 0;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){layout, share, t};
        pthread_create(&ids[t], NULL, work, &jobs[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double bytes = (double)MATRICES * (layout ? packed_bytes : codes_bytes + 2 * scale_count);
    return bytes / ((double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec)) / 1e9;
}

static int by_value(const void *a, const void *b) { return *(const double *)a < *(const double *)b ? -1 : 1; }

int main(int argc, char **argv) {
    threads = argc > 1 ? atoi(argv[1]) : 2;
    int sweeps = argc > 2 ? atoi(argv[2]) : 7;
    if (threads < 1 || threads > 16 || sweeps < 1 || sweeps > 64) return 2;
    packed_bytes = (size_t)(OUT / 4) * (IN / Q8_SPAN) * q8_span_bytes(Q8_WEIGHTS_INT4, SCALE_F16, GROUP);
    codes = malloc(MATRICES * codes_bytes), scales = malloc(MATRICES * scale_count * 2);
    interleaved = malloc(MATRICES * packed_bytes), ys = malloc(sizeof(float) * OUT * MATRICES);
    float *first = malloc(sizeof(float) * OUT * MATRICES), xf[IN];
    x.work = malloc(q8_work_bytes(1, IN));
    if (!codes || !scales || !interleaved || !ys || !first || !x.work) return 1;
    srand(1);
    for (size_t i = 0; i < MATRICES * codes_bytes; i++) codes[i] = (uint8_t)rand();
    for (size_t i = 0; i < MATRICES * scale_count; i++) scales[i] = (uint16_t)(0x1800 + rand() % 0x400); /* f16 ~1e-3 */
    for (int m = 0; m < MATRICES; m++) interleave(codes + m * codes_bytes, scales + m * scale_count, interleaved + m * packed_bytes);
    for (int k = 0; k < IN; k++) xf[k] = (float)(rand() % 2001 - 1000) * 1e-3f;
    q8_prepare(Q8_WEIGHTS_INT4, xf, 1, IN, 1, &x);
    sweep(0, OWN);
    memcpy(first, ys, sizeof(float) * OUT * MATRICES);
    sweep(1, OWN);
    printf("same bytes: %s\n", memcmp(first, ys, sizeof(float) * OUT * MATRICES) ? "NO" : "yes");
    double rates[2][N_SHARES][64];
    for (int s = 0; s < sweeps; s++) /* alternating, so the host's moods hit every variant alike */
        for (int share = 0; share < N_SHARES; share++)
            for (int layout = 0; layout < 2; layout++) rates[layout][share][s] = sweep(layout, share);
    printf("| %d threads | row-major GB/s (median, best) | interleaved |\n|---|---:|---:|\n", threads);
    for (int share = 0; share < N_SHARES; share++) {
        double *r = rates[0][share], *i = rates[1][share];
        qsort(r, (size_t)sweeps, sizeof(double), by_value), qsort(i, (size_t)sweeps, sizeof(double), by_value);
        printf("| %s | %.1f, %.1f | %.1f, %.1f |\n", SHARES[share], r[sweeps / 2], r[sweeps - 1], i[sweeps / 2], i[sweeps - 1]);
    }
    return 0;
}
