/* target-server/cmd/ts_serve_cmd.c — the command line of `target-server serve` (see --help):
 * its options checked and turned into ts_serve_args for ts_serve_run (ts_serve.c), and
 * --curve-keygen. */
#include "ts_cmd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_chan.h"
#include "cm_log.h"
#include "ts_serve.h"
#include "ts_split.h"

#define CMD "target-server serve"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: target-server serve --model DIR [options]\n"
        "\n"
        "Loads the target once and answers hidden-state requests from drafter-trainers over ZeroMQ\n"
        "until SIGTERM or SIGINT (then finishes the forward in progress, says BYE, exits 0).\n"
        "\n"
        "  --model DIR               Hugging Face model directory (config.json + safetensors)\n"
        "  --init checkpoint|random  weights from the checkpoint (default) or, for benchmarks, filled\n"
        "                            on the device from --seed with the checkpoint's shapes (then\n"
        "                            --model or --config may name a config.json alone)\n"
        "  --config FILE             the config.json for --init random (same as --model FILE)\n"
        "  --seed N                  seed of --init random (default 1)\n"
        "  --device cpu|cuda         kernel backend (default cpu)\n"
        "  --gpu LIST                cuda device ordinals, comma-separated: one model replica per GPU\n"
        "                            behind the one endpoint (default 0)\n"
        "  --replicas N              model replicas (default: one per --gpu entry, or per --stages\n"
        "                            entries; on cuda without --gpu, GPUs 0..N-1); each answers\n"
        "                            requests on its own\n"
        "  --stages N                split each replica's layers over N GPUs (default 1), for a\n"
        "                            target larger than one GPU: --gpu lists a replica's N GPUs,\n"
        "                            then the next replica's; a worker per stage keeps up to N\n"
        "                            packs in flight; answers go through host memory; decoding\n"
        "                            keeps its state on the stages (docs/target.md)\n"
        "  --precision bf16|fp32|fp8 cuda matrix products (default bf16, fp8 for an FP8 checkpoint;\n"
        "                            as dump)\n"
        "  --bind ENDPOINT           tcp://HOST:PORT (PORT may be '*') or ipc://PATH\n"
        "                            (default tcp://127.0.0.1:5555); a non-loopback address needs\n"
        "                            --curve-secret-key and --curve-client-keys\n"
        "  --endpoint-file PATH      write the bound endpoint (port resolved) to PATH once bound\n"
        "  --name NAME               target name shown to trainers (default: the model directory's)\n"
        "  --credits N               requests queued per trainer (default 4)\n"
        "  --threads N               compression threads (default: half the CPUs, 2 to 16)\n"
        "  --encoding LIST           encodings offered, comma-separated: raw, zstd, zstd-byteplane,\n"
        "                            fp8-zstd (lossy), or 'lossless' (default) or 'all'; each trainer\n"
        "                            picks one in its requests; with --device cuda and NCCL, trainers\n"
        "                            on a GPU of this host may also ask for 'nccl' (GPU to GPU, raw)\n"
        "  --zstd-level N            zstd level (default 1)\n"
        "  --dtype bf16|f32          dtype of the hidden states sent (default bf16, rounded RNE)\n"
        "  --max-tokens N            largest packed batch accepted (default 16384); on cuda each\n"
        "                            replica runs one forward of that size at start-up, so its memory\n"
        "                            is taken then, not during serving\n"
        "  --max-layers N            most layers per request (default 8)\n"
        "  --heartbeat-ms N          heartbeat to idle trainers (default 1000)\n"
        "  --peer-timeout-ms N       drop a trainer silent this long, with its queued work (default 5000)\n"
        "  --stats-interval S        per-session log line every S seconds (default 30; 0 = off)\n"
        "  --curve-secret-key FILE   this server's CURVE secret key (Z85 text)\n"
        "  --curve-client-keys DIR   accept only trainers whose public key is a DIR/*.pub file\n"
        "  --curve-keygen PREFIX     write a new key pair PREFIX.key (secret) and PREFIX.pub, then exit\n"
        "  --decode-seqs N           sequences decoded at once for clients such as `drafter-trainer\n"
        "                            eval` (default 16; 0 turns decoding off and leaves the LM head\n"
        "                            unloaded); their caches take device memory at the first step\n"
        "  --decode-max-len N        tokens per decoded sequence, prompt included (default 2048)\n"
        "  --decode-max-step N       tokens verified in one step over its sequences (default 1024)\n"
        "  --decode-bind ENDPOINT    the decoding endpoint (default: --bind's host on a free port, or\n"
        "                            ipc://PATH-decode; clients find it through STATUS)\n"
        "  --decode-idle-s S         a decoding client silent this long loses its sequences (default 300)\n"
        "  --log-level L             debug, info, warn, error, off (default info; env TANDEM_LOG)\n");
}

