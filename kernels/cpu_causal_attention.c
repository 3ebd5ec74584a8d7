/* Prompts attending to themselves on the CPU, whole or a chunk after their cached prefix:
 * causal, no window, float32, grouped-query heads.
 *
 * For each sequence and kv head the keys are first laid out sixteen to a block with the
 * head_dim running down the block (the transpose of their rows), so that scoring eight queries
 * against sixteen keys is eight accumulators fed by one load and eight broadcasts per
 * dimension, every multiply-add at the core's full width. The softmax takes the scores of keys
 * up to each query (later keys score -inf, exp 0); the values are summed four queries and four
 * vectors of head_dim at a time.
 *
 * Built and loaded by kernels/native_build.py; kernels/torch_attention.py's
 * _causal_sdpa_in_chunks is the reference. Sums run in another order, so results agree to
 * float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_vec.h"

#define QB 8 /* queries scored together (summed four at a time) */
#define MAX_HEAD_DIM 512

/* kt (blocks of 16 keys, each head_dim rows of 16 lanes) of one kv head's n keys, rows ld
 * floats apart; lanes past n are 0. */
static void transpose_keys(const float *k, int64_t ld, int n, int head_dim, float *kt) {
    for (int b = 0; b * 16 < n; b++)
        for (int lane = 0; lane < 16; lane++) {
            int key = b * 16 + lane;
            for (int d = 0; d < head_dim; d++)
                kt[((int64_t)b * head_dim + d) * 16 + lane] = key < n ? k[key * ld + d] : 0.0f;
        }
}

/* scores (QB rows sld apart) = scale * q . k for keys 0 .. last of queries i0 .. i0 + QB - 1,
 * -inf past each query's position; top[i] the row's largest lane by lane. */
static void score_queries(const float *q, int64_t qld, const float *kt, int i0, int last,
                          int head_dim, float scale, float *scores, int64_t sld, v16 *top) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int i = 0; i < QB; i++) top[i] = splat16(-INFINITY);
    for (int b = 0; b <= last / 16; b++) {
        const float *kb = kt + (int64_t)b * head_dim * 16;
        v16 acc[QB] = {{0}};
        for (int d = 0; d < head_dim; d++) {
            v16 kd = load16(kb + d * 16);
            for (int i = 0; i < QB; i++) acc[i] += q[i * qld + d] * kd;
        }
        for (int i = 0; i < QB; i++) {
            v16 s = acc[i] * scale;
            s = select16(lane + b * 16 <= i0 + i, s, splat16(-INFINITY));
            store16(scores + i * sld + b * 16, s);
            top[i] = select16(s > top[i], s, top[i]);
        }
    }
}

/* Each score row (blocks of 16 up to key last) replaced by exp(score - its max); inv[i] the
 * reciprocal of row i's sum. */
static void softmax_rows(float *scores, int64_t sld, int last, const v16 *top, float *inv) {
    for (int i = 0; i < QB; i++) {
        float max = -INFINITY;
        for (int l = 0; l < 16; l++) max = top[i][l] > max ? top[i][l] : max;
        v16 sums = {0};
        for (int b = 0; b <= last / 16; b++) {
            v16 e = vexp16(load16(scores + i * sld + b * 16) - max);
            store16(scores + i * sld + b * 16, e);
            sums += e;
        }
        inv[i] = 1.0f / sum16(sums);
    }
}

/* out rows (old apart) of count queries = inv * the weights (scores) times the values (rows
 * ld apart) of keys 0 .. last; four queries and four vectors of head_dim at a time. */
static void sum_values(const float *scores, int64_t sld, const float *inv, const float *v,
                       int64_t ld, int last, int count, int head_dim, float *out, int64_t old) {
    const int nv = head_dim / 16, tail = nv * 16;
    for (int i0 = 0; i0 < count; i0 += 4)
        for (int j0 = 0; j0 < nv; j0 += 4) {
            int nj = nv - j0 < 4 ? nv - j0 : 4, ni = count - i0 < 4 ? count - i0 : 4;
            const float *sc = scores + i0 * sld;
            v16 acc[4][4] = {{{0}}};
            for (int key = 0; key <= last; key++) {
                const float *vr = v + key * ld + j0 * 16;
                for (int j = 0; j < nj; j++) {
                    v16 x = in_register(load16(vr + j * 16));
                    for (int i = 0; i < 4; i++) acc[i][j] += sc[i * sld + key] * x;
                }
            }
            for (int i = 0; i < ni; i++)
                for (int j = 0; j < nj; j++)
                    store16(out + (i0 + i) * old + (j0 + j) * 16, acc[i][j] * inv[i0 + i]);
        }
    for (int i = 0; i < count; i++)
        for (int d = tail; d < head_dim; d++) {
            float x = 0.0f;
            for (int key = 0; key <= last; key++) x += scores[i * sld + key] * v[key * ld + d];
            out[i * old + d] = x * inv[i];
        }
}

