/* tests/test_cm_safetensors.c — the safetensors writer and reader: round trips over several
 * dtypes and shapes (bytes, order, metadata, alignment, contiguous data as the safetensors
 * library requires), conversion on read (also from an unaligned tensor), a sharded model
 * directory, and every kind of bad input, each of which must fail with a non-OK status and a
 * message naming the file and the problem. Files are written to a mkdtemp directory under
 * /tmp that is removed at the end. */
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_safetensors.h"
#include "tst.h"

static char tmpdir[64];

static const char *tmp_path(char *buf, const char *name) {
    snprintf(buf, 512, "%s/%s", tmpdir, name);
    return buf;
}

static void write_bytes(const char *path, const void *data, size_t len) {
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        perror(path);
        exit(1);
    }
    if (len && fwrite(data, 1, len, fp) != len)
        exit(1);
    fclose(fp);
}

/* A hand-made file: 8-byte length (n_field, or the header's length if UINT64_MAX), the header
 * text, then data_len bytes of the pattern i & 0xff. */
static void write_raw(const char *path, uint64_t n_field, const char *hdr, size_t data_len) {
    size_t   hlen = strlen(hdr);
    uint64_t n = n_field == UINT64_MAX ? hlen : n_field;
    size_t   len = 8 + hlen + data_len;
    uint8_t *buf = malloc(len);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(n >> (8 * i));
    memcpy(buf + 8, hdr, hlen);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + hlen + i] = (uint8_t)i;
    write_bytes(path, buf, len);
    free(buf);
}

/* Opens a raw file, which must fail with want and the words. */
#define TST_FILE_FAILS(path, want, ...)                                                                      \
    do {                                                                                                     \
        cm_st *st_ = NULL;                                                                                   \
        TST_FAILS(cm_st_open_file(&st_, (path)), (want), __VA_ARGS__);                                       \
        TST_CHECK(st_ == NULL);                                                                              \
    } while (0)

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

// ---- round trip

typedef struct spec {
    const char *name;
    cm_dtype    dt;
    int         n_dims;
    int64_t     shape[4];
} spec;

static const spec specs[] = {
    {"model.embed.weight", CM_DTYPE_BF16, 2, {3, 5}}, /* 30 bytes: not a multiple of 8 */
    {"a.f32", CM_DTYPE_F32, 2, {4, 3}},
    {"odd.u8", CM_DTYPE_U8, 1, {7}},
    {"b.f16", CM_DTYPE_F16, 3, {2, 3, 1}},
    {"c.f8", CM_DTYPE_F8_E4M3, 1, {5}},
    {"d.i64", CM_DTYPE_I64, 1, {3}},
    {"e.f64", CM_DTYPE_F64, 2, {2, 2}},
    {"f.i32", CM_DTYPE_I32, 1, {4}},
    {"scalar", CM_DTYPE_F32, 0, {0}},
    {"empty", CM_DTYPE_F32, 2, {0, 4}},
};
enum { N_SPECS = sizeof specs / sizeof specs[0] };

static size_t spec_bytes(const spec *s) {
    size_t n = cm_dtype_size(s->dt);
    for (int d = 0; d < s->n_dims; d++)
        n *= (size_t)s->shape[d];
    return n;
}

