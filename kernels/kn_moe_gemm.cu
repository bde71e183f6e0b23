/* kernels/kn_moe_gemm.cu — the routed experts' GEMMs in one launch (kn_backend.h moe_gemm; the
 * specification is kn_ref_moe_gemm in ref/kn_moe_ref.c).
 *
 * The rows are grouped by expert (moe_group's order) and the row counts live on the device, so
 * nothing waits for the host: one CTA of `tiles` turns the E + 1 offsets into a list of
 * (expert, first row) tiles of MG_BM rows, in expert order, with the unused tail of the list
 * marked −1; then one CTA per (tile, column block) of the product. The grid is sized for the
 * worst case (R / MG_BM + E tiles), so the launch needs no count from the device; CTAs past
 * the list's end return at once.
 *
 * The product: 128 × 128 tiles of fp32 accumulators, 4 warps of 64 × 64 each (or 8 of 64 × 32
 * with TANDEM_MOE_GEMM_WARPS=8), mma.sync m16n8k16 on bf16 (kn_mma_sm80.h, sm_80 and later), K
 * in steps of 32 through a 4-stage cp.async ring in shared memory (rows padded to 40 bf16 so
 * that ldmatrix is conflict-free). moe_gemm_swiglu computes gate and up for the same 64
 * columns in one tile (the B tile's first 64 rows from the gate matrix, the last 64 from up)
 * and writes bf16(silu(gate)·up) through shared memory: the f32 gate and up never reach memory.
 * Rows past the expert's last and columns past N load as zeros and are not stored. The column
 * blocks of one row tile are adjacent CTAs, so a row tile is read from memory about once and
 * served from L2 to the others; with two weight sets (gate and up) both sets' column blocks of
 * a tile are adjacent for the same reason. */
#include <stdlib.h>
#include <string.h>

#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_mma_sm80.h"

#define MG_BM      128
#define MG_BN      128
#define MG_BK      32
#define MG_STAGES  4
#define MG_LD      (MG_BK + 8) /* shared-memory row pitch in bf16: 80 bytes */
#define MG_CLD     (MG_BN + 4) /* the swiglu epilogue's f32 tile pitch */
#define MG_SMEM    ((size_t)MG_STAGES * (MG_BM + MG_BN) * MG_LD * sizeof(bf16)) /* 80 KiB */
static_assert((size_t)MG_BM * MG_CLD * sizeof(float) <= MG_SMEM, "the swiglu epilogue's tile must fit the ring");

// ----------------------------------------------------------------------------
// kernels

/* One CTA of 1024 threads, thread e for expert e: tiles[first_e + i] = (e, offsets[e] + i·MG_BM)
 * for the ceil(n_e / MG_BM) tiles of expert e, tiles[i] = (−1, 0) from the total to n_slots. */
static __global__ void moe_tiles_kernel(int2 *tiles, int64_t n_slots, const int32_t *offsets, int E) {
    __shared__ int32_t wsum[32];
    const int          e = threadIdx.x, lane = e & 31, warp = e >> 5;
    int32_t            r0 = 0, cnt = 0;
    if (e < E) {
        r0 = offsets[e];
        const int32_t n = offsets[e + 1] - r0;
        cnt = n > 0 ? (n + MG_BM - 1) / MG_BM : 0;
    }
    int32_t x = cnt; /* inclusive scan over e: within the warp, then over the warps' sums */
    for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int32_t ws = wsum[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t y = __shfl_up_sync(0xffffffffu, ws, o);
            if (lane >= o)
                ws += y;
        }
        wsum[lane] = ws;
    }
    __syncthreads();
    const int32_t incl = x + (warp ? wsum[warp - 1] : 0), total = wsum[31];
    for (int32_t i = 0; i < cnt && incl - cnt + i < n_slots; i++)
        tiles[incl - cnt + i] = make_int2(e, r0 + i * MG_BM);
    for (int64_t i = total + threadIdx.x; i < n_slots; i += blockDim.x)
        tiles[i] = make_int2(-1, 0);
}

/* CTA b: row tile tiles[b / (n_sets·nt)], weight set (b / nt) % n_sets, column block b % nt.
 * WARPS_N warps across the 128 columns (8: 2 × 4 warps of 64 × 32; 4: 2 × 2 of 64 × 64).
 * SWIGLU: one set of column blocks of 64, rows 0..63 of the B tile from w0 (gate) and 64..127
 * from w1 (up) at the same columns; the accumulators go through shared memory and the CTA
 * writes act = bf16(silu(gate)·up) (swiglu_bf16's formula) into out (bf16) instead. */
