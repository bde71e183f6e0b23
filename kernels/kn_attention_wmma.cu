/* kernels/kn_attention_wmma.cu — the first flash form of kn_cuda_attention (kn_attention.cu
 * picks it): KN_GEMM_MODE_BF16 at head dims the FlashAttention-2 kernel does not take, on
 * devices whose shared memory per block is too small for it, for misaligned arrays, or when
 * TANDEM_ATTN_KERNEL=wmma forces it. WMMA 16×16×16 tiles; q, k, v are first copied to bf16
 * zero-padded to 64, 128 or 256 (every tile row whole 16-byte vectors), K/V tiles of 32 keys
 * stream in by cp.async, the online softmax runs base 2, the sigmoid gate is applied at the
 * output. q, k, v and the probabilities are rounded to bf16: a few 1e-3 relative, as
 * FlashAttention. */
#include "kn_attention_int.h"
#include "kn_cuda.h"
#include "kn_device.h"

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;
typedef __nv_bfloat16 bf16;

// ----------------------------------------------------------------------------
// kernels

#define FA_ROWS    64 /* query rows per block: 4 warps × 16 */
#define FA_KEYS    32 /* keys per tile */
#define FA_THREADS 128
#define FA_FS      36 /* fp32 stride of the 32-wide score tile */
#define FA_BS      40 /* bf16 stride of the 32-wide probability tile */

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa_fa_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fa_fb_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fa_fb_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float>              fa_facc;

/* x [rows, n] fp32 → dst [rows, P] bf16, zero past n: the operands of the tiles, padded so that
 * every tile row is whole 16-byte vectors. One thread per 8 outputs. */
static __global__ void fa_to_bf16_padded(bf16 *dst, const float *x, int64_t rows, int n, int P) {
    to_bf16_padded<false>(dst, x, rows, n, P, 1.0f);
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
        cp_async16_n(dst + r * (HDP + 8) + c, src + ((ok ? s : 0) * heads + head) * (int64_t)HDP + c,
                     ok ? 16 : 0);
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
                           const int32_t *cu, int n_seq, int64_t T, int nq, int nkv, int hd,
                           float scale_log2) {
    typedef fa_smem<HDP> SM;
    constexpr int        QS = SM::QS, NT = HDP / 16;
    const int64_t        r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const int            h = blockIdx.y, kvh = h / (nq / nkv);
    const int            tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int64_t        r_end = r0 + FA_ROWS < T ? r0 + FA_ROWS : T;

    extern __shared__ __align__(128) unsigned char fa_smem_raw[];
    bf16                                          *Qb = (bf16 *)fa_smem_raw;          /* [64][QS] */
    bf16                                          *Kb = Qb + 64 * QS;                 /* [FA_KEYS][QS] */
    bf16                                          *Vb = Kb + FA_KEYS * QS;            /* [FA_KEYS][QS] */
    float                                         *Sf = (float *)(Vb + FA_KEYS * QS); /* [64][FA_FS] */
    bf16                                          *Pb = (bf16 *)(Sf + 64 * FA_FS);    /* [64][FA_BS] */
    float   *m_s = (float *)(Pb + 64 * FA_BS), *l_s = m_s + 64, *corr_s = l_s + 64;
    int32_t *bos_s = (int32_t *)(corr_s + 64);

    for (int r = tid; r < 64; r += FA_THREADS) {
        int64_t t = r0 + r < r_end ? r0 + r : r_end - 1;
        bos_s[r] = (int32_t)seq_start(cu, n_seq, t);
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
    cp_commit();

    for (int64_t s0 = kv_lo; s0 < kv_hi; s0 += FA_KEYS) {
        cp_wait<0>();
        __syncthreads(); /* k (and q) landed for every thread; every warp is done with the last v */
        fa_load_tile<HDP>(Vb, vc, s0, kv_hi, nkv, kvh, FA_KEYS, tid);
        cp_commit();
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
            if (m_new != -INFINITY) {        /* no key seen yet: nothing to rescale or add */
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
        cp_wait<0>();
        __syncthreads(); /* v landed; every warp is done with k */
        if (s0 + FA_KEYS < kv_hi) {
            fa_load_tile<HDP>(Kb, kc, s0 + FA_KEYS, kv_hi, nkv, kvh, FA_KEYS, tid);
            cp_commit();
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

    float   inv_l[8];
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
static cm_status wmma_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                             const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                             int hd, float scale) {
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
    flash_attention_kernel<HDP><<<grid, FA_THREADS, smem, ctx->stream>>>(
        out, qc, kc, vc, gate, cu, n_seq, T, nq, nkv, hd, scale * 1.4426950408889634f);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// launchers (kn_attention_int.h)

size_t kn_attention_wmma_smem(int hd) {
    return hd <= 64 ? fa_smem<64>::bytes : hd <= 128 ? fa_smem<128>::bytes : fa_smem<256>::bytes;
}

cm_status kn_attention_wmma(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                            int hd, float scale) {
    if (hd <= 64)
        return wmma_launch<64>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv, hd, scale);
    if (hd <= 128)
        return wmma_launch<128>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv, hd, scale);
    return wmma_launch<256>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv, hd, scale);
}
