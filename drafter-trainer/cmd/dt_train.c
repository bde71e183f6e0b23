/* drafter-trainer/cmd/dt_train.c — `drafter-trainer train`: the training loop over batch files
 * (docs/drafter.md). Per step: the next batch of the epoch's shuffled order, its anchors drawn from
 * (seed, epoch, batch id), dt_model_step, clip + AdamW with the warmup + cosine schedule, and
 * one metrics line (stdout every --log-every steps, RUN_DIR/metrics.jsonl every step; wait_s is
 * the time spent getting the batch and its hidden states: files, --shards or --server, live via
 * dt_live.h with requests prefetched ahead; compute_s the rest of the step).
 * Checkpoints (dt_ckpt.h) every --save-every steps and at the end; --resume continues from
 * RUN_DIR/checkpoints/latest bit for bit, refusing other hyperparameters, other data or a
 * checkpoint that fails its checksums. One trainer per RUN_DIR: RUN_DIR/trainer.lock (cm_lock.h)
 * is held from before the first read of the directory to exit. Every buffer is allocated before
 * the first step. One thread.
 * On cuda: --gpu picks the device (default LOCAL_RANK modulo the visible ones), --precision
 * the GEMM mode; with W > 1 ranks every step's gradients and statistics are all-reduced over
 * NCCL (dt_dp.h) so the ranks train one model on the global batch. With --server each step
 * takes its batch's taps as they arrived (dt_live_get_taps): host memory, uploaded once per tap,
 * or with --encoding nccl already in GPU memory. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cm_args.h"
#include "cm_cfg.h"
#include "cm_cfg_hash.h"
#include "cm_dtype.h"
#include "cm_lock.h"
#include "cm_log.h"
#include "cm_pool.h"
#include "cm_safetensors.h"
#include "cm_tb.h"
#include "cm_time.h"
#include "cm_weights_id.h"
#include "dt_anchor.h"
#include "dt_ckpt.h"
#include "dt_cmd.h"
#include "dt_data.h"
#include "dt_dp.h"
#include "dt_feed.h"
#include "dt_live.h"
#include "dt_model.h"
#include "dt_optim.h"
#include "dt_plan.h"
#include "dt_progress.h"
#include "dt_runcfg.h"
#include "dt_shard_source.h"
#include "dt_train_args.h"
#include "dt_train_eval.h"
#include "dt_train_random.h"
#include "dt_train_rundir.h"

// ---- pieces of the run

typedef struct run {
    train_args        a;
    const kn_backend *be;
    kn_ctx           *ctx;
    cm_drafter_cfg    cfg;
    dt_model         *m;
    dt_optim         *o;
    dt_feed          *feed;       /* the batches and their hidden states; owns the three below */
    dt_data          *data;       /* its batches */
    dt_shard_source  *shards;     /* --shards: where target_hidden comes from */
    dt_live          *live;       /* --server: where target_hidden comes from */
    int               is_dataset; /* --dataset: the batches are packed documents */
    dt_dp            *dp;        /* cuda with W > 1 ranks: the gradient all-reduce */
    int               device;    /* cuda device of ctx */
    uint64_t          target_id;  /* cm_target_cfg_hash of --target */
    uint64_t          weights_id; /* its weights fingerprint, when hidden states come from
                                     --server or --shards (0: not needed) */
    cm_st            *target;
    float            *frozen_owned[2]; /* widened embed / lm_head when the target is not F32/BF16 */
    int32_t          *order, *order_next, *anchors, *work;
    FILE             *metrics;
    cm_lock          *lock;     /* RUN_DIR/trainer.lock, held for the whole run */
    cm_tb            *tb;       /* RUN_DIR/tb event file, unless --no-tensorboard */
    dt_train_eval    *ev;       /* --eval-every (rank 0), or NULL */
    dt_progress       prog;     /* --progress display on stderr */
    int64_t           prog_end; /* the step this invocation stops at (--steps or the schedule) */
    dt_hparams        hp;
    dt_train_state    ts;
    char              resume_dir[4096];
    char              metrics_path[4096];
} run;

static cm_status default_gamma(int block_size, double *g) {
    switch (block_size) {
    case 16:
        *g = 7;
        return CM_OK;
    case 10:
        *g = 5;
        return CM_OK;
    case 8:
        *g = 4;
        return CM_OK;
    default:
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "no default loss-decay gamma for block_size %d (defaults exist for 8, 10, 16); pass "
                       "--loss-decay-gamma",
                       block_size);
    }
}

/* The drafter config: from the checkpoint when resuming (cross-checked against --config or
 * --init-from when given), else from --config or --init-from. */
