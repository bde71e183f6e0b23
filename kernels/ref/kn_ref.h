/* kernels/ref/kn_ref.h — the plain-C reference kernels: the executable specification that
 * kn_backend_cpu() exposes and that every CUDA kernel is tested against. Each function has
 * the signature of its kn_backend entry (see kn_backend.h for shapes and semantics).
 * Numerics: F32 storage; dot products, norms, softmax, the conv and the whole gated delta
 * rule run in double and round once on store. softplus(x) = x for x > 20, else log1p(e^x);
 * sigmoid(x) = 1/(1 + e^-x); silu(x) = x·sigmoid(x). Arguments are validated: bad shapes or
 * NULL pointers give CM_ERR_INVALID_ARG with a message, never a crash. The cpu kn_ctx holds
 * only its config; ops run synchronously on the calling thread (OpenMP inside when built). */
#ifndef KN_REF_H
#define KN_REF_H

#include <math.h>

#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- context and memory (kn_memory_ref.c); alloc is 64-byte aligned and zero-filled
cm_status kn_ref_ctx_create(kn_ctx **out, const kn_ctx_config *cfg);
void      kn_ref_ctx_destroy(kn_ctx **ctx);
cm_status kn_ref_alloc(kn_ctx *ctx, void **out, size_t bytes);
void      kn_ref_free(kn_ctx *ctx, void *p);
cm_status kn_ref_upload(kn_ctx *ctx, void *dst, const void *host_src, size_t bytes);
cm_status kn_ref_download(kn_ctx *ctx, void *host_dst, const void *src, size_t bytes);
cm_status kn_ref_copy_peer(kn_ctx *ctx, kn_ctx *dst_ctx, void *dst, const void *src, size_t bytes);
cm_status kn_ref_sync(kn_ctx *ctx);
cm_status kn_ref_zero(kn_ctx *ctx, void *p, size_t bytes);
cm_status kn_ref_copy2d(kn_ctx *ctx, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                        int64_t rows, int64_t cols);

/* Checks a packed-sequence table: cu[0] = 0, non-decreasing, cu[n_seq] = T. op names the
 * caller in the message. */
cm_status kn_ref_seqlens_check(const char *op, const int32_t *cu_seqlens, int n_seq, int64_t T);

// ---- elementwise (kn_elementwise_ref.c)
cm_status kn_ref_add(kn_ctx *ctx, float *x, const float *y, int64_t n);
cm_status kn_ref_swiglu(kn_ctx *ctx, float *out, const float *gate, const float *up, int64_t n);

// ---- embedding (kn_embed_ref.c) and GEMM (kn_gemm_ref.c)
cm_status kn_ref_embed(kn_ctx *ctx, float *out, const int32_t *ids, const void *table, cm_dtype tdt,
                       int64_t T, int64_t C);
/* Each output is one double-accumulated dot product of a row of inp with a row of W (BF16
 * widened exactly); tiles of rows run in parallel under OpenMP. */
cm_status kn_ref_gemm(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                      int64_t N, int64_t K);

// ---- norms (kn_norm_ref.c)
cm_status kn_ref_rmsnorm(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                         float eps, int one_plus);
cm_status kn_ref_rmsnorm_gated(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                               int64_t rows, int64_t C, float eps);
cm_status kn_ref_l2norm(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps);

// ---- attention pieces (kn_rope_ref.c, kn_attention_ref.c)
/* inv_freq[i] is rounded to F32 as Hugging Face computes it (1 / theta^((2i)/rot_dim) in
 * float32), the angle pos·inv_freq is rounded to F32 (HF's float32 product), and cos, sin
 * and the rotation are then evaluated in double. */
cm_status kn_ref_rope(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                      int rot_dim, float theta);
/* Two-pass softmax in double with max subtraction; parallel over (token, head). */
cm_status kn_ref_attention(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq,
                           int nkv, int hd, float scale);

// ---- gated deltanet pieces (kn_conv1d_ref.c, kn_gdn_ref.c)
cm_status kn_ref_conv1d_silu(kn_ctx *ctx, float *out, const float *x, const float *w,
                             const int32_t *cu_seqlens, int n_seq, int64_t T, int64_t C, int K);
cm_status kn_ref_gdn_gate(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b,
                          const float *A_log, const float *dt_bias, int64_t T, int nv);
