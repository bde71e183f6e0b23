/* kernels/kn_gdn_state.cu — step 4 of the chunked gated delta rule (kn_gdn_chunk.cu): the state
 * recurrence over each sequence's chunks, from the per-chunk W, U, P, E that gdn_prep_mma left.
 * dk ≤ 128: gdn_state_mma, one block per (sequence, v-head, 64 columns of dv), sequential over
 * the sequence's chunks with the fp32 state transposed, Sᵀ [v, dk], in registers (two warps per
 * 16 rows, one per half of dk) and the chunk's operands double-buffered by cp.async, one block
 * barrier per chunk: δᵀ = Uᵀ − Sᵀ Wᵀ, Oᵀ = Sᵀ Qᵀ ⊙ e^γ + δᵀ Pᵀ, Sᵀ ← e^{γ_last} Sᵀ +
 * (δᵀ ⊙ e^{γ_last−γ}) K. dk 256 (a state too large for the registers): gdn_state, the state
 * slice S[dk, 32] in shared memory, WMMA. On compute capability 9.0, dk ≤ 128 runs the same
 * recurrence on warpgroup MMA instead (kn_gdn_state_sm90a.cu; TANDEM_GDN_KERNEL=mma keeps
 * gdn_state_mma there, for comparing the two). */
#include "kn_cuda.h"
#include "kn_gdn_int.h"
#include "kn_mma_sm80.h"

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

// ----------------------------------------------------------------------------
// kernels

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> gdn_fa_row;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> gdn_fa_col;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> gdn_fb_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> gdn_fb_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float>              gdn_facc;

/* One pipeline stage of gdn_state: the chunk's W, Q, K, U slice, P and E. */
template <int DKP> struct gdn_stage {
    static constexpr int    KS = DKP + 8;
    static constexpr size_t bytes = 3 * (size_t)64 * KS * 2 /* Wb, Qb, Kb */ +
                                    (size_t)64 * GDN_SBS * 2 /* Ub */ + (size_t)64 * GDN_BS * 2 /* Pb */ +
                                    192 * 4 /* Eb */;
};

template <int DKP, int STAGES> struct gdn_state_smem {
    static constexpr size_t bytes = STAGES * gdn_stage<DKP>::bytes + (size_t)DKP * GDN_SFS * 4 /* Sf */ +
                                    (size_t)DKP * GDN_SBS * 2 /* Sb */ +
                                    2 * (size_t)64 * GDN_SBS * 2 /* Db, Dd */;
};

/* Issues the cp.async copies of chunk slot ci (tokens t0 … t0 + L − 1) into stage buffer sb. */
template <int DKP>
static __device__ __forceinline__ void gdn_state_load(unsigned char *sb, const bf16 *Wg, const bf16 *Ug,
                                                      const bf16 *Pg, const float *Eg, const bf16 *qc,
                                                      const bf16 *kc, int64_t slot, int64_t t0, int L, int nk,
                                                      int kh, int DVP, int col0, int tid) {
    constexpr int KS = DKP + 8;
    bf16         *Wb = (bf16 *)sb, *Qb = Wb + 64 * KS, *Kb = Qb + 64 * KS, *Ub = Kb + 64 * KS;
    bf16         *Pb = Ub + 64 * GDN_SBS;
    float        *Eb = (float *)(Pb + 64 * GDN_BS);
    gdn_load_rows<DKP>(Wb, Wg + slot * 64 * DKP, DKP, 64, tid, GDN_THREADS);
    gdn_load_rows<DKP>(Qb, qc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_THREADS);
    gdn_load_rows<DKP>(Kb, kc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_THREADS);
    {
        const int r = tid / 4, c = (tid % 4) * 8; /* 64 rows × 4 vectors: one per thread */
        cp_async16_n(Ub + r * GDN_SBS + c, Ug + (slot * 64 + r) * DVP + col0 + c, 16);
    }
    for (int i = tid; i < 64 * 8; i += GDN_THREADS) {
        const int r = i / 8, c = (i % 8) * 8;
        cp_async16_n(Pb + r * GDN_BS + c, Pg + (slot * 64 + r) * 64 + c, 16);
    }
    if (tid < 48)
        cp_async16_n(Eb + tid * 4, Eg + slot * 192 + tid * 4, 16);
}

