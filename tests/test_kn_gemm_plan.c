/* tests/test_kn_gemm_plan.c — the cuda backend's GEMM plans (kernels/kn_cuda.h, kn_gemm_bwd.cu):
 * a context makes one plan (descriptors + algorithm) per key on the key's first call and
 * reuses it after. Checked against a context on the per-call path (TANDEM_GEMM_PLAN=0, read at
 * its first GEMM) and a host reference in double:
 * - the same GEMM twice gives the same bits, equal to the per-call path's (BF16 and F32
 *   modes, gemm and gemm_bf16in), and is the host product within the fp32 rounding bound;
 * - the second call makes no plan; a key differing only in an operand's alignment or in a
 *   leading dimension gets its own plan (and the right result);
 * - more distinct shapes than the table holds all compute correctly and equal the per-call
 *   path bit for bit (the overflow runs per call), the table stops at KN_LT_PLANS;
 * - an accumulating kn_cuda_lt_matmul (beta = 1) is C0 + A·B on its first (planning) call
 *   and C0 + 2·A·B after the second, with plans by the heuristic and with timed plans
 *   (TANDEM_GEMM_AUTOTUNE=8: the timing runs must not touch the caller's C).
 * Label gpu: exits 77 when the build has no cuda backend or the machine has no cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "tst.h"

#define TST_KN_SEED 0x243F6A8885A308D3ull
#include "tst_cuda.h"
#include "tst_kn.h"

static const kn_backend *gpu;

#define OK(x)                                                                                                \
    do {                                                                                                     \
        cm_status s_ = (x);                                                                                  \
        if (s_ != CM_OK) {                                                                                   \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #x, cm_status_str(s_),        \
                    cm_last_error());                                                                        \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static float frand(void) { /* [-1, 1) */
    return (float)(tst_urand() * 2.0 - 1.0);
}

/* x rounded to bf16, nearest even, as the kernels round (finite inputs) */
static float bf16_round(float x) {
    return tst_bf16_widen(tst_bf16_round(x));
}
static uint16_t bf16_bits(float x) {
    return tst_bf16_round(x);
}

/* Host out[M, N] = inp[M, K] · W[N, K]ᵀ in double, inputs rounded to bf16 when bf; and the
 * bound Σ|a·b| per element for the tolerance. */
static void host_gemm(double *out, double *bound, const float *inp, const float *w, int M, int N, int K, int bf) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0, b = 0;
            for (int k = 0; k < K; k++) {
                double a = bf ? bf16_round(inp[(size_t)i * K + k]) : inp[(size_t)i * K + k];
                double c = bf ? bf16_round(w[(size_t)j * K + k]) : w[(size_t)j * K + k];
                s += a * c;
                b += fabs(a * c);
            }
            out[(size_t)i * N + j] = s;
            bound[(size_t)i * N + j] = b;
        }
}

/* |got - ref| <= 1e-5 · bound elementwise (fp32 sums of exact products: ~eps·sqrt(K)·bound). */
static int near_host(const char *name, const float *got, const double *ref, const double *bound, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - ref[i]) <= 1e-5 * bound[i] + 1e-30)) {
            if (bad < 5)
                fprintf(stderr, "  %s[%zu]: got %.8g ref %.8g\n", name, i, got[i], ref[i]);
            bad++;
        }
    tst_checks++;
    if (bad) {
        tst_failures++;
        fprintf(stderr, "%s: %zu of %zu differ from the host product\n", name, bad, n);
    }
    return bad == 0;
}

static int same_bits(const char *name, const float *x, const float *y, size_t n) {
    int eq = memcmp(x, y, n * sizeof(float)) == 0;
    tst_checks++;
    if (!eq) {
        tst_failures++;
        fprintf(stderr, "%s: results differ in their bits\n", name);
    }
    return eq;
}

static kn_ctx *make_ctx(kn_gemm_mode mode, const char *plan_env, const char *tune_env) {
    /* the context reads both variables at its first GEMM: set them, make it, run one */
    if (plan_env)
        setenv("TANDEM_GEMM_PLAN", plan_env, 1);
    else
        unsetenv("TANDEM_GEMM_PLAN");
    if (tune_env)
        setenv("TANDEM_GEMM_AUTOTUNE", tune_env, 1);
    else
        unsetenv("TANDEM_GEMM_AUTOTUNE");
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    cfg.gemm_mode = mode;
    kn_ctx *ctx = NULL;
    OK(gpu->ctx_create(&ctx, &cfg));
    float *d = NULL;
    OK(gpu->alloc(ctx, (void **)&d, 64 * sizeof(float)));
    OK(gpu->gemm(ctx, d + 32, d, d + 16, CM_DTYPE_F32, 2, 2, 4)); /* reads the environment */
    OK(gpu->sync(ctx));
    gpu->free(ctx, d);
    unsetenv("TANDEM_GEMM_PLAN");
    unsetenv("TANDEM_GEMM_AUTOTUNE");
    return ctx;
}

