/* kernels/ref/kn_mixed_ref.c — reference ops for drafter training with BF16 saved
 * activations: cast2d (F32 ↔ BF16 and copies, strided), the general matmul (either operand
 * and C in F32 or BF16, either operand transposed, leading dimensions) and SwiGLU forward and
 * backward on typed storage. BF16 values are widened exactly; every result is evaluated in
 * double, rounded once to F32 and then, for a BF16 destination, to BF16 (nearest even), so a
 * BF16 result is exactly the rounding of the F32 one. Outputs may alias inputs element for
 * element (each element is read before it is written). Also rmsnorm_bwd_acc, the accumulating
 * rmsnorm backward that spares the drafter a temporary. */
#include "kn_ref.h"

#include <stdlib.h>

static int typed_ok(cm_dtype dt) {
    return dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16;
}

static inline double ld_el(const void *p, cm_dtype dt, int64_t i) {
    return dt == CM_DTYPE_F32 ? (double)((const float *)p)[i] : (double)cm_bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void st_el(void *p, cm_dtype dt, int64_t i, double v) {
    if (dt == CM_DTYPE_F32)
        ((float *)p)[i] = (float)v;
    else
        ((uint16_t *)p)[i] = cm_f32_to_bf16((float)v);
}

cm_status kn_ref_cast2d(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dst_ld, const void *src, cm_dtype sdt,
                        int64_t src_ld, int64_t rows, int64_t cols) {
    KN_REF_CHECK(ctx, "cast2d: ctx is NULL");
    if (!typed_ok(ddt) || !typed_ok(sdt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "cast2d: %s to %s is not supported (F32 or BF16)", cm_dtype_name(sdt),
                       cm_dtype_name(ddt));
    KN_REF_CHECK(rows >= 0 && cols >= 0 && dst_ld >= cols && src_ld >= cols,
                 "cast2d: bad shape rows=%lld cols=%lld dst_ld=%lld src_ld=%lld (lds >= cols >= 0)",
                 (long long)rows, (long long)cols, (long long)dst_ld, (long long)src_ld);
    if (rows == 0 || cols == 0) return CM_OK;
    KN_REF_CHECK(dst && src, "cast2d: dst or src is NULL");
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) st_el(dst, ddt, r * dst_ld + c, ld_el(src, sdt, r * src_ld + c));
    return CM_OK;
}

cm_status kn_ref_matmul(kn_ctx *ctx, const kn_matmul_params *p) {
    KN_REF_CHECK(ctx && p, "matmul: ctx or params is NULL");
    if (!typed_ok(p->a_dt) || !typed_ok(p->b_dt) || !typed_ok(p->c_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "matmul: operand types %s, %s -> %s are not supported (F32 or BF16)",
                       cm_dtype_name(p->a_dt), cm_dtype_name(p->b_dt), cm_dtype_name(p->c_dt));
    const int64_t M = p->M, N = p->N, K = p->K;
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "matmul: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    KN_REF_CHECK(p->lda >= (p->trans_a ? M : K) && p->ldb >= (p->trans_b ? K : N) && p->ldc >= N,
                 "matmul: leading dimensions lda=%lld ldb=%lld ldc=%lld are shorter than the rows they hold",
                 (long long)p->lda, (long long)p->ldb, (long long)p->ldc);
    KN_REF_CHECK(!p->accumulate || p->c_dt == CM_DTYPE_F32, "matmul: accumulate needs an F32 C");
    if (M == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(p->c && (K == 0 || (p->a && p->b)), "matmul: a, b or c is NULL");
    const int64_t sa_m = p->trans_a ? 1 : p->lda, sa_k = p->trans_a ? p->lda : 1;
    const int64_t sb_k = p->trans_b ? 1 : p->ldb, sb_n = p->trans_b ? p->ldb : 1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++)
                s += ld_el(p->a, p->a_dt, i * sa_m + k * sa_k) * ld_el(p->b, p->b_dt, k * sb_k + j * sb_n);
            if (p->accumulate) s += ld_el(p->c, p->c_dt, i * p->ldc + j);
            st_el(p->c, p->c_dt, i * p->ldc + j, s);
        }
    return CM_OK;
}

