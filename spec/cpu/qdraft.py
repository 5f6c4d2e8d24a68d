"""A GGUF Llama draft run by spec's own block-quantized kernel (issue 43): the same Q4_1 file the
llama.cpp draft reads, several times cheaper a token on a CPU with AVX-512 VNNI.

The draft's cost bounds what a self-draft can gain (Theorem 3.8: the speedup is E / (gamma c + V)),
and a draft's numbers never touch the output: whatever it proposes, the target's acceptance rule
keeps the output exactly the target's. So the draft may be computed the fastest way a CPU allows.
This module reads a GGUF written for llama.cpp's `llama` architecture (Q4_1 and Q8_0 matrices, f32
norms; the layout every llama.cpp Q4_1 export of a Llama has) into records of 16 rows x 32 inputs,
quantizes each activation block of 32 to int8 as llama.cpp does, and sums products in int32 with
VNNI (`dpbusd`), the whole forward (norms, RoPE, grouped attention over a float32 KV cache, SiLU
MLP) in C (`SOURCE`), its products split over `threads` threads of spec.cpu.gemv's pool (POOL), the rest on
the caller's. Where the GGUF has anything else (another architecture or
quantization, biases, rope scaling) or the CPU lacks AVX-512 VNNI, `unsupported()` says why and the
caller (spec.gguf_draft) runs llama.cpp instead.

`library()` builds SOURCE twice with the system C compiler (plain, and with the AVX-512 VNNI flags)
into $SPEC_CACHE/qdraft/, and self-tests both in a SUBPROCESS (ctypes only: a crash there is a
return code here), once per process: the VNNI build is loaded only where the CPU says it has those
instructions and its results equal the plain build's. `QuantRun(path)` is a Runner (spec.protocols)
over one sequence: `run(ids)` feeds ids after what the cache holds and returns the last position's
logits; `crop(keep)` forgets positions from keep on.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spec.cpu import gemv

log = logging.getLogger(__name__)

SOURCE = gemv.POOL + gemv.VEXP + r"""
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* Block-quantized Llama forward for a draft model (its products split over the pool's threads).

   A weight matrix W [N][K] (N % 16 == 0, K % 32 == 0) is stored as records, one per (panel p of 16
   rows, block b of 32 inputs), in the order p, b:
     kind 4 (from Q4_1): 256 bytes of nibbles then 16 fp16 d then 16 fp16 m (320 bytes);
        byte (i, j, t) at 64 i + 4 j + t, i < 4, row 16p + j: low nibble = u[32b + 4i + t],
        high nibble = u[32b + 16 + 4i + t];
     kind 8 (from Q8_0): 512 bytes, byte (g, j, t) at 64 g + 4 j + t = u[32b + 4g + t], then d, m.
   The weight is w = d u + m (Q4_1: u the nibble, d and m the block's; Q8_0: u = q + 128, m = -128 d).
   Activations are quantized per block of 32 to int8 (xq, scale xd, xs = xd * sum xq), so a block's dot
   is d xd sum(u xq) + m xs, the integer sum exact (VNNI dpbusd where compiled with it). */

#define REC(kind) ((kind) == 4 ? 320 : 576)
#define WBYTES(kind) ((kind) == 4 ? 256 : 512)

static inline float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {
        if (m == 0) bits = s;
        else {                                           /* subnormal */
            e = 113;
            while (!(m & 1024)) { m <<= 1; e--; }
            bits = s | (e << 23) | ((m & 1023) << 13);
        }
    } else if (e == 31) bits = s | 0x7f800000u | (m << 13);
    else bits = s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int weight_u(const uint8_t *rec, int kind, int j, int k) {   /* u of row j (in the panel), input k < 32 */
    if (kind == 8) return rec[64 * (k / 4) + 4 * j + k % 4];
    int hi = k >= 16, kk = k - 16 * hi;
    uint8_t byte = rec[64 * (kk / 4) + 4 * j + kk % 4];
    return hi ? byte >> 4 : byte & 15;
}

void spec_qd_row(const uint8_t *W, int64_t kind, int64_t N, int64_t K, int64_t row, float *out) {
    /* Row `row` of W dequantized (the embedding lookup). */
    int64_t B = K / 32, p = row / 16, j = row % 16;
    (void)N;
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *rec = W + (p * B + b) * REC(kind);
        const uint16_t *dm = (const uint16_t *)(rec + WBYTES(kind));
        float d = h2f(dm[j]), m = h2f(dm[16 + j]);
        for (int k = 0; k < 32; k++) out[32 * b + k] = d * (float)weight_u(rec, kind, (int)j, k) + m;
    }
}

void spec_qd_quantize(const float *x, int64_t R, int64_t K, int8_t *q, float *xd, float *xs) {
    int64_t B = K / 32;
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < B; b++) {
            const float *v = x + r * K + 32 * b;
            float amax = 0.f;
            for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
            int8_t *o = q + r * K + 32 * b;
            int sum = 0;
            if (amax > 0.f) {
                float id = 127.f / amax;
                for (int k = 0; k < 32; k++) {
                    int t = (int)rintf(v[k] * id);
                    t = t > 127 ? 127 : (t < -127 ? -127 : t);
                    o[k] = (int8_t)t;
                    sum += t;
                }
            } else
                for (int k = 0; k < 32; k++) o[k] = 0;
            float d = amax / 127.f;
            xd[r * B + b] = d;
            xs[r * B + b] = d * (float)sum;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QD_VNNI 1

#define QMV_BODY(RR)                                                                                    \
    for (int64_t p = p0; p < p1; p++) {                                                                 \
        __m512 acc[RR];                                                                                   \
        for (int r = 0; r < RR; r++) acc[r] = _mm512_setzero_ps();                                        \
        const uint8_t *rec = W + p * B * rs;                                                              \
        for (int64_t b = 0; b < B; b++, rec += rs) {                                                      \
            __m512i w[8];                                                                                 \
            if (kind == 4) {                                                                              \
                const __m512i lo = _mm512_set1_epi8(15);                                                  \
                for (int i = 0; i < 4; i++) {                                                             \
                    __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * i));                        \
                    w[i] = _mm512_and_si512(v, lo);                                                       \
                    w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);                             \
                }                                                                                         \
            } else                                                                                        \
                for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512((const void *)(rec + 64 * i));     \
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + wb)));          \
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + wb + 32)));     \
            for (int r = 0; r < RR; r++) {                                                                \
                const int32_t *xb = (const int32_t *)(xq + r * K + 32 * b);                               \
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();                         \
                for (int g = 0; g < 8; g += 2) {                                                          \
                    s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(xb[g]));                         \
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(xb[g + 1]));                 \
                }                                                                                         \
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),                   \
                                         _mm512_set1_ps(xd[r * B + b]));                                  \
                acc[r] = _mm512_fmadd_ps(t, dv, acc[r]);                                                  \
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * B + b]), acc[r]);                      \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < RR; r++) _mm512_storeu_ps(y + r * N + 16 * p, acc[r]);                        \
    }