static cm_status load_config(run *r) {
    char        path[4096];
    const char *given = r->a.config;
    if (!given && r->a.init_from) {
        snprintf(path, sizeof path, "%s/config.json", r->a.init_from);
        given = path;
    }
    if (!r->resume_dir[0]) {
        CM_TRY(cm_drafter_cfg_load(&r->cfg, given));
        if (!r->cfg.mask_token[0] && r->a.target && !r->a.target_random) { /* named as the target spells it */
            int found;
            CM_TRY(cm_tokenizer_token(r->a.target, r->cfg.mask_token_id, r->cfg.mask_token,
                                      sizeof r->cfg.mask_token, &found));
            if (found)
                CM_LOG_DEBUG("mask token %d is '%s' in the target's tokenizer", r->cfg.mask_token_id,
                             r->cfg.mask_token);
        }
        return CM_OK;
    }
    char ck[4096 + 16];
    snprintf(ck, sizeof ck, "%s/config.json", r->resume_dir);
    CM_TRY(cm_drafter_cfg_load(&r->cfg, ck));
    if (!given)
        return CM_OK;
    cm_drafter_cfg other;
    CM_TRY(cm_drafter_cfg_load(&other, given));
    if (!other.mask_token[0]) /* the run filled it in from the target's tokenizer */
        memcpy(other.mask_token, r->cfg.mask_token, sizeof other.mask_token);
    char     *x = NULL, *y = NULL;
    cm_status st = dt_ckpt_config_json(&r->cfg, &x);
    if (st == CM_OK)
        st = dt_ckpt_config_json(&other, &y);
    if (st == CM_OK && strcmp(x, y) != 0)
        st = CM_FAIL(
            CM_ERR_INVALID_ARG,
            "cannot resume: the drafter config '%s' differs from the checkpoint's '%s'; drop the flag "
            "or start a new --out",
            given, ck);
    free(x);
    free(y);
    return st;
}

/* --target-init random: the frozen matrices of a `serve --init random` target's scale, for
 * benchmarks; the drafter learns nothing real from them. */
static cm_status random_frozen(run *r, int64_t V, int64_t D) {
    uint16_t *m[2];
    CM_TRY(dt_random_frozen(r->a.target_seed, V, D, m));
    r->frozen_owned[0] = (float *)m[0];
    r->frozen_owned[1] = (float *)m[1];
    return dt_model_set_frozen(r->m, r->frozen_owned[0], CM_DTYPE_BF16, r->frozen_owned[1], CM_DTYPE_BF16, V, D);
}

/* The frozen embedding and LM head from the target directory (the keys dt_grad reads:
 * model.language_model.embed_tokens.weight or model.embed_tokens.weight, and lm_head.weight
 * unless the target ties them). */
static cm_status load_target(run *r) {
    char   tc[4096];
    size_t tl = strlen(r->a.target);
    if (r->a.target_random && tl > 5 && strcmp(r->a.target + tl - 5, ".json") == 0)
        snprintf(tc, sizeof tc, "%s", r->a.target);
    else
        snprintf(tc, sizeof tc, "%s/config.json", r->a.target);
    cm_target_cfg t;
    CM_TRY(cm_target_cfg_load(&t, tc));
    r->target_id = cm_target_cfg_hash(&t);
    if (t.hidden_size != r->cfg.hidden_size || t.vocab_size != r->cfg.vocab_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "target '%s' has hidden %d and vocab %d but the drafter has hidden %d and vocab %d; use the "
            "target the drafter is for",
            r->a.target, t.hidden_size, t.vocab_size, r->cfg.hidden_size, r->cfg.vocab_size);
    for (int i = 0; i < r->cfg.n_taps; i++)
        if (r->cfg.target_layer_ids[i] >= t.n_layers)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "dflash_config.target_layer_ids[%d] = %d is outside the target's layers [0, %d) ('%s'); "
                "choose tap ids below %d",
                i, r->cfg.target_layer_ids[i], t.n_layers, r->a.target, t.n_layers);
    if (t.n_layers != r->cfg.num_target_layers)
        CM_LOG_WARN("the drafter config says num_target_layers %d but target '%s' has %d layers",
                    r->cfg.num_target_layers, r->a.target, t.n_layers);
    if (r->a.target_random) {
        r->weights_id = cm_target_random_id(r->target_id, r->a.target_seed);
        return random_frozen(r, t.vocab_size, t.hidden_size);
    }
    CM_TRY(cm_st_open_dir(&r->target, r->a.target));
    if (r->a.server || r->a.shards) { /* hidden states of another process: they must be of these weights */
        cm_weights_id_info wi;
        CM_TRY(cm_weights_id_dir(r->target, r->a.target, CM_WEIGHTS_ID_READ_CACHE | CM_WEIGHTS_ID_WRITE_CACHE, 0,
                                 &wi));
        r->weights_id = wi.id;
        if (wi.from_cache)
            CM_LOG_INFO("target weights %016llx (from '%s/%s', checked against the files' sizes and times)",
                        (unsigned long long)wi.id, r->a.target, CM_WEIGHTS_ID_CACHE);
        else
            CM_LOG_INFO("target weights %016llx: %d tensors, %.2f GB hashed in %.2f s", (unsigned long long)wi.id,
                        wi.n_tensors, (double)wi.bytes / 1e9, wi.seconds);
    }
    return dt_model_set_frozen_from(r->m, r->target, t.vocab_size, t.hidden_size, t.tie_word_embeddings,
                                    r->frozen_owned);
}

