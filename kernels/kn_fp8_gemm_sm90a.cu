/* kernels/kn_fp8_gemm_sm90a.cu — the dense block-scaled FP8 product (gemm_fp8q, gemm_fp8q_acc)
 * on Hopper's warpgroup MMA, fed by the tensor memory accelerator. Compiled for sm_90a only, into
 * the kn_sm90a object (kernels/CMakeLists.txt); kn_fp8.cu calls in here with TANDEM_FP8_GEMM=wgmma
 * on a GPU of compute capability 9.0 (kn_fp8_int.h), and runs cuBLASLt's block-scaled product
 * otherwise. The specification is kn_ref_gemm_fp8q (ref/kn_fp8_ref.c): out[m, n] =
 * Σ_b s[b, m] · ws[n / 128, b] · Σ_{k in group b} q[m, k] · wq[n, k], each group's inner sum in
 * the tensor core, the groups summed in fp32 in order of b. On an H200 its results equal
 * cuBLASLt's bit for bit (test_kn_fp8), but it runs at 0.76-0.90 of cuBLASLt's speed at the 27B
 * shapes (about 1,000-1,060 TF/s against 1,100-1,270; bench_kn_fp8), so cuBLASLt stays the
 * default: a base for a faster kernel, measured beside cuBLASLt in every bench run.
 *
 * A persistent kernel: one CTA per SM walks output tiles of 128 rows × BN columns (BN = 256 by
 * default, 128 the other form), in groups of FG_GROUP_M row tiles so that the tiles in flight
 * share their weight tiles in L2. Per 128 of K a tile needs its input rows (16 KB of e4m3), its
 * weight rows (BN · 128 bytes) and the rows' 128 input scales of that group. The wider tile reads
 * 25 % fewer bytes from L2 per product and is 5-10 % faster (bench_kn_fp8).
 *
 * Warpgroup 2 is the producer: one thread waits for a free stage of the ring, then issues the
 * stage's three TMA loads onto its full barrier (input and weight tiles in the 128-byte swizzle
 * wgmma reads). Warpgroups 0 and 1 are the consumers, 64 rows each. Per stage and 128 columns
 * of the tile: four wgmma.m64n128k32 (e4m3) into a fresh accumulator, wait, then add it into the
 * tile's fp32 sum scaled by the row's input scale times that column block's weight scale; after
 * the last column block each warp releases the stage (one arrival on its empty barrier). While
 * one warpgroup scales, the other's products run. The sums need 64 · BN / 128 + 64 registers per
 * thread, which setmaxnreg moves from the producer to the consumers. The epilogue stores from
 * registers: F32, BF16 (rounded to nearest even once), or F32 added onto out (gemm_fp8q_acc); the
 * producer meanwhile loads the next tile. Rows past M (the padding rows of kn_fp8_rows) and
 * columns past N are not written; the TMA fills operands past the edges with zeros. */
#include <cuda.h> /* CUtensorMap */
#include <cudaTypedefs.h>

#include "kn_cuda.h"
#include "kn_device.h"
#include "kn_fp8_int.h"
#include "kn_wgmma_sm90.h"

#define FG_BM      128 /* rows per tile: two consumer warpgroups of 64 */
#define FG_BK      128 /* e4m3 per stage: one 128-byte swizzle row, one scale group */
#define FG_THREADS 384 /* two consumer warpgroups and the producer warpgroup */
#define FG_ATILE   (FG_BM * FG_BK)
#define FG_GROUP_M 16 /* row tiles walked together (L2 reuse of the weight tiles) */

/* The layout of a form: BN columns per tile, the ring's stages (as many as fit beside the
 * barriers), per stage the input tile, the weight tile and the input scales (in 1024 bytes, so
 * that every stage starts 1024-aligned as the swizzle needs); + 1024 for the ring's alignment. */
template <int BN> struct fg_form {
    static constexpr int    stage = FG_ATILE + BN * FG_BK + 1024;
    static constexpr int    stages = BN == 256 ? 4 : 6;
    static constexpr size_t smem = (size_t)stages * stage + 2 * stages * 8 + 1024;
};

