/* tests/fuzz/fuzz_dataset.c — libFuzzer target: a tokenized dataset file (dt_dataset.h) read
 * with dt_docs_read and packed with dt_dataset_open, as `drafter-trainer train --dataset` does.
 * Input: one flag byte (bit 0: the binary .safetensors form, else JSONL; bits 1..7: the token
 * budget / 2, at least 1), then the file. For documents that read: offsets tile [0, total] with
 * no empty document, masks are 0/1, ids non-negative, the binary form written by dt_docs_write
 * reads back equal; for a dataset that opens, every pack is within the budget and its
 * cu_seqlens strictly increase from 0 to T. */
#include <string.h>

#include "dt_dataset.h"
#include "fuzz_util.h"

static char jsonl_path[300], bin_path[300], out_path[300];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    snprintf(jsonl_path, sizeof jsonl_path, "%s/in.jsonl", fuzz_dir());
    snprintf(bin_path, sizeof bin_path, "%s/in.safetensors", fuzz_dir());
    snprintf(out_path, sizeof out_path, "%s/out.safetensors", fuzz_dir());
    return 0;
}

static void check_docs(const dt_docs *d) {
    FUZZ_CHECK(d->n_docs >= 0 && d->total >= 0 && d->offsets[0] == 0 && d->offsets[d->n_docs] == d->total);
    for (int64_t i = 0; i < d->n_docs; i++)
        FUZZ_CHECK(d->offsets[i] < d->offsets[i + 1]);
    for (int64_t i = 0; i < d->total; i++)
        FUZZ_CHECK(d->ids[i] >= 0 && d->mask[i] <= 1);
    FUZZ_CHECK(dt_docs_write(d, out_path) == CM_OK);
    dt_docs back;
    FUZZ_CHECK(dt_docs_read(&back, out_path) == CM_OK);
    FUZZ_CHECK(back.n_docs == d->n_docs && back.total == d->total);
    FUZZ_CHECK(memcmp(back.offsets, d->offsets, sizeof(int64_t) * (size_t)(d->n_docs + 1)) == 0);
    FUZZ_CHECK(d->total == 0 || memcmp(back.ids, d->ids, sizeof(int32_t) * (size_t)d->total) == 0);
    FUZZ_CHECK(d->total == 0 || memcmp(back.mask, d->mask, (size_t)d->total) == 0);
    dt_docs_release(&back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    const char *path = data[0] & 1 ? bin_path : jsonl_path;
    int64_t     budget = 2 * (int64_t)(data[0] >> 1);
    if (budget < 2)
        budget = 2;
    fuzz_write(path, data + 1, size - 1);
    dt_docs d;
    if (fuzz_note(dt_docs_read(&d, path)) != CM_OK)
        return 0;
    check_docs(&d);
    dt_docs_release(&d);

    dt_dataset *ds = NULL;
    if (fuzz_note(dt_dataset_open(&ds, &path, 1, budget, INT32_MAX)) != CM_OK)
        return 0;
    static int32_t ids[256], cu[257], mask[256];
    for (int i = 0; i < dt_dataset_n_packs(ds); i++) {
        int64_t T;
        int     N;
        dt_dataset_pack_size(ds, i, &T, &N);
        FUZZ_CHECK(T >= 1 && T <= budget && N >= 1 && N <= T);
        dt_dataset_pack(ds, i, ids, cu, mask);
        FUZZ_CHECK(cu[0] == 0 && cu[N] == T);
        for (int k = 0; k < N; k++)
            FUZZ_CHECK(cu[k] < cu[k + 1]);
    }
    dt_dataset_hash(ds);
    dt_dataset_destroy(&ds);
    return 0;
}
