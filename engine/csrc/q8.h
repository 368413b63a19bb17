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
    int interleaved; /* 1: w holds codes and scales in the interleaved layout below (scales unused) */
} Q8Matrix;

/* The interleaved layout (int4 and int8 weights): output rows in blocks of 4 and each block's columns in
 * spans of Q8_SPAN; a span is its 8 chunks' codes, chunk by chunk and within a chunk row by row (chunk c8 of
 * row p at (4 c8 + p) step bytes; step 32 int4, 64 int8, the bytes a row-major chunk has), then the 4 rows'
 * scales of its Q8_SPAN / group groups (row p's first at p Q8_SPAN / group), of the matrix's scale kind. A
 * 4-row block is then one forward stream, which the hardware prefetchers follow; the row-major layout's
 * four rows 1 stride apart they do not (docs/kernels.md, "The interleaved layout"). Same products, same
 * order: the same bytes as the row-major matrix. Where q8_interleavable says so. */
#define Q8_SPAN 512
int q8_interleavable(int kind, int scale_kind, int in, int out, int group);
size_t q8_span_bytes(int kind, int scale_kind, int group);

/* x quantised: per row and chunk of 64 columns, 64 int8 (int4 weights: the even columns, then the odd
 * ones, which is how a chunk's 32 packed bytes unpack; int8 weights: in order), then 8 floats of block
 * scales as the kernel multiplies them, then 8 int32 of offset corrections (-8 sum xq of block 0 in lane 0, of
 * block 1 in lane 4; int8 weights' q8_gemm does not read them, q8_tiles_gemm does). */
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
/* Q8_ISA_AMX: q8_tiles_gemm's AMX path where the CPU has it; every other product takes Q8_ISA_VNNI's loops. */
enum { Q8_ISA_SCALAR = 0, Q8_ISA_AVX2 = 1, Q8_ISA_VNNI = 2, Q8_ISA_AMX = 3 };
/* OR'd into an isa: the product in q8_tiles.h's numbers (a prompt's rows), not q8_gemm's (every other row). */
#define Q8_TILES 8
int q8_vnni_available(void);

/* y[r * ldy + o - begin] = sum_k dequant(W)[o, k] * dequant(xq)[r, k] for output rows [begin, end),
 * with the best instruction set up to `isa` (bf16 weights: bf16.c's path up to the same level, AVX-512
 * for Q8_ISA_VNNI). Each row of x is computed the same way whatever the other rows are
 * (batch-invariant). */
void q8_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy);

#endif
