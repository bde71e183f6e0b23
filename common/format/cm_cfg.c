/* common/format/cm_cfg.c — config.json readers for the hybrid Qwen target (Qwen3.5/3.6, nested
 * under "text_config" or flat) and the DFlash drafter (docs/drafter.md, docs/formats.md).
 * Every field is looked up by name, type- and range-checked before it lands in the
 * caller's struct; the first problem fails with one message naming the file, the field
 * and the fix. Stateless (cJSON trees are local to each call), so safe from any thread. */
#include "cm_cfg.h"
#include "cm_cfg_int.h"

#include <cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CFG_MAX_BYTES ((size_t)16 << 20) /* config.json files are a few KB */

// ----------------------------------------------------------------------------
// reading files

cm_status cm_read_text_file(const char *path, size_t max_bytes, char **out) {
    *out = NULL;
    cm_status st = CM_OK;
    char     *buf = NULL;
    FILE     *fp = fopen(path, "rb");
    if (!fp)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = CM_FAIL(CM_ERR_IO, "cannot read '%s': not a regular file", path);
        goto fail;
    }
    if ((uint64_t)sb.st_size > (uint64_t)max_bytes) {
        st = CM_FAIL(CM_ERR_IO, "'%s' is %lld bytes, more than the %zu-byte limit for this file", path,
                     (long long)sb.st_size, max_bytes);
        goto fail;
    }
    size_t size = (size_t)sb.st_size;
    buf = malloc(size + 1);
    if (!buf) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes to read '%s'", size + 1, path);
        goto fail;
    }
    size_t got = fread(buf, 1, size, fp);
    if (got != size || ferror(fp)) {
        st = CM_FAIL(CM_ERR_IO, "cannot read '%s': got %zu of %zu bytes", path, got, size);
        goto fail;
    }
    buf[size] = '\0';
    fclose(fp);
    *out = buf;
    return CM_OK;
fail:
    free(buf);
    fclose(fp);
    return st;
}

/* DIR → DIR/config.json; a file path is used as is. */
cm_status cm_cfg_read_path(const char *path, char **text, char *file, size_t file_len) {
    struct stat sb;
    if (stat(path, &sb) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    int n = S_ISDIR(sb.st_mode) ? snprintf(file, file_len, "%s/config.json", path)
                                : snprintf(file, file_len, "%s", path);
    if (n < 0 || (size_t)n >= file_len)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path too long: '%s'", path);
    return cm_read_text_file(file, CFG_MAX_BYTES, text);
}

cm_status cm_cfg_parse_object(const char *json, const char *origin, cJSON **root) {
    const char *end = NULL;
    *root = cJSON_ParseWithOpts(json, &end, 1);
    if (!*root)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': malformed JSON near byte %td", origin,
                       end ? end - json : (ptrdiff_t)0);
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return CM_FAIL(CM_ERR_FORMAT, "'%s': the top level is not a JSON object", origin);
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// typed field access: one object plus the dotted prefix that names it in messages

/* The member, or NULL if absent or JSON null (null means "unset" in HF configs). */
const cJSON *cm_cfg_item(const cfg_obj *o, const char *key) {
    const cJSON *it = o->obj ? cJSON_GetObjectItemCaseSensitive(o->obj, key) : NULL;
    return cJSON_IsNull(it) ? NULL : it;
}

const char *cm_cfg_json_kind(const cJSON *it) {
    if (cJSON_IsBool(it))
        return "a boolean";
    if (cJSON_IsNumber(it))
        return "a number";
    if (cJSON_IsString(it))
        return "a string";
    if (cJSON_IsArray(it))
        return "an array";
    if (cJSON_IsObject(it))
        return "an object";
    return "something else";
}

static cm_status cfg_missing(const cfg_obj *o, const char *key) {
    return CM_FAIL(CM_ERR_FORMAT, "'%s': missing field '%s%s'", o->origin, o->prefix, key);
}

/* Reads an integer field into *out; sets *found. Non-integers and values outside int fail. */
cm_status cm_cfg_int_opt(const cfg_obj *o, const char *key, int *out, int *found) {
    const cJSON *it = cm_cfg_item(o, key);
    *found = it != NULL;
    if (!it)
        return CM_OK;
    double d = cJSON_IsNumber(it) ? it->valuedouble : NAN;
    if (!cJSON_IsNumber(it) || !isfinite(d) || d != floor(d) || d < INT_MIN || d > INT_MAX)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be an integer, found %s", o->origin, o->prefix,
                       key, cJSON_IsNumber(it) ? "a fraction or an out-of-range number" : cm_cfg_json_kind(it));
    *out = (int)d;
    return CM_OK;
}

