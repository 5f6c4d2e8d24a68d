/* The few-row fp32 product for CPU linears, y[M, N] = x[M, K] W[N, K]^T (+ b).

   Two layouts of w, both computing y[m*N + n] = sum_k x[m*K + k] * w[n][k] (+ b[n]):
   rows:  w as nn.Linear stores it, [N][K], read in place;
   panel: w reordered once, [ceil(N/16)][K][16] (16 rows interleaved k by k, the last panel zero-padded),
          each 64-byte line one zmm of 16 outputs FMA'd against up to 12 rows of x broadcast from L1, the
          accumulators in registers, the panel streamed once (spec.cpu.gemv makes the copies).
   Variants: AVX-512F, AVX2+FMA, plain C (isa 2, 1, 0; the VNNI level runs the AVX-512F code here). */
#include "spec_native.h"

#include <math.h>
#include <stdlib.h>

static void rows_c(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N,
                   int64_t K, int64_t n0) {
    for (int64_t n = n0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            const float *wn = w + n * K, *xm = x + m * K;
            float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int j = 0; j < 8; j++) s[j] += xm[k + j] * wn[k + j];
            float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            for (; k < K; k++) t += xm[k] * wn[k];
            y[m * N + n] = b ? t + b[n] : t;
        }
}

/* panel, plain C: columns n0..n1 (multiples of 16, n1 cut at N), every row, no bias */
static void panel_c(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                    int64_t n1) {
    for (; n0 < n1; n0 += 16) {
        const float *p = wp + n0 * K;
        int64_t w = N - n0 < 16 ? N - n0 : 16;
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0};
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < 16; j++) acc[j] += x[m * K + k] * p[k * 16 + j];
            for (int64_t j = 0; j < w; j++) y[m * N + n0 + j] = acc[j];
        }
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#include "vexp.h"
#define T256 __attribute__((target("avx2,fma")))
#define INL static inline __attribute__((always_inline))

/* rows, AVX-512: one row of w at a time (one sequential stream) against MB rows of x */
INL T512 void rows512_blk(const float *x, const float *wn, float *out, int64_t N, int64_t K, const int MB,
                          int64_t PF) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (PF) _mm_prefetch((const char *)(wn + k + PF), _MM_HINT_T0);
        __m512 wv = _mm512_loadu_ps(wn + k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv = _mm512_maskz_loadu_ps(mask, wn + k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) out[m * N] = _mm512_reduce_add_ps(acc[m]);
}

#define ROWS512(MB) static T512 void rows512_##MB(const float *x, const float *w, float *y, int64_t N, int64_t K, \
                                                  int64_t PF) {                                                 \
    for (int64_t n = 0; n < N; n++) rows512_blk(x, w + n * K, y + n, N, K, MB, PF); }
ROWS512(1) ROWS512(2) ROWS512(3) ROWS512(4) ROWS512(5) ROWS512(6) ROWS512(7) ROWS512(8)
static void (*const rows512[9])(const float *, const float *, float *, int64_t, int64_t, int64_t) =
    {0, rows512_1, rows512_2, rows512_3, rows512_4, rows512_5, rows512_6, rows512_7, rows512_8};

INL T256 void rows256_blk(const float *x, const float *wn, float *out, int64_t N, int64_t K, const int MB,
                          int64_t PF) {
    __m256 acc[4];
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (PF && !(k & 15)) _mm_prefetch((const char *)(wn + k + PF), _MM_HINT_T0);
        __m256 wv = _mm256_loadu_ps(wn + k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        float t = _mm_cvtss_f32(_mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1)));
        for (int64_t j = k; j < K; j++) t += wn[j] * x[m * K + j];
        out[m * N] = t;
    }
}

#define ROWS256(MB) static T256 void rows256_##MB(const float *x, const float *w, float *y, int64_t N, int64_t K, \
                                                  int64_t PF) {                                                 \
    for (int64_t n = 0; n < N; n++) rows256_blk(x, w + n * K, y + n, N, K, MB, PF); }
ROWS256(1) ROWS256(2) ROWS256(3) ROWS256(4)
static void (*const rows256[5])(const float *, const float *, float *, int64_t, int64_t, int64_t) =
    {0, rows256_1, rows256_2, rows256_3, rows256_4};

/* panel, AVX-512: a panel's 16 rows are one zmm per k; MB rows of x, U chains of k per row so that at
   least 4 FMAs are in flight; the x values broadcast from L1. Software prefetch: PF floats ahead into L1
   (one line per U lines), FAR floats ahead into L2 (every line); 0 none. */
