/* target-server/cmd/ts_cmd.h — the target-server's commands (dump, serve, status, generate): each turns
 * its options into arguments with the shared parser (cm_args.h) and runs the model code below
 * (ts_model.h, ts_serve.h). Each returns the exit status: 0 (done, or --help), 1 for a failure
 * (one message on stderr), 2 for a usage error. */
#ifndef TS_CMD_H
#define TS_CMD_H

#include <stdint.h>
#include <stdio.h>

#include "cm_args.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What dump and serve both take to build the target (the command's argument struct holds one). */
typedef struct ts_target_args {
    const char  *model;       /* --model DIR, or --config FILE (for --init random) */
    const char  *device;      /* --device cpu|cuda */
    int          init_random; /* --init checkpoint|random */
    uint64_t     seed;        /* --seed N (of --init random) */
    kn_gemm_mode mode;        /* --precision bf16|fp32|fp8: the GEMM mode (fp8: KN_GEMM_MODE_BF16) */
    int          fp8;         /* --precision fp8: FP8 weights (ts_model_config.fp8, docs/fp8.md) */
    int          precision;   /* 1 when --precision was given */
} ts_target_args;
#define TS_TARGET_ARGS_DEFAULT                                                                               \
    { NULL, "cpu", 0, 1, KN_GEMM_MODE_BF16, 0, 0 }

/* 1 when the current argument is one of ts_target_args' flags or --log-level (applied at
 * once); a bad value sets p->bad with the message printed. */
int ts_args_target(cm_args *p, ts_target_args *t);

/* After parsing: the precision the checkpoint gets when --precision was not given, from its
 * quantization_config (docs/fp8.md): fp8 for an FP8 checkpoint (unless it asks for
 * dequantize), else bf16; logged at info when the checkpoint is FP8. A quantization_config
 * Tandem does not read fails here, before anything loads. */
cm_status ts_args_precision(ts_target_args *t);
/* "bf16", "fp32" or "fp8". */
const char *ts_args_precision_name(const ts_target_args *t);

/* The contexts of a target split over stages (dump and generate --stages, --gpu): stage i on the
 * i-th entry of gpus ("N[,M...]", NULL = "0"), or every stage on its one entry; ctxs has room for
 * stages (≤ TS_SPLIT_MAX_STAGES) and starts zeroed. ts_args_stage_ctxs_free destroys what was
 * made, each with its device current. */
cm_status ts_args_stage_ctxs(const kn_backend *be, const char *gpus, int stages, kn_gemm_mode mode, kn_ctx **ctxs);
void      ts_args_stage_ctxs_free(const kn_backend *be, kn_ctx **ctxs, int stages);

/* The options after the command's name. */
int ts_dump_main(int argc, char **argv);   /* cmd/ts_dump.c */
int ts_serve_main(int argc, char **argv);  /* cmd/ts_serve_cmd.c */
int ts_status_main(int argc, char **argv); /* cmd/ts_status.c */
int ts_generate_main(int argc, char **argv); /* cmd/ts_generate.c */

/* The top-level usage with dump's options (cmd/ts_dump.c). */
void ts_dump_usage(FILE *f);

#ifdef __cplusplus
}
#endif
#endif /* TS_CMD_H */
