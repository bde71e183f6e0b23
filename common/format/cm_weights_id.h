/* common/format/cm_weights_id.h — the fingerprint of a target's weights: the identity that tells two
 * checkpoints of one architecture apart (a base model and its fine-tune, a copy with one tensor
 * changed), announced in WELCOME beside the config hash, stored in shards and checked by
 * trainers.
 *
 * Definition (version 1). Over every tensor of the checkpoint that the text model may read —
 * all but the vision tower (`model.visual.*`) and the MTP head (`mtp.*`) —, in byte order of
 * the names: the name, its dtype as stored, its shape and a hash of its bytes as stored. A
 * tensor's bytes are cut into 32 MiB chunks, each chunk hashed with XXH64 (seed 0), and the
 * chunk hashes hashed again (seed = the tensor's size in bytes); the records are hashed with
 * XXH64 into the fingerprint (0 is mapped to 1). So the value depends on the weights alone:
 * not on the number of threads, the shard split or the order of tensors in the files, and a
 * checkpoint saved in another dtype is another fingerprint.
 *
 * Cost: one read of the weights, spread over threads (the chunks are the unit of work). The
 * server computes it from the bytes every time it loads, on threads of its own while the
 * loader reads the same pages. A directory may keep the result in DIR/.tandem-fingerprint
 * (written atomically by whoever computed it, where the directory is writable): a text file
 * listing each safetensors file's size and modification time (ns) and ending in an XXH64 of
 * its own text; it is used only when that checksum holds and every file of the checkpoint is
 * listed with the same size and time, else it is recomputed. */
#ifndef CM_WEIGHTS_ID_H
#define CM_WEIGHTS_ID_H

#include <stdint.h>

#include "cm_safetensors.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_WEIGHTS_ID_CACHE ".tandem-fingerprint"

typedef struct cm_weights_id_info {
    uint64_t id;         /* the fingerprint, never 0 */
    int      n_tensors;  /* tensors it covers */
    uint64_t bytes;      /* their bytes */
    double   seconds;    /* wall time spent hashing (0 when read from the cache) */
    int      from_cache; /* 1: read from DIR/.tandem-fingerprint */
} cm_weights_id_info;

/* 1 if a tensor of this name is part of the fingerprint. */
int cm_weights_id_covers(const char *name);

/* The fingerprint of st's tensors, hashed on n_threads threads (≤ 0: the online CPUs, at most
 * 16). CM_ERR_INVALID_ARG if st holds no covered tensor. */
cm_status cm_weights_id_compute(const cm_st *st, int n_threads, cm_weights_id_info *out);

enum {
    CM_WEIGHTS_ID_READ_CACHE = 1,  /* use a valid DIR/.tandem-fingerprint instead of hashing */
    CM_WEIGHTS_ID_WRITE_CACHE = 2, /* after hashing, (re)write it (best effort: a read-only
                                      directory is logged at debug and not an error) */
};

/* The fingerprint of the checkpoint st opened from dir (cm_st_open_dir), with the cache as
 * flags say. */
cm_status cm_weights_id_dir(const cm_st *st, const char *dir, int flags, int n_threads,
                            cm_weights_id_info *out);

/* The same on a thread of its own, so that a loader can read the weights meanwhile: start
 * opens dir and begins; finish waits for the result and releases the job (call it on every
 * started job, also when the result is no longer wanted). */
typedef struct cm_weights_id_job cm_weights_id_job;
cm_status cm_weights_id_start(cm_weights_id_job **out, const char *dir, int flags, int n_threads);
cm_status cm_weights_id_finish(cm_weights_id_job **job, cm_weights_id_info *out);

/* "0123456789abcdef" into buf (≥ 17 bytes); returns buf. */
const char *cm_weights_id_hex(uint64_t id, char *buf);

#ifdef __cplusplus
}
#endif
#endif /* CM_WEIGHTS_ID_H */
