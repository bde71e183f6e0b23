/* tests/test_kn_moe.c — the mixture-of-experts ops (kn_backend.h "mixture of experts").
 *   test_kn_moe cpu    the reference (ref/kn_moe_ref.c, through the cpu table) against the header
 *                      computed another way: the softmax in double and the top-K by sorting
 *                      (probability descending, then index ascending), idx exactly and w within
 *                      the fp32 rounding bound (n + 4 + max|l − m|)·2^-24 relative (n the terms of
 *                      w's sum: E, or K with renorm; each unit of |l − m| is an ulp of exp's
 *                      argument); constructed rows of equal logits (exact ties go to the lower
 *                      index), −inf logits and a NaN logit; renorm on and off, K = 1 and K = E;
 *                      moe_group against a sort of the (expert, assignment) pairs and src/dst
 *                      inverse; gather rows bit for bit; combine against a double loop within
 *                      (K + 4)·2^-24 of Σ|terms|, with and without shared; the refusals.
 *   test_kn_moe cuda   kn_moe.cu against the cpu reference on odd shapes (T 1 … 4099, E 3 … 512 and
 *                      1024, K 1 … 10, D 1, 33, 2048): idx equal except where the two chosen p are
 *                      within 1e-6 of a tie (counted, and 0 expected from random logits), w within
 *                      1e-6 relative (the same fp32 operations in the same order; only expf's ulps
 *                      differ), offsets/src/dst and gather bit for bit from the same idx, combine
 *                      within 1e-5 of Σ|terms|; the documented handling of bad device indices;
 *                      label gpu, exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cm_rng.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"

#define U32 (1.0 / 16777216.0) /* 2^-24, the unit roundoff of fp32 */

static cm_rng rng;

/* n logits N(0, 1)·scale as floats: a tie is a 2^-24 event per pair. */
static float *rand_logits(long n, double scale) {
    float *x = tst_zeros_f32(n);
    for (long i = 0; i < n; i++) x[i] = (float)(cm_rng_normal(&rng) * scale);
    return x;
}

static int32_t *rand_idx(long n, int E) {
    int32_t *x = tst_xcalloc((size_t)n * 4);
    for (long i = 0; i < n; i++) x[i] = (int32_t)cm_rng_below(&rng, (uint64_t)E);
    return x;
}

// ---- the independent pieces: double softmax and a sort

typedef struct pe {
    double p;
    int    e;
} pe;

static int pe_cmp(const void *a, const void *b) {
    const pe *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->e - y->e;
}

/* The row's softmax in double, sorted best first into s [E]; returns max|l − m|. */
static double sorted_softmax(pe *s, const float *l, int E) {
    double m = -INFINITY, sum = 0, spread = 0;
    for (int e = 0; e < E; e++) m = fmax(m, l[e]);
    for (int e = 0; e < E; e++) {
        s[e].p = exp((double)l[e] - m);
        s[e].e = e;
        sum += s[e].p;
        if (isfinite(l[e])) spread = fmax(spread, m - l[e]);
    }
    for (int e = 0; e < E; e++) s[e].p /= sum;
    qsort(s, (size_t)E, sizeof *s, pe_cmp);
    return spread;
}

typedef struct pair {
    int32_t e, a;
} pair;

static int pair_cmp(const void *x, const void *y) {
    const pair *p = x, *q = y;
    return p->e != q->e ? (p->e < q->e ? -1 : 1) : (p->a < q->a ? -1 : p->a > q->a);
}

// ---- cpu: the reference against the header

static const kn_backend *ref;
static kn_ctx           *rctx;

