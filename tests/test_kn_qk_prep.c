/* tests/test_kn_qk_prep.c — the cpu qk_prep (the gated attention's q/gate split, q/k head
 * rmsnorm and partial rope in one pass) against the chain it replaces in ts_model's
 * forward_attention, two copy2d, two rmsnorm and two rope through the same backend table:
 * bit-identical q, gate and k on odd shapes (hd 2, 30, 32, 64, 256; rot_dim < hd and = hd;
 * gated and not, the ungated q in place and from a separate buffer; nq/nkv 1/1, 3/1, 6/2,
 * 4/4; several packed sequences with positions restarting per sequence, and large positions;
 * one_plus on and off). Independently of both: the gate equals qg's second halves, the dims
 * past rot_dim equal x·rstd·scale computed here, and each rotated pair keeps the sum of
 * squares of its normalised inputs (rope is a rotation). Also bad arguments and T = 0.
 * Label unit. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0x51ed270b27a3c0f1ull
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

static float *nan_f32(long n) { /* an element the op never writes stays NaN and fails */
    float *x = tst_rand_f32(n, 0, 1);
    for (long i = 0; i < n; i++)
        x[i] = NAN;
    return x;
}

typedef struct qk_case {
    int   lens[4], n_seq;
    int   nq, nkv, hd, rot;
    int   gated, in_place, one_plus;
    float theta;
    int   pos_base; /* added to every position (0: positions restart at 0 per sequence) */
} qk_case;

static void run_case(const qk_case *cs) {
    long T = 0;
    for (int s = 0; s < cs->n_seq; s++)
        T += cs->lens[s];
    const int   nq = cs->nq, nkv = cs->nkv, hd = cs->hd, rot = cs->rot, half = rot / 2;
    const long  qs = cs->gated ? 2L * hd : hd, nqg = T * nq * qs, nqe = T * nq * hd, nke = T * nkv * hd;
    const float eps = 1e-6f;
    int32_t    *pos = malloc((size_t)T * sizeof *pos);
    if (!pos)
        exit(1);
    for (int s = 0, t0 = 0; s < cs->n_seq; t0 += cs->lens[s], s++)
        for (int i = 0; i < cs->lens[s]; i++)
            pos[t0 + i] = cs->pos_base + i;
    float *qg = tst_rand_f32(nqg, -3, 3), *k = tst_rand_f32(nke, -3, 3);
    float *qn = tst_rand_f32(hd, -0.5, 0.5), *kn = tst_rand_f32(hd, -0.5, 0.5);

    /* the chain, as forward_attention ran it */
    float *qc = tst_rand_f32(nqe, 0, 1), *gc = tst_rand_f32(nqe, 0, 1), *kc = tst_rand_f32(nke, 0, 1);
    memcpy(kc, k, (size_t)nke * sizeof *k);
    if (cs->gated) {
        tst_ok(be->copy2d(ctx, qc, hd, qg, qs, T * nq, hd), "copy2d q");
        tst_ok(be->copy2d(ctx, gc, hd, qg + hd, qs, T * nq, hd), "copy2d gate");
    } else {
        memcpy(qc, qg, (size_t)nqe * sizeof *qc);
    }
    tst_ok(be->rmsnorm(ctx, qc, qc, qn, T * nq, hd, eps, cs->one_plus), "rmsnorm q");
    tst_ok(be->rmsnorm(ctx, kc, kc, kn, T * nkv, hd, eps, cs->one_plus), "rmsnorm k");
    tst_ok(be->rope(ctx, qc, pos, T, nq, hd, rot, cs->theta), "rope q");
    tst_ok(be->rope(ctx, kc, pos, T, nkv, hd, rot, cs->theta), "rope k");

    /* the fused op */
    float *qf = NULL, *gf = cs->gated ? nan_f32(nqe) : NULL, *kf = tst_rand_f32(nke, 0, 1), *qgf = NULL;
    memcpy(kf, k, (size_t)nke * sizeof *k);
    if (cs->in_place) {
        qf = qgf = tst_rand_f32(nqg, 0, 1);
        memcpy(qf, qg, (size_t)nqg * sizeof *qg);
    } else {
        qf = nan_f32(nqe);
        qgf = qg;
    }
    tst_ok(be->qk_prep(ctx, qf, gf, kf, qgf, qn, kn, pos, T, nq, nkv, hd, rot, cs->theta, eps, cs->one_plus),
       "qk_prep");

    char name[160];
    snprintf(name, sizeof name,
             "T=%ld seqs=%d nq=%d nkv=%d hd=%d rot=%d gated=%d in_place=%d one_plus=%d pos+%d", T, cs->n_seq,
             nq, nkv, hd, rot, cs->gated, cs->in_place, cs->one_plus, cs->pos_base);
    int same = memcmp(qf, qc, (size_t)nqe * sizeof *qf) == 0 &&
               memcmp(kf, kc, (size_t)nke * sizeof *kf) == 0 &&
               (!cs->gated || memcmp(gf, gc, (size_t)nqe * sizeof *gf) == 0);
    TST_CHECK(same);

    /* independent checks on q and k rows */
    int gate_ok = 1, pass_ok = 1, norm_ok = 1;
    for (long r = 0; r < T * (nq + nkv); r++) {
        const int    isq = r < T * nq;
        const long   rr = isq ? r : r - T * nq;
        const float *x = isq ? qg + rr * qs : k + rr * hd;
        const float *y = isq ? qf + rr * hd : kf + rr * hd;
        const float *w = isq ? qn : kn;
        if (isq && cs->gated)
            gate_ok &= memcmp(gf + rr * hd, x + hd, (size_t)hd * sizeof *x) == 0;
        double ss = 0;
        for (int c = 0; c < hd; c++)
            ss += (double)x[c] * x[c];
        double rstd = 1 / sqrt(ss / hd + eps);
        for (int c = 0; c < hd; c++) {
            double n = (double)x[c] * rstd * (cs->one_plus ? 1 + (double)w[c] : (double)w[c]);
            if (c >= rot)
                pass_ok &= fabs(y[c] - n) <= 1e-6 * fabs(n) + 1e-30;
            if (c < half) {
                double n2 = (double)x[c + half] * rstd *
                            (cs->one_plus ? 1 + (double)w[c + half] : (double)w[c + half]);
                double a = n * n + n2 * n2, b = (double)y[c] * y[c] + (double)y[c + half] * y[c + half];
                norm_ok &= fabs(a - b) <= 1e-5 * a + 1e-30;
            }
        }
    }
    TST_CHECK(gate_ok && pass_ok && norm_ok);
    printf("qk_prep %-100s %s\n", name,
           same && gate_ok && pass_ok && norm_ok ? "ok (bit-identical)" : "FAIL");
    if (!same || !gate_ok || !pass_ok || !norm_ok)
        fprintf(stderr, "  same %d gate %d pass %d norm %d\n", same, gate_ok, pass_ok, norm_ok);
    free(pos);
    free(qg);
    free(k);
    free(qn);
    free(kn);
    free(qc);
    free(gc);
    free(kc);
    free(qf);
    free(gf);
    free(kf);
}

