/* common/format/cm_compress.c — the tensor encodings of cm_compress.h over a worker pool (cm_pool.h).
 * A job is "do item i for i in [0, n)" (an item is a chunk); workers, the caller among them,
 * take items from an atomic counter, so the split of work varies from run to run but each
 * chunk's bytes do not. Encoding compresses chunk i into its own worst-case slot of dst, then
 * the caller packs the slots down in order (one memmove pass) and writes the chunk table.
 * Decoding checks the whole table first, then each worker decodes its chunks straight into
 * their place in dst. Workers report failures into their own message buffer (cm_last_error
 * is per thread); the caller re-raises the first one. */
#include "cm_compress.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <zstd.h>

#include "cm_bytes.h"
#include "cm_pool.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cm_compress assumes a little-endian host (streams are little-endian and bytes are split as stored)"
#endif

#define STORED_BIT    0x80000000u
#define FP8_MAX_ABS   18446744073709551616.0f /* 2^64: largest magnitude fp8-zstd encodes */
#define FP8_MAX_SCALE 72057594037927936.0f    /* 2^56: largest scale a decoder accepts */

typedef struct worker worker;
typedef cm_status (*item_fn)(cm_compress *c, worker *w, int64_t i);

struct worker {
    ZSTD_CCtx *cctx;
    ZSTD_DCtx *dctx;
    uint8_t   *scratch; /* a chunk's planes or fp8 bytes */
    size_t     scratch_cap;
    char       err[768]; /* this worker's failure in the current job */
};

/* Where everything of one stream lies. */
typedef struct layout {
    cm_encoding enc;
    cm_dtype    dt;
    size_t      esize;     /* bytes per element */
    int         transform; /* byteplane rotation */
    uint64_t    n_elems, n_rows, row_len;
    uint64_t    chunk_elems, n_chunks;
    size_t      chunk_in;   /* zstd input bytes of a full chunk */
    size_t      scales_off; /* = CM_COMPRESS_HEAD_SIZE + 4·n_chunks */
    size_t      chunks_off; /* scales_off + (fp8 ? 4·n_rows : 0) */
    size_t      slot;       /* encode: worst-case bytes of one chunk */
} layout;

struct cm_compress {
    cm_compress_config cfg;
    worker            *w; /* [n_workers]: worker k's contexts and scratch */
    int                n_workers;
    cm_pool           *pool;
    /* the current job */
    item_fn        fn;
    const layout  *lay;
    const uint8_t *src;
    uint8_t       *dst;
    /* per-chunk sizes (encode) or stream offsets (decode), grown to the most chunks seen */
    int       tuned; /* whether the CCtxs hold the tuned parameters now */
    uint32_t *sizes;
    uint64_t *offs;
    size_t    chunks_cap;
    float     fp8_lut[256];
};

static cm_status wfail(worker *w, cm_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static cm_status wfail(worker *w, cm_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err, sizeof w->err, fmt, ap);
    va_end(ap);
    return st;
}

// ----------------------------------------------------------------------------
// jobs on the worker pool (cm_pool)

static cm_status run_item(void *ctx, int k, int64_t i) {
    cm_compress *c = ctx;
    return c->fn(c, &c->w[k], i);
}

/* Runs fn over n items on every worker and returns the failure of the lowest item seen. */
static cm_status run_job(cm_compress *c, item_fn fn, int64_t n) {
    int bad = 0;
    c->fn = fn;
    cm_status st = cm_pool_run(c->pool, run_item, c, n, &bad);
    return st != CM_OK ? CM_FAIL(st, "%s", c->w[bad].err) : CM_OK;
}

void cm_compress_destroy(cm_compress **cp) {
    if (!cp || !*cp)
        return;
    cm_compress *c = *cp;
    cm_pool_destroy(&c->pool);
    for (int k = 0; c->w && k < c->n_workers; k++) {
        worker *w = &c->w[k];
        ZSTD_freeCCtx(w->cctx);
        ZSTD_freeDCtx(w->dctx);
        free(w->scratch);
    }
    free(c->w);
    free(c->sizes);
    free(c->offs);
    free(c);
    *cp = NULL;
}

/* Sets a worker's compression parameters: the level, frame checksums and content sizes, and
 * with tuned the entropy-first match parameters (see cm_compress_config.tune). */
