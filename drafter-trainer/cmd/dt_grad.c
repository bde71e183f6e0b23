/* drafter-trainer/cmd/dt_grad.c — `drafter-trainer grad` (docs/checks.md): the loss and every
 * parameter gradient of one packed batch, for checking the drafter step against an outside
 * oracle.
 *   drafter-trainer grad --drafter DIR --batch IN.safetensors --out OUT.safetensors
 *                        [--device cpu|cuda] [--gpu N] [--target DIR]
 *                        [--loss-decay-gamma G] [--log-level L]
 * OUT holds loss and tau (F32 [1]), acc_hits and acc_count (I32 [block_size]), accepted
 * (I32 [n_anchors]), tau_chain, chain_tokens and chain_steps when the anchors hold the chain a
 * decoder walks (dt_tau_chain.h) and grad.<name> (F32, the parameter's shape) for every
 * parameter, written atomically. Bad input ends with one message and exit status 1; usage
 * errors exit 2. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_args.h"
#include "cm_cfg.h"
#include "cm_log.h"
#include "cm_safetensors.h"
#include "dt_cmd.h"
#include "dt_model.h"
#include "dt_tau_chain.h"
#include "kn_backend.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: drafter-trainer grad --drafter DIR --batch IN.safetensors --out OUT.safetensors [options]\n"
        "\n"
        "Runs one forward and backward of the drafter over a packed batch and writes the loss and\n"
        "every parameter gradient.\n"
        "\n"
        "  --drafter DIR            drafter checkpoint (config.json + model.safetensors, serving format)\n"
        "  --batch IN.safetensors   input_ids, cu_seqlens, loss_mask, anchors (I32), target_hidden\n"
        "                           ([T, taps x hidden], BF16 or F32), optionally embed_tokens and lm_head\n"
        "  --out OUT.safetensors    receives loss, tau (F32 [1]), acc_hits, acc_count (I32 [block]),\n"
        "                           accepted (I32 [anchors]), tau_chain (F32 [1]), chain_tokens and\n"
        "                           chain_steps (I32 [1]) and grad.<parameter> (F32) for every parameter\n"
        "  --target DIR             target model directory: embed_tokens and lm_head come from it when\n"
        "                           the batch has none; its config is checked against the drafter's\n"
        "  --device cpu|cuda        kernel backend (default cpu)\n"
        "  --gpu N                  cuda device ordinal (default 0)\n"
        "  --loss-decay-gamma G     slot weight exp(-(k-1)/G); default 7 for block size >= 16,\n"
        "                           4 for block size <= 8, else 5\n"
        "  --selector-alpha A       DFlash2: loss = unary + A x selector (default 1)\n"
        "  --selector-miss inject|drop\n"
        "                           DFlash2: a label outside the unary top-K replaces the K-th candidate\n"
        "                           (inject, the default) or leaves the selector term (drop)\n"
        "  --selector-stop-grad     DFlash2: the selector's gradient stops at its own parameters\n"
        "  --log-level L            debug, info, warn, error, off (default info; env TANDEM_LOG)\n"
        "\n"
        "accepted[j] is the leading run of correct slots of the block at anchors[j]; tau_chain is the τ a\n"
        "greedy decoder reports on this text, walking from each response's first token to its end over\n"
        "those runs (docs/drafter.md): written when the anchors hold every position it walks through, as\n"
        "every anchor candidate does. A DFlash2 drafter also writes loss_unary, loss_selector, sel_tau\n"
        "(F32 [1]), sel_in_topk and sel_hits (I32 [block]), and the same for its selector path:\n"
        "sel_accepted, sel_tau_chain, sel_chain_tokens, sel_chain_steps.\n");
}

typedef struct grad_args {
    const char *drafter, *batch, *out, *device, *target;
    int              gpu;
    float            gamma; /* 0: the block size's default */
    dt_selector_opts sel;
} grad_args;

/* docs/drafter.md defaults (γ = 7 for B = 16, 5 for 10, 4 for 8), extended to other sizes. */
static float default_gamma(int block_size) {
    if (block_size >= 16)
        return 7.0f;
    if (block_size <= 8)
        return 4.0f;
    return 5.0f;
}

// ----------------------------------------------------------------------------
// the batch file

