/* common/format/cm_tokenizer.c — one lookup in a Hugging Face tokenizer.json: the string of a token id,
 * from its added tokens (where special tokens such as a mask token live) or else its model vocabulary.
 * The drafter's checkpoint writes its mask token's string with it, so that a serving loader does not
 * fall back to a default name. Reads the whole file once per call; no state. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <cJSON.h>
#include <stdlib.h>
#include "cm_cfg.h"
#include "cm_status.h"

#define TOKENIZER_MAX_BYTES ((size_t)256 << 20)

static void copy_token(char *out, size_t cap, const char *s, int *found) {
    if (strlen(s) >= cap)
        return; /* longer than a config field holds: treated as unknown */
    snprintf(out, cap, "%s", s);
    *found = 1;
}

cm_status cm_tokenizer_token(const char *model_dir, int id, char *out, size_t cap, int *found) {
    char        path[4096];
    struct stat sb;
    *found = 0;
    if (cap)
        out[0] = '\0';
    if (snprintf(path, sizeof path, "%s/tokenizer.json", model_dir) >= (int)sizeof path)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path too long: '%s'", model_dir);
    if (stat(path, &sb) != 0)
        return errno == ENOENT ? CM_OK : CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    char *text = NULL;
    CM_TRY(cm_read_text_file(path, TOKENIZER_MAX_BYTES, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': malformed JSON", path);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), *it;
    cJSON_ArrayForEach(it, added) {
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(it, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (cJSON_IsNumber(tid) && tid->valuedouble == id && cJSON_IsString(content)) {
            copy_token(out, cap, content->valuestring, found);
            break;
        }
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!*found && cJSON_IsObject(vocab))
        cJSON_ArrayForEach(it, vocab) {
            if (cJSON_IsNumber(it) && it->valuedouble == id && it->string) {
                copy_token(out, cap, it->string, found);
                break;
            }
        }
    cJSON_Delete(root);
    return CM_OK;
}
