/* kernels/kn_moe_gemm_sm90a.cu — the routed experts' GEMMs (kn_backend.h moe_gemm and
 * moe_gemm_swiglu) on Hopper's warpgroup MMA. Compiled for sm_90a only (wgmma is an
 * architecture-specific instruction), as its own object (kernels/CMakeLists.txt); the entries,
 * their checks and the tile list are kn_moe_gemm.cu's, which calls in here when the GPU is
 * compute capability 9.0 (kn_moe_gemm_int.h). The results are the mma.sync kernel's up to the
 * order of fp32 additions inside the tensor core; the specification is kn_ref_moe_gemm.
 *
 * One CTA per (row tile of 128, weight set, column block), as the mma.sync kernel: two
 * warpgroups of 64 rows × 128 columns, each one wgmma.m64n128k16 per 16 of K with fp32
 * accumulators in registers. K goes in steps of 64 bf16 (one 128-byte row) through a ring of
 * STAGES stages that all 256 threads fill with cp.async (rows gathered through src, rows past
 * the expert and columns past N as zeros), stored in the 128-byte swizzle wgmma reads: 16-byte
 * chunk c of row r at chunk c ^ (r mod 8), each 8-row group 1024 bytes and 1024-aligned.
 * SWIGLU: the B tile's rows 0..63 are gate columns n0.., rows 64..127 up at the same columns, so
 * each thread holds gate and up of the same outputs and writes bf16(silu(gate)·up) from
 * registers. moe_gemm_fp8's kernel is the same on e4m3 (below).
 */
#include "kn_device.h"
#include "kn_moe_gemm_int.h"
#include "kn_wgmma_sm90.h"

#define WG_BM      128 /* two warpgroups of 64 rows */
#define WG_BN      128
#define WG_BK      64  /* bf16: one 128-byte swizzle row */
#define WG_THREADS 256
#define WG_ROWB    128 /* bytes per smem row */
#define WG_TILEB   (WG_BM * WG_ROWB) /* one operand's stage: 16 KB (WG_BN == WG_BM) */

static constexpr size_t wg_smem(int stages) { return (size_t)stages * 2 * WG_TILEB + 1024; /* + alignment */ }

// ----------------------------------------------------------------------------
// the shapes only these kernels use (the rest: kn_wgmma_sm90.h)

/* d[64] += A (64 × 16, K-major, descriptor da) · B (128 × 16, K-major, db)ᵀ. d's layout per warp w
 * of the warpgroup (rows 16w..16w + 15), lane g = lane / 4, t = lane % 4: d[4i + 2h + j] is row
 * g + 8h, column 8i + 2t + j (mma.sync's C fragment for each 8 columns). */
static __device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_D64
                 : "l"(da), "l"(db), "r"(1));
}

/* This thread's half row h of a warp's 16 × 128 f32 result (d's layout above) into row r of out
 * [.., N] at columns n0 + 8i + 2t, + 1: float2 stores where N is even, columns past N left alone. */
static __device__ __forceinline__ void store_row(float *out, int r, const float (&d)[64], int h, int n0, int t, int N) {
    float *o = out + (int64_t)r * N;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int   c = n0 + 8 * i + 2 * t;
        const float v0 = d[4 * i + 2 * h], v1 = d[4 * i + 2 * h + 1];
        if ((N & 1) == 0 && c + 1 < N) {
            *(float2 *)(o + c) = make_float2(v0, v1);
        } else {
            if (c < N)
                o[c] = v0;
            if (c + 1 < N)
                o[c + 1] = v1;
        }
    }
}

// ----------------------------------------------------------------------------
// kernel

