/* The library's self-test: every entry at one variant against a double-precision reference, on shapes
   whose edges are ragged (sizes that are not multiples of the vector width or the 16-row panel, row counts
   at and past each block), with a guard word after every output (a write past the end is a failure here,
   and a fault under -fsanitize=address). spec.cpu.native runs it in a subprocess before the library is
   used (a crash is a return code there); selftest_main.c runs it under the sanitizers and on other
   architectures. */
#include "half.h"
#include "spec_native.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GUARD 16
#define CANARY 12345.f

/* every allocation of a run, freed together at its end (a check that fails returns at once) */
static void *held[1 << 14];
static int nheld;
static void *alloc(size_t n) {
    void *p = calloc(n ? n : 1, 1);
    if (!p || nheld == (int)(sizeof held / sizeof held[0])) abort();
    return held[nheld++] = p;
}
static void release(void) {
    while (nheld) free(held[--nheld]);
}

static uint64_t rng_state;
static double uni(double lo, double hi) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}
static float *frand(int64_t n, double lo, double hi) {
    float *p = alloc(sizeof(float) * (size_t)(n + GUARD));
    for (int64_t i = 0; i < n; i++) p[i] = (float)uni(lo, hi);
    for (int i = 0; i < GUARD; i++) p[n + i] = CANARY;
    return p;
}
static float *out(int64_t n) { return frand(n, 0, 0); }    /* zeros and the guard */
static int overrun(const float *p, int64_t n) {
    for (int i = 0; i < GUARD; i++) if (p[n + i] != CANARY) return 1;
    return 0;
}

static char *msg_buf;
static size_t msg_len;
static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg_buf, msg_len, fmt, ap);
    va_end(ap);
    return 1;
}

/* ---- products ---- */
static int check_gemv(int isa, int threads) {
    /* (33, 6000): the panel kernel's rows in blocks of 12 from 13 rows on (X_FLOATS / K under 12) */
    static const int64_t NK[][2] = {{1, 1}, {15, 7}, {16, 16}, {17, 17}, {25, 33}, {33, 71}, {47, 130}, {33, 6000}};
    for (int64_t M = 1; M <= 13; M++)
        for (size_t c = 0; c < sizeof NK / sizeof NK[0]; c++) {
            const int64_t N = NK[c][0], K = NK[c][1], P = (N + 15) / 16;
            const int bias = (M + N + K) % 2 == 0;
            float *x = frand(M * K, -1, 1), *w = frand(N * K, -1, 1), *b = bias ? frand(N, -1, 1) : NULL;
            float *wp = out(P * 16 * K);
            for (int64_t n = 0; n < N; n++)
                for (int64_t k = 0; k < K; k++) wp[(n / 16) * 16 * K + k * 16 + n % 16] = w[n * K + k];
            for (int layout = 0; layout < 2; layout++) {
                float *y = out(M * N), *y1 = out(M * N);
                int (*f)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int, int) = layout ? spec_gemv_panel : spec_gemv_rows;
                const float *wl = layout ? wp : w;
                const int ran = f(x, wl, b, y, M, N, K, 64, 512, isa, threads);
                f(x, wl, b, y1, M, N, K, 64, 512, isa, 1);
                const char *name = layout ? "panel" : "rows";
                int want = spec_pick_isa(isa) > SPEC_ISA_AVX512 ? SPEC_ISA_AVX512 : spec_pick_isa(isa);
                int bad = 0;
                if (ran != want) bad = fail("gemv %s: variant %d asked, %d ran", name, want, ran);
                else if (overrun(y, M * N)) bad = fail("gemv %s M=%ld N=%ld K=%ld: wrote past y", name, M, N, K);
                else if (memcmp(y, y1, sizeof(float) * (size_t)(M * N)))
                    bad = fail("gemv %s M=%ld N=%ld K=%ld: %d threads differ from one", name, M, N, K, threads);
                for (int64_t m = 0; m < M && !bad; m++)
                    for (int64_t n = 0; n < N && !bad; n++) {
                        double s = bias ? b[n] : 0, a = bias ? fabs(b[n]) : 0;
                        for (int64_t k = 0; k < K; k++) {
                            s += (double)x[m * K + k] * w[n * K + k];
                            a += fabs((double)x[m * K + k] * w[n * K + k]);
                        }
                        if (!(fabs(y[m * N + n] - s) <= 1e-5 * a + 1e-30))
                            bad = fail("gemv %s isa %d threads %d M=%ld N=%ld K=%ld bias=%d: y[%ld,%ld] = %g, fp64 %g",
                                       name, isa, threads, M, N, K, bias, m, n, y[m * N + n], s);
                    }
                if (bad) return 1;
            }
        }
    return 0;
}