/* The state recurrence for dk 256 (gdn_state_mma, whose state lives in registers, covers dk ≤ 128).
 * One block per (sequence, v-head, GDN_BV-column slice of dv), sequential over the sequence's
 * chunks; the fp32 state slice S[DKP][GDN_BV] stays in shared memory from the first chunk
 * (S = 0) to the last. With STAGES = 2 the next chunk's operands stream in (cp.async) while the
 * current one computes; with STAGES = 1 (what dk 256 launches, one block per SM) the chunk's
 * operands load at the top of each chunk. Per chunk, warp w owns the (w/2, w%2) 16×16 tile of
 * the 64 × 32 slice, kept in WMMA fragments (the row and column of each fragment element are
 * read off fragments of row and column numbers, so no layout knowledge is assumed):
 *   δ = U − W S,  O = e^γ ⊙ Q S + P δ,  S ← e^{γ_last} S + Kᵀ (e^{γ_last−γ} ⊙ δ). */
template <int DKP, int STAGES>
static __global__ void __launch_bounds__(GDN_THREADS)
    gdn_state_kernel(float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug,
                     const bf16 *Pg, const float *Eg, const int32_t *cu, const int *seq_first, int64_t T,
                     int nk, int nv, int dv, int DVP) {
    constexpr int KS = DKP + 8, BS = GDN_BS, SFS = GDN_SFS, SBS = GDN_SBS;
    const int     seq = blockIdx.x / nv, h = blockIdx.x % nv, kh = h / (nv / nk);
    const int     col0 = blockIdx.y * GDN_BV;
    const int     tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int64_t       bos = cu[seq], eos = cu[seq + 1];
    bos = bos < 0 ? 0 : (bos > T ? T : bos);
    eos = eos < bos ? bos : (eos > T ? T : eos);
    const int ncol = dv - col0 < GDN_BV ? dv - col0 : GDN_BV;
    const int nch = (int)((eos - bos + GDN_C - 1) / GDN_C), first = seq_first[seq];

    extern __shared__ __align__(128) unsigned char gdn_smem[];
    unsigned char                                 *stage0 = gdn_smem;
    float *Sf = (float *)(gdn_smem + STAGES * gdn_stage<DKP>::bytes); /* [DKP][SFS] */
    bf16  *Sb = (bf16 *)(Sf + DKP * SFS);                             /* [DKP][SBS] */
    bf16  *Db = Sb + DKP * SBS;                                       /* [64][SBS] δ */
    bf16  *Dd = Db + 64 * SBS;                                        /* [64][SBS] e^{γ_last−γ} δ */

    /* row and column numbers of a 16×16 tile, through Sf before it holds the state */
    for (int e = tid; e < 256; e += GDN_THREADS) {
        Sf[(e / 16) * SFS + e % 16] = (float)(e / 16);
        Sf[(16 + e / 16) * SFS + e % 16] = (float)(e % 16);
    }
    __syncthreads();
    int rid[8], cid[8];
    {
        gdn_facc f;
        static_assert(sizeof(f.x) / sizeof(float) == 8, "16x16 fp32 accumulator of 8 elements");
        wmma::load_matrix_sync(f, Sf, SFS, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < 8; i++)
            rid[i] = (int)f.x[i];
        wmma::load_matrix_sync(f, Sf + 16 * SFS, SFS, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < 8; i++)
            cid[i] = (int)f.x[i];
    }
    __syncthreads();
    for (int idx = tid; idx < DKP * SFS; idx += GDN_THREADS)
        Sf[idx] = 0.0f;
    for (int idx = tid; idx < DKP * SBS; idx += GDN_THREADS)
        Sb[idx] = __float2bfloat16(0.0f);
    if (nch > 0) {
        gdn_state_load<DKP>(stage0, Wg, Ug, Pg, Eg, qc, kc, (int64_t)first * nv + h, bos,
                            (int)(eos - bos < GDN_C ? eos - bos : GDN_C), nk, kh, DVP, col0, tid);
        cp_commit();
    }

    for (int k = 0; k < nch; k++) {
        const int64_t t0 = bos + (int64_t)k * GDN_C;
        const int     L = (int)(eos - t0 < GDN_C ? eos - t0 : GDN_C);
        __syncthreads(); /* A: the previous chunk is done with every buffer */
        if (STAGES == 2 && k + 1 < nch) {
            const int64_t t1 = t0 + GDN_C;
            gdn_state_load<DKP>(stage0 + ((k + 1) % 2) * gdn_stage<DKP>::bytes, Wg, Ug, Pg, Eg, qc, kc,
                                (int64_t)(first + k + 1) * nv + h, t1,
                                (int)(eos - t1 < GDN_C ? eos - t1 : GDN_C), nk, kh, DVP, col0, tid);
            cp_commit();
            cp_wait<1>();
        } else {
            if (STAGES == 1 && k > 0) {
                gdn_state_load<DKP>(stage0, Wg, Ug, Pg, Eg, qc, kc, (int64_t)(first + k) * nv + h, t0, L, nk,
                                    kh, DVP, col0, tid);
                cp_commit();
            }
            cp_wait<0>();
        }
        __syncthreads(); /* B: this chunk's operands are visible to every thread */
        unsigned char *sb = stage0 + (STAGES == 2 ? (k % 2) * gdn_stage<DKP>::bytes : 0);
        const bf16    *Wb = (const bf16 *)sb, *Qb = Wb + 64 * KS, *Kb = Qb + 64 * KS, *Ub = Kb + 64 * KS;
        const bf16    *Pb = Ub + 64 * SBS;
        const float   *Eb = (const float *)(Pb + 64 * BS);

        const int ti = warp / 2, tj = warp % 2;
        gdn_facc  qs; /* Q S, then the output tile */
        {
            gdn_facc ws;
            wmma::fill_fragment(ws, 0.0f);
            wmma::fill_fragment(qs, 0.0f);
#pragma unroll 4
            for (int kk = 0; kk < DKP; kk += 16) {
                gdn_fa_row a;
                gdn_fb_row b;
                wmma::load_matrix_sync(b, Sb + kk * SBS + tj * 16, SBS);
                wmma::load_matrix_sync(a, Wb + ti * 16 * KS + kk, KS);
                wmma::mma_sync(ws, a, b, ws);
                wmma::load_matrix_sync(a, Qb + ti * 16 * KS + kk, KS);
                wmma::mma_sync(qs, a, b, qs);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) { /* this warp's tile: δ, its decayed copy, e^γ Q S */
                const int r = ti * 16 + rid[i], c = tj * 16 + cid[i];
                float     d = __bfloat162float(Ub[r * SBS + c]) - ws.x[i];
                Db[r * SBS + c] = __float2bfloat16(d);
                Dd[r * SBS + c] = __float2bfloat16(d * Eb[64 + r]);
                qs.x[i] *= Eb[r];
            }
        }
        __syncthreads(); /* E: δ complete */

        {
            for (int kk = 0; kk <= ti * 16; kk += 16) { /* P is lower triangular */
                gdn_fa_row a;
                gdn_fb_row b;
                wmma::load_matrix_sync(a, Pb + ti * 16 * BS + kk, BS);
                wmma::load_matrix_sync(b, Db + kk * SBS + tj * 16, SBS);
                wmma::mma_sync(qs, a, b, qs);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int r = ti * 16 + rid[i], c = tj * 16 + cid[i];
                if (r < L && c < ncol)
                    out[((t0 + r) * nv + h) * (int64_t)dv + col0 + c] = qs.x[i];
            }
        }
        const float elast = Eb[128];
        for (int tile = warp; tile < (DKP / 16) * 2; tile += 8) {
            const int si = tile / 2, sj = tile % 2;
            gdn_facc  acc;
            wmma::load_matrix_sync(acc, Sf + si * 16 * SFS + sj * 16, SFS, wmma::mem_row_major);
#pragma unroll
            for (int e = 0; e < acc.num_elements; e++)
                acc.x[e] *= elast;
#pragma unroll
            for (int kk = 0; kk < 64; kk += 16) {
                gdn_fa_col a; /* Kᵀ: element (i, j) = K[j][i] */
                gdn_fb_row b;
                wmma::load_matrix_sync(a, Kb + kk * KS + si * 16, KS);
                wmma::load_matrix_sync(b, Dd + kk * SBS + sj * 16, SBS);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(Sf + si * 16 * SFS + sj * 16, acc, SFS, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int r = si * 16 + e / 16, c = sj * 16 + e % 16;
                Sb[r * SBS + c] = __float2bfloat16(Sf[r * SFS + c]);
            }
        }
    }
}

// ---- the state recurrence on mma.sync with the state in registers (DKP 64 and 128)
//
// mma.sync.m16n8k16 .bf16, g = lane / 4, t = lane % 4 (PTX ISA fragment layouts):
//   A 16×16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16×8:            b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C 16×8 fp32:       c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
// The recurrence runs transposed, on Sᵀ [v, dk]: then every product has Sᵀ or δᵀ as its A
// operand, and the C accumulators of two adjacent 8-column tiles are, element for element, the
// A fragment of a 16-wide k step (as FlashAttention-2 reuses P). So the state never leaves the
// registers of the warp that owns its 16 rows, and no barrier orders its steps.

/* One pipeline stage of gdn_state_mma: the chunk's W, Q, K [64][DKP + 8], U slice [64][GDN_US],
 * P [64][GDN_BS] (bf16) and E [192] (fp32). Two stages, then the warps' exchange areas. */
#define GDN_MT (64 * GDN_MW) /* threads of gdn_state_mma: two warps per 16 state rows */
#define GDN_XW (12 * 4 * 32) /* floats of one warp's exchange area: 8 D tiles, 4 O tiles */
template <int DKP> struct gdn_mstage {
    static constexpr int    KS = DKP + 8;
    static constexpr size_t bytes =
        3 * (size_t)64 * KS * 2 + (size_t)64 * GDN_US * 2 + (size_t)64 * GDN_BS * 2 + 192 * 4;
    /* the block's shared memory with ST stages (2: Hopper, datacenter Blackwell; 1: A100) */
    static constexpr size_t smem(int ST) { return ST * bytes + (size_t)2 * GDN_MW * GDN_XW * 4; }
};

/* Issues the cp.async copies of chunk slot `slot` (tokens t0 … t0 + L − 1) into stage sb, by the
 * GDN_MT threads, every copy's row and column fixed by tid (no division in the loop). */
template <int DKP>
static __device__ __forceinline__ void gdn_mstate_load(unsigned char *sb, const bf16 *Wg, const bf16 *Ug,
                                                       const bf16 *Pg, const float *Eg, const bf16 *qc,
                                                       const bf16 *kc, int64_t slot, int64_t t0, int L,
                                                       int nk, int kh, int DVP, int col0, int tid) {
    constexpr int KS = DKP + 8, VPR = DKP / 8, RPP = GDN_MT / VPR; /* vectors per row, rows per pass */
    bf16         *Wb = (bf16 *)sb, *Qb = Wb + 64 * KS, *Kb = Qb + 64 * KS, *Ub = Kb + 64 * KS;
    bf16         *Pb = Ub + 64 * GDN_US;
    float        *Eb = (float *)(Pb + 64 * GDN_BS);
    const int     r = tid / VPR, c = (tid % VPR) * 8;
    const bf16   *w = Wg + slot * 64 * DKP + r * DKP + c;
    const bf16   *q = qc + (t0 * nk + kh) * (int64_t)DKP + c, *k = kc + (t0 * nk + kh) * (int64_t)DKP + c;
    const int64_t rs = (int64_t)nk * DKP;
#pragma unroll
    for (int j = 0; j < 64 / RPP; j++) {
        const int rr = r + j * RPP;
        cp_async16_n(Wb + rr * KS + c, w + j * RPP * DKP, 16);
        cp_async16_n(Qb + rr * KS + c, q + (rr < L ? rr : 0) * rs, rr < L ? 16 : 0);
        cp_async16_n(Kb + rr * KS + c, k + (rr < L ? rr : 0) * rs, rr < L ? 16 : 0);
    }
    const int ur = tid / 8, uc = (tid % 8) * 8; /* 64 rows × 8 vectors: two per thread */
#pragma unroll
    for (int j = 0; j < 2; j++) {
        cp_async16_n(Ub + (ur + 32 * j) * GDN_US + uc, Ug + (slot * 64 + ur + 32 * j) * DVP + col0 + uc, 16);
        cp_async16_n(Pb + (ur + 32 * j) * GDN_BS + uc, Pg + (slot * 64 + ur + 32 * j) * 64 + uc, 16);
    }
    if (tid < 48)
        cp_async16_n(Eb + tid * 4, Eg + slot * 192 + tid * 4, 16);
}

/* One warp's part of gdn_state_mma for the whole sequence: rows vr, vr + 8 (lane's) of the
 * block's 16-row state slice, dk columns HF·DKP/2 … of Sᵀ, held in C fragments. The warp and
 * its partner (the other half of dk, same rows) each take the partial products over their half
 * of dk and add the other's through shared memory (one 64-thread barrier per chunk); both then
 * hold the whole δᵀ, each updates its half of the state, and each writes half of the output
 * tokens (HF 0: token tiles 0, 1, 6, 7; HF 1: 2 … 5, so that P's triangle splits evenly). */
template <int DKP, int ST, int HF>
static __device__ __forceinline__ void
gdn_state_warp(float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug, const bf16 *Pg,
               const float *Eg, unsigned char *smem, float *Xme, const float *Xpa, int bar, int64_t bos,
               int64_t eos, int first, int nch, int h, int kh, int nk, int nv, int dv, int DVP, int col0,
               int vr) {
    constexpr int KS = DKP + 8, BS = GDN_BS, US = GDN_US, KH = DKP / 2, NS = KH / 8;
    const int     tid = threadIdx.x, lane = tid % 32, t = lane % 4;
    const int     c_lo = col0 + vr;
    constexpr int own[4] = {HF ? 2 : 0, HF ? 3 : 1, HF ? 4 : 6, HF ? 5 : 7}; /* my output tiles */
    constexpr int oth[4] = {HF ? 0 : 2, HF ? 1 : 3, HF ? 6 : 4, HF ? 7 : 5}; /* the partner's */
    constexpr int onp[2] = {HF ? 1 : 0, HF ? 2 : 3};                         /* as 16-token tiles */

    float S[NS][4];
#pragma unroll
    for (int n = 0; n < NS; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            S[n][e] = 0.0f;

    for (int k = 0; k < nch; k++) {
        const int64_t t0 = bos + (int64_t)k * GDN_C;
        const int     L = (int)(eos - t0 < GDN_C ? eos - t0 : GDN_C);
        if (ST == 1 && k > 0) { /* one stage: chunk k loads once every warp is done with k − 1 */
            __syncthreads();
            gdn_mstate_load<DKP>(smem, Wg, Ug, Pg, Eg, qc, kc, (int64_t)(first + k) * nv + h, t0, L, nk, kh,
                                 DVP, col0, tid);
            cp_commit();
        }
        cp_wait<0>();
        __syncthreads(); /* chunk k has landed for every thread; chunk k − 1's buffer and the
                          * exchange areas are free */
        if (ST == 2 && k + 1 < nch) {
            const int64_t t1 = t0 + GDN_C;
            gdn_mstate_load<DKP>(smem + ((k + 1) & 1) * gdn_mstage<DKP>::bytes, Wg, Ug, Pg, Eg, qc, kc,
                                 (int64_t)(first + k + 1) * nv + h, t1,
                                 (int)(eos - t1 < GDN_C ? eos - t1 : GDN_C), nk, kh, DVP, col0, tid);
            cp_commit();
        }
        const unsigned char *sb = smem + (ST == 2 ? (k & 1) * gdn_mstage<DKP>::bytes : 0);
        const bf16  *Wb = (const bf16 *)sb, *Qb = Wb + 64 * KS, *Kb = Qb + 64 * KS, *Ub = Kb + 64 * KS;
        const bf16  *Pb = Ub + 64 * US;
        const float *Eb = (const float *)(Pb + 64 * BS);

        // partial D = Sᵀ Wᵀ and O = Sᵀ Qᵀ over this warp's half of dk
        float D[8][4], O[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                D[n][e] = O[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KH / 16; ks++) {
            uint32_t a[4];
            a[0] = pack_bf16(S[2 * ks][0], S[2 * ks][1]);
            a[1] = pack_bf16(S[2 * ks][2], S[2 * ks][3]);
            a[2] = pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
            a[3] = pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                frag_b_nk_l(b, Wb, KS, np * 16, HF * KH + ks * 16, lane);
                mma_bf16(D[2 * np], a, b[0], b[1]);
                mma_bf16(D[2 * np + 1], a, b[2], b[3]);
                frag_b_nk_l(b, Qb, KS, np * 16, HF * KH + ks * 16, lane);
                mma_bf16(O[2 * np], a, b[0], b[1]);
                mma_bf16(O[2 * np + 1], a, b[2], b[3]);
            }
        }
        // exchange with the partner: all of D, O on the partner's output tiles (same fragment
        // positions in both warps, so lane-major areas without bank conflicts)
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                Xme[(n * 4 + e) * 32 + lane] = D[n][e];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                Xme[((8 + j) * 4 + e) * 32 + lane] = O[oth[j]][e];
        asm volatile("bar.sync %0, 64;\n" ::"r"(bar) : "memory");
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                D[n][e] += Xpa[(n * 4 + e) * 32 + lane];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                O[own[j]][e] += Xpa[((8 + j) * 4 + e) * 32 + lane];

        // δᵀ = Uᵀ − D; its A fragments plain (for Pᵀ) and decayed by e^{γ_last−γ} (for K);
        // O scaled by e^γ per token (column)
        uint32_t da[4][4], dd[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            float d[2][4];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int n = 2 * kk + hf, tok = 8 * n + 2 * t;
                d[hf][0] = __bfloat162float(Ub[tok * US + vr]) - D[n][0];
                d[hf][1] = __bfloat162float(Ub[(tok + 1) * US + vr]) - D[n][1];
                d[hf][2] = __bfloat162float(Ub[tok * US + vr + 8]) - D[n][2];
                d[hf][3] = __bfloat162float(Ub[(tok + 1) * US + vr + 8]) - D[n][3];
            }
            gdn_delta_frags(da[kk], dd[kk], d, Eb, kk, t);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int   tok = 8 * own[j] + 2 * t;
            const float e0 = Eb[tok], e1 = Eb[tok + 1];
            O[own[j]][0] *= e0;
            O[own[j]][1] *= e1;
            O[own[j]][2] *= e0;
            O[own[j]][3] *= e1;
        }

        // this half of Sᵀ ← e^{γ_last} Sᵀ + (decayed δᵀ) K
        const float elast = Eb[128];
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                S[n][e] *= elast;
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int np = 0; np < KH / 16; np++) {
                uint32_t b[4];
                frag_b_kn_l(b, Kb, KS, kk * 16, HF * KH + np * 16, lane);
                mma_bf16(S[2 * np], dd[kk], b[0], b[1]);
                mma_bf16(S[2 * np + 1], dd[kk], b[2], b[3]);
            }

            // O += δᵀ Pᵀ on this warp's token tiles (P lower triangular: k steps kk ≤ np), then out
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int np = onp[i];
#pragma unroll
            for (int kk = 0; kk <= np; kk++) {
                uint32_t b[4];
                frag_b_nk_l(b, Pb, BS, np * 16, kk * 16, lane);
                mma_bf16(O[2 * np], da[kk], b[0], b[1]);
                mma_bf16(O[2 * np + 1], da[kk], b[2], b[3]);
            }
        }
        float *o = out + (t0 * nv + h) * (int64_t)dv;
#pragma unroll
        for (int j = 0; j < 4; j++)
            gdn_store_c(o, (int64_t)nv * dv, 8 * own[j] + 2 * t, L, c_lo, dv, O[own[j]]);
    }
}

