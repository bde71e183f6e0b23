/* kernels/kn_gdn_state_sm90a.cu — the Hopper form of step 4 of the chunked gated delta rule (the
 * state recurrence over each sequence's chunks; kn_gdn_state.cu picks it on compute capability
 * 9.0 for dk ≤ 128 unless TANDEM_GDN_KERNEL=mma). Compiled for sm_90a only, into the kn_sm90a
 * object (kernels/CMakeLists.txt). Its numbers are gdn_state_mma's: the same operands rounded
 * to bf16 at the same points (Sᵀ, δᵀ and the decayed δᵀ; W, U, P, Q, K as gdn_prep_mma and the
 * caller left them), fp32 accumulation and an fp32 state, up to the order of fp32 additions
 * inside the tensor cores.
 *
 * One CTA of one warpgroup per (sequence, v-head, 64 columns of dv), sequential over the
 * sequence's chunks. Warp w holds rows 16w … 16w + 15 of the transposed state Sᵀ [v, dk] in a
 * wgmma accumulator for the whole sequence, and every product of a chunk is a warpgroup MMA with
 * its A operand in registers:
 *   Sᵀ [W; Q]ᵀ                      (m64n128, K = dk; W and Q stacked, K-major in shared memory)
 *   δᵀ = Uᵀ − Sᵀ Wᵀ,  Oᵀ = (Sᵀ Qᵀ) ⊙ e^γ + δᵀ Pᵀ      (m64n64, K = 64 tokens; P K-major)
 *   Sᵀ ← e^{γ_last} Sᵀ + (δᵀ ⊙ e^{γ_last−γ}) K       (m64n{dk}, K = 64 tokens; Kᵀ K-major)
 * The accumulators of Sᵀ and δᵀ are, element for element, the A fragments of the next products
 * (as FlashAttention reuses P). The chunk's operands stream in by cp.async one chunk ahead into
 * 128-byte swizzled tiles, issued behind the first product; K arrives as rows and is transposed in
 * shared memory (ldmatrix .trans, stmatrix) while that product runs, and Uᵀ is read in the
 * accumulator's layout by ldmatrix .trans. */
#include "kn_cuda.h"
#include "kn_gdn_int.h"
#include "kn_wgmma_sm90.h"

#define GW_THREADS 128 /* one warpgroup */

/* One stage (a chunk's operands), each part 1024-aligned: W and Q stacked as DKP / 64 swizzled
 * panels of 128 rows × 128 bytes (W's 64 token rows, then Q's: one B operand of N = 128, so one
 * wgmma gives both Sᵀ Wᵀ and Sᵀ Qᵀ), P (64 × 64) swizzled, K as plain rows [64][DKP + 8] (the
 * transpose's source), the U slice [64][GDN_US], E [192]. After both stages: Kᵀ, DKP rows × 64
 * tokens, swizzled. */
template <int DKP> struct gw_layout {
    static constexpr int PANEL = 128 * 128;
    static constexpr int WQ = DKP / 64 * PANEL;
    static constexpr int PB = 64 * 128;
    static constexpr int KB = (64 * (DKP + 8) * 2 + 1023) / 1024 * 1024;
    static constexpr int UB = 64 * GDN_US * 2;
    static constexpr int STAGE = (WQ + PB + KB + UB + 192 * 4 + 1023) / 1024 * 1024;
    static constexpr int KT = DKP * 128;
    static constexpr size_t smem = 2 * (size_t)STAGE + KT + 1024; /* + the alignment of the base */
};

