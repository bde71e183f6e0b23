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
 * The product: 128 × 128 tiles of fp32 accumulators, 8 warps of 64 × 32 each, mma.sync
 * m16n8k16 on bf16 (kn_mma_sm80.h, sm_80 and later), K in steps of 32 through a 4-stage
 * cp.async ring in shared memory (rows padded to 40 bf16 so that ldmatrix is conflict-free).
 * Rows past the expert's last and columns past N load as zeros and are not stored. The column
 * blocks of one row tile are adjacent CTAs, so a row tile is read from memory about once and
 * served from L2 to the others; with two weight sets (gate and up) both sets' column blocks of
 * a tile are adjacent for the same reason. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_mma_sm80.h"

#define MG_BM      128
#define MG_BN      128
#define MG_BK      32
#define MG_STAGES  4
#define MG_LD      (MG_BK + 8) /* shared-memory row pitch in bf16: 80 bytes */
#define MG_THREADS 256
#define MG_SMEM    ((size_t)MG_STAGES * (MG_BM + MG_BN) * MG_LD * sizeof(bf16)) /* 80 KiB */

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

/* CTA b: row tile tiles[b / (n_sets·nt)], weight set (b / nt) % n_sets, column block b % nt. */
static __global__ void __launch_bounds__(MG_THREADS, 2)
    moe_gemm_kernel(float *out0, float *out1, const bf16 *inp, const bf16 *const *w0, const bf16 *const *w1,
                    const int32_t *offsets, const int2 *tiles, int nt, int n_sets, int N, int K) {
    extern __shared__ __align__(16) unsigned char mg_sm[];
    const int64_t b = blockIdx.x;
    const int2    tl = tiles[b / (n_sets * nt)];
    if (tl.x < 0)
        return;
    const int   e = tl.x, r0 = tl.y, rend = offsets[e + 1], set = (int)(b / nt) % n_sets;
    const int   n0 = (int)(b % nt) * MG_BN;
    const bf16 *W = (set ? w1 : w0)[e];
    float      *out = set ? out1 : out0;
    bf16       *As = (bf16 *)mg_sm, *Bs = As + MG_STAGES * MG_BM * MG_LD;
    const int   tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    const int   ktiles = (K + MG_BK - 1) / MG_BK;

    /* a stage: 128 rows × 4 chunks of 8 bf16 for each operand, 2 chunks of each per thread */
    auto load = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int  c = tid + i * MG_THREADS, row = c >> 2, col = (c & 3) * 8, gk = kt * MG_BK + col;
            const int  gr = r0 + row, gn = n0 + row;
            const bool va = gr < rend && gk < K, vb = gn < N && gk < K;
            cp_async16(As + (stage * MG_BM + row) * MG_LD + col, va ? inp + (int64_t)gr * K + gk : inp, va);
            cp_async16(Bs + (stage * MG_BN + row) * MG_LD + col, vb ? W + (int64_t)gn * K + gk : W, vb);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
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
            uint32_t a[4][4], bf[2][4];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                frag_a_l(a[mi], as, MG_LD, wm * 64 + mi * 16, kk, lane);
#pragma unroll
            for (int nj = 0; nj < 2; nj++)
                frag_b_nk_l(bf[nj], bs, MG_LD, wn * 32 + nj * 16, kk, lane);
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    mma_bf16(acc[mi][2 * nj], a[mi], bf[nj][0], bf[nj][1]);
                    mma_bf16(acc[mi][2 * nj + 1], a[mi], bf[nj][2], bf[nj][3]);
                }
        }
    }
    cp_wait<0>();

    const int  g = lane >> 2, t = lane & 3;
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
            for (int ni = 0; ni < 4; ni++) {
                const int   c = n0 + wn * 32 + ni * 8 + 2 * t;
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
// launcher

cm_status kn_cuda_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const uint16_t *const *w0,
                           const uint16_t *const *w1, const int32_t *offsets, int64_t R, int E, int64_t N,
                           int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "moe_gemm: ctx is NULL");
    KN_CUDA_CHECK_ARG(R >= 0 && N >= 0 && K >= 0 && R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                      "moe_gemm: bad shape R=%lld N=%lld K=%lld (each in [0, 2^31))", (long long)R, (long long)N,
                      (long long)K);
    KN_CUDA_CHECK_ARG(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_gemm: E=%d experts is outside [1, %d]", E,
                      KN_MOE_MAX_EXPERTS);
    KN_CUDA_CHECK_ARG(!out1 == !w1, "moe_gemm: out1 and w1 go together (both or neither)");
    if (R == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out0 && inp && w0 && offsets, "moe_gemm: out0, inp, w0 or offsets is NULL");
    KN_CUDA_CHECK_ARG(K % 8 == 0 && (uintptr_t)inp % 16 == 0,
                      "moe_gemm: K=%lld must be a multiple of 8 and inp 16-byte aligned (rows are read 16 bytes at "
                      "a time); use gemm_bf16in per expert otherwise",
                      (long long)K);
    if (K == 0) {
        /* an empty sum: zeros, as the reference writes */
        KN_CUDA(cudaMemsetAsync(out0, 0, (size_t)(R * N) * sizeof(float), ctx->stream));
        if (out1)
            KN_CUDA(cudaMemsetAsync(out1, 0, (size_t)(R * N) * sizeof(float), ctx->stream));
        return CM_OK;
    }
    const int64_t n_slots = R / MG_BM + E + 1, nt = (N + MG_BN - 1) / MG_BN, n_sets = out1 ? 2 : 1;
    const int64_t grid = n_slots * nt * n_sets;
    KN_CUDA_CHECK_ARG(grid <= INT32_MAX, "moe_gemm: R=%lld rows x N=%lld columns need more CTAs than one launch "
                      "holds; split the rows", (long long)R, (long long)N);
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)n_slots * sizeof(int2)));
    int2 *tiles = (int2 *)ctx->scratch;
    moe_tiles_kernel<<<1, 1024, 0, ctx->stream>>>(tiles, n_slots, offsets, E);
    KN_CUDA_LAUNCHED(ctx);
    KN_CUDA(cudaFuncSetAttribute(moe_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MG_SMEM));
    moe_gemm_kernel<<<(unsigned)grid, MG_THREADS, MG_SMEM, ctx->stream>>>(
        out0, out1, (const bf16 *)inp, (const bf16 *const *)w0, (const bf16 *const *)w1, offsets, tiles, (int)nt,
        (int)n_sets, (int)N, (int)K);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
