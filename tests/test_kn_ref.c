/* tests/test_kn_ref.c — checks the cpu reference kernels through the kn_backend table
 * against independent naive formulas written differently from kernels/ref: the gated delta
 * rule (chunked) against the per-token recurrence with a [dv, dk] state, attention against a
 * dense masked softmax per sequence, rope invariants and hand values, conv1d at sequence
 * boundaries, norms and the GDN gate against closed-form values, GEMM (F32 and BF16) against
 * a triple loop, embed, copy2d, and bad arguments. Label unit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

// ---- helpers: backend buffers and deterministic random numbers

static void *dev_put(const void *host, size_t bytes) {
    void *p = NULL;
    if (be->alloc(ctx, &p, bytes) != CM_OK) {
        fprintf(stderr, "alloc of %zu bytes failed: %s\n", bytes, cm_last_error());
        exit(1);
    }
    if (host && be->upload(ctx, p, host, bytes) != CM_OK) {
        fprintf(stderr, "upload failed: %s\n", cm_last_error());
        exit(1);
    }
    return p;
}

static void dev_get(void *host, const void *dev, size_t bytes) {
    if (be->download(ctx, host, dev, bytes) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

// ---- context and memory

static void test_memory(void) {
    void *p = NULL;
    TST_CHECK(be->alloc(ctx, &p, 1000) == CM_OK);
    TST_CHECK(p && ((uintptr_t)p % 64) == 0);
    int zero = 1;
    for (int i = 0; i < 1000; i++) zero &= ((unsigned char *)p)[i] == 0;
    TST_CHECK(zero);
    unsigned char src[1000], back[1000];
    for (int i = 0; i < 1000; i++) src[i] = (unsigned char)(i * 7);
    TST_CHECK(be->upload(ctx, p, src, sizeof src) == CM_OK);
    TST_CHECK(be->download(ctx, back, p, sizeof back) == CM_OK);
    TST_CHECK(be->sync(ctx) == CM_OK);
    TST_CHECK(memcmp(src, back, sizeof src) == 0);
    TST_CHECK(be->zero(ctx, (unsigned char *)p + 10, 500) == CM_OK); /* clears exactly [10, 510) */
    TST_CHECK(be->download(ctx, back, p, sizeof back) == CM_OK);
    int cleared = 1;
    for (int i = 0; i < 1000; i++) cleared &= back[i] == (i >= 10 && i < 510 ? 0 : src[i]);
    TST_CHECK(cleared);
    TST_CHECK(be->zero(ctx, NULL, 4) != CM_OK);
    be->free(ctx, p);
    be->free(ctx, NULL);

    void *z = NULL;
    TST_CHECK(be->alloc(ctx, &z, 0) == CM_OK && z != NULL);
    be->free(ctx, z);

    kn_ctx *c2 = NULL;
    TST_CHECK(be->ctx_create(&c2, NULL) == CM_OK && c2);
    be->ctx_destroy(&c2);
    TST_CHECK(c2 == NULL);
    be->ctx_destroy(&c2);
    be->ctx_destroy(NULL);
}

static void test_copy2d(void) {
    float src[4 * 7], dst[4 * 5];
    for (int i = 0; i < 28; i++) src[i] = (float)i;
    for (int i = 0; i < 20; i++) dst[i] = -1;
    float *ds = dev_put(src, sizeof src), *dd = dev_put(dst, sizeof dst);
    TST_CHECK(be->copy2d(ctx, dd + 1, 5, ds + 2, 7, 4, 3) == CM_OK);
    dev_get(dst, dd, sizeof dst);
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 5; c++) {
            float want = (c >= 1 && c < 4) ? (float)(r * 7 + 2 + (c - 1)) : -1.0f;
            TST_CHECK(dst[r * 5 + c] == want);
        }
    be->free(ctx, ds);
    be->free(ctx, dd);
}

// ---- elementwise, embed, gemm

static void test_elementwise(void) {
    float  x[3] = {1, -2, 0.5f}, y[3] = {0.25f, 2, -1}, gate[3] = {0, 1, -1}, up[3] = {3, 2, -4}, out[3];
    float *dx = dev_put(x, sizeof x), *dy = dev_put(y, sizeof y);
    float *dg = dev_put(gate, sizeof gate), *du = dev_put(up, sizeof up), *dout = dev_put(NULL, sizeof out);
    TST_CHECK(be->add(ctx, dx, dy, 3) == CM_OK);
    dev_get(x, dx, sizeof x);
    TST_CHECK(x[0] == 1.25f && x[1] == 0.0f && x[2] == -0.5f);
    TST_CHECK(be->swiglu(ctx, dout, dg, du, 3) == CM_OK);
    dev_get(out, dout, sizeof out);
    const float want[3] = {0.0f, (float)(2 * 0.7310585786300049), (float)(-4 * -0.2689414213699951)};
    TST_CLOSE("swiglu", out, want, 3, 1e-7, 1e-6);
    be->free(ctx, dx);
    be->free(ctx, dy);
    be->free(ctx, dg);
    be->free(ctx, du);
    be->free(ctx, dout);
}