/* An integer field, > 0. required: absent fails; else absent leaves *out = def. */
cm_status cm_cfg_pos(const cfg_obj *o, const char *key, int required, int def, int *out) {
    int found;
    *out = def;
    CM_TRY(cm_cfg_int_opt(o, key, out, &found));
    if (!found && required)
        return cfg_missing(o, key);
    if (found && *out <= 0)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be positive, found %d", o->origin, o->prefix,
                       key, *out);
    return CM_OK;
}

static cm_status cfg_double_opt(const cfg_obj *o, const char *key, double *out, int *found) {
    const cJSON *it = cm_cfg_item(o, key);
    *found = it != NULL;
    if (!it)
        return CM_OK;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be a finite number, found %s", o->origin,
                       o->prefix, key, cJSON_IsNumber(it) ? "a non-finite number" : cm_cfg_json_kind(it));
    *out = it->valuedouble;
    return CM_OK;
}

cm_status cm_cfg_bool(const cfg_obj *o, const char *key, int def, int *out) {
    const cJSON *it = cm_cfg_item(o, key);
    *out = def;
    if (!it)
        return CM_OK;
    if (!cJSON_IsBool(it))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be true or false, found %s", o->origin,
                       o->prefix, key, cm_cfg_json_kind(it));
    *out = cJSON_IsTrue(it) ? 1 : 0;
    return CM_OK;
}

/* A nested object (absent or null gives one with obj = NULL). */
cm_status cm_cfg_sub(const cfg_obj *o, const char *key, char *prefix, size_t prefix_len, cfg_obj *sub) {
    const cJSON *it = cm_cfg_item(o, key);
    snprintf(prefix, prefix_len, "%s%s.", o->prefix, key);
    *sub = (cfg_obj){o->origin, NULL, prefix};
    if (!it)
        return CM_OK;
    if (!cJSON_IsObject(it))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be an object, found %s", o->origin, o->prefix,
                       key, cm_cfg_json_kind(it));
    sub->obj = it;
    return CM_OK;
}

static cm_status cfg_eps(const cfg_obj *o, float *out) {
    double eps = 1e-6;
    int    found;
    CM_TRY(cfg_double_opt(o, "rms_norm_eps", &eps, &found));
    if (!(eps > 0 && eps < 1))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%srms_norm_eps' must be in (0, 1), found %g", o->origin,
                       o->prefix, eps);
    *out = (float)eps;
    return CM_OK;
}

/* The value of a field that may live in two places (e.g. rope_theta at the top level of the
 * text config and in rope_parameters): either may be absent; if both are set they must agree. */
static cm_status cfg_double_either(const cfg_obj *a, const cfg_obj *b, const char *key, double def,
                                   double *out) {
    double va = def, vb = def;
    int    fa, fb;
    CM_TRY(cfg_double_opt(a, key, &va, &fa));
    CM_TRY(cfg_double_opt(b, key, &vb, &fb));
    if (fa && fb && va != vb)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': '%s%s' (%g) and '%s%s' (%g) disagree; keep one", a->origin,
                       a->prefix, key, va, b->prefix, key, vb);
    *out = fa ? va : fb ? vb : def;
    return CM_OK;
}

static cm_status cfg_int_either(const cfg_obj *a, const cfg_obj *b, const char *key, int *out, int *found) {
    int va = 0, vb = 0, fa, fb;
    CM_TRY(cm_cfg_int_opt(a, key, &va, &fa));
    CM_TRY(cm_cfg_int_opt(b, key, &vb, &fb));
    if (fa && fb && va != vb)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': '%s%s' (%d) and '%s%s' (%d) disagree; keep one", a->origin,
                       a->prefix, key, va, b->prefix, key, vb);
    *found = fa || fb;
    if (*found)
        *out = fa ? va : vb;
    return CM_OK;
}

/* Only plain RoPE is implemented: a rope_type/type other than "default" (yarn, linear,
 * dynamic, ...) would change the math, so it is refused rather than ignored. */
