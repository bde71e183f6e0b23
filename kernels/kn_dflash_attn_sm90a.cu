/* kernels/kn_dflash_attn_sm90a.cu — the DFlash block attention's bf16 tensor-core kernels on
 * Hopper's warpgroup MMA. Compiled for sm_90a only, into the kn_sm90a object
 * (kernels/CMakeLists.txt); kn_dflash_attn_mma.cu runs them on compute capability 9.0 for head dims
 * 64 and 128 where TANDEM_DFLASH_KERNEL=wgmma, and its mma.sync kernels otherwise: on an H100 at the
 * Qwen3.6-27B drafter shape these take 1.30 ms forward and 4.00 ms backward a layer against 1.02
 * and 3.59 ms for mma.sync (one warpgroup per CTA, no overlap of softmax and MMA). The
 * operands (the bf16 copies and Δ that file makes), the masks, which CTA writes which output and
 * the order in which a dk/dv CTA visits the blocks (kn_dflash_attn_int.h) are those of the mma.sync
 * kernels, so the two differ only in the order of fp32 additions inside the tensor cores.
 *
 * Every CTA is one warpgroup whose products have M = 64 (wgmma m64nNk16), with every shared
 * operand in the 128-byte swizzle of kn_wgmma_sm90.h, streamed by cp.async through two stages.
 * A [row][d] tile serves as the K-major B of S = Q·Kᵀ and, read MN-major, as the B of the products
 * that contract over its rows (P·V, dS·K, Pᵀ·dO, dSᵀ·Q): nothing is transposed in memory.
 * - forward: one CTA per (block j, 64 of its query rows, kv head g), every head of the group ×
 *   the block's slots as rows. Per tile of 64 keys (the context range [lo_j, a_j), then the
 *   block's own rows): S = Q·Kᵀ, the mask, the online softmax in base 2 on the accumulators,
 *   O += P·V with P from registers. Writes out and lse.
 * - dq: the same CTA and tile loop: S = Q·Kᵀ, dP = dO·Vᵀ, P = exp2(S·scale − lse),
 *   dS = P·(dP − Δ), dQ += dS·K.
 * - dk, dv: one CTA per 64 context keys (or one block's own keys) and kv head, K and V staying in
 *   shared memory; items of 64 query rows of the blocks that see the keys stream through:
 *   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, then dV += Pᵀ·dO, dK += dSᵀ·Q. dK and dV (64 keys × HD in fp32) stay
 *   in the warpgroup's registers from the first item to the last.
 * Each output element is summed by one thread in one order: the same bits every run. The mma.sync
 * kernels load every fragment through ldmatrix per warp (the dk/dv kernel was bound by shared
 * memory bandwidth); a wgmma reads its shared operands once per warpgroup. Two CTAs per SM: at
 * HD 128 the dk/dv CTA holds 97 KB of shared memory and ≤ 255 registers a thread. */
#include "kn_dflash_attn_int.h"
#include "kn_wgmma_sm90.h"

#include <math.h>
#include <stdint.h>

#define DFW_KEYS    64 /* keys per CTA: the M of every product */
#define DFW_QR      64 /* query rows per item */
#define DFW_THREADS 128
#define DFW_LOG2E   1.4426950408889634f
#define DFW_LN2     0.6931471805599453f

/* Shared memory in bytes, each part 1024-aligned: K and V of the CTA's keys (HD / 64 blocks of 64
 * rows × 128 bytes, the 128-byte swizzle of kn_wgmma_sm90.h), then two stages of Q and dO (the
 * same shape) with the item's lse (log2 units) and Δ. */
template <int HD> struct dfw_layout {
    static constexpr int    TILE = HD / 64 * 64 * 128;
    static constexpr int    STAGE = (2 * TILE + 2 * DFW_QR * 4 + 1023) / 1024 * 1024;
    static constexpr size_t BYTES = 2 * (size_t)TILE + 2 * (size_t)STAGE + 1024;
};

