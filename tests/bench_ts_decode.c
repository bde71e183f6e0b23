/* tests/bench_ts_decode.c — decoding on the target at real scale (not a test; bench/decode_bench.sh
 * runs it beside bench/hf_decode_bench.py): a model with --init random weights (default the 27B
 * deploy config) on one backend, and for each batch of N sequences (--seqs 1,8,32):
 *   - prefill of N prompts of --prompt tokens (one step, states advanced in the forward);
 *   - target-only decoding: steps of one token per sequence, latency and tokens/s;
 *   - verification steps of B tokens per sequence (--blocks 8,16: the anchor and B − 1 drafts, which
 *     random weights reject, so every step commits one token and the sequences stay short):
 *     latency of the whole step (forward over N·B tokens, the head at the draft rows, the commit);
 * printed as a table and written as JSON (--json). Greedy: the head's argmax through lm_ce.
 *   bench_ts_decode [--config FILE] [--device cuda] [--precision bf16|fp32] [--prompt 512]
 *                   [--seqs 1,8,32] [--blocks 8,16] [--steps 16] [--seed 1] [--json OUT] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_log.h"
#include "kn_backend.h"
#include "ts_decode.h"
#include "ts_model.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define CHECK(x)                                                                                             \
    do {                                                                                                     \
        cm_status s_ = (x);                                                                                  \
        if (s_ != CM_OK) {                                                                                   \
            fprintf(stderr, "bench_ts_decode: %s failed: %s: %s\n", #x, cm_status_str(s_), cm_last_error()); \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    for (const char *p = s; *p && n < cap;) {
        out[n++] = atoi(p);
        const char *c = strchr(p, ',');
        if (!c) break;
        p = c + 1;
    }
    return n;
}

typedef struct result {
    int    seqs, block;
    double ms, tokens_per_s; /* block 1: target-only decode; else the verification step */
    double commit_ms;        /* of ms, the commit of the GDN states to the accepted prefix */
} result;

static cm_status one_step(ts_decoder *d, cm_proto_decode *rq, int32_t (*rows)[4]) {
    cm_proto_tensor t[1];
    cm_proto_answer ans = {.tensors = t, .cap_tensors = 1};
    CM_TRY(ts_decoder_step(d, "bench", rq, &ans));
    memcpy(rows, t[0].data, (size_t)rq->n_seqs * 16);
    return CM_OK;
}

