/* kernels/kn_attention_sm90a.cu — the Hopper form of kn_cuda_attention (kn_attention.cu picks
 * it on compute capability 9.0 in KN_GEMM_MODE_BF16, head dims 128 and 256, an even GQA group):
 * FlashAttention on warpgroup MMA. Compiled for sm_90a only, into the kn_sm90a object
 * (kernels/CMakeLists.txt). The specification is kn_ref_attention; the numbers are those of the
 * FlashAttention-2 form (kn_attention_mma.cu: bf16 q, k, v and probabilities, fp32 accumulation
 * and softmax) up to the order of fp32 additions inside the tensor cores.
 *
 * One CTA of two warpgroups per (64-row tile of the work list, two q heads of one kv head):
 * warpgroup w takes head 2·blockIdx.x + w, both take the same 64 rows, so both need the same
 * keys and share every K and V tile in shared memory (GQA groups are even in every Qwen hybrid).
 * Key tiles of 64 are aligned to multiples of 64 of the packed batch (the 16-byte copies of Vᵀ
 * need 8-key alignment); keys before the sequence start or after a row are masked. Per tile t:
 * S = Q·Kᵀ (wgmma m64n64k16, Q and K K-major in shared memory), then O += P·V of tile t − 1
 * (wgmma m64n{HD}k16 with P from registers, in the accumulator's own layout, and Vᵀ K-major in
 * shared memory) issued behind it, and the online softmax of tile t in base 2 on the accumulators
 * while that second product runs; O is rescaled to tile t's max once it is done. So K of tile t
 * and V of tile t − 1 are in use together: two stages each, K of t + 1 and V of t copied by
 * cp.async during tile t. A prep kernel rounds K to bf16 and writes V rounded and transposed,
 * [kv head][dim][token] (tokens padded to 64 with zeros); q is rounded as it enters shared
 * memory. */
#include "kn_attention_int.h"
#include "kn_wgmma_sm90.h"

#include <math.h>
#include <stdint.h>

#define WA_ROWS    64  /* query rows per CTA (each warpgroup's 64 rows, of its own head) */
#define WA_KT      64  /* keys per tile: one 128-byte swizzle row of Vᵀ */
#define WA_THREADS 256 /* two warpgroups */

/* Shared memory: Q of two heads (HD / 64 column blocks of 64 rows × 128 bytes each), then two
 * stages of K (HD / 64 blocks of 64 keys) and two of Vᵀ (HD rows of 64 keys), each part
 * 1024-aligned. */
template <int HD> struct wa_layout {
    static constexpr int NKB = HD / 64;
    static constexpr int QB = 2 * NKB * WA_ROWS * 128;
    static constexpr int KB = NKB * WA_KT * 128;
    static constexpr int VB = HD * 128;
};
template <int HD> static constexpr size_t wa_smem() {
    return (size_t)wa_layout<HD>::QB + 2 * (size_t)(wa_layout<HD>::KB + wa_layout<HD>::VB) + 1024;
}

/* k, v [T][nkv][HD] fp32 → kb (same layout) and vt [nkv · HD][Tp] in bf16, zeros at tokens
 * T .. Tp − 1. One block of 256 per 64 tokens × 64 of the nkv · HD columns, through shared
 * memory so that both the reads and the transposed writes are coalesced. */
static __global__ void __launch_bounds__(256) wa_kv_prep(bf16 *kb, bf16 *vt, const float *k, const float *v, int T,
                                                         int Tp, int C) {
    __shared__ float tile[64][65];
    const int        t0 = blockIdx.x * 64, c0 = blockIdx.y * 64, tid = threadIdx.x;
    for (int i = tid; i < 64 * 64; i += 256) {
        const int     r = i >> 6, c = i & 63, t = t0 + r;
        const int64_t off = (int64_t)t * C + c0 + c;
        float         x = 0.0f;
        if (t < T) {
            x = v[off];
            kb[off] = __float2bfloat16_rn(k[off]);
        }
        tile[r][c] = x;
    }
    __syncthreads();
    for (int i = tid; i < 64 * 64; i += 256) {
        const int c = i >> 6, r = i & 63;
        vt[(int64_t)(c0 + c) * Tp + t0 + r] = __float2bfloat16_rn(tile[r][c]);
    }
}

