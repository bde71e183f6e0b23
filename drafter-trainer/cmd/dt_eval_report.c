/* drafter-trainer/cmd/dt_eval_report.c — the parts of `drafter-trainer eval` that need no server
 * (dt_eval.h): prompts from a tokenized dataset, the target's EOS ids from its configs, the figures of
 * a run, the table and the JSON report. */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dt_eval.h"

// ----------------------------------------------------------------------------
// prompts and EOS ids

cm_status dt_eval_prompts(const dt_docs *docs, int64_t max, dt_eval_prompt **out, int64_t *n,
                          int64_t *skipped) {
    *out = NULL;
    *n = *skipped = 0;
    dt_eval_prompt *p = malloc((size_t)(docs->n_docs > 0 ? docs->n_docs : 1) * sizeof *p);
    if (!p)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld prompts", (long long)docs->n_docs);
    for (int64_t d = 0; d < docs->n_docs && (max <= 0 || *n < max); d++) {
        const int64_t o = docs->offsets[d], e = docs->offsets[d + 1];
        int64_t       t = o;
        while (t < e && !docs->mask[t])
            t++;
        if (t == o || t == e) { /* supervised from the start, or never */
            (*skipped)++;
            continue;
        }
        p[(*n)++] = (dt_eval_prompt){.doc = d, .ids = docs->ids + o, .n = t - o};
    }
    *out = p;
    return CM_OK;
}

static cm_status read_text(const char *path, char **out, int *missing) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (missing && errno == ENOENT) {
            *missing = 1;
            return CM_OK;
        }
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    cm_status st = CM_OK;
    char     *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
        goto done;
    }
    const long size = ftell(f);
    rewind(f);
    if (size < 0 || size > (64L << 20)) {
        st = CM_FAIL(CM_ERR_FORMAT, "'%s' is not a config file (%ld bytes)", path, size);
        goto done;
    }
    buf = malloc((size_t)size + 1);
    if (!buf) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %ld bytes for '%s'", size, path);
        goto done;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) {
        st = CM_FAIL(CM_ERR_IO, "cannot read '%s'", path);
        goto done;
    }
    buf[size] = 0;
    *out = buf;
    buf = NULL;
done:
    free(buf);
    fclose(f);
    return st;
}

/* Adds the ids of v (an integer or a list of them; NULL or null: none) to ids without repeats. */
static cm_status add_eos(const cJSON *v, const char *path, int32_t *ids, int cap, int *n) {
    if (!v || cJSON_IsNull(v))
        return CM_OK;
    const cJSON *one = v;
    int          list = cJSON_IsArray(v);
    for (int i = 0; list ? i < cJSON_GetArraySize(v) : i < 1; i++) {
        if (list)
            one = cJSON_GetArrayItem(v, i);
        const double x = cJSON_IsNumber(one) ? one->valuedouble : -1;
        if (x < 0 || x > INT32_MAX || x != (double)(int32_t)x)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': eos_token_id must be a token id or a list of them", path);
        int seen = 0;
        for (int k = 0; k < *n; k++)
            seen |= ids[k] == (int32_t)x;
        if (seen)
            continue;
        if (*n == cap)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': more than %d eos_token_id values", path, cap);
        ids[(*n)++] = (int32_t)x;
    }
    return CM_OK;
}