/* The byte offset of 16-byte chunk cc (of HD / 8) of row r (< 64) in a tile. */
static __device__ __forceinline__ int dfw_off(int r, int cc) {
    return (cc >> 3) * (64 * 128) + wg_swz(r, cc & 7);
}

/* Key rows [row0, row0 + nk) of kv head g of the joint K/V copies into ks, vs (zeros past nk). */
template <int HD>
static __device__ void dfw_load_kv(const df_params &p, const bf16 *kb, const bf16 *vb, int g, int64_t row0,
                                   int nk, unsigned char *ks, unsigned char *vs) {
    constexpr int CH = HD / 8;
#pragma unroll 1
    for (int i = threadIdx.x; i < DFW_KEYS * CH; i += DFW_THREADS) {
        const int     r = i / CH, cc = i % CH;
        const bool    ok = r < nk;
        const int64_t off = ok ? ((row0 + r) * p.nkv + g) * (int64_t)HD + cc * 8 : 0;
        cp_async16(ks + dfw_off(r, cc), kb + off, ok);
        cp_async16(vs + dfw_off(r, cc), vb + off, ok);
    }
}

/* Query rows [c·64, c·64 + 64) of block j for kv head g from src ([R, nq, HD] bf16) into a
 * tile: virtual row r is q head g·group + r / SP, slot r % SP (SP = ceil(B / 16)·16), zeros where
 * that is no real row. */
template <int HD>
static __device__ void dfw_load_q(const df_params &p, const bf16 *src, int g, int64_t j, int c,
                                  unsigned char *dst) {
    constexpr int CH = HD / 8;
    const int     group = p.nq / p.nkv, SP = (p.B + 15) / 16 * 16;
#pragma unroll 1
    for (int i = threadIdx.x; i < DFW_QR * CH; i += DFW_THREADS) {
        const int     r = i / CH, cc = i % CH, vr = c * DFW_QR + r;
        const int     h = g * group + vr / SP, slot = vr % SP;
        const bool    ok = vr < group * SP && slot < p.B;
        const int64_t off = ok ? ((j * p.B + slot) * p.nq + h) * (int64_t)HD + cc * 8 : 0;
        cp_async16(dst + dfw_off(r, cc), src + off, ok);
    }
}

/* The query-side index of virtual row vr of block j: (j·B + slot)·nq + head, or −1 when vr is
 * no real row. */
static __device__ __forceinline__ int64_t dfw_task(const df_params &p, int g, int64_t j, int vr) {
    const int SP = (p.B + 15) / 16 * 16, slot = vr % SP;
    if (vr >= (p.nq / p.nkv) * SP || slot >= p.B)
        return -1;
    return (j * p.B + slot) * p.nq + g * (p.nq / p.nkv) + vr / SP;
}

/* Item (j, c) of a dk/dv CTA into a stage: Q and dO rows (dfw_load_q), then the rows' lse (log2
 * units) and Δ by plain stores (read after the barrier that precedes the item's use). */
template <int HD>
static __device__ void dfw_load_item(const df_params &p, const bf16 *qb, const bf16 *dob, const float *delta,
                                     int g, int64_t j, int c, unsigned char *stage) {
    float *lse_s = reinterpret_cast<float *>(stage + 2 * dfw_layout<HD>::TILE), *dl_s = lse_s + DFW_QR;
    dfw_load_q<HD>(p, qb, g, j, c, stage);
    dfw_load_q<HD>(p, dob, g, j, c, stage + dfw_layout<HD>::TILE);
    for (int r = threadIdx.x; r < DFW_QR; r += DFW_THREADS) {
        const int64_t task = dfw_task(p, g, j, c * DFW_QR + r);
        lse_s[r] = task >= 0 ? p.lse[task] * DFW_LOG2E : 0.0f;
        dl_s[r] = task >= 0 ? delta[task] : 0.0f;
    }
}

