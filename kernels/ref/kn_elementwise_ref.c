/* kernels/ref/kn_elementwise_ref.c — reference add (x += y), SwiGLU (out = silu(gate)·up)
 * and its backward, and swiglu_bf16 (SwiGLU rounded to F32, then to BF16). Evaluated in
 * double per element and rounded once; an output may alias the inputs (each element is read
 * before it is written). */
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

/* d/dg silu(g) = σ(g) + g·σ(g)·(1 − σ(g)) = σ(g)·(1 + g·(1 − σ(g))). */
cm_status kn_ref_swiglu_bwd(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, int64_t n) {
    KN_REF_CHECK(ctx, "swiglu_bwd: ctx is NULL");
    KN_REF_CHECK(n >= 0, "swiglu_bwd: n=%lld must be >= 0", (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(dgate && dup && dout && gate && up, "swiglu_bwd: dgate, dup, dout, gate or up is NULL");
    KN_REF_CHECK(dgate != dup, "swiglu_bwd: dgate and dup must be different buffers");
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        const double d = dout[i], g = gate[i], u = up[i];
        const double sg = kn_ref_sigmoid(g);
        dup[i]          = (float)(d * kn_ref_silu(g));
        dgate[i]        = (float)(d * u * sg * (1.0 + g * (1.0 - sg)));
    }
    return CM_OK;
}

/* swiglu rounded to F32 as above, then to BF16 for the down projection. */
cm_status kn_ref_swiglu_bf16(kn_ctx *ctx, uint16_t *out, const float *gate, const float *up, int64_t n) {
    KN_REF_CHECK(ctx, "swiglu_bf16: ctx is NULL");
    KN_REF_CHECK(n >= 0, "swiglu_bf16: n=%lld must be >= 0", (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(out && gate && up, "swiglu_bf16: out, gate or up is NULL");
    for (int64_t i = 0; i < n; i++) out[i] = cm_f32_to_bf16((float)(kn_ref_silu(gate[i]) * (double)up[i]));
    return CM_OK;
}
