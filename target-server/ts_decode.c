/* target-server/ts_decode.c — DECODE steps on the target (ts_decode.h; the message is documented
 * in cm_proto.h). A step runs in up to two kinds of forward over the cache:
 *   - sequences without drafts (a prompt being prefilled, or the target going on alone): their
 *     tokens are all committed, so the GDN states advance inside the forward; a long prompt is
 *     split into pieces of at most max_forward tokens, each piece a forward of its own;
 *   - sequences with drafts: one forward over every such sequence's context and draft tokens
 *     that keeps its GDN inputs; the target's tokens at the draft positions decide how many
 *     drafts are accepted, and ts_cache_commit advances each state by the committed prefix.
 * The target's token at a position is its argmax (greedy) or a draw with the sequence's sampling
 * settings from its own stream; a draft is accepted while it equals that token. With drafts that
 * do not depend on the target's draws this is rejection sampling with the draft as a point mass:
 * accepted with probability p(draft), and on rejection the token is drawn from p without the
 * draft, renormalised; the output follows the target's distribution exactly. */
#include "ts_decode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_rng.h"
#include "cm_time.h"
#include "ts_sample.h"

typedef struct dseq {
    int      used;
    uint32_t handle;
    char     owner[2 * CM_PROTO_NAME_MAX + 1];
    int64_t  len; /* committed tokens */
    float    temperature, top_p;
    int      top_k;
    cm_rng   rng;
} dseq;

/* One sequence's part of a forward: tokens [off, off + n) of its record's tokens. */
typedef struct piece {
    int     rec;
    int64_t off, n;
    int     head; /* 1: the last piece of its record: the head runs on its posterior rows */
} piece;

struct ts_decoder {
    ts_model            *m;      /* the target in one model, with its cache; or */
    ts_cache            *cache;
    ts_split            *sp;     /* the target over a split's stages, with theirs */
    ts_split_cache      *scache;
    ts_decoder_config    cfg;
    const cm_target_cfg *tc;
    dseq                *seqs; /* [max_seqs], indexed by cache slot */
    uint32_t             next_handle;
    ts_sampler           sampler;
    double               commit_s; /* in ts_cache_commit */
    int64_t              n_commits;
    /* per step, host, grown to fit */
    int64_t  cap_n, cap_t, cap_rows;
    int      cap_l;
    int32_t *slot_of, *tok_off, *acc, *nxt, *out_off; /* [N] per record */
    int32_t *ids, *cu, *slots, *base, *adv, *rows, *am; /* a forward's arrays */
    piece   *pieces;
    float   *logits;   /* [rows, V] when a sampled sequence is in the forward */
    float  **lay;      /* [L] host [T, D] captures */
    int     *lay_ids;  /* the capture's layers, ascending */
    int     *lay_pos;  /* request position of lay_ids[i] */
    uint8_t *out;      /* the answer's hidden states, [L][rows_max, D] in hidden dtype */
    int32_t *dec;      /* [N, 4] */
};

size_t ts_decoder_bytes(const cm_target_cfg *c, const ts_decoder_config *cfg) {
    return ts_cache_bytes(c, cfg->max_seqs, cfg->max_len, cfg->max_step);
}