template <int DKP>
static __global__ void __launch_bounds__(GW_THREADS, 1)
    gw_state_kernel(float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug, const bf16 *Pg,
                    const float *Eg, const int32_t *cu, const int *seq_first, int64_t T, int nk, int nv, int dv,
                    int DVP) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef gw_layout<DKP> Ly;
    constexpr int          CH = DKP / 8, KS = DKP + 8; /* 16-byte chunks per row; K's row stride */
    extern __shared__ unsigned char gw_raw[];
    unsigned char *base = (unsigned char *)(((uintptr_t)gw_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *Kt = base + 2 * Ly::STAGE;
    /* the dv slices of one (sequence, v-head) are neighbours in the grid, so they run at the same
     * time and the second reads W, Q, K and P from L2 */
    const int      nsl = DVP / GDN_MV, sh = blockIdx.x / nsl;
    const int      seq = sh / nv, h = sh % nv, kh = h / (nv / nk);
    const int      col0 = blockIdx.x % nsl * GDN_MV;
    const int      tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
    int64_t        bos = cu[seq], eos = cu[seq + 1];
    bos = bos < 0 ? 0 : (bos > T ? T : bos);
    eos = eos < bos ? bos : (eos > T ? T : eos);
    const int nch = (int)((eos - bos + GDN_C - 1) / GDN_C), first = seq_first[seq];
    const int vr = 16 * warp + (lane >> 2); /* this lane's state rows vr and vr + 8 within the slice */

    /* chunk k's operands into stage st (rows ≥ L of Q and K zero-filled) */
    auto load = [&](int st, int k) {
        const int64_t  t0 = bos + (int64_t)k * GDN_C, slot = (int64_t)(first + k) * nv + h;
        const int      L = (int)(eos - t0 < GDN_C ? eos - t0 : GDN_C);
        unsigned char *sb = base + st * Ly::STAGE;
        unsigned char *Pb = sb + Ly::WQ, *Kb = Pb + Ly::PB, *Ub = Kb + Ly::KB;
        float         *Eb = (float *)(Ub + Ly::UB);
#pragma unroll
        for (int it = 0; it < 64 * CH / GW_THREADS; it++) {
            const int     i = tid + it * GW_THREADS, r = i / CH, c = i % CH;
            unsigned char *pan = sb + (c >> 3) * Ly::PANEL;
            const bool     ok = r < L;
            const int64_t  qo = ((t0 + (ok ? r : 0)) * nk + kh) * (int64_t)DKP + c * 8;
            cp_async16(pan + wg_swz(r, c & 7), Wg + (slot * 64 + r) * DKP + c * 8, true);
            cp_async16(pan + wg_swz(64 + r, c & 7), qc + qo, ok);
            cp_async16(Kb + (r * KS + c * 8) * 2, kc + qo, ok);
        }
#pragma unroll
        for (int it = 0; it < 64 * 8 / GW_THREADS; it++) {
            const int i = tid + it * GW_THREADS, r = i >> 3, c = i & 7;
            /* P's 16 × 16 blocks above the diagonal are zero and gdn_prep_mma leaves them
             * unwritten (gdn_state_mma skips them; an m64n64 product takes all four) */
            cp_async16(Pb + wg_swz(r, c), Pg + (slot * 64 + r) * 64 + c * 8, c < 2 * (r >> 4) + 2);
            cp_async16(Ub + (r * GDN_US + c * 8) * 2, Ug + (slot * 64 + r) * DVP + col0 + c * 8, true);
        }
        if (tid < 48)
            cp_async16(Eb + tid * 4, Eg + slot * 192 + tid * 4, true);
    };
    if (nch > 0)
        load(0, 0);
    cp_commit();

    float    S[DKP / 2]; /* Sᵀ rows vr, vr + 8: S[4i + 2h + j] is row vr + 8h, dk column 8i + 2t + j */
    uint32_t sa[DKP / 16][4];
#pragma unroll
    for (int i = 0; i < DKP / 2; i++)
        S[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < DKP / 16; i++)
        sa[i][0] = sa[i][1] = sa[i][2] = sa[i][3] = 0u;

    for (int k = 0; k < nch; k++) {
        const int64_t t0 = bos + (int64_t)k * GDN_C;
        const int     L = (int)(eos - t0 < GDN_C ? eos - t0 : GDN_C);
        cp_wait<0>();
        fence_async_smem();
        __syncthreads(); /* chunk k landed for every thread; chunk k − 1's stage and Kᵀ are free */
        unsigned char *sb = base + (k & 1) * Ly::STAGE;
        unsigned char *Pb = sb + Ly::WQ, *Kb = Pb + Ly::PB, *Ub8 = Kb + Ly::KB;
        const float   *Eb = (const float *)(Ub8 + Ly::UB);
        const uint64_t wqd = wg_desc(sb), pd = wg_desc(Pb), kd = wg_desc(Kt);

        /* DO = Sᵀ [W; Q]ᵀ: columns 0 … 63 are Sᵀ Wᵀ (D), 64 … 127 Sᵀ Qᵀ (O) */
        float DO[64];
#pragma unroll
        for (int i = 0; i < 64; i++)
            DO[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ks++) /* descriptor units of 16 bytes */
            wgmma_m64n128k16_rs(DO, sa[ks], wqd + (ks >> 2) * (Ly::PANEL / 16) + 2 * (ks & 3), ks > 0);
        wg_commit();
        float(&D)[32] = *reinterpret_cast<float(*)[32]>(DO);
        float(&O)[32] = *reinterpret_cast<float(*)[32]>(DO + 32);

        /* while it runs: the next chunk's copies, and Kᵀ from K's rows */
        if (k + 1 < nch)
            load((k + 1) & 1, k + 1);
        cp_commit();

        /* Kᵀ: 8 × 8 blocks (tokens 8bt.., dk 8bd..), four per warp and step; lane l addresses
         * row l % 8 of block l / 8 */
#pragma unroll
        for (int it = 0; it < 8 * (DKP / 8) / 16; it++) {
            const int b = (it * 4 + warp) * 4 + (lane >> 3), bt = b & 7, bd = b >> 3, rr = lane & 7;
            uint32_t  r[4];
            ldsm_x4_t(r, (const bf16 *)Kb + (bt * 8 + rr) * KS + bd * 8);
            stsm_x4(Kt + wg_swz(bd * 8 + rr, bt), r);
        }
        /* Uᵀ in the accumulator's layout: ldmatrix .trans of U's 8 × 8 blocks (tokens 8n.., v
         * 16w + 8h..) gives lane (g, t) the pair Uᵀ[16w + 8h + g][8n + 2t, + 1] of D[4n + 2h] */
        uint32_t ut[8][2];
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
            uint32_t r[4];
            const int m = lane >> 3, rr = lane & 7; /* block m: n + (m >> 1), h = m & 1 */
            ldsm_x4_t(r, (const bf16 *)Ub8 + (8 * (n + (m >> 1)) + rr) * GDN_US + 16 * warp + 8 * (m & 1));
            ut[n][0] = r[0], ut[n][1] = r[1], ut[n + 1][0] = r[2], ut[n + 1][1] = r[3];
        }
        wg_wait0();
        wg_fence_operands(DO);
        const float elast = Eb[128]; /* (after the wait: ptxas would insert one for S here anyway) */
#pragma unroll
        for (int i = 0; i < DKP / 2; i++)
            S[i] *= elast;

        /* δᵀ = Uᵀ − D as A fragments, plain (for Pᵀ) and decayed by e^{γ_last−γ} (for K); O ⊙ e^γ */
        uint32_t da[4][4], dd[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            float d[2][4];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int    n = 2 * kk + hf, tok = 8 * n + 2 * t;
                const float2 e = *(const float2 *)(Eb + tok);
                d[hf][0] = __uint_as_float(ut[n][0] << 16) - D[4 * n];
                d[hf][1] = __uint_as_float(ut[n][0] & 0xffff0000u) - D[4 * n + 1];
                d[hf][2] = __uint_as_float(ut[n][1] << 16) - D[4 * n + 2];
                d[hf][3] = __uint_as_float(ut[n][1] & 0xffff0000u) - D[4 * n + 3];
                O[4 * n] *= e.x, O[4 * n + 1] *= e.y, O[4 * n + 2] *= e.x, O[4 * n + 3] *= e.y;
            }
            gdn_delta_frags(da[kk], dd[kk], d, Eb, kk, t);
        }
        fence_async_smem();
        __syncthreads(); /* Kᵀ written by every warp */
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if constexpr (DKP == 128)
                wgmma_m64n128k16_rs(S, dd[kk], kd + 2 * kk, 1);
            else
                wgmma_m64n64k16_rs(S, dd[kk], kd + 2 * kk, 1);
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_m64n64k16_rs(O, da[kk], pd + 2 * kk, 1);
        wg_commit();
        wg_wait0();
        wg_fence_operands(S);
        wg_fence_operands(DO);

        float *o = out + (t0 * nv + h) * (int64_t)dv;
#pragma unroll
        for (int n = 0; n < 8; n++)
            gdn_store_c(o, (int64_t)nv * dv, 8 * n + 2 * t, L, col0 + vr, dv, O + 4 * n);
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ks++) {
            sa[ks][0] = pack_bf16(S[8 * ks], S[8 * ks + 1]);
            sa[ks][1] = pack_bf16(S[8 * ks + 2], S[8 * ks + 3]);
            sa[ks][2] = pack_bf16(S[8 * ks + 4], S[8 * ks + 5]);
            sa[ks][3] = pack_bf16(S[8 * ks + 6], S[8 * ks + 7]);
        }
    }
    cp_wait<0>(); /* nothing in flight at exit */
