/* kernels/kn_fp8.cu — the FP8 block-scaled ops on CUDA (kn_backend.h, "FP8 block-scaled
 * GEMMs"; the specification is ref/kn_fp8_ref.c): the weight quantization in 128 × 128 blocks
 * (one CTA per block), the input quantization in 1 × 128 groups (one half warp per group, from the
 * input's bf16 value; swiglu_fp8 computes that input from the MLP's gate and up on the way) and
 * the W8A8 product through cuBLASLt's block-scaled modes on sm_90 (kn_cuda_lt_matmul_fp8: the
 * weight as A with 128 × 128 scales, the quantized input as B with 1 × 128 scales, fp32
 * accumulation, F32 or BF16 output), or with TANDEM_FP8_GEMM=wgmma through Tandem's own Hopper
 * kernel (kn_fp8_gemm_sm90a.cu: the same bits, 10-24 % slower today). The quantizations do the
 * reference's fp32 operations in its order (IEEE division; the e4m3 conversion, two values at a
 * time, rounds to nearest even and saturates), so their bytes and scales equal the cpu's; only
 * the product's accumulation order differs. cuBLASLt wants the token count a multiple of 4 or
 * more: the quantized input is padded with zero rows to kn_fp8_rows(M), and a ragged product
 * goes through scratch. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"
#include "kn_fp8_dev.h"
#include "kn_fp8_int.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ float ld_in(const void *p, int bf16, int64_t i) {
    return bf16 ? __uint_as_float((unsigned int)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

/* One CTA (256 threads) per 128 × 128 block of W [N, K]; grid (L, ceil(N/128)). */
static __global__ void quant_weight_kernel(uint8_t *q, float *scale, const void *w, int bf16, int64_t N,
                                           int64_t K, int64_t ld) {
    __shared__ float red[8];
    const int64_t    j = blockIdx.x, i = blockIdx.y;
    const int64_t    n0 = i * KN_FP8_BLOCK, k0 = j * KN_FP8_BLOCK;
    const int        nr = (int)min((int64_t)KN_FP8_BLOCK, N - n0), nc = (int)min((int64_t)KN_FP8_BLOCK, K - k0);
    float            amax = 0.0f;
    for (int e = threadIdx.x; e < nr * nc; e += blockDim.x)
        amax = fmaxf(amax, fabsf(ld_in(w, bf16, (n0 + e / nc) * K + k0 + e % nc)));
    for (int o = 16; o > 0; o >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (int t = 1; t < (int)(blockDim.x >> 5); t++)
        amax = fmaxf(amax, red[t]);
    const float a = amax > 1e-12f ? amax : 1e-12f;
    const float r = __fdiv_rn(KN_FP8_MAX, a);
    if (threadIdx.x == 0) {
        scale[i * ld + j] = __fdiv_rn(1.0f, r);
        if (j == gridDim.x - 1) /* the row's padding */
            for (int64_t p = gridDim.x; p < ld; p++)
                scale[i * ld + p] = 0.0f;
    }
    for (int e = threadIdx.x; e < nr * nc; e += blockDim.x) {
        int64_t idx = (n0 + e / nc) * K + k0 + e % nc;
        q[idx] = to_e4m3(__fmul_rn(ld_in(w, bf16, idx), r));
    }
}

/* The input quantization: each half warp takes one 1 × 128 group, lane l holding inputs
 * 8(l mod 16) .. 8(l mod 16) + 7 of it (one 16- or 32-byte load per source, one 8-byte store;
 * K is a multiple of 16, so a ragged group is whole lanes). q [Mp, K] (rows ≥ M zero), s [L, Mp]
 * (token-contiguous, as cuBLASLt's 1 × 128 mode reads it; 0 for rows ≥ M). */
enum { SRC_F32 = 0, SRC_BF16, SRC_SWIGLU, SRC_SWIGLU16 };

/* a and b rounded to bf16 (each as __float2bfloat16_rn would) in one paired conversion */
static __device__ __forceinline__ void bf16r2(float a, float b, float *ra, float *rb) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    *ra = __low2float(p), *rb = __high2float(p);
}

/* eight bf16 values (16 bytes) widened exactly */
static __device__ __forceinline__ void ld_bf16x8(const uint16_t *p, float v[8]) {
    const uint4    raw = *(const uint4 *)p;
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
}

