/* tests/test_ts_decode.c — decoding on the target (ts_decode, ts_cache, the cached forward) on the
 * embedded tiny trained target (models/tandem-tiny), on the backend named by argv[1] (cpu, or
 * cuda: exits 77 without a GPU):
 *   - exactness: sequences of odd lengths prefilled in pieces and then fed one token per step
 *     (several sequences per step, packed) give the hidden states and greedy tokens of one
 *     uncached forward over each whole sequence (captures within rel L2 1e-4 on cpu, 1e-3 on
 *     cuda, 4e-3 when the answer is bf16; both backends in fp32 GEMM mode, so that greedy
 *     near-ties do not depend on the batch's shape);
 *   - verification: blocks of drafts, some right (the target's own greedy tokens) and some
 *     wrong, accept exactly the right prefix; the output is the target's greedy output token for
 *     token, and the committed hidden states equal the uncached forward's, so the roll-back of
 *     the GDN states to the accepted prefix is exact;
 *   - sampling: at temperature 0.9 / top-k 12 with a draft in every step, the first and second
 *     generated tokens follow the target's distribution (chi-square at p = 0.001 over 1200 seeded
 *     sequences; 480 and shorter decodes under the sanitizers), and the same test refuses the tokens a decoder that accepts drafts unchecked
 *     would emit;
 *   - refusals: a foreign or closed handle, a wrong base, a length past max_len, too many
 *     sequences, a step too large, a token or layer out of range, each with its message and
 *     nothing changed.
 * `test_ts_decode cpu fp8`: exactness and verification with the projections quantized on load
 * (docs/fp8.md): the input quantization is per token, so a token's FP8 products do not depend on
 * what else is in the batch, and the cached forward equals the uncached one as in fp32. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "ts_decode.h"
#include "ts_model.h"
#include "tst.h"
#include "tst_cuda.h"

#define MODEL  TANDEM_TEST_DATA "/../models/tandem-tiny"
#define N_TAPS 3
static const int32_t taps[N_TAPS] = {1, 7, 3}; /* not sorted: the answer follows the request's order */

static const kn_backend *be;
static kn_ctx           *ctx;
static ts_model         *model;
static int               on_cuda;
static int64_t           D, V;

// ---- the reference: one uncached forward over a whole sequence

typedef struct ref_seq {
    int64_t n;
    float  *lay[N_TAPS]; /* [n, D] */
    int32_t *greedy;     /* [n]: argmax of the logits at each position */
    float   *logits;     /* [n, V] */
} ref_seq;

static void ref_forward(const int32_t *ids, int64_t n, ref_seq *r) {
    int sorted[N_TAPS] = {1, 3, 7}, pos[N_TAPS] = {0, 2, 1}; /* taps[] sorted; pos: where each came from */
    memset(r, 0, sizeof *r);
    r->n = n;
    float *out[N_TAPS];
    for (int i = 0; i < N_TAPS; i++) out[i] = r->lay[pos[i]] = malloc((size_t)(n * D) * 4);
    r->logits = malloc((size_t)(n * V) * 4);
    r->greedy = malloc((size_t)n * 4);
    int32_t    cu[2] = {0, (int32_t)n};
    ts_capture cap = {.n_layers = N_TAPS, .layers = sorted, .layer_out = out, .logits = r->logits};
    TST_CHECK(tst_ok(ts_model_forward(model, ids, n, cu, 1, &cap), "reference forward"));
    for (int64_t t = 0; t < n; t++) {
        int64_t b = 0;
        for (int64_t v = 1; v < V; v++)
            if (r->logits[t * V + v] > r->logits[t * V + b]) b = v;
        r->greedy[t] = (int32_t)b;
    }
}

static void ref_free(ref_seq *r) {
    for (int i = 0; i < N_TAPS; i++) free(r->lay[i]);
    free(r->logits);
    free(r->greedy);
}

// ---- a client of the decoder, in process

