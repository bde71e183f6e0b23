/* target-server/ts_nccl.cu — the server side of the NCCL data path (ts_nccl.h): rounding of
 * the captured layers into staging memory fused with the NaN/Inf/all-zero check, then
 * ncclSend through common/cm_nccl. */
#include "ts_nccl.h"

#include <cuda_bf16.h>
#include <stdlib.h>

#include "cm_log.h"
#include "cm_nccl.h"
#include "kn_cuda.h"

struct ts_nccl_peer {
    cm_nccl_peer       *nc;
    int                 device;
    void               *staging; /* the answer being sent (or last sent) */
    size_t              cap;
    unsigned long long *counts; /* device: [non-finite, non-zero] per layer */
    int                 cap_layers;
    int                 in_flight; /* sends enqueued and not yet waited for */
};

/* out[i] = round(x[i]) to T_OUT; counts[0] += non-finite values, counts[1] += non-zero values. */
template <typename T_OUT>
__global__ void round_check(T_OUT *out, const float *x, size_t n, unsigned long long *counts) {
    unsigned long long bad = 0, nz = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        bad += !isfinite(v);
        nz += v != 0.0f;
        if constexpr (sizeof(T_OUT) == 2)
            out[i] = __float2bfloat16_rn(v);
        else
            out[i] = v;
    }
    for (int o = 16; o > 0; o >>= 1) {
        bad += __shfl_down_sync(0xffffffffu, bad, o);
        nz += __shfl_down_sync(0xffffffffu, nz, o);
    }
    if ((threadIdx.x & 31) == 0 && (bad || nz)) {
        atomicAdd(&counts[0], bad);
        atomicAdd(&counts[1], nz);
    }
}

extern "C" cm_status ts_nccl_open(ts_nccl_peer **out, const cm_proto_nccl *offer, kn_ctx *ctx, int timeout_ms) {
    *out = NULL;
    ts_nccl_peer *p = (ts_nccl_peer *)calloc(1, sizeof *p);
    if (!p)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate an NCCL peer");
    p->device = ctx->device;
    cm_status st = cm_nccl_peer_open(&p->nc, offer, 1, ctx->device, timeout_ms);
    if (st != CM_OK) {
        free(p);
        return st;
    }
    *out = p;
    return CM_OK;
}

extern "C" void ts_nccl_close(ts_nccl_peer **pp) {
    if (!pp || !*pp)
        return;
    ts_nccl_peer *p = *pp;
    cm_nccl_peer_close(&p->nc);
    cudaSetDevice(p->device);
    cudaFree(p->staging);
    cudaFree(p->counts);
    free(p);
    *pp = NULL;
}

extern "C" cm_status ts_nccl_send(ts_nccl_peer *p, kn_ctx *ctx, float *const *dev, const int32_t *layers, int n,
                                  int64_t T, int64_t D, cm_dtype dt, uint64_t batch, int timeout_ms) {
    if (dt != CM_DTYPE_BF16 && dt != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "NCCL answers are BF16 or F32, not %s", cm_dtype_name(dt));
    if (n > 256)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d layers in one answer; at most 256", n);
    KN_CUDA(cudaSetDevice(p->device));
    if (p->in_flight) { /* the staging memory is the previous answer's until its sends are done */
        CM_TRY(cm_nccl_peer_wait(p->nc, timeout_ms));
        p->in_flight = 0;
    }
    const size_t es = cm_dtype_size(dt), per = (size_t)T * (size_t)D * es;
    const size_t stride = (per + 255) & ~(size_t)255, need = stride * (size_t)n;
    if (need > p->cap) {
        cudaFree(p->staging);
        p->staging = NULL;
        p->cap = 0;
        KN_CUDA(cudaMalloc(&p->staging, need));
        p->cap = need;
    }
    if (n > p->cap_layers) {
        cudaFree(p->counts);
        p->counts = NULL;
        p->cap_layers = 0;
        KN_CUDA(cudaMalloc((void **)&p->counts, 2 * sizeof(unsigned long long) * (size_t)n));
        p->cap_layers = n;
    }
    KN_CUDA(cudaMemsetAsync(p->counts, 0, 2 * sizeof(unsigned long long) * (size_t)n, ctx->stream));
    const size_t elems = (size_t)T * (size_t)D;
    const int    threads = 256;
    const int    blocks = (int)((elems + threads - 1) / threads < 4096 ? (elems + threads - 1) / threads : 4096);
    const void  *bufs[256];
    size_t       bytes[256];
    for (int i = 0; i < n; i++) {
        uint8_t *dst = (uint8_t *)p->staging + stride * (size_t)i;
        if (dt == CM_DTYPE_BF16)
            round_check<__nv_bfloat16><<<blocks, threads, 0, ctx->stream>>>((__nv_bfloat16 *)dst, dev[i], elems,
                                                                            p->counts + 2 * i);
        else
            round_check<float><<<blocks, threads, 0, ctx->stream>>>((float *)dst, dev[i], elems, p->counts + 2 * i);
        KN_CUDA_LAUNCHED(ctx);
        bufs[i] = dst;
        bytes[i] = per;
    }
    unsigned long long counts[512];
    KN_CUDA(cudaMemcpyAsync(counts, p->counts, 2 * sizeof(unsigned long long) * (size_t)n, cudaMemcpyDeviceToHost,
                            ctx->stream));
    KN_CUDA(cudaStreamSynchronize(ctx->stream)); /* the staging memory is complete from here on */
    for (int i = 0; i < n; i++) {
        if (counts[2 * i])
            return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture holds %llu NaN/Inf values; refusing to send it",
                           (unsigned long long)batch, layers[i], counts[2 * i]);
        if (!counts[2 * i + 1] && elems)
            return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture is all zeros; refusing to send it",
                           (unsigned long long)batch, layers[i]);
    }
    CM_TRY(cm_nccl_peer_send(p->nc, bufs, bytes, n));
    p->in_flight = 1;
    return CM_OK;
}