#define QMV_FN(RR)                                                                                      \
    static void qmv_##RR(const uint8_t *W, int kind, int64_t N, int64_t K, const int8_t *xq,            \
                         const float *xd, const float *xs, float *y, int64_t p0, int64_t p1) {            \
        const int64_t B = K / 32, rs = REC(kind), wb = WBYTES(kind);                                     \
        QMV_BODY(RR)                                                                                      \
    }
QMV_FN(1)
QMV_FN(2)
QMV_FN(3)
QMV_FN(4)
#endif

#define RMAX 4

static void qmv_c(const uint8_t *W, int kind, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, int64_t R, float *y, int64_t p0, int64_t p1) {
    const int64_t B = K / 32, rs = REC(kind), wb = WBYTES(kind);
    for (int64_t p = p0; p < p1; p++)
        for (int64_t r = 0; r < R; r++)
            for (int j = 0; j < 16; j++) {
                float acc = 0.f;
                for (int64_t b = 0; b < B; b++) {
                    const uint8_t *rec = W + (p * B + b) * rs;
                    const uint16_t *dm = (const uint16_t *)(rec + wb);
                    int32_t s = 0;
                    for (int k = 0; k < 32; k++) s += weight_u(rec, kind, j, k) * (int32_t)xq[r * K + 32 * b + k];
                    acc += (float)s * xd[r * B + b] * h2f(dm[j]) + h2f(dm[16 + j]) * xs[r * B + b];
                }
                y[r * N + 16 * p + j] = acc;
            }
}

int spec_qd_vnni(void) {
#ifdef QD_VNNI
    return 1;
#else
    return 0;
#endif
}

typedef struct { const uint8_t *W; int kind; int64_t N, K; const int8_t *xq; const float *xd, *xs; int64_t R;
                 float *y; int64_t vnni; } qmv_job;

/* One part of a product: the panels P*part/parts .. P*(part+1)/parts (P = N/16), every row; each output
   is summed in the same order whatever the split. */
static void qmv_part(void *arg, int part, int parts) {
    const qmv_job *j = (const qmv_job *)arg;
    const int64_t P = j->N / 16, p0 = P * part / parts, p1 = P * (part + 1) / parts, K = j->K, N = j->N;
    if (p0 >= p1) return;
#ifdef QD_VNNI
    if (j->vnni) {
        for (int64_t r0 = 0; r0 < j->R; r0 += RMAX) {
            int64_t n = j->R - r0 < RMAX ? j->R - r0 : RMAX;
            const int8_t *q = j->xq + r0 * K;
            const float *d = j->xd + r0 * (K / 32), *s = j->xs + r0 * (K / 32);
            float *o = j->y + r0 * N;
            switch (n) {
                case 1: qmv_1(j->W, j->kind, N, K, q, d, s, o, p0, p1); break;
                case 2: qmv_2(j->W, j->kind, N, K, q, d, s, o, p0, p1); break;
                case 3: qmv_3(j->W, j->kind, N, K, q, d, s, o, p0, p1); break;
                default: qmv_4(j->W, j->kind, N, K, q, d, s, o, p0, p1); break;
            }
        }
        return;
    }
#endif
    qmv_c(j->W, j->kind, N, K, j->xq, j->xd, j->xs, j->R, j->y, p0, p1);
}