/* One of m and sp. */
static cm_status create(ts_model *m, ts_split *sp, const ts_decoder_config *cfg, ts_decoder **out) {
    *out = NULL;
    if (cfg->max_seqs < 1 || cfg->max_len < 2 || cfg->max_step < 1 || cfg->max_forward < 1 ||
        (cfg->hidden_dtype != CM_DTYPE_F32 && cfg->hidden_dtype != CM_DTYPE_BF16))
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoder: bad limits (%d sequences, %lld tokens, step %lld, forward %lld) "
                                           "or hidden dtype",
                       cfg->max_seqs, (long long)cfg->max_len, (long long)cfg->max_step, (long long)cfg->max_forward);
    if (m && (ts_model_first_layer(m) != 0 || ts_model_n_loaded_layers(m) != ts_model_cfg(m)->n_layers || !ts_model_has_head(m)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding needs every layer and the head loaded (layers %d to %d of %d%s)",
                       ts_model_first_layer(m), ts_model_n_loaded_layers(m) - 1, ts_model_cfg(m)->n_layers,
                       ts_model_has_head(m) ? "" : ", no head");
    ts_decoder *d = calloc(1, sizeof *d);
    if (!d) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a decoder");
    d->m           = m;
    d->sp          = sp;
    d->cfg         = *cfg;
    d->tc          = m ? ts_model_cfg(m) : ts_split_cfg(sp);
    d->next_handle = 1;
    d->seqs        = calloc((size_t)cfg->max_seqs, sizeof *d->seqs);
    cm_status st   = d->seqs ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d decoding sequences", cfg->max_seqs);
    if (st == CM_OK)
        st = m ? ts_cache_create(m, cfg->max_seqs, cfg->max_len, cfg->max_step, &d->cache)
               : ts_split_cache_create(sp, cfg->max_seqs, cfg->max_len, cfg->max_step, &d->scache);
    if (st != CM_OK) {
        ts_decoder_destroy(&d);
        return st;
    }
    *out = d;
    return CM_OK;
}

cm_status ts_decoder_create(ts_model *m, const ts_decoder_config *cfg, ts_decoder **out) {
    return create(m, NULL, cfg, out);
}

cm_status ts_decoder_create_split(ts_split *sp, const ts_decoder_config *cfg, ts_decoder **out) {
    return create(NULL, sp, cfg, out);
}

/* The cache's three operations, on the model or over the split's stages. */
static cm_status forward_cached(ts_decoder *d, const ts_cache_step *cs, int64_t T, const ts_capture *cap) {
    return d->m ? ts_model_forward_cached(d->m, d->cache, cs, d->ids, T, d->cu, cap)
                : ts_split_forward_cached(d->scache, cs, d->ids, T, d->cu, cap);
}
static cm_status cache_commit(ts_decoder *d) {
    return d->m ? ts_cache_commit(d->cache, d->adv) : ts_split_cache_commit(d->scache, d->adv);
}
static cm_status cache_clear(ts_decoder *d, int slot) {
    return d->m ? ts_cache_clear(d->cache, slot) : ts_split_cache_clear(d->scache, slot);
}

static void free_step(ts_decoder *d) {
    void *p[] = {d->slot_of, d->tok_off, d->acc, d->nxt, d->out_off, d->ids, d->cu, d->slots, d->base,
                 d->adv, d->rows, d->am, d->pieces, d->logits, d->lay_ids, d->lay_pos, d->out, d->dec};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
    if (d->lay)
        for (int i = 0; i < d->cap_l; i++) free(d->lay[i]);
    free(d->lay);
}

void ts_decoder_destroy(ts_decoder **pd) {
    ts_decoder *d = pd ? *pd : NULL;
    if (!d) return;
    ts_cache_destroy(&d->cache);
    ts_split_cache_destroy(&d->scache);
    ts_sampler_free(&d->sampler);
    free_step(d);
    free(d->seqs);
    free(d);
    *pd = NULL;
}

double ts_decoder_commit_s(const ts_decoder *d, int64_t *n_commits) {
    if (n_commits) *n_commits = d->n_commits;
    return d->commit_s;
}

int ts_decoder_open(const ts_decoder *d) {
    int n = 0;
    for (int i = 0; i < d->cfg.max_seqs; i++) n += d->seqs[i].used;
    return n;
}

void ts_decoder_drop(ts_decoder *d, const char *owner) {
    int n = 0;
    for (int i = 0; i < d->cfg.max_seqs; i++)
        if (d->seqs[i].used && strcmp(d->seqs[i].owner, owner) == 0) {
            d->seqs[i].used = 0;
            n++;
        }
    if (n) CM_LOG_INFO("decoding: %d sequence(s) of '%s' dropped", n, owner);
}

// ----------------------------------------------------------------------------
// scratch

