/* kernels/kn_moe.cu — the mixture-of-experts ops on CUDA (kn_backend.h, "mixture of experts";
 * the specification is ref/kn_moe_ref.c).
 *   route    one warp per token (4 per CTA): the logits into shared memory, the max by shuffles,
 *            expf(l − m), then lane 0 sums the row serially in expert order and every p is an IEEE
 *            division by that sum: the reference's fp32 operations in its order, so p differs only
 *            by expf's ulps (CUDA's expf is within 2 ulp) and the choice is the reference's unless
 *            two p are within rounding of a tie. A serial sum of E ≤ 1024 shared-memory values is
 *            a few µs per warp, hidden by the other tokens' warps; a tree sum would move w by
 *            ~sqrt(E) ulps and could reorder near ties. Top-K: K rounds of a warp argmax (each lane
 *            its strided experts, then a butterfly on (p, index), ties to the lower index), the
 *            winner marked −inf; a NaN p ranks as −1, below every number, as in the reference.
 *   group    a stable counting sort in three launches, no atomics in the placement: per chunk of
 *            assignments a histogram (shared-memory integer atomics: counts are order-free); one
 *            CTA scans the [chunks, E] table down each expert's column and across experts
 *            (offsets); one warp per chunk places its assignments in order, 32 at a time, each
 *            lane's rank among its expert's lanes from __match_any_sync. The table lives in
 *            ctx->scratch (chunks ≤ 1024, so at most 4 MiB).
 *   gather   a row copy (src[j] / K → j) in the widest word the row length and alignment allow.
 *   combine  one CTA per token, a thread per column: Σ_k w·y in k order from 0.0f, with
 *            __fmul_rn / __fadd_rn so the product and the sum round separately as the reference's do,
 *            then + sigmoid(sgate)·shared.
 * Every op writes its outputs (=); none accumulates. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#define MOE_ROUTE_WARPS 4    /* tokens per CTA of route */
#define MOE_CHUNK       1024 /* least assignments per chunk of group */
#define MOE_MAX_CHUNKS  1024 /* most chunks of group (bounds the scan and the scratch) */

// ----------------------------------------------------------------------------
// kernels

/* Shared memory: per warp p [E] and the selection key [E] (p; −1 for a NaN; −inf once taken). */
static __global__ void moe_route_kernel(int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                                        int renorm) {
    extern __shared__ float route_sm[];
    const int     warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= T)
        return;
    float       *p = route_sm + (size_t)warp * 2 * E, *key = p + E;
    const float *l = logits + t * E;
    float        m = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        p[e] = l[e];
        m = fmaxf(m, p[e]);
    }
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int e = lane; e < E; e += 32)
        p[e] = expf(p[e] - m);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (int e = 0; e < E; e++)
            sum += p[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    __syncwarp(); /* lane 0's reads of p before the lanes overwrite it */
    for (int e = lane; e < E; e += 32) {
        p[e] = p[e] / sum;
        key[e] = p[e] >= 0.0f ? p[e] : -1.0f;
    }
    __syncwarp();
    int32_t *ti = idx + t * K;
    float   *tw = w + t * K;
    float    s = 0.0f; /* lane 0: the chosen p summed in k order */
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int   bi = E;
        for (int e = lane; e < E; e += 32)
            if (key[e] > bv)
                bv = key[e], bi = e;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int   oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi))
                bv = ov, bi = oi;
        }
        /* K ≤ E leaves an untaken expert every round, so bi < E */
        if (lane == (bi & 31))
            key[bi] = -INFINITY;
        if (lane == 0) {
            ti[k] = bi;
            tw[k] = p[bi];
            s += p[bi];
        }
    }
    if (renorm && lane == 0)
        for (int k = 0; k < K; k++)
            tw[k] = tw[k] / s;
}

