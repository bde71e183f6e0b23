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
 * [rows, C]. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#define NORM_BWD_ROWS    128 /* rows per partial of dw */
#define NORM_BWD_THREADS 128

// ----------------------------------------------------------------------------
// kernels

static __global__ void rmsnorm_bwd_dx_kernel(float *dinp, double *rstd, const float *dout, const float *inp,
                                             const float *w, int64_t rows, int64_t C, float eps, int one_plus,
                                             int acc) {
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * C, *dy = dout + r * C;
        float       *dx = dinp + r * C;
        double       ss = 0, g = 0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            double s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            ss += (double)x[c] * (double)x[c];
            g += (double)dy[c] * s * (double)x[c];
        }
        ss = block_sum(ss, sh);
        g = block_sum(g, sh);
        const double rs = 1.0 / sqrt(ss / (double)C + (double)eps);
        const double k = rs * rs * rs / (double)C * g;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            double s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            const float v = (float)(rs * s * (double)dy[c] - (double)x[c] * k);
            dx[c] = acc ? dx[c] + v : v;
        }
        if (threadIdx.x == 0)
            rstd[r] = rs;
    }
}

static __global__ void rmsnorm_bwd_dw_partial_kernel(double *partial, const double *rstd, const float *dout,
                                                     const float *inp, int64_t rows, int64_t C) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C)
        return;
    const int64_t r0 = chunk * NORM_BWD_ROWS, r1 = r0 + NORM_BWD_ROWS < rows ? r0 + NORM_BWD_ROWS : rows;
    double        acc = 0;
    for (int64_t r = r0; r < r1; r++)
        acc += (double)dout[r * C + c] * (double)inp[r * C + c] * rstd[r];
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

static cm_status rmsnorm_bwd_launch(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                    const float *w, int64_t rows, int64_t C, float eps, int one_plus, int acc) {
    KN_CUDA_CHECK_ARG(ctx, "rmsnorm_bwd: ctx is NULL");
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "rmsnorm_bwd: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                      (long long)rows, (long long)C);
    KN_CUDA_CHECK_ARG(eps >= 0, "rmsnorm_bwd: eps=%g must be >= 0", (double)eps);
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dinp && dw && dout && inp && w, "rmsnorm_bwd: dinp, dw, dout, inp or w is NULL");
    KN_CUDA_CHECK_ARG(dinp != dout, "rmsnorm_bwd: dinp may not alias dout");
    const int64_t n_chunks = (rows + NORM_BWD_ROWS - 1) / NORM_BWD_ROWS;
    KN_CUDA_CHECK_ARG(n_chunks <= 65535, "rmsnorm_bwd: rows=%lld exceeds %d", (long long)rows,
                      65535 * NORM_BWD_ROWS);
    CM_TRY(kn_cuda_scratch_reserve(ctx, ((size_t)rows + (size_t)(n_chunks * C)) * sizeof(double)));
    double *rstd = (double *)ctx->scratch, *partial = rstd + rows;

    const int64_t grid = rows < (1 << 20) ? rows : (1 << 20);
    rmsnorm_bwd_dx_kernel<<<(unsigned int)grid, NORM_BWD_THREADS, 0, ctx->stream>>>(dinp, rstd, dout, inp, w, rows,
                                                                                  C, eps, one_plus, acc);
    KN_CUDA_LAUNCHED(ctx);
    dim3 pg((unsigned int)((C + 127) / 128), (unsigned int)n_chunks);
    rmsnorm_bwd_dw_partial_kernel<<<pg, 128, 0, ctx->stream>>>(partial, rstd, dout, inp, rows, C);
    KN_CUDA_LAUNCHED(ctx);
    rmsnorm_bwd_dw_reduce_kernel<<<(unsigned int)((C + 127) / 128), 128, 0, ctx->stream>>>(dw, partial, n_chunks,
                                                                                          C);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_bwd(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    return rmsnorm_bwd_launch(ctx, dinp, dw, dout, inp, w, rows, C, eps, one_plus, 0);
}

cm_status kn_cuda_rmsnorm_bwd_acc(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                  const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    return rmsnorm_bwd_launch(ctx, dinp, dw, dout, inp, w, rows, C, eps, one_plus, 1);
}
