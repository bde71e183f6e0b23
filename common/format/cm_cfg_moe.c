/* common/format/cm_cfg_moe.c — the mixture-of-experts part of a target config.json
 * (docs/moe.md). Qwen3.5-MoE (qwen3_5_moe_text) makes every layer a sparse block and always
 * renormalises the router's top-k; its configs carry mlp_only_layers: [] and no
 * norm_topk_prob or decoder_sparse_step, which Transformers' class does not read either, so
 * neither does Tandem. Qwen3-Next chooses per layer: layer i is sparse iff i is not in
 * mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the rest run the dense MLP of
 * intermediate_size. */
#include <cJSON.h>
#include <math.h>
#include <string.h>

#include "cm_cfg.h"
#include "cm_cfg_int.h"

/* mlp_only_layers: absent, null or an array of layer indices in [0, n_layers) (a repeated index is
 * harmless, as in Transformers). The range is checked before the value is converted to int: a
 * double outside int's range must not reach the cast (undefined behaviour). */
static cm_status mlp_only_layers(const cfg_obj *tx, int n_layers, unsigned char *dense) {
    const cJSON *arr = cm_cfg_item(tx, "mlp_only_layers");
    if (!arr) return CM_OK;
    if (!cJSON_IsArray(arr))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%smlp_only_layers' must be an array of layer indices, found %s",
                       tx->origin, tx->prefix, cm_cfg_json_kind(arr));
    int          i  = 0;
    const cJSON *it = NULL;
    cJSON_ArrayForEach(it, arr) {
        const double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!cJSON_IsNumber(it) || !(d >= 0 && d < n_layers) || d != floor(d))
            return CM_FAIL(CM_ERR_FORMAT, "'%s': %smlp_only_layers[%d] must be a layer index in [0, %d)", tx->origin,
                           tx->prefix, i, n_layers);
        dense[(int)d] = 1;
        i++;
    }
    return CM_OK;
}

cm_status cm_cfg_moe_fill(cm_target_cfg *cfg, const cfg_obj *tx) {
    const char *o = tx->origin, *p = tx->prefix;
    CM_TRY(cm_cfg_pos(tx, "num_experts", 1, 0, &cfg->n_experts));
    CM_TRY(cm_cfg_pos(tx, "num_experts_per_tok", 1, 0, &cfg->n_experts_per_tok));
    CM_TRY(cm_cfg_pos(tx, "moe_intermediate_size", 1, 0, &cfg->moe_intermediate_size));
    int found;
    CM_TRY(cm_cfg_int_opt(tx, "shared_expert_intermediate_size", &cfg->shared_expert_intermediate_size, &found));
    if (cfg->shared_expert_intermediate_size < 0)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': field '%sshared_expert_intermediate_size' must be 0 (none) or positive, "
                       "found %d", o, p, cfg->shared_expert_intermediate_size);
    if (cfg->n_experts > CM_CFG_MAX_EXPERTS)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "'%s': %snum_experts %d exceeds the %d experts Tandem routes over", o, p,
                       cfg->n_experts, CM_CFG_MAX_EXPERTS);
    if (cfg->n_experts_per_tok > cfg->n_experts)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': %snum_experts_per_tok %d exceeds num_experts %d", o, p,
                       cfg->n_experts_per_tok, cfg->n_experts);
    if (cfg->family == CM_TARGET_FAMILY_QWEN3_5_MOE) {
        cfg->norm_topk_prob = 1;
        memset(cfg->layer_moe, 1, (size_t)cfg->n_layers);
        return CM_OK;
    }
    CM_TRY(cm_cfg_bool(tx, "norm_topk_prob", 1, &cfg->norm_topk_prob));
    int step;
    CM_TRY(cm_cfg_pos(tx, "decoder_sparse_step", 0, 1, &step));
    unsigned char dense[CM_CFG_MAX_LAYERS] = {0};
    CM_TRY(mlp_only_layers(tx, cfg->n_layers, dense));
    for (int i = 0; i < cfg->n_layers; i++) cfg->layer_moe[i] = !dense[i] && (i + 1) % step == 0;
    return CM_OK;
}
