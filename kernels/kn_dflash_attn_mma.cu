/* kernels/kn_dflash_attn_mma.cu — DFlash block attention on tensor cores (the ctx's BF16
 * GEMM mode): the visibility rules of kn_dflash_attn_int.h and the deterministic backward of
 * the fp32 kernels in kn_dflash_attn.cu, laid out the way FlashAttention-2 lays out its
 * kernels (sm_80 and later: Ampere, Hopper, Blackwell RTX; no wgmma, so one code path).
 *
 * F32 inputs are rounded to bf16 copies in the ctx's scratch, one pass each per call (and dO in
 * the backward), context and block rows of K and V in one array (block j's row s is row
 * T + j·B + s); BF16 inputs (io_dt) are read where they are when aligned and K's (V's) block rows
 * follow its context rows, and copied so otherwise. Every tile is then a 16-byte cp.async
 * stream into shared memory, double-buffered (the next tile loads while this one is multiplied),
 * and every mma.sync.m16n8k16 fragment is one ldmatrix (.trans for the operands stored k-major).
 * Products take bf16 operands (Q, K, V, dO, P, dS) and sum in fp32; the online softmax, lse,
 * Δ and the outputs are fp32 (out stored in io_dt). Softmax exponents are taken base 2 with log2(e) folded
 * into the scale. Tiles that lie wholly inside every slot's visible range skip the mask.
 *
 * - forward: one CTA per (block j, kv head g); warp u takes q head g·group + u / MT and slots
 *   (u % MT)·16 … + 15, so the group's heads share each K/V tile (GQA without reloads). Per
 *   tile of 64 keys (the context range [lo_j, a_j), then the block's own rows): S = Q·Kᵀ with Q
 *   held as fragments, mask, online softmax on the accumulators, O += P·V with P taken from
 *   the S accumulators. Writes out and lse (natural log).
 * - dq: the same CTA and tile loop: S = Q·Kᵀ, dP = dO·Vᵀ, P = exp(S − lse), dS = P·(dP − Δ),
 *   dQ += dS·K. Q and dO stay in shared memory and are read by ldmatrix per k step.
 * - dk, dv: one CTA per 64 key rows and kv head (each warp 16 keys), visiting in a fixed order
 *   every block that sees the tile (context keys) or only the key's own block (block keys), in
 *   items of 64 query rows (every head of the group × the block's slots), Q and dO of the next
 *   item loading while this one is multiplied: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO,
 *   dK += dSᵀ·Q. Each output element is owned by one lane and summed in one order: no
 *   atomics, the same bits every run.
 * On compute capability 9.0 the three run on wgmma instead at head_dim 64 and 128
 * (kn_dflash_attn_sm90a.cu), from the same bf16 copies.
 * Shapes: head_dim 16, 32, 64 or 128 (template instances), B ≤ 64, (nq/nkv)·ceil(B/16) ≤ 8,
 * and the shared memory the device allows (kn_dflash_mma_supported); kn_dflash_attn.cu runs
 * the fp32 kernels otherwise. */
#include "kn_cuda.h"
#include "kn_dflash_attn_int.h"
#include "kn_mma_sm80.h"

#include <cuda_bf16.h>
#include <math.h>

/* Tile sizes. 64-key tiles and 64-row items (2 CTAs per SM, register-bound) measured slower
 * than 32 on an H200 at the Qwen3.6-27B drafter shape (fwd 1.19 vs 1.03 ms, bwd 4.40 vs
 * 4.20 ms per layer), and again on an H100 on 2026-12-06 (64-key tiles: fwd 0.943 ms against
 * 0.845 for 32 under the register cap below), and 32 fits the ~100 KB of shared memory of
 * Blackwell RTX parts too. */
#define DFM_KT        32 /* keys per tile in fwd and dq */
#define DFM_DKV_KEYS  64 /* keys per CTA in dkv: 4 warps × 16 */
#define DFM_QR        32 /* query rows per dkv item */
#define DFM_MAX_UNITS 8  /* warps per CTA in fwd and dq */
#define DFM_FULL      0xffffffffu
/* The forward's and dq's register cap: at most 168 a thread lets three 4-warp CTAs share an SM (the
 * Qwen3.6-27B drafter's shape: 4 query heads a kv head, blocks of 16). Left to itself the compiler
 * took 169-172, which leaves two, and the forward ran 15 % slower (0.999 against 0.845 ms, H100). */
#define DFM_NREG      __maxnreg__(168)
#define DFM_LOG2E     1.4426950408889634f
#define DFM_LN2       0.6931471805599453f

typedef __nv_bfloat16 bf16;

/* Two products over the head dim for one warp: c1 = A1·B1ᵀ and c2 = A2·B2ᵀ on the 16 rows of
 * A at r0 and the NT 8-column tiles of B from row n0 (all four in shared memory, row-major,
 * stride HD + 8): S and dP in dq (Q, dO against K, V), Sᵀ and dPᵀ in dk/dv (K, V against Q,
 * dO). */
