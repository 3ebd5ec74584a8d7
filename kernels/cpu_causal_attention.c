/* Prompts attending to themselves on the CPU, whole or a chunk after their cached prefix:
 * causal, no window, float32, grouped-query heads.
 *
 * For each sequence and kv head the keys are first laid out sixteen to a block with the
 * head_dim running down the block (the transpose of their rows), so that scoring eight queries
 * against sixteen keys is eight accumulators fed by one load and eight broadcasts per
 * dimension, every multiply-add at the core's full width (two blocks at a time: sixteen
 * accumulators, each query's value broadcast once for both). The softmax takes the scores of
 * keys up to each query (later keys score -inf, exp 0); the values are summed for all eight
 * queries and two vectors of head_dim at a time, so a task reads each value row once a pair of
 * vectors.
 *
 * Built and loaded by kernels/native_build.py; kernels/torch_attention.py's
 * _causal_sdpa_in_chunks is the reference. Sums run in another order, so results agree to
 * float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_amx.h"
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

/* The scores of blocks b (and b + 1 when two = 1) of keys: acc[i][t] = q_i . block b + t */
static inline __attribute__((always_inline)) void score_blocks(
        const float *q, int64_t qld, const float *kt, int b, int head_dim, int two,
        v16 acc[QB][2]) {
    const float *kb = kt + (int64_t)b * head_dim * 16, *next = kb + head_dim * 16;
    for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = splat16(0.0f);
    for (int d = 0; d < head_dim; d++) {
        const v16 k0 = load16(kb + d * 16), k1 = two ? load16(next + d * 16) : k0;
        for (int i = 0; i < QB; i++) {
            const float x = q[i * qld + d];
            acc[i][0] += x * k0;
            if (two) acc[i][1] += x * k1;
        }
    }
}

/* scores (QB rows sld apart) = scale * q . k for keys 0 .. last of queries i0 .. i0 + QB - 1,
 * -inf past each query's position; top[i] the row's largest lane by lane. Two blocks of 16
 * keys at a time, so each query's value is read once for both. */
