/* kernels/kn_cuda_ops.h — the CUDA launchers behind kn_backend_cuda(): one per kn_backend
 * entry, with the entry's signature and semantics (kn_backend.h). Pointers are device memory
 * from kn_cuda_alloc; every op validates its arguments on the host (CM_ERR_INVALID_ARG with
 * a message), enqueues on ctx->stream and returns before completion, except download and
 * sync (and upload, which waits so that host_src may be reused at once). Shape products are
 * computed in int64. Declarations only; the table is in kn_backend_cuda.c. */
#ifndef KN_CUDA_OPS_H
#define KN_CUDA_OPS_H

#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- context and memory (kn_memory.cu)
/* CM_ERR_UNSUPPORTED when no cuda device is present (or the driver is missing) and when the
 * ordinal is out of range; CM_ERR_CUDA / CM_ERR_CUBLAS for other failures. */
cm_status kn_cuda_ctx_create(kn_ctx **out, const kn_ctx_config *cfg);
void      kn_cuda_ctx_destroy(kn_ctx **ctx);
cm_status kn_cuda_ctx_bind(kn_ctx *ctx);
cm_status kn_cuda_alloc(kn_ctx *ctx, void **out, size_t bytes);
void      kn_cuda_free(kn_ctx *ctx, void *p);
cm_status kn_cuda_upload(kn_ctx *ctx, void *dst, const void *host_src, size_t bytes);
cm_status kn_cuda_host_pin(kn_ctx *ctx, void *p, size_t bytes);
void      kn_cuda_host_unpin(kn_ctx *ctx, void *p);
cm_status kn_cuda_download(kn_ctx *ctx, void *host_dst, const void *src, size_t bytes);
cm_status kn_cuda_copy_peer(kn_ctx *ctx, kn_ctx *dst_ctx, void *dst, const void *src, size_t bytes);
cm_status kn_cuda_sync(kn_ctx *ctx);
cm_status kn_cuda_zero(kn_ctx *ctx, void *p, size_t bytes);
cm_status kn_cuda_copy2d(kn_ctx *ctx, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                         int64_t rows, int64_t cols);

// ---- elementwise (kn_elementwise.cu)
cm_status kn_cuda_add(kn_ctx *ctx, float *x, const float *y, int64_t n);
cm_status kn_cuda_swiglu(kn_ctx *ctx, float *out, const float *gate, const float *up, int64_t n);

// ---- embedding (kn_embed.cu) and GEMM (kn_gemm.cu)
cm_status kn_cuda_embed(kn_ctx *ctx, float *out, const int32_t *ids, const void *table, cm_dtype tdt,
                        int64_t T, int64_t C);
cm_status kn_cuda_gemm(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                       int64_t N, int64_t K);

// ---- norms (kn_norm.cu)
cm_status kn_cuda_rmsnorm(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                          float eps, int one_plus);
cm_status kn_cuda_rmsnorm_gated(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                                int64_t rows, int64_t C, float eps);
cm_status kn_cuda_l2norm(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps);

// ---- attention pieces (kn_rope.cu; kn_attention.cu with kn_attention_mma.cu, kn_attention_wmma.cu)
cm_status kn_cuda_rope(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                       int rot_dim, float theta);
cm_status kn_cuda_attention(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq,
                            int nkv, int hd, float scale);

// ---- gated deltanet pieces (kn_conv1d.cu, kn_gdn_gate.cu; kn_gdn.cu with kn_gdn_chunk.cu, kn_gdn_state.cu)
cm_status kn_cuda_conv1d_silu(kn_ctx *ctx, float *out, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int64_t C, int K);
cm_status kn_cuda_gdn_gate(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b,
                           const float *A_log, const float *dt_bias, int64_t T, int nv);
cm_status kn_cuda_gated_delta_rule(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                   int64_t T, int nk, int nv, int dk, int dv, float scale);

// ---- incremental decoding (kn_cache.cu). The sequence tables are device memory: a sequence
// that breaks a rule the cpu reference refuses gets NaN outputs and no cache or state writes.
cm_status kn_cuda_kv_cache_write(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                                 const int32_t *slots, const int32_t *base, const int32_t *cu_seqlens, int n_seq,
                                 int64_t T, int nkv, int hd, int64_t max_len);
cm_status kn_cuda_attention_cached(kn_ctx *ctx, float *out, const float *q, const float *kc, const float *vc,
                                   const float *gate, const int32_t *slots, const int32_t *base,
                                   const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv, int hd,
                                   int64_t max_len, float scale);
cm_status kn_cuda_conv1d_silu_cached(kn_ctx *ctx, float *out, const float *x, const float *w, float *state,
                                     const int32_t *slots, const int32_t *n_adv, const int32_t *cu_seqlens,
                                     int n_seq, int64_t T, int64_t C, int K);
cm_status kn_cuda_gdn_cached(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, float *state, const int32_t *slots,
                             const int32_t *n_adv, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                             int dk, int dv, float scale);

