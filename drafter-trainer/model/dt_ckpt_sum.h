/* drafter-trainer/model/dt_ckpt_sum.h — checksums of a training checkpoint, so that a resume never
 * continues from damaged bytes (a flipped bit in a master weight or an Adam moment trains on
 * silently; see dt_ckpt.h for the step directory they cover).
 *
 * step-<N>/checksums.json, written last into step-<N>.tmp/ and so renamed into place with the
 * rest of the checkpoint (atomically: a step directory has all of its checksums or is not a
 * checkpoint). XXH64 (cm_hash.h, seed 0), as 16 lower-case hex digits of the 64-bit value (what
 * `xxhsum -H64` prints for a whole file):
 *   format   "tandem.dflash.checksums"
 *   version  "1"
 *   hash     "xxh64"
 *   files    {"config.json":                {"bytes": B, "xxh64": H},
 *             "model.safetensors":          {"bytes": B, "header_xxh64": H, "tensors": {name: H}},
 *             "training_state.safetensors": {same as model.safetensors}}
 * For a safetensors file header_xxh64 covers its first 8 + N bytes (the length and the JSON
 * header: names, dtypes, shapes, offsets and __metadata__, e.g. the hparams a resume trusts)
 * and each tensor's hash its data bytes, so every byte that is read is covered and a mismatch
 * names the tensor. A manifest rather than __metadata__ inside each file: a file cannot hold
 * the checksum of its own header, config.json has no metadata, and the serving files stay
 * byte for byte what SGLang and vLLM read.
 * One thread; borrows its arguments. */
#ifndef DT_CKPT_SUM_H
#define DT_CKPT_SUM_H

#include <stddef.h>
#include <stdint.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_CKPT_SUM_NAME    "checksums.json"
#define DT_CKPT_SUM_FORMAT  "tandem.dflash.checksums"
#define DT_CKPT_SUM_VERSION "1"

/* What a build or a verification read. */
typedef struct dt_ckpt_sum_stats {
    int64_t bytes;   /* bytes hashed */
    double  seconds; /* wall time of the whole pass (open, read, hash) */
} dt_ckpt_sum_stats;

/* The checksums.json text of the checkpoint files in dir, hashed from the files as written
 * (malloc'd, NUL-terminated; caller frees). stats may be NULL. */
cm_status dt_ckpt_sum_build(const char *dir, char **json, dt_ckpt_sum_stats *stats);

/* Checks every file of step directory dir against its checksums.json. *verified = 0 (and
 * CM_OK) when dir has none: a checkpoint saved before checksums existed. A mismatch, a missing
 * or resized file or a malformed checksums.json is CM_ERR_FORMAT, one line: "checkpoint 'DIR'
 * is damaged: tensor 'adam_v.fc.weight' of training_state.safetensors does not match its
 * checksum (...); <what to do>", where what to do names the newest earlier step-<M> beside
 * dir and how to resume from it. stats may be NULL. */
cm_status dt_ckpt_sum_verify(const char *dir, int *verified, dt_ckpt_sum_stats *stats);

/* What to do about the damaged step directory dir (".../checkpoints/step-<N>"), as the tail of
 * a refusal: resume from the newest earlier step-<M> beside it (the command that points latest
 * there), or restore it or start a new --out when there is none. */
void dt_ckpt_sum_advice(const char *dir, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* DT_CKPT_SUM_H */