/* ---- the small ops ---- */
static int check_small(int isa) {
    static const int64_t RN[][2] = {{1, 1}, {2, 17}, {3, 64}, {2, 579}};
    for (size_t c = 0; c < 4; c++) {
        const int64_t rows = RN[c][0], n = RN[c][1];
        float *x = frand(rows * n, -2, 2), *w = frand(n, -2, 2), *y = out(rows * n);
        spec_rms(x, w, y, rows, n, 1e-5f);
        if (overrun(y, rows * n)) return fail("spec_rms rows=%ld n=%ld: wrote past y", rows, n);
        for (int64_t r = 0; r < rows; r++) {
            double ss = 0;
            for (int64_t i = 0; i < n; i++) ss += (double)x[r * n + i] * x[r * n + i];
            const double s = 1 / sqrt(ss / n + 1e-5);
            for (int64_t i = 0; i < n; i++) {
                const double want = w[i] * x[r * n + i] * s;
                if (!(fabs(y[r * n + i] - want) <= 1e-5 * fabs(want) + 1e-30))
                    return fail("spec_rms rows=%ld n=%ld: y[%ld,%ld] = %g, fp64 %g", rows, n, r, i, y[r * n + i], want);
            }
        }
    }
    static const int64_t RH[][4] = {{1, 1, 1, 2}, {2, 3, 4, 8}, {3, 5, 7, 64}};    /* rows, heads, of all, D */
    for (size_t c = 0; c < 3; c++) {
        const int64_t rows = RH[c][0], heads = RH[c][1], total = RH[c][2], D = RH[c][3], stride = total * D;
        float *x = frand(rows * stride, -2, 2), *cs = frand(rows * D, -1, 1), *sn = frand(rows * D, -1, 1);
        float *v = out(rows * stride);
        memcpy(v, x, sizeof(float) * (size_t)(rows * stride));
        spec_rotary(v, rows, heads, stride, D, cs, sn);
        if (overrun(v, rows * stride)) return fail("spec_rotary: wrote past x");
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < total; h++)
                for (int64_t i = 0; i < D; i++) {
                    const int64_t at = r * stride + h * D + i, half = D / 2;
                    const double rot = i < half ? -x[at + half] : x[at - half];
                    const double want = h < heads ? x[at] * (double)cs[r * D + i] + rot * sn[r * D + i] : x[at];
                    if (!(fabs(v[at] - want) <= 1e-6 * (fabs(x[at]) + fabs(rot)) + 1e-30))
                        return fail("spec_rotary rows=%ld heads=%ld: x[%ld,%ld,%ld] = %g, fp64 %g", rows, heads, r, h,
                                    i, v[at], want);
                }
    }
    static const int64_t RI[][2] = {{1, 1}, {2, 19}, {3, 64}, {2, 33}};
    for (size_t c = 0; c < 4; c++) {
        const int64_t rows = RI[c][0], inner = RI[c][1];
        float *gu = frand(rows * 2 * inner, -30, 30), *o = out(rows * inner);
        spec_silu_mul(gu, o, rows, inner, isa);
        if (overrun(o, rows * inner)) return fail("spec_silu_mul rows=%ld inner=%ld: wrote past out", rows, inner);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < inner; i++) {
                const double g = gu[r * 2 * inner + i], u = gu[r * 2 * inner + inner + i];
                const double want = g / (1 + exp(-g)) * u;
                if (!(fabs(o[r * inner + i] - want) <= 1e-5 * fabs(want) + 1e-30))
                    return fail("spec_silu_mul isa %d rows=%ld inner=%ld: out[%ld,%ld] = %g, fp64 %g", isa, rows,
                                inner, r, i, o[r * inner + i], want);
            }
    }
    return 0;
}

