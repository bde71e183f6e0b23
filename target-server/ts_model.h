/* target-server/ts_model.h — the frozen hybrid Qwen target (Qwen3.5/3.6: Gated DeltaNet +
 * gated attention) loaded from a Hugging Face model directory onto one kernel backend, and
 * its forward over packed sequences with per-layer capture (docs/target.md).
 *
 * The model owns its weights (in backend memory) and a workspace that grows to the largest
 * batch seen; it borrows the backend and the context, which must outlive it. One thread
 * at a time. */
#ifndef TS_MODEL_H
#define TS_MODEL_H

#include <stdint.h>

#include "cm_cfg.h"
#include "cm_status.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_model ts_model;

typedef struct ts_model_config {
    const char       *dir;         /* model directory: config.json + safetensors (sharded or single) */
    const kn_backend *backend;     /* borrowed */
    kn_ctx           *ctx;         /* borrowed */
    int               n_layers;    /* load layers [first_layer, n_layers); -1 = all */
    int               first_layer; /* 0, or a pipeline stage's first layer (ts_split.h): the stage starts
                                      from the previous stage's output (ts_capture.x_in) and loads no
                                      embedding */
    int               load_head;   /* load the final norm and the LM head */
    int               bf16_weights;/* store GEMM weights as BF16 (F32 checkpoints are rounded) */
    int               fp8;         /* GEMM weights FP8 (docs/fp8.md): FP8 tensors of the checkpoint as
                                      stored, the others quantized on load in 128 × 128 blocks; the
                                      backend needs gemm_fp8. 0: FP8 tensors are dequantized on load
                                      (to BF16 with bf16_weights, else F32) */
    int               init_random; /* no checkpoint: dir is a config.json (or a directory holding one)
                                      and every tensor is filled on the device from seed, with the
                                      checkpoint's shapes and scales that keep 64 layers finite */
    uint64_t          seed;        /* for init_random; the same seed gives the same weights on
                                      every backend (fill_uniform) */
} ts_model_config;

/* Loads the config and the weights the forward needs; layers beyond n_layers, model.visual.*
 * and mtp.* are never read. Errors name the directory, the tensor and the fix. Caller
 * destroys with ts_model_destroy. With init_random nothing but the config is read; the
 * backend must have fill_uniform. TANDEM_LAYER_TIMING=1 in the environment turns timing on
 * (ts_model_set_timing) and logs each forward's breakdown at info level. */
cm_status ts_model_load(ts_model **out, const ts_model_config *cfg);
void      ts_model_destroy(ts_model **m); /* NULL-safe */
const cm_target_cfg *ts_model_cfg(const ts_model *m);
int                  ts_model_n_loaded_layers(const ts_model *m); /* the end of the loaded range */
int                  ts_model_first_layer(const ts_model *m);
int                  ts_model_has_head(const ts_model *m); /* final norm and LM head loaded */
/* Makes the model's device current on the calling thread (contexts on several GPUs in one
 * process). The forward, the cache and the decoder call it on entry. */
cm_status ts_model_bind(const ts_model *m);

/* Checks a packed batch against the model: 0 ≤ input_ids[t] < vocab_size, cu_seqlens[0] = 0,
 * strictly increasing, cu_seqlens[n_seq] = T. CM_ERR_INVALID_ARG with the first offending
 * index and value. */
cm_status ts_batch_validate(const cm_target_cfg *cfg, const int32_t *input_ids, int64_t T,
                            const int32_t *cu_seqlens, int n_seq);
/* The part of ts_batch_validate that depends on the model: 0 ≤ input_ids[t] < vocab_size
 * (for a batch whose shape is already checked, e.g. a decoded cm_proto_request). */
cm_status ts_tokens_validate(const cm_target_cfg *cfg, const int32_t *input_ids, int64_t T);

/* What a forward captures; host buffers owned by the caller. layer_out[i] receives the output
 * of decoder layer layers[i] (before the final norm) as F32 [T, D]; final_norm [T, D] and
 * logits [T, V] are computed only when non-NULL (they need every layer and load_head). */
