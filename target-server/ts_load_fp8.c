/* target-server/ts_load_fp8.c — the FP8 part of loading a target (docs/fp8.md): Qwen's
 * fine-grained FP8 checkpoints, whose projections are F8_E4M3 [N, K] with a
 * <name>_scale_inv [ceil(N/128), ceil(K/128)] (F32, BF16 or F16) beside each. A matrix is FP8
 * exactly when it is F8_E4M3 and has that scale; the config's list of unconverted modules is
 * only a cross-check (loaders that trusted a prefix match of that list read FP8 bytes as bf16).
 *
 * Under fp8 (ts_model_config.fp8) FP8 matrices are uploaded as stored, the scales widened to
 * fp32 in rows of kn_fp8_scale_ld(K) (padding 0), and the projections stored BF16 or F32 are
 * quantized on the device (fp8_quantize_weight). Without it FP8 matrices are dequantized on the
 * host, w = f32(q) · scale, to BF16 or F32. Every refusal is one message naming the tensor, its
 * file and what to do. Runs on the loading thread, as ts_model.c. */
#include "ts_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

#define FP8_DOC    "docs/fp8.md"
#define FP8_SUFFIX "_scale_inv"

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Bytes of a [rows, cols] FP8 weight's scale table as the backend keeps it (kn_backend.h). */
static size_t scale_table_bytes(int64_t rows, int64_t cols) {
    return (size_t)cdiv(rows, KN_FP8_BLOCK) * (size_t)kn_fp8_scale_ld(cols) * sizeof(float);
}

void ts_mat_free(ts_model *m, ts_mat *w) {
    m->be->free(m->ctx, w->data);
    m->be->free(m->ctx, w->scale);
    memset(w, 0, sizeof *w);
}

cm_status ts_fp8_check_backend(const ts_model *m) {
    const kn_backend *be = m->be;
    char              why[256] = "";
    if (!be->gemm_fp8 || !be->fp8_quantize_weight || !be->fp8_supported)
        snprintf(why, sizeof why, "the %s backend has no FP8 GEMM", be->name);
    else if (!be->fp8_supported(m->ctx, why, sizeof why) && !why[0])
        snprintf(why, sizeof why, "the %s backend cannot run FP8 GEMMs on this device", be->name);
    if (!why[0]) return CM_OK;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "--precision fp8: %s; use --precision bf16 to run the checkpoint dequantized to "
                                       "bf16",
                   why);
}

// ----------------------------------------------------------------------------
// the checkpoint's FP8 tensors, before anything is loaded

/* 1 when the load reads tensor name (under prefix: the embedding, the final norm, layers below
 * n_layers; lm_head with load_head). mtp.* and model.visual.* are never read. */
static int loaded_name(const char *name, const char *prefix, int n_layers, int load_head) {
    if (strncmp(name, "lm_head.", 8) == 0) return load_head;
    const size_t pl = strlen(prefix);
    if (strncmp(name, prefix, pl) != 0) return 0;
    const char *r = name + pl;
    if (strncmp(r, "embed_tokens.", 13) == 0 || strncmp(r, "norm.", 5) == 0) return 1;
    if (strncmp(r, "layers.", 7) != 0) return 0;
    char *end;
    long  i = strtol(r + 7, &end, 10);
    return end != r + 7 && *end == '.' && i >= 0 && i < n_layers;
}

static int has_suffix(const char *s, const char *suf) {
    size_t n = strlen(s), k = strlen(suf);
    return n > k && strcmp(s + n - k, suf) == 0;
}

/* The tensors Tandem reads as bf16/f32 tables or vectors, never through an FP8 GEMM. */
static int table_name(const char *name) {
    static const char *const suffixes[] = {"embed_tokens.weight", "lm_head.weight", "norm.weight", "conv1d.weight",
                                           "A_log", "dt_bias"};
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++)
        if (strcmp(name, suffixes[i]) == 0 || (has_suffix(name, suffixes[i]) &&
                                               name[strlen(name) - strlen(suffixes[i]) - 1] == '.'))
            return 1;
    return 0;
}

