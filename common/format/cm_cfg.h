/* common/format/cm_cfg.h — the model configurations Tandem reads from Hugging Face config.json:
 * the hybrid Qwen target (Qwen3.5/3.6 dense and MoE: text model nested under "text_config" as
 * Qwen3_5{,Moe}ForConditionalGeneration saves it, or flat as the ForCausalLM classes save it;
 * Qwen3-Next, flat) and the
 * DFlash drafter (docs/drafter.md). Parsing validates every field it reads and fails
 * with one message naming the file, the field and the fix. Plain structs, caller-owned. */
#ifndef CM_CFG_H
#define CM_CFG_H

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_CFG_MAX_LAYERS 256
#define CM_CFG_MAX_TAPS   64
#define CM_CFG_MAX_EXPERTS 1024 /* a router's experts (Qwen's largest: 512); the kernels' KN_MOE_MAX_EXPERTS */

typedef enum cm_layer_type {
    CM_LAYER_TYPE_LINEAR_ATTENTION = 0, /* Gated DeltaNet */
    CM_LAYER_TYPE_FULL_ATTENTION,
    CM_LAYER_TYPE_SLIDING_ATTENTION,    /* drafter only */
} cm_layer_type;

typedef enum cm_target_family {
    CM_TARGET_FAMILY_QWEN3_5 = 0, /* qwen3_5 / qwen3_5_text: split in_proj_{qkv,z,b,a}, dense MLP */
    CM_TARGET_FAMILY_QWEN3_5_MOE, /* qwen3_5_moe / qwen3_5_moe_text: as qwen3_5, every MLP a sparse MoE block */
    CM_TARGET_FAMILY_QWEN3_NEXT,  /* qwen3_next: fused in_proj_qkvz / in_proj_ba (un-interleaved at load),
                                     MoE or dense per layer (decoder_sparse_step, mlp_only_layers) */
} cm_target_family;

typedef struct cm_target_cfg {
    cm_target_family family;
    char          model_type[32];      /* of the text model, e.g. "qwen3_5_text" */
    int           nested;              /* 1 if read from "text_config" */
    int           hidden_size;         /* D */
    int           n_layers;
    int           intermediate_size;
    int           vocab_size;          /* V */
    float         rms_norm_eps;
    int           tie_word_embeddings; /* from the text config, else top level; default 0 */
    cm_layer_type layer_types[CM_CFG_MAX_LAYERS];
    /* gated attention */
    int    n_heads;
    int    n_kv_heads;
    int    head_dim;
    int    rotary_dim;                 /* head_dim · partial_rotary_factor, even */
    double rope_theta;
    int    attn_output_gate;           /* default 1 */
    /* gated deltanet */
    int lin_n_k_heads;
    int lin_n_v_heads;                 /* a multiple of lin_n_k_heads */
    int lin_k_head_dim;
    int lin_v_head_dim;
    int lin_conv_kernel;
    /* mixture of experts (docs/moe.md; all 0 for a dense target) */
    int           n_experts;           /* E, num_experts */
    int           n_experts_per_tok;   /* K, num_experts_per_tok */
    int           moe_intermediate_size;
    int           shared_expert_intermediate_size; /* 0: no shared expert */
    int           norm_topk_prob;      /* renormalise the K chosen weights (qwen3_5_moe: always) */
    unsigned char layer_moe[CM_CFG_MAX_LAYERS]; /* 1: layer i's MLP is the sparse block, 0: dense */
} cm_target_cfg;

/* Whether layer l's MLP is the sparse MoE block. */
static inline int cm_target_layer_moe(const cm_target_cfg *cfg, int l) { return cfg->n_experts > 0 && cfg->layer_moe[l]; }

/* Reads DIR/config.json (or a file path). Unknown model_type → CM_ERR_UNSUPPORTED naming
 * the supported ones; missing or bad fields → CM_ERR_FORMAT. */
cm_status cm_target_cfg_load(cm_target_cfg *cfg, const char *path);
/* Parses JSON text; origin names it in messages. */
cm_status cm_target_cfg_parse(cm_target_cfg *cfg, const char *json, const char *origin);

typedef enum cm_drafter_kind {
    CM_DRAFTER_DFLASH = 0, /* DFlashDraftModel */
    CM_DRAFTER_DFLASH2,    /* DFlash2DraftModel: + dynamic convolutions and the candidate selector */
} cm_drafter_kind;

