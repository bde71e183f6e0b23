/* tests/test_kn_fp8.c — the FP8 block-scaled ops (kn_backend.h "FP8 block-scaled GEMMs").
 *   test_kn_fp8 cpu    the reference (ref/kn_fp8_ref.c) against what the header says, computed here
 *                      another way: e4m3 rounding by a search over all 256 codes (ties to the even
 *                      code), the block and group scales from their formulas, the product as one
 *                      double dot product of the dequantized operands (within 1e-12 of Σ|terms|);
 *                      ragged blocks, BF16 inputs, the refusals, and the CUDA support rule.
 *   test_kn_fp8 cuda   kn_fp8.cu against the cpu reference on odd and 27B shapes: the quantized
 *                      weight and input bytes and scales bit for bit, the product within 2e-3 of
 *                      Σ|terms|: Hopper's FP8 tensor cores add the products of a 128-wide block with
 *                      about 14 mantissa bits before cuBLASLt promotes the block's sum to fp32 (seen
 *                      on an H200: up to 6.7e-4 of Σ|terms| at K = 128, 4e-5 at K = 17408, where the
 *                      errors of many blocks average out); cuBLASLt's product and the wgmma kernel
 *                      (TANDEM_FP8_GEMM=wgmma, compute capability 9.0) on the same operands, each
 *                      against the cpu and against each other, nothing written past M rows; label
 *                      gpu, exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "kn_ref.h"
#include "tst.h"
#include "tst_kn.h"

// ---- the independent pieces

static float e4m3_value(int code) { /* decoded from the bit fields, not through cm_dtype */
    int   s = code >> 7, e = (code >> 3) & 15, m = code & 7;
    float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return s ? -v : v;
}

/* The nearest finite e4m3 code to v (|v| ≤ 448), ties to the code with an even mantissa. */
static uint8_t e4m3_search(float v) {
    int    best = -1;
    double bd = INFINITY;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue; /* NaN */
        double d = fabs((double)e4m3_value(c) - (double)v);
        if (d < bd || (d == bd && (c & 1) == 0 && (best & 1) == 1)) {
            bd = d;
            best = c;
        }
    }
    if (e4m3_value(best) == 0.0f) best = signbit(v) ? 0x80 : 0; /* ±0 keeps the sign, as a cast does */
    return (uint8_t)best;
}

static float clampf(float v) { return v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v; }

static float in_val(const void *p, cm_dtype dt, long i) {
    return dt == CM_DTYPE_BF16 ? tst_bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Random values of mixed magnitudes (so blocks and groups have different scales and some small
 * entries land in e4m3's subnormals), in dt. */
static void *rand_mat(long n, cm_dtype dt) {
    void *p = tst_xcalloc((size_t)n * 4);
    for (long i = 0; i < n; i++) {
        float v = (float)((2 * tst_urand() - 1) * pow(10.0, 3 * tst_urand() - 2));
        if (dt == CM_DTYPE_BF16)
            ((uint16_t *)p)[i] = tst_bf16_round(v);
        else
            ((float *)p)[i] = v;
    }
    return p;
}

// ---- cpu: the reference against the header

static void check_weight_quant(long N, long K, cm_dtype dt) {
    kn_ctx *ctx = NULL;
    TST_CHECK(kn_ref_ctx_create(&ctx, NULL) == CM_OK);
    void         *w = rand_mat(N * K, dt);
    const long    B = 128, nb = (N + B - 1) / B, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K);
    uint8_t      *q = tst_xcalloc((size_t)(N * K));
    float        *s = tst_xcalloc((size_t)(nb * ld) * 4);
    for (long i = 0; i < nb * ld; i++) s[i] = NAN;
    TST_CHECK(kn_ref_fp8_quantize_weight(ctx, q, s, w, dt, N, K) == CM_OK);
    long bad_q = 0, bad_s = 0, bad_pad = 0;
    for (long i = 0; i < nb; i++) {
        for (long j = 0; j < L; j++) {
            float amax = 0;
            for (long n = i * B; n < N && n < (i + 1) * B; n++)
                for (long k = j * B; k < K && k < (j + 1) * B; k++) amax = fmaxf(amax, fabsf(in_val(w, dt, n * K + k)));
            const float r = 448.0f / fmaxf(amax, 1e-12f);
            if (s[i * ld + j] != 1.0f / r) bad_s++;
            for (long n = i * B; n < N && n < (i + 1) * B; n++)
                for (long k = j * B; k < K && k < (j + 1) * B; k++)
                    if (q[n * K + k] != e4m3_search(clampf(in_val(w, dt, n * K + k) * r))) bad_q++;
        }
        for (long j = L; j < ld; j++) bad_pad += s[i * ld + j] != 0.0f;
    }
    printf("quantize_weight N=%-4ld K=%-4ld %s: %ld bytes and %ld scales differ, %ld pads not 0\n", N, K,
           cm_dtype_name(dt), bad_q, bad_s, bad_pad);
    TST_CHECK(bad_q == 0 && bad_s == 0 && bad_pad == 0);
    free(w), free(q), free(s);
    kn_ref_ctx_destroy(&ctx);
}

static void check_gemm(long M, long N, long K, cm_dtype idt) {
    kn_ctx *ctx = NULL;
    TST_CHECK(kn_ref_ctx_create(&ctx, NULL) == CM_OK);
    const long B = 128, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K);
    void      *x = rand_mat(M * K, idt);
    float     *w = rand_mat(N * K, CM_DTYPE_F32);
    uint8_t   *wq = tst_xcalloc((size_t)(N * K)), *qa = tst_xcalloc((size_t)(M * K));
    float     *ws = tst_xcalloc((size_t)(((N + B - 1) / B) * ld) * 4), *sa = tst_xcalloc((size_t)(M * L) * 4);
    float     *out = tst_zeros_f32(M * N), *want = tst_zeros_f32(M * N), *plain = tst_zeros_f32(M * N);
    double    *bound = tst_xcalloc((size_t)(M * N) * sizeof(double));
    TST_CHECK(kn_ref_fp8_quantize_weight(ctx, wq, ws, w, CM_DTYPE_F32, N, K) == CM_OK);
    TST_CHECK(kn_ref_gemm_fp8(ctx, out, x, idt, wq, ws, M, N, K) == CM_OK);
    /* the input's groups, here: a = bf16(x), s = max(amax, 1e-10)·(1/448), q = e4m3(a / s) */
    long bad_q = 0;
    for (long m = 0; m < M; m++)
        for (long j = 0; j < L; j++) {
            float amax = 0;
            for (long k = j * B; k < K && k < (j + 1) * B; k++)
                amax = fmaxf(amax, fabsf(tst_bf16_widen(tst_bf16_round(in_val(x, idt, m * K + k)))));
            sa[m * L + j] = fmaxf(amax, 1e-10f) * (1.0f / 448.0f);
            for (long k = j * B; k < K && k < (j + 1) * B; k++)
                qa[m * K + k] = e4m3_search(clampf(tst_bf16_widen(tst_bf16_round(in_val(x, idt, m * K + k))) / sa[m * L + j]));
        }
    const long Mp = kn_fp8_rows(M);
    uint8_t   *qa_ref = tst_xcalloc((size_t)(Mp * K));
    float     *sa_ref = tst_xcalloc((size_t)(Mp * L) * 4);
    memset(qa_ref, 0x55, (size_t)(Mp * K));
    for (long i = 0; i < Mp * L; i++) sa_ref[i] = NAN;
    TST_CHECK(kn_ref_fp8_quantize_rows(ctx, qa_ref, sa_ref, x, idt, M, K) == CM_OK);
    for (long m = 0; m < Mp; m++) {
        for (long k = 0; k < K; k++) bad_q += qa_ref[m * K + k] != (m < M ? qa[m * K + k] : 0);
        for (long j = 0; j < L; j++) bad_q += !(sa_ref[j * Mp + m] == (m < M ? sa[m * L + j] : 0.0f));
    }
    TST_CHECK(bad_q == 0);
    /* the product: one double dot product of the dequantized operands */
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            double acc = 0, mag = 0, ex = 0;
            for (long k = 0; k < K; k++) {
                double a = (double)e4m3_value(qa[m * K + k]) * sa[m * L + k / B];
                double b = (double)e4m3_value(wq[n * K + k]) * ws[(n / B) * ld + k / B];
                acc += a * b;
                mag += fabs(a * b);
                ex += (double)in_val(x, idt, m * K + k) * (double)w[n * K + k];
            }
            want[m * N + n] = (float)acc;
            plain[m * N + n] = (float)ex;
            bound[m * N + n] = mag;
        }
    char name[96];
    snprintf(name, sizeof name, "gemm_fp8 %ldx%ldx%ld %s (%ld bad q)", M, N, K, cm_dtype_name(idt), bad_q);
    tst_compare_bound(name, 52, out, want, bound, M * N, 1e-12, NULL);
    double d2 = 0, r2 = 0;
    for (long i = 0; i < M * N; i++) d2 += ((double)out[i] - plain[i]) * ((double)out[i] - plain[i]), r2 += (double)plain[i] * plain[i];
    printf("  the W8A8 product against the unquantized one: rel L2 %.4f\n", sqrt(d2 / r2));
    TST_CHECK(sqrt(d2 / r2) < 0.1);
    free(x), free(w), free(wq), free(qa), free(ws), free(sa), free(out), free(want), free(plain), free(bound);
    free(qa_ref), free(sa_ref);
    kn_ref_ctx_destroy(&ctx);
}

