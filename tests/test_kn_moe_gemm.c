/* tests/test_kn_moe_gemm.c — moe_gemm (kn_backend.h), the routed experts' GEMMs in one call, against
 * its definition computed here in double: for each expert e and row j of [offsets[e], offsets[e+1])
 * out[j, n] = Σ_k inp[j, k]·W[e][n, k] over bf16 values, for one weight set and for two (gate and up).
 *   test_kn_moe_gemm cpu    the reference (ref/kn_moe_ref.c): each output within 2^-23·Σ|a·b| (a double
 *                           sum rounded once to fp32); empty experts, all rows in one expert, rows
 *                           past offsets[E] left as they were; the refusals (K not a multiple of 8,
 *                           offsets not ascending or past R, out1 without w1).
 *   test_kn_moe_gemm cuda   kn_moe_gemm.cu on odd shapes (R 1 … 8192, E 1 … 256, N 1 … 2048 with odd
 *                           N, K 8 … 2048 with K not a multiple of the 32-wide step; the cpu's
 *                           cases plus the Qwen3.5-35B-A3B expert shapes), within (K + 8)·2^-24·Σ|a·b|
 *                           (any fp32 summation order meets it; a wrong row, expert or column does
 *                           not); the two-set call equal bit for bit to two one-set calls; rows
 *                           past offsets[E] untouched; each case under TANDEM_MOE_GEMM_TILE 128w4
 *                           and, on compute capability 9.0, the wgmma tilings wg and wg4 (the default
 *                           there); 128w8 and 64w4 bit-identical to 128w4. Label gpu, exits 77 without
 *                           a cuda device.
 * Both: moe_gemm_swiglu equal bit for bit to moe_gemm of gate and up then swiglu_bf16 on the same
 * backend, and nothing written past offsets[E]; rows read through src (a random permutation, topk
 * rows per input row: the gather fused into the loads) as well as directly. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"

#define U24      (1.0 / 16777216.0) /* 2^-24 */
#define SENTINEL 12345.0f           /* what rows past offsets[E] hold before and after */

/* One problem on the host: inputs, E weight matrices per set, the offsets, the exact results. */
typedef struct prob {
    long      R, N, K;
    int       E, sets, topk; /* topk > 0: rows read through src (the gather fused into the loads) */
    uint16_t *inp;    /* [R, K], or [ceil(R / topk), K] with src */
    int32_t  *src;    /* [R] a permutation of [0, R), or NULL */
    uint16_t *w[2];   /* [E, N, K] each */
    int32_t  *off;    /* [E + 1] */
    double   *ref[2]; /* [R, N] */
    double   *abs[2]; /* [R, N]: Σ|a·b| */
} prob;

static uint16_t *rand_bf16(long n) {
    uint16_t *x = tst_xcalloc((size_t)n * 2);
    for (long i = 0; i < n; i++) x[i] = tst_bf16_round((float)(2.0 * tst_urand() - 1.0));
    return x;
}

/* Rows [0, used) split over the experts at random, some experts empty (every third is empty when
 * skew is 1; with skew 2 the first expert takes them all). */
static prob make(long R, int E, long N, long K, int sets, long used, int skew, int topk) {
    const long rows = topk > 0 ? (R + topk - 1) / topk : R;
    prob       p    = {R,   N, K, E, sets, topk, rand_bf16(rows * K), NULL, {NULL, NULL}, tst_xcalloc((size_t)(E + 1) * 4),
                       {0}, {0}};
    if (topk > 0) { /* src: a random permutation of [0, R) */
        p.src = tst_xcalloc((size_t)R * 4);
        for (long j = 0; j < R; j++) p.src[j] = (int32_t)j;
        for (long j = R - 1; j > 0; j--) {
            const long    i = (long)(tst_urand() * (double)(j + 1));
            const int32_t v = p.src[i];
            p.src[i]        = p.src[j];
            p.src[j]        = v;
        }
    }
    for (int s = 0; s < sets; s++) p.w[s] = rand_bf16((long)E * N * K);
    long *cnt = tst_xcalloc((size_t)E * sizeof(long));
    for (long j = 0; j < used; j++) {
        int e = (int)(tst_urand() * E);
        if (skew == 1 && E > 2 && e % 3 == 2) e = 0;
        if (skew == 2) e = 0;
        cnt[e]++;
    }
    for (int e = 0; e < E; e++) p.off[e + 1] = p.off[e] + (int32_t)cnt[e];
    free(cnt);
    for (int s = 0; s < sets; s++) {
        p.ref[s] = tst_xcalloc((size_t)(R * N) * sizeof(double));
        p.abs[s] = tst_xcalloc((size_t)(R * N) * sizeof(double));
        for (int e = 0; e < E; e++)
            for (long j = p.off[e]; j < p.off[e + 1]; j++)
                for (long n = 0; n < N; n++) {
                    const uint16_t *a = p.inp + (p.src ? p.src[j] / topk : j) * K, *b = p.w[s] + ((long)e * N + n) * K;
                    double          acc = 0, ab = 0;
                    for (long k = 0; k < K; k++) {
                        const double t = (double)tst_bf16_widen(a[k]) * (double)tst_bf16_widen(b[k]);
                        acc += t;
                        ab += fabs(t);
                    }
                    p.ref[s][j * N + n] = acc;
                    p.abs[s][j * N + n] = ab;
                }
    }
    return p;
}