static cm_status cfg_rope_type(const cfg_obj *rope) {
    static const char *keys[] = {"rope_type", "type"};
    for (int i = 0; i < 2; i++) {
        const cJSON *it = cm_cfg_item(rope, keys[i]);
        if (!it)
            continue;
        if (!cJSON_IsString(it))
            return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%s%s' must be a string, found %s", rope->origin,
                           rope->prefix, keys[i], cm_cfg_json_kind(it));
        if (strcmp(it->valuestring, "default") != 0)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "'%s': %s%s '%s' is not supported (only 'default' RoPE)",
                           rope->origin, rope->prefix, keys[i], it->valuestring);
    }
    return CM_OK;
}

/* Head sizes: heads > 0, kv heads > 0 dividing heads, head_dim (default hidden/heads) > 0. */
static cm_status cfg_heads(const cfg_obj *o, int hidden, int *n_heads, int *n_kv, int *head_dim) {
    CM_TRY(cm_cfg_pos(o, "num_attention_heads", 1, 0, n_heads));
    CM_TRY(cm_cfg_pos(o, "num_key_value_heads", 0, *n_heads, n_kv));
    if (*n_heads % *n_kv != 0)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "'%s': %snum_attention_heads %d is not a multiple of %snum_key_value_heads %d (GQA groups "
            "must be whole)",
            o->origin, o->prefix, *n_heads, o->prefix, *n_kv);
    int found;
    CM_TRY(cm_cfg_int_opt(o, "head_dim", head_dim, &found));
    if (!found) {
        if (hidden % *n_heads != 0)
            return CM_FAIL(
                CM_ERR_FORMAT,
                "'%s': %shead_dim is absent and hidden_size %d is not a multiple of num_attention_heads "
                "%d; set head_dim",
                o->origin, o->prefix, hidden, *n_heads);
        *head_dim = hidden / *n_heads;
    }
    if (*head_dim <= 0)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%shead_dim' must be positive, found %d", o->origin,
                       o->prefix, *head_dim);
    return CM_OK;
}

/* layer_types: an array of n strings, each one of names[0..n_names) mapped to types[]. */
static cm_status cm_cfg_layer_types(const cfg_obj *o, const cJSON *arr, int n, const char *const *names,
                                 const cm_layer_type *types, int n_names, cm_layer_type *out) {
    if (!cJSON_IsArray(arr))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%slayer_types' must be an array of strings, found %s",
                       o->origin, o->prefix, cm_cfg_json_kind(arr));
    int len = cJSON_GetArraySize(arr);
    if (len != n)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': %slayer_types has %d entries but num_hidden_layers is %d; give one per layer",
                       o->origin, o->prefix, len, n);
    int          i = 0;
    const cJSON *it = NULL;
    cJSON_ArrayForEach(it, arr) {
        int k = n_names;
        if (cJSON_IsString(it))
            for (k = 0; k < n_names && strcmp(it->valuestring, names[k]) != 0; k++) {
            }
        if (k == n_names)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': %slayer_types[%d] is %s%s%s; expected '%s' or '%s'",
                           o->origin, o->prefix, i, cJSON_IsString(it) ? "'" : "",
                           cJSON_IsString(it) ? it->valuestring : cm_cfg_json_kind(it),
                           cJSON_IsString(it) ? "'" : "", names[0], names[1]);
        out[i++] = types[k];
    }
    return CM_OK;
}

#define CFG_SUPPORTED "qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next"

static cm_status cfg_model_type(const cfg_obj *o, const char **out) {
    const cJSON *it = cm_cfg_item(o, "model_type");
    if (!it)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': missing field '%smodel_type'; supported: " CFG_SUPPORTED, o->origin,
                       o->prefix);
    if (!cJSON_IsString(it))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%smodel_type' must be a string, found %s", o->origin,
                       o->prefix, cm_cfg_json_kind(it));
    *out = it->valuestring;
    return CM_OK;
}

/* The model types Tandem reads: the top-level type, the text model's type, the family, and
 * whether the text model is nested under text_config (the multimodal classes). */
static const struct {
    const char      *top, *text;
    cm_target_family family;
    int              nested;
} model_types[] = {
    {"qwen3_5", "qwen3_5_text", CM_TARGET_FAMILY_QWEN3_5, 1},
    {"qwen3_5_text", "qwen3_5_text", CM_TARGET_FAMILY_QWEN3_5, 0},
    {"qwen3_5_moe", "qwen3_5_moe_text", CM_TARGET_FAMILY_QWEN3_5_MOE, 1},
    {"qwen3_5_moe_text", "qwen3_5_moe_text", CM_TARGET_FAMILY_QWEN3_5_MOE, 0},
    {"qwen3_next", "qwen3_next", CM_TARGET_FAMILY_QWEN3_NEXT, 0},
};