/* The fused forms against their definitions, on the cpu: gemm_fp8q's BF16 output is its F32
 * output rounded; swiglu_fp8 from BF16 inputs is swiglu_fp8 of the widened values;
 * add_rmsnorm_fp8 is add_rmsnorm_bf16 then fp8_quantize_rows of its output. */
static void check_fused(long M, long N, long K) {
    kn_ctx *ctx = NULL;
    TST_CHECK(kn_ref_ctx_create(&ctx, NULL) == CM_OK);
    const long B = 128, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K), Mp = kn_fp8_rows(M);
    float     *w = rand_mat(N * K, CM_DTYPE_F32), *x = rand_mat(M * K, CM_DTYPE_F32);
    uint8_t   *wq = tst_xcalloc((size_t)(N * K)), *qa = tst_xcalloc((size_t)(Mp * K));
    float     *ws = tst_xcalloc((size_t)(((N + B - 1) / B) * ld) * 4), *sa = tst_xcalloc((size_t)(Mp * L) * 4);
    float     *o32 = tst_zeros_f32(M * N);
    uint16_t  *o16 = tst_xcalloc((size_t)(M * N) * 2);
    TST_CHECK(kn_ref_fp8_quantize_weight(ctx, wq, ws, w, CM_DTYPE_F32, N, K) == CM_OK);
    TST_CHECK(kn_ref_fp8_quantize_rows(ctx, qa, sa, x, CM_DTYPE_F32, M, K) == CM_OK);
    TST_CHECK(kn_ref_gemm_fp8q(ctx, o32, CM_DTYPE_F32, qa, sa, wq, ws, M, N, K) == CM_OK);
    TST_CHECK(kn_ref_gemm_fp8q(ctx, o16, CM_DTYPE_BF16, qa, sa, wq, ws, M, N, K) == CM_OK);
    /* one rounding from the double sum: the f32 value rounded again, except where that f32 value
     * sits on a bf16 midpoint (then either neighbour, by the side of the double sum) */
    long bad = 0, mid = 0;
    for (long i = 0; i < M * N; i++) {
        uint32_t u;
        memcpy(&u, &o32[i], 4);
        if ((u & 0xffffu) == 0x8000u)
            mid++, bad += o16[i] != (uint16_t)(u >> 16) && o16[i] != (uint16_t)((u >> 16) + 1);
        else
            bad += o16[i] != tst_bf16_round(o32[i]);
    }
    printf("gemm_fp8q %ldx%ldx%ld bf16 out: %ld of %ld values differ from the rounded f32 out (%ld f32 midpoints)\n",
           M, N, K, bad, M * N, mid);
    TST_CHECK(bad == 0);
    /* swiglu_fp8: gate and up as bf16, and the same values as f32 */
    uint16_t *g16 = rand_mat(M * K, CM_DTYPE_BF16), *u16 = rand_mat(M * K, CM_DTYPE_BF16);
    float    *g32 = tst_zeros_f32(M * K), *u32 = tst_zeros_f32(M * K);
    for (long i = 0; i < M * K; i++) g32[i] = tst_bf16_widen(g16[i]), u32[i] = tst_bf16_widen(u16[i]);
    uint8_t *q1 = tst_xcalloc((size_t)(Mp * K)), *q2 = tst_xcalloc((size_t)(Mp * K));
    float   *s1 = tst_xcalloc((size_t)(Mp * L) * 4), *s2 = tst_xcalloc((size_t)(Mp * L) * 4);
    TST_CHECK(kn_ref_swiglu_fp8(ctx, q1, s1, g16, u16, CM_DTYPE_BF16, M, K) == CM_OK);
    TST_CHECK(kn_ref_swiglu_fp8(ctx, q2, s2, g32, u32, CM_DTYPE_F32, M, K) == CM_OK);
    TST_CHECK(memcmp(q1, q2, (size_t)(Mp * K)) == 0 && memcmp(s1, s2, (size_t)(Mp * L) * 4) == 0);
    /* add_rmsnorm_fp8, with and without the residual, both norm-weight conventions */
    for (int var = 0; var < 2; var++) {
        float    *x1 = tst_zeros_f32(M * K), *x2 = tst_zeros_f32(M * K), *nw = rand_mat(K, CM_DTYPE_F32);
        uint16_t *h1 = tst_xcalloc((size_t)(M * K) * 2), *h2 = tst_xcalloc((size_t)(M * K) * 2);
        memcpy(x1, x, (size_t)(M * K) * 4), memcpy(x2, x, (size_t)(M * K) * 4);
        const float *y = var ? g32 : NULL;
        memset(q1, 0x55, (size_t)(Mp * K)), memset(q2, 0, (size_t)(Mp * K));
        TST_CHECK(kn_ref_add_rmsnorm_fp8(ctx, h1, q1, s1, x1, y, nw, M, K, 1e-6f, var) == CM_OK);
        TST_CHECK(kn_ref_add_rmsnorm_bf16(ctx, h2, x2, y, nw, M, K, 1e-6f, var) == CM_OK);
        TST_CHECK(kn_ref_fp8_quantize_rows(ctx, q2, s2, h2, CM_DTYPE_BF16, M, K) == CM_OK);
        TST_CHECK(memcmp(x1, x2, (size_t)(M * K) * 4) == 0 && memcmp(h1, h2, (size_t)(M * K) * 2) == 0);
        TST_CHECK(memcmp(q1, q2, (size_t)(Mp * K)) == 0 && memcmp(s1, s2, (size_t)(Mp * L) * 4) == 0);
        /* out NULL: the same x, bytes and scales, no bf16 output */
        memcpy(x2, x, (size_t)(M * K) * 4), memset(q2, 0x55, (size_t)(Mp * K)), memset(s2, 0x55, (size_t)(Mp * L) * 4);
        TST_CHECK(kn_ref_add_rmsnorm_fp8(ctx, NULL, q2, s2, x2, y, nw, M, K, 1e-6f, var) == CM_OK);
        TST_CHECK(memcmp(x1, x2, (size_t)(M * K) * 4) == 0 && memcmp(q1, q2, (size_t)(Mp * K)) == 0 &&
                  memcmp(s1, s2, (size_t)(Mp * L) * 4) == 0);
        free(x1), free(x2), free(nw), free(h1), free(h2);
    }
    /* rmsnorm_gated_fp8: M tokens of K/16 heads of 16 */
    {
        const long H = K / 16, C = 16;
        float     *nw = rand_mat(C, CM_DTYPE_F32);
        uint16_t  *a = tst_xcalloc((size_t)(M * K) * 2);
        memset(q1, 0x55, (size_t)(Mp * K)), memset(q2, 0, (size_t)(Mp * K));
        TST_CHECK(kn_ref_rmsnorm_gated_fp8(ctx, q1, s1, x, g32, nw, M, H, C, 1e-6f) == CM_OK);
        TST_CHECK(kn_ref_rmsnorm_gated_bf16(ctx, a, x, g32, nw, M * H, C, 1e-6f) == CM_OK);
        TST_CHECK(kn_ref_fp8_quantize_rows(ctx, q2, s2, a, CM_DTYPE_BF16, M, K) == CM_OK);
        TST_CHECK(memcmp(q1, q2, (size_t)(Mp * K)) == 0 && memcmp(s1, s2, (size_t)(Mp * L) * 4) == 0);
        free(nw), free(a);
    }
    TST_FAILS(kn_ref_gemm_fp8q(ctx, o16, CM_DTYPE_F16, qa, sa, wq, ws, M, N, K), CM_ERR_UNSUPPORTED, "F16");
    TST_FAILS(kn_ref_swiglu_fp8(ctx, q1, s1, g16, u16, CM_DTYPE_F16, M, K), CM_ERR_UNSUPPORTED, "F16");
    free(w), free(x), free(wq), free(qa), free(ws), free(sa), free(o32), free(o16);
    free(g16), free(u16), free(g32), free(u32), free(q1), free(q2), free(s1), free(s2);
    kn_ref_ctx_destroy(&ctx);
}

