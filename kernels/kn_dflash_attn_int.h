/* kernels/kn_dflash_attn_int.h — what the two DFlash attention implementations share
 * (kn_dflash_attn.cu: the fp32 CUDA-core kernels; kn_dflash_attn_mma.cu: the bf16
 * tensor-core kernels; kn_dflash_attn_sm90a.cu: their dk/dv pass on wgmma): the visibility rules
 * of docs/drafter.md as device functions, the K/V row stager, the CTA order and dk/dv item walk
 * of the tensor-core kernels, and their launchers. CUDA C++ only; internal to libkn. */
#ifndef KN_DFLASH_ATTN_INT_H
#define KN_DFLASH_ATTN_INT_H

#include "kn_cuda.h"

#include <cuda_bf16.h>

typedef kn_dflash_attn_params df_params;

/* Element i of one of the typed arrays (q, k, v, out: io_dt F32 or BF16) as fp32, and v stored
 * there (BF16: rounded to nearest even). */
static __device__ __forceinline__ float df_ld(const df_params &p, const void *a, int64_t i) {
    return p.io_dt == CM_DTYPE_BF16 ? __uint_as_float((unsigned int)((const uint16_t *)a)[i] << 16)
                                    : ((const float *)a)[i];
}
static __device__ __forceinline__ void df_st(const df_params &p, void *a, int64_t i, float v) {
    if (p.io_dt == CM_DTYPE_BF16)
        ((__nv_bfloat16 *)a)[i] = __float2bfloat16_rn(v);
    else
        ((float *)a)[i] = v;
}

/* Two adjacent outputs a, b at element i (even) of out: one 8-byte F32 or 4-byte BF16 store. */
static __device__ __forceinline__ void df_st_out2(const df_params &p, int64_t i, float a, float b) {
    if (p.io_dt == CM_DTYPE_BF16)
        *reinterpret_cast<__nv_bfloat162 *>((__nv_bfloat16 *)p.out + i) = __floats2bfloat162_rn(a, b);
    else
        *reinterpret_cast<float2 *>((float *)p.out + i) = make_float2(a, b);
}

/* Block j's context bounds, clamped into [0, T]: doc_lo = ctx_lo[j], hi = a_j, and lo =
 * the union of its slots' lower bounds (what the tile loops visit). Clamping keeps a bad
 * anchor (device memory, not checked on the host) from reading out of bounds. */
typedef struct df_range {
    int64_t doc_lo, lo, hi;
} df_range;

static __device__ __forceinline__ df_range block_range(const df_params &p, int64_t j) {
    df_range r;
    r.hi = p.anchors[j];
    r.hi = r.hi < 0 ? 0 : r.hi > p.T ? p.T : r.hi;
    r.doc_lo = p.ctx_lo[j];
    r.doc_lo = r.doc_lo < 0 ? 0 : r.doc_lo > r.hi ? r.hi : r.doc_lo;
    r.lo = r.doc_lo;
    if (p.window > 0) {
        int64_t w0 = r.hi - (p.window - 1); /* slot 0's bound is the loosest */
        if (w0 > r.lo)
            r.lo = w0 < r.hi ? w0 : r.hi;
    }
    return r;
}

/* Does slot k of block (range r) see context row `key` (key < r.hi assumed)? */
static __device__ __forceinline__ bool ctx_visible(const df_params &p, const df_range &r, int k, int64_t key) {
    if (key < r.doc_lo)
        return false;
    return p.window <= 0 || key >= r.hi + k - (p.window - 1);
}

/* Does slot k see block slot s of its own block? All slots, or s ≤ k when causal; on a
 * sliding layer also |k − s| < W (for a causal layer that is k − s < W). */
static __device__ __forceinline__ bool blk_visible(const df_params &p, int k, int64_t s) {
    if (p.causal && s > k)
        return false;
    return p.window <= 0 || (s > k ? s - k : k - s) < p.window;
}

/* Does every slot of a block see every slot of it (no mask needed over the block's rows)? */
static __device__ __forceinline__ bool blk_all_visible(const df_params &p) {
    return !p.causal && (p.window <= 0 || p.window >= p.B);
}

/* Stages key rows [base, base + nk) of kv head g into ks (row stride ks_ld) and vs (vs_ld)
 * as fp32, zero-filling rows nk..n_rows-1. Context rows when is_ctx, else block j's rows. */
static __device__ void load_kv_rows(const df_params &p, bool is_ctx, int64_t j, int64_t base, int nk, int n_rows,
                                    int g, float *ks, int ks_ld, float *vs, int vs_ld) {
    const int hd = p.hd;
    for (int i = threadIdx.x; i < n_rows * hd; i += blockDim.x) {
        const int kk = i / hd, d = i % hd;
        float     kv = 0.0f, vv = 0.0f;
        if (kk < nk) {
            const int64_t row = is_ctx ? base + kk : j * p.B + base + kk;
            const int64_t off = (row * p.nkv + g) * (int64_t)hd + d;
            kv = df_ld(p, is_ctx ? p.k_ctx : p.k_blk, off);
            vv = df_ld(p, is_ctx ? p.v_ctx : p.v_blk, off);
        }
        ks[kk * ks_ld + d] = kv;
        vs[kk * vs_ld + d] = vv;
    }
}