static void drop(prob *p) {
    free(p->inp);
    free(p->src);
    free(p->off);
    for (int s = 0; s < 2; s++) {
        free(p->w[s]);
        free(p->ref[s]);
        free(p->abs[s]);
    }
}

/* got [R, N] against the definition within tol·Σ|a·b| on the grouped rows; the SENTINEL past them. */
static void check(const char *name, const prob *p, int s, const float *got, double tol) {
    const long used = p->off[p->E], n = used * p->N;
    float     *ref  = tst_zeros_f32(n);
    for (long i = 0; i < n; i++) ref[i] = (float)p->ref[s][i];
    tst_compare_bound(name, 52, got, ref, p->abs[s], n, tol, NULL);
    long bad = 0;
    for (long i = n; i < p->R * p->N; i++) bad += got[i] != SENTINEL;
    TST_CHECK(bad == 0);
    if (bad) fprintf(stderr, "%s: %ld values past offsets[E]=%ld were written\n", name, bad, used);
    free(ref);
}

/* The backend's moe_gemm on p: weights as E matrices of its memory, outputs prefilled with the
 * SENTINEL; out[s] gets set s's result (host). one_by_one: each set in its own call. act (two
 * sets only, may be NULL): moe_gemm_swiglu's bf16 output as well, [R, N], rows past offsets[E]
 * prefilled with 0xffff. */
static void run(const kn_backend *be, kn_ctx *cx, const prob *p, int one_by_one, float *out[2], uint16_t **act) {
    const long  R = p->R, N = p->N, K = p->K;
    const int   E = p->E;
    const long  rows = p->src ? (R + p->topk - 1) / p->topk : R;
    void       *inp, *off, *src = NULL, *o[2] = {NULL, NULL}, *tab[2] = {NULL, NULL};
    void      **mats = tst_xcalloc((size_t)(2 * E) * 8);
    float      *fill = tst_zeros_f32(R * N);
    for (long i = 0; i < R * N; i++) fill[i] = SENTINEL;
    tst_ok(be->alloc(cx, &inp, (size_t)(rows * K) * 2), "alloc inp");
    tst_ok(be->upload(cx, inp, p->inp, (size_t)(rows * K) * 2), "upload inp");
    if (p->src) {
        tst_ok(be->alloc(cx, &src, (size_t)R * 4), "alloc src");
        tst_ok(be->upload(cx, src, p->src, (size_t)R * 4), "upload src");
    }
    tst_ok(be->alloc(cx, &off, (size_t)(E + 1) * 4), "alloc offsets");
    tst_ok(be->upload(cx, off, p->off, (size_t)(E + 1) * 4), "upload offsets");
    for (int s = 0; s < p->sets; s++) {
        for (int e = 0; e < E; e++) {
            const size_t b = (size_t)(N * K) * 2;
            tst_ok(be->alloc(cx, &mats[s * E + e], b), "alloc weights");
            tst_ok(be->upload(cx, mats[s * E + e], p->w[s] + (size_t)e * N * K, b), "upload weights");
        }
        tst_ok(be->alloc(cx, &tab[s], (size_t)E * sizeof(void *)), "alloc table");
        tst_ok(be->upload(cx, tab[s], mats + s * E, (size_t)E * sizeof(void *)), "upload table");
        tst_ok(be->alloc(cx, &o[s], (size_t)(R * N) * 4), "alloc out");
        tst_ok(be->upload(cx, o[s], fill, (size_t)(R * N) * 4), "upload out");
    }
    if (p->sets == 2 && !one_by_one) {
        tst_ok(be->moe_gemm(cx, o[0], o[1], inp, src, p->topk, tab[0], tab[1], off, R, E, N, K), "moe_gemm (two sets)");
    } else {
        for (int s = 0; s < p->sets; s++)
            tst_ok(be->moe_gemm(cx, o[s], NULL, inp, src, p->topk, tab[s], NULL, off, R, E, N, K), "moe_gemm");
    }
    if (act) {
        void *a;
        *act = tst_xcalloc((size_t)(R * N) * 2);
        memset(*act, 0xff, (size_t)(R * N) * 2);
        tst_ok(be->alloc(cx, &a, (size_t)(R * N) * 2), "alloc act");
        tst_ok(be->upload(cx, a, *act, (size_t)(R * N) * 2), "upload act");
        tst_ok(be->moe_gemm_swiglu(cx, a, inp, src, p->topk, tab[0], tab[1], off, R, E, N, K), "moe_gemm_swiglu");
        tst_ok(be->download(cx, *act, a, (size_t)(R * N) * 2), "download act");
        be->free(cx, a);
    }
    for (int s = 0; s < p->sets; s++) {
        out[s] = tst_zeros_f32(R * N);
        tst_ok(be->download(cx, out[s], o[s], (size_t)(R * N) * 4), "download out");
        be->free(cx, o[s]);
        be->free(cx, tab[s]);
        for (int e = 0; e < E; e++) be->free(cx, mats[s * E + e]);
    }
    be->free(cx, inp);
    be->free(cx, src);
    be->free(cx, off);
    free(mats);
    free(fill);
}

