/* tests/test_deploy_launch.c — deploy/tandem-launch for real on the CPU with the tiny target
 * (models/tiny-qwen35): one target-server and one trainer on token batch files run a few live
 * steps, the launcher exits 0 after stopping the server last, and every process is gone; a
 * SIGTERM mid-run stops the trainer first, then the server (exit 143); a failing trainer's
 * status becomes the launcher's; a server that cannot load its model stops the launch before
 * any trainer starts; a SIGKILLed launcher leaves no child behind (pdeathsig); the swap-runs
 * workflow (--servers-only, then two --trainers-only runs against it, then a precompute from it
 * and a --trainers-only --shards run that needs no server); a server over a group of GPUs
 * (--server-gpus 0+1: one server of 2 pipeline stages) feeding a trainer; the --dry-run plan
 * of the seeds' layout (servers on GPUs 0-1, trainers on 2-3), of 3 ranks on 2 servers and of
 * servers over groups; the
 * split --gpus chooses from the planner's rates (bf16 and fp8 servers), and --balance-after's
 * report of supply against demand on a real run. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_rng.h"
#include "cm_safetensors.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define LAUNCH  TANDEM_TEST_DATA "/../deploy/tandem-launch"
#define MODEL   TANDEM_TEST_DATA "/../models/tiny-qwen35"
#define CONFIGS122 TANDEM_TEST_DATA "/../deploy/configs/qwen3.5-122b-a10b"
#define CONFIGS TANDEM_TEST_DATA "/../deploy/configs/qwen3.6-27b"
#define N_BATCH 6

extern char **environ;

static char tmp[256], config[512], csv[8192];

// ---- fixtures: the tiny drafter's config and token batch files (no hidden states: live)

static int write_config(void) {
    FILE *f = fopen(config, "w");
    if (!f)
        return 0;
    fprintf(f, "{\"architectures\": [\"DFlashDraftModel\"], \"model_type\": \"qwen3\", \"block_size\": 8,\n"
               " \"num_target_layers\": 6, \"dflash_config\": {\"mask_token_id\": 511, \"target_layer_ids\": "
               "[1, 3]},\n"
               " \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 1,\n"
               " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,\n"
               " \"hidden_act\": \"silu\", \"rms_norm_eps\": 1e-06, \"rope_theta\": 10000,\n"
               " \"attention_bias\": false, \"max_position_embeddings\": 4096,\n"
               " \"layer_types\": [\"full_attention\"], \"tie_word_embeddings\": false,\n"
               " \"vocab_size\": 512, \"dtype\": \"bfloat16\"}\n");
    return fclose(f) == 0;
}

/* N_BATCH token batches of 3-5 counting documents (24-40 tokens, a 3-token prompt each). */
static int write_batches(void) {
    int32_t ids[256], mask[256], cu[8];
    cm_rng  r;
    cm_rng_seed(&r, 5);
    csv[0] = '\0';
    for (int b = 0; b < N_BATCH; b++) {
        int T = 0, n = 0;
        cu[0] = 0;
        while (n < 3 || (T < 96 && n < 5)) {
            int len = 24 + (int)cm_rng_below(&r, 17), s = (int)cm_rng_below(&r, 64);
            int d = 1 + (int)cm_rng_below(&r, 3);
            for (int i = 0; i < len; i++) {
                ids[T + i] = 100 + (s + i * d) % 64;
                mask[T + i] = i >= 3;
            }
            T += len;
            cu[++n] = T;
        }
        char path[512];
        snprintf(path, sizeof path, "%s/tok-%d.safetensors", tmp, b);
        int64_t       sT[1] = {T}, sN[1] = {n + 1};
        cm_st_writer *w = NULL;
        int           ok = cm_st_writer_create(&w) == CM_OK &&
                 cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, sT, ids) == CM_OK &&
                 cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, sN, cu) == CM_OK &&
                 cm_st_writer_add(w, "loss_mask", CM_DTYPE_I32, 1, sT, mask) == CM_OK &&
                 cm_st_writer_write(w, path) == CM_OK;
        cm_st_writer_destroy(&w);
        if (!ok)
            return 0;
        size_t u = strlen(csv);
        snprintf(csv + u, sizeof csv - u, "%s%s", b ? "," : "", path);
    }
    return 1;
}

// ---- processes

/* Starts the launcher with args (NULL-terminated), stdout and stderr into out. */
static pid_t launch_start(const char *out, char **args) {
    char *argv[64] = {"/bin/bash", LAUNCH};
    int   n = 2;
    for (; args[n - 2] && n < 63; n++)
        argv[n] = args[n - 2];
    argv[n] = NULL;
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    setenv("UBSAN_OPTIONS", "halt_on_error=1:exitcode=87:print_stacktrace=1", 1);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    pid_t pid;
    int   rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc == 0 ? pid : -1;
}

