/* kernels/kn_norm_bwd.cu — backward of rmsnorm (y = x·r·s, r = (Σx²/C + eps)^(-1/2),
 * s = w or 1 + w):  dx = r·s⊙dy − x·(r³/C)·Σ_c dy·s·x  (written),  dw[c] += Σ_rows dy·x·r.
 * Three deterministic kernels, no atomics:
 * 1. one block per row (grid-stride): Σx² and Σ dy·s·x in double (per-thread partials, then a
 *    fixed shuffle/shared tree), dx written, r kept in scratch (double [rows]). Where C % 4 == 0
 *    (C ≤ 6144) and the rows are aligned, the vector form holds the thread's groups of four
 *    columns of dy, x (BF16 packed) and the old dinp in registers from the load to the store
 *    (16-byte accesses, all in flight before the first use; 80 registers, two blocks of 320
 *    threads per SM at C = 5120), so the row is read once and both sums share one reduction;
 *    the scalar form (two passes, the second re-reading) stays for other shapes;
 * 2. the rows in fixed chunks of NORM_BWD_ROWS: one thread per (chunk, column), or per group of
 *    four columns where aligned, sums dy·x·r over its chunk's rows in order (double, DW_UNROLL
 *    rows' loads in flight) into scratch [n_chunks, C];
 * 3. each column's chunk partials added in chunk order to dw (the loads of many chunks in flight).
 * So dw has the same bits for any launch configuration or device; the sums are in double
 * like the reference, which differs only in the order of the double additions. dinp may not
 * alias dout. rmsnorm_bwd_acc adds dx to dinp instead (dinp[c] += float(dx), the F32 sum that
 * rmsnorm_bwd into a temporary and add make, bit for bit), sparing the drafter that temporary
 * [rows, C]. rmsnorm_bwd_typed is the same with x in F32 or BF16 (read where it is, no widened
 * copy) and, optionally, the bf16 of dinp's final value written beside it (the next GEMM's
 * operand, no cast pass). Kernels 2 and 3 also serve head_norm_rope_bwd (kn_head_norm.cu)
 * through kn_norm_int.h.
 * Bytes at the drafter's R = 8192, C = 5120 (BF16 x, accumulate, bf16 copy): kernel 1 reads dy,
 * x, dinp and writes dinp, its bf16 (18 B an element, 755 MB), kernel 2 reads dy and x again
 * (6 B, 252 MB): ~240 µs at 4.2 TB/s; F32 x without them: 12 + 8 B, ~200 µs. */
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

/* The dx kernel's vector path (C % 4 == 0, every row 16-byte aligned, 8 for BF16 x; C ≤ 4·NORM_BWD_VEC·4):
 * one block per row, thread t holding the groups of four columns t + j·blockDim.x (j < V) of dy, x, w and
 * (acc) the old dinp in registers from their loads, all issued before the first use, to the stores of dinp
 * and its bf16, so each row crosses memory once. Σx² and Σ dy·s·x reduce together (one shared tree, two
 * barriers). The per-element double math is the scalar kernel's, the per-thread sums j by j. */
#define NORM_BWD_VEC 384

static __device__ __forceinline__ void f4_arr(float a[4], float4 v) {
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
}

/* (a.x, a.y) summed over the block (blockDim.x a multiple of 32), every thread getting both totals in a
 * fixed order; sh holds 32 pairs, the leading barrier making back-to-back calls safe. */
static __device__ double2 block_sum2(double2 a, double2 *sh) {
    a.x = warp_sum(a.x), a.y = warp_sum(a.y);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0)
        sh[warp] = a;
    __syncthreads();
    a = lane < (int)(blockDim.x / 32) ? sh[lane] : make_double2(0.0, 0.0);
    a.x = warp_sum(a.x), a.y = warp_sum(a.y);
    return a;
}

