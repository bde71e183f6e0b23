/* tests/test_kn_cache.c — the cpu reference of the incremental-decoding ops (kn_cache_ref.c;
 * kn_backend.h, "incremental decoding") on odd shapes: four packed sequences of lengths 1, 9, 23
 * and 40 in slots 5, 0, 3 and 6 of a 7-slot arena.
 * (a) Each sequence fed in pieces of random lengths 1..7 (every step packs the next piece of each
 *     unfinished sequence, in a rotating order, with n_adv = the piece lengths) equals the
 *     uncached op on the whole sequences: kv_cache_write + attention_cached against attention and
 *     conv1d_silu_cached against conv1d_silu bit for bit; gdn_cached against gated_delta_rule (the
 *     chunked form) within atol 5e-8 + rtol 5e-7 (the F32 state rounded between pieces: measured
 *     rel L2 3e-8, worst err/tol 0.2), its final states against a per-token recurrence in double
 *     (the same bound) and the conv's bit for bit against the sequences' last K − 1 rows. Slots
 *     outside the batch keep their bits. Before each piece a rejected block of keys is written at
 *     the same positions (a verification step whose tail is not accepted): it is never seen.
 * (b) A step with n_adv NULL leaves every state's bits; the commit that follows (out and q NULL,
 *     n_adv = a per sequence, 0 and len included) gives the bits of feeding only the first a
 *     tokens, and so does one call with out and n_adv = a, whose outputs are the step's bits.
 * (c) Argument refusals, each naming the op and its rule. Label unit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"

#define MAX_SEQ   8
#define MAX_STEPS 64
#define N_SLOTS   7
#define PIECE_MAX 7
#define SENTINEL  12345.0f

static const kn_backend *be;
static kn_ctx           *ctx;

/* Backend memory, zero-filled. On the cpu backend it is host memory (kn_ref.h), which the test
 * fills and reads directly. */
static void *balloc(size_t bytes) {
    void *p = NULL;
    if (be->alloc(ctx, &p, bytes ? bytes : 4) != CM_OK) {
        fprintf(stderr, "alloc of %zu bytes failed: %s\n", bytes, cm_last_error());
        exit(1);
    }
    return p;
}

static float *brand(long n, double lo, double hi) {
    float *p = balloc((size_t)n * sizeof(float));
    tst_fill(p, n, lo, hi);
    return p;
}

static float *bdup(const float *src, long n) {
    float *p = balloc((size_t)n * sizeof(float));
    memcpy(p, src, (size_t)n * sizeof(float));
    return p;
}

// ---- the sequences, their pieces and a step's tables

typedef struct seqset {
    int     n;
    int     lens[MAX_SEQ];
    int32_t slots[MAX_SEQ];
    int32_t cu[MAX_SEQ + 1];
} seqset;

static seqset seqs_make(void) {
    seqset q = {4, {1, 9, 23, 40}, {5, 0, 3, 6}, {0}};
    for (int s = 0; s < q.n; s++) q.cu[s + 1] = q.cu[s] + q.lens[s];
    return q;
}

/* Rows off .. off + len − 1 of sequence s; a step packs its pieces in the order of p. */
typedef struct piece {
    int s, off, len;
} piece;
typedef struct step {
    int   n;
    piece p[MAX_SEQ];
} step;

/* Random pieces of 1..PIECE_MAX rows; step k visits the sequences from k % n on. */
static int plan(const seqset *q, step *st) {
    int off[MAX_SEQ] = {0}, n_steps = 0;
    for (;;) {
        step *x = &st[n_steps];
        x->n    = 0;
        for (int i = 0; i < q->n; i++) {
            const int s = (i + n_steps) % q->n, left = q->lens[s] - off[s];
            if (left <= 0) continue;
            int len      = 1 + (int)(tst_urand() * PIECE_MAX);
            len          = len < left ? len : left;
            x->p[x->n++] = (piece){s, off[s], len};
            off[s] += len;
        }
        if (!x->n) return n_steps;
        if (++n_steps == MAX_STEPS) {
            fprintf(stderr, "plan: more than %d steps\n", MAX_STEPS);
            exit(1);
        }
    }
}