/* Waits up to ms; the exit status (128 + signal), or -1 (then the launcher is SIGKILLed). */
static int launch_wait(pid_t pid, int ms) {
    return tst_finish(pid, ms);
}

static int launch(const char *out, char **args, int ms) {
    pid_t pid = launch_start(out, args);
    return pid < 0 ? -1 : launch_wait(pid, ms);
}

/* Reads a small text file (static buffer; "" if unreadable). */
static const char *slurp(const char *path) {
    static char buf[1 << 17];
    buf[0] = '\0';
    FILE *f = fopen(path, "rb");
    if (!f)
        return buf;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static const char *file_in(const char *run, const char *name) {
    static char p[4][768];
    static int  k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s/%s", tmp, run, name);
    return p[k];
}

/* 1 if a is found in text before b (both present). */
static int before(const char *text, const char *a, const char *b) {
    const char *pa = strstr(text, a), *pb = strstr(text, b);
    return pa && pb && pa < pb;
}

/* Processes (not zombies) whose command line names our temporary directory; printed if loud. */
static int count_ours(int loud) {
    DIR *d = opendir("/proc");
    if (!d)
        return -1;
    struct dirent *e;
    int            n = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || atoi(e->d_name) == (int)getpid())
            continue;
        char path[300], buf[8192];
        snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f)
            continue;
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        for (size_t i = 0; i < len; i++)
            if (!buf[i])
                buf[i] = ' ';
        buf[len] = '\0';
        if (len && strstr(buf, tmp)) {
            if (loud)
                fprintf(stderr, "left running: pid %s: %s\n", e->d_name, buf);
            n++;
        }
    }
    closedir(d);
    return n;
}

/* Waits up to ms for every process of ours to be gone; 1 if so. */
static int none_left(int ms) {
    for (int waited = 0; waited < ms; waited += 100) {
        if (count_ours(0) == 0)
            return 1;
        tst_sleep_ms(100);
    }
    return count_ours(1) == 0;
}

// ---- the launches

#define COMMON "--device", "cpu", "--model", MODEL, "--drafter-config", config, "--bin-dir", TANDEM_BINARY_DIR
/* one server and one trainer on GPU 0 (the cpu here), ports from the system */
#define ONE_EACH "--server-gpus", "0", "--trainer-gpus", "0", "--base-port", "0", COMMON

/* TMP/OUT_NAME, the launcher's output, into out and TMP/RUN_NAME, the run, into run. */
static void paths(const char *out_name, const char *run_name, char out[512], char run[512]) {
    snprintf(out, 512, "%s/%s", tmp, out_name);
    snprintf(run, 512, "%s/%s", tmp, run_name);
}

static void test_run(void) {
    char out[512], run[512];
    paths("run.out", "run", out, run);
    char *args[] = {ONE_EACH,        "--out", run,      "--", "--data",    csv, "--steps", "4",
                    "--max-anchors", "16",    "--seed", "3",  "--credits", "2", NULL};
    int   rc = launch(out, args, 60000);
    TST_CHECK(rc == 0);
    const char *o = slurp(out);
    if (rc != 0)
        fprintf(stderr, "launcher output:\n%s\ntrainer log:\n%s\n", o,
                slurp(file_in("run", "logs/trainer-0.log")));
    TST_CHECK(strstr(o, "server 0 ready at tcp://127.0.0.1:") != NULL);
    TST_CHECK(before(o, "server 0 ready", "trainer 0 started"));
    TST_CHECK(before(o, "trainer 0 exited with status 0", "server 0 exited with status 0"));
    TST_CHECK(tst_metrics_lines(tmp, "run") == 4);
    TST_CHECK(strstr(slurp(file_in("run", "logs/server-0.log")), "answering requests") != NULL);
    TST_CHECK(strstr(slurp(file_in("run", "logs/server-0.log")), "served ") != NULL); /* a clean stop */
    TST_CHECK(strstr(slurp(file_in("run", "logs/trainer-0.log")), "=== ") != NULL);
    TST_CHECK(strstr(slurp(file_in("run", "logs/plan.txt")), "trainer 0: gpu 0") != NULL);
    TST_CHECK(none_left(5000));
}

/* A server over a group of GPUs (--server-gpus 0+1): one target-server whose layers are split into
 * 2 pipeline stages (here 2 cpu contexts), feeding a trainer as any server does. */