/* y[R][N] = W x for R quantized rows (xq [R][K], xd and xs [R][K/32]), the panels split over
   spec_pool_threads' threads. vnni: 1 the VNNI kernel (where compiled), 0 the plain-C one. */
void spec_qd_matvec(const uint8_t *W, int64_t kind, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, int64_t R, float *y, int64_t vnni) {
    qmv_job j = {W, (int)kind, N, K, xq, xd, xs, R, y, vnni};
    pool_run(qmv_part, &j, (int)(N / 16));
}

typedef struct {
    int64_t n_layer, dim, n_head, n_kv, head_dim, ffn, vocab, n_ctx;
    float eps, theta;
    const uint8_t *embd;           /* token embedding, [vocab][dim] */
    int64_t embd_kind;
    const uint8_t *out;            /* output projection, [vocab][dim] */
    int64_t out_kind;
    const float *out_norm;
    const float *const *norms;     /* [n_layer][2]: attention, ffn */
    const uint8_t *const *mats;    /* [n_layer][7]: q, k, v, o, gate, up, down */
    const int64_t *kinds;          /* [n_layer][7] */
    float *kc, *vc;                /* [n_layer][n_ctx][n_kv * head_dim] */
    int64_t vnni;
} spec_qd_model;

/* sum a[i] b[i]: on the VNNI build 16 lanes at a time (a float sum in a loop is not vectorized by the
   compiler: it would reorder the additions), the lanes added at the end. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    int64_t i = 0;
#ifdef QD_VNNI
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}


/* v[i] = e^(v[i] - mx) for i < n; returns their sum */
static float exp_shifted(float *v, int64_t n, float mx) {
#ifdef QD_VNNI
    return exp_shift512(v, n, mx);
#else
    float z = 0.f;
    for (int64_t i = 0; i < n; i++) { v[i] = expf(v[i] - mx); z += v[i]; }
    return z;
#endif
}

/* g[i] = silu(g[i]) u[i] for i < n */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
#ifdef QD_VNNI
    i = silu_mul512(g, u, g, n);
#endif
    for (; i < n; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *o) {
    const float ss = dot(x, x, n);
    float s = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) o[i] = x[i] * s * w[i];
}

static void rope(float *v, int64_t heads, int64_t hd, const float *cs, const float *sn) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < hd / 2; i++) {
            float a = v[h * hd + 2 * i], b = v[h * hd + 2 * i + 1];
            v[h * hd + 2 * i] = a * cs[i] - b * sn[i];
            v[h * hd + 2 * i + 1] = a * sn[i] + b * cs[i];
        }
}

static void linear(const spec_qd_model *m, const uint8_t *W, int64_t kind, int64_t N, int64_t K, const float *x,
                   int64_t R, float *y, int8_t *xq, float *xd, float *xs) {
    if (x) spec_qd_quantize(x, R, K, xq, xd, xs);     /* x NULL: xq, xd, xs already hold it (q/k/v, gate/up) */
    spec_qd_matvec(W, kind, N, K, xq, xd, xs, R, y, m->vnni);
}

/* Feed ids[0..n) at positions pos0.. (the cache holds pos0 positions before); logits: the last
   position's [vocab]. 0, or -1 when the positions do not fit, -2 when memory runs out. */
