/* kernels/kn_gdn_chunk.cu — the chunked form of the gated delta rule (kn_gdn.cu picks it):
 * KN_GEMM_MODE_BF16 (serving): the chunked WY form of docs/target.md with C = 64
 *   (kn_gdn_ref.c is its specification), matrix products on bf16 tensor cores (mma.sync
 *   m16n8k16 with ldmatrix fragments, fp32 accumulation; sm_80 and newer, no wgmma/TMA, so the
 *   same code runs on Ampere, Hopper and Blackwell), fp32 state, everything in the ctx scratch
 *   (no allocation after the first call of a size):
 *   1. gdn_to_bf16_padded (twice): q·scale and k to bf16 [T, nk, DKP], DKP = dk rounded up to
 *      64, 128 or 256, so every operand row is whole 16-byte vectors for cp.async. Skipped by
 *      gated_delta_rule_bf16 (kn_gdn_chunked_bf16), whose caller wrote exactly these bf16 values
 *      (dk = DKP), v in bf16 too; the prep kernel then reads that v.
 *   2. gdn_chunk_table: the (start, length) chunks, restarting at every sequence start, and each
 *      sequence's first chunk slot.
 *   3. gdn_prep_mma, one block of 4 warps per (chunk, v-head), fully parallel, warp w on rows
 *      16w … 16w + 15 of every product, kept in registers: γ = cumsum(g) (fp32),
 *      A = β_r e^{γ_r−γ_j} k_r·k_j (j < r, masked before exp), T = (I + A)^{-1} in fp32 (each
 *      warp's 16×16 diagonal block by forward substitution, then the block rows by the 16×16
 *      merge T_ij = −T_ii Σ A_im T_mj on tf32 mma, three levels), then, stored bf16 per chunk
 *      slot (as FLA stores its intermediates): W = T diag(β e^γ) K, U = T diag(β) V, the decayed
 *      causal P = (QKᵀ ⊙ e^{γ_r−γ_j})[j ≤ r], and the decay vectors (fp32).
 *   4. dk ≤ 128: gdn_state_mma, one block per (sequence, v-head, 64 columns of dv), sequential
 *      over the sequence's chunks with the fp32 state transposed, Sᵀ [v, dk], in registers (two
 *      warps per 16 rows, one per half of dk) and the chunk's operands double-buffered by
 *      cp.async, one block barrier per chunk: δᵀ = Uᵀ − Sᵀ Wᵀ, Oᵀ = Sᵀ Qᵀ ⊙ e^γ + δᵀ Pᵀ,
 *      Sᵀ ← e^{γ_last} Sᵀ + (δᵀ ⊙ e^{γ_last−γ}) K. 48 v-heads × 2 slices give 96 blocks of 8
 *      warps for one 8192-token sequence of the 27B shape. dk 256 (a state too large for the
 *      registers): gdn_state, the state slice S[dk, 32] in shared memory, WMMA. On compute
 *      capability 9.0 (dk ≤ 128) the same recurrence runs on warpgroup MMA instead
 *      (kn_gdn_state_sm90a.cu), which reads P's blocks above the diagonal as zeros (step 3
 *      leaves them unwritten).
 *   On an H200 at the 27B shape and 8192 tokens (one sequence) this takes 0.67–0.70 ms with the
 *   wgmma state kernel, 0.74–0.79 with gdn_state_mma (the pack of mixed lengths: 0.59 and 0.68);
 *   ncu with the clocks left alone: prep 0.28 ms, state 0.28 ms (wgmma) or 0.40 (mma.sync), q/k
 *   copies 2 × 0.024, chunk table 0.009. gdn_state_mma is bound by shared memory (each 512-byte
 *   ldmatrix feeds two mma.sync; L1 64 % busy) and latency with one block per SM
 *   (bench/results/target-2026-11-30.md); the wgmma form by the latency of its chain of products
 *   (bench/results/gdn-wgmma-2026-12-04.md).
 *   Rounding: q, k, v, T diag(β e^γ), T diag(β), W, U, the state and δ enter the tensor cores as
 *   bf16 (FLA rounds the same operands; the inverse's block merge runs on tf32), so outputs
 *   differ from the fp64 reference by a few 1e-3 relative (test_kn_cuda_seq).
 *   dk is zero-padded to 64, 128 or 256 (zero columns change no dot product); dv is any size.
 *   gdn_state_mma at dk 128 takes 188 KB of shared memory with its two stages, 118 KB with one
 *   (A100: 163 KB per block); where a device's shared memory per block is too small even for
 *   that (sm_86/89/120 parts: 99 KB), the per-token kernel runs instead (kn_gdn_chunked_fits). */
