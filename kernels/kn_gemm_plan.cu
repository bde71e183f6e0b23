/* kernels/kn_gemm_plan.cu — the cuBLASLt matmul that every GEMM of the backend goes through
 * (gemm and gemm_bf16in in kn_gemm.cu, gemm_dx and gemm_dw in kn_gemm_bwd.cu, matmul, lm_ce:
 * kn_cuda_lt.h), and the context's table of GEMM plans behind it (kn_cuda.h): one plan per key
 * (descriptors and algorithm, made on the key's first call, i.e. at the first forward or step),
 * so a later call is one table probe and one cublasLtMatmul: no descriptor, no heuristic query,
 * no host allocation. The algorithm is the heuristic's first answer for the shape and the
 * operands' alignment: for a fixed shape and alignment the same kernel runs every time, which
 * keeps results reproducible run to run. TANDEM_GEMM_PLAN=0 makes everything per call again
 * (for comparison); TANDEM_GEMM_AUTOTUNE=k (2..16) times the heuristic's first k answers when a
 * plan is made and keeps the fastest: faster kernels perhaps, but another process may pick
 * another one (other low bits), so it is off by default (both read at ctx_create, kn_cuda.h).
 * On an H200 at the 27B target's shapes (M 8192) the timed pick was 0-7 % faster per GEMM than
 * the first answer (in_qkv 1.181 -> 1.099 ms, gate/up 1.997 -> 1.923 ms, ~3 % of the forward's
 * GEMM time), the forward 810.6 -> 799.9 ms: about the run-to-run noise
 * (bench/results/gemm-plan-2026-11-30.md). No kernels. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"

#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

// ----------------------------------------------------------------------------
// the key's inputs

static uint32_t ptr_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t  al = 256;
    while (al > 1 && (a & (al - 1)))
        al >>= 1;
    return al;
}

// ----------------------------------------------------------------------------
// GEMM plans (kn_cuda.h): the descriptors and the algorithm of a key, made on its first call

#define LT_TUNE_RUNS 3 /* timed runs per answer, after one warm-up */

typedef struct lt_descs {
    cublasLtMatmulDesc_t   op;
    cublasLtMatrixLayout_t a, b, c;
} lt_descs;

static void lt_descs_release(lt_descs *d) {
    if (d->c)
        cublasLtMatrixLayoutDestroy(d->c);
    if (d->b)
        cublasLtMatrixLayoutDestroy(d->b);
    if (d->a)
        cublasLtMatrixLayoutDestroy(d->a);
    if (d->op)
        cublasLtMatmulDescDestroy(d->op);
    d->op = NULL;
    d->a = d->b = d->c = NULL;
}

/* On failure some descriptors may exist: the caller releases d either way. */
static cm_status lt_descs_make(lt_descs *d, const kn_lt_key *key) {
    cublasOperation_t ta = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                      tb = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cudaDataType_t ab = (cudaDataType_t)key->ab_type;
    int64_t        m = key->m, n = key->n, k = key->k;
    KN_CUBLAS(cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* stored shapes: op(A) is m×k, so A is k×m when transposed */
    KN_CUBLAS(cublasLtMatrixLayoutCreate(&d->a, ab, (uint64_t)(key->trans_a ? k : m),
                                         (uint64_t)(key->trans_a ? m : k), key->lda));
    KN_CUBLAS(cublasLtMatrixLayoutCreate(&d->b, ab, (uint64_t)(key->trans_b ? n : k),
                                         (uint64_t)(key->trans_b ? k : n), key->ldb));
    KN_CUBLAS(
        cublasLtMatrixLayoutCreate(&d->c, (cudaDataType_t)key->c_type, (uint64_t)m, (uint64_t)n, key->ldc));
    if (ab == CUDA_R_8F_E4M3) { /* block-scaled FP8 (kn_cuda_lt_matmul_fp8): A 128 × 128 blocks, B 1 × 128 */
        cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                    bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
    }
    return CM_OK;
}

/* The scale pointers of a block-scaled FP8 product, set on its descriptor before each run (a
 * context is used by one thread at a time, so the plan's descriptor may carry them). */
static cm_status lt_set_scales(cublasLtMatmulDesc_t op, const float *a_scale, const float *b_scale) {
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
    return CM_OK;
}

static const char *lt_type_name(int32_t t) {
    return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_8F_E4M3 ? "fp8" : "f32";
}

/* The preference (workspace, alignments) for key; the caller destroys *pref either way. */
static cm_status lt_pref_make(kn_ctx *ctx, cublasLtMatmulPreference_t *pref, const kn_lt_key *key) {
    uint64_t ws = ctx->lt_ws_bytes;
    KN_CUBLAS(cublasLtMatmulPreferenceCreate(pref));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                   sizeof ws));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                   &key->al_a, sizeof key->al_a));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                   &key->al_b, sizeof key->al_b));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                   &key->al_c, sizeof key->al_c));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                   &key->al_c, sizeof key->al_c));
    return CM_OK;
}

