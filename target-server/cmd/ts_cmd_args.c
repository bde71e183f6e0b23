/* target-server/cmd/ts_cmd_args.c — the flags dump, serve and generate share (ts_cmd.h), the
 * default precision of a checkpoint (docs/fp8.md), and the contexts of a target over stages. */
#include "ts_cmd.h"

#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_quant.h"
#include "ts_split.h"

static cm_status precision_of_checkpoint(ts_target_args *t);

int ts_args_target(cm_args *p, ts_target_args *t) {
    static const char *const  inits[] = {"checkpoint", "random", NULL};
    static const char *const  precisions[] = {"bf16", "fp32", "fp8", NULL};
    static const kn_gemm_mode modes[] = {KN_GEMM_MODE_BF16, KN_GEMM_MODE_F32, KN_GEMM_MODE_BF16};
    int                       k = 0;
    if (cm_args_str(p, "--model", &t->model) || cm_args_str(p, "--config", &t->model) ||
        cm_args_str(p, "--device", &t->device) || cm_args_u64(p, "--seed", &t->seed) || cm_args_log_level(p))
        return 1;
    if (cm_args_choice(p, "--init", inits, &k)) {
        if (!p->bad)
            t->init_random = k == 1;
        return 1;
    }
    if (cm_args_choice(p, "--precision", precisions, &k)) {
        if (!p->bad) {
            t->mode = modes[k];
            t->fp8 = k == 2; /* FP8 GEMMs on a context in bf16 mode: the other products stay bf16 */
            t->precision = 1;
        }
        return 1;
    }
    return 0;
}

const char *ts_args_precision_name(const ts_target_args *t) {
    return t->fp8 ? "fp8" : t->mode == KN_GEMM_MODE_F32 ? "fp32" : "bf16";
}

/* TANDEM_FP8_REST=fp32 (a comparison aid, docs/fp8.md): under fp8 the products that are not FP8
 * run in fp32, as the cpu reference runs them, instead of bf16. */
static void fp8_rest(ts_target_args *t) {
    const char *e = getenv("TANDEM_FP8_REST");
    if (t->fp8 && e && strcmp(e, "fp32") == 0) {
        t->mode = KN_GEMM_MODE_F32;
        CM_LOG_WARN("TANDEM_FP8_REST=fp32: the FP8 projections' products are FP8, every other product fp32 (a "
                    "comparison aid, not a serving precision)");
    }
}

cm_status ts_args_precision(ts_target_args *t) {
    cm_status st = CM_OK;
    if (t->model) st = precision_of_checkpoint(t);
    fp8_rest(t);
    return st;
}

static cm_status precision_of_checkpoint(ts_target_args *t) {
    cm_quant_cfg q;
    CM_TRY(cm_quant_cfg_load(&q, t->model));
    const int fp8_ckpt = q.fp8, dequantize = q.dequantize;
    cm_quant_cfg_release(&q);
    if (!fp8_ckpt)
        return CM_OK;
    if (!t->precision && !dequantize) {
        t->fp8 = 1;
        t->mode = KN_GEMM_MODE_BF16;
        CM_LOG_INFO("'%s' is an FP8 checkpoint: precision fp8 (its default; --precision bf16 runs it dequantized)",
                    t->model);
    } else if (!t->fp8) {
        CM_LOG_INFO("'%s' is an FP8 checkpoint: its FP8 weights are dequantized on load, precision %s (%s)",
                    t->model, ts_args_precision_name(t),
                    t->precision ? "--precision" : "its quantization_config asks for dequantize");
    }
    return CM_OK;
}

/* --gpu "0" or "0,1,...": n ordinals into gpu[] (at most max). */
static cm_status parse_gpus(const char *s, int *gpu, int max, int *n) {
    *n = 0;
    for (const char *p = s; p && *p;) {
        char *end;
        long  v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > 1023 || (*end && *end != ',') || *n == max)
            return CM_FAIL(CM_ERR_INVALID_ARG, "--gpu '%s': expected up to %d device ordinals in [0, 1023], "
                           "comma-separated", s, max);
        gpu[(*n)++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) return CM_FAIL(CM_ERR_INVALID_ARG, "--gpu '%s' names no device", s);
    return CM_OK;
}

cm_status ts_args_stage_ctxs(const kn_backend *be, const char *gpus, int stages, kn_gemm_mode mode, kn_ctx **ctxs) {
    int gpu[TS_SPLIT_MAX_STAGES] = {0}, n_gpu = 1;
    if (gpus) CM_TRY(parse_gpus(gpus, gpu, TS_SPLIT_MAX_STAGES, &n_gpu));
    if (n_gpu > 1 && n_gpu != stages)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--gpu names %d devices for %d stages: give one, or one per stage", n_gpu,
                       stages);
    for (int i = 0; i < stages; i++) {
        kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
        kc.device        = gpu[n_gpu > 1 ? i : 0];
        kc.gemm_mode     = mode;
        CM_TRY(be->ctx_create(&ctxs[i], &kc));
    }
    return CM_OK;
}

void ts_args_stage_ctxs_free(const kn_backend *be, kn_ctx **ctxs, int stages) {
    for (int i = 0; i < stages; i++) {
        if (ctxs[i] && be->ctx_bind) be->ctx_bind(ctxs[i]); /* its device current while it goes */
        if (ctxs[i]) be->ctx_destroy(&ctxs[i]);
    }
}