// ---- drafter training (kn_gemm_bwd.cu, kn_norm_bwd.cu, kn_rope.cu, kn_elementwise_bwd.cu,
// kn_dflash_attn.cu, kn_lm_ce.cu, kn_optim.cu). Deterministic: no float atomics, fixed
// reduction orders. Device-memory indices (anchors, ctx_lo, labels) are not validated on the
// host: the kernels clamp or flag them (see each file).
cm_status kn_cuda_gemm_dx(kn_ctx *ctx, float *dinp, const float *dout, const void *w, cm_dtype wdt, int64_t M,
                          int64_t N, int64_t K, int accumulate);
cm_status kn_cuda_gemm_dw(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                          int64_t K);
cm_status kn_cuda_rmsnorm_bwd(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, int64_t rows, int64_t C, float eps, int one_plus);
cm_status kn_cuda_rope_bwd(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                           int rot_dim, float theta);
cm_status kn_cuda_swiglu_bwd(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, int64_t n);
cm_status kn_cuda_dflash_attn_fwd(kn_ctx *ctx, const kn_dflash_attn_params *p);
cm_status kn_cuda_dflash_attn_bwd(kn_ctx *ctx, const kn_dflash_attn_params *p);
cm_status kn_cuda_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p); /* kn_dynconv.cu */
cm_status kn_cuda_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p);
cm_status kn_cuda_selector_fwd(kn_ctx *ctx, const kn_selector_params *p); /* kn_selector.cu */
cm_status kn_cuda_selector_bwd(kn_ctx *ctx, const kn_selector_params *p);
cm_status kn_cuda_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h, const int32_t *labels,
                        const float *gscale, const void *w, cm_dtype wdt, int64_t R, int64_t V, int64_t D);
cm_status kn_cuda_lm_ce_topk(kn_ctx *ctx, const kn_lm_topk_params *p);
cm_status kn_cuda_sumsq(kn_ctx *ctx, double *out, const float *x, int64_t n);
cm_status kn_cuda_adamw(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                        const kn_adamw_params *p);

// ---- bf16 GEMM inputs written by their producers (kn_gemm.cu, kn_norm.cu,
// kn_elementwise.cu, kn_conv1d.cu)
int       kn_cuda_gemm_rounds_input(const kn_ctx *ctx);
cm_status kn_cuda_gemm_bf16in(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                              int64_t M, int64_t N, int64_t K);
cm_status kn_cuda_gemm_bf16in_acc(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                                  int64_t M, int64_t N, int64_t K);
cm_status kn_cuda_add_rmsnorm_bf16(kn_ctx *ctx, uint16_t *out, float *x, const float *y, const float *w,
                                   int64_t rows, int64_t C, float eps, int one_plus);
cm_status kn_cuda_rmsnorm_gated_bf16(kn_ctx *ctx, uint16_t *out, const float *x, const float *z,
                                     const float *w, int64_t rows, int64_t C, float eps);
cm_status kn_cuda_swiglu_bf16(kn_ctx *ctx, uint16_t *out, const float *gate, const float *up, int64_t n);
cm_status kn_cuda_gdn_conv_qkv(kn_ctx *ctx, float *q, float *k, float *v, const float *x, const float *w,
                               const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk,
                               int dv, int K, float eps);
cm_status kn_cuda_gdn_conv_qkv_bf16(kn_ctx *ctx, uint16_t *q, uint16_t *k, uint16_t *v, const float *x,
                                    const float *w, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk,
                                    int nv, int dk, int dv, int K, float eps, float q_scale);
cm_status kn_cuda_gated_delta_rule_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                                        const uint16_t *v, const float *g, const float *beta,
                                        const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                                        int dk, int dv); /* kn_gdn.cu */
cm_status kn_cuda_qk_prep(kn_ctx *ctx, float *q, float *gate, float *k, const float *qg, const float *q_norm,
                          const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv, int hd, int rot_dim,
                          float theta, float eps, int one_plus); /* kn_qk_prep.cu */

// ---- drafter training with BF16 saved activations (kn_matmul.cu, kn_elementwise_bwd.cu)
cm_status kn_cuda_cast2d(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dst_ld, const void *src, cm_dtype sdt,
                         int64_t src_ld, int64_t rows, int64_t cols);
cm_status kn_cuda_matmul(kn_ctx *ctx, const kn_matmul_params *p);
cm_status kn_cuda_swiglu_typed(kn_ctx *ctx, void *out, cm_dtype odt, const void *gate, const void *up, cm_dtype idt,
                               int64_t n);
cm_status kn_cuda_swiglu_bwd_typed(kn_ctx *ctx, void *dgate, void *dup, const void *dout, const void *gate,
                                   const void *up, cm_dtype dt, int64_t n);
cm_status kn_cuda_swiglu_fwd_bwd_typed(kn_ctx *ctx, void *h, void *dgate, void *dup, const void *dout,
                                       const void *gate, const void *up, cm_dtype dt, int64_t n);
