/* tests/bench_dt_step.c — one whole drafter training step on cuda at a real shape (not a
 * test; bench/drafter_bench.sh runs it): dt_model_step (forward, chunked LM-head loss,
 * backward) plus dt_optim_step (grad-norm clip + AdamW), with random weights filled on the
 * device, a random frozen embedding and a separate LM head of the target's size, and one
 * random packed batch (T tokens in equal documents, loss_mask 1 everywhere, anchors drawn by
 * dt_anchor_sample as train does) whose hidden states are BF16 taps already in GPU memory, as
 * the NCCL data path delivers them (--host-taps: F32 on the host, uploaded every step, as the
 * ZeroMQ and shard paths do, from page-locked memory as the trainer's batch buffers are;
 * --pageable: from ordinary memory). Prints one JSON line: median and mean step seconds, the
 * step's FLOPs counted as dt_plan does (drafter-trainer/cmd/dt_plan.h) and the TF/s they give,
 * and device memory in use after the steps (cudaMemGetInfo: everything the process holds).
 * --layout FILE writes the batch layout (input_ids, cu_seqlens, loss_mask, anchors) so the
 * PyTorch reference (bench/drafter_flex.py) trains on the same rows. --profile times every
 * backend entry with a synchronise around it (slower; a separate run) and prints where the
 * time goes. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "dt_anchor.h"
#include "dt_model.h"
#include "dt_optim.h"
#include "dt_plan.h"
#include "kn_backend.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define DIE(st)                                                                                              \
    do {                                                                                                     \
        if ((st) != CM_OK) {                                                                                 \
            fprintf(stderr, "bench_dt_step: %s: %s (line %d)\n", cm_status_str(st), cm_last_error(),         \
                    __LINE__);                                                                               \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

// ---- --profile: the cuda table with every entry timed between two synchronises

enum {
    P_GEMM,
    P_GEMM_DX,
    P_GEMM_DW,
    P_ATTN_FWD,
    P_ATTN_BWD,
    P_LM_CE,
    P_NORM,
    P_ROPE,
    P_HEAD,
    P_SWIGLU,
    P_ELEM,
    P_OPTIM,
    P_DYNCONV,
    P_SEL,
    P_COUNT
};
static const char *const p_name[P_COUNT] = {"gemm (fwd)",
                                            "gemm_dx",
                                            "gemm_dw",
                                            "dflash_attn_fwd",
                                            "dflash_attn_bwd",
                                            "lm_ce (fused)",
                                            "rmsnorm fwd+bwd",
                                            "rope fwd+bwd",
                                            "q/k norm+rope fused",
                                            "swiglu fwd+bwd",
                                            "copies/casts/gathers",
                                            "sumsq+adamw",
                                            "dynconv fwd+bwd (DFlash2)",
                                            "selector fwd+bwd (DFlash2)"};
static double            p_sec[P_COUNT], p_flop[P_COUNT];
static long              p_calls[P_COUNT];
static const kn_backend *cuda;
static kn_backend        prof;

#define PROF(cat, flops, call)                                                                               \
    do {                                                                                                     \
        cuda->sync(ctx);                                                                                     \
        double    t0_ = now_s();                                                                             \
        cm_status st_ = (call);                                                                              \
        cuda->sync(ctx);                                                                                     \
        p_sec[cat] += now_s() - t0_;                                                                         \
        p_flop[cat] += (flops);                                                                              \
        p_calls[cat]++;                                                                                      \
        return st_;                                                                                          \
    } while (0)

static cm_status w_gemm(kn_ctx *ctx, float *o, const float *i, const void *w, cm_dtype d, int64_t M,
                        int64_t N, int64_t K) {
    PROF(P_GEMM, 2.0 * M * N * K, cuda->gemm(ctx, o, i, w, d, M, N, K));
}
static cm_status w_gemm_dx(kn_ctx *ctx, float *o, const float *i, const void *w, cm_dtype d, int64_t M,
                           int64_t N, int64_t K, int acc) {
    PROF(P_GEMM_DX, 2.0 * M * N * K, cuda->gemm_dx(ctx, o, i, w, d, M, N, K, acc));
}
static cm_status w_gemm_dw(kn_ctx *ctx, float *dw, const float *d, const float *i, int64_t M, int64_t N,
                           int64_t K) {
    PROF(P_GEMM_DW, 2.0 * M * N * K, cuda->gemm_dw(ctx, dw, d, i, M, N, K));
}
static cm_status w_attn_fwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    PROF(P_ATTN_FWD, 0, cuda->dflash_attn_fwd(ctx, p));
}
static cm_status w_attn_bwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    PROF(P_ATTN_BWD, 0, cuda->dflash_attn_bwd(ctx, p));
}
static cm_status w_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *am, const float *h, const int32_t *l,
                         const float *g, const void *w, cm_dtype wdt, int64_t R, int64_t V, int64_t D) {
    PROF(P_LM_CE, (dh ? 4.0 : 2.0) * R * V * D, cuda->lm_ce(ctx, dh, ce, am, h, l, g, w, wdt, R, V, D));
}
static cm_status w_lm_ce_topk(kn_ctx *ctx, const kn_lm_topk_params *p) {
    PROF(P_LM_CE, (p->dh ? 4.0 : 2.0) * p->R * p->V * p->D, cuda->lm_ce_topk(ctx, p));
}
static cm_status w_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    PROF(P_DYNCONV, 0, cuda->dynconv_fwd(ctx, p));
}
static cm_status w_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    PROF(P_DYNCONV, 0, cuda->dynconv_bwd(ctx, p));
}
static cm_status w_selector_fwd(kn_ctx *ctx, const kn_selector_params *p) {
    PROF(P_SEL, 0, cuda->selector_fwd(ctx, p));
}
static cm_status w_selector_bwd(kn_ctx *ctx, const kn_selector_params *p) {
    PROF(P_SEL, 0, cuda->selector_bwd(ctx, p));
}
static cm_status w_rmsnorm(kn_ctx *ctx, float *o, const float *i, const float *w, int64_t r, int64_t C,
                           float e, int op) {
    PROF(P_NORM, 0, cuda->rmsnorm(ctx, o, i, w, r, C, e, op));
}
static cm_status w_rmsnorm_bwd(kn_ctx *ctx, float *di, float *dw, const float *d, const float *i,
                               const float *w, int64_t r, int64_t C, float e, int op) {
    PROF(P_NORM, 0, cuda->rmsnorm_bwd(ctx, di, dw, d, i, w, r, C, e, op));
}
static cm_status w_rmsnorm_bwd_acc(kn_ctx *ctx, float *di, float *dw, const float *d, const float *i,
                                   const float *w, int64_t r, int64_t C, float e, int op) {
    PROF(P_NORM, 0, cuda->rmsnorm_bwd_acc(ctx, di, dw, d, i, w, r, C, e, op));
}
static cm_status w_rmsnorm_typed(kn_ctx *ctx, const kn_norm_typed_params *p) {
    PROF(P_NORM, 0, cuda->rmsnorm_typed(ctx, p));
}
static cm_status w_rmsnorm_bwd_typed(kn_ctx *ctx, const kn_norm_bwd_typed_params *p) {
    PROF(P_NORM, 0, cuda->rmsnorm_bwd_typed(ctx, p));
}
static cm_status w_head_norm_rope(kn_ctx *ctx, void *o, cm_dtype od, const void *x, cm_dtype xd,
                                  const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rd,
                                  float th, float e) {
    PROF(P_HEAD, 0, cuda->head_norm_rope(ctx, o, od, x, xd, w, pos, T, nh, hd, rd, th, e));
}
static cm_status w_head_norm_rope_bwd(kn_ctx *ctx, void *di, cm_dtype dd, float *dw, float *d, const void *x,
                                      cm_dtype xd, const float *w, const int32_t *pos, int64_t T, int nh,
                                      int hd, int rd, float th, float e) {
    PROF(P_HEAD, 0, cuda->head_norm_rope_bwd(ctx, di, dd, dw, d, x, xd, w, pos, T, nh, hd, rd, th, e));
}
static cm_status w_rope(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int nh, int hd, int rd,
                        float th) {
    PROF(P_ROPE, 0, cuda->rope(ctx, x, pos, T, nh, hd, rd, th));
}
static cm_status w_rope_bwd(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int nh, int hd, int rd,
                            float th) {
    PROF(P_ROPE, 0, cuda->rope_bwd(ctx, x, pos, T, nh, hd, rd, th));
}
static cm_status w_swiglu(kn_ctx *ctx, float *o, const float *g, const float *u, int64_t n) {
    PROF(P_SWIGLU, 0, cuda->swiglu(ctx, o, g, u, n));
}
static cm_status w_swiglu_bwd(kn_ctx *ctx, float *dg, float *du, const float *d, const float *g,
                              const float *u, int64_t n) {
    PROF(P_SWIGLU, 0, cuda->swiglu_bwd(ctx, dg, du, d, g, u, n));
}
static cm_status w_add(kn_ctx *ctx, float *x, const float *y, int64_t n) {
    PROF(P_ELEM, 0, cuda->add(ctx, x, y, n));
}
static cm_status w_copy2d(kn_ctx *ctx, float *d, int64_t dl, const float *s, int64_t sl, int64_t r,
                          int64_t c) {
    PROF(P_ELEM, 0, cuda->copy2d(ctx, d, dl, s, sl, r, c));
}
static cm_status w_embed(kn_ctx *ctx, float *o, const int32_t *ids, const void *t, cm_dtype td, int64_t T,
                         int64_t C) {
    PROF(P_ELEM, 0, cuda->embed(ctx, o, ids, t, td, T, C));
}
static cm_status w_zero(kn_ctx *ctx, void *p, size_t b) {
    PROF(P_ELEM, 0, cuda->zero(ctx, p, b));
}
static cm_status w_sumsq(kn_ctx *ctx, double *o, const float *x, int64_t n) {
    PROF(P_OPTIM, 0, cuda->sumsq(ctx, o, x, n));
}
static cm_status w_adamw(kn_ctx *ctx, float *p, const float *g, float *m, float *v, int64_t n,
                         const kn_adamw_params *a) {
    PROF(P_OPTIM, 0, cuda->adamw(ctx, p, g, m, v, n, a));
}

/* matmul by its role: dw has A transposed, the forward B transposed, dx neither */
static cm_status w_matmul(kn_ctx *ctx, const kn_matmul_params *p) {
    const int cat = p->trans_a ? P_GEMM_DW : p->trans_b ? P_GEMM : P_GEMM_DX;
    PROF(cat, 2.0 * p->M * p->N * p->K, cuda->matmul(ctx, p));
}
static cm_status w_cast2d(kn_ctx *ctx, void *d, cm_dtype dd, int64_t dl, const void *s, cm_dtype sd, int64_t sl,
                          int64_t r, int64_t c) {
    PROF(P_ELEM, 0, cuda->cast2d(ctx, d, dd, dl, s, sd, sl, r, c));
}
static cm_status w_swiglu_typed(kn_ctx *ctx, void *o, cm_dtype od, const void *g, const void *u, cm_dtype id,
                                int64_t n) {
    PROF(P_SWIGLU, 0, cuda->swiglu_typed(ctx, o, od, g, u, id, n));
}
static cm_status w_swiglu_bwd_typed(kn_ctx *ctx, void *dg, void *du, const void *d, const void *g, const void *u,
                                    cm_dtype dt, int64_t n) {
    PROF(P_SWIGLU, 0, cuda->swiglu_bwd_typed(ctx, dg, du, d, g, u, dt, n));
}
static cm_status w_swiglu_fwd_bwd_typed(kn_ctx *ctx, void *h, void *dg, void *du, const void *d,
                                        const void *g, const void *u, cm_dtype dt, int64_t n) {
    PROF(P_SWIGLU, 0, cuda->swiglu_fwd_bwd_typed(ctx, h, dg, du, d, g, u, dt, n));
}
static cm_status w_sumsq_multi(kn_ctx *ctx, double *o, const kn_mt_tensor *t, int n, int64_t c) {
    PROF(P_OPTIM, 0, cuda->sumsq_multi(ctx, o, t, n, c));
}
static cm_status w_adamw_multi(kn_ctx *ctx, const kn_mt_tensor *t, int n, int64_t c, const kn_adamw_params *p,
                               const double *s, double clip) {
    PROF(P_OPTIM, 0, cuda->adamw_multi(ctx, t, n, c, p, s, clip));
}

