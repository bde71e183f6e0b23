/* common/format/cm_shard.h — the offline shard store: the target-server's ANSWER frames written to
 * large append-only files with an index, read back with mmap by the trainer's data path (which
 * decodes a record with the same cm_proto_answer_decode as a live answer). A writer appends,
 * makes the data durable before indexing it, and resumes a killed run: nothing is lost that
 * was indexed and nothing is written twice. A reader checks every record before handing it
 * out. Neither trusts a length or an offset from the files. A writer is used by one thread and
 * locks its directory against a second writer; a reader is immutable after open, may be used
 * from several threads, and may open a directory that a writer is appending to (it sees the
 * records indexed when it opened; a writer never cuts indexed bytes).
 *
 * DIRECTORY: index.bin, writer.lock (cm_lock.h), shard-00000.bin, shard-00001.bin, ...
 * (shard-%05u.bin; six digits past 99999). Records are appended to the current shard; a record that would take it past
 * max_shard_bytes starts the next one (a record larger than that fills a shard alone). Binary
 * index, not JSONL: fixed-size entries each with its own checksum make a torn append
 * detectable and cut off exactly, need no parser, and load 10^6 records in one read; `drafter-
 * trainer shards inspect` prints it for people.
 * All integers little-endian, no padding, offsets in bytes; XXH64 with seed 0 (cm_hash.h).
 *
 * INDEX = INDEX HEADER (384 bytes) | ENTRY (64 bytes) × n_records, in the order written
 * INDEX HEADER: the run's identity; written once (index.bin.tmp, fsync, rename) when the
 * directory is created, before any shard
 *   off size field            meaning
 *   0   4    magic            0x58485354 (the bytes "TSHX")
 *   4   2    version          CM_SHARD_VERSION (2); version 1 (before weights_id) is read with
 *                             weights_id = 0 and a warning, never appended to; others are refused
 *   6   2    header_size      384
 *   8   2    entry_size       64
 *   10  2    proto_version    CM_PROTO_VERSION of the ANSWER frames in the records
 *   12  1    hidden_dtype     cm_dtype of the decoded hidden states (F32 or BF16)
 *   13  1    encoding         cm_encoding the answers were asked for
 *   14  2    n_layers         1 .. CM_SHARD_MAX_LAYERS
 *   16  8    target_id        the target's identity (WELCOME target_id, hash of its config)
 *   24  4    hidden_size      D ≥ 1
 *   28  4    reserved         0
 *   32  64   target_name      the target's name, NUL-padded; 0..64 bytes of [A-Za-z0-9_.-]
 *   96  256  layer_ids        i32 × 64: the tapped layers in answer order (distinct, ≥ 0), then 0
 *   352 8    weights_id       fingerprint of the target's weights (0 = unknown); version 1: 0
 *                             (these bytes were reserved)
 *   360 16   reserved         0
 *   376 8    header_checksum  XXH64 of bytes 0..375
 * ENTRY: one record, appended only after the record's bytes are durable (fsync of the shard)
 *   0   8    batch_id         unique in the store
 *   8   4    shard            the record's shard number (< CM_SHARD_MAX_SHARDS)
 *   12  4    n_tensors        tensors in the ANSWER (for inspect)
 *   16  8    offset           of the RECORD HEADER in the shard
 *   24  8    length           payload bytes, CM_PROTO_HEADER_SIZE .. CM_SHARD_MAX_PAYLOAD
 *   32  8    checksum         XXH64 of the payload (= the record header's)
 *   40  8    raw_bytes        decoded bytes of the answer's tensors (for the ratio)
 *   48  8    batch_hash       cm_shard_batch_hash of the request's tokens and cu_seqlens (0 = not
 *                             recorded): the trainer checks that a record answers the tokens it
 *                             has under that batch id, so shards used with another dataset or
 *                             packing are refused instead of pairing hidden states with wrong tokens
 *   56  8    entry_checksum   XXH64 of bytes 0..55
 *   Entries tile the shards in order: the first is (shard 0, offset 0); each next one is at
 *   the previous record's end in the same shard, or at offset 0 of the next shard.
 *
 * SHARD = RECORD × n, back to back, nothing between; RECORD = RECORD HEADER (48) | PAYLOAD
 *   0   4    magic            0x52485354 (the bytes "TSHR")
 *   4   2    version          CM_SHARD_RECORD_VERSION (1, in stores of either version)
 *   6   2    header_size      48
 *   8   8    batch_id         = the entry's
 *   16  8    length           payload bytes, = the entry's
 *   24  8    checksum         XXH64 of the payload, = the entry's
 *   32  8    batch_hash       = the entry's
 *   40  8    header_checksum  XXH64 of bytes 0..39
 *   PAYLOAD: one ANSWER frame exactly as cm_proto_answer_encode writes it, header id = batch_id.
 *
 * Durability: append writes the record (pwrite); every fsync_every records, before a new
 * shard is started, and at close the writer fsyncs the shard, then appends the pending
 * entries to index.bin and fsyncs it (a new shard's directory entry is fsynced before any
 * entry names it). So an entry never names bytes that a crash can lose. Resume (opening an
 * existing directory): the identity must equal the run's; a torn tail of index.bin (a partial
 * entry, or entries with bad checksums up to the end) is cut off; the tail record of every
 * shard is verified (header and payload checksum); bytes past the last indexed record of a
 * shard (a partial record, or records written but not indexed) are truncated, and shard files
 * past the last indexed shard are removed: those records are simply written again. With
 * verify set, every indexed record is verified, not only the tails, and a damaged one (a bit
 * flipped after it was written) is listed instead of refused: cm_shard_writer_restore_parts
 * writes it again in place, which is possible only when the new answer is the very bytes the
 * index names (its length and checksum): the index is never rewritten. */
