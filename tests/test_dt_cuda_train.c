/* tests/test_dt_cuda_train.c — `drafter-trainer train --device cuda` end to end as real
 * processes (label gpu; exits 77 without a cuda build or device), on the training set of
 * tests/dt_train_data.h (real hidden states of models/tiny-qwen35, a 2-layer drafter):
 *   1. 8 steps on cuda --precision fp32 give the cpu run's losses within 1e-4 relative, and
 *      --precision bf16 within 3e-2 (bf16 rounds every GEMM input to 8 significant bits,
 *      relative error ≤ 2^-9 ≈ 2e-3 per operand; over 8 AdamW steps at lr 3e-3 the weights
 *      drift apart further, so the bound leaves ~10× room over one step's error);
 *   2. resume on cuda is exact: 8 steps straight vs 4, stop, --resume to 8 give bit-identical
 *      logged losses and final checkpoint files;
 *   3. with two GPUs: data parallelism over NCCL (two ranks, one GPU each, each with half the
 *      batches) gives per step the losses of one GPU training on the concatenation of the two
 *      ranks' batches (the same global batch; every candidate is an anchor, so both runs
 *      train on exactly the same slots), within 1e-4 relative in fp32; once more with rank 1's
 *      batch without any anchor (all loss_mask 0), which must still join every collective;
 *   4. with two GPUs: live hidden states over NCCL (`target-server serve --device cuda --gpu 0`,
 *      trainer on GPU 1 with --encoding nccl, answers landing in GPU memory) give bit-identical
 *      losses and grad norms to the same run over ZeroMQ with --encoding raw (the server's BF16).
 * Set DT_TRAIN_KEEP=1 to keep the work dir. */
#include <cuda_runtime.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dt_train_data.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_proc.h"

#define MAX_STEPS 64

static char tmp[256], config[512], csv[8192];
static char batch_path[6][600];

typedef struct metrics {
    int    n;
    double loss[MAX_STEPS];
    char   text[MAX_STEPS][200]; /* loss|grad_norm as printed, for bitwise equality */
} metrics;

static int read_metrics(const char *run, metrics *m) {
    char path[700];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[4096];
    int  ok = 1;
    m->n = 0;
    while (fgets(line, sizeof line, f) && m->n < MAX_STEPS) {
        long long   step = -1;
        const char *l = tst_field(line, "\"loss\": "), *g = tst_field(line, "\"grad_norm\": ");
        if (sscanf(line, "{\"step\": %lld", &step) != 1 || step != m->n + 1 || !l || !g) {
            ok = 0;
            break;
        }
        m->loss[m->n] = strtod(l, NULL);
        snprintf(m->text[m->n], sizeof m->text[m->n], "%.*s|%.*s", (int)strcspn(l, ","), l,
                 (int)strcspn(g, ","), g);
        m->n++;
    }
    fclose(f);
    return ok;
}

/* argv for a training run into out (under tmp) with the given extra flags (NULL-terminated). */
static int build_argv(char **argv, const char *out, const char *data, const char *const *extra) {
    static char outp[8][600];
    static int  k;
    char       *o = outp[k++ % 8];
    snprintf(o, 600, "%s/%s", tmp, out);
    const char *base[] = {
        DTD_DT_BIN,    "train", "--config",   config, "--target",        DTD_MODEL, "--data", data,
        "--out",       o,       "--epochs",   "2",    "--seed",          "3",       "--lr",   "3e-3",
        "--log-level", "warn",  "--progress", "off",  "--no-tensorboard"};
    int n = 0;
    for (size_t i = 0; i < sizeof base / sizeof base[0]; i++)
        argv[n++] = (char *)base[i];
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    return n;
}

static int train(const char *out, const char *data, const char *const *extra) {
    char *argv[64], err[700];
    build_argv(argv, out, data, extra);
    snprintf(err, sizeof err, "%s/%s.err", tmp, out);
    int rc = tst_run(argv, err);
    if (rc != 0)
        fprintf(stderr, "drafter-trainer train (%s) exited %d: %s\n", out, rc, tst_slurp(err));
    return rc;
}

static int run_metrics(const char *out, metrics *m) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", tmp, out);
    return read_metrics(p, m);
}