typedef struct ts_capture {
    int     n_layers;
    const int *layers;   /* ascending, unique, < loaded layers */
    float **layer_out;   /* n_layers host buffers of T·D floats */
    float **layer_dev;   /* NULL, or n_layers buffers of T·D floats in the backend's memory: the
                            layers are copied there on the device and layer_out is not used */
    kn_ctx    *layer_dev_ctx; /* NULL: layer_dev is on this model's context; else the context it is on
                                 (another GPU: a peer copy per layer, as for x_out_dev) */
    float  *final_norm;  /* NULL or T·D floats */
    float  *logits;      /* NULL or T·V floats */
    /* NULL, or called instead of filling layer_out/layer_dev as the forward passes layers[i]:
     * x is that layer's output, F32 [T, D] in the backend's memory, valid for work the hook
     * enqueues on the context's stream before it returns (later layers overwrite it). The
     * forward goes on after the hook returns; a failure ends it. */
    cm_status (*on_layer)(void *user, int i, const float *x);
    void *user;
    /* The head at chosen rows only (decoding): n_head_rows > 0 runs the final norm and the LM
     * head on rows head_rows[0 .. n_head_rows) (host, token indices < T, any order, repeats
     * allowed) and writes, when non-NULL, head_argmax [n_head_rows] (the largest logit's index,
     * lowest on ties) and head_logits [n_head_rows, V] (host). final_norm and logits must then
     * be NULL. */
    int            n_head_rows;
    const int32_t *head_rows;
    int32_t       *head_argmax;
    float         *head_logits;
    /* NULL, or host [loaded layers][T, K] (K = num_experts_per_tok): each sparse MoE layer i
     * writes its tokens' chosen experts at experts + i·T·K, in descending routing weight (the
     * rows of dense layers are left as they were). */
    int32_t *experts;
    /* A pipeline stage's hand-over (ts_split.h), F32 [T, D]: x_in the input of a model loaded
     * from first_layer > 0 (instead of the embedding); x_out, when set, receives the residual
     * stream after the model's last loaded layer (every loaded layer then runs). In host memory,
     * or in backend memory: x_in_dev on this model's context, x_out_dev on x_out_ctx (another
     * context of the backend, maybe on another GPU: a peer copy). At most one input is given. */
    const float *x_in;
    float       *x_out;
    const float *x_in_dev;
    float       *x_out_dev;
    kn_ctx      *x_out_ctx;
} ts_capture;

/* Per-block times of the forwards since timing was turned on, in milliseconds, summed over
 * forwards and layers. Timing synchronises the device around every block and GEMM, so a timed
 * forward is slightly slower than an untimed one; the breakdown is what it is for. */
typedef struct ts_timing {
    int    forwards;                              /* forwards timed */
    int    gdn_layers, attn_layers, mlp_layers;   /* block runs timed */
    int    moe_layers, moe_grouped_layers;        /* of mlp_layers: MoE blocks, and those whose experts'
                                                     GEMMs ran grouped (moe_gemm) */
    double gdn_ms, attn_ms, mlp_ms;               /* whole blocks: norm … residual add (on the fused
                                                     bf16 path a block's add runs inside the norm
                                                     that opens the next block) */
    double gdn_core_ms, attn_core_ms;             /* the gated_delta_rule / attention kernels alone */
    double gdn_gemm_ms, attn_gemm_ms, mlp_gemm_ms;/* the GEMMs inside those blocks */
    double expert_gemm_ms;                        /* of mlp_gemm_ms: a MoE block's routed experts' GEMMs */
    double other_ms;                              /* embedding, captures, final norm, head */
    double total_ms;                              /* whole forwards */
} ts_timing;

/* 1 when the forward takes the fused bf16 path: the backend's gemm rounds its inputs to bf16
 * (cuda, KN_GEMM_MODE_BF16), so the norms, swiglu and the GDN gated norm write the GEMM
 * inputs as bf16 themselves, residual adds run inside the next norm and the GDN conv, split
 * and q/k l2norms are one op. TANDEM_TARGET_FUSED=0 in the environment at load turns it off,
 * =1 turns it on for any backend (the cpu then rounds GEMM inputs as cuda bf16 does). */
int ts_model_fused(const ts_model *m);

