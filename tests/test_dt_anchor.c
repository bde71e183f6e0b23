/* tests/test_dt_anchor.c — training anchors (docs/drafter.md): the candidate rule on crafted masks
 * and document boundaries and against an independent per-token rule on random batches; the
 * draw (no duplicates, sorted, only candidates, max_anchors cap, all candidates when fewer,
 * zero-candidate batches); reproducibility from (seed, epoch, batch id) and independence from
 * call history; rough uniformity of selection; and bad layouts refused with a message. */
#include <stdint.h>
#include <string.h>

#include "cm_rng.h"
#include "dt_anchor.h"
#include "tst.h"

#define MAXT 4096

static int32_t work[MAXT], anchors[MAXT];

static int64_t cands(const int32_t *cu, int n_seq, const int32_t *mask, int64_t T, int32_t *out) {
    TST_CHECK(dt_anchor_check(cu, n_seq, mask, T) == CM_OK);
    return dt_anchor_candidates(cu, n_seq, mask, T, out);
}

static int same_list(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, (size_t)na * sizeof *a) == 0);
}

static void test_crafted(void) {
    int32_t out[64];
    { /* one document, all supervised: every position but the last */
        int32_t cu[] = {0, 10}, m[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        int32_t want[] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
        TST_CHECK(same_list(out, cands(cu, 1, m, 10, out), want, 9));
    }
    { /* two documents: the last token of each is not a candidate */
        int32_t cu[] = {0, 4, 9}, m[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
        int32_t want[] = {0, 1, 2, 4, 5, 6, 7};
        TST_CHECK(same_list(out, cands(cu, 2, m, 9, out), want, 7));
    }
    { /* unsupervised tokens: p needs mask[p] and mask[p + 1] */
        int32_t cu[] = {0, 10}, m[10] = {1, 1, 0, 1, 1, 1, 0, 0, 1, 1};
        int32_t want[] = {0, 3, 4, 8};
        TST_CHECK(same_list(out, cands(cu, 1, m, 10, out), want, 4));
    }
    { /* prompt then answer in two documents */
        int32_t cu[] = {0, 5, 10}, m[10] = {0, 0, 1, 1, 1, 0, 1, 1, 1, 1};
        int32_t want[] = {2, 3, 6, 7, 8};
        TST_CHECK(same_list(out, cands(cu, 2, m, 10, out), want, 5));
    }
    { /* no candidate: alternating mask, and single-token documents */
        int32_t cu[] = {0, 6}, m[6] = {1, 0, 1, 0, 1, 0};
        TST_CHECK(cands(cu, 1, m, 6, out) == 0);
        int32_t cu1[] = {0, 1, 2, 3}, m1[3] = {1, 1, 1};
        TST_CHECK(cands(cu1, 3, m1, 3, out) == 0);
        int64_t n = -1;
        TST_CHECK(dt_anchor_sample(cu1, 3, m1, 3, 512, 0, 0, 0, work, anchors, &n) == CM_OK && n == 0);
        TST_CHECK(dt_anchor_sample(cu, 1, m, 6, 4, 1, 2, 3, work, anchors, &n) == CM_OK && n == 0);
    }
    { /* fewer candidates than max_anchors: all of them, in order */
        int32_t cu[] = {0, 4, 9}, m[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
        int32_t want[] = {0, 1, 2, 4, 5, 6, 7};
        int64_t n = 0;
        TST_CHECK(dt_anchor_sample(cu, 2, m, 9, 7, 5, 0, 0, work, anchors, &n) == CM_OK);
        TST_CHECK(same_list(anchors, n, want, 7));
        TST_CHECK(dt_anchor_sample(cu, 2, m, 9, 512, 5, 0, 0, work, anchors, &n) == CM_OK);
        TST_CHECK(same_list(anchors, n, want, 7));
    }
}

/* A random packed batch: documents of 1..60 tokens, a prompt of unsupervised tokens, then a
 * mostly supervised answer with a few holes. */
static int64_t random_batch(cm_rng *r, int32_t *cu, int *n_seq, int32_t *mask, int64_t Tmax) {
    int64_t T = 0;
    int     n = 0;
    cu[0] = 0;
    while (T < Tmax - 60) {
        int len = 1 + (int)cm_rng_below(r, 60);
        int prompt = (int)cm_rng_below(r, (uint64_t)len + 1);
        for (int i = 0; i < len; i++)
            mask[T + i] = i >= prompt && cm_rng_below(r, 10) != 0;
        T += len;
        cu[++n] = (int32_t)T;
    }
    *n_seq = n;
    return T;
}

static void test_random_batches(void) {
    static int32_t cu[MAXT + 1], mask[MAXT], doc[MAXT], cand[MAXT], a2[MAXT];
    cm_rng         r;
    cm_rng_seed(&r, 2024);
    for (int trial = 0; trial < 40; trial++) {
        int     n_seq;
        int64_t T = random_batch(&r, cu, &n_seq, mask, 2000);
        for (int d = 0; d < n_seq; d++)
            for (int32_t p = cu[d]; p < cu[d + 1]; p++)
                doc[p] = d;
        /* independent rule: per token, look at the next token's document and mask */
        int64_t nc = 0;
        for (int64_t p = 0; p + 1 < T; p++)
            if (mask[p] && mask[p + 1] && doc[p] == doc[p + 1])
                cand[nc++] = (int32_t)p;
        int32_t got[MAXT];
        TST_CHECK(same_list(got, cands(cu, n_seq, mask, T, got), cand, nc));

        int64_t max_anchors = 1 + (int64_t)cm_rng_below(&r, 300);
        int64_t n = -1, n2 = -1;
        TST_CHECK(dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 7, (uint64_t)trial, 11, work, anchors,
                                   &n) == CM_OK);
        TST_CHECK(n == (nc < max_anchors ? nc : max_anchors));
        int sorted = 1, member = 1;
        for (int64_t i = 0; i < n; i++) {
            if (i > 0 && anchors[i] <= anchors[i - 1])
                sorted = 0; /* strictly: no duplicates */
            int found = 0;
            for (int64_t j = 0; j < nc && !found; j++)
                found = cand[j] == anchors[i];
            member &= found;
        }
        TST_CHECK(sorted);
        TST_CHECK(member);

        /* same (seed, epoch, batch) → same anchors, whatever ran in between */
        int64_t dummy;
        dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 99, 3, 4, work, a2, &dummy);
        TST_CHECK(dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 7, (uint64_t)trial, 11, work, a2, &n2) ==
                  CM_OK);
        TST_CHECK(same_list(anchors, n, a2, n2));
        if (n < nc && n >= 8) {
            /* another epoch, batch id or seed draws a different subset */
            dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 7, (uint64_t)trial + 1, 11, work, a2, &n2);
            TST_CHECK(n2 == n && !same_list(anchors, n, a2, n2));
            dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 7, (uint64_t)trial, 12, work, a2, &n2);
            TST_CHECK(n2 == n && !same_list(anchors, n, a2, n2));
            dt_anchor_sample(cu, n_seq, mask, T, max_anchors, 8, (uint64_t)trial, 11, work, a2, &n2);
            TST_CHECK(n2 == n && !same_list(anchors, n, a2, n2));
        }
    }
}

