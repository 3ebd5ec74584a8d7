/* A few rows against a weight in oneDNN's packed layout: y (M, N) = x (M, K) W^T, float32 or
 * bfloat16, for decode steps (M of at most 16 in float32, 32 in bf16).
 *
 * float32: oneDNN's packed weight (kernels/linear.py) holds W in panels of 64 output columns:
 * panel p is kp rows (K rounded up to 16, zero-padded), each row the 64 weights W[p*64 + j, k]
 * side by side; the panels follow one another, so the whole weight is one sequential stream.
 * A decode step's few rows read it once: each k row of a panel is four 16-float vectors,
 * multiplied by every x row's k-th value into four accumulators per row, summed in the order
 * k = 0, 1, ...
 *
 * bfloat16: panels of 32 output columns, kp rows (K rounded up to 32 or 64, zero-padded) taken
 * in pairs: pair i of panel p is the 32 columns' (W[c, 2i], W[c, 2i + 1]) side by side, the
 * layout of AMX's bf16 tile multiply, which reads 16 pairs of 16 columns as one tile. Each
 * panel's sums are up to four tiles (16 rows x 16 columns, float32; up to 32 rows a pass over
 * the weight), k taken 32 at a time in order; results are rounded to bf16 once, with the bias
 * added in float32 first (what oneDNN's AMX GEMM does: the same bits here). Only where the
 * compiler targets AMX and the kernel grants it (panel_gemm_bf16_native); elsewhere the call
 * is refused and oneDNN keeps the rows.
 *
 * float32 rows go through in blocks (their accumulators stay in registers); a second block
 * rereads the panel from cache, not memory. Both kernels prefetch the weight a few k steps
 * ahead of their multiplies (PREFETCH_ROWS, AMX_PREFETCH): the CPU's own prefetcher alone
 * left a stream read with a few rows of work per byte short of the memory's bandwidth
 * (docs/cpu-speed.md). Columns past N in the last panel are computed from the padding and not
 * stored. OpenMP splits the panels when threads > 1. Used by
 * kernels/cpu_panel_gemm.c (the calls on their own) and kernels/cpu_decode_layers.c (a fused
 * decode's GEMMs).
 */
#ifndef PDSERVE_NATIVE_PANEL_H
#define PDSERVE_NATIVE_PANEL_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_amx.h"
#include "native_vec.h"

#define PANEL 64 /* float32 panel width */
#define PREFETCH_ROWS 16 /* k rows of a float32 panel (256 bytes each) read ahead */
#define ROW_BLOCK 6 /* rows whose 4 x 6 accumulators stay in registers (7 spill) */

/* rows (<= ROW_BLOCK, a constant once inlined) of x against one panel: out (rows, 64) */
static inline __attribute__((always_inline)) void panel_rows(
    const float *x, int64_t ldx, const float *panel, int64_t k, float *out, const int rows) {
    v16 acc[ROW_BLOCK][4];
#pragma GCC unroll 6
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        const float *w = panel + i * PANEL;
        const char *ahead = (const char *)(w + PREFETCH_ROWS * PANEL);
        for (int line = 0; line < PANEL * 4; line += 64) __builtin_prefetch(ahead + line, 0, 3);
        v16 w0 = in_register(load16(w)), w1 = in_register(load16(w + 16));
        v16 w2 = in_register(load16(w + 32)), w3 = in_register(load16(w + 48));
#pragma GCC unroll 6
        for (int m = 0; m < rows; m++) {
            float a = x[m * ldx + i];
            acc[m][0] += w0 * a;
            acc[m][1] += w1 * a;
            acc[m][2] += w2 * a;
            acc[m][3] += w3 * a;
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < rows; m++)
        memcpy(out + m * PANEL, acc[m], sizeof acc[m]);
}

static void panel_block(const float *x, int64_t ldx, const float *panel, int64_t k,
                        float *out, int rows) {
    switch (rows) {
    case 1: panel_rows(x, ldx, panel, k, out, 1); break;
    case 2: panel_rows(x, ldx, panel, k, out, 2); break;
    case 3: panel_rows(x, ldx, panel, k, out, 3); break;
    case 4: panel_rows(x, ldx, panel, k, out, 4); break;
    case 5: panel_rows(x, ldx, panel, k, out, 5); break;
    default: panel_rows(x, ldx, panel, k, out, 6); break;
    }
}

/* y (m, n) row stride ldy = x (m, k) row stride ldx times the packed weight (kp rows a panel,
 * kp >= k); bias (n) or NULL. Returns 0, or -1 for a shape it does not take. */
static int panel_gemm_f32_run(const float *x, int64_t ldx, const float *packed, int64_t kp,
                              const float *bias, float *y, int64_t ldy, int64_t m, int64_t n,
                              int64_t k, int threads) {
    if (m < 1 || n < 1 || k < 1 || kp < k || ldx < k || ldy < n) return -1;
    int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * kp * PANEL;
        int64_t col = p * PANEL, cols = n - col < PANEL ? n - col : PANEL;
        float out[ROW_BLOCK * PANEL];
        for (int64_t r = 0; r < m; r += ROW_BLOCK) {
            int rows = m - r < ROW_BLOCK ? (int)(m - r) : ROW_BLOCK;
            panel_block(x + r * ldx, ldx, panel, k, out, rows);
            for (int i = 0; i < rows; i++) {
                float *dst = y + (r + i) * ldy + col;
                for (int64_t j = 0; j < cols; j++)
                    dst[j] = out[i * PANEL + j] + (bias ? bias[col + j] : 0.0f);
            }
        }
    }
    return 0;
}

