/* drafter-trainer/cmd/dt_main.c — the drafter-trainer command line: dispatch to subcommands. */
#include <stdio.h>
#include <string.h>

#include "dt_cmd.h"

static void usage(FILE *f) {
    fprintf(f, "usage: drafter-trainer <command> [options]\n"
               "\n"
               "commands:\n"
               "  train   train a DFlash drafter (see drafter-trainer train --help)\n"
               "  grad    loss and every gradient of one batch (see drafter-trainer grad --help)\n"
               "  shards  inspect or export offline hidden-state shards (see drafter-trainer shards --help)\n"
               "  precompute  store a target-server's hidden states in shards (see drafter-trainer precompute --help)\n"
               "  dataset convert|inspect  tokenized datasets of documents (see drafter-trainer dataset --help)\n"
               "  eval    speculative decoding with a drafter against a target-server (see drafter-trainer eval --help)\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "grad") == 0) return dt_cmd_grad(argc - 2, argv + 2);
    if (strcmp(argv[1], "train") == 0) return dt_cmd_train(argc - 2, argv + 2);
    if (strcmp(argv[1], "shards") == 0) return dt_cmd_shards(argc - 2, argv + 2);
    if (strcmp(argv[1], "precompute") == 0) return dt_cmd_precompute(argc - 2, argv + 2);
    if (strcmp(argv[1], "dataset") == 0) return dt_cmd_dataset(argc - 2, argv + 2);
    if (strcmp(argv[1], "eval") == 0) return dt_cmd_eval(argc - 2, argv + 2);
    fprintf(stderr, "drafter-trainer: unknown command '%s' (commands: train, grad, shards, precompute, dataset, eval; see --help)\n", argv[1]);
    return 2;
}
