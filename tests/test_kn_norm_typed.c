/* tests/test_kn_norm_typed.c — the drafter's norms on typed storage (rmsnorm_typed, rmsnorm_bwd_typed,
 * head_norm_rope, head_norm_rope_bwd; kernels/ref/kn_norm_typed_ref.c, kernels/kn_norm.cu,
 * kernels/kn_norm_bwd.cu, kernels/kn_head_norm.cu).
 *   cpu:  each reference against the chain of established entries it stands for, bit for bit, on
 *         odd shapes, F32 and BF16 inputs, with and without rounding, accumulation and the bf16 copy
 *         (rmsnorm_typed = cast2d round trip, rmsnorm, cast2d; rmsnorm_bwd_typed = widen,
 *         rmsnorm_bwd or rmsnorm_bwd_acc, cast2d; head_norm_rope = widen, rmsnorm per head, rope with
 *         a full and a partial rot_dim; head_norm_rope_bwd = rope_bwd, widen, rmsnorm_bwd (, cast2d)); bad
 *         arguments refused with their messages.
 *   cuda: (label gpu; 77 without a device) every op against the reference on odd shapes, through
 *         each launch path (rows of C % 4 != 0: the scalar kernels; C = 260 and 5120: the vector
 *         ones with one and four groups of four a thread; heads of hd = rot_dim = 128: the
 *         warp-per-token path, nh = 5 leaving a partial group of rows; hd 72, rot 40: the general one): the
 *         rounded x and its bf16 copy bit-exact, F32 outputs within 1e-5, bf16 outputs within one
 *         bf16 ulp, dw within 1e-5; head_norm_rope in place = out of place bit for bit;
 *         head_norm_rope_bwd's bf16 dinp the rounding of its F32 one, bit for bit; a head
 *         wider than the kernels take refused as unsupported. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "kn_ref.h"
#include "tst.h"
#include "tst_kn.h"

static float *rnd(int64_t n, double s) {
    return tst_rand_f32((long)n, -s, s);
}

static float *dup_f(const float *x, int64_t n) {
    float *y = tst_xcalloc((size_t)n * 4);
    memcpy(y, x, (size_t)n * 4);
    return y;
}

// ----------------------------------------------------------------------------
// cpu: the references against their chains

static void ref_rmsnorm_typed(kn_ctx *c) {
    const int64_t rows = 7, C = 37, n = rows * C;
    for (int xbf = 0; xbf < 2; xbf++)
        for (int round = 0; round < 2 - xbf; round++)
            for (int one_plus = 0; one_plus < 2; one_plus++) {
                float    *x = rnd(n, 3), *w = rnd(C, 1), *xc = dup_f(x, n), *y = tst_zeros_f32(n);
                float    *out = tst_zeros_f32(n), *y_chain = tst_zeros_f32(n);
                uint16_t *xb = tst_bf16_round_n(x, n), *sb = tst_xcalloc((size_t)n * 2),
                         *ob = tst_xcalloc((size_t)n * 2);
                uint16_t *sb_chain = tst_xcalloc((size_t)n * 2), *ob_chain = tst_xcalloc((size_t)n * 2);
                kn_norm_typed_params p = {.rows = rows,
                                          .C = C,
                                          .eps = 1e-6f,
                                          .one_plus = one_plus,
                                          .w = w,
                                          .x = xbf ? (void *)xb : (void *)x,
                                          .x_dt = xbf ? CM_DTYPE_BF16 : CM_DTYPE_F32,
                                          .round = round,
                                          .x_bf16 = round ? sb : NULL,
                                          .out = out,
                                          .out_bf16 = ob};
                TST_CHECK(kn_ref_rmsnorm_typed(c, &p) == CM_OK);
                /* the chain */
                float *xin = xbf ? tst_bf16_widen_n(xb, n) : xc;
                if (round) {
                    TST_CHECK(kn_ref_cast2d(c, sb_chain, CM_DTYPE_BF16, n, xc, CM_DTYPE_F32, n, 1, n) ==
                              CM_OK);
                    TST_CHECK(kn_ref_cast2d(c, xc, CM_DTYPE_F32, n, sb_chain, CM_DTYPE_BF16, n, 1, n) ==
                              CM_OK);
                }
                TST_CHECK(kn_ref_rmsnorm(c, y_chain, xin, w, rows, C, 1e-6f, one_plus) == CM_OK);
                TST_CHECK(kn_ref_cast2d(c, ob_chain, CM_DTYPE_BF16, n, y_chain, CM_DTYPE_F32, n, 1, n) ==
                          CM_OK);
                TST_CHECK(memcmp(out, y_chain, (size_t)n * 4) == 0 &&
                          memcmp(ob, ob_chain, (size_t)n * 2) == 0);
                if (!xbf)
                    TST_CHECK(memcmp(x, xc, (size_t)n * 4) == 0); /* rounded in place, or untouched */
                if (round)
                    TST_CHECK(memcmp(sb, sb_chain, (size_t)n * 2) == 0);
                if (xbf)
                    free(xin);
                free(x), free(w), free(xc), free(y), free(out), free(y_chain), free(xb), free(sb), free(ob);
                free(sb_chain), free(ob_chain);
            }
    printf("cpu: rmsnorm_typed = cast2d round trip + rmsnorm + cast2d bit for bit (F32/BF16 x, round, "
           "one_plus)\n");
}

