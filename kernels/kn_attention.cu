/* kernels/kn_attention.cu — causal GQA attention within each packed sequence, then the
 * optional output gate: out[t, h] = softmax_{bos≤s≤t}(scale·q[t,h]·k[s,h/(nq/nkv)]) · v ⊙
 * sigmoid(gate[t, h]). The kernel follows the context's precision:
 *
 * - KN_GEMM_MODE_F32 (the fp32 oracle checks): a simple exact kernel, one block of 4 warps per
 *   (token, q head). Lane l holds dims l, l+32, … (hd ≤ 256, so ≤ 8 per lane) of q and of an
 *   fp32 output accumulator; warp w takes keys bos+w, bos+w+4, …: a coalesced read of the key
 *   row, a shuffle-reduced dot product, and an online-softmax update (running max m, sum l,
 *   acc rescaled by e^{m_old − m_new}). The 4 warps' (m, l, acc) are merged through shared
 *   memory at the end. All math fp32 with expf; O(len²) work per sequence, no score matrix.
 *
 * - KN_GEMM_MODE_BF16 (serving), head dims 64, 128 and 256: FlashAttention-2 on mma.sync
 *   (fm_attention_kernel below; the helpers of kn_mma_sm80.h, shared with
 *   the drafter's kn_dflash_attn_mma.cu; sm_80+, no wgmma, so one code path for Ampere, Hopper
 *   and Blackwell). A small kernel sorts the 64-row tiles of every sequence longest key range
 *   first (tiles never straddle sequences, so there is no mask work below the diagonal);
 *   K and V are rounded to bf16 copies in the ctx scratch, q is read as fp32 and rounded as
 *   it enters shared memory; every fragment is one ldmatrix, K/V tiles of 32 keys stream in
 *   by cp.async while the previous tile is multiplied, the online softmax runs base 2 on the
 *   accumulators, the sigmoid gate is applied at the output.
 * - KN_GEMM_MODE_BF16, other head dims, or where the device's shared memory per block is too
 *   small for the forms above: the first flash kernel (flash_attention_kernel, WMMA 16×16×16,
 *   q, k, v first copied to bf16 zero-padded to 64, 128 or 256).
 *   q, k, v and the probabilities are rounded to bf16: a few 1e-3 relative, as FlashAttention.
 *
 * The token's sequence start is a binary search of cu_seqlens (device memory, checked by
 * the caller before upload; clamped here so a bad table cannot cause a wild read). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_mma_sm80.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;
typedef __nv_bfloat16 bf16;

#define ATT_WARPS  4
#define ATT_MAX_HD 256

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ int64_t att_seq_start(const int32_t *cu, int n_seq, int64_t t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    int64_t bos = cu[lo];
    return bos < 0 ? 0 : (bos > t ? t : bos);
}

/* NJ = dims per lane = ceil(hd / 32). grid (T, nq), block 32·ATT_WARPS. */
template <int NJ>
static __global__ void attention_kernel(float *out, const float *q, const float *k, const float *v,
                                        const float *gate, const int32_t *cu, int n_seq, int nq, int nkv,
                                        int hd, float scale) {
    __shared__ float sh_m[ATT_WARPS], sh_l[ATT_WARPS];
    __shared__ float sh_acc[ATT_WARPS][ATT_MAX_HD];

    const int64_t t = blockIdx.x;
    const int     h = blockIdx.y;
    const int     kvh = h / (nq / nkv);
    const int     lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t bos = att_seq_start(cu, n_seq, t);

    const float *qr = q + (t * nq + h) * (int64_t)hd;
    float        qv[NJ], acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        qv[j] = d < hd ? qr[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t s = bos + warp; s <= t; s += ATT_WARPS) {
        const float *kr = k + (s * nkv + kvh) * (int64_t)hd;
        const float *vr = v + (s * nkv + kvh) * (int64_t)hd;
        float        dot = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int d = lane + 32 * j;
            if (d < hd)
                dot += qv[j] * kr[d];
        }
        for (int o = 16; o > 0; o >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        float score = dot * scale;
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new); /* 0 on the first key (m = -inf) */
        float p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int d = lane + 32 * j;
            acc[j] = acc[j] * corr + (d < hd ? p * vr[d] : 0.0f);
        }
        m = m_new;
    }

    if (lane == 0) {
        sh_m[warp] = m;
        sh_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        if (d < hd)
            sh_acc[warp][d] = acc[j];
    }
    __syncthreads();

    float mx = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++)
        mx = fmaxf(mx, sh_m[w]);
    float wt[ATT_WARPS], denom = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = sh_m[w] == -INFINITY ? 0.0f : expf(sh_m[w] - mx); /* warps that saw no key weigh 0 */
        denom += wt[w] * sh_l[w];
    }
    float       *o = out + (t * nq + h) * (int64_t)hd;
    const float *gr = gate ? gate + (t * nq + h) * (int64_t)hd : NULL;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            num += wt[w] * sh_acc[w][d];
        float y = num / denom;
        if (gr)
            y *= 1.0f / (1.0f + expf(-gr[d]));
        o[d] = y;
    }
}

