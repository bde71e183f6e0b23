/* tests/test_deploy_configs.c — every example config under deploy/configs/ read by the real
 * code: each drafter.json through cm_drafter_cfg_load (the parser train and grad use), each
 * run.json's keys against the flags `drafter-trainer train --help` lists (a run config's keys
 * are train's long flag names without the dashes), and the Qwen3.6-27B drafter's shape against
 * the numbers it must have (docs/goals.md, docs/drafter.md): hidden 5120, 5
 * layers (4 sliding 2048 then 1 full), 32/8 heads x 128, MLP 17408, vocab 248320, taps
 * [1,16,31,46,61] = the default of docs/drafter.md for 64 target layers, block 16, mask 248070; and the
 * Qwen3.6-27B DFlash2 drafter's (docs/drafter.md, the DFlash2 reference notes, section 6): the same
 * backbone with 5 non-causal sliding 2048 layers, taps [5,19,33,47,61], block 8, Kc 2, G 16, R 256, K 16;
 * the Qwen3.5-35B-A3B and -122B-A10B DFlash drafters' (z-lab's shapes, the dflash reference notes'
 * table): 6 layers (5 sliding 4096 then 1 full), 32/8 heads x 128, block 16, mask 248077, 8 taps =
 * the default of docs/drafter.md for 40 and 48 target layers, hidden 2048 / 3072, MLP 6144 / 9216;
 * and each target-config.json through the target and quantization_config readers (the FP8 one's list of
 * unconverted modules against Qwen's; the MoE ones' experts, top-k and sizes, every layer sparse). */
#include <cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cm_cfg.h"
#include "cm_quant.h"
#include "tst.h"

#define CONFIGS TANDEM_TEST_DATA "/../deploy/configs"
#define DT_BIN  TANDEM_BINARY_DIR "/drafter-trainer/drafter-trainer"

static char help[1 << 16];

static int read_help(void) {
    FILE *p = popen(DT_BIN " train --help", "r");
    if (!p)
        return 0;
    size_t n = fread(help, 1, sizeof help - 1, p);
    help[n] = '\0';
    return pclose(p) == 0 && n > 0;
}

/* 1 if `train --help` lists --key (followed by a space or the end of the line). */
static int train_has_flag(const char *key) {
    char flag[128];
    snprintf(flag, sizeof flag, "--%s", key);
    for (const char *p = help; (p = strstr(p, flag)) != NULL; p += strlen(flag)) {
        char next = p[strlen(flag)];
        if (next == ' ' || next == '\n')
            return 1;
    }
    return 0;
}

static void check_run_config(const char *path) {
    FILE *f = fopen(path, "rb");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    static char text[1 << 16];
    size_t      n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *root = cJSON_Parse(text);
    TST_CHECK(cJSON_IsObject(root));
    if (!cJSON_IsObject(root)) {
        fprintf(stderr, "%s: not a JSON object\n", path);
        cJSON_Delete(root);
        return;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        int known = train_has_flag(it->string);
        /* the launcher and the Slurm script give these per process; a run config must not */
        int per_process = strcmp(it->string, "server") == 0 || strcmp(it->string, "out") == 0 ||
                          strcmp(it->string, "dp-rank") == 0 || strcmp(it->string, "dp-size") == 0;
        int kind_ok = cJSON_IsNumber(it) || cJSON_IsString(it) || cJSON_IsBool(it) || cJSON_IsArray(it);
        TST_CHECK(known && !per_process && kind_ok);
        if (!known || per_process || !kind_ok)
            fprintf(stderr, "%s: key '%s' %s\n", path, it->string,
                    !known        ? "is not a flag of `drafter-trainer train --help`"
                    : per_process ? "is set per process by deploy/ (remove it)"
                                  : "has a value of the wrong kind");
    }
    cJSON_Delete(root);
}

/* docs/drafter.md: round(1 + i·(Lt − 4)/(Ld − 1)), round half to even. */
static int default_tap(int i, int n_target, int n_taps) {
    return (int)nearbyint(1.0 + (double)i * (n_target - 4) / (n_taps - 1));
}