/* The draft cache's halves (half.h): every half to float and back is itself (a NaN comes back quiet); a float
   becomes the nearest half, a tie the even one, past the largest infinity; and where the CPU converts
   (AVX-512F: the cache's loads), its conversions are these, every half and random floats over the range */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static int hw_half(int isa) {
    if (isa < SPEC_ISA_AVX512) return 0;
    for (uint32_t h = 0; h < 65536; h += 16) {
        uint16_t in[16];
        float got[16];
        for (int i = 0; i < 16; i++) in[i] = (uint16_t)(h + (uint32_t)i);
        _mm512_storeu_ps(got, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)in)));
        for (int i = 0; i < 16; i++) {
            const float want = spec_h2f(in[i]);
            if (memcmp(&got[i], &want, 4) != 0 && !(isnan(got[i]) && isnan(want)))
                return fail("spec_h2f(0x%04x) = %g, the CPU's %g", in[i], want, got[i]);
        }
    }
    for (int t = 0; t < 4096; t++) {
        float x[16];
        uint16_t got[16];
        for (int i = 0; i < 16; i++) x[i] = (float)(uni(-1, 1) * pow(2.0, uni(-27, 17)));
        _mm256_storeu_si256((__m256i *)got, _mm512_cvtps_ph(_mm512_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT |
                                                                             _MM_FROUND_NO_EXC));
        for (int i = 0; i < 16; i++)
            if (spec_f2h(x[i]) != got[i])
                return fail("spec_f2h(%a) = 0x%04x, the CPU's 0x%04x", x[i], spec_f2h(x[i]), got[i]);
    }
    return 0;
}
#endif
static int check_half(int isa) {
    const uint64_t seed = rng_state;                  /* (the checks after it draw what they drew without it) */
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = spec_h2f((uint16_t)h);
        const uint16_t back = spec_f2h(f);
        if (isnan(f) ? back != (h | 0x200) : back != h)
            return fail("half 0x%04x: spec_h2f %a, back 0x%04x", h, f, back);
        if ((h & 0x7fff) < 0x7bff) {                  /* the tie between it and the next magnitude up: the even */
            const float mid = (float)(((double)f + spec_h2f((uint16_t)(h + 1))) / 2);
            if (spec_f2h(mid) != (h & 1 ? h + 1 : h))
                return fail("spec_f2h(%a), half way from half 0x%04x up: 0x%04x", mid, h, spec_f2h(mid));
        }
    }
    for (int t = 0; t < 100000; t++) {
        const float x = (float)(uni(-1, 1) * pow(2.0, uni(-27, 17)));
        const uint16_t h = spec_f2h(x);
        const double got = spec_h2f(h), e = fabs(got - x);
        if (!signbit(got) != !signbit(x) || (fabs(x) >= 65520) != !!isinf(got))
            return fail("spec_f2h(%a) = 0x%04x (%a): sign or range wrong", x, h, got);
        for (int k = -1; k <= 1 && !isinf(got); k += 2) {   /* no neighbour nearer */
            const uint16_t nb = (uint16_t)(h + k);
            if (((h & 0x7fff) == 0 && k < 0) || (nb & 0x7fff) >= 0x7c00) continue;
            const double en = fabs(spec_h2f(nb) - x);
            if (e > en || (e == en && (h & 1)))
                return fail("spec_f2h(%a) = 0x%04x (%a): half 0x%04x is nearer", x, h, got, nb);
        }
    }
#if defined(__x86_64__)
    const int rc = hw_half(isa);
#else
    const int rc = 0;
    (void)isa;
#endif
    rng_state = seed;
    return rc;
}

/* attention: head-major keys ([KV][L][D], as a DynamicCache) and position-major ones ([L][KV][D]); with a
   mask (row 0 masked out entirely: reported, not written) and without one (row t sees keys up to L - T + t);
   grouped heads; head sizes that are and are not multiples of 16; more rows than one pass of the blocked
   attention takes (a prefill: T = L), so that its keys are packed as later rows reach them */