// ---- flash form (KN_GEMM_MODE_BF16)

#define FA_ROWS    64  /* query rows per block: 4 warps × 16 */
#define FA_KEYS    32  /* keys per tile */
#define FA_THREADS 128
#define FA_FS      36  /* fp32 stride of the 32-wide score tile */
#define FA_BS      40  /* bf16 stride of the 32-wide probability tile */

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa_fa_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fa_fb_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fa_fb_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float>                fa_facc;

/* 16-byte asynchronous copy global → shared (sm_80+); src_bytes 0 writes zeros (rows past the
 * end), and then nothing is read from src. */
static __device__ __forceinline__ void fa_cp16(void *smem, const void *gmem, int src_bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
static __device__ __forceinline__ void fa_cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
static __device__ __forceinline__ void fa_cp_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::);
}

/* x [rows, n] fp32 → dst [rows, P] bf16, zero past n: the operands of the tiles, padded so that
 * every tile row is whole 16-byte vectors. One thread per 8 outputs. */
static __global__ void fa_to_bf16_padded(bf16 *dst, const float *x, int64_t rows, int n, int P) {
    const int64_t nvec = rows * (P / 8), stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const int64_t r = i / (P / 8);
        const int     c0 = (int)(i % (P / 8)) * 8;
        __align__(16) bf16 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = __float2bfloat16(c0 + j < n ? x[r * n + c0 + j] : 0.0f);
        *(uint4 *)(dst + r * P + c0) = *(const uint4 *)v;
    }
}

template <int HDP> struct fa_smem {
    static constexpr int    QS = HDP + 8; /* bf16 stride of q / k / v rows (16-byte multiple) */
    static constexpr size_t bytes = (size_t)64 * QS * 2 /* Qb */ + 2 * (size_t)FA_KEYS * QS * 2 /* Kb, Vb */ +
                                    (size_t)64 * FA_FS * 4 /* Sf */ + (size_t)64 * FA_BS * 2 /* Pb */ +
                                    4 * 64 * 4 /* m, l, corr, bos */;
};

/* n rows (tokens row0…) of head `head` of a padded bf16 [T, heads, HDP] array into smem rows of
 * stride HDP + 8, by cp.async; rows ≥ end are zero-filled. */
template <int HDP>
static __device__ __forceinline__ void fa_load_tile(bf16 *dst, const bf16 *src, int64_t row0, int64_t end,
                                                    int heads, int head, int n, int tid) {
    constexpr int VPR = HDP / 8;
#pragma unroll 4
    for (int i = tid; i < n * VPR; i += FA_THREADS) {
        const int     r = i / VPR, c = (i % VPR) * 8;
        const int64_t s = row0 + r;
        const bool    ok = s < end;
        fa_cp16(dst + r * (HDP + 8) + c, src + ((ok ? s : 0) * heads + head) * (int64_t)HDP + c, ok ? 16 : 0);
    }
}

/* One block per (64 consecutive tokens, q head); tiles may straddle sequences, so every row
 * carries its own sequence start and the key range is [start of the first row, last row].
 * q, k, v arrive as padded bf16 copies (fa_to_bf16_padded). Per 32-key tile: S = Q Kᵀ (bf16
 * WMMA → fp32, through shared memory), the online softmax in fp32 (base 2, row max m, sum l),
 * then O = O · 2^{m_old − m_new} + P V with the output accumulator O in registers (16 WMMA
 * fragments per warp): the row of each fragment element is read off a fragment loaded from a
 * matrix of row numbers, so the row-wise rescale needs no knowledge of the fragment layout.
 * The v tile streams in (cp.async) while S and the softmax run, the next k tile while P V
 * runs; 81 KB of shared memory at head dim 256, so two blocks share a multiprocessor. Warp w
 * owns rows 16w…16w+15. Tiles run last-first so the longest finish first. */
