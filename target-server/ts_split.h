/* target-server/ts_split.h — one target spread over several kernel contexts as pipeline stages
 * (docs/target.md, "A target on several GPUs"): stage s holds the layers [bounds[s], bounds[s+1])
 * on its own context (a GPU, or a cpu context), the first stage also the embedding and the last
 * the head. A forward runs the stages in turn; between two stages the residual stream [T, D]
 * goes from one stage's memory to the next one's (a peer copy, GPU to GPU, or a device copy on
 * one GPU; never through the host). Captures are gathered from whichever stage holds a layer, so a split
 * forward writes exactly what one ts_model_forward writes: the stages run the same kernels on the
 * same values in the same order, and fp32 captures are bit-identical to one context's.
 *
 * Several packs can be in flight (ts_split_forward_with from several threads): each stage takes
 * one pack at a time, in stage order. A split target also decodes: a ts_split_cache holds one
 * ts_cache per stage, and a cached forward runs every stage. */
#ifndef TS_SPLIT_H
#define TS_SPLIT_H

#include "ts_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_SPLIT_MAX_STAGES 16

typedef struct ts_split          ts_split;
typedef struct ts_split_handover ts_split_handover;

/* The default boundaries of the first n_layers layers over n stages: balanced by each layer's
 * weight bytes (GDN, attention, dense MLP and MoE layers differ), every stage at least one
 * layer. bounds [n + 1], bounds[0] = 0, bounds[n] = n_layers. n ≤ n_layers. */
void ts_split_even(const cm_target_cfg *cfg, int n_layers, int n, int *bounds);

/* Loads base->dir (base's precision and init; its n_layers bounds the layers loaded, -1 all;
 * its backend, ctx and first_layer are replaced) over n ≤ TS_SPLIT_MAX_STAGES stages on
 * ctxs[0..n), with bounds [n + 1] (NULL: ts_split_even). The last stage loads the head when
 * base->load_head. One message names the stage that failed. */
cm_status ts_split_load(ts_split **out, const ts_model_config *base, int n, kn_ctx *const *ctxs, const int *bounds);
void      ts_split_destroy(ts_split **s); /* NULL-safe */
int       ts_split_stages(const ts_split *s);
const cm_target_cfg *ts_split_cfg(const ts_split *s);
/* ts_model_warmup of every stage: its workspace and plans for max_tokens, before the first request. */
cm_status ts_split_warmup(ts_split *s, int64_t max_tokens);
/* Stage i's first layer (i < stages) or the end of the loaded layers (i = stages). */
int ts_split_bound(const ts_split *s, int i);
/* ts_model_forward over the stages: layer_out, final_norm, logits and experts as there (host
 * buffers), or the layers gathered in one context's memory (layer_dev with layer_dev_ctx: a
 * stage's or any other context of the backend; each stage copies its layers there, a peer copy
 * from another GPU); on_layer, the head at chosen rows and the stage hand-over fields are
 * refused. Stages past the last one the capture needs do not run. One caller at a time (the
 * hand-over is the split's own). */
cm_status ts_split_forward(ts_split *s, const int32_t *input_ids, int64_t T, const int32_t *cu_seqlens, int n_seq,
                           const ts_capture *cap);
/* A caller's hand-over: each stage's input, F32 [T, D] on that stage's context (grown to the
 * largest T seen, under the stage's lock). Destroy it before its split. */
cm_status ts_split_handover_create(ts_split *s, ts_split_handover **out);
void      ts_split_handover_destroy(ts_split_handover **h); /* NULL-safe */
/* The same with the caller's hand-over h: any number of threads at once, each with its own h.
 * A pack takes the stages in order, one pack per stage at a time, so several packs run in the
 * pipeline together, each stage on another. */
cm_status ts_split_forward_with(ts_split *s, ts_split_handover *h, const int32_t *input_ids, int64_t T,
                                const int32_t *cu_seqlens, int n_seq, const ts_capture *cap);

// ----------------------------------------------------------------------------
// decoding (ts_model.h's cache, one per stage)

typedef struct ts_split_cache ts_split_cache;

/* A decoding cache over every stage: each stage's ts_cache on its own context. Needs every layer
 * of the target and the head loaded (CM_ERR_INVALID_ARG otherwise). */
cm_status ts_split_cache_create(ts_split *s, int n_slots, int64_t max_len, int64_t max_step, ts_split_cache **out);
void      ts_split_cache_destroy(ts_split_cache **c); /* NULL-safe */
/* ts_model_forward_cached over the stages: every stage runs (each one's cache sees the new
 * tokens), the residual stream handed over stage to stage, captures from the stage that
 * holds each layer, the head (all rows or chosen rows) on the last. layer_dev, on_layer and the
 * hand-over fields are refused. Takes each stage's lock like ts_split_forward_with. */
cm_status ts_split_forward_cached(ts_split_cache *c, const ts_cache_step *st, const int32_t *input_ids, int64_t T,
                                  const int32_t *cu_seqlens, const ts_capture *cap);
/* ts_cache_commit and ts_cache_clear on every stage. */
cm_status ts_split_cache_commit(ts_split_cache *c, const int32_t *n_adv);
cm_status ts_split_cache_clear(ts_split_cache *c, int slot);

#ifdef __cplusplus
}
#endif
#endif /* TS_SPLIT_H */
