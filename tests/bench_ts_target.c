/* tests/bench_ts_target.c — the target-server forward at real scale on one GPU (not a test;
 * bench/target_bench.sh runs it): a 27B-shaped model with --init random weights, packed
 * batches of a realistic mix of sequence lengths, and in one run
 *   - cold start: process start → weights on the device → first forward done (first answer),
 *   - tokens/s over timed forwards (all 64 layers, the drafter's taps copied out on the device),
 *   - a timed forward's breakdown: GDN, attention and MLP blocks, their GEMMs, the kernels,
 *   - the chunked GDN and flash attention kernels alone on one 8192-token sequence and on the mix
 *     (and beside them, each on a context of its own, the kernels the dispatch did not pick:
 *     TANDEM_GDN_KERNEL=mma, TANDEM_ATTN_KERNEL=wmma|fa2-2|fa2),
 *   - the elementwise ops at the model's shapes, unfused and fused (the bf16 fast path),
 *   - the cuBLASLt ceilings (8192³ bf16 and block-scaled fp8, fp32 accumulate), the GEMM-only
 *     bounds of both precisions and the model's achieved TF/s,
 * then a table on stdout and the same numbers as JSON (--json PATH).
 *   bench_ts_target --config deploy/configs/qwen3.6-27b/target-config.json [--tokens 8192]
 *                   [--iters 5] [--seed 1] [--gpu 0] [--precision bf16|fp8] [--json OUT.json]
 *                   [--mix-only OUT.json]
 * --mix-only writes the pack's cu_seqlens as JSON and exits without touching the GPU (the
 * Transformers side of bench/target_bench.sh runs the same pack); --profile-only runs one
 * forward and exits (for a kernel profiler); --gdn-only 1 times the chunked GDN kernel alone (and
 * with TANDEM_GDN_KERNEL=mma) and exits. TANDEM_TARGET_FUSED=0 runs the forward on the
 * unfused path (ts_model.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_cfg.h"
#include "cm_log.h"
#include "kn_backend.h"
#include "kn_cuda_lt.h"
#include "kn_fp8_int.h"
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
    /* the elementwise ops at the model's shapes, before and after fusion */
    float    *x, *conv_out, *conv_w, *big0, *big1, *big2, *res, *y, *norm_w, *h, *z, *gn_w, *proj_out;
    uint16_t *h16, *act16;
    void     *down_w; /* BF16 [D, I] */
    /* --precision fp8: the quantized normed input, the FP8 gate and up weights [I, D] with
     * their block scales, the quantized down-projection input */
    uint8_t *h8, *gw8, *uw8, *act8;
    float   *h8s, *gws, *uws, *act8s;
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

/* GDN conv: conv1d_silu, the three q/k/v copies and two l2norms, or the one fused op */
static cm_status ew_conv_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    const int64_t qk = (int64_t)c->lin_n_k_heads * c->lin_k_head_dim, vd = (int64_t)c->lin_n_v_heads * c->lin_v_head_dim;
    const int64_t C  = 2 * qk + vd;
    CM_TRY(be->conv1d_silu(cx, b->conv_out, b->x, b->conv_w, b->cu, n_seq, T, C, c->lin_conv_kernel));
    CM_TRY(be->copy2d(cx, b->q, qk, b->conv_out, C, T, qk));
    CM_TRY(be->copy2d(cx, b->k, qk, b->conv_out + qk, C, T, qk));
    CM_TRY(be->copy2d(cx, b->v, vd, b->conv_out + 2 * qk, C, T, vd));
    CM_TRY(be->l2norm(cx, b->q, b->q, T * c->lin_n_k_heads, c->lin_k_head_dim, 1e-6f));
    return be->l2norm(cx, b->k, b->k, T * c->lin_n_k_heads, c->lin_k_head_dim, 1e-6f);
}

static cm_status ew_conv_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    return be->gdn_conv_qkv(cx, b->q, b->k, b->v, b->x, b->conv_w, b->cu, n_seq, T, c->lin_n_k_heads,
                            c->lin_n_v_heads, c->lin_k_head_dim, c->lin_v_head_dim, c->lin_conv_kernel, 1e-6f);
}

/* residual add + the next RMSNorm (its bf16 conversion happens in each GEMM that reads it) */
static cm_status ew_norm_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    (void)n_seq;
    CM_TRY(be->add(cx, b->res, b->y, T * c->hidden_size));
    return be->rmsnorm(cx, b->h, b->res, b->norm_w, T, c->hidden_size, c->rms_norm_eps, 1);
}

