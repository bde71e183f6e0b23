/* kernels/kn_fill.h — the counter-based uniform generator behind the backends' fill_uniform
 * entry (target-server --init random): value i of a stream is a pure function of (seed, i),
 * computed with integer arithmetic and one exactly rounded conversion, so the cpu and cuda
 * backends produce bit-identical weights and any slice can be generated independently.
 * Compiles as C and as CUDA C++. */
#ifndef KN_FILL_H
#define KN_FILL_H

#include <stdint.h>

#if defined(__CUDACC__)
#define KN_FILL_FN static __host__ __device__ __forceinline__
#else
#define KN_FILL_FN static inline
#endif

/* splitmix64 of seed + (i + 1)·golden: a full-period, well-mixed counter hash. */
KN_FILL_FN uint64_t kn_fill_hash(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* lo + (hi − lo)·u with u = 24 random bits / 2^24 ∈ [0, 1): the product of two 24-bit
 * significands is exact in double, so fused or separate multiply-add round the same way on
 * every machine, and so do the sum's rounding to double and then to float. */
KN_FILL_FN float kn_fill_value(uint64_t seed, uint64_t i, float lo, float hi) {
    double u = (double)(kn_fill_hash(seed, i) >> 40) * (1.0 / 16777216.0);
    return (float)((double)lo + ((double)hi - (double)lo) * u);
}

/* bf16 of a finite float, round to nearest even (as __float2bfloat16_rn). */
KN_FILL_FN uint16_t kn_fill_bf16(float f) {
    union {
        float    f;
        uint32_t u;
    } c;
    c.f = f;
    uint32_t u = c.u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif /* KN_FILL_H */