/* acc += A (registers, four k16 steps) · B (MN-major at desc bm, 16 rows of K per step). */
template <int HD>
static __device__ __forceinline__ void dfw_acc(float (&acc)[HD / 2], const uint32_t (&a)[4][4], uint64_t bm) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        if constexpr (HD == 128)
            wgmma_m64n128k16_rs<1>(acc, a[kk], bm + kk * 128, 1); /* 128 units of 16 bytes: 16 rows */
        else
            wgmma_m64n64k16_rs<1>(acc, a[kk], bm + kk * 128, 1);
    }
}

/* Keeps a's registers live to this point (after the wait for the wgmma that reads them). */
static __device__ __forceinline__ void dfw_keep(uint32_t (&a)[4][4]) {
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            asm volatile("" : "+r"(a[k][e])::"memory");
}

/* d = A (64 rows × HD, K-major tile at ad) · B (64 rows × HD, tile at bd)ᵀ: the HD / 16 k steps
 * issued (d's old values ignored), not committed. */
template <int HD> static __device__ __forceinline__ void dfw_nt(float (&d)[32], uint64_t ad, uint64_t bd) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const int off = (kk >> 2) * (64 * 128 / 16) + 2 * (kk & 3); /* units of 16 bytes */
        wgmma_m64n64k16_ss(d, ad + off, bd + off, kk > 0);
    }
}

/* The accumulators of a 64 × 64 product as the A fragments of the four k16 steps of the next. */
static __device__ __forceinline__ void dfw_frags(uint32_t (&a)[4][4], const float (&s)[32]) {
#pragma unroll
    for (int k = 0; k < 4; k++)
        c_to_a(a[k], &s[8 * k], &s[8 * k + 4]);
}

static __device__ __forceinline__ unsigned char *dfw_base(unsigned char *raw) {
    return (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
}

// ----------------------------------------------------------------------------
// forward and dq: one CTA per (block j, 64 of its query rows, kv head g)

/* Shared memory of the forward (NQ = 1: Q) and dq (NQ = 2: Q, dO): the query tiles, then two
 * stages of a key tile's K and V. */
template <int HD, int NQ> static constexpr size_t dfw_q_bytes() {
    return (size_t)(NQ + 4) * dfw_layout<HD>::TILE + 1024;
}

/* The CTA's block j, chunk c of its query rows and kv head g (cta_item's order: blocks from the
 * last), and the rows this thread holds (16w + lane / 4 and + 8 of the chunk): their slots and
 * whether they are real rows. */
typedef struct dfw_rows {
    int64_t j;
    int     c, g, slot[2];
    bool    real[2], all_real;
} dfw_rows;

static __device__ __forceinline__ dfw_rows dfw_rows_of(const df_params &p) {
    const int SP = (p.B + 15) / 16 * 16, rows = (p.nq / p.nkv) * SP, n_chunks = (rows + DFW_QR - 1) / DFW_QR;
    dfw_rows  q;
    int64_t   x;
    cta_item(p.nkv, p.n_blocks * n_chunks, 1, &x, &q.g);
    q.j = x / n_chunks;
    q.c = (int)(x % n_chunks);
    const int r0 = (threadIdx.x / 32) * 16 + (threadIdx.x % 32) / 4;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int vr = q.c * DFW_QR + r0 + 8 * hh;
        q.slot[hh] = vr % SP;
        q.real[hh] = dfw_task(p, q.g, q.j, vr) >= 0;
    }
    q.all_real = (q.c + 1) * DFW_QR <= rows && p.B % 16 == 0;
    return q;
}

/* Does this thread's row hh (0: 16w + lane / 4, 1: + 8) see key ki of tile tl? */
static __device__ __forceinline__ bool dfw_visible(const df_params &p, const df_range &rg, const dfm_tile &tl,
                                                   const dfw_rows &q, int hh, int ki) {
    return q.real[hh] && visible(p, rg, tl, q.slot[hh], ki);
}

