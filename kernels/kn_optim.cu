/* kernels/kn_optim.cu — the optimizer pieces of the drafter step:
 * - sumsq: Σx² in double, deterministic: the input is cut into fixed chunks of
 *   SUMSQ_CHUNK elements (one block each; per-thread strided double sums, then a fixed
 *   shuffle/shared tree), and one block adds the chunk partials in a fixed order. The
 *   partition depends on n only, never on the device, so the bits are the same on every
 *   GPU and every run. The result is downloaded (the call blocks).
 * - adamw: one fused elementwise pass per tensor (PyTorch AdamW, decoupled weight decay, the
 *   clip factor applied to the gradient first): fp32 masters, m and v read once and written
 *   once, the update evaluated in double like the reference; the bias corrections
 *   1 − β^step are computed once on the host in double.
 * - sumsq_multi / adamw_multi: the optimizer step over a table of tensors (kn_mt_tensor, in
 *   device memory, uploaded once by the caller) in two launches and no host round trip, where
 *   the per-tensor pair took a blocking sumsq and an adamw launch per tensor (116 launches, 58
 *   host syncs for the 27B drafter). Both grids have one block per KN_MT_CHUNK-element chunk
 *   of one tensor (found by binary search over the table's chunk0). sumsq_multi writes one
 *   double partial per chunk (per-thread strided sums, fixed tree) and one block adds the
 *   partials in a fixed order into *out: the bits depend on the table only. adamw_multi reads
 *   that sum, derives the clip factor exactly as dt_optim does on the host (double, rounded to
 *   F32), and skips every write when the norm is not finite, so a bad step leaves the
 *   parameters and moments as they were; the update is adamw's, four elements per float4 load
 *   and store where the chunk's four arrays are 16-byte aligned (the same arithmetic per element).
 *   Both are streams of 34 bytes per parameter (1.73 B parameters in the 27B drafter): each
 *   thread issues several 16-byte loads before it does any arithmetic (sumsq_multi four groups,
 *   adamw_multi two groups of its four arrays), so that enough bytes are in flight per SM to
 *   run at DRAM bandwidth; gradients are read with the evict-first hint (read once, or twice
 *   with a whole pass between), and the updated arrays stored with it. A tensor with a w16
 *   copy also gets its new values rounded to bf16 there (2 bytes a parameter more), read by
 *   the next step's GEMMs (plain stores: it is read soon). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <math.h>

#define SUMSQ_CHUNK   8192
#define SUMSQ_THREADS 256

// ----------------------------------------------------------------------------
// kernels

/* Block-wide double sum with a fixed tree (blockDim.x == SUMSQ_THREADS); thread 0 gets it. */
static __device__ double block_sum_fixed(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0)
        sh[threadIdx.x / 32] = v;
    __syncthreads();
    double t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < SUMSQ_THREADS / 32; w++)
            t += sh[w];
    return t;
}

static __global__ void sumsq_partial_kernel(double *partial, const float *x, int64_t n) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    const int64_t     i0 = (int64_t)blockIdx.x * SUMSQ_CHUNK;
    const int64_t     i1 = i0 + SUMSQ_CHUNK < n ? i0 + SUMSQ_CHUNK : n;
    double            s = 0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += SUMSQ_THREADS)
        s += (double)x[i] * (double)x[i];
    s = block_sum_fixed(s, sh);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s;
}

static __global__ void sumsq_final_kernel(double *out, const double *partial, int64_t n_part) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    double            s = 0;
    for (int64_t i = threadIdx.x; i < n_part; i += SUMSQ_THREADS)
        s += partial[i];
    s = block_sum_fixed(s, sh);
    if (threadIdx.x == 0)
        *out = s;
}

/* One AdamW update of values p, m, v given the gradient gr, in double, decoupled weight decay first. */
static __device__ __forceinline__ void adamw_val(float &p, float &m, float &v, float gr, double lr, double b1,
                                                 double b2, double eps, double wd, double gs, double bc1,
                                                 double bc2) {
    const double g = (double)gr * gs;
    double       pv = p;
    pv -= lr * wd * pv;
    const double mi = b1 * (double)m + (1.0 - b1) * g;
    const double vi = b2 * (double)v + (1.0 - b2) * g * g;
    pv -= lr * (mi / bc1) / (sqrt(vi / bc2) + eps);
    p = (float)pv;
    m = (float)mi;
    v = (float)vi;
}

