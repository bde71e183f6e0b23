/* target-server/cmd/ts_cmd_args.c — the flags dump, serve and generate share (ts_cmd.h), and the
 * default precision of a checkpoint (docs/fp8.md). */
#include "ts_cmd.h"

#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_quant.h"

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
