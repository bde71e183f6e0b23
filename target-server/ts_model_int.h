/* target-server/ts_model_int.h — what the files of the target model share (ts_model.c the loading,
 * ts_load_fp8.c its FP8 part, ts_load_moe.c the MoE and Qwen3-Next parts, ts_forward.c the
 * forward, ts_forward_moe.c its sparse block, ts_cache.c the decoding cache) and
 * nobody else needs: the model's weights, the loader, the workspace and the cache's buffers. */
#ifndef TS_MODEL_INT_H
#define TS_MODEL_INT_H

#include "cm_quant.h"
#include "cm_safetensors.h"
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
    /* sparse MoE block (moe; docs/moe.md), instead of gate/up/down_proj */
    int     moe;
    ts_mat  router;                    /* mlp.gate [E, D] */
    ts_mat *ex_gate, *ex_up, *ex_down; /* E each: [Ie, D], [Ie, D], [D, Ie] */
    void  **ex_ptrs;                   /* backend memory: the E gate, E up and E down matrices' data for
                                          moe_gemm when all are BF16, or for moe_gemm_fp8 when all are
                                          F8_E4M3 (then followed by their 3E scales), else NULL (one GEMM
                                          per expert) */
    int     ex_fp8;                    /* ex_ptrs holds FP8 matrices and their scales */
    ts_mat  sh_gate, sh_up, sh_down;   /* the shared expert: [Is, D], [Is, D], [D, Is] (absent: Is = 0) */
    ts_mat  sh_router;                 /* shared_expert_gate [1, D] */
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
    int       o_added;  /* the block's output projection went straight onto x (ts_forward.c, out_gemm) */
    uint8_t  *act8;  /* FP8 down projections on the fused path: swiglu's output quantized, [kn_fp8_rows(T), I] */
    float    *act8s; /* and its scales [ceil(I/128), kn_fp8_rows(T)] */
    /* MoE layers (ts_forward_moe.c; NULL for a dense model), with R = T·K routed rows */
    float   *rlogits;            /* [T, E] the router's logits */
    int32_t *ridx, *roff, *rsrc, *rdst; /* [T, K], [E + 1], [R], [R] (moe_route, moe_group) */
    float   *rw;                 /* [T, K] the routing weights */
    void    *xg;                 /* [R, D] the gathered inputs (bf16 on the fused path, else f32) */
    float   *eg, *eu;            /* [R, Ie] gate and up */
    void    *eact;               /* [R, Ie] swiglu (bf16 on the fused path, else f32) */
    float   *ey;                 /* [R, D] the experts' outputs */
    uint8_t *eact8;              /* grouped FP8 experts: swiglu quantized, [kn_fp8_rows(R), Ie] e4m3 */
    float   *eact8s;             /* and its scales [ceil(Ie/128), kn_fp8_rows(R)] */
    float   *sh, *shg;           /* [T, D] the shared expert's output, [T] its gate's logit */
    int32_t *roff_host;          /* host [E + 1] */
} ts_ws;

