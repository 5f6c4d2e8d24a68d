"""A hand-written fp32 few-row product, y[M, N] = x[M, K] W[N, K]^T (+ b), for CPU linears (issue 43).

Two layouts (see SOURCE): "rows", nn.Linear's own weight read in place; "panel", what spec.cpu.prepack runs, a
copy reordered once into panels of 16 rows interleaved k by k, each 64-byte line one zmm of 16 outputs
FMA'd against up to 12 rows of x broadcast from L1, the accumulators in registers, the panel streamed
once. The panel copies live on transparent huge pages where Linux gives them (`buffer`), and the kernel
prefetches the stream into L1 and, from 7 rows on where the FMAs bound the pass, far ahead into L2
(spec_gemv_panel). The C source below is plain C (no torch headers) with function-level target
attributes: an AVX-512F variant, an AVX2+FMA one and a plain-C fallback, chosen at run time by
__builtin_cpu_supports, so the library built here (no -march) runs on any x86-64; elsewhere only the
plain-C one is compiled.

`library()` compiles it once with the system C compiler ($CC, else cc) into $SPEC_CACHE (default
~/.cache/spec)/gemv/<source hash>.so and self-tests it in a SUBPROCESS (ctypes only, no torch: a crash
there is a return code here), once per process. Any failure (no compiler, a compile error, a crash or
a wrong result in the self-test) gives None and a debug-level reason (`reason()`), never an exception:
the caller keeps its other path. Everything else calls `product(w, b)`, a function x -> x W^T + b.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# A pool of worker threads for the library's products (POOL below, part of SOURCE): `spec_pool_run(fn, arg,
# parts)` runs fn(arg, i, parts) for i in 0..parts-1, part 0 on the calling thread and the others on workers
# made at the first use. A worker that finishes spins (yielding the core to any other runnable thread) for
# SPIN_NS, so the next product of the same pass finds it awake, then sleeps on a condition variable; a
# fork leaves the child with no workers (made again there when asked).
POOL = r"""
#include <stdint.h>
#include <stddef.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX 64
#define SPIN_NS 300000
typedef void (*pool_fn)(void *arg, int part, int parts);
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pool_fn fn;
    void *arg;
    int parts, workers;
    atomic_uint gen;
    atomic_int left, sleepers;
    atomic_long worked;         /* parts run on workers so far (spec_pool_worked) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
static int pool_threads = 1;    /* the threads a product is split over (spec_pool_threads) */
static int pool_forked_hook = 0;
static unsigned pool_born[POOL_MAX];
static atomic_flag pool_busy = ATOMIC_FLAG_INIT;   /* a caller is running parts on the pool */

static uint64_t pool_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *pool_worker(void *p) {
    int id = (int)(intptr_t)p;
    unsigned seen = pool_born[id];      /* the generation before the first job it is to take */
    for (;;) {
        uint64_t t0 = pool_ns();
        for (unsigned spin = 1; atomic_load_explicit(&pool.gen, memory_order_acquire) == seen; spin++) {
            if (!(spin & 15) && pool_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleepers, 1);
                while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
            sched_yield();
        }
        seen = atomic_load(&pool.gen);
        if (id < pool.parts) {
            pool.fn(pool.arg, id, pool.parts);
            atomic_fetch_add(&pool.worked, 1);
        }
        atomic_fetch_sub_explicit(&pool.left, 1, memory_order_release);
    }
    return NULL;
}

static void pool_child(void) {     /* after fork: the workers stayed in the parent */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    pool.mu = mu;
    pool.cv = cv;
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_flag_clear(&pool_busy);
}

/* The threads products are split over from now on (1: the caller's alone; at most POOL_MAX); returns it. */
int spec_pool_threads(int n) {
    pool_threads = n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : n;
    return pool_threads;
}

long spec_pool_worked(void) { return atomic_load(&pool.worked); }

static void pool_run_locked(pool_fn fn, void *arg, int parts);

/* fn's parts on the pool; a call made while another is on it (another caller thread) runs alone. */
static void pool_run(pool_fn fn, void *arg, int parts) {
    if (parts > pool_threads) parts = pool_threads;
    if (parts <= 1 || atomic_flag_test_and_set(&pool_busy)) { fn(arg, 0, 1); return; }
    pool_run_locked(fn, arg, parts);
    atomic_flag_clear(&pool_busy);
}

