/* The q8 gemm loops, included by q8.c once per instruction set with Q8_TARGET / Q8_INLINE (function
 * attributes), Q8_NAME (the set's suffix) and Q8_RB (rows of x per block: each chunk's weights are unpacked
 * once for that many rows; 4 where AVX-512VL gives 32 vector registers for the 4 x 4 accumulators, else 2)
 * defined, and the architecture's 8-lane types and helpers (Q8W weights, Q8I int32 lane sums, Q8F floats;
 * q8f_load, q8f_zero, q8f_dup, q8f_pair, q8_accumulate, hsum, halves8, prefetch_l2_line: q8.c for x86,
 * q8_neon.h for aarch64). The x86 sets define Q8_VNNI (1: dpbusd products) and take chunk_weights and
 * chunk_dot from here; the NEON sets bring their own. */

#if defined(Q8_VNNI)

/* A chunk's weights as two vectors of unsigned (int4) or signed (int8) bytes, block 0 in the low lanes:
 * int4: the low nibbles (even columns) and the high ones; int8: columns 0-15|32-47 and 16-31|48-63. */
Q8_INLINE void Q8_NAME(chunk_weights)(int kind, const uint8_t *p, __m256i v[2]) {
    if (kind == Q8_WEIGHTS_INT4) {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        __m256i packed = _mm256_loadu_si256((const __m256i *)p);
        v[0] = _mm256_and_si256(packed, low4);
        v[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    } else {
        v[0] = _mm256_loadu2_m128i((const __m128i *)(p + 32), (const __m128i *)p);
        v[1] = _mm256_loadu2_m128i((const __m128i *)(p + 48), (const __m128i *)(p + 16));
    }
}

/* The chunk's integer sums per lane (lanes 0-3 block 0, 4-7 block 1) for one row's prepared x, int4's
 * offsets (-8 sum xq) included. Exact either way (maddubs cannot saturate: |w| <= 127, |x| <= 127). */
Q8_INLINE __m256i Q8_NAME(chunk_dot)(int kind, const __m256i w[2], const uint8_t *s) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)s), x1 = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i a0 = w[0], a1 = w[1]; /* unsigned x signed products: int8 weights as |w| times x with w's sign */
    if (kind != Q8_WEIGHTS_INT4) {
        x0 = _mm256_sign_epi8(x0, w[0]), x1 = _mm256_sign_epi8(x1, w[1]);
        a0 = _mm256_sign_epi8(w[0], w[0]), a1 = _mm256_sign_epi8(w[1], w[1]);
    }
    __m256i start = kind == Q8_WEIGHTS_INT4 ? _mm256_loadu_si256((const __m256i *)(s + SLOT_OFFSETS)) : _mm256_setzero_si256();
#if Q8_VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, a0, x0), a1, x1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind == Q8_WEIGHTS_INT4) { /* |pair sums| <= 2 * 15 * 127: two of them add up in int16 exactly */
        __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a0, x0), _mm256_maddubs_epi16(a1, x1));
        return _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), start);
    }
    __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, x0), ones),
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(a1, x1), ones));
    return _mm256_add_epi32(sum, start);
#endif
}
#endif

/* acc[p][r] += chunk c of P output rows (codes at rows[p], group scales sc[p]; the chunk's blocks are in
 * groups gi[2c], gi[2c + 1]) times RB rows of x. one_scale: groups of 64 columns or more, so both blocks
 * of a chunk have one scale (one broadcast instead of two and an insert; a block past the row's end is
 * zeros in x and in the codes' copy, so its scale never mattered). */
Q8_INLINE void Q8_NAME(chunk_step)(int kind, int one_scale, int P, int RB, const uint8_t *const rows[4],
                            const float *const sc[4], const int *gi, const uint8_t *const s[Q8_RB], int c, size_t step,
                            size_t ahead, Q8F acc[4][Q8_RB]) {
    Q8F d[Q8_RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) d[r] = q8f_load((const float *)(s[r] + (size_t)c * SLOT_BYTES + SLOT_SCALES));
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        Q8W w[2];
        /* the rows two blocks ahead, same columns, into L2: a few short rows interleaved are not a
         * stream the hardware prefetchers follow; one block ahead is too late from DRAM and into L1
         * evicts what this block still reads (docs/kernels.md, "int8 activations") */
        if (ahead) prefetch_l2_line(rows[p] + ahead + (size_t)c * step);
        Q8_NAME(chunk_weights)(kind, rows[p] + (size_t)c * step, w);
        Q8F sv = one_scale ? q8f_dup(sc[p] + gi[2 * c]) : q8f_pair(sc[p] + gi[2 * c], sc[p] + gi[2 * c + 1]);
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++)
            acc[p][r] = q8_accumulate(acc[p][r], Q8_NAME(chunk_dot)(kind, w, s[r] + (size_t)c * SLOT_BYTES), d[r], sv);
    }
}

