/* tests/test_dt_ckpt_sum.c — a resume checks its checkpoint against checksums.json
 * (dt_ckpt_sum.h) and refuses any damage with exit 1 and one line naming the file, the tensor
 * and what to do (the earlier step-10): one flipped mantissa bit and one exponent bit of
 * master.fc.weight, a bit of an adam_v tensor, a NaN written over a master weight, a byte of the
 * training state's header (its hparams), a truncated and a bit-flipped model.safetensors (which
 * the resume itself never reads), an edited config.json, a missing checksums.json entry. A
 * checkpoint saved before checksums (none) still resumes, with a warning that it cannot be
 * verified, and the run's next checkpoint has them; but not with a truncated model.safetensors.
 * Real drafter-trainer processes on the tiny drafter of dt_train_data.h. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cm_cfg.h"
#include "dt_train_data.h"
#include "tst.h"

#define DT_CKPT_SUM_NAME "checksums.json" /* dt_ckpt_sum.h; spelled out so the test builds without it */

static char tmp[256], config[512], csv[8192];

/* drafter-trainer train on the 3 batch files, 8 epochs (24 steps), then extra. */
static int train(const char *out, const char *errname, const char *const *extra) {
    char o[512], err[512];
    snprintf(o, sizeof o, "%s/%s", tmp, out);
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    const char *argv[48] = {DTD_DT_BIN,    "train", "--target",   DTD_MODEL, "--data",        csv,
                            "--out",       o,       "--epochs",   "8",       "--seed",        "3",
                            "--lr",        "3e-3",  "--config",   config,    "--max-anchors", "8",
                            "--log-level", "warn",  "--progress", "off"};
    int         n = 22;
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return tst_run((char *const *)argv, err);
}

static const char *err_text(const char *errname) {
    return tst_err_in(tmp, errname);
}

static int sh(const char *fmt, const char *a, const char *b) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, fmt, a, b);
    return system(cmd) == 0;
}

/* The absolute offset of tensor name's data in a safetensors file, or -1. */
static long tensor_offset(const char *path, const char *name) {
    cm_st *f = NULL;
    if (cm_st_open_file(&f, path) != CM_OK)
        return -1;
    const cm_st_tensor *t = cm_st_find(f, name);
    FILE               *fp = fopen(path, "rb");
    unsigned char       n8[8];
    long                off = -1;
    if (t && fp && fread(n8, 1, 8, fp) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--)
            n = n << 8 | n8[i];
        /* data pointers are into the reader's map of the file: their distance from the first
         * tensor's start gives the offset inside the data area */
        const char *lo = NULL;
        for (int i = 0; i < cm_st_count(f); i++)
            if (!lo || (const char *)cm_st_at(f, i)->data < lo)
                lo = cm_st_at(f, i)->data;
        off = (long)(8 + n) + (long)((const char *)t->data - lo);
    }
    if (fp)
        fclose(fp);
    cm_st_destroy(&f);
    return off;
}

static int xor_byte(const char *path, long off, unsigned char x) {
    FILE *f = fopen(path, "r+b");
    int   c = f && fseek(f, off, SEEK_SET) == 0 ? fgetc(f) : EOF;
    int   ok = c != EOF && fseek(f, off, SEEK_SET) == 0 && fputc(c ^ x, f) != EOF;
    if (f)
        ok &= fclose(f) == 0;
    return ok;
}

static int put_bytes(const char *path, long off, const void *p, size_t n) {
    FILE *f = fopen(path, "r+b");
    int   ok = f && fseek(f, off, SEEK_SET) == 0 && fwrite(p, 1, n, f) == n;
    if (f)
        ok &= fclose(f) == 0;
    return ok;
}

/* A copy of the base run (latest = step-20, step-10 before it) as out; its step-20 path. */
static void copy_base(const char *out, char *step, size_t cap) {
    char a[300], b[300], cmd[1024];
    snprintf(a, sizeof a, "%s/base", tmp);
    snprintf(b, sizeof b, "%s/%s", tmp, out);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", b, a, b);
    TST_CHECK(system(cmd) == 0);
    snprintf(step, cap, "%s/checkpoints/step-20", b);
}

/* The resume of a damaged copy: exit 1, one line, naming what and the way back to step-10. */
static void expect_damaged(const char *out, const char *what) {
    const char *resume[] = {"--resume", "--steps", "24", NULL};
    int         rc = train(out, out, resume);
    const char *e = err_text(out);
    int         one_line = strchr(e, '\n') == e + strlen(e) - 1;
    int         ok = rc == 1 && one_line && strstr(e, "is damaged: ") && strstr(e, what) &&
             strstr(e, "to resume from step-10, the newest earlier checkpoint, run echo step-10 > '");
    if (!ok)
        fprintf(stderr, "%s: exit %d, expected 1 and one line with '%s'; stderr: %s\n", out, rc, what, e);
    TST_CHECK(ok);
    /* nothing was trained from it: the ledger still ends at step 20 */
    char p[600];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", tmp, out);
    const char *m = tst_slurp(p);
    TST_CHECK(strstr(m, "{\"step\": 20,") && !strstr(m, "{\"step\": 21,"));
}

