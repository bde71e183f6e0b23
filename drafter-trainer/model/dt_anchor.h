/* drafter-trainer/model/dt_anchor.h — training anchors for one packed batch (docs/drafter.md).
 *
 * Candidates are the packed positions p with loss_mask[p] = 1 whose successor p + 1 lies in
 * the same document with loss_mask[p + 1] = 1 (slot 1 of the block then has a label). Up to
 * max_anchors are drawn without replacement (partial Fisher–Yates over the ascending candidate
 * list) and returned sorted ascending; with no more candidates than max_anchors all of them
 * are taken. A batch without candidates yields 0 anchors: still a valid step.
 *
 * The generator is keyed by (seed, epoch, batch id) through cm_rng_seed_stream, so each draw
 * is a pure function of those three numbers and of the batch: resuming, reordering or sharding
 * batches across ranks never changes them. Pure functions; no allocation; thread-safe. */
#ifndef DT_ANCHOR_H
#define DT_ANCHOR_H

#include <stdint.h>

#include "cm_rng.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Domain constant mixed into the seed so anchor streams never coincide with other streams
 * derived from the same run seed (the data shuffle). */
#define DT_ANCHOR_STREAM 0x616e63686f72ULL /* "anchor" */

/* Checks the packed layout: n_seq ≥ 1, cu_seqlens[0] = 0, strictly increasing, ending at T;
 * loss_mask values 0 or 1. CM_ERR_INVALID_ARG naming the first problem. */
cm_status dt_anchor_check(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T);

/* Writes the candidates in ascending order into cand [T] and returns their count. The layout
 * must have passed dt_anchor_check. */
int64_t dt_anchor_candidates(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                             int32_t *cand);

/* The generator of batch batch_id in epoch epoch: cm_rng_seed_stream(seed ^ DT_ANCHOR_STREAM,
 * epoch, batch_id). Saved in checkpoints for reference; sampling re-derives it. */
void dt_anchor_rng(cm_rng *r, uint64_t seed, uint64_t epoch, uint64_t batch_id);

/* Samples the anchors of one batch: checks the layout (as dt_anchor_check), collects the
 * candidates into work [T] (scratch, caller-owned), draws min(max_anchors, #candidates) of
 * them with dt_anchor_rng(seed, epoch, batch_id) and writes them sorted ascending into
 * anchors [min(max_anchors, T)]; *n_anchors receives the count. max_anchors ≥ 1. */
cm_status dt_anchor_sample(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                           int64_t max_anchors, uint64_t seed, uint64_t epoch, uint64_t batch_id,
                           int32_t *work, int32_t *anchors, int64_t *n_anchors);

#ifdef __cplusplus
}
#endif
#endif /* DT_ANCHOR_H */
