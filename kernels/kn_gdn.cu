/* kernels/kn_gdn.cu — the Gated DeltaNet core: the gate (g = −e^{A_log}·softplus(a + dt_bias),
 * beta = sigmoid(b), one thread per (token, v-head), fp32) and the gated delta rule, in two forms
 * chosen by the context's precision (both compute the function of kn_backend.h):
 *
 * - KN_GEMM_MODE_F32 (dump --precision fp32, the fp32 oracle checks): the per-token recurrence,
 *   all fp32 SIMT: per token, S = e^g·S; u = β(v − Sᵀk); S += k uᵀ; o = Sᵀ(q·scale). One block
 *   per (sequence, v-head, 32-column tile of dv); the fp32 state tile S[dk, 32] lives in
 *   registers (lane = column, warp w of 8 owns rows w, w+8, …). Exact to fp32 rounding, slow.
 *
 * - KN_GEMM_MODE_BF16 (serving): the chunked WY form of docs/target.md with C = 64
 *   (kn_gdn_ref.c is its specification), matrix products on bf16 tensor cores (mma.sync
 *   m16n8k16 with ldmatrix fragments, fp32 accumulation; sm_80 and newer, no wgmma/TMA, so the
 *   same code runs on Ampere, Hopper and Blackwell), fp32 state, everything in the ctx scratch
 *   (no allocation after the first call of a size):
 *   1. gdn_to_bf16_padded (twice): q·scale and k to bf16 [T, nk, DKP], DKP = dk rounded up to
 *      64, 128 or 256, so every operand row is whole 16-byte vectors for cp.async.
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
 *      registers): gdn_state, the state slice S[dk, 32] in shared memory, WMMA.
 *   On an H200 at the 27B shape and 8192 tokens (one sequence) this takes 0.75–0.83 ms (the
 *   pack of mixed lengths: 0.69); ncu at its locked clocks: prep 0.37 ms, state 0.52 ms, q/k
 *   copies 0.06, chunk table 0.01. The state kernel is bound by shared memory (each 512-byte
 *   ldmatrix feeds two mma.sync; L1 64 % busy) and latency with one block per SM; see
 *   bench/results/target-2026-11-30.md.
 *   Rounding: q, k, v, T diag(β e^γ), T diag(β), W, U, the state and δ enter the tensor cores as
 *   bf16 (FLA rounds the same operands; the inverse's block merge runs on tf32), so outputs
 *   differ from the fp64 reference by a few 1e-3 relative (test_kn_cuda).
 *   dk is zero-padded to 64, 128 or 256 (zero columns change no dot product); dv is any size.
 *   gdn_state_mma at dk 128 takes 188 KB of shared memory with its two stages, 118 KB with one
 *   (A100: 163 KB per block); where a device's shared memory per block is too small even for
 *   that (sm_86/89/120 parts: 99 KB), the per-token kernel runs instead (gdn_chunked_fits). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include <cuda_bf16.h>
#include <mma.h>

#include "kn_mma_sm80.h"

using namespace nvcuda;
typedef __nv_bfloat16 bf16;

#define GDN_WARPS  8  /* row groups */
#define GDN_CH     16 /* tokens staged per shared-memory load */
#define GDN_MAX_DK 256

// ----------------------------------------------------------------------------
// kernels

static __global__ void gdn_gate_kernel(float *g, float *beta, const float *a, const float *b,
                                       const float *A_log, const float *dt_bias, int64_t n, int nv) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int   h = (int)(i % nv);
        float x = a[i] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(A_log[h]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
}

/* NR = state rows per thread; 8·NR ≥ dk. grid (n_seq·nv, ceil(dv/32)), block 32·GDN_WARPS.
 * Dynamic shared memory: k_s, q_s [GDN_CH][8·NR], v_s [GDN_CH][32], g_s, b_s [GDN_CH]. */
