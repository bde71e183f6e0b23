/* drafter-trainer/cmd/dt_train_args.c — `drafter-trainer train`'s flags (dt_train_args.h): --help,
 * the cm_args loop, the data-parallel rank from the environment and the checks between flags. */
#include "dt_train_args.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_args.h"
#include "cm_log.h"
#include "dt_model.h"
#include "dt_plan.h"

#define CMD "drafter-trainer train"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: drafter-trainer train (--config DRAFTER_CONFIG.json | --init-from DIR) --target TARGET_DIR\n"
        "                             (--data FILE[,FILE...] | --data-dir DIR | --dataset FILE[,FILE...])\n"
        "                             --out RUN_DIR [options]\n"
        "\n"
        "Trains a DFlash drafter on packed batch files (safetensors: input_ids, cu_seqlens, loss_mask I32;\n"
        "target_hidden BF16/F32 [T, n_taps*hidden]; see drafter-trainer/feed/dt_data.h) or on a tokenized\n"
        "dataset of documents that it packs itself (JSONL or binary; see drafter-trainer/feed/dt_dataset.h).\n"
        "\n"
        "  --config FILE            drafter config.json; parameters start from the Qwen3 init (--seed)\n"
        "  --init-from DIR          start from a drafter checkpoint (config.json + model.safetensors)\n"
        "  --target DIR             target model: its frozen embed_tokens and lm_head\n"
        "  --data FILE[,FILE...]    batch files, one packed batch each (one step per batch)\n"
        "  --data-dir DIR           every DIR/*.safetensors, sorted by name\n"
        "  --dataset FILE[,FILE...] tokenized documents (.jsonl or .safetensors), packed into batches of\n"
        "                           at most --token-budget tokens; needs --shards or --server\n"
        "  --token-budget N         tokens per packed batch with --dataset (default 8192)\n"
        "  --dp-rank R --dp-size W  data-parallel rank R of W: positions R, R+W, ... of each epoch's\n"
        "                           order (default: RANK and WORLD_SIZE from the environment, else 0 of 1);\n"
        "                           with --device cuda the ranks all-reduce their gradients over NCCL\n"
        "                           (rendezvous at MASTER_ADDR:MASTER_PORT, default 127.0.0.1:29500; each\n"
        "                           rank needs its own --out), on cpu each rank trains alone on its share\n"
        "  --shards DIR             target_hidden from precomputed shards (drafter-trainer precompute\n"
        "                           over the same data list); the batch files then need no target_hidden\n"
        "  --verify-shards full|lazy full (default): before step 1, check every record the run will read\n"
        "                           (one read of them; the rate is logged); lazy: check each record only\n"
        "                           when its step reads it (a damaged one then stops the run there)\n"
        "  --server EP[,EP...]      target_hidden live from running `target-server serve`s (several:\n"
        "                           step s goes to server s mod n; all must serve the same target)\n"
        "                           (tcp://HOST:PORT or ipc://PATH); the batch files then need no\n"
        "                           target_hidden; mutually exclusive with --shards\n"
        "  --credits N              requests in flight ahead of training with --server (default 4)\n"
        "  --encoding NAME          answers' encoding with --server: raw, zstd, zstd-byteplane (default)\n"
        "                           or fp8-zstd (lossy); nccl (--device cuda, a server on this host with\n"
        "                           --device cuda): GPU to GPU into this trainer's --gpu, no host copy\n"
        "  --timeout-ms N           longest wait for the server with --server (default 300000)\n"
        "  --target-init random     benchmarks: the target is `serve --init random --seed N`: --target is only\n"
        "                           its config (dir or file), the frozen embedding/LM head are random\n"
        "  --target-seed N          that server's --seed (default 1)\n"
        "  --curve-server-key FILE  the server's CURVE public key (a --server on another host)\n"
        "  --curve-secret-key FILE  this trainer's CURVE secret key (default: a fresh pair; a server\n"
        "                           with --curve-client-keys needs its public key)\n"
        "  --out RUN_DIR            metrics.jsonl and checkpoints/step-<N>/ (serving format + state); one\n"
        "                           trainer at a time (RUN_DIR/trainer.lock)\n"
        "  --epochs N               passes over the data (default 6)\n"
        "  --steps N                stop after step N (the schedule still spans every epoch)\n"
        "  --lr X                   peak learning rate (default 6e-4)\n"
        "  --warmup-ratio X         linear warmup share of the steps, then cosine to 0 (default 0.04)\n"
        "  --max-anchors N          anchors (blocks) per batch (default 512)\n"
        "  --loss-decay-gamma G     slot weight exp(-(k-1)/G) (default 7 for block 16, 5 for 10, 4 for 8)\n"
        "  --selector-alpha A       DFlash2: loss = unary + A x selector (default 1)\n"
        "  --selector-warmup-ratio X  DFlash2: the selector term is off for this share of the steps\n"
        "  --selector-ramp-ratio X  DFlash2: then A rises linearly over this share (default 0: at once)\n"
        "  --selector-miss inject|drop\n"
        "                           DFlash2: a label outside the unary top-K replaces the K-th candidate\n"
        "                           (inject, default, as speculators) or leaves the term (drop, SpecForge)\n"
        "  --selector-stop-grad     DFlash2: the selector's gradient stops at its own parameters\n"
        "  --weight-decay X         AdamW decoupled weight decay (default 0)\n"
        "  --clip X                 global grad-norm clip, 0 = off (default 1)\n"
        "  --seed N                 init, shuffle and anchor seed (default 0)\n"
        "  --save-every N           checkpoint every N steps (default 0: only at the end)\n"
        "  --eval-every N           every N steps and at the end, decode --eval-data's prompts speculatively\n"
        "                           with the current weights on a target-server (greedy, as `drafter-trainer\n"
        "                           eval`; the first time also with the target alone): tau, acceptance and\n"
        "                           tokens/s to metrics.jsonl, TensorBoard and the progress stream; the\n"
        "                           training itself is unchanged by it (default 0: off)\n"
        "  --eval-data FILE         held-out tokenized documents (.jsonl or .safetensors); a prompt is a\n"
        "                           document's tokens before its first with loss_mask 1\n"
        "  --eval-prompts K         the first K prompts of --eval-data (default 16)\n"
        "  --eval-max-new M         tokens generated per prompt, EOS included (default 128)\n"
        "  --eval-batch N           sequences per verify step (default 8)\n"
        "  --eval-server EP         the target-server to decode on; its STATUS names its decoding endpoint\n"
        "                           (default: the first --server; needed with --shards or batch files)\n"
        "  --prefetch 0|1           load the next batch (files, shards) on a thread during each step\n"
        "                           (default 1; 0 loads it between steps; live servers pipeline anyway)\n"
        "  --resume                 continue RUN_DIR from checkpoints/latest exactly, once its files\n"
        "                           match their checksums (step-<N>/checksums.json)\n"
        "  --device cpu|cuda        kernel backend (default cpu)\n"
        "  --gpu N                  cuda device (default: LOCAL_RANK modulo the visible devices, else 0)\n"
        "  --precision bf16|fp32    cuda GEMM inputs in bf16 (fp32 accumulate, fp32 master weights) or\n"
        "                           true fp32 (default bf16; the cpu backend always computes in fp32)\n"
        "  --log-every N            print every N-th step's metrics (default 1)\n"
        "  --log-level L            debug, info, warn, error, off (default info)\n"
        "  --progress MODE          auto (a bar on a terminal, else lines), bar, lines or off (stderr)\n"
        "  --no-tensorboard         no RUN_DIR/tb/events.out.tfevents.* (written by default)\n"
        "  --run-config FILE.json   flags from a JSON object {\"lr\": 6e-4, \"resume\": true, ...}; keys are\n"
        "                           the long flags without dashes; the command line overrides the file\n"
        "  --dry-run                print the plan (parameters, memory per GPU, bytes per token, target\n"
        "                           GPUs per trainer GPU) from the configs, and exit; needs no data\n"
        "  --plan-seq-len N         document length for the plan (default: --token-budget)\n"
        "  --plan-target-tflops X   achieved target prefill TF/s per GPU for the plan (default 550, or 240 for\n"
        "                           a MoE target)\n"
        "  --plan-drafter-tflops X  achieved drafter TF/s per GPU for the plan (default 430)\n"
        "  --plan-ratio X           compression ratio for the plan (default: the measured range)\n");
}

