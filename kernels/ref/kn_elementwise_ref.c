/* kernels/ref/kn_elementwise_ref.c — reference add (x += y) and SwiGLU (out = silu(gate)·up).
 * Evaluated in double per element and rounded once; out may alias either input. */
#include "kn_ref.h"

cm_status kn_ref_add(kn_ctx *ctx, float *x, const float *y, int64_t n) {
    KN_REF_CHECK(ctx, "add: ctx is NULL");
    KN_REF_CHECK(n >= 0, "add: n=%lld must be >= 0", (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(x && y, "add: x or y is NULL");
    for (int64_t i = 0; i < n; i++) x[i] = (float)((double)x[i] + (double)y[i]);
    return CM_OK;
}

cm_status kn_ref_swiglu(kn_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    KN_REF_CHECK(ctx, "swiglu: ctx is NULL");
    KN_REF_CHECK(n >= 0, "swiglu: n=%lld must be >= 0", (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(out && gate && up, "swiglu: out, gate or up is NULL");
    for (int64_t i = 0; i < n; i++) out[i] = (float)(kn_ref_silu(gate[i]) * (double)up[i]);
    return CM_OK;
}
