/* kernels/kn_attention_int.h — internal to kn_cuda_attention: the bf16 flash forms that
 * kn_attention.cu dispatches to, each in its own file. Arguments are checked by the caller
 * (kn_cuda_attention); C++ only. */
#ifndef KN_ATTENTION_INT_H
#define KN_ATTENTION_INT_H

#include "kn_cuda.h"

#include <stddef.h>
#include <stdint.h>

#define KN_ATT_FA2_LEVEL 64 /* rows per schedule tile of the FlashAttention-2 form (its rows per CTA) */

/* kn_attention_mma.cu. Shared memory of one CTA of the FlashAttention-2 kernel with hpb q heads
 * per CTA and stg K/V stages at head dim hd. */
size_t kn_attention_fa2_smem(int hd, int hpb, int stg);

/* The FlashAttention-2 form at head dim hd (64, 128 or 256), hpb (1 or 2) q heads per CTA,
 * n_max work-list entries (ceil(T / KN_ATT_FA2_LEVEL) + n_seq, ≤ 65535). */
cm_status kn_attention_fa2(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                           int hd, float scale, int hpb, int n_max);

/* kn_attention_mma.cu. The work list of both flash forms in the ctx scratch, after the first
 * `head` bytes (which the caller keeps for its own copies): every 64-row tile of every sequence,
 * longest key range first, n_max entries (ceil(T / KN_ATT_FA2_LEVEL) + n_seq); enqueued on
 * ctx->stream. */
cm_status kn_attention_schedule(kn_ctx *ctx, const int32_t *cu, int n_seq, int64_t T, int n_max, size_t head,
                                int4 **tiles);

/* kn_attention_sm90a.cu. The wgmma form: the GPU is compute capability 9.0, the build has
 * architecture 90 and its shared memory fits at head dim hd (128 or 256). */
bool kn_attention_wg_available(kn_ctx *ctx, int hd);

/* The wgmma form at head dim hd (128 or 256), nq / nkv even, n_max as above (≤ 65535). */
cm_status kn_attention_wg(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v, const float *gate,
                          const int32_t *cu, int n_seq, int64_t T, int nq, int nkv, int hd, float scale, int n_max);

/* kn_attention_wmma.cu. Shared memory of one block of the WMMA kernel at head dim hd (≤ 256). */
size_t kn_attention_wmma_smem(int hd);

/* The WMMA form at any head dim ≤ 256 (padded to 64, 128 or 256). */
cm_status kn_attention_wmma(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                            int hd, float scale);

#endif /* KN_ATTENTION_INT_H */