#else
    __trap(); /* built without sm_90a code: kn_gdn_wg_available said no */
#endif
}

// ----------------------------------------------------------------------------
// launchers (kn_gdn_int.h)

bool kn_gdn_wg_available(kn_ctx *ctx, int DKP) {
    int major = 0, minor = 0;
    if (ctx->gdn_force || (DKP != 64 && DKP != 128) ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    const size_t need = DKP == 64 ? gw_layout<64>::smem : gw_layout<128>::smem;
    return major == 9 && minor == 0 && need <= (size_t)kn_gdn_smem_optin(ctx);
}

template <int DKP>
static cm_status gw_launch(kn_ctx *ctx, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg, const bf16 *Ug,
                           const bf16 *Pg, const float *Eg, const int32_t *cu, const int *seq_first, int n_seq,
                           int64_t T, int nk, int nv, int dv, int DVP) {
    const size_t smem = gw_layout<DKP>::smem;
    KN_CUDA(cudaFuncSetAttribute(gw_state_kernel<DKP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int64_t ctas = (int64_t)n_seq * nv * (DVP / GDN_MV);
    KN_CUDA_CHECK_ARG(
        ctas < INT32_MAX,
        "gated_delta_rule: %lld sequences x %d v-heads exceed one grid; pass fewer sequences per call",
        (long long)n_seq, nv);
    gw_state_kernel<DKP><<<(unsigned int)ctas, GW_THREADS, smem, ctx->stream>>>(
        out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, T, nk, nv, dv, DVP);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_gdn_state_wg(kn_ctx *ctx, int DKP, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg,
                          const bf16 *Ug, const bf16 *Pg, const float *Eg, const int32_t *cu, const int *seq_first,
                          int n_seq, int64_t T, int nk, int nv, int dv, int DVP) {
    if (DKP == 64)
        return gw_launch<64>(ctx, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv, DVP);
    return gw_launch<128>(ctx, out, qc, kc, Wg, Ug, Pg, Eg, cu, seq_first, n_seq, T, nk, nv, dv, DVP);
}