#include "kn_cuda.h"
#include "kn_gdn_int.h"
#include "kn_mma_sm80.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

/* x [rows, n] fp32 · scale → dst [rows, P] bf16, zero past n (P a multiple of 8). */
static __global__ void gdn_to_bf16_padded(bf16 *dst, const float *x, int64_t rows, int n, int P,
                                          float scale) {
    to_bf16_padded<true>(dst, x, rows, n, P, scale);
}

/* Chunks of every sequence: chunks[i] = (first token, length ≤ 64), seq_first[s] = the slot
 * of sequence s's first chunk, *n_chunks = their count (at most cap; a table that would
 * overflow — only possible with a cu_seqlens that is not increasing, which callers reject — is
 * cut at cap). One block: thread i sums the chunk counts of its run of sequences, a scan of the
 * runs gives each run its first slot. */
static __global__ void gdn_chunk_table_kernel(int2 *chunks, int *seq_first, int *n_chunks, const int32_t *cu,
                                              int n_seq, int64_t T, int cap) {
    __shared__ int part[1024];
    const int      tid = threadIdx.x, nt = blockDim.x;
    const int      per = (n_seq + nt - 1) / nt;
    const int      s0 = tid * per < n_seq ? tid * per : n_seq, s1 = s0 + per < n_seq ? s0 + per : n_seq;
    int            local = 0;
    for (int s = s0; s < s1; s++) {
        int64_t b = cu[s], e = cu[s + 1];
        b = b < 0 ? 0 : (b > T ? T : b);
        e = e < b ? b : (e > T ? T : e);
        local += (int)((e - b + GDN_C - 1) / GDN_C);
    }
    part[tid] = local;
    __syncthreads();
    if (tid == 0) {
        int run = 0;
        for (int i = 0; i < nt; i++) {
            int c = part[i];
            part[i] = run;
            run += c;
        }
        *n_chunks = run < cap ? run : cap;
    }
    __syncthreads();
    int off = part[tid];
    for (int s = s0; s < s1; s++) {
        int64_t b = cu[s], e = cu[s + 1];
        b = b < 0 ? 0 : (b > T ? T : b);
        e = e < b ? b : (e > T ? T : e);
        seq_first[s] = off;
        for (int64_t c = b; c < e; c += GDN_C, off++)
            if (off < cap)
                chunks[off] = make_int2((int)c, (int)(e - c < GDN_C ? e - c : GDN_C));
    }
}

// ---- gdn_prep on mma.sync: warp w owns the 16 rows 16w … 16w + 15 of every chunk product

static __device__ __forceinline__ uint32_t gdn_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
/* mma.sync.m16n8k8 .tf32 (fp32 accumulate): A a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
 * B b0 (k = t, n = g), b1 (k = t+4, n = g); C as in m16n8k16. */