/* Routes T rows of l on the cpu and checks every row against the double sort; returns idx. */
static int32_t *check_route(const char *what, const float *l, long T, int E, int K, int renorm) {
    int32_t *idx = tst_xcalloc((size_t)(T * K) * 4);
    float   *w = tst_zeros_f32(T * K);
    pe      *s = tst_xcalloc((size_t)E * sizeof *s);
    tst_ok(ref->moe_route(rctx, idx, w, l, T, E, K, renorm), "moe_route");
    long   bad_i = 0, bad_w = 0;
    double worst = 0;
    for (long t = 0; t < T; t++) {
        const double spread = sorted_softmax(s, l + t * E, E);
        double       chosen = 0;
        for (int k = 0; k < K; k++) chosen += s[k].p;
        const double tol = ((renorm ? K : E) + 4 + ceil(spread)) * U32;
        for (int k = 0; k < K; k++) {
            const double want = renorm ? s[k].p / chosen : s[k].p;
            const double err = fabs((double)w[t * K + k] - want) / fmax(want, 1e-300); /* p = 0: exact */
            bad_i += idx[t * K + k] != s[k].e;
            bad_w += !(err <= tol);
            if (err / tol > worst) worst = err / tol;
        }
    }
    printf("moe_route %-12s T=%-4ld E=%-4d K=%-3d renorm=%d: %ld idx and %ld w differ (w err/tol %.3f)\n", what, T,
           E, K, renorm, bad_i, bad_w, worst);
    TST_CHECK(bad_i == 0 && bad_w == 0);
    free(w), free(s);
    return idx;
}

/* Hand-built rows whose answer is known: equal logits (ties to the lower index), −inf logits
 * (p = 0, chosen last, in index order), a NaN (the whole row NaN: idx 0 … K−1, w NaN). */
static void check_route_constructed(void) {
    const float ninf = -INFINITY;
    const float rows[4][8] = {
        {1, 3, 2, 3, 3, 0, 2, 1},
        {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f},
        {ninf, 0, ninf, 1, ninf, ninf, 2, ninf},
        {1, 3, 2, 3, 3, NAN, 2, 1},
    };
    const int32_t want[4][5] = {{1, 3, 4, 2, 6}, {0, 1, 2, 3, 4}, {6, 3, 1, 0, 2}, {0, 1, 2, 3, 4}};
    for (int renorm = 0; renorm < 2; renorm++) {
        int32_t *idx = check_route("constructed", &rows[0][0], 3, 8, 5, renorm);
        TST_CHECK(memcmp(idx, want, sizeof(int32_t) * 15) == 0);
        free(idx);
        int32_t ni[5];
        float   nw[5];
        tst_ok(ref->moe_route(rctx, ni, nw, rows[3], 1, 8, 5, renorm), "moe_route NaN row");
        TST_CHECK(memcmp(ni, want[3], sizeof ni) == 0);
        for (int k = 0; k < 5; k++) TST_CHECK(isnan(nw[k]));
    }
    /* the all-equal row: w exactly 1/8, or 1/5 after renorm */
    int32_t ti[5];
    float   tw[5];
    tst_ok(ref->moe_route(rctx, ti, tw, rows[1], 1, 8, 5, 0), "moe_route");
    for (int k = 0; k < 5; k++) TST_CHECK(tw[k] == 0.125f);
    tst_ok(ref->moe_route(rctx, ti, tw, rows[1], 1, 8, 5, 1), "moe_route");
    for (int k = 0; k < 5; k++) TST_CHECK(tw[k] == 0.125f / 0.625f);
}

