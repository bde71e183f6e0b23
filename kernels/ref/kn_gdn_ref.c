/* kernels/ref/kn_gdn_ref.c — reference Gated DeltaNet core: the gate (g = −e^{A_log} ·
 * softplus(a + dt_bias), beta = sigmoid(b)) and the gated delta rule in its chunked WY/UT form
 * (docs/target.md, as FLA chunk_gated_delta_rule and HF torch_chunk_gated_delta_rule),
 * all in double. Per sequence and v-head h (qk-head h / (nv/nk)), from a zero state S [dk, dv],
 * for each chunk of L ≤ 64 tokens (chunks restart at every sequence start):
 *   γ_r = Σ_{i≤r} g_i (local),  A[r, j] = β_r e^{γ_r−γ_j} (k_r·k_j) for j < r (only j < r is
 *   ever exponentiated, so no 0·inf), T = (I + A)^{-1} by forward substitution,
 *   U = T diag(β) V,  W = T diag(β e^γ) K,  δ = U − W S,
 *   o_r = e^{γ_r} (q_r S) + Σ_{j≤r} e^{γ_r−γ_j} (q_r·k_j) δ_j   (q scaled by `scale`),
 *   S ← e^{γ_{L−1}} S + Σ_j e^{γ_{L−1}−γ_j} k_j δ_jᵀ.
 * This equals the per-token recurrence of kn_backend.h exactly in real arithmetic; the test
 * checks it against that recurrence. (sequence, v-head) pairs run in parallel under OpenMP,
 * each thread with its own double scratch. */
#include "kn_ref.h"

#include <stdlib.h>

#define CH KN_REF_GDN_CHUNK

cm_status kn_ref_gdn_gate(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b,
                          const float *A_log, const float *dt_bias, int64_t T, int nv) {
    KN_REF_CHECK(ctx, "gdn_gate: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nv > 0, "gdn_gate: bad shape T=%lld nv=%d (T >= 0, nv > 0)", (long long)T, nv);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(g && beta && a && b && A_log && dt_bias,
                 "gdn_gate: g, beta, a, b, A_log or dt_bias is NULL");
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < nv; h++) {
            int64_t i = t * nv + h;
            g[i]      = (float)(-exp((double)A_log[h]) * kn_ref_softplus((double)a[i] + (double)dt_bias[h]));
            beta[i]   = (float)kn_ref_sigmoid(b[i]);
        }
    }
    return CM_OK;
}

/* Per-thread scratch for one (sequence, v-head) task. */
typedef struct gdn_scratch {
    double *S;  /* [dk, dv] state at the chunk start */
    double *A;  /* [CH, CH] strictly lower: β_r e^{γ_r−γ_j} k_r·k_j */
    double *Ti; /* [CH, CH] (I + A)^{-1}, unit lower-triangular */
    double *U;  /* [CH, dv] */
    double *W;  /* [CH, dk] */
    double *D;  /* [CH, dv] δ, the new values */
    double  gam[CH], bet[CH];
} gdn_scratch;

/* The scratch's doubles for head sizes dk, dv (S, A, Ti, U, W and D, in that order). */
static size_t scratch_doubles(int dk, int dv) {
    return (size_t)dk * dv + 2 * (size_t)CH * CH + (size_t)CH * (2 * (size_t)dv + dk);
}

/* sc's arrays laid over p (scratch_doubles(dk, dv) doubles). */
static void scratch_view(gdn_scratch *sc, double *p, int dk, int dv) {
    sc->S = p;
    sc->A = sc->S + (size_t)dk * dv;
    sc->Ti = sc->A + (size_t)CH * CH;
    sc->U = sc->Ti + (size_t)CH * CH;
    sc->W = sc->U + (size_t)CH * dv;
    sc->D = sc->W + (size_t)CH * dk;
}

/* One (sequence [bos, eos), v-head h) pair. Strides: q, k rows are nk·dk floats per token,
 * v, out rows nv·dv, g, beta rows nv. */
