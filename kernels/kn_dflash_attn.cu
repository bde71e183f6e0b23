/* kernels/kn_dflash_attn.cu — DFlash block attention (docs/drafter.md; semantics and shapes in
 * kn_backend.h, the specification in ref/kn_dflash_attn_ref.c), forward and backward, fused:
 * scores and probabilities live in registers and shared memory only, never in global memory.
 *
 * Visibility. Block j (anchor a_j, document start ctx_lo[j]) sees the context rows
 * [lo_j, a_j) and its own B block rows: all B slots, or slots ≤ k when the layer is causal. On
 * a sliding layer (window W > 0) the window bounds every key: slot k sees only context rows
 * ≥ a_j + k − (W − 1) and block slots s with |k − s| < W; on a full layer every slot sees the
 * whole range. The union over the block's slots is [max(ctx_lo, a_j − W + 1),
 * a_j): the kernels loop over key tiles of that range and then the block's own rows, so
 * tiles with nothing visible are never visited; a tile's masked keys get probability 0.
 *
 * Forward (dflash_fwd_kernel): one CTA per (query block j, q head h), 4 warps. The block's
 * B query rows sit in shared memory; each key tile of 32 rows (K, V of kv head h / (nq/nkv):
 * GQA) is staged in shared memory and every warp takes query rows in turn: lane i scores key
 * i (fp32 dot over hd), the warp does an online softmax (running max and sum in fp32), and
 * lanes own output dims (hd ≤ 256: up to 8 per lane) accumulated from the tile's V. Writes
 * out = o / l and lse = m + log l (natural log).
 *
 * Backward, three kernels, no atomics (deterministic):
 * 1. Δ[q, h] = Σ_d dout·out (= Σ_keys P·dp), one warp per query row and head;
 * 2. dq (dflash_dq_kernel): the forward's loop with P = exp(s − lse) recomputed per tile,
 *    dp = dout·v, dS = P·(dp − Δ), dq += dS·k; one CTA per (block, q head);
 * 3. dk, dv (dflash_dkv_kernel): one CTA per 32 key rows and kv head; each warp owns 4 keys
 *    (lanes own dims, sums in registers) and visits, in a fixed order, every query block
 *    whose range holds the tile (context keys), or only the key's own block (block keys),
 *    every head of the kv group, and every slot that sees the key: lane k recomputes P and
 *    dS of slot k, and the warp accumulates dk += dS·q, dv += P·dout. Each output element is
 *    owned by one lane and summed in one order, so dk/dv have the same bits every run.
 * All math is fp32 (the inputs F32 or, io_dt BF16, widened as loaded; out stored in io_dt); exp is
 * expf. The backward reads out and lse from the forward. These kernels are the F32 GEMM mode's and the
 * fallback for every shape; in BF16 mode the launchers hand the shapes the tensor-core kernels take (head_dim
 * 16/32/64/128, B ≤ 64) to kn_dflash_attn_mma.cu. Shared memory grows with B·hd; the launchers report the
 * largest supported shape for the device (hd ≤ 256). A simple, correct kernel: no tensor cores yet. anchors
 * and ctx_lo are device memory and cannot be checked on the host: the kernels clamp them into [0, T] so a bad
 * value cannot read out of bounds (the cpu reference refuses it). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"
#include "kn_dflash_attn_int.h"

#include <math.h>

#define DF_TILE      32 /* keys per tile: one per lane */
#define DF_NPL       8  /* output dims per lane: hd ≤ 256 */
#define DF_MAX_HD    (32 * DF_NPL)
#define DF_Q_WARPS   4 /* fwd and dq */
#define DF_KV_WARPS  8
#define DF_KPW       4 /* keys per warp in dkv: DF_KV_WARPS · DF_KPW = DF_TILE keys per CTA */
#define DF_FULL_MASK 0xffffffffu

// ----------------------------------------------------------------------------
// device helpers

/* One warp's update of an output row o[0, hd): o = o·c (SCALE) + Σ_{i<nk} w_i · M[i][·], where
 * w_i is lane i's w (broadcast by shuffle) and M is [nk][ld] in shared memory; lane l owns
 * dims l, l + 32, …: P·V in the forward, dS·K in dq. */