/* One AdamW element update (adamw and adamw_multi's unaligned and tail elements); w16, when not
 * NULL, takes the new value rounded to bf16. */
static __device__ __forceinline__ void adamw_elem(float *param, const float *grad, float *m, float *v,
                                                  uint16_t *w16, int64_t i, double lr, double b1, double b2,
                                                  double eps, double wd, double gs, double bc1, double bc2) {
    float p = param[i], mm = m[i], vv = v[i];
    adamw_val(p, mm, vv, grad[i], lr, b1, b2, eps, wd, gs, bc1, bc2);
    param[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (w16)
        w16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(p));
}

static __global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, int64_t n, double lr,
                                    double b1, double b2, double eps, double wd, double gs, double bc1,
                                    double bc2) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        adamw_elem(param, grad, m, v, NULL, i, lr, b1, b2, eps, wd, gs, bc1, bc2);
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_sumsq(kn_ctx *ctx, double *out, const float *x, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx && out, "sumsq: ctx or out is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "sumsq: n=%lld must be >= 0", (long long)n);
    *out = 0;
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(x, "sumsq: x is NULL");
    const int64_t n_part = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    KN_CUDA_CHECK_ARG(n_part < ((int64_t)1 << 31), "sumsq: n=%lld is too large", (long long)n);
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(n_part + 1) * sizeof(double)));
    double *partial = (double *)ctx->scratch, *total = partial + n_part;
    sumsq_partial_kernel<<<(unsigned int)n_part, SUMSQ_THREADS, 0, ctx->stream>>>(partial, x, n);
    KN_CUDA_LAUNCHED(ctx);
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, ctx->stream>>>(total, partial, n_part);
    KN_CUDA_LAUNCHED(ctx);
    return kn_cuda_download(ctx, out, total, sizeof(double));
}

cm_status kn_cuda_adamw(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                        const kn_adamw_params *p) {
    KN_CUDA_CHECK_ARG(ctx && p, "adamw: ctx or params is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "adamw: n=%lld must be >= 0", (long long)n);
    KN_CUDA_CHECK_ARG(p->step >= 1, "adamw: step=%lld must be >= 1 (it is 1-based)", (long long)p->step);
    KN_CUDA_CHECK_ARG(p->lr >= 0 && isfinite(p->lr), "adamw: lr=%g must be finite and >= 0", (double)p->lr);
    KN_CUDA_CHECK_ARG(p->beta1 >= 0 && p->beta1 < 1 && p->beta2 >= 0 && p->beta2 < 1,
                      "adamw: betas (%g, %g) must be in [0, 1)", (double)p->beta1, (double)p->beta2);
    KN_CUDA_CHECK_ARG(p->eps >= 0 && isfinite(p->eps), "adamw: eps=%g must be finite and >= 0",
                      (double)p->eps);
    KN_CUDA_CHECK_ARG(p->weight_decay >= 0 && isfinite(p->weight_decay),
                      "adamw: weight_decay=%g must be finite and >= 0", (double)p->weight_decay);
    KN_CUDA_CHECK_ARG(isfinite(p->grad_scale), "adamw: grad_scale=%g must be finite", (double)p->grad_scale);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(param && grad && m && v, "adamw: param, grad, m or v is NULL");
    const double bc1 = 1.0 - pow((double)p->beta1, (double)p->step);
    const double bc2 = 1.0 - pow((double)p->beta2, (double)p->step);
    int64_t      blocks = (n + 255) / 256;
    adamw_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        param, grad, m, v, n, p->lr, p->beta1, p->beta2, p->eps, p->weight_decay, p->grad_scale, bc1, bc2);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// multi-tensor step

#define MT_THREADS 256
#define MT_UNROLL  4 /* float4 groups per thread whose loads sumsq_multi issues together */

/* The table entry whose chunks hold chunk b (the last one with chunk0 ≤ b; empty tensors
 * share chunk0 with the next and are never chosen). */
static __device__ int mt_find(const kn_mt_tensor *tab, int n_t, int64_t b) {
    int lo = 0, hi = n_t - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tab[mid].chunk0 <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static __global__ void sumsq_multi_partial_kernel(double *partial, const kn_mt_tensor *tab, int n_t) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    const int64_t     b = blockIdx.x;
    const int         t = mt_find(tab, n_t, b);
    const float      *x = tab[t].grad;
    const int64_t     i0 = (b - tab[t].chunk0) * KN_MT_CHUNK;
    const int64_t     i1 = i0 + KN_MT_CHUNK < tab[t].n ? i0 + KN_MT_CHUNK : tab[t].n;
    int64_t           i = i0;
    double            s = 0;
    if ((uintptr_t)(x + i0) % 16 == 0) { /* float4 groups, MT_UNROLL loads in flight before the sums */
        const float4 *x4 = (const float4 *)(x + i0);
        const int64_t n4 = (i1 - i0) / 4;
        for (int64_t q = threadIdx.x; q < n4; q += MT_UNROLL * SUMSQ_THREADS) {
            float4 g[MT_UNROLL];
#pragma unroll
            for (int u = 0; u < MT_UNROLL; u++)
                g[u] =
                    q + u * SUMSQ_THREADS < n4 ? __ldcs(x4 + q + u * SUMSQ_THREADS) : make_float4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < MT_UNROLL; u++) {
                s += (double)g[u].x * (double)g[u].x;
                s += (double)g[u].y * (double)g[u].y;
                s += (double)g[u].z * (double)g[u].z;
                s += (double)g[u].w * (double)g[u].w;
            }
        }
        i = i0 + n4 * 4;
    }
    for (i += threadIdx.x; i < i1; i += SUMSQ_THREADS)
        s += (double)x[i] * (double)x[i];
    s = block_sum_fixed(s, sh);
    if (threadIdx.x == 0)
        partial[b] = s;
}

