/* tests/test_dt_tau_chain.c — τ_chain, the τ a greedy speculative decoder reports, from one teacher-forced
 * pass (drafter-trainer/model/dt_tau_chain.h, docs/drafter.md "τ and accuracy").
 *
 * 1. The walk on hand-made acceptances with hand-counted results: the cap on the last step, a span that
 *    ends exactly on a bonus token, several documents packed (a one-token response, a document without
 *    one, a document of two responses), an anchor the chain needs missing and one it does not need,
 *    nothing to walk, bad input refused with a message.
 * 2. The walk against z-lab dflash 0.1.0's dflash_generate loop (greedy), transcribed in its own
 *    coordinates (prompt of P tokens, max_new = the response length, verify_size, produced) on random
 *    packed batches: every document's steps and the totals equal; each response of N tokens emits N − 1.
 * 3. `drafter-trainer grad` on oracle fixtures (tests/fixtures/drafter, drafter2), run as a child process:
 *    on the fixture's own anchors, accepted per anchor agrees with the float64 oracle's τ (mean + 1) and
 *    slot-1 hits, and no tau_chain is written (the anchors do not hold the chain); with every anchor
 *    candidate, tau_chain, chain_tokens and chain_steps equal the loop of 2 walked here over the reported
 *    accepted, and each reported acceptance equals τ − 1 of a step of that anchor alone (dt_model API),
 *    for DFlash2 also for the selector path (sel_accepted, sel_tau_chain, sel_tau). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_rng.h"
#include "cm_safetensors.h"
#include "dt_model.h"
#include "dt_tau_chain.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_dt.h"
#include "tst_proc.h"

static char bin[1024];
static char tmp[64];

// ----------------------------------------------------------------------------
// 1. hand-made acceptances

/* Walks and checks the totals (and each document's steps when want_seq is non-NULL). */
static void expect_walk(const char *what, const int32_t *cu, int n_seq, const int32_t *mask,
                        const int32_t *anchors, const int32_t *acc, int64_t n, int64_t tokens, int64_t steps,
                        int64_t missing, const int64_t *want_seq) {
    dt_tau_chain c;
    int64_t      seq[16];
    TST_CHECK(n_seq <= 16);
    if (!tst_ok(dt_tau_chain_walk(cu, n_seq, mask, cu[n_seq], anchors, acc, n, seq, &c), what))
        return;
    int ok = c.tokens == tokens && c.steps == steps && c.missing == missing;
    for (int d = 0; want_seq && missing < 0 && d < n_seq; d++)
        ok = ok && seq[d] == want_seq[d];
    TST_CHECK(ok);
    if (!ok)
        fprintf(stderr, "%s: %lld tokens in %lld steps, missing %lld; expected %lld in %lld, missing %lld\n",
                what, (long long)c.tokens, (long long)c.steps, (long long)c.missing, (long long)tokens,
                (long long)steps, (long long)missing);
}

