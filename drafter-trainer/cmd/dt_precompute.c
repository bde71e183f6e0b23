/* drafter-trainer/cmd/dt_precompute.c — `drafter-trainer precompute` (token batches → target-server
 * → shard directory, resumable; layout and rules in dt_precompute.h; the trainer reads the store
 * through feed/dt_shard_source.h). Precompute keeps `credits` requests in flight, stores
 * each verified ANSWER as received (cm_chan_client_frames → cm_shard_writer_append_parts, no
 * second encoding), skips ids already stored, and on SIGINT/SIGTERM closes the writer so that
 * every record appended so far is durable (exit 130/143). */
#include "dt_precompute.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_args.h"
#include "cm_chan.h"
#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_proto.h"
#include "cm_shard.h"
#include "dt_cmd.h"
#include "dt_live.h" /* dt_live_connect */

// ----------------------------------------------------------------------------
// precompute

typedef struct pc_args {
    const char *server, *data, *data_dir, *dataset, *layers, *out, *name;
    const char *curve_server_key, *curve_secret_key;
    cm_encoding encoding;
    int64_t     credits, timeout_ms, progress_every, threads, token_budget;
    int         verify_tail; /* --verify-stored tail: only each shard's last stored record */
} pc_args;

static volatile sig_atomic_t g_signal;
static void                  on_signal(int sig) {
                     g_signal = sig;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: drafter-trainer precompute --server ENDPOINT\n"
            "           (--data FILE[,FILE...] | --data-dir DIR | --dataset FILE[,FILE...] [--token-budget N])\n"
            "           --layers I,J,... --out SHARD_DIR [options]\n"
            "\n"
            "Asks a running target-server for the hidden states of every token batch file and stores\n"
            "the answers in SHARD_DIR (created if absent; its parent must exist). Resumable: batches\n"
            "already stored are skipped, so a killed precompute continues where it stopped. Token batch\n"
            "files hold input_ids, cu_seqlens and loss_mask (see drafter-trainer/feed/dt_data.h; a\n"
            "target_hidden is ignored); a batch's id is its index in the data list. Train from the\n"
            "result with `drafter-trainer train ... --shards SHARD_DIR` and the same --data. With\n"
            "--dataset (drafter-trainer/feed/dt_dataset.h) the documents are packed as train packs them and\n"
            "pack i is batch id i: train with the same --dataset and --token-budget.\n"
            "\n"
            "options:\n"
            "  --server ENDPOINT       the target-server (tcp://127.0.0.1:PORT or ipc://PATH)\n"
            "  --data FILE[,FILE...]   token batch files, in batch id order\n"
            "  --data-dir DIR          every DIR/*.safetensors, sorted by name\n"
            "  --dataset FILE[,FILE...] tokenized documents (.jsonl or .safetensors), packed\n"
            "  --token-budget N        tokens per pack with --dataset (default 8192)\n"
            "  --layers I,J,...        target layers to store (the drafters' target_layer_ids)\n"
            "  --out SHARD_DIR         shard directory\n"
            "  --encoding NAME         raw, zstd, zstd-byteplane (default) or fp8-zstd (lossy)\n"
            "  --credits N             requests in flight (default 4)\n"
            "  --timeout-ms N          give up when no answer arrives for this long (default 600000)\n"
            "  --curve-server-key FILE the server's CURVE public key (a server on another host)\n"
            "  --curve-secret-key FILE this client's CURVE secret key (default: a fresh pair)\n"
            "  --progress-every N      progress line every N batches (default 16)\n"
            "  --verify-stored full|tail  records already in SHARD_DIR: full (default) checks every one\n"
            "                          (one read of the store; the rate is logged) and asks the server\n"
            "                          again for a damaged one, restoring it in place; tail checks only\n"
            "                          each shard's last record (a damaged one stops the run)\n"
            "  --name NAME             this client's name in the server's logs (default precompute)\n"
            "  --log-level LEVEL       debug, info, warn, error or off\n"
            "Exit status: 0 all batches stored (and, with --verify-stored full, every stored record\n"
            "verified or restored), 1 failure, 2 usage error, 130/143 stopped by SIGINT/SIGTERM\n"
            "(everything stored so far is durable; run again to continue).\n");
}

