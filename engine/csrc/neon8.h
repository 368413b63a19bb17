/* An AVX2 register's 8 float lanes as two NEON registers (aarch64 only), for the NEON loops that mirror the
 * AVX2 ones lane for lane: every lane does the same IEEE operations in the same order (vfmaq_f32 is one
 * fused multiply-add, as _mm256_fmadd_ps), and f8_hsum adds the 8 lanes in hsum8's order
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), so a NEON loop gives its AVX2 twin's bits (tools/kernel_bits_harness.c). */
#ifndef COLIBRI_NEON8_H
#define COLIBRI_NEON8_H

#include <arm_neon.h>

typedef struct {
    float32x4_t lo, hi; /* lanes 0-3, 4-7 */
} F8;

#define F8_INLINE __attribute__((always_inline)) static inline

F8_INLINE F8 f8_zero(void) { return (F8){vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
F8_INLINE F8 f8_dup(float a) { return (F8){vdupq_n_f32(a), vdupq_n_f32(a)}; }
F8_INLINE F8 f8_load(const float *p) { return (F8){vld1q_f32(p), vld1q_f32(p + 4)}; }
F8_INLINE void f8_store(float *p, F8 v) { vst1q_f32(p, v.lo), vst1q_f32(p + 4, v.hi); }
/* a * b + c, fused */
F8_INLINE F8 f8_fma(F8 a, F8 b, F8 c) { return (F8){vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
F8_INLINE F8 f8_add(F8 a, F8 b) { return (F8){vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
F8_INLINE F8 f8_mul(F8 a, F8 b) { return (F8){vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
/* hsum8's order: the halves, then lanes 0+2 and 1+3, then those two */
F8_INLINE float f8_hsum(F8 v) {
    float32x4_t s = vaddq_f32(v.lo, v.hi);
    float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

/* 8 float16 bit patterns as floats (IEEE conversion: exact, as _mm256_cvtph_ps) */
F8_INLINE F8 f8_from_halves(const uint16_t *p) {
    float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    return (F8){vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}

#endif