/* P output rows (P <= 4) times RB rows of x from row r0: one accumulator per pair, each chunk's weights
 * unpacked once for all of them; a row's last, partial chunk is read through zeroed copies (nothing
 * past a row is touched). */
Q8_INLINE void Q8_NAME(rows_block)(int kind, int one_scale, int P, int RB, const Q8Matrix *m, const Q8Rows *x, int o, int r0, int end,
                            float *const scales[4], const int *gi, float *y, size_t ldy, int begin) {
    size_t row_bytes = row_code_bytes(kind, m->in);
    size_t step = chunk_step_bytes(kind);
    int full = (int)(row_bytes / step);
    const uint8_t *rows[4];
    const float *sc[4] = {scales[0], scales[1], scales[2], scales[3]};
    const uint8_t *s[Q8_RB];
#pragma GCC unroll 4
    for (int r = 0; r < Q8_RB; r++) s[r] = slot(x, r0 + (r < RB ? r : RB - 1), 0);
    Q8F acc[4][Q8_RB];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        rows[p] = (const uint8_t *)m->w + (size_t)(o + p) * row_bytes;
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) acc[p][r] = q8f_zero();
    }
    /* only on the first pass over these rows (r0 == 0), and not past this caller's last block */
    size_t ahead = r0 == 0 && o + 3 * P <= end ? (size_t)2 * P * row_bytes : 0;
    for (int c = 0; c < full; c++) Q8_NAME(chunk_step)(kind, one_scale, P, RB, rows, sc, gi, s, c, step, ahead, acc);
    if (full < x->chunks) {
        uint8_t tails[4][64] = {{0}};
        const uint8_t *tail_rows[4];
        for (int p = 0; p < P; p++) {
            memcpy(tails[p], rows[p] + (size_t)full * step, row_bytes - (size_t)full * step);
            tail_rows[p] = tails[p] - (size_t)full * step; /* chunk_step adds full * step back */
        }
        Q8_NAME(chunk_step)(kind, one_scale, P, RB, tail_rows, sc, gi, s, full, step, 0, acc);
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) y[(size_t)(r0 + r) * ldy + (o + p - begin)] = hsum(acc[p][r]);
}

/* The first 8 output rows of a call, every line, into L2 at once: rows_block prefetches the rows two
 * steps ahead of those it computes, so without this the call's first two steps wait on DRAM line by
 * line (without any prefetch the kernel is much slower: docs/kernels.md, "Fused decode steps"). */
Q8_INLINE void Q8_NAME(prefetch_start)(int kind, const Q8Matrix *m, int begin, int end) {
    size_t row_bytes = row_code_bytes(kind, m->in);
    int rows = end - begin < 8 ? end - begin : 8;
    const char *first = (const char *)m->w + (size_t)begin * row_bytes;
    prefetch_l2(first, (size_t)rows * row_bytes);
}

#define ROWS_BLOCK(P, RB) Q8_NAME(rows_block)(kind, one_scale, P, RB, m, x, o, r0, end, scales, gi, y, ldy, begin)
/* Output rows [o, o + P) times rows [first, last) of x, Q8_RB at a time; scales[p] hold row o + p's. */
Q8_INLINE void Q8_NAME(output_rows)(int kind, int one_scale, int P, const Q8Matrix *m, const Q8Rows *x, int o, int first,
                                    int last, int end, float *const scales[4], const int *gi, float *y, size_t ldy,
                                    int begin) {
    for (int r0 = first; r0 < last; r0 += Q8_RB) {
        int rb = last - r0 < Q8_RB ? last - r0 : Q8_RB;
        switch (P * 8 + rb) { /* constant P and RB: the loops above unroll into registers */
        case 9: ROWS_BLOCK(1, 1); break;
        case 10: ROWS_BLOCK(1, 2); break;
        case 17: ROWS_BLOCK(2, 1); break;
        case 18: ROWS_BLOCK(2, 2); break;
        case 25: ROWS_BLOCK(3, 1); break;
        case 26: ROWS_BLOCK(3, 2); break;
        case 33: ROWS_BLOCK(4, 1); break;
        case 34: ROWS_BLOCK(4, 2); break;
#if Q8_RB == 4
        case 11: ROWS_BLOCK(1, 3); break;
        case 12: ROWS_BLOCK(1, 4); break;
        case 19: ROWS_BLOCK(2, 3); break;
        case 20: ROWS_BLOCK(2, 4); break;
        case 27: ROWS_BLOCK(3, 3); break;
        case 28: ROWS_BLOCK(3, 4); break;
        case 35: ROWS_BLOCK(4, 3); break;
        case 36: ROWS_BLOCK(4, 4); break;
#endif
        }
    }
}

