/* What the AMX kernels share (gemm_amx.c, mla_amx.c): the target attribute they are compiled with, whatever
   -march says (called only where amx_on()), the one tile configuration they all use, a 16 x 16 transpose in
   registers, the float -> bfloat16 pair rounding and per-thread scratch. Included only under WD_AMX. */
#ifndef WIDEEP_AMX_H
#define WIDEEP_AMX_H

#include <immintrin.h>
#include <stdlib.h>

#include "wideep.h"

#define AMXF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

/* Tile loads, stores and the configuration as asm that tells the compiler what memory it touches. GCC 12's
   intrinsics do not: _tile_loadconfig declares 8 of the config's 64 bytes as read (the stores to the rest were
   dropped as dead in a test build: tilezero then raised SIGILL), and _tile_loadd / _tile_stored declare no memory
   at all, so the stores that pack a tile's operand, or the loads that read a stored tile, could be moved across
   them. */
#define TILE_LOAD(T, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"((int64_t)(stride)) : "memory")
#define TILE_STORE(T, base, stride) \
    __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(base), "r"((int64_t)(stride)) : "memory")

/* The 2 x 2 block of sums the kernels run: tiles 0-3 zeroed, then each K step (32 values) adds tile 0 += A0 B0,
   1 += A1 B0, 2 += A0 B1, 3 += A1 B1, with the A tiles (4, 5) loaded from a0, a1 (16 rows sa bytes apart) and the B
   tiles (6, 7) from b0, b1 (packed: 64 bytes a row). two_a / two_b false: the second A / B tile and its sums
   skipped. */
#define TILES_ZERO4()   \
    do {                \
        _tile_zero(0);  \
        _tile_zero(1);  \
        _tile_zero(2);  \
        _tile_zero(3);  \
    } while (0)
#define TILE_STEP(a0, a1, sa, b0, b1, two_a, two_b) \
    do {                                            \
        TILE_LOAD(4, a0, sa);                       \
        TILE_LOAD(6, b0, 64);                       \
        _tile_dpbf16ps(0, 4, 6);                    \
        if (two_a) {                                \
            TILE_LOAD(5, a1, sa);                   \
            _tile_dpbf16ps(1, 5, 6);                \
        }                                           \
        if (two_b) {                                \
            TILE_LOAD(7, b1, 64);                   \
            _tile_dpbf16ps(2, 4, 7);                \
            if (two_a) _tile_dpbf16ps(3, 5, 7);     \
        }                                           \
    } while (0)

/* the tile configuration: palette 1, all 8 tiles 16 rows x 64 bytes. Loaded at the start of every kernel and
   released at its end (_tile_release): oneDNN, in the same thread, configures its own at each of its calls. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static inline AMXF void tiles_on(void) {
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

/* 16 x 16 32-bit elements, r[i] row i, transposed in registers (three rounds of shuffles) */
static inline AMXF void tr16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* tile TILE's 16 x 16 sums stored through c (1 KiB, 64-byte aligned) and read back transposed: r[j] = column j */
#define TILE_TR(TILE, c, r)                                                \
    do {                                                                   \
        TILE_STORE(TILE, c, 64);                                           \
        for (int i_ = 0; i_ < 16; i_++) (r)[i_] = _mm512_load_si512((c) + 16 * i_); \
        tr16(r);                                                           \
    } while (0)

/* 32 floats at p as 32 bfloat16 (16 pairs), rounded to nearest even */
static inline AMXF __m512i bf32(const float *p) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

/* this thread's scratch number `which` (0: the GEMM's, 1: the MLA decode's, 2: the routed expert's) of at least n
   bfloat16, 64-byte aligned, kept between calls; NULL when out of memory */
static inline uint16_t *amx_scratch(int which, int64_t n) {
    static __thread uint16_t *buf[3];
    static __thread int64_t cap[3];
    if (n > cap[which]) {
        free(buf[which]);
        cap[which] = n;
        buf[which] = aligned_alloc(64, (size_t)((n * 2 + 63) & ~(int64_t)63));
        if (!buf[which]) cap[which] = 0;
    }
    return buf[which];
}

#endif