/* --gpu 0 or --gpu 0,1,3: distinct ordinals. */
static int parse_gpus(const char *val, int *gpus, int *n) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", val);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int64_t v;
        if (*n == TS_MAX_REPLICAS) {
            fprintf(stderr, "target-server serve: --gpu '%s': at most %d GPUs\n", val, TS_MAX_REPLICAS);
            return 0;
        }
        if (!cm_parse_i64(CMD, "--gpu", tok, 0, 1023, &v))
            return 0;
        for (int i = 0; i < *n; i++)
            if (gpus[i] == (int)v) {
                fprintf(stderr, "target-server serve: --gpu '%s' names GPU %lld twice\n", val, (long long)v);
                return 0;
            }
        gpus[(*n)++] = (int)v;
    }
    if (!*n)
        fprintf(stderr, "target-server serve: --gpu '%s' names no GPU\n", val);
    return *n > 0;
}

static int parse_encodings(const char *val, uint32_t *mask) {
    if (strcmp(val, "lossless") == 0) {
        *mask = CM_ENCODING_LOSSLESS_MASK;
        return 1;
    }
    if (strcmp(val, "all") == 0) {
        *mask = (1u << CM_ENCODING_END) - 1;
        return 1;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", val);
    *mask = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        cm_encoding e;
        if (cm_encoding_parse(tok, &e) != CM_OK) {
            fprintf(stderr, "target-server serve: --encoding '%s': %s\n", val, cm_last_error());
            return 0;
        }
        *mask |= 1u << e;
    }
    if (!*mask)
        fprintf(stderr, "target-server serve: --encoding '%s' names no encoding\n", val);
    return *mask != 0;
}