template <int HD, int NT>
static __device__ __forceinline__ void mma_pair_nt(float (&c1)[NT][4], float (&c2)[NT][4], const bf16 *A1,
                                                   const bf16 *A2, int r0, const bf16 *B1, const bf16 *B2,
                                                   int n0) {
    constexpr int LD = HD + 8;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            c1[nt][e] = c2[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
        uint32_t a1[4], a2[4];
        frag_a(a1, A1, LD, r0, ks * 16);
        frag_a(a2, A2, LD, r0, ks * 16);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            frag_b_nk(b, B1, LD, n0 + np * 16, ks * 16);
            mma_bf16(c1[2 * np], a1, b[0], b[1]);
            mma_bf16(c1[2 * np + 1], a1, b[2], b[3]);
            frag_b_nk(b, B2, LD, n0 + np * 16, ks * 16);
            mma_bf16(c2[2 * np], a2, b[0], b[1]);
            mma_bf16(c2[2 * np + 1], a2, b[2], b[3]);
        }
    }
}

// ----------------------------------------------------------------------------
// the bf16 copies

/* dst[i] = bf16(src[i]), i < n: four at a time when src is 16-byte aligned (vec), else one. */
static __global__ void dfm_to_bf16_kernel(bf16 *dst, const float *src, int64_t n, int vec) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, n4 = vec ? n / 4 : 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = reinterpret_cast<const float4 *>(src)[i];
        uint2        o;
        o.x = pack_bf16(v.x, v.y);
        o.y = pack_bf16(v.z, v.w);
        reinterpret_cast<uint2 *>(dst)[i] = o;
    }
    for (int64_t i = 4 * n4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* One fp32 array into its place in a bf16 copy (dst is 8-byte aligned: offsets are
 * multiples of hd, itself a multiple of 8). */
static cm_status to_bf16(kn_ctx *ctx, bf16 *dst, const float *src, int64_t n) {
    if (n == 0)
        return CM_OK;
    const int     vec = (uintptr_t)src % 16 == 0;
    const int64_t blocks = ((vec ? n / 4 : n) + 255) / 256;
    dfm_to_bf16_kernel<<<(unsigned int)(blocks < 8192 ? blocks : 8192), 256, 0, ctx->stream>>>(dst, src, n,
                                                                                               vec);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* Δ[task] = Σ_d dout·out (out in io_dt) and dob = bf16(dout), one warp per (query row, q head). */
static __global__ void dfm_delta_kernel(float *delta, bf16 *dob, const float *dout, const void *out, int obf,
                                        int64_t n_tasks, int hd) {
    const int64_t task = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int     lane = threadIdx.x % 32;
    if (task >= n_tasks)
        return; /* whole warps leave together: blockDim is a multiple of 32 */
    float s = 0.0f;
    for (int d = 2 * lane; d < hd; d += 64) { /* hd is even */
        const float2 a = *reinterpret_cast<const float2 *>(dout + task * hd + d);
        float2       b;
        if (obf) {
            const uint32_t u = *reinterpret_cast<const uint32_t *>((const bf16 *)out + task * hd + d);
            b = make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
        } else {
            b = *reinterpret_cast<const float2 *>((const float *)out + task * hd + d);
        }
        s += __fmaf_rn(a.x, b.x, __fmul_rn(a.y, b.y)); /* one contraction, whatever the loads before */
        *reinterpret_cast<uint32_t *>(dob + task * hd + d) = pack_bf16(a.x, a.y);
    }
    for (int o = 16; o > 0; o >>= 1)
        s += __shfl_xor_sync(DFM_FULL, s, o);
    if (lane == 0)
        delta[task] = s;
}

// ----------------------------------------------------------------------------
// tiles

/* Streams rows [row0, row0 + nk) of kv head g of K and V into the stage's k_s, v_s (row
 * stride LD), zero-filling up to KT rows. */
template <int HD, int KT>
static __device__ __forceinline__ void load_kv_tile(const df_params &p, const bf16 *kb, const bf16 *vb, int g,
                                                    int64_t row0, int nk, bf16 *k_s, bf16 *v_s) {
    constexpr int LD = HD + 8, CH = HD / 8;
    /* CH (≤ 16) divides blockDim.x (a multiple of 32): each thread keeps one 16-byte column c and
     * walks rows r0, r0 + rs, ..., so its addresses advance by a constant per row it takes */
    const int     c = threadIdx.x % CH, rs = blockDim.x / CH;
    const int64_t step = (int64_t)rs * p.nkv * HD;
    int64_t       off = ((row0 + threadIdx.x / CH) * p.nkv + g) * (int64_t)HD + c * 8;
    for (int r = threadIdx.x / CH; r < KT; r += rs, off += step) {
        const bool ok = r < nk;
        cp_async16(k_s + r * LD + c * 8, kb + (ok ? off : 0), ok);
        cp_async16(v_s + r * LD + c * 8, vb + (ok ? off : 0), ok);
    }
}

/* Tile t of block j's K/V pipeline is in stage t & 1 once this returns: starts tile t + 1
 * into the other stage (cp.async), waits for tile t (started the step before) and syncs the
 * block. The forward and the dq kernel run the same two-stage pipeline. */
template <int HD, int KT>
static __device__ __forceinline__ void kv_tile_ready(const df_params &p, const df_range &rg, int64_t j,
                                                     int n_ct, int t, int n_tiles, const bf16 *kb,
                                                     const bf16 *vb, int g, bf16 *k_s, bf16 *v_s) {
    constexpr int LD = HD + 8;
    const int     st = t & 1;
    if (t + 1 < n_tiles) {
        const dfm_tile tn = tile_of<KT>(p, rg, j, n_ct, t + 1);
        load_kv_tile<HD, KT>(p, kb, vb, g, tn.row0, tn.nk, k_s + (st ^ 1) * KT * LD,
                             v_s + (st ^ 1) * KT * LD);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
}

/* Streams the query-side rows of block j for kv head g: row u·16 + i is q head
 * g·group + u / MT, slot (u % MT)·16 + i (zero for slots ≥ B); src is [rows, nq, HD] bf16. */
template <int HD>
static __device__ __forceinline__ void load_q_rows(const df_params &p, const bf16 *src, int64_t j, int g,
                                                   int n_rows, int MT, bf16 *dst) {
    constexpr int LD = HD + 8, CH = HD / 8;
    const int     group = p.nq / p.nkv;
    for (int i = threadIdx.x; i < n_rows * CH; i += blockDim.x) {
        const int     row = i / CH, c = i % CH, u = row / 16;
        const int     h = g * group + u / MT, slot = (u % MT) * 16 + row % 16;
        const bool    ok = slot < p.B && u / MT < group;
        const int64_t off = ok ? ((j * p.B + slot) * p.nq + h) * (int64_t)HD + c * 8 : 0;
        cp_async16(dst + row * LD + c * 8, src + off, ok);
    }
}

// ----------------------------------------------------------------------------
// forward

template <int HD, int KT>
static __global__ void DFM_NREG dfm_fwd_kernel(const df_params p, const bf16 *qb, const bf16 *kb,
                                               const bf16 *vb) {
    extern __shared__ __align__(16) unsigned char dfm_sm[];
    constexpr int                                 LD = HD + 8, KS = HD / 16, NT = HD / 8;
    const int                                     B = p.B, MT = (B + 15) / 16, n_units = blockDim.x / 32;
    bf16          *q_s = reinterpret_cast<bf16 *>(dfm_sm); /* [n_units·16, LD] */
    bf16          *k_s = q_s + n_units * 16 * LD;          /* [2][KT, LD] */
    bf16          *v_s = k_s + 2 * KT * LD;                /* [2][KT, LD] */
    int64_t                                       j;
    int                                           g;
    cta_item(p.nkv, p.n_blocks, 1, &j, &g);
    const int      lane = threadIdx.x % 32, u = threadIdx.x / 32;
    const int      gq = lane / 4, tq = lane % 4;
    const int      h = g * (p.nq / p.nkv) + u / MT, s0 = (u % MT) * 16; /* this warp's head and slots */
    const df_range rg = block_range(p, j);
    const float    sc = p.scale * DFM_LOG2E;
    const int n_ct = (int)((rg.hi - rg.lo + KT - 1) / KT), n_bt = (B + KT - 1) / KT, n_tiles = n_ct + n_bt;

    load_q_rows<HD>(p, qb, j, g, n_units * 16, MT, q_s);
    {
        const dfm_tile t0 = tile_of<KT>(p, rg, j, n_ct, 0);
        load_kv_tile<HD, KT>(p, kb, vb, g, t0.row0, t0.nk, k_s, v_s);
    }
    cp_commit();

    uint32_t qf[KS][4];
    float    o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows s0 + gq, s0 + gq + 8 (log2 units) */

    for (int t = 0; t < n_tiles; t++) {
        const int st = t & 1;
        kv_tile_ready<HD, KT>(p, rg, j, n_ct, t, n_tiles, kb, vb, g, k_s, v_s);
        if (t == 0) {
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                frag_a(qf[ks], q_s, LD, u * 16, ks * 16);
        }
        const bf16    *kt = k_s + st * KT * LD, *vt = v_s + st * KT * LD;
        const dfm_tile tl = tile_of<KT>(p, rg, j, n_ct, t);
        const bool     full = tile_full<KT>(p, rg, tl);

        float s[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int np = 0; np < KT / 16; np++) {
                uint32_t b[4];
                frag_b_nk(b, kt, LD, np * 16, ks * 16);
                mma_bf16(s[2 * np], qf[ks], b[0], b[1]);
                mma_bf16(s[2 * np + 1], qf[ks], b[2], b[3]);
            }
        float mx[2] = {-INFINITY, -INFINITY};
        if (full) { /* CTA-uniform: the unmasked tiles take a path without a test per element */
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[nt][e] *= sc;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const bool vis =
                        visible(p, rg, tl, s0 + gq + (e >= 2 ? 8 : 0), nt * 8 + 2 * tq + (e & 1));
                    s[nt][e] = vis ? s[nt][e] * sc : -INFINITY;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
                }
        }
        float corr[2], sum[2] = {0.0f, 0.0f};
        softmax_new_max(m, mx, corr);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                s[nt][e] = s[nt][e] == -INFINITY ? 0.0f : ex2_ftz(s[nt][e] - mx[r]);
                sum[r] += s[nt][e];
            }
        softmax_fold(m, l, mx, sum, corr);
        /* o · 1 is o: once every row's maximum has settled the rescale is skipped */
        if (__any_sync(DFM_FULL, corr[0] != 1.0f || corr[1] != 1.0f))
            scale_rows<NT>(o, corr);
        mma_tile_kn<NT, KT>(o, s, vt, LD);
        __syncthreads(); /* this stage is consumed before tile t + 2 overwrites it */
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        if (slot >= B)
            continue;
        const int64_t task = (j * B + slot) * p.nq + h;
        const float   inv = 1.0f / l[r];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            df_st_out2(p, task * HD + nt * 8 + 2 * tq, o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
        if (tq == 0)
            p.lse[task] = (m[r] + log2f(l[r])) * DFM_LN2;
    }
}

// ----------------------------------------------------------------------------
// backward: dq

template <int HD, int KT>
static __global__ void DFM_NREG dfm_dq_kernel(const df_params p, const bf16 *qb, const bf16 *kb,
                                              const bf16 *vb, const bf16 *dob, const float *delta) {
    extern __shared__ __align__(16) unsigned char dfm_sm[];
    constexpr int                                 LD = HD + 8, NT = HD / 8;
    const int                                     B = p.B, MT = (B + 15) / 16, n_units = blockDim.x / 32;
    bf16          *q_s = reinterpret_cast<bf16 *>(dfm_sm); /* [n_units·16, LD] */
    bf16          *do_s = q_s + n_units * 16 * LD;         /* [n_units·16, LD] */
    bf16          *k_s = do_s + n_units * 16 * LD;         /* [2][KT, LD] */
    bf16          *v_s = k_s + 2 * KT * LD;                /* [2][KT, LD] */
    int64_t                                       j;
    int                                           g;
    cta_item(p.nkv, p.n_blocks, 1, &j, &g);
    const int      lane = threadIdx.x % 32, u = threadIdx.x / 32;
    const int      gq = lane / 4, tq = lane % 4;
    const int      h = g * (p.nq / p.nkv) + u / MT, s0 = (u % MT) * 16;
    const df_range rg = block_range(p, j);
    const float    sc = p.scale * DFM_LOG2E;
    const int n_ct = (int)((rg.hi - rg.lo + KT - 1) / KT), n_bt = (B + KT - 1) / KT, n_tiles = n_ct + n_bt;

    load_q_rows<HD>(p, qb, j, g, n_units * 16, MT, q_s);
    load_q_rows<HD>(p, dob, j, g, n_units * 16, MT, do_s);
    {
        const dfm_tile t0 = tile_of<KT>(p, rg, j, n_ct, 0);
        load_kv_tile<HD, KT>(p, kb, vb, g, t0.row0, t0.nk, k_s, v_s);
    }
    cp_commit();

    float lse2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        lse2[r] = slot < B ? p.lse[(j * B + slot) * p.nq + h] * DFM_LOG2E : 0.0f;
        dl[r] = slot < B ? delta[(j * B + slot) * p.nq + h] : 0.0f;
    }
    float dq[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;

    for (int t = 0; t < n_tiles; t++) {
        const int st = t & 1;
        kv_tile_ready<HD, KT>(p, rg, j, n_ct, t, n_tiles, kb, vb, g, k_s, v_s);
        const bf16    *kt = k_s + st * KT * LD, *vt = v_s + st * KT * LD;
        const dfm_tile tl = tile_of<KT>(p, rg, j, n_ct, t);
        const bool     full = tile_full<KT>(p, rg, tl);

        float s[KT / 8][4], dp[KT / 8][4];
        mma_pair_nt<HD, KT / 8>(s, dp, q_s, do_s, u * 16, kt, vt, 0);
        if (full) { /* CTA-uniform, as in the forward */
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int   r = e >> 1;
                    const float pr = ex2_ftz(s[nt][e] * sc - lse2[r]);
                    s[nt][e] = pr * (dp[nt][e] - dl[r]); /* dS */
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int   r = e >> 1;
                    const bool  vis = visible(p, rg, tl, s0 + gq + 8 * r, nt * 8 + 2 * tq + (e & 1));
                    const float pr = vis ? ex2_ftz(s[nt][e] * sc - lse2[r]) : 0.0f;
                    s[nt][e] = pr * (dp[nt][e] - dl[r]);
                }
        }
        mma_tile_kn<NT, KT>(dq, s, kt, LD);
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int slot = s0 + gq + 8 * r;
        if (slot >= B)
            continue;
        float *dst = p.dq + ((j * B + slot) * p.nq + h) * (int64_t)HD;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            *reinterpret_cast<float2 *>(dst + nt * 8 + 2 * tq) =
                make_float2(dq[nt][0 + 2 * r] * p.scale, dq[nt][1 + 2 * r] * p.scale);
    }
}

// ----------------------------------------------------------------------------
// backward: dk, dv

/* q = v / SP and r = v % SP for the padded slot count SP (a multiple of 16): two bit operations
 * for blocks of up to 16 slots, the usual size, instead of an integer division. */
static __device__ __forceinline__ void sp_divmod(int v, int SP, int *q, int *r) {
    if (SP == 16) {
        *q = v >> 4;
        *r = v & 15;
    } else {
        *q = v / SP;
        *r = v % SP;
    }
}

/* Streams item (j, c)'s query rows of Q and dO, and their lse (log2 units) and Δ. Virtual
 * row r of block j is q head g·group + r / SP, slot r % SP (SP = MT·16). */
template <int HD, int QR>
static __device__ __forceinline__ void load_dkv_item(const df_params &p, const bf16 *qb, const bf16 *dob,
                                                     const float *delta, int g, int64_t j, int c, bf16 *q_s,
                                                     bf16 *do_s, float *lse_s, float *dl_s) {
    constexpr int LD = HD + 8, CH = HD / 8;
    const int     group = p.nq / p.nkv, SP = (p.B + 15) / 16 * 16;
    /* as in load_kv_tile: a fixed column cc, rows r0, r0 + rs, ...; the (head, slot) of a row
     * advanced by rs slots rather than divided out per row */
    const int cc = threadIdx.x % CH, rs = blockDim.x / CH, r0 = threadIdx.x / CH;
    int       h, slot;
    sp_divmod(c * QR + r0, SP, &h, &slot);
    h += g * group;
    for (int r = r0, vr = c * QR + r0; r < QR; r += rs, vr += rs) {
        const bool    ok = vr < group * SP && slot < p.B;
        const int64_t off = ok ? ((j * p.B + slot) * p.nq + h) * (int64_t)HD + cc * 8 : 0;
        cp_async16(q_s + r * LD + cc * 8, qb + off, ok);
        cp_async16(do_s + r * LD + cc * 8, dob + off, ok);
        for (slot += rs; slot >= SP; slot -= SP)
            h++;
    }
    for (int r = threadIdx.x; r < QR; r += blockDim.x) {
        const int vr = c * QR + r;
        int       h, slot;
        sp_divmod(vr, SP, &h, &slot);
        h += g * group;
        const bool ok = vr < group * SP && slot < p.B;
        lse_s[r] = ok ? p.lse[(j * p.B + slot) * p.nq + h] * DFM_LOG2E : 0.0f;
        dl_s[r] = ok ? delta[(j * p.B + slot) * p.nq + h] : 0.0f;
    }
}

/* blk_mode 0: CTA x covers context rows [64x, 64x + 64) and visits every block whose range
 * meets them; blk_mode 1: CTA x covers the B ≤ 64 block rows of block x. */
template <int HD, int QR>
static __global__ void __launch_bounds__(128)
    dfm_dkv_kernel(const df_params p, const bf16 *qb, const bf16 *kb, const bf16 *vb, const bf16 *dob,
                   const float *delta, int blk_mode) {
    extern __shared__ __align__(16) unsigned char dfm_sm[];
    constexpr int                                 LD = HD + 8, NT = HD / 8;
    const int                                     B = p.B, SP = (B + 15) / 16 * 16, group = p.nq / p.nkv;
    const int                                     n_chunks = (group * SP + QR - 1) / QR;
    bf16       *k_s = reinterpret_cast<bf16 *>(dfm_sm);                /* [DFM_DKV_KEYS, LD] */
    bf16       *v_s = k_s + DFM_DKV_KEYS * LD;                         /* [DFM_DKV_KEYS, LD] */
    bf16       *q_s = v_s + DFM_DKV_KEYS * LD;                         /* [2][QR, LD] */
    bf16       *do_s = q_s + 2 * QR * LD;                              /* [2][QR, LD] */
    float      *lse_s = reinterpret_cast<float *>(do_s + 2 * QR * LD); /* [2][QR] */
    float      *dl_s = lse_s + 2 * QR;                                 /* [2][QR] */
    const int                                     lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int   gq = lane / 4, tq = lane % 4;
    const float sc = p.scale * DFM_LOG2E;
    const dkv_span sp = dkv_span_of(p, blk_mode, DFM_DKV_KEYS);
    const int64_t  key0 = sp.key0, row0 = sp.row0, j_begin = sp.j_begin, j_end = sp.j_end;
    const int      nk = sp.nk, g = sp.g;
    load_kv_tile<HD, DFM_DKV_KEYS>(p, kb, vb, g, row0, nk, k_s, v_s);

    /* the first item: block j_begin − 1's "last chunk" advanced */
    int64_t j = j_begin - 1;
    int     c = n_chunks;
    dkv_next(p, blk_mode, key0, nk, j_end, n_chunks, &j, &c);
    if (j < j_end)
        load_dkv_item<HD, QR>(p, qb, dob, delta, g, j, c, q_s, do_s, lse_s, dl_s);
    cp_commit();

    float dk[NT][4], dv[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[nt][e] = dv[nt][e] = 0.0f;

    for (int st = 0; j < j_end; st ^= 1) {
        int64_t jn = j;
        int     cn = c + 1;
        dkv_next(p, blk_mode, key0, nk, j_end, n_chunks, &jn, &cn);
        if (jn < j_end)
            load_dkv_item<HD, QR>(p, qb, dob, delta, g, jn, cn, q_s + (st ^ 1) * QR * LD,
                                  do_s + (st ^ 1) * QR * LD, lse_s + (st ^ 1) * QR, dl_s + (st ^ 1) * QR);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const bf16    *qt = q_s + st * QR * LD, *dt = do_s + st * QR * LD;
        const float   *lt = lse_s + st * QR, *dlt = dl_s + st * QR;
        const df_range rg = block_range(p, j);
        const bool     full = dkv_item_full(p, sp, blk_mode, rg, c, QR, DFM_DKV_KEYS);
#pragma unroll
        for (int sub = 0; sub < QR / 32; sub++) {
            /* Sᵀ and dPᵀ: this warp's 16 keys × 32 query rows */
            float sT[4][4], dpT[4][4];
            mma_pair_nt<HD, 4>(sT, dpT, k_s, v_s, w * 16, qt, dt, sub * 32);
            if (full) { /* CTA-uniform, as in the forward */
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int   r = sub * 32 + nt * 8 + 2 * tq + (e & 1);
                        const float pr = ex2_ftz(sT[nt][e] * sc - lt[r]);
                        sT[nt][e] = pr;
                        dpT[nt][e] = pr * (dpT[nt][e] - dlt[r]); /* dSᵀ */
                    }
            } else {
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int kr = w * 16 + gq + (e >= 2 ? 8 : 0),
                                  r = sub * 32 + nt * 8 + 2 * tq + (e & 1);
                        const bool  vis = dkv_visible(p, sp, blk_mode, rg, kr, c * QR + r);
                        const float pr = vis ? ex2_ftz(sT[nt][e] * sc - lt[r]) : 0.0f;
                        sT[nt][e] = pr;
                        dpT[nt][e] = pr * (dpT[nt][e] - dlt[r]);
                    }
            }
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                uint32_t ap[4], ads[4];
                c_to_a(ap, sT[2 * kk], sT[2 * kk + 1]);
                c_to_a(ads, dpT[2 * kk], dpT[2 * kk + 1]);
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    frag_b_kn(b, dt, LD, sub * 32 + kk * 16, np * 16);
                    mma_bf16(dv[2 * np], ap, b[0], b[1]);
                    mma_bf16(dv[2 * np + 1], ap, b[2], b[3]);
                    frag_b_kn(b, qt, LD, sub * 32 + kk * 16, np * 16);
                    mma_bf16(dk[2 * np], ads, b[0], b[1]);
                    mma_bf16(dk[2 * np + 1], ads, b[2], b[3]);
                }
            }
        }
        __syncthreads(); /* this stage is consumed before the item after next overwrites it */
        j = jn;
        c = cn;
    }
    cp_wait<0>(); /* nothing in flight at exit (the K/V tile when no block sees it) */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int kr = w * 16 + gq + 8 * r;
        if (kr < nk)
            dkv_store<HD>(p, sp, blk_mode, kr, r, &dk[0][0], &dv[0][0]);
    }
}