/* Key tile t of block j is in stage t & 1 of kv (K, then V, each stage 2·TILE) once this
 * returns: starts tile t + 1 into the other stage, waits for tile t, fences it for the async
 * proxy and syncs the block. */
template <int HD>
static __device__ __forceinline__ void dfw_tile_ready(const df_params &p, const df_range &rg, int64_t j,
                                                      int n_ct, int t, int n_tiles, const bf16 *kb,
                                                      const bf16 *vb, int g, unsigned char *kv) {
    constexpr int TILE = dfw_layout<HD>::TILE;
    if (t + 1 < n_tiles) {
        const dfm_tile tn = tile_of<DFW_KEYS>(p, rg, j, n_ct, t + 1);
        unsigned char *d = kv + ((t + 1) & 1) * 2 * TILE;
        dfw_load_kv<HD>(p, kb, vb, g, tn.row0, tn.nk, d, d + TILE);
    }
    cp_commit();
    cp_wait<1>();
    fence_async_smem();
    __syncthreads();
}

/* Starts block j's first key tile into stage 0 (after the query tiles were started). */
template <int HD>
static __device__ __forceinline__ void dfw_first_tile(const df_params &p, const df_range &rg, int64_t j,
                                                      int n_ct, const bf16 *kb, const bf16 *vb, int g,
                                                      unsigned char *kv) {
    const dfm_tile t0 = tile_of<DFW_KEYS>(p, rg, j, n_ct, 0);
    dfw_load_kv<HD>(p, kb, vb, g, t0.row0, t0.nk, kv, kv + dfw_layout<HD>::TILE);
    cp_commit();
}

/* Per key tile of 64 (the context range [lo_j, a_j), then the block's own rows): S = Q·Kᵀ, the
 * mask, the online softmax (base 2) on the accumulators, O += P·V with V read MN-major. Writes
 * out and lse (natural log). */
template <int HD>
static __global__ void __launch_bounds__(DFW_THREADS, 2)
    dfw_fwd_kernel(const df_params p, const bf16 *qb, const bf16 *kb, const bf16 *vb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int                   TILE = dfw_layout<HD>::TILE;
    extern __shared__ unsigned char dfw_raw[];
    unsigned char                  *qs = dfw_base(dfw_raw), *kv = qs + TILE;
    const dfw_rows                  q = dfw_rows_of(p);
    const int                       tq = threadIdx.x % 4;
    const df_range                  rg = block_range(p, q.j);
    const float                     sc = p.scale * DFW_LOG2E;
    const int n_ct = (int)((rg.hi - rg.lo + DFW_KEYS - 1) / DFW_KEYS), n_tiles = n_ct + 1; /* B ≤ 64 */
    dfw_load_q<HD>(p, qb, q.g, q.j, q.c, qs);
    dfw_first_tile<HD>(p, rg, q.j, n_ct, kb, vb, q.g, kv);

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        o[i] = 0.0f;
    float          m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* log2 units */
    const uint64_t qd = wg_desc(qs);
    for (int t = 0; t < n_tiles; t++) {
        dfw_tile_ready<HD>(p, rg, q.j, n_ct, t, n_tiles, kb, vb, q.g, kv);
        unsigned char *ks = kv + (t & 1) * 2 * TILE, *vs = ks + TILE;
        const dfm_tile tl = tile_of<DFW_KEYS>(p, rg, q.j, n_ct, t);
        const bool     full = q.all_real && tile_full<DFW_KEYS>(p, rg, tl);
        float          s[32];
#pragma unroll
        for (int i = 0; i < 32; i++)
            s[i] = 0.0f;
        wg_fence();
        dfw_nt<HD>(s, qd, wg_desc(ks));
        wg_commit();
        wg_wait0();
        wg_fence_operands(s);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int  hh = e >> 1;
                const bool vis = full || dfw_visible(p, rg, tl, q, hh, 8 * i + 2 * tq + (e & 1));
                s[4 * i + e] = vis ? s[4 * i + e] * sc : -INFINITY;
                mx[hh] = fmaxf(mx[hh], s[4 * i + e]);
            }
        float corr[2], sum[2] = {0.0f, 0.0f};
        softmax_new_max(m, mx, corr);
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const int hh = (i >> 1) & 1;
            s[i] = s[i] == -INFINITY ? 0.0f : exp2f(s[i] - mx[hh]);
            sum[hh] += s[i];
        }
        softmax_fold(m, l, mx, sum, corr);