/* A step's tables in backend memory: cu_seqlens, slots, base (the offsets), adv (the lengths). */
typedef struct batch {
    int      n;
    int64_t  T;
    int32_t *cu, *slots, *base, *adv;
} batch;

static batch batch_alloc(void) {
    batch b = {
        0, 0, balloc(4 * (MAX_SEQ + 1)), balloc(4 * MAX_SEQ), balloc(4 * MAX_SEQ), balloc(4 * MAX_SEQ)};
    return b;
}

static void batch_free(batch *b) {
    be->free(ctx, b->cu);
    be->free(ctx, b->slots);
    be->free(ctx, b->base);
    be->free(ctx, b->adv);
}

static void batch_set(batch *b, const seqset *q, const step *x) {
    b->n     = x->n;
    b->cu[0] = 0;
    for (int i = 0; i < x->n; i++) {
        b->cu[i + 1] = b->cu[i] + x->p[i].len;
        b->slots[i]  = q->slots[x->p[i].s];
        b->base[i]   = x->p[i].off;
        b->adv[i]    = x->p[i].len;
    }
    b->T = b->cu[x->n];
}

/* dst's packed rows (width w) ← the pieces' rows of the whole sequences, or back. */
static void gather(float *dst, const float *whole, long w, const seqset *q, const step *x) {
    long r = 0;
    for (int i = 0; i < x->n; i++)
        for (int j = 0; j < x->p[i].len; j++, r++)
            memcpy(dst + r * w, whole + (q->cu[x->p[i].s] + x->p[i].off + j) * w, (size_t)w * sizeof(float));
}

static void scatter(float *whole, const float *src, long w, const seqset *q, const step *x) {
    long r = 0;
    for (int i = 0; i < x->n; i++)
        for (int j = 0; j < x->p[i].len; j++, r++)
            memcpy(whole + (q->cu[x->p[i].s] + x->p[i].off + j) * w, src + r * w, (size_t)w * sizeof(float));
}

/* 1 when every slot outside the sequences' ones still holds SENTINEL. */
static int others_kept(const float *arena, long slot_n, const seqset *q) {
    for (int sl = 0; sl < N_SLOTS; sl++) {
        int used = 0;
        for (int s = 0; s < q->n; s++) used |= q->slots[s] == sl;
        for (long i = 0; !used && i < slot_n; i++)
            if (arena[sl * slot_n + i] != SENTINEL) return 0;
    }
    return 1;
}

// ---- attention: kv_cache_write + attention_cached against attention