// ----------------------------------------------------------------------------
// barriers and TMA (PTX ISA 8.0)

static __device__ __forceinline__ void mbar_init(uint64_t *b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(uint64_t *b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
/* Until the phase of the given parity has completed. */
static __device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nFG_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra FG_WAIT;\n}\n" ::"r"(smem_u32(b)),
                 "r"(parity)
                 : "memory");
}
/* The box at (x, y) (x the contiguous coordinate) of map into dst, completing on bar. */
static __device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int x,
                                                   int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(smem_u32(dst)),
        "l"((uint64_t)map), "r"(x), "r"(y), "r"(smem_u32(bar))
        : "memory");
}

/* Tile t of the walk: FG_GROUP_M row tiles (fewer in the last group) times every column tile,
 * rows fastest. */
static __device__ __forceinline__ void fg_tile(int t, int mt, int nt, int &mb, int &nb) {
    const int per = FG_GROUP_M * nt, grp = t / per, first = grp * FG_GROUP_M;
    const int gm = min(FG_GROUP_M, mt - first), r = t - grp * per;
    mb = first + r % gm;
    nb = r / gm;
}

/* The four products (K 128) of warpgroup wg's 64 rows of the input tile at st and the 128 weight
 * rows at wb into a fresh accumulator a. */
static __device__ __forceinline__ void fg_issue(float (&a)[64], const unsigned char *st,
                                                const unsigned char *wb, int wg) {
    const uint64_t da = wg_desc(st + wg * 64 * FG_BK), db = wg_desc(wb);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < FG_BK / 32; kk++)
        wgmma_m64n128k32_e4m3(a, da + 2 * kk, db + 2 * kk, kk);
    wg_commit();
}

// ----------------------------------------------------------------------------
// kernel