static cm_status set_params(cm_compress *c, worker *w, int tuned) {
    static const struct {
        ZSTD_cParameter p;
        const char     *name;
    } names[] = {{ZSTD_c_compressionLevel, "level"},
                 {ZSTD_c_checksumFlag, "checksumFlag"},
                 {ZSTD_c_contentSizeFlag, "contentSizeFlag"},
                 {ZSTD_c_hashLog, "hashLog"},
                 {ZSTD_c_minMatch, "minMatch"}};
    int    values[] = {c->cfg.level, 1, 1, 6, 7};
    size_t r = ZSTD_CCtx_reset(w->cctx, ZSTD_reset_parameters);
    for (int k = 0; !ZSTD_isError(r) && k < (tuned ? 5 : 3); k++) {
        r = ZSTD_CCtx_setParameter(w->cctx, names[k].p, values[k]);
        if (ZSTD_isError(r))
            return CM_FAIL(CM_ERR_ZSTD, "zstd: cannot set %s to %d: %s", names[k].name, values[k],
                           ZSTD_getErrorName(r));
    }
    if (ZSTD_isError(r))
        return CM_FAIL(CM_ERR_ZSTD, "zstd: cannot reset parameters: %s", ZSTD_getErrorName(r));
    return CM_OK;
}

cm_status cm_compress_create(cm_compress **out, const cm_compress_config *cfg) {
    cm_status    st = CM_OK;
    cm_compress *c = NULL;
    *out = NULL;
    if (cfg->n_threads < 1 || cfg->n_threads > CM_COMPRESS_MAX_THREADS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: n_threads %d must be in [1, %d]", cfg->n_threads,
                       CM_COMPRESS_MAX_THREADS);
    if (cfg->level < ZSTD_minCLevel() || cfg->level > ZSTD_maxCLevel())
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: zstd level %d must be in [%d, %d]", cfg->level,
                       ZSTD_minCLevel(), ZSTD_maxCLevel());
    if (cfg->chunk_bytes < 4096 || cfg->chunk_bytes > CM_COMPRESS_MAX_CHUNK_BYTES)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: chunk_bytes %zu must be in [4096, %u]",
                       cfg->chunk_bytes, CM_COMPRESS_MAX_CHUNK_BYTES);
    if (cfg->rotate != 0 && cfg->rotate != 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: rotate %d must be 0 or 1", cfg->rotate);
    if (cfg->tune != 0 && cfg->tune != 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: tune %d must be 0 or 1", cfg->tune);
    c = calloc(1, sizeof *c);
    if (!c)
        return CM_FAIL(CM_ERR_NOMEM, "compress: out of memory");
    c->cfg = *cfg;
    c->n_workers = cfg->n_threads;
    for (int b = 0; b < 256; b++)
        c->fp8_lut[b] = cm_f8e4m3_to_f32((uint8_t)b);
    c->w = calloc((size_t)c->n_workers, sizeof *c->w);
    if (!c->w) {
        st = CM_FAIL(CM_ERR_NOMEM, "compress: out of memory");
        goto fail;
    }
    for (int k = 0; k < c->n_workers; k++) {
        worker *w = &c->w[k];
        w->cctx = ZSTD_createCCtx();
        w->dctx = ZSTD_createDCtx();
        if (!w->cctx || !w->dctx) {
            st = CM_FAIL(CM_ERR_ZSTD, "zstd: cannot create a compression context (out of memory)");
            goto fail;
        }
        CM_TRY_GOTO(set_params(c, w, 0), st, fail);
    }
    CM_TRY_GOTO(cm_pool_create(&c->pool, c->n_workers, "compress"), st, fail);
    *out = c;
    return CM_OK;
fail:
    cm_compress_destroy(&c);
    return st;
}

static cm_status ensure_scratch(cm_compress *c, size_t bytes) {
    for (int k = 0; k < c->n_workers; k++) {
        worker *w = &c->w[k];
        if (w->scratch_cap >= bytes)
            continue;
        uint8_t *p = realloc(w->scratch, bytes);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "compress: cannot allocate %zu bytes of scratch", bytes);
        w->scratch = p;
        w->scratch_cap = bytes;
    }
    return CM_OK;
}