INL T512 void panel512_blk(const float *x, const float *p, float *out, int64_t N, int64_t K, int64_t w,
                           const int MB, const int U, int64_t PF, int64_t FAR) {
    __m512 acc[12][4];
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        if (PF) _mm_prefetch((const char *)(p + k * 16 + PF), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            if (FAR) _mm_prefetch((const char *)(p + (k + u) * 16 + FAR), _MM_HINT_T1);
            __m512 wv = _mm512_loadu_ps(p + (k + u) * 16);
#pragma GCC unroll 12
            for (int m = 0; m < MB; m++) acc[m][u] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * K + k + u]), acc[m][u]);
        }
    }
    for (; k < K; k++) {
        __m512 wv = _mm512_loadu_ps(p + k * 16);
#pragma GCC unroll 12
        for (int m = 0; m < MB; m++) acc[m][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * K + k]), acc[m][0]);
    }
    __mmask16 mask = (__mmask16)(w >= 16 ? 0xFFFF : (1u << w) - 1);
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][u]);
        _mm512_mask_storeu_ps(out + m * N, mask, acc[m][0]);
    }
}

#define PANEL512(MB, U) static T512 void panel512_##MB(const float *x, const float *wp, float *y, int64_t N, \
                                                       int64_t K, int64_t PF, int64_t FAR, int64_t n0,     \
                                                       int64_t n1) {                                       \
    for (int64_t n = n0; n < n1; n += 16) panel512_blk(x, wp + n * K, y + n, N, K, N - n, MB, U, PF, FAR); }
PANEL512(1, 4) PANEL512(2, 2) PANEL512(3, 2) PANEL512(4, 1) PANEL512(5, 1) PANEL512(6, 1) PANEL512(7, 1)
PANEL512(8, 1) PANEL512(9, 1) PANEL512(10, 1) PANEL512(11, 1) PANEL512(12, 1)
static void (*const panel512[13])(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, int64_t) =
    {0, panel512_1, panel512_2, panel512_3, panel512_4, panel512_5, panel512_6, panel512_7, panel512_8,
     panel512_9, panel512_10, panel512_11, panel512_12};

/* panel, AVX2: two ymm per k (one line); PF, FAR as for AVX-512 */
INL T256 void panel256_blk(const float *x, const float *p, float *out, int64_t N, int64_t K, int64_t w,
                           const int MB, int64_t PF, int64_t FAR) {
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (PF) _mm_prefetch((const char *)(p + k * 16 + PF), _MM_HINT_T0);
        if (FAR) _mm_prefetch((const char *)(p + k * 16 + FAR), _MM_HINT_T1);
        __m256 a = _mm256_loadu_ps(p + k * 16), c = _mm256_loadu_ps(p + k * 16 + 8);
#pragma GCC unroll 6
        for (int m = 0; m < MB; m++) {
            __m256 xv = _mm256_broadcast_ss(x + m * K + k);
            lo[m] = _mm256_fmadd_ps(a, xv, lo[m]);
            hi[m] = _mm256_fmadd_ps(c, xv, hi[m]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) {
        if (w >= 16) {
            _mm256_storeu_ps(out + m * N, lo[m]);
            _mm256_storeu_ps(out + m * N + 8, hi[m]);
        } else {
            float t[16];
            _mm256_storeu_ps(t, lo[m]);
            _mm256_storeu_ps(t + 8, hi[m]);
            for (int64_t j = 0; j < w; j++) out[m * N + j] = t[j];
        }
    }
}

#define PANEL256(MB) static T256 void panel256_##MB(const float *x, const float *wp, float *y, int64_t N, \
                                                    int64_t K, int64_t PF, int64_t FAR, int64_t n0,     \
                                                    int64_t n1) {                                       \
    for (int64_t n = n0; n < n1; n += 16) panel256_blk(x, wp + n * K, y + n, N, K, N - n, MB, PF, FAR); }
PANEL256(1) PANEL256(2) PANEL256(3) PANEL256(4) PANEL256(5) PANEL256(6)
static void (*const panel256[7])(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, int64_t) =
    {0, panel256_1, panel256_2, panel256_3, panel256_4, panel256_5, panel256_6};
#endif

/* the variant of the products: the asked one, at most AVX-512F */
static int pick(int isa) {
    isa = spec_pick_isa(isa);
    return isa > SPEC_ISA_AVX512 ? SPEC_ISA_AVX512 : isa;
}

static void add_bias(float *y, const float *b, int64_t M, int64_t N, int64_t n0, int64_t n1) {   /* columns n0..n1 */
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) y[m * N + n] += b[n];
}

/* w [N][K] in place; PF floats ahead into L1 (< 0: none); FAR unused (the panel entry's signature).
   Returns the isa used. */
int spec_gemv_rows(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                   int64_t PF, int64_t FAR, int isa, int threads) {
    (void)FAR;
    (void)threads;
    isa = pick(isa);
    if (PF < 0) PF = 0;
#ifdef HAVE_X86
    if (isa > 0) {
        int most = isa == 2 ? 8 : 4;
        for (int64_t m = 0; m < M; ) {
            int64_t mb = M - m < most ? M - m : most;
            (isa == 2 ? rows512 : rows256)[mb](x + m * K, w, y + m * N, N, K, m == 0 ? PF : 0);
            m += mb;
        }
        if (b) add_bias(y, b, M, N, 0, N);
        return isa;
    }
#endif
    rows_c(x, w, b, y, M, N, K, 0);
    return 0;
}

