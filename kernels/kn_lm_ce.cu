/* kernels/kn_lm_ce.cu — fused LM head + cross-entropy (kn_backend.h lm_ce) without ever
 * holding [R, V] logits. Rows go in tiles of at most LMCE_ROWS; the vocabulary in chunks of
 * Vc columns with Rt·Vc ≤ LMCE_CHUNK_FLOATS, so the only logits in memory are one
 * [Rt, Vc] chunk (F32, in the ctx scratch). One pass per row tile, per chunk:
 *   logits = h·W[v0:v0+Vc]ᵀ (cuBLASLt), then one block per row merges the chunk into the
 *     row's running max, Σexp (double) and argmax (lowest index on ties: a later chunk wins
 *     only with a strictly larger logit) and picks up the label's logit;
 *   when dh is asked for: the chunk becomes exp(logit − m_ref) (m_ref: a per-row shift,
 *     moved to the chunk's max only when that exceeds it by more than LMCE_SHIFT, so the
 *     coefficients stay ≤ e^LMCE_SHIFT and rows rarely need rescaling), the rows whose shift
 *     moved have their dh sum rescaled by exp(m_old − m_new), and dh (+)= coef · W[v0:v0+Vc]
 *     (cuBLASLt, beta 0 for the first chunk, 1 after), summed over the chunks in order.
 * After the last chunk ce = max + log Σ − logit[label] and lse are written, and
 *   dh = gscale · (dh · exp(m_ref − lse) − W[label])   (= gscale · (softmax − onehot) · W).
 * Two GEMMs per chunk: the logits are never recomputed. W is frozen: no gradient for it.
 * GEMM precision follows ctx->gemm_mode as gemm does (BF16: h, F32 weights and the
 * coefficients rounded to bf16; F32: fp32 operands, BF16 weights widened). Every reduction
 * has a fixed order, so results are reproducible. Labels are device memory and not
 * validated here: a label outside [0, V), which the cpu reference refuses, gives ce = NaN
 * (the caller validates labels on the host; dt_model builds them from token ids it has
 * checked). */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>
#include <math.h>

#define LMCE_ROWS         2048
#define LMCE_CHUNK_FLOATS ((int64_t)16 << 20) /* 64 MiB of logits per chunk */
#define LMCE_THREADS      256
#define LMCE_SHIFT        8.0f /* the coefficient shift moves when a chunk's max exceeds it by this */

// ----------------------------------------------------------------------------
// kernels

typedef struct lmce_row {
    double  m, s; /* running max and Σ exp(logit − m) */
    float   lab;  /* logit of the label (NaN until seen) */
    int32_t amax; /* index of the running max */
    float   mref; /* the shift of dh's coefficients exp(logit − mref) */
} lmce_row;

static __global__ void lmce_init_kernel(lmce_row *st, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        st[i].m = -INFINITY;
        st[i].s = 0;
        st[i].lab = __int_as_float(0x7fc00000);
        st[i].amax = 0;
        st[i].mref = -INFINITY;
    }
}

/* One block per row of the tile: merges logits[r, 0:nc] (columns v0 + c) into st[r]. */
/* alpha[r] (when not NULL): the factor dh's running sum of row r takes before this chunk
 * is added (1 unless the row's shift moved). */
static __global__ void lmce_stats_kernel(lmce_row *st, float *alpha, const float *logits, int64_t ld,
                                         int64_t nc, int64_t v0, const int32_t *labels) {
    __shared__ float   smax[LMCE_THREADS / 32];
    __shared__ int64_t sidx[LMCE_THREADS / 32];
    __shared__ double  ssum[LMCE_THREADS / 32];
    const int64_t      r = blockIdx.x;
    const float       *lg = logits + r * ld;
    const int          lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    /* chunk max and its lowest index: per thread, then warps, then warp 0 */
    float   mx = -INFINITY;
    int64_t ix = 0x7fffffffffffffffll;
    for (int64_t c = threadIdx.x; c < nc; c += LMCE_THREADS)
        if (lg[c] > mx) { /* strided ascending: the first max a thread sees has its lowest index */
            mx = lg[c];
            ix = c;
        }
    for (int o = 16; o > 0; o >>= 1) {
        float   om = __shfl_xor_sync(0xffffffffu, mx, o);
        int64_t oi = __shfl_xor_sync(0xffffffffu, ix, o);
        if (om > mx || (om == mx && oi < ix)) {
            mx = om;
            ix = oi;
        }
    }
    if (lane == 0) {
        smax[warp] = mx;
        sidx[warp] = ix;
    }
    __syncthreads();
    mx = smax[0];
    ix = sidx[0];
    for (int w = 1; w < LMCE_THREADS / 32; w++)
        if (smax[w] > mx || (smax[w] == mx && sidx[w] < ix)) {
            mx = smax[w];
            ix = sidx[w];
        }
    /* Σ exp(logit − chunk max) in double, fixed tree */
    double s = 0;
    for (int64_t c = threadIdx.x; c < nc; c += LMCE_THREADS)
        s += (double)expf(lg[c] - mx);
    s = warp_sum(s);
    if (lane == 0)
        ssum[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double cs = 0;
        for (int w = 0; w < LMCE_THREADS / 32; w++)
            cs += ssum[w];
        lmce_row    *row = &st[r];
        const double cm = (double)mx, m_new = row->m > cm ? row->m : cm;
        row->s = row->s * exp(row->m - m_new) + cs * exp(cm - m_new);
        if (cm > row->m) /* strictly: on a tie the earlier chunk's (lower) index stays */
            row->amax = (int32_t)(v0 + ix);
        row->m = m_new;
        if (alpha) {
            float a = 1.0f;
            if (row->mref == -INFINITY || mx > row->mref + LMCE_SHIFT) {
                a = row->mref == -INFINITY ? 0.0f : expf(row->mref - mx);
                row->mref = mx;
            }
            alpha[r] = a;
        }
        const int64_t lab = labels[r];
        if (lab >= v0 && lab < v0 + nc)
            row->lab = lg[lab - v0];
    }
}

