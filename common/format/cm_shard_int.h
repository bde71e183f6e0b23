/* common/format/cm_shard_int.h — what the files of the shard store share (private to
 * cm_shard_*.c; the format is documented in cm_shard.h): path and file helpers, the batch id
 * map, the index and record codecs, and the loaded index. */
#ifndef CM_SHARD_INT_H
#define CM_SHARD_INT_H

#include <stddef.h>
#include <stdint.h>

#include "cm_shard.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cm_shard assumes a little-endian host"
#endif

#define SH_PATH_MAX  4096
#define SH_READ_SIZE ((size_t)1 << 20) /* streaming reads when verifying a record from a file */

// ---- paths and files (cm_shard_index.c)

/* dst holds SH_PATH_MAX bytes; CM_ERR_INVALID_ARG when "dir/name" does not fit. */
cm_status cm_shard_path_join_(char *dst, const char *dir, const char *name);
void      cm_shard_name_(char *dst, uint32_t k); /* "shard-%05u.bin"; dst holds 32 bytes */
cm_status cm_shard_path_(char *dst, const char *dir, uint32_t k);
/* Full pwrite; CM_ERR_IO naming the file on failure. */
cm_status cm_shard_write_all_(int fd, const void *buf, size_t n, uint64_t off, const char *path);
/* Opens shard k; a missing file is a damaged store. */
cm_status cm_shard_open_(int *fd, const char *dir, uint32_t k, int flags, char *path);
cm_status cm_shard_file_size_(int fd, const char *path, uint64_t *size);
/* Parses "shard-<digits>.bin"; 1 and *k on success. */
int cm_shard_parse_name_(const char *s, uint32_t *k);

// ---- batch id → entry position (cm_shard_idmap.c; vals hold position + 1)

typedef struct idmap {
    uint64_t *keys;
    uint64_t *vals; /* 0 = empty slot */
    uint64_t  cap;  /* power of two */
    uint64_t  n;
} idmap;

void cm_shard_idmap_release_(idmap *m);
int  cm_shard_idmap_get_(const idmap *m, uint64_t key, uint64_t *val);
/* Inserts key → val: 1 if inserted, 0 if the key was present (nothing changed). */
cm_status cm_shard_idmap_put_(idmap *m, uint64_t key, uint64_t val, int *inserted);

// ---- identity, entries and records (cm_shard_index.c)

/* Checks an identity's fields; st is CM_ERR_INVALID_ARG for the caller's, CM_ERR_FORMAT for a file's. */
cm_status cm_shard_identity_valid_(const cm_shard_identity *id, cm_status st, const char *what);
void      cm_shard_index_header_encode_(uint8_t *p, const cm_shard_identity *id);
void      cm_shard_entry_encode_(uint8_t *p, const cm_shard_entry *e);
void      cm_shard_record_header_encode_(uint8_t *p, const cm_shard_entry *e);
/* The record is damaged: a CM_ERR_FORMAT naming it, with how to restore it. Needs dir, name
 * (the shard's file name) and e (the entry) in scope. */
#define REC_FAIL(fmt, ...)                                                                                   \
    CM_FAIL(CM_ERR_FORMAT,                                                                                   \
            "shard directory '%s': %s offset %llu (batch %llu): " fmt                                        \
            ": the record is corrupted; run the same `drafter-trainer precompute ... --out %s` again to "    \
            "restore it (`drafter-trainer shards inspect %s --verify` lists every bad record)",              \
            dir, name, (unsigned long long)e->offset, (unsigned long long)e->batch_id, __VA_ARGS__, dir,     \
            dir)
/* Checks a record header against its index entry. */
cm_status cm_shard_record_header_check_(const uint8_t *p, const cm_shard_entry *e, const char *dir);
cm_status cm_shard_payload_check_(uint64_t got, const cm_shard_entry *e, const char *dir);
/* Verifies a record in an open shard file (header and streamed payload checksum); buf holds
 * SH_READ_SIZE bytes. */
cm_status cm_shard_record_verify_fd_(int fd, const char *path, const cm_shard_entry *e, const char *dir,
                                     uint8_t *buf);

// ---- the loaded index (cm_shard_index.c; shared by the writer's resume and the reader)

typedef struct shard_span {
    uint64_t first, n_records, end; /* entries [first, first + n_records); bytes [0, end) */
} shard_span;

typedef struct store_index {
    cm_shard_identity id;
    uint16_t          version; /* of the store: 1 or CM_SHARD_VERSION */
    cm_shard_entry   *entries;
    uint64_t          n;
    uint64_t          n_torn;     /* entries cut off the end (writer) */
    uint64_t          torn_bytes; /* bytes of a partial entry at the end */
    shard_span       *spans;
    uint32_t          n_shards;
    idmap             map;
} store_index;

void cm_shard_index_release_(store_index *x);
/* Reads DIR/index.bin. torn_ok = 1 (writer): entries failing their checksum at the end are
 * counted in n_torn and dropped; 0 (reader): any bad entry is refused. A partial entry at
 * the end is always dropped (torn_bytes). Then checks placement and unique ids. */
cm_status cm_shard_index_load_(store_index *x, int fd, const char *path, int torn_ok);
/* The shard must hold every byte its entries name. */
cm_status cm_shard_span_check_(const store_index *x, uint32_t k, uint64_t file_bytes, const char *dir);

#endif /* CM_SHARD_INT_H */