static void ref_rmsnorm_bwd_typed(kn_ctx *c) {
    const int64_t rows = 9, C = 29, n = rows * C;
    for (int xbf = 0; xbf < 2; xbf++)
        for (int acc = 0; acc < 2; acc++) {
            float    *x = rnd(n, 2), *dy = rnd(n, 1), *w = rnd(C, 1), *d0 = rnd(n, 1), *dw0 = rnd(C, 1);
            float    *dinp = dup_f(d0, n), *dw = dup_f(dw0, C), *dinp_c = dup_f(d0, n), *dw_c = dup_f(dw0, C);
            uint16_t *xb = tst_bf16_round_n(x, n), *db = tst_xcalloc((size_t)n * 2),
                     *db_c = tst_xcalloc((size_t)n * 2);
            kn_norm_bwd_typed_params p = {.rows = rows,
                                          .C = C,
                                          .eps = 1e-6f,
                                          .one_plus = acc,
                                          .w = w,
                                          .dw = dw,
                                          .x = xbf ? (const void *)xb : (const void *)x,
                                          .x_dt = xbf ? CM_DTYPE_BF16 : CM_DTYPE_F32,
                                          .dout = dy,
                                          .dinp = dinp,
                                          .accumulate = acc,
                                          .dinp_bf16 = db};
            TST_CHECK(kn_ref_rmsnorm_bwd_typed(c, &p) == CM_OK);
            float *xin = xbf ? tst_bf16_widen_n(xb, n) : x;
            TST_CHECK((acc ? kn_ref_rmsnorm_bwd_acc(c, dinp_c, dw_c, dy, xin, w, rows, C, 1e-6f, acc)
                           : kn_ref_rmsnorm_bwd(c, dinp_c, dw_c, dy, xin, w, rows, C, 1e-6f, acc)) == CM_OK);
            TST_CHECK(kn_ref_cast2d(c, db_c, CM_DTYPE_BF16, n, dinp_c, CM_DTYPE_F32, n, 1, n) == CM_OK);
            TST_CHECK(memcmp(dinp, dinp_c, (size_t)n * 4) == 0 && memcmp(dw, dw_c, (size_t)C * 4) == 0 &&
                      memcmp(db, db_c, (size_t)n * 2) == 0);
            if (xbf)
                free(xin);
            free(x), free(dy), free(w), free(d0), free(dw0), free(dinp), free(dw), free(dinp_c), free(dw_c);
            free(xb), free(db), free(db_c);
        }
    printf("cpu: rmsnorm_bwd_typed = widen + rmsnorm_bwd(_acc) + cast2d bit for bit\n");
}

