/* kernels/kn_attention_mma.cu — the FlashAttention-2 form of kn_cuda_attention (kn_attention.cu
 * picks it): KN_GEMM_MODE_BF16 (serving) at head dims 64, 128 and 256, on mma.sync (the helpers
 * of kn_mma_sm80.h, shared with the drafter's kn_dflash_attn_mma.cu; sm_80+, no wgmma, so one
 * code path for Ampere, Hopper and Blackwell). A small kernel sorts the 64-row tiles of every
 * sequence longest key range first (tiles never straddle sequences, so there is no mask work
 * below the diagonal); K and V are rounded to bf16 copies in the ctx scratch, q is read as fp32
 * and rounded as it enters shared memory; every fragment is one ldmatrix, K/V tiles of 32 keys
 * stream in by cp.async while the previous tile is multiplied, the online softmax runs base 2
 * on the accumulators, the sigmoid gate is applied at the output. */
#include "kn_attention_int.h"
#include "kn_cuda.h"
#include "kn_mma_sm80.h"

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// ----------------------------------------------------------------------------
// kernels

#define FM_ROWS 64 /* query rows per head per CTA: 4 warps × 16 */
#define FM_KT   32 /* keys per tile */
#define FM_FULL 0xffffffffu

/* Shared memory of fm_attention_kernel<HD, HPB, STG>: Q of HPB heads × 64 rows, STG stages
 * of K and V tiles, bf16 rows of stride HD + 8 (ldmatrix rows fall on different banks). */
size_t kn_attention_fa2_smem(int hd, int hpb, int stg) {
    return sizeof(bf16) * (size_t)(hd + 8) * ((size_t)hpb * FM_ROWS + 2 * (size_t)stg * FM_KT);
}

/* Sequence s of the table as [bos, eos), clamped into [0, T] so that a bad table cannot cause
 * a wild access; the first starts at 0 and the last ends at T (tokens outside the table
 * belong to the nearest sequence, as seq_start (kn_device.h) places them). */
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
        const int n = (eos - bos + KN_ATT_FA2_LEVEL - 1) / KN_ATT_FA2_LEVEL;
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
        const int n = (eos - bos + KN_ATT_FA2_LEVEL - 1) / KN_ATT_FA2_LEVEL;
        for (int i = 0; i < n && i < L; i++) {
            const int pos = hist[i] + atomicAdd(&cnt[i], 1);
            if (pos < n_max)
                tiles[pos] = make_int4(bos + i * KN_ATT_FA2_LEVEL, bos, eos, 0);
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
        cp_wait<STG - 2>();
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
    cp_wait<0>(); /* nothing in flight at exit */
    attn_store_rows<HD>(out, gate, reinterpret_cast<const float(&)[HD / 2]>(o), l, wr0 + gq, r_end, nq, h,
                        tq);
}

/* The flash-2 path: the schedule, the bf16 K/V copies, the kernel. HPB: q heads per CTA,
 * STG: K/V stages. */
template <int HD, int HPB, int STG>
static cm_status fm_attention_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                     const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq,
                                     int nkv, float scale, int n_max) {
    const size_t kv_bytes = ((size_t)T * nkv * HD * sizeof(bf16) + 255) / 256 * 256;
    int4        *tiles;
    CM_TRY(kn_attention_schedule(ctx, cu, n_seq, T, n_max, 2 * kv_bytes, &tiles));
    bf16 *kb = (bf16 *)ctx->scratch, *vb = (bf16 *)((char *)ctx->scratch + kv_bytes);
    const int64_t n4 = T * nkv * HD / 4, blocks = (n4 + 255) / 256;
    fm_kv_to_bf16<<<(unsigned int)(blocks < 8192 ? blocks : 8192), 256, 0, ctx->stream>>>(kb, vb, k, v, n4);
    KN_CUDA_LAUNCHED(ctx);
    const size_t smem = kn_attention_fa2_smem(HD, HPB, STG);
    KN_CUDA(cudaFuncSetAttribute(fm_attention_kernel<HD, HPB, STG>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned int)(nq / HPB), (unsigned int)n_max);
    fm_attention_kernel<HD, HPB, STG><<<grid, 128 * HPB, smem, ctx->stream>>>(
        out, q, kb, vb, gate, tiles, nq, nkv, scale * 1.4426950408889634f);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// launchers (kn_attention_int.h)

cm_status kn_attention_schedule(kn_ctx *ctx, const int32_t *cu, int n_seq, int64_t T, int n_max, size_t head,
                                int4 **tiles) {
    const int    L = (int)((T + KN_ATT_FA2_LEVEL - 1) / KN_ATT_FA2_LEVEL);
    const size_t tile_bytes = ((size_t)n_max * sizeof(int4) + 255) / 256 * 256;
    head = (head + 255) / 256 * 256;
    CM_TRY(kn_cuda_scratch_reserve(ctx, head + tile_bytes + 2 * (size_t)L * sizeof(int)));
    char *sp = (char *)ctx->scratch;
    *tiles = (int4 *)(sp + head);
    int *hist = (int *)(sp + head + tile_bytes), *cnt = hist + L;
    fm_schedule_kernel<<<1, 1024, 0, ctx->stream>>>(*tiles, hist, cnt, cu, n_seq, (int)T, L, n_max);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_attention_fa2(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                           int hd, float scale, int hpb, int n_max) {
#define FM_CASE(d)                                                                                           \
    if (hd == d)                                                                                             \
        return hpb == 2 ? fm_attention_launch<d, 2, 2>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv,       \
                                                       scale, n_max)                                         \
                        : fm_attention_launch<d, 1, 2>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv,       \
                                                       scale, n_max);
    FM_CASE(64)
    FM_CASE(128)
    FM_CASE(256)
#undef FM_CASE
    return CM_FAIL(CM_ERR_UNSUPPORTED, "attention: head dim %d has no FlashAttention-2 kernel", hd);
}
