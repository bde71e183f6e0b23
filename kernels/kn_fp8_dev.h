/* kernels/kn_fp8_dev.h — the device side of the 1 × 128 input quantization (kn_backend.h,
 * "FP8 block-scaled GEMMs"), shared by the kernels that write an FP8 GEMM's input: the e4m3
 * byte of a value and the quantization of one group by a warp (4 values a lane) or a half warp
 * (8 a lane). The fp32 operations are the cpu reference's, in its order (ref/kn_fp8_ref.c), so
 * bytes and scales equal the cpu's. Internal to kernels/; include from .cu files only. */
#ifndef KN_FP8_DEV_H
#define KN_FP8_DEV_H

#include "kn_backend.h"
#include "kn_device.h"
#include "kn_fp8_quot.h"

#include <cuda_fp8.h>

/* e4m3 ("fn") of v, rounded to nearest even. .satfinite saturates a finite v beyond ±448 to
 * ±448, as the reference's clamp does; a NaN stays NaN (0x7f). */
static __device__ __forceinline__ uint8_t to_e4m3(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

/* e4m3 of lo (low byte) and hi (high byte), as to_e4m3 makes each, in one paired conversion
 * (cvt ...e4m3x2.f32: half the conversions, which share a narrow pipe with SiLU's ex2 and rcp). */
static __device__ __forceinline__ uint32_t to_e4m3x2(float lo, float hi) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

/* The e4m3 bytes of v[0 .. 4·N2) / s, four to a word, low byte first: with r = 1/s rounded
 * once, each quotient by kn_fp8_quot where s is finite, else by division. */
template <int N2>
static __device__ __forceinline__ void fp8_quot_pack(const float *v, float s, uint32_t *out) {
    if (isfinite(s)) {
        const float r = __frcp_rn(s);
#pragma unroll
        for (int i = 0; i < N2; i++)
            out[i] = to_e4m3x2(kn_fp8_quot(v[4 * i], s, r), kn_fp8_quot(v[4 * i + 1], s, r)) |
                     to_e4m3x2(kn_fp8_quot(v[4 * i + 2], s, r), kn_fp8_quot(v[4 * i + 3], s, r)) << 16;
    } else {
#pragma unroll
        for (int i = 0; i < N2; i++) {
            out[i] = 0;
            for (int t = 0; t < 4; t++)
                out[i] |= (uint32_t)to_e4m3(__fdiv_rn(v[4 * i + t], s)) << (8 * t);
        }
    }
}

/* A group's scale from its amax, as the reference makes it: max(amax, 1e-10) · (1/448). */
static __device__ __forceinline__ float fp8_group_scale(float amax) {
    return __fmul_rn(amax > 1e-10f ? amax : 1e-10f, 1.0f / KN_FP8_MAX);
}

/* One group of 128 inputs held by a whole warp, lane l holding inputs 4l .. 4l + 3 as bf16
 * values (zeros for lanes past a ragged end). Every lane gets the group's scale
 * s = max(amax, 1e-10) · (1/448) in *sc; the result is the lane's four e4m3 bytes of v / s,
 * packed low byte first (0 where valid is 0: lanes past the end, padding rows). The bytes are
 * those of the IEEE quotient, reached without a division per value (kn_fp8_quot.h). */
static __device__ __forceinline__ uint32_t fp8_group_quant(const float v[4], int valid, float *sc) {
    const float amax = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
    const float s = fp8_group_scale(amax);
    uint32_t    packed = 0;
    if (valid)
        fp8_quot_pack<1>(v, s, &packed);
    *sc = s;
    return packed;
}

/* fp8_group_quant with the group held by a half warp (lanes 0-15 or 16-31, each its own
 * group), lane holding 8 consecutive inputs: the same bytes and scale, with half the
 * shuffles, reciprocals and stores per value. */
static __device__ __forceinline__ uint2 fp8_group_quant8(const float v[8], int valid, float *sc) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++)
        m = fmaxf(m, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = fp8_group_scale(m);
    uint32_t    packed[2] = {0, 0};
    if (valid)
        fp8_quot_pack<2>(v, s, packed);
    *sc = s;
    return make_uint2(packed[0], packed[1]);
}

#endif /* KN_FP8_DEV_H */