static void check_refusals(void) {
    kn_ctx *ctx = NULL;
    TST_CHECK(kn_ref_ctx_create(&ctx, NULL) == CM_OK);
    float   x[40] = {0}, out[4];
    uint8_t wq[160] = {0};
    float   ws[4] = {1, 0, 0, 0};
    TST_FAILS(kn_ref_gemm_fp8(ctx, out, x, CM_DTYPE_F16, wq, ws, 1, 4, 32), CM_ERR_UNSUPPORTED, "F16");
    TST_FAILS(kn_ref_fp8_quantize_weight(ctx, wq, ws, x, CM_DTYPE_F8_E4M3, 4, 32), CM_ERR_UNSUPPORTED, "F8_E4M3");
    kn_ref_ctx_destroy(&ctx);
    char why[400];
    TST_CHECK(kn_fp8_support(9, 0, 130100, why, sizeof why) == 1 && why[0] == 0);
    TST_CHECK(kn_fp8_support(8, 9, 130100, why, sizeof why) == 0 && strstr(why, "compute capability 8.9") &&
              strstr(why, "--precision bf16"));
    printf("refusal on an Ada GPU: %s\n", why);
    TST_CHECK(kn_fp8_support(10, 0, 130100, why, sizeof why) == 0 && strstr(why, "10.0"));
    TST_CHECK(kn_fp8_support(9, 0, 120800, why, sizeof why) == 0 && strstr(why, "12.9"));
}

static int run_cpu(void) {
    check_weight_quant(1, 16, CM_DTYPE_F32);
    check_weight_quant(130, 200, CM_DTYPE_BF16);
    check_weight_quant(256, 640, CM_DTYPE_F32);
    check_gemm(1, 48, 64, CM_DTYPE_F32);
    check_gemm(5, 80, 40, CM_DTYPE_BF16); /* K = 40: fine on the cpu (cuda refuses it) */
    check_gemm(7, 112, 96, CM_DTYPE_BF16);
    check_gemm(19, 136, 336, CM_DTYPE_F32);
    check_gemm(40, 260, 512, CM_DTYPE_BF16);
    check_fused(5, 48, 64);
    check_fused(19, 136, 336);
    check_refusals();
    return tst_report();
}

// ---- cuda: kn_fp8.cu against the reference

#include "tst_kn_pair.h"