/* s = w or 1 + w of a group's four columns, widened. */
static __device__ __forceinline__ void s_arr(double s[4], float4 w, int one_plus) {
    float c[4];
    f4_arr(c, w);
#pragma unroll
    for (int e = 0; e < 4; e++)
        s[e] = one_plus ? 1.0 + (double)c[e] : (double)c[e];
}

template <int V, bool XBF>
static __global__ void __launch_bounds__(NORM_BWD_VEC, 2)
    rmsnorm_bwd_dx_vec_kernel(float *dinp, __nv_bfloat16 *dinp_bf16, double *rstd, const float *dout,
                              const void *inp, const float *w, int64_t rows, int64_t C, float eps,
                              int one_plus, int acc) {
    __shared__ double2 sh[32];
    const int          C4 = (int)(C / 4);
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t  o = r * C4; /* the row's first group */
        float4         dy[V], d0[V];
        kn_typed4<XBF> xv[V];
#pragma unroll
        for (int j = 0; j < V; j++) {
            const int g = threadIdx.x + j * blockDim.x;
            if (g >= C4)
                continue;
            dy[j] = ((const float4 *)dout)[o + g];
            xv[j].load(inp, o + g);
            if (acc)
                d0[j] = ((const float4 *)dinp)[o + g];
        }
        double2 t = make_double2(0.0, 0.0);
#pragma unroll
        for (int j = 0; j < V; j++) {
            const int g = threadIdx.x + j * blockDim.x;
            if (g >= C4)
                continue;
            float  a[4], b[4];
            double s[4];
            f4_arr(a, dy[j]), f4_arr(b, xv[j].get()), s_arr(s, ((const float4 *)w)[g], one_plus);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const double x = (double)b[e];
                t.x = __fma_rn(x, x, t.x);
                t.y = __fma_rn(__dmul_rn((double)a[e], s[e]), x, t.y);
            }
        }
        t = block_sum2(t, sh);
        const double rs = 1.0 / sqrt(t.x / (double)C + (double)eps);
        const double k = rs * rs * rs / (double)C * t.y;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const int g = threadIdx.x + j * blockDim.x;
            if (g >= C4)
                continue;
            float  a[4], b[4], d[4];
            double s[4];
            f4_arr(a, dy[j]), f4_arr(b, xv[j].get()), s_arr(s, ((const float4 *)w)[g], one_plus);
            if (acc)
                f4_arr(d, d0[j]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const double y = __fma_rn(__dmul_rn(rs, s[e]), (double)a[e], -__dmul_rn((double)b[e], k));
                const float  v = __double2float_rn(y);
                d[e] = acc ? d[e] + v : v;
            }
            const float4 out = make_float4(d[0], d[1], d[2], d[3]);
            ((float4 *)dinp)[o + g] = out;
            if (dinp_bf16)
                st_bf16x4(dinp_bf16, o + g, out);
        }
        if (threadIdx.x == 0)
            rstd[r] = rs;
    }
}

/* Kernel 2: one thread per column (vec 0) or per group of four (vec 1: C % 4 == 0, dout rows 16-byte
 * aligned, x 16 or 8 for BF16) and chunk; DW_UNROLL rows' loads are issued before their products are
 * added, in row order, so a thread has that many rows in flight instead of one. Every column's sum is
 * fma(dy·x, r, acc) row by row from 0, whichever path, so the partials have the same bits either way. */
#define DW_UNROLL 8

static __device__ __forceinline__ double dw_term(double acc, float dy, float x, double rs) {
    return __fma_rn(__dmul_rn((double)dy, (double)x), rs, acc);
}