// ----------------------------------------------------------------------------
// launchers

static int units_of(const df_params *p) {
    return (p->nq / p->nkv) * ((p->B + 15) / 16);
}

static size_t fwd_smem(const df_params *p) {
    return sizeof(bf16) * (size_t)(p->hd + 8) * ((size_t)units_of(p) * 16 + 4 * DFM_KT);
}
static size_t dq_smem(const df_params *p) {
    return sizeof(bf16) * (size_t)(p->hd + 8) * ((size_t)2 * units_of(p) * 16 + 4 * DFM_KT);
}
static size_t dkv_smem(const df_params *p) {
    return sizeof(bf16) * (size_t)(p->hd + 8) * ((size_t)2 * DFM_DKV_KEYS + 4 * DFM_QR) +
           sizeof(float) * 4 * DFM_QR;
}

int kn_dflash_mma_supported(const kn_ctx *ctx, const df_params *p) {
    if (!((p->hd == 16 || p->hd == 32 || p->hd == 64 || p->hd == 128) && p->B <= 64 &&
          units_of(p) <= DFM_MAX_UNITS))
        return 0;
    /* out is stored two elements at a time (and read so by the backward's Δ) */
    if (((uintptr_t)p->out & (p->io_dt == CM_DTYPE_BF16 ? 3u : 7u)) != 0)
        return 0;
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess)
        return 0;
    size_t need = fwd_smem(p);
    need = dq_smem(p) > need ? dq_smem(p) : need;
    need = dkv_smem(p) > need ? dkv_smem(p) : need;
    return need <= (size_t)optin;
}

