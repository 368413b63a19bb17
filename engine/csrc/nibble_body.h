/* The 4-bit kernel's SIMD loops (nibble.c), included once per instruction set with NB_TARGET / NB_INLINE
 * (function attributes), NB_NAME (the set's suffix), NB_VEC / NB_CODES / NB_TABLE (types), NB_HALVES
 * (lane groups per chunk: 1 of 16 lanes, or 2 of 8), NB_MAX_RS (rows of x per pass, the accumulators'
 * register budget) and the per-set primitives value_table, load_codes, weights, load_x, fma, add, zero,
 * chunk_lanes, broadcast and total defined, and prefetch_t0.
 *
 * Every lane does the same float operations in the same order in every set: a chunk's 8 products per
 * lane (two FMA chains from 0, even and odd s, then added), then one FMA by the lane's group scale into
 * the row's accumulator, and the 16 lanes summed as lanes 0-7 + lanes 8-15, then hsum8. So the sets give
 * the same bits, and a row's result does not depend on which rows share its pass (rows_alone holds by
 * construction; only the column block, which the y sums follow, may depend on the row count, where alone
 * is 0). */

/* acc[h][r] += chunk products of lane group h for RS rows of x (xc: the first row's chunk, rows
 * CHUNK_COLS floats apart); codes: the chunk's 64 bytes, scales: the block's (row_scales). */
NB_INLINE void NB_NAME(chunk_rows)(int RS, int broad, const uint8_t *codes, const NB_TABLE *table, const float *scales,
                                   const ChunkScales *cs, const float *xc, NB_VEC acc[NB_HALVES][NB_MAX_RS]) {
#pragma GCC unroll 2
    for (int h = 0; h < NB_HALVES; h++) {
        NB_CODES v = NB_NAME(load_codes)(codes + h * (CHUNK_BYTES / NB_HALVES), table);
        NB_VEC part[2][NB_MAX_RS]; /* even and odd s: two chains, half the latency */
#pragma GCC unroll 8
        for (int r = 0; r < RS; r++) part[0][r] = part[1][r] = NB_NAME(zero)();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            NB_VEC w = NB_NAME(weights)(v, s, table);
#pragma GCC unroll 8
            for (int r = 0; r < RS; r++)
                part[s % 2][r] = NB_NAME(fma)(w, NB_NAME(load_x)(xc + r * CHUNK_COLS + 16 * s + 8 * h), part[s % 2][r]);
        }
        NB_VEC sv = broad ? NB_NAME(broadcast)(scales + cs->base) : NB_NAME(chunk_lanes)(scales, cs, h);
#pragma GCC unroll 8
        for (int r = 0; r < RS; r++) acc[h][r] = NB_NAME(fma)(NB_NAME(add)(part[0][r], part[1][r]), sv, acc[h][r]);
    }
}

/* y[r * n] += one output row's column block [c0, c1) times RS rows of x (xs: the first one's; XR rows per
 * chunk in xs). ahead (or NULL): the codes the next pass reads, asked for one line per chunk: a column
 * block reads a row in pieces, which the hardware prefetchers follow less well than one stream. */
NB_INLINE void NB_NAME(row_block)(int RS, int XR, int broad, const NibbleMatrix *m, const uint8_t *row, const NB_TABLE *table,
                                  const float *scales, const ChunkScales *cs, size_t c0, size_t c1, const float *xs,
                                  const uint8_t *ahead, float *y, size_t n) {
    size_t row_bytes = nibble_row_bytes(m), full = row_bytes / CHUNK_BYTES, c1_full = c1 < full ? c1 : full;
    NB_VEC acc[NB_HALVES][NB_MAX_RS];
#pragma GCC unroll 2
    for (int h = 0; h < NB_HALVES; h++)
#pragma GCC unroll 8
        for (int r = 0; r < RS; r++) acc[h][r] = NB_NAME(zero)();
    for (size_t c = c0; c < c1_full; c++) {
        if (ahead) prefetch_t0(ahead + (c - c0) * CHUNK_BYTES);
        NB_NAME(chunk_rows)(RS, broad, row + c * CHUNK_BYTES, table, scales, cs + (c - c0), xs + c * XR * CHUNK_COLS, acc);
    }
    if (c1 > c1_full) { /* the row's last bytes, zero-padded to a chunk */
        uint8_t tail[CHUNK_BYTES] = {0};
        memcpy(tail, row + full * CHUNK_BYTES, row_bytes - full * CHUNK_BYTES);
        NB_NAME(chunk_rows)(RS, broad, tail, table, scales, cs + (full - c0), xs + full * XR * CHUNK_COLS, acc);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RS; r++) y[r * n] += NB_NAME(total)(acc, r);
}

/* One output row's column block for all R rows of x, NB_MAX_RS rows per pass (each pass unpacks the
 * block's codes again, from L1); only the first pass asks for the next codes. */
