/* common/format/cm_quant.h — a checkpoint's quantization_config (config.json, at the top level
 * or inside text_config): which quantized formats Tandem reads (docs/fp8.md). Only Qwen's
 * fine-grained FP8 is read: quant_method "fp8", e4m3 weights in 128 × 128 blocks with one
 * float scale each (weight_scale_inv), activations quantized at run time ("dynamic"). Anything
 * else fails with one CM_ERR_UNSUPPORTED message naming the field, the value and what to do.
 *
 * The struct is caller-owned; its list of modules kept out of quantization is on the heap
 * (cm_quant_cfg_release frees it). Stateless otherwise, so safe from any thread. */
#ifndef CM_QUANT_H
#define CM_QUANT_H

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cm_quant_cfg {
    int    fp8;        /* 1: quant_method "fp8" (the fields below checked); 0: no quantization_config */
    int    dequantize; /* "dequantize": true: the producer asks for bf16 weights; Tandem's default
                          precision is then bf16 (the FP8 tensors dequantized on load) */
    int    block_n, block_k; /* weight_block_size: 128, 128 */
    int    n_skip;
    char **skip;       /* modules_to_not_convert and ignored_layers, as written (heap) */
} cm_quant_cfg;

/* Reads DIR/config.json (or a file path). No quantization_config (or null) gives fp8 = 0 and
 * an empty list. Supported: quant_method "fp8"; fmt "e4m3" or absent; activation_scheme
 * "dynamic" or absent; weight_block_size [128, 128] or absent; scale_fmt "float" or absent;
 * modules_to_not_convert / ignored_layers lists of strings; dequantize a boolean. Another
 * method, fmt, scheme, block size or scale format → CM_ERR_UNSUPPORTED naming it; a field of
 * the wrong JSON type → CM_ERR_FORMAT. q is zeroed first; release it on success only. */
cm_status cm_quant_cfg_load(cm_quant_cfg *q, const char *path);
/* Parses JSON text; origin names it in messages. */
cm_status cm_quant_cfg_parse(cm_quant_cfg *q, const char *json, const char *origin);
void      cm_quant_cfg_release(cm_quant_cfg *q); /* frees the list; q zeroed; NULL-safe */

/* 1 when pattern names module (a dotted module or tensor name) at module boundaries, as
 * Transformers 5.24's should_convert_module means it: the pattern equals the name, a leading
 * run of its components ("model.visual" names "model.visual.blocks.0.attn.qkv") or a trailing
 * run ("lm_head" names "lm_head", "mlp.gate" names "model.layers.0.mlp.gate" but not
 * "model.layers.0.mlp.gate_proj"). '*' in the pattern matches any characters, dots included
 * ("model.visual.*"). */
int cm_quant_name_match(const char *pattern, const char *module);

/* The pattern of the list that keeps tensor (a checkpoint name such as
 * "model.layers.0.mlp.gate.weight") out of quantization, naming the tensor or its module (the
 * name without its last component); NULL when none does. Borrowed from q. */
const char *cm_quant_cfg_skips(const cm_quant_cfg *q, const char *tensor);

#ifdef __cplusplus
}
#endif
#endif /* CM_QUANT_H */