static void check_qwen36_27b(const cm_drafter_cfg *c) {
    TST_CHECK(c->hidden_size == 5120 && c->n_layers == 5 && c->intermediate_size == 17408);
    TST_CHECK(c->n_heads == 32 && c->n_kv_heads == 8 && c->head_dim == 128);
    TST_CHECK(c->vocab_size == 248320 && c->mask_token_id == 248070);
    TST_CHECK(c->block_size == 16 && c->num_target_layers == 64 && c->rope_theta == 1e7);
    /* the SpecForge layout: layers 0-3 sliding (window 2048), the last one full */
    for (int l = 0; l < 4; l++)
        TST_CHECK(c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION);
    TST_CHECK(c->layer_types[4] == CM_LAYER_TYPE_FULL_ATTENTION && c->sliding_window == 2048);
    static const int taps[5] = {1, 16, 31, 46, 61};
    TST_CHECK(c->n_taps == 5);
    for (int i = 0; i < 5 && i < c->n_taps; i++) {
        TST_CHECK(c->target_layer_ids[i] == taps[i]);
        TST_CHECK(default_tap(i, 64, 5) == taps[i]);
    }
    TST_CHECK(!c->tie_word_embeddings && !c->attention_bias);
}

static void check_qwen36_27b_dflash2(const cm_drafter_cfg *c) {
    TST_CHECK(c->kind == CM_DRAFTER_DFLASH2);
    TST_CHECK(c->hidden_size == 5120 && c->n_layers == 5 && c->intermediate_size == 17408);
    TST_CHECK(c->n_heads == 32 && c->n_kv_heads == 8 && c->head_dim == 128);
    TST_CHECK(c->vocab_size == 248320 && c->mask_token_id == 248070);
    TST_CHECK(c->block_size == 8 && c->num_target_layers == 64 && c->rope_theta == 1e7);
    /* the published layout: every layer sliding (window 2048) and non-causal */
    for (int l = 0; l < 5; l++) {
        TST_CHECK(c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION);
        TST_CHECK(!cm_drafter_layer_causal(c, l));
    }
    TST_CHECK(c->sliding_window == 2048 && c->is_causal == CM_CAUSAL_NONE);
    static const int taps[5] = {5, 19, 33, 47, 61};
    TST_CHECK(c->n_taps == 5);
    for (int i = 0; i < 5 && i < c->n_taps; i++)
        TST_CHECK(c->target_layer_ids[i] == taps[i]);
    TST_CHECK(c->conv_kernel_size == 2 && c->conv_group_size == 16);
    TST_CHECK(c->selector_rank == 256 && c->selector_top_k == 16);
    TST_CHECK(!c->tie_word_embeddings && !c->attention_bias);
}

/* A Qwen3.5-MoE DFlash drafter (deploy/configs/qwen3.5-{35b-a3b,122b-a10b}/README.md). */
static void check_qwen35_moe_drafter(const cm_drafter_cfg *c, int hidden, int mlp, int n_target,
                                     const int *taps) {
    TST_CHECK(c->kind == CM_DRAFTER_DFLASH);
    TST_CHECK(c->hidden_size == hidden && c->n_layers == 6 && c->intermediate_size == mlp);
    TST_CHECK(c->n_heads == 32 && c->n_kv_heads == 8 && c->head_dim == 128);
    TST_CHECK(c->vocab_size == 248320 && c->mask_token_id == 248077);
    TST_CHECK(c->block_size == 16 && c->num_target_layers == n_target && c->rope_theta == 1e7);
    for (int l = 0; l < 5; l++)
        TST_CHECK(c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION && cm_drafter_layer_causal(c, l));
    TST_CHECK(c->layer_types[5] == CM_LAYER_TYPE_FULL_ATTENTION && c->sliding_window == 4096);
    TST_CHECK(c->n_taps == 8);
    for (int i = 0; i < 8 && i < c->n_taps; i++) {
        TST_CHECK(c->target_layer_ids[i] == taps[i]);
        TST_CHECK(default_tap(i, n_target, 8) == taps[i]);
    }
    TST_CHECK(!c->tie_word_embeddings && !c->attention_bias);
}

