/* drafter-trainer/model/dt_optim.c — AdamW with global grad-norm clipping and the warmup + cosine
 * schedule (see dt_optim.h for the exact formulas). The moments live in two backend
 * allocations carved per parameter in parameter order. Where the backend has the
 * multi-tensor entries, a step is two launches over a table of every parameter (uploaded at
 * create): the squared norm summed on the device, then AdamW reading the clip factor from
 * it, and one download of the norm for the stats and the finiteness check (the update has
 * skipped itself when it is not finite). Otherwise the norm is the double sum of
 * per-parameter sums of squares in parameter order and AdamW runs per parameter. Either way
 * the reduction order is fixed, so a step is deterministic. */
#include "dt_optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct dt_optim {
    const kn_backend *be;
    kn_ctx           *ctx;
    dt_optim_config   cfg;
    int               n_params;
    const dt_param  **params; /* [n_params], borrowed */
    int64_t          *offset; /* [n_params], element offset of each parameter's moments */
    float            *m, *v;  /* backend memory, Σ numel floats each */
    int64_t           t;      /* steps taken */
    /* the multi-tensor path (NULL without the backend's sumsq_multi and adamw_multi) */
    kn_mt_tensor *table;    /* backend memory, [n_params] */
    double       *sumsq;    /* backend memory, 1: the last squared norm */
    int64_t       n_chunks; /* of KN_MT_CHUNK elements, over the table */
};

int64_t dt_optim_warmup_steps(int64_t total_steps, double warmup_ratio) {
    return (int64_t)floor(warmup_ratio * (double)total_steps);
}

double dt_optim_lr(const dt_optim_config *cfg, int64_t t) {
    const int64_t N = cfg->total_steps, W = cfg->warmup_steps;
    if (t < 0 || t >= N)
        return 0.0;
    if (t < W)
        return cfg->lr * (double)(t + 1) / (double)W;
    return cfg->lr * 0.5 * (1.0 + cos(M_PI * (double)(t - W) / (double)(N - W)));
}

double dt_optim_clip_scale(double norm, double clip) {
    if (!(clip > 0))
        return 1.0;
    double s = clip / (norm + 1e-6);
    return s < 1.0 ? s : 1.0;
}

static cm_status check_cfg(const dt_optim_config *c) {
    if (!(c->lr >= 0 && isfinite(c->lr)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "learning rate %g must be finite and >= 0", c->lr);
    if (!(c->beta1 >= 0 && c->beta1 < 1 && c->beta2 >= 0 && c->beta2 < 1))
        return CM_FAIL(CM_ERR_INVALID_ARG, "adam betas (%g, %g) must be in [0, 1)", c->beta1, c->beta2);
    if (!(c->eps >= 0 && isfinite(c->eps)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "adam eps %g must be finite and >= 0", c->eps);
    if (!(c->weight_decay >= 0 && isfinite(c->weight_decay)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "weight decay %g must be finite and >= 0", c->weight_decay);
    if (!isfinite(c->clip))
        return CM_FAIL(CM_ERR_INVALID_ARG, "grad-norm clip %g must be finite", c->clip);
    if (c->total_steps < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "schedule has %lld steps; need at least 1",
                       (long long)c->total_steps);
    if (c->warmup_steps < 0 || c->warmup_steps > c->total_steps)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "warmup of %lld steps must be within the %lld steps of the schedule",
                       (long long)c->warmup_steps, (long long)c->total_steps);
    return CM_OK;
}

cm_status dt_optim_create(dt_optim **out, const kn_backend *be, kn_ctx *ctx, const dt_param *const *params,
                          int n_params, const dt_optim_config *cfg) {
    *out = NULL;
    CM_TRY(check_cfg(cfg));
    if (!be->sumsq || !be->adamw)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend has no %s kernel yet; use --device cpu", be->name,
                       be->sumsq ? "adamw" : "sumsq");
    if (n_params < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "optimizer needs at least one parameter");
    cm_status st = CM_OK;
    dt_optim *o = calloc(1, sizeof *o);
    if (!o)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the optimizer");
    o->be = be;
    o->ctx = ctx;
    o->cfg = *cfg;
    o->n_params = n_params;
    o->params = calloc((size_t)n_params, sizeof *o->params);
    o->offset = calloc((size_t)n_params, sizeof *o->offset);
    if (!o->params || !o->offset) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the optimizer's parameter table");
        goto fail;
    }
    int64_t total = 0;
    for (int i = 0; i < n_params; i++) {
        o->params[i] = params[i];
        o->offset[i] = total;
        total += params[i]->numel;
    }
    CM_TRY_GOTO(be->alloc(ctx, (void **)&o->m, (size_t)total * sizeof(float)), st, fail);
    CM_TRY_GOTO(be->alloc(ctx, (void **)&o->v, (size_t)total * sizeof(float)), st, fail);
    if (be->sumsq_multi && be->adamw_multi) {
        kn_mt_tensor *host = calloc((size_t)n_params, sizeof *host);
        if (!host) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the optimizer's tensor table");
            goto fail;
        }
        for (int i = 0; i < n_params; i++) {
            host[i] = (kn_mt_tensor){params[i]->data,     params[i]->grad,  o->m + o->offset[i],
                                     o->v + o->offset[i], params[i]->numel, o->n_chunks};
            o->n_chunks += (params[i]->numel + KN_MT_CHUNK - 1) / KN_MT_CHUNK;
        }
        st = be->alloc(ctx, (void **)&o->table, (size_t)n_params * sizeof *host);
        if (st == CM_OK)
            st = be->upload(ctx, o->table, host, (size_t)n_params * sizeof *host);
        free(host);
        if (st != CM_OK)
            goto fail;
        CM_TRY_GOTO(be->alloc(ctx, (void **)&o->sumsq, sizeof(double)), st, fail);
    }
    *out = o;
    return CM_OK;
