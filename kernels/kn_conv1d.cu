/* kernels/kn_conv1d.cu — causal depthwise conv over time within each packed sequence, then
 * SiLU (the GDN short conv): out[t, c] = silu(Σ_{j<K} w[c, j] · x[t − (K−1) + j, c]) with
 * taps before the sequence start reading 0. One thread per (token, channel): grid y walks
 * tokens, x walks channel tiles, so each warp reads K coalesced row segments of x (the K
 * rows are shared through L1/L2 by neighbouring token blocks) and writes one. The token's
 * sequence start comes from a binary search of cu_seqlens (uniform per block, cached).
 * fp32 accumulation (K is small: 4 for Qwen). out must not overlap x. Writes out (=).
 * cu_seqlens live on the device and are not validated here (the caller checks them before
 * upload); out-of-range entries are clamped so a bad table cannot cause a wild read.
 * gdn_conv_qkv (the target's fast path) fuses this conv with the q/k/v split and the q/k head
 * l2norms: heads of at most 128 channels (a multiple of 4) take a warp per run of tokens and
 * head (gdn_conv_warp_kernel), other shapes a block that walks runs of tokens per channel. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

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
            out[t * C + c] = kn_silu(acc);
        }
    }
}

/* Group g of the GDN conv's blocks: q heads 0 .. nk − 1, k heads nk .. 2nk − 1 (dk channels,
 * l2-normalised), then v heads (dv): its width, whether it is normed, its first channel in x
 * [T, 2·nk·dk + nv·dv], and where its rows go (dst, row stride dst_ld). */
template <typename OT> struct gdn_group {
    int     width, norm;
    float   mul; /* q_scale for a q head, else 1 */
    int64_t c0, dst_ld;
    OT     *dst;
};

template <typename OT>
static __device__ __forceinline__ gdn_group<OT> gdn_group_of(int g, OT *q, OT *k, OT *v, int nk, int nv,
                                                             int dk, int dv, float q_scale) {
    const int64_t qk = (int64_t)nk * dk;
    gdn_group<OT> r;
    r.mul = 1.0f;
    if (g < 2 * nk) {
        const int h = g < nk ? g : g - nk;
        r.width = dk, r.norm = 1;
        if (g < nk)
            r.mul = q_scale;
        r.c0 = (g < nk ? 0 : qk) + (int64_t)h * dk;
        r.dst = (g < nk ? q : k) + (int64_t)h * dk;
        r.dst_ld = qk;
    } else {
        const int h = g - 2 * nk;
        r.width = dv, r.norm = 0;
        r.c0 = 2 * qk + (int64_t)h * dv;
        r.dst = v + (int64_t)h * dv;
        r.dst_ld = (int64_t)nv * dv;
    }
    return r;
}

/* gdn_conv_qkv's stores: F32 as computed, or BF16 of the value times mul (q_scale on q heads;
 * the product rounded, then rounded to bf16, as gated_delta_rule's q·scale copy rounds it). */
static __device__ __forceinline__ void conv_st1(float *p, float v, float) {
    *p = v;
}
static __device__ __forceinline__ void conv_st1(__nv_bfloat16 *p, float v, float mul) {
    *p = __float2bfloat16(v * mul);
}
static __device__ __forceinline__ void conv_st4(float *p, float4 v, float) {
    *(float4 *)p = v;
}
static __device__ __forceinline__ void conv_st4(__nv_bfloat16 *p, float4 v, float mul) {
    __align__(8) __nv_bfloat16 b[4] = {__float2bfloat16(v.x * mul), __float2bfloat16(v.y * mul),
                                       __float2bfloat16(v.z * mul), __float2bfloat16(v.w * mul)};
    *(uint2 *)p = *(const uint2 *)b;
}

#define GDN_CONV_THREADS 128
#define GDN_CONV_MAX_RUN 64
#define GDN_CONV_SMEM    (48 * 1024)

/* The GDN short-conv block: conv1d_silu + q/k/v split + q/k l2norm. Block (run of tokens,
 * group): a group is one q head, one k head (dk channels, l2-normalised) or one v head (dv).
 * Phase 0 stages the run's x rows and the K − 1 rows before it in shared memory (coalesced,
 * float4 when aligned: many independent loads per thread, where one thread per output with
 * K dependent taps and a binary search was latency-bound); phase 1 walks the run token by
 * token per channel with the taps and the window in registers, stepping over sequence starts
 * from one binary search per block, and writes y over the staged row it no longer needs;
 * phase 2 gives a warp to each token: the head's sum of squares by shuffles, then the
 * coalesced store into q, k or v. The f32 math per output is that of conv1d_silu_kernel
 * then l2norm_kernel (the sums in another order). */
