/* How q8.c's kernels and q8_tiles.c's find things: the prepared x's slots (q8.h Q8Rows) and a weight's codes and
 * scales in either layout (q8.h: row-major, interleaved). Included by those two files only. */
#ifndef COLIBRI_Q8_LAYOUT_H
#define COLIBRI_Q8_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "nibble.h"
#include "q8.h"

/* Per row and chunk in the work area: 64 int8 of x, 8 float block scales, 8 int32 offset corrections. */
#define SLOT_BYTES 128
#define SLOT_SCALES 64
#define SLOT_OFFSETS 96

static inline int chunks_of(int in) { return (in + Q8_CHUNK - 1) / Q8_CHUNK; }

/* Slots a row of x takes in the work area: its chunks, an odd number (one zeroed slot more where the chunks are
 * even). Rows a power of two of bytes apart all fall in one L1 set, and the tile kernels read one chunk of every row
 * (q8_tiles.c: 64 rows of 2048 columns, 4 KB apart, read at 0.85x). */
static inline int slots_per_row(int chunks) { return chunks | 1; }

static inline uint8_t *slot(const Q8Rows *x, int r, int c) {
    return x->work + ((size_t)r * (size_t)slots_per_row(x->chunks) + (size_t)c) * SLOT_BYTES;
}

/* Where column j (0..63) of a chunk goes in the prepared 64 bytes. */
static inline int x_position(int kind, int j) {
    if (kind == Q8_WEIGHTS_INT4) return j % 2 ? 32 + j / 2 : j / 2;
    int piece = j / 16; /* pieces 0 1 2 3 -> positions 0 2 1 3 */
    return 16 * (piece == 1 ? 2 : piece == 2 ? 1 : piece) + j % 16;
}

static inline size_t chunk_step_bytes(int kind) { return kind == Q8_WEIGHTS_INT4 ? 32 : 64; }

/* Bytes of one row's codes in the row-major layout: int4 ceil(in / 2), int8 in. */
static inline size_t row_code_bytes(int kind, int in) {
    return kind == Q8_WEIGHTS_INT4 ? (size_t)(in + 1) / 2 : (size_t)in;
}

/* Bytes of a span's codes (interleaved layout, q8.h): its scales follow them. */
static inline size_t span_code_bytes(int kind) { return Q8_SPAN / Q8_CHUNK * 4 * chunk_step_bytes(kind); }

/* Span s (columns s Q8_SPAN ..) of row o's 4-row block in an interleaved matrix. */
static inline const uint8_t *span_at(const Q8Matrix *m, int o, int s) {
    size_t spans = (size_t)(m->in / Q8_SPAN);
    return (const uint8_t *)m->w + ((size_t)(o / 4) * spans + (size_t)s) * q8_span_bytes(m->kind, m->scale_kind, m->group);
}

/* Weight row o's value at column k (before its group's scale). */
static inline int weight_at(const Q8Matrix *m, int o, int k) {
    if (m->interleaved) {
        int j = k % Q8_CHUNK, c8 = k % Q8_SPAN / Q8_CHUNK;
        const uint8_t *chunk = span_at(m, o, k / Q8_SPAN) + (size_t)(4 * c8 + o % 4) * chunk_step_bytes(m->kind);
        if (m->kind == Q8_WEIGHTS_INT8) return ((const int8_t *)chunk)[j];
        return ((chunk[j / 2] >> (4 * (j % 2))) & 0x0F) - 8;
    }
    const uint8_t *row = (const uint8_t *)m->w + (size_t)o * row_code_bytes(m->kind, m->in);
    if (m->kind == Q8_WEIGHTS_INT8) return ((const int8_t *)row)[k];
    return ((row[k / 2] >> (4 * (k % 2))) & 0x0F) - 8;
}

/* Weight row o's scale of group g. */
static inline float scale_of(const Q8Matrix *m, int o, int g) {
    if (m->interleaved) {
        int per = Q8_SPAN / m->group;
        const uint8_t *scales = span_at(m, o, g / per) + span_code_bytes(m->kind);
        return nibble_scale(m->scale_kind, scales, (size_t)(o % 4) * per + g % per);
    }
    int groups = (m->in + m->group - 1) / m->group;
    return nibble_scale(m->scale_kind, m->scales, (size_t)o * groups + g);
}

#if defined(__x86_64__)
/* Row o's group scales of a row-major matrix as float32, and a 0 after them (q8.c's, for q8_tiles.c). */
void q8_row_scales(const Q8Matrix *m, int o, int groups, float *out);
#endif

#endif
