/* kernels/kn_head_norm.cu — the drafter's q/k prep on typed storage and its backward.
 * head_norm_rope: every head row of x [T, nh, hd] (F32 or BF16) rmsnorm'ed with the plain w [hd]
 * and rotated by the NeoX rope into out (F32, or BF16 rounded once from that F32 value, as the
 * attention's operand): the chain widen, rmsnorm, rope (, cast2d) in one pass, reading the saved
 * BF16 projection where it is. One block per token (grid-stride): its threads put the
 * token's cos/sin into shared memory, then each warp takes one head row at a time through a shared
 * row buffer, as kn_qk_prep.cu does, with its numerics: the sum of squares, 1/sqrt and the scaled
 * output in double rounded once, the angle one float32 product (__fmul_rn), cos, sin and the
 * rotation in double with explicit _rn operations. out may equal x (same dtype): a warp reads its
 * whole row before it writes.
 * head_norm_rope_bwd: per head row, the gradient rotated back (sin negated) and stored back in
 * place, then rmsnorm's backward dx in double as kernel 1 of kn_norm_bwd.cu (the row's r kept),
 * stored as F32 or rounded once more to bf16 (the operand of the GEMMs that follow),
 * then dw by kn_norm_bwd.cu's deterministic chunked pass (kn_norm_int.h) over the T·nh rows: the
 * chain rope_bwd, widen, rmsnorm_bwd in two passes instead of four. Limits: hd ≤ 1024 (shared
 * memory ≤ 40 KiB); beyond, CM_ERR_UNSUPPORTED.
 * Fast path (the drafter's heads: hd = rot_dim = 128, F32 arrays 8-byte and BF16 ones 4-byte
 * aligned; the launchers pick it, every other shape keeps the kernels above). The general kernels
 * are latency-bound there (a barrier pair per token, scalar 4-byte accesses, a dependent double
 * reduction per row) at ~5x the time their bytes need. One warp takes one token and all its nh
 * head rows, HN_FAST_ROWS at a time in flight. Lane l owns the rotation pairs 2l and 2l + 1, so
 * the elements 2l, 2l + 1 and 64 + 2l, 64 + 2l + 1 of every row: both partners of a pair are in
 * its registers (no shared row buffer, no barrier, no shuffle for the rotation), each half row is
 * one coalesced 8-byte (F32) or 4-byte (BF16) access per lane, and a lane reads and writes only its
 * own elements, which makes out == x safe. The lane's 2 cos/sin are computed once per token and
 * reused over its nh rows (2 double sincos per lane per token; redone per row they would nearly
 * double the kernel's fp64 work, which with the fp64 conversions is what bounds it after the
 * bytes). The 4 rows' sums are reduced together (warp_sum4: the lanes 8r..8r+7 end with row r's,
 * 1/sqrt computed once per lane and shuffled out), which halves the shuffles and quarters the
 * divisions. The operations are the general kernels', in the same order, with the
 * same roundings: the results are theirs bit for bit except where the order of a row's double
 * sums (its sum of squares, the bwd's Σ dy·w·x) changes the last bit of rstd. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"
#include "kn_norm_int.h"
#include "kn_rope_int.h"

#define HN_MAX_HD 1024
#define HN_WARPS  8

#define HN_FAST_HD    128 /* head_dim = rot_dim of the fast path: 32 lanes × 2 pairs */
#define HN_FAST_ROWS  4   /* head rows a warp has in flight; warp_sum4 is written for 4 */
#define HN_FAST_WARPS 8

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