static void test_embed(void) {
    enum { V = 5, C = 3, T = 4 };
    float    tf[V * C];
    uint16_t tb[V * C];
    for (int i = 0; i < V * C; i++) {
        tf[i] = (float)(i * 1.5 - 7);
        tb[i] = cm_f32_to_bf16((float)(i * 0.37 - 2));
    }
    int32_t ids[T] = {4, 0, 2, 2};
    float   out[T * C];
    void   *dtf = dev_put(tf, sizeof tf), *dtb = dev_put(tb, sizeof tb), *dids = dev_put(ids, sizeof ids);
    float  *dout = dev_put(NULL, sizeof out);
    TST_CHECK(be->embed(ctx, dout, dids, dtf, CM_DTYPE_F32, T, C) == CM_OK);
    dev_get(out, dout, sizeof out);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) TST_CHECK(out[t * C + c] == tf[ids[t] * C + c]);
    TST_CHECK(be->embed(ctx, dout, dids, dtb, CM_DTYPE_BF16, T, C) == CM_OK);
    dev_get(out, dout, sizeof out);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            TST_CHECK(out[t * C + c] == tst_bf16_widen(tb[ids[t] * C + c]));
    TST_CHECK(be->embed(ctx, dout, dids, dtf, CM_DTYPE_F16, T, C) == CM_ERR_UNSUPPORTED);
    be->free(ctx, dtf);
    be->free(ctx, dtb);
    be->free(ctx, dids);
    be->free(ctx, dout);
}

static void gemm_case(int M, int N, int K, cm_dtype wdt) {
    float    *inp = malloc(sizeof(float) * M * K), *wf = malloc(sizeof(float) * N * K);
    uint16_t *wb  = malloc(sizeof(uint16_t) * N * K);
    float    *out = malloc(sizeof(float) * M * N), *ref = malloc(sizeof(float) * M * N);
    tst_fill(inp, (long)M * K, -1, 1);
    tst_fill(wf, (long)N * K, -1, 1);
    for (long i = 0; i < (long)N * K; i++) wb[i] = cm_f32_to_bf16(wf[i]);
    // naive triple loop, k outermost, accumulated in double
    double *acc = calloc((size_t)M * N, sizeof(double));
    for (int k = 0; k < K; k++)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double wv = wdt == CM_DTYPE_BF16 ? tst_bf16_widen(wb[n * K + k]) : wf[n * K + k];
                acc[m * N + n] += (double)inp[m * K + k] * wv;
            }
    for (long i = 0; i < (long)M * N; i++) ref[i] = (float)acc[i];
    const void *w    = wdt == CM_DTYPE_BF16 ? (const void *)wb : (const void *)wf;
    size_t      wsz  = (size_t)N * K * (wdt == CM_DTYPE_BF16 ? 2 : 4);
    float      *din  = dev_put(inp, sizeof(float) * M * K);
    void       *dw   = dev_put(w, wsz);
    float      *dout = dev_put(NULL, sizeof(float) * M * N);
    TST_CHECK(be->gemm(ctx, dout, din, dw, wdt, M, N, K) == CM_OK);
    dev_get(out, dout, sizeof(float) * M * N);
    char name[64];
    snprintf(name, sizeof name, "gemm %s %dx%dx%d", cm_dtype_name(wdt), M, N, K);
    TST_CLOSE(name, out, ref, (long)M * N, 1e-6, 1e-6);
    be->free(ctx, din);
    be->free(ctx, dw);
    be->free(ctx, dout);
    free(acc);
    free(inp);
    free(wf);
    free(wb);
    free(out);
    free(ref);
}

