/* tests/fuzz/fuzz_cfg.c — libFuzzer target: config.json text through both parsers of
 * cm_cfg.h (the hybrid Qwen target, nested or flat, and the DFlash drafter), as the programs
 * read --model and --config files. For a config that parses, the invariants the rest of the
 * code relies on must hold (layer counts in range, whole GQA groups, an even rotary width,
 * mask token and taps in range and distinct). */
#include <string.h>

#include "cm_cfg.h"
#include "fuzz_util.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    return 0;
}

static void check_target(const cm_target_cfg *c) {
    FUZZ_CHECK(c->n_layers >= 1 && c->n_layers <= CM_CFG_MAX_LAYERS);
    FUZZ_CHECK(c->hidden_size > 0 && c->intermediate_size > 0 && c->vocab_size > 0);
    FUZZ_CHECK(c->n_heads > 0 && c->n_kv_heads > 0 && c->n_heads % c->n_kv_heads == 0 && c->head_dim > 0);
    FUZZ_CHECK(c->rotary_dim >= 2 && c->rotary_dim % 2 == 0 && c->rotary_dim <= c->head_dim);
    FUZZ_CHECK(c->rope_theta > 0);
    FUZZ_CHECK(memchr(c->model_type, '\0', sizeof c->model_type) != NULL);
    int has_linear = 0;
    for (int i = 0; i < c->n_layers; i++) {
        FUZZ_CHECK(c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION ||
                   c->layer_types[i] == CM_LAYER_TYPE_FULL_ATTENTION);
        has_linear |= c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION;
    }
    if (has_linear) {
        FUZZ_CHECK(c->lin_n_k_heads > 0 && c->lin_n_v_heads > 0 && c->lin_n_v_heads % c->lin_n_k_heads == 0);
        FUZZ_CHECK(c->lin_k_head_dim > 0 && c->lin_v_head_dim > 0 && c->lin_conv_kernel > 0);
    }
}

static void check_drafter(const cm_drafter_cfg *c) {
    FUZZ_CHECK(c->n_layers >= 1 && c->n_layers <= CM_CFG_MAX_LAYERS);
    FUZZ_CHECK(c->hidden_size > 0 && c->vocab_size > 0 && c->head_dim > 0);
    FUZZ_CHECK(c->n_heads > 0 && c->n_kv_heads > 0 && c->n_heads % c->n_kv_heads == 0);
    FUZZ_CHECK(c->block_size >= 2);
    FUZZ_CHECK(c->mask_token_id >= 0 && c->mask_token_id < c->vocab_size);
    FUZZ_CHECK(c->num_target_layers > 0);
    FUZZ_CHECK(c->n_taps >= 1 && c->n_taps <= CM_CFG_MAX_TAPS);
    for (int i = 0; i < c->n_taps; i++) {
        FUZZ_CHECK(c->target_layer_ids[i] >= 0 && c->target_layer_ids[i] < c->num_target_layers);
        for (int j = 0; j < i; j++)
            FUZZ_CHECK(c->target_layer_ids[i] != c->target_layer_ids[j]);
    }
    for (int i = 0; i < c->n_layers; i++)
        if (c->layer_types[i] == CM_LAYER_TYPE_SLIDING_ATTENTION)
            FUZZ_CHECK(c->sliding_window > 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1); /* the parsers take NUL-terminated text, as cm_read_text_file gives */
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    cm_target_cfg  t;
    cm_drafter_cfg d;
    if (fuzz_note(cm_target_cfg_parse(&t, text, "fuzz/config.json")) == CM_OK)
        check_target(&t);
    if (fuzz_note(cm_drafter_cfg_parse(&d, text, "fuzz/config.json")) == CM_OK)
        check_drafter(&d);
    free(text);
    return 0;
}
