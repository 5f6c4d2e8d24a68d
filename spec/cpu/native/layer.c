/* A Llama layer's small ops, written once for the fp32 target's plain layers (spec.cpu.plainllama) and
   the quantized draft's forward (qdraft.c): RMSNorm, rotary (rotate-half), attention over a cache, the
   SiLU gate. In transformers' arithmetic: the library is built without FMA contraction, so each product
   and sum rounds as torch's; the 16-lane sums and the vector exponential differ from torch's by fp32
   rounding only (the probe checks the plain layers against the model's own forward). */
#include "half.h"
#include "spec_native.h"
#include "vexp.h"

#include <math.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>

/* query rows a pass of the blocked attention takes together: its scores, ROWS x keys floats, stay in L2 */
#define SPEC_ATTEND_ROWS 48

/* RMSNorm over rows of n: y = w (x / sqrt(mean(x^2) + eps)); the sum of squares runs in 16 lanes (torch's
   own order differs: fp32 rounding apart). */
void spec_rms(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float acc[16] = {0}, ss = 0.f;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += xr[i + j] * xr[i + j];
        for (int j = 0; j < 16; j++) ss += acc[j];
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float s = 1.f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) y[r * n + i] = w[i] * (xr[i] * s);
    }
}

/* Rotary embedding, rotate-half form, in place on the first `heads` heads of D of each row (rows `stride`
   floats apart), cos and sin [rows][D]: v*cos + rotate_half(v)*sin as transformers computes it. */
void spec_rotary(float *x, int64_t rows, int64_t heads, int64_t stride, int64_t D, const float *cos,
                 const float *sin) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                const float lo_c = a * c[i], lo_s = -b * s[i], hi_c = b * c[i + half], hi_s = a * s[i + half];
                v[i] = lo_c + lo_s;
                v[i + half] = hi_c + hi_s;
            }
        }
    }
}

/* One query row's attention over keys 0 .. n-1 (key l at k + l kt, its value at v + l kt; m: a mask row,
   nonzero may attend, or NULL), s scratch of n floats: softmax(scale q.k) v into o. Returns 0 where no key
   may be attended (o unwritten). Plain C: */
static int attend_row_c(const float *qv, const float *k, const float *v, int64_t kt, int64_t n, const uint8_t *m,
                        float *o, int64_t D, float scale, float *s) {
    float mx = -INFINITY, z = 0.f;
    for (int64_t l = 0; l < n; l++) {
        float a = 0.f;
        for (int64_t d = 0; d < D; d++) a += qv[d] * scale * k[l * kt + d];
        s[l] = m && !m[l] ? -INFINITY : a;
        if (s[l] > mx) mx = s[l];
    }
    if (mx == -INFINITY) return 0;
    for (int64_t l = 0; l < n; l++) z += s[l] = s[l] == -INFINITY ? 0.f : expf(s[l] - mx);
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
    for (int64_t l = 0; l < n; l++)
        for (int64_t d = 0; d < D; d++) o[d] += s[l] * v[l * kt + d];
    for (int64_t d = 0; d < D; d++) o[d] *= 1.f / z;
    return 1;
}

/* spec_attend_blocked, plain C: the same sums in the same order as the AVX-512 code's lanes */
static void attend_blocked_c(const float *q, int64_t G, int64_t D, const uint16_t *kb, const uint16_t *v, int64_t vt,
                             int64_t n, float *s, int64_t ss, float *o) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * ss, mx = -INFINITY, z = 0;
        for (int64_t p = 0; p < n; p++) {
            const uint16_t *k = kb + (p / 16) * 16 * D + p % 16;
            float a = 0;
            for (int64_t d = 0; d < D; d++) a += q[g * D + d] * spec_h2f(k[d * 16]);
            sg[p] = a;
            if (a > mx) mx = a;
        }
        for (int64_t p = 0; p < n; p++) z += sg[p] = expf(sg[p] - mx);
        for (int64_t d = 0; d < D; d++) o[g * D + d] = 0;
        for (int64_t p = 0; p < n; p++)
            for (int64_t d = 0; d < D; d++) o[g * D + d] += sg[p] * spec_h2f(v[p * vt + d]);
        for (int64_t d = 0; d < D; d++) o[g * D + d] *= 1.f / z;
    }
}