// ----------------------------------------------------------------------------
// target

static cm_status target_fill(cm_target_cfg *cfg, const cfg_obj *root, const cfg_obj *tx) {
    const char *origin = tx->origin;
    CM_TRY(cm_cfg_pos(tx, "hidden_size", 1, 0, &cfg->hidden_size));
    CM_TRY(cm_cfg_pos(tx, "num_hidden_layers", 1, 0, &cfg->n_layers));
    if (cfg->n_layers > CM_CFG_MAX_LAYERS)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': %snum_hidden_layers %d exceeds the supported maximum %d", origin,
                       tx->prefix, cfg->n_layers, CM_CFG_MAX_LAYERS);
    if (cfg->family != CM_TARGET_FAMILY_QWEN3_5) CM_TRY(cm_cfg_moe_fill(cfg, tx));
    int dense = 0; /* the dense MLP's intermediate_size is needed only where a layer has one */
    for (int i = 0; i < cfg->n_layers; i++) dense |= !cm_target_layer_moe(cfg, i);
    CM_TRY(cm_cfg_pos(tx, "intermediate_size", dense, 0, &cfg->intermediate_size));
    CM_TRY(cm_cfg_pos(tx, "vocab_size", 1, 0, &cfg->vocab_size));
    CM_TRY(cfg_eps(tx, &cfg->rms_norm_eps));
    if (cm_cfg_item(tx, "tie_word_embeddings"))
        CM_TRY(cm_cfg_bool(tx, "tie_word_embeddings", 0, &cfg->tie_word_embeddings));
    else
        CM_TRY(cm_cfg_bool(root, "tie_word_embeddings", 0, &cfg->tie_word_embeddings));

    // layer pattern: explicit list, else every interval-th layer is full attention
    static const char *const   names[] = {"linear_attention", "full_attention"};
    static const cm_layer_type types[] = {CM_LAYER_TYPE_LINEAR_ATTENTION, CM_LAYER_TYPE_FULL_ATTENTION};
    const cJSON               *lt = cm_cfg_item(tx, "layer_types");
    if (lt) {
        CM_TRY(cm_cfg_layer_types(tx, lt, cfg->n_layers, names, types, 2, cfg->layer_types));
    } else {
        int interval;
        CM_TRY(cm_cfg_pos(tx, "full_attention_interval", 0, 4, &interval));
        for (int i = 0; i < cfg->n_layers; i++)
            cfg->layer_types[i] =
                (i + 1) % interval == 0 ? CM_LAYER_TYPE_FULL_ATTENTION : CM_LAYER_TYPE_LINEAR_ATTENTION;
    }
    int has_linear = 0;
    for (int i = 0; i < cfg->n_layers; i++)
        has_linear |= cfg->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION;

    // gated attention
    CM_TRY(cfg_heads(tx, cfg->hidden_size, &cfg->n_heads, &cfg->n_kv_heads, &cfg->head_dim));
    CM_TRY(cm_cfg_bool(tx, "attn_output_gate", 1, &cfg->attn_output_gate));

    // rope: transformers 5 keeps rope_parameters; older configs keep the keys at the top level
    char    rp_prefix[64], rs_prefix[64];
    cfg_obj rp, rs;
    CM_TRY(cm_cfg_sub(tx, "rope_parameters", rp_prefix, sizeof rp_prefix, &rp));
    CM_TRY(cm_cfg_sub(tx, "rope_scaling", rs_prefix, sizeof rs_prefix, &rs));
    CM_TRY(cfg_rope_type(&rp));
    CM_TRY(cfg_rope_type(&rs));
    double factor;
    CM_TRY(cfg_double_either(&rp, tx, "rope_theta", 10000.0, &cfg->rope_theta));
    CM_TRY(cfg_double_either(&rp, tx, "partial_rotary_factor", 0.25, &factor)); /* Transformers' default */
    if (!(cfg->rope_theta > 0))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': rope_theta must be positive, found %g", origin, cfg->rope_theta);
    if (!(factor > 0 && factor <= 1))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': partial_rotary_factor must be in (0, 1], found %g", origin,
                       factor);
    double rd = cfg->head_dim * factor;
    if (fabs(rd - nearbyint(rd)) > 1e-6 || (int)nearbyint(rd) % 2 != 0)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "'%s': head_dim %d × partial_rotary_factor %g = %g is not an even integer (RoPE rotates "
            "dimension pairs)",
            origin, cfg->head_dim, factor, rd);
    cfg->rotary_dim = (int)nearbyint(rd);
    if (cfg->rotary_dim < 2)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': head_dim %d × partial_rotary_factor %g rotates no dimensions",
                       origin, cfg->head_dim, factor);

    // gated deltanet (required when any layer uses it)
    CM_TRY(cm_cfg_pos(tx, "linear_num_key_heads", has_linear, 0, &cfg->lin_n_k_heads));
    CM_TRY(cm_cfg_pos(tx, "linear_num_value_heads", has_linear, 0, &cfg->lin_n_v_heads));
    CM_TRY(cm_cfg_pos(tx, "linear_key_head_dim", has_linear, 0, &cfg->lin_k_head_dim));
    CM_TRY(cm_cfg_pos(tx, "linear_value_head_dim", has_linear, 0, &cfg->lin_v_head_dim));
    CM_TRY(cm_cfg_pos(tx, "linear_conv_kernel_dim", has_linear, 0, &cfg->lin_conv_kernel));
    if (cfg->lin_n_k_heads > 0 && cfg->lin_n_v_heads % cfg->lin_n_k_heads != 0)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "'%s': %slinear_num_value_heads %d must be a positive multiple of linear_num_key_heads %d",
            origin, tx->prefix, cfg->lin_n_v_heads, cfg->lin_n_k_heads);
    if ((cfg->lin_n_k_heads > 0) != (cfg->lin_n_v_heads > 0))
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': %slinear_num_key_heads and linear_num_value_heads must be set together", origin,
                       tx->prefix);
    return CM_OK;
}

