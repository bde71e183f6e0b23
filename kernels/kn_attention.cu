/* kernels/kn_attention.cu — causal GQA attention within each packed sequence, then the
 * optional output gate: out[t, h] = softmax_{bos≤s≤t}(scale·q[t,h]·k[s,h/(nq/nkv)]) · v ⊙
 * sigmoid(gate[t, h]). The kernel follows the context's precision:
 *
 * - KN_GEMM_MODE_F32 (the fp32 oracle checks): a simple exact kernel (here), one block of 4
 *   warps per (token, q head). Lane l holds dims l, l+32, … (hd ≤ 256, so ≤ 8 per lane) of q
 *   and of an fp32 output accumulator; warp w takes keys bos+w, bos+w+4, …: a coalesced read of
 *   the key row, a shuffle-reduced dot product, and an online-softmax update (running max m,
 *   sum l, acc rescaled by e^{m_old − m_new}). The 4 warps' (m, l, acc) are merged through
 *   shared memory at the end. All math fp32 with expf; O(len²) work per sequence, no score
 *   matrix.
 * - KN_GEMM_MODE_BF16 (serving) on compute capability 9.0, head dims 128 and 256, an even GQA
 *   group: FlashAttention on Hopper's warpgroup MMA (kn_attention_sm90a.cu).
 * - KN_GEMM_MODE_BF16, otherwise at head dims 64, 128 and 256: FlashAttention-2 on mma.sync
 *   (kn_attention_mma.cu).
 * - KN_GEMM_MODE_BF16, other head dims, or where the device's shared memory per block is too
 *   small for the form above: the first flash kernel, WMMA 16×16×16 (kn_attention_wmma.cu).
 *   q, k, v and the probabilities are rounded to bf16: a few 1e-3 relative, as FlashAttention.
 *
 * The token's sequence start is a binary search of cu_seqlens (device memory, checked by
 * the caller before upload; clamped so a bad table cannot cause a wild read). */
#include "kn_attention_int.h"
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATT_WARPS  4
#define ATT_MAX_HD 256

// ----------------------------------------------------------------------------
// kernels

/* NJ = dims per lane = ceil(hd / 32). grid (T, nq), block 32·ATT_WARPS. */
template <int NJ>
static __global__ void attention_kernel(float *out, const float *q, const float *k, const float *v,
                                        const float *gate, const int32_t *cu, int n_seq, int nq, int nkv,
                                        int hd, float scale) {
    __shared__ float sh_m[ATT_WARPS], sh_l[ATT_WARPS];
    __shared__ float sh_acc[ATT_WARPS][ATT_MAX_HD];

    const int64_t t = blockIdx.x;
    const int     h = blockIdx.y;
    const int     kvh = h / (nq / nkv);
    const int     lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t bos = seq_start(cu, n_seq, t);

    const float *qr = q + (t * nq + h) * (int64_t)hd;
    float        qv[NJ], acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        qv[j] = d < hd ? qr[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t s = bos + warp; s <= t; s += ATT_WARPS) {
        const float *kr = k + (s * nkv + kvh) * (int64_t)hd;
        const float *vr = v + (s * nkv + kvh) * (int64_t)hd;
        float        dot = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int d = lane + 32 * j;
            if (d < hd)
                dot += qv[j] * kr[d];
        }
        dot = warp_sum(dot);
        float score = dot * scale;
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new); /* 0 on the first key (m = -inf) */
        float p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int d = lane + 32 * j;
            acc[j] = acc[j] * corr + (d < hd ? p * vr[d] : 0.0f);
        }
        m = m_new;
    }

    if (lane == 0) {
        sh_m[warp] = m;
        sh_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        if (d < hd)
            sh_acc[warp][d] = acc[j];
    }
    __syncthreads();

    float mx = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++)
        mx = fmaxf(mx, sh_m[w]);
    float wt[ATT_WARPS], denom = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = sh_m[w] == -INFINITY ? 0.0f : expf(sh_m[w] - mx); /* warps that saw no key weigh 0 */
        denom += wt[w] * sh_l[w];
    }
    float       *o = out + (t * nq + h) * (int64_t)hd;
    const float *gr = gate ? gate + (t * nq + h) * (int64_t)hd : NULL;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            num += wt[w] * sh_acc[w][d];
        float y = num / denom;
        if (gr)
            y *= 1.0f / (1.0f + expf(-gr[d]));
        o[d] = y;
    }
}

// ----------------------------------------------------------------------------
// launchers