/* A Qwen3.5-MoE target (fp8_moe reference notes, B4): the text model nested, every layer sparse,
 * the router always renormalised, full attention every 4th layer. */
static void check_qwen35_moe_target(const cm_target_cfg *t, int hidden, int n_layers, int n_heads, int lin_v,
                                    int moe_i) {
    TST_CHECK(t->family == CM_TARGET_FAMILY_QWEN3_5_MOE && t->nested &&
              strcmp(t->model_type, "qwen3_5_moe_text") == 0);
    TST_CHECK(t->hidden_size == hidden && t->n_layers == n_layers && t->vocab_size == 248320);
    TST_CHECK(t->n_heads == n_heads && t->n_kv_heads == 2 && t->head_dim == 256 && t->rotary_dim == 64);
    TST_CHECK(t->lin_n_k_heads == 16 && t->lin_n_v_heads == lin_v && t->lin_k_head_dim == 128);
    TST_CHECK(t->n_experts == 256 && t->n_experts_per_tok == 8 && t->moe_intermediate_size == moe_i);
    TST_CHECK(t->shared_expert_intermediate_size == moe_i && t->norm_topk_prob == 1);
    TST_CHECK(t->rope_theta == 1e7 && !t->tie_word_embeddings && t->intermediate_size == 0);
    for (int l = 0; l < n_layers; l++) {
        TST_CHECK(cm_target_layer_moe(t, l));
        TST_CHECK(t->layer_types[l] ==
                  (l % 4 == 3 ? CM_LAYER_TYPE_FULL_ATTENTION : CM_LAYER_TYPE_LINEAR_ATTENTION));
    }
}

/* A target-config.json: the target parser and the quantization_config reader accept it. The
 * Qwen3.6-27B-FP8 one (docs/fp8.md) keeps exactly the modules Qwen keeps bf16 out of
 * quantization: per layer the norms, the GDN's A_log, conv1d, dt_bias, in_proj_a/b and norm,
 * the attention's q/k norms; lm_head, the embedding and the vision tower; never a projection. */
static void check_target_config(const char *name, const char *path) {
    cm_target_cfg t;
    cm_quant_cfg  q;
    cm_status     st = cm_target_cfg_load(&t, path);
    if (st == CM_OK) st = cm_quant_cfg_load(&q, path);
    TST_CHECK(st == CM_OK);
    if (st != CM_OK) {
        fprintf(stderr, "%s: %s\n", path, cm_last_error());
        return;
    }
    TST_CHECK(q.fp8 == (strstr(name, "fp8") != NULL));
    if (strcmp(name, "qwen3.5-35b-a3b") == 0)
        check_qwen35_moe_target(&t, 2048, 40, 16, 32, 512);
    else if (strcmp(name, "qwen3.5-122b-a10b") == 0)
        check_qwen35_moe_target(&t, 3072, 48, 32, 64, 1024);
    else
        TST_CHECK(t.n_experts == 0); /* the dense targets */
    if (q.fp8) {
        TST_CHECK(t.n_layers == 64 && q.n_skip == 64 * 2 + 48 * 6 + 16 * 2 + 3);
        static const char *const kept[] = {"input_layernorm.weight", "post_attention_layernorm.weight",
                                           "linear_attn.A_log", "linear_attn.conv1d.weight",
                                           "linear_attn.dt_bias", "linear_attn.in_proj_a.weight",
                                           "linear_attn.in_proj_b.weight", "linear_attn.norm.weight",
                                           "self_attn.q_norm.weight", "self_attn.k_norm.weight"};
        static const char *const fp8[] = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                          "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                          "linear_attn.out_proj.weight", "self_attn.q_proj.weight",
                                          "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                          "self_attn.o_proj.weight"};
        for (int l = 0; l < t.n_layers; l++) {
            const int lin = t.layer_types[l] == CM_LAYER_TYPE_LINEAR_ATTENTION;
            char      n[160];
            for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
                const int mine = strncmp(kept[i], lin ? "self_attn" : "linear_attn", lin ? 9 : 11) != 0;
                snprintf(n, sizeof n, "model.language_model.layers.%d.%s", l, kept[i]);
                TST_CHECK((cm_quant_cfg_skips(&q, n) != NULL) == mine);
            }
            for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; i++) {
                snprintf(n, sizeof n, "model.language_model.layers.%d.%s", l, fp8[i]);
                TST_CHECK(cm_quant_cfg_skips(&q, n) == NULL);
            }
        }
        TST_CHECK(cm_quant_cfg_skips(&q, "lm_head.weight") && cm_quant_cfg_skips(&q, "model.visual.blocks.0.attn.qkv.weight"));
        TST_CHECK(cm_quant_cfg_skips(&q, "model.language_model.embed_tokens.weight") != NULL);
    }
    cm_quant_cfg_release(&q);
}