static __device__ __forceinline__ void gdn_mma_tf32(float c[4], const uint32_t a[4], uint32_t b0,
                                                    uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* c (16×16 as two 16×8 C tiles) += A B for fp32 16×16 blocks A (lda) and B (ldb) in shared
 * memory, on tf32 tensor cores (10-bit mantissas, 4× finer than the bf16 the inverse is
 * rounded to afterwards). */
static __device__ __forceinline__ void gdn_mm16_tf32(float (&c)[2][4], const float *A, int lda,
                                                     const float *B, int ldb, int g, int t) {
#pragma unroll
    for (int ks = 0; ks < 2; ks++) {
        uint32_t a[4];
        a[0] = gdn_tf32(A[g * lda + 8 * ks + t]);
        a[1] = gdn_tf32(A[(g + 8) * lda + 8 * ks + t]);
        a[2] = gdn_tf32(A[g * lda + 8 * ks + t + 4]);
        a[3] = gdn_tf32(A[(g + 8) * lda + 8 * ks + t + 4]);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
            gdn_mma_tf32(c[nt], a, gdn_tf32(B[(8 * ks + t) * ldb + 8 * nt + g]),
                         gdn_tf32(B[(8 * ks + t + 4) * ldb + 8 * nt + g]));
    }
}
/* The bf16 A fragment of the 16×16 block of T (fp32, row-major, ld) at rows r0.., cols c0..,
 * column j scaled by s[j]: rows of T diag(s). */
static __device__ __forceinline__ void gdn_frag_a_scaled(uint32_t a[4], const float *T, int ld, int r0,
                                                         int c0, const float *s, int g, int t) {
    const int    c = c0 + 2 * t;
    const float2 x0 = *(const float2 *)(T + (r0 + g) * ld + c),
                 x1 = *(const float2 *)(T + (r0 + g + 8) * ld + c);
    const float2 x2 = *(const float2 *)(T + (r0 + g) * ld + c + 8);
    const float2 x3 = *(const float2 *)(T + (r0 + g + 8) * ld + c + 8);
    const float  s0 = s[c], s1 = s[c + 1], s8 = s[c + 8], s9 = s[c + 9];
    a[0] = pack_bf16(x0.x * s0, x0.y * s1);
    a[1] = pack_bf16(x1.x * s0, x1.y * s1);
    a[2] = pack_bf16(x2.x * s8, x2.y * s9);
    a[3] = pack_bf16(x3.x * s8, x3.y * s9);
}

#define GDN_PT 128 /* threads of gdn_prep_mma: 4 warps */
#define GDN_XS 24  /* fp32 stride of a warp's 16×16 merge scratch (off the banks of its reads) */

/* Thread tid's 32 values of v [t0 + r][h][c0 + c] for one 64-column pass: pairs (c, c + 1) at
 * r = tid / 32 + 4i, c = 2·(tid % 32), i < 16 (zero outside the chunk and past dv), loaded
 * together so that their latency overlaps, and held as loaded until the pass's stage is written
 * (gdn_vpair): fp32 values, or bf16 pairs as their 32 bits. A bf16 pair widened right after its
 * load made the inverse wait on every load: in the forward, whose v is bf16, the prep took
 * 352 µs at the 27B shape, now 263 µs (ncu). */
template <typename VT> struct gdn_vregs { float x[32]; };
template <> struct gdn_vregs<bf16> { uint32_t p[16]; };

/* the pair p[0], p[1] in one load (p aligned to the pair) */
static __device__ __forceinline__ void gdn_ldv2(gdn_vregs<float> &r, int i, const float *p) {
    const float2 f = __ldg((const float2 *)p);
    r.x[2 * i] = f.x, r.x[2 * i + 1] = f.y;
}
static __device__ __forceinline__ void gdn_ldv2(gdn_vregs<bf16> &r, int i, const bf16 *p) {
    r.p[i] = __ldg((const unsigned int *)p);
}
/* the pair p[0] (if lo), p[1] (if hi), zeros elsewhere, one value at a time */
static __device__ __forceinline__ void gdn_ldv1(gdn_vregs<float> &r, int i, const float *p, bool lo,
                                                bool hi) {
    r.x[2 * i] = lo ? __ldg(p) : 0.0f;
    r.x[2 * i + 1] = hi ? __ldg(p + 1) : 0.0f;
}
static __device__ __forceinline__ void gdn_ldv1(gdn_vregs<bf16> &r, int i, const bf16 *p, bool lo, bool hi) {
    const unsigned short *u = (const unsigned short *)p;
    r.p[i] = (lo ? (uint32_t)__ldg(u) : 0u) | (hi ? (uint32_t)__ldg(u + 1) << 16 : 0u);
}
static __device__ __forceinline__ void gdn_vzero(gdn_vregs<float> &r, int i) {
    r.x[2 * i] = r.x[2 * i + 1] = 0.0f;
}
static __device__ __forceinline__ void gdn_vzero(gdn_vregs<bf16> &r, int i) {
    r.p[i] = 0u;
}
/* pair i as the stage's bf16 pair (a bf16 pair as it was loaded: the same bits as widening it and
 * rounding it back) */
static __device__ __forceinline__ uint32_t gdn_vpair(const gdn_vregs<float> &r, int i) {
    return pack_bf16(r.x[2 * i], r.x[2 * i + 1]);
}
static __device__ __forceinline__ uint32_t gdn_vpair(const gdn_vregs<bf16> &r, int i) {
    return r.p[i];
}

template <typename VT>
static __device__ __forceinline__ void gdn_vload(gdn_vregs<VT> &x, const VT *v, int64_t t0, int L, int nv,
                                                 int h, int dv, int c0, int tid) {
    const int     r = tid / 32, c = c0 + 2 * (tid % 32);
    const VT     *p = v + ((t0 + r) * nv + h) * (int64_t)dv + c;
    const int64_t step = (int64_t)4 * nv * dv;
    if (dv % 2 == 0 && ((uintptr_t)v & (2 * sizeof(VT) - 1)) == 0) { /* every pair whole and aligned */
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (r + 4 * i < L && c < dv)
                gdn_ldv2(x, i, p + i * step);
            else
                gdn_vzero(x, i);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const bool ok = r + 4 * i < L;
        gdn_ldv1(x, i, p + i * step, ok && c < dv, ok && c + 1 < dv);
    }
}

/* The bf16 pairs a warp holds of 16 rows of a chunk output (pairs[n][h]: row gq + 8h, columns 8n + 2tq
 * and + 1, n < NT) to global rows dst (row stride ld), columns below ncols (a multiple of 8): the
 * pairs go through 16 rows of shared memory that only this warp uses (stage, row stride ss bf16, a
 * multiple of 8), then each row leaves in whole 16-byte chunks. Stored from the fragments directly,
 * each 4-byte store half-filled its sectors: ncu counted 40 % of the prep's global sectors as
 * excess at the 27B shape. */
template <int NT>
static __device__ __forceinline__ void gdn_store16(bf16 *dst, int64_t ld, const uint32_t (&pairs)[NT][2],
                                                   bf16 *stage, int ss, int ncols, int lane) {
    const int gq = lane / 4, tq = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; n++)
        if (8 * n < ncols) {
            *(uint32_t *)(stage + gq * ss + 8 * n + 2 * tq) = pairs[n][0];
            *(uint32_t *)(stage + (gq + 8) * ss + 8 * n + 2 * tq) = pairs[n][1];
        }
    __syncwarp();
    const int cpr = ncols / 8; /* 16-byte chunks per row */
    for (int i = lane; i < 16 * cpr; i += 32) {
        const int r = i / cpr, c = i % cpr;
        *(uint4 *)(dst + r * ld + 8 * c) = *(const uint4 *)(stage + r * ss + 8 * c);
    }
    __syncwarp(); /* the stage may be written again */
}

