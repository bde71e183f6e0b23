/* tests/test_kn_dynconv.c — the cpu reference of DFlash2's grouped dynamic causal convolution
 * (kn_backend.h, kn_dynconv_params) on odd shapes: the forward against a second implementation
 * that pads every block's start with Kc − 1 zero rows (as z-lab's decoder convolves one block at a
 * time), the identity initialisation (base tap 0 = 1, the rest and delta 0) giving x back exactly,
 * every gradient (dx, this side's dbase and ddelta) against finite differences, the other side's
 * slices left untouched, the trainer's options (x in BF16, accumulate, the bf16 copies of out and dx),
 * and each bad argument refused with a message. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_fd.h"
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

typedef struct {
    const char *name;
    int         n_blocks, B, D, G, Kc;
} dc_case;

typedef struct {
    kn_dynconv_params p;
    float            *r; /* L = Σ r·out */
    long              n_x, n_base, n_delta;
} dc_st;

static double dc_loss(void *vs) {
    dc_st *s = vs;
    if (be->dynconv_fwd(ctx, &s->p) != CM_OK) {
        fprintf(stderr, "dynconv_fwd failed: %s\n", cm_last_error());
        exit(1);
    }
    double l = 0;
    for (long i = 0; i < s->n_x; i++)
        l += (double)s->r[i] * (double)s->p.out[i];
    return l;
}

/* out by padding each block's start with Kc − 1 zero rows: no slot test at all */
static void padded_forward(const kn_dynconv_params *p, double *out) {
    const int B = p->B, D = p->D, Kc = p->Kc, ng = D / p->G, s = p->side;
    double   *pad = calloc((size_t)(B + Kc - 1) * D, sizeof(double));
    for (int64_t b = 0; b < p->rows / B; b++) {
        for (int k = 0; k < B; k++)
            for (int c = 0; c < D; c++)
                pad[(size_t)(Kc - 1 + k) * D + c] = ((const float *)p->x)[(b * B + k) * D + c];
        for (int k = 0; k < B; k++) {
            const int64_t i = b * B + k;
            for (int c = 0; c < D; c++) {
                double acc = 0;
                for (int t = 0; t < Kc; t++) {
                    const double w = (double)p->base[((int64_t)s * Kc + t) * D + c] +
                                     (double)p->delta[((i * 2 + s) * Kc + t) * ng + c / p->G];
                    acc += w * pad[(size_t)(Kc - 1 + k - t) * D + c];
                }
                out[i * D + c] = acc;
            }
        }
    }
    free(pad);
}