typedef struct step_out {
    int32_t         dec[64][4];
    cm_proto_tensor t[1 + N_TAPS];
    cm_proto_answer ans;
} step_out;

/* One STEP or CLOSE. recs: n records; toks: their tokens back to back. */
static cm_status step(ts_decoder *d, const char *owner, cm_decode_op op, cm_proto_decode_seq *recs, int n,
                      int32_t *toks, int n_layers, step_out *o) {
    uint32_t T = 0;
    for (int i = 0; i < n; i++) T += recs[i].n_ctx + recs[i].n_draft;
    int32_t         lay[N_TAPS];
    memcpy(lay, taps, sizeof lay);
    cm_proto_decode rq = {.id = 1, .op = op, .encoding = CM_ENCODING_RAW, .n_seqs = (uint32_t)n, .n_tokens = T,
                          .n_layers = (uint32_t)n_layers, .seqs = recs, .tokens = toks, .layer_ids = lay};
    memset(&o->ans, 0, sizeof o->ans);
    o->ans.tensors     = o->t;
    o->ans.cap_tensors = 1 + N_TAPS;
    cm_status st = ts_decoder_step(d, owner, &rq, &o->ans);
    if (st == CM_OK)
        for (int i = 0; i < n; i++) memcpy(o->dec[i], (const int32_t *)o->t[0].data + 4 * i, 16);
    return st;
}

static double rel_l2(const float *got, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)got[i] - ref[i];
        num += e * e;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num) / (sqrt(den) + 1e-30);
}

/* The answer's hidden states of layer tap i, rows [r0, r0 + n), as floats. */
static void answer_rows(const step_out *o, int i, int64_t r0, int64_t n, float *dst) {
    const cm_proto_tensor *t = &o->t[1 + i];
    for (int64_t k = 0; k < n * D; k++)
        dst[k] = t->dtype == CM_DTYPE_BF16 ? cm_bf16_to_f32(((const uint16_t *)t->data)[r0 * D + k])
                                           : ((const float *)t->data)[r0 * D + k];
}

static ts_decoder *new_decoder(int seqs, int64_t max_len, int64_t max_step, int64_t max_fwd, cm_dtype dt) {
    ts_decoder_config c = {.max_seqs = seqs, .max_len = max_len, .max_step = max_step, .max_forward = max_fwd,
                           .hidden_dtype = dt};
    ts_decoder *d = NULL;
    TST_CHECK(tst_ok(ts_decoder_create(model, &c, &d), "decoder"));
    return d;
}

// ---- exactness and verification

#define N_SEQ 3
static const int64_t lens[N_SEQ] = {29, 1, 47}; /* prompt lengths */
/* Sizes: the full ones, or smaller under the sanitizers (the reference kernels run ~15x slower there) or
 * with TST_SMALL=1 in the environment (to run the small sizes without a sanitizer build). */
static int small_run(void) {
#if defined(__SANITIZE_ADDRESS__)
    return 1;
#else
    const char *e = getenv("TST_SMALL");
    return e && strcmp(e, "1") == 0;
#endif
}
#define GEN (small_run() ? 6 : 16)

/* Prefill (in pieces of max_forward 16), then GEN target steps: one token at a time (block 0) or
 * blocks of B with drafts mixing the target's own tokens and wrong ones (B > 1). Every committed
 * row and every token is compared with the uncached forward over the final sequence. */