/* 0 ok, 1 help printed, 2 usage error (message printed). */
static int parse_args(int argc, char **argv, pc_args *a) {
    *a = (pc_args){.name = "precompute",
                   .encoding = CM_ENCODING_ZSTD_BYTEPLANE,
                   .credits = 4,
                   .timeout_ms = 600000,
                   .progress_every = 16,
                   .token_budget = 8192};
    cm_args p;
    cm_args_init(&p, "drafter-trainer precompute", argc, argv);
    while (cm_args_next(&p)) {
        const char *v = NULL;
        if (cm_args_help(&p)) {
            usage(stdout);
            return 1;
        }
        if (cm_args_str(&p, "--server", &a->server) || cm_args_str(&p, "--data", &a->data) ||
            cm_args_str(&p, "--data-dir", &a->data_dir) || cm_args_str(&p, "--dataset", &a->dataset) ||
            cm_args_i64(&p, "--token-budget", 2, INT32_MAX, &a->token_budget) ||
            cm_args_str(&p, "--layers", &a->layers) || cm_args_str(&p, "--out", &a->out) ||
            cm_args_str(&p, "--name", &a->name))
            ;
        else if (cm_args_str(&p, "--verify-stored", &v)) {
            if (v && strcmp(v, "full") != 0 && strcmp(v, "tail") != 0) {
                fprintf(stderr, "drafter-trainer precompute: --verify-stored %s: expected full or tail\n", v);
                return 2;
            }
            if (v)
                a->verify_tail = v[0] == 't';
        } else if (cm_args_str(&p, "--encoding", &v)) {
            if (v && cm_encoding_parse(v, &a->encoding) != CM_OK) {
                fprintf(stderr, "drafter-trainer precompute: --encoding: %s\n", cm_last_error());
                return 2;
            }
        } else if (cm_args_i64(&p, "--credits", 1, 64, &a->credits) ||
                   cm_args_i64(&p, "--timeout-ms", 1, INT32_MAX, &a->timeout_ms) ||
                   cm_args_str(&p, "--curve-server-key", &a->curve_server_key) ||
                   cm_args_str(&p, "--curve-secret-key", &a->curve_secret_key) ||
                   cm_args_i64(&p, "--progress-every", 1, INT32_MAX, &a->progress_every) || cm_args_log_level(&p))
            ;
        else
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (!a->server || !a->layers || !a->out || (!a->data && !a->data_dir && !a->dataset)) {
        fprintf(stderr, "drafter-trainer precompute: --server, --layers, --out and --data, --data-dir or "
                        "--dataset are required (see --help)\n");
        return 2;
    }
    if (!!a->data + !!a->data_dir + !!a->dataset > 1) {
        fprintf(stderr, "drafter-trainer precompute: give one of --data, --data-dir and --dataset\n");
        return 2;
    }
    char what[96];
    snprintf(what, sizeof what, "--name '%.70s'", a->name);
    if (cm_proto_name_check(what, a->name) != CM_OK) { /* the server sees it: the wire's rules */
        fprintf(stderr, "drafter-trainer precompute: %s\n", cm_last_error());
        return 2;
    }
    return 0;
}

/* "3,1,7" → distinct non-negative layer ids (at most CM_SHARD_MAX_LAYERS). */
static cm_status parse_layers(const char *s, int32_t *ids, uint32_t *n) {
    *n = 0;
    for (const char *p = s;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ','))
            return CM_FAIL(CM_ERR_INVALID_ARG, "--layers '%s': expected distinct layer ids like 1,5,9", s);
        if (*n == CM_SHARD_MAX_LAYERS)
            return CM_FAIL(CM_ERR_INVALID_ARG, "--layers '%s': at most %d layers", s, CM_SHARD_MAX_LAYERS);
        for (uint32_t i = 0; i < *n; i++)
            if (ids[i] == (int32_t)v)
                return CM_FAIL(CM_ERR_INVALID_ARG, "--layers '%s': layer %ld is given twice", s, v);
        ids[(*n)++] = (int32_t)v;
        if (!*end)
            return CM_OK;
        p = end + 1;
    }
}

typedef struct pc_run {
    pc_args          a;
    char           **paths;
    int              n_paths; /* files given (batch files, or dataset files) */
    dt_dataset      *ds;
    dt_data         *data;
    cm_chan_client  *cl;
    cm_shard_writer *w;
    uint64_t        *hashes; /* [batches]: the request's cm_shard_batch_hash, set at submit */
    int32_t          layers[CM_SHARD_MAX_LAYERS];
    uint32_t         n_layers;
    /* progress */
    uint64_t stored, skipped, restored, bytes_written, raw_bytes;
} pc_run;

static void progress(const pc_run *r, const char *what) {
    const double mb = (double)r->bytes_written / 1e6;
    CM_LOG_INFO("precompute %s: %llu/%d batches (%llu stored now, %llu already stored%s, %llu restored), "
                "%.1f MB written, ratio %.2fx",
                what, (unsigned long long)(r->stored + r->skipped + r->restored), dt_data_count(r->data),
                (unsigned long long)r->stored, (unsigned long long)r->skipped,
                r->a.verify_tail ? "" : " and verified", (unsigned long long)r->restored, mb,
                r->bytes_written ? (double)r->raw_bytes / (double)r->bytes_written : 0.0);
}

