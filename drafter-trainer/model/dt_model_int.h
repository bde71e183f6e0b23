/* drafter-trainer/model/dt_model_int.h — private to model/dt_model*.c (and dt_infer.c, which reads the
 * parameters and the frozen embedding and LM head): the dt_model struct, its activation plan and the
 * helpers the files of the drafter share.
 *
 * The DFlash drafter on the kernel backend table (DFlash2's additions: dt_model_conv.c, dt_model_sel.c):
 * parameters (one allocation for the fp32 masters, one for their grads, carved per tensor in the serving-key
 * order), the borrowed frozen embedding and LM head, and one training step (docs/drafter.md): host-side block
 * layout, labels and weights, then forward, loss and backward.
 *
 * Activations the backward needs are saved per layer in one backend allocation, planned
 * for the largest batch seen and reused. They are stored in the activation dtype: F32, or
 * BF16 when the backend's gemm rounds its inputs to bf16 anyway (cuda --precision bf16), so
 * a saved GEMM input costs half and feeds the GEMM without a conversion pass. Everything the
 * forward saves in BF16 it also goes on with as rounded (the residual stream at each save,
 * q/k before their norms, v), so the backward's recomputations see the forward's exact
 * values. Only what needs a GEMM to rebuild is saved: the norms' outputs (input and
 * post-attention layernorm, q/k norm and RoPE) are recomputed in the backward from their
 * saved inputs, the SwiGLU product too, and the MLP backward writes dgate/dup over the saved
 * gate/up. Each layer's gate/up span is also the attention scratch of that layer (the
 * forward's attention runs before the MLP writes it, the backward's after the MLP backward
 * has consumed it); what does not fit there, and the other phases' temporaries, share one
 * work region. The passes over saved rows are fused where they meet: the q/k/v projections
 * write their saved outputs straight from the GEMM; one pass rounds, saves and norms the residual
 * stream (rmsnorm_typed); the q/k norms and RoPE read the saved projections where they are
 * (head_norm_rope) and their backward rotates and norms in one (head_norm_rope_bwd); every norm
 * backward reads its saved input as stored and, with BF16 storage, writes the bf16 dx the next
 * layer half's first GEMMs take (dt_model_dx_op). With BF16 GEMMs each layer projection is rounded to bf16
 * once a step, into a copy that lives in an earlier layer's not-yet-written gradient (dt_model_w16.c), and
 * every GEMM of the step reads that. Context rows pass only through fc, hidden_norm and each
 * layer's k/v projections, so their key and value gradients from every layer sum into one dctx. One thread;
 * every op is CM_TRY'd. */
#ifndef DT_MODEL_INT_H
#define DT_MODEL_INT_H

#include <stddef.h>
#include <stdint.h>

#include "dt_model.h"

#define DT_MAX_BLOCK 64 /* dt_step_stats holds 64 slots */
#define DT_ALIGN     64 /* bytes: every carved buffer starts on this boundary */

/* Per-layer parameters, in serving-key order after fc.weight and hidden_norm.weight. */
enum {
    LP_INPUT_LN = 0,
    LP_Q,
    LP_K,
    LP_V,
    LP_O,
    LP_Q_NORM,
    LP_K_NORM,
    LP_POST_LN,
    LP_GATE,
    LP_UP,
    LP_DOWN,
    LP_COUNT, /* DFlash's per-layer count; DFlash2 adds the two convolutions: */
    LP_ACONV_BASE = LP_COUNT, /* attention_conv.base_kernel [2, Kc, D] */
    LP_ACONV_PROJ,            /* attention_conv.kernel_projection.weight [2·Kc·n_g, D] */
    LP_MCONV_BASE,            /* mlp_conv.base_kernel */
    LP_MCONV_PROJ,            /* mlp_conv.kernel_projection.weight */
    LP_COUNT2
};
#define P_FC          0
#define P_HIDDEN_NORM 1
#define P_LAYER0      2
/* After the layers: norm.weight (m->p_norm), then DFlash2's selector (m->p_sel): */
enum { SP_PRED = 0, SP_SUCC, SP_HPROJ, SP_COUNT };

/* What layer l saved in the forward for the backward, in the activation dtype (adt).
 * R = n_anchors · B block rows. */
