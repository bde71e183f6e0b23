/* drafter-trainer/feed/dt_dataset.h — tokenized datasets of documents, packed by the trainer into
 * batches of at most a token budget (issue 5 items 2–3; docs/architecture.md: the trainer owns packing).
 *
 * Two file forms hold the same thing, a list of documents (tools/prepare_data.py writes both):
 *
 * JSONL (any name not ending in .safetensors): one document per line,
 *   {"input_ids": [int, ...], "loss_mask": [0|1, ...]}
 *     input_ids   non-empty array of integers in [0, 2^31)        the document's tokens
 *     loss_mask   optional array of 0/1 (or false/true), one per id; 1 = the token is supervised
 *                 (an assistant token); absent = every token supervised
 *   Other keys are ignored; blank lines are ignored; a NUL byte anywhere is an error. Errors name
 *   the file and the line number.
 *
 * Binary (name ending in .safetensors): a safetensors file holding
 *   input_ids     I32 [total]   every document's tokens, concatenated, each in [0, 2^31)
 *   loss_mask     U8  [total]   0 or 1 per token
 *   doc_offsets   I64 [N + 1]   document d is tokens [o_d, o_{d+1}); 0 = o_0 < ... < o_N = total
 *   __metadata__  {"format": "tandem-tokens", "version": "1"}
 *   Read with the mmap reader (cm_safetensors.h) and validated in full: no offset is trusted.
 *   `drafter-trainer dataset convert IN.jsonl OUT.safetensors` writes it (atomically).
 *
 * Packing (deterministic; a function of the files, their order, the budget and the vocabulary
 * check only): documents of the files, in the order given, are numbered 0, 1, ... across files.
 * A document without an anchor candidate (docs/drafter.md: a p with loss_mask[p] = 1 and
 * loss_mask[p + 1] = 1 in the same document) can never be trained on and is dropped (counted).
 * The rest go first-fit decreasing into packs of at most budget tokens: by length, longest
 * first, ties by document number; each goes into the first pack (in creation order) with room,
 * else a new pack. Within a pack, documents keep their number order; the pack's cu_seqlens are
 * its documents. Pack i is batch id i (the key of shard records and live requests), so live
 * and offline runs of the same files and budget ask for identical batches. A document longer
 * than the budget, an id ≥ vocab_size, or a dataset with nothing trainable stops the open with
 * one message naming the file and the fix. The hash (for resume checks) is XXH64 over the
 * budget and every pack's documents: lengths, ids and masks. Immutable after open; any thread. */
#ifndef DT_DATASET_H
#define DT_DATASET_H

#include <stdint.h>
#include <stdio.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_DATASET_FORMAT         "tandem-tokens"
#define DT_DATASET_VERSION        "1"
#define DT_DATASET_DEFAULT_BUDGET 8192

// ---- documents of one file (convert, inspect)

/* The documents of one file, as stored: ids [total], mask [total], offsets [n_docs + 1].
 * Owned arrays; release with dt_docs_release. */
typedef struct dt_docs {
    int32_t *ids;
    uint8_t *mask;
    int64_t *offsets;
    int64_t  n_docs, total;
} dt_docs;

/* Reads and validates path (JSONL or binary by its name, above). CM_ERR_IO for a missing or
 * unreadable file, CM_ERR_FORMAT naming the file and line (JSONL) or tensor (binary). */
cm_status dt_docs_read(dt_docs *out, const char *path);
void      dt_docs_release(dt_docs *d); /* NULL-safe on the arrays; zeroes *d */
/* Writes the binary form of d to path (atomic: path.tmp, fsync, rename). */
cm_status dt_docs_write(const dt_docs *d, const char *path);

// ---- a packed dataset

typedef struct dt_dataset dt_dataset;

typedef struct dt_dataset_stats {
    int64_t n_docs;       /* documents read, over every file */
    int64_t n_dropped;    /* documents without an anchor candidate (not packed) */
    int64_t n_tokens;     /* tokens of the packed documents */
    int64_t n_supervised; /* of which loss_mask = 1 */
    int64_t n_packs;      /* packs = batches */
    int64_t max_pack_tokens, max_pack_docs;
} dt_dataset_stats;

/* Reads paths[n_paths] in order, drops untrainable documents, checks every id < vocab_size
 * (pass INT32_MAX to skip the check) and every kept document ≤ budget tokens, and packs.
 * Logs one line with the counts. paths are copied. Caller destroys with dt_dataset_destroy. */
cm_status dt_dataset_open(dt_dataset **out, const char *const *paths, int n_paths, int64_t budget,
                          int vocab_size);
void      dt_dataset_destroy(dt_dataset **ds); /* NULL-safe; sets *ds = NULL */

void        dt_dataset_get_stats(const dt_dataset *ds, dt_dataset_stats *out);
int64_t     dt_dataset_budget(const dt_dataset *ds);
uint64_t    dt_dataset_hash(const dt_dataset *ds);
const char *dt_dataset_name(const dt_dataset *ds); /* the files, comma-separated, for messages */
int         dt_dataset_n_packs(const dt_dataset *ds);
/* Pack i's size: *T tokens in *N documents. */
void dt_dataset_pack_size(const dt_dataset *ds, int i, int64_t *T, int *N);
/* Copies pack i into ids [T], cu_seqlens [N + 1] and loss_mask [T] (I32, the batch layout of
 * dt_data.h), sized by dt_dataset_pack_size. */
void dt_dataset_pack(const dt_dataset *ds, int i, int32_t *ids, int32_t *cu_seqlens, int32_t *loss_mask);
/* Global document numbers of pack i's documents into docs[N] (for tests and inspect). */
void dt_dataset_pack_docs(const dt_dataset *ds, int i, int64_t *docs);

#ifdef __cplusplus
}
#endif
#endif /* DT_DATASET_H */