static double max_rel(const metrics *a, const metrics *b) {
    double worst = 0;
    for (int i = 0; i < a->n && i < b->n; i++) {
        double d = fabs(a->loss[i] - b->loss[i]) / fmax(fabs(b->loss[i]), 1e-12);
        if (d > worst)
            worst = d;
    }
    return worst;
}

static void test_cpu_vs_cuda(void) {
    const char *cpu[] = {"--device", "cpu", "--max-anchors", "16", "--steps", "8", NULL};
    const char *f32[] = {"--device", "cuda",    "--precision", "fp32", "--max-anchors",
                         "16",       "--steps", "8",           NULL};
    const char *b16[] = {"--device", "cuda",    "--precision", "bf16", "--max-anchors",
                         "16",       "--steps", "8",           NULL};
    TST_CHECK(train("cpu", csv, cpu) == 0);
    TST_CHECK(train("cuda-f32", csv, f32) == 0);
    TST_CHECK(train("cuda-bf16", csv, b16) == 0);
    metrics *c = calloc(3, sizeof *c);
    TST_CHECK(run_metrics("cpu", &c[0]) && run_metrics("cuda-f32", &c[1]) && run_metrics("cuda-bf16", &c[2]));
    TST_CHECK(c[0].n == 8 && c[1].n == 8 && c[2].n == 8);
    double rf = max_rel(&c[1], &c[0]), rb = max_rel(&c[2], &c[0]);
    fprintf(stderr, "cuda vs cpu over 8 steps: fp32 max relative loss difference %.3g, bf16 %.3g\n", rf, rb);
    for (int i = 0; i < c[0].n; i++)
        fprintf(stderr, "  step %d: cpu %.9f  cuda fp32 %.9f  cuda bf16 %.9f\n", i + 1, c[0].loss[i],
                c[1].loss[i], c[2].loss[i]);
    TST_CHECK(rf <= 1e-4);
    TST_CHECK(rb <= 3e-2);
    TST_CHECK(c[0].n == 8 && c[0].loss[7] != c[0].loss[0]); /* it trained */
    free(c);
}

static void test_resume(void) {
    const char *a[] = {"--device", "cuda", "--max-anchors", "16", "--save-every", "4", "--steps", "8", NULL};
    const char *b1[] = {"--device", "cuda", "--max-anchors", "16", "--save-every", "4", "--steps", "4", NULL};
    const char *b2[] = {"--device", "cuda", "--max-anchors", "16", "--save-every", "4",
                        "--steps",  "8",    "--resume",      NULL};
    TST_CHECK(train("res-a", csv, a) == 0);
    TST_CHECK(train("res-b", csv, b1) == 0);
    TST_CHECK(train("res-b", csv, b2) == 0);
    metrics *m = calloc(2, sizeof *m);
    TST_CHECK(run_metrics("res-a", &m[0]) && run_metrics("res-b", &m[1]));
    TST_CHECK(m[0].n == 8 && m[1].n == 8);
    int same = m[0].n == m[1].n;
    for (int i = 0; same && i < m[0].n; i++)
        if (strcmp(m[0].text[i], m[1].text[i]) != 0) {
            fprintf(stderr, "resume on cuda: step %d differs: straight %s, resumed %s\n", i + 1, m[0].text[i],
                    m[1].text[i]);
            same = 0;
        }
    TST_CHECK(same);
    const char *files[] = {"model.safetensors", "training_state.safetensors"};
    for (int k = 0; k < 2; k++) {
        char fa[900], fb[900];
        snprintf(fa, sizeof fa, "%s/res-a/checkpoints/step-8/%s", tmp, files[k]);
        snprintf(fb, sizeof fb, "%s/res-b/checkpoints/step-8/%s", tmp, files[k]);
        TST_CHECK(tst_same_file(fa, fb));
    }
    free(m);
}

// ---- data parallelism

/* Copies I32 tensor name of n elements into dst (cm_st_read converts float dtypes only). */
static int read_i32(const cm_st *st, const char *name, int64_t n, int32_t *dst) {
    const cm_st_tensor *t = cm_st_find(st, name);
    if (!t || t->dtype != CM_DTYPE_I32 || t->shape[0] != n)
        return 0;
    memcpy(dst, t->data, (size_t)n * sizeof *dst);
    return 1;
}