fail:
    dt_optim_destroy(&o);
    return st;
}

void dt_optim_destroy(dt_optim **o) {
    if (!o || !*o)
        return;
    dt_optim *x = *o;
    if (x->be) {
        x->be->free(x->ctx, x->sumsq);
        x->be->free(x->ctx, x->table);
        x->be->free(x->ctx, x->v);
        x->be->free(x->ctx, x->m);
    }
    free(x->offset);
    free(x->params);
    free(x);
    *o = NULL;
}

cm_status dt_optim_grad_norm(dt_optim *o, double *norm) {
    double total = 0;
    if (o->table) {
        CM_TRY(o->be->sumsq_multi(o->ctx, o->sumsq, o->table, o->n_params, o->n_chunks));
        CM_TRY(o->be->download(o->ctx, &total, o->sumsq, sizeof total));
        *norm = sqrt(total);
        return CM_OK;
    }
    for (int i = 0; i < o->n_params; i++) {
        double s = 0;
        CM_TRY(o->be->sumsq(o->ctx, &s, o->params[i]->grad, o->params[i]->numel));
        total += s;
    }
    *norm = sqrt(total);
    return CM_OK;
}

static cm_status not_finite(const dt_optim *o) {
    return CM_FAIL(CM_ERR_INVALID_ARG,
                   "gradient norm is not finite at step %lld; the parameters were left unchanged "
                   "(lower --lr or check the data)",
                   (long long)(o->t + 1));
}

cm_status dt_optim_step(dt_optim *o, dt_optim_stats *stats) {
    const double    lr = dt_optim_lr(&o->cfg, o->t);
    kn_adamw_params p = {
        .lr = (float)lr,
        .beta1 = (float)o->cfg.beta1,
        .beta2 = (float)o->cfg.beta2,
        .eps = (float)o->cfg.eps,
        .weight_decay = (float)o->cfg.weight_decay,
        .grad_scale = 1.0f,
        .step = o->t + 1,
    };
    double norm = 0;
    if (o->table) { /* the norm, the clip factor and the update without leaving the device */
        double sumsq = 0;
        CM_TRY(o->be->sumsq_multi(o->ctx, o->sumsq, o->table, o->n_params, o->n_chunks));
        CM_TRY(o->be->adamw_multi(o->ctx, o->table, o->n_params, o->n_chunks, &p, o->sumsq, o->cfg.clip));
        CM_TRY(o->be->download(o->ctx, &sumsq, o->sumsq, sizeof sumsq));
        norm = sqrt(sumsq);
        if (!isfinite(norm))
            return not_finite(o); /* the update skipped itself */
    } else {
        CM_TRY(dt_optim_grad_norm(o, &norm));
        if (!isfinite(norm))
            return not_finite(o);
        p.grad_scale = (float)dt_optim_clip_scale(norm, o->cfg.clip);
        for (int i = 0; i < o->n_params; i++) {
            const dt_param *q = o->params[i];
            CM_TRY(o->be->adamw(o->ctx, q->data, q->grad, o->m + o->offset[i], o->v + o->offset[i], q->numel,
                                &p));
        }
    }
    const double scale = dt_optim_clip_scale(norm, o->cfg.clip);
    o->t++;
    if (stats) {
        stats->step = o->t;
        stats->lr = lr;
        stats->grad_norm = norm;
        stats->grad_scale = scale;
    }
    return CM_OK;
}

const dt_optim_config *dt_optim_cfg(const dt_optim *o) {
    return &o->cfg;
}
int64_t dt_optim_steps_done(const dt_optim *o) {
    return o->t;
}
void dt_optim_set_steps_done(dt_optim *o, int64_t t) {
    o->t = t;
}
int dt_optim_n_params(const dt_optim *o) {
    return o->n_params;
}
const dt_param *dt_optim_param(const dt_optim *o, int i) {
    return o->params[i];
}
float *dt_optim_m(const dt_optim *o, int i) {
    return o->m + o->offset[i];
}
float *dt_optim_v(const dt_optim *o, int i) {
    return o->v + o->offset[i];
}
