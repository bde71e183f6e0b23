/* tests/bench_cm_compress.c — ratio and speed of each hidden-state encoding (cm_compress) on
 * real hidden states (`target-server dump` outputs: every layer_<i> tensor, F32 [T, D], sent as
 * BF16 the way the server sends them, and as F32) and on synthetic data (gaussian bf16, and
 * gaussian with hidden-state-like outlier channels and sink tokens). Prints a markdown report:
 * ratio, GB/s of raw bytes for compress and decompress on 1 thread and on N threads (and per
 * core), and for fp8-zstd its error against the input. Every timed decode is checked against
 * the input (bit-exact for lossless modes). A standalone program, not a test.
 *
 *   bench_cm_compress [--threads N] [--min-time S] [--synthetic ROWSxCOLS] [--no-synthetic]
 *                     [DUMP.safetensors[=LABEL] ...]
 *   bench_cm_compress --make-input OUT.safetensors --tokens T --seqs N --vocab V [--seed S]
 * The second form writes random input_ids (I32 [T], uniform in [0, V)) and cu_seqlens (N equal
 * documents) for `target-server dump --input`. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cm_compress.h"
#include "cm_hash.h"
#include "cm_safetensors.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double uniform(void) {
    return (double)(rnd() >> 11) / 9007199254740992.0;
}
static float gauss(void) {
    return (float)(sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()));
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct dataset {
    char      name[160];
    int64_t   rows, cols;
    float    *f32;  /* [rows, cols] */
    uint16_t *bf16; /* the same, rounded to bf16 */
} dataset;

static void dataset_free(dataset *d) {
    free(d->f32);
    free(d->bf16);
    d->f32 = NULL;
    d->bf16 = NULL;
}

static int dataset_alloc(dataset *d, int64_t rows, int64_t cols) {
    d->rows = rows, d->cols = cols;
    d->f32 = malloc((size_t)(rows * cols) * 4);
    d->bf16 = malloc((size_t)(rows * cols) * 2);
    return d->f32 && d->bf16;
}

static void dataset_round(dataset *d) {
    for (int64_t i = 0; i < d->rows * d->cols; i++)
        d->bf16[i] = cm_f32_to_bf16(d->f32[i]);
}

/* All layer_<i> tensors of a dump, stacked: [n_layers · T, D]. */
static cm_status load_dump(dataset *d, const char *path, const char *label) {
    cm_st    *st = NULL;
    cm_status s;
    CM_TRY(cm_st_open_file(&st, path));
    int64_t rows = 0, cols = -1;
    int     n_layers = 0;
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (strncmp(t->name, "layer_", 6) != 0)
            continue;
        if (t->dtype != CM_DTYPE_F32 || t->n_dims != 2 || (cols >= 0 && t->shape[1] != cols)) {
            s = CM_FAIL(CM_ERR_FORMAT, "'%s' in %s: expected F32 [T, D] like the other layers", t->name,
                        path);
            goto fail;
        }
        cols = t->shape[1];
        rows += t->shape[0];
        n_layers++;
    }
    if (!n_layers) {
        s = CM_FAIL(CM_ERR_FORMAT, "%s holds no layer_<i> tensor; pass a `target-server dump` output", path);
        goto fail;
    }
    if (!dataset_alloc(d, rows, cols)) {
        s = CM_FAIL(CM_ERR_NOMEM, "out of memory for %s", path);
        goto fail;
    }
    int64_t r = 0, T = 0;
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (strncmp(t->name, "layer_", 6) != 0)
            continue;
        memcpy(d->f32 + r * cols, t->data, t->nbytes);
        r += t->shape[0];
        T = t->shape[0];
    }
    dataset_round(d);
    snprintf(d->name, sizeof d->name, "%.100s: %d layers × T=%lld × D=%lld", label, n_layers, (long long)T,
             (long long)cols);
    cm_st_destroy(&st);
    return CM_OK;
fail:
    cm_st_destroy(&st);
    return s;
}