static __global__ void head_norm_rope_kernel(void *out, int obf, const void *x, int xbf, const float *w,
                                             const int32_t *pos, int64_t T, int nh, int hd, int half,
                                             float eps, const kn_rope_freqs freqs) {
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
                    st_f(out, obf, o + c, (float)__dsub_rn(__dmul_rn(x1, cs[c]), __dmul_rn(x2, sn[c])));
                    st_f(out, obf, o + c + half,
                         (float)__dadd_rn(__dmul_rn(x2, cs[c]), __dmul_rn(x1, sn[c])));
                } else if (c >= 2 * half) {
                    st_f(out, obf, o + c, buf[c]);
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
// fast path: hd = rot_dim = 128, one warp per token, lane l owning pairs 2l and 2l + 1

/* This lane's 2 elements at x + i (i even): one 8-byte F32 or 4-byte BF16 load. */
template <bool BF> static __device__ __forceinline__ void ld2(float v[2], const void *x, int64_t i) {
    if (BF) {
        const uint32_t u = *(const uint32_t *)((const uint16_t *)x + i); /* element i in the low half */
        v[0] = __uint_as_float(u << 16), v[1] = __uint_as_float(u & 0xffff0000u);
    } else {
        const float2 f = *(const float2 *)((const float *)x + i);
        v[0] = f.x, v[1] = f.y;
    }
}

/* a, b to p + i, p + i + 1 as F32 or (bf) each rounded once to bf16, one vector store. */
static __device__ __forceinline__ void st2(void *p, int bf, int64_t i, float a, float b) {
    if (bf)
        *(__nv_bfloat162 *)((__nv_bfloat16 *)p + i) = __floats2bfloat162_rn(a, b);
    else
        *(float2 *)((float *)p + i) = make_float2(a, b);
}

/* The warp's totals of 4 rows' partial sums a[r], transposed: the lane gets row (lane >> 3)'s (lanes
 * 8r..8r+7 hold row r's). The halves trade rows at each of the first two steps, so the 4 rows take
 * 6 double shuffles and additions instead of 4 butterflies of 5, and each lane then has one row's
 * 1/sqrt to compute instead of 4. */
static __device__ __forceinline__ double warp_sum4(const double a[4], int lane) {
    const int    b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1;
    const double c0 = (b4 ? a[2] : a[0]) + __shfl_xor_sync(0xffffffffu, b4 ? a[0] : a[2], 16);
    const double c1 = (b4 ? a[3] : a[1]) + __shfl_xor_sync(0xffffffffu, b4 ? a[1] : a[3], 16);
    double       c = (b3 ? c1 : c0) + __shfl_xor_sync(0xffffffffu, b3 ? c0 : c1, 8);
    for (int o = 4; o > 0; o >>= 1)
        c += __shfl_xor_sync(0xffffffffu, c, o);
    return c;
}

/* The lane's constants: w at its elements 2l + j, 64 + 2l + j (wd[j], wd[2 + j]) widened, and the
 * frequencies of its pairs 2l, 2l + 1. */
static __device__ __forceinline__ void lane_consts(double wd[4], float inv[2], const float *w,
                                                   const kn_rope_freqs &freqs, int lane) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        wd[j] = (double)w[2 * lane + j];
        wd[2 + j] = (double)w[HN_FAST_HD / 2 + 2 * lane + j];
        inv[j] = freqs.inv[2 * lane + j];
    }
}

/* cos and sin of the lane's 2 pairs at position p (sin negated for rope_bwd, as the general
 * kernel's s = -sn[c]). */
static __device__ __forceinline__ void lane_angles(double cs[2], double sn[2], int32_t p, const float inv[2],
                                                   int neg) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        sincos((double)__fmul_rn((float)p, inv[j]), &sn[j], &cs[j]);
        sn[j] = neg ? -sn[j] : sn[j];
    }
}

/* The fast kernels' walk: f(row0, nr, cs, sn, wd) for each group of up to HN_FAST_ROWS head rows
 * of the warp's tokens (one token per warp, grid-stride): row0 the group's first row (t·nh + h0),
 * nr its rows inside nh, cs and sn the cos and sin (sin negated when neg) of the lane's pairs at
 * the token's position, wd w at the lane's elements. */
template <typename F>
static __device__ __forceinline__ void fast_rows(const float *w, const int32_t *pos, int64_t T, int nh,
                                                 const kn_rope_freqs &freqs, int neg, F &&f) {
    double wd[4];
    float  inv[2];
    lane_consts(wd, inv, w, freqs, threadIdx.x & 31);
    const int64_t nw = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < T; t += nw) {
        double cs[2], sn[2];
        lane_angles(cs, sn, pos[t], inv, neg);
        for (int h0 = 0; h0 < nh; h0 += HN_FAST_ROWS)
            f(t * nh + h0, nh - h0 < HN_FAST_ROWS ? nh - h0 : HN_FAST_ROWS, cs, sn, wd);
    }
}

