/* kernels/kn_moe_gemm.cu — the routed experts' GEMMs in one launch (kn_backend.h moe_gemm and
 * moe_gemm_swiglu; the specification is kn_ref_moe_gemm in ref/kn_moe_ref.c).
 *
 * The rows are grouped by expert (moe_group's order) and the row counts live on the device, so
 * nothing waits for the host: one CTA of `tiles` turns the E + 1 offsets into a list of
 * (expert, first row) tiles of BM rows, in expert order, with the unused tail of the list
 * marked −1; then one CTA per (tile, column block) of the product. The grid is sized for the
 * worst case (R / BM + E tiles), so the launch needs no count from the device; CTAs past the
 * list's end return at once. With src given, a tile's input rows are read through it (row j of
 * the product is row src[j] / topk of the input): moe_gather fused into the loads.
 *
 * The product: BM × 128 tiles of fp32 accumulators, mma.sync m16n8k16 on bf16 (kn_mma_sm80.h,
 * sm_80 and later), K in steps of 32 through a 4-stage cp.async ring in shared memory (rows
 * padded to 40 bf16 so that ldmatrix is conflict-free). Three mma.sync tilings (TANDEM_MOE_GEMM_TILE,
 * for measuring one beside another; all give the same bits, since every output is the same sums in
 * the same order): "128w4" (the default off Hopper) BM 128 with 4 warps of 64 × 64; "128w8" BM 128 with 8
 * warps of 64 × 32; "64w4" BM 64 with 4 warps of 64 × 32 (less padding in each expert's last
 * tile). Rows past the expert's last and columns past N load as zeros and are not stored. The
 * column blocks of one row tile are adjacent CTAs, so a tile's rows come from memory about once
 * and from L2 to the others. moe_gemm_swiglu computes gate and up for the same 64 columns in one
 * tile (the B tile's first 64 rows from the gate matrix, the last 64 from up) and writes
 * bf16(silu(gate)·up) through shared memory: the f32 gate and up never reach memory.
 * On compute capability 9.0 the default is the same tiles on wgmma instead (kn_moe_gemm_sm90a.cu,
 * tilings "wg" and "wg4"), equal to these within fp32 rounding, not bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_mma_sm80.h"
#include "kn_moe_gemm_int.h"

#define MG_BN     128
#define MG_BK     32
#define MG_STAGES 4
#define MG_LD     (MG_BK + 8) /* shared-memory row pitch in bf16: 80 bytes */
#define MG_CLD    (MG_BN + 4) /* the swiglu epilogue's f32 tile pitch */

/* The shared memory of a BM-row tiling: the cp.async ring (the swiglu epilogue's f32 tile reuses it). */
static constexpr size_t mg_smem(int bm) { return (size_t)MG_STAGES * (bm + MG_BN) * MG_LD * sizeof(bf16); }
static_assert((size_t)128 * MG_CLD * sizeof(float) <= mg_smem(128), "the swiglu tile must fit the ring");
static_assert((size_t)64 * MG_CLD * sizeof(float) <= mg_smem(64), "the swiglu tile must fit the ring");

// ----------------------------------------------------------------------------
// kernels

/* One CTA of 1024 threads, thread e for expert e: tiles[first_e + i] = (e, offsets[e] + i·bm)
 * for the ceil(n_e / bm) tiles of expert e, tiles[i] = (−1, 0) from the total to n_slots. */
static __global__ void moe_tiles_kernel(int2 *tiles, int64_t n_slots, const int32_t *offsets, int E, int bm) {
    __shared__ int32_t wsum[32];
    const int          e = threadIdx.x;
    int32_t            r0 = 0, cnt = 0, total;
    if (e < E) {
        r0 = offsets[e];
        const int32_t n = offsets[e + 1] - r0;
        cnt = n > 0 ? (n + bm - 1) / bm : 0;
    }
    const int32_t incl = block_incl_scan_1024(cnt, wsum, &total);
    for (int32_t i = 0; i < cnt && incl - cnt + i < n_slots; i++)
        tiles[incl - cnt + i] = make_int2(e, r0 + i * bm);
    for (int64_t i = total + threadIdx.x; i < n_slots; i += blockDim.x)
        tiles[i] = make_int2(-1, 0);
}