#ifndef TANDEM_HAVE_SM90A /* a build without architecture 90 (kernels/CMakeLists.txt) has no wgmma form */
bool      kn_attention_wg_available(kn_ctx *, int) { return false; }
cm_status kn_attention_wg(kn_ctx *, float *, const float *, const float *, const float *, const float *,
                          const int32_t *, int, int64_t, int, int, int, float, int) {
    return CM_ERR_UNSUPPORTED;
}
#endif

cm_status kn_cuda_attention(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq,
                            int nkv, int hd, float scale) {
    KN_CUDA_CHECK_ARG(ctx, "attention: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nq > 0 && nkv > 0 && hd > 0, "attention: bad shape T=%lld nq=%d nkv=%d hd=%d",
                      (long long)T, nq, nkv, hd);
    KN_CUDA_CHECK_ARG(nq % nkv == 0, "attention: nq=%d must be a multiple of nkv=%d", nq, nkv);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "attention: n_seq=%d must be >= 0", n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "attention: T=%lld tokens but n_seq=0 sequences", (long long)T);
    if (hd > ATT_MAX_HD)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention: head dim %d is not supported by the cuda backend (max %d)", hd,
                       ATT_MAX_HD);
    if (nq > 65535)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention: nq=%d heads is not supported by the cuda backend (max 65535)", nq);
    KN_CUDA_CHECK_ARG(T <= INT32_MAX, "attention: T=%lld exceeds the grid limit %d", (long long)T, INT32_MAX);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && k && v && cu_seqlens, "attention: out, q, k, v or cu_seqlens is NULL");
    int optin = 0; /* shared memory per block: the flash blocks (≤ 81 KB) fit every sm_80+ part */
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        optin = 0;
    }
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16) {
        /* On compute capability 9.0 the wgmma kernel (kn_attention_sm90a.cu), else the
         * FlashAttention-2 kernel: head dims 64, 128, 256 (no padding), 16-byte aligned
         * arrays (float4 reads of q, float2 of gate and out), a work list within the grid's y
         * limit, and its 99 KB of shared memory at head dim 256 (every sm_80+ part, sm_86/89/
         * 120 included), else the WMMA kernel. TANDEM_ATTN_KERNEL=wmma (the WMMA kernel),
         * fa2-2 (two heads per CTA, the group even) or fa2 (FlashAttention-2 where the wgmma
         * kernel would run) is a benchmark switch read at ctx_create (ctx->attn_force). */
        const int64_t   n_max = (T + KN_ATT_FA2_LEVEL - 1) / KN_ATT_FA2_LEVEL + n_seq;
        const uintptr_t bits =
            (uintptr_t)out | (uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)(gate ? gate : q);
        const int aligned = bits % 16 == 0;
        /* the wgmma form first (compute capability 9.0, head dims 128 and 256, the group even) */
        if (ctx->attn_force == 0 && aligned && n_max <= 65535 && (hd == 128 || hd == 256) && (nq / nkv) % 2 == 0 &&
            kn_attention_wg_available(ctx, hd))
            return kn_attention_wg(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale, (int)n_max);
        int form = kn_attention_fa2_smem(hd, 1, 2) <= (size_t)optin; /* 1: one head per CTA, 2 stages */
        if (ctx->attn_force == 1)
            form = 0;
        else if (ctx->attn_force == 2 && (nq / nkv) % 2 == 0 &&
                 kn_attention_fa2_smem(hd, 2, 2) <= (size_t)optin)
            form = 2;
        if (form && aligned && n_max <= 65535 && (hd == 64 || hd == 128 || hd == 256)) {
            return kn_attention_fa2(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale, form,
                                    (int)n_max);
        }
    }
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16 && kn_attention_wmma_smem(hd) <= (size_t)optin)
        return kn_attention_wmma(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale);

    dim3 grid((unsigned int)T, (unsigned int)nq);
    dim3 block(32 * ATT_WARPS);
    switch ((hd + 31) / 32) {
#define ATT_CASE(nj)                                                                                         \
    case nj:                                                                                                 \
        attention_kernel<nj>                                                                                 \
            <<<grid, block, 0, ctx->stream>>>(out, q, k, v, gate, cu_seqlens, n_seq, nq, nkv, hd, scale);    \
        break;
        ATT_CASE(1)
        ATT_CASE(2)
        ATT_CASE(3)
        ATT_CASE(4)
        ATT_CASE(5)
        ATT_CASE(6)
        ATT_CASE(7)
        ATT_CASE(8)
#undef ATT_CASE
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