static int grow(void **p, size_t want_bytes) {
    void *q = realloc(*p, want_bytes ? want_bytes : 1);
    if (!q) return 0;
    *p = q;
    return 1;
}

/* Room for N records, T tokens (over every forward of the step), R head rows and L layers. */
static cm_status reserve(ts_decoder *d, int64_t N, int64_t T, int64_t R, int L, int want_logits) {
    const int64_t D = d->tc->hidden_size, V = d->tc->vocab_size;
    int           ok = 1;
    if (N > d->cap_n) {
        int32_t **a[] = {&d->slot_of, &d->tok_off, &d->acc, &d->nxt, &d->out_off};
        for (size_t i = 0; i < sizeof a / sizeof a[0]; i++) ok &= grow((void **)a[i], (size_t)N * 4);
        ok &= grow((void **)&d->dec, (size_t)N * 16);
        ok &= grow((void **)&d->slots, (size_t)N * 4) && grow((void **)&d->base, (size_t)N * 4);
        ok &= grow((void **)&d->adv, (size_t)N * 4) && grow((void **)&d->cu, (size_t)(N + 1) * 4);
        ok &= grow((void **)&d->pieces, (size_t)(N + T + 1) * sizeof(piece));
        if (ok) d->cap_n = N;
    }
    if (ok && T > d->cap_t) {
        ok &= grow((void **)&d->ids, (size_t)T * 4);
        ok &= grow((void **)&d->pieces, (size_t)(N + T + 1) * sizeof(piece));
        for (int i = 0; ok && i < d->cap_l; i++) ok &= grow((void **)&d->lay[i], (size_t)(T * D) * 4);
        ok &= grow((void **)&d->out, (size_t)d->cap_l * (size_t)(T * D) * 4);
        if (ok) d->cap_t = T;
    }
    if (ok && L > d->cap_l) {
        ok &= grow((void **)&d->lay, (size_t)L * sizeof(float *));
        for (int i = d->cap_l; ok && i < L; i++) d->lay[i] = malloc((size_t)(d->cap_t * D) * 4 + 4);
        for (int i = d->cap_l; ok && i < L; i++) ok &= d->lay[i] != NULL;
        ok &= grow((void **)&d->lay_ids, (size_t)L * sizeof(int));
        ok &= grow((void **)&d->lay_pos, (size_t)L * sizeof(int));
        ok &= grow((void **)&d->out, (size_t)L * (size_t)(d->cap_t * D) * 4 + 4);
        if (ok) d->cap_l = L;
    }
    if (ok && (R > d->cap_rows || (want_logits && !d->logits))) {
        ok &= grow((void **)&d->rows, (size_t)R * 4) && grow((void **)&d->am, (size_t)R * 4);
        free(d->logits);
        d->logits = NULL;
        if (ok && want_logits) ok &= (d->logits = malloc((size_t)R * (size_t)V * 4)) != NULL;
        if (ok) d->cap_rows = R;
    }
    return ok ? CM_OK
              : CM_FAIL(CM_ERR_NOMEM, "cannot allocate a decoding step's buffers (%lld tokens, %d layers)", (long long)T,
                        L);
}

// ----------------------------------------------------------------------------
// checks: nothing changes before every record passed

static dseq *find(ts_decoder *d, uint32_t handle, const char *owner) {
    for (int i = 0; i < d->cfg.max_seqs; i++)
        if (d->seqs[i].used && d->seqs[i].handle == handle && strcmp(d->seqs[i].owner, owner) == 0)
            return &d->seqs[i];
    return NULL;
}