static void score_queries(const float *q, int64_t qld, const float *kt, int i0, int last,
                          int head_dim, float scale, float *scores, int64_t sld, v16 *top) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int blocks = last / 16 + 1;
    for (int i = 0; i < QB; i++) top[i] = splat16(-INFINITY);
    for (int b = 0; b < blocks; b += 2) {
        const int nb = blocks - b < 2 ? 1 : 2;
        v16 acc[QB][2];
        if (nb == 2)
            score_blocks(q, qld, kt, b, head_dim, 1, acc);
        else
            score_blocks(q, qld, kt, b, head_dim, 0, acc);
        for (int t = 0; t < nb; t++)
            for (int i = 0; i < QB; i++) {
                v16 x = acc[i][t] * scale;
                x = select16(lane + (b + t) * 16 <= i0 + i, x, splat16(-INFINITY));
                store16(scores + i * sld + (b + t) * 16, x);
                top[i] = select16(x > top[i], x, top[i]);
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

/* The sums of all QB queries' weights (scores, rows sld apart) times the values (rows ld
 * apart, from dimension d0) of keys 0 .. last, one or two (two = 1) vectors of head_dim */
static inline __attribute__((always_inline)) void sum_value_vectors(
        const float *scores, int64_t sld, const float *v, int64_t ld, int last, int d0,
        int two, v16 acc[QB][2]) {
    for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = splat16(0.0f);
    for (int key = 0; key <= last; key++) {
        const float *vr = v + key * ld + d0;
        const v16 x0 = in_register(load16(vr)), x1 = two ? in_register(load16(vr + 16)) : x0;
        for (int i = 0; i < QB; i++) {
            const float w = scores[i * sld + key];
            acc[i][0] += w * x0;
            if (two) acc[i][1] += w * x1;
        }
    }
}

/* out rows (old apart) of count queries = inv * the weights (scores) times the values (rows
 * ld apart) of keys 0 .. last; every query and two vectors of head_dim at a time, so a task
 * reads each value once. */
static void sum_values(const float *scores, int64_t sld, const float *inv, const float *v,
                       int64_t ld, int last, int count, int head_dim, float *out, int64_t old) {
    const int nv = head_dim / 16, tail = nv * 16;
    for (int j0 = 0; j0 < nv; j0 += 2) {
        const int nj = nv - j0 < 2 ? 1 : 2;
        v16 acc[QB][2];
        if (nj == 2)
            sum_value_vectors(scores, sld, v, ld, last, j0 * 16, 1, acc);
        else
            sum_value_vectors(scores, sld, v, ld, last, j0 * 16, 0, acc);
        for (int i = 0; i < count; i++)
            for (int j = 0; j < nj; j++)
                store16(out + i * old + (j0 + j) * 16, acc[i][j] * inv[i]);
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

/* bfloat16 prompts on AMX's tiles: one whole prompt (no cached prefix), causal, grouped-query
 * heads, head_dim a multiple of 32 (at most MAX_HEAD_DIM_BF16).
 *
 * Each kv head's keys are laid out once as the right-hand tiles of the scores (for sixteen keys
 * and 32 dimensions, sixteen rows of the keys' dimension pairs side by side) and its values as
 * those of the sums (for 32 keys and sixteen dimensions, sixteen rows of the dimensions' key
 * pairs). A task takes sixteen queries of one head (one tile of rows, read in place) and walks
 * the keys up to its last query 32 at a time, what a block needs staying in the core's first
 * cache: the block's scores (two float32 tiles); on the vector unit, the softmax's weights
 * exp(score - m) over the keys each query sees (0 past them), m the row's running maximum,
 * rounded to bf16 as torch's bf16 attention rounds them, their float32 values summed per row;
 * then the weights times the block's values added to the output's sums, which stay in four
 * tiles (64 dimensions; a wider head takes a pass over the keys per 64, reusing the weights
 * the first pass kept). The running maximum may lag a row's scores by STALE_LOG2: where a block
 * scores higher still, the maximum rises to it and the sums made so far shrink by the factor
 * between the two (rare: a row's largest scores come early). Each row is finally scaled by its
 * sum's reciprocal and rounded to bf16. The next block's scores go to AMX before the vector
 * unit works out this block's weights. Tiles 0-3 hold the output's sums, 4 and 5 a block's
 * scores, 6 the left-hand rows (queries, then weights), 7 the right-hand tile (keys, then
 * values). */
#define MAX_HEAD_DIM_BF16 256
#define AQ 16 /* queries a task: one tile of rows */
#define AK 32 /* keys a block: two tiles of 16 (scores), one tile's 16 pairs (sums) */
#define AD 64 /* output dimensions a pass over the keys sums: four tiles of 16 */
#define TILE_U16 512 /* one 16 x 64-byte tile, in bf16 values */

#if HAVE_AMX_BF16
/* kt: key tile (b, c) for b in 16-key blocks (up to the 32-key block count x 2), c in 32-dim
 * chunks: row p holds the 16 keys' dims (32c + 2p, 32c + 2p + 1); zero past n keys */
static void pack_keys_bf16(const uint16_t *k, int64_t ld, int n, int head_dim, uint16_t *kt) {
    const int chunks = head_dim / 32, tiles = (n + AK - 1) / AK * 2;
    for (int b = 0; b < tiles; b++)
        for (int c = 0; c < chunks; c++) {
            uint32_t *tile = (uint32_t *)(kt + ((int64_t)b * chunks + c) * TILE_U16);
            for (int j = 0; j < 16; j++) {
                const int key = b * 16 + j;
                for (int p = 0; p < 16; p++) {
                    uint32_t pair = 0;
                    if (key < n) memcpy(&pair, k + key * ld + c * 32 + 2 * p, sizeof pair);
                    tile[p * 16 + j] = pair;
                }
            }
        }
}

/* vt: value tile (b, t) for b in 32-key blocks, t in 16-dim slices: row p holds the 16 dims'
 * values of keys (32b + 2p, 32b + 2p + 1) side by side; zero past n keys */
static void pack_values_bf16(const uint16_t *v, int64_t ld, int n, int head_dim, uint16_t *vt) {
    const int slices = head_dim / 16, blocks = (n + AK - 1) / AK;
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < slices; t++) {
            uint16_t *tile = vt + ((int64_t)b * slices + t) * TILE_U16;
            for (int p = 0; p < 16; p++)
                for (int d = 0; d < 16; d++)
                    for (int e = 0; e < 2; e++) {
                        const int key = b * AK + 2 * p + e;
                        tile[(p * 16 + d) * 2 + e] = key < n ? v[key * ld + t * 16 + d] : 0;
                    }
        }
}

/* 2^x lane by lane for the softmax's weights, which are rounded to bf16 (8 bits): x = n + f,
 * |f| <= 1/2, 2^f by its Taylor polynomial of degree 5 (relative error below 3e-6), times 2^n
 * by scalef (0 below 2^-149, +inf past 2^128). x must not be NaN; the kernel's are at most
 * STALE_LOG2 on the keys a query sees (the others' are set to 0 after). */
static inline v16 vexp2_weights(v16 x) {
    __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v16 f = x - (v16)n;
    v16 p = splat16(1.3333558146e-3f);
    p = p * f + 9.6181291076e-3f;
    p = p * f + 5.5504108665e-2f;
    p = p * f + 2.4022650696e-1f;
    p = p * f + 6.9314718056e-1f;
    p = p * f + 1.0f;
    return (v16)_mm512_scalef_ps((__m512)p, n);
}

/* s (AQ rows of AK floats) = the queries (q rows qld apart) against the keys of block b */
static inline void score_block_bf16(const uint16_t *q, int64_t qld, const uint16_t *kt, int b,
                                    int chunks, float *s) {
    _tile_zero(4);
    _tile_zero(5);
    for (int c = 0; c < chunks; c++) {
        _tile_loadd(6, q + c * 32, qld * 2);
        _tile_loadd(7, kt + ((int64_t)(2 * b) * chunks + c) * TILE_U16, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, kt + ((int64_t)(2 * b + 1) * chunks + c) * TILE_U16, 64);
        _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(4, s, AK * 4);
    _tile_stored(5, s + 16, AK * 4);
}

/* Lanes of the 16 keys from `first` that query position `pos` sees (keys up to pos). */
static inline v16i seen_keys(int first, int pos) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return lane + first <= pos;
}

/* Rows' running maxima may lag the scores by this much (log2 of the weights' largest value)
 * before the sums made so far are scaled down to a new maximum. */
#define STALE_LOG2 8.0f

/* Block b's weights (the keys k0 .. k0 + 31 each query sees, 0 past them; AQ rows of AK bf16
 * in w, wld apart) from its scores s: exp(scale (score - top[i])), top[i] the row's running
 * maximum, raised where the block's scores pass it by more than STALE_LOG2 (alpha[i] the
 * factor by which the row's sums so far must then shrink, else 1); their float32 values added
 * to sums[i]. Returns whether any row's maximum rose. */
static inline int block_weights_bf16(const float *s, int k0, int p0, float log2_scale,
                                     float *top, float *alpha, uint16_t *w, int64_t wld,
                                     v16 *sums) {
    const int whole = k0 + AK - 1 <= p0; /* every row sees every key */
    const float stale = STALE_LOG2 / log2_scale; /* in the scores' units */
    int rose = 0;
    for (int i = 0; i < AQ; i++) {
        const v16 lo = load16(s + i * AK), hi = load16(s + i * AK + 16);
        v16i seen_lo = {0}, seen_hi = {0};
        __m512 most;
        if (whole)
            most = _mm512_max_ps((__m512)lo, (__m512)hi);
        else { /* the keys past the query count for nothing */
            seen_lo = seen_keys(k0, p0 + i);
            seen_hi = seen_keys(k0 + 16, p0 + i);
            most = _mm512_max_ps((__m512)select16(seen_lo, lo, splat16(-INFINITY)),
                                 (__m512)select16(seen_hi, hi, splat16(-INFINITY)));
        }
        alpha[i] = 1.0f;
        if (_mm512_cmp_ps_mask(most, _mm512_set1_ps(top[i] + stale), _CMP_GT_OQ)
                || top[i] == -INFINITY) { /* rare: the row's maximum rises */
            const float now = _mm512_reduce_max_ps(most);
            if (top[i] != -INFINITY) alpha[i] = exp2f((top[i] - now) * log2_scale);
            sums[i] *= alpha[i];
            top[i] = now;
            rose = 1;
        }
        const v16 shift = splat16(top[i] * log2_scale);
        v16 e0 = vexp2_weights(lo * log2_scale - shift);
        v16 e1 = vexp2_weights(hi * log2_scale - shift);
        if (!whole) {
            e0 = select16(seen_lo, e0, splat16(0.0f));
            e1 = select16(seen_hi, e1, splat16(0.0f));
        }
        sums[i] += e0 + e1;
        store16_bf16(w + i * wld, e0);
        store16_bf16(w + i * wld + 16, e1);
    }
    return rose;
}

/* The output's sums (tiles 0 .. group - 1, AQ rows) into acc (AQ rows of AD floats) */
static inline void store_sums(int group, float *acc) {
    _tile_stored(0, acc, AD * 4);
    _tile_stored(1, acc + 16, AD * 4);
    if (group > 2) {
        _tile_stored(2, acc + 32, AD * 4);
        _tile_stored(3, acc + 48, AD * 4);
    }
}

/* The output's sums (tiles 0 .. group - 1) times alpha[i] row by row, through acc */
static void shrink_sums(int group, const float *alpha, float *acc) {
    store_sums(group, acc);
    for (int i = 0; i < AQ; i++)
        for (int d = 0; d < group * 16; d += 16)
            store16(acc + i * AD + d, load16(acc + i * AD + d) * alpha[i]);
    _tile_loadd(0, acc, AD * 4);
    _tile_loadd(1, acc + 16, AD * 4);
    if (group > 2) {
        _tile_loadd(2, acc + 32, AD * 4);
        _tile_loadd(3, acc + 48, AD * 4);
    }
}

/* The output's sums (tiles 0 .. group - 1, group 2 or 4) plus a block's weights (w, AQ rows
 * wld apart) times its values of the pass's dimensions (value tiles from `values`) */
static inline void add_values_bf16(const uint16_t *w, int64_t wld, const uint16_t *values,
                                   int group) {
    _tile_loadd(6, w, wld * 2);
    _tile_loadd(7, values, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, values + TILE_U16, 64);
    _tile_dpbf16ps(1, 6, 7);
    if (group > 2) {
        _tile_loadd(7, values + 2 * TILE_U16, 64);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, values + 3 * TILE_U16, 64);
        _tile_dpbf16ps(3, 6, 7);
    }
}

/* The sixteen queries at positions p0 .. p0 + 15 (q rows qld apart; count of them real) of
 * one head: out rows 0 .. count - 1 (old apart, bf16). s: 2 x AQ x AK floats (a block's scores
 * and the next one's); w: AQ rows of wld >= the keys' padded count bf16 (every block's
 * weights, kept for a wider head's later passes); acc: AQ x AD floats; shrink: AQ x blocks
 * floats (the factors of the rows' sums at each block), rose: blocks flags (whether any row's
 * maximum rose there: the later passes replay those). */
static void attend_queries_bf16(const uint16_t *q, int64_t qld, const uint16_t *kt,
                                const uint16_t *vt, int p0, int count, int head_dim,
                                float scale, float *s, uint16_t *w, int64_t wld, float *acc,
                                float *shrink, unsigned char *rose, uint16_t *out,
                                int64_t old) {
    const int blocks = (p0 + count - 1) / AK + 1, chunks = head_dim / 32;
    const int slices = head_dim / 16;
    const float log2_scale = scale * 1.4426950408889634f;
    float top[AQ];
    v16 sums[AQ];
    for (int i = 0; i < AQ; i++) {
        top[i] = -INFINITY;
        sums[i] = splat16(0.0f);
    }
    for (int d0 = 0; d0 < head_dim; d0 += AD) {
        const int group = head_dim - d0 < AD ? 2 : 4; /* the pass's tiles of 16 dimensions */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (d0 == 0) score_block_bf16(q, qld, kt, 0, chunks, s);
        for (int b = 0; b < blocks; b++) {
            if (d0 == 0) { /* the first pass makes the weights; later ones replay them */
                if (b + 1 < blocks)
                    score_block_bf16(q, qld, kt, b + 1, chunks, s + ((b + 1) & 1) * AQ * AK);
                rose[b] = (unsigned char)block_weights_bf16(
                    s + (b & 1) * AQ * AK, b * AK, p0, log2_scale, top, shrink + b * AQ,
                    w + b * AK, wld, sums);
            }
            if (b > 0 && rose[b]) shrink_sums(group, shrink + b * AQ, acc);
            add_values_bf16(w + b * AK, wld, vt + ((int64_t)b * slices + d0 / 16) * TILE_U16,
                            group);
        }
        store_sums(group, acc);
        for (int i = 0; i < count; i++) {
            const float inv = 1.0f / sum16(sums[i]);
            for (int d = 0; d < group * 16; d += 16)
                store16_bf16(out + i * old + d0 + d, load16(acc + i * AD + d) * inv);
        }
    }
}

/* Every kv head's keys (kts, kt_size apart) and values (vts, vt_size apart) packed, the jobs
 * shared by the threads of the enclosing parallel region. */
static void pack_heads_bf16(const uint16_t *k, const uint16_t *v, int64_t kv_token,
                            int64_t kv_head, int n, int kv_heads, int head_dim, uint16_t *kts,
                            int64_t kt_size, uint16_t *vts, int64_t vt_size) {
#pragma omp for schedule(static)
    for (int job = 0; job < 2 * kv_heads; job++) { /* each kv head's keys, then values */
        const int g = job / 2;
        if (job % 2 == 0)
            pack_keys_bf16(k + g * kv_head, kv_token, n, head_dim, kts + g * kt_size);
        else
            pack_values_bf16(v + g * kv_head, kv_token, n, head_dim, vts + g * vt_size);
    }
}

/* Task `task`'s head h and first query i0: a kv head's tasks together (its keys and values
 * stay in cache), the longest (the last queries, which see the most keys) first. */
static inline void task_of(int64_t task, int group, int qblocks, int *h, int *i0) {
    const int g = (int)(task / ((int64_t)group * qblocks));
    const int rest = (int)(task % ((int64_t)group * qblocks));
    *h = g * group + rest % group;
    *i0 = (qblocks - 1 - rest / group) * AQ;
}

/* The AQ queries of head h from position i0 as the tiles read them: in place, or for the last
 * block (count < AQ) copied into pad and filled up with zero queries; *qld their row stride. */
static inline const uint16_t *task_queries(const uint16_t *q, int64_t q_token, int64_t q_head,
                                           int h, int i0, int count, int head_dim,
                                           uint16_t *pad, int64_t *qld) {
    const uint16_t *qs = q + h * q_head + (int64_t)i0 * q_token;
    *qld = q_token;
    if (count == AQ) return qs;
    memset(pad, 0, sizeof(uint16_t) * (size_t)(AQ * head_dim));
    for (int i = 0; i < count; i++)
        memcpy(pad + i * head_dim, qs + i * q_token, sizeof(uint16_t) * head_dim);
    *qld = head_dim;
    return pad;
}
#endif

/* Whether causal_attention_bf16 runs here (the compiler targets AMX and the kernel grants this
 * process its tiles): 1 or 0. */
int causal_attention_bf16_native(void) { return HAVE_AMX_BF16 && amx_permitted(); }

/* One bf16 prompt of n tokens attending to itself: q (n, heads, head_dim) with strides
 * (q_token, q_head, 1), k and v (n, kv_heads, head_dim) with strides (kv_token, kv_head, 1);
 * out (n, heads, head_dim) contiguous. Returns 0; -1 for a shape it does not take or a CPU or
 * process without AMX; -2 when out of memory. */
int causal_attention_bf16(const uint16_t *q, int64_t q_token, int64_t q_head, const uint16_t *k,
                          const uint16_t *v, int64_t kv_token, int64_t kv_head, uint16_t *out,
                          int n, int heads, int kv_heads, int head_dim, float scale, int threads) {
    if (n < 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || head_dim % 32
            || head_dim > MAX_HEAD_DIM_BF16 || !(scale > 0.0f) || !amx_permitted())
        return -1;
    if (n == 0) return 0;
#if HAVE_AMX_BF16
    const int group = heads / kv_heads, blocks = (n + AK - 1) / AK, qblocks = (n + AQ - 1) / AQ;
    const int64_t kt_size = (int64_t)blocks * 2 * (head_dim / 32) * TILE_U16;
    const int64_t vt_size = (int64_t)blocks * (head_dim / 16) * TILE_U16;
    /* the weights' rows: + 32 lest rows a multiple of 4 KiB apart share the caches' sets */
    const int64_t wld = (int64_t)blocks * AK + 32;
    uint16_t *packed = malloc(sizeof(uint16_t) * (size_t)((kt_size + vt_size) * kv_heads));
    if (packed == NULL) return -2;
    uint16_t *kts = packed, *vts = packed + kt_size * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        pack_heads_bf16(k, v, kv_token, kv_head, n, kv_heads, head_dim, kts, kt_size, vts,
                        vt_size);
        const int tile_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        float s[2 * AQ * AK], acc[AQ * AD];
        uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(AQ * wld));
        uint16_t *pad = malloc(sizeof(uint16_t) * (size_t)(AQ * head_dim));
        float *shrink = malloc(sizeof(float) * (size_t)(AQ * blocks));
        unsigned char *rose = malloc((size_t)blocks);
        const int ready = w != NULL && pad != NULL && shrink != NULL && rose != NULL;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        } else
            amx_load_config(tile_rows);
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < (int64_t)heads * qblocks; task++) {
            if (!ready) continue;
            int h, i0;
            task_of(task, group, qblocks, &h, &i0);
            const int g = h / group, count = n - i0 < AQ ? n - i0 : AQ;
            int64_t qld;
            const uint16_t *qs = task_queries(q, q_token, q_head, h, i0, count, head_dim, pad,
                                              &qld);
            attend_queries_bf16(qs, qld, kts + g * kt_size, vts + g * vt_size, i0, count,
                                head_dim, scale, s, w, wld, acc, shrink, rose,
                                out + ((int64_t)i0 * heads + h) * head_dim,
                                (int64_t)heads * head_dim);
        }
        if (ready) _tile_release();
        free(w);
        free(pad);
        free(shrink);
        free(rose);
    }
    free(packed);
    return failed ? -2 : 0;
#else
    (void)q, (void)q_token, (void)q_head, (void)k, (void)v, (void)kv_token, (void)kv_head;
    (void)out, (void)scale, (void)threads;
    return -1;
#endif
}