/* Gaussian N(0,1), or hidden-state-like: row norms vary (×0.5..×2.5), ~2% of channels ×5..×20,
 * 0.1% "massive" channels ×100..×1000, and every 2048th row (a document start: the attention
 * sink) has two channels at ±3000. Channel picks are fixed across rows, as in real models. */
static int make_synthetic(dataset *d, int64_t rows, int64_t cols, int outliers) {
    if (!dataset_alloc(d, rows, cols))
        return 0;
    float *cs = malloc((size_t)cols * sizeof *cs);
    if (!cs)
        return 0;
    for (int64_t j = 0; j < cols; j++) {
        double u = uniform();
        cs[j] = !outliers   ? 1.0f
                : u < 0.001 ? (float)(100 + 900 * uniform())
                : u < 0.02  ? (float)(5 + 15 * uniform())
                            : 1.0f;
    }
    for (int64_t r = 0; r < rows; r++) {
        float rs = outliers ? (float)(0.5 + 2.0 * uniform()) : 1.0f;
        for (int64_t j = 0; j < cols; j++)
            d->f32[r * cols + j] = rs * cs[j] * gauss();
        if (outliers && r % 2048 == 0) {
            d->f32[r * cols + cols / 3] = 3000.0f;
            d->f32[r * cols + 2 * cols / 3] = -3000.0f;
        }
    }
    free(cs);
    dataset_round(d);
    snprintf(d->name, sizeof d->name, "synthetic %s: %lld × %lld",
             outliers ? "hidden-like (outliers)" : "gaussian", (long long)rows, (long long)cols);
    return 1;
}

typedef struct mode {
    const char *label;
    cm_encoding enc;
    cm_dtype    dt;
    int         level, rotate, tune;
} mode;

static const mode MODES[] = {
    {"bf16 zstd (no split)", CM_ENCODING_ZSTD, CM_DTYPE_BF16, 1, 0, 0},
    {"bf16 zstd (no split)", CM_ENCODING_ZSTD, CM_DTYPE_BF16, 3, 0, 0},
    {"bf16 zstd-byteplane: plain split, zstd's parameters", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 1, 0,
     0},
    {"bf16 zstd-byteplane: rotated, zstd's parameters", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 1, 1, 0},
    {"bf16 zstd-byteplane: rotated, zstd's parameters", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 3, 1, 0},
    {"bf16 zstd-byteplane: plain split, tuned", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 1, 0, 1},
    {"**bf16 zstd-byteplane: rotated, tuned (default)**", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 1, 1, 1},
    {"bf16 zstd-byteplane: rotated, tuned", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, 3, 1, 1},
    {"bf16 → fp8-zstd (lossy), tuned", CM_ENCODING_FP8_ZSTD, CM_DTYPE_BF16, 1, 1, 1},
    {"f32 zstd (no split)", CM_ENCODING_ZSTD, CM_DTYPE_F32, 1, 0, 0},
    {"f32 zstd-byteplane: rotated, tuned", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_F32, 1, 1, 1},
    {"f32 zstd-byteplane: rotated, tuned", CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_F32, 3, 1, 1},
    {"f32 → fp8-zstd (lossy), tuned", CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, 1, 1, 1},
};

typedef struct result {
    double ratio, c1, d1, cn, dn; /* GB/s of raw bytes */
    double rel_l2, max_abs, rel_l2_f32;
} result;

static int    n_threads = 2;
static double min_time = 0.3;

