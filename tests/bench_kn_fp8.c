/* tests/bench_kn_fp8.c — the 27B target's GEMM shapes in bf16 and in block-scaled FP8 on one GPU
 * (not a test; bench/target_bench.sh runs it beside the forward): per shape, M tokens (8192)
 * times each weight, the time and TF/s of
 *   bf16     gemm_bf16in (bf16 input written by its producer, bf16 weight, fp32 accumulate),
 *   fp8      gemm_fp8 from the same bf16 input (the 1 × 128 input quantization included),
 *   fp8 mm   the block-scaled cuBLASLt product alone (input already quantized),
 *   fp8 wg   Tandem's wgmma kernel (kn_fp8_gemm_sm90a.cu, TANDEM_FP8_GEMM=wgmma) from the same
 *            quantized input, on compute capability 9.0 (elsewhere the column repeats fp8 mm),
 * and the 8192³ ceilings of both; then the GEMM-only time of one forward of the 27B shape in
 * each precision (48 GDN layers, 16 attention layers, 64 MLPs).
 *   bench_kn_fp8 [--tokens 8192] [--iters 20] [--gpu 0] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kn_backend.h"
#include "kn_cuda_lt.h"
#include "kn_fp8_int.h"

#define CHECK(x)                                                                                             \
    do {                                                                                                     \
        cm_status s_ = (x);                                                                                  \
        if (s_ != CM_OK) {                                                                                   \
            fprintf(stderr, "bench_kn_fp8: %s failed: %s: %s\n", #x, cm_status_str(s_), cm_last_error());    \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

typedef struct shape {
    const char *name;
    long        N, K;
    int         per_fwd; /* times per forward */
} shape;

static const shape shapes[] = {
    {"gdn in_proj_qkv", 10240, 5120, 48}, {"gdn in_proj_z", 6144, 5120, 48}, {"gdn out_proj", 5120, 6144, 48},
    {"attn q_proj (gated)", 12288, 5120, 16}, {"attn k_proj / v_proj", 1024, 5120, 32}, {"attn o_proj", 5120, 6144, 16},
    {"mlp gate / up", 17408, 5120, 128}, {"mlp down", 5120, 17408, 64},
};

static const kn_backend *be;
static kn_ctx           *cx;

typedef enum { RUN_BF16, RUN_FP8, RUN_FP8_MM, RUN_FP8_WG, N_RUNS, RUN_WG_CFG = N_RUNS } run_kind;

static int wg_cfg; /* RUN_WG_CFG: the wgmma kernel's form (kn_fp8_int.h) */

typedef struct bufs {
    uint16_t *x16;
    uint16_t *w16;
    uint8_t  *wq, *xq;
    float    *ws, *xs, *out;
} bufs;

static cm_status run_once(run_kind k, const bufs *b, long M, long N, long K) {
    if (k == RUN_BF16) return be->gemm_bf16in(cx, b->out, b->x16, b->w16, CM_DTYPE_BF16, M, N, K);
    if (k == RUN_FP8) return be->gemm_fp8(cx, b->out, b->x16, CM_DTYPE_BF16, b->wq, b->ws, M, N, K);
    if ((k == RUN_FP8_WG || k == RUN_WG_CFG) && kn_fp8_wg_available(cx))
        return kn_fp8_gemm_wg(cx, b->out, KN_FP8_OUT_F32, b->xq, b->xs, b->wq, b->ws, M, N, K,
                              k == RUN_WG_CFG ? wg_cfg : 0);
    return kn_cuda_lt_matmul_fp8(cx, "bench", N, M, K, b->wq, b->ws, b->xq, b->xs, 0.0f, b->out, CUDA_R_32F, N);
}

static double time_ms(run_kind k, const bufs *b, long M, long N, long K, int iters) {
    CHECK(run_once(k, b, M, N, K)); /* the plan */
    CHECK(be->sync(cx));
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < iters; i++) CHECK(run_once(k, b, M, N, K));
        CHECK(be->sync(cx));
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = ((double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6) / iters;
        best = ms < best ? ms : best;
    }
    return best;
}