template <int NR>
static __global__ void gated_delta_rule_kernel(float *out, const float *q, const float *k, const float *v,
                                               const float *g, const float *beta, const int32_t *cu,
                                               int64_t T, int nk, int nv, int dk, int dv, float scale) {
    constexpr int           DKP = GDN_WARPS * NR;
    extern __shared__ float smem[];
    float                  *k_s = smem;
    float                  *q_s = k_s + GDN_CH * DKP;
    float                  *v_s = q_s + GDN_CH * DKP;
    float                  *g_s = v_s + GDN_CH * 32;
    float                  *b_s = g_s + GDN_CH;
    __shared__ float        red_kv[GDN_WARPS][32], red_o[GDN_WARPS][32];

    const int seq = blockIdx.x / nv, h = blockIdx.x % nv, kh = h / (nv / nk);
    const int col0 = blockIdx.y * 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t   bos = cu[seq], eos = cu[seq + 1];
    bos = bos < 0 ? 0 : (bos > T ? T : bos);
    eos = eos < bos ? bos : (eos > T ? T : eos);

    float S[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        S[r] = 0.0f;

    for (int64_t t0 = bos; t0 < eos; t0 += GDN_CH) {
        const int L = (int)(eos - t0 < GDN_CH ? eos - t0 : GDN_CH);
        for (int idx = threadIdx.x; idx < GDN_CH * DKP; idx += blockDim.x) {
            int     tau = idx / DKP, i = idx % DKP;
            int64_t off = ((t0 + tau) * nk + kh) * (int64_t)dk + i;
            bool    ok = tau < L && i < dk;
            k_s[idx] = ok ? k[off] : 0.0f;
            q_s[idx] = ok ? q[off] * scale : 0.0f;
        }
        for (int idx = threadIdx.x; idx < GDN_CH * 32; idx += blockDim.x) {
            int tau = idx / 32, c = col0 + idx % 32;
            v_s[idx] = tau < L && c < dv ? v[((t0 + tau) * nv + h) * (int64_t)dv + c] : 0.0f;
        }
        for (int tau = threadIdx.x; tau < GDN_CH; tau += blockDim.x) {
            g_s[tau] = tau < L ? g[(t0 + tau) * nv + h] : 0.0f;
            b_s[tau] = tau < L ? beta[(t0 + tau) * nv + h] : 0.0f;
        }
        __syncthreads();

        for (int tau = 0; tau < L; tau++) {
            const float *kt = k_s + tau * DKP, *qt = q_s + tau * DKP;
            float        p = 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++)
                p += S[r] * kt[warp + GDN_WARPS * r];
            red_kv[warp][lane] = p;
            __syncthreads();
            float kv = 0.0f;
#pragma unroll
            for (int w = 0; w < GDN_WARPS; w++)
                kv += red_kv[w][lane];
            const float decay = expf(g_s[tau]);
            const float u = b_s[tau] * (v_s[tau * 32 + lane] - decay * kv);
            float       po = 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                S[r] = decay * S[r] + kt[warp + GDN_WARPS * r] * u;
                po += S[r] * qt[warp + GDN_WARPS * r];
            }
            red_o[warp][lane] = po;
            __syncthreads();
            if (warp == 0 && col0 + lane < dv) {
                float o = 0.0f;
#pragma unroll
                for (int w = 0; w < GDN_WARPS; w++)
                    o += red_o[w][lane];
                out[((t0 + tau) * nv + h) * (int64_t)dv + col0 + lane] = o;
            }
        }
        /* the last token's second barrier already ordered every read of the staged chunk
         * before the next chunk's writes */
    }
}

// ---- the chunked form (KN_GEMM_MODE_BF16)

#define GDN_C       64  /* chunk length */
#define GDN_BV      32  /* state columns per block of gdn_state */
#define GDN_THREADS 256 /* 8 warps */
#define GDN_FS      68  /* fp32 stride of 64-wide tiles (a multiple of 4 for WMMA, off the 32 banks) */
#define GDN_BS      72  /* bf16 stride of 64-wide tiles (a multiple of 8 for WMMA, 16-byte rows) */
#define GDN_SFS     36  /* fp32 stride of GDN_BV-wide tiles */
#define GDN_SBS     40  /* bf16 stride of GDN_BV-wide tiles */

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> gdn_fa_row;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> gdn_fa_col;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> gdn_fb_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> gdn_fb_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float>                gdn_facc;

