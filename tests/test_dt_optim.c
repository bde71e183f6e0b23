/* tests/test_dt_optim.c — the drafter optimizer: the warmup + cosine schedule at chosen steps
 * against its closed form and against PyTorch's chainable CosineAnnealingLR recursion as
 * SpecForge's CosineAnnealingWarmupLR drives it; the warmup step count; the clip factor; and
 * AdamW steps through the cpu table against hand math in double (clipped and unclipped,
 * bias correction at steps 1 and 2, weight decay), plus a non-finite gradient and bad configs;
 * the multi-tensor step (sumsq_multi + adamw_multi over the table) against the per-tensor one
 * on the cpu table, bit for bit, with tensors that span several chunks; and the bf16 copies the
 * update can write into earlier groups' gradients (dt_optim_set_copies). */
#include <math.h>
#include <string.h>

#include "cm_rng.h"
#include "dt_optim.h"
#include "tst.h"

static void test_schedule(void) {
    TST_CHECK(dt_optim_warmup_steps(100, 0.04) == 4);
    TST_CHECK(dt_optim_warmup_steps(1000, 0.04) == 40);
    TST_CHECK(dt_optim_warmup_steps(75, 0.04) == 3); /* int(3.0) */
    TST_CHECK(dt_optim_warmup_steps(10, 0.04) == 0);
    TST_CHECK(dt_optim_warmup_steps(24, 0.0) == 0);

    dt_optim_config c = DT_OPTIM_CONFIG_DEFAULT;
    c.lr = 6e-4;
    c.total_steps = 100;
    c.warmup_steps = 4;
    TST_CHECK(dt_optim_lr(&c, 0) == 6e-4 * 1 / 4);
    TST_CHECK(dt_optim_lr(&c, 2) == 6e-4 * 3 / 4);
    TST_CHECK(dt_optim_lr(&c, 3) == 6e-4);
    TST_CHECK(dt_optim_lr(&c, 4) == 6e-4);
    TST_CHECK(fabs(dt_optim_lr(&c, 52) - 3e-4) < 1e-18); /* half way through the cosine */
    TST_CHECK(fabs(dt_optim_lr(&c, 99) - 6e-4 * 0.5 * (1 + cos(M_PI * 95 / 96))) < 1e-18);
    TST_CHECK(dt_optim_lr(&c, 100) == 0 && dt_optim_lr(&c, 1000) == 0 && dt_optim_lr(&c, -1) == 0);
    int monotone = 1;
    for (int64_t t = 4; t < 100; t++)
        monotone &= dt_optim_lr(&c, t + 1) <= dt_optim_lr(&c, t);
    TST_CHECK(monotone);

    /* PyTorch: the warmup scheduler sets base·(t+1)/W; at t = W the cosine scheduler (its
     * last_epoch 0) returns the current lr; afterwards its chainable form
     * lr_k = (1 + cos(πk/T)) / (1 + cos(π(k−1)/T)) · lr_{k−1} with T = N − W, eta_min 0. */
    int64_t Ns[] = {100, 37, 1000, 9}, Ws[] = {4, 1, 40, 0};
    for (int c_i = 0; c_i < 4; c_i++) {
        c.total_steps = Ns[c_i];
        c.warmup_steps = Ws[c_i];
        const int64_t N = Ns[c_i], W = Ws[c_i], T = N - W;
        double        prev = c.lr, worst = 0;
        for (int64_t t = 0; t < N; t++) {
            double ref;
            if (t < W)
                ref = c.lr * (double)(t + 1) / (double)W;
            else if (t == W)
                ref = W > 0 ? prev : c.lr;
            else {
                int64_t k = t - W;
                ref = (1 + cos(M_PI * k / T)) / (1 + cos(M_PI * (k - 1) / T)) * prev;
            }
            prev = ref;
            double d = fabs(dt_optim_lr(&c, t) - ref);
            if (d > worst)
                worst = d;
        }
        TST_CHECK(worst < 1e-15 * c.lr);
    }

    TST_CHECK(dt_optim_clip_scale(0.5, 1.0) == 1.0);
    TST_CHECK(dt_optim_clip_scale(3.0, 1.0) == 1.0 / (3.0 + 1e-6));
    TST_CHECK(dt_optim_clip_scale(1.0, 1.0) < 1.0); /* the 1e-6 makes norm = clip scale just below 1 */
    TST_CHECK(dt_optim_clip_scale(1e9, 0.0) == 1.0);
}

// ---- AdamW through the cpu table

enum { NP = 2 };
static const int64_t numel[NP] = {15, 7};