#ifndef CM_SHARD_H
#define CM_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_proto.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_SHARD_VERSION            2 /* of the store (index header); 1 = without weights_id */
#define CM_SHARD_RECORD_VERSION     1 /* of a record header (unchanged by version 2) */
#define CM_SHARD_INDEX_MAGIC        0x58485354u /* "TSHX" */
#define CM_SHARD_RECORD_MAGIC       0x52485354u /* "TSHR" */
#define CM_SHARD_INDEX_HEADER_SIZE  384
#define CM_SHARD_ENTRY_SIZE         64
#define CM_SHARD_RECORD_HEADER_SIZE 48
#define CM_SHARD_MAX_LAYERS         64
#define CM_SHARD_MAX_SHARDS         1000000u
#define CM_SHARD_MAX_PAYLOAD        (1ull << 36) /* 64 GiB: bounds any length read from a file */
#define CM_SHARD_INDEX_NAME         "index.bin"
#define CM_SHARD_LOCK_NAME          "writer.lock" /* the writer's lock (cm_lock.h); no data */

/* The run a store belongs to: a trainer refuses shards from another target or tap set. */
typedef struct cm_shard_identity {
    uint64_t    target_id;                          /* hash of the target's config (architecture) */
    uint64_t    weights_id;                         /* fingerprint of its weights; 0 = unknown */
    char        target_name[CM_PROTO_NAME_MAX + 1]; /* for messages; may be empty */
    cm_dtype    hidden_dtype;                       /* F32 or BF16 */
    cm_encoding encoding;
    uint32_t    hidden_size;
    uint32_t    n_layers;
    int32_t     layer_ids[CM_SHARD_MAX_LAYERS];
} cm_shard_identity;

/* Checks have against want and names the first difference (CM_ERR_INVALID_ARG, "shard
 * directory 'DIR' holds ... , this run expects ..."). Fields of want that are 0 are not
 * compared: target_id, hidden_size, n_layers (then layer_ids are not compared either);
 * weights_id is compared when both are non-zero ("same architecture (config C), different
 * weights (fingerprint A in the store, B expected)"). With exact = 1 everything but
 * target_name is compared, zeros included (the writer's rule). */
cm_status cm_shard_identity_check(const cm_shard_identity *have, const cm_shard_identity *want, int exact,
                                  const char *dir);

/* XXH64 (seed 0) of u32 T, u32 N, tokens[T] and cu_seqlens[N + 1] (i32, little-endian): the
 * fingerprint of one packed request, computed alike by precompute and by the trainer. */