#if defined(__x86_64__)
/* v[i] = e^(v[i] - mx) for i < n (-inf: exactly 0), 16 lanes at a time; returns their sum */
static T512 float exp_shift512(float *v, int64_t n, float mx) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(k, v + i);
        const __mmask16 live = k & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(v + i, k, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

/* o[i] = silu(g[i]) u[i] = g[i] / (1 + e^-g[i]) u[i], 16 lanes at a time; returns the i done (the rest: the
   caller's, in scalar code) */
static T512 int64_t silu_mul512(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                        exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    return i;
}

/* 16 lanes from element i of a cache of floats or (half) of IEEE halves */
static inline __attribute__((always_inline)) T512 __m512 load16(const void *p, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* NB blocks of 16 keys from block b scored for GG heads: one FMA chain per head and key along d (keys: floats, or
   halves where `half`); each broadcast of q feeds the NB blocks' FMAs */
static inline __attribute__((always_inline)) T512 void scores_turn512(const void *kb, int64_t D, const float *q,
                                                                     int64_t b, float *s, int64_t ss, const int GG,
                                                                     const int half, const int NB) {
    __m512 acc[2][8];
#pragma GCC unroll 2
    for (int k = 0; k < NB; k++)
#pragma GCC unroll 8
        for (int g = 0; g < GG; g++) acc[k][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 kv[2];
#pragma GCC unroll 2
        for (int k = 0; k < NB; k++) kv[k] = load16(kb, ((b + k) * D + d) * 16, half);
#pragma GCC unroll 8
        for (int g = 0; g < GG; g++) {
            const __m512 qg = _mm512_set1_ps(q[g * D + d]);
#pragma GCC unroll 2
            for (int k = 0; k < NB; k++) acc[k][g] = _mm512_fmadd_ps(qg, kv[k], acc[k][g]);
        }
    }
#pragma GCC unroll 2
    for (int k = 0; k < NB; k++)
#pragma GCC unroll 8
        for (int g = 0; g < GG; g++) _mm512_storeu_ps(s + g * ss + (b + k) * 16, acc[k][g]);
}

/* The blocked attention's scores for GG heads over the first n keys (whole blocks of 16), two blocks a turn */
static inline __attribute__((always_inline)) T512 void blocked_scores512(const void *kb, int64_t D, const float *q,
                                                                        int64_t n, float *s, int64_t ss, const int GG,
                                                                        const int half) {
    int64_t b = 0;
    for (; (b + 1) * 16 < n; b += 2) scores_turn512(kb, D, q, b, s, ss, GG, half, 2);
    if (b * 16 < n) scores_turn512(kb, D, q, b, s, ss, GG, half, 1);
}

/* The blocked attention's values for GG heads: each value row read once for them, 4 lines at a time */
static inline __attribute__((always_inline)) T512 void blocked_values512(const void *v, int64_t vt, int64_t D,
                                                                        int64_t n, const float *s, int64_t ss,
                                                                        const float *z, float *o, const int GG,
                                                                        const int half) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        const int C = D - c0 >= 64 ? 4 : (int)((D - c0) / 16);
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < n; p++) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                if (c >= C) break;
                const __m512 x = load16(v, p * vt + c0 + 16 * c, half);
#pragma GCC unroll 4
                for (int g = 0; g < GG; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * ss + p]), x, acc[g][c]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++)
                _mm512_storeu_ps(o + g * D + c0 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(1.f / z[g])));
    }
}

/* blocked_scores512 over R query rows, 8 at a time: s[r * ss + p] for the first n keys (whole blocks) */
static inline __attribute__((always_inline)) T512 void blocked_scores_rows512(const void *kb, int64_t D, const float *q,
                                                                             int64_t R, int64_t n, float *s,
                                                                             int64_t ss, const int half) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const float *qr = q + r0 * D;
        float *sr = s + r0 * ss;
        switch (R - r0 < 8 ? R - r0 : 8) {
            case 1: blocked_scores512(kb, D, qr, n, sr, ss, 1, half); break;
            case 2: blocked_scores512(kb, D, qr, n, sr, ss, 2, half); break;
            case 3: blocked_scores512(kb, D, qr, n, sr, ss, 3, half); break;
            case 4: blocked_scores512(kb, D, qr, n, sr, ss, 4, half); break;
            case 5: blocked_scores512(kb, D, qr, n, sr, ss, 5, half); break;
            case 6: blocked_scores512(kb, D, qr, n, sr, ss, 6, half); break;
            case 7: blocked_scores512(kb, D, qr, n, sr, ss, 7, half); break;
            default: blocked_scores512(kb, D, qr, n, sr, ss, 8, half); break;
        }
    }
}

