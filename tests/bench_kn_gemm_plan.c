/* tests/bench_kn_gemm_plan.c — what the GEMM plans (kernels/kn_cuda.h) buy at the Qwen3.6-27B
 * target's shapes on one GPU (not a test). For each projection of the target (N×K, M tokens,
 * bf16 mode, BF16 weights, bf16 input: the fused forward's gemm_bf16in) on three contexts:
 *   per call  (TANDEM_GEMM_PLAN=0: descriptors and heuristic query every call, as before),
 *   planned   (the heuristic's first answer, planned once: the default),
 *   timed     (TANDEM_GEMM_AUTOTUNE=k: the fastest of the heuristic's first k answers),
 * it prints the host time to enqueue one call (the loop's wall clock over --reps calls while
 * the GPU works through them) and the GPU time per call (events over the same calls), then
 * the totals of one forward (each shape times its count in the 64-layer model: 48 GDN, 16
 * attention, 64 MLP blocks) and whether the planned results equal the per-call bits.
 *   bench_kn_gemm_plan [--tokens 8192] [--reps 20] [--tune 8] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kn_backend.h"
#include "kn_cuda.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define CHECK(x)                                                                                             \
    do {                                                                                                     \
        cm_status s_ = (x);                                                                                  \
        if (s_ != CM_OK) {                                                                                   \
            fprintf(stderr, "bench_kn_gemm_plan: %s failed: %s: %s\n", #x, cm_status_str(s_),               \
                    cm_last_error());                                                                        \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

typedef struct shape {
    const char *name;
    int64_t     N, K;
    int         per_forward; /* calls in one 64-layer forward */
} shape;

/* Qwen3.6-27B (deploy/configs/qwen3.6-27b/target-config.json): D 5120, I 17408, GDN 16 k heads
 * and 48 v heads of 128, attention 24 q heads (gated: 2×) and 4 kv heads of 256. */