#pragma unroll
        for (int i = 0; i < HD / 2; i++)
            o[i] *= corr[(i >> 1) & 1];
        uint32_t pa[4][4];
        dfw_frags(pa, s);
        wg_fence();
        dfw_acc<HD>(o, pa, wg_desc_mn(vs, 64 * 128));
        wg_commit();
        wg_wait0();
        wg_fence_operands(o);
        dfw_keep(pa);
        __syncthreads(); /* this stage is consumed before tile t + 2 overwrites it */
    }
    const int r0 = (threadIdx.x / 32) * 16 + (threadIdx.x % 32) / 4;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t task = dfw_task(p, q.g, q.j, q.c * DFW_QR + r0 + 8 * hh);
        if (task < 0)
            continue;
        const float inv = 1.0f / l[hh];
#pragma unroll
        for (int i = 0; i < HD / 8; i++)
            df_st_out2(p, task * HD + 8 * i + 2 * tq, o[4 * i + 2 * hh] * inv, o[4 * i + 2 * hh + 1] * inv);
        if (tq == 0)
            p.lse[task] = (m[hh] + log2f(l[hh])) * DFW_LN2;
    }
#else
    __trap(); /* built without sm_90a code: kn_dflash_wg_supported said no */
#endif
}

/* The same CTA and tile loop: S = Q·Kᵀ and dP = dO·Vᵀ, P = exp2(S·scale − lse), dS = P·(dP − Δ),
 * dQ += dS·K with K read MN-major. */
