/* kernels/kn_dynconv.cu — DFlash2's grouped dynamic causal convolution (semantics and shapes in
 * kn_backend.h, kn_dynconv_params; the specification in ref/kn_dynconv_ref.c), forward and
 * backward, fp32. Every output element is a sum in a fixed order (no atomics), so results are the
 * same run to run:
 *   forward   one thread per (row, channel) on a (channel tile, row) grid, the taps of its own block;
 *             x in F32 or BF16, out written or accumulated, and its bf16 copy when asked (the next
 *             GEMM's operand, without a conversion pass);
 *   dx        the same grid, the rows after it in its block that tap it (and dx's bf16 copy);
 *   ddelta    one block per row: the products x[i − t, c]·dout[i, c] of all channels land in shared
 *             memory (coalesced loads), then one thread per group sums its G in channel order (a
 *             thread per (row, tap, group) reading G strided channels was the first version);
 *   dbase     two passes: one thread per (tap, channel) and chunk of DC_CHUNK rows sums its chunk in
 *             row order into a scratch row, then one thread per (tap, channel) sums the chunks in
 *             order (the first version ran one thread per (tap, channel) over every row: 10k threads,
 *             latency-bound on thousands of rows).
 * The module is elementwise next to the projection GEMM that makes delta. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ float dc_coef(const kn_dynconv_params &p, int64_t i, int t, int c) {
    const int ng = p.D / p.G;
    return p.base[((int64_t)p.side * p.Kc + t) * p.D + c] +
           p.delta[((i * 2 + p.side) * p.Kc + t) * ng + c / p.G];
}

static __device__ __forceinline__ float dc_x(const kn_dynconv_params &p, int64_t k) {
    if (p.x_dt == CM_DTYPE_BF16)
        return __bfloat162float(((const __nv_bfloat16 *)p.x)[k]);
    return ((const float *)p.x)[k];
}

static __device__ __forceinline__ uint16_t dc_bf16(float v) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *(uint16_t *)&b;
}

/* grid (channel tiles, rows): no divisions per element */
static __global__ void dynconv_fwd_kernel(kn_dynconv_params p) {
    const int64_t i = blockIdx.y;
    const int     c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.D)
        return;
    const int     slot = (int)(i % p.B), taps = slot + 1 < p.Kc ? slot + 1 : p.Kc;
    const int64_t e = i * p.D + c;
    float         acc = p.accumulate ? p.out[e] : 0.0f;
    for (int t = 0; t < taps; t++)
        acc = fmaf(dc_coef(p, i, t, c), dc_x(p, (i - t) * p.D + c), acc);
    p.out[e] = acc;
    if (p.out_bf16)
        p.out_bf16[e] = dc_bf16(acc);
}

static __global__ void dynconv_dx_kernel(kn_dynconv_params p) {
    const int64_t m = blockIdx.y;
    const int     c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.D)
        return;
    const int after = p.B - 1 - (int)(m % p.B), taps = after + 1 < p.Kc ? after + 1 : p.Kc;
    float     acc = 0.0f;
    for (int t = 0; t < taps; t++)
        acc = fmaf(dc_coef(p, m + t, t, c), p.dout[(m + t) * p.D + c], acc);
    p.dx[m * p.D + c] = acc;
    if (p.dx_bf16)
        p.dx_bf16[m * p.D + c] = dc_bf16(acc);
}

/* One block per row i; smem holds one tap's D products. */
static __global__ void dynconv_ddelta_kernel(kn_dynconv_params p) {
    extern __shared__ float dd_prod[];
    const int     ng = p.D / p.G;
    const int64_t i = blockIdx.x;
    const int     slot = (int)(i % p.B);
    for (int t = 0; t < p.Kc; t++) {
        float *out = p.ddelta + ((i * 2 + p.side) * p.Kc + t) * ng;
        if (t > slot) { /* the tap reaches before the block's start */
            for (int g = threadIdx.x; g < ng; g += blockDim.x)
                out[g] = 0.0f;
            continue;
        }
        for (int c = threadIdx.x; c < p.D; c += blockDim.x)
            dd_prod[c] = dc_x(p, (i - t) * p.D + c) * p.dout[i * p.D + c];
        __syncthreads();
        for (int g = threadIdx.x; g < ng; g += blockDim.x) {
            float acc = 0.0f;
            for (int c = g * p.G; c < (g + 1) * p.G; c++)
                acc += dd_prod[c];
            out[g] = acc;
        }
        __syncthreads();
    }
}

/* The first version's ddelta (one thread per (row, tap, group)), for hidden sizes whose products do
 * not fit shared memory. The sums are in the same channel order. */
