/* kernels/kn_elementwise_bwd.cu — backward of SwiGLU (out = silu(gate)·up):
 *   dup = dout·silu(g),  dgate = dout·up·σ(g)·(1 + g·(1 − σ(g))).
 * One thread per element (grid-stride, int64 indices), evaluated in double and rounded once
 * like the reference: the factor 1 + g·(1 − σ) crosses zero near g ≈ −1.28, where fp32
 * would lose the relative accuracy the reference has. Streaming; outputs written (=).
 * The typed pair (swiglu_typed, swiglu_bwd_typed) does the same on F32 or BF16 storage for
 * dt_model's BF16 saved activations: the forward in fp32 math exactly as swiglu
 * (kn_elementwise.cu), the backward as above; BF16 loads are widened exactly and stores
 * rounded to nearest even, so with F32 the results are swiglu's and swiglu_bwd's bits. The
 * backward may write dgate over gate and dup over up (each thread reads its element's three
 * inputs before writing), which lets the MLP backward reuse the saved gate/up buffers.
 * BF16 to BF16 with n a multiple of 8 and aligned buffers (the target's fused MLP) moves 16
 * bytes per load (swiglu_bf16io_kernel), the same bits; its backward in BF16 with n a multiple
 * of 4 moves 8 bytes per access (swiglu_bwd_bf16_kernel), the same bits.
 * swiglu_fwd_bwd_typed is the pair in one pass for the MLP backward, which needs the product
 * again (for down's weight gradient) and the gradient: gate, up and dout read once, the product
 * written over dout, the gradient over gate and up; each value is the one its own kernel gives
 * (at the drafter's 8192 × 17408 BF16, 1.7 GB moved instead of the pair's 2.3 GB). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>

/* SwiGLU's backward for one element, in double and rounded once (the header's formulas): every
 * kernel below evaluates it through this, so they agree bit for bit. */
static __device__ __forceinline__ void swiglu_bwd_val(double d, double g, double u, float *dgate,
                                                      float *dup) {
    const double sg = 1.0 / (1.0 + exp(-g)); /* one exp and one division: the kernels' cost */
    *dup = (float)(d * (g * sg));
    *dgate = (float)(d * u * sg * (1.0 + g * (1.0 - sg)));
}

static __global__ void swiglu_bwd_kernel(float *dgate, float *dup, const float *dout, const float *gate,
                                         const float *up, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float dg, du;
        swiglu_bwd_val(dout[i], gate[i], up[i], &dg, &du);
        dup[i] = du;
        dgate[i] = dg;
    }
}

cm_status kn_cuda_swiglu_bwd(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu_bwd: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "swiglu_bwd: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dgate && dup && dout && gate && up, "swiglu_bwd: dgate, dup, dout, gate or up is NULL");
    KN_CUDA_CHECK_ARG(dgate != dup, "swiglu_bwd: dgate and dup must be different buffers");
    int64_t blocks = (n + 255) / 256;
    swiglu_bwd_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        dgate, dup, dout, gate, up, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// typed storage

static __global__ void swiglu_typed_kernel(void *out, int obf, const void *gate, const void *up, int ibf,
                                           int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = ld_f(gate, ibf, i);
        st_f(out, obf, i, kn_silu(g) * ld_f(up, ibf, i));
    }
}

/* swiglu_typed_kernel for BF16 in and out with n % 8 == 0 and 16-byte aligned buffers (the
 * target's MLP on the fused path): 8 values per 16-byte load, the same math per value. */
static __global__ void swiglu_bf16io_kernel(uint4 *out, const uint4 *gate, const uint4 *up, int64_t n8) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
        const uint4           g4 = gate[i], u4 = up[i];
        const __nv_bfloat162 *g = (const __nv_bfloat162 *)&g4, *u = (const __nv_bfloat162 *)&u4;
        uint4                 o4;
        __nv_bfloat162       *o = (__nv_bfloat162 *)&o4;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 gf = __bfloat1622float2(g[j]), uf = __bfloat1622float2(u[j]);
            o[j] = __floats2bfloat162_rn(kn_silu(gf.x) * uf.x, kn_silu(gf.y) * uf.y);
        }
        out[i] = o4;
    }
}

/* swiglu_bwd_typed's kernel; with H (swiglu_fwd_bwd_typed) it also writes the product h, with
 * swiglu_typed_kernel's value. Each element's inputs are loaded before any of its stores. */
template <bool H>
static __global__ void swiglu_bwd_typed_kernel(void *h, void *dgate, void *dup, const void *dout,
                                               const void *gate, const void *up, int bf, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = ld_f(gate, bf, i), u = ld_f(up, bf, i);
        float       dg, du;
        swiglu_bwd_val(ld_f(dout, bf, i), g, u, &dg, &du);
        if (H)
            st_f(h, bf, i, kn_silu(g) * u);
        st_f(dup, bf, i, du);
        st_f(dgate, bf, i, dg);
    }
}

/* swiglu_bwd_typed_kernel for BF16 with n % 4 == 0 and 8-byte aligned buffers (the drafter's
 * MLP backward): four values per 8-byte load and store, the same arithmetic per value. The
 * scalar kernel's 2-byte accesses left it at a fraction of the DRAM bandwidth. */