template <int MODE, int BN> /* MODE: KN_FP8_OUT_F32, _BF16 or _ADD */
static __global__ void __launch_bounds__(FG_THREADS, 1)
    fp8_gemm_wg_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                       const __grid_constant__ CUtensorMap tm_s, void *out, const float *ws, int M, int N,
                       int K, int ldw, int mt, int nt) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using F = fg_form<BN>;
    constexpr int NH = BN / 128; /* column blocks of 128 per tile, each its own weight scale */
    extern __shared__ unsigned char fg_raw[];
    unsigned char                  *ring = (unsigned char *)(((uintptr_t)fg_raw + 1023) & ~(uintptr_t)1023);
    uint64_t *full = (uint64_t *)(ring + F::stages * F::stage), *empty = full + F::stages;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kt = (K + FG_BK - 1) / FG_BK, tiles = mt * nt, wblocks = (N + 127) / 128;
    if (tid == 0) {
        for (int s = 0; s < F::stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8); /* one arrival per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp >= 8) { /* the producer warpgroup: one thread issues, the registers go to the consumers */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (warp == 8 && lane == 0) {
            int      s = 0;
            unsigned ph = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int mb, nb;
                fg_tile(t, mt, nt, mb, nb);
                for (int k = 0; k < kt; k++) {
                    mbar_wait(&empty[s], ph ^ 1);
                    mbar_expect_tx(&full[s],
                                   FG_ATILE + BN * FG_BK + FG_BM * 4); /* the bytes the three loads bring */
                    unsigned char *st = ring + s * F::stage;
                    tma_load_2d(st, &tm_a, &full[s], k * FG_BK, mb * FG_BM);
                    tma_load_2d(st + FG_ATILE, &tm_b, &full[s], k * FG_BK, nb * BN);
                    tma_load_2d(st + FG_ATILE + BN * FG_BK, &tm_s, &full[s], mb * FG_BM, k);
                    if (++s == F::stages) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    /* the consumers: warpgroup wg holds rows 64 wg .. + 63; this thread rows rl and rl + 8 */
    const int wg = warp >> 2, g = lane >> 2, t4 = lane & 3, rl = wg * 64 + (warp & 3) * 16 + g;
    int       s = 0;
    unsigned  ph = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int mb, nb;
        fg_tile(t, mt, nt, mb, nb);
        const float *wsr[NH];
#pragma unroll
        for (int h = 0; h < NH; h++) /* a block past N has zero weights: any finite scale */
            wsr[h] = ws + (int64_t)min(nb * NH + h, wblocks - 1) * ldw;
        float d[NH][64], acc[64];
#pragma unroll
        for (int h = 0; h < NH; h++)
#pragma unroll
            for (int i = 0; i < 64; i++)
                d[h][i] = 0.0f;
        for (int k = 0; k < kt; k++) {
            float sw[NH];
#pragma unroll
            for (int h = 0; h < NH; h++)
                sw[h] = __ldg(wsr[h] + k);
            mbar_wait(&full[s], ph);
            const unsigned char *st = ring + s * F::stage;
            const float         *sa = (const float *)(st + FG_ATILE + BN * FG_BK);
            const float          fa = sa[rl], fb = sa[rl + 8];
#pragma unroll
            for (int h = 0; h < NH; h++) {
                fg_issue(acc, st, st + FG_ATILE + h * 128 * FG_BK, wg);
                wg_wait<0>();
                wg_fence_operands(acc);
                if (h == NH - 1) { /* this warp is done with the stage */
                    __syncwarp();
                    if (lane == 0)
                        mbar_arrive(&empty[s]);
                }
                wg_scale_add(d[h], acc, fa * sw[h], fb * sw[h]);
            }
            if (++s == F::stages) {
                s = 0;
                ph ^= 1;
            }
        }

        /* the epilogue: N is a multiple of 4 (gemm_fp8q's check), so pairs never straddle it */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = mb * FG_BM + rl + 8 * h;
            if (r >= M)
                continue;
#pragma unroll
            for (int j = 0; j < NH; j++)
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int c = nb * BN + j * 128 + 8 * i + 2 * t4;
                    if (c >= N)
                        continue;
                    const float   v0 = d[j][4 * i + 2 * h], v1 = d[j][4 * i + 2 * h + 1];
                    const int64_t o = (int64_t)r * N + c;
                    if (MODE == KN_FP8_OUT_BF16) {
                        *(__nv_bfloat162 *)((bf16 *)out + o) = __floats2bfloat162_rn(v0, v1);
                    } else if (MODE == KN_FP8_OUT_ADD) {
                        float2 *p = (float2 *)((float *)out + o), x = *p;
                        *p = make_float2(x.x + v0, x.y + v1);
                    } else {
                        *(float2 *)((float *)out + o) = make_float2(v0, v1);
                    }
                }
        }
    }
#else
    __trap(); /* built without sm_90a code: kn_fp8_wg_available said no */
#endif
}

// ----------------------------------------------------------------------------
// launcher (kn_fp8_int.h)

typedef PFN_cuTensorMapEncodeTiled_v12000 fg_encode_fn;

static fg_encode_fn fg_encoder(void) {
    static const fg_encode_fn fn = [] {
        void                           *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            p = NULL;
        }
        return (fg_encode_fn)p;
    }();
    return fn;
}

/* A row-major [rows, cols] operand of elem-byte values (row stride ld values) as a tensor map of
 * boxes box_c × box_r. */
static cm_status fg_map(CUtensorMap *m, const void *p, CUtensorMapDataType dt, int elem, int64_t rows,
                        int64_t cols, int64_t ld, int box_c, int box_r, CUtensorMapSwizzle swz) {
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)(ld * elem)};
    const cuuint32_t box[2] = {(cuuint32_t)box_c, (cuuint32_t)box_r}, one[2] = {1, 1};
    const CUresult   r =
        fg_encoder()(m, dt, 2, (void *)p, dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE, swz,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return CM_FAIL(CM_ERR_CUDA, "gemm_fp8q: cuTensorMapEncodeTiled failed (%d) for a %lld x %lld operand",
                       (int)r, (long long)rows, (long long)cols);
    return CM_OK;
}

