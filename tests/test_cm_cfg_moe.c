/* tests/test_cm_cfg_moe.c — the mixture-of-experts part of target config parsing (cm_cfg_moe.c):
 * the Qwen3.5-MoE deploy configs (deploy/configs/qwen3.5-{35b-a3b,122b-a10b}, nested under
 * text_config) and the same text model flat; Qwen3-Next (flat, the shape of its FP8 release in the
 * fp8/MoE reference notes, B5) with its per-layer choice (decoder_sparse_step, mlp_only_layers:
 * dense layers then need intermediate_size) and norm_topk_prob; Qwen3.5-MoE ignoring those keys
 * (every layer sparse, always renormalised, as Transformers' class reads it); each bad MoE field
 * failing with one message naming it; and the target hash: a dense config's is what it was before
 * the MoE fields existed, and two MoE configs that differ only in top-k hash differently. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_cfg.h"
#include "cm_cfg_hash.h"
#include "cm_hash.h"
#include "tst.h"
#include "tst_json.h"

#define DEPLOY TANDEM_TEST_DATA "/../deploy/configs"
#define ORIGIN "fixture/config.json"

/* Qwen3-Next: hidden 2048, 48 layers (full attention every 4th), 16/2 heads of 256, GDN 16/32 heads of
 * 128, 512 experts top-10, expert and shared MLP 512, norm_topk_prob, decoder_sparse_step 1, no dense
 * layers (intermediate_size 5120 unused), vocab 151936, RoPE θ 1e7 on a quarter of each head. */
static const char *const next_json =
    "{\"architectures\": [\"Qwen3NextForCausalLM\"], \"model_type\": \"qwen3_next\", \"hidden_size\": 2048,"
    " \"num_hidden_layers\": 48, \"full_attention_interval\": 4, \"num_attention_heads\": 16,"
    " \"num_key_value_heads\": 2, \"head_dim\": 256, \"linear_num_key_heads\": 16, "
    "\"linear_num_value_heads\": 32,"
    " \"linear_key_head_dim\": 128, \"linear_value_head_dim\": 128, \"linear_conv_kernel_dim\": 4,"
    " \"num_experts\": 512, \"num_experts_per_tok\": 10, \"moe_intermediate_size\": 512,"
    " \"shared_expert_intermediate_size\": 512, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,"
    " \"mlp_only_layers\": [], \"intermediate_size\": 5120, \"vocab_size\": 151936, \"rms_norm_eps\": 1e-06,"
    " \"rope_parameters\": {\"rope_theta\": 10000000, \"partial_rotary_factor\": 0.25, \"rope_type\": "
    "\"default\"},"
    " \"router_aux_loss_coef\": 0.001, \"tie_word_embeddings\": false, \"max_position_embeddings\": 262144,"
    " \"hidden_act\": \"silu\", \"dtype\": \"bfloat16\"}";


static cJSON *next(void) {
    cJSON *j = cJSON_Parse(next_json);
    if (!j)
        exit(1);
    return j;
}

static cJSON *moe_35b(void) {
    return tst_json_load(DEPLOY "/qwen3.5-35b-a3b/target-config.json");
}

/* The 35B's text model flat, as Qwen3_5MoeForCausalLM saves it: text_config's fields at the top. */
static cJSON *moe_35b_flat(void) {
    cJSON *root = moe_35b();
    cJSON *tx = cJSON_DetachItemFromObjectCaseSensitive(root, "text_config");
    cJSON_Delete(root);
    if (!tx)
        exit(1);
    return tx;
}


static cm_status target_of(cJSON *j, cm_target_cfg *cfg) { return tst_json_target(j, cfg, ORIGIN); }

static int n_sparse(const cm_target_cfg *c) {
    int n = 0;
    for (int l = 0; l < c->n_layers; l++)
        n += cm_target_layer_moe(c, l);
    return n;
}

// ---- Qwen3.5-MoE

/* Every MoE field of a Qwen3.5-MoE target (fp8/MoE reference notes, B4) and the dense fields that
 * go with them; hidden, layers, query heads, GDN value heads and the expert MLP per model. */