static void *down(const dbuf *b, int on_gpu) {
    void *h = tst_xcalloc(b->bytes);
    if ((on_gpu ? gpu->download(gctx16, h, b->g, b->bytes) : cpu->download(cctx, h, b->c, b->bytes)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    return h;
}

/* bound[m, n] = Σ_k |q[m, k] s[k / 128, m] · wq[n, k] ws[n / 128, k / 128]|: the scale of the
 * product's rounding, from the quantized operands as fp8_quantize_rows and fp8_quantize_weight
 * lay them out. */
static void sum_abs_terms(double *bound, const uint8_t *xq, const float *xs, const uint8_t *wq, const float *ws, long M,
                          long N, long K) {
    const long Mp = kn_fp8_rows(M), ld = kn_fp8_scale_ld(K);
    float      lut[256];
    for (int c = 0; c < 256; c++) lut[c] = e4m3_value(c);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            double mag = 0;
            for (long k = 0; k < K; k++)
                mag += fabs((double)lut[xq[m * K + k]] * xs[(k / 128) * Mp + m] * lut[wq[n * K + k]] *
                            ws[(n / 128) * ld + k / 128]);
            bound[m * N + n] = mag;
        }
}

/* fp8_quantize_rows of bf16 rows holding a NaN, a −NaN and a +inf (K = 272: three groups, the last
 * ragged): the scales equal the cpu's bit for bit (inf where the group holds the inf), and so do
 * the bytes, except that a NaN's byte only has to be a NaN code on both sides (the cpu keeps the
 * sign, the conversion on the gpu gives 0x7f). */
static void cuda_nan_rows(void) {
    const long M = 3, K = 272, L = (K + 127) / 128, Mp = kn_fp8_rows(M);
    uint16_t  *hx = rand_mat(M * K, CM_DTYPE_BF16);
    hx[1 * K + 5] = 0x7fc0, hx[2 * K + 130] = 0xffc0, hx[0 * K + 200] = 0x7f80;
    dbuf x = dbuf_put(hx, (size_t)(M * K) * 2), q = dbuf_put(NULL, (size_t)(Mp * K)),
         s = dbuf_put(NULL, (size_t)(Mp * L) * 4);
    TST_CHECK(cpu->fp8_quantize_rows(cctx, q.c, s.c, x.c, CM_DTYPE_BF16, M, K) == CM_OK);
    TST_CHECK(gpu->fp8_quantize_rows(gctx16, q.g, s.g, x.g, CM_DTYPE_BF16, M, K) == CM_OK);
    uint8_t *qc = down(&q, 0), *qg = down(&q, 1);
    float   *sc = down(&s, 0), *sg = down(&s, 1);
    long     dq = 0, ds = 0, nan = 0;
    for (long i = 0; i < Mp * K; i++) {
        if ((qc[i] & 0x7f) == 0x7f) {
            nan++;
            dq += (qg[i] & 0x7f) != 0x7f;
        } else {
            dq += qc[i] != qg[i];
        }
    }
    for (long i = 0; i < Mp * L; i++) ds += memcmp(&sc[i], &sg[i], 4) != 0;
    printf("fp8_quantize_rows with NaN and inf inputs: %ld NaN codes, %ld bytes and %ld scales differ\n", nan, dq,
           ds);
    TST_CHECK(nan >= 3 && dq == 0 && ds == 0);
    TST_CHECK(isinf(sc[1 * Mp + 0]));
    free(hx), free(qc), free(qg), free(sc), free(sg);
    dbuf_free(&x), dbuf_free(&q), dbuf_free(&s);
}

static void cuda_case(long M, long N, long K, cm_dtype idt, cm_dtype wdt) {
    const long B = 128, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K), nb = (N + B - 1) / B;
    void      *hx = rand_mat(M * K, idt), *hw = rand_mat(N * K, wdt);
    dbuf       x = dbuf_put(hx, (size_t)(M * K) * cm_dtype_size(idt)), w = dbuf_put(hw, (size_t)(N * K) * cm_dtype_size(wdt));
    dbuf       wq = dbuf_put(NULL, (size_t)(N * K)), ws = dbuf_put(NULL, (size_t)(nb * ld) * 4);
    dbuf       out = dbuf_put(NULL, (size_t)(M * N) * 4);
    /* the cpu quantizes into its buffers, the gpu into its own; the bytes must agree */
    TST_CHECK(cpu->fp8_quantize_weight(cctx, wq.c, ws.c, w.c, wdt, N, K) == CM_OK);
    TST_CHECK(gpu->fp8_quantize_weight(gctx16, wq.g, ws.g, w.g, wdt, N, K) == CM_OK);
    uint8_t *qc = down(&wq, 0), *qg = down(&wq, 1);
    float   *sc = down(&ws, 0), *sg = down(&ws, 1);
    long     dq = 0, ds = 0;
    for (long i = 0; i < N * K; i++) dq += qc[i] != qg[i];
    for (long i = 0; i < nb * ld; i++) ds += memcmp(&sc[i], &sg[i], 4) != 0;
    printf("quantize_weight %ldx%ld %s: %ld of %ld bytes and %ld of %ld scales differ\n", N, K, cm_dtype_name(wdt),
           dq, N * K, ds, nb * ld);
    TST_CHECK(dq == 0 && ds == 0);
    /* both products from the cpu's quantized weight (uploaded to the gpu), so only the product differs */
    TST_CHECK(gpu->upload(gctx16, wq.g, qc, (size_t)(N * K)) == CM_OK && gpu->upload(gctx16, ws.g, sc, (size_t)(nb * ld) * 4) == CM_OK);
    TST_CHECK(cpu->gemm_fp8(cctx, out.c, x.c, idt, wq.c, ws.c, M, N, K) == CM_OK);
    TST_CHECK(gpu->gemm_fp8(gctx16, out.g, x.g, idt, wq.g, ws.g, M, N, K) == CM_OK);
    float   *oc = down(&out, 0), *og = down(&out, 1);
    double  *bound = tst_xcalloc((size_t)(M * N) * sizeof(double));
    /* the input's quantization alone, bit for bit, and the product from it (gemm_fp8q) */
    const long Mp = kn_fp8_rows(M);
    dbuf       xq = dbuf_put(NULL, (size_t)(Mp * K)), xs = dbuf_put(NULL, (size_t)(Mp * L) * 4);
    TST_CHECK(cpu->fp8_quantize_rows(cctx, xq.c, xs.c, x.c, idt, M, K) == CM_OK);
    TST_CHECK(gpu->fp8_quantize_rows(gctx16, xq.g, xs.g, x.g, idt, M, K) == CM_OK);
    uint8_t *xqc = down(&xq, 0), *xqg = down(&xq, 1);
    float   *xsc = down(&xs, 0), *xsg = down(&xs, 1);
    TST_CHECK(memcmp(xqc, xqg, (size_t)(Mp * K)) == 0 && memcmp(xsc, xsg, (size_t)(Mp * L) * 4) == 0);
    dbuf out2 = dbuf_put(NULL, (size_t)(M * N) * 4);
    TST_CHECK(gpu->gemm_fp8q(gctx16, out2.g, CM_DTYPE_F32, xq.g, xs.g, wq.g, ws.g, M, N, K) == CM_OK);
    float *og2 = down(&out2, 1);
    TST_CHECK(memcmp(og, og2, (size_t)(M * N) * 4) == 0); /* the same plan and operands */
    /* gemm_fp8q_acc: the product added onto out, = gemm_fp8q then the fp32 add (the cpu exactly;
     * cuda's epilogue adds its fp32 sum to out once: within an ulp of that, counted beside) */
    {
        float *base = rand_mat(M * N, CM_DTYPE_F32);
        dbuf   acc = dbuf_put(base, (size_t)(M * N) * 4);
        TST_CHECK(gpu->gemm_fp8q_acc(gctx16, acc.g, xq.g, xs.g, wq.g, ws.g, M, N, K) == CM_OK);
        TST_CHECK(cpu->gemm_fp8q_acc(cctx, acc.c, xq.c, xs.c, wq.c, ws.c, M, N, K) == CM_OK);
        float *ag = down(&acc, 1), *ac = down(&acc, 0);
        long   bits = 0, far = 0, cpu_bad = 0;
        for (long i = 0; i < M * N; i++) {
            const float want = base[i] + og[i], wc = base[i] + oc[i];
            bits += memcmp(&ag[i], &want, 4) != 0;
            far += fabs((double)ag[i] - want) > 2.4e-7 * (fabs((double)base[i]) + fabs((double)og[i]));
            cpu_bad += memcmp(&ac[i], &wc, 4) != 0;
        }
        printf("gemm_fp8q_acc %ldx%ldx%ld: cuda %ld of %ld values not bit-equal to gemm_fp8q + add (%ld past an ulp), "
               "cpu %ld\n", M, N, K, bits, M * N, far, cpu_bad);
        TST_CHECK(far == 0 && cpu_bad == 0);
        free(base), free(ag), free(ac);
        dbuf_free(&acc);
    }
    /* the bf16 output: cuBLASLt's epilogue rounds its own fp32 sum, so against the cpu's rounded
     * value it may differ by the sums' difference plus one bf16 step */
    dbuf out16 = dbuf_put(NULL, (size_t)(M * N) * 2);
    TST_CHECK(gpu->gemm_fp8q(gctx16, out16.g, CM_DTYPE_BF16, xq.g, xs.g, wq.g, ws.g, M, N, K) == CM_OK);
    TST_CHECK(cpu->gemm_fp8q(cctx, out16.c, CM_DTYPE_BF16, xq.c, xs.c, wq.c, ws.c, M, N, K) == CM_OK);
    uint16_t *g16 = down(&out16, 1), *c16 = down(&out16, 0);
    float    *gw = tst_zeros_f32(M * N), *cw = tst_zeros_f32(M * N);
    double   *bound16 = tst_xcalloc((size_t)(M * N) * sizeof(double));
    sum_abs_terms(bound, xqc, xsc, qc, sc, M, N, K);
    char name[96];
    snprintf(name, sizeof name, "gemm_fp8 cuda %ldx%ldx%ld %s", M, N, K, cm_dtype_name(idt));
    tst_compare_bound(name, 44, og, oc, bound, M * N, 2e-3, NULL);
    for (long i = 0; i < M * N; i++) {
        gw[i] = tst_bf16_widen(g16[i]), cw[i] = tst_bf16_widen(c16[i]);
        bound16[i] = 2e-3 * bound[i] + fabs((double)cw[i]) * (1.0 / 128);
    }
    snprintf(name, sizeof name, "gemm_fp8q cuda bf16 out %ldx%ldx%ld", M, N, K);
    tst_compare_bound(name, 44, gw, cw, bound16, M * N, 1.0, NULL);
    free(g16), free(c16), free(gw), free(cw), free(bound16);
    dbuf_free(&out16);
    free(xqc), free(xqg), free(xsc), free(xsg), free(og2);
    dbuf_free(&xq), dbuf_free(&xs), dbuf_free(&out2);
    free(hx), free(hw), free(qc), free(qg), free(sc), free(sg), free(oc), free(og), free(bound);
    dbuf_free(&x), dbuf_free(&w), dbuf_free(&wq), dbuf_free(&ws), dbuf_free(&out);
}

