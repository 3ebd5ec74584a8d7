/* The elementwise steps between a decoder layer's GEMMs as calls of their own:
 * native_pointwise.h holds the row functions and says what they compute. */
#include "native_pointwise.h"

/* out (rows, inter) = silu(gate) * up for x (rows, 2 * inter) = [gate | up], rows ldx apart */
void silu_and_mul(const void *x, int64_t ldx, int64_t rows, int64_t inter, void *out, int bf16,
                  int threads) {
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
void add_rms_norm(const void *x, const void *residual, void *sum, const void *weight,
                  float eps, int64_t rows, int64_t hidden, void *out, int bf16, int threads) {
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
void rotary(const void *x, int64_t ld_token, int64_t ld_head, int64_t tokens, int64_t heads,
            int64_t dim, const float *cos, const float *sin, void *out, int bf16, int threads) {
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