/* blocked_values512 over R rows, 4 at a time: o[r * D ..] = sum_p s[r * ss + p] v_p / z[r] */
static inline __attribute__((always_inline)) T512 void blocked_values_rows512(const void *v, int64_t vt, int64_t D,
                                                                             int64_t R, int64_t n, const float *s,
                                                                             int64_t ss, const float *z, float *o,
                                                                             const int half) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const float *sr = s + r0 * ss, *zr = z + r0;
        float *orow = o + r0 * D;
        switch (R - r0 < 4 ? R - r0 : 4) {
            case 1: blocked_values512(v, vt, D, n, sr, ss, zr, orow, 1, half); break;
            case 2: blocked_values512(v, vt, D, n, sr, ss, zr, orow, 2, half); break;
            case 3: blocked_values512(v, vt, D, n, sr, ss, zr, orow, 3, half); break;
            default: blocked_values512(v, vt, D, n, sr, ss, zr, orow, 4, half); break;
        }
    }
}

static T512 void attend_blocked512(const float *q, int64_t G, int64_t D, const uint16_t *kb, const uint16_t *v,
                                   int64_t vt, int64_t n, float *s, int64_t ss, float *o) {
    float z[SPEC_ATTEND_ROWS];
    for (int64_t g0 = 0; g0 < G; g0 += SPEC_ATTEND_ROWS) {
        const int64_t R = G - g0 < SPEC_ATTEND_ROWS ? G - g0 : SPEC_ATTEND_ROWS;
        blocked_scores_rows512(kb, D, q + g0 * D, R, n, s, ss, 1);
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * ss, mx = -INFINITY;
            for (int64_t p = 0; p < n; p++) mx = sr[p] > mx ? sr[p] : mx;
            z[r] = exp_shift512(sr, n, mx);
        }
        blocked_values_rows512(v, vt, D, R, n, s, ss, z, o + g0 * D, 1);
    }
}

/* A 16 x 16 tile of floats transposed in registers: r[i][j] becomes r[j][i] */
static inline __attribute__((always_inline)) T512 void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {                  /* pairs of rows interleaved: a0 b0 a1 b1 | a4 b4 .. */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {                  /* u[i + c]'s 128-bit lane l: column 4l + c of rows i..i+3 */
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)                    /* t[h + c]: columns c, c + 8 of rows h..h+7 (c < 4), */
        for (int c = 0; c < 4; c++) {                  /* t[h + 4 + c]: columns 4 + c, 12 + c */
            t[h + c] = _mm512_shuffle_f32x4(u[h + c], u[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_f32x4(u[h + c], u[h + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; c++) {                      /* column c from rows 0-7 and 8-15, likewise c + 8 */
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[c + 8] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    }
}

/* The first n keys of one head (key l at k + l kt, D floats) into blocks of 16 positions, d-major (as
   spec_attend_blocked reads them); the last block's missing keys are zeros. */
static T512 void pack_keys512(const float *k, int64_t kt, int64_t n, int64_t D, float *kb) {
    for (int64_t b = 0; b * 16 < n; b++) {
        const int64_t w = n - b * 16 < 16 ? n - b * 16 : 16;
        float *dst = kb + b * 16 * D;
        for (int64_t c = 0; c < D; c += 16) {
            __m512 r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = i < w ? _mm512_loadu_ps(k + (b * 16 + i) * kt + c) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t i = 0; i < 16; i++) _mm512_storeu_ps(dst + (c + i) * 16, r[i]);
        }
    }
}

/* A row's scores past its last visible key (see .. n) set to -inf; returns their maximum over 0 .. n */
static T512 float causal_max512(float *sr, int64_t see, int64_t n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t p = 0; p < n; p += 16) {
        const __mmask16 in = n - p >= 16 ? 0xFFFF : (__mmask16)((1u << (n - p)) - 1);
        const __mmask16 hid = in & _mm512_cmpge_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32((int)(p - see))),
                                                           _mm512_setzero_si512());
        if (hid) _mm512_mask_storeu_ps(sr + p, hid, _mm512_set1_ps(-INFINITY));
        mx = _mm512_mask_max_ps(mx, in & ~hid, _mm512_maskz_loadu_ps(in, sr + p), mx);   /* (a NaN score passed over, as the scalar max does) */
    }
    return _mm512_reduce_max_ps(mx);
}

