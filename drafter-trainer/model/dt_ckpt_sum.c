/* drafter-trainer/model/dt_ckpt_sum.c — checksums.json of a checkpoint (format in dt_ckpt_sum.h):
 * one pass per file that builds the entry when saving and compares it while verifying, so the
 * two can never disagree on what is hashed. Safetensors data is hashed in the reader's mmap
 * (cm_safetensors.h), the tensors on a pool of the host's cores, the header and config.json
 * through pread. */
#include "dt_ckpt_sum.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_pool.h"
#include "cm_safetensors.h"
#include "cm_time.h"

static const char *const SUM_FILES[3] = {"config.json", "model.safetensors", "training_state.safetensors"};

typedef struct sum_ctx {
    const char       *dir;
    char              why[900]; /* the first mismatch (verify), for the message */
    dt_ckpt_sum_stats stats;
} sum_ctx;

static void hex64(char out[17], uint64_t h) {
    snprintf(out, 17, "%016" PRIx64, h);
}

/* The want entry's 16-hex-digit string key, or NULL when absent or malformed. */
static const char *want_hex(const cJSON *want, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(want, key);
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 16)
        return NULL;
    for (const char *c = v->valuestring; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
            return NULL;
    return v->valuestring;
}

/* XXH64 of bytes [0, len) of fd, read in 1 MiB pieces. */
static cm_status hash_fd(int fd, const char *path, int64_t len, uint64_t *h, sum_ctx *c) {
    static const size_t piece = 1 << 20;
    char               *buf = malloc(piece);
    if (!buf)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a read buffer");
    cm_xxh64_state s;
    cm_xxh64_init(&s, 0);
    for (int64_t off = 0; off < len;) {
        size_t  want = (size_t)(len - off) < piece ? (size_t)(len - off) : piece;
        ssize_t n = pread(fd, buf, want, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = n < 0 ? errno : EIO;
            free(buf);
            return CM_FAIL(CM_ERR_IO, "cannot read '%s': %s", path, strerror(e));
        }
        cm_xxh64_update(&s, buf, (size_t)n);
        off += n;
    }
    free(buf);
    c->stats.bytes += len;
    *h = cm_xxh64_digest(&s);
    return CM_OK;
}

/* Every tensor's XXH64 of a safetensors file, on a pool of the host's cores (each tensor has its
 * own hash, so the order of the work does not matter). */
typedef struct tensor_sums {
    const cm_st *f;
    uint64_t    *h;
} tensor_sums;

static cm_status sum_tensor(void *ctx, int worker, int64_t i) {
    (void)worker;
    const tensor_sums  *ts = ctx;
    const cm_st_tensor *t = cm_st_at(ts->f, (int)i);
    ts->h[i] = cm_xxh64(t->data, t->nbytes, 0);
    return CM_OK;
}

static cm_status sum_tensors(const cm_st *f, uint64_t **out) {
    const int n = cm_st_count(f);
    *out = malloc((size_t)(n > 0 ? n : 1) * sizeof **out);
    if (!*out)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d tensor checksums", n);
    tensor_sums ts = {f, *out};
    cm_pool    *pool = NULL;
    int         failed;
    cm_status   st = cm_pool_create(&pool, cm_pool_cpu_threads(16), "checkpoint checksums");
    if (st == CM_OK)
        st = cm_pool_run(pool, sum_tensor, &ts, n, &failed);
    cm_pool_destroy(&pool);
    return st;
}

/* One file of the checkpoint: builds its entry into got (saving) or compares it with want
 * (verifying; exactly one of the two is non-NULL). A mismatch is CM_ERR_FORMAT with c->why. */