// ---- argument parsing

/* --dp-rank / --dp-size, else RANK / WORLD_SIZE as torchrun and Slurm launchers set them
 * (both or neither), else 0 of 1. 0 ok, else a message was printed. */
static int dp_from_env(train_args *a) {
    if ((a->dp_rank < 0) != (a->dp_size < 0)) {
        fprintf(stderr, CMD ": give --dp-rank and --dp-size together\n");
        return 1;
    }
    if (a->dp_size < 0) {
        const char *r = getenv("RANK"), *w = getenv("WORLD_SIZE");
        a->dp_rank = 0;
        a->dp_size = 1;
        if (r && w && (!cm_parse_i64(CMD, "RANK", r, 0, INT64_MAX, &a->dp_rank) ||
                      !cm_parse_i64(CMD, "WORLD_SIZE", w, 1, INT64_MAX, &a->dp_size)))
            return 1;
    }
    if (a->dp_rank >= a->dp_size || a->dp_size > 1 << 20) {
        fprintf(stderr, CMD ": data-parallel rank %lld of %lld: need 0 <= rank < size <= %d\n",
                (long long)a->dp_rank, (long long)a->dp_size, 1 << 20);
        return 1;
    }
    return 0;
}

static const char *const target_inits[] = {"checkpoint", "random", NULL};
static const char *const precisions[] = {"bf16", "fp32", NULL};
static const char *const verify_modes[] = {"full", "lazy", NULL};