/* CTA b: row tile tiles[b / (n_sets·nt)], weight set (b / nt) % n_sets, column block b % nt;
 * WARPS_M × WARPS_N warps over the BM × 128 tile. SWIGLU: one set of column blocks of 64, rows
 * 0..63 of the B tile from w0 (gate) and 64..127 from w1 (up) at the same columns; the
 * accumulators go through shared memory and the CTA writes act = bf16(silu(gate)·up)
 * (swiglu_bf16's formula) into out0 (bf16) instead. */
template <int BM, int WARPS_M, int WARPS_N, bool SWIGLU>
static __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, 2)
    moe_gemm_kernel(void *out0, float *out1, const bf16 *inp, const int32_t *src, int topk, const bf16 *const *w0,
                    const bf16 *const *w1, const int32_t *offsets, const int2 *tiles, int nt, int n_sets, int N,
                    int K) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int WR = BM / WARPS_M, MF = WR / 16;          /* rows per warp, 16-row fragments */
    constexpr int WC = MG_BN / WARPS_N, NF = WC / 8;        /* columns per warp, 8-column fragments */
    constexpr int CN = SWIGLU ? MG_BN / 2 : MG_BN;          /* output columns per CTA */
    static_assert(BM * 4 % THREADS == 0 && MG_BN * 4 % THREADS == 0 && MF >= 1 && NF % 2 == 0, "tiling");
    extern __shared__ __align__(16) unsigned char mg_sm[];
    __shared__ int32_t arow[BM]; /* each tile row's input row, −1 past the expert's rows */
    const int64_t      b = blockIdx.x;
    const int2         tl = tiles[b / (n_sets * nt)];
    if (tl.x < 0)
        return;
    const int   e = tl.x, r0 = tl.y, rend = offsets[e + 1], set = (int)(b / nt) % n_sets;
    const int   n0 = (int)(b % nt) * CN;
    const bf16 *W = (set ? w1 : w0)[e], *Wu = SWIGLU ? w1[e] : W;
    bf16       *As = (bf16 *)mg_sm, *Bs = As + MG_STAGES * BM * MG_LD;
    const int   tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int   ktiles = (K + MG_BK - 1) / MG_BK;
    for (int i = tid; i < BM; i += THREADS)
        arow[i] = r0 + i < rend ? (src ? src[r0 + i] / topk : r0 + i) : -1;
    __syncthreads();

    /* a stage: BM rows of the input and 128 of the weights, 4 chunks of 8 bf16 each */
    auto load = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < BM * 4 / THREADS; i++) {
            const int  c = tid + i * THREADS, row = c >> 2, col = (c & 3) * 8, gk = kt * MG_BK + col;
            const int  ar = arow[row];
            const bool va = ar >= 0 && gk < K;
            cp_async16(As + (stage * BM + row) * MG_LD + col, va ? inp + (int64_t)ar * K + gk : inp, va);
        }
#pragma unroll
        for (int i = 0; i < MG_BN * 4 / THREADS; i++) {
            const int   c = tid + i * THREADS, row = c >> 2, col = (c & 3) * 8, gk = kt * MG_BK + col;
            const int   gn = n0 + (SWIGLU ? (row & 63) : row);
            const bf16 *Wr = SWIGLU && row >= 64 ? Wu : W;
            const bool  vb = gn < N && gk < K;
            cp_async16(Bs + (stage * MG_BN + row) * MG_LD + col, vb ? Wr + (int64_t)gn * K + gk : Wr, vb);
        }
    };

    float acc[MF][NF][4];
