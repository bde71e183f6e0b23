/* kernels/kn_memory.cu — the CUDA context and memory: ctx_create selects the device and
 * makes one non-blocking compute stream, a cuBLASLt handle and a 32 MiB workspace; alloc is
 * cudaMalloc followed by a zero fill enqueued on the stream; upload and download are
 * cudaMemcpyAsync on the stream followed by a stream synchronise (so host buffers may be
 * reused, or read, when they return: pageable or pinned alike); copy2d is one
 * cudaMemcpy2DAsync (device to device, pitched). The GEMM scratch buffer grows here. No
 * kernels: every transfer is a copy-engine operation. ctx_create also reads the run-time
 * switches the context holds (kn_cuda.h's table). The calling thread must have the
 * context's device current (ctx_create makes it current on the creating thread). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

// ----------------------------------------------------------------------------
// context

static cm_status ctx_init(kn_ctx *ctx) {
    KN_CUDA(cudaSetDevice(ctx->device));
    KN_CUDA(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    KN_CUBLAS(cublasLtCreate(&ctx->lt));
    KN_CUDA(cudaMalloc(&ctx->lt_ws, KN_CUDA_LT_WORKSPACE_BYTES));
    ctx->lt_ws_bytes = KN_CUDA_LT_WORKSPACE_BYTES;
    return CM_OK;
}

/* The run-time switches of kn_cuda.h's table that the context holds, read once. */
static void ctx_switches_read(kn_ctx *ctx) {
    const char *p = getenv("TANDEM_GEMM_PLAN");
    ctx->lt_plan_mode = p && strcmp(p, "0") == 0 ? 2 : 1;
    const char *t = getenv("TANDEM_GEMM_AUTOTUNE");
    int         k = t ? atoi(t) : 0;
    ctx->lt_autotune = k < 0 ? 0 : k > KN_LT_TUNE_MAX ? KN_LT_TUNE_MAX : k;
    const char *a = getenv("TANDEM_ATTN_KERNEL");
    ctx->attn_force = !a                          ? 0
                      : strcmp(a, "wmma") == 0  ? 1
                      : strcmp(a, "fa2-2") == 0 ? 2
                      : strcmp(a, "fa2") == 0   ? 3
                                                : 0;
    const char *g = getenv("TANDEM_GDN_KERNEL");
    ctx->gdn_force = g && strcmp(g, "mma") == 0;
    const char *d = getenv("TANDEM_DFLASH_KERNEL");
    ctx->dflash_wgmma = d && strcmp(d, "wgmma") == 0;
    const char *f = getenv("TANDEM_FP8_GEMM");
    ctx->fp8_wgmma = f && strcmp(f, "wgmma") == 0;
}

cm_status kn_cuda_ctx_create(kn_ctx **out, const kn_ctx_config *cfg) {
    KN_CUDA_CHECK_ARG(out, "ctx_create: out is NULL");
    *out = NULL;
    kn_ctx_config c = KN_CTX_CONFIG_DEFAULT;
    if (cfg)
        c = *cfg;
    KN_CUDA_CHECK_ARG(c.gemm_mode == KN_GEMM_MODE_BF16 || c.gemm_mode == KN_GEMM_MODE_F32,
                      "ctx_create: unknown gemm_mode %d (use KN_GEMM_MODE_BF16 or KN_GEMM_MODE_F32)",
                      (int)c.gemm_mode);

    int         n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear it: no device is not a sticky error */
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "no cuda device: cudaGetDeviceCount failed: %s (%s); use the cpu backend",
                       cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (n_dev == 0)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "no cuda device on this machine; use the cpu backend");
    KN_CUDA_CHECK_ARG(c.device >= 0 && c.device < n_dev,
                      "ctx_create: cuda device %d does not exist (this machine has %d: 0..%d)", c.device,
                      n_dev, n_dev - 1);

    kn_ctx *ctx = (kn_ctx *)calloc(1, sizeof *ctx);
    if (!ctx)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a cuda kernel context");
    ctx->device = c.device;
    ctx->gemm_mode = c.gemm_mode;
    ctx_switches_read(ctx);
    cm_status st = ctx_init(ctx);
    if (st != CM_OK) {
        kn_cuda_ctx_destroy(&ctx);
        return st;
    }
    *out = ctx;
    return CM_OK;
}

cm_status kn_cuda_ctx_bind(kn_ctx *ctx) {
    KN_CUDA(cudaSetDevice(ctx->device));
    return CM_OK;
}

void kn_cuda_ctx_destroy(kn_ctx **pctx) {
    if (!pctx || !*pctx)
        return;
    kn_ctx *ctx = *pctx;
    if (ctx->stream)
        cudaStreamSynchronize(ctx->stream);
    cudaFree(ctx->scratch);
    cudaFree(ctx->lt_ws);
    kn_cuda_lt_plans_release(ctx); /* the GEMM plans' descriptors (kn_gemm_plan.cu) */
    if (ctx->lt)
        cublasLtDestroy(ctx->lt);
    if (ctx->stream)
        cudaStreamDestroy(ctx->stream);
    free(ctx);
    *pctx = NULL;
}

cm_status kn_cuda_scratch_reserve(kn_ctx *ctx, size_t bytes) {
    if (bytes <= ctx->scratch_bytes)
        return CM_OK;
    size_t want = bytes + bytes / 4; /* some headroom so a slowly growing shape does not realloc each call */
    if (want < bytes)
        want = bytes;
    cudaFree(ctx->scratch);
    ctx->scratch = NULL;
    ctx->scratch_bytes = 0;
    KN_CUDA(cudaMalloc(&ctx->scratch, want));
    ctx->scratch_bytes = want;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// memory

cm_status kn_cuda_alloc(kn_ctx *ctx, void **out, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx && out, "alloc: ctx or out is NULL");
    *out = NULL;
    void       *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* out of memory is not sticky; clear it for the next launch check */
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes of device memory: %s", bytes,
                       cudaGetErrorString(e));
    }
    e = cudaMemsetAsync(p, 0, bytes, ctx->stream);
    if (e != cudaSuccess) {
        cudaFree(p);
        return CM_FAIL(CM_ERR_CUDA, "cudaMemsetAsync(p, 0, bytes, ctx->stream) failed: %s (%s)",
                       cudaGetErrorString(e), cudaGetErrorName(e));
    }
    *out = p;
    return CM_OK;
}