static void run_case(const dc_case *c, int side) {
    const long rows = (long)c->n_blocks * c->B, ng = c->D / c->G;
    dc_st      s = {0};
    s.n_x = rows * c->D;
    s.n_base = 2L * c->Kc * c->D;
    s.n_delta = rows * 2 * c->Kc * ng;
    kn_dynconv_params *p = &s.p;
    *p = (kn_dynconv_params){.rows = rows, .B = c->B, .D = c->D, .G = c->G, .Kc = c->Kc, .side = side};
    float *x = tst_rand_f32(s.n_x, -1, 1), *base = tst_rand_f32(s.n_base, -1, 1);
    float *delta = tst_rand_f32(s.n_delta, -0.5, 0.5);
    p->x = x, p->base = base, p->delta = delta;
    p->out = tst_xcalloc((size_t)s.n_x * 4);
    s.r = tst_rand_f32(s.n_x, -1, 1);
    char name[160];
    snprintf(name, sizeof name, "dynconv %s side %d (blocks %d, B %d, D %d, G %d, Kc %d)", c->name, side,
             c->n_blocks, c->B, c->D, c->G, c->Kc);

    /* forward against the padded form */
    TST_CHECK(tst_ok(be->dynconv_fwd(ctx, p), name));
    double *ref = tst_xcalloc((size_t)s.n_x * sizeof(double));
    padded_forward(p, ref);
    double worst = 0;
    for (long i = 0; i < s.n_x; i++) {
        const double d = fabs((double)p->out[i] - ref[i]) / (fabs(ref[i]) + 1e-6);
        worst = d > worst ? d : worst;
    }
    TST_CHECK(worst <= 1e-6);
    printf("%-72s fwd vs padded: max rel %.2e\n", name, worst);
    free(ref);

    /* backward against finite differences; the other side's slices stay as they were */
    float *dout = s.r, *dx = tst_xcalloc((size_t)s.n_x * 4), *dbase = tst_xcalloc((size_t)s.n_base * 4),
          *ddelta = tst_xcalloc((size_t)s.n_delta * 4);
    for (long i = 0; i < s.n_base; i++)
        dbase[i] = 77.0f;
    for (long i = 0; i < s.n_delta; i++)
        ddelta[i] = 77.0f;
    p->dout = dout, p->dx = dx, p->dbase = dbase, p->ddelta = ddelta;
    TST_CHECK(tst_ok(be->dynconv_bwd(ctx, p), name));
    int untouched = 1;
    for (long i = 0; i < s.n_base; i++)
        if (i / ((long)c->Kc * c->D) != side)
            untouched &= dbase[i] == 77.0f;
    for (long i = 0; i < s.n_delta; i++)
        if ((i / ((long)c->Kc * ng)) % 2 != side)
            untouched &= ddelta[i] == 77.0f;
    TST_CHECK(untouched);
    /* finite differences need the other side's gradients too: zero there (L does not depend on them) */
    for (long i = 0; i < s.n_base; i++)
        if (dbase[i] == 77.0f)
            dbase[i] = 0;
    for (long i = 0; i < s.n_delta; i++)
        if (ddelta[i] == 77.0f)
            ddelta[i] = 0;
    char what[200];
    snprintf(what, sizeof what, "%s dx", name);
    fd_check(what, dc_loss, &s, x, dx, s.n_x);
    snprintf(what, sizeof what, "%s dbase", name);
    fd_check(what, dc_loss, &s, base, dbase, s.n_base);
    snprintf(what, sizeof what, "%s ddelta", name);
    fd_check(what, dc_loss, &s, delta, ddelta, s.n_delta);

    /* identity initialisation: base tap 0 = 1, others and delta 0, so out = x exactly */
    for (long i = 0; i < s.n_base; i++)
        base[i] = (i % ((long)c->Kc * c->D)) < c->D ? 1.0f : 0.0f;
    memset(delta, 0, (size_t)s.n_delta * 4);
    TST_CHECK(tst_ok(be->dynconv_fwd(ctx, p), "dynconv_fwd identity"));
    TST_CHECK(memcmp(p->out, x, (size_t)s.n_x * 4) == 0);

    free(x), free(base), free(delta), free(p->out), free(s.r), free(dx), free(dbase), free(ddelta);
}

/* The options the trainer uses: x in BF16 gives exactly what its widened F32 values give (both
 * passes); accumulate adds the convolution onto out; the bf16 copies of out and dx are exactly
 * bf16(out) and bf16(dx). */
static void run_options(const dc_case *c, int side) {
    const long rows = (long)c->n_blocks * c->B, n_x = rows * c->D, ng = c->D / c->G;
    const long n_base = 2L * c->Kc * c->D, n_delta = rows * 2 * c->Kc * ng;
    float     *x = tst_rand_f32(n_x, -1, 1), *base = tst_rand_f32(n_base, -1, 1);
    float     *delta = tst_rand_f32(n_delta, -0.5, 0.5), *dout = tst_rand_f32(n_x, -1, 1);
    uint16_t  *x16 = tst_xcalloc((size_t)n_x * 2), *o16 = tst_xcalloc((size_t)n_x * 2);
    uint16_t  *dx16 = tst_xcalloc((size_t)n_x * 2);
    for (long i = 0; i < n_x; i++) { /* x rounded to bf16, kept as both */
        x16[i] = cm_f32_to_bf16(x[i]);
        x[i] = cm_bf16_to_f32(x16[i]);
    }
    float *out_a = tst_xcalloc((size_t)n_x * 4), *out_b = tst_rand_f32(n_x, -1, 1);
    float *prev = tst_xcalloc((size_t)n_x * 4), *dx_a = tst_xcalloc((size_t)n_x * 4);
    float *dx_b = tst_xcalloc((size_t)n_x * 4), *db_a = tst_xcalloc((size_t)n_base * 4);
    float *db_b = tst_xcalloc((size_t)n_base * 4), *dd_a = tst_xcalloc((size_t)n_delta * 4);
    float *dd_b = tst_xcalloc((size_t)n_delta * 4);
    memcpy(prev, out_b, (size_t)n_x * 4);
    kn_dynconv_params a = {.rows = rows, .B = c->B, .D = c->D, .G = c->G, .Kc = c->Kc, .side = side, .x = x,
                           .base = base, .delta = delta, .out = out_a, .dout = dout, .dx = dx_a, .dbase = db_a,
                           .ddelta = dd_a};
    kn_dynconv_params b = a;
    b.x = x16, b.x_dt = CM_DTYPE_BF16, b.out = out_b, b.accumulate = 1, b.out_bf16 = o16;
    b.dx = dx_b, b.dbase = db_b, b.ddelta = dd_b, b.dx_bf16 = dx16;
    TST_CHECK(tst_ok(be->dynconv_fwd(ctx, &a), "dynconv_fwd F32 x"));
    TST_CHECK(tst_ok(be->dynconv_fwd(ctx, &b), "dynconv_fwd BF16 x, accumulate, bf16 copy"));
    TST_CHECK(tst_ok(be->dynconv_bwd(ctx, &a), "dynconv_bwd F32 x"));
    TST_CHECK(tst_ok(be->dynconv_bwd(ctx, &b), "dynconv_bwd BF16 x, bf16 copy of dx"));
    double acc_worst = 0;
    int    copies = 1;
    for (long i = 0; i < n_x; i++) {
        const double want = (double)prev[i] + (double)out_a[i];
        acc_worst = fmax(acc_worst, fabs(out_b[i] - want) / (fabs(prev[i]) + fabs(out_a[i]) + 1e-6));
        copies &= o16[i] == cm_f32_to_bf16(out_b[i]) && dx16[i] == cm_f32_to_bf16(dx_b[i]);
    }
    const int same_bwd = memcmp(dx_a, dx_b, (size_t)n_x * 4) == 0 &&
                         memcmp(db_a, db_b, (size_t)n_base * 4) == 0 &&
                         memcmp(dd_a, dd_b, (size_t)n_delta * 4) == 0;
    TST_CHECK(acc_worst <= 1e-6 && copies && same_bwd);
    printf("%-72s BF16 x + accumulate: max rel %.2e; bf16 copies %s; backward %s\n", c->name, acc_worst,
           copies ? "exact" : "WRONG", same_bwd ? "bit-identical" : "DIFFERS");
    free(x), free(base), free(delta), free(dout), free(x16), free(o16), free(dx16), free(out_a), free(out_b);
    free(prev), free(dx_a), free(dx_b), free(db_a), free(db_b), free(dd_a), free(dd_b);
}