/* The kernels' bf16 operands: Q [R, nq, hd], K and V [T + R, nkv, hd] (context rows, then block
 * rows), and in the backward dO [R, nq, hd] and Δ [R, nq] (fp32). F32 inputs are rounded into
 * copies in the ctx's scratch; BF16 ones are read in place where 16-byte aligned (K and V: where
 * the block rows follow the context rows) and copied there otherwise. */
typedef struct dfm_bufs {
    const bf16 *q, *k, *v;
    bf16       *dout;
    float      *delta;
} dfm_bufs;

static int aligned16(const void *a) {
    return ((uintptr_t)a & 15u) == 0;
}

/* A BF16 input's joint [T + R] array where it can be read in place, else NULL. */
static const bf16 *joint_in(const df_params *p, const void *ctx_rows, const void *blk_rows) {
    const int64_t ctx_el = p->T * p->nkv * p->hd;
    const bf16   *base = (const bf16 *)(p->T > 0 ? ctx_rows : blk_rows);
    if (!aligned16(base) || (p->T > 0 && p->n_blocks > 0 && (const bf16 *)blk_rows != base + ctx_el))
        return NULL;
    return base;
}

/* The joint array of one of K, V into dst: rounded from F32, or copied from BF16. */
static cm_status joint_copy(kn_ctx *ctx, const df_params *p, bf16 *dst, const void *ctx_rows,
                            const void *blk_rows) {
    const int64_t ctx_el = p->T * p->nkv * p->hd, blk_el = p->n_blocks * p->B * p->nkv * p->hd;
    if (p->io_dt == CM_DTYPE_F32) {
        CM_TRY(to_bf16(ctx, dst, (const float *)ctx_rows, ctx_el));
        return to_bf16(ctx, dst + ctx_el, (const float *)blk_rows, blk_el);
    }
    if (ctx_el > 0)
        KN_CUDA(cudaMemcpyAsync(dst, ctx_rows, sizeof(bf16) * (size_t)ctx_el, cudaMemcpyDeviceToDevice,
                                ctx->stream));
    if (blk_el > 0)
        KN_CUDA(cudaMemcpyAsync(dst + ctx_el, blk_rows, sizeof(bf16) * (size_t)blk_el,
                                cudaMemcpyDeviceToDevice, ctx->stream));
    return CM_OK;
}