static cm_status check_step(ts_decoder *d, const char *owner, const cm_proto_decode *rq) {
    int n_new = 0, n_free = 0;
    for (int i = 0; i < d->cfg.max_seqs; i++) n_free += !d->seqs[i].used;
    int64_t draft_tokens = 0;
    for (uint32_t r = 0; r < rq->n_seqs; r++) {
        const cm_proto_decode_seq *q = &rq->seqs[r];
        int64_t                    have = 0;
        if (q->handle == 0) {
            n_new++;
        } else {
            const dseq *s = find(d, q->handle, owner);
            if (!s)
                return CM_FAIL(CM_ERR_INVALID_ARG, "record %u: sequence %u is not open for this client (closed, dropped "
                                                   "after the client fell silent, or never opened)",
                               r, q->handle);
            if (rq->op == CM_DECODE_STEP && (int64_t)q->base != s->len)
                return CM_FAIL(CM_ERR_INVALID_ARG, "record %u: sequence %u has %lld tokens committed but the step "
                                                   "assumes %u (a step lost or sent twice?)",
                               r, q->handle, (long long)s->len, q->base);
            have = s->len;
            for (uint32_t o = 0; o < r; o++)
                if (rq->seqs[o].handle == q->handle)
                    return CM_FAIL(CM_ERR_INVALID_ARG, "records %u and %u both step sequence %u", o, r, q->handle);
        }
        if (rq->op == CM_DECODE_STEP && have + q->n_ctx + q->n_draft > d->cfg.max_len)
            return CM_FAIL(CM_ERR_INVALID_ARG, "record %u: the sequence would reach %lld tokens; this server decodes "
                                               "at most %lld per sequence (serve --decode-max-len)",
                           r, (long long)(have + q->n_ctx + q->n_draft), (long long)d->cfg.max_len);
        if (q->n_draft > 0) draft_tokens += q->n_ctx + q->n_draft;
    }
    if (rq->op == CM_DECODE_CLOSE) {
        if (n_new) return CM_FAIL(CM_ERR_INVALID_ARG, "CLOSE of handle 0: name the sequences to close");
        return CM_OK;
    }
    if (n_new > n_free)
        return CM_FAIL(CM_ERR_INVALID_ARG, "too many decoding sequences: %d new ones asked for, %d of the server's %d "
                                           "free (serve --decode-seqs); close finished ones, or ask for fewer at once",
                       n_new, n_free, d->cfg.max_seqs);
    if (draft_tokens > d->cfg.max_step || draft_tokens > d->cfg.max_forward)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a verification step of %lld tokens; this server verifies at most %lld at "
                                           "once (serve --decode-max-step): send fewer sequences per step",
                       (long long)draft_tokens,
                       (long long)(d->cfg.max_step < d->cfg.max_forward ? d->cfg.max_step : d->cfg.max_forward));
    CM_TRY(ts_tokens_validate(d->tc, rq->tokens, rq->n_tokens));
    for (uint32_t i = 0; i < rq->n_layers; i++)
        if (rq->layer_ids[i] < 0 || rq->layer_ids[i] >= d->tc->n_layers)
            return CM_FAIL(CM_ERR_INVALID_ARG, "layer %d asked for; the target has layers 0 to %d", rq->layer_ids[i],
                           d->tc->n_layers - 1);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// one forward over pieces

/* Copies rows [r0, r0 + n) of every capture into the answer at output row o (hidden dtype). */
static void copy_rows(ts_decoder *d, int L, int64_t r0, int64_t n, int64_t o) {
    const int64_t D = d->tc->hidden_size;
    const size_t  el = d->cfg.hidden_dtype == CM_DTYPE_BF16 ? 2 : 4;
    for (int i = 0; i < L; i++) {
        const float *src = d->lay[i] + r0 * D;
        uint8_t     *dst = d->out + ((size_t)d->lay_pos[i] * (size_t)(d->cap_t * D) + (size_t)(o * D)) * el;
        if (el == 4) {
            memcpy(dst, src, (size_t)(n * D) * 4);
        } else {
            uint16_t *b = (uint16_t *)dst;
            for (int64_t k = 0; k < n * D; k++) b[k] = cm_f32_to_bf16(src[k]);
        }
    }
}