static void test_gemm(void) {
    gemm_case(7, 13, 29, CM_DTYPE_F32);
    gemm_case(7, 13, 29, CM_DTYPE_BF16);
    gemm_case(37, 50, 70, CM_DTYPE_F32); /* several tiles in both M and N */
    gemm_case(37, 50, 70, CM_DTYPE_BF16);
    gemm_case(1, 1, 1, CM_DTYPE_BF16);
    // K = 0: the empty sum is 0
    float  junk[6] = {5, 5, 5, 5, 5, 5}, zeros[6] = {0};
    float *dout = dev_put(junk, sizeof junk), *din = dev_put(NULL, 4);
    void  *dw = dev_put(NULL, 4);
    TST_CHECK(be->gemm(ctx, dout, din, dw, CM_DTYPE_F32, 2, 3, 0) == CM_OK);
    dev_get(junk, dout, sizeof junk);
    TST_CHECK(memcmp(junk, zeros, sizeof zeros) == 0);
    be->free(ctx, dout);
    be->free(ctx, din);
    be->free(ctx, dw);
}

// ---- norms and the GDN gate (closed-form values)

static void test_norms(void) {
    const float x[4] = {1, 2, 3, 4}, w[4] = {0.5f, -1, 0, 2}, z[4] = {0, 1, -1, 2}, wg[4] = {1, 1, 2, 0.5f};
    float      *dx = dev_put(x, sizeof x), *dw = dev_put(w, sizeof w), *dz = dev_put(z, sizeof z);
    float      *dwg = dev_put(wg, sizeof wg), *dout = dev_put(NULL, sizeof x);
    float       out[4];
    // eps = 0.5 makes mean(x²) + eps = 8
    const float one_plus[4] = {0.5303300858899106f, 0.0f, 1.0606601717798212f, 4.242640687119285f};
    const float plain[4]    = {0.17677669529663687f, -0.7071067811865475f, 0.0f, 2.82842712474619f};
    const float gated[4]    = {0.0f, 0.5169364783938752f, -0.5705109083780165f, 1.2456351733749136f};
    TST_CHECK(be->rmsnorm(ctx, dout, dx, dw, 1, 4, 0.5f, 1) == CM_OK);
    dev_get(out, dout, sizeof out);
    TST_CLOSE("rmsnorm (1+w)", out, one_plus, 4, 1e-7, 1e-6);
    TST_CHECK(be->rmsnorm(ctx, dout, dx, dw, 1, 4, 0.5f, 0) == CM_OK);
    dev_get(out, dout, sizeof out);
    TST_CLOSE("rmsnorm w", out, plain, 4, 1e-7, 1e-6);
    TST_CHECK(be->rmsnorm_gated(ctx, dout, dx, dz, dwg, 1, 4, 0.5f) == CM_OK);
    dev_get(out, dout, sizeof out);
    TST_CLOSE("rmsnorm_gated", out, gated, 4, 1e-7, 1e-6);
    // in place, two rows
    float  xx[8] = {1, 2, 3, 4, 1, 2, 3, 4};
    float *dxx   = dev_put(xx, sizeof xx);
    TST_CHECK(be->rmsnorm(ctx, dxx, dxx, dw, 2, 4, 0.5f, 1) == CM_OK);
    dev_get(xx, dxx, sizeof xx);
    TST_CLOSE("rmsnorm in place row 0", xx, one_plus, 4, 1e-7, 1e-6);
    TST_CLOSE("rmsnorm in place row 1", xx + 4, one_plus, 4, 1e-7, 1e-6);
    // l2norm: (3, 4) → (0.6, 0.8); with eps: x / sqrt(25 + 11) = x / 6
    const float l2in[4] = {3, 4, 3, 4}, l2a[2] = {0.6f, 0.8f}, l2b[2] = {0.5f, 4.0f / 6.0f};
    float      *dl = dev_put(l2in, sizeof l2in);
    TST_CHECK(be->l2norm(ctx, dl, dl, 1, 2, 0.0f) == CM_OK);
    TST_CHECK(be->l2norm(ctx, dl + 2, dl + 2, 1, 2, 11.0f) == CM_OK);
    dev_get(out, dl, sizeof out);
    TST_CLOSE("l2norm", out, l2a, 2, 1e-7, 1e-6);
    TST_CLOSE("l2norm eps", out + 2, l2b, 2, 1e-7, 1e-6);
    be->free(ctx, dx);
    be->free(ctx, dw);
    be->free(ctx, dz);
    be->free(ctx, dwg);
    be->free(ctx, dout);
    be->free(ctx, dxx);
    be->free(ctx, dl);
}

