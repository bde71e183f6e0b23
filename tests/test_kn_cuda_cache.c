/* tests/test_kn_cuda_cache.c — the CUDA incremental-decoding kernels (kn_cache.cu) against the cpu
 * reference (kn_cache_ref.c) through the backend tables. Each case is a decoding session run on
 * both backends from the same inputs: a few sequences in distinct slots of a larger arena whose
 * every slot starts with random bits (so a state is really read, and a slot outside the batch
 * must keep its bits), a prefill, single-token steps, verification blocks of up to 16 tokens with
 * n_adv = a (a < len: the state snapshot mid-block while later outputs go on), without n_adv (the
 * states must not move) followed by the commit (out and q NULL), and steps with no n_adv at all.
 * After every call the outputs and the whole arena are compared. Shapes: odd ones (head dims 20,
 * 33 (rows not 16-byte multiples) and 32; dk, dv 7, 12, 16, 33, 40, 70; C 37, K 7) and 27B-like
 * ones (nq 24, nkv 4, hd 256 with 64..1516 cached positions, one sequence alone and eight
 * together, which take the split and the single-pass paths; nv 48, nk 16, dk = dv = 128; dk = dv
 * = 256 and 32; C 10240, K 4). Tolerances (fp32 kernels against double references; stated, not
 * yet measured on a device: the comparison lines print err/tol): attention out atol 2e-6 + rtol
 * 1e-5; conv out atol 1e-6 + rtol 1e-5; gdn out and states atol 2e-6 + rtol 2e-5; the key/value
 * cache and the conv states bit for bit (copies). Then the refusals and the NaN flags of bad
 * device tables. Label gpu; exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

#define MAXS   8
#define MAXST  6
#define W_NAME 84

static float *host_of(const dbuf *b, long n, int on_gpu) {
    float *h = tst_zeros_f32(n);
    if ((on_gpu ? gpu->download(gctx, h, b->g, (size_t)n * 4)
                : cpu->download(cctx, h, b->c, (size_t)n * 4)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    return h;
}

static void cmp(const char *name, const dbuf *b, long n, double atol, double rtol) {
    float *c = host_of(b, n, 0), *g = host_of(b, n, 1);
    tst_compare(name, W_NAME, g, c, n, atol, rtol, NULL);
    free(c), free(g);
}

static dbuf put_rand(long n, double lo, double hi) {
    float *h = tst_rand_f32(n > 0 ? n : 1, lo, hi);
    dbuf   b = dbuf_put(h, (size_t)(n > 0 ? n : 1) * 4);
    free(h);
    return b;
}

/* NaN into the cuda side, so that an element the kernel never writes fails. */
static void poison(dbuf *b, long n) {
    float *h = tst_zeros_f32(n);
    for (long i = 0; i < n; i++)
        h[i] = NAN;
    tst_ok(gpu->upload(gctx, b->g, h, (size_t)n * 4), "poison");
    free(h);
}

/* A step's tables on both backends; base and adv NULL give zeros (passed as NULL by the caller). */
typedef struct tabs {
    int     n;
    int64_t T;
    int32_t hcu[MAXS + 1];
    dbuf    cu, slots, base, adv;
} tabs;

static tabs tabs_put(int n, const int *lens, const int32_t *slots, const int32_t *base, const int32_t *adv) {
    tabs t = {.n = n};
    for (int s = 0; s < n; s++)
        t.hcu[s + 1] = t.hcu[s] + lens[s];
    t.T = t.hcu[n];
    t.cu = dbuf_put(t.hcu, 4 * (size_t)(n + 1));
    t.slots = dbuf_put(slots, 4 * (size_t)n);
    t.base = dbuf_put(base, 4 * (size_t)n);
    t.adv = dbuf_put(adv, 4 * (size_t)n);
    return t;
}

static void tabs_free(tabs *t) {
    dbuf_free(&t->cu), dbuf_free(&t->slots), dbuf_free(&t->base), dbuf_free(&t->adv);
}

// ----------------------------------------------------------------------------
// attention: kv_cache_write + attention_cached