typedef struct ref_state {
    double p[NP][15], m[NP][15], v[NP][15];
} ref_state;

static void set_grads(const kn_backend *be, kn_ctx *ctx, dt_param *ps, cm_rng *r, double mag,
                      float g[NP][15]) {
    for (int i = 0; i < NP; i++) {
        for (int64_t j = 0; j < numel[i]; j++)
            g[i][j] = (float)(mag * cm_rng_normal(r));
        be->upload(ctx, ps[i].grad, g[i], (size_t)numel[i] * sizeof(float));
    }
}

/* One AdamW step by hand: norm, clip, decoupled decay, moments, bias correction. */
static void ref_step(ref_state *s, float g[NP][15], const dt_optim_config *c, int64_t t) {
    double ss = 0;
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < numel[i]; j++)
            ss += (double)g[i][j] * g[i][j];
    double norm = sqrt(ss), scale = norm > 0 && c->clip / (norm + 1e-6) < 1 ? c->clip / (norm + 1e-6) : 1;
    double lr =
        t < c->warmup_steps ? c->lr * (t + 1) / c->warmup_steps : c->lr; /* tests stay short of cosine */
    lr = (double)(float)lr;
    double b1 = (float)c->beta1, b2 = (float)c->beta2, eps = (float)c->eps, wd = (float)c->weight_decay;
    double gs = (float)scale;
    double bc1 = 1 - pow(b1, (double)(t + 1)), bc2 = 1 - pow(b2, (double)(t + 1));
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < numel[i]; j++) {
            double gg = g[i][j] * gs;
            s->p[i][j] = s->p[i][j] * (1 - lr * wd);
            s->m[i][j] = b1 * s->m[i][j] + (1 - b1) * gg;
            s->v[i][j] = b2 * s->v[i][j] + (1 - b2) * gg * gg;
            s->p[i][j] -= lr * (s->m[i][j] / bc1) / (sqrt(s->v[i][j] / bc2) + eps);
        }
}

static void compare(const kn_backend *be, kn_ctx *ctx, dt_optim *o, dt_param *ps, const ref_state *s) {
    for (int i = 0; i < NP; i++) {
        float got[15], ref[15];
        be->download(ctx, got, ps[i].data, (size_t)numel[i] * sizeof(float));
        for (int64_t j = 0; j < numel[i]; j++)
            ref[j] = (float)s->p[i][j];
        TST_CLOSE("param", got, ref, numel[i], 1e-7, 1e-6);
        be->download(ctx, got, dt_optim_m(o, i), (size_t)numel[i] * sizeof(float));
        for (int64_t j = 0; j < numel[i]; j++)
            ref[j] = (float)s->m[i][j];
        TST_CLOSE("m", got, ref, numel[i], 1e-9, 1e-6);
        be->download(ctx, got, dt_optim_v(o, i), (size_t)numel[i] * sizeof(float));
        for (int64_t j = 0; j < numel[i]; j++)
            ref[j] = (float)s->v[i][j];
        TST_CLOSE("v", got, ref, numel[i], 1e-12, 1e-6);
    }
}