cm_status kn_cuda_rmsnorm_bwd_acc(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                  const float *w, int64_t rows, int64_t C, float eps, int one_plus); /* kn_norm_bwd.cu */
cm_status kn_cuda_rmsnorm_bwd_typed(kn_ctx *ctx, const kn_norm_bwd_typed_params *p); /* kn_norm_bwd.cu */
cm_status kn_cuda_rmsnorm_typed(kn_ctx *ctx, const kn_norm_typed_params *p);         /* kn_norm.cu */
cm_status kn_cuda_head_norm_rope(kn_ctx *ctx, void *out, cm_dtype out_dt, const void *x, cm_dtype x_dt,
                                 const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rot_dim,
                                 float theta, float eps);
cm_status kn_cuda_head_norm_rope_bwd(kn_ctx *ctx, void *dinp, cm_dtype dinp_dt, float *dw, float *dout,
                                     const void *x, cm_dtype x_dt, const float *w, const int32_t *pos,
                                     int64_t T, int nh, int hd, int rot_dim, float theta,
                                     float eps); /* kn_head_norm.cu */
// ---- the multi-tensor optimizer step (kn_optim.cu)
cm_status kn_cuda_sumsq_multi(kn_ctx *ctx, double *out, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks);
cm_status kn_cuda_adamw_multi(kn_ctx *ctx, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks,
                              const kn_adamw_params *p, const double *sumsq, double clip);

// ---- FP8 block-scaled GEMMs (kn_fp8.cu)
cm_status kn_cuda_fp8_quantize_weight(kn_ctx *ctx, uint8_t *q, float *scale, const void *w, cm_dtype wdt,
                                      int64_t N, int64_t K);
cm_status kn_cuda_gemm_fp8(kn_ctx *ctx, float *out, const void *inp, cm_dtype idt, const uint8_t *wq,
                           const float *wscale, int64_t M, int64_t N, int64_t K);
cm_status kn_cuda_fp8_quantize_rows(kn_ctx *ctx, uint8_t *q, float *s, const void *inp, cm_dtype idt, int64_t M,
                                    int64_t K);
cm_status kn_cuda_swiglu_fp8(kn_ctx *ctx, uint8_t *q, float *s, const void *gate, const void *up, cm_dtype idt,
                             int64_t M, int64_t I);
cm_status kn_cuda_gemm_fp8q(kn_ctx *ctx, void *out, cm_dtype odt, const uint8_t *q, const float *s,
                            const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K);
cm_status kn_cuda_gemm_fp8q_acc(kn_ctx *ctx, float *out, const uint8_t *q, const float *s, const uint8_t *wq,
                                const float *wscale, int64_t M, int64_t N, int64_t K);
cm_status kn_cuda_add_rmsnorm_fp8(kn_ctx *ctx, uint16_t *out, uint8_t *q, float *s, float *x, const float *y,
                                  const float *w, int64_t rows, int64_t C, float eps, int one_plus);
cm_status kn_cuda_rmsnorm_gated_fp8(kn_ctx *ctx, uint8_t *q, float *s, const float *x, const float *z, const float *w,
                                    int64_t T, int64_t H, int64_t C, float eps);
int       kn_cuda_fp8_supported(const kn_ctx *ctx, char *why, size_t n);

// ---- mixture of experts (kn_moe.cu). The index tables (idx, src, dst) are device memory and not
// validated on the host (the cpu reference refuses bad ones); nothing reads or writes out of
// bounds for them: moe_group counts an expert index outside [0, E) in no expert (its dst is −1
// and offsets[E] falls short of T·K), moe_gather writes a zero row for a src outside [0, T·K),
// moe_combine skips a dst outside it.
cm_status kn_cuda_moe_route(kn_ctx *ctx, int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                            int renorm);
cm_status kn_cuda_moe_group(kn_ctx *ctx, int32_t *offsets, int32_t *src, int32_t *dst, const int32_t *idx,
                            int64_t T, int E, int K);
cm_status kn_cuda_moe_gather(kn_ctx *ctx, void *out, const void *in, cm_dtype dt, const int32_t *src, int64_t T,
                             int K, int64_t D);
cm_status kn_cuda_moe_combine(kn_ctx *ctx, float *out, const float *y, const int32_t *dst, const float *w,
                              const float *shared, const float *sgate, int64_t T, int K, int64_t D);
cm_status kn_cuda_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const int32_t *src, int topk,
                           const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                           int E, int64_t N, int64_t K); /* kn_moe_gemm.cu */
cm_status kn_cuda_moe_gemm_swiglu(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const int32_t *src, int topk,
                                  const uint16_t *const *wg, const uint16_t *const *wu, const int32_t *offsets,
                                  int64_t R, int E, int64_t N, int64_t K);
cm_status kn_cuda_moe_gemm_fp8(kn_ctx *ctx, float *out0, float *out1, const uint8_t *q, const float *s, int64_t Mq,
                               const int32_t *src, int topk, const uint8_t *const *w0, const float *const *s0,
                               const uint8_t *const *w1, const float *const *s1, const int32_t *offsets, int64_t R,
                               int E, int64_t N, int64_t K);

// ---- random initialisation (kn_fill.cu)
cm_status kn_cuda_fill_uniform(kn_ctx *ctx, void *dst, cm_dtype dt, int64_t n, uint64_t seed, float lo,
                               float hi);

#ifdef __cplusplus
}
#endif
#endif /* KN_CUDA_OPS_H */
