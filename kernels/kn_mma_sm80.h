/* kernels/kn_mma_sm80.h — the warp-level tensor-core helpers shared by the FlashAttention-2
 * style kernels (kn_dflash_attn_mma.cu, the drafter's attention; kn_attention_mma.cu, the
 * target's) and the chunked delta rule (kn_gdn_chunk.cu, kn_gdn_state.cu): ldmatrix and
 * mma.sync m16n8k16 on bf16 with fp32 accumulation, all sm_80+ (Ampere, Hopper, Blackwell
 * alike; no wgmma); cp.async comes from kn_device.h. Internal to kernels/; include from .cu
 * files only. Every function is static, so each file gets its own copy. */
#ifndef KN_MMA_SM80_H
#define KN_MMA_SM80_H

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "kn_device.h"

typedef __nv_bfloat16 bf16;

// ----------------------------------------------------------------------------
// ldmatrix and mma (PTX ISA; cp.async is in kn_device.h; mma.m16n8k16 .bf16 with g = lane / 4, t = lane % 4:
//   A 16×16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16×8:            b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C 16×8 fp32:       c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1))

/* 16 bytes global → shared, or 16 zero bytes when !valid (src is then not read). */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    cp_async16_n(dst, src, valid ? 16 : 0);
}

static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* A fragment: the 16×16 block of M (row-major, ld) at rows r0.., cols c0... The _l forms take
 * the lane (threadIdx.x % 32) from a caller that has it at hand; the others compute it. */
static __device__ __forceinline__ void frag_a_l(uint32_t a[4], const bf16 *M, int ld, int r0, int c0, int l) {
    ldsm_x4(a, M + (r0 + (l & 15)) * ld + c0 + (l >> 4) * 8);
}
static __device__ __forceinline__ void frag_a(uint32_t a[4], const bf16 *M, int ld, int r0, int c0) {
    frag_a_l(a, M, ld, r0, c0, threadIdx.x % 32);
}

/* B fragments of two adjacent n tiles (n0.., n0 + 8..) at k0.. with B[k][n] = M[n][k]
 * (M stored n-major: Kᵀ from K [key][d], Wᵀ from W [token][·]): {r[0], r[1]} for n0,
 * {r[2], r[3]} for n0 + 8. */
static __device__ __forceinline__ void frag_b_nk_l(uint32_t r[4], const bf16 *M, int ld, int n0, int k0, int l) {
    ldsm_x4(r, M + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8);
}
static __device__ __forceinline__ void frag_b_nk(uint32_t r[4], const bf16 *M, int ld, int n0, int k0) {
    frag_b_nk_l(r, M, ld, n0, k0, threadIdx.x % 32);
}

/* The same with B[k][n] = M[k][n] (M stored k-major: V [key][d] for P·V, K [token][dk]). */
static __device__ __forceinline__ void frag_b_kn_l(uint32_t r[4], const bf16 *M, int ld, int k0, int n0, int l) {
    ldsm_x4_t(r, M + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8);
}
static __device__ __forceinline__ void frag_b_kn(uint32_t r[4], const bf16 *M, int ld, int k0, int n0) {
    frag_b_kn_l(r, M, ld, k0, n0, threadIdx.x % 32);
}

/* The C accumulators of two adjacent 16×8 tiles (columns 0..7 and 8..15 of a k16 step) as
 * the A fragment of the next product: P·V, dS·K, Pᵀ·dO, dSᵀ·Q. */
static __device__ __forceinline__ void c_to_a(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

/* The running-softmax rescale of an output accumulator: rows g (c0, c1) times corr[0], rows
 * g + 8 (c2, c3) times corr[1]. */
template <int NT> static __device__ __forceinline__ void scale_rows(float (&o)[NT][4], const float corr[2]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        o[nt][0] *= corr[0];
        o[nt][1] *= corr[0];
        o[nt][2] *= corr[1];
        o[nt][3] *= corr[1];
    }
}

/* acc += P · M for one tile of KT keys: P is the tile's C fragments s (KT / 8 of them, as the
 * Q·Kᵀ product left them) rounded to bf16 as A fragments, M [key][d] k-major in shared memory
 * (ld), NT output tiles of 8 columns: O += P·V in a forward, dQ += dS·K in a backward. */
template <int NT, int KT>
static __device__ __forceinline__ void mma_tile_kn(float (&acc)[NT][4], const float (&s)[KT / 8][4],
                                                   const bf16 *M, int ld) {
#pragma unroll
    for (int kk = 0; kk < KT / 16; kk++) {
        uint32_t a[4];
        c_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            frag_b_kn(b, M, ld, kk * 16, np * 16);
            mma_bf16(acc[2 * np], a, b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* 2^x on the special-function unit alone (ex2.approx.ftz): where exp2f would return a subnormal
 * (x < -126) this returns 0, and 2^-inf is 0. Softmax weights are summed with a 1 (the row's
 * maximum), so the difference lies far below any fp32 or bf16 step of what they feed. */
static __device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
static __device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* The online softmax of a tile over this lane's two rows (base 2; quads share a row): mx holds
 * the lane's maxima of the tile's scores and becomes the rows' new running maxima; corr gets the
 * factor for what was summed before (1 while a row has seen nothing but -inf). */
static __device__ __forceinline__ void softmax_new_max(const float m[2], float mx[2], float corr[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float m_new = fmaxf(m[r], quad_max(mx[r]));
        corr[r] = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new); /* 0 when m was -inf */
        mx[r] = m_new;
    }
}

/* ... and once the tile's exponents (relative to mx) are summed per lane in sum: l rescaled and
 * added to, m moved to the new maxima. */
static __device__ __forceinline__ void softmax_fold(float m[2], float l[2], const float mx[2], const float sum[2],
                                                    const float corr[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] = l[r] * corr[r] + quad_sum(sum[r]);
        m[r] = mx[r];
    }
}

#endif /* KN_MMA_SM80_H */