template <int WARPS_N, bool SWIGLU>
static __global__ void __launch_bounds__(64 * WARPS_N, 2)
    moe_gemm_kernel(void *out0, float *out1, const bf16 *inp, const bf16 *const *w0, const bf16 *const *w1,
                    const int32_t *offsets, const int2 *tiles, int nt, int n_sets, int N, int K) {
    constexpr int THREADS = 64 * WARPS_N, NF = 128 / WARPS_N / 8; /* 8-column fragments per warp */
    constexpr int CN = SWIGLU ? MG_BN / 2 : MG_BN;                 /* output columns per CTA */
    extern __shared__ __align__(16) unsigned char mg_sm[];
    const int64_t b = blockIdx.x;
    const int2    tl = tiles[b / (n_sets * nt)];
    if (tl.x < 0)
        return;
    const int   e = tl.x, r0 = tl.y, rend = offsets[e + 1], set = (int)(b / nt) % n_sets;
    const int   n0 = (int)(b % nt) * CN;
    const bf16 *W = (set ? w1 : w0)[e], *Wu = SWIGLU ? w1[e] : W;
    bf16       *As = (bf16 *)mg_sm, *Bs = As + MG_STAGES * MG_BM * MG_LD;
    const int   tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int   ktiles = (K + MG_BK - 1) / MG_BK;

    /* a stage: 128 rows × 4 chunks of 8 bf16 for each operand */
    auto load = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < 512 / THREADS; i++) {
            const int   c = tid + i * THREADS, row = c >> 2, col = (c & 3) * 8, gk = kt * MG_BK + col;
            const int   gr = r0 + row, gn = n0 + (SWIGLU ? (row & 63) : row);
            const bf16 *Wr = SWIGLU && row >= 64 ? Wu : W;
            const bool  va = gr < rend && gk < K, vb = gn < N && gk < K;
            cp_async16(As + (stage * MG_BM + row) * MG_LD + col, va ? inp + (int64_t)gr * K + gk : inp, va);
            cp_async16(Bs + (stage * MG_BN + row) * MG_LD + col, vb ? Wr + (int64_t)gn * K + gk : Wr, vb);
        }
    };

    float acc[4][NF][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NF; j++)
#pragma unroll
            for (int v = 0; v < 4; v++)
                acc[i][j][v] = 0.0f;
#pragma unroll
    for (int s = 0; s < MG_STAGES - 1; s++) {
        if (s < ktiles)
            load(s, s);
        cp_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_wait<MG_STAGES - 2>();
        __syncthreads(); /* stage kt landed for all; stage kt − 1 is free again */
        if (kt + MG_STAGES - 1 < ktiles)
            load((kt + MG_STAGES - 1) % MG_STAGES, kt + MG_STAGES - 1);
        cp_commit();
        const bf16 *as = As + (kt % MG_STAGES) * MG_BM * MG_LD, *bs = Bs + (kt % MG_STAGES) * MG_BN * MG_LD;
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            uint32_t a[4][4], bf[NF / 2][4];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                frag_a_l(a[mi], as, MG_LD, wm * 64 + mi * 16, kk, lane);
#pragma unroll
            for (int nj = 0; nj < NF / 2; nj++)
                frag_b_nk_l(bf[nj], bs, MG_LD, wn * NF * 8 + nj * 16, kk, lane);
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < NF / 2; nj++) {
                    mma_bf16(acc[mi][2 * nj], a[mi], bf[nj][0], bf[nj][1]);
                    mma_bf16(acc[mi][2 * nj + 1], a[mi], bf[nj][2], bf[nj][3]);
                }
        }
    }
    cp_wait<0>();

    const int g = lane >> 2, t = lane & 3;
    if (SWIGLU) {
        __syncthreads(); /* every warp is done with the ring: it becomes the f32 tile */
        float *C = (float *)mg_sm;
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int ni = 0; ni < NF; ni++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float *c = C + (wm * 64 + mi * 16 + g + 8 * h) * MG_CLD + wn * NF * 8 + ni * 8 + 2 * t;
                    c[0] = acc[mi][ni][2 * h];
                    c[1] = acc[mi][ni][2 * h + 1];
                }
        __syncthreads();
        bf16 *act = (bf16 *)out0;
        for (int i = tid; i < MG_BM * (CN / 2); i += THREADS) {
            const int row = i / (CN / 2), c = 2 * (i % (CN / 2)), r = r0 + row, n = n0 + c;
            if (r >= rend || n >= N)
                continue;
            const float *cr = C + row * MG_CLD;
            const float  g0 = cr[c], u0 = cr[CN + c], g1 = cr[c + 1], u1 = cr[CN + c + 1];
            const float  v0 = g0 / (1.0f + expf(-g0)) * u0, v1 = g1 / (1.0f + expf(-g1)) * u1;
            bf16        *o = act + (int64_t)r * N + n;
            if ((N & 1) == 0) {
                *(__nv_bfloat162 *)o = __floats2bfloat162_rn(v0, v1);
            } else {
                o[0] = __float2bfloat16_rn(v0);
                if (n + 1 < N)
                    o[1] = __float2bfloat16_rn(v1);
            }
        }
        return;
    }
    float     *out = set ? out1 : (float *)out0;
    const bool pairs = (N & 1) == 0; /* then (row·N + even column) is even: float2 stores */
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + wm * 64 + mi * 16 + g + 8 * h;
            if (r >= rend)
                continue;
            float *o = out + (int64_t)r * N;