static cm_status sum_file(sum_ctx *c, const char *name, const cJSON *want, cJSON *got) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", c->dir, name) >= sizeof path)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s/%s' is too long", c->dir, name);
    const int is_st = strcmp(name, "config.json") != 0;
    int       fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (want && errno == ENOENT) {
            snprintf(c->why, sizeof c->why, "%s is missing", name);
            return CM_ERR_FORMAT;
        }
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    cm_status   st = CM_OK;
    cm_st      *f = NULL;
    struct stat sb;
    uint64_t    h = 0, *th = NULL;
    char        hx[17];
    if (fstat(fd, &sb) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
        goto done;
    }
    const int64_t size = (int64_t)sb.st_size;
    if (want) {
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(want, "bytes");
        if (!cJSON_IsNumber(b) || !want_hex(want, is_st ? "header_xxh64" : "xxh64")) {
            snprintf(c->why, sizeof c->why, "%s has no valid entry for %s", DT_CKPT_SUM_NAME, name);
            st = CM_ERR_FORMAT;
            goto done;
        }
        if ((double)size != b->valuedouble) {
            snprintf(c->why, sizeof c->why,
                     "%s is %" PRId64 " bytes but was saved with %.0f (truncated or rewritten)", name, size,
                     b->valuedouble);
            st = CM_ERR_FORMAT;
            goto done;
        }
    } else
        cJSON_AddNumberToObject(got, "bytes", (double)size);
    int64_t hlen = size; /* config.json: the whole file; safetensors: length + JSON header */
    if (is_st) {
        unsigned char n8[8];
        uint64_t      n = 0;
        if (size < 8 || pread(fd, n8, 8, 0) != 8) {
            snprintf(c->why, sizeof c->why, "%s is too short for a safetensors header", name);
            st = want ? CM_ERR_FORMAT
                      : CM_FAIL(CM_ERR_FORMAT, "'%s' is too short for a safetensors header", path);
            goto done;
        }
        for (int i = 7; i >= 0; i--)
            n = n << 8 | n8[i];
        if (n > (uint64_t)size - 8) {
            snprintf(c->why, sizeof c->why, "the header length of %s points past its end", name);
            st = want ? CM_ERR_FORMAT : CM_FAIL(CM_ERR_FORMAT, "'%s': header length past the end", path);
            goto done;
        }
        hlen = 8 + (int64_t)n;
    }
    CM_TRY_GOTO(hash_fd(fd, path, hlen, &h, c), st, done);
    hex64(hx, h);
    const char *key = is_st ? "header_xxh64" : "xxh64";
    if (want && strcmp(hx, want_hex(want, key)) != 0) {
        snprintf(c->why, sizeof c->why, "the %s of %s does not match its checksum (xxh64 %s, saved %s)",
                 is_st ? "header" : "text", name, hx, want_hex(want, key));
        st = CM_ERR_FORMAT;
        goto done;
    }
    if (got)
        cJSON_AddStringToObject(got, key, hx);
    if (!is_st)
        goto done;

    /* the header is the one saved, so the reader's validation cannot fail on damage there */
    CM_TRY_GOTO(cm_st_open_file(&f, path), st, done);
    const cJSON *wt = want ? cJSON_GetObjectItemCaseSensitive(want, "tensors") : NULL;
    cJSON       *gt = got ? cJSON_AddObjectToObject(got, "tensors") : NULL;
    if (want && (!cJSON_IsObject(wt) || cJSON_GetArraySize(wt) != cm_st_count(f))) {
        snprintf(c->why, sizeof c->why, "%s holds %d tensors but %s lists %d", name, cm_st_count(f),
                 DT_CKPT_SUM_NAME, cJSON_IsObject(wt) ? cJSON_GetArraySize(wt) : 0);
        st = CM_ERR_FORMAT;
        goto done;
    }
    if (got && !gt) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot build %s", DT_CKPT_SUM_NAME);
        goto done;
    }
    CM_TRY_GOTO(sum_tensors(f, &th), st, done);
    for (int i = 0; i < cm_st_count(f); i++) {
        const cm_st_tensor *t = cm_st_at(f, i);
        hex64(hx, th[i]);
        c->stats.bytes += (int64_t)t->nbytes;
        if (gt) {
            cJSON_AddStringToObject(gt, t->name, hx);
            continue;
        }
        const char *w = want_hex(wt, t->name);
        if (!w || strcmp(w, hx) != 0) {
            if (w)
                snprintf(c->why, sizeof c->why,
                         "tensor '%s' of %s does not match its checksum (xxh64 %s, saved %s)", t->name, name,
                         hx, w);
            else
                snprintf(c->why, sizeof c->why, "tensor '%s' of %s has no checksum in %s", t->name, name,
                         DT_CKPT_SUM_NAME);
            st = CM_ERR_FORMAT;
            goto done;
        }
    }
done:
    free(th);
    cm_st_destroy(&f);
    close(fd);
    return st;
}

cm_status dt_ckpt_sum_build(const char *dir, char **json, dt_ckpt_sum_stats *stats) {
    *json = NULL;
    sum_ctx   c = {.dir = dir};
    double    t0 = cm_now_s();
    cm_status st = CM_OK;
    cJSON    *j = cJSON_CreateObject(), *files = NULL;
    if (!j || !cJSON_AddStringToObject(j, "format", DT_CKPT_SUM_FORMAT) ||
        !cJSON_AddStringToObject(j, "version", DT_CKPT_SUM_VERSION) ||
        !cJSON_AddStringToObject(j, "hash", "xxh64") || !(files = cJSON_AddObjectToObject(j, "files"))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot build %s", DT_CKPT_SUM_NAME);
        goto done;
    }
    for (int k = 0; k < 3; k++) {
        cJSON *e = cJSON_AddObjectToObject(files, SUM_FILES[k]);
        if (!e) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot build %s", DT_CKPT_SUM_NAME);
            goto done;
        }
        CM_TRY_GOTO(sum_file(&c, SUM_FILES[k], NULL, e), st, done);
    }
    char  *text = cJSON_Print(j);
    size_t n = text ? strlen(text) : 0;
    if (!text || !(*json = malloc(n + 2))) {
        free(text);
        st = CM_FAIL(CM_ERR_NOMEM, "cannot build %s", DT_CKPT_SUM_NAME);
        goto done;
    }
    memcpy(*json, text, n);
    memcpy(*json + n, "\n", 2);
    free(text);
