/* tests/fuzz/fuzz_util.h — helpers shared by the fuzz targets (header-only, static): a private
 * scratch directory (under /dev/shm when it exists, so a file-reading parser costs no disk I/O;
 * removed at exit), writing and clearing its files, splitting one input into several files at
 * FUZZ_SPLIT, and re-sealing the XXH64 checksums of a wire frame so the fuzzer can reach the
 * field checks behind them (a fuzzer cannot forge a 64-bit checksum). Single-threaded, as
 * libFuzzer runs a target. */
#ifndef FUZZ_UTIL_H
#define FUZZ_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem, mkdtemp */
#endif
#include <dirent.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_log.h"
#include "cm_proto.h"

/* Separates the files of one input (a line of its own, so seeds stay readable). */
#define FUZZ_SPLIT     "\n@@file@@\n"
#define FUZZ_MAX_PARTS 8

/* Aborts with a message: an invariant a parser promised does not hold (a finding). */
#define FUZZ_CHECK(cond)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond);                     \
            abort();                                                                                         \
        }                                                                                                    \
    } while (0)

/* st, after printing the failure's message when FUZZ_DEBUG is set (to see how far a seed gets). */
static inline cm_status fuzz_note(cm_status st) {
    if (st != CM_OK && getenv("FUZZ_DEBUG"))
        fprintf(stderr, "fuzz: %s\n", cm_last_error());
    return st;
}

static char fuzz_dir_path[256];

static inline void fuzz_dir_clear(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char           p[512];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
}

static inline void fuzz_dir_remove(void) {
    if (fuzz_dir_path[0]) {
        fuzz_dir_clear(fuzz_dir_path);
        rmdir(fuzz_dir_path);
    }
}

/* The scratch directory, created on first use. */
static inline const char *fuzz_dir(void) {
    if (fuzz_dir_path[0])
        return fuzz_dir_path;
    struct stat sb;
    const char *base = getenv("TMPDIR");
    if (stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0)
        base = "/dev/shm";
    else if (!base || !base[0])
        base = "/tmp";
    snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/tandem-fuzz-XXXXXX", base);
    if (!mkdtemp(fuzz_dir_path)) {
        perror("fuzz: mkdtemp");
        abort();
    }
    atexit(fuzz_dir_remove);
    return fuzz_dir_path;
}

static inline void fuzz_write(const char *path, const void *data, size_t len) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    const uint8_t *p = data;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n <= 0) {
            perror(path);
            abort();
        }
        p += n, len -= (size_t)n;
    }
    close(fd);
}

typedef struct fuzz_part {
    const uint8_t *data;
    size_t         len;
} fuzz_part;

/* Splits data at every FUZZ_SPLIT into at most max parts (the last takes the rest); returns
 * the count (≥ 1). */
static inline int fuzz_split(const uint8_t *data, size_t len, fuzz_part *parts, int max) {
    const size_t m = sizeof FUZZ_SPLIT - 1;
    int          n = 0;
    while (n < max - 1) {
        const uint8_t *hit = len >= m ? memmem(data, len, FUZZ_SPLIT, m) : NULL;
        if (!hit)
            break;
        parts[n].data = data, parts[n].len = (size_t)(hit - data);
        n++;
        len -= (size_t)(hit - data) + m;
        data = hit + m;
    }
    parts[n].data = data, parts[n].len = len;
    return n + 1;
}

static inline uint64_t fuzz_rd64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint32_t fuzz_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint16_t fuzz_rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}
static inline void fuzz_wr64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Re-seals a wire frame in place (cm_proto.h layout): each ANSWER tensor's checksum over its
 * bytes in DATA (while the descriptors and DATA are in range), then body_checksum, then
 * header_checksum. Bytes out of range are left alone: the decoder must refuse them anyway. */
static inline void fuzz_proto_seal(uint8_t *f, size_t len) {
    if (len < CM_PROTO_HEADER_SIZE)
        return;
    uint32_t body_len = fuzz_rd32(f + 24);
    uint32_t n_tensors = fuzz_rd32(f + 12);
    uint64_t data_len = fuzz_rd64(f + 32);
    size_t   body_end = CM_PROTO_HEADER_SIZE + (size_t)body_len;
    if (body_len <= len - CM_PROTO_HEADER_SIZE) {
        if (fuzz_rd16(f + 6) == CM_PROTO_TYPE_ANSWER && data_len <= len - body_end) {
            size_t   p = CM_PROTO_HEADER_SIZE;
            uint64_t off = 0;
            for (uint32_t i = 0; i < n_tensors && i < 4096; i++) {
                if (body_end - p < 2)
                    break;
                p += 2 + fuzz_rd16(f + p);
                if (p > body_end || body_end - p < 4)
                    break;
                unsigned nd = f[p + 2];
                p += 4;
                if (nd > CM_PROTO_MAX_DIMS || body_end - p < 8u * nd + 24)
                    break;
                p += 8u * nd + 8;
                uint64_t enc = fuzz_rd64(f + p);
                if (enc > data_len - off)
                    break;
                fuzz_wr64(f + p + 8, cm_xxh64(f + body_end + off, (size_t)enc, 0));
                off += enc;
                p += 16;
            }
        }
        fuzz_wr64(f + 40, cm_xxh64(f + CM_PROTO_HEADER_SIZE, body_len, 0));
    }
    fuzz_wr64(f + 48, cm_xxh64(f, 48, 0));
}

#endif /* FUZZ_UTIL_H */