/* The CTA's (x, kv head) from a one-dimensional grid of n·nkv CTAs, kv heads fastest, x walked
 * from the end when `reverse`. CTAs start in index order, so the order decides what is left for
 * the last wave: the forward and dq take blocks from the last (in anchor order, the longest
 * contexts of a document come last), the context dk/dv key tiles from the first (the keys that
 * most blocks see open a document). Which CTA computes an output does not change with it. */
static __device__ __forceinline__ void cta_item(int nkv, int64_t n, int reverse, int64_t *x, int *g) {
    const int64_t i = blockIdx.x, k = i / nkv;
    *g = (int)(i - k * nkv);
    *x = reverse ? n - 1 - k : k;
}

/* Tile t of block j's key loop: context tiles [lo + t·KT, …) first, then the block's rows.
 * row0 is the tile's first row in the joint K/V array, base its first key (context row, or
 * block slot), nk its valid rows. */
typedef struct dfm_tile {
    bool    is_ctx;
    int64_t base, row0;
    int     nk;
} dfm_tile;

template <int KT>
static __device__ __forceinline__ dfm_tile tile_of(const df_params &p, const df_range &rg, int64_t j,
                                                   int n_ct, int t) {
    dfm_tile tl;
    tl.is_ctx = t < n_ct;
    if (tl.is_ctx) {
        tl.base = rg.lo + (int64_t)t * KT;
        tl.row0 = tl.base;
        const int64_t left = rg.hi - tl.base;
        tl.nk = left < KT ? (int)left : KT;
    } else {
        tl.base = (int64_t)(t - n_ct) * KT;
        tl.row0 = p.T + j * p.B + tl.base;
        const int64_t left = p.B - tl.base;
        tl.nk = left < KT ? (int)left : KT;
    }
    return tl;
}

/* Does every slot of the block see every key of the tile? Then the mask can be skipped. */
template <int KT>
static __device__ __forceinline__ bool tile_full(const df_params &p, const df_range &rg, const dfm_tile &tl) {
    if (tl.nk != KT || p.B % 16 != 0)
        return false;
    if (!tl.is_ctx)
        return blk_all_visible(p);
    if (tl.base < rg.doc_lo)
        return false;
    /* slot B − 1 has the tightest lower bound on a sliding layer */
    return p.window <= 0 || tl.base >= rg.hi + (p.B - 1) - (p.window - 1);
}

/* Is element (slot row, key) of tile tl visible? */
static __device__ __forceinline__ bool visible(const df_params &p, const df_range &rg, const dfm_tile &tl,
                                               int row, int ki) {
    if (row >= p.B || ki >= tl.nk)
        return false;
    const int64_t key = tl.base + ki;
    return tl.is_ctx ? ctx_visible(p, rg, row, key) : blk_visible(p, row, key);
}

/* A dk/dv CTA's keys and the blocks it visits: blk_mode 0, the CTA's context rows [key0, key0 +
 * nk) (its x-th run of `keys`) and every block j_begin ≤ j < j_end; blk_mode 1, the B ≤ keys own
 * rows of block x (key0 0, slots). row0 is the first key's row in the joint K/V copies; g the kv
 * head. */
typedef struct dkv_span {
    int64_t key0, row0, j_begin, j_end;
    int     nk, g;
} dkv_span;

static __device__ __forceinline__ dkv_span dkv_span_of(const df_params &p, int blk_mode, int keys) {
    dkv_span s;
    int64_t  x;
    cta_item(p.nkv, blk_mode ? p.n_blocks : (p.T + keys - 1) / keys, 0, &x, &s.g);
    if (!blk_mode) {
        s.key0 = s.row0 = x * keys;
        s.nk = p.T - s.key0 < keys ? (int)(p.T - s.key0) : keys;
        s.j_begin = 0;
        s.j_end = p.n_blocks;
    } else {
        s.key0 = 0;
        s.j_begin = x;
        s.j_end = x + 1;
        s.row0 = p.T + x * p.B;
        s.nk = p.B;
    }
    return s;
}

/* Does every (key, row) of item (block range rg, chunk c of qr rows) see every key of the span?
 * All rows real slots and every key inside every slot's range; `keys` the span's full size. */
static __device__ __forceinline__ bool dkv_item_full(const df_params &p, const dkv_span &s, int blk_mode,
                                                     const df_range &rg, int c, int qr, int keys) {
    const int SP = (p.B + 15) / 16 * 16;
    if (s.nk != keys || p.B % 16 != 0 || (c + 1) * qr > (p.nq / p.nkv) * SP)
        return false;
    if (blk_mode)
        return blk_all_visible(p);
    return s.key0 >= rg.doc_lo && s.key0 + keys <= rg.hi &&
           (p.window <= 0 || s.key0 >= rg.hi + (p.B - 1) - (p.window - 1));
}