cm_status dt_eval_eos_ids(const char *model_dir, int32_t *ids, int cap, int *n) {
    static const char *const files[2] = {"config.json", "generation_config.json"};
    *n = 0;
    for (int f = 0; f < 2; f++) {
        char path[4096], *text = NULL;
        int  missing = 0;
        snprintf(path, sizeof path, "%s/%s", model_dir, files[f]);
        CM_TRY(read_text(path, &text, f == 1 ? &missing : NULL));
        if (missing)
            continue;
        cJSON *o = cJSON_Parse(text);
        free(text);
        if (!cJSON_IsObject(o)) {
            cJSON_Delete(o);
            return CM_FAIL(CM_ERR_FORMAT, "'%s' is not a JSON object", path);
        }
        cm_status    st = add_eos(cJSON_GetObjectItemCaseSensitive(o, "eos_token_id"), path, ids, cap, n);
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(o, "text_config");
        if (st == CM_OK && cJSON_IsObject(tc))
            st = add_eos(cJSON_GetObjectItemCaseSensitive(tc, "eos_token_id"), path, ids, cap, n);
        cJSON_Delete(o);
        CM_TRY(st);
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// figures

void dt_eval_seq_release(dt_eval_seq *s) {
    if (!s)
        return;
    free(s->out);
    free(s->trace);
    s->out   = NULL;
    s->trace = NULL;
}

void dt_eval_seq_step(dt_eval_seq *s, int n_draft, int a, int emitted) {
    if (s->trace) { /* the loop sizes it for max_new steps: each step emits a token at least */
        s->trace[2 * s->steps]     = n_draft;
        s->trace[2 * s->steps + 1] = a;
    }
    s->steps++;
    s->verified += emitted;
    s->drafted += n_draft;
    if (a >= 0 && a < DT_EVAL_MAX_BLOCK)
        s->hist[a]++;
    for (int k = 1; k <= a && k < DT_EVAL_MAX_BLOCK; k++)
        s->slot_acc[k]++;
}

double dt_eval_seq_tau(const dt_eval_seq *s) {
    return s->steps ? (double)s->verified / (double)s->steps : 0.0;
}

void dt_eval_summarize(const dt_eval_seq *seqs, int64_t n, double wall_s, dt_eval_summary *o) {
    memset(o, 0, sizeof *o);
    o->n_prompts = n;
    for (int64_t i = 0; i < n; i++) {
        const dt_eval_seq *s = &seqs[i];
        o->generated += s->generated;
        o->steps += s->steps;
        o->verified += s->verified;
        o->drafted += s->drafted;
        o->n_eos += s->eos;
        for (int k = 0; k < DT_EVAL_MAX_BLOCK; k++) {
            o->hist[k] += s->hist[k];
            o->slot_acc[k] += s->slot_acc[k];
        }
    }
    o->tau = o->steps ? (double)o->verified / (double)o->steps : 0.0;
    o->wall_s = wall_s;
    o->tokens_per_s = wall_s > 0 ? (double)o->generated / wall_s : 0.0;
}

int64_t dt_eval_first_diff(const dt_eval_seq *a, const dt_eval_seq *b) {
    const int64_t n = a->generated < b->generated ? a->generated : b->generated;
    for (int64_t i = 0; i < n; i++)
        if (a->out[i] != b->out[i])
            return i;
    return a->generated == b->generated ? -1 : n;
}

static double seq_wall(const dt_eval_seq *s) {
    return s->t_end > s->t_start ? s->t_end - s->t_start : 0.0;
}

static double seq_rate(const dt_eval_seq *s) {
    const double w = seq_wall(s);
    return w > 0 ? (double)s->generated / w : 0.0;
}

// ----------------------------------------------------------------------------
// the table

void dt_eval_print(FILE *f, const dt_eval_report *r) {
    const dt_eval_meta    *m = &r->meta;
    const dt_eval_summary *a = &r->all;
    const int              B = m->block;
    if (m->target_only)
        fprintf(f, "target-only decoding, batch %d, max-new %lld", m->batch, (long long)m->max_new);
    else
        fprintf(f, "%s drafter '%s', block %d, batch %d, max-new %lld", m->kind, m->drafter, B, m->batch,
                (long long)m->max_new);
    if (m->temperature < 0)
        fprintf(f, ", sampled as the target's generation_config.json says, seed %" PRIu64 "\n", m->seed);
    else if (m->temperature > 0)
        fprintf(f, ", temperature %g, top-p %g, top-k %d, seed %" PRIu64 "\n", m->temperature, m->top_p,
                m->top_k, m->seed);
    else
        fprintf(f, ", greedy\n");
    fprintf(f, "%7s %8s %7s %9s %6s %6s %9s %4s%s\n", "prompt", "doc", "prompt", "generated", "steps", "tau",
            "tokens/s", "eos", r->compare ? "  same as target-only" : "");
    for (int64_t i = 0; i < r->n; i++) {
        const dt_eval_seq *s = &r->seqs[i];
        fprintf(f, "%7lld %8lld %7lld %9lld %6lld %6.2f %9.1f %4s", (long long)i, (long long)s->doc,
                (long long)s->prompt_len, (long long)s->generated, (long long)s->steps, dt_eval_seq_tau(s),
                seq_rate(s), s->eos ? "yes" : "no");
        if (r->compare) {
            const int64_t d = dt_eval_first_diff(s, &r->base[i]);
            if (d < 0)
                fprintf(f, "  yes");
            else
                fprintf(f, "  no (from token %lld)", (long long)d);
        }
        fprintf(f, "\n");
    }
    fprintf(f,
            "overall: %lld prompts, %lld tokens in %lld verify steps, tau %.3f, %.1f tokens/s (wall %.2f s: "
            "drafter %.2f s, target %.2f s)\n",
            (long long)a->n_prompts, (long long)a->generated, (long long)a->steps, a->tau, a->tokens_per_s,
            a->wall_s, a->draft_s, a->verify_s);
    if (!m->target_only && a->steps > 0) {
        fprintf(f, "accepted drafts per step (a: share of steps):");
        for (int k = 0; k < B; k++)
            fprintf(f, " %d: %.3f", k, (double)a->hist[k] / (double)a->steps);
        fprintf(f, "\ndraft k accepted (k: share of steps):");
        for (int k = 1; k < B; k++)
            fprintf(f, " %d: %.3f", k, (double)a->slot_acc[k] / (double)a->steps);
        fprintf(f, "\n");
    }
    if (r->compare) {
        int64_t same = 0;
        for (int64_t i = 0; i < r->n; i++)
            same += dt_eval_first_diff(&r->seqs[i], &r->base[i]) < 0;
        const dt_eval_summary *b = &r->base_all;
        fprintf(f,
                "target only: %.1f tokens/s (wall %.2f s); speculative speed-up %.2fx; outputs identical for "
                "%lld of "
                "%lld prompts%s\n",
                b->tokens_per_s, b->wall_s, b->tokens_per_s > 0 ? a->tokens_per_s / b->tokens_per_s : 0.0,
                (long long)same, (long long)r->n,
                m->temperature != 0 ? " (sampled: equal only where the server's "
                                      "sampling is reproducible)"
                                    : "");
    }
}

// ----------------------------------------------------------------------------
// the JSON report

static cJSON *counts(const int64_t *v, int from, int to) {
    cJSON *a = cJSON_CreateArray();
    for (int k = from; a && k < to; k++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber((double)v[k]));
    return a;
}

static cJSON *shares(const int64_t *v, int from, int to, int64_t den) {
    cJSON *a = cJSON_CreateArray();
    for (int k = from; a && k < to; k++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(den ? (double)v[k] / (double)den : 0.0));
    return a;
}

static void add_str(cJSON *o, const char *key, const char *v) {
    if (v)
        cJSON_AddStringToObject(o, key, v);
    else
        cJSON_AddNullToObject(o, key);
}

static cJSON *summary_json(const dt_eval_summary *s, int B) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompts", (double)s->n_prompts);
    cJSON_AddNumberToObject(o, "generated", (double)s->generated);
    cJSON_AddNumberToObject(o, "steps", (double)s->steps);
    cJSON_AddNumberToObject(o, "tau", s->tau);
    cJSON_AddItemToObject(o, "accept_hist", counts(s->hist, 0, B));
    cJSON_AddItemToObject(o, "accept_by_slot", shares(s->slot_acc, 1, B, s->steps));
    cJSON_AddNumberToObject(o, "drafted", (double)s->drafted);
    cJSON_AddNumberToObject(o, "eos", (double)s->n_eos);
    cJSON_AddNumberToObject(o, "wall_s", s->wall_s);
    cJSON_AddNumberToObject(o, "tokens_per_s", s->tokens_per_s);
    cJSON_AddNumberToObject(o, "drafter_s", s->draft_s);
    cJSON_AddNumberToObject(o, "target_s", s->verify_s);
    return o;
}

cm_status dt_eval_json(const dt_eval_report *r, char **out) {
    const dt_eval_meta *m = &r->meta;
    const int           B = m->block;
    *out = NULL;
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return CM_FAIL(CM_ERR_NOMEM, "cannot build the JSON report");
    add_str(o, "drafter", m->drafter);
    add_str(o, "kind", m->kind);
    add_str(o, "target", m->target);
    add_str(o, "data", m->data);
    add_str(o, "endpoint", m->endpoint);
    add_str(o, "device", m->device);
    cJSON_AddBoolToObject(o, "target_only", m->target_only);
    cJSON_AddNumberToObject(o, "block", B);
    cJSON_AddNumberToObject(o, "batch", m->batch);
    cJSON_AddNumberToObject(o, "max_new", (double)m->max_new);
    cJSON_AddNumberToObject(o, "temperature", m->temperature);
    cJSON_AddNumberToObject(o, "top_p", m->top_p);
    cJSON_AddNumberToObject(o, "top_k", m->top_k);
    char seed[24];
    snprintf(seed, sizeof seed, "%" PRIu64, m->seed);
    cJSON_AddStringToObject(o, "seed", seed);
    cJSON_AddItemToObject(o, "overall", summary_json(&r->all, B));
    cJSON *ps = cJSON_AddArrayToObject(o, "prompts");
    for (int64_t i = 0; ps && i < r->n; i++) {
        const dt_eval_seq *s = &r->seqs[i];
        cJSON             *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "doc", (double)s->doc);
        cJSON_AddNumberToObject(p, "prompt_tokens", (double)s->prompt_len);
        cJSON_AddNumberToObject(p, "generated", (double)s->generated);
        cJSON_AddNumberToObject(p, "steps", (double)s->steps);
        cJSON_AddNumberToObject(p, "tau", dt_eval_seq_tau(s));
        cJSON_AddItemToObject(p, "accept_hist", counts(s->hist, 0, B));
        cJSON_AddItemToObject(p, "accept_by_slot", shares(s->slot_acc, 1, B, s->steps));
        cJSON_AddNumberToObject(p, "wall_s", seq_wall(s));
        cJSON_AddNumberToObject(p, "tokens_per_s", seq_rate(s));
        cJSON_AddBoolToObject(p, "eos", s->eos);
        if (m->trace && s->out) {
            cJSON *tok = cJSON_AddArrayToObject(p, "tokens"), *nd = cJSON_AddArrayToObject(p, "n_draft"),
                  *ac = cJSON_AddArrayToObject(p, "accepted");
            for (int64_t k = 0; k < s->generated; k++) cJSON_AddItemToArray(tok, cJSON_CreateNumber(s->out[k]));
            for (int64_t k = 0; s->trace && k < s->steps; k++) {
                cJSON_AddItemToArray(nd, cJSON_CreateNumber(s->trace[2 * k]));
                cJSON_AddItemToArray(ac, cJSON_CreateNumber(s->trace[2 * k + 1]));
            }
        }
        if (r->compare) {
            const int64_t d = dt_eval_first_diff(s, &r->base[i]);
            cJSON_AddBoolToObject(p, "identical", d < 0);
            cJSON_AddNumberToObject(p, "first_diff", (double)d);
            cJSON_AddNumberToObject(p, "target_only_tokens_per_s", seq_rate(&r->base[i]));
        }
        cJSON_AddItemToArray(ps, p);
    }
    if (r->compare) {
        int64_t same = 0;
        for (int64_t i = 0; i < r->n; i++)
            same += dt_eval_first_diff(&r->seqs[i], &r->base[i]) < 0;
        cJSON *b = summary_json(&r->base_all, 1);
        cJSON_AddNumberToObject(b, "identical", (double)same);
        cJSON_AddBoolToObject(b, "all_identical", same == r->n);
        cJSON_AddNumberToObject(b, "speedup",
                                r->base_all.tokens_per_s > 0 ? r->all.tokens_per_s / r->base_all.tokens_per_s
                                                             : 0.0);
        cJSON_AddItemToObject(o, "target_only_run", b);
    }
    *out = cJSON_Print(o);
    cJSON_Delete(o);
    return *out ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot print the JSON report");
}

cm_status dt_eval_write_file(const char *path, const char *text) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the path '%s' is too long", path);
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    const size_t n = strlen(text);
    size_t       done = 0;
    while (done < n) {
        const ssize_t w = write(fd, text + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            const int e = errno;
            close(fd);
            unlink(tmp);
            return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
        }
        done += (size_t)w;
    }
    if (write(fd, "\n", 1) != 1 || fsync(fd) != 0) {
        const int e = errno;
        close(fd);
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(e));
    }
    return CM_OK;
}