static __global__ void rmsnorm_bwd_dw_partial_kernel(double *partial, const double *rstd, const float *dout,
                                                     const void *inp, int xbf, int64_t rows, int64_t C,
                                                     int vec) {
    const int64_t chunk = blockIdx.y, r0 = chunk * NORM_BWD_ROWS;
    const int64_t r1 = r0 + NORM_BWD_ROWS < rows ? r0 + NORM_BWD_ROWS : rows;
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (!vec) {
        if (c >= C)
            return;
        double  acc = 0;
        int64_t r = r0;
        for (; r + DW_UNROLL <= r1; r += DW_UNROLL) {
            float dy[DW_UNROLL], x[DW_UNROLL];
#pragma unroll
            for (int u = 0; u < DW_UNROLL; u++)
                dy[u] = dout[(r + u) * C + c], x[u] = ld_f(inp, xbf, (r + u) * C + c);
#pragma unroll
            for (int u = 0; u < DW_UNROLL; u++)
                acc = dw_term(acc, dy[u], x[u], rstd[r + u]);
        }
        for (; r < r1; r++)
            acc = dw_term(acc, dout[r * C + c], ld_f(inp, xbf, r * C + c), rstd[r]);
        partial[chunk * C + c] = acc;
        return;
    }
    const int64_t C4 = C / 4;
    if (c >= C4)
        return;
    double  acc[4] = {0, 0, 0, 0};
    int64_t r = r0;
    for (; r + DW_UNROLL <= r1; r += DW_UNROLL) {
        float4 dy[DW_UNROLL], x[DW_UNROLL];
#pragma unroll
        for (int u = 0; u < DW_UNROLL; u++) {
            dy[u] = ((const float4 *)dout)[(r + u) * C4 + c];
            x[u] = ld_f4(inp, xbf, (r + u) * C4 + c);
        }
#pragma unroll
        for (int u = 0; u < DW_UNROLL; u++) {
            const double rs = rstd[r + u];
            acc[0] = dw_term(acc[0], dy[u].x, x[u].x, rs), acc[1] = dw_term(acc[1], dy[u].y, x[u].y, rs);
            acc[2] = dw_term(acc[2], dy[u].z, x[u].z, rs), acc[3] = dw_term(acc[3], dy[u].w, x[u].w, rs);
        }
    }
    for (; r < r1; r++) {
        const float4 dy = ((const float4 *)dout)[r * C4 + c];
        const float4 x = ld_f4(inp, xbf, r * C4 + c);
        const double rs = rstd[r];
        acc[0] = dw_term(acc[0], dy.x, x.x, rs), acc[1] = dw_term(acc[1], dy.y, x.y, rs);
        acc[2] = dw_term(acc[2], dy.z, x.z, rs), acc[3] = dw_term(acc[3], dy.w, x.w, rs);
    }
#pragma unroll
    for (int e = 0; e < 4; e++)
        partial[chunk * C + 4 * c + e] = acc[e];
}

/* Kernel 3: a block per DWR_COLS columns adds their chunk partials in chunk order. Every thread
 * loads DWR_PER partials of a tile of DWR_ROWS chunks into registers (DWR_COLS · 8 = 128 contiguous
 * bytes a chunk row), parks them in shared memory, and fetches the next tile while the first
 * DWR_COLS threads add the parked one, chunk by chunk, each into its column. So the order of the
 * additions is thread-per-column's, while the loads are all in flight: the head norms' 2048
 * chunks of 128 columns took 112 µs as one block of 128 threads each walking its column. */
#define DWR_COLS    16
#define DWR_THREADS 512
#define DWR_PER     4
#define DWR_ROWS    (DWR_THREADS * DWR_PER / DWR_COLS)

