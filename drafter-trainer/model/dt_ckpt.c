/* drafter-trainer/model/dt_ckpt.c — checkpoint writer and reader (layout in dt_ckpt.h): serving
 * config.json text, BF16 model tensors, the fp32 training state, and the atomic directory
 * protocol (files synced, step-<N>.tmp renamed, parent synced, latest replaced). */
#include "dt_ckpt.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_safetensors.h"
#include "cm_time.h"
#include "dt_ckpt_sum.h"

// ---- text building

typedef struct sbuf {
    char  *p;
    size_t len, cap;
    int    oom;
} sbuf;

static void sb_add(sbuf *s, const char *fmt, ...) {
    if (s->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(s->p ? s->p + s->len : NULL, s->p ? s->cap - s->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            s->oom = 1;
            return;
        }
        if (s->p && s->len + (size_t)n < s->cap) {
            s->len += (size_t)n;
            return;
        }
        size_t nc = (s->cap ? s->cap * 2 : 1024) + (size_t)n;
        char  *np = realloc(s->p, nc);
        if (!np) {
            s->oom = 1;
            return;
        }
        s->p = np;
        s->cap = nc;
    }
}

/* Shortest %g text that reads back as the same float / double. */
static void fmt_float(char *buf, size_t cap, float v) {
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, cap, "%.*g", p, (double)v);
        if (strtof(buf, NULL) == v)
            return;
    }
}

static void fmt_double(char *buf, size_t cap, double v) {
    if (v == (double)(int64_t)v && v > -1e15 && v < 1e15) {
        snprintf(buf, cap, "%.0f", v);
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

cm_status dt_ckpt_config_json(const cm_drafter_cfg *c, char **out) {
    *out = NULL;
    sbuf s = {0};
    char eps[32], theta[32];
    fmt_float(eps, sizeof eps, c->rms_norm_eps);
    fmt_double(theta, sizeof theta, c->rope_theta);
    int any_sliding = 0;
    for (int l = 0; l < c->n_layers; l++)
        any_sliding |= c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION;

    const int v2 = c->kind == CM_DRAFTER_DFLASH2;
    sb_add(&s, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"qwen3\",\n",
           v2 ? "DFlash2DraftModel" : "DFlashDraftModel");
    sb_add(&s, "  \"block_size\": %d,\n  \"num_target_layers\": %d,\n", c->block_size, c->num_target_layers);
    sb_add(&s, "  \"dflash_config\": {\n    \"block_size\": %d,\n    \"mask_token_id\": %d,\n", c->block_size,
           c->mask_token_id);
    if (c->mask_token[0]) { /* the loaders default the string to "<|MASK|>" otherwise */
        sb_add(&s, "    \"mask_token\": \"");
        for (const unsigned char *t = (const unsigned char *)c->mask_token; *t; t++)
            sb_add(&s, *t == '"' || *t == '\\' ? "\\%c" : *t < 0x20 ? "\\u%04x" : "%c", *t);
        sb_add(&s, "\",\n");
    }
    if (v2)
        sb_add(&s,
               "    \"conv_kernel_size\": %d,\n    \"conv_group_size\": %d,\n    \"selector_rank\": %d,\n"
               "    \"selector_top_k\": %d,\n",
               c->conv_kernel_size, c->conv_group_size, c->selector_rank, c->selector_top_k);
    sb_add(&s, "    \"target_layer_ids\": [");
    for (int i = 0; i < c->n_taps; i++)
        sb_add(&s, "%s%d", i ? ", " : "", c->target_layer_ids[i]);
    sb_add(&s, "]\n  },\n");
    sb_add(&s, "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n",
           c->hidden_size, c->intermediate_size, c->n_layers);
    sb_add(&s, "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n",
           c->n_heads, c->n_kv_heads, c->head_dim);
    sb_add(&s, "  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": %s,\n  \"rope_theta\": %s,\n", eps, theta);
    sb_add(&s, "  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %s},\n", theta);
    sb_add(&s, "  \"rope_scaling\": null,\n  \"attention_bias\": %s,\n  \"attention_dropout\": 0.0,\n",
           c->attention_bias ? "true" : "false");
    sb_add(&s, "  \"max_position_embeddings\": %d,\n  \"layer_types\": [", c->max_position_embeddings);
    for (int l = 0; l < c->n_layers; l++)
        sb_add(&s, "%s\"%s\"", l ? ", " : "",
               c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION ? "sliding_attention" : "full_attention");
    sb_add(&s, "],\n  \"use_sliding_window\": %s,\n", any_sliding ? "true" : "false");
    if (any_sliding)
        sb_add(&s, "  \"sliding_window\": %d,\n", c->sliding_window);
    else
        sb_add(&s, "  \"sliding_window\": null,\n");
    if (c->is_causal != CM_CAUSAL_BY_LAYER_TYPE) /* absent stays absent: the loaders then derive it as we do */
        sb_add(&s, "  \"is_causal\": %s,\n", c->is_causal == CM_CAUSAL_ALL ? "true" : "false");
    sb_add(&s, "  \"initializer_range\": 0.02,\n  \"use_cache\": true,\n  \"tie_word_embeddings\": %s,\n",
           c->tie_word_embeddings ? "true" : "false");
    sb_add(&s, "  \"vocab_size\": %d,\n  \"dtype\": \"bfloat16\"\n}\n", c->vocab_size);
    if (s.oom) {
        free(s.p);
        return CM_FAIL(CM_ERR_NOMEM, "cannot build config.json");
    }
    *out = s.p;
    return CM_OK;
}

// ---- files and directories

static cm_status fsync_path(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s' to sync it: %s", path, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0)
        return CM_FAIL(CM_ERR_IO, "cannot sync '%s': %s", path, strerror(e));
    return CM_OK;
}

/* Writes len bytes to path.tmp, syncs, renames to path. */
static cm_status write_file_atomic(const char *path, const void *data, size_t len) {
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s' is too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    const char *p = data;
    size_t      left = len;
    while (left > 0) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = errno;
            close(fd);
            unlink(tmp);
            return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
        }
        p += n;
        left -= (size_t)n;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        int e = errno;
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot sync '%s': %s", tmp, strerror(e));
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(e));
    }
    return CM_OK;
}