template <int HDP>
static __global__ void __launch_bounds__(FA_THREADS, 2)
    flash_attention_kernel(float *out, const bf16 *qc, const bf16 *kc, const bf16 *vc, const float *gate,
                           const int32_t *cu, int n_seq, int64_t T, int nq, int nkv, int hd, float scale_log2) {
    typedef fa_smem<HDP> SM;
    constexpr int        QS = SM::QS, NT = HDP / 16;
    const int64_t        r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const int            h = blockIdx.y, kvh = h / (nq / nkv);
    const int            tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int64_t        r_end = r0 + FA_ROWS < T ? r0 + FA_ROWS : T;

    extern __shared__ __align__(128) unsigned char fa_smem_raw[];
    bf16    *Qb = (bf16 *)fa_smem_raw;         /* [64][QS] */
    bf16    *Kb = Qb + 64 * QS;                /* [FA_KEYS][QS] */
    bf16    *Vb = Kb + FA_KEYS * QS;           /* [FA_KEYS][QS] */
    float   *Sf = (float *)(Vb + FA_KEYS * QS); /* [64][FA_FS] */
    bf16    *Pb = (bf16 *)(Sf + 64 * FA_FS);   /* [64][FA_BS] */
    float   *m_s = (float *)(Pb + 64 * FA_BS), *l_s = m_s + 64, *corr_s = l_s + 64;
    int32_t *bos_s = (int32_t *)(corr_s + 64);

    for (int r = tid; r < 64; r += FA_THREADS) {
        int64_t t = r0 + r < r_end ? r0 + r : r_end - 1;
        bos_s[r] = (int32_t)att_seq_start(cu, n_seq, t);
        m_s[r] = -INFINITY;
        l_s[r] = 0.0f;
    }
    for (int e = tid; e < 256; e += FA_THREADS) { /* row and column numbers of a 16×16 tile */
        Sf[(e / 16) * FA_FS + e % 16] = (float)(e / 16);
        Sf[(16 + e / 16) * FA_FS + e % 16] = (float)(e % 16);
    }
    __syncthreads();
    int rid[8], cid[8];
    {
        fa_facc f;
        wmma::load_matrix_sync(f, Sf, FA_FS, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < 8; i++)
            rid[i] = (int)f.x[i];
        wmma::load_matrix_sync(f, Sf + 16 * FA_FS, FA_FS, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < 8; i++)
            cid[i] = (int)f.x[i];
    }
    static_assert(sizeof(((fa_facc *)0)->x) / sizeof(float) == 8, "16x16 fp32 accumulator of 8 elements");
    fa_facc o[NT];
#pragma unroll
    for (int t = 0; t < NT; t++)
        wmma::fill_fragment(o[t], 0.0f);
    const int64_t kv_lo = bos_s[0], kv_hi = r_end; /* keys [kv_lo, kv_hi) */
    fa_load_tile<HDP>(Qb, qc, r0, r_end, nq, h, 64, tid);
    fa_load_tile<HDP>(Kb, kc, kv_lo, kv_hi, nkv, kvh, FA_KEYS, tid);
    fa_cp_commit();

    for (int64_t s0 = kv_lo; s0 < kv_hi; s0 += FA_KEYS) {
        fa_cp_wait_all();
        __syncthreads(); /* k (and q) landed for every thread; every warp is done with the last v */
        fa_load_tile<HDP>(Vb, vc, s0, kv_hi, nkv, kvh, FA_KEYS, tid);
        fa_cp_commit();
        {
            fa_facc a0, a1;
            wmma::fill_fragment(a0, 0.0f);
            wmma::fill_fragment(a1, 0.0f);
#pragma unroll 4
            for (int kk = 0; kk < HDP; kk += 16) {
                fa_fa_row a;
                fa_fb_col b0, b1;
                wmma::load_matrix_sync(a, Qb + warp * 16 * QS + kk, QS);
                wmma::load_matrix_sync(b0, Kb + kk, QS);
                wmma::load_matrix_sync(b1, Kb + 16 * QS + kk, QS);
                wmma::mma_sync(a0, a, b0, a0);
                wmma::mma_sync(a1, a, b1, a1);
            }
            wmma::store_matrix_sync(Sf + warp * 16 * FA_FS, a0, FA_FS, wmma::mem_row_major);
            wmma::store_matrix_sync(Sf + warp * 16 * FA_FS + 16, a1, FA_FS, wmma::mem_row_major);
        }
        __syncwarp();
        {
            /* two lanes per row, 16 keys each; scores in base 2 (scale_log2 = scale · log2 e) */
            const int     row = warp * 16 + lane / 2, half = lane % 2;
            const int64_t t = r0 + row, bos = bos_s[row];
            const bool    live = t < r_end;
            float         x[16], mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int64_t s = s0 + half * 16 + c;
                bool    ok = live && s >= bos && s <= t;
                x[c] = ok ? Sf[row * FA_FS + half * 16 + c] * scale_log2 : -INFINITY;
                mx = fmaxf(mx, x[c]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            const float m_old = m_s[row], m_new = fmaxf(m_old, mx);
            float       corr = 1.0f, sum = 0.0f;
            if (m_new != -INFINITY) { /* no key seen yet: nothing to rescale or add */
                corr = exp2f(m_old - m_new); /* 0 when m_old = -inf */
#pragma unroll
                for (int c = 0; c < 16; c++) {
                    x[c] = exp2f(x[c] - m_new); /* exp2(-inf) = 0 for masked keys */
                    sum += x[c];
                }
            } else {
#pragma unroll
                for (int c = 0; c < 16; c++)
                    x[c] = 0.0f;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
#pragma unroll
            for (int c = 0; c < 16; c += 2)
                *(__nv_bfloat162 *)(Pb + row * FA_BS + half * 16 + c) = __floats2bfloat162_rn(x[c], x[c + 1]);
            if (half == 0) {
                m_s[row] = m_new;
                l_s[row] = l_s[row] * corr + sum;
                corr_s[row] = corr;
            }
        }
        __syncwarp();
        {
            float cr[8];
#pragma unroll
            for (int i = 0; i < 8; i++)
                cr[i] = corr_s[warp * 16 + rid[i]];
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[t].x[i] *= cr[i];
        }
        fa_cp_wait_all();
        __syncthreads(); /* v landed; every warp is done with k */
        if (s0 + FA_KEYS < kv_hi) {
            fa_load_tile<HDP>(Kb, kc, s0 + FA_KEYS, kv_hi, nkv, kvh, FA_KEYS, tid);
            fa_cp_commit();
        }
        {
            fa_fa_row p0, p1;
            wmma::load_matrix_sync(p0, Pb + warp * 16 * FA_BS, FA_BS);
            wmma::load_matrix_sync(p1, Pb + warp * 16 * FA_BS + 16, FA_BS);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                fa_fb_row b;
                wmma::load_matrix_sync(b, Vb + t * 16, QS);
                wmma::mma_sync(o[t], p0, b, o[t]);
                wmma::load_matrix_sync(b, Vb + 16 * QS + t * 16, QS);
                wmma::mma_sync(o[t], p1, b, o[t]);
            }
        }
    }
    __syncwarp();

    float inv_l[8];
    int64_t tok[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int row = warp * 16 + rid[i];
        tok[i] = r0 + row;
        inv_l[i] = tok[i] < r_end ? 1.0f / l_s[row] : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = t * 16 + cid[i];
            if (tok[i] < r_end && c < hd) {
                int64_t oi = (tok[i] * nq + h) * (int64_t)hd + c;
                float   y = o[t].x[i] * inv_l[i];
                if (gate)
                    y *= 1.0f / (1.0f + __expf(-gate[oi]));
                out[oi] = y;
            }
        }
}

template <int HDP>
static cm_status flash_attention_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                        const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq,
                                        int nkv, int hd, float scale) {
    const size_t smem = fa_smem<HDP>::bytes;
    const size_t q_bytes = ((size_t)T * nq * HDP * sizeof(bf16) + 255) / 256 * 256;
    const size_t kv_bytes = ((size_t)T * nkv * HDP * sizeof(bf16) + 255) / 256 * 256;
    CM_TRY(kn_cuda_scratch_reserve(ctx, q_bytes + 2 * kv_bytes));
    bf16 *qc = (bf16 *)ctx->scratch, *kc = (bf16 *)((char *)ctx->scratch + q_bytes);
    bf16 *vc = (bf16 *)((char *)ctx->scratch + q_bytes + kv_bytes);
    struct {
        bf16        *dst;
        const float *src;
        int64_t      rows;
    } conv[3] = {{qc, q, T * nq}, {kc, k, T * nkv}, {vc, v, T * nkv}};
    for (int i = 0; i < 3; i++) {
        int64_t      nvec = conv[i].rows * (HDP / 8), blocks = (nvec + 255) / 256;
        unsigned int grid = (unsigned int)(blocks < 65536 ? blocks : 65536);
        fa_to_bf16_padded<<<grid, 256, 0, ctx->stream>>>(conv[i].dst, conv[i].src, conv[i].rows, hd, HDP);
        KN_CUDA_LAUNCHED(ctx);
    }
    KN_CUDA(cudaFuncSetAttribute(flash_attention_kernel<HDP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem));
    dim3 grid((unsigned int)((T + FA_ROWS - 1) / FA_ROWS), (unsigned int)nq);
    flash_attention_kernel<HDP><<<grid, FA_THREADS, smem, ctx->stream>>>(out, qc, kc, vc, gate, cu, n_seq, T, nq,
                                                                         nkv, hd, scale * 1.4426950408889634f);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ---- FlashAttention-2 form (KN_GEMM_MODE_BF16, head dim 64, 128 or 256)

#define FM_ROWS  64 /* query rows per head per CTA: 4 warps × 16 */
#define FM_KT    32 /* keys per tile */
#define FM_LEVEL 64 /* rows per schedule tile (= FM_ROWS) */
#define FM_FULL  0xffffffffu

/* Shared memory of fm_attention_kernel<HD, HPB, STG>: Q of HPB heads × 64 rows, STG stages
 * of K and V tiles, bf16 rows of stride HD + 8 (ldmatrix rows fall on different banks). */
static size_t fm_smem(int hd, int hpb, int stg) {
    return sizeof(bf16) * (size_t)(hd + 8) * ((size_t)hpb * FM_ROWS + 2 * (size_t)stg * FM_KT);
}

/* Waits until at most N committed cp.async groups are still in flight. */
template <int N> static __device__ __forceinline__ void fm_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Sequence s of the table as [bos, eos), clamped into [0, T] so that a bad table cannot cause
 * a wild access; the first starts at 0 and the last ends at T (tokens outside the table
 * belong to the nearest sequence, as att_seq_start places them). */
static __device__ __forceinline__ void fm_seq(const int32_t *cu, int n_seq, int T, int s, int *bos,
                                              int *eos) {
    int b = s == 0 ? 0 : cu[s], e = s == n_seq - 1 ? T : cu[s + 1];
    b = b < 0 ? 0 : (b > T ? T : b);
    e = e < b ? b : (e > T ? T : e);
    *bos = b;
    *eos = e;
}

/* The work list: every 64-row tile of every sequence as {first row, bos, eos, 0}, longest key
 * range first (tile i of a sequence sees up to 64·(i + 1) keys, so tiles are sorted by i,
 * descending), so that the long sequence's last tiles start first and the short ones fill the
 * tail. Entries past the number of tiles are {-1, ...} (their CTAs return at once). Counting
 * sort by i: hist[i] = sequences with more than i tiles, turned into the offsets of each
 * level; within a level the order is whatever the atomics give (every tile computes the same
 * either way). One block of 1024 threads; hist, cnt [L], tiles [n_max] in the ctx scratch. */
static __global__ void __launch_bounds__(1024)
    fm_schedule_kernel(int4 *tiles, int *hist, int *cnt, const int32_t *cu, int n_seq, int T, int L,
                       int n_max) {
    __shared__ int part[1024];
    const int      tid = threadIdx.x;
    for (int i = tid; i < L; i += 1024)
        hist[i] = cnt[i] = 0;
    for (int i = tid; i < n_max; i += 1024)
        tiles[i] = make_int4(-1, 0, 0, 0);
    __syncthreads();
    for (int s = tid; s < n_seq; s += 1024) {
        int bos, eos;
        fm_seq(cu, n_seq, T, s, &bos, &eos);
        const int n = (eos - bos + FM_LEVEL - 1) / FM_LEVEL;
        for (int i = 0; i < n && i < L; i++)
            atomicAdd(&hist[i], 1);
    }
    __syncthreads();
    /* offsets: off[i] = Σ_{j > i} hist[j]; thread tid owns levels [c0, c1) */
    const int C = (L + 1023) / 1024, c0 = min(L, tid * C), c1 = min(L, c0 + C);
    int       sum = 0;
    for (int i = c0; i < c1; i++)
        sum += hist[i];
    part[tid] = sum;
    __syncthreads();
    if (tid < 32) { /* part[t] ← Σ_{u > t} part[u]: lane l owns part[32l, 32l + 32) */
        int s = 0;
        for (int u = 0; u < 32; u++)
            s += part[tid * 32 + u];
        int incl = s; /* Σ over lanes ≥ tid */
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_down_sync(FM_FULL, incl, o);
            if (tid + o < 32)
                incl += y;
        }
        int acc = incl - s;
        for (int u = 31; u >= 0; u--) {
            const int v = part[tid * 32 + u];
            part[tid * 32 + u] = acc;
            acc += v;
        }
    }
    __syncthreads();
    {
        int acc = part[tid];
        for (int i = c1 - 1; i >= c0; i--) {
            const int v = hist[i];
            hist[i] = acc;
            acc += v;
        }
    }
    __syncthreads();
    for (int s = tid; s < n_seq; s += 1024) {
        int bos, eos;
        fm_seq(cu, n_seq, T, s, &bos, &eos);
        const int n = (eos - bos + FM_LEVEL - 1) / FM_LEVEL;
        for (int i = 0; i < n && i < L; i++) {
            const int pos = hist[i] + atomicAdd(&cnt[i], 1);
            if (pos < n_max)
                tiles[pos] = make_int4(bos + i * FM_LEVEL, bos, eos, 0);
        }
    }
}