static void test_gdn_gate(void) {
    /* T = 2, nv = 2; head 0: A_log 0, dt_bias 0; head 1: A_log ln 2, dt_bias 1 */
    const float A_log[2] = {0.0f, (float)log(2.0)}, dt_bias[2] = {0, 1};
    const float a[4] = {0, 25, -1, 18}, b[4] = {0, 2, -3, 40};
    const float want_g[4]    = {-0.6931471805599453f, -52.0f, -0.31326168751822286f, -38.00000001120559f};
    const float want_beta[4] = {0.5f, 0.8807970779778823f, 0.04742587317756678f, 1.0f};
    float      *dA = dev_put(A_log, sizeof A_log), *ddt = dev_put(dt_bias, sizeof dt_bias);
    float      *da = dev_put(a, sizeof a), *db = dev_put(b, sizeof b);
    float      *dg = dev_put(NULL, sizeof a), *dbeta = dev_put(NULL, sizeof a);
    float       g[4], beta[4];
    TST_CHECK(be->gdn_gate(ctx, dg, dbeta, da, db, dA, ddt, 2, 2) == CM_OK);
    dev_get(g, dg, sizeof g);
    dev_get(beta, dbeta, sizeof beta);
    TST_CLOSE("gdn_gate g", g, want_g, 4, 1e-7, 1e-6);
    TST_CLOSE("gdn_gate beta", beta, want_beta, 4, 1e-7, 1e-6);
    be->free(ctx, dA);
    be->free(ctx, ddt);
    be->free(ctx, da);
    be->free(ctx, db);
    be->free(ctx, dg);
    be->free(ctx, dbeta);
}

// ---- rope

static void test_rope(void) {
    enum { T = 4, NH = 2, HD = 10, ROT = 6 };
    const int32_t pos[T] = {0, 1, 7, 1000};
    float         x[T * NH * HD], y[T * NH * HD];
    tst_fill(x, T * NH * HD, -2, 2);
    float   *dx = dev_put(x, sizeof x);
    int32_t *dp = dev_put(pos, sizeof pos);
    TST_CHECK(be->rope(ctx, dx, dp, T, NH, HD, ROT, 10000.0f) == CM_OK);
    dev_get(y, dx, sizeof y);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            const float *xi = x + (t * NH + h) * HD, *yi = y + (t * NH + h) * HD;
            for (int d = ROT; d < HD; d++) TST_CHECK(yi[d] == xi[d]); /* tail untouched */
            for (int i = 0; i < ROT / 2; i++) {
                double n0 = hypot(xi[i], xi[i + ROT / 2]), n1 = hypot(yi[i], yi[i + ROT / 2]);
                TST_CHECK(fabs(n0 - n1) <= 1e-6 * (n0 + 1e-30) + 1e-7); /* pair norm preserved */
            }
            if (t == 0)
                for (int d = 0; d < HD; d++) TST_CHECK(yi[d] == xi[d]); /* pos 0 is the identity */
        }
    // hand values on unit vectors: dim i = 1 at pos 1 (inv_freq 10000^(-1/3)), dim 0 at pos 1000
    float e[2 * NH * HD] = {0};
    e[0 * NH * HD + 1]   = 1.0f; /* token 0, head 0, dim 1 */
    e[1 * NH * HD + 0]   = 1.0f; /* token 1, head 0, dim 0 */
    const int32_t p2[2]  = {1, 1000};
    float        *de     = dev_put(e, sizeof e);
    int32_t      *dp2    = dev_put(p2, sizeof p2);
    TST_CHECK(be->rope(ctx, de, dp2, 2, NH, HD, ROT, 10000.0f) == CM_OK);
    dev_get(e, de, sizeof e);
    const float got[4]  = {e[1], e[1 + ROT / 2], e[NH * HD + 0], e[NH * HD + ROT / 2]};
    const float want[4] = {0.998922976239608f, 0.04639921918096883f, 0.5623790762907029f,
                           0.8268795405320025f};
    TST_CLOSE("rope hand values", got, want, 4, 1e-7, 1e-6);
    be->free(ctx, dx);
    be->free(ctx, dp);
    be->free(ctx, de);
    be->free(ctx, dp2);
}

// ---- attention vs a dense masked softmax per sequence