uint64_t cm_shard_batch_hash(const int32_t *tokens, uint32_t n_tokens, const int32_t *cu_seqlens,
                             uint32_t n_seqs);

/* One index entry (as stored; not yet verified against its record). */
typedef struct cm_shard_entry {
    uint64_t batch_id;
    uint64_t batch_hash; /* cm_shard_batch_hash of the request, 0 = not recorded */
    uint32_t shard;
    uint32_t n_tensors;
    uint64_t offset;    /* of the record header */
    uint64_t length;    /* payload bytes */
    uint64_t checksum;  /* XXH64 of the payload */
    uint64_t raw_bytes; /* decoded bytes of the answer's tensors */
} cm_shard_entry;

// ---- writer

typedef struct cm_shard_writer_config {
    uint64_t max_shard_bytes; /* bytes per shard file before the next one starts (≥ 4096) */
    uint32_t fsync_every; /* records between fsyncs (and index appends); 0 = only at a new shard and close */
    uint32_t verify;      /* resume: 1 = verify every record, listing the damaged (cost: one read of the
                             store); 0 = only each shard's last record, refusing the store if it is bad */
} cm_shard_writer_config;
#define CM_SHARD_WRITER_CONFIG_DEFAULT                                                                       \
    { 4ull << 30, 16, 0 }

typedef struct cm_shard_writer cm_shard_writer;

/* Opens dir for appending (creating it and its index if absent; the parent must exist), or
 * resumes an existing store as described above (logging what it cut off). The directory is
 * locked (cm_lock.h: flock on CM_SHARD_LOCK_NAME, which names the holder's pid) against a
 * second writer until close. Errors: CM_ERR_INVALID_ARG
 * (bad config or identity, identity differs from the store's, directory in use), CM_ERR_FORMAT
 * (a damaged store: message names the file, the offset and the batch id; a version-1 store),
 * CM_ERR_IO. With cfg->verify a damaged record is not an error: see cm_shard_writer_damaged.
 * Caller closes with cm_shard_writer_close (or destroys). */
cm_status cm_shard_writer_create(cm_shard_writer **out, const char *dir, const cm_shard_identity *id,
                                 const cm_shard_writer_config *cfg);
/* Makes every appended record durable and indexed, then destroys the writer (also on error;
 * sets *w = NULL). NULL-safe. */
cm_status cm_shard_writer_close(cm_shard_writer **w);
/* Like close, ignoring (but logging) a failure to sync: for error paths. NULL-safe. */
void cm_shard_writer_destroy(cm_shard_writer **w);

/* 1 if batch_id is stored (durable or pending), else 0: a resumed run skips those ids. */
int      cm_shard_writer_has(const cm_shard_writer *w, uint64_t batch_id);
uint64_t cm_shard_writer_count(const cm_shard_writer *w);   /* records stored, pending included */
uint64_t cm_shard_writer_durable(const cm_shard_writer *w); /* of which indexed (durable) */

/* Appends one record. frame/len must be one valid ANSWER frame (cm_proto_answer_decode with
 * CM_PROTO_LIMITS_DEFAULT, tensor checksums included) whose header id is batch_id, and
 * batch_id must not be stored yet: else CM_ERR_INVALID_ARG naming the problem, and nothing
 * is written. batch_hash is cm_shard_batch_hash of the request (0 = not recorded). Borrows
 * frame. CM_ERR_IO if a write or fsync fails (the shard is cut back to its last complete
 * record; after a failed fsync the writer refuses further use: open the directory again). */
cm_status cm_shard_writer_append(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                 const void *frame, size_t len);
/* The same for an ANSWER received in two parts, HEAD (header + descriptors) and DATA (the
 * tensors' bytes), as cm_proto_answer_decode_parts takes them: the record's payload is HEAD
 * then DATA, written without joining them in memory. */
cm_status cm_shard_writer_append_parts(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                       const void *head, size_t head_len, const void *data, size_t data_len);
/* fsyncs the current shard and indexes every pending record now. */
cm_status cm_shard_writer_sync(cm_shard_writer *w);

