/* A decode step's decoder layers in one call on the CPU, float32 or bfloat16.
 *
 * The layers of kernels/../models/llama.py for a batch of one new token per sequence, each
 * step done by the kernel the unfused path calls for it, in the same order, with the same
 * roundings: RMSNorm (with the residual add), the fused q/k/v GEMM, rotate-half RoPE on q and
 * k, K and V written to their pool slots, paged decode attention, the output GEMM, the second
 * norm, the gate/up GEMM, SiLU-and-mul and the down GEMM; then the model's final norm. A
 * bfloat16 model rounds each step's output to bf16 where the unfused path holds it in a bf16
 * tensor. What the unfused path spends between its kernels (a few thousand dispatches per
 * step, each a few microseconds) is gone; the work is the same.
 *
 * Weights are oneDNN's packed layouts (native_panel.h), the pools pdserve's
 * (native_attention.h). kernels/cpu_decode_layers.py checks what the call takes and builds
 * the per-layer table once.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_attention.h"
#include "native_panel.h"
#include "native_pointwise.h"

/* One layer's weights (model dtype unless said) and pools. */
typedef struct {
    const void *input_norm, *post_norm;  /* (hidden) */
    const void *qkv, *o, *gate_up, *down; /* packed weights */
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* (out) or NULL */
    int64_t qkv_kp, o_kp, gate_up_kp, down_kp; /* padded input rows of each packed panel */
    void *k_pool, *v_pool; /* (num_blocks, block_size, kv_heads, head_dim), model dtype */
    int32_t window; /* 0: none */
} decode_layer;

/* The model's shape and the step's batch. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int block_size, num_blocks;
    int64_t gemm_min_work, attention_min_work; /* below these a call runs on one thread */
} decode_shape;

/* threads for a call of this much work (kernels/native_build.py's threads) */
static inline int threads_for(int64_t work, int64_t min_work, int threads) {
    return work >= min_work ? threads : 1;
}

/* RoPE of the packed q and k heads of qkv (rows, (heads + kv_heads) x head_dim, row stride
   ld) into out (rows, heads + kv_heads, head_dim); rotary_head's products stay unfused. */
__attribute__((optimize("fp-contract=off")))
static void rope_rows(const void *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t dim,
                      const float *cos, const float *sin, void *out, int bf16) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * ld + h * dim, out_at = (t * heads + h) * dim;
            if (bf16)
                rotary_head(qkv, at, dim, cos + t * dim, sin + t * dim, out, out_at, 1);
            else
                rotary_head(qkv, at, dim, cos + t * dim, sin + t * dim, out, out_at, 0);
        }
}

static void norm_rows(const void *x, const void *residual, void *sum, const void *weight,
                      float eps, int64_t rows, int64_t hidden, void *out, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * hidden * size;
        const char *rr = residual == NULL ? NULL : (const char *)residual + at;
        char *sr = residual == NULL ? NULL : (char *)sum + at;
        if (bf16)
            add_rms_norm_row((const char *)x + at, rr, sr, weight, eps, hidden, (char *)out + at, 1);
        else
            add_rms_norm_row((const char *)x + at, rr, sr, weight, eps, hidden, (char *)out + at, 0);
    }
}

/* Copy n values of row into the pool row at slot (the pool and the row of one dtype). */
static inline void put_row(void *pool, int64_t slot, int64_t n, const void *row, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    memcpy((char *)pool + slot * n * size, row, (size_t)(n * size));
}

/* hidden (rows, hidden) in the model dtype: the embeddings in, the final norm's output out.
 * cos, sin: (rows, head_dim) float32, rope_table_torch's rows; slots (rows,) int64 pool
 * slots of the new tokens; tables (rows, table_stride) int32 and lens (rows,) int32 (context
 * after this token) as paged decode attention takes them. Returns 0; -1 for a shape it does
 * not take; -2 when out of memory; -3 for a block table or slot outside the pool. */