static void test_adamw(void) {
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    kn_ctx_config     kc = KN_CTX_CONFIG_DEFAULT;
    TST_CHECK(be->ctx_create(&ctx, &kc) == CM_OK);
    if (!ctx)
        return;

    dt_param ps[NP] = {{"a.weight", 2, {3, 5}, 15, NULL, NULL}, {"b.weight", 1, {7, 0}, 7, NULL, NULL}};
    const dt_param *pp[NP] = {&ps[0], &ps[1]};
    ref_state       s;
    memset(&s, 0, sizeof s);
    cm_rng r;
    cm_rng_seed(&r, 5);
    for (int i = 0; i < NP; i++) {
        be->alloc(ctx, (void **)&ps[i].data, (size_t)numel[i] * sizeof(float));
        be->alloc(ctx, (void **)&ps[i].grad, (size_t)numel[i] * sizeof(float));
        float init[15];
        for (int64_t j = 0; j < numel[i]; j++)
            s.p[i][j] = init[j] = (float)(0.1 * cm_rng_normal(&r));
        be->upload(ctx, ps[i].data, init, (size_t)numel[i] * sizeof(float));
    }

    dt_optim_config c = DT_OPTIM_CONFIG_DEFAULT;
    c.lr = 1e-2;
    c.weight_decay = 0.1;
    c.total_steps = 100;
    c.warmup_steps = 10;
    dt_optim *o = NULL;
    TST_CHECK(dt_optim_create(&o, be, ctx, pp, NP, &c) == CM_OK);
    if (o) {
        float          g[NP][15];
        dt_optim_stats st;
        /* step 1: large gradients, clipped */
        set_grads(be, ctx, ps, &r, 2.0, g);
        double norm = 0;
        TST_CHECK(dt_optim_grad_norm(o, &norm) == CM_OK && norm > 1.0);
        TST_CHECK(dt_optim_step(o, &st) == CM_OK);
        TST_CHECK(st.step == 1 && st.lr == 1e-3 && st.grad_norm == norm && st.grad_scale < 1.0);
        TST_CHECK(fabs(st.grad_scale - 1.0 / (norm + 1e-6)) < 1e-15);
        ref_step(&s, g, &c, 0);
        compare(be, ctx, o, ps, &s);
        /* step 2: small gradients, unclipped, second bias correction */
        set_grads(be, ctx, ps, &r, 0.01, g);
        TST_CHECK(dt_optim_step(o, &st) == CM_OK);
        TST_CHECK(st.step == 2 && st.grad_scale == 1.0 && fabs(st.lr - 2e-3) < 1e-18);
        ref_step(&s, g, &c, 1);
        compare(be, ctx, o, ps, &s);
        TST_CHECK(dt_optim_steps_done(o) == 2);

        /* a non-finite gradient changes nothing */
        g[1][3] = NAN;
        be->upload(ctx, ps[1].grad, g[1], (size_t)numel[1] * sizeof(float));
        TST_CHECK(dt_optim_step(o, &st) == CM_ERR_INVALID_ARG);
        TST_CHECK(strstr(cm_last_error(), "not finite at step 3") != NULL);
        TST_CHECK(dt_optim_steps_done(o) == 2);
        compare(be, ctx, o, ps, &s);
    }
    dt_optim_destroy(&o);
    dt_optim_destroy(&o); /* NULL-safe */

    /* bad configurations */
    dt_optim_config bad = c;
    bad.lr = -1;
    TST_CHECK(dt_optim_create(&o, be, ctx, pp, NP, &bad) == CM_ERR_INVALID_ARG && !o);
    bad = c;
    bad.beta2 = 1.0;
    TST_CHECK(dt_optim_create(&o, be, ctx, pp, NP, &bad) == CM_ERR_INVALID_ARG);
    bad = c;
    bad.warmup_steps = 101;
    TST_CHECK(dt_optim_create(&o, be, ctx, pp, NP, &bad) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "warmup") != NULL);
    bad = c;
    bad.total_steps = 0;
    TST_CHECK(dt_optim_create(&o, be, ctx, pp, NP, &bad) == CM_ERR_INVALID_ARG);

    for (int i = 0; i < NP; i++) {
        be->free(ctx, ps[i].data);
        be->free(ctx, ps[i].grad);
    }
    be->ctx_destroy(&ctx);
}

/* The same steps through the table with and without the multi-tensor entries: every
 * parameter, moment and stat bit-identical, the non-finite step too. */