static void attention_case(int use_gate) {
    enum { NQ = 4, NKV = 2, HD = 16, NS = 3 };
    const int32_t cu[NS + 1] = {0, 1, 6, 39};
    const int     T          = cu[NS];
    const float   scale      = 1.0f / sqrtf((float)HD);
    float        *q = malloc(sizeof(float) * T * NQ * HD), *gate = malloc(sizeof(float) * T * NQ * HD);
    float        *k = malloc(sizeof(float) * T * NKV * HD), *v = malloc(sizeof(float) * T * NKV * HD);
    float        *out = malloc(sizeof(float) * T * NQ * HD), *ref = malloc(sizeof(float) * T * NQ * HD);
    tst_fill(q, (long)T * NQ * HD, -1.5, 1.5);
    tst_fill(k, (long)T * NKV * HD, -1.5, 1.5);
    tst_fill(v, (long)T * NKV * HD, -1, 1);
    tst_fill(gate, (long)T * NQ * HD, -3, 3);
    for (int s = 0; s < NS; s++) {
        int     L = cu[s + 1] - cu[s], b = cu[s];
        double *P = malloc(sizeof(double) * L * L);
        for (int h = 0; h < NQ; h++) {
            int kvh = h / (NQ / NKV);
            for (int i = 0; i < L; i++) { /* dense score row with a −∞ mask above the diagonal */
                double den = 0;
                for (int j = 0; j < L; j++) {
                    double d = 0;
                    for (int c = 0; c < HD; c++)
                        d += (double)q[((b + i) * NQ + h) * HD + c] * k[((b + j) * NKV + kvh) * HD + c];
                    P[i * L + j] = j > i ? 0.0 : exp(d * scale);
                    den += P[i * L + j];
                }
                for (int j = 0; j < L; j++) P[i * L + j] /= den;
            }
            for (int i = 0; i < L; i++)
                for (int c = 0; c < HD; c++) {
                    double o = 0;
                    for (int j = 0; j < L; j++) o += P[i * L + j] * v[((b + j) * NKV + kvh) * HD + c];
                    long idx = ((long)(b + i) * NQ + h) * HD + c;
                    ref[idx] = (float)(use_gate ? o / (1.0 + exp(-(double)gate[idx])) : o);
                }
        }
        free(P);
    }
    float   *dq = dev_put(q, sizeof(float) * T * NQ * HD), *dg = dev_put(gate, sizeof(float) * T * NQ * HD);
    float   *dk = dev_put(k, sizeof(float) * T * NKV * HD), *dv = dev_put(v, sizeof(float) * T * NKV * HD);
    float   *dout = dev_put(NULL, sizeof(float) * T * NQ * HD);
    int32_t *dcu  = dev_put(cu, sizeof cu);
    TST_CHECK(be->attention(ctx, dout, dq, dk, dv, use_gate ? dg : NULL, dcu, NS, T, NQ, NKV, HD, scale) ==
              CM_OK);
    dev_get(out, dout, sizeof(float) * T * NQ * HD);
    TST_CLOSE(use_gate ? "attention gated" : "attention", out, ref, (long)T * NQ * HD, 1e-6, 1e-5);
    // token 0 of every sequence attends only to itself: out = v (times the gate)
    for (int s = 0; s < NS; s++)
        for (int h = 0; h < NQ; h++)
            for (int c = 0; c < HD; c++) {
                long   idx = ((long)cu[s] * NQ + h) * HD + c;
                double vv  = v[((long)cu[s] * NKV + h / (NQ / NKV)) * HD + c];
                if (use_gate) vv /= 1.0 + exp(-(double)gate[idx]);
                TST_CHECK(fabs(out[idx] - vv) <= 1e-6);
            }
    be->free(ctx, dq);
    be->free(ctx, dg);
    be->free(ctx, dk);
    be->free(ctx, dv);
    be->free(ctx, dout);
    be->free(ctx, dcu);
    free(q);
    free(gate);
    free(k);
    free(v);
    free(out);
    free(ref);
}

// ---- conv1d at sequence boundaries