static void attention_pieces(int nq, int nkv, int hd, int gated) {
    const seqset  q = seqs_make();
    const long    T = q.cu[q.n], qw = (long)nq * hd, kw = (long)nkv * hd;
    const int64_t max_len = 47;
    step          st[MAX_STEPS];
    const int     n_steps = plan(&q, st);
    const float   scale   = 1.0f / sqrtf((float)hd);
    float        *Q = brand(T * qw, -2, 2), *K = brand(T * kw, -1, 1), *V = brand(T * kw, -1, 1);
    float        *G   = gated ? brand(T * qw, -3, 3) : NULL;
    float        *ref = balloc(4 * T * qw), *got = balloc(4 * T * qw);
    int32_t      *cu = balloc(sizeof q.cu);
    memcpy(cu, q.cu, sizeof q.cu);
    tst_ok(be->attention(ctx, ref, Q, K, V, G, cu, q.n, T, nq, nkv, hd, scale), "attention");

    const long slot_n = max_len * kw;
    float     *kc = balloc(4 * N_SLOTS * slot_n), *vc = balloc(4 * N_SLOTS * slot_n);
    for (long i = 0; i < N_SLOTS * slot_n; i++) kc[i] = vc[i] = SENTINEL;
    const long rows = T + q.n * PIECE_MAX; /* room for a rejected block */
    float     *sq = balloc(4 * rows * qw), *sk = balloc(4 * rows * kw), *sv = balloc(4 * rows * kw);
    float     *sg = balloc(4 * rows * qw), *so = balloc(4 * rows * qw);
    batch      b = batch_alloc();
    for (int k = 0; k < n_steps; k++) {
        step rej = st[k]; /* a verification block whose keys are written and then not kept */
        for (int i = 0; i < rej.n; i++) {
            const int room = (int)(max_len - rej.p[i].off);
            rej.p[i].len   = PIECE_MAX < room ? PIECE_MAX : room;
        }
        batch_set(&b, &q, &rej);
        tst_fill(sq, b.T * qw, -2, 2), tst_fill(sk, b.T * kw, -9, 9), tst_fill(sv, b.T * kw, -9, 9);
        tst_fill(sg, b.T * qw, -3, 3);
        tst_ok(be->kv_cache_write(ctx, kc, vc, sk, sv, b.slots, b.base, b.cu, b.n, b.T, nkv, hd, max_len),
               "kv_cache_write (rejected block)");
        tst_ok(be->attention_cached(ctx, so, sq, kc, vc, G ? sg : NULL, b.slots, b.base, b.cu, b.n, b.T, nq,
                                    nkv, hd, max_len, scale),
               "attention_cached (rejected block)");

        batch_set(&b, &q, &st[k]);
        gather(sq, Q, qw, &q, &st[k]), gather(sk, K, kw, &q, &st[k]), gather(sv, V, kw, &q, &st[k]);
        if (G) gather(sg, G, qw, &q, &st[k]);
        tst_ok(be->kv_cache_write(ctx, kc, vc, sk, sv, b.slots, b.base, b.cu, b.n, b.T, nkv, hd, max_len),
               "kv_cache_write");
        tst_ok(be->attention_cached(ctx, so, sq, kc, vc, G ? sg : NULL, b.slots, b.base, b.cu, b.n, b.T, nq,
                                    nkv, hd, max_len, scale),
               "attention_cached");
        scatter(got, so, qw, &q, &st[k]);
    }
    char name[112];
    snprintf(name, sizeof name, "attention_cached in %d steps nq=%d nkv=%d hd=%d%s (bits)", n_steps, nq, nkv,
             hd, gated ? " gated" : "");
    tst_compare(name, 64, got, ref, T * qw, 0, 0, NULL);
    TST_CHECK(others_kept(kc, slot_n, &q) && others_kept(vc, slot_n, &q));
    int rows_ok = 1; /* each sequence's cache rows are its keys and values */
    for (int s = 0; s < q.n; s++)
        rows_ok &= !memcmp(kc + q.slots[s] * slot_n, K + q.cu[s] * kw, 4 * (size_t)(q.lens[s] * kw)) &&
                   !memcmp(vc + q.slots[s] * slot_n, V + q.cu[s] * kw, 4 * (size_t)(q.lens[s] * kw));
    TST_CHECK(rows_ok);
    float *bufs[] = {Q, K, V, G, ref, got, kc, vc, sq, sk, sv, sg, so};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(ctx, bufs[i]);
    be->free(ctx, cu);
    batch_free(&b);
}

// ---- the stateful ops: conv1d_silu_cached and gdn_cached through one harness

typedef struct sop {
    const char  *name;
    int          gdn;    /* 0: conv1d_silu_cached; 1: gdn_cached */
    int          n_in;   /* conv: x; gdn: q, k, v, g, beta */
    long         w[5];   /* row widths of the inputs */
    long         out_w;  /* output row width */
    long         slot_n; /* state floats per slot */
    const float *cw;     /* conv weights [C, K] */
    int64_t      C;
    int          K;
    int          nk, nv, dk, dv;
    float        scale;
    double       atol, rtol; /* pieces against the uncached op (0, 0: bits) */
    int          strong;     /* gdn: every 7th g is −30 (e^g underflows) */
} sop;

static sop conv_op(int64_t C, int K) {
    sop f = {
        .name = "conv1d_silu_cached", .n_in = 1, .w = {C}, .out_w = C, .slot_n = (K - 1) * C, .C = C, .K = K};
    f.cw = brand(C * K, -1, 1);
    return f;
}