static const kn_backend *profiled(void) {
    prof = *cuda;
    prof.gemm = w_gemm;
    prof.gemm_dx = w_gemm_dx;
    prof.gemm_dw = w_gemm_dw;
    prof.dflash_attn_fwd = w_attn_fwd;
    prof.dflash_attn_bwd = w_attn_bwd;
    prof.lm_ce = w_lm_ce;
    prof.lm_ce_topk = cuda->lm_ce_topk ? w_lm_ce_topk : NULL;
    prof.dynconv_fwd = cuda->dynconv_fwd ? w_dynconv_fwd : NULL;
    prof.dynconv_bwd = cuda->dynconv_bwd ? w_dynconv_bwd : NULL;
    prof.selector_fwd = cuda->selector_fwd ? w_selector_fwd : NULL;
    prof.selector_bwd = cuda->selector_bwd ? w_selector_bwd : NULL;
    prof.rmsnorm = w_rmsnorm;
    prof.rmsnorm_bwd = w_rmsnorm_bwd;
    prof.rope = w_rope;
    prof.rope_bwd = w_rope_bwd;
    prof.swiglu = w_swiglu;
    prof.swiglu_bwd = w_swiglu_bwd;
    prof.add = w_add;
    prof.copy2d = w_copy2d;
    prof.zero = w_zero;
    prof.embed = w_embed;
    prof.sumsq = w_sumsq;
    prof.adamw = w_adamw;
    if (cuda->matmul)
        prof.matmul = w_matmul;
    if (cuda->cast2d)
        prof.cast2d = w_cast2d;
    if (cuda->swiglu_typed)
        prof.swiglu_typed = w_swiglu_typed;
    if (cuda->swiglu_bwd_typed)
        prof.swiglu_bwd_typed = w_swiglu_bwd_typed;
    if (cuda->swiglu_fwd_bwd_typed)
        prof.swiglu_fwd_bwd_typed = w_swiglu_fwd_bwd_typed;
    if (cuda->rmsnorm_bwd_acc)
        prof.rmsnorm_bwd_acc = w_rmsnorm_bwd_acc;
    if (cuda->rmsnorm_typed)
        prof.rmsnorm_typed = w_rmsnorm_typed;
    if (cuda->rmsnorm_bwd_typed)
        prof.rmsnorm_bwd_typed = w_rmsnorm_bwd_typed;
    if (cuda->head_norm_rope)
        prof.head_norm_rope = w_head_norm_rope;
    if (cuda->head_norm_rope_bwd)
        prof.head_norm_rope_bwd = w_head_norm_rope_bwd;
    if (cuda->sumsq_multi)
        prof.sumsq_multi = w_sumsq_multi;
    if (cuda->adamw_multi)
        prof.adamw_multi = w_adamw_multi;
    return &prof;
}