static cm_status ensure_chunks(cm_compress *c, uint64_t n) {
    if (n <= c->chunks_cap)
        return CM_OK;
    uint32_t *s = realloc(c->sizes, n * sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "compress: cannot allocate a table of %llu chunks",
                       (unsigned long long)n);
    c->sizes = s;
    uint64_t *o = realloc(c->offs, n * sizeof *o);
    if (!o)
        return CM_FAIL(CM_ERR_NOMEM, "compress: cannot allocate a table of %llu chunks",
                       (unsigned long long)n);
    c->offs = o;
    c->chunks_cap = n;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// element transforms

static void split2(uint8_t *out, const uint8_t *in, size_t n, int rot) {
    uint8_t *p0 = out, *p1 = out + n;
    if (rot) {
        for (size_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, in + 2 * i, 2);
            v = (uint16_t)(v << 1 | v >> 15);
            p0[i] = (uint8_t)v;
            p1[i] = (uint8_t)(v >> 8);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            p0[i] = in[2 * i];
            p1[i] = in[2 * i + 1];
        }
    }
}

static void unsplit2(uint8_t *out, const uint8_t *in, size_t n, int rot) {
    const uint8_t *p0 = in, *p1 = in + n;
    if (rot) {
        for (size_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(p0[i] | p1[i] << 8);
            v = (uint16_t)(v >> 1 | v << 15);
            memcpy(out + 2 * i, &v, 2);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            out[2 * i] = p0[i];
            out[2 * i + 1] = p1[i];
        }
    }
}

static void split4(uint8_t *out, const uint8_t *in, size_t n, int rot) {
    uint8_t *p0 = out, *p1 = out + n, *p2 = out + 2 * n, *p3 = out + 3 * n;
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, in + 4 * i, 4);
        if (rot)
            v = v << 1 | v >> 31;
        p0[i] = (uint8_t)v;
        p1[i] = (uint8_t)(v >> 8);
        p2[i] = (uint8_t)(v >> 16);
        p3[i] = (uint8_t)(v >> 24);
    }
}

static void unsplit4(uint8_t *out, const uint8_t *in, size_t n, int rot) {
    const uint8_t *p0 = in, *p1 = in + n, *p2 = in + 2 * n, *p3 = in + 3 * n;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 | (uint32_t)p3[i] << 24;
        if (rot)
            v = v >> 1 | v << 31;
        memcpy(out + 4 * i, &v, 4);
    }
}

static void split_any(uint8_t *out, const uint8_t *in, size_t n, size_t es, int rot) {
    if (es == 2)
        return split2(out, in, n, rot);
    if (es == 4)
        return split4(out, in, n, rot);
    for (size_t k = 0; k < es; k++)
        for (size_t i = 0; i < n; i++)
            out[k * n + i] = in[i * es + k];
}

static void unsplit_any(uint8_t *out, const uint8_t *in, size_t n, size_t es, int rot) {
    if (es == 2)
        return unsplit2(out, in, n, rot);
    if (es == 4)
        return unsplit4(out, in, n, rot);
    for (size_t k = 0; k < es; k++)
        for (size_t i = 0; i < n; i++)
            out[i * es + k] = in[k * n + i];
}

/* f32 → E4M3 (fn: no infinities, max 448), round to nearest even, saturating; v finite. Bit for
 * bit cm_f32_to_f8e4m3 (the test holds it to that), without its frexpf. */
static inline uint8_t e4m3_rne(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u >= 0x43E00000u)
        return sign | 0x7e; /* ≥ 448 */
    if (u < 0x3C800000u) {  /* < 2^-6: subnormal, steps of 2^-9; + 2^23 − 2^23 rounds to nearest even */
        float a;
        memcpy(&a, &u, 4);
        volatile float t = a * 512.0f + 8388608.0f;
        return sign | (uint8_t)(int)(t - 8388608.0f);
    }
    uint32_t r = (u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20; /* exponent and 3 mantissa bits, rounded */
    uint32_t q = r - (120u << 3);                         /* re-bias 127 → 7 */
    return sign | (uint8_t)(q > 0x7eu ? 0x7eu : q);
}