static void gdn_one(gdn_scratch *sc, float *out, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, int64_t bos, int64_t eos, int h, int kh, int nk,
                    int nv, int dk, int dv, double scale) {
    double *S = sc->S, *A = sc->A, *Ti = sc->Ti, *U = sc->U, *W = sc->W, *D = sc->D;
    for (int64_t i = 0; i < (int64_t)dk * dv; i++) S[i] = 0;
#define KROW(t) (k + ((t)*nk + kh) * (int64_t)dk)
#define QROW(t) (q + ((t)*nk + kh) * (int64_t)dk)
#define VROW(t) (v + ((t)*nv + h) * (int64_t)dv)

    for (int64_t s0 = bos; s0 < eos; s0 += CH) {
        const int L = (int)(eos - s0 < CH ? eos - s0 : CH);
        for (int r = 0; r < L; r++) {
            sc->gam[r] = (r ? sc->gam[r - 1] : 0.0) + (double)g[(s0 + r) * nv + h];
            sc->bet[r] = beta[(s0 + r) * nv + h];
        }
        // A, strictly lower, then T = (I + A)^{-1}: row r of (I + A)T = e_r gives
        // T[r, j] = −Σ_{m=j}^{r−1} A[r, m] T[m, j] for j < r.
        for (int r = 0; r < L; r++)
            for (int j = 0; j < r; j++)
                A[r * CH + j] =
                    sc->bet[r] * exp(sc->gam[r] - sc->gam[j]) * kn_ref_dot(KROW(s0 + r), KROW(s0 + j), dk);
        for (int r = 0; r < L; r++) {
            for (int j = 0; j < r; j++) {
                double acc = 0;
                for (int m = j; m < r; m++) acc += A[r * CH + m] * Ti[m * CH + j];
                Ti[r * CH + j] = -acc;
            }
            Ti[r * CH + r] = 1.0;
        }
        // U = T diag(β) V, W = T diag(β e^γ) K, δ = U − W S.
        for (int r = 0; r < L; r++) {
            double *u = U + (int64_t)r * dv, *w = W + (int64_t)r * dk, *d = D + (int64_t)r * dv;
            for (int c = 0; c < dv; c++) u[c] = 0;
            for (int i = 0; i < dk; i++) w[i] = 0;
            for (int j = 0; j <= r; j++) {
                const float *vj = VROW(s0 + j), *kj = KROW(s0 + j);
                double       tu = Ti[r * CH + j] * sc->bet[j];
                double       tw = tu * exp(sc->gam[j]);
                for (int c = 0; c < dv; c++) u[c] += tu * (double)vj[c];
                for (int i = 0; i < dk; i++) w[i] += tw * (double)kj[i];
            }
            for (int c = 0; c < dv; c++) d[c] = u[c];
            for (int i = 0; i < dk; i++) {
                const double *Si = S + (int64_t)i * dv;
                for (int c = 0; c < dv; c++) d[c] -= w[i] * Si[c];
            }
        }
        // Outputs: inter-chunk (q_r S, decayed by e^{γ_r}) plus intra-chunk (causal, incl. j = r).
        // U is free now and holds the output row being accumulated.
        for (int r = 0; r < L; r++) {
            const float *qr = QROW(s0 + r);
            double      *o  = U;
            double       er = exp(sc->gam[r]);
            for (int c = 0; c < dv; c++) o[c] = 0;
            for (int i = 0; i < dk; i++) {
                double        qi = (double)qr[i] * scale * er;
                const double *Si = S + (int64_t)i * dv;
                for (int c = 0; c < dv; c++) o[c] += qi * Si[c];
            }
            for (int j = 0; j <= r; j++) {
                double        qk = kn_ref_dot(qr, KROW(s0 + j), dk) * scale * exp(sc->gam[r] - sc->gam[j]);
                const double *dj = D + (int64_t)j * dv;
                for (int c = 0; c < dv; c++) o[c] += qk * dj[c];
            }
            float *orow = out + ((s0 + r) * nv + h) * (int64_t)dv;
            for (int c = 0; c < dv; c++) orow[c] = (float)o[c];
        }
        // State at the chunk end.
        const double glast = sc->gam[L - 1], elast = exp(glast);
        for (int64_t i = 0; i < (int64_t)dk * dv; i++) S[i] *= elast;
        for (int j = 0; j < L; j++) {
            const float  *kj = KROW(s0 + j);
            const double *dj = D + (int64_t)j * dv;
            double        ej = exp(glast - sc->gam[j]);
            for (int i = 0; i < dk; i++) {
                double  ki = ej * (double)kj[i];
                double *Si = S + (int64_t)i * dv;
                for (int c = 0; c < dv; c++) Si[c] += ki * dj[c];
            }
        }
    }
#undef KROW
#undef QROW
#undef VROW
}

