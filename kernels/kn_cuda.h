/* kernels/kn_cuda.h — what every CUDA op file shares: the check macros that turn CUDA and
 * cuBLAS failures into a cm_status with the failing statement, file:line and the library's
 * message in cm_last_error(), and the CUDA kn_ctx (device, one compute stream, the cuBLASLt
 * handle and workspace, a growable scratch buffer for GEMM input conversion, the GEMM mode,
 * the table of GEMM plans, the run-time switches read at ctx_create).
 * A kn_ctx is used by one thread at a time; every op enqueues on ctx->stream. Compiles as C
 * and as CUDA C++.
 *
 * Run-time switches of the CUDA kernels (environment variables; benchmark and comparison aids,
 * every default is the serving choice):
 *
 *   variable              where read, into       values (default first) and meaning
 *   TANDEM_GEMM_PLAN      ctx_create,            unset or not "0": 1, one cuBLASLt plan per key, made on
 *                         ctx->lt_plan_mode      its first call and reused; "0": 2, per call (descriptors
 *                                                and heuristic every call, as before plans existed)
 *   TANDEM_GEMM_AUTOTUNE  ctx_create,            unset: 0; else atoi clamped to 0..KN_LT_TUNE_MAX (16);
 *                         ctx->lt_autotune       k > 1: a new plan times the heuristic's first k answers
 *                                                and keeps the fastest; 0, 1: its first answer
 *   TANDEM_ATTN_KERNEL    ctx_create,            unset: 0, the dispatch of kn_attention.cu; bf16 mode only:
 *                         ctx->attn_force        "wmma": 1, the WMMA kernel; "fa2-2": 2, two q heads per
 *                                                CTA of the FlashAttention-2 kernel (group even, fits);
 *                                                "fa2": 3, FlashAttention-2 where the wgmma kernel of
 *                                                compute capability 9.0 would run
 *   TANDEM_GDN_KERNEL     ctx_create,            unset: 0, the dispatch of kn_gdn_state.cu; "mma": 1, the
 *                         ctx->gdn_force         mma.sync state kernel where the wgmma one of compute
 *                                                capability 9.0 would run
 *   TANDEM_DFLASH_KERNEL  ctx_create,            unset: 0, the mma.sync kernels of kn_dflash_attn_mma.cu;
 *                         ctx->dflash_wgmma      "wgmma": 1, the wgmma ones on compute capability 9.0
 *                                                (kn_dflash_attn_sm90a.cu; same masks, slower today)
 *   TANDEM_FP8_GEMM       ctx_create,            unset: 0, cuBLASLt's block-scaled FP8 product; "wgmma": 1,
 *                         ctx->fp8_wgmma         Tandem's own kernel on compute capability 9.0
 *                                                (kn_fp8_gemm_sm90a.cu; same bits, slower today)
 *
 * A test or benchmark that compares the forced kernels makes a context per setting
 * (test_kn_cuda_seq, test_kn_gdn16, test_kn_fp8, test_kn_cuda_drafter, bench_ts_target, bench_kn_fp8,
 * bench_kn_drafter). The target's TANDEM_TARGET_FUSED and TANDEM_LAYER_TIMING are model choices,
 * read in ts_model.c. */
#ifndef KN_CUDA_H
#define KN_CUDA_H

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One cuBLASLt GEMM plan: everything a call needs besides its pointers and beta, made the
 * first time its key is seen (kn_gemm_plan.cu) and reused by every later call, so the serving
 * loop creates no descriptor, asks no heuristic and allocates nothing. The key is every input
 * of the descriptors and of the heuristic: operand and output types, transposes, the shape,
 * the leading dimensions and the pointers' alignments (the workspace size is the context's). */
typedef struct kn_lt_key {
    int32_t  ab_type, c_type; /* cudaDataType_t */
    int32_t  trans_a, trans_b;
    int64_t  m, n, k, lda, ldb, ldc;
    uint32_t al_a, al_b, al_c; /* ptr_align of A, B and C (= D) */
} kn_lt_key;

typedef struct kn_lt_plan {
    int                    used; /* slot holds a plan */
    kn_lt_key              key;
    cublasLtMatmulDesc_t   op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t   algo;
    int                    rank; /* which heuristic answer algo is (0: the first; > 0 only when timed) */
} kn_lt_plan;

/* Plan slots per context (open addressing, linear probing). The 27B target forward's GEMMs
 * are 9 shapes per batch size (M = tokens is part of the key, so a server fed packs of many
 * sizes fills a plan per size); a key that finds the table full runs the per-call path
 * (descriptors made and freed, the heuristic's first answer): ~1-2 us more host time per
 * call on an H200, the same result. */
#define KN_LT_PLANS 256

/* Most heuristic answers timed per plan (TANDEM_GEMM_AUTOTUNE's upper clamp). */
#define KN_LT_TUNE_MAX 16

/* Forms of the Hopper FP8 GEMM (kn_fp8_int.h). */
#define KN_FP8_WG_CONFIGS 2

struct kn_ctx {
    int              device; /* cuda device ordinal */
    cudaStream_t     stream; /* every op enqueues here */
    cublasLtHandle_t lt;
    void            *lt_ws; /* cuBLASLt workspace, lt_ws_bytes */
    size_t           lt_ws_bytes;
    void            *scratch;       /* GEMM operand conversion (bf16 inputs, widened weights) */
    size_t           scratch_bytes; /* grows on demand, never shrinks */
    kn_gemm_mode     gemm_mode;
    /* GEMM plans (kn_gemm_plan.cu). lt_plan_mode: 1 plans, 2 per call (TANDEM_GEMM_PLAN=0:
     * descriptors and heuristic every call, as before plans existed). lt_autotune: 0 or 1 keeps
     * the heuristic's first answer; k > 1 times its first k answers when a plan is made
     * (TANDEM_GEMM_AUTOTUNE=k). Both set by ctx_create (the table above). */
    int        lt_plan_mode;
    int        lt_autotune;
    int        attn_force; /* TANDEM_ATTN_KERNEL: 0 the dispatch, 1 wmma, 2 fa2-2, 3 fa2 */
    int        gdn_force;  /* TANDEM_GDN_KERNEL: 0 the dispatch, 1 mma */
    int        dflash_wgmma; /* TANDEM_DFLASH_KERNEL: 0 mma.sync, 1 the wgmma kernels */
    int        fp8_wgmma;  /* TANDEM_FP8_GEMM: 0 cuBLASLt, 1 the wgmma kernel */
    int        lt_plans_used;
    uint64_t   lt_plan_overflow; /* calls that found the table full and ran per call */
    kn_lt_plan lt_plans[KN_LT_PLANS];
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

/* Destroys the context's GEMM plans (their descriptors); ctx_destroy calls it. Defined in
 * kn_gemm_plan.cu. */
void kn_cuda_lt_plans_release(kn_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif /* KN_CUDA_H */