/* The training state before step `step` (0-based count of steps taken): cursor and the
 * anchor generator that step will use. */
static void set_next_rng(run *r, int64_t step) {
    const int64_t n = r->hp.n_batches;
    r->ts.step = step;
    r->ts.epoch = step / n;
    r->ts.index = step % n;
    dt_data_epoch_order(r->data, r->hp.seed, (uint64_t)r->ts.epoch, r->order_next);
    dt_anchor_rng(&r->ts.rng, r->hp.seed, (uint64_t)r->ts.epoch,
                  (uint64_t)dt_data_step_batch(r->data, r->order_next, r->ts.index));
}

/* --shards: verifies the record of every batch that steps start+1 .. end will read (this rank's,
 * in the epochs' orders), before the first of them. */
static cm_status verify_shards(run *r, int64_t start, int64_t end) {
    const int      n = dt_data_count(r->data);
    uint8_t       *reads = calloc((size_t)n, 1);
    if (!reads)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d batch marks", n);
    for (int64_t t = start, epoch = -1; t < end; t++) {
        if (t / r->hp.n_batches != epoch) {
            epoch = t / r->hp.n_batches;
            dt_data_epoch_order(r->data, r->hp.seed, (uint64_t)epoch, r->order);
        }
        reads[dt_data_step_batch(r->data, r->order, t % r->hp.n_batches)] = 1;
    }
    cm_status st = dt_shard_source_verify(r->shards, reads, n, cm_pool_cpu_threads(8));
    free(reads);
    return st;
}

/* dt_data_set_pinning's and the live clients' callbacks: the batch buffers, or the answers,
 * page-locked through the backend. */
static cm_status pin_host(void *user, void *p, size_t bytes) {
    run *r = user;
    return r->be->host_pin(r->ctx, p, bytes);
}
static void unpin_host(void *user, void *p) {
    run *r = user;
    r->be->host_unpin(r->ctx, p);
}

/* The training data and where its hidden states come from (dt_feed.h): batch files (--data,
 * --data-dir) or a dataset's packs (--dataset), with target_hidden from the files, --shards or
 * --server; this process's data-parallel share. */
static cm_status open_data(run *r) {
    const train_args    *a = &r->a;
    const dt_live_config lc = {.endpoint = a->server, /* the rest of it is the feed's */
                               .name = "drafter-trainer",
                               .credits = (int)a->credits,
                               .encoding = a->encoding,
                               .timeout_ms = (int)a->timeout_ms,
                               .curve_server_key = a->curve_server_key,
                               .curve_secret_key = a->curve_secret_key,
                               .device = r->device,
                               .host_lock = r->be->host_pin && r->be->host_unpin ? pin_host : NULL,
                               .host_unlock = unpin_host,
                               .host_user = r};
    const dt_feed_config fc = {.data = a->data,
                               .data_dir = a->data_dir,
                               .dataset = a->dataset,
                               .token_budget = a->token_budget,
                               .shards = a->shards,
                               .live = a->server ? &lc : NULL,
                               .layer_ids = r->cfg.target_layer_ids,
                               .n_taps = r->cfg.n_taps,
                               .hidden = r->cfg.hidden_size,
                               .vocab_size = r->cfg.vocab_size,
                               .target_id = r->target_id,
                               .weights_id = r->weights_id,
                               .dp_rank = (int)a->dp_rank,
                               .dp_size = (int)a->dp_size,
                               .on_cuda = r->be == kn_backend_cuda()};
    CM_TRY(dt_feed_open(&r->feed, &fc));
    r->data = dt_feed_data(r->feed);
    r->shards = dt_feed_shards(r->feed);
    r->live = dt_feed_live(r->feed);
    r->is_dataset = dt_feed_is_dataset(r->feed);
    return CM_OK;
}

/* A resume with another data-parallel size would visit other batches: say so plainly (the
 * checkpoint's data hash covers the dp size; dt_ckpt_load refuses any other difference). */