typedef struct attn_case {
    const char *name;
    int         nq, nkv, hd, gated;
    int         n_seq, n_slots;
    int32_t     slots[MAXS];
    int64_t     max_len;
    int         pre[MAXS];
    int         pre_attend; /* 0: the prefill only writes the cache (long contexts) */
    int         n_steps;
    int         lens[MAXST][MAXS], acc[MAXST][MAXS]; /* acc: the tokens kept (base advances by them) */
} attn_case;

static void attn_step(const attn_case *c, const dbuf *kc, const dbuf *vc, const int *lens,
                      const int32_t *base, int attend, const char *what) {
    const long  qw = (long)c->nq * c->hd, kw = (long)c->nkv * c->hd;
    tabs        t = tabs_put(c->n_seq, lens, c->slots, base, NULL);
    dbuf        q = put_rand(t.T * qw, -2, 2), k = put_rand(t.T * kw, -1, 1), v = put_rand(t.T * kw, -1, 1);
    dbuf        g = put_rand(t.T * qw, -3, 3), o = dbuf_put(NULL, (size_t)(t.T * qw) * 4);
    const float scale = 1.0f / sqrtf((float)c->hd);
    const long  arena = c->n_slots * c->max_len * kw;
    char        name[160];
    tst_ok(cpu->kv_cache_write(cctx, kc->c, vc->c, k.c, v.c, t.slots.c, t.base.c, t.cu.c, t.n, t.T, c->nkv,
                               c->hd, c->max_len),
           "cpu kv_cache_write");
    tst_ok(gpu->kv_cache_write(gctx, kc->g, vc->g, k.g, v.g, t.slots.g, t.base.g, t.cu.g, t.n, t.T, c->nkv,
                               c->hd, c->max_len),
           "cuda kv_cache_write");
    snprintf(name, sizeof name, "%s %s: key cache (bits)", c->name, what);
    cmp(name, kc, arena, 0, 0);
    snprintf(name, sizeof name, "%s %s: value cache (bits)", c->name, what);
    cmp(name, vc, arena, 0, 0);
    if (attend) {
        poison(&o, t.T * qw);
        tst_ok(cpu->attention_cached(cctx, o.c, q.c, kc->c, vc->c, c->gated ? g.c : NULL, t.slots.c, t.base.c,
                                     t.cu.c, t.n, t.T, c->nq, c->nkv, c->hd, c->max_len, scale),
               "cpu attention_cached");
        tst_ok(gpu->attention_cached(gctx, o.g, q.g, kc->g, vc->g, c->gated ? g.g : NULL, t.slots.g, t.base.g,
                                     t.cu.g, t.n, t.T, c->nq, c->nkv, c->hd, c->max_len, scale),
               "cuda attention_cached");
        snprintf(name, sizeof name, "%s %s: out (T=%lld)", c->name, what, (long long)t.T);
        cmp(name, &o, t.T * qw, 2e-6, 1e-5);
    }
    dbuf_free(&q), dbuf_free(&k), dbuf_free(&v), dbuf_free(&g), dbuf_free(&o);
    tabs_free(&t);
}

static void attn_session(const attn_case *c) {
    const long arena = c->n_slots * c->max_len * (long)c->nkv * c->hd;
    dbuf       kc = put_rand(arena, -1, 1), vc = put_rand(arena, -1, 1);
    int32_t    base[MAXS] = {0};
    attn_step(c, &kc, &vc, c->pre, base, c->pre_attend, "prefill");
    for (int s = 0; s < c->n_seq; s++)
        base[s] = c->pre[s];
    for (int k = 0; k < c->n_steps; k++) {
        char what[32];
        snprintf(what, sizeof what, "step %d", k + 1);
        attn_step(c, &kc, &vc, c->lens[k], base, 1, what);
        for (int s = 0; s < c->n_seq; s++)
            base[s] += c->acc[k][s];
    }
    dbuf_free(&kc), dbuf_free(&vc);
}

