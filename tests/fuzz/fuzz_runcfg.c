/* tests/fuzz/fuzz_runcfg.c — libFuzzer target: a `drafter-trainer train --run-config FILE.json`
 * file through dt_runcfg_expand with train's flag table, as the command line sees it (the file's
 * flags, then the command line's). For a file that loads: the argv ends with the command line's
 * flags, every entry is a string, and every flag is a known one spelled "--name". */
#include <string.h>

#include "dt_runcfg.h"
#include "fuzz_util.h"

static char path[300];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    snprintf(path, sizeof path, "%s/run.json", fuzz_dir());
    return 0;
}

static int known(const dt_runcfg_flag *flags, int n, const char *arg) {
    if (strncmp(arg, "--", 2) != 0)
        return 0;
    for (int i = 0; i < n; i++)
        if (strcmp(arg + 2, flags[i].name) == 0)
            return 1;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write(path, data, size);
    int                   n_flags;
    const dt_runcfg_flag *flags = dt_runcfg_train_flags(&n_flags);
    char                 *cmdline[] = {"--run-config", path, "--epochs", "2", NULL};
    dt_runcfg_argv        a = {0, NULL};
    if (fuzz_note(dt_runcfg_expand(&a, flags, n_flags, 4, cmdline)) != CM_OK)
        return 0;
    FUZZ_CHECK(a.argc >= 2 && a.argv[a.argc] == NULL);
    FUZZ_CHECK(strcmp(a.argv[a.argc - 2], "--epochs") == 0 && strcmp(a.argv[a.argc - 1], "2") == 0);
    for (int i = 0; i < a.argc; i++) {
        FUZZ_CHECK(a.argv[i] != NULL);
        (void)strlen(a.argv[i]);
    }
    // the file's part: flags, each bare (a bool) or followed by its value
    for (int i = 0; i < a.argc - 2; i++) {
        FUZZ_CHECK(known(flags, n_flags, a.argv[i]));
        if (i + 1 < a.argc - 2 && !known(flags, n_flags, a.argv[i + 1]))
            i++;
    }
    dt_runcfg_argv_release(&a);
    return 0;
}