static void test_run_stages(void) {
    char out[512], run[512];
    paths("stages.out", "stages", out, run);
    char *args[] = {"--server-gpus", "0+1",           "--trainer-gpus", "2",  "--base-port", "0",
                    COMMON,          "--out",         run,              "--", "--data",      csv,
                    "--steps",       "2",             "--max-anchors",  "16", "--credits",   "2",
                    NULL};
    int   rc = launch(out, args, 60000);
    TST_CHECK(rc == 0);
    if (rc != 0) fprintf(stderr, "launcher output:\n%s\n", slurp(out));
    /* slurp has one buffer: each file is looked at before the next is read */
    TST_CHECK(strstr(slurp(file_in("stages", "logs/plan.txt")), "server  0: gpu 0+1 CUDA_VISIBLE_DEVICES=0,1 (2 "
                                                                "stages) ") != NULL);
    const char *log    = slurp(file_in("stages", "logs/server-0.log"));
    const int   staged = strstr(log, "replica 0, stage 1: layers ") && strstr(log, "answering requests");
    TST_CHECK(staged);
    if (!staged) fprintf(stderr, "server log:\n%s\n", log);
    TST_CHECK(tst_metrics_lines(tmp, "stages") == 2);
    TST_CHECK(none_left(5000));
}

/* The same command again with --auto-resume and a later stop: it continues the run's checkpoint
 * (a plain second start would be refused: the run directory already holds a run). */
static void test_auto_resume(void) {
    char out[512], run[512];
    paths("again.out", "run", out, run);
    char *args[] = {ONE_EACH, "--auto-resume", "--out", run,      "--", "--data",    csv, "--steps",
                    "6",      "--max-anchors", "16",    "--seed", "3",  "--credits", "2", NULL};
    int   rc = launch(out, args, 60000);
    TST_CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "launcher output:\n%s\n", slurp(out));
    TST_CHECK(strstr(slurp(out), " --resume ") != NULL);
    TST_CHECK(strstr(slurp(file_in("run", "logs/trainer-0.log")), "resuming") != NULL);
    TST_CHECK(tst_metrics_lines(tmp, "run") == 6);
    TST_CHECK(none_left(5000));
}

/* A run that lasts (many epochs), stopped with sig once it has trained 2 steps. */
static int stop_mid_run(const char *name, int sig, int *steps_at_stop) {
    char out[512], run[512], out_name[300];
    snprintf(out_name, sizeof out_name, "%s.out", name);
    paths(out_name, name, out, run);
    char *args[] = {ONE_EACH, "--out",         run,  "--",     "--data", csv, "--epochs",
                    "100000", "--max-anchors", "16", "--seed", "3",      NULL};
    pid_t pid = launch_start(out, args);
    if (pid < 0)
        return -1;
    const char *metrics = file_in(name, "metrics.jsonl");
    for (int i = 0; i < 3000 && tst_lines(metrics) < 2; i++)
        tst_sleep_ms(10);
    *steps_at_stop = tst_lines(metrics);
    kill(pid, sig);
    return launch_wait(pid, 30000);
}

static void test_sigterm(void) {
    int steps = 0, rc = stop_mid_run("term", SIGTERM, &steps);
    TST_CHECK(steps >= 2);
    TST_CHECK(rc == 143);
    const char *o = slurp(file_in("", "term.out"));
    if (rc != 143)
        fprintf(stderr, "launcher output:\n%s\n", o);
    /* the trainer is stopped (SIGTERM: 143) and gone before the server is asked to stop */
    TST_CHECK(before(o, "trainer 0 exited with status 143", "stopping servers"));
    TST_CHECK(before(o, "stopping servers", "server 0 exited with status 0"));
    TST_CHECK(strstr(o, "stopped by SIGTERM") != NULL);
    TST_CHECK(strstr(slurp(file_in("term", "logs/server-0.log")), "served ") != NULL);
    TST_CHECK(none_left(5000));
}

static void test_launcher_killed(void) {
    int steps = 0, rc = stop_mid_run("killed", SIGKILL, &steps);
    TST_CHECK(steps >= 2 && rc == 128 + SIGKILL);
    /* nobody forwards anything now: the children's parent-death signal must end them */
    TST_CHECK(none_left(15000));
}

/* A trainer with a bad flag; its server logs at warn level only, so the launcher can learn that
 * the model is loaded only by asking `target-server status`. */
static void test_trainer_fails(void) {
    char out[512], run[512];
    paths("fail.out", "fail", out, run);
    char *args[] = {ONE_EACH, "--out", run, "--server-args", "--log-level warn", "--", "--data", csv,
                    "--lr",   "fast",  NULL};
    TST_CHECK(launch(out, args, 60000) == 2);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "server 0 ready at tcp://127.0.0.1:") != NULL);
    TST_CHECK(before(o, "trainer 0 exited with status 2", "server 0 exited with status 0"));
    TST_CHECK(strstr(o, "trainer 0 failed with status 2") != NULL);
    TST_CHECK(strstr(slurp(file_in("fail", "logs/trainer-0.log")), "--lr 'fast'") != NULL);
    TST_CHECK(strstr(slurp(file_in("fail", "logs/server-0.log")), "answering requests") == NULL);
    TST_CHECK(none_left(5000));
}