NB_INLINE void NB_NAME(row_rows)(int R, int broad, const NibbleMatrix *m, const uint8_t *row, const NB_TABLE *table,
                                 const float *scales, const ChunkScales *cs, size_t c0, size_t c1, const float *xs,
                                 const uint8_t *ahead, float *y, size_t n) {
    for (int r = 0; r < R; r += NB_MAX_RS) {
        const float *xr = xs + r * CHUNK_COLS;
        const uint8_t *next = r ? NULL : ahead;
        float *yr = y + r * n;
        switch (R - r < NB_MAX_RS ? R - r : NB_MAX_RS) {
#define NB_PASS(RS) NB_NAME(row_block)(RS, R, broad, m, row, table, scales, cs, c0, c1, xr, next, yr, n)
        case 1: NB_PASS(1); break;
        case 2: NB_PASS(2); break;
#if NB_MAX_RS > 2
        case 3: NB_PASS(3); break;
        case 4: NB_PASS(4); break;
        case 5: NB_PASS(5); break;
        case 6: NB_PASS(6); break;
        case 7: NB_PASS(7); break;
        default: NB_PASS(8); break;
#endif
#undef NB_PASS
        }
    }
}

/* R rows (a constant after inlining) times output rows [begin, end), column block by column block;
 * ``alone``: the column blocks of a one-row call, whatever R is (rows_alone). */
NB_INLINE void NB_NAME(rows_simd)(int R, int alone, int broad, int code, const NibbleMatrix *m, const float *xs, int begin, int end,
                                  float *y) {
    size_t row_bytes = nibble_row_bytes(m), chunks = nibble_chunks(m), n = (size_t)(end - begin);
    size_t block = alone ? block_chunks(1) : block_chunks(R);
    NB_TABLE table = NB_NAME(value_table)(code);
    ChunkScales cs[MAX_BLOCK_CHUNKS];
    float scales[MAX_BLOCK_GROUPS + 16]; /* + 16: chunk_lanes loads 16 from a chunk's first group */
    for (int r = 0; r < R; r++) memset(y + (size_t)r * n, 0, n * sizeof *y);
    for (size_t c0 = 0; c0 < chunks; c0 += block) {
        size_t c1 = c0 + block < chunks ? c0 + block : chunks;
        size_t first_group = c0 * CHUNK_COLS / m->group, n_groups = ((c1 * CHUNK_COLS - 1) / m->group) - first_group + 1;
        block_scales(m, c0, c1, cs);
        for (int o = begin; o < end; o++) {
            /* the codes of the row two ahead for this block, or of the first rows for the next block
             * (one row ahead leaves a single thread waiting on the memory) */
            int t = o + AHEAD_ROWS;
            const uint8_t *ahead = t < end ? m->q + (size_t)t * row_bytes + c0 * CHUNK_BYTES
                                   : c1 < chunks && t - end + begin < end ? m->q + (size_t)(t - end + begin) * row_bytes + c1 * CHUNK_BYTES
                                                                          : NULL;
            row_scales(m, o, first_group, n_groups + 16, scales);
            NB_NAME(row_rows)(R, broad, m, m->q + (size_t)o * row_bytes, &table, scales, cs, c0, c1, xs, ahead, y + (o - begin), n);
        }
    }
}

/* One instantiation per row count (1..MAX_ROWS). */
NB_INLINE void NB_NAME(layout_rows)(int broad, int code, int alone, const NibbleMatrix *m, const float *xs, int rows, int begin, int end,
                                    float *y) {
    switch (rows) {
    case 1: NB_NAME(rows_simd)(1, alone, broad, code, m, xs, begin, end, y); break;
    case 2: NB_NAME(rows_simd)(2, alone, broad, code, m, xs, begin, end, y); break;
    case 3: NB_NAME(rows_simd)(3, alone, broad, code, m, xs, begin, end, y); break;
    case 4: NB_NAME(rows_simd)(4, alone, broad, code, m, xs, begin, end, y); break;
    case 5: NB_NAME(rows_simd)(5, alone, broad, code, m, xs, begin, end, y); break;
    case 6: NB_NAME(rows_simd)(6, alone, broad, code, m, xs, begin, end, y); break;
    case 7: NB_NAME(rows_simd)(7, alone, broad, code, m, xs, begin, end, y); break;
    default: NB_NAME(rows_simd)(8, alone, broad, code, m, xs, begin, end, y); break;
    }
}

/* One instantiation per scale layout and code (the 8-lane set makes int4 values by arithmetic). */
NB_TARGET static void NB_NAME(gemm_simd)(const NibbleMatrix *m, int alone, const float *xs, int rows, int begin, int end, float *y) {
    int broad = broadcast_scales(m);
    if (broad && m->code == CODE_INT4) NB_NAME(layout_rows)(1, CODE_INT4, alone, m, xs, rows, begin, end, y);
    else if (broad) NB_NAME(layout_rows)(1, CODE_FP4, alone, m, xs, rows, begin, end, y);
    else if (m->code == CODE_INT4) NB_NAME(layout_rows)(0, CODE_INT4, alone, m, xs, rows, begin, end, y);
    else NB_NAME(layout_rows)(0, CODE_FP4, alone, m, xs, rows, begin, end, y);
}