static void ref_head_norm_rope(kn_ctx *c) {
    const int64_t T = 5;
    const int     nh = 3, hd = 10;
    int32_t       pos[5] = {0, 3, 17, 1000, 5};
    for (int xbf = 0; xbf < 2; xbf++)
        for (int rot = 6; rot <= hd; rot += hd - 6) {
            const int64_t n = T * nh * hd;
            float        *x = rnd(n, 2), *w = rnd(hd, 1), *out = tst_zeros_f32(n), *chain;
            uint16_t      *xb = tst_bf16_round_n(x, n);
            const void    *xin_t = xbf ? (const void *)xb : (const void *)x;
            const cm_dtype xdt = xbf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
            TST_CHECK(kn_ref_head_norm_rope(c, out, CM_DTYPE_F32, xin_t, xdt, w, pos, T, nh, hd, rot, 1e4f,
                                            1e-6f) == CM_OK);
            chain = xbf ? tst_bf16_widen_n(xb, n) : dup_f(x, n);
            TST_CHECK(kn_ref_rmsnorm(c, chain, chain, w, T * nh, hd, 1e-6f, 0) == CM_OK);
            TST_CHECK(kn_ref_rope(c, chain, pos, T, nh, hd, rot, 1e4f) == CM_OK);
            TST_CHECK(memcmp(out, chain, (size_t)n * 4) == 0);
            /* a BF16 out: the chain's value rounded once (cast2d) */
            uint16_t *ob = tst_xcalloc((size_t)n * 2), *ob_c = tst_bf16_round_n(chain, n);
            TST_CHECK(kn_ref_head_norm_rope(c, ob, CM_DTYPE_BF16, xin_t, xdt, w, pos, T, nh, hd, rot, 1e4f,
                                            1e-6f) == CM_OK);
            TST_CHECK(memcmp(ob, ob_c, (size_t)n * 2) == 0);
            if (xbf) { /* in place on BF16 */
                uint16_t *xb2 = tst_bf16_round_n(x, n);
                TST_CHECK(kn_ref_head_norm_rope(c, xb2, CM_DTYPE_BF16, xb2, CM_DTYPE_BF16, w, pos, T, nh, hd,
                                                rot, 1e4f, 1e-6f) == CM_OK);
                TST_CHECK(memcmp(xb2, ob_c, (size_t)n * 2) == 0);
                free(xb2);
            }
            free(ob), free(ob_c);
            if (!xbf) { /* in place */
                TST_CHECK(kn_ref_head_norm_rope(c, x, CM_DTYPE_F32, x, CM_DTYPE_F32, w, pos, T, nh, hd, rot,
                                                1e4f, 1e-6f) == CM_OK);
                TST_CHECK(memcmp(x, chain, (size_t)n * 4) == 0);
            }
            /* the backward */
            float *dy = rnd(n, 1), *dy_c = dup_f(dy, n), *dinp = tst_zeros_f32(n), *dinp_c = tst_zeros_f32(n);
            float *dw = rnd(hd, 1), *dw_c = dup_f(dw, hd);
            float    *xin = tst_bf16_widen_n(xb, n);
            float    *dy2 = dup_f(dy, n), *dw2 = dup_f(dw, hd);
            uint16_t *db = tst_xcalloc((size_t)n * 2), *db_c = tst_xcalloc((size_t)n * 2);
            TST_CHECK(kn_ref_head_norm_rope_bwd(c, dinp, CM_DTYPE_F32, dw, dy, xb, CM_DTYPE_BF16, w, pos, T,
                                                nh, hd, rot, 1e4f, 1e-6f) == CM_OK);
            TST_CHECK(kn_ref_head_norm_rope_bwd(c, db, CM_DTYPE_BF16, dw2, dy2, xb, CM_DTYPE_BF16, w, pos, T,
                                                nh, hd, rot, 1e4f, 1e-6f) == CM_OK);
            TST_CHECK(kn_ref_rope_bwd(c, dy_c, pos, T, nh, hd, rot, 1e4f) == CM_OK);
            TST_CHECK(kn_ref_rmsnorm_bwd(c, dinp_c, dw_c, dy_c, xin, w, T * nh, hd, 1e-6f, 0) == CM_OK);
            TST_CHECK(kn_ref_cast2d(c, db_c, CM_DTYPE_BF16, n, dinp_c, CM_DTYPE_F32, n, 1, n) == CM_OK);
            TST_CHECK(memcmp(dinp, dinp_c, (size_t)n * 4) == 0 && memcmp(dw, dw_c, (size_t)hd * 4) == 0 &&
                      memcmp(dy, dy_c, (size_t)n * 4) == 0);
            TST_CHECK(memcmp(db, db_c, (size_t)n * 2) == 0 && memcmp(dw2, dw_c, (size_t)hd * 4) == 0 &&
                      memcmp(dy2, dy_c, (size_t)n * 4) == 0);
            free(dy), free(dy_c), free(dinp), free(dinp_c), free(dw), free(dw_c), free(xin);
            free(dy2), free(dw2), free(db), free(db_c);
            free(x), free(w), free(out), free(chain), free(xb);
        }
    printf(
        "cpu: head_norm_rope = widen + rmsnorm + rope (+ cast2d into BF16), head_norm_rope_bwd = rope_bwd + "
        "widen + rmsnorm_bwd, bit for bit (rot_dim 6 and 10 of 10, in place)\n");
}