/* Records found damaged at open (cfg.verify) and not restored since; cm_shard_writer_has is
 * still 1 for them (their batch ids are taken). */
uint64_t cm_shard_writer_n_damaged(const cm_shard_writer *w);
/* 1 if batch_id's record is damaged and not restored yet, else 0. */
int cm_shard_writer_damaged(const cm_shard_writer *w, uint64_t batch_id);
/* The first damaged record in index order not restored yet: 1 and *e, else 0. */
int cm_shard_writer_first_damaged(const cm_shard_writer *w, cm_shard_entry *e);
/* Writes a damaged record again in place from a new answer in two parts (as append_parts):
 * HEAD then DATA must be exactly the payload the index names (its length and checksum, and
 * its batch hash when both are recorded), so the restored record is the original one; the
 * record is fsynced and read back. CM_ERR_INVALID_ARG if batch_id is not damaged; CM_ERR_FORMAT
 * naming the record if the answer differs (another target or weights, or a forward that is
 * not bit-reproducible): nothing is written then. Borrows head and data. */
cm_status cm_shard_writer_restore_parts(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                        const void *head, size_t head_len, const void *data, size_t data_len);

// ---- reader

typedef struct cm_shard_reader cm_shard_reader;

/* Per-shard summary (from the index). */
typedef struct cm_shard_info {
    const char *path; /* borrowed */
    uint64_t    n_records;
    uint64_t    bytes;      /* indexed bytes: record headers + payloads */
    uint64_t    file_bytes; /* the file's size when opened (≥ bytes) */
    uint64_t    first;      /* index of its first entry (meaningless when n_records = 0) */
} cm_shard_info;

/* Opens a store: reads and checks the index (header, identity against want unless NULL with
 * cm_shard_identity_check(exact = 0), every entry's checksum and placement, unique batch ids),
 * checks that every shard holds the bytes its entries name, and maps the shards. A partial
 * entry at the end of index.bin (a writer is appending, or crashed) is ignored with a warning.
 * Errors: CM_ERR_IO (missing directory or file), CM_ERR_FORMAT (damaged index or shard, naming
 * file, offset and batch id), CM_ERR_INVALID_ARG (identity differs). Caller destroys with
 * cm_shard_reader_destroy; pointers handed out are valid until then. */
cm_status cm_shard_reader_open(cm_shard_reader **out, const char *dir, const cm_shard_identity *want);
void      cm_shard_reader_destroy(cm_shard_reader **r); /* NULL-safe; sets *r = NULL */

const cm_shard_identity *cm_shard_reader_identity(const cm_shard_reader *r);
uint32_t                 cm_shard_reader_version(const cm_shard_reader *r); /* of the store: 1 or 2 */
const char              *cm_shard_reader_dir(const cm_shard_reader *r);
uint64_t                 cm_shard_reader_count(const cm_shard_reader *r);
uint32_t                 cm_shard_reader_n_shards(const cm_shard_reader *r);
void cm_shard_reader_entry(const cm_shard_reader *r, uint64_t i, cm_shard_entry *out); /* i < count */
void cm_shard_reader_shard(const cm_shard_reader *r, uint32_t k, cm_shard_info *out);  /* k < n_shards */
/* 1 and *i = its position in index order if batch_id is stored, else 0. */
int cm_shard_reader_find(const cm_shard_reader *r, uint64_t batch_id, uint64_t *i);

/* The payload (an ANSWER frame) of record i in index order, after verifying its record
 * header against the entry and the payload's checksum. *frame points into the mapping.
 * CM_ERR_FORMAT naming the shard, offset and batch id if anything differs: never use it. */
cm_status cm_shard_reader_at(const cm_shard_reader *r, uint64_t i, const void **frame, size_t *len);
/* The same by batch id; CM_ERR_INVALID_ARG if the store does not hold it, or if batch_hash (the
 * trainer's cm_shard_batch_hash of this batch; 0 = do not check) differs from the one recorded
 * (when one was): the record answers other tokens. */
cm_status cm_shard_reader_get(const cm_shard_reader *r, uint64_t batch_id, uint64_t batch_hash,
                              const void **frame, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* CM_SHARD_H */