static cm_status check_resume_dp(run *r) {
    char path[4096 + 32];
    snprintf(path, sizeof path, "%s/training_state.safetensors", r->resume_dir);
    cm_st *f = NULL;
    if (cm_st_open_file(&f, path) != CM_OK) {
        cm_clear_error();
        return CM_OK; /* dt_ckpt_load reports it */
    }
    const char *h = cm_st_metadata(f, "data_hash");
    uint64_t    saved = h ? strtoull(h, NULL, 16) : 0;
    cm_st_destroy(&f);
    const int W = dt_data_dp_size(r->data);
    if (!h || saved == dt_data_hash(r->data))
        return CM_OK;
    for (int w = 1; w <= 4096; w++)
        if (w != W && dt_data_hash_dp(r->data, w) == saved)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "cannot resume: '%s' was trained with data-parallel size %d but this run has %d; "
                           "resume with --dp-size %d (or that WORLD_SIZE), or start a new --out",
                           r->resume_dir, w, W, w);
    if (r->is_dataset)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot resume: the dataset or its packing differs from the run's (data hash %016llx, "
                       "checkpoint %016llx); pass the same --dataset files in the same order and the same "
                       "--token-budget, or start a new --out",
                       (unsigned long long)dt_data_hash(r->data), (unsigned long long)saved);
    return CM_OK;
}

/* A run trains on one target's hidden states: a resume whose --target has other weights than
 * the checkpoint recorded would mix two targets in one drafter. */
static cm_status check_resume_target(run *r) {
    const uint64_t saved = r->weights_id ? dt_ckpt_target_weights(r->resume_dir) : 0;
    if (!saved || saved == r->weights_id) /* nothing to compare, or dt_ckpt_load reports what is missing */
        return CM_OK;
    return CM_FAIL(CM_ERR_INVALID_ARG,
                   "cannot resume: '%s' was trained on the hidden states of target weights %016llx, but --target "
                   "'%s' has weights %016llx; resume with the run's target, or start a new --out",
                   r->resume_dir, (unsigned long long)saved, r->a.target, (unsigned long long)r->weights_id);
}

static cm_status save(run *r, int64_t step) {
    set_next_rng(r, step);
    char dir[4096];
    CM_TRY(dt_ckpt_save(r->a.out, r->m, r->o, r->be, r->ctx, &r->hp, &r->ts, dir, sizeof dir));
    if (r->metrics && (fflush(r->metrics) != 0 || fsync(fileno(r->metrics)) != 0))
        return CM_FAIL(CM_ERR_IO, "cannot sync '%s': %s", r->metrics_path, strerror(errno));
    CM_LOG_INFO("saved checkpoint '%s'", dir);
    return CM_OK;
}

/* DFlash2's step figures over the trained slots: recall@K (label in the unary top-K) and the selector's
 * teacher-forced accuracy over those (0 for DFlash, whose counts are 0). */
static void selector_rates(const dt_step_stats *s, int B, double *recall, double *acc) {
    int64_t in = 0, hit = 0, cnt = 0;
    for (int k = 1; k < B; k++) {
        in += s->sel_in_topk[k];
        hit += s->sel_hits[k];
        cnt += s->acc_count[k];
    }
    *recall = cnt ? (double)in / (double)cnt : 0.0;
    *acc = in ? (double)hit / (double)in : 0.0;
}

