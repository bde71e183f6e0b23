/* tests/test_kn_cuda_dynconv.c — the CUDA grouped dynamic causal convolution (kn_dynconv.cu)
 * against the cpu reference, forward and backward, both sides, on odd shapes and one of training
 * size: each output within a small multiple of fp32 rounding of its dot-product bound Σ|a·b|,
 * the other side's gradient slices untouched, the backward repeated bit-identical, the trainer's
 * options (BF16 x, accumulate, bf16 copies), bad arguments refused as on the cpu. Label gpu; exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

typedef struct {
    const char *name;
    int         n_blocks, B, D, G, Kc;
} dc_case;

static void download_both(const dbuf *b, void *c, void *g) {
    if (gpu->sync(gctx) != CM_OK || cpu->download(cctx, c, b->c, b->bytes) != CM_OK ||
        gpu->download(gctx, g, b->g, b->bytes) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* The dot-product bounds Σ|a·b| of every output of one side, on the host in double. */
static void bounds(const dc_case *c, int s, const float *x, const float *base, const float *delta,
                   const float *dout, double *b_out, double *b_dx, double *b_dd, double *b_db) {
    const long rows = (long)c->n_blocks * c->B, ng = c->D / c->G;
#define COEF(i, t, ch)                                                                                       \
    fabs((double)base[((long)s * c->Kc + (t)) * c->D + (ch)] +                                               \
         (double)delta[(((i)*2 + s) * c->Kc + (t)) * ng + (ch) / c->G])
    for (long i = 0; i < rows; i++)
        for (int ch = 0; ch < c->D; ch++) {
            double bo = 0, bx = 0;
            for (int t = 0; t < c->Kc; t++) {
                if (t <= i % c->B)
                    bo += COEF(i, t, ch) * fabs((double)x[(i - t) * c->D + ch]);
                if (t <= c->B - 1 - i % c->B)
                    bx += COEF(i + t, t, ch) * fabs((double)dout[(i + t) * c->D + ch]);
            }
            b_out[i * c->D + ch] = bo;
            b_dx[i * c->D + ch] = bx;
        }
#undef COEF
    for (long i = 0; i < rows; i++)
        for (int t = 0; t < 2 * c->Kc; t++)
            for (int g = 0; g < ng; g++) {
                double acc = 0;
                if (t / c->Kc == s && t % c->Kc <= i % c->B)
                    for (int ch = g * c->G; ch < (g + 1) * c->G; ch++)
                        acc += fabs((double)x[(i - t % c->Kc) * c->D + ch] * (double)dout[i * c->D + ch]);
                b_dd[(i * 2 * c->Kc + t) * ng + g] = acc;
            }
    for (int t = 0; t < 2 * c->Kc; t++)
        for (int ch = 0; ch < c->D; ch++) {
            double acc = 0;
            for (long i = 0; t / c->Kc == s && i < rows; i++)
                if (i % c->B >= t % c->Kc)
                    acc += fabs((double)x[(i - t % c->Kc) * c->D + ch] * (double)dout[i * c->D + ch]);
            b_db[t * c->D + ch] = acc;
        }
}

