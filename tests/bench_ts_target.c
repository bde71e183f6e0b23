/* tests/bench_ts_target.c — the target-server forward at real scale on one GPU (not a test;
 * bench/target_bench.sh runs it): a 27B-shaped model with --init random weights, packed
 * batches of a realistic mix of sequence lengths, and in one run
 *   - cold start: process start → weights on the device → first forward done (first answer),
 *   - tokens/s over timed forwards (all 64 layers, the drafter's taps copied out on the device),
 *   - a timed forward's breakdown: GDN, attention and MLP blocks, their GEMMs, the kernels,
 *   - the chunked GDN and flash attention kernels alone on one 8192-token sequence and on the mix,
 *   - the cuBLASLt ceiling (8192³ bf16, fp32 accumulate) and the model's achieved TF/s,
 * then a table on stdout and the same numbers as JSON (--json PATH).
 *   bench_ts_target --config deploy/configs/qwen3.6-27b/target-config.json [--tokens 8192]
 *                   [--iters 5] [--seed 1] [--gpu 0] [--json OUT.json] [--mix-only OUT.json]
 * --mix-only writes the pack's cu_seqlens as JSON and exits without touching the GPU (the
 * Transformers side of bench/target_bench.sh runs the same pack); --profile-only runs one
 * forward and exits (for a kernel profiler). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_cfg.h"
#include "cm_log.h"
#include "kn_backend.h"
#include "kn_cuda_lt.h"
#include "ts_model.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define CHECK(x)                                                                                             \
    do {                                                                                                     \
        cm_status s_ = (x);                                                                                  \
        if (s_ != CM_OK) {                                                                                   \
            fprintf(stderr, "bench_ts_target: %s failed: %s: %s\n", #x, cm_status_str(s_), cm_last_error()); \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double   urand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* A realistic pack: lengths log-uniform in [256, 8192] (chat and document data: many short,
 * some long), drawn until T tokens are filled, the last one cut to fit (so every pack is
 * exactly T tokens, as the trainer packs them). Returns n_seq. */
static int make_mix(int32_t *cu, int max_seq, int64_t T) {
    int n = 0;
    cu[0] = 0;
    while (cu[n] < T && n < max_seq - 1) {
        int64_t len = (int64_t)exp(log(256.0) + (log(8192.0) - log(256.0)) * urand());
        if (cu[n] + len > T) len = T - cu[n];
        cu[n + 1] = cu[n] + (int32_t)len;
        n++;
    }
    cu[n] = (int32_t)T;
    return n;
}

typedef struct op_bufs {
    float   *q, *k, *v, *g, *beta, *gate, *out;
    int32_t *cu;
} op_bufs;

/* Median over 5 rounds of the mean time of reps calls (seconds). */
typedef cm_status (*op_fn)(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                           const cm_target_cfg *c);

static cm_status run_gdn(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                         const cm_target_cfg *c) {
    return be->gated_delta_rule(cx, b->out, b->q, b->k, b->v, b->g, b->beta, b->cu, n_seq, T, c->lin_n_k_heads,
                                c->lin_n_v_heads, c->lin_k_head_dim, c->lin_v_head_dim,
                                1.0f / sqrtf((float)c->lin_k_head_dim));
}