static cm_status make_dir(const char *path) {
    if (mkdir(path, 0755) == 0 || errno == EEXIST) {
        struct stat sb;
        if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
            return CM_OK;
        return CM_FAIL(CM_ERR_IO, "'%s' exists and is not a directory", path);
    }
    return CM_FAIL(CM_ERR_IO, "cannot create directory '%s': %s", path, strerror(errno));
}

/* Removes a flat directory of our own making (its plain files, then itself); absent is fine.
 * 0, or -1 with errno and the path that could not be removed in bad (cap bytes). */
static int rm_flat_dir(const char *path, char *bad, size_t cap) {
    DIR *dp = opendir(path);
    if (!dp) {
        snprintf(bad, cap, "%s", path);
        return errno == ENOENT ? 0 : -1;
    }
    struct dirent *e;
    while ((e = readdir(dp)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if ((size_t)snprintf(bad, cap, "%s/%s", path, e->d_name) >= cap || unlink(bad) != 0) {
            int err = errno;
            closedir(dp);
            errno = err;
            return -1;
        }
    }
    closedir(dp);
    snprintf(bad, cap, "%s", path);
    return rmdir(path);
}

static cm_status remove_flat_dir(const char *path) {
    char bad[4096];
    if (rm_flat_dir(path, bad, sizeof bad) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot remove '%s': %s", bad, strerror(errno));
    return CM_OK;
}

static cm_status join(char *buf, size_t cap, const char *a, const char *b) {
    int n = snprintf(buf, cap, "%s/%s", a, b);
    if (n < 0 || (size_t)n >= cap)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s/%s' is too long", a, b);
    return CM_OK;
}

/* Test-only fault hook (dt_ckpt.h): TANDEM_FAULT=kill-in-checkpoint[:STEP] kills the process
 * with SIGKILL once step-<N>.tmp/ holds every file and before it is renamed, at the save of
 * step STEP (any step without one), so a test can prove a half-written checkpoint is never
 * loaded. Read at each save: a checkpoint is rare, and the test sets it per process. */
static void fault_kill_in_checkpoint(int64_t step) {
    const char *f = getenv("TANDEM_FAULT");
    const char *key = "kill-in-checkpoint";
    if (!f || strncmp(f, key, strlen(key)) != 0)
        return;
    const char *rest = f + strlen(key);
    if (*rest == '\0' || (*rest == ':' && strtoll(rest + 1, NULL, 10) == step)) {
        CM_LOG_WARN("TANDEM_FAULT=%s: killing this process inside the checkpoint of step %" PRId64, f, step);
        raise(SIGKILL);
    }
}

// ---- serving format

/* The parameters' bytes while a file is written (cm_st_fill_fn): each one downloaded into one
 * staging buffer, page-locked where the backend can (a DMA rather than a copy through the
 * driver), and for the serving format rounded to BF16 into a second one. Nothing else is held:
 * the host memory a save takes is the largest parameter's, not the state's. */
typedef struct param_fill {
    const kn_backend *be;
    kn_ctx           *ctx;
    const float     **src;   /* [entries] the device data of each tensor added later (else NULL) */
    int64_t          *numel; /* [entries] */
    float            *stage; /* the largest tensor's floats */
    uint16_t         *bf;    /* the BF16 copy (serving format), else NULL */
    int               pinned;
} param_fill;

static cm_status fill_create(param_fill *f, const kn_backend *be, kn_ctx *ctx, int n_entries,
                             int64_t max_numel, int bf16) {
    memset(f, 0, sizeof *f);
    f->be = be;
    f->ctx = ctx;
    f->src = calloc((size_t)n_entries, sizeof *f->src);
    f->numel = calloc((size_t)n_entries, sizeof *f->numel);
    f->stage = malloc((size_t)max_numel * sizeof *f->stage);
    f->bf = bf16 ? malloc((size_t)max_numel * sizeof *f->bf) : NULL;
    if (!f->src || !f->numel || !f->stage || (bf16 && !f->bf))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld floats to stage a checkpoint",
                       (long long)max_numel);
    if (be->host_pin && be->host_unpin) {
        f->pinned = be->host_pin(ctx, f->stage, (size_t)max_numel * sizeof *f->stage) == CM_OK;
        if (!f->pinned) {
            CM_LOG_DEBUG("checkpoint staging stays pageable: %s", cm_last_error());
            cm_clear_error();
        }
    }
    return CM_OK;
}

static void fill_destroy(param_fill *f) {
    if (f->pinned)
        f->be->host_unpin(f->ctx, f->stage);
    free(f->src);
    free(f->numel);
    free(f->stage);
    free(f->bf);
}

static cm_status fill_param(void *user, int entry, const void **data) {
    param_fill  *f = user;
    const size_t n = (size_t)f->numel[entry];
    CM_TRY(f->be->download(f->ctx, f->stage, f->src[entry], n * sizeof *f->stage));
    if (f->bf)
        CM_TRY(cm_convert(f->bf, CM_DTYPE_BF16, f->stage, CM_DTYPE_F32, n));
    *data = f->bf ? (const void *)f->bf : (const void *)f->stage;
    return CM_OK;
}

/* model.safetensors.index.json naming model.safetensors for every tensor: vLLM and SGLang read every
 * *.safetensors of a directory that has no index, training_state.safetensors included (vLLM then fails
 * on its names); with the index they read only the weights. */
static cm_status write_index(const char *dir, const dt_model *m) {
    sbuf    s = {0};
    int64_t bytes = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        bytes += dt_model_param(m, i)->numel * 2;
    sb_add(&s, "{\n  \"metadata\": {\"total_size\": %lld},\n  \"weight_map\": {\n", (long long)bytes);
    for (int i = 0; i < dt_model_n_params(m); i++)
        sb_add(&s, "    \"%s\": \"model.safetensors\"%s\n", dt_model_param(m, i)->name,
               i + 1 < dt_model_n_params(m) ? "," : "");
    sb_add(&s, "  }\n}\n");
    if (s.oom) {
        free(s.p);
        return CM_FAIL(CM_ERR_NOMEM, "cannot build model.safetensors.index.json");
    }
    char      path[4096];
    cm_status st = join(path, sizeof path, dir, "model.safetensors.index.json");
    if (st == CM_OK)
        st = write_file_atomic(path, s.p, strlen(s.p));
    free(s.p);
    return st;
}

cm_status dt_ckpt_write_model(const char *dir, const dt_model *m, const kn_backend *be, kn_ctx *ctx) {
    cm_status     st = CM_OK;
    char         *json = NULL;
    cm_st_writer *w = NULL;
    param_fill    f = {0};
    char          path[4096];
    int64_t       widest = 1;
    for (int i = 0; i < dt_model_n_params(m); i++)
        if (dt_model_param(m, i)->numel > widest)
            widest = dt_model_param(m, i)->numel;
    CM_TRY_GOTO(dt_ckpt_config_json(dt_model_cfg(m), &json), st, fail);
    CM_TRY_GOTO(join(path, sizeof path, dir, "config.json"), st, fail);
    CM_TRY_GOTO(write_file_atomic(path, json, strlen(json)), st, fail);

    CM_TRY_GOTO(fill_create(&f, be, ctx, dt_model_n_params(m), widest, 1), st, fail);
    CM_TRY_GOTO(cm_st_writer_create(&w), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "format", "pt"), st, fail);
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        f.src[i] = p->data;
        f.numel[i] = p->numel;
        CM_TRY_GOTO(cm_st_writer_add_later(w, p->name, CM_DTYPE_BF16, p->n_dims, p->shape), st, fail);
    }
    CM_TRY_GOTO(join(path, sizeof path, dir, "model.safetensors"), st, fail);
    CM_TRY_GOTO(cm_st_writer_write_with(w, path, fill_param, &f), st, fail);
    CM_TRY_GOTO(write_index(dir, m), st, fail);