static void check_decode(int B, cm_dtype dt) {
    const double tol = dt == CM_DTYPE_BF16 ? 4e-3 : on_cuda ? 1e-3 : 1e-4; /* bf16 answers: their rounding */
    ts_decoder  *d   = new_decoder(4, 128, 64, 24, dt);
    if (!d) return;
    int32_t *seq[N_SEQ];
    int64_t  len[N_SEQ];
    uint32_t handle[N_SEQ];
    int32_t  next[N_SEQ];
    for (int s = 0; s < N_SEQ; s++) {
        seq[s] = malloc(256 * 4);
        for (int64_t t = 0; t < lens[s]; t++) seq[s][t] = (int32_t)((t * 7 + 3 * s + 1) % V);
        len[s] = lens[s];
    }
    /* the reference for each sequence is computed after decoding, over prompt + generated */
    float  *rows[N_SEQ][N_TAPS];
    for (int s = 0; s < N_SEQ; s++)
        for (int i = 0; i < N_TAPS; i++) rows[s][i] = malloc((size_t)(256 * D) * 4);
    step_out *o = calloc(1, sizeof *o);
    /* prefill */
    cm_proto_decode_seq recs[N_SEQ];
    int32_t             toks[512];
    int64_t             off = 0;
    for (int s = 0; s < N_SEQ; s++) {
        recs[s] = (cm_proto_decode_seq){.n_ctx = (uint32_t)lens[s], .top_p = 1};
        memcpy(toks + off, seq[s], (size_t)lens[s] * 4);
        off += lens[s];
    }
    TST_CHECK(tst_ok(step(d, "c", CM_DECODE_STEP, recs, N_SEQ, toks, N_TAPS, o), "prefill"));
    int64_t r0 = 0;
    for (int s = 0; s < N_SEQ; s++) {
        handle[s] = (uint32_t)o->dec[s][0];
        TST_CHECK(o->dec[s][1] == lens[s] && o->dec[s][2] == 0);
        next[s] = o->dec[s][3];
        for (int i = 0; i < N_TAPS; i++) answer_rows(o, i, r0, lens[s], rows[s][i]);
        r0 += lens[s];
    }
    /* generation: each step sends the anchor (the token the last step returned) and B − 1 drafts:
     * every other step the target's own greedy continuation (from uncached forwards) with a wrong
     * token at slot s + 1, else guesses that are right only by chance */
    for (int g = 0; g < GEN; g++) {
        off = 0;
        int nd[N_SEQ];
        for (int s = 0; s < N_SEQ; s++) {
            seq[s][len[s]] = next[s];
            nd[s]          = B > 1 ? B - 1 : 0;
            int32_t *dr    = toks + off + 1;
            toks[off]      = next[s];
            if (nd[s] && g % 2 == 0) {
                for (int k = 0; k < nd[s]; k++) {
                    ref_seq r2;
                    ref_forward(seq[s], len[s] + 1 + k, &r2);
                    dr[k] = seq[s][len[s] + 1 + k] = r2.greedy[len[s] + k];
                    ref_free(&r2);
                }
                if (s + 1 < nd[s]) dr[s + 1] = (dr[s + 1] + 1) % (int32_t)V;
            } else {
                for (int k = 0; k < nd[s]; k++) dr[k] = (int32_t)((next[s] + 5 * k + 2) % V);
            }
            recs[s] = (cm_proto_decode_seq){.handle = handle[s], .base = (uint32_t)len[s], .n_ctx = 1,
                                            .n_draft = (uint32_t)nd[s], .top_p = 1};
            off += 1 + nd[s];
        }
        TST_CHECK(tst_ok(step(d, "c", CM_DECODE_STEP, recs, N_SEQ, toks, N_TAPS, o), "step"));
        r0  = 0;
        off = 0;
        for (int s = 0; s < N_SEQ; s++) {
            const int a = o->dec[s][2];
            TST_CHECK(o->dec[s][0] == (int32_t)handle[s] && a >= 0 && a <= nd[s]);
            for (int k = 0; k < a; k++) seq[s][len[s] + 1 + k] = toks[off + 1 + k];
            for (int i = 0; i < N_TAPS; i++) answer_rows(o, i, r0, 1 + a, rows[s][i] + len[s] * D);
            r0 += 1 + a;
            len[s] += 1 + a;
            TST_CHECK(o->dec[s][1] == len[s]);
            next[s] = o->dec[s][3];
            off += 1 + nd[s];
        }
    }
    /* the reference over each final sequence: rows and greedy tokens */
    double worst = 0;
    for (int s = 0; s < N_SEQ; s++) {
        seq[s][len[s]] = next[s];
        ref_seq r;
        ref_forward(seq[s], len[s], &r);
        for (int i = 0; i < N_TAPS; i++) {
            double e = rel_l2(rows[s][i], r.lay[i], len[s] * D);
            worst    = e > worst ? e : worst;
        }
        int mism = 0;
        for (int64_t t = lens[s] - 1; t < len[s]; t++) mism += r.greedy[t] != seq[s][t + 1];
        if (mism) fprintf(stderr, "  sequence %d: %d generated tokens differ from the target's greedy\n", s, mism);
        TST_CHECK(mism == 0);
        ref_free(&r);
    }
    fprintf(stderr, "decode %s B=%d (%s): %lld + %lld + %lld tokens, worst rel L2 of the committed rows %.2e\n",
            be->name, B, cm_dtype_name(dt), (long long)len[0], (long long)len[1], (long long)len[2], worst);
    TST_CHECK(worst < tol);
    for (int s = 0; s < N_SEQ; s++) {
        free(seq[s]);
        for (int i = 0; i < N_TAPS; i++) free(rows[s][i]);
    }
    free(o);
    ts_decoder_destroy(&d);
}