static __global__ void lmce_finish_kernel(float *ce, int32_t *argmax, float *lse, const lmce_row *st,
                                          int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const double l = st[i].m + log(st[i].s);
        lse[i] = (float)l;
        ce[i] = (float)(l - (double)st[i].lab);
        argmax[i] = st[i].amax;
    }
}

/* logits[r, c] → exp(logit − mref[r]), in place (F32) or into coef16 (bf16) when it is not
 * NULL. */
static __global__ void lmce_coef_kernel(float *logits, uint16_t *coef16, int64_t ld, int64_t rows, int64_t nc,
                                        const lmce_row *st) {
    const int64_t n = rows * nc, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t r = i / nc, c = i % nc;
        const float   cf = expf(logits[r * ld + c] - st[r].mref);
        if (coef16) {
            __nv_bfloat16 b = __float2bfloat16_rn(cf);
            coef16[r * ld + c] = *(uint16_t *)&b;
        } else {
            logits[r * ld + c] = cf;
        }
    }
}

/* dh[r, :] *= alpha[r] for the rows whose shift moved; one block per row. */
static __global__ void lmce_rescale_kernel(float *dh, int64_t D, const float *alpha) {
    const float a = alpha[blockIdx.x];
    if (a == 1.0f)
        return;
    float *row = dh + (int64_t)blockIdx.x * D;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
        row[i] *= a;
}

/* dh[r, :] = gscale[r] · (dh[r, :] · exp(mref − lse) − W[label, :]); one block per row.
 * W[label] is rounded as the GEMM saw it (round16: bf16 operands), so a row whose softmax is
 * one-hot at its label gets dh = 0 exactly, as the reference does. */
static __global__ void lmce_dh_finish_kernel(float *dh, int64_t D, const lmce_row *st, const float *lse,
                                             const int32_t *labels, const float *gscale, const void *w,
                                             int w_bf16, int round16, int64_t V) {
    const int64_t r = blockIdx.x, lab = labels[r];
    const float   f = expf(st[r].mref - lse[r]), gs = gscale[r];
    float        *row = dh + r * D;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
        float wl = 0.0f; /* a label outside [0, V) already gave ce = NaN */
        if (lab >= 0 && lab < V)
            wl = w_bf16 ? __bfloat162float(((const __nv_bfloat16 *)w)[lab * D + i])
                        : ((const float *)w)[lab * D + i];
        if (round16)
            wl = __bfloat162float(__float2bfloat16_rn(wl));
        row[i] = gs * (row[i] * f - wl);
    }
}

// ----------------------------------------------------------------------------
// launchers

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

static unsigned int grid_for(int64_t n, int threads) {
    int64_t blocks = (n + threads - 1) / threads;
    return (unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20));
}