template <int K, typename OT>
static __global__ void gdn_conv_qkv_kernel(OT *q, OT *k, OT *v, const float *x, const float *w,
                                           const int32_t *cu, int n_seq, int64_t T, int nk, int nv, int dk,
                                           int dv, int run, int vec, float eps, float q_scale) {
    extern __shared__ float xs[]; /* [run + K − 1][width] */
    const int               g = blockIdx.y;
    const int64_t           t0 = (int64_t)blockIdx.x * run;
    const int               nr = (int)(T - t0 < run ? T - t0 : run);
    const int64_t           C = 2 * (int64_t)nk * dk + (int64_t)nv * dv;
    const gdn_group<OT>     gr = gdn_group_of(g, q, k, v, nk, nv, dk, dv, q_scale);
    const int               width = gr.width, norm = gr.norm;
    const int64_t           c0 = gr.c0, dst_ld = gr.dst_ld;
    OT *const               dst = gr.dst;

    // phase 0: rows t0 − (K − 1) .. t0 + nr − 1 of the group's columns (before token 0: zeros)
    const int rows = nr + K - 1;
    if (vec) {
        const int w4 = width / 4;
#pragma unroll 4
        for (int i = threadIdx.x; i < rows * w4; i += blockDim.x) {
            const int     r = i / w4, c4 = i - r * w4;
            const int64_t t = t0 - (K - 1) + r;
            float4        val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t >= 0)
                val = *(const float4 *)(x + t * C + c0 + 4 * c4);
            *(float4 *)(xs + r * width + 4 * c4) = val;
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < rows * width; i += blockDim.x) {
            const int     r = i / width, ch = i - r * width;
            const int64_t t = t0 - (K - 1) + r;
            xs[i] = t >= 0 ? x[t * C + c0 + ch] : 0.0f;
        }
    }
    __syncthreads();

    // phase 1: the conv per channel over the run; y replaces row r (token t0 + r − (K − 1))
    const int s0 = seq_of(cu, n_seq, t0);
    for (int ch = threadIdx.x; ch < width; ch += blockDim.x) {
        float wr[K], win[K]; /* win[j] = x[t − (K − 1) + j] */
#pragma unroll
        for (int j = 0; j < K; j++)
            wr[j] = w[(c0 + ch) * K + j];
        int     s = s0;
        int64_t bos = cu[s], eos = cu[s + 1];
#pragma unroll
        for (int j = 0; j < K - 1; j++)
            win[j] = t0 - (K - 1) + j >= bos ? xs[j * width + ch] : 0.0f;
        for (int r = 0; r < nr; r++) {
            const int64_t t = t0 + r;
            while (t >= eos && s + 1 < n_seq) { /* a sequence starts at t: earlier taps read 0 */
                s++;
                bos = eos;
                eos = cu[s + 1];
#pragma unroll
                for (int j = 0; j < K - 1; j++)
                    win[j] = 0.0f;
            }
            win[K - 1] = xs[(r + K - 1) * width + ch];
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < K; j++)
                acc += wr[j] * win[j];
            xs[r * width + ch] = kn_silu(acc);
#pragma unroll
            for (int j = 0; j < K - 1; j++)
                win[j] = win[j + 1];
        }
    }
    __syncthreads();

    // phase 2: a warp per token: the head's l2norm (q, k), the store
    const int lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int r = threadIdx.x / 32; r < nr; r += n_warps) {
        const float *y = xs + r * width;
        float        scale = 1.0f;
        if (norm) {
            float ss = 0.0f;
            for (int c = lane; c < width; c += 32)
                ss += y[c] * y[c];
            ss = warp_sum(ss);
            scale = 1.0f / sqrtf(ss + eps);
        }
        OT *out = dst + (t0 + r) * dst_ld;
        for (int c = lane; c < width; c += 32)
            conv_st1(out + c, norm ? y[c] * scale : y[c], gr.mul);
    }
}

#define GDN_WARP_RUN 8 /* tokens per warp in gdn_conv_warp_kernel */

/* gdn_conv_qkv for heads of at most 128 channels, a multiple of 4, with 16-byte aligned
 * rows (the Qwen shapes): a warp per (run of GDN_WARP_RUN tokens, group), lane l holding
 * channels 4l .. 4l + 3. The warp issues the loads of all its K − 1 + run rows at once (one
 * float4 per lane and row), slides the taps over them in registers, and takes a q/k head's sum
 * of squares by shuffles, so no block-wide phases wait on each other (the block kernel above
 * reached half the memory bandwidth). A block is 8 warps: 8 consecutive runs of one group,
 * whose overlapping rows meet in L1. Token indices are 32-bit (cu_seqlens are) and three
 * blocks share a multiprocessor (at most 85 registers a thread; at 88 only two did: 208 µs
 * against 167 at the 27B shape, ncu). The f32 math is the block kernel's, with the sum of
 * squares in another order. */