fail:
    fill_destroy(&f);
    cm_st_writer_destroy(&w);
    free(json);
    return st;
}

// ---- training state

static cm_status hparams_json(const dt_hparams *h, char **out) {
    sbuf s = {0};
    sb_add(&s,
           "{\"lr\": %.17g, \"warmup_ratio\": %.17g, \"beta1\": %.17g, \"beta2\": %.17g, \"eps\": %.17g, ",
           h->lr, h->warmup_ratio, h->beta1, h->beta2, h->eps);
    sb_add(&s, "\"weight_decay\": %.17g, \"clip\": %.17g, \"loss_decay_gamma\": %.17g, ", h->weight_decay,
           h->clip, h->loss_decay_gamma);
    sb_add(&s, "\"epochs\": %" PRId64 ", \"max_anchors\": %" PRId64 ", \"n_batches\": %" PRId64 ", ",
           h->epochs, h->max_anchors, h->n_batches);
    sb_add(&s, "\"selector_alpha\": %.17g, \"selector_warmup_ratio\": %.17g, \"selector_ramp_ratio\": %.17g, ",
           h->selector_alpha, h->selector_warmup_ratio, h->selector_ramp_ratio);
    sb_add(&s, "\"selector_miss\": %d, \"selector_stop_grad\": %d, ", h->selector_miss, h->selector_stop_grad);
    sb_add(&s, "\"total_steps\": %" PRId64 ", \"warmup_steps\": %" PRId64 ", \"seed\": \"%" PRIu64 "\"}",
           h->total_steps, h->warmup_steps, h->seed);
    if (s.oom) {
        free(s.p);
        return CM_FAIL(CM_ERR_NOMEM, "cannot build the training-state metadata");
    }
    *out = s.p;
    return CM_OK;
}