int spec_qd_forward(const spec_qd_model *m, const int32_t *ids, int64_t n, int64_t pos0, float *logits) {
    if (n <= 0 || pos0 < 0 || pos0 + n > m->n_ctx) return -1;
    const int64_t D = m->dim, F = m->ffn, hd = m->head_dim, kvd = m->n_kv * hd, H = m->n_head;
    const int64_t group = m->n_head / m->n_kv, widest = F > D ? F : D;
    float *x = malloc(sizeof(float) * RMAX * D), *h = malloc(sizeof(float) * RMAX * widest);
    float *q = malloc(sizeof(float) * RMAX * D), *k = malloc(sizeof(float) * RMAX * kvd);
    float *v = malloc(sizeof(float) * RMAX * kvd), *g = malloc(sizeof(float) * RMAX * F);
    float *u = malloc(sizeof(float) * RMAX * F), *att = malloc(sizeof(float) * (pos0 + n));
    int8_t *xq = malloc((size_t)RMAX * widest);
    float *xd = malloc(sizeof(float) * RMAX * widest / 32), *xs = malloc(sizeof(float) * RMAX * widest / 32);
    float *cs = malloc(sizeof(float) * RMAX * hd / 2), *sn = malloc(sizeof(float) * RMAX * hd / 2);
    int rc = 0;
    if (!x || !h || !q || !k || !v || !g || !u || !att || !xq || !xd || !xs || !cs || !sn) { rc = -2; goto done; }
    const float scale = 1.f / sqrtf((float)hd);
    for (int64_t c0 = 0; c0 < n; c0 += RMAX) {
        const int64_t R = n - c0 < RMAX ? n - c0 : RMAX, p0 = pos0 + c0;
        for (int64_t r = 0; r < R; r++) {
            spec_qd_row(m->embd, m->embd_kind, m->vocab, D, ids[c0 + r], x + r * D);
            for (int64_t i = 0; i < hd / 2; i++) {
                float f = (float)(p0 + r) * powf(m->theta, -2.f * (float)i / (float)hd);
                cs[r * hd / 2 + i] = cosf(f);
                sn[r * hd / 2 + i] = sinf(f);
            }
        }
        for (int64_t l = 0; l < m->n_layer; l++) {
            const uint8_t *const *W = m->mats + 7 * l;
            const int64_t *kd = m->kinds + 7 * l;
            float *kc = m->kc + l * m->n_ctx * kvd, *vc = m->vc + l * m->n_ctx * kvd;
            for (int64_t r = 0; r < R; r++) rmsnorm(x + r * D, m->norms[2 * l], D, m->eps, h + r * D);
            linear(m, W[0], kd[0], D, D, h, R, q, xq, xd, xs);
            linear(m, W[1], kd[1], kvd, D, NULL, R, k, xq, xd, xs);
            linear(m, W[2], kd[2], kvd, D, NULL, R, v, xq, xd, xs);
            for (int64_t r = 0; r < R; r++) {
                rope(q + r * D, H, hd, cs + r * hd / 2, sn + r * hd / 2);
                rope(k + r * kvd, m->n_kv, hd, cs + r * hd / 2, sn + r * hd / 2);
                memcpy(kc + (p0 + r) * kvd, k + r * kvd, sizeof(float) * kvd);
                memcpy(vc + (p0 + r) * kvd, v + r * kvd, sizeof(float) * kvd);
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t T = p0 + r + 1;                 /* positions this row sees */
                for (int64_t hh = 0; hh < H; hh++) {
                    const float *qh = q + r * D + hh * hd;
                    const int64_t off = (hh / group) * hd;
                    float mx = -INFINITY;
                    for (int64_t t = 0; t < T; t++) {
                        const float *kt = kc + t * kvd + off;
                        float s = dot(qh, kt, hd);
                        att[t] = s * scale;
                        mx = fmaxf(mx, att[t]);
                    }
                    const float z = exp_shifted(att, T, mx);
                    float *o = h + r * D + hh * hd;
                    for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
                    for (int64_t t = 0; t < T; t++) {
                        const float *vt = vc + t * kvd + off, a = att[t] / z;
                        for (int64_t i = 0; i < hd; i++) o[i] += a * vt[i];
                    }
                }
            }
            linear(m, W[3], kd[3], D, D, h, R, q, xq, xd, xs);
            for (int64_t i = 0; i < R * D; i++) x[i] += q[i];
            for (int64_t r = 0; r < R; r++) rmsnorm(x + r * D, m->norms[2 * l + 1], D, m->eps, h + r * D);
            linear(m, W[4], kd[4], F, D, h, R, g, xq, xd, xs);
            linear(m, W[5], kd[5], F, D, NULL, R, u, xq, xd, xs);
            silu_mul(g, u, R * F);
            linear(m, W[6], kd[6], D, F, g, R, q, xq, xd, xs);
            for (int64_t i = 0; i < R * D; i++) x[i] += q[i];
        }
        if (c0 + R == n) {
            rmsnorm(x + (R - 1) * D, m->out_norm, D, m->eps, h);
            linear(m, m->out, m->out_kind, m->vocab, D, h, 1, logits, xq, xd, xs);
        }
    }
done:
    free(x); free(h); free(q); free(k); free(v); free(g); free(u); free(att); free(xq); free(xd); free(xs);
    free(cs); free(sn);
    return rc;
}
"""

VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")   # /proc/cpuinfo's names
KINDS = {"Q4_1": 4, "Q8_0": 8}          # GGUF matrix types the kernel reads, and its record kind
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# The self-test (run in a subprocess: ctypes and numpy only): random records of both kinds, 1-9 rows,
# each build's matvec (and the VNNI build's plain-C path) against a float64 reference; then a whole
# forward of a random one-layer model (prefill of 5, then one token) on each build, finite and equal
# within float32 rounding of the quantized activations.
SELFTEST = r"""
import ctypes, sys
import numpy as np
P = ctypes.c_void_p
rng = np.random.default_rng(0)
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
for lib in libs:
    lib.spec_qd_matvec.argtypes = [P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, P, P, P, ctypes.c_int64, P,
                                   ctypes.c_int64]
    lib.spec_qd_vnni.restype = ctypes.c_int
    lib.spec_pool_threads.argtypes = [ctypes.c_int]