/* Deterministic contents: finite floats for float dtypes, a byte pattern otherwise. */
static void spec_fill(const spec *s, int seed, void *out) {
    size_t n = spec_bytes(s) / cm_dtype_size(s->dt);
    float *f = malloc((n ? n : 1) * sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = (float)((int)(i * 7 + seed) % 23 - 11) * 0.25f;
    if (cm_dtype_is_float(s->dt)) {
        TST_CHECK(cm_convert(out, s->dt, f, CM_DTYPE_F32, n) == CM_OK);
    } else {
        for (size_t i = 0; i < spec_bytes(s); i++)
            ((uint8_t *)out)[i] = (uint8_t)(i * 13 + seed);
    }
    free(f);
}

static int cmp_ptr(const void *a, const void *b) { /* by start, empty tensors first */
    const cm_st_tensor *ta = *(const cm_st_tensor *const *)a, *tb = *(const cm_st_tensor *const *)b;
    const uint8_t      *x = ta->data, *y = tb->data;
    if (x != y)
        return x < y ? -1 : 1;
    return (ta->nbytes > tb->nbytes) - (ta->nbytes < tb->nbytes);
}

static void test_round_trip(void) {
    char          path[512], tmp[600];
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    uint8_t data[N_SPECS][256];
    for (int i = 0; i < N_SPECS; i++) {
        spec_fill(&specs[i], i, data[i]);
        TST_CHECK(cm_st_writer_add(w, specs[i].name, specs[i].dt, specs[i].n_dims, specs[i].shape, data[i]) ==
                  CM_OK);
    }
    TST_CHECK(cm_st_writer_set_metadata(w, "format", "np") == CM_OK);
    TST_CHECK(cm_st_writer_set_metadata(w, "format", "pt") == CM_OK); /* replaces */
    TST_CHECK(cm_st_writer_set_metadata(w, "note", "a \"quoted\" value") == CM_OK);
    tmp_path(path, "rt.safetensors");
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    TST_CHECK(access(tmp, F_OK) != 0); /* renamed away */

    // the header length is a multiple of 8 and the header is padded with spaces
    FILE   *fp = fopen(path, "rb");
    uint8_t len8[8];
    TST_CHECK(fp && fread(len8, 1, 8, fp) == 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | len8[i];
    TST_CHECK(n % 8 == 0);
    fseek(fp, 0, SEEK_END);
    long file_size = ftell(fp);
    fclose(fp);

    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
    if (!st)
        return;
    TST_CHECK(cm_st_count(st) == N_SPECS);
    const cm_st_tensor *by_data[N_SPECS];
    for (int i = 0; i < N_SPECS; i++) {
        const cm_st_tensor *t = cm_st_at(st, i); /* header order = insertion order */
        TST_CHECK(t && strcmp(t->name, specs[i].name) == 0);
        TST_CHECK(cm_st_find(st, specs[i].name) == t);
        TST_CHECK(t->dtype == specs[i].dt && t->n_dims == specs[i].n_dims);
        for (int d = 0; d < specs[i].n_dims; d++)
            TST_CHECK(t->shape[d] == specs[i].shape[d]);
        TST_CHECK(t->nbytes == spec_bytes(&specs[i]));
        TST_CHECK(t->nbytes == 0 || memcmp(t->data, data[i], t->nbytes) == 0);
        TST_CHECK((uintptr_t)t->data % cm_dtype_size(t->dtype) == 0); /* natural alignment */
        TST_CHECK(strcmp(t->file, path) == 0);
        by_data[i] = t;
    }
    TST_CHECK(cm_st_at(st, N_SPECS) == NULL && cm_st_at(st, -1) == NULL);
    TST_CHECK(cm_st_find(st, "nope") == NULL);
    // data is contiguous and covers the data area exactly (the safetensors library requires it)
    qsort(by_data, N_SPECS, sizeof by_data[0], cmp_ptr);
    const uint8_t *area = (const uint8_t *)by_data[0]->data;
    size_t         off = 0;
    for (int i = 0; i < N_SPECS; i++) {
        TST_CHECK((const uint8_t *)by_data[i]->data == area + off);
        off += by_data[i]->nbytes;
    }
    TST_CHECK((long)(8 + n + off) == file_size);
    TST_CHECK(strcmp(cm_st_metadata(st, "format"), "pt") == 0);
    TST_CHECK(strcmp(cm_st_metadata(st, "note"), "a \"quoted\" value") == 0);
    TST_CHECK(cm_st_metadata(st, "nope") == NULL);

    // cm_st_read converts any float dtype into the destination's
    const int64_t sh35[] = {3, 5}, any2[] = {-1, -1}, sh43[] = {4, 3}, sh5[] = {5}, sh22[] = {2, 2};
    float         got[16];
    uint16_t      h[16];
    TST_CHECK(cm_st_read(st, "model.embed.weight", 2, sh35, got, CM_DTYPE_F32) == CM_OK);
    for (int i = 0; i < 15; i++)
        TST_CHECK(got[i] == cm_bf16_to_f32(((uint16_t *)data[0])[i]));
    TST_CHECK(cm_st_read(st, "model.embed.weight", 2, any2, got, CM_DTYPE_F32) == CM_OK);
    TST_CHECK(cm_st_read(st, "a.f32", 2, sh43, h, CM_DTYPE_BF16) == CM_OK);
    for (int i = 0; i < 12; i++)
        TST_CHECK(h[i] == cm_f32_to_bf16(((float *)data[1])[i]));
    TST_CHECK(cm_st_read(st, "c.f8", 1, sh5, got, CM_DTYPE_F32) == CM_OK);
    for (int i = 0; i < 5; i++)
        TST_CHECK(got[i] == cm_f8e4m3_to_f32(data[4][i]));
    TST_CHECK(cm_st_read(st, "e.f64", 2, sh22, h, CM_DTYPE_F16) == CM_OK);
    for (int i = 0; i < 4; i++)
        TST_CHECK(h[i] == cm_f32_to_f16((float)((double *)data[6])[i]));
    float one = -1;
    TST_CHECK(cm_st_read(st, "scalar", 0, NULL, &one, CM_DTYPE_F32) == CM_OK && one == ((float *)data[8])[0]);
    const cm_st_tensor *t = NULL;
    TST_CHECK(cm_st_expect(st, "f.i32", 1, (const int64_t[]){4}, &t) == CM_OK && t);
    TST_CHECK(t && cm_st_expect_dtype(t, CM_DTYPE_I32) == CM_OK);
    cm_st_destroy(&st);
    TST_CHECK(st == NULL);
    cm_st_destroy(&st); /* NULL-safe */

    // writing over an existing file replaces it
    cm_st_writer *w2 = NULL;
    TST_CHECK(cm_st_writer_create(&w2) == CM_OK);
    const float v[2] = {1.5f, -2.0f};
    TST_CHECK(cm_st_writer_add(w2, "only", CM_DTYPE_F32, 1, (const int64_t[]){2}, v) == CM_OK);
    TST_CHECK(cm_st_writer_write(w2, path) == CM_OK);
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK && st && cm_st_count(st) == 1);
    TST_CHECK(st && cm_st_metadata(st, "format") == NULL);
    cm_st_destroy(&st);
    cm_st_writer_destroy(&w2);
    cm_st_writer_destroy(&w);
    cm_st_writer_destroy(&w); /* NULL-safe */
}

/* A tensor at an odd offset (legal in the format) must still convert without unaligned loads. */
/* Tensors added later and given while the file is written: the file is byte for byte the one
 * written from copies; a write without a fill is refused; a failed fill leaves no file. */
typedef struct later_src {
    uint8_t (*data)[256];
    int calls, fail_at;
} later_src;
static cm_status give_later(void *user, int entry, const void **out) {
    later_src *l = user;
    l->calls++;
    if (entry == l->fail_at)
        return CM_FAIL(CM_ERR_IO, "the test's source of tensor %d failed", entry);
    *out = l->data[entry];
    return CM_OK;
}
static uint8_t *slurp_file(const char *path, long *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    *len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)*len + 1);
    if (b && fread(b, 1, (size_t)*len, fp) != (size_t)*len) {
        free(b);
        b = NULL;
    }
    fclose(fp);
    return b;
}
static void test_write_later(void) {
    char          a[512], b[512], tmp[600];
    uint8_t       data[N_SPECS][256];
    cm_st_writer *w1 = NULL, *w2 = NULL;
    TST_CHECK(cm_st_writer_create(&w1) == CM_OK && cm_st_writer_create(&w2) == CM_OK);
    int n_later = 0;
    for (int i = 0; i < N_SPECS; i++) {
        spec_fill(&specs[i], 3 * i + 1, data[i]);
        TST_CHECK(cm_st_writer_add(w1, specs[i].name, specs[i].dt, specs[i].n_dims, specs[i].shape,
                                   data[i]) == CM_OK);
        if (i % 2) { /* every other one later */
            TST_CHECK(cm_st_writer_add_later(w2, specs[i].name, specs[i].dt, specs[i].n_dims,
                                             specs[i].shape) == CM_OK);
            n_later++;
        } else
            TST_CHECK(cm_st_writer_add(w2, specs[i].name, specs[i].dt, specs[i].n_dims, specs[i].shape,
                                       data[i]) == CM_OK);
    }
    tmp_path(a, "copies.safetensors");
    tmp_path(b, "later.safetensors");
    TST_CHECK(cm_st_writer_write(w1, a) == CM_OK);
    TST_CHECK(cm_st_writer_write(w2, b) == CM_ERR_INVALID_ARG && strstr(cm_last_error(), "added later"));
    TST_CHECK(access(b, F_OK) != 0);
    later_src src = {.data = data, .fail_at = 3};
    TST_CHECK(cm_st_writer_write_with(w2, b, give_later, &src) == CM_ERR_IO &&
              strstr(cm_last_error(), "tensor 3 failed"));
    snprintf(tmp, sizeof tmp, "%s.tmp", b);
    TST_CHECK(access(b, F_OK) != 0 && access(tmp, F_OK) != 0);
    src = (later_src){.data = data, .fail_at = -1};
    TST_CHECK(cm_st_writer_write_with(w2, b, give_later, &src) == CM_OK && src.calls == n_later);
    long     la = 0, lb = 0;
    uint8_t *fa = slurp_file(a, &la), *fb = slurp_file(b, &lb);
    TST_CHECK(fa && fb && la == lb && memcmp(fa, fb, (size_t)la) == 0);
    printf("tensors added later: %d given while writing, the file equal to the one written from copies (%ld "
           "bytes)\n",
           n_later, lb);
    free(fa);
    free(fb);
    cm_st_writer_destroy(&w1);
    cm_st_writer_destroy(&w2);
}