static void test_conv1d(void) {
    enum { C = 3, K = 4, NS = 3 };
    const int32_t cu[NS + 1] = {0, 3, 5, 11};
    const int     T          = cu[NS];
    float         x[T * C], w[C * K], out[T * C], ref[T * C];
    tst_fill(x, T * C, -2, 2);
    tst_fill(w, C * K, -1, 1);
    // naive: walk back from t, stopping at the sequence start; tap K-1-back multiplies x[t - back]
    for (int s = 0; s < NS; s++)
        for (int t = cu[s]; t < cu[s + 1]; t++)
            for (int c = 0; c < C; c++) {
                double acc = 0;
                for (int back = 0; back < K && t - back >= cu[s]; back++)
                    acc += w[c * K + (K - 1 - back)] * (double)x[(t - back) * C + c];
                ref[t * C + c] = (float)(acc / (1.0 + exp(-acc)));
            }
    float   *dx = dev_put(x, sizeof x), *dw = dev_put(w, sizeof w), *dout = dev_put(NULL, sizeof out);
    int32_t *dcu = dev_put(cu, sizeof cu);
    TST_CHECK(be->conv1d_silu(ctx, dout, dx, dw, dcu, NS, T, C, K) == CM_OK);
    dev_get(out, dout, sizeof out);
    TST_CLOSE("conv1d_silu", out, ref, T * C, 1e-7, 1e-6);
    // a token at a sequence start sees only itself: silu(w[c, K-1] · x[t, c])
    for (int s = 0; s < NS; s++)
        for (int c = 0; c < C; c++) {
            double a = (double)w[c * K + K - 1] * x[cu[s] * C + c];
            TST_CHECK(fabs(out[cu[s] * C + c] - a / (1.0 + exp(-a))) <= 1e-6);
        }
    // changing sequence 0 leaves sequence 1 alone
    float x2[T * C], out2[T * C];
    memcpy(x2, x, sizeof x);
    for (int i = 0; i < cu[1] * C; i++) x2[i] += 10.0f;
    TST_CHECK(be->upload(ctx, dx, x2, sizeof x2) == CM_OK);
    TST_CHECK(be->conv1d_silu(ctx, dout, dx, dw, dcu, NS, T, C, K) == CM_OK);
    dev_get(out2, dout, sizeof out2);
    TST_CHECK(memcmp(out + cu[1] * C, out2 + cu[1] * C, sizeof(float) * (T - cu[1]) * C) == 0);
    be->free(ctx, dx);
    be->free(ctx, dw);
    be->free(ctx, dout);
    be->free(ctx, dcu);
}

// ---- gated delta rule: chunked reference vs the per-token recurrence

/* The oracle of docs/target.md, per token, with the state stored transposed as
 * St[dv][dk] (v-major) in double: decay, delta write, read after the write. */
static void gdn_recurrent(double *out, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, const int32_t *cu, int n_seq, int nk, int nv, int dk, int dv,
                          double scale) {
    double *St = malloc(sizeof(double) * dv * dk);
    for (int s = 0; s < n_seq; s++)
        for (int h = 0; h < nv; h++) {
            int kh = h / (nv / nk);
            memset(St, 0, sizeof(double) * dv * dk);
            for (int t = cu[s]; t < cu[s + 1]; t++) {
                const float *kt = k + ((long)t * nk + kh) * dk, *qt = q + ((long)t * nk + kh) * dk;
                const float *vt    = v + ((long)t * nv + h) * dv;
                double       decay = exp((double)g[t * nv + h]), bt = beta[t * nv + h];
                for (int c = 0; c < dv; c++) {
                    double *row = St + (long)c * dk, sk = 0;
                    for (int i = 0; i < dk; i++) {
                        row[i] *= decay;
                        sk += row[i] * kt[i];
                    }
                    double u = bt * ((double)vt[c] - sk);
                    double o = 0;
                    for (int i = 0; i < dk; i++) {
                        row[i] += kt[i] * u;
                        o += row[i] * (double)qt[i] * scale;
                    }
                    out[((long)t * nv + h) * dv + c] = o;
                }
            }
        }
    free(St);
}

static void l2norm_rows(float *x, long rows, int d) {
    for (long r = 0; r < rows; r++) {
        double s = 0;
        for (int i = 0; i < d; i++) s += (double)x[r * d + i] * x[r * d + i];
        for (int i = 0; i < d; i++) x[r * d + i] = (float)(x[r * d + i] / sqrt(s + 1e-6));
    }
}

