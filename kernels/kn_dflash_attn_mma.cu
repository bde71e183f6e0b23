/* kernels/kn_dflash_attn_mma.cu — DFlash block attention on tensor cores (the ctx's BF16
 * GEMM mode): the same visibility, tiling and deterministic backward as the fp32 kernels in
 * kn_dflash_attn.cu, with every matrix product an mma.sync.m16n8k16 on bf16 operands and
 * fp32 accumulators (sm_80 and later: Ampere, Hopper, Blackwell RTX). Operands are staged in
 * shared memory as fp32 and rounded to bf16 (nearest even) when a fragment is built, so the
 * inputs, P and dS are bf16 while every sum, the online softmax and the outputs are fp32.
 *
 * One 16-row query tile is one mma M tile, and a DFlash block is B = 16 rows: so a CTA takes
 * one block j and one kv head g, and each warp takes one (q head of the group, 16-slot tile)
 * pair: the group's heads share the CTA's K/V tiles (GQA without reloads).
 * - forward: per key tile of 32 rows (context [lo_j, a_j), then the block's own rows):
 *   S = Q·Kᵀ (fragments of Q kept in registers), masked, online softmax on the fragments
 *   (row max and sum over the 4 lanes of a row), then O += P·V with the S accumulators
 *   reused as the A operand. Writes out and lse.
 * - dq: per key tile, S and dP = dO·Vᵀ, P = exp(S − lse), dS = P·(dP − Δ), dQ += dS·K.
 * - dk, dv: one CTA per 64 key rows and kv head (each warp 16 keys), visiting in a fixed
 *   order every block that sees the tile, every head of the group and every 16-slot tile:
 *   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, then dV += Pᵀ·dO and dK += dSᵀ·Q. Each output element is
 *   owned by one lane: no atomics, the same bits every run.
 * Shapes: head_dim 16, 32, 64 or 128 (template instances), B ≤ 64, (nq/nkv)·ceil(B/16) ≤ 8;
 * kn_dflash_mma_supported says so, and kn_dflash_attn.cu falls back to the fp32 kernels
 * otherwise. Fragments are built with plain shared-memory loads (no ldmatrix): simple first. */
#include "kn_cuda.h"
#include "kn_dflash_attn_int.h"

#include <cuda_bf16.h>
#include <math.h>

#define DFM_KT        32 /* keys per tile in fwd and dq: 4 mma N tiles */
#define DFM_DKV_KEYS  64 /* keys per CTA in dkv: 4 warps × 16 */
#define DFM_MAX_UNITS 8  /* warps per CTA in fwd and dq */
#define DFM_FULL      0xffffffffu

// ----------------------------------------------------------------------------
// mma fragments (PTX ISA, mma.m16n8k16 with .bf16: g = lane / 4, t = lane % 4)
//   A 16×16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16×8:            b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C 16×8 fp32:       c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low half) = lo */
    return *reinterpret_cast<uint32_t *>(&v);
}

static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* A fragment of the 16×16 block of M (row-major, ld) at rows r0.., cols c0... */
static __device__ __forceinline__ void frag_a(uint32_t a[4], const float *M, int ld, int r0, int c0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const float *p0 = M + (r0 + g) * ld + c0 + 2 * t, *p1 = p0 + 8 * ld;
    a[0] = pack_bf16(p0[0], p0[1]);
    a[1] = pack_bf16(p1[0], p1[1]);
    a[2] = pack_bf16(p0[8], p0[9]);
    a[3] = pack_bf16(p1[8], p1[9]);
}

/* B fragment with B[k][n] = M[n0 + n][k0 + k] (M row-major by n: Kᵀ from K [key][d]). */
static __device__ __forceinline__ void frag_b_nk(uint32_t b[2], const float *M, int ld, int n0, int k0) {
    const int    g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const float *p = M + (n0 + g) * ld + k0 + 2 * t;
    b[0] = pack_bf16(p[0], p[1]);
    b[1] = pack_bf16(p[8], p[9]);
}