/* An I32 vector of the batch, copied into an aligned array (file data may be unaligned). */
static cm_status read_i32(const cm_st *in, const char *path, const char *name, const char *what,
                          int32_t **out, int64_t *n) {
    const cm_st_tensor *t = cm_st_find(in, name);
    if (!t)
        return CM_FAIL(CM_ERR_FORMAT, "'%s' has no tensor '%s' (%s)", path, name, what);
    if (t->dtype != CM_DTYPE_I32)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': tensor '%s' has dtype %s; expected I32 (%s)", path, name,
                       cm_dtype_name(t->dtype), what);
    if (t->n_dims != 1)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': tensor '%s' has %d dimensions; expected 1 (%s)", path, name,
                       t->n_dims, what);
    *n = t->shape[0];
    *out = malloc((size_t)(*n ? *n : 1) * sizeof **out);
    if (!*out)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld values for '%s'", (long long)*n, name);
    memcpy(*out, t->data, (size_t)*n * sizeof **out);
    return CM_OK;
}

/* A frozen [V, D] matrix: F32 and BF16 are used as stored, other float dtypes are widened
 * to F32 into *owned (freed by the caller). */
static cm_status frozen_matrix(const cm_st *st, const cm_st_tensor *t, const char *where, const void **data,
                               cm_dtype *dt, void **owned) {
    if (!cm_dtype_is_float(t->dtype))
        return CM_FAIL(CM_ERR_FORMAT,
                       "tensor '%s' in '%s' has dtype %s; expected a float dtype (BF16 or F32)", t->name,
                       where, cm_dtype_name(t->dtype));
    if (t->n_dims != 2)
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' in '%s' has %d dimensions; expected 2 ([vocab, hidden])",
                       t->name, where, t->n_dims);
    if (t->dtype == CM_DTYPE_F32 || t->dtype == CM_DTYPE_BF16) {
        *data = t->data;
        *dt = t->dtype;
        return CM_OK;
    }
    size_t n = (size_t)t->shape[0] * (size_t)t->shape[1];
    *owned = malloc(n * sizeof(float));
    if (!*owned)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu floats for '%s'", n, t->name);
    CM_TRY(cm_st_read(st, t->name, 2, t->shape, *owned, CM_DTYPE_F32));
    *data = *owned;
    *dt = CM_DTYPE_F32;
    return CM_OK;
}

/* Checks a target directory's config against the drafter's: hidden size, tap ids and the
 * mask token. */
static cm_status check_target(const cm_drafter_cfg *cfg, const cm_target_cfg *t, const char *drafter,
                              const char *target) {
    if (t->hidden_size != cfg->hidden_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "drafter hidden_size %d ('%s') differs from the target's hidden_size %d ('%s'); a DFlash "
            "drafter must have its target's hidden size",
            cfg->hidden_size, drafter, t->hidden_size, target);
    for (int i = 0; i < cfg->n_taps; i++)
        if (cfg->target_layer_ids[i] >= t->n_layers)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "dflash_config.target_layer_ids[%d] = %d in '%s' is outside the target's layers [0, %d) "
                "('%s'); choose tap ids below %d",
                i, cfg->target_layer_ids[i], drafter, t->n_layers, target, t->n_layers);
    if (cfg->mask_token_id >= t->vocab_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "dflash_config.mask_token_id %d in '%s' is outside the target's vocabulary [0, %d) ('%s')",
            cfg->mask_token_id, drafter, t->vocab_size, target);
    return CM_OK;
}

/* The embedding and LM head: from the batch if it has them, else from the target dir. */
typedef struct frozen {
    cm_st      *target; /* owned when opened */
    const void *embed, *lm_head;
    cm_dtype    embed_dt, lm_head_dt;
    int64_t     V, D;
    void       *owned[2];
} frozen;

