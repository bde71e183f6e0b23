/* tests/test_dt_runcfg.c — run config files (drafter-trainer/cmd/dt_runcfg.h) written to a temporary
 * directory: every value kind (strings, numbers in their shortest exact form, bare flags
 * true/false, arrays joined by commas), relative paths resolved against the file's directory
 * (and left alone for absolute paths, non-path keys and a file in the working directory), the
 * command line placed after the file so it overrides it, and every refusal with its message:
 * unknown keys with the closest flag, wrong kinds, null, objects, nested and empty arrays,
 * duplicate keys, a nested run-config, a non-object, bad JSON, a missing file, --run-config
 * twice or without a value. Last, every flag `drafter-trainer train --help` lists must be in
 * dt_runcfg_train_flags (so a new train flag cannot be forgotten here). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dt_runcfg.h"
#include "tst.h"
#include "tst_proc.h"

static char                  tmp[256];
static int                   n_flags;
static const dt_runcfg_flag *flags;

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

/* argv joined by spaces, for comparing whole lists in one check. */
static const char *joined(const dt_runcfg_argv *a) {
    static char buf[8192];
    size_t      n = 0;
    buf[0] = '\0';
    for (int i = 0; i < a->argc; i++)
        n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%s", i ? " " : "", a->argv[i]);
    return buf;
}

#define CHECK_ARGV(a, want)                                                                                  \
    do {                                                                                                     \
        const char *g_ = joined(a);                                                                          \
        TST_CHECK(strcmp(g_, (want)) == 0 && (a)->argv[(a)->argc] == NULL);                                  \
        if (strcmp(g_, (want)) != 0)                                                                         \
            fprintf(stderr, "  got  '%s'\n  want '%s'\n", g_, (want));                                       \
    } while (0)

/* Loads JSON text from a fresh file; expects failure with status want and every word. */
static void refused(const char *json, cm_status want, const char *w1, const char *w2) {
    char path[300];
    snprintf(path, sizeof path, "%s/bad.json", tmp);
    write_file(path, json);
    dt_runcfg_argv a;
    cm_clear_error();
    cm_status st = dt_runcfg_load(&a, flags, n_flags, path);
    int       ok = st == want && strstr(cm_last_error(), "bad.json") && strstr(cm_last_error(), w1) &&
             (!w2 || strstr(cm_last_error(), w2));
    TST_CHECK(ok);
    if (!ok || getenv("TST_VERBOSE"))
        fprintf(stderr, "  %s -> %s: %s\n", json, cm_status_str(st), cm_last_error());
    if (st == CM_OK)
        dt_runcfg_argv_release(&a);
}

static void test_values(void) {
    char sub[300], path[400], want[4096];
    snprintf(sub, sizeof sub, "%s/sub", tmp);
    mkdir(sub, 0755);
    snprintf(path, sizeof path, "%s/run.json", sub);
    write_file(path, "{\"config\": \"drafter.json\", \"target\": \"/abs/target\", \"data\": [\"a.st\", "
                     "\"b/c.st\"], \"out\": \"runs/r1\", \"lr\": 6e-4, \"epochs\": 6, \"resume\": true, "
                     "\"seed\": 0, \"warmup-ratio\": 0.04, \"dry-run\": false, \"clip\": 0.3333333333333333, "
                     "\"timeout-ms\": 1e20, \"server\": \"ipc://rel.sock\", \"data-dir\": \"/\", "
                     "\"dataset\": \"p.jsonl,/q.jsonl\"}");
    dt_runcfg_argv a;
    TST_CHECK(dt_runcfg_load(&a, flags, n_flags, path) == CM_OK);
    snprintf(
        want, sizeof want,
        "--config %s/drafter.json --target /abs/target --data %s/a.st,%s/b/c.st --out %s/runs/r1 --lr 0.0006 "
        "--epochs 6 --resume --seed 0 --warmup-ratio 0.04 --clip 0.3333333333333333 --timeout-ms 1e+20 "
        "--server ipc://rel.sock --data-dir / --dataset %s/p.jsonl,/q.jsonl",
        sub, sub, sub, sub, sub);
    CHECK_ARGV(&a, want);
    dt_runcfg_argv_release(&a);
    TST_CHECK(a.argv == NULL && a.argc == 0);
    dt_runcfg_argv_release(&a);

    /* numbers: the shortest text that reads back exactly; a value list joined by commas */
    write_file(path,
               "{\"lr\": 1e-5, \"clip\": 123456789.5, \"seed\": -3, \"credits\": 0.1, \"encoding\": [1, "
               "\"x\", 2.5]}");
    TST_CHECK(dt_runcfg_load(&a, flags, n_flags, path) == CM_OK);
    CHECK_ARGV(&a, "--lr 1e-05 --clip 123456789.5 --seed -3 --credits 0.1 --encoding 1,x,2.5");
    dt_runcfg_argv_release(&a);

    /* a file in the working directory: relative paths stay relative to it */
    char cwd[4096];
    TST_CHECK(getcwd(cwd, sizeof cwd) != NULL);
    TST_CHECK(chdir(sub) == 0);
    write_file("local.json", "{\"out\": \"runs/r2\", \"data\": \"x.st,y.st\", \"dataset\": [\"d.jsonl\"]}");
    TST_CHECK(dt_runcfg_load(&a, flags, n_flags, "local.json") == CM_OK);
    CHECK_ARGV(&a, "--out runs/r2 --data x.st,y.st --dataset d.jsonl");
    dt_runcfg_argv_release(&a);
    TST_CHECK(chdir(cwd) == 0);

    /* an empty object is an empty argv */
    write_file(path, "{}");
    TST_CHECK(dt_runcfg_load(&a, flags, n_flags, path) == CM_OK);
    TST_CHECK(a.argc == 0 && a.argv && a.argv[0] == NULL);
    dt_runcfg_argv_release(&a);
}

