/* tests/test_cm_cfg.c — config.json parsing for the Qwen3.5/3.6 target (nested text_config as
 * saved by Qwen3_5ForConditionalGeneration, flat as saved by Qwen3_5ForCausalLM) and the
 * DFlash drafter, from the fixtures in tests/data/cm/ (values of Qwen3.6-27B and its DFlash
 * drafter, docs/target.md and docs/drafter.md) and from edited copies of them:
 * derived layer types, both RoPE spellings, default taps, and every bad case, each of which
 * must fail with the right status and a message naming the file and the field. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_cfg.h"
#include "tst.h"
#include "tst_json.h"

#define DATA   TANDEM_TEST_DATA "/data/cm"
#define ORIGIN "fixture/config.json"



static cm_status target_of(cJSON *j, cm_target_cfg *cfg) { return tst_json_target(j, cfg, ORIGIN); }

static cm_status drafter_of(cJSON *j, cm_drafter_cfg *cfg) {
    char     *text = cJSON_PrintUnformatted(j);
    cm_status st = cm_drafter_cfg_parse(cfg, text, ORIGIN);
    free(text);
    cJSON_Delete(j);
    return st;
}

static cJSON *nested(void) {
    return tst_json_load(DATA "/qwen3_6_27b/config.json");
}
static cJSON *flat(void) {
    return tst_json_load(DATA "/qwen3_5_tiny_flat/config.json");
}
static cJSON *dflash(void) {
    return tst_json_load(DATA "/dflash_qwen3_6_27b/config.json");
}

/* The same drafter as DFlash2 with the published 27B values (Kc 2, G 16, R 256, K 16). */
static cJSON *dflash2(void) {
    cJSON *j = tst_json_edit(dflash(), "architectures", "[\"DFlash2DraftModel\"]");
    j = tst_json_edit(j, "dflash_config.conv_kernel_size", "2");
    j = tst_json_edit(j, "dflash_config.conv_group_size", "16");
    j = tst_json_edit(j, "dflash_config.selector_rank", "256");
    return tst_json_edit(j, "dflash_config.selector_top_k", "16");
}

// ---- target

static void check_27b(const cm_target_cfg *c) {
    TST_CHECK(c->family == CM_TARGET_FAMILY_QWEN3_5);
    TST_CHECK(strcmp(c->model_type, "qwen3_5_text") == 0 && c->nested == 1);
    TST_CHECK(c->hidden_size == 5120 && c->n_layers == 64 && c->intermediate_size == 17408);
    TST_CHECK(c->vocab_size == 248320 && c->rms_norm_eps == 1e-6f && c->tie_word_embeddings == 0);
    int bad = 0;
    for (int i = 0; i < 64; i++)
        bad += c->layer_types[i] !=
               ((i % 4 == 3) ? CM_LAYER_TYPE_FULL_ATTENTION : CM_LAYER_TYPE_LINEAR_ATTENTION);
    TST_CHECK(bad == 0);
    TST_CHECK(c->n_heads == 24 && c->n_kv_heads == 4 && c->head_dim == 256);
    TST_CHECK(c->rotary_dim == 64 && c->rope_theta == 1e7 && c->attn_output_gate == 1);
    TST_CHECK(c->lin_n_k_heads == 16 && c->lin_n_v_heads == 48);
    TST_CHECK(c->lin_k_head_dim == 128 && c->lin_v_head_dim == 128 && c->lin_conv_kernel == 4);
}