done:
    cJSON_Delete(j);
    c.stats.seconds = cm_now_s() - t0;
    if (stats)
        *stats = c.stats;
    return st;
}

void dt_ckpt_sum_advice(const char *dir, char *out, size_t cap) {
    char        parent[4096];
    const char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : dir;
    snprintf(parent, sizeof parent, "%.*s", slash ? (int)(slash - dir) : 1, slash ? dir : ".");
    long long n = -1, best = -1;
    if (strncmp(base, "step-", 5) == 0)
        n = strtoll(base + 5, NULL, 10);
    DIR *d = opendir(parent);
    for (struct dirent *e; d && (e = readdir(d));) {
        char     *end;
        long long m = strncmp(e->d_name, "step-", 5) == 0 ? strtoll(e->d_name + 5, &end, 10) : -1;
        if (m >= 0 && *end == '\0' && end != e->d_name + 5 && (n < 0 || m < n) && m > best)
            best = m;
    }
    if (d)
        closedir(d);
    if (best >= 0)
        snprintf(out, cap,
                 "to resume from step-%lld, the newest earlier checkpoint, run echo step-%lld > '%s/latest' "
                 "and --resume again (%s is replaced when the run saves it again), or start a new --out",
                 best, best, parent, base);
    else
        snprintf(out, cap,
                 "no earlier checkpoint is left beside it: restore %s from a copy or start a new --out",
                 base);
}

cm_status dt_ckpt_sum_verify(const char *dir, int *verified, dt_ckpt_sum_stats *stats) {
    *verified = 0;
    sum_ctx c = {.dir = dir};
    double  t0 = cm_now_s();
    char    path[4096], advice[1400];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, DT_CKPT_SUM_NAME) >= sizeof path)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s' is too long", dir);
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        if (errno == ENOENT)
            return CM_OK;
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    /* a manifest is a few hundred bytes per tensor; 64 MiB is far past any drafter's */
    char  *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 65536 > cap) {
            char *nt = cap < ((size_t)64 << 20) ? realloc(text, cap = cap ? cap * 2 : 65536 + 1) : NULL;
            if (!nt) {
                free(text);
                fclose(fp);
                return CM_FAIL(CM_ERR_FORMAT, "'%s' is too large for a checksum list", path);
            }
            text = nt;
        }
        size_t n = fread(text + len, 1, cap - 1 - len, fp);
        len += n;
        if (n == 0)
            break;
    }
    int rerr = ferror(fp);
    fclose(fp);
    if (rerr) {
        free(text);
        return CM_FAIL(CM_ERR_IO, "cannot read '%s'", path);
    }
    text[len] = '\0';
    cJSON *j = cJSON_Parse(text);
    free(text);
    cm_status    st = CM_OK;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format"),
                *ver = cJSON_GetObjectItemCaseSensitive(j, "version");
    const cJSON *hash = cJSON_GetObjectItemCaseSensitive(j, "hash"),
                *files = cJSON_GetObjectItemCaseSensitive(j, "files");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, DT_CKPT_SUM_FORMAT) != 0 || !cJSON_IsString(ver) ||
        strcmp(ver->valuestring, DT_CKPT_SUM_VERSION) != 0 || !cJSON_IsString(hash) ||
        strcmp(hash->valuestring, "xxh64") != 0 || !cJSON_IsObject(files)) {
        snprintf(c.why, sizeof c.why,
                 "%s is not a version %s %s list (damaged, or from a newer drafter-trainer)",
                 DT_CKPT_SUM_NAME, DT_CKPT_SUM_VERSION, DT_CKPT_SUM_FORMAT);
        st = CM_ERR_FORMAT;
        goto done;
    }
    for (int k = 0; k < 3 && st == CM_OK; k++) {
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(files, SUM_FILES[k]);
        if (!cJSON_IsObject(w)) {
            snprintf(c.why, sizeof c.why, "%s has no entry for %s", DT_CKPT_SUM_NAME, SUM_FILES[k]);
            st = CM_ERR_FORMAT;
        } else
            st = sum_file(&c, SUM_FILES[k], w, NULL);
    }
done:
    cJSON_Delete(j);
    c.stats.seconds = cm_now_s() - t0;
    if (stats)
        *stats = c.stats;
    if (st == CM_ERR_FORMAT && c.why[0]) {
        dt_ckpt_sum_advice(dir, advice, sizeof advice);
        return CM_FAIL(CM_ERR_FORMAT, "cannot resume: checkpoint '%s' is damaged: %s; %s", dir, c.why, advice);
    }
    if (st == CM_OK)
        *verified = 1;
    return st;
}