/* One row-major gemm case on a planned and a per-call context of the same mode: out at
 * element offset out_off of a buffer (to vary its alignment), weights F32 or BF16. */
typedef struct gcase {
    int      M, N, K;
    cm_dtype wdt;
    int      bf16in; /* gemm_bf16in: the input uploaded as bf16 */
    int      out_off;
} gcase;

static void run_gemm(kn_ctx *ctx, const gcase *c, const float *inp, const float *w, float *out_host) {
    size_t    n_in = (size_t)c->M * c->K, n_w = (size_t)c->N * c->K, n_out = (size_t)c->M * c->N;
    void     *d_in, *d_w;
    float    *d_out;
    uint16_t *in16 = malloc(n_in * 2), *w16 = malloc(n_w * 2);
    for (size_t i = 0; i < n_in; i++)
        in16[i] = bf16_bits(inp[i]);
    for (size_t i = 0; i < n_w; i++)
        w16[i] = bf16_bits(w[i]);
    OK(gpu->alloc(ctx, &d_in, n_in * 4));
    OK(gpu->alloc(ctx, &d_w, n_w * 4));
    OK(gpu->alloc(ctx, (void **)&d_out, (n_out + (size_t)c->out_off) * 4));
    OK(gpu->upload(ctx, d_in, c->bf16in ? (const void *)in16 : (const void *)inp, n_in * (c->bf16in ? 2 : 4)));
    OK(gpu->upload(ctx, d_w, c->wdt == CM_DTYPE_BF16 ? (const void *)w16 : (const void *)w,
                   n_w * (c->wdt == CM_DTYPE_BF16 ? 2 : 4)));
    if (c->bf16in)
        OK(gpu->gemm_bf16in(ctx, d_out + c->out_off, d_in, d_w, c->wdt, c->M, c->N, c->K));
    else
        OK(gpu->gemm(ctx, d_out + c->out_off, d_in, d_w, c->wdt, c->M, c->N, c->K));
    OK(gpu->download(ctx, out_host, d_out + c->out_off, n_out * 4));
    gpu->free(ctx, d_in);
    gpu->free(ctx, d_w);
    gpu->free(ctx, d_out);
    free(in16);
    free(w16);
}

/* The case on ctx twice (same bits; the second call makes no plan) and on the per-call
 * context (same bits again), and against the host. Returns the plans the first call made. */
static int check_case(const char *name, kn_ctx *ctx, kn_ctx *percall, const gcase *c) {
    size_t  n_in = (size_t)c->M * c->K, n_w = (size_t)c->N * c->K, n_out = (size_t)c->M * c->N;
    float  *inp = malloc(n_in * 4), *w = malloc(n_w * 4);
    float  *o1 = malloc(n_out * 4), *o2 = malloc(n_out * 4), *o3 = malloc(n_out * 4);
    double *ref = malloc(n_out * 8), *bound = malloc(n_out * 8);
    for (size_t i = 0; i < n_in; i++)
        inp[i] = c->bf16in ? bf16_round(frand()) : frand();
    for (size_t i = 0; i < n_w; i++)
        w[i] = c->wdt == CM_DTYPE_BF16 ? bf16_round(frand()) : frand();
    int before = ctx->lt_plans_used;
    run_gemm(ctx, c, inp, w, o1);
    int made = ctx->lt_plans_used - before;
    run_gemm(ctx, c, inp, w, o2);
    TST_CHECK(ctx->lt_plans_used == before + made); /* the second call reuses the plan */
    run_gemm(percall, c, inp, w, o3);
    TST_CHECK(percall->lt_plans_used == 0);
    char label[160];
    snprintf(label, sizeof label, "%s: planned twice", name);
    same_bits(label, o1, o2, n_out);
    snprintf(label, sizeof label, "%s: planned vs per call", name);
    same_bits(label, o1, o3, n_out);
    host_gemm(ref, bound, inp, w, c->M, c->N, c->K, ctx->gemm_mode == KN_GEMM_MODE_BF16);
    snprintf(label, sizeof label, "%s: vs host", name);
    near_host(label, o1, ref, bound, n_out);
    free(inp);
    free(w);
    free(o1);
    free(o2);
    free(o3);
    free(ref);
    free(bound);
    return made;
}

