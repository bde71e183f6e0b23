/* kernels/kn_gdn.cu — the gated delta rule of the Gated DeltaNet core (the function of
 * kn_backend.h), in two forms chosen by the context's precision:
 *
 * - KN_GEMM_MODE_F32 (dump --precision fp32, the fp32 oracle checks): the per-token recurrence
 *   (here), all fp32 SIMT: per token, S = e^g·S; u = β(v − Sᵀk); S += k uᵀ; o = Sᵀ(q·scale). One
 *   block per (sequence, v-head, 32-column tile of dv); the fp32 state tile S[dk, 32] lives in
 *   registers (lane = column, warp w of 8 owns rows w, w+8, …). Exact to fp32 rounding, slow.
 * - KN_GEMM_MODE_BF16 (serving): the chunked WY form on bf16 tensor cores (kn_gdn_chunk.cu and
 *   kn_gdn_state.cu), where the device's shared memory per block is large enough for its
 *   blocks (kn_gdn_chunked_fits); elsewhere the per-token kernel runs here.
 * The gate (g, beta) is kn_gdn_gate.cu. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_gdn_int.h"

#define GDN_WARPS  8  /* row groups */
#define GDN_CH     16 /* tokens staged per shared-memory load */
#define GDN_MAX_DK 256

// ----------------------------------------------------------------------------
// kernels

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

// ----------------------------------------------------------------------------
// launchers

/* The shape checks both entries start with; op names the call in the messages. */
static cm_status gdr_check_shape(const kn_ctx *ctx, const char *op, int64_t T, int nk, int nv, int dk, int dv,
                                 int n_seq) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                      "%s: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d", op, (long long)T, nk, nv, dk, dv);
    KN_CUDA_CHECK_ARG(nv % nk == 0, "%s: nv=%d must be a multiple of nk=%d", op, nv, nk);
    KN_CUDA_CHECK_ARG(n_seq >= 0, "%s: n_seq=%d must be >= 0", op, n_seq);
    KN_CUDA_CHECK_ARG(T == 0 || n_seq > 0, "%s: T=%lld tokens but n_seq=0 sequences", op, (long long)T);
    return CM_OK;
}

/* The grid limits of both entries' launches. */
static cm_status gdr_check_grid(const char *op, int n_seq, int nv, int dv) {
    KN_CUDA_CHECK_ARG((int64_t)n_seq * nv <= INT32_MAX && dv <= 65535 * 32,
                      "%s: n_seq·nv=%lld or dv=%d exceeds the cuda grid limits", op, (long long)n_seq * nv, dv);
    return CM_OK;
}

cm_status kn_cuda_gated_delta_rule(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                   int64_t T, int nk, int nv, int dk, int dv, float scale) {
    CM_TRY(gdr_check_shape(ctx, "gated_delta_rule", T, nk, nv, dk, dv, n_seq));
    if (dk > GDN_MAX_DK)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "gated_delta_rule: dk=%d is not supported by the cuda backend (max %d)", dk,
                       GDN_MAX_DK);
    CM_TRY(gdr_check_grid("gated_delta_rule", n_seq, nv, dv));
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && k && v && g && beta && cu_seqlens,
                      "gated_delta_rule: out, q, k, v, g, beta or cu_seqlens is NULL");
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16 && kn_gdn_chunked_fits(ctx, dk))
        return kn_gdn_chunked(ctx, out, q, k, v, g, beta, cu_seqlens, n_seq, T, nk, nv, dk, dv, scale);

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

cm_status kn_cuda_gated_delta_rule_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                                        const uint16_t *v, const float *g, const float *beta,
                                        const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                                        int dk, int dv) {
    CM_TRY(gdr_check_shape(ctx, "gated_delta_rule_bf16", T, nk, nv, dk, dv, n_seq));
    if (ctx->gemm_mode != KN_GEMM_MODE_BF16 || (dk != 64 && dk != 128 && dk != 256) ||
        !kn_gdn_chunked_fits(ctx, dk))
        return CM_FAIL(
            CM_ERR_UNSUPPORTED,
            "gated_delta_rule_bf16: the chunked form on bf16 operands needs a bf16-mode context, dk 64, "
            "128 or 256 (dk=%d) and room for its blocks; run gated_delta_rule",
            dk);
    CM_TRY(gdr_check_grid("gated_delta_rule_bf16", n_seq, nv, dv));
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && k && v && g && beta && cu_seqlens,
                      "gated_delta_rule_bf16: out, q, k, v, g, beta or cu_seqlens is NULL");
    KN_CUDA_CHECK_ARG((uintptr_t)q % 16 == 0 && (uintptr_t)k % 16 == 0,
                      "gated_delta_rule_bf16: q and k must be 16-byte aligned");
    return kn_gdn_chunked_bf16(ctx, out, q, k, v, g, beta, cu_seqlens, n_seq, T, nk, nv, dk, dv);
}