static void ref_bad_args(kn_ctx *c) {
    float                    x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, w[4] = {1, 1, 1, 1}, y[8], dw[4] = {0};
    uint16_t                 xb[8] = {0}, yb[8];
    int32_t                  pos[2] = {0, 1};
    static const char *const round_words[] = {"round", "F32", NULL}, *const out_words[] = {"no output", NULL},
                             *const type_words[] = {"I32", "not supported", NULL},
                             *const alias_words[] = {"alias", NULL}, *const rot_words[] = {"rot_dim=5", NULL};
    kn_norm_typed_params p = {
        .rows = 2, .C = 4, .eps = 1e-6f, .w = w, .x = xb, .x_dt = CM_DTYPE_BF16, .round = 1, .out = y};
    TST_CHECK(tst_fails_with(kn_ref_rmsnorm_typed(c, &p), CM_ERR_INVALID_ARG, round_words));
    p = (kn_norm_typed_params){.rows = 2, .C = 4, .w = w, .x = x, .x_dt = CM_DTYPE_F32};
    TST_CHECK(tst_fails_with(kn_ref_rmsnorm_typed(c, &p), CM_ERR_INVALID_ARG, out_words));
    p = (kn_norm_typed_params){.rows = 2, .C = 4, .w = w, .x = x, .x_dt = CM_DTYPE_I32, .out_bf16 = yb};
    TST_CHECK(tst_fails_with(kn_ref_rmsnorm_typed(c, &p), CM_ERR_UNSUPPORTED, type_words));
    kn_norm_bwd_typed_params b = {
        .rows = 2, .C = 4, .w = w, .dw = dw, .x = x, .x_dt = CM_DTYPE_F32, .dout = y, .dinp = y};
    TST_CHECK(tst_fails_with(kn_ref_rmsnorm_bwd_typed(c, &b), CM_ERR_INVALID_ARG, alias_words));
    TST_CHECK(tst_fails_with(
        kn_ref_head_norm_rope(c, y, CM_DTYPE_F32, x, CM_DTYPE_F32, w, pos, 2, 1, 4, 5, 1e4f, 1e-6f),
        CM_ERR_INVALID_ARG, rot_words));
    static const char *const same_words[] = {"same dtype", NULL};
    TST_CHECK(tst_fails_with(
        kn_ref_head_norm_rope(c, x, CM_DTYPE_BF16, x, CM_DTYPE_F32, w, pos, 2, 1, 4, 4, 1e4f, 1e-6f),
        CM_ERR_INVALID_ARG, same_words));
    TST_CHECK(tst_fails_with(kn_ref_head_norm_rope_bwd(c, y, CM_DTYPE_F32, dw, y, x, CM_DTYPE_F32, w, pos, 2,
                                                       1, 4, 4, 1e4f, 1e-6f),
                             CM_ERR_INVALID_ARG, alias_words));
    printf("cpu: bad arguments refused (round on BF16, no output, I32, aliases, odd rot_dim, in place across "
           "dtypes)\n");
}

// ----------------------------------------------------------------------------
// cuda against the references