/* o += P·V for one 64-key tile: P as four A fragments (keys 16j .. 16j + 15), Vᵀ K-major at vd */
template <int HD>
static __device__ __forceinline__ void wa_pv(float (&o)[HD / 2], const uint32_t (&p)[4][4], uint64_t vd) {
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if constexpr (HD == 256)
            wgmma_m64n256k16_rs(o, p[j], vd + 2 * j, 1);
        else
            wgmma_m64n128k16_rs(o, p[j], vd + 2 * j, 1);
    }
}

/* Keeps p's registers live to this point (after the wait for the wgmma that reads them). */
static __device__ __forceinline__ void wa_keep(uint32_t (&p)[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            asm volatile("" : "+r"(p[j][e])::"memory");
}

template <int HD>
static __global__ void __launch_bounds__(WA_THREADS, 1)
    wa_attention_kernel(float *out, const float *q, const bf16 *kb, const bf16 *vt, const float *gate,
                        const int4 *tiles, int nq, int nkv, int T, int Tp, float sc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef wa_layout<HD> Ly;
    constexpr int         NKB = Ly::NKB, CH = HD / 8; /* 16-byte chunks per head row */
    extern __shared__ unsigned char wa_raw[];
    const int4                      tl = tiles[blockIdx.y];
    if (tl.x < 0)
        return; /* past the end of the work list */
    const int r0 = tl.x, bos = tl.y, r_end = min(tl.x + WA_ROWS, tl.z);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wq = (tid >> 5) & 3, gq = lane >> 2, tq = lane & 3;
    const int h0 = blockIdx.x * 2, h = h0 + wg, g = h0 / (nq / nkv);
    unsigned char *Qs = (unsigned char *)(((uintptr_t)wa_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *Ks = Qs + Ly::QB, *Vs = Ks + 2 * Ly::KB;
    const int      kt0 = bos / WA_KT, n_kt = (r_end - 1) / WA_KT - kt0 + 1;

    /* one tile's K and Vᵀ into a stage, loops not unrolled: unrolled, their addresses were
     * hoisted out of the tile loop, and at HD 256 registers spilled */
    auto load_k = [&](int stage, int kt) {
        const int      s0 = kt * WA_KT;
        unsigned char *kd = Ks + stage * Ly::KB;
#pragma unroll 1
        for (int it = 0; it < WA_KT * CH / WA_THREADS; it++) {
            const int  i = tid + it * WA_THREADS, r = i / CH, c = i % CH, s = s0 + r;
            const bool ok = s < T;
            cp_async16(kd + (c >> 3) * (WA_KT * 128) + wg_swz(r, c & 7),
                       ok ? kb + ((int64_t)s * nkv + g) * HD + c * 8 : kb, ok);
        }
    };
    auto load_v = [&](int stage, int kt) {
        const int      s0 = kt * WA_KT;
        unsigned char *vd = Vs + stage * Ly::VB;
#pragma unroll 1
        for (int it = 0; it < HD * 8 / WA_THREADS; it++) {
            const int i = tid + it * WA_THREADS, d = i >> 3, c = i & 7;
            cp_async16(vd + wg_swz(d, c), vt + ((int64_t)g * HD + d) * Tp + s0 + c * 8, true);
        }
    };
    load_k(0, kt0); /* n_kt ≥ 1: the CTA's first row is a key of its own tile */
    cp_commit();
    /* Q of both heads, rounded from fp32 (zeros at and past r_end), every load in flight at once
     * (nothing else holds registers yet) */
#pragma unroll
    for (int it = 0; it < 2 * WA_ROWS * CH / WA_THREADS; it++) {
        const int i = tid + it * WA_THREADS, hh = i / (WA_ROWS * CH), r = (i / CH) % WA_ROWS, c = i % CH;
        const int t = r0 + r;
        uint4     o = make_uint4(0, 0, 0, 0);
        if (t < r_end) {
            const float4 *src = reinterpret_cast<const float4 *>(q + ((int64_t)t * nq + h0 + hh) * HD + c * 8);
            const float4  a = __ldg(src), b = __ldg(src + 1);
            o = make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
        }
        *reinterpret_cast<uint4 *>(Qs + (hh * NKB + (c >> 3)) * (WA_ROWS * 128) + wg_swz(r, c & 7)) = o;
    }
    fence_async_smem();

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        o[i] = 0.0f;
    float     m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows gq, gq + 8 of the warp; l per lane */
    const int wr0 = r0 + wq * 16 + gq;                              /* this lane's first row */
    const uint64_t qd = wg_desc(Qs + wg * NKB * (WA_ROWS * 128));

    /* tile t's S into P (bf16 A fragments, keys 16j .. 16j + 15 in the accumulator's column groups
     * 2j, 2j + 1), the running max m and sum l updated, corr the factor for the output so far */
    auto softmax = [&](float(&s)[32], int t, uint32_t(&pn)[4][4], float(&corr)[2]) {
        const int s0 = (kt0 + t) * WA_KT;
        /* no mask when every key of the tile is in the sequence and at or before the CTA's first row */
        const bool full = s0 >= bos && s0 + WA_KT - 1 <= r0;
        float      mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = s0 + 8 * i + 2 * tq + (e & 1), row = wr0 + (e >= 2 ? 8 : 0);
                const float x = full || (key >= bos && key <= row) ? s[4 * i + e] * sc : -INFINITY;
                s[4 * i + e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float mb[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float m_new = quad_max(mx[r]);
            /* a row past r_end (or one that saw no key yet) keeps exact zeros instead of NaN */
            mb[r] = m_new == -INFINITY ? 0.0f : m_new;
            corr[r] = exp2f(m[r] - mb[r]); /* 0 when m was -inf */
            m[r] = m_new;
        }
#pragma unroll
        for (int i = 0; i < 32; i++)
            s[i] = exp2f(s[i] - mb[(i >> 1) & 1]); /* exp2(-inf) = 0 for masked keys */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                sum += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
            l[r] = l[r] * corr[r] + sum;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            pn[j][0] = pack_bf16(s[8 * j], s[8 * j + 1]);
            pn[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
            pn[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
            pn[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
        }
    };
    /* the top of tile t: its K and the V of tile t − 1 (and Q) landed, both warpgroups done with
     * tile t − 1's S and tile t − 2's P·V, whose stages take K of t + 1 and V of t; then S = Q·Kᵀ
     * issued */
    auto begin = [&](float(&s)[32], int t) {
        cp_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (t + 1 < n_kt)
            load_k((t + 1) & 1, kt0 + t + 1);
        load_v(t & 1, kt0 + t);
        cp_commit();
        const uint64_t kd = wg_desc(Ks + (t & 1) * Ly::KB);
#pragma unroll
        for (int i = 0; i < 32; i++)
            s[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const int off =
                (kk >> 2) * (WA_ROWS * 128 / 16) + 2 * (kk & 3); /* descriptor units of 16 bytes */
            wgmma_m64n64k16_ss(s, qd + off, kd + off, kk > 0);
        }
        wg_commit();
    };

    /* tile t ≥ 1: O += P·V of the tile before (pp) issued behind S, the softmax into pn while it
     * runs, then O rescaled to this tile's max */
    auto step = [&](int t, uint32_t(&pp)[4][4], uint32_t(&pn)[4][4]) {
        float s[32], corr[2];
        begin(s, t);
        wa_pv<HD>(o, pp, wg_desc(Vs + ((t - 1) & 1) * Ly::VB));
        wg_commit();
        wg_wait<1>();
        wg_fence_operands(s);
        softmax(s, t, pn, corr);
        wg_wait0();
        wg_fence_operands(o);
        wa_keep(pp);
        if (corr[0] != 1.0f || corr[1] != 1.0f) {
#pragma unroll
            for (int i = 0; i < HD / 2; i++)
                o[i] *= corr[(i >> 1) & 1];
        }
    };
    /* P·V of the last tile, once its V has landed for every thread */
    auto finish = [&](uint32_t(&pp)[4][4]) {
        cp_wait<0>();
        fence_async_smem();
        __syncthreads();
        wa_pv<HD>(o, pp, wg_desc(Vs + ((n_kt - 1) & 1) * Ly::VB));
        wg_commit();
        wg_wait0();
        wg_fence_operands(o);
    };
    /* P of alternate tiles in pa and pb, so that the P a P·V in flight reads and the next tile's P
     * are different registers (a wgmma reads its A registers until it is waited for, which the
     * compiler does not know: one array copied each tile let it build the next P in place) */
    uint32_t pa[4][4], pb[4][4];
    {
        float s[32], corr[2];
        begin(s, 0);
        wg_wait0();
        wg_fence_operands(s);
        softmax(s, 0, pa, corr); /* o is still zero: nothing to rescale */
    }
    int t = 1;
    for (; t + 1 < n_kt; t += 2) {
        step(t, pa, pb);
        step(t + 1, pb, pa);
    }
    if (t < n_kt) {
        step(t, pa, pb);
        finish(pb);
    } else
        finish(pa);

    attn_store_rows<HD>(out, gate, o, l, wr0, r_end, nq, h, tq);
#else
    __trap(); /* built without sm_90a code: kn_attention_wg_available said no */
#endif
}

// ----------------------------------------------------------------------------
// launchers (kn_attention_int.h)

bool kn_attention_wg_available(kn_ctx *ctx, int hd) {
    int major = 0, minor = 0, optin = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    const size_t need = hd == 256 ? wa_smem<256>() : hd == 128 ? wa_smem<128>() : (size_t)-1;
    return major == 9 && minor == 0 && need <= (size_t)optin;
}

template <int HD>
static cm_status wa_launch(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu, int n_seq, int64_t T, int nq, int nkv,
                           float scale, int n_max) {
    const int64_t Tp = (T + WA_KT - 1) / WA_KT * WA_KT;
    const size_t  kb_bytes = ((size_t)T * nkv * HD * sizeof(bf16) + 255) / 256 * 256;
    const size_t  vt_bytes = ((size_t)Tp * nkv * HD * sizeof(bf16) + 255) / 256 * 256;
    int4         *tiles;
    CM_TRY(kn_attention_schedule(ctx, cu, n_seq, T, n_max, kb_bytes + vt_bytes, &tiles));
    bf16 *kb = (bf16 *)ctx->scratch, *vt = (bf16 *)((char *)ctx->scratch + kb_bytes);
    dim3  pg((unsigned int)(Tp / 64), (unsigned int)(nkv * HD / 64));
    wa_kv_prep<<<pg, 256, 0, ctx->stream>>>(kb, vt, k, v, (int)T, (int)Tp, nkv * HD);
    KN_CUDA_LAUNCHED(ctx);
    const size_t smem = wa_smem<HD>();
    KN_CUDA(cudaFuncSetAttribute(wa_attention_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem));
    dim3 grid((unsigned int)(nq / 2), (unsigned int)n_max);
    wa_attention_kernel<HD><<<grid, WA_THREADS, smem, ctx->stream>>>(
        out, q, kb, vt, gate, tiles, nq, nkv, (int)T, (int)Tp, scale * 1.4426950408889634f);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_attention_wg(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v, const float *gate,
                          const int32_t *cu, int n_seq, int64_t T, int nq, int nkv, int hd, float scale, int n_max) {
    if (hd == 256)
        return wa_launch<256>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv, scale, n_max);
    if (hd == 128)
        return wa_launch<128>(ctx, out, q, k, v, gate, cu, n_seq, T, nq, nkv, scale, n_max);
    return CM_FAIL(CM_ERR_UNSUPPORTED, "attention: head dim %d has no wgmma kernel", hd);
}