/* 16- and 4-byte asynchronous copies global → shared (sm_80+); src_bytes 0 writes zeros. */
static __device__ __forceinline__ void gdn_cp16(void *smem, const void *gmem, int src_bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
static __device__ __forceinline__ void gdn_cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> static __device__ __forceinline__ void gdn_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* x [rows, n] fp32 · scale → dst [rows, P] bf16, zero past n (P a multiple of 8). */
static __global__ void gdn_to_bf16_padded(bf16 *dst, const float *x, int64_t rows, int n, int P, float scale) {
    const int64_t nvec = rows * (P / 8), stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const int64_t r = i / (P / 8);
        const int     c0 = (int)(i % (P / 8)) * 8;
        __align__(16) bf16 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = __float2bfloat16(c0 + j < n ? x[r * n + c0 + j] * scale : 0.0f);
        *(uint4 *)(dst + r * P + c0) = *(const uint4 *)v;
    }
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

/* γ_r = Σ_{i≤r} g[t0 + i] for r < 64 (rows ≥ L repeat γ_{L−1}), by one warp: lane l owns rows
 * 2l, 2l+1 and the pair sums are scanned with shuffles. */
static __device__ __forceinline__ void gdn_chunk_gamma(float *gam, const float *g, int64_t t0, int L, int nv,
                                                       int h, int lane) {
    const int r0 = 2 * lane, r1 = r0 + 1;
    float     g0 = r0 < L ? g[(t0 + r0) * nv + h] : 0.0f;
    float     g1 = r1 < L ? g[(t0 + r1) * nv + h] : 0.0f;
    float     pair = g0 + g1, incl = pair;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
            incl += n;
    }
    float excl = incl - pair;
    gam[r0] = excl + g0;
    gam[r1] = excl + g0 + g1;
}

/* 64 rows of DKP bf16 (row r at src + r·row_stride, rows ≥ L zero-filled) into smem rows of
 * stride DKP + 8, by nt threads. */
template <int DKP>
static __device__ __forceinline__ void gdn_load_rows(bf16 *dst, const bf16 *src, int64_t row_stride, int L,
                                                     int tid, int nt) {
    constexpr int VPR = DKP / 8;
    for (int i = tid; i < 64 * VPR; i += nt) {
        const int r = i / VPR, c = (i % VPR) * 8;
        gdn_cp16(dst + r * (DKP + 8) + c, src + (r < L ? r : 0) * row_stride + c, r < L ? 16 : 0);
    }
}

/* One pipeline stage of gdn_state: the chunk's W, Q, K, U slice, P and E. */
template <int DKP> struct gdn_stage {
    static constexpr int    KS = DKP + 8;
    static constexpr size_t bytes = 3 * (size_t)64 * KS * 2 /* Wb, Qb, Kb */ + (size_t)64 * GDN_SBS * 2 /* Ub */ +
                                    (size_t)64 * GDN_BS * 2 /* Pb */ + 192 * 4 /* Eb */;
};