#ifdef TANDEM_HAVE_CUDA
#include "kn_fp8_int.h"

/* gemm_fp8q's two CUDA forms on the same quantized operands: cuBLASLt's block-scaled product (the
 * default, gctx16) and the wgmma kernel of compute capability 9.0 (wg, made with
 * TANDEM_FP8_GEMM=wgmma), each against the cpu and against each other within 2e-3 of Σ|terms|,
 * F32 and BF16 outputs and the F32 add. out has rows to spare past M, poisoned: the
 * product must write every value of its M rows and nothing past them. Shapes with ragged row,
 * column and K tiles, and more tiles than the GPU has SMs (the persistent walk). */
static void forms_agree(kn_ctx *wg, long M, long N, long K) {
    const long Mp = kn_fp8_rows(M), L = (K + 127) / 128, ld = kn_fp8_scale_ld(K), nb = (N + 127) / 128, E = 16 * N;
    void      *hx = rand_mat(M * K, CM_DTYPE_BF16), *hw = rand_mat(N * K, CM_DTYPE_BF16);
    dbuf x = dbuf_put(hx, (size_t)(M * K) * 2), w = dbuf_put(hw, (size_t)(N * K) * 2),
         wq = dbuf_put(NULL, (size_t)(N * K)), ws = dbuf_put(NULL, (size_t)(nb * ld) * 4),
         xq = dbuf_put(NULL, (size_t)(Mp * K)), xs = dbuf_put(NULL, (size_t)(Mp * L) * 4);
    TST_CHECK(cpu->fp8_quantize_weight(cctx, wq.c, ws.c, w.c, CM_DTYPE_BF16, N, K) == CM_OK);
    TST_CHECK(cpu->fp8_quantize_rows(cctx, xq.c, xs.c, x.c, CM_DTYPE_BF16, M, K) == CM_OK);
    uint8_t *hwq = down(&wq, 0), *hxq = down(&xq, 0);
    float   *hws = down(&ws, 0), *hxs = down(&xs, 0);
    TST_CHECK(gpu->upload(gctx16, wq.g, hwq, wq.bytes) == CM_OK && gpu->upload(gctx16, ws.g, hws, ws.bytes) == CM_OK &&
              gpu->upload(gctx16, xq.g, hxq, xq.bytes) == CM_OK && gpu->upload(gctx16, xs.g, hxs, xs.bytes) == CM_OK);
    const size_t nd = (size_t)(M * N) * sizeof(double);
    double      *bound = tst_xcalloc(nd), *bound16 = tst_xcalloc(nd), *badd = tst_xcalloc(nd);
    sum_abs_terms(bound, hxq, hxs, hwq, hws, M, N, K);
    float *ref = tst_zeros_f32(M * N), *base = rand_mat(M * N + E, CM_DTYPE_F32);
    TST_CHECK(cpu->gemm_fp8q(cctx, ref, CM_DTYPE_F32, hxq, hxs, hwq, hws, M, N, K) == CM_OK);
    float *got[2][3]; /* [form][F32, BF16 widened, ADD] */
    long   spill[2] = {0, 0};
    /* cuBLASLt's bf16 rows must be 16-byte aligned: a BF16 output with N % 8 is refused there */
    int refused[2] = {N % 8 != 0, N % 8 != 0 && !kn_fp8_wg_available(gctx16)};
    for (int f = 0; f < 2; f++) {
        kn_ctx        *c = f ? wg : gctx16;
        const cm_dtype odt[2] = {CM_DTYPE_F32, CM_DTYPE_BF16};
        for (int o = 0; o < 3; o++) {
            const size_t elem = o == 1 ? 2 : 4, bytes = (size_t)(M * N + E) * elem;
            void        *h = tst_xcalloc(bytes);
            if (o == 2)
                memcpy(h, base, bytes);
            else
                memset(h, 0xFF, bytes); /* NaN in both widths */
            void *d = NULL;
            TST_CHECK(gpu->alloc(c, &d, bytes) == CM_OK && gpu->upload(c, d, h, bytes) == CM_OK);
            if (o == 1 && refused[f])
                TST_FAILS(gpu->gemm_fp8q(c, d, odt[o], xq.g, xs.g, wq.g, ws.g, M, N, K), CM_ERR_UNSUPPORTED,
                          "multiple of 8");
            else if (o < 2)
                TST_CHECK(gpu->gemm_fp8q(c, d, odt[o], xq.g, xs.g, wq.g, ws.g, M, N, K) == CM_OK);
            else
                TST_CHECK(gpu->gemm_fp8q_acc(c, d, xq.g, xs.g, wq.g, ws.g, M, N, K) == CM_OK);
            void *back = tst_xcalloc(bytes);
            TST_CHECK(gpu->download(c, back, d, bytes) == CM_OK);
            spill[f] += memcmp((char *)back + (size_t)(M * N) * elem, (char *)h + (size_t)(M * N) * elem,
                               (size_t)E * elem) != 0;
            got[f][o] = tst_zeros_f32(M * N);
            for (long i = 0; i < M * N; i++)
                got[f][o][i] = o == 1 ? tst_bf16_widen(((uint16_t *)back)[i])
                               : o == 2 ? ((float *)back)[i] - base[i]
                                        : ((float *)back)[i];
            gpu->free(c, d);
            free(h), free(back);
        }
    }
    printf("gemm_fp8q %ldx%ldx%ld: rows past M changed by cuBLASLt %ld, by the wgmma kernel %ld (of 3 outputs each)\n",
           M, N, K, spill[0], spill[1]);
    TST_CHECK(spill[0] == 0 && spill[1] == 0);
    static const char *form[2] = {"cublaslt", "wgmma"}, *out[3] = {"f32", "bf16", "f32 add"};
    char               name[96];
    /* bf16: one bf16 step more; the add: its difference carries base's rounding, an ulp of |base| */
    for (long i = 0; i < M * N; i++) {
        bound16[i] = 2e-3 * bound[i] + fabs((double)ref[i]) * (1.0 / 128);
        badd[i] = 2e-3 * bound[i] + 1.2e-7 * fabs((double)base[i]);
    }
    const double *bnd[3] = {bound, bound16, badd}, tol[3] = {2e-3, 1.0, 1.0};
    for (int f = 0; f < 2; f++)
        for (int o = 0; o < 3; o++) {
            if (o == 1 && refused[f])
                continue; /* refused above: nothing to compare */
            snprintf(name, sizeof name, "gemm_fp8q %s %s %ldx%ldx%ld vs cpu", form[f], out[o], M, N, K);
            tst_compare_bound(name, 52, got[f][o], ref, bnd[o], M * N, tol[o], NULL);
        }
    snprintf(name, sizeof name, "gemm_fp8q wgmma vs cublaslt f32 %ldx%ldx%ld", M, N, K);
    tst_compare_bound(name, 52, got[1][0], got[0][0], bound, M * N, 2e-3, NULL);
    long bits = 0;
    for (long i = 0; i < M * N; i++) bits += memcmp(&got[1][0][i], &got[0][0][i], 4) != 0;
    printf("gemm_fp8q %ldx%ldx%ld: %ld of %ld f32 values of the two forms differ in any bit\n", M, N, K, bits, M * N);
    /* the wgmma kernel's other forms: the same bits as its default's (same sums, same order) */
    if (kn_fp8_wg_available(gctx16)) {
        float *o = NULL, *h = tst_zeros_f32(M * N);
        TST_CHECK(gpu->alloc(gctx16, (void **)&o, (size_t)(M * N) * 4) == CM_OK);
        for (int cfg = 1; cfg < KN_FP8_WG_CONFIGS; cfg++) {
            TST_CHECK(gpu->fill_uniform(gctx16, o, CM_DTYPE_F32, M * N, 5, -1, 1) == CM_OK);
            TST_CHECK(kn_fp8_gemm_wg(gctx16, o, KN_FP8_OUT_F32, xq.g, xs.g, wq.g, ws.g, M, N, K, cfg) == CM_OK);
            TST_CHECK(gpu->download(gctx16, h, o, (size_t)(M * N) * 4) == CM_OK);
            const int same = memcmp(h, got[1][0], (size_t)(M * N) * 4) == 0;
            printf("gemm_fp8q wgmma form %d %ldx%ldx%ld: %s the default form's bits\n", cfg, M, N, K,
                   same ? "equal to" : "NOT equal to");
            TST_CHECK(same);
        }
        gpu->free(gctx16, o);
        free(h);
    }
    for (int f = 0; f < 2; f++)
        for (int o = 0; o < 3; o++) free(got[f][o]);
    free(hx), free(hw), free(hwq), free(hxq), free(hws), free(hxs), free(bound), free(bound16), free(badd), free(ref),
        free(base);
    dbuf_free(&x), dbuf_free(&w), dbuf_free(&wq), dbuf_free(&ws), dbuf_free(&xq), dbuf_free(&xs);
}
#endif