#define PANEL_BF16 32 /* bfloat16 panel width */

#if HAVE_AMX_BF16
#define PANEL_BF16_AMX 1
#define AMX_K 32 /* k values a tile multiply takes: one A tile row of 64 bytes */
#define AMX_ROWS 32 /* rows one pass over the weight takes: two tiles of 16 */
#define AMX_PREFETCH 4 /* k steps of a bf16 panel (2 KiB each) read ahead */

/* Tiles 0-3: the sums of a panel (rows 0-15 of its two halves of 16 columns, then rows
   16-31); 4 and 5: rows 0-15 and 16-31 of x, 32 k values each; 6 and 7: 16 pairs of k of the
   panel's two halves. rows: 1-32. */
static void amx_configure(int rows) {
    const int first = rows < 16 ? rows : 16, second = rows - first;
    const int tile_rows[8] = {first, first, second, second, first, second, AMX_K / 2,
                              AMX_K / 2};
    amx_load_config(tile_rows);
}

/* rows (<= 32, as configured) of x, kp columns (zero past k), against one panel: out (rows,
   32) float32 sums, k in order 32 at a time; the panel is read once for all the rows */
static inline void panel_rows_amx(const uint16_t *x, const uint16_t *panel, int64_t kp,
                                  int rows, float *out) {
    const int two = rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t i = 0; i < kp; i += AMX_K) {
        const uint16_t *w = panel + i * PANEL_BF16; /* pair i / 2 */
        const char *ahead = (const char *)(w + AMX_PREFETCH * AMX_K * PANEL_BF16);
        for (int line = 0; line < AMX_K * PANEL_BF16 * 2; line += 64)
            __builtin_prefetch(ahead + line, 0, 3);
        _tile_loadd(6, w, PANEL_BF16 * 4);
        _tile_loadd(7, w + PANEL_BF16, PANEL_BF16 * 4);
        _tile_loadd(4, x + i, kp * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * kp + i, kp * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, PANEL_BF16 * 4);
    _tile_stored(1, out + 16, PANEL_BF16 * 4);
    if (two) {
        _tile_stored(2, out + 16 * PANEL_BF16, PANEL_BF16 * 4);
        _tile_stored(3, out + 16 * PANEL_BF16 + 16, PANEL_BF16 * 4);
    }
}

/* y rows r .. r + block - 1 of one panel p from its sums out (block, 32), bias added, rounded */
static inline void store_panel_bf16(const float *out, const uint16_t *bias, uint16_t *y,
                                    int64_t ldy, int64_t block, int64_t col, int64_t cols) {
    for (int64_t i = 0; i < block; i++)
        for (int64_t j = 0; j < cols; j++)
            y[i * ldy + col + j] = float_to_bf16(
                out[i * PANEL_BF16 + j] + (bias ? bf16_to_float(bias[col + j]) : 0.0f));
}
#else
#define PANEL_BF16_AMX 0
#define AMX_K 32
#endif

/* The bfloat16 GEMM on AMX: y (m, n) bf16, row stride ldy = x (m, k) bf16, row stride ldx,
 * times the packed weight (kp rows a panel, kp >= k, a multiple of 32); bias (n) bf16 or NULL.
 * x is copied with its rows padded to kp (zeros past k), 32 rows at a time (a pass over the
 * weight: two tiles of 16 rows). Returns 0; -1 for a shape it does not take or a CPU or
 * process without AMX; -2 out of memory. */
static int panel_gemm_bf16_run(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                               int64_t kp, const uint16_t *bias, uint16_t *y, int64_t ldy,
                               int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n < 1 || k < 1 || kp < k || kp % AMX_K || ldx < k || ldy < n
            || !amx_permitted())
        return -1;
#if PANEL_BF16_AMX
    const int64_t panels = (n + PANEL_BF16 - 1) / PANEL_BF16;
    uint16_t *xp = calloc((size_t)(m < AMX_ROWS ? m : AMX_ROWS) * kp, 2);
    if (xp == NULL) return -2;
    for (int64_t r = 0; r < m; r += AMX_ROWS) {
        const int64_t block = m - r < AMX_ROWS ? m - r : AMX_ROWS;
        for (int64_t i = 0; i < block; i++) memcpy(xp + i * kp, x + (r + i) * ldx, k * 2);
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float out[AMX_ROWS * PANEL_BF16];
            amx_configure((int)block); /* each thread's tiles, released when it is done */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t col = p * PANEL_BF16;
                panel_rows_amx(xp, packed + p * kp * PANEL_BF16, kp, (int)block, out);
                store_panel_bf16(out, bias, y + r * ldy, ldy, block, col,
                                 n - col < PANEL_BF16 ? n - col : PANEL_BF16);
            }
            _tile_release();
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)threads;
    return -1;
#endif
}

/* Either GEMM by the weight's type (bf16 = 1: bfloat16 x, weight, bias and y). */
static inline int panel_gemm_run(const void *x, int64_t ldx, const void *packed, int64_t kp,
                                 const void *bias, void *y, int64_t ldy, int64_t m, int64_t n,
                                 int64_t k, int bf16, int threads) {
    if (bf16)
        return panel_gemm_bf16_run(x, ldx, packed, kp, bias, y, ldy, m, n, k, threads);
    return panel_gemm_f32_run(x, ldx, packed, kp, bias, y, ldy, m, n, k, threads);
}

#endif