template <int HD>
static __global__ void __launch_bounds__(DFW_THREADS, 2)
    dfw_dq_kernel(const df_params p, const bf16 *qb, const bf16 *kb, const bf16 *vb, const bf16 *dob,
                  const float *delta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int                   TILE = dfw_layout<HD>::TILE;
    extern __shared__ unsigned char dfw_raw[];
    unsigned char                  *qs = dfw_base(dfw_raw), *dos = qs + TILE, *kv = dos + TILE;
    const dfw_rows                  q = dfw_rows_of(p);
    const int      tq = threadIdx.x % 4, r0 = (threadIdx.x / 32) * 16 + (threadIdx.x % 32) / 4;
    const df_range rg = block_range(p, q.j);
    const float    sc = p.scale * DFW_LOG2E;
    const int      n_ct = (int)((rg.hi - rg.lo + DFW_KEYS - 1) / DFW_KEYS), n_tiles = n_ct + 1;
    dfw_load_q<HD>(p, qb, q.g, q.j, q.c, qs);
    dfw_load_q<HD>(p, dob, q.g, q.j, q.c, dos);
    dfw_first_tile<HD>(p, rg, q.j, n_ct, kb, vb, q.g, kv);
    float lse2[2], dl[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t task = dfw_task(p, q.g, q.j, q.c * DFW_QR + r0 + 8 * hh);
        lse2[hh] = task >= 0 ? p.lse[task] * DFW_LOG2E : 0.0f;
        dl[hh] = task >= 0 ? delta[task] : 0.0f;
    }
    float dq[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        dq[i] = 0.0f;
    const uint64_t qd = wg_desc(qs), dd = wg_desc(dos);
    for (int t = 0; t < n_tiles; t++) {
        dfw_tile_ready<HD>(p, rg, q.j, n_ct, t, n_tiles, kb, vb, q.g, kv);
        unsigned char *ks = kv + (t & 1) * 2 * TILE, *vs = ks + TILE;
        const dfm_tile tl = tile_of<DFW_KEYS>(p, rg, q.j, n_ct, t);
        const bool     full = q.all_real && tile_full<DFW_KEYS>(p, rg, tl);
        float          s[32], dp[32];
#pragma unroll
        for (int i = 0; i < 32; i++)
            s[i] = dp[i] = 0.0f;
        wg_fence();
        dfw_nt<HD>(s, qd, wg_desc(ks));
        dfw_nt<HD>(dp, dd, wg_desc(vs));
        wg_commit();
        wg_wait0();
        wg_fence_operands(s);
        wg_fence_operands(dp);
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int   hh = e >> 1;
                const bool  vis = full || dfw_visible(p, rg, tl, q, hh, 8 * i + 2 * tq + (e & 1));
                const float pr = vis ? exp2f(s[4 * i + e] * sc - lse2[hh]) : 0.0f;
                s[4 * i + e] = pr * (dp[4 * i + e] - dl[hh]); /* dS */
            }
        uint32_t da[4][4];
        dfw_frags(da, s);
        wg_fence();
        dfw_acc<HD>(dq, da, wg_desc_mn(ks, 64 * 128));
        wg_commit();
        wg_wait0();
        wg_fence_operands(dq);
        dfw_keep(da);
        __syncthreads();
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t task = dfw_task(p, q.g, q.j, q.c * DFW_QR + r0 + 8 * hh);
        if (task < 0)
            continue;
        float *dst = p.dq + task * HD;
#pragma unroll
        for (int i = 0; i < HD / 8; i++)
            *reinterpret_cast<float2 *>(dst + 8 * i + 2 * tq) =
                make_float2(dq[4 * i + 2 * hh] * p.scale, dq[4 * i + 2 * hh + 1] * p.scale);
    }
#else
    __trap();
#endif
}

// ----------------------------------------------------------------------------
// dk, dv

/* blk_mode 0: CTA x covers context rows [64x, 64x + 64) and visits every block whose range meets
 * them; blk_mode 1: CTA x covers the B ≤ 64 rows of block x. */