static sop gdn_op(int nk, int nv, int dk, int dv, int strong) {
    sop f = {.name   = "gdn_cached",
             .gdn    = 1,
             .n_in   = 5,
             .w      = {(long)nk * dk, (long)nk * dk, (long)nv * dv, nv, nv},
             .out_w  = (long)nv * dv,
             .slot_n = (long)nv * dk * dv,
             .nk     = nk,
             .nv     = nv,
             .dk     = dk,
             .dv     = dv,
             .scale  = 1.0f / sqrtf((float)dk),
             .atol   = 5e-8,
             .rtol   = 5e-7,
             .strong = strong};
    return f;
}

/* Random inputs for rows rows: conv x in [−2, 2); gdn q, k l2-normalised per head, v in
 * [−1, 1), g in [−0.4, 0) (every 7th −30 when strong), beta in [0, 1). */
static void sop_fill(const sop *f, float *const *in, long rows) {
    if (!f->gdn) {
        tst_fill(in[0], rows * f->w[0], -2, 2);
        return;
    }
    tst_fill(in[0], rows * f->w[0], -1, 1), tst_fill(in[1], rows * f->w[1], -1, 1);
    tst_l2norm_rows(in[0], rows * f->nk, f->dk), tst_l2norm_rows(in[1], rows * f->nk, f->dk);
    tst_fill(in[2], rows * f->w[2], -1, 1), tst_fill(in[3], rows * f->w[3], -0.4, 0);
    tst_fill(in[4], rows * f->w[4], 0, 1);
    if (f->strong)
        for (long i = 0; i < rows * f->w[3]; i += 7) in[3][i] = -30.0f;
}

static cm_status sop_call(const sop *f, float *out, float *const *in, float *state, const batch *b,
                          const int32_t *adv) {
    if (f->gdn)
        return be->gdn_cached(ctx, out, out ? in[0] : NULL, in[1], in[2], in[3], in[4], state, b->slots, adv,
                              b->cu, b->n, b->T, f->nk, f->nv, f->dk, f->dv, f->scale);
    return be->conv1d_silu_cached(ctx, out, in[0], f->cw, state, b->slots, adv, b->cu, b->n, b->T, f->C,
                                  f->K);
}

static cm_status sop_whole(const sop *f, float *out, float *const *in, const int32_t *cu, int n_seq,
                           int64_t T) {
    if (f->gdn)
        return be->gated_delta_rule(ctx, out, in[0], in[1], in[2], in[3], in[4], cu, n_seq, T, f->nk, f->nv,
                                    f->dk, f->dv, f->scale);
    return be->conv1d_silu(ctx, out, in[0], f->cw, cu, n_seq, T, f->C, f->K);
}

/* The final states the whole sequences leave, independently of kn_cache_ref.c: the conv's last
 * K − 1 rows (zeros before the start); the gdn recurrence per token in double with the state
 * held transposed (v-major), as test_kn_ref's oracle. */
static void sop_final_states(const sop *f, double *want, float *const *in, const seqset *q) {
    for (int s = 0; s < q->n; s++) {
        double       *ws  = want + (long)s * f->slot_n;
        const int64_t bos = q->cu[s], len = q->lens[s];
        if (!f->gdn) {
            for (int r = 0; r < f->K - 1; r++) {
                const int64_t src = len - (f->K - 1) + r;
                for (int64_t c = 0; c < f->C; c++)
                    ws[r * f->C + c] = src < 0 ? 0.0 : in[0][(bos + src) * f->C + c];
            }
            continue;
        }
        double *St = malloc(sizeof(double) * f->dv * f->dk);
        for (int h = 0; h < f->nv; h++) {
            const int kh = h / (f->nv / f->nk);
            memset(St, 0, sizeof(double) * f->dv * f->dk);
            for (int64_t t = bos; t < bos + len; t++) {
                const float *kt = in[1] + (t * f->nk + kh) * f->dk, *vt = in[2] + (t * f->nv + h) * f->dv;
                double       decay = exp((double)in[3][t * f->nv + h]), bt = in[4][t * f->nv + h];
                for (int c = 0; c < f->dv; c++) {
                    double *row = St + (long)c * f->dk, sk = 0;
                    for (int i = 0; i < f->dk; i++) {
                        row[i] *= decay;
                        sk += row[i] * kt[i];
                    }
                    double u = bt * ((double)vt[c] - sk);
                    for (int i = 0; i < f->dk; i++) row[i] += kt[i] * u;
                }
            }
            for (int i = 0; i < f->dk; i++)
                for (int c = 0; c < f->dv; c++)
                    ws[((long)h * f->dk + i) * f->dv + c] = St[(long)c * f->dk + i];
        }
        free(St);
    }
}