template <int DKP, int STAGES> struct gdn_state_smem {
    static constexpr size_t bytes = STAGES * gdn_stage<DKP>::bytes + (size_t)DKP * GDN_SFS * 4 /* Sf */ +
                                    (size_t)DKP * GDN_SBS * 2 /* Sb */ + 2 * (size_t)64 * GDN_SBS * 2 /* Db, Dd */;
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
        gdn_cp16(Ub + r * GDN_SBS + c, Ug + (slot * 64 + r) * DVP + col0 + c, 16);
    }
    for (int i = tid; i < 64 * 8; i += GDN_THREADS) {
        const int r = i / 8, c = (i % 8) * 8;
        gdn_cp16(Pb + r * GDN_BS + c, Pg + (slot * 64 + r) * 64 + c, 16);
    }
    if (tid < 48)
        gdn_cp16(Eb + tid * 4, Eg + slot * 192 + tid * 4, 16);
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
    gdn_state_kernel(float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug, const bf16 *Pg,
                     const float *Eg, const int32_t *cu, const int *seq_first, int64_t T, int nk, int nv, int dv,
                     int DVP) {
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
    unsigned char *stage0 = gdn_smem;
    float         *Sf = (float *)(gdn_smem + STAGES * gdn_stage<DKP>::bytes); /* [DKP][SFS] */
    bf16          *Sb = (bf16 *)(Sf + DKP * SFS);                             /* [DKP][SBS] */
    bf16          *Db = Sb + DKP * SBS;                                       /* [64][SBS] δ */
    bf16          *Dd = Db + 64 * SBS;                                        /* [64][SBS] e^{γ_last−γ} δ */

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
        gdn_cp_commit();
    }

    for (int k = 0; k < nch; k++) {
        const int64_t t0 = bos + (int64_t)k * GDN_C;
        const int     L = (int)(eos - t0 < GDN_C ? eos - t0 : GDN_C);
        __syncthreads(); /* A: the previous chunk is done with every buffer */
        if (STAGES == 2 && k + 1 < nch) {
            const int64_t t1 = t0 + GDN_C;
            gdn_state_load<DKP>(stage0 + ((k + 1) % 2) * gdn_stage<DKP>::bytes, Wg, Ug, Pg, Eg, qc, kc,
                                (int64_t)(first + k + 1) * nv + h, t1, (int)(eos - t1 < GDN_C ? eos - t1 : GDN_C),
                                nk, kh, DVP, col0, tid);
            gdn_cp_commit();
            gdn_cp_wait<1>();
        } else {
            if (STAGES == 1 && k > 0) {
                gdn_state_load<DKP>(stage0, Wg, Ug, Pg, Eg, qc, kc, (int64_t)(first + k) * nv + h, t0, L, nk, kh,
                                    DVP, col0, tid);
                gdn_cp_commit();
            }
            gdn_cp_wait<0>();
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

#define GDN_MW 4             /* state row slices of gdn_state_mma, 16 rows (v columns) each */
#define GDN_MV (16 * GDN_MW) /* v columns per block */
#define GDN_US (GDN_MV + 8)  /* bf16 stride of the staged U slice */

/* B fragments of the n tiles n0.. and n0 + 8.. at k0.. with B[k][n] = M[n][k] (M row-major,
 * n-major: Wᵀ, Qᵀ, Pᵀ from W, Q, P [token][·]): {r0, r1} for n0, {r2, r3} for n0 + 8. */
static __device__ __forceinline__ void gdn_frag_b_nk(uint32_t r[4], const bf16 *M, int ld, int n0, int k0,
                                                     int lane) {
    ldsm_x4(r, M + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}
/* The same with B[k][n] = M[k][n] (M k-major: K [token][dk] in δᵀ·K). */
static __device__ __forceinline__ void gdn_frag_b_kn(uint32_t r[4], const bf16 *M, int ld, int k0, int n0,
                                                     int lane) {
    ldsm_x4_t(r, M + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

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
        gdn_cp16(Wb + rr * KS + c, w + j * RPP * DKP, 16);
        gdn_cp16(Qb + rr * KS + c, q + (rr < L ? rr : 0) * rs, rr < L ? 16 : 0);
        gdn_cp16(Kb + rr * KS + c, k + (rr < L ? rr : 0) * rs, rr < L ? 16 : 0);
    }
    const int ur = tid / 8, uc = (tid % 8) * 8; /* 64 rows × 8 vectors: two per thread */
#pragma unroll
    for (int j = 0; j < 2; j++) {
        gdn_cp16(Ub + (ur + 32 * j) * GDN_US + uc, Ug + (slot * 64 + ur + 32 * j) * DVP + col0 + uc, 16);
        gdn_cp16(Pb + (ur + 32 * j) * GDN_BS + uc, Pg + (slot * 64 + ur + 32 * j) * 64 + uc, 16);
    }
    if (tid < 48)
        gdn_cp16(Eb + tid * 4, Eg + slot * 192 + tid * 4, 16);
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
    const int     c_lo = col0 + vr, c_hi = c_lo + 8;
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
            gdn_cp_commit();
        }
        gdn_cp_wait<0>();
        __syncthreads(); /* chunk k has landed for every thread; chunk k − 1's buffer and the
                          * exchange areas are free */
        if (ST == 2 && k + 1 < nch) {
            const int64_t t1 = t0 + GDN_C;
            gdn_mstate_load<DKP>(smem + ((k + 1) & 1) * gdn_mstage<DKP>::bytes, Wg, Ug, Pg, Eg, qc, kc,
                                 (int64_t)(first + k + 1) * nv + h, t1,
                                 (int)(eos - t1 < GDN_C ? eos - t1 : GDN_C), nk, kh, DVP, col0, tid);
            gdn_cp_commit();
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
                gdn_frag_b_nk(b, Wb, KS, np * 16, HF * KH + ks * 16, lane);
                mma_bf16(D[2 * np], a, b[0], b[1]);
                mma_bf16(D[2 * np + 1], a, b[2], b[3]);
                gdn_frag_b_nk(b, Qb, KS, np * 16, HF * KH + ks * 16, lane);
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
            da[kk][0] = pack_bf16(d[0][0], d[0][1]);
            da[kk][1] = pack_bf16(d[0][2], d[0][3]);
            da[kk][2] = pack_bf16(d[1][0], d[1][1]);
            da[kk][3] = pack_bf16(d[1][2], d[1][3]);
            const int   tl = 16 * kk + 2 * t, th = tl + 8;
            const float l0 = Eb[64 + tl], l1 = Eb[64 + tl + 1], h0 = Eb[64 + th], h1 = Eb[64 + th + 1];
            dd[kk][0] = pack_bf16(d[0][0] * l0, d[0][1] * l1);
            dd[kk][1] = pack_bf16(d[0][2] * l0, d[0][3] * l1);
            dd[kk][2] = pack_bf16(d[1][0] * h0, d[1][1] * h1);
            dd[kk][3] = pack_bf16(d[1][2] * h0, d[1][3] * h1);
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
                gdn_frag_b_kn(b, Kb, KS, kk * 16, HF * KH + np * 16, lane);
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
                gdn_frag_b_nk(b, Pb, BS, np * 16, kk * 16, lane);
                mma_bf16(O[2 * np], da[kk], b[0], b[1]);
                mma_bf16(O[2 * np + 1], da[kk], b[2], b[3]);
            }
        }
        float *o = out + (t0 * nv + h) * (int64_t)dv;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int n = own[j], tok = 8 * n + 2 * t;
            float    *o0 = o + (int64_t)tok * nv * dv, *o1 = o0 + (int64_t)nv * dv;
            if (tok < L) {
                if (c_lo < dv)
                    o0[c_lo] = O[n][0];
                if (c_hi < dv)
                    o0[c_hi] = O[n][2];
            }
            if (tok + 1 < L) {
                if (c_lo < dv)
                    o1[c_lo] = O[n][1];
                if (c_hi < dv)
                    o1[c_hi] = O[n][3];
            }
        }
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
    float *X = (float *)(gdn_smem + ST * gdn_mstage<DKP>::bytes);
    if (nch > 0) {
        gdn_mstate_load<DKP>(gdn_smem, Wg, Ug, Pg, Eg, qc, kc, (int64_t)first * nv + h, bos,
                             (int)(eos - bos < GDN_C ? eos - bos : GDN_C), nk, kh, DVP, col0, tid);
        gdn_cp_commit();
    }
    float *Xme = X + warp * GDN_XW, *Xpa = X + (warp ^ 1) * GDN_XW;
    if (warp & 1)
        gdn_state_warp<DKP, ST, 1>(out, qc, kc, Wg, Ug, Pg, Eg, gdn_smem, Xme, Xpa, 1 + pair, bos, eos, first,
                                   nch, h, kh, nk, nv, dv, DVP, col0, vr);
    else
        gdn_state_warp<DKP, ST, 0>(out, qc, kc, Wg, Ug, Pg, Eg, gdn_smem, Xme, Xpa, 1 + pair, bos, eos, first,
                                   nch, h, kh, nk, nv, dv, DVP, col0, vr);
}

