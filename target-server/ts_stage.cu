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
    /* streaming (ts_stage_put / ts_stage_wait): fixed slots of slot_bytes */
    cudaStream_t        copy;
    size_t              slot_bytes;
    int                 n_slots;
    cudaEvent_t         ready[TS_STAGE_MAX], copied[TS_STAGE_MAX];
    unsigned long long *host_counts; /* page-locked: [non-finite, non-zero] per slot */
    size_t              elems[TS_STAGE_MAX];
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
    if (s->copy)
        cudaStreamSynchronize(s->copy);
    cudaStreamSynchronize(s->ctx->stream);
    for (int i = 0; i < s->n_slots; i++) {
        cudaEventDestroy(s->ready[i]);
        cudaEventDestroy(s->copied[i]);
    }
    if (s->copy)
        cudaStreamDestroy(s->copy);
    cudaFreeHost(s->host_counts);
    cudaFree(s->mem);
    cudaFree(s->counts);
    free(s);
    *sp = NULL;
}

/* The staging memory at least bytes and the check counters for n layers (contents dead). */
static cm_status stage_fit(ts_stage *s, size_t bytes, int n) {
    if (bytes > s->cap) {
        cudaFree(s->mem);
        s->mem = NULL;
        s->cap = 0;
        KN_CUDA(cudaMalloc(&s->mem, bytes));
        s->cap = bytes;
    }
    if (n > s->cap_layers) {
        cudaFree(s->counts);
        s->counts = NULL;
        s->cap_layers = 0;
        KN_CUDA(cudaMalloc((void **)&s->counts, 2 * sizeof(unsigned long long) * (size_t)n));
        s->cap_layers = n;
    }
    return CM_OK;
}

static int round_blocks(size_t elems) {
    return (int)((elems + 255) / 256 < 4096 ? (elems + 255) / 256 : 4096);
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
    CM_TRY(stage_fit(s, need, n));
    KN_CUDA(cudaMemsetAsync(s->counts, 0, 2 * sizeof(unsigned long long) * (size_t)n, ctx->stream));
    const size_t elems = (size_t)T * (size_t)D;
    const int    threads = 256, blocks = round_blocks(elems);
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

extern "C" cm_status ts_stage_reserve(ts_stage *s, int n, int64_t T, int64_t D, cm_dtype dt) {
    kn_ctx *ctx = s->ctx;
    if (dt != CM_DTYPE_BF16 && dt != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "captures are sent as BF16 or F32, not %s", cm_dtype_name(dt));
    if (n < 1 || n > TS_STAGE_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d layers in one answer; expected 1 to %d", n, TS_STAGE_MAX);
    const size_t slot = ((size_t)T * (size_t)D * cm_dtype_size(dt) + 255) & ~(size_t)255;
    if (slot <= s->slot_bytes && n <= s->n_slots)
        return CM_OK;
    KN_CUDA(cudaSetDevice(ctx->device));
    if (!s->copy)
        KN_CUDA(cudaStreamCreateWithFlags(&s->copy, cudaStreamNonBlocking));
    if (!s->host_counts)
        KN_CUDA(cudaHostAlloc((void **)&s->host_counts, 2 * sizeof(unsigned long long) * TS_STAGE_MAX,
                              cudaHostAllocDefault));
    /* slots in use may still be copied out: let every copy finish before the memory moves */
    KN_CUDA(cudaStreamSynchronize(s->copy));
    KN_CUDA(cudaStreamSynchronize(ctx->stream));
    const size_t bytes = (slot > s->slot_bytes ? slot : s->slot_bytes) * (size_t)(n > s->n_slots ? n : s->n_slots);
    CM_TRY(stage_fit(s, bytes, n));
    for (; s->n_slots < n; s->n_slots++) {
        KN_CUDA(cudaEventCreateWithFlags(&s->ready[s->n_slots], cudaEventDisableTiming));
        KN_CUDA(cudaEventCreateWithFlags(&s->copied[s->n_slots], cudaEventDisableTiming));
    }
    if (slot > s->slot_bytes)
        s->slot_bytes = slot;
    return CM_OK;
}

extern "C" cm_status ts_stage_put(ts_stage *s, int i, const float *x, int64_t T, int64_t D, cm_dtype dt,
                                  void *host) {
    kn_ctx *ctx = s->ctx;
    CM_TRY(ts_stage_reserve(s, i + 1, T, D, dt));
    KN_CUDA(cudaSetDevice(ctx->device));
    const size_t elems = (size_t)T * (size_t)D, bytes = elems * cm_dtype_size(dt);
    uint8_t     *dst = (uint8_t *)s->mem + s->slot_bytes * (size_t)i;
    /* the slot's previous copy (an answer that failed midway is not waited for) ends first */
    KN_CUDA(cudaStreamWaitEvent(ctx->stream, s->copied[i], 0));
    KN_CUDA(cudaMemsetAsync(s->counts + 2 * i, 0, 2 * sizeof(unsigned long long), ctx->stream));
    if (elems && dt == CM_DTYPE_BF16)
        round_check<__nv_bfloat16>
            <<<round_blocks(elems), 256, 0, ctx->stream>>>((__nv_bfloat16 *)dst, x, elems, s->counts + 2 * i);
    else if (elems)
        round_check<float><<<round_blocks(elems), 256, 0, ctx->stream>>>((float *)dst, x, elems, s->counts + 2 * i);
    KN_CUDA_LAUNCHED(ctx);
    KN_CUDA(cudaEventRecord(s->ready[i], ctx->stream));
    KN_CUDA(cudaStreamWaitEvent(s->copy, s->ready[i], 0));
    KN_CUDA(cudaMemcpyAsync(host, dst, bytes, cudaMemcpyDeviceToHost, s->copy));
    KN_CUDA(cudaMemcpyAsync(s->host_counts + 2 * i, s->counts + 2 * i, 2 * sizeof(unsigned long long),
                            cudaMemcpyDeviceToHost, s->copy));
    KN_CUDA(cudaEventRecord(s->copied[i], s->copy));
    s->elems[i] = elems;
    return CM_OK;
}

extern "C" cm_status ts_stage_wait(ts_stage *s, int i, int layer, uint64_t batch) {
    if (i < 0 || i >= s->n_slots)
        return CM_FAIL(CM_ERR_INVALID_ARG, "staging slot %d was never filled", i);
    KN_CUDA(cudaSetDevice(s->ctx->device)); /* this may be another thread */
    KN_CUDA(cudaEventSynchronize(s->copied[i]));
    const unsigned long long bad = s->host_counts[2 * i], nonzero = s->host_counts[2 * i + 1];
    if (bad)
        return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture holds %llu NaN/Inf values; refusing to send it",
                       (unsigned long long)batch, layer, bad);
    if (!nonzero && s->elems[i])
        return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture is all zeros; refusing to send it",
                       (unsigned long long)batch, layer);
    return CM_OK;
}