template <int HD>
static __global__ void __launch_bounds__(DFW_THREADS, 2)
    dfw_dkv_kernel(const df_params p, const bf16 *qb, const bf16 *kb, const bf16 *vb, const bf16 *dob,
                   const float *delta, int blk_mode) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef dfw_layout<HD>          Ly;
    extern __shared__ unsigned char dfw_raw[];
    unsigned char                  *ks = dfw_base(dfw_raw);
    unsigned char                  *vs = ks + Ly::TILE, *stages = vs + Ly::TILE;
    const int                       B = p.B, SP = (B + 15) / 16 * 16, rows = (p.nq / p.nkv) * SP;
    const int                       n_chunks = (rows + DFW_QR - 1) / DFW_QR;
    const int   w = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const float sc = p.scale * DFW_LOG2E;
    const dkv_span sp = dkv_span_of(p, blk_mode, DFW_KEYS);
    const int64_t  key0 = sp.key0, row0 = sp.row0, j_begin = sp.j_begin, j_end = sp.j_end;
    const int      nk = sp.nk, g = sp.g;
    dfw_load_kv<HD>(p, kb, vb, g, row0, nk, ks, vs);
    int64_t j = j_begin - 1; /* the first item: block j_begin − 1's "last chunk" advanced */
    int     c = n_chunks;
    dkv_next(p, blk_mode, key0, nk, j_end, n_chunks, &j, &c);
    if (j < j_end)
        dfw_load_item<HD>(p, qb, dob, delta, g, j, c, stages);
    cp_commit();

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        dk[i] = dv[i] = 0.0f;
    const uint64_t kd = wg_desc(ks), vd = wg_desc(vs);
    const int      kr0 = w * 16 + gq; /* this thread's key rows: kr0 and kr0 + 8 */

    for (int st = 0; j < j_end; st ^= 1) {
        int64_t jn = j;
        int     cn = c + 1;
        dkv_next(p, blk_mode, key0, nk, j_end, n_chunks, &jn, &cn);
        if (jn < j_end)
            dfw_load_item<HD>(p, qb, dob, delta, g, jn, cn, stages + (st ^ 1) * Ly::STAGE);
        cp_commit();
        cp_wait<1>();
        fence_async_smem();
        __syncthreads();
        unsigned char *stg = stages + st * Ly::STAGE;
        const float   *lt = reinterpret_cast<const float *>(stg + 2 * Ly::TILE), *dlt = lt + DFW_QR;

        /* Sᵀ and dPᵀ: 64 keys × 64 rows over the head dim */
        float s[32], dp[32];
#pragma unroll
        for (int i = 0; i < 32; i++)
            s[i] = dp[i] = 0.0f;
        wg_fence();
        dfw_nt<HD>(s, kd, wg_desc(stg));
        dfw_nt<HD>(dp, vd, wg_desc(stg + Ly::TILE));
        wg_commit();
        wg_wait0();
        wg_fence_operands(s);
        wg_fence_operands(dp);

        /* P and dSᵀ */
        const df_range rg = block_range(p, j);
        const bool     full = dkv_item_full(p, sp, blk_mode, rg, c, DFW_QR, DFW_KEYS);
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int  kr = kr0 + (e >= 2 ? 8 : 0), r = 8 * i + 2 * tq + (e & 1);
                const bool vis = full || dkv_visible(p, sp, blk_mode, rg, kr, c * DFW_QR + r);
                const float pr = vis ? exp2f(s[4 * i + e] * sc - lt[r]) : 0.0f;
                s[4 * i + e] = pr;
                dp[4 * i + e] = pr * (dp[4 * i + e] - dlt[r]); /* dSᵀ */
            }

        /* dV += Pᵀ·dO and dK += dSᵀ·Q: rows 16k .. 16k + 15 of the item are k step k */
        uint32_t ap[4][4], ad[4][4];
        dfw_frags(ap, s);
        dfw_frags(ad, dp);
        wg_fence();
        dfw_acc<HD>(dv, ap, wg_desc_mn(stg + Ly::TILE, 64 * 128));
        dfw_acc<HD>(dk, ad, wg_desc_mn(stg, 64 * 128));
        wg_commit();
        wg_wait0();
        wg_fence_operands(dv);
        wg_fence_operands(dk);
        dfw_keep(ap);
        dfw_keep(ad);
        __syncthreads(); /* this stage is consumed before the item after next overwrites it */
        j = jn;
        c = cn;
    }
    cp_wait<0>(); /* nothing in flight at exit (the K/V tile when no block sees it) */
#pragma unroll
    for (int h8 = 0; h8 < 2; h8++)
        if (kr0 + 8 * h8 < nk)
            dkv_store<HD>(p, sp, blk_mode, kr0 + 8 * h8, h8, dk, dv);
#else
    __trap(); /* built without sm_90a code: kn_dflash_wg_supported said no */
#endif
}

// ----------------------------------------------------------------------------
// launchers (kn_dflash_attn_int.h)

int kn_dflash_wg_supported(kn_ctx *ctx, const df_params *p) {
    if (!ctx->dflash_wgmma || (p->hd != 64 && p->hd != 128) || p->B > DFW_KEYS)
        return 0;
    int major = 0, minor = 0, optin = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const size_t need = p->hd == 128 ? dfw_layout<128>::BYTES : dfw_layout<64>::BYTES; /* the largest */
    return major == 9 && minor == 0 && need <= (size_t)optin;
}