/* act against swiglu_bf16 of the same backend on its own moe_gemm results g, u: equal bit for bit
 * on the grouped rows (the entry's definition), 0xffff left past them. */
static void check_act(const char *name, const kn_backend *be, kn_ctx *cx, const prob *p, const float *g,
                      const float *u, const uint16_t *act) {
    const long used = p->off[p->E], n = used * p->N, all = p->R * p->N;
    void      *dg, *du, *da;
    uint16_t  *want = tst_xcalloc((size_t)(n + 1) * 2);
    tst_ok(be->alloc(cx, &dg, (size_t)(n + 1) * 4), "alloc");
    tst_ok(be->alloc(cx, &du, (size_t)(n + 1) * 4), "alloc");
    tst_ok(be->alloc(cx, &da, (size_t)(n + 1) * 2), "alloc");
    tst_ok(be->upload(cx, dg, g, (size_t)n * 4), "upload");
    tst_ok(be->upload(cx, du, u, (size_t)n * 4), "upload");
    tst_ok(be->swiglu_bf16(cx, da, dg, du, n), "swiglu_bf16");
    tst_ok(be->download(cx, want, da, (size_t)n * 2), "download");
    long diff = 0, past = 0;
    for (long i = 0; i < n; i++) diff += act[i] != want[i];
    for (long i = n; i < all; i++) past += act[i] != 0xffff;
    printf("%-52s swiglu: %ld of %ld differ from moe_gemm + swiglu_bf16, %ld written past offsets[E]\n", name, diff,
           n, past);
    TST_CHECK(diff == 0 && past == 0);
    be->free(cx, dg);
    be->free(cx, du);
    be->free(cx, da);
    free(want);
}

/* The other tilings (TANDEM_MOE_GEMM_TILE) against the default's results: the same sums in the same order. */
static void check_tilings(const char *name, const kn_backend *be, kn_ctx *cx, const prob *p, float *const got[2],
                          const uint16_t *act) {
    static const char *const tilings[] = {"128w8", "64w4"};
    for (int i = 0; i < 2; i++) {
        float    *one[2] = {NULL, NULL};
        uint16_t *act_t  = NULL;
        setenv("TANDEM_MOE_GEMM_TILE", tilings[i], 1);
        run(be, cx, p, 0, one, act ? &act_t : NULL);
        unsetenv("TANDEM_MOE_GEMM_TILE");
        int same = 1;
        for (int s = 0; s < p->sets; s++) {
            same = same && memcmp(got[s], one[s], (size_t)(p->R * p->N) * 4) == 0;
            free(one[s]);
        }
        if (act) same = same && memcmp(act, act_t, (size_t)(p->R * p->N) * 2) == 0;
        free(act_t);
        printf("%-52s tiling %-5s against 128w4: %s\n", name, tilings[i], same ? "bit-identical" : "DIFFER");
        TST_CHECK(same);
    }
}

