/* kernels/kn_backend.h — the kernel backend table: one const table of function pointers
 * with two instances, the plain-C reference (kn_backend_cpu, the executable specification)
 * and CUDA (kn_backend_cuda, NULL in a CPU-only build). Model code is written once against
 * the table, so the whole target forward runs on either.
 *
 * Conventions shared by every entry:
 * - Pointers are in the backend's memory (host for cpu, device for cuda), allocated with
 *   the table's alloc. Activations are F32, row-major; "rows" are tokens (T) or token-heads.
 * - Weight matrices are [N, K] (out features × in features, PyTorch Linear layout) in F32
 *   or BF16; small parameters (norm weights, conv weights, A_log, dt_bias) are F32.
 * - Packed sequences: cu_seqlens[0..n_seq] (I32, in backend memory) with cu_seqlens[0] = 0
 *   and cu_seqlens[n_seq] = T; every op that mixes tokens stays inside one sequence.
 * - Ops enqueue on the context's stream and may return before completion; download and
 *   sync complete everything before them. Outputs are written (=), never accumulated,
 *   except add (x += y).
 * - A context is used by one thread at a time. */
#ifndef KN_BACKEND_H
#define KN_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kn_ctx kn_ctx;

/* GEMM precision on backends that have a choice (cuda). The cpu backend always computes
 * in fp32 with fp64 accumulation. */
typedef enum kn_gemm_mode {
    KN_GEMM_MODE_BF16 = 0, /* inputs rounded to bf16, bf16 weights, fp32 accumulate and output */
    KN_GEMM_MODE_F32,      /* fp32 inputs and weights (bf16 weights widened), fp32 math, no TF32 */
} kn_gemm_mode;

typedef struct kn_ctx_config {
    int          device;    /* cuda device ordinal; ignored by cpu */
    kn_gemm_mode gemm_mode;
} kn_ctx_config;
#define KN_CTX_CONFIG_DEFAULT {0, KN_GEMM_MODE_BF16}

/* DFlash block attention (docs/drafter.md) for one layer. Query rows are the n_blocks · B block
 * slots; keys/values are the T context rows plus the block rows. Query (block j, slot k) at
 * position a_j + k sees: context rows p with ctx_lo[j] ≤ p < a_j = anchors[j] (ctx_lo = start of
 * the anchor's document); block slots s of its own block only, all B of them, or s ≤ k when
 * causal. On a sliding layer (window W > 0) the window bounds every key by position: context
 * rows only p ≥ a_j + k − (W − 1), block slots only k − s < W and, when not causal, s − k < W
 * (both directions, as z-lab's, vLLM's and SGLang's masks apply it). GQA: q head h uses kv head h / (nq /
 * nkv). A query that sees nothing outputs 0. Shapes: q, out, dout, dq [n_blocks·B, nq, hd]; k_ctx, v_ctx [T,
 * nkv, hd]; k_blk, v_blk [n_blocks·B, nkv, hd]; lse [n_blocks·B, nq] (natural log, written by fwd, read by
 * bwd; −inf for a query that sees nothing). anchors, ctx_lo: I32 [n_blocks] in backend memory. io_dt BF16: q,
 * k, v and out hold bf16 (the attention's operands as the tensor-core kernels take them, made where their
 * producers write); the values are those of the F32 op on the widened inputs, out rounded once to nearest
 * even. With BF16 storage a k_blk that follows k_ctx in memory (k_blk = k_ctx + T·nkv·hd), and likewise v, is
 * read in place by the tensor-core kernels as one [T + n_blocks·B] array; otherwise they copy it. */
typedef struct kn_dflash_attn_params {
    int64_t T;          /* context rows */
    int64_t n_blocks;
    int     B;          /* block size */
    int     nq, nkv, hd;
    int     window;     /* 0: full_attention layer; W > 0: sliding_attention with window W */
    int     causal;     /* 1: slot k sees block slots ≤ k; 0: all slots of its block (within the window) */
    float   scale;      /* usually hd^-0.5 */
    const int32_t *anchors, *ctx_lo;
    cm_dtype       io_dt; /* of q, k_ctx, v_ctx, k_blk, v_blk and out: F32 (0, the default) or BF16 */
    const void    *q, *k_ctx, *v_ctx, *k_blk, *v_blk;
    void          *out;                                /* fwd output; the cuda bwd reads it */
    float         *lse;                                /* fwd output; bwd reads it */
    const float   *dout;                               /* bwd input */
    float         *dq, *dk_ctx, *dv_ctx, *dk_blk, *dv_blk; /* bwd outputs */
} kn_dflash_attn_params;

/* DFlash2's grouped dynamic causal convolution of one side of one module (docs/drafter.md), over
 * the block rows only: rows = n_blocks · B, row i is slot i % B of block i / B. With n_g = D / G
 * groups and side s (0: the input side, "prepare"; 1: the output side, "finish"):
 *   out[i, c] = Σ_{t < Kc, t ≤ slot(i)} (base[s, t, c] + delta[i, s, t, c / G]) · x[i − t, c]
 * so no tap crosses a block's start. base [2, Kc, D] (index 0 the input side, 1 the output side),
 * delta [rows, 2, Kc, n_g] (the sublayer input's kernel projection, made by a GEMM outside), x and
 * out [rows, D] (out may not alias x). Backward, given dout [rows, D]: dx = ∂/∂x (written),
 * dbase[s] (this side's [Kc, D] slice) and ddelta[:, s] (this side's [rows, Kc, n_g] part) written;
 * the other side's slices are left alone (rows = 0 writes nothing). 1 ≤ Kc ≤ B, G ≥ 1 divides D. */
typedef struct kn_dynconv_params {
    int64_t      rows;
    int          B, D, G, Kc, side;
    const void  *x;                   /* [rows, D] in x_dt */
    cm_dtype     x_dt;                /* F32 (0, the default) or BF16 (bit patterns, widened exactly) */
    const float *base, *delta;
    float       *out;                 /* fwd output */
    int          accumulate;          /* fwd: out += the convolution instead of = */
    uint16_t    *out_bf16;            /* fwd, optional: bf16 of what out holds afterwards (nearest even) */
    const float *dout;                /* bwd input */
    float       *dx, *dbase, *ddelta; /* bwd outputs */
    uint16_t    *dx_bf16;             /* bwd, optional: bf16 of dx */
} kn_dynconv_params;
/* The shape and pointer rules above, as both backends apply them (ref/kn_dynconv_ref.c): CM_OK, or
 * CM_ERR_INVALID_ARG naming op and the broken rule. bwd: the backward's pointers, else the forward's. */
cm_status kn_dynconv_check(const char *op, kn_ctx *ctx, const kn_dynconv_params *p, int bwd);