/* Fastest of repeated runs lasting at least min_time in total (at least 3 runs). */
static int run_timed(cm_compress *c, const mode *m, const void *in, const dataset *d, uint8_t *enc,
                     size_t cap, void *out, size_t *len, double *c_gbs, double *d_gbs) {
    size_t raw = (size_t)(d->rows * d->cols) * cm_dtype_size(m->dt);
    double best = 1e30, t_total = 0;
    for (int k = 0; k < 3 || t_total < min_time; k++) {
        double t0 = now();
        if (cm_compress_encode(c, m->enc, m->dt, in, d->rows, d->cols, enc, cap, len) != CM_OK) {
            fprintf(stderr, "bench_cm_compress: encode failed: %s\n", cm_last_error());
            return 0;
        }
        double t = now() - t0;
        t_total += t;
        if (t < best)
            best = t;
    }
    *c_gbs = (double)raw / best / 1e9;
    best = 1e30, t_total = 0;
    for (int k = 0; k < 3 || t_total < min_time; k++) {
        double t0 = now();
        if (cm_compress_decode(c, m->enc, m->dt, enc, *len, d->rows, d->cols, out, raw) != CM_OK) {
            fprintf(stderr, "bench_cm_compress: decode failed: %s\n", cm_last_error());
            return 0;
        }
        double t = now() - t0;
        t_total += t;
        if (t < best)
            best = t;
    }
    *d_gbs = (double)raw / best / 1e9;
    if (m->enc != CM_ENCODING_FP8_ZSTD && memcmp(out, in, raw) != 0) {
        fprintf(stderr, "bench_cm_compress: %s L%d is not bit-exact on %s\n", m->label, m->level, d->name);
        return 0;
    }
    return 1;
}

static int bench_mode(const mode *m, const dataset *d, result *res) {
    memset(res, 0, sizeof *res);
    cm_compress       *c1 = NULL, *cn = NULL;
    cm_compress_config cfg = {1, m->level, 256u << 10, m->rotate, m->tune};
    int                ok = 0;
    uint8_t           *enc = NULL, *out = NULL;
    const void        *in = m->dt == CM_DTYPE_BF16 ? (const void *)d->bf16 : (const void *)d->f32;
    size_t             raw = (size_t)(d->rows * d->cols) * cm_dtype_size(m->dt), len = 0, len_n = 0;
    if (cm_compress_create(&c1, &cfg) != CM_OK)
        goto done;
    cfg.n_threads = n_threads;
    if (cm_compress_create(&cn, &cfg) != CM_OK)
        goto done;
    size_t cap = cm_compress_bound(c1, m->enc, m->dt, d->rows, d->cols);
    enc = malloc(cap);
    out = malloc(raw ? raw : 1);
    if (!enc || !out)
        goto done;
    if (!run_timed(c1, m, in, d, enc, cap, out, &len, &res->c1, &res->d1))
        goto done;
    if (!run_timed(cn, m, in, d, enc, cap, out, &len_n, &res->cn, &res->dn))
        goto done;
    if (len != len_n) {
        fprintf(stderr, "bench_cm_compress: %s: %zu bytes on 1 thread, %zu on %d\n", m->label, len, len_n,
                n_threads);
        goto done;
    }
    res->ratio = (double)raw / (double)len;
    if (m->enc ==
        CM_ENCODING_FP8_ZSTD) { /* error against the encoder's input, and against the F32 original */
        double num = 0, den = 0, num32 = 0, den32 = 0, mx = 0;
        for (int64_t i = 0; i < d->rows * d->cols; i++) {
            double y = m->dt == CM_DTYPE_BF16 ? cm_bf16_to_f32(((uint16_t *)out)[i]) : ((float *)out)[i];
            double x = m->dt == CM_DTYPE_BF16 ? cm_bf16_to_f32(d->bf16[i]) : d->f32[i];
            num += (y - x) * (y - x), den += x * x;
            num32 += (y - d->f32[i]) * (y - d->f32[i]), den32 += (double)d->f32[i] * d->f32[i];
            if (fabs(y - x) > mx)
                mx = fabs(y - x);
        }
        res->rel_l2 = sqrt(num / (den + 1e-300));
        res->rel_l2_f32 = sqrt(num32 / (den32 + 1e-300));
        res->max_abs = mx;
    }
    ok = 1;
done:
    if (!ok && cm_last_error()[0])
        fprintf(stderr, "bench_cm_compress: %s\n", cm_last_error());
    free(enc);
    free(out);
    cm_compress_destroy(&c1);
    cm_compress_destroy(&cn);
    return ok;
}