static int check_attend(int isa, int threads) {
    static const int64_t C[][7] = {{1, 5, 2, 1, 16, 0, 0}, {3, 7, 4, 2, 32, 1, 0}, {4, 4, 2, 2, 16, 0, 1},
                                   {2, 9, 3, 1, 8, 0, 0}, {5, 40, 6, 2, 64, 0, 1}, {3, 6, 2, 1, 24, 1, 1},
                                   {40, 40, 6, 2, 64, 0, 0}, {20, 50, 3, 1, 32, 1, 0}, {60, 64, 2, 2, 16, 0, 1}};
    for (size_t c = 0; c < sizeof C / sizeof C[0]; c++) {
        const int64_t T = C[c][0], L = C[c][1], H = C[c][2], KV = C[c][3], D = C[c][4], masked = C[c][5];
        const int64_t kh = C[c][6] ? D : L * D, kt = C[c][6] ? KV * D : D;      /* position-major : head-major */
        float *q = frand(T * H * D, -1, 1), *k = frand(KV * L * D, -1, 1), *v = frand(KV * L * D, -1, 1);
        float *o = out(T * H * D);
        uint8_t *m = alloc((size_t)(T * L));
        for (int64_t i = 0; i < T * L; i++) m[i] = uni(0, 1) < 0.7;
        if (masked) { memset(m, 0, (size_t)L); m[L] = 1; }
        const int64_t got = spec_attend(q, H * D, D, k, v, kh, kt, L, masked ? m : NULL, o, T, H, KV, D, 0.25f, isa,
                                        threads);
        if (got != (masked ? H : 0))
            return fail("spec_attend T=%ld L=%ld D=%ld: %ld (row, head) pairs reported with no key, %ld expected",
                        T, L, D, got, masked ? H : 0);
        if (overrun(o, T * H * D)) return fail("spec_attend T=%ld L=%ld: wrote past out", T, L);
        for (int64_t t = masked ? 1 : 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t j = h / (H / KV);
                double sc[64], mx = -INFINITY, z = 0;
                for (int64_t l = 0; l < L; l++) {
                    const int live = masked ? m[t * L + l] : l <= L - T + t;
                    double s = 0;
                    for (int64_t d = 0; d < D; d++) s += 0.25 * q[(t * H + h) * D + d] * k[j * kh + l * kt + d];
                    sc[l] = live ? s : -INFINITY;
                    if (sc[l] > mx) mx = sc[l];
                }
                for (int64_t l = 0; l < L; l++) z += sc[l] = sc[l] == -INFINITY ? 0 : exp(sc[l] - mx);
                for (int64_t d = 0; d < D; d++) {
                    double want = 0;
                    for (int64_t l = 0; l < L; l++) want += sc[l] * v[j * kh + l * kt + d];
                    want /= z;
                    if (!(fabs(o[(t * H + h) * D + d] - want) <= 1e-5))
                        return fail("spec_attend isa %d T=%ld L=%ld D=%ld masked=%ld: out[%ld,%ld,%ld] = %g, fp64 %g",
                                    isa, T, L, D, masked, t, h, d, o[(t * H + h) * D + d], want);
                }
            }
    }
    return 0;
}

/* ---- the quantized draft ---- */
static uint16_t half_bits(double lo, double hi) {     /* a random normal fp16 in [lo, hi) by magnitude */
    const double a = uni(lo, hi);
    int e;
    const double f = frexp(a, &e);                     /* a = f 2^e, f in [0.5, 1) */
    const uint16_t mant = (uint16_t)((f * 2 - 1) * 1024);
    return (uint16_t)(((e - 1 + 15) << 10) | mant);
}
static double half_value(uint16_t h) { return ldexp(1 + (h & 1023) / 1024.0, ((h >> 10) & 31) - 15); }

