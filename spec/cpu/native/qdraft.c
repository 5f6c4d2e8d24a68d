/* The block-quantized Llama forward of a draft model (spec.cpu.qdraft): its products on 16-row records of
   Q4_1 / Q8_0 blocks, the rest on layer.c's ops (the same RMSNorm, rotary, attention and SiLU gate as the
   fp32 target's plain layers). The draft's numbers never reach the output (the target decides every
   token), so it may round as it likes; the self-test bounds its products against a double reference.

   A weight matrix W [N][K] (N % 16 == 0, K % 32 == 0) is stored as records, one per (panel p of 16
   rows, block b of 32 inputs), in the order p, b:
     kind 4 (from Q4_1): 256 bytes of nibbles then 16 fp16 d then 16 fp16 m (320 bytes);
        byte (i, j, t) at 64 i + 4 j + t, i < 4, row 16p + j: low nibble = u[32b + 4i + t],
        high nibble = u[32b + 16 + 4i + t];
     kind 8 (from Q8_0): 512 bytes, byte (g, j, t) at 64 g + 4 j + t = u[32b + 4g + t], then d, m.
   The weight is w = d u + m (Q4_1: u the nibble, d and m the block's; Q8_0: u = q + 128, m = -128 d).
   Activations are quantized per block of 32 to int8 (xq, scale xd, xs = xd * sum xq), so a block's dot
   is d xd sum(u xq) + m xs, the integer sum exact (VNNI dpbusd in the VNNI variant). Two matrices that
   read the same input (q, k, v; gate, up) are one matrix, their records one after the other. */
#include "half.h"
#include "spec_native.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define REC(kind) ((kind) == 4 ? 320 : 576)
#define WBYTES(kind) ((kind) == 4 ? 256 : 512)

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
        float d = spec_h2f(dm[j]), m = spec_h2f(dm[16 + j]);
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

#if defined(__x86_64__)
#include <immintrin.h>
#define QD_VNNI 1
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

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
    static TVNNI void qmv_##RR(const uint8_t *W, int kind, int64_t N, int64_t K, const int8_t *xq,            \
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
#define CHUNK 64   /* rows of a prefill per pass over the weights (spec_qd_forward) */

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
                    acc += (float)s * xd[r * B + b] * spec_h2f(dm[j]) + spec_h2f(dm[16 + j]) * xs[r * B + b];
                }
                y[r * N + 16 * p + j] = acc;
            }
}

typedef struct { const uint8_t *W; int kind; int64_t N, K; const int8_t *xq; const float *xd, *xs; int64_t R;
                 float *y; int vnni; } qmv_job;

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

/* y[R][N] = W x for R quantized rows (xq [R][K], xd and xs [R][K/32]), the panels split over `threads`
   threads; isa: the VNNI kernel at SPEC_ISA_VNNI, else the plain-C one. */
void spec_qd_matvec(const uint8_t *W, int64_t kind, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, int64_t R, float *y, int isa, int threads) {
    qmv_job j = {W, (int)kind, N, K, xq, xd, xs, R, y, spec_pick_isa(isa) >= SPEC_ISA_VNNI};
    pool_run(qmv_part, &j, (int)(N / 16), threads);
}

static void linear(const spec_qd_model *m, const uint8_t *W, int64_t kind, int64_t N, int64_t K, const float *x,
                   int64_t R, float *y, int8_t *xq, float *xd, float *xs) {
    spec_qd_quantize(x, R, K, xq, xd, xs);
    spec_qd_matvec(W, kind, N, K, xq, xd, xs, R, y, (int)m->isa, (int)m->threads);
}

/* Whether n positions from pos0 fit the cache (the last slot included). */
static int qd_fits(const spec_qd_model *m, int64_t n, int64_t pos0) {
    return n > 0 && pos0 >= 0 && pos0 + n <= m->n_ctx;
}

/* transformers' rotary tables for positions p0..p0+R: the angles twice over, [R][head_dim] each. */
void spec_qd_tables(const spec_qd_model *m, int64_t p0, int64_t R, float *cs, float *sn) {
    const int64_t hd = m->head_dim;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < hd / 2; i++) {
            const float f = (float)(p0 + r) * powf(m->theta, -2.f * (float)i / (float)hd);
            cs[r * hd + i] = cs[r * hd + hd / 2 + i] = cosf(f);
            sn[r * hd + i] = sn[r * hd + hd / 2 + i] = sinf(f);
        }
}

/* Layer l's key block b of key head j (16 positions x head_dim, d-major) */
static uint16_t *qd_kblock(const spec_qd_model *m, int64_t l, int64_t j, int64_t b) {
    return m->kc + ((l * m->n_kv + j) * SPEC_QD_BLOCKS(m->n_ctx) + b) * 16 * m->head_dim;
}

