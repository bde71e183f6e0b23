/* drafter-trainer/cmd/dt_shards.c — `drafter-trainer shards inspect|export`: looking at a shard
 * directory written by precompute (common/format/cm_shard.h).
 *   drafter-trainer shards inspect DIR [--verify] [--threads N]
 *     prints the run's identity, records, bytes, the compression ratio and one line per shard
 *     (stdout); --verify also checks every record: its header and payload checksum, the ANSWER
 *     frame inside (header, body and tensor checksums, batch id) and decodes every tensor
 *     (zstd's content checksums), listing each bad record on stderr (exit 1 if any).
 *   drafter-trainer shards export DIR --batch ID[,ID...] --out X.safetensors [--threads N]
 *     decodes those batches' tensors into one safetensors file, named "<batch id>/<tensor
 *     name>" in the order given, in each tensor's own dtype and shape (fp8-zstd records hold
 *     the decoded approximation); __metadata__ records the store's identity and the batches.
 * Bad input ends with one message and exit status 1; usage errors exit 2. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_args.h"
#include "cm_compress.h"
#include "cm_log.h"
#include "cm_pool.h"
#include "cm_proto.h"
#include "cm_safetensors.h"
#include "cm_shard.h"
#include "dt_cmd.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: drafter-trainer shards inspect DIR [--verify] [--threads N]\n"
        "       drafter-trainer shards export DIR --batch ID[,ID...] --out X.safetensors [--threads N]\n"
        "\n"
        "Looks at a shard directory written by precompute (index.bin + shard-NNNNN.bin).\n"
        "\n"
        "  inspect                  identity of the run (target, hidden size, layers, encoding), records,\n"
        "                           bytes, compression ratio and a summary per shard\n"
        "    --verify               also check every record: record and frame checksums, batch ids, and\n"
        "                           a full decode of every tensor; lists each bad record, exit 1 if any\n"
        "  export                   decode the tensors of the given batches into one safetensors file,\n"
        "                           named \"<batch id>/<tensor name>\" (e.g. \"17/layer_31\")\n"
        "    --batch ID[,ID...]     batch ids (decimal), each at most once\n"
        "    --out X.safetensors    the file to write (atomically)\n"
        "  --threads N              decoding threads (default: the cores, at most 16)\n"
        "  --log-level L            debug, info, warn, error or off\n");
}

typedef struct shards_args {
    const char *cmd, *dir, *batches, *out;
    int         verify, threads;
} shards_args;

/* Decodes the ANSWER of record i into a (tensors: caller storage of 64) and checks it against
 * its index entry; CM_ERR_FORMAT naming the record otherwise. */
static cm_status load_answer(const cm_shard_reader *r, uint64_t i, cm_proto_answer *a) {
    static const cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    cm_shard_entry               e;
    const void                  *frame;
    size_t                       len;
    char                         where[160];
    cm_shard_reader_entry(r, i, &e);
    snprintf(where, sizeof where, "shard-%05u.bin offset %llu (batch %llu)", e.shard,
             (unsigned long long)e.offset, (unsigned long long)e.batch_id);
    CM_TRY(cm_shard_reader_at(r, i, &frame, &len));
    if (cm_proto_answer_decode(frame, len, &lim, a) != CM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': %s: the ANSWER frame is bad: %s",
                       cm_shard_reader_dir(r), where, why);
    }
    uint64_t raw = 0;
    for (uint32_t t = 0; t < a->n_tensors; t++)
        raw += a->tensors[t].raw_size;
    if (a->batch_id != e.batch_id || a->n_tensors != e.n_tensors || raw != e.raw_bytes)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "shard directory '%s': %s: the frame holds batch %llu, %u tensors, %llu decoded bytes; "
            "the index says batch %llu, %u, %llu",
            cm_shard_reader_dir(r), where, (unsigned long long)a->batch_id, a->n_tensors,
            (unsigned long long)raw, (unsigned long long)e.batch_id, e.n_tensors,
            (unsigned long long)e.raw_bytes);
    return CM_OK;
}