/* The fused LM head with top-K (DFlash2's candidate set): lm_ce's outputs over the R rows (dh, ce
 * and argmax exactly as lm_ce defines them; dh may be NULL, then gscale may be too) and, per row,
 * the K largest logits in descending order, equal logits lower index first, with their indices,
 * and the logit of the row's label; all taken inside the same chunked pass over the vocabulary,
 * so [R, V] logits never exist. 1 ≤ K ≤ KN_TOPK_MAX, K ≤ V. */
#define KN_TOPK_MAX 64
typedef struct kn_lm_topk_params {
    int64_t        R, V, D;
    int            K;
    const float   *h;           /* [R, D] */
    const int32_t *labels;      /* [R] */
    const float   *gscale;      /* [R] (lm_ce's) */
    const void    *w;           /* [V, D] in wdt (F32 or BF16), frozen */
    cm_dtype       wdt;
    float         *dh, *ce;     /* [R, D] (optional), [R] */
    int32_t       *argmax;      /* [R] */
    int32_t       *topk_idx;    /* [R, K] */
    float         *topk_val;    /* [R, K] */
    float         *label_logit; /* [R] */
} kn_lm_topk_params;

/* DFlash2's candidate selector over n rows (docs/drafter.md): row i has the final-normed hidden h_i,
 * its true token labels[i], its predecessor token pred[i] (teacher forcing) and the unary top-K
 * (topk_idx, topk_val, label_logit from lm_ce_topk). With u = h · W_hᵀ [n, Rk] made by a GEMM outside:
 *   candidates  cand[i, c] = topk_idx[i, c]; lab_pos[i] = the c with cand[i, c] = labels[i], or −1;
 *               when lab_pos = −1 and miss = KN_SEL_INJECT: cand[i, K−1] = labels[i] (its unary logit
 *               label_logit[i]) and the label index is K − 1; with KN_SEL_DROP the row has no label
 *               (ce = 0, and d = 0 below whatever gscale says); lab_pos stays −1 either way, so bwd
 *               (given the same miss) finds the label index from lab_pos;
 *   scores      score[i, c] = z(cand[i, c]) + Σ_r P[pred_i, r] · u[i, r] · S[cand[i, c], r]
 *               (z = topk_val, or label_logit for an injected candidate);
 *   ce[i]       = logsumexp_c score[i, :] − score[i, label index];
 *   choice[i]   = argmax_c score[i, c] (lowest c on ties), an index into cand.
 * fwd writes cand, score, ce, lab_pos, choice. bwd reads them (and the fwd inputs) with gscale [n]
 * (∂loss/∂ce per row, 0 for rows out of the term) and, with d[i, c] = gscale_i · (softmax(score_i)
 * − onehot(label index))_c (0 for a row without a label):
 *   dh[i, :]  += Σ_c d[i, c] · W[cand[i, c], :]                  (W the frozen LM head; skipped when dh is NULL)
 *   du[i, r]   = Σ_c d[i, c] · P[pred_i, r] · S[cand[i, c], r]   (written)
 *   dP[v, r]  += Σ_{i: pred_i = v} u[i, r] · Σ_c d[i, c] · S[cand[i, c], r]
 *   dS[v, r]  += Σ_{i, c: cand[i, c] = v} d[i, c] · P[pred_i, r] · u[i, r]
 * A row with d ≡ 0 (no label, or gscale 0) adds exactly nothing to dh and reads no row of W.
 * Only the rows of dP and dS that some pred or cand names are touched; every sum has a fixed order
 * (rows of dP/dS: contributions in ascending (i, c)), so results are reproducible. 1 ≤ K ≤ KN_TOPK_MAX. */
typedef enum kn_sel_miss {
    KN_SEL_INJECT = 0, /* a label outside the top-K replaces the K-th candidate (speculators) */
    KN_SEL_DROP,       /* such a row leaves the selector term (SpecForge's strict top-K) */
} kn_sel_miss;
typedef struct kn_selector_params {
    int64_t        n, V;
    int            K, Rk, D;
    kn_sel_miss    miss;
    const int32_t *topk_idx;    /* [n, K] */
    const float   *topk_val;    /* [n, K] */
    const float   *label_logit; /* [n] */
    const int32_t *labels, *pred; /* [n] */
    const float   *u;           /* [n, Rk] */
    const float   *P, *S;       /* [V, Rk] predecessor and successor codebooks */
    int32_t       *cand;        /* [n, K] fwd output */
    float         *score;       /* [n, K] fwd output */
    float         *ce;          /* [n] fwd output */
    int32_t       *lab_pos;     /* [n] fwd output */
    int32_t       *choice;      /* [n] fwd output */
    const float   *gscale;      /* [n] bwd input */
    const void    *w;           /* [V, D] LM head in wdt, bwd input (for dh) */
    cm_dtype       wdt;
    float         *dh;          /* [n, D] bwd, += (optional) */
    float         *du;          /* [n, Rk] bwd, = */
    float         *dP, *dS;     /* [V, Rk] bwd, += */
} kn_selector_params;
/* The rules above, as both backends apply them (ref/kn_selector_ref.c): CM_OK; CM_ERR_INVALID_ARG
 * naming op and the broken rule (shape, miss, a NULL pointer: dh may be NULL, and w with it);
 * CM_ERR_UNSUPPORTED for a wdt other than F32 or BF16 (bwd). bwd: the backward's pointers, else
 * the forward's. Token ids are device memory on cuda and not looked at here (the cpu ops check them). */
cm_status kn_selector_check(const char *op, kn_ctx *ctx, const kn_selector_params *p, int bwd);

typedef struct kn_adamw_params {
    float   lr, beta1, beta2, eps, weight_decay;
    float   grad_scale; /* multiplies the gradient first (global-norm clipping) */
    int64_t step;       /* 1-based, for bias correction */
} kn_adamw_params;

/* One tensor of a multi-tensor optimizer table (sumsq_multi, adamw_multi), the table itself in
 * backend memory. chunk0 = Σ over the earlier tensors of ceil(n / KN_MT_CHUNK): where this
 * tensor's chunks start in the launch; n_chunks is the sum over all of them. w16, when not
 * NULL, receives the updated parameter rounded to bf16 (nearest even, as gemm rounds an F32
 * operand): the weight copy a bf16 GEMM reads, written by adamw_multi where it writes param
 * (an update that skips itself writes neither). */
#define KN_MT_CHUNK 65536
typedef struct kn_mt_tensor {
    float       *param;
    const float *grad;
    float       *m, *v;
    int64_t      n;
    int64_t      chunk0;
    uint16_t    *w16;
} kn_mt_tensor;

/* A general matmul in row-major terms (kn_backend matmul): C[M, N] (= or +=) op(A)·op(B) with
 * op(A) [M, K] (A stored [M, K], or [K, M] when trans_a) and op(B) [K, N] (B stored [K, N], or
 * [N, K] when trans_b); leading dimensions in elements (≥ the stored row length). Each operand
 * is F32 or BF16 (uint16_t bit patterns). Precision follows the context as gemm's does: BF16
 * mode rounds F32 operands to bf16 (nearest even) and multiplies bf16 products with fp32
 * accumulation; F32 mode widens BF16 operands and runs fp32 math. C is F32, or BF16 (the fp32
 * result rounded to nearest even; not with accumulate). gemm, gemm_dx and gemm_dw are the
 * packed F32 cases (A = inp, B = W transposed; A = dout, B = W; A = dout transposed, B = inp). */