static void check_qwen35_moe(const cm_target_cfg *c, int nested, int D, int L, int H, int nv, int Ie) {
    TST_CHECK(c->family == CM_TARGET_FAMILY_QWEN3_5_MOE && strcmp(c->model_type, "qwen3_5_moe_text") == 0);
    TST_CHECK(c->nested == nested);
    TST_CHECK(c->hidden_size == D && c->n_layers == L && c->vocab_size == 248320 && !c->tie_word_embeddings);
    TST_CHECK(c->n_heads == H && c->n_kv_heads == 2 && c->head_dim == 256 && c->rotary_dim == 64);
    TST_CHECK(c->rope_theta == 1e7 && c->attn_output_gate == 1 && c->rms_norm_eps == 1e-6f);
    TST_CHECK(c->lin_n_k_heads == 16 && c->lin_n_v_heads == nv && c->lin_k_head_dim == 128 &&
              c->lin_v_head_dim == 128 && c->lin_conv_kernel == 4);
    TST_CHECK(c->n_experts == 256 && c->n_experts_per_tok == 8);
    TST_CHECK(c->moe_intermediate_size == Ie && c->shared_expert_intermediate_size == Ie);
    TST_CHECK(c->norm_topk_prob == 1);
    TST_CHECK(c->intermediate_size == 0); /* absent: no layer has a dense MLP */
    int bad = 0;
    for (int l = 0; l < L; l++) {
        bad += c->layer_moe[l] != 1 || !cm_target_layer_moe(c, l);
        bad +=
            c->layer_types[l] != (l % 4 == 3 ? CM_LAYER_TYPE_FULL_ATTENTION : CM_LAYER_TYPE_LINEAR_ATTENTION);
    }
    TST_CHECK(bad == 0);
    for (int l = L; l < CM_CFG_MAX_LAYERS; l++)
        bad += c->layer_moe[l] != 0;
    TST_CHECK(bad == 0 && n_sparse(c) == L);
}

static void test_qwen35_moe(void) {
    cm_target_cfg c;
    TST_CHECK(tst_ok(cm_target_cfg_load(&c, DEPLOY "/qwen3.5-35b-a3b/target-config.json"), "35B-A3B"));
    check_qwen35_moe(&c, 1, 2048, 40, 16, 32, 512);
    TST_CHECK(tst_ok(cm_target_cfg_load(&c, DEPLOY "/qwen3.5-122b-a10b/target-config.json"), "122B-A10B"));
    check_qwen35_moe(&c, 1, 3072, 48, 32, 64, 1024);

    // flat (qwen3_5_moe_text at the top level): the same model
    TST_CHECK(tst_ok(target_of(moe_35b_flat(), &c), "flat 35B-A3B"));
    check_qwen35_moe(&c, 0, 2048, 40, 16, 32, 512);
    // the flat text type nested under text_config is refused: it has no text_config
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "model_type", "\"qwen3_5_moe_text\""), &c), CM_ERR_FORMAT,
              "missing field 'hidden_size'");

    // Transformers' Qwen3.5-MoE reads neither norm_topk_prob, decoder_sparse_step nor mlp_only_layers:
    // always renormalised, every layer sparse, whatever the config says
    cJSON *j = tst_json_edit(moe_35b(), "text_config.norm_topk_prob", "false");
    j = tst_json_edit(j, "text_config.decoder_sparse_step", "2");
    j = tst_json_edit(j, "text_config.mlp_only_layers", "[0, 3]");
    TST_CHECK(tst_ok(target_of(j, &c), "35B-A3B with Qwen3-Next keys"));
    check_qwen35_moe(&c, 1, 2048, 40, 16, 32, 512);
    TST_CHECK(
        tst_ok(target_of(tst_json_edit(moe_35b_flat(), "decoder_sparse_step", "0"), &c), "decoder_sparse_step 0"));
    TST_CHECK(n_sparse(&c) == 40 && c.norm_topk_prob == 1);
    // no shared expert
    TST_CHECK(tst_ok(target_of(tst_json_edit(moe_35b(), "text_config.shared_expert_intermediate_size", NULL), &c),
                     "no shared expert"));
    TST_CHECK(c.shared_expert_intermediate_size == 0 && c.n_experts == 256);
    TST_CHECK(tst_ok(target_of(tst_json_edit(moe_35b(), "text_config.shared_expert_intermediate_size", "0"), &c),
                     "shared expert 0"));
    TST_CHECK(c.shared_expert_intermediate_size == 0);
    // top-k = E and E = CM_CFG_MAX_EXPERTS are the largest allowed
    j = tst_json_edit(moe_35b(), "text_config.num_experts", "1024");
    TST_CHECK(
        tst_ok(target_of(tst_json_edit(j, "text_config.num_experts_per_tok", "1024"), &c), "1024 experts top-1024"));
    TST_CHECK(c.n_experts == CM_CFG_MAX_EXPERTS && c.n_experts_per_tok == CM_CFG_MAX_EXPERTS);
}