static void expect_refused(kn_dynconv_params p, int bwd, const char *want) {
    cm_status st = bwd ? be->dynconv_bwd(ctx, &p) : be->dynconv_fwd(ctx, &p);
    const int good = st == CM_ERR_INVALID_ARG && strstr(cm_last_error(), want);
    if (!good)
        fprintf(stderr, "  expected a refusal with '%s', got %s: %s\n", want, cm_status_str(st),
                cm_last_error());
    TST_CHECK(good);
}

static void test_bad_args(void) {
    float             buf[4096] = {0}, out[1024];
    kn_dynconv_params good = {.rows = 8,
                              .B = 4,
                              .D = 6,
                              .G = 3,
                              .Kc = 2,
                              .side = 1,
                              .x = buf,
                              .base = buf,
                              .delta = buf,
                              .out = out,
                              .dout = buf,
                              .dx = out,
                              .dbase = out,
                              .ddelta = out};
    TST_CHECK(tst_ok(be->dynconv_fwd(ctx, &good), "dynconv_fwd good"));
    kn_dynconv_params p = good;
    p.G = 4;
    expect_refused(p, 0, "conv_group_size G=4 does not divide the hidden size D=6");
    p = good, p.Kc = 5;
    expect_refused(p, 0, "conv_kernel_size Kc=5 is above the block size B=4");
    p = good, p.rows = 7;
    expect_refused(p, 0, "rows=7 is not a whole number of blocks of B=4");
    p = good, p.side = 2;
    expect_refused(p, 1, "side=2 must be 0 (input side) or 1 (output side)");
    p = good, p.Kc = 0;
    expect_refused(p, 0, "bad shape");
    p = good, p.out = buf;
    expect_refused(p, 0, "out is NULL or aliases x");
    p = good, p.ddelta = NULL;
    expect_refused(p, 1, "dout, dx, dbase or ddelta is NULL");
    p = good, p.x_dt = CM_DTYPE_F16;
    expect_refused(p, 0, "x in F16; expected F32 or BF16");
}

int main(void) {
    be = kn_backend_cpu();
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create a cpu context: %s\n", cm_last_error());
        return 1;
    }
    static const dc_case cases[] = {
        {"Kc 3, 3 groups", 3, 5, 12, 4, 3}, /* B odd, taps cut at every block start */
        {"Kc 1 (no taps back)", 2, 4, 6, 3, 1},
        {"Kc = B, one group", 2, 3, 5, 5, 3}, /* a group of the whole width; the last slot taps all */
        {"Kc 2, group size 1", 4, 2, 3, 1, 2},
        {"one block of 8, Kc 2, G 2", 1, 8, 4, 2, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int side = 0; side < 2; side++)
            run_case(&cases[i], side);
    run_options(&cases[0], 0);
    run_options(&cases[2], 1);
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