/* k and v [n4 float4s each] → bf16 copies (the key side is read by every query tile of its
 * sequence; q is read once per CTA, straight from fp32). */
static __global__ void fm_kv_to_bf16(bf16 *kb, bf16 *vb, const float *k, const float *v, int64_t n4) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 a = reinterpret_cast<const float4 *>(k)[i], b = reinterpret_cast<const float4 *>(v)[i];
        reinterpret_cast<uint2 *>(kb)[i] = make_uint2(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w));
        reinterpret_cast<uint2 *>(vb)[i] = make_uint2(pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
    }
}

/* Streams keys [s0, s0 + FM_KT) of kv head g (zeros at and past s_end) into k_s, v_s. */
template <int HD, int NTHR>
static __device__ __forceinline__ void fm_load_kv(const bf16 *kb, const bf16 *vb, int nkv, int g, int s0,
                                                  int s_end, bf16 *k_s, bf16 *v_s) {
    constexpr int LD = HD + 8, CH = HD / 8;
    static_assert(FM_KT * CH % NTHR == 0, "whole rounds of 16-byte copies");
#pragma unroll
    for (int it = 0; it < FM_KT * CH / NTHR; it++) {
        const int     i = threadIdx.x + it * NTHR, r = i / CH, c = i % CH;
        const bool    ok = s0 + r < s_end;
        const int64_t off = ok ? ((int64_t)(s0 + r) * nkv + g) * HD + c * 8 : 0;
        cp_async16(k_s + r * LD + c * 8, kb + off, ok);
        cp_async16(v_s + r * LD + c * 8, vb + off, ok);
    }
}