/* B fragment with B[k][n] = M[k0 + k][n0 + n] (M row-major by k: V [key][d] for P·V). */
static __device__ __forceinline__ void frag_b_kn(uint32_t b[2], const float *M, int ld, int k0, int n0) {
    const int    g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const float *p = M + (k0 + 2 * t) * ld + n0 + g;
    b[0] = pack_bf16(p[0], p[ld]);
    b[1] = pack_bf16(p[8 * ld], p[9 * ld]);
}

/* The C accumulators of two adjacent 16×8 tiles (columns 0..7 and 8..15 of a k16 step) as
 * the A fragment of the next product: P·V, dS·K, Pᵀ·dO, dSᵀ·Q. */
static __device__ __forceinline__ void c_to_a(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

static __device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(DFM_FULL, v, 1));
    return fmaxf(v, __shfl_xor_sync(DFM_FULL, v, 2));
}

static __device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(DFM_FULL, v, 1);
    return v + __shfl_xor_sync(DFM_FULL, v, 2);
}

/* Stages the query-side rows of block j for the group of kv head g: row u·16 + i of dst is
 * q head g·group + u / MT, slot (u % MT)·16 + i (zero for slots ≥ B); src is [rows, nq, hd]. */
static __device__ void load_q_rows(const df_params &p, const float *src, int64_t j, int g, int n_units, int MT,
                                   float *dst, int ld) {
    const int hd = p.hd, group = p.nq / p.nkv;
    for (int i = threadIdx.x; i < n_units * 16 * hd; i += blockDim.x) {
        const int row = i / hd, d = i % hd, u = row / 16;
        const int h = g * group + u / MT, slot = (u % MT) * 16 + row % 16;
        dst[row * ld + d] = slot < p.B ? src[((j * p.B + slot) * p.nq + h) * (int64_t)hd + d] : 0.0f;
    }
}

/* Per-row values (lse or Δ) of block j for head h, slots 0..n-1 (0 past B). */
static __device__ void load_row_vals(const df_params &p, const float *src, int64_t j, int h, float *dst, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dst[i] = i < p.B ? src[(j * p.B + i) * p.nq + h] : 0.0f;
}

// ----------------------------------------------------------------------------
// forward