/* (a): the pieces against the whole; leaves the final states in *state_out (the arena). */
static float *sop_pieces(const sop *f, const char *tag) {
    const seqset q = seqs_make();
    const long   T = q.cu[q.n];
    step         st[MAX_STEPS];
    const int    n_steps = plan(&q, st);
    float       *in[5] = {0}, *sin[5] = {0};
    for (int i = 0; i < f->n_in; i++) in[i] = balloc(4 * T * f->w[i]), sin[i] = balloc(4 * T * f->w[i]);
    sop_fill(f, in, T);
    int32_t *cu = balloc(sizeof q.cu);
    memcpy(cu, q.cu, sizeof q.cu);
    float *ref = balloc(4 * T * f->out_w), *got = balloc(4 * T * f->out_w), *so = balloc(4 * T * f->out_w);
    tst_ok(sop_whole(f, ref, in, cu, q.n, T), "uncached op");

    float *state = balloc(4 * (N_SLOTS * f->slot_n + 1));
    for (long i = 0; i < N_SLOTS * f->slot_n; i++) state[i] = SENTINEL;
    for (int s = 0; s < q.n; s++) /* a new sequence's slot is zeroed first */
        tst_ok(be->zero(ctx, state + q.slots[s] * f->slot_n, 4 * (size_t)f->slot_n), "zero");
    batch b = batch_alloc();
    for (int k = 0; k < n_steps; k++) {
        batch_set(&b, &q, &st[k]);
        for (int i = 0; i < f->n_in; i++) gather(sin[i], in[i], f->w[i], &q, &st[k]);
        tst_ok(sop_call(f, so, sin, f->K == 1 && !f->gdn ? NULL : state, &b, b.adv), f->name);
        scatter(got, so, f->out_w, &q, &st[k]);
    }
    char name[128];
    snprintf(name, sizeof name, "%s %s in %d steps%s", f->name, tag, n_steps, f->atol ? "" : " (bits)");
    tst_compare(name, 64, got, ref, T * f->out_w, f->atol, f->rtol, NULL);
    if (f->gdn) {
        double *rl2 = malloc(sizeof(double) * T * f->out_w);
        for (long i = 0; i < T * f->out_w; i++) rl2[i] = ref[i];
        printf("%-64s rel L2 %.2e\n", name, tst_rel_l2(got, rl2, T * f->out_w));
        free(rl2);
    }
    TST_CHECK(others_kept(state, f->slot_n, &q));

    double *want = malloc(sizeof(double) * (q.n * f->slot_n + 1));
    float  *wf   = malloc(sizeof(float) * (q.n * f->slot_n + 1)),
          *gf    = malloc(sizeof(float) * (q.n * f->slot_n + 1));
    sop_final_states(f, want, in, &q);
    for (int s = 0; s < q.n; s++)
        for (long i = 0; i < f->slot_n; i++) {
            wf[s * f->slot_n + i] = (float)want[s * f->slot_n + i];
            gf[s * f->slot_n + i] = state[q.slots[s] * f->slot_n + i];
        }
    snprintf(name, sizeof name, "%s %s final states%s", f->name, tag, f->gdn ? "" : " (bits)");
    tst_compare(name, 64, gf, wf, q.n * f->slot_n, f->gdn ? 5e-8 : 0, f->gdn ? 5e-7 : 0, NULL);
    free(want), free(wf), free(gf);

    for (int i = 0; i < f->n_in; i++) be->free(ctx, in[i]), be->free(ctx, sin[i]);
    be->free(ctx, cu), be->free(ctx, ref), be->free(ctx, got), be->free(ctx, so);
    batch_free(&b);
    return state;
}

