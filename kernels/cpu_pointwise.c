/* The elementwise steps between a decoder layer's GEMMs as calls of their own:
 * native_pointwise.h holds the kernels and says what they compute; and a step's K/V rows
 * copied into their slots of the paged pool. */
#include <string.h>

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

/* Row i of key and value (row_bytes each, k + i * ld_k and v + i * ld_v bytes) copied to row
 * slots[i] of k_pool and v_pool (rows row_bytes apart; num_slots of them). Returns 0; -1,
 * having copied nothing, when a slot is negative or past the pool. */
int write_kv_rows(const char *k, int64_t ld_k, const char *v, int64_t ld_v, int64_t rows,
                  int64_t row_bytes, const int64_t *slots, int64_t num_slots, char *k_pool,
                  char *v_pool, int threads) {
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        memcpy(k_pool + slots[i] * row_bytes, k + i * ld_k, (size_t)row_bytes);
        memcpy(v_pool + slots[i] * row_bytes, v + i * ld_v, (size_t)row_bytes);
    }
    return 0;
}
