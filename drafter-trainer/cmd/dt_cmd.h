/* drafter-trainer/cmd/dt_cmd.h — the drafter-trainer subcommands; dt_main.c dispatches to them.
 * Each takes the arguments after its name and returns the process exit status: 0 success,
 * 1 failure (one message on stderr), 2 usage error. */
#ifndef DT_CMD_H
#define DT_CMD_H

#ifdef __cplusplus
extern "C" {
#endif

int dt_cmd_grad(int argc, char **argv);  /* dt_grad.c: docs/checks.md check interface */
int dt_cmd_train(int argc, char **argv); /* dt_train.c: training from batch files */
int dt_cmd_shards(int argc, char **argv); /* dt_shards.c: inspect and export shard directories */
int dt_cmd_precompute(int argc, char **argv); /* dt_precompute.c: token batches → target-server → shards */
int dt_cmd_dataset(int argc, char **argv);    /* dt_dataset_cli.c: convert and inspect tokenized datasets */
int dt_cmd_eval(int argc, char **argv);       /* dt_eval.c: speculative decoding against a target-server */

#ifdef __cplusplus
}
#endif
#endif /* DT_CMD_H */