static void stats_line(const dataset *d) {
    double  s = 0, s2 = 0, mx = 0;
    int64_t n = d->rows * d->cols;
    for (int64_t i = 0; i < n; i++) {
        double x = d->f32[i];
        s += x, s2 += x * x;
        if (fabs(x) > mx)
            mx = fabs(x);
    }
    double sd = sqrt(s2 / n - (s / n) * (s / n));
    printf("values: %lld, std %.4g, max |x| %.4g (max/std %.1f)\n\n", (long long)n, sd, mx,
           mx / (sd + 1e-300));
}

static int bench_dataset(const dataset *d) {
    printf("### %s\n\n", d->name);
    stats_line(d);
    printf("| mode | zstd level | ratio | compress 1 thr GB/s | decompress 1 thr GB/s | compress %d thr GB/s "
           "(per core) "
           "| decompress %d thr GB/s (per core) | fp8 rel L2 / max abs err |\n",
           n_threads, n_threads);
    printf("|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof MODES / sizeof MODES[0]; i++) {
        result r;
        if (!bench_mode(&MODES[i], d, &r))
            return 0;
        char err[96] = "—";
        if (MODES[i].enc == CM_ENCODING_FP8_ZSTD)
            snprintf(err, sizeof err, "%.4f / %.3g (vs f32: %.4f)", r.rel_l2, r.max_abs, r.rel_l2_f32);
        printf("| %s | %d | %.3f | %.3f | %.3f | %.3f (%.3f) | %.3f (%.3f) | %s |\n", MODES[i].label,
               MODES[i].level, r.ratio, r.c1, r.d1, r.cn, r.cn / n_threads, r.dn, r.dn / n_threads, err);
        fflush(stdout);
    }
    printf("\n");
    return 1;
}

static void bench_reference(const dataset *d) {
    size_t   n = (size_t)(d->rows * d->cols) * 2;
    uint8_t *dst = malloc(n);
    if (!dst)
        return;
    double   best_h = 1e30, best_m = 1e30;
    uint64_t h = 0;
    for (int k = 0; k < 5; k++) {
        double t0 = now();
        h ^= cm_xxh64(d->bf16, n, 0);
        double t1 = now();
        memcpy(dst, d->bf16, n);
        double t2 = now();
        if (t1 - t0 < best_h)
            best_h = t1 - t0;
        if (t2 - t1 < best_m)
            best_m = t2 - t1;
    }
    printf(
        "Reference speeds on one core over %zu bytes: XXH64 (cm_hash) %.2f GB/s, memcpy %.2f GB/s (checksum "
        "%016llx).\n\n",
        n, (double)n / best_h / 1e9, (double)n / best_m / 1e9, (unsigned long long)h);
    free(dst);
}

static int make_input(const char *out, long T, long N, long V, uint64_t seed) {
    if (T < 1 || N < 1 || N > T || V < 1) {
        fprintf(stderr, "bench_cm_compress --make-input: needs 1 ≤ --seqs ≤ --tokens and --vocab ≥ 1\n");
        return 2;
    }
    rng = seed;
    int32_t      *ids = malloc((size_t)T * 4), *cu = malloc((size_t)(N + 1) * 4);
    cm_st_writer *w = NULL;
    int           rc = 1;
    if (!ids || !cu)
        goto done;
    for (long i = 0; i < T; i++)
        ids[i] = (int32_t)(rnd() % (uint64_t)V);
    for (long i = 0; i <= N; i++)
        cu[i] = (int32_t)(T * i / N);
    int64_t st = T, sn = N + 1;
    if (cm_st_writer_create(&w) != CM_OK ||
        cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, &st, ids) != CM_OK ||
        cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, &sn, cu) != CM_OK ||
        cm_st_writer_write(w, out) != CM_OK) {
        fprintf(stderr, "bench_cm_compress: cannot write '%s': %s\n", out, cm_last_error());
        goto done;
    }
    rc = 0;