// ---- gdn_prep on mma.sync: warp w owns the 16 rows 16w … 16w + 15 of every chunk product

/* A fragment of the 16×16 block of M (bf16, row-major, ld) at rows r0.., cols c0... */
static __device__ __forceinline__ void gdn_frag_a(uint32_t a[4], const bf16 *M, int ld, int r0, int c0,
                                                  int lane) {
    ldsm_x4(a, M + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8);
}
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
 * together so that their latency overlaps. */
static __device__ __forceinline__ void gdn_vload(float (&x)[32], const float *v, int64_t t0, int L, int nv,
                                                 int h, int dv, int c0, int tid) {
    const int     r = tid / 32, c = c0 + 2 * (tid % 32);
    const float  *p = v + ((t0 + r) * nv + h) * (int64_t)dv + c;
    const int64_t step = (int64_t)4 * nv * dv;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const bool ok = r + 4 * i < L;
        x[2 * i] = ok && c < dv ? __ldg(p + i * step) : 0.0f;
        x[2 * i + 1] = ok && c + 1 < dv ? __ldg(p + i * step + 1) : 0.0f;
    }
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
 *   they are built. Row blocks above the diagonal of P are not written (never read).
 * Three blocks share a multiprocessor at dk 128 (75 KB each). */
template <int DKP>
static __global__ void __launch_bounds__(GDN_PT, 3)
    gdn_prep_mma_kernel(bf16 *Wg, bf16 *Ug, bf16 *Pg, float *Eg, const bf16 *qc, const bf16 *kc,
                        const float *v, const float *g, const float *beta, const int2 *chunks,
                        const int *n_chunks, int nk, int nv, int dv, int DVP) {
    typedef gdn_prep_mma_smem<DKP> SM;
    constexpr int                  KS = SM::KS, FS = GDN_FS, BS = GDN_BS;
    if ((int)blockIdx.x >= *n_chunks)
        return;
    const int2    ch = chunks[blockIdx.x];
    const int64_t t0 = ch.x, slot = (int64_t)blockIdx.x * nv + blockIdx.y;
    const int     L = ch.y, h = blockIdx.y, kh = h / (nv / nk);
    const int     tid = threadIdx.x, w = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4, r0 = 16 * w;

    extern __shared__ __align__(128) unsigned char gdn_smem[];
    bf16  *Kb = (bf16 *)gdn_smem;        /* [64][KS] k */
    bf16  *Qb = Kb + 64 * KS;            /* [64][KS] q · scale */
    bf16  *Vb = Qb;                      /* [64][BS] v, 64 columns a pass, once Q is done */
    float *Af = (float *)(Qb + 64 * KS); /* [64][FS] A */
    float *Ti = Af + 64 * FS;            /* [64][FS] T = (I + A)^{-1} */
    float *Xs = Ti + 64 * FS + w * 16 * GDN_XS;
    float *gam = Ti + 64 * FS + 4 * 16 * GDN_XS, *bet = gam + 64, *bge = bet + 64; /* γ, β, β e^γ */

    gdn_load_rows<DKP>(Kb, kc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_PT);
    gdn_load_rows<DKP>(Qb, qc + (t0 * nk + kh) * (int64_t)DKP, (int64_t)nk * DKP, L, tid, GDN_PT);
    gdn_cp_commit();
    if (w == 0)
        gdn_chunk_gamma(gam, g, t0, L, nv, h, lane);
    else if (w == 1)
        for (int r = lane; r < 64; r += 32)
            bet[r] = r < L ? beta[(t0 + r) * nv + h] : 0.0f;
    gdn_cp_wait<0>();
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
            gdn_frag_a(ak, Kb, KS, r0, ks * 16, lane);
            gdn_frag_a(aq, Qb, KS, r0, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < 4; np++)
                if (np <= w) {
                    uint32_t b[4];
                    gdn_frag_b_nk(b, Kb, KS, np * 16, ks * 16, lane);
                    mma_bf16(kk[2 * np], ak, b[0], b[1]);
                    mma_bf16(kk[2 * np + 1], ak, b[2], b[3]);
                    mma_bf16(qk[2 * np], aq, b[0], b[1]);
                    mma_bf16(qk[2 * np + 1], aq, b[2], b[3]);
                }
        }
        // P = (Q Kᵀ ⊙ e^{γ_r−γ_j})[j ≤ r < L] to global, A = β_r e^{γ_r−γ_j} k_r·k_j [j < r < L] to Af
        // (the exponent is masked before the exp, so it only ever sees γ_r − γ_j ≤ 0)
        bf16 *P = Pg + slot * 64 * 64;
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
                    *(uint32_t *)(P + r * 64 + j) = pack_bf16(p0, p1);
                    *(float2 *)(Af + r * FS + j) =
                        make_float2(j < r ? br * e0 * kk[n][2 * hf] : 0.0f,
                                    j + 1 < r ? br * e1 * kk[n][2 * hf + 1] : 0.0f);
                }
    }

    float vr[32]; /* v of the first 64 columns, in flight during the inverse */
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
        *(uint32_t *)(Vb + (w + 4 * i) * BS + 2 * lane) = pack_bf16(vr[2 * i], vr[2 * i + 1]);
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
                gdn_frag_b_kn(b, Kb, KS, 16 * kk, c0 + 16 * np, lane);
                mma_bf16(acc[2 * np], a, b[0], b[1]);
                mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < WC / 8; n++) {
            const int c = c0 + 8 * n + 2 * tq;
            *(uint32_t *)(W + (r0 + gq) * DKP + c) = pack_bf16(acc[n][0], acc[n][1]);
            *(uint32_t *)(W + (r0 + gq + 8) * DKP + c) = pack_bf16(acc[n][2], acc[n][3]);
        }
    }

    // U = T diag(β) V, 64 columns a pass (DVP is a multiple of 32: the last pass may have 32)
    bf16 *U = Ug + slot * 64 * (int64_t)DVP;