static void pool_run_locked(pool_fn fn, void *arg, int parts) {
    if (!pool_forked_hook) { pthread_atfork(NULL, NULL, pool_child); pool_forked_hook = 1; }
    while (pool.workers < parts - 1) {
        pthread_t t;
        pool_born[pool.workers + 1] = atomic_load(&pool.gen);
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        pthread_detach(t);
        pool.workers++;
    }
    if (parts > pool.workers + 1) parts = pool.workers + 1;
    if (parts <= 1) { fn(arg, 0, 1); return; }
    pool.fn = fn;
    pool.arg = arg;
    pool.parts = parts;
    atomic_store(&pool.left, pool.workers);
    atomic_fetch_add(&pool.gen, 1);                 /* seq_cst: then the sleepers count is read */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    fn(arg, 0, parts);
    while (atomic_load_explicit(&pool.left, memory_order_acquire) > 0) sched_yield();
}
"""

# e^x in 16 AVX-512 lanes, and the softmax's and SiLU's loops on it, shared by this library and spec.cpu.qdraft's.
VEXP = r"""
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
/* e^x, 16 lanes: 2^(x log2 e) split into an integer power (scalef) and 2^f, |f| <= 1/2, by its Taylor
   polynomial of degree 7 (relative error ~1e-7 there; a few 1e-6 from rounding x log2 e at |x| near 88) */
static inline __attribute__((always_inline, target("avx512f"))) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-104.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* v[i] = e^(v[i] - mx) for i < n (-inf: exactly 0), 16 lanes at a time; returns their sum */
static __attribute__((target("avx512f"), unused)) float exp_shift512(float *v, int64_t n, float mx) {
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
static __attribute__((target("avx512f"), unused)) int64_t silu_mul512(const float *g, const float *u, float *o,
                                                                      int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                        exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    return i;
}
#endif
"""

SOURCE = POOL + VEXP + r"""
#include <math.h>
#include <stdlib.h>

/* Two layouts of w, both computing y[m*N + n] = sum_k x[m*K + k] * w[n][k] (+ b[n]):
   rows:  w as nn.Linear stores it, [N][K], read in place;
   panel: w reordered once, [ceil(N/16)][K][16] (16 rows interleaved k by k, the last panel zero-padded).
   isa: 2 AVX-512F, 1 AVX2+FMA, 0 plain C; -1 or more than the CPU has: the best it has. */

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

static void panel_c(const float *x, const float *wp, const float *b, float *y, int64_t M, int64_t N,
                    int64_t K) {
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const float *p = wp + n0 * K;
        int64_t w = N - n0 < 16 ? N - n0 : 16;
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0};
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < 16; j++) acc[j] += x[m * K + k] * p[k * 16 + j];
            for (int64_t j = 0; j < w; j++) y[m * N + n0 + j] = b ? acc[j] + b[n0 + j] : acc[j];
        }
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#define T512 __attribute__((target("avx512f")))
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

int spec_gemv_isa(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static int pick(int isa) {
    int best = spec_gemv_isa();
    return isa < 0 || isa > best ? best : isa;
}

static void add_bias(float *y, const float *b, int64_t M, int64_t N, int64_t n0, int64_t n1) {   /* columns n0..n1 */
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) y[m * N + n] += b[n];
}

/* w [N][K] in place; PF floats ahead into L1 (< 0: none); FAR unused (the panel entry's signature).
   Returns the isa used. */
int spec_gemv_rows(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                   int64_t PF, int64_t FAR, int isa) {
    (void)FAR;
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
        int most = j->isa == 2 ? 12 : 6;
        for (int64_t m = 0; m < j->M; ) {
            int64_t mb = j->M - m < most ? j->M - m : most;
            (j->isa == 2 ? panel512 : panel256)[mb](j->x + m * j->K, j->wp, j->y + m * j->N, j->N, j->K,
                                                    m == 0 ? j->PF : 0, m == 0 ? j->FAR : 0, n0, n1);
            m += mb;
        }
        if (j->b) add_bias(j->y, j->b, j->M, j->N, n0, n1);
    }
#endif
}

/* wp [ceil(N/16)][K][16]. isa -1 (auto): on an AVX-512F CPU, 1 or 2 rows run the AVX2+FMA code (measured
   faster there on Zen 4) and more the AVX-512F code. PF (floats ahead into L1), FAR (into L2) < 0: the
   kernel's choice, measured on Zen 4: none for the AVX2 code; for the AVX-512F code FAR 8192 (about one
   panel of K = 576 ahead) from FAR_ROWS rows on, where the FMAs bound the pass and the core's own window
   runs too few lines ahead of them, none below (the stream bounds it there, and the far prefetch cost
   0.1-0.3 more); PF 512 with a far prefetch, 1024 without. FAR 0 and PF -1: the kernel before the far
   prefetch. The panels are split over spec_pool_threads' threads (the plain-C code: one). Returns the isa
   used. */
