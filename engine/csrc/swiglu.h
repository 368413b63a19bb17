/* SwiGLU's elementwise step, shared by the fused expert calls (q8_moe.c, nibble_moe.c). */
#ifndef COLIBRI_SWIGLU_H
#define COLIBRI_SWIGLU_H

#include <math.h>
#include <stddef.h>

/* gate[i] = silu(gate[i]) * up[i] for n values, both clamped first with a limit (DeepSeek-V4). Each value
 * on its own: the result of a row does not depend on the other rows. */
static inline void swiglu_in_place(float *gate, const float *up, size_t n, int clamp, float limit) {
    for (size_t i = 0; i < n; i++) {
        float g = gate[i], u = up[i];
        if (clamp) {
            g = g > limit ? limit : g;
            u = u > limit ? limit : u < -limit ? -limit : u;
        }
        gate[i] = g / (1.f + expf(-g)) * u;
    }
}

#endif