static cm_status run_attn(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                          const cm_target_cfg *c) {
    return be->attention(cx, b->out, b->q, b->k, b->v, b->gate, b->cu, n_seq, T, c->n_heads, c->n_kv_heads,
                         c->head_dim, 1.0f / sqrtf((float)c->head_dim));
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double time_op(op_fn f, const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                      const cm_target_cfg *c, int reps) {
    double r[5];
    CHECK(f(be, cx, b, n_seq, T, c)); /* warm-up */
    CHECK(be->sync(cx));
    for (int i = 0; i < 5; i++) {
        double t0 = now_s();
        for (int j = 0; j < reps; j++) CHECK(f(be, cx, b, n_seq, T, c));
        CHECK(be->sync(cx));
        r[i] = (now_s() - t0) / reps;
    }
    qsort(r, 5, sizeof r[0], cmp_d);
    return r[2];
}

int main(int argc, char **argv) {
    const double t_start = now_s();
    const char  *config = NULL, *json = NULL, *mix_only = NULL;
    int          profile_only = 0;
    int64_t      T = 8192;
    int          iters = 5, gpu = 0;
    uint64_t     seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--config")) config = argv[i + 1];
        else if (!strcmp(argv[i], "--tokens")) T = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--gpu")) gpu = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--json")) json = argv[i + 1];
        else if (!strcmp(argv[i], "--mix-only")) mix_only = argv[i + 1];
        else if (!strcmp(argv[i], "--profile-only")) profile_only = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench_ts_target: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!config || T <= 0 || iters <= 0) {
        fprintf(stderr, "usage: bench_ts_target --config CONFIG.json [--tokens 8192] [--iters 5] [--seed 1] "
                        "[--gpu 0] [--json OUT.json]\n");
        return 2;
    }
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    if (mix_only) {
        int32_t *cu = malloc((size_t)(T + 1) * sizeof *cu);
        FILE    *f  = fopen(mix_only, "w");
        if (!cu || !f) return 1;
        int n = make_mix(cu, (int)T + 1, T);
        fprintf(f, "{\"tokens\": %lld, \"cu_seqlens\": [", (long long)T);
        for (int s = 0; s <= n; s++) fprintf(f, "%s%d", s ? ", " : "", cu[s]);
        fprintf(f, "]}\n");
        fclose(f);
        free(cu);
        return 0;
    }
    const kn_backend *be = kn_backend_cuda();
    if (!be) {
        fprintf(stderr, "bench_ts_target: this build has no cuda backend\n");
        return 1;
    }
    kn_ctx       *cx = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.device = gpu;
    CHECK(be->ctx_create(&cx, &kc));
    const double t_ctx = now_s();

    ts_model       *m  = NULL;
    ts_model_config mc = {.dir = config, .backend = be, .ctx = cx, .n_layers = -1, .load_head = 0,
                          .bf16_weights = 1, .init_random = 1, .seed = seed};
    CHECK(ts_model_load(&m, &mc));
    const double         t_loaded = now_s();
    const cm_target_cfg *c        = ts_model_cfg(m);
    const int64_t        D        = c->hidden_size;

    /* the pack */
    int32_t *cu  = malloc((size_t)(T + 1) * sizeof *cu);
    int32_t *ids = malloc((size_t)T * sizeof *ids);
    if (!cu || !ids) return 1;
    int n_seq = make_mix(cu, (int)T + 1, T);
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(urand() * c->vocab_size) % c->vocab_size;

    /* captures: the drafter's taps (deploy drafter.json) and the last layer, kept on the device */
    int    taps[8], n_taps = 0;
    int    want[] = {1, 16, 31, 46, 61};
    for (int i = 0; i < 5; i++)
        if (want[i] < c->n_layers - 1) taps[n_taps++] = want[i];
    taps[n_taps++] = c->n_layers - 1;
    float *dev[8];
    for (int i = 0; i < n_taps; i++) CHECK(be->alloc(cx, (void **)&dev[i], (size_t)(T * D) * sizeof(float)));
    ts_capture cap = {.n_layers = n_taps, .layers = taps, .layer_dev = dev};

    CHECK(ts_model_forward(m, ids, T, cu, n_seq, &cap));
    const double t_first = now_s();
    if (profile_only) return 0;
    CHECK(ts_model_forward(m, ids, T, cu, n_seq, &cap));
    double t0 = now_s();
    for (int i = 0; i < iters; i++) CHECK(ts_model_forward(m, ids, T, cu, n_seq, &cap));
    const double fwd_s = (now_s() - t0) / iters;

    ts_model_set_timing(m, 1);
    for (int i = 0; i < 2; i++) CHECK(ts_model_forward(m, ids, T, cu, n_seq, &cap));
    ts_timing tm;
    ts_model_get_timing(m, &tm);
    ts_model_set_timing(m, 0);
    const double nf = tm.forwards;

    /* FLOPs of a pack: 2·T per matrix parameter of the decoder, plus causal attention
     * 4·nq·hd·Σ L(L+1)/2 per attention layer (qwen_hybrid.md §6); GDN and elementwise work
     * (< 1 %) not counted */
    const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, I = c->intermediate_size;
    const double  p_gdn = (double)D * (2 * nk * dk + nv * dv) + (double)D * nv * dv * 2 + 2.0 * D * nv;
    const double  p_att = (double)D * nq * hd * 2 + 2.0 * D * nkv * hd + (double)D * nq * hd;
    double        p_dec = 0, att_pairs = 0;
    int           n_gdn = 0, n_att = 0;
    for (int i = 0; i < c->n_layers; i++) {
        int g = c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION;
        p_dec += 3.0 * D * I + (g ? p_gdn : p_att);
        n_gdn += g;
        n_att += !g;
    }
    for (int s = 0; s < n_seq; s++) {
        double L = cu[s + 1] - cu[s];
        att_pairs += L * (L + 1) / 2;
    }
    const double flops_gemm = 2.0 * (double)T * p_dec;
    const double flops_attn = 4.0 * nq * hd * att_pairs * n_att;

    /* kernels alone: one 8192-token sequence and the mix */
    op_bufs b;
    CHECK(be->alloc(cx, (void **)&b.q, (size_t)(T * (nq * hd > nk * dk ? nq * hd : nk * dk)) * 4));
    CHECK(be->alloc(cx, (void **)&b.k, (size_t)(T * (nkv * hd > nk * dk ? nkv * hd : nk * dk)) * 4));
    CHECK(be->alloc(cx, (void **)&b.v, (size_t)(T * (nkv * hd > nv * dv ? nkv * hd : nv * dv)) * 4));
    CHECK(be->alloc(cx, (void **)&b.out, (size_t)(T * (nq * hd > nv * dv ? nq * hd : nv * dv)) * 4));
    CHECK(be->alloc(cx, (void **)&b.gate, (size_t)(T * nq * hd) * 4));
    CHECK(be->alloc(cx, (void **)&b.g, (size_t)(T * nv) * 4));
    CHECK(be->alloc(cx, (void **)&b.beta, (size_t)(T * nv) * 4));
    CHECK(be->alloc(cx, (void **)&b.cu, (size_t)(T + 1) * 4));
    int32_t one[2] = {0, (int32_t)T};
    double  t_gdn[2], t_att[2];
    for (int mix = 0; mix < 2; mix++) {
        CHECK(be->upload(cx, b.cu, mix ? cu : one, (size_t)((mix ? n_seq : 1) + 1) * 4));
        CHECK(be->fill_uniform(cx, b.q, CM_DTYPE_F32, T * nk * dk, 11, -1, 1));
        CHECK(be->fill_uniform(cx, b.k, CM_DTYPE_F32, T * nk * dk, 12, -1, 1));
        CHECK(be->l2norm(cx, b.q, b.q, T * nk, (int)dk, 1e-6f));
        CHECK(be->l2norm(cx, b.k, b.k, T * nk, (int)dk, 1e-6f));
        CHECK(be->fill_uniform(cx, b.v, CM_DTYPE_F32, T * nv * dv, 13, -1, 1));
        CHECK(be->fill_uniform(cx, b.g, CM_DTYPE_F32, T * nv, 14, -1.0f, -0.001f));
        CHECK(be->fill_uniform(cx, b.beta, CM_DTYPE_F32, T * nv, 15, 0.0f, 1.0f));
        t_gdn[mix] = time_op(run_gdn, be, cx, &b, mix ? n_seq : 1, T, c, 20);
        CHECK(be->fill_uniform(cx, b.q, CM_DTYPE_F32, T * nq * hd, 16, -1, 1));
        CHECK(be->fill_uniform(cx, b.k, CM_DTYPE_F32, T * nkv * hd, 17, -1, 1));
        CHECK(be->fill_uniform(cx, b.v, CM_DTYPE_F32, T * nkv * hd, 18, -1, 1));
        CHECK(be->fill_uniform(cx, b.gate, CM_DTYPE_F32, T * nq * hd, 19, -3, 3));
        t_att[mix] = time_op(run_attn, be, cx, &b, mix ? n_seq : 1, T, c, 5);
    }

    /* the cuBLASLt ceiling: 8192³, bf16 operands, fp32 accumulate and output */
    const int64_t G = 8192;
    void         *ga, *gb;
    float        *gc;
    CHECK(be->alloc(cx, &ga, (size_t)(G * G) * 2));
    CHECK(be->alloc(cx, &gb, (size_t)(G * G) * 2));
    CHECK(be->alloc(cx, (void **)&gc, (size_t)(G * G) * 4));
    CHECK(be->fill_uniform(cx, ga, CM_DTYPE_BF16, G * G, 21, -1, 1));
    CHECK(be->fill_uniform(cx, gb, CM_DTYPE_BF16, G * G, 22, -1, 1));
    double r[7];
    for (int i = 0; i < 7; i++) {
        CHECK(be->sync(cx));
        double s = now_s();
        for (int j = 0; j < 5; j++)
            CHECK(kn_cuda_lt_matmul(cx, "ceiling", CUDA_R_16BF, 1, 0, G, G, G, ga, G, gb, G, 0.0f, gc, G));
        CHECK(be->sync(cx));
        r[i] = (now_s() - s) / 5;
    }
    qsort(r, 7, sizeof r[0], cmp_d);
    const double ceil_tf = 2.0 * G * G * G / r[3] / 1e12;

    const double tok_s    = T / fwd_s;
    const double gemm_ms  = (tm.gdn_gemm_ms + tm.attn_gemm_ms + tm.mlp_gemm_ms) / nf;
    const double timed_ms = tm.total_ms / nf;
    printf("\n## target forward, %s, %lld-token packs (%d sequences: ", config, (long long)T, n_seq);
    for (int s = 0; s < n_seq; s++) printf("%s%d", s ? " " : "", cu[s + 1] - cu[s]);
    printf(")\n\n| figure | value |\n| --- | --- |\n");
    printf("| cold start: process start to weights on the GPU (--init random) | %.2f s (context %.2f s) |\n",
           t_loaded - t_start, t_ctx - t_start);
    printf("| cold start: process start to the first forward done | %.2f s |\n", t_first - t_start);
    printf("| forward, %d-pack mean (untimed) | %.1f ms |\n", iters, fwd_s * 1e3);
    printf("| **tokens/s** | **%.0f** |\n", tok_s);
    printf("| achieved (GEMM + attention FLOPs / time) | %.0f TF/s (%.1f TFLOP per pack) |\n",
           (flops_gemm + flops_attn) / fwd_s / 1e12, (flops_gemm + flops_attn) / 1e12);
    printf("| cuBLASLt ceiling, 8192^3 bf16 | %.0f TF/s |\n", ceil_tf);
    printf("| GEMM-only bound at the ceiling | %.0f ms = %.0f tok/s |\n", flops_gemm / (ceil_tf * 1e12) * 1e3,
           T / (flops_gemm / (ceil_tf * 1e12)));
    printf("| timed forward (syncs around every block and GEMM) | %.1f ms |\n", timed_ms);
    printf("| GEMMs in the timed forward | %.1f ms (%.0f %%; %.0f TF/s) |\n", gemm_ms, 100 * gemm_ms / timed_ms,
           flops_gemm / (gemm_ms * 1e-3) / 1e12);
    printf("| GDN block (norm, projections, conv, gate, core, norm, out proj, add) | %.3f ms x %d (GEMMs %.3f, "
           "core %.3f) |\n",
           tm.gdn_ms / tm.gdn_layers, n_gdn, tm.gdn_gemm_ms / tm.gdn_layers, tm.gdn_core_ms / tm.gdn_layers);
    printf("| attention block | %.3f ms x %d (GEMMs %.3f, core %.3f) |\n", tm.attn_ms / tm.attn_layers, n_att,
           tm.attn_gemm_ms / tm.attn_layers, tm.attn_core_ms / tm.attn_layers);
    printf("| MLP block | %.3f ms x %d (GEMMs %.3f) |\n", tm.mlp_ms / tm.mlp_layers, c->n_layers,
           tm.mlp_gemm_ms / tm.mlp_layers);
    printf("| other (embedding, captures, uploads) | %.1f ms |\n", tm.other_ms / nf);
    printf("| chunked GDN kernel alone, 1 x %lld tokens | %.3f ms |\n", (long long)T, t_gdn[0] * 1e3);
    printf("| chunked GDN kernel alone, the mix | %.3f ms |\n", t_gdn[1] * 1e3);
    printf("| flash attention kernel alone, 1 x %lld tokens | %.3f ms (%.0f TF/s) |\n", (long long)T,
           t_att[0] * 1e3, 4.0 * nq * hd * (double)T * (T + 1) / 2 / t_att[0] / 1e12);
    printf("| flash attention kernel alone, the mix | %.3f ms (%.0f TF/s) |\n", t_att[1] * 1e3,
           4.0 * nq * hd * att_pairs / t_att[1] / 1e12);
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f,
                    "{\"tokens\": %lld, \"n_seq\": %d, \"cold_load_s\": %.3f, \"cold_first_forward_s\": %.3f, "
                    "\"forward_ms\": %.3f, \"tokens_per_s\": %.1f, \"achieved_tflops\": %.1f, "
                    "\"ceiling_tflops\": %.1f, \"gemm_ms\": %.3f, \"timed_forward_ms\": %.3f, "
                    "\"gdn_block_ms\": %.4f, \"gdn_core_ms\": %.4f, \"attn_block_ms\": %.4f, "
                    "\"attn_core_ms\": %.4f, \"mlp_block_ms\": %.4f, \"gdn_kernel_single_ms\": %.4f, "
                    "\"gdn_kernel_mix_ms\": %.4f, \"attn_kernel_single_ms\": %.4f, \"attn_kernel_mix_ms\": %.4f, "
                    "\"cu_seqlens\": [",
                    (long long)T, n_seq, t_loaded - t_start, t_first - t_start, fwd_s * 1e3, tok_s,
                    (flops_gemm + flops_attn) / fwd_s / 1e12, ceil_tf, gemm_ms, timed_ms, tm.gdn_ms / tm.gdn_layers,
                    tm.gdn_core_ms / tm.gdn_layers, tm.attn_ms / tm.attn_layers, tm.attn_core_ms / tm.attn_layers,
                    tm.mlp_ms / tm.mlp_layers, t_gdn[0] * 1e3, t_gdn[1] * 1e3, t_att[0] * 1e3, t_att[1] * 1e3);
            for (int s = 0; s <= n_seq; s++) fprintf(f, "%s%d", s ? ", " : "", cu[s]);
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    /* the process exits here: the driver frees device memory */
    return 0;
}