void kn_cuda_free(kn_ctx *ctx, void *p) {
    (void)ctx;
    if (!p)
        return;
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess)
        CM_LOG_WARN("cudaFree(%p) failed: %s", p, cudaGetErrorString(e));
}

cm_status kn_cuda_upload(kn_ctx *ctx, void *dst, const void *host_src, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx, "upload: ctx is NULL");
    if (bytes == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dst && host_src, "upload: NULL pointer for %zu bytes", bytes);
    KN_CUDA(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, ctx->stream));
    KN_CUDA(cudaStreamSynchronize(ctx->stream));
    return CM_OK;
}

cm_status kn_cuda_host_pin(kn_ctx *ctx, void *p, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx && p, "host_pin: ctx or p is NULL");
    if (bytes == 0)
        return CM_OK;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable); /* any thread, any device */
    if (e != cudaSuccess) {
        cudaGetLastError();
        return CM_FAIL(CM_ERR_CUDA,
                       "cannot page-lock %zu bytes of host memory for fast uploads: %s (raise the locked-memory "
                       "limit, ulimit -l, or free host memory)",
                       bytes, cudaGetErrorString(e));
    }
    return CM_OK;
}

void kn_cuda_host_unpin(kn_ctx *ctx, void *p) {
    (void)ctx;
    if (!p)
        return;
    cudaError_t e = cudaHostUnregister(p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        CM_LOG_WARN("cudaHostUnregister(%p) failed: %s", p, cudaGetErrorString(e));
    }
}

cm_status kn_cuda_download(kn_ctx *ctx, void *host_dst, const void *src, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx, "download: ctx is NULL");
    if (bytes == 0)
        return kn_cuda_sync(ctx);
    KN_CUDA_CHECK_ARG(host_dst && src, "download: NULL pointer for %zu bytes", bytes);
    KN_CUDA(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, ctx->stream));
    KN_CUDA(cudaStreamSynchronize(ctx->stream));
    return CM_OK;
}

/* cudaMemcpyPeerAsync on ctx's stream: a device-to-device copy on one GPU; between two, over
 * NVLink or PCIe peer to peer where the GPUs can reach each other (enabled here the first time),
 * otherwise staged by the driver. */
cm_status kn_cuda_copy_peer(kn_ctx *ctx, kn_ctx *dst_ctx, void *dst, const void *src, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx && dst_ctx, "copy_peer: ctx or dst_ctx is NULL");
    if (bytes == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dst && src, "copy_peer: NULL pointer for %zu bytes", bytes);
    if (dst_ctx->device != ctx->device) {
        int can = 0;
        KN_CUDA(cudaDeviceCanAccessPeer(&can, ctx->device, dst_ctx->device));
        if (can) {
            KN_CUDA(cudaSetDevice(ctx->device));
            cudaError_t e = cudaDeviceEnablePeerAccess(dst_ctx->device, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled)
                cudaGetLastError(); /* enabled before: not an error to keep */
            else if (e != cudaSuccess)
                return CM_FAIL(CM_ERR_CUDA, "cannot enable peer access from GPU %d to GPU %d: %s", ctx->device,
                               dst_ctx->device, cudaGetErrorString(e));
        }
    }
    KN_CUDA(cudaMemcpyPeerAsync(dst, dst_ctx->device, src, ctx->device, bytes, ctx->stream));
    KN_CUDA(cudaStreamSynchronize(ctx->stream));
    return CM_OK;
}

cm_status kn_cuda_sync(kn_ctx *ctx) {
    KN_CUDA_CHECK_ARG(ctx, "sync: ctx is NULL");
    KN_CUDA(cudaStreamSynchronize(ctx->stream));
    return CM_OK;
}

cm_status kn_cuda_zero(kn_ctx *ctx, void *p, size_t bytes) {
    KN_CUDA_CHECK_ARG(ctx, "zero: ctx is NULL");
    if (bytes == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p, "zero: NULL pointer for %zu bytes", bytes);
    KN_CUDA(cudaMemsetAsync(p, 0, bytes, ctx->stream));
    return CM_OK;
}

cm_status kn_cuda_copy2d(kn_ctx *ctx, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                         int64_t rows, int64_t cols) {
    KN_CUDA_CHECK_ARG(ctx, "copy2d: ctx is NULL");
    KN_CUDA_CHECK_ARG(rows >= 0 && cols >= 0, "copy2d: bad shape rows=%lld cols=%lld (must be >= 0)",
                      (long long)rows, (long long)cols);
    KN_CUDA_CHECK_ARG(dst_ld >= cols && src_ld >= cols,
                      "copy2d: leading dimensions dst_ld=%lld src_ld=%lld must be >= cols=%lld",
                      (long long)dst_ld, (long long)src_ld, (long long)cols);
    if (rows == 0 || cols == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dst && src, "copy2d: dst or src is NULL");
    KN_CUDA(cudaMemcpy2DAsync(dst, (size_t)dst_ld * sizeof(float), src, (size_t)src_ld * sizeof(float),
                              (size_t)cols * sizeof(float), (size_t)rows, cudaMemcpyDeviceToDevice,
                              ctx->stream));
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