// ---- sampling: the output follows the target's distribution

/* The target's sampling distribution at one position (temperature, top-k), computed here from
 * the uncached forward's logits, independently of ts_sample. */
static void warp(const float *z, double temp, int top_k, double *p) {
    float *sorted = malloc((size_t)V * 4);
    memcpy(sorted, z, (size_t)V * 4);
    for (int k = 0; k < top_k; k++) /* the top_k-th largest by partial selection */
        for (int64_t v = k + 1; v < V; v++)
            if (sorted[v] > sorted[k]) {
                float t   = sorted[k];
                sorted[k] = sorted[v];
                sorted[v] = t;
            }
    const float cut = sorted[top_k - 1], top = sorted[0];
    double      sum = 0;
    for (int64_t v = 0; v < V; v++) sum += p[v] = z[v] >= cut ? exp(((double)z[v] - top) / temp) : 0;
    for (int64_t v = 0; v < V; v++) p[v] /= sum;
    free(sorted);
}

/* Pearson's chi-square of counts against n·p over the tokens expected ≥ 5 times, the rest pooled;
 * returns the statistic over its p = 0.001 critical value (Wilson–Hilferty), so > 1 rejects. */
static double chi2_ratio(const int *count, const double *p, int n) {
    double stat = 0, rest_e = 0;
    int    rest_c = 0, df = -1;
    for (int64_t v = 0; v < V; v++) {
        const double e = n * p[v];
        if (e >= 5) {
            stat += (count[v] - e) * (count[v] - e) / e;
            df++;
        } else {
            rest_e += e;
            rest_c += count[v];
        }
    }
    if (rest_e > 0) {
        stat += (rest_c - rest_e) * (rest_c - rest_e) / (rest_e > 1 ? rest_e : 1);
        df++;
    }
    if (df < 1) df = 1;
    const double k = 2.0 / (9.0 * df), crit = df * pow(1 - k + 3.090 * sqrt(k), 3);
    return stat / crit;
}

#define N_SAMPLES (small_run() ? 480 : 1200)
#define BATCH     16