template <int DKP> struct gdn_prep_mma_smem {
    static constexpr int    KS = DKP + 8;
    static constexpr size_t kq = (size_t)64 * KS * 2; /* Kb, Qb; Vb [64][GDN_BS] reuses Qb */
    static constexpr size_t bytes = 2 * kq + 2 * (size_t)64 * GDN_FS * 4 /* Af, Ti */ +
                                    4 * (size_t)16 * GDN_XS * 4 /* Xs */ + 3 * 64 * 4 /* gam, bet, bge */;
    static_assert((size_t)64 * GDN_BS * 2 <= kq, "the v stage fits where Q was");
};

/* T_ij = −T_ii Σ_{m=j}^{i−1} A_im T_mj (block row i of (I + A) T = I, 16×16 blocks j < i), by one
 * warp, Af and Ti in shared memory (stride GDN_FS), Xs the warp's scratch. */
static __device__ __forceinline__ void gdn_merge(float *Ti, const float *Af, float *Xs, int i, int j, int g,
                                                 int t) {
    constexpr int FS = GDN_FS;
    float         x[2][4] = {}, y[2][4] = {};
    for (int m = j; m < i; m++)
        gdn_mm16_tf32(x, Af + 16 * i * FS + 16 * m, FS, Ti + 16 * m * FS + 16 * j, FS, g, t);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        *(float2 *)(Xs + g * GDN_XS + 8 * nt + 2 * t) = make_float2(x[nt][0], x[nt][1]);
        *(float2 *)(Xs + (g + 8) * GDN_XS + 8 * nt + 2 * t) = make_float2(x[nt][2], x[nt][3]);
    }
    __syncwarp();
    gdn_mm16_tf32(y, Ti + 16 * i * FS + 16 * i, FS, Xs, GDN_XS, g, t);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        *(float2 *)(Ti + (16 * i + g) * FS + 16 * j + 8 * nt + 2 * t) = make_float2(-y[nt][0], -y[nt][1]);
        *(float2 *)(Ti + (16 * i + g + 8) * FS + 16 * j + 8 * nt + 2 * t) = make_float2(-y[nt][2], -y[nt][3]);
    }
    __syncwarp(); /* Xs is reused by the next merge */
}