template <int K, typename OT>
static __global__ void __launch_bounds__(256, 3)
    gdn_conv_warp_kernel(OT *q, OT *k, OT *v, const float *x, const float *w, const int32_t *cu, int n_seq,
                         int64_t T, int nk, int nv, int dk, int dv, float eps, float q_scale) {
    const int     g = blockIdx.y, lane = threadIdx.x & 31;
    const int     t0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * GDN_WARP_RUN, Ti = (int)T;
    if (t0 >= Ti)
        return;
    const int64_t   C = 2 * (int64_t)nk * dk + (int64_t)nv * dv;
    const gdn_group<OT> gr = gdn_group_of(g, q, k, v, nk, nv, dk, dv, q_scale);
    const int           width = gr.width, norm = gr.norm;
    const int64_t       c0 = gr.c0, dst_ld = gr.dst_ld;
    OT *const           dst = gr.dst;
    const int on = 4 * lane < width; /* lanes past a narrow head only join the shuffles */
    const int ch = on ? 4 * lane : 0;

    // every row the run reads, t0 − (K − 1) .. t0 + run − 1 (before token 0 or past T: zeros)
    float4 win[GDN_WARP_RUN + K - 1];
#pragma unroll
    for (int i = 0; i < GDN_WARP_RUN + K - 1; i++) {
        const int t = t0 - (K - 1) + i;
        win[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (on && t >= 0 && t < Ti)
            win[i] = *(const float4 *)(x + (int64_t)t * C + c0 + ch);
    }
    float wr[4][K];
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int j = 0; j < K; j++)
            wr[c][j] = on ? w[(c0 + ch + c) * K + j] : 0.0f;

    int     s = seq_of(cu, n_seq, t0);
    int     bos = cu[s], eos = cu[s + 1];
#pragma unroll
    for (int r = 0; r < GDN_WARP_RUN; r++) {
        const int t = t0 + r;
        if (t >= Ti) /* warp-uniform */
            break;
        while (t >= eos && s + 1 < n_seq) { /* a sequence starts at t */
            s++;
            bos = eos;
            eos = cu[s + 1];
        }
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < K; j++) {
            if (t - (K - 1) + j >= bos) { /* taps before the sequence start read 0 */
                const float4 xv = win[r + j];
                acc.x += wr[0][j] * xv.x, acc.y += wr[1][j] * xv.y;
                acc.z += wr[2][j] * xv.z, acc.w += wr[3][j] * xv.w;
            }
        }
        float4 y = make_float4(kn_silu(acc.x), kn_silu(acc.y), kn_silu(acc.z), kn_silu(acc.w));
        if (norm) {
            const float ss = warp_sum(on ? y.x * y.x + y.y * y.y + y.z * y.z + y.w * y.w : 0.0f);
            const float scale = 1.0f / sqrtf(ss + eps);
            y.x *= scale, y.y *= scale, y.z *= scale, y.w *= scale;
        }
        if (on)
            conv_st4(dst + (int64_t)t * dst_ld + ch, y, gr.mul);
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

static int overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes) {
    const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

/* gdn_conv_qkv with OT outputs (float: the op; bf16: gdn_conv_qkv_bf16, q scaled by q_scale). */
template <typename OT>
static cm_status gdn_conv_run(kn_ctx *ctx, OT *q, OT *k, OT *v, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                              int K, float eps, float q_scale) {
    KN_CUDA_CHECK_ARG(ctx, "gdn_conv_qkv: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0 && K > 0,
                      "gdn_conv_qkv: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d K=%d (T >= 0, the others > 0)",
                      (long long)T, nk, nv, dk, dv, K);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "gdn_conv_qkv: eps=%g must be >= 0", (double)eps);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "gdn_conv_qkv: n_seq=%d must be >= 0", n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "gdn_conv_qkv: T=%lld tokens but n_seq=0 sequences", (long long)T);
    if (K > 8)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gdn_conv_qkv: K=%d taps (at most 8; use conv1d_silu)", K);
    KN_CUDA_CHECK_ARG(T < INT32_MAX, "gdn_conv_qkv: T=%lld tokens is too many (cu_seqlens are int32)",
                      (long long)T);
    const int64_t groups = 2 * (int64_t)nk + nv, width = dk > dv ? dk : dv;
    const int64_t run_fit = GDN_CONV_SMEM / (int64_t)(width * sizeof(float)) - (K - 1);
    if (run_fit < 1 || groups > 65535)
        return CM_FAIL(
            CM_ERR_UNSUPPORTED,
            "gdn_conv_qkv: head size %lld or %lld heads is too large for one block (use conv1d_silu)",
            (long long)width, (long long)groups);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && k && v && x && w && cu_seqlens,
                      "gdn_conv_qkv: q, k, v, x, w or cu_seqlens is NULL");
    const int64_t qk = (int64_t)nk * dk, C = 2 * qk + (int64_t)nv * dv;
    const size_t  xb = (size_t)(T * C) * sizeof(float), qb = (size_t)(T * qk) * sizeof(OT),
                 vb = (size_t)(T * nv * dv) * sizeof(OT);
    KN_CUDA_CHECK_ARG(!overlaps(q, qb, x, xb) && !overlaps(k, qb, x, xb) && !overlaps(v, vb, x, xb),
                      "gdn_conv_qkv: q, k or v overlaps x (use separate buffers)");

    const int vec = C % 4 == 0 && dk % 4 == 0 && dv % 4 == 0 && (uintptr_t)x % 16 == 0;
    const uintptr_t oa = 4 * sizeof(OT); /* the warp form stores 4 channels at once */
    if (vec && width <= 128 && (uintptr_t)q % oa == 0 && (uintptr_t)k % oa == 0 && (uintptr_t)v % oa == 0) {
        const int64_t runs = (T + GDN_WARP_RUN - 1) / GDN_WARP_RUN;
        dim3          wgrid((unsigned int)((runs + 7) / 8), (unsigned int)groups);
#define GDN_WARP_CASE(KK)                                                                                    \
    case KK:                                                                                                 \
        gdn_conv_warp_kernel<KK, OT><<<wgrid, 256, 0, ctx->stream>>>(q, k, v, x, w, cu_seqlens, n_seq, T,    \
                                                                     nk, nv, dk, dv, eps, q_scale);          \
        break
        switch (K) {
            GDN_WARP_CASE(1);
            GDN_WARP_CASE(2);
            GDN_WARP_CASE(3);
            GDN_WARP_CASE(4);
            GDN_WARP_CASE(5);
            GDN_WARP_CASE(6);
            GDN_WARP_CASE(7);
            GDN_WARP_CASE(8);
        }
#undef GDN_WARP_CASE
        KN_CUDA_LAUNCHED(ctx);
        return CM_OK;
    }
    const int    run = (int)(run_fit < GDN_CONV_MAX_RUN ? run_fit : GDN_CONV_MAX_RUN);
    const size_t smem = (size_t)(run + K - 1) * (size_t)width * sizeof(float);
    dim3         grid((unsigned int)((T + run - 1) / run), (unsigned int)groups);
