/* drafter-trainer/cmd/dt_eval_loop.c — the decoding loop of `drafter-trainer eval` (dt_eval.h): up to
 * `batch` sequences per DECODE step, new prompts admitted as others finish, drafts from the drafter
 * for every running sequence in one call, the answer's committed taps into the drafter's cache in one
 * call, the figures per prompt. Every buffer is allocated before the first step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_time.h"
#include "dt_eval.h"

// ----------------------------------------------------------------------------
// dt_infer as the drafter

static cm_status inf_append(void *u, const dt_infer_rows *rows) {
    return dt_infer_append(u, rows);
}
static cm_status inf_draft(void *u, int block, int n, const int32_t *slots, const int32_t *anchor,
                           int32_t *drafts) {
    return dt_infer_draft_block(u, block, n, slots, anchor, drafts, NULL);
}
static void inf_reset(void *u, int slot) {
    dt_infer_reset(u, slot);
}

dt_eval_drafter dt_eval_drafter_infer(dt_infer *inf) {
    dt_eval_drafter d = {0};
    d.n_slots = dt_infer_n_slots(inf);
    d.block = dt_infer_block(inf);
    d.append = inf_append;
    d.draft = inf_draft;
    d.reset = inf_reset;
    d.user = inf;
    return d;
}

// ----------------------------------------------------------------------------
// the loop

/* An active sequence. */
typedef struct live {
    int64_t  p;       /* prompt index */
    int      slot;    /* drafter slot */
    int      started; /* has a handle (its prefill answered) */
    uint32_t handle;
    uint32_t base;     /* committed tokens */
    int32_t  anchor;   /* the token the last answer returned */
    int      n_draft;  /* drafts of this step */
    int      draft_at; /* its row in the step's drafts, or −1 */
    int      done;
} live;

typedef struct loop {
    const dt_eval_target  *t;
    const dt_eval_drafter *d;
    const dt_eval_opts    *o;
    int                    B;
    live                  *act;     /* [batch] */
    uint8_t               *used;    /* [n_slots] */
    int32_t               *dslots;  /* [batch] */
    int32_t               *danchor; /* [batch] */
    int32_t               *drafts;  /* [batch, B − 1] */
    int32_t               *n_rows;  /* [batch] */
    cm_proto_decode        rq;
    cm_proto_answer        ans;
    uint64_t               id;
    int64_t                n, n_done; /* prompts, and those finished */
    double                 draft_s, verify_s;
} loop;

static const cm_proto_tensor *find_tensor(const cm_proto_answer *a, const char *name) {
    for (uint32_t i = 0; i < a->n_tensors; i++)
        if (strcmp(a->tensors[i].name, name) == 0)
            return &a->tensors[i];
    return NULL;
}

/* Emits one token of s; 1 when s is finished (an EOS token, or max_new reached). */
static int emit(dt_eval_seq *s, int32_t tok, const dt_eval_opts *o) {
    if (s->generated >= o->max_new)
        return 1;
    s->out[s->generated++] = tok;
    for (int e = 0; e < o->n_eos; e++)
        if (tok == o->eos[e]) {
            s->eos = 1;
            return 1;
        }
    return s->generated >= o->max_new;
}

static cm_status step(loop *L, cm_proto_decode *rq) {
    rq->id = L->id++;
    const double t0 = cm_now_s();
    cm_status    st = L->t->step(L->t->user, rq, &L->ans);
    L->verify_s += cm_now_s() - t0;
    return st;
}

/* CLOSEs the finished sequences' handles. */
static cm_status close_done(loop *L, int n_act) {
    cm_proto_decode rq = L->rq;
    rq.op = CM_DECODE_CLOSE;
    rq.n_seqs = rq.n_tokens = rq.n_layers = 0;
    for (int i = 0; i < n_act; i++)
        if (L->act[i].done && L->act[i].started)
            rq.seqs[rq.n_seqs++] =
                (cm_proto_decode_seq){.handle = L->act[i].handle, .base = L->act[i].base, .top_p = 1.0f};
    return rq.n_seqs ? step(L, &rq) : CM_OK;
}