static void test_server_fails(void) {
    /* a model directory with the tiny target's config but no weights: it binds, then fails */
    char model[512], cmd[1200], out[512], run[512];
    snprintf(model, sizeof model, "%s/no-weights", tmp);
    mkdir(model, 0755);
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/'", MODEL, model);
    TST_CHECK(system(cmd) == 0);
    paths("sfail.out", "sfail", out, run);
    char *args[] = {"--server-gpus",
                    "0",
                    "--trainer-gpus",
                    "0",
                    "--base-port",
                    "0",
                    "--device",
                    "cpu",
                    "--model",
                    model,
                    "--drafter-config",
                    config,
                    "--bin-dir",
                    TANDEM_BINARY_DIR,
                    "--out",
                    run,
                    "--",
                    "--data",
                    csv,
                    NULL};
    TST_CHECK(launch(out, args, 60000) == 1);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "server 0 stopped before it was ready") != NULL);
    TST_CHECK(strstr(o, "trainer 0 started") == NULL);
    TST_CHECK(access(file_in("sfail", "logs/trainer-0.log"), F_OK) != 0);
    TST_CHECK(none_left(5000));
}

/* --servers-only keeps a warm target; two runs attach to it one after the other. */
static void test_swap_runs(void) {
    char out[512], dir[512];
    snprintf(out, sizeof out, "%s/warm.out", tmp);
    snprintf(dir, sizeof dir, "%s/warm", tmp);
    char *sargs[] = {"--servers-only",  "--server-gpus", "0",       "--base-port", "0",
                     "--device",        "cpu",           "--model", MODEL,         "--bin-dir",
                     TANDEM_BINARY_DIR, "--out",         dir,       NULL};
    pid_t srv = launch_start(out, sargs);
    TST_CHECK(srv > 0);
    if (srv < 0)
        return;
    char endpoint[256] = "";
    for (int i = 0; i < 3000 && !endpoint[0]; i++) {
        const char *p = strstr(slurp(out), "servers up: ");
        if (p)
            sscanf(p + strlen("servers up: "), "%255s", endpoint);
        else
            tst_sleep_ms(10);
    }
    TST_CHECK(strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0);
    const char *runs[] = {"swap-a", "swap-b"}, *lrs[] = {"1e-3", "3e-3"};
    for (int k = 0; k < 2 && endpoint[0]; k++) {
        char rout[512], run[512];
        snprintf(rout, sizeof rout, "%s/%s.out", tmp, runs[k]);
        snprintf(run, sizeof run, "%s/%s", tmp, runs[k]);
        char *targs[] = {"--trainers-only",
                         "--server-endpoints",
                         endpoint,
                         "--trainer-gpus",
                         "0",
                         COMMON,
                         "--out",
                         run,
                         "--",
                         "--data",
                         csv,
                         "--steps",
                         "3",
                         "--max-anchors",
                         "16",
                         "--lr",
                         (char *)lrs[k],
                         NULL};
        int   rc = launch(rout, targs, 60000);
        TST_CHECK(rc == 0);
        if (rc != 0)
            fprintf(stderr, "%s:\n%s\n", runs[k], slurp(rout));
        TST_CHECK(tst_metrics_lines(tmp, runs[k]) == 3);
        TST_CHECK(strstr(slurp(rout), "server 0") == NULL); /* it started no server */
    }
    /* precompute from the warm server, then a run from the shards alone (--shards: no server) */
    if (endpoint[0]) {
        char shards[512], err[512], pout[512], run[512];
        snprintf(shards, sizeof shards, "%s/shards", tmp);
        snprintf(err, sizeof err, "%s/precompute.err", tmp);
        char *pre[] = {TANDEM_BINARY_DIR "/drafter-trainer/drafter-trainer",
                       "precompute",
                       "--server",
                       endpoint,
                       "--data",
                       csv,
                       "--layers",
                       "1,3",
                       "--out",
                       shards,
                       "--log-level",
                       "warn",
                       NULL};
        unlink(err);
        pid_t p = tst_spawn(pre, err);
        TST_CHECK(p > 0 && launch_wait(p, 60000) == 0);
        snprintf(pout, sizeof pout, "%s/from-shards.out", tmp);
        snprintf(run, sizeof run, "%s/from-shards", tmp);
        char *sargs2[] = {"--trainers-only",
                          "--shards",
                          shards,
                          "--trainer-gpus",
                          "0",
                          COMMON,
                          "--out",
                          run,
                          "--",
                          "--data",
                          csv,
                          "--steps",
                          "3",
                          "--max-anchors",
                          "16",
                          NULL};
        int   rc = launch(pout, sargs2, 60000);
        TST_CHECK(rc == 0);
        if (rc != 0)
            fprintf(stderr, "from-shards:\n%s\n%s\n", slurp(pout),
                    slurp(file_in("from-shards", "logs/trainer-0.log")));
        TST_CHECK(strstr(slurp(pout), "shards ") != NULL);
        TST_CHECK(tst_metrics_lines(tmp, "from-shards") == 3);
    }
    /* the same server answered every run, and still runs */
    TST_CHECK(kill(srv, 0) == 0 && strstr(slurp(out), "exited") == NULL);
    kill(srv, SIGINT);
    TST_CHECK(launch_wait(srv, 30000) == 130);
    TST_CHECK(strstr(slurp(out), "server 0 exited with status 0") != NULL);
    TST_CHECK(none_left(5000));
}

