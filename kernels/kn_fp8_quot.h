/* kernels/kn_fp8_quot.h — the quotient v / s of the 1 × 128 input quantization without a
 * division per value, for the CUDA quantizers (kn_fp8_dev.h): with r = 1/s rounded once per
 * group, q0 = v·r and one correction, q = q0 + (v − q0·s)·r, both as fused multiply-adds
 * (Markstein's step). The specification stays the IEEE quotient (ref/kn_fp8_ref.c), and what
 * must equal it is the e4m3 byte: for every bf16 v and every finite scale the quantization
 * makes from a bf16 amax ≥ |v| (s = max(amax, 1e-10)·(1/448)), the two bytes are equal;
 * test_kn_fp8_quot checks all 5.3e8 such pairs. The fp32 quotients themselves differ only where
 * the correction term underflows (|v / s| below 2^-71, a 2^-62 part of e4m3's smallest step).
 * Callers divide where s is not finite. Included from C (the test) and CUDA. */
#ifndef KN_FP8_QUOT_H
#define KN_FP8_QUOT_H

#include <math.h>

#ifdef __CUDACC__
#define KN_FP8_QUOT_FN static __host__ __device__ __forceinline__
#else
#define KN_FP8_QUOT_FN static inline
#endif

/* v / s given r = 1/s rounded to nearest (s > 0); worked on |v| and given v's sign, so that
 * -0 stays -0 as in the division */
KN_FP8_QUOT_FN float kn_fp8_quot(float v, float s, float r) {
    const float a = fabsf(v);
#ifdef __CUDA_ARCH__
    const float q0 = __fmul_rn(a, r);
    return copysignf(__fmaf_rn(__fmaf_rn(-q0, s, a), r, q0), v);
#else
    const float q0 = a * r;
    return copysignf(fmaf(fmaf(-q0, s, a), r, q0), v);
#endif
}

#endif /* KN_FP8_QUOT_H */
