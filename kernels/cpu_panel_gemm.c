/* A few rows against a weight in oneDNN's packed panel layout: y (M, N) = x (M, K) W^T.
 *
 * The packed weight (kernels/linear.py) holds W in panels of 64 output columns: panel p is
 * kp rows (K rounded up to 16, zero-padded), each row the 64 weights W[p*64 + j, k] side by
 * side; the panels follow one another, so the whole weight is one sequential stream. A decode
 * step's few rows read it once: each k row of a panel is four 16-float vectors, multiplied by
 * every x row's k-th value into four accumulators per row, summed in the order k = 0, 1, ...
 *
 * Rows go through in blocks of at most ROW_BLOCK (their accumulators stay in registers); a
 * second block rereads the panel from cache, not memory. Columns past N in the last panel are
 * computed from the padding and not stored. OpenMP splits the panels when threads > 1.
 */

#include <stdint.h>
#include <string.h>

#include "native_vec.h"

#define PANEL 64
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
int panel_gemm_f32(const float *x, int64_t ldx, const float *packed, int64_t kp,
                   const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                   int threads) {
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

/* Whether a block of rows keeps its accumulators in registers on the CPU this was built for:
 * ROW_BLOCK x 4 vectors of 16 floats and the panel row's 4 need AVX-512's 32 registers; with
 * AVX2's 16 (a vector of 16 floats takes two) or NEON's they spill to memory on every k. */
int panel_gemm_rows_in_registers(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Whether packed (nbytes) holds w (n, k, row-major) in the panel layout above, kp = k rounded
 * up to 16, padding zero: 1 yes, 0 no. Checked once per weight before the kernel reads it. */
int panel_layout_matches(const float *w, int64_t n, int64_t k, const float *packed,
                         int64_t nbytes) {
    int64_t kp = (k + 15) / 16 * 16, panels = (n + PANEL - 1) / PANEL;
    if (nbytes != panels * kp * PANEL * (int64_t)sizeof(float)) return 0;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kp; i++)
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t row = p * PANEL + j;
                float want = row < n && i < k ? w[row * k + i] : 0.0f;
                float got = packed[(p * kp + i) * PANEL + j];
                if (memcmp(&want, &got, sizeof want) != 0) return 0;
            }
    return 1;
}