/* The fused forms on the gpu, bit for bit against the gpu's own unfused ops: swiglu_fp8 from
 * bf16 gate and up against swiglu_fp8 from the same values in f32; add_rmsnorm_fp8 against
 * add_rmsnorm_bf16 then fp8_quantize_rows (x, the bf16 output, bytes and scales; padding rows
 * included). The cpu's bytes are counted beside (its sums may round differently). */
static void cuda_fused(long M, long C, int one_plus) {
    const long L = (C + 127) / 128, Mp = kn_fp8_rows(M);
    uint16_t  *hg = rand_mat(M * C, CM_DTYPE_BF16), *hu = rand_mat(M * C, CM_DTYPE_BF16);
    float     *fg = tst_zeros_f32(M * C), *fu = tst_zeros_f32(M * C), *hx = rand_mat(M * C, CM_DTYPE_F32);
    float     *hy = rand_mat(M * C, CM_DTYPE_F32), *hw = rand_mat(C, CM_DTYPE_F32);
    for (long i = 0; i < M * C; i++) fg[i] = tst_bf16_widen(hg[i]), fu[i] = tst_bf16_widen(hu[i]);
    dbuf g16 = dbuf_put(hg, (size_t)(M * C) * 2), u16 = dbuf_put(hu, (size_t)(M * C) * 2);
    dbuf g32 = dbuf_put(fg, (size_t)(M * C) * 4), u32 = dbuf_put(fu, (size_t)(M * C) * 4);
    dbuf q1 = dbuf_put(NULL, (size_t)(Mp * C)), q2 = dbuf_put(NULL, (size_t)(Mp * C));
    dbuf s1 = dbuf_put(NULL, (size_t)(L * Mp) * 4), s2 = dbuf_put(NULL, (size_t)(L * Mp) * 4);
    TST_CHECK(gpu->swiglu_fp8(gctx16, q1.g, s1.g, g16.g, u16.g, CM_DTYPE_BF16, M, C) == CM_OK);
    TST_CHECK(gpu->swiglu_fp8(gctx16, q2.g, s2.g, g32.g, u32.g, CM_DTYPE_F32, M, C) == CM_OK);
    uint8_t *b1 = down(&q1, 1), *b2 = down(&q2, 1);
    float   *c1 = down(&s1, 1), *c2 = down(&s2, 1);
    long     dq = 0;
    for (long i = 0; i < Mp * C; i++) dq += b1[i] != b2[i];
    printf("swiglu_fp8 bf16 in %ldx%ld: %ld bytes differ from the f32 form, scales %s\n", M, C, dq,
           memcmp(c1, c2, (size_t)(L * Mp) * 4) ? "DIFFER" : "equal");
    TST_CHECK(dq == 0 && memcmp(c1, c2, (size_t)(L * Mp) * 4) == 0);
    free(b1), free(b2), free(c1), free(c2);
    /* add_rmsnorm_fp8: q1/s1 start as garbage, so the padding rows must be written */
    for (int with_y = 0; with_y < 2; with_y++) {
        dbuf x1 = dbuf_put(hx, (size_t)(M * C) * 4), x2 = dbuf_put(hx, (size_t)(M * C) * 4);
        dbuf y = dbuf_put(hy, (size_t)(M * C) * 4), w = dbuf_put(hw, (size_t)C * 4);
        dbuf h1 = dbuf_put(NULL, (size_t)(M * C) * 2), h2 = dbuf_put(NULL, (size_t)(M * C) * 2);
        void *junk = tst_xcalloc((size_t)(Mp * C) + (size_t)(L * Mp) * 4);
        memset(junk, 0x7f, (size_t)(Mp * C) + (size_t)(L * Mp) * 4);
        TST_CHECK(gpu->upload(gctx16, q1.g, junk, (size_t)(Mp * C)) == CM_OK);
        TST_CHECK(gpu->upload(gctx16, s1.g, junk, (size_t)(L * Mp) * 4) == CM_OK);
        free(junk);
        TST_CHECK(gpu->add_rmsnorm_fp8(gctx16, h1.g, q1.g, s1.g, x1.g, with_y ? y.g : NULL, w.g, M, C, 1e-6f,
                                       one_plus) == CM_OK);
        TST_CHECK(gpu->add_rmsnorm_bf16(gctx16, h2.g, x2.g, with_y ? y.g : NULL, w.g, M, C, 1e-6f, one_plus) == CM_OK);
        TST_CHECK(gpu->fp8_quantize_rows(gctx16, q2.g, s2.g, h2.g, CM_DTYPE_BF16, M, C) == CM_OK);
        TST_CHECK(cpu->add_rmsnorm_fp8(cctx, h1.c, q1.c, s1.c, x1.c, with_y ? y.c : NULL, w.c, M, C, 1e-6f,
                                       one_plus) == CM_OK);
        void    *xa = down(&x1, 1), *xb = down(&x2, 1), *ha = down(&h1, 1), *hb = down(&h2, 1), *hc = down(&h1, 0);
        uint8_t *qa = down(&q1, 1), *qb = down(&q2, 1), *qc = down(&q1, 0);
        float   *sa = down(&s1, 1), *sb = down(&s2, 1);
        long     dq2 = 0, dh = 0, dc = 0;
        for (long i = 0; i < Mp * C; i++) dq2 += qa[i] != qb[i], dc += qa[i] != qc[i];
        for (long i = 0; i < M * C; i++) dh += ((uint16_t *)ha)[i] != ((uint16_t *)hc)[i];
        const int same = memcmp(xa, xb, (size_t)(M * C) * 4) == 0 && memcmp(ha, hb, (size_t)(M * C) * 2) == 0 &&
                         memcmp(sa, sb, (size_t)(L * Mp) * 4) == 0;
        printf("add_rmsnorm_fp8 %ldx%ld%s%s: %ld bytes differ from the two ops, x/out/scales %s; against the cpu "
               "%ld of %ld bf16 values and %ld bytes differ\n",
               M, C, with_y ? " +y" : "", one_plus ? " 1+w" : "", dq2, same ? "equal" : "DIFFER", dh, M * C, dc);
        TST_CHECK(dq2 == 0 && same);
        TST_CHECK(dh <= M * C / 100); /* the cpu's row sums round differently now and then */
        /* out NULL (nothing reads the bf16 values): the same x, bytes and scales */
        {
            dbuf x3 = dbuf_put(hx, (size_t)(M * C) * 4);
            TST_CHECK(gpu->add_rmsnorm_fp8(gctx16, NULL, q2.g, s2.g, x3.g, with_y ? y.g : NULL, w.g, M, C, 1e-6f,
                                           one_plus) == CM_OK);
            void    *xn = down(&x3, 1);
            uint8_t *qn = down(&q2, 1);
            float   *sn = down(&s2, 1);
            const int eq = memcmp(xn, xa, (size_t)(M * C) * 4) == 0 && memcmp(qn, qa, (size_t)(Mp * C)) == 0 &&
                           memcmp(sn, sa, (size_t)(L * Mp) * 4) == 0;
            printf("add_rmsnorm_fp8 %ldx%ld%s%s without the bf16 output: x/bytes/scales %s\n", M, C,
                   with_y ? " +y" : "", one_plus ? " 1+w" : "", eq ? "equal" : "DIFFER");
            TST_CHECK(eq);
            free(xn), free(qn), free(sn);
            dbuf_free(&x3);
        }
        free(xa), free(xb), free(ha), free(hb), free(hc), free(qa), free(qb), free(qc), free(sa), free(sb);
        dbuf_free(&x1), dbuf_free(&x2), dbuf_free(&y), dbuf_free(&w), dbuf_free(&h1), dbuf_free(&h2);
    }
    /* rmsnorm_gated_fp8 (heads of 128 or 256; 64 is refused): x as the core's output, y as z */
    for (long hc = 64; hc <= 256; hc *= 2) {
        const long H = C / hc;
        if (H < 1 || C % hc) continue;
        dbuf x = dbuf_put(hx, (size_t)(M * C) * 4), z = dbuf_put(hy, (size_t)(M * C) * 4);
        dbuf w = dbuf_put(hw, (size_t)hc * 4), a = dbuf_put(NULL, (size_t)(M * C) * 2);
        cm_status st = gpu->rmsnorm_gated_fp8(gctx16, q1.g, s1.g, x.g, z.g, w.g, M, H, hc, 1e-6f);
        if (hc % 128) {
            TST_CHECK(st == CM_ERR_UNSUPPORTED);
        } else {
            TST_CHECK(st == CM_OK);
            TST_CHECK(gpu->rmsnorm_gated_bf16(gctx16, a.g, x.g, z.g, w.g, M * H, hc, 1e-6f) == CM_OK);
            TST_CHECK(gpu->fp8_quantize_rows(gctx16, q2.g, s2.g, a.g, CM_DTYPE_BF16, M, C) == CM_OK);
            TST_CHECK(cpu->rmsnorm_gated_fp8(cctx, q1.c, s1.c, x.c, z.c, w.c, M, H, hc, 1e-6f) == CM_OK);
            uint8_t *qa = down(&q1, 1), *qb = down(&q2, 1), *qc = down(&q1, 0);
            float   *sa = down(&s1, 1), *sb = down(&s2, 1);
            long     d1 = 0, dc = 0;
            for (long i = 0; i < Mp * C; i++) d1 += qa[i] != qb[i], dc += qa[i] != qc[i];
            const int same_s = memcmp(sa, sb, (size_t)(L * Mp) * 4) == 0;
            printf("rmsnorm_gated_fp8 %ld x %ld heads of %ld: %ld bytes differ from the two ops, scales %s; %ld "
                   "bytes differ from the cpu\n", M, H, hc, d1, same_s ? "equal" : "DIFFER", dc);
            TST_CHECK(d1 == 0 && same_s);
            TST_CHECK(dc <= Mp * C / 100);
            free(qa), free(qb), free(qc), free(sa), free(sb);
        }
        dbuf_free(&x), dbuf_free(&z), dbuf_free(&w), dbuf_free(&a);
    }
    free(hg), free(hu), free(fg), free(fu), free(hx), free(hy), free(hw);
    dbuf_free(&g16), dbuf_free(&u16), dbuf_free(&g32), dbuf_free(&u32);
    dbuf_free(&q1), dbuf_free(&q2), dbuf_free(&s1), dbuf_free(&s2);
}