static cm_status write_metrics(run *r, int64_t step, int64_t epoch, int32_t batch, const dt_batch *b,
                               const dt_step_stats *s, const dt_optim_stats *os, double secs, double wait_s) {
    const int B = r->cfg.block_size;
    double    tps = secs > 0 ? (double)b->T / secs : 0;
    fprintf(r->metrics,
            "{\"step\": %" PRId64 ", \"epoch\": %" PRId64 ", \"batch\": %d, \"loss\": %.17g, \"tau\": %.17g, "
            "\"acc\": [",
            step, epoch, batch, s->loss, s->tau);
    for (int k = 1; k < B; k++) {
        if (s->acc_count[k] > 0)
            fprintf(r->metrics, "%s%.9g", k > 1 ? ", " : "",
                    (double)s->acc_hits[k] / (double)s->acc_count[k]);
        else
            fprintf(r->metrics, "%snull", k > 1 ? ", " : "");
    }
    double recall, sel_acc;
    selector_rates(s, B, &recall, &sel_acc);
    if (r->cfg.kind == CM_DRAFTER_DFLASH2) {
        fprintf(r->metrics,
                "], \"loss_unary\": %.17g, \"loss_selector\": %.17g, \"selector_alpha\": %.17g, "
                "\"recall_at_k\": %.9g, \"selector_acc\": %.9g, \"selector_tau\": %.17g, \"sel_acc\": [",
                s->loss_unary, s->loss_selector, s->alpha, recall, sel_acc, s->sel_tau);
        for (int k = 1; k < B; k++)
            fprintf(r->metrics, s->sel_in_topk[k] > 0 ? "%s%.9g" : "%snull", k > 1 ? ", " : "",
                    s->sel_in_topk[k] > 0 ? (double)s->sel_hits[k] / (double)s->sel_in_topk[k] : 0.0);
    }
    fprintf(r->metrics,
            "], \"lr\": %.17g, \"grad_norm\": %.17g, \"grad_scale\": %.17g, \"weight_sum\": %.17g, "
            "\"n_anchors\": %" PRId64 ", \"n_blocks\": %" PRId64 ", \"tokens\": %" PRId64
            ", \"seconds\": %.6f, "
            "\"wait_s\": %.6f, \"compute_s\": %.6f, \"tokens_per_s\": %.1f}\n",
            os->lr, os->grad_norm, os->grad_scale, s->weight_sum, b->n_anchors, s->n_blocks, b->T, secs,
            wait_s, secs - wait_s, tps);
    if (fflush(r->metrics) != 0 || ferror(r->metrics))
        return CM_FAIL(CM_ERR_IO, "cannot append to '%s': %s", r->metrics_path, strerror(errno));
    const double acc1 = s->acc_count[1] > 0 ? (double)s->acc_hits[1] / (double)s->acc_count[1] : 0.0;
    if (r->tb) {
        static const char *const tags[] = {"train/loss", "train/tau",         "train/acc1",  "train/lr",
                                           "train/grad_norm", "perf/tokens_per_s", "perf/wait_s", "perf/compute_s"};
        const double vals[] = {s->loss, s->tau, acc1, os->lr, os->grad_norm, tps, wait_s, secs - wait_s};
        CM_TRY(cm_tb_scalars(r->tb, 0, step, 8, tags, vals));
        if (r->cfg.kind == CM_DRAFTER_DFLASH2) {
            static const char *const tags2[] = {"train/loss_unary",  "train/loss_selector", "train/recall_at_k",
                                                "train/selector_acc", "train/selector_tau", "train/selector_alpha"};
            const double vals2[] = {s->loss_unary, s->loss_selector, recall, sel_acc, s->sel_tau, s->alpha};
            CM_TRY(cm_tb_scalars(r->tb, 0, step, 6, tags2, vals2));
        }
    }
    dt_progress_line pl = {
        .step = step, .total = r->prog_end, .epoch = epoch, .loss = s->loss, .tau = s->tau, .acc = acc1,
        .lr = os->lr, .v2 = r->cfg.kind == CM_DRAFTER_DFLASH2, .sel_tau = s->sel_tau, .recall = recall};
    dt_progress_step(&r->prog, &pl, secs, wait_s, (double)b->T);
    return CM_OK;
}

/* --eval-every: the evaluator, made before the first step (rank 0 only: every rank holds the same
 * weights). It decodes on --eval-server, else on the first live --server. */
static cm_status open_eval(run *r) {
    const train_args *a = &r->a;
    if (a->eval_every <= 0)
        return CM_OK;
    if (a->dp_rank != 0) {
        CM_LOG_DEBUG("rank %" PRId64 ": evaluations run on rank 0", a->dp_rank);
        return CM_OK;
    }
    char server[1024];
    snprintf(server, sizeof server, "%s", a->eval_server ? a->eval_server : a->server);
    server[strcspn(server, ",")] = '\0';
    const size_t               tl = strlen(a->target);
    const dt_train_eval_config ec = {
        .data = a->eval_data,
        .prompts = a->eval_prompts,
        .max_new = a->eval_max_new,
        .batch = (int)a->eval_batch,
        .target = tl > 5 && strcmp(a->target + tl - 5, ".json") == 0 ? NULL : a->target,
        .server = server,
        .curve_server_key = a->curve_server_key,
        .curve_secret_key = a->curve_secret_key,
        .timeout_ms = (int)a->timeout_ms,
        .weights_id = r->weights_id,
        .hint = a->eval_server ? "; --eval-every needs one" : "; --eval-every needs one: give --eval-server ENDPOINT"};
    return dt_train_eval_create(&r->ev, &ec, r->m);
}

/* One evaluation at step (after that step's metrics line and checkpoint). */
static cm_status evaluate(run *r, int64_t step) {
    if (!r->ev)
        return CM_OK;
    dt_progress_break(&r->prog);
    dt_train_eval_result res;
    CM_TRY(dt_train_eval_run(r->ev, step, &res));
    return dt_train_eval_report(&res, r->metrics, r->metrics_path, r->tb,
                                r->prog.mode != DT_PROGRESS_OFF ? r->prog.out : NULL);
}