bool kn_fp8_wg_available(kn_ctx *ctx) {
    int major = 0, minor = 0, optin = 0;
    if (!fg_encoder() ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return major == 9 && minor == 0 && fg_form<256>::smem <= (size_t)optin &&
           fg_form<128>::smem <= (size_t)optin;
}

/* The forms built: columns per tile; kn_fp8_gemm_wg's cfg indexes this, 0 the default. */
static const int fg_cfg[KN_FP8_WG_CONFIGS] = {256, 128};

template <int MODE, int BN>
static cm_status fg_launch(kn_ctx *ctx, const CUtensorMap *a, const CUtensorMap *b, const CUtensorMap *s,
                           void *out, const float *ws, int M, int N, int K, int ldw, int mt, int nt) {
    auto kern = fp8_gemm_wg_kernel<MODE, BN>;
    int  sms = 0;
    KN_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->device));
    KN_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fg_form<BN>::smem));
    const int tiles = mt * nt, grid = tiles < sms ? tiles : sms; /* one CTA per SM */
    kern<<<grid, FG_THREADS, fg_form<BN>::smem, ctx->stream>>>(*a, *b, *s, out, ws, M, N, K, ldw, mt, nt);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int MODE>
static cm_status fg_launch_cfg(kn_ctx *ctx, int bn, const CUtensorMap *a, const CUtensorMap *b,
                               const CUtensorMap *s, void *out, const float *ws, int M, int N, int K, int ldw,
                               int mt, int nt) {
    if (bn == 128)
        return fg_launch<MODE, 128>(ctx, a, b, s, out, ws, M, N, K, ldw, mt, nt);
    return fg_launch<MODE, 256>(ctx, a, b, s, out, ws, M, N, K, ldw, mt, nt);
}

cm_status kn_fp8_gemm_wg(kn_ctx *ctx, void *out, int mode, const uint8_t *q, const float *s,
                         const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K, int cfg) {
    const int64_t Mp = kn_fp8_rows(M), L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    KN_CUDA_CHECK_ARG(Mp <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                      "gemm_fp8q: M=%lld N=%lld K=%lld exceed the kernel's 32-bit indices", (long long)M,
                      (long long)N, (long long)K);
    KN_CUDA_CHECK_ARG(cfg >= 0 && cfg < KN_FP8_WG_CONFIGS, "gemm_fp8q: no wgmma configuration %d (0..%d)",
                      cfg, KN_FP8_WG_CONFIGS - 1);
    const int   bn = fg_cfg[cfg];
    CUtensorMap ma, mb, ms;
    CM_TRY(
        fg_map(&ma, q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, Mp, K, K, FG_BK, FG_BM, CU_TENSOR_MAP_SWIZZLE_128B));
    CM_TRY(fg_map(&mb, wq, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, N, K, K, FG_BK, bn, CU_TENSOR_MAP_SWIZZLE_128B));
    CM_TRY(
        fg_map(&ms, s, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, L, Mp, Mp, FG_BM, 1, CU_TENSOR_MAP_SWIZZLE_NONE));
    const int mt = (int)((Mp + FG_BM - 1) / FG_BM), nt = (int)((N + bn - 1) / bn),
              ldw = (int)kn_fp8_scale_ld(K);
    if (mode == KN_FP8_OUT_BF16)
        return fg_launch_cfg<KN_FP8_OUT_BF16>(ctx, bn, &ma, &mb, &ms, out, wscale, (int)M, (int)N, (int)K,
                                              ldw, mt, nt);
    if (mode == KN_FP8_OUT_ADD)
        return fg_launch_cfg<KN_FP8_OUT_ADD>(ctx, bn, &ma, &mb, &ms, out, wscale, (int)M, (int)N, (int)K, ldw,
                                             mt, nt);
    return fg_launch_cfg<KN_FP8_OUT_F32>(ctx, bn, &ma, &mb, &ms, out, wscale, (int)M, (int)N, (int)K, ldw, mt,
                                         nt);
}