static __global__ void __launch_bounds__(MT_THREADS)
    adamw_multi_kernel(const kn_mt_tensor *tab, int n_t, const double *sumsq, double clip, double lr,
                       double b1, double b2, double eps, double wd, double bc1, double bc2) {
    const double norm = sqrt(*sumsq);
    if (!isfinite(norm))
        return;
    double scale = 1.0; /* dt_optim_clip_scale */
    if (clip > 0) {
        scale = clip / (norm + 1e-6);
        scale = scale < 1.0 ? scale : 1.0;
    }
    const double  gs = (double)(float)scale; /* as kn_adamw_params.grad_scale carries it */
    const int64_t b = blockIdx.x;
    const int     t = mt_find(tab, n_t, b);
    float        *param = tab[t].param, *m = tab[t].m, *v = tab[t].v;
    const float  *grad = tab[t].grad;
    uint16_t     *w16 = tab[t].w16;
    const int64_t i0 = (b - tab[t].chunk0) * KN_MT_CHUNK;
    const int64_t i1 = i0 + KN_MT_CHUNK < tab[t].n ? i0 + KN_MT_CHUNK : tab[t].n;
    int64_t       i = i0;
    const uintptr_t align = (uintptr_t)(param + i0) | (uintptr_t)(grad + i0) | (uintptr_t)(m + i0) |
                            (uintptr_t)(v + i0) | (w16 && (uintptr_t)(w16 + i0) % 8 != 0);
    /* four elements per load and store (four copies per 8-byte store), two groups' loads in flight
     * before the arithmetic: the same update on each element */
    if (align % 16 == 0) {
        const int64_t n4 = (i1 - i0) / 4;
        float4 *p4 = (float4 *)(param + i0), *m4 = (float4 *)(m + i0), *v4 = (float4 *)(v + i0);
        const float4 *g4 = (const float4 *)(grad + i0);
        for (int64_t q = threadIdx.x; q < n4; q += 2 * MT_THREADS) {
            const bool    two = q + MT_THREADS < n4;
            const int64_t q2 = two ? q + MT_THREADS : q;
            float4        P[2] = {p4[q], p4[q2]}, M[2] = {m4[q], m4[q2]}, V[2] = {v4[q], v4[q2]};
            const float4  G[2] = {__ldcs(g4 + q), __ldcs(g4 + q2)};
#pragma unroll
            for (int u = 0; u < 2; u++) {
                adamw_val(P[u].x, M[u].x, V[u].x, G[u].x, lr, b1, b2, eps, wd, gs, bc1, bc2);
                adamw_val(P[u].y, M[u].y, V[u].y, G[u].y, lr, b1, b2, eps, wd, gs, bc1, bc2);
                adamw_val(P[u].z, M[u].z, V[u].z, G[u].z, lr, b1, b2, eps, wd, gs, bc1, bc2);
                adamw_val(P[u].w, M[u].w, V[u].w, G[u].w, lr, b1, b2, eps, wd, gs, bc1, bc2);
            }
            __stcs(p4 + q, P[0]);
            __stcs(m4 + q, M[0]);
            __stcs(v4 + q, V[0]);
            if (w16)
                reinterpret_cast<uint2 *>(w16 + i0)[q] = f4_to_bf16x4(P[0]);
            if (two) {
                __stcs(p4 + q2, P[1]);
                __stcs(m4 + q2, M[1]);
                __stcs(v4 + q2, V[1]);
                if (w16)
                    reinterpret_cast<uint2 *>(w16 + i0)[q2] = f4_to_bf16x4(P[1]);
            }
        }
        i = i0 + n4 * 4;
    }
    for (i += threadIdx.x; i < i1; i += MT_THREADS)
        adamw_elem(param, grad, m, v, w16, i, lr, b1, b2, eps, wd, gs, bc1, bc2);
}