typedef struct kn_matmul_params {
    int64_t     M, N, K;
    const void *a;
    cm_dtype    a_dt;
    int64_t     lda;
    int         trans_a;
    const void *b;
    cm_dtype    b_dt;
    int64_t     ldb;
    int         trans_b;
    void       *c;
    cm_dtype    c_dt;
    int64_t     ldc;
    int         accumulate; /* C += (F32 C only) */
} kn_matmul_params;

/* The drafter's row norms on typed storage (kn_backend rmsnorm_typed): rmsnorm of x [rows, C] in
 * x_dt (F32 or BF16) with w, eps and one_plus as rmsnorm, in one pass:
 *   round (x_dt F32 only): x is first rounded in place to its BF16 values and the norm runs on
 *     them (the forward goes on with what it saves);
 *   x_bf16 (optional; needs round): those BF16 values, the saved copy;
 *   out (optional, F32) and out_bf16 (optional): the normed rows; out_bf16 = bf16(out).
 * At least one of out and out_bf16. Neither output may overlap x. */
typedef struct kn_norm_typed_params {
    int64_t      rows, C;
    float        eps;
    int          one_plus;
    const float *w; /* [C] */
    void        *x; /* written only when round */
    cm_dtype     x_dt;
    int          round;
    uint16_t    *x_bf16;
    float       *out;
    uint16_t    *out_bf16;
} kn_norm_typed_params;

/* rmsnorm's backward on typed storage (kn_backend rmsnorm_bwd_typed): x (the forward's input) in
 * x_dt (F32 or BF16), dout F32; dinp (F32) = ∂/∂x, or += when accumulate (rmsnorm_bwd_acc's F32
 * sum); dinp_bf16 (optional) = bf16 of dinp's final value (the next GEMM's operand); dw += ∂/∂w.
 * dinp and dinp_bf16 overlap neither dout nor x. */
typedef struct kn_norm_bwd_typed_params {
    int64_t      rows, C;
    float        eps;
    int          one_plus;
    const float *w;
    float       *dw;
    const void  *x;
    cm_dtype     x_dt;
    const float *dout;
    float       *dinp;
    int          accumulate;
    uint16_t    *dinp_bf16;
} kn_norm_bwd_typed_params;