/* Layer l's keys and values for R rows at positions p0.. (each row: its keys, then its values; rows `stride`
   floats apart): the keys rotated, both stored in its caches as halves. */
static void qd_store(const spec_qd_model *m, int64_t l, float *kv, int64_t stride, int64_t R, int64_t p0,
                     const float *cs, const float *sn) {
    const int64_t hd = m->head_dim, kvd = m->n_kv * hd;
    uint16_t *vc = m->vc + l * m->n_ctx * kvd;
    spec_rotary(kv, R, m->n_kv, stride, hd, cs, sn);
    for (int64_t r = 0; r < R; r++) {
        const int64_t p = p0 + r;
        for (int64_t j = 0; j < m->n_kv; j++) {
            uint16_t *kb = qd_kblock(m, l, j, p / 16) + p % 16;
            const float *k = kv + r * stride + j * hd;
            for (int64_t d = 0; d < hd; d++) kb[d * 16] = spec_f2h(k[d]);
        }
        const float *v = kv + r * stride + kvd;
        for (int64_t i = 0; i < kvd; i++) vc[p * kvd + i] = spec_f2h(v[i]);
    }
}

/* Layer l's q|k|v rows [R][QKV] for positions p0..: rotated, their keys and values stored in its caches. */
static void qd_rotate_and_store(const spec_qd_model *m, int64_t l, float *qkv, int64_t R, int64_t p0,
                                const float *cs, const float *sn) {
    const int64_t D = m->dim, QKV = D + 2 * m->n_kv * m->head_dim;
    spec_rotary(qkv, R, m->n_head, QKV, m->head_dim, cs, sn);
    qd_store(m, l, qkv + D, QKV, R, p0, cs, sn);
}

/* Layer l's attention for R rows at positions p0.. (row r sees keys 0 .. p0 + r), q in qkv's rows [R][QKV]
   (rotated): each key head's G = n_head / n_kv query heads together on layer.c's spec_attend_blocked, which
   reads the head's keys and values once. out [R][n_head * head_dim]. 0, or -2 when memory runs out. */
static int qd_context(const spec_qd_model *m, int64_t l, const float *qkv, int64_t R, int64_t p0, float *out) {
    const int64_t hd = m->head_dim, H = m->n_head, KV = m->n_kv, G = H / KV, kvd = KV * hd, QKV = m->dim + 2 * kvd;
    const int64_t ss = SPEC_QD_BLOCKS(m->n_ctx) * 16;
    float *s = malloc(sizeof(float) * (size_t)(G * ss)), *q = malloc(sizeof(float) * (size_t)(G * hd));
    if (!s || !q) { free(s); free(q); return -2; }
    const float scale = 1.f / sqrtf((float)hd);
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < KV; j++) {
            for (int64_t i = 0; i < G * hd; i++) q[i] = qkv[r * QKV + j * G * hd + i] * scale;
            spec_attend_blocked(q, G, hd, qd_kblock(m, l, j, 0), m->vc + l * m->n_ctx * kvd + j * hd, kvd, p0 + r + 1,
                                s, ss, out + r * H * hd + j * G * hd, (int)m->isa);
        }
    free(s);
    free(q);
    return 0;
}

/* Feed ids[0..n) at positions pos0.. (the cache holds pos0 positions before), CHUNK rows a pass over the
   weights (a prefill streams each matrix from memory once per CHUNK rows; the products take RMAX rows a turn);
   logits: the last position's [vocab]. 0, or -1 when the positions do not fit, -2 when memory runs out. */