static void check_group(const int32_t *idx, long T, int E, int K) {
    const long n = T * K;
    int32_t   *off = tst_xcalloc((size_t)(E + 1) * 4), *src = tst_xcalloc((size_t)n * 4 + 4),
            *dst = tst_xcalloc((size_t)n * 4 + 4);
    pair *p = tst_xcalloc((size_t)n * sizeof *p + 1);
    char *seen = tst_xcalloc((size_t)n + 1);
    for (int e = 0; e <= E; e++) off[e] = -7;
    tst_ok(ref->moe_group(rctx, off, src, dst, idx, T, E, K), "moe_group");
    for (long a = 0; a < n; a++) p[a] = (pair){idx[a], (int32_t)a};
    qsort(p, (size_t)n, sizeof *p, pair_cmp);
    long bad_src = 0, bad_off = 0, bad_inv = 0, bad_perm = 0, bad_mono = 0;
    for (long j = 0; j < n; j++) {
        bad_src += src[j] != p[j].a;
        bad_inv += src[j] < 0 || src[j] >= n || dst[src[j]] != j;
        if (src[j] >= 0 && src[j] < n) bad_perm += seen[src[j]]++ != 0;
    }
    /* offsets[e] = the assignments of experts below e, counted from the sort */
    long j = 0;
    for (int e = 0; e <= E; e++) {
        while (j < n && p[j].e < e) j++;
        bad_off += off[e] != j;
        if (e) bad_mono += off[e] < off[e - 1];
    }
    printf("moe_group T=%-5ld E=%-4d K=%-3d: %ld src, %ld offsets, %ld inverse, %ld repeats, %ld descents\n", T, E, K,
           bad_src, bad_off, bad_inv, bad_perm, bad_mono);
    TST_CHECK(bad_src == 0 && bad_off == 0 && bad_inv == 0 && bad_perm == 0 && bad_mono == 0);
    TST_CHECK(off[0] == 0 && off[E] == n);
    free(off), free(src), free(dst), free(p), free(seen);
}

/* A random permutation of [0, n) as src (any valid table will do for gather). */
static int32_t *rand_perm(long n) {
    int32_t *s = tst_xcalloc((size_t)n * 4 + 4);
    for (long i = 0; i < n; i++) s[i] = (int32_t)i;
    for (long i = n - 1; i > 0; i--) {
        long    r = (long)cm_rng_below(&rng, (uint64_t)i + 1);
        int32_t x = s[i];
        s[i] = s[r], s[r] = x;
    }
    return s;
}

static void check_gather(long T, int K, long D, cm_dtype dt) {
    const long   n = T * K;
    const size_t es = cm_dtype_size(dt), row = (size_t)D * es;
    uint8_t     *in = tst_xcalloc((size_t)T * row), *out = tst_xcalloc((size_t)n * row);
    for (size_t i = 0; i < (size_t)T * row; i++) in[i] = (uint8_t)cm_rng_u64(&rng);
    int32_t *src = rand_perm(n);
    tst_ok(ref->moe_gather(rctx, out, in, dt, src, T, K, D), "moe_gather");
    long bad = 0;
    for (long j = 0; j < n; j++)
        for (size_t b = 0; b < row; b++) bad += out[(size_t)j * row + b] != in[(size_t)(src[j] / K) * row + b];
    printf("moe_gather T=%-4ld K=%-3d D=%-4ld %s: %ld bytes differ\n", T, K, D, cm_dtype_name(dt), bad);
    TST_CHECK(bad == 0);
    free(in), free(out), free(src);
}

static void check_combine(long T, int K, long D, int with_shared) {
    const long n = T * K;
    float     *y = rand_logits(n * D, 1.0), *w = tst_rand_f32(n, 0.0, 1.0);
    float     *sh = with_shared ? rand_logits(T * D, 1.0) : NULL, *sg = with_shared ? rand_logits(T, 2.0) : NULL;
    float     *out = tst_zeros_f32(T * D), *want = tst_zeros_f32(T * D);
    double    *bound = tst_xcalloc((size_t)(T * D) * sizeof(double));
    int32_t   *dst = rand_perm(n);
    tst_ok(ref->moe_combine(rctx, out, y, dst, w, sh, sg, T, K, D), "moe_combine");
    for (long t = 0; t < T; t++)
        for (long d = 0; d < D; d++) {
            double acc = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double term = (double)w[t * K + k] * y[(long)dst[t * K + k] * D + d];
                acc += term, mag += fabs(term);
            }
            if (sh) {
                const double term = sh[t * D + d] / (1.0 + exp(-(double)sg[t]));
                acc += term, mag += fabs(term);
            }
            want[t * D + d] = (float)acc;
            bound[t * D + d] = mag;
        }
    char name[80];
    snprintf(name, sizeof name, "moe_combine T=%ld K=%d D=%ld%s", T, K, D, sh ? " shared" : "");
    tst_compare_bound(name, 44, out, want, bound, T * D, (K + 4) * U32, NULL);
    free(y), free(w), free(sh), free(sg), free(out), free(want), free(bound), free(dst);
}