/* Writes dir/name = the concatenation of batch files a and b (documents of a, then of b;
 * target_hidden widened to F32), with b's loss_mask zeroed when b_no_loss. */
static int concat_batches(const char *a, const char *b, int b_no_loss, const char *out) {
    const char *src[2] = {a, b};
    cm_st      *st[2] = {NULL, NULL};
    int         ok = 1;
    int64_t     T[2] = {0, 0}, N[2] = {0, 0}, W = 2 * DTD_D;
    for (int i = 0; i < 2 && ok; i++) {
        ok = cm_st_open_file(&st[i], src[i]) == CM_OK;
        const cm_st_tensor *ids = ok ? cm_st_find(st[i], "input_ids") : NULL,
                           *cu = ok ? cm_st_find(st[i], "cu_seqlens") : NULL;
        ok = ids && cu;
        if (ok) {
            T[i] = ids->shape[0];
            N[i] = cu->shape[0] - 1;
        }
    }
    int32_t *ids = NULL, *mask = NULL, *cu = NULL;
    float   *hid = NULL;
    if (ok) {
        ids = malloc((size_t)(T[0] + T[1]) * sizeof *ids);
        mask = malloc((size_t)(T[0] + T[1]) * sizeof *mask);
        cu = malloc((size_t)(N[0] + N[1] + 1) * sizeof *cu);
        hid = malloc((size_t)(T[0] + T[1]) * (size_t)W * sizeof *hid);
        ok = ids && mask && cu && hid;
    }
    int64_t off_t = 0, off_n = 0;
    for (int i = 0; i < 2 && ok; i++) {
        int64_t s2[2] = {T[i], W};
        ok = read_i32(st[i], "input_ids", T[i], ids + off_t) &&
             read_i32(st[i], "loss_mask", T[i], mask + off_t) &&
             cm_st_read(st[i], "target_hidden", 2, s2, hid + off_t * W, CM_DTYPE_F32) == CM_OK &&
             read_i32(st[i], "cu_seqlens", N[i] + 1, cu + off_n);
        if (!ok)
            break;
        for (int64_t s = 0; s <= N[i]; s++)
            cu[off_n + s] += (int32_t)off_t;
        if (i == 1 && b_no_loss)
            memset(mask + off_t, 0, (size_t)T[i] * sizeof *mask);
        off_t += T[i];
        off_n += N[i];
    }
    if (ok) {
        cm_st_writer *w = NULL;
        ok = cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, off_t, 0, ids) &&
             dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, off_n + 1, 0, cu) &&
             dtd_put(w, "loss_mask", CM_DTYPE_I32, 1, off_t, 0, mask) &&
             dtd_put(w, "target_hidden", CM_DTYPE_F32, 2, off_t, W, hid) &&
             cm_st_writer_write(w, out) == CM_OK;
        cm_st_writer_destroy(&w);
    }
    free(ids);
    free(mask);
    free(cu);
    free(hid);
    cm_st_destroy(&st[0]);
    cm_st_destroy(&st[1]);
    return ok;
}

/* A copy of batch file src with every loss_mask 0 (no anchor candidates). */
static int no_loss_copy(const char *src, const char *out) {
    cm_st *st = NULL;
    if (cm_st_open_file(&st, src) != CM_OK)
        return 0;
    const cm_st_tensor *ids = cm_st_find(st, "input_ids"), *cu = cm_st_find(st, "cu_seqlens");
    int                 ok = ids && cu;
    int64_t             T = ok ? ids->shape[0] : 0, N = ok ? cu->shape[0] : 0, W = 2 * DTD_D;
    int32_t *id = malloc((size_t)T * 4 + 4), *mask = calloc((size_t)T + 1, 4), *c = malloc((size_t)N * 4 + 4);
    float   *hid = malloc((size_t)(T * W) * 4 + 4);
    int64_t  s2[2] = {T, W};
    ok = ok && id && mask && c && hid && read_i32(st, "input_ids", T, id) &&
         read_i32(st, "cu_seqlens", N, c) &&
         cm_st_read(st, "target_hidden", 2, s2, hid, CM_DTYPE_F32) == CM_OK;
    if (ok) {
        cm_st_writer *w = NULL;
        ok = cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, T, 0, id) &&
             dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, N, 0, c) &&
             dtd_put(w, "loss_mask", CM_DTYPE_I32, 1, T, 0, mask) &&
             dtd_put(w, "target_hidden", CM_DTYPE_F32, 2, T, W, hid) && cm_st_writer_write(w, out) == CM_OK;
        cm_st_writer_destroy(&w);
    }
    free(id);
    free(mask);
    free(c);
    free(hid);
    cm_st_destroy(&st);
    return ok;
}

