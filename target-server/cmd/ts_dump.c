/* target-server/cmd/ts_dump.c — `target-server dump --model DIR --input IN.safetensors --out
 * OUT.safetensors [options]` (docs/checks.md): runs the frozen forward over one packed batch and
 * writes layer_<i>, final_norm and logits as F32, and a MoE target's routing as experts_<i>. Every failure ends with one message and exit
 * status 1; usage errors exit 2. */
#include "ts_cmd.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_safetensors.h"
#include "kn_backend.h"
#include "ts_model.h"
#include "ts_split.h"

void ts_dump_usage(FILE *f) {
    fprintf(f,
            "usage: target-server <command> [options]\n"
            "\n"
            "commands:\n"
            "  dump    run the frozen forward over one packed batch and write hidden states\n"
            "  serve   answer hidden-state requests from trainers over ZeroMQ (serve --help)\n"
            "  status  ask a running server what it serves, to whom and how fast (status --help)\n"
            "  generate  answer a tokenized dataset's prompts with the target: regenerated responses\n"
            "          (generate --help)\n"
            "\n"
            "dump options:\n"
            "  --model DIR              Hugging Face model directory (config.json + safetensors)\n"
            "  --init checkpoint|random weights from the checkpoint (default) or filled from --seed\n"
            "                           with the checkpoint's shapes, the same on cpu and cuda\n"
            "                           (bf16 precision, the default, rounds them to bf16 on cpu too)\n"
            "                           (then --model or --config may name a config.json alone)\n"
            "  --config FILE            the config.json for --init random (same as --model FILE)\n"
            "  --seed N                 seed of --init random (default 1)\n"
            "  --input IN.safetensors   input_ids (I32 [T]) and cu_seqlens (I32 [N+1])\n"
            "  --out OUT.safetensors    receives layer_<i> (F32 [T, D]), final_norm (F32 [T, D]),\n"
            "                           and with --logits, logits (F32 [T, V]); a MoE target adds\n"
            "                           experts_<i> (I32 [T, K]) for every sparse layer that ran:\n"
            "                           each token's chosen experts, largest weight first\n"
            "  --device cpu|cuda        kernel backend (default cpu)\n"
            "  --gpu N[,M...]           cuda device ordinals (default 0): one, or one per --stages\n"
            "  --stages N               split the layers over N pipeline stages (default 1), each on\n"
            "                           its own context: the --gpu entries, or all on the one given\n"
            "                           (on the cpu, N cpu contexts); the output is the same\n"
            "  --precision bf16|fp32|fp8  cuda matrix products: bf16 inputs and weights with fp32\n"
            "                           accumulation (default), fp32 throughout, or FP8 weights and\n"
            "                           inputs in 128-blocks (docs/fp8.md; the default for an FP8\n"
            "                           checkpoint, which bf16 and fp32 run dequantized)\n"
            "  --layers all|i,j,...     layers to write (default all); the forward stops after the\n"
            "                           last one, and final_norm is written only when every layer ran\n"
            "  --logits                 also write logits (runs every layer)\n"
            "  --log-level L            debug, info, warn, error, off (default info; env TANDEM_LOG)\n");
}

typedef struct dump_args {
    ts_target_args t;
    const char    *input, *out, *layers, *gpus;
    int            logits, stages;
} dump_args;

/* Parses "all" or a comma list into a sorted unique list; *n = -1 for all. */
static cm_status parse_layers(const char *s, int n_total, int *layers, int *n) {
    if (!s || strcmp(s, "all") == 0) {
        *n = -1;
        return CM_OK;
    }
    char *seen = calloc((size_t)n_total, 1);
    if (!seen) return CM_FAIL(CM_ERR_NOMEM, "cannot parse --layers");
    const char *p = s;
    while (*p) {
        char *end;
        errno  = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || (*end && *end != ',')) {
            free(seen);
            return CM_FAIL(CM_ERR_INVALID_ARG, "--layers '%s': expected 'all' or comma-separated layer numbers", s);
        }
        if (v < 0 || v >= n_total) {
            free(seen);
            return CM_FAIL(CM_ERR_INVALID_ARG, "--layers: layer %ld is out of range; the model has layers 0..%d", v,
                           n_total - 1);
        }
        seen[v] = 1;
        p       = *end ? end + 1 : end;
    }
    *n = 0;
    for (int i = 0; i < n_total; i++)
        if (seen[i]) layers[(*n)++] = i;
    free(seen);
    return *n ? CM_OK : CM_FAIL(CM_ERR_INVALID_ARG, "--layers '%s' names no layer", s);
}

