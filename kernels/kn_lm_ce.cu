/* kernels/kn_lm_ce.cu — fused LM head + cross-entropy (kn_backend.h lm_ce) without ever
 * holding [R, V] logits. Rows go in tiles of at most LMCE_ROWS; the vocabulary in chunks of
 * Vc columns with Rt·Vc ≤ LMCE_CHUNK_FLOATS, so the only logits in memory are one
 * [Rt, Vc] chunk (F32, in the ctx scratch). One pass per row tile, per chunk:
 *   logits = h·W[v0:v0+Vc]ᵀ (cuBLASLt), then one block per row merges the chunk into the
 *     row's running max, Σexp (double) and argmax (lowest index on ties: a later chunk wins
 *     only with a strictly larger logit) and picks up the label's logit; the block stages its
 *     row in shared memory when it fits (all its loads in flight at once, five blocks an SM;
 *     reading global memory on each pass it was latency bound at 1.7 TB/s, and holding the row
 *     in registers left two blocks an SM);
 *   when dh is asked for: the same kernel then turns the row into exp(logit − m_ref) (m_ref: a per-row shift,
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
 * checked).
 * lm_ce_topk runs the same pass (lm_ce's outputs bit for bit) and keeps, per row, the running
 * top-K of the fp32 logits (larger first, then lower index) in its outputs topk_val/topk_idx,
 * merged in by the stats kernel: each thread keeps the best KMAX (K rounded up to 4, 8, 16, 32
 * or 64) of its strided columns in registers, taking only logits that beat the row's K-th
 * entry so far (after the first chunk almost none do, so the later chunks cost a compare per
 * logit); K rounds of a block arg-best (one barrier each, stopping when no candidate is left)
 * pull the chunk's top-K out of those lists; a rank merge (each entry's place = its own rank
 * + the entries of the other list that beat it) joins it with the row's list. Exact (the
 * order is total: indices differ) and deterministic; no extra memory. The label's logit is
 * the one the stats kernel picks up for ce. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>
#include <math.h>

/* At the Qwen3.6-27B drafter's 7680 selected rows on an H100 (bench_kn_drafter, one call):
 * 4096 rows and 128 MiB of logits 60.9-61.1 ms; 2048 rows (then tiled 2048, 2048, 2048, 1536)
 * and 64 MiB 61.2-62.7 ms; 4096 and 64 MiB 64.0-64.3 ms; 2048 tiled equally (4 x 1920) and
 * 64 MiB 67.5 ms. The bigger chunk costs 77 MB of scratch. */
#define LMCE_ROWS         4096
#define LMCE_CHUNK_FLOATS ((int64_t)32 << 20) /* 128 MiB of logits per chunk */
#define LMCE_THREADS      256
#define LMCE_SM_COLS      11264 /* rows up to 44 KB staged in shared memory (8768 above) */
#define LMCE_SHIFT        8.0f /* the coefficient shift moves when a chunk's max exceeds it by this */

// ----------------------------------------------------------------------------
// kernels

typedef struct lmce_row {
    double  m, s; /* running max and Σ exp(logit − m) */
    float   lab;  /* logit of the label (NaN until seen) */
    int32_t amax; /* index of the running max */
    float   mref; /* the shift of dh's coefficients exp(logit − mref) */
    int32_t tk_n; /* entries of the row's running top-K (lm_ce_topk) */
} lmce_row;

/* lm_ce_topk's outputs for the rows of one tile (K = 0: lm_ce, none). val/idx [rows, K] hold
 * each row's running top-K, sorted, its first tk_n entries valid, until the finish kernel. */
typedef struct lmce_topk {
    int      K;
    float   *val;
    int32_t *idx;
    float   *label_logit;
} lmce_topk;

#define TOPK_NONE 0x7fffffff /* the index of an empty slot; with −inf it loses to every logit */