/* Starts argv with stderr into err_path (emptied first); returns the pid or -1. */
static pid_t spawn(char *const argv[], const char *err_path) {
    unlink(err_path);
    return tst_spawn(argv, err_path);
}

static int reap(pid_t pid) {
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) < 0)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Two ranks over the data list pair (one batch each per epoch) against one GPU over the
 * concatenated batch file, 4 steps, fp32. */
static void test_dp(const char *tag, const char *pair, const char *global, int port) {
    char single[64], r0[64], r1[64], portv[16];
    snprintf(single, sizeof single, "dp-%s-single", tag);
    snprintf(r0, sizeof r0, "dp-%s-rank0", tag);
    snprintf(r1, sizeof r1, "dp-%s-rank1", tag);
    snprintf(portv, sizeof portv, "%d", port);
    const char *one[] = {"--device", "cuda",     "--precision", "fp32", "--max-anchors",
                         "4096",     "--epochs", "4",           NULL};
    TST_CHECK(train(single, global, one) == 0);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", portv, 1);
    char       *argv[2][64], err[2][700];
    const char *x0[] = {"--device",      "cuda", "--gpu",    "0", "--precision", "fp32",
                        "--max-anchors", "4096", "--epochs", "4", "--dp-rank",   "0",
                        "--dp-size",     "2",    NULL};
    const char *x1[] = {"--device",      "cuda", "--gpu",    "1", "--precision", "fp32",
                        "--max-anchors", "4096", "--epochs", "4", "--dp-rank",   "1",
                        "--dp-size",     "2",    NULL};
    build_argv(argv[0], r0, pair, x0);
    build_argv(argv[1], r1, pair, x1);
    snprintf(err[0], sizeof err[0], "%s/%s.err", tmp, r0);
    snprintf(err[1], sizeof err[1], "%s/%s.err", tmp, r1);
    pid_t p0 = spawn(argv[0], err[0]), p1 = spawn(argv[1], err[1]);
    int   rc0 = reap(p0), rc1 = reap(p1);
    if (rc0 != 0 || rc1 != 0)
        fprintf(stderr, "dp %s: rank 0 exited %d (%s), rank 1 exited %d (%s)\n", tag, rc0, tst_slurp(err[0]),
                rc1, tst_slurp(err[1]));
    TST_CHECK(rc0 == 0 && rc1 == 0);
    metrics *m = calloc(3, sizeof *m);
    TST_CHECK(run_metrics(single, &m[0]) && run_metrics(r0, &m[1]) && run_metrics(r1, &m[2]));
    TST_CHECK(m[0].n == 4 && m[1].n == 4 && m[2].n == 4);
    double d0 = max_rel(&m[1], &m[0]), d1 = max_rel(&m[2], &m[0]);
    fprintf(
        stderr,
        "dp %s: two ranks vs one GPU over 4 steps: max relative loss difference rank 0 %.3g, rank 1 %.3g\n",
        tag, d0, d1);
    for (int i = 0; i < m[0].n; i++)
        fprintf(stderr, "  step %d: one GPU %.9f  rank 0 %.9f  rank 1 %.9f\n", i + 1, m[0].loss[i],
                m[1].loss[i], m[2].loss[i]);
    TST_CHECK(d0 <= 1e-4 && d1 <= 1e-4);
    TST_CHECK(m[0].n == 4 && m[0].loss[3] != m[0].loss[0]);
    free(m);
}

// ---- live over NCCL