static cm_status find_frozen(frozen *fz, const cm_st *in, const grad_args *a, const cm_drafter_cfg *cfg,
                             const cm_target_cfg *tcfg) {
    const cm_st_tensor *e = cm_st_find(in, "embed_tokens"), *h = cm_st_find(in, "lm_head");
    const cm_st        *e_st = in, *h_st = in;
    const char         *e_where = a->batch, *h_where = a->batch;
    if ((!e || !h) && a->target) {
        CM_TRY(cm_st_open_dir(&fz->target, a->target));
        if (!e) {
            static const char *const keys[] = {"model.language_model.embed_tokens.weight",
                                               "model.embed_tokens.weight"};
            for (int i = 0; i < 2 && !e; i++)
                e = cm_st_find(fz->target, keys[i]);
            if (!e)
                return CM_FAIL(CM_ERR_FORMAT,
                               "'%s' has no 'model.language_model.embed_tokens.weight' or "
                               "'model.embed_tokens.weight': is it a Qwen3.5/3.6 checkpoint?",
                               a->target);
            e_st = fz->target;
            e_where = a->target;
        }
        if (!h) {
            h = tcfg->tie_word_embeddings ? e : cm_st_find(fz->target, "lm_head.weight");
            if (!h)
                return CM_FAIL(CM_ERR_FORMAT,
                               "'%s' has no 'lm_head.weight' and its config does not tie the word embeddings",
                               a->target);
            h_st = tcfg->tie_word_embeddings ? e_st : fz->target;
            h_where = tcfg->tie_word_embeddings ? e_where : a->target;
        }
    }
    if (!e)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "'%s' has no tensor 'embed_tokens' and no --target was given; add embed_tokens [vocab, "
            "hidden] to the batch or pass --target DIR",
            a->batch);
    if (!h && cfg->tie_word_embeddings) {
        h = e;
        h_st = e_st;
        h_where = e_where;
    }
    if (!h)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "'%s' has no tensor 'lm_head' and no --target was given; add lm_head [vocab, hidden] to the "
            "batch or pass --target DIR",
            a->batch);
    CM_TRY(frozen_matrix(e_st, e, e_where, &fz->embed, &fz->embed_dt, &fz->owned[0]));
    if (h == e) {
        fz->lm_head = fz->embed;
        fz->lm_head_dt = fz->embed_dt;
    } else {
        CM_TRY(frozen_matrix(h_st, h, h_where, &fz->lm_head, &fz->lm_head_dt, &fz->owned[1]));
    }
    fz->V = e->shape[0];
    fz->D = e->shape[1];
    if (fz->D != cfg->hidden_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "drafter hidden_size %d ('%s') differs from the target hidden size %lld (width of '%s' in "
            "'%s'); a DFlash drafter must have its target's hidden size",
            cfg->hidden_size, a->drafter, (long long)fz->D, e->name, e_where);
    if (h->shape[0] != e->shape[0] || h->shape[1] != e->shape[1])
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s' in '%s' has shape [%lld, %lld] but '%s' has [%lld, %lld]; both are "
                       "[vocab, hidden]",
                       h->name, h_where, (long long)h->shape[0], (long long)h->shape[1], e->name,
                       (long long)e->shape[0], (long long)e->shape[1]);
    if (cfg->mask_token_id >= fz->V)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "dflash_config.mask_token_id %d in '%s' is outside the target vocabulary [0, %lld) ('%s' "
            "has %lld rows)",
            cfg->mask_token_id, a->drafter, (long long)fz->V, e->name, (long long)fz->V);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// the command

/* One path's acceptance per anchor and the decoder's chain over it: path 0 the unary argmax, path 1
 * DFlash2's selector. */
typedef struct chain_fig {
    int32_t     *accepted; /* [n_anchors] */
    dt_tau_chain chain;
} chain_fig;

/* <prefix>accepted, and <prefix>tau_chain, <prefix>chain_tokens, <prefix>chain_steps when the
 * anchors held the whole chain. */
static cm_status add_chain(cm_st_writer *w, const char *prefix, const chain_fig *c, int64_t n_anchors) {
    char          name[64];
    const int64_t one = 1;
    snprintf(name, sizeof name, "%saccepted", prefix);
    CM_TRY(cm_st_writer_add(w, name, CM_DTYPE_I32, 1, &n_anchors, c->accepted));
    if (c->chain.missing >= 0)
        return CM_OK;
    const float   tau = (float)dt_tau_chain_tau(&c->chain);
    const int32_t tokens = (int32_t)c->chain.tokens, steps = (int32_t)c->chain.steps;
    snprintf(name, sizeof name, "%stau_chain", prefix);
    CM_TRY(cm_st_writer_add(w, name, CM_DTYPE_F32, 1, &one, &tau));
    snprintf(name, sizeof name, "%schain_tokens", prefix);
    CM_TRY(cm_st_writer_add(w, name, CM_DTYPE_I32, 1, &one, &tokens));
    snprintf(name, sizeof name, "%schain_steps", prefix);
    CM_TRY(cm_st_writer_add(w, name, CM_DTYPE_I32, 1, &one, &steps));
    return CM_OK;
}

