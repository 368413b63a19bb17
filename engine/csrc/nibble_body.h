/* The 4-bit kernel's SIMD loops (nibble.c), included once per instruction set with NB_TARGET / NB_INLINE
 * (function attributes) and NB_NAME (the set's suffix) defined. The code is the same 256-bit AVX2 code
 * each time: compiled with AVX-512VL as well the compiler has 32 vector registers for the accumulators
 * and the weight vectors (no spills), measured ~16% faster on Zen 4, and the same operations in the same
 * order, so the same bits. */

NB_TARGET static inline float NB_NAME(hsum8)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

NB_INLINE __m256 NB_NAME(halves)(const float *first, const float *second) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(first)), _mm_broadcast_ss(second), 1);
}

/* Row o's scales of groups first.. as float32 (0 past the row's last group: a tail chunk's padding
 * columns, where x is 0; no scale past the row is read). */
NB_TARGET static void NB_NAME(row_scales)(const NibbleMatrix *m, int o, size_t first, size_t count, float *out) {
    size_t groups = (size_t)nibble_groups(m), s0 = (size_t)o * groups, have = first + count < groups ? count : groups - first;
    switch (m->scale_kind) {
    case SCALE_F16:
        for (size_t i = 0; i < have; i++) out[i] = _cvtsh_ss(((const uint16_t *)m->scales)[s0 + first + i]);
        break;
    case SCALE_BF16:
        for (size_t i = 0; i < have; i++) out[i] = from_bits((uint32_t)((const uint16_t *)m->scales)[s0 + first + i] << 16);
        break;
    default:
        for (size_t i = 0; i < have; i++) out[i] = e8m0_to_float(((const uint8_t *)m->scales)[s0 + first + i]);
    }
    for (size_t i = have; i < count; i++) out[i] = 0.f;
}

/* sv[q]: the scales of weight vectors q and 4 + q (chunk_weights), from the row's block scales. */
NB_INLINE void NB_NAME(chunk_scales)(int layout, const float *scales, const uint16_t slot[8], __m256 sv[4]) {
    switch (layout) {
    case ONE_GROUP: sv[0] = _mm256_broadcast_ss(scales + slot[0]); break;
    case TWO_GROUPS: sv[0] = NB_NAME(halves)(scales + slot[0], scales + slot[4]); break;
    case FOUR_GROUPS:
        sv[0] = NB_NAME(halves)(scales + slot[0], scales + slot[4]);
        sv[1] = NB_NAME(halves)(scales + slot[2], scales + slot[6]);
        break;
    default:
        for (int q = 0; q < 4; q++) sv[q] = NB_NAME(halves)(scales + slot[q], scales + slot[4 + q]);
    }
}

/* Which sv scales weight vector v. */
NB_INLINE int NB_NAME(scale_index)(int layout, int v) {
    return layout == FOUR_GROUPS ? (v % 4) / 2 : layout == EIGHTS ? v % 4 : 0;
}

/* The code's 16 values as bf16 bytes: tables[0] the low byte, tables[1] the high one (both lanes). */
NB_INLINE void NB_NAME(value_tables)(int code, __m256i tables[2]) {
    uint8_t low[16], high[16];
    for (int n = 0; n < 16; n++) {
        uint32_t bits;
        memcpy(&bits, &VALUES[code][n], sizeof bits); /* the low 16 bits are 0: bf16-exact */
        low[n] = (uint8_t)(bits >> 16);
        high[n] = (uint8_t)(bits >> 24);
    }
    tables[0] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)low));
    tables[1] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)high));
}

/* One chunk of P (1, 2) output rows times RS rows of x (xc: the chunk's x of the first, rows 64 floats
 * apart) into acc[p][r][.]. 32 packed bytes -> 64 weights as 8 float vectors w[4h + q], h the nibble
 * (0 low = even column): lanes 0-3 from bytes 4q..4q+3, lanes 4-7 from bytes 16+4q.. (x_slot's order).
 * Each vector is scaled (or the chunk's sums are, SCALE_AFTER), then meets every row before the next
 * is made (few live registers); each x load serves both output rows. */