template <int HD>
static __global__ void __launch_bounds__(32 * DFM_MAX_UNITS) dflash_mma_fwd_kernel(const df_params p) {
    extern __shared__ float sm[];
    constexpr int  LD = HD + 4, KS = HD / 16, NT = HD / 8;
    const int      B = p.B, MT = (B + 15) / 16, n_units = blockDim.x / 32;
    float         *q_s = sm;                   /* [n_units·16, LD] */
    float         *k_s = q_s + n_units * 16 * LD; /* [DFM_KT, LD] */
    float         *v_s = k_s + DFM_KT * LD;       /* [DFM_KT, LD] */
    const int64_t  j = blockIdx.x;
    const int      g = blockIdx.y, lane = threadIdx.x % 32, u = threadIdx.x / 32;
    const int      gq = lane / 4, tq = lane % 4;
    const int      h = g * (p.nq / p.nkv) + u / MT, s0 = (u % MT) * 16; /* this warp's head and slots */
    const df_range rg = block_range(p, j);

    load_q_rows(p, p.q, j, g, n_units, MT, q_s, LD);
    __syncthreads();
    uint32_t qf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
        frag_a(qf[ks], q_s, LD, u * 16, ks * 16);
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows s0 + gq, s0 + gq + 8 */

    const int n_ct = (int)((rg.hi - rg.lo + DFM_KT - 1) / DFM_KT), n_bt = (B + DFM_KT - 1) / DFM_KT;
    for (int tile = 0; tile < n_ct + n_bt; tile++) {
        const bool    is_ctx = tile < n_ct;
        const int64_t base = is_ctx ? rg.lo + (int64_t)tile * DFM_KT : (int64_t)(tile - n_ct) * DFM_KT;
        const int64_t left = is_ctx ? rg.hi - base : B - base;
        const int     nk = left < DFM_KT ? (int)left : DFM_KT;
        __syncthreads(); /* the previous tile is consumed */
        load_kv_rows(p, is_ctx, j, base, nk, DFM_KT, g, k_s, LD, v_s, LD);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t b[2];
                frag_b_nk(b, k_s, LD, nt * 8, ks * 16);
                mma_bf16(s[nt], qf[ks], b);
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int     row = s0 + gq + (e >= 2 ? 8 : 0), ki = nt * 8 + 2 * tq + (e & 1);
                const int64_t key = base + ki;
                const bool    vis = row < B && ki < nk &&
                                 (is_ctx ? ctx_visible(p, rg, row, key) : blk_visible(p, row, key));
                s[nt][e] = vis ? s[nt][e] * p.scale : -INFINITY;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
            }
        float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float m_new = fmaxf(m[r], quad_max(mx[r]));
            corr[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new); /* 0 when m was -inf */
            mx[r] = m_new;
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                s[nt][e] = s[nt][e] == -INFINITY ? 0.0f : expf(s[nt][e] - mx[r]);
                sum[r] += s[nt][e];
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] = l[r] * corr[r] + quad_sum(sum[r]);
            m[r] = mx[r];
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            o[nt][0] *= corr[0];
            o[nt][1] *= corr[0];
            o[nt][2] *= corr[1];
            o[nt][3] *= corr[1];
        }
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint32_t a[4];
            c_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint32_t b[2];
                frag_b_kn(b, v_s, LD, kk * 16, nt * 8);
                mma_bf16(o[nt], a, b);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        if (slot >= B)
            continue;
        const int64_t task = (j * B + slot) * p.nq + h;
        const float   inv = 1.0f / l[r];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            p.out[task * HD + nt * 8 + 2 * tq] = o[nt][2 * r] * inv;
            p.out[task * HD + nt * 8 + 2 * tq + 1] = o[nt][2 * r + 1] * inv;
        }
        if (tq == 0)
            p.lse[task] = m[r] + logf(l[r]);
    }
}

// ----------------------------------------------------------------------------
// backward: dq