/* x's rows a tile at a time (Q8_ROW_TILE), each tile against every output row of the call. */
Q8_INLINE void Q8_NAME(gemm_kind)(int kind, int one_scale, const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *const scales[4],
                           const int *gi, float *y, size_t ldy) {
    int groups = (m->in + m->group - 1) / m->group;
    if (x->rows <= 2) Q8_NAME(prefetch_start)(kind, m, begin, end);
    for (int first = 0; first < x->rows; first += Q8_ROW_TILE) {
        int last = x->rows - first < Q8_ROW_TILE ? x->rows : first + Q8_ROW_TILE;
        for (int o = begin; o < end; o += 4) {
            int P = end - o < 4 ? end - o : 4;
            for (int p = 0; p < P; p++) row_scales(m, o + p, groups, scales[p]);
            Q8_NAME(output_rows)(kind, one_scale, P, m, x, o, first, last, end, scales, gi, y, ldy, begin);
        }
    }
}
#undef ROWS_BLOCK

/* The scales of one span's 4 rows (interleaved layout, q8.h) per chunk: sc[p][c8], the scale of row p's
 * group holding the span's chunk c8. */
Q8_INLINE void Q8_NAME(span_scales)(const Q8Matrix *m, const uint8_t *scales, float sc[4][8]) {
    int per = Q8_SPAN / m->group;
    if (m->scale_kind == SCALE_F16 && per == 8) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) halves8((const uint16_t *)scales + 8 * p, sc[p]);
        return;
    }
    for (int p = 0; p < 4; p++)
        for (int c8 = 0; c8 < 8; c8++) sc[p][c8] = nibble_scale(m->scale_kind, scales, (size_t)p * per + (size_t)c8 * Q8_CHUNK / m->group);
}

/* One 4-row block of an interleaved matrix times RB rows of x from r0 -> out[p][r]: each (row, x row) pair
 * summed as rows_block sums it (chunk by chunk, the chunk's product scaled by d times the group's scale). */
Q8_INLINE void Q8_NAME(interleaved_block)(int kind, int RB, const Q8Matrix *m, const Q8Rows *x, int block, int r0,
                                          size_t ahead, float out[4][Q8_RB]) {
    size_t step = chunk_step_bytes(kind), span_bytes = q8_span_bytes(kind, m->scale_kind, m->group);
    int spans = m->in / Q8_SPAN;
    const uint8_t *first = (const uint8_t *)m->w + (size_t)block * (size_t)spans * span_bytes;
    const uint8_t *s[Q8_RB];
#pragma GCC unroll 4
    for (int r = 0; r < Q8_RB; r++) s[r] = slot(x, r0 + (r < RB ? r : RB - 1), 0);
    Q8F acc[4][Q8_RB];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) acc[p][r] = q8f_zero();
    for (int sp = 0; sp < spans; sp++) {
        const uint8_t *span = first + (size_t)sp * span_bytes;
        /* the stream `ahead` bytes on into L2, a span at a time: the hardware prefetchers of some hosts do
         * not run far enough ahead of one stream from DRAM (docs/kernels.md, "The interleaved layout") */
        if (ahead) prefetch_l2(span + ahead, span_bytes);
        float sc[4][8];
        Q8_NAME(span_scales)(m, span + span_code_bytes(kind), sc);
        for (int c8 = 0; c8 < Q8_SPAN / Q8_CHUNK; c8++) {
            size_t c = (size_t)sp * (Q8_SPAN / Q8_CHUNK) + (size_t)c8;
            Q8F d[Q8_RB];
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) d[r] = q8f_load((const float *)(s[r] + c * SLOT_BYTES + SLOT_SCALES));
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                Q8W w[2];
                Q8_NAME(chunk_weights)(kind, span + (size_t)(4 * c8 + p) * step, w);
                Q8F sv = q8f_dup(&sc[p][c8]);
#pragma GCC unroll 4
                for (int r = 0; r < RB; r++)
                    acc[p][r] = q8_accumulate(acc[p][r], Q8_NAME(chunk_dot)(kind, w, s[r] + c * SLOT_BYTES), d[r], sv);
            }
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) out[p][r] = hsum(acc[p][r]);
}

/* One 4-row block of an interleaved matrix times rows [first, last) of x, Q8_RB at a time; the block's rows in
 * [begin, end) stored. */