cm_status cm_target_cfg_parse(cm_target_cfg *cfg, const char *json, const char *origin) {
    memset(cfg, 0, sizeof *cfg);
    if (!origin)
        origin = "config.json";
    cJSON    *root = NULL;
    cm_status st = CM_OK;
    CM_TRY(cm_cfg_parse_object(json, origin, &root));
    cfg_obj     top = {origin, root, ""};
    cfg_obj     tx = top;
    char        tx_prefix[32];
    const char *mt = NULL, *text_mt = NULL;
    CM_TRY_GOTO(cfg_model_type(&top, &mt), st, fail);
    size_t k = 0, n_types = sizeof model_types / sizeof model_types[0];
    while (k < n_types && strcmp(mt, model_types[k].top) != 0) k++;
    if (k == n_types) {
        st = CM_FAIL(CM_ERR_UNSUPPORTED, "'%s': unknown model_type '%s'; supported: " CFG_SUPPORTED, origin, mt);
        goto fail;
    }
    text_mt = model_types[k].text;
    if (model_types[k].nested) {
        CM_TRY_GOTO(cm_cfg_sub(&top, "text_config", tx_prefix, sizeof tx_prefix, &tx), st, fail);
        if (!tx.obj) {
            st = CM_FAIL(CM_ERR_FORMAT, "'%s': model_type '%s' needs a 'text_config' object with the text model",
                         origin, mt);
            goto fail;
        }
        if (cm_cfg_item(&tx, "model_type")) {
            const char *got;
            CM_TRY_GOTO(cfg_model_type(&tx, &got), st, fail);
            if (strcmp(got, text_mt) != 0) {
                st = CM_FAIL(CM_ERR_UNSUPPORTED, "'%s': text_config.model_type '%s' does not go with model_type "
                             "'%s'; expected '%s'", origin, got, mt, text_mt);
                goto fail;
            }
        }
        cfg->nested = 1;
    }
    cfg->family = model_types[k].family;
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", text_mt);
    CM_TRY_GOTO(target_fill(cfg, &top, &tx), st, fail);
    cJSON_Delete(root);
    return CM_OK;
fail:
    cJSON_Delete(root);
    return st;
}

// ----------------------------------------------------------------------------
// drafter

/* build_target_layer_ids (docs/drafter.md, taps): Ld taps spread evenly over layers
 * [1, Lt − 3], rounded half to even like Python's round(). */
static void default_taps(int n_target_layers, int n_taps, int *ids) {
    if (n_taps == 1) {
        ids[0] = n_target_layers / 2;
        return;
    }
    double start = 1, span = (double)(n_target_layers - 3) - start;
    for (int i = 0; i < n_taps; i++)
        ids[i] = (int)nearbyint(start + i * span / (n_taps - 1));
}

