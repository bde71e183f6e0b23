/* target-server/ts_model_int.h — what the files of the target model share (ts_model.c the loading,
 * ts_forward.c the forward, ts_cache.c the decoding cache) and nobody else needs: the model's
 * weights, its workspace and the cache's buffers. */
#ifndef TS_MODEL_INT_H
#define TS_MODEL_INT_H

#include "ts_model.h"

typedef struct ts_mat {
    void    *data;  /* backend memory, [rows, cols] */
    cm_dtype dtype; /* F32, BF16, or F8_E4M3 (then scale is set) */
    float   *scale; /* F8_E4M3: backend memory, [ceil(rows/128), kn_fp8_scale_ld(cols)] (kn_backend.h) */
} ts_mat;

typedef struct ts_layer {
    cm_layer_type type;
    float        *input_norm; /* [D] */
    float        *post_norm;  /* [D] */
    ts_mat        gate_proj, up_proj, down_proj;
    /* gated deltanet */
    ts_mat in_qkv, in_z, in_b, in_a, out_proj;
    float *conv_w;  /* [conv_dim, K] */
    float *A_log;   /* [nv] */
    float *dt_bias; /* [nv] */
    float *gdn_norm;/* [dv] */
    /* gated attention */
    ts_mat q_proj, k_proj, v_proj, o_proj;
    float *q_norm, *k_norm; /* [hd] */
} ts_layer;

typedef struct ts_ws {
    int64_t T; /* capacity in tokens */
    int32_t *ids, *cu, *pos;
    int32_t *pos_host; /* host staging of the positions (no allocation per forward) */
    float   *x, *h, *o, *big0, *big1, *big2, *q, *k, *v, *gate, *z, *a, *b, *g, *beta, *attn, *logits;
    uint16_t *h16;   /* fused path: bf16 [T, D], the normed input of the projections */
    uint16_t *act16; /* fused path: bf16 [T, max(I, nv·dv)], swiglu / gated-norm output */
    uint8_t  *h8;    /* FP8 weights: the normed input quantized, [kn_fp8_rows(T), D] e4m3 */
    float    *h8s;   /* and its 1 × 128 scales [ceil(D/128), kn_fp8_rows(T)] */
    int       h8_valid; /* h8 holds the current normed input */
} ts_ws;

struct ts_model {
    cm_target_cfg     cfg;
    const kn_backend *be;
    kn_ctx           *ctx;
    int               n_layers; /* loaded */
    int               has_head;
    ts_mat            embed;
    ts_mat            lm_head;  /* aliases embed when tied */
    float            *final_norm;
    ts_layer         *layers;
    ts_ws             ws;
    int               fused; /* the bf16 fast path (see the top of this file) */
    int               timing;
    ts_timing         tm;
    double           *gemm_acc; /* while timing: the sum the running block's GEMMs add to */
    /* during ts_model_forward_cached: the cache and the step (NULL otherwise) */
    ts_cache            *cache;
    const ts_cache_step *step;
    /* the head at chosen rows (ts_capture.n_head_rows): backend buffers for up to head_cap rows */
    int64_t  head_cap;
    int32_t *head_ids, *head_am, *head_lab;
    float   *head_h, *head_ce, *head_logits;
    int      head_has_logits;
};

/* The decoding cache (ts_cache.c). Per-layer arrays are indexed by layer; an entry is NULL for
 * a layer of the other kind. */
struct ts_cache {
    ts_model *m;
    int       n_slots;
    int64_t   max_len, max_step;
    float   **kc, **vc;        /* attention: [n_slots, max_len, nkv, hd] */
    float   **conv, **state;   /* GDN: [n_slots, K − 1, C], [n_slots, nv, dk, dv] */
    float   **sx, **sk, **sv, **sg, **sb; /* GDN: the kept step's inputs: [max_step, C], [.., nk·dk], [.., nv·dv], [.., nv] ×2 */
    int32_t  *d_slots, *d_base, *d_adv, *d_cu; /* backend: [n_slots], [n_slots], [n_slots], [n_slots + 1] */
    /* the step kept for ts_cache_commit */
    int      pending, pend_n_seq;
    int64_t  pend_T;
    int32_t *pend_cu; /* host [n_slots + 1] */
};


/* ts_forward.c: frees the workspace (the model's destroy calls it); the forward from scratch
 * (m->cache NULL, as ts_model_forward) or continued from m->cache at m->step (as
 * ts_model_forward_cached, which sets them around the call). */
void      ts_ws_release(ts_model *m);
cm_status ts_forward_run(ts_model *m, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                         const ts_capture *cap);

#endif /* TS_MODEL_INT_H */