static inline float load_f32(const uint8_t *p, cm_dtype dt) {
    if (dt == CM_DTYPE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    if (dt == CM_DTYPE_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float    f;
        memcpy(&f, &u, 4);
        return f;
    }
    return cm_f16_to_f32(h);
}

/* x finite (|x| ≤ 2^64·448 at most): round to nearest even into dt. */
static inline void store_f32(uint8_t *p, cm_dtype dt, float x) {
    if (dt == CM_DTYPE_F32) {
        memcpy(p, &x, 4);
        return;
    }
    uint16_t h;
    if (dt == CM_DTYPE_BF16) {
        uint32_t u;
        memcpy(&u, &x, 4);
        h = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    } else {
        h = cm_f32_to_f16(x);
    }
    memcpy(p, &h, 2);
}

// ----------------------------------------------------------------------------
// layout

static int dtype_is_float_wide(cm_dtype dt) {
    return dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16 || dt == CM_DTYPE_F16;
}

/* Fills the layout of n_rows × row_len elements with chunk_elems per chunk (0 = from the
 * config). Returns nonzero on a bad combination (message in cm_last_error under st_bad). */
static cm_status make_layout(const cm_compress *c, cm_encoding enc, cm_dtype dt, int64_t n_rows,
                             int64_t row_len, uint64_t chunk_elems, cm_status st_bad, layout *L) {
    memset(L, 0, sizeof *L);
    if ((unsigned)enc >= CM_ENCODING_END)
        return CM_FAIL(st_bad, "compress: unknown encoding %d", (int)enc);
    if (enc == CM_ENCODING_NCCL)
        return CM_FAIL(st_bad, "compress: encoding nccl sends raw bytes GPU to GPU; nothing to encode here");
    if ((unsigned)dt >= CM_DTYPE_COUNT)
        return CM_FAIL(st_bad, "compress: unknown dtype %d", (int)dt);
    if (enc == CM_ENCODING_FP8_ZSTD && !dtype_is_float_wide(dt))
        return CM_FAIL(st_bad, "compress: fp8-zstd encodes F32, BF16 or F16, not %s", cm_dtype_name(dt));
    if (n_rows < 0 || row_len < 0)
        return CM_FAIL(st_bad, "compress: negative size (%lld rows of %lld)", (long long)n_rows,
                       (long long)row_len);
    L->enc = enc;
    L->dt = dt;
    L->esize = cm_dtype_size(dt);
    L->n_rows = (uint64_t)n_rows;
    L->row_len = (uint64_t)row_len;
    uint64_t bytes;
    if (__builtin_mul_overflow(L->n_rows, L->row_len, &L->n_elems) ||
        __builtin_mul_overflow(L->n_elems, (uint64_t)L->esize, &bytes) || bytes > SIZE_MAX / 2)
        return CM_FAIL(st_bad, "compress: %lld rows of %lld elements overflow", (long long)n_rows,
                       (long long)row_len);
    if (enc == CM_ENCODING_RAW)
        return CM_OK;
    L->transform = enc == CM_ENCODING_ZSTD_BYTEPLANE && c->cfg.rotate && dtype_is_float_wide(dt);
    if (!chunk_elems) {
        chunk_elems = c->cfg.chunk_bytes / L->esize;
        if (enc == CM_ENCODING_FP8_ZSTD && L->row_len) {
            uint64_t rows = chunk_elems / L->row_len;
            if (rows < 1)
                rows = 1;
            if (L->row_len > CM_COMPRESS_MAX_CHUNK_BYTES / L->esize)
                return CM_FAIL(st_bad,
                               "compress: fp8-zstd rows of %llu elements exceed the chunk limit of %u bytes",
                               (unsigned long long)L->row_len, CM_COMPRESS_MAX_CHUNK_BYTES);
            chunk_elems = rows * L->row_len;
        }
    }
    L->chunk_elems = chunk_elems;
    L->n_chunks = L->n_elems ? (L->n_elems + chunk_elems - 1) / chunk_elems : 0;
    if (L->n_chunks > UINT32_MAX)
        return CM_FAIL(st_bad, "compress: %llu elements make more than 2^32 chunks",
                       (unsigned long long)L->n_elems);
    L->chunk_in = (size_t)chunk_elems * (enc == CM_ENCODING_FP8_ZSTD ? 1 : L->esize);
    L->scales_off = CM_COMPRESS_HEAD_SIZE + 4 * (size_t)L->n_chunks;
    L->chunks_off = L->scales_off + (enc == CM_ENCODING_FP8_ZSTD && L->n_elems ? 4 * (size_t)L->n_rows : 0);
    L->slot = ZSTD_compressBound(L->chunk_in);
    return CM_OK;
}

size_t cm_compress_bound(const cm_compress *c, cm_encoding enc, cm_dtype dt, int64_t n_rows,
                         int64_t row_len) {
    layout L;
    if (make_layout(c, enc, dt, n_rows, row_len, 0, CM_ERR_INVALID_ARG, &L) != CM_OK)
        return 0;
    if (enc == CM_ENCODING_RAW)
        return (size_t)(L.n_elems * L.esize);
    uint64_t b;
    if (__builtin_mul_overflow(L.n_chunks, (uint64_t)L.slot, &b) || b > SIZE_MAX - L.chunks_off)
        return 0;
    return L.chunks_off + (size_t)b;
}

// ----------------------------------------------------------------------------
// encode

static void chunk_span(const layout *L, int64_t i, uint64_t *e0, uint64_t *n) {
    *e0 = (uint64_t)i * L->chunk_elems;
    *n = L->n_elems - *e0 < L->chunk_elems ? L->n_elems - *e0 : L->chunk_elems;
}

/* Quantizes the whole rows of elements [e0, e0 + n) to out and writes their scales. */
static cm_status fp8_quantize(cm_compress *c, worker *w, uint64_t e0, uint64_t n, uint8_t *out) {
    const layout *L = c->lay;
    uint64_t      r0 = e0 / L->row_len, r1 = (e0 + n) / L->row_len;
    float        *f = (float *)(void *)(w->scratch + ((L->chunk_in + 63) & ~(size_t)63)); /* the row as F32 */
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *row = c->src + r * L->row_len * L->esize;
        uint64_t       n_r = L->row_len;
        if (L->dt == CM_DTYPE_BF16) {
            for (uint64_t j = 0; j < n_r; j++)
                f[j] = load_f32(row + 2 * j, CM_DTYPE_BF16);
        } else if (L->dt == CM_DTYPE_F32) {
            memcpy(f, row, 4 * n_r);
        } else {
            for (uint64_t j = 0; j < n_r; j++)
                f[j] = load_f32(row + 2 * j, L->dt);
        }
        float amax = 0.0f;
        int   bad = 0;
        for (uint64_t j = 0; j < n_r; j++) {
            float a = fabsf(f[j]);
            bad |= !(a <= FP8_MAX_ABS); /* NaN, Inf, too large */
            amax = a > amax ? a : amax;
        }
        if (bad) {
            uint64_t j = 0;
            while (j + 1 < n_r && isfinite(f[j]) && fabsf(f[j]) <= FP8_MAX_ABS)
                j++;
            return wfail(w, CM_ERR_INVALID_ARG,
                         "compress: fp8-zstd: row %llu holds %g at column %llu; it encodes "
                         "finite values up to 2^64 only (send this tensor lossless)",
                         (unsigned long long)r, (double)f[j], (unsigned long long)j);
        }
        float    scale = amax / 448.0f;
        uint8_t *q = out + (r - r0) * n_r;
        if (scale < FLT_MIN) {
            scale = 0.0f;
            memset(q, 0, n_r);
        } else {
            float inv = 1.0f / scale;
            for (uint64_t j = 0; j < n_r; j++)
                q[j] = e4m3_rne(f[j] * inv);
        }
        memcpy(c->dst + L->scales_off + 4 * r, &scale, 4);
    }
    return CM_OK;
}