int main(void) {
    TST_CHECK(read_help());
    DIR *d = opendir(CONFIGS);
    TST_CHECK(d != NULL);
    if (!d)
        return tst_report();
    int            n_drafters = 0, n_runs = 0, n_targets = 0, saw_27b = 0, saw_27b_v2 = 0, saw_27b_fp8 = 0;
    int            saw_35b = 0, saw_122b = 0;
    static const int taps_35b[8] = {1, 6, 11, 16, 22, 27, 32, 37}, taps_122b[8] = {1, 7, 14, 20, 26, 32, 39, 45};
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char dir[1024], path[1200];
        snprintf(dir, sizeof dir, "%s/%s", CONFIGS, e->d_name);
        struct stat sb;
        if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
            continue;
        snprintf(path, sizeof path, "%s/drafter.json", dir);
        if (stat(path, &sb) == 0) {
            cm_drafter_cfg c;
            cm_status      st = cm_drafter_cfg_load(&c, path);
            TST_CHECK(st == CM_OK);
            if (st != CM_OK)
                fprintf(stderr, "%s: %s\n", path, cm_last_error());
            else if (strcmp(e->d_name, "qwen3.6-27b") == 0) {
                check_qwen36_27b(&c);
                saw_27b = 1;
            } else if (strcmp(e->d_name, "qwen3.6-27b-dflash2") == 0) {
                check_qwen36_27b_dflash2(&c);
                saw_27b_v2 = 1;
            } else if (strcmp(e->d_name, "qwen3.5-35b-a3b") == 0) {
                check_qwen35_moe_drafter(&c, 2048, 6144, 40, taps_35b);
                saw_35b++;
            } else if (strcmp(e->d_name, "qwen3.5-122b-a10b") == 0) {
                check_qwen35_moe_drafter(&c, 3072, 9216, 48, taps_122b);
                saw_122b++;
            }
            n_drafters++;
        }
        snprintf(path, sizeof path, "%s/target-config.json", dir);
        if (stat(path, &sb) == 0) {
            check_target_config(e->d_name, path);
            n_targets++;
            saw_27b_fp8 |= strcmp(e->d_name, "qwen3.6-27b-fp8") == 0;
            saw_35b += strcmp(e->d_name, "qwen3.5-35b-a3b") == 0;
            saw_122b += strcmp(e->d_name, "qwen3.5-122b-a10b") == 0;
        }
        snprintf(path, sizeof path, "%s/run.json", dir);
        if (stat(path, &sb) == 0) {
            check_run_config(path);
            n_runs++;
        }
    }
    closedir(d);
    TST_CHECK(n_drafters >= 4 && n_runs >= 4 && n_targets >= 4 && saw_27b && saw_27b_v2 && saw_27b_fp8);
    TST_CHECK(saw_35b == 2 && saw_122b == 2); /* each MoE folder: its drafter and its target */
    fprintf(stderr, "deploy/configs: %d drafter configs, %d run configs, %d target configs\n", n_drafters, n_runs,
            n_targets);
    return tst_report();
}