static const shape shapes[] = {
    {"gdn in_qkv", 10240, 5120, 48}, {"gdn in_z", 6144, 5120, 48},    {"gdn in_b/in_a", 48, 5120, 96},
    {"gdn out_proj", 5120, 6144, 48}, {"attn q(+gate)", 12288, 5120, 16}, {"attn k/v", 1024, 5120, 32},
    {"attn o_proj", 5120, 6144, 16},  {"mlp gate/up", 17408, 5120, 128},  {"mlp down", 5120, 17408, 64},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static kn_ctx *make_ctx(const kn_backend *be, const char *plan, const char *tune) {
    if (plan)
        setenv("TANDEM_GEMM_PLAN", plan, 1);
    else
        unsetenv("TANDEM_GEMM_PLAN");
    if (tune)
        setenv("TANDEM_GEMM_AUTOTUNE", tune, 1);
    else
        unsetenv("TANDEM_GEMM_AUTOTUNE");
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    kn_ctx       *ctx = NULL;
    CHECK(be->ctx_create(&ctx, &cfg));
    float *d = NULL;
    CHECK(be->alloc(ctx, (void **)&d, 64 * sizeof(float)));
    CHECK(be->gemm(ctx, d + 32, d, d + 16, CM_DTYPE_F32, 2, 2, 4)); /* the context reads the environment */
    CHECK(be->sync(ctx));
    be->free(ctx, d);
    return ctx;
}

int main(int argc, char **argv) {
    int64_t M = 8192;
    int     reps = 20;
    const char *tune = "8";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            M = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tune") && i + 1 < argc)
            tune = argv[++i];
        else {
            fprintf(stderr, "usage: bench_kn_gemm_plan [--tokens 8192] [--reps 20] [--tune 8]\n");
            return 2;
        }
    }
    const kn_backend *be = kn_backend_cuda();
    if (!be) {
        fprintf(stderr, "bench_kn_gemm_plan: this build has no cuda backend\n");
        return 77;
    }
    kn_ctx     *ctx[3] = {make_ctx(be, "0", NULL), make_ctx(be, NULL, NULL), make_ctx(be, NULL, tune)};

    int64_t maxN = 0, maxK = 0;
    for (int s = 0; s < N_SHAPES; s++) {
        maxN = shapes[s].N > maxN ? shapes[s].N : maxN;
        maxK = shapes[s].K > maxK ? shapes[s].K : maxK;
    }
    /* one set of buffers per context (each context has its own stream) */
    void  *in[3], *w[3];
    float *out[3];
    size_t n_in = (size_t)M * maxK, n_w = (size_t)maxN * maxK, n_out = (size_t)M * maxN;
    float *host0 = malloc(n_out * 4), *host1 = malloc(n_out * 4);
    uint16_t *fill = malloc((n_in > n_w ? n_in : n_w) * 2);
    uint64_t  r = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < (n_in > n_w ? n_in : n_w); i++) { /* bf16 values in about ±0.06 */
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        fill[i] = (uint16_t)(0x3C00u + (r >> 60)) | (uint16_t)((r >> 59 & 1u) << 15);
        fill[i] |= (uint16_t)(r >> 40 & 0x7Fu);
    }
    for (int c = 0; c < 3; c++) {
        CHECK(be->alloc(ctx[c], &in[c], n_in * 2));
        CHECK(be->alloc(ctx[c], &w[c], n_w * 2));
        CHECK(be->alloc(ctx[c], (void **)&out[c], n_out * 4));
        CHECK(be->upload(ctx[c], in[c], fill, n_in * 2));
        CHECK(be->upload(ctx[c], w[c], fill, n_w * 2));
    }

    double tot_gpu[3] = {0}, tot_host[3] = {0};
    int    all_same = 1;
    printf("M = %lld tokens, %d calls per measurement, timed plans of the first %s answers\n", (long long)M, reps,
           tune);
    printf("| shape (N x K) | per forward | host us/call: per call / planned / timed | GPU ms/call: per call / "
           "planned / timed | timed pick | planned == per call |\n|---|---|---|---|---|---|\n");
    for (int s = 0; s < N_SHAPES; s++) {
        const shape *sh = &shapes[s];
        double       host_us[3], gpu_ms[3];
        for (int c = 0; c < 3; c++) {
            kn_ctx *x = ctx[c];
            /* first call: makes the plan (timed ones time their candidates here) */
            CHECK(be->gemm_bf16in(x, out[c], in[c], w[c], CM_DTYPE_BF16, M, sh->N, sh->K));
            CHECK(be->sync(x));
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0);
            cudaEventCreate(&e1);
            cudaEventRecord(e0, x->stream);
            double t0 = now_s();
            for (int i = 0; i < reps; i++)
                CHECK(be->gemm_bf16in(x, out[c], in[c], w[c], CM_DTYPE_BF16, M, sh->N, sh->K));
            double t1 = now_s();
            cudaEventRecord(e1, x->stream);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
            host_us[c] = (t1 - t0) * 1e6 / reps;
            gpu_ms[c] = (double)ms / reps;
            tot_gpu[c] += gpu_ms[c] * sh->per_forward;
            tot_host[c] += host_us[c] * sh->per_forward;
        }
        CHECK(be->download(ctx[0], host0, out[0], (size_t)M * sh->N * 4));
        CHECK(be->download(ctx[1], host1, out[1], (size_t)M * sh->N * 4));
        int same = memcmp(host0, host1, (size_t)M * sh->N * 4) == 0;
        all_same &= same;
        int rank = -1;
        for (int i = 0; i < KN_LT_PLANS; i++) {
            const kn_lt_plan *p = &ctx[2]->lt_plans[i];
            if (p->used && p->key.m == sh->N && p->key.n == M && p->key.k == sh->K)
                rank = p->rank;
        }
        printf("| %s (%lld x %lld) | %d | %.1f / %.1f / %.1f | %.4f / %.4f / %.4f | #%d | %s |\n", sh->name,
               (long long)sh->N, (long long)sh->K, sh->per_forward, host_us[0], host_us[1], host_us[2], gpu_ms[0],
               gpu_ms[1], gpu_ms[2], rank, same ? "yes" : "NO");
    }
    printf("one forward's %d GEMMs: host enqueue %.2f / %.2f / %.2f ms, GPU %.2f / %.2f / %.2f ms "
           "(per call / planned / timed); timed vs planned GPU: %+.2f %%\n",
           48 * 5 + 16 * 4 + 64 * 3, tot_host[0] / 1e3, tot_host[1] / 1e3, tot_host[2] / 1e3, tot_gpu[0], tot_gpu[1],
           tot_gpu[2], 100.0 * (tot_gpu[2] - tot_gpu[1]) / tot_gpu[1]);
    printf("plans: per call %d, planned %d, timed %d; planned results %s the per-call bits\n",
           ctx[0]->lt_plans_used, ctx[1]->lt_plans_used, ctx[2]->lt_plans_used, all_same ? "equal" : "DIFFER FROM");
    for (int c = 0; c < 3; c++) {
        be->free(ctx[c], in[c]);
        be->free(ctx[c], w[c]);
        be->free(ctx[c], out[c]);
        be->ctx_destroy(&ctx[c]);
    }
    free(host0);
    free(host1);
    free(fill);
    return all_same ? 0 : 1;
}