// ---- the plan

static void test_dry_run(void) {
    char out[512], run[512];
    paths("dry.out", "never", out, run);
    char *seeds[] = {"--server-gpus",
                     "0,1",
                     "--trainer-gpus",
                     "2,3",
                     "--model",
                     "/models/Qwen3.6-27B",
                     "--drafter-config",
                     "drafter.json",
                     "--run-config",
                     "run.json",
                     "--out",
                     run,
                     "--dry-run",
                     NULL};
    TST_CHECK(launch(out, seeds, 20000) == 0);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "server  0: gpu 0 CUDA_VISIBLE_DEVICES=0 endpoint tcp://127.0.0.1:5555 ") != NULL);
    TST_CHECK(strstr(o, "server  1: gpu 1 CUDA_VISIBLE_DEVICES=1 endpoint tcp://127.0.0.1:5556 ") != NULL);
    TST_CHECK(strstr(o, "trainer 0: gpu 2 CUDA_VISIBLE_DEVICES=2 RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 servers tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 ") !=
              NULL);
    TST_CHECK(strstr(o, "trainer 1: gpu 3 CUDA_VISIBLE_DEVICES=3 RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 servers tcp://127.0.0.1:5556,tcp://127.0.0.1:5555 ") !=
              NULL);
    /* the commands: each server on its one visible GPU, each rank with its data shard */
    TST_CHECK(strstr(o, "$ env CUDA_VISIBLE_DEVICES=1 ") && strstr(o, "serve --model /models/Qwen3.6-27B "
                                                                      "--device cuda --gpu 0 --bind "
                                                                      "tcp://127.0.0.1:5556"));
    TST_CHECK(strstr(o, "--server tcp://127.0.0.1:5556\\,tcp://127.0.0.1:5555 --out ") &&
              strstr(o, "--dp-rank 1 --dp-size 2"));
    TST_CHECK(strstr(o, "--run-config ") && strstr(o, "/run.json --config "));
    TST_CHECK(access(run, F_OK) != 0); /* a dry run creates nothing */

    /* 3 ranks on 2 servers: every rank uses both, rank r from server r mod 2 on */
    char *odd[] = {"--server-gpus",    "4,5",    "--trainer-gpus", "0,1,2", "--model",     "/m",
                   "--drafter-config", "d.json", "--out",          run,     "--base-port", "7000",
                   "--master-port",    "29600",  "--dry-run",      NULL};
    TST_CHECK(launch(out, odd, 20000) == 0);
    o = slurp(out);
    TST_CHECK(strstr(o, "server  1: gpu 5 CUDA_VISIBLE_DEVICES=5 endpoint tcp://127.0.0.1:7001 ") != NULL);
    TST_CHECK(strstr(o, "trainer 2: gpu 2 CUDA_VISIBLE_DEVICES=2 RANK=2 LOCAL_RANK=2 WORLD_SIZE=3 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 servers tcp://127.0.0.1:7000,tcp://127.0.0.1:7001 ") !=
              NULL);
    TST_CHECK(strstr(o, "trainer 1: gpu 1 ") && strstr(o, "servers tcp://127.0.0.1:7001,tcp://127.0.0.1:7000 out "));

    /* servers over groups of GPUs: each group is one server of as many stages */
    char *groups[] = {"--server-gpus",    "0+1,2+3", "--trainer-gpus", "4",  "--model", "/m",
                      "--drafter-config", "d.json",  "--out",          run,  "--dry-run", NULL};
    TST_CHECK(launch(out, groups, 20000) == 0);
    o = slurp(out);
    TST_CHECK(strstr(o, "server  1: gpu 2+3 CUDA_VISIBLE_DEVICES=2,3 (2 stages) endpoint tcp://127.0.0.1:5556 "));
    TST_CHECK(strstr(o, "CUDA_VISIBLE_DEVICES=2\\,3 ") && strstr(o, "--gpu 0\\,1 --stages 2 --bind tcp://127.0.0.1:5556"));
    char *bad_group[] = {"--server-gpus", "0+", "--trainer-gpus", "4", "--model", "/m", "--drafter-config", "d.json",
                         "--out", run, "--dry-run", NULL};
    TST_CHECK(launch(out, bad_group, 20000) == 2 && strstr(slurp(out), "groups like 0+1,2+3"));
}