static void check_refusals(void) {
    float   l[8] = {0}, w[8], x[8] = {0};
    int32_t idx[8] = {0, 1, 2, 3, 0, 1, 2, 9}, off[5], src[8], dst[8];
    TST_FAILS(ref->moe_route(rctx, idx, w, l, 1, 4, 0, 0), CM_ERR_INVALID_ARG, "K=0");
    TST_FAILS(ref->moe_route(rctx, idx, w, l, 1, 4, 5, 0), CM_ERR_INVALID_ARG, "E=4 K=5");
    TST_FAILS(ref->moe_route(rctx, idx, w, l, 1, KN_MOE_MAX_EXPERTS + 1, 2, 0), CM_ERR_INVALID_ARG, "1025");
    TST_FAILS(ref->moe_group(rctx, off, src, dst, idx, 4, 4, 2), CM_ERR_INVALID_ARG, "idx[7]=9");
    TST_FAILS(ref->moe_group(rctx, off, src, dst, idx, (int64_t)1 << 30, 4, 2), CM_ERR_INVALID_ARG, "I32");
    TST_FAILS(ref->moe_gather(rctx, x, l, CM_DTYPE_F16, idx, 1, 1, 1), CM_ERR_UNSUPPORTED, "F16");
    TST_FAILS(ref->moe_gather(rctx, x, l, CM_DTYPE_F32, idx, 4, 2, 1), CM_ERR_INVALID_ARG, "src[7]=9");
    TST_FAILS(ref->moe_combine(rctx, x, l, idx, w, x, NULL, 1, 2, 1), CM_ERR_INVALID_ARG, "sgate");
    /* nothing to do: T = 0 writes offsets of zeros */
    for (int e = 0; e < 5; e++) off[e] = -1;
    tst_ok(ref->moe_group(rctx, off, NULL, NULL, NULL, 0, 4, 2), "moe_group T=0");
    TST_CHECK(off[0] == 0 && off[4] == 0);
}

static int run_cpu(void) {
    cm_rng_seed(&rng, 0x6d6f65);
    ref = kn_backend_cpu();
    TST_CHECK(ref->moe_route && ref->moe_group && ref->moe_gather && ref->moe_combine);
    tst_ok(ref->ctx_create(&rctx, NULL), "cpu ctx_create");
    check_route_constructed();
    static const struct {
        long T;
        int  E, K;
    } rs[] = {{1, 1, 1}, {5, 3, 1}, {7, 3, 3}, {33, 8, 2}, {64, 64, 8}, {17, 64, 64}, {40, 257, 10}, {9, 1024, 10}};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++)
        for (int renorm = 0; renorm < 2; renorm++) {
            float   *l = rand_logits(rs[i].T * rs[i].E, 2.0);
            int32_t *idx = check_route("random", l, rs[i].T, rs[i].E, rs[i].K, renorm);
            if (renorm) check_group(idx, rs[i].T, rs[i].E, rs[i].K);
            free(l), free(idx);
        }
    /* grouping alone: more experts than assignments (empty experts), and many per expert */
    static const struct {
        long T;
        int  E, K;
    } gs[] = {{0, 4, 2}, {1, 1, 1}, {3, 64, 2}, {100, 5, 4}, {1000, 512, 10}};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++) {
        int32_t *idx = rand_idx(gs[i].T * gs[i].K, gs[i].E);
        check_group(idx, gs[i].T, gs[i].E, gs[i].K);
        free(idx);
    }
    check_gather(1, 1, 1, CM_DTYPE_F32);
    check_gather(7, 2, 33, CM_DTYPE_BF16);
    check_gather(13, 8, 64, CM_DTYPE_F32);
    check_gather(5, 3, 1, CM_DTYPE_BF16);
    for (int s = 0; s < 2; s++) {
        check_combine(1, 1, 1, s);
        check_combine(7, 2, 33, s);
        check_combine(33, 10, 70, s);
    }
    check_refusals();
    ref->ctx_destroy(&rctx);
    return tst_report();
}