/* a random [N][K] matrix of `kind` as records, and its weights (d u + m) in double */
static uint8_t *make_records(int kind, int64_t N, int64_t K, double *wf, int negative_m) {
    const int64_t B = K / 32, rs = kind == 4 ? 320 : 576, wb = kind == 4 ? 256 : 512;
    uint8_t *rec = alloc((size_t)(N / 16 * B * rs));
    for (int64_t p = 0; p < N / 16; p++)
        for (int64_t b = 0; b < B; b++) {
            uint8_t *r = rec + (p * B + b) * rs;
            uint16_t *dm = (uint16_t *)(r + wb);
            for (int j = 0; j < 16; j++) {
                const uint16_t d = half_bits(0.001, 0.02), m = half_bits(0.001, 0.1) | (negative_m ? 0x8000 : 0);
                dm[j] = d;
                dm[16 + j] = kind == 4 ? m : (uint16_t)(d + (7 << 10)) | 0x8000;      /* Q8_0: m = -128 d */
                const double dv = half_value(d), mv = kind == 4 ? -half_value(m & 0x7fff) * (negative_m ? 1 : -1)
                                                                : -128 * dv;
                for (int k = 0; k < 32; k++) {
                    const int u = (int)uni(0, kind == 4 ? 16 : 256);
                    if (kind == 8) r[64 * (k / 4) + 4 * j + k % 4] = (uint8_t)u;
                    else {
                        const int hi = k >= 16, kk = k - 16 * hi;
                        r[64 * (kk / 4) + 4 * j + kk % 4] |= (uint8_t)(hi ? u << 4 : u);
                    }
                    wf[(16 * p + j) * K + 32 * b + k] = dv * u + mv;
                }
            }
        }
    return rec;
}

static int check_qd_matvec(int isa, int threads) {
    static const int64_t NK[][2] = {{16, 32}, {48, 96}, {32, 576}, {80, 64}};
    for (int kind = 4; kind <= 8; kind += 4)
        for (size_t c = 0; c < 4; c++) {
            const int64_t N = NK[c][0], K = NK[c][1], B = K / 32;
            double *wf = alloc(sizeof(double) * (size_t)(N * K));
            uint8_t *rec = make_records(kind, N, K, wf, 1);
            for (int64_t R = 1; R <= 9; R++) {
                int8_t *xq = alloc((size_t)(R * K));
                float *xd = frand(R * B, 0, 0.05), *xs = out(R * B), *y = out(R * N), *y1 = out(R * N);
                for (int64_t i = 0; i < R * K; i++) xq[i] = (int8_t)(int)uni(-127, 128);
                for (int64_t r = 0; r < R; r++)
                    for (int64_t b = 0; b < B; b++) {
                        int s = 0;
                        for (int k = 0; k < 32; k++) s += xq[r * K + 32 * b + k];
                        xs[r * B + b] = xd[r * B + b] * (float)s;
                    }
                spec_qd_matvec(rec, kind, N, K, xq, xd, xs, R, y, isa, threads);
                spec_qd_matvec(rec, kind, N, K, xq, xd, xs, R, y1, isa, 1);
                if (overrun(y, R * N)) return fail("qd_matvec kind %d N=%ld K=%ld R=%ld: wrote past y", kind, N, K, R);
                if (memcmp(y, y1, sizeof(float) * (size_t)(R * N)))
                    return fail("qd_matvec kind %d N=%ld R=%ld: %d threads differ from one", kind, N, R, threads);
                for (int64_t r = 0; r < R; r++)
                    for (int64_t n = 0; n < N; n++) {
                        double s = 0, a = 0;
                        for (int64_t k = 0; k < K; k++) {
                            const double t = (double)xd[r * B + k / 32] * xq[r * K + k] * wf[n * K + k];
                            s += t;
                            a += fabs(t);
                        }
                        if (!(fabs(y[r * N + n] - s) <= 1e-5 * a + 1e-30))
                            return fail("qd_matvec isa %d kind %d N=%ld K=%ld R=%ld: y[%ld,%ld] = %g, fp64 %g", isa,
                                        kind, N, K, R, r, n, y[r * N + n], s);
                    }
            }
        }
    return 0;
}