/* Everything of one chunk that does not depend on the state, one block of 4 warps per (chunk
 * slot, v-head), chunk-indexed outputs of 64 rows (rows past the chunk are zero):
 *   W = T diag(β e^γ) K   [64][DKP] bf16      U = T diag(β) V   [64][DVP] bf16
 *   P = (Q Kᵀ ⊙ e^{γ_r−γ_j})[j ≤ r]  [64][64] bf16 (the intra-chunk causal part of the output)
 *   E = e^{γ_r}, e^{γ_last−γ_r}, e^{γ_last}  [3][64] fp32
 * with T = (I + A)^{-1}, A = β_r e^{γ_r−γ_j} k_r·k_j (j < r). qc, kc: [T, nk, DKP] bf16 (q already
 * scaled); v: [T, nv, dv] fp32. Warp w computes rows 16w … 16w + 15 of every product in registers:
 *   K Kᵀ and Q Kᵀ (tiles j ≤ r only) → P (bf16, global) and A (fp32, shared);
 *   T = (I + A)^{-1}: the diagonal 16×16 block of its rows by forward substitution (16 lanes,
 *   one column each), then the block rows by the merge T_ij = −T_ii Σ A_im T_mj, three levels
 *   (j = i−1, i−2, i−3) on tf32 mma with a barrier between levels;
 *   W = (T diag(β e^γ)) K and U = (T diag(β)) V with the A fragments read off T and scaled as
 *   they are built. Row blocks above the diagonal of P are not written (never read). P, W and U
 *   leave through the warp's own 16 rows of Q (P) or of A (W, U), once nothing reads them, in whole
 *   16-byte chunks (gdn_store16).
 * Three blocks share a multiprocessor at dk 128 (75 KB each). */