typedef struct dt_layer_acts {
    void  *x;           /* [R, D] residual stream into the layer */
    void  *q_pre;       /* [R, nq·hd] q_proj(input_layernorm(x)) */
    void  *kc_pre, *vc; /* [T, nkv·hd] context: k_proj(ctx), v_proj(ctx) */
    void  *kb_pre, *vb; /* [R, nkv·hd] the same for the block rows; vb follows vc in memory */
    void  *attn;        /* [R, nq·hd] attention output */
    float *lse;         /* [R, nq] */
    void  *x_mid;       /* [R, D] x + o_proj(attn) */
    void  *gate, *up;   /* [R, I] gate_proj(h2), up_proj(h2), one span (up follows gate);
                           the backward overwrites them with their gradients */
    /* DFlash2 (NULL for DFlash): each convolution's coefficients δ = u · kernel_projectionᵀ (F32
     * [R, 2·Kc·n_g]) and the sublayer's output before the output-side convolution (adt [R, D]) */
    float *dA, *dM;
    void  *sA, *sM;
} dt_layer_acts;

/* The temporaries of the attention of one layer (forward: q and k after their norms and RoPE,
 * in the saved activations' dtype, the attention's operands; backward: those again, the output
 * gradient, the five input gradients and the pre-norm q/k gradients), placed first-fit in the
 * layer's gate/up span, the rest in the work region. v and the output are the saved A->vc/vb and
 * A->attn themselves. */
enum {
    AS_Q = 0, /* [R, Q] q (adt) */
    AS_DQP,   /* [R, Q] dq_pre (the GEMMs' operand dtype) */
    AS_DO,    /* [R, Q] dattn (F32) */
    AS_DQ,    /* [R, Q] (F32) */
    AS_K,     /* [T + R, KV] k (adt): the context rows, then the block rows */
    AS_DKPC,  /* [T, KV] dkc_pre (the GEMMs' operand dtype; BF16: then dvc rounded, in the second half) */
    AS_DKPB,  /* [R, KV] dkb_pre (likewise dvb) */
    AS_DKC,
    AS_DVC, /* [T, KV] (F32) */
    AS_DKB,
    AS_DVB, /* [R, KV] (F32) */
    AS_COUNT
};
/* The fc/hidden_norm temporaries (forward start, backward end), in layer 0's span or the
 * work region: ctx_pre and ctx in F32; then ctx_pre again and dctx_pre. */
enum { FS_PRE = 0, FS_OUT, FS_COUNT };

typedef struct dt_slot {
    int    in_span; /* 1: offset into a layer's gate/up span; 0: into the work region */
    size_t off;     /* bytes */
} dt_slot;

/* Backend buffers for one step, sized for T_cap context rows and R_cap block rows. */
typedef struct dt_acts {
    int64_t  T_cap, R_cap;
    void    *base;
    size_t   bytes;                       /* of base */
    int32_t *blk_ids, *blk_pos, *ctx_pos; /* [R], [R], [T] */
    int32_t *anchors, *ctx_lo;            /* [n_anchors] */
    int32_t *labels, *argmax;             /* [R] (first n_sel used) */
    int32_t *sel, *inv;                   /* [R] selected row → block row; block row → selected
                                             row or n_sel (the zero row of dhsel) */
    float *gscale, *ce;                   /* [R] */
    float *F;                             /* [T, n·D] F32: target features (adt F32 only; BF16
                                             reads the taps where they are, see dt_model.tap) */
    void          *ctx_pre, *ctx;         /* [T, D] adt: F·fcᵀ; hidden_norm of it */
    dt_layer_acts *layer;                 /* [L] (host array of pointers into base) */
    /* F32 [R, D] buffers of both passes: xw the residual stream (forward; x_out at the end),
     * then the widened saved x / x_mid (backward with BF16 storage) or the recomputed normed
     * rows (F32 storage); dx its gradient (the forward's normed rows and the selected rows of
     * the loss before that); dh the gradient of a norm's output (the forward's o_proj/down
     * outputs, the final norm's output, the backward's normed rows before their BF16 copy) */
    float  *xw, *dx, *dh;
    void   *H;    /* [R, D] BF16: normed rows as GEMM input (adt BF16 only) */
    float  *dctx; /* [T, D] */
    /* DFlash2 only: F32 [R, D] the sublayer input u, its convolved u' (then ∂/∂u); [R, 2·Kc·n_g] ∂/∂δ. The selector over the n_sel rows: the unary
     * top-K, label logits, predecessors, u = h·W_hᵀ and its gradient [R, Rk], and selector_fwd's
     * outputs. */
    float   *cu, *cup, *cdd;
    int32_t *topk_idx, *pred, *cand, *lab_pos, *choice; /* [R, K], [R], [R, K], [R], [R] */
    float   *topk_val, *lab_logit, *score, *sce, *sgs;  /* [R, K], [R], [R, K], [R], [R] */
    float   *su, *sdu;                                  /* [R, Rk] */
    void   *work; /* the work region (see dt_slot) */
    size_t  span_bytes, work_bytes;
    dt_slot as[AS_COUNT], fs[FS_COUNT];
} dt_acts;