int main(int argc, char **argv) {
    const char *cfg = "deploy/configs/qwen3.6-27b/target-config.json", *device = "cuda", *json = NULL;
    const char *seqs_s = "1,8,32", *blocks_s = "8,16";
    int         prompt = 512, steps = 16, fp32 = 0;
    uint64_t    seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--config") && v) cfg = argv[++i];
        else if (!strcmp(a, "--device") && v) device = argv[++i];
        else if (!strcmp(a, "--precision") && v) fp32 = !strcmp(argv[++i], "fp32");
        else if (!strcmp(a, "--prompt") && v) prompt = atoi(argv[++i]);
        else if (!strcmp(a, "--seqs") && v) seqs_s = argv[++i];
        else if (!strcmp(a, "--blocks") && v) blocks_s = argv[++i];
        else if (!strcmp(a, "--steps") && v) steps = atoi(argv[++i]);
        else if (!strcmp(a, "--seed") && v) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--json") && v) json = argv[++i];
        else {
            fprintf(stderr, "bench_ts_decode: unknown argument '%s' (see the top of tests/bench_ts_decode.c)\n", a);
            return 2;
        }
    }
    int seqs[16], blocks[16];
    const int n_seqs = parse_list(seqs_s, seqs, 16), n_blocks = parse_list(blocks_s, blocks, 16);
    const kn_backend *be;
    CHECK(kn_backend_get(device, &be));
    kn_ctx       *ctx;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.gemm_mode     = fp32 ? KN_GEMM_MODE_F32 : KN_GEMM_MODE_BF16;
    CHECK(be->ctx_create(&ctx, &kc));
    ts_model       *m;
    ts_model_config mc = {.dir = cfg, .backend = be, .ctx = ctx, .n_layers = -1, .load_head = 1,
                          .bf16_weights = !fp32 && be != kn_backend_cpu(), .init_random = 1, .seed = seed};
    const double t_load = now_s();
    CHECK(ts_model_load(&m, &mc));
    const cm_target_cfg *c = ts_model_cfg(m);
    printf("model %s: %d layers, hidden %d, vocab %d, %s %s; loaded in %.1f s\n", cfg, c->n_layers, c->hidden_size,
           c->vocab_size, device, fp32 ? "fp32" : "bf16", now_s() - t_load);
    int max_seqs = 1, max_block = 1;
    for (int i = 0; i < n_seqs; i++) max_seqs = seqs[i] > max_seqs ? seqs[i] : max_seqs;
    for (int i = 0; i < n_blocks; i++) max_block = blocks[i] > max_block ? blocks[i] : max_block;
    const int64_t     max_len = prompt + (int64_t)(steps + 2) * (n_blocks + 1) * max_block + 8;
    ts_decoder_config dc = {.max_seqs = max_seqs, .max_len = max_len, .max_step = (int64_t)max_seqs * max_block,
                            .max_forward = 16384, .hidden_dtype = CM_DTYPE_BF16};
    printf("decoder: %d sequences of %lld tokens: %.2f GB of cache\n", max_seqs, (long long)max_len,
           (double)ts_decoder_bytes(c, &dc) / 1e9);
    result  res[64];
    int     n_res = 0;
    int32_t (*rows)[4] = calloc((size_t)max_seqs, sizeof *rows);
    cm_proto_decode_seq *recs = calloc((size_t)max_seqs, sizeof *recs);
    int32_t *toks = malloc((size_t)max_seqs * (size_t)(prompt > max_block ? prompt : max_block) * 4);
    for (int si = 0; si < n_seqs; si++) {
        const int   N = seqs[si];
        ts_decoder *d;
        CHECK(ts_decoder_create(m, &dc, &d));
        uint64_t x = seed * 77 + (uint64_t)N;
        for (int64_t t = 0; t < (int64_t)N * prompt; t++) toks[t] = (int32_t)((x = x * 6364136223846793005ull + 1) >> 40) % c->vocab_size;
        for (int s = 0; s < N; s++) recs[s] = (cm_proto_decode_seq){.n_ctx = (uint32_t)prompt, .top_p = 1};
        cm_proto_decode rq = {.id = 1, .op = CM_DECODE_STEP, .encoding = CM_ENCODING_RAW, .n_seqs = (uint32_t)N,
                              .n_tokens = (uint32_t)(N * prompt), .seqs = recs, .tokens = toks};
        double t0 = now_s();
        CHECK(one_step(d, &rq, rows));
        const double prefill_ms = 1e3 * (now_s() - t0);
        printf("  %2d sequences: prefill of %d tokens each %.1f ms (%.0f tokens/s)\n", N, prompt, prefill_ms,
               N * prompt / (prefill_ms / 1e3));
        for (int bi = -1; bi < n_blocks; bi++) {
            const int B = bi < 0 ? 1 : blocks[bi];
            double    total = 0, commit0 = 0;
            for (int k = 0; k < steps + 2; k++) {
                if (k == 2) commit0 = ts_decoder_commit_s(d, NULL);
                for (int s = 0; s < N; s++) {
                    recs[s] = (cm_proto_decode_seq){.handle = (uint32_t)rows[s][0], .base = (uint32_t)rows[s][1],
                                                    .n_ctx = 1, .n_draft = (uint32_t)(B - 1), .top_p = 1};
                    toks[s * B] = rows[s][3];
                    for (int j = 1; j < B; j++) toks[s * B + j] = (rows[s][3] + 17 * j + 1) % c->vocab_size;
                }
                rq.n_tokens = (uint32_t)(N * B);
                t0          = now_s();
                CHECK(one_step(d, &rq, rows));
                if (k >= 2) total += now_s() - t0; /* the first two steps allocate and plan */
            }
            result *r       = &res[n_res++];
            r->seqs         = N;
            r->block        = B;
            r->ms           = 1e3 * total / steps;
            r->tokens_per_s = N / (total / steps);
            r->commit_ms    = 1e3 * (ts_decoder_commit_s(d, NULL) - commit0) / steps;
            if (B == 1)
                printf("    target-only decode: %.2f ms per step, %.0f tokens/s\n", r->ms, r->tokens_per_s);
            else
                printf("    verify B = %2d: %.2f ms per step (%d tokens), of which the commit %.3f ms\n", B, r->ms,
                       N * B, r->commit_ms);
        }
        ts_decoder_destroy(&d);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f, "{\"config\": \"%s\", \"device\": \"%s\", \"precision\": \"%s\", \"prompt\": %d, \"steps\": %d, "
                       "\"results\": [",
                    cfg, device, fp32 ? "fp32" : "bf16", prompt, steps);
            for (int i = 0; i < n_res; i++)
                fprintf(f, "%s{\"seqs\": %d, \"block\": %d, \"ms\": %.4f, \"commit_ms\": %.4f, \"tokens_per_s\": %.2f}",
                        i ? ", " : "", res[i].seqs, res[i].block, res[i].ms, res[i].commit_ms, res[i].tokens_per_s);
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    free(rows);
    free(recs);
    free(toks);
    ts_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return 0;
}
