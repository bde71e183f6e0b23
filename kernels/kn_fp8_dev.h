/* kernels/kn_fp8_dev.h — the device side of the 1 × 128 input quantization (kn_backend.h,
 * "FP8 block-scaled GEMMs"), shared by the kernels that write an FP8 GEMM's input: the e4m3
 * byte of a value and one warp's quantization of one group. The fp32 operations are the cpu
 * reference's, in its order (ref/kn_fp8_ref.c), so bytes and scales equal the cpu's. Internal
 * to kernels/; include from .cu files only. */
#ifndef KN_FP8_DEV_H
#define KN_FP8_DEV_H

#include "kn_backend.h"
#include "kn_device.h"
#include "kn_fp8_quot.h"

#include <cuda_fp8.h>

/* e4m3 ("fn") of v: clamped to ±448, rounded to nearest even. */
static __device__ __forceinline__ uint8_t to_e4m3(float v) {
    v = fminf(fmaxf(v, -KN_FP8_MAX), KN_FP8_MAX);
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

/* e4m3 of lo (low byte) and hi (high byte), as to_e4m3 makes each, in one paired conversion
 * (cvt ...e4m3x2.f32: half the conversions, which share a narrow pipe with SiLU's ex2 and rcp). */
static __device__ __forceinline__ uint32_t to_e4m3x2(float lo, float hi) {
    lo = fminf(fmaxf(lo, -KN_FP8_MAX), KN_FP8_MAX);
    hi = fminf(fmaxf(hi, -KN_FP8_MAX), KN_FP8_MAX);
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

/* One group of 128 inputs held by a whole warp, lane l holding inputs 4l .. 4l + 3 as bf16
 * values (zeros for lanes past a ragged end). Every lane gets the group's scale
 * s = max(amax, 1e-10) · (1/448) in *sc; the result is the lane's four e4m3 bytes of v / s,
 * packed low byte first (0 where valid is 0: lanes past the end, padding rows). The bytes are
 * those of the IEEE quotient, reached without a division per value (kn_fp8_quot.h). */
static __device__ __forceinline__ uint32_t fp8_group_quant(const float v[4], int valid, float *sc) {
    const float amax = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
    const float s = __fmul_rn(amax > 1e-10f ? amax : 1e-10f, 1.0f / KN_FP8_MAX);
    uint32_t    packed = 0;
    if (valid && isfinite(s)) { /* one rounded reciprocal per group, the quotients by kn_fp8_quot */
        const float r = __frcp_rn(s);
        packed = to_e4m3x2(kn_fp8_quot(v[0], s, r), kn_fp8_quot(v[1], s, r)) |
                 to_e4m3x2(kn_fp8_quot(v[2], s, r), kn_fp8_quot(v[3], s, r)) << 16;
    } else if (valid) {
        for (int t = 0; t < 4; t++)
            packed |= (uint32_t)to_e4m3(__fdiv_rn(v[t], s)) << (8 * t);
    }
    *sc = s;
    return packed;
}

#endif /* KN_FP8_DEV_H */