/* One block per (sequence, v-head, GDN_MV-column slice of dv; DVP a multiple of GDN_MV),
 * sequential over the sequence's chunks, one block barrier per chunk (the next chunk's
 * operands are copied in by cp.async while this one is multiplied). Warps 2s and 2s + 1 hold
 * rows v = col0 + 16s … + 15 of Sᵀ [v][DKP] in fp32 C fragments for the whole sequence, the
 * first dk half and the second (gdn_state_warp). Per chunk, with e^γ, e^{γ_last−γ}, e^{γ_last}
 * from E:
 *   δᵀ = Uᵀ − Sᵀ Wᵀ,   Oᵀ = Sᵀ Qᵀ ⊙ e^γ + δᵀ Pᵀ,   Sᵀ ← e^{γ_last} Sᵀ + (δᵀ ⊙ e^{γ_last−γ}) K
 * (Sᵀ, δᵀ and the decayed δᵀ enter the tensor cores in bf16, as in gdn_state). */
template <int DKP, int ST>
static __global__ void __launch_bounds__(GDN_MT, 1)
    gdn_state_mma_kernel(float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug,
                         const bf16 *Pg, const float *Eg, const int32_t *cu, const int *seq_first, int64_t T,
                         int nk, int nv, int dv, int DVP) {
    const int seq = blockIdx.x / nv, h = blockIdx.x % nv, kh = h / (nv / nk);
    const int col0 = blockIdx.y * GDN_MV;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, pair = warp / 2;
    int64_t   bos = cu[seq], eos = cu[seq + 1];
    bos = bos < 0 ? 0 : (bos > T ? T : bos);
    eos = eos < bos ? bos : (eos > T ? T : eos);
    const int nch = (int)((eos - bos + GDN_C - 1) / GDN_C), first = seq_first[seq];
    const int vr = 16 * pair + lane / 4; /* this lane's state rows vr and vr + 8 within the slice */

    extern __shared__ __align__(128) unsigned char gdn_smem[];
    float                                         *X = (float *)(gdn_smem + ST * gdn_mstage<DKP>::bytes);
    if (nch > 0) {
        gdn_mstate_load<DKP>(gdn_smem, Wg, Ug, Pg, Eg, qc, kc, (int64_t)first * nv + h, bos,
                             (int)(eos - bos < GDN_C ? eos - bos : GDN_C), nk, kh, DVP, col0, tid);
        cp_commit();
    }
    float *Xme = X + warp * GDN_XW, *Xpa = X + (warp ^ 1) * GDN_XW;
    if (warp & 1)
        gdn_state_warp<DKP, ST, 1>(out, qc, kc, Wg, Ug, Pg, Eg, gdn_smem, Xme, Xpa, 1 + pair, bos, eos, first,
                                   nch, h, kh, nk, nv, dv, DVP, col0, vr);
    else
        gdn_state_warp<DKP, ST, 0>(out, qc, kc, Wg, Ug, Pg, Eg, gdn_smem, Xme, Xpa, 1 + pair, bos, eos, first,
                                   nch, h, kh, nk, nv, dv, DVP, col0, vr);
}