static cm_status encode_chunk(cm_compress *c, worker *w, int64_t i) {
    const layout *L = c->lay;
    uint64_t      e0, n;
    chunk_span(L, i, &e0, &n);
    const uint8_t *in;
    size_t         in_len = (size_t)n * (L->enc == CM_ENCODING_FP8_ZSTD ? 1 : L->esize);
    if (L->enc == CM_ENCODING_ZSTD) {
        in = c->src + e0 * L->esize;
    } else if (L->enc == CM_ENCODING_ZSTD_BYTEPLANE) {
        split_any(w->scratch, c->src + e0 * L->esize, (size_t)n, L->esize, L->transform);
        in = w->scratch;
    } else {
        CM_TRY(fp8_quantize(c, w, e0, n, w->scratch));
        in = w->scratch;
    }
    uint8_t *slot = c->dst + L->chunks_off + (size_t)i * L->slot;
    size_t   r = ZSTD_compress2(w->cctx, slot, L->slot, in, in_len);
    if (ZSTD_isError(r))
        return wfail(w, CM_ERR_ZSTD, "zstd: cannot compress chunk %lld: %s", (long long)i,
                     ZSTD_getErrorName(r));
    if (r >= in_len) {
        memcpy(slot, in, in_len);
        c->sizes[i] = (uint32_t)in_len | STORED_BIT;
    } else {
        c->sizes[i] = (uint32_t)r;
    }
    return CM_OK;
}

