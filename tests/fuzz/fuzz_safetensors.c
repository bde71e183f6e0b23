/* tests/fuzz/fuzz_safetensors.c — libFuzzer target: one .safetensors file (the whole input),
 * opened with cm_st_open_file as target-server and drafter-trainer open model weights and batch
 * files. For a file that opens: every tensor is found by name, its bytes are read, float tensors
 * convert with cm_st_read, no two tensors' bytes overlap, and the set round-trips through the writer (same names, dtypes,
 * shapes and bytes after reopening). */
#include <string.h>

#include "cm_safetensors.h"
#include "fuzz_util.h"

static char in_path[300], out_path[300];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    snprintf(in_path, sizeof in_path, "%s/in.safetensors", fuzz_dir());
    snprintf(out_path, sizeof out_path, "%s/out.safetensors", fuzz_dir());
    return 0;
}

static void check_roundtrip(const cm_st *st) {
    cm_st_writer *w = NULL;
    FUZZ_CHECK(cm_st_writer_create(&w) == CM_OK);
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        FUZZ_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
    }
    const char *fmt = cm_st_metadata(st, "format");
    if (fmt)
        FUZZ_CHECK(cm_st_writer_set_metadata(w, "format", fmt) == CM_OK);
    FUZZ_CHECK(cm_st_writer_write(w, out_path) == CM_OK);
    cm_st_writer_destroy(&w);
    cm_st *back = NULL;
    if (cm_st_open_file(&back, out_path) != CM_OK) {
        fprintf(stderr, "reopening the written copy failed: %s\n", cm_last_error());
        FUZZ_CHECK(0);
    }
    FUZZ_CHECK(cm_st_count(back) == cm_st_count(st));
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *a = cm_st_at(st, i), *b = cm_st_find(back, a->name);
        FUZZ_CHECK(b != NULL);
        FUZZ_CHECK(a->dtype == b->dtype && a->n_dims == b->n_dims && a->nbytes == b->nbytes);
        FUZZ_CHECK(memcmp(a->shape, b->shape, (size_t)a->n_dims * sizeof a->shape[0]) == 0);
        FUZZ_CHECK(a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0);
    }
    if (fmt)
        FUZZ_CHECK(cm_st_metadata(back, "format") && strcmp(cm_st_metadata(back, "format"), fmt) == 0);
    cm_st_destroy(&back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write(in_path, data, size);
    cm_st *st = NULL;
    if (fuzz_note(cm_st_open_file(&st, in_path)) != CM_OK)
        return 0;
    static float dst[1 << 16];
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        FUZZ_CHECK(cm_st_find(st, t->name) != NULL && strcmp(cm_st_find(st, t->name)->name, t->name) == 0);
        uint8_t acc = 0; /* touch every byte the header claims */
        for (size_t k = 0; k < t->nbytes; k++)
            acc ^= ((const uint8_t *)t->data)[k];
        (void)acc;
        if (cm_dtype_is_float(t->dtype) && t->nbytes / cm_dtype_size(t->dtype) <= sizeof dst / sizeof dst[0])
            FUZZ_CHECK(cm_st_read(st, t->name, t->n_dims, t->shape, dst, CM_DTYPE_F32) == CM_OK);
        for (int j = 0; j < i && t->nbytes; j++) { /* no two tensors share a byte */
            const cm_st_tensor *u = cm_st_at(st, j);
            const uint8_t      *a = t->data, *b = u->data;
            FUZZ_CHECK(!u->nbytes || a + t->nbytes <= b || b + u->nbytes <= a);
        }
    }
    check_roundtrip(st);
    cm_st_destroy(&st);
    return 0;
}