/* The step's drafts: one call for every running sequence that drafts this step. */
static cm_status draft_all(loop *L, int n_act, const dt_eval_seq *seqs) {
    const dt_eval_opts *o = L->o;
    int                 nd = 0;
    for (int i = 0; i < n_act; i++) {
        live *a = &L->act[i];
        a->n_draft = 0;
        a->draft_at = -1;
        if (!a->started || o->target_only)
            continue;
        /* as z-lab's dflash_generate: the block ends at the last position max_new allows (a draft
         * accepted there still emits, its bonus does not) */
        const int64_t rem = o->max_new - seqs[a->p].generated;
        a->n_draft = (int)(rem < L->B - 1 ? rem : L->B - 1);
        if (a->n_draft <= 0) {
            a->n_draft = 0;
            continue;
        }
        a->draft_at = nd++;
    }
    /* one call per block length (the full one, and shorter ones near max_new, as z-lab's decoder drafts
     * them), each call's rows put at their sequences' places in L->drafts [nd, B − 1] */
    const double t0 = cm_now_s();
    cm_status    st = CM_OK;
    for (int len = L->B - 1; len >= 1 && st == CM_OK; len--) {
        int m = 0;
        for (int i = 0; i < n_act; i++)
            if (L->act[i].draft_at >= 0 && L->act[i].n_draft == len) {
                L->dslots[m]    = L->act[i].slot;
                L->danchor[m++] = L->act[i].anchor;
            }
        if (!m) continue;
        int32_t *out = L->drafts + (size_t)(nd * (L->B - 1)); /* scratch past the used rows */
        st           = L->d->draft(L->d->user, len + 1, m, L->dslots, L->danchor, out);
        for (int i = 0, k = 0; st == CM_OK && i < n_act; i++)
            if (L->act[i].draft_at >= 0 && L->act[i].n_draft == len)
                memcpy(L->drafts + (size_t)L->act[i].draft_at * (size_t)(L->B - 1), out + (size_t)(k++) * len,
                       (size_t)len * sizeof(int32_t));
    }
    L->draft_s += cm_now_s() - t0;
    return st;
}

/* The answer's "decode" row i: handle, committed, accepted, next. */
static void decode_row(const cm_proto_tensor *t, int i, int32_t r[4]) {
    memcpy(r, (const char *)t->data + (size_t)i * 4 * sizeof(int32_t), 4 * sizeof(int32_t));
}

/* Checks the answer against the request: the "decode" tensor, each sequence's handle, length and
 * accepted count, and (with taps) every "layer_<id>" [Σ (n_ctx + a), hidden] in one float dtype. Fills
 * L->n_rows and the append's row set. */
static cm_status check_answer(loop *L, int n_act, dt_infer_rows *rows) {
    const dt_eval_opts    *o = L->o;
    const cm_proto_answer *ans = &L->ans;
    const cm_proto_tensor *dec = find_tensor(ans, "decode");
    if (!dec || dec->dtype != CM_DTYPE_I32 || dec->n_dims != 2 || dec->shape[0] != n_act ||
        dec->shape[1] != 4)
        return CM_FAIL(
            CM_ERR_PROTOCOL,
            "the target's answer has no \"decode\" tensor I32 [%d, 4] (one row per sequence of the "
            "step); is the decoding endpoint a target-server's?",
            n_act);
    int64_t total = 0;
    for (int i = 0; i < n_act; i++) {
        const live *a = &L->act[i];
        int32_t     r[4];
        decode_row(dec, i, r);
        const uint32_t n_ctx = L->rq.seqs[i].n_ctx;
        if ((a->started && (uint32_t)r[0] != a->handle) || (!a->started && r[0] == 0) || r[2] < 0 ||
            r[2] > a->n_draft || (uint32_t)r[1] != a->base + n_ctx + (uint32_t)r[2] || r[3] < 0)
            return CM_FAIL(
                CM_ERR_PROTOCOL,
                "the target answered sequence %d of the step with (handle %d, committed %d, accepted %d, "
                "next %d) for a request of (handle %u, base %u, %u tokens, %d drafts)",
                i, r[0], r[1], r[2], r[3], a->handle, a->base, n_ctx, a->n_draft);
        L->n_rows[i] = (int32_t)(n_ctx + (uint32_t)r[2]);
        total += L->n_rows[i];
    }
    for (int i = 0; i < n_act; i++)
        L->dslots[i] = L->act[i].slot;
    memset(rows, 0, sizeof *rows);
    rows->n_seq = n_act;
    rows->slots = L->dslots;
    rows->n_rows = L->n_rows;
    rows->ld = o->hidden;
    if (o->target_only)
        return CM_OK;
    for (int k = 0; k < o->n_taps; k++) {
        char name[CM_PROTO_NAME_MAX + 1];
        snprintf(name, sizeof name, "layer_%d", o->layer_ids[k]);
        const cm_proto_tensor *t = find_tensor(ans, name);
        if (!t)
            return CM_FAIL(CM_ERR_PROTOCOL, "the target's answer has no \"%s\" (the drafter's tap %d)", name,
                           k);
        if ((t->dtype != CM_DTYPE_F32 && t->dtype != CM_DTYPE_BF16) || (k > 0 && t->dtype != rows->dt))
            return CM_FAIL(CM_ERR_PROTOCOL, "the target's \"%s\" is %s; expected F32 or BF16 like every tap",
                           name, cm_dtype_name(t->dtype));
        if (t->n_dims != 2 || t->shape[0] != total)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "the target's \"%s\" has %lld rows; the step committed %lld tokens", name,
                           (long long)(t->n_dims == 2 ? t->shape[0] : -1), (long long)total);
        if (t->shape[1] != o->hidden)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "the target's hidden states are %lld wide but the drafter's hidden size is %lld; serve the "
                "model the drafter was trained for",
                (long long)t->shape[1], (long long)o->hidden);
        rows->dt = t->dtype;
        rows->tap[k] = t->data;
    }
    return CM_OK;
}