static void *dev_put(const kn_backend *be, kn_ctx *ctx, const void *host, size_t bytes) {
    void *d = NULL;
    TST_CHECK(be->alloc(ctx, &d, bytes) == CM_OK);
    if (d && host)
        TST_CHECK(be->upload(ctx, d, host, bytes) == CM_OK);
    return d;
}

static void *dev_get(const kn_backend *be, kn_ctx *ctx, const void *dev, size_t bytes) {
    void *h = tst_xcalloc(bytes);
    TST_CHECK(be->download(ctx, h, dev, bytes) == CM_OK);
    return h;
}

/* bf16 arrays compared as floats within one bf16 ulp (2^-8 relative) */
static void close_bf(const char *name, const uint16_t *got, const uint16_t *ref, int64_t n) {
    float *a = tst_bf16_widen_n(got, n), *b = tst_bf16_widen_n(ref, n);
    tst_compare(name, 36, a, b, (long)n, 1e-6, 8e-3, NULL);
    free(a), free(b);
}

static void cuda_norms(const kn_backend *be, kn_ctx *ctx, kn_ctx *cpu, int64_t rows, int64_t C) {
    const int64_t n = rows * C;
    float        *x = rnd(n, 3), *w = rnd(C, 1), *y = tst_zeros_f32(n), *dy = rnd(n, 1), *d0 = rnd(n, 1);
    float        *dw0 = rnd(C, 1);
    uint16_t     *sb = tst_xcalloc((size_t)n * 2), *ob = tst_xcalloc((size_t)n * 2), *xb;
    float        *gx = dev_put(be, ctx, x, (size_t)n * 4), *gw = dev_put(be, ctx, w, (size_t)C * 4);
    float        *gy = dev_put(be, ctx, NULL, (size_t)n * 4);
    uint16_t     *gsb = dev_put(be, ctx, NULL, (size_t)n * 2), *gob = dev_put(be, ctx, NULL, (size_t)n * 2);
    /* forward with round: the reference rounds x in place too */
    kn_norm_typed_params p = {.rows = rows,
                              .C = C,
                              .eps = 1e-6f,
                              .w = w,
                              .x = x,
                              .x_dt = CM_DTYPE_F32,
                              .round = 1,
                              .x_bf16 = sb,
                              .out = y,
                              .out_bf16 = ob};
    TST_CHECK(kn_ref_rmsnorm_typed(cpu, &p) == CM_OK);
    p.w = gw, p.x = gx, p.x_bf16 = gsb, p.out = gy, p.out_bf16 = gob;
    TST_CHECK(be->rmsnorm_typed(ctx, &p) == CM_OK);
    float    *hx = dev_get(be, ctx, gx, (size_t)n * 4), *hy = dev_get(be, ctx, gy, (size_t)n * 4);
    uint16_t *hsb = dev_get(be, ctx, gsb, (size_t)n * 2), *hob = dev_get(be, ctx, gob, (size_t)n * 2);
    TST_CHECK(memcmp(hx, x, (size_t)n * 4) == 0 && memcmp(hsb, sb, (size_t)n * 2) == 0);
    tst_compare("cuda rmsnorm_typed round out", 36, hy, y, (long)n, 1e-5, 1e-5, NULL);
    close_bf("cuda rmsnorm_typed round out_bf16", hob, ob, n);
    free(hx), free(hy), free(hsb), free(hob);
    /* forward from BF16 x, out_bf16 only */
    xb = sb; /* the saved rows */
    p = (kn_norm_typed_params){.rows = rows,
                               .C = C,
                               .eps = 1e-6f,
                               .one_plus = 1,
                               .w = w,
                               .x = xb,
                               .x_dt = CM_DTYPE_BF16,
                               .out_bf16 = ob};
    TST_CHECK(kn_ref_rmsnorm_typed(cpu, &p) == CM_OK);
    p.w = gw, p.x = gsb, p.out_bf16 = gob;
    TST_CHECK(be->rmsnorm_typed(ctx, &p) == CM_OK);
    hob = dev_get(be, ctx, gob, (size_t)n * 2);
    close_bf("cuda rmsnorm_typed bf16 x", hob, ob, n);
    free(hob);
    /* backward, x BF16 and F32, accumulate, with the bf16 copy */
    for (int xbf = 0; xbf < 2; xbf++) {
        float *dinp = dup_f(d0, n), *dw = dup_f(dw0, C);
        float *gdy = dev_put(be, ctx, dy, (size_t)n * 4), *gd = dev_put(be, ctx, d0, (size_t)n * 4);
        float *gdw = dev_put(be, ctx, dw0, (size_t)C * 4);
        kn_norm_bwd_typed_params b = {.rows = rows,
                                      .C = C,
                                      .eps = 1e-6f,
                                      .w = w,
                                      .dw = dw,
                                      .x = xbf ? (const void *)xb : (const void *)x,
                                      .x_dt = xbf ? CM_DTYPE_BF16 : CM_DTYPE_F32,
                                      .dout = dy,
                                      .dinp = dinp,
                                      .accumulate = 1,
                                      .dinp_bf16 = ob};
        TST_CHECK(kn_ref_rmsnorm_bwd_typed(cpu, &b) == CM_OK);
        b.w = gw, b.dw = gdw, b.x = xbf ? (const void *)gsb : (const void *)gx, b.dout = gdy, b.dinp = gd;
        b.dinp_bf16 = gob;
        TST_CHECK(be->rmsnorm_bwd_typed(ctx, &b) == CM_OK);
        float    *hd = dev_get(be, ctx, gd, (size_t)n * 4), *hdw = dev_get(be, ctx, gdw, (size_t)C * 4);
        uint16_t *hdb = dev_get(be, ctx, gob, (size_t)n * 2);
        tst_compare(xbf ? "cuda rmsnorm_bwd_typed bf16 x" : "cuda rmsnorm_bwd_typed f32 x", 36, hd, dinp,
                    (long)n, 1e-5, 1e-5, NULL);
        tst_compare("cuda rmsnorm_bwd_typed dw", 36, hdw, dw, (long)C, 1e-5, 1e-5, NULL);
        close_bf("cuda rmsnorm_bwd_typed dinp_bf16", hdb, ob, n);
        free(hd), free(hdw), free(hdb), free(dinp), free(dw);
        be->free(ctx, gdy), be->free(ctx, gd), be->free(ctx, gdw);
    }
    free(x), free(w), free(y), free(dy), free(d0), free(dw0), free(sb), free(ob);
    be->free(ctx, gx), be->free(ctx, gw), be->free(ctx, gy), be->free(ctx, gsb), be->free(ctx, gob);
}