/* A row's scores where its mask is zero set to -inf; returns their maximum over 0 .. n */
static float masked_max(float *sr, const uint8_t *m, int64_t n) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        if (!m[p]) sr[p] = -INFINITY;
        mx = sr[p] > mx ? sr[p] : mx;
    }
    return mx;
}

/* spec_attend on AVX-512F (D a multiple of 16 up to 256), key heads j0 .. j1: each key head's keys packed once
   (pack_keys512), then the rows of its G query heads at up to SPEC_ATTEND_ROWS / G positions at a time
   scored, masked, put through the softmax and summed over the values together, so that each key and value
   is read once per block of rows, not once per (row, head). w: scratch (attend_part's). */
static T512 int64_t attend_heads512(const float *q, int64_t qt, int64_t qh, const float *k, const float *v,
                                    int64_t kh, int64_t kt, int64_t L, const uint8_t *mask, float *out, int64_t T,
                                    int64_t H, int64_t KV, int64_t D, float scale, int64_t j0, int64_t j1, float *w) {
    const int64_t G = H / KV, P = G < SPEC_ATTEND_ROWS ? SPEC_ATTEND_ROWS / G : 1, ss = (L + 15) / 16 * 16;
    float *kb = w, *s = kb + ss * D, *qs = s + P * G * ss, *o = qs + P * G * D, *z = o + P * G * D;
    int64_t empty = 0;
    for (int64_t j = j0; j < j1; j++) {
        int64_t packed = 0;
        for (int64_t t0 = 0; t0 < T; t0 += P) {
            const int64_t tb = T - t0 < P ? T - t0 : P, R = tb * G, n = mask ? L : L - T + t0 + tb;
            if (n > packed) {                          /* keys up to n, packed as the rows reach them */
                const int64_t from = packed / 16 * 16;     /* (a part-filled block again, whole) */
                pack_keys512(k + j * kh + from * kt, kt, n - from, D, kb + from * D);
                packed = n;
            }
            for (int64_t r = 0; r < R; r++)
                for (int64_t d = 0; d < D; d++)
                    qs[r * D + d] = q[(t0 + r / G) * qt + (j * G + r % G) * qh + d] * scale;
            blocked_scores_rows512(kb, D, qs, R, n, s, ss, 0);
            for (int64_t r = 0; r < R; r++) {
                const int64_t t = t0 + r / G, see = mask ? L : L - T + t + 1;
                const uint8_t *m = mask ? mask + t * L : NULL;
                float *sr = s + r * ss, mx = m ? masked_max(sr, m, n) : causal_max512(sr, see, n);
                if (mx == -INFINITY) {                 /* no key: reported, left unwritten */
                    for (int64_t p = 0; p < n; p++) sr[p] = 0.f;
                    z[r] = 0.f;
                    empty++;
                    continue;
                }
                z[r] = exp_shift512(sr, n, mx);
            }
            blocked_values_rows512(v + j * kh, kt, D, R, n, s, ss, z, o, 0);
            for (int64_t r = 0; r < R; r++)
                if (z[r] != 0.f)
                    memcpy(out + ((t0 + r / G) * H + j * G + r % G) * D, o + r * D, (size_t)D * sizeof(float));
        }
    }
    return empty;
}
#endif

#if defined(__x86_64__)
typedef struct {
    const float *q, *k, *v;
    const uint8_t *mask;
    float *out;
    int64_t qt, qh, kh, kt, L, T, H, KV, D;
    float scale;
    atomic_llong empty;
    atomic_int failed;
} attend_job;

/* One part of spec_attend's key heads (KV * part / parts ..), with scratch of its own */
static void attend_part(void *arg, int part, int parts) {
    attend_job *a = (attend_job *)arg;
    const int64_t j0 = a->KV * part / parts, j1 = a->KV * (part + 1) / parts, D = a->D, G = a->H / a->KV;
    if (j0 >= j1) return;
    const int64_t R = (G < SPEC_ATTEND_ROWS ? SPEC_ATTEND_ROWS / G : 1) * G, ss = (a->L + 15) / 16 * 16;
    float *w = (float *)malloc((size_t)(ss * D + R * ss + 2 * R * D + R) * sizeof(float));
    if (!w) {
        atomic_store(&a->failed, 1);
        return;
    }
    atomic_fetch_add(&a->empty, attend_heads512(a->q, a->qt, a->qh, a->k, a->v, a->kh, a->kt, a->L, a->mask, a->out,
                                                a->T, a->H, a->KV, D, a->scale, j0, j1, w));
    free(w);
}
#endif