// ---- Qwen3-Next

static void test_qwen3_next(void) {
    cm_target_cfg c;
    TST_CHECK(tst_ok(cm_target_cfg_parse(&c, next_json, ORIGIN), "qwen3_next"));
    TST_CHECK(c.family == CM_TARGET_FAMILY_QWEN3_NEXT && strcmp(c.model_type, "qwen3_next") == 0 &&
              c.nested == 0);
    TST_CHECK(c.hidden_size == 2048 && c.n_layers == 48 && c.vocab_size == 151936 && !c.tie_word_embeddings);
    TST_CHECK(c.n_heads == 16 && c.n_kv_heads == 2 && c.head_dim == 256 && c.rotary_dim == 64);
    TST_CHECK(c.rope_theta == 1e7);
    TST_CHECK(c.lin_n_k_heads == 16 && c.lin_n_v_heads == 32 && c.lin_k_head_dim == 128 &&
              c.lin_v_head_dim == 128);
    TST_CHECK(c.n_experts == 512 && c.n_experts_per_tok == 10 && c.moe_intermediate_size == 512);
    TST_CHECK(c.shared_expert_intermediate_size == 512 && c.norm_topk_prob == 1);
    TST_CHECK(c.intermediate_size == 5120); /* read although no layer uses it */
    int bad = 0;
    for (int l = 0; l < 48; l++)
        bad +=
            !cm_target_layer_moe(&c, l) ||
            c.layer_types[l] != (l % 4 == 3 ? CM_LAYER_TYPE_FULL_ATTENTION : CM_LAYER_TYPE_LINEAR_ATTENTION);
    TST_CHECK(bad == 0);
    // defaults: decoder_sparse_step 1 and norm_topk_prob true (Qwen3NextConfig's), mlp_only_layers none;
    // every layer sparse, so intermediate_size may be absent
    cJSON *j = tst_json_edit(next(), "decoder_sparse_step", NULL);
    j = tst_json_edit(tst_json_edit(tst_json_edit(j, "norm_topk_prob", NULL), "mlp_only_layers", NULL), "intermediate_size", NULL);
    TST_CHECK(tst_ok(target_of(j, &c), "qwen3_next defaults"));
    TST_CHECK(n_sparse(&c) == 48 && c.norm_topk_prob == 1 && c.intermediate_size == 0);
    // null means unset
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "mlp_only_layers", "null"), &c), "mlp_only_layers null"));
    TST_CHECK(n_sparse(&c) == 48);

    // norm_topk_prob false: the router's top-k weights are used as the softmax gives them
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "norm_topk_prob", "false"), &c), "norm_topk_prob false"));
    TST_CHECK(c.norm_topk_prob == 0 && n_sparse(&c) == 48);

    // decoder_sparse_step 2, mlp_only_layers [0, 3]: layer i sparse iff i not listed and (i + 1) % 2 == 0,
    // so layers 1, 5, 7, 9, ..., 47 (23 of them); the others run the dense MLP of intermediate_size
    j = tst_json_edit(tst_json_edit(next(), "decoder_sparse_step", "2"), "mlp_only_layers", "[0, 3]");
    TST_CHECK(tst_ok(target_of(j, &c), "decoder_sparse_step 2, mlp_only_layers [0, 3]"));
    bad = 0;
    for (int l = 0; l < 48; l++) {
        const int want = l != 0 && l != 3 && (l + 1) % 2 == 0;
        bad += c.layer_moe[l] != want || cm_target_layer_moe(&c, l) != want;
    }
    TST_CHECK(bad == 0 && n_sparse(&c) == 23 && c.intermediate_size == 5120);
    TST_CHECK(!cm_target_layer_moe(&c, 0) && cm_target_layer_moe(&c, 1) && !cm_target_layer_moe(&c, 3));
    // mlp_only_layers alone: those layers dense; a repeated index is harmless
    TST_CHECK(
        tst_ok(target_of(tst_json_edit(next(), "mlp_only_layers", "[47, 0, 47]"), &c), "mlp_only_layers [47, 0, 47]"));
    TST_CHECK(n_sparse(&c) == 46 && !cm_target_layer_moe(&c, 0) && !cm_target_layer_moe(&c, 47));
    // a step above the layer count leaves every layer dense (the router's fields are still checked)
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "decoder_sparse_step", "49"), &c), "decoder_sparse_step 49"));
    TST_CHECK(n_sparse(&c) == 0 && c.n_experts == 512);

    // dense layers need intermediate_size: absent fails naming it
    j = tst_json_edit(tst_json_edit(next(), "decoder_sparse_step", "2"), "intermediate_size", NULL);
    TST_FAILS(target_of(j, &c), CM_ERR_FORMAT, "'" ORIGIN "': missing field 'intermediate_size'");
    j = tst_json_edit(tst_json_edit(next(), "mlp_only_layers", "[5]"), "intermediate_size", NULL);
    TST_FAILS(target_of(j, &c), CM_ERR_FORMAT, "missing field 'intermediate_size'");
    TST_FAILS(target_of(tst_json_edit(tst_json_edit(next(), "mlp_only_layers", "[5]"), "intermediate_size", "0"), &c),
              CM_ERR_FORMAT, "'intermediate_size' must be positive, found 0");
}

