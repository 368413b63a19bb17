/* Weights times rows of x quantised to int8 (q8.c): integer dot products, as llama.cpp's Q8 activations.
 * The weights are the container's own records: int4 nibbles (value n - 8) or int8, one float16 /
 * bfloat16 / e8m0 scale per group of columns (a multiple of Q8_BLOCK). */
#ifndef COLIBRI_Q8_H
#define COLIBRI_Q8_H

#include <stddef.h>
#include <stdint.h>

#define Q8_BLOCK 32 /* columns of x per int8 scale */
#define Q8_CHUNK 64 /* columns per step of the kernels: two blocks */

enum { Q8_WEIGHTS_INT4 = 0, Q8_WEIGHTS_INT8 = 1, N_Q8_WEIGHTS };

/* A dense matrix of the float32 path in the fused decode steps: bf16 weights [out, in], no scales; x is
 * not quantised (q8_prepare only points at it) and the product is bf16.c's, the bits the module path's
 * Bf16Linear gets. Not a routed expert's kind (q8_layout_valid). */
#define Q8_WEIGHTS_BF16 N_Q8_WEIGHTS

/* A weight [out, in]: int4: uint8 [out, ceil(in / 2)] (column 2j in the low nibble of byte j); int8:
 * int8 [out, in]. scales [out, ceil(in / group)] of kind scale_kind (nibble.h's SCALE_*). bf16: uint16
 * [out, in], scales and group unused. */
typedef struct {
    const void *w;
    const void *scales;
    int kind, scale_kind;
    int in, group; /* group % Q8_BLOCK == 0 */
} Q8Matrix;

/* x quantised: per row and chunk of 64 columns, 64 int8 (int4 weights: the even columns, then the odd
 * ones, which is how a chunk's 32 packed bytes unpack; int8 weights: in order), then 8 floats of block
 * scales as the kernel multiplies them, then (int4) 8 int32 of offset corrections (-8 sum xq of block 0 in lane 0, of block 1 in lane 4). */
typedef struct {
    uint8_t *work;
    int rows, chunks, kind;
    const float *floats; /* Q8_WEIGHTS_BF16: x itself [rows, in], which must outlive the products */
} Q8Rows;

size_t q8_work_bytes(int rows, int in);

/* Quantise x float32 [rows, in] per block of 32 columns: scale absmax / 127, value round(x / scale)
 * (nearest, ties to even), zero past in; simd 0 forces the scalar path (the same bytes). For bf16
 * weights x is only pointed at (nothing is written to work). */
void q8_prepare(int kind, const float *x, int rows, int in, int simd, Q8Rows *out);

/* The instruction sets q8_gemm may use, at most: each level gives the same bytes as the one below. */
enum { Q8_ISA_SCALAR = 0, Q8_ISA_AVX2 = 1, Q8_ISA_VNNI = 2 };
int q8_vnni_available(void);

/* y[r * ldy + o - begin] = sum_k dequant(W)[o, k] * dequant(xq)[r, k] for output rows [begin, end),
 * with the best instruction set up to `isa` (bf16 weights: bf16.c's path up to the same level, AVX-512
 * for Q8_ISA_VNNI). Each row of x is computed the same way whatever the other rows are
 * (batch-invariant). */
void q8_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy);

#endif