static __global__ void __launch_bounds__(DWR_THREADS)
    rmsnorm_bwd_dw_reduce_kernel(float *dw, const double *partial, int64_t n_chunks, int64_t C) {
    __shared__ double tile[DWR_ROWS][DWR_COLS];
    const int         lc = threadIdx.x % DWR_COLS, lr = threadIdx.x / DWR_COLS;
    const int64_t     c = (int64_t)blockIdx.x * DWR_COLS + lc;
    double            pre[DWR_PER];
    auto              fetch = [&](int64_t k0) {
#pragma unroll
        for (int j = 0; j < DWR_PER; j++) {
            const int64_t k = k0 + lr + j * (DWR_THREADS / DWR_COLS);
            pre[j] = c < C && k < n_chunks ? partial[k * C + c] : 0.0;
        }
    };
    double acc = 0;
    fetch(0);
    for (int64_t k0 = 0; k0 < n_chunks; k0 += DWR_ROWS) {
#pragma unroll
        for (int j = 0; j < DWR_PER; j++)
            tile[lr + j * (DWR_THREADS / DWR_COLS)][lc] = pre[j];
        __syncthreads();
        if (k0 + DWR_ROWS < n_chunks)
            fetch(k0 + DWR_ROWS);
        if (threadIdx.x < DWR_COLS) {
            const int n = n_chunks - k0 < DWR_ROWS ? (int)(n_chunks - k0) : DWR_ROWS;
            for (int k = 0; k < n; k++)
                acc += tile[k][lc];
        }
        __syncthreads();
    }
    if (threadIdx.x < DWR_COLS && c < C)
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
    const int     vec = C % 4 == 0 && (uintptr_t)dout % 16 == 0 && (uintptr_t)x % (xbf ? 8 : 16) == 0;
    const int64_t nt = vec ? C / 4 : C; /* threads per chunk */
    const int     block = nt < 128 ? (int)((nt + 31) / 32 * 32) : 128;
    dim3          pg((unsigned int)((nt + block - 1) / block), (unsigned int)n_chunks);
    rmsnorm_bwd_dw_partial_kernel<<<pg, block, 0, ctx->stream>>>(partial, rstd, dout, x, xbf, rows, C, vec);
    KN_CUDA_LAUNCHED(ctx);
    rmsnorm_bwd_dw_reduce_kernel<<<(unsigned int)((C + DWR_COLS - 1) / DWR_COLS), DWR_THREADS, 0,
                                   ctx->stream>>>(dw, partial, n_chunks, C);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int V, bool XBF>
static void dx_vec_launch(kn_ctx *ctx, unsigned int grid, int block, const kn_norm_bwd_typed_params *p,
                          double *rstd) {
    rmsnorm_bwd_dx_vec_kernel<V, XBF>
        <<<grid, block, 0, ctx->stream>>>(p->dinp, (__nv_bfloat16 *)p->dinp_bf16, rstd, p->dout, p->x, p->w,
                                          p->rows, p->C, p->eps, p->one_plus ? 1 : 0, p->accumulate ? 1 : 0);
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
    const unsigned int grid = (unsigned int)(rows < (1 << 20) ? rows : (1 << 20));
    const int64_t      C4 = C / 4;
    __nv_bfloat16     *db = (__nv_bfloat16 *)p->dinp_bf16;
    const int          one = p->one_plus ? 1 : 0, acc = p->accumulate ? 1 : 0;
    if (C % 4 == 0 && C4 <= 4 * NORM_BWD_VEC &&
        ((uintptr_t)p->dinp | (uintptr_t)p->dout | (uintptr_t)p->w) % 16 == 0 && (uintptr_t)db % 8 == 0 &&
        (uintptr_t)p->x % (xbf ? 8 : 16) == 0) {
        int       block = 0;
        const int per = kn_norm_vec_shape(C4, &block);
        if (per == 4 && xbf)
            dx_vec_launch<4, true>(ctx, grid, block, p, rstd);
        else if (per == 4)
            dx_vec_launch<4, false>(ctx, grid, block, p, rstd);
        else if (xbf)
            dx_vec_launch<1, true>(ctx, grid, block, p, rstd);
        else
            dx_vec_launch<1, false>(ctx, grid, block, p, rstd);
    } else {
        rmsnorm_bwd_dx_kernel<<<grid, NORM_BWD_THREADS, 0, ctx->stream>>>(
            p->dinp, db, rstd, p->dout, p->x, xbf, p->w, rows, C, p->eps, one, acc);
    }
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