/* Runs pieces p[0 .. np) (distinct sequences) as one forward; with_drafts: keep and commit. */
static cm_status run_forward(ts_decoder *d, const cm_proto_decode *rq, const piece *p, int np, int with_drafts) {
    const int64_t V = d->tc->vocab_size;
    int64_t       T = 0, R = 0;
    int           sampled = 0;
    for (int i = 0; i < np; i++) {
        const cm_proto_decode_seq *q = &rq->seqs[p[i].rec];
        const dseq                *s = &d->seqs[d->slot_of[p[i].rec]];
        d->cu[i]    = (int32_t)T;
        d->slots[i] = d->slot_of[p[i].rec];
        d->base[i]  = (int32_t)s->len;
        d->adv[i]   = (int32_t)p[i].n;
        memcpy(d->ids + T, rq->tokens + d->tok_off[p[i].rec] + p[i].off, (size_t)p[i].n * 4);
        if (p[i].head) { /* the posterior rows: from the last context token to the last draft */
            for (uint32_t k = 0; k <= q->n_draft; k++) d->rows[R++] = (int32_t)(T + q->n_ctx - 1 - p[i].off + k);
            sampled |= s->temperature > 0;
        }
        T += p[i].n;
    }
    d->cu[np] = (int32_t)T;
    if (sampled && !d->logits) CM_TRY(reserve(d, d->cap_n, d->cap_t, d->cap_rows, d->cap_l, 1));
    ts_capture cap = {.n_layers    = (int)rq->n_layers,
                      .layers      = d->lay_ids,
                      .layer_out   = d->lay,
                      .n_head_rows = (int)R,
                      .head_rows   = d->rows,
                      .head_argmax = R ? d->am : NULL,
                      .head_logits = R && sampled ? d->logits : NULL};
    if (!R) { /* a prefill piece that is not the last: no head */
        cap.n_head_rows = 0;
        cap.head_rows   = NULL;
    }
    ts_cache_step cs = {.n_seq = np, .slots = d->slots, .base = d->base, .n_adv = with_drafts ? NULL : d->adv};
    CM_TRY(forward_cached(d, &cs, T, &cap));
    /* the target's tokens, acceptance, what is committed */
    int64_t r = 0;
    for (int i = 0; i < np; i++) {
        const int                  rec = p[i].rec;
        const cm_proto_decode_seq *q   = &rq->seqs[rec];
        dseq                      *s   = &d->seqs[d->slot_of[rec]];
        int32_t                    a = 0, next = -1;
        if (p[i].head) {
            const int32_t *draft = rq->tokens + d->tok_off[rec] + q->n_ctx;
            const int64_t  r0    = r;
            r += q->n_draft + 1;
            for (uint32_t k = 0;; k++) { /* rows after the first mismatch are not looked at */
                int32_t t = d->am[r0 + k];
                if (s->temperature > 0)
                    CM_TRY(ts_sample(&d->sampler, d->logits + (r0 + k) * V, V, s->temperature, s->top_k, s->top_p,
                                     &s->rng, &t));
                if (k < q->n_draft && t == draft[k]) {
                    a++;
                    continue;
                }
                next = t;
                break;
            }
            d->acc[rec] = a;
            d->nxt[rec] = next;
        }
        d->adv[i] = (int32_t)(with_drafts ? q->n_ctx + a : p[i].n);
        copy_rows(d, (int)rq->n_layers, d->cu[i], d->adv[i], d->out_off[rec] + p[i].off);
    }
    if (with_drafts) {
        const double t0 = cm_now_s();
        CM_TRY(cache_commit(d));
        d->commit_s += cm_now_s() - t0;
        d->n_commits++;
    }
    for (int i = 0; i < np; i++) d->seqs[d->slot_of[p[i].rec]].len += d->adv[i];
    return CM_OK;
}

// ----------------------------------------------------------------------------
// the step