int spec_qd_forward(const spec_qd_model *m, const int32_t *ids, int64_t n, int64_t pos0, float *logits) {
    if (!qd_fits(m, n, pos0)) return -1;
    const int64_t D = m->dim, F = m->ffn, hd = m->head_dim, kvd = m->n_kv * hd;
    const int64_t QKV = D + 2 * kvd, widest = F > D ? F : D;
    float *x = malloc(sizeof(float) * CHUNK * D), *h = malloc(sizeof(float) * CHUNK * D);
    float *qkv = malloc(sizeof(float) * CHUNK * QKV), *gu = malloc(sizeof(float) * CHUNK * 2 * F);
    float *g = malloc(sizeof(float) * CHUNK * F), *o = malloc(sizeof(float) * CHUNK * D);
    int8_t *xq = malloc((size_t)CHUNK * widest);
    float *xd = malloc(sizeof(float) * CHUNK * widest / 32), *xs = malloc(sizeof(float) * CHUNK * widest / 32);
    float *cs = malloc(sizeof(float) * CHUNK * hd), *sn = malloc(sizeof(float) * CHUNK * hd);
    int rc = 0;
    if (!x || !h || !qkv || !gu || !g || !o || !xq || !xd || !xs || !cs || !sn) { rc = -2; goto done; }
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t R = n - c0 < CHUNK ? n - c0 : CHUNK, p0 = pos0 + c0;
        for (int64_t r = 0; r < R; r++) spec_qd_row(m->embd, m->embd_kind, m->vocab, D, ids[c0 + r], x + r * D);
        spec_qd_tables(m, p0, R, cs, sn);
        for (int64_t l = 0; l < m->n_layer; l++) {
            const uint8_t *const *W = m->mats + 4 * l;
            const int64_t *kd = m->kinds + 4 * l;
            spec_rms(x, m->norms[2 * l], h, R, D, m->eps);
            linear(m, W[0], kd[0], QKV, D, h, R, qkv, xq, xd, xs);
            qd_rotate_and_store(m, l, qkv, R, p0, cs, sn);
            if (qd_context(m, l, qkv, R, p0, h) != 0) { rc = -2; goto done; }
            linear(m, W[1], kd[1], D, D, h, R, o, xq, xd, xs);
            for (int64_t i = 0; i < R * D; i++) x[i] += o[i];
            spec_rms(x, m->norms[2 * l + 1], h, R, D, m->eps);
            linear(m, W[2], kd[2], 2 * F, D, h, R, gu, xq, xd, xs);
            spec_silu_mul(gu, g, R, F, (int)m->isa);
            linear(m, W[3], kd[3], D, F, g, R, o, xq, xd, xs);
            for (int64_t i = 0; i < R * D; i++) x[i] += o[i];
        }
        if (c0 + R == n) {
            spec_rms(x + (R - 1) * D, m->out_norm, h, 1, D, m->eps);
            linear(m, m->out, m->out_kind, m->vocab, D, h, 1, logits, xq, xd, xs);
        }
    }
done:
    free(x); free(h); free(qkv); free(gu); free(g); free(o); free(xq); free(xd); free(xs); free(cs); free(sn);
    return rc;
}

/* The keys and values of positions pos0..pos0+n from given layer inputs instead of the draft's own forward,
   for layers l0..l1: layer l's input at position pos0 + i at hidden + (l - l0) ls + i rs (dim floats; a
   target of the same shape hands its own: transformers' hidden_states 0..n_layer-1, read where they lie; or
   one layer at a time as its pass makes them), through the draft's norm, its k and v products (the fused
   matrix's key and value rows alone) and rotary, into the caches, CHUNK rows at a time. cs, sn: the rotary
   tables of those positions (spec_qd_tables, [n][head_dim] each; made once for a fill of many layer ranges).
   0, or -1 when the positions or layers do not fit, -2 when memory runs out. */
int spec_qd_fill(const spec_qd_model *m, const float *hidden, int64_t n, int64_t pos0, int64_t rs, int64_t ls,
                 int64_t l0, int64_t l1, const float *cs, const float *sn) {
    if (!qd_fits(m, n, pos0) || l0 < 0 || l1 > m->n_layer || l0 >= l1) return -1;
    const int64_t D = m->dim, hd = m->head_dim, KV2 = 2 * m->n_kv * hd;
    float *h = malloc(sizeof(float) * CHUNK * D), *kv = malloc(sizeof(float) * CHUNK * KV2);
    int8_t *xq = malloc((size_t)CHUNK * D);
    float *xd = malloc(sizeof(float) * CHUNK * D / 32), *xs = malloc(sizeof(float) * CHUNK * D / 32);
    int rc = 0;
    if (!h || !kv || !xq || !xd || !xs) { rc = -2; goto done; }
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t rows = n - c0 < CHUNK ? n - c0 : CHUNK;
        for (int64_t l = l0; l < l1; l++) {
            for (int64_t r = 0; r < rows; r++)
                spec_rms(hidden + (l - l0) * ls + (c0 + r) * rs, m->norms[2 * l], h + r * D, 1, D, m->eps);
            /* past its first D rows (q's): D / 16 whole panels of D / 32 records (_check: D a multiple of 32) */
            const uint8_t *wkv = m->mats[4 * l] + (D / 16) * (D / 32) * REC(m->kinds[4 * l]);
            linear(m, wkv, m->kinds[4 * l], KV2, D, h, rows, kv, xq, xd, xs);
            qd_store(m, l, kv, KV2, rows, pos0 + c0, cs + c0 * hd, sn + c0 * hd);
        }
    }
done:
    free(h); free(kv); free(xq); free(xd); free(xs);
    return rc;
}
