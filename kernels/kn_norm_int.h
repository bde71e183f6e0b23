/* kernels/kn_norm_int.h — private to kn_norm.cu, kn_norm_bwd.cu and kn_head_norm.cu: the
 * deterministic dw pass of rmsnorm's backward (kernels 2 and 3 of kn_norm_bwd.cu), shared by
 * rmsnorm_bwd* and head_norm_rope_bwd, the scratch it reads, and the shape of the row-in-registers
 * norm kernels. */
#ifndef KN_NORM_INT_H
#define KN_NORM_INT_H

#include "kn_cuda.h"

/* Reserves ctx->scratch for rows row scales (*rstd, double [rows]) and the dw partials (*partial);
 * refuses more than 65535 chunks of rows (op names the caller in the message). */
cm_status kn_cuda_norm_bwd_scratch(kn_ctx *ctx, const char *op, int64_t rows, int64_t C, double **rstd,
                                   double **partial);
/* dw[c] += Σ_r dout[r, c]·x[r, c]·rstd[r] over rows [rows, C], summed in fixed row chunks and then
 * in chunk order (double); x in F32 (xbf 0) or BF16. */
cm_status kn_cuda_norm_bwd_dw(kn_ctx *ctx, float *dw, const double *rstd, double *partial, const float *dout,
                              const void *x, int xbf, int64_t rows, int64_t C);

/* The row-in-registers norm kernels (rmsnorm_typed's forward, rmsnorm_bwd's dx) over C4 groups of
 * four columns: 4 groups a thread from C = 512 up (5120: 320 threads, 10 warps), 1 below, where
 * four would leave most of a warp idle. Returns the groups a thread; *block the threads, a multiple
 * of 32. */
static inline int kn_norm_vec_shape(int64_t C4, int *block) {
    const int     per = C4 > 128 ? 4 : 1;
    const int64_t nt = (C4 + per - 1) / per;
    *block = (int)((nt + 31) / 32 * 32);
    return per;
}

#endif /* KN_NORM_INT_H */
