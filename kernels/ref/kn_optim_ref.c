/* kernels/ref/kn_optim_ref.c — reference optimizer pieces: sumsq (the squared global grad
 * norm, in double, summed in fixed chunks so the result is the same for any thread count)
 * and the AdamW step of torch.optim.AdamW (decoupled weight decay, bias correction with a
 * 1-based step). AdamW works per element in double on the widened F32 inputs and
 * hyperparameters and stores param, m and v as F32; elements are independent, so the
 * parallel loop is deterministic. */
#include "kn_ref.h"

cm_status kn_ref_sumsq(kn_ctx *ctx, double *out, const float *x, int64_t n) {
    KN_REF_CHECK(ctx && out, "sumsq: ctx or out is NULL");
    KN_REF_CHECK(n >= 0, "sumsq: n=%lld must be >= 0", (long long)n);
    *out = 0;
    if (n == 0) return CM_OK;
    KN_REF_CHECK(x, "sumsq: x is NULL");

    const int64_t n_chunks = (n + KN_REF_SUMSQ_CHUNK - 1) / KN_REF_SUMSQ_CHUNK;
    double        total    = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) ordered
#endif
    for (int64_t chunk = 0; chunk < n_chunks; chunk++) {
        const int64_t i0 = chunk * KN_REF_SUMSQ_CHUNK;
        const int64_t m  = n - i0 < KN_REF_SUMSQ_CHUNK ? n - i0 : KN_REF_SUMSQ_CHUNK;
        const double  s  = kn_ref_dot(x + i0, x + i0, m);
#ifdef _OPENMP
#pragma omp ordered
#endif
        total += s;
    }
    *out = total;
    return CM_OK;
}

cm_status kn_ref_adamw(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                       const kn_adamw_params *p) {
    KN_REF_CHECK(ctx && p, "adamw: ctx or params is NULL");
    KN_REF_CHECK(n >= 0, "adamw: n=%lld must be >= 0", (long long)n);
    KN_REF_CHECK(p->step >= 1, "adamw: step=%lld must be >= 1 (it is 1-based)", (long long)p->step);
    KN_REF_CHECK(p->lr >= 0 && isfinite(p->lr), "adamw: lr=%g must be finite and >= 0", (double)p->lr);
    KN_REF_CHECK(p->beta1 >= 0 && p->beta1 < 1 && p->beta2 >= 0 && p->beta2 < 1,
                 "adamw: betas (%g, %g) must be in [0, 1)", (double)p->beta1, (double)p->beta2);
    KN_REF_CHECK(p->eps >= 0 && isfinite(p->eps), "adamw: eps=%g must be finite and >= 0", (double)p->eps);
    KN_REF_CHECK(p->weight_decay >= 0 && isfinite(p->weight_decay),
                 "adamw: weight_decay=%g must be finite and >= 0", (double)p->weight_decay);
    KN_REF_CHECK(isfinite(p->grad_scale), "adamw: grad_scale=%g must be finite", (double)p->grad_scale);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(param && grad && m && v, "adamw: param, grad, m or v is NULL");

    const double lr = p->lr, b1 = p->beta1, b2 = p->beta2, eps = p->eps, wd = p->weight_decay;
    const double gs  = p->grad_scale;
    const double bc1 = 1.0 - pow(b1, (double)p->step);
    const double bc2 = 1.0 - pow(b2, (double)p->step);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        const double g  = (double)grad[i] * gs;
        double       pv = param[i];
        pv -= lr * wd * pv;
        const double mi = b1 * (double)m[i] + (1.0 - b1) * g;
        const double vi = b2 * (double)v[i] + (1.0 - b2) * g * g;
        pv -= lr * (mi / bc1) / (sqrt(vi / bc2) + eps);
        param[i] = (float)pv;
        m[i]     = (float)mi;
        v[i]     = (float)vi;
    }
    return CM_OK;
}