/* The heuristic's first `want` answers for the descriptors and key; *n_found may be 0. */
static cm_status lt_heuristic(kn_ctx *ctx, const lt_descs *d, const kn_lt_key *key, int want,
                              cublasLtMatmulHeuristicResult_t *res, int *n_found) {
    cublasLtMatmulPreference_t pref = NULL;
    cm_status                  st = lt_pref_make(ctx, &pref, key);
    if (st == CM_OK) {
        cublasStatus_t s =
            cublasLtMatmulAlgoGetHeuristic(ctx->lt, d->op, d->a, d->b, d->c, d->c, pref, want, res, n_found);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = CM_FAIL(CM_ERR_CUBLAS, "cublasLtMatmulAlgoGetHeuristic failed: %s (%s)",
                         cublasLtGetStatusString(s), cublasLtGetStatusName(s));
    }
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    return st;
}

static cm_status lt_no_algo(const char *opname, const kn_lt_key *key) {
    return CM_FAIL(CM_ERR_CUBLAS, "%s: cuBLASLt has no algorithm for m=%lld n=%lld k=%lld (%s operands)",
                   opname, (long long)key->m, (long long)key->n, (long long)key->k, lt_type_name(key->ab_type));
}

/* Times the n answers on the real operands A and B into a scratch C (the caller's C is never
 * touched, so an accumulating call's C stays as it was) and returns the fastest's index;
 * ties keep the earlier (heuristic) rank. Any failure of the timing itself (no memory for
 * the scratch C, an answer that does not run) only drops candidates: 0 at worst. */
static int lt_time(kn_ctx *ctx, const char *opname, const lt_descs *d, const kn_lt_key *key,
                   const cublasLtMatmulHeuristicResult_t *res, int n, const void *A, const void *B,
                   float beta) {
    size_t      elem = key->c_type == CUDA_R_16BF ? 2 : 4;
    size_t      bytes = (size_t)key->ldc * (size_t)key->n * elem;
    void       *tmp = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    int         best = 0;
    float       best_ms = 0.0f, first_ms = -1.0f;
    const float alpha = 1.0f;
    if (cudaMalloc(&tmp, bytes) != cudaSuccess ||
        cudaMemsetAsync(tmp, 0, bytes, ctx->stream) != cudaSuccess || cudaEventCreate(&e0) != cudaSuccess ||
        cudaEventCreate(&e1) != cudaSuccess) {
        cudaGetLastError(); /* not sticky: the plan keeps the first answer */
        goto done;
    }
    for (int i = 0; i < n; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ctx->lt_ws_bytes)
            continue;
        if (cublasLtMatmul(ctx->lt, d->op, &alpha, A, d->a, B, d->b, &beta, tmp, d->c, tmp, d->c,
                           &res[i].algo, ctx->lt_ws, ctx->lt_ws_bytes, ctx->stream) != CUBLAS_STATUS_SUCCESS)
            continue;
        cudaEventRecord(e0, ctx->stream);
        int ok = 1;
        for (int r = 0; r < LT_TUNE_RUNS && ok; r++)
            ok = cublasLtMatmul(ctx->lt, d->op, &alpha, A, d->a, B, d->b, &beta, tmp, d->c, tmp, d->c,
                                &res[i].algo, ctx->lt_ws, ctx->lt_ws_bytes,
                                ctx->stream) == CUBLAS_STATUS_SUCCESS;
        cudaEventRecord(e1, ctx->stream);
        float ms = 0.0f;
        if (!ok || cudaEventSynchronize(e1) != cudaSuccess ||
            cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        ms /= LT_TUNE_RUNS;
        if (i == 0)
            first_ms = ms;
        if (best_ms == 0.0f || ms < best_ms) {
            best_ms = ms;
            best = i;
        }
    }
    CM_LOG_INFO("gemm plan %s m=%lld n=%lld k=%lld %s: heuristic #0 %.4f ms, timed choice #%d %.4f ms of %d",
                opname, (long long)key->m, (long long)key->n, (long long)key->k, lt_type_name(key->ab_type),
                (double)first_ms, best, (double)best_ms, n);
done:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    if (tmp)
        cudaFree(tmp); /* waits for the timing runs */
    return best;
}

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h;
}