cm_status cm_compress_encode(cm_compress *c, cm_encoding enc, cm_dtype dt, const void *src, int64_t n_rows,
                             int64_t row_len, void *dst, size_t cap, size_t *len) {
    layout L;
    *len = 0;
    CM_TRY(make_layout(c, enc, dt, n_rows, row_len, 0, CM_ERR_INVALID_ARG, &L));
    size_t need = cm_compress_bound(c, enc, dt, n_rows, row_len);
    if (!need && enc != CM_ENCODING_RAW)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: %lld rows of %lld elements are too large to encode",
                       (long long)n_rows, (long long)row_len);
    if (cap < need)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "compress: output buffer of %zu bytes is below the bound of %zu for %s", cap, need,
                       cm_encoding_name(enc));
    if ((L.n_elems && !src) || (need && !dst))
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: NULL buffer");
    if (enc == CM_ENCODING_RAW) {
        if (need)
            memcpy(dst, src, need);
        *len = need;
        return CM_OK;
    }
    uint8_t *d = dst;
    CM_TRY(ensure_chunks(c, L.n_chunks));
    int tuned = c->cfg.tune && enc != CM_ENCODING_ZSTD;
    if (tuned != c->tuned) {
        for (int k = 0; k < c->n_workers; k++)
            CM_TRY(set_params(c, &c->w[k], tuned));
        c->tuned = tuned;
    }
    if (enc == CM_ENCODING_ZSTD_BYTEPLANE)
        CM_TRY(ensure_scratch(c, L.chunk_in));
    if (enc == CM_ENCODING_FP8_ZSTD)
        CM_TRY(ensure_scratch(c, ((L.chunk_in + 63) & ~(size_t)63) + 4 * L.row_len));
    cm_le_put_u32(d, CM_COMPRESS_MAGIC);
    d[4] = (uint8_t)enc;
    d[5] = (uint8_t)dt;
    d[6] = (uint8_t)L.transform;
    d[7] = 0;
    cm_le_put_u64(d + 8, L.n_elems);
    cm_le_put_u64(d + 16, enc == CM_ENCODING_FP8_ZSTD ? L.row_len : 0);
    cm_le_put_u32(d + 24, (uint32_t)L.chunk_elems);
    cm_le_put_u32(d + 28, (uint32_t)L.n_chunks);
    c->lay = &L;
    c->src = src;
    c->dst = d;
    CM_TRY(run_job(c, encode_chunk, (int64_t)L.n_chunks));
    size_t pos = L.chunks_off;
    for (uint64_t i = 0; i < L.n_chunks; i++) {
        size_t n = c->sizes[i] & ~STORED_BIT;
        memmove(d + pos, d + L.chunks_off + i * L.slot, n);
        pos += n;
        cm_le_put_u32(d + CM_COMPRESS_HEAD_SIZE + 4 * i, c->sizes[i]);
    }
    *len = pos;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// decode