static void expect(cm_status got, cm_status want, const char *what) {
    if (got != want)
        fprintf(stderr, "  %s: got %s, want %s\n", what, cm_status_str(got), cm_status_str(want));
    TST_CHECK(got == want);
}

static void test_bad_args(void) {
    float   buf[4096];
    int32_t pos[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    memset(buf, 0, sizeof buf);
    float *w = buf + 3000;
    /* T=4, nq=2, nkv=1, hd=8: qg (gated) 128 floats, q 64, gate 64, k 32 */
    expect(be->qk_prep(ctx, buf + 200, buf + 300, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_OK, "separate buffers");
    expect(be->qk_prep(ctx, buf + 64, buf + 300, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "gated q overlaps qg");
    expect(be->qk_prep(ctx, buf, buf + 300, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "gated q == qg");
    expect(be->qk_prep(ctx, buf + 200, buf + 100, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "gate overlaps qg");
    expect(be->qk_prep(ctx, buf + 200, buf + 300, buf + 120, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "k overlaps qg");
    expect(be->qk_prep(ctx, buf, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1), CM_OK,
           "ungated in place");
    expect(be->qk_prep(ctx, buf + 8, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "ungated q shifted over qg");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 7, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "odd rot_dim");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 10, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "rot_dim > hd");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, pos, 4, 0, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "nq = 0");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 0.0f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "theta = 0");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, pos, 4, 2, 1, 8, 8, 1e4f, -1.0f, 1),
           CM_ERR_INVALID_ARG, "eps < 0");
    expect(be->qk_prep(ctx, buf + 200, NULL, buf + 400, buf, w, w, NULL, 4, 2, 1, 8, 8, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "pos NULL");
    expect(be->qk_prep(ctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 2, 1, 8, 8, 1e4f, 1e-6f, 1), CM_OK,
           "T = 0");
    printf("qk_prep bad arguments and T = 0 ok\n");
}

int main(void) {
    be = kn_backend_cpu();
    if (!be->qk_prep) {
        fprintf(stderr, "the cpu backend has no qk_prep\n");
        return 1;
    }
    if (!tst_ok(be->ctx_create(&ctx, NULL), "ctx_create"))
        return tst_report();
    static const qk_case cases[] = {
        {{5}, 1, 1, 1, 2, 2, 0, 1, 1, 1e4f, 0},
        {{3, 1, 7}, 3, 3, 1, 32, 8, 1, 0, 1, 1e7f, 0},
        {{1, 17, 4}, 3, 6, 2, 64, 64, 1, 0, 1, 1e7f, 0},
        {{9, 2}, 2, 6, 2, 64, 16, 0, 1, 0, 1e6f, 0},
        {{9, 2}, 2, 6, 2, 64, 16, 0, 0, 1, 1e6f, 0},
        {{5, 3}, 2, 3, 1, 256, 64, 1, 0, 1, 1e7f, 0},
        {{2, 6}, 2, 4, 4, 256, 256, 0, 1, 1, 1e7f, 0},
        {{4}, 1, 4, 2, 30, 10, 1, 0, 0, 1e4f, 0},
        {{3, 2, 2, 5}, 4, 6, 2, 32, 8, 1, 0, 1, 1e7f, 262000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