int spec_gemv_panel(const float *x, const float *wp, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                    int64_t PF, int64_t FAR, int isa) {
    int automatic = isa < 0;
    isa = pick(isa);
#ifdef HAVE_X86
    if (automatic && isa == 2 && M <= 2) isa = 1;
    if (FAR < 0) FAR = isa == 2 && M >= FAR_ROWS ? 8192 : 0;
    if (PF < 0) PF = isa == 2 ? (FAR ? 512 : 1024) : 0;
    if (isa > 0) {
        panel_job j = {x, wp, b, y, M, N, K, PF, FAR, isa};
        pool_run(panel_part, &j, (int)((N + 15) / 16));
        return isa;
    }
#endif
    panel_c(x, wp, b, y, M, N, K);
    return 0;
}

/* The small ops around a Llama layer's products (spec.cpu.plainllama), in transformers' arithmetic: plain C,
   no FMA contraction (the library is built without -march), so each product and sum rounds as torch's.
   RMSNorm over rows of n: y = w (x / sqrt(mean(x^2) + eps)); the sum of squares runs in 16 lanes (torch's
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

#ifdef HAVE_X86
/* One query row's attention over keys 0 .. n-1 (m: a mask row, nonzero may attend, or NULL), D a multiple
   of 16 up to 256, s scratch of n floats: softmax(scale q.k) v into o. Returns 0 where no key may be
   attended (o unwritten). */
static T512 int attend_row512(const float *qv, const float *k, const float *v, int64_t n, const uint8_t *m,
                              float *o, int64_t D, float scale, float *s) {
    const int64_t C = D / 16;
    __m512 qr[16], acc[16];
    for (int64_t c = 0; c < C; c++) qr[c] = _mm512_mul_ps(_mm512_loadu_ps(qv + 16 * c), _mm512_set1_ps(scale));
    float mx = -INFINITY;
    for (int64_t l = 0; l < n; l++) {
        const float *kl = k + l * D;
        __m512 a = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kl));
        for (int64_t c = 1; c < C; c++) a = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kl + 16 * c), a);
        s[l] = m && !m[l] ? -INFINITY : _mm512_reduce_add_ps(a);
        if (s[l] > mx) mx = s[l];
    }
    if (mx == -INFINITY) return 0;
    const float z = exp_shift512(s, n, mx);
    for (int64_t c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l++) {
        if (s[l] == 0.f) continue;                 /* masked (e^-inf), or underflowed: adds nothing */
        const __m512 p = _mm512_set1_ps(s[l]);
        for (int64_t c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + l * D + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / z);
    for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
    return 1;
}
#endif

/* Attention of one sequence's T query rows of H heads over L keys of KV heads (head h reads key head
   h / (H / KV)): q[t * qt + h * qh + d]; k, v [KV][L][D] (head j at j * kh); mask [T][L] (nonzero: may
   attend) or NULL: row t sees keys 0 .. L - T + t (one row: all of them; T = L: causal). out [T][H][D].
   The 16-lane exponential; the scores' maximum is subtracted first. Returns the (row, head) pairs with no
   key to attend (out left unwritten for them), or -1 where this CPU or D is not covered (AVX-512F, D a multiple
   of 16 up to 256): the caller runs its own attention then. */
int64_t spec_attend(const float *q, int64_t qt, int64_t qh, const float *k, const float *v, int64_t kh, int64_t L,
                    const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KV, int64_t D, float scale) {
#ifdef HAVE_X86
    if (spec_gemv_isa() != 2 || D % 16 || D > 256 || D <= 0 || KV <= 0 || H % KV || L < T) return -1;
    float *s = (float *)malloc((size_t)(L + 16) * sizeof(float));
    if (!s) return -1;
    int64_t empty = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t j = h / (H / KV);
            empty += !attend_row512(q + t * qt + h * qh, k + j * kh, v + j * kh, mask ? L : L - T + t + 1,
                                    mask ? mask + t * L : NULL, out + (t * H + h) * D, D, scale, s);
        }
    free(s);
    return empty;
#else
    (void)q; (void)qt; (void)qh; (void)k; (void)v; (void)kh; (void)L; (void)mask; (void)out; (void)T; (void)H;
    (void)KV; (void)D; (void)scale;
    return -1;
#endif
}

/* SwiGLU's gate: out[r][i] = silu(gu[r][i]) gu[r][inner + i] (gate and up side by side in each row of gu),
   silu(x) = x / (1 + e^-x); e^x in 16 AVX-512 lanes where the CPU has them (exp512: within a few 1e-7 of
   expf), else expf. */