// ---- bad MoE fields: one message each, naming the field

static void test_bad(void) {
    cm_target_cfg c;
    // missing fields
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts", NULL), &c), CM_ERR_FORMAT,
              "'" ORIGIN "': missing field 'num_experts'");
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "text_config.num_experts", NULL), &c), CM_ERR_FORMAT,
              "missing field 'text_config.num_experts'");
    TST_FAILS(target_of(tst_json_edit(moe_35b_flat(), "num_experts", NULL), &c), CM_ERR_FORMAT,
              "missing field 'num_experts'");
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts_per_tok", NULL), &c), CM_ERR_FORMAT,
              "missing field 'num_experts_per_tok'");
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "text_config.moe_intermediate_size", NULL), &c), CM_ERR_FORMAT,
              "missing field 'text_config.moe_intermediate_size'");
    // values
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts", "0"), &c), CM_ERR_FORMAT,
              "'num_experts' must be positive");
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts", "\"512\""), &c), CM_ERR_FORMAT,
              "'num_experts' must be an integer, found a string");
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts_per_tok", "600"), &c), CM_ERR_FORMAT,
              "num_experts_per_tok 600 exceeds num_experts 512");
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "text_config.num_experts_per_tok", "257"), &c), CM_ERR_FORMAT,
              "text_config.num_experts_per_tok 257 exceeds num_experts 256");
    TST_FAILS(target_of(tst_json_edit(next(), "num_experts", "1025"), &c), CM_ERR_UNSUPPORTED,
              "num_experts 1025 exceeds the 1024 experts Tandem routes over");
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "text_config.num_experts", "4096"), &c), CM_ERR_UNSUPPORTED,
              "text_config.num_experts 4096 exceeds the 1024 experts");
    TST_FAILS(target_of(tst_json_edit(next(), "moe_intermediate_size", "-512"), &c), CM_ERR_FORMAT,
              "'moe_intermediate_size' must be positive, found -512");
    TST_FAILS(target_of(tst_json_edit(next(), "shared_expert_intermediate_size", "-1"), &c), CM_ERR_FORMAT,
              "'shared_expert_intermediate_size' must be 0 (none) or positive, found -1");
    TST_FAILS(target_of(tst_json_edit(moe_35b(), "text_config.shared_expert_intermediate_size", "-512"), &c),
              CM_ERR_FORMAT, "'text_config.shared_expert_intermediate_size' must be 0 (none) or positive");
    TST_FAILS(target_of(tst_json_edit(next(), "shared_expert_intermediate_size", "0.5"), &c), CM_ERR_FORMAT,
              "'shared_expert_intermediate_size' must be an integer");
    TST_FAILS(target_of(tst_json_edit(next(), "norm_topk_prob", "1"), &c), CM_ERR_FORMAT,
              "'norm_topk_prob' must be true or false, found a number");
    TST_FAILS(target_of(tst_json_edit(next(), "decoder_sparse_step", "0"), &c), CM_ERR_FORMAT,
              "'decoder_sparse_step' must be positive, found 0");
    // mlp_only_layers: an array of layer indices in [0, n_layers)
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[0, 48]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[1] must be a layer index in [0, 48)");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[-1]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[0] must be a layer index in [0, 48)");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[1e20]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[0] must be a layer index in [0, 48)");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[2.5]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[0] must be a layer index");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[1, \"2\"]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[1] must be a layer index");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "[true]"), &c), CM_ERR_FORMAT,
              "mlp_only_layers[0] must be a layer index");
    TST_FAILS(target_of(tst_json_edit(next(), "mlp_only_layers", "3"), &c), CM_ERR_FORMAT,
              "field 'mlp_only_layers' must be an array of layer indices, found a number");
}