template <bool H>
static __global__ void swiglu_bwd_bf16_kernel(uint2 *h, uint2 *dgate, uint2 *dup, const uint2 *dout,
                                              const uint2 *gate, const uint2 *up, int64_t n4) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const uint2           d4 = dout[i], g4 = gate[i], u4 = up[i];
        const __nv_bfloat162 *d2 = (const __nv_bfloat162 *)&d4, *g2 = (const __nv_bfloat162 *)&g4,
                             *u2 = (const __nv_bfloat162 *)&u4;
        uint2           h4, dg4, du4;
        __nv_bfloat162 *h2 = (__nv_bfloat162 *)&h4, *dg2 = (__nv_bfloat162 *)&dg4,
                       *du2 = (__nv_bfloat162 *)&du4;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float2 df = __bfloat1622float2(d2[j]), gf = __bfloat1622float2(g2[j]),
                         uf = __bfloat1622float2(u2[j]);
            float rg[2], ru[2];
            swiglu_bwd_val(df.x, gf.x, uf.x, &rg[0], &ru[0]);
            swiglu_bwd_val(df.y, gf.y, uf.y, &rg[1], &ru[1]);
            if (H)
                h2[j] = __floats2bfloat162_rn(kn_silu(gf.x) * uf.x, kn_silu(gf.y) * uf.y);
            du2[j] = __floats2bfloat162_rn(ru[0], ru[1]);
            dg2[j] = __floats2bfloat162_rn(rg[0], rg[1]);
        }
        if (H)
            h[i] = h4;
        dup[i] = du4;
        dgate[i] = dg4;
    }
}

static unsigned int typed_grid(int64_t n) {
    int64_t blocks = (n + 255) / 256;
    return (unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20));
}

static int typed_ok(cm_dtype dt) {
    return dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16;
}

cm_status kn_cuda_swiglu_typed(kn_ctx *ctx, void *out, cm_dtype odt, const void *gate, const void *up,
                               cm_dtype idt, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu_typed: ctx is NULL");
    if (!typed_ok(odt) || !typed_ok(idt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "swiglu_typed: %s to %s is not supported (F32 or BF16)",
                       cm_dtype_name(idt), cm_dtype_name(odt));
    KN_CUDA_CHECK_ARG(n >= 0, "swiglu_typed: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && gate && up, "swiglu_typed: out, gate or up is NULL");
    if (odt == CM_DTYPE_BF16 && idt == CM_DTYPE_BF16 && n % 8 == 0 &&
        (((uintptr_t)out | (uintptr_t)gate | (uintptr_t)up) & 15) == 0) {
        swiglu_bf16io_kernel<<<typed_grid(n / 8), 256, 0, ctx->stream>>>((uint4 *)out, (const uint4 *)gate,
                                                                         (const uint4 *)up, n / 8);
        KN_CUDA_LAUNCHED(ctx);
        return CM_OK;
    }
    swiglu_typed_kernel<<<typed_grid(n), 256, 0, ctx->stream>>>(out, odt == CM_DTYPE_BF16, gate, up,
                                                                idt == CM_DTYPE_BF16, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* swiglu_bwd_typed, and with H swiglu_fwd_bwd_typed (op names the entry in messages). */
template <bool H>
static cm_status swiglu_bwd_launch(const char *op, kn_ctx *ctx, void *h, void *dgate, void *dup,
                                   const void *dout, const void *gate, const void *up, cm_dtype dt,
                                   int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    if (!typed_ok(dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: %s is not supported (F32 or BF16)", op, cm_dtype_name(dt));
    KN_CUDA_CHECK_ARG(n >= 0, "%s: n=%lld must be >= 0", op, (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG((h || !H) && dgate && dup && dout && gate && up,
                      "%s: %sdgate, dup, dout, gate or up is NULL", op, H ? "h, " : "");
    KN_CUDA_CHECK_ARG(dgate != dup && (!H || (h != dgate && h != dup)),
                      "%s: %sdgate and dup must be different buffers", op, H ? "h, " : "");
    if (dt == CM_DTYPE_BF16 && n % 4 == 0 &&
        (((uintptr_t)h | (uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)dout | (uintptr_t)gate |
          (uintptr_t)up) &
         7) == 0)
        swiglu_bwd_bf16_kernel<H><<<typed_grid(n / 4), 256, 0, ctx->stream>>>(
            (uint2 *)h, (uint2 *)dgate, (uint2 *)dup, (const uint2 *)dout, (const uint2 *)gate,
            (const uint2 *)up, n / 4);
    else
        swiglu_bwd_typed_kernel<H>
            <<<typed_grid(n), 256, 0, ctx->stream>>>(h, dgate, dup, dout, gate, up, dt == CM_DTYPE_BF16, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_swiglu_bwd_typed(kn_ctx *ctx, void *dgate, void *dup, const void *dout, const void *gate,
                                   const void *up, cm_dtype dt, int64_t n) {
    return swiglu_bwd_launch<false>("swiglu_bwd_typed", ctx, NULL, dgate, dup, dout, gate, up, dt, n);
}

cm_status kn_cuda_swiglu_fwd_bwd_typed(kn_ctx *ctx, void *h, void *dgate, void *dup, const void *dout,
                                       const void *gate, const void *up, cm_dtype dt, int64_t n) {
    return swiglu_bwd_launch<true>("swiglu_fwd_bwd_typed", ctx, h, dgate, dup, dout, gate, up, dt, n);
}
