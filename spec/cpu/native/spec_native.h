/* spec's CPU runtime: one library, built by spec/cpu/native.py from the sources beside this header with
   explicit flags (-O3 -ffp-contract=off -fno-fast-math: no FMA contraction, no reassociation, so each
   sum rounds in the order written). Every entry takes `isa`, the instruction-set variant to run at most
   (SPEC_ISA_*; -1: the best this CPU has), and the kernels `threads`, the threads their panels split over
   (the caller's and threads - 1 of the library's pool): no state of the caller's process is changed. */
#ifndef SPEC_NATIVE_H
#define SPEC_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define SPEC_ISA_C 0        /* plain C: any CPU */
#define SPEC_ISA_AVX2 1     /* AVX2 + FMA */
#define SPEC_ISA_AVX512 2   /* AVX-512F */
#define SPEC_ISA_VNNI 3     /* AVX-512F, BW, VL, VNNI, F16C, FMA: the quantized draft's kernel */

#define HIDDEN __attribute__((visibility("hidden")))

/* the best variant this CPU runs; and `isa` as asked (-1 or more than the CPU has: the best) */
int spec_native_isa(void);
HIDDEN int spec_pick_isa(int isa);

/* pool.c: fn(arg, i, parts) for i < parts, part 0 on the caller, the rest on the pool's workers (made at
   the first use; parts is cut to `threads`). A call made while another caller holds the pool runs alone. */
typedef void (*pool_fn)(void *arg, int part, int parts);
HIDDEN void pool_run(pool_fn fn, void *arg, int parts, int threads);
long spec_pool_worked(void);

/* gemv.c: y[M][N] = x[M][K] w^T (+ b), w as nn.Linear stores it ("rows") or in panels of 16 rows
   interleaved k by k ("panel", [ceil(N/16)][K][16], the last zero-padded). PF, FAR: floats ahead to
   prefetch into L1 and L2 (< 0: the kernel's choice). Return the variant that ran. */
int spec_gemv_rows(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                   int64_t PF, int64_t FAR, int isa, int threads);
int spec_gemv_panel(const float *x, const float *wp, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                    int64_t PF, int64_t FAR, int isa, int threads);

/* layer.c: a Llama layer's small ops, in transformers' arithmetic (see each) */
void spec_rms(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps);
void spec_rotary(float *x, int64_t rows, int64_t heads, int64_t stride, int64_t D, const float *cos,
                 const float *sin);
int64_t spec_attend(const float *q, int64_t qt, int64_t qh, const float *k, const float *v, int64_t kh, int64_t kt,
                    int64_t L, const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KV, int64_t D,
                    float scale, int isa, int threads);
void spec_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner, int isa);
HIDDEN void spec_attend_blocked(const float *q, int64_t G, int64_t D, const uint16_t *kb, const uint16_t *v,
                                int64_t vt, int64_t n, float *s, int64_t ss, float *o, int isa);  /* the draft's */

/* qdraft.c: the block-quantized Llama forward of a draft (its own comment says the layout). Its caches hold
   IEEE halves (half.h): the key cache kc n_layer x n_kv x SPEC_QD_BLOCKS(n_ctx) blocks of 16 positions x
   head_dim, d-major in a block (a key's dim d of position p at [d][p % 16]); the value cache vc
   [n_layer][n_ctx][n_kv * head_dim]. */
#define SPEC_QD_BLOCKS(n_ctx) (((n_ctx) + 15) / 16)
typedef struct {
    int64_t n_layer, dim, n_head, n_kv, head_dim, ffn, vocab, n_ctx;
    float eps, theta;
    const uint8_t *embd;           /* token embedding, [vocab][dim] */
    int64_t embd_kind;
    const uint8_t *out;            /* output projection, [vocab][dim] */
    int64_t out_kind;
    const float *out_norm;
    const float *const *norms;     /* [n_layer][2]: attention, ffn */
    const uint8_t *const *mats;    /* [n_layer][4]: q|k|v, o, gate|up, down */
    const int64_t *kinds;          /* [n_layer][4] */
    uint16_t *kc, *vc;             /* the key and value caches (above), halves */
    int64_t isa, threads;
} spec_qd_model;
void spec_qd_row(const uint8_t *W, int64_t kind, int64_t N, int64_t K, int64_t row, float *out);
void spec_qd_quantize(const float *x, int64_t R, int64_t K, int8_t *q, float *xd, float *xs);
void spec_qd_matvec(const uint8_t *W, int64_t kind, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, int64_t R, float *y, int isa, int threads);
int spec_qd_forward(const spec_qd_model *m, const int32_t *ids, int64_t n, int64_t pos0, float *logits);
int spec_qd_fill(const spec_qd_model *m, const float *hidden, int64_t n, int64_t pos0, int64_t rs, int64_t ls,
                 int64_t l0, int64_t l1, const float *cs, const float *sn);
void spec_qd_tables(const spec_qd_model *m, int64_t p0, int64_t R, float *cs, float *sn);

/* selftest.c: every entry at variant `isa` (and `threads`) against a double-precision reference, on
   ragged shapes; 0, or nonzero with what went wrong in msg */
int spec_selftest(int isa, int threads, char *msg, size_t len);

#endif
