/* common/format/cm_quant.c — quantization_config of config.json (cm_quant.h, docs/fp8.md).
 * The field names follow Transformers' FineGrainedFP8Config and vLLM's Fp8Config: vLLM reads
 * quant_method, activation_scheme, weight_block_size and ignored_layers /
 * modules_to_not_convert; Transformers also dequantize and scale_fmt; neither reads fmt, but
 * Qwen writes it, so a value other than e4m3 is refused here. modules_to_convert and
 * expert_dtype are not read: which tensors are FP8 is decided by the tensors themselves (an
 * F8_E4M3 weight with its weight_scale_inv), the list of unconverted modules is a cross-check. */
#include "cm_quant.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_cfg_int.h"

#define QUANT_WHAT "Tandem reads fine-grained FP8 checkpoints (docs/fp8.md) and unquantized ones"

// ----------------------------------------------------------------------------
// names

/* s[0..se) against p[0..pe) where '*' matches any run of characters. */
static int glob(const char *p, const char *pe, const char *s, const char *se) {
    while (p < pe) {
        if (*p == '*') {
            for (const char *t = se; t >= s; t--)
                if (glob(p + 1, pe, t, se))
                    return 1;
            return 0;
        }
        if (s == se || *p != *s)
            return 0;
        p++;
        s++;
    }
    return s == se;
}

int cm_quant_name_match(const char *pattern, const char *name) {
    const size_t pl = strlen(pattern), n = strlen(name);
    if (!pl)
        return 0;
    for (size_t j = 1; j <= n; j++) /* a leading run of components: name[0, j) */
        if ((j == n || name[j] == '.') && glob(pattern, pattern + pl, name, name + j))
            return 1;
    for (size_t i = 1; i < n; i++) /* a trailing run: name[i, n) */
        if (name[i - 1] == '.' && glob(pattern, pattern + pl, name + i, name + n))
            return 1;
    return 0;
}

const char *cm_quant_cfg_skips(const cm_quant_cfg *q, const char *tensor) {
    const char  *dot = strrchr(tensor, '.');
    char         module[512];
    const size_t ml = dot ? (size_t)(dot - tensor) : 0;
    snprintf(module, sizeof module, "%.*s", (int)ml, tensor);
    for (int i = 0; i < q->n_skip; i++)
        if (cm_quant_name_match(q->skip[i], tensor) || (ml && cm_quant_name_match(q->skip[i], module)))
            return q->skip[i];
    return NULL;
}

// ----------------------------------------------------------------------------
// parsing

void cm_quant_cfg_release(cm_quant_cfg *q) {
    if (!q)
        return;
    for (int i = 0; i < q->n_skip; i++)
        free(q->skip[i]);
    free(q->skip);
    memset(q, 0, sizeof *q);
}

/* A string field, or NULL when absent; another JSON type fails. */
static cm_status str_opt(const cfg_obj *o, const char *key, const char **out) {
    const cJSON *it = cm_cfg_item(o, key);
    *out = NULL;
    if (!it)
        return CM_OK;
    if (!cJSON_IsString(it))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be a string, found %s", o->origin, o->prefix, key,
                       cm_cfg_json_kind(it));
    *out = it->valuestring;
    return CM_OK;
}

/* Appends a list of module names (absent or null: nothing). */
static cm_status add_names(cm_quant_cfg *q, const cfg_obj *o, const char *key) {
    const cJSON *arr = cm_cfg_item(o, key);
    if (!arr)
        return CM_OK;
    if (!cJSON_IsArray(arr))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be a list of module names, found %s", o->origin,
                       o->prefix, key, cm_cfg_json_kind(arr));
    const int n = cJSON_GetArraySize(arr);
    char    **grown = realloc(q->skip, (size_t)(q->n_skip + n + 1) * sizeof *grown);
    if (!grown)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d module names of '%s'", q->n_skip + n, o->origin);
    q->skip = grown;
    int i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        if (!cJSON_IsString(it))
            return CM_FAIL(CM_ERR_FORMAT, "'%s': %s%s[%d] must be a module name (a string), found %s", o->origin,
                           o->prefix, key, i, cm_cfg_json_kind(it));
        if (!(q->skip[q->n_skip] = strdup(it->valuestring)))
            return CM_FAIL(CM_ERR_NOMEM, "cannot copy the module names of '%s'", o->origin);
        q->n_skip++;
    }
    return CM_OK;
}

/* weight_block_size: absent means [128, 128] (FineGrainedFP8Config's default; the scales'
 * shapes are checked against it at load); anything but two integers 128 is refused. */
