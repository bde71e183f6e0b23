/* kernels/kn_head_norm.cu — the drafter's q/k prep on typed storage and its backward.
 * head_norm_rope: every head row of x [T, nh, hd] (F32 or BF16) rmsnorm'ed with the plain w [hd]
 * and rotated by the NeoX rope into out (F32): the chain widen, rmsnorm, rope in one pass, reading
 * the saved BF16 projection where it is. One block per token (grid-stride): its threads put the
 * token's cos/sin into shared memory, then each warp takes one head row at a time through a shared
 * row buffer, as kn_qk_prep.cu does, with its numerics: the sum of squares, 1/sqrt and the scaled
 * output in double rounded once, the angle one float32 product (__fmul_rn), cos, sin and the
 * rotation in double with explicit _rn operations. out may equal x (F32): a warp reads its whole
 * row before it writes.
 * head_norm_rope_bwd: per head row, the gradient rotated back (sin negated) and stored back in
 * place, then rmsnorm's backward dx in double as kernel 1 of kn_norm_bwd.cu (the row's r kept),
 * stored as F32 or rounded once more to bf16 (the operand of the GEMMs that follow),
 * then dw by kn_norm_bwd.cu's deterministic chunked pass (kn_norm_int.h) over the T·nh rows: the
 * chain rope_bwd, widen, rmsnorm_bwd in two passes instead of four. Limits: hd ≤ 1024 (shared
 * memory ≤ 40 KiB); beyond, CM_ERR_UNSUPPORTED. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"
#include "kn_norm_int.h"
#include "kn_rope_int.h"

#define HN_MAX_HD 1024
#define HN_WARPS  8

// ----------------------------------------------------------------------------
// kernels

/* cos and sin of token position p's angles into cs, sn [half] (the block's threads together). */
static __device__ __forceinline__ void token_angles(double *cs, double *sn, int half, int32_t p,
                                                    const kn_rope_freqs &freqs) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = __fmul_rn((float)p, freqs.inv[i]);
        double      s, c;
        sincos((double)angle, &s, &c);
        cs[i] = c;
        sn[i] = s;
    }
}

static __global__ void head_norm_rope_kernel(float *out, const void *x, int xbf, const float *w,
                                             const int32_t *pos, int64_t T, int nh, int hd, int half, float eps,
                                             const kn_rope_freqs freqs) {
    extern __shared__ double hn_sm[];
    double                  *cs = hn_sm, *sn = hn_sm + half;
    const int                lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float                   *buf = (float *)(hn_sm + 2 * half) + (int64_t)warp * hd;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads(); /* the previous token's rows are done with cs/sn */
        token_angles(cs, sn, half, pos[t], freqs);
        __syncthreads();
        for (int h = warp; h < nh; h += nw) {
            const int64_t o = (t * nh + h) * (int64_t)hd;
            float        *y = out + o;
            double        ss = 0;
            for (int c = lane; c < hd; c += 32) {
                const float v = ld_f(x, xbf, o + c);
                buf[c] = v;
                ss += (double)v * (double)v;
            }
            ss = warp_sum(ss);
            const double rstd = 1.0 / sqrt(ss / (double)hd + (double)eps);
            for (int c = lane; c < hd; c += 32)
                buf[c] = (float)__dmul_rn(__dmul_rn((double)buf[c], rstd), (double)w[c]);
            __syncwarp();
            for (int c = lane; c < hd; c += 32) {
                if (c < half) {
                    const double x1 = buf[c], x2 = buf[c + half];
                    y[c] = (float)__dsub_rn(__dmul_rn(x1, cs[c]), __dmul_rn(x2, sn[c]));
                    y[c + half] = (float)__dadd_rn(__dmul_rn(x2, cs[c]), __dmul_rn(x1, sn[c]));
                } else if (c >= 2 * half) {
                    y[c] = buf[c];
                }
            }
            __syncwarp(); /* the buffer is reused by this warp's next row */
        }
    }
}

/* dout rotated back in place and dinp = rmsnorm_bwd's dx per head row, F32 or (dbf) its bf16; rstd
 * [T·nh] kept. */
