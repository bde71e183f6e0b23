/* kernels/kn_qk_prep.cu — the gated attention's q/k input prep in one pass (the target's bf16
 * fast path): per token, every q head is copied out of the gated q_proj output qg (per head
 * [q_h | gate_h], the gate half copied to gate), and every q and k head is rmsnorm'ed and
 * rotated by the NeoX partial rope, reading and writing each element once where the chain
 * (two copy2d, two rmsnorm, two rope) made six passes over [T, nq·hd] and [T, nkv·hd].
 * One block per token (grid-stride): its threads first compute the token's cos/sin table for
 * the rot_dim/2 pairs into shared memory, then each warp takes one head row at a time: it
 * loads the row into a shared row buffer (writing the gate half as it goes), sums x² in
 * double by warp shuffles, writes the normalised floats back into the buffer, and rotates
 * pairs (i, i + rot_dim/2) from it, so any rot_dim ≤ hd works. Numerics are the cpu
 * reference's (ref/kn_rope_ref.c kn_ref_qk_prep): the sum of squares, 1/sqrt and the scaled
 * output in double rounded once, inv_freq computed on the host in float32 by the same
 * expression, the angle one float32 product (__fmul_rn), cos, sin and the rotation in double
 * with explicit _rn operations (no fused multiply-add), so results differ from the cpu only
 * by the order of the double sum of squares. Limits: hd ≤ 1024 and rot_dim ≤ 1024 (shared
 * memory ≤ 40 KiB); beyond, CM_ERR_UNSUPPORTED and the caller runs the chain. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include "kn_rope_int.h"

#define QK_MAX_HD 1024
#define QK_WARPS  8

// ----------------------------------------------------------------------------
// kernel

static __global__ void qk_prep_kernel(float *q, float *gate, float *k, const float *qg, const float *q_norm,
                                      const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv,
                                      int hd, int half, float eps, int one_plus, const kn_rope_freqs freqs) {
    extern __shared__ double qk_sm[];
    double                  *cs = qk_sm, *sn = qk_sm + half;
    const int                lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float                   *buf = (float *)(qk_sm + 2 * half) + (int64_t)warp * hd;
    const int64_t            qs = gate ? 2 * (int64_t)hd : hd;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads(); /* the previous token's rows are done with cs/sn */
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float  angle = __fmul_rn((float)pos[t], freqs.inv[i]);
            double s, c;
            sincos((double)angle, &s, &c);
            cs[i] = c;
            sn[i] = s;
        }
        __syncthreads();
        for (int h = warp; h < nq + nkv; h += nw) {
            const int    isq = h < nq;
            float       *y = isq ? q + (t * nq + h) * (int64_t)hd : k + (t * nkv + (h - nq)) * (int64_t)hd;
            const float *src = isq ? qg + (t * nq + h) * qs : y;
            const float *w = isq ? q_norm : k_norm;
            float       *g = isq && gate ? gate + (t * nq + h) * (int64_t)hd : NULL;
            double       ss = 0;
            for (int c = lane; c < hd; c += 32) {
                float v = src[c];
                buf[c] = v;
                ss += (double)v * (double)v; /* exact product: the order of the sum is the only difference */
                if (g)
                    g[c] = src[hd + c];
            }
            ss = warp_sum(ss);
            const double rstd = 1.0 / sqrt(ss / (double)hd + (double)eps);
            for (int c = lane; c < hd; c += 32) {
                double sc = one_plus ? 1.0 + (double)w[c] : (double)w[c];
                buf[c] = (float)__dmul_rn(__dmul_rn((double)buf[c], rstd), sc);
            }
            __syncwarp();
            for (int c = lane; c < hd; c += 32) {
                if (c < half) {
                    double x1 = buf[c], x2 = buf[c + half];
                    y[c] = (float)__dsub_rn(__dmul_rn(x1, cs[c]), __dmul_rn(x2, sn[c]));
                    y[c + half] = (float)__dadd_rn(__dmul_rn(x2, cs[c]), __dmul_rn(x1, sn[c]));
                } else if (c >= 2 * half) {
                    y[c] = buf[c];
                }
            }
            __syncwarp(); /* the buffer is reused by this warp's next row */
        }
    }
}

// ----------------------------------------------------------------------------
// launcher

static int spans_overlap(const float *a, int64_t na, const float *b, int64_t nb) {
    const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + (uintptr_t)nb * sizeof(float) && b0 < a0 + (uintptr_t)na * sizeof(float);
}

cm_status kn_cuda_qk_prep(kn_ctx *ctx, float *q, float *gate, float *k, const float *qg, const float *q_norm,
                          const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv, int hd,
                          int rot_dim, float theta, float eps, int one_plus) {
    KN_CUDA_CHECK_ARG(ctx, "qk_prep: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nq > 0 && nkv > 0 && hd > 0, "qk_prep: bad shape T=%lld nq=%d nkv=%d hd=%d",
                      (long long)T, nq, nkv, hd);
    KN_CUDA_CHECK_ARG(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= hd,
                      "qk_prep: rot_dim=%d must be even, > 0 and <= head_dim=%d", rot_dim, hd);
    KN_CUDA_CHECK_ARG(theta > 0 && isfinite(theta), "qk_prep: theta=%g must be finite and > 0",
                      (double)theta);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "qk_prep: eps=%g must be >= 0", (double)eps);
    if (hd > QK_MAX_HD || rot_dim / 2 > KN_ROPE_MAX_HALF)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "qk_prep: head_dim=%d is not supported by the cuda backend (max %d)", hd, QK_MAX_HD);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && k && qg && q_norm && k_norm && pos,
                      "qk_prep: q, k, qg, q_norm, k_norm or pos is NULL");
    const int64_t qs = gate ? 2 * (int64_t)hd : hd, nqg = T * nq * qs, nqe = T * nq * (int64_t)hd,
                  nke = T * nkv * (int64_t)hd;
    KN_CUDA_CHECK_ARG(!spans_overlap(qg, nqg, k, nke) && (!gate || !spans_overlap(qg, nqg, gate, nqe)) &&
                          (qg == q ? !gate : !spans_overlap(qg, nqg, q, nqe)),
                      "qk_prep: qg overlaps q, gate or k (only an ungated q may equal qg)");

    const int half = rot_dim / 2;
    kn_rope_freqs freqs;
    kn_rope_freqs_fill(&freqs, rot_dim, theta);
    const int     warps = nq + nkv < QK_WARPS ? nq + nkv : QK_WARPS;
    const size_t  smem = (size_t)half * 2 * sizeof(double) + (size_t)warps * (size_t)hd * sizeof(float);
    const int64_t blocks = T < (1 << 20) ? T : (1 << 20);
    qk_prep_kernel<<<(unsigned int)blocks, 32 * warps, smem, ctx->stream>>>(
        q, gate, k, qg, q_norm, k_norm, pos, T, nq, nkv, hd, half, eps, one_plus, freqs);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