/* Host-side layout of the current batch (grown with the plan). */
typedef struct dt_host {
    int32_t *blk_ids, *blk_pos, *ctx_pos, *ctx_lo; /* [R], [R], [T], [n_anchors] */
    int32_t *sel_row, *labels, *argmax;            /* [R]: selected row → block row, label, argmax */
    int32_t *inv;                                  /* [R] block row → selected row, or n_sel */
    double  *weight;                               /* [R] w of each selected row */
    float   *gscale, *ce;                          /* [R] */
    /* DFlash2: per selected row the predecessor token, selector_fwd's label position, choice and
     * K-way CE, and the selector term's gscale */
    int32_t *pred, *lab_pos, *choice;
    float   *sce, *sgs;
} dt_host;

struct dt_model {
    cm_drafter_cfg    cfg;
    const kn_backend *be;
    kn_ctx           *ctx;
    int               n_params;
    int               n_lp;   /* parameters per layer: LP_COUNT (DFlash) or LP_COUNT2 (DFlash2) */
    int               p_norm; /* index of norm.weight */
    int               p_sel;  /* index of the selector's first parameter (DFlash2), else −1 */
    int               ng;     /* DFlash2: groups per convolution, hidden_size / conv_group_size */
    dt_selector_opts  sel;
    dt_param         *params;
    char (*names)[80];
    float       *data_base, *grad_base; /* backend; carved into params */
    dt_grad_hook grad_hook;             /* dt_model_set_grad_hook, or NULL */
    void        *grad_hook_user;
    size_t       n_slab; /* floats in each slab (with alignment padding) */
    /* [n_params]: 1 while a parameter whose gradient only dW matmuls make (grad_by_matmul in
     * dt_model.c) still holds the last step's values; its first matmul of the step writes it
     * (dt_model_grad_first), and dt_model_grads_settle zeroes it if none did */
    unsigned char *grad_unset;
    /* [n_params] each: where parameter i's bf16 copy lives this step (in the gradient of parameter
     * w16_host[i]; dt_model_w16.c), or NULL where its GEMMs round it per call; 1 once made */
    void         **w16;
    int           *w16_host;
    unsigned char *w16_made;
    int            w16_written; /* dt_model_w16_written since the last step began */
    /* frozen target embedding and LM head, [V, D] */
    void    *embed, *lm_head;
    cm_dtype embed_dt, lm_head_dt;
    int      lm_head_shared; /* lm_head aliases embed */
    int64_t  V;
    cm_dtype adt; /* saved activations: F32, or BF16 when gemm rounds its inputs (see the top) */
    /* With BF16 storage fc multiplies tap by tap (F · fcᵀ = Σ_k tap_k · fc[:, kD:(k+1)D]ᵀ) from
     * where the taps are: the batch's device taps, or Fh, the host features rounded to BF16 on
     * upload, tap by tap like device taps ([n_taps][T_cap, D], each tap 256-byte aligned; a
     * separate allocation made by the first host-fed step). Both paths run the same GEMMs with
     * the same layout on the same values, so they give the same bits. */
    const void *tap[DT_MAX_TAPS];
    cm_dtype    tap_dt;
    int64_t     tap_ld;
    void       *Fh;
    int64_t     Fh_T;
    dt_acts     acts;
    dt_host     host;
    /* the current batch */
    int64_t T, n_anchors, R, n_sel;
    double  weight_sum;
    double  sel_weight_sum; /* DFlash2: Σ w over the slots in the selector term */
};

static inline size_t align_floats(size_t n) {
    const size_t a = DT_ALIGN / sizeof(float);
    return (n + a - 1) / a * a;
}

static inline int dt_model_is_v2(const dt_model *m) {
    return m->cfg.kind == CM_DRAFTER_DFLASH2;
}

/* Is per-layer parameter j one of the layer's projections (q, k, v, o, gate, up, down), the matrices
 * whose gradients only dW matmuls make and whose GEMMs take bf16 copies? */
static inline int dt_lp_is_projection(int j) {
    return j == LP_Q || j == LP_K || j == LP_V || j == LP_O || j == LP_GATE || j == LP_UP || j == LP_DOWN;
}

/* The dtype for a gradient that only feeds GEMMs: BF16 where the backend's GEMMs round their F32
 * operands to bf16 anyway (the same values, without the conversion each GEMM would make), else F32. */
static inline cm_dtype dt_model_gemm_op_dt(dt_model *m) {
    return m->adt == CM_DTYPE_BF16 && m->be->gemm_rounds_input && m->be->gemm_rounds_input(m->ctx)
               ? CM_DTYPE_BF16
               : CM_DTYPE_F32;
}