// ---- main

static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const char *dcfg = NULL, *tcfg = NULL, *layout = NULL, *precision = "bf16";
    int         steps = 5, warmup = 2, gpu = 0, docs = 4, profile = 0, host_taps = 0, pageable = 0;
    int         optim_copies = 1;
    int64_t     T = 8192, A = 512;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(f, "--profile") || !strcmp(f, "--host-taps") || !strcmp(f, "--pageable")) {
            profile |= !strcmp(f, "--profile");
            host_taps |= !strcmp(f, "--host-taps");
            pageable |= !strcmp(f, "--pageable");
            continue;
        }
        i++;
        if (!strcmp(f, "--drafter-config"))
            dcfg = v;
        else if (!strcmp(f, "--target-config"))
            tcfg = v;
        else if (!strcmp(f, "--layout"))
            layout = v;
        else if (!strcmp(f, "--precision"))
            precision = v;
        else if (!strcmp(f, "--steps"))
            steps = atoi(v);
        else if (!strcmp(f, "--warmup"))
            warmup = atoi(v);
        else if (!strcmp(f, "--gpu"))
            gpu = atoi(v);
        else if (!strcmp(f, "--tokens"))
            T = atoll(v);
        else if (!strcmp(f, "--docs"))
            docs = atoi(v);
        else if (!strcmp(f, "--anchors"))
            A = atoll(v);
        else if (!strcmp(f, "--optim-copies"))
            optim_copies = atoi(v);
        else {
            fprintf(stderr, "usage: bench_dt_step --drafter-config F --target-config F [--precision "
                            "bf16|fp32] [--steps N]\n"
                            "       [--warmup N] [--gpu N] [--tokens T] [--docs N] [--anchors A] [--layout "
                            "OUT] [--profile]\n"
                            "       [--host-taps [--pageable]] [--optim-copies 0|1]\n");
            return 2;
        }
    }
    if (!dcfg || !tcfg || steps < 1 || docs < 1 || T % docs != 0) {
        fprintf(stderr,
                "bench_dt_step: need --drafter-config and --target-config, steps >= 1, docs dividing T\n");
        return 2;
    }
    cm_drafter_cfg d;
    cm_target_cfg  t;
    DIE(cm_drafter_cfg_load(&d, dcfg));
    DIE(cm_target_cfg_load(&t, tcfg));
    const int64_t D = d.hidden_size, V = d.vocab_size, nD = (int64_t)d.n_taps * D;

    cuda = kn_backend_cuda();
    if (!cuda) {
        fprintf(stderr, "bench_dt_step: this build has no cuda backend\n");
        return 77;
    }
    kn_ctx       *ctx = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.device = gpu;
    kc.gemm_mode = strcmp(precision, "fp32") == 0 ? KN_GEMM_MODE_F32 : KN_GEMM_MODE_BF16;
    DIE(cuda->ctx_create(&ctx, &kc));
    size_t free0, total;
    cudaMemGetInfo(&free0, &total);
    const kn_backend *be = profile ? profiled() : cuda;

    double    t0 = now_s();
    dt_model *m = NULL;
    DIE(dt_model_create(&m, &d, be, ctx));
    for (int i = 0; i < dt_model_n_params(m); i++) { /* HF init scale: std 0.02 = uniform ±0.02·√3 */
        const dt_param *p = dt_model_param(m, i);
        const float     a = p->n_dims == 2 ? 0.02f * sqrtf(3.0f) : 1.0f, lo = p->n_dims == 2 ? -a : 1.0f;
        DIE(cuda->fill_uniform(ctx, p->data, CM_DTYPE_F32, p->numel, 1000 + (uint64_t)i, lo, a));
    }
    /* embedding rows 0..V-1 and LM head rows 1..V of one host array: two distinct matrices */
    uint16_t *frozen = malloc((size_t)(V + 1) * (size_t)D * sizeof *frozen);
    float    *F = host_taps ? malloc((size_t)T * (size_t)nD * sizeof *F) : malloc(sizeof *F);
    int32_t  *ids = malloc((size_t)T * 4), *mask = malloc((size_t)T * 4), *work = malloc((size_t)T * 4),
            *anchors = malloc((size_t)T * 4), *cu = malloc((size_t)(docs + 1) * 4);
    if (!frozen || !F || !ids || !mask || !work || !anchors || !cu) {
        fprintf(stderr, "bench_dt_step: out of host memory\n");
        return 1;
    }
    uint64_t s = 7;
    for (size_t i = 0; i < (size_t)(V + 1) * (size_t)D; i += 4) { /* bf16 of ±0.02-ish values */
        uint64_t r = mix(&s);
        for (int k = 0; k < 4 && i + k < (size_t)(V + 1) * (size_t)D; k++)
            frozen[i + k] = (uint16_t)(0x3c00 | ((r >> (16 * k)) & 0x7f) | ((r >> (16 * k + 7)) & 1) << 15);
    }
    for (size_t i = 0; host_taps && i < (size_t)T * (size_t)nD; i++)
        F[i] = (float)((int64_t)(mix(&s) >> 40) - (1 << 23)) / (float)(1 << 23);
    /* host taps page-locked as the trainer's batch buffers are (--pageable: as before) */
    const int pinned = host_taps && !pageable;
    if (pinned)
        DIE(cuda->host_pin(ctx, F, (size_t)T * (size_t)nD * sizeof *F));
    void *taps[DT_MAX_TAPS] = {0};
    for (int k = 0; !host_taps && k < d.n_taps; k++) {
        DIE(cuda->alloc(ctx, &taps[k], (size_t)T * (size_t)D * 2));
        DIE(cuda->fill_uniform(ctx, taps[k], CM_DTYPE_BF16, T * D, 500 + (uint64_t)k, -1.0f, 1.0f));
    }
    for (int64_t i = 0; i < T; i++) {
        ids[i] = (int32_t)(mix(&s) % (uint64_t)V);
        mask[i] = 1;
    }
    for (int k = 0; k <= docs; k++)
        cu[k] = (int32_t)(T / docs * k);
    DIE(dt_model_set_frozen(m, frozen, CM_DTYPE_BF16, frozen + D, CM_DTYPE_BF16, V, D));
    free(frozen);
    int64_t n_anchors = 0;
    DIE(dt_anchor_sample(cu, docs, mask, T, A, 0, 0, 0, work, anchors, &n_anchors));
    if (layout) {
        cm_st_writer *w = NULL;
        int64_t       sT[1] = {T}, sC[1] = {docs + 1}, sA[1] = {n_anchors};
        DIE(cm_st_writer_create(&w));
        DIE(cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, sT, ids));
        DIE(cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, sC, cu));
        DIE(cm_st_writer_add(w, "loss_mask", CM_DTYPE_I32, 1, sT, mask));
        DIE(cm_st_writer_add(w, "anchors", CM_DTYPE_I32, 1, sA, anchors));
        DIE(cm_st_writer_write(w, layout));
        cm_st_writer_destroy(&w);
    }
    const int        np = dt_model_n_params(m);
    const dt_param **params = malloc((size_t)np * sizeof *params);
    for (int i = 0; i < np; i++)
        params[i] = dt_model_param(m, i);
    dt_optim       *o = NULL;
    dt_optim_config oc = DT_OPTIM_CONFIG_DEFAULT;
    oc.total_steps = 1000000;
    DIE(dt_optim_create(&o, be, ctx, params, np, &oc));
    if (optim_copies) /* as drafter-trainer runs: AdamW writes the next step's bf16 weights */
        DIE(dt_optim_copies_of_model(o, m));
    const double setup_s = now_s() - t0;

    dt_batch b = {.T = T,
                  .n_seq = docs,
                  .cu_seqlens = cu,
                  .input_ids = ids,
                  .loss_mask = mask,
                  .target_hidden = host_taps ? F : NULL,
                  .n_anchors = n_anchors,
                  .anchors = anchors,
                  .taps_dt = CM_DTYPE_BF16};
    for (int k = 0; k < d.n_taps; k++)
        b.dev_taps[k] = taps[k];
    double *sec = calloc((size_t)steps, sizeof *sec);
    double  loss0 = 0, loss1 = 0;
    for (int i = 0; i < warmup + steps; i++) {
        if (i == warmup)
            memset(p_sec, 0, sizeof p_sec), memset(p_flop, 0, sizeof p_flop),
                memset(p_calls, 0, sizeof p_calls);
        dt_step_stats ss;
        double        a0 = now_s();
        DIE(dt_model_step(m, &b, 7.0f, &ss));
        dt_optim_stats os;
        DIE(dt_optim_step(o, &os));
        if (os.copies)
            dt_model_w16_written(m);
        DIE(cuda->sync(ctx));
        if (i >= warmup)
            sec[i - warmup] = now_s() - a0;
        if (i == 0)
            loss0 = ss.loss;
        loss1 = ss.loss;
    }
    size_t free1;
    cudaMemGetInfo(&free1, &total);
    double mean = 0;
    for (int i = 0; i < steps; i++)
        mean += sec[i] / steps;
    qsort(sec, (size_t)steps, sizeof *sec, cmp_d);
    const double med = sec[steps / 2];

    dt_plan_run pr = DT_PLAN_RUN_DEFAULT;
    pr.token_budget = T;
    pr.max_anchors = A;
    pr.seq_len = T / docs;
    dt_plan pl;
    DIE(dt_plan_compute(&pl, &t, &d, &pr));
    printf("{\"impl\": \"tandem\", \"precision\": \"%s\", \"host_taps\": %d, \"pinned\": %d, "
           "\"optim_copies\": %d, \"profile\": %d, \"tokens\": "
           "%lld, \"docs\": %d, "
           "\"anchors\": %lld, \"block\": %d, \"steps\": %d, \"step_s_median\": %.6f, \"step_s_mean\": %.6f, "
           "\"step_s_min\": %.6f, \"step_s_max\": %.6f, \"tflop_per_step\": %.3f, \"tflop_attn\": %.3f, "
           "\"tflop_lm\": %.3f, \"tflops\": %.1f, \"mem_used_gb\": %.3f, \"ctx_gb\": %.3f, \"params\": %lld, "
           "\"act_gb\": %.3f, \"act_dtype\": \"%s\", \"plan_act_gb\": %.3f, "
           "\"loss_first\": %.6f, \"loss_last\": %.6f, \"setup_s\": %.1f}\n",
           precision, host_taps, pinned, optim_copies, profile, (long long)T, docs, (long long)n_anchors,
           d.block_size, steps, med, mean, sec[0], sec[steps - 1], pl.f_step / 1e12, pl.f_step_attn / 1e12,
           pl.f_step_lm / 1e12, pl.f_step / med / 1e12, (double)(total - free1) / 1e9,
           (double)(total - free0) / 1e9, (long long)pl.p_drafter, (double)dt_model_act_bytes(m) / 1e9,
           cm_dtype_name(dt_model_act_dtype(m)), (pl.m_act + pl.m_act_transient) / 1e9, loss0, loss1,
           setup_s);
    if (profile) {
        double all = 0;
        for (int c = 0; c < P_COUNT; c++)
            all += p_sec[c];
        fprintf(stdout, "profile (per step, each entry between two synchronises; %d steps):\n", steps);
        for (int c = 0; c < P_COUNT; c++) {
            fprintf(stdout, "  %-20s %9.2f ms  %5.1f %%  %6ld calls", p_name[c], 1e3 * p_sec[c] / steps,
                    100 * p_sec[c] / all, p_calls[c] / steps);
            if (p_flop[c] > 0)
                fprintf(stdout, "  %7.1f TF/s", p_flop[c] / p_sec[c] / 1e12);
            fputc('\n', stdout);
        }
        fprintf(stdout, "  sum %.2f ms per step\n", 1e3 * all / steps);
    }
    fflush(stdout);
    free(sec);
    free(params);
    dt_optim_destroy(&o);
    dt_model_destroy(&m);
    for (int k = 0; k < DT_MAX_TAPS; k++)
        cuda->free(ctx, taps[k]);
    if (pinned)
        cuda->host_unpin(ctx, F);
    cuda->ctx_destroy(&ctx);
    free(F);
    free(ids);
    free(mask);
    free(work);
    free(anchors);
    free(cu);
    return 0;
}