static cm_status drafter_architectures(const cfg_obj *o, cm_drafter_kind *kind) {
    const cJSON *arch = cm_cfg_item(o, "architectures");
    if (!arch)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': missing field 'architectures'; a DFlash drafter config lists "
                       "\"DFlashDraftModel\" (or \"DFlash2DraftModel\")",
                       o->origin);
    if (!cJSON_IsArray(arch))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field 'architectures' must be an array of strings, found %s",
                       o->origin, cm_cfg_json_kind(arch));
    const cJSON *it = NULL;
    const char  *first = NULL;
    cJSON_ArrayForEach(it, arch) {
        if (!cJSON_IsString(it))
            continue;
        if (strcmp(it->valuestring, "DFlashDraftModel") == 0 || strcmp(it->valuestring, "DFlash2DraftModel") == 0) {
            *kind = it->valuestring[6] == '2' ? CM_DRAFTER_DFLASH2 : CM_DRAFTER_DFLASH;
            return CM_OK;
        }
        if (!first)
            first = it->valuestring;
    }
    return CM_FAIL(CM_ERR_UNSUPPORTED,
                   "'%s': architectures has no \"DFlashDraftModel\" or \"DFlash2DraftModel\" (found '%s'); "
                   "not a DFlash drafter config",
                   o->origin, first ? first : "");
}

static cm_status drafter_taps(cm_drafter_cfg *cfg, const cfg_obj *dc) {
    const cJSON *arr = cm_cfg_item(dc, "target_layer_ids");
    int          derived = arr == NULL;
    if (derived) {
        if (cfg->n_layers > CM_CFG_MAX_TAPS)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': set dflash_config.target_layer_ids (%d layers is more than %d taps)",
                           dc->origin, cfg->n_layers, CM_CFG_MAX_TAPS);
        cfg->n_taps = cfg->n_layers;
        default_taps(cfg->num_target_layers, cfg->n_taps, cfg->target_layer_ids);
    } else {
        if (!cJSON_IsArray(arr))
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': field 'dflash_config.target_layer_ids' must be an array of integers, "
                           "found %s",
                           dc->origin, cm_cfg_json_kind(arr));
        int n = cJSON_GetArraySize(arr);
        if (n < 1 || n > CM_CFG_MAX_TAPS)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': dflash_config.target_layer_ids has %d entries; expected 1 to %d",
                           dc->origin, n, CM_CFG_MAX_TAPS);
        int          i = 0;
        const cJSON *it = NULL;
        cJSON_ArrayForEach(it, arr) {
            double d = cJSON_IsNumber(it) ? it->valuedouble : NAN;
            if (!(d == floor(d) && fabs(d) < 1e9))
                return CM_FAIL(CM_ERR_FORMAT,
                               "'%s': dflash_config.target_layer_ids[%d] must be an integer, found %s",
                               dc->origin, i, cm_cfg_json_kind(it));
            cfg->target_layer_ids[i++] = (int)d;
        }
        cfg->n_taps = n;
    }
    for (int i = 0; i < cfg->n_taps; i++) {
        int id = cfg->target_layer_ids[i];
        if (id < 0 || id >= cfg->num_target_layers)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': %s target layer id %d (tap %d) is outside [0, num_target_layers = %d)%s",
                           dc->origin, derived ? "derived" : "dflash_config.target_layer_ids:", id, i,
                           cfg->num_target_layers, derived ? "; set dflash_config.target_layer_ids" : "");
    }
    /* each tap is one layer's hidden state: a repeat would ask the server for a layer twice
     * (refused mid-run) and, from shards, train on a duplicated feature block */
    for (int i = 1; i < cfg->n_taps; i++)
        for (int j = 0; j < i; j++)
            if (cfg->target_layer_ids[i] == cfg->target_layer_ids[j])
                return CM_FAIL(CM_ERR_FORMAT,
                               "'%s': %s target layer id %d appears twice (taps %d and %d); each tap must be "
                               "a different layer%s",
                               dc->origin, derived ? "derived" : "dflash_config.target_layer_ids:",
                               cfg->target_layer_ids[i], j, i,
                               derived ? "; set dflash_config.target_layer_ids" : "");
    return CM_OK;
}

/* DFlash2's four dflash_config keys (z-lab's loader needs every one; the top level is accepted too),
 * each checked against the shapes it must fit. */
