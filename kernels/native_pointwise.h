/* The elementwise steps between a decoder layer's GEMMs, fused, on the CPU, in float32 or
 * bfloat16.
 *
 * torch runs each of these as several passes over the activations (SiLU, then the product;
 * the residual add, then the square, the mean, the root and two products; RoPE's roll, two
 * products and a sum), each one a read and a write of the whole tensor and a dispatch; here
 * each is one pass, sixteen lanes at a time. kernels/torch_ops.py holds the references
 * (rms_norm_torch, silu_and_mul_torch, rotary_torch); the norm's sum runs in another order
 * (results agree to float32 rounding), RoPE computes the reference's products and sum
 * without fusing them (the same bits).
 *
 * bf16 (bf16 = 1: activations, weight and outputs bfloat16; RoPE's tables stay float32) reads
 * each value as a float, computes in float32 and rounds to bf16 where the reference does:
 * SiLU's output before the product, the residual sum, the normalised row before the weight,
 * each output. The entry points take bf16 as an argument and call a copy of the loop compiled
 * for each type (the helpers of native_vec.h fold the test away).
 *
 * The row functions live here; kernels/cpu_pointwise.c calls them on their own, and
 * kernels/cpu_decode_layers.c between the GEMMs of a fused decode.
 */
#ifndef PDSERVE_NATIVE_POINTWISE_H
#define PDSERVE_NATIVE_POINTWISE_H
#include <math.h>
#include <stdint.h>

#include "native_vec.h"

static inline __attribute__((always_inline)) void silu_and_mul_row(
        const void *x, int64_t row, int64_t inter, void *out, const int bf16) {
    const int64_t gate = row, up = row + inter, o = 0;
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) {
        v16 g = loadx16(x, gate + i, bf16);
        v16 silu = g / (1.0f + vexp16(-g));
        if (bf16) silu = round16_bf16(silu);
        storex16(out, o + i, silu * loadx16(x, up + i, bf16), bf16);
    }
    for (; i < inter; i++) {
        float g = loadx1(x, gate + i, bf16), silu = g / (1.0f + expf(-g));
        if (bf16) silu = round_bf16(silu);
        storex1(out, o + i, silu * loadx1(x, up + i, bf16), bf16);
    }
}

/* One row of add_rms_norm: x, residual, sum, out offset to the row. */
static inline __attribute__((always_inline)) void add_rms_norm_row(
        const void *x, const void *residual, void *sum, const void *weight, float eps,
        int64_t hidden, void *out, const int bf16) {
    if (residual != NULL) {
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            storex16(sum, i, loadx16(x, i, bf16) + loadx16(residual, i, bf16), bf16);
        for (; i < hidden; i++)
            storex1(sum, i, loadx1(x, i, bf16) + loadx1(residual, i, bf16), bf16);
        x = sum;
    }
    v16 squares = {0};
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16) {
        v16 v = loadx16(x, i, bf16);
        squares += v * v;
    }
    float total = sum16(squares);
    for (; i < hidden; i++) total += loadx1(x, i, bf16) * loadx1(x, i, bf16);
    const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
    for (i = 0; i + 16 <= hidden; i += 16) {
        v16 normed = loadx16(x, i, bf16) * inv;
        if (bf16) normed = round16_bf16(normed);
        storex16(out, i, normed * loadx16(weight, i, bf16), bf16);
    }
    for (; i < hidden; i++) {
        float normed = loadx1(x, i, bf16) * inv;
        if (bf16) normed = round_bf16(normed);
        storex1(out, i, normed * loadx1(weight, i, bf16), bf16);
    }
}

static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotary_head(
        const void *x, int64_t at, int64_t dim, const float *c, const float *s, void *out,
        int64_t out_at, const int bf16) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float p = loadx1(x, at + i, bf16) * c[i], q = loadx1(x, at + i + half, bf16) * s[i];
        storex1(out, out_at + i, p + q, bf16);
    }
    for (int64_t i = half; i < dim; i++) {
        float p = loadx1(x, at + i, bf16) * c[i], q = loadx1(x, at + i - half, bf16) * s[i];
        storex1(out, out_at + i, p + q, bf16);
    }
}

#endif