/* The queries at positions p0 .. p0 + count - 1 of one head: q rows qld floats apart (QB of
 * them), out rows old apart, values v rows ld apart, scores room for QB rows of the padded key
 * count. */
static void attend_queries(const float *q, int64_t qld, const float *kt, const float *v,
                           int64_t ld, int p0, int count, int head_dim, float scale,
                           float *scores, int64_t sld, float *out, int64_t old) {
    const int last = p0 + count - 1;
    v16 top[QB];
    float inv[QB];
    score_queries(q, qld, kt, p0, last, head_dim, scale, scores, sld, top);
    softmax_rows(scores, sld, last, top, inv);
    sum_values(scores, sld, inv, v, ld, last, count, head_dim, out, old);
}

/* seqs sequences of offset + n positions each, the queries their last n: q (seqs, n, heads,
 * head_dim) with strides (q_seq, q_token, q_head, 1); k, v (seqs, offset + n, kv_heads,
 * head_dim) contiguous; out (seqs, n, heads, head_dim) contiguous. The query at position p
 * sees keys 0 .. p (offset 0: whole prompts; else a chunk after its cached prefix). Returns
 * 0, -1 for a shape it does not take, -2 when out of memory. */
int causal_attention_f32(const float *q, int64_t q_seq, int64_t q_token, int64_t q_head,
                         const float *k, const float *v, float *out, int seqs, int n, int offset,
                         int heads, int kv_heads, int head_dim, float scale, int threads) {
    if (seqs < 0 || n < 0 || offset < 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0
            || head_dim > MAX_HEAD_DIM)
        return -1;
    if (seqs == 0 || n == 0) return 0;
    const int keys = offset + n, group = heads / kv_heads, blocks = (keys + 15) / 16;
    const int qblocks = (n + QB - 1) / QB;
    const int64_t ld = (int64_t)kv_heads * head_dim, kt_size = (int64_t)blocks * head_dim * 16;
    float *kt = malloc(sizeof(float) * (size_t)(kt_size * kv_heads * seqs));
    if (kt == NULL) return -2;
    for (int s = 0; s < seqs; s++)
        for (int g = 0; g < kv_heads; g++)
            transpose_keys(k + (int64_t)s * keys * ld + g * head_dim, ld, keys, head_dim,
                           kt + (int64_t)(s * kv_heads + g) * kt_size);
    int failed = 0;
    const int64_t tasks = (int64_t)seqs * heads * qblocks;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int s = (int)(task / ((int64_t)heads * qblocks));
        int rest = (int)(task % ((int64_t)heads * qblocks));
        int h = rest / qblocks, i0 = (rest % qblocks) * QB, g = h / group;
        int count = n - i0 < QB ? n - i0 : QB;
        int64_t sld = (int64_t)blocks * 16;
        float *scores = malloc(sizeof(float) * (size_t)(QB * sld));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float pad[QB * MAX_HEAD_DIM];
        const float *qs = q + s * q_seq + h * q_head + (int64_t)i0 * q_token;
        int64_t qld = q_token;
        if (count < QB) { /* the last block, filled up with zero queries */
            for (int i = 0; i < QB; i++)
                for (int d = 0; d < head_dim; d++)
                    pad[i * head_dim + d] = i < count ? qs[i * q_token + d] : 0.0f;
            qs = pad;
            qld = head_dim;
        }
        attend_queries(qs, qld, kt + (int64_t)(s * kv_heads + g) * kt_size,
                       v + (int64_t)s * keys * ld + g * head_dim, ld, offset + i0, count,
                       head_dim, scale, scores, sld,
                       out + (((int64_t)s * n + i0) * heads + h) * head_dim,
                       (int64_t)heads * head_dim);
        free(scores);
    }
    free(kt);
    return failed ? -2 : 0;
}
