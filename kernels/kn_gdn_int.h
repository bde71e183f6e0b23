/* kernels/kn_gdn_int.h — internal to the chunked form of the gated delta rule
 * (kn_gdn_chunk.cu: operands, chunk table, the per-chunk prep, the launch; kn_gdn_state.cu: the
 * state recurrence over a sequence's chunks; kn_gdn_state_sm90a.cu: its Hopper form): the tile
 * constants and the device helpers they use, and the functions one calls in another. C++ (CUDA)
 * only. */
#ifndef KN_GDN_INT_H
#define KN_GDN_INT_H

#include "kn_cuda.h"

#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

#include "kn_device.h"
#include "kn_mma_sm80.h"

typedef __nv_bfloat16 bf16;

#define GDN_C       64  /* chunk length */
#define GDN_BV      32  /* state columns per block of gdn_state */
#define GDN_THREADS 256 /* 8 warps */
#define GDN_FS      68  /* fp32 stride of 64-wide tiles (a multiple of 4 for WMMA, off the 32 banks) */
#define GDN_BS      72  /* bf16 stride of 64-wide tiles (a multiple of 8 for WMMA, 16-byte rows) */
#define GDN_SFS     36  /* fp32 stride of GDN_BV-wide tiles */
#define GDN_SBS     40  /* bf16 stride of GDN_BV-wide tiles */

#define GDN_MW 4             /* state row slices of gdn_state_mma, 16 rows (v columns) each */
#define GDN_MV (16 * GDN_MW) /* v columns per block */
#define GDN_US (GDN_MV + 8)  /* bf16 stride of the staged U slice */

// ----------------------------------------------------------------------------
// device helpers

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
        cp_async16_n(dst + r * (DKP + 8) + c, src + (r < L ? r : 0) * row_stride + c, r < L ? 16 : 0);
    }
}

/* The state kernels' δᵀ for tokens 16kk … 16kk + 15 (d[hf] the C fragment of the 8-token tile
 * 2kk + hf: rows g, g + 8, tokens 2t, 2t + 1) as bf16 A fragments, plain (da, for Pᵀ) and decayed
 * by e^{γ_last−γ} (dd, for K), the decay read from E[64 …]. Both kernels round here, so their δ
 * operands are the same bits. */
static __device__ __forceinline__ void gdn_delta_frags(uint32_t da[4], uint32_t dd[4], const float (&d)[2][4],
                                                       const float *E, int kk, int t) {
    da[0] = pack_bf16(d[0][0], d[0][1]);
    da[1] = pack_bf16(d[0][2], d[0][3]);
    da[2] = pack_bf16(d[1][0], d[1][1]);
    da[3] = pack_bf16(d[1][2], d[1][3]);
    const int    tl = 16 * kk + 2 * t;
    const float2 l = *(const float2 *)(E + 64 + tl), h = *(const float2 *)(E + 64 + tl + 8);
    dd[0] = pack_bf16(d[0][0] * l.x, d[0][1] * l.y);
    dd[1] = pack_bf16(d[0][2] * l.x, d[0][3] * l.y);
    dd[2] = pack_bf16(d[1][0] * h.x, d[1][1] * h.y);
    dd[3] = pack_bf16(d[1][2] * h.x, d[1][3] * h.y);
}

/* One C fragment of Oᵀ (v columns c_lo and c_lo + 8, tokens tok and tok + 1: c[0] (tok, c_lo),
 * c[1] (tok + 1, c_lo), c[2] (tok, c_lo + 8), c[3] (tok + 1, c_lo + 8)) into out rows o (token 0 of
 * the chunk, row stride rs), tokens < L and columns < dv only. */
static __device__ __forceinline__ void gdn_store_c(float *o, int64_t rs, int tok, int L, int c_lo, int dv,
                                                   const float *c) {
    float *o0 = o + (int64_t)tok * rs, *o1 = o0 + rs;
    if (tok < L) {
        if (c_lo < dv)
            o0[c_lo] = c[0];
        if (c_lo + 8 < dv)
            o0[c_lo + 8] = c[2];
    }
    if (tok + 1 < L) {
        if (c_lo < dv)
            o1[c_lo] = c[1];
        if (c_lo + 8 < dv)
            o1[c_lo + 8] = c[3];
    }
}

// ----------------------------------------------------------------------------
// host

/* The device's shared memory per block with opt-in (0 where it cannot be read). kn_gdn_chunk.cu */
int kn_gdn_smem_optin(const kn_ctx *ctx);

/* Whether the chunked form's blocks fit this device's shared memory per block, and the chunked
 * form itself (arguments already checked by kn_cuda_gated_delta_rule). kn_gdn_chunk.cu */
int       kn_gdn_chunked_fits(const kn_ctx *ctx, int dk);
cm_status kn_gdn_chunked(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const int32_t *cu, int n_seq, int64_t T, int nk,
                         int nv, int dk, int dv, float scale);

/* The chunked form from bf16 q (q·scale already), k and v, dk 64, 128 or 256 (checked by
 * kn_cuda_gated_delta_rule_bf16). kn_gdn_chunk.cu */
cm_status kn_gdn_chunked_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                              const float *g, const float *beta, const int32_t *cu, int n_seq, int64_t T, int nk,
                              int nv, int dk, int dv);

/* Shared memory of the state kernel's block at padded dk DKP (64, 128: gdn_state_mma with
 * `stages` stages; 256: gdn_state, one stage). kn_gdn_state.cu */
size_t kn_gdn_state_smem(int DKP, int stages);

/* The state recurrence over the prepared chunks (qc, kc, Wg, Ug, Pg, Eg, seq_first, as
 * gdn_prep_mma and gdn_chunk_table left them), writing out. kn_gdn_state.cu */
cm_status kn_gdn_state(kn_ctx *ctx, int DKP, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg,
                       const bf16 *Ug, const bf16 *Pg, const float *Eg, const int32_t *cu,
                       const int *seq_first, int n_seq, int64_t T, int nk, int nv, int dv, int DVP);

/* The Hopper form of kn_gdn_state for DKP 64 and 128: whether it runs here (compute capability
 * 9.0, a build with architecture 90, the shared memory, no TANDEM_GDN_KERNEL=mma), and the
 * launch, with kn_gdn_state's arguments. kn_gdn_state_sm90a.cu (kn_gdn_state.cu without
 * architecture 90). */
bool      kn_gdn_wg_available(kn_ctx *ctx, int DKP);
cm_status kn_gdn_state_wg(kn_ctx *ctx, int DKP, float *out, const bf16 *qc, const bf16 *kc, const bf16 *Wg,
                          const bf16 *Ug, const bf16 *Pg, const float *Eg, const int32_t *cu, const int *seq_first,
                          int n_seq, int64_t T, int nk, int nv, int dv, int DVP);

#endif /* KN_GDN_INT_H */