/* eight f32 values (32 bytes) */
static __device__ __forceinline__ void ld_f32x8(const float *p, float v[8]) {
    const float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

/* silu(g)·u as swiglu_bf16's kernel computes it (kn_elementwise.cu), so that the fused op sees
 * the same bf16 values */
static __device__ __forceinline__ float swiglu1(float g, float u) {
    return kn_silu(g) * u;
}

/* lane's eight raw inputs at `at` (gate and up for SwiGLU): loaded first, so that every load
 * of a warp's run is in flight before the first value is worked on */
struct raw8 {
    float a[8], b[8];
};

template <int SRC>
static __device__ __forceinline__ void load8(const void *inp, const void *up, int64_t at, raw8 *r) {
    if (SRC == SRC_BF16 || SRC == SRC_SWIGLU16)
        ld_bf16x8((const uint16_t *)inp + at, r->a);
    else
        ld_f32x8((const float *)inp + at, r->a);
    if (SRC == SRC_SWIGLU16)
        ld_bf16x8((const uint16_t *)up + at, r->b);
    else if (SRC == SRC_SWIGLU)
        ld_f32x8((const float *)up + at, r->b);
}

/* the bf16 values (as floats) the quantization reads, from the raw inputs */
template <int SRC> static __device__ __forceinline__ void values8(const raw8 &r, float v[8]) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        if (SRC == SRC_BF16)
            v[i] = r.a[i], v[i + 1] = r.a[i + 1];
        else if (SRC == SRC_F32)
            bf16r2(r.a[i], r.a[i + 1], &v[i], &v[i + 1]);
        else
            bf16r2(swiglu1(r.a[i], r.b[i]), swiglu1(r.a[i + 1], r.b[i + 1]), &v[i], &v[i + 1]);
    }
}

/* A warp takes QP consecutive pairs of groups of one row (a run of QP·256 inputs) and issues all
 * their loads before the first reduction, so that enough bytes are in flight to keep the memory
 * busy (one group per warp left it latency-bound). Index arithmetic within a row is 32-bit (K at
 * most 2^30, checked). */
#define QP 2

/* warps per row of L groups (QP pairs a warp), for the kernel and its grid */
static __host__ __device__ __forceinline__ int64_t rows_warps(int64_t L) {
    return ((L + 1) / 2 + QP - 1) / QP;
}

template <int SRC>
static __global__ void quant_rows_kernel(uint8_t *q, float *s, const void *inp, const void *up, int64_t M,
                                         int64_t Mp, int64_t K, int64_t L) {
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int     lane = threadIdx.x & 31, half = lane >> 4;
    const int     LW = (int)rows_warps(L);
    if (warp >= Mp * LW)
        return;
    const int64_t m = warp / LW, row = m * K;
    const int     j0 = (int)(warp % LW) * QP * 2 + half, k_lane = 8 * (lane & 15), Ki = (int)K;
    raw8          raw[QP];
#pragma unroll
    for (int p = 0; p < QP; p++) {
        const int k = (j0 + 2 * p) * KN_FP8_BLOCK + k_lane;
        if (m < M && k < Ki)
            load8<SRC>(inp, up, row + k, &raw[p]);
    }
#pragma unroll
    for (int p = 0; p < QP; p++) {
        const int j = j0 + 2 * p, k = j * KN_FP8_BLOCK + k_lane, on = j < L && k < Ki;
        if (j - half >= L) /* warp-uniform: the pair starts past the row */
            break;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (on && m < M)
            values8<SRC>(raw[p], v);
        float       sc;
        const uint2 packed = fp8_group_quant8(v, on && m < M, &sc);
        if (on)
            *(uint2 *)(q + row + k) = packed;
        if ((lane & 15) == 0 && j < L)
            s[(int64_t)j * Mp + m] = m < M ? sc : 0.0f;
    }
}

// ----------------------------------------------------------------------------
// launchers

/* quant_rows_kernel's grid: one warp per QP pairs of groups of a row, 256 threads a block */
static unsigned rows_grid(int64_t Mp, int64_t L) {
    return (unsigned)((Mp * rows_warps(L) * 32 + 255) / 256);
}

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