int ts_serve_main(int argc, char **argv) {
    static const char *const dtypes[] = {"bf16", "f32", NULL};
    ts_target_args           t = TS_TARGET_ARGS_DEFAULT;
    ts_serve_args            a = {.bind = "tcp://127.0.0.1:5555",
                                  .threads = cm_chan_default_threads(),
                                  .zstd_level = 1,
                                  .heartbeat_ms = 1000,
                                  .peer_timeout_ms = 5000,
                                  .stats_s = 30,
                                  .credits = 4,
                                  .max_tokens = 16384,
                                  .max_layers = 8,
                                  .decode_seqs = 16,
                                  .decode_max_len = 2048,
                                  .decode_max_step = 1024,
                                  .decode_idle_s = 300,
                                  .stages = 1,
                                  .encodings = CM_ENCODING_LOSSLESS_MASK,
                                  .dtype = CM_DTYPE_BF16};
    const char              *v = NULL;
    int                      k = 0;
    cm_args                  p;
    cm_args_init(&p, CMD, argc, argv);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (ts_args_target(&p, &t) || cm_args_str(&p, "--bind", &a.bind) ||
                   cm_args_str(&p, "--name", &a.name) ||
                   cm_args_str(&p, "--endpoint-file", &a.endpoint_file) ||
                   cm_args_str(&p, "--curve-secret-key", &a.curve_secret) ||
                   cm_args_str(&p, "--curve-client-keys", &a.curve_clients) ||
                   cm_args_str(&p, "--curve-keygen", &a.keygen) ||
                   cm_args_int(&p, "--replicas", 1, TS_MAX_REPLICAS, &a.replicas) ||
                   cm_args_int(&p, "--stages", 1, TS_SPLIT_MAX_STAGES, &a.stages) ||
                   cm_args_int(&p, "--credits", 1, 1024, &a.credits) ||
                   cm_args_int(&p, "--threads", 1, 256, &a.threads) ||
                   cm_args_int(&p, "--zstd-level", -7, 22, &a.zstd_level) ||
                   cm_args_int(&p, "--max-tokens", 1, 1 << 24, &a.max_tokens) ||
                   cm_args_int(&p, "--max-layers", 1, 256, &a.max_layers) ||
                   cm_args_int(&p, "--heartbeat-ms", 10, 600000, &a.heartbeat_ms) ||
                   cm_args_int(&p, "--peer-timeout-ms", 20, 3600000, &a.peer_timeout_ms) ||
                   cm_args_int(&p, "--stats-interval", 0, 86400, &a.stats_s) ||
                   cm_args_str(&p, "--decode-bind", &a.decode_bind) ||
                   cm_args_int(&p, "--decode-seqs", 0, 4096, &a.decode_seqs) ||
                   cm_args_int(&p, "--decode-max-len", 2, 1 << 22, &a.decode_max_len) ||
                   cm_args_int(&p, "--decode-max-step", 1, 1 << 20, &a.decode_max_step) ||
                   cm_args_int(&p, "--decode-idle-s", 1, 86400, &a.decode_idle_s))
            ;
        else if (cm_args_str(&p, "--encoding", &v)) {
            if (!p.bad && !parse_encodings(v, &a.encodings))
                p.bad = 1;
        } else if (cm_args_str(&p, "--gpu", &v)) {
            if (!p.bad && !parse_gpus(v, a.gpus, &a.n_gpus))
                p.bad = 1;
        } else if (cm_args_choice(&p, "--dtype", dtypes, &k)) {
            if (!p.bad)
                a.dtype = k == 0 ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        } else
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (t.model && !a.keygen) {
        cm_status st = ts_args_precision(&t); /* an FP8 checkpoint's default; a config Tandem cannot read */
        if (st != CM_OK) {
            fprintf(stderr, "target-server serve: %s: %s\n", cm_status_str(st), cm_last_error());
            return 1;
        }
    }
    a.model = t.model;
    a.device = t.device;
    a.init_random = t.init_random;
    a.seed = t.seed;
    a.mode = t.mode;
    a.fp8 = t.fp8;
    if (a.keygen) {
        cm_status st = cm_chan_curve_keygen(a.keygen);
        if (st != CM_OK) {
            fprintf(stderr, "target-server serve: %s: %s\n", cm_status_str(st), cm_last_error());
            return 1;
        }
        printf("wrote %s.key (secret: keep it private) and %s.pub (public: give it to the other side)\n",
               a.keygen, a.keygen);
        return 0;
    }
    char what[96];
    snprintf(what, sizeof what, "--name '%.70s'", a.name ? a.name : "");
    if (a.name && cm_proto_name_check(what, a.name) != CM_OK) { /* trainers see it: the wire's rules */
        fprintf(stderr, "target-server serve: %s\n", cm_last_error());
        return 2;
    }
    if (!a.model) {
        fprintf(
            stderr,
            "target-server serve: --model DIR is required (or --init random --config FILE; see --help)\n");
        return 2;
    }
    if (a.n_gpus % a.stages) {
        fprintf(stderr, "target-server serve: --gpu names %d GPUs for replicas of %d stages each; give %d GPUs per "
                        "replica, replica after replica\n", a.n_gpus, a.stages, a.stages);
        return 2;
    }
    if (a.n_gpus && a.replicas && a.n_gpus != a.replicas * a.stages) {
        fprintf(stderr,
                "target-server serve: --gpu names %d GPUs but --replicas %d of %d stages need %d; give one GPU per "
                "replica and stage\n",
                a.n_gpus, a.replicas, a.stages, a.replicas * a.stages);
        return 2;
    }
    if (a.n_gpus > 1 && strcmp(a.device, "cuda") != 0) {
        fprintf(stderr,
                "target-server serve: --gpu %d,... needs --device cuda (use --replicas N on the cpu)\n",
                a.gpus[0]);
        return 2;
    }
    if (!a.replicas)
        a.replicas = a.n_gpus ? a.n_gpus / a.stages : 1;
    if (a.replicas * a.stages > TS_MAX_REPLICAS) {
        fprintf(stderr, "target-server serve: %d replicas of %d stages: at most %d contexts in all\n", a.replicas,
                a.stages, TS_MAX_REPLICAS);
        return 2;
    }
    const char *stream_env = getenv("TANDEM_SERVE_STREAM");
    a.stream = !stream_env || strcmp(stream_env, "0") != 0;
    for (int i = a.n_gpus; i < a.replicas * a.stages; i++) /* cuda without --gpu: 0..N-1; cpu: ignored */
        a.gpus[i] = strcmp(a.device, "cuda") == 0 ? i : 0;
    if (a.peer_timeout_ms <= a.heartbeat_ms) {
        fprintf(stderr, "target-server serve: --peer-timeout-ms %d must exceed --heartbeat-ms %d\n",
                a.peer_timeout_ms, a.heartbeat_ms);
        return 2;
    }
    cm_status st = ts_serve_run(&a);
    if (st != CM_OK) {
        fprintf(stderr, "target-server serve: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