static __global__ void head_norm_rope_bwd_kernel(void *dinp, int dbf, double *rstd, float *dout,
                                                 const void *x, int xbf, const float *w, const int32_t *pos,
                                                 int64_t T, int nh, int hd, int half, float eps,
                                                 const kn_rope_freqs freqs) {
    extern __shared__ double hn_sm[];
    double                  *cs = hn_sm, *sn = hn_sm + half;
    const int                lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float                   *buf = (float *)(hn_sm + 2 * half) + (int64_t)warp * hd;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads();
        token_angles(cs, sn, half, pos[t], freqs);
        __syncthreads();
        for (int h = warp; h < nh; h += nw) {
            const int64_t o = (t * nh + h) * (int64_t)hd;
            float        *dy = dout + o;
            for (int c = lane; c < hd; c += 32)
                buf[c] = dy[c];
            __syncwarp();
            for (int c = lane; c < half; c += 32) { /* one lane per pair: rope_bwd's rotation */
                const double d1 = buf[c], d2 = buf[c + half], s = -sn[c];
                buf[c] = (float)__dsub_rn(__dmul_rn(d1, cs[c]), __dmul_rn(d2, s));
                buf[c + half] = (float)__dadd_rn(__dmul_rn(d2, cs[c]), __dmul_rn(d1, s));
            }
            __syncwarp();
            double ss = 0, g = 0;
            for (int c = lane; c < hd; c += 32) {
                const float  v = buf[c];
                const double xv = (double)ld_f(x, xbf, o + c);
                dy[c] = v; /* the dw pass reads the rotated gradient */
                ss += xv * xv;
                g += (double)v * (double)w[c] * xv;
            }
            ss = warp_sum(ss);
            g = warp_sum(g);
            const double rs = 1.0 / sqrt(ss / (double)hd + (double)eps);
            const double k = rs * rs * rs / (double)hd * g;
            for (int c = lane; c < hd; c += 32)
                st_f(dinp, dbf, o + c,
                     (float)(rs * (double)w[c] * (double)buf[c] - (double)ld_f(x, xbf, o + c) * k));
            if (lane == 0)
                rstd[t * nh + h] = rs;
            __syncwarp();
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

/* The checks both launchers start with; op names the call in the messages. */
static cm_status head_check(const kn_ctx *ctx, const char *op, cm_dtype x_dt, int64_t T, int nh, int hd,
                            int rot_dim, float theta, float eps) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(x_dt == CM_DTYPE_F32 || x_dt == CM_DTYPE_BF16, "%s: x in %s is not supported (F32 or BF16)", op,
                      cm_dtype_name(x_dt));
    KN_CUDA_CHECK_ARG(T >= 0 && nh > 0 && hd > 0, "%s: bad shape T=%lld nh=%d hd=%d", op, (long long)T, nh, hd);
    KN_CUDA_CHECK_ARG(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= hd && theta > 0 && isfinite(theta) && eps >= 0,
                      "%s: rot_dim=%d (even, <= hd=%d), theta=%g (> 0) or eps=%g (>= 0) out of range", op, rot_dim, hd,
                      (double)theta, (double)eps);
    if (hd > HN_MAX_HD)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: head_dim=%d is not supported by the cuda backend (max %d)", op, hd,
                       HN_MAX_HD);
    return CM_OK;
}

/* Warps per block and dynamic shared memory of either kernel. */
static int head_warps(int nh) {
    return nh < HN_WARPS ? nh : HN_WARPS;
}

static size_t head_smem(int nh, int hd, int half) {
    return (size_t)half * 2 * sizeof(double) + (size_t)head_warps(nh) * (size_t)hd * sizeof(float);
}

cm_status kn_cuda_head_norm_rope(kn_ctx *ctx, float *out, const void *x, cm_dtype x_dt, const float *w,
                                 const int32_t *pos, int64_t T, int nh, int hd, int rot_dim, float theta, float eps) {
    CM_TRY(head_check(ctx, "head_norm_rope", x_dt, T, nh, hd, rot_dim, theta, eps));
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && w && pos, "head_norm_rope: out, x, w or pos is NULL");
    const int     half = rot_dim / 2;
    kn_rope_freqs freqs;
    kn_rope_freqs_fill(&freqs, rot_dim, theta);
    const int64_t blocks = T < (1 << 20) ? T : (1 << 20);
    head_norm_rope_kernel<<<(unsigned int)blocks, 32 * head_warps(nh), head_smem(nh, hd, half), ctx->stream>>>(
        out, x, x_dt == CM_DTYPE_BF16, w, pos, T, nh, hd, half, eps, freqs);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_head_norm_rope_bwd(kn_ctx *ctx, void *dinp, cm_dtype dinp_dt, float *dw, float *dout,
                                     const void *x, cm_dtype x_dt, const float *w, const int32_t *pos,
                                     int64_t T, int nh, int hd, int rot_dim, float theta, float eps) {
    CM_TRY(head_check(ctx, "head_norm_rope_bwd", x_dt, T, nh, hd, rot_dim, theta, eps));
    KN_CUDA_CHECK_ARG(dinp_dt == CM_DTYPE_F32 || dinp_dt == CM_DTYPE_BF16,
                      "head_norm_rope_bwd: dinp in %s is not supported (F32 or BF16)",
                      cm_dtype_name(dinp_dt));
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dinp && dw && dout && x && w && pos, "head_norm_rope_bwd: dinp, dw, dout, x, w or pos is NULL");
    KN_CUDA_CHECK_ARG(dinp != (void *)dout && (const void *)dinp != x,
                      "head_norm_rope_bwd: dinp may not alias dout or x");
    const int64_t rows = T * nh;
    double       *rstd, *partial;
    CM_TRY(kn_cuda_norm_bwd_scratch(ctx, "head_norm_rope_bwd", rows, hd, &rstd, &partial));
    const int     half = rot_dim / 2, xbf = x_dt == CM_DTYPE_BF16;
    kn_rope_freqs freqs;
    kn_rope_freqs_fill(&freqs, rot_dim, theta);
    const int64_t blocks = T < (1 << 20) ? T : (1 << 20);
    head_norm_rope_bwd_kernel<<<(unsigned int)blocks, 32 * head_warps(nh), head_smem(nh, hd, half),
                                ctx->stream>>>(dinp, dinp_dt == CM_DTYPE_BF16, rstd, dout, x, xbf, w, pos, T,
                                               nh, hd, half, eps, freqs);
    KN_CUDA_LAUNCHED(ctx);
    return kn_cuda_norm_bwd_dw(ctx, dw, rstd, partial, dout, x, xbf, rows, hd);
}