/* Rows [r0, r0 + 64) of q heads h0 … h0 + HPB − 1 (zeros at and past r_end) rounded from
 * fp32 into q_s (row hh·64 + i, stride HD + 8): plain 16-byte loads, read once per CTA. */
template <int HD, int NTHR, int HPB>
static __device__ __forceinline__ void fm_load_q(bf16 *q_s, const float *q, int r0, int r_end, int nq,
                                                 int h0) {
    constexpr int LD = HD + 8, CH = HD / 8;
    static_assert(HPB * FM_ROWS * CH % NTHR == 0, "whole rounds of 8-element chunks");
#pragma unroll 4
    for (int it = 0; it < HPB * FM_ROWS * CH / NTHR; it++) {
        const int i = threadIdx.x + it * NTHR, row = i / CH, c = i % CH, t = r0 + row % FM_ROWS;
        uint4     o = make_uint4(0, 0, 0, 0);
        if (t < r_end) {
            const float4 *src =
                reinterpret_cast<const float4 *>(q + ((int64_t)t * nq + h0 + row / FM_ROWS) * HD + c * 8);
            const float4 a = __ldg(src), b = __ldg(src + 1);
            o = make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y),
                           pack_bf16(b.z, b.w));
        }
        *reinterpret_cast<uint4 *>(q_s + row * LD + c * 8) = o;
    }
}

