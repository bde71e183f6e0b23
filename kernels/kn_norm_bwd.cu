/* kernels/kn_norm_bwd.cu — backward of rmsnorm (y = x·r·s, r = (Σx²/C + eps)^(-1/2),
 * s = w or 1 + w):  dx = r·s⊙dy − x·(r³/C)·Σ_c dy·s·x  (written),  dw[c] += Σ_rows dy·x·r.
 * Three deterministic kernels, no atomics:
 * 1. one block per row (grid-stride): Σx² and Σ dy·s·x in double (per-thread partials, then a
 *    fixed shuffle/shared tree), dx written, r kept in scratch (double [rows]);
 * 2. the rows in fixed chunks of NORM_BWD_ROWS: one thread per (chunk, column) sums
 *    dy·x·r over its chunk's rows in order (double) into scratch [n_chunks, C];
 * 3. one thread per column adds the chunk partials in chunk order to dw.
 * So dw has the same bits for any launch configuration or device; the sums are in double
 * like the reference, which differs only in the order of the double additions. dinp may not
 * alias dout. rmsnorm_bwd_acc adds dx to dinp instead (dinp[c] += float(dx), the F32 sum that
 * rmsnorm_bwd into a temporary and add make, bit for bit), sparing the drafter that temporary
 * [rows, C]. rmsnorm_bwd_typed is the same with x in F32 or BF16 (read where it is, no widened
 * copy) and, optionally, the bf16 of dinp's final value written beside it (the next GEMM's
 * operand, no cast pass). Kernels 2 and 3 also serve head_norm_rope_bwd (kn_head_norm.cu)
 * through kn_norm_int.h. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"
#include "kn_norm_int.h"

#include <cuda_bf16.h>

#define NORM_BWD_ROWS    128 /* rows per partial of dw */
#define NORM_BWD_THREADS 128

// ----------------------------------------------------------------------------
// kernels

/* x in F32 (xbf 0) or BF16; dinp_bf16 (may be NULL) gets bf16 of dinp's final value. */
static __global__ void rmsnorm_bwd_dx_kernel(float *dinp, __nv_bfloat16 *dinp_bf16, double *rstd, const float *dout,
                                             const void *inp, int xbf, const float *w, int64_t rows, int64_t C,
                                             float eps, int one_plus, int acc) {
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *dy = dout + r * C;
        float       *dx = dinp + r * C;
        double       ss = 0, g = 0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            double       s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            const double x = (double)ld_f(inp, xbf, r * C + c);
            ss += x * x;
            g += (double)dy[c] * s * x;
        }
        ss = block_sum(ss, sh);
        g = block_sum(g, sh);
        const double rs = 1.0 / sqrt(ss / (double)C + (double)eps);
        const double k = rs * rs * rs / (double)C * g;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            double      s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            const float v = (float)(rs * s * (double)dy[c] - (double)ld_f(inp, xbf, r * C + c) * k);
            const float o = acc ? dx[c] + v : v;
            dx[c] = o;
            if (dinp_bf16)
                dinp_bf16[r * C + c] = __float2bfloat16_rn(o);
        }
        if (threadIdx.x == 0)
            rstd[r] = rs;
    }
}

static __global__ void rmsnorm_bwd_dw_partial_kernel(double *partial, const double *rstd, const float *dout,
                                                     const void *inp, int xbf, int64_t rows, int64_t C) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C)
        return;
    const int64_t r0 = chunk * NORM_BWD_ROWS, r1 = r0 + NORM_BWD_ROWS < rows ? r0 + NORM_BWD_ROWS : rows;
    double        acc = 0;
    for (int64_t r = r0; r < r1; r++)
        acc += (double)dout[r * C + c] * (double)ld_f(inp, xbf, r * C + c) * rstd[r];
    partial[chunk * C + c] = acc;
}

static __global__ void rmsnorm_bwd_dw_reduce_kernel(float *dw, const double *partial, int64_t n_chunks,
                                                    int64_t C) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    double acc = 0;
    for (int64_t k = 0; k < n_chunks; k++)
        acc += partial[k * C + c];
    dw[c] = (float)((double)dw[c] + acc);
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_norm_bwd_scratch(kn_ctx *ctx, const char *op, int64_t rows, int64_t C, double **rstd,
                                   double **partial) {
    const int64_t n_chunks = (rows + NORM_BWD_ROWS - 1) / NORM_BWD_ROWS;
    KN_CUDA_CHECK_ARG(n_chunks <= 65535, "%s: rows=%lld exceeds %d", op, (long long)rows, 65535 * NORM_BWD_ROWS);
    CM_TRY(kn_cuda_scratch_reserve(ctx, ((size_t)rows + (size_t)(n_chunks * C)) * sizeof(double)));
    *rstd = (double *)ctx->scratch;
    *partial = *rstd + rows;
    return CM_OK;
}

