/* The streamed small-batch GEMM's body, included by gemm.c once per weight dtype (a C template): WT is the
   weight element type, LDW(p) / LDW_PART(p, n) load 16 weights (the first n < 16) as floats, SFX(name) names
   this instance's functions. The activations are float32 in every instance. Why the loops are shaped so:
   gemm.c. */

/* the lines WD_PF_AHEAD bytes past a step of 32 weights (wideep.h says why) */
#if WD_PF_AHEAD > 0
#define PF_AHEAD(p)                                                                                \
    do {                                                                                           \
        const char *pf_ = (const char *)(p) + WD_PF_AHEAD;                                         \
        for (int l_ = 0; l_ < (int)(32 * sizeof(WT)); l_ += 64)                                    \
            __builtin_prefetch(pf_ + l_, 0, WD_PF_HINT);                                           \
    } while (0)
#else
#define PF_AHEAD(p) ((void)0)
#endif

/* part[j] (16 lanes whose sum is x[j] . wr) for MB rows of x. Two accumulators per row halve the FMA
   dependency chains (one row of x too: its weights then stream ~13 % faster, measured A/B; four
   accumulators stream slower). Features past the last multiple of 16: one zero-padded step. */
#define ROW(MB)                                                                                    \
static inline void SFX(row_##MB)(const float *x, int64_t ldx, const WT *wr, int64_t K, v16 *part) { \
    v16 a[MB], b[MB];                                                                              \
    for (int j = 0; j < MB; j++) a[j] = b[j] = bc(0);                                              \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    for (; k + 32 <= K16; k += 32) {                                                               \
        PF_AHEAD(wr + k);                                                                          \
        v16 w0 = LDW(wr + k), w1 = LDW(wr + k + 16);                                               \
        for (int j = 0; j < MB; j++) {                                                             \
            a[j] += w0 * ld(x + j * ldx + k);                                                      \
            b[j] += w1 * ld(x + j * ldx + k + 16);                                                 \
        }                                                                                          \
    }                                                                                              \
    for (; k < K16; k += 16) {                                                                     \
        v16 w0 = LDW(wr + k);                                                                      \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld(x + j * ldx + k);                             \
    }                                                                                              \
    if (k < K) {                                                                                   \
        v16 w0 = LDW_PART(wr + k, K - k);                                                          \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld_part(x + j * ldx + k, K - k);                 \
    }                                                                                              \
    for (int j = 0; j < MB; j++) part[j] = a[j] + b[j];                                            \
}
ROW(1) ROW(2) ROW(4) ROW(8)
#undef ROW

/* the partial sums of all m rows of x (m <= MCHUNK) against one row of w, in blocks of 8, 4, 2, 1 */
static inline void SFX(row_all)(const float *x, int64_t ldx, int64_t m, const WT *wr, int64_t K, v16 *part) {
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) SFX(row_8)(x + j * ldx, ldx, wr, K, part + j);
    if (j + 4 <= m) { SFX(row_4)(x + j * ldx, ldx, wr, K, part + j); j += 4; }
    if (j + 2 <= m) { SFX(row_2)(x + j * ldx, ldx, wr, K, part + j); j += 2; }
    if (j < m) SFX(row_1)(x + j * ldx, ldx, wr, K, part + j);
}

/* Four or more rows of x: blocks of 4 rows of w x MB rows of x share every load (gemm.c says why). */
#define BLOCK4_STEP(MB, LDX, LDWV)                                                                 \
        {                                                                                          \
            v16 w0 = LDWV(w + k), w1 = LDWV(w + ldw + k), w2 = LDWV(w + 2 * ldw + k),              \
                w3 = LDWV(w + 3 * ldw + k);                                                        \
            KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                \
            for (int j = 0; j < MB; j++) {                                                         \
                v16 xv = LDX(x + j * ldx + k);                                                     \
                KEEP(xv);                                                                          \
                acc[j][0] += w0 * xv; acc[j][1] += w1 * xv; acc[j][2] += w2 * xv; acc[j][3] += w3 * xv; \
            }                                                                                      \
        }
#define LDX_FULL(p) ld(p)
#define LDX_TAIL(p) ld_part(p, K - k)
#define LDW_FULL(p) LDW(p)
#define LDW_TAIL(p) LDW_PART(p, K - k)
#define BLOCK4(MB)                                                                                 \
static void SFX(block4_##MB)(const float *x, int64_t ldx, const WT *w, int64_t ldw, float *y,      \
                             int64_t ldy, int64_t K, int pf) {                                     \
    v16 acc[MB][4];                                                                                \
    for (int j = 0; j < MB; j++) for (int r = 0; r < 4; r++) acc[j][r] = bc(0);                    \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    if (pf)                                                                                        \
        for (; k < K16; k += 16) {                                                                 \
            for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k, 0, 2);                \
            BLOCK4_STEP(MB, LDX_FULL, LDW_FULL)                                                    \
        }                                                                                          \
    else                                                                                           \
        for (; k < K16; k += 16) BLOCK4_STEP(MB, LDX_FULL, LDW_FULL)                               \
    if (k < K) BLOCK4_STEP(MB, LDX_TAIL, LDW_TAIL)                                                 \
    for (int j = 0; j < MB; j++) {                                                                 \
        v16 s = reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);                               \
        for (int r = 0; r < 4; r++) y[j * ldy + r] = s[4 * r];                                     \
    }                                                                                              \
}
BLOCK4(2) BLOCK4(3) BLOCK4(4)
#undef BLOCK4
#undef BLOCK4_STEP
#undef LDX_FULL
#undef LDX_TAIL
#undef LDW_FULL
#undef LDW_TAIL

/* y [M, N] (rows ldy apart) = x [M, K] @ w [N, K]^T: gemm.c's linear, for weights of type WT */
static void SFX(linear)(const float *x, int64_t ldx, const WT *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                        int64_t N, int64_t K) {
    v16 part[4][MCHUNK];
    int64_t n4 = N & ~(int64_t)3;
    if (M >= 4) {
        for (int64_t n = 0; n < n4; n += 4)
            for (int64_t m = 0; m < M;) {
                /* blocks of 4 rows of x; five left: 3 + 2 (a block of one reads 4 weight rows for 4 FMAs) */
                int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
                const float *xm = x + m * ldx;
                const WT *wn = w + n * ldw;
                float *ym = y + m * ldy + n;
                switch (mb) {
                    case 2: SFX(block4_2)(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    case 3: SFX(block4_3)(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    default: SFX(block4_4)(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N);
                }
                m += mb;
            }
    } else {
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) SFX(row_all)(x, ldx, M, w + (n + r) * ldw, K, part[r]);
            for (int64_t j = 0; j < M; j++) {
                v16 s = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = s[4 * r];
            }
        }
    }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            int64_t m = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            SFX(row_all)(x + m0 * ldx, ldx, m, w + n * ldw, K, part[0]);
            for (int64_t j = 0; j < m; j++) {
                float t = 0;
                for (int l = 0; l < 16; l++) t += part[0][j][l];
                y[(m0 + j) * ldy + n] = t;
            }
        }
}