cm_status kn_cuda_sumsq_multi(kn_ctx *ctx, double *out, const kn_mt_tensor *table, int n_tensors,
                              int64_t n_chunks) {
    KN_CUDA_CHECK_ARG(ctx && out, "sumsq_multi: ctx or out is NULL");
    KN_CUDA_CHECK_ARG(n_tensors >= 0 && n_chunks >= 0 && (table || n_tensors == 0),
                      "sumsq_multi: bad table (n_tensors=%d, n_chunks=%lld)", n_tensors, (long long)n_chunks);
    KN_CUDA_CHECK_ARG(n_chunks < ((int64_t)1 << 31), "sumsq_multi: %lld chunks are too many",
                      (long long)n_chunks);
    if (n_chunks == 0) {
        KN_CUDA(cudaMemsetAsync(out, 0, sizeof(double), ctx->stream));
        return CM_OK;
    }
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)n_chunks * sizeof(double)));
    double *partial = (double *)ctx->scratch;
    sumsq_multi_partial_kernel<<<(unsigned int)n_chunks, SUMSQ_THREADS, 0, ctx->stream>>>(partial, table,
                                                                                          n_tensors);
    KN_CUDA_LAUNCHED(ctx);
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, ctx->stream>>>(out, partial, n_chunks);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_adamw_multi(kn_ctx *ctx, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks,
                              const kn_adamw_params *p, const double *sumsq, double clip) {
    KN_CUDA_CHECK_ARG(ctx && p && sumsq, "adamw_multi: ctx, params or sumsq is NULL");
    KN_CUDA_CHECK_ARG(n_tensors >= 0 && n_chunks >= 0 && (table || n_tensors == 0),
                      "adamw_multi: bad table (n_tensors=%d, n_chunks=%lld)", n_tensors, (long long)n_chunks);
    KN_CUDA_CHECK_ARG(n_chunks < ((int64_t)1 << 31), "adamw_multi: %lld chunks are too many",
                      (long long)n_chunks);
    KN_CUDA_CHECK_ARG(p->step >= 1, "adamw_multi: step=%lld must be >= 1 (it is 1-based)",
                      (long long)p->step);
    KN_CUDA_CHECK_ARG(p->lr >= 0 && isfinite(p->lr), "adamw_multi: lr=%g must be finite and >= 0",
                      (double)p->lr);
    KN_CUDA_CHECK_ARG(p->beta1 >= 0 && p->beta1 < 1 && p->beta2 >= 0 && p->beta2 < 1,
                      "adamw_multi: betas (%g, %g) must be in [0, 1)", (double)p->beta1, (double)p->beta2);
    KN_CUDA_CHECK_ARG(p->eps >= 0 && isfinite(p->eps), "adamw_multi: eps=%g must be finite and >= 0",
                      (double)p->eps);
    KN_CUDA_CHECK_ARG(p->weight_decay >= 0 && isfinite(p->weight_decay),
                      "adamw_multi: weight_decay=%g must be finite and >= 0", (double)p->weight_decay);
    KN_CUDA_CHECK_ARG(isfinite(clip), "adamw_multi: clip=%g must be finite", clip);
    if (n_chunks == 0)
        return CM_OK;
    const double bc1 = 1.0 - pow((double)p->beta1, (double)p->step);
    const double bc2 = 1.0 - pow((double)p->beta2, (double)p->step);
    adamw_multi_kernel<<<(unsigned int)n_chunks, MT_THREADS, 0, ctx->stream>>>(
        table, n_tensors, sumsq, clip, p->lr, p->beta1, p->beta2, p->eps, p->weight_decay, bc1, bc2);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