/* Reads an I32 vector named name from the input file. */
static cm_status read_i32(const cm_st *in, const char *path, const char *name, const int32_t **out, int64_t *n) {
    const cm_st_tensor *t = cm_st_find(in, name);
    if (!t) return CM_FAIL(CM_ERR_FORMAT, "'%s' has no tensor '%s' (I32 [%s])", path, name,
                           strcmp(name, "input_ids") == 0 ? "T" : "N+1");
    CM_TRY(cm_st_expect_dtype(t, CM_DTYPE_I32));
    if (t->n_dims != 1)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': tensor '%s' has %d dimensions, expected 1", path, name, t->n_dims);
    *out = t->data;
    *n   = t->shape[0];
    return CM_OK;
}

static cm_status run_dump(dump_args *a) {
    cm_status         st;
    const kn_backend *be  = NULL;
    kn_ctx           *ctxs[TS_SPLIT_MAX_STAGES] = {0};
    ts_split         *m   = NULL;
    cm_st            *in  = NULL;
    cm_st_writer     *wr  = NULL;
    int32_t          *ids = NULL, *cu = NULL;
    float           **outs  = NULL;
    float            *final = NULL, *logits = NULL;
    int32_t          *experts = NULL;
    int              *layers = NULL;
    int               n_cap  = 0;

    CM_TRY_GOTO(kn_backend_get(a->t.device, &be), st, fail);
    CM_TRY_GOTO(ts_args_precision(&a->t), st, fail); /* an FP8 checkpoint's default: before the context's mode */
    CM_TRY_GOTO(ts_args_stage_ctxs(be, a->gpus, a->stages, a->t.mode, ctxs), st, fail);

    /* The input is read first: a bad batch costs no model load. */
    CM_TRY_GOTO(cm_st_open_file(&in, a->input), st, fail);
    const int32_t *ids_in, *cu_in;
    int64_t        T, n_cu;
    CM_TRY_GOTO(read_i32(in, a->input, "input_ids", &ids_in, &T), st, fail);
    CM_TRY_GOTO(read_i32(in, a->input, "cu_seqlens", &cu_in, &n_cu), st, fail);
    if (n_cu < 2 || n_cu - 1 > T) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "'%s': cu_seqlens has %lld values for %lld tokens; expected 2..T+1",
                     a->input, (long long)n_cu, (long long)T);
        goto fail;
    }
    /* safetensors data may be unaligned: copy into aligned arrays */
    ids = malloc((size_t)T * sizeof *ids);
    cu  = malloc((size_t)n_cu * sizeof *cu);
    if (!ids || !cu) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the batch of %lld tokens", (long long)T);
        goto fail;
    }
    memcpy(ids, ids_in, (size_t)T * sizeof *ids);
    memcpy(cu, cu_in, (size_t)n_cu * sizeof *cu);
    const int n_seq = (int)(n_cu - 1);

    cm_target_cfg cfg;
    CM_TRY_GOTO(cm_target_cfg_load(&cfg, a->t.model), st, fail);
    CM_TRY_GOTO(ts_batch_validate(&cfg, ids, T, cu, n_seq), st, fail);
    layers = malloc((size_t)cfg.n_layers * sizeof *layers);
    if (!layers) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the layer list");
        goto fail;
    }
    CM_TRY_GOTO(parse_layers(a->layers, cfg.n_layers, layers, &n_cap), st, fail);
    int all = n_cap < 0;
    if (all) {
        n_cap = cfg.n_layers;
        for (int i = 0; i < n_cap; i++) layers[i] = i;
    }
    int             full = all || a->logits || layers[n_cap - 1] == cfg.n_layers - 1;
    ts_model_config mc   = {.dir          = a->t.model,
                            .backend      = be,
                            .n_layers     = full ? cfg.n_layers : layers[n_cap - 1] + 1,
                            .load_head    = full,
                            /* random weights are made bf16 on cpu too under bf16 precision: the
                               values a cuda bf16 run uses, so the two compare without weight rounding */
                            .bf16_weights = a->t.mode == KN_GEMM_MODE_BF16 && (strcmp(be->name, "cpu") != 0 || a->t.init_random),
                            .fp8          = a->t.fp8,
                            .init_random  = a->t.init_random,
                            .seed         = a->t.seed};
    CM_TRY_GOTO(ts_split_load(&m, &mc, a->stages, ctxs, NULL), st, fail);

    const size_t TD = (size_t)T * (size_t)cfg.hidden_size;
    outs            = calloc((size_t)n_cap, sizeof *outs);
    if (!outs) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the outputs");
        goto fail;
    }
    for (int i = 0; i < n_cap; i++) {
        outs[i] = malloc(TD * sizeof(float));
        if (!outs[i]) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for layer %d", TD * sizeof(float), layers[i]);
            goto fail;
        }
    }
    if (full && !(final = malloc(TD * sizeof(float)))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the final norm output");
        goto fail;
    }
    if (a->logits && !(logits = malloc((size_t)T * (size_t)cfg.vocab_size * sizeof(float)))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate logits of %lld x %d floats", (long long)T, cfg.vocab_size);
        goto fail;
    }
    const int     ran = full ? cfg.n_layers : layers[n_cap - 1] + 1; /* layers the forward runs */
    const int64_t K   = cfg.n_experts_per_tok;
    if (cfg.n_experts && !(experts = malloc((size_t)ran * (size_t)(T * K) * sizeof *experts))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the routing of %d layers", ran);
        goto fail;
    }
    ts_capture cap = {.n_layers = n_cap, .layers = layers, .layer_out = outs, .final_norm = final, .logits = logits,
                      .experts = experts};
    CM_TRY_GOTO(ts_split_forward(m, ids, T, cu, n_seq, &cap), st, fail);

    CM_TRY_GOTO(cm_st_writer_create(&wr), st, fail);
    const int64_t shape_td[2] = {T, cfg.hidden_size};
    for (int i = 0; i < n_cap; i++) {
        char name[32];
        snprintf(name, sizeof name, "layer_%d", layers[i]);
        CM_TRY_GOTO(cm_st_writer_add(wr, name, CM_DTYPE_F32, 2, shape_td, outs[i]), st, fail);
    }
    if (final) CM_TRY_GOTO(cm_st_writer_add(wr, "final_norm", CM_DTYPE_F32, 2, shape_td, final), st, fail);
    if (logits) {
        const int64_t shape_tv[2] = {T, cfg.vocab_size};
        CM_TRY_GOTO(cm_st_writer_add(wr, "logits", CM_DTYPE_F32, 2, shape_tv, logits), st, fail);
    }
    for (int i = 0; experts && i < ran; i++) {
        if (!cm_target_layer_moe(&cfg, i)) continue;
        char          name[32];
        const int64_t shape_tk[2] = {T, K};
        snprintf(name, sizeof name, "experts_%d", i);
        CM_TRY_GOTO(cm_st_writer_add(wr, name, CM_DTYPE_I32, 2, shape_tk, experts + (size_t)i * (size_t)(T * K)), st,
                    fail);
    }
    CM_TRY_GOTO(cm_st_writer_set_metadata(wr, "producer", "tandem target-server dump"), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(wr, "device", be->name), st, fail);
    CM_TRY_GOTO(cm_st_writer_set_metadata(wr, "precision", ts_args_precision_name(&a->t)), st, fail);
    CM_TRY_GOTO(cm_st_writer_write(wr, a->out), st, fail);
    CM_LOG_INFO("wrote '%s': %d layers%s%s, %lld tokens in %d sequences", a->out, n_cap,
                final ? ", final_norm" : "", logits ? ", logits" : "", (long long)T, n_seq);