static void test_live_nccl(void) {
    char log[700], epfile[700], bind[700], endpoint[400] = "";
    snprintf(log, sizeof log, "%s/serve.log", tmp);
    snprintf(epfile, sizeof epfile, "%s/serve.ep", tmp);
    snprintf(bind, sizeof bind, "ipc://%s/serve.ipc", tmp);
    char *argv[] = {DTD_TS_BIN,    "serve",  "--model", DTD_MODEL,         "--device", "cuda",      "--gpu",
                    "0",           "--bind", bind,      "--endpoint-file", epfile,     "--credits", "4",
                    "--log-level", "warn",   NULL};
    pid_t pid = spawn(argv, log);
    TST_CHECK(pid > 0);
    if (!tst_await_endpoint(pid, epfile, log, endpoint, sizeof endpoint, 60000))
        pid = -1;
    TST_CHECK(endpoint[0] != '\0');
    if (endpoint[0]) {
        const char *raw[] = {"--device",      "cuda", "--gpu",        "1",      "--precision", "fp32",
                             "--max-anchors", "16",   "--steps",      "6",      "--server",    endpoint,
                             "--encoding",    "raw",  "--timeout-ms", "120000", NULL};
        const char *nccl[] = {"--device",      "cuda", "--gpu",        "1",      "--precision", "fp32",
                              "--max-anchors", "16",   "--steps",      "6",      "--server",    endpoint,
                              "--encoding",    "nccl", "--timeout-ms", "120000", NULL};
        TST_CHECK(train("live-raw", csv, raw) == 0);
        TST_CHECK(train("live-nccl", csv, nccl) == 0);
        metrics *m = calloc(2, sizeof *m);
        TST_CHECK(run_metrics("live-raw", &m[0]) && run_metrics("live-nccl", &m[1]));
        TST_CHECK(m[0].n == 6 && m[1].n == 6);
        int same = m[0].n == m[1].n && m[0].n > 0;
        for (int i = 0; i < m[0].n && i < m[1].n; i++) {
            fprintf(stderr, "  live step %d: zmq raw %s  nccl %s\n", i + 1, m[0].text[i], m[1].text[i]);
            same &= strcmp(m[0].text[i], m[1].text[i]) == 0;
        }
        fprintf(stderr, "live over NCCL vs ZeroMQ raw: %s (max relative loss difference %.3g)\n",
                same ? "bit-identical" : "DIFFERENT", max_rel(&m[1], &m[0]));
        TST_CHECK(same);
        free(m);
    }
    tst_end(pid, SIGTERM, 10000);
}

static void test_data_parallel(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        fprintf(stderr, "data-parallel checks skipped: %d cuda device(s), they need 2\n", n);
        return;
    }
    char pair[1300], global[700], nol[700];
    /* rank 0 and rank 1 each get one of batches 0 and 2 per epoch; one GPU sees both at once */
    snprintf(global, sizeof global, "%s/global-0-2.safetensors", tmp);
    snprintf(pair, sizeof pair, "%s,%s", batch_path[0], batch_path[2]);
    TST_CHECK(concat_batches(batch_path[0], batch_path[2], 0, global));
    const int port = 29500 + (int)(getpid() % 2000);
    test_dp("both", pair, global, port);
    /* one rank's batch has no anchor: the global batch is batch 0 plus unsupervised context */
    snprintf(nol, sizeof nol, "%s/noloss-2.safetensors", tmp);
    TST_CHECK(no_loss_copy(batch_path[2], nol));
    snprintf(global, sizeof global, "%s/global-0-nol.safetensors", tmp);
    snprintf(pair, sizeof pair, "%s,%s", batch_path[0], nol);
    TST_CHECK(concat_batches(batch_path[0], batch_path[2], 1, global));
    test_dp("noanchor", pair, global, port + 1);
    test_live_nccl();
}

int main(void) {
    tst_need_cuda();
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-dtcuda-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    TST_CHECK(dtd_make_batches(tmp, 6, 11, csv, sizeof csv));
    for (int i = 0; i < 6; i++)
        snprintf(batch_path[i], sizeof batch_path[i], "%s/batch-%d.safetensors", tmp, i);
    if (tst_failures == 0) {
        test_cpu_vs_cuda();
        test_resume();
        test_data_parallel();
    }
    return dtd_end(tmp);
}