static void test_unaligned(void) {
    char path[512];
    tmp_path(path, "unaligned.safetensors");
    const char *hdr = "{\"pad\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                      "\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[1,13]}}";
    size_t      hlen = strlen(hdr), padded = (hlen + 7) / 8 * 8;
    uint8_t     buf[512];
    memset(buf, ' ', sizeof buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, hdr, hlen);
    const float w[3] = {0.5f, -3.0f, 1e-3f};
    buf[8 + padded] = 7;
    memcpy(buf + 8 + padded + 1, w, sizeof w);
    write_bytes(path, buf, 8 + padded + 13);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
    if (!st)
        return;
    float    got[3];
    double   gd[3];
    uint16_t gh[3];
    TST_CHECK(cm_st_read(st, "w", 1, (const int64_t[]){3}, got, CM_DTYPE_F32) == CM_OK);
    TST_CHECK(memcmp(got, w, sizeof w) == 0);
    TST_CHECK(cm_st_read(st, "w", 1, (const int64_t[]){3}, gd, CM_DTYPE_F64) == CM_OK);
    for (int i = 0; i < 3; i++)
        TST_CHECK(gd[i] == (double)w[i]);
    TST_CHECK(cm_st_read(st, "w", 1, (const int64_t[]){-1}, gh, CM_DTYPE_BF16) == CM_OK);
    for (int i = 0; i < 3; i++)
        TST_CHECK(gh[i] == cm_f32_to_bf16(w[i]));
    cm_st_destroy(&st);
}