static void cuda_heads(const kn_backend *be, kn_ctx *ctx, kn_ctx *cpu, int64_t T, int nh, int hd, int rot) {
    const int64_t n = T * nh * (int64_t)hd;
    int32_t      *pos = tst_xcalloc((size_t)T * 4);
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)((t * 977) % 40000);
    float *x = rnd(n, 2), *w = rnd(hd, 1), *out = tst_zeros_f32(n), *dy = rnd(n, 1), *dinp = tst_zeros_f32(n);
    float *dw = rnd(hd, 1), *dy_ref = dup_f(dy, n), *dw_ref = dup_f(dw, hd);
    uint16_t *xb = tst_bf16_round_n(x, n);
    int32_t  *gpos = dev_put(be, ctx, pos, (size_t)T * 4);
    float    *gx = dev_put(be, ctx, x, (size_t)n * 4), *gw = dev_put(be, ctx, w, (size_t)hd * 4);
    float    *gout = dev_put(be, ctx, NULL, (size_t)n * 4), *gdy = dev_put(be, ctx, dy, (size_t)n * 4);
    float    *gdinp = dev_put(be, ctx, NULL, (size_t)n * 4), *gdw = dev_put(be, ctx, dw, (size_t)hd * 4);
    uint16_t *gxb = dev_put(be, ctx, xb, (size_t)n * 2);
    char      name[96];
    /* forward from BF16 and in place on F32 */
    TST_CHECK(kn_ref_head_norm_rope(cpu, out, CM_DTYPE_F32, xb, CM_DTYPE_BF16, w, pos, T, nh, hd, rot, 1e6f,
                                    1e-6f) == CM_OK);
    TST_CHECK(be->head_norm_rope(ctx, gout, CM_DTYPE_F32, gxb, CM_DTYPE_BF16, gw, gpos, T, nh, hd, rot, 1e6f,
                                 1e-6f) == CM_OK);
    float *h = dev_get(be, ctx, gout, (size_t)n * 4);
    snprintf(name, sizeof name, "cuda head_norm_rope nh=%d hd=%d rot=%d", nh, hd, rot);
    tst_compare(name, 36, h, out, (long)n, 1e-5, 1e-5, NULL);
    /* a BF16 out is the F32 out rounded once, bit for bit; in place on BF16 too */
    uint16_t *hb_c = tst_bf16_round_n(h, n), *gob = dev_put(be, ctx, NULL, (size_t)n * 2);
    TST_CHECK(be->head_norm_rope(ctx, gob, CM_DTYPE_BF16, gxb, CM_DTYPE_BF16, gw, gpos, T, nh, hd, rot, 1e6f,
                                 1e-6f) == CM_OK);
    uint16_t *hb = dev_get(be, ctx, gob, (size_t)n * 2);
    TST_CHECK(memcmp(hb, hb_c, (size_t)n * 2) == 0);
    free(hb);
    uint16_t *gxb2 = dev_put(be, ctx, xb, (size_t)n * 2);
    TST_CHECK(be->head_norm_rope(ctx, gxb2, CM_DTYPE_BF16, gxb2, CM_DTYPE_BF16, gw, gpos, T, nh, hd, rot,
                                 1e6f, 1e-6f) == CM_OK);
    hb = dev_get(be, ctx, gxb2, (size_t)n * 2);
    TST_CHECK(memcmp(hb, hb_c, (size_t)n * 2) == 0);
    free(hb), free(hb_c), free(h);
    TST_CHECK(be->head_norm_rope(ctx, gout, CM_DTYPE_F32, gx, CM_DTYPE_F32, gw, gpos, T, nh, hd, rot, 1e6f,
                                 1e-6f) == CM_OK);
    float *h1 = dev_get(be, ctx, gout, (size_t)n * 4);
    hb_c = tst_bf16_round_n(h1, n);
    TST_CHECK(be->head_norm_rope(ctx, gob, CM_DTYPE_BF16, gx, CM_DTYPE_F32, gw, gpos, T, nh, hd, rot, 1e6f,
                                 1e-6f) == CM_OK);
    hb = dev_get(be, ctx, gob, (size_t)n * 2);
    TST_CHECK(memcmp(hb, hb_c, (size_t)n * 2) == 0);
    free(hb), free(hb_c);
    be->free(ctx, gob), be->free(ctx, gxb2);
    TST_CHECK(be->head_norm_rope(ctx, gx, CM_DTYPE_F32, gx, CM_DTYPE_F32, gw, gpos, T, nh, hd, rot, 1e6f,
                                 1e-6f) == CM_OK);
    float *h2 = dev_get(be, ctx, gx, (size_t)n * 4);
    TST_CHECK(memcmp(h1, h2, (size_t)n * 4) == 0);
    free(h1), free(h2);
    /* backward */
    TST_CHECK(kn_ref_head_norm_rope_bwd(cpu, dinp, CM_DTYPE_F32, dw_ref, dy_ref, xb, CM_DTYPE_BF16, w, pos, T,
                                        nh, hd, rot, 1e6f, 1e-6f) == CM_OK);
    uint16_t *ref_b = tst_bf16_round_n(dinp, n);
    float    *gdy2 = dev_put(be, ctx, dy, (size_t)n * 4), *gdw2 = dev_put(be, ctx, dw, (size_t)hd * 4);
    uint16_t *gdb = dev_put(be, ctx, NULL, (size_t)n * 2);
    TST_CHECK(be->head_norm_rope_bwd(ctx, gdinp, CM_DTYPE_F32, gdw, gdy, gxb, CM_DTYPE_BF16, gw, gpos, T, nh,
                                     hd, rot, 1e6f, 1e-6f) == CM_OK);
    TST_CHECK(be->head_norm_rope_bwd(ctx, gdb, CM_DTYPE_BF16, gdw2, gdy2, gxb, CM_DTYPE_BF16, gw, gpos, T, nh,
                                     hd, rot, 1e6f, 1e-6f) == CM_OK);
    float *hd_ = dev_get(be, ctx, gdinp, (size_t)n * 4), *hdw = dev_get(be, ctx, gdw, (size_t)hd * 4),
          *hdy = dev_get(be, ctx, gdy, (size_t)n * 4), *hdw2 = dev_get(be, ctx, gdw2, (size_t)hd * 4);
    uint16_t *hdb = dev_get(be, ctx, gdb, (size_t)n * 2), *hdb_c = tst_bf16_round_n(hd_, n);
    snprintf(name, sizeof name, "cuda head_norm_rope_bwd nh=%d hd=%d", nh, hd);
    tst_compare(name, 36, hd_, dinp, (long)n, 1e-5, 1e-5, NULL);
    tst_compare("cuda head_norm_rope_bwd dw", 36, hdw, dw_ref, (long)hd, 1e-5, 1e-5, NULL);
    tst_compare("cuda head_norm_rope_bwd dout rotated", 36, hdy, dy_ref, (long)n, 1e-6, 1e-6, NULL);
    close_bf("cuda head_norm_rope_bwd bf16 dinp", hdb, ref_b, n);
    /* the bf16 output is the rounding of the F32 one, and dw the same bits */
    TST_CHECK(memcmp(hdb, hdb_c, (size_t)n * 2) == 0 && memcmp(hdw, hdw2, (size_t)hd * 4) == 0);
    free(hd_), free(hdw), free(hdy), free(hdw2), free(hdb), free(hdb_c), free(ref_b);
    be->free(ctx, gdy2), be->free(ctx, gdw2), be->free(ctx, gdb);
    free(pos), free(x), free(w), free(out), free(dy), free(dinp), free(dw), free(dy_ref), free(dw_ref),
        free(xb);
    be->free(ctx, gpos), be->free(ctx, gx), be->free(ctx, gw), be->free(ctx, gout), be->free(ctx, gdy);
    be->free(ctx, gdinp), be->free(ctx, gdw), be->free(ctx, gxb);
}

