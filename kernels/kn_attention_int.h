/* kernels/kn_attention_int.h — internal to kn_cuda_attention: the bf16 flash forms that
 * kn_attention.cu dispatches to, each in its own file, and the output epilogue the mma.sync and
 * wgmma forms share. Arguments are checked by the caller (kn_cuda_attention); C++ (CUDA) only. */
#ifndef KN_ATTENTION_INT_H
#define KN_ATTENTION_INT_H

#include "kn_cuda.h"

#include <stddef.h>
#include <stdint.h>

#include "kn_mma_sm80.h"

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

/* A lane's two output rows, row0 and row0 + 8, of head h: o holds the accumulator's C fragments
 * (o[4i + 2r + j] is row row0 + 8r, column 8i + 2tq + j), l the lane's partial sums of the rows.
 * out = o / l, times sigmoid(gate) where there is a gate; rows at or past r_end are not written.
 * The gate is read 16 pairs at a time ahead of their stores. Read one pair at a time between the
 * stores (which may alias it, as far as the compiler knows), every pair waited on memory: in the
 * wgmma form on the 27B forward, 33 of the 45 instructions with the most stall samples were the
 * first use of a gate value, 16.5 % of all samples between them. */
template <int HD>
static __device__ __forceinline__ void attn_store_rows(float *out, const float *gate,
                                                       const float (&o)[HD / 2], const float (&l)[2],
                                                       int row0, int r_end, int nq, int h, int tq) {
    constexpr int GB = 16 < HD / 8 ? 16 : HD / 8;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float lr = quad_sum(l[r]);
        const int   row = row0 + 8 * r;
        if (row >= r_end)
            continue;
        const float   inv = 1.0f / lr;
        const int64_t base = ((int64_t)row * nq + h) * HD + 2 * tq;
#pragma unroll
        for (int i0 = 0; i0 < HD / 8; i0 += GB) {
            float2 gt[GB];
            if (gate) {
#pragma unroll
                for (int i = 0; i < GB; i++)
                    gt[i] = __ldg(reinterpret_cast<const float2 *>(gate + base + 8 * (i0 + i)));
            }
#pragma unroll
            for (int i = 0; i < GB; i++) {
                const int k = 4 * (i0 + i) + 2 * r;
                float2    y = make_float2(o[k] * inv, o[k + 1] * inv);
                if (gate) {
                    y.x *= 1.0f / (1.0f + __expf(-gt[i].x));
                    y.y *= 1.0f / (1.0f + __expf(-gt[i].y));
                }
                *reinterpret_cast<float2 *>(out + base + 8 * (i0 + i)) = y;
            }
        }
    }
}

#endif /* KN_ATTENTION_INT_H */