static void test_expand(void) {
    char path[300], want[4096];
    snprintf(path, sizeof path, "%s/r.json", tmp);
    write_file(path, "{\"lr\": 0.001, \"epochs\": 2, \"out\": \"o\"}");
    char          *argv1[] = {"--lr", "1e-3", "--run-config", path, "--steps", "5", NULL};
    dt_runcfg_argv a;
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 6, argv1) == CM_OK);
    snprintf(want, sizeof want, "--lr 0.001 --epochs 2 --out %s/o --lr 1e-3 --steps 5", tmp);
    CHECK_ARGV(&a, want); /* the command line's --lr comes last, so it wins */
    dt_runcfg_argv_release(&a);

    char *argv2[] = {"--epochs", "3", "--resume", NULL};
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 3, argv2) == CM_OK);
    CHECK_ARGV(&a, "--epochs 3 --resume");
    dt_runcfg_argv_release(&a);
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 0, argv2) == CM_OK);
    TST_CHECK(a.argc == 0 && a.argv && a.argv[0] == NULL);
    dt_runcfg_argv_release(&a);

    char *argv3[] = {"--run-config", path, "--run-config", path, NULL};
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 4, argv3) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "--run-config is given twice") != NULL);
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 1, argv3) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "'--run-config' needs a value") != NULL);
    char missing[300];
    snprintf(missing, sizeof missing, "%s/none.json", tmp);
    char *argv4[] = {"--run-config", missing, NULL};
    TST_CHECK(dt_runcfg_expand(&a, flags, n_flags, 2, argv4) == CM_ERR_IO);
    TST_CHECK(strstr(cm_last_error(), "none.json") != NULL);
}

