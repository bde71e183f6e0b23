/* kernels/kn_cuda.h — what every CUDA op file shares: the check macros that turn CUDA and
 * cuBLAS failures into a cm_status with the failing statement, file:line and the library's
 * message in cm_last_error(), and the CUDA kn_ctx (device, one compute stream, the cuBLASLt
 * handle and workspace, a growable scratch buffer for GEMM input conversion, the GEMM mode).
 * A kn_ctx is used by one thread at a time; every op enqueues on ctx->stream. Compiles as C
 * and as CUDA C++. */
#ifndef KN_CUDA_H
#define KN_CUDA_H

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kn_ctx {
    int              device; /* cuda device ordinal */
    cudaStream_t     stream; /* every op enqueues here */
    cublasLtHandle_t lt;
    void            *lt_ws; /* cuBLASLt workspace, lt_ws_bytes */
    size_t           lt_ws_bytes;
    void            *scratch;       /* GEMM operand conversion (bf16 inputs, widened weights) */
    size_t           scratch_bytes; /* grows on demand, never shrinks */
    kn_gemm_mode     gemm_mode;
};

#define KN_CUDA_LT_WORKSPACE_BYTES ((size_t)32 << 20)

/* On failure: records "#x failed: <cuda message> (<name>)" and returns CM_ERR_CUDA. */
#define KN_CUDA(x)                                                                                           \
    do {                                                                                                     \
        cudaError_t e_ = (x);                                                                                \
        if (e_ != cudaSuccess)                                                                               \
            return CM_FAIL(CM_ERR_CUDA, "%s failed: %s (%s)", #x, cudaGetErrorString(e_),                    \
                           cudaGetErrorName(e_));                                                            \
    } while (0)

/* On failure: records "#x failed: <cublas message> (<name>)" and returns CM_ERR_CUBLAS. */
#define KN_CUBLAS(x)                                                                                         \
    do {                                                                                                     \
        cublasStatus_t s_ = (x);                                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                     \
            return CM_FAIL(CM_ERR_CUBLAS, "%s failed: %s (%s)", #x, cublasLtGetStatusString(s_),             \
                           cublasLtGetStatusName(s_));                                                       \
    } while (0)

/* After every kernel launch: the launch error, and with CM_SYNC_DEBUG the kernel's own
 * (asynchronous) error, reported at the launch that caused it. */
#ifdef CM_SYNC_DEBUG
#define KN_CUDA_LAUNCHED(ctx)                                                                                \
    do {                                                                                                     \
        KN_CUDA(cudaGetLastError());                                                                         \
        KN_CUDA(cudaStreamSynchronize((ctx)->stream));                                                       \
    } while (0)
#else
#define KN_CUDA_LAUNCHED(ctx) KN_CUDA(cudaGetLastError())
#endif

/* Argument validation in launchers: CM_ERR_INVALID_ARG with the message when cond is false. */
#define KN_CUDA_CHECK_ARG(cond, ...)                                                                         \
    do {                                                                                                     \
        if (!(cond))                                                                                         \
            return CM_FAIL(CM_ERR_INVALID_ARG, __VA_ARGS__);                                                 \
    } while (0)

/* Makes ctx->scratch at least bytes long (cudaFree + cudaMalloc; cudaFree waits for the
 * device, so work still queued on the old buffer finishes first). Defined in kn_memory.cu. */
cm_status kn_cuda_scratch_reserve(kn_ctx *ctx, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif /* KN_CUDA_H */