static cm_status block_size(cm_quant_cfg *q, const cfg_obj *o) {
    const cJSON *arr = cm_cfg_item(o, "weight_block_size");
    q->block_n = q->block_k = 128;
    if (!arr)
        return CM_OK;
    char         text[64] = "";
    const cJSON *a = cJSON_IsArray(arr) ? arr->child : NULL, *b = a ? a->next : NULL;
    int          ok = cJSON_IsArray(arr) && a && b && !b->next && cJSON_IsNumber(a) && cJSON_IsNumber(b);
    if (ok) {
        snprintf(text, sizeof text, "[%g, %g]", a->valuedouble, b->valuedouble);
        ok = a->valuedouble == 128 && b->valuedouble == 128;
    } else {
        snprintf(text, sizeof text, "(%s)", cJSON_IsArray(arr) ? "not two numbers" : cm_cfg_json_kind(arr));
    }
    if (!ok)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "'%s': %sweight_block_size %s is not supported; Tandem reads FP8 weights scaled in 128 x 128 "
                       "blocks ([128, 128]): use a checkpoint quantized that way, or the model's bf16 release",
                       o->origin, o->prefix, text);
    return CM_OK;
}

/* One field that must hold one of the accepted strings (or be absent). */
static cm_status one_of(const cfg_obj *o, const char *key, const char *ok, const char *why) {
    const char *v;
    CM_TRY(str_opt(o, key, &v));
    if (v && strcmp(v, ok) != 0)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "'%s': %s%s '%s' is not supported; %s (%s '%s'): use the model's bf16 "
                       "release",
                       o->origin, o->prefix, key, v, why, key, ok);
    return CM_OK;
}

static cm_status quant_fill(cm_quant_cfg *q, const cfg_obj *qc) {
    const char *method;
    CM_TRY(str_opt(qc, "quant_method", &method));
    if (!method)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': missing field '%squant_method'", qc->origin, qc->prefix);
    if (strcmp(method, "fp8") != 0)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "'%s': %squant_method '%s' is not supported; " QUANT_WHAT ": use the model's bf16 release "
                       "or its FP8 one (quant_method 'fp8')",
                       qc->origin, qc->prefix, method);
    CM_TRY(one_of(qc, "fmt", "e4m3", "Tandem reads FP8 weights as e4m3"));
    CM_TRY(one_of(qc, "activation_scheme", "dynamic",
                  "Tandem quantizes activations at run time and reads no activation scales"));
    CM_TRY(one_of(qc, "scale_fmt", "float", "Tandem reads the block scales as plain floats"));
    CM_TRY(block_size(q, qc));
    CM_TRY(cm_cfg_bool(qc, "dequantize", 0, &q->dequantize));
    CM_TRY(add_names(q, qc, "modules_to_not_convert"));
    CM_TRY(add_names(q, qc, "ignored_layers"));
    q->fp8 = 1;
    return CM_OK;
}

cm_status cm_quant_cfg_parse(cm_quant_cfg *q, const char *json, const char *origin) {
    memset(q, 0, sizeof *q);
    if (!origin)
        origin = "config.json";
    cJSON *root = NULL;
    CM_TRY(cm_cfg_parse_object(json, origin, &root));
    cfg_obj   top = {origin, root, ""}, tx, qc;
    char      tx_prefix[32], qc_prefix[64];
    cm_status st;
    /* the top level first (Qwen's releases), then the text model's config */
    CM_TRY_GOTO(cm_cfg_sub(&top, "quantization_config", qc_prefix, sizeof qc_prefix, &qc), st, fail);
    if (!qc.obj) {
        CM_TRY_GOTO(cm_cfg_sub(&top, "text_config", tx_prefix, sizeof tx_prefix, &tx), st, fail);
        CM_TRY_GOTO(cm_cfg_sub(&tx, "quantization_config", qc_prefix, sizeof qc_prefix, &qc), st, fail);
    }
    if (qc.obj)
        CM_TRY_GOTO(quant_fill(q, &qc), st, fail);
    cJSON_Delete(root);
    return CM_OK;
fail:
    cJSON_Delete(root);
    cm_quant_cfg_release(q);
    return st;
}

cm_status cm_quant_cfg_load(cm_quant_cfg *q, const char *path) {
    char *text = NULL;
    char  file[4096];
    memset(q, 0, sizeof *q);
    CM_TRY(cm_cfg_read_path(path, &text, file, sizeof file));
    cm_status st = cm_quant_cfg_parse(q, text, file);
    free(text);
    return st;
}