#pragma unroll
            for (int ni = 0; ni < NF; ni++) {
                const int   c = n0 + wn * NF * 8 + ni * 8 + 2 * t;
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (pairs && c + 1 < N) {
                    *(float2 *)(o + c) = make_float2(v0, v1);
                } else {
                    if (c < N)
                        o[c] = v0;
                    if (c + 1 < N)
                        o[c + 1] = v1;
                }
            }
        }
}

// ----------------------------------------------------------------------------
// launchers

/* The warps of a CTA: 4 (2 × 2, 64 × 64 each), or 8 (2 × 4, 64 × 32 each) when
 * TANDEM_MOE_GEMM_WARPS=8, for measuring one beside the other. Both give the same bits; 4 was
 * the faster at the Qwen3.5-35B-A3B shape on an H200 (77.0 against 81.5 ms of experts' GEMMs
 * per 8192-token forward, bench/results/moe35-2026-12-02.md). */
static int mg_warps(void) {
    const char *v = getenv("TANDEM_MOE_GEMM_WARPS");
    return v && strcmp(v, "8") == 0 ? 8 : 4;
}

template <int WARPS_N, bool SWIGLU>
static cm_status mg_launch(kn_ctx *ctx, int64_t grid, void *out0, float *out1, const uint16_t *inp,
                           const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets,
                           const int2 *tiles, int64_t nt, int64_t n_sets, int64_t N, int64_t K) {
    auto kern = moe_gemm_kernel<WARPS_N, SWIGLU>;
    KN_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MG_SMEM));
    kern<<<(unsigned)grid, 64 * WARPS_N, MG_SMEM, ctx->stream>>>(out0, out1, (const bf16 *)inp,
                                                                (const bf16 *const *)w0, (const bf16 *const *)w1,
                                                                offsets, tiles, (int)nt, (int)n_sets, (int)N, (int)K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* The checks both entries share, the tile list, then the product (swiglu: act from w0 and w1). */
static cm_status mg_run(kn_ctx *ctx, const char *op, void *out0, float *out1, const uint16_t *inp,
                        const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                        int E, int64_t N, int64_t K, bool swiglu) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(R >= 0 && N >= 0 && K >= 0 && R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                      "%s: bad shape R=%lld N=%lld K=%lld (each in [0, 2^31))", op, (long long)R, (long long)N,
                      (long long)K);
    KN_CUDA_CHECK_ARG(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "%s: E=%d experts is outside [1, %d]", op, E,
                      KN_MOE_MAX_EXPERTS);
    if (!swiglu)
        KN_CUDA_CHECK_ARG(!out1 == !w1, "%s: out1 and w1 go together (both or neither)", op);
    if (R == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out0 && inp && w0 && offsets && (!swiglu || w1), "%s: out, inp, w0%s or offsets is NULL", op,
                      swiglu ? ", w1" : "");
    KN_CUDA_CHECK_ARG(K % 8 == 0 && (uintptr_t)inp % 16 == 0,
                      "%s: K=%lld must be a multiple of 8 and inp 16-byte aligned (rows are read 16 bytes at a time); "
                      "use gemm_bf16in per expert otherwise",
                      op, (long long)K);
    const int64_t cn = swiglu ? MG_BN / 2 : MG_BN;
    const int64_t n_slots = R / MG_BM + E + 1, nt = (N + cn - 1) / cn, n_sets = out1 ? 2 : 1;
    const int64_t grid = n_slots * nt * n_sets;
    KN_CUDA_CHECK_ARG(grid <= INT32_MAX, "%s: R=%lld rows x N=%lld columns need more CTAs than one launch holds; "
                      "split the rows", op, (long long)R, (long long)N);
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)n_slots * sizeof(int2)));
    int2 *tiles = (int2 *)ctx->scratch;
    moe_tiles_kernel<<<1, 1024, 0, ctx->stream>>>(tiles, n_slots, offsets, E);
    KN_CUDA_LAUNCHED(ctx);
    const int warps = mg_warps();
    if (swiglu)
        return warps == 4 ? mg_launch<2, true>(ctx, grid, out0, NULL, inp, w0, w1, offsets, tiles, nt, 1, N, K)
                          : mg_launch<4, true>(ctx, grid, out0, NULL, inp, w0, w1, offsets, tiles, nt, 1, N, K);
    return warps == 4 ? mg_launch<2, false>(ctx, grid, out0, out1, inp, w0, w1, offsets, tiles, nt, n_sets, N, K)
                      : mg_launch<4, false>(ctx, grid, out0, out1, inp, w0, w1, offsets, tiles, nt, n_sets, N, K);
}

cm_status kn_cuda_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const uint16_t *const *w0,
                           const uint16_t *const *w1, const int32_t *offsets, int64_t R, int E, int64_t N,
                           int64_t K) {
    return mg_run(ctx, "moe_gemm", out0, out1, inp, w0, w1, offsets, R, E, N, K, false);
}

cm_status kn_cuda_moe_gemm_swiglu(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const uint16_t *const *wg,
                                  const uint16_t *const *wu, const int32_t *offsets, int64_t R, int E, int64_t N,
                                  int64_t K) {
    return mg_run(ctx, "moe_gemm_swiglu", act, NULL, inp, wg, wu, offsets, R, E, N, K, true);
}