// ---- model directories

static void write_tensor_file(const char *path, const char *const *names, int n, float base) {
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    for (int i = 0; i < n; i++) {
        float v[4] = {base + i, base + i + 0.5f, -base, 2.0f};
        TST_CHECK(cm_st_writer_add(w, names[i], CM_DTYPE_F32, 2, (const int64_t[]){2, 2}, v) == CM_OK);
    }
    TST_CHECK(cm_st_writer_set_metadata(w, "format", "pt") == CM_OK);
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
    cm_st_writer_destroy(&w);
}

static const char *SHARD1 = "model-00001-of-00003.safetensors";
static const char *SHARD2 = "model-00002-of-00003.safetensors";
static const char *SHARD3 = "model-00003-of-00003.safetensors";

/* DIR with three shards and an index mapping a, b → 1; c → 2; d → 3 (shard 2 also holds 'extra'). */
static void make_sharded(const char *dir, const char *index_text) {
    char p[600];
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/%s", dir, SHARD1);
    write_tensor_file(p, (const char *const[]){"a", "b"}, 2, 1.0f);
    snprintf(p, sizeof p, "%s/%s", dir, SHARD2);
    write_tensor_file(p, (const char *const[]){"c", "extra"}, 2, 10.0f);
    snprintf(p, sizeof p, "%s/%s", dir, SHARD3);
    write_tensor_file(p, (const char *const[]){"d"}, 1, 20.0f);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, index_text, strlen(index_text));
}

static const char *GOOD_INDEX =
    "{\"metadata\": {\"total_size\": 80},\n \"weight_map\": {\n"
    "  \"a\": \"model-00001-of-00003.safetensors\",\n  \"b\": \"model-00001-of-00003.safetensors\",\n"
    "  \"c\": \"model-00002-of-00003.safetensors\",\n  \"d\": \"model-00003-of-00003.safetensors\"}}\n";