static cm_status make_bufs(kn_ctx *ctx, const df_params *p, int bwd, dfm_bufs *b) {
    const int64_t R = p->n_blocks * p->B, nq_el = R * p->nq * p->hd, kv_el = (p->T + R) * p->nkv * p->hd;
    const int     bf = p->io_dt == CM_DTYPE_BF16;
    const bf16   *q_in = bf && aligned16(p->q) ? (const bf16 *)p->q : NULL;
    const bf16   *k_in = bf ? joint_in(p, p->k_ctx, p->k_blk) : NULL;
    const bf16   *v_in = bf ? joint_in(p, p->v_ctx, p->v_blk) : NULL;
    *b = dfm_bufs{};
    const int64_t n16 = (q_in ? 0 : nq_el) + (k_in ? 0 : kv_el) + (v_in ? 0 : kv_el) + (bwd ? nq_el : 0);
    CM_TRY(kn_cuda_scratch_reserve(ctx, sizeof(bf16) * (size_t)n16 +
                                            (bwd ? sizeof(float) * (size_t)(R * p->nq) : 0)));
    bf16 *at = (bf16 *)ctx->scratch; /* every piece a multiple of 16 bytes: hd is a multiple of 8 */
    if (!q_in) {
        if (bf)
            KN_CUDA(cudaMemcpyAsync(at, p->q, sizeof(bf16) * (size_t)nq_el, cudaMemcpyDeviceToDevice,
                                    ctx->stream));
        else
            CM_TRY(to_bf16(ctx, at, (const float *)p->q, nq_el));
        q_in = at, at += nq_el;
    }
    if (!k_in) {
        CM_TRY(joint_copy(ctx, p, at, p->k_ctx, p->k_blk));
        k_in = at, at += kv_el;
    }
    if (!v_in) {
        CM_TRY(joint_copy(ctx, p, at, p->v_ctx, p->v_blk));
        v_in = at, at += kv_el;
    }
    b->q = q_in, b->k = k_in, b->v = v_in;
    b->dout = bwd ? at : NULL;
    b->delta = bwd ? (float *)(at + nq_el) : NULL;
    return CM_OK;
}