/* Does virtual query row vr of the item's block (range rg) see key row kr of the span? */
static __device__ __forceinline__ bool dkv_visible(const df_params &p, const dkv_span &s, int blk_mode,
                                                   const df_range &rg, int kr, int vr) {
    const int SP = (p.B + 15) / 16 * 16, slot = vr % SP;
    if (kr >= s.nk || vr >= (p.nq / p.nkv) * SP || slot >= p.B)
        return false;
    const int64_t key = s.key0 + kr;
    return blk_mode ? blk_visible(p, slot, key) : key < rg.hi && ctx_visible(p, rg, slot, key);
}

/* Writes a dk/dv CTA's sums for key row kr (< s.nk) of the span: dK·scale and dV at this lane's
 * columns 8i + 2·tq, + 1. dk and dv are in the accumulator layout mma.sync's C fragments and
 * wgmma's m64nHD share: element 4i + 2h + e is column 8i + 2·tq + e of the lane's row h. */
template <int HD>
static __device__ __forceinline__ void dkv_store(const df_params &p, const dkv_span &s, int blk_mode, int kr, int h,
                                                 const float *dk, const float *dv) {
    const int     tq = threadIdx.x % 4;
    const int64_t row = blk_mode ? s.j_begin * p.B + kr : s.key0 + kr;
    float        *dko = (blk_mode ? p.dk_blk : p.dk_ctx) + (row * p.nkv + s.g) * (int64_t)HD;
    float        *dvo = (blk_mode ? p.dv_blk : p.dv_ctx) + (row * p.nkv + s.g) * (int64_t)HD;
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
        const int e = 4 * i + 2 * h;
        *reinterpret_cast<float2 *>(dko + 8 * i + 2 * tq) = make_float2(dk[e] * p.scale, dk[e + 1] * p.scale);
        *reinterpret_cast<float2 *>(dvo + 8 * i + 2 * tq) = make_float2(dv[e], dv[e + 1]);
    }
}

/* The next item at or after (j, c) for a dkv CTA: block j's query rows [c·QR, c·QR + QR).
 * blk_mode visits only block j_begin; otherwise every block whose range meets the CTA's keys
 * [key0, key0 + nk). Returns j = j_end when there is none. Called by whole warps, uniformly:
 * each warp looks at 32 blocks per step (anchors need not be sorted, so the blocks that see
 * a tile are found by looking, not by searching). */
static __device__ __forceinline__ void dkv_next(const df_params &p, int blk_mode, int64_t key0, int nk,
                                                int64_t j_end, int n_chunks, int64_t *j, int *c) {
    if (*c < n_chunks)
        return;
    *c = 0;
    if (blk_mode) {
        *j += 1;
        return;
    }
    const int lane = threadIdx.x % 32;
    for (int64_t base = *j + 1; base < j_end; base += 32) {
        const int64_t jj = base + lane;
        bool          vis = false;
        if (jj < j_end) {
            const df_range rg = block_range(p, jj);
            vis = key0 < rg.hi && key0 + nk > rg.lo;
        }
        const unsigned m = __ballot_sync(0xffffffffu, vis);
        if (m) {
            *j = base + __ffs(m) - 1;
            return;
        }
    }
    *j = j_end;
}

/* The tensor-core path (kn_dflash_attn_mma.cu): 1 when it takes this shape (head_dim 16,
 * 32, 64 or 128; B ≤ 64; (nq/nkv)·ceil(B/16) ≤ 8 query tiles per kv head; the shared
 * memory this device allows per block). Both calls use the ctx's scratch (bf16 copies of
 * the operands; the backward also Δ = Σ dout·out per query row and head). */
int       kn_dflash_mma_supported(const kn_ctx *ctx, const df_params *p);
cm_status kn_dflash_mma_fwd(kn_ctx *ctx, const df_params *p);
cm_status kn_dflash_mma_bwd(kn_ctx *ctx, const df_params *p);

/* The same kernels on Hopper's warpgroup MMA (kn_dflash_attn_sm90a.cu), for kn_dflash_mma_fwd
 * and _bwd: supported when this build has sm_90a code, the GPU is compute capability 9.0, head_dim
 * is 64 or 128 (B ≤ 64) and TANDEM_DFLASH_KERNEL=wgmma asks for them. They take the bf16 copies
 * and Δ those made (Q, dO [R, nq, hd]; K, V [T + R, nkv, hd]); the backward runs dq and dk/dv. */
int       kn_dflash_wg_supported(kn_ctx *ctx, const df_params *p);
cm_status kn_dflash_wg_fwd(kn_ctx *ctx, const df_params *p, const __nv_bfloat16 *qb, const __nv_bfloat16 *kb,
                           const __nv_bfloat16 *vb);
cm_status kn_dflash_wg_bwd(kn_ctx *ctx, const df_params *p, const __nv_bfloat16 *qb, const __nv_bfloat16 *kb,
                           const __nv_bfloat16 *vb, const __nv_bfloat16 *dob, const float *delta);

#endif /* KN_DFLASH_ATTN_INT_H */