static cm_status train(run *r) {
    cm_status   st = CM_OK;
    train_args *a = &r->a;
    CM_TRY(kn_backend_get(a->device, &r->be));
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    const int     on_cuda = r->be == kn_backend_cuda();
    kc.device = a->gpu >= 0 ? (int)a->gpu : on_cuda ? dt_dp_default_device() : 0;
    kc.gemm_mode = a->precision && strcmp(a->precision, "fp32") == 0 ? KN_GEMM_MODE_F32 : KN_GEMM_MODE_BF16;
    if (!on_cuda && (a->gpu >= 0 || a->precision))
        CM_LOG_WARN("--gpu and --precision apply to --device cuda; the cpu backend computes in fp32");
    CM_TRY(r->be->ctx_create(&r->ctx, &kc));
    r->device = kc.device;

    CM_TRY(dt_train_lock_run_dir(&r->a, &r->lock));
    /* resume: find the checkpoint first, since it defines the config */
    char ckpt_latest[4096];
    snprintf(ckpt_latest, sizeof ckpt_latest, "%s/checkpoints/latest", a->out);
    int found = 0;
    CM_TRY(dt_ckpt_latest(a->out, r->resume_dir, sizeof r->resume_dir, &found));
    if (a->resume && !found)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot resume: '%s' has no checkpoint (%s is missing); drop --resume "
                       "to start a new run",
                       a->out, ckpt_latest);
    if (!a->resume && found)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "'%s' already holds a run (%s); pass --resume to continue it or choose "
                       "a new --out",
                       a->out, ckpt_latest);
    if (!a->resume)
        r->resume_dir[0] = '\0';
    else /* every byte of it, before its config or state is read */
        CM_TRY(dt_ckpt_verify(r->resume_dir));
    CM_TRY(load_config(r));

    CM_TRY(dt_model_create(&r->m, &r->cfg, r->be, r->ctx));
    if (!a->resume) {
        if (a->init_from)
            CM_TRY(dt_model_load(r->m, a->init_from));
        else
            CM_TRY(dt_model_init_random(r->m, a->seed));
    }
    CM_TRY(load_target(r));

    CM_TRY(open_data(r));
    if (r->be->host_pin && r->be->host_unpin && !r->live) /* fed from files or shards: DMA uploads */
        dt_data_set_pinning(r->data, pin_host, unpin_host, r);
    if (a->dp_size > 1 && on_cuda) {
        const char    *port = getenv("MASTER_PORT");
        int64_t        p = 0;
        if (port && !cm_parse_i64("drafter-trainer train", "MASTER_PORT", port, 1, INT64_MAX, &p))
            return CM_FAIL(CM_ERR_INVALID_ARG, "MASTER_PORT '%s' is not a port number", port);
        const dt_dp_config dc = {.rank = (int)a->dp_rank,
                                 .size = (int)a->dp_size,
                                 .master_addr = getenv("MASTER_ADDR"),
                                 .master_port = (int)p,
                                 .timeout_ms = (int)a->timeout_ms};
        CM_TRY(dt_dp_create(&r->dp, &dc, r->be, r->ctx, r->m));
    } else if (a->dp_size > 1)
        CM_LOG_WARN("rank %" PRId64 " of %" PRId64 " on cpu trains alone on its share of the data (gradients are "
                    "all-reduced only with --device cuda)",
                    a->dp_rank, a->dp_size);

    dt_hparams *hp = &r->hp;
    hp->lr = a->lr;
    hp->warmup_ratio = a->warmup_ratio;
    hp->beta1 = 0.9;
    hp->beta2 = 0.999;
    hp->eps = 1e-8;
    hp->weight_decay = a->weight_decay;
    hp->clip = a->clip;
    if (a->have_gamma)
        hp->loss_decay_gamma = a->gamma;
    else
        CM_TRY(default_gamma(r->cfg.block_size, &hp->loss_decay_gamma));
    hp->epochs = a->epochs;
    hp->max_anchors = a->max_anchors;
    hp->n_batches = dt_data_steps_per_epoch(r->data); /* of this rank */
    if (hp->epochs > INT64_MAX / hp->n_batches)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--epochs %" PRId64 " is too large", hp->epochs);
    hp->total_steps = hp->epochs * hp->n_batches;
    hp->warmup_steps = dt_optim_warmup_steps(hp->total_steps, hp->warmup_ratio);
    hp->seed = a->seed;
    hp->data_hash = dt_data_hash(r->data);
    hp->target_weights = r->weights_id;
    hp->selector_alpha = a->sel_alpha;
    hp->selector_warmup_ratio = a->sel_warmup_ratio;
    hp->selector_ramp_ratio = a->sel_ramp_ratio;
    hp->selector_miss = a->sel_miss;
    hp->selector_stop_grad = a->sel_stop_grad;

    int              np = dt_model_n_params(r->m);
    const dt_param **params = malloc((size_t)np * sizeof *params);
    if (!params)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the parameter list");
    for (int i = 0; i < np; i++)
        params[i] = dt_model_param(r->m, i);
    dt_optim_config oc = {hp->lr,           hp->beta1, hp->beta2,       hp->eps,
                          hp->weight_decay, hp->clip,  hp->total_steps, hp->warmup_steps};
    st = dt_optim_create(&r->o, r->be, r->ctx, params, np, &oc);
    free(params);
    CM_TRY(st);
    CM_TRY(dt_optim_copies_of_model(r->o, r->m)); /* the update writes the next step's bf16 weights */

    const int64_t max_T = dt_data_max_tokens(r->data);
    /* every activation buffer now, for the largest batch: nothing is allocated in the loop */
    CM_TRY(dt_model_reserve(r->m, max_T, hp->max_anchors < max_T ? hp->max_anchors : max_T));
    r->order = malloc((size_t)dt_data_count(r->data) * sizeof *r->order);
    r->order_next = malloc((size_t)dt_data_count(r->data) * sizeof *r->order_next);
    r->anchors = malloc((size_t)max_T * sizeof *r->anchors);
    r->work = malloc((size_t)max_T * sizeof *r->work);
    if (!r->order || !r->order_next || !r->anchors || !r->work)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the step buffers");
    CM_TRY(open_eval(r)); /* last: the training's own memory is all in place before it */

    snprintf(r->metrics_path, sizeof r->metrics_path, "%s/metrics.jsonl", a->out);
    int64_t start = 0;
    if (a->resume) {
        CM_TRY(check_resume_dp(r));
        CM_TRY(check_resume_target(r));
        CM_TRY(dt_ckpt_load(r->resume_dir, hp, r->m, r->o, r->be, r->ctx, &r->ts));
        dt_train_state saved = r->ts;
        set_next_rng(r, saved.step);
        if (memcmp(&saved.rng, &r->ts.rng, sizeof saved.rng) != 0)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': the saved anchor generator does not match (seed, epoch, batch); "
                           "the checkpoint is damaged",
                           r->resume_dir);
        start = saved.step;
        CM_TRY(dt_train_trim_metrics(r->metrics_path, start));
        CM_LOG_INFO("resuming '%s' at step %" PRId64 " (epoch %" PRId64 ", batch %" PRId64 " of the epoch)",
                    r->resume_dir, start, saved.epoch, saved.index);
    } else {
        FILE *f = fopen(r->metrics_path, "wb");
        if (!f)
            return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", r->metrics_path, strerror(errno));
        fclose(f);
    }
    r->metrics = fopen(r->metrics_path, "ab");
    if (!r->metrics)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", r->metrics_path, strerror(errno));
    if (!a->no_tensorboard)
        CM_TRY(cm_tb_create(&r->tb, a->out, 10, start));
    const dt_progress_config pc = {a->progress, stderr, a->log_every};
    dt_progress_init(&r->prog, &pc);

    int64_t end = hp->total_steps;
    if (a->steps > 0 && a->steps < end)
        end = a->steps;
    r->prog_end = end;
    CM_LOG_INFO("training %d parameters on %" PRId64 " batches per epoch (%d %s%s) x %" PRId64
                " epochs = %" PRId64 " steps (warmup %" PRId64 "), steps %" PRId64 "..%" PRId64 ", device %s",
                np, hp->n_batches, dt_data_count(r->data), r->is_dataset ? "packs" : "batch files",
                dt_data_dp_size(r->data) > 1 ? ", this rank's share" : "", hp->epochs, hp->total_steps,
                hp->warmup_steps, start + 1, end, r->be->name);
    if (start >= end) {
        CM_LOG_INFO("nothing to do: the run is at step %" PRId64 " and stops at %" PRId64, start, end);
        return CM_OK;
    }

    if (r->shards && !a->verify_lazy)
        CM_TRY(verify_shards(r, start, end));
    if (r->live)
        dt_live_plan(r->live, hp->seed, start, end);
    int64_t cur_epoch = -1, last_saved = a->resume ? start : -1;
    for (int64_t t = start; t < end; t++) {
        double        t0 = cm_now_s();
        const int64_t epoch = t / hp->n_batches, index = t % hp->n_batches;
        if (epoch != cur_epoch) {
            dt_data_epoch_order(r->data, hp->seed, (uint64_t)epoch, r->order);
            cur_epoch = epoch;
        }
        const int32_t batch = dt_data_step_batch(r->data, r->order, index);
        dt_batch      b = {0};
        CM_TRY(dt_data_load(r->data, batch, &b));
        if (r->live) /* the taps as they arrived (host memory, or this GPU's with encoding nccl) */
            CM_TRY(dt_live_get_taps(r->live, batch, &b));
        const double wait_s = cm_now_s() - t0; /* the batch and its hidden states (file, shards, server) */
        CM_TRY(dt_anchor_sample(b.cu_seqlens, b.n_seq, b.loss_mask, b.T, hp->max_anchors, hp->seed,
                                (uint64_t)epoch, (uint64_t)batch, r->work, r->anchors, &b.n_anchors));
        b.anchors = r->anchors;
        dt_step_stats ss;
        memset(&ss, 0, sizeof ss);
        /* the next batch of this epoch loads while this step computes (a new epoch's first batch
         * waits for its order) */
        if (a->prefetch && !r->live && t + 1 < end && (t + 1) / hp->n_batches == epoch)
            CM_TRY(dt_data_prefetch(r->data, dt_data_step_batch(r->data, r->order, index + 1)));
        const dt_selector_opts so = {dt_hparams_selector_alpha(hp, t), (kn_sel_miss)hp->selector_miss,
                                     hp->selector_stop_grad};
        CM_TRY(dt_model_set_selector(r->m, &so));
        CM_TRY(dt_model_step(r->m, &b, (float)hp->loss_decay_gamma, &ss));
        dt_live_release(r->live); /* the step has synchronised: the answer's memory is free */
        if (r->dp) /* every rank, anchors or not: the loss and gradients become the global ones */
            CM_TRY(dt_dp_reduce(r->dp, &ss));
        dt_optim_stats os;
        CM_TRY(dt_optim_step(r->o, &os));
        if (os.copies)
            dt_model_w16_written(r->m);
        CM_TRY(write_metrics(r, t + 1, epoch, batch, &b, &ss, &os, cm_now_s() - t0, wait_s));
        if (a->save_every > 0 && (t + 1) % a->save_every == 0) {
            dt_progress_break(&r->prog);
            CM_TRY(save(r, t + 1));
            last_saved = t + 1;
        }
        if (a->eval_every > 0 && (t + 1) % a->eval_every == 0)
            CM_TRY(evaluate(r, t + 1));
    }
    dt_progress_release(&r->prog);
    if (last_saved != end)
        CM_TRY(save(r, end));
    if (a->eval_every > 0 && end % a->eval_every != 0)
        CM_TRY(evaluate(r, end));
    if (r->tb)
        CM_TRY(cm_tb_flush(r->tb));
    return CM_OK;
}