static cm_status ew_norm_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    (void)n_seq;
    return be->add_rmsnorm_bf16(cx, b->h16, b->res, b->y, b->norm_w, T, c->hidden_size, c->rms_norm_eps, 1);
}

/* the GDN output norm */
static cm_status ew_gnorm_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                              const cm_target_cfg *c) {
    (void)n_seq;
    return be->rmsnorm_gated(cx, b->out, b->out, b->z, b->gn_w, T * c->lin_n_v_heads, c->lin_v_head_dim,
                             c->rms_norm_eps);
}

static cm_status ew_gnorm_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                              const cm_target_cfg *c) {
    (void)n_seq;
    return be->rmsnorm_gated_bf16(cx, b->act16, b->out, b->z, b->gn_w, T * c->lin_n_v_heads, c->lin_v_head_dim,
                                  c->rms_norm_eps);
}

/* SwiGLU and the down projection (whose GEMM converts an f32 input to bf16 first) */
static cm_status ew_mlp_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                            const cm_target_cfg *c) {
    (void)n_seq;
    const int64_t I = c->intermediate_size;
    CM_TRY(be->swiglu(cx, b->big2, b->big0, b->big1, T * I));
    return be->gemm(cx, b->proj_out, b->big2, b->down_w, CM_DTYPE_BF16, T, c->hidden_size, I);
}

static cm_status ew_mlp_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                            const cm_target_cfg *c) {
    (void)n_seq;
    const int64_t I = c->intermediate_size;
    CM_TRY(be->swiglu_bf16(cx, b->act16, b->big0, b->big1, T * I));
    return be->gemm_bf16in(cx, b->proj_out, b->act16, b->down_w, CM_DTYPE_BF16, T, c->hidden_size, I);
}

/* FP8: the norm, then the quantization of its output for the projections; or the one op */
static cm_status ew_norm8_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                              const cm_target_cfg *c) {
    CM_TRY(ew_norm_new(be, cx, b, n_seq, T, c));
    return be->fp8_quantize_rows(cx, b->h8, b->h8s, b->h16, CM_DTYPE_BF16, T, c->hidden_size);
}

static cm_status ew_norm8_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                              const cm_target_cfg *c) {
    (void)n_seq;
    return be->add_rmsnorm_fp8(cx, b->h16, b->h8, b->h8s, b->res, b->y, b->norm_w, T, c->hidden_size,
                               c->rms_norm_eps, 1);
}

/* FP8: the GDN output norm, then out_proj's input quantization; or the one op */
static cm_status ew_gnorm8_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                               const cm_target_cfg *c) {
    CM_TRY(ew_gnorm_new(be, cx, b, n_seq, T, c));
    return be->fp8_quantize_rows(cx, b->act8, b->act8s, b->act16, CM_DTYPE_BF16, T,
                                 (int64_t)c->lin_n_v_heads * c->lin_v_head_dim);
}

static cm_status ew_gnorm8_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                               const cm_target_cfg *c) {
    (void)n_seq;
    return be->rmsnorm_gated_fp8(cx, b->act8, b->act8s, b->out, b->z, b->gn_w, T, c->lin_n_v_heads,
                                 c->lin_v_head_dim, c->rms_norm_eps);
}

/* FP8: the gate and up products and SwiGLU into the quantized down input, the products in f32
 * (before) or bf16 (now) */
static cm_status ew_mlp8(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int64_t T, const cm_target_cfg *c,
                         cm_dtype odt) {
    const int64_t D = c->hidden_size, I = c->intermediate_size;
    CM_TRY(be->gemm_fp8q(cx, b->big0, odt, b->h8, b->h8s, b->gw8, b->gws, T, I, D));
    CM_TRY(be->gemm_fp8q(cx, b->big1, odt, b->h8, b->h8s, b->uw8, b->uws, T, I, D));
    return be->swiglu_fp8(cx, b->act8, b->act8s, b->big0, b->big1, odt, T, I);
}

static cm_status ew_mlp8_old(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    (void)n_seq;
    return ew_mlp8(be, cx, b, T, c, CM_DTYPE_F32);
}