static void test_hand_made(void) {
    { /* prompt of 3, response of 10 [3, 13): 3 -(2 accepted + bonus)-> 6 -(0 + bonus)-> 7, then 9 accepted
         where 5 are left: the step emits 5 and ends on 12, the response's last token */
        const int32_t cu[] = {0, 13}, mask[] = {0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        const int32_t anchors[] = {3, 4, 5, 6, 7, 8, 9, 10, 11}, acc[] = {2, 7, 7, 0, 9, 7, 7, 7, 7};
        expect_walk("one response", cu, 1, mask, anchors, acc, 9, 9, 3, -1, NULL);
        dt_tau_chain c = {9, 3, -1};
        TST_CHECK(dt_tau_chain_tau(&c) == 3.0);
    }
    { /* a response of 5: 4 tokens after the prefill's. 4 accepted: one step emits the 4 (no bonus, max_new
         is out); 3 accepted + the bonus: the same; 2 accepted + the bonus, then the last one */
        const int32_t cu[] = {0, 5}, mask[] = {1, 1, 1, 1, 1}, anchors[] = {0, 1, 2, 3};
        const int32_t all[] = {4, 0, 0, 0}, fit[] = {3, 0, 0, 0}, short_[] = {2, 0, 0, 0};
        expect_walk("all accepted", cu, 1, mask, anchors, all, 4, 4, 1, -1, NULL);
        expect_walk("bonus on the last token", cu, 1, mask, anchors, fit, 4, 4, 1, -1, NULL);
        expect_walk("one token short", cu, 1, mask, anchors, short_, 4, 4, 2, -1, NULL);
    }
    { /* packed: A [0, 4) response [1, 4); B [4, 5) a one-token response (no step); C [5, 9) no response;
         D [9, 20) two responses [10, 13) and [15, 20). A: 1 -(1 + bonus)-> 3 end. D: 10 -> 11 -> 12 end;
         15 -(2 + bonus)-> 18 -(1 accepted, 1 left)-> 19 end. 8 tokens in 5 steps */
        const int32_t cu[] = {0, 4, 5, 9, 20};
        const int32_t mask[] = {0, 1, 1, 1, /**/ 1, /**/ 0, 0, 0, 0, /**/ 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1};
        const int32_t anchors[] = {1, 2, 10, 11, 15, 16, 17, 18}, acc[] = {1, 5, 0, 0, 2, 0, 0, 1};
        const int64_t seq[] = {1, 0, 0, 4};
        expect_walk("packed", cu, 4, mask, anchors, acc, 8, 8, 5, -1, seq);
        dt_tau_chain c = {8, 5, -1};
        TST_CHECK(dt_tau_chain_tau(&c) == 1.6);
        /* anchor 16 is off the chain: not needed; anchor 18 is on it: missing */
        const int32_t no16[] = {1, 2, 10, 11, 15, 17, 18}, acc16[] = {1, 5, 0, 0, 2, 0, 1};
        expect_walk("an anchor off the chain dropped", cu, 4, mask, no16, acc16, 7, 8, 5, -1, seq);
        const int32_t no18[] = {1, 2, 10, 11, 15, 16, 17}, acc18[] = {1, 5, 0, 0, 2, 0, 0};
        expect_walk("an anchor on the chain dropped", cu, 4, mask, no18, acc18, 7, 0, 0, 18, NULL);
        expect_walk("no anchors", cu, 4, mask, NULL, NULL, 0, 0, 0, 1, NULL);
        /* the same documents and anchors, other acceptances on the anchors the chain skips: no change */
        const int32_t other[] = {1, 99, 0, 0, 2, 99, 99, 1};
        expect_walk("skipped anchors ignored", cu, 4, mask, anchors, other, 8, 8, 5, -1, seq);
    }
    { /* nothing to walk: no supervised token, or one-token responses only; τ_chain 0 */
        const int32_t cu[] = {0, 3, 4, 5}, zeros[] = {0, 0, 0, 0, 0}, ones[] = {0, 0, 1, 1, 1};
        const int64_t none[] = {0, 0, 0};
        expect_walk("no response", cu, 3, zeros, NULL, NULL, 0, 0, 0, -1, none);
        expect_walk("one-token responses", cu, 3, ones, NULL, NULL, 0, 0, 0, -1, none);
        dt_tau_chain c = {0, 0, -1};
        TST_CHECK(dt_tau_chain_tau(&c) == 0.0);
    }
    { /* bad input */
        const int32_t cu[] = {0, 5}, mask[] = {1, 1, 1, 1, 1}, bad_cu[] = {0, 4};
        const int32_t up[] = {0, 1, 2}, down[] = {0, 2, 1}, twice[] = {0, 1, 1}, far[] = {0, 1, 5};
        const int32_t acc[] = {0, 0, 0}, neg[] = {0, -1, 0};
        dt_tau_chain  c;
        TST_FAILS(dt_tau_chain_walk(bad_cu, 1, mask, 5, up, acc, 3, NULL, &c), CM_ERR_INVALID_ARG,
                  "cu_seqlens");
        TST_FAILS(dt_tau_chain_walk(cu, 1, mask, 5, down, acc, 3, NULL, &c), CM_ERR_INVALID_ARG, "ascending");
        TST_FAILS(dt_tau_chain_walk(cu, 1, mask, 5, twice, acc, 3, NULL, &c), CM_ERR_INVALID_ARG,
                  "ascending");
        TST_FAILS(dt_tau_chain_walk(cu, 1, mask, 5, far, acc, 3, NULL, &c), CM_ERR_INVALID_ARG, "outside");
        TST_FAILS(dt_tau_chain_walk(cu, 1, mask, 5, up, neg, 3, NULL, &c), CM_ERR_INVALID_ARG,
                  "acceptance -1");
        TST_FAILS(dt_tau_chain_walk(cu, 1, mask, 5, NULL, NULL, 3, NULL, &c), CM_ERR_INVALID_ARG,
                  "3 anchors");
    }
}

// ----------------------------------------------------------------------------
// 2. against z-lab's decode loop

/* dflash 0.1.0's dflash_generate, greedy, without stop tokens, over the output positions of one decode:
 * prompt of P tokens, max_new N; acc_at[start] is what the drafter's block at start gets accepted on
 * this text (−1: unknown), B the block size. The prefill writes position P; each verify step's
 * acceptance_lengths entry is `produced`. Returns the steps (−1 on an unknown acceptance; *unknown gets
 * its position); *tokens the Σ of produced. */
static int64_t zlab_loop(int64_t P, int64_t N, int B, const int32_t *acc_at, int64_t *tokens,
                         int64_t *unknown) {
    const int64_t max_length = P + N;
    int64_t       start = P, steps = 0;
    *tokens = 0;
    while (start + 1 < max_length) {
        const int64_t verify_size = B < max_length - start ? B : max_length - start;
        int64_t       acceptance = acc_at[start];
        if (acceptance < 0) {
            *unknown = start;
            return -1;
        }
        if (acceptance > verify_size - 1) /* only verify_size − 1 drafts are proposed */
            acceptance = verify_size - 1;
        const int64_t produced =
            acceptance + 1 < max_length - start - 1 ? acceptance + 1 : max_length - start - 1;
        start += produced;
        *tokens += produced;
        steps++;
    }
    return steps;
}

/* Every response of a packed batch decoded by zlab_loop: prompt = its document's tokens before it,
 * max_new = its length. acc_pos[p] is the acceptance at packed position p (−1 unknown). Returns the
 * total steps, or −1 (then *unknown the packed position). */
static int64_t zlab_batch(const int32_t *cu, int n_seq, const int32_t *mask, const int32_t *acc_pos, int B,
                          int64_t *seq_steps, int64_t *tokens, int64_t *unknown) {
    int64_t steps = 0;
    *tokens = 0;
    for (int d = 0; d < n_seq; d++) {
        const int64_t s = cu[d], len = cu[d + 1] - cu[d];
        seq_steps[d] = 0;
        for (int64_t f = 0; f < len; f++) {
            if (!mask[s + f] || (f > 0 && mask[s + f - 1]))
                continue; /* f: the first token of a response */
            int64_t N = 0, t = 0, u = 0;
            while (f + N < len && mask[s + f + N])
                N++;
            const int64_t k = zlab_loop(f, N, B, acc_pos + s, &t, &u);
            if (k < 0) {
                *unknown = s + u;
                return -1;
            }
            TST_CHECK(t == N - 1);
            seq_steps[d] += k;
            steps += k;
            *tokens += t;
        }
    }
    return steps;
}

static void test_against_zlab(void) {
    enum { MAXT = 400, MAXD = 16 };
    static int32_t cu[MAXD + 1], mask[MAXT], anchors[MAXT], acc[MAXT], acc_pos[MAXT];
    cm_rng         r;
    cm_rng_seed(&r, 2026);
    int64_t total_steps = 0, total_tokens = 0, dropped = 0;
    for (int trial = 0; trial < 500; trial++) {
        const int B = trial % 3 == 0 ? 8 : trial % 3 == 1 ? 16 : 4;
        const int n_seq = 1 + (int)cm_rng_below(&r, MAXD);
        int64_t   T = 0;
        cu[0] = 0;
        for (int d = 0; d < n_seq; d++) { /* prompt, response, sometimes another turn, sometimes nothing */
            const int64_t len = 1 + (int64_t)cm_rng_below(&r, trial % 5 == 0 ? 4 : MAXT / MAXD);
            const int64_t prompt = (int64_t)cm_rng_below(&r, len + 1);
            const int     turns = cm_rng_below(&r, 4) == 0;
            for (int64_t p = 0; p < len; p++) {
                mask[T + p] = p >= prompt;
                if (turns && p >= prompt && cm_rng_below(&r, 6) == 0)
                    mask[T + p] = 0;
            }
            T += len;
            cu[d + 1] = (int32_t)T;
        }
        int64_t n = 0;
        for (int64_t p = 0; p < T; p++)
            acc_pos[p] = -1;
        for (int d = 0; d < n_seq; d++)
            for (int32_t p = cu[d]; p + 1 < cu[d + 1]; p++)
                if (mask[p] &&
                    mask[p + 1]) { /* every candidate; acceptances up to B − 1 (a few past the end) */
                    anchors[n] = p;
                    acc[n] = (int32_t)(cm_rng_uniform(&r) < 0.5 ? 0 : cm_rng_below(&r, (uint64_t)B));
                    acc_pos[p] = acc[n++];
                }
        int64_t      seq[MAXD], zseq[MAXD], ztokens = 0, unknown = -1;
        dt_tau_chain c;
        if (!tst_ok(dt_tau_chain_walk(cu, n_seq, mask, T, anchors, acc, n, seq, &c), "random walk"))
            return;
        const int64_t zsteps = zlab_batch(cu, n_seq, mask, acc_pos, B, zseq, &ztokens, &unknown);
        int           ok = c.missing == -1 && zsteps == c.steps && ztokens == c.tokens;
        for (int d = 0; ok && d < n_seq; d++)
            ok = seq[d] == zseq[d];
        TST_CHECK(ok);
        if (!ok) {
            fprintf(stderr, "trial %d: walk %lld tokens in %lld steps, z-lab loop %lld in %lld\n", trial,
                    (long long)c.tokens, (long long)c.steps, (long long)ztokens, (long long)zsteps);
            return;
        }
        total_steps += c.steps;
        total_tokens += c.tokens;
        if (n > 0) { /* drop one anchor: missing exactly when the decoder needs it, at the first such place */
            const int64_t k = (int64_t)cm_rng_below(&r, (uint64_t)n), gone = anchors[k];
            acc_pos[gone] = -1;
            memmove(anchors + k, anchors + k + 1, (size_t)(n - k - 1) * sizeof *anchors);
            memmove(acc + k, acc + k + 1, (size_t)(n - k - 1) * sizeof *acc);
            TST_CHECK(dt_tau_chain_walk(cu, n_seq, mask, T, anchors, acc, n - 1, NULL, &c) == CM_OK);
            unknown = -1;
            const int64_t z = zlab_batch(cu, n_seq, mask, acc_pos, B, zseq, &ztokens, &unknown);
            TST_CHECK(z < 0 ? c.missing == gone && unknown == gone && c.steps == 0 && c.tokens == 0
                            : c.missing == -1 && c.steps == z && c.tokens == ztokens);
            dropped += z < 0;
        }
    }
    TST_CHECK(dropped > 50 && total_steps > 1000);
    printf("%-34s 500 random packed batches: every document's steps equal; %lld tokens in %lld steps; "
           "%lld drops the chain needed\n",
           "walk vs z-lab's loop", (long long)total_tokens, (long long)total_steps, (long long)dropped);
}

// ----------------------------------------------------------------------------
// 3. drafter-trainer grad on the oracle fixtures

typedef struct batch {
    cm_st   *st;
    int32_t *ids, *cu, *mask, *anchors;
    float   *F;
    int64_t  T, n_seq, n_anchors;
} batch;

static int32_t *i32_of(const cm_st *st, const char *name, int64_t *n) {
    const cm_st_tensor *t = st ? cm_st_find(st, name) : NULL;
    TST_CHECK(t && t->dtype == CM_DTYPE_I32 && t->n_dims == 1);
    if (!t || t->dtype != CM_DTYPE_I32 || t->n_dims != 1)
        return NULL;
    *n = t->shape[0];
    int32_t *v = malloc((size_t)(*n + 1) * sizeof *v);
    memcpy(v, t->data, (size_t)*n * sizeof *v);
    return v;
}

static double f64_of(const cm_st *st, const char *name) {
    const cm_st_tensor *t = st ? cm_st_find(st, name) : NULL;
    double              v = NAN;
    if (t && t->n_dims == 1 && t->shape[0] == 1 && cm_dtype_is_float(t->dtype))
        cm_convert(&v, CM_DTYPE_F64, t->data, t->dtype, 1);
    return v;
}

static int batch_load(batch *b, const char *path) {
    memset(b, 0, sizeof *b);
    int64_t n = 0;
    TST_CHECK(cm_st_open_file(&b->st, path) == CM_OK);
    b->ids = i32_of(b->st, "input_ids", &b->T);
    b->cu = i32_of(b->st, "cu_seqlens", &b->n_seq);
    b->mask = i32_of(b->st, "loss_mask", &n);
    b->anchors = i32_of(b->st, "anchors", &b->n_anchors);
    b->n_seq--;
    const cm_st_tensor *th = b->st ? cm_st_find(b->st, "target_hidden") : NULL;
    if (!b->ids || !b->cu || !b->mask || !b->anchors || !th)
        return 0;
    b->F = malloc((size_t)(th->shape[0] * th->shape[1]) * sizeof *b->F);
    return cm_st_read(b->st, "target_hidden", 2, th->shape, b->F, CM_DTYPE_F32) == CM_OK;
}

static void batch_free(batch *b) {
    free(b->ids), free(b->cu), free(b->mask), free(b->anchors), free(b->F);
    cm_st_destroy(&b->st);
}

/* The batch file again with anchors = every candidate (p and p + 1 supervised, one document); returns
 * their count, the positions in cand. */
static int64_t write_every_anchor(const batch *b, const char *path, int32_t *cand) {
    int64_t n = 0;
    for (int64_t d = 0; d < b->n_seq; d++)
        for (int32_t p = b->cu[d]; p + 1 < b->cu[d + 1]; p++)
            if (b->mask[p] && b->mask[p + 1])
                cand[n++] = p;
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    for (int i = 0; w && i < cm_st_count(b->st); i++) {
        const cm_st_tensor *t = cm_st_at(b->st, i);
        if (strcmp(t->name, "anchors") != 0)
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
    }
    TST_CHECK(w && cm_st_writer_add(w, "anchors", CM_DTYPE_I32, 1, &n, cand) == CM_OK);
    TST_CHECK(w && cm_st_writer_write(w, path) == CM_OK);
    cm_st_writer_destroy(&w);
    return n;
}

static cm_st *run_grad(const char *drafter, const char *batch_path, const char *out, const cm_st *ref) {
    char        err[128], alpha[64] = "", miss[16] = "";
    const char *a = cm_st_metadata(ref, "selector_alpha"), *mp = cm_st_metadata(ref, "selector_miss");
    char       *argv[20];
    int         n = 0;
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    argv[n++] = bin, argv[n++] = "grad", argv[n++] = "--drafter", argv[n++] = (char *)drafter;
    argv[n++] = "--batch", argv[n++] = (char *)batch_path, argv[n++] = "--out", argv[n++] = (char *)out;
    argv[n++] = "--log-level", argv[n++] = "warn";
    argv[n++] = "--loss-decay-gamma", argv[n++] = (char *)cm_st_metadata(ref, "gamma");
    if (a) {
        snprintf(alpha, sizeof alpha, "%s", a);
        argv[n++] = "--selector-alpha", argv[n++] = alpha;
    }
    if (mp) {
        snprintf(miss, sizeof miss, "%s", mp);
        argv[n++] = "--selector-miss", argv[n++] = miss;
    }
    argv[n] = NULL;
    const int rc = tst_run(argv, err);
    TST_CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "grad on '%s' exited %d:\n%s\n", batch_path, rc, tst_slurp(err));
        return NULL;
    }
    cm_st *got = NULL;
    TST_CHECK(cm_st_open_file(&got, out) == CM_OK);
    return got;
}