// ---- cuda: kn_moe.cu against the reference

#include "tst_kn_pair.h"

static void *down(const dbuf *b, int on_gpu) {
    void *h = tst_xcalloc(b->bytes);
    if ((on_gpu ? gpu->download(gctx, h, b->g, b->bytes) : cpu->download(cctx, h, b->c, b->bytes)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    return h;
}

/* Both backends group the same idx (host); offsets, src and dst must agree bit for bit. */
static void cuda_group(const int32_t *hidx, long T, int E, int K) {
    const long n = T * K;
    dbuf       idx = dbuf_put(hidx, (size_t)n * 4 + 4), off = dbuf_put(NULL, (size_t)(E + 1) * 4);
    dbuf       src = dbuf_put(NULL, (size_t)n * 4 + 4), dst = dbuf_put(NULL, (size_t)n * 4 + 4);
    tst_ok(cpu->moe_group(cctx, off.c, src.c, dst.c, idx.c, T, E, K), "cpu moe_group");
    tst_ok(gpu->moe_group(gctx, off.g, src.g, dst.g, idx.g, T, E, K), "cuda moe_group");
    int32_t *oc = down(&off, 0), *og = down(&off, 1), *sc = down(&src, 0), *sg = down(&src, 1);
    int32_t *dc = down(&dst, 0), *dg = down(&dst, 1);
    const int eq = !memcmp(oc, og, off.bytes) && !memcmp(sc, sg, (size_t)n * 4) && !memcmp(dc, dg, (size_t)n * 4);
    printf("moe_group cuda T=%-6ld E=%-4d K=%-3d: offsets, src, dst %s\n", T, E, K, eq ? "equal" : "DIFFER");
    TST_CHECK(eq);
    free(oc), free(og), free(sc), free(sg), free(dc), free(dg);
    dbuf_free(&idx), dbuf_free(&off), dbuf_free(&src), dbuf_free(&dst);
}

/* Routes on both; idx must agree except where the two experts' p are within 1e-6 of a tie.
 * Returns the cpu's idx. */
static int32_t *cuda_route(long T, int E, int K, int renorm, const float *given) {
    float *hl = given ? NULL : rand_logits(T * E, 2.0);
    dbuf   l = dbuf_put(given ? given : hl, (size_t)(T * E) * 4);
    dbuf   idx = dbuf_put(NULL, (size_t)(T * K) * 4), w = dbuf_put(NULL, (size_t)(T * K) * 4);
    tst_ok(cpu->moe_route(cctx, idx.c, w.c, l.c, T, E, K, renorm), "cpu moe_route");
    tst_ok(gpu->moe_route(gctx, idx.g, w.g, l.g, T, E, K, renorm), "cuda moe_route");
    int32_t     *ic = down(&idx, 0), *ig = down(&idx, 1);
    float       *wc = down(&w, 0), *wg = down(&w, 1);
    const float *hv = given ? given : hl;
    long         near = 0, bad = 0, nan_rows = 0;
    for (long t = 0; t < T; t++) {
        const float *r = hv + t * E;
        float        m = r[0];
        int          has_nan = 0;
        for (int e = 0; e < E; e++) m = r[e] > m ? r[e] : m, has_nan |= isnan(r[e]);
        nan_rows += has_nan;
        for (int k = 0; k < K; k++) {
            const int32_t a = ic[t * K + k], b = ig[t * K + k];
            if (a == b) continue;
            if (b < 0 || b >= E || has_nan) {
                bad++;
                continue;
            }
            const double pa = exp((double)r[a] - m), pb = exp((double)r[b] - m);
            if (fabs(pa - pb) <= 1e-6 * fmax(pa, pb))
                near++;
            else
                bad++;
        }
    }
    /* a NaN row: w NaN on both; the rest within 1e-6 relative */
    for (long i = 0; i < T * K; i++)
        if (isnan(wc[i]) && isnan(wg[i])) wc[i] = wg[i] = 0.0f;
    char name[96];
    snprintf(name, sizeof name, "moe_route cuda T=%ld E=%d K=%d renorm=%d", T, E, K, renorm);
    tst_compare(name, 44, wg, wc, T * K, 1e-30, 1e-6, NULL);
    printf("  idx: %ld differ beyond a tie, %ld near-tie swaps, %ld NaN rows\n", bad, near, nan_rows);
    TST_CHECK(bad == 0);
    free(hl), free(ig), free(wc), free(wg);
    dbuf_free(&l), dbuf_free(&idx), dbuf_free(&w);
    return ic;
}

/* gather (F32 and BF16, random bits) and combine (with and without shared) from the group of idx */
static void cuda_gather_combine(const int32_t *hidx, long T, int E, int K, long D) {
    const long n = T * K;
    int32_t   *hs = tst_xcalloc((size_t)n * 4), *hd = tst_xcalloc((size_t)n * 4);
    int32_t   *ho = tst_xcalloc((size_t)(E + 1) * 4);
    tst_ok(cpu->moe_group(cctx, ho, hs, hd, hidx, T, E, K), "cpu moe_group"); /* host memory on the cpu */
    dbuf src = dbuf_put(hs, (size_t)n * 4), dst = dbuf_put(hd, (size_t)n * 4);
    for (int bf = 0; bf < 2; bf++) {
        const size_t row = (size_t)D * (bf ? 2 : 4);
        uint8_t     *hin = tst_xcalloc((size_t)T * row);
        for (size_t i = 0; i < (size_t)T * row; i++) hin[i] = (uint8_t)cm_rng_u64(&rng);
        dbuf in = dbuf_put(hin, (size_t)T * row), out = dbuf_put(NULL, (size_t)n * row);
        const cm_dtype dt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        tst_ok(cpu->moe_gather(cctx, out.c, in.c, dt, src.c, T, K, D), "cpu moe_gather");
        tst_ok(gpu->moe_gather(gctx, out.g, in.g, dt, src.g, T, K, D), "cuda moe_gather");
        uint8_t *oc = down(&out, 0), *og = down(&out, 1);
        const int eq = memcmp(oc, og, out.bytes) == 0;
        printf("moe_gather cuda T=%-5ld K=%-3d D=%-5ld %-4s: %s\n", T, K, D, cm_dtype_name(dt),
               eq ? "equal" : "DIFFER");
        TST_CHECK(eq);
        free(hin), free(oc), free(og);
        dbuf_free(&in), dbuf_free(&out);
    }
    float *hy = rand_logits(n * D, 1.0), *hw = tst_rand_f32(n, 0.0, 1.0), *hsh = rand_logits(T * D, 1.0);
    float *hg = rand_logits(T, 2.0);
    dbuf    y = dbuf_put(hy, (size_t)(n * D) * 4), w = dbuf_put(hw, (size_t)n * 4);
    dbuf    sh = dbuf_put(hsh, (size_t)(T * D) * 4), sg = dbuf_put(hg, (size_t)T * 4);
    dbuf    out = dbuf_put(NULL, (size_t)(T * D) * 4);
    double *bound = tst_xcalloc((size_t)(T * D) * sizeof(double));
    for (int s = 0; s < 2; s++) {
        tst_ok(cpu->moe_combine(cctx, out.c, y.c, dst.c, w.c, s ? sh.c : NULL, s ? sg.c : NULL, T, K, D),
               "cpu moe_combine");
        tst_ok(gpu->moe_combine(gctx, out.g, y.g, dst.g, w.g, s ? sh.g : NULL, s ? sg.g : NULL, T, K, D),
               "cuda moe_combine");
        float *oc = down(&out, 0), *og = down(&out, 1);
        for (long t = 0; t < T; t++)
            for (long d = 0; d < D; d++) {
                double mag = s ? fabs((double)hsh[t * D + d]) : 0;
                for (int k = 0; k < K; k++) mag += fabs((double)hw[t * K + k] * hy[(long)hd[t * K + k] * D + d]);
                bound[t * D + d] = mag;
            }
        char name[96];
        snprintf(name, sizeof name, "moe_combine cuda T=%ld K=%d D=%ld%s", T, K, D, s ? " shared" : "");
        tst_compare_bound(name, 44, og, oc, bound, T * D, 1e-5, NULL);
        free(oc), free(og);
    }
    free(hs), free(hd), free(ho), free(hy), free(hw), free(hsh), free(hg), free(bound);
    dbuf_free(&src), dbuf_free(&dst), dbuf_free(&y), dbuf_free(&w), dbuf_free(&sh), dbuf_free(&sg), dbuf_free(&out);
}

/* Bad device indices, as kn_cuda_ops.h documents: no out-of-bounds access; group counts an
 * expert outside [0, E) in none (dst −1, offsets[E] short), gather writes a zero row for a src
 * outside [0, T·K), combine skips such a dst. */
static void cuda_bad_indices(void) {
    const int32_t hidx[8] = {1, 7, 0, -1, 1, 3, 2, 1}; /* T = 4, K = 2, E = 4 */
    dbuf idx = dbuf_put(hidx, sizeof hidx), off = dbuf_put(NULL, 5 * 4), src = dbuf_put(NULL, 8 * 4),
         dst = dbuf_put(NULL, 8 * 4);
    tst_ok(gpu->moe_group(gctx, off.g, src.g, dst.g, idx.g, 4, 4, 2), "cuda moe_group");
    int32_t      *o = down(&off, 1), *s = down(&src, 1), *d = down(&dst, 1);
    const int32_t wo[5] = {0, 1, 4, 5, 6}, ws[6] = {2, 0, 4, 7, 6, 5}, wd[8] = {1, -1, 0, -1, 2, 5, 4, 3};
    TST_CHECK(memcmp(o, wo, sizeof wo) == 0 && memcmp(s, ws, sizeof ws) == 0 && memcmp(d, wd, sizeof wd) == 0);
    const int32_t hsrc[3] = {1, 99, -5};
    const float   hin[2] = {3.0f, 4.0f}, hy[3] = {10.0f, 20.0f, 30.0f}, hw[3] = {0.5f, 2.0f, 1.0f};
    const int32_t hdst[3] = {2, 3, 0};
    dbuf bs = dbuf_put(hsrc, sizeof hsrc), bi = dbuf_put(hin, sizeof hin), bo = dbuf_put(NULL, 3 * 4);
    dbuf by = dbuf_put(hy, sizeof hy), bw = dbuf_put(hw, sizeof hw), bd = dbuf_put(hdst, sizeof hdst);
    dbuf bc = dbuf_put(NULL, 4);
    tst_ok(gpu->moe_gather(gctx, bo.g, bi.g, CM_DTYPE_F32, bs.g, 1, 3, 1), "cuda moe_gather");
    tst_ok(gpu->moe_combine(gctx, bc.g, by.g, bd.g, bw.g, NULL, NULL, 1, 3, 1), "cuda moe_combine");
    float *go = down(&bo, 1), *gc = down(&bc, 1);
    printf("bad device indices: offsets %d %d %d %d %d, gather %g %g %g, combine %g\n", o[0], o[1], o[2], o[3], o[4],
           go[0], go[1], go[2], gc[0]);
    TST_CHECK(go[0] == 3.0f && go[1] == 0.0f && go[2] == 0.0f);
    TST_CHECK(gc[0] == 0.5f * 30.0f + 1.0f * 10.0f);
    free(o), free(s), free(d), free(go), free(gc);
    dbuf_free(&idx), dbuf_free(&off), dbuf_free(&src), dbuf_free(&dst), dbuf_free(&bs), dbuf_free(&bi);
    dbuf_free(&bo), dbuf_free(&by), dbuf_free(&bw), dbuf_free(&bd), dbuf_free(&bc);
}

static int run_cuda(void) {
    cm_rng_seed(&rng, 0x6d6f65 + 1);
    if (!tst_pair_open()) return tst_report();
    TST_CHECK(gpu->moe_route && gpu->moe_group && gpu->moe_gather && gpu->moe_combine);
    /* routing and grouping over every (T, E, K) of the odd shapes with K ≤ E */
    static const long Ts[] = {1, 7, 333, 4099};
    static const int  Es[] = {3, 64, 257, 512}, Ks[] = {1, 2, 8, 10};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++)
            for (int c = 0; c < 4; c++) {
                if (Ks[c] > Es[b]) continue;
                int32_t *idx = cuda_route(Ts[a], Es[b], Ks[c], (a + b + c) & 1, NULL);
                cuda_group(idx, Ts[a], Es[b], Ks[c]);
                free(idx);
            }
    free(cuda_route(5, 3, 3, 1, NULL)); /* K = E */
    free(cuda_route(3, 64, 64, 0, NULL));
    {
        /* the constructed ties, −inf and NaN rows of the cpu test, on the gpu */
        const float ninf = -INFINITY;
        const float rows[32] = {1, 3, 2, 3, 3, 0, 2, 1, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,
                                ninf, 0, ninf, 1, ninf, ninf, 2, ninf, 1, 3, 2, 3, 3, NAN, 2, 1};
        for (int renorm = 0; renorm < 2; renorm++) free(cuda_route(4, 8, 5, renorm, rows));
    }
    /* the largest router (E = 1024, T·K = 81920 in 80 chunks) and a grouping past 1024 chunks */
    {
        int32_t *idx = cuda_route(8192, 1024, 10, 1, NULL);
        cuda_group(idx, 8192, 1024, 10);
        free(idx);
        idx = rand_idx(131072L * 10, 64);
        cuda_group(idx, 131072, 64, 10);
        free(idx);
    }
    /* gather and combine: every D with small T, the large T with narrow rows */
    static const struct {
        long T;
        int  E, K;
        long D;
    } gc[] = {{1, 3, 1, 1},      {1, 64, 8, 2048}, {7, 3, 2, 33},   {7, 257, 10, 2048},
              {333, 64, 2, 33},  {333, 512, 8, 2048}, {4099, 257, 10, 33}, {4099, 3, 1, 1}};
    for (size_t i = 0; i < sizeof gc / sizeof gc[0]; i++) {
        int32_t *idx = rand_idx(gc[i].T * gc[i].K, gc[i].E);
        cuda_gather_combine(idx, gc[i].T, gc[i].E, gc[i].K, gc[i].D);
        free(idx);
    }
    cuda_bad_indices();
    tst_pair_close();
    return tst_report();
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "cpu") == 0) return run_cpu();
    if (argc == 2 && strcmp(argv[1], "cuda") == 0) return run_cuda();
    fprintf(stderr, "usage: test_kn_moe cpu|cuda\n");
    return 2;
}
