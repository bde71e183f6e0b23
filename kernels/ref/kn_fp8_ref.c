/* kernels/ref/kn_fp8_ref.c — the FP8 block-scaled ops (kn_backend.h, "FP8 block-scaled
 * GEMMs"): a weight quantized in 128 × 128 blocks, an input quantized per row in 1 × 128
 * groups, and their W8A8 product. Every scale, quotient and product of the quantization is one
 * fp32 operation in the order the header states, so the CUDA kernels can match these bytes
 * exactly; the product sums each group exactly (e4m3 × e4m3 products are multiples of 2^-18
 * below 2^18, so 128 of them add exactly in double), scales it in double and adds the groups
 * in double, with one rounding to F32 (or BF16) at the end. TANDEM_FP8_REF_TC replaces the exact
 * group sums with a model of a tensor core's (kn_fp8_tc_ref.c), for diagnosis only. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

#define FP8_MB 16 /* rows of inp per tile */
#define FP8_NB 16 /* rows of W per tile */

static float in_value(const void *p, cm_dtype dt, int64_t i) {
    return dt == CM_DTYPE_BF16 ? cm_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static float clamp448(float v) {
    return v > KN_FP8_MAX ? KN_FP8_MAX : v < -KN_FP8_MAX ? -KN_FP8_MAX : v;
}

cm_status kn_ref_fp8_quantize_weight(kn_ctx *ctx, uint8_t *q, float *scale, const void *w, cm_dtype wdt,
                                     int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "fp8_quantize_weight: ctx is NULL");
    KN_REF_CHECK(N >= 0 && K >= 0, "fp8_quantize_weight: bad shape N=%lld K=%lld (each must be >= 0)",
                 (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "fp8_quantize_weight: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (N == 0 || K == 0) return CM_OK;
    KN_REF_CHECK(q && scale && w, "fp8_quantize_weight: q, scale or w is NULL");
    const int64_t B = KN_FP8_BLOCK, nb = (N + B - 1) / B, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t blk = 0; blk < nb * L; blk++) {
        const int64_t i = blk / L, j = blk % L;
        const int64_t n0 = i * B, n1 = n0 + B < N ? n0 + B : N, k0 = j * B, k1 = k0 + B < K ? k0 + B : K;
        float         amax = 0;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t k = k0; k < k1; k++) {
                float a = fabsf(in_value(w, wdt, n * K + k));
                amax = a > amax ? a : amax;
            }
        const float a = amax > 1e-12f ? amax : 1e-12f;
        const float r = KN_FP8_MAX / a;
        scale[i * ld + j] = 1.0f / r;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t k = k0; k < k1; k++) q[n * K + k] = cm_f32_to_f8e4m3(clamp448(in_value(w, wdt, n * K + k) * r));
    }
    for (int64_t i = 0; i < nb; i++)
        for (int64_t j = L; j < ld; j++) scale[i * ld + j] = 0;
    return CM_OK;
}

cm_status kn_ref_fp8_quantize_rows(kn_ctx *ctx, uint8_t *q, float *s, const void *inp, cm_dtype idt, int64_t M,
                                   int64_t K) {
    KN_REF_CHECK(ctx, "fp8_quantize_rows: ctx is NULL");
    KN_REF_CHECK(M >= 0 && K >= 0, "fp8_quantize_rows: bad shape M=%lld K=%lld (each must be >= 0)", (long long)M,
                 (long long)K);
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "fp8_quantize_rows: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || K == 0) return CM_OK;
    KN_REF_CHECK(q && s && inp, "fp8_quantize_rows: q, s or inp is NULL");
    const int64_t B = KN_FP8_BLOCK, L = (K + B - 1) / B, Mp = kn_fp8_rows(M);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t j = 0; j < L; j++) {
            const int64_t k0 = j * B, k1 = k0 + B < K ? k0 + B : K;
            if (m >= M) {
                memset(q + m * K + k0, 0, (size_t)(k1 - k0));
                s[j * Mp + m] = 0;
                continue;
            }
            float amax = 0;
            for (int64_t k = k0; k < k1; k++) {
                float a = fabsf(cm_bf16_to_f32(cm_f32_to_bf16(in_value(inp, idt, m * K + k))));
                amax = a > amax ? a : amax;
            }
            const float sc = (amax > 1e-10f ? amax : 1e-10f) * (1.0f / KN_FP8_MAX);
            s[j * Mp + m] = sc;
            for (int64_t k = k0; k < k1; k++) {
                float a = cm_bf16_to_f32(cm_f32_to_bf16(in_value(inp, idt, m * K + k)));
                q[m * K + k] = cm_f32_to_f8e4m3(clamp448(a / sc));
            }
        }
    return CM_OK;
}

