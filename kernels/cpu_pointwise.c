/* The elementwise steps between a decoder layer's GEMMs as calls of their own:
 * native_pointwise.h holds the kernels and says what they compute. */
#include "native_pointwise.h"

void silu_and_mul(const void *x, int64_t ldx, int64_t rows, int64_t inter, void *out, int bf16,
                  int threads) {
    silu_and_mul_rows(x, ldx, rows, inter, out, bf16, threads);
}

void add_rms_norm(const void *x, const void *residual, void *sum, const void *weight,
                  float eps, int64_t rows, int64_t hidden, void *out, int bf16, int threads) {
    add_rms_norm_rows(x, residual, sum, weight, eps, rows, hidden, out, bf16, threads);
}

void rotary(const void *x, int64_t ld_token, int64_t ld_head, int64_t tokens, int64_t heads,
            int64_t dim, const float *cos, const float *sin, void *out, int bf16, int threads) {
    rotary_rows(x, ld_token, ld_head, tokens, heads, dim, cos, sin, out, bf16, threads);
}