static void check_cuda(void) {
    tst_need_cuda();
    const kn_backend *be = kn_backend_cuda();
    kn_ctx           *ctx = NULL, *cpu = NULL;
    kn_ctx_config     kc = KN_CTX_CONFIG_DEFAULT;
    TST_CHECK(be->ctx_create(&ctx, &kc) == CM_OK && kn_ref_ctx_create(&cpu, NULL) == CM_OK);
    if (!ctx || !cpu)
        return;
    cuda_norms(be, ctx, cpu, 301, 517); /* C % 4 != 0: the scalar kernels */
    cuda_norms(be, ctx, cpu, 19, 260);  /* the vector kernels with one group of four a thread */
    cuda_norms(be, ctx, cpu, 33, 5120); /* four groups a thread (the drafter's rows) */
    cuda_heads(be, ctx, cpu, 37, 5, 128, 128);
    cuda_heads(be, ctx, cpu, 29, 12, 72, 40);
    float x[4] = {0};
    TST_CHECK(be->head_norm_rope(ctx, x, CM_DTYPE_F32, x, CM_DTYPE_F32, x, NULL, 1, 1, 1026, 1026, 1e4f,
                                 1e-6f) == CM_ERR_UNSUPPORTED);
    TST_CHECK(be->head_norm_rope(ctx, x, CM_DTYPE_I32, x, CM_DTYPE_F32, x, NULL, 1, 1, 4, 4, 1e4f, 1e-6f) ==
              CM_ERR_INVALID_ARG);
    be->ctx_destroy(&ctx);
    kn_ref_ctx_destroy(&cpu);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "cuda") == 0) {
        check_cuda();
    } else {
        kn_ctx *c = NULL;
        TST_CHECK(kn_ref_ctx_create(&c, NULL) == CM_OK);
        ref_rmsnorm_typed(c);
        ref_rmsnorm_bwd_typed(c);
        ref_head_norm_rope(c);
        ref_bad_args(c);
        kn_ref_ctx_destroy(&c);
    }
    return tst_report();
}