NB_INLINE void NB_NAME(chunk_fma)(int P, int RS, int AR, int layout, const __m256i packed[2], const __m256i tables[2],
                           __m256 sv[2][4], const float *xc, __m256 acc[2][4][4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const int after = SCALE_AFTER(layout, P, AR), accs = ACCS(P, AR);
    __m256 sums[2][4][4]; /* SCALE_AFTER: the chunk's unscaled sums */
    __m256 (*into)[4][4] = after ? sums : acc;
    if (after)
        for (int p = 0; p < P; p++)
            for (int r = 0; r < RS; r++)
                for (int a = 0; a < accs; a++) sums[p][r][a] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i bf16[2][2]; /* [p]: bytes 0-7, 8-15 of each lane */
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(packed[p], 4) : packed[p], low4);
            __m256i lo = _mm256_shuffle_epi8(tables[0], nib), hi = _mm256_shuffle_epi8(tables[1], nib);
            bf16[p][0] = _mm256_unpacklo_epi8(lo, hi), bf16[p][1] = _mm256_unpackhi_epi8(lo, hi);
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            int v = 4 * h + q;
            __m256 w[2];
#pragma GCC unroll 2
            for (int p = 0; p < P; p++) {
                __m256i bits = q % 2 ? _mm256_unpackhi_epi16(zero, bf16[p][q / 2]) : _mm256_unpacklo_epi16(zero, bf16[p][q / 2]);
                w[p] = after ? _mm256_castsi256_ps(bits) : _mm256_mul_ps(_mm256_castsi256_ps(bits), sv[p][NB_NAME(scale_index)(layout, v)]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < RS; r++) {
                __m256 x = _mm256_loadu_ps(xc + CHUNK_COLS * r + 8 * v);
                if (P > 1) __asm__("" : "+x"(x)); /* one load for both outputs: keep gcc from folding it twice */
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) into[p][r][v % accs] = _mm256_fmadd_ps(w[p], x, into[p][r][v % accs]);
            }
        }
    }
    if (after)
        for (int p = 0; p < P; p++)
            for (int r = 0; r < RS; r++)
                for (int a = 0; a < accs; a++) acc[p][r][a] = _mm256_fmadd_ps(sums[p][r][a], sv[p][0], acc[p][r][a]);
}

/* y[r][o] += the column block [c0, c1) of P output rows times RS rows of x (xs: the first one's;
 * XR rows per chunk in xs). ahead (or NULL): the next two rows' codes for their block, asked for one
 * line per chunk: a column block reads a row in pieces, which the hardware prefetchers follow less
 * well than one stream, and spreading the requests keeps them from stalling the loop. */
NB_INLINE void NB_NAME(block_dot)(int P, int RS, int AR, int XR, int layout, const NibbleMatrix *m, const __m256i tables[2],
                           const OutRow out[2], const uint8_t *const *ahead, const uint16_t slots[][8], size_t c0,
                           size_t c1, const float *xs, size_t n) {
    size_t row_bytes = nibble_row_bytes(m), full = row_bytes / CHUNK_BYTES, c1_full = c1 < full ? c1 : full;
    __m256 acc[2][4][4], sv[2][4];
    __m256i packed[2];
#pragma GCC unroll 2
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RS; r++)
            for (int a = 0; a < ACCS(P, AR); a++) acc[p][r][a] = _mm256_setzero_ps();
    for (size_t c = c0; c < c1_full; c++) {
        if (ahead) _mm_prefetch((const char *)ahead[(c - c0) % 2] + (c - c0) / 2 * 64, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            packed[p] = _mm256_loadu_si256((const __m256i *)(out[p].q + c * CHUNK_BYTES));
            NB_NAME(chunk_scales)(layout, out[p].scales, slots[c - c0], sv[p]);
        }
        NB_NAME(chunk_fma)(P, RS, AR, layout, packed, tables, sv, xs + c * XR * CHUNK_COLS, acc);
    }
    if (c1 > c1_full) { /* the rows' last bytes, zero-padded to a chunk */
        uint8_t tail[2][CHUNK_BYTES] = {{0}};
        for (int p = 0; p < P; p++) {
            memcpy(tail[p], out[p].q + full * CHUNK_BYTES, row_bytes - full * CHUNK_BYTES);
            packed[p] = _mm256_loadu_si256((const __m256i *)tail[p]);
            NB_NAME(chunk_scales)(layout, out[p].scales, slots[full - c0], sv[p]);
        }
        NB_NAME(chunk_fma)(P, RS, AR, layout, packed, tables, sv, xs + full * XR * CHUNK_COLS, acc);
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RS; r++) {
            __m256 sum = acc[p][r][0];
            for (int a = 1; a < ACCS(P, AR); a++) sum = _mm256_add_ps(sum, acc[p][r][a]);
            out[p].y[r * n] += NB_NAME(hsum8)(sum);
        }
}