static void test_multi(void) {
    enum { NT = 4 };
    static const int64_t sizes[NT] = {KN_MT_CHUNK + 17, 3, 2 * KN_MT_CHUNK, 1};
    const kn_backend    *multi = kn_backend_cpu();
    kn_backend           per = *multi;
    per.sumsq_multi = NULL;
    per.adamw_multi = NULL;
    const kn_backend *bes[2] = {multi, &per};
    kn_ctx           *ctx = NULL;
    TST_CHECK(multi->ctx_create(&ctx, NULL) == CM_OK);
    float         *out[2][NT][3];
    dt_optim_stats sts[2][3];
    cm_status      rc[2][3];
    for (int k = 0; k < 2; k++) {
        const kn_backend *be = bes[k];
        dt_param          ps[NT];
        const dt_param   *pp[NT];
        cm_rng            r;
        cm_rng_seed(&r, 11);
        for (int i = 0; i < NT; i++) {
            ps[i] = (dt_param){"t", 1, {sizes[i], 0}, sizes[i], NULL, NULL};
            pp[i] = &ps[i];
            be->alloc(ctx, (void **)&ps[i].data, (size_t)sizes[i] * sizeof(float));
            be->alloc(ctx, (void **)&ps[i].grad, (size_t)sizes[i] * sizeof(float));
            for (int64_t j = 0; j < sizes[i]; j++)
                ps[i].data[j] = (float)(0.1 * cm_rng_normal(&r));
        }
        dt_optim_config c = DT_OPTIM_CONFIG_DEFAULT;
        c.lr = 1e-2;
        c.weight_decay = 0.01;
        c.total_steps = 10;
        c.warmup_steps = 2;
        dt_optim *o = NULL;
        TST_CHECK(dt_optim_create(&o, be, ctx, pp, NT, &c) == CM_OK);
        for (int s = 0; o && s < 3; s++) {
            for (int i = 0; i < NT; i++)
                for (int64_t j = 0; j < sizes[i]; j++)
                    ps[i].grad[j] = (float)((s == 0 ? 0.05 : 1e-4) * cm_rng_normal(&r));
            if (s == 2)
                ps[2].grad[KN_MT_CHUNK + 5] = INFINITY;
            memset(&sts[k][s], 0, sizeof sts[k][s]);
            rc[k][s] = dt_optim_step(o, &sts[k][s]);
        }
        for (int i = 0; i < NT; i++) {
            out[k][i][0] = ps[i].data;
            out[k][i][1] = malloc((size_t)sizes[i] * 2 * sizeof(float));
            memcpy(out[k][i][1], o ? dt_optim_m(o, i) : ps[i].data, (size_t)sizes[i] * sizeof(float));
            memcpy(out[k][i][1] + sizes[i], o ? dt_optim_v(o, i) : ps[i].data,
                   (size_t)sizes[i] * sizeof(float));
            out[k][i][2] = ps[i].grad;
        }
        dt_optim_destroy(&o);
    }
    int same = 1;
    for (int i = 0; i < NT; i++)
        same = same && memcmp(out[0][i][0], out[1][i][0], (size_t)sizes[i] * sizeof(float)) == 0 &&
               memcmp(out[0][i][1], out[1][i][1], (size_t)sizes[i] * 2 * sizeof(float)) == 0;
    TST_CHECK(same);
    TST_CHECK(memcmp(sts[0], sts[1], sizeof sts[0]) == 0);
    TST_CHECK(rc[0][0] == CM_OK && rc[0][1] == CM_OK && rc[0][2] == CM_ERR_INVALID_ARG &&
              rc[1][2] == CM_ERR_INVALID_ARG);
    TST_CHECK(sts[0][0].grad_scale < 1.0 && sts[0][1].grad_scale == 1.0 && sts[0][1].step == 2);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < NT; i++) {
            multi->free(ctx, out[k][i][0]);
            multi->free(ctx, out[k][i][2]);
            free(out[k][i][1]);
        }
    multi->ctx_destroy(&ctx);
    printf("multi-tensor step: %s the per-tensor one over 3 steps (clipped, unclipped, non-finite)\n",
           same ? "bit-identical to" : "DIFFERS from");
}

/* bf16 copies written by the update (dt_optim_set_copies) on the cpu table: P1's copy lies in P0's
 * gradient and P2's in P1's, as the drafter's weight copies do. Over a clipped, an unclipped and a
 * non-finite step: parameters, moments and stats bit-identical to the same steps without copies,
 * each copy the RNE rounding of its parameter after a step (stats.copies set), untouched by the
 * non-finite one; memory clashes and bad groups refused with their names. */