static void check_sampling(void) {
    const float temp = 0.9f;
    const int   top_k = 12, P = 20;
    ts_decoder *d = new_decoder(BATCH, 64, 512, 512, CM_DTYPE_F32);
    if (!d) return;
    int32_t prompt[64];
    for (int t = 0; t < P; t++) prompt[t] = (int32_t)((t * 11 + 5) % V);
    ref_seq r1, r2;
    ref_forward(prompt, P, &r1);
    const int32_t x1 = r1.greedy[P - 1];
    prompt[P] = x1;
    ref_forward(prompt, P + 1, &r2);
    const int32_t x2 = r2.greedy[P];
    double *p1 = malloc((size_t)V * sizeof *p1), *p2 = malloc((size_t)V * sizeof *p2);
    warp(r1.logits + (P - 1) * V, temp, top_k, p1);
    warp(r2.logits + P * V, temp, top_k, p2);
    int *c1 = calloc((size_t)V, sizeof *c1), *c2 = calloc((size_t)V, sizeof *c2), n2 = 0;
    step_out *o = calloc(1, sizeof *o);
    for (int b0 = 0; b0 < N_SAMPLES; b0 += BATCH) {
        cm_proto_decode_seq recs[BATCH];
        int32_t             toks[BATCH * 24];
        for (int i = 0; i < BATCH; i++) {
            recs[i] = (cm_proto_decode_seq){.n_ctx = (uint32_t)P, .n_draft = 2, .temperature = temp,
                                            .top_k = (uint32_t)top_k, .top_p = 1, .seed = 1000u + (uint64_t)(b0 + i)};
            memcpy(toks + i * (P + 2), prompt, (size_t)P * 4);
            toks[i * (P + 2) + P]     = x1;
            toks[i * (P + 2) + P + 1] = x2;
        }
        if (!tst_ok(step(d, "s", CM_DECODE_STEP, recs, BATCH, toks, 0, o), "sampled step")) break;
        int32_t g1[BATCH], g2[BATCH], more = 0;
        cm_proto_decode_seq again[BATCH];
        int                 who[BATCH];
        for (int i = 0; i < BATCH; i++) {
            const int a = o->dec[i][2];
            g1[i]       = a >= 1 ? x1 : o->dec[i][3];
            g2[i]       = a >= 2 ? x2 : a == 1 ? o->dec[i][3] : -1;
            recs[i].handle = (uint32_t)o->dec[i][0];
            recs[i].base   = (uint32_t)o->dec[i][1];
            if (g2[i] < 0) { /* the second token needs one more step, the target alone */
                again[more] = (cm_proto_decode_seq){.handle = recs[i].handle, .base = recs[i].base, .n_ctx = 1};
                toks[more]  = g1[i];
                who[more++] = i;
            }
        }
        if (more && tst_ok(step(d, "s", CM_DECODE_STEP, again, more, toks, 0, o), "second step"))
            for (int j = 0; j < more; j++) g2[who[j]] = o->dec[j][3];
        for (int i = 0; i < BATCH && b0 + i < N_SAMPLES; i++) {
            c1[g1[i]]++;
            if (g1[i] == x1) {
                c2[g2[i]]++;
                n2++;
            }
        }
        for (int i = 0; i < BATCH; i++) recs[i].n_ctx = recs[i].n_draft = 0;
        TST_CHECK(tst_ok(step(d, "s", CM_DECODE_CLOSE, recs, BATCH, toks, 0, o), "close"));
    }
    const double q1 = chi2_ratio(c1, p1, N_SAMPLES), q2 = chi2_ratio(c2, p2, n2);
    /* what a decoder that takes drafts unchecked would emit: x1 then x2, always */
    int *u1 = calloc((size_t)V, sizeof *u1);
    u1[x1] = N_SAMPLES;
    const double qu = chi2_ratio(u1, p1, N_SAMPLES);
    fprintf(stderr, "sampling: first token chi2/crit %.3f (p(x1) %.3f), second token given x1 %.3f over %d; unchecked "
                    "drafts %.1f\n",
            q1, p1[x1], q2, n2, qu);
    TST_CHECK(q1 < 1 && q2 < 1 && qu > 1 && n2 > 100);
    TST_CHECK(ts_decoder_open(d) == 0);
    free(u1);
    free(c1);
    free(c2);
    free(p1);
    free(p2);
    free(o);
    ref_free(&r1);
    ref_free(&r2);
    ts_decoder_destroy(&d);
}

// ---- refusals