/* The path's acceptances in the output (prefix "" or "sel_"): n values, their mean + 1 equal to tau (as
 * F32), the number ≥ 1 equal to the slot-1 hits. Returns a malloc'd copy. */
static int32_t *accepted_of(const cm_st *got, const char *prefix, int64_t n, double tau, int64_t hits1) {
    char name[64];
    snprintf(name, sizeof name, "%saccepted", prefix);
    int64_t  m = -1;
    int32_t *acc = i32_of(got, name, &m);
    TST_CHECK(acc && m == n);
    if (!acc || m != n) {
        free(acc);
        return NULL;
    }
    double  sum = 0;
    int64_t one = 0;
    for (int64_t j = 0; j < n; j++) {
        sum += 1 + acc[j];
        one += acc[j] >= 1;
    }
    TST_CHECK(n > 0 && fabs(sum / (double)n - tau) <= 1e-6 * tau);
    TST_CHECK(one == hits1);
    return acc;
}

static int64_t slot1(const cm_st *st, const char *name) {
    int64_t       n = 0;
    int32_t      *v = i32_of(st, name, &n);
    const int64_t h = v && n > 1 ? v[1] : -1;
    free(v);
    return h;
}

/* tau_chain and its counts in the output against zlab_batch over the reported acceptances. */
static void check_chain(const char *name, const cm_st *got, const char *prefix, const batch *b,
                        const int32_t *cand, const int32_t *acc, int64_t n, int B, double *tau_out) {
    int32_t *acc_pos = malloc((size_t)b->T * sizeof *acc_pos);
    int64_t *seq = malloc((size_t)b->n_seq * sizeof *seq);
    for (int64_t p = 0; p < b->T; p++)
        acc_pos[p] = -1;
    for (int64_t j = 0; j < n; j++)
        acc_pos[cand[j]] = acc[j];
    int64_t       tokens = 0, unknown = -1;
    const int64_t steps = zlab_batch(b->cu, (int)b->n_seq, b->mask, acc_pos, B, seq, &tokens, &unknown);
    char          key[64];
    snprintf(key, sizeof key, "%schain_tokens", prefix);
    int64_t  k = 0;
    int32_t *t = i32_of(got, key, &k);
    snprintf(key, sizeof key, "%schain_steps", prefix);
    int32_t *s = i32_of(got, key, &k);
    snprintf(key, sizeof key, "%stau_chain", prefix);
    const double tau = f64_of(got, key);
    TST_CHECK(steps > 0 && t && s && t[0] == tokens && s[0] == steps);
    TST_CHECK(tau == (double)(float)((double)tokens / (double)steps));
    if (!(t && s && t[0] == tokens && s[0] == steps))
        fprintf(stderr, "%s: %stau_chain %lld/%lld, z-lab's loop %lld/%lld\n", name, prefix,
                t ? (long long)t[0] : -1LL, s ? (long long)s[0] : -1LL, (long long)tokens, (long long)steps);
    *tau_out = tau;
    free(t), free(s), free(acc_pos), free(seq);
}