/* FlashAttention-2 forward, the layout of kn_dflash_attn_mma.cu's: one CTA per (schedule
 * tile, HPB q heads of one kv head): warp w takes head blockIdx.x·HPB + w / 4 and rows
 * r0 + (w % 4)·16 … + 15. Q (HPB·64 rows) is rounded from fp32 into shared memory once and
 * read by ldmatrix at each k step (the head-dim-256 O accumulator, 128 fp32 per lane, leaves
 * no registers to hold it); K/V tiles of 32 keys stream in by cp.async, STG − 1 tiles ahead
 * (one barrier per tile). Per tile: S = Q·Kᵀ (mma m16n8k16, fp32), the causal mask only on
 * tiles that reach past the warp's first row, online softmax in base 2 on the accumulators
 * (row max m, per-lane partial sums l reduced once at the end), O = O·corr + P·V with P taken
 * from the S accumulators (the rescale skipped when no row's max moved). A warp skips the
 * tiles whose keys all lie after its last row. The sigmoid gate is applied at the output.
 * Shapes measured on an H200 at the 27B layout (24/4 heads × 256, the 8192-token mix), with
 * 242 registers per lane at head dim 256: one head per CTA, 2 stages, 99 KB, two CTAs per
 * multiprocessor: 1.86 ms; two heads sharing each K/V tile (HPB = 2, 8 warps, one CTA per
 * multiprocessor; half the L2 traffic): 2.04 ms with 2 stages, 2.07 with 3; the O
 * accumulator split over two warps (keys for S, head-dim halves for P·V, P and the row max
 * exchanged through shared memory; 128 registers, 16 warps per multiprocessor): 2.01 ms, its
 * ldmatrix traffic per mma 25 % higher (L1 67 % busy). */