template <int DKP, typename VT>
static __global__ void __launch_bounds__(GDN_PT, 3)
    gdn_prep_mma_kernel(bf16 *Wg, bf16 *Ug, bf16 *Pg, float *Eg, const bf16 *qc, const bf16 *kc, const VT *v,
                        const float *g, const float *beta, const int2 *chunks, const int *n_chunks, int nk,
                        int nv, int dv, int DVP) {
    typedef gdn_prep_mma_smem<DKP> SM;
    constexpr int                  KS = SM::KS, FS = GDN_FS, BS = GDN_BS;
    if ((int)blockIdx.x >= *n_chunks)
        return;
    const int2    ch = chunks[blockIdx.x];
    const int64_t t0 = ch.x, slot = (int64_t)blockIdx.x * nv + blockIdx.y;
    const int     L = ch.y, h = blockIdx.y, kh = h / (nv / nk);
    const int     tid = threadIdx.x, w = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4, r0 = 16 * w;

    extern __shared__ __align__(128) unsigned char gdn_smem[];
    bf16                                          *Kb = (bf16 *)gdn_smem; /* [64][KS] k */
    bf16                                          *Qb = Kb + 64 * KS;     /* [64][KS] q · scale */
    bf16  *Vb = Qb;                      /* [64][BS] v, 64 columns a pass, once Q is done */
    float *Af = (float *)(Qb + 64 * KS); /* [64][FS] A */
    float *Ti = Af + 64 * FS;            /* [64][FS] T = (I + A)^{-1} */
    float *Xs = Ti + 64 * FS + w * 16 * GDN_XS;
    float *gam = Ti + 64 * FS + 4 * 16 * GDN_XS, *bet = gam + 64, *bge = bet + 64; /* γ, β, β e^γ */

    gdn_load_rows<DKP>(Kb, kc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_PT);
    gdn_load_rows<DKP>(Qb, qc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_PT);
    cp_commit();
    if (w == 0)
        gdn_chunk_gamma(gam, g, t0, L, nv, h, lane);
    else if (w == 1)
        for (int r = lane; r < 64; r += 32)
            bet[r] = r < L ? beta[(t0 + r) * nv + h] : 0.0f;
    cp_wait<0>();
    __syncthreads();
    if (tid < 64) {
        float *E = Eg + slot * 192;
        float  gl = gam[L - 1];
        bge[tid] = bet[tid] * __expf(gam[tid]);
        E[tid] = tid < L ? __expf(gam[tid]) : 0.0f;
        E[64 + tid] = tid < L ? __expf(gl - gam[tid]) : 0.0f;
        E[128 + tid] = tid == 0 ? __expf(gl) : 0.0f;
    }

    // K Kᵀ and Q Kᵀ on this warp's rows, column tiles up to the diagonal
    {
        float kk[8][4], qk[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                kk[n][e] = qk[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ks++) {
            uint32_t ak[4], aq[4];
            frag_a_l(ak, Kb, KS, r0, ks * 16, lane);
            frag_a_l(aq, Qb, KS, r0, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < 4; np++)
                if (np <= w) {
                    uint32_t b[4];
                    frag_b_nk_l(b, Kb, KS, np * 16, ks * 16, lane);
                    mma_bf16(kk[2 * np], ak, b[0], b[1]);
                    mma_bf16(kk[2 * np + 1], ak, b[2], b[3]);
                    mma_bf16(qk[2 * np], aq, b[0], b[1]);
                    mma_bf16(qk[2 * np + 1], aq, b[2], b[3]);
                }
        }
        // P = (Q Kᵀ ⊙ e^{γ_r−γ_j})[j ≤ r < L] to global, A = β_r e^{γ_r−γ_j} k_r·k_j [j < r < L] to Af
        // (the exponent is masked before the exp, so it only ever sees γ_r − γ_j ≤ 0)
        uint32_t pp[8][2];
#pragma unroll
        for (int n = 0; n < 8; n++)
            if (n < 2 * w + 2)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int   r = r0 + gq + 8 * hf, j = 8 * n + 2 * tq;
                    const float gr = gam[r], br = r < L ? bet[r] : 0.0f;
                    const float e0 = j <= r ? __expf(gr - gam[j]) : 0.0f;
                    const float e1 = j + 1 <= r ? __expf(gr - gam[j + 1]) : 0.0f;
                    const float p0 = r < L ? qk[n][2 * hf] * e0 : 0.0f,
                                p1 = r < L ? qk[n][2 * hf + 1] * e1 : 0.0f;
                    pp[n][hf] = pack_bf16(p0, p1);
                    *(float2 *)(Af + r * FS + j) =
                        make_float2(j < r ? br * e0 * kk[n][2 * hf] : 0.0f,
                                    j + 1 < r ? br * e1 * kk[n][2 * hf + 1] : 0.0f);
                }
        /* through this warp's own rows of Q, which only it read */
        gdn_store16<8>(Pg + (slot * 64 + r0) * 64, 64, pp, Qb + r0 * KS, KS, 16 * w + 16, lane);
    }

    gdn_vregs<VT> vr; /* v of the first 64 columns, in flight during the inverse */
    gdn_vload(vr, v, t0, L, nv, h, dv, 0, tid);

    // the diagonal block of this warp's rows: lane c < 16 solves column c of (I + A_ww) x = e_c
    __syncwarp();
    if (lane < 16) {
        const float *Ab = Af + r0 * FS + r0;
        float        x[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float acc = r == lane ? 1.0f : 0.0f;
#pragma unroll
            for (int m = 0; m < r; m++)
                acc -= Ab[r * FS + m] * x[m];
            x[r] = acc;
        }
#pragma unroll
        for (int r = 0; r < 16; r++)
            Ti[(r0 + r) * FS + r0 + lane] = x[r];
    }
    __syncthreads(); /* A and the diagonal blocks of T complete; Q is dead */
#pragma unroll
    for (int i = 0; i < 16; i++)
        *(uint32_t *)(Vb + (w + 4 * i) * BS + 2 * lane) = gdn_vpair(vr, i);
    if (DVP > 64)
        gdn_vload(vr, v, t0, L, nv, h, dv, 64, tid);

    // the block rows of T, three levels
    if (w >= 1)
        gdn_merge(Ti, Af, Xs, w, w - 1, gq, tq);
    __syncthreads(); /* also: the first v stage is visible */
    if (w >= 2)
        gdn_merge(Ti, Af, Xs, w, w - 2, gq, tq);
    __syncthreads();
    if (w == 3)
        gdn_merge(Ti, Af, Xs, 3, 0, gq, tq);
    __syncwarp(); /* this warp's rows of T are complete: W and U need no other warp's */

    // W = T diag(β e^γ) K, 128 columns at a time (T lower triangular: k blocks ≤ w)
    bf16         *W = Wg + slot * 64 * DKP;
    constexpr int WC = DKP < 128 ? DKP : 128;
#pragma unroll 1
    for (int c0 = 0; c0 < DKP; c0 += WC) {
        float acc[WC / 8][4];
#pragma unroll
        for (int n = 0; n < WC / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[n][e] = 0.0f;
        for (int kk = 0; kk <= w; kk++) {
            uint32_t a[4];
            gdn_frag_a_scaled(a, Ti, FS, r0, 16 * kk, bge, gq, tq);
#pragma unroll
            for (int np = 0; np < WC / 16; np++) {
                uint32_t b[4];
                frag_b_kn_l(b, Kb, KS, 16 * kk, c0 + 16 * np, lane);
                mma_bf16(acc[2 * np], a, b[0], b[1]);
                mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
            }
        }
        uint32_t pw[WC / 8][2];
#pragma unroll
        for (int n = 0; n < WC / 8; n++) {
            pw[n][0] = pack_bf16(acc[n][0], acc[n][1]);
            pw[n][1] = pack_bf16(acc[n][2], acc[n][3]);
        }
        /* through this warp's own rows of A, free once its merges are done */
        gdn_store16<WC / 8>(W + r0 * DKP + c0, DKP, pw, (bf16 *)(Af + r0 * FS), 2 * FS, WC, lane);
    }

    // U = T diag(β) V, 64 columns a pass (DVP is a multiple of 32: the last pass may have 32)
    bf16 *U = Ug + slot * 64 * (int64_t)DVP;
#pragma unroll 1
    for (int c0 = 0; c0 < DVP; c0 += 64) {
        if (c0 > 0) {
            __syncthreads(); /* every warp is done with the last pass's stage */
#pragma unroll
            for (int i = 0; i < 16; i++)
                *(uint32_t *)(Vb + (w + 4 * i) * BS + 2 * lane) = gdn_vpair(vr, i);
            if (c0 + 64 < DVP)
                gdn_vload(vr, v, t0, L, nv, h, dv, c0 + 64, tid);
            __syncthreads();
        }
        const int nc = DVP - c0 < 64 ? DVP - c0 : 64;
        float     acc[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[n][e] = 0.0f;
        for (int kk = 0; kk <= w; kk++) {
            uint32_t a[4];
            gdn_frag_a_scaled(a, Ti, FS, r0, 16 * kk, bet, gq, tq);
#pragma unroll
            for (int np = 0; np < 4; np++)
                if (16 * np < nc) {
                    uint32_t b[4];
                    frag_b_kn_l(b, Vb, BS, 16 * kk, 16 * np, lane);
                    mma_bf16(acc[2 * np], a, b[0], b[1]);
                    mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
                }
        }
        uint32_t pu[8][2];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            pu[n][0] = pack_bf16(acc[n][0], acc[n][1]);
            pu[n][1] = pack_bf16(acc[n][2], acc[n][3]);
        }
        gdn_store16<8>(U + r0 * (int64_t)DVP + c0, DVP, pu, (bf16 *)(Af + r0 * FS), 2 * FS, nc, lane);
    }
}

// ----------------------------------------------------------------------------
// launchers (kn_gdn_int.h)

/* The device's shared memory per block with opt-in (0 where it cannot be read). */
int kn_gdn_smem_optin(const kn_ctx *ctx) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return optin;
}