/* cnt[c, e] = the assignments of chunk c routed to expert e (an index outside [0, E) to none). */
static __global__ void moe_count_kernel(int32_t *cnt, const int32_t *idx, int64_t n, int64_t chunk, int E) {
    extern __shared__ int32_t hist[];
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[e] = 0;
    __syncthreads();
    const int64_t a0 = (int64_t)blockIdx.x * chunk, a1 = min(a0 + chunk, n);
    for (int64_t a = a0 + threadIdx.x; a < a1; a += blockDim.x) {
        const int32_t e = idx[a];
        if (e >= 0 && e < E)
            atomicAdd(&hist[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[(int64_t)blockIdx.x * E + e] = hist[e];
}

/* One CTA of 1024 threads, thread e for expert e: cnt[c, e] becomes the exclusive sum of
 * column e over the chunks before c, and offsets the exclusive sum of the column totals. */
static __global__ void moe_scan_kernel(int32_t *offsets, int32_t *cnt, int64_t n_chunks, int E) {
    __shared__ int32_t wsum[32];
    const int          e = threadIdx.x;
    int32_t            run = 0, total;
    if (e < E)
        for (int64_t c = 0; c < n_chunks; c++) {
            const int32_t v = cnt[c * E + e];
            cnt[c * E + e] = run;
            run += v;
        }
    const int32_t incl = block_incl_scan_1024(run, wsum, &total);
    if (e < E)
        offsets[e] = incl - run;
    if (e == E - 1)
        offsets[E] = incl;
}

/* One warp per chunk: the chunk's assignments in order, 32 at a time; lanes with the same
 * expert take consecutive rows in lane order, and the group's highest lane advances the cursor. */
static __global__ void moe_place_kernel(int32_t *src, int32_t *dst, const int32_t *idx, const int32_t *offsets,
                                        const int32_t *cnt, int64_t n, int64_t chunk, int E) {
    extern __shared__ int32_t next[];
    const int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32)
        next[e] = offsets[e] + cnt[(int64_t)blockIdx.x * E + e];
    __syncwarp();
    const int64_t a0 = (int64_t)blockIdx.x * chunk, a1 = min(a0 + chunk, n);
    for (int64_t b = a0; b < a1; b += 32) {
        const int64_t  a = b + lane;
        int32_t        e = a < a1 ? idx[a] : -1;
        const int      ok = e >= 0 && e < E;
        const unsigned peers = __match_any_sync(0xffffffffu, ok ? e : -1);
        const int      rank = __popc(peers & ((1u << lane) - 1u));
        if (ok) {
            const int32_t j = next[e] + rank;
            src[j] = (int32_t)a;
            dst[a] = j;
        } else if (a < a1) {
            dst[a] = -1;
        }
        __syncwarp();
        if (ok && lane == 31 - __clz(peers))
            next[e] += __popc(peers);
        __syncwarp();
    }
}

/* out [n, nw] words, row j from row src[j] / K of in (a zero row for a src outside [0, n)). */
template <typename W>
static __global__ void moe_gather_kernel(W *out, const W *in, const int32_t *src, int64_t n, int K, int64_t nw) {
    const W zero = {};
    for (int64_t j = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; j < n; j += (int64_t)gridDim.y * blockDim.y) {
        const int32_t s = src[j];
        const int     ok = s >= 0 && s < n;
        const W      *r = in + (ok ? (int64_t)(s / K) : 0) * nw;
        W            *o = out + j * nw;
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nw; c += (int64_t)gridDim.x * blockDim.x)
            o[c] = ok ? r[c] : zero;
    }
}

static __global__ void moe_combine_kernel(float *out, const float *y, const int32_t *dst, const float *w,
                                          const float *shared, const float *sgate, int64_t T, int K, int64_t D) {
    const int64_t n = T * K;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const float g = shared ? 1.0f / (1.0f + expf(-sgate[t])) : 0.0f;
        for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                const int32_t j = dst[t * K + k];
                if (j >= 0 && j < n)
                    acc = __fadd_rn(acc, __fmul_rn(w[t * K + k], y[(int64_t)j * D + d]));
            }
            if (shared)
                acc = __fadd_rn(acc, __fmul_rn(g, shared[t * D + d]));
            out[t * D + d] = acc;
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

static cm_status moe_rows_check(const char *op, int64_t T, int K) {
    KN_CUDA_CHECK_ARG(T >= 0 && K >= 1, "%s: bad shape T=%lld K=%d (T must be >= 0, K >= 1)", op, (long long)T, K);
    KN_CUDA_CHECK_ARG(T <= INT32_MAX / K, "%s: T=%lld x K=%d assignments do not fit the I32 tables", op,
                      (long long)T, K);
    return CM_OK;
}

cm_status kn_cuda_moe_route(kn_ctx *ctx, int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                            int renorm) {
    KN_CUDA_CHECK_ARG(ctx, "moe_route: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0, "moe_route: T=%lld must be >= 0", (long long)T);
    KN_CUDA_CHECK_ARG(K >= 1 && K <= E && E <= KN_MOE_MAX_EXPERTS,
                      "moe_route: bad experts E=%d K=%d (need 1 <= K <= E <= %d)", E, K, KN_MOE_MAX_EXPERTS);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(idx && w && logits, "moe_route: idx, w or logits is NULL");
    const size_t smem = (size_t)MOE_ROUTE_WARPS * 2 * (size_t)E * sizeof(float); /* ≤ 32 KiB */
    const unsigned grid = (unsigned)((T + MOE_ROUTE_WARPS - 1) / MOE_ROUTE_WARPS);
    moe_route_kernel<<<grid, 32 * MOE_ROUTE_WARPS, smem, ctx->stream>>>(idx, w, logits, T, E, K, renorm);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_moe_group(kn_ctx *ctx, int32_t *offsets, int32_t *src, int32_t *dst, const int32_t *idx,
                            int64_t T, int E, int K) {
    KN_CUDA_CHECK_ARG(ctx, "moe_group: ctx is NULL");
    CM_TRY(moe_rows_check("moe_group", T, K));
    KN_CUDA_CHECK_ARG(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_group: E=%d experts is outside [1, %d]", E,
                      KN_MOE_MAX_EXPERTS);
    KN_CUDA_CHECK_ARG(offsets, "moe_group: offsets is NULL");
    const int64_t n = T * K;
    if (n == 0) {
        KN_CUDA(cudaMemsetAsync(offsets, 0, (size_t)(E + 1) * sizeof(int32_t), ctx->stream));
        return CM_OK;
    }
    KN_CUDA_CHECK_ARG(src && dst && idx, "moe_group: src, dst or idx is NULL");
    /* chunks of at least MOE_CHUNK, at most MOE_MAX_CHUNKS of them, a multiple of the warp */
    int64_t chunk = (n + MOE_MAX_CHUNKS - 1) / MOE_MAX_CHUNKS;
    chunk = chunk < MOE_CHUNK ? MOE_CHUNK : (chunk + 31) / 32 * 32;
    const int64_t n_chunks = (n + chunk - 1) / chunk;
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(n_chunks * E) * sizeof(int32_t)));
    int32_t     *cnt = (int32_t *)ctx->scratch;
    const size_t hist = (size_t)E * sizeof(int32_t);
    moe_count_kernel<<<(unsigned)n_chunks, 256, hist, ctx->stream>>>(cnt, idx, n, chunk, E);
    KN_CUDA_LAUNCHED(ctx);
    moe_scan_kernel<<<1, 1024, 0, ctx->stream>>>(offsets, cnt, n_chunks, E);
    KN_CUDA_LAUNCHED(ctx);
    moe_place_kernel<<<(unsigned)n_chunks, 32, hist, ctx->stream>>>(src, dst, idx, offsets, cnt, n, chunk, E);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <typename W>
static void moe_gather_launch(kn_ctx *ctx, void *out, const void *in, const int32_t *src, int64_t n, int K,
                              int64_t row_bytes) {
    const int64_t nw = row_bytes / (int64_t)sizeof(W);
    const int     bx = nw >= 256 ? 256 : (int)((nw + 31) / 32 * 32), by = 256 / bx;
    const int64_t gx = (nw + bx - 1) / bx, gy = (n + by - 1) / by;
    dim3          grid((unsigned)(gx < 1024 ? gx : 1024), (unsigned)(gy < 65535 ? gy : 65535));
    moe_gather_kernel<W><<<grid, dim3(bx, by), 0, ctx->stream>>>((W *)out, (const W *)in, src, n, K, nw);
}

cm_status kn_cuda_moe_gather(kn_ctx *ctx, void *out, const void *in, cm_dtype dt, const int32_t *src, int64_t T,
                             int K, int64_t D) {
    KN_CUDA_CHECK_ARG(ctx, "moe_gather: ctx is NULL");
    CM_TRY(moe_rows_check("moe_gather", T, K));
    KN_CUDA_CHECK_ARG(D >= 0, "moe_gather: D=%lld must be >= 0", (long long)D);
    if (dt != CM_DTYPE_F32 && dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "moe_gather: dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(dt));
    const int64_t n = T * K;
    if (n == 0 || D == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && in && src, "moe_gather: out, in or src is NULL");
    const int64_t   row = D * (int64_t)cm_dtype_size(dt);
    const uintptr_t al = (uintptr_t)out | (uintptr_t)in;
    if (row % 16 == 0 && al % 16 == 0)
        moe_gather_launch<uint4>(ctx, out, in, src, n, K, row);
    else if (row % 4 == 0 && al % 4 == 0)
        moe_gather_launch<uint32_t>(ctx, out, in, src, n, K, row);
    else
        moe_gather_launch<uint16_t>(ctx, out, in, src, n, K, row);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_moe_combine(kn_ctx *ctx, float *out, const float *y, const int32_t *dst, const float *w,
                              const float *shared, const float *sgate, int64_t T, int K, int64_t D) {
    KN_CUDA_CHECK_ARG(ctx, "moe_combine: ctx is NULL");
    CM_TRY(moe_rows_check("moe_combine", T, K));
    KN_CUDA_CHECK_ARG(D >= 0, "moe_combine: D=%lld must be >= 0", (long long)D);
    if (T == 0 || D == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && y && dst && w, "moe_combine: out, y, dst or w is NULL");
    KN_CUDA_CHECK_ARG(!shared || sgate, "moe_combine: shared is given without sgate");
    const int block = D >= 256 ? 256 : (int)((D + 31) / 32 * 32);
    moe_combine_kernel<<<(unsigned)(T < (1 << 20) ? T : (1 << 20)), block, 0, ctx->stream>>>(out, y, dst, w, shared,
                                                                                           sgate, T, K, D);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