#define GDN_CONV_CASE(KK)                                                                                    \
    case KK:                                                                                                 \
        gdn_conv_qkv_kernel<KK, OT><<<grid, GDN_CONV_THREADS, smem, ctx->stream>>>(                          \
            q, k, v, x, w, cu_seqlens, n_seq, T, nk, nv, dk, dv, run, vec, eps, q_scale);                    \
        break
    switch (K) {
        GDN_CONV_CASE(1);
        GDN_CONV_CASE(2);
        GDN_CONV_CASE(3);
        GDN_CONV_CASE(4);
        GDN_CONV_CASE(5);
        GDN_CONV_CASE(6);
        GDN_CONV_CASE(7);
        GDN_CONV_CASE(8);
    }
#undef GDN_CONV_CASE
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_gdn_conv_qkv(kn_ctx *ctx, float *q, float *k, float *v, const float *x, const float *w,
                               const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk,
                               int dv, int K, float eps) {
    return gdn_conv_run(ctx, q, k, v, x, w, cu_seqlens, n_seq, T, nk, nv, dk, dv, K, eps, 1.0f);
}

cm_status kn_cuda_gdn_conv_qkv_bf16(kn_ctx *ctx, uint16_t *q, uint16_t *k, uint16_t *v, const float *x,
                                    const float *w, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk,
                                    int nv, int dk, int dv, int K, float eps, float q_scale) {
    return gdn_conv_run(ctx, (__nv_bfloat16 *)q, (__nv_bfloat16 *)k, (__nv_bfloat16 *)v, x, w, cu_seqlens,
                        n_seq, T, nk, nv, dk, dv, K, eps, q_scale);
}
