/* target-server/ts_stage.cu — captured layers rounded and checked on the GPU (ts_stage.h). */
#include "ts_stage.h"

#include <cuda_bf16.h>
#include <stdlib.h>

#include "kn_cuda.h"

#define TS_STAGE_MAX 256

struct ts_stage {
    kn_ctx             *ctx;
    void               *mem; /* the rounded layers, 256-byte strides */
    size_t              cap;
    unsigned long long *counts; /* device: [non-finite, non-zero] per layer */
    int                 cap_layers;
};

/* out[i] = round(x[i]) to T_OUT; counts[0] += non-finite values, counts[1] += non-zero values. */
template <typename T_OUT>
__global__ void round_check(T_OUT *out, const float *x, size_t n, unsigned long long *counts) {
    unsigned long long bad = 0, nz = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
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

extern "C" cm_status ts_stage_create(ts_stage **out, kn_ctx *ctx) {
    *out = (ts_stage *)calloc(1, sizeof **out);
    if (!*out)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the capture staging state");
    (*out)->ctx = ctx;
    return CM_OK;
}

extern "C" void ts_stage_destroy(ts_stage **sp) {
    if (!sp || !*sp)
        return;
    ts_stage *s = *sp;
    cudaSetDevice(s->ctx->device);
    cudaFree(s->mem);
    cudaFree(s->counts);
    free(s);
    *sp = NULL;
}

extern "C" cm_status ts_stage_round(ts_stage *s, float *const *dev, const int32_t *layers, int n, int64_t T,
                                    int64_t D, cm_dtype dt, uint64_t batch, const void **out) {
    kn_ctx *ctx = s->ctx;
    if (dt != CM_DTYPE_BF16 && dt != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "captures are sent as BF16 or F32, not %s", cm_dtype_name(dt));
    if (n > TS_STAGE_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d layers in one answer; at most %d", n, TS_STAGE_MAX);
    KN_CUDA(cudaSetDevice(ctx->device));
    const size_t es = cm_dtype_size(dt), per = (size_t)T * (size_t)D * es;
    const size_t stride = (per + 255) & ~(size_t)255, need = stride * (size_t)n;
    if (need > s->cap) {
        cudaFree(s->mem);
        s->mem = NULL;
        s->cap = 0;
        KN_CUDA(cudaMalloc(&s->mem, need));
        s->cap = need;
    }
    if (n > s->cap_layers) {
        cudaFree(s->counts);
        s->counts = NULL;
        s->cap_layers = 0;
        KN_CUDA(cudaMalloc((void **)&s->counts, 2 * sizeof(unsigned long long) * (size_t)n));
        s->cap_layers = n;
    }
    KN_CUDA(cudaMemsetAsync(s->counts, 0, 2 * sizeof(unsigned long long) * (size_t)n, ctx->stream));
    const size_t elems = (size_t)T * (size_t)D;
    const int    threads = 256;
    const int blocks = (int)((elems + threads - 1) / threads < 4096 ? (elems + threads - 1) / threads : 4096);
    for (int i = 0; i < n; i++) {
        uint8_t *dst = (uint8_t *)s->mem + stride * (size_t)i;
        if (elems && dt == CM_DTYPE_BF16)
            round_check<__nv_bfloat16>
                <<<blocks, threads, 0, ctx->stream>>>((__nv_bfloat16 *)dst, dev[i], elems, s->counts + 2 * i);
        else if (elems)
            round_check<float>
                <<<blocks, threads, 0, ctx->stream>>>((float *)dst, dev[i], elems, s->counts + 2 * i);
        KN_CUDA_LAUNCHED(ctx);
        out[i] = dst;
    }
    unsigned long long counts[2 * TS_STAGE_MAX];
    KN_CUDA(cudaMemcpyAsync(counts, s->counts, 2 * sizeof(unsigned long long) * (size_t)n,
                            cudaMemcpyDeviceToHost, ctx->stream));
    KN_CUDA(cudaStreamSynchronize(ctx->stream)); /* the staging memory is complete from here on */
    for (int i = 0; i < n; i++) {
        if (counts[2 * i])
            return CM_FAIL(CM_ERR_FORMAT,
                           "batch %llu: layer %d capture holds %llu NaN/Inf values; refusing to send it",
                           (unsigned long long)batch, layers[i], counts[2 * i]);
        if (!counts[2 * i + 1] && elems)
            return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture is all zeros; refusing to send it",
                           (unsigned long long)batch, layers[i]);
    }
    return CM_OK;
}

extern "C" cm_status ts_stage_download(ts_stage *s, float *const *dev, const int32_t *layers, int n,
                                       int64_t T, int64_t D, cm_dtype dt, uint64_t batch, void *const *host) {
    const void *staged[TS_STAGE_MAX];
    CM_TRY(ts_stage_round(s, dev, layers, n, T, D, dt, batch, staged));
    const size_t bytes = (size_t)T * (size_t)D * cm_dtype_size(dt);
    for (int i = 0; i < n; i++)
        KN_CUDA(cudaMemcpyAsync(host[i], staged[i], bytes, cudaMemcpyDeviceToHost, s->ctx->stream));
    KN_CUDA(cudaStreamSynchronize(s->ctx->stream));
    return CM_OK;
}