template <int STAGES, bool SWIGLU>
static __global__ void __launch_bounds__(WG_THREADS, STAGES == 3 ? 2 : 1)
    moe_wgmma_kernel(void *out0, float *out1, const bf16 *inp, const int32_t *src, int topk, const bf16 *const *w0,
                     const bf16 *const *w1, const int32_t *offsets, const int2 *tiles, int nt, int n_sets, int N,
                     int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CN = SWIGLU ? WG_BN / 2 : WG_BN; /* output columns per CTA */
    extern __shared__ unsigned char wg_raw[];
    __shared__ int32_t arow[WG_BM]; /* each tile row's input row, −1 past the expert's rows */
    const int64_t      b = blockIdx.x;
    const int2         tl = tiles[b / (n_sets * nt)];
    if (tl.x < 0)
        return;
    const int   e = tl.x, r0 = tl.y, rend = offsets[e + 1], set = (int)(b / nt) % n_sets;
    const int   n0 = (int)(b % nt) * CN;
    const bf16 *W = (set ? w1 : w0)[e], *Wu = SWIGLU ? w1[e] : W;
    unsigned char *ring = (unsigned char *)(((uintptr_t)wg_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *As = ring, *Bs = ring + STAGES * WG_TILEB;
    const int      tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wq = (tid >> 5) & 3;
    const int      ktiles = (K + WG_BK - 1) / WG_BK;
    for (int i = tid; i < WG_BM; i += WG_THREADS)
        arow[i] = r0 + i < rend ? (src ? src[r0 + i] / topk : r0 + i) : -1;
    __syncthreads();

    /* a stage: 128 rows of the input and 128 of the weights, 8 chunks of 16 bytes each */
    auto load = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < WG_BM * 8 / WG_THREADS; i++) {
            const int  c = tid + i * WG_THREADS, row = c >> 3, ch = c & 7, gk = kt * WG_BK + ch * 8;
            const int  ar = arow[row];
            const bool va = ar >= 0 && gk < K;
            cp_async16(As + stage * WG_TILEB + row * WG_ROWB + ((ch ^ (row & 7)) << 4),
                       va ? inp + (int64_t)ar * K + gk : inp, va);
        }
#pragma unroll
        for (int i = 0; i < WG_BN * 8 / WG_THREADS; i++) {
            const int   c = tid + i * WG_THREADS, row = c >> 3, ch = c & 7, gk = kt * WG_BK + ch * 8;
            const int   gn = n0 + (SWIGLU ? (row & 63) : row);
            const bf16 *Wr = SWIGLU && row >= 64 ? Wu : W;
            const bool  vb = gn < N && gk < K;
            cp_async16(Bs + stage * WG_TILEB + row * WG_ROWB + ((ch ^ (row & 7)) << 4),
                       vb ? Wr + (int64_t)gn * K + gk : Wr, vb);
        }
    };

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; i++)
        d[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles)
            load(s, s);
        cp_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_wait<STAGES - 2>();
        fence_async_smem();
        __syncthreads(); /* stage kt landed for all; every warpgroup is done with stage kt − 1 */
        if (kt + STAGES - 1 < ktiles)
            load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_commit();
        const int      s = kt % STAGES;
        const uint64_t da = wg_desc(As + s * WG_TILEB + wg * 64 * WG_ROWB), db = wg_desc(Bs + s * WG_TILEB);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; kk++)
            wgmma_m64n128k16(d, da + 2 * kk, db + 2 * kk);
        wg_commit();
        wg_wait0();
    }
    cp_wait<0>();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + wg * 64 + wq * 16 + g + 8 * h;
        if (r >= rend)
            continue;
        if (SWIGLU) {
            bf16 *o = (bf16 *)out0 + (int64_t)r * N;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int   c = n0 + 8 * i + 2 * t;
                const float g0 = d[4 * i + 2 * h], g1 = d[4 * i + 2 * h + 1];
                const float u0 = d[32 + 4 * i + 2 * h], u1 = d[32 + 4 * i + 2 * h + 1];
                const float v0 = kn_silu(g0) * u0, v1 = kn_silu(g1) * u1;
                if ((N & 1) == 0 && c + 1 < N) {
                    *(__nv_bfloat162 *)(o + c) = __floats2bfloat162_rn(v0, v1);
                } else {
                    if (c < N)
                        o[c] = __float2bfloat16_rn(v0);
                    if (c + 1 < N)
                        o[c + 1] = __float2bfloat16_rn(v1);
                }
            }
        } else {
            store_row(set ? out1 : (float *)out0, r, d, h, n0, t, N);
        }
    }
