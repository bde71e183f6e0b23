/* common/format/cm_tb.c — TensorBoard event files (format in cm_tb.h): a writer that encodes Event
 * protobufs by hand into a fixed buffer and frames them as TFRecords, and a reader that checks
 * both CRCs of every record and decodes the fields the writer writes. Metrics events are
 * ~100 bytes, so CRC32C is computed bitwise: no table, no initialisation, no global state. */
#include "cm_tb.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cm_bytes.h"
#include "cm_log.h"

// ---- CRC32C

uint32_t cm_crc32c(const void *data, size_t len) {
    const uint8_t *p = data;
    uint32_t       crc = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

uint32_t cm_crc32c_mask(uint32_t crc) {
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

// ---- protobuf wire format (only what an Event of scalars needs)

/* Enough for the largest event: CM_TB_MAX_VALUES values of (tag + float) plus the header. */
#define EV_CAP (CM_TB_MAX_VALUES * (CM_TB_MAX_TAG + 16) + 64)

typedef struct pb {
    uint8_t *p;
    size_t   n, cap;
} pb;

static void pb_byte(pb *b, uint8_t v) {
    CM_ASSERT(b->n < b->cap);
    b->p[b->n++] = v;
}

static void pb_varint(pb *b, uint64_t v) {
    while (v >= 0x80) {
        pb_byte(b, (uint8_t)(v | 0x80));
        v >>= 7;
    }
    pb_byte(b, (uint8_t)v);
}

static void pb_u32(pb *b, uint32_t v) {
    CM_ASSERT(b->n + 4 <= b->cap);
    cm_le_put_u32(b->p + b->n, v);
    b->n += 4;
}

static void pb_u64(pb *b, uint64_t v) {
    CM_ASSERT(b->n + 8 <= b->cap);
    cm_le_put_u64(b->p + b->n, v);
    b->n += 8;
}

static void pb_bytes(pb *b, int field, const void *data, size_t len) {
    pb_varint(b, (uint64_t)field << 3 | 2);
    pb_varint(b, len);
    CM_ASSERT(b->n + len <= b->cap);
    memcpy(b->p + b->n, data, len);
    b->n += len;
}

static size_t varint_len(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static void pb_header(pb *b, double wall_time, int64_t step) {
    uint64_t bits;
    memcpy(&bits, &wall_time, 8);
    pb_varint(b, 1 << 3 | 1); /* wall_time: fixed64 */
    pb_u64(b, bits);
    pb_varint(b, 2 << 3 | 0); /* step: varint (two's complement for negatives, as int64 is) */
    pb_varint(b, (uint64_t)step);
}

// ---- writer

struct cm_tb {
    FILE   *f;
    int     flush_every, pending;
    char    path[4096];
    uint8_t buf[EV_CAP + 16];
};

static double wall_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Frames b->p[0..n) as one TFRecord and hands it to stdio. */
static cm_status write_record(cm_tb *tb, const uint8_t *data, size_t n) {
    uint8_t head[12], tail[4];
    cm_le_put_u64(head, (uint64_t)n);
    cm_le_put_u32(head + 8, cm_crc32c_mask(cm_crc32c(head, 8)));
    cm_le_put_u32(tail, cm_crc32c_mask(cm_crc32c(data, n)));
    if (fwrite(head, 1, 12, tb->f) != 12 || fwrite(data, 1, n, tb->f) != n || fwrite(tail, 1, 4, tb->f) != 4)
        return CM_FAIL(CM_ERR_IO, "cannot write to '%s': %s", tb->path, strerror(errno));
    if (++tb->pending >= tb->flush_every) {
        tb->pending = 0;
        if (fflush(tb->f) != 0)
            return CM_FAIL(CM_ERR_IO, "cannot write to '%s': %s", tb->path, strerror(errno));
    }
    return CM_OK;
}

cm_status cm_tb_create(cm_tb **out, const char *run_dir, int flush_every, int64_t resume_step) {
    *out = NULL;
    if (flush_every < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "tensorboard flush_every %d must be >= 1", flush_every);
    cm_tb *tb = calloc(1, sizeof *tb);
    if (!tb)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the tensorboard writer");
    tb->flush_every = flush_every;
    cm_status st = CM_OK;
    char      dir[4096];
    if ((size_t)snprintf(dir, sizeof dir, "%s/tb", run_dir) >= sizeof dir) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "run directory path '%s' is too long", run_dir);
        goto fail;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        st = CM_FAIL(CM_ERR_IO, "cannot create '%s': %s (does the run directory exist?)", dir,
                     strerror(errno));
        goto fail;
    }
    char host[256] = "localhost";
    if (gethostname(host, sizeof host - 1) != 0 || !host[0])
        snprintf(host, sizeof host, "localhost");
    for (char *c = host; *c; c++) /* a hostname never holds '/', but keep the name one path element */
        if (*c == '/')
            *c = '_';
    const long long t = (long long)time(NULL);
    int             fd = -1;
    for (int k = 0; k < 1000 && fd < 0; k++) {
        int w = k == 0
                    ? snprintf(tb->path, sizeof tb->path, "%s/events.out.tfevents.%010lld.%s", dir, t, host)
                    : snprintf(tb->path, sizeof tb->path, "%s/events.out.tfevents.%010lld.%s.%d", dir, t,
                               host, k);
        if (w < 0 || (size_t)w >= sizeof tb->path) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "run directory path '%s' is too long", run_dir);
            goto fail;
        }
        fd = open(tb->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) {
            st = CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tb->path, strerror(errno));
            goto fail;
        }
    }
    if (fd < 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create a new event file in '%s': 1000 names taken", dir);
        goto fail;
    }
    if (!(tb->f = fdopen(fd, "wb"))) {
        close(fd);
        st = CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", tb->path, strerror(errno));
        goto fail;
    }
    pb b = {tb->buf, 0, sizeof tb->buf};
    pb_header(&b, wall_now(), 0);
    pb_bytes(&b, 3, CM_TB_FILE_VERSION, strlen(CM_TB_FILE_VERSION));
    CM_TRY_GOTO(write_record(tb, b.p, b.n), st, fail);
    if (resume_step > 0) {
        const uint8_t start[2] = {1 << 3 | 0, 1}; /* SessionLog.status = START */
        b.n = 0;
        pb_header(&b, wall_now(), resume_step + 1);
        pb_bytes(&b, 7, start, sizeof start);
        CM_TRY_GOTO(write_record(tb, b.p, b.n), st, fail);
    }
    CM_TRY_GOTO(cm_tb_flush(tb), st, fail);
    *out = tb;
    return CM_OK;
