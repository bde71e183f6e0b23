/* tests/test_cm_weights_id.c — the weights fingerprint (common/format/cm_weights_id.h): what changes
 * it (one byte of any text-model tensor, a name, a shape, a dtype) and what does not (thread
 * count, tensor order in the file, the shard split, the vision tower and MTP head), and the
 * cache beside the checkpoint: used only while the files are as it lists them and its own
 * checksum holds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_safetensors.h"
#include "cm_weights_id.h"
#include "tst.h"
#include "tst_proc.h"

#define BIG_N (9u << 20) /* F32 elements: 36 MiB, two 32 MiB chunks */

static char   tmp[256];
static float *big;

typedef struct spec {
    const char *name;
    cm_dtype    dt;
    int         nd;
    int64_t     shape[2];
} spec;

static const spec base[] = {
    {"model.language_model.embed_tokens.weight", CM_DTYPE_F32, 2, {16, 8}},
    {"model.language_model.layers.0.mlp.up_proj.weight", CM_DTYPE_F32, 2, {3, 5}},
    {"model.language_model.layers.0.big", CM_DTYPE_F32, 1, {BIG_N}},
    {"model.visual.blocks.0.w", CM_DTYPE_F32, 1, {4}},
    {"mtp.fc.weight", CM_DTYPE_F32, 1, {2}},
};
enum { N_BASE = sizeof base / sizeof base[0] };

/* Tensor k's bytes (deterministic), with `flip` xor-ed into byte `at` of tensor `which`. */
static const void *data_of(int k, int which, size_t at, uint8_t flip) {
    static float small[N_BASE][128];
    float       *p = k == 2 ? big : small[k];
    size_t       n = k == 2 ? BIG_N : (size_t)(base[k].shape[0] * (base[k].nd > 1 ? base[k].shape[1] : 1));
    for (size_t i = 0; i < n; i++)
        p[i] = (float)((i * 2654435761u + (size_t)k * 97) % 1000) * 1e-3f;
    if (k == which)
        ((uint8_t *)p)[at] ^= flip;
    return p;
}

/* Writes tensors order[0..n) of spec s into path (a .safetensors file). */
static int write_file(const char *path, const spec *s, const int *order, int n, int which, size_t at,
                      uint8_t flip) {
    cm_st_writer *w = NULL;
    int           ok = cm_st_writer_create(&w) == CM_OK;
    for (int i = 0; ok && i < n; i++) {
        int k = order[i];
        ok = cm_st_writer_add(w, s[k].name, s[k].dt, s[k].nd, s[k].shape, data_of(k, which, at, flip)) ==
             CM_OK;
    }
    ok = ok && cm_st_writer_write(w, path) == CM_OK;
    cm_st_writer_destroy(&w);
    return ok;
}

/* A one-file model directory dir/NAME with tensors in `order`, one byte changed as data_of. */
static const char *model(const char *name, const spec *s, const int *order, int which, size_t at,
                         uint8_t flip) {
    static char dir[512];
    char        path[600];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    TST_CHECK(write_file(path, s, order, N_BASE, which, at, flip));
    return dir;
}

static uint64_t id_of(const char *dir, int threads, int flags, int *from_cache) {
    cm_st             *st = NULL;
    cm_weights_id_info wi = {0};
    if (!tst_ok(cm_st_open_dir(&st, dir), "open"))
        return 0;
    tst_ok(cm_weights_id_dir(st, dir, flags, threads, &wi), "fingerprint");
    cm_st_destroy(&st);
    if (from_cache)
        *from_cache = wi.from_cache;
    return wi.id;
}

static const int in_order[N_BASE] = {0, 1, 2, 3, 4};

static void test_what_counts(void) {
    static const int reversed[N_BASE] = {4, 3, 2, 1, 0};
    uint64_t         ref = id_of(model("ref", base, in_order, -1, 0, 0), 1, 0, NULL);
    TST_CHECK(ref != 0);
    TST_CHECK(id_of(model("ref", base, in_order, -1, 0, 0), 7, 0, NULL) == ref); /* threads */
    TST_CHECK(id_of(model("rev", base, reversed, -1, 0, 0), 3, 0, NULL) == ref); /* order in the file */
    /* one byte anywhere in a text-model tensor: the first, the last of the big one (second chunk) */
    TST_CHECK(id_of(model("b0", base, in_order, 1, 0, 1), 2, 0, NULL) != ref);
    TST_CHECK(id_of(model("b1", base, in_order, 2, (size_t)BIG_N * 4 - 1, 0x40), 2, 0, NULL) != ref);
    TST_CHECK(id_of(model("b2", base, in_order, 2, 12345, 0x01), 2, 0, NULL) != ref);
    /* the vision tower and the MTP head are not the target's forward */
    TST_CHECK(id_of(model("vis", base, in_order, 3, 2, 0x10), 2, 0, NULL) == ref);
    TST_CHECK(id_of(model("mtp", base, in_order, 4, 0, 0x10), 2, 0, NULL) == ref);
    /* name, shape and dtype with the same bytes */
    spec s[N_BASE];
    memcpy(s, base, sizeof s);
    s[1].name = "model.language_model.layers.0.mlp.down_proj.weight";
    TST_CHECK(id_of(model("name", s, in_order, -1, 0, 0), 2, 0, NULL) != ref);
    memcpy(s, base, sizeof s);
    s[1].shape[0] = 5, s[1].shape[1] = 3;
    TST_CHECK(id_of(model("shape", s, in_order, -1, 0, 0), 2, 0, NULL) != ref);
    memcpy(s, base, sizeof s);
    s[1].dt = CM_DTYPE_I32;
    TST_CHECK(id_of(model("dtype", s, in_order, -1, 0, 0), 2, 0, NULL) != ref);

    /* the same tensors in two shards with an index */
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/sharded", tmp);
    mkdir(dir, 0755);
    static const int a[] = {2, 4}, b[] = {0, 1, 3};
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    TST_CHECK(write_file(path, base, a, 2, -1, 0, 0));
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    TST_CHECK(write_file(path, base, b, 3, -1, 0, 0));
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"metadata\": {}, \"weight_map\": {");
    for (int k = 0; k < N_BASE; k++)
        fprintf(f, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", k ? ", " : "", base[k].name,
                k == 2 || k == 4 ? 1 : 2);
    fprintf(f, "}}\n");
    fclose(f);
    TST_CHECK(id_of(dir, 4, 0, NULL) == ref);
    printf(
        "fingerprint %016llx: same for 1/3/7 threads, file order and a 2-shard split; changed by one byte, a "
        "name, a shape, a dtype; not by model.visual.* or mtp.*\n",
        (unsigned long long)ref);
}