cm_status kn_ref_swiglu_fp8(kn_ctx *ctx, uint8_t *q, float *s, const void *gate, const void *up, cm_dtype idt,
                            int64_t M, int64_t I) {
    KN_REF_CHECK(ctx, "swiglu_fp8: ctx is NULL");
    KN_REF_CHECK(M >= 0 && I >= 0, "swiglu_fp8: bad shape M=%lld I=%lld (each must be >= 0)", (long long)M,
                 (long long)I);
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "swiglu_fp8: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || I == 0) return CM_OK;
    const int64_t n = M * I, wide = idt == CM_DTYPE_BF16 ? 2 * n : 0;
    uint16_t     *a = malloc((size_t)n * sizeof *a);
    float        *f = wide ? malloc((size_t)wide * sizeof *f) : NULL; /* gate, up widened */
    cm_status     st = a && (f || !wide) ? CM_OK
                                         : CM_FAIL(CM_ERR_NOMEM, "swiglu_fp8: cannot allocate %lld x %lld values",
                                                   (long long)M, (long long)I);
    for (int64_t i = 0; st == CM_OK && i < wide / 2; i++) {
        f[i] = in_value(gate, idt, i);
        f[n + i] = in_value(up, idt, i);
    }
    if (st == CM_OK)
        st = kn_ref_swiglu_bf16(ctx, a, wide ? f : (const float *)gate, wide ? f + n : (const float *)up, n);
    if (st == CM_OK) st = kn_ref_fp8_quantize_rows(ctx, q, s, a, CM_DTYPE_BF16, M, I);
    free(a), free(f);
    return st;
}

cm_status kn_ref_add_rmsnorm_fp8(kn_ctx *ctx, uint16_t *out, uint8_t *q, float *s, float *x, const float *y,
                                 const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    KN_REF_CHECK(q && s, "add_rmsnorm_fp8: q or s is NULL");
    KN_REF_CHECK(rows >= 0 && C >= 0, "add_rmsnorm_fp8: bad shape rows=%lld C=%lld (each must be >= 0)",
                 (long long)rows, (long long)C);
    /* out NULL: the bf16 values are not stored, only quantized */
    uint16_t *a = out ? out : malloc((size_t)(rows * C > 0 ? rows * C : 1) * sizeof *a);
    if (!a)
        return CM_FAIL(CM_ERR_NOMEM, "add_rmsnorm_fp8: cannot allocate %lld x %lld bf16 values", (long long)rows,
                       (long long)C);
    cm_status st = kn_ref_add_rmsnorm_bf16(ctx, a, x, y, w, rows, C, eps, one_plus);
    if (st == CM_OK) st = kn_ref_fp8_quantize_rows(ctx, q, s, a, CM_DTYPE_BF16, rows, C);
    if (a != out) free(a);
    return st;
}

cm_status kn_ref_rmsnorm_gated_fp8(kn_ctx *ctx, uint8_t *q, float *s, const float *x, const float *z, const float *w,
                                   int64_t T, int64_t H, int64_t C, float eps) {
    KN_REF_CHECK(T >= 0 && H > 0 && C > 0, "rmsnorm_gated_fp8: bad shape T=%lld H=%lld C=%lld (T >= 0, H, C > 0)",
                 (long long)T, (long long)H, (long long)C);
    KN_REF_CHECK(q && s, "rmsnorm_gated_fp8: q or s is NULL");
    if (T == 0) return CM_OK;
    uint16_t *a = malloc((size_t)(T * H * C) * sizeof *a);
    if (!a)
        return CM_FAIL(CM_ERR_NOMEM, "rmsnorm_gated_fp8: cannot allocate %lld x %lld bf16 values", (long long)T,
                       (long long)(H * C));
    cm_status st = kn_ref_rmsnorm_gated_bf16(ctx, a, x, z, w, T * H, C, eps);
    if (st == CM_OK) st = kn_ref_fp8_quantize_rows(ctx, q, s, a, CM_DTYPE_BF16, T, H * C);
    free(a);
    return st;
}