fail:
    if (tb->f) {
        fclose(tb->f);
        unlink(tb->path);
    }
    free(tb);
    return st;
}

const char *cm_tb_path(const cm_tb *tb) {
    return tb->path;
}

cm_status cm_tb_scalars(cm_tb *tb, double wall_time, int64_t step, int n, const char *const *tags,
                        const double *values) {
    if (n < 0 || n > CM_TB_MAX_VALUES)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d scalars in one tensorboard event (at most %d)", n,
                       CM_TB_MAX_VALUES);
    size_t summary_len = 0;
    for (int i = 0; i < n; i++) {
        size_t tl = strlen(tags[i]);
        if (tl == 0 || tl > CM_TB_MAX_TAG)
            return CM_FAIL(CM_ERR_INVALID_ARG, "tensorboard tag '%.40s...' has %zu bytes (1 to %d)", tags[i],
                           tl, CM_TB_MAX_TAG);
        size_t value_len = 1 + varint_len(tl) + tl + 5; /* tag field + simple_value fixed32 */
        summary_len += 1 + varint_len(value_len) + value_len;
    }
    pb b = {tb->buf, 0, sizeof tb->buf};
    pb_header(&b, wall_time > 0 ? wall_time : wall_now(), step);
    pb_varint(&b, 5 << 3 | 2); /* summary */
    pb_varint(&b, summary_len);
    const size_t at = b.n;
    for (int i = 0; i < n; i++) {
        size_t tl = strlen(tags[i]);
        pb_varint(&b, 1 << 3 | 2); /* Summary.value */
        pb_varint(&b, 1 + varint_len(tl) + tl + 5);
        pb_bytes(&b, 1, tags[i], tl);
        float    v = (float)values[i];
        uint32_t bits;
        memcpy(&bits, &v, 4);
        pb_varint(&b, 2 << 3 | 5); /* simple_value: fixed32 */
        pb_u32(&b, bits);
    }
    CM_ASSERT(b.n - at == summary_len);
    return write_record(tb, b.p, b.n);
}

