/* Paged decode attention on the CPU, reading the KV blocks where they lie.
 *
 * One query token per sequence (its last position) against that sequence's context in the
 * paged pool. Queries, scores, sums and outputs are float32; the pool is float32 or bfloat16
 * (each K and V value widened to float32 as it is read, exactly). The pool layout is
 * pdserve's (kernels/kv_layout.py): K and V each (num_blocks, block_size, num_kv_heads,
 * head_dim), contiguous; a sequence's position p lives in row p % block_size of block
 * block_table[p / block_size]. Nothing is gathered: each (sequence, kv head) task walks its
 * block table, scores every visible key against the query heads that share the kv head, takes
 * the softmax (exp sixteen scores at a time, vexp16), and sums the values. A task's reads are
 * strided (its kv head's slice of each row), so it fetches each next block's slices ahead.
 *
 * Used by kernels/cpu_decode_attention.c (the call on its own) and kernels/cpu_decode_layers.c
 * (the attention step of a fused decode), built by kernels/native_build.py (cc -O3
 * -march=native). The torch path in kernels/torch_attention.py is its reference (which widens
 * a bf16 pool to float32 too). Sums run in another order than the reference, so results agree
 * to float32 rounding, not bit for bit.
 */
#ifndef PDSERVE_NATIVE_ATTENTION_H
#define PDSERVE_NATIVE_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_vec.h"

#define MAX_VECTORS 32 /* head_dim up to 512 */
#define MAX_GROUP 8 /* query heads a pass takes together */

/* Rows [lo, hi) of block b of a context of n positions starting at first. */
static inline int block_lo(int b, int bs, int first) { return b * bs < first ? first - b * bs : 0; }
static inline int block_hi(int b, int bs, int n) { return n - b * bs < bs ? n - b * bs : bs; }

/* Scores of positions first .. n - 1 of each of group rows (n apart) replaced by
   exp(score - the row's max), sixteen at a time (vexp16); inv[h] the reciprocal of row h's
   sum. */
static inline void softmax_rows(float *scores, int n, int first, int group, const float *max,
                                float *inv) {
    for (int h = 0; h < group; h++) {
        float *sh = scores + h * n;
        v16 sums = {0};
        int p = first;
        for (; p + 16 <= n; p += 16) {
            v16 e = vexp16(load16(sh + p) - max[h]);
            store16(sh + p, e);
            sums += e;
        }
        if (p < n) { /* the last few, the lanes past n at -inf (exp 0) */
            v16 x = splat16(-INFINITY);
            memcpy(&x, sh + p, sizeof(float) * (size_t)(n - p));
            v16 e = vexp16(x - max[h]);
            memcpy(sh + p, &e, sizeof(float) * (size_t)(n - p));
            sums += e;
        }
        inv[h] = 1.f / sum16(sums);
    }
}

/* A head's head_dim values at element i of a pool, every cache line of them, fetched ahead. */
static inline void prefetch_row(const void *pool, int64_t i, int head_dim, int bf16) {
    const char *p = addressx(pool, i, bf16);
    for (int line = 0; line < head_dim * (bf16 ? 2 : 4); line += 64) __builtin_prefetch(p + line);
}

/* Lane i: the sum of a[i]'s sixteen lanes. Four levels of pairwise folds, each halving the
   lanes that hold one vector's partial sums; they leave vector i's sum in the lane whose index
   is i's four bits reversed, which the last shuffle (its own inverse) puts back. */