template <int HD, int HPB, int STG>
static __global__ void __launch_bounds__(128 * HPB, (HD == 256 ? 2 : 4) / HPB)
    fm_attention_kernel(float *out, const float *q, const bf16 *kb, const bf16 *vb, const float *gate,
                        const int4 *tiles, int nq, int nkv, float sc) {
    constexpr int     NTHR = 128 * HPB, LD = HD + 8, KS = HD / 16, NT = HD / 8;
    extern __shared__ __align__(16) unsigned char fm_sm[];
    bf16                                         *q_s = reinterpret_cast<bf16 *>(fm_sm); /* [HPB·64][LD] */
    bf16                                         *k_s = q_s + HPB * FM_ROWS * LD; /* [STG][FM_KT][LD] */
    bf16                                         *v_s = k_s + STG * FM_KT * LD;   /* [STG][FM_KT][LD] */
    const int4                                    tl = tiles[blockIdx.y];
    if (tl.x < 0)
        return; /* past the end of the work list */
    const int r0 = tl.x, bos = tl.y, r_end = min(tl.x + FM_ROWS, tl.z);
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const int h0 = blockIdx.x * HPB, h = h0 + w / 4, g = h0 / (nq / nkv);
    const int wr0 = r0 + (w % 4) * 16; /* this warp's first row */
    const int n_tiles = (r_end - bos + FM_KT - 1) / FM_KT;

#pragma unroll
    for (int i = 0; i < STG - 1; i++) { /* one group per stage, empty past the last tile */
        if (i < n_tiles)
            fm_load_kv<HD, NTHR>(kb, vb, nkv, g, bos + i * FM_KT, r_end, k_s + i * FM_KT * LD,
                                 v_s + i * FM_KT * LD);
        cp_commit();
    }
    fm_load_q<HD, NTHR, HPB>(q_s, q, r0, r_end, nq, h0);

    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float      m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows wr0 + gq, + 8; l per lane */
    const bool live = wr0 < r_end;

    for (int t = 0; t < n_tiles; t++) {
        const int st = t % STG, s0 = bos + t * FM_KT;
        fm_cp_wait<STG - 2>();
        __syncthreads(); /* tile t (and Q) landed; every warp is done with tile t − 1's stage */
        if (t + STG - 1 < n_tiles) {
            const int sn = (t + STG - 1) % STG;
            fm_load_kv<HD, NTHR>(kb, vb, nkv, g, s0 + (STG - 1) * FM_KT, r_end, k_s + sn * FM_KT * LD,
                                 v_s + sn * FM_KT * LD);
        }
        cp_commit();
        if (!live || s0 > wr0 + 15)
            continue; /* every key of the tile lies after every row of this warp */
        const bf16 *kt = k_s + st * FM_KT * LD, *vt = v_s + st * FM_KT * LD;

        float s[FM_KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < FM_KT / 8; nt++)
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t a[4];
            frag_a(a, q_s, LD, w * 16, ks * 16);
#pragma unroll
            for (int np = 0; np < FM_KT / 16; np++) {
                uint32_t b[4];
                frag_b_nk(b, kt, LD, np * 16, ks * 16);
                mma_bf16(s[2 * np], a, b[0], b[1]);
                mma_bf16(s[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* keys run from the sequence start, so only the causal bound can cut: not at all when
         * the tile's last key is at or before the warp's first row */
        const bool full = s0 + FM_KT - 1 <= wr0;
        float      mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < FM_KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = s0 + nt * 8 + 2 * tq + (e & 1), row = wr0 + gq + (e >= 2 ? 8 : 0);
                s[nt][e] = full || key <= row ? s[nt][e] * sc : -INFINITY;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
            }
        float corr[2], mb[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float m_new = quad_max(mx[r]);
            /* every row sees its sequence's first key in tile 0, so m_new is finite; the guard
             * keeps a row that saw none at exact zeros instead of NaN */
            mb[r] = m_new == -INFINITY ? 0.0f : m_new;
            corr[r] = exp2f(m[r] - mb[r]); /* 0 when m was -inf */
            m[r] = m_new;
        }
#pragma unroll
        for (int nt = 0; nt < FM_KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[nt][e] = exp2f(s[nt][e] - mb[e >> 1]); /* exp2(-inf) = 0 for masked keys */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < FM_KT / 8; nt++)
                sum += s[nt][2 * r] + s[nt][2 * r + 1];
            l[r] = l[r] * corr[r] + sum;
        }
        /* once the running max settles most tiles leave it: skip the 128 multiplies then */
        if (__any_sync(FM_FULL, corr[0] != 1.0f || corr[1] != 1.0f))
            scale_rows<NT>(o, corr);
        mma_tile_kn<NT, FM_KT>(o, s, vt, LD);
    }
    fm_cp_wait<0>(); /* nothing in flight at exit */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float lr = quad_sum(l[r]);
        const int   row = wr0 + gq + 8 * r;
        if (row >= r_end)
            continue;
        const float   inv = 1.0f / lr;
        const int64_t base = ((int64_t)row * nq + h) * HD + 2 * tq;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float2 y = make_float2(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
            if (gate) {
                const float2 gt = *reinterpret_cast<const float2 *>(gate + base + nt * 8);
                y.x *= 1.0f / (1.0f + __expf(-gt.x));
                y.y *= 1.0f / (1.0f + __expf(-gt.y));
            }
            *reinterpret_cast<float2 *>(out + base + nt * 8) = y;
        }
    }
}

/* The flash-2 path: the schedule, the bf16 K/V copies, the kernel. HPB: q heads per CTA,
 * STG: K/V stages. */