cm_status ts_fp8_scan(const ts_loader *ld, int n_layers, int load_head) {
    const cm_st *st = ld->st;
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (!loaded_name(t->name, ld->prefix, n_layers, load_head)) continue;
        char other[300];
        if (has_suffix(t->name, FP8_SUFFIX)) {
            snprintf(other, sizeof other, "%.*s", (int)(strlen(t->name) - strlen(FP8_SUFFIX)), t->name);
            const cm_st_tensor *w = cm_st_find(st, other);
            if (!w)
                return CM_FAIL(CM_ERR_FORMAT,
                               "tensor '%s' in '%s' is a block scale without its weight '%s': the checkpoint is "
                               "incomplete; download it again or use the model's bf16 release",
                               t->name, t->file, other);
            if (w->dtype != CM_DTYPE_F8_E4M3)
                return CM_FAIL(CM_ERR_FORMAT,
                               "tensor '%s' in '%s' scales '%s', which is stored %s, not F8_E4M3: block scales belong "
                               "to FP8 weights; the checkpoint mixes formats, use the model's bf16 or FP8 release "
                               "as published",
                               t->name, t->file, other, cm_dtype_name(w->dtype));
            continue;
        }
        if (t->dtype != CM_DTYPE_F8_E4M3) continue;
        if (table_name(t->name)) return ts_fp8_refuse_table(t);
        snprintf(other, sizeof other, "%s%s", t->name, FP8_SUFFIX);
        if (!cm_st_find(st, other))
            return CM_FAIL(CM_ERR_FORMAT,
                           "tensor '%s' in '%s' is F8_E4M3 but has no block scales '%s': Tandem reads fine-grained "
                           "FP8 (128 x 128 blocks, " FP8_DOC "), not per-tensor FP8; use the model's bf16 release or "
                           "its fine-grained FP8 one",
                           t->name, t->file, other);
        const char *pattern = cm_quant_cfg_skips(ld->quant, t->name);
        if (pattern)
            return CM_FAIL(CM_ERR_FORMAT,
                           "tensor '%s' in '%s' is stored F8_E4M3, but quantization_config in '%s/config.json' lists "
                           "'%s' among the modules not converted: the config and the weights disagree; fix the list "
                           "(modules_to_not_convert) or use the model's release as published",
                           t->name, t->file, ld->dir, pattern);
    }
    return CM_OK;
}

cm_status ts_fp8_refuse_table(const cm_st_tensor *t) {
    if (t->dtype != CM_DTYPE_F8_E4M3) return CM_OK;
    return CM_FAIL(CM_ERR_UNSUPPORTED,
                   "tensor '%s' in '%s' is stored F8_E4M3, but Tandem reads it in bf16 or f32 (the embedding, "
                   "lm_head, norms, conv1d, A_log and dt_bias are never FP8 in Qwen's releases): not supported; use "
                   "a checkpoint that keeps it bf16",
                   t->name, t->file);
}

// ----------------------------------------------------------------------------
// loading one FP8 matrix

/* The FP8 GEMM quantizes its input in 1 × 128 groups along K; the cuda kernels want K a multiple
 * of 16 (cuBLASLt's FP8 alignment; every Qwen shape is a multiple of 128), the cpu reference takes
 * any K. */
static cm_status check_k(const kn_backend *be, const char *name, int64_t rows, int64_t cols) {
    if (cols % 16 == 0 || be == kn_backend_cpu()) return CM_OK;
    return CM_FAIL(CM_ERR_UNSUPPORTED,
                   "cannot run '%s' [%lld, %lld] as an FP8 GEMM on %s: its input width %lld is not a multiple of 16 "
                   "(the FP8 kernels' alignment); use --precision bf16",
                   name, (long long)rows, (long long)cols, be->name, (long long)cols);
}

/* The scale table as fp32 rows of kn_fp8_scale_ld(cols) (padding 0), from s [ceil(rows/128),
 * ceil(cols/128)] in its stored dtype. */
