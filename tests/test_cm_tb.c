/* tests/test_cm_tb.c — TensorBoard event files (common/format/cm_tb.h): CRC32C against its published
 * check value, a written file read back record by record (file_version first, every scalar's
 * tag, step, wall time and float value, NaN and inf included), flush_every putting records on
 * disk without an explicit flush, a resumed writer's new file name and SessionLog START, and a
 * damaged length, damaged data and a truncated file each refused. With `--write DIR` it only
 * writes a known file into DIR/tb and exits (--write-resumed DIR: a resumed run's file);
 * test_cm_tb_tensorboard.py reads those with TensorBoard itself. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_tb.h"
#include "tst.h"
#include "tst_proc.h"

static char tmp[256];

static int fails_with(cm_status got, cm_status want, const char *word) {
    int ok = got == want && strstr(cm_last_error(), word) != NULL;
    if (!ok || getenv("TST_VERBOSE"))
        fprintf(stderr, "  %s: %s\n", cm_status_str(got), cm_last_error());
    return ok;
}

static long file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

/* The fixed files that the TensorBoard check reads: steps 1..5 of loss, tau, lr; resumed at
 * step 3, steps 4..5 again with loss 100 + step. */
static int write_known(const char *dir, int64_t resume_step) {
    cm_tb *tb = NULL;
    if (cm_tb_create(&tb, dir, 2, resume_step) != CM_OK) {
        fprintf(stderr, "%s\n", cm_last_error());
        return 1;
    }
    const char *tags[3] = {"train/loss", "train/tau", "train/lr"};
    for (int s = (int)resume_step + 1; s <= 5; s++) {
        double v[3] = {resume_step ? 100.0 + s : 10.0 / s, 1.0 + 0.25 * s, 6e-4 * s};
        if (cm_tb_scalars(tb, 1.7e9 + s, s, 3, tags, v) != CM_OK) {
            fprintf(stderr, "%s\n", cm_last_error());
            return 1;
        }
    }
    if (cm_tb_flush(tb) != CM_OK)
        return 1;
    printf("%s\n", cm_tb_path(tb));
    cm_tb_destroy(&tb);
    return 0;
}

static void test_crc(void) {
    TST_CHECK(cm_crc32c("123456789", 9) == 0xe3069283u);
    TST_CHECK(cm_crc32c("", 0) == 0);
    /* RFC 3720 B.4: 32 bytes of zeros → 0x8a9136aa, 32 bytes of 0xff → 0x62a8ab43 */
    unsigned char z[32], f[32];
    memset(z, 0, sizeof z);
    memset(f, 0xff, sizeof f);
    TST_CHECK(cm_crc32c(z, 32) == 0x8a9136aau);
    TST_CHECK(cm_crc32c(f, 32) == 0x62a8ab43u);
    TST_CHECK(cm_crc32c_mask(0) == 0xa282ead8u);
}

/* Reads every record of path into evs (at most cap); returns the count or -1 on error. */
static int read_all(const char *path, cm_tb_event *evs, int cap) {
    cm_tb_reader *r = NULL;
    if (cm_tb_reader_open(&r, path) != CM_OK)
        return -1;
    int n = 0, done = 0;
    while (n < cap) {
        if (cm_tb_reader_next(r, &evs[n], &done) != CM_OK) {
            n = -1;
            break;
        }
        if (done)
            break;
        n++;
    }
    cm_tb_reader_destroy(&r);
    return n;
}

/* Writes the first keep bytes of buf with the byte at flip_at (unless (size_t)-1) flipped,
 * reads records until one fails, and expects CM_ERR_FORMAT with word in the message. */
static void expect_damaged(const char *buf, size_t keep, size_t flip_at, const char *word) {
    char path[300], copy[4096];
    snprintf(path, sizeof path, "%s/bad", tmp);
    memcpy(copy, buf, keep);
    if (flip_at != (size_t)-1)
        copy[flip_at] ^= 0x10;
    FILE *f = fopen(path, "wb");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fwrite(copy, 1, keep, f);
    fclose(f);
    cm_tb_reader *r = NULL;
    cm_tb_event  *ev = calloc(1, sizeof *ev);
    TST_CHECK(cm_tb_reader_open(&r, path) == CM_OK);
    cm_status st = CM_OK;
    int       done = 0;
    while (r && ev && st == CM_OK && !done)
        st = cm_tb_reader_next(r, ev, &done);
    TST_CHECK(fails_with(st, CM_ERR_FORMAT, word));
    cm_tb_reader_destroy(&r);
    free(ev);
}