typedef struct kn_backend {
    const char *name; /* "cpu", "cuda" */

    // ---- context and memory
    cm_status (*ctx_create)(kn_ctx **out, const kn_ctx_config *cfg);
    void (*ctx_destroy)(kn_ctx **ctx); /* NULL-safe; sets *ctx = NULL */
    /* Makes the context's device the calling thread's current one. A thread that works with
     * contexts on several devices (a target split over GPUs) binds each before using it: memory
     * and launches otherwise go to the device last bound or created on that thread. cpu: absent. */
    cm_status (*ctx_bind)(kn_ctx *ctx); /* (optional) */
    cm_status (*alloc)(kn_ctx *ctx, void **out, size_t bytes); /* zero-filled */
    void (*free)(kn_ctx *ctx, void *p);                        /* NULL-safe */
    cm_status (*upload)(kn_ctx *ctx, void *dst, const void *host_src, size_t bytes);
    cm_status (*download)(kn_ctx *ctx, void *host_dst, const void *src, size_t bytes); /* blocks */
    cm_status (*sync)(kn_ctx *ctx);
    /* Copies bytes from src (ctx's memory) to dst (dst_ctx's memory: the same context or another
     * of this backend, on another device — a peer copy, GPU to GPU without the host) after the
     * work enqueued on ctx, and returns when the copy is done. */
    cm_status (*copy_peer)(kn_ctx *ctx, kn_ctx *dst_ctx, void *dst, const void *src, size_t bytes);
    cm_status (*zero)(kn_ctx *ctx, void *p, size_t bytes); /* enqueues a clear of bytes at p */
    /* Page-locks the host memory [p, p + bytes) so that uploads from it run at the bus's speed
     * (a DMA straight from it, no staging copy); host_unpin undoes it before the memory is
     * freed. cpu: absent (its uploads are memcpy). */
    cm_status (*host_pin)(kn_ctx *ctx, void *p, size_t bytes); /* (optional) */
    void (*host_unpin)(kn_ctx *ctx, void *p);                   /* (optional) */

    // ---- elementwise and data movement
    /* dst[r, 0:cols] = src[r, 0:cols] for r < rows, with leading dimensions in elements (F32). */
    cm_status (*copy2d)(kn_ctx *ctx, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                        int64_t rows, int64_t cols);
    /* x[i] += y[i] */
    cm_status (*add)(kn_ctx *ctx, float *x, const float *y, int64_t n);
    /* out[i] = silu(gate[i]) * up[i] */
    cm_status (*swiglu)(kn_ctx *ctx, float *out, const float *gate, const float *up, int64_t n);

    // ---- embedding and GEMM
    /* out[t, :] = table[ids[t], :]; table [V, C] in tdt (F32 or BF16). Ids must be < V
     * (validated by the caller, before upload). */
    cm_status (*embed)(kn_ctx *ctx, float *out, const int32_t *ids, const void *table, cm_dtype tdt,
                       int64_t T, int64_t C);
    /* out[M, N] = inp[M, K] · W[N, K]ᵀ; W in wdt (F32 or BF16). */
    cm_status (*gemm)(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                      int64_t N, int64_t K);

    // ---- norms
    /* Per row of C: y = x · rsqrt(mean(x²) + eps) · (w or 1 + w). one_plus selects the
     * zero-centred Qwen3.5 form (1 + w); 0 gives the plain-w form. out may equal inp. */
    cm_status (*rmsnorm)(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                         float eps, int one_plus);
    /* GDN output norm, per row of C: y = w · (x · rsqrt(mean(x²) + eps)) · silu(z). */
    cm_status (*rmsnorm_gated)(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                               int64_t rows, int64_t C, float eps);
    /* Per row of C: y = x · rsqrt(sum(x²) + eps). out may equal inp. */
    cm_status (*l2norm)(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps);

    // ---- attention pieces
    /* In place on x [T, n_heads, head_dim]: NeoX half-split RoPE on the first rot_dim dims of
     * each head (rot_dim even, ≤ head_dim), inv_freq[i] = theta^(-2i/rot_dim), pair (i, i +
     * rot_dim/2), angle pos[t]·inv_freq[i]; the other dims pass through. pos is I32 [T]. */
    cm_status (*rope)(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                      int rot_dim, float theta);
    /* Causal GQA attention within each packed sequence, then the output gate:
     * out[t, h, :] = softmax_s≤t(q[t,h]·k[s,h/(nq/nkv)] · scale) · v  ⊙ sigmoid(gate[t, h, :]).
     * q, gate, out: [T, nq, hd]; k, v: [T, nkv, hd]; gate may be NULL (no gate). */
    cm_status (*attention)(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv,
                           int hd, float scale);

    // ---- gated deltanet pieces
    /* Causal depthwise conv over time within each sequence, then SiLU:
     * out[t, c] = silu(Σ_{j<K} w[c, j] · x[t - (K-1) + j, c]), x before the sequence start = 0.
     * x, out: [T, C] (out ≠ x); w: [C, K]. */
    cm_status (*conv1d_silu)(kn_ctx *ctx, float *out, const float *x, const float *w, const int32_t *cu_seqlens,
                             int n_seq, int64_t T, int64_t C, int K);
    /* g[t, h] = -exp(A_log[h]) · softplus(a[t, h] + dt_bias[h]) (softplus threshold 20);
     * beta[t, h] = sigmoid(b[t, h]). a, b, g, beta: [T, nv]. */
    cm_status (*gdn_gate)(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b, const float *A_log,
                          const float *dt_bias, int64_t T, int nv);
    /* Chunked (64) gated delta rule, zero state at every sequence start; per sequence and
     * v-head h (qk-head h / (nv/nk)), for each token t in order:
     *   S = exp(g_t)·S;  u = beta_t·(v_t − Sᵀk_t);  S += k_t uᵀ;  o_t = Sᵀ(q_t · scale).
     * q, k: [T, nk, dk] (already l2-normalised); v, out: [T, nv, dv]; g, beta: [T, nv]. */
    cm_status (*gated_delta_rule)(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                  const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                  int64_t T, int nk, int nv, int dk, int dv, float scale);

    // ---- drafter training: backward passes and the DFlash-specific ops (docs/drafter.md).
    // The cpu and cuda tables both fill every entry; an entry marked (optional) may be NULL in
    // another backend, so callers check it and report "not available on this backend".

    /* dinp[M, K] (= or += when accumulate) dout[M, N] · W[N, K]; W in wdt (F32 or BF16). */
    cm_status (*gemm_dx)(kn_ctx *ctx, float *dinp, const float *dout, const void *w, cm_dtype wdt, int64_t M,
                         int64_t N, int64_t K, int accumulate); /* (optional) */
    /* dw[N, K] += dout[M, N]ᵀ · inp[M, K] (always accumulates: grads are zeroed once per step). */
    cm_status (*gemm_dw)(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                         int64_t K); /* (optional) */
    /* Backward of rmsnorm (same one_plus meaning): dinp = ∂/∂inp (written), dw += ∂/∂w.
     * inp is the forward input; dinp may not alias dout. */
    cm_status (*rmsnorm_bwd)(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                             const float *w, int64_t rows, int64_t C, float eps, int one_plus); /* (optional) */
    /* Backward of rope: rotates the gradient dx in place by the negative angles. */
    cm_status (*rope_bwd)(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                          int rot_dim, float theta); /* (optional) */
    /* Backward of swiglu: dgate, dup written. */
    cm_status (*swiglu_bwd)(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, int64_t n); /* (optional) */
    /* DFlash block attention, forward (see kn_dflash_attn_params). */
    cm_status (*dflash_attn_fwd)(kn_ctx *ctx, const kn_dflash_attn_params *p); /* (optional) */
    /* DFlash block attention, backward: writes dq, dk_ctx, dv_ctx, dk_blk, dv_blk (=). */
    cm_status (*dflash_attn_bwd)(kn_ctx *ctx, const kn_dflash_attn_params *p); /* (optional) */
    /* DFlash2 grouped dynamic causal convolution, forward and backward (see kn_dynconv_params). */
    cm_status (*dynconv_fwd)(kn_ctx *ctx, const kn_dynconv_params *p); /* (optional) */
    cm_status (*dynconv_bwd)(kn_ctx *ctx, const kn_dynconv_params *p); /* (optional) */
    /* Fused LM head + cross-entropy over R rows, never holding more than one chunk of logits:
     *   logits_r = h_r · Wᵀ (W [V, D] frozen, in wdt), ce_r = logsumexp(logits_r) − logits_r[label_r],
     *   argmax_r = index of the largest logit (lowest index on ties),
     *   dh_r = gscale_r · (softmax(logits_r) − onehot(label_r)) · W      (when dh ≠ NULL).
     * ce [R] and argmax [R] are written; gscale [R] is the per-row weight of dloss/dce. */
    cm_status (*lm_ce)(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h, const int32_t *labels,
                       const float *gscale, const void *w, cm_dtype wdt, int64_t R, int64_t V,
                       int64_t D); /* (optional) */
    /* lm_ce with the per-row top-K and label logit (see kn_lm_topk_params). */
    cm_status (*lm_ce_topk)(kn_ctx *ctx, const kn_lm_topk_params *p); /* (optional) */
    /* DFlash2's candidate selector, forward and backward (see kn_selector_params). */
    cm_status (*selector_fwd)(kn_ctx *ctx, const kn_selector_params *p); /* (optional) */
    cm_status (*selector_bwd)(kn_ctx *ctx, const kn_selector_params *p); /* (optional) */
    /* Sum of squares of x[0, n) in double, returned on the host (blocks). */
    cm_status (*sumsq)(kn_ctx *ctx, double *out, const float *x, int64_t n); /* (optional) */
    /* One AdamW step on n fp32 values (PyTorch semantics, decoupled weight decay):
     *   p -= lr·wd·p;  m = b1·m + (1−b1)·g;  v = b2·v + (1−b2)·g²;
     *   p -= lr · (m / (1 − b1^step)) / (sqrt(v / (1 − b2^step)) + eps);
     * g = grad · grad_scale (the clip factor). step ≥ 1. */
    cm_status (*adamw)(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                       const kn_adamw_params *p); /* (optional) */

    // ---- random initialisation (target-server --init random)
    /* dst[i] = lo + (hi − lo)·u(seed, i) for i < n, u uniform in [0, 1) from a counter-based hash
     * (kernels/kn_fill.h), as F32 or BF16: bit-identical on every backend. */
    cm_status (*fill_uniform)(kn_ctx *ctx, void *dst, cm_dtype dt, int64_t n, uint64_t seed, float lo,
                              float hi); /* (optional) */

    // ---- bf16 GEMM inputs written by their producers (the target forward under --precision
    // bf16 on cuda). A context whose gemm rounds its input to bf16 anyway gives the same
    // product when the producer writes that bf16 input itself, which saves the conversion
    // pass and half the traffic. BF16 buffers are uint16_t bit patterns; "bf16(v)" is v's F32
    // value rounded to nearest even, exactly as gemm would round it.
    /* 1 when gemm on this context rounds its input to bf16 (cuda in KN_GEMM_MODE_BF16); then
     * gemm_bf16in(bf16(inp)) = gemm(inp). cpu: 0 (its gemm is fp32 whatever the mode). */
    int (*gemm_rounds_input)(const kn_ctx *ctx); /* (optional) */
    /* out[M, N] = inp[M, K] · W[N, K]ᵀ with inp BF16 (widened exactly), W in wdt; the math of
     * gemm on the widened input. */
    cm_status (*gemm_bf16in)(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                             int64_t M, int64_t N, int64_t K); /* (optional) */
    /* gemm_bf16in added onto out instead of written: out[M, N] += inp · Wᵀ, each sum rounded to
     * F32 and then added to out, as gemm_bf16in then add (cuda: cuBLASLt's beta = 1, one
     * kernel; the block's output projection straight into the residual stream). */
    cm_status (*gemm_bf16in_acc)(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                                 int64_t M, int64_t N, int64_t K); /* (optional) */
    /* The residual add fused into the next norm: x += y (as add; skipped when y is NULL), then
     * out = bf16(rmsnorm(x)) per row of C (rmsnorm's one_plus meaning). */
    cm_status (*add_rmsnorm_bf16)(kn_ctx *ctx, uint16_t *out, float *x, const float *y, const float *w,
                                  int64_t rows, int64_t C, float eps, int one_plus); /* (optional) */
    /* out = bf16(rmsnorm_gated(x, z, w)). */
    cm_status (*rmsnorm_gated_bf16)(kn_ctx *ctx, uint16_t *out, const float *x, const float *z, const float *w,
                                    int64_t rows, int64_t C, float eps); /* (optional) */
    /* out[i] = bf16(swiglu(gate, up)[i]). */
    cm_status (*swiglu_bf16)(kn_ctx *ctx, uint16_t *out, const float *gate, const float *up,
                             int64_t n); /* (optional) */
    /* The GDN short-conv block in one op: conv1d_silu over the C = 2·nk·dk + nv·dv channels of
     * x [T, C] (w [C, K]), split into q [T, nk, dk], k [T, nk, dk] and v [T, nv, dv], with every
     * q and k head l2norm'ed (eps): the same as conv1d_silu, three copy2d and two l2norm. */
    cm_status (*gdn_conv_qkv)(kn_ctx *ctx, float *q, float *k, float *v, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                              int K, float eps); /* (optional) */
    /* gdn_conv_qkv with bf16 outputs for gated_delta_rule_bf16: bf16(q·q_scale), bf16(k),
     * bf16(v) of gdn_conv_qkv's F32 values (q·q_scale rounded to F32 first), the operands the
     * chunked form rounds to bf16 anyway, so it need not copy them. */
    cm_status (*gdn_conv_qkv_bf16)(kn_ctx *ctx, uint16_t *q, uint16_t *k, uint16_t *v, const float *x,
                                   const float *w, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk,
                                   int nv, int dk, int dv, int K, float eps, float q_scale); /* (optional) */
    /* gated_delta_rule of the widened bf16 q (which carries its scale: scale 1), k and v. cuda:
     * the chunked form in bf16 mode, dk 64, 128 or 256 only (else CM_ERR_UNSUPPORTED: widen and
     * run gated_delta_rule); the same bits as gated_delta_rule on the F32 values these came
     * from with that scale, because that form rounds exactly these operands. */
    cm_status (*gated_delta_rule_bf16)(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, const float *g, const float *beta,
                                       const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                                       int dk, int dv); /* (optional) */
    /* The gated attention's q/k input prep in one op: the split of the gated q_proj output,
     * the q/k head norms and partial rope, the same as (gate ≠ NULL) copy2d(q ← qg[:, :hd]) and
     * copy2d(gate ← qg[:, hd:]) over the T·nq rows of qg [T, nq, 2·hd] (per head [q_h | gate_h]),
     * or (gate = NULL) copy2d(q ← qg) with qg [T, nq, hd] (qg may equal q); then
     * rmsnorm(q, q_norm), rmsnorm(k, k_norm) per head of hd (eps, one_plus as rmsnorm), and
     * rope(q, pos) and rope(k, pos) (rot_dim, theta as rope). q [T, nq, hd] and gate are
     * written; k [T, nkv, hd] is updated in place. qg must not overlap q (unless equal, ungated),
     * gate or k. A backend may refuse a shape with CM_ERR_UNSUPPORTED (the caller then runs the
     * chain). */
    cm_status (*qk_prep)(kn_ctx *ctx, float *q, float *gate, float *k, const float *qg, const float *q_norm,
                         const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv, int hd, int rot_dim,
                         float theta, float eps, int one_plus); /* (optional) */

    // ---- drafter training with saved activations in BF16 (dt_model when gemm rounds its
    // input): GEMMs that read and write BF16 directly and SwiGLU on BF16 storage.
    /* dst[r, 0:cols] = src[r, 0:cols] for r < rows, each F32 or BF16 with its leading dimension
     * (elements): F32 → BF16 rounds to nearest even, BF16 → F32 is exact, same type copies.
     * dst and src must not overlap unless they are the same buffer with the same type and ld. */
    cm_status (*cast2d)(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dst_ld, const void *src, cm_dtype sdt,
                        int64_t src_ld, int64_t rows, int64_t cols); /* (optional) */
    /* See kn_matmul_params. */
    cm_status (*matmul)(kn_ctx *ctx, const kn_matmul_params *p); /* (optional) */
    /* out[i] = silu(gate[i])·up[i]: gate and up in idt, out in odt (F32 or BF16; the F32 value
     * rounded when BF16). out may alias gate or up when the types match. */
    cm_status (*swiglu_typed)(kn_ctx *ctx, void *out, cm_dtype odt, const void *gate, const void *up, cm_dtype idt,
                              int64_t n); /* (optional) */
    /* swiglu_bwd with dout, gate, up, dgate and dup all in dt (F32 or BF16; outputs rounded):
     * dgate may alias gate and dup may alias up (the backward overwrites its saved inputs),
     * either may alias dout; dgate ≠ dup. With F32 the values of swiglu_bwd. */
    cm_status (*swiglu_bwd_typed)(kn_ctx *ctx, void *dgate, void *dup, const void *dout, const void *gate,
                                  const void *up, cm_dtype dt, int64_t n); /* (optional) */
    /* swiglu_typed (odt = idt = dt) into h and swiglu_bwd_typed in one pass, each with its values:
     * the backward's recomputed product and the gradient from one read of gate and up. h may
     * alias dout, dgate gate and dup up (each element is read before it is written); the three
     * outputs are distinct buffers. */
    cm_status (*swiglu_fwd_bwd_typed)(kn_ctx *ctx, void *h, void *dgate, void *dup, const void *dout,
                                      const void *gate, const void *up, cm_dtype dt,
                                      int64_t n); /* (optional) */

    /* rmsnorm_bwd adding its input gradient to dinp: dinp[i] += float(∂/∂inp[i]) (the F32 sum
     * of rmsnorm_bwd into a temporary and add); dw += as there. dinp aliases neither dout nor inp. */
    cm_status (*rmsnorm_bwd_acc)(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus); /* (optional) */
    /* See kn_norm_typed_params and kn_norm_bwd_typed_params: the values of widen, rmsnorm and
     * cast2d (forward; round: cast2d to BF16 and back first), and of widen, rmsnorm_bwd (or
     * rmsnorm_bwd_acc) and cast2d (backward). */
    cm_status (*rmsnorm_typed)(kn_ctx *ctx, const kn_norm_typed_params *p);         /* (optional) */
    cm_status (*rmsnorm_bwd_typed)(kn_ctx *ctx, const kn_norm_bwd_typed_params *p); /* (optional) */
    /* The drafter's q/k prep on typed storage: out [T, nh, hd] = rope(rmsnorm(x)) with the norm per
     * head row of hd (plain w [hd], eps) and rope's pos, rot_dim and theta, x [T, nh, hd] in x_dt and
     * out in out_dt (each F32 or BF16): the values of widen, rmsnorm, rope (and, for a BF16 out,
     * cast2d). out may equal x when the two dtypes are the same. */
    cm_status (*head_norm_rope)(kn_ctx *ctx, void *out, cm_dtype out_dt, const void *x, cm_dtype x_dt,
                                const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rot_dim,
                                float theta, float eps); /* (optional) */
    /* Its backward: dout [T, nh, hd] (F32, ∂/∂out) is rotated back in place (rope_bwd), then
     * dinp (written, in dinp_dt: F32, or BF16 rounded from the F32 value as cast2d rounds, for a GEMM
     * that rounds its operands anyway) and dw (+=) as rmsnorm_bwd with x in x_dt: the values of
     * rope_bwd, widen, rmsnorm_bwd (and cast2d). dinp overlaps neither dout nor x. */
    cm_status (*head_norm_rope_bwd)(kn_ctx *ctx, void *dinp, cm_dtype dinp_dt, float *dw, float *dout,
                                    const void *x, cm_dtype x_dt, const float *w, const int32_t *pos,
                                    int64_t T, int nh, int hd, int rot_dim, float theta,
                                    float eps); /* (optional) */

    // ---- incremental decoding (target-server's decoding sessions, docs/target.md). A cache holds,
    // per sequence slot, what the forward over a sequence's earlier tokens left behind: the
    // attention layers' keys and values, the GDN layers' last K − 1 conv inputs and recurrent
    // state. A batch packs n_seq sequences' new tokens by cu_seqlens (len_s = cu[s+1] − cu[s] ≥ 1);
    // sequence s lives in slot slots[s] and has base[s] tokens before its new ones, so its token
    // i sits at position base[s] + i. slots, base and n_adv are I32 [n_seq] in backend memory;
    // distinct slots within a batch; a new sequence's slot is zeroed first (zero). "n_adv":
    // NULL leaves the state alone; else the state of slots[s] is advanced by the first n_adv[s]
    // new tokens (0 ≤ n_adv[s] ≤ len_s; 0 leaves it), as if only those had been fed.
    // The ops are not told n_slots, so slots[s] < n_slots is the caller's to keep (a larger slot
    // reads and writes past the arena). cpu checks every other rule of its tables (len_s ≥ 1,
    // slots ≥ 0 and distinct, base, n_adv) with CM_ERR_INVALID_ARG naming the op and the rule;
    // cuda cannot look at tables in device memory and gives a sequence that breaks one (bar
    // distinctness) NaN outputs and no cache or state writes.
    /* kc[slots[s], base[s] + i] = k[cu[s] + i] and vc likewise from v, for i < len_s;
     * kc, vc [n_slots, max_len, nkv, hd]; k, v [T, nkv, hd]; base[s] + len_s ≤ max_len. */
    cm_status (*kv_cache_write)(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                                const int32_t *slots, const int32_t *base, const int32_t *cu_seqlens, int n_seq,
                                int64_t T, int nkv, int hd, int64_t max_len); /* (optional) */
    /* attention's math over the cache: token t = cu[s] + i (position p = base[s] + i) sees cache
     * rows j ≤ p of its slot: out[t, h, :] = softmax_j(q[t,h]·kc[slot, j, h/(nq/nkv)] · scale) ·
     * vc[slot, j, h/(nq/nkv)] ⊙ sigmoid(gate[t, h, :]) (gate NULL: no gate). The new tokens'
     * keys and values must be in the cache already (kv_cache_write). q, gate, out [T, nq, hd]. */
    cm_status (*attention_cached)(kn_ctx *ctx, float *out, const float *q, const float *kc, const float *vc,
                                  const float *gate, const int32_t *slots, const int32_t *base,
                                  const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv, int hd,
                                  int64_t max_len, float scale); /* (optional) */
    /* conv1d_silu continued from a state: state [n_slots, K − 1, C] holds each slot's last K − 1
     * inputs, oldest first (zeros before a sequence's start), and the sequence's rows follow
     * them: out[cu[s] + i, c] = silu(Σ_{j<K} w[c, j] · x̃[i − (K − 1) + j, c]) with x̃[r] = state
     * row K − 1 + r for r < 0 and x[cu[s] + r] for r ≥ 0. out may be NULL (the state update
     * only). With n_adv the state becomes the last K − 1 rows of (state rows, then x rows
     * cu[s] .. cu[s] + n_adv[s] − 1), after out is computed. x, out [T, C] (out must not
     * overlap x); w [C, K]. K = 1 has no state (state may be NULL). */
    cm_status (*conv1d_silu_cached)(kn_ctx *ctx, float *out, const float *x, const float *w, float *state,
                                    const int32_t *slots, const int32_t *n_adv, const int32_t *cu_seqlens,
                                    int n_seq, int64_t T, int64_t C, int K); /* (optional) */
    /* The gated delta rule of gated_delta_rule (its per-token recurrence, exactly) continued
     * from a state: S = state[slots[s]] [nv, dk, dv] (the v-head's dk × dv matrix; zeros for a
     * new sequence) instead of zeros, the sequence's tokens in order. out [T, nv, dv] may be
     * NULL (then q may be too: the state update only, which reads only the first n_adv[s]
     * tokens). With n_adv the state becomes S after token n_adv[s] − 1; the outputs of the
     * later tokens still come from the evolving S. q, k [T, nk, dk]; v [T, nv, dv]; g, beta
     * [T, nv]; nv a multiple of nk. */
    cm_status (*gdn_cached)(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *g, const float *beta, float *state, const int32_t *slots,
                            const int32_t *n_adv, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                            int dk, int dv, float scale); /* (optional) */

    // ---- the optimizer step over a table of tensors, without a host round trip
    /* *out (backend memory) = Σ over the table's grads of g², in double, in an order fixed by
     * the table alone (deterministic; cpu: sumsq of each tensor, summed in table order).
     * Enqueues; the result stays on the device. */
    cm_status (*sumsq_multi)(kn_ctx *ctx, double *out, const kn_mt_tensor *table, int n_tensors,
                             int64_t n_chunks); /* (optional) */
    /* adamw on every tensor of the table at once, the clip factor read from the device:
     * norm = sqrt(*sumsq), g = grad · float(min(1, clip / (norm + 1e-6))) (1 when clip ≤ 0),
     * as dt_optim clips (p->grad_scale is not used). Nothing is written when norm is not
     * finite. Enqueues. */
    cm_status (*adamw_multi)(kn_ctx *ctx, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks,
                             const kn_adamw_params *p, const double *sumsq, double clip); /* (optional) */

    // ---- FP8 block-scaled GEMMs (--precision fp8; docs/fp8.md). An FP8 weight is W [N, K] as
    // e4m3 bytes ("fn": no infinities, ±448 the largest) with fp32 block scales
    // scale [ceil(N/128), kn_fp8_scale_ld(K)], row-major: entry (i, j) multiplies the 128 × 128
    // block of rows 128i.. and columns 128j.. (the last blocks may be ragged); the padding
    // entries of a row (ld > ceil(K/128)) are never read. w(n, k) = f32(q[n, k]) · scale[n/128, k/128].
    /* Quantizes W [N, K] (F32 or BF16) in 128 × 128 blocks, the arithmetic of Transformers'
     * Fp8Quantize with one rounding fewer (it takes 448 · (1/a)): a = max(amax(|block|), 1e-12),
     * r = 448 / a, q = e4m3(clamp(w · r, ±448)) (nearest even), scale = 1 / r (each an fp32
     * operation). q [N, K], scale as above (padding written 0). */
    cm_status (*fp8_quantize_weight)(kn_ctx *ctx, uint8_t *q, float *scale, const void *w, cm_dtype wdt,
                                     int64_t N, int64_t K); /* (optional) */
    /* out[M, N] (F32) = the W8A8 product of inp [M, K] (F32 or BF16) and an FP8 weight. The input
     * is quantized per row in 1 × 128 groups along K (the last one ragged), from its bf16 value
     * a = bf16(inp) (exact for BF16): s = max(amax(|a|), 1e-10) · (1/448), qa = e4m3(clamp(a / s,
     * ±448)); then out[m, n] = Σ_j sa[m, j] · sw[n/128, j] · Σ_{k in group j} qa[m, k] · qw[n, k].
     * cpu: each group's sum exact, the scaled sums added in double, one rounding; cuda: cuBLASLt's
     * block-scaled modes, fp32 accumulation. cuda: K a multiple of 16 and N of 4 (cuBLASLt's FP8
     * alignment; CM_ERR_INVALID_ARG and CM_ERR_UNSUPPORTED), the cpu takes any shape. */
    cm_status (*gemm_fp8)(kn_ctx *ctx, float *out, const void *inp, cm_dtype idt, const uint8_t *wq,
                          const float *wscale, int64_t M, int64_t N, int64_t K); /* (optional) */
    /* gemm_fp8's input quantization alone, for an input that several GEMMs read: q [Mp, K] e4m3
     * and s [ceil(K/128), Mp] fp32 (token-contiguous), Mp = kn_fp8_rows(M); rows m ≥ M are
     * written as zeros (q 0, s 0). */
    cm_status (*fp8_quantize_rows)(kn_ctx *ctx, uint8_t *q, float *s, const void *inp, cm_dtype idt, int64_t M,
                                   int64_t K); /* (optional) */
    /* swiglu_bf16 and fp8_quantize_rows in one pass (the MLP's down-projection input written
     * quantized): q, s as fp8_quantize_rows(bf16(swiglu(gate, up))) with gate, up [M, I] in idt,
     * F32 or BF16 (widened exactly). */
    cm_status (*swiglu_fp8)(kn_ctx *ctx, uint8_t *q, float *s, const void *gate, const void *up, cm_dtype idt,
                            int64_t M, int64_t I); /* (optional) */
    /* gemm_fp8 from an input fp8_quantize_rows wrote (the same M and K): gemm_fp8 is
     * fp8_quantize_rows then this. out in odt: F32, or BF16 = the F32 result rounded to nearest
     * even (what a serving engine's FP8 linear writes; half the bytes for the next op to read). */
    cm_status (*gemm_fp8q)(kn_ctx *ctx, void *out, cm_dtype odt, const uint8_t *q, const float *s,
                           const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K); /* (optional) */
    /* gemm_fp8q's F32 product added onto out (out += product), as gemm_fp8q then add (cuda:
     * cuBLASLt's beta = 1). */
    cm_status (*gemm_fp8q_acc)(kn_ctx *ctx, float *out, const uint8_t *q, const float *s, const uint8_t *wq,
                               const float *wscale, int64_t M, int64_t N, int64_t K); /* (optional) */
    /* add_rmsnorm_bf16 and fp8_quantize_rows of its output in one pass (the norm writes the
     * quantized input of the FP8 projections that follow it): out, x as add_rmsnorm_bf16, q, s as
     * fp8_quantize_rows(out, BF16, rows, C); out may be NULL when nothing reads the bf16 values
     * (they are quantized, not stored). CM_ERR_UNSUPPORTED (nothing written) for a shape the
     * backend does not fuse; the caller then runs the two ops. */
    cm_status (*add_rmsnorm_fp8)(kn_ctx *ctx, uint16_t *out, uint8_t *q, float *s, float *x, const float *y,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus); /* (optional) */
    /* rmsnorm_gated_bf16 of T·H rows of C (T tokens of H heads, the GDN output norm) written
     * straight into the quantized input of the next FP8 GEMM: q, s as fp8_quantize_rows of those
     * bf16 values viewed as [T, H·C]. CM_ERR_UNSUPPORTED (nothing written) for a shape the
     * backend does not fuse (cuda: C a multiple of 128, so no group spans two heads). */
    cm_status (*rmsnorm_gated_fp8)(kn_ctx *ctx, uint8_t *q, float *s, const float *x, const float *z,
                                   const float *w, int64_t T, int64_t H, int64_t C, float eps); /* (optional) */
    /* 1 when gemm_fp8 runs on this context; else 0 with the reason in why[0..n) (a sentence
     * naming the device and what it lacks). */
    int (*fp8_supported)(const kn_ctx *ctx, char *why, size_t n); /* (optional) */

    // ---- mixture of experts (docs/moe.md): routing, grouping by expert, gather, the experts'
    // GEMMs over their rows in one call, weighted combine.
    /* Routing of T tokens over E experts, K chosen per token (1 ≤ K ≤ E ≤ KN_MOE_MAX_EXPERTS):
     * p = softmax(logits[t, 0:E]) in fp32 (the row's max subtracted, exp, sum, divide); the K
     * largest p in descending order, equal p to the lower expert index first; w = p / Σ of the K
     * chosen p when renorm, else p. idx [T, K] I32 and w [T, K] F32 written; logits [T, E] F32. */
    cm_status (*moe_route)(kn_ctx *ctx, int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                           int renorm); /* (optional) */
    /* The T·K assignments a = t·K + k grouped by expert: sorted row j runs over experts
     * ascending and, within one expert, over a ascending (stable). offsets [E + 1] I32:
     * offsets[e] the first sorted row of expert e, offsets[E] = T·K; src [T·K] I32: the
     * assignment at sorted row j; dst [T·K] I32: the sorted row of assignment a (src's inverse).
     * idx [T, K] as moe_route wrote it (every entry in [0, E)). */
    cm_status (*moe_group)(kn_ctx *ctx, int32_t *offsets, int32_t *src, int32_t *dst, const int32_t *idx, int64_t T,
                           int E, int K); /* (optional) */
    /* out[j, :] = in[src[j] / K, :] for j < T·K: each token's row copied to its K sorted rows;
     * in [T, D] and out [T·K, D] both in dt (F32 or BF16). */
    cm_status (*moe_gather)(kn_ctx *ctx, void *out, const void *in, cm_dtype dt, const int32_t *src, int64_t T,
                            int K, int64_t D); /* (optional) */
    /* out[t, :] = Σ_{k = 0..K-1} w[t, k] · y[dst[t·K + k], :], added in k order in fp32, then
     * + sigmoid(sgate[t]) · shared[t, :] when shared ≠ NULL (sgate [T], shared [T, D]); y [T·K, D],
     * out [T, D], all F32. out aliases none of the inputs. */
    cm_status (*moe_combine)(kn_ctx *ctx, float *out, const float *y, const int32_t *dst, const float *w,
                             const float *shared, const float *sgate, int64_t T, int K,
                             int64_t D); /* (optional) */
    /* The routed experts' GEMMs, all experts in one call, over rows grouped by expert as
     * moe_group leaves them: for each expert e and each row j in [offsets[e], offsets[e + 1]),
     * out0[j, 0:N) = x_j · w0[e]ᵀ, and out1[j, :] = x_j · w1[e]ᵀ when w1 ≠ NULL (gate and up from
     * one read of the rows), with x_j = inp[j, 0:K) when src is NULL, else inp[src[j] / topk, 0:K)
     * (moe_group's src: the gather of moe_gather done by the loads; src[j] in [0, R)). inp BF16,
     * 16-byte aligned, K a multiple of 8; w0 and w1 arrays of E pointers to [N, K] BF16 matrices,
     * the arrays themselves in this backend's memory (their pointers are read there); offsets
     * [E + 1] ascending with offsets[E] ≤ R, in this backend's memory; out0, out1 [R, N] F32, fp32
     * accumulation; rows past offsets[E] are not written. Reads no row count on the host:
     * nothing waits. */
    cm_status (*moe_gemm)(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const int32_t *src, int topk,
                          const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                          int E, int64_t N, int64_t K); /* (optional) */
    /* moe_gemm of gate (wg) and up (wu) followed by swiglu_bf16, in one: act [R, N] BF16 =
     * bf16(silu(g)·u) with g and u the F32 results moe_gemm would write (the same bits as the two
     * calls, without the F32 products in memory). The rest as moe_gemm. */
    cm_status (*moe_gemm_swiglu)(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const int32_t *src, int topk,
                                 const uint16_t *const *wg, const uint16_t *const *wu, const int32_t *offsets,
                                 int64_t R, int E, int64_t N, int64_t K); /* (optional) */
    /* moe_gemm on FP8 experts (W8A8: gemm_fp8q's product): for each expert e and each row j in
     * [offsets[e], offsets[e + 1]), out0[j, 0:N) = gemm_fp8q's row for input row r of (q, s)
     * and expert e's FP8 weight (w0[e] with scales s0[e]), r = src[j] / topk with src, else j;
     * out1 likewise from (w1, s1) when w1 ≠ NULL. q [Mq, K] e4m3 and s [ceil(K/128), Mq] as
     * fp8_quantize_rows wrote them (Mq = kn_fp8_rows of its M: the caller passes it); w0[e] [N, K]
     * e4m3 and s0[e] [ceil(N/128), kn_fp8_scale_ld(K)] (an FP8 weight, above); the arrays of E
     * pointers in this backend's memory. cpu: exactly gemm_fp8q per expert on the gathered rows;
     * cuda: compute capability 9.0 and a build for architecture 90 (else CM_ERR_UNSUPPORTED), K a
     * multiple of 16, q 16-byte aligned, each 128-wide group's products added by the tensor core
     * and promoted to fp32 (as cuBLASLt). A call with R = 0 checks only that it runs here. The rest
     * as moe_gemm. */
    cm_status (*moe_gemm_fp8)(kn_ctx *ctx, float *out0, float *out1, const uint8_t *q, const float *s, int64_t Mq,
                              const int32_t *src, int topk, const uint8_t *const *w0, const float *const *s0,
                              const uint8_t *const *w1, const float *const *s1, const int32_t *offsets, int64_t R,
                              int E, int64_t N, int64_t K); /* (optional) */
} kn_backend;

