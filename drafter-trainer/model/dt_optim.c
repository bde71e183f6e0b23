/* drafter-trainer/model/dt_optim.c — AdamW with global grad-norm clipping and the warmup + cosine
 * schedule (see dt_optim.h for the exact formulas). The moments live in two backend
 * allocations carved per parameter in parameter order. Where the backend has the
 * multi-tensor entries, a step is two launches over a table of every parameter (uploaded at
 * create): the squared norm summed on the device, then AdamW reading the clip factor from
 * it, and one download of the norm for the stats and the finiteness check (the update has
 * skipped itself when it is not finite). Otherwise the norm is the double sum of
 * per-parameter sums of squares in parameter order and AdamW runs per parameter. Either way
 * the reduction order is fixed, so a step is deterministic. With bf16 copies
 * (dt_optim_set_copies) the update is one launch per group, in group order, over tables
 * uploaded when the copies are set; the norm is still one launch over the whole table. */
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
    /* with bf16 copies (dt_optim_set_copies): the update's tables, one per group in order */
    kn_mt_tensor *gtab;     /* backend memory, [n_params]: the groups' tables one after another */
    int           n_groups; /* 0: no copies, the update goes over table */
    int          *g_first;  /* [n_groups + 1]: group k's entries are gtab[g_first[k] .. g_first[k + 1]) */
    int64_t      *g_chunks; /* [n_groups] */
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

/* Parameter i's entry of a multi-tensor table whose chunks so far number *chunks (advanced past
 * this tensor's), with bf16 copy w16 (NULL: none). */
static kn_mt_tensor mt_entry(const dt_optim *o, int i, int64_t *chunks, uint16_t *w16) {
    const dt_param    *q = o->params[i];
    const kn_mt_tensor t = {.param = q->data,
                            .grad = q->grad,
                            .m = o->m + o->offset[i],
                            .v = o->v + o->offset[i],
                            .n = q->numel,
                            .chunk0 = *chunks,
                            .w16 = w16};
    *chunks += (q->numel + KN_MT_CHUNK - 1) / KN_MT_CHUNK;
    return t;
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
        for (int i = 0; i < n_params; i++)
            host[i] = mt_entry(o, i, &o->n_chunks, NULL);
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
        x->be->free(x->ctx, x->gtab);
        x->be->free(x->ctx, x->sumsq);
        x->be->free(x->ctx, x->table);
        x->be->free(x->ctx, x->v);
        x->be->free(x->ctx, x->m);
    }
    free(x->g_first);
    free(x->g_chunks);
    free(x->offset);
    free(x->params);
    free(x);
    *o = NULL;
}