static cm_status write_state(const char *path, const dt_optim *o, const kn_backend *be, kn_ctx *ctx,
                             const dt_hparams *hp, const dt_train_state *ts) {
    cm_status     st = CM_OK;
    cm_st_writer *w = NULL;
    char         *hj = NULL;
    char          name[512], hash[32];
    param_fill    f = {0};
    const int     n = dt_optim_n_params(o);
    int64_t       widest = 1;
    for (int i = 0; i < n; i++)
        if (dt_optim_param(o, i)->numel > widest)
            widest = dt_optim_param(o, i)->numel;
    CM_TRY_GOTO(fill_create(&f, be, ctx, 3 * n + 3, widest, 0), st, fail);
    CM_TRY_GOTO(cm_st_writer_create(&w), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "format", DT_CKPT_FORMAT), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "version", DT_CKPT_VERSION), st, fail);
    CM_TRY_GOTO(hparams_json(hp, &hj), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "hparams", hj), st, fail);
    snprintf(hash, sizeof hash, "%016" PRIx64, hp->data_hash);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "data_hash", hash), st, fail);
    if (hp->target_weights) {
        snprintf(hash, sizeof hash, "%016" PRIx64, hp->target_weights);
        CM_TRY_GOTO(cm_st_writer_set_metadata(w, "target_weights", hash), st, fail);
    }
    static const char *const kinds[3] = {"master", "adam_m", "adam_v"};
    for (int k = 0; k < 3; k++) /* entry k·n + i */
        for (int i = 0; i < n; i++) {
            const dt_param *p = dt_optim_param(o, i);
            f.src[k * n + i] = k == 0 ? p->data : k == 1 ? dt_optim_m(o, i) : dt_optim_v(o, i);
            f.numel[k * n + i] = p->numel;
            snprintf(name, sizeof name, "%s.%s", kinds[k], p->name);
            CM_TRY_GOTO(cm_st_writer_add_later(w, name, CM_DTYPE_F32, p->n_dims, p->shape), st, fail);
        }
    int64_t one = 1, two = 2, four = 4;
    int64_t step[1] = {ts->step}, cursor[2] = {ts->epoch, ts->index}, rng[4];
    for (int i = 0; i < 4; i++)
        rng[i] = (int64_t)ts->rng.s[i];
    CM_TRY_GOTO(cm_st_writer_add(w, "step", CM_DTYPE_I64, 1, &one, step), st, fail);
    CM_TRY_GOTO(cm_st_writer_add(w, "cursor", CM_DTYPE_I64, 1, &two, cursor), st, fail);
    CM_TRY_GOTO(cm_st_writer_add(w, "rng", CM_DTYPE_I64, 1, &four, rng), st, fail);
    CM_TRY_GOTO(cm_st_writer_write_with(w, path, fill_param, &f), st, fail);
