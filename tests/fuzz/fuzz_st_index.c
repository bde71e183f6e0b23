/* tests/fuzz/fuzz_st_index.c — libFuzzer target: a sharded model directory as cm_st_open_dir
 * reads it. The input is model.safetensors.index.json, then up to seven shard files, separated by
 * FUZZ_SPLIT; the shards are named a, b, c, ... in order (the seeds' weight_maps use those
 * names). For a directory that opens: every tensor of the map is found by name and read. */
#include <string.h>

#include "cm_safetensors.h"
#include "fuzz_util.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    fuzz_dir();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_part parts[FUZZ_MAX_PARTS];
    int       n = fuzz_split(data, size, parts, FUZZ_MAX_PARTS);
    char      path[512];
    fuzz_dir_clear(fuzz_dir());
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", fuzz_dir());
    fuzz_write(path, parts[0].data, parts[0].len);
    for (int i = 1; i < n; i++) {
        snprintf(path, sizeof path, "%s/%c", fuzz_dir(), 'a' + i - 1);
        fuzz_write(path, parts[i].data, parts[i].len);
    }
    cm_st *st = NULL;
    if (fuzz_note(cm_st_open_dir(&st, fuzz_dir())) != CM_OK)
        return 0;
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        FUZZ_CHECK(cm_st_find(st, t->name) != NULL && strcmp(cm_st_find(st, t->name)->name, t->name) == 0);
        uint8_t acc = 0;
        for (size_t k = 0; k < t->nbytes; k++)
            acc ^= ((const uint8_t *)t->data)[k];
        (void)acc;
    }
    cm_st_metadata(st, "format");
    cm_st_destroy(&st);
    return 0;
}