static void test_target_good(void) {
    cm_target_cfg c;
    // nested, loaded from the directory
    TST_CHECK(cm_target_cfg_load(&c, DATA "/qwen3_6_27b") == CM_OK);
    check_27b(&c);
    // layer_types derived from full_attention_interval (default 4): the same pattern
    TST_CHECK(target_of(tst_json_edit(tst_json_edit(nested(), "text_config.layer_types", NULL),
                             "text_config.full_attention_interval", NULL),
                        &c) == CM_OK);
    check_27b(&c);
    // older spelling: rope_theta and partial_rotary_factor at the top of the text config
    cJSON *j = tst_json_edit(nested(), "text_config.rope_parameters", NULL);
    TST_CHECK(target_of(tst_json_edit(tst_json_edit(j, "text_config.rope_theta", "10000000"),
                             "text_config.partial_rotary_factor", "0.25"),
                        &c) == CM_OK);
    check_27b(&c);
    // both spellings present and agreeing is fine
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.rope_theta", "1e7"), &c) == CM_OK);
    check_27b(&c);
    // mRoPE's rope_scaling of older configs (type default) is accepted
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.rope_scaling",
                             "{\"type\": \"default\", \"mrope_section\": [11, "
                             "11, 10]}"),
                        &c) == CM_OK);
    // no rope anywhere: theta 10000, factor 0.25 (Transformers' defaults for these classes)
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.rope_parameters", NULL), &c) == CM_OK);
    TST_CHECK(c.rope_theta == 10000.0 && c.rotary_dim == 64);
    // tie_word_embeddings: the text config wins, else the top level
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.tie_word_embeddings", "true"), &c) == CM_OK &&
              c.tie_word_embeddings == 1);
    TST_CHECK(target_of(tst_json_edit(tst_json_edit(nested(), "text_config.tie_word_embeddings", NULL), "tie_word_embeddings",
                             "true"),
                        &c) == CM_OK &&
              c.tie_word_embeddings == 1);
    TST_CHECK(
        target_of(tst_json_edit(tst_json_edit(nested(), "text_config.tie_word_embeddings", NULL), "tie_word_embeddings", NULL),
                  &c) == CM_OK &&
        c.tie_word_embeddings == 0);
    // attn_output_gate off; null counts as absent (default on)
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.attn_output_gate", "false"), &c) == CM_OK &&
              c.attn_output_gate == 0);
    TST_CHECK(target_of(tst_json_edit(nested(), "text_config.attn_output_gate", "null"), &c) == CM_OK &&
              c.attn_output_gate == 1);

    // flat (Qwen3_5ForCausalLM), loaded by file path: interval 2, top-level rope keys, tied
    TST_CHECK(cm_target_cfg_load(&c, DATA "/qwen3_5_tiny_flat/config.json") == CM_OK);
    TST_CHECK(c.nested == 0 && strcmp(c.model_type, "qwen3_5_text") == 0);
    TST_CHECK(c.hidden_size == 32 && c.n_layers == 4 && c.intermediate_size == 64 && c.vocab_size == 128);
    TST_CHECK(c.layer_types[0] == CM_LAYER_TYPE_LINEAR_ATTENTION &&
              c.layer_types[1] == CM_LAYER_TYPE_FULL_ATTENTION);
    TST_CHECK(c.layer_types[2] == CM_LAYER_TYPE_LINEAR_ATTENTION &&
              c.layer_types[3] == CM_LAYER_TYPE_FULL_ATTENTION);
    TST_CHECK(c.n_heads == 4 && c.n_kv_heads == 2 && c.head_dim == 16 && c.rotary_dim == 4);
    TST_CHECK(c.rope_theta == 1e6 && c.rms_norm_eps == 1e-5f && c.tie_word_embeddings == 1);
    TST_CHECK(c.lin_n_k_heads == 2 && c.lin_n_v_heads == 4 && c.lin_k_head_dim == 8 &&
              c.lin_v_head_dim == 16);
    // head_dim defaults to hidden / heads; num_key_value_heads to the heads
    TST_CHECK(target_of(tst_json_edit(flat(), "head_dim", NULL), &c) == CM_OK && c.head_dim == 8 && c.rotary_dim == 2);
    TST_CHECK(target_of(tst_json_edit(flat(), "num_key_value_heads", NULL), &c) == CM_OK && c.n_kv_heads == 4);
    // an explicit list, all full attention: the linear-attention fields become optional
    cJSON      *all_full = tst_json_edit(flat(), "layer_types",
                                "[\"full_attention\", \"full_attention\", \"full_attention\", "
                                     "\"full_attention\"]");
    const char *lin[] = {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"};
    for (int i = 0; i < 5; i++)
        tst_json_edit(all_full, lin[i], NULL);
    TST_CHECK(target_of(all_full, &c) == CM_OK && c.lin_n_k_heads == 0 &&
              c.layer_types[0] == CM_LAYER_TYPE_FULL_ATTENTION);
}