for kind in (4, 8):
    for N, K in ((16, 32), (48, 96), (32, 576)):
        B, rs, wb = K // 32, (320 if kind == 4 else 576), (256 if kind == 4 else 512)
        u = rng.integers(0, 16 if kind == 4 else 256, size=(N, K)).astype(np.uint8)
        d = rng.uniform(-0.1, 0.1, size=(N, B)).astype(np.float16)
        m = rng.uniform(-0.1, 0.1, size=(N, B)).astype(np.float16)
        P_, blk = N // 16, u.reshape(N // 16, 16, B, 32)
        if kind == 4:
            h = blk.reshape(P_, 16, B, 2, 4, 4)
            w = (h[:, :, :, 0] | (h[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(P_, B, 256)
        else:
            w = blk.reshape(P_, 16, B, 8, 4).transpose(0, 2, 3, 1, 4).reshape(P_, B, 512)
        sc = lambda a: a.reshape(P_, 16, B).transpose(0, 2, 1).copy().view(np.uint8).reshape(P_, B, 32)
        rec = np.ascontiguousarray(np.concatenate([w, sc(d), sc(m)], axis=-1))
        assert rec.shape[-1] == rs
        wf = (d.astype(np.float64).repeat(32, 1) * u + m.astype(np.float64).repeat(32, 1))
        for R in range(1, 10):
            xq = rng.integers(-127, 128, size=(R, K)).astype(np.int8)
            xd = rng.uniform(0, 0.05, size=(R, B)).astype(np.float32)
            xs = (xd * xq.reshape(R, B, 32).astype(np.int64).sum(-1)).astype(np.float32)
            x = xd.astype(np.float64).repeat(32, 1) * xq
            want = x @ wf.T
            bound = (np.abs(x) @ np.abs(wf).T) * 1e-5 + 1e-30
            for lib in libs:
                for vnni in ((0, 1) if lib.spec_qd_vnni() else (0,)):
                    ys = []
                    for threads in (1, 2, 3):         # the panels split over the pool: the same sums
                        lib.spec_pool_threads(threads)
                        y = np.zeros((R, N), np.float32)
                        lib.spec_qd_matvec(rec.ctypes.data, kind, N, K, xq.ctypes.data, xd.ctypes.data,
                                           xs.ctypes.data, R, y.ctypes.data, vnni)
                        ys.append(y)
                        if not (np.abs(y - want) <= bound).all():
                            sys.exit(f"kind {kind} N={N} K={K} R={R} vnni={vnni} threads {threads}: largest error "
                                     f"{np.abs(y - want).max():.3g} (bound {bound.min():.3g})")
                    if not all(np.array_equal(y, ys[0]) for y in ys):
                        sys.exit(f"kind {kind} N={N} K={K} R={R} vnni={vnni}: split over threads, another product")
                    lib.spec_pool_threads(1)


def records(kind, N, K):
    B, P_ = K // 32, N // 16
    u = rng.integers(0, 16 if kind == 4 else 256, size=(P_, B, 512 if kind == 8 else 256)).astype(np.uint8)
    if kind == 4:
        u = u & 15 | (u & 15) << 4
    d = rng.uniform(0.001, 0.02, size=(P_, B, 16)).astype(np.float16)
    m = (-d.astype(np.float32) * (8 if kind == 4 else 128)).astype(np.float16)
    return np.ascontiguousarray(np.concatenate([u, d.view(np.uint8), m.view(np.uint8)], axis=-1))


class Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("n_layer", "dim", "n_head", "n_kv", "head_dim", "ffn", "vocab",
                                              "n_ctx")] + [
        ("eps", ctypes.c_float), ("theta", ctypes.c_float), ("embd", P), ("embd_kind", ctypes.c_int64),
        ("out", P), ("out_kind", ctypes.c_int64), ("out_norm", P), ("norms", P), ("mats", P), ("kinds", P),
        ("kc", P), ("vc", P), ("vnni", ctypes.c_int64)]


D, F, V, CTX = 32, 64, 32, 8
shapes = [(D, D), (16, D), (16, D), (D, D), (F, D), (F, D), (D, F)]
mats = [records(4, n, k) for n, k in shapes]
embd, norm = records(8, V, D), np.ones(D, np.float32)
ptrs = np.array([a.ctypes.data for a in mats], np.uint64)
kinds = np.full(7, 4, np.int64)
norms = np.array([norm.ctypes.data] * 2, np.uint64)
logits = []
for lib in libs:
    lib.spec_qd_forward.argtypes = [P, P, ctypes.c_int64, ctypes.c_int64, P]
    for vnni, threads in [(v, t) for v in ((0, 1) if lib.spec_qd_vnni() else (0,)) for t in (1, 2)]:
        lib.spec_pool_threads(threads)
        kc, vc = np.zeros((CTX, 16), np.float32), np.zeros((CTX, 16), np.float32)
        model = Model(1, D, 2, 1, 16, F, V, CTX, 1e-5, 10000.0, embd.ctypes.data, 8, embd.ctypes.data, 8,
                      norm.ctypes.data, norms.ctypes.data, ptrs.ctypes.data, kinds.ctypes.data, kc.ctypes.data,
                      vc.ctypes.data, vnni)
        out = np.zeros(V, np.float32)
        ids = np.array([1, 5, 3, 9, 2, 7], np.int32)
        if lib.spec_qd_forward(ctypes.byref(model), ids.ctypes.data, 5, 0, out.ctypes.data) != 0 or \
                lib.spec_qd_forward(ctypes.byref(model), ids[5:].ctypes.data, 1, 5, out.ctypes.data) != 0:
            sys.exit("the forward refused a context that fits")
        if not np.isfinite(out).all():
            sys.exit(f"vnni={vnni}: the forward gave non-finite logits")
        if threads == 2 and not np.array_equal(out, logits[-1]):
            sys.exit(f"vnni={vnni}: the forward on 2 threads differs from one thread's")
        logits.append(out)
        lib.spec_pool_threads(1)
scale = max(float(np.abs(x).max()) for x in logits)
if max(float(np.abs(x - logits[0]).max()) for x in logits) > 1e-3 * scale + 1e-30:
    sys.exit(f"the builds' forwards differ: {[x[:4] for x in logits]}")
print("ok")
"""

_STATE: dict = {}


def cache_dir() -> Path:
    return gemv.cache_dir().parent / "qdraft"


def cpu_has_vnni() -> bool:
    """Whether this CPU (Linux's /proc/cpuinfo) has every instruction set the VNNI build uses."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return all(f in flags for f in CPU_FLAGS)


def selftest(paths: list[Path]) -> str | None:
    """None if every library in `paths` computes the block products right (in a subprocess), else why."""
    return gemv.run_selftest(SELFTEST, [str(p) for p in paths], "the self-test")


def _make():
    if os.environ.get("SPEC_QDRAFT", "1") == "0":
        return None, "SPEC_QDRAFT=0"
    if not cpu_has_vnni():
        return None, f"this CPU lacks one of {', '.join(CPU_FLAGS)}"
    paths = [gemv.compiled(SOURCE, cache_dir()), gemv.compiled(SOURCE, cache_dir(), VNNI_FLAGS)]
    why = selftest(paths)
    if why is not None:
        return None, why
    lib = ctypes.CDLL(str(paths[1]))
    _declare(lib)
    if not lib.spec_qd_vnni():
        return None, "the VNNI build has no VNNI kernel (the compiler did not define it)"
    return lib, None


def library():
    """The VNNI build, self-tested, as a ctypes.CDLL, or None with `reason()` saying why (no AVX-512
    VNNI on this CPU, no compiler, a failed self-test); decided once per process. SPEC_QDRAFT=0: None."""
    return gemv.decide_once(_STATE, _make, "spec.cpu.qdraft")


def reason() -> str | None:
    """Why `library()` is None (None when it is not, or was not asked yet)."""
    return _STATE.get("why")


def forget() -> None:
    _STATE.clear()


_INTS = ("n_layer", "dim", "n_head", "n_kv", "head_dim", "ffn", "vocab", "n_ctx")


class Model(ctypes.Structure):
    """SOURCE's spec_qd_model."""
    _fields_ = ([(n, ctypes.c_int64) for n in _INTS]  # type: ignore[assignment]
                + [("eps", ctypes.c_float), ("theta", ctypes.c_float),
                   ("embd", ctypes.c_void_p), ("embd_kind", ctypes.c_int64),
                   ("out", ctypes.c_void_p), ("out_kind", ctypes.c_int64), ("out_norm", ctypes.c_void_p),
                   ("norms", ctypes.c_void_p), ("mats", ctypes.c_void_p), ("kinds", ctypes.c_void_p),
                   ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p), ("vnni", ctypes.c_int64)])


def _declare(lib) -> None:
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.spec_qd_vnni.restype = ctypes.c_int
    lib.spec_pool_threads.restype = ctypes.c_int
    lib.spec_pool_threads.argtypes = [ctypes.c_int]
    lib.spec_pool_worked.restype = ctypes.c_long
    lib.spec_qd_forward.restype = ctypes.c_int
    lib.spec_qd_forward.argtypes = [P, P, I, I, P]


def records(kind: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """A GGUF matrix's raw blocks (Q4_1 when kind is 4, Q8_0 when 8; [n rows, bytes]) as the kernel's
    records (SOURCE's comment), in memory asked for huge pages (spec.cpu.gemv.buffer)."""
    B, P = k // 32, n // 16
    d: np.ndarray
    m: np.ndarray
    if kind == 4:
        blk = raw.reshape(n, B, 20)
        d, m = blk[..., 0:2].copy().view(np.float16)[..., 0], blk[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blk[..., 4:20]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)            # element k < 16 low nibble, k >= 16 high
        h = u.reshape(P, 16, B, 2, 4, 4)
        w = (h[:, :, :, 0] | (h[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(P, B, 256)
    else:
        blk = raw.reshape(n, B, 34)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0]
        m = (d.astype(np.float32) * -128).astype(np.float16)     # exact: a power of two
        u = (blk[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        w = u.reshape(P, 16, B, 8, 4).transpose(0, 2, 3, 1, 4).reshape(P, B, 512)
    scales: list[np.ndarray] = [a.reshape(P, 16, B).transpose(0, 2, 1).copy().view(np.uint8).reshape(P, B, 32)
                                for a in (d, m)]
    rec = np.concatenate([w, *scales], axis=-1)
    out = gemv.buffer(-(-rec.size // 4)).view(torch.uint8)[:rec.size].numpy()
    out[:] = rec.reshape(-1)
    return out


class Unsupported(ValueError):
    """The kernel cannot run this file here (the message says why)."""


GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}   # the rest: "type N"
BLOCK_BYTES = {"F32": (1, 4), "Q4_1": (32, 20), "Q8_0": (32, 34)}                           # (elements, bytes)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUF:
    """A GGUF file's metadata (`fields`: key -> value; arrays as lists) and tensors (`tensors`: name ->
    (type name, shape [ne0, ne1, ...], byte offset)) read with the standard library, and its tensor
    data memory-mapped (`data(name)`: the raw bytes, [rows, bytes a row]). Only what the kernel needs:
    the token list is read, other string arrays (merges) skipped."""

    def __init__(self, path):
        import struct

        self.path = Path(path)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = raw.tobytes() if raw.size < 1 << 16 else bytes(raw[: min(raw.size, 64 << 20)])
        if buf[:4] != b"GGUF":
            raise Unsupported(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        pos = 4

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string(keep: bool = True):
            nonlocal pos
            n = take("<Q")
            pos += n
            return buf[pos - n:pos].decode("utf-8", errors="replace") if keep else None

        def value(kind: int, keep: bool = True):
            if kind == 8:
                return string(keep)
            if kind == 9:
                sub, n = take("<I"), take("<Q")
                return [value(sub, keep) for _ in range(n)] if keep or sub == 8 else [value(sub) for _ in range(n)]
            if kind not in _SCALARS:
                raise Unsupported(f"{self.path.name}: metadata value of unknown type {kind}")
            return take(_SCALARS[kind])

        version = take("<I")
        if version < 2:
            raise Unsupported(f"{self.path.name}: GGUF version {version} (2 or later read)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = string()
            v = value(take("<I"), keep=not key.startswith("tokenizer.ggml.merges"))
            self.fields[key] = v
        self.tensors: dict = {}
        for _ in range(n_tensors):
            name = string()
            shape = [take("<Q") for _ in range(take("<I"))]
            kind, offset = take("<I"), take("<Q")
            self.tensors[name] = (GGUF_TYPES.get(kind, f"type {kind}"), shape, offset)
        align = int(self.fields.get("general.alignment", 32))
        self.start = -(-pos // align) * align
        self.raw = raw

    def data(self, name: str) -> np.ndarray:
        kind, shape, offset = self.tensors[name]
        per, nbytes = BLOCK_BYTES[kind]
        row = shape[0] // per * nbytes
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        return self.raw[self.start + offset:self.start + offset + rows * row].reshape(rows, row)


def unsupported(path) -> str | None:
    """Why the kernel cannot run the GGUF at `path` here (None: it can)."""
    try:
        _check(GGUF(path))
    except Unsupported as e:
        return str(e)
    except OSError as e:
        return f"{Path(path).name} cannot be read: {e}"
    return None


def _check(g: GGUF) -> None:
    """Raise Unsupported naming why the kernel cannot run `g` here."""
    if library() is None:
        raise Unsupported(f"spec's quantized kernel is not available here: {reason()}")
    f = g.fields
    arch = f.get("general.architecture")
    if arch != "llama":
        raise Unsupported(f"architecture {arch!r} (the kernel runs 'llama' only)")
    for key in ("rope.scaling.type", "rope.scaling.factor", "attention.key_length", "attention.value_length"):
        if f.get(f"llama.{key}") not in (None, "none"):
            raise Unsupported(f"llama.{key} is set (the kernel has no rope scaling; head size = width / heads)")
    for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length",
                "attention.layer_norm_rms_epsilon"):
        if f.get(f"llama.{key}") is None:
            raise Unsupported(f"llama.{key} is missing")
    layers = int(f["llama.block_count"])
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(layers) for n in MATRICES + ("attn_norm", "ffn_norm")}
    extra = sorted(set(g.tensors) - expected)
    if extra:
        raise Unsupported(f"tensors the kernel does not compute: {', '.join(extra[:4])}")
    missing = sorted(expected - set(g.tensors) - {"output.weight"})
    if missing:
        raise Unsupported(f"tensors missing: {', '.join(missing[:4])}")
    for name, (kind, shape, _) in g.tensors.items():
        if name.endswith("_norm.weight"):
            if kind != "F32":
                raise Unsupported(f"{name} is {kind} (f32 norms only)")
        elif kind not in KINDS:
            raise Unsupported(f"{name} is {kind} (the kernel reads {', '.join(KINDS)})")
        elif len(shape) != 2 or shape[0] % 32 or shape[1] % 16:
            raise Unsupported(f"{name} is {shape[1:]} x {shape[0]} (rows a multiple of 16, inputs of 32)")


class QuantRun:
    """A Runner over one sequence of the GGUF Llama at `path` on spec's kernel (the module docstring);
    n_ctx: the positions its KV cache holds; threads: the threads its products are split over (the
    rest of the forward runs on the caller's). Raises Unsupported (a ValueError) naming why where the
    kernel cannot run it here; `pieces`, `bos`, `eos`: the GGUF's tokens (spec.gguf_draft checks them)."""

    def __init__(self, path, *, n_ctx: int = 4096, threads: int = 1):
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads: a positive int expected, got {threads!r}")
        self.path, self.n_ctx, self.threads = Path(path), n_ctx, threads
        g = GGUF(self.path)
        _check(g)
        def f(key: str, default: Any = None) -> Any:
            return g.fields.get("llama." + key, default)

        dim, heads = int(f("embedding_length")), int(f("attention.head_count"))
        kv = int(f("attention.head_count_kv", heads))
        self.vocab = int(g.tensors["token_embd.weight"][1][1])
        self.pieces = g.fields.get("tokenizer.ggml.tokens") or []
        self.bos, self.eos = g.fields.get("tokenizer.ggml.bos_token_id"), g.fields.get("tokenizer.ggml.eos_token_id")
        self._keep: list = []

        def mat(name: str) -> tuple[int, int]:
            kind, (k, n), _ = g.tensors[name]
            r = records(KINDS[kind], np.asarray(g.data(name)), n, k)
            self._keep.append(r)
            return r.ctypes.data, KINDS[kind]

        def norm(name: str) -> int:
            a = np.array(g.data(name), copy=True).view(np.float32).reshape(-1)
            self._keep.append(a)
            return a.ctypes.data

        layers = int(f("block_count"))
        embd, embd_kind = mat("token_embd.weight")
        out, out_kind = mat("output.weight") if "output.weight" in g.tensors else (embd, embd_kind)
        mats: np.ndarray = np.zeros((layers, 7), np.uint64)
        kinds: np.ndarray = np.zeros((layers, 7), np.int64)
        norms: np.ndarray = np.zeros((layers, 2), np.uint64)
        for i in range(layers):
            for j, n in enumerate(MATRICES):
                mats[i, j], kinds[i, j] = mat(f"blk.{i}.{n}.weight")
            norms[i] = norm(f"blk.{i}.attn_norm.weight"), norm(f"blk.{i}.ffn_norm.weight")
        hd = dim // heads
        self.kc: np.ndarray | None = np.zeros((layers, n_ctx, kv * hd), np.float32)
        self.vc: np.ndarray | None = np.zeros_like(self.kc)
        self._keep += [mats, kinds, norms]
        self.model = Model(layers, dim, heads, kv, hd, int(f("feed_forward_length")), self.vocab, n_ctx,
                           float(f("attention.layer_norm_rms_epsilon")), float(f("rope.freq_base", 10000.0)),
                           embd, embd_kind, out, out_kind, norm("output_norm.weight"), norms.ctypes.data,
                           mats.ctypes.data, kinds.ctypes.data, self.kc.ctypes.data, self.vc.ctypes.data, 1)  # type: ignore[union-attr]
        self.lib = library()
        self.ids: np.ndarray = np.zeros(n_ctx, np.int32)
        self.n = 0
        self.logits: np.ndarray = np.zeros(self.vocab, np.float32)

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("ids: nothing to feed (a draft step needs at least one new token)")
        if (keep or len(ids)) != 1:
            raise ValueError(f"keep: the quantized draft returns the last position's logits only (keep=1), got "
                             f"{keep} for {len(ids)} ids")
        if self.n + len(ids) > self.n_ctx:
            raise ValueError(f"the quantized draft's context holds {self.n_ctx} positions; {self.n} + {len(ids)} "
                             f"do not fit (n_ctx=...)")
        new = np.ascontiguousarray(ids.numpy(), dtype=np.int32)
        if new.min() < 0 or new.max() >= self.vocab:
            raise ValueError(f"ids: token ids in [0, {self.vocab}) expected, got {int(new.min())}..{int(new.max())}")
        self.lib.spec_pool_threads(self.threads)
        rc = self.lib.spec_qd_forward(ctypes.byref(self.model), new.ctypes.data, len(new), self.n,
                                      self.logits.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"spec.cpu.qdraft's forward failed ({'out of memory' if rc == -2 else rc})")
        self.ids[self.n:self.n + len(new)] = new
        self.n += len(new)
        return torch.from_numpy(self.logits.copy())[None]

    def crop(self, keep: int) -> None:
        self.n = min(self.n, max(0, keep))

    def __len__(self) -> int:
        return self.n

    def held(self) -> torch.Tensor:
        return torch.from_numpy(self.ids[:self.n].astype(np.int64))

    def close(self) -> None:
        self._keep.clear()
        self.kc = self.vc = None