/* Anchors alone through the dt_model API: τ − 1 (and sel_tau − 1) of that one block equal the acceptances
 * grad reported with every anchor in the batch; each anchor that accepts something and every 6th of the
 * others. Returns the anchors that disagree; *n_alone the anchors checked. */
static int64_t check_alone(const char *root, const char *name, const batch *b, const int32_t *cand, int64_t n,
                           const int32_t *acc, const int32_t *sel_acc, const cm_st *ref, int64_t *n_alone) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/%s/drafter", root, name);
    cm_drafter_cfg cfg;
    TST_CHECK(cm_drafter_cfg_load(&cfg, dir) == CM_OK);
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    int64_t           bad = n;
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    TST_CHECK(dt_model_create(&m, &cfg, be, ctx) == CM_OK && dt_model_load(m, dir) == CM_OK);
    const cm_st_tensor *e = cm_st_find(b->st, "embed_tokens"), *h = cm_st_find(b->st, "lm_head");
    if (!m || !e || !h)
        goto done;
    TST_CHECK(dt_model_set_frozen(m, e->data, e->dtype, h->data, h->dtype, e->shape[0], e->shape[1]) ==
              CM_OK);
    const char      *a = cm_st_metadata(ref, "selector_alpha"), *mp = cm_st_metadata(ref, "selector_miss");
    dt_selector_opts so = DT_SELECTOR_OPTS_DEFAULT;
    if (a)
        so.alpha = atof(a);
    if (mp && strcmp(mp, "drop") == 0)
        so.miss = KN_SEL_DROP;
    TST_CHECK(dt_model_set_selector(m, &so) == CM_OK);
    const float gamma = (float)atof(cm_st_metadata(ref, "gamma"));
    dt_batch    one = {.T = b->T,
                       .n_seq = (int)b->n_seq,
                       .cu_seqlens = b->cu,
                       .input_ids = b->ids,
                       .loss_mask = b->mask,
                       .target_hidden = b->F,
                       .n_anchors = 1};
    int32_t     got = -1;
    bad = 0;
    for (int64_t j = 0; j < n; j++) {
        if (acc[j] == 0 && (!sel_acc || sel_acc[j] == 0) && j % 6 != 0)
            continue; /* each anchor accepting something, and every 6th of the others (time) */
        dt_step_stats s;
        one.anchors = cand + j;
        TST_CHECK(dt_model_step(m, &one, gamma, &s) == CM_OK);
        TST_CHECK(dt_model_accepted(m, 0, &got) == CM_OK);
        int ok = got == acc[j] && s.tau == 1.0 + acc[j];
        if (sel_acc) {
            int32_t sel = -1;
            TST_CHECK(dt_model_accepted(m, 1, &sel) == CM_OK);
            ok = ok && sel == sel_acc[j] && s.sel_tau == 1.0 + sel_acc[j];
        }
        bad += !ok;
        (*n_alone)++;
        if (!ok && bad <= 3)
            fprintf(stderr,
                    "%s: anchor %d alone: tau %.3f sel_tau %.3f; with every anchor accepted %d (sel %d)\n",
                    name, cand[j], s.tau, s.sel_tau, acc[j], sel_acc ? sel_acc[j] : -1);
    }
    TST_CHECK(bad == 0);
    if (!sel_acc)
        TST_FAILS(dt_model_accepted(m, 1, &got), CM_ERR_INVALID_ARG, "DFlash drafter", "only 0");
    TST_FAILS(dt_model_accepted(m, 2, &got), CM_ERR_INVALID_ARG, "path 2");