static cm_status drafter2_fields(cm_drafter_cfg *cfg, const cfg_obj *top, const cfg_obj *dc) {
    static const char *const keys[4] = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"};
    int *const               out[4] = {&cfg->conv_kernel_size, &cfg->conv_group_size, &cfg->selector_rank,
                                       &cfg->selector_top_k};
    const char              *origin = top->origin;
    for (int i = 0; i < 4; i++) {
        int found;
        CM_TRY(cfg_int_either(dc, top, keys[i], out[i], &found));
        if (!found)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': missing field 'dflash_config.%s'; a DFlash2DraftModel config needs "
                           "conv_kernel_size, conv_group_size, selector_rank and selector_top_k",
                           origin, keys[i]);
        if (*out[i] < 1)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': dflash_config.%s must be at least 1, found %d", origin, keys[i],
                           *out[i]);
    }
    if (cfg->conv_kernel_size > cfg->block_size)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': dflash_config.conv_kernel_size %d is above block_size %d (a tap cannot reach "
                       "past its block)",
                       origin, cfg->conv_kernel_size, cfg->block_size);
    if (cfg->hidden_size % cfg->conv_group_size != 0)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': dflash_config.conv_group_size %d does not divide hidden_size %d",
                       origin, cfg->conv_group_size, cfg->hidden_size);
    if (cfg->selector_top_k > cfg->vocab_size)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': dflash_config.selector_top_k %d is above vocab_size %d", origin,
                       cfg->selector_top_k, cfg->vocab_size);
    return CM_OK;
}

static cm_status drafter_fill(cm_drafter_cfg *cfg, const cfg_obj *top) {
    const char *origin = top->origin;
    CM_TRY(drafter_architectures(top, &cfg->kind));
    char    dc_prefix[32], rp_prefix[32], rs_prefix[32];
    cfg_obj dc, rp, rs;
    CM_TRY(cm_cfg_sub(top, "dflash_config", dc_prefix, sizeof dc_prefix, &dc));
    CM_TRY(cm_cfg_sub(top, "rope_parameters", rp_prefix, sizeof rp_prefix, &rp));
    CM_TRY(cm_cfg_sub(top, "rope_scaling", rs_prefix, sizeof rs_prefix, &rs));

    CM_TRY(cm_cfg_pos(top, "hidden_size", 1, 0, &cfg->hidden_size));
    CM_TRY(cm_cfg_pos(top, "num_hidden_layers", 1, 0, &cfg->n_layers));
    if (cfg->n_layers > CM_CFG_MAX_LAYERS)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': num_hidden_layers %d exceeds the supported maximum %d", origin,
                       cfg->n_layers, CM_CFG_MAX_LAYERS);
    CM_TRY(cm_cfg_pos(top, "intermediate_size", 1, 0, &cfg->intermediate_size));
    CM_TRY(cm_cfg_pos(top, "vocab_size", 1, 0, &cfg->vocab_size));
    CM_TRY(cfg_heads(top, cfg->hidden_size, &cfg->n_heads, &cfg->n_kv_heads, &cfg->head_dim));
    CM_TRY(cfg_eps(top, &cfg->rms_norm_eps));
    CM_TRY(cfg_rope_type(&rp));
    CM_TRY(cfg_rope_type(&rs));
    CM_TRY(cfg_double_either(top, &rp, "rope_theta", 10000.0, &cfg->rope_theta));
    if (!(cfg->rope_theta > 0))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': rope_theta must be positive, found %g", origin, cfg->rope_theta);
    CM_TRY(cm_cfg_pos(top, "max_position_embeddings", 0, 32768, &cfg->max_position_embeddings));
    CM_TRY(cm_cfg_bool(top, "tie_word_embeddings", 0, &cfg->tie_word_embeddings));
    CM_TRY(cm_cfg_bool(top, "attention_bias", 0, &cfg->attention_bias));

    // layer types: full or sliding (window W); causal within the block: is_causal, else sliding
    static const char *const   names[] = {"full_attention", "sliding_attention"};
    static const cm_layer_type types[] = {CM_LAYER_TYPE_FULL_ATTENTION, CM_LAYER_TYPE_SLIDING_ATTENTION};
    const cJSON               *lt = cm_cfg_item(top, "layer_types");
    for (int i = 0; i < cfg->n_layers; i++)
        cfg->layer_types[i] = CM_LAYER_TYPE_FULL_ATTENTION;
    if (lt)
        CM_TRY(cm_cfg_layer_types(top, lt, cfg->n_layers, names, types, 2, cfg->layer_types));
    int window = 0, found;
    CM_TRY(cm_cfg_int_opt(top, "sliding_window", &window, &found));
    for (int i = 0; i < cfg->n_layers; i++) {
        if (cfg->layer_types[i] != CM_LAYER_TYPE_SLIDING_ATTENTION)
            continue;
        if (!found)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': layer_types[%d] is 'sliding_attention' but sliding_window is not set; "
                           "set sliding_window > 0",
                           origin, i);
        if (window <= 0)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s': layer_types[%d] is 'sliding_attention' but sliding_window is %d; "
                           "set sliding_window > 0",
                           origin, i, window);
        cfg->sliding_window = window;
    }
    int causal;
    CM_TRY(cm_cfg_bool(top, "is_causal", -1, &causal));
    cfg->is_causal = causal < 0 ? CM_CAUSAL_BY_LAYER_TYPE : causal ? CM_CAUSAL_ALL : CM_CAUSAL_NONE;

    // DFlash fields
    CM_TRY(cfg_int_either(top, &dc, "block_size", &cfg->block_size, &found));
    if (!found)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': missing field 'block_size' (top level or in dflash_config)",
                       origin);
    if (cfg->block_size < 2)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': block_size %d must be at least 2 (slot 0 holds the anchor token)", origin,
                       cfg->block_size);
    CM_TRY(cfg_int_either(&dc, top, "mask_token_id", &cfg->mask_token_id, &found));
    if (!found)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': missing field 'dflash_config.mask_token_id' (the target token id of "
                       "<|MASK|>)",
                       origin);
    if (cfg->mask_token_id < 0 || cfg->mask_token_id >= cfg->vocab_size)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': dflash_config.mask_token_id %d is outside the vocabulary [0, %d)", origin,
                       cfg->mask_token_id, cfg->vocab_size);
    const cJSON *mt = cm_cfg_item(&dc, "mask_token");
    if (mt) {
        if (!cJSON_IsString(mt) || !mt->valuestring[0] || strlen(mt->valuestring) >= sizeof cfg->mask_token)
            return CM_FAIL(CM_ERR_FORMAT, "'%s': dflash_config.mask_token must be a string of 1 to %d bytes", origin,
                           (int)sizeof cfg->mask_token - 1);
        snprintf(cfg->mask_token, sizeof cfg->mask_token, "%s", mt->valuestring);
    }
    CM_TRY(cfg_int_either(top, &dc, "num_target_layers", &cfg->num_target_layers, &found));
    if (!found)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': missing field 'num_target_layers' (top level or in dflash_config)", origin);
    if (cfg->num_target_layers <= 0)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': num_target_layers must be positive, found %d", origin,
                       cfg->num_target_layers);
    CM_TRY(drafter_taps(cfg, &dc));
    return cfg->kind == CM_DRAFTER_DFLASH2 ? drafter2_fields(cfg, top, &dc) : CM_OK;
}

