/* bf16 weights times float32 rows (bf16.c): the dense part of a bf16 checkpoint on the exact path.
 * bf16 -> float32 is exact (the 16 bits become the high half), so this equals a float32 matmul of the
 * upcast weights to float rounding while reading half the bytes. */
#ifndef COLIBRI_BF16_H
#define COLIBRI_BF16_H

#include <stddef.h>
#include <stdint.h>

/* The path the kernel takes for rows `in` wide: 2 AVX-512 (in % 64 == 0), 1 AVX2+FMA or NEON (in % 32 == 0;
 * the same bits), 0 scalar; capped by `limit` (tests reach every path on any CPU). */
int bf16_isa(int in, int limit);

/* y[r * ldy + o - begin] = sum_k w[o, k] x[r, k] for output rows [begin, end) of w bf16 [out, in] and
 * x float32 [rows, in] (MAX_ROWS at a time). alone: each row computed exactly as a one-row call
 * computes it (batch-invariant; one row is always so). */
void bf16_gemm_rows(const uint16_t *w, const float *x, int rows, int in, int begin, int end, int isa_limit, int alone,
                    float *y, size_t ldy);

#endif