void spec_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner) {
    static int wide = -1;
    if (wide < 0) wide = spec_gemv_isa() == 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inner, *u = g + inner;
        float *o = out + r * inner;
        int64_t i = 0;
#ifdef HAVE_X86
        if (wide) i = silu_mul512(g, u, o, inner);
#endif
        for (; i < inner; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
"""

# Run by `selftest` in a subprocess with the library's path: every ISA this CPU has, against an fp64
# product in Python, over shapes that take every block and tail (M 1-9, N around the 8-row blocks, K
# around 16). ctypes and the standard library only, so it starts in a few tens of milliseconds.
SELFTEST = r"""
import ctypes, random, sys
lib = ctypes.CDLL(sys.argv[1])
lib.spec_gemv_isa.restype = ctypes.c_int
F = ctypes.c_float
rng = random.Random(0)

def panel(w, N, K):
    P = -(-N // 16)
    out = [0.0] * (P * 16 * K)
    for n in range(N):
        for k in range(K):
            out[(n // 16) * 16 * K + k * 16 + n % 16] = w[n * K + k]
    return out

cases = []
for M in range(1, 14):                # every block: rows turns of 1-8 (AVX-512) / 1-4, panel turns of 1-12 / 1-6
    for N, K in ((1, 1), (16, 16), (17, 17), (33, 71)):
        bias = (M + N + K) % 2 == 0
        x = [rng.uniform(-1, 1) for _ in range(M * K)]
        w = [rng.uniform(-1, 1) for _ in range(N * K)]
        b = [rng.uniform(-1, 1) for _ in range(N)] if bias else None
        want, scale = [], []
        for m in range(M):
            for n in range(N):
                dots = [x[m * K + k] * w[n * K + k] for k in range(K)]
                want.append(sum(dots) + (b[n] if bias else 0.0))
                scale.append(sum(abs(d) for d in dots) + (abs(b[n]) if bias else 0.0))
        args = {"rows": (F * len(w))(*w), "panel": (F * (-(-N // 16) * 16 * K))(*panel(w, N, K))}
        cases.append((M, N, K, bias, (F * len(x))(*x), args, (F * N)(*b) if bias else None, want, scale))
lib.spec_pool_threads.restype = ctypes.c_int
for threads, isa in [(1, i) for i in [-1] + list(range(lib.spec_gemv_isa() + 1))] + [(3, -1), (2, -1)]:
    lib.spec_pool_threads(threads)               # -1: the automatic choice; the panels split over threads
    for M, N, K, bias, x, args, b, want, scale in cases:
        for name, wl in args.items():
            y = (F * (M * N))()
            got = getattr(lib, "spec_gemv_" + name)(x, wl, b, y, ctypes.c_int64(M), ctypes.c_int64(N),
                                                    ctypes.c_int64(K), ctypes.c_int64(64 if isa >= 0 else -1),
                                                    ctypes.c_int64(512 if isa >= 0 else -1), ctypes.c_int(isa))
            if got != isa and not (isa < 0 and 0 <= got <= lib.spec_gemv_isa()):
                sys.exit(f"{name}: isa {isa} asked, {got} ran")
            for i in range(M * N):
                if not abs(y[i] - want[i]) <= 1e-5 * scale[i] + 1e-30:
                    sys.exit(f"{name} isa {isa} threads {threads} M={M} N={N} K={K} bias={bias}: "
                             f"y[{i // N},{i % N}] = {y[i]}, "
                             f"fp64 {want[i]}")
# the small ops: RMSNorm and rotary against fp64 (relative to the terms' scale)
for rows, n in ((1, 1), (2, 17), (3, 64)):
    x = [rng.uniform(-2, 2) for _ in range(rows * n)]
    w = [rng.uniform(-2, 2) for _ in range(n)]
    y = (F * (rows * n))()
    lib.spec_rms((F * len(x))(*x), (F * n)(*w), y, ctypes.c_int64(rows), ctypes.c_int64(n), F(1e-5))
    for r in range(rows):
        s = (sum(v * v for v in x[r * n:(r + 1) * n]) / n + 1e-5) ** -0.5
        for i in range(n):
            want = w[i] * x[r * n + i] * s
            if not abs(y[r * n + i] - want) <= 1e-5 * (abs(want) + 1e-30):
                sys.exit(f"spec_rms rows={rows} n={n}: y[{r},{i}] = {y[r * n + i]}, fp64 {want}")
for rows, heads, total, D in ((1, 1, 1, 2), (2, 3, 4, 8)):
    stride = total * D
    x = [rng.uniform(-2, 2) for _ in range(rows * stride)]
    c = [rng.uniform(-1, 1) for _ in range(rows * D)]
    sn = [rng.uniform(-1, 1) for _ in range(rows * D)]
    v = (F * len(x))(*x)
    lib.spec_rotary(v, ctypes.c_int64(rows), ctypes.c_int64(heads), ctypes.c_int64(stride), ctypes.c_int64(D),
                    (F * len(c))(*c), (F * len(sn))(*sn))
    for r in range(rows):
        for h in range(total):
            for i in range(D):
                at, half = r * stride + h * D + i, D // 2
                rot = -x[at + half] if i < half else x[at - half]
                want = x[at] * c[r * D + i] + rot * sn[r * D + i] if h < heads else x[at]
                if not abs(v[at] - want) <= 1e-6 * (abs(x[at]) + abs(rot)) + 1e-30:
                    sys.exit(f"spec_rotary rows={rows} heads={heads}: x[{r},{h},{i}] = {v[at]}, fp64 {want}")
import math
for rows, inner in ((1, 1), (2, 19), (3, 64)):
    gu = [rng.uniform(-30, 30) for _ in range(rows * 2 * inner)]
    out = (F * (rows * inner))()
    lib.spec_silu_mul((F * len(gu))(*gu), out, ctypes.c_int64(rows), ctypes.c_int64(inner))
    for r in range(rows):
        for i in range(inner):
            gv, uv = gu[r * 2 * inner + i], gu[r * 2 * inner + inner + i]
            want = gv / (1 + math.exp(-gv)) * uv
            if not abs(out[r * inner + i] - want) <= 1e-5 * abs(want) + 1e-30:
                sys.exit(f"spec_silu_mul rows={rows} inner={inner}: out[{r},{i}] = {out[r * inner + i]}, fp64 {want}")
# attention: against fp64, with a mask (one row masked out entirely: reported, not written), without one
# (each row sees keys up to L - T + t), grouped heads; -1 where the CPU has no AVX-512F
lib.spec_attend.restype = ctypes.c_int64
for T, L, H, KV, D, masked in ((1, 5, 2, 1, 16, False), (3, 7, 4, 2, 32, True), (4, 4, 2, 2, 16, False)):
    q = [rng.uniform(-1, 1) for _ in range(T * H * D)]
    kk = [rng.uniform(-1, 1) for _ in range(KV * L * D)]
    vv = [rng.uniform(-1, 1) for _ in range(KV * L * D)]
    m = [int(rng.random() < 0.7) for _ in range(T * L)] if masked else None
    if masked:
        m[0:L] = [0] * L
        m[L] = 1
    out = (F * (T * H * D))()
    got = lib.spec_attend((F * len(q))(*q), ctypes.c_int64(H * D), ctypes.c_int64(D), (F * len(kk))(*kk),
                          (F * len(vv))(*vv), ctypes.c_int64(L * D), ctypes.c_int64(L),
                          (ctypes.c_uint8 * len(m))(*m) if masked else None, out, ctypes.c_int64(T), ctypes.c_int64(H),
                          ctypes.c_int64(KV), ctypes.c_int64(D), F(0.25))
    if lib.spec_gemv_isa() != 2:
        if got != -1:
            sys.exit(f"spec_attend answered {got} on a CPU without AVX-512F (-1 expected)")
        continue
    if got != (H if masked else 0):
        sys.exit(f"spec_attend T={T} L={L}: {got} (row, head) pairs reported with no key, {H if masked else 0} expected")
    for t in range(T):
        if masked and t == 0:
            continue
        for h in range(H):
            j = h // (H // KV)
            keys = [l for l in range(L) if (m[t * L + l] if masked else l <= L - T + t)]
            sc = [0.25 * sum(q[(t * H + h) * D + d] * kk[(j * L + l) * D + d] for d in range(D)) for l in keys]
            mx = max(sc)
            p = [math.exp(x - mx) for x in sc]
            z = sum(p)
            for d in range(D):
                want = sum(pi * vv[(j * L + l) * D + d] for pi, l in zip(p, keys)) / z
                if not abs(out[(t * H + h) * D + d] - want) <= 1e-5:
                    sys.exit(f"spec_attend T={T} L={L} masked={masked}: out[{t},{h},{d}] = "
                             f"{out[(t * H + h) * D + d]}, fp64 {want}")
print("ok", lib.spec_gemv_isa())
"""

PREFETCH = -1  # floats ahead in w's stream to prefetch into L1; -1: the kernel's own choice (see spec_gemv_panel)
FAR = -1       # floats ahead to prefetch into L2 (the panel layout); -1: the kernel's own choice

_STATE: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser() / "gemv"


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def build() -> Path:
    """The library compiled from SOURCE (cached by the source's and the compiler's hash); raises
    RuntimeError naming the compiler and its output when it cannot be built."""
    return compiled(SOURCE, cache_dir())


def compiled(source: str, folder: Path, flags: tuple[str, ...] = ()) -> Path:
    """`source` (C) compiled with the system compiler ($CC, else cc), -O3 and `flags` into a shared
    library in `folder`, named by the hash of the three (a rerun finds it); RuntimeError naming the
    compiler and its output when it cannot be built."""
    cc = compiler()
    key = hashlib.sha256((source + "\0" + cc + "\0" + " ".join(flags)).encode()).hexdigest()[:16]
    out = Path(folder) / f"{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "lib.c", Path(tmp) / "lib.so"
        src.write_text(source)
        try:
            done = subprocess.run([cc, "-O3", *flags, "-fPIC", "-shared", "-o", str(lib), str(src), "-lm"],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"C compiler {cc!r} could not run: {e}") from e
        if done.returncode != 0 or not lib.exists():
            raise RuntimeError(f"C compiler {cc!r} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        os.replace(lib, out)          # atomic: a concurrent build leaves one whole file
    return out


def selftest(path: Path) -> str | None:
    """None if the library at `path` computes the product right for every ISA this CPU has (run in a
    subprocess: a crash is reported, not suffered), else what went wrong."""
    return run_selftest(SELFTEST, [str(path)], f"the self-test of {path}")


def run_selftest(script: str, argv: list[str], what: str) -> str | None:
    """Run the Python `script` with `argv` in a subprocess (a native crash there is a return code here):
    None when it exits 0, else "`what` failed (return code N): <its last output>"."""
    try:
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the self-test could not run: {e}"
    if done.returncode != 0:
        return f"{what} failed (return code {done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}"
    return None


def decide_once(state: dict, make, name: str):
    """state["lib"], made once per process by `make()` -> (library or None, why not); a RuntimeError or
    OSError from it is a why-not too, logged at debug level under `name`. The native libraries' shared
    decision (spec.cpu.gemv, spec.cpu.qdraft)."""
    if "lib" not in state:
        try:
            lib, why = make()
        except (RuntimeError, OSError) as e:
            lib, why = None, str(e)
        if why is not None:
            log.debug("%s not used: %s", name, why)
        state["lib"], state["why"] = lib, why
    return state["lib"]


def _make():
    path = build()
    why = selftest(path)
    if why is not None:
        return None, why
    lib = ctypes.CDLL(str(path))
    for fn in (lib.spec_gemv_rows, lib.spec_gemv_panel):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    lib.spec_gemv_isa.restype = ctypes.c_int
    lib.spec_pool_threads.restype = ctypes.c_int
    lib.spec_pool_threads.argtypes = [ctypes.c_int]
    lib.spec_pool_worked.restype = ctypes.c_long
    lib.spec_rms.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.spec_rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    lib.spec_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.spec_attend.restype = ctypes.c_int64
    lib.spec_attend.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                                + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_float])
    return lib, None


def library():
    """The built, self-tested library (ctypes.CDLL), or None with `reason()` saying why; decided once
    per process."""
    return decide_once(_STATE, _make, "spec.cpu.gemv")


def reason() -> str | None:
    """Why `library()` is None (None when it is not, or was not asked yet)."""
    return _STATE.get("why")


def forget() -> None:
    """Decide again at the next `library()` (tests: another $CC)."""
    _STATE.clear()


def set_threads(n: int) -> int:
    """Split the panel products over `n` threads from now on (the calling thread and n - 1 workers of the
    library's pool, made at the first product that needs them); the result does not depend on `n`.
    Returns the count in force (1 without a library)."""
    lib = library()
    return 1 if lib is None else lib.spec_pool_threads(int(n))


def worked() -> int:
    """Parts of products the pool's workers have run in this process (0 without a library)."""
    lib = library()
    return 0 if lib is None else lib.spec_pool_worked()


def isa() -> int:
    """The variant this CPU runs: 2 AVX-512F, 1 AVX2+FMA, 0 plain C; -1 without a library."""
    lib = library()
    return -1 if lib is None else lib.spec_gemv_isa()


# The panel copies live in anonymous memory asked for transparent huge pages (madvise(MADV_HUGEPAGE);
# Linux's default THP mode "madvise" gives them only where asked, torch's allocator does not ask). On the
# measured Zen 4 the 211 products over SmolLM2's 538 MB took 0.65-0.75 of the time on 4 KB pages at 1 row
# and 0.75-0.8 at 9 (docs/BENCHMARKS.md, "A hand-written few-row kernel"): a TLB miss per 4 KB and
# hardware prefetchers that stop at each 4 KB page. Copies up to ARENA_CHUNK / 2 share 2 MB-aligned chunks
# of ARENA_CHUNK bytes (a chunk is unmapped when the last tensor in it goes), larger ones get their own
# mapping. Where there is no madvise or no MADV_HUGEPAGE (not Linux), or the mapping fails: torch's memory.
HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20
_ARENA: dict = {"map": None, "base": 0, "used": 0, "size": 0}
_ARENA_LOCK = threading.Lock()


def _mapping(nbytes: int):
    """(an anonymous private mapping of at least nbytes from a 2 MB boundary, asked for huge pages, the
    boundary's offset in it)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor                                     # (an exported buffer would keep the map from closing)
    return mm, (-address) % HUGE_PAGE


def buffer(numel: int, huge: bool = True) -> torch.Tensor:
    """An fp32 tensor of `numel` elements, contents unspecified: with `huge`, 4 KB-aligned in memory asked
    for transparent huge pages (see HUGE_PAGE above), else (or where that is not possible) torch's."""
    nbytes = -(-numel * 4 // 4096) * 4096
    if not huge or not nbytes or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(numel, dtype=torch.float32)
    try:
        with _ARENA_LOCK:
            if nbytes > ARENA_CHUNK // 2:
                mm, offset = _mapping(nbytes)
            else:
                if _ARENA["map"] is None or _ARENA["used"] + nbytes > _ARENA["size"]:
                    mm, base = _mapping(ARENA_CHUNK)
                    _ARENA.update(map=mm, base=base, used=0, size=ARENA_CHUNK)
                mm, offset = _ARENA["map"], _ARENA["base"] + _ARENA["used"]
                _ARENA["used"] += nbytes
            return torch.frombuffer(mm, dtype=torch.float32, count=numel, offset=offset)
    except (OSError, ValueError) as e:
        log.debug("spec.cpu.gemv: no huge-page mapping (%s); torch's memory", e)
        return torch.empty(numel, dtype=torch.float32)


def panels(weight: torch.Tensor, huge: bool = True) -> torch.Tensor:
    """W [N, K] reordered for the panel layout: [ceil(N/16), K, 16], panel p holding rows 16p..16p+15
    interleaved k by k (the last panel's missing rows zero); in `buffer`'s memory (`huge`: huge pages)."""
    N, K = weight.shape
    P = -(-N // 16)
    return _fill_panels(buffer(P * K * 16, huge).view(P, K, 16), weight)


def _fill_panels(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    N, K = weight.shape
    P = out.shape[0]
    full = N // 16
    w = weight.detach()
    if full:
        out[:full].copy_(w[:full * 16].view(full, 16, K).transpose(1, 2))
    if full < P:
        tail = w.new_zeros(16, K)
        tail[:N - full * 16] = w[full * 16:]
        out[full].copy_(tail.t())
    return out


def product(weight: torch.Tensor, bias: torch.Tensor | None = None, layout: str = "panel",
            prefetch: int | None = None, variant: int = -1, far: int | None = None, huge: bool = True):
    """x -> x W^T + b on the library (which must be there: see `library()`), W [N, K] fp32 contiguous
    on CPU as nn.Linear stores it; x [..., K] fp32 on CPU. layout "rows": W read in place; "panel": a
    reordered copy made here once (`panels`; `huge`: on huge pages). `variant`: the ISA to use at most
    (-1: chosen by the kernel per call, see spec_gemv_panel; 2 AVX-512F, 1 AVX2+FMA, 0 plain C).
    `prefetch`, `far`: floats ahead in the weight's stream prefetched into L1 and into L2 (None: PREFETCH,
    FAR; -1: the kernel's choice; 0 none; `far` only in the panel layout). The Product keeps the tensors
    it reads alive (`keep`)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"spec.cpu.gemv's library is not available: {reason()}")
    if layout not in ("rows", "panel"):
        raise ValueError(f"layout: 'rows' or 'panel', got {layout!r}")
    w = weight.detach()
    b = None if bias is None else bias.detach()
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name}: fp32 contiguous on CPU expected, got {t.dtype} on {t.device}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
    if w.dim() != 2 or (b is not None and b.shape != (w.shape[0],)):
        raise ValueError(f"weight [N, K] and bias [N] expected, got {tuple(w.shape)} and "
                         f"{None if b is None else tuple(b.shape)}")
    N, K = w.shape
    return Product(lib.spec_gemv_panel if layout == "panel" else lib.spec_gemv_rows,
                   panels(w, huge) if layout == "panel" else w, b, N, K, PREFETCH if prefetch is None else prefetch,
                   FAR if far is None else far, variant)


def grouped(weights: list[torch.Tensor], biases: list[torch.Tensor | None], huge: bool = True):
    """Products of several weights that read the same x (q, k, v; gate, up), in the panel layout:
    (one Product of all of them, x -> [x W1^T + b1 | x W2^T + b2 | ...], and one Product per weight),
    the per-weight ones reading their part of the whole one's panels (no second copy). Every output column
    is summed as in its own product (`product`'s): the whole one's columns are bit-identical to the parts'.
    None where a weight other than the last has rows not a multiple of 16 (its last panel would hold the
    next weight's rows), or the weights differ in K or layout (fp32 contiguous on CPU, as `product`)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"spec.cpu.gemv's library is not available: {reason()}")
    K = weights[0].shape[1]
    if any(w.dim() != 2 or w.shape[1] != K or w.dtype != torch.float32 or w.device.type != "cpu"
           or not w.is_contiguous() for w in weights) or any(w.shape[0] % 16 for w in weights[:-1]):
        return None
    Ns = [w.shape[0] for w in weights]
    Ps = [-(-n // 16) for n in Ns]
    whole = buffer(sum(Ps) * K * 16, huge).view(sum(Ps), K, 16)
    parts, at = [], 0
    for w, P in zip(weights, Ps):
        parts.append(_fill_panels(whole[at:at + P], w.detach()))
        at += P
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
    make = lambda w, b, N: Product(lib.spec_gemv_panel, w, b, N, K, PREFETCH, FAR, -1)  # noqa: E731
    return make(whole, bias, sum(Ns)), [make(part, None if b is None else b.detach(), N)
                                         for part, b, N in zip(parts, biases, Ns)]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's function over the last axis of fp32 contiguous CPU `x` on the library (see spec_rms):
    weight * (x / sqrt(mean(x^2) + eps)), weight fp32 contiguous [n]. The caller has checked the library."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    library().spec_rms(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def rotary_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding (rotate-half) in place on the first `heads` heads of fp32 contiguous
    CPU `x` [..., all heads, D], with cos and sin [..., D] contiguous (one row per row of x); returns x."""
    D = cos.shape[-1]
    rows = cos.numel() // D
    library().spec_rotary(x.data_ptr(), rows, heads, x.numel() // rows, D, cos.data_ptr(), sin.data_ptr())
    return x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """Attention of one sequence on the library (spec_attend): q [1, H, T, D] (last axis contiguous), k and v
    [1, KV, L, D] with each head's rows contiguous (as a DynamicCache holds them), fp32 on CPU; `mask` None
    (row t sees keys up to L - T + t: one row sees all, T = L is causal) or bool [1, 1, T, L] (True: may
    attend). Returns [1, T, H * D]; None where the inputs are not of that form, the CPU or head size is not
    covered, or a row may attend to no key: the caller runs its own attention then."""
    B, H, T, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    if (B != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != D or H % KV or q.stride(3) != 1
            or not q.dtype == k.dtype == v.dtype == torch.float32 or k.stride()[1:] != (L * D, D, 1)
            or v.stride()[1:] != (L * D, D, 1) or L < T):
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape != (1, 1, T, L):
            return None
        mask = mask.contiguous()
    out = q.new_empty(1, T, H * D)
    done = library().spec_attend(q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1), L,
                                 None if mask is None else mask.data_ptr(), out.data_ptr(), T, H, KV, D, scale)
    return out if done == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fp32 CPU `gate_up` [..., 2 * inner], gate and up side by side (a Group's output):
    [..., inner] (see spec_silu_mul). The caller has checked the library."""
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    library().spec_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inner), inner)
    return out


class Product:
    """x -> x W^T + b through one of the library's entries (made by `product` or `grouped`)."""

    def __init__(self, call, w: torch.Tensor, b: torch.Tensor | None, N: int, K: int, prefetch: int, far: int,
                 variant: int):
        self.call, self.N, self.K, self.prefetch, self.far, self.variant = call, N, K, prefetch, far, variant
        self.keep = (w, b)        # the tensors whose memory the library reads
        self.wp, self.bp = w.data_ptr(), (None if b is None else b.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        K = self.K
        if x.shape[-1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x: fp32 [..., {K}] on CPU expected, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        M = x.numel() // K
        y = torch.empty(*x.shape[:-1], self.N, dtype=torch.float32)
        if M:
            self.call(x.data_ptr(), self.wp, self.bp, y.data_ptr(), M, self.N, K, self.prefetch, self.far,
                      self.variant)
        return y