#define KN_MOE_MAX_EXPERTS 1024 /* experts a router may have (Qwen's largest: 512) */

#define KN_FP8_BLOCK 128
#define KN_FP8_MAX   448.0f
/* The rows of a quantized FP8 input (fp8_quantize_rows): M rounded up to a multiple of 16
 * (cuBLASLt's FP8 products want the token count a multiple of 4 or more). */
static inline int64_t kn_fp8_rows(int64_t M) { return (M + 15) / 16 * 16; }

/* The row length of an FP8 weight's scale table: ceil(K / 128) rounded up to a multiple of 4
 * (cuBLASLt's 128 × 128 scale layout wants column strides that are multiples of 4). */
static inline int64_t kn_fp8_scale_ld(int64_t K) {
    int64_t L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    return (L + 3) / 4 * 4;
}

/* The CUDA rule behind fp8_supported (kn_fp8_support.c): 1 for compute capability 9.0 with
 * cuBLASLt ≥ 12.9 (lt_version as cublasLtGetVersion, e.g. 130100), else 0 with the refusal
 * (device, what it lacks, and --precision bf16 as the way out) in why[0..n). */
int kn_fp8_support(int cc_major, int cc_minor, long lt_version, char *why, size_t n);

const kn_backend *kn_backend_cpu(void);
/* NULL when this build has no CUDA backend. */
const kn_backend *kn_backend_cuda(void);
/* "cpu" or "cuda" → the table; CM_ERR_UNSUPPORTED with a message when cuda is not built in,
 * CM_ERR_INVALID_ARG for any other name. */
cm_status kn_backend_get(const char *name, const kn_backend **out);

#ifdef __cplusplus
}
#endif
#endif /* KN_BACKEND_H */