cm_status kn_cuda_fp8_quantize_weight(kn_ctx *ctx, uint8_t *q, float *scale, const void *w, cm_dtype wdt,
                                      int64_t N, int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "fp8_quantize_weight: ctx is NULL");
    KN_CUDA_CHECK_ARG(N >= 0 && K >= 0, "fp8_quantize_weight: bad shape N=%lld K=%lld (each must be >= 0)",
                      (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "fp8_quantize_weight: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (N == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && scale && w, "fp8_quantize_weight: q, scale or w is NULL");
    const int64_t nb = (N + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    KN_CUDA_CHECK_ARG(nb < 65536, "fp8_quantize_weight: N=%lld has more than 65535 row blocks", (long long)N);
    dim3 grid((unsigned)L, (unsigned)nb);
    quant_weight_kernel<<<grid, 256, 0, ctx->stream>>>(q, scale, w, wdt == CM_DTYPE_BF16, N, K, kn_fp8_scale_ld(K));
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_fp8_quantize_rows(kn_ctx *ctx, uint8_t *q, float *s, const void *inp, cm_dtype idt, int64_t M,
                                    int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "fp8_quantize_rows: ctx is NULL");
    KN_CUDA_CHECK_ARG(M >= 0 && K >= 0, "fp8_quantize_rows: bad shape M=%lld K=%lld (each must be >= 0)",
                      (long long)M, (long long)K);
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "fp8_quantize_rows: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && s && inp, "fp8_quantize_rows: q, s or inp is NULL");
    KN_CUDA_CHECK_ARG(K <= (1 << 30), "fp8_quantize_rows: K=%lld is too large (at most 2^30)", (long long)K);
    KN_CUDA_CHECK_ARG(K % 16 == 0 && ((uintptr_t)inp % 16) == 0 && ((uintptr_t)q % 16) == 0,
                      "fp8_quantize_rows: K=%lld must be a multiple of 16 and inp, q 16-byte aligned", (long long)K);
    const int64_t Mp = kn_fp8_rows(M), L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    const unsigned grid = rows_grid(Mp, L);
    if (idt == CM_DTYPE_BF16)
        quant_rows_kernel<SRC_BF16><<<grid, 256, 0, ctx->stream>>>(q, s, inp, NULL, M, Mp, K, L);
    else
        quant_rows_kernel<SRC_F32><<<grid, 256, 0, ctx->stream>>>(q, s, inp, NULL, M, Mp, K, L);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_swiglu_fp8(kn_ctx *ctx, uint8_t *q, float *s, const void *gate, const void *up, cm_dtype idt,
                             int64_t M, int64_t I) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu_fp8: ctx is NULL");
    KN_CUDA_CHECK_ARG(M >= 0 && I >= 0, "swiglu_fp8: bad shape M=%lld I=%lld (each must be >= 0)", (long long)M,
                      (long long)I);
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "swiglu_fp8: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || I == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && s && gate && up, "swiglu_fp8: q, s, gate or up is NULL");
    KN_CUDA_CHECK_ARG(I <= (1 << 30), "swiglu_fp8: I=%lld is too large (at most 2^30)", (long long)I);
    KN_CUDA_CHECK_ARG(I % 16 == 0 && ((uintptr_t)gate % 16) == 0 && ((uintptr_t)up % 16) == 0 &&
                          ((uintptr_t)q % 16) == 0,
                      "swiglu_fp8: I=%lld must be a multiple of 16 and gate, up, q 16-byte aligned", (long long)I);
    const int64_t  Mp = kn_fp8_rows(M), L = (I + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    const unsigned grid = rows_grid(Mp, L);
    if (idt == CM_DTYPE_BF16)
        quant_rows_kernel<SRC_SWIGLU16><<<grid, 256, 0, ctx->stream>>>(q, s, gate, up, M, Mp, I, L);
    else
        quant_rows_kernel<SRC_SWIGLU><<<grid, 256, 0, ctx->stream>>>(q, s, gate, up, M, Mp, I, L);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

static cm_status gemm_check(const char *op, int64_t M, int64_t N, int64_t K) {
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0, "%s: bad shape M=%lld N=%lld K=%lld (each must be >= 0)", op,
                      (long long)M, (long long)N, (long long)K);
    KN_CUDA_CHECK_ARG(K % 16 == 0, "%s: K=%lld is not a multiple of 16 (FP8 GEMMs need 16-byte rows)", op,
                      (long long)K);
    if (N % 4)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: N=%lld is not a multiple of 4 (cuBLASLt's block-scaled FP8 needs "
                       "it); keep this weight in bf16",
                       op, (long long)N);
    return CM_OK;
}

/* The product of a quantized input into out (elem bytes per value, C type ct), or added onto it
 * (beta 1); a ragged M (M < Mp) goes through tmp (Mp·N values), which then first receives out's
 * rows when adding. */
static cm_status fp8q_run(kn_ctx *ctx, const char *op, void *out, cudaDataType_t ct, const uint8_t *q,
                          const float *s, const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K,
                          void *tmp, float beta) {
    const int64_t Mp = kn_fp8_rows(M);
    const size_t  elem = ct == CUDA_R_16BF ? 2 : 4;
    if (ctx->fp8_wgmma && ((uintptr_t)q | (uintptr_t)s | (uintptr_t)wq) % 16 == 0 && (uintptr_t)out % 8 == 0 &&
        kn_fp8_wg_available(ctx)) /* TANDEM_FP8_GEMM=wgmma: Tandem's kernel, no ragged copy */
        return kn_fp8_gemm_wg(ctx, out,
                              beta != 0.0f        ? KN_FP8_OUT_ADD
                              : ct == CUDA_R_16BF ? KN_FP8_OUT_BF16
                                                  : KN_FP8_OUT_F32,
                              q, s, wq, wscale, M, N, K, 0);
    if (ct == CUDA_R_16BF && N % 8)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "%s: a BF16 output needs N a multiple of 8 on cuBLASLt (N=%lld); ask for F32", op,
                       (long long)N);
    void         *dst = Mp == M ? out : tmp;
    if (dst != out && beta != 0.0f)
        KN_CUDA(cudaMemcpyAsync(dst, out, (size_t)(M * N) * elem, cudaMemcpyDeviceToDevice, ctx->stream));
    /* outᵀ (N × Mp, ld N) = Wᵀ-op · qᵀ: A = W stored K × N (op T), B = q stored K × Mp */
    CM_TRY(kn_cuda_lt_matmul_fp8(ctx, op, N, Mp, K, wq, wscale, q, s, beta, dst, ct, N));
    if (dst != out) /* rows < M are the first M·N values of the padded product */
        KN_CUDA(cudaMemcpyAsync(out, dst, (size_t)(M * N) * elem, cudaMemcpyDeviceToDevice, ctx->stream));
    return CM_OK;
}

#ifndef TANDEM_HAVE_SM90A /* a build without architecture 90 (kernels/CMakeLists.txt) has no wgmma form */
bool      kn_fp8_wg_available(kn_ctx *) { return false; }
cm_status kn_fp8_gemm_wg(kn_ctx *, void *, int, const uint8_t *, const float *, const uint8_t *, const float *, int64_t,
                         int64_t, int64_t, int) {
    return CM_ERR_UNSUPPORTED;
}
#endif

cm_status kn_cuda_gemm_fp8q(kn_ctx *ctx, void *out, cm_dtype odt, const uint8_t *q, const float *s,
                            const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_fp8q: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8q", M, N, K));
    if (odt != CM_DTYPE_F32 && odt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_fp8q: output dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(odt));
    if (M == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out, "gemm_fp8q: out is NULL");
    const size_t elem = odt == CM_DTYPE_BF16 ? 2 : 4;
    if (K == 0) {
        KN_CUDA(cudaMemsetAsync(out, 0, (size_t)M * (size_t)N * elem, ctx->stream));
        return CM_OK;
    }
    KN_CUDA_CHECK_ARG(q && s && wq && wscale, "gemm_fp8q: q, s, wq or wscale is NULL");
    if (kn_fp8_rows(M) != M)
        CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(kn_fp8_rows(M) * N) * elem));
    return fp8q_run(ctx, "gemm_fp8q", out, odt == CM_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F, q, s, wq, wscale, M, N,
                    K, ctx->scratch, 0.0f);
}

