/* kernels/ref/kn_memory_ref.c — the cpu backend's context and memory: the kn_ctx is a small
 * heap struct holding the config, memory is host memory (64-byte aligned, zero-filled),
 * upload and download are plain copies and sync has nothing to wait for. Also copy2d and
 * the packed-sequence check shared by the ops that mix tokens. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

#define KN_REF_ALIGN 64

struct kn_ctx {
    kn_ctx_config cfg;
};

cm_status kn_ref_ctx_create(kn_ctx **out, const kn_ctx_config *cfg) {
    KN_REF_CHECK(out, "ctx_create: out is NULL");
    *out = NULL;

    kn_ctx_config c = KN_CTX_CONFIG_DEFAULT;
    if (cfg) c = *cfg;
    KN_REF_CHECK(c.gemm_mode == KN_GEMM_MODE_BF16 || c.gemm_mode == KN_GEMM_MODE_F32,
                 "ctx_create: unknown gemm_mode %d (use KN_GEMM_MODE_BF16 or KN_GEMM_MODE_F32)",
                 (int)c.gemm_mode);
    kn_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a cpu kernel context");
    ctx->cfg = c;

    *out = ctx;
    return CM_OK;
}

void kn_ref_ctx_destroy(kn_ctx **ctx) {
    if (!ctx || !*ctx) return;
    free(*ctx);
    *ctx = NULL;
}

cm_status kn_ref_alloc(kn_ctx *ctx, void **out, size_t bytes) {
    KN_REF_CHECK(ctx && out, "alloc: ctx or out is NULL");
    *out = NULL;

    size_t rounded = (bytes + KN_REF_ALIGN - 1) / KN_REF_ALIGN * KN_REF_ALIGN;
    if (rounded < bytes) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes: size overflows", bytes);
    if (rounded == 0) rounded = KN_REF_ALIGN;
    void *p = aligned_alloc(KN_REF_ALIGN, rounded);
    if (!p) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes of host memory", bytes);
    memset(p, 0, rounded);
    *out = p;
    return CM_OK;
}

void kn_ref_free(kn_ctx *ctx, void *p) {
    (void)ctx;
    free(p);
}

/* memmove, not memcpy: on the cpu backend host and "device" memory are the same, so a
 * caller may legitimately pass overlapping or identical ranges. */
cm_status kn_ref_upload(kn_ctx *ctx, void *dst, const void *host_src, size_t bytes) {
    KN_REF_CHECK(ctx, "upload: ctx is NULL");
    if (bytes == 0) return CM_OK;
    KN_REF_CHECK(dst && host_src, "upload: NULL pointer for %zu bytes", bytes);
    memmove(dst, host_src, bytes);
    return CM_OK;
}

cm_status kn_ref_zero(kn_ctx *ctx, void *p, size_t bytes) {
    KN_REF_CHECK(ctx, "zero: ctx is NULL");
    if (bytes == 0) return CM_OK;
    KN_REF_CHECK(p, "zero: NULL pointer for %zu bytes", bytes);
    memset(p, 0, bytes);
    return CM_OK;
}

cm_status kn_ref_download(kn_ctx *ctx, void *host_dst, const void *src, size_t bytes) {
    KN_REF_CHECK(ctx, "download: ctx is NULL");
    if (bytes == 0) return CM_OK;
    KN_REF_CHECK(host_dst && src, "download: NULL pointer for %zu bytes", bytes);
    memmove(host_dst, src, bytes);
    return CM_OK;
}

cm_status kn_ref_copy_peer(kn_ctx *ctx, kn_ctx *dst_ctx, void *dst, const void *src, size_t bytes) {
    KN_REF_CHECK(ctx && dst_ctx, "copy_peer: ctx or dst_ctx is NULL");
    if (bytes == 0) return CM_OK;
    KN_REF_CHECK(dst && src, "copy_peer: NULL pointer for %zu bytes", bytes);
    memmove(dst, src, bytes);
    return CM_OK;
}

cm_status kn_ref_sync(kn_ctx *ctx) {
    KN_REF_CHECK(ctx, "sync: ctx is NULL");
    return CM_OK;
}

cm_status kn_ref_copy2d(kn_ctx *ctx, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                        int64_t rows, int64_t cols) {
    KN_REF_CHECK(ctx, "copy2d: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && cols >= 0, "copy2d: bad shape rows=%lld cols=%lld (must be >= 0)",
                 (long long)rows, (long long)cols);
    KN_REF_CHECK(dst_ld >= cols && src_ld >= cols,
                 "copy2d: leading dimensions dst_ld=%lld src_ld=%lld must be >= cols=%lld", (long long)dst_ld,
                 (long long)src_ld, (long long)cols);
    if (rows == 0 || cols == 0) return CM_OK;
    KN_REF_CHECK(dst && src, "copy2d: dst or src is NULL");
    for (int64_t r = 0; r < rows; r++)
        memmove(dst + r * dst_ld, src + r * src_ld, (size_t)cols * sizeof(float));
    return CM_OK;
}

cm_status kn_ref_seqlens_check(const char *op, const int32_t *cu_seqlens, int n_seq, int64_t T) {
    KN_REF_CHECK(cu_seqlens, "%s: cu_seqlens is NULL", op);
    KN_REF_CHECK(n_seq >= 0, "%s: n_seq=%d must be >= 0", op, n_seq);
    KN_REF_CHECK(cu_seqlens[0] == 0, "%s: cu_seqlens[0]=%d must be 0", op, (int)cu_seqlens[0]);
    for (int s = 0; s < n_seq; s++)
        KN_REF_CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], "%s: cu_seqlens decreases at %d (%d then %d)", op,
                     s + 1, (int)cu_seqlens[s], (int)cu_seqlens[s + 1]);
    KN_REF_CHECK(cu_seqlens[n_seq] == T, "%s: cu_seqlens[%d]=%d must equal T=%lld", op, n_seq,
                 (int)cu_seqlens[n_seq], (long long)T);
    return CM_OK;
}