static __global__ void dynconv_ddelta_wide_kernel(kn_dynconv_params p) {
    const int     ng = p.D / p.G;
    const int64_t n = p.rows * p.Kc * ng;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e / ((int64_t)p.Kc * ng);
        const int     t = (int)(e / ng % p.Kc), g = (int)(e % ng);
        float         acc = 0.0f;
        if (t <= (int)(i % p.B))
            for (int c = g * p.G; c < (g + 1) * p.G; c++)
                acc += dc_x(p, (i - t) * p.D + c) * p.dout[i * p.D + c];
        p.ddelta[((i * 2 + p.side) * p.Kc + t) * ng + g] = acc;
    }
}

#define DC_CHUNK 64 /* rows per dbase partial */

/* part[chunk, t·D + c] = Σ over the chunk's rows i (in order) with slot(i) ≥ t of x[i − t, c]·dout[i, c] */
static __global__ void dynconv_dbase_part_kernel(kn_dynconv_params p, float *part) {
    const int64_t n = (int64_t)p.Kc * p.D, e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n)
        return;
    const int     t = (int)(e / p.D), c = (int)(e % p.D);
    const int64_t r0 = (int64_t)blockIdx.y * DC_CHUNK, r1 = r0 + DC_CHUNK < p.rows ? r0 + DC_CHUNK : p.rows;
    float         acc = 0.0f;
    int           slot = (int)(r0 % p.B); /* slot(i), kept as i advances (no division per row) */
    for (int64_t i = r0; i < r1; i++) {
        if (slot >= t)
            acc = fmaf(dc_x(p, (i - t) * p.D + c), p.dout[i * p.D + c], acc);
        if (++slot == p.B)
            slot = 0;
    }
    part[(int64_t)blockIdx.y * n + e] = acc;
}

static __global__ void dynconv_dbase_sum_kernel(kn_dynconv_params p, const float *part, int64_t n_chunks) {
    const int64_t n = (int64_t)p.Kc * p.D, e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n)
        return;
    float acc = 0.0f;
    for (int64_t k = 0; k < n_chunks; k++)
        acc += part[k * n + e];
    p.dbase[(int64_t)p.side * n + e] = acc;
}

// ----------------------------------------------------------------------------
// launchers

static unsigned int dc_grid(int64_t n, int block) {
    const int64_t g = (n + block - 1) / block;
    return (unsigned int)(g < 65535 * 8 ? (g > 0 ? g : 1) : 65535 * 8);
}

cm_status kn_cuda_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_fwd", ctx, p, 0));
    if (p->rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->rows <= 0x7fffffff, "dynconv_fwd: %lld rows is more than this kernel's grid",
                      (long long)p->rows);
    dynconv_fwd_kernel<<<dim3((unsigned int)((p->D + 127) / 128), (unsigned int)p->rows), 128, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_bwd", ctx, p, 1));
    if (p->rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->rows <= 0x7fffffff, "dynconv_bwd: %lld rows is more than this kernel's grid",
                      (long long)p->rows);
    dynconv_dx_kernel<<<dim3((unsigned int)((p->D + 127) / 128), (unsigned int)p->rows), 128, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    const size_t smem = (size_t)p->D * sizeof(float);
    if (smem <= 48 * 1024 && p->rows <= 0x7fffffff) {
        dynconv_ddelta_kernel<<<(unsigned int)p->rows, 256, smem, ctx->stream>>>(*p);
    } else {
        dynconv_ddelta_wide_kernel<<<dc_grid(p->rows * p->Kc * (p->D / p->G), 256), 256, 0, ctx->stream>>>(*p);
    }
    KN_CUDA_LAUNCHED(ctx);
    const int64_t n = (int64_t)p->Kc * p->D, n_chunks = (p->rows + DC_CHUNK - 1) / DC_CHUNK;
    if (n_chunks > 65535)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "dynconv_bwd: %lld rows is more than this kernel's %d", (long long)p->rows,
                       65535 * DC_CHUNK);
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(n * n_chunks) * sizeof(float)));
    float     *part = (float *)ctx->scratch;
    const dim3 grid((unsigned int)((n + 127) / 128), (unsigned int)n_chunks);
    dynconv_dbase_part_kernel<<<grid, 128, 0, ctx->stream>>>(*p, part);
    KN_CUDA_LAUNCHED(ctx);
    dynconv_dbase_sum_kernel<<<(unsigned int)((n + 127) / 128), 128, 0, ctx->stream>>>(*p, part, n_chunks);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