static int run_cuda(void) {
    if (!tst_pair_open()) return tst_report();
    char why[400];
    if (!gpu->fp8_supported(gctx16, why, sizeof why)) {
        printf("%s\n", why); /* the refusal is the answer on this device */
        TST_CHECK(strstr(why, "--precision bf16") != NULL);
        tst_pair_close();
        TST_SKIP("no block-scaled FP8 on this device");
    }
    cuda_case(1, 48, 64, CM_DTYPE_BF16, CM_DTYPE_BF16);
    cuda_case(3, 112, 96, CM_DTYPE_F32, CM_DTYPE_F32);
    cuda_case(16, 64, 48, CM_DTYPE_BF16, CM_DTYPE_BF16);
    cuda_case(17, 256, 128, CM_DTYPE_F32, CM_DTYPE_BF16);
    cuda_case(33, 136, 336, CM_DTYPE_BF16, CM_DTYPE_F32);
    cuda_case(200, 384, 1024, CM_DTYPE_BF16, CM_DTYPE_BF16);
    cuda_case(64, 1024, 5120, CM_DTYPE_BF16, CM_DTYPE_BF16);  /* 27B: in_qkv's K */
    cuda_case(48, 640, 17408, CM_DTYPE_BF16, CM_DTYPE_BF16);  /* 27B: down_proj's K */
    cuda_case(256, 1536, 6144, CM_DTYPE_BF16, CM_DTYPE_BF16); /* 27B: out_proj's K */
    cuda_nan_rows();
#ifdef TANDEM_HAVE_CUDA
    {
        kn_ctx *wg = NULL;
        if (tst_gpu_ctx_env(&wg, "TANDEM_FP8_GEMM", "wgmma")) {
            forms_agree(wg, 1, 4, 16);
            forms_agree(wg, 37, 260, 400);    /* ragged rows, columns and K */
            forms_agree(wg, 300, 132, 128);
            forms_agree(wg, 2000, 1284, 272); /* more tiles than SMs in both forms */
            forms_agree(wg, 130, 1024, 5120); /* 27B: in_qkv's K */
            gpu->ctx_destroy(&wg);
        }
    }
#endif
    /* swiglu_fp8 fused = swiglu_bf16 then fp8_quantize_rows, on the gpu, bit for bit (M ragged) */
    {
        const long M = 37, I = 17408, L = I / 128, Mp = kn_fp8_rows(M);
        float     *hg = rand_mat(M * I, CM_DTYPE_F32), *hu = rand_mat(M * I, CM_DTYPE_F32);
        dbuf       g = dbuf_put(hg, (size_t)(M * I) * 4), u = dbuf_put(hu, (size_t)(M * I) * 4);
        dbuf       a16 = dbuf_put(NULL, (size_t)(M * I) * 2), q1 = dbuf_put(NULL, (size_t)(Mp * I)),
             q2 = dbuf_put(NULL, (size_t)(Mp * I)), s1 = dbuf_put(NULL, (size_t)(L * Mp) * 4),
             s2 = dbuf_put(NULL, (size_t)(L * Mp) * 4);
        TST_CHECK(gpu->swiglu_fp8(gctx16, q1.g, s1.g, g.g, u.g, CM_DTYPE_F32, M, I) == CM_OK);
        TST_CHECK(gpu->swiglu_bf16(gctx16, a16.g, g.g, u.g, M * I) == CM_OK);
        TST_CHECK(gpu->fp8_quantize_rows(gctx16, q2.g, s2.g, a16.g, CM_DTYPE_BF16, M, I) == CM_OK);
        uint8_t *b1 = down(&q1, 1), *b2 = down(&q2, 1);
        float   *c1 = down(&s1, 1), *c2 = down(&s2, 1);
        long     dq = 0;
        for (long i = 0; i < Mp * I; i++) dq += b1[i] != b2[i];
        printf("swiglu_fp8 %ldx%ld: %ld bytes differ from swiglu_bf16 + fp8_quantize_rows, scales %s\n", M, I, dq,
               memcmp(c1, c2, (size_t)(L * Mp) * 4) ? "DIFFER" : "equal");
        TST_CHECK(dq == 0 && memcmp(c1, c2, (size_t)(L * Mp) * 4) == 0);
        free(hg), free(hu), free(b1), free(b2), free(c1), free(c2);
        dbuf_free(&g), dbuf_free(&u), dbuf_free(&a16), dbuf_free(&q1), dbuf_free(&q2), dbuf_free(&s1), dbuf_free(&s2);
    }
    cuda_fused(37, 17408, 0);
    cuda_fused(37, 6144, 1); /* the 27B's GDN output: 48 heads of 128 */
    cuda_fused(16, 64, 1);   /* one ragged group, no padding rows */
    cuda_fused(5, 2304, 0);  /* a last group of 0, heads of 256 */
    cuda_fused(5, 2064, 0);  /* a last group of 16 */
    cuda_fused(130, 48, 1);
    /* K not a multiple of 16, N not a multiple of 4: refused, with the way out */
    {
        dbuf x = dbuf_put(NULL, 40 * 4), wq = dbuf_put(NULL, 8 * 40), ws = dbuf_put(NULL, 16), out = dbuf_put(NULL, 8 * 4);
        TST_FAILS(gpu->gemm_fp8(gctx16, out.g, x.g, CM_DTYPE_F32, wq.g, ws.g, 1, 8, 40), CM_ERR_INVALID_ARG, "K=40",
                  "16");
        dbuf_free(&x), dbuf_free(&wq), dbuf_free(&ws), dbuf_free(&out);
    }
    {
        dbuf x = dbuf_put(NULL, 64 * 4), wq = dbuf_put(NULL, 6 * 64), ws = dbuf_put(NULL, 16), out = dbuf_put(NULL, 6 * 4);
        TST_FAILS(gpu->gemm_fp8(gctx16, out.g, x.g, CM_DTYPE_F32, wq.g, ws.g, 1, 6, 64), CM_ERR_UNSUPPORTED, "N=6",
                  "multiple of 4");
        dbuf_free(&x), dbuf_free(&wq), dbuf_free(&ws), dbuf_free(&out);
    }
    tst_pair_close();
    return tst_report();
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "cpu") == 0) return run_cpu();
    if (argc == 2 && strcmp(argv[1], "cuda") == 0) return run_cuda();
    fprintf(stderr, "usage: test_kn_fp8 cpu|cuda\n");
    return 2;
}