static inline v16 sum16_each(const v16 a[16]) {
    v16 c[8], d[4], e[2];
    for (int j = 0; j < 8; j++)
        c[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                         24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27)
               + __builtin_shufflevector(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12,
                                         13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        e[j] = __builtin_shufflevector(d[2 * j], d[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29)
               + __builtin_shufflevector(d[2 * j], d[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                         11, 26, 27, 14, 15, 30, 31);
    v16 f = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                    28, 14, 30)
            + __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                      29, 15, 31);
    return __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* The scores (scale q . k) of positions first .. n - 1 of group query heads (q rows head_dim
   apart) sharing one kv head, into scores (group rows n apart); max[h] row h's largest. The
   keys are taken sixteen positions at a time, widened to float32 into a small buffer that
   each head's products then read from cache, sixteen dot products summed at once
   (sum16_each) into a vector of scores; each next block's slices are fetched ahead. */
static inline __attribute__((always_inline)) void score_keys(
        const float *q, const void *k, int64_t head, const int bf16, const int32_t *table,
        int n, int first, int64_t row, const int group, const int head_dim, int bs, float scale,
        float *scores, float *max) {
    const int nv = head_dim / 16, tail = nv * 16;
    const int64_t block = bs * row;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float keys[16 * 16 * MAX_VECTORS]; /* sixteen K rows as float32, head_dim apart */
    v16 top[MAX_GROUP];
    for (int h = 0; h < group; h++) top[h] = splat16(-INFINITY);
    int b = first / bs, o = first - b * bs; /* the next key's block and row */
    for (int p0 = first; p0 < n; p0 += 16) {
        const int count = n - p0 < 16 ? n - p0 : 16;
        for (int i = 0; i < count; i++) {
            const int64_t kr = head + table[b] * block + o * row;
            if (o == 0 && (b + 1) * bs < n) /* the next block's rows of this head, every line */
                for (int r = 0; r < bs; r++)
                    prefetch_row(k, head + table[b + 1] * block + r * row, head_dim, bf16);
            for (int j = 0; j < nv; j++)
                store16(keys + i * head_dim + j * 16, loadx16(k, kr + j * 16, bf16));
            for (int d = tail; d < head_dim; d++) keys[i * head_dim + d] = loadx1(k, kr + d, bf16);
            if (++o == bs) {
                o = 0;
                b++;
            }
        }
        const v16i real = lane < count;
        for (int h = 0; h < group; h++) {
            const float *qh = q + h * head_dim;
            v16 acc[16];
            for (int i = 0; i < 16; i++) {
                v16 a = {0};
                if (i < count)
                    for (int j = 0; j < nv; j++)
                        a += load16(qh + j * 16) * load16(keys + i * head_dim + j * 16);
                acc[i] = a;
            }
            v16 x = sum16_each(acc);
            if (tail < head_dim)
                for (int i = 0; i < count; i++)
                    for (int d = tail; d < head_dim; d++) x[i] += qh[d] * keys[i * head_dim + d];
            x = select16(real, x * scale, splat16(-INFINITY));
            memcpy(scores + h * n + p0, &x, sizeof(float) * (size_t)count);
            top[h] = select16(x > top[h], x, top[h]);
        }
    }
    for (int h = 0; h < group; h++) {
        max[h] = -INFINITY;
        for (int l = 0; l < 16; l++) max[h] = top[h][l] > max[h] ? top[h][l] : max[h];
    }
}

/* The query heads h0 .. h0 + group - 1 sharing one kv head: q and out (group, head_dim)
   rows, k/v the pools and head the element offset of that kv head in a position's row, row
   the stride between consecutive positions of a block, scores room for group * n floats.
   Each K and V row is read once for the group: the scores (score_keys), their softmax, then
   the values summed a row at a time for every head. */
static inline __attribute__((always_inline)) void attend_group(
        const float *q, const void *k, const void *v, int64_t head, const int bf16,
        const int32_t *table, int n, int first, int64_t row, const int group, const int head_dim,
        int bs, float scale, float *scores, float *out) {
    const int nv = head_dim / 16, tail = nv * 16;
    const int64_t block = bs * row;
    float max[MAX_GROUP];
    score_keys(q, k, head, bf16, table, n, first, row, group, head_dim, bs, scale, scores, max);
    float inv[MAX_GROUP];
    softmax_rows(scores, n, first, group, max, inv);
    v16 acc[MAX_GROUP][MAX_VECTORS];
    float acc_tail[MAX_GROUP][16] = {{0}};
    for (int h = 0; h < group; h++)
        for (int j = 0; j < nv; j++) acc[h][j] = (v16){0};
    for (int b = first / bs; b * bs < n; b++) {
        const int64_t vb = head + table[b] * block;
        const int64_t next = (b + 1) * bs < n ? head + table[b + 1] * block : vb;
        for (int o = block_lo(b, bs, first), hi = block_hi(b, bs, n); o < hi; o++) {
            const int64_t vr = vb + o * row;
            prefetch_row(v, next + o * row, head_dim, bf16);
            for (int j = 0; j < nv; j++) {
                v16 x = loadx16(v, vr + j * 16, bf16);
                for (int h = 0; h < group; h++) acc[h][j] += scores[h * n + b * bs + o] * x;
            }
            for (int h = 0; h < group; h++)
                for (int d = tail; d < head_dim; d++)
                    acc_tail[h][d - tail] +=
                        scores[h * n + b * bs + o] * loadx1(v, vr + d, bf16);
        }
    }
    for (int h = 0; h < group; h++) {
        for (int j = 0; j < nv; j++) store16(out + h * head_dim + j * 16, acc[h][j] * inv[h]);
        for (int d = tail; d < head_dim; d++)
            out[h * head_dim + d] = acc_tail[h][d - tail] * inv[h];
    }
}

/* The common shapes compiled with their group and head_dim as constants (registers, unrolled
   loops); any other shape through the general code. BF16: the pool's type, a constant. */
#define DEFINE_ATTEND(NAME, BF16) \
static void NAME(const float *q, const void *k, const void *v, int64_t head, \
                 const int32_t *table, int n, int first, int64_t row, int group, int head_dim, \
                 int bs, float scale, float *scores, float *out) { \
    CASES(BF16) \
    for (int h0 = 0; h0 < group; h0 += MAX_GROUP) { \
        int g = group - h0 < MAX_GROUP ? group - h0 : MAX_GROUP; \
        attend_group(q + h0 * head_dim, k, v, head, BF16, table, n, first, row, g, head_dim, \
                     bs, scale, scores, out + h0 * head_dim); \
    } \
}
#define CASE(BF16, G, D) \
    if (group == G && head_dim == D) \
        return attend_group(q, k, v, head, BF16, table, n, first, row, G, D, bs, scale, scores, \
                            out);
#define CASES(BF16) \
    CASE(BF16, 1, 64) CASE(BF16, 2, 64) CASE(BF16, 3, 64) CASE(BF16, 4, 64) CASE(BF16, 8, 64) \
    CASE(BF16, 1, 128) CASE(BF16, 2, 128) CASE(BF16, 4, 128) CASE(BF16, 8, 128)
DEFINE_ATTEND(attend_f32, 0)
DEFINE_ATTEND(attend_bf16, 1)
#undef DEFINE_ATTEND
#undef CASES
#undef CASE

/* q, out: (num_seqs, num_heads, head_dim) float32; k, v: (num_blocks, block_size,
   num_kv_heads, head_dim) float32 (bf16 = 0) or bfloat16 (bf16 = 1); tables: (num_seqs,
   table_stride) int32; lens: (num_seqs,) int32 context lengths (the query is position
   lens[s] - 1); window > 0: keys p > lens[s] - 1 - window only. Returns 0; -1 for a shape it
   does not take; -2 when out of memory; -3 for a block id outside the pool or a context
   longer than the table. */
static int decode_attention_run(const float *q, const void *k, const void *v, int bf16,
                           const int32_t *tables, int64_t table_stride, const int32_t *lens,
                           float *out, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int num_blocks, float scale, int window,
                           int threads) {
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
        float *scores = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1) * group);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const float *qg = q + ((int64_t)s * num_heads + g * group) * head_dim;
        float *og = out + ((int64_t)s * num_heads + g * group) * head_dim;
        if (n <= first)
            memset(og, 0, sizeof(float) * group * head_dim);
        else
            (bf16 ? attend_bf16 : attend_f32)(qg, k, v, (int64_t)g * head_dim, table, n, first,
                                              row, group, head_dim, block_size, scale, scores, og);
        free(scores);
    }
    return failed ? -2 : 0;
}

#endif