struct ts_model {
    cm_target_cfg     cfg;
    const kn_backend *be;
    kn_ctx           *ctx;
    int               n_layers;    /* layers [first_layer, n_layers) are loaded; m->layers has n_layers entries, */
    int               first_layer; /* those below first_layer zero (a pipeline stage's, ts_split.c) */
    int               has_head;
    ts_mat            embed;
    ts_mat            lm_head;  /* aliases embed when tied */
    float            *final_norm;
    ts_layer         *layers;
    ts_ws             ws;
    int               fused; /* the bf16 fast path (see the top of this file) */
    int               residual_gemm; /* fused: out_proj, down_proj add onto x (TANDEM_TARGET_RESIDUAL_GEMM) */
    int               bf16_products; /* fused: gate/up_proj write bf16 for swiglu (TANDEM_TARGET_BF16_PRODUCTS) */
    int               moe_grouped; /* the experts' GEMMs in one moe_gemm call where it can (TANDEM_MOE_GEMM) */
    int               moe_fp8_loop; /* the backend turned moe_gemm_fp8 down here: FP8 experts one GEMM each */
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


// ----------------------------------------------------------------------------
// loading (ts_model.c; the FP8 weights in ts_load_fp8.c, docs/fp8.md)

/* What a matrix of the forward may be in FP8. */
typedef enum ts_mat_role {
    TS_MAT_ROLE_QUANT = 0, /* a projection Qwen's FP8 releases quantize (q/k/v/o_proj, in_proj_qkv,
                              in_proj_z, out_proj, gate/up/down_proj): FP8 as stored, and under
                              fp8 quantized on load when stored BF16 or F32 */
    TS_MAT_ROLE_GEMM,      /* a GEMM kept bf16 by Qwen (in_proj_a, in_proj_b): FP8 only when stored so */
    TS_MAT_ROLE_TABLE,     /* read by rows or by lm_ce (embed_tokens, lm_head): never FP8 */
} ts_mat_role;

typedef struct ts_loader {
    ts_model           *m;
    const cm_st        *st;
    const cm_quant_cfg *quant;  /* the checkpoint's quantization_config (fp8 = 0 when none) */
    const char         *prefix; /* "model.language_model." or "model." */
    const char         *dir;
    int                 bf16_weights;
    int                 fp8;    /* ts_model_config.fp8 */
    int                 random; /* init_random: fill instead of read */
    uint64_t            seed;
    int n_fp8_stored, n_fp8_quantized, n_fp8_dequantized; /* matrices, for the load's log line */
} ts_loader;

/* fp8: the backend runs FP8 GEMMs on this context (gemm_fp8, fp8_quantize_weight and
 * fp8_supported present, fp8_supported says yes); else CM_ERR_UNSUPPORTED with its reason and
 * the way out (--precision bf16). */
cm_status ts_fp8_check_backend(const ts_model *m);
/* The checkpoint's FP8 tensors among those the load reads (layers [0, n_layers), the
 * embedding, the final norm and, with load_head, lm_head): every F8_E4M3 tensor has its
 * <name>_scale_inv and is not listed as unconverted by the config, and every _scale_inv has an
 * F8_E4M3 weight beside it. One message naming the tensor, its file and what to do. */
cm_status ts_fp8_scan(const ts_loader *ld, int n_layers, int load_head);
/* A matrix stored F8_E4M3 (t, shape [rows, cols] checked) with scale s (NULL: refused): under
 * fp8 uploaded as stored (bytes and fp32 scales in kn_fp8_scale_ld rows), else dequantized on
 * the host to BF16 (bf16_weights) or F32. name is the full tensor name. */
cm_status ts_fp8_load_stored(ts_loader *ld, const char *name, const cm_st_tensor *t, const cm_st_tensor *s,
                             int64_t rows, int64_t cols, ts_mat_role role, ts_mat *out);
/* Quantizes w (BF16 or F32 in backend memory, [rows, cols]) to FP8 on the device in place of its
 * data (the old buffer freed). */
/* A stored FP8 matrix [rows, cols] loaded as n_pieces matrices of its rows: piece p has
 * piece_rows[p] rows, row j of the pieces (back to back) being row map[j] of t. Each destination
 * 128-row block must take all its rows from one stored 128-row block, so that the stored scales
 * carry over unchanged (Qwen3-Next's in_proj_qkvz); otherwise the load is refused. */
cm_status ts_fp8_load_rows(ts_loader *ld, const char *name, const cm_st_tensor *t, const cm_st_tensor *s,
                           int64_t rows, int64_t cols, const int64_t *map, int n_pieces, const int64_t *piece_rows,
                           ts_mat *const *out);
cm_status ts_fp8_quantize(ts_loader *ld, const char *name, int64_t rows, int64_t cols, ts_mat *w);
/* CM_ERR_UNSUPPORTED for a tensor stored F8_E4M3 that Tandem reads as a bf16/f32 table or
 * vector (embed_tokens, lm_head, norms, conv1d, A_log, dt_bias); CM_OK for any other dtype. */
cm_status ts_fp8_refuse_table(const cm_st_tensor *t);
/* Frees a matrix's data and scales (NULL-safe) and zeroes it. */
void ts_mat_free(ts_model *m, ts_mat *w);

/* The sparse MoE block's weights of layer i (ts_load_moe.c): router, experts in either layout
 * (fused 3-D gate_up_proj / down_proj, or per expert), shared expert and its gate. */
cm_status ts_load_moe(ts_loader *ld, int i, ts_layer *L);
/* Qwen3-Next's fused in_proj_qkvz / in_proj_ba of layer i un-interleaved into in_qkv, in_z,
 * in_b, in_a (ts_load_moe.c). */
cm_status ts_load_next_gdn(ts_loader *ld, int i, ts_layer *L);
/* Frees layer L's MoE weights. */
void ts_moe_free(ts_model *m, ts_layer *L);
/* ts_model.c, shared with ts_load_moe.c: the dtype a matrix stored as `stored` is kept in on the
 * device (BF16 when stored so or under bf16_weights, else F32); loading a [rows, cols] matrix named
 * prefix+name (raw: exactly name) as its role and the precision say; and the same from host values
 * already read in ts_load_dtype's dtype dt, name naming it in messages. */
cm_dtype  ts_load_dtype(const ts_loader *ld, cm_dtype stored);
cm_status ts_load_mat(ts_loader *ld, const char *name, int raw, ts_mat_role role, int64_t rows, int64_t cols,
                      ts_mat *out);
cm_status ts_load_mat_host(ts_loader *ld, const char *name, const void *host, cm_dtype dt, ts_mat_role role,
                           int64_t rows, int64_t cols, ts_mat *out);

/* ts_forward.c: frees the workspace (the model's destroy calls it); the forward from scratch
 * (m->cache NULL, as ts_model_forward) or continued from m->cache at m->step (as
 * ts_model_forward_cached, which sets them around the call). */
void      ts_ws_release(ts_model *m);
cm_status ts_forward_run(ts_model *m, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                         const ts_capture *cap);

/* A GEMM's input for ts_gemm: exactly one of an F32 matrix, a BF16 one written by its producer
 * (fused path), or one already quantized for FP8 weights (q8 with its scales s8, in
 * fp8_quantize_rows' layout). */
typedef struct gemm_in {
    const float    *f32;
    const uint16_t *bf16;
    const uint8_t  *q8;
    const float    *s8;
    int             out_bf16; /* the product written BF16: gemm_fp8q's odt with q8, matmul with bf16 */
    int             acc;      /* the F32 product added onto out (gemm_bf16in_acc, gemm_fp8q_acc) */
} gemm_in;
/* ts_forward.c: out [M, N] = in · wᵀ by the backend's GEMM for the weight's type and the
 * input's form (timed into the running block's GEMM time); ts_gemm_h the same from the block's
 * normed input (ws.h16 on the fused path, else ws.h; quantized once per norm for FP8 weights). */
/* The time now once the device has finished everything queued; 0 when timing is off. */
cm_status ts_mark(ts_model *m, double *t);
cm_status ts_gemm(ts_model *m, void *out, gemm_in in, const ts_mat *w, int64_t M, int64_t N, int64_t K);
cm_status ts_gemm_h(ts_model *m, float *out, const ts_mat *w, int64_t M, int64_t N, int64_t K);
/* The block's normed input [M, K] quantized into ws.h8 / ws.h8s (once per norm; FP8 weights). */
cm_status ts_quant_h(ts_model *m, int64_t M, int64_t K);
/* ts_forward_moe.c: the workspace's MoE buffers for T tokens (none for a dense model), and the
 * sparse block of layer li from the normed input into ws.o; cap->experts, when set, receives
 * the layer's routing. */
cm_status ts_moe_reserve(ts_model *m, int64_t T);
void      ts_moe_release(ts_model *m);
cm_status ts_forward_moe(ts_model *m, const ts_layer *L, int li, int64_t T, const ts_capture *cap);
/* One info line on how a MoE model's experts' GEMMs run (grouped, or per expert and why). */
void      ts_moe_log_plan(const ts_model *m);

#endif /* TS_MODEL_INT_H */