static cm_status write_out(const grad_args *a, dt_model *m, const kn_backend *be, kn_ctx *ctx,
                           const dt_step_stats *s, const chain_fig *fig, int64_t n_anchors, float gamma) {
    cm_status     st;
    cm_st_writer *w = NULL;
    float        *host = NULL;
    int64_t       widest = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        if (dt_model_param(m, i)->numel > widest)
            widest = dt_model_param(m, i)->numel;
    host = malloc((size_t)widest * sizeof *host);
    if (!host)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld floats for the gradients", (long long)widest);
    CM_TRY_GOTO(cm_st_writer_create(&w), st, fail);
    const int64_t one = 1, B = dt_model_cfg(m)->block_size;
    const float   loss = (float)s->loss, tau = (float)s->tau;
    int32_t       hits[64], count[64];
    for (int k = 0; k < B; k++) {
        hits[k] = (int32_t)s->acc_hits[k];
        count[k] = (int32_t)s->acc_count[k];
    }
    CM_TRY_GOTO(cm_st_writer_add(w, "loss", CM_DTYPE_F32, 1, &one, &loss), st, fail);
    CM_TRY_GOTO(cm_st_writer_add(w, "tau", CM_DTYPE_F32, 1, &one, &tau), st, fail);
    CM_TRY_GOTO(cm_st_writer_add(w, "acc_hits", CM_DTYPE_I32, 1, &B, hits), st, fail);
    CM_TRY_GOTO(cm_st_writer_add(w, "acc_count", CM_DTYPE_I32, 1, &B, count), st, fail);
    CM_TRY_GOTO(add_chain(w, "", &fig[0], n_anchors), st, fail);
    if (dt_model_cfg(m)->kind == CM_DRAFTER_DFLASH2) {
        const float lu = (float)s->loss_unary, ls = (float)s->loss_selector, stau = (float)s->sel_tau;
        int32_t     in[64], sh[64];
        for (int k = 0; k < B; k++) {
            in[k] = (int32_t)s->sel_in_topk[k];
            sh[k] = (int32_t)s->sel_hits[k];
        }
        CM_TRY_GOTO(cm_st_writer_add(w, "loss_unary", CM_DTYPE_F32, 1, &one, &lu), st, fail);
        CM_TRY_GOTO(cm_st_writer_add(w, "loss_selector", CM_DTYPE_F32, 1, &one, &ls), st, fail);
        CM_TRY_GOTO(cm_st_writer_add(w, "sel_tau", CM_DTYPE_F32, 1, &one, &stau), st, fail);
        CM_TRY_GOTO(cm_st_writer_add(w, "sel_in_topk", CM_DTYPE_I32, 1, &B, in), st, fail);
        CM_TRY_GOTO(cm_st_writer_add(w, "sel_hits", CM_DTYPE_I32, 1, &B, sh), st, fail);
        CM_TRY_GOTO(add_chain(w, "sel_", &fig[1], n_anchors), st, fail);
    }
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        char            name[128];
        snprintf(name, sizeof name, "grad.%s", p->name);
        CM_TRY_GOTO(be->download(ctx, host, p->grad, (size_t)p->numel * sizeof(float)), st, fail);
        CM_TRY_GOTO(cm_st_writer_add(w, name, CM_DTYPE_F32, p->n_dims, p->shape, host), st, fail);
    }
    char g[32];
    snprintf(g, sizeof g, "%.9g", (double)gamma);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "producer", "tandem drafter-trainer grad"), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "device", be->name), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "loss_decay_gamma", g), st, fail);
    CM_TRY_GOTO(cm_st_writer_write(w, a->out), st, fail);
fail:
    cm_st_writer_destroy(&w);
    free(host);
    return st;
}

