/* A decode step's decoder layers in one call on the CPU, float32 or bfloat16.
 *
 * The layers of models/llama.py for a batch of one new token per sequence, each
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

/* The model's shape, the pools' and the bound on splitting work over threads. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int block_size, num_blocks;
    int64_t parallel_min_work; /* below this much work a step runs on one thread */
} decode_shape;

/* threads for a call of this much work (kernels/native_build.py's threads) */
static inline int threads_for(int64_t work, int64_t min_work, int threads) {
    return work >= min_work ? threads : 1;
}

/* Copy n values of row into the pool row at slot (the pool and the row of one dtype). */
static inline void put_row(void *pool, int64_t slot, int64_t n, const void *row, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    memcpy((char *)pool + slot * n * size, row, (size_t)(n * size));
}

/* One call's batch, scratch and settings. */
typedef struct {
    const decode_shape *shape;
    int64_t rows, q_size, kv_size, qkv_size;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *tables, *lens;
    int64_t table_stride;
    int bf16, threads, attention_threads;
    char *residual, *normed, *wide, *rotated, *attn, *act; /* model dtype */
    float *q32, *out32;
} decode_batch;

/* B->normed = RMSNorm(hidden (+ residual, written back to residual)) with weight */
static void norm_into(const decode_batch *B, const void *hidden, void *residual,
                      const void *weight) {
    add_rms_norm_rows(hidden, residual, residual, weight, B->shape->eps, B->rows,
                      B->shape->hidden, B->normed, B->bf16, 1);
}

static int gemm_threads(const decode_batch *B, int64_t n, int64_t k) {
    return threads_for(B->rows * n * k, B->shape->parallel_min_work, B->threads);
}

/* normed rows -> the attention block's output projection, in hidden: q/k/v, RoPE, the new
   K and V into their slots, paged attention over each sequence's context, o. */
static int attention_block(const decode_batch *B, const decode_layer *L, void *hidden) {
    const decode_shape *S = B->shape;
    const int64_t rows = B->rows, h = S->hidden, size = B->bf16 ? 2 : 4;
    const int64_t q_size = B->q_size, kv_size = B->kv_size, qkv_size = B->qkv_size;
    int code = panel_gemm_run(B->normed, h, L->qkv, L->qkv_kp, L->qkv_bias, B->wide, qkv_size,
                              rows, qkv_size, h, B->bf16, gemm_threads(B, qkv_size, h));
    if (code) return code;
    rotary_rows(B->wide, qkv_size, S->head_dim, rows, S->heads + S->kv_heads, S->head_dim,
                B->cos, B->sin, B->rotated, B->bf16, 1);
    for (int64_t r = 0; r < rows; r++) {
        const char *row = B->rotated + r * (q_size + kv_size) * size;
        put_row(L->k_pool, B->slots[r], kv_size, row + q_size * size, B->bf16);
        put_row(L->v_pool, B->slots[r], kv_size,
                B->wide + (r * qkv_size + q_size + kv_size) * size, B->bf16);
        for (int64_t i = 0; i < q_size; i++) B->q32[r * q_size + i] = loadx1(row, i, B->bf16);
    }
    code = decode_attention_run(B->q32, L->k_pool, L->v_pool, B->bf16, B->tables,
                                B->table_stride, B->lens, B->out32, (int)rows, (int)S->heads,
                                (int)S->kv_heads, (int)S->head_dim, S->block_size,
                                S->num_blocks, S->scale, L->window, B->attention_threads);
    if (code) return code;
    for (int64_t i = 0; i < rows * q_size; i++) storex1(B->attn, i, B->out32[i], B->bf16);
    return panel_gemm_run(B->attn, q_size, L->o, L->o_kp, L->o_bias, hidden, h, rows, h, q_size,
                          B->bf16, gemm_threads(B, h, q_size));
}

/* normed rows -> the MLP's output, in hidden: gate/up, SiLU-and-mul, down. */
static int mlp_block(const decode_batch *B, const decode_layer *L, void *hidden) {
    const int64_t rows = B->rows, h = B->shape->hidden, inter = B->shape->inter;
    int code = panel_gemm_run(B->normed, h, L->gate_up, L->gate_up_kp, L->gate_up_bias,
                              B->wide, 2 * inter, rows, 2 * inter, h, B->bf16,
                              gemm_threads(B, 2 * inter, h));
    if (code) return code;
    silu_and_mul_rows(B->wide, 2 * inter, rows, inter, B->act, B->bf16, 1);
    return panel_gemm_run(B->act, inter, L->down, L->down_kp, L->down_bias, hidden, h, rows, h,
                          inter, B->bf16, gemm_threads(B, h, inter));
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
    const int64_t inter = shape->inter, size = bf16 ? 2 : 4;
    if (rows < 1 || num_layers < 1 || hd < 2 || hd % 2 || shape->kv_heads < 1
            || heads % shape->kv_heads)
        return -1;
    const int64_t pool_slots = (int64_t)shape->num_blocks * shape->block_size;
    int64_t context = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= pool_slots) return -3;
        context += lens[r];
    }
    decode_batch B = {.shape = shape, .rows = rows, .q_size = heads * hd,
                      .kv_size = shape->kv_heads * hd, .cos = cos, .sin = sin, .slots = slots,
                      .tables = tables, .lens = lens, .table_stride = table_stride,
                      .bf16 = bf16, .threads = threads};
    B.qkv_size = B.q_size + 2 * B.kv_size;
    B.attention_threads = threads_for(context * heads * hd, shape->parallel_min_work, threads);
    const int64_t wide = B.qkv_size > 2 * inter ? B.qkv_size : 2 * inter;
    const int64_t widths[] = {h, h, wide, B.q_size + B.kv_size, B.q_size, inter};
    char **buffers[] = {&B.residual, &B.normed, &B.wide, &B.rotated, &B.attn, &B.act};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += rows * widths[i] * size;
    char *scratch = malloc((size_t)(total + rows * 2 * B.q_size * 4));
    if (scratch == NULL) return -2;
    char *at = scratch;
    for (int i = 0; i < 6; i++) {
        *buffers[i] = at;
        at += rows * widths[i] * size;
    }
    B.q32 = (float *)at;
    B.out32 = B.q32 + rows * B.q_size;
    memcpy(B.residual, hidden, (size_t)(rows * h * size));
    norm_into(&B, hidden, NULL, layers[0].input_norm);
    int code = 0;
    for (int l = 0; l < num_layers && code == 0; l++) {
        if (l > 0) norm_into(&B, hidden, B.residual, layers[l].input_norm);
        code = attention_block(&B, &layers[l], hidden);
        if (code) break;
        norm_into(&B, hidden, B.residual, layers[l].post_norm);
        code = mlp_block(&B, &layers[l], hidden);
    }
    if (code == 0) {
        norm_into(&B, hidden, B.residual, final_norm);
        memcpy(hidden, B.normed, (size_t)(rows * h * size));
    }
    free(scratch);
    return code;
}