/* The grid of n work items × nkv kv heads, one dimension (cta_item). */
static cm_status dfw_grid(int64_t n, int nkv, unsigned int *grid) {
    KN_CUDA_CHECK_ARG(n * nkv <= INT32_MAX,
                      "dflash_attn: %lld blocks or key tiles x %d kv heads are too many CTAs", (long long)n,
                      nkv);
    *grid = (unsigned int)(n * nkv);
    return CM_OK;
}

/* 64-row chunks of a block's query rows (every head of the group × the slots). */
static int64_t dfw_chunks(const df_params *p) {
    return ((int64_t)(p->nq / p->nkv) * ((p->B + 15) / 16 * 16) + DFW_QR - 1) / DFW_QR;
}

template <int HD>
static cm_status dfw_fwd(kn_ctx *ctx, const df_params *p, const bf16 *qb, const bf16 *kb, const bf16 *vb) {
    const size_t smem = dfw_q_bytes<HD, 1>();
    unsigned int grid = 0;
    CM_TRY(dfw_grid(p->n_blocks * dfw_chunks(p), p->nkv, &grid));
    KN_CUDA(cudaFuncSetAttribute(dfw_fwd_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dfw_fwd_kernel<HD><<<grid, DFW_THREADS, smem, ctx->stream>>>(*p, qb, kb, vb);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int HD>
static cm_status dfw_bwd(kn_ctx *ctx, const df_params *p, const bf16 *qb, const bf16 *kb, const bf16 *vb,
                         const bf16 *dob, const float *delta) {
    unsigned int grid = 0;
    if (p->n_blocks > 0) {
        const size_t smem = dfw_q_bytes<HD, 2>();
        CM_TRY(dfw_grid(p->n_blocks * dfw_chunks(p), p->nkv, &grid));
        KN_CUDA(
            cudaFuncSetAttribute(dfw_dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        dfw_dq_kernel<HD><<<grid, DFW_THREADS, smem, ctx->stream>>>(*p, qb, kb, vb, dob, delta);
        KN_CUDA_LAUNCHED(ctx);
    }
    const size_t smem = dfw_layout<HD>::BYTES;
    KN_CUDA(cudaFuncSetAttribute(dfw_dkv_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    for (int blk_mode = 0; blk_mode < 2; blk_mode++) {
        /* every context row is written, zero where no block sees it */
        const int64_t n = blk_mode ? p->n_blocks : (p->T + DFW_KEYS - 1) / DFW_KEYS;
        if (n == 0)
            continue;
        CM_TRY(dfw_grid(n, p->nkv, &grid));
        dfw_dkv_kernel<HD><<<grid, DFW_THREADS, smem, ctx->stream>>>(*p, qb, kb, vb, dob, delta, blk_mode);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}

cm_status kn_dflash_wg_fwd(kn_ctx *ctx, const df_params *p, const bf16 *qb, const bf16 *kb, const bf16 *vb) {
    if (p->hd == 128)
        return dfw_fwd<128>(ctx, p, qb, kb, vb);
    if (p->hd == 64)
        return dfw_fwd<64>(ctx, p, qb, kb, vb);
    return CM_FAIL(CM_ERR_UNSUPPORTED, "dflash_attn_fwd: head_dim %d has no wgmma kernel", p->hd);
}

cm_status kn_dflash_wg_bwd(kn_ctx *ctx, const df_params *p, const bf16 *qb, const bf16 *kb, const bf16 *vb,
                           const bf16 *dob, const float *delta) {
    if (p->hd == 128)
        return dfw_bwd<128>(ctx, p, qb, kb, vb, dob, delta);
    if (p->hd == 64)
        return dfw_bwd<64>(ctx, p, qb, kb, vb, dob, delta);
    return CM_FAIL(CM_ERR_UNSUPPORTED, "dflash_attn_bwd: head_dim %d has no wgmma kernels", p->hd);
}