fail:
    cm_st_writer_destroy(&wr);
    if (outs)
        for (int i = 0; i < n_cap; i++) free(outs[i]);
    free(outs);
    free(final);
    free(logits);
    free(experts);
    free(layers);
    free(ids);
    free(cu);
    cm_st_destroy(&in);
    ts_split_destroy(&m);
    if (be) ts_args_stage_ctxs_free(be, ctxs, a->stages);
    return st;
}

int ts_dump_main(int argc, char **argv) {
    dump_args a = {.t = TS_TARGET_ARGS_DEFAULT, .layers = "all", .stages = 1};
    cm_args   p;
    cm_args_init(&p, "target-server dump", argc, argv);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            ts_dump_usage(stdout);
            return 0;
        } else if (cm_args_flag(&p, "--logits"))
            a.logits = 1;
        else if (ts_args_target(&p, &a.t) || cm_args_str(&p, "--input", &a.input) ||
                 cm_args_str(&p, "--out", &a.out) || cm_args_str(&p, "--layers", &a.layers) ||
                 cm_args_str(&p, "--gpu", &a.gpus) || cm_args_int(&p, "--stages", 1, TS_SPLIT_MAX_STAGES, &a.stages))
            ;
        else
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (!a.t.model || !a.input || !a.out) {
        fprintf(stderr, "target-server dump: --model, --input and --out are required (see --help)\n");
        return 2;
    }
    cm_status st = run_dump(&a);
    if (st != CM_OK) {
        fprintf(stderr, "target-server dump: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