/* The chunked WY/UT form (docs/target.md) with chunks of KN_REF_GDN_CHUNK tokens that
 * restart at every sequence start, all in double; parallel over (sequence, v-head). */
#define KN_REF_GDN_CHUNK 64
cm_status kn_ref_gated_delta_rule(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                  const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                  int64_t T, int nk, int nv, int dk, int dv, float scale);

// ---- incremental decoding (kn_cache_ref.c): the uncached ops' arithmetic continued from the
// cache (attention_cached and conv1d_silu_cached reproduce attention and conv1d_silu bit for bit
// when a sequence is fed in pieces; gdn_cached is the per-token recurrence in double from the
// F32 state, rounded once per state write). The tables (slots, base, n_adv) are validated here;
// slots[s] < n_slots cannot be (the ops are not told n_slots).
cm_status kn_ref_kv_cache_write(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                                const int32_t *slots, const int32_t *base, const int32_t *cu_seqlens, int n_seq,
                                int64_t T, int nkv, int hd, int64_t max_len);
cm_status kn_ref_attention_cached(kn_ctx *ctx, float *out, const float *q, const float *kc, const float *vc,
                                  const float *gate, const int32_t *slots, const int32_t *base,
                                  const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv, int hd,
                                  int64_t max_len, float scale);
cm_status kn_ref_conv1d_silu_cached(kn_ctx *ctx, float *out, const float *x, const float *w, float *state,
                                    const int32_t *slots, const int32_t *n_adv, const int32_t *cu_seqlens,
                                    int n_seq, int64_t T, int64_t C, int K);
cm_status kn_ref_gdn_cached(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v, const float *g,
                            const float *beta, float *state, const int32_t *slots, const int32_t *n_adv,
                            const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                            float scale);

// ---- drafter training: backward passes and the DFlash ops (kn_gemm_ref.c, kn_norm_ref.c,
// kn_rope_ref.c, kn_elementwise_ref.c, kn_dflash_attn_ref.c, kn_dynconv_ref.c, kn_lm_ce_ref.c,
// kn_selector_ref.c, kn_optim_ref.c).
// Each is deterministic: bit-identical run to run and for any thread count (every output
// element is summed by one thread in a fixed order; no atomics).
/* dinp[m, k] = Σ_n dout[m, n]·W[n, k] in double over n = 0..N-1 in order (plus the old
 * dinp[m, k] when accumulate), rounded once. N = 0 writes zeros (or leaves dinp as is). */
cm_status kn_ref_gemm_dx(kn_ctx *ctx, float *dinp, const float *dout, const void *w, cm_dtype wdt, int64_t M,
                         int64_t N, int64_t K, int accumulate);
/* dw[n, k] = dw[n, k] + Σ_m dout[m, n]·inp[m, k], the sum in double over m in order. */
cm_status kn_ref_gemm_dw(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                         int64_t K);
/* dinp = rstd·s⊙dout − inp·rstd³/C·Σ(dout⊙s⊙inp) with s = w or 1 + w; dw[c] += Σ_rows
 * dout·inp·rstd (the rows summed in order). */
cm_status kn_ref_rmsnorm_bwd(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                             const float *w, int64_t rows, int64_t C, float eps, int one_plus);
/* The transpose of kn_ref_rope: the same F32 inv_freq and F32 angle, the rotation by −angle. */
cm_status kn_ref_rope_bwd(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                          int rot_dim, float theta);
/* dup = dout·silu(gate); dgate = dout·up·σ(gate)·(1 + gate·(1 − σ(gate))). Either output
 * may alias dout. */
cm_status kn_ref_swiglu_bwd(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, int64_t n);
/* Validates 0 ≤ ctx_lo[j] ≤ anchors[j] < T for every block. Forward: one query row's scores
 * at a time, softmax in double with max subtraction, lse = max + log Σ; parallel over
 * (query row, head). Backward: the probabilities are recomputed from the saved lse; pass 1
 * (parallel over query rows) gives dq and Δ = Σ p·dp per query; pass 2 (parallel over key
 * rows × kv heads) sums dk, dv over the blocks, slots and group heads that see the key, in
 * that fixed order. */