/* --dry-run: the plan from the drafter config (--config or --init-from) and the target's. */
static cm_status dry_run(const train_args *a) {
    cm_drafter_cfg d;
    cm_target_cfg  t;
    char           path[4096 + 16];
    if (a->config)
        CM_TRY(cm_drafter_cfg_load(&d, a->config));
    else {
        snprintf(path, sizeof path, "%s/config.json", a->init_from);
        CM_TRY(cm_drafter_cfg_load(&d, path));
    }
    /* a plan needs no weights: --target may name the model directory or just its config file */
    size_t tl = strlen(a->target);
    if (tl > 5 && strcmp(a->target + tl - 5, ".json") == 0)
        snprintf(path, sizeof path, "%s", a->target);
    else
        snprintf(path, sizeof path, "%s/config.json", a->target);
    CM_TRY(cm_target_cfg_load(&t, path));
    dt_plan_run pr = DT_PLAN_RUN_DEFAULT;
    pr.token_budget = a->token_budget;
    pr.max_anchors = a->max_anchors;
    pr.seq_len = a->plan_seq_len;
    pr.dp_size = (int)a->dp_size;
    pr.credits = a->server ? (int)a->credits : 0;
    pr.encoding = a->encoding;
    pr.ratio = a->plan_ratio;
    pr.target_tflops = a->plan_target_tflops;
    pr.drafter_tflops = a->plan_drafter_tflops;
    dt_plan p;
    CM_TRY(dt_plan_compute(&p, &t, &d, &pr));
    dt_plan_print(stdout, &p, &t, &d);
    return CM_OK;
}