#pragma unroll
    for (int i = 0; i < MF; i++)
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
        const bf16 *as = As + (kt % MG_STAGES) * BM * MG_LD, *bs = Bs + (kt % MG_STAGES) * MG_BN * MG_LD;
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            uint32_t a[MF][4], bf[NF / 2][4];
#pragma unroll
            for (int mi = 0; mi < MF; mi++)
                frag_a_l(a[mi], as, MG_LD, wm * WR + mi * 16, kk, lane);
#pragma unroll
            for (int nj = 0; nj < NF / 2; nj++)
                frag_b_nk_l(bf[nj], bs, MG_LD, wn * WC + nj * 16, kk, lane);
#pragma unroll
            for (int mi = 0; mi < MF; mi++)
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
        for (int mi = 0; mi < MF; mi++)
#pragma unroll
            for (int ni = 0; ni < NF; ni++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float *c = C + (wm * WR + mi * 16 + g + 8 * h) * MG_CLD + wn * WC + ni * 8 + 2 * t;
                    c[0] = acc[mi][ni][2 * h];
                    c[1] = acc[mi][ni][2 * h + 1];
                }
        __syncthreads();
        bf16 *act = (bf16 *)out0;
        for (int i = tid; i < BM * (CN / 2); i += THREADS) {
            const int row = i / (CN / 2), c = 2 * (i % (CN / 2)), r = r0 + row, n = n0 + c;
            if (r >= rend || n >= N)
                continue;
            const float *cr = C + row * MG_CLD;
            const float  g0 = cr[c], u0 = cr[CN + c], g1 = cr[c + 1], u1 = cr[CN + c + 1];
            const float  v0 = kn_silu(g0) * u0, v1 = kn_silu(g1) * u1;
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
    for (int mi = 0; mi < MF; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + wm * WR + mi * 16 + g + 8 * h;
            if (r >= rend)
                continue;
            float *o = out + (int64_t)r * N;
#pragma unroll
            for (int ni = 0; ni < NF; ni++) {
                const int   c = n0 + wn * WC + ni * 8 + 2 * t;
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

/* The tiling: TANDEM_MOE_GEMM_TILE "wg" (wgmma, 3 stages: the default on compute capability 9.0
 * when the build has architecture 90), "wg4" (wgmma, 4 stages), "128w4" (mma.sync: the default
 * elsewhere), "128w8" or "64w4" (see the top); any other value is the default. */
typedef enum { MG_DEFAULT, MG_WG, MG_WG4, MG_128W4, MG_128W8, MG_64W4 } mg_tiling;
static mg_tiling mg_tile(void) {
    static const struct {
        const char *name;
        mg_tiling   t;
    } names[] = {{"wg", MG_WG}, {"wg4", MG_WG4}, {"128w4", MG_128W4}, {"128w8", MG_128W8}, {"64w4", MG_64W4}};
    const char *v = getenv("TANDEM_MOE_GEMM_TILE");
    for (size_t i = 0; v && i < sizeof names / sizeof names[0]; i++)
        if (strcmp(v, names[i].name) == 0)
            return names[i].t;
    return MG_DEFAULT;
}

/* Whether this build has the wgmma kernel (kernels/CMakeLists.txt: architecture 90 in the list). */
#ifdef TANDEM_HAVE_SM90A
static bool mg_wgmma_built(void) { return true; }
#else
static bool     mg_wgmma_built(void) { return false; }
cm_status       kn_moe_wgmma_launch(kn_ctx *, const mg_args *, bool, int) { return CM_ERR_INVALID_ARG; }
cm_status       kn_moe_wgmma_fp8_launch(kn_ctx *, const mg_args *, const mg_fp8 *) { return CM_ERR_INVALID_ARG; }
bool            kn_moe_wgmma_available(kn_ctx *) { return false; }
#endif

cm_status kn_moe_tiles(kn_ctx *ctx, const mg_args *a, int bm, int64_t *n_slots, const void **tiles) {
    *n_slots = a->R / bm + a->E + 1;
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)*n_slots * sizeof(int2)));
    moe_tiles_kernel<<<1, 1024, 0, ctx->stream>>>((int2 *)ctx->scratch, *n_slots, a->offsets, a->E, bm);
    KN_CUDA_LAUNCHED(ctx);
    *tiles = ctx->scratch;
    return CM_OK;
}