/* The tilings each case runs under on cuda (TANDEM_MOE_GEMM_TILE): 128w4 (mma.sync), then the wgmma
 * ones where the GPU and the build have them (wgmma_tilings() finds out). */
static const char *const base_tilings[] = {"128w4", "wg", "wg4"};
static int               n_base_tilings = 1;

static void case_on(const kn_backend *be, kn_ctx *cx, long R, int E, long N, long K, int sets, long used,
                    int skew, int topk, double tol) {
    prob      p    = make(R, E, N, K, sets, used, skew, topk);
    const int cuda = strcmp(be->name, "cuda") == 0;
    for (int t = 0; t < (cuda ? n_base_tilings : 1); t++) {
        float    *got[2] = {NULL, NULL}, *one[2] = {NULL, NULL};
        uint16_t *act = NULL;
        if (cuda) setenv("TANDEM_MOE_GEMM_TILE", base_tilings[t], 1);
        run(be, cx, &p, 0, got, sets == 2 ? &act : NULL);
        char name[128];
        for (int s = 0; s < sets; s++) {
            snprintf(name, sizeof name, "%s%s%s R=%ld used=%ld E=%d N=%ld K=%ld%s set %d/%d", be->name,
                     cuda ? " " : "", cuda ? base_tilings[t] : "", R, used, E, N, K, topk ? " src" : "", s + 1, sets);
            check(name, &p, s, got[s], tol);
        }
        if (sets == 2) { /* two sets in one call = each set alone, bit for bit; swiglu = the two calls */
            check_act(name, be, cx, &p, got[0], got[1], act);
            run(be, cx, &p, 1, one, NULL);
            for (int s = 0; s < 2; s++) {
                TST_CHECK(memcmp(got[s], one[s], (size_t)(R * N) * 4) == 0);
                free(one[s]);
            }
        }
        unsetenv("TANDEM_MOE_GEMM_TILE");
        if (cuda && t == 0) check_tilings(name, be, cx, &p, got, act);
        free(act);
        for (int s = 0; s < sets; s++) free(got[s]);
    }
    drop(&p);
}

/* Whether TANDEM_MOE_GEMM_TILE=wg runs here: a GPU of compute capability 9.0 and a build for
 * architecture 90; elsewhere the call refuses with a message naming both. */
static int wgmma_tilings(const kn_backend *be, kn_ctx *cx) {
    void           *x, *w, *o, *off, *tab;
    const int32_t   offs[2] = {0, 1};
    const void     *wp;
    tst_ok(be->alloc(cx, &x, 16), "alloc");
    tst_ok(be->alloc(cx, &w, 16), "alloc");
    tst_ok(be->alloc(cx, &o, 4), "alloc");
    tst_ok(be->alloc(cx, &off, 8), "alloc");
    tst_ok(be->alloc(cx, &tab, 8), "alloc");
    wp = w;
    tst_ok(be->upload(cx, off, offs, 8), "upload");
    tst_ok(be->upload(cx, tab, &wp, 8), "upload");
    setenv("TANDEM_MOE_GEMM_TILE", "wg", 1);
    const cm_status st = be->moe_gemm(cx, o, NULL, x, NULL, 0, (const uint16_t *const *)tab, NULL, off, 1, 1, 1, 8);
    unsetenv("TANDEM_MOE_GEMM_TILE");
    if (st != CM_OK) {
        TST_CHECK(strstr(cm_last_error(), "compute capability 9.0") != NULL);
        printf("wgmma tilings: not here (%s)\n", cm_last_error());
    } else {
        printf("wgmma tilings: wg and wg4 run here, each case under them too\n");
    }
    be->free(cx, x);
    be->free(cx, w);
    be->free(cx, o);
    be->free(cx, off);
    be->free(cx, tab);
    return st == CM_OK ? 3 : 1;
}