static void test_sharded(void) {
    char dir[512], p[600];
    tmp_path(dir, "sharded");
    make_sharded(dir, GOOD_INDEX);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_dir(&st, dir) == CM_OK);
    if (!st)
        return;
    TST_CHECK(cm_st_count(st) == 4); /* 'extra' is not in the map: ignored */
    TST_CHECK(cm_st_find(st, "extra") == NULL);
    const char *names[] = {"a", "b", "c", "d"};
    const char *files[] = {SHARD1, SHARD1, SHARD2, SHARD3};
    const float want0[] = {1.0f, 2.0f, 10.0f, 20.0f};
    for (int i = 0; i < 4; i++) {
        const cm_st_tensor *t = cm_st_find(st, names[i]);
        TST_CHECK(t && cm_st_at(st, i) == t);
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        TST_CHECK(t && strcmp(t->file, p) == 0);
        float v[4];
        TST_CHECK(cm_st_read(st, names[i], 2, (const int64_t[]){2, 2}, v, CM_DTYPE_F32) == CM_OK);
        TST_CHECK(v[0] == want0[i] && v[3] == 2.0f);
    }
    TST_CHECK(cm_st_metadata(st, "format") && strcmp(cm_st_metadata(st, "format"), "pt") == 0);
    TST_FAILS(cm_st_expect(st, "nope", 1, (const int64_t[]){1}, NULL), CM_ERR_FORMAT, "missing tensor 'nope'",
              dir);
    cm_st_destroy(&st);

    // a directory with a single model.safetensors
    char single[512];
    tmp_path(single, "single");
    mkdir(single, 0755);
    snprintf(p, sizeof p, "%s/model.safetensors", single);
    write_tensor_file(p, (const char *const[]){"x", "y"}, 2, 3.0f);
    TST_CHECK(cm_st_open_dir(&st, single) == CM_OK && st && cm_st_count(st) == 2);
    if (st)
        TST_FAILS(cm_st_expect(st, "z", 1, (const int64_t[]){1}, NULL), CM_ERR_FORMAT, "missing tensor 'z'",
                  single);
    cm_st_destroy(&st);
}

static void test_bad_dirs(void) {
    char   dir[512], p[600];
    cm_st *st = NULL;

    tmp_path(dir, "no-such-dir");
    TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_IO, "cannot open model directory", "no-such-dir");
    tmp_path(dir, "empty-dir");
    mkdir(dir, 0755);
    TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_IO, "empty-dir", "model.safetensors.index.json",
              "model.safetensors");

    // missing shard: named with its directory, the index and a tensor that lives in it
    tmp_path(dir, "missing-shard");
    make_sharded(dir, GOOD_INDEX);
    snprintf(p, sizeof p, "%s/%s", dir, SHARD2);
    unlink(p);
    char want[700];
    snprintf(want, sizeof want,
             "cannot open '%s/%s': No such file or directory (listed in "
             "model.safetensors.index.json for tensor 'c')",
             dir, SHARD2);
    TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_IO, want);
    TST_CHECK(st == NULL);

    // truncated shard: the data area ends before a tensor's offsets
    tmp_path(dir, "truncated-shard");
    make_sharded(dir, GOOD_INDEX);
    snprintf(p, sizeof p, "%s/%s", dir, SHARD3);
    struct stat sb;
    stat(p, &sb);
    TST_CHECK(truncate(p, sb.st_size - 4) == 0);
    TST_FAILS(cm_st_open_dir(&st, dir), CM_OK, SHARD3,
              "tensor 'd' data_offsets [0, 16] lie outside the data area of 12",
              "listed in model.safetensors.index.json for tensor 'd'");
    // truncated inside the header
    TST_CHECK(truncate(p, 20) == 0);
    TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_IO, SHARD3, "exceeds the file size 20",
              "listed in model.safetensors.index.json for tensor 'd'");

    // a tensor the index assigns to a shard that does not hold it
    tmp_path(dir, "misassigned");
    make_sharded(dir, "{\"weight_map\": {\"a\": \"model-00001-of-00003.safetensors\", "
                      "\"d\": \"model-00002-of-00003.safetensors\"}}");
    TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_FORMAT, "tensor 'd' is listed in",
              "model.safetensors.index.json", SHARD2, "does not hold it");

    // broken indexes
    struct {
        const char *index;
        const char *word;
    } bad_index[] = {
        {"{\"weight_map\": {\"a\": \"model-00001-of-00003.safetensors\",", "malformed JSON"},
        {"{\"metadata\": {}}", "missing object 'weight_map'"},
        {"{\"weight_map\": []}", "missing object 'weight_map'"},
        {"{\"weight_map\": {}}", "weight_map is empty"},
        {"{\"weight_map\": {\"a\": 3}}", "weight_map entry 'a'"},
        {"{\"weight_map\": {\"a\": \"../model-00001-of-00003.safetensors\"}}", "weight_map entry 'a'"},
        {"{\"weight_map\": {\"a\": \"/etc/passwd\"}}", "weight_map entry 'a'"},
        {"{\"weight_map\": {\"a\": \"model-00001-of-00003.safetensors\", \"a\": "
         "\"model-00001-of-00003.safetensors\"}}",
         "duplicate tensor 'a' in weight_map"},
    };
    for (size_t i = 0; i < sizeof bad_index / sizeof bad_index[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad-index-%zu", i);
        tmp_path(dir, name);
        make_sharded(dir, bad_index[i].index);
        TST_FAILS(cm_st_open_dir(&st, dir), CM_ERR_FORMAT, bad_index[i].word, "model.safetensors.index.json");
        TST_CHECK(st == NULL);
    }
}

