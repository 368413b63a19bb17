/* The DSA indexer's scoring loops (index_select.c), included once per instruction set with IS_TARGET /
 * IS_INLINE (function attributes) and IS_NAME (the set's suffix) defined, as nibble_body.h is. The code is
 * the same 256-bit AVX2 code each time; compiled with AVX-512VL the compiler has 32 vector registers, enough
 * for three keys' 24 accumulators, so each load of a head's query values feeds three FMAs instead of one.
 * Each key's products, their order, its head sums and its tail are the same whichever keys come with it:
 * the same bits. */

IS_INLINE float IS_NAME(hsum8)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum of v[0]], ..., [sum of v[7]] as one vector. */
IS_INLINE __m256 IS_NAME(sums8)(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* score += each head's weighted ReLU from head h on, one by one (the heads past a multiple of 8). */
IS_TARGET static float IS_NAME(heads_after)(const IndexSelect *j, const float *key, int h, float score) {
    int dim = j->dim, whole = dim / 8 * 8;
    for (; h < j->heads; h++) {
        const float *q = j->q + (size_t)h * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int k = 0; k < whole; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + k), _mm256_loadu_ps(key + k), acc);
        float dot = IS_NAME(hsum8)(acc);
        for (int k = whole; k < dim; k++) dot += q[k] * key[k];
        score += j->weights[h] * relu(dot * j->scale);
    }
    return score;
}

/* out[t] = the score of keys[t] (rows dim floats apart), t < n <= 3: heads 8 at a time, one accumulator per
 * (key, head) over the key's floats (its tail through a masked load), each key's eight head sums at once;
 * the heads past a multiple of 8 one by one. Inlined with n a constant, so the loops over keys unroll. */
IS_INLINE void IS_NAME(score_keys)(const IndexSelect *j, const float *keys, int n, float *out) {
    static const int lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    int dim = j->dim, whole = dim / 8 * 8;
    __m256i tail = _mm256_loadu_si256((const __m256i *)(lanes + 8 - dim % 8));
    __m256 total[3], zero = _mm256_setzero_ps(), scale = _mm256_set1_ps(j->scale);
    for (int t = 0; t < n; t++) total[t] = _mm256_setzero_ps();
    int h = 0;
    for (; h + 8 <= j->heads; h += 8) {
        const float *q = j->q + (size_t)h * dim;
        __m256 acc[3][8];
        for (int t = 0; t < n; t++)
            for (int i = 0; i < 8; i++) acc[t][i] = _mm256_setzero_ps();
        for (int k = 0; k < whole; k += 8) {
            __m256 kv[3];
            for (int t = 0; t < n; t++) kv[t] = _mm256_loadu_ps(keys + (size_t)t * dim + k);
            for (int i = 0; i < 8; i++) {
                __m256 qv = _mm256_loadu_ps(q + (size_t)i * dim + k);
                for (int t = 0; t < n; t++) acc[t][i] = _mm256_fmadd_ps(qv, kv[t], acc[t][i]);
            }
        }
        for (int t = 0; t < n; t++) {
            if (whole < dim) {
                __m256 kv = _mm256_maskload_ps(keys + (size_t)t * dim + whole, tail);
                for (int i = 0; i < 8; i++)
                    acc[t][i] = _mm256_fmadd_ps(_mm256_maskload_ps(q + (size_t)i * dim + whole, tail), kv, acc[t][i]);
            }
            __m256 relu = _mm256_max_ps(zero, _mm256_mul_ps(IS_NAME(sums8)(acc[t]), scale)); /* a NaN stays NaN */
            total[t] = _mm256_fmadd_ps(_mm256_loadu_ps(j->weights + h), relu, total[t]);
        }
    }
    for (int t = 0; t < n; t++) out[t] = IS_NAME(heads_after)(j, keys + (size_t)t * dim, h, IS_NAME(hsum8)(total[t]));
}

/* Each instruction set's entry points; a set may leave one unused (AVX2 alone never takes three keys). */
IS_TARGET __attribute__((unused)) static void IS_NAME(score1)(const IndexSelect *j, const float *key, float *out) {
    IS_NAME(score_keys)(j, key, 1, out);
}

IS_TARGET __attribute__((unused)) static void IS_NAME(score3)(const IndexSelect *j, const float *keys, float *out) {
    IS_NAME(score_keys)(j, keys, 3, out);
}