/* The refusals; offsets and src are read only by the cpu (on cuda they are device memory, not checked). */
static void refusals(const kn_backend *be, kn_ctx *cx, int host_tables) {
    static uint16_t x[64] __attribute__((aligned(16))), w[64];
    const uint16_t *tab[2] = {w, w};
    float           out[64];
    int32_t bad_order[3] = {0, 5, 3}, past[3] = {0, 2, 9}, ok[3] = {0, 2, 4}, src[4] = {0, 1, 2, 3}, far[4] = {0, 1, 2, 4};
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, NULL, 0, tab, NULL, ok, 4, 2, 1, 12), CM_ERR_INVALID_ARG, "K=12",
              "multiple of 8");
    TST_FAILS(be->moe_gemm(cx, out, out, x, NULL, 0, tab, NULL, ok, 4, 2, 1, 8), CM_ERR_INVALID_ARG, "out1 and w1");
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, NULL, 0, tab, NULL, ok, 4, 0, 1, 8), CM_ERR_INVALID_ARG, "E=0");
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, src, 0, tab, NULL, ok, 4, 2, 1, 8), CM_ERR_INVALID_ARG, "topk=0");
    TST_FAILS(be->moe_gemm_swiglu(cx, (uint16_t *)out, x, NULL, 0, tab, NULL, ok, 4, 2, 1, 8), CM_ERR_INVALID_ARG,
              "w1");
    if (!host_tables) return;
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, NULL, 0, tab, NULL, bad_order, 5, 2, 1, 8), CM_ERR_INVALID_ARG,
              "not ascending");
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, NULL, 0, tab, NULL, past, 4, 2, 1, 8), CM_ERR_INVALID_ARG,
              "outside [0, R=4]");
    TST_FAILS(be->moe_gemm(cx, out, NULL, x, far, 2, tab, NULL, ok, 4, 2, 1, 8), CM_ERR_INVALID_ARG, "src[3]=4");
}

static int run_cpu(void) {
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *cx = NULL;
    if (!tst_ok(be->ctx_create(&cx, NULL), "cpu ctx_create")) return tst_report();
    const double tol = 2 * U24;
    case_on(be, cx, 1, 1, 1, 8, 1, 1, 0, 0, tol);
    case_on(be, cx, 9, 3, 5, 24, 2, 9, 1, 0, tol);
    case_on(be, cx, 40, 7, 37, 40, 2, 33, 1, 0, tol); /* 7 rows past offsets[E] */
    case_on(be, cx, 64, 5, 16, 64, 1, 64, 2, 0, tol); /* every row in expert 0 */
    case_on(be, cx, 10, 4, 3, 8, 1, 0, 0, 0, tol);    /* no rows at all */
    case_on(be, cx, 40, 7, 37, 40, 2, 40, 1, 3, tol); /* rows read through src, 3 per token */
    case_on(be, cx, 64, 5, 16, 64, 1, 60, 0, 8, tol);
    refusals(be, cx, 1);
    be->ctx_destroy(&cx);
    return tst_report();
}

static int run_cuda(void) {
    tst_need_cuda();
    const kn_backend *be = kn_backend_cuda();
    kn_ctx           *cx = NULL;
    kn_ctx_config     kc = KN_CTX_CONFIG_DEFAULT;
    if (!tst_ok(be->ctx_create(&cx, &kc), "cuda ctx_create")) return tst_report();
    n_base_tilings = wgmma_tilings(be, cx);
    static const struct {
        long R;
        int  E;
        long N, K;
        int  sets;
        long used;
        int  skew, topk;
    } cs[] = {
        {1, 1, 1, 8, 1, 1, 0, 0},           {9, 3, 5, 24, 2, 9, 1, 0},         {40, 7, 37, 40, 2, 33, 1, 3},
        {64, 5, 16, 64, 1, 64, 2, 0},       {10, 4, 3, 8, 1, 0, 0, 0},         {300, 7, 130, 136, 2, 300, 1, 3},
        {1000, 64, 257, 520, 1, 999, 1, 0}, {4099, 3, 129, 8, 2, 4000, 0, 1},  {200, 256, 200, 2048, 2, 200, 0, 8},
        {1024, 256, 512, 2048, 2, 1024, 0, 8}, /* Qwen3.5-35B-A3B: gate and up (Ie 512, D 2048), 8 per token */
        {1024, 256, 2048, 512, 1, 1024, 0, 0}, /* and its down projection */
        {8192, 8, 64, 256, 2, 8192, 2, 0},     /* one expert with every row: 64 row tiles in a row */
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        case_on(be, cx, cs[i].R, cs[i].E, cs[i].N, cs[i].K, cs[i].sets, cs[i].used, cs[i].skew, cs[i].topk,
                (double)(cs[i].K + 8) * U24);
    refusals(be, cx, 0);
    be->ctx_destroy(&cx);
    return tst_report();
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "cpu") == 0) return run_cpu();
    if (argc == 2 && strcmp(argv[1], "cuda") == 0) return run_cuda();
    fprintf(stderr, "usage: test_kn_moe_gemm cpu|cuda\n");
    return 2;
}