/* Decodes tensor t into *buf (grown to its raw size). */
static cm_status decode_tensor(cm_compress *cz, const cm_shard_reader *r, uint64_t batch_id,
                               const cm_proto_tensor *t, uint8_t **buf, size_t *cap) {
    if (t->raw_size > SIZE_MAX)
        return CM_FAIL(CM_ERR_FORMAT, "batch %llu tensor '%s' is too large", (unsigned long long)batch_id,
                       t->name);
    if (t->raw_size > *cap) {
        uint8_t *p = realloc(*buf, (size_t)t->raw_size);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %llu bytes for tensor '%s'",
                           (unsigned long long)t->raw_size, t->name);
        *buf = p, *cap = (size_t)t->raw_size;
    }
    if (cm_compress_decode_tensor(cz, t, *buf, (size_t)t->raw_size) != CM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': batch %llu: tensor '%s' does not decode: %s",
                       cm_shard_reader_dir(r), (unsigned long long)batch_id, t->name, why);
    }
    return CM_OK;
}

static double gib(uint64_t b) {
    return (double)b / (double)(1ull << 30);
}

static cm_status run_inspect(const shards_args *a, int *n_bad) {
    cm_status        st = CM_OK;
    cm_shard_reader *r = NULL;
    cm_compress     *cz = NULL;
    uint8_t         *buf = NULL;
    size_t           cap = 0;
    cm_proto_tensor  tensors[64];
    *n_bad = 0;
    CM_TRY(cm_shard_reader_open(&r, a->dir, NULL));
    const cm_shard_identity *id = cm_shard_reader_identity(r);
    uint64_t n = cm_shard_reader_count(r), payload = 0, raw = 0, lo = UINT64_MAX, hi = 0, hashed = 0;
    for (uint64_t i = 0; i < n; i++) {
        cm_shard_entry e;
        cm_shard_reader_entry(r, i, &e);
        payload += e.length;
        raw += e.raw_bytes;
        hashed += e.batch_hash != 0;
        lo = e.batch_id < lo ? e.batch_id : lo;
        hi = e.batch_id > hi ? e.batch_id : hi;
    }
    uint64_t stored = payload + n * CM_SHARD_RECORD_HEADER_SIZE;
    printf("shard directory  %s\n", a->dir);
    printf("format           shard version %u%s, protocol version %d frames\n", cm_shard_reader_version(r),
           cm_shard_reader_version(r) < CM_SHARD_VERSION ? " (read-only: no weights fingerprint)" : "",
           CM_PROTO_VERSION);
    printf("target           %s (id %016llx)\n", id->target_name[0] ? id->target_name : "(unnamed)",
           (unsigned long long)id->target_id);
    if (id->weights_id)
        printf("weights          fingerprint %016llx\n", (unsigned long long)id->weights_id);
    else
        printf("weights          unknown (no fingerprint recorded)\n");
    printf("hidden           %u x %s, %u taps: layers", id->hidden_size, cm_dtype_name(id->hidden_dtype),
           id->n_layers);
    for (uint32_t l = 0; l < id->n_layers; l++)
        printf("%s%d", l ? "," : " ", id->layer_ids[l]);
    printf("\nencoding         %s\n", cm_encoding_name(id->encoding));
    if (n)
        printf("records          %llu (batch ids %llu .. %llu)\n", (unsigned long long)n,
               (unsigned long long)lo, (unsigned long long)hi);
    else
        printf("records          0\n");
    printf("stored           %llu bytes (%.3f GiB) in %u shards: payload %llu, record headers %llu\n",
           (unsigned long long)stored, gib(stored), cm_shard_reader_n_shards(r), (unsigned long long)payload,
           (unsigned long long)(n * CM_SHARD_RECORD_HEADER_SIZE));
    printf("decoded          %llu bytes (%.3f GiB) of tensors; ratio %.3fx (decoded / payload)\n",
           (unsigned long long)raw, gib(raw), payload ? (double)raw / (double)payload : 0.0);
    printf(
        "batch hashes     recorded for %llu of %llu records (the trainer checks its tokens against them)\n",
        (unsigned long long)hashed, (unsigned long long)n);
    printf("%-16s %10s %16s %16s  %s\n", "shard", "records", "bytes", "file bytes",
           "batch ids (first .. last)");
    for (uint32_t k = 0; k < cm_shard_reader_n_shards(r); k++) {
        cm_shard_info  s;
        cm_shard_entry f, l;
        cm_shard_reader_shard(r, k, &s);
        cm_shard_reader_entry(r, s.first, &f);
        cm_shard_reader_entry(r, s.first + s.n_records - 1, &l);
        const char *base = strrchr(s.path, '/');
        printf("%-16s %10llu %16llu %16llu  %llu .. %llu\n", base ? base + 1 : s.path,
               (unsigned long long)s.n_records, (unsigned long long)s.bytes, (unsigned long long)s.file_bytes,
               (unsigned long long)f.batch_id, (unsigned long long)l.batch_id);
    }
    fflush(stdout);
    if (!a->verify)
        goto done;

    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = a->threads;
    CM_TRY_GOTO(cm_compress_create(&cz, &cc), st, done);
    for (uint64_t i = 0; i < n; i++) {
        cm_proto_answer ans = {.tensors = tensors, .cap_tensors = 64};
        cm_status       rs = load_answer(r, i, &ans);
        for (uint32_t t = 0; rs == CM_OK && t < ans.n_tensors; t++)
            rs = decode_tensor(cz, r, ans.batch_id, &tensors[t], &buf, &cap);
        if (rs == CM_ERR_NOMEM || rs == CM_ERR_IO) {
            st = rs;
            goto done;
        }
        if (rs != CM_OK) {
            fprintf(stderr, "drafter-trainer shards inspect: bad record %llu: %s\n", (unsigned long long)i,
                    cm_last_error());
            (*n_bad)++;
        }
    }
    if (*n_bad == 0)
        printf("verified         %llu records: every checksum holds and every tensor decodes\n",
               (unsigned long long)n);
done:
    free(buf);
    cm_compress_destroy(&cz);
    cm_shard_reader_destroy(&r);
    return st;
}