// ---- the target hash

/* cm_target_cfg_hash of the dense test fixtures as computed before the MoE fields existed (commit
 * 87c8d09, the parent of the MoE config commit): a dense target keeps its identity, so trainers and
 * shards made against it still match. */
#define HASH_27B_BEFORE_MOE  0xa972fcf0b2eec2c3ull
#define HASH_TINY_BEFORE_MOE 0xbf135531e0b6f097ull

static void test_hash(void) {
    cm_target_cfg c;
    char          text[8192];
    TST_CHECK(tst_ok(cm_target_cfg_load(&c, TANDEM_TEST_DATA "/data/cm/qwen3_6_27b"), "27B fixture"));
    size_t n = cm_target_cfg_canonical(&c, text, sizeof text);
    TST_CHECK(n < sizeof text && c.n_experts == 0);
    TST_CHECK(!strstr(text, "n_experts") && !strstr(text, "layer_moe") && !strstr(text, "norm_topk_prob"));
    TST_CHECK(strncmp(text, "tandem-target-v1;family=0;model_type=qwen3_5_text;", 50) == 0);
    TST_CHECK(cm_target_cfg_hash(&c) == cm_xxh64(text, n, 0));
    TST_CHECK(cm_target_cfg_hash(&c) == HASH_27B_BEFORE_MOE);
    if (cm_target_cfg_hash(&c) != HASH_27B_BEFORE_MOE)
        fprintf(stderr, "  27B hash %016llx, before the MoE fields %016llx\n%s\n",
                (unsigned long long)cm_target_cfg_hash(&c), (unsigned long long)HASH_27B_BEFORE_MOE, text);
    TST_CHECK(
        tst_ok(cm_target_cfg_load(&c, TANDEM_TEST_DATA "/data/cm/qwen3_5_tiny_flat/config.json"), "tiny"));
    TST_CHECK(cm_target_cfg_hash(&c) == HASH_TINY_BEFORE_MOE);

    // MoE: the fields are in the text, and each changes the hash
    cm_target_cfg a, b;
    TST_CHECK(tst_ok(target_of(moe_35b(), &a), "35B-A3B"));
    n = cm_target_cfg_canonical(&a, text, sizeof text);
    TST_CHECK(n < sizeof text && strstr(text, "n_experts=256;n_experts_per_tok=8;") != NULL);
    TST_CHECK(strstr(text, "layer_moe=1111111111111111111111111111111111111111;") != NULL);
    TST_CHECK(tst_ok(target_of(tst_json_edit(moe_35b(), "text_config.num_experts_per_tok", "9"), &b), "top-9"));
    TST_CHECK(cm_target_cfg_hash(&a) != cm_target_cfg_hash(&b));
    TST_CHECK(tst_ok(target_of(moe_35b(), &b), "35B-A3B again"));
    TST_CHECK(cm_target_cfg_hash(&a) == cm_target_cfg_hash(&b));
    // nested and flat spell the same model: the same hash (the nesting is not part of the identity)
    TST_CHECK(tst_ok(target_of(moe_35b_flat(), &b), "flat 35B-A3B"));
    TST_CHECK(cm_target_cfg_hash(&a) == cm_target_cfg_hash(&b));
    // Qwen3-Next: renormalisation and the sparse layers are part of the identity
    TST_CHECK(tst_ok(cm_target_cfg_parse(&a, next_json, ORIGIN), "qwen3_next"));
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "norm_topk_prob", "false"), &b), "norm_topk_prob false"));
    TST_CHECK(cm_target_cfg_hash(&a) != cm_target_cfg_hash(&b));
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "mlp_only_layers", "[7]"), &b), "mlp_only_layers [7]"));
    TST_CHECK(cm_target_cfg_hash(&a) != cm_target_cfg_hash(&b));
    TST_CHECK(tst_ok(target_of(tst_json_edit(next(), "shared_expert_intermediate_size", "256"), &b), "shared 256"));
    TST_CHECK(cm_target_cfg_hash(&a) != cm_target_cfg_hash(&b));
}

int main(void) {
    test_qwen35_moe();
    test_qwen3_next();
    test_bad();
    test_hash();
    return tst_report();
}