fail:
    fill_destroy(&f);
    free(hj);
    cm_st_writer_destroy(&w);
    return st;
}

/* tmp/checksums.json (dt_ckpt_sum.h) over the files already written into tmp. */
static cm_status write_sums(const char *tmp) {
    char             *json = NULL, path[4096];
    dt_ckpt_sum_stats ss;
    CM_TRY(join(path, sizeof path, tmp, DT_CKPT_SUM_NAME));
    CM_TRY(dt_ckpt_sum_build(tmp, &json, &ss));
    cm_status st = write_file_atomic(path, json, strlen(json));
    free(json);
    CM_LOG_DEBUG("checksums of '%s': %.1f MB in %.3f s", tmp, (double)ss.bytes / 1e6, ss.seconds);
    return st;
}

cm_status dt_ckpt_save(const char *run_dir, const dt_model *m, const dt_optim *o, const kn_backend *be,
                       kn_ctx *ctx, const dt_hparams *hp, const dt_train_state *ts, char *step_dir,
                       size_t cap) {
    char ckdir[4096], name[64], tmp[4096], fin[4096], path[4096];
    CM_TRY(make_dir(run_dir));
    CM_TRY(join(ckdir, sizeof ckdir, run_dir, "checkpoints"));
    CM_TRY(make_dir(ckdir));
    snprintf(name, sizeof name, "step-%" PRId64 ".tmp", ts->step);
    CM_TRY(join(tmp, sizeof tmp, ckdir, name));
    snprintf(name, sizeof name, "step-%" PRId64, ts->step);
    CM_TRY(join(fin, sizeof fin, ckdir, name));

    CM_TRY(remove_flat_dir(tmp)); /* a crashed earlier attempt */
    CM_TRY(make_dir(tmp));
    /* a failed save (a full disk) takes its step-<N>.tmp/ with it rather than leave it to the
     * next save of step N, which may never come */
    cm_status    st = CM_OK;
    const double t0 = cm_now_s();
    CM_TRY_GOTO(dt_ckpt_write_model(tmp, m, be, ctx), st, fail);
    const double t1 = cm_now_s();
    CM_TRY_GOTO(join(path, sizeof path, tmp, "training_state.safetensors"), st, fail);
    CM_TRY_GOTO(write_state(path, o, be, ctx, hp, ts), st, fail);
    const double t2 = cm_now_s();
    CM_TRY_GOTO(write_sums(tmp), st, fail); /* last: it hashes the files as written */
    const double t3 = cm_now_s();
    CM_TRY_GOTO(fsync_path(tmp), st, fail);
    fault_kill_in_checkpoint(ts->step);
    /* a step-<N> left by a crash between its rename and the latest update is stale: the run
     * resumed from an older latest and has just recomputed step N */
    CM_TRY_GOTO(remove_flat_dir(fin), st, fail);
    if (rename(tmp, fin) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, fin, strerror(errno));
        goto fail;
    }
    CM_TRY(fsync_path(ckdir));

    char line[80];
    int  n = snprintf(line, sizeof line, "%s\n", name);
    CM_TRY(join(path, sizeof path, ckdir, "latest"));
    CM_TRY(write_file_atomic(path, line, (size_t)n));
    CM_TRY(fsync_path(ckdir));
    const double t4 = cm_now_s();
    CM_LOG_INFO("checkpoint %s written in %.1f s: model %.1f s, training state %.1f s, checksums %.1f s, "
                "syncs %.1f s",
                name, t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3);
    if (step_dir && cap)
        snprintf(step_dir, cap, "%s", fin);
    return CM_OK;
fail:
    /* quietly: the failure that brought us here is the one to report */
    if (rm_flat_dir(tmp, path, sizeof path) != 0)
        CM_LOG_DEBUG("cannot remove '%s' after a failed save: %s", path, strerror(errno));
    return st;
}

cm_status dt_ckpt_latest(const char *run_dir, char *dir, size_t cap, int *found) {
    *found = 0;
    char path[4096], ckdir[4096];
    CM_TRY(join(ckdir, sizeof ckdir, run_dir, "checkpoints"));
    CM_TRY(join(path, sizeof path, ckdir, "latest"));
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT)
            return CM_OK;
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    char   line[128];
    size_t n = fread(line, 1, sizeof line - 1, f);
    fclose(f);
    line[n] = '\0';
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = '\0';
    const char *d = line + 5;
    int         ok = strncmp(line, "step-", 5) == 0 && *d;
    for (const char *c = d; ok && *c; c++)
        ok = *c >= '0' && *c <= '9';
    if (!ok)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s' should hold one line 'step-<N>', found '%.40s'; repair or remove it", path,
                       line);
    CM_TRY(join(dir, cap, ckdir, line));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return CM_FAIL(CM_ERR_FORMAT, "'%s' names '%s', which is not a checkpoint directory", path, dir);
    *found = 1;
    return CM_OK;
}