static uint32_t key_slot(const kn_lt_key *k) {
    uint64_t h = 0;
    h = mix(h, (uint64_t)k->ab_type << 32 | (uint32_t)k->c_type);
    h = mix(h, (uint64_t)k->trans_a << 1 | (uint64_t)k->trans_b);
    h = mix(h, (uint64_t)k->m);
    h = mix(h, (uint64_t)k->n);
    h = mix(h, (uint64_t)k->k);
    h = mix(h, (uint64_t)k->lda);
    h = mix(h, (uint64_t)k->ldb);
    h = mix(h, (uint64_t)k->ldc);
    h = mix(h, (uint64_t)k->al_a << 32 | (uint64_t)k->al_b << 16 | k->al_c);
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return (uint32_t)(h % KN_LT_PLANS);
}

static int key_eq(const kn_lt_key *x, const kn_lt_key *y) {
    return x->ab_type == y->ab_type && x->c_type == y->c_type && x->trans_a == y->trans_a &&
           x->trans_b == y->trans_b && x->m == y->m && x->n == y->n && x->k == y->k && x->lda == y->lda &&
           x->ldb == y->ldb && x->ldc == y->ldc && x->al_a == y->al_a && x->al_b == y->al_b &&
           x->al_c == y->al_c;
}

/* The plan of key: found, or made in the key's empty slot (A, B and beta only serve the
 * timing of a new plan). *out = NULL when the table is full. */
static cm_status lt_plan_get(kn_ctx *ctx, const char *opname, const kn_lt_key *key, const void *A,
                             const void *B, float beta, const float *a_scale, const float *b_scale,
                             kn_lt_plan **out) {
    *out = NULL;
    uint32_t    s = key_slot(key);
    kn_lt_plan *p = NULL;
    for (int i = 0; i < KN_LT_PLANS; i++, s = (s + 1) % KN_LT_PLANS) {
        kn_lt_plan *q = &ctx->lt_plans[s];
        if (!q->used) {
            p = q;
            break;
        }
        if (key_eq(&q->key, key)) {
            *out = q;
            return CM_OK;
        }
    }
    if (!p) {
        ctx->lt_plan_overflow++;
        return CM_OK;
    }
    cublasLtMatmulHeuristicResult_t res[KN_LT_TUNE_MAX];
    int                             want = ctx->lt_autotune > 1 ? ctx->lt_autotune : 1, n_found = 0;
    lt_descs                        d = {0};
    cm_status                       st = lt_descs_make(&d, key);
    if (st == CM_OK && a_scale)
        st = lt_set_scales(d.op, a_scale, b_scale);
    if (st == CM_OK)
        st = lt_heuristic(ctx, &d, key, want, res, &n_found);
    if (st == CM_OK && n_found == 0)
        st = lt_no_algo(opname, key);
    if (st != CM_OK) {
        lt_descs_release(&d);
        return st;
    }
    int pick = n_found > 1 ? lt_time(ctx, opname, &d, key, res, n_found, A, B, beta) : 0;
    p->key = *key;
    p->op = d.op;
    p->a = d.a;
    p->b = d.b;
    p->c = d.c;
    p->algo = res[pick].algo;
    p->rank = pick;
    p->used = 1;
    ctx->lt_plans_used++;
    *out = p;
    return CM_OK;
}