/* Parses "a,b,c" into ids (caller frees); CM_ERR_INVALID_ARG naming a bad or repeated item. */
static cm_status parse_ids(const char *s, uint64_t **ids, int *n) {
    int cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    *n = 0;
    *ids = malloc((size_t)cap * sizeof **ids);
    if (!*ids)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d batch ids", cap);
    for (const char *p = s;;) {
        const char *q = p;
        while (*q >= '0' && *q <= '9')
            q++;
        char *end;
        errno = 0;
        unsigned long long v = strtoull(p, &end, 10);
        if (q == p || end != q || errno || (*q && *q != ','))
            return CM_FAIL(CM_ERR_INVALID_ARG, "--batch '%s': expected decimal batch ids separated by commas",
                           s);
        for (int j = 0; j < *n; j++)
            if ((*ids)[j] == v)
                return CM_FAIL(CM_ERR_INVALID_ARG, "--batch '%s': batch %llu is named twice", s, v);
        (*ids)[(*n)++] = v;
        if (!*q)
            break;
        p = q + 1;
    }
    return CM_OK;
}

static cm_status run_export(const shards_args *a, const uint64_t *ids, int n_ids) {
    cm_status        st = CM_OK;
    cm_shard_reader *r = NULL;
    cm_compress     *cz = NULL;
    cm_st_writer    *w = NULL;
    uint8_t         *buf = NULL;
    size_t           cap = 0;
    int              n_tensors = 0, lossy = 0;
    cm_proto_tensor  tensors[64];
    CM_TRY(cm_shard_reader_open(&r, a->dir, NULL));
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = a->threads;
    CM_TRY_GOTO(cm_compress_create(&cz, &cc), st, fail);
    CM_TRY_GOTO(cm_st_writer_create(&w), st, fail);
    for (int b = 0; b < n_ids; b++) {
        uint64_t i;
        if (!cm_shard_reader_find(r, ids[b], &i)) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "shard directory '%s' holds no batch %llu (%llu records; `drafter-trainer shards "
                         "inspect %s` lists their ids per shard)",
                         a->dir, (unsigned long long)ids[b], (unsigned long long)cm_shard_reader_count(r),
                         a->dir);
            goto fail;
        }
        cm_proto_answer ans = {.tensors = tensors, .cap_tensors = 64};
        CM_TRY_GOTO(load_answer(r, i, &ans), st, fail);
        for (uint32_t t = 0; t < ans.n_tensors; t++) {
            char name[CM_PROTO_NAME_MAX + 32];
            snprintf(name, sizeof name, "%llu/%.64s", (unsigned long long)ids[b], tensors[t].name);
            CM_TRY_GOTO(decode_tensor(cz, r, ids[b], &tensors[t], &buf, &cap), st, fail);
            CM_TRY_GOTO(cm_st_writer_add(w, name, tensors[t].dtype, tensors[t].n_dims, tensors[t].shape, buf),
                        st, fail);
            lossy |= tensors[t].encoding == CM_ENCODING_FP8_ZSTD;
            n_tensors++;
        }
    }
    const cm_shard_identity *id = cm_shard_reader_identity(r);
    char                     v[CM_SHARD_MAX_LAYERS * 12 + 32];
    size_t                   o = 0;
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "format", "tandem shard export"), st, fail);
    snprintf(v, sizeof v, "%016llx", (unsigned long long)id->target_id);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "target_id", v), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "target_name", id->target_name), st, fail);
    if (id->weights_id) {
        snprintf(v, sizeof v, "%016llx", (unsigned long long)id->weights_id);
        CM_TRY_GOTO(cm_st_writer_set_metadata(w, "weights_id", v), st, fail);
    }
    snprintf(v, sizeof v, "%u", id->hidden_size);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "hidden_size", v), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "hidden_dtype", cm_dtype_name(id->hidden_dtype)), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "encoding", cm_encoding_name(id->encoding)), st, fail);
    v[0] = '\0';
    for (uint32_t l = 0; l < id->n_layers; l++)
        o += (size_t)snprintf(v + o, sizeof v - o, "%s%d", l ? "," : "", id->layer_ids[l]);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "layer_ids", v), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "batches", a->batches), st, fail);
    if (lossy)
        CM_TRY_GOTO(cm_st_writer_set_metadata(w, "lossy", "fp8-zstd tensors hold the decoded approximation"),
                    st, fail);
    CM_TRY_GOTO(cm_st_writer_write(w, a->out), st, fail);
    printf("wrote %d tensors of %d batches to %s\n", n_tensors, n_ids, a->out);
