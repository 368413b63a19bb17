/* GB/s of the 4-bit kernel (engine/csrc/nibble.c) on one thread, one row of x, int4 codes with float16
 * scales, best of 5 passes: a benchmark, not a test.
 *
 *   gcc -O3 -Iengine/csrc -o /tmp/nibble_harness tools/nibble_harness.c engine/csrc/nibble.c -lm
 *   /tmp/nibble_harness MATRICES PASSES IN OUT SIMD [GROUP]
 *
 * MATRICES of OUT x IN codes, each read PASSES times per timing: 1 matrix of 2048 x 1024 stays in L2, 500
 * come from DRAM. SIMD: nibble_gemm's level (2 AVX-512, 1 AVX2, 0 scalar). GROUP: 64 unless given. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "nibble.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MATRICES PASSES IN OUT SIMD [GROUP]\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), passes = atoi(argv[2]), in = atoi(argv[3]), out = atoi(argv[4]), simd = atoi(argv[5]);
    int group = argc > 6 ? atoi(argv[6]) : 64;
    NibbleMatrix shape = {NULL, NULL, CODE_INT4, SCALE_F16, in, group};
    size_t row_bytes = nibble_row_bytes(&shape), codes = (size_t)out * row_bytes, groups = (size_t)out * nibble_groups(&shape);
    uint8_t *q = malloc(codes * n);
    uint16_t *scales = malloc(groups * sizeof *scales * n);
    float *x = malloc(sizeof *x * in), *xs = malloc(sizeof *xs * nibble_work_floats(&shape, 1)), *y = malloc(sizeof *y * out);
    for (size_t i = 0; i < codes * n; i++) q[i] = (uint8_t)rand();
    for (size_t i = 0; i < groups * n; i++) scales[i] = (uint16_t)(0x2c00 + rand() % 512); /* float16 ~0.06-0.12 */
    for (int i = 0; i < in; i++) x[i] = (float)(rand() % 200 - 100) * 0.01f;
    nibble_prepare(&shape, x, 1, xs);
    double best = 0;
    for (int t = 0; t < 5; t++) {
        double t0 = now();
        for (int p = 0; p < passes; p++)
            for (int e = 0; e < n; e++) {
                NibbleMatrix m = {q + e * codes, scales + e * groups, CODE_INT4, SCALE_F16, in, group};
                nibble_gemm(&m, xs, 1, 0, out, simd, 1, y);
            }
        double rate = (double)codes * n * passes / (now() - t0) / 1e9;
        best = rate > best ? rate : best;
    }
    printf("%.2f GB/s of codes (y[5] %f)\n", best, y[5 % out]);
    return 0;
}
