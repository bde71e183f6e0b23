/* tests/test_cm_quant.c — quantization_config parsing (cm_quant.h, docs/fp8.md): Qwen's FP8
 * config at the top level and inside text_config, no config at all, every refused value with
 * its status and a message naming the field and the value, and the module-boundary name match
 * ("mlp.gate" names the router, never mlp.gate_proj). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_quant.h"
#include "tst.h"

#define ORIGIN "fixture/config.json"

/* A config whose quantization_config is body (NULL: none), at the top level or nested. */
static cm_status parse(cm_quant_cfg *q, const char *body, int nested) {
    char json[2048];
    if (!body)
        snprintf(json, sizeof json, "{\"model_type\": \"qwen3_5\", \"text_config\": {\"hidden_size\": 8}}");
    else if (nested)
        snprintf(json, sizeof json, "{\"model_type\": \"qwen3_5\", \"text_config\": {\"quantization_config\": %s}}",
                 body);
    else
        snprintf(json, sizeof json, "{\"model_type\": \"qwen3_5\", \"quantization_config\": %s}", body);
    return cm_quant_cfg_parse(q, json, ORIGIN);
}

#define QWEN                                                                                                 \
    "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"activation_scheme\": \"dynamic\", "                   \
    "\"weight_block_size\": [128, 128], \"modules_to_not_convert\": [\"lm_head\", "                        \
    "\"model.language_model.embed_tokens\", \"model.language_model.layers.0.mlp.gate\", "                 \
    "\"model.language_model.layers.0.linear_attn.A_log\", \"model.visual.*\"]}"