fail:
    free(buf);
    cm_st_writer_destroy(&w);
    cm_compress_destroy(&cz);
    cm_shard_reader_destroy(&r);
    return st;
}

int dt_cmd_shards(int argc, char **argv) {
    shards_args a = {0};
    a.threads = cm_pool_cpu_threads(16);
    if (argc >= 1 && (strcmp(argv[0], "-h") == 0 || strcmp(argv[0], "--help") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc < 2 || (strcmp(argv[0], "inspect") != 0 && strcmp(argv[0], "export") != 0)) {
        fprintf(stderr, "drafter-trainer shards: expected 'inspect DIR' or 'export DIR' (see --help)\n");
        return 2;
    }
    a.cmd = argv[0];
    char name[64];
    snprintf(name, sizeof name, "drafter-trainer shards %s", a.cmd);
    const int export = a.cmd[0] == 'e';
    cm_args   p;
    cm_args_init(&p, name, argc - 1, argv + 1);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (p.arg[0] != '-') {
            if (a.dir) {
                fprintf(stderr, "%s: one directory only ('%s' and '%s')\n", name, a.dir, p.arg);
                return 2;
            }
            a.dir = p.arg;
        } else if (!export && cm_args_flag(&p, "--verify")) {
            a.verify = 1;
        } else if (export && (cm_args_str(&p, "--batch", &a.batches) || cm_args_str(&p, "--out", &a.out))) {
        } else if (!cm_args_int(&p, "--threads", 1, CM_COMPRESS_MAX_THREADS, &a.threads) && !cm_args_log_level(&p))
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (!a.dir) {
        fprintf(stderr, "drafter-trainer shards %s: the shard directory is required (see --help)\n", a.cmd);
        return 2;
    }
    cm_status st;
    if (a.cmd[0] == 'i') {
        int n_bad = 0;
        st = run_inspect(&a, &n_bad);
        if (st == CM_OK && n_bad) {
            fprintf(stderr,
                    "drafter-trainer shards inspect: %d records of '%s' are corrupted (listed above): train "
                    "without them, or run precompute again into a new directory\n",
                    n_bad, a.dir);
            return 1;
        }
    } else {
        if (!a.batches || !a.out) {
            fprintf(stderr, "drafter-trainer shards export: --batch and --out are required (see --help)\n");
            return 2;
        }
        uint64_t *ids = NULL;
        int       n_ids = 0;
        st = parse_ids(a.batches, &ids, &n_ids);
        if (st != CM_OK) {
            fprintf(stderr, "drafter-trainer shards export: %s\n", cm_last_error());
            free(ids);
            return 2;
        }
        st = run_export(&a, ids, n_ids);
        free(ids);
    }
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer shards %s: %s: %s\n", a.cmd, cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