/* The one-dimensional grid of cta_item: n·nkv CTAs. */
static cm_status grid_of(int64_t n, int nkv, unsigned int *grid) {
    KN_CUDA_CHECK_ARG(n * nkv <= INT32_MAX,
                      "dflash_attn: %lld blocks or key tiles x %d kv heads are too many CTAs", (long long)n,
                      nkv);
    *grid = (unsigned int)(n * nkv);
    return CM_OK;
}

static cm_status opt_in(kn_ctx *ctx, const void *kernel, size_t smem) {
    KN_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return CM_OK;
}

template <int HD, int KT> static cm_status mma_fwd(kn_ctx *ctx, const df_params *p) {
    dfm_bufs b;
    CM_TRY(make_bufs(ctx, p, 0, &b));
    if (kn_dflash_wg_supported(ctx, p)) /* the wgmma form (kn_dflash_attn_sm90a.cu) */
        return kn_dflash_wg_fwd(ctx, p, b.q, b.k, b.v);
    const size_t smem = fwd_smem(p);
    CM_TRY(opt_in(ctx, (const void *)dfm_fwd_kernel<HD, KT>, smem));
    unsigned int grid = 0;
    CM_TRY(grid_of(p->n_blocks, p->nkv, &grid));
    dfm_fwd_kernel<HD, KT><<<grid, 32 * units_of(p), smem, ctx->stream>>>(*p, b.q, b.k, b.v);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int HD, int KT> static cm_status mma_bwd(kn_ctx *ctx, const df_params *p) {
    dfm_bufs b;
    CM_TRY(make_bufs(ctx, p, 1, &b));
    const int64_t n_q = p->n_blocks * p->B * p->nq;
    if (n_q > 0) {
        const int64_t blocks = (n_q * 32 + 255) / 256;
        KN_CUDA_CHECK_ARG(blocks <= INT32_MAX, "dflash_attn_bwd: %lld query rows are too many",
                          (long long)n_q);
        dfm_delta_kernel<<<(unsigned int)blocks, 256, 0, ctx->stream>>>(b.delta, b.dout, p->dout, p->out,
                                                                        p->io_dt == CM_DTYPE_BF16, n_q, HD);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (kn_dflash_wg_supported(ctx, p)) /* dq and dk/dv on wgmma (kn_dflash_attn_sm90a.cu) */
        return kn_dflash_wg_bwd(ctx, p, b.q, b.k, b.v, b.dout, b.delta);
    if (n_q > 0) {
        const size_t smem = dq_smem(p);
        CM_TRY(opt_in(ctx, (const void *)dfm_dq_kernel<HD, KT>, smem));
        unsigned int grid = 0;
        CM_TRY(grid_of(p->n_blocks, p->nkv, &grid));
        dfm_dq_kernel<HD, KT>
            <<<grid, 32 * units_of(p), smem, ctx->stream>>>(*p, b.q, b.k, b.v, b.dout, b.delta);
        KN_CUDA_LAUNCHED(ctx);
    }
    const size_t smem = dkv_smem(p);
    CM_TRY(opt_in(ctx, (const void *)dfm_dkv_kernel<HD, DFM_QR>, smem));
    if (p->T > 0) { /* every context row is written, zero where no block sees it */
        unsigned int grid = 0;
        CM_TRY(grid_of((p->T + DFM_DKV_KEYS - 1) / DFM_DKV_KEYS, p->nkv, &grid));
        dfm_dkv_kernel<HD, DFM_QR><<<grid, 128, smem, ctx->stream>>>(*p, b.q, b.k, b.v, b.dout, b.delta, 0);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (p->n_blocks > 0) {
        unsigned int grid = 0;
        CM_TRY(grid_of(p->n_blocks, p->nkv, &grid));
        dfm_dkv_kernel<HD, DFM_QR><<<grid, 128, smem, ctx->stream>>>(*p, b.q, b.k, b.v, b.dout, b.delta, 1);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}

#ifndef TANDEM_HAVE_SM90A /* a build without architecture 90 (kernels/CMakeLists.txt) has no wgmma pass */
int kn_dflash_wg_supported(kn_ctx *, const df_params *) {
    return 0;
}
cm_status kn_dflash_wg_fwd(kn_ctx *, const df_params *, const bf16 *, const bf16 *, const bf16 *) {
    return CM_ERR_UNSUPPORTED;
}
cm_status kn_dflash_wg_bwd(kn_ctx *, const df_params *, const bf16 *, const bf16 *, const bf16 *,
                           const bf16 *, const float *) {
    return CM_ERR_UNSUPPORTED;
}
#endif

#define DFM_DISPATCH(fn, ctx, p)                                                                             \
    do {                                                                                                     \
        switch ((p)->hd) {                                                                                   \
        case 16:                                                                                             \
            return fn<16, DFM_KT>(ctx, p);                                                                   \
        case 32:                                                                                             \
            return fn<32, DFM_KT>(ctx, p);                                                                   \
        case 64:                                                                                             \
            return fn<64, DFM_KT>(ctx, p);                                                                   \
        case 128:                                                                                            \
            return fn<128, DFM_KT>(ctx, p);                                                                  \
        default:                                                                                             \
            return CM_FAIL(CM_ERR_UNSUPPORTED,                                                               \
                           "dflash_attn (bf16 tensor cores): head_dim %d (use 16, 32, 64 or 128)", (p)->hd); \
        }                                                                                                    \
    } while (0)

cm_status kn_dflash_mma_fwd(kn_ctx *ctx, const df_params *p) {
    DFM_DISPATCH(mma_fwd, ctx, p);
}

cm_status kn_dflash_mma_bwd(kn_ctx *ctx, const df_params *p) {
    DFM_DISPATCH(mma_bwd, ctx, p);
}
