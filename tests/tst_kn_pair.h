/* tests/tst_kn_pair.h — the cuda backend against the cpu reference, through the kn_backend
 * tables: the two backends and their contexts (cctx on cpu; on cuda gctx in F32 GEMM mode and
 * gctx16 in BF16 GEMM mode), opened with a skip (exit 77) where there is no cuda backend or
 * device, a further context with a run-time switch set, and host arrays mirrored on both
 * backends. Header-only; include once, after tst_kn.h. */
#ifndef TST_KN_PAIR_H
#define TST_KN_PAIR_H

#include <stdio.h>
#include <stdlib.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_cuda.h"

static const kn_backend *cpu, *gpu;
static kn_ctx           *cctx;   /* cpu */
static kn_ctx           *gctx;   /* cuda, KN_GEMM_MODE_F32 */
static kn_ctx           *gctx16; /* cuda, KN_GEMM_MODE_BF16 */

/* Sets cpu and gpu and creates the three contexts. Exits 77 without a cuda backend or device
 * and 1 when the cuda context fails otherwise; 0 after a failed check (the bf16-mode or cpu
 * context), 1 when all are open. */
static inline int tst_pair_open(void) {
    cpu = kn_backend_cpu();
    gpu = kn_backend_cuda();
    if (!gpu)
        TST_SKIP("this build has no cuda backend");
    kn_ctx_config cfg = {0, KN_GEMM_MODE_F32};
    cm_status     st = gpu->ctx_create(&gctx, &cfg);
    if (st == CM_ERR_UNSUPPORTED)
        TST_SKIP("%s", cm_last_error());
    if (st != CM_OK) {
        fprintf(stderr, "cuda ctx_create failed: %s: %s\n", cm_status_str(st), cm_last_error());
        exit(1);
    }
    cfg.gemm_mode = KN_GEMM_MODE_BF16;
    return tst_ok(gpu->ctx_create(&gctx16, &cfg), "cuda ctx_create (bf16 gemm mode)") &&
           tst_ok(cpu->ctx_create(&cctx, NULL), "cpu ctx_create");
}

/* A second cuda context in bf16 GEMM mode made with the run-time switch var=val (kn_cuda.h: read at
 * ctx_create, unset again after), to run a kernel the dispatch would not pick beside gctx16.
 * Returns tst_ok's verdict; *out is NULL on failure. */
static inline int tst_gpu_ctx_env(kn_ctx **out, const char *var, const char *val) {
    kn_ctx_config c16 = {0, KN_GEMM_MODE_BF16};
    char          what[96];
    snprintf(what, sizeof what, "cuda ctx_create (%s=%s)", var, val);
    setenv(var, val, 1);
    const int made = tst_ok(gpu->ctx_create(out, &c16), what);
    unsetenv(var);
    return made;
}

static inline void tst_pair_close(void) {
    cpu->ctx_destroy(&cctx);
    gpu->ctx_destroy(&gctx16);
    gpu->ctx_destroy(&gctx);
}

/* One host array mirrored on both backends. */
typedef struct dbuf {
    void  *c, *g;
    size_t bytes;
} dbuf;

/* bytes on both backends, a copy of host (or zeros when host is NULL); exits 1 on failure. */
static inline dbuf dbuf_put(const void *host, size_t bytes) {
    dbuf b = {NULL, NULL, bytes};
    if (cpu->alloc(cctx, &b.c, bytes) != CM_OK || gpu->alloc(gctx, &b.g, bytes) != CM_OK) {
        fprintf(stderr, "alloc of %zu bytes failed: %s\n", bytes, cm_last_error());
        exit(1);
    }
    if (host &&
        (cpu->upload(cctx, b.c, host, bytes) != CM_OK || gpu->upload(gctx, b.g, host, bytes) != CM_OK)) {
        fprintf(stderr, "upload of %zu bytes failed: %s\n", bytes, cm_last_error());
        exit(1);
    }
    /* the zero fill is ordered on gctx's stream; gctx16 uses these buffers too */
    if (gpu->sync(gctx) != CM_OK) {
        fprintf(stderr, "sync failed: %s\n", cm_last_error());
        exit(1);
    }
    return b;
}

static inline void dbuf_free(dbuf *b) {
    cpu->free(cctx, b->c);
    gpu->free(gctx, b->g);
    b->c = b->g = NULL;
}

#endif /* TST_KN_PAIR_H */