#pragma unroll 1
    for (int c0 = 0; c0 < DVP; c0 += 64) {
        if (c0 > 0) {
            __syncthreads(); /* every warp is done with the last pass's stage */
#pragma unroll
            for (int i = 0; i < 16; i++)
                *(uint32_t *)(Vb + (w + 4 * i) * BS + 2 * lane) = pack_bf16(vr[2 * i], vr[2 * i + 1]);
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
                    gdn_frag_b_kn(b, Vb, BS, 16 * kk, 16 * np, lane);
                    mma_bf16(acc[2 * np], a, b[0], b[1]);
                    mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
                }
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
            if (8 * n < nc) {
                const int c = c0 + 8 * n + 2 * tq;
                *(uint32_t *)(U + (r0 + gq) * (int64_t)DVP + c) = pack_bf16(acc[n][0], acc[n][1]);
                *(uint32_t *)(U + (r0 + gq + 8) * (int64_t)DVP + c) = pack_bf16(acc[n][2], acc[n][3]);
            }
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_gdn_gate(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b,
                           const float *A_log, const float *dt_bias, int64_t T, int nv) {
    KN_CUDA_CHECK_ARG(ctx, "gdn_gate: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nv > 0, "gdn_gate: bad shape T=%lld nv=%d (T >= 0, nv > 0)", (long long)T,
                      nv);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(g && beta && a && b && A_log && dt_bias,
                      "gdn_gate: g, beta, a, b, A_log or dt_bias is NULL");
    int64_t n = T * nv;
    int64_t blocks = (n + 255) / 256;
    gdn_gate_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        g, beta, a, b, A_log, dt_bias, n, nv);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* The device's shared memory per block with opt-in (0 where it cannot be read). */
static int gdn_smem_optin(const kn_ctx *ctx) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return optin;
}