done:
    cm_st_writer_destroy(&w);
    free(ids);
    free(cu);
    return rc;
}

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: bench_cm_compress [--threads N] [--min-time S] [--synthetic ROWSxCOLS] [--no-synthetic]\n"
        "                         [DUMP.safetensors[=LABEL] ...]\n"
        "       bench_cm_compress --make-input OUT.safetensors --tokens T --seqs N --vocab V [--seed S]\n");
}

int main(int argc, char **argv) {
    long        srows = 4096, scols = 5120, T = 0, N = 0, V = 0;
    int         synthetic = 1;
    const char *mk = NULL;
    uint64_t    seed = 1;
    const char *dumps[64];
    int         n_dumps = 0;
    long        ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = ncpu > 0 ? (int)ncpu : 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--no-synthetic")) {
            synthetic = 0;
        } else if (a[0] == '-' && a[1] == '-' && !v) {
            fprintf(stderr, "bench_cm_compress: option '%s' needs a value\n", a);
            return 2;
        } else if (!strcmp(a, "--threads")) {
            n_threads = atoi(v), i++;
        } else if (!strcmp(a, "--min-time")) {
            min_time = atof(v), i++;
        } else if (!strcmp(a, "--synthetic")) {
            if (sscanf(v, "%ldx%ld", &srows, &scols) != 2 || srows < 1 || scols < 1) {
                fprintf(stderr, "bench_cm_compress: --synthetic '%s': expected ROWSxCOLS, e.g. 4096x5120\n",
                        v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--make-input")) {
            mk = v, i++;
        } else if (!strcmp(a, "--tokens")) {
            T = atol(v), i++;
        } else if (!strcmp(a, "--seqs")) {
            N = atol(v), i++;
        } else if (!strcmp(a, "--vocab")) {
            V = atol(v), i++;
        } else if (!strcmp(a, "--seed")) {
            seed = strtoull(v, NULL, 10), i++;
        } else if (a[0] == '-') {
            fprintf(stderr, "bench_cm_compress: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (n_dumps < 64) {
            dumps[n_dumps++] = a;
        }
    }
    if (mk)
        return make_input(mk, T, N, V, seed);
    if (n_threads < 1 || n_threads > CM_COMPRESS_MAX_THREADS) {
        fprintf(stderr, "bench_cm_compress: --threads must be in [1, %d]\n", CM_COMPRESS_MAX_THREADS);
        return 2;
    }
    printf(
        "## bench_cm_compress: %d threads, %ld cpus online, fastest of ≥ 3 runs and ≥ %.2f s per figure\n\n",
        n_threads, ncpu, min_time);
    printf("GB/s are raw (uncompressed) bytes per second; per core = the %d-thread figure / %d. Chunks of "
           "256 KiB "
           "of input.\n\n",
           n_threads, n_threads);
    for (int i = 0; i < n_dumps; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s", dumps[i]);
        char       *eq = strchr(path, '=');
        const char *label = path;
        if (eq)
            *eq = '\0', label = eq + 1;
        dataset d = {0};
        if (load_dump(&d, path, label) != CM_OK) {
            fprintf(stderr, "bench_cm_compress: %s\n", cm_last_error());
            return 1;
        }
        int ok = bench_dataset(&d);
        dataset_free(&d);
        if (!ok)
            return 1;
    }
    if (synthetic) {
        for (int o = 0; o < 2; o++) {
            dataset d = {0};
            if (!make_synthetic(&d, srows, scols, o)) {
                fprintf(stderr, "bench_cm_compress: out of memory for %ld × %ld\n", srows, scols);
                return 1;
            }
            if (o)
                bench_reference(&d);
            int ok = bench_dataset(&d);
            dataset_free(&d);
            if (!ok)
                return 1;
        }
    }
    return 0;
}