static void run_release(run *r) {
    dt_train_eval_destroy(&r->ev); /* borrows the model */
    cm_tb_destroy(&r->tb);
    if (r->metrics)
        fclose(r->metrics);
    free(r->work);
    free(r->anchors);
    free(r->order_next);
    free(r->order);
    dt_feed_destroy(&r->feed);
    dt_dp_destroy(&r->dp);
    dt_optim_destroy(&r->o);
    dt_model_destroy(&r->m);
    cm_st_destroy(&r->target);
    free(r->frozen_owned[1]);
    free(r->frozen_owned[0]);
    if (r->be)
        r->be->ctx_destroy(&r->ctx);
    cm_lock_destroy(&r->lock); /* last: every file of the run is closed */
}

int dt_cmd_train(int argc, char **argv) {
    run *r = calloc(1, sizeof *r);
    if (!r) {
        fprintf(stderr, "drafter-trainer train: out of memory\n");
        return 1;
    }
    /* --run-config FILE: its flags first, so the command line's win; r->a borrows ex's strings */
    int                   n_flags;
    const dt_runcfg_flag *flags = dt_runcfg_train_flags(&n_flags);
    dt_runcfg_argv        ex;
    cm_status             st = dt_runcfg_expand(&ex, flags, n_flags, argc, argv);
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer train: %s\n", cm_last_error());
        free(r);
        return st == CM_ERR_INVALID_ARG ? 2 : 1;
    }
    int rc = dt_train_args_parse(ex.argc, ex.argv, &r->a);
    if (rc != 0) {
        dt_runcfg_argv_release(&ex);
        free(r);
        return rc == 1 ? 0 : 2;
    }
    st = r->a.dry_run ? dry_run(&r->a) : train(r);
    run_release(r);
    dt_runcfg_argv_release(&ex);
    free(r);
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer train: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