/* One step of the n_act active sequences: drafts, the DECODE, the taps into the drafter, the figures. */
static cm_status one_step(loop *L, int n_act, const dt_eval_prompt *prompts, dt_eval_seq *seqs) {
    const dt_eval_opts *o = L->o;
    cm_proto_decode    *rq = &L->rq;
    CM_TRY(draft_all(L, n_act, seqs));
    rq->op = CM_DECODE_STEP;
    rq->encoding = o->encoding;
    rq->n_seqs = (uint32_t)n_act;
    rq->n_tokens = 0;
    rq->n_layers = o->target_only ? 0 : (uint32_t)o->n_taps;
    const double now = cm_now_s();
    for (int i = 0; i < n_act; i++) {
        live                *a = &L->act[i];
        cm_proto_decode_seq *r = &rq->seqs[i];
        *r = (cm_proto_decode_seq){.handle = a->handle,
                                   .base = a->base,
                                   .top_k = o->top_k,
                                   .temperature = o->temperature,
                                   .top_p = o->top_p,
                                   .flags = o->flags,
                                   .seed = o->seed + (uint64_t)a->p};
        int32_t *tok = rq->tokens + rq->n_tokens;
        if (!a->started) {
            const dt_eval_prompt *p = &prompts[a->p];
            r->n_ctx = (uint32_t)p->n;
            memcpy(tok, p->ids, (size_t)p->n * sizeof *tok);
            seqs[a->p].t_start = now;
        } else {
            r->n_ctx = 1;
            r->n_draft = (uint32_t)a->n_draft;
            tok[0] = a->anchor;
            if (a->n_draft)
                memcpy(tok + 1, L->drafts + (size_t)a->draft_at * (size_t)(L->B - 1),
                       (size_t)a->n_draft * sizeof *tok);
        }
        rq->n_tokens += r->n_ctx + r->n_draft;
    }
    CM_TRY(step(L, rq));
    dt_infer_rows rows;
    CM_TRY(check_answer(L, n_act, &rows));
    if (!o->target_only) {
        const double t0 = cm_now_s();
        CM_TRY(L->d->append(L->d->user, &rows));
        L->draft_s += cm_now_s() - t0;
    }
    const cm_proto_tensor *dec = find_tensor(&L->ans, "decode");
    const double           done_at = cm_now_s();
    for (int i = 0; i < n_act; i++) {
        live        *a = &L->act[i];
        dt_eval_seq *s = &seqs[a->p];
        int32_t      r[4];
        decode_row(dec, i, r);
        if (!a->started) {
            a->started = 1;
            a->handle = (uint32_t)r[0];
            a->done = emit(s, r[3], o);
        } else {
            const int64_t  before = s->generated;
            const int32_t *d = L->drafts + (size_t)(a->draft_at < 0 ? 0 : a->draft_at) * (size_t)(L->B - 1);
            for (int k = 0; k < r[2] && !a->done; k++)
                a->done = emit(s, d[k], o);
            if (!a->done)
                a->done = emit(s, r[3], o);
            dt_eval_seq_step(s, a->n_draft, r[2], (int)(s->generated - before));
        }
        a->base = (uint32_t)r[1];
        a->anchor = r[3];
        if (a->done) {
            s->t_end = done_at;
            L->n_done++;
            cm_log_write(o->quiet ? CM_LOG_LEVEL_DEBUG : CM_LOG_LEVEL_INFO,
                         "%lld of %lld prompts done; prompt %lld (document %lld): %lld tokens%s in %lld "
                         "steps, tau %.2f",
                         (long long)L->n_done, (long long)L->n, (long long)a->p, (long long)s->doc,
                         (long long)s->generated, s->eos ? " (EOS)" : "", (long long)s->steps,
                         dt_eval_seq_tau(s));
        }
    }
    return CM_OK;
}