/* parameters (dt_model.c) */
dt_param *dt_model_lp(dt_model *m, int l, int j);
cm_status dt_model_dev_zero(dt_model *m, float *p, int64_t n);
void      dt_model_acts_release(dt_model *m);
cm_status dt_model_grads_final_from(dt_model *m, int i);
cm_status dt_model_grads_begin(dt_model *m);
cm_status dt_model_grads_settle(dt_model *m, int from);
int       dt_model_grad_first(dt_model *m, const dt_param *p);
/* the bf16 weight copies (dt_model_w16.c): planned at create, reset at each step's start (kept
 * when an optimizer wrote them); the GEMM operand of parameter p, its copy (made on first use
 * unless written) or the F32 master */
cm_status dt_model_w16_plan(dt_model *m);
void      dt_model_w16_release(dt_model *m);
void      dt_model_w16_begin(dt_model *m);
cm_status dt_model_weight(dt_model *m, const dt_param *p, const void **w, cm_dtype *dt);
/* the batch (dt_model_batch.c) */
void      dt_model_layout_batch(dt_model *m, const dt_batch *b, float gamma);
cm_status dt_model_upload_batch(dt_model *m, const dt_batch *b);
/* the activation plan (dt_model_act.c) */
float    *dt_model_slot_ptr(const dt_model *m, int l, int s);
float    *dt_model_fc_slot(const dt_model *m, int s);
cm_status dt_model_ensure_capacity(dt_model *m, int64_t T, int64_t R);
/* typed helpers of both passes (dt_model_ops.c) */
cm_status dt_model_dx_op(dt_model *m, const void **op);
cm_status dt_model_save_norm(dt_model *m, const void **hop, void *save, float *x, const float *w, int64_t rows,
                             float *h32, void *hb);
cm_status dt_model_norm_saved(dt_model *m, const void **hop, const void *x, const float *w, int64_t rows);
cm_status dt_model_norm_bwd(dt_model *m, float *dinp, float *dw, const float *dout, const void *x,
                            cm_dtype x_dt, const float *w, int64_t rows, int acc, void *dinp_bf16);
void     *dt_model_dx_op_out(dt_model *m);
cm_status dt_model_mm_fwd(dt_model *m, void *out, cm_dtype odt, const void *inp, cm_dtype idt,
                          const dt_param *w, int64_t M, int64_t N, int64_t K);
cm_status dt_model_mm_dx(dt_model *m, void *dinp, cm_dtype odt, const void *dout, cm_dtype ddt,
                         const dt_param *w, int64_t M, int64_t N, int64_t K, int acc);
cm_status dt_model_mm_dw(dt_model *m, dt_param *w, const void *dout, cm_dtype ddt, const void *inp,
                         cm_dtype idt, int64_t M, int64_t N, int64_t K);
/* forward (dt_model_fwd.c) */
kn_dflash_attn_params dt_model_attn_params(const dt_model *m, int l);
/* The shape of layer l's DFlash attention (heads, window, causality, scale) over T context rows and
 * n_blocks blocks of B, no arrays: what training and dt_infer share. */
kn_dflash_attn_params dt_attn_shape(const cm_drafter_cfg *g, int l, int64_t T, int64_t n_blocks, int B);
cm_status dt_model_k_post(dt_model *m, int l, void *k, const void *k_pre, int64_t rows, const int32_t *pos);
cm_status dt_model_q_post(dt_model *m, int l, void *q, const void *q_pre);
cm_status             dt_model_forward(dt_model *m);
/* backward (dt_model_bwd.c) */
cm_status dt_model_backward(dt_model *m);
/* DFlash2's convolutions (dt_model_conv.c): module 0 around attention, 1 around the MLP */
cm_status dt_model_conv_in_fwd(dt_model *m, int l, int mod, const void **hop);
cm_status dt_model_conv_out_fwd(dt_model *m, int l, int mod);
cm_status dt_model_conv_out_bwd(dt_model *m, int l, int mod, const void **dop);
cm_status dt_model_conv_in_recompute(dt_model *m, int l, int mod, const void *x, cm_dtype x_dt,
                                     const void **hop);
cm_status dt_model_conv_in_bwd(dt_model *m, int l, int mod, const void *x, cm_dtype x_dt);
/* DFlash2's selector term (dt_model_sel.c): after the unary LM-head pass over hsel [n_sel, D], adds its
 * gradient into dhsel and the selector parameters' grads; fills the host figures */
cm_status dt_model_selector(dt_model *m, const float *hsel, float *dhsel);

#endif /* DT_MODEL_INT_H */