cm_status kn_ref_swiglu_typed(kn_ctx *ctx, void *out, cm_dtype odt, const void *gate, const void *up, cm_dtype idt,
                              int64_t n) {
    KN_REF_CHECK(ctx, "swiglu_typed: ctx is NULL");
    if (!typed_ok(odt) || !typed_ok(idt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "swiglu_typed: %s to %s is not supported (F32 or BF16)",
                       cm_dtype_name(idt), cm_dtype_name(odt));
    KN_REF_CHECK(n >= 0, "swiglu_typed: n=%lld must be >= 0", (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK(out && gate && up, "swiglu_typed: out, gate or up is NULL");
    for (int64_t i = 0; i < n; i++) {
        const double g = ld_el(gate, idt, i), u = ld_el(up, idt, i);
        st_el(out, odt, i, kn_ref_silu(g) * u);
    }
    return CM_OK;
}

/* swiglu_bwd_typed, and with_h swiglu_fwd_bwd_typed: the product h as swiglu_typed writes it
 * (op names the entry in messages). Each element's inputs are read before any of its writes. */
static cm_status swiglu_bwd_ref(const char *op, int with_h, kn_ctx *ctx, void *h, void *dgate, void *dup,
                                const void *dout, const void *gate, const void *up, cm_dtype dt, int64_t n) {
    KN_REF_CHECK(ctx, "%s: ctx is NULL", op);
    if (!typed_ok(dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: %s is not supported (F32 or BF16)", op, cm_dtype_name(dt));
    KN_REF_CHECK(n >= 0, "%s: n=%lld must be >= 0", op, (long long)n);
    if (n == 0) return CM_OK;
    KN_REF_CHECK((h || !with_h) && dgate && dup && dout && gate && up, "%s: %sdgate, dup, dout, gate or up is NULL",
                 op, with_h ? "h, " : "");
    KN_REF_CHECK(dgate != dup && (!with_h || (h != dgate && h != dup)), "%s: %sdgate and dup must be different buffers",
                 op, with_h ? "h, " : "");
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        const double d = ld_el(dout, dt, i), g = ld_el(gate, dt, i), u = ld_el(up, dt, i);
        const double sg = kn_ref_sigmoid(g);
        if (with_h) st_el(h, dt, i, kn_ref_silu(g) * u);
        st_el(dup, dt, i, d * kn_ref_silu(g));
        st_el(dgate, dt, i, d * u * sg * (1.0 + g * (1.0 - sg)));
    }
    return CM_OK;
}

cm_status kn_ref_swiglu_bwd_typed(kn_ctx *ctx, void *dgate, void *dup, const void *dout, const void *gate,
                                  const void *up, cm_dtype dt, int64_t n) {
    return swiglu_bwd_ref("swiglu_bwd_typed", 0, ctx, NULL, dgate, dup, dout, gate, up, dt, n);
}

cm_status kn_ref_swiglu_fwd_bwd_typed(kn_ctx *ctx, void *h, void *dgate, void *dup, const void *dout,
                                      const void *gate, const void *up, cm_dtype dt, int64_t n) {
    return swiglu_bwd_ref("swiglu_fwd_bwd_typed", 1, ctx, h, dgate, dup, dout, gate, up, dt, n);
}

cm_status kn_ref_rmsnorm_bwd_acc(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    KN_REF_CHECK(ctx, "rmsnorm_bwd_acc: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_bwd_acc: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(dinp && dout && inp && dinp != dout && dinp != inp,
                 "rmsnorm_bwd_acc: dinp, dout or inp is NULL, or dinp aliases dout or inp");
    float *tmp = malloc((size_t)(rows * C) * sizeof *tmp);
    if (!tmp)
        return CM_FAIL(CM_ERR_NOMEM, "rmsnorm_bwd_acc: cannot allocate %lld floats", (long long)(rows * C));
    cm_status st = kn_ref_rmsnorm_bwd(ctx, tmp, dw, dout, inp, w, rows, C, eps, one_plus);
    if (st == CM_OK)
        st = kn_ref_add(ctx, dinp, tmp, rows * C);
    free(tmp);
    return st;
}