static int overlaps(const void *a, size_t an, const void *b, size_t bn) {
    const char *x = a, *y = b;
    return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

/* Where copy i (2·numel bytes at dst[i]) clashes with the memory of parameter j, or NULL. */
static const char *copy_clash(const dt_optim *o, uint16_t *const *dst, const int *group, int i, int j) {
    const dt_param *q = o->params[j];
    const size_t cn = (size_t)o->params[i]->numel * sizeof(uint16_t), fn = (size_t)q->numel * sizeof(float);
    if (overlaps(dst[i], cn, q->data, fn))
        return "the parameter's values";
    if (overlaps(dst[i], cn, o->m + o->offset[j], fn) || overlaps(dst[i], cn, o->v + o->offset[j], fn))
        return "its Adam moments";
    if (j != i && dst[j] && overlaps(dst[i], cn, dst[j], (size_t)q->numel * sizeof(uint16_t)))
        return "its bf16 copy";
    if (overlaps(dst[i], cn, q->grad, fn) && group[j] >= group[i])
        return "its gradient, which is read in the same group or a later one";
    return NULL;
}

cm_status dt_optim_set_copies(dt_optim *o, uint16_t *const *dst, const int *group) {
    if (!o->table)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "bf16 copies need the %s backend's multi-tensor optimizer entries",
                       o->be->name);
    int max_g = -1;
    for (int i = 0; i < o->n_params; i++) {
        if (group[i] < 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "parameter %s has launch group %d; groups are >= 0",
                           o->params[i]->name, group[i]);
        max_g = group[i] > max_g ? group[i] : max_g;
        for (int j = 0; dst[i] && j < o->n_params; j++) {
            const char *why = copy_clash(o, dst, group, i, j);
            if (why)
                return CM_FAIL(CM_ERR_INVALID_ARG,
                               "the bf16 copy of %s (group %d) overlaps %s of %s (group %d)",
                               o->params[i]->name, group[i], why, o->params[j]->name, group[j]);
        }
    }
    const size_t  n_g = (size_t)(max_g < 0 ? 0 : max_g) + 1; /* group values 0 .. max_g */
    const size_t  n_p = (size_t)(o->n_params > 0 ? o->n_params : 1);
    cm_status     st = CM_OK;
    kn_mt_tensor *host = calloc(n_p, sizeof *host);
    int          *first = calloc(n_g + 1, sizeof *first);
    int64_t      *chunks = calloc(n_g, sizeof *chunks);
    int           n = 0, k = 0;
    if (!host || !first || !chunks) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the optimizer's group tables");
        goto done;
    }
    /* the groups that have members, in order; their members in parameter order */
    for (int g = 0; g <= max_g; g++) {
        first[k] = n;
        chunks[k] = 0;
        for (int i = 0; i < o->n_params; i++) {
            if (group[i] != g)
                continue;
            host[n++] = mt_entry(o, i, &chunks[k], dst[i]);
        }
        k += n > first[k];
    }
    first[k] = n;
    if (!o->gtab)
        CM_TRY_GOTO(o->be->alloc(o->ctx, (void **)&o->gtab, n_p * sizeof *host), st, done);
    CM_TRY_GOTO(o->be->upload(o->ctx, o->gtab, host, n_p * sizeof *host), st, done);
    free(o->g_first);
    free(o->g_chunks);
    o->g_first = first;
    o->g_chunks = chunks;
    o->n_groups = k;
    first = NULL;
    chunks = NULL;
done:
    free(host);
    free(first);
    free(chunks);
    return st;
}

cm_status dt_optim_copies_of_model(dt_optim *o, const dt_model *m) {
    if (!o->table) /* the per-tensor update writes no copies: the forward makes them as before */
        return CM_OK;
    const int n = dt_model_n_params(m);
    if (n != o->n_params)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the optimizer has %d parameters, the model %d", o->n_params, n);
    for (int i = 0; i < n; i++)
        if (o->params[i] != dt_model_param(m, i))
            return CM_FAIL(CM_ERR_INVALID_ARG, "optimizer parameter %d is not the model's %s", i,
                           dt_model_param(m, i)->name);
    uint16_t **dst = calloc((size_t)n, sizeof *dst);
    int       *group = calloc((size_t)n, sizeof *group);
    cm_status  st = CM_OK;
    if (!dst || !group)
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the weight-copy table");
    else if (dt_model_w16_targets(m, dst, group) > 0)
        st = dt_optim_set_copies(o, dst, group);
    free(dst);
    free(group);
    return st;
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
        if (o->n_groups == 0)
            CM_TRY(o->be->adamw_multi(o->ctx, o->table, o->n_params, o->n_chunks, &p, o->sumsq, o->cfg.clip));
        for (int k = 0; k < o->n_groups; k++) /* in order: a group's copies overwrite earlier groups' grads */
            CM_TRY(o->be->adamw_multi(o->ctx, o->gtab + o->g_first[k], o->g_first[k + 1] - o->g_first[k],
                                      o->g_chunks[k], &p, o->sumsq, o->cfg.clip));
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
        stats->copies = o->n_groups > 0;
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