static void test_uniform_selection(void) {
    /* 20 candidates, 5 drawn, 8000 epochs: each candidate is chosen 2000 times on average
     * (sd about 39); allow ±10 % */
    int32_t cu[] = {0, 21}, m[21];
    for (int i = 0; i < 21; i++)
        m[i] = 1;
    long hits[21] = {0};
    for (uint64_t e = 0; e < 8000; e++) {
        int64_t n;
        dt_anchor_sample(cu, 1, m, 21, 5, 3, e, 0, work, anchors, &n);
        TST_CHECK(n == 5);
        for (int64_t i = 0; i < n; i++)
            hits[anchors[i]]++;
    }
    int ok = hits[20] == 0;
    for (int p = 0; p < 20; p++)
        ok &= hits[p] > 1800 && hits[p] < 2200;
    TST_CHECK(ok);
}

static void test_bad_layouts(void) {
    int32_t m[6] = {1, 1, 1, 1, 1, 1}, bad_m[6] = {1, 1, 2, 1, 1, 1};
    int64_t n;
    int32_t cu_ok[] = {0, 3, 6}, cu_start[] = {1, 3, 6}, cu_flat[] = {0, 3, 3, 6}, cu_end[] = {0, 3, 5};
    TST_CHECK(dt_anchor_sample(cu_ok, 2, m, 6, 0, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "max_anchors") != NULL);
    TST_CHECK(dt_anchor_sample(cu_start, 2, m, 6, 4, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
    TST_CHECK(dt_anchor_sample(cu_flat, 3, m, 6, 4, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "strictly increasing") != NULL);
    TST_CHECK(dt_anchor_sample(cu_end, 2, m, 6, 4, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
    TST_CHECK(dt_anchor_sample(cu_ok, 2, bad_m, 6, 4, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "loss_mask[2]") != NULL);
    TST_CHECK(dt_anchor_sample(cu_ok, 0, m, 6, 4, 0, 0, 0, work, anchors, &n) == CM_ERR_INVALID_ARG);
}

int main(void) {
    test_crafted();
    test_random_batches();
    test_uniform_selection();
    test_bad_layouts();
    return tst_report();
}
