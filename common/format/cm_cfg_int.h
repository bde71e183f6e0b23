/* common/format/cm_cfg_int.h — what the config.json readers share (private to common/format:
 * cm_cfg.c defines these, cm_quant.c and cm_cfg_moe.c use them): reading a config file, parsing it into a cJSON
 * object, and typed field access that names the file and the dotted field in messages. */
#ifndef CM_CFG_INT_H
#define CM_CFG_INT_H

#include <cJSON.h>
#include <stddef.h>

#include "cm_status.h"

/* One JSON object plus the dotted prefix that names it in messages. */
typedef struct cfg_obj {
    const char  *origin; /* the file, for messages */
    const cJSON *obj;    /* NULL: an absent optional object (every field absent) */
    const char  *prefix; /* "" or "text_config." or "dflash_config." ... */
} cfg_obj;

/* DIR → DIR/config.json (a file path is used as is) into a malloc'd text (caller frees); file
 * [file_len] receives the path read. */
cm_status cm_cfg_read_path(const char *path, char **text, char *file, size_t file_len);
/* Parses json into *root (caller deletes with cJSON_Delete); CM_ERR_FORMAT for malformed JSON
 * or a top level that is not an object, naming origin. */
cm_status cm_cfg_parse_object(const char *json, const char *origin, cJSON **root);
/* The member, or NULL if absent or JSON null (null means "unset" in HF configs). */
const cJSON *cm_cfg_item(const cfg_obj *o, const char *key);
/* "a boolean", "a number", ... for messages. */
const char *cm_cfg_json_kind(const cJSON *it);
/* A boolean field into *out (absent: def); anything else fails naming the field. */
cm_status cm_cfg_bool(const cfg_obj *o, const char *key, int def, int *out);
/* A nested object (absent or null gives one with obj = NULL); prefix [prefix_len] holds its
 * dotted name for the sub-object's messages. */
cm_status cm_cfg_sub(const cfg_obj *o, const char *key, char *prefix, size_t prefix_len, cfg_obj *sub);

/* An integer field into *out, *found set (absent leaves *out); non-integers fail naming it. */
cm_status cm_cfg_int_opt(const cfg_obj *o, const char *key, int *out, int *found);
/* An integer field, > 0. required: absent fails; else absent leaves *out = def. */
cm_status cm_cfg_pos(const cfg_obj *o, const char *key, int required, int def, int *out);

struct cm_target_cfg;
/* cm_cfg_moe.c: the mixture-of-experts fields of a qwen3_5_moe or qwen3_next text config into
 * cfg (family and n_layers already set): experts, top-k, sizes, the router's renormalisation and
 * which layers are sparse. */
cm_status cm_cfg_moe_fill(struct cm_target_cfg *cfg, const cfg_obj *tx);

#endif /* CM_CFG_INT_H */
