/* kernels/kn_moe_gemm_int.h — what the two files of the routed experts' GEMMs share:
 * kn_moe_gemm.cu (the entries, the checks, the tile list and the mma.sync kernel for every
 * GPU) and kn_moe_gemm_sm90a.cu (the wgmma kernel, compiled for sm_90a only). Internal to
 * kernels/; include from .cu files only. */
#ifndef KN_MOE_GEMM_INT_H
#define KN_MOE_GEMM_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kn_cuda.h"

/* One call: out0 (f32 [R, N]; bf16 act for swiglu) and out1 (the second weight set's f32, or
 * NULL) from inp (bf16 [rows, K]; read through src[j] / topk when src is given) and the
 * device tables w0[e], w1[e] (bf16 [N, K] per expert), rows grouped by offsets [E + 1]. */
typedef struct mg_args {
    void                  *out0;
    float                 *out1;
    const uint16_t        *inp;
    const int32_t         *src;
    int                    topk;
    const uint16_t *const *w0, *const *w1;
    const int32_t         *offsets;
    int64_t                R, N, K;
    int                    E;
} mg_args;

/* The FP8 form (moe_gemm_fp8): inp is q [Mq, K] e4m3 with its scales s [ceil(K/128), Mq]; the
 * weight tables w0/w1 hold e4m3 matrices and ws0/ws1 their scales [ceil(N/128), kn_fp8_scale_ld(K)]. */
typedef struct mg_fp8 {
    const float        *s;
    int64_t             Mq;
    const float *const *ws0, *const *ws1;
} mg_fp8;

/* The tile list of a launch with bm-row tiles, in the context's scratch: (expert, first row)
 * per slot, −1 past the last; *n_slots = R / bm + E + 1 (the worst case). Enqueued on ctx->stream. */
cm_status kn_moe_tiles(kn_ctx *ctx, const mg_args *a, int bm, int64_t *n_slots, const void **tiles);

/* The wgmma kernel (kn_moe_gemm_sm90a.cu): available when the build has architecture 90 and the
 * context's GPU is compute capability 9.0; stages is 3 or 4. */
bool      kn_moe_wgmma_available(kn_ctx *ctx);
cm_status kn_moe_wgmma_launch(kn_ctx *ctx, const mg_args *a, bool swiglu, int stages);
/* The FP8 one (a's inp, w0, w1 hold bytes; f the scales). */
cm_status kn_moe_wgmma_fp8_launch(kn_ctx *ctx, const mg_args *a, const mg_fp8 *f);

#endif