/* wp [ceil(N/16)][K][16]. isa -1 (auto): on an AVX-512F CPU, 1 or 2 rows run the AVX2+FMA code (measured
   faster there on Zen 4) and more the AVX-512F code. PF (floats ahead into L1), FAR (into L2) < 0: the
   kernel's choice, measured on Zen 4: none for the AVX2 code; for the AVX-512F code FAR 8192 (about one
   panel of K = 576 ahead) from FAR_ROWS rows on, where the FMAs bound the pass and the core's own window
   runs too few lines ahead of them, none below (the stream bounds it there, and the far prefetch cost
   0.1-0.3 more); PF 512 with a far prefetch, 1024 without. FAR 0 and PF -1: the kernel before the far
   prefetch. Returns the isa used. */
#define FAR_ROWS 7
#define X_FLOATS 65536   /* a block of x rows the panels run against, at most (256 KB: in L2) */
typedef struct { const float *x, *wp, *b; float *y; int64_t M, N, K, PF, FAR; int isa; } panel_job;

/* One part of a product: the columns of panels P*part/parts .. P*(part+1)/parts (P = ceil(N/16)), every
   row. Each column's sums run in the same order whatever the split: the result does not depend on it. */
static void panel_part(void *arg, int part, int parts) {
    const panel_job *j = (const panel_job *)arg;
    int64_t P = (j->N + 15) / 16, n0 = P * part / parts * 16, n1 = P * (part + 1) / parts * 16;
    if (n1 > j->N) n1 = j->N;
    if (n0 >= n1) return;
#ifdef HAVE_X86
    if (j->isa > 0) {
        const int64_t most = j->isa == 2 ? 12 : 6, K = j->K;
        void (*const *kernel)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t) = j->isa == 2 ? panel512 : panel256;
        if (j->M <= most) {          /* one turn over the panels */
            kernel[j->M](j->x, j->wp, j->y, j->N, K, j->PF, j->FAR, n0, n1);
        } else {
            /* more rows (a prefill): blocks of rows whose x stays in L2 (X_FLOATS), and within a block each
               panel, read from memory once, run against every turn of `most` rows from L1 and L2 */
            int64_t block = X_FLOATS / K / most * most;
            if (block < most) block = most;
            for (int64_t m0 = 0; m0 < j->M; m0 += block) {
                const int64_t m1 = j->M - m0 < block ? j->M : m0 + block;
                for (int64_t n = n0; n < n1; n += 16) {
                    const int64_t e = n + 16 < n1 ? n + 16 : n1;
                    for (int64_t m = m0; m < m1; m += most) {
                        const int64_t mb = m1 - m < most ? m1 - m : most;
                        kernel[mb](j->x + m * K, j->wp, j->y + m * j->N, j->N, K, m == m0 ? j->PF : 0,
                                   m == m0 ? j->FAR : 0, n, e);
                    }
                }
            }
        }
    } else
#endif
        panel_c(j->x, j->wp, j->y, j->M, j->N, j->K, n0, n1);
    if (j->b) add_bias(j->y, j->b, j->M, j->N, n0, n1);
}

/* wp [ceil(N/16)][K][16]. isa -1 (auto): on an AVX-512F CPU, 1 or 2 rows run the AVX2+FMA code (measured
   faster there on Zen 4) and more the AVX-512F code. PF (floats ahead into L1), FAR (into L2) < 0: the
   kernel's choice, measured on Zen 4: none for the AVX2 code; for the AVX-512F code FAR 8192 (about one
   panel of K = 576 ahead) from FAR_ROWS rows on, where the FMAs bound the pass and the core's own window
   runs too few lines ahead of them, none below (the stream bounds it there, and the far prefetch cost
   0.1-0.3 more); PF 512 with a far prefetch, 1024 without. FAR 0 and PF -1: the kernel before the far
   prefetch. The panels are split over `threads` threads (the plain-C code: one). Returns the isa
   used. */
int spec_gemv_panel(const float *x, const float *wp, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                    int64_t PF, int64_t FAR, int isa, int threads) {
    int automatic = isa < 0;
    isa = pick(isa);
#ifdef HAVE_X86
    if (automatic && isa == 2 && M <= 2) isa = 1;
    if (FAR < 0) FAR = isa == 2 && M >= FAR_ROWS ? 8192 : 0;
    if (PF < 0) PF = isa == 2 ? (FAR ? 512 : 1024) : 0;
#else
    (void)automatic;
#endif
    panel_job j = {x, wp, b, y, M, N, K, PF, FAR, isa};
    pool_run(panel_part, &j, (int)((N + 15) / 16), threads);
    return isa;
}