template <int HD, int HPB, int STG>
static cm_status fm_attention_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                     const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq,
                                     int nkv, float scale, int n_max) {
    const int    L = (int)((T + FM_LEVEL - 1) / FM_LEVEL);
    const size_t kv_bytes = ((size_t)T * nkv * HD * sizeof(bf16) + 255) / 256 * 256;
    const size_t tile_bytes = ((size_t)n_max * sizeof(int4) + 255) / 256 * 256;
    CM_TRY(kn_cuda_scratch_reserve(ctx, 2 * kv_bytes + tile_bytes + 2 * (size_t)L * sizeof(int)));
    char *sp = (char *)ctx->scratch;
    bf16 *kb = (bf16 *)sp, *vb = (bf16 *)(sp + kv_bytes);
    int4 *tiles = (int4 *)(sp + 2 * kv_bytes);
    int  *hist = (int *)(sp + 2 * kv_bytes + tile_bytes), *cnt = hist + L;

    fm_schedule_kernel<<<1, 1024, 0, ctx->stream>>>(tiles, hist, cnt, cu, n_seq, (int)T, L, n_max);
    KN_CUDA_LAUNCHED(ctx);
    const int64_t n4 = T * nkv * HD / 4, blocks = (n4 + 255) / 256;
    fm_kv_to_bf16<<<(unsigned int)(blocks < 8192 ? blocks : 8192), 256, 0, ctx->stream>>>(kb, vb, k, v, n4);
    KN_CUDA_LAUNCHED(ctx);
    const size_t smem = fm_smem(HD, HPB, STG);
    KN_CUDA(cudaFuncSetAttribute(fm_attention_kernel<HD, HPB, STG>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned int)(nq / HPB), (unsigned int)n_max);
    fm_attention_kernel<HD, HPB, STG><<<grid, 128 * HPB, smem, ctx->stream>>>(
        out, q, kb, vb, gate, tiles, nq, nkv, scale * 1.4426950408889634f);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_attention(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq,
                            int nkv, int hd, float scale) {
    KN_CUDA_CHECK_ARG(ctx, "attention: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nq > 0 && nkv > 0 && hd > 0, "attention: bad shape T=%lld nq=%d nkv=%d hd=%d",
                      (long long)T, nq, nkv, hd);
    KN_CUDA_CHECK_ARG(nq % nkv == 0, "attention: nq=%d must be a multiple of nkv=%d", nq, nkv);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "attention: n_seq=%d must be >= 0", n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "attention: T=%lld tokens but n_seq=0 sequences", (long long)T);
    if (hd > ATT_MAX_HD)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention: head dim %d is not supported by the cuda backend (max %d)", hd,
                       ATT_MAX_HD);
    if (nq > 65535)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention: nq=%d heads is not supported by the cuda backend (max 65535)", nq);
    KN_CUDA_CHECK_ARG(T <= INT32_MAX, "attention: T=%lld exceeds the grid limit %d", (long long)T, INT32_MAX);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && k && v && cu_seqlens, "attention: out, q, k, v or cu_seqlens is NULL");
    int optin = 0; /* shared memory per block: the flash blocks (≤ 81 KB) fit every sm_80+ part */
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        optin = 0;
    }
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16) {
        /* The FlashAttention-2 kernel: head dims 64, 128, 256 (no padding), 16-byte aligned
         * arrays (float4 reads of q, float2 of gate and out), a work list within the grid's y
         * limit, and its 99 KB of shared memory at head dim 256 (every sm_80+ part, sm_86/89/
         * 120 included), else the WMMA kernel. TANDEM_ATTN_KERNEL=wmma (the WMMA kernel) or
         * fa2-2 (two heads per CTA, the group even) is a benchmark switch; fa2-1 is the
         * default. */
        const char     *force = getenv("TANDEM_ATTN_KERNEL");
        const int64_t   n_max = (T + FM_LEVEL - 1) / FM_LEVEL + n_seq;
        const uintptr_t bits =
            (uintptr_t)out | (uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)(gate ? gate : q);
        const int aligned = bits % 16 == 0;
        int       form = fm_smem(hd, 1, 2) <= (size_t)optin; /* 1: one head per CTA, 2 stages */
        if (force && !strcmp(force, "wmma"))
            form = 0;
        else if (force && !strcmp(force, "fa2-2") && (nq / nkv) % 2 == 0 &&
                 fm_smem(hd, 2, 2) <= (size_t)optin)
            form = 2;
        if (form && aligned && n_max <= 65535 && (hd == 64 || hd == 128 || hd == 256)) {
#define FM_CASE(d)                                                                                           \
    if (hd == d)                                                                                             \
        return form == 2 ? fm_attention_launch<d, 2, 2>(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq,   \
                                                        nkv, scale, (int)n_max)                              \
                         : fm_attention_launch<d, 1, 2>(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq,   \
                                                        nkv, scale, (int)n_max);
            FM_CASE(64)
            FM_CASE(128)
            FM_CASE(256)
#undef FM_CASE
        }
    }
    const size_t fa_need = hd <= 64    ? fa_smem<64>::bytes
                           : hd <= 128 ? fa_smem<128>::bytes
                                       : fa_smem<256>::bytes;
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16 && fa_need <= (size_t)optin) {
        if (hd <= 64)
            return flash_attention_launch<64>(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale);
        if (hd <= 128)
            return flash_attention_launch<128>(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale);
        return flash_attention_launch<256>(ctx, out, q, k, v, gate, cu_seqlens, n_seq, T, nq, nkv, hd, scale);
    }

    dim3 grid((unsigned int)T, (unsigned int)nq);
    dim3 block(32 * ATT_WARPS);
    switch ((hd + 31) / 32) {
#define ATT_CASE(nj)                                                                                         \
    case nj:                                                                                                 \
        attention_kernel<nj>                                                                                 \
            <<<grid, block, 0, ctx->stream>>>(out, q, k, v, gate, cu_seqlens, n_seq, nq, nkv, hd, scale);    \
        break;
        ATT_CASE(1)
        ATT_CASE(2)
        ATT_CASE(3)
        ATT_CASE(4)
        ATT_CASE(5)
        ATT_CASE(6)
        ATT_CASE(7)
        ATT_CASE(8)
#undef ATT_CASE
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