/* The draft's forward against a double-precision forward of the same weights (activations unquantized:
   the bound is the int8 activations' error), fed as a prefill of 5, then 1, then 2 ids (the last slot of
   the cache), then one more (refused); and the same ids fed one at a time agree with the prefill. */
#define QD_D 32
#define QD_H 2
#define QD_KV 1
#define QD_HD 16
#define QD_F 64
#define QD_V 32
#define QD_CTX 40   /* three blocks of 16 keys, the last part-full */
#define QD_STEPS 8
typedef struct { double w[4][2 * QD_F * QD_F]; double embd[QD_V * QD_D]; } ref_model;

static void ref_rms(const double *x, double *y) {
    double ss = 0;
    for (int i = 0; i < QD_D; i++) ss += x[i] * x[i];
    for (int i = 0; i < QD_D; i++) y[i] = x[i] / sqrt(ss / QD_D + 1e-5);
}
static void ref_mv(const double *w, const double *x, double *y, int N, int K) {
    for (int n = 0; n < N; n++) { y[n] = 0; for (int k = 0; k < K; k++) y[n] += w[n * K + k] * x[k]; }
}
static void ref_forward(const ref_model *rm, const int32_t *ids, int n, double *logits) {
    enum { QKV = QD_D + 2 * QD_KV * QD_HD };
    static double kc[QD_CTX][QD_HD], vc[QD_CTX][QD_HD];
    for (int t = 0; t < n; t++) {
        double x[QD_D], h[QD_D], qkv[QKV], a[QD_D], o[QD_D], gu[2 * QD_F], g[QD_F];
        for (int i = 0; i < QD_D; i++) x[i] = rm->embd[ids[t] * QD_D + i];
        ref_rms(x, h);
        ref_mv(rm->w[0], h, qkv, QKV, QD_D);
        for (int hh = 0; hh < QD_H + QD_KV; hh++)
            for (int i = 0; i < QD_HD / 2; i++) {
                const double f = t * pow(10000.0, -2.0 * i / QD_HD), c = cos(f), s = sin(f);
                double *v = qkv + hh * QD_HD, lo = v[i], hi = v[i + QD_HD / 2];
                v[i] = lo * c - hi * s;
                v[i + QD_HD / 2] = hi * c + lo * s;
            }
        for (int d = 0; d < QD_HD; d++) {              /* the draft's cache holds halves */
            kc[t][d] = spec_h2f(spec_f2h((float)qkv[QD_D + d]));
            vc[t][d] = spec_h2f(spec_f2h((float)qkv[QD_D + QD_HD + d]));
        }
        for (int hh = 0; hh < QD_H; hh++) {
            double sc[QD_CTX], mx = -INFINITY, z = 0;
            for (int l = 0; l <= t; l++) {
                sc[l] = 0;
                for (int d = 0; d < QD_HD; d++) sc[l] += qkv[hh * QD_HD + d] * kc[l][d] / sqrt(QD_HD);
                if (sc[l] > mx) mx = sc[l];
            }
            for (int l = 0; l <= t; l++) z += sc[l] = exp(sc[l] - mx);
            for (int d = 0; d < QD_HD; d++) {
                a[hh * QD_HD + d] = 0;
                for (int l = 0; l <= t; l++) a[hh * QD_HD + d] += sc[l] / z * vc[l][d];
            }
        }
        ref_mv(rm->w[1], a, o, QD_D, QD_D);
        for (int i = 0; i < QD_D; i++) x[i] += o[i];
        ref_rms(x, h);
        ref_mv(rm->w[2], h, gu, 2 * QD_F, QD_D);
        for (int i = 0; i < QD_F; i++) g[i] = gu[i] / (1 + exp(-gu[i])) * gu[QD_F + i];
        ref_mv(rm->w[3], g, o, QD_D, QD_F);
        for (int i = 0; i < QD_D; i++) x[i] += o[i];
        ref_rms(x, h);
        if (t == n - 1) ref_mv(rm->embd, h, logits, QD_V, QD_D);
    }
}