done:
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return bad;
}

static void check_fixture(const char *root, const char *name) {
    char drafter[1200], path[1200], out[256], every[256];
    snprintf(drafter, sizeof drafter, "%s/%s/drafter", root, name);
    snprintf(path, sizeof path, "%s/%s/ref.safetensors", root, name);
    snprintf(out, sizeof out, "%s/out.safetensors", tmp);
    snprintf(every, sizeof every, "%s/every.safetensors", tmp);
    cm_st *ref = NULL, *got = NULL;
    batch  b;
    TST_CHECK(cm_st_open_file(&ref, path) == CM_OK);
    snprintf(path, sizeof path, "%s/%s/batch.safetensors", root, name);
    int32_t *cand = NULL, *acc = NULL, *sel = NULL;
    if (!batch_load(&b, path) || !ref)
        goto done;
    const int v2 = cm_st_find(ref, "sel_tau") != NULL, B = (int)cm_st_find(ref, "acc_hits")->shape[0];

    /* the fixture's own anchors: accepted against the float64 oracle's τ and slot-1 hits; no chain */
    if (!(got = run_grad(drafter, path, out, ref)))
        goto done;
    free(accepted_of(got, "", b.n_anchors, f64_of(ref, "tau"), slot1(ref, "acc_hits")));
    if (v2)
        free(accepted_of(got, "sel_", b.n_anchors, f64_of(ref, "sel_tau"), slot1(ref, "sel_hits")));
    TST_CHECK(!cm_st_find(got, "tau_chain") && !cm_st_find(got, "sel_tau_chain"));
    cm_st_destroy(&got);

    /* every anchor candidate: the chain, and each anchor alone */
    cand = malloc((size_t)b.T * sizeof *cand);
    const int64_t n = write_every_anchor(&b, every, cand);
    if (!(got = run_grad(drafter, every, out, ref)))
        goto done;
    acc = accepted_of(got, "", n, f64_of(got, "tau"), slot1(got, "acc_hits"));
    if (v2)
        sel = accepted_of(got, "sel_", n, f64_of(got, "sel_tau"), slot1(got, "sel_hits"));
    if (!acc || (v2 && !sel))
        goto done;
    double tau_chain = 0, sel_chain = 0;
    check_chain(name, got, "", &b, cand, acc, n, B, &tau_chain);
    if (v2)
        check_chain(name, got, "sel_", &b, cand, sel, n, B, &sel_chain);
    int64_t       alone = 0;
    const int64_t bad = check_alone(root, name, &b, cand, n, acc, sel, ref, &alone);
    printf("%-34s %3lld anchors: tau %.4f, tau_chain %.4f", name, (long long)n, f64_of(got, "tau"),
           tau_chain);
    if (v2)
        printf(", sel_tau %.4f, sel_tau_chain %.4f", f64_of(got, "sel_tau"), sel_chain);
    printf("; %lld anchors alone: %lld differ\n", (long long)alone, (long long)bad);
done:
    free(cand), free(acc), free(sel);
    batch_free(&b);
    cm_st_destroy(&got);
    cm_st_destroy(&ref);
}

int main(void) {
    test_hand_made();
    test_against_zlab();
    snprintf(bin, sizeof bin, "%s/drafter-trainer/drafter-trainer", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-taucv-XXXXXX");
    TST_CHECK(mkdtemp(tmp) != NULL);
    static const char *const roots[] = {"drafter", "drafter2"};
    for (int r = 0; r < 2; r++) {
        char root[1024], *names[64];
        snprintf(root, sizeof root, "%s/fixtures/%s", TANDEM_TEST_DATA, roots[r]);
        const int n = tst_dt_fixtures(root, names);
        TST_CHECK(n >= 3);
        for (int i = 0; i < n; i++) {
            check_fixture(root, names[i]);
            free(names[i]);
        }
    }
    TST_CHECK(tst_rmdir(tmp));
    return tst_report();
}
