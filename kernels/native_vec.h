/* Vectors of 16 floats for pdserve's C kernels (GCC vector extensions: one AVX-512 register,
 * two AVX2 ones or four NEON ones, whatever -march=native offers), unaligned loads and stores,
 * a horizontal sum and exp. kernels/native_build.py hashes this header into every kernel's
 * build key. */
#ifndef PDSERVE_NATIVE_VEC_H
#define PDSERVE_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }
static inline v16 splat16(float x) { return (v16){0} + x; }

/* bfloat16: a float's upper 16 bits. Widening is exact; narrowing rounds to nearest, ties to
 * even, as torch does (a NaN stays a NaN). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* sixteen bf16 values as 32-bit lanes, each in its lane's low half */
#if defined(__AVX512F__)
#include <immintrin.h>
/* one widening move: GCC splits __builtin_convertvector's into 128-bit pieces here */
static inline v16u widen16(v16h h) { return (v16u)_mm512_cvtepu16_epi32((__m256i)h); }
#else
static inline v16u widen16(v16h h) { return __builtin_convertvector(h, v16u); }
#endif

static inline v16 load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16)(widen16(h) << 16);
}

#if defined(__AVX512BF16__)
/* AVX512-BF16 rounds sixteen floats to bf16 in one instruction, to nearest, ties to even, as
 * the bit arithmetic below does, but for subnormal floats (|x| < 1.2e-38), which it reads as
 * zero: activations never hold them; one instruction where the arithmetic takes eight */
#include <immintrin.h>

static inline v16h to_bf16(v16 x) { return (v16h)_mm512_cvtneps_pbh((__m512)x); }
#else
/* x's bits rounded to the nearest bf16 (in the upper 16 bits; the lower ones are zero) */
static inline v16u round_bits_bf16(v16 x) {
    v16u bits = (v16u)x;
    v16u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    v16u nan = (v16u)(x != x);
    return ((nan & (bits | 0x00400000u)) & 0xFFFF0000u) | (~nan & rounded);
}

static inline v16h to_bf16(v16 x) {
    return __builtin_convertvector(round_bits_bf16(x) >> 16, v16h);
}
#endif

/* x rounded to bf16 precision, kept as floats */
static inline v16 round16_bf16(v16 x) {
    return (v16)(widen16(to_bf16(x)) << 16);
}

static inline void store16_bf16(uint16_t *p, v16 x) {
    v16h h = to_bf16(x);
    memcpy(p, &h, sizeof h);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return (uint16_t)((bits | 0x00400000u) >> 16);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

/* Element i of an array of float32 (bf16 = 0) or bfloat16 (bf16 = 1) values, read as floats
 * (16 of them, or one) or written from floats. Kernels pass bf16 as a constant wherever these
 * are inlined, so the test folds away and one source serves both types. */
static inline __attribute__((always_inline)) v16 loadx16(const void *p, int64_t i, int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)p + i) : load16((const float *)p + i);
}
static inline __attribute__((always_inline)) float loadx1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline __attribute__((always_inline)) void storex16(void *p, int64_t i, v16 x, int bf16) {
    if (bf16)
        store16_bf16((uint16_t *)p + i, x);
    else
        store16((float *)p + i, x);
}
static inline __attribute__((always_inline)) void storex1(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(x);
    else
        ((float *)p)[i] = x;
}
static inline const char *addressx(const void *p, int64_t i, int bf16) {
    return (const char *)p + i * (bf16 ? 2 : 4);
}

/* x, loaded once and kept in a register: without this the compiler folds a vector's load into
 * every multiply-add that uses it, reading it from cache again each time, and a loop that
 * uses one loaded vector for several accumulators is then bound by its loads, not its
 * multiply-adds. (An empty asm the compiler cannot see through; no instruction.) */
static inline v16 in_register(v16 x) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(x));
#elif defined(__AVX__)
    /* without AVX-512 a v16 lives in two AVX registers: pin each half */
    v8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    __asm__("" : "+x"(lo), "+x"(hi));
    x = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    return x;
}

static inline float sum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v8 c = a + b;
    v4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
    return (d[0] + d[2]) + (d[1] + d[3]);
}

/* lanes of a where mask (all ones) is set, b elsewhere */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    return (v16)((mask & (v16i)a) | (~mask & (v16i)b));
}

/* e^x lane by lane, within ~2 ulp of expf: x = n ln2 + f with |f| <= ln2 / 2 (ln2 in two
 * parts, Cody and Waite), e^f by a degree-5 minimax polynomial (Cephes' expf), 2^n by building
 * the float's exponent bits (as 2 * 2^(n-1), so n = 128 still overflows to inf). Below -87.3,
 * where e^x is subnormal, it gives 0; above ~88.72 inf; NaN stays NaN. */
static inline v16 vexp16(v16 x) {
    const v16 lo = splat16(-87.3f), hi = splat16(88.8f);
    v16 c = select16(x < lo, lo, x);
    c = select16(c > hi, hi, c);
    const v16 round = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (c * 1.44269504088896341f + round) - round;
    v16 f = c - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = splat16(1.9875691500e-4f);
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * (f * f) + f + 1.0f;
    v16i half_scale = (__builtin_convertvector(n, v16i) + 126) << 23;
    return select16(x < lo, splat16(0.0f), (p * 2.0f) * (v16)half_scale);
}

#endif
