/* The q8 kernel's aarch64 sets (included by q8.c): q8_body.h's loops over NEON registers, the AVX2 set lane
 * for lane. A chunk's integer sums land in the same 8 int32 lanes as AVX2's (lane l: bytes 4l..4l+3 of both
 * weight vectors times x, the int4 offsets in lanes 0 and 4), exact either way, and each lane's float
 * accumulation and the final sum are AVX2's (neon8.h): the same bytes as the AVX2 and VNNI sets.
 *
 * Two sets: dot-product (SDOT: a lane's 4 byte products in one instruction) where the CPU has FEAT_DotProd,
 * plain NEON (widening multiplies and pairwise adds) everywhere else. SMMLA (FEAT_I8MM) sums 8 bytes per
 * lane: it would merge two of AVX2's lanes, whose floats are summed apart, so it cannot give these bytes
 * (docs/kernels.md, "ARM (NEON)"). */
#include "neon8.h"

#if defined(__clang__)
#define DOTPROD __attribute__((target("dotprod")))
#else
#define DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#define NEON_INLINE __attribute__((always_inline)) static inline

/* q8_body.h's 8-lane types and helpers */
typedef F8 Q8F;
typedef struct {
    int32x4_t lo, hi;
} Q8I;
typedef struct {
    int8x16_t lo, hi; /* bytes of lanes 0-3, 4-7 */
} Q8W;
NEON_INLINE Q8F q8f_load(const float *p) { return f8_load(p); }
NEON_INLINE Q8F q8f_zero(void) { return f8_zero(); }
NEON_INLINE Q8F q8f_dup(const float *p) { return f8_dup(*p); }
NEON_INLINE Q8F q8f_pair(const float *a, const float *b) { return (F8){vdupq_n_f32(*a), vdupq_n_f32(*b)}; }
NEON_INLINE Q8F q8_accumulate(Q8F acc, Q8I dot, Q8F d, Q8F sv) {
    return f8_fma((F8){vcvtq_f32_s32(dot.lo), vcvtq_f32_s32(dot.hi)}, f8_mul(d, sv), acc);
}
NEON_INLINE float hsum(Q8F v) { return f8_hsum(v); }
NEON_INLINE void halves8(const uint16_t *p, float *out) { f8_store(out, f8_from_halves(p)); }

/* Row o's group scales as float32, and a 0 after them (the AVX2 row_scales: the conversions are exact). */
static void row_scales(const Q8Matrix *m, int o, int groups, float *out) {
    int g = 0;
    if (m->scale_kind == SCALE_F16)
        for (; g + 8 <= groups; g += 8) halves8((const uint16_t *)m->scales + (size_t)o * groups + g, out + g);
    for (; g < groups; g++) out[g] = nibble_scale(m->scale_kind, m->scales, (size_t)o * groups + g);
    out[groups] = 0.f;
}

/* A chunk's weights as AVX2's chunk_weights orders them: int4 the low nibbles (even columns) and the high
 * ones, unsigned 0..15; int8 columns 0-15|32-47 and 16-31|48-63. */
NEON_INLINE void chunk_weights_neon(int kind, const uint8_t *p, Q8W v[2]) {
    if (kind == Q8_WEIGHTS_INT4) {
        uint8x16_t a = vld1q_u8(p), b = vld1q_u8(p + 16), low4 = vdupq_n_u8(0x0F);
        v[0] = (Q8W){vreinterpretq_s8_u8(vandq_u8(a, low4)), vreinterpretq_s8_u8(vandq_u8(b, low4))};
        v[1] = (Q8W){vreinterpretq_s8_u8(vshrq_n_u8(a, 4)), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
    } else {
        const int8_t *q = (const int8_t *)p;
        v[0] = (Q8W){vld1q_s8(q), vld1q_s8(q + 32)};
        v[1] = (Q8W){vld1q_s8(q + 16), vld1q_s8(q + 48)};
    }
}
DOTPROD NEON_INLINE void chunk_weights_dotprod(int kind, const uint8_t *p, Q8W v[2]) { chunk_weights_neon(kind, p, v); }

/* The int4 offsets (lanes 0 and 4) or zeros: each lane's sum starts there, as AVX2's */
NEON_INLINE Q8I chunk_start(int kind, const uint8_t *s) {
    if (kind != Q8_WEIGHTS_INT4) return (Q8I){vdupq_n_s32(0), vdupq_n_s32(0)};
    const int32_t *offsets = (const int32_t *)(s + SLOT_OFFSETS);
    return (Q8I){vld1q_s32(offsets), vld1q_s32(offsets + 4)};
}

/* 4 lanes' sums of 4 byte products each, two weight/x pairs: widening multiplies, pairwise adds */
NEON_INLINE int32x4_t sums4_neon(int32x4_t start, int8x16_t w0, int8x16_t x0, int8x16_t w1, int8x16_t x1) {
    int32x4_t low = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0))), vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
    int32x4_t high = vpadalq_s16(vpaddlq_s16(vmull_high_s8(w0, x0)), vmull_high_s8(w1, x1));
    return vaddq_s32(vpaddq_s32(low, high), start);
}
NEON_INLINE Q8I chunk_dot_neon(int kind, const Q8W w[2], const uint8_t *s) {
    const int8_t *x = (const int8_t *)s;
    Q8I start = chunk_start(kind, s);
    return (Q8I){sums4_neon(start.lo, w[0].lo, vld1q_s8(x), w[1].lo, vld1q_s8(x + 32)),
                 sums4_neon(start.hi, w[0].hi, vld1q_s8(x + 16), w[1].hi, vld1q_s8(x + 48))};
}

/* SDOT: lane l += the 4 products of bytes 4l..4l+3. Older clang declares vdotq_s32 only when the whole
 * file targets dot-product; there it is the instruction itself. */
#if defined(__clang__) && !defined(__ARM_FEATURE_DOTPROD)
DOTPROD NEON_INLINE int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    __asm__("sdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}
#else
#define sdot vdotq_s32
#endif

/* The same sums with SDOT */
DOTPROD NEON_INLINE Q8I chunk_dot_dotprod(int kind, const Q8W w[2], const uint8_t *s) {
    const int8_t *x = (const int8_t *)s;
    Q8I start = chunk_start(kind, s);
    return (Q8I){sdot(sdot(start.lo, w[0].lo, vld1q_s8(x)), w[1].lo, vld1q_s8(x + 32)),
                 sdot(sdot(start.hi, w[0].hi, vld1q_s8(x + 16)), w[1].hi, vld1q_s8(x + 48))};
}

#define Q8_TARGET
#define Q8_INLINE NEON_INLINE
#define Q8_NAME(name) name##_neon
#define Q8_RB 2
#include "q8_body.h"
#undef Q8_TARGET
#undef Q8_INLINE
#undef Q8_NAME
#undef Q8_RB

#define Q8_TARGET DOTPROD
#define Q8_INLINE DOTPROD NEON_INLINE
#define Q8_NAME(name) name##_dotprod
#define Q8_RB 2
#include "q8_body.h"
#undef Q8_TARGET
#undef Q8_INLINE
#undef Q8_NAME
#undef Q8_RB
