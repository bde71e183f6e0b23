/* kernels/kn_dflash_attn_int.h — what the two DFlash attention implementations share
 * (kn_dflash_attn.cu: the fp32 CUDA-core kernels; kn_dflash_attn_mma.cu: the bf16
 * tensor-core kernels): the visibility rules of docs/drafter.md as device functions, the K/V row
 * stager, and the tensor-core launchers. CUDA C++ only; internal to libkn. */
#ifndef KN_DFLASH_ATTN_INT_H
#define KN_DFLASH_ATTN_INT_H

#include "kn_cuda.h"

typedef kn_dflash_attn_params df_params;

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
            kv = is_ctx ? p.k_ctx[off] : p.k_blk[off];
            vv = is_ctx ? p.v_ctx[off] : p.v_blk[off];
        }
        ks[kk * ks_ld + d] = kv;
        vs[kk * vs_ld + d] = vv;
    }
}

/* The tensor-core path (kn_dflash_attn_mma.cu): 1 when it takes this shape (head_dim 16,
 * 32, 64 or 128; B ≤ 64; (nq/nkv)·ceil(B/16) ≤ 8 query tiles per kv head; the shared
 * memory this device allows per block). Both calls use the ctx's scratch (bf16 copies of
 * the operands; the backward also Δ = Σ dout·out per query row and head). */
int       kn_dflash_mma_supported(const kn_ctx *ctx, const df_params *p);
cm_status kn_dflash_mma_fwd(kn_ctx *ctx, const df_params *p);
cm_status kn_dflash_mma_bwd(kn_ctx *ctx, const df_params *p);

#endif /* KN_DFLASH_ATTN_INT_H */