// ---- malformed files

static void test_bad_files(void) {
    char path[512], want[700];

    tmp_path(path, "nope.safetensors");
    TST_FILE_FAILS(path, CM_ERR_IO, "cannot open", "nope.safetensors", "No such file or directory");
    TST_FILE_FAILS(tmpdir, CM_ERR_IO, "not a regular file");

    tmp_path(path, "tiny.safetensors");
    write_bytes(path, "\x02\0\0", 3);
    TST_FILE_FAILS(path, CM_ERR_IO, "tiny.safetensors", "smaller than the 8-byte header length");

    // header length beyond the file: the exact message
    tmp_path(path, "x.safetensors");
    char junk[992];
    memset(junk, 'x', sizeof junk);
    uint8_t buf[1000];
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(123456789ull >> (8 * i));
    memcpy(buf + 8, junk, sizeof junk);
    write_bytes(path, buf, sizeof buf);
    snprintf(want, sizeof want,
             "'%s': header length 123456789 exceeds the file size 1000 (truncated or not a "
             "safetensors file)",
             path);
    TST_FILE_FAILS(path, CM_ERR_IO, want);

    // a header length over the 100 MB bound (in a sparse file that is large enough to hold it)
    tmp_path(path, "huge.safetensors");
    write_raw(path, ((uint64_t)100 << 20) + 1, "{}", 0);
    TST_CHECK(truncate(path, (off_t)110 << 20) == 0);
    TST_FILE_FAILS(path, CM_ERR_FORMAT, "huge.safetensors",
                   "header length 104857601 exceeds the 104857600-byte limit");

    const char *T = "{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}";
    char        hdr[1024];
    struct {
        const char *name;
        const char *hdr;
        size_t      data_len;
        cm_status   st;
        const char *words[3];
    } cases[] = {
        {"malformed", "{\"a\": {\"dtype\": \"F32\", ", 16, CM_ERR_FORMAT, {"header JSON is malformed"}},
        {"empty-header", "", 16, CM_ERR_FORMAT, {"header JSON is malformed"}},
        {"trailing", "{}xx", 0, CM_ERR_FORMAT, {"header JSON is malformed", "stray bytes"}},
        {"not-object", "[1, 2]", 0, CM_ERR_FORMAT, {"header JSON is not an object"}},
        {"entry-not-object", "{\"a\": [1]}", 0, CM_ERR_FORMAT, {"tensor 'a' is not an object"}},
        {"no-dtype",
         "{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' has no dtype"}},
        {"unknown-dtype",
         "{\"a.weight\": {\"dtype\": \"F7\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a.weight' has unknown dtype 'F7'", "known: F32"}},
        {"no-shape",
         "{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' has no shape"}},
        {"negative-shape",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [-1, 4], \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' shape[0] is not a non-negative integer"}},
        {"fraction-shape",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"shape[0] is not a non-negative integer"}},
        {"many-dims",
         "{\"a\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 1]}}",
         1,
         CM_ERR_FORMAT,
         {"9 dims, more than the 8"}},
        {"overflow",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 4]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' shape [4294967296, 4294967296] overflows"}},
        {"size-mismatch",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}",
         16,
         CM_ERR_FORMAT,
         {"tensor 'a' data_offsets [0, 12] hold 12 bytes", "shape [2, 2] of F32 needs 16"}},
        {"outside",
         "{\"a.weight\": {\"dtype\": \"F32\", \"shape\": [16], \"data_offsets\": [0, 64]}}",
         32,
         CM_ERR_IO,
         {"tensor 'a.weight' data_offsets [0, 64] lie outside the data area of 32 bytes"}},
        {"reversed",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 4]}}",
         16,
         CM_ERR_FORMAT,
         {"tensor 'a' data_offsets [8, 4] end before they begin"}},
        {"offsets-arity",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' data_offsets must be [begin, end]"}},
        {"offsets-negative",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}",
         4,
         CM_ERR_FORMAT,
         {"tensor 'a' data_offsets must be [begin, end]"}},
        {"duplicate", NULL, 16, CM_ERR_FORMAT, {"duplicate tensor 'w'"}},
        /* byte ranges that overlap: two tensors aliasing each other's bytes */
        {"overlap",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
         " \"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}",
         24,
         CM_ERR_FORMAT,
         {"tensors 'a' (data_offsets [0, 16]) and 'b' ([8, 24]) overlap"}},
        {"overlap-inside",
         "{\"s\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [16, 20]},"
         " \"c\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [64, 68]},"
         " \"big\": {\"dtype\": \"F32\", \"shape\": [16], \"data_offsets\": [0, 64]}}",
         68,
         CM_ERR_FORMAT,
         {"tensors 'big' (data_offsets [0, 64]) and 's' ([16, 20]) overlap"}},
        {"overlap-same",
         "{\"x\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [4, 8]},"
         " \"p\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4]},"
         " \"y\": {\"dtype\": \"I32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
         8,
         CM_ERR_FORMAT,
         {"' ([4, 8]) overlap", "(data_offsets [4, 8]) and '"}},
        {"empty-name",
         "{\"\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}}",
         1,
         CM_ERR_FORMAT,
         {"empty name"}},
        {"metadata-value",
         "{\"__metadata__\": {\"format\": 1}}",
         0,
         CM_ERR_FORMAT,
         {"__metadata__ value of 'format' must be a string"}},
        {"metadata-array",
         "{\"__metadata__\": [\"pt\"]}",
         0,
         CM_ERR_FORMAT,
         {"'__metadata__' must be an object"}},
        {"metadata-twice",
         "{\"__metadata__\": {}, \"__metadata__\": {}}",
         0,
         CM_ERR_FORMAT,
         {"'__metadata__' twice"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s.safetensors", cases[i].name);
        tmp_path(path, name);
        const char *h = cases[i].hdr;
        if (!h) {
            snprintf(hdr, sizeof hdr, "{\"w\": %s, \"v\": %s, \"w\": %s}", T, T, T);
            h = hdr;
        }
        write_raw(path, UINT64_MAX, h, cases[i].data_len);
        TST_FILE_FAILS(path, cases[i].st, name, cases[i].words[0],
                       cases[i].words[1] ? cases[i].words[1] : cases[i].words[0]);
    }

    // touching ranges and empty tensors (anywhere, even inside another's bytes) do not overlap
    tmp_path(path, "touching.safetensors");
    write_raw(path, UINT64_MAX,
              "{\"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [16, 32]},"
              " \"e\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 8]},"
              " \"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
              32);
    cm_st *tf = NULL;
    TST_CHECK(cm_st_open_file(&tf, path) == CM_OK && tf && cm_st_count(tf) == 3);
    cm_st_destroy(&tf);

    // a valid file with zero tensors is fine
    tmp_path(path, "no-tensors.safetensors");
    write_raw(path, UINT64_MAX, "{\"__metadata__\": {\"k\": \"v\"}}  ", 0);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK && st && cm_st_count(st) == 0);
    TST_CHECK(st && strcmp(cm_st_metadata(st, "k"), "v") == 0);
    cm_st_destroy(&st);
}