/* Column-major C (m×n, ldc) = C0 + reps · A·B through kn_cuda_lt_matmul with beta = 1, A m×k
 * (lda = m), B k×n (ldb = k), F32 operands; checked after the first and the second call. */
static void check_accumulate(const char *name, kn_ctx *ctx, int m, int n, int k, int ldc) {
    size_t  nA = (size_t)m * k, nB = (size_t)k * n, nC = (size_t)ldc * n;
    float  *A = malloc(nA * 4), *B = malloc(nB * 4), *C0 = malloc(nC * 4), *C = malloc(nC * 4);
    double *ref = malloc(nC * 8), *bound = malloc(nC * 8);
    for (size_t i = 0; i < nA; i++)
        A[i] = frand();
    for (size_t i = 0; i < nB; i++)
        B[i] = frand();
    for (size_t i = 0; i < nC; i++)
        C0[i] = frand();
    float *dA, *dB, *dC;
    OK(gpu->alloc(ctx, (void **)&dA, nA * 4));
    OK(gpu->alloc(ctx, (void **)&dB, nB * 4));
    OK(gpu->alloc(ctx, (void **)&dC, nC * 4));
    OK(gpu->upload(ctx, dA, A, nA * 4));
    OK(gpu->upload(ctx, dB, B, nB * 4));
    OK(gpu->upload(ctx, dC, C0, nC * 4));
    for (int rep = 1; rep <= 2; rep++) {
        int before = ctx->lt_plans_used;
        OK(kn_cuda_lt_matmul(ctx, name, CUDA_R_32F, 0, 0, m, n, k, dA, m, dB, k, 1.0f, dC, ldc));
        TST_CHECK(ctx->lt_plans_used == before + (rep == 1));
        OK(gpu->download(ctx, C, dC, nC * 4));
        for (int j = 0; j < n; j++)
            for (int i = 0; i < ldc; i++) {
                size_t idx = (size_t)j * ldc + i;
                if (i >= m) { /* rows past m: never written */
                    ref[idx] = C0[idx];
                    bound[idx] = 0;
                    continue;
                }
                double s = 0, b = 0;
                for (int t = 0; t < k; t++) {
                    double p = (double)A[(size_t)t * m + i] * B[(size_t)j * k + t];
                    s += p;
                    b += fabs(p);
                }
                ref[idx] = C0[idx] + rep * s;
                bound[idx] = rep * b + fabs(C0[idx]);
            }
        char label[160];
        snprintf(label, sizeof label, "%s: beta 1, call %d", name, rep);
        near_host(label, C, ref, bound, nC);
    }
    gpu->free(ctx, dA);
    gpu->free(ctx, dB);
    gpu->free(ctx, dC);
    free(A);
    free(B);
    free(C0);
    free(C);
    free(ref);
    free(bound);
}