static cm_status answer(ts_decoder *d, const cm_proto_decode *rq, cm_proto_answer *ans, int64_t rows) {
    if (ans->cap_tensors < 1 + rq->n_layers)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the answer has room for %u tensors; %u needed", ans->cap_tensors,
                       1 + rq->n_layers);
    const int64_t    D  = d->tc->hidden_size;
    const size_t     el = d->cfg.hidden_dtype == CM_DTYPE_BF16 ? 2 : 4;
    cm_proto_tensor *t  = ans->tensors;
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "decode");
    t->dtype    = CM_DTYPE_I32;
    t->encoding = CM_ENCODING_RAW;
    t->n_dims   = 2;
    t->shape[0] = rq->n_seqs;
    t->shape[1] = 4;
    t->raw_size = t->encoded_size = (uint64_t)rq->n_seqs * 16;
    t->data                       = d->dec;
    for (uint32_t i = 0; rq->op == CM_DECODE_STEP && i < rq->n_layers; i++) {
        cm_proto_tensor *u = &ans->tensors[1 + i];
        memset(u, 0, sizeof *u);
        snprintf(u->name, sizeof u->name, "layer_%d", rq->layer_ids[i]);
        u->dtype    = d->cfg.hidden_dtype;
        u->encoding = CM_ENCODING_RAW;
        u->n_dims   = 2;
        u->shape[0] = rows;
        u->shape[1] = D;
        u->raw_size = u->encoded_size = (uint64_t)(rows * D) * el;
        u->data                       = d->out + (size_t)i * (size_t)(d->cap_t * D) * el;
    }
    ans->n_tensors = rq->op == CM_DECODE_STEP ? 1 + rq->n_layers : 1;
    return CM_OK;
}

static cm_status do_close(ts_decoder *d, const char *owner, const cm_proto_decode *rq, cm_proto_answer *ans) {
    CM_TRY(reserve(d, rq->n_seqs, 1, 1, 1, 0));
    for (uint32_t r = 0; r < rq->n_seqs; r++) {
        dseq *s = find(d, rq->seqs[r].handle, owner);
        if (s) s->used = 0;
        int32_t row[4] = {(int32_t)rq->seqs[r].handle, 0, 0, -1};
        memcpy(d->dec + 4 * r, row, sizeof row);
    }
    return answer(d, rq, ans, 0);
}

/* Opens the step's new sequences in free slots and maps every record to its slot. */
static cm_status open_new(ts_decoder *d, const char *owner, const cm_proto_decode *rq) {
    int next_free = 0;
    for (uint32_t r = 0; r < rq->n_seqs; r++) {
        const cm_proto_decode_seq *q = &rq->seqs[r];
        if (q->handle) {
            d->slot_of[r] = (int32_t)(find(d, q->handle, owner) - d->seqs);
            continue;
        }
        while (d->seqs[next_free].used) next_free++;
        dseq *s = &d->seqs[next_free];
        memset(s, 0, sizeof *s);
        s->used   = 1;
        s->handle = d->next_handle++;
        if (!d->next_handle) d->next_handle = 1;
        snprintf(s->owner, sizeof s->owner, "%s", owner);
        if (q->flags & CM_DECODE_FLAG_TARGET_SAMPLING) {
            const cm_gen_cfg *g = &d->cfg.gen;
            s->temperature      = g->do_sample ? g->temperature : 0;
            s->top_p            = g->top_p;
            s->top_k            = g->top_k;
        } else {
            s->temperature = q->temperature;
            s->top_p       = q->top_p;
            s->top_k       = (int)q->top_k;
        }
        cm_rng_seed(&s->rng, q->seed);
        d->slot_of[r] = next_free;
        CM_LOG_DEBUG("decoding: sequence %u opened for '%s' in slot %d", s->handle, owner, next_free);
        CM_TRY(cache_clear(d, next_free));
    }
    return CM_OK;
}

/* Sorts the requested layers for the capture (ascending) and remembers each one's request position. */
static void plan_layers(ts_decoder *d, const cm_proto_decode *rq) {
    const int L = (int)rq->n_layers;
    for (int i = 0; i < L; i++) {
        d->lay_ids[i] = rq->layer_ids[i];
        d->lay_pos[i] = i;
    }
    for (int i = 1; i < L; i++) /* insertion sort: a handful of layers */
        for (int j = i; j > 0 && d->lay_ids[j] < d->lay_ids[j - 1]; j--) {
            int t = d->lay_ids[j];
            d->lay_ids[j] = d->lay_ids[j - 1];
            d->lay_ids[j - 1] = t;
            t = d->lay_pos[j];
            d->lay_pos[j] = d->lay_pos[j - 1];
            d->lay_pos[j - 1] = t;
        }
}