int decode_layers(const decode_layer *layers, int num_layers, const decode_shape *shape,
                  const void *final_norm, void *hidden, int64_t rows, const float *cos,
                  const float *sin, const int64_t *slots, const int32_t *tables,
                  int64_t table_stride, const int32_t *lens, int bf16, int threads) {
    const int64_t h = shape->hidden, hd = shape->head_dim, heads = shape->heads;
    const int64_t kvh = shape->kv_heads, inter = shape->inter;
    const int64_t q_size = heads * hd, kv_size = kvh * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t size = bf16 ? 2 : 4;
    if (rows < 1 || num_layers < 1 || hd < 2 || hd % 2 || heads % kvh) return -1;
    const int64_t pool_slots = (int64_t)shape->num_blocks * shape->block_size;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= pool_slots) return -3;
    const int64_t widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    /* scratch: residual, normed, qkv/gate_up, rotated q/k, q float, attention float, its
       model-dtype copy, activation */
    char *scratch = malloc((size_t)(rows * (size * (2 * h + widest + q_size + kv_size + q_size
                                                    + inter) + 4 * 2 * q_size)));
    if (scratch == NULL) return -2;
    char *residual = scratch, *normed = residual + rows * h * size;
    char *wide = normed + rows * h * size, *rotated = wide + rows * widest * size;
    char *attn = rotated + rows * (q_size + kv_size) * size, *act = attn + rows * q_size * size;
    float *q32 = (float *)(act + rows * inter * size), *out32 = q32 + rows * q_size;
    const int64_t gemm = shape->gemm_min_work;
    int64_t context = 0;
    for (int64_t r = 0; r < rows; r++) context += lens[r];
    const int attention_threads = threads_for(context * heads * hd, shape->attention_min_work,
                                              threads);
    int code = 0;
    for (int l = 0; l < num_layers && code == 0; l++) {
        const decode_layer *L = &layers[l];
        if (l == 0) {
            memcpy(residual, hidden, (size_t)(rows * h * size));
            norm_rows(hidden, NULL, NULL, L->input_norm, shape->eps, rows, h, normed, bf16);
        } else {
            norm_rows(hidden, residual, residual, L->input_norm, shape->eps, rows, h, normed,
                      bf16);
        }
        code = panel_gemm_run(normed, h, L->qkv, L->qkv_kp, L->qkv_bias, wide, qkv_size, rows,
                              qkv_size, h, bf16, threads_for(rows * qkv_size * h, gemm, threads));
        if (code) break;
        rope_rows(wide, qkv_size, rows, heads + kvh, hd, cos, sin, rotated, bf16);
        for (int64_t r = 0; r < rows; r++) {
            const char *row = rotated + r * (q_size + kv_size) * size;
            put_row(L->k_pool, slots[r], kv_size, row + q_size * size, bf16);
            put_row(L->v_pool, slots[r], kv_size, wide + (r * qkv_size + q_size + kv_size) * size,
                    bf16);
            for (int64_t i = 0; i < q_size; i++) q32[r * q_size + i] = loadx1(row, i, bf16);
        }
        code = decode_attention_run(q32, L->k_pool, L->v_pool, bf16, tables, table_stride, lens,
                                    out32, (int)rows, (int)heads, (int)kvh, (int)hd,
                                    shape->block_size, shape->num_blocks, shape->scale,
                                    L->window, attention_threads);
        if (code) break;
        for (int64_t i = 0; i < rows * q_size; i++) storex1(attn, i, out32[i], bf16);
        code = panel_gemm_run(attn, q_size, L->o, L->o_kp, L->o_bias, hidden, h, rows, h, q_size,
                              bf16, threads_for(rows * h * q_size, gemm, threads));
        if (code) break;
        norm_rows(hidden, residual, residual, L->post_norm, shape->eps, rows, h, normed, bf16);
        code = panel_gemm_run(normed, h, L->gate_up, L->gate_up_kp, L->gate_up_bias, wide,
                              2 * inter, rows, 2 * inter, h, bf16,
                              threads_for(rows * 2 * inter * h, gemm, threads));
        if (code) break;
        for (int64_t r = 0; r < rows; r++) {
            if (bf16)
                silu_and_mul_row(wide, r * 2 * inter, inter, act + r * inter * size, 1);
            else
                silu_and_mul_row(wide, r * 2 * inter, inter, act + r * inter * size, 0);
        }
        code = panel_gemm_run(act, inter, L->down, L->down_kp, L->down_bias, hidden, h, rows, h,
                              inter, bf16, threads_for(rows * h * inter, gemm, threads));
    }
    if (code == 0) {
        norm_rows(hidden, residual, residual, final_norm, shape->eps, rows, h, normed, bf16);
        memcpy(hidden, normed, (size_t)(rows * h * size));
    }
    free(scratch);
    return code;
}