static cm_status decode_chunk(cm_compress *c, worker *w, int64_t i) {
    const layout *L = c->lay;
    uint64_t      e0, n;
    chunk_span(L, i, &e0, &n);
    size_t         in_len = (size_t)n * (L->enc == CM_ENCODING_FP8_ZSTD ? 1 : L->esize);
    const uint8_t *cs = c->src + c->offs[i];
    size_t         csz = c->sizes[i] & ~STORED_BIT;
    uint8_t       *out = c->dst + e0 * L->esize;
    const uint8_t *plain = cs;
    if (!(c->sizes[i] & STORED_BIT)) {
        /* one zstd frame (magic, then the frame header descriptor whose bit 2 is the content
         * checksum flag), exactly csz bytes, declaring exactly in_len bytes of content */
        if (csz < 6 || cm_le_get_u32(cs) != 0xFD2FB528u)
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld is not a zstd frame", (long long)i);
        if (!(cs[4] & 0x04))
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld has no content checksum", (long long)i);
        unsigned long long fcs = ZSTD_getFrameContentSize(cs, csz);
        if (fcs != in_len)
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld declares %lld content bytes, expected %zu",
                         (long long)i, fcs >= ZSTD_CONTENTSIZE_ERROR ? -1LL : (long long)fcs, in_len);
        size_t fsz = ZSTD_findFrameCompressedSize(cs, csz);
        if (ZSTD_isError(fsz) || fsz != csz)
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld: its zstd frame %s its %zu table bytes",
                         (long long)i, ZSTD_isError(fsz) ? "is cut short within" : "does not fill", csz);
        uint8_t *target = L->enc == CM_ENCODING_ZSTD ? out : w->scratch;
        size_t   r = ZSTD_decompressDCtx(w->dctx, target, in_len, cs, csz);
        if (ZSTD_isError(r))
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld does not decode: zstd: %s", (long long)i,
                         ZSTD_getErrorName(r));
        if (r != in_len)
            return wfail(w, CM_ERR_PROTOCOL, "compress: chunk %lld decodes to %zu bytes, expected %zu",
                         (long long)i, r, in_len);
        plain = target;
    }
    if (L->enc == CM_ENCODING_ZSTD) {
        if (plain != out)
            memcpy(out, plain, in_len);
    } else if (L->enc == CM_ENCODING_ZSTD_BYTEPLANE) {
        unsplit_any(out, plain, (size_t)n, L->esize, L->transform);
    } else {
        uint64_t r0 = e0 / L->row_len, r1 = (e0 + n) / L->row_len;
        for (uint64_t r = r0; r < r1; r++) {
            float scale;
            memcpy(&scale, c->src + L->scales_off + 4 * r, 4);
            if (!(scale >= 0.0f && scale <= FP8_MAX_SCALE))
                return wfail(w, CM_ERR_PROTOCOL,
                             "compress: fp8-zstd: scale of row %llu is %g, expected a finite "
                             "value in [0, 2^56]",
                             (unsigned long long)r, (double)scale);
            const uint8_t *q = plain + (r - r0) * L->row_len;
            uint8_t       *o = c->dst + r * L->row_len * L->esize;
            for (uint64_t j = 0; j < L->row_len; j++) {
                if (q[j] == 0x7f || q[j] == 0xff)
                    return wfail(w, CM_ERR_PROTOCOL,
                                 "compress: fp8-zstd: row %llu column %llu is the NaN code",
                                 (unsigned long long)r, (unsigned long long)j);
                store_f32(o + j * L->esize, L->dt, c->fp8_lut[q[j]] * scale);
            }
        }
    }
    return CM_OK;
}