template <int BM, int WARPS_M, int WARPS_N, bool SWIGLU> static cm_status mg_launch(kn_ctx *ctx, const mg_args *a) {
    const int64_t cn = SWIGLU ? MG_BN / 2 : MG_BN, nt = (a->N + cn - 1) / cn, n_sets = a->out1 ? 2 : 1;
    int64_t       n_slots;
    const void   *tiles;
    CM_TRY(kn_moe_tiles(ctx, a, BM, &n_slots, &tiles));
    const int64_t grid = n_slots * nt * n_sets;
    KN_CUDA_CHECK_ARG(grid <= INT32_MAX, "moe_gemm: R=%lld rows x N=%lld columns need more CTAs than one launch holds; "
                      "split the rows", (long long)a->R, (long long)a->N);
    auto kern = moe_gemm_kernel<BM, WARPS_M, WARPS_N, SWIGLU>;
    KN_CUDA(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mg_smem(BM)));
    kern<<<(unsigned)grid, 32 * WARPS_M * WARPS_N, mg_smem(BM), ctx->stream>>>(
        a->out0, a->out1, (const bf16 *)a->inp, a->src, a->topk, (const bf16 *const *)a->w0,
        (const bf16 *const *)a->w1, a->offsets, (const int2 *)tiles, (int)nt, (int)n_sets, (int)a->N, (int)a->K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* The checks both entries share, then the tiling's launch (swiglu: act from w0 and w1). */
static cm_status mg_run(kn_ctx *ctx, const char *op, const mg_args *a, bool swiglu) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(a->R >= 0 && a->N >= 0 && a->K >= 0 && a->R <= INT32_MAX && a->N <= INT32_MAX &&
                          a->K <= INT32_MAX,
                      "%s: bad shape R=%lld N=%lld K=%lld (each in [0, 2^31))", op, (long long)a->R, (long long)a->N,
                      (long long)a->K);
    KN_CUDA_CHECK_ARG(a->E >= 1 && a->E <= KN_MOE_MAX_EXPERTS, "%s: E=%d experts is outside [1, %d]", op, a->E,
                      KN_MOE_MAX_EXPERTS);
    KN_CUDA_CHECK_ARG(!a->src || a->topk >= 1, "%s: topk=%d must be >= 1 with src", op, a->topk);
    if (!swiglu)
        KN_CUDA_CHECK_ARG(!a->out1 == !a->w1, "%s: out1 and w1 go together (both or neither)", op);
    if (a->R == 0 || a->N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(a->out0 && a->inp && a->w0 && a->offsets && (!swiglu || a->w1),
                      "%s: out, inp, w0%s or offsets is NULL", op, swiglu ? ", w1" : "");
    KN_CUDA_CHECK_ARG(a->K % 8 == 0 && (uintptr_t)a->inp % 16 == 0,
                      "%s: K=%lld must be a multiple of 8 and inp 16-byte aligned (rows are read 16 bytes at a time); "
                      "use gemm_bf16in per expert otherwise",
                      op, (long long)a->K);
    mg_tiling  t = mg_tile();
    const bool wg = mg_wgmma_built() && kn_moe_wgmma_available(ctx);
    KN_CUDA_CHECK_ARG(wg || (t != MG_WG && t != MG_WG4),
                      "%s: TANDEM_MOE_GEMM_TILE=%s needs a GPU of compute capability 9.0 and a build for architecture "
                      "90; unset it or choose 128w4", op, getenv("TANDEM_MOE_GEMM_TILE"));
    if (t == MG_DEFAULT)
        t = wg ? MG_WG : MG_128W4;
    switch (t) {
    case MG_WG: return kn_moe_wgmma_launch(ctx, a, swiglu, 3);
    case MG_WG4: return kn_moe_wgmma_launch(ctx, a, swiglu, 4);
    case MG_128W8: return swiglu ? mg_launch<128, 2, 4, true>(ctx, a) : mg_launch<128, 2, 4, false>(ctx, a);
    case MG_64W4: return swiglu ? mg_launch<64, 1, 4, true>(ctx, a) : mg_launch<64, 1, 4, false>(ctx, a);
    default: return swiglu ? mg_launch<128, 2, 2, true>(ctx, a) : mg_launch<128, 2, 2, false>(ctx, a);
    }
}

cm_status kn_cuda_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const int32_t *src, int topk,
                           const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                           int E, int64_t N, int64_t K) {
    const mg_args a = {out0, out1, inp, src, topk, w0, w1, offsets, R, N, K, E};
    return mg_run(ctx, "moe_gemm", &a, false);
}