Q8_INLINE void Q8_NAME(interleaved_rows)(const Q8Matrix *m, const Q8Rows *x, int block, int first, int last, int begin,
                                         int end, size_t block_bytes, float *y, size_t ldy) {
    for (int r0 = first; r0 < last; r0 += Q8_RB) {
        int rb = last - r0 < Q8_RB ? last - r0 : Q8_RB;
        /* two blocks on, on the first pass over the block and not past this caller's last one */
        size_t ahead = r0 == 0 && (block + 3) * 4 <= end ? 2 * block_bytes : 0;
        float out[4][Q8_RB];
        switch ((m->kind == Q8_WEIGHTS_INT4 ? 0 : 8) + rb) { /* constant kind and RB: registers, as rows_block */
        case 1: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT4, 1, m, x, block, r0, ahead, out); break;
        case 2: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT4, 2, m, x, block, r0, ahead, out); break;
        case 9: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT8, 1, m, x, block, r0, ahead, out); break;
        case 10: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT8, 2, m, x, block, r0, ahead, out); break;
#if Q8_RB == 4
        case 3: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT4, 3, m, x, block, r0, ahead, out); break;
        case 4: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT4, 4, m, x, block, r0, ahead, out); break;
        case 11: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT8, 3, m, x, block, r0, ahead, out); break;
        case 12: Q8_NAME(interleaved_block)(Q8_WEIGHTS_INT8, 4, m, x, block, r0, ahead, out); break;
#endif
        }
        for (int p = 0; p < 4; p++) {
            int o = 4 * block + p;
            if (o < begin || o >= end) continue;
            for (int r = 0; r < rb; r++) y[(size_t)(r0 + r) * ldy + (o - begin)] = out[p][r];
        }
    }
}

/* Output rows [begin, end) of an interleaved matrix: the 4-row blocks holding them, every row of a block
 * computed (its codes are one stream), those in range stored. */
Q8_INLINE void Q8_NAME(interleaved_gemm)(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
    size_t block_bytes = (size_t)(m->in / Q8_SPAN) * q8_span_bytes(m->kind, m->scale_kind, m->group);
    if (x->rows <= 2) { /* the first two blocks at once, as prefetch_start */
        int blocks = (end + 3) / 4 - begin / 4 < 2 ? 1 : 2;
        prefetch_l2((const char *)m->w + (size_t)(begin / 4) * block_bytes, (size_t)blocks * block_bytes);
    }
    for (int first = 0; first < x->rows; first += Q8_ROW_TILE) {
        int last = x->rows - first < Q8_ROW_TILE ? x->rows : first + Q8_ROW_TILE;
        for (int block = begin / 4; block * 4 < end; block++)
            Q8_NAME(interleaved_rows)(m, x, block, first, last, begin, end, block_bytes, y, ldy);
    }
}

/* Four output rows at a time; rows of x Q8_RB at a time (the accumulators stay in registers). */
Q8_TARGET static void Q8_NAME(gemm)(const Q8Matrix *m, const Q8Rows *x, int begin, int end, float *y, size_t ldy) {
    if (m->interleaved) {
        Q8_NAME(interleaved_gemm)(m, x, begin, end, y, ldy);
        return;
    }
    int groups = (m->in + m->group - 1) / m->group, blocks = 2 * x->chunks;
    float *buffer = malloc(sizeof(float) * 4 * (size_t)(groups + 1) + sizeof(int) * (size_t)blocks);
    if (buffer == NULL) {
        gemm_scalar(m, x, begin, end, y, ldy);
        return;
    }
    float *scales[4] = {buffer, buffer + (groups + 1), buffer + 2 * (groups + 1), buffer + 3 * (groups + 1)};
    int *gi = (int *)(buffer + 4 * (groups + 1)); /* each block's group, for every output row alike */
    for (int b = 0; b < blocks; b++) gi[b] = b * Q8_BLOCK < m->in ? b * Q8_BLOCK / m->group : groups;
    int one_scale = m->group % Q8_CHUNK == 0;
    if (m->kind == Q8_WEIGHTS_INT4 && one_scale)
        Q8_NAME(gemm_kind)(Q8_WEIGHTS_INT4, 1, m, x, begin, end, scales, gi, y, ldy);
    else if (m->kind == Q8_WEIGHTS_INT4)
        Q8_NAME(gemm_kind)(Q8_WEIGHTS_INT4, 0, m, x, begin, end, scales, gi, y, ldy);
    else if (one_scale)
        Q8_NAME(gemm_kind)(Q8_WEIGHTS_INT8, 1, m, x, begin, end, scales, gi, y, ldy);
    else
        Q8_NAME(gemm_kind)(Q8_WEIGHTS_INT8, 0, m, x, begin, end, scales, gi, y, ldy);
    free(buffer);
}