// ----------------------------------------------------------------------------
// launchers (kn_gdn_int.h)

size_t kn_gdn_state_smem(int DKP, int stages) {
    if (DKP == 64)
        return gdn_mstage<64>::smem(stages);
    if (DKP == 128)
        return gdn_mstage<128>::smem(stages);
    return gdn_state_smem<256, 1>::bytes;
}

#ifndef TANDEM_HAVE_SM90A /* a build without architecture 90 (kernels/CMakeLists.txt) has no wgmma form */
bool      kn_gdn_wg_available(kn_ctx *, int) { return false; }
cm_status kn_gdn_state_wg(kn_ctx *, int, float *, const bf16 *, const bf16 *, const bf16 *, const bf16 *,
                          const bf16 *, const float *, const int32_t *, const int *, int, int64_t, int, int, int,
                          int) {
    return CM_ERR_UNSUPPORTED;
}
#endif

template <int DKP>
static cm_status gdn_state_launch(kn_ctx *ctx, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg,
                                  const bf16 *Ug, const bf16 *Pg, const float *Eg, const int32_t *cu,
                                  const int *seq_first, int n_seq, int64_t T, int nk, int nv, int dv,
                                  int DVP) {
    constexpr bool MMA = DKP <= 128;
    if constexpr (MMA) {
        if (kn_gdn_wg_available(ctx, DKP)) /* compute capability 9.0: warpgroup MMA */
            return kn_gdn_state_wg(ctx, DKP, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv,
                                   DVP);
        /* two stages where the device's shared memory per block allows (kn_gdn_chunked_fits has
         * checked that one does) */
        if (gdn_mstage<DKP>::smem(2) <= (size_t)kn_gdn_smem_optin(ctx)) {
            const size_t smem = gdn_mstage<DKP>::smem(2);
            KN_CUDA(cudaFuncSetAttribute(gdn_state_mma_kernel<DKP, 2>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            gdn_state_mma_kernel<DKP, 2>
                <<<dim3((unsigned int)(n_seq * nv), (unsigned int)(DVP / GDN_MV)), GDN_MT, smem,
                   ctx->stream>>>(out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, T, nk, nv, dv, DVP);
        } else {
            const size_t smem = gdn_mstage<DKP>::smem(1);
            KN_CUDA(cudaFuncSetAttribute(gdn_state_mma_kernel<DKP, 1>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            gdn_state_mma_kernel<DKP, 1>
                <<<dim3((unsigned int)(n_seq * nv), (unsigned int)(DVP / GDN_MV)), GDN_MT, smem,
                   ctx->stream>>>(out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, T, nk, nv, dv, DVP);
        }
    } else {
        /* dk 256: one stage, one block per SM */
        const size_t state_smem = gdn_state_smem<DKP, 1>::bytes;
        KN_CUDA(cudaFuncSetAttribute(gdn_state_kernel<DKP, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)state_smem));
        dim3 grid((unsigned int)(n_seq * nv), (unsigned int)(DVP / GDN_BV));
        gdn_state_kernel<DKP, 1><<<grid, GDN_THREADS, state_smem, ctx->stream>>>(
            out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, T, nk, nv, dv, DVP);
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_gdn_state(kn_ctx *ctx, int DKP, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg,
                       const bf16 *Ug, const bf16 *Pg, const float *Eg, const int32_t *cu,
                       const int *seq_first, int n_seq, int64_t T, int nk, int nv, int dv, int DVP) {
    if (DKP == 64)
        return gdn_state_launch<64>(ctx, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv,
                                    DVP);
    if (DKP == 128)
        return gdn_state_launch<128>(ctx, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv,
                                     DVP);
    return gdn_state_launch<256>(ctx, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv, DVP);
}