static cm_status gemm_check(const char *op, int64_t M, int64_t N, int64_t K) {
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "%s: bad shape M=%lld N=%lld K=%lld (each must be >= 0)", op,
                 (long long)M, (long long)N, (long long)K);
    return CM_OK;
}

/* The product (below): each output's double sum rounded once, to F32 in out or, where o16 is
 * given, to BF16 in o16 (out then unused). */
static cm_status gemm_fp8q_run(float *out, uint16_t *o16, const uint8_t *qa, const float *sa, const uint8_t *wq,
                               const float *wscale, int64_t M, int64_t N, int64_t K);

/* v rounded to BF16, nearest even, in one rounding: the F32 rounding can land on a BF16
 * midpoint that v is not on, and then it is moved one F32 step towards v first. */
static uint16_t bf16_of_double(double v) {
    float    f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0xffffu) == 0x8000u && (double)f != v) f = nextafterf(f, v > (double)f ? INFINITY : -INFINITY);
    return cm_f32_to_bf16(f);
}

cm_status kn_ref_gemm_fp8q(kn_ctx *ctx, void *out, cm_dtype odt, const uint8_t *qa, const float *sa,
                           const uint8_t *wq, const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm_fp8q: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8q", M, N, K));
    if (odt != CM_DTYPE_F32 && odt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_fp8q: output dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(odt));
    if (M == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out && (K == 0 || (qa && sa && wq && wscale)), "gemm_fp8q: out, q, s, wq or wscale is NULL");
    return odt == CM_DTYPE_F32 ? gemm_fp8q_run(out, NULL, qa, sa, wq, wscale, M, N, K)
                               : gemm_fp8q_run(NULL, out, qa, sa, wq, wscale, M, N, K);
}

cm_status kn_ref_gemm_fp8q_acc(kn_ctx *ctx, float *out, const uint8_t *q, const float *s, const uint8_t *wq,
                               const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm_fp8q_acc: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8q_acc", M, N, K));
    if (M == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out, "gemm_fp8q_acc: out is NULL");
    float *y = malloc((size_t)M * (size_t)N * sizeof *y);
    if (!y)
        return CM_FAIL(CM_ERR_NOMEM, "gemm_fp8q_acc: cannot allocate the %lld x %lld product", (long long)M,
                       (long long)N);
    cm_status st = kn_ref_gemm_fp8q(ctx, y, CM_DTYPE_F32, q, s, wq, wscale, M, N, K);
    if (st == CM_OK) st = kn_ref_add(ctx, out, y, M * N);
    free(y);
    return st;
}

/* One gemm_fp8q: the widened input, the scales, the e4m3 table and the number of W-row tiles. */
typedef struct {
    float         *out;
    uint16_t      *o16;
    const float   *fa, *sa;
    const uint8_t *wq;
    const float   *wscale, *lut;
    int64_t        M, N, K, ld, Mp, n_nt;
    kn_fp8_tc_model tc; /* bits 0: each group's sum exact */
} fp8_tiles;