cm_status cm_compress_decode(cm_compress *c, cm_encoding enc, cm_dtype dt, const void *src, size_t src_len,
                             int64_t n_rows, int64_t row_len, void *dst, size_t dst_len) {
    layout L;
    CM_TRY(make_layout(c, enc, dt, n_rows, row_len, CM_COMPRESS_MAX_CHUNK_BYTES, CM_ERR_INVALID_ARG, &L));
    size_t raw = (size_t)(L.n_elems * L.esize);
    if (dst_len != raw)
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: output buffer has %zu bytes, the tensor needs %zu",
                       dst_len, raw);
    if ((raw && !dst) || (src_len && !src))
        return CM_FAIL(CM_ERR_INVALID_ARG, "compress: NULL buffer");
    const uint8_t *s = src;
    const char    *en = cm_encoding_name(enc);
    if (enc == CM_ENCODING_RAW) {
        if (src_len != raw)
            return CM_FAIL(CM_ERR_PROTOCOL, "compress: raw tensor has %zu bytes, expected %zu", src_len, raw);
        if (raw)
            memcpy(dst, src, raw);
        return CM_OK;
    }
    if (src_len < CM_COMPRESS_HEAD_SIZE)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: %s stream truncated: %zu bytes, its head alone has %d", en,
                       src_len, CM_COMPRESS_HEAD_SIZE);
    uint32_t magic = cm_le_get_u32(s);
    if (magic != CM_COMPRESS_MAGIC)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: bad stream magic 0x%08x (expected 0x%08x \"TCZ1\")", magic,
                       CM_COMPRESS_MAGIC);
    if (s[4] != enc)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'encoding' is %s, the descriptor says %s",
                       cm_encoding_name(s[4]), en);
    if (s[5] != dt)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'dtype' is %u, the descriptor says %s", s[5],
                       cm_dtype_name(dt));
    int transform = s[6];
    if (transform > 1 || (transform && (enc != CM_ENCODING_ZSTD_BYTEPLANE || (L.esize != 2 && L.esize != 4))))
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'transform' is %d, not valid for %s %s",
                       transform, en, cm_dtype_name(dt));
    if (s[7])
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'reserved' is %u, must be 0", s[7]);
    uint64_t n_elems = cm_le_get_u64(s + 8), srow = cm_le_get_u64(s + 16), ce = cm_le_get_u32(s + 24),
             n_chunks = cm_le_get_u32(s + 28);
    if (n_elems != L.n_elems)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'n_elems' is %llu, the descriptor says %llu",
                       (unsigned long long)n_elems, (unsigned long long)L.n_elems);
    uint64_t want_row = enc == CM_ENCODING_FP8_ZSTD ? L.row_len : 0;
    if (srow != want_row)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'row_len' is %llu, expected %llu",
                       (unsigned long long)srow, (unsigned long long)want_row);
    // bounded even for an empty tensor: the scratch is sized from it
    if ((n_elems && ce < 1) || ce > CM_COMPRESS_MAX_CHUNK_BYTES / L.esize)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: stream field 'chunk_elems' is %llu, must be in [%d, %zu]",
                       (unsigned long long)ce, n_elems ? 1 : 0, CM_COMPRESS_MAX_CHUNK_BYTES / L.esize);
    if (n_elems) {
        if (enc == CM_ENCODING_FP8_ZSTD && ce % L.row_len)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "compress: stream field 'chunk_elems' %llu is not a multiple of row_len %llu",
                           (unsigned long long)ce, (unsigned long long)L.row_len);
    }
    CM_TRY(make_layout(c, enc, dt, n_rows, row_len, ce ? ce : 1, CM_ERR_INVALID_ARG, &L));
    L.transform = transform;
    if (n_chunks != L.n_chunks)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "compress: stream field 'n_chunks' is %llu, %llu elements in chunks of %llu "
                       "make %llu",
                       (unsigned long long)n_chunks, (unsigned long long)n_elems, (unsigned long long)ce,
                       (unsigned long long)L.n_chunks);
    if (src_len < L.chunks_off)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "compress: %s stream truncated: %zu bytes, its chunk table%s end at %zu", en, src_len,
                       enc == CM_ENCODING_FP8_ZSTD ? " and scales" : "", L.chunks_off);
    CM_TRY(ensure_chunks(c, L.n_chunks));
    uint64_t pos = L.chunks_off;
    for (uint64_t i = 0; i < L.n_chunks; i++) {
        uint32_t e = cm_le_get_u32(s + CM_COMPRESS_HEAD_SIZE + 4 * i);
        uint64_t sz = e & ~STORED_BIT, e0, n;
        chunk_span(&L, (int64_t)i, &e0, &n);
        uint64_t in_len = n * (enc == CM_ENCODING_FP8_ZSTD ? 1 : L.esize);
        if (sz > src_len - pos)
            return CM_FAIL(
                CM_ERR_PROTOCOL, "compress: chunk %llu of %llu bytes runs past the stream end (%llu left)",
                (unsigned long long)i, (unsigned long long)sz, (unsigned long long)(src_len - pos));
        if ((e & STORED_BIT) && sz != in_len)
            return CM_FAIL(CM_ERR_PROTOCOL, "compress: stored chunk %llu has %llu bytes, expected %llu",
                           (unsigned long long)i, (unsigned long long)sz, (unsigned long long)in_len);
        c->sizes[i] = e;
        c->offs[i] = pos;
        pos += sz;
    }
    if (pos != src_len)
        return CM_FAIL(CM_ERR_PROTOCOL, "compress: %s stream has %llu bytes after its last chunk", en,
                       (unsigned long long)(src_len - pos));
    if (enc != CM_ENCODING_ZSTD)
        CM_TRY(ensure_scratch(c, L.chunk_in));
    c->lay = &L;
    c->src = s;
    c->dst = dst;
    return run_job(c, decode_chunk, (int64_t)L.n_chunks);
}

cm_status cm_compress_decode_tensor(cm_compress *c, const cm_proto_tensor *t, void *dst, size_t dst_len) {
    static const cm_proto_limits unbounded = {UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX,
                                              UINT32_MAX, UINT32_MAX, UINT64_MAX, UINT64_MAX};
    int64_t                      rows, row_len;
    CM_TRY(cm_proto_tensor_check(t, &unbounded, CM_ERR_PROTOCOL, &rows, &row_len));
    return cm_compress_decode(c, t->encoding, t->dtype, t->data, t->encoded_size, rows, row_len, dst,
                              dst_len);
}
