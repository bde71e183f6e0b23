/* target-server/cmd/ts_cmd_args.c — the flags dump and serve share (ts_cmd.h). */
#include "ts_cmd.h"

int ts_args_target(cm_args *p, ts_target_args *t) {
    static const char *const  inits[] = {"checkpoint", "random", NULL};
    static const char *const  precisions[] = {"bf16", "fp32", NULL};
    static const kn_gemm_mode modes[] = {KN_GEMM_MODE_BF16, KN_GEMM_MODE_F32};
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
        if (!p->bad)
            t->mode = modes[k];
        return 1;
    }
    return 0;
}