/* Readies the model for batches of up to max_tokens tokens before the first request: the
 * workspace at that size, then one forward over max_tokens tokens in 64-token sequences
 * (every layer, nothing captured) so that every op's scratch memory and every GEMM's cuBLASLt
 * plan exist from now on. Forwards within that size then allocate nothing, unless a batch has
 * more sequences than max_tokens / 64 (the GDN's per-chunk scratch grows once). */
cm_status ts_model_warmup(ts_model *m, int64_t max_tokens);

/* Turns per-block timing on (and clears the sums) or off. */
void ts_model_set_timing(ts_model *m, int on);
void ts_model_get_timing(const ts_model *m, ts_timing *out);

/* Runs the forward over one packed batch (host arrays; validated with ts_batch_validate)
 * and stops after the last layer the capture needs. Blocks until the outputs are on the
 * host. */
cm_status ts_model_forward(ts_model *m, const int32_t *input_ids, int64_t T, const int32_t *cu_seqlens,
                           int n_seq, const ts_capture *cap);

// ----------------------------------------------------------------------------
// incremental decoding (ts_cache.c): the state a forward leaves behind per sequence

/* Per sequence slot: every attention layer's keys and values for max_len positions (F32), every
 * GDN layer's last K − 1 conv inputs and recurrent state (F32), in the model's backend memory;
 * plus, for the step that is not committed yet, the GDN layers' inputs of its tokens (up to
 * max_step_tokens over all its sequences), from which ts_cache_commit advances the states. */
typedef struct ts_cache ts_cache;

/* Bytes a cache of these sizes takes in backend memory (the planner's and the session limit's
 * figure). */
size_t    ts_cache_bytes(const cm_target_cfg *cfg, int n_slots, int64_t max_len, int64_t max_step_tokens);
/* Allocates a cache for the model's loaded layers [first_layer, n_layers): decoding needs every
 * layer and the head, in one model (ts_decoder_create checks) or over a split's stages (one
 * cache per stage, ts_split_cache_create). CM_ERR_NOMEM names the bytes asked for. */
cm_status ts_cache_create(ts_model *m, int n_slots, int64_t max_len, int64_t max_step_tokens, ts_cache **out);
void      ts_cache_destroy(ts_cache **c); /* NULL-safe */
int       ts_cache_slots(const ts_cache *c);
int64_t   ts_cache_max_len(const ts_cache *c);
/* Zeroes a slot's state (a new sequence starts there). */
cm_status ts_cache_clear(ts_cache *c, int slot);

/* One cached forward's sequences: host arrays [n_seq]. Sequence s (its tokens packed by the
 * forward's cu_seqlens) lives in slot slots[s] (distinct) and has base[s] tokens cached before
 * them; base[s] + len_s ≤ max_len. n_adv NULL: the GDN states stay as they were and the step's
 * GDN inputs are kept for ts_cache_commit (len_s summed ≤ max_step_tokens); else every state
 * advances by the first n_adv[s] tokens during the forward (prefill: n_adv = len). Keys and
 * values of every new token are written into the cache either way (positions past what is
 * committed are simply overwritten later). */
typedef struct ts_cache_step {
    int            n_seq;
    const int32_t *slots, *base, *n_adv;
} ts_cache_step;

/* ts_model_forward continued from the cache: positions start at base[s], attention sees the
 * cached keys, GDN layers start from their cached states. The capture is as for
 * ts_model_forward (every layer runs when the head is asked for). Blocks until the outputs are
 * on the host. */
cm_status ts_model_forward_cached(ts_model *m, ts_cache *c, const ts_cache_step *st, const int32_t *input_ids,
                                  int64_t T, const int32_t *cu_seqlens, const ts_capture *cap);
/* Advances the GDN states of the last ts_model_forward_cached that kept its inputs (n_adv
 * NULL) by n_adv[s] tokens of its sequence s (host [n_seq], 0 ≤ n_adv[s] ≤ len_s): the
 * accepted prefix of a verified block. Once per such forward; CM_ERR_INVALID_ARG otherwise. */
cm_status ts_cache_commit(ts_cache *c, const int32_t *n_adv);

#ifdef __cplusplus
}
#endif
#endif /* TS_MODEL_H */
