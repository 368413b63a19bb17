/* A prompt's rows as tile GEMMs (q8_tiles.c, issue #71): q8_gemm's int8 rows and weights, 16 output rows per
 * AVX-512 vector and each chunk's weights gathered once for every row of the call, so a block's 32 products
 * are one integer sum (dpbusd) and a block costs one conversion and one multiply-add per output row, not
 * q8_gemm's one per 8 columns.
 *
 * The numbers, per row r of x and output row o:
 *
 *     acc = 0
 *     for each block b of 32 columns, in order:  acc = fma((float)dot_b, d[r, b] * s[o, g(b)], acc)
 *
 * dot_b the block's exact integer dot product of the weights (int4: n - 8) and xq, d and s x's and the
 * weights' scales. The same xq, d, weights and scales as q8_gemm; only the order of the float sum differs (q8_gemm
 * sums 8-column pieces per lane, then the lanes), so a row's result can differ from q8_gemm's in its last bits.
 * Every instruction set gives the same bytes, and a row's result does not depend on the other rows. */
#ifndef COLIBRI_Q8_TILES_H
#define COLIBRI_Q8_TILES_H

#include <stddef.h>

#include "q8.h"

#define Q8_TILE_OUTS 16 /* output rows per tile: one AVX-512 vector of int32 / float lanes */

/* 1 where q8_tiles_gemm has its vector path (AVX-512 VNNI); elsewhere the plain C loop gives its bytes. */
int q8_tiles_fast(void);

/* 1 where q8_tiles_gemm can run on the AMX unit (AMX-INT8, and Linux grants the tile state): the same bytes, for
 * calls of 64 rows of x or more (q8_tiles.c AMX_MIN_ROWS). */
int q8_amx_available(void);

/* q8_gemm's product (output rows [begin, end) of m, int4 or int8 weights in either layout, times every row
 * of x) in the numbers above. isa: q8.h Q8_ISA_*, the best to use (Q8_ISA_AMX: AMX tiles where the CPU has them;
 * below Q8_ISA_VNNI: the plain C loop). */
void q8_tiles_gemm(const Q8Matrix *m, const Q8Rows *x, int begin, int end, int isa, float *y, size_t ldy);

#endif