int main(int argc, char **argv) {
    long M = 8192;
    int  iters = 20, gpu = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tokens")) M = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--gpu")) gpu = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_kn_fp8 [--tokens 8192] [--iters 20] [--gpu 0]\n");
            return 2;
        }
    }
    be = kn_backend_cuda();
    if (!be) {
        fprintf(stderr, "bench_kn_fp8: this build has no cuda backend\n");
        return 1;
    }
    kn_ctx_config kc = {gpu, KN_GEMM_MODE_BF16};
    CHECK(be->ctx_create(&cx, &kc));
    char why[400];
    if (!be->fp8_supported(cx, why, sizeof why)) {
        fprintf(stderr, "bench_kn_fp8: %s\n", why);
        return 1;
    }
    const long maxN = 17408, maxK = 17408, ceilN = 8192;
    const long big = (M > ceilN ? M : ceilN);
    bufs       b;
    CHECK(be->alloc(cx, (void **)&b.x16, (size_t)(big * maxK) * 2));
    CHECK(be->alloc(cx, (void **)&b.w16, (size_t)(maxN * maxK) * 2));
    CHECK(be->alloc(cx, (void **)&b.wq, (size_t)(maxN * maxK)));
    CHECK(be->alloc(cx, (void **)&b.xq, (size_t)(big * maxK)));
    CHECK(be->alloc(cx, (void **)&b.ws, (size_t)((maxN / 128 + 1) * kn_fp8_scale_ld(maxK)) * 4));
    CHECK(be->alloc(cx, (void **)&b.xs, (size_t)(big * (maxK / 128 + 1)) * 4));
    CHECK(be->alloc(cx, (void **)&b.out, (size_t)(big * maxN) * 4));
    CHECK(be->fill_uniform(cx, b.x16, CM_DTYPE_BF16, big * maxK, 1, -2.0f, 2.0f));
    CHECK(be->fill_uniform(cx, b.w16, CM_DTYPE_BF16, maxN * maxK, 2, -0.03f, 0.03f));
    CHECK(be->fill_uniform(cx, b.xq, CM_DTYPE_BF16, big * maxK / 2, 3, -0.5f, 0.5f)); /* any bits: finite e4m3 */
    CHECK(be->fill_uniform(cx, b.xs, CM_DTYPE_F32, big * (maxK / 128 + 1), 4, 0.001f, 0.002f));

    printf("fp8 wg is %s\n\n", kn_fp8_wg_available(cx) ? "the wgmma kernel" : "cuBLASLt (no wgmma kernel here)");
    printf("| GEMM (M = %ld) | N x K | bf16 ms | TF/s | fp8 ms | TF/s | fp8 mm ms | TF/s | fp8 wg ms | TF/s | "
           "bf16/fp8 | mm/wg |\n", M);
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    double fwd[N_RUNS] = {0, 0, 0, 0};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const shape *sh = &shapes[s];
        CHECK(be->fp8_quantize_weight(cx, b.wq, b.ws, b.w16, CM_DTYPE_BF16, sh->N, sh->K));
        double fl = 2.0 * (double)M * sh->N * sh->K, t[N_RUNS];
        for (int k = 0; k < N_RUNS; k++) {
            t[k] = time_ms((run_kind)k, &b, M, sh->N, sh->K, iters);
            fwd[k] += t[k] * sh->per_fwd;
        }
        printf("| %s | %ld x %ld | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.2f | %.2f |\n", sh->name,
               sh->N, sh->K, t[0], fl / t[0] / 1e9, t[1], fl / t[1] / 1e9, t[2], fl / t[2] / 1e9, t[3],
               fl / t[3] / 1e9, t[0] / t[1], t[2] / t[3]);
    }
    CHECK(be->fp8_quantize_weight(cx, b.wq, b.ws, b.w16, CM_DTYPE_BF16, ceilN, ceilN));
    double c[N_RUNS], cf = 2.0 * ceilN * ceilN * ceilN;
    for (int k = 0; k < N_RUNS; k++) c[k] = time_ms((run_kind)k, &b, ceilN, ceilN, ceilN, iters);
    printf("| ceiling 8192^3 | | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.2f | %.2f |\n", c[0],
           cf / c[0] / 1e9, c[1], cf / c[1] / 1e9, c[2], cf / c[2] / 1e9, c[3], cf / c[3] / 1e9, c[0] / c[1],
           c[2] / c[3]);
    printf("\nGEMMs of one 27B forward (M = %ld, LM head excluded): bf16 %.1f ms, fp8 %.1f ms (input quantization "
           "included), fp8 product alone: cuBLASLt %.1f ms, fp8 wg %.1f ms; bf16/fp8 %.2f\n",
           M, fwd[0], fwd[1], fwd[2], fwd[3], fwd[0] / fwd[1]);
    if (kn_fp8_wg_available(cx)) { /* the wgmma kernel's forms (kn_fp8_gemm_sm90a.cu's fg_cfg) */
        printf("\n| wgmma kernel, form (0: 128 x 256 tiles, 1: 128 x 128) (M = %ld) | N x K |", M);
        for (int g = 0; g < KN_FP8_WG_CONFIGS; g++) printf(" cfg %d ms | TF/s |", g);
        printf("\n|---|---|");
        for (int g = 0; g < KN_FP8_WG_CONFIGS; g++) printf("---|---|");
        printf("\n");
        for (size_t s = 0; s <= sizeof shapes / sizeof shapes[0]; s++) {
            const int  ceil_row = s == sizeof shapes / sizeof shapes[0];
            const long n = ceil_row ? ceilN : shapes[s].N, k = ceil_row ? ceilN : shapes[s].K, m = ceil_row ? ceilN : M;
            CHECK(be->fp8_quantize_weight(cx, b.wq, b.ws, b.w16, CM_DTYPE_BF16, n, k));
            printf("| %s | %ld x %ld |", ceil_row ? "ceiling 8192^3" : shapes[s].name, n, k);
            for (wg_cfg = 0; wg_cfg < KN_FP8_WG_CONFIGS; wg_cfg++) {
                const double t = time_ms(RUN_WG_CFG, &b, m, n, k, iters);
                printf(" %.3f | %.0f |", t, 2.0 * m * n * k / t / 1e9);
            }
            printf("\n");
        }
    }
    be->ctx_destroy(&cx);
    return 0;
}
