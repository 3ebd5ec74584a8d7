/* AMX for pdserve's bf16 kernels: whether this process may use the tile registers, and their
 * configuration. HAVE_AMX_BF16 is 1 where the compiler targets AMX's tiles and bf16 multiply
 * (-march=native on a CPU that has them), else 0 and amx_permitted() says no. Used by
 * native_panel.h (the GEMMs) and cpu_causal_attention.c (bf16 prompts). */
#ifndef PDSERVE_NATIVE_AMX_H
#define PDSERVE_NATIVE_AMX_H
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_BF16 1

/* Whether this process may use AMX's tile registers (Linux grants them on request, once). */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-7 configured as rows[t] rows of 64 bytes each (0: the tile is unused), for the
 * calling thread until it calls _tile_release(). */
static inline void amx_load_config(const int rows[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.bytes_per_row[t] = rows[t] ? 64 : 0;
        cfg.rows[t] = (uint8_t)rows[t];
    }
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX_BF16 0
static inline int amx_permitted(void) { return 0; }
#endif

#endif
