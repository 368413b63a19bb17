/* The DSA indexer's long-prompt scores (index_select.c, index_tile_scores), included once per instruction set
 * with IT_TARGET (function attributes), IT_NAME (the set's suffix), IT_VEC and its operations (IT_ZERO, IT_DUP,
 * IT_LOAD, IT_STORE, IT_FMA, IT_MUL, IT_RELU), IT_LANES floats a vector, IT_KV vectors of keys and IT_HEADS heads
 * at a time (IT_HEADS x IT_KV accumulators, IT_KV key vectors and a query broadcast in registers).
 *
 * Each lane is one key: its dot product with a head is one fused multiply-add per dim in order from 0.f, and its
 * score one fused multiply-add per head in order from 0.f over that head's ReLU(scale x dot): the plain C loop
 * (tile_score_plain) with another width, so every instruction set gives the same bits. Heads go IT_HEADS at a
 * time, one accumulator per (head, key vector), the key vectors loaded once per dim for those heads; the head sum
 * goes in head order whatever the grouping, so the grouping leaves the bits alone. */

/* Scores of W = IT_KV * IT_LANES keys: keys [dim, key_stride] from the first -> out[0, W). */
IT_TARGET static void IT_NAME(tile_keys)(const IndexTiles *j, const float *q, const float *w, const float *keys,
                                        size_t key_stride, float *out) {
    int heads = j->heads, dim = j->dim, h = 0;
    IT_VEC zero = IT_ZERO(), scale = IT_DUP(j->scale), total[IT_KV];
    for (int v = 0; v < IT_KV; v++) total[v] = zero;
    for (; h + IT_HEADS <= heads; h += IT_HEADS) {
        IT_VEC acc[IT_HEADS][IT_KV];
        for (int i = 0; i < IT_HEADS; i++)
            for (int v = 0; v < IT_KV; v++) acc[i][v] = zero;
        for (int d = 0; d < dim; d++) {
            IT_VEC k[IT_KV];
            for (int v = 0; v < IT_KV; v++) k[v] = IT_LOAD(keys + (size_t)d * key_stride + v * IT_LANES);
            for (int i = 0; i < IT_HEADS; i++) {
                IT_VEC qv = IT_DUP(q[(size_t)(h + i) * dim + d]);
                for (int v = 0; v < IT_KV; v++) acc[i][v] = IT_FMA(qv, k[v], acc[i][v]);
            }
        }
        for (int i = 0; i < IT_HEADS; i++) {
            IT_VEC wv = IT_DUP(w[h + i]);
            for (int v = 0; v < IT_KV; v++) total[v] = IT_FMA(wv, IT_RELU(zero, IT_MUL(acc[i][v], scale)), total[v]);
        }
    }
    for (; h < heads; h++) { /* the heads past a multiple of IT_HEADS, one at a time */
        IT_VEC acc[IT_KV];
        for (int v = 0; v < IT_KV; v++) acc[v] = zero;
        for (int d = 0; d < dim; d++) {
            IT_VEC qv = IT_DUP(q[(size_t)h * dim + d]);
            for (int v = 0; v < IT_KV; v++)
                acc[v] = IT_FMA(qv, IT_LOAD(keys + (size_t)d * key_stride + v * IT_LANES), acc[v]);
        }
        IT_VEC wv = IT_DUP(w[h]);
        for (int v = 0; v < IT_KV; v++) total[v] = IT_FMA(wv, IT_RELU(zero, IT_MUL(acc[v], scale)), total[v]);
    }
    for (int v = 0; v < IT_KV; v++) IT_STORE(out + v * IT_LANES, total[v]);
}

/* Row `row`'s scores of keys [begin, end): whole vectors in place, the rest through a zero-padded copy. */
IT_TARGET static void IT_NAME(tile_row)(const IndexTiles *j, int row, int begin, int end) {
    enum { W = IT_KV * IT_LANES };
    const float *q = j->q + (size_t)row * j->heads * j->dim, *w = j->weights + (size_t)row * j->heads;
    float *out = j->scores + (size_t)row * j->score_stride;
    int t = begin;
    for (; t + W <= end; t += W) IT_NAME(tile_keys)(j, q, w, j->keys_t + t, (size_t)j->key_stride, out + t);
    if (t == end) return;
    float *padded = calloc((size_t)j->dim * W, sizeof(float)), scores[W];
    if (padded == NULL) { /* no memory for the tail's copy: the plain loop, the same bits */
        for (; t < end; t++) out[t] = tile_score_plain(j, q, w, t);
        return;
    }
    for (int d = 0; d < j->dim; d++)
        memcpy(padded + (size_t)d * W, j->keys_t + (size_t)d * j->key_stride + t, sizeof(float) * (size_t)(end - t));
    IT_NAME(tile_keys)(j, q, w, padded, W, scores);
    memcpy(out + t, scores, sizeof(float) * (size_t)(end - t));
    free(padded);
}