static cm_status store_answer(pc_run *r, cm_chan_answer *ans) {
    if (ans->status != CM_OK)
        return CM_FAIL(ans->status, "the server cannot answer batch %llu ('%s'): %s",
                       (unsigned long long)ans->batch_id, dt_data_path(r->data, (int)ans->batch_id),
                       ans->message);
    const int damaged = cm_shard_writer_damaged(r->w, ans->batch_id);
    if (!damaged && cm_shard_writer_has(r->w, ans->batch_id)) /* stored meanwhile: never twice */
        return CM_OK;
    const void *head, *data;
    size_t      head_len, data_len;
    CM_TRY(cm_chan_client_frames(r->cl, ans, &head, &head_len, &data, &data_len));
    if (damaged) {
        CM_TRY(cm_shard_writer_restore_parts(r->w, ans->batch_id, r->hashes[ans->batch_id], head, head_len,
                                             data, data_len));
        r->restored++;
    } else {
        CM_TRY(cm_shard_writer_append_parts(r->w, ans->batch_id, r->hashes[ans->batch_id], head, head_len,
                                            data, data_len));
        r->stored++;
    }
    r->bytes_written += head_len + data_len + CM_SHARD_RECORD_HEADER_SIZE;
    for (uint32_t i = 0; i < ans->n_tensors; i++)
        r->raw_bytes += ans->tensors[i].bytes;
    if ((r->stored + r->skipped + r->restored) % (uint64_t)r->a.progress_every == 0)
        progress(r, "progress");
    return CM_OK;
}

