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

/* bfloat16 prompts on AMX's tiles: one whole prompt (no cached prefix), causal, grouped-query
 * heads, head_dim a multiple of 32 (at most MAX_HEAD_DIM_BF16).
 *
 * Each kv head's keys are laid out once as the right-hand tiles of the scores (for sixteen keys
 * and 32 dimensions, sixteen rows of the keys' dimension pairs side by side) and its values as
 * those of the sums (for 32 keys and sixteen dimensions, sixteen rows of the dimensions' key
 * pairs). A task takes 32 queries of one head (two tiles of sixteen rows, read in place): their
 * scores against every key up to the last of them, 32 keys at a time in four float32 tiles;
 * then, row by row on the vector unit, the softmax over the keys up to each query (later ones
 * weigh 0), the weights rounded to bf16 as torch's bf16 attention does; then the weights times
 * the values, 32 dimensions at a time in four tiles, and each row scaled by its sum's
 * reciprocal and rounded to bf16. Tiles 0-3 hold sums, 4 and 5 the left-hand rows, 6 and 7 the
 * right-hand tiles. */
#define MAX_HEAD_DIM_BF16 256
#define AQ 32 /* queries a task: two tiles of 16 rows */
#define AK 32 /* keys a block: two tiles of 16 (scores), one tile's 16 pairs (sums) */
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
 * by scalef (0 below 2^-149). x must not be NaN or +inf; the kernel's are at most 0. */
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

/* One step's four products: left tiles 4 (rows 0-15) and 5 (rows 16-31) times right tiles 6
 * and 7 into sums 0, 1 (rows 0-15) and 2, 3 (rows 16-31). */
#define AMX_FOUR_PRODUCTS()      \
    do {                         \
        _tile_dpbf16ps(0, 4, 6); \
        _tile_dpbf16ps(1, 4, 7); \
        _tile_dpbf16ps(2, 5, 6); \
        _tile_dpbf16ps(3, 5, 7); \
    } while (0)

/* scores (AQ rows sld apart) of the 32 queries (q rows qld apart) against the keys of blocks
 * 0 .. blocks - 1: four float32 tiles a block of 32 keys, head_dim 32 at a time. */
static void score_block_bf16(const uint16_t *q, int64_t qld, const uint16_t *kt, int blocks,
                             int head_dim, float *scores, int64_t sld) {
    const int chunks = head_dim / 32;
    for (int b = 0; b < blocks; b++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < chunks; c++) {
            _tile_loadd(4, q + c * 32, qld * 2);
            _tile_loadd(5, q + 16 * qld + c * 32, qld * 2);
            _tile_loadd(6, kt + ((int64_t)(2 * b) * chunks + c) * TILE_U16, 64);
            _tile_loadd(7, kt + ((int64_t)(2 * b + 1) * chunks + c) * TILE_U16, 64);
            AMX_FOUR_PRODUCTS();
        }
        _tile_stored(0, scores + b * AK, sld * 4);
        _tile_stored(1, scores + b * AK + 16, sld * 4);
        _tile_stored(2, scores + 16 * sld + b * AK, sld * 4);
        _tile_stored(3, scores + 16 * sld + b * AK + 16, sld * 4);
    }
}

/* weights (bf16, AQ rows sld apart, blocks x AK keys each) = exp(scale (score - the row's
 * max)) over the keys up to each query i0 + i, 0 past it and on the padding rows past count;
 * inv[i] the reciprocal of row i's sum. */
static void softmax_weights_bf16(const float *scores, int i0, int count, int blocks,
                                 float scale, uint16_t *weights, int64_t sld, float *inv) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int i = 0; i < AQ; i++) {
        uint16_t *w = weights + i * sld;
        if (i >= count) { /* a padding row: weights 0 */
            memset(w, 0, sizeof(uint16_t) * (size_t)(blocks * AK));
            continue;
        }
        const float *s = scores + i * sld;
        const int last = i0 + i, full = (last + 1) / 16, vecs = last / 16 + 1;
        const v16i tail = lane + full * 16 <= last; /* the keys of the last, partial vector */
        __m512 top[4]; /* four running maxima: one would wait on the last one's result */
        for (int j = 0; j < 4; j++) top[j] = (__m512)splat16(-INFINITY);
        for (int b = 0; b < full; b++)
            top[b % 4] = _mm512_max_ps(top[b % 4], _mm512_loadu_ps(s + b * 16));
        if (full < vecs)
            top[0] = _mm512_max_ps(top[0], (__m512)select16(tail, load16(s + full * 16),
                                                            splat16(-INFINITY)));
        const float max = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
        /* e^(scale (s - max)) = 2^(s log2e scale - max log2e scale): one multiply-add a lane */
        const float log2_scale = scale * 1.4426950408889634f, shift = max * log2_scale;
        v16 sums = {0};
        for (int b = 0; b < full; b++) {
            v16 e = vexp2_weights(load16(s + b * 16) * log2_scale - shift);
            sums += e;
            store16_bf16(w + b * 16, e);
        }
        if (full < vecs) {
            v16 e = select16(tail, vexp2_weights(load16(s + full * 16) * log2_scale - shift),
                             splat16(0.0f));
            sums += e;
            store16_bf16(w + full * 16, e);
        }
        for (int b = vecs; b < blocks * 2; b++) store16_bf16(w + b * 16, splat16(0.0f));
        inv[i] = 1.0f / sum16(sums);
    }
}

