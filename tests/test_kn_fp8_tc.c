/* tests/test_kn_fp8_tc.c — the model of an FP8 tensor core's accumulation (kernels/ref/kn_fp8_tc_ref.c,
 * TANDEM_FP8_REF_TC), a diagnosis the CPU reference can run instead of its exact group sums:
 *   - the setting parsed, and every malformed one refused with one message that names it;
 *   - hand-made groups whose answers follow from the model's words: a product below the window cut,
 *     toward zero; the running sum taking part in the alignment and rounded to F32; promotion per
 *     chunk keeping what the chained sum loses;
 *   - 40 bits over one 128-wide chunk equal to the exact sum rounded once to F32 on random e4m3 groups,
 *     and 14 bits within its bound (each of the 129 terms cut by less than 2^-13 of the largest);
 *   - kn_ref_gemm_fp8q under the setting equal to the group sums of the model scaled and added as the
 *     exact reference adds them, and equal to the exact reference again once the setting is unset. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kn_ref.h"
#include "tst.h"
#include "tst_kn.h"

static kn_fp8_tc_model model_of(const char *v) {
    kn_fp8_tc_model m;
    if (v)
        setenv("TANDEM_FP8_REF_TC", v, 1);
    else
        unsetenv("TANDEM_FP8_REF_TC");
    TST_CHECK(kn_ref_fp8_tc_model(&m) == CM_OK);
    return m;
}

static void check_parse(void) {
    kn_fp8_tc_model m = model_of(NULL);
    TST_CHECK(m.bits == 0);
    m = model_of("");
    TST_CHECK(m.bits == 0);
    m = model_of("14");
    TST_CHECK(m.bits == 14 && m.chunk == 32 && m.promote == 0);
    m = model_of("13:16:1");
    TST_CHECK(m.bits == 13 && m.chunk == 16 && m.promote == 1);
    const char *bad[] = {"x", "3", "41", "14:0", "14:129", "14:32:2", "14:32:1x", "14:", "-14"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        setenv("TANDEM_FP8_REF_TC", bad[i], 1);
        TST_FAILS(kn_ref_fp8_tc_model(&m), CM_ERR_INVALID_ARG, "TANDEM_FP8_REF_TC", bad[i],
                  "BITS[:CHUNK[:PROMOTE]]");
    }
    unsetenv("TANDEM_FP8_REF_TC");
}

static double dot(const float *a, const float *w, int n, int bits, int chunk, int promote) {
    const kn_fp8_tc_model m = {bits, chunk, promote};
    return kn_ref_fp8_tc_dot(a, w, n, &m);
}

static void check_hand(void) {
    const float one[2] = {1, 1}, tiny = ldexpf(1, -20);
    const float a[2] = {1, tiny}, neg[2] = {-1, -tiny}, mix[2] = {1, -3 * ldexpf(1, -15)};
    TST_CHECK(dot(a, one, 2, 14, 32, 0) == 1.0);        /* 2^-20 lies below 14 bits of 1 */
    TST_CHECK(dot(a, one, 2, 22, 32, 0) == 1.0 + tiny); /* and within 22 */
    TST_CHECK(dot(neg, one, 2, 14, 32, 0) == -1.0);     /* cut toward zero, both signs */
    TST_CHECK(dot(mix, one, 2, 14, 32, 0) == 1.0);      /* -0.75 of a step cut to 0, not to -1 step */
    TST_CHECK(dot(a, one, 2, 14, 1, 0) == 1.0);         /* chained: the running 1 sets the window */
    TST_CHECK(dot(a, one, 2, 14, 1, 1) == 1.0 + tiny);  /* promoted: each chunk its own window */
    const float b[2] = {1, ldexpf(1, -30)};
    TST_CHECK(dot(b, one, 2, 40, 1, 0) == 1.0);                 /* the running sum is an F32 */
    TST_CHECK(dot(b, one, 2, 40, 1, 1) == 1.0 + ldexp(1, -30)); /* the promoted sum a double */
    const float z[3] = {0, 0, 0};
    TST_CHECK(dot(z, z, 3, 14, 32, 0) == 0.0);
}

/* n random e4m3 values (codes whose magnitude lies in [2^-6, 448]) into v. */
static void rand_e4m3(float *v, int n) {
    for (int i = 0; i < n; i++) {
        int code;
        do
            code = rand() & 0x7f;
        while (code < 8 || code > 126); /* normal, finite */
        v[i] = (rand() & 1 ? -1 : 1) * cm_f8e4m3_to_f32((uint8_t)code);
    }
}