/* q, k F32 (copied to bf16 · scale here) with qb = kb = NULL, or qb, kb already bf16 [T, nk, DKP]
 * (q carrying its scale); v F32 or BF16. */
template <int DKP, typename VT>
static cm_status gdn_chunked_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const bf16 *qb,
                                    const bf16 *kb, const VT *v, const float *g, const float *beta,
                                    const int32_t *cu, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                                    float scale) {
    const int64_t cap = T / GDN_C + n_seq; /* Σ ceil(len / 64) ≤ Σ (len / 64 + 1) */
    KN_CUDA_CHECK_ARG(T + n_seq < INT32_MAX / 2 && cap * nv < INT32_MAX,
                      "gated_delta_rule: T=%lld tokens exceeds the chunk table's int32 range", (long long)T);
    /* dk ≤ 128: the register-state kernel, GDN_MV columns per block; dk 256 (its state would
     * not fit the registers): gdn_state, GDN_BV columns per block */
    constexpr bool MMA = DKP <= 128;
    const int      CW = MMA ? GDN_MV : GDN_BV, DVP = (dv + CW - 1) / CW * CW;
    /* scratch: q·scale and k in bf16 padded to DKP, then per chunk slot and v-head W, U, P, E,
     * then the chunk table */
    const size_t qkb = qb ? 0 : (size_t)T * nk * DKP * 2;
    size_t       off[8], sz[7] = {qkb,
                                  qkb,
                                  (size_t)cap * nv * 64 * DKP * 2,
                                  (size_t)cap * nv * 64 * DVP * 2,
                                  (size_t)cap * nv * 64 * 64 * 2,
                                  (size_t)cap * nv * 192 * 4,
                                  (size_t)cap * sizeof(int2) + (size_t)(n_seq + 1) * sizeof(int)};
    off[0] = 0;
    for (int i = 0; i < 7; i++)
        off[i + 1] = off[i] + (sz[i] + 255) / 256 * 256;
    CM_TRY(kn_cuda_scratch_reserve(ctx, off[7]));
    char       *base = (char *)ctx->scratch;
    const bf16 *qc = qb ? qb : (const bf16 *)(base + off[0]), *kc = kb ? kb : (const bf16 *)(base + off[1]);
    bf16       *Wg = (bf16 *)(base + off[2]);
    bf16       *Ug = (bf16 *)(base + off[3]), *Pg = (bf16 *)(base + off[4]);
    float      *Eg = (float *)(base + off[5]);
    int2       *chunks = (int2 *)(base + off[6]);
    int        *seq_first = (int *)(chunks + cap), *n_chunks = seq_first + n_seq;

    if (!qb) {
        const int64_t  nvec = T * nk * (DKP / 8);
        const unsigned cgrid = (unsigned int)((nvec + 255) / 256 < 65536 ? (nvec + 255) / 256 : 65536);
        gdn_to_bf16_padded<<<cgrid, 256, 0, ctx->stream>>>((bf16 *)(base + off[0]), q, T * nk, dk, DKP,
                                                           scale);
        KN_CUDA_LAUNCHED(ctx);
        gdn_to_bf16_padded<<<cgrid, 256, 0, ctx->stream>>>((bf16 *)(base + off[1]), k, T * nk, dk, DKP, 1.0f);
        KN_CUDA_LAUNCHED(ctx);
    }
    gdn_chunk_table_kernel<<<1, 1024, 0, ctx->stream>>>(chunks, seq_first, n_chunks, cu, n_seq, T, (int)cap);
    KN_CUDA_LAUNCHED(ctx);

    const size_t prep_smem = gdn_prep_mma_smem<DKP>::bytes;
    /* blocks above 48 KB of dynamic shared memory must opt in (a host-side attribute, no sync) */
    KN_CUDA(cudaFuncSetAttribute(gdn_prep_mma_kernel<DKP, VT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)prep_smem));
    gdn_prep_mma_kernel<DKP, VT>
        <<<dim3((unsigned int)cap, (unsigned int)nv), GDN_PT, prep_smem, ctx->stream>>>(
            Wg, Ug, Pg, Eg, qc, kc, v, g, beta, chunks, n_chunks, nk, nv, dv, DVP);
    KN_CUDA_LAUNCHED(ctx);

    return kn_gdn_state(ctx, DKP, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv, DVP);
}