/* The config's top-level is_causal: absent (or null) leaves it to layer_types; zero-initialised
 * configs therefore keep that default. */
typedef enum cm_causal {
    CM_CAUSAL_BY_LAYER_TYPE = 0, /* absent: sliding layers causal within the block, full layers not */
    CM_CAUSAL_NONE,              /* is_causal false: no layer causal */
    CM_CAUSAL_ALL,               /* is_causal true: every layer causal */
} cm_causal;

#define CM_CFG_MAX_TOKEN 64 /* bytes of a token string, with its terminator */

typedef struct cm_drafter_cfg {
    cm_drafter_kind kind;
    int           hidden_size;
    int           n_layers;
    int           intermediate_size;
    int           vocab_size;
    int           n_heads;
    int           n_kv_heads;
    int           head_dim;
    float         rms_norm_eps;
    double        rope_theta;
    int           max_position_embeddings;
    int           tie_word_embeddings;
    int           attention_bias;
    cm_layer_type layer_types[CM_CFG_MAX_LAYERS]; /* FULL or SLIDING */
    int           sliding_window;                 /* W, for sliding layers; 0 if none */
    cm_causal     is_causal;
    int           block_size;                     /* B ≥ 2 */
    int           mask_token_id;                  /* < vocab_size */
    int           num_target_layers;
    int           n_taps;
    int           target_layer_ids[CM_CFG_MAX_TAPS];
    /* DFlash2 only (dflash_config; 0 for DFlash): conv_kernel_size Kc ≤ block_size, conv_group_size G
     * dividing hidden_size, selector_rank R ≥ 1, selector_top_k K ≤ vocab_size */
    int conv_kernel_size, conv_group_size, selector_rank, selector_top_k;
    /* dflash_config.mask_token: the mask token's string in the target's tokenizer ("" when the config
     * has none; the trainer fills it from the target's tokenizer.json so that a serving loader does not
     * default it to "<|MASK|>") */
    char mask_token[CM_CFG_MAX_TOKEN];
} cm_drafter_cfg;

/* Does layer l's block attention see only the slots up to a query's own (causal) or all of the
 * block? The top-level is_causal, where given, decides for every layer (as z-lab's and vLLM's
 * loaders read it); else sliding layers are causal and full layers are not. */
static inline int cm_drafter_layer_causal(const cm_drafter_cfg *cfg, int l) {
    if (cfg->is_causal != CM_CAUSAL_BY_LAYER_TYPE)
        return cfg->is_causal == CM_CAUSAL_ALL;
    return cfg->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION;
}

cm_status cm_drafter_cfg_load(cm_drafter_cfg *cfg, const char *path);
cm_status cm_drafter_cfg_parse(cm_drafter_cfg *cfg, const char *json, const char *origin);

/* Reads a whole text file (≤ max_bytes) into a malloc'd NUL-terminated buffer; caller frees. */
/* A model's sampling defaults and end tokens, as Hugging Face's generate reads them: from
 * DIR/generation_config.json (do_sample, temperature, top_p, top_k, eos_token_id) with Hugging
 * Face's defaults for what is absent (greedy; 1.0, 1.0, 50), and end tokens from it or else from
 * config.json's eos_token_id (top level or text_config; an integer or a list). A missing
 * generation_config.json is not an error. */
#define CM_GEN_MAX_EOS 8
typedef struct cm_gen_cfg {
    int   do_sample;
    float temperature, top_p;
    int   top_k;
    int   n_eos;
    int   eos[CM_GEN_MAX_EOS];
} cm_gen_cfg;
cm_status cm_gen_cfg_load(cm_gen_cfg *g, const char *model_dir);

cm_status cm_read_text_file(const char *path, size_t max_bytes, char **out);

/* The string of token id in MODEL_DIR/tokenizer.json (its added tokens first, then its model vocabulary)
 * into out [cap]: *found = 1, or 0 (out "") when the file is absent, the id is not there or the string
 * does not fit. CM_ERR_IO / CM_ERR_FORMAT for a file that cannot be read or parsed. */
cm_status cm_tokenizer_token(const char *model_dir, int id, char *out, size_t cap, int *found);

#ifdef __cplusplus
}
#endif
#endif /* CM_CFG_H */