static cm_status run_grad(const grad_args *a) {
    cm_status         st;
    cm_st            *in = NULL;
    const kn_backend *be = NULL;
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    int32_t          *ids = NULL, *cu = NULL, *mask = NULL, *anchors = NULL;
    float            *F = NULL;
    frozen            fz = {0};
    chain_fig         fig[2] = {{0}};
    cm_drafter_cfg    cfg;
    cm_target_cfg     tcfg;
    memset(&tcfg, 0, sizeof tcfg);

    CM_TRY_GOTO(cm_drafter_cfg_load(&cfg, a->drafter), st, fail);
    if (a->target) {
        CM_TRY_GOTO(cm_target_cfg_load(&tcfg, a->target), st, fail);
        CM_TRY_GOTO(check_target(&cfg, &tcfg, a->drafter, a->target), st, fail);
    }

    /* the batch */
    CM_TRY_GOTO(cm_st_open_file(&in, a->batch), st, fail);
    int64_t T, n_cu, n_mask, n_anchors;
    CM_TRY_GOTO(read_i32(in, a->batch, "input_ids", "I32 [T]", &ids, &T), st, fail);
    CM_TRY_GOTO(read_i32(in, a->batch, "cu_seqlens", "I32 [N+1]", &cu, &n_cu), st, fail);
    CM_TRY_GOTO(read_i32(in, a->batch, "loss_mask", "I32 [T]", &mask, &n_mask), st, fail);
    CM_TRY_GOTO(read_i32(in, a->batch, "anchors", "I32 [n_anchors], sorted", &anchors, &n_anchors), st, fail);
    if (n_mask != T) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s': loss_mask has %lld values but input_ids has %lld", a->batch,
                     (long long)n_mask, (long long)T);
        goto fail;
    }
    if (n_cu < 2 || n_cu - 1 > T) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s': cu_seqlens has %lld values for %lld tokens; expected 2 to T+1",
                     a->batch, (long long)n_cu, (long long)T);
        goto fail;
    }
    const int64_t       width = (int64_t)cfg.n_taps * cfg.hidden_size;
    const cm_st_tensor *th = cm_st_find(in, "target_hidden");
    if (!th) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s' has no tensor 'target_hidden' (BF16 or F32 [T, taps x hidden])",
                     a->batch);
        goto fail;
    }
    if (th->dtype != CM_DTYPE_BF16 && th->dtype != CM_DTYPE_F32) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s': tensor 'target_hidden' has dtype %s; expected BF16 or F32",
                     a->batch, cm_dtype_name(th->dtype));
        goto fail;
    }
    if (th->n_dims != 2 || th->shape[0] != T) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "'%s': target_hidden must be [T = %lld, %lld]; found %d dimensions, %lld rows", a->batch,
                     (long long)T, (long long)width, th->n_dims, (long long)th->shape[0]);
        goto fail;
    }
    if (th->shape[1] != width) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "'%s': target_hidden is %lld wide but the drafter takes %d taps x hidden %d = %lld "
                     "(dflash_config.target_layer_ids in '%s'); capture those layers",
                     a->batch, (long long)th->shape[1], cfg.n_taps, cfg.hidden_size, (long long)width,
                     a->drafter);
        goto fail;
    }
    F = malloc((size_t)T * (size_t)width * sizeof *F);
    if (!F) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate target_hidden of %lld x %lld floats", (long long)T,
                     (long long)width);
        goto fail;
    }
    CM_TRY_GOTO(cm_st_read(in, "target_hidden", 2, th->shape, F, CM_DTYPE_F32), st, fail);
    CM_TRY_GOTO(find_frozen(&fz, in, a, &cfg, &tcfg), st, fail);

    /* the model */
    CM_TRY_GOTO(kn_backend_get(a->device, &be), st, fail);
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.device = a->gpu;
    kc.gemm_mode = KN_GEMM_MODE_F32;
    CM_TRY_GOTO(be->ctx_create(&ctx, &kc), st, fail);
    CM_TRY_GOTO(dt_model_create(&m, &cfg, be, ctx), st, fail);
    CM_TRY_GOTO(dt_model_load(m, a->drafter), st, fail);
    CM_TRY_GOTO(dt_model_set_selector(m, &a->sel), st, fail);
    CM_TRY_GOTO(dt_model_set_frozen(m, fz.embed, fz.embed_dt, fz.lm_head, fz.lm_head_dt, fz.V, fz.D), st,
                fail);

    const dt_batch b = {.T = T,
                        .n_seq = (int)(n_cu - 1),
                        .cu_seqlens = cu,
                        .input_ids = ids,
                        .loss_mask = mask,
                        .target_hidden = F,
                        .n_anchors = n_anchors,
                        .anchors = anchors};
    const float    gamma = a->gamma > 0 ? a->gamma : default_gamma(cfg.block_size);
    dt_step_stats  stats;
    CM_TRY_GOTO(dt_model_step(m, &b, gamma, &stats), st, fail);
    const int n_paths = cfg.kind == CM_DRAFTER_DFLASH2 ? 2 : 1;
    for (int p = 0; p < n_paths; p++) {
        fig[p].accepted = malloc((size_t)(n_anchors ? n_anchors : 1) * sizeof *fig[p].accepted);
        if (!fig[p].accepted) {
            st =
                CM_FAIL(CM_ERR_NOMEM, "cannot allocate the acceptance of %lld anchors", (long long)n_anchors);
            goto fail;
        }
        CM_TRY_GOTO(dt_model_accepted(m, p, fig[p].accepted), st, fail);
        CM_TRY_GOTO(
            dt_tau_chain_walk(cu, b.n_seq, mask, T, anchors, fig[p].accepted, n_anchors, NULL, &fig[p].chain),
            st, fail);
    }
    CM_TRY_GOTO(write_out(a, m, be, ctx, &stats, fig, n_anchors, gamma), st, fail);
    char figs[2][160];
    for (int p = 0; p < n_paths; p++) {
        const dt_tau_chain *c = &fig[p].chain;
        const char         *pre = p ? "sel_" : "";
        const double        tau = p ? stats.sel_tau : stats.tau;
        if (c->missing < 0)
            snprintf(figs[p], sizeof figs[p], "%stau %.3f, %stau_chain %.3f (%lld tokens in %lld steps)", pre,
                     tau, pre, dt_tau_chain_tau(c), (long long)c->tokens, (long long)c->steps);
        else
            snprintf(figs[p], sizeof figs[p], "%stau %.3f, no %stau_chain (no anchor at %lld, where it goes)",
                     pre, tau, pre, (long long)c->missing);
    }
    CM_LOG_INFO("wrote '%s': loss %.6f, %s%s%s, %lld anchors, %lld tokens, gamma %g", a->out, stats.loss,
                figs[0], n_paths > 1 ? ", " : "", n_paths > 1 ? figs[1] : "", (long long)n_anchors,
                (long long)T, (double)gamma);
