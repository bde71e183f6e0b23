/* kernels/kn_device.h — the device helpers that several kernel files share: cp.async copies
 * global → shared (sm_80+), warp and block sums, the sequence lookup in a cu_seqlens table, and
 * fp32/bf16 loads and stores of typed storage, one element or four at a time. Internal to
 * kernels/; include from .cu files only. Every function is static (or a template), so each
 * file gets its own inlined copy and
 * the generated code is the code of the place that calls it. */
#ifndef KN_DEVICE_H
#define KN_DEVICE_H

#include <cuda_bf16.h>
#include <stdint.h>

// ----------------------------------------------------------------------------
// cp.async (PTX ISA, sm_80+)

static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global → shared, asynchronous; src_bytes (0 or 16) of them are read from gmem and
 * the rest written as zeros, so src_bytes 0 (rows past the end) reads nothing. */
static __device__ __forceinline__ void cp_async16_n(void *smem, const void *gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(src_bytes));
}
static __device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
/* Waits until at most N committed cp.async groups are still in flight. */
template <int N> static __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ----------------------------------------------------------------------------
// SiLU

/* silu(x) = x / (1 + e^-x), the one form every CUDA kernel of the forward uses (SwiGLU, the
 * MoE experts' epilogues, the GDN conv, the gated norm), so that fused and unfused forms give
 * the same bits. The exponential is ex2.approx (__expf) and the division the reciprocal's
 * product (__fdividef): the accurate expf and the IEEE division made SwiGLU with its FP8
 * quantization bound by instructions, not memory (bench/results/silu-conv-2026-12-04.md). The
 * error against the cpu reference's expf and division is __expf's, 2 + 1.2·|x| ulp where
 * e^-x dominates, plus 2 ulp; where 1 + e^-x passes 2^126 (x < -87.3) the result is ±0
 * instead of a value below 1e-36. */
static __device__ __forceinline__ float kn_silu(float x) {
    return __fdividef(x, 1.0f + __expf(-x));
}

// ----------------------------------------------------------------------------
// reductions

/* Sum over the warp by butterfly shuffles; every lane gets the total. */
template <typename T> static __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the total. sh
 * holds 32 values; the leading barrier makes back-to-back calls safe. */
template <typename T> static __device__ T block_sum(T v, T *sh) {
    v = warp_sum(v);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? sh[lane] : (T)0;
    return warp_sum(v);
}

/* Inclusive prefix sum of x over the threads of a block of 1024 (thread order), by shuffles
 * within each warp and then over the warps' sums; *total gets the block's sum. sh holds 32
 * values. */
static __device__ int32_t block_incl_scan_1024(int32_t x, int32_t *sh, int32_t *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int32_t ws = sh[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t y = __shfl_up_sync(0xffffffffu, ws, o);
            if (lane >= o)
                ws += y;
        }
        sh[lane] = ws;
    }
    __syncthreads();
    *total = sh[31];
    return x + (warp ? sh[warp - 1] : 0);
}

// ----------------------------------------------------------------------------
// packed sequences

/* Index of the sequence holding token t: the last s with cu[s] <= t (0 if none). */
static __device__ __forceinline__ int seq_of(const int32_t *cu, int n_seq, int64_t t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Start of the sequence holding token t, clamped into [0, t] so that a bad table cannot cause
 * a wild read. */
static __device__ __forceinline__ int64_t seq_start(const int32_t *cu, int n_seq, int64_t t) {
    int64_t bos = cu[seq_of(cu, n_seq, t)];
    return bos < 0 ? 0 : (bos > t ? t : bos);
}

// ----------------------------------------------------------------------------
// padded bf16 copies

/* x [rows, n] fp32 (times scale when SCALED) → dst [rows, P] bf16, zero past n (P a multiple of
 * 8): tile operands whose rows are whole 16-byte vectors. One thread per 8 outputs, grid-stride. */
template <bool SCALED>
static __device__ __forceinline__ void to_bf16_padded(__nv_bfloat16 *dst, const float *x, int64_t rows, int n,
                                                      int P, float scale) {
    const int64_t nvec = rows * (P / 8), stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const int64_t               r = i / (P / 8);
        const int                   c0 = (int)(i % (P / 8)) * 8;
        __align__(16) __nv_bfloat16 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = __float2bfloat16(c0 + j < n ? (SCALED ? x[r * n + c0 + j] * scale : x[r * n + c0 + j])
                                               : 0.0f);
        *(uint4 *)(dst + r * P + c0) = *(const uint4 *)v;
    }
}

// ----------------------------------------------------------------------------
// typed storage: element i of an F32 (bf == 0) or BF16 (bf != 0) array, as fp32

static __device__ __forceinline__ float ld_f(const void *p, int bf, int64_t i) {
    return bf ? __uint_as_float((unsigned int)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

static __device__ __forceinline__ void st_f(void *p, int bf, int64_t i, float v) {
    if (bf)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else
        ((float *)p)[i] = v;
}

// ----------------------------------------------------------------------------
// packed bf16: two in a 32-bit word, four in 8 bytes, in memory order

/* lo and hi rounded to bf16 (nearest even), lo in the low half (the lower address). */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low half) = lo */
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Four bf16 as loaded from 8 bytes, widened exactly. */
static __device__ __forceinline__ float4 bf16x4_to_f4(uint2 u) {
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

/* Four floats each rounded once to bf16, ready for one 8-byte store. */
static __device__ __forceinline__ uint2 f4_to_bf16x4(float4 v) {
    return make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}

/* Group i of four elements (bytes 8i.. of BF16 storage), widened; and four values stored there. */
static __device__ __forceinline__ float4 ld_bf16x4(const void *p, int64_t i) {
    return bf16x4_to_f4(((const uint2 *)p)[i]);
}
static __device__ __forceinline__ void st_bf16x4(void *p, int64_t i, float4 v) {
    ((uint2 *)p)[i] = f4_to_bf16x4(v);
}

/* Group i of four elements of F32 (bf == 0: bytes 16i..) or BF16 storage (bytes 8i..), as fp32:
 * ld_f four at a time. */
static __device__ __forceinline__ float4 ld_f4(const void *p, int bf, int64_t i) {
    return bf ? ld_bf16x4(p, i) : ((const float4 *)p)[i];
}

/* Four consecutive elements of F32 (BF false) or BF16 storage held in registers as loaded: the
 * bf16 kept packed (half the registers while a row is held) and widened where used; set stores
 * a value's bf16 rounding in the BF16 form. Group i is bytes 16i.. (F32) or 8i.. (BF16). */
template <bool BF> struct kn_typed4;
template <> struct kn_typed4<false> {
    float4                            v;
    __device__ __forceinline__ void   load(const void *p, int64_t i) { v = ((const float4 *)p)[i]; }
    __device__ __forceinline__ float4 get() const { return v; }
    __device__ __forceinline__ void   set(float4 f) { v = f; }
};
template <> struct kn_typed4<true> {
    uint2                             v;
    __device__ __forceinline__ void   load(const void *p, int64_t i) { v = ((const uint2 *)p)[i]; }
    __device__ __forceinline__ float4 get() const { return bf16x4_to_f4(v); }
    __device__ __forceinline__ void   set(float4 f) { v = f4_to_bf16x4(f); }
};

#endif /* KN_DEVICE_H */