int main(void) {
    gpu = kn_backend_cuda();
    if (!gpu)
        TST_SKIP("this build has no cuda backend");
    {
        kn_ctx   *probe = NULL;
        cm_status st = gpu->ctx_create(&probe, NULL);
        if (st == CM_ERR_UNSUPPORTED)
            TST_SKIP("%s", cm_last_error());
        OK(st);
        gpu->ctx_destroy(&probe);
    }

    for (int mode = 0; mode < 2; mode++) {
        kn_gemm_mode gm = mode ? KN_GEMM_MODE_F32 : KN_GEMM_MODE_BF16;
        const char  *mn = mode ? "f32" : "bf16";
        kn_ctx      *planned = make_ctx(gm, NULL, NULL), *percall = make_ctx(gm, "0", NULL);
        TST_CHECK(planned->lt_plan_mode == 1 && percall->lt_plan_mode == 2);
        char name[96];
        /* shapes of real use (odd sizes included), both weight types, both input kinds */
        const gcase cases[] = {
            {37, 53, 64, CM_DTYPE_F32, 0, 0},    {37, 53, 64, CM_DTYPE_BF16, 0, 0},
            {37, 53, 64, CM_DTYPE_BF16, 1, 0},   {128, 96, 200, CM_DTYPE_BF16, 0, 0},
            {256, 384, 512, CM_DTYPE_BF16, 1, 0}, {5, 7, 3, CM_DTYPE_F32, 0, 0},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            snprintf(name, sizeof name, "%s gemm %dx%dx%d w%s%s", mn, cases[i].M, cases[i].N, cases[i].K,
                     cm_dtype_name(cases[i].wdt), cases[i].bf16in ? " bf16in" : "");
            check_case(name, planned, percall, &cases[i]);
        }
        /* the same shape with the output 4 bytes past a 256-byte boundary: its own plan */
        gcase al = {37, 53, 64, CM_DTYPE_F32, 0, 1};
        snprintf(name, sizeof name, "%s gemm 37x53x64 out+4B", mn);
        TST_CHECK(check_case(name, planned, percall, &al) == 1);
        gpu->ctx_destroy(&planned);
        gpu->ctx_destroy(&percall);
    }

    /* leading dimension: the same m, n, k with ldc 40 then 48: two plans */
    {
        kn_ctx *ctx = make_ctx(KN_GEMM_MODE_F32, NULL, NULL);
        int     before = ctx->lt_plans_used;
        check_accumulate("ldc 40", ctx, 33, 17, 29, 40);
        check_accumulate("ldc 48", ctx, 33, 17, 29, 48);
        TST_CHECK(ctx->lt_plans_used == before + 2);
        /* accumulating calls at a size where the heuristic has several answers */
        check_accumulate("acc 256x192x320", ctx, 256, 192, 320, 256);
        gpu->ctx_destroy(&ctx);
    }

    /* timed plans: the timing writes a scratch C, so the caller's accumulating C is right */
    {
        kn_ctx *ctx = make_ctx(KN_GEMM_MODE_F32, NULL, "8");
        TST_CHECK(ctx->lt_autotune == 8);
        check_accumulate("tuned acc 256x192x320", ctx, 256, 192, 320, 256);
        check_accumulate("tuned acc 1000x300x500", ctx, 1000, 300, 500, 1000);
        check_accumulate("tuned acc 33x17x29", ctx, 33, 17, 29, 40);
        kn_ctx *ctx16 = make_ctx(KN_GEMM_MODE_BF16, NULL, "8"), *per16 = make_ctx(KN_GEMM_MODE_BF16, "0", NULL);
        gcase   big = {512, 640, 768, CM_DTYPE_BF16, 1, 0};
        /* a timed plan may pick another kernel than the per-call path: compare to the host only */
        size_t  n_in = (size_t)big.M * big.K, n_w = (size_t)big.N * big.K, n_out = (size_t)big.M * big.N;
        float  *inp = malloc(n_in * 4), *w = malloc(n_w * 4), *o1 = malloc(n_out * 4), *o2 = malloc(n_out * 4);
        double *ref = malloc(n_out * 8), *bound = malloc(n_out * 8);
        for (size_t i = 0; i < n_in; i++)
            inp[i] = bf16_round(frand());
        for (size_t i = 0; i < n_w; i++)
            w[i] = bf16_round(frand());
        run_gemm(ctx16, &big, inp, w, o1);
        run_gemm(ctx16, &big, inp, w, o2);
        same_bits("tuned bf16 gemm twice", o1, o2, n_out);
        host_gemm(ref, bound, inp, w, big.M, big.N, big.K, 1);
        near_host("tuned bf16 gemm vs host", o1, ref, bound, n_out);
        free(inp);
        free(w);
        free(o1);
        free(o2);
        free(ref);
        free(bound);
        gpu->ctx_destroy(&per16);
        gpu->ctx_destroy(&ctx16);
        gpu->ctx_destroy(&ctx);
    }

    /* more distinct shapes than the table holds: all right, the overflow runs per call */
    {
        kn_ctx *ctx = make_ctx(KN_GEMM_MODE_F32, NULL, NULL), *percall = make_ctx(KN_GEMM_MODE_F32, "0", NULL);
        int     n_shapes = KN_LT_PLANS + 44, bad_before = tst_failures;
        for (int s = 1; s <= n_shapes && tst_failures == bad_before; s++) {
            gcase c = {s, 9, 16, CM_DTYPE_F32, 0, 0};
            char  name[64];
            snprintf(name, sizeof name, "overflow shape %d", s);
            check_case(name, ctx, percall, &c);
        }
        TST_CHECK(ctx->lt_plans_used == KN_LT_PLANS);
        TST_CHECK(ctx->lt_plan_overflow > 0);
        printf("table: %d plans, %llu calls past a full table\n", ctx->lt_plans_used,
               (unsigned long long)ctx->lt_plan_overflow);
        gpu->ctx_destroy(&ctx);
        gpu->ctx_destroy(&percall);
    }
    return tst_report();
}