cm_status dt_ckpt_clean(const char *run_dir) {
    char ckdir[4096], path[4096], bad[4096];
    CM_TRY(join(ckdir, sizeof ckdir, run_dir, "checkpoints"));
    DIR *dp = opendir(ckdir);
    if (!dp)
        return errno == ENOENT ? CM_OK : CM_FAIL(CM_ERR_IO, "cannot list '%s': %s", ckdir, strerror(errno));
    cm_status st = CM_OK;
    for (struct dirent *e; st == CM_OK && (e = readdir(dp)) != NULL;) {
        size_t n = strlen(e->d_name);
        int    step_tmp =
            strncmp(e->d_name, "step-", 5) == 0 && n > 9 && strcmp(e->d_name + n - 4, ".tmp") == 0;
        if (!step_tmp && strcmp(e->d_name, "latest.tmp") != 0)
            continue;
        CM_TRY_GOTO(join(path, sizeof path, ckdir, e->d_name), st, done);
        CM_LOG_INFO("removing '%s', left by a checkpoint that did not finish", path);
        if ((step_tmp ? rm_flat_dir(path, bad, sizeof bad) : unlink(path)) != 0 && errno != ENOENT)
            st = CM_FAIL(CM_ERR_IO, "cannot remove '%s' (left by a checkpoint that did not finish): %s",
                         step_tmp ? bad : path, strerror(errno));
    }
done:
    closedir(dp);
    return st;
}

cm_status dt_ckpt_verify(const char *step_dir) {
    int               verified = 0;
    dt_ckpt_sum_stats ss;
    CM_TRY(dt_ckpt_sum_verify(step_dir, &verified, &ss));
    if (verified) {
        const double gbs = ss.seconds > 0 ? (double)ss.bytes / ss.seconds / 1e9 : 0.0;
        CM_LOG_INFO("verified checkpoint '%s': %.1f MB hashed in %.3f s (%.2f GB/s)", step_dir,
                    (double)ss.bytes / 1e6, ss.seconds, gbs);
        return CM_OK;
    }
    CM_LOG_WARN("checkpoint '%s' has no %s (saved before checkpoints had checksums): resuming without "
                "verifying it; the checkpoints this run saves will have them",
                step_dir, DT_CKPT_SUM_NAME);
    /* what can be seen without checksums: a truncated or malformed model.safetensors (the resume
     * reads only the training state, so nothing else would notice) */
    char   path[4096], advice[1400];
    cm_st *f = NULL;
    CM_TRY(join(path, sizeof path, step_dir, "model.safetensors"));
    cm_status st = cm_st_open_file(&f, path);
    cm_st_destroy(&f);
    if (st == CM_OK)
        return CM_OK;
    char why[1024];
    snprintf(why, sizeof why, "%s", cm_last_error());
    dt_ckpt_sum_advice(step_dir, advice, sizeof advice);
    return CM_FAIL(CM_ERR_FORMAT, "cannot resume: checkpoint '%s' is damaged: %s; %s", step_dir, why, advice);
}

// ---- loading

static cm_status cmp_f(const char *field, double want, double got, const char *flag) {
    if (want == got)
        return CM_OK;
    char w[32], g[32];
    fmt_double(w, sizeof w, want);
    fmt_double(g, sizeof g, got);
    return CM_FAIL(
        CM_ERR_INVALID_ARG,
        "cannot resume: %s is %s but the checkpoint was trained with %s; pass %s %s or start a new --out",
        field, w, g, flag, g);
}

static cm_status cmp_i(const char *field, int64_t want, int64_t got, const char *what) {
    if (want == got)
        return CM_OK;
    return CM_FAIL(CM_ERR_INVALID_ARG,
                   "cannot resume: %s is %" PRId64 " but the checkpoint has %" PRId64 " (%s); use the same "
                   "settings and data or start a new --out",
                   field, want, got, what);
}

static cm_status json_num(const cJSON *o, const char *key, const char *origin, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': hparams has no number '%s'", origin, key);
    *out = v->valuedouble;
    return CM_OK;
}