static __global__ void lmce_init_kernel(lmce_row *st, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        st[i].m = -INFINITY;
        st[i].s = 0;
        st[i].lab = __int_as_float(0x7fc00000);
        st[i].amax = 0;
        st[i].mref = -INFINITY;
        st[i].tk_n = 0;
    }
}

/* The top-K order: a larger logit first, then the lower index. NaN is never better. */
static __device__ __forceinline__ bool topk_better(float a, int32_t ia, float b, int32_t ib) {
    return a > b || (a == b && ia < ib);
}

/* Inserts (x, xi) into the sorted list (a bubble pass, unrolled so the list stays in
 * registers); the last entry drops out. */
template <int KMAX>
static __device__ __forceinline__ void topk_insert(float (&lv)[KMAX], int32_t (&li)[KMAX], float x,
                                                   int32_t xi) {
#pragma unroll
    for (int j = 0; j < KMAX; j++)
        if (topk_better(x, xi, lv[j], li[j])) {
            const float   tv = lv[j];
            const int32_t ti = li[j];
            lv[j] = x;
            li[j] = xi;
            x = tv;
            xi = ti;
        }
}

template <int KMAX> static __device__ __forceinline__ void topk_pop(float (&lv)[KMAX], int32_t (&li)[KMAX]) {
#pragma unroll
    for (int j = 0; j + 1 < KMAX; j++) {
        lv[j] = lv[j + 1];
        li[j] = li[j + 1];
    }
    lv[KMAX - 1] = -INFINITY;
    li[KMAX - 1] = TOPK_NONE;
}

/* The chunk's top-K out of the threads' sorted lists lv/li, then merged with the row's list
 * val/idx (n_old entries, sorted) into its best min(K, n_old + n_new); *n_out takes the count.
 * Called by every thread of the block. Round k: each thread offers its head, the block's best
 * head (butterfly in each warp, then the 8 warp bests, read by every thread) is entry k, its
 * owner pops it; the warp bests are double-buffered, so one barrier per round suffices. */