cm_status kn_ref_dflash_attn_fwd(kn_ctx *ctx, const kn_dflash_attn_params *p);
cm_status kn_ref_dflash_attn_bwd(kn_ctx *ctx, const kn_dflash_attn_params *p);
/* kn_dynconv_ref.c: sums in double, one output row (fwd) or one input row (bwd: its dx gathers
 * the taps of the rows after it in the block) per task, so results do not depend on the thread
 * count; dbase and ddelta are sums over rows taken in row order. */
cm_status kn_ref_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p);
cm_status kn_ref_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p);
/* kn_selector_ref.c: scores in double rounded once, choice and ce from the stored F32 scores; the
 * backward's d from the stored scores in double, dP and dS by a stable counting sort of the
 * contributions by target row (scratch: d [n, K] doubles, the sort's order [n·K] and starts
 * [V + 2]), each touched row one double sum in ascending (i, c) added to its old value. Token ids
 * (labels, pred, topk_idx; bwd: pred, cand, lab_pos in [−1, K)) are validated. */
cm_status kn_ref_selector_fwd(kn_ctx *ctx, const kn_selector_params *p);
cm_status kn_ref_selector_bwd(kn_ctx *ctx, const kn_selector_params *p);
/* Chunks of KN_REF_LM_CE_ROWS rows share each widened row of W; per-thread scratch is one
 * chunk of logits in double ([rows, V]) and one [rows, D] accumulator for dh. Labels must be
 * in [0, V); gscale may be NULL when dh is NULL. */
#define KN_REF_LM_CE_ROWS 8
cm_status kn_ref_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h,
                       const int32_t *labels, const float *gscale, const void *w, cm_dtype wdt, int64_t R,
                       int64_t V, int64_t D);
/* lm_ce's pass (the same code, so ce, argmax and dh are lm_ce's bits) with the top-K of each
 * row's double logits, ordered by the double value, stored rounded to float, and the label's
 * logit likewise. A row with fewer than K logits that are not NaN pads with (−1, NaN). */
cm_status kn_ref_lm_ce_topk(kn_ctx *ctx, const kn_lm_topk_params *p);
/* Fixed chunks of KN_REF_SUMSQ_CHUNK values, each summed in double, then the chunk sums in
 * order: the same result for any thread count. */
#define KN_REF_SUMSQ_CHUNK 65536
cm_status kn_ref_sumsq(kn_ctx *ctx, double *out, const float *x, int64_t n);
/* Per element in double (the F32 hyperparameters widened), m, v and param stored as F32;
 * the param update uses the unrounded double m and v of this step. */
cm_status kn_ref_adamw(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                       const kn_adamw_params *p);
/* Counter-based uniform fill (kn_fill.h), F32 or BF16. */
cm_status kn_ref_fill_uniform(kn_ctx *ctx, void *dst, cm_dtype dt, int64_t n, uint64_t seed, float lo, float hi);

// ---- bf16 GEMM inputs written by their producers (kn_gemm_ref.c, kn_norm_ref.c,
// kn_elementwise_ref.c, kn_conv1d_ref.c). Each is specified as the composition of the
// entries above followed by F32 → BF16 rounding to nearest even (cm_f32_to_bf16).
/* Always 0: the cpu gemm is fp32 in every mode. */
int       kn_ref_gemm_rounds_input(const kn_ctx *ctx);
/* Widens inp to F32 and runs kn_ref_gemm. */
cm_status kn_ref_gemm_bf16in(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt, int64_t M,
                             int64_t N, int64_t K);
/* kn_ref_gemm_bf16in into a temporary, then kn_ref_add onto out. */
cm_status kn_ref_gemm_bf16in_acc(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                                 int64_t M, int64_t N, int64_t K);
/* kn_ref_add (when y ≠ NULL), then kn_ref_rmsnorm of each row rounded to BF16. */
cm_status kn_ref_add_rmsnorm_bf16(kn_ctx *ctx, uint16_t *out, float *x, const float *y, const float *w,
                                  int64_t rows, int64_t C, float eps, int one_plus);
cm_status kn_ref_rmsnorm_gated_bf16(kn_ctx *ctx, uint16_t *out, const float *x, const float *z, const float *w,
                                    int64_t rows, int64_t C, float eps);
cm_status kn_ref_swiglu_bf16(kn_ctx *ctx, uint16_t *out, const float *gate, const float *up, int64_t n);
/* kn_ref_conv1d_silu into a scratch [T, C], then kn_ref_copy2d of the q, k, v column ranges
 * and kn_ref_l2norm of the q and k heads. */