fail:
    free(fig[0].accepted);
    free(fig[1].accepted);
    dt_model_destroy(&m);
    if (be)
        be->ctx_destroy(&ctx);
    free(fz.owned[0]);
    free(fz.owned[1]);
    cm_st_destroy(&fz.target);
    free(F);
    free(ids);
    free(cu);
    free(mask);
    free(anchors);
    cm_st_destroy(&in);
    return st;
}

int dt_cmd_grad(int argc, char **argv) {
    static const char *const devices[] = {"cpu", "cuda", NULL};
    grad_args                a = {.device = "cpu", .sel = DT_SELECTOR_OPTS_DEFAULT};
    cm_args                  p;
    cm_args_init(&p, "drafter-trainer grad", argc, argv);
    while (cm_args_next(&p)) {
        const char *val = NULL;
        int         k = 0;
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (cm_args_str(&p, "--drafter", &a.drafter) || cm_args_str(&p, "--batch", &a.batch) ||
                   cm_args_str(&p, "--out", &a.out) || cm_args_str(&p, "--target", &a.target)) {
        } else if (cm_args_choice(&p, "--device", devices, &k)) {
            a.device = devices[k];
        } else if (cm_args_str(&p, "--gpu", &val)) {
            char *end;
            errno = 0;
            long gpu = val ? strtol(val, &end, 10) : 0;
            if (val && (*end || end == val || errno || gpu < 0 || gpu > 1024))
                cm_args_fail(&p, "not a device ordinal");
            a.gpu = (int)gpu;
        } else if (cm_args_str(&p, "--loss-decay-gamma", &val)) {
            char *end;
            errno = 0;
            double g = val ? strtod(val, &end) : 0;
            if (val && (*end || end == val || errno || !(g > 0) || !isfinite(g) || g > 1e30))
                cm_args_fail(&p, "expected a positive number");
            a.gamma = (float)g;
        } else if (cm_args_f64(&p, "--selector-alpha", 0, 1e6, &a.sel.alpha)) {
        } else if (cm_args_choice(&p, "--selector-miss", dt_selector_miss_names, &k)) {
            a.sel.miss = (kn_sel_miss)k;
        } else if (cm_args_flag(&p, "--selector-stop-grad")) {
            a.sel.stop_grad = 1;
        } else if (!cm_args_log_level(&p))
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (!a.drafter || !a.batch || !a.out) {
        fprintf(stderr, "drafter-trainer grad: --drafter, --batch and --out are required (see --help)\n");
        return 2;
    }
    cm_status st = run_grad(&a);
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer grad: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