/* out rows 0 .. count - 1 (old apart, bf16) = inv[i] x the weights times the values of blocks
 * 0 .. blocks - 1: four float32 tiles (32 rows, 32 dimensions) at a time. */
static void sum_values_bf16(const uint16_t *weights, int64_t sld, const uint16_t *vt,
                            int blocks, int head_dim, const float *inv, int count,
                            uint16_t *out, int64_t old) {
    const int slices = head_dim / 16;
    float acc[AQ * MAX_HEAD_DIM_BF16];
    for (int t = 0; t < slices; t += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < blocks; b++) {
            _tile_loadd(4, weights + b * AK, sld * 2);
            _tile_loadd(5, weights + 16 * sld + b * AK, sld * 2);
            _tile_loadd(6, vt + ((int64_t)b * slices + t) * TILE_U16, 64);
            _tile_loadd(7, vt + ((int64_t)b * slices + t + 1) * TILE_U16, 64);
            AMX_FOUR_PRODUCTS();
        }
        _tile_stored(0, acc + t * 16, head_dim * 4);
        _tile_stored(1, acc + t * 16 + 16, head_dim * 4);
        _tile_stored(2, acc + 16 * head_dim + t * 16, head_dim * 4);
        _tile_stored(3, acc + 16 * head_dim + t * 16 + 16, head_dim * 4);
    }
    for (int i = 0; i < count; i++)
        for (int d = 0; d < head_dim; d += 16)
            store16_bf16(out + i * old + d, load16(acc + i * head_dim + d) * inv[i]);
}

/* The 32 queries i0 .. i0 + 31 (count of them real, q rows qld apart, padded to 32) of one
 * head: out rows old apart. scores (AQ x sld floats) and weights (AQ x sld bf16) are the
 * task's buffers, sld at least the keys up to the last query rounded up to AK. */
static void attend_block_bf16(const uint16_t *q, int64_t qld, const uint16_t *kt,
                              const uint16_t *vt, int i0, int count, int head_dim, float scale,
                              float *scores, uint16_t *weights, int64_t sld, uint16_t *out,
                              int64_t old) {
    const int blocks = (i0 + count - 1) / AK + 1;
    float inv[AQ];
    score_block_bf16(q, qld, kt, blocks, head_dim, scores, sld);
    softmax_weights_bf16(scores, i0, count, blocks, scale, weights, sld, inv);
    sum_values_bf16(weights, sld, vt, blocks, head_dim, inv, count, out, old);
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
    /* the buffers' rows: + 16 lest rows a multiple of 4 KiB apart share the caches' sets */
    const int64_t sld = (int64_t)blocks * AK + 16;
    uint16_t *packed = malloc(sizeof(uint16_t) * (size_t)((kt_size + vt_size) * kv_heads));
    if (packed == NULL) return -2;
    uint16_t *kts = packed, *vts = packed + kt_size * kv_heads;
    for (int g = 0; g < kv_heads; g++) {
        pack_keys_bf16(k + g * kv_head, kv_token, n, head_dim, kts + g * kt_size);
        pack_values_bf16(v + g * kv_head, kv_token, n, head_dim, vts + g * vt_size);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int tile_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        float *scores = malloc(sizeof(float) * (size_t)(AQ * sld));
        uint16_t *weights = malloc(sizeof(uint16_t) * (size_t)(AQ * sld));
        uint16_t *pad = malloc(sizeof(uint16_t) * (size_t)(AQ * head_dim));
        if (scores == NULL || weights == NULL || pad == NULL) {
#pragma omp atomic write
            failed = 1;
        } else
            amx_load_config(tile_rows);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < (int64_t)heads * qblocks; task++) {
            if (scores == NULL || weights == NULL || pad == NULL) continue;
            const int h = (int)(task / qblocks), i0 = (int)(task % qblocks) * AQ;
            const int g = h / group, count = n - i0 < AQ ? n - i0 : AQ;
            const uint16_t *qs = q + h * q_head + (int64_t)i0 * q_token;
            int64_t qld = q_token;
            if (count < AQ) { /* the last block, filled up with zero queries */
                memset(pad, 0, sizeof(uint16_t) * (size_t)(AQ * head_dim));
                for (int i = 0; i < count; i++)
                    memcpy(pad + i * head_dim, qs + i * q_token, sizeof(uint16_t) * head_dim);
                qs = pad;
                qld = head_dim;
            }
            attend_block_bf16(qs, qld, kts + g * kt_size, vts + g * vt_size, i0, count,
                              head_dim, scale, scores, weights, sld,
                              out + ((int64_t)i0 * heads + h) * head_dim,
                              (int64_t)heads * head_dim);
        }
        if (scores != NULL && weights != NULL && pad != NULL) _tile_release();
        free(scores);
        free(weights);
        free(pad);
    }
    free(packed);
    return failed ? -2 : 0;
#else
    (void)q, (void)q_token, (void)q_head, (void)k, (void)v, (void)kv_token, (void)kv_head;
    (void)out, (void)scale, (void)threads;
    return -1;
#endif
}