/* One flag at the cursor; 0 when it is none of train's. */
static int parse_flag(cm_args *p, train_args *a) {
    const char *v = NULL;
    int64_t     x = 0;
    int         k = 0;
    if (cm_args_flag(p, "--resume"))
        a->resume = 1;
    else if (cm_args_flag(p, "--dry-run"))
        a->dry_run = 1;
    else if (cm_args_flag(p, "--no-tensorboard"))
        a->no_tensorboard = 1;
    else if (cm_args_str(p, "--config", &a->config) || cm_args_str(p, "--init-from", &a->init_from) ||
             cm_args_str(p, "--target", &a->target) || cm_args_str(p, "--data", &a->data) ||
             cm_args_str(p, "--data-dir", &a->data_dir) || cm_args_str(p, "--dataset", &a->dataset))
        ;
    else if (cm_args_i64(p, "--token-budget", 2, INT64_MAX, &a->token_budget) ||
             cm_args_i64(p, "--dp-rank", 0, INT64_MAX, &a->dp_rank) ||
             cm_args_i64(p, "--dp-size", 1, INT64_MAX, &a->dp_size))
        ;
    else if (cm_args_str(p, "--shards", &a->shards) || cm_args_str(p, "--server", &a->server))
        ;
    else if (cm_args_i64(p, "--credits", 1, INT64_MAX, &a->credits) ||
             cm_args_i64(p, "--timeout-ms", 1, INT64_MAX, &a->timeout_ms))
        ;
    else if (cm_args_choice(p, "--target-init", target_inits, &k)) {
        if (!p->bad)
            a->target_random = k == 1;
    } else if (cm_args_i64(p, "--target-seed", 0, INT64_MAX, &x)) {
        if (!p->bad)
            a->target_seed = (uint64_t)x;
    } else if (cm_args_str(p, "--curve-server-key", &a->curve_server_key) ||
               cm_args_str(p, "--curve-secret-key", &a->curve_secret_key))
        ;
    else if (cm_args_str(p, "--encoding", &v)) {
        if (v && cm_encoding_parse(v, &a->encoding) != CM_OK) {
            fprintf(stderr, CMD ": --encoding: %s\n", cm_last_error());
            p->bad = 1;
        }
    } else if (cm_args_str(p, "--out", &a->out) || cm_args_str(p, "--device", &a->device))
        ;
    else if (cm_args_i64(p, "--gpu", 0, INT64_MAX, &a->gpu))
        ;
    else if (cm_args_choice(p, "--precision", precisions, &k)) {
        if (!p->bad)
            a->precision = precisions[k];
    } else if (cm_args_i64(p, "--epochs", 1, INT64_MAX, &a->epochs) ||
               cm_args_i64(p, "--steps", 1, INT64_MAX, &a->steps) ||
               cm_args_i64(p, "--max-anchors", 1, INT64_MAX, &a->max_anchors) ||
               cm_args_i64(p, "--save-every", 0, INT64_MAX, &a->save_every))
        ;
    else if (cm_args_i64(p, "--eval-every", 0, INT64_MAX, &a->eval_every) ||
             cm_args_i64(p, "--eval-prompts", 1, INT32_MAX, &a->eval_prompts) ||
             cm_args_i64(p, "--eval-max-new", 1, 1 << 24, &a->eval_max_new) ||
             cm_args_i64(p, "--eval-batch", 1, 4096, &a->eval_batch) ||
             cm_args_str(p, "--eval-data", &a->eval_data) || cm_args_str(p, "--eval-server", &a->eval_server))
        ;
    else if (cm_args_i64(p, "--prefetch", 0, INT64_MAX, &a->prefetch)) {
        if (!p->bad && a->prefetch > 1) {
            fprintf(stderr, CMD ": --prefetch %s: expected 0 (off) or 1 (on)\n", p->argv[p->i + 1]);
            p->bad = 1;
        }
    } else if (cm_args_str(p, "--verify-shards", &v)) {
        if (v) {
            for (k = 0; verify_modes[k] && strcmp(v, verify_modes[k]) != 0; k++)
                ;
            if (!verify_modes[k]) {
                fprintf(stderr, CMD ": --verify-shards %s: expected full or lazy\n", v);
                p->bad = 1;
            }
            a->verify_lazy = k == 1;
        }
    } else if (cm_args_i64(p, "--log-every", 1, INT64_MAX, &a->log_every))
        ;
    else if (cm_args_f64(p, "--lr", 0, 1e3, &a->lr) || cm_args_f64(p, "--warmup-ratio", 0, 1, &a->warmup_ratio) ||
             cm_args_f64(p, "--weight-decay", 0, 1e3, &a->weight_decay) || cm_args_f64(p, "--clip", 0, 1e30, &a->clip))
        ;
    else if (cm_args_f64(p, "--loss-decay-gamma", 1e-30, 1e30, &a->gamma))
        a->have_gamma = 1;
    else if (cm_args_f64(p, "--selector-alpha", 0, 1e6, &a->sel_alpha) ||
             cm_args_f64(p, "--selector-warmup-ratio", 0, 1, &a->sel_warmup_ratio) ||
             cm_args_f64(p, "--selector-ramp-ratio", 0, 1, &a->sel_ramp_ratio) ||
             cm_args_choice(p, "--selector-miss", dt_selector_miss_names, &a->sel_miss))
        ;
    else if (cm_args_flag(p, "--selector-stop-grad"))
        a->sel_stop_grad = 1;
    else if (cm_args_i64(p, "--seed", 0, INT64_MAX, &x)) {
        if (!p->bad)
            a->seed = (uint64_t)x;
    } else if (cm_args_str(p, "--progress", &v)) {
        if (v && dt_progress_mode_parse(v, &a->progress) != CM_OK) {
            fprintf(stderr, CMD ": %s\n", cm_last_error());
            p->bad = 1;
        }
    } else if (cm_args_i64(p, "--plan-seq-len", 1, INT64_MAX, &a->plan_seq_len) ||
               cm_args_f64(p, "--plan-target-tflops", 1e-6, 1e6, &a->plan_target_tflops) ||
               cm_args_f64(p, "--plan-drafter-tflops", 1e-6, 1e6, &a->plan_drafter_tflops) ||
               cm_args_f64(p, "--plan-ratio", 1, 1e6, &a->plan_ratio) || cm_args_log_level(p))
        ;
    else
        return 0;
    return 1;
}

