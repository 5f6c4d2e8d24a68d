/* e^x in 16 AVX-512 lanes, and the softmax's and SiLU's loops on it (layer.c). */
#ifndef SPEC_VEXP_H
#define SPEC_VEXP_H
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define T512 __attribute__((target("avx512f")))

/* e^x, 16 lanes: 2^(x log2 e) split into an integer power (scalef) and 2^f, |f| <= 1/2, by its Taylor
   polynomial of degree 7 (relative error ~1e-7 there; a few 1e-6 from rounding x log2 e at |x| near 88) */
static inline __attribute__((always_inline)) T512 __m512 exp512(__m512 x) {
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
#endif
#endif