cm_status kn_ref_gdn_conv_qkv(kn_ctx *ctx, float *q, float *k, float *v, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                              int K, float eps);
/* kn_ref_gdn_conv_qkv into F32 scratch, then bf16(q·q_scale), bf16(k), bf16(v). */
cm_status kn_ref_gdn_conv_qkv_bf16(kn_ctx *ctx, uint16_t *q, uint16_t *k, uint16_t *v, const float *x,
                                   const float *w, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                                   int dk, int dv, int K, float eps, float q_scale);
/* kn_ref_gated_delta_rule on q, k, v widened from bf16, scale 1 (q carries it). */
cm_status kn_ref_gated_delta_rule_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, const float *g, const float *beta, const int32_t *cu_seqlens,
                                       int n_seq, int64_t T, int nk, int nv, int dk, int dv);
/* copy2d split, rmsnorm and rope of the attention's q and k in one pass per token, with the
 * arithmetic of kn_ref_copy2d, kn_ref_rmsnorm and kn_ref_rope (bit-identical to that chain). */
cm_status kn_ref_qk_prep(kn_ctx *ctx, float *q, float *gate, float *k, const float *qg, const float *q_norm,
                         const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv, int hd, int rot_dim,
                         float theta, float eps, int one_plus);

// ---- drafter training with BF16 saved activations (kn_mixed_ref.c): BF16 read by widening
// exactly, every result computed in double, rounded to F32 and then, for a BF16 output, to BF16
// (nearest even).
cm_status kn_ref_cast2d(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dst_ld, const void *src, cm_dtype sdt,
                        int64_t src_ld, int64_t rows, int64_t cols);
/* Each output one double sum over k in order (plus the old C when accumulate), rounded once
 * to F32 (then to BF16 for a BF16 C); parallel over rows of C. */
cm_status kn_ref_matmul(kn_ctx *ctx, const kn_matmul_params *p);
cm_status kn_ref_swiglu_typed(kn_ctx *ctx, void *out, cm_dtype odt, const void *gate, const void *up, cm_dtype idt,
                              int64_t n);
cm_status kn_ref_swiglu_bwd_typed(kn_ctx *ctx, void *dgate, void *dup, const void *dout, const void *gate,
                                  const void *up, cm_dtype dt, int64_t n);
cm_status kn_ref_swiglu_fwd_bwd_typed(kn_ctx *ctx, void *h, void *dgate, void *dup, const void *dout,
                                      const void *gate, const void *up, cm_dtype dt, int64_t n);
/* kn_ref_rmsnorm_bwd into a temporary, then kn_ref_add into dinp. */
cm_status kn_ref_rmsnorm_bwd_acc(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus);
// ---- the drafter's norms on typed storage (kn_norm_typed_ref.c): compositions of the references
// above (widen, rmsnorm / rmsnorm_bwd, rope / rope_bwd, cast2d), bit-identical to those chains.
cm_status kn_ref_rmsnorm_typed(kn_ctx *ctx, const kn_norm_typed_params *p);
cm_status kn_ref_rmsnorm_bwd_typed(kn_ctx *ctx, const kn_norm_bwd_typed_params *p);
cm_status kn_ref_head_norm_rope(kn_ctx *ctx, void *out, cm_dtype out_dt, const void *x, cm_dtype x_dt,
                                const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rot_dim,
                                float theta, float eps);
cm_status kn_ref_head_norm_rope_bwd(kn_ctx *ctx, void *dinp, cm_dtype dinp_dt, float *dw, float *dout,
                                    const void *x, cm_dtype x_dt, const float *w, const int32_t *pos,
                                    int64_t T, int nh, int hd, int rot_dim, float theta, float eps);
// ---- the multi-tensor optimizer step (kn_optim_multi_ref.c): kn_ref_sumsq of each tensor summed
// in table order; kn_ref_adamw of each with grad_scale = float(the clip factor).
cm_status kn_ref_sumsq_multi(kn_ctx *ctx, double *out, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks);
cm_status kn_ref_adamw_multi(kn_ctx *ctx, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks,
                             const kn_adamw_params *p, const double *sumsq, double clip);