static cm_status read_scales(const char *name, const cm_st_tensor *s, int64_t rows, int64_t cols, float **out) {
    const int64_t R = cdiv(rows, KN_FP8_BLOCK), L = cdiv(cols, KN_FP8_BLOCK), ld = kn_fp8_scale_ld(cols);
    *out = NULL;
    if (s->n_dims != 2 || s->shape[0] != R || s->shape[1] != L) {
        char got[64];
        cm_shape_str(got, sizeof got, s->n_dims, s->shape);
        return CM_FAIL(CM_ERR_FORMAT,
                       "tensor '%s' in '%s' has shape %s, but the FP8 weight '%s' [%lld, %lld] needs one scale per "
                       "128 x 128 block: [%lld, %lld]; the checkpoint is not fine-grained FP8 as Tandem reads it "
                       "(" FP8_DOC "); use the model's bf16 release",
                       s->name, s->file, got, name, (long long)rows, (long long)cols, (long long)R, (long long)L);
    }
    if (s->dtype != CM_DTYPE_F32 && s->dtype != CM_DTYPE_BF16 && s->dtype != CM_DTYPE_F16)
        return CM_FAIL(CM_ERR_FORMAT,
                       "tensor '%s' in '%s' has dtype %s; block scales are F32, BF16 or F16: the checkpoint is not "
                       "fine-grained FP8 as Tandem reads it (" FP8_DOC ")",
                       s->name, s->file, cm_dtype_name(s->dtype));
    float *raw = malloc((size_t)(R * L) * sizeof *raw), *tab = calloc((size_t)(R * ld), sizeof *tab);
    if (!raw || !tab) {
        free(raw);
        free(tab);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the scales of '%s'", name);
    }
    cm_status st = cm_convert(raw, CM_DTYPE_F32, s->data, s->dtype, (size_t)(R * L)); /* data may be unaligned */
    for (int64_t r = 0; st == CM_OK && r < R; r++) memcpy(tab + r * ld, raw + r * L, (size_t)L * sizeof *tab);
    free(raw);
    if (st != CM_OK) {
        free(tab);
        return st;
    }
    *out = tab;
    return CM_OK;
}

/* w = f32(q) · scale per 128 × 128 block, as dt (BF16 or F32) into host [rows, cols]. */
static void dequantize(void *host, cm_dtype dt, const uint8_t *q, const float *tab, int64_t rows, int64_t cols) {
    const int64_t ld = kn_fp8_scale_ld(cols);
    for (int64_t n = 0; n < rows; n++)
        for (int64_t k = 0; k < cols; k++) {
            const float v = cm_f8e4m3_to_f32(q[n * cols + k]) * tab[(n / KN_FP8_BLOCK) * ld + k / KN_FP8_BLOCK];
            if (dt == CM_DTYPE_BF16)
                ((uint16_t *)host)[n * cols + k] = cm_f32_to_bf16(v);
            else
                ((float *)host)[n * cols + k] = v;
        }
}

/* t and s pair up as a fine-grained FP8 weight [rows, cols]; its scale table (read_scales) in *tab. */
static cm_status read_stored(ts_loader *ld, const char *name, const cm_st_tensor *t, const cm_st_tensor *s,
                             int64_t rows, int64_t cols, float **tab) {
    if (!s || t->dtype != CM_DTYPE_F8_E4M3) /* ts_fp8_scan says which; this keeps the load safe alone */
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' in '%s' (%s) and its block scales '%s%s' do not pair up: the "
                                      "checkpoint is not fine-grained FP8 (" FP8_DOC ")",
                       name, t->file, cm_dtype_name(t->dtype), name, FP8_SUFFIX);
    if (ld->fp8) CM_TRY(check_k(ld->m->be, name, rows, cols));
    return read_scales(name, s, rows, cols, tab);
}

/* q [rows, cols] e4m3 with its scale table onto the device: kept FP8 at fp8, else dequantized. */
static cm_status put(ts_loader *ld, const char *name, const uint8_t *q, const float *tab, int64_t rows, int64_t cols,
                     ts_mat *out) {
    ts_model    *m = ld->m;
    const size_t n = (size_t)rows * (size_t)cols;
    cm_status    st;
    if (ld->fp8) {
        const size_t tab_bytes = scale_table_bytes(rows, cols);
        st = m->be->alloc(m->ctx, &out->data, n);
        if (st == CM_OK) st = m->be->upload(m->ctx, out->data, q, n);
        if (st == CM_OK) st = m->be->alloc(m->ctx, (void **)&out->scale, tab_bytes);
        if (st == CM_OK) st = m->be->upload(m->ctx, out->scale, tab, tab_bytes);
        out->dtype = CM_DTYPE_F8_E4M3;
        ld->n_fp8_stored += st == CM_OK;
        return st;
    }
    const cm_dtype dt   = ld->bf16_weights ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    void          *host = malloc(n * cm_dtype_size(dt));
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes to dequantize '%s'", n * cm_dtype_size(dt), name);
    dequantize(host, dt, q, tab, rows, cols);
    st = m->be->alloc(m->ctx, &out->data, n * cm_dtype_size(dt));
    if (st == CM_OK) st = m->be->upload(m->ctx, out->data, host, n * cm_dtype_size(dt));
    free(host);
    out->dtype = dt;
    ld->n_fp8_dequantized += st == CM_OK;
    return st;
}

