/* The elementwise steps between a decoder layer's GEMMs, fused, float32, on the CPU.
 *
 * torch runs each of these as several passes over the activations (SiLU, then the product;
 * the residual add, then the square, the mean, the root and two products; RoPE's roll, two
 * products and a sum), each one a read and a write of the whole tensor and a dispatch; here
 * each is one pass, sixteen lanes at a time. kernels/torch_ops.py holds the references
 * (rms_norm_torch, silu_and_mul_torch, rotary_torch); the norm's sum runs in another order
 * (results agree to float32 rounding), RoPE computes the reference's products and sum
 * without fusing them (the same bits).
 */
#include <math.h>
#include <stdint.h>

#include "native_vec.h"

/* out (rows, inter) = silu(gate) * up for x (rows, 2 * inter) = [gate | up], rows ldx apart */
void silu_and_mul_f32(const float *x, int64_t ldx, int64_t rows, int64_t inter, float *out,
                      int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * ldx, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            v16 g = load16(gate + i);
            store16(o + i, g / (1.0f + vexp16(-g)) * load16(up + i));
        }
        for (; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row (rows, hidden); with residual (not
 * NULL): x + residual first, written to sum (the next layer's residual). */
void add_rms_norm_f32(const float *x, const float *residual, float *sum, const float *weight,
                      float eps, int64_t rows, int64_t hidden, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        if (residual != NULL) {
            float *sr = sum + r * hidden;
            const float *rr = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        v16 squares = {0};
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16) {
            v16 v = load16(xr + i);
            squares += v * v;
        }
        float total = sum16(squares);
        for (; i < hidden; i++) total += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
        float *o = out + r * hidden;
        for (i = 0; i + 16 <= hidden; i += 16)
            store16(o + i, load16(xr + i) * inv * load16(weight + i));
        for (; i < hidden; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* RoPE, rotate-half: out (tokens, heads, dim) = x * cos + (x2, x1) * sin per head, x's heads
 * ld_head floats apart and tokens ld_token apart; cos and sin (tokens, dim) are the rows of
 * rope_table_torch, (cos, cos) and (-sin, sin). Products and sum rounded one by one, as torch
 * does them (no fused multiply-add), so the result is the reference's bit for bit. */
__attribute__((optimize("fp-contract=off")))
void rotary_f32(const float *x, int64_t ld_token, int64_t ld_head, int64_t tokens, int64_t heads,
                int64_t dim, const float *cos, const float *sin, float *out, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * ld_token + h * ld_head;
            float *o = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                float p = xh[i] * c[i], q = xh[i + half] * s[i];
                o[i] = p + q;
            }
            for (int64_t i = half; i < dim; i++) {
                float p = xh[i] * c[i], q = xh[i - half] * s[i];
                o[i] = p + q;
            }
        }
    }
}