static void test_refusals(void) {
    refused("{\"epoch\": 6}", CM_ERR_INVALID_ARG, "unknown key 'epoch'", "closest is 'epochs'");
    refused("{\"max_anchors\": 6}", CM_ERR_INVALID_ARG, "unknown key 'max_anchors'",
            "closest is 'max-anchors'");
    refused("{\"--lr\": 6}", CM_ERR_INVALID_ARG, "unknown key '--lr'", "closest is 'lr'");
    refused("{\"resum\": true}", CM_ERR_INVALID_ARG, "without the dashes", "closest is 'resume'");
    refused("{\"resume\": \"yes\"}", CM_ERR_INVALID_ARG, "'resume' is a bare flag", "true (present)");
    refused("{\"lr\": true}", CM_ERR_INVALID_ARG, "'lr' takes a value", NULL);
    refused("{\"lr\": null}", CM_ERR_INVALID_ARG, "'lr' needs a string or a number, not null", NULL);
    refused("{\"lr\": {\"a\": 1}}", CM_ERR_INVALID_ARG, "not an object", NULL);
    refused("{\"data\": [[\"a\"]]}", CM_ERR_INVALID_ARG, "'data' needs a path", "nested array");
    refused("{\"data\": [\"a\", 3]}", CM_ERR_INVALID_ARG, "'data' needs a path (a string), not a number",
            NULL);
    refused("{\"out\": 5}", CM_ERR_INVALID_ARG, "'out' needs a path", NULL);
    refused("{\"out\": \"\"}", CM_ERR_INVALID_ARG, "'out' holds an empty path", NULL);
    refused("{\"dataset\": \"a,,b\"}", CM_ERR_INVALID_ARG, "'dataset' holds an empty path", NULL);
    refused("{\"data\": []}", CM_ERR_INVALID_ARG, "'data' is an empty array", NULL);
    refused("{\"out\": [\"a\", \"b\"]}", CM_ERR_INVALID_ARG, "'out' takes one path", NULL);
    refused("{\"lr\": 1, \"epochs\": 2, \"lr\": 3}", CM_ERR_INVALID_ARG, "'lr' appears twice", NULL);
    refused("{\"run-config\": \"x.json\"}", CM_ERR_INVALID_ARG, "cannot name another", NULL);
    refused("[1, 2]", CM_ERR_FORMAT, "must be a JSON object", NULL);
    refused("{\"lr\": }", CM_ERR_FORMAT, "not valid JSON", NULL);
    refused("{\"lr\": 1} trailing", CM_ERR_FORMAT, "not valid JSON", NULL);
    TST_CHECK(strcmp(dt_runcfg_closest(flags, n_flags, "warmup_ratio"), "warmup-ratio") == 0);
    TST_CHECK(strcmp(dt_runcfg_closest(flags, n_flags, "loss-decay-gama"), "loss-decay-gamma") == 0);
}

/* Every "--flag" at the start of a line of `drafter-trainer train --help` is a known key. */
static void test_help_in_sync(void) {
    const char *bin = TANDEM_BINARY_DIR "/drafter-trainer/drafter-trainer";
    if (access(bin, X_OK) != 0) {
        fprintf(stderr, "  %s is not built: the --help check is skipped\n", bin);
        return;
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "'%s' train --help", bin);
    FILE *p = popen(cmd, "r");
    TST_CHECK(p != NULL);
    if (!p)
        return;
    char line[1024];
    int  seen = 0;
    while (fgets(line, sizeof line, p)) {
        const char *s = line;
        while (*s == ' ')
            s++;
        if (strncmp(s, "--", 2) != 0)
            continue;
        /* the flag column ("--dp-rank R --dp-size W") ends where the description starts */
        for (const char *f = s; f && f < line + 27; f = strstr(f + 2, " --")) {
            f += f[0] == ' ';
            char name[64];
            if (sscanf(f + 2, "%63[a-z0-9-]", name) != 1 || strcmp(name, "help") == 0 ||
                strcmp(name, "run-config") == 0)
                continue;
            int found = 0;
            for (int i = 0; i < n_flags; i++)
                found |= strcmp(flags[i].name, name) == 0;
            if (!found)
                fprintf(stderr,
                        "  train --help lists --%s: add it to train_flags in drafter-trainer/cmd/dt_runcfg.c\n",
                        name);
            TST_CHECK(found);
            seen++;
        }
    }
    TST_CHECK(pclose(p) == 0);
    TST_CHECK(seen >= 20);
}

/* The committed run config of the 27B deployment loads. */
static void test_deploy_config(void) {
    const char *path = TANDEM_TEST_DATA "/../deploy/configs/qwen3.6-27b/run.json";
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "  %s is not here: its check is skipped\n", path);
        return;
    }
    dt_runcfg_argv a;
    cm_status      st = dt_runcfg_load(&a, flags, n_flags, path);
    if (st != CM_OK)
        fprintf(stderr, "  %s\n", cm_last_error());
    TST_CHECK(st == CM_OK && a.argc >= 2 && strncmp(a.argv[0], "--", 2) == 0);
    if (st == CM_OK)
        dt_runcfg_argv_release(&a);
}

int main(void) {
    snprintf(tmp, sizeof tmp, "/tmp/test_dt_runcfg.XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    flags = dt_runcfg_train_flags(&n_flags);
    test_values();
    test_expand();
    test_refusals();
    test_help_in_sync();
    test_deploy_config();
    tst_rmdir(tmp);
    return tst_report();
}