// ---- FP8 block-scaled ops (kn_fp8_ref.c)
cm_status kn_ref_fp8_quantize_weight(kn_ctx *ctx, uint8_t *q, float *scale, const void *w, cm_dtype wdt,
                                     int64_t N, int64_t K);
cm_status kn_ref_gemm_fp8(kn_ctx *ctx, float *out, const void *inp, cm_dtype idt, const uint8_t *wq,
                          const float *wscale, int64_t M, int64_t N, int64_t K);
cm_status kn_ref_fp8_quantize_rows(kn_ctx *ctx, uint8_t *q, float *s, const void *inp, cm_dtype idt, int64_t M,
                                   int64_t K);
cm_status kn_ref_swiglu_fp8(kn_ctx *ctx, uint8_t *q, float *s, const void *gate, const void *up, cm_dtype idt,
                            int64_t M, int64_t I);
cm_status kn_ref_gemm_fp8q(kn_ctx *ctx, void *out, cm_dtype odt, const uint8_t *q, const float *s,
                           const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K);
/* kn_ref_gemm_fp8q's F32 product into a temporary, then kn_ref_add onto out. */
cm_status kn_ref_gemm_fp8q_acc(kn_ctx *ctx, float *out, const uint8_t *q, const float *s, const uint8_t *wq,
                               const float *wscale, int64_t M, int64_t N, int64_t K);
cm_status kn_ref_add_rmsnorm_fp8(kn_ctx *ctx, uint16_t *out, uint8_t *q, float *s, float *x, const float *y,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus);
cm_status kn_ref_rmsnorm_gated_fp8(kn_ctx *ctx, uint8_t *q, float *s, const float *x, const float *z, const float *w,
                                   int64_t T, int64_t H, int64_t C, float eps);
int       kn_ref_fp8_supported(const kn_ctx *ctx, char *why, size_t n);
/* A model of an FP8 tensor core's limited-width accumulation (kn_fp8_tc_ref.c), for diagnosis: bits
 * 0 is the exact reference. kn_ref_fp8_tc_model reads TANDEM_FP8_REF_TC (unset: bits 0) and
 * refuses a malformed value; kn_ref_fp8_tc_dot sums a group's n products a[i]·w[i] by the model. */
typedef struct kn_fp8_tc_model {
    int bits, chunk, promote;
} kn_fp8_tc_model;
cm_status kn_ref_fp8_tc_model(kn_fp8_tc_model *m);
double    kn_ref_fp8_tc_dot(const float *a, const float *w, int64_t n, const kn_fp8_tc_model *m);

// ---- mixture of experts (kn_moe_ref.c): fp32 in the header's order, not double (the router's
// choice must be the one the CUDA kernel makes). route: m = max, p = expf(l − m), the sum in
// expert order, p / sum; K rounds of selection (the first of equals wins, a NaN p ranks below
// every number); renorm divides by the fp32 sum of the K chosen p in k order. group: a stable
// counting sort. combine: acc = Σ_k w·y in k order from 0.0f, then + (1 / (1 + expf(−sgate)))·shared.
// idx, src and dst are validated ([0, E) and [0, T·K)); T·K must fit I32.
cm_status kn_ref_moe_route(kn_ctx *ctx, int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                           int renorm);
cm_status kn_ref_moe_group(kn_ctx *ctx, int32_t *offsets, int32_t *src, int32_t *dst, const int32_t *idx, int64_t T,
                           int E, int K);
cm_status kn_ref_moe_gather(kn_ctx *ctx, void *out, const void *in, cm_dtype dt, const int32_t *src, int64_t T, int K,
                            int64_t D);
cm_status kn_ref_moe_combine(kn_ctx *ctx, float *out, const float *y, const int32_t *dst, const float *w,
                             const float *shared, const float *sgate, int64_t T, int K, int64_t D);
/* moe_gemm: each output a double sum of the bf16 products rounded once to fp32 (more exact than
 * the kernel's fp32 accumulation; tests allow the difference); offsets validated. */
cm_status kn_ref_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const int32_t *src, int topk,
                          const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                          int E, int64_t N, int64_t K);
/* moe_gemm_fp8: each expert's rows gathered (with their scales) and put through kn_ref_gemm_fp8q, so
 * the result is the per-expert GEMMs' bit for bit. */
