/* Paged decode attention on the CPU as a call of its own: native_attention.h holds the kernel
 * and says what it computes. */
#include "native_attention.h"

/* The entry point; native_attention.h's decode_attention_run says what it takes. */
int paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                           const int32_t *tables, int64_t table_stride, const int32_t *lens,
                           float *out, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int num_blocks, float scale, int window,
                           int threads) {
    return decode_attention_run(q, k, v, bf16, tables, table_stride, lens, out, num_seqs,
                                num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                window, threads);
}