static void test_target_bad(void) {
    cm_target_cfg c;
    // model types
    TST_FAILS(target_of(tst_json_edit(nested(), "model_type", "\"llama\""), &c), CM_ERR_UNSUPPORTED,
              "'" ORIGIN "': unknown model_type 'llama'; supported: qwen3_5, qwen3_5_text, qwen3_5_moe, "
              "qwen3_5_moe_text, qwen3_next");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.model_type", "\"qwen3_5_moe_text\""), &c),
              CM_ERR_UNSUPPORTED, "text_config.model_type 'qwen3_5_moe_text' does not go with model_type 'qwen3_5'",
              "expected 'qwen3_5_text'");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.model_type", "\"llama\""), &c), CM_ERR_UNSUPPORTED,
              "text_config.model_type 'llama' does not go with");
    TST_FAILS(target_of(tst_json_edit(nested(), "model_type", "\"qwen3_5_moe\""), &c), CM_ERR_UNSUPPORTED,
              "text_config.model_type 'qwen3_5_text' does not go with model_type 'qwen3_5_moe'");
    TST_FAILS(target_of(tst_json_edit(nested(), "model_type", NULL), &c), CM_ERR_FORMAT, ORIGIN,
              "missing field 'model_type'");
    TST_FAILS(target_of(tst_json_edit(nested(), "model_type", "5"), &c), CM_ERR_FORMAT,
              "'model_type' must be a string");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config", NULL), &c), CM_ERR_FORMAT,
              "needs a 'text_config' object");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config", "[]"), &c), CM_ERR_FORMAT,
              "field 'text_config' must be an object");

    // missing and mistyped fields
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.hidden_size", NULL), &c), CM_ERR_FORMAT,
              "'" ORIGIN "': missing field 'text_config.hidden_size'");
    TST_FAILS(target_of(tst_json_edit(flat(), "vocab_size", NULL), &c), CM_ERR_FORMAT, "missing field 'vocab_size'");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.num_attention_heads", NULL), &c), CM_ERR_FORMAT,
              "missing field 'text_config.num_attention_heads'");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.linear_conv_kernel_dim", NULL), &c), CM_ERR_FORMAT,
              "missing field 'text_config.linear_conv_kernel_dim'");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.intermediate_size", "\"big\""), &c), CM_ERR_FORMAT,
              "'text_config.intermediate_size' must be an integer, found a string");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.hidden_size", "5120.5"), &c), CM_ERR_FORMAT,
              "'text_config.hidden_size' must be an integer");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.hidden_size", "1e12"), &c), CM_ERR_FORMAT,
              "'text_config.hidden_size' must be an integer");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.hidden_size", "0"), &c), CM_ERR_FORMAT,
              "'text_config.hidden_size' must be positive, found 0");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.vocab_size", "-5"), &c), CM_ERR_FORMAT,
              "'text_config.vocab_size' must be positive");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.rms_norm_eps", "-1e-6"), &c), CM_ERR_FORMAT,
              "'text_config.rms_norm_eps' must be in (0, 1)");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.attn_output_gate", "\"yes\""), &c), CM_ERR_FORMAT,
              "'text_config.attn_output_gate' must be true or false");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.num_hidden_layers", "300"), &c), CM_ERR_FORMAT,
              "num_hidden_layers 300 exceeds the supported maximum 256");

    // heads
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.num_key_value_heads", "5"), &c), CM_ERR_FORMAT,
              "num_attention_heads 24 is not a multiple of text_config.num_key_value_heads 5");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.linear_num_value_heads", "40"), &c), CM_ERR_FORMAT,
              "linear_num_value_heads 40 must be a positive multiple of linear_num_key_heads 16");
    TST_FAILS(target_of(tst_json_edit(tst_json_edit(tst_json_edit(flat(), "head_dim", NULL), "num_attention_heads", "5"),
                             "num_key_value_heads", "5"),
                        &c),
              CM_ERR_FORMAT,
              "head_dim is absent and hidden_size 32 is not a multiple of num_attention_heads 5");

    // layer types
    cJSON *j = nested();
    cJSON_DeleteItemFromArray(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "text_config"), "layer_types"), 0);
    TST_FAILS(target_of(j, &c), CM_ERR_FORMAT,
              "text_config.layer_types has 63 entries but num_hidden_layers is 64");
    j = nested();
    cJSON_ReplaceItemInArray(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "text_config"), "layer_types"), 2,
                             cJSON_CreateString("mamba"));
    TST_FAILS(target_of(j, &c), CM_ERR_FORMAT,
              "text_config.layer_types[2] is 'mamba'; expected 'linear_attention' or 'full_attention'");
    j = flat();
    tst_json_edit(j, "layer_types", "[\"linear_attention\", 7, \"full_attention\", \"full_attention\"]");
    TST_FAILS(target_of(j, &c), CM_ERR_FORMAT, "layer_types[1] is a number");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.layer_types", "\"full_attention\""), &c), CM_ERR_FORMAT,
              "'text_config.layer_types' must be an array");
    TST_FAILS(target_of(tst_json_edit(flat(), "full_attention_interval", "0"), &c), CM_ERR_FORMAT,
              "'full_attention_interval' must be positive");

    // rope
    TST_FAILS(
        target_of(tst_json_edit(nested(), "text_config.rope_theta", "1000000"), &c), CM_ERR_FORMAT,
        "'text_config.rope_parameters.rope_theta' (1e+07) and 'text_config.rope_theta' (1e+06) disagree");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.rope_parameters.rope_type", "\"yarn\""), &c),
              CM_ERR_UNSUPPORTED, "text_config.rope_parameters.rope_type 'yarn' is not supported");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.rope_parameters.partial_rotary_factor", "0.3"), &c),
              CM_ERR_FORMAT, "head_dim 256 × partial_rotary_factor 0.3 = 76.8 is not an even integer");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.rope_parameters.partial_rotary_factor", "1.5"), &c),
              CM_ERR_FORMAT, "partial_rotary_factor must be in (0, 1]");
    TST_FAILS(target_of(tst_json_edit(flat(), "partial_rotary_factor", "0.1875"), &c), CM_ERR_FORMAT,
              "= 3 is not an even integer");
    TST_FAILS(target_of(tst_json_edit(flat(), "rope_theta", "-1"), &c), CM_ERR_FORMAT, "rope_theta must be positive");
    TST_FAILS(target_of(tst_json_edit(nested(), "text_config.rope_parameters", "7"), &c), CM_ERR_FORMAT,
              "'text_config.rope_parameters' must be an object");

    // not JSON, not an object
    TST_FAILS(cm_target_cfg_parse(&c, "{\"model_type\": \"qwen3_5\",", ORIGIN), CM_ERR_FORMAT,
              "'" ORIGIN "': malformed JSON near byte");
    TST_FAILS(cm_target_cfg_parse(&c, "{} trailing", ORIGIN), CM_ERR_FORMAT, "malformed JSON");
    TST_FAILS(cm_target_cfg_parse(&c, "[1, 2]", ORIGIN), CM_ERR_FORMAT, "not a JSON object");

    // files
    TST_FAILS(cm_target_cfg_load(&c, DATA "/no-such-model"), CM_ERR_IO, "cannot open", "no-such-model");
    char dir[] = "/tmp/tandem_test_cm_cfg_XXXXXX";
    TST_CHECK(mkdtemp(dir) != NULL);
    TST_FAILS(cm_target_cfg_load(&c, dir), CM_ERR_IO, "cannot open", "/config.json", "No such file");
    char sub[64];
    snprintf(sub, sizeof sub, "%s/config.json", dir);
    TST_CHECK(mkdir(sub, 0755) == 0); /* a directory where the file should be */
    TST_FAILS(cm_target_cfg_load(&c, dir), CM_ERR_IO, "not a regular file");
    rmdir(sub);
    FILE *fp = fopen(sub, "w");
    TST_CHECK(fp != NULL);
    if (fp) {
        fputs("{\"model_type\": \"llama\"}", fp);
        fclose(fp);
    }
    TST_FAILS(cm_target_cfg_load(&c, dir), CM_ERR_UNSUPPORTED, sub, "unknown model_type 'llama'");
    char *text = NULL;
    TST_FAILS(cm_read_text_file(sub, 8, &text), CM_ERR_IO, "more than the 8-byte limit");
    TST_CHECK(text == NULL);
    TST_CHECK(cm_read_text_file(sub, 100, &text) == CM_OK && text &&
              strcmp(text, "{\"model_type\": \"llama\"}") == 0);
    free(text);
    unlink(sub);
    rmdir(dir);
}

