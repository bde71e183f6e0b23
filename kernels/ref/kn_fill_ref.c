/* kernels/ref/kn_fill_ref.c — fill_uniform on the cpu backend: dst[i] = kn_fill_value(seed, i,
 * lo, hi) as F32 or BF16 (kn_fill.h; bit-identical to the cuda backend's). */
#include "kn_fill.h"
#include "kn_ref.h"

cm_status kn_ref_fill_uniform(kn_ctx *ctx, void *dst, cm_dtype dt, int64_t n, uint64_t seed, float lo, float hi) {
    KN_REF_CHECK(ctx, "fill_uniform: ctx is NULL");
    KN_REF_CHECK(n >= 0, "fill_uniform: n=%lld must be >= 0", (long long)n);
    KN_REF_CHECK(dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16, "fill_uniform: dtype %s is not supported (F32 or BF16)",
                 cm_dtype_name(dt));
    if (n == 0) return CM_OK;
    KN_REF_CHECK(dst, "fill_uniform: dst is NULL");
    if (dt == CM_DTYPE_F32) {
        float *d = dst;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t i = 0; i < n; i++) d[i] = kn_fill_value(seed, (uint64_t)i, lo, hi);
    } else {
        uint16_t *d = dst;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t i = 0; i < n; i++) d[i] = kn_fill_bf16(kn_fill_value(seed, (uint64_t)i, lo, hi));
    }
    return CM_OK;
}