cm_status ts_fp8_load_stored(ts_loader *ld, const char *name, const cm_st_tensor *t, const cm_st_tensor *s,
                             int64_t rows, int64_t cols, ts_mat_role role, ts_mat *out) {
    (void)role; /* every role but TABLE (refused before) may be stored FP8 */
    float *tab = NULL;
    CM_TRY(read_stored(ld, name, t, s, rows, cols, &tab));
    const cm_status st = put(ld, name, t->data, tab, rows, cols, out);
    free(tab);
    return st;
}

cm_status ts_fp8_load_rows(ts_loader *ld, const char *name, const cm_st_tensor *t, const cm_st_tensor *s,
                           int64_t rows, int64_t cols, const int64_t *map, int n_pieces, const int64_t *piece_rows,
                           ts_mat *const *out) {
    float *tab = NULL;
    CM_TRY(read_stored(ld, name, t, s, rows, cols, &tab));
    const int64_t  B = KN_FP8_BLOCK, ldc = kn_fp8_scale_ld(cols);
    const uint8_t *src = t->data;
    cm_status      st  = CM_OK;
    for (int p = 0, off = 0; p < n_pieces && st == CM_OK; off += (int)piece_rows[p], p++) {
        const int64_t  n = piece_rows[p], *m = map + off;
        uint8_t       *q  = malloc((size_t)(n * cols) + 1);
        float         *pt = calloc((size_t)(cdiv(n, B) * ldc) + 1, sizeof *pt);
        if (!q || !pt) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the un-interleaved rows of '%s'", name);
        for (int64_t j = 0; j < n && st == CM_OK; j++) {
            if (m[j] / B != m[j - j % B] / B) /* the destination block's first row's source block */
                st = CM_FAIL(CM_ERR_UNSUPPORTED,
                             "tensor '%s' in '%s' is stored FP8, and un-interleaving its rows would put rows %lld "
                             "and %lld, of different 128-row scale blocks, into one block; Tandem keeps stored FP8 "
                             "values and scales as they are, so it cannot load this layout: use the bf16 checkpoint",
                             name, t->file, (long long)m[j - j % B], (long long)m[j]);
            else
                memcpy(q + j * cols, src + m[j] * cols, (size_t)cols);
            if (st == CM_OK && j % B == 0) memcpy(pt + (j / B) * ldc, tab + (m[j] / B) * ldc, (size_t)ldc * sizeof *pt);
        }
        if (st == CM_OK) st = put(ld, name, q, pt, n, cols, out[p]);
        free(q);
        free(pt);
    }
    free(tab);
    return st;
}

cm_status ts_fp8_quantize(ts_loader *ld, const char *name, int64_t rows, int64_t cols, ts_mat *w) {
    ts_model *m = ld->m;
    CM_TRY(check_k(ld->m->be, name, rows, cols));
    const size_t tab_bytes = scale_table_bytes(rows, cols);
    uint8_t     *q         = NULL;
    float       *tab       = NULL;
    cm_status    st        = m->be->alloc(m->ctx, (void **)&q, (size_t)rows * (size_t)cols);
    if (st == CM_OK) st = m->be->alloc(m->ctx, (void **)&tab, tab_bytes);
    if (st == CM_OK) st = m->be->fp8_quantize_weight(m->ctx, q, tab, w->data, w->dtype, rows, cols);
    if (st == CM_OK) st = m->be->sync(m->ctx); /* the source is freed next */
    if (st != CM_OK) {
        m->be->free(m->ctx, q);
        m->be->free(m->ctx, tab);
        return st;
    }
    m->be->free(m->ctx, w->data);
    w->data  = q;
    w->scale = tab;
    w->dtype = CM_DTYPE_F8_E4M3;
    ld->n_fp8_quantized++;
    return CM_OK;
}
