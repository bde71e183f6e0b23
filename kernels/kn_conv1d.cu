/* kernels/kn_conv1d.cu — causal depthwise conv over time within each packed sequence, then
 * SiLU (the GDN short conv): out[t, c] = silu(Σ_{j<K} w[c, j] · x[t − (K−1) + j, c]) with
 * taps before the sequence start reading 0. One thread per (token, channel): grid y walks
 * tokens, x walks channel tiles, so each warp reads K coalesced row segments of x (the K
 * rows are shared through L1/L2 by neighbouring token blocks) and writes one. The token's
 * sequence start comes from a binary search of cu_seqlens (uniform per block, cached).
 * fp32 accumulation (K is small: 4 for Qwen). out must not overlap x. Writes out (=).
 * cu_seqlens live on the device and are not validated here (the caller checks them before
 * upload); out-of-range entries are clamped so a bad table cannot cause a wild read. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

// ----------------------------------------------------------------------------
// kernels

/* Start of the sequence holding token t: cu[s] for the last s with cu[s] <= t, clamped. */
static __device__ __forceinline__ int64_t seq_start(const int32_t *cu, int n_seq, int64_t t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    int64_t bos = cu[lo];
    return bos < 0 ? 0 : (bos > t ? t : bos);
}

static __global__ void conv1d_silu_kernel(float *out, const float *x, const float *w, const int32_t *cu,
                                          int n_seq, int64_t T, int64_t C, int K) {
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        int64_t bos = seq_start(cu, n_seq, t);
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (int64_t)gridDim.x * blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int64_t src = t - (K - 1) + j;
                if (src >= bos)
                    acc += w[c * K + j] * x[src * C + c];
            }
            out[t * C + c] = acc / (1.0f + expf(-acc));
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_conv1d_silu(kn_ctx *ctx, float *out, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int64_t C, int K) {
    KN_CUDA_CHECK_ARG(ctx, "conv1d_silu: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && C > 0 && K > 0,
                      "conv1d_silu: bad shape T=%lld C=%lld K=%d (T >= 0, C > 0, K > 0)", (long long)T,
                      (long long)C, K);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "conv1d_silu: n_seq=%d must be >= 0", n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "conv1d_silu: T=%lld tokens but n_seq=0 sequences", (long long)T);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && w && cu_seqlens, "conv1d_silu: out, x, w or cu_seqlens is NULL");
    const uintptr_t o0 = (uintptr_t)out, x0 = (uintptr_t)x, bytes = (uintptr_t)(T * C) * sizeof(float);
    KN_CUDA_CHECK_ARG(o0 + bytes <= x0 || x0 + bytes <= o0,
                      "conv1d_silu: out overlaps x (use a separate buffer)");

    const int block = C < 128 ? 64 : 128;
    int64_t   gx = (C + block - 1) / block;
    dim3      grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(T < 65535 ? T : 65535));
    conv1d_silu_kernel<<<grid, block, 0, ctx->stream>>>(out, x, w, cu_seqlens, n_seq, T, C, K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