static void run_case(const dc_case *c, int side) {
    const long rows = (long)c->n_blocks * c->B, ng = c->D / c->G;
    const long nx = rows * c->D, nb = 2L * c->Kc * c->D, nd = rows * 2 * c->Kc * ng;
    float *x = tst_rand_f32(nx, -1, 1), *base = tst_rand_f32(nb, -1, 1), *delta = tst_rand_f32(nd, -0.5, 0.5);
    float *dout = tst_rand_f32(nx, -1, 1), *fill_b = tst_xcalloc((size_t)nb * 4),
          *fill_d = tst_xcalloc((size_t)nd * 4);
    for (long i = 0; i < nb; i++)
        fill_b[i] = 77.0f;
    for (long i = 0; i < nd; i++)
        fill_d[i] = 77.0f;
    dbuf bx = dbuf_put(x, (size_t)nx * 4), bbase = dbuf_put(base, (size_t)nb * 4),
         bdel = dbuf_put(delta, (size_t)nd * 4);
    dbuf bdo = dbuf_put(dout, (size_t)nx * 4), bout = dbuf_put(NULL, (size_t)nx * 4),
         bdx = dbuf_put(NULL, (size_t)nx * 4);
    dbuf              bdb = dbuf_put(fill_b, (size_t)nb * 4), bdd = dbuf_put(fill_d, (size_t)nd * 4);
    kn_dynconv_params pc = {.rows = rows, .B = c->B, .D = c->D, .G = c->G, .Kc = c->Kc, .side = side};
    kn_dynconv_params pg = pc;
    pc.x = bx.c, pc.base = bbase.c, pc.delta = bdel.c, pc.out = bout.c, pc.dout = bdo.c, pc.dx = bdx.c,
    pc.dbase = bdb.c, pc.ddelta = bdd.c;
    pg.x = bx.g, pg.base = bbase.g, pg.delta = bdel.g, pg.out = bout.g, pg.dout = bdo.g, pg.dx = bdx.g,
    pg.dbase = bdb.g, pg.ddelta = bdd.g;
    tst_ok(cpu->dynconv_fwd(cctx, &pc), "cpu dynconv_fwd");
    tst_ok(cpu->dynconv_bwd(cctx, &pc), "cpu dynconv_bwd");
    tst_ok(gpu->dynconv_fwd(gctx, &pg), "cuda dynconv_fwd");
    tst_ok(gpu->dynconv_bwd(gctx, &pg), "cuda dynconv_bwd");

    double *b_out = tst_xcalloc((size_t)nx * 8), *b_dx = tst_xcalloc((size_t)nx * 8);
    double *b_dd = tst_xcalloc((size_t)nd * 8), *b_db = tst_xcalloc((size_t)nb * 8);
    bounds(c, side, x, base, delta, dout, b_out, b_dx, b_dd, b_db);
    const dbuf   *bufs[4] = {&bout, &bdx, &bdd, &bdb};
    const long    ns[4] = {nx, nx, nd, nb};
    const double *bd[4] = {b_out, b_dx, b_dd, b_db};
    const char   *what[4] = {"out", "dx", "ddelta", "dbase"};
    float        *first[4];
    for (int k = 0; k < 4; k++) {
        float *hc = tst_xcalloc((size_t)ns[k] * 4), *hg = tst_xcalloc((size_t)ns[k] * 4);
        download_both(bufs[k], hc, hg);
        char name[160];
        snprintf(name, sizeof name, "dynconv %-6s %s side %d (rows %ld D %d G %d Kc %d)", what[k], c->name,
                 side, rows, c->D, c->G, c->Kc);
        /* fp32 fma chains against double sums: a few ulps of the bound per term */
        tst_compare_bound(name, 76, hg, hc, bd[k], ns[k], 1e-6 * (k == 3 ? sqrt((double)rows) + 8 : 8), NULL);
        if (k >= 2) { /* the other side's slice untouched, on both backends */
            int        untouched = 1;
            const long slice = k == 2 ? (long)c->Kc * ng : (long)c->Kc * c->D;
            for (long i = 0; i < ns[k]; i++)
                if ((k == 2 ? (i / slice) % 2 : i / slice) != side)
                    untouched &= hc[i] == 77.0f && hg[i] == 77.0f;
            TST_CHECK(untouched);
        }
        first[k] = hg;
        free(hc);
    }
    /* determinism: the backward again, the same bits */
    tst_ok(gpu->dynconv_bwd(gctx, &pg), "cuda dynconv_bwd again");
    int same = 1;
    for (int k = 1; k < 4; k++) {
        float *hc = tst_xcalloc((size_t)ns[k] * 4), *hg = tst_xcalloc((size_t)ns[k] * 4);
        download_both(bufs[k], hc, hg);
        same &= memcmp(hg, first[k], (size_t)ns[k] * 4) == 0;
        free(hc);
        free(hg);
    }
    TST_CHECK(same);
    printf("%-76s %s\n", "dynconv backward repeated", same ? "bit-identical" : "DIFFERS");
    for (int k = 0; k < 4; k++)
        free(first[k]);
    dbuf *all[] = {&bx, &bbase, &bdel, &bdo, &bout, &bdx, &bdb, &bdd};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
    free(x), free(base), free(delta), free(dout), free(fill_b), free(fill_d);
    free(b_out), free(b_dx), free(b_dd), free(b_db);
}

/* The trainer's options on both backends: x in BF16, the forward accumulated onto out, the bf16 copies
 * of out and dx. The F32 results within the bound of each output (the accumulated one's plus |out|
 * before); each backend's copies exactly bf16 of its own F32 results. */