template <int KMAX>
static __device__ void topk_merge(float (&lv)[KMAX], int32_t (&li)[KMAX], int K, int n_old, float *val,
                                  int32_t *idx, int32_t *n_out) {
    static_assert(2 * KMAX <= LMCE_THREADS, "the rank merge takes one thread per entry of both lists");
    __shared__ float   s_wv[2][LMCE_THREADS / 32];
    __shared__ int32_t s_wi[2][LMCE_THREADS / 32];
    __shared__ float   s_nv[KMAX], s_ov[KMAX];
    __shared__ int32_t s_ni[KMAX], s_oi[KMAX];
    const int          lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int                n_new = 0;
    for (; n_new < K; n_new++) {
        float   bv = lv[0];
        int32_t bi = li[0];
        for (int o = 16; o > 0; o >>= 1) {
            const float   ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (topk_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        const int b = n_new & 1;
        if (lane == 0) {
            s_wv[b][warp] = bv;
            s_wi[b][warp] = bi;
        }
        __syncthreads();
        bv = s_wv[b][0];
        bi = s_wi[b][0];
        for (int w = 1; w < LMCE_THREADS / 32; w++)
            if (topk_better(s_wv[b][w], s_wi[b][w], bv, bi)) {
                bv = s_wv[b][w];
                bi = s_wi[b][w];
            }
        if (bi == TOPK_NONE) /* no candidate left; every thread sees the same */
            break;
        if (li[0] == bi) /* the one thread whose column it is */
            topk_pop<KMAX>(lv, li);
        if (threadIdx.x == 0) {
            s_nv[n_new] = bv;
            s_ni[n_new] = bi;
        }
    }
    if (n_new == 0)
        return;
    for (int t = threadIdx.x; t < n_old; t += LMCE_THREADS) {
        s_ov[t] = val[t];
        s_oi[t] = idx[t];
    }
    __syncthreads();
    /* the chunk's indices all exceed the old ones, so the old entry wins a tie, as the order says */
    const int t = threadIdx.x;
    float     v = 0.0f;
    int32_t   i = 0;
    int       rank = K;
    if (t < n_old) {
        v = s_ov[t];
        i = s_oi[t];
        rank = t;
        for (int j = 0; j < n_new; j++)
            rank += topk_better(s_nv[j], s_ni[j], v, i);
    } else if (t >= KMAX && t < KMAX + n_new) {
        v = s_nv[t - KMAX];
        i = s_ni[t - KMAX];
        rank = t - KMAX;
        for (int j = 0; j < n_old; j++)
            rank += topk_better(s_ov[j], s_oi[j], v, i);
    }
    if (rank < K) {
        val[rank] = v;
        idx[rank] = i;
    }
    if (t == 0)
        *n_out = n_old + n_new < K ? n_old + n_new : K;
}

/* One block per row of the tile: merges logits[r, 0:nc] (columns v0 + c) into st[r]. */
/* alpha[r] (when not NULL, that is when dh is asked for): the factor dh's running sum of row r
 * takes before this chunk is added (1 unless the row's shift moved); then the row's coefficients
 * exp(logit − mref) are written, into coef16 (bf16) when it is not NULL, else over the logits, by
 * a last pass over the row this block has just read (it is in L1/L2: no separate kernel reads the
 * chunk from DRAM again). KMAX > 0 (lm_ce_topk, K ≤ KMAX): the chunk also goes into the row's
 * running top-K (tk). */
template <int KMAX, bool SM>
static __global__ void __launch_bounds__(LMCE_THREADS, (SM && KMAX == 0) ? 5 : 1)
    lmce_stats_kernel(lmce_row *st, float *alpha, float *logits, uint16_t *coef16, int64_t ld, int64_t nc,
                      int64_t v0, const int32_t *labels, lmce_topk tk) {
    extern __shared__ float4 lmce_row_smem[]; /* SM: the row, nc floats */
    __shared__ float         smax[LMCE_THREADS / 32];
    __shared__ int64_t       sidx[LMCE_THREADS / 32];
    __shared__ double        ssum[LMCE_THREADS / 32];
    __shared__ float         s_mref;
    const int64_t            r = blockIdx.x;
    float                   *lg = logits + r * ld;
    const int                lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    /* SM (nc ≤ LMCE_SM_COLS, the row 16-byte aligned): the row comes into shared memory by
     * 16-byte asynchronous copies, all in flight at once, and the three passes below read it
     * there; otherwise each pass reads global memory. Both visit the same columns in the same
     * order, so they give the same bits. */
    const float *x_src = lg;
    if constexpr (SM) {
        float *row = (float *)lmce_row_smem;
        for (int64_t i = threadIdx.x; 4 * i < nc; i += LMCE_THREADS) {
            const int64_t left = nc - 4 * i;
            cp_async16_n(row + 4 * i, lg + 4 * i, left >= 4 ? 16 : (int)(4 * left));
        }
        cp_commit();
        x_src = row;
    }
    /* the row's state and label, fetched while the copies fly */
    const int64_t lab = threadIdx.x == 0 ? labels[r] : 0;
    double        st_m = 0, st_s = 0;
    float         st_mref = 0;
    if (threadIdx.x == 0) {
        st_m = st[r].m;
        st_s = st[r].s;
        st_mref = st[r].mref;
    }
    /* top-K: this thread's best KMAX columns among those that beat the row's K-th entry (the
     * empty slot (−inf, TOPK_NONE) until the row has K), read before any barrier, that is
     * before this block's merge writes the list */
    float   lv[KMAX > 0 ? KMAX : 1], thr_v = -INFINITY;
    int32_t li[KMAX > 0 ? KMAX : 1], thr_i = TOPK_NONE;
    int     n_old = 0;
    if constexpr (KMAX > 0) {
#pragma unroll
        for (int j = 0; j < KMAX; j++) {
            lv[j] = -INFINITY;
            li[j] = TOPK_NONE;
        }
        n_old = st[r].tk_n;
        if (n_old == tk.K) {
            thr_v = tk.val[r * tk.K + tk.K - 1];
            thr_i = tk.idx[r * tk.K + tk.K - 1];
        }
    }
    if constexpr (SM) {
        cp_wait<0>();
        __syncthreads();
    }
    /* chunk max and its lowest index: per thread, then warps, then warp 0 */
    float   mx = -INFINITY;
    int64_t ix = 0x7fffffffffffffffll;
    for (int64_t c = threadIdx.x; c < nc; c += LMCE_THREADS) {
        const float x = x_src[c];
        if (x > mx) { /* strided ascending: the first max a thread sees has its lowest index */
            mx = x;
            ix = c;
        }
        if constexpr (KMAX > 0) {
            const int32_t xi = (int32_t)(v0 + c);
            if (topk_better(x, xi, thr_v, thr_i) && topk_better(x, xi, lv[KMAX - 1], li[KMAX - 1]))
                topk_insert<KMAX>(lv, li, x, xi);
        }
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
        s += (double)expf(x_src[c] - mx);
    s = warp_sum(s);
    if (lane == 0)
        ssum[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double cs = 0;
        for (int w = 0; w < LMCE_THREADS / 32; w++)
            cs += ssum[w];
        lmce_row    *row = &st[r];
        const double cm = (double)mx, m_new = st_m > cm ? st_m : cm;
        row->s = st_s * exp(st_m - m_new) + cs * exp(cm - m_new);
        if (cm > st_m) /* strictly: on a tie the earlier chunk's (lower) index stays */
            row->amax = (int32_t)(v0 + ix);
        row->m = m_new;
        float mref = st_mref;
        if (alpha) {
            float a = 1.0f;
            if (mref == -INFINITY || mx > mref + LMCE_SHIFT) {
                a = mref == -INFINITY ? 0.0f : expf(mref - mx);
                mref = mx;
                row->mref = mref;
            }
            alpha[r] = a;
        }
        s_mref = mref;
        if (lab >= v0 && lab < v0 + nc)
            row->lab = x_src[lab - v0];
    }
    if constexpr (KMAX > 0)
        topk_merge<KMAX>(lv, li, tk.K, n_old, tk.val + r * tk.K, tk.idx + r * tk.K, &st[r].tk_n);
    if (!alpha)
        return;
    __syncthreads(); /* thread 0 has moved the shift */
    const float mref = s_mref;
    int64_t     c0 = 0; /* SM: four columns a thread (16-byte reads, 8- or 16-byte stores), the rest below */
    if constexpr (SM) {
        const float4 *x4 = (const float4 *)x_src;
        for (int64_t c4 = threadIdx.x; 4 * c4 + 3 < nc; c4 += LMCE_THREADS) {
            const float4 x = x4[c4];
            const float4 cf =
                make_float4(expf(x.x - mref), expf(x.y - mref), expf(x.z - mref), expf(x.w - mref));
            if (coef16)
                *(uint2 *)(coef16 + r * ld + 4 * c4) = f4_to_bf16x4(cf);
            else
                *(float4 *)(lg + 4 * c4) = cf;
        }
        c0 = nc / 4 * 4;
    }
    for (int64_t c = c0 + threadIdx.x; c < nc; c += LMCE_THREADS) {
        const float cf = expf(x_src[c] - mref);
        if (coef16) {
            __nv_bfloat16 b = __float2bfloat16_rn(cf);
            coef16[r * ld + c] = *(uint16_t *)&b;
        } else {
            lg[c] = cf;
        }
    }
}

/* With tk.K > 0 also the label logit, and (−1, NaN) in the top-K slots no logit filled (only
 * a row with fewer than K logits that are not NaN has such slots). */
static __global__ void lmce_finish_kernel(float *ce, int32_t *argmax, float *lse, const lmce_row *st,
                                          int64_t n, lmce_topk tk) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const double l = st[i].m + log(st[i].s);
        lse[i] = (float)l;
        ce[i] = (float)(l - (double)st[i].lab);
        argmax[i] = st[i].amax;
        if (tk.K > 0) {
            tk.label_logit[i] = st[i].lab;
            for (int k = st[i].tk_n; k < tk.K; k++) {
                tk.val[i * tk.K + k] = __int_as_float(0x7fc00000);
                tk.idx[i * tk.K + k] = -1;
            }
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

/* The stats kernel with the list size that K needs (KMAX 0: lm_ce), the row staged in shared
 * memory when it fits and is 16-byte aligned. */
template <int KMAX>
static void lmce_stats_launch(kn_ctx *ctx, int64_t nr, lmce_row *st, float *alpha, float *logits,
                              uint16_t *coef16, int64_t ld, int64_t nc, int64_t v0, const int32_t *labels,
                              lmce_topk tk) {
    const unsigned int g = (unsigned int)nr;
    if (nc <= LMCE_SM_COLS && ld % 4 == 0 && (uintptr_t)logits % 16 == 0) {
        const size_t smem = (size_t)(nc + 3) / 4 * 16;
        lmce_stats_kernel<KMAX, true>
            <<<g, LMCE_THREADS, smem, ctx->stream>>>(st, alpha, logits, coef16, ld, nc, v0, labels, tk);
        return;
    }
    lmce_stats_kernel<KMAX, false>
        <<<g, LMCE_THREADS, 0, ctx->stream>>>(st, alpha, logits, coef16, ld, nc, v0, labels, tk);
}

static cm_status lmce_stats(kn_ctx *ctx, int64_t nr, lmce_row *st, float *alpha, float *logits,
                            uint16_t *coef16, int64_t ld, int64_t nc, int64_t v0, const int32_t *labels,
                            lmce_topk tk) {
    if (tk.K == 0)
        lmce_stats_launch<0>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    else if (tk.K <= 4)
        lmce_stats_launch<4>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    else if (tk.K <= 8)
        lmce_stats_launch<8>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    else if (tk.K <= 16)
        lmce_stats_launch<16>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    else if (tk.K <= 32)
        lmce_stats_launch<32>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    else
        lmce_stats_launch<KN_TOPK_MAX>(ctx, nr, st, alpha, logits, coef16, ld, nc, v0, labels, tk);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* The checks that come before R = 0 returns: context, shape, dtype (op names the entry). */
static cm_status lmce_check_shape(const char *op, kn_ctx *ctx, int64_t R, int64_t V, int64_t D,
                                  cm_dtype wdt) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(R >= 0 && V > 0 && D > 0, "%s: bad shape R=%lld V=%lld D=%lld (R >= 0, V > 0, D > 0)",
                      op, (long long)R, (long long)V, (long long)D);
    KN_CUDA_CHECK_ARG(V <= INT32_MAX, "%s: V=%lld does not fit the I32 argmax", op, (long long)V);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: weight dtype %s is not supported (use F32 or BF16)", op,
                       cm_dtype_name(wdt));
    return CM_OK;
}

/* The pass of lm_ce and lm_ce_topk (p->K = 0: lm_ce, no top-K outputs). */
static cm_status lmce_run(const char *op, kn_ctx *ctx, const kn_lm_topk_params *p) {
    const int64_t R = p->R, V = p->V, D = p->D;
    const int     K = p->K;
    if (R == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->ce && p->argmax && p->h && p->labels && p->w,
                      "%s: ce, argmax, h, labels or w is NULL", op);
    KN_CUDA_CHECK_ARG(!p->dh || p->gscale, "%s: gscale is NULL but dh is requested", op);
    float *const         dh = p->dh;
    const float *const   h = p->h;
    const void *const    w = p->w;
    const cm_dtype       wdt = p->wdt;
    const int32_t *const labels = p->labels;

    const int     bf16 = ctx->gemm_mode == KN_GEMM_MODE_BF16;
    /* the fewest tiles of at most LMCE_ROWS, equal to within a row (7680 rows: two of 3840, not
     * three of 2048 and one of 1536), so that no tile is a GEMM of a few waves' tail */
    const int64_t n_tiles = (R + LMCE_ROWS - 1) / LMCE_ROWS, Rt = (R + n_tiles - 1) / n_tiles;
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
        /* the tile's rows of the top-K outputs, which hold the running lists meanwhile */
        const lmce_topk tk = {K, K ? p->topk_val + r0 * K : NULL, K ? p->topk_idx + r0 * K : NULL,
                              K ? p->label_logit + r0 : NULL};
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
            CM_TRY(kn_cuda_lt_matmul(ctx, op, ab, 1, 0, nc, nr, D, w_op, D, h_op, D, 0.0f, logits, Vc));
            CM_TRY(lmce_stats(ctx, nr, st, alpha, logits, coef16, Vc, nc, v0, labels + r0, tk));
            if (!dh)
                continue;
            if (v0 > 0) {
                lmce_rescale_kernel<<<(unsigned int)nr, 256, 0, ctx->stream>>>(dh + r0 * D, D, alpha);
                KN_CUDA_LAUNCHED(ctx);
            }
            /* dhᵀ (D×nr, ld D) (+)= W_chunk (stored D×nc, op N) · coefᵀ (nc×nr, ld Vc) */
            const void *c_op = coef16 ? (const void *)coef16 : (const void *)logits;
            CM_TRY(kn_cuda_lt_matmul(ctx, op, ab, 0, 0, D, nr, nc, w_op, D, c_op, Vc, v0 == 0 ? 0.0f : 1.0f,
                                     dh + r0 * D, D));
        }
        lmce_finish_kernel<<<grid_for(nr, 256), 256, 0, ctx->stream>>>(p->ce + r0, p->argmax + r0, lse, st,
                                                                       nr, tk);
        KN_CUDA_LAUNCHED(ctx);
        if (dh) {
            lmce_dh_finish_kernel<<<(unsigned int)nr, 256, 0, ctx->stream>>>(
                dh + r0 * D, D, st, lse, labels + r0, p->gscale + r0, w, wdt == CM_DTYPE_BF16, bf16, V);
            KN_CUDA_LAUNCHED(ctx);
        }
    }
    return CM_OK;
}

cm_status kn_cuda_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h,
                        const int32_t *labels, const float *gscale, const void *w, cm_dtype wdt, int64_t R,
                        int64_t V, int64_t D) {
    CM_TRY(lmce_check_shape("lm_ce", ctx, R, V, D, wdt));
    kn_lm_topk_params p = {};
    p.R = R, p.V = V, p.D = D, p.K = 0, p.h = h, p.labels = labels, p.gscale = gscale, p.w = w, p.wdt = wdt;
    p.dh = dh, p.ce = ce, p.argmax = argmax;
    return lmce_run("lm_ce", ctx, &p);
}

cm_status kn_cuda_lm_ce_topk(kn_ctx *ctx, const kn_lm_topk_params *p) {
    KN_CUDA_CHECK_ARG(p, "lm_ce_topk: params are NULL");
    CM_TRY(lmce_check_shape("lm_ce_topk", ctx, p->R, p->V, p->D, p->wdt));
    KN_CUDA_CHECK_ARG(p->K >= 1 && p->K <= KN_TOPK_MAX, "lm_ce_topk: K=%d is outside [1, KN_TOPK_MAX=%d]",
                      p->K, KN_TOPK_MAX);
    KN_CUDA_CHECK_ARG(p->K <= p->V, "lm_ce_topk: K=%d exceeds the vocabulary size V=%lld", p->K,
                      (long long)p->V);
    if (p->R == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->topk_idx && p->topk_val && p->label_logit,
                      "lm_ce_topk: topk_idx, topk_val or label_logit is NULL");
    return lmce_run("lm_ce_topk", ctx, p);
}