static cm_status ew_mlp8_new(const kn_backend *be, kn_ctx *cx, const op_bufs *b, int n_seq, int64_t T,
                             const cm_target_cfg *c) {
    (void)n_seq;
    return ew_mlp8(be, cx, b, T, c, CM_DTYPE_BF16);
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

/* The 8192³ ceilings: bf16 operands through cuBLASLt, and block-scaled e4m3 operands (the weight's
 * 128 × 128 scales gs_a, the input's 1 × 128 scales gs_b) through cuBLASLt or Tandem's wgmma
 * kernel; fp32 accumulate and output into gc. */
typedef enum { CEIL_BF16, CEIL_FP8_LT, CEIL_FP8_WG } ceil_kind;
typedef struct ceil_ops {
    void  *ga, *gb;
    float *gc, *gs_a, *gs_b;
} ceil_ops;

/* Seconds per product: the median of 7 runs of 5 back-to-back products of kind k. */
static double ceil_s(const kn_backend *be, kn_ctx *cx, ceil_kind k, const ceil_ops *o, int64_t G) {
    double r[7];
    for (int i = 0; i < 7; i++) {
        CHECK(be->sync(cx));
        double s = now_s();
        for (int j = 0; j < 5; j++) {
            if (k == CEIL_BF16)
                CHECK(kn_cuda_lt_matmul(cx, "ceiling", CUDA_R_16BF, 1, 0, G, G, G, o->ga, G, o->gb, G, 0.0f, o->gc,
                                        G));
            else if (k == CEIL_FP8_LT)
                CHECK(kn_cuda_lt_matmul_fp8(cx, "ceiling", G, G, G, o->gb, o->gs_a, o->gb, o->gs_b, 0.0f, o->gc,
                                            CUDA_R_32F, G));
            else
                CHECK(kn_fp8_gemm_wg(cx, o->gc, KN_FP8_OUT_F32, (const uint8_t *)o->gb, o->gs_b,
                                     (const uint8_t *)o->gb, o->gs_a, G, G, G, 0));
        }
        CHECK(be->sync(cx));
        r[i] = (now_s() - s) / 5;
    }
    qsort(r, 7, sizeof r[0], cmp_d);
    return r[3];
}

/* run_gdn on a context of its own with TANDEM_GDN_KERNEL=mma (the mma.sync state kernel where the
 * dispatch would take the wgmma one), on the same buffers */
static double time_gdn_mma(const kn_backend *be, const kn_ctx_config *kc, const op_bufs *b, int n_seq, int64_t T,
                           const cm_target_cfg *c) {
    kn_ctx *fx = NULL;
    setenv("TANDEM_GDN_KERNEL", "mma", 1); /* read at ctx_create */
    CHECK(be->ctx_create(&fx, kc));
    unsetenv("TANDEM_GDN_KERNEL");
    const double t = time_op(run_gdn, be, fx, b, n_seq, T, c, 20);
    be->ctx_destroy(&fx);
    return t;
}

int main(int argc, char **argv) {
    const double t_start = now_s();
    const char  *config = NULL, *json = NULL, *mix_only = NULL;
    int          profile_only = 0, gdn_only = 0, fp8 = 0;
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
        else if (!strcmp(argv[i], "--gdn-only")) gdn_only = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--precision") && (!strcmp(argv[i + 1], "bf16") || !strcmp(argv[i + 1], "fp8")))
            fp8 = !strcmp(argv[i + 1], "fp8");
        else {
            fprintf(stderr, "bench_ts_target: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!config || T <= 0 || iters <= 0) {
        fprintf(stderr, "usage: bench_ts_target --config CONFIG.json [--tokens 8192] [--iters 5] [--seed 1] "
                        "[--gpu 0] [--precision bf16|fp8] [--json OUT.json]\n");
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
    ts_model_config mc = {.dir = config, .backend = be, .ctx = cx, .n_layers = gdn_only ? 1 : -1,
                          .load_head = 0, .bf16_weights = 1, .init_random = 1, .seed = seed, .fp8 = fp8};
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

    /* --gdn-only 1: the chunked GDN kernel alone (one sequence, the mix), nothing else (one
     * layer loaded only for the config and the context); for iterating on kn_gdn.cu */
    if (gdn_only) {
        const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim;
        const int64_t dv = c->lin_v_head_dim;
        op_bufs       b = {0};
        int32_t       one[2] = {0, (int32_t)T};
        CHECK(be->alloc(cx, (void **)&b.q, (size_t)(T * nk * dk) * 4));
        CHECK(be->alloc(cx, (void **)&b.k, (size_t)(T * nk * dk) * 4));
        CHECK(be->alloc(cx, (void **)&b.v, (size_t)(T * nv * dv) * 4));
        CHECK(be->alloc(cx, (void **)&b.out, (size_t)(T * nv * dv) * 4));
        CHECK(be->alloc(cx, (void **)&b.g, (size_t)(T * nv) * 4));
        CHECK(be->alloc(cx, (void **)&b.beta, (size_t)(T * nv) * 4));
        CHECK(be->alloc(cx, (void **)&b.cu, (size_t)(T + 1) * 4));
        for (int mix = 0; mix < 2; mix++) {
            CHECK(be->upload(cx, b.cu, mix ? cu : one, (size_t)((mix ? n_seq : 1) + 1) * 4));
            CHECK(be->fill_uniform(cx, b.q, CM_DTYPE_F32, T * nk * dk, 11, -1, 1));
            CHECK(be->fill_uniform(cx, b.k, CM_DTYPE_F32, T * nk * dk, 12, -1, 1));
            CHECK(be->l2norm(cx, b.q, b.q, T * nk, (int)dk, 1e-6f));
            CHECK(be->l2norm(cx, b.k, b.k, T * nk, (int)dk, 1e-6f));
            CHECK(be->fill_uniform(cx, b.v, CM_DTYPE_F32, T * nv * dv, 13, -1, 1));
            CHECK(be->fill_uniform(cx, b.g, CM_DTYPE_F32, T * nv, 14, -1.0f, -0.001f));
            CHECK(be->fill_uniform(cx, b.beta, CM_DTYPE_F32, T * nv, 15, 0.0f, 1.0f));
            const double t_wg = time_op(run_gdn, be, cx, &b, mix ? n_seq : 1, T, c, 20);
            const double t_mma = time_gdn_mma(be, &kc, &b, mix ? n_seq : 1, T, c);
            printf("| chunked GDN kernel alone, %s | %.3f ms (TANDEM_GDN_KERNEL=mma: %.3f ms) |\n",
                   mix ? "the mix" : "1 sequence", t_wg * 1e3, t_mma * 1e3);
        }
        return 0;
    }

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
     * 4·nq·hd·Σ L(L+1)/2 per attention layer (docs/target.md); GDN and elementwise work
     * (< 1 %) not counted */
    const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, I = c->intermediate_size;
    const double  p_gdn = (double)D * (2 * nk * dk + nv * dv) + (double)D * nv * dv * 2 + 2.0 * D * nv;
    const double  p_att = (double)D * nq * hd * 2 + 2.0 * D * nkv * hd + (double)D * nq * hd;
    double        p_dec = 0, att_pairs = 0;
    int           n_gdn = 0, n_att = 0;
    /* a sparse MoE layer's MLP: the K routed experts, the shared expert, the router and its gate */
    const double p_moe = 3.0 * D * c->moe_intermediate_size * c->n_experts_per_tok +
                         3.0 * D * c->shared_expert_intermediate_size + (double)D * c->n_experts + D;
    double       p_experts = 0; /* the routed experts' part */
    for (int i = 0; i < c->n_layers; i++) {
        int g = c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION;
        p_dec += (cm_target_layer_moe(c, i) ? p_moe : 3.0 * D * I) + (g ? p_gdn : p_att);
        if (cm_target_layer_moe(c, i)) p_experts += 3.0 * D * c->moe_intermediate_size * c->n_experts_per_tok;
        n_gdn += g;
        n_att += !g;
    }
    for (int s = 0; s < n_seq; s++) {
        double L = cu[s + 1] - cu[s];
        att_pairs += L * (L + 1) / 2;
    }
    const double flops_gemm = 2.0 * (double)T * p_dec;
    /* under fp8 the GDN's in_proj_a and in_proj_b stay bf16 (docs/fp8.md) */
    int n_moe = 0;
    for (int i = 0; i < c->n_layers; i++) n_moe += cm_target_layer_moe(c, i);
    /* (and a MoE layer's router and shared-expert gate) */
    const double flops_ab = 2.0 * (double)T * ((2.0 * D * nv) * n_gdn + ((double)D * c->n_experts + D) * n_moe);
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
    double  t_gdn[2], t_gdn_mma[2], t_att[2], t_att_forced[3][2];
    static const char *att_forced[3] = {"wmma", "fa2-2", "fa2"}; /* kn_attention.cu's other kernels */
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
        t_gdn_mma[mix] = time_gdn_mma(be, &kc, &b, mix ? n_seq : 1, T, c);
        CHECK(be->fill_uniform(cx, b.q, CM_DTYPE_F32, T * nq * hd, 16, -1, 1));
        CHECK(be->fill_uniform(cx, b.k, CM_DTYPE_F32, T * nkv * hd, 17, -1, 1));
        CHECK(be->fill_uniform(cx, b.v, CM_DTYPE_F32, T * nkv * hd, 18, -1, 1));
        CHECK(be->fill_uniform(cx, b.gate, CM_DTYPE_F32, T * nq * hd, 19, -3, 3));
        t_att[mix] = time_op(run_attn, be, cx, &b, mix ? n_seq : 1, T, c, 5);
        CHECK(be->sync(cx));
        for (int f = 0; f < 3; f++) { /* the switch is read at ctx_create: one context per kernel */
            kn_ctx *fx = NULL;
            setenv("TANDEM_ATTN_KERNEL", att_forced[f], 1);
            CHECK(be->ctx_create(&fx, &kc));
            t_att_forced[f][mix] = time_op(run_attn, be, fx, &b, mix ? n_seq : 1, T, c, 5);
            be->ctx_destroy(&fx);
        }
        unsetenv("TANDEM_ATTN_KERNEL");
    }

    /* the elementwise ops at the model's shapes on the mix, the unfused sequence and the fused op */
    const int64_t conv_dim = 2 * nk * dk + nv * dv;
    CHECK(be->alloc(cx, (void **)&b.x, (size_t)(T * conv_dim) * 4));
    CHECK(be->alloc(cx, (void **)&b.conv_out, (size_t)(T * conv_dim) * 4));
    CHECK(be->alloc(cx, (void **)&b.conv_w, (size_t)(conv_dim * c->lin_conv_kernel) * 4));
    CHECK(be->alloc(cx, (void **)&b.big0, (size_t)(T * I) * 4));
    CHECK(be->alloc(cx, (void **)&b.big1, (size_t)(T * I) * 4));
    CHECK(be->alloc(cx, (void **)&b.big2, (size_t)(T * I) * 4));
    CHECK(be->alloc(cx, (void **)&b.res, (size_t)(T * D) * 4));
    CHECK(be->alloc(cx, (void **)&b.y, (size_t)(T * D) * 4));
    CHECK(be->alloc(cx, (void **)&b.h, (size_t)(T * D) * 4));
    CHECK(be->alloc(cx, (void **)&b.proj_out, (size_t)(T * D) * 4));
    CHECK(be->alloc(cx, (void **)&b.norm_w, (size_t)D * 4));
    CHECK(be->alloc(cx, (void **)&b.z, (size_t)(T * nv * dv) * 4));
    CHECK(be->alloc(cx, (void **)&b.gn_w, (size_t)dv * 4));
    CHECK(be->alloc(cx, (void **)&b.h16, (size_t)(T * D) * 2));
    CHECK(be->alloc(cx, (void **)&b.act16, (size_t)(T * (I > nv * dv ? I : nv * dv)) * 2));
    CHECK(be->alloc(cx, &b.down_w, (size_t)(D * I) * 2));
    CHECK(be->upload(cx, b.cu, cu, (size_t)(n_seq + 1) * 4));
    CHECK(be->fill_uniform(cx, b.x, CM_DTYPE_F32, T * conv_dim, 31, -1, 1));
    CHECK(be->fill_uniform(cx, b.conv_w, CM_DTYPE_F32, conv_dim * c->lin_conv_kernel, 32, -0.5f, 0.5f));
    CHECK(be->fill_uniform(cx, b.big0, CM_DTYPE_F32, T * I, 33, -3, 3));
    CHECK(be->fill_uniform(cx, b.big1, CM_DTYPE_F32, T * I, 34, -3, 3));
    CHECK(be->fill_uniform(cx, b.res, CM_DTYPE_F32, T * D, 35, -1, 1));
    CHECK(be->fill_uniform(cx, b.y, CM_DTYPE_F32, T * D, 36, -1e-3f, 1e-3f));
    CHECK(be->fill_uniform(cx, b.norm_w, CM_DTYPE_F32, D, 37, -0.1f, 0.1f));
    CHECK(be->fill_uniform(cx, b.out, CM_DTYPE_F32, T * nv * dv, 38, -1, 1));
    CHECK(be->fill_uniform(cx, b.z, CM_DTYPE_F32, T * nv * dv, 39, -3, 3));
    CHECK(be->fill_uniform(cx, b.gn_w, CM_DTYPE_F32, dv, 40, 0.9f, 1.1f));
    CHECK(be->fill_uniform(cx, b.down_w, CM_DTYPE_BF16, D * I, 41, -0.0346f, 0.0346f));
    const int fp8_ops = fp8 && be->add_rmsnorm_fp8 && be->gemm_fp8q && be->swiglu_fp8 && be->fp8_quantize_weight &&
                        be->rmsnorm_gated_fp8 && I >= nv * dv;
    if (fp8_ops) { /* random bf16 weights (in big2) quantized in 128 x 128 blocks */
        const int64_t Tp = kn_fp8_rows(T), LD = (D + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
        const int64_t LI = (I + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, ws = LI * kn_fp8_scale_ld(D);
        CHECK(be->alloc(cx, (void **)&b.h8, (size_t)(Tp * D)));
        CHECK(be->alloc(cx, (void **)&b.h8s, (size_t)(Tp * LD) * 4));
        CHECK(be->alloc(cx, (void **)&b.act8, (size_t)(Tp * I)));
        CHECK(be->alloc(cx, (void **)&b.act8s, (size_t)(Tp * LI) * 4));
        CHECK(be->alloc(cx, (void **)&b.gw8, (size_t)(I * D)));
        CHECK(be->alloc(cx, (void **)&b.uw8, (size_t)(I * D)));
        CHECK(be->alloc(cx, (void **)&b.gws, (size_t)ws * 4));
        CHECK(be->alloc(cx, (void **)&b.uws, (size_t)ws * 4));
        CHECK(be->fill_uniform(cx, b.big2, CM_DTYPE_BF16, I * D, 42, -0.0242f, 0.0242f));
        CHECK(be->fp8_quantize_weight(cx, b.gw8, b.gws, b.big2, CM_DTYPE_BF16, I, D));
        CHECK(be->fill_uniform(cx, b.big2, CM_DTYPE_BF16, I * D, 43, -0.0242f, 0.0242f));
        CHECK(be->fp8_quantize_weight(cx, b.uw8, b.uws, b.big2, CM_DTYPE_BF16, I, D));
        CHECK(ew_norm8_new(be, cx, &b, n_seq, T, c));
    }
    const struct {
        const char *name;
        op_fn       old_f, new_f;
        int         reps, per_layer; /* per_layer: runs per forward (GDN layers, all layers, 2 per layer) */
    } ew[] = {
        {"GDN conv1d + SiLU, q/k/v split, q/k l2norm", ew_conv_old, ew_conv_new, 10, n_gdn},
        {"residual add + RMSNorm (bf16 out)", ew_norm_old, ew_norm_new, 10, 2 * c->n_layers},
        {"GDN gated RMSNorm (bf16 out)", ew_gnorm_old, ew_gnorm_new, 10, n_gdn},
        {"SwiGLU + down projection GEMM", ew_mlp_old, ew_mlp_new, 5, c->n_layers},
        {"FP8: residual add + RMSNorm, input quantization (one op)", ew_norm8_old, ew_norm8_new, 10, 2 * c->n_layers},
        {"FP8: gate + up GEMMs and SwiGLU, products f32 -> bf16", ew_mlp8_old, ew_mlp8_new, 5, c->n_layers},
        {"FP8: GDN gated RMSNorm, out_proj input quantization (one op)", ew_gnorm8_old, ew_gnorm8_new, 10, n_gdn},
    };
    const int n_ew = (int)(sizeof ew / sizeof ew[0]) - (fp8_ops ? 0 : 3);
    double    t_ew[7][2];
    const int can_fuse = be->gdn_conv_qkv && be->add_rmsnorm_bf16 && be->rmsnorm_gated_bf16 && be->swiglu_bf16 &&
                         be->gemm_bf16in;
    for (int i = 0; i < n_ew && can_fuse; i++) {
        t_ew[i][0] = time_op(ew[i].old_f, be, cx, &b, n_seq, T, c, ew[i].reps);
        t_ew[i][1] = time_op(ew[i].new_f, be, cx, &b, n_seq, T, c, ew[i].reps);
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
    ceil_ops     co = {ga, gb, gc, NULL, NULL};
    const double ceil_tf = 2.0 * G * G * G / ceil_s(be, cx, CEIL_BF16, &co, G) / 1e12;
    /* and the block-scaled FP8 one: 8192³, e4m3 operands (weights 128 × 128 scales, the other
     * 1 × 128), fp32 accumulate and output; the input quantization not counted */
    float *gs_a, *gs_b;
    CHECK(be->alloc(cx, (void **)&gs_a, (size_t)(G / 128 * kn_fp8_scale_ld(G)) * 4));
    CHECK(be->alloc(cx, (void **)&gs_b, (size_t)(G / 128 * G) * 4));
    CHECK(be->fill_uniform(cx, gs_a, CM_DTYPE_F32, G / 128 * kn_fp8_scale_ld(G), 23, 0.001f, 0.002f));
    CHECK(be->fill_uniform(cx, gs_b, CM_DTYPE_F32, G / 128 * G, 24, 0.001f, 0.002f));
    CHECK(be->fp8_quantize_weight(cx, (uint8_t *)gb, gs_a, ga, CM_DTYPE_BF16, G, G)); /* finite e4m3 operands */
    co.gs_a = gs_a, co.gs_b = gs_b;
    const double ceil_fp8_tf = 2.0 * G * G * G / ceil_s(be, cx, CEIL_FP8_LT, &co, G) / 1e12;
    /* the same product on Tandem's wgmma kernel (TANDEM_FP8_GEMM=wgmma), where it runs */
    const int    wg_fp8 = kn_fp8_wg_available(cx);
    const double wg_fp8_tf = wg_fp8 ? 2.0 * G * G * G / ceil_s(be, cx, CEIL_FP8_WG, &co, G) / 1e12 : 0.0;
    /* the FP8 bound at the faster of the two */
    const double best_fp8_tf = wg_fp8_tf > ceil_fp8_tf ? wg_fp8_tf : ceil_fp8_tf;
    const double bound_bf16_ms = flops_gemm / (ceil_tf * 1e12) * 1e3;
    const double bound_fp8_ms =
        ((flops_gemm - flops_ab) / best_fp8_tf + flops_ab / ceil_tf) / 1e9;
    const double bound_ms = fp8 ? bound_fp8_ms : bound_bf16_ms;


    const double tok_s    = T / fwd_s;
    const double gemm_ms  = (tm.gdn_gemm_ms + tm.attn_gemm_ms + tm.mlp_gemm_ms) / nf;
    const double timed_ms = tm.total_ms / nf;
    printf("\n## target forward, %s, %s, %lld-token packs, %s path (%d sequences: ", config, fp8 ? "fp8" : "bf16",
           (long long)T, ts_model_fused(m) ? "fused bf16" : "unfused", n_seq);
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
    printf("| cuBLASLt ceiling, 8192^3 block-scaled fp8 | %.0f TF/s |\n", ceil_fp8_tf);
    if (wg_fp8)
        printf("| Tandem's wgmma FP8 kernel (TANDEM_FP8_GEMM=wgmma), 8192^3 block-scaled fp8 | %.0f TF/s |\n",
               wg_fp8_tf);
    printf("| GEMM-only bound at the ceiling, bf16 | %.0f ms = %.0f tok/s |\n", bound_bf16_ms, T / bound_bf16_ms * 1e3);
    printf("| GEMM-only bound at the ceilings, fp8 (the faster fp8 of the two; in_proj_a/b bf16) | %.0f ms = %.0f "
           "tok/s |\n", bound_fp8_ms,
           T / bound_fp8_ms * 1e3);
    printf("| **forward / this precision's bound** | **%.0f %%** |\n", 100 * bound_ms / (fwd_s * 1e3));
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
    if (tm.expert_gemm_ms > 0)
        printf("| routed experts' GEMMs (%s) | %.1f ms per forward (%.0f %% of the timed "
               "forward; %.0f TF/s) |\n",
               tm.moe_grouped_layers == tm.moe_layers ? "grouped: one moe_gemm call for gate and up, one for down"
               : tm.moe_grouped_layers == 0           ? "one GEMM per expert over its tokens"
                                                      : "grouped in some layers, per expert in others",
               tm.expert_gemm_ms / nf, 100 * tm.expert_gemm_ms / tm.total_ms,
               2.0 * (double)T * p_experts / (tm.expert_gemm_ms / nf * 1e-3) / 1e12);
    printf("| elementwise per block (block − GEMMs − core) | GDN %.3f, attention %.3f, MLP %.3f ms |\n",
           (tm.gdn_ms - tm.gdn_gemm_ms - tm.gdn_core_ms) / tm.gdn_layers,
           (tm.attn_ms - tm.attn_gemm_ms - tm.attn_core_ms) / tm.attn_layers,
           (tm.mlp_ms - tm.mlp_gemm_ms) / tm.mlp_layers);
    printf("| elementwise per forward (sum of the above) | %.1f ms |\n",
           (tm.gdn_ms - tm.gdn_gemm_ms - tm.gdn_core_ms + tm.attn_ms - tm.attn_gemm_ms - tm.attn_core_ms +
            tm.mlp_ms - tm.mlp_gemm_ms) / nf);
    printf("| other (embedding, captures, uploads) | %.1f ms |\n", tm.other_ms / nf);
    printf("| chunked GDN kernel alone, 1 x %lld tokens | %.3f ms |\n", (long long)T, t_gdn[0] * 1e3);
    printf("| chunked GDN kernel alone, the mix | %.3f ms |\n", t_gdn[1] * 1e3);
    printf("| TANDEM_GDN_KERNEL=mma alone, 1 x %lld tokens / the mix | %.3f ms / %.3f ms |\n", (long long)T,
           t_gdn_mma[0] * 1e3, t_gdn_mma[1] * 1e3);
    printf("| flash attention kernel alone, 1 x %lld tokens | %.3f ms (%.0f TF/s) |\n", (long long)T,
           t_att[0] * 1e3, 4.0 * nq * hd * (double)T * (T + 1) / 2 / t_att[0] / 1e12);
    printf("| flash attention kernel alone, the mix | %.3f ms (%.0f TF/s) |\n", t_att[1] * 1e3,
           4.0 * nq * hd * att_pairs / t_att[1] / 1e12);
    for (int f = 0; f < 3; f++)
        printf("| TANDEM_ATTN_KERNEL=%s alone, 1 x %lld tokens / the mix "
               "| %.3f ms (%.0f TF/s) / %.3f ms (%.0f TF/s) |\n",
               att_forced[f], (long long)T, t_att_forced[f][0] * 1e3,
               4.0 * nq * hd * (double)T * (T + 1) / 2 / t_att_forced[f][0] / 1e12, t_att_forced[f][1] * 1e3,
               4.0 * nq * hd * att_pairs / t_att_forced[f][1] / 1e12);
    if (can_fuse) {
        printf("\n| op at the model's shapes, on the mix | unfused ms | fused ms | saved per forward |\n"
               "| --- | --- | --- | --- |\n");
        for (int i = 0; i < n_ew; i++)
            printf("| %s | %.3f | %.3f | %.1f ms (x %d) |\n", ew[i].name, t_ew[i][0] * 1e3, t_ew[i][1] * 1e3,
                   (t_ew[i][0] - t_ew[i][1]) * 1e3 * ew[i].per_layer, ew[i].per_layer);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f,
                    "{\"tokens\": %lld, \"n_seq\": %d, \"cold_load_s\": %.3f, \"cold_first_forward_s\": %.3f, "
                    "\"forward_ms\": %.3f, \"tokens_per_s\": %.1f, \"achieved_tflops\": %.1f, "
                    "\"ceiling_tflops\": %.1f, \"ceiling_fp8_tflops\": %.1f, \"wgmma_fp8_tflops\": %.1f, "
                    "\"precision\": \"%s\", "
                    "\"bound_bf16_ms\": %.3f, \"bound_fp8_ms\": %.3f, \"gemm_ms\": %.3f, \"timed_forward_ms\": %.3f, "
                    "\"gdn_block_ms\": %.4f, \"gdn_core_ms\": %.4f, \"attn_block_ms\": %.4f, "
                    "\"attn_core_ms\": %.4f, \"mlp_block_ms\": %.4f, \"gdn_kernel_single_ms\": %.4f, "
                    "\"gdn_kernel_mix_ms\": %.4f, \"attn_kernel_single_ms\": %.4f, \"attn_kernel_mix_ms\": %.4f, "
                    "\"fused\": %d, \"gdn_gemm_ms\": %.4f, \"attn_gemm_ms\": %.4f, \"mlp_gemm_ms\": %.4f, "
                    "\"expert_gemm_ms_per_forward\": %.4f, \"cu_seqlens\": [",
                    (long long)T, n_seq, t_loaded - t_start, t_first - t_start, fwd_s * 1e3, tok_s,
                    (flops_gemm + flops_attn) / fwd_s / 1e12, ceil_tf, ceil_fp8_tf, wg_fp8_tf, fp8 ? "fp8" : "bf16",
                    bound_bf16_ms,
                    bound_fp8_ms, gemm_ms, timed_ms, tm.gdn_ms / tm.gdn_layers,
                    tm.gdn_core_ms / tm.gdn_layers, tm.attn_ms / tm.attn_layers, tm.attn_core_ms / tm.attn_layers,
                    tm.mlp_ms / tm.mlp_layers, t_gdn[0] * 1e3, t_gdn[1] * 1e3, t_att[0] * 1e3, t_att[1] * 1e3,
                    ts_model_fused(m), tm.gdn_gemm_ms / tm.gdn_layers, tm.attn_gemm_ms / tm.attn_layers,
                    tm.mlp_gemm_ms / tm.mlp_layers, tm.expert_gemm_ms / nf);
            for (int s = 0; s <= n_seq; s++) fprintf(f, "%s%d", s ? ", " : "", cu[s]);
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    /* the process exits here: the driver frees device memory */
    return 0;
}