static cm_status precompute(pc_run *r) {
    pc_args *a = &r->a;
    CM_TRY(parse_layers(a->layers, r->layers, &r->n_layers));
    if (a->dataset) {
        CM_TRY(dt_data_split_list(a->dataset, &r->paths, &r->n_paths));
        CM_TRY(dt_dataset_open(&r->ds, (const char *const *)r->paths, r->n_paths, a->token_budget, INT32_MAX));
        CM_TRY(dt_data_open_dataset(&r->data, r->ds, 0, 0, NULL));
    } else {
        if (a->data)
            CM_TRY(dt_data_split_list(a->data, &r->paths, &r->n_paths));
        else
            CM_TRY(dt_data_list_dir(a->data_dir, &r->paths, &r->n_paths));
        CM_TRY(dt_data_open_source(&r->data, (const char *const *)r->paths, r->n_paths, 0, 0, INT32_MAX,
                                   NULL));
    }
    const int n_batches = dt_data_count(r->data);
    r->hashes = calloc((size_t)n_batches, sizeof *r->hashes);
    if (!r->hashes)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d batch hashes", n_batches);

    cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cc.endpoint = a->server;
    cc.name = a->name;
    cc.credits = (uint32_t)a->credits;
    cc.encoding = a->encoding;
    cc.accept = 0; /* the store's identity names one encoding */
    cc.keep_frames = 1;
    cc.curve_server_key = a->curve_server_key;
    cc.curve_secret_key = a->curve_secret_key;
    CM_TRY(cm_chan_client_create(&r->cl, &cc));
    cm_proto_welcome wl;
    cm_status        st;
    st = dt_live_connect(r->cl, a->server, a->timeout_ms, &g_signal, &wl); /* stops on a signal */
    if (g_signal)
        return CM_OK;
    if (st == CM_ERR_TIMEOUT) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        return CM_FAIL(CM_ERR_TIMEOUT, "no target-server answered at '%s' within --timeout-ms %lld (%s)",
                       a->server, (long long)a->timeout_ms, why);
    }
    CM_TRY(st);
    for (uint32_t i = 0; i < r->n_layers; i++)
        if ((uint32_t)r->layers[i] >= wl.n_layers)
            return CM_FAIL(CM_ERR_INVALID_ARG, "--layers: layer %d is outside target '%s' layers [0, %u)",
                           r->layers[i], wl.name, wl.n_layers);
    if ((int64_t)dt_data_max_tokens(r->data) > (int64_t)wl.max_tokens)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "the largest batch has %lld tokens but the server takes at most %u; start it with a larger "
            "--max-tokens or repack the data",
            (long long)dt_data_max_tokens(r->data), wl.max_tokens);

    cm_shard_identity id = {.target_id = wl.target_id,
                            .weights_id = wl.weights_id,
                            .hidden_dtype = wl.hidden_dtype,
                            .encoding = a->encoding,
                            .hidden_size = wl.hidden_size,
                            .n_layers = r->n_layers};
    snprintf(id.target_name, sizeof id.target_name, "%s", wl.name);
    memcpy(id.layer_ids, r->layers, r->n_layers * sizeof *r->layers);
    cm_shard_writer_config wc = CM_SHARD_WRITER_CONFIG_DEFAULT;
    wc.fsync_every = 1; /* answers are large and slow to make: keep each one once written */
    wc.verify = !a->verify_tail;
    CM_TRY(cm_shard_writer_create(&r->w, a->out, &id, &wc));
    if (cm_shard_writer_n_damaged(r->w))
        CM_LOG_WARN("precompute: %llu stored records of '%s' are damaged (listed above): asking the server for "
                    "them again to restore them in place",
                    (unsigned long long)cm_shard_writer_n_damaged(r->w), a->out);
    CM_LOG_INFO(
        "precompute: %d batches from target '%s' (hidden %u %s, layers %s, %s) into '%s'; %llu already "
        "stored",
        n_batches, wl.name, wl.hidden_size, cm_dtype_name(wl.hidden_dtype), a->layers,
        cm_encoding_name(a->encoding), a->out, (unsigned long long)cm_shard_writer_count(r->w));

    int     next = 0;
    int64_t waited = 0;
    while (!g_signal) {
        while (next < n_batches && cm_chan_client_pending(r->cl) < (uint32_t)a->credits) {
            if (cm_shard_writer_has(r->w, (uint64_t)next) && !cm_shard_writer_damaged(r->w, (uint64_t)next)) {
                r->skipped++;
                next++;
                continue;
            }
            dt_batch b;
            CM_TRY(dt_data_load(r->data, next, &b));
            r->hashes[next] =
                cm_shard_batch_hash(b.input_ids, (uint32_t)b.T, b.cu_seqlens, (uint32_t)b.n_seq);
            CM_TRY(cm_chan_client_submit(r->cl, (uint64_t)next, b.input_ids, (uint32_t)b.T, b.cu_seqlens,
                                         (uint32_t)b.n_seq, r->layers, r->n_layers));
            next++;
        }
        if (next == n_batches && cm_chan_client_pending(r->cl) == 0)
            break;
        cm_chan_answer *ans = NULL;
        st = cm_chan_client_recv(r->cl, 200, &ans);
        if (st == CM_ERR_TIMEOUT) {
            if ((waited += 200) >= a->timeout_ms)
                return CM_FAIL(CM_ERR_TIMEOUT, "no answer from '%s' for %lld ms (is the target-server up?)",
                               a->server, (long long)a->timeout_ms);
            continue;
        }
        CM_TRY(st);
        waited = 0;
        st = store_answer(r, ans);
        cm_chan_client_release(r->cl, &ans);
        CM_TRY(st);
    }
    cm_shard_entry e;
    if (!g_signal && cm_shard_writer_first_damaged(r->w, &e))
        return CM_FAIL(CM_ERR_FORMAT,
                       "shard directory '%s': shard-%05u.bin offset %llu (batch %llu) is damaged and cannot be "
                       "restored: the data given has %d batches and not this one (%llu damaged records "
                       "remain); run precompute with the data the store was made from, or into a new "
                       "directory",
                       a->out, e.shard, (unsigned long long)e.offset, (unsigned long long)e.batch_id, n_batches,
                       (unsigned long long)cm_shard_writer_n_damaged(r->w));
    return CM_OK;
}

int dt_cmd_precompute(int argc, char **argv) {
    pc_run *r = calloc(1, sizeof *r);
    if (!r) {
        fprintf(stderr, "drafter-trainer precompute: out of memory\n");
        return 1;
    }
    int rc = parse_args(argc, argv, &r->a);
    if (rc != 0) {
        free(r);
        return rc == 1 ? 0 : 2;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    struct sigaction old_int, old_term;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);

    cm_status st = precompute(r);
    char      msg[1024];
    snprintf(msg, sizeof msg, "%s", st != CM_OK ? cm_last_error() : "");
    cm_chan_client_destroy(&r->cl);
    cm_status cst = cm_shard_writer_close(&r->w); /* durable: everything appended so far */
    if (st == CM_OK && cst != CM_OK) {
        st = cst;
        snprintf(msg, sizeof msg, "%s", cm_last_error());
    }
    if (st == CM_OK && r->data)
        progress(r, g_signal ? "stopped" : "done");
    dt_data_destroy(&r->data);
    dt_dataset_destroy(&r->ds);
    dt_data_free_list(r->paths, r->n_paths);
    free(r->hashes);
    free(r);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer precompute: %s: %s\n", cm_status_str(st), msg);
        return 1;
    }
    if (g_signal)
        return 128 + (int)g_signal;
    return 0;
}