cm_status dt_eval_run(const dt_eval_target *t, const dt_eval_drafter *d, const dt_eval_opts *o,
                      const dt_eval_prompt *prompts, int64_t n, dt_eval_seq *seqs, double *wall_s,
                      double *draft_s, double *verify_s) {
    if (!t || !o || (!d && !o->target_only) || o->batch < 1 || o->max_new < 1 || (n > 0 && !prompts))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "dt_eval_run: a verifier, a drafter (unless target only), a batch and "
                       "max_new of at least 1");
    if (!o->target_only && (o->batch > d->n_slots || d->block < 2 || d->block > DT_EVAL_MAX_BLOCK))
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_eval_run: batch %d needs as many drafter slots (it has %d)",
                       o->batch, d->n_slots);
    cm_status st = CM_OK;
    loop      L = {.t = t, .d = d, .o = o, .B = o->target_only ? 1 : d->block, .id = 1, .n = n};
    int64_t   longest = 1;
    for (int64_t i = 0; i < n; i++) {
        if (prompts[i].n < 1 || prompts[i].n > INT32_MAX / 2)
            return CM_FAIL(CM_ERR_INVALID_ARG, "prompt %lld has %lld tokens", (long long)i,
                           (long long)prompts[i].n);
        longest = prompts[i].n > longest ? prompts[i].n : longest;
    }
    const int     batch = o->batch, B = L.B, n_slots = o->target_only ? batch : d->n_slots;
    const int64_t cap_tokens = (int64_t)batch * (longest > B ? longest : B);
    memset(seqs, 0, (size_t)n * sizeof *seqs);
    L.act = calloc((size_t)batch, sizeof *L.act);
    L.used = calloc((size_t)n_slots, 1);
    L.dslots = calloc((size_t)batch, sizeof(int32_t));
    L.danchor = calloc((size_t)batch, sizeof(int32_t));
    L.drafts = calloc(2 * (size_t)batch * (size_t)B, sizeof(int32_t)); /* the rows, then a call's scratch */
    L.n_rows = calloc((size_t)batch, sizeof(int32_t));
    L.rq.seqs = calloc((size_t)batch, sizeof *L.rq.seqs);
    L.rq.tokens = malloc((size_t)cap_tokens * sizeof(int32_t));
    L.rq.layer_ids = malloc((size_t)(o->n_taps > 0 ? o->n_taps : 1) * sizeof(int32_t));
    L.rq.cap_seqs = (uint32_t)batch;
    L.rq.cap_tokens = (uint32_t)cap_tokens;
    L.rq.cap_layers = (uint32_t)(o->n_taps > 0 ? o->n_taps : 1);
    L.ans.cap_tensors = (uint32_t)(o->n_taps + 8);
    L.ans.tensors = calloc(L.ans.cap_tensors, sizeof *L.ans.tensors);
    for (int64_t i = 0; i < n; i++) {
        seqs[i].out   = malloc((size_t)(o->max_new + DT_EVAL_MAX_BLOCK) * sizeof(int32_t));
        seqs[i].trace = malloc((size_t)(2 * o->max_new + 2) * sizeof(int32_t));
    }
    int all = L.act && L.used && L.dslots && L.danchor && L.drafts && L.n_rows && L.rq.seqs && L.rq.tokens &&
              L.rq.layer_ids && L.ans.tensors;
    for (int64_t i = 0; i < n; i++)
        all = all && seqs[i].out && seqs[i].trace;
    if (!all) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding loop's buffers for %lld prompts",
                     (long long)n);
        goto done;
    }
    for (int k = 0; k < o->n_taps; k++)
        L.rq.layer_ids[k] = o->layer_ids[k];
    const double t0 = cm_now_s();
    int64_t      next = 0;
    int          n_act = 0;
    while (next < n || n_act > 0) {
        while (n_act < batch && next < n) { /* admit the next prompt into a free slot */
            live *a = &L.act[n_act++];
            int   slot = 0;
            while (L.used[slot])
                slot++;
            L.used[slot] = 1;
            *a = (live){.p = next, .slot = slot, .draft_at = -1};
            seqs[next].doc = prompts[next].doc;
            seqs[next].prompt_len = prompts[next].n;
            if (!o->target_only)
                d->reset(d->user, slot);
            next++;
        }
        CM_TRY_GOTO(one_step(&L, n_act, prompts, seqs), st, done);
        CM_TRY_GOTO(close_done(&L, n_act), st, done);
        int kept = 0;
        for (int i = 0; i < n_act; i++)
            if (L.act[i].done)
                L.used[L.act[i].slot] = 0;
            else
                L.act[kept++] = L.act[i];
        n_act = kept;
    }
    *wall_s = cm_now_s() - t0;
    if (draft_s)
        *draft_s = L.draft_s;
    if (verify_s)
        *verify_s = L.verify_s;
done:
    free(L.act);
    free(L.used);
    free(L.dslots);
    free(L.danchor);
    free(L.drafts);
    free(L.n_rows);
    free(L.rq.seqs);
    free(L.rq.tokens);
    free(L.rq.layer_ids);
    free(L.ans.tensors);
    return st;
}