void kn_cuda_lt_plans_release(kn_ctx *ctx) {
    if (!ctx)
        return;
    for (int i = 0; i < KN_LT_PLANS; i++) {
        kn_lt_plan *p = &ctx->lt_plans[i];
        if (!p->used)
            continue;
        lt_descs d = {p->op, p->a, p->b, p->c};
        lt_descs_release(&d);
        memset(p, 0, sizeof *p);
    }
    ctx->lt_plans_used = 0;
}

/* a_scale and b_scale: the block scales of FP8 operands (ab_type CUDA_R_8F_E4M3), else NULL. */
static cm_status lt_run(kn_ctx *ctx, const char *opname, cudaDataType_t ab_type, int trans_a, int trans_b,
                        int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                        int64_t ldb, float beta, void *C, cudaDataType_t c_type, int64_t ldc,
                        const float *a_scale, const float *b_scale) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", opname);
    kn_lt_key key;
    memset(&key, 0, sizeof key);
    key.ab_type = (int32_t)ab_type;
    key.c_type = (int32_t)c_type;
    key.trans_a = trans_a != 0;
    key.trans_b = trans_b != 0;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.al_a = ptr_align(A);
    key.al_b = ptr_align(B);
    key.al_c = ptr_align(C);
    const float alpha = 1.0f;
    if (ctx->lt_plan_mode == 1) {
        kn_lt_plan *p;
        CM_TRY(lt_plan_get(ctx, opname, &key, A, B, beta, a_scale, b_scale, &p));
        if (p) {
            if (a_scale)
                CM_TRY(lt_set_scales(p->op, a_scale, b_scale));
            KN_CUBLAS(cublasLtMatmul(ctx->lt, p->op, &alpha, A, p->a, B, p->b, &beta, C, p->c, C, p->c,
                                     &p->algo, ctx->lt_ws, ctx->lt_ws_bytes, ctx->stream));
            KN_CUDA_LAUNCHED(ctx);
            return CM_OK;
        }
    }
    /* per call: TANDEM_GEMM_PLAN=0, or the table is full */
    cublasLtMatmulHeuristicResult_t heur;
    int                             n_found = 0;
    lt_descs                        d = {0};
    cm_status                       st = lt_descs_make(&d, &key);
    if (st == CM_OK && a_scale)
        st = lt_set_scales(d.op, a_scale, b_scale);
    if (st == CM_OK)
        st = lt_heuristic(ctx, &d, &key, 1, &heur, &n_found);
    if (st == CM_OK && n_found == 0)
        st = lt_no_algo(opname, &key);
    if (st == CM_OK) {
        cublasStatus_t s = cublasLtMatmul(ctx->lt, d.op, &alpha, A, d.a, B, d.b, &beta, C, d.c, C, d.c,
                                          &heur.algo, ctx->lt_ws, ctx->lt_ws_bytes, ctx->stream);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = CM_FAIL(CM_ERR_CUBLAS, "%s: cublasLtMatmul failed: %s (%s)", opname,
                         cublasLtGetStatusString(s), cublasLtGetStatusName(s));
    }
    lt_descs_release(&d);
    if (st == CM_OK)
        KN_CUDA_LAUNCHED(ctx);
    return st;
}

cm_status kn_cuda_lt_matmul(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                            int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                            int64_t ldb, float beta, float *C, int64_t ldc) {
    return lt_run(ctx, op, ab_type, trans_a, trans_b, m, n, k, A, lda, B, ldb, beta, C, CUDA_R_32F, ldc, NULL,
                  NULL);
}

cm_status kn_cuda_lt_matmul_ct(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                               int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                               int64_t ldb, float beta, void *C, cudaDataType_t c_type, int64_t ldc) {
    return lt_run(ctx, op, ab_type, trans_a, trans_b, m, n, k, A, lda, B, ldb, beta, C, c_type, ldc, NULL, NULL);
}

cm_status kn_cuda_lt_matmul_fp8(kn_ctx *ctx, const char *op, int64_t m, int64_t n, int64_t k, const void *A,
                                const float *a_scale, const void *B, const float *b_scale, float beta, void *C,
                                cudaDataType_t c_type, int64_t ldc) {
    return lt_run(ctx, op, CUDA_R_8F_E4M3, 1, 0, m, n, k, A, k, B, k, beta, C, c_type, ldc, a_scale, b_scale);
}