template <int DKP>
static cm_status gdn_chunked_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                    const float *g, const float *beta, const int32_t *cu, int n_seq,
                                    int64_t T, int nk, int nv, int dk, int dv, float scale) {
    const int64_t cap = T / GDN_C + n_seq; /* Σ ceil(len / 64) ≤ Σ (len / 64 + 1) */
    KN_CUDA_CHECK_ARG(T + n_seq < INT32_MAX / 2 && cap * nv < INT32_MAX,
                      "gated_delta_rule: T=%lld tokens exceeds the chunk table's int32 range", (long long)T);
    /* dk ≤ 128: the register-state kernel, GDN_MV columns per block; dk 256 (its state would
     * not fit the registers): gdn_state, GDN_BV columns per block */
    constexpr bool MMA = DKP <= 128;
    const int      CW = MMA ? GDN_MV : GDN_BV, DVP = (dv + CW - 1) / CW * CW;
    /* scratch: q·scale and k in bf16 padded to DKP, then per chunk slot and v-head W, U, P, E,
     * then the chunk table */
    size_t off[8], sz[7] = {(size_t)T * nk * DKP * 2,
                            (size_t)T * nk * DKP * 2,
                            (size_t)cap * nv * 64 * DKP * 2,
                            (size_t)cap * nv * 64 * DVP * 2,
                            (size_t)cap * nv * 64 * 64 * 2,
                            (size_t)cap * nv * 192 * 4,
                            (size_t)cap * sizeof(int2) + (size_t)(n_seq + 1) * sizeof(int)};
    off[0] = 0;
    for (int i = 0; i < 7; i++)
        off[i + 1] = off[i] + (sz[i] + 255) / 256 * 256;
    CM_TRY(kn_cuda_scratch_reserve(ctx, off[7]));
    char  *base = (char *)ctx->scratch;
    bf16  *qc = (bf16 *)(base + off[0]), *kc = (bf16 *)(base + off[1]), *Wg = (bf16 *)(base + off[2]);
    bf16  *Ug = (bf16 *)(base + off[3]), *Pg = (bf16 *)(base + off[4]);
    float *Eg = (float *)(base + off[5]);
    int2  *chunks = (int2 *)(base + off[6]);
    int   *seq_first = (int *)(chunks + cap), *n_chunks = seq_first + n_seq;

    const int64_t  nvec = T * nk * (DKP / 8);
    const unsigned cgrid = (unsigned int)((nvec + 255) / 256 < 65536 ? (nvec + 255) / 256 : 65536);
    gdn_to_bf16_padded<<<cgrid, 256, 0, ctx->stream>>>(qc, q, T * nk, dk, DKP, scale);
    KN_CUDA_LAUNCHED(ctx);
    gdn_to_bf16_padded<<<cgrid, 256, 0, ctx->stream>>>(kc, k, T * nk, dk, DKP, 1.0f);
    KN_CUDA_LAUNCHED(ctx);
    gdn_chunk_table_kernel<<<1, 1024, 0, ctx->stream>>>(chunks, seq_first, n_chunks, cu, n_seq, T, (int)cap);
    KN_CUDA_LAUNCHED(ctx);

    const size_t prep_smem = gdn_prep_mma_smem<DKP>::bytes;
    /* blocks above 48 KB of dynamic shared memory must opt in (a host-side attribute, no sync) */
    KN_CUDA(cudaFuncSetAttribute(gdn_prep_mma_kernel<DKP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)prep_smem));
    gdn_prep_mma_kernel<DKP><<<dim3((unsigned int)cap, (unsigned int)nv), GDN_PT, prep_smem, ctx->stream>>>(
        Wg, Ug, Pg, Eg, qc, kc, v, g, beta, chunks, n_chunks, nk, nv, dv, DVP);
    KN_CUDA_LAUNCHED(ctx);

    if constexpr (MMA) {
        /* two stages where the device's shared memory per block allows (gdn_chunked_fits has
         * checked that one does) */
        if (gdn_mstage<DKP>::smem(2) <= (size_t)gdn_smem_optin(ctx)) {
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

/* Whether the chunked form's blocks fit this device's shared memory per block (227 KB on
 * Hopper and datacenter Blackwell, 163 KB on A100, 99 KB on Ampere/Ada/Blackwell RTX parts such
 * as sm_120); where they do not, the exact per-token kernel runs instead (slower, same result
 * to rounding). */
static int gdn_chunked_fits(const kn_ctx *ctx, int dk) {
    const int optin = gdn_smem_optin(ctx);
    size_t    p, s;
    if (dk <= 64) {
        p = gdn_prep_mma_smem<64>::bytes;
        s = gdn_mstage<64>::smem(1);
    } else if (dk <= 128) {
        p = gdn_prep_mma_smem<128>::bytes;
        s = gdn_mstage<128>::smem(1);
    } else {
        p = gdn_prep_mma_smem<256>::bytes;
        s = gdn_state_smem<256, 1>::bytes;
    }
    return (p > s ? p : s) <= (size_t)optin;
}

/* The chunked form; arguments already checked. */
static cm_status gdn_chunked(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, const int32_t *cu, int n_seq, int64_t T, int nk,
                             int nv, int dk, int dv, float scale) {
    if (dk <= 64)
        return gdn_chunked_launch<64>(ctx, out, q, k, v, g, beta, cu, n_seq, T, nk, nv, dk, dv, scale);
    if (dk <= 128)
        return gdn_chunked_launch<128>(ctx, out, q, k, v, g, beta, cu, n_seq, T, nk, nv, dk, dv, scale);
    return gdn_chunked_launch<256>(ctx, out, q, k, v, g, beta, cu, n_seq, T, nk, nv, dk, dv, scale);
}

cm_status kn_cuda_gated_delta_rule(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                   int64_t T, int nk, int nv, int dk, int dv, float scale) {
    KN_CUDA_CHECK_ARG(ctx, "gated_delta_rule: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                      "gated_delta_rule: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d", (long long)T, nk, nv, dk,
                      dv);
    KN_CUDA_CHECK_ARG(nv % nk == 0, "gated_delta_rule: nv=%d must be a multiple of nk=%d", nv, nk);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "gated_delta_rule: n_seq=%d must be >= 0", n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "gated_delta_rule: T=%lld tokens but n_seq=0 sequences",
                      (long long)T);
    if (dk > GDN_MAX_DK)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "gated_delta_rule: dk=%d is not supported by the cuda backend (max %d)", dk,
                       GDN_MAX_DK);
    KN_CUDA_CHECK_ARG((int64_t)n_seq * nv <= INT32_MAX && dv <= 65535 * 32,
                      "gated_delta_rule: n_seq·nv=%lld or dv=%d exceeds the cuda grid limits",
                      (long long)n_seq * nv, dv);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && k && v && g && beta && cu_seqlens,
                      "gated_delta_rule: out, q, k, v, g, beta or cu_seqlens is NULL");
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16 && gdn_chunked_fits(ctx, dk))
        return gdn_chunked(ctx, out, q, k, v, g, beta, cu_seqlens, n_seq, T, nk, nv, dk, dv, scale);

    dim3 grid((unsigned int)(n_seq * nv), (unsigned int)((dv + 31) / 32));
    dim3 block(32 * GDN_WARPS);
    int  nr = 1;
    while (GDN_WARPS * nr < dk)
        nr *= 2;
    size_t smem = (size_t)(2 * GDN_CH * GDN_WARPS * nr + GDN_CH * 32 + 2 * GDN_CH) * sizeof(float);
    switch (nr) {
#define GDN_CASE(n)                                                                                          \
    case n:                                                                                                  \
        gated_delta_rule_kernel<n><<<grid, block, smem, ctx->stream>>>(out, q, k, v, g, beta, cu_seqlens, T, \
                                                                       nk, nv, dk, dv, scale);               \
        break;
        GDN_CASE(1)
        GDN_CASE(2)
        GDN_CASE(4)
        GDN_CASE(8)
        GDN_CASE(16)
        GDN_CASE(32)
#undef GDN_CASE
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