cm_status kn_cuda_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h,
                        const int32_t *labels, const float *gscale, const void *w, cm_dtype wdt, int64_t R,
                        int64_t V, int64_t D) {
    KN_CUDA_CHECK_ARG(ctx, "lm_ce: ctx is NULL");
    KN_CUDA_CHECK_ARG(R >= 0 && V > 0 && D > 0,
                      "lm_ce: bad shape R=%lld V=%lld D=%lld (R >= 0, V > 0, D > 0)", (long long)R,
                      (long long)V, (long long)D);
    KN_CUDA_CHECK_ARG(V <= INT32_MAX, "lm_ce: V=%lld does not fit the I32 argmax", (long long)V);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "lm_ce: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (R == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(ce && argmax && h && labels && w, "lm_ce: ce, argmax, h, labels or w is NULL");
    KN_CUDA_CHECK_ARG(!dh || gscale, "lm_ce: gscale is NULL but dh is requested");

    const int     bf16 = ctx->gemm_mode == KN_GEMM_MODE_BF16;
    const int64_t Rt = R < LMCE_ROWS ? R : LMCE_ROWS;
    int64_t       Vc = LMCE_CHUNK_FLOATS / Rt;
    Vc =
        Vc < V ? Vc / 8 * 8 : V; /* whole chunks of 8 keep the chunk pointers 16-byte aligned when D allows */
    /* W chunk operand: converted when its dtype is not the mode's */
    const int    conv_w = bf16 ? wdt == CM_DTYPE_F32 : wdt == CM_DTYPE_BF16;
    const size_t esz = bf16 ? 2 : 4;
    const size_t sz_logits = round_up_256((size_t)(Rt * Vc) * 4);
    const size_t sz_coef16 = bf16 && dh ? round_up_256((size_t)(Rt * Vc) * 2) : 0;
    const size_t sz_h16 = bf16 ? round_up_256((size_t)(Rt * D) * 2) : 0;
    const size_t sz_w = conv_w ? round_up_256((size_t)(Vc * D) * esz) : 0;
    const size_t sz_st = round_up_256((size_t)Rt * sizeof(lmce_row));
    const size_t sz_lse = round_up_256((size_t)Rt * 4);
    CM_TRY(kn_cuda_scratch_reserve(ctx, sz_logits + sz_coef16 + sz_h16 + sz_w + sz_st + 2 * sz_lse));
    char     *base = (char *)ctx->scratch;
    float    *logits = (float *)base;
    uint16_t *coef16 = sz_coef16 ? (uint16_t *)(base + sz_logits) : NULL;
    void     *h16 = base + sz_logits + sz_coef16;
    void     *wbuf = base + sz_logits + sz_coef16 + sz_h16;
    lmce_row *st = (lmce_row *)(base + sz_logits + sz_coef16 + sz_h16 + sz_w);
    float    *lse = (float *)(base + sz_logits + sz_coef16 + sz_h16 + sz_w + sz_st);
    float    *alpha = dh ? (float *)(base + sz_logits + sz_coef16 + sz_h16 + sz_w + sz_st + sz_lse) : NULL;
    const cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;

    for (int64_t r0 = 0; r0 < R; r0 += Rt) {
        const int64_t nr = R - r0 < Rt ? R - r0 : Rt;
        const void   *h_op = h + r0 * D;
        if (bf16) {
            CM_TRY(kn_cuda_f32_to_bf16(ctx, h16, h + r0 * D, nr * D));
            h_op = h16;
        }
        lmce_init_kernel<<<grid_for(nr, 256), 256, 0, ctx->stream>>>(st, nr);
        KN_CUDA_LAUNCHED(ctx);
        for (int64_t v0 = 0; v0 < V; v0 += Vc) {
            const int64_t nc = V - v0 < Vc ? V - v0 : Vc;
            const void   *w_op = (const char *)w + (size_t)(v0 * D) * cm_dtype_size(wdt);
            if (conv_w) {
                if (bf16)
                    CM_TRY(kn_cuda_f32_to_bf16(ctx, wbuf, (const float *)w_op, nc * D));
                else
                    CM_TRY(kn_cuda_bf16_to_f32(ctx, (float *)wbuf, w_op, nc * D));
                w_op = wbuf;
            }
            /* logitsᵀ (nc×nr col-major, ld Vc) = W_chunk (stored D×nc, op T) · hᵀ (D×nr) */
            CM_TRY(kn_cuda_lt_matmul(ctx, "lm_ce", ab, 1, 0, nc, nr, D, w_op, D, h_op, D, 0.0f, logits, Vc));
            lmce_stats_kernel<<<(unsigned int)nr, LMCE_THREADS, 0, ctx->stream>>>(st, alpha, logits, Vc, nc,
                                                                                  v0, labels + r0);
            KN_CUDA_LAUNCHED(ctx);
            if (!dh)
                continue;
            lmce_coef_kernel<<<grid_for(nr * nc, 256), 256, 0, ctx->stream>>>(logits, coef16, Vc, nr, nc, st);
            KN_CUDA_LAUNCHED(ctx);
            if (v0 > 0) {
                lmce_rescale_kernel<<<(unsigned int)nr, 256, 0, ctx->stream>>>(dh + r0 * D, D, alpha);
                KN_CUDA_LAUNCHED(ctx);
            }
            /* dhᵀ (D×nr, ld D) (+)= W_chunk (stored D×nc, op N) · coefᵀ (nc×nr, ld Vc) */
            const void *c_op = coef16 ? (const void *)coef16 : (const void *)logits;
            CM_TRY(kn_cuda_lt_matmul(ctx, "lm_ce", ab, 0, 0, D, nr, nc, w_op, D, c_op, Vc,
                                     v0 == 0 ? 0.0f : 1.0f, dh + r0 * D, D));
        }
        lmce_finish_kernel<<<grid_for(nr, 256), 256, 0, ctx->stream>>>(ce + r0, argmax + r0, lse, st, nr);
        KN_CUDA_LAUNCHED(ctx);
        if (dh) {
            lmce_dh_finish_kernel<<<(unsigned int)nr, 256, 0, ctx->stream>>>(
                dh + r0 * D, D, st, lse, labels + r0, gscale + r0, w, wdt == CM_DTYPE_BF16, bf16, V);
            KN_CUDA_LAUNCHED(ctx);
        }
    }
    return CM_OK;
}