static cm_status check_hparams(const char *origin, const char *text, const char *hash, const dt_hparams *w) {
    cJSON *j = cJSON_Parse(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return CM_FAIL(CM_ERR_FORMAT, "'%s': the hparams metadata is not a JSON object", origin);
    }
    cm_status   st = CM_OK;
    double      v[13];
    const char *keys[13] = {"lr",          "warmup_ratio", "beta1",     "beta2",
                            "eps",         "weight_decay", "clip",      "loss_decay_gamma",
                            "epochs",      "max_anchors",  "n_batches", "total_steps",
                            "warmup_steps"};
    for (int k = 0; k < 13; k++)
        CM_TRY_GOTO(json_num(j, keys[k], origin, &v[k]), st, done);
    const cJSON *sv = cJSON_GetObjectItemCaseSensitive(j, "seed");
    if (!cJSON_IsString(sv)) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s': hparams has no string 'seed'", origin);
        goto done;
    }
    CM_TRY_GOTO(cmp_f("--lr", w->lr, v[0], "--lr"), st, done);
    CM_TRY_GOTO(cmp_f("--warmup-ratio", w->warmup_ratio, v[1], "--warmup-ratio"), st, done);
    CM_TRY_GOTO(cmp_f("adam beta1", w->beta1, v[2], "beta1"), st, done);
    CM_TRY_GOTO(cmp_f("adam beta2", w->beta2, v[3], "beta2"), st, done);
    CM_TRY_GOTO(cmp_f("adam eps", w->eps, v[4], "eps"), st, done);
    CM_TRY_GOTO(cmp_f("--weight-decay", w->weight_decay, v[5], "--weight-decay"), st, done);
    CM_TRY_GOTO(cmp_f("--clip", w->clip, v[6], "--clip"), st, done);
    CM_TRY_GOTO(cmp_f("--loss-decay-gamma", w->loss_decay_gamma, v[7], "--loss-decay-gamma"), st, done);
    CM_TRY_GOTO(cmp_i("--epochs", w->epochs, (int64_t)v[8], "epochs"), st, done);
    CM_TRY_GOTO(cmp_i("--max-anchors", w->max_anchors, (int64_t)v[9], "anchors per batch"), st, done);
    CM_TRY_GOTO(cmp_i("the number of batch files", w->n_batches, (int64_t)v[10], "batch files"), st, done);
    CM_TRY_GOTO(cmp_i("the schedule length", w->total_steps, (int64_t)v[11], "total steps"), st, done);
    CM_TRY_GOTO(cmp_i("the warmup length", w->warmup_steps, (int64_t)v[12], "warmup steps"), st, done);
    { /* the selector's settings; absent in checkpoints older than DFlash2: the defaults */
        static const char *const sk[5] = {"selector_alpha", "selector_warmup_ratio", "selector_ramp_ratio",
                                          "selector_miss", "selector_stop_grad"};
        static const char *const flag[5] = {"--selector-alpha", "--selector-warmup-ratio", "--selector-ramp-ratio",
                                            "--selector-miss", "--selector-stop-grad"};
        const double want[5] = {w->selector_alpha, w->selector_warmup_ratio, w->selector_ramp_ratio,
                                (double)w->selector_miss, (double)w->selector_stop_grad};
        double       got[5] = {1, 0, 0, 0, 0};
        for (int k = 0; k < 5; k++) {
            if (cJSON_GetObjectItemCaseSensitive(j, sk[k]))
                CM_TRY_GOTO(json_num(j, sk[k], origin, &got[k]), st, done);
            CM_TRY_GOTO(cmp_f(flag[k], want[k], got[k], flag[k]), st, done);
        }
    }
    char seed[32];
    snprintf(seed, sizeof seed, "%" PRIu64, w->seed);
    if (strcmp(seed, sv->valuestring) != 0) {
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "cannot resume: --seed is %s but the checkpoint was trained with %s; "
                     "pass --seed %s or start a new --out",
                     seed, sv->valuestring, sv->valuestring);
        goto done;
    }
    char want_hash[32];
    snprintf(want_hash, sizeof want_hash, "%016" PRIx64, w->data_hash);
    if (!hash || strcmp(hash, want_hash) != 0) {
        st = CM_FAIL(
            CM_ERR_INVALID_ARG,
            "cannot resume: the batch files differ from the run's (data hash %s, checkpoint %s); pass the "
            "same files in the same order or start a new --out",
            want_hash, hash ? hash : "missing");
        goto done;
    }
done:
    cJSON_Delete(j);
    return st;
}

static cm_status read_i64(const cm_st *f, const char *origin, const char *name, int64_t n, int64_t *out) {
    const cm_st_tensor *t = NULL;
    CM_TRY(cm_st_expect(f, name, 1, &n, &t));
    CM_TRY(cm_st_expect_dtype(t, CM_DTYPE_I64));
    (void)origin;
    memcpy(out, t->data, (size_t)n * sizeof *out);
    return CM_OK;
}

