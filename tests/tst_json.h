/* tests/tst_json.h — config.json trees for the config tests: read one, edit a member by its dotted
 * path, parse the result as a target config. Header-only; exits 1 on what a test cannot go on from. */
#ifndef TST_JSON_H
#define TST_JSON_H

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_cfg.h"

static inline cJSON *tst_json_load(const char *path) {
    char *text = NULL;
    if (cm_read_text_file(path, 1 << 20, &text) != CM_OK) {
        fprintf(stderr, "%s\n", cm_last_error());
        exit(1);
    }
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) exit(1);
    return j;
}

/* Sets the member at a dotted path ("text_config.rope_parameters.rope_theta") to the JSON
 * value text, or deletes it when value is NULL. Returns the edited root for chaining. */
static inline cJSON *tst_json_edit(cJSON *root, const char *path, const char *value) {
    char   buf[256];
    cJSON *obj = root;
    snprintf(buf, sizeof buf, "%s", path);
    char *key = buf, *dot;
    while ((dot = strchr(key, '.')) != NULL) {
        *dot = '\0';
        obj  = cJSON_GetObjectItemCaseSensitive(obj, key);
        if (!obj) {
            fprintf(stderr, "edit: no object on the path '%s'\n", path);
            exit(1);
        }
        key = dot + 1;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        if (!v) exit(1);
        cJSON_AddItemToObject(obj, key, v);
    }
    return root;
}

/* Parses an (edited) tree as a target config named origin in messages, and frees it. */
static inline cm_status tst_json_target(cJSON *j, cm_target_cfg *cfg, const char *origin) {
    char     *text = cJSON_PrintUnformatted(j);
    cm_status st   = cm_target_cfg_parse(cfg, text, origin);
    free(text);
    cJSON_Delete(j);
    return st;
}

#endif /* TST_JSON_H */