static void gdn_case(const int32_t *cu, int n_seq, int strong_decay) {
    enum { NK = 2, NV = 6, DK = 16, DV = 12 };
    const int    T     = cu[n_seq];
    const double scale = 1.0 / sqrt((double)DK);
    long         nqk = (long)T * NK * DK, nvv = (long)T * NV * DV, ng = (long)T * NV;
    float       *q = malloc(sizeof(float) * (nqk + 1)), *k = malloc(sizeof(float) * (nqk + 1));
    float       *v = malloc(sizeof(float) * (nvv + 1)), *out = malloc(sizeof(float) * (nvv + 1));
    float       *g = malloc(sizeof(float) * (ng + 1)), *beta = malloc(sizeof(float) * (ng + 1));
    double      *ref  = malloc(sizeof(double) * (nvv + 1));
    float       *reff = malloc(sizeof(float) * (nvv + 1));
    tst_fill(q, nqk, -1, 1);
    tst_fill(k, nqk, -1, 1);
    l2norm_rows(q, (long)T * NK, DK);
    l2norm_rows(k, (long)T * NK, DK);
    tst_fill(v, nvv, -1, 1);
    tst_fill(g, ng, -0.4, 0.0);
    tst_fill(beta, ng, 0.0, 1.0);
    if (strong_decay)
        for (long i = 0; i < ng; i += 7) g[i] = -30.0f; /* e^γ underflows across a chunk */
    gdn_recurrent(ref, q, k, v, g, beta, cu, n_seq, NK, NV, DK, DV, scale);
    for (long i = 0; i < nvv; i++) reff[i] = (float)ref[i];

    float   *dq = dev_put(q, sizeof(float) * (nqk + 1)), *dk = dev_put(k, sizeof(float) * (nqk + 1));
    float   *dv = dev_put(v, sizeof(float) * (nvv + 1)), *dout = dev_put(NULL, sizeof(float) * (nvv + 1));
    float   *dg = dev_put(g, sizeof(float) * (ng + 1)), *db = dev_put(beta, sizeof(float) * (ng + 1));
    int32_t *dcu = dev_put(cu, sizeof(int32_t) * (n_seq + 1));
    TST_CHECK(be->gated_delta_rule(ctx, dout, dq, dk, dv, dg, db, dcu, n_seq, T, NK, NV, DK, DV,
                                   (float)scale) == CM_OK);
    dev_get(out, dout, sizeof(float) * (nvv + 1));
    char name[64];
    snprintf(name, sizeof name, "gated_delta_rule T=%d n_seq=%d%s", T, n_seq,
             strong_decay ? " strong decay" : "");
    TST_CLOSE(name, out, reff, nvv, 1e-6, 1e-5);
    double rel = tst_rel_l2(out, ref, nvv);
    if (T > 0) TST_CHECK(rel < 1e-6);
    be->free(ctx, dq);
    be->free(ctx, dk);
    be->free(ctx, dv);
    be->free(ctx, dout);
    be->free(ctx, dg);
    be->free(ctx, db);
    be->free(ctx, dcu);
    free(q);
    free(k);
    free(v);
    free(out);
    free(g);
    free(beta);
    free(ref);
    free(reff);
}

static void test_gated_delta_rule(void) {
    /* lengths {1, 63, 64, 65, 200, 130} packed: chunk boundaries at, around and inside sequences */
    const int32_t cu[7] = {0, 1, 64, 128, 193, 393, 523};
    gdn_case(cu, 6, 0);
    gdn_case(cu, 6, 1);
    const int32_t cu_empty[4] = {0, 5, 5, 70}; /* an empty sequence in the middle */
    gdn_case(cu_empty, 3, 0);
}

// ---- bad arguments

/* Each call must fail with CM_ERR_INVALID_ARG and leave a message. */
#define BAD(call)                                                                                            \
    do {                                                                                                     \
        cm_clear_error();                                                                                    \
        TST_CHECK((call) == CM_ERR_INVALID_ARG && cm_last_error()[0] != '\0');                               \
    } while (0)

