/* Group-quantised 4-bit matrices times a few float32 rows, and their dequantiser (nibble.c); the
 * Python module, the thread split and the bf16 kernels are in kernels.c. */
#ifndef COLIBRI_NIBBLE_H
#define COLIBRI_NIBBLE_H

#include <stddef.h>
#include <stdint.h>

#define MAX_ROWS 8

/* What a nibble means (engine/kernels/quant.py code_values) and how a group's scale is stored (scale_values). */
enum { CODE_INT4 = 0, CODE_FP4 = 1, N_CODES };
enum { SCALE_F16 = 0, SCALE_BF16 = 1, SCALE_E8M0 = 2, N_SCALE_KINDS };

/* A weight [out, in]: q uint8 [out, ceil(in / 2)] (column 2j in the low nibble of byte j, an odd row's
 * last high nibble is padding); scales [out, ceil(in / group)], the last group of a row maybe partial. */
typedef struct {
    const uint8_t *q;
    const void *scales;
    int code, scale_kind;
    int in, group; /* group even, so no byte holds two groups */
} NibbleMatrix;

/* 1 when the kernels take a matrix of this shape and kind (in >= 1, an even group >= 2, known code and
 * scale kinds; its addresses are not looked at). */
static inline int nibble_matrix_valid(const NibbleMatrix *m) {
    return m->in >= 1 && m->group >= 2 && m->group % 2 == 0 && m->code >= 0 && m->code < N_CODES && m->scale_kind >= 0 &&
           m->scale_kind < N_SCALE_KINDS;
}

static inline size_t nibble_row_bytes(const NibbleMatrix *m) { return ((size_t)m->in + 1) / 2; }
static inline int nibble_groups(const NibbleMatrix *m) { return (int)(((size_t)m->in + m->group - 1) / m->group); }

/* x is laid out per chunk of 64 packed bytes (128 columns), in the order the kernel unpacks them. */
#define CHUNK_BYTES 64
#define CHUNK_COLS 128
static inline size_t nibble_chunks(const NibbleMatrix *m) { return (nibble_row_bytes(m) + CHUNK_BYTES - 1) / CHUNK_BYTES; }

/* Floats of workspace nibble_prepare needs for `rows` rows. */
size_t nibble_work_floats(const NibbleMatrix *m, int rows);

/* x float32 [rows, in] -> xs [rows, chunks * 64]: each chunk's columns in the kernel's unpacking order
 * (nibble.c x_slot), zero past `in` (so padding and tail nibbles contribute nothing). */
void nibble_prepare(const NibbleMatrix *m, const float *x, int rows, float *xs);

/* y [rows, end - begin] = x @ dequant(m)[begin:end]^T from nibble_prepare's xs; simd caps the loops:
 * 0 scalar, 1 AVX2, 2 the AVX-512 loops where the CPU has them (the same bits as 1,
 * faster). alone 1: batch-invariant, each row's result bit-identical to a one-row call's (rows of
 * independent requests decoded together); 0: the fastest order for several rows of one prompt. */
void nibble_gemm(const NibbleMatrix *m, const float *xs, int rows, int begin, int end, int simd, int alone, float *y);

/* w float32 [out, in] = value(nibble) * scale, the same float operations as engine/kernels/quant.py's torch
 * reference (bit-identical). */
void nibble_dequant(const NibbleMatrix *m, int out, float *w);

/* Scale i of a scales array of kind scale_kind (SCALE_*), as float32. */
float nibble_scale(int scale_kind, const void *scales, size_t i);

/* The highest loops any kernel may take (2 AVX-512 / NEON dot-product, 1 AVX2 / plain NEON):
 * COLIBRI_STREAM_ISA ("avx2" or "neon": 1; unset, "best" or "dotprod": no cap), read once. It measures a
 * host without AVX-512 (or without dot-product) on one with it; engine/kernels/isa.py refuses other values
 * before the extension loads. */
int isa_cap(void);

/* 0 where COLIBRI_STREAM_ISA is "avx512" (or "avx2"): a prompt's tile products keep off the AMX unit, so an AMX
 * host measures one without it. */
int isa_amx_allowed(void);

/* aarch64: bit 0 the CPU has dot-product (SDOT/UDOT), bit 1 int8 matrix multiply (SMMLA; detected, named by
 * doctor, not used: docs/kernels.md "ARM (NEON)"); 0 elsewhere. Not capped. */
int arm_features(void);

/* Whether the CPU has the AVX2 path (AVX2, FMA, F16C), or is an aarch64 one (NEON), and the cap allows it. */
int nibble_simd_available(void);

/* 1 when the CPU also has AVX-512 (F, VL and BW; x86) or dot-product (aarch64) and the cap allows it: the
 * 16-lane loops (x86), the SDOT loops (q8.c, aarch64). */
int nibble_simd_wide(void);

#endif