/* Tile `tile` (FP8_MB rows × FP8_NB W rows) of the product; wbuf holds FP8_NB × K widened weights. */
static void fp8_tile(int64_t tile, void *scratch, const void *user) {
    const fp8_tiles *g = user;
    const int64_t    B = KN_FP8_BLOCK, M = g->M, N = g->N, K = g->K, L = (K + B - 1) / B;
    const int64_t    m0 = (tile / g->n_nt) * FP8_MB, m1 = m0 + FP8_MB < M ? m0 + FP8_MB : M;
    const int64_t    n0 = (tile % g->n_nt) * FP8_NB, n1 = n0 + FP8_NB < N ? n0 + FP8_NB : N;
    float           *wbuf = scratch;
    for (int64_t i = 0; i < (n1 - n0) * K; i++)
        wbuf[i] = g->lut[g->wq[n0 * K + i]];
    for (int64_t m = m0; m < m1; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float *a = g->fa + m * K, *wr = wbuf + (n - n0) * K;
            double       acc = 0;
            for (int64_t j = 0; j < L; j++) {
                const int64_t k0 = j * B, k1 = k0 + B < K ? k0 + B : K;
                const double  s = g->tc.bits ? kn_ref_fp8_tc_dot(a + k0, wr + k0, k1 - k0, &g->tc)
                                             : kn_ref_dot(a + k0, wr + k0, k1 - k0); /* exact */
                acc += (double)g->sa[j * g->Mp + m] * (double)g->wscale[(n / B) * g->ld + j] * s;
            }
            if (g->o16)
                g->o16[m * N + n] = bf16_of_double(acc);
            else
                g->out[m * N + n] = (float)acc;
        }
}

static cm_status gemm_fp8q_run(float *out, uint16_t *o16, const uint8_t *qa, const float *sa, const uint8_t *wq,
                               const float *wscale, int64_t M, int64_t N, int64_t K) {
    if (K == 0) {
        memset(o16 ? (void *)o16 : (void *)out, 0, (size_t)(M * N) * (o16 ? 2 : 4));
        return CM_OK;
    }
    const int64_t   ld = kn_fp8_scale_ld(K), Mp = kn_fp8_rows(M);
    kn_fp8_tc_model tc;
    CM_TRY(kn_ref_fp8_tc_model(&tc));
    float *fa = malloc((size_t)(M * K) * sizeof *fa);
    if (!fa)
        return CM_FAIL(CM_ERR_NOMEM, "gemm_fp8q: cannot widen the quantized input (%lld x %lld)", (long long)M,
                       (long long)K);
    float lut[256];
    for (int b = 0; b < 256; b++) lut[b] = cm_f8e4m3_to_f32((uint8_t)b);
    for (int64_t i = 0; i < M * K; i++) fa[i] = lut[qa[i]];

    const fp8_tiles g = {out, o16, fa, sa, wq, wscale, lut, M, N, K, ld, Mp, (N + FP8_NB - 1) / FP8_NB, tc};
    const cm_status st = kn_ref_parallel("gemm_fp8q", (M + FP8_MB - 1) / FP8_MB * g.n_nt, 1,
                                         (size_t)(FP8_NB * K) * sizeof(float), fp8_tile, &g);
    free(fa);
    return st;
}

cm_status kn_ref_gemm_fp8(kn_ctx *ctx, float *out, const void *inp, cm_dtype idt, const uint8_t *wq,
                          const float *wscale, int64_t M, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm_fp8: ctx is NULL");
    CM_TRY(gemm_check("gemm_fp8", M, N, K));
    if (idt != CM_DTYPE_F32 && idt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_fp8: input dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(idt));
    if (M == 0 || N == 0) return CM_OK;
    const int64_t Mp = kn_fp8_rows(M), L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    uint8_t      *qa = malloc((size_t)(Mp * K) + 1);
    float        *sa = malloc((size_t)(Mp * L + 1) * sizeof *sa);
    cm_status     st = qa && sa ? CM_OK
                                : CM_FAIL(CM_ERR_NOMEM, "gemm_fp8: cannot allocate the quantized input (%lld x %lld)",
                                          (long long)M, (long long)K);
    if (st == CM_OK) st = kn_ref_fp8_quantize_rows(ctx, qa, sa, inp, idt, M, K);
    if (st == CM_OK) st = kn_ref_gemm_fp8q(ctx, out, CM_DTYPE_F32, qa, sa, wq, wscale, M, N, K);
    free(qa), free(sa);
    return st;
}

int kn_ref_fp8_supported(const kn_ctx *ctx, char *why, size_t n) {
    (void)ctx;
    if (why && n) why[0] = 0;
    return 1;
}
