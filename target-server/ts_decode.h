/* target-server/ts_decode.h — decoding sequences on the target (docs/target.md, "Decoding"): the
 * DECODE steps of cm_proto.h run against a ts_model and its ts_cache. Sequences belong to an
 * owner (a client's name); each holds a cache slot, its committed length and its sampling
 * settings and stream. A step prefills new sequences, lets the target alone go on (no drafts) or
 * verifies draft blocks, all of a step's sequences in batched forwards, and answers with the
 * "decode" table and the committed tokens' hidden states. Used by `serve` (through cm_dec) and by
 * `generate` (in process). One thread at a time, the model's. */
#ifndef TS_DECODE_H
#define TS_DECODE_H

#include <stdint.h>

#include "cm_cfg.h"
#include "cm_proto.h"
#include "cm_status.h"
#include "ts_model.h"
#include "ts_split.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_decoder ts_decoder;

typedef struct ts_decoder_config {
    int        max_seqs;      /* sequences open at once, over all owners (cache slots) */
    int64_t    max_len;       /* tokens per sequence, prompt included */
    int64_t    max_step;      /* tokens of the sequences with drafts in one step */
    int64_t    max_forward;   /* tokens of one forward (prefills are split into forwards of at most this) */
    cm_dtype   hidden_dtype;  /* F32 or BF16: of the answers' hidden states */
    cm_gen_cfg gen;           /* the target's sampling defaults (CM_DECODE_FLAG_TARGET_SAMPLING) */
} ts_decoder_config;

/* Bytes of backend memory a decoder of this config takes (its cache). */
size_t    ts_decoder_bytes(const cm_target_cfg *c, const ts_decoder_config *cfg);
cm_status ts_decoder_create(ts_model *m, const ts_decoder_config *cfg, ts_decoder **out);
/* The same over a split target's stages (ts_split.h): the cache spread over the stages' contexts,
 * the same steps and answers as on one model. */
cm_status ts_decoder_create_split(ts_split *sp, const ts_decoder_config *cfg, ts_decoder **out);
void      ts_decoder_destroy(ts_decoder **d); /* NULL-safe */

/* Runs one DECODE of owner (already decoded by cm_proto_decode_decode) and fills ans (room for
 * 1 + rq->n_layers tensors in ans->tensors; raw, data owned by the decoder until its next call).
 * CM_ERR_INVALID_ARG for a step that cannot be served (a handle not the owner's, a wrong base, a
 * length past max_len, too many sequences, a token or layer out of range: the message says which)
 * and then nothing changed; another failure drops the step's sequences (their state is lost). */
cm_status ts_decoder_step(ts_decoder *d, const char *owner, const cm_proto_decode *rq, cm_proto_answer *ans);
/* Closes every sequence of owner (its client went away). */
void ts_decoder_drop(ts_decoder *d, const char *owner);
/* Sequences open now. */
int ts_decoder_open(const ts_decoder *d);
/* Seconds spent since creation in the commits of verified blocks (ts_cache_commit: the GDN states
 * advanced over the accepted prefixes again, after each verification forward), and their count. */
double ts_decoder_commit_s(const ts_decoder *d, int64_t *n_commits);

#ifdef __cplusplus
}
#endif
#endif /* TS_DECODE_H */