// ---- drafter

static void test_drafter_good(void) {
    cm_drafter_cfg d;
    TST_CHECK(cm_drafter_cfg_load(&d, DATA "/dflash_qwen3_6_27b") == CM_OK);
    TST_CHECK(d.hidden_size == 5120 && d.n_layers == 5 && d.intermediate_size == 17408 &&
              d.vocab_size == 248320);
    TST_CHECK(d.n_heads == 32 && d.n_kv_heads == 8 && d.head_dim == 128 && d.rms_norm_eps == 1e-6f);
    TST_CHECK(d.rope_theta == 1e7 && d.max_position_embeddings == 262144);
    TST_CHECK(d.tie_word_embeddings == 0 && d.attention_bias == 0);
    for (int i = 0; i < 4; i++)
        TST_CHECK(d.layer_types[i] == CM_LAYER_TYPE_SLIDING_ATTENTION);
    TST_CHECK(d.layer_types[4] == CM_LAYER_TYPE_FULL_ATTENTION && d.sliding_window == 2048);
    TST_CHECK(d.block_size == 16 && d.mask_token_id == 248070 && d.num_target_layers == 64);
    const int taps[] = {1, 16, 31, 46, 61};
    TST_CHECK(d.n_taps == 5);
    for (int i = 0; i < 5; i++)
        TST_CHECK(d.target_layer_ids[i] == taps[i]);

    // block_size only in one of its two places; rope_theta in rope_parameters
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "block_size", NULL), &d) == CM_OK && d.block_size == 16);
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "dflash_config.block_size", NULL), &d) == CM_OK &&
              d.block_size == 16);
    TST_CHECK(drafter_of(tst_json_edit(tst_json_edit(dflash(), "rope_theta", NULL), "rope_parameters",
                              "{\"rope_type\": \"default\", \"rope_theta\": 1000000}"),
                         &d) == CM_OK &&
              d.rope_theta == 1e6);
    // defaults: all layers full (no window), head_dim = hidden / heads, kv heads = heads
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "layer_types", NULL), &d) == CM_OK);
    TST_CHECK(d.layer_types[0] == CM_LAYER_TYPE_FULL_ATTENTION && d.sliding_window == 0);
    TST_CHECK(drafter_of(tst_json_edit(tst_json_edit(dflash(), "head_dim", NULL), "num_key_value_heads", NULL), &d) == CM_OK &&
              d.head_dim == 160 && d.n_kv_heads == 32);
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "max_position_embeddings", NULL), &d) == CM_OK &&
              d.max_position_embeddings == 32768);
    // a DFlash config is kind DFlash with no DFlash2 fields; a DFlash2 config carries its four keys
    TST_CHECK(d.kind == CM_DRAFTER_DFLASH && d.conv_kernel_size == 0 && d.selector_top_k == 0);
    TST_CHECK(drafter_of(dflash2(), &d) == CM_OK && d.kind == CM_DRAFTER_DFLASH2 && d.conv_kernel_size == 2 &&
              d.conv_group_size == 16 && d.selector_rank == 256 && d.selector_top_k == 16 && d.hidden_size == 5120);
    TST_CHECK(drafter_of(tst_json_edit(dflash2(), "dflash_config.conv_kernel_size", "16"), &d) == CM_OK &&
              d.conv_kernel_size == 16); /* Kc = B is allowed */
    TST_CHECK(drafter_of(dflash(), &d) == CM_OK);
    // causality per layer: absent (or null) -> sliding layers causal, full not; is_causal decides for all
    TST_CHECK(d.is_causal == CM_CAUSAL_BY_LAYER_TYPE && cm_drafter_layer_causal(&d, 0) == 1 && cm_drafter_layer_causal(&d, 4) == 0);
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "is_causal", "false"), &d) == CM_OK && d.is_causal == CM_CAUSAL_NONE &&
              cm_drafter_layer_causal(&d, 0) == 0 && cm_drafter_layer_causal(&d, 4) == 0);
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "is_causal", "true"), &d) == CM_OK && d.is_causal == CM_CAUSAL_ALL &&
              cm_drafter_layer_causal(&d, 0) == 1 && cm_drafter_layer_causal(&d, 4) == 1);
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "is_causal", "null"), &d) == CM_OK && d.is_causal == CM_CAUSAL_BY_LAYER_TYPE);
    // mask_token_id at the top level (vLLM accepts it there)
    TST_CHECK(drafter_of(tst_json_edit(tst_json_edit(dflash(), "dflash_config.mask_token_id", NULL), "mask_token_id", "151669"),
                         &d) == CM_OK &&
              d.mask_token_id == 151669);
    // num_target_layers inside dflash_config
    TST_CHECK(
        drafter_of(tst_json_edit(tst_json_edit(dflash(), "num_target_layers", NULL), "dflash_config.num_target_layers", "64"),
                   &d) == CM_OK &&
        d.num_target_layers == 64);
    // explicit taps of another length than the layer count
    TST_CHECK(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[1, 6, 11, 16, 22, 27, 32, 37]"),
                         &d) == CM_OK &&
              d.n_taps == 8 && d.target_layer_ids[7] == 37);

    // default taps: build_target_layer_ids(Lt, Ld) of docs/drafter.md (taps), Python rounding
    struct {
        int lt, ld, ids[8];
    } def[] = {
        {64, 5, {1, 16, 31, 46, 61}},
        {36, 5, {1, 9, 17, 25, 33}},
        {32, 5, {1, 8, 15, 22, 29}},
        {40, 5, {1, 10, 19, 28, 37}},
        {10, 5, {1, 2, 4, 6, 7}} /* 2.5 rounds to 2, 5.5 to 6 */,
        {40, 1, {20}},
    };
    for (size_t k = 0; k < sizeof def / sizeof def[0]; k++) {
        char lt[16], ld[16];
        snprintf(lt, sizeof lt, "%d", def[k].lt);
        snprintf(ld, sizeof ld, "%d", def[k].ld);
        cJSON *j = tst_json_edit(tst_json_edit(dflash(), "dflash_config.target_layer_ids", NULL), "num_target_layers", lt);
        tst_json_edit(tst_json_edit(j, "num_hidden_layers", ld), "layer_types", NULL);
        TST_CHECK(drafter_of(j, &d) == CM_OK && d.n_taps == def[k].ld);
        for (int i = 0; i < def[k].ld; i++)
            TST_CHECK(d.target_layer_ids[i] == def[k].ids[i]);
    }
}