cm_status cm_tb_scalar(cm_tb *tb, const char *tag, int64_t step, double value) {
    return cm_tb_scalars(tb, 0, step, 1, &tag, &value);
}

cm_status cm_tb_flush(cm_tb *tb) {
    tb->pending = 0;
    if (fflush(tb->f) != 0 || fsync(fileno(tb->f)) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot write to '%s': %s", tb->path, strerror(errno));
    return CM_OK;
}

void cm_tb_destroy(cm_tb **tb) {
    if (!tb || !*tb)
        return;
    if (cm_tb_flush(*tb) != CM_OK)
        CM_LOG_WARN("%s", cm_last_error());
    fclose((*tb)->f);
    free(*tb);
    *tb = NULL;
}

// ---- reader

struct cm_tb_reader {
    char  *data;
    size_t n, at;
    char   path[4096];
};

cm_status cm_tb_reader_open(cm_tb_reader **out, const char *path) {
    *out = NULL;
    cm_tb_reader *r = calloc(1, sizeof *r);
    if (!r)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a tensorboard reader");
    snprintf(r->path, sizeof r->path, "%s", path);
    FILE *f = fopen(path, "rb");
    if (!f) {
        free(r);
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    size_t cap = 0;
    for (;;) {
        if (r->n == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            char *p = realloc(r->data, cap);
            if (!p) {
                fclose(f);
                cm_tb_reader_destroy(&r);
                return CM_FAIL(CM_ERR_NOMEM, "cannot read '%s' into memory", path);
            }
            r->data = p;
        }
        size_t got = fread(r->data + r->n, 1, cap - r->n, f);
        r->n += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        cm_tb_reader_destroy(&r);
        return CM_FAIL(CM_ERR_IO, "cannot read '%s'", path);
    }
    *out = r;
    return CM_OK;
}

/* A protobuf reader over [p, end): every length is checked against what is left. */
typedef struct pr {
    const uint8_t *p, *end;
} pr;

static int pr_varint(pr *r, uint64_t *v) {
    *v = 0;
    for (int s = 0; s < 64; s += 7) {
        if (r->p >= r->end)
            return 0;
        uint8_t c = *r->p++;
        *v |= (uint64_t)(c & 0x7f) << s;
        if (!(c & 0x80))
            return 1;
    }
    return 0;
}

/* Reads one field's key and, for LEN fields, bounds the payload into *sub. Skips nothing. */
static int pr_field(pr *r, int *field, int *wire, pr *sub, uint64_t *scalar) {
    uint64_t key;
    if (!pr_varint(r, &key) || (key >> 3) == 0 || (key >> 3) > 0x1fffffff)
        return 0;
    *field = (int)(key >> 3);
    *wire = (int)(key & 7);
    switch (*wire) {
    case 0:
        return pr_varint(r, scalar);
    case 1:
        if (r->end - r->p < 8)
            return 0;
        *scalar = cm_le_get_u64(r->p);
        r->p += 8;
        return 1;
    case 5:
        if (r->end - r->p < 4)
            return 0;
        *scalar = cm_le_get_u32(r->p);
        r->p += 4;
        return 1;
    case 2: {
        uint64_t len;
        if (!pr_varint(r, &len) || len > (uint64_t)(r->end - r->p))
            return 0;
        sub->p = r->p;
        sub->end = r->p + len;
        r->p += len;
        return 1;
    }
    default:
        return 0; /* groups (3, 4) never occur in these messages */
    }
}

static int decode_value(pr v, cm_tb_event *ev) {
    int      field, wire, have_tag = 0, have_value = 0;
    pr       sub;
    uint64_t x;
    char     tag[CM_TB_MAX_TAG + 1] = "";
    float    value = 0;
    while (v.p < v.end) {
        if (!pr_field(&v, &field, &wire, &sub, &x))
            return 0;
        if (field == 1 && wire == 2) {
            size_t len = (size_t)(sub.end - sub.p);
            if (len > CM_TB_MAX_TAG)
                return 0;
            memcpy(tag, sub.p, len);
            tag[len] = '\0';
            have_tag = 1;
        } else if (field == 2 && wire == 5) {
            uint32_t bits = (uint32_t)x;
            memcpy(&value, &bits, 4);
            have_value = 1;
        }
    }
    if (!have_tag || !have_value)
        return 1; /* a value of another kind (histogram, tensor): not ours to decode */
    if (ev->n_values >= CM_TB_MAX_VALUES)
        return 0;
    memcpy(ev->tags[ev->n_values], tag, sizeof tag);
    ev->values[ev->n_values++] = value;
    return 1;
}

static int decode_event(pr e, cm_tb_event *ev) {
    int      field, wire;
    pr       sub;
    uint64_t x;
    while (e.p < e.end) {
        if (!pr_field(&e, &field, &wire, &sub, &x))
            return 0;
        if (field == 1 && wire == 1)
            memcpy(&ev->wall_time, &x, 8);
        else if (field == 2 && wire == 0)
            ev->step = (int64_t)x;
        else if (field == 3 && wire == 2) {
            size_t len = (size_t)(sub.end - sub.p);
            if (len >= sizeof ev->file_version)
                return 0;
            memcpy(ev->file_version, sub.p, len);
            ev->file_version[len] = '\0';
            ev->kind = CM_TB_KIND_FILE_VERSION;
        } else if (field == 5 && wire == 2) {
            ev->kind = CM_TB_KIND_SUMMARY;
            while (sub.p < sub.end) {
                int f2, w2;
                pr  val;
                if (!pr_field(&sub, &f2, &w2, &val, &x))
                    return 0;
                if (f2 == 1 && w2 == 2 && !decode_value(val, ev))
                    return 0;
            }
        } else if (field == 7 && wire == 2) {
            while (sub.p < sub.end) {
                int f2, w2;
                pr  unused;
                if (!pr_field(&sub, &f2, &w2, &unused, &x))
                    return 0;
                if (f2 == 1 && w2 == 0 && x == 1)
                    ev->kind = CM_TB_KIND_SESSION_START;
            }
        }
    }
    return 1;
}

cm_status cm_tb_reader_next(cm_tb_reader *r, cm_tb_event *ev, int *done) {
    *done = 0;
    if (r->at == r->n) {
        *done = 1;
        return CM_OK;
    }
    const size_t   at = r->at, left = r->n - at;
    const uint8_t *p = (const uint8_t *)r->data + at;
    if (left < 12)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': truncated record header at offset %zu (%zu bytes left)", r->path,
                       at, left);
    const uint64_t len = cm_le_get_u64(p);
    if (cm_le_get_u32(p + 8) != cm_crc32c_mask(cm_crc32c(p, 8)))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': bad length checksum of the record at offset %zu", r->path, at);
    if (len > left - 12 || left - 12 - len < 4)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': truncated record at offset %zu (length %llu, %zu bytes left)",
                       r->path, at, (unsigned long long)len, left);
    if (cm_le_get_u32(p + 12 + len) != cm_crc32c_mask(cm_crc32c(p + 12, (size_t)len)))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': bad data checksum of the record at offset %zu", r->path, at);
    memset(ev, 0, sizeof *ev);
    if (!decode_event((pr){p + 12, p + 12 + len}, ev))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': the record at offset %zu is not a valid Event protobuf", r->path,
                       at);
    r->at = at + 12 + (size_t)len + 4;
    return CM_OK;
}

void cm_tb_reader_destroy(cm_tb_reader **r) {
    if (!r || !*r)
        return;
    free((*r)->data);
    free(*r);
    *r = NULL;
}