#else
    __trap(); /* built without sm_90a code: kn_moe_wgmma_available said no */
#endif
}

/* The FP8 tiles (moe_gemm_fp8): the same CTAs, rows and ring, 128 e4m3 of K per step (one
 * 128-byte row, and exactly one scale group). Each step's four wgmma.m64n128k32 go into a fresh
 * accumulator t, which the step then adds into d scaled by its rows' input scales and the weight
 * block's scale (the columns of a CTA lie in one 128-row weight block): fp32 from group to group,
 * as cuBLASLt's block-scaled product. d and t take 128 registers, so one CTA per SM. */
template <int STAGES>
static __global__ void __launch_bounds__(WG_THREADS, 1)
    moe_wgmma_fp8_kernel(float *out0, float *out1, const uint8_t *inp, const float *sc, int Mq, const int32_t *src,
                         int topk, const uint8_t *const *w0, const uint8_t *const *w1, const float *const *ws0,
                         const float *const *ws1, const int32_t *offsets, const int2 *tiles, int nt, int n_sets, int N,
                         int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char wg_raw[];
    __shared__ int32_t arow[WG_BM];
    const int64_t      b = blockIdx.x;
    const int2         tl = tiles[b / (n_sets * nt)];
    if (tl.x < 0)
        return;
    const int      e = tl.x, r0 = tl.y, rend = offsets[e + 1], set = (int)(b / nt) % n_sets;
    const int      n0 = (int)(b % nt) * WG_BN, ldw = ((K + 127) / 128 + 3) / 4 * 4;
    const uint8_t *W = (set ? w1 : w0)[e];
    const float   *Ws = (set ? ws1 : ws0)[e] + (int64_t)(n0 / 128) * ldw;
    unsigned char *ring = (unsigned char *)(((uintptr_t)wg_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *As = ring, *Bs = ring + STAGES * WG_TILEB;
    const int      tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wq = (tid >> 5) & 3;
    const int      g = lane >> 2, t4 = lane & 3, ktiles = (K + 127) / 128;
    for (int i = tid; i < WG_BM; i += WG_THREADS)
        arow[i] = r0 + i < rend ? (src ? src[r0 + i] / topk : r0 + i) : -1;
    __syncthreads();
    const int ra = arow[wg * 64 + wq * 16 + g], rb = arow[wg * 64 + wq * 16 + g + 8]; /* this thread's rows */

    auto load = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < WG_BM * 8 / WG_THREADS; i++) {
            const int  c = tid + i * WG_THREADS, row = c >> 3, ch = c & 7, gk = kt * 128 + ch * 16;
            const int  ar = arow[row];
            const bool va = ar >= 0 && gk < K;
            cp_async16(As + stage * WG_TILEB + row * WG_ROWB + ((ch ^ (row & 7)) << 4),
                       va ? inp + (int64_t)ar * K + gk : inp, va);
        }
#pragma unroll
        for (int i = 0; i < WG_BN * 8 / WG_THREADS; i++) {
            const int  c = tid + i * WG_THREADS, row = c >> 3, ch = c & 7, gk = kt * 128 + ch * 16;
            const int  gn = n0 + row;
            const bool vb = gn < N && gk < K;
            cp_async16(Bs + stage * WG_TILEB + row * WG_ROWB + ((ch ^ (row & 7)) << 4),
                       vb ? W + (int64_t)gn * K + gk : W, vb);
        }
    };

    float d[64], acc[64];
#pragma unroll
    for (int i = 0; i < 64; i++)
        d[i] = acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles)
            load(s, s);
        cp_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        /* this step's scales, read before the MMAs so that their latency hides behind them */
        const float sw = Ws[kt];
        const float fa = (ra >= 0 ? sc[(int64_t)kt * Mq + ra] : 0.0f) * sw;
        const float fb = (rb >= 0 ? sc[(int64_t)kt * Mq + rb] : 0.0f) * sw;
        cp_wait<STAGES - 2>();
        fence_async_smem();
        __syncthreads();
        if (kt + STAGES - 1 < ktiles)
            load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_commit();
        const int      s = kt % STAGES;
        const uint64_t da = wg_desc(As + s * WG_TILEB + wg * 64 * WG_ROWB), db = wg_desc(Bs + s * WG_TILEB);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_m64n128k32_e4m3(acc, da + 2 * kk, db + 2 * kk, kk);
        wg_commit();
        wg_wait0();
        wg_scale_add(d, acc, fa, fb);
    }
    cp_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + wg * 64 + wq * 16 + g + 8 * h;
        if (r >= rend)
            continue;
        store_row(set ? out1 : out0, r, d, h, n0, t4, N);
    }
