/* IEEE half precision (binary16) <-> float, in plain C: the quantized draft's fp16 block scales and its key
   and value caches. spec_f2h rounds to nearest, ties to even (as F16C's vcvtps2ph with
   _MM_FROUND_TO_NEAREST_INT): a magnitude past 65504 becomes infinity, one below 2^-25 zero, a NaN a quiet NaN
   keeping the top of its payload. spec_h2f is exact. */
#ifndef SPEC_HALF_H
#define SPEC_HALF_H

#include <stdint.h>
#include <string.h>

static inline float spec_h2f(uint16_t h) {
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

static inline uint16_t spec_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t s = (x >> 16) & 0x8000u, e = (x >> 23) & 255, m = x & 0x7fffffu;
    if (e == 255) return (uint16_t)(s | 0x7c00u | (m ? 0x200u | (m >> 13) : 0));     /* infinity, NaN */
    const int32_t he = (int32_t)e - 112;                 /* the half's biased exponent */
    if (he >= 31) return (uint16_t)(s | 0x7c00u);        /* past the largest half */
    uint32_t h, rem, tie;
    if (he <= 0) {                                       /* a subnormal half, or zero */
        if (he < -10) return (uint16_t)s;
        const int shift = 14 - he;                       /* (the implicit bit made explicit) */
        const uint32_t mm = m | 0x800000u;
        h = mm >> shift, rem = mm & ((1u << shift) - 1), tie = 1u << (shift - 1);
    } else
        h = ((uint32_t)he << 10) | (m >> 13), rem = m & 0x1fffu, tie = 0x1000u;
    if (rem > tie || (rem == tie && (h & 1))) h++;       /* (a carry walks into the exponent: right) */
    return (uint16_t)(s | h);
}

#endif