cm_status kn_cuda_norm_bwd_dw(kn_ctx *ctx, float *dw, const double *rstd, double *partial, const float *dout,
                              const void *x, int xbf, int64_t rows, int64_t C) {
    const int64_t n_chunks = (rows + NORM_BWD_ROWS - 1) / NORM_BWD_ROWS;
    dim3          pg((unsigned int)((C + 127) / 128), (unsigned int)n_chunks);
    rmsnorm_bwd_dw_partial_kernel<<<pg, 128, 0, ctx->stream>>>(partial, rstd, dout, x, xbf, rows, C);
    KN_CUDA_LAUNCHED(ctx);
    rmsnorm_bwd_dw_reduce_kernel<<<(unsigned int)((C + 127) / 128), 128, 0, ctx->stream>>>(dw, partial, n_chunks,
                                                                                          C);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

static cm_status rmsnorm_bwd_launch(kn_ctx *ctx, const char *op, const kn_norm_bwd_typed_params *p) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(p->x_dt == CM_DTYPE_F32 || p->x_dt == CM_DTYPE_BF16, "%s: x in %s is not supported (F32 or BF16)",
                      op, cm_dtype_name(p->x_dt));
    const int64_t rows = p->rows, C = p->C;
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "%s: bad shape rows=%lld C=%lld (rows >= 0, C > 0)", op, (long long)rows,
                      (long long)C);
    KN_CUDA_CHECK_ARG(p->eps >= 0, "%s: eps=%g must be >= 0", op, (double)p->eps);
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->dinp && p->dw && p->dout && p->x && p->w, "%s: dinp, dw, dout, x or w is NULL", op);
    KN_CUDA_CHECK_ARG(p->dinp != p->dout && (const void *)p->dinp != p->x, "%s: dinp may not alias dout or x", op);
    double *rstd, *partial;
    CM_TRY(kn_cuda_norm_bwd_scratch(ctx, op, rows, C, &rstd, &partial));
    const int xbf = p->x_dt == CM_DTYPE_BF16;
    const int64_t grid = rows < (1 << 20) ? rows : (1 << 20);
    rmsnorm_bwd_dx_kernel<<<(unsigned int)grid, NORM_BWD_THREADS, 0, ctx->stream>>>(
        p->dinp, (__nv_bfloat16 *)p->dinp_bf16, rstd, p->dout, p->x, xbf, p->w, rows, C, p->eps, p->one_plus,
        p->accumulate);
    KN_CUDA_LAUNCHED(ctx);
    return kn_cuda_norm_bwd_dw(ctx, p->dw, rstd, partial, p->dout, p->x, xbf, rows, C);
}

/* The F32 entries as typed parameters. */
static kn_norm_bwd_typed_params f32_params(float *dinp, float *dw, const float *dout, const float *inp,
                                           const float *w, int64_t rows, int64_t C, float eps, int one_plus,
                                           int acc) {
    kn_norm_bwd_typed_params p = {.rows = rows, .C = C, .eps = eps, .one_plus = one_plus, .w = w, .dw = dw,
                                  .x = inp, .x_dt = CM_DTYPE_F32, .dout = dout, .dinp = dinp, .accumulate = acc};
    return p;
}

cm_status kn_cuda_rmsnorm_bwd(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    const kn_norm_bwd_typed_params p = f32_params(dinp, dw, dout, inp, w, rows, C, eps, one_plus, 0);
    return rmsnorm_bwd_launch(ctx, "rmsnorm_bwd", &p);
}

cm_status kn_cuda_rmsnorm_bwd_acc(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                  const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    const kn_norm_bwd_typed_params p = f32_params(dinp, dw, dout, inp, w, rows, C, eps, one_plus, 1);
    return rmsnorm_bwd_launch(ctx, "rmsnorm_bwd_acc", &p);
}

cm_status kn_cuda_rmsnorm_bwd_typed(kn_ctx *ctx, const kn_norm_bwd_typed_params *p) {
    KN_CUDA_CHECK_ARG(p, "rmsnorm_bwd_typed: params is NULL");
    return rmsnorm_bwd_launch(ctx, "rmsnorm_bwd_typed", p);
}
