/* common/format/cm_cfg_hash.c — canonical text and XXH64 of a target config (see cm_cfg_hash.h).
 * The text names every field, so adding a field later changes every hash: bump nothing, the
 * trainer simply sees another target id. */
#include "cm_cfg_hash.h"

#include <stdarg.h>
#include <stdio.h>

#include "cm_hash.h"

typedef struct canon {
    char  *buf;
    size_t cap, len;
} canon;

static void put(canon *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static void put(canon *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char  *at = c->len < c->cap ? c->buf + c->len : NULL;
    size_t room = c->len < c->cap ? c->cap - c->len : 0;
    int    n = vsnprintf(at, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        c->len += (size_t)n;
}

size_t cm_target_cfg_canonical(const cm_target_cfg *cfg, char *buf, size_t cap) {
    canon c = {buf, cap, 0};
    if (cap)
        buf[0] = '\0';
    put(&c, "tandem-target-v1;family=%d;model_type=%s;hidden_size=%d;n_layers=%d;intermediate_size=%d;",
        (int)cfg->family, cfg->model_type, cfg->hidden_size, cfg->n_layers, cfg->intermediate_size);
    put(&c, "vocab_size=%d;rms_norm_eps=%.9g;tie_word_embeddings=%d;layer_types=", cfg->vocab_size,
        (double)cfg->rms_norm_eps, cfg->tie_word_embeddings);
    for (int i = 0; i < cfg->n_layers && i < CM_CFG_MAX_LAYERS; i++)
        put(&c, "%s%d", i ? "," : "", (int)cfg->layer_types[i]);
    put(&c, ";n_heads=%d;n_kv_heads=%d;head_dim=%d;rotary_dim=%d;rope_theta=%.17g;attn_output_gate=%d;",
        cfg->n_heads, cfg->n_kv_heads, cfg->head_dim, cfg->rotary_dim, cfg->rope_theta,
        cfg->attn_output_gate);
    put(&c, "lin_n_k_heads=%d;lin_n_v_heads=%d;lin_k_head_dim=%d;lin_v_head_dim=%d;lin_conv_kernel=%d;",
        cfg->lin_n_k_heads, cfg->lin_n_v_heads, cfg->lin_k_head_dim, cfg->lin_v_head_dim,
        cfg->lin_conv_kernel);
    if (cfg->n_experts) { /* only MoE targets name these, so a dense target's hash is unchanged */
        put(&c, "n_experts=%d;n_experts_per_tok=%d;moe_intermediate_size=%d;shared_expert_intermediate_size=%d;",
            cfg->n_experts, cfg->n_experts_per_tok, cfg->moe_intermediate_size, cfg->shared_expert_intermediate_size);
        put(&c, "norm_topk_prob=%d;layer_moe=", cfg->norm_topk_prob);
        for (int i = 0; i < cfg->n_layers && i < CM_CFG_MAX_LAYERS; i++) put(&c, "%d", cfg->layer_moe[i]);
        put(&c, ";");
    }
    return c.len;
}

uint64_t cm_target_cfg_hash(const cm_target_cfg *cfg) {
    char   text[8192];
    size_t n = cm_target_cfg_canonical(cfg, text, sizeof text);
    CM_ASSERT(n < sizeof text); /* 256 layers × 5 bytes + the fixed fields fit */
    uint64_t h = cm_xxh64(text, n, 0);
    return h ? h : 1;
}

uint64_t cm_target_random_id(uint64_t cfg_hash, uint64_t seed) {
    uint64_t id = cfg_hash ^ 0x72616e646f6d0000ull ^ seed; /* "random" */
    return id ? id : 1;
}

int cm_target_identity_differs(char *buf, size_t cap, uint64_t have_cfg, uint64_t have_weights, uint64_t want_cfg,
                               uint64_t want_weights, const char *here, const char *expected) {
    const int cfg_differs = want_cfg && have_cfg != want_cfg;
    const int w_differs = want_weights && have_weights != want_weights;
    if (!cfg_differs && !w_differs) return 0;
    if (!cfg_differs)
        snprintf(buf, cap, "same architecture (config %016llx), different weights (fingerprint %016llx %s, %016llx %s)",
                 (unsigned long long)have_cfg, (unsigned long long)have_weights, here,
                 (unsigned long long)want_weights, expected);
    else if (!w_differs)
        snprintf(buf, cap, "another architecture (config %016llx %s, %016llx %s)", (unsigned long long)have_cfg, here,
                 (unsigned long long)want_cfg, expected);
    else
        snprintf(buf, cap,
                 "another architecture (config %016llx %s, %016llx %s) and other weights (fingerprint %016llx %s, "
                 "%016llx %s)",
                 (unsigned long long)have_cfg, here, (unsigned long long)want_cfg, expected,
                 (unsigned long long)have_weights, here, (unsigned long long)want_weights, expected);
    return 1;
}