static int check_qd_forward(int isa, int threads) {
    static ref_model rm;
    static const int64_t shape[4][2] = {{QD_D + 2 * QD_KV * QD_HD, QD_D}, {QD_D, QD_D}, {2 * QD_F, QD_D}, {QD_D, QD_F}};
    const uint8_t *mats[4];
    int64_t kinds[4] = {4, 4, 4, 8};
    for (int i = 0; i < 4; i++) mats[i] = make_records((int)kinds[i], shape[i][0], shape[i][1], rm.w[i], i % 2);
    uint8_t *embd = make_records(8, QD_V, QD_D, rm.embd, 0);
    float ones[QD_D];
    for (int i = 0; i < QD_D; i++) ones[i] = 1.f;
    const float *norms[2] = {ones, ones};
    enum { KC = SPEC_QD_BLOCKS(QD_CTX) * 16 * QD_KV * QD_HD / 2, VC = QD_CTX * QD_KV * QD_HD / 2 };  /* in floats */
    uint16_t *kc = (uint16_t *)out(KC), *vc = (uint16_t *)out(VC);
    spec_qd_model m = {1, QD_D, QD_H, QD_KV, QD_HD, QD_F, QD_V, QD_CTX, 1e-5f, 10000.f, embd, 8, embd, 8, ones,
                       norms, mats, kinds, kc, vc, isa, threads};
    const int32_t ids[QD_CTX + 1] = {1, 5, 3, 9, 2, 7, 30, 11, 4};
    static const int feeds[][2] = {{0, 5}, {5, 1}, {6, 2}, {8, 31}};
    float *logits = out(QD_V), *steps = out(QD_V);
    double want[QD_V];
    int rc = 0;
    for (int f = 0; f < 4 && !rc; f++) {
        if (spec_qd_forward(&m, ids + feeds[f][0], feeds[f][1], feeds[f][0], logits) != 0)
            rc = fail("qd_forward isa %d: refused positions %d..%d of a cache of %d", isa, feeds[f][0],
                      feeds[f][0] + feeds[f][1] - 1, QD_CTX);
        ref_forward(&rm, ids, feeds[f][0] + feeds[f][1], want);
        double scale = 0, err = 0;
        for (int i = 0; i < QD_V; i++) {
            scale = fmax(scale, fabs(want[i]));
            err = fmax(err, fabs(logits[i] - want[i]));
            if (!isfinite(logits[i])) err = INFINITY;
        }
        if (!rc && !(err <= 0.03 * scale)) rc = fail("qd_forward isa %d, after %d ids: logits off by %g (largest %g)",
                                                     isa, feeds[f][0] + feeds[f][1], err, scale);
    }
    if (!rc && spec_qd_forward(&m, ids + QD_CTX, 1, QD_CTX, logits) != -1)
        rc = fail("qd_forward isa %d: a position past the cache's last was not refused", isa);
    for (int t = 0; t < QD_STEPS && !rc; t++) spec_qd_forward(&m, ids + t, 1, t, steps);
    spec_qd_forward(&m, ids + 6, 2, 6, logits);
    for (int i = 0; i < QD_V && !rc; i++)
        if (!(fabs(steps[i] - logits[i]) <= 1e-3 * (fabs(logits[i]) + 1)))
            rc = fail("qd_forward isa %d: one id at a time gives %g, a block %g (logit %d)", isa, steps[i], logits[i], i);
    if (!rc && (overrun((float *)kc, KC) || overrun((float *)vc, VC) ||
                overrun(logits, QD_V)))
        rc = fail("qd_forward isa %d: wrote past the cache or the logits", isa);
    return rc;
}

int spec_selftest(int isa, int threads, char *msg, size_t len) {
    msg_buf = msg;
    msg_len = len;
    if (len) msg[0] = 0;
    rng_state = 0x9E3779B97F4A7C15ull;
    if (isa > spec_native_isa()) return fail("variant %d asked; this CPU runs %d at most", isa, spec_native_isa());
    const int rc = check_gemv(isa, threads) || check_small(isa) || check_half(isa) || check_attend(isa, threads) ||
                   check_qd_matvec(isa, threads) || check_qd_forward(isa, threads);
    release();
    return rc;
}