template <bool SCALE>
static __device__ __forceinline__ void row_update(float *o, int hd, float c, float w, int nk, const float *M,
                                                  int ld, int lane) {
    float acc[DF_NPL];
#pragma unroll
    for (int u = 0; u < DF_NPL; u++) {
        const int d = lane + 32 * u;
        acc[u] = d < hd ? (SCALE ? o[d] * c : o[d]) : 0.0f;
    }
    for (int i = 0; i < nk; i++) {
        const float wi = __shfl_sync(DF_FULL_MASK, w, i);
#pragma unroll
        for (int u = 0; u < DF_NPL; u++) {
            const int d = lane + 32 * u;
            if (d < hd)
                acc[u] += wi * M[i * ld + d];
        }
    }
#pragma unroll
    for (int u = 0; u < DF_NPL; u++) {
        const int d = lane + 32 * u;
        if (d < hd)
            o[d] = acc[u];
    }
}

/* Stages DF_TILE key rows (see load_kv_rows). */
static __device__ void load_kv_tile(const df_params &p, bool is_ctx, int64_t j, int64_t base, int nk, int g,
                                    float *ks, int ks_ld, float *vs, int vs_ld) {
    load_kv_rows(p, is_ctx, j, base, nk, DF_TILE, g, ks, ks_ld, vs, vs_ld);
}

// ----------------------------------------------------------------------------
// forward