template <int HD>
static __global__ void __launch_bounds__(32 * DFM_MAX_UNITS) dflash_mma_dq_kernel(const df_params p,
                                                                                const float *delta) {
    extern __shared__ float sm[];
    constexpr int  LD = HD + 4, KS = HD / 16, NT = HD / 8;
    const int      B = p.B, MT = (B + 15) / 16, n_units = blockDim.x / 32;
    float         *q_s = sm;                       /* [n_units·16, LD] */
    float         *do_s = q_s + n_units * 16 * LD; /* [n_units·16, LD] */
    float         *k_s = do_s + n_units * 16 * LD; /* [DFM_KT, LD] */
    float         *v_s = k_s + DFM_KT * LD;        /* [DFM_KT, LD] */
    const int64_t  j = blockIdx.x;
    const int      g = blockIdx.y, lane = threadIdx.x % 32, u = threadIdx.x / 32;
    const int      gq = lane / 4, tq = lane % 4;
    const int      h = g * (p.nq / p.nkv) + u / MT, s0 = (u % MT) * 16;
    const df_range rg = block_range(p, j);

    load_q_rows(p, p.q, j, g, n_units, MT, q_s, LD);
    load_q_rows(p, p.dout, j, g, n_units, MT, do_s, LD);
    __syncthreads();
    uint32_t qf[KS][4], df[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        frag_a(qf[ks], q_s, LD, u * 16, ks * 16);
        frag_a(df[ks], do_s, LD, u * 16, ks * 16);
    }
    float lse[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        lse[r] = slot < B ? p.lse[(j * B + slot) * p.nq + h] : 0.0f;
        dl[r] = slot < B ? delta[(j * B + slot) * p.nq + h] : 0.0f;
    }
    float dq[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;

    const int n_ct = (int)((rg.hi - rg.lo + DFM_KT - 1) / DFM_KT), n_bt = (B + DFM_KT - 1) / DFM_KT;
    for (int tile = 0; tile < n_ct + n_bt; tile++) {
        const bool    is_ctx = tile < n_ct;
        const int64_t base = is_ctx ? rg.lo + (int64_t)tile * DFM_KT : (int64_t)(tile - n_ct) * DFM_KT;
        const int64_t left = is_ctx ? rg.hi - base : B - base;
        const int     nk = left < DFM_KT ? (int)left : DFM_KT;
        __syncthreads();
        load_kv_rows(p, is_ctx, j, base, nk, DFM_KT, g, k_s, LD, v_s, LD);
        __syncthreads();
        float s[4][4], dp[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t b[2];
                frag_b_nk(b, k_s, LD, nt * 8, ks * 16);
                mma_bf16(s[nt], qf[ks], b);
                frag_b_nk(b, v_s, LD, nt * 8, ks * 16);
                mma_bf16(dp[nt], df[ks], b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int     r = e >> 1, row = s0 + gq + 8 * r, ki = nt * 8 + 2 * tq + (e & 1);
                const int64_t key = base + ki;
                const bool    vis = row < B && ki < nk &&
                                 (is_ctx ? ctx_visible(p, rg, row, key) : blk_visible(p, row, key));
                const float pr = vis ? expf(s[nt][e] * p.scale - lse[r]) : 0.0f;
                s[nt][e] = pr * (dp[nt][e] - dl[r]); /* dS */
            }
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint32_t a[4];
            c_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint32_t b[2];
                frag_b_kn(b, k_s, LD, kk * 16, nt * 8);
                mma_bf16(dq[nt], a, b);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        if (slot >= B)
            continue;
        float *dst = p.dq + ((j * B + slot) * p.nq + h) * (int64_t)HD;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            dst[nt * 8 + 2 * tq] = dq[nt][2 * r] * p.scale;
            dst[nt * 8 + 2 * tq + 1] = dq[nt][2 * r + 1] * p.scale;
        }
    }
}

// ----------------------------------------------------------------------------
// backward: dk, dv

/* blk_mode 0: CTA x covers context rows [64x, 64x + 64) and visits every block whose range
 * meets them; blk_mode 1: CTA x covers the B ≤ 64 block rows of block x. */
template <int HD>
static __global__ void __launch_bounds__(128) dflash_mma_dkv_kernel(const df_params p, const float *delta,
                                                                  int blk_mode) {
    extern __shared__ float sm[];
    constexpr int LD = HD + 4, KS = HD / 16, NT = HD / 8;
    const int     B = p.B, MT = (B + 15) / 16, SP = MT * 16, group = p.nq / p.nkv;
    float        *k_s = sm;                    /* [64, LD] */
    float        *v_s = k_s + DFM_DKV_KEYS * LD; /* [64, LD] */
    float        *q_s = v_s + DFM_DKV_KEYS * LD; /* [SP, LD] */
    float        *do_s = q_s + SP * LD;          /* [SP, LD] */
    float        *lse_s = do_s + SP * LD;        /* [SP] */
    float        *dl_s = lse_s + SP;             /* [SP] */
    const int     g = blockIdx.y, lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int     gq = lane / 4, tq = lane % 4;
    int64_t       key0, j_begin, j_end;
    int           nk;
    if (!blk_mode) {
        key0 = (int64_t)blockIdx.x * DFM_DKV_KEYS;
        nk = p.T - key0 < DFM_DKV_KEYS ? (int)(p.T - key0) : DFM_DKV_KEYS;
        j_begin = 0;
        j_end = p.n_blocks;
    } else {
        key0 = 0;
        nk = B;
        j_begin = blockIdx.x;
        j_end = j_begin + 1;
    }
    load_kv_rows(p, !blk_mode, j_begin, key0, nk, DFM_DKV_KEYS, g, k_s, LD, v_s, LD);
    float dk[NT][4], dv[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[nt][e] = dv[nt][e] = 0.0f;

    for (int64_t j = j_begin; j < j_end; j++) {
        const df_range rg = block_range(p, j);
        if (!blk_mode && (key0 >= rg.hi || key0 + nk <= rg.lo)) /* CTA-uniform */
            continue;
        for (int h = g * group; h < (g + 1) * group; h++) {
            __syncthreads(); /* the previous (j, h) is consumed; k_s, v_s are staged */
            for (int i = threadIdx.x; i < SP * HD; i += blockDim.x) {
                const int     slot = i / HD, d = i % HD;
                const int64_t off = ((j * B + slot) * p.nq + h) * (int64_t)HD + d;
                q_s[slot * LD + d] = slot < B ? p.q[off] : 0.0f;
                do_s[slot * LD + d] = slot < B ? p.dout[off] : 0.0f;
            }
            load_row_vals(p, p.lse, j, h, lse_s, SP);
            load_row_vals(p, delta, j, h, dl_s, SP);
            __syncthreads();
            for (int sc = 0; sc < MT; sc++) {
                /* Sᵀ and dPᵀ: this warp's 16 keys × 16 slots */
                float st[2][4], dpt[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    uint32_t ak[4], av[4];
                    frag_a(ak, k_s, LD, w * 16, ks * 16);
                    frag_a(av, v_s, LD, w * 16, ks * 16);
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        uint32_t b[2];
                        frag_b_nk(b, q_s, LD, sc * 16 + nt * 8, ks * 16);
                        mma_bf16(st[nt], ak, b);
                        frag_b_nk(b, do_s, LD, sc * 16 + nt * 8, ks * 16);
                        mma_bf16(dpt[nt], av, b);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int     kr = w * 16 + gq + (e >= 2 ? 8 : 0), slot = sc * 16 + nt * 8 + 2 * tq + (e & 1);
                        const int64_t key = key0 + kr;
                        bool          vis = kr < nk && slot < B;
                        if (vis)
                            vis = blk_mode ? blk_visible(p, slot, key) : key < rg.hi && ctx_visible(p, rg, slot, key);
                        const float pr = vis ? expf(st[nt][e] * p.scale - lse_s[slot]) : 0.0f;
                        st[nt][e] = pr;
                        dpt[nt][e] = pr * (dpt[nt][e] - dl_s[slot]); /* dSᵀ */
                    }
                uint32_t ap[4], ads[4];
                c_to_a(ap, st[0], st[1]);
                c_to_a(ads, dpt[0], dpt[1]);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    uint32_t b[2];
                    frag_b_kn(b, do_s, LD, sc * 16, nt * 8);
                    mma_bf16(dv[nt], ap, b);
                    frag_b_kn(b, q_s, LD, sc * 16, nt * 8);
                    mma_bf16(dk[nt], ads, b);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int kr = w * 16 + gq + 8 * r;
        if (kr >= nk)
            continue;
        const int64_t row = blk_mode ? j_begin * B + kr : key0 + kr;
        float        *dko = (blk_mode ? p.dk_blk : p.dk_ctx) + (row * p.nkv + g) * (int64_t)HD;
        float        *dvo = (blk_mode ? p.dv_blk : p.dv_ctx) + (row * p.nkv + g) * (int64_t)HD;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            dko[nt * 8 + 2 * tq] = dk[nt][2 * r] * p.scale;
            dko[nt * 8 + 2 * tq + 1] = dk[nt][2 * r + 1] * p.scale;
            dvo[nt * 8 + 2 * tq] = dv[nt][2 * r];
            dvo[nt * 8 + 2 * tq + 1] = dv[nt][2 * r + 1];
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

int kn_dflash_mma_supported(const df_params *p) {
    const int units = (p->nq / p->nkv) * ((p->B + 15) / 16);
    return (p->hd == 16 || p->hd == 32 || p->hd == 64 || p->hd == 128) && p->B <= 64 && units <= DFM_MAX_UNITS;
}

static cm_status opt_in(kn_ctx *ctx, const void *kernel, size_t smem, const df_params *p) {
    int optin = 0;
    KN_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
    if (smem > (size_t)optin)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "dflash_attn (bf16 tensor cores): block size %d, head_dim %d and %d q heads per kv head "
                       "need %zu bytes of shared memory; this device allows %d per block",
                       p->B, p->hd, p->nq / p->nkv, smem, optin);
    KN_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return CM_OK;
}

template <int HD>
static cm_status mma_fwd(kn_ctx *ctx, const df_params *p) {
    const int    units = (p->nq / p->nkv) * ((p->B + 15) / 16), LD = HD + 4;
    const size_t smem = sizeof(float) * ((size_t)units * 16 * LD + (size_t)2 * DFM_KT * LD);
    CM_TRY(opt_in(ctx, (const void *)dflash_mma_fwd_kernel<HD>, smem, p));
    dim3 grid((unsigned int)p->n_blocks, (unsigned int)p->nkv);
    dflash_mma_fwd_kernel<HD><<<grid, 32 * units, smem, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int HD>
static cm_status mma_bwd(kn_ctx *ctx, const df_params *p, const float *delta) {
    const int units = (p->nq / p->nkv) * ((p->B + 15) / 16), LD = HD + 4, SP = (p->B + 15) / 16 * 16;
    if (p->n_blocks > 0) {
        const size_t smem = sizeof(float) * ((size_t)2 * units * 16 * LD + (size_t)2 * DFM_KT * LD);
        CM_TRY(opt_in(ctx, (const void *)dflash_mma_dq_kernel<HD>, smem, p));
        dim3 grid((unsigned int)p->n_blocks, (unsigned int)p->nkv);
        dflash_mma_dq_kernel<HD><<<grid, 32 * units, smem, ctx->stream>>>(*p, delta);
        KN_CUDA_LAUNCHED(ctx);
    }
    const size_t smem = sizeof(float) * ((size_t)2 * DFM_DKV_KEYS * LD + (size_t)2 * SP * LD + (size_t)2 * SP);
    CM_TRY(opt_in(ctx, (const void *)dflash_mma_dkv_kernel<HD>, smem, p));
    if (p->T > 0) { /* every context row is written, zero where no block sees it */
        dim3 grid((unsigned int)((p->T + DFM_DKV_KEYS - 1) / DFM_DKV_KEYS), (unsigned int)p->nkv);
        dflash_mma_dkv_kernel<HD><<<grid, 128, smem, ctx->stream>>>(*p, delta, 0);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (p->n_blocks > 0) {
        dim3 grid((unsigned int)p->n_blocks, (unsigned int)p->nkv);
        dflash_mma_dkv_kernel<HD><<<grid, 128, smem, ctx->stream>>>(*p, delta, 1);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}

cm_status kn_dflash_mma_fwd(kn_ctx *ctx, const df_params *p) {
    switch (p->hd) {
    case 16: return mma_fwd<16>(ctx, p);
    case 32: return mma_fwd<32>(ctx, p);
    case 64: return mma_fwd<64>(ctx, p);
    case 128: return mma_fwd<128>(ctx, p);
    default:
        return CM_FAIL(CM_ERR_UNSUPPORTED, "dflash_attn (bf16 tensor cores): head_dim %d (use 16, 32, 64 or 128)",
                       p->hd);
    }
}

cm_status kn_dflash_mma_bwd(kn_ctx *ctx, const df_params *p, const float *delta) {
    switch (p->hd) {
    case 16: return mma_bwd<16>(ctx, p, delta);
    case 32: return mma_bwd<32>(ctx, p, delta);
    case 64: return mma_bwd<64>(ctx, p, delta);
    case 128: return mma_bwd<128>(ctx, p, delta);
    default:
        return CM_FAIL(CM_ERR_UNSUPPORTED, "dflash_attn (bf16 tensor cores): head_dim %d (use 16, 32, 64 or 128)",
                       p->hd);
    }
}