/* (b): a step without n_adv, its commit, and the same step cut to the committed tokens. */
static void sop_spec(const sop *f, float *state, const char *tag) {
    const seqset q = seqs_make();
    step         x = {q.n, {{0}}}, cut = {0, {{0}}};
    int32_t      a[MAX_SEQ];
    for (int s = 0; s < q.n; s++) {
        x.p[s] = (piece){s, 0, 1 + (int)(tst_urand() * PIECE_MAX)};
        a[s]   = s == 0 ? 0 : s == 1 ? x.p[s].len : (int)(tst_urand() * (x.p[s].len + 1));
        if (a[s]) cut.p[cut.n++] = (piece){s, 0, a[s]};
    }
    batch b = batch_alloc(), bc = batch_alloc();
    batch_set(&b, &q, &x), batch_set(&bc, &q, &cut);
    for (int s = 0; s < q.n; s++) b.adv[s] = a[s];
    float *in[5] = {0}, *cin[5] = {0};
    for (int i = 0; i < f->n_in; i++) in[i] = balloc(4 * b.T * f->w[i]), cin[i] = balloc(4 * b.T * f->w[i]);
    sop_fill(f, in, b.T);
    for (int i = 0; i < f->n_in; i++) /* the first a[s] rows of each sequence, packed */
        for (int j = 0; j < cut.n; j++)
            memcpy(cin[i] + bc.cu[j] * f->w[i], in[i] + b.cu[cut.p[j].s] * f->w[i],
                   4 * (size_t)(cut.p[j].len * f->w[i]));
    const long n_st  = N_SLOTS * f->slot_n;
    float     *saved = bdup(state, n_st), *after_a = NULL;
    float     *o1 = balloc(4 * b.T * f->out_w), *o2 = balloc(4 * b.T * f->out_w),
          *o3 = balloc(4 * b.T * f->out_w);
    float *st = f->K == 1 && !f->gdn ? NULL : state;

    tst_ok(sop_call(f, o1, in, st, &b, NULL), "step without n_adv");
    TST_CHECK(!memcmp(state, saved, 4 * (size_t)n_st));
    tst_ok(sop_call(f, NULL, in, st, &b, b.adv), "commit (out NULL)");
    after_a = bdup(state, n_st);

    memcpy(state, saved, 4 * (size_t)n_st); /* only the first a tokens, with out */
    tst_ok(sop_call(f, o2, cin, st, &bc, bc.adv), "the committed tokens alone");
    int same = !memcmp(state, after_a, 4 * (size_t)n_st);
    for (int j = 0; j < cut.n; j++)
        same &= !memcmp(o2 + bc.cu[j] * f->out_w, o1 + b.cu[cut.p[j].s] * f->out_w,
                        4 * (size_t)(cut.p[j].len * f->out_w));
    memcpy(state, saved, 4 * (size_t)n_st); /* the whole step with out and n_adv = a */
    tst_ok(sop_call(f, o3, in, st, &b, b.adv), "step with out and n_adv");
    same &= !memcmp(state, after_a, 4 * (size_t)n_st) && !memcmp(o3, o1, 4 * (size_t)(b.T * f->out_w));
    TST_CHECK(same);
    printf("%-64s %s\n", tag, same ? "ok" : "FAIL");

    for (int i = 0; i < f->n_in; i++) be->free(ctx, in[i]), be->free(ctx, cin[i]);
    be->free(ctx, saved), be->free(ctx, after_a), be->free(ctx, o1), be->free(ctx, o2), be->free(ctx, o3);
    batch_free(&b), batch_free(&bc);
}

static void sop_case(sop f, const char *tag) {
    float *state = sop_pieces(&f, tag);
    char   name[128];
    snprintf(name, sizeof name, "%s %s: no n_adv, commit, cut step (bits)", f.name, tag);
    sop_spec(&f, state, name);
    be->free(ctx, state);
    be->free(ctx, (void *)f.cw);
}

// ---- (c) refusals