static void check_random(void) {
    float  a[128], w[128];
    long   exact_bad = 0, over = 0, moved = 0;
    double worst = 0;
    for (int t = 0; t < 2000; t++) {
        rand_e4m3(a, 128), rand_e4m3(w, 128);
        double top = 0, ex = 0; /* e4m3 products span 2^36 at most: 128 of them add exactly in double */
        for (int i = 0; i < 128; i++) {
            ex += (double)a[i] * w[i];
            top = fmax(top, fmax(fabs((double)a[i] * w[i]), fabs(ex)));
        }
        exact_bad += dot(a, w, 128, 40, 128, 0) != (double)(float)ex;
        /* 4 chunks, each of 33 terms cut by < 2^-13 of a largest at most `top`, and an F32 rounding */
        const double d = fabs(dot(a, w, 128, 14, 32, 0) - ex),
                     bound = 4 * (33 * ldexp(top, -13) + ldexp(top, -23));
        over += d > bound;
        moved += d > 0;
        worst = fmax(worst, d / bound);
    }
    printf("2000 random e4m3 groups: 40 bits, one chunk: %ld differ from the exact sum rounded to F32; "
           "14 bits: %ld moved, %ld past the bound (worst %.3f of it)\n",
           exact_bad, moved, over, worst);
    TST_CHECK(exact_bad == 0 && over == 0 && moved > 1000);
}

/* gemm_fp8q with the model: each group's model sum, scaled by the two scales and added in double. */
static void check_gemm(long M, long N, long K) {
    kn_ctx *ctx = NULL;
    TST_CHECK(kn_ref_ctx_create(&ctx, NULL) == CM_OK);
    const long B = 128, L = (K + B - 1) / B, ld = kn_fp8_scale_ld(K), Mp = kn_fp8_rows(M);
    float     *x = tst_xcalloc((size_t)(M * K) * 4), *w = tst_xcalloc((size_t)(N * K) * 4);
    for (long i = 0; i < M * K; i++)
        x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (long i = 0; i < N * K; i++)
        w[i] = (float)rand() / RAND_MAX - 0.5f;
    uint8_t *wq = tst_xcalloc((size_t)(N * K)), *qa = tst_xcalloc((size_t)(Mp * K));
    float   *ws = tst_xcalloc((size_t)(((N + B - 1) / B) * ld) * 4), *sa = tst_xcalloc((size_t)(Mp * L) * 4);
    float   *out = tst_zeros_f32(M * N), *plain = tst_zeros_f32(M * N), *fa = tst_xcalloc((size_t)K * 4),
          *fw = tst_xcalloc((size_t)K * 4);
    TST_CHECK(kn_ref_fp8_quantize_weight(ctx, wq, ws, w, CM_DTYPE_F32, N, K) == CM_OK);
    TST_CHECK(kn_ref_fp8_quantize_rows(ctx, qa, sa, x, CM_DTYPE_F32, M, K) == CM_OK);
    TST_CHECK(kn_ref_gemm_fp8q(ctx, plain, CM_DTYPE_F32, qa, sa, wq, ws, M, N, K) == CM_OK);
    const kn_fp8_tc_model m = model_of("13:16");
    TST_CHECK(kn_ref_gemm_fp8q(ctx, out, CM_DTYPE_F32, qa, sa, wq, ws, M, N, K) == CM_OK);
    long bad = 0, moved = 0;
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) {
            double acc = 0;
            for (long j = 0; j < L; j++) {
                const long k0 = j * B, k1 = k0 + B < K ? k0 + B : K;
                for (long k = k0; k < k1; k++) {
                    fa[k - k0] = cm_f8e4m3_to_f32(qa[r * K + k]);
                    fw[k - k0] = cm_f8e4m3_to_f32(wq[n * K + k]);
                }
                acc += (double)sa[j * Mp + r] * (double)ws[(n / B) * ld + j] *
                       kn_ref_fp8_tc_dot(fa, fw, k1 - k0, &m);
            }
            bad += out[r * N + n] != (float)acc;
            moved += out[r * N + n] != plain[r * N + n];
        }
    float *again = tst_zeros_f32(M * N);
    model_of(NULL);
    TST_CHECK(kn_ref_gemm_fp8q(ctx, again, CM_DTYPE_F32, qa, sa, wq, ws, M, N, K) == CM_OK);
    const int same = memcmp(again, plain, (size_t)(M * N) * 4) == 0;
    setenv("TANDEM_FP8_REF_TC", "14:32:3", 1);
    TST_FAILS(kn_ref_gemm_fp8q(ctx, again, CM_DTYPE_F32, qa, sa, wq, ws, M, N, K), CM_ERR_INVALID_ARG,
              "TANDEM_FP8_REF_TC", "14:32:3");
    unsetenv("TANDEM_FP8_REF_TC");
    printf("gemm_fp8q %ldx%ldx%ld with the model 13:16: %ld of %ld differ from its group sums, %ld moved "
           "from the "
           "exact product; unset again: %s\n",
           M, N, K, bad, M * N, moved, same ? "the exact product" : "NOT the exact product");
    TST_CHECK(bad == 0 && moved > 0 && same);
    free(x), free(w), free(wq), free(qa), free(ws), free(sa), free(out), free(plain), free(fa), free(fw),
        free(again);
    kn_ref_ctx_destroy(&ctx);
}

int main(void) {
    srand(7);
    check_parse();
    check_hand();
    check_random();
    check_gemm(5, 48, 64);
    check_gemm(19, 136, 336);
    return tst_report();
}