int dt_train_args_parse(int argc, char **argv, train_args *a) {
    *a = (train_args){.target_seed = 1,
                      .device = "cpu",
                      .epochs = 6,
                      .max_anchors = 512,
                      .log_every = 1,
                      .lr = 6e-4,
                      .warmup_ratio = 0.04,
                      .clip = 1.0,
                      .sel_alpha = 1.0,
                      .credits = 4,
                      .prefetch = 1,
                      .timeout_ms = 300000,
                      .token_budget = 8192,
                      .eval_prompts = 16,
                      .eval_max_new = 128,
                      .eval_batch = 8,
                      .dp_rank = -1,
                      .dp_size = -1,
                      .gpu = -1,
                      .encoding = CM_ENCODING_ZSTD_BYTEPLANE,
                      .progress = DT_PROGRESS_AUTO,
                      .plan_target_tflops = 0, /* by the target: dense or MoE (dt_plan.h) */
                      .plan_drafter_tflops = DT_PLAN_DRAFTER_TFLOPS};
    cm_args p;
    cm_args_init(&p, CMD, argc, argv);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            usage(stdout);
            return 1;
        }
        if (!parse_flag(&p, a))
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    if (a->dry_run) { /* the plan needs the two configs only */
        if (!a->target || (!a->config && !a->init_from)) {
            fprintf(stderr, CMD ": --dry-run needs --target and --config or --init-from\n");
            return 2;
        }
        return dp_from_env(a) != 0 ? 2 : 0;
    }
    if (!a->target || !a->out || (!a->data && !a->data_dir && !a->dataset)) {
        fprintf(stderr, CMD ": --target, --out and --data, --data-dir or --dataset are "
                        "required (see --help)\n");
        return 2;
    }
    if (!!a->data + !!a->data_dir + !!a->dataset > 1) {
        fprintf(stderr, CMD ": give one of --data, --data-dir and --dataset\n");
        return 2;
    }
    if (a->dataset && !a->shards && !a->server) {
        fprintf(stderr, CMD ": a --dataset has no hidden states of its own; give --shards "
                        "DIR (from drafter-trainer precompute --dataset) or --server ENDPOINT\n");
        return 2;
    }
    if (a->token_budget > INT32_MAX) {
        fprintf(stderr, CMD ": --token-budget is at most %d\n", INT32_MAX);
        return 2;
    }
    if (dp_from_env(a) != 0)
        return 2;
    if (a->credits > 1024 || a->timeout_ms > INT32_MAX) {
        fprintf(stderr, CMD ": --credits is at most 1024 and --timeout-ms at most %d\n",
                INT32_MAX);
        return 2;
    }
    if (a->shards && a->server) {
        fprintf(stderr, CMD ": give --shards or --server, not both\n");
        return 2;
    }
    if (a->config && a->init_from) {
        fprintf(stderr, CMD ": give --config or --init-from, not both\n");
        return 2;
    }
    if (!a->config && !a->init_from && !a->resume) {
        fprintf(stderr, CMD ": --config or --init-from is required (see --help)\n");
        return 2;
    }
    if (a->eval_every > 0 && !a->eval_data) {
        fprintf(stderr, CMD ": --eval-every needs --eval-data FILE (the held-out prompts it decodes)\n");
        return 2;
    }
    if (a->eval_every > 0 && !a->server && !a->eval_server) {
        fprintf(stderr, CMD ": --eval-every decodes on a target-server, and this run has no live --server (its "
                        "hidden states come from %s): give --eval-server ENDPOINT\n",
                a->shards ? "--shards" : "the batch files");
        return 2;
    }
    if (a->eval_every == 0 && (a->eval_data || a->eval_server))
        CM_LOG_WARN("--eval-data and --eval-server are not used without --eval-every N");
    return 0;
}