static void test_round_trip(cm_tb_event *evs) {
    char run[300];
    snprintf(run, sizeof run, "%s/run", tmp);
    TST_CHECK(mkdir(run, 0755) == 0);
    cm_tb *tb = NULL;
    TST_CHECK(cm_tb_create(&tb, run, 2, 0) == CM_OK);
    if (!tb)
        return;
    const char *path = cm_tb_path(tb);
    char        host[256] = "";
    gethostname(host, sizeof host - 1);
    TST_CHECK(strstr(path, "/run/tb/events.out.tfevents.") != NULL);
    TST_CHECK(strstr(path, host) != NULL && strcmp(path + strlen(path) - strlen(host), host) == 0);

    const long   after_create = file_size(path); /* create flushes the file_version record */
    const char  *tags[4] = {"loss", "tau", "acc/1", "tokens_per_s"};
    const double v1[4] = {3.25, 1.5, 0.125, 12345.0};
    TST_CHECK(cm_tb_scalars(tb, 1.7e9, 1, 4, tags, v1) == CM_OK);
    TST_CHECK(file_size(path) == after_create); /* 1 pending < flush_every 2: still in stdio */
    const double v2[4] = {NAN, INFINITY, -0.5, 1e30};
    TST_CHECK(cm_tb_scalars(tb, 1.7e9 + 1.5, 2, 4, tags, v2) == CM_OK);
    TST_CHECK(file_size(path) > after_create); /* the 2nd record flushed both */
    TST_CHECK(cm_tb_scalar(tb, "lr", 1ll << 40, 6e-4) == CM_OK);
    char long_tag[CM_TB_MAX_TAG + 2];
    memset(long_tag, 'x', sizeof long_tag - 1);
    long_tag[sizeof long_tag - 1] = '\0';
    TST_CHECK(fails_with(cm_tb_scalar(tb, long_tag, 3, 1), CM_ERR_INVALID_ARG, "tag"));
    TST_CHECK(fails_with(cm_tb_scalar(tb, "", 3, 1), CM_ERR_INVALID_ARG, "tag"));
    TST_CHECK(
        fails_with(cm_tb_scalars(tb, 0, 3, CM_TB_MAX_VALUES + 1, tags, v1), CM_ERR_INVALID_ARG, "at most"));
    char path_copy[4096];
    snprintf(path_copy, sizeof path_copy, "%s", path);
    cm_tb_destroy(&tb);
    TST_CHECK(tb == NULL);
    cm_tb_destroy(&tb);

    int n = read_all(path_copy, evs, 8);
    TST_CHECK(n == 4);
    if (n != 4)
        return;
    TST_CHECK(evs[0].kind == CM_TB_KIND_FILE_VERSION && strcmp(evs[0].file_version, "brain.Event:2") == 0);
    TST_CHECK(evs[0].step == 0 && evs[0].wall_time > 1.6e9);
    TST_CHECK(evs[1].kind == CM_TB_KIND_SUMMARY && evs[1].step == 1 && evs[1].wall_time == 1.7e9);
    TST_CHECK(evs[1].n_values == 4);
    for (int i = 0; i < 4 && i < evs[1].n_values; i++) {
        TST_CHECK(strcmp(evs[1].tags[i], tags[i]) == 0);
        TST_CHECK(evs[1].values[i] == (float)v1[i]);
    }
    TST_CHECK(evs[2].step == 2 && evs[2].wall_time == 1.7e9 + 1.5 && evs[2].n_values == 4);
    TST_CHECK(isnan(evs[2].values[0]) && isinf(evs[2].values[1]) && evs[2].values[1] > 0);
    TST_CHECK(evs[2].values[2] == -0.5f && evs[2].values[3] == (float)1e30);
    TST_CHECK(evs[3].step == (1ll << 40) && evs[3].n_values == 1 && strcmp(evs[3].tags[0], "lr") == 0);
    TST_CHECK(evs[3].values[0] == (float)6e-4 && evs[3].wall_time > 1.6e9);

    /* a resumed run in the same second: a new file beside the first, START at the next step */
    TST_CHECK(cm_tb_create(&tb, run, 1, 40) == CM_OK);
    if (!tb)
        return;
    TST_CHECK(strcmp(cm_tb_path(tb), path_copy) != 0);
    char second[4096];
    snprintf(second, sizeof second, "%s", cm_tb_path(tb));
    TST_CHECK(cm_tb_scalar(tb, "loss", 41, 2.0) == CM_OK);
    TST_CHECK(file_size(second) > 0);
    cm_tb_destroy(&tb);
    n = read_all(second, evs, 8);
    TST_CHECK(n == 3);
    if (n == 3) {
        TST_CHECK(evs[0].kind == CM_TB_KIND_FILE_VERSION);
        TST_CHECK(evs[1].kind == CM_TB_KIND_SESSION_START && evs[1].step == 41);
        TST_CHECK(evs[2].kind == CM_TB_KIND_SUMMARY && evs[2].step == 41 && evs[2].values[0] == 2.0f);
    }

    /* damage: one byte of the first record's length, of the second record's data, a cut */
    FILE  *f = fopen(path_copy, "rb");
    char   buf[4096];
    size_t len = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f)
        fclose(f);
    TST_CHECK(len > 100);
    const size_t first = 12 + (size_t)(unsigned char)buf[0] + 4; /* file_version record, length < 256 */
    expect_damaged(buf, len, 0, "bad length checksum");
    expect_damaged(buf, len, first + 20, "bad data checksum");
    expect_damaged(buf, len - 3, (size_t)-1, "truncated");
    expect_damaged(buf, 7, (size_t)-1, "truncated record header");
    char bad[300];
    snprintf(bad, sizeof bad, "%s/bad", tmp);
    /* a record whose CRCs are right but whose payload is not an Event protobuf */
    f = fopen(bad, "wb");
    if (f) {
        const unsigned char junk[3] = {0x0a, 0x7f, 0x00}; /* field 1 LEN 127 with 1 byte left */
        unsigned char       rec[12 + 3 + 4];
        for (int i = 0; i < 8; i++)
            rec[i] = (unsigned char)(i == 0 ? 3 : 0);
        uint32_t c = cm_crc32c_mask(cm_crc32c(rec, 8));
        for (int i = 0; i < 4; i++)
            rec[8 + i] = (unsigned char)(c >> (8 * i));
        memcpy(rec + 12, junk, 3);
        c = cm_crc32c_mask(cm_crc32c(junk, 3));
        for (int i = 0; i < 4; i++)
            rec[15 + i] = (unsigned char)(c >> (8 * i));
        fwrite(rec, 1, sizeof rec, f);
        fclose(f);
        cm_tb_reader *r = NULL;
        int           done = 0;
        TST_CHECK(cm_tb_reader_open(&r, bad) == CM_OK);
        if (r)
            TST_CHECK(fails_with(cm_tb_reader_next(r, &evs[0], &done), CM_ERR_FORMAT, "not a valid Event"));
        cm_tb_reader_destroy(&r);
    }
}

static void test_bad_create(void) {
    cm_tb *tb = NULL;
    char   missing[300];
    snprintf(missing, sizeof missing, "%s/no/such/run", tmp);
    TST_CHECK(fails_with(cm_tb_create(&tb, missing, 1, 0), CM_ERR_IO, "does the run directory exist"));
    TST_CHECK(tb == NULL);
    TST_CHECK(fails_with(cm_tb_create(&tb, tmp, 0, 0), CM_ERR_INVALID_ARG, "flush_every"));
    cm_tb_reader *r = NULL;
    TST_CHECK(fails_with(cm_tb_reader_open(&r, missing), CM_ERR_IO, "cannot open"));
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--write") == 0)
        return write_known(argv[2], 0);
    if (argc == 3 && strcmp(argv[1], "--write-resumed") == 0)
        return write_known(argv[2], 3);
    snprintf(tmp, sizeof tmp, "/tmp/test_cm_tb.XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    cm_tb_event *evs = calloc(8, sizeof *evs); /* 16 KB each: not on the stack */
    if (!evs)
        return 1;
    test_crc();
    test_round_trip(evs);
    test_bad_create();
    free(evs);
    tst_rmdir(tmp);
    return tst_report();
}