static void run_options(const dc_case *c, int side) {
    const long rows = (long)c->n_blocks * c->B, ng = c->D / c->G;
    const long nx = rows * c->D, nb = 2L * c->Kc * c->D, nd = rows * 2 * c->Kc * ng;
    float    *x = tst_rand_f32(nx, -1, 1), *base = tst_rand_f32(nb, -1, 1), *delta = tst_rand_f32(nd, -0.5, 0.5);
    float    *dout = tst_rand_f32(nx, -1, 1), *prev = tst_rand_f32(nx, -1, 1);
    uint16_t *x16 = tst_xcalloc((size_t)nx * 2);
    for (long i = 0; i < nx; i++) {
        x16[i] = cm_f32_to_bf16(x[i]);
        x[i] = cm_bf16_to_f32(x16[i]);
    }
    dbuf bx = dbuf_put(x16, (size_t)nx * 2), bbase = dbuf_put(base, (size_t)nb * 4), bdel = dbuf_put(delta, (size_t)nd * 4);
    dbuf bdo = dbuf_put(dout, (size_t)nx * 4), bout = dbuf_put(prev, (size_t)nx * 4), bdx = dbuf_put(NULL, (size_t)nx * 4);
    dbuf bo16 = dbuf_put(NULL, (size_t)nx * 2), bdx16 = dbuf_put(NULL, (size_t)nx * 2);
    dbuf bdb = dbuf_put(NULL, (size_t)nb * 4), bdd = dbuf_put(NULL, (size_t)nd * 4);
    kn_dynconv_params pc = {.rows = rows, .B = c->B, .D = c->D, .G = c->G, .Kc = c->Kc, .side = side,
                            .x_dt = CM_DTYPE_BF16, .accumulate = 1};
    kn_dynconv_params pg = pc;
    pc.x = bx.c, pc.base = bbase.c, pc.delta = bdel.c, pc.out = bout.c, pc.out_bf16 = bo16.c, pc.dout = bdo.c;
    pc.dx = bdx.c, pc.dx_bf16 = bdx16.c, pc.dbase = bdb.c, pc.ddelta = bdd.c;
    pg.x = bx.g, pg.base = bbase.g, pg.delta = bdel.g, pg.out = bout.g, pg.out_bf16 = bo16.g, pg.dout = bdo.g;
    pg.dx = bdx.g, pg.dx_bf16 = bdx16.g, pg.dbase = bdb.g, pg.ddelta = bdd.g;
    tst_ok(cpu->dynconv_fwd(cctx, &pc), "cpu dynconv_fwd (options)");
    tst_ok(cpu->dynconv_bwd(cctx, &pc), "cpu dynconv_bwd (options)");
    tst_ok(gpu->dynconv_fwd(gctx, &pg), "cuda dynconv_fwd (options)");
    tst_ok(gpu->dynconv_bwd(gctx, &pg), "cuda dynconv_bwd (options)");
    double *b_out = tst_xcalloc((size_t)nx * 8), *b_dx = tst_xcalloc((size_t)nx * 8);
    double *b_dd = tst_xcalloc((size_t)nd * 8), *b_db = tst_xcalloc((size_t)nb * 8);
    bounds(c, side, x, base, delta, dout, b_out, b_dx, b_dd, b_db);
    for (long i = 0; i < nx; i++)
        b_out[i] += fabs((double)prev[i]);
    float    *oc = tst_xcalloc((size_t)nx * 4), *og = tst_xcalloc((size_t)nx * 4);
    float    *dc = tst_xcalloc((size_t)nx * 4), *dg = tst_xcalloc((size_t)nx * 4);
    uint16_t *o16c = tst_xcalloc((size_t)nx * 2), *o16g = tst_xcalloc((size_t)nx * 2);
    uint16_t *d16c = tst_xcalloc((size_t)nx * 2), *d16g = tst_xcalloc((size_t)nx * 2);
    download_both(&bout, oc, og);
    download_both(&bdx, dc, dg);
    download_both(&bo16, o16c, o16g);
    download_both(&bdx16, d16c, d16g);
    char name[160];
    snprintf(name, sizeof name, "dynconv BF16 x, accumulate: out %s side %d", c->name, side);
    tst_compare_bound(name, 76, og, oc, b_out, nx, 8e-6, NULL);
    snprintf(name, sizeof name, "dynconv BF16 x: dx %s side %d", c->name, side);
    tst_compare_bound(name, 76, dg, dc, b_dx, nx, 8e-6, NULL);
    int copies = 1;
    for (long i = 0; i < nx; i++)
        copies &= o16g[i] == cm_f32_to_bf16(og[i]) && d16g[i] == cm_f32_to_bf16(dg[i]) &&
                  o16c[i] == cm_f32_to_bf16(oc[i]) && d16c[i] == cm_f32_to_bf16(dc[i]);
    TST_CHECK(copies);
    printf("%-76s %s\n", "dynconv bf16 copies of out and dx", copies ? "exact on both backends" : "WRONG");
    dbuf *all[] = {&bx, &bbase, &bdel, &bdo, &bout, &bdx, &bo16, &bdx16, &bdb, &bdd};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
    free(x), free(base), free(delta), free(dout), free(prev), free(x16), free(b_out), free(b_dx), free(b_dd);
    free(b_db), free(oc), free(og), free(dc), free(dg), free(o16c), free(o16g), free(d16c), free(d16g);
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    static const dc_case cases[] = {
        {"odd B5 Kc3 G4", 7, 5, 12, 4, 3},
        {"Kc1 G3", 3, 4, 6, 3, 1},
        {"Kc=B one group", 5, 3, 5, 5, 3},
        {"G1 Kc2", 9, 2, 3, 1, 2},
        {"training-like B16 Kc2 G16", 300, 16, 96, 16, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int side = 0; side < 2; side++)
            run_case(&cases[i], side);
    run_options(&cases[0], 1);
    run_options(&cases[4], 0);
    /* bad arguments: the same rule and message as on the cpu */
    kn_dynconv_params bad = {.rows = 8, .B = 4, .D = 6, .G = 4, .Kc = 2};
    cm_status         st = gpu->dynconv_fwd(gctx, &bad);
    TST_CHECK(st == CM_ERR_INVALID_ARG && strstr(cm_last_error(), "does not divide the hidden size D=6"));
    tst_pair_close();
    return tst_report();
}