template <bool XBF>
static __global__ void __launch_bounds__(32 * HN_FAST_WARPS)
    head_norm_rope_fast_kernel(void *out, int obf, const void *x, const float *w, const int32_t *pos,
                               int64_t T, int nh, float eps, const kn_rope_freqs freqs) {
    const int lane = threadIdx.x & 31;
    fast_rows(w, pos, T, nh, freqs, 0,
              [&](int64_t row0, int nr, const double *cs, const double *sn, const double *wd) {
                  const int64_t o = row0 * HN_FAST_HD + 2 * lane;
                  float         v[HN_FAST_ROWS][4] = {};
                  double        ss[HN_FAST_ROWS];
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++)
                      if (r < nr) { /* rows past nh stay 0: the shuffles below run on the whole warp */
                          ld2<XBF>(v[r], x, o + r * HN_FAST_HD);
                          ld2<XBF>(v[r] + 2, x, o + r * HN_FAST_HD + HN_FAST_HD / 2);
                      }
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++) {
                      ss[r] = 0;
#pragma unroll
                      for (int k = 0; k < 4; k++)
                          ss[r] += (double)v[r][k] * (double)v[r][k];
                  }
                  const double rl = 1.0 / sqrt(warp_sum4(ss, lane) / (double)HN_FAST_HD + (double)eps);
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++) {
                      const double rstd = __shfl_sync(0xffffffffu, rl, 8 * r);
                      double       n[4];
                      float        y[4];
#pragma unroll
                      for (int k = 0; k < 4; k++)
                          n[k] = (double)(float)__dmul_rn(__dmul_rn((double)v[r][k], rstd), wd[k]);
#pragma unroll
                      for (int j = 0; j < 2; j++) { /* x1 = n[j], x2 = n[2 + j] */
                          y[j] = (float)__dsub_rn(__dmul_rn(n[j], cs[j]), __dmul_rn(n[2 + j], sn[j]));
                          y[2 + j] = (float)__dadd_rn(__dmul_rn(n[2 + j], cs[j]), __dmul_rn(n[j], sn[j]));
                      }
                      if (r < nr) {
                          st2(out, obf, o + r * HN_FAST_HD, y[0], y[1]);
                          st2(out, obf, o + r * HN_FAST_HD + HN_FAST_HD / 2, y[2], y[3]);
                      }
                  }
              });
}

template <bool XBF>
static __global__ void __launch_bounds__(32 * HN_FAST_WARPS)
    head_norm_rope_bwd_fast_kernel(void *dinp, int dbf, double *rstd, float *dout, const void *x,
                                   const float *w, const int32_t *pos, int64_t T, int nh, float eps,
                                   const kn_rope_freqs freqs) {
    const int lane = threadIdx.x & 31;
    fast_rows(w, pos, T, nh, freqs, 1,
              [&](int64_t row0, int nr, const double *cs, const double *s, const double *wd) {
                  const int64_t o = row0 * HN_FAST_HD + 2 * lane;
                  float         dv[HN_FAST_ROWS][4] = {}, xv[HN_FAST_ROWS][4] = {}, v[HN_FAST_ROWS][4];
                  double        ss[HN_FAST_ROWS], g[HN_FAST_ROWS];
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++)
                      if (r < nr) {
                          ld2<false>(dv[r], dout, o + r * HN_FAST_HD);
                          ld2<false>(dv[r] + 2, dout, o + r * HN_FAST_HD + HN_FAST_HD / 2);
                          ld2<XBF>(xv[r], x, o + r * HN_FAST_HD);
                          ld2<XBF>(xv[r] + 2, x, o + r * HN_FAST_HD + HN_FAST_HD / 2);
                      }
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++) {
#pragma unroll
                      for (int j = 0; j < 2; j++) { /* rope_bwd's rotation: d1 = dv[j], d2 = dv[2 + j] */
                          const double d1 = dv[r][j], d2 = dv[r][2 + j];
                          v[r][j] = (float)__dsub_rn(__dmul_rn(d1, cs[j]), __dmul_rn(d2, s[j]));
                          v[r][2 + j] = (float)__dadd_rn(__dmul_rn(d2, cs[j]), __dmul_rn(d1, s[j]));
                      }
                      if (r < nr) { /* the dw pass reads the rotated gradient */
                          st2(dout, 0, o + r * HN_FAST_HD, v[r][0], v[r][1]);
                          st2(dout, 0, o + r * HN_FAST_HD + HN_FAST_HD / 2, v[r][2], v[r][3]);
                      }
                      ss[r] = 0, g[r] = 0;
#pragma unroll
                      for (int k = 0; k < 4; k++) {
                          const double xd = (double)xv[r][k];
                          ss[r] += xd * xd;
                          g[r] += (double)v[r][k] * wd[k] * xd;
                      }
                  }
                  const double rl = 1.0 / sqrt(warp_sum4(ss, lane) / (double)HN_FAST_HD + (double)eps);
                  const double kl = rl * rl * rl / (double)HN_FAST_HD * warp_sum4(g, lane);
                  if ((lane & 7) == 0 && (lane >> 3) < nr)
                      rstd[row0 + (lane >> 3)] = rl;
#pragma unroll
                  for (int r = 0; r < HN_FAST_ROWS; r++) {
                      const double rs = __shfl_sync(0xffffffffu, rl, 8 * r),
                                   kr = __shfl_sync(0xffffffffu, kl, 8 * r);
                      float dx[4];
#pragma unroll
                      for (int k = 0; k < 4; k++)
                          dx[k] = (float)(rs * wd[k] * (double)v[r][k] - (double)xv[r][k] * kr);
                      if (r < nr) {
                          st2(dinp, dbf, o + r * HN_FAST_HD, dx[0], dx[1]);
                          st2(dinp, dbf, o + r * HN_FAST_HD + HN_FAST_HD / 2, dx[2], dx[3]);
                      }
                  }
              });
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

