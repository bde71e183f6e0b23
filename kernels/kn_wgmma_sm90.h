/* kernels/kn_wgmma_sm90.h — Hopper's warpgroup MMA (PTX ISA 8.0, sm_90a only) for the kernels of
 * kn_*_sm90a.cu: the shared-memory descriptor of the 128-byte swizzle, the fence / commit / wait
 * instructions, the bf16 and e4m3 wgmma shapes they use and stmatrix. Internal to kernels/;
 * include from kn_*_sm90a.cu files only (wgmma does not exist on other architectures). Every
 * function is static, so each file gets its own copy.
 *
 * Operands in shared memory are K-major in the 128-byte swizzle: a row holds 64 bf16 or 128 e4m3
 * (128 bytes) of K, 16-byte chunk c of row r sits at chunk c ^ (r mod 8), each 8-row group is
 * 1024 bytes and 1024-aligned. An accumulator d of an m64nN shape holds, per warp w of the warpgroup (rows
 * 16w .. 16w + 15), lane g = lane / 4, t = lane % 4: d[4i + 2h + j] is row g + 8h, column
 * 8i + 2t + j (mma.sync's C fragment for each 8 columns). */
#ifndef KN_WGMMA_SM90_H
#define KN_WGMMA_SM90_H

#include <stdint.h>

#include "kn_mma_sm80.h"

/* The descriptor of a K-major operand in the 128-byte swizzle: start address / 16, leading
 * offset 1 (unused by this layout), stride 1024 bytes between 8-row groups, layout type 1
 * (128B swizzle). Adding 2 moves the start 32 bytes: the next 16 of K within the row. */
static __device__ __forceinline__ uint64_t wg_desc(const void *p) {
    const uint64_t a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* The descriptor of an MN-major operand (the transpose-B forms, 16-bit types only) in the same
 * 128-byte swizzle: rows of the tile run along K, each holding 64 bf16 of N; 8-row groups 1024
 * bytes apart, and 64-wide blocks of N `lbo` bytes apart. So a [k][n] tile stored like a K-major
 * one is read transposed: Q and dO [row][d], the B of S = K·Qᵀ, are also the B of dK = dSᵀ·Q.
 * Adding 128 moves the start 16 rows of K. */
static __device__ __forceinline__ uint64_t wg_desc_mn(const void *p, uint32_t lbo) {
    const uint64_t a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}

static __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
/* Until at most N committed groups of this warpgroup are still running. */
template <int N> static __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Shared memory written through the generic proxy (stores, cp.async) before wgmma reads it
 * through the async proxy. */
static __device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* Four 8 × 8 bf16 matrices from registers to shared memory (sm_90): register i holds matrix i's
 * row lane / 4, columns 2·(lane % 4) and + 1 (mma.sync's fragment), lanes 8i .. 8i + 7 give the
 * addresses of its rows. After ldmatrix .trans of a block this stores the block transposed. */
static __device__ __forceinline__ void stsm_x4(void *p, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(p)), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

/* After wgmma.wait_group: ties the accumulator's registers to this point, so that the compiler
 * does not move their reads above the wait (the asm above writes them only as far as it knows). */
template <int N> static __device__ __forceinline__ void wg_fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* The byte offset of 16-byte chunk c (of 8 per row) of row r in a 128-byte swizzled tile. */
static __device__ __forceinline__ int wg_swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

/* The accumulator operands of an m64nN wgmma (N / 2 floats per thread), for the asm below and
 * the shapes a kernel file keeps to itself. */
#define WG_D32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D64 \
    WG_D32, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_D128 \
    WG_D64, \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

/* d[32] = (acc ? d : 0) + A (64 × 16, K-major, descriptor da) · B (64 × 16, K-major, db)ᵀ. */
static __device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32
                 : "l"(da), "l"(db), "r"(acc));
}

/* d[32] = (acc ? d : 0) + A (64 × 16 in registers: a as mma.sync's A fragment of each warp's 16
 * rows) · B (64 × 16, K-major, db)ᵀ. a must not change until the wgmma has been waited for.
 * TB = 1 reads B MN-major instead (db from wg_desc_mn: B is 16 × 64, stored k-row by k-row). */
template <int TB = 0>
static __device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                                          int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, "
                 "1, 1, %38;\n}\n"
                 : WG_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

/* d[64] = (acc ? d : 0) + A (64 × 16 in registers: a as mma.sync's A fragment of each warp's 16
 * rows) · B (128 × 16, K-major, db)ᵀ. a must not change until the wgmma has been waited for.
 * TB = 1 reads B MN-major instead (db from wg_desc_mn). */
template <int TB = 0>
static __device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                           uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
                 "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
                 "%56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : WG_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

/* d[128] = (acc ? d : 0) + A (64 × 16 in registers: a as mma.sync's A fragment of each warp's 16
 * rows) · B (256 × 16, K-major, db)ᵀ. a must not change until the wgmma has been waited for. */
static __device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db,
                                                          int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
                 : WG_D128
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

/* d[64] = (acc ? d : 0) + A (64 × 32 e4m3, K-major) · B (128 × 32 e4m3, K-major)ᵀ; d's layout as above.
 * (FP8 wgmma reads K-major operands only: no transpose operands.) */
static __device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
                 : WG_D64
                 : "l"(da), "l"(db), "r"(acc));
}

/* d += a with its rows scaled: rows g (d[4i], d[4i + 1]) by fa, rows g + 8 (d[4i + 2], d[4i + 3])
 * by fb, one fmaf each. The promotion of a block-scaled FP8 group's m64n128 products into the fp32
 * sums (the MoE and the dense FP8 kernels). */
static __device__ __forceinline__ void wg_scale_add(float (&d)[64], const float (&a)[64], float fa,
                                                    float fb) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
        d[4 * i]     = fmaf(a[4 * i], fa, d[4 * i]);
        d[4 * i + 1] = fmaf(a[4 * i + 1], fa, d[4 * i + 1]);
        d[4 * i + 2] = fmaf(a[4 * i + 2], fb, d[4 * i + 2]);
        d[4 * i + 3] = fmaf(a[4 * i + 3], fb, d[4 * i + 3]);
    }
}

#endif /* KN_WGMMA_SM90_H */