cm_status kn_ref_moe_gemm_fp8(kn_ctx *ctx, float *out0, float *out1, const uint8_t *q, const float *s, int64_t Mq,
                              const int32_t *src, int topk, const uint8_t *const *w0, const float *const *s0,
                              const uint8_t *const *w1, const float *const *s1, const int32_t *offsets, int64_t R,
                              int E, int64_t N, int64_t K);
/* moe_gemm_swiglu: moe_gemm into two F32 buffers, then swiglu_bf16 (the composition, by definition). */
cm_status kn_ref_moe_gemm_swiglu(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const int32_t *src, int topk,
                                 const uint16_t *const *wg, const uint16_t *const *wu, const int32_t *offsets,
                                 int64_t R, int E, int64_t N, int64_t K);

// ---- scalar functions shared by the reference files
static inline double kn_ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double kn_ref_silu(double x) { return x / (1.0 + exp(-x)); }
static inline double kn_ref_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

/* Σ a[i]·b[i] over F32 inputs: the products are exact in double, the sum is accumulated in
 * double over four interleaved partial sums (for instruction-level parallelism). */
static inline double kn_ref_dot(const float *a, const float *b, int64_t n) {
    double  s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)a[i + 0] * (double)b[i + 0];
        s1 += (double)a[i + 1] * (double)b[i + 1];
        s2 += (double)a[i + 2] * (double)b[i + 2];
        s3 += (double)a[i + 3] * (double)b[i + 3];
    }
    for (; i < n; i++) s0 += (double)a[i] * (double)b[i];
    return (s0 + s1) + (s2 + s3);
}

/* One query row of causal attention, the reference's arithmetic: scores q·k_j · scale over the n keys at
 * k + j·stride (double), softmax, Σ p_j v_j (v at the same stride), times sigmoid(gate) when gate is
 * non-NULL, written to o [hd]. p [n] and acc [hd] are the caller's scratch. */
static inline void kn_ref_attend_row(float *o, const float *q, const float *k, const float *v, int64_t stride,
                                     int64_t n, int hd, float scale, const float *gate, double *p, double *acc) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        p[j] = kn_ref_dot(q, k + j * stride, hd) * (double)scale;
        if (p[j] > mx) mx = p[j];
    }
    double sum = 0;
    for (int64_t j = 0; j < n; j++) {
        p[j] = exp(p[j] - mx);
        sum += p[j];
    }
    for (int c = 0; c < hd; c++) acc[c] = 0;
    for (int64_t j = 0; j < n; j++) {
        const float *vr = v + j * stride;
        const double ps = p[j] / sum;
        for (int c = 0; c < hd; c++) acc[c] += ps * (double)vr[c];
    }
    for (int c = 0; c < hd; c++) o[c] = (float)(gate ? acc[c] * kn_ref_sigmoid(gate[c]) : acc[c]);
}

/* fn(task, scratch, user) for every task < n_tasks, in parallel under OpenMP (a dynamic schedule,
 * chunk tasks at a time), each thread with its own scratch of scratch_bytes (malloc's alignment)
 * for all its tasks. Tasks must write disjoint outputs. CM_ERR_NOMEM naming op when a thread's
 * scratch cannot be had (kn_parallel_ref.c). */
typedef void (*kn_ref_task_fn)(int64_t task, void *scratch, const void *user);
cm_status kn_ref_parallel(const char *op, int64_t n_tasks, int chunk, size_t scratch_bytes, kn_ref_task_fn fn,
                          const void *user);

/* The (token, q head) rows of a reference attention: row(task, p, acc, user) for every task < n_tasks,
 * in parallel under OpenMP, each thread with scratch p [n_keys] and acc [hd] doubles for
 * kn_ref_attend_row (kn_attention_ref.c). CM_ERR_NOMEM naming op when the scratch cannot be had. */
typedef void (*kn_ref_attend_fn)(int64_t task, double *p, double *acc, const void *user);
cm_status kn_ref_attend_rows(const char *op, int64_t n_tasks, int64_t n_keys, int hd, kn_ref_attend_fn row,
                             const void *user);

/* Argument validation: returns CM_ERR_INVALID_ARG with the formatted message when cond is false. */
#define KN_REF_CHECK(cond, ...)                                                                              \
    do {                                                                                                     \
        if (!(cond)) return CM_FAIL(CM_ERR_INVALID_ARG, __VA_ARGS__);                                        \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* KN_REF_H */