/* Whether the fast path takes the call: its shape, and each typed array (bf: BF16) aligned for the
 * lanes' 2-element vector accesses (8 bytes F32, 4 BF16; rows are 128 elements). */
static int head_fast(int hd, int rot_dim) {
    return hd == HN_FAST_HD && rot_dim == HN_FAST_HD;
}

static int vec_aligned(const void *p, int bf) {
    return ((uintptr_t)p & (bf ? 3u : 7u)) == 0;
}

/* Blocks of HN_FAST_WARPS warps, one token per warp (grid-stride beyond 2^20 blocks). */
static unsigned int fast_blocks(int64_t T) {
    const int64_t b = (T + HN_FAST_WARPS - 1) / HN_FAST_WARPS;
    return (unsigned int)(b < (1 << 20) ? b : (1 << 20));
}

cm_status kn_cuda_head_norm_rope(kn_ctx *ctx, void *out, cm_dtype out_dt, const void *x, cm_dtype x_dt,
                                 const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rot_dim,
                                 float theta, float eps) {
    CM_TRY(head_check(ctx, "head_norm_rope", x_dt, T, nh, hd, rot_dim, theta, eps));
    KN_CUDA_CHECK_ARG(out_dt == CM_DTYPE_F32 || out_dt == CM_DTYPE_BF16,
                      "head_norm_rope: out in %s is not supported (F32 or BF16)", cm_dtype_name(out_dt));
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && w && pos, "head_norm_rope: out, x, w or pos is NULL");
    KN_CUDA_CHECK_ARG(out != x || out_dt == x_dt, "head_norm_rope: out may equal x only in the same dtype");
    const int     half = rot_dim / 2;
    kn_rope_freqs freqs;
    kn_rope_freqs_fill(&freqs, rot_dim, theta);
    const int xbf = x_dt == CM_DTYPE_BF16, obf = out_dt == CM_DTYPE_BF16;
    if (head_fast(hd, rot_dim) && vec_aligned(out, obf) && vec_aligned(x, xbf)) {
        if (xbf)
            head_norm_rope_fast_kernel<true><<<fast_blocks(T), 32 * HN_FAST_WARPS, 0, ctx->stream>>>(
                out, obf, x, w, pos, T, nh, eps, freqs);
        else
            head_norm_rope_fast_kernel<false><<<fast_blocks(T), 32 * HN_FAST_WARPS, 0, ctx->stream>>>(
                out, obf, x, w, pos, T, nh, eps, freqs);
        KN_CUDA_LAUNCHED(ctx);
        return CM_OK;
    }
    const int64_t blocks = T < (1 << 20) ? T : (1 << 20);
    head_norm_rope_kernel<<<(unsigned int)blocks, 32 * head_warps(nh), head_smem(nh, hd, half),
                            ctx->stream>>>(out, obf, x, xbf, w, pos, T, nh, hd, half, eps, freqs);
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
    const int dbf = dinp_dt == CM_DTYPE_BF16;
    if (head_fast(hd, rot_dim) && vec_aligned(dinp, dbf) && vec_aligned(dout, 0) && vec_aligned(x, xbf)) {
        if (xbf)
            head_norm_rope_bwd_fast_kernel<true><<<fast_blocks(T), 32 * HN_FAST_WARPS, 0, ctx->stream>>>(
                dinp, dbf, rstd, dout, x, w, pos, T, nh, eps, freqs);
        else
            head_norm_rope_bwd_fast_kernel<false><<<fast_blocks(T), 32 * HN_FAST_WARPS, 0, ctx->stream>>>(
                dinp, dbf, rstd, dout, x, w, pos, T, nh, eps, freqs);
        KN_CUDA_LAUNCHED(ctx);
        return kn_cuda_norm_bwd_dw(ctx, dw, rstd, partial, dout, x, xbf, rows, hd);
    }
    const int64_t blocks = T < (1 << 20) ? T : (1 << 20);
    head_norm_rope_bwd_kernel<<<(unsigned int)blocks, 32 * head_warps(nh), head_smem(nh, hd, half),
                                ctx->stream>>>(dinp, dbf, rstd, dout, x, xbf, w, pos, T, nh, hd, half, eps,
                                               freqs);
    KN_CUDA_LAUNCHED(ctx);
    return kn_cuda_norm_bwd_dw(ctx, dw, rstd, partial, dout, x, xbf, rows, hd);
}
