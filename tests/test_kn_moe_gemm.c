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
 * moe_gemm_fp8 (FP8 experts): on the cpu each expert's rows equal bit for bit gemm_fp8 on its gathered
 * bf16 rows (the forward's per-expert path); on cuda (compute capability 9.0, wgmma) within 2e-3·Σ|terms|
 * of the cpu on odd shapes and the 35B-A3B ones, the two-set call equal to two one-set calls.
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

// ----------------------------------------------------------------------------
// moe_gemm_fp8

/* A problem's FP8 operands on the host, made by the cpu backend: the input quantized per row
 * (fp8_quantize_rows), each expert's weight in 128 × 128 blocks (fp8_quantize_weight). */
typedef struct prob8 {
    long     rows, Mq, L, nb, ld;
    uint8_t *q;               /* [Mq, K] */
    float   *s;               /* [L, Mq] */
    uint8_t *wq[2];           /* [E][N, K] */
    float   *ws[2];           /* [E][nb, ld] */
} prob8;

static prob8 quantize8(const kn_backend *cpu, kn_ctx *cc, const prob *p) {
    prob8 q = {0};
    q.rows  = p->src ? (p->R + p->topk - 1) / p->topk : p->R;
    q.Mq = kn_fp8_rows(q.rows), q.L = (p->K + 127) / 128, q.nb = (p->N + 127) / 128, q.ld = kn_fp8_scale_ld(p->K);
    q.q = tst_xcalloc((size_t)(q.Mq * p->K) + 1);
    q.s = tst_xcalloc((size_t)(q.Mq * q.L + 1) * 4);
    tst_ok(cpu->fp8_quantize_rows(cc, q.q, q.s, p->inp, CM_DTYPE_BF16, q.rows, p->K), "fp8_quantize_rows");
    for (int s = 0; s < p->sets; s++) {
        q.wq[s] = tst_xcalloc((size_t)(p->E * p->N * p->K) + 1);
        q.ws[s] = tst_xcalloc((size_t)(p->E * q.nb * q.ld + 1) * 4);
        for (int e = 0; e < p->E; e++)
            tst_ok(cpu->fp8_quantize_weight(cc, q.wq[s] + (long)e * p->N * p->K, q.ws[s] + (long)e * q.nb * q.ld,
                                            p->w[s] + (long)e * p->N * p->K, CM_DTYPE_BF16, p->N, p->K),
                   "fp8_quantize_weight");
    }
    return q;
}

static void drop8(prob8 *q) {
    free(q->q), free(q->s);
    for (int s = 0; s < 2; s++) free(q->wq[s]), free(q->ws[s]);
}

/* moe_gemm_fp8 on be: out[s] [R, N] (host), prefilled with the SENTINEL; one_by_one: each set in its own call. */
static void run8(const kn_backend *be, kn_ctx *cx, const prob *p, const prob8 *q, int one_by_one, float *out[2]) {
    const long R = p->R, N = p->N, K = p->K;
    const int  E = p->E;
    void      *dq, *ds, *off, *src = NULL, *o[2] = {NULL, NULL}, *tw[2] = {NULL, NULL}, *ts[2] = {NULL, NULL};
    void      *mw[2] = {NULL, NULL}, *msc[2] = {NULL, NULL};
    float     *fill = tst_zeros_f32(R * N);
    for (long i = 0; i < R * N; i++) fill[i] = SENTINEL;
    tst_ok(be->alloc(cx, &dq, (size_t)(q->Mq * K) + 16), "alloc q");
    tst_ok(be->upload(cx, dq, q->q, (size_t)(q->Mq * K)), "upload q");
    tst_ok(be->alloc(cx, &ds, (size_t)(q->Mq * q->L) * 4 + 4), "alloc s");
    tst_ok(be->upload(cx, ds, q->s, (size_t)(q->Mq * q->L) * 4), "upload s");
    if (p->src) {
        tst_ok(be->alloc(cx, &src, (size_t)R * 4), "alloc src");
        tst_ok(be->upload(cx, src, p->src, (size_t)R * 4), "upload src");
    }
    tst_ok(be->alloc(cx, &off, (size_t)(E + 1) * 4), "alloc offsets");
    tst_ok(be->upload(cx, off, p->off, (size_t)(E + 1) * 4), "upload offsets");
    for (int s = 0; s < p->sets; s++) {
        const size_t wb = (size_t)(N * K), sb = (size_t)(q->nb * q->ld) * 4;
        void       **hw = tst_xcalloc((size_t)E * 8), **hs = tst_xcalloc((size_t)E * 8);
        tst_ok(be->alloc(cx, &mw[s], wb * (size_t)E), "alloc weights");
        tst_ok(be->upload(cx, mw[s], q->wq[s], wb * (size_t)E), "upload weights");
        tst_ok(be->alloc(cx, &msc[s], sb * (size_t)E), "alloc scales");
        tst_ok(be->upload(cx, msc[s], q->ws[s], sb * (size_t)E), "upload scales");
        for (int e = 0; e < E; e++) hw[e] = (char *)mw[s] + e * wb, hs[e] = (char *)msc[s] + e * sb;
        tst_ok(be->alloc(cx, &tw[s], (size_t)E * 8), "alloc table");
        tst_ok(be->upload(cx, tw[s], hw, (size_t)E * 8), "upload table");
        tst_ok(be->alloc(cx, &ts[s], (size_t)E * 8), "alloc table");
        tst_ok(be->upload(cx, ts[s], hs, (size_t)E * 8), "upload table");
        free(hw), free(hs);
        tst_ok(be->alloc(cx, &o[s], (size_t)(R * N) * 4), "alloc out");
        tst_ok(be->upload(cx, o[s], fill, (size_t)(R * N) * 4), "upload out");
    }
    typedef const uint8_t *const *wtab;
    typedef const float *const   *stab;
    if (p->sets == 2 && !one_by_one) {
        tst_ok(be->moe_gemm_fp8(cx, o[0], o[1], dq, ds, q->Mq, src, p->topk, (wtab)tw[0], (stab)ts[0], (wtab)tw[1],
                                (stab)ts[1], off, R, E, N, K),
               "moe_gemm_fp8 (two sets)");
    } else {
        for (int s = 0; s < p->sets; s++)
            tst_ok(be->moe_gemm_fp8(cx, o[s], NULL, dq, ds, q->Mq, src, p->topk, (wtab)tw[s], (stab)ts[s], NULL, NULL,
                                    off, R, E, N, K),
                   "moe_gemm_fp8");
    }
    for (int s = 0; s < p->sets; s++) {
        out[s] = tst_zeros_f32(R * N);
        tst_ok(be->download(cx, out[s], o[s], (size_t)(R * N) * 4), "download out");
        be->free(cx, o[s]), be->free(cx, tw[s]), be->free(cx, ts[s]), be->free(cx, mw[s]), be->free(cx, msc[s]);
    }
    be->free(cx, dq), be->free(cx, ds), be->free(cx, off), be->free(cx, src);
    free(fill);
}

/* Rows past offsets[E] left as they were. */
static void untouched8(const char *name, const prob *p, const float *got) {
    long bad = 0;
    for (long i = (long)p->off[p->E] * p->N; i < p->R * p->N; i++) bad += got[i] != SENTINEL;
    TST_CHECK(bad == 0);
    if (bad) fprintf(stderr, "%s: %ld values past offsets[E]=%d were written\n", name, bad, p->off[p->E]);
}

/* cpu: each expert's rows equal, bit for bit, the per-expert product the forward's other path runs:
 * gemm_fp8 (which quantizes its own input) on the gathered bf16 rows with that expert's weight. */
static void fp8_case_cpu(const kn_backend *be, kn_ctx *cx, long R, int E, long N, long K, int sets, long used,
                         int skew, int topk) {
    prob   p = make(R, E, N, K, sets, used, skew, topk);
    prob8  q = quantize8(be, cx, &p);
    float *got[2] = {NULL, NULL};
    run8(be, cx, &p, &q, 0, got);
    long diff = 0;
    for (int s = 0; s < sets; s++)
        for (int e = 0; e < E; e++) {
            const long r0 = p.off[e], n = p.off[e + 1] - r0;
            if (n == 0) continue;
            uint16_t *x = tst_xcalloc((size_t)(n * K) * 2);
            float    *y = tst_zeros_f32(n * N);
            for (long i = 0; i < n; i++)
                memcpy(x + i * K, p.inp + (p.src ? p.src[r0 + i] / topk : r0 + i) * K, (size_t)K * 2);
            tst_ok(be->gemm_fp8(cx, y, x, CM_DTYPE_BF16, q.wq[s] + (long)e * N * K, q.ws[s] + (long)e * q.nb * q.ld, n,
                                N, K),
                   "gemm_fp8");
            diff += memcmp(y, got[s] + r0 * N, (size_t)(n * N) * 4) != 0;
            free(x), free(y);
        }
    char name[128];
    snprintf(name, sizeof name, "cpu fp8 R=%ld used=%ld E=%d N=%ld K=%ld%s sets %d", R, used, E, N, K,
             topk ? " src" : "", sets);
    printf("%-56s %ld experts differ from gemm_fp8 on their gathered rows\n", name, diff);
    TST_CHECK(diff == 0);
    for (int s = 0; s < sets; s++) untouched8(name, &p, got[s]), free(got[s]);
    drop8(&q);
    drop(&p);
}

/* cuda against the cpu's moe_gemm_fp8 within 2e-3·Σ|terms| (test_kn_fp8's bound for the block-scaled
 * product: the tensor core adds a group's products with fewer bits, then fp32); the two-set call
 * bit-identical to two one-set calls; rows past offsets[E] untouched. */
static void fp8_case_cuda(const kn_backend *be, kn_ctx *cx, const kn_backend *cpu, kn_ctx *cc, long R, int E, long N,
                          long K, int sets, long used, int skew, int topk) {
    prob   p = make(R, E, N, K, sets, used, skew, topk);
    prob8  q = quantize8(cpu, cc, &p);
    float *got[2] = {NULL, NULL}, *want[2] = {NULL, NULL}, *one[2] = {NULL, NULL};
    run8(be, cx, &p, &q, 0, got);
    run8(cpu, cc, &p, &q, 0, want);
    char name[128];
    for (int s = 0; s < sets; s++) {
        snprintf(name, sizeof name, "cuda fp8 R=%ld used=%ld E=%d N=%ld K=%ld%s set %d/%d", R, used, E, N, K,
                 topk ? " src" : "", s + 1, sets);
        const long n = (long)p.off[E] * N;
        double    *bound = tst_xcalloc((size_t)(n + 1) * sizeof(double));
        for (int e = 0; e < E; e++)
            for (long j = p.off[e]; j < p.off[e + 1]; j++) {
                const long     r = p.src ? p.src[j] / topk : j;
                const uint8_t *a = q.q + r * K;
                for (long c = 0; c < N; c++) {
                    const uint8_t *w  = q.wq[s] + ((long)e * N + c) * K;
                    const float   *ws = q.ws[s] + (long)e * q.nb * q.ld + (c / 128) * q.ld;
                    double         mag = 0;
                    for (long k = 0; k < K; k++)
                        mag += fabs((double)cm_f8e4m3_to_f32(a[k]) * q.s[(k / 128) * q.Mq + r] *
                                    cm_f8e4m3_to_f32(w[k]) * ws[k / 128]);
                    bound[j * N + c] = mag;
                }
            }
        tst_compare_bound(name, 56, got[s], want[s], bound, n, 2e-3, NULL);
        untouched8(name, &p, got[s]);
        free(bound);
    }
    if (sets == 2) {
        run8(be, cx, &p, &q, 1, one);
        for (int s = 0; s < 2; s++) {
            TST_CHECK(memcmp(got[s], one[s], (size_t)(R * N) * 4) == 0);
            free(one[s]);
        }
    }
    for (int s = 0; s < sets; s++) free(got[s]), free(want[s]);
    drop8(&q);
    drop(&p);
}

static void refusals8(const kn_backend *be, kn_ctx *cx) {
    static uint8_t  x[64] __attribute__((aligned(16))), w[64];
    static float    sx[64], sw[64];
    const uint8_t  *tw[2] = {w, w};
    const float    *tsc[2] = {sw, sw};
    float           out[64];
    int32_t         ok[3] = {0, 2, 4};
    TST_FAILS(be->moe_gemm_fp8(cx, out, out, x, sx, 16, NULL, 0, tw, tsc, NULL, NULL, ok, 4, 2, 1, 16),
              CM_ERR_INVALID_ARG, "out1, w1 and s1");
    TST_FAILS(be->moe_gemm_fp8(cx, out, NULL, x, sx, 16, NULL, 0, tw, tsc, NULL, NULL, ok, 4, 0, 1, 16),
              CM_ERR_INVALID_ARG, "E=0");
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
    fp8_case_cpu(be, cx, 9, 3, 5, 24, 2, 9, 1, 0);
    fp8_case_cpu(be, cx, 40, 7, 37, 40, 2, 33, 1, 3);   /* 7 rows past offsets[E], read through src */
    fp8_case_cpu(be, cx, 64, 5, 16, 136, 1, 60, 0, 8);  /* K past one 128-wide group */
    fp8_case_cpu(be, cx, 300, 4, 130, 256, 2, 300, 1, 3); /* N past one 128-row weight block */
    fp8_case_cpu(be, cx, 10, 4, 3, 8, 1, 0, 0, 0);      /* no rows at all */
    refusals8(be, cx);
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
    /* moe_gemm_fp8, where the wgmma kernels run (a call with no rows says whether they do) */
    if (be->moe_gemm_fp8(cx, NULL, NULL, NULL, NULL, 0, NULL, 1, NULL, NULL, NULL, NULL, NULL, 0, 1, 0, 0) != CM_OK) {
        printf("moe_gemm_fp8: not here (%s)\n", cm_last_error());
        TST_CHECK(n_base_tilings == 1);
    } else {
        const kn_backend *cpu = kn_backend_cpu();
        kn_ctx           *cc  = NULL;
        tst_ok(cpu->ctx_create(&cc, NULL), "cpu ctx_create");
        fp8_case_cuda(be, cx, cpu, cc, 1, 1, 1, 16, 1, 1, 0, 0);
        fp8_case_cuda(be, cx, cpu, cc, 40, 7, 37, 48, 2, 33, 1, 3);
        fp8_case_cuda(be, cx, cpu, cc, 300, 7, 130, 144, 2, 300, 1, 3);
        fp8_case_cuda(be, cx, cpu, cc, 1000, 64, 257, 528, 1, 999, 1, 0);
        fp8_case_cuda(be, cx, cpu, cc, 10, 4, 3, 16, 1, 0, 0, 0);
        fp8_case_cuda(be, cx, cpu, cc, 1024, 256, 512, 2048, 2, 1024, 0, 8); /* the 35B-A3B gate and up */
        fp8_case_cuda(be, cx, cpu, cc, 1024, 256, 2048, 512, 1, 1024, 0, 0); /* and down */
        fp8_case_cuda(be, cx, cpu, cc, 4096, 2, 128, 256, 2, 4096, 2, 0);    /* one expert, 32 row tiles */
        refusals8(be, cx);
        TST_FAILS(be->moe_gemm_fp8(cx, (float *)cx, NULL, (const uint8_t *)cx, (const float *)cx, 16, NULL, 0,
                                   (const uint8_t *const *)cx, (const float *const *)cx, NULL, NULL,
                                   (const int32_t *)cx, 4, 2, 1, 24),
                  CM_ERR_INVALID_ARG, "multiple of 16");
        cpu->ctx_destroy(&cc);
    }
    be->ctx_destroy(&cx);
    return tst_report();
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "cpu") == 0) return run_cpu();
    if (argc == 2 && strcmp(argv[1], "cuda") == 0) return run_cuda();
    fprintf(stderr, "usage: test_kn_moe_gemm cpu|cuda\n");
    return 2;
}