/* Attention of one sequence's T query rows of H heads over L keys of KV heads (head h reads key head
   h / (H / KV)): q[t * qt + h * qh + d]; key l of head j at k[j * kh + l * kt], its value likewise in v;
   mask [T][L] (nonzero: may attend) or NULL: row t sees keys 0 .. L - T + t (one row: all of them; T = L:
   causal). out [T][H][D]. The scores' maximum is subtracted before the exponential. Returns the (row,
   head) pairs with no key to attend (out left unwritten for them), or -1 for shapes it does not take (D
   over 256). AVX-512F with D a multiple of 16: attend_heads512 (each key and value read once for a block of
   rows and the heads that share them), the key heads split over `threads` threads; otherwise plain C, a
   (row, head) at a time. */
int64_t spec_attend(const float *q, int64_t qt, int64_t qh, const float *k, const float *v, int64_t kh, int64_t kt,
                    int64_t L, const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KV, int64_t D,
                    float scale, int isa, int threads) {
    if (D <= 0 || D > 256 || KV <= 0 || H % KV || L < T) return -1;
    isa = spec_pick_isa(isa);
    const int wide = isa >= SPEC_ISA_AVX512 && D % 16 == 0;
    (void)wide;                                    /* (no AVX-512 variant off x86-64) */
#if defined(__x86_64__)
    if (wide) {
        attend_job a = {q, k, v, mask, out, qt, qh, kh, kt, L, T, H, KV, D, scale, 0, 0};
        pool_run(attend_part, &a, (int)KV, threads);
        return atomic_load(&a.failed) ? -1 : atomic_load(&a.empty);
    }
#else
    (void)threads;
#endif
    float *s = (float *)malloc((size_t)(L + 16) * sizeof(float));
    if (!s) return -1;
    int64_t empty = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t j = h / (H / KV), n = mask ? L : L - T + t + 1;
            const uint8_t *m = mask ? mask + t * L : NULL;
            const float *qv = q + t * qt + h * qh;
            float *o = out + (t * H + h) * D;
            empty += !attend_row_c(qv, k + j * kh, v + j * kh, kt, n, m, o, D, scale, s);
        }
    free(s);
    return empty;
}

/* Attention of one key head's G query heads, q [G][D] (already scaled), over its first n keys held in blocks
   of 16 positions, d-major (key p's dim d at kb[(p / 16) * 16 * D + d * 16 + p % 16]: the quantized draft's
   cache, qdraft.c), values a row per position (value p at v + p * vt), both IEEE halves (spec_h2f). The scores of 16 keys are one FMA
   chain per head along d (no horizontal sums), and each key and value is read once for the G heads.
   s: scratch of G * ss floats (ss: n rounded up to 16 at least). o [G][D]. AVX-512F for D a multiple of 16
   up to 256, else plain C. */
void spec_attend_blocked(const float *q, int64_t G, int64_t D, const uint16_t *kb, const uint16_t *v, int64_t vt,
                         int64_t n, float *s, int64_t ss, float *o, int isa) {
#if defined(__x86_64__)
    if (spec_pick_isa(isa) >= SPEC_ISA_AVX512 && D % 16 == 0 && D <= 256) {
        attend_blocked512(q, G, D, kb, v, vt, n, s, ss, o);
        return;
    }
#else
    (void)isa;
#endif
    attend_blocked_c(q, G, D, kb, v, vt, n, s, ss, o);
}

/* SwiGLU's gate: out[r][i] = silu(gu[r][i]) gu[r][inner + i] (gate and up side by side in each row of gu),
   silu(x) = x / (1 + e^-x); e^x in 16 AVX-512 lanes in that variant (exp512: within a few 1e-7 of expf),
   else expf. */
void spec_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner, int isa) {
    const int wide = spec_pick_isa(isa) >= SPEC_ISA_AVX512;
    (void)wide;                                    /* (no AVX-512 variant off x86-64) */
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inner, *u = g + inner;
        float *o = out + r * inner;
        int64_t i = 0;
#if defined(__x86_64__)
        if (wide) i = silu_mul512(g, u, o, inner);
#endif
        for (; i < inner; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