static void test_cache(void) {
    const int rw = CM_WEIGHTS_ID_READ_CACHE | CM_WEIGHTS_ID_WRITE_CACHE;
    char      dir[512], cache[600];
    snprintf(dir, sizeof dir, "%s", model("cached", base, in_order, -1, 0, 0));
    snprintf(cache, sizeof cache, "%s/%s", dir, CM_WEIGHTS_ID_CACHE);
    int      hit = -1;
    uint64_t ref = id_of(dir, 2, rw, &hit);
    TST_CHECK(hit == 0 && access(cache, R_OK) == 0);
    TST_CHECK(id_of(dir, 2, rw, &hit) == ref && hit == 1);
    TST_CHECK(id_of(dir, 2, 0, &hit) == ref && hit == 0); /* without READ the bytes are hashed */

    /* the checkpoint rewritten with one byte changed (same size, new time): the cache is stale */
    uint64_t changed = id_of(model("cached", base, in_order, 1, 3, 0x02), 2, rw, &hit);
    TST_CHECK(changed != ref && hit == 0);
    TST_CHECK(id_of(dir, 2, rw, &hit) == changed && hit == 1); /* and cached again */

    /* a cache whose text was edited (the id changed, the checksum not) is not believed */
    char text[4096];
    snprintf(text, sizeof text, "%s", tst_slurp(cache));
    char *idl = strstr(text, "\nid ");
    TST_CHECK(idl != NULL);
    if (idl)
        idl[4] = idl[4] == '0' ? '1' : '0';
    FILE *f = fopen(cache, "w");
    fputs(text, f);
    fclose(f);
    TST_CHECK(id_of(dir, 2, CM_WEIGHTS_ID_READ_CACHE, &hit) == changed && hit == 0);
    /* nor is a cache of other files (copied next to another checkpoint) */
    char other[512], oc[600];
    snprintf(other, sizeof other, "%s", model("other", base, in_order, 0, 0, 0x08));
    snprintf(oc, sizeof oc, "%s/%s", other, CM_WEIGHTS_ID_CACHE);
    TST_CHECK(id_of(dir, 2, rw, &hit) == changed); /* a good cache again in `dir` */
    snprintf(text, sizeof text, "%s", tst_slurp(cache));
    f = fopen(oc, "w");
    fputs(text, f);
    fclose(f);
    TST_CHECK(id_of(other, 2, CM_WEIGHTS_ID_READ_CACHE, &hit) != changed && hit == 0);
    printf("cache: used while sizes and times hold, stale after a rewrite, refused when edited or copied\n");
}

static void test_background(void) {
    const char        *dir = model("bg", base, in_order, -1, 0, 0);
    cm_weights_id_job *j = NULL;
    cm_weights_id_info wi = {0};
    TST_CHECK(tst_ok(cm_weights_id_start(&j, dir, 0, 3), "start"));
    TST_CHECK(tst_ok(cm_weights_id_finish(&j, &wi), "finish") && j == NULL);
    TST_CHECK(wi.id == id_of(dir, 1, 0, NULL) && wi.n_tensors == 3 &&
              wi.bytes == (16 * 8 + 15 + BIG_N) * 4ull);
    TST_CHECK(cm_weights_id_start(&j, "/nonexistent/model", 0, 0) != CM_OK && j == NULL);
    /* a checkpoint with nothing to fingerprint */
    char path[600];
    snprintf(path, sizeof path, "%s/vis-only", tmp);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/vis-only/model.safetensors", tmp);
    static const int vis[] = {3};
    TST_CHECK(write_file(path, base, vis, 1, -1, 0, 0));
    snprintf(path, sizeof path, "%s/vis-only", tmp);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_dir(&st, path) == CM_OK);
    TST_CHECK(cm_weights_id_compute(st, 1, &wi) == CM_ERR_INVALID_ARG &&
              strstr(cm_last_error(), "no text-model"));
    cm_st_destroy(&st);
}

int main(void) {
    snprintf(tmp, sizeof tmp, "/tmp/tandem-wid-%d", (int)getpid());
    mkdir(tmp, 0755);
    big = malloc(BIG_N * sizeof *big);
    test_what_counts();
    test_cache();
    test_background();
    free(big);
    tst_rmdir(tmp);
    return tst_report();
}