/* One gated_delta_rule call's operands. */
typedef struct {
    float         *out;
    const float   *q, *k, *v, *g, *beta;
    const int32_t *cu;
    int            nk, nv, dk, dv;
    double         scale;
} gdn_args;

/* Task s·nv + h: sequence s, v-head h. */
static void gdn_task(int64_t task, void *scratch, const void *user) {
    const gdn_args *a = user;
    const int       s = (int)(task / a->nv), h = (int)(task % a->nv);
    gdn_scratch     sc;
    scratch_view(&sc, scratch, a->dk, a->dv);
    gdn_one(&sc, a->out, a->q, a->k, a->v, a->g, a->beta, a->cu[s], a->cu[s + 1], h, h / (a->nv / a->nk),
            a->nk, a->nv, a->dk, a->dv, a->scale);
}

cm_status kn_ref_gated_delta_rule(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                                  const float *g, const float *beta, const int32_t *cu_seqlens, int n_seq,
                                  int64_t T, int nk, int nv, int dk, int dv, float scale) {
    KN_REF_CHECK(ctx, "gated_delta_rule: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                 "gated_delta_rule: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d", (long long)T, nk, nv, dk, dv);
    KN_REF_CHECK(nv % nk == 0, "gated_delta_rule: nv=%d must be a multiple of nk=%d", nv, nk);
    CM_TRY(kn_ref_seqlens_check("gated_delta_rule", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(out && q && k && v && g && beta, "gated_delta_rule: out, q, k, v, g or beta is NULL");

    const gdn_args a = {out, q, k, v, g, beta, cu_seqlens, nk, nv, dk, dv, (double)scale};
    return kn_ref_parallel("gated_delta_rule", (int64_t)n_seq * nv, 1,
                           scratch_doubles(dk, dv) * sizeof(double), gdn_task, &a);
}

cm_status kn_ref_gated_delta_rule_bf16(kn_ctx *ctx, float *out, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, const float *g, const float *beta, const int32_t *cu_seqlens,
                                       int n_seq, int64_t T, int nk, int nv, int dk, int dv) {
    KN_REF_CHECK(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                 "gated_delta_rule_bf16: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d", (long long)T, nk, nv, dk, dv);
    if (T == 0)
        return kn_ref_gated_delta_rule(ctx, out, NULL, NULL, NULL, g, beta, cu_seqlens, n_seq, T, nk, nv, dk, dv,
                                       1.0f);
    KN_REF_CHECK(q && k && v, "gated_delta_rule_bf16: q, k or v is NULL");
    const int64_t nq = T * nk * dk, nvv = T * nv * dv;
    float        *f = malloc((size_t)(2 * nq + nvv) * sizeof(float));
    if (!f)
        return CM_FAIL(CM_ERR_NOMEM, "gated_delta_rule_bf16: cannot allocate %lld floats of scratch",
                       (long long)(2 * nq + nvv));
    for (int64_t i = 0; i < nq; i++) f[i] = cm_bf16_to_f32(q[i]);
    for (int64_t i = 0; i < nq; i++) f[nq + i] = cm_bf16_to_f32(k[i]);
    for (int64_t i = 0; i < nvv; i++) f[2 * nq + i] = cm_bf16_to_f32(v[i]);
    cm_status st =
        kn_ref_gated_delta_rule(ctx, out, f, f + nq, f + 2 * nq, g, beta, cu_seqlens, n_seq, T, nk, nv, dk, dv, 1.0f);
    free(f);
    return st;
}
