/* A few rows against a packed weight as calls of their own: native_panel.h holds the kernels
 * and says what they compute. */
#include "native_panel.h"

int panel_gemm_f32(const float *x, int64_t ldx, const float *packed, int64_t kp,
                   const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                   int threads) {
    return panel_gemm_f32_run(x, ldx, packed, kp, bias, y, ldy, m, n, k, threads);
}

int panel_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, int64_t kp,
                    const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n,
                    int64_t k, int threads) {
    return panel_gemm_bf16_run(x, ldx, packed, kp, bias, y, ldy, m, n, k, threads);
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

/* Whether the bfloat16 GEMM runs here (the compiler targets AMX and the kernel grants this
 * process its tiles): 1 or 0. */
int panel_gemm_bf16_native(void) { return PANEL_BF16_AMX && amx_permitted(); }

/* Whether packed (nbytes) holds w (n, k, row-major, bf16) in the bf16 pair layout of
 * native_panel.h, kp = nbytes / (panels x 32 x 2 bytes) rows a panel (a multiple of 32),
 * padding zero: 1 yes, 0 no. */
int panel_layout_matches_bf16(const uint16_t *w, int64_t n, int64_t k, const uint16_t *packed,
                              int64_t nbytes) {
    int64_t panels = (n + PANEL_BF16 - 1) / PANEL_BF16;
    if (nbytes % (panels * PANEL_BF16 * 2)) return 0;
    int64_t kp = nbytes / (panels * PANEL_BF16 * 2);
    if (kp < k || kp % AMX_K) return 0;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kp; i++)
            for (int64_t j = 0; j < PANEL_BF16; j++) {
                int64_t row = p * PANEL_BF16 + j;
                uint16_t want = row < n && i < k ? w[row * k + i] : 0;
                if (packed[((p * kp + i - i % 2) * PANEL_BF16 + 2 * j) + i % 2] != want) return 0;
            }
    return 1;
}