/* Whether the chunked form's blocks fit this device's shared memory per block (227 KB on
 * Hopper and datacenter Blackwell, 163 KB on A100, 99 KB on Ampere/Ada/Blackwell RTX parts such
 * as sm_120); where they do not, the exact per-token kernel runs instead (slower, same result
 * to rounding). */
int kn_gdn_chunked_fits(const kn_ctx *ctx, int dk) {
    const int optin = kn_gdn_smem_optin(ctx);
    size_t    p, s;
    if (dk <= 64) {
        p = gdn_prep_mma_smem<64>::bytes;
        s = kn_gdn_state_smem(64, 1);
    } else if (dk <= 128) {
        p = gdn_prep_mma_smem<128>::bytes;
        s = kn_gdn_state_smem(128, 1);
    } else {
        p = gdn_prep_mma_smem<256>::bytes;
        s = kn_gdn_state_smem(256, 1);
    }
    return (p > s ? p : s) <= (size_t)optin;
}

/* The chunked form; arguments already checked. */
cm_status kn_gdn_chunked(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const int32_t *cu, int n_seq, int64_t T, int nk,
                         int nv, int dk, int dv, float scale) {
    if (dk <= 64)
        return gdn_chunked_launch<64>(ctx, out, q, k, NULL, NULL, v, g, beta, cu, n_seq, T, nk, nv, dk, dv,
                                      scale);
    if (dk <= 128)
        return gdn_chunked_launch<128>(ctx, out, q, k, NULL, NULL, v, g, beta, cu, n_seq, T, nk, nv, dk, dv,
                                       scale);
    return gdn_chunked_launch<256>(ctx, out, q, k, NULL, NULL, v, g, beta, cu, n_seq, T, nk, nv, dk, dv,
                                   scale);
}

/* The chunked form from bf16 q (carrying its scale), k and v, dk 64, 128 or 256 (the padded
 * widths, so q and k are read as they are); arguments already checked. */
cm_status kn_gdn_chunked_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                              const uint16_t *v, const float *g, const float *beta, const int32_t *cu,
                              int n_seq, int64_t T, int nk, int nv, int dk, int dv) {
    const bf16 *qb = (const bf16 *)q, *kb = (const bf16 *)k, *vb = (const bf16 *)v;
    if (dk == 64)
        return gdn_chunked_launch<64>(ctx, out, NULL, NULL, qb, kb, vb, g, beta, cu, n_seq, T, nk, nv, dk, dv,
                                      1.0f);
    if (dk == 128)
        return gdn_chunked_launch<128>(ctx, out, NULL, NULL, qb, kb, vb, g, beta, cu, n_seq, T, nk, nv, dk,
                                       dv, 1.0f);
    return gdn_chunked_launch<256>(ctx, out, NULL, NULL, qb, kb, vb, g, beta, cu, n_seq, T, nk, nv, dk, dv,
                                   1.0f);
}