cm_status cm_drafter_cfg_parse(cm_drafter_cfg *cfg, const char *json, const char *origin) {
    memset(cfg, 0, sizeof *cfg);
    if (!origin)
        origin = "config.json";
    cJSON *root = NULL;
    CM_TRY(cm_cfg_parse_object(json, origin, &root));
    cfg_obj   top = {origin, root, ""};
    cm_status st = drafter_fill(cfg, &top);
    cJSON_Delete(root);
    return st;
}

// ----------------------------------------------------------------------------
// loading from a path

/* Reads the config at path (a file, or a directory's config.json) and parses it as the
 * drafter's (drafter = 1) or the target's. cfg is zeroed first, so a failed read leaves it 0. */
static cm_status cfg_load(void *cfg, int drafter, const char *path) {
    char *text = NULL;
    char  file[4096];
    memset(cfg, 0, drafter ? sizeof(cm_drafter_cfg) : sizeof(cm_target_cfg));
    CM_TRY(cm_cfg_read_path(path, &text, file, sizeof file));
    cm_status st = drafter ? cm_drafter_cfg_parse(cfg, text, file) : cm_target_cfg_parse(cfg, text, file);
    free(text);
    return st;
}

cm_status cm_target_cfg_load(cm_target_cfg *cfg, const char *path) {
    return cfg_load(cfg, 0, path);
}

cm_status cm_drafter_cfg_load(cm_drafter_cfg *cfg, const char *path) {
    return cfg_load(cfg, 1, path);
}
