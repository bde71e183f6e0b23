/* tests/test_ts_generate.c — `target-server generate` as a real process on the embedded tiny target
 * (models/tandem-tiny) and the first 24 documents of data/tiny/valid.jsonl, greedy, 40 new tokens at most:
 *   - an uninterrupted run writes one line per document, in order, each a prompt (the input's tokens
 *     before its first supervised one, unchanged) + a response (loss mask 1) that ends at the end
 *     token or at --max-new;
 *   - a run killed (SIGKILL) once some of its output exists, then run again with the same arguments,
 *     ends byte-identical to the uninterrupted run, whether the kill fell inside a batch or not (a
 *     torn last line and a partial batch are cut);
 *   - the target split over 3 pipeline stages (--stages 3) writes the same file, byte for byte;
 *   - the same arguments with another input or other settings, and an --out that generate did not
 *     write, are refused with one message each, and the file is left alone. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tst.h"
#include "tst_proc.h"

#define TS    TANDEM_BINARY_DIR "/target-server/target-server"
#define MODEL TANDEM_TEST_DATA "/../models/tandem-tiny"
#define DATA  TANDEM_TEST_DATA "/../data/tiny/valid.jsonl"

static char dir[256];

static int gen(const char *out, const char *max_new, const char *data, const char *err) {
    char *argv[] = {TS, "generate", "--model", MODEL, "--data", (char *)data, "--out", (char *)out, "--limit", "24",
                    "--batch", "8", "--max-new", (char *)max_new, "--log-level", "warn", NULL};
    return tst_run(argv, err);
}

/* The same run with the target over 3 pipeline stages (3 cpu contexts). */
static int gen_staged(const char *out, const char *err) {
    char *argv[] = {TS, "generate", "--model", MODEL, "--data", DATA, "--out", (char *)out, "--limit", "24", "--batch",
                    "8", "--max-new", "40", "--stages", "3", "--log-level", "warn", NULL};
    return tst_run(argv, err);
}

static long file_size(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

/* Starts a run and kills it once OUT holds more than min_bytes; 1 if it was killed while running. */
static int gen_killed(const char *out, long min_bytes, const char *err) {
    char *argv[] = {TS, "generate", "--model", MODEL, "--data", DATA, "--out", (char *)out, "--limit", "24",
                    "--batch", "8", "--max-new", "40", "--log-level", "warn", NULL};
    pid_t pid = tst_spawn(argv, err);
    for (int i = 0; i < 6000; i++) {
        if (file_size(out) > min_bytes) {
            kill(pid, SIGKILL);
            tst_wait_exit(pid, 5000);
            return 1;
        }
        if (tst_wait_exit(pid, 0) >= 0) return 0;
        tst_sleep_ms(5);
    }
    kill(pid, SIGKILL);
    tst_wait_exit(pid, 5000);
    return 0;
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/tandem-test-generate-%d", (int)getpid());
    mkdir(dir, 0755);
    char full[512], cut[512], cut2[512], err[512], other[512];
    snprintf(full, sizeof full, "%s/full.jsonl", dir);
    snprintf(cut, sizeof cut, "%s/cut.jsonl", dir);
    snprintf(cut2, sizeof cut2, "%s/cut2.jsonl", dir);
    snprintf(err, sizeof err, "%s/generate.err", dir);
    snprintf(other, sizeof other, "%s/other.jsonl", dir);

    /* the uninterrupted run */
    TST_CHECK(gen(full, "40", DATA, err) == 0);
    TST_CHECK(tst_lines(full) == 24);
    FILE *in = fopen(DATA, "r"), *o = fopen(full, "r");
    char  a[65536], b[65536];
    int   n_doc = 0, n_regen = 0, n_ended = 0;
    while (in && o && n_doc < 24 && fgets(a, sizeof a, in) && fgets(b, sizeof b, o)) {
        /* the prompt: the input's ids up to the first 1 in its mask, which the output keeps */
        const char *ia = strstr(a, "\"input_ids\":["), *ma = strstr(a, "\"loss_mask\":[");
        const char *ib = strstr(b, "\"input_ids\":["), *mb = strstr(b, "\"loss_mask\":[");
        TST_CHECK(ia && ma && ib && mb);
        if (!ia || !ma || !ib || !mb) break;
        int prompt = 0;
        for (const char *p = ma + 13; *p && *p != ']'; p++)
            if (*p == '0') prompt++;
            else if (*p == '1') break;
        int same = 1, k = 0, last = -1;
        char *pa = (char *)ia + 13, *pb = (char *)ib + 13;
        for (; k < prompt; k++) {
            long x = strtol(pa, &pa, 10), y = strtol(pb, &pb, 10);
            same &= x == y;
            pa += *pa == ',';
            pb += *pb == ',';
        }
        TST_CHECK(same);
        int resp = 0;
        while (*pb && *pb != ']') {
            last = (int)strtol(pb, &pb, 10);
            resp++;
            pb += *pb == ',';
        }
        int ones = 0;
        for (const char *p = mb + 13; *p && *p != ']'; p++) ones += *p == '1';
        TST_CHECK(resp >= 1 && resp <= 40 && ones == resp); /* the response, all supervised */
        n_regen++;
        n_ended += last == 2; /* the tiny model's end token */
        n_doc++;
    }
    if (in) fclose(in);
    if (o) fclose(o);
    fprintf(stderr, "generate: %d documents regenerated, %d ended at the end token\n", n_regen, n_ended);
    TST_CHECK(n_doc == 24 && n_ended >= 8);

    /* the target over 3 pipeline stages: the same file */
    char staged[512];
    snprintf(staged, sizeof staged, "%s/staged.jsonl", dir);
    TST_CHECK(gen_staged(staged, err) == 0);
    TST_CHECK(tst_same_file(staged, full));
    fprintf(stderr, "generate --stages 3: %s\n", tst_same_file(staged, full) ? "byte-identical" : "DIFFERS");

    /* killed and resumed: inside the first batch's writing or later */
    long sizes[2] = {100, file_size(full) / 2};
    const char *outs[2] = {cut, cut2};
    for (int i = 0; i < 2; i++) {
        int killed = gen_killed(outs[i], sizes[i], err);
        fprintf(stderr, "run %d killed while running: %d (%ld bytes written)\n", i, killed, file_size(outs[i]));
        TST_CHECK(gen(outs[i], "40", DATA, err) == 0);
        TST_CHECK(tst_same_file(outs[i], full));
    }

    /* refusals: other settings, another input, a file generate did not write */
    const long before = file_size(full);
    TST_CHECK(gen(full, "32", DATA, err) == 1);
    TST_CHECK(strstr(tst_slurp(err), "other settings") != NULL);
    char data2[512];
    snprintf(data2, sizeof data2, "%s/in2.jsonl", dir);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "head -n 23 '%s' > '%s' && echo '{\"input_ids\":[1,3,4,5],\"loss_mask\":[0,0,1,1]}' >> '%s'",
             DATA, data2, data2);
    char sh_out[64];
    TST_CHECK(tst_sh(cmd, sh_out, sizeof sh_out) == 0);
    TST_CHECK(gen(full, "40", data2, err) == 1);
    TST_CHECK(strstr(tst_slurp(err), "another input") != NULL);
    TST_CHECK(file_size(full) == before);
    FILE *f = fopen(other, "w");
    if (f) {
        fputs("{\"input_ids\":[1]}\n", f);
        fclose(f);
    }
    TST_CHECK(gen(other, "40", DATA, err) == 1);
    TST_CHECK(strstr(tst_slurp(err), "not a generate output") != NULL);
    return tst_cleanup(dir, tst_report());
}
