/* common/format/cm_gencfg.c — a model's generation defaults (generation_config.json) and end
 * tokens (cm_cfg.h, cm_gen_cfg_load). */
#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cm_cfg.h"

/* eos_token_id: an integer or a list of integers (HF writes both); appended to g->eos. */
static cm_status read_eos(cm_gen_cfg *g, const cJSON *it, const char *origin) {
    if (!it || cJSON_IsNull(it)) return CM_OK;
    const cJSON *one = it;
    if (cJSON_IsArray(it)) one = it->child;
    for (; one; one = cJSON_IsArray(it) ? one->next : NULL) {
        if (!cJSON_IsNumber(one) || one->valuedouble != floor(one->valuedouble) || one->valuedouble < 0)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': eos_token_id must be a token id or a list of them", origin);
        if (g->n_eos < CM_GEN_MAX_EOS) g->eos[g->n_eos++] = (int)one->valuedouble;
        if (!cJSON_IsArray(it)) break;
    }
    return CM_OK;
}

static cm_status parse_file(const char *path, cJSON **root) {
    char     *text = NULL;
    cm_status st = cm_read_text_file(path, (size_t)1 << 20, &text);
    if (st != CM_OK) return st;
    *root = cJSON_Parse(text);
    free(text);
    if (!*root || !cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return CM_FAIL(CM_ERR_FORMAT, "'%s' is not a JSON object", path);
    }
    return CM_OK;
}

static cm_status num(const cJSON *o, const char *key, const char *origin, double lo, double hi, double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!it || cJSON_IsNull(it)) return CM_OK;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || it->valuedouble < lo || it->valuedouble > hi)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': %s must be a number in [%g, %g]", origin, key, lo, hi);
    *out = it->valuedouble;
    return CM_OK;
}

cm_status cm_gen_cfg_load(cm_gen_cfg *g, const char *dir) {
    memset(g, 0, sizeof *g);
    g->temperature = 1.0f;
    g->top_p       = 1.0f;
    g->top_k       = 50;
    char        path[4096];
    struct stat sb;
    cJSON      *root = NULL;
    cm_status   st   = CM_OK;
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (stat(path, &sb) == 0) {
        CM_TRY(parse_file(path, &root));
        double t = g->temperature, p = g->top_p, k = g->top_k;
        const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "do_sample");
        g->do_sample = cJSON_IsTrue(ds);
        st = num(root, "temperature", path, 0, 1e6, &t);
        if (st == CM_OK) st = num(root, "top_p", path, 0, 1, &p);
        if (st == CM_OK) st = num(root, "top_k", path, 0, 1e9, &k);
        if (st == CM_OK) st = read_eos(g, cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"), path);
        if (st == CM_OK && (k != floor(k) || p <= 0))
            st = CM_FAIL(CM_ERR_FORMAT, "'%s': top_k must be an integer and top_p above 0", path);
        g->temperature = (float)t;
        g->top_p       = (float)p;
        g->top_k       = (int)k;
        cJSON_Delete(root);
        root = NULL;
        if (st != CM_OK) return st;
    }
    if (g->n_eos == 0) { /* the model config's end token(s) */
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (stat(path, &sb) != 0) return CM_OK;
        CM_TRY(parse_file(path, &root));
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        st = read_eos(g, cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"), path);
        if (st == CM_OK && g->n_eos == 0 && cJSON_IsObject(tc))
            st = read_eos(g, cJSON_GetObjectItemCaseSensitive(tc, "eos_token_id"), path);
        cJSON_Delete(root);
    }
    return st;
}