/* P output rows: rows of x 4 at a time (the accumulators' register budget); the second pass reads
 * the block's codes again from L1. */
NB_INLINE void NB_NAME(block_rows)(int P, int R, int layout, const NibbleMatrix *m, const __m256i tables[2],
                            const OutRow out[2], const uint8_t *ahead[2], const uint16_t slots[][8], size_t c0,
                            size_t c1, const float *xs, size_t n) {
    if (R <= 4) {
        NB_NAME(block_dot)(P, R, R, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
        return;
    }
    OutRow rest[2] = {{out[0].q, out[0].scales, out[0].y + 4 * n}, {out[1].q, out[1].scales, out[1].y + 4 * n}};
    NB_NAME(block_dot)(P, 4, 4, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
    NB_NAME(block_dot)(P, R - 4, R - 4, R, layout, m, tables, rest, NULL, slots, c0, c1, xs + 4 * CHUNK_COLS, n);
}

/* Batch-invariant: each of the R rows of x accumulates exactly as a one-row call does (AR = 1: its
 * accumulators, scaling and the one-row column blocks), so a row's result does not depend on which other
 * rows share the call. Rows go ALONE_ROWS at a time through one unpacking of the block's weights (more
 * rows per unpacking spill the accumulators: measured slower at 4 rows). */
#define ALONE_DOT(P, RS) NB_NAME(block_dot)(P, RS, 1, R, layout, m, tables, row, next, slots, c0, c1, xr, n)
NB_INLINE void NB_NAME(rows_alone)(int P, int R, int layout, const NibbleMatrix *m, const __m256i tables[2],
                            const OutRow out[2], const uint8_t *ahead[2], const uint16_t slots[][8], size_t c0,
                            size_t c1, const float *xs, size_t n) {
    for (int r = 0; r < R; r += ALONE_ROWS) {
        OutRow row[2] = {{out[0].q, out[0].scales, out[0].y + r * n}, {out[1].q, out[1].scales, out[1].y + r * n}};
        const float *xr = xs + r * CHUNK_COLS;
        const uint8_t *const *next = r ? NULL : ahead;
        switch ((R - r < ALONE_ROWS ? R - r : ALONE_ROWS) + 2 * (P - 1)) {
        case 1: ALONE_DOT(1, 1); break;
        case 2: ALONE_DOT(1, 2); break;
        case 3: ALONE_DOT(2, 1); break;
        default: ALONE_DOT(2, 2); break;
        }
    }
}
#undef ALONE_DOT

/* R rows (a constant after inlining) times output rows [begin, end): column block by column block,
 * two output rows at a time; ``alone``: batch-invariant (rows_alone). */
NB_INLINE void NB_NAME(rows_simd)(int R, int alone, int layout, const NibbleMatrix *m, const float *xs, int begin, int end,
                           float *y) {
    size_t row_bytes = nibble_row_bytes(m), chunks = nibble_chunks(m), n = (size_t)(end - begin);
    size_t block = alone ? block_chunks(1) : block_chunks(R);
    __m256i tables[2];
    uint16_t slots[MAX_BLOCK_CHUNKS][8];
    float scales[2][MAX_BLOCK_GROUPS];
    NB_NAME(value_tables)(m->code, tables);
    for (int r = 0; r < R; r++) memset(y + (size_t)r * n, 0, n * sizeof *y);
    for (size_t c0 = 0; c0 < chunks; c0 += block) {
        size_t c1 = c0 + block < chunks ? c0 + block : chunks;
        size_t first_group = c0 * CHUNK_COLS / m->group, n_groups = ((c1 * CHUNK_COLS - 1) / m->group) - first_group + 1;
        block_groups(m, c0, c1, slots);
        for (int o = begin; o < end; o += 2) {
            int pair = o + 1 < end;
            OutRow out[2];
            /* the next pair's codes for this block, or the first pair's for the next block */
            int next = o + 2 < end ? o + 2 : begin;
            size_t from = (o + 2 < end ? c0 : c1) * CHUNK_BYTES;
            const uint8_t *ahead[2] = {m->q + (size_t)next * row_bytes + from,
                                       m->q + (size_t)(next + 1 < end ? next + 1 : next) * row_bytes + from};
            for (int p = 0; p <= pair; p++) {
                NB_NAME(row_scales)(m, o + p, first_group, n_groups, scales[p]);
                out[p] = (OutRow){m->q + (size_t)(o + p) * row_bytes, scales[p], y + (o + p - begin)};
            }
            if (o + 2 >= end && c1 >= chunks) ahead[0] = ahead[1] = NULL; /* the slice's last pass */
            if (alone) NB_NAME(rows_alone)(pair + 1, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
            else if (pair) NB_NAME(block_rows)(2, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
            else NB_NAME(block_rows)(1, R, layout, m, tables, out, ahead, slots, c0, c1, xs, n);
        }
    }
}

/* One instantiation per layout and row count (1..MAX_ROWS). */
NB_INLINE void NB_NAME(layout_rows)(int layout, int alone, const NibbleMatrix *m, const float *xs, int rows, int begin,
                             int end, float *y) {
    if (alone && rows > 1) {
        switch (rows) {
        case 2: NB_NAME(rows_simd)(2, 1, layout, m, xs, begin, end, y); break;
        case 3: NB_NAME(rows_simd)(3, 1, layout, m, xs, begin, end, y); break;
        case 4: NB_NAME(rows_simd)(4, 1, layout, m, xs, begin, end, y); break;
        case 5: NB_NAME(rows_simd)(5, 1, layout, m, xs, begin, end, y); break;
        case 6: NB_NAME(rows_simd)(6, 1, layout, m, xs, begin, end, y); break;
        case 7: NB_NAME(rows_simd)(7, 1, layout, m, xs, begin, end, y); break;
        default: NB_NAME(rows_simd)(8, 1, layout, m, xs, begin, end, y); break;
        }
        return;
    }
    switch (rows) {
    case 1: NB_NAME(rows_simd)(1, 0, layout, m, xs, begin, end, y); break;
    case 2: NB_NAME(rows_simd)(2, 0, layout, m, xs, begin, end, y); break;
    case 3: NB_NAME(rows_simd)(3, 0, layout, m, xs, begin, end, y); break;
    case 4: NB_NAME(rows_simd)(4, 0, layout, m, xs, begin, end, y); break;
    case 5: NB_NAME(rows_simd)(5, 0, layout, m, xs, begin, end, y); break;
    case 6: NB_NAME(rows_simd)(6, 0, layout, m, xs, begin, end, y); break;
    case 7: NB_NAME(rows_simd)(7, 0, layout, m, xs, begin, end, y); break;
    default: NB_NAME(rows_simd)(8, 0, layout, m, xs, begin, end, y); break;
    }
}

NB_TARGET static void NB_NAME(gemm_simd)(const NibbleMatrix *m, int layout, int alone, const float *xs, int rows, int begin, int end,
                           float *y) {
    switch (layout) {
    case ONE_GROUP: NB_NAME(layout_rows)(ONE_GROUP, alone, m, xs, rows, begin, end, y); break;
    case TWO_GROUPS: NB_NAME(layout_rows)(TWO_GROUPS, alone, m, xs, rows, begin, end, y); break;
    case FOUR_GROUPS: NB_NAME(layout_rows)(FOUR_GROUPS, alone, m, xs, rows, begin, end, y); break;
    default: NB_NAME(layout_rows)(EIGHTS, alone, m, xs, rows, begin, end, y); break;
    }
}
#undef ALONE_DOT