static void test_attention(void) {
    static const attn_case cases[] = {
        {"attn nq=6 nkv=2 hd=20 gated",
         6,
         2,
         20,
         1,
         3,
         5,
         {4, 0, 2},
         100,
         {37, 5, 1},
         1,
         3,
         {{1, 1, 1}, {7, 16, 3}, {16, 1, 9}},
         {{1, 1, 1}, {2, 16, 0}, {16, 1, 9}}},
        {"attn nq=5 nkv=5 hd=33 split",
         5,
         5,
         33,
         0,
         3,
         5,
         {1, 4, 0},
         300,
         {37, 5, 1},
         1,
         3,
         {{1, 1, 1}, {7, 16, 3}, {16, 1, 9}},
         {{1, 1, 1}, {2, 16, 0}, {16, 1, 9}}},
        {"attn tiny nq=4 nkv=2 hd=32 gated",
         4,
         2,
         32,
         1,
         4,
         4,
         {1, 3, 0, 2},
         64,
         {20, 1, 9, 30},
         1,
         2,
         {{1, 1, 1, 1}, {16, 4, 1, 8}},
         {{1, 1, 1, 1}, {3, 4, 1, 0}}},
        {"attn 27B nq=24 nkv=4 hd=256 gated",
         24,
         4,
         256,
         1,
         3,
         4,
         {2, 0, 3},
         640,
         {300, 517, 64},
         0,
         3,
         {{1, 1, 1}, {16, 16, 5}, {1, 16, 16}},
         {{1, 1, 1}, {4, 16, 0}, {1, 1, 1}}},
        {"attn 27B one sequence, 1500 cached",
         24,
         4,
         256,
         1,
         1,
         2,
         {1},
         2048,
         {1500},
         0,
         2,
         {{1}, {16}},
         {{1}, {16}}},
        {"attn 27B eight sequences, max_len 128",
         24,
         4,
         256,
         1,
         8,
         9,
         {8, 0, 7, 1, 6, 2, 5, 3},
         128,
         {50, 3, 17, 64, 1, 33, 9, 80},
         1,
         2,
         {{1, 1, 1, 1, 1, 1, 1, 1}, {16, 4, 16, 1, 7, 16, 2, 16}},
         {{1, 1, 1, 1, 1, 1, 1, 1}, {16, 4, 16, 1, 7, 16, 2, 16}}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        attn_session(&cases[i]);
}

// ----------------------------------------------------------------------------
// the GDN layers: conv1d_silu_cached and gdn_cached

enum { WITH_ADV = 0, SPEC_COMMIT = 1, NO_ADV = 2 };

typedef struct sf_case {
    const char *name;
    int         gdn;
    int64_t     C;
    int         K;
    int         nk, nv, dk, dv;
    int         n_seq, n_slots;
    int32_t     slots[MAXS];
} sf_case;

/* The steps every stateful session runs: lens, a and mode per step (pre[] replaces step 0's lens). */
static const int SF_STEPS = 5;
static const int SF_MODE[5] = {WITH_ADV, WITH_ADV, SPEC_COMMIT, WITH_ADV, NO_ADV};
static const int SF_LENS[5][3] = {{0}, {1, 1, 1}, {16, 7, 3}, {16, 7, 3}, {4, 16, 1}};
static const int SF_ACC[5][3] = {{0}, {1, 1, 1}, {5, 7, 0}, {16, 2, 0}, {0}};

static void sf_session(const sf_case *c, const int *pre) {
    const long   slot_n = c->gdn ? (long)c->nv * c->dk * c->dv : (c->K - 1) * c->C;
    const long   arena = c->n_slots * slot_n;
    const long   w_qk = (long)c->nk * c->dk, w_v = (long)c->nv * c->dv, out_w = c->gdn ? w_v : c->C;
    const float  scale = c->gdn ? 1.0f / sqrtf((float)c->dk) : 0.0f;
    dbuf         state = put_rand(arena, -0.5, 0.5), cw = put_rand(c->gdn ? 1 : c->C * c->K, -1, 1);
    const double atol = c->gdn ? 2e-6 : 1e-6, rtol = c->gdn ? 2e-5 : 1e-5;
    for (int k = 0; k < SF_STEPS; k++) {
        int lens[MAXS], acc[MAXS];
        for (int s = 0; s < c->n_seq; s++) {
            lens[s] = k == 0 ? pre[s] : SF_LENS[k][s];
            acc[s] = k == 0 ? pre[s] : SF_ACC[k][s];
        }
        tabs       t = tabs_put(c->n_seq, lens, c->slots, NULL, acc);
        const long T = t.T;
        dbuf       o = dbuf_put(NULL, (size_t)(T * out_w) * 4), in[5];
        if (c->gdn) {
            float *q = tst_rand_f32(T * w_qk, -1, 1), *kk = tst_rand_f32(T * w_qk, -1, 1);
            float *g = tst_rand_f32(T * c->nv, -1.5, -0.001);
            tst_l2norm_rows(q, T * c->nk, c->dk), tst_l2norm_rows(kk, T * c->nk, c->dk);
            for (long i = 0; i < T * c->nv; i += 2) /* slow decays too: the state carries far */
                g[i] *= 0.01f;
            in[0] = dbuf_put(q, (size_t)(T * w_qk) * 4), in[1] = dbuf_put(kk, (size_t)(T * w_qk) * 4);
            in[2] = put_rand(T * w_v, -1, 1), in[3] = dbuf_put(g, (size_t)(T * c->nv) * 4);
            in[4] = put_rand(T * c->nv, 0.02, 0.98);
            free(q), free(kk), free(g);
        } else {
            in[0] = put_rand(T * c->C, -2, 2);
        }
        const int   n_in = c->gdn ? 5 : 1, mode = SF_MODE[k];
        const void *adv_c = mode == WITH_ADV ? t.adv.c : NULL, *adv_g = mode == WITH_ADV ? t.adv.g : NULL;
        char        name[160];
        float      *before = mode == SPEC_COMMIT ? host_of(&state, arena, 1) : NULL;
        poison(&o, T * out_w);
        for (int side = 0; side < 2; side++) {
            const kn_backend *be = side ? gpu : cpu;
            kn_ctx           *cx = side ? gctx : cctx;
#define P(b) (side ? (b).g : (b).c)
            cm_status st = c->gdn ? be->gdn_cached(cx, P(o), P(in[0]), P(in[1]), P(in[2]), P(in[3]), P(in[4]),
                                                   P(state), P(t.slots), side ? adv_g : adv_c, P(t.cu), t.n,
                                                   T, c->nk, c->nv, c->dk, c->dv, scale)
                                  : be->conv1d_silu_cached(cx, P(o), P(in[0]), P(cw),
                                                           c->K > 1 ? P(state) : NULL, P(t.slots),
                                                           side ? adv_g : adv_c, P(t.cu), t.n, T, c->C, c->K);
            tst_ok(st, side ? "cuda step" : "cpu step");
            if (mode != SPEC_COMMIT)
                continue;
            if (side) { /* without n_adv the cuda states keep their bits (the cpu's: the unit test) */
                float *now = host_of(&state, arena, 1);
                int    kept = !memcmp(before, now, (size_t)arena * 4);
                TST_CHECK(kept);
                snprintf(name, sizeof name, "%s step %d without n_adv: states keep their bits", c->name, k);
                printf("%-*s %s\n", W_NAME, name, kept ? "ok" : "FAIL");
                free(now);
            }
            /* the commit: out (and q) NULL, n_adv = a */
            st = c->gdn ? be->gdn_cached(cx, NULL, NULL, P(in[1]), P(in[2]), P(in[3]), P(in[4]), P(state),
                                         P(t.slots), P(t.adv), P(t.cu), t.n, T, c->nk, c->nv, c->dk, c->dv,
                                         scale)
                        : be->conv1d_silu_cached(cx, NULL, P(in[0]), P(cw), c->K > 1 ? P(state) : NULL,
                                                 P(t.slots), P(t.adv), P(t.cu), t.n, T, c->C, c->K);
            tst_ok(st, side ? "cuda commit" : "cpu commit");
#undef P
        }
        free(before);
        snprintf(name, sizeof name, "%s step %d (T=%ld%s): out", c->name, k, T,
                 mode == WITH_ADV      ? ", n_adv"
                 : mode == SPEC_COMMIT ? ", no n_adv"
                                       : ", no n_adv, no commit");
        cmp(name, &o, T * out_w, atol, rtol);
        snprintf(name, sizeof name, "%s step %d: states%s%s", c->name, k,
                 mode == SPEC_COMMIT ? " after the commit" : "", c->gdn ? "" : " (bits)");
        cmp(name, &state, arena, c->gdn ? atol : 0, c->gdn ? rtol : 0);
        for (int i = 0; i < n_in; i++)
            dbuf_free(&in[i]);
        dbuf_free(&o);
        tabs_free(&t);
    }
    dbuf_free(&state), dbuf_free(&cw);
}

static void test_stateful(void) {
    static const int     pre_odd[3] = {37, 5, 1}, pre_27b[3] = {300, 64, 1};
    static const sf_case convs[] = {
        {"conv C=37 K=4", 0, 37, 4, 0, 0, 0, 0, 3, 5, {4, 0, 2}},
        {"conv C=5 K=7", 0, 5, 7, 0, 0, 0, 0, 3, 4, {1, 3, 0}},
        {"conv C=3 K=1", 0, 3, 1, 0, 0, 0, 0, 3, 3, {2, 1, 0}},
        {"conv 27B C=10240 K=4", 0, 10240, 4, 0, 0, 0, 0, 3, 4, {3, 1, 2}},
    };
    static const sf_case gdns[] = {
        {"gdn nk=2 nv=6 dk=16 dv=12", 1, 0, 0, 2, 6, 16, 12, 3, 5, {4, 0, 2}},
        {"gdn nk=1 nv=3 dk=7 dv=33", 1, 0, 0, 1, 3, 7, 33, 3, 4, {1, 3, 0}},
        {"gdn nk=2 nv=4 dk=40 dv=70", 1, 0, 0, 2, 4, 40, 70, 3, 4, {3, 1, 2}},
        {"gdn nk=4 nv=8 dk=dv=32", 1, 0, 0, 4, 8, 32, 32, 3, 4, {0, 2, 3}},
        {"gdn nk=2 nv=4 dk=dv=256", 1, 0, 0, 2, 4, 256, 256, 3, 4, {2, 3, 1}},
        {"gdn 27B nk=16 nv=48 dk=dv=128", 1, 0, 0, 16, 48, 128, 128, 3, 4, {3, 1, 2}},
    };
    for (size_t i = 0; i < sizeof convs / sizeof convs[0]; i++)
        sf_session(&convs[i], convs[i].C > 1000 ? pre_27b : pre_odd);
    for (size_t i = 0; i < sizeof gdns / sizeof gdns[0]; i++)
        sf_session(&gdns[i], gdns[i].nv == 48 ? pre_27b : pre_odd);
}

// ----------------------------------------------------------------------------
// bad device tables: NaN outputs, no cache or state writes (cuda only; the cpu refuses them)

static int all_nan(const float *x, long n) {
    int ok = 1;
    for (long i = 0; i < n; i++)
        ok &= isnan(x[i]);
    return ok;
}

static int all_finite(const float *x, long n) {
    int ok = 1;
    for (long i = 0; i < n; i++)
        ok &= isfinite(x[i]);
    return ok;
}

static void test_flags(void) {
    const int     lens[2] = {2, 3};
    const int32_t slots[2] = {0, 1}, bad_slots[2] = {0, -1}, base[2] = {0, 7}, adv[2] = {2, 4};
    const int     nq = 2, hd = 8, nv = 2, dk = 8, dv = 8;
    const long    arena = 2 * 8 * hd, st_n = 2L * nv * dk * dv;
    tabs          t = tabs_put(2, lens, slots, base, adv), tb = tabs_put(2, lens, bad_slots, base, adv);
    dbuf          kc = dbuf_put(NULL, arena * 4), vc = dbuf_put(NULL, arena * 4), k = put_rand(5 * hd, -1, 1);
    dbuf          q = put_rand(5 * nq * hd, -1, 1), o = dbuf_put(NULL, 5 * nq * hd * 4);
    // attention: base[1] + len 3 > max_len 8
    tst_ok(gpu->kv_cache_write(gctx, kc.g, vc.g, k.g, k.g, t.slots.g, t.base.g, t.cu.g, 2, 5, 1, hd, 8),
           "cuda kv_cache_write (bad base)");
    tst_ok(gpu->attention_cached(gctx, o.g, q.g, kc.g, vc.g, NULL, t.slots.g, t.base.g, t.cu.g, 2, 5, nq, 1,
                                 hd, 8, 0.3f),
           "cuda attention_cached (bad base)");
    float *hk = host_of(&k, 5 * hd, 1), *hc = host_of(&kc, arena, 1), *ho = host_of(&o, 5 * nq * hd, 1);
    int    zero = 1;
    for (long i = 8 * hd; i < arena; i++)
        zero &= hc[i] == 0.0f;
    const int att_ok = !memcmp(hc, hk, 2 * hd * 4) && zero && all_finite(ho, 2 * nq * hd) &&
                       all_nan(ho + 2 * nq * hd, 3 * nq * hd);
    TST_CHECK(att_ok);
    printf("%-*s %s\n", W_NAME, "bad base: its cache rows unwritten, its outputs NaN",
           att_ok ? "ok" : "FAIL");
    free(hk), free(hc), free(ho);

    // gdn: n_adv[1] = 4 > len 3
    dbuf st = put_rand(st_n, -0.5, 0.5), gq = put_rand(5 * dk, -0.3, 0.3), gv = put_rand(5 * nv * dv, -1, 1);
    dbuf gg = put_rand(5 * nv, -1, 0), gb = put_rand(5 * nv, 0, 1), go = dbuf_put(NULL, 5 * nv * dv * 4);
    float *s0 = host_of(&st, st_n, 1);
    tst_ok(gpu->gdn_cached(gctx, go.g, gq.g, gq.g, gv.g, gg.g, gb.g, st.g, t.slots.g, t.adv.g, t.cu.g, 2, 5,
                           1, nv, dk, dv, 0.3f),
           "cuda gdn_cached (bad n_adv)");
    float    *s1 = host_of(&st, st_n, 1), *gho = host_of(&go, 5 * nv * dv, 1);
    const int gdn_ok = !memcmp(s0 + st_n / 2, s1 + st_n / 2, (size_t)st_n / 2 * 4) &&
                       memcmp(s0, s1, (size_t)st_n / 2 * 4) && all_finite(gho, 2 * nv * dv) &&
                       all_nan(gho + 2 * nv * dv, 3 * nv * dv);
    TST_CHECK(gdn_ok);
    printf("%-*s %s\n", W_NAME, "bad n_adv: its state unwritten, its outputs NaN", gdn_ok ? "ok" : "FAIL");
    free(s0), free(s1), free(gho);

    // conv: slots[1] = −1
    dbuf   cx = put_rand(5 * 6, -1, 1), cw = put_rand(6 * 4, -1, 1), cs = put_rand(2 * 3 * 6, -1, 1);
    dbuf   co = dbuf_put(NULL, 5 * 6 * 4);
    float *c0 = host_of(&cs, 36, 1);
    tst_ok(gpu->conv1d_silu_cached(gctx, co.g, cx.g, cw.g, cs.g, tb.slots.g, tb.adv.g, tb.cu.g, 2, 5, 6, 4),
           "cuda conv1d_silu_cached (bad slot)");
    float    *c1 = host_of(&cs, 36, 1), *cho = host_of(&co, 30, 1);
    const int conv_ok = !memcmp(c0 + 18, c1 + 18, 18 * 4) && all_finite(cho, 12) && all_nan(cho + 12, 18);
    TST_CHECK(conv_ok);
    printf("%-*s %s\n", W_NAME, "bad slot: no state written for it, its outputs NaN",
           conv_ok ? "ok" : "FAIL");
    free(c0), free(c1), free(cho);

    dbuf *bufs[] = {&kc, &vc, &k, &q, &o, &st, &gq, &gv, &gg, &gb, &go, &cx, &cw, &cs, &co};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        dbuf_free(bufs[i]);
    tabs_free(&t), tabs_free(&tb);
}

// ----------------------------------------------------------------------------
// refusals on the host: the cpu's words where the rule is the same

static void test_refusals(void) {
    const int       lens[2] = {2, 3};
    const int32_t   slots[2] = {0, 1}, base[2] = {0, 0};
    tabs            t = tabs_put(2, lens, slots, base, NULL);
    dbuf            d = dbuf_put(NULL, 4096 * 4);
    float          *g = d.g;
    const int32_t  *sl = t.slots.g, *ba = t.base.g, *cu = t.cu.g;
    const cm_status E = CM_ERR_INVALID_ARG, U = CM_ERR_UNSUPPORTED;
    TST_FAILS(gpu->attention_cached(gctx, g, g, g, g, NULL, sl, ba, cu, 2, 5, 2, 1, 300, 8, 0.3f), U,
              "attention_cached: head dim 300");
    TST_FAILS(gpu->attention_cached(gctx, g, g, g, g, NULL, sl, ba, cu, 2, 5, 3, 2, 8, 8, 0.3f), E,
              "attention_cached: nq=3 must be a multiple of nkv=2");
    TST_FAILS(gpu->attention_cached(gctx, g, g, g, g, NULL, sl, ba, cu, 3, 2, 2, 1, 8, 8, 0.3f), E,
              "attention_cached: T=2 tokens for n_seq=3");
    TST_FAILS(gpu->attention_cached(gctx, g, NULL, g, g, NULL, sl, ba, cu, 2, 5, 2, 1, 8, 8, 0.3f), E,
              "attention_cached:", "is NULL");
    TST_FAILS(gpu->kv_cache_write(gctx, g, g, g, g, sl, ba, cu, 2, 5, 1, 8, 0), E,
              "kv_cache_write: bad shape");
    TST_FAILS(gpu->kv_cache_write(gctx, g, g, g, g, sl, NULL, cu, 2, 5, 1, 8, 8), E,
              "kv_cache_write:", "is NULL");
    TST_FAILS(gpu->conv1d_silu_cached(gctx, g + 4, g, g, g + 2048, sl, NULL, cu, 2, 5, 4, 4), E,
              "conv1d_silu_cached: out overlaps x");
    TST_FAILS(gpu->conv1d_silu_cached(gctx, g + 1024, g, g, g + 2048, sl, NULL, cu, 2, 5, 4, 0), E,
              "conv1d_silu_cached: bad shape");
    TST_FAILS(gpu->conv1d_silu_cached(gctx, g + 1024, g, g, NULL, sl, NULL, cu, 2, 5, 4, 4), E,
              "conv1d_silu_cached:", "is NULL");
    TST_FAILS(gpu->gdn_cached(gctx, g, g, g, g, g, g, g, sl, NULL, cu, 2, 5, 1, 1, 300, 8, 0.3f), U,
              "gdn_cached: dk=300");
    TST_FAILS(gpu->gdn_cached(gctx, g, NULL, g, g, g, g, g, sl, NULL, cu, 2, 5, 1, 2, 8, 8, 0.3f), E,
              "gdn_cached: q is NULL but out is not");
    TST_FAILS(gpu->gdn_cached(gctx, g, g, g, g, g, g, g, sl, NULL, cu, 2, 5, 2, 3, 8, 8, 0.3f), E,
              "gdn_cached: nv=3 must be a multiple of nk=2");
    /* T = 0: nothing to do, no pointer looked at */
    tst_ok(gpu->kv_cache_write(gctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 1, 8, 8),
           "kv_cache_write T=0");
    tst_ok(
        gpu->attention_cached(gctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 2, 1, 8, 8, 0.3f),
        "attention_cached T=0");
    tst_ok(gpu->conv1d_silu_cached(gctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 4, 4),
           "conv1d_silu_cached T=0");
    tst_ok(gpu->gdn_cached(gctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 1, 2, 8, 8,
                           0.3f),
           "gdn_cached T=0");
    dbuf_free(&d);
    tabs_free(&t);
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    test_attention();
    test_stateful();
    test_flags();
    test_refusals();
    tst_pair_close();
    return tst_report();
}
