/* tests/test_kn_mixed.c — the ops of drafter training with BF16 saved activations (cast2d,
 * matmul, swiglu_typed, swiglu_bwd_typed; kernels/ref/kn_mixed_ref.c, kernels/kn_matmul.cu,
 * kernels/kn_elementwise_bwd.cu).
 *   cpu:  the reference against the established entries it generalises: matmul with any
 *         transpose, leading dimensions and BF16 operands equals kn_ref_gemm on the widened,
 *         materialised op(A) and op(B)ᵀ; its packed F32 cases equal gemm, gemm_dx, gemm_dw;
 *         BF16 outputs are the RNE rounding of the F32 ones; the typed SwiGLU pair equals
 *         swiglu / swiglu_bwd bit for bit in F32 and in place.
 *   cuda: (label gpu; 77 without a device) every op on odd shapes against the reference: cast2d
 *         bit-exact, matmul in F32 mode within 1e-5 and bit-identical to gemm/gemm_dx/gemm_dw on
 *         the packed F32 cases, in BF16 mode within 1e-5 of the reference on bf16-rounded
 *         operands (1 bf16 ulp for a BF16 C), the SwiGLU pair within 1e-6 (1 ulp in BF16), its
 *         BF16 vector kernels bit-identical to the same op one value at a time; the
 *         multi-tensor optimizer step (sumsq_multi, adamw_multi) within 1e-12 / 1e-6 of the
 *         reference, bit-identical when repeated, its bf16 copies (aligned and not; both
 *         backends) the RNE rounding of the updated values bit for bit, and writing nothing
 *         (copies included) after a non-finite norm;
 *         rmsnorm_bwd_acc = cuda rmsnorm_bwd + add bit for bit, and within 1e-5 of the reference.
 * Both: rmsnorm_bwd_acc is rmsnorm_bwd into a temporary plus add, bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "kn_ref.h"
#include "tst.h"
#include "tst_kn.h"

static float urand(void) { /* [-1, 1) */
    return (float)(tst_urand() * 2.0 - 1.0);
}

static float *rand_f(int64_t n, float scale) {
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = scale * urand();
    return x;
}

static uint16_t *to_bf(const float *x, int64_t n) {
    uint16_t *y = malloc((size_t)n * sizeof *y);
    for (int64_t i = 0; i < n; i++)
        y[i] = cm_f32_to_bf16(x[i]);
    return y;
}

static float *widen(const void *x, cm_dtype dt, int64_t n) {
    float *y = malloc((size_t)n * sizeof *y);
    for (int64_t i = 0; i < n; i++)
        y[i] = dt == CM_DTYPE_F32 ? ((const float *)x)[i] : cm_bf16_to_f32(((const uint16_t *)x)[i]);
    return y;
}

/* op(X) [rows, cols] (F32) from X stored with ld, transposed or not, in dt. */
static float *materialise(const void *x, cm_dtype dt, int64_t ld, int trans, int64_t rows, int64_t cols) {
    float *y = malloc((size_t)(rows * cols) * sizeof *y);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = trans ? c * ld + r : r * ld + c;
            y[r * cols + c] =
                dt == CM_DTYPE_F32 ? ((const float *)x)[i] : cm_bf16_to_f32(((const uint16_t *)x)[i]);
        }
    return y;
}

typedef struct mm_case {
    int64_t  M, N, K;
    int      ta, tb, pad; /* transposes; extra elements per stored row */
    cm_dtype adt, bdt, cdt;
    int      acc;
} mm_case;

/* An operand stored [rows, ld] (its rows hold ld ≥ cols elements), random, in dt. */
static void *operand(int64_t rows, int64_t ld, cm_dtype dt) {
    float *f = rand_f(rows * ld, 1.0f);
    if (dt == CM_DTYPE_F32)
        return f;
    uint16_t *b = to_bf(f, rows * ld);
    free(f);
    return b;
}