static void test_refusals(void) {
    float   *d  = balloc(4 * 4096);
    int32_t *cu = balloc(4 * 3), *sl = balloc(4 * 2), *ba = balloc(4 * 2), *adv = balloc(4 * 2);
    int32_t *dup = balloc(4 * 2), *neg = balloc(4 * 2), *cu0 = balloc(4 * 3);
    cu[0] = 0, cu[1] = 2, cu[2] = 5;    /* lens 2, 3 */
    cu0[0] = 0, cu0[1] = 0, cu0[2] = 5; /* an empty sequence */
    sl[0] = 1, sl[1] = 0, dup[0] = dup[1] = 2, neg[0] = 0, neg[1] = -1;
    ba[0] = 0, ba[1] = 4;
    const cm_status E = CM_ERR_INVALID_ARG;

    // kv_cache_write: max_len 8 holds base 4 + len 3 = 7, not with max_len 6
    tst_ok(be->kv_cache_write(ctx, d + 1024, d + 2048, d, d, sl, ba, cu, 2, 5, 2, 4, 8),
           "kv_cache_write fits");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, ba, cu, 2, 5, 2, 4, 6), E,
              "kv_cache_write:", "base[1]=4 + len 3 > max_len=6");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, neg, cu, 2, 5, 2, 4, 8), E, "base[1]=-1 must be >= 0");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, neg, ba, cu, 2, 5, 2, 4, 8), E, "slots[1]=-1 must be >= 0");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, dup, ba, cu, 2, 5, 2, 4, 8), E,
              "slots[1]=2 repeats slots[0]");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, ba, cu0, 2, 5, 2, 4, 8), E, "sequence 0 is empty");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, NULL, cu, 2, 5, 2, 4, 8), E,
              "kv_cache_write:", "is NULL");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, ba, cu, 2, 6, 2, 4, 8), E, "must equal T=6");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, ba, cu, 2, 5, 2, 0, 8), E, "kv_cache_write: bad shape");
    TST_FAILS(be->kv_cache_write(ctx, d, d, d, d, sl, ba, cu, 2, 5, 2, 4, 0), E, "kv_cache_write: bad shape");
    tst_ok(be->kv_cache_write(ctx, NULL, NULL, NULL, NULL, NULL, NULL, cu, 0, 0, 2, 4, 8),
           "kv_cache_write T=0");

    // attention_cached
    tst_ok(
        be->attention_cached(ctx, d + 3072, d, d + 1024, d + 2048, NULL, sl, ba, cu, 2, 5, 4, 2, 4, 8, 0.5f),
        "attention_cached fits");
    TST_FAILS(be->attention_cached(ctx, d, d, d, d, NULL, sl, ba, cu, 2, 5, 3, 2, 4, 8, 0.5f), E,
              "attention_cached: nq=3 must be a multiple of nkv=2");
    TST_FAILS(be->attention_cached(ctx, d, d, d, d, NULL, sl, ba, cu, 2, 5, 4, 2, 4, 6, 0.5f), E,
              "attention_cached: base[1]=4 + len 3 > max_len=6");
    TST_FAILS(be->attention_cached(ctx, d, NULL, d, d, NULL, sl, ba, cu, 2, 5, 4, 2, 4, 8, 0.5f), E,
              "attention_cached:", "is NULL");
    TST_FAILS(be->attention_cached(ctx, d, d, d, d, NULL, dup, ba, cu, 2, 5, 4, 2, 4, 8, 0.5f), E, "repeats");

    // conv1d_silu_cached: n_adv in [0, len]
    adv[0] = 2, adv[1] = 0;
    tst_ok(be->conv1d_silu_cached(ctx, d + 2048, d, d, d + 1024, sl, adv, cu, 2, 5, 4, 4),
           "conv1d_silu_cached");
    adv[1] = 4;
    TST_FAILS(be->conv1d_silu_cached(ctx, d + 2048, d, d, d + 1024, sl, adv, cu, 2, 5, 4, 4), E,
              "conv1d_silu_cached: n_adv[1]=4 is out of range [0, len=3]");
    adv[1] = -1;
    TST_FAILS(be->conv1d_silu_cached(ctx, NULL, d, d, d + 1024, sl, adv, cu, 2, 5, 4, 4), E,
              "n_adv[1]=-1 is out of range");
    TST_FAILS(be->conv1d_silu_cached(ctx, d + 4, d, d, d + 1024, sl, NULL, cu, 2, 5, 4, 4), E,
              "out overlaps x");
    TST_FAILS(be->conv1d_silu_cached(ctx, d + 2048, d, d, NULL, sl, NULL, cu, 2, 5, 4, 4), E,
              "conv1d_silu_cached:", "is NULL");
    TST_FAILS(be->conv1d_silu_cached(ctx, d + 2048, d, d, d + 1024, sl, NULL, cu, 2, 5, 4, 0), E,
              "conv1d_silu_cached: bad shape");
    TST_FAILS(be->conv1d_silu_cached(ctx, d + 2048, d, d, d + 1024, neg, NULL, cu, 2, 5, 4, 4), E,
              "slots[1]=-1 must be >= 0");
    tst_ok(be->conv1d_silu_cached(ctx, d + 2048, d, d, NULL, sl, NULL, cu, 2, 5, 4, 1),
           "conv K=1 without state");

    // gdn_cached
    adv[1] = 3;
    tst_ok(be->gdn_cached(ctx, NULL, NULL, d, d, d, d, d + 2048, sl, adv, cu, 2, 5, 1, 2, 4, 4, 0.5f),
           "gdn_cached commit");
    TST_FAILS(be->gdn_cached(ctx, d + 1024, NULL, d, d, d, d, d + 2048, sl, adv, cu, 2, 5, 1, 2, 4, 4, 0.5f),
              E, "gdn_cached: q is NULL but out is not");
    adv[0] = 3;
    TST_FAILS(be->gdn_cached(ctx, NULL, NULL, d, d, d, d, d + 2048, sl, adv, cu, 2, 5, 1, 2, 4, 4, 0.5f), E,
              "gdn_cached: n_adv[0]=3 is out of range [0, len=2]");
    TST_FAILS(be->gdn_cached(ctx, d + 1024, d, d, d, d, d, d + 2048, sl, NULL, cu, 2, 5, 2, 3, 4, 4, 0.5f), E,
              "gdn_cached: nv=3 must be a multiple of nk=2");
    TST_FAILS(be->gdn_cached(ctx, d + 1024, d, d, d, d, d, NULL, sl, NULL, cu, 2, 5, 1, 2, 4, 4, 0.5f), E,
              "gdn_cached:", "is NULL");
    TST_FAILS(be->gdn_cached(ctx, d + 1024, d, d, d, d, d, d + 2048, dup, NULL, cu, 2, 5, 1, 2, 4, 4, 0.5f),
              E, "gdn_cached: slots[1]=2 repeats");
    TST_FAILS(be->gdn_cached(ctx, d + 1024, d, d, d, d, d, d + 2048, sl, NULL, cu0, 2, 5, 1, 2, 4, 4, 0.5f),
              E, "gdn_cached: sequence 0 is empty");
    tst_ok(
        be->gdn_cached(ctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, cu, 0, 0, 1, 2, 4, 4, 0.5f),
        "gdn_cached T=0");
    void *bufs[] = {d, cu, sl, ba, adv, dup, neg, cu0};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(ctx, bufs[i]);
}

int main(void) {
    be = kn_backend_cpu();
    if (!tst_ok(be->ctx_create(&ctx, NULL), "cpu ctx_create")) return tst_report();
    attention_pieces(6, 2, 20, 1);
    attention_pieces(3, 3, 7, 0);
    attention_pieces(4, 1, 33, 1);
    sop_case(conv_op(37, 4), "C=37 K=4");
    sop_case(conv_op(5, 7), "C=5 K=7");
    sop_case(conv_op(3, 1), "C=3 K=1");
    sop_case(gdn_op(2, 6, 16, 12, 0), "nk=2 nv=6 dk=16 dv=12");
    sop_case(gdn_op(1, 3, 7, 33, 0), "nk=1 nv=3 dk=7 dv=33");
    sop_case(gdn_op(2, 4, 9, 5, 1), "nk=2 nv=4 dk=9 dv=5 strong decay");
    test_refusals();
    be->ctx_destroy(&ctx);
    return tst_report();
}