static void test_copies(void) {
    enum { NT = 4 };
    static const int64_t sizes[NT] = {KN_MT_CHUNK + 4464, 20000, 30000, 5};
    static const int     group[NT] = {0, 1, 2, 0};
    const kn_backend    *be = kn_backend_cpu();
    kn_ctx              *ctx = NULL;
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    dt_param        ps[2][NT];
    const dt_param *pp[2][NT];
    dt_optim       *o[2] = {NULL, NULL};
    cm_rng          r[2];
    dt_optim_config c = DT_OPTIM_CONFIG_DEFAULT;
    c.lr = 1e-2;
    c.weight_decay = 0.01;
    c.total_steps = 10;
    for (int k = 0; k < 2; k++) { /* k = 0 with copies, 1 without */
        cm_rng_seed(&r[k], 5);
        for (int i = 0; i < NT; i++) {
            ps[k][i] = (dt_param){"p", 1, {sizes[i], 0}, sizes[i], NULL, NULL};
            pp[k][i] = &ps[k][i];
            be->alloc(ctx, (void **)&ps[k][i].data, (size_t)sizes[i] * sizeof(float));
            be->alloc(ctx, (void **)&ps[k][i].grad, (size_t)sizes[i] * sizeof(float));
            for (int64_t j = 0; j < sizes[i]; j++)
                ps[k][i].data[j] = (float)(0.1 * cm_rng_normal(&r[k]));
        }
        TST_CHECK(dt_optim_create(&o[k], be, ctx, pp[k], NT, &c) == CM_OK);
    }
    ps[0][0].name = "p0", ps[0][1].name = "p1", ps[0][2].name = "p2";
    uint16_t *dst[NT] = {NULL, (uint16_t *)(ps[0][0].grad + 100), (uint16_t *)ps[0][1].grad, NULL};
    /* refused: a copy over a gradient of its own group or a later one, over values, over another
     * copy, and a negative group */
    uint16_t *bad[NT] = {NULL, (uint16_t *)ps[0][2].grad, NULL, NULL};
    TST_CHECK(dt_optim_set_copies(o[0], bad, group) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "p1") && strstr(cm_last_error(), "gradient"));
    bad[1] = (uint16_t *)ps[0][1].grad;
    TST_CHECK(dt_optim_set_copies(o[0], bad, group) == CM_ERR_INVALID_ARG);
    bad[1] = (uint16_t *)(ps[0][0].data + 7);
    TST_CHECK(dt_optim_set_copies(o[0], bad, group) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "values") != NULL);
    bad[1] = dst[1];
    bad[2] = dst[1] + 1000;
    TST_CHECK(dt_optim_set_copies(o[0], bad, group) == CM_ERR_INVALID_ARG);
    const int neg[NT] = {0, 1, -1, 0};
    TST_CHECK(dt_optim_set_copies(o[0], dst, neg) == CM_ERR_INVALID_ARG);
    kn_backend per = *be;
    per.sumsq_multi = NULL;
    per.adamw_multi = NULL;
    dt_optim *op = NULL;
    TST_CHECK(dt_optim_create(&op, &per, ctx, pp[1], NT, &c) == CM_OK);
    TST_CHECK(op && dt_optim_set_copies(op, dst, group) == CM_ERR_UNSUPPORTED);
    dt_optim_destroy(&op);
    TST_CHECK(dt_optim_set_copies(o[0], dst, group) == CM_OK);

    long           wrong = 0;
    int            same = 1;
    dt_optim_stats st[2];
    cm_status      rc[2][3];
    uint16_t      *keep = malloc((size_t)sizes[2] * sizeof *keep);
    for (int s = 0; o[0] && o[1] && s < 3; s++) {
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < NT; i++)
                for (int64_t j = 0; j < sizes[i]; j++)
                    ps[k][i].grad[j] = (float)((s == 0 ? 0.05 : 1e-4) * cm_rng_normal(&r[k]));
            if (s == 2) {
                ps[k][1].grad[77] = INFINITY;
                memcpy(keep, dst[2], (size_t)sizes[2] * sizeof *keep); /* the copy before */
            }
            memset(&st[k], 0, sizeof st[k]);
            rc[k][s] = dt_optim_step(o[k], &st[k]);
        }
        for (int i = 0; i < NT; i++)
            same = same && memcmp(ps[0][i].data, ps[1][i].data, (size_t)sizes[i] * sizeof(float)) == 0 &&
                   memcmp(dt_optim_m(o[0], i), dt_optim_m(o[1], i), (size_t)sizes[i] * sizeof(float)) == 0 &&
                   memcmp(dt_optim_v(o[0], i), dt_optim_v(o[1], i), (size_t)sizes[i] * sizeof(float)) == 0;
        same = same && st[0].grad_norm == st[1].grad_norm && st[0].grad_scale == st[1].grad_scale;
        if (s < 2) {
            TST_CHECK(rc[0][s] == CM_OK && st[0].copies == 1 && st[1].copies == 0);
            for (int i = 1; i < 3; i++)
                for (int64_t j = 0; j < sizes[i]; j++)
                    wrong += dst[i][j] != cm_f32_to_bf16(ps[0][i].data[j]);
        } else {
            TST_CHECK(rc[0][2] == CM_ERR_INVALID_ARG && rc[1][2] == CM_ERR_INVALID_ARG);
            TST_CHECK(memcmp(keep, dst[2], (size_t)sizes[2] * sizeof *keep) == 0);
        }
    }
    TST_CHECK(same && wrong == 0);
    printf("bf16 copies in earlier groups' gradients: update %s the one without copies over 3 steps; %ld "
           "copy values differ from the rounded parameters\n",
           same ? "bit-identical to" : "DIFFERS from", wrong);
    free(keep);
    for (int k = 0; k < 2; k++) {
        dt_optim_destroy(&o[k]);
        for (int i = 0; i < NT; i++) {
            be->free(ctx, ps[k][i].data);
            be->free(ctx, ps[k][i].grad);
        }
    }
    be->ctx_destroy(&ctx);
}

int main(void) {
    test_schedule();
    test_adamw();
    test_multi();
    test_copies();
    return tst_report();
}