/* --mps: a GPU that a server and a trainer share runs them under CUDA MPS when
 * nvidia-cuda-mps-control is there (TANDEM_MPS_CONTROL names it here; a dry run only looks for
 * it: the daemon itself ran on an H200, bench/results/pipeline-shared-mps-2026-12-04.md), is
 * time-sliced without it or with --mps off, and --mps on refuses to start without it. A start
 * whose daemon exits at once (/bin/false) stops with one message before any server, and
 * removes the pipe directory its plan named. */
static void test_mps(void) {
    char out[512], run[512];
    paths("mps.out", "never", out, run);
    char *shared[16] = {"--server-gpus",    "0",      "--trainer-gpus", "0,1", "--model",  "/m",
                        "--drafter-config", "d.json", "--out",          run,   "--dry-run"}; /* NULLs after */
    setenv("TANDEM_MPS_CONTROL", "/nonexistent/nvidia-cuda-mps-control", 1);
    TST_CHECK(launch(out, shared, 20000) == 0);
    TST_CHECK(strstr(slurp(out), "GPU(s) 0 shared by several processes, time-sliced: nvidia-cuda-mps-control is "
                                 "not installed") != NULL);
    TST_CHECK(strstr(slurp(out), "CUDA_MPS_PIPE_DIRECTORY") == NULL);
    shared[11] = "--mps", shared[12] = "on";
    TST_CHECK(launch(out, shared, 20000) == 2 && strstr(slurp(out), "--mps on: GPU(s) 0 are shared"));
    setenv("TANDEM_MPS_CONTROL", "/bin/true", 1); /* present; a dry run never starts it */
    TST_CHECK(launch(out, shared, 20000) == 0);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "GPU(s) 0 shared by several processes: they run under CUDA MPS") != NULL);
    /* the server and rank 0 (GPU 0) are MPS clients, rank 1 (GPU 1 alone) is not */
    TST_CHECK(strstr(o, "$ env CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps.") != NULL);
    TST_CHECK(strstr(o, "MASTER_PORT=29500 CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps.") != NULL);
    TST_CHECK(strstr(o, "$ env CUDA_VISIBLE_DEVICES=1 RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 /") != NULL);
    /* rank 0 shares GPU 0 at client priority below normal, the server at the normal one */
    TST_CHECK(strstr(o, "trainers there at MPS client priority below normal") != NULL);
    const char *prio = strstr(o, "CUDA_MPS_CLIENT_PRIORITY=1 /"), *rank0 = strstr(o, "$ env CUDA_VISIBLE_DEVICES=0 RANK=0 ");
    TST_CHECK(prio && rank0 && prio > rank0 && !memchr(rank0, '\n', (size_t)(prio - rank0)));
    TST_CHECK(prio && !strstr(prio + 1, "CUDA_MPS_CLIENT_PRIORITY"));
    shared[13] = "--mps-trainer-priority", shared[14] = "normal";
    TST_CHECK(launch(out, shared, 20000) == 0);
    o = slurp(out);
    TST_CHECK(strstr(o, "CUDA_MPS_PIPE_DIRECTORY") && !strstr(o, "CUDA_MPS_CLIENT_PRIORITY") &&
              !strstr(o, "priority below normal"));
    shared[14] = "low";
    TST_CHECK(launch(out, shared, 20000) == 2 &&
              strstr(slurp(out), "--mps-trainer-priority 'low': expected below or normal"));
    shared[13] = NULL, shared[12] = "off";
    TST_CHECK(launch(out, shared, 20000) == 0 && strstr(slurp(out), "time-sliced (--mps off)") &&
              !strstr(slurp(out), "CUDA_MPS_PIPE_DIRECTORY"));
    shared[12] = "sometimes";
    TST_CHECK(launch(out, shared, 20000) == 2 && strstr(slurp(out), "--mps 'sometimes'"));
    TST_CHECK(access(run, F_OK) != 0);
    /* a real start whose control daemon does not come up: one message, status 1, nothing started */
    setenv("TANDEM_MPS_CONTROL", "/bin/false", 1);
    char run2[512];
    paths("mps.out", "mps-run", out, run2);
    char *start[] = {
        "--server-gpus", "0",         "--trainer-gpus",  "0",     "--model", MODEL, "--drafter-config",
        config,          "--bin-dir", TANDEM_BINARY_DIR, "--out", run2,      NULL};
    TST_CHECK(launch(out, start, 20000) == 1);
    o = slurp(out);
    TST_CHECK(strstr(o, "the MPS control daemon did not start") != NULL);
    TST_CHECK(strstr(o, "server 0 started") == NULL &&
              strstr(o, "CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps.") != NULL &&
              strstr(o, "XXXXXX") == NULL); /* the plan names the pipe directory it made */
    const char *pipe = strstr(o, "CUDA_MPS_PIPE_DIRECTORY=");
    char        dir[64] = "";
    if (pipe)
        sscanf(pipe + strlen("CUDA_MPS_PIPE_DIRECTORY="), "%63[^ \n]", dir);
    TST_CHECK(dir[0] && access(dir, F_OK) != 0); /* removed on the way out */
    unsetenv("TANDEM_MPS_CONTROL");
}