// ---- expectations and the writer's argument checks

static void test_expect(void) {
    char path[512];
    tmp_path(path, "expect.safetensors");
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    float   f[12] = {0};
    int32_t ids[3] = {1, 2, 3};
    TST_CHECK(cm_st_writer_add(w, "x", CM_DTYPE_F32, 2, (const int64_t[]){3, 4}, f) == CM_OK);
    TST_CHECK(cm_st_writer_add(w, "ids", CM_DTYPE_I32, 1, (const int64_t[]){3}, ids) == CM_OK);
    // argument checks
    TST_FAILS(cm_st_writer_add(w, "x", CM_DTYPE_F32, 1, (const int64_t[]){1}, f), CM_ERR_INVALID_ARG,
              "duplicate tensor name 'x'");
    TST_FAILS(cm_st_writer_add(w, "neg", CM_DTYPE_F32, 1, (const int64_t[]){-2}, f), CM_ERR_INVALID_ARG,
              "negative");
    TST_FAILS(cm_st_writer_add(w, "__metadata__", CM_DTYPE_F32, 1, (const int64_t[]){1}, f),
              CM_ERR_INVALID_ARG, "bad tensor name");
    TST_FAILS(cm_st_writer_add(w, "deep", CM_DTYPE_F32, 9, (const int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}, f),
              CM_ERR_INVALID_ARG, "9 dims");
    TST_FAILS(cm_st_writer_add(w, "nodata", CM_DTYPE_F32, 1, (const int64_t[]){2}, NULL), CM_ERR_INVALID_ARG,
              "no data");
    TST_FAILS(cm_st_writer_write(w, "/nonexistent-dir-tandem/x.safetensors"), CM_ERR_IO, "cannot create",
              "/nonexistent-dir-tandem/x.safetensors.tmp");
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
    cm_st_writer_destroy(&w);

    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
    if (!st)
        return;
    const cm_st_tensor *t = (const cm_st_tensor *)1;
    TST_FAILS(cm_st_expect(st, "x", 2, (const int64_t[]){3, 16}, &t), CM_ERR_FORMAT,
              "tensor 'x' has shape [3, 4], expected [3, 16] (in ", "expect.safetensors");
    TST_CHECK(t == NULL);
    TST_FAILS(cm_st_expect(st, "x", 1, (const int64_t[]){12}, NULL), CM_ERR_FORMAT,
              "has shape [3, 4], expected [12]");
    TST_FAILS(cm_st_expect(st, "x", 3, (const int64_t[]){3, 4, -1}, NULL), CM_ERR_FORMAT,
              "expected [3, 4, *]");
    TST_FAILS(cm_st_expect(st, "y", 1, (const int64_t[]){1}, NULL), CM_ERR_FORMAT,
              "missing tensor 'y' (looked in ", "expect.safetensors");
    TST_CHECK(cm_st_expect(st, "x", 2, (const int64_t[]){-1, 4}, &t) == CM_OK && t && t->nbytes == 48);
    TST_FAILS(cm_st_expect_dtype(t, CM_DTYPE_I32), CM_ERR_FORMAT, "tensor 'x' has dtype F32, expected I32",
              "expect.safetensors");
    float out[12];
    TST_FAILS(cm_st_read(st, "ids", 1, (const int64_t[]){3}, out, CM_DTYPE_F32), CM_ERR_FORMAT,
              "tensor 'ids' has dtype I32, expected a float dtype");
    TST_FAILS(cm_st_read(st, "x", 2, (const int64_t[]){3, 4}, ids, CM_DTYPE_I32), CM_ERR_INVALID_ARG,
              "destination must be a float dtype");
    TST_FAILS(cm_st_read(st, "x", 2, (const int64_t[]){4, 3}, out, CM_DTYPE_F32), CM_ERR_FORMAT,
              "has shape [3, 4]");
    TST_FAILS(cm_st_read(st, "nope", 1, (const int64_t[]){1}, out, CM_DTYPE_F32), CM_ERR_FORMAT,
              "missing tensor 'nope'");
    cm_st_destroy(&st);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/tandem_test_cm_st_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_round_trip();
    test_write_later();
    test_unaligned();
    test_sharded();
    test_bad_dirs();
    test_bad_files();
    test_expect();
    nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return tst_report();
}