cm_status kn_cuda_moe_gemm_swiglu(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const int32_t *src, int topk,
                                  const uint16_t *const *wg, const uint16_t *const *wu, const int32_t *offsets,
                                  int64_t R, int E, int64_t N, int64_t K) {
    const mg_args a = {act, NULL, inp, src, topk, wg, wu, offsets, R, N, K, E};
    return mg_run(ctx, "moe_gemm_swiglu", &a, true);
}

cm_status kn_cuda_moe_gemm_fp8(kn_ctx *ctx, float *out0, float *out1, const uint8_t *q, const float *s, int64_t Mq,
                               const int32_t *src, int topk, const uint8_t *const *w0, const float *const *s0,
                               const uint8_t *const *w1, const float *const *s1, const int32_t *offsets, int64_t R,
                               int E, int64_t N, int64_t K) {
    const mg_args a = {out0, out1, (const uint16_t *)q, src, topk, (const uint16_t *const *)w0,
                       (const uint16_t *const *)w1, offsets, R, N, K, E};
    const mg_fp8  f = {s, Mq, s0, s1};
    KN_CUDA_CHECK_ARG(ctx, "moe_gemm_fp8: ctx is NULL");
    KN_CUDA_CHECK_ARG(R >= 0 && N >= 0 && K >= 0 && R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
                          Mq >= 0 && Mq <= INT32_MAX,
                      "moe_gemm_fp8: bad shape R=%lld N=%lld K=%lld Mq=%lld (each in [0, 2^31))", (long long)R,
                      (long long)N, (long long)K, (long long)Mq);
    KN_CUDA_CHECK_ARG(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_gemm_fp8: E=%d experts is outside [1, %d]", E,
                      KN_MOE_MAX_EXPERTS);
    KN_CUDA_CHECK_ARG(!out1 == !w1 && !w1 == !s1, "moe_gemm_fp8: out1, w1 and s1 go together (all or none)");
    KN_CUDA_CHECK_ARG(!src || topk >= 1, "moe_gemm_fp8: topk=%d must be >= 1 with src", topk);
    if (!mg_wgmma_built() || !kn_moe_wgmma_available(ctx)) /* first: a call with no rows asks this alone */
        return CM_FAIL(CM_ERR_UNSUPPORTED, "moe_gemm_fp8: the grouped FP8 kernel needs a GPU of compute capability "
                       "9.0 and a build for architecture 90; run the FP8 experts one gemm_fp8q each instead");
    if (R == 0 || N == 0) return CM_OK;
    KN_CUDA_CHECK_ARG(out0 && q && s && w0 && s0 && offsets, "moe_gemm_fp8: out0, q, s, w0, s0 or offsets is NULL");
    KN_CUDA_CHECK_ARG(K % 16 == 0 && (uintptr_t)q % 16 == 0,
                      "moe_gemm_fp8: K=%lld must be a multiple of 16 and q 16-byte aligned (rows are read 16 bytes "
                      "at a time)", (long long)K);
    return kn_moe_wgmma_fp8_launch(ctx, &a, &f);
}