/* --gpus: the split from the planner's rates (the 27B deploy configs: one trainer GPU needs 2.42
 * target GPUs at bf16, 1.70 at fp8), printed with the plan. */
static void test_auto_split(void) {
    char out[512], run[512];
    paths("split.out", "never", out, run);
    char *eight[] = {"--gpus",           "0,1,2,3,4,5,6,7", "--model",      CONFIGS "/target-config.json",
                     "--drafter-config", CONFIGS "/drafter.json", "--run-config", CONFIGS "/run.json",
                     "--bin-dir",        TANDEM_BINARY_DIR, "--out",        run,
                     "--dry-run",        NULL};
    TST_CHECK(launch(out, eight, 20000) == 0);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "auto split of 8 GPU(s): 5 server(s), 3 trainer(s); the planner: one trainer GPU needs "
                        "2.42 target GPUs at bf16") != NULL);
    TST_CHECK(strstr(o, "server  4: gpu 4 ") && strstr(o, "trainer 0: gpu 5 ") && strstr(o, "trainer 2: gpu 7 "));
    if (!strstr(o, "auto split of 8")) fprintf(stderr, "launcher output:\n%s\n", o);
    /* four GPUs: 3 + 1 at bf16, 2 + 2 with the servers at fp8 */
    char *four[] = {"--gpus",           "0,1,2,3", "--model",      CONFIGS "/target-config.json",
                    "--drafter-config", CONFIGS "/drafter.json", "--run-config", CONFIGS "/run.json",
                    "--bin-dir",        TANDEM_BINARY_DIR, "--out", run, "--dry-run", NULL};
    TST_CHECK(launch(out, four, 20000) == 0);
    TST_CHECK(strstr(slurp(out), "auto split of 4 GPU(s): 3 server(s), 1 trainer(s)") != NULL);
    char *four8[] = {"--gpus",           "0,1,2,3", "--model",      CONFIGS "/target-config.json",
                     "--drafter-config", CONFIGS "/drafter.json", "--run-config", CONFIGS "/run.json",
                     "--bin-dir",        TANDEM_BINARY_DIR, "--out", run, "--server-args", "--precision fp8",
                     "--dry-run",        NULL};
    TST_CHECK(launch(out, four8, 20000) == 0);
    TST_CHECK(strstr(slurp(out), "auto split of 4 GPU(s): 2 server(s), 2 trainer(s); the planner: one trainer GPU "
                                 "needs 1.70 target GPUs at fp8") != NULL);
    /* the 122B-A10B at bf16 takes 2 H200s a replica: servers over pairs of GPUs (3.16 target GPUs per
     * trainer GPU: 3 pairs and 2 trainers of 8), every trainer fed by every server; 2 GPUs are too few */
    char *big[] = {"--gpus",           "0,1,2,3,4,5,6,7", "--model",      CONFIGS122 "/target-config.json",
                   "--drafter-config", CONFIGS122 "/drafter.json", "--run-config", CONFIGS122 "/run.json",
                   "--bin-dir",        TANDEM_BINARY_DIR, "--out", run, "--dry-run", NULL};
    TST_CHECK(launch(out, big, 20000) == 0);
    o = slurp(out);
    TST_CHECK(strstr(o, "auto split of 8 GPU(s): 3 server(s) of 2 GPUs each, 2 trainer(s); the planner: one trainer "
                        "GPU needs 3.16 target GPUs at bf16") != NULL);
    TST_CHECK(strstr(o, "server  2: gpu 4+5 CUDA_VISIBLE_DEVICES=4,5 (2 stages) ") &&
              strstr(o, "trainer 1: gpu 7 ") && strstr(o, "--stages 2 --bind tcp://127.0.0.1:5557"));
    TST_CHECK(strstr(o, "servers tcp://127.0.0.1:5556,tcp://127.0.0.1:5557,tcp://127.0.0.1:5555 out "));
    if (!strstr(o, "of 2 GPUs each")) fprintf(stderr, "launcher output:\n%s\n", o);
    big[1] = "0,1";
    TST_CHECK(launch(out, big, 20000) == 2 && strstr(slurp(out), "one replica of this target takes 2 GPUs at bf16"));
    char *both[] = {"--gpus", "0,1", "--server-gpus", "0", "--model", MODEL, "--drafter-config", config,
                    "--out",  run,   NULL};
    TST_CHECK(launch(out, both, 20000) == 2 && strstr(slurp(out), "not both"));
    TST_CHECK(access(run, F_OK) != 0);
}