#else
    __trap(); /* built without sm_90a code: kn_moe_wgmma_available said no */
#endif
}

// ----------------------------------------------------------------------------
// launcher

bool kn_moe_wgmma_available(kn_ctx *ctx) {
    int major = 0, minor = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ctx->device) == cudaSuccess &&
           major == 9 && minor == 0;
}

template <int STAGES, bool SWIGLU> static cm_status wg_launch(kn_ctx *ctx, const mg_args *a) {
    const int64_t cn = SWIGLU ? WG_BN / 2 : WG_BN, nt = (a->N + cn - 1) / cn, n_sets = a->out1 ? 2 : 1;
    int64_t       n_slots;
    const void   *tiles;
    CM_TRY(kn_moe_tiles(ctx, a, WG_BM, &n_slots, &tiles));
    const int64_t grid = n_slots * nt * n_sets;
    KN_CUDA_CHECK_ARG(grid <= INT32_MAX, "moe_gemm: R=%lld rows x N=%lld columns need more CTAs than one launch holds; "
                      "split the rows", (long long)a->R, (long long)a->N);
    auto kern = moe_wgmma_kernel<STAGES, SWIGLU>;
    KN_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wg_smem(STAGES)));
    kern<<<(unsigned)grid, WG_THREADS, wg_smem(STAGES), ctx->stream>>>(
        a->out0, a->out1, (const bf16 *)a->inp, a->src, a->topk, (const bf16 *const *)a->w0,
        (const bf16 *const *)a->w1, a->offsets, (const int2 *)tiles, (int)nt, (int)n_sets, (int)a->N, (int)a->K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_moe_wgmma_launch(kn_ctx *ctx, const mg_args *a, bool swiglu, int stages) {
    if (stages == 4)
        return swiglu ? wg_launch<4, true>(ctx, a) : wg_launch<4, false>(ctx, a);
    return swiglu ? wg_launch<3, true>(ctx, a) : wg_launch<3, false>(ctx, a);
}

cm_status kn_moe_wgmma_fp8_launch(kn_ctx *ctx, const mg_args *a, const mg_fp8 *f) {
    const int64_t nt = (a->N + WG_BN - 1) / WG_BN, n_sets = a->out1 ? 2 : 1;
    int64_t       n_slots;
    const void   *tiles;
    CM_TRY(kn_moe_tiles(ctx, a, WG_BM, &n_slots, &tiles));
    const int64_t grid = n_slots * nt * n_sets;
    KN_CUDA_CHECK_ARG(grid <= INT32_MAX, "moe_gemm_fp8: R=%lld rows x N=%lld columns need more CTAs than one launch "
                      "holds; split the rows", (long long)a->R, (long long)a->N);
    constexpr int STAGES = 4;
    auto          kern   = moe_wgmma_fp8_kernel<STAGES>;
    KN_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wg_smem(STAGES)));
    kern<<<(unsigned)grid, WG_THREADS, wg_smem(STAGES), ctx->stream>>>(
        (float *)a->out0, a->out1, (const uint8_t *)a->inp, f->s, (int)f->Mq, a->src, a->topk,
        (const uint8_t *const *)a->w0, (const uint8_t *const *)a->w1, f->ws0, f->ws1, a->offsets, (const int2 *)tiles,
        (int)nt, (int)n_sets, (int)a->N, (int)a->K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