static __global__ void dflash_fwd_kernel(const df_params p) {
    extern __shared__ float sm[];
    const int      B = p.B, hd = p.hd, hdp = hd + 1;
    float         *q_s = sm;             /* [B, hd] */
    float         *o_s = q_s + B * hd;   /* [B, hd] */
    float         *k_s = o_s + B * hd;   /* [DF_TILE, hd + 1]: lane-per-key reads, padded */
    float         *v_s = k_s + DF_TILE * hdp; /* [DF_TILE, hd] */
    float         *m_s = v_s + DF_TILE * hd;  /* [B] */
    float         *l_s = m_s + B;             /* [B] */
    const int64_t  j = blockIdx.x;
    const int      h = blockIdx.y, g = h / (p.nq / p.nkv);
    const int      lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    const df_range rg = block_range(p, j);

    for (int i = threadIdx.x; i < B * hd; i += blockDim.x) {
        const int r = i / hd, d = i % hd;
        q_s[i] = df_ld(p, p.q, ((j * B + r) * p.nq + h) * (int64_t)hd + d);
        o_s[i] = 0.0f;
    }
    for (int r = threadIdx.x; r < B; r += blockDim.x) {
        m_s[r] = -INFINITY;
        l_s[r] = 0.0f;
    }
    const int n_ct = (int)((rg.hi - rg.lo + DF_TILE - 1) / DF_TILE), n_bt = (B + DF_TILE - 1) / DF_TILE;
    for (int t = 0; t < n_ct + n_bt; t++) {
        const bool    is_ctx = t < n_ct;
        const int64_t base = is_ctx ? rg.lo + (int64_t)t * DF_TILE : (int64_t)(t - n_ct) * DF_TILE;
        const int64_t left = is_ctx ? rg.hi - base : B - base;
        const int     nk = left < DF_TILE ? (int)left : DF_TILE;
        __syncthreads(); /* the previous tile is consumed (and q_s, o_s are initialised) */
        load_kv_tile(p, is_ctx, j, base, nk, g, k_s, hdp, v_s, hd);
        __syncthreads();
        for (int r = warp; r < B; r += n_warps) {
            const int64_t key = base + lane;
            const bool    vis = lane < nk && (is_ctx ? ctx_visible(p, rg, r, key) : blk_visible(p, r, key));
            float         s = -INFINITY;
            if (vis) {
                float a = 0.0f;
                for (int d = 0; d < hd; d++)
                    a += q_s[r * hd + d] * k_s[lane * hdp + d];
                s = a * p.scale;
            }
            const float tmax = warp_max(s);
            if (tmax == -INFINITY) /* nothing of this tile is visible to row r (warp-uniform) */
                continue;
            const float m_old = m_s[r], l_old = l_s[r];
            const float m_new = fmaxf(m_old, tmax);
            const float corr = expf(m_old - m_new); /* 0 on the first visible tile */
            const float pv = vis ? expf(s - m_new) : 0.0f;
            const float psum = warp_sum(pv);
            row_update<true>(o_s + r * hd, hd, corr, pv, nk, v_s, hd, lane);
            __syncwarp(); /* every lane has read m_s[r], l_s[r] */
            if (lane == 0) {
                m_s[r] = m_new;
                l_s[r] = l_old * corr + psum;
            }
            __syncwarp();
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < B * hd; i += blockDim.x) {
        const int     r = i / hd, d = i % hd;
        const int64_t task = (j * B + r) * p.nq + h;
        df_st(p, p.out, task * hd + d, o_s[i] / l_s[r]);
    }
    for (int r = threadIdx.x; r < B; r += blockDim.x)
        p.lse[(j * B + r) * p.nq + h] = m_s[r] + logf(l_s[r]);
}

// ----------------------------------------------------------------------------
// backward

/* Δ[task] = Σ_d dout·out for every (query row, q head); one warp per task. */
static __global__ void dflash_delta_kernel(float *delta, const float *dout, const df_params p,
                                           int64_t n_tasks, int hd) {
    const int64_t task = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int     lane = threadIdx.x % 32;
    if (task >= n_tasks)
        return; /* whole warps leave together: blockDim is a multiple of 32 */
    float s = 0.0f;
    for (int d = lane; d < hd; d += 32)
        s += dout[task * hd + d] * df_ld(p, p.out, task * hd + d);
    s = warp_sum(s);
    if (lane == 0)
        delta[task] = s;
}

static __global__ void dflash_dq_kernel(const df_params p, const float *delta) {
    extern __shared__ float sm[];
    const int      B = p.B, hd = p.hd, hdp = hd + 1;
    float         *q_s = sm;                   /* [B, hd] */
    float         *do_s = q_s + B * hd;        /* [B, hd] */
    float         *dq_s = do_s + B * hd;       /* [B, hd] */
    float         *k_s = dq_s + B * hd;        /* [DF_TILE, hd + 1] */
    float         *v_s = k_s + DF_TILE * hdp;  /* [DF_TILE, hd + 1] */
    float         *lse_s = v_s + DF_TILE * hdp; /* [B] */
    float         *dl_s = lse_s + B;            /* [B] */
    const int64_t  j = blockIdx.x;
    const int      h = blockIdx.y, g = h / (p.nq / p.nkv);
    const int      lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    const df_range rg = block_range(p, j);

    for (int i = threadIdx.x; i < B * hd; i += blockDim.x) {
        const int     r = i / hd, d = i % hd;
        const int64_t off = ((j * B + r) * p.nq + h) * (int64_t)hd + d;
        q_s[i] = df_ld(p, p.q, off);
        do_s[i] = p.dout[off];
        dq_s[i] = 0.0f;
    }
    for (int r = threadIdx.x; r < B; r += blockDim.x) {
        lse_s[r] = p.lse[(j * B + r) * p.nq + h];
        dl_s[r] = delta[(j * B + r) * p.nq + h];
    }
    const int n_ct = (int)((rg.hi - rg.lo + DF_TILE - 1) / DF_TILE), n_bt = (B + DF_TILE - 1) / DF_TILE;
    for (int t = 0; t < n_ct + n_bt; t++) {
        const bool    is_ctx = t < n_ct;
        const int64_t base = is_ctx ? rg.lo + (int64_t)t * DF_TILE : (int64_t)(t - n_ct) * DF_TILE;
        const int64_t left = is_ctx ? rg.hi - base : B - base;
        const int     nk = left < DF_TILE ? (int)left : DF_TILE;
        __syncthreads();
        load_kv_tile(p, is_ctx, j, base, nk, g, k_s, hdp, v_s, hdp);
        __syncthreads();
        for (int r = warp; r < B; r += n_warps) {
            const int64_t key = base + lane;
            const bool    vis = lane < nk && (is_ctx ? ctx_visible(p, rg, r, key) : blk_visible(p, r, key));
            if (!__any_sync(DF_FULL_MASK, vis))
                continue;
            float ds = 0.0f;
            if (vis) {
                float a = 0.0f, b = 0.0f;
                for (int d = 0; d < hd; d++) {
                    a += q_s[r * hd + d] * k_s[lane * hdp + d];
                    b += do_s[r * hd + d] * v_s[lane * hdp + d];
                }
                const float pr = expf(a * p.scale - lse_s[r]);
                ds = pr * (b - dl_s[r]);
            }
            row_update<false>(dq_s + r * hd, hd, 1.0f, ds, nk, k_s, hdp, lane);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < B * hd; i += blockDim.x) {
        const int r = i / hd, d = i % hd;
        p.dq[((j * B + r) * p.nq + h) * (int64_t)hd + d] = dq_s[i] * p.scale;
    }
}

/* blk_mode 0: CTA x covers context rows [32x, 32x + 32); every block j whose range meets
 * the tile contributes. blk_mode 1: CTA x covers block slots of block x / ceil(B/32); only
 * that block's queries see them. */
static __global__ void dflash_dkv_kernel(const df_params p, const float *delta, int blk_mode) {
    extern __shared__ float sm[];
    const int B = p.B, hd = p.hd, hdp = hd + 1, group = p.nq / p.nkv;
    float    *q_s = sm;                  /* [B, hd + 1]: lane-per-slot reads, padded */
    float    *do_s = q_s + B * hdp;      /* [B, hd + 1] */
    float    *k_s = do_s + B * hdp;      /* [DF_TILE, hd] */
    float    *v_s = k_s + DF_TILE * hd;  /* [DF_TILE, hd] */
    float    *lse_s = v_s + DF_TILE * hd; /* [B] */
    float    *dl_s = lse_s + B;           /* [B] */
    const int g = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t   key0, j_begin, j_end;
    int       nk;
    if (!blk_mode) {
        key0 = (int64_t)blockIdx.x * DF_TILE;
        nk = p.T - key0 < DF_TILE ? (int)(p.T - key0) : DF_TILE;
        j_begin = 0;
        j_end = p.n_blocks;
    } else {
        const int nbt = (B + DF_TILE - 1) / DF_TILE;
        j_begin = blockIdx.x / nbt;
        j_end = j_begin + 1;
        key0 = (int64_t)(blockIdx.x % nbt) * DF_TILE;
        nk = B - key0 < DF_TILE ? (int)(B - key0) : DF_TILE;
    }
    load_kv_tile(p, !blk_mode, j_begin, key0, nk, g, k_s, hd, v_s, hd);

    float dk[DF_KPW][DF_NPL], dv[DF_KPW][DF_NPL];
#pragma unroll
    for (int kk = 0; kk < DF_KPW; kk++)
#pragma unroll
        for (int u = 0; u < DF_NPL; u++)
            dk[kk][u] = dv[kk][u] = 0.0f;

    for (int64_t j = j_begin; j < j_end; j++) {
        const df_range rg = block_range(p, j);
        if (!blk_mode && (key0 >= rg.hi || key0 + nk <= rg.lo)) /* CTA-uniform */
            continue;
        for (int h = g * group; h < (g + 1) * group; h++) {
            __syncthreads(); /* the previous (j, h) is consumed; k_s, v_s are loaded */
            for (int i = threadIdx.x; i < B * hd; i += blockDim.x) {
                const int     r = i / hd, d = i % hd;
                const int64_t off = ((j * B + r) * p.nq + h) * (int64_t)hd + d;
                q_s[r * hdp + d] = df_ld(p, p.q, off);
                do_s[r * hdp + d] = p.dout[off];
            }
            for (int r = threadIdx.x; r < B; r += blockDim.x) {
                lse_s[r] = p.lse[(j * B + r) * p.nq + h];
                dl_s[r] = delta[(j * B + r) * p.nq + h];
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < DF_KPW; kk++) {
                const int i = warp * DF_KPW + kk;
                if (i >= nk) /* warp-uniform */
                    continue;
                const int64_t key = key0 + i; /* context row, or block slot */
                for (int sc = 0; sc < B; sc += 32) {
                    const int k = sc + lane;
                    bool      vis = k < B;
                    if (vis)
                        vis = blk_mode ? blk_visible(p, k, key) : key < rg.hi && ctx_visible(p, rg, k, key);
                    if (!__any_sync(DF_FULL_MASK, vis))
                        continue;
                    float pr = 0.0f, ds = 0.0f;
                    if (vis) {
                        float a = 0.0f, b = 0.0f;
                        for (int d = 0; d < hd; d++) {
                            a += q_s[k * hdp + d] * k_s[i * hd + d];
                            b += do_s[k * hdp + d] * v_s[i * hd + d];
                        }
                        pr = expf(a * p.scale - lse_s[k]);
                        ds = pr * (b - dl_s[k]);
                    }
                    const int ns = B - sc < 32 ? B - sc : 32;
                    for (int t = 0; t < ns; t++) {
                        const float pt = __shfl_sync(DF_FULL_MASK, pr, t);
                        const float dt = __shfl_sync(DF_FULL_MASK, ds, t);
#pragma unroll
                        for (int u = 0; u < DF_NPL; u++) {
                            const int d = lane + 32 * u;
                            if (d < hd) {
                                dk[kk][u] += dt * q_s[(sc + t) * hdp + d];
                                dv[kk][u] += pt * do_s[(sc + t) * hdp + d];
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < DF_KPW; kk++) {
        const int i = warp * DF_KPW + kk;
        if (i >= nk)
            continue;
        const int64_t row = blk_mode ? j_begin * B + key0 + i : key0 + i;
        float        *dko = (blk_mode ? p.dk_blk : p.dk_ctx) + (row * p.nkv + g) * (int64_t)hd;
        float        *dvo = (blk_mode ? p.dv_blk : p.dv_ctx) + (row * p.nkv + g) * (int64_t)hd;
#pragma unroll
        for (int u = 0; u < DF_NPL; u++) {
            const int d = lane + 32 * u;
            if (d < hd) {
                dko[d] = dk[kk][u] * p.scale;
                dvo[d] = dv[kk][u];
            }
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

static size_t fwd_smem(const df_params *p) {
    return sizeof(float) * ((size_t)2 * p->B * p->hd + (size_t)DF_TILE * (p->hd + 1) + (size_t)DF_TILE * p->hd +
                            (size_t)2 * p->B);
}
static size_t dq_smem(const df_params *p) {
    return sizeof(float) * ((size_t)3 * p->B * p->hd + (size_t)2 * DF_TILE * (p->hd + 1) + (size_t)2 * p->B);
}
static size_t dkv_smem(const df_params *p) {
    return sizeof(float) * ((size_t)2 * p->B * (p->hd + 1) + (size_t)2 * DF_TILE * p->hd + (size_t)2 * p->B);
}

static cm_status check_params(const char *op, kn_ctx *ctx, const df_params *p, int bwd) {
    KN_CUDA_CHECK_ARG(ctx && p, "%s: ctx or params is NULL", op);
    KN_CUDA_CHECK_ARG(p->T >= 0 && p->n_blocks >= 0 && p->B > 0 && p->nq > 0 && p->nkv > 0 && p->hd > 0,
                      "%s: bad shape T=%lld n_blocks=%lld B=%d nq=%d nkv=%d hd=%d", op, (long long)p->T,
                      (long long)p->n_blocks, p->B, p->nq, p->nkv, p->hd);
    KN_CUDA_CHECK_ARG(p->nq % p->nkv == 0, "%s: nq=%d must be a multiple of nkv=%d", op, p->nq, p->nkv);
    KN_CUDA_CHECK_ARG(p->window >= 0, "%s: window=%d must be >= 0 (0 = full attention)", op, p->window);
    KN_CUDA_CHECK_ARG(isfinite(p->scale), "%s: scale=%g must be finite", op, (double)p->scale);
    KN_CUDA_CHECK_ARG(p->io_dt == CM_DTYPE_F32 || p->io_dt == CM_DTYPE_BF16,
                      "%s: q, k, v and out in %s are not supported (F32 or BF16)", op,
                      cm_dtype_name(p->io_dt));
    const int64_t row_elems = (int64_t)p->nq * p->hd;
    KN_CUDA_CHECK_ARG(p->n_blocks <= INT64_MAX / p->B / row_elems && p->T <= INT64_MAX / row_elems,
                      "%s: shape T=%lld n_blocks=%lld B=%d overflows", op, (long long)p->T, (long long)p->n_blocks,
                      p->B);
    KN_CUDA_CHECK_ARG(p->nq <= 65535 && p->nkv <= 65535 && p->n_blocks <= INT32_MAX && p->T <= INT32_MAX,
                      "%s: shape nq=%d nkv=%d n_blocks=%lld T=%lld exceeds the cuda grid", op, p->nq, p->nkv,
                      (long long)p->n_blocks, (long long)p->T);
    if (p->hd > DF_MAX_HD)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: head_dim %d is not supported by the cuda kernel (max %d)", op, p->hd,
                       DF_MAX_HD);
    if (p->n_blocks > 0) {
        KN_CUDA_CHECK_ARG(p->anchors && p->ctx_lo, "%s: anchors or ctx_lo is NULL", op);
        KN_CUDA_CHECK_ARG(p->q && p->k_blk && p->v_blk && p->lse, "%s: q, k_blk, v_blk or lse is NULL", op);
        if (bwd)
            KN_CUDA_CHECK_ARG(p->dout && p->out && p->dq && p->dk_blk && p->dv_blk,
                              "%s: dout, out, dq, dk_blk or dv_blk is NULL (the cuda backward reads the "
                              "forward's out)",
                              op);
        else
            KN_CUDA_CHECK_ARG(p->out, "%s: out is NULL", op);
    }
    if (p->T > 0 && (p->n_blocks > 0 || bwd))
        KN_CUDA_CHECK_ARG(p->k_ctx && p->v_ctx, "%s: k_ctx or v_ctx is NULL", op);
    if (p->T > 0 && bwd)
        KN_CUDA_CHECK_ARG(p->dk_ctx && p->dv_ctx, "%s: dk_ctx or dv_ctx is NULL", op);
    return CM_OK;
}

/* Opts the kernel into smem bytes of dynamic shared memory, or says the shape is too big. */
static cm_status smem_opt_in(kn_ctx *ctx, const char *op, const void *kernel, size_t smem, const df_params *p) {
    int optin = 0;
    KN_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
    if (smem > (size_t)optin)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "%s: block size %d with head_dim %d needs %zu bytes of shared memory; this device "
                       "allows %d per block (use a smaller block_size or head_dim)",
                       op, p->B, p->hd, smem, optin);
    KN_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return CM_OK;
}

/* The ctx's BF16 GEMM mode selects the bf16 tensor-core kernels (kn_dflash_attn_mma.cu) for
 * the shapes they take; F32 mode, and every other shape, runs the fp32 kernels above. */
static int use_mma(const kn_ctx *ctx, const df_params *p) {
    return ctx->gemm_mode == KN_GEMM_MODE_BF16 && kn_dflash_mma_supported(ctx, p);
}

cm_status kn_cuda_dflash_attn_fwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    CM_TRY(check_params("dflash_attn_fwd", ctx, p, 0));
    if (p->n_blocks == 0)
        return CM_OK;
    if (use_mma(ctx, p))
        return kn_dflash_mma_fwd(ctx, p);
    const size_t smem = fwd_smem(p);
    CM_TRY(smem_opt_in(ctx, "dflash_attn_fwd", (const void *)dflash_fwd_kernel, smem, p));
    dim3 grid((unsigned int)p->n_blocks, (unsigned int)p->nq);
    dflash_fwd_kernel<<<grid, 32 * DF_Q_WARPS, smem, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_dflash_attn_bwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    CM_TRY(check_params("dflash_attn_bwd", ctx, p, 1));
    if (use_mma(ctx, p))
        return kn_dflash_mma_bwd(ctx, p);
    const int64_t n_q = p->n_blocks * p->B * p->nq;
    float        *delta = NULL;
    if (n_q > 0) {
        CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)n_q * sizeof(float)));
        delta = (float *)ctx->scratch;
        const int64_t threads = n_q * 32, blocks = (threads + 255) / 256;
        KN_CUDA_CHECK_ARG(blocks <= INT32_MAX, "dflash_attn_bwd: %lld query rows are too many", (long long)n_q);
        dflash_delta_kernel<<<(unsigned int)blocks, 256, 0, ctx->stream>>>(delta, p->dout, *p, n_q, p->hd);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (n_q > 0) {
        const size_t smem_q = dq_smem(p);
        CM_TRY(smem_opt_in(ctx, "dflash_attn_bwd", (const void *)dflash_dq_kernel, smem_q, p));
        dim3 grid((unsigned int)p->n_blocks, (unsigned int)p->nq);
        dflash_dq_kernel<<<grid, 32 * DF_Q_WARPS, smem_q, ctx->stream>>>(*p, delta);
        KN_CUDA_LAUNCHED(ctx);
    }
    const size_t smem_kv = dkv_smem(p);
    CM_TRY(smem_opt_in(ctx, "dflash_attn_bwd", (const void *)dflash_dkv_kernel, smem_kv, p));
    if (p->T > 0) { /* every context row is written, zero where no block sees it */
        dim3 grid((unsigned int)((p->T + DF_TILE - 1) / DF_TILE), (unsigned int)p->nkv);
        dflash_dkv_kernel<<<grid, 32 * DF_KV_WARPS, smem_kv, ctx->stream>>>(*p, delta, 0);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (p->n_blocks > 0) {
        const int64_t nbt = (p->B + DF_TILE - 1) / DF_TILE;
        dim3          grid((unsigned int)(p->n_blocks * nbt), (unsigned int)p->nkv);
        dflash_dkv_kernel<<<grid, 32 * DF_KV_WARPS, smem_kv, ctx->stream>>>(*p, delta, 1);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}