static void test_bad_args(void) {
    float    buf[64] = {0};
    int32_t  cu[3] = {0, 2, 4}, pos[4] = {0};
    float   *d   = dev_put(buf, sizeof buf);
    int32_t *dcu = dev_put(cu, sizeof cu), *dpos = dev_put(pos, sizeof pos);

    BAD(be->gemm(ctx, d, d, d, CM_DTYPE_F32, -1, 2, 2));
    BAD(be->gemm(ctx, NULL, d, d, CM_DTYPE_F32, 2, 2, 2));
    BAD(be->gemm(NULL, d, d, d, CM_DTYPE_F32, 2, 2, 2));
    TST_CHECK(be->gemm(ctx, d, d, d, CM_DTYPE_I32, 2, 2, 2) == CM_ERR_UNSUPPORTED);
    BAD(be->copy2d(ctx, d, 2, d + 32, 4, 2, 3));
    BAD(be->add(ctx, d, NULL, 4));
    BAD(be->embed(ctx, d, dpos, d, CM_DTYPE_F32, -2, 4));
    int32_t  neg  = -1;
    int32_t *dneg = dev_put(&neg, sizeof neg);
    BAD(be->embed(ctx, d, dneg, d, CM_DTYPE_F32, 1, 4));
    BAD(be->rmsnorm(ctx, d, d, d, 2, 0, 1e-6f, 1));
    BAD(be->rmsnorm(ctx, d, d, NULL, 2, 4, 1e-6f, 1));
    BAD(be->l2norm(ctx, d, d, 2, 4, -1.0f));
    BAD(be->rope(ctx, d, dpos, 4, 1, 8, 5, 1e4f));  /* odd rot_dim */
    BAD(be->rope(ctx, d, dpos, 4, 1, 8, 10, 1e4f)); /* rot_dim > head_dim */
    BAD(be->rope(ctx, d, dpos, 4, 1, 8, 8, 0.0f));
    BAD(be->attention(ctx, d, d, d, d, NULL, dcu, 2, 4, 3, 2, 2, 1.0f)); /* nq % nkv */
    BAD(be->attention(ctx, d, d, d, d, NULL, dcu, 2, 5, 2, 2, 2, 1.0f)); /* cu[n] != T */
    BAD(be->attention(ctx, d, d, d, d, NULL, NULL, 2, 4, 2, 2, 2, 1.0f));
    int32_t  bad_cu[3] = {0, 3, 2}, bad0[3] = {1, 2, 4};
    int32_t *dbad = dev_put(bad_cu, sizeof bad_cu), *dbad0 = dev_put(bad0, sizeof bad0);
    BAD(be->conv1d_silu(ctx, d + 32, d, d, dbad, 2, 2, 2, 4));  /* decreasing */
    BAD(be->conv1d_silu(ctx, d + 32, d, d, dbad0, 2, 4, 2, 4)); /* cu[0] != 0 */
    BAD(be->conv1d_silu(ctx, d, d, d + 32, dcu, 2, 4, 2, 4));   /* out == x */
    BAD(be->conv1d_silu(ctx, d + 32, d, d, dcu, 2, 4, 2, 0));   /* K = 0 */
    BAD(be->gdn_gate(ctx, d, d, d, d, d, NULL, 2, 2));
    BAD(be->gated_delta_rule(ctx, d, d, d, d, d, d, dcu, 2, 4, 2, 3, 2, 2, 1.0f));
    BAD(be->gated_delta_rule(ctx, d, d, d, d, d, d, dcu, -1, 4, 1, 1, 2, 2, 1.0f));
    BAD(be->alloc(ctx, NULL, 8));
    BAD(be->upload(ctx, NULL, buf, 8));
    kn_ctx       *c2  = NULL;
    kn_ctx_config bad = {0, (kn_gemm_mode)7};
    TST_CHECK(be->ctx_create(&c2, &bad) == CM_ERR_INVALID_ARG && c2 == NULL);
    BAD(be->ctx_create(NULL, NULL));
    be->free(ctx, d);
    be->free(ctx, dcu);
    be->free(ctx, dpos);
    be->free(ctx, dneg);
    be->free(ctx, dbad);
    be->free(ctx, dbad0);
}

static void test_backend_get(void) {
    const kn_backend *b = NULL;
    TST_CHECK(kn_backend_get("cpu", &b) == CM_OK && b == kn_backend_cpu() && strcmp(b->name, "cpu") == 0);
    cm_status st = kn_backend_get("cuda", &b);
#ifdef TANDEM_HAVE_CUDA
    TST_CHECK(st == CM_OK && b == kn_backend_cuda());
#else
    TST_CHECK(st == CM_ERR_UNSUPPORTED && b == NULL && kn_backend_cuda() == NULL);
    TST_CHECK(strstr(cm_last_error(), "no cuda backend") != NULL);
#endif
    TST_CHECK(kn_backend_get("tpu", &b) == CM_ERR_INVALID_ARG && b == NULL);
    TST_CHECK(kn_backend_get(NULL, &b) == CM_ERR_INVALID_ARG);
    TST_CHECK(kn_backend_get("cpu", NULL) == CM_ERR_INVALID_ARG);
    // every entry of the table is filled
    const kn_backend *c = kn_backend_cpu();
    TST_CHECK(c->ctx_create && c->ctx_destroy && c->alloc && c->free && c->upload && c->download && c->sync);
    TST_CHECK(c->copy2d && c->add && c->swiglu && c->embed && c->gemm && c->rmsnorm && c->rmsnorm_gated);
    TST_CHECK(c->l2norm && c->rope && c->attention && c->conv1d_silu && c->gdn_gate && c->gated_delta_rule);
}

int main(void) {
    test_backend_get();
    be = kn_backend_cpu();

    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create a cpu context: %s\n", cm_last_error());
        return 1;
    }
    test_memory();
    test_copy2d();
    test_elementwise();
    test_embed();
    test_gemm();
    test_norms();
    test_gdn_gate();
    test_rope();
    attention_case(0);
    attention_case(1);
    test_conv1d();
    test_gated_delta_rule();
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