cm_status dt_ckpt_load(const char *step_dir, const dt_hparams *want, const dt_model *m, dt_optim *o,
                       const kn_backend *be, kn_ctx *ctx, dt_train_state *ts) {
    char path[4096], name[512];
    CM_TRY(join(path, sizeof path, step_dir, "training_state.safetensors"));
    cm_st    *f = NULL;
    cm_status st = CM_OK;
    CM_TRY(cm_st_open_file(&f, path));
    const char *fmt = cm_st_metadata(f, "format"), *ver = cm_st_metadata(f, "version");
    if (!fmt || strcmp(fmt, DT_CKPT_FORMAT) != 0 || !ver || strcmp(ver, DT_CKPT_VERSION) != 0) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s' is not a version %s %s file (format '%s', version '%s')", path,
                     DT_CKPT_VERSION, DT_CKPT_FORMAT, fmt ? fmt : "none", ver ? ver : "none");
        goto fail;
    }
    const char *hp = cm_st_metadata(f, "hparams");
    if (!hp) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s' has no hparams metadata", path);
        goto fail;
    }
    CM_TRY_GOTO(check_hparams(path, hp, cm_st_metadata(f, "data_hash"), want), st, fail);
    if (dt_optim_n_params(o) != dt_model_n_params(m)) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "optimizer and model disagree on the parameter count");
        goto fail;
    }
    if (cm_st_count(f) != 3 * dt_model_n_params(m) + 3) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "'%s' holds %d tensors; the drafter needs %d (master, adam_m, adam_v per "
                     "parameter, step, cursor, rng): the checkpoint is of another model",
                     path, cm_st_count(f), 3 * dt_model_n_params(m) + 3);
        goto fail;
    }
    static const char *const kinds[3] = {"master", "adam_m", "adam_v"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < dt_model_n_params(m); i++) {
            const dt_param     *p = dt_model_param(m, i);
            const cm_st_tensor *t = NULL;
            snprintf(name, sizeof name, "%s.%s", kinds[k], p->name);
            CM_TRY_GOTO(cm_st_expect(f, name, p->n_dims, p->shape, &t), st, fail);
            CM_TRY_GOTO(cm_st_expect_dtype(t, CM_DTYPE_F32), st, fail);
            float *dst = k == 0 ? p->data : k == 1 ? dt_optim_m(o, i) : dt_optim_v(o, i);
            CM_TRY_GOTO(be->upload(ctx, dst, t->data, t->nbytes), st, fail);
        }
    int64_t step, cursor[2], rng[4];
    CM_TRY_GOTO(read_i64(f, path, "step", 1, &step), st, fail);
    CM_TRY_GOTO(read_i64(f, path, "cursor", 2, cursor), st, fail);
    CM_TRY_GOTO(read_i64(f, path, "rng", 4, rng), st, fail);
    if (step < 0 || step > want->total_steps || cursor[0] < 0 || cursor[1] < 0 ||
        cursor[1] >= want->n_batches || cursor[0] * want->n_batches + cursor[1] != step) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "'%s': step %" PRId64 " and cursor (%" PRId64 ", %" PRId64 ") do not agree", path, step,
                     cursor[0], cursor[1]);
        goto fail;
    }
    ts->step = step;
    ts->epoch = cursor[0];
    ts->index = cursor[1];
    for (int i = 0; i < 4; i++)
        ts->rng.s[i] = (uint64_t)rng[i];
    dt_optim_set_steps_done(o, step);
    cm_st_destroy(&f);
    return CM_OK;
fail:
    cm_st_destroy(&f);
    return st;
}

double dt_hparams_selector_alpha(const dt_hparams *h, int64_t steps) {
    const int64_t warm = (int64_t)floor(h->selector_warmup_ratio * (double)h->total_steps);
    const int64_t ramp = (int64_t)floor(h->selector_ramp_ratio * (double)h->total_steps);
    if (steps < warm)
        return 0.0;
    if (steps < warm + ramp)
        return h->selector_alpha * (double)(steps - warm + 1) / (double)ramp;
    return h->selector_alpha;
}

uint64_t dt_ckpt_target_weights(const char *step_dir) {
    char path[4096 + 32];
    snprintf(path, sizeof path, "%s/training_state.safetensors", step_dir);
    cm_st *f = NULL;
    if (cm_st_open_file(&f, path) != CM_OK) {
        cm_clear_error();
        return 0;
    }
    const char *h = cm_st_metadata(f, "target_weights");
    uint64_t    id = h ? strtoull(h, NULL, 16) : 0;
    cm_st_destroy(&f);
    return id;
}