/* --gpus and --balance-after on the cpu: one server and one trainer (two "GPUs"), and after the
 * window the launcher reports demand, supply and the measured ratio (the figures are the cpu's). */
static void test_balance(void) {
    char out[512], run[512];
    paths("balance.out", "balance", out, run);
    char *args[] = {"--gpus", "0,1", "--balance-after", "3", "--base-port", "0", COMMON, "--out", run, "--",
                    "--data", csv, "--steps", "40", "--max-anchors", "16", "--seed", "3", "--credits", "2", NULL};
    int rc = launch(out, args, 120000);
    TST_CHECK(rc == 0);
    const char *o = slurp(out);
    TST_CHECK(strstr(o, "auto split of 2 GPU(s): 1 server(s), 1 trainer(s)") != NULL);
    TST_CHECK(strstr(o, "balance after 3 steps per trainer: the trainers waited ") != NULL);
    TST_CHECK(strstr(o, "demand: 1 trainer(s) consume ") && strstr(o, "supply: 1 server(s) make "));
    TST_CHECK(strstr(o, "target GPUs per trainer GPU, measured: ") != NULL);
    if (!strstr(o, "measured: ")) fprintf(stderr, "launcher output:\n%s\n", o);
    const char *b = strstr(o, "tandem-launch: balance after");
    if (b) printf("%.*s\n", (int)(strstr(b, "stopping") ? strstr(b, "stopping") - b : (long)strlen(b)), b);
    TST_CHECK(strstr(slurp(file_in("balance", "logs/balance.txt")), "measured: ") != NULL); /* (o is gone now) */
    TST_CHECK(none_left(5000));
}

static void test_usage(void) {
    char out[512];
    snprintf(out, sizeof out, "%s/usage.out", tmp);
    char *no_model[] = {"--server-gpus", "0", "--trainer-gpus", "1", "--out", tmp, "--drafter-config",
                        config,          NULL};
    TST_CHECK(launch(out, no_model, 20000) == 2 && strstr(slurp(out), "--model DIR is required"));
    char *no_eps[] = {"--trainers-only",  "--trainer-gpus", "1", "--model", MODEL, "--out", tmp,
                      "--drafter-config", config,           NULL};
    TST_CHECK(launch(out, no_eps, 20000) == 2 && strstr(slurp(out), "--server-endpoints"));
    char *bad_gpus[] = {"--server-gpus", "0;1", "--trainer-gpus",   "2",    "--model", MODEL,
                        "--out",         tmp,   "--drafter-config", config, NULL};
    TST_CHECK(launch(out, bad_gpus, 20000) == 2 && strstr(slurp(out), "--server-gpus '0;1'"));
    char *bad_dev[] = {"--server-gpus",    "0",    "--trainer-gpus", "2",   "--model", MODEL, "--out", tmp,
                       "--drafter-config", config, "--device",       "tpu", NULL};
    TST_CHECK(launch(out, bad_dev, 20000) == 2 && strstr(slurp(out), "--device 'tpu'"));
    char *no_bin[] = {"--server-gpus",
                      "0",
                      "--trainer-gpus",
                      "0",
                      "--model",
                      MODEL,
                      "--out",
                      tmp,
                      "--drafter-config",
                      config,
                      "--bin-dir",
                      "/nonexistent",
                      NULL};
    TST_CHECK(launch(out, no_bin, 20000) == 2 && strstr(slurp(out), "no target-server at"));
}

int main(void) {
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-deploy-%d", (int)getpid());
    mkdir(tmp, 0700);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    if (!write_config() || !write_batches()) {
        TST_CHECK(0);
        return tst_report();
    }
    time_t t0 = time(NULL);
    test_dry_run();
    test_mps();
    test_auto_split();
    test_usage();
    test_run();
    test_run_stages();
    test_auto_resume();
    test_sigterm();
    test_trainer_fails();
    test_server_fails();
    test_launcher_killed();
    test_swap_runs();
    test_balance();
    fprintf(stderr, "launcher tests took %lld s\n", (long long)(time(NULL) - t0));
    return tst_cleanup(tmp, tst_report()); /* logs are kept for a failed run */
}
