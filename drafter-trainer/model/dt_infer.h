/* drafter-trainer/model/dt_infer.h — speculative drafting with a trained DFlash or DFlash2 drafter
 * (docs/drafter.md "Inference"), for several sequences at once, on either kernel backend.
 *
 * A dt_infer holds n_slots sequence slots. Each slot caches, per drafter layer, the keys and values
 * of its sequence's committed tokens: their target taps arrive step by step (dt_infer_append) and
 * are projected as the training forward projects context rows (fc, hidden_norm, then each layer's
 * k_proj + k_norm + RoPE at the row's position, and v_proj), once. A draft (dt_infer_draft) runs
 * one block per sequence: slot 0 the anchor token (the token the target returned) at position
 * len (the slot's committed length), slots 1 .. B−1 the mask token, attending to the slot's cached
 * rows before the anchor and to the block as in training (docs/drafter.md "Block attention",
 * sliding windows included), the target's LM head on slots 1 .. B−1; DFlash drafts the argmax of
 * each slot, DFlash2 walks its candidate selector over the unary top-K from slot 1 on (slot k's
 * predecessor is the token chosen at slot k − 1, slot 1's the anchor). With B the drafter's block
 * size the drafts are the argmaxes (DFlash) or the greedy selector choices (DFlash2) the training
 * forward computes for one anchor at len over the same context (tests/test_dt_infer.c); a smaller
 * B (served blocks may be shortened) runs the same layers on the shorter block.
 *
 * Memory: every buffer (the caches, [n_slots · max_len] rows per layer for keys and for values in
 * F32, and the block's working memory for n_slots blocks) is allocated by dt_infer_create and reused:
 * appends and drafts allocate nothing. When the backend's GEMMs round their inputs to bf16 anyway
 * (cuda in its bf16 GEMM mode) the weight matrices are kept as bf16 copies made at create time
 * (dt_infer_refresh after the masters change), which gives the same products without a conversion
 * pass per call. Appends write the caches with the backend's kv_cache_write where it has one. The
 * model (with its frozen embedding and LM head attached) is borrowed and must outlive the dt_infer;
 * it is only read. One thread. */
#ifndef DT_INFER_H
#define DT_INFER_H

#include <stddef.h>
#include <stdint.h>

#include "cm_status.h"
#include "dt_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_infer dt_infer;

typedef struct dt_infer_config {
    int     n_slots;    /* sequences held at once (≥ 1) */
    int64_t max_len;    /* committed rows one slot holds; a draft needs len < max_len */
    int     block;      /* block size B used, 2 .. the drafter's block_size; 0 = the drafter's */
    int64_t chunk_rows; /* context rows projected per pass (0: 256); bounds the append scratch */
} dt_infer_config;
#define DT_INFER_CONFIG_DEFAULT {1, 4096, 0, 0}

/* Allocates the caches and working memory for cfg on the model's backend. The model must have its
 * frozen embedding and LM head (dt_model_set_frozen). CM_ERR_UNSUPPORTED naming the missing entry
 * when the backend lacks an op the draft needs; CM_ERR_INVALID_ARG for a config out of range
 * (DFlash2: B ≥ conv_kernel_size). Caller destroys with dt_infer_destroy. */
cm_status dt_infer_create(dt_infer **out, const dt_model *m, const dt_infer_config *cfg);
void      dt_infer_destroy(dt_infer **inf); /* NULL-safe; sets *inf = NULL */

/* Copies the model's weights again (the bf16 copies; a no-op when there are none). */
cm_status dt_infer_refresh(dt_infer *inf);
/* Forgets a slot's context (its committed length becomes 0); the next append starts at position 0. */
void    dt_infer_reset(dt_infer *inf, int slot);
int64_t dt_infer_len(const dt_infer *inf, int slot); /* committed rows of a slot */
int     dt_infer_block(const dt_infer *inf);         /* B */
int     dt_infer_n_slots(const dt_infer *inf);       /* n_slots */
size_t  dt_infer_bytes(const dt_infer *inf);         /* backend memory held */

/* Newly committed rows of several sequences, packed in the order given: sequence i's n_rows[i]
 * rows follow sequence i − 1's. Tap k (target_layer_ids order) of packed row r is the D values at
 * tap[k] + r · ld elements, in dt (F32 or BF16), on the host: ld = D for separate per-layer
 * tensors (a decoding answer's "layer_<id>"), n_taps · D with tap[k] = F + k · D for the trainer's
 * feature rows F [rows, n_taps · D]. */
typedef struct dt_infer_rows {
    int            n_seq;
    const int32_t *slots;  /* [n_seq], distinct */
    const int32_t *n_rows; /* [n_seq], each ≥ 0 */
    const void    *tap[DT_MAX_TAPS];
    cm_dtype       dt;
    int64_t        ld;
} dt_infer_rows;

/* Appends the rows to their slots' caches at positions len, len + 1, ... (then len grows by n_rows).
 * CM_ERR_INVALID_ARG (nothing appended) for a slot out of range or repeated, or a slot that would
 * pass max_len. Completes before return (the host rows may be reused). */
cm_status dt_infer_append(dt_infer *inf, const dt_infer_rows *rows);

/* Drafts one block for each of n sequences (1 ≤ n ≤ n_slots): slots[i] (distinct) with anchor
 * token anchor[i] at position dt_infer_len(slots[i]) (< max_len). Writes drafts [n, B − 1]: row i's
 * tokens for block slots 1 .. B − 1. probs [n, B − 1], optional (NULL: not computed): DFlash, the
 * slot's largest softmax probability (that of its draft); DFlash2, the selector's K-way softmax
 * probability of its choice. The caches are not changed. Completes before return. */
cm_status dt_infer_draft(dt_infer *inf, int n, const int32_t *slots, const int32_t *anchor, int32_t *drafts,
                         float *probs);
/* dt_infer_draft with a shorter block of `block` slots (2 ≤ block ≤ B; for DFlash2 at least its
 * conv_kernel_size): drafts and probs [n, block − 1]. A decoder shortens the block where fewer
 * tokens remain, as z-lab's does; on a non-causal drafter that changes the drafts. */
cm_status dt_infer_draft_block(dt_infer *inf, int block, int n, const int32_t *slots, const int32_t *anchor,
                               int32_t *drafts, float *probs);

#ifdef __cplusplus
}
#endif
#endif /* DT_INFER_H */
