/* kernels/kn_fp8_int.h — what kn_fp8.cu and the Hopper FP8 GEMM (kn_fp8_gemm_sm90a.cu) share:
 * the output modes and the entry of the wgmma kernel. Internal to kernels/ (and the benchmark
 * that times it beside cuBLASLt). */
#ifndef KN_FP8_INT_H
#define KN_FP8_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kn_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gemm_fp8q's outputs: F32 written, BF16 written (the F32 sum rounded once), F32 added onto out
 * (gemm_fp8q_acc). */
enum { KN_FP8_OUT_F32 = 0, KN_FP8_OUT_BF16 = 1, KN_FP8_OUT_ADD = 2 };

/* Whether the wgmma kernel can run on ctx's GPU: compute capability 9.0, a build with
 * architecture 90, the driver's tensor-map encoder found, the shared memory. gemm_fp8q takes it
 * only with TANDEM_FP8_GEMM=wgmma (kn_cuda.h). kn_fp8_gemm_sm90a.cu (kn_fp8.cu without
 * architecture 90: always false). */
bool kn_fp8_wg_available(kn_ctx *ctx);

/* gemm_fp8q (mode F32 or BF16) or gemm_fp8q_acc (mode ADD) on the wgmma kernel, with their
 * arguments (checked by the caller): q [kn_fp8_rows(M), K] and s as fp8_quantize_rows wrote them,
 * wq [N, K] and wscale an FP8 weight (kn_backend.h); N a multiple of 4, K of 16; q, s, wq
 * 16-byte aligned and out 8-byte aligned. Rows ≥ M of out are not written. cfg picks the
 * kernel's form: 0 (the default) tiles of 128 × 256, 1 tiles of 128 × 128 (kn_fp8_gemm_sm90a.cu's
 * fg_cfg); both give the same bits. */
cm_status kn_fp8_gemm_wg(kn_ctx *ctx, void *out, int mode, const uint8_t *q, const float *s,
                         const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K, int cfg);

#ifdef __cplusplus
}
#endif

#endif /* KN_FP8_INT_H */