static void test_damage(void) {
    const char *base[] = {"--save-every", "10", "--steps", "20", NULL};
    TST_CHECK(train("base", "base", base) == 0);
    char step[600], p[700];
    copy_base("intact", step, sizeof step);
    const char *resume[] = {"--resume", "--steps", "24", NULL};
    TST_CHECK(train("intact", "intact", resume) == 0 && err_text("intact")[0] == '\0');

    static const struct {
        const char   *out, *tensor;
        int           byte;
        unsigned char x;
    } flips[] = {
        {"mantissa", "master.fc.weight", 400, 0x01}, /* low mantissa bit: a silent drift */
        {"exponent", "master.fc.weight", 403, 0x40}, /* an exponent bit: the loss jumps */
        {"adam-v", "adam_v.layers.0.mlp.up_proj.weight", 41, 0x10},
    };
    for (int k = 0; k < 3; k++) {
        copy_base(flips[k].out, step, sizeof step);
        snprintf(p, sizeof p, "%s/training_state.safetensors", step);
        long off = tensor_offset(p, flips[k].tensor);
        TST_CHECK(off > 0 && xor_byte(p, off + flips[k].byte, flips[k].x));
        char what[200];
        snprintf(what, sizeof what, "tensor '%s' of training_state.safetensors does not match its checksum",
                 flips[k].tensor);
        expect_damaged(flips[k].out, what);
    }
    /* a NaN over a master weight */
    copy_base("nan", step, sizeof step);
    snprintf(p, sizeof p, "%s/training_state.safetensors", step);
    const unsigned char qnan[4] = {0x00, 0x00, 0xc0, 0x7f};
    TST_CHECK(put_bytes(p, tensor_offset(p, "master.norm.weight") + 8, qnan, 4));
    expect_damaged("nan", "tensor 'master.norm.weight' of training_state.safetensors");
    /* the header: "lr": 0.0030000000000000001 -> 0.0070000000000000001 (refused as damage, not
     * as another --lr) */
    copy_base("header", step, sizeof step);
    snprintf(p, sizeof p, "%s/training_state.safetensors", step);
    static char head[1 << 16];
    FILE       *f = fopen(p, "rb");
    size_t      hn = f ? fread(head, 1, sizeof head, f) : 0;
    if (f)
        fclose(f);
    const char *lr = memmem(head, hn, "\\\"lr\\\": 0.003", 13);
    TST_CHECK(lr != NULL);
    if (lr)
        TST_CHECK(xor_byte(p, (long)(lr - head) + 12, '3' ^ '7'));
    expect_damaged("header", "the header of training_state.safetensors does not match its checksum");
    /* model.safetensors, which the resume does not read: truncated, or a flipped bit */
    copy_base("model-trunc", step, sizeof step);
    snprintf(p, sizeof p, "truncate -s 100000 '%s/model.safetensors'", step);
    TST_CHECK(system(p) == 0);
    expect_damaged("model-trunc", "model.safetensors is 100000 bytes but was saved with");
    copy_base("model-flip", step, sizeof step);
    snprintf(p, sizeof p, "%s/model.safetensors", step);
    TST_CHECK(xor_byte(p, tensor_offset(p, "fc.weight") + 7, 0x01));
    expect_damaged("model-flip", "tensor 'fc.weight' of model.safetensors does not match its checksum");
    /* config.json: the resume's drafter config */
    copy_base("config", step, sizeof step);
    TST_CHECK(sh("sed -i 's/\"rms_norm_eps\": 1e-06/\"rms_norm_eps\": 1e-05/' '%s/config.json'", step, ""));
    expect_damaged("config", "the text of config.json does not match its checksum");
    /* a checksum list with an entry removed */
    copy_base("list", step, sizeof step);
    TST_CHECK(sh("sed -i '/\"master.fc.weight\"/d' '%s/" DT_CKPT_SUM_NAME "'", step, ""));
    expect_damaged("list", "training_state.safetensors holds");
}

static void test_legacy(void) {
    char step[600], p[1400];
    copy_base("legacy", step, sizeof step);
    snprintf(p, sizeof p, "%s/" DT_CKPT_SUM_NAME, step);
    TST_CHECK(unlink(p) == 0);
    const char *resume[] = {"--resume", "--steps", "24", NULL};
    TST_CHECK(train("legacy", "legacy", resume) == 0);
    const char *e = err_text("legacy");
    TST_CHECK(strstr(e, "has no " DT_CKPT_SUM_NAME) && strstr(e, "resuming without verifying it"));
    snprintf(p, sizeof p, "%s/legacy/checkpoints/step-24/" DT_CKPT_SUM_NAME, tmp);
    TST_CHECK(access(p, R_OK) == 0);

    copy_base("legacy-trunc", step, sizeof step);
    snprintf(p, sizeof p, "rm '%s/" DT_CKPT_SUM_NAME "' && truncate -s 100000 '%s/model.safetensors'", step,
             step);
    TST_CHECK(system(p) == 0);
    int rc = train("legacy-trunc", "legacy-trunc", resume);
    e = err_text("legacy-trunc");
    TST_CHECK(rc == 1 && strstr(e, "is damaged: ") && strstr(e, "model.safetensors") &&
              strstr(e, "echo step-10 > '"));
}

int main(void) {
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-dcs-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    TST_CHECK(dtd_make_batches(tmp, 3, 5, csv, sizeof csv));
    if (tst_failures == 0) {
        test_damage();
        test_legacy();
    }
    return dtd_end(tmp);
}
