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
 * The kernels live here (a row at a time, and over rows, split over threads); kernels/
 * cpu_pointwise.c exports them as calls of their own, kernels/cpu_decode_layers.c runs them
 * between the GEMMs of a fused decode.
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

/* out (rows, inter) = silu(gate) * up for x (rows, 2 * inter) = [gate | up], rows ldx apart */
static void silu_and_mul_rows(const void *x, int64_t ldx, int64_t rows, int64_t inter,
                              void *out, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            silu_and_mul_row(x, r * ldx, inter, (uint16_t *)out + r * inter, 1);
        else
            silu_and_mul_row(x, r * ldx, inter, (float *)out + r * inter, 0);
    }
}

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row (rows, hidden); with residual (not
 * NULL): x + residual first, written to sum (the next layer's residual). */
static void add_rms_norm_rows(const void *x, const void *residual, void *sum,
                              const void *weight, float eps, int64_t rows, int64_t hidden,
                              void *out, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * hidden * size;
        const char *xr = (const char *)x + at;
        const char *rr = residual == NULL ? NULL : (const char *)residual + at;
        char *sr = residual == NULL ? NULL : (char *)sum + at, *o = (char *)out + at;
        if (bf16)
            add_rms_norm_row(xr, rr, sr, weight, eps, hidden, o, 1);
        else
            add_rms_norm_row(xr, rr, sr, weight, eps, hidden, o, 0);
    }
}

/* RoPE, rotate-half: out (tokens, heads, dim) = x * cos + (x2, x1) * sin per head, x's heads
 * ld_head elements apart and tokens ld_token apart; cos and sin (tokens, dim) float32 are the
 * rows of rope_table_torch, (cos, cos) and (-sin, sin). Products and sum rounded one by one,
 * as torch does them (no fused multiply-add), so the result is the reference's bit for bit. */
__attribute__((optimize("fp-contract=off")))
static void rotary_rows(const void *x, int64_t ld_token, int64_t ld_head, int64_t tokens,
                        int64_t heads, int64_t dim, const float *cos, const float *sin, void *out,
                        int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * ld_token + h * ld_head, out_at = (t * heads + h) * dim;
            if (bf16)
                rotary_head(x, at, dim, c, s, out, out_at, 1);
            else
                rotary_head(x, at, dim, c, s, out, out_at, 0);
        }
    }
}

#endif