cm_status kn_cuda_gemm_fp8q_acc(kn_ctx *ctx, float *out, const uint8_t *q, const float *s, const uint8_t *wq,
                                const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_fp8q_acc: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8q_acc", M, N, K));
    if (M == 0 || N == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && s && wq && wscale, "gemm_fp8q_acc: out, q, s, wq or wscale is NULL");
    if (kn_fp8_rows(M) != M)
        CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(kn_fp8_rows(M) * N) * sizeof(float)));
    return fp8q_run(ctx, "gemm_fp8q_acc", out, CUDA_R_32F, q, s, wq, wscale, M, N, K, ctx->scratch, 1.0f);
}

cm_status kn_cuda_gemm_fp8(kn_ctx *ctx, float *out, const void *inp, cm_dtype idt, const uint8_t *wq,
                           const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_fp8: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8", M, N, K));
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_fp8: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out, "gemm_fp8: out is NULL");
    if (K == 0) {
        KN_CUDA(cudaMemsetAsync(out, 0, (size_t)M * (size_t)N * sizeof(float), ctx->stream));
        return CM_OK;
    }
    KN_CUDA_CHECK_ARG(inp && wq && wscale, "gemm_fp8: inp, wq or wscale is NULL");
    const int64_t Mp = kn_fp8_rows(M), L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    const size_t  q_bytes = round_up_256((size_t)(Mp * K)), s_bytes = round_up_256((size_t)(L * Mp) * sizeof(float));
    const size_t  o_bytes = Mp == M ? 0 : (size_t)(Mp * N) * sizeof(float);
    CM_TRY(kn_cuda_scratch_reserve(ctx, q_bytes + s_bytes + o_bytes));
    uint8_t *qa = (uint8_t *)ctx->scratch;
    float   *sa = (float *)((char *)ctx->scratch + q_bytes);
    CM_TRY(kn_cuda_fp8_quantize_rows(ctx, qa, sa, inp, idt, M, K));
    return fp8q_run(ctx, "gemm_fp8", out, CUDA_R_32F, qa, sa, wq, wscale, M, N, K,
                    (char *)ctx->scratch + q_bytes + s_bytes, 0.0f);
}

int kn_cuda_fp8_supported(const kn_ctx *ctx, char *why, size_t n) {
    int major = 0, minor = 0;
    if (!ctx || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        major = minor = 0;
    }
    return kn_fp8_support(major, minor, (long)cublasLtGetVersion(), why, n);
}