cm_status ts_decoder_step(ts_decoder *d, const char *owner, const cm_proto_decode *rq, cm_proto_answer *ans) {
    CM_TRY(check_step(d, owner, rq));
    if (rq->op == CM_DECODE_CLOSE) return do_close(d, owner, rq, ans);
    const int64_t N = rq->n_seqs, T = rq->n_tokens;
    CM_TRY(reserve(d, N, T, T + N, (int)rq->n_layers, 0));
    CM_TRY(open_new(d, owner, rq));
    plan_layers(d, rq);
    int64_t off = 0;
    for (int64_t r = 0; r < N; r++) {
        d->tok_off[r] = (int32_t)off;
        d->out_off[r] = (int32_t)off; /* room for every token; compacted below */
        d->acc[r]     = 0;
        d->nxt[r]     = -1;
        off += rq->seqs[r].n_ctx + rq->seqs[r].n_draft;
    }
    /* forwards without drafts: pieces of at most max_forward tokens, one piece per sequence each */
    cm_status st = CM_OK;
    int       np = 0;
    int64_t   tok = 0;
    for (int64_t r = 0; r < N && st == CM_OK; r++) {
        const cm_proto_decode_seq *q = &rq->seqs[r];
        if (q->n_draft) continue;
        for (int64_t o = 0; o < q->n_ctx && st == CM_OK;) {
            int64_t n = q->n_ctx - o;
            if (n > d->cfg.max_forward) n = d->cfg.max_forward;
            if (np && (tok + n > d->cfg.max_forward || d->pieces[np - 1].rec == r)) {
                st  = run_forward(d, rq, d->pieces, np, 0);
                np  = 0;
                tok = 0;
            }
            d->pieces[np++] = (piece){.rec = (int)r, .off = o, .n = n, .head = o + n == q->n_ctx};
            tok += n;
            o += n;
        }
    }
    if (st == CM_OK && np) st = run_forward(d, rq, d->pieces, np, 0);
    /* the sequences with drafts: one forward, then the commit of what was accepted */
    np = 0;
    for (int64_t r = 0; r < N && st == CM_OK; r++)
        if (rq->seqs[r].n_draft)
            d->pieces[np++] = (piece){.rec = (int)r, .off = 0, .n = rq->seqs[r].n_ctx + rq->seqs[r].n_draft, .head = 1};
    if (st == CM_OK && np) st = run_forward(d, rq, d->pieces, np, 1);
    if (st != CM_OK) { /* the state of the step's sequences is not known any more */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", cm_last_error());
        for (int64_t r = 0; r < N; r++) d->seqs[d->slot_of[r]].used = 0;
        return CM_FAIL(st, "%s (the step's %lld sequence(s) are closed)", msg, (long long)N);
    }
    /* the table, and the committed rows moved together in record order */
    const int64_t D  = d->tc->hidden_size;
    const size_t  el = d->cfg.hidden_dtype == CM_DTYPE_BF16 ? 2 : 4;
    int64_t       rows = 0;
    for (int64_t r = 0; r < N; r++) {
        const dseq   *s = &d->seqs[d->slot_of[r]];
        const int64_t n = rq->seqs[r].n_ctx + d->acc[r];
        for (uint32_t i = 0; i < rq->n_layers; i++) {
            uint8_t *base = d->out + (size_t)i * (size_t)(d->cap_t * D) * el;
            memmove(base + (size_t)(rows * D) * el, base + (size_t)(d->out_off[r] * D) * el, (size_t)(n * D) * el);
        }
        rows += n;
        int32_t row[4] = {(int32_t)s->handle, (int32_t)s->len, d->acc[r], d->nxt[r]};
        memcpy(d->dec + 4 * r, row, sizeof row);
    }
    return answer(d, rq, ans, rows);
}