static void check_refusals(void) {
    ts_decoder *d = new_decoder(2, 40, 8, 64, CM_DTYPE_F32);
    if (!d) return;
    step_out           *o = calloc(1, sizeof *o);
    int32_t             toks[64] = {0};
    cm_proto_decode_seq r = {.n_ctx = 10, .top_p = 1};
    for (int t = 0; t < 10; t++) toks[t] = t + 3;
    TST_CHECK(tst_ok(step(d, "a", CM_DECODE_STEP, &r, 1, toks, 1, o), "open"));
    const uint32_t h = (uint32_t)o->dec[0][0];
    cm_proto_decode_seq s = {.handle = h, .base = 10, .n_ctx = 1, .n_draft = 3, .top_p = 1};
    TST_FAILS(step(d, "b", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "not open for this client");
    s.base = 9;
    TST_FAILS(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "10 tokens committed", "assumes 9");
    s.base    = 10;
    s.n_draft = 30;
    TST_FAILS(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "would reach 41", "at most 40");
    s.n_draft = 8;
    TST_FAILS(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "verification step of 9");
    s.n_draft = 3;
    toks[2]   = (int32_t)V;
    TST_FAILS(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "out of range");
    toks[2] = 5;
    cm_proto_decode_seq three[3] = {r, r, r};
    TST_FAILS(step(d, "a", CM_DECODE_STEP, three, 3, toks, 1, o), CM_ERR_INVALID_ARG, "too many decoding sequences");
    TST_CHECK(ts_decoder_open(d) == 1); /* nothing changed */
    /* a layer out of range (the request's own layer list) */
    int32_t         bad = 99;
    cm_proto_decode rq  = {.id = 2, .op = CM_DECODE_STEP, .encoding = CM_ENCODING_RAW, .n_seqs = 1, .n_tokens = 4,
                           .n_layers = 1, .seqs = &s, .tokens = toks, .layer_ids = &bad};
    o->ans.tensors     = o->t;
    o->ans.cap_tensors = 1 + N_TAPS;
    TST_FAILS(ts_decoder_step(d, "a", &rq, &o->ans), CM_ERR_INVALID_ARG, "layer 99");
    /* the same step, valid, still finds the sequence where it was */
    TST_CHECK(tst_ok(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), "valid step after refusals"));
    TST_CHECK(o->dec[0][1] == 11 + o->dec[0][2]);
    ts_decoder_drop(d, "a");
    TST_CHECK(ts_decoder_open(d) == 0);
    TST_FAILS(step(d, "a", CM_DECODE_STEP, &s, 1, toks, 1, o), CM_ERR_INVALID_ARG, "not open for this client");
    free(o);
    ts_decoder_destroy(&d);
}


int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cpu";
    on_cuda          = strcmp(name, "cuda") == 0;
    if (kn_backend_get(name, &be) != CM_OK) TST_SKIP("backend %s: %s", name, cm_last_error());
    kn_ctx_config cc = KN_CTX_CONFIG_DEFAULT;
    cc.gemm_mode     = KN_GEMM_MODE_F32;
    if (be->ctx_create(&ctx, &cc) != CM_OK) TST_SKIP("no %s device: %s", name, cm_last_error());
    const int       fp8 = argc > 2 && strcmp(argv[2], "fp8") == 0; /* the projections quantized on load */
    ts_model_config mc = {.dir = MODEL, .backend = be, .ctx = ctx, .n_layers = -1, .load_head = 1, .fp8 = fp8};
    if (!tst_ok(ts_model_load(&model, &mc), "load")) return tst_report();
    D = ts_model_cfg(model)->hidden_size;
    V = ts_model_cfg(model)->vocab_size;
    check_decode(1, CM_DTYPE_F32);
    check_decode(4, CM_DTYPE_F32);
    if (fp8) { /* the cached forward's FP8 path: exactness and verification (the rest is precision-blind) */
        ts_model_destroy(&model);
        be->ctx_destroy(&ctx);
        return tst_report();
    }
    if (!small_run()) check_decode(6, CM_DTYPE_BF16);
    check_sampling();
    check_refusals();
    ts_model_destroy(&model);
    be->ctx_destroy(&ctx);
    return tst_report();
}