static void test_accepts(void) {
    cm_quant_cfg q;
    TST_CHECK(tst_ok(parse(&q, NULL, 0), "no quantization_config"));
    TST_CHECK(q.fp8 == 0 && q.n_skip == 0 && !q.skip);
    cm_quant_cfg_release(&q);
    TST_CHECK(tst_ok(parse(&q, "null", 0), "quantization_config null"));
    TST_CHECK(q.fp8 == 0);
    cm_quant_cfg_release(&q);

    for (int nested = 0; nested < 2; nested++) {
        TST_CHECK(tst_ok(parse(&q, QWEN, nested), "Qwen's FP8 config"));
        TST_CHECK(q.fp8 == 1 && q.dequantize == 0 && q.block_n == 128 && q.block_k == 128 && q.n_skip == 5);
        TST_CHECK(q.n_skip == 5 && strcmp(q.skip[4], "model.visual.*") == 0);
        TST_CHECK(cm_quant_cfg_skips(&q, "lm_head.weight") && strcmp(cm_quant_cfg_skips(&q, "lm_head.weight"), "lm_head") == 0);
        TST_CHECK(cm_quant_cfg_skips(&q, "model.language_model.embed_tokens.weight"));
        TST_CHECK(cm_quant_cfg_skips(&q, "model.language_model.layers.0.mlp.gate.weight"));
        TST_CHECK(!cm_quant_cfg_skips(&q, "model.language_model.layers.0.mlp.gate_proj.weight"));
        TST_CHECK(!cm_quant_cfg_skips(&q, "model.language_model.layers.10.mlp.gate.weight"));
        TST_CHECK(cm_quant_cfg_skips(&q, "model.language_model.layers.0.linear_attn.A_log"));
        TST_CHECK(!cm_quant_cfg_skips(&q, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"));
        TST_CHECK(cm_quant_cfg_skips(&q, "model.visual.blocks.0.attn.qkv.weight"));
        cm_quant_cfg_release(&q);
        TST_CHECK(q.skip == NULL && q.n_skip == 0);
    }
    /* the optional fields absent; ignored_layers (vLLM's name) adds to the list; dequantize */
    TST_CHECK(tst_ok(parse(&q, "{\"quant_method\": \"fp8\", \"ignored_layers\": [\"lm_head\"], "
                               "\"modules_to_not_convert\": null, \"dequantize\": true, \"scale_fmt\": \"float\"}",
                           0),
                     "minimal FP8 config"));
    TST_CHECK(q.fp8 == 1 && q.dequantize == 1 && q.block_n == 128 && q.n_skip == 1);
    cm_quant_cfg_release(&q);
    cm_quant_cfg_release(NULL);
}

static void test_refuses(void) {
    cm_quant_cfg q;
    TST_FAILS(parse(&q, "{\"quant_method\": \"awq\"}", 0), CM_ERR_UNSUPPORTED, ORIGIN,
              "quantization_config.quant_method 'awq' is not supported", "bf16 release");
    TST_FAILS(parse(&q, "{\"quant_method\": \"gptq\"}", 1), CM_ERR_UNSUPPORTED,
              "text_config.quantization_config.quant_method 'gptq'");
    TST_FAILS(parse(&q, "{\"fmt\": \"e4m3\"}", 0), CM_ERR_FORMAT, "missing field 'quantization_config.quant_method'");
    TST_FAILS(parse(&q, "{\"quant_method\": 8}", 0), CM_ERR_FORMAT, "quant_method' must be a string");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\"}", 0), CM_ERR_UNSUPPORTED,
              "quantization_config.fmt 'e5m2' is not supported", "e4m3");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"activation_scheme\": \"static\"}", 0), CM_ERR_UNSUPPORTED,
              "activation_scheme 'static' is not supported", "dynamic");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\"}", 0), CM_ERR_UNSUPPORTED,
              "scale_fmt 'ue8m0' is not supported");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 128]}", 0), CM_ERR_UNSUPPORTED,
              "weight_block_size [64, 128] is not supported", "[128, 128]");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"weight_block_size\": [128]}", 0), CM_ERR_UNSUPPORTED,
              "weight_block_size (not two numbers)");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"modules_to_not_convert\": \"lm_head\"}", 0), CM_ERR_FORMAT,
              "modules_to_not_convert' must be a list of module names");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"ignored_layers\": [\"a\", 3]}", 0), CM_ERR_FORMAT,
              "ignored_layers[1] must be a module name");
    TST_FAILS(parse(&q, "{\"quant_method\": \"fp8\", \"dequantize\": 1}", 0), CM_ERR_FORMAT,
              "dequantize' must be true or false");
    TST_FAILS(parse(&q, "[1]", 0), CM_ERR_FORMAT, "quantization_config' must be an object");
    TST_FAILS(cm_quant_cfg_load(&q, "/nonexistent/model"), CM_ERR_IO, "/nonexistent/model");
    TST_CHECK(q.skip == NULL); /* a failed parse leaves nothing to release */
}

static void test_names(void) {
    static const struct {
        const char *pattern, *name;
        int         match;
    } cases[] = {
        {"lm_head", "lm_head", 1},
        {"mlp.gate", "model.layers.0.mlp.gate", 1},
        {"mlp.gate", "model.layers.0.mlp.gate_proj", 0},
        {"mlp.gate", "model.layers.0.mlp.gate.weight", 0}, /* a module's name, not its tensor's */
        {"model.visual", "model.visual.blocks.0.attn.qkv", 1},
        {"model.visual.*", "model.visual.blocks.0.attn.qkv", 1},
        {"model.visual.*", "model.visualizer.x", 0},
        {"layers.1.mlp", "model.layers.10.mlp", 0},
        {"model.layers.1", "model.layers.1.mlp.up_proj", 1},
        {"model.layers.1", "model.layers.12.mlp.up_proj", 0},
        {"gate", "model.layers.0.mlp.up_gate", 0},
        {"proj", "model.layers.0.mlp.up_proj", 0},
        {"", "lm_head", 0},
        {"*.k_norm", "model.layers.3.self_attn.k_norm", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int got = cm_quant_name_match(cases[i].pattern, cases[i].name);
        if (got != cases[i].match)
            fprintf(stderr, "  '%s' vs '%s': %d, expected %d\n", cases[i].pattern, cases[i].name, got,
                    cases[i].match);
        TST_CHECK(got == cases[i].match);
    }
}

int main(void) {
    test_accepts();
    test_refuses();
    test_names();
    return tst_report();
}