static void test_drafter_bad(void) {
    cm_drafter_cfg d;
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "architectures", NULL), &d), CM_ERR_FORMAT, ORIGIN,
              "missing field 'architectures'", "DFlashDraftModel");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "architectures", "[\"Qwen3ForCausalLM\"]"), &d), CM_ERR_UNSUPPORTED,
              "architectures has no \"DFlashDraftModel\" or \"DFlash2DraftModel\" (found 'Qwen3ForCausalLM')");

    // DFlash2: the four dflash_config keys, each missing and each out of its shape
    {
        const char *keys[4] = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"};
        for (int i = 0; i < 4; i++) {
            char key[64], want[96];
            snprintf(key, sizeof key, "dflash_config.%s", keys[i]);
            snprintf(want, sizeof want, "missing field 'dflash_config.%s'", keys[i]);
            TST_FAILS(drafter_of(tst_json_edit(dflash2(), key, NULL), &d), CM_ERR_FORMAT, want);
            snprintf(want, sizeof want, "dflash_config.%s must be at least 1, found 0", keys[i]);
            TST_FAILS(drafter_of(tst_json_edit(dflash2(), key, "0"), &d), CM_ERR_FORMAT, want);
        }
        TST_FAILS(drafter_of(tst_json_edit(dflash2(), "dflash_config.conv_kernel_size", "17"), &d), CM_ERR_FORMAT,
                  "dflash_config.conv_kernel_size 17 is above block_size 16");
        TST_FAILS(drafter_of(tst_json_edit(dflash2(), "dflash_config.conv_group_size", "3"), &d), CM_ERR_FORMAT,
                  "dflash_config.conv_group_size 3 does not divide hidden_size 5120");
        TST_FAILS(drafter_of(tst_json_edit(dflash2(), "dflash_config.selector_top_k", "248321"), &d), CM_ERR_FORMAT,
                  "dflash_config.selector_top_k 248321 is above vocab_size 248320");
    }
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "hidden_size", NULL), &d), CM_ERR_FORMAT,
              "missing field 'hidden_size'");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "num_attention_heads", "30"), &d), CM_ERR_FORMAT,
              "num_attention_heads 30 is not a multiple of num_key_value_heads 8");

    TST_FAILS(drafter_of(tst_json_edit(dflash(), "is_causal", "\"no\""), &d), CM_ERR_FORMAT,
              "field 'is_causal' must be true or false, found");

    // block size
    TST_FAILS(drafter_of(tst_json_edit(tst_json_edit(dflash(), "block_size", "1"), "dflash_config.block_size", NULL), &d),
              CM_ERR_FORMAT, "block_size 1 must be at least 2");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.block_size", "8"), &d), CM_ERR_FORMAT,
              "'block_size' (16) and 'dflash_config.block_size' (8) disagree");
    TST_FAILS(drafter_of(tst_json_edit(tst_json_edit(dflash(), "block_size", NULL), "dflash_config.block_size", NULL), &d),
              CM_ERR_FORMAT, "missing field 'block_size'");

    // mask token
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.mask_token_id", "248320"), &d), CM_ERR_FORMAT,
              "dflash_config.mask_token_id 248320 is outside the vocabulary [0, 248320)");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.mask_token_id", "-1"), &d), CM_ERR_FORMAT,
              "outside the vocabulary");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.mask_token_id", NULL), &d), CM_ERR_FORMAT,
              "missing field 'dflash_config.mask_token_id'");

    // taps
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[1, 16, 31, 46, 64]"), &d),
              CM_ERR_FORMAT, "target layer id 64 (tap 4) is outside [0, num_target_layers = 64)");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[-1, 16]"), &d), CM_ERR_FORMAT,
              "target layer id -1 (tap 0)");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[]"), &d), CM_ERR_FORMAT,
              "target_layer_ids has 0 entries");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[1, \"x\"]"), &d), CM_ERR_FORMAT,
              "target_layer_ids[1] must be an integer");
    TST_FAILS(drafter_of(
                  tst_json_edit(tst_json_edit(dflash(), "dflash_config.target_layer_ids", NULL), "num_target_layers", "2"), &d),
              CM_ERR_FORMAT, "derived target layer id", "set dflash_config.target_layer_ids");
    // a layer tapped twice: the server refuses it mid-run, shards would train on it twice
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[5, 5]"), &d), CM_ERR_FORMAT,
              "target layer id 5 appears twice (taps 0 and 1)");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.target_layer_ids", "[1, 16, 31, 16]"), &d),
              CM_ERR_FORMAT, "target layer id 16 appears twice (taps 1 and 3)");
    /* 5 taps spread over 7 layers: 1, 1.75, 2.5, 3.25, 4 round to 1, 2, 2, 3, 4 */
    TST_FAILS(drafter_of(tst_json_edit(tst_json_edit(tst_json_edit(tst_json_edit(dflash(), "dflash_config.target_layer_ids", NULL),
                                        "num_target_layers", "7"),
                                   "num_hidden_layers", "5"),
                              "layer_types", NULL),
                         &d),
              CM_ERR_FORMAT, "derived target layer id 2 appears twice (taps 1 and 2)",
              "set dflash_config.target_layer_ids");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "num_target_layers", NULL), &d), CM_ERR_FORMAT,
              "missing field 'num_target_layers'");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config.num_target_layers", "48"), &d), CM_ERR_FORMAT,
              "'num_target_layers' (64) and 'dflash_config.num_target_layers' (48) disagree");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "dflash_config", "[]"), &d), CM_ERR_FORMAT,
              "'dflash_config' must be an object");

    // layer types and the sliding window
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "sliding_window", "null"), &d), CM_ERR_FORMAT,
              "layer_types[0] is 'sliding_attention' but sliding_window is not set");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "sliding_window", "0"), &d), CM_ERR_FORMAT,
              "sliding_window is 0; set sliding_window > 0");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "layer_types",
                              "[\"full_attention\", \"causal\", \"full_attention\", "
                              "\"full_attention\", \"full_attention\"]"),
                         &d),
              CM_ERR_FORMAT, "layer_types[1] is 'causal'; expected 'full_attention' or 'sliding_attention'");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "layer_types", "[\"full_attention\"]"), &d), CM_ERR_FORMAT,
              "layer_types has 1 entries but num_hidden_layers is 5");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4}"), &d),
              CM_ERR_UNSUPPORTED, "rope_scaling.rope_type 'yarn' is not supported");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "rope_theta", "[1]"), &d), CM_ERR_FORMAT,
              "'rope_theta' must be a finite number, found an array");
    TST_FAILS(drafter_of(tst_json_edit(dflash(), "attention_bias", "1"), &d), CM_ERR_FORMAT,
              "'attention_bias' must be true or false");
    TST_FAILS(cm_drafter_cfg_load(&d, DATA "/no-such-drafter"), CM_ERR_IO, "cannot open", "no-such-drafter");
    TST_FAILS(cm_drafter_cfg_parse(&d, "", ORIGIN), CM_ERR_FORMAT, "malformed JSON");
}

int main(void) {
    test_target_good();
    test_target_bad();
    test_drafter_good();
    test_drafter_bad();
    return tst_report();
}
