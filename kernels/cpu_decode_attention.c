/* Paged decode attention on the CPU, reading the KV blocks where they lie.
 *
 * One query token per sequence (its last position) against that sequence's context in the
 * paged pool, float32 throughout. The pool layout is pdserve's (kernels/kv_layout.py): K and
 * V each (num_blocks, block_size, num_kv_heads, head_dim), contiguous; a sequence's position
 * p lives in row p % block_size of block block_table[p / block_size]. Nothing is gathered:
 * each (sequence, kv head) task walks its block table, scores every visible key against the
 * query heads that share the kv head, takes the softmax, and sums the values.
 *
 * Built and loaded by kernels/native_build.py (cc -O3 -march=native); the torch path in
 * kernels/torch_attention.py is its reference. Sums run in another order than the reference,
 * so results agree to float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define MAX_VECTORS 32 /* head_dim up to 512 */

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

static inline float sum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v8 c = a + b;
    v4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
    return (d[0] + d[2]) + (d[1] + d[3]);
}

/* Rows [lo, hi) of block b of a context of n positions starting at first. */
static inline int block_lo(int b, int bs, int first) { return b * bs < first ? first - b * bs : 0; }
static inline int block_hi(int b, int bs, int n) { return n - b * bs < bs ? n - b * bs : bs; }

/* One query head: q (head_dim), k/v the pool offset to this kv head, row the stride between
   consecutive positions of a block, scores room for n floats. */
static inline __attribute__((always_inline)) void attend_head(
        const float *q, const float *k, const float *v, const int32_t *table, int n, int first,
        int64_t row, const int head_dim, int bs, float scale, float *scores, float *out) {
    const int nv = head_dim / 16, tail = nv * 16;
    const int64_t block = bs * row;
    v16 qv[MAX_VECTORS];
    for (int j = 0; j < nv; j++) qv[j] = load16(q + j * 16);
    float max = -INFINITY;
    for (int b = first / bs; b * bs < n; b++) {
        const float *kb = k + table[b] * block;
        const float *next = (b + 1) * bs < n ? k + table[b + 1] * block : kb;
        float *sb = scores + b * bs;
        for (int o = block_lo(b, bs, first), hi = block_hi(b, bs, n); o < hi; o++) {
            const float *kr = kb + o * row;
            __builtin_prefetch(next + o * row);
            v16 acc = {0};
            for (int j = 0; j < nv; j++) acc += qv[j] * load16(kr + j * 16);
            float x = sum16(acc);
            for (int d = tail; d < head_dim; d++) x += q[d] * kr[d];
            x *= scale;
            sb[o] = x;
            max = x > max ? x : max;
        }
    }
    float total = 0.f;
    for (int p = first; p < n; p++) {
        float e = expf(scores[p] - max);
        scores[p] = e;
        total += e;
    }
    v16 acc[MAX_VECTORS];
    float acc_tail[16] = {0};
    for (int j = 0; j < nv; j++) acc[j] = (v16){0};
    for (int b = first / bs; b * bs < n; b++) {
        const float *vb = v + table[b] * block;
        const float *next = (b + 1) * bs < n ? v + table[b + 1] * block : vb;
        const float *sb = scores + b * bs;
        for (int o = block_lo(b, bs, first), hi = block_hi(b, bs, n); o < hi; o++) {
            const float *vr = vb + o * row;
            __builtin_prefetch(next + o * row);
            float w = sb[o];
            for (int j = 0; j < nv; j++) acc[j] += w * load16(vr + j * 16);
            for (int d = tail; d < head_dim; d++) acc_tail[d - tail] += w * vr[d];
        }
    }
    float inv = 1.f / total;
    for (int j = 0; j < nv; j++) store16(out + j * 16, acc[j] * inv);
    for (int d = tail; d < head_dim; d++) out[d] = acc_tail[d - tail] * inv;
}

/* q, out: (num_seqs, num_heads, head_dim); k, v: (num_blocks, block_size, num_kv_heads,
   head_dim); tables: (num_seqs, table_stride) int32; lens: (num_seqs,) int32 context lengths
   (the query is position lens[s] - 1); window > 0: keys p > lens[s] - 1 - window only.
   Returns 0; -1 for a shape it does not take; -2 when out of memory; -3 for a block id
   outside the pool or a context longer than the table. */
int paged_decode_attention_f32(const float *q, const float *k, const float *v,
                               const int32_t *tables, int64_t table_stride, const int32_t *lens,
                               float *out, int num_seqs, int num_heads, int num_kv_heads,
                               int head_dim, int block_size, int num_blocks, float scale,
                               int window, int threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0
            || head_dim > 16 * MAX_VECTORS)
        return -1;
    for (int s = 0; s < num_seqs; s++) {
        int n = lens[s];
        if (n < 0 || (n + block_size - 1) / block_size > table_stride) return -3;
        for (int b = 0; b * block_size < n; b++)
            if (tables[s * table_stride + b] < 0 || tables[s * table_stride + b] >= num_blocks)
                return -3;
    }
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (int task = 0; task < num_seqs * num_kv_heads; task++) {
        int s = task / num_kv_heads, g = task % num_kv_heads, n = lens[s];
        int first = window > 0 && n > window ? n - window : 0;
        const int32_t *table = tables + s * table_stride;
        const float *kg = k + (int64_t)g * head_dim, *vg = v + (int64_t)g * head_dim;
        float *scores = malloc(sizeof(float) * (n > 0 ? n : 1));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        for (int h = g * group; h < (g + 1) * group; h++) {
            const float *qh = q + ((int64_t)s * num_heads + h) * head_dim;
            float *oh = out + ((int64_t)s * num_heads + h) * head_dim;
            if (n <= first) {
                memset(oh, 0, sizeof(float) * head_dim);
            } else if (head_dim == 64) {
                attend_head(qh, kg, vg, table, n, first, row, 64, block_size, scale, scores, oh);
            } else if (head_dim == 128) {
                attend_head(qh, kg, vg, table, n, first, row, 128, block_size, scale, scores, oh);
            } else {
                attend_head(qh, kg, vg, table, n, first, row, head_dim, block_size, scale,
                            scores, oh);
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
