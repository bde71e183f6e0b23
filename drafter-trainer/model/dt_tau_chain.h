/* drafter-trainer/model/dt_tau_chain.h — the τ a greedy speculative decoder reports, from one
 * teacher-forced pass over text the target generated (docs/drafter.md, "τ and accuracy").
 *
 * The teacher-forced τ weights every anchor alike; a decoder anchors each block where the last one
 * stopped. Given the acceptance of the anchors the decoder would use (accepted[j]: the leading run of
 * correct slots of the block at anchors[j], dt_model_accepted), this walks that chain.
 *
 * Spans. A response span is a maximal run [f, e) of positions with loss_mask = 1 inside one
 * document. It stands for one decode: prompt = the document's tokens before f, max_new = e − f. The
 * target's prefill produces ids[f] (no verify step, not counted); then
 *     a_0 = f,   n_i = min(accepted(a_i) + 1, e − 1 − a_i),   a_(i+1) = a_i + n_i,   while a_i + 1 < e:
 * each verify step emits its accepted drafts and the target's bonus token, except that the step which
 * reaches the span's last token emits only the tokens left (max_new is out; z-lab dflash 0.1.0's
 * dflash_generate: produced = min(acceptance + 1, max_length − start − 1), also when the text ends in
 * its eos). So a span of N tokens emits N − 1 tokens in its steps, and one of 1 token takes no step.
 * τ_chain = Σ tokens / Σ steps over the spans of all documents, pooled as z-lab's acceptance_lengths
 * are pooled over prompts. Every a_i is an anchor candidate (loss_mask[a_i] = loss_mask[a_i + 1] = 1
 * in one document, dt_anchor.h), so anchors holding every candidate always complete the chain.
 *
 * Pure function; no allocation; thread-safe. */
#ifndef DT_TAU_CHAIN_H
#define DT_TAU_CHAIN_H

#include <stdint.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_tau_chain {
    int64_t tokens;  /* emitted by verify steps, bonus tokens included */
    int64_t steps;   /* verify steps */
    int64_t missing; /* −1: complete; else the first position the chain anchors on that anchors lacks
                        (tokens and steps are then 0) */
} dt_tau_chain;

/* Walks the chain of every response span of a packed batch (T tokens, n_seq documents) over the
 * acceptance of the anchors (sorted ascending, each in [0, T); accepted[j] ≥ 0 for anchors[j]; values
 * past the span's end are capped as above). seq_steps [n_seq], when non-NULL, receives each document's
 * verify steps (undefined when the chain is incomplete). CM_ERR_INVALID_ARG naming the first problem
 * for a bad layout (dt_anchor_check), unsorted or out-of-range anchors or a negative acceptance. */
cm_status dt_tau_chain_walk(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                            const int32_t *anchors, const int32_t *accepted, int64_t n_anchors,
                            int64_t *seq_steps, dt_tau_chain *out);

/* tokens / steps; 0 with no step. */
double dt_tau_chain_tau(const dt_tau_chain *c);

#ifdef __cplusplus
}
#endif
#endif /* DT_TAU_CHAIN_H */