static const mm_case cases[] = {
    {37, 29, 53, 0, 1, 0, CM_DTYPE_F32, CM_DTYPE_F32, CM_DTYPE_F32, 0},   /* gemm */
    {37, 53, 29, 0, 0, 0, CM_DTYPE_F32, CM_DTYPE_F32, CM_DTYPE_F32, 1},   /* gemm_dx, accumulate */
    {29, 53, 37, 1, 0, 0, CM_DTYPE_F32, CM_DTYPE_F32, CM_DTYPE_F32, 1},   /* gemm_dw */
    {33, 70, 41, 0, 1, 3, CM_DTYPE_BF16, CM_DTYPE_F32, CM_DTYPE_BF16, 0}, /* fwd, BF16 in and out */
    {33, 41, 70, 0, 0, 0, CM_DTYPE_BF16, CM_DTYPE_F32, CM_DTYPE_F32, 1},  /* dx from a BF16 gradient */
    {70, 41, 33, 1, 0, 5, CM_DTYPE_F32, CM_DTYPE_BF16, CM_DTYPE_F32, 1},  /* dw with a BF16 input */
    {17, 19, 23, 1, 1, 2, CM_DTYPE_BF16, CM_DTYPE_BF16, CM_DTYPE_BF16, 0},
    {8, 16, 0, 0, 1, 0, CM_DTYPE_F32, CM_DTYPE_F32, CM_DTYPE_F32, 0}, /* K = 0: zeros */
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

typedef struct mm_data {
    void   *a, *b, *c0;
    int64_t lda, ldb, ldc, a_rows, a_cols, b_rows, b_cols;
} mm_data;

static void mm_make(const mm_case *t, mm_data *d) {
    d->a_rows = t->ta ? t->K : t->M;
    d->a_cols = t->ta ? t->M : t->K;
    d->b_rows = t->tb ? t->N : t->K;
    d->b_cols = t->tb ? t->K : t->N;
    d->lda = d->a_cols + t->pad;
    d->ldb = d->b_cols + t->pad;
    d->ldc = t->N + t->pad;
    d->a = operand(d->a_rows, d->lda, t->adt);
    d->b = operand(d->b_rows, d->ldb, t->bdt);
    d->c0 = operand(t->M, d->ldc, t->cdt);
}

static void mm_free(mm_data *d) {
    free(d->a);
    free(d->b);
    free(d->c0);
}

static kn_matmul_params mm_params(const mm_case *t, const mm_data *d, const void *a, const void *b, void *c) {
    kn_matmul_params p = {t->M,   t->N,   t->K,  a, t->adt, d->lda, t->ta, b,
                          t->bdt, d->ldb, t->tb, c, t->cdt, d->ldc, t->acc};
    return p;
}

/* C [M, N] packed F32 of the reference matmul (widened when BF16). */
static float *c_packed(const mm_case *t, const mm_data *d, const void *c) {
    float *y = malloc((size_t)(t->M * t->N + 1) * sizeof *y);
    for (int64_t i = 0; i < t->M; i++)
        for (int64_t j = 0; j < t->N; j++) {
            const int64_t k = i * d->ldc + j;
            y[i * t->N + j] =
                t->cdt == CM_DTYPE_F32 ? ((const float *)c)[k] : cm_bf16_to_f32(((const uint16_t *)c)[k]);
        }
    return y;
}

static size_t esz(cm_dtype dt) {
    return dt == CM_DTYPE_F32 ? 4 : 2;
}

static void check_ref(void) {
    kn_ctx           *ctx = NULL;
    const kn_backend *be = kn_backend_cpu();
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    for (int ci = 0; ci < N_CASES; ci++) {
        const mm_case *t = &cases[ci];
        mm_data        d;
        mm_make(t, &d);
        const size_t cbytes = (size_t)(t->M * d.ldc) * esz(t->cdt);
        void        *c = malloc(cbytes);
        memcpy(c, d.c0, cbytes);
        kn_matmul_params p = mm_params(t, &d, d.a, d.b, c);
        TST_CHECK(kn_ref_matmul(ctx, &p) == CM_OK);
        /* independent: kn_ref_gemm on materialised op(A) [M, K] and op(B)ᵀ [N, K] */
        float *oa = materialise(d.a, t->adt, d.lda, t->ta, t->M, t->K);
        float *obt = materialise(d.b, t->bdt, d.ldb, !t->tb, t->N, t->K);
        float *want = malloc((size_t)(t->M * t->N + 1) * sizeof *want);
        TST_CHECK(kn_ref_gemm(ctx, want, oa, obt, CM_DTYPE_F32, t->M, t->N, t->K) == CM_OK);
        float *old = c_packed(t, &d, d.c0);
        int    gaps_kept = 1;
        for (int64_t i = 0; i < t->M; i++) {
            for (int64_t j = 0; j < t->N; j++) {
                float v = want[i * t->N + j];
                if (t->acc)
                    v = (float)((double)old[i * t->N + j] + (double)v);
                if (t->cdt == CM_DTYPE_BF16)
                    v = cm_bf16_to_f32(cm_f32_to_bf16(v));
                want[i * t->N + j] = v;
            }
            for (int64_t j = t->N; j < d.ldc; j++)
                gaps_kept = gaps_kept &&
                            memcmp((char *)c + (size_t)(i * d.ldc + j) * esz(t->cdt),
                                   (char *)d.c0 + (size_t)(i * d.ldc + j) * esz(t->cdt), esz(t->cdt)) == 0;
        }
        float *got = c_packed(t, &d, c);
        /* one rounding apart at most (the product sums in double either way) */
        TST_CLOSE("ref matmul", got, want, (long)(t->M * t->N), 1e-6, t->cdt == CM_DTYPE_BF16 ? 8e-3 : 1e-6);
        TST_CHECK(gaps_kept);
        free(got);
        free(old);
        free(want);
        free(oa);
        free(obt);
        free(c);
        mm_free(&d);
    }
    /* the packed F32 cases are gemm, gemm_dx and gemm_dw */
    {
        const int64_t M = 21, N = 34, K = 45;
        float        *x = rand_f(M * K, 1), *w = rand_f(N * K, 1), *dy = rand_f(M * N, 1);
        float        *o1 = malloc(M * N * 4), *o2 = malloc(M * N * 4), *dx1 = rand_f(M * K, 1),
              *dx2 = malloc(M * K * 4);
        float *dw1 = rand_f(N * K, 1), *dw2 = malloc(N * K * 4);
        memcpy(dx2, dx1, M * K * 4);
        memcpy(dw2, dw1, N * K * 4);
        kn_matmul_params pf = {M, N, K, x, CM_DTYPE_F32, K, 0, w, CM_DTYPE_F32, K, 1, o2, CM_DTYPE_F32, N, 0};
        kn_matmul_params px = {M, K, N, dy, CM_DTYPE_F32, N, 0, w, CM_DTYPE_F32, K, 0, dx2, CM_DTYPE_F32,
                               K, 1};
        kn_matmul_params pw = {N, K, M, dy, CM_DTYPE_F32, N, 1, x, CM_DTYPE_F32, K, 0, dw2, CM_DTYPE_F32,
                               K, 1};
        TST_CHECK(kn_ref_gemm(ctx, o1, x, w, CM_DTYPE_F32, M, N, K) == CM_OK &&
                  kn_ref_matmul(ctx, &pf) == CM_OK);
        TST_CHECK(kn_ref_gemm_dx(ctx, dx1, dy, w, CM_DTYPE_F32, M, N, K, 1) == CM_OK &&
                  kn_ref_matmul(ctx, &px) == CM_OK);
        TST_CHECK(kn_ref_gemm_dw(ctx, dw1, dy, x, M, N, K) == CM_OK && kn_ref_matmul(ctx, &pw) == CM_OK);
        TST_CLOSE("matmul = gemm", o2, o1, (long)(M * N), 0, 1e-6);
        TST_CLOSE("matmul = gemm_dx", dx2, dx1, (long)(M * K), 1e-7, 1e-6);
        TST_CLOSE("matmul = gemm_dw", dw2, dw1, (long)(N * K), 1e-7, 1e-6);
        free(x), free(w), free(dy), free(o1), free(o2), free(dx1), free(dx2), free(dw1), free(dw2);
    }
    /* cast2d: strided, both ways, gaps untouched */
    {
        const int64_t rows = 5, cols = 7, sld = 9, dld = 11;
        float    *src = rand_f(rows * sld, 3), *back = rand_f(rows * dld, 1), *keep = malloc(rows * dld * 4);
        uint16_t *mid = calloc((size_t)(rows * dld), 2);
        memcpy(keep, back, rows * dld * 4);
        TST_CHECK(kn_ref_cast2d(ctx, mid, CM_DTYPE_BF16, dld, src, CM_DTYPE_F32, sld, rows, cols) == CM_OK);
        TST_CHECK(kn_ref_cast2d(ctx, back, CM_DTYPE_F32, dld, mid, CM_DTYPE_BF16, dld, rows, cols) == CM_OK);
        int ok = 1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < dld; c++) {
                if (c < cols)
                    ok = ok && mid[r * dld + c] == cm_f32_to_bf16(src[r * sld + c]) &&
                         back[r * dld + c] == cm_bf16_to_f32(mid[r * dld + c]);
                else
                    ok = ok && mid[r * dld + c] == 0 && back[r * dld + c] == keep[r * dld + c];
            }
        TST_CHECK(ok);
        TST_CHECK(kn_ref_cast2d(ctx, mid, CM_DTYPE_I32, dld, src, CM_DTYPE_F32, sld, rows, cols) ==
                  CM_ERR_UNSUPPORTED);
        TST_CHECK(kn_ref_cast2d(ctx, mid, CM_DTYPE_BF16, 3, src, CM_DTYPE_F32, sld, rows, cols) ==
                  CM_ERR_INVALID_ARG);
        free(src), free(back), free(keep), free(mid);
    }
    /* swiglu typed: F32 = swiglu / swiglu_bwd bit for bit, in place too; BF16 = RNE of F32 */
    {
        const int64_t n = 1003;
        float        *g = rand_f(n, 4), *u = rand_f(n, 2), *d = rand_f(n, 1);
        float        *o1 = malloc(n * 4), *o2 = malloc(n * 4), *dg1 = malloc(n * 4), *du1 = malloc(n * 4);
        float        *g2 = malloc(n * 4), *u2 = malloc(n * 4);
        TST_CHECK(kn_ref_swiglu(ctx, o1, g, u, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_typed(ctx, o2, CM_DTYPE_F32, g, u, CM_DTYPE_F32, n) == CM_OK);
        TST_CHECK(memcmp(o1, o2, n * 4) == 0);
        TST_CHECK(kn_ref_swiglu_bwd(ctx, dg1, du1, d, g, u, n) == CM_OK);
        memcpy(g2, g, n * 4);
        memcpy(u2, u, n * 4);
        TST_CHECK(kn_ref_swiglu_bwd_typed(ctx, g2, u2, d, g2, u2, CM_DTYPE_F32, n) == CM_OK); /* in place */
        TST_CHECK(memcmp(g2, dg1, n * 4) == 0 && memcmp(u2, du1, n * 4) == 0);
        uint16_t *gb = to_bf(g, n), *ub = to_bf(u, n), *db = to_bf(d, n), *ob = malloc(n * 2);
        float    *gw = widen(gb, CM_DTYPE_BF16, n), *uw = widen(ub, CM_DTYPE_BF16, n),
              *dw = widen(db, CM_DTYPE_BF16, n);
        TST_CHECK(kn_ref_swiglu_typed(ctx, ob, CM_DTYPE_BF16, gb, ub, CM_DTYPE_BF16, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu(ctx, o1, gw, uw, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_bwd(ctx, dg1, du1, dw, gw, uw, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_bwd_typed(ctx, gb, ub, db, gb, ub, CM_DTYPE_BF16, n) == CM_OK);
        int ok = 1;
        for (int64_t i = 0; i < n; i++)
            ok = ok && ob[i] == cm_f32_to_bf16(o1[i]) && gb[i] == cm_f32_to_bf16(dg1[i]) &&
                 ub[i] == cm_f32_to_bf16(du1[i]);
        TST_CHECK(ok);
        TST_CHECK(kn_ref_swiglu_bwd_typed(ctx, gb, gb, db, gb, ub, CM_DTYPE_BF16, n) == CM_ERR_INVALID_ARG);
        free(g), free(u), free(d), free(o1), free(o2), free(dg1), free(du1), free(g2), free(u2);
        free(gb), free(ub), free(db), free(ob), free(gw), free(uw), free(dw);
    }
    /* swiglu_fwd_bwd_typed = swiglu_typed and swiglu_bwd_typed, bit for bit, over its inputs as the
     * MLP backward calls it (h over dout, the gradient over gate and up) and into separate buffers */
    for (int bf = 0; bf < 2; bf++) {
        const cm_dtype dt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        const int64_t  n = 1003;
        const size_t   b = (size_t)n * esz(dt);
        float         *g = rand_f(n, 4), *u = rand_f(n, 2), *d = rand_f(n, 1);
        void          *hg = bf ? (void *)to_bf(g, n) : g, *hu = bf ? (void *)to_bf(u, n) : u;
        void          *hd = bf ? (void *)to_bf(d, n) : d;
        void          *h1 = malloc(b), *dg1 = malloc(b), *du1 = malloc(b), *h2 = malloc(b), *dg2 = malloc(b),
             *du2 = malloc(b);
        TST_CHECK(kn_ref_swiglu_typed(ctx, h1, dt, hg, hu, dt, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_bwd_typed(ctx, dg1, du1, hd, hg, hu, dt, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_fwd_bwd_typed(ctx, h2, dg2, du2, hd, hg, hu, dt, n) == CM_OK);
        TST_CHECK(memcmp(h1, h2, b) == 0 && memcmp(dg1, dg2, b) == 0 && memcmp(du1, du2, b) == 0);
        TST_CHECK(kn_ref_swiglu_fwd_bwd_typed(ctx, hd, hg, hu, hd, hg, hu, dt, n) == CM_OK); /* in place */
        TST_CHECK(memcmp(h1, hd, b) == 0 && memcmp(dg1, hg, b) == 0 && memcmp(du1, hu, b) == 0);
        TST_CHECK(kn_ref_swiglu_fwd_bwd_typed(ctx, h2, h2, du2, hd, hg, hu, dt, n) == CM_ERR_INVALID_ARG);
        TST_CHECK(kn_ref_swiglu_fwd_bwd_typed(ctx, h2, dg2, du2, hd, hg, hu, CM_DTYPE_I32, n) ==
                  CM_ERR_UNSUPPORTED);
        if (bf)
            free(hg), free(hu), free(hd);
        free(g), free(u), free(d), free(h1), free(dg1), free(du1), free(h2), free(dg2), free(du2);
    }
    /* rmsnorm_bwd_acc: rmsnorm_bwd into a temporary, then add */
    {
        const int64_t rows = 13, C = 37;
        float        *x = rand_f(rows * C, 2), *dy = rand_f(rows * C, 1), *w = rand_f(C, 1),
              *acc = rand_f(rows * C, 1);
        float *acc2 = malloc(rows * C * 4), *tmp = malloc(rows * C * 4), *dw1 = calloc(C, 4),
              *dw2 = calloc(C, 4);
        memcpy(acc2, acc, rows * C * 4);
        TST_CHECK(kn_ref_rmsnorm_bwd_acc(ctx, acc, dw1, dy, x, w, rows, C, 1e-6f, 0) == CM_OK);
        TST_CHECK(kn_ref_rmsnorm_bwd(ctx, tmp, dw2, dy, x, w, rows, C, 1e-6f, 0) == CM_OK &&
                  kn_ref_add(ctx, acc2, tmp, rows * C) == CM_OK);
        TST_CHECK(memcmp(acc, acc2, rows * C * 4) == 0 && memcmp(dw1, dw2, C * 4) == 0);
        TST_CHECK(kn_ref_rmsnorm_bwd_acc(ctx, x, dw1, dy, x, w, rows, C, 1e-6f, 0) == CM_ERR_INVALID_ARG);
        free(x), free(dy), free(w), free(acc), free(acc2), free(tmp), free(dw1), free(dw2);
    }
    be->ctx_destroy(&ctx);
    printf(
        "cpu reference: matmul (%d cases), cast2d, swiglu typed pair agree with gemm/gemm_dx/gemm_dw/swiglu, "
        "rmsnorm_bwd_acc with rmsnorm_bwd + add\n",
        N_CASES);
}

// ---- cuda against the reference

static void *dev_put(const kn_backend *be, kn_ctx *ctx, const void *host, size_t bytes) {
    void *p = NULL;
    TST_CHECK(be->alloc(ctx, &p, bytes ? bytes : 1) == CM_OK);
    if (p && host && bytes)
        TST_CHECK(be->upload(ctx, p, host, bytes) == CM_OK);
    return p;
}

static void *dev_get(const kn_backend *be, kn_ctx *ctx, const void *dev, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    TST_CHECK(be->download(ctx, h, dev, bytes) == CM_OK);
    return h;
}

/* X (stored rows × ld in dt) with every element rounded to bf16 and widened back, as dt. */
static void *round_operand(const void *x, cm_dtype dt, int64_t n) {
    if (dt == CM_DTYPE_BF16) {
        void *y = malloc((size_t)n * 2);
        memcpy(y, x, (size_t)n * 2);
        return y;
    }
    float *y = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        y[i] = cm_bf16_to_f32(cm_f32_to_bf16(((const float *)x)[i]));
    return y;
}

static void check_cuda(const kn_backend *be) {
    kn_ctx *cpu = NULL;
    TST_CHECK(kn_ref_ctx_create(&cpu, NULL) == CM_OK);
    for (int mode = 0; mode < 2; mode++) {
        kn_ctx       *ctx = NULL;
        kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
        kc.gemm_mode = mode ? KN_GEMM_MODE_BF16 : KN_GEMM_MODE_F32;
        TST_CHECK(be->ctx_create(&ctx, &kc) == CM_OK);
        for (int ci = 0; ci < N_CASES; ci++) {
            const mm_case *t = &cases[ci];
            mm_data        d;
            mm_make(t, &d);
            const size_t     cbytes = (size_t)(t->M * d.ldc) * esz(t->cdt);
            const size_t     abytes = (size_t)(d.a_rows * d.lda) * esz(t->adt);
            const size_t     bbytes = (size_t)(d.b_rows * d.ldb) * esz(t->bdt);
            void            *da = dev_put(be, ctx, d.a, abytes), *db = dev_put(be, ctx, d.b, bbytes);
            void            *dc = dev_put(be, ctx, d.c0, cbytes);
            kn_matmul_params p = mm_params(t, &d, da, db, dc);
            TST_CHECK(be->matmul(ctx, &p) == CM_OK);
            void *hc = dev_get(be, ctx, dc, cbytes);
            /* the reference on what the mode multiplies: bf16-rounded operands in BF16 mode */
            void *ra = mode ? round_operand(d.a, t->adt, d.a_rows * d.lda) : d.a;
            void *rb = mode ? round_operand(d.b, t->bdt, d.b_rows * d.ldb) : d.b;
            void *rc = malloc(cbytes);
            memcpy(rc, d.c0, cbytes);
            kn_matmul_params pr = mm_params(t, &d, ra, rb, rc);
            TST_CHECK(kn_ref_matmul(cpu, &pr) == CM_OK);
            float *got = c_packed(t, &d, hc), *want = c_packed(t, &d, rc);
            char   name[64];
            snprintf(name, sizeof name, "cuda matmul case %d %s", ci, mode ? "bf16" : "f32");
            TST_CLOSE(name, got, want, (long)(t->M * t->N), 1e-4, t->cdt == CM_DTYPE_BF16 ? 8e-3 : 1e-5);
            int gaps_kept = 1;
            for (int64_t i = 0; i < t->M; i++)
                gaps_kept = gaps_kept && memcmp((char *)hc + (size_t)(i * d.ldc + t->N) * esz(t->cdt),
                                                (char *)d.c0 + (size_t)(i * d.ldc + t->N) * esz(t->cdt),
                                                (size_t)(d.ldc - t->N) * esz(t->cdt)) == 0;
            TST_CHECK(gaps_kept);
            free(got), free(want), free(hc), free(rc);
            if (mode)
                free(ra), free(rb);
            be->free(ctx, da), be->free(ctx, db), be->free(ctx, dc);
            mm_free(&d);
        }
        /* packed F32: the very bits of gemm, gemm_dx, gemm_dw */
        {
            const int64_t M = 67, N = 130, K = 99;
            float *x = rand_f(M * K, 1), *w = rand_f(N * K, 1), *dy = rand_f(M * N, 1), *z = rand_f(N * K, 1);
            float *dx_ = dev_put(be, ctx, x, M * K * 4), *dw_ = dev_put(be, ctx, w, N * K * 4);
            float *ddy = dev_put(be, ctx, dy, M * N * 4);
            float *o1 = dev_put(be, ctx, NULL, M * N * 4), *o2 = dev_put(be, ctx, NULL, M * N * 4);
            float *i1 = dev_put(be, ctx, NULL, M * K * 4), *i2 = dev_put(be, ctx, NULL, M * K * 4);
            float *g1 = dev_put(be, ctx, z, N * K * 4), *g2 = dev_put(be, ctx, z, N * K * 4);
            kn_matmul_params pf = {
                M, N, K, dx_, CM_DTYPE_F32, K, 0, dw_, CM_DTYPE_F32, K, 1, o2, CM_DTYPE_F32, N, 0};
            kn_matmul_params px = {
                M, K, N, ddy, CM_DTYPE_F32, N, 0, dw_, CM_DTYPE_F32, K, 0, i2, CM_DTYPE_F32, K, 0};
            kn_matmul_params pw = {
                N, K, M, ddy, CM_DTYPE_F32, N, 1, dx_, CM_DTYPE_F32, K, 0, g2, CM_DTYPE_F32, K, 1};
            TST_CHECK(be->gemm(ctx, o1, dx_, dw_, CM_DTYPE_F32, M, N, K) == CM_OK &&
                      be->matmul(ctx, &pf) == CM_OK);
            TST_CHECK(be->gemm_dx(ctx, i1, ddy, dw_, CM_DTYPE_F32, M, N, K, 0) == CM_OK &&
                      be->matmul(ctx, &px) == CM_OK);
            TST_CHECK(be->gemm_dw(ctx, g1, ddy, dx_, M, N, K) == CM_OK && be->matmul(ctx, &pw) == CM_OK);
            float *h1 = dev_get(be, ctx, o1, M * N * 4), *h2 = dev_get(be, ctx, o2, M * N * 4);
            float *j1 = dev_get(be, ctx, i1, M * K * 4), *j2 = dev_get(be, ctx, i2, M * K * 4);
            float *k1 = dev_get(be, ctx, g1, N * K * 4), *k2 = dev_get(be, ctx, g2, N * K * 4);
            TST_CHECK(memcmp(h1, h2, M * N * 4) == 0 && memcmp(j1, j2, M * K * 4) == 0 &&
                      memcmp(k1, k2, N * K * 4) == 0);
            free(x), free(w), free(dy), free(z), free(h1), free(h2), free(j1), free(j2), free(k1), free(k2);
            be->free(ctx, dx_), be->free(ctx, dw_), be->free(ctx, ddy), be->free(ctx, o1), be->free(ctx, o2);
            be->free(ctx, i1), be->free(ctx, i2), be->free(ctx, g1), be->free(ctx, g2);
        }
        be->ctx_destroy(&ctx);
    }
    /* cast2d and the SwiGLU pair (mode-independent) */
    kn_ctx *ctx = NULL;
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    for (int v = 0; v < 2; v++) { /* one element a thread; four (cols and both lds multiples of 4) */
        const int64_t rows = 77, cols = v ? 300 : 301, sld = v ? 304 : 305, dld = v ? 308 : 310;
        float        *src = rand_f(rows * sld, 5);
        float        *ds = dev_put(be, ctx, src, rows * sld * 4);
        uint16_t     *dm = dev_put(be, ctx, NULL, rows * dld * 2), *rm = calloc((size_t)(rows * dld), 2);
        TST_CHECK(be->cast2d(ctx, dm, CM_DTYPE_BF16, dld, ds, CM_DTYPE_F32, sld, rows, cols) == CM_OK);
        TST_CHECK(kn_ref_cast2d(cpu, rm, CM_DTYPE_BF16, dld, src, CM_DTYPE_F32, sld, rows, cols) == CM_OK);
        uint16_t *hm = dev_get(be, ctx, dm, rows * dld * 2);
        TST_CHECK(memcmp(hm, rm, (size_t)(rows * dld) * 2) == 0);
        float *df = dev_put(be, ctx, NULL, rows * cols * 4), *rf = malloc(rows * cols * 4);
        TST_CHECK(be->cast2d(ctx, df, CM_DTYPE_F32, cols, dm, CM_DTYPE_BF16, dld, rows, cols) == CM_OK);
        TST_CHECK(kn_ref_cast2d(cpu, rf, CM_DTYPE_F32, cols, rm, CM_DTYPE_BF16, dld, rows, cols) == CM_OK);
        float *hf = dev_get(be, ctx, df, rows * cols * 4);
        TST_CHECK(memcmp(hf, rf, (size_t)(rows * cols) * 4) == 0);
        free(src), free(rm), free(hm), free(rf), free(hf);
        be->free(ctx, ds), be->free(ctx, dm), be->free(ctx, df);
    }
    for (int bf = 0; bf < 2; bf++) {
        const cm_dtype dt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        const int64_t  n = 100003;
        const size_t   b = (size_t)n * esz(dt);
        float         *g = rand_f(n, 5), *u = rand_f(n, 2), *d = rand_f(n, 1);
        void          *hg = bf ? (void *)to_bf(g, n) : g, *hu = bf ? (void *)to_bf(u, n) : u;
        void          *hd = bf ? (void *)to_bf(d, n) : d;
        void *dg = dev_put(be, ctx, hg, b), *du = dev_put(be, ctx, hu, b), *dd = dev_put(be, ctx, hd, b);
        void *dout = dev_put(be, ctx, NULL, b), *rout = malloc(b);
        TST_CHECK(be->swiglu_typed(ctx, dout, dt, dg, du, dt, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_typed(cpu, rout, dt, hg, hu, dt, n) == CM_OK);
        void *gout = dev_get(be, ctx, dout, b);
        /* the backward in place over the device gate/up, the reference into its copies */
        TST_CHECK(be->swiglu_bwd_typed(ctx, dg, du, dd, dg, du, dt, n) == CM_OK);
        TST_CHECK(kn_ref_swiglu_bwd_typed(cpu, hg, hu, hd, hg, hu, dt, n) == CM_OK);
        void  *gdg = dev_get(be, ctx, dg, b), *gdu = dev_get(be, ctx, du, b);
        float *a1 = widen(gout, dt, n), *a2 = widen(rout, dt, n), *b1 = widen(gdg, dt, n),
              *b2 = widen(hg, dt, n);
        float       *c1 = widen(gdu, dt, n), *c2 = widen(hu, dt, n);
        const double rtol = bf ? 8e-3 : 1e-6;
        TST_CLOSE(bf ? "cuda swiglu_typed bf16" : "cuda swiglu_typed f32", a1, a2, (long)n, 1e-7, rtol);
        TST_CLOSE(bf ? "cuda dgate bf16" : "cuda dgate f32", b1, b2, (long)n, 1e-7, rtol);
        TST_CLOSE(bf ? "cuda dup bf16" : "cuda dup f32", c1, c2, (long)n, 1e-7, rtol);
        free(a1), free(a2), free(b1), free(b2), free(c1), free(c2), free(gout), free(gdg), free(gdu),
            free(rout);
        if (bf)
            free(hg), free(hu), free(hd);
        free(g), free(u), free(d);
        be->free(ctx, dg), be->free(ctx, du), be->free(ctx, dd), be->free(ctx, dout);
    }
    /* swiglu_fwd_bwd_typed on the device: the bits of swiglu_typed and swiglu_bwd_typed there, in
     * place as the MLP backward calls it, on 8-byte vectors (BF16, n a multiple of 4, aligned) and
     * one element at a time (F32; BF16 one element in) */
    for (int c = 0; c < 3; c++) {
        const int      bf = c > 0, off = c == 2;
        const cm_dtype dt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        const int64_t  n = 4 * 25013 - off, es = esz(dt);
        const size_t   b = (size_t)(n + off) * es;
        float         *g = rand_f(n + off, 5), *u = rand_f(n + off, 2), *d = rand_f(n + off, 1);
        void          *hg = bf ? (void *)to_bf(g, n + off) : g, *hu = bf ? (void *)to_bf(u, n + off) : u;
        void          *hd = bf ? (void *)to_bf(d, n + off) : d;
        char *dg = dev_put(be, ctx, hg, b), *du = dev_put(be, ctx, hu, b), *dd = dev_put(be, ctx, hd, b);
        char *sh = dev_put(be, ctx, NULL, b), *sg = dev_put(be, ctx, NULL, b),
             *su = dev_put(be, ctx, NULL, b);
        const int64_t o = off * es;
        TST_CHECK(be->swiglu_typed(ctx, sh + o, dt, dg + o, du + o, dt, n) == CM_OK);
        TST_CHECK(be->swiglu_bwd_typed(ctx, sg + o, su + o, dd + o, dg + o, du + o, dt, n) == CM_OK);
        TST_CHECK(be->swiglu_fwd_bwd_typed(ctx, dd + o, dg + o, du + o, dd + o, dg + o, du + o, dt, n) ==
                  CM_OK);
        char *a[3] = {dev_get(be, ctx, sh, b), dev_get(be, ctx, sg, b), dev_get(be, ctx, su, b)};
        char *f[3] = {dev_get(be, ctx, dd, b), dev_get(be, ctx, dg, b), dev_get(be, ctx, du, b)};
        int   same = 1;
        for (int k = 0; k < 3; k++)
            same = same && memcmp(a[k] + o, f[k] + o, (size_t)n * es) == 0;
        printf("swiglu_fwd_bwd_typed %s%s: the bits of the pair: %s\n", bf ? "bf16" : "f32",
               off ? " (unaligned)" : "", same ? "yes" : "no");
        TST_CHECK(same);
        TST_CHECK(be->swiglu_fwd_bwd_typed(ctx, sh, sh, su, dd, dg, du, dt, n) == CM_ERR_INVALID_ARG);
        for (int k = 0; k < 3; k++)
            free(a[k]), free(f[k]);
        if (bf)
            free(hg), free(hu), free(hd);
        free(g), free(u), free(d);
        be->free(ctx, dg), be->free(ctx, du), be->free(ctx, dd), be->free(ctx, sh), be->free(ctx, sg),
            be->free(ctx, su);
    }
    /* swiglu_typed BF16 → BF16 on 16-byte vectors (n a multiple of 8, aligned buffers) against
     * the same op one value at a time (the buffers one element in: unaligned) and the cpu */
    {
        const int64_t n = 8 * 12503;
        float        *g = rand_f(n, 5), *u = rand_f(n, 2);
        uint16_t     *hg = to_bf(g, n), *hu = to_bf(u, n), *rout = malloc((size_t)n * 2);
        uint16_t     *dg = dev_put(be, ctx, hg, (size_t)n * 2), *du = dev_put(be, ctx, hu, (size_t)n * 2);
        uint16_t     *dv = dev_put(be, ctx, NULL, (size_t)n * 2), *ds = dev_put(be, ctx, NULL, (size_t)n * 2);
        TST_CHECK(be->swiglu_typed(ctx, dv, CM_DTYPE_BF16, dg, du, CM_DTYPE_BF16, n) == CM_OK);
        TST_CHECK(be->swiglu_typed(ctx, ds + 1, CM_DTYPE_BF16, dg + 1, du + 1, CM_DTYPE_BF16, n - 8) ==
                  CM_OK);
        TST_CHECK(kn_ref_swiglu_typed(cpu, rout, CM_DTYPE_BF16, hg, hu, CM_DTYPE_BF16, n) == CM_OK);
        uint16_t *hv = dev_get(be, ctx, dv, (size_t)n * 2), *hs = dev_get(be, ctx, ds, (size_t)n * 2);
        long      diff = 0;
        for (int64_t i = 1; i < n - 7; i++)
            diff += hv[i] != hs[i];
        printf("swiglu_typed bf16 vectors vs one at a time: %ld of %lld values differ\n", diff,
               (long long)n - 8);
        TST_CHECK(diff == 0);
        float *a1 = widen(hv, CM_DTYPE_BF16, n), *a2 = widen(rout, CM_DTYPE_BF16, n);
        TST_CLOSE("cuda swiglu_typed bf16 vectors", a1, a2, (long)n, 1e-7, 8e-3);
        free(a1), free(a2), free(hv), free(hs), free(g), free(u), free(hg), free(hu), free(rout);
        be->free(ctx, dg), be->free(ctx, du), be->free(ctx, dv), be->free(ctx, ds);
    }
    /* cast2d of packed arrays, four elements per access (n a multiple of 4, aligned) and one at a
     * time (one element in), both ways: the reference's bits */
    {
        const int64_t n = 4 * 30011;
        float        *src = rand_f(n, 5), *rf = malloc((size_t)n * 4);
        uint16_t     *rm = malloc((size_t)n * 2);
        float        *ds = dev_put(be, ctx, src, (size_t)n * 4), *df = dev_put(be, ctx, NULL, (size_t)n * 4);
        uint16_t *dm = dev_put(be, ctx, NULL, (size_t)n * 2), *dm1 = dev_put(be, ctx, NULL, (size_t)n * 2);
        TST_CHECK(kn_ref_cast2d(cpu, rm, CM_DTYPE_BF16, n, src, CM_DTYPE_F32, n, 1, n) == CM_OK);
        TST_CHECK(kn_ref_cast2d(cpu, rf, CM_DTYPE_F32, n, rm, CM_DTYPE_BF16, n, 1, n) == CM_OK);
        TST_CHECK(be->cast2d(ctx, dm, CM_DTYPE_BF16, n, ds, CM_DTYPE_F32, n, 1, n) == CM_OK);
        TST_CHECK(be->cast2d(ctx, dm1 + 1, CM_DTYPE_BF16, n - 4, ds + 1, CM_DTYPE_F32, n - 4, 1, n - 4) ==
                  CM_OK);
        TST_CHECK(be->cast2d(ctx, df, CM_DTYPE_F32, n, dm, CM_DTYPE_BF16, n, 1, n) == CM_OK);
        uint16_t *hm = dev_get(be, ctx, dm, (size_t)n * 2), *hm1 = dev_get(be, ctx, dm1, (size_t)n * 2);
        float    *hf = dev_get(be, ctx, df, (size_t)n * 4);
        TST_CHECK(memcmp(hm, rm, (size_t)n * 2) == 0 && memcmp(hf, rf, (size_t)n * 4) == 0);
        TST_CHECK(memcmp(hm1 + 1, rm + 1, (size_t)(n - 4) * 2) == 0);
        free(src), free(rf), free(rm), free(hm), free(hm1), free(hf);
        be->free(ctx, ds), be->free(ctx, df), be->free(ctx, dm), be->free(ctx, dm1);
    }
    /* swiglu_bwd_typed BF16 on 8-byte vectors (n a multiple of 4, aligned buffers, in place over
     * gate and up) against the same op one value at a time (one element in: unaligned) and the cpu */
    {
        const int64_t n = 4 * 25001;
        const size_t  b = (size_t)n * 2;
        float        *g = rand_f(n, 5), *u = rand_f(n, 2), *d = rand_f(n, 1);
        uint16_t     *hg = to_bf(g, n), *hu = to_bf(u, n), *hd = to_bf(d, n);
        uint16_t *vg = dev_put(be, ctx, hg, b), *vu = dev_put(be, ctx, hu, b), *vd = dev_put(be, ctx, hd, b);
        uint16_t *sg = dev_put(be, ctx, hg, b), *su = dev_put(be, ctx, hu, b);
        TST_CHECK(be->swiglu_bwd_typed(ctx, vg, vu, vd, vg, vu, CM_DTYPE_BF16, n) == CM_OK);
        TST_CHECK(be->swiglu_bwd_typed(ctx, sg + 1, su + 1, vd + 1, sg + 1, su + 1, CM_DTYPE_BF16, n - 4) ==
                  CM_OK);
        TST_CHECK(kn_ref_swiglu_bwd_typed(cpu, hg, hu, hd, hg, hu, CM_DTYPE_BF16, n) == CM_OK);
        uint16_t *ag = dev_get(be, ctx, vg, b), *au = dev_get(be, ctx, vu, b);
        uint16_t *bg = dev_get(be, ctx, sg, b), *bu = dev_get(be, ctx, su, b);
        long      diff = 0;
        for (int64_t i = 1; i < n - 3; i++)
            diff += (ag[i] != bg[i]) + (au[i] != bu[i]);
        printf("swiglu_bwd_typed bf16 vectors vs one at a time: %ld of %lld values differ\n", diff,
               2 * ((long long)n - 4));
        TST_CHECK(diff == 0);
        float *a1 = widen(ag, CM_DTYPE_BF16, n), *a2 = widen(hg, CM_DTYPE_BF16, n);
        float *c1 = widen(au, CM_DTYPE_BF16, n), *c2 = widen(hu, CM_DTYPE_BF16, n);
        TST_CLOSE("cuda dgate bf16 vectors", a1, a2, (long)n, 1e-7, 8e-3);
        TST_CLOSE("cuda dup bf16 vectors", c1, c2, (long)n, 1e-7, 8e-3);
        free(a1), free(a2), free(c1), free(c2), free(ag), free(au), free(bg), free(bu);
        free(g), free(u), free(d), free(hg), free(hu), free(hd);
        be->free(ctx, vg), be->free(ctx, vu), be->free(ctx, vd), be->free(ctx, sg), be->free(ctx, su);
    }
    /* the multi-tensor optimizer step */
    {
        enum { NT = 4 };
        static const int64_t sizes[NT] = {KN_MT_CHUNK + 17, 3, 2 * KN_MT_CHUNK + 1000, 1};
        kn_mt_tensor         ht[NT], dt_[NT];
        float               *host[NT][4];
        int64_t              chunks = 0;
        for (int i = 0; i < NT; i++) {
            for (int k = 0; k < 4; k++)
                host[i][k] = rand_f(sizes[i], k == 0 ? 0.1f : k == 1 ? 0.05f : k == 2 ? 1e-3f : 1e-6f);
            for (int64_t j = 0; j < sizes[i]; j++) /* v ≥ 0 */
                host[i][3][j] = fabsf(host[i][3][j]);
            ht[i] = (kn_mt_tensor){host[i][0], host[i][1], host[i][2], host[i][3], sizes[i], chunks, NULL};
            dt_[i] = (kn_mt_tensor){dev_put(be, ctx, host[i][0], sizes[i] * 4),
                                    dev_put(be, ctx, host[i][1], sizes[i] * 4),
                                    dev_put(be, ctx, host[i][2], sizes[i] * 4),
                                    dev_put(be, ctx, host[i][3], sizes[i] * 4),
                                    sizes[i],
                                    chunks,
                                    NULL};
            chunks += (sizes[i] + KN_MT_CHUNK - 1) / KN_MT_CHUNK;
        }
        /* bf16 copies of tensors 0 (aligned: the four-wide stores) and 2 (one element off: the
         * one-at-a-time path), on the device and in the reference */
        uint16_t *w16buf = dev_put(be, ctx, NULL, (size_t)(sizes[0] + sizes[2] + 8) * 2);
        dt_[0].w16 = w16buf;
        dt_[2].w16 = w16buf + sizes[0] + 5;
        uint16_t *hw16[2] = {calloc((size_t)sizes[0], 2), calloc((size_t)sizes[2], 2)};
        ht[0].w16 = hw16[0];
        ht[2].w16 = hw16[1];
        kn_mt_tensor   *dtab = dev_put(be, ctx, dt_, sizeof dt_);
        double         *dsum = dev_put(be, ctx, NULL, sizeof(double));
        double          s_ref = 0, s1 = 0, s2 = 0;
        kn_adamw_params ap = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f, 3};
        TST_CHECK(kn_ref_sumsq_multi(cpu, &s_ref, ht, NT, chunks) == CM_OK);
        TST_CHECK(be->sumsq_multi(ctx, dsum, dtab, NT, chunks) == CM_OK);
        TST_CHECK(be->download(ctx, &s1, dsum, sizeof s1) == CM_OK);
        TST_CHECK(be->sumsq_multi(ctx, dsum, dtab, NT, chunks) == CM_OK);
        TST_CHECK(be->download(ctx, &s2, dsum, sizeof s2) == CM_OK);
        TST_CHECK(s1 == s2 && fabs(s1 - s_ref) <= 1e-12 * s_ref && s_ref > 0);
        /* clip 0.5 < norm: the factor bites */
        TST_CHECK(kn_ref_adamw_multi(cpu, ht, NT, chunks, &ap, &s_ref, 0.5) == CM_OK);
        TST_CHECK(be->adamw_multi(ctx, dtab, NT, chunks, &ap, dsum, 0.5) == CM_OK);
        for (int i = 0; i < NT; i++)
            for (int k = 0; k < 4; k += (k == 0 ? 2 : 1)) { /* param, m, v */
                float *got = dev_get(be, ctx,
                                     k == 0   ? (void *)dt_[i].param
                                     : k == 2 ? (void *)dt_[i].m
                                              : dt_[i].v,
                                     sizes[i] * 4);
                TST_CLOSE("cuda adamw_multi", got, host[i][k], (long)sizes[i], 1e-12, 1e-6);
                free(got);
            }
        long w16_bad = 0, w16_ref_bad = 0;
        for (int c = 0; c < 2; c++) { /* each copy is its own updated values rounded, bit for bit */
            const int t = c ? 2 : 0;
            float    *got = dev_get(be, ctx, dt_[t].param, sizes[t] * 4);
            uint16_t *w = dev_get(be, ctx, dt_[t].w16, sizes[t] * 2);
            for (int64_t j = 0; j < sizes[t]; j++) {
                w16_bad += w[j] != cm_f32_to_bf16(got[j]);
                w16_ref_bad += hw16[c][j] != cm_f32_to_bf16(host[t][0][j]);
            }
            free(got), free(w);
        }
        printf("adamw_multi bf16 copies: %ld (cuda) and %ld (cpu) of %lld differ from the rounded update\n",
               w16_bad, w16_ref_bad, (long long)(sizes[0] + sizes[2]));
        TST_CHECK(w16_bad == 0 && w16_ref_bad == 0);
        uint16_t *w_before = dev_get(be, ctx, dt_[2].w16, sizes[2] * 2);
        /* a non-finite gradient: the norm is not finite and nothing is written */
        float *before = dev_get(be, ctx, dt_[2].param, sizes[2] * 4), nan = NAN;
        TST_CHECK(be->upload(ctx, (float *)dt_[2].grad + KN_MT_CHUNK + 3, &nan, 4) == CM_OK);
        TST_CHECK(be->sumsq_multi(ctx, dsum, dtab, NT, chunks) == CM_OK);
        TST_CHECK(be->adamw_multi(ctx, dtab, NT, chunks, &ap, dsum, 1.0) == CM_OK);
        TST_CHECK(be->download(ctx, &s1, dsum, sizeof s1) == CM_OK);
        float    *after = dev_get(be, ctx, dt_[2].param, sizes[2] * 4);
        uint16_t *w_after = dev_get(be, ctx, dt_[2].w16, sizes[2] * 2);
        TST_CHECK(isnan(s1) && memcmp(before, after, (size_t)sizes[2] * 4) == 0);
        TST_CHECK(memcmp(w_before, w_after, (size_t)sizes[2] * 2) == 0);
        free(before), free(after), free(w_before), free(w_after), free(hw16[0]), free(hw16[1]);
        be->free(ctx, w16buf);
        for (int i = 0; i < NT; i++) {
            be->free(ctx, dt_[i].param), be->free(ctx, (void *)dt_[i].grad), be->free(ctx, dt_[i].m);
            be->free(ctx, dt_[i].v);
            for (int k = 0; k < 4; k++)
                free(host[i][k]);
        }
        be->free(ctx, dtab), be->free(ctx, dsum);
    }
    /* rmsnorm_bwd_acc: the bits of cuda rmsnorm_bwd + add, and the reference within 1e-5 */
    {
        const int64_t rows = 301, C = 517;
        const size_t  b = (size_t)(rows * C) * 4;
        float        *x = rand_f(rows * C, 2), *dy = rand_f(rows * C, 1), *w = rand_f(C, 1),
              *acc = rand_f(rows * C, 1);
        float *dx_ = dev_put(be, ctx, x, b), *ddy = dev_put(be, ctx, dy, b),
              *dwt = dev_put(be, ctx, w, C * 4);
        float *a1 = dev_put(be, ctx, acc, b), *a2 = dev_put(be, ctx, acc, b),
              *tmp = dev_put(be, ctx, NULL, b);
        float *g1 = dev_put(be, ctx, NULL, C * 4), *g2 = dev_put(be, ctx, NULL, C * 4);
        float *ra = malloc(b), *rg = calloc(C, 4);
        memcpy(ra, acc, b);
        TST_CHECK(be->rmsnorm_bwd_acc(ctx, a1, g1, ddy, dx_, dwt, rows, C, 1e-6f, 0) == CM_OK);
        TST_CHECK(be->rmsnorm_bwd(ctx, tmp, g2, ddy, dx_, dwt, rows, C, 1e-6f, 0) == CM_OK &&
                  be->add(ctx, a2, tmp, rows * C) == CM_OK);
        TST_CHECK(kn_ref_rmsnorm_bwd_acc(cpu, ra, rg, dy, x, w, rows, C, 1e-6f, 0) == CM_OK);
        float *h1 = dev_get(be, ctx, a1, b), *h2 = dev_get(be, ctx, a2, b), *k1 = dev_get(be, ctx, g1, C * 4),
              *k2 = dev_get(be, ctx, g2, C * 4);
        TST_CHECK(memcmp(h1, h2, b) == 0 && memcmp(k1, k2, C * 4) == 0);
        TST_CLOSE("cuda rmsnorm_bwd_acc", h1, ra, (long)(rows * C), 1e-5, 1e-5);
        TST_CLOSE("cuda rmsnorm_bwd_acc dw", k1, rg, (long)C, 1e-5, 1e-5);
        free(x), free(dy), free(w), free(acc), free(ra), free(rg), free(h1), free(h2), free(k1), free(k2);
        be->free(ctx, dx_), be->free(ctx, ddy), be->free(ctx, dwt), be->free(ctx, a1), be->free(ctx, a2);
        be->free(ctx, tmp), be->free(ctx, g1), be->free(ctx, g2);
    }
    be->ctx_destroy(&ctx);
    kn_ref_ctx_destroy(&cpu);
    printf("cuda: rmsnorm_bwd_acc = rmsnorm_bwd + add bits, and the reference's values\n");
    printf("cuda: multi-tensor sumsq + adamw against the reference, repeatable, skip on non-finite\n");
    printf(
        "cuda: matmul (%d cases x 2 modes, = gemm/gemm_dx/gemm_dw bits in F32), cast2d exact, swiglu pair\n",
        N_CASES);
}

int main(int argc, char **argv) {
    const char *device = argc > 1 ? argv[1] : "cpu";
    if (strcmp(device, "cuda") == 0) {
        const kn_backend *be = kn_backend_cuda();
        if (!be)
            TST_SKIP("this build has no cuda backend");
        kn_ctx *ctx = NULL;
        if (be->ctx_create(&ctx, NULL) != CM_OK)
            TST_SKIP("no usable cuda device: %s", cm_last_error());
        be->ctx_destroy(&ctx);
        check_cuda(be);
    } else {
        check_ref();
    }
    return tst_report();
}
