/* kernels/kn_backend.c — the cpu backend table (the ref/ functions) and lookup by name.
 * In a build without CUDA this file also defines kn_backend_cuda() as NULL; with CUDA,
 * kernels/kn_backend_cuda.c defines it. The tables are const and shared by all threads. */
#include "kn_backend.h"

#include <string.h>

#include "kn_ref.h"

static const kn_backend cpu_backend = {
    .name             = "cpu",
    .ctx_create       = kn_ref_ctx_create,
    .ctx_destroy      = kn_ref_ctx_destroy,
    .alloc            = kn_ref_alloc,
    .free             = kn_ref_free,
    .upload           = kn_ref_upload,
    .download         = kn_ref_download,
    .sync             = kn_ref_sync,
    .copy_peer        = kn_ref_copy_peer,
    .zero             = kn_ref_zero,
    .copy2d           = kn_ref_copy2d,
    .add              = kn_ref_add,
    .swiglu           = kn_ref_swiglu,
    .embed            = kn_ref_embed,
    .gemm             = kn_ref_gemm,
    .rmsnorm          = kn_ref_rmsnorm,
    .rmsnorm_gated    = kn_ref_rmsnorm_gated,
    .l2norm           = kn_ref_l2norm,
    .rope             = kn_ref_rope,
    .attention        = kn_ref_attention,
    .conv1d_silu      = kn_ref_conv1d_silu,
    .gdn_gate         = kn_ref_gdn_gate,
    .gated_delta_rule = kn_ref_gated_delta_rule,
    .gemm_dx          = kn_ref_gemm_dx,
    .gemm_dw          = kn_ref_gemm_dw,
    .rmsnorm_bwd      = kn_ref_rmsnorm_bwd,
    .rope_bwd         = kn_ref_rope_bwd,
    .swiglu_bwd       = kn_ref_swiglu_bwd,
    .dflash_attn_fwd  = kn_ref_dflash_attn_fwd,
    .dflash_attn_bwd  = kn_ref_dflash_attn_bwd,
    .dynconv_fwd      = kn_ref_dynconv_fwd,
    .dynconv_bwd      = kn_ref_dynconv_bwd,
    .selector_fwd     = kn_ref_selector_fwd,
    .selector_bwd     = kn_ref_selector_bwd,
    .lm_ce            = kn_ref_lm_ce,
    .lm_ce_topk       = kn_ref_lm_ce_topk,
    .sumsq            = kn_ref_sumsq,
    .adamw            = kn_ref_adamw,
    .fill_uniform     = kn_ref_fill_uniform,
    .gemm_rounds_input  = kn_ref_gemm_rounds_input,
    .gemm_bf16in        = kn_ref_gemm_bf16in,
    .gemm_bf16in_acc    = kn_ref_gemm_bf16in_acc,
    .add_rmsnorm_bf16   = kn_ref_add_rmsnorm_bf16,
    .rmsnorm_gated_bf16 = kn_ref_rmsnorm_gated_bf16,
    .swiglu_bf16        = kn_ref_swiglu_bf16,
    .gdn_conv_qkv       = kn_ref_gdn_conv_qkv,
    .gdn_conv_qkv_bf16  = kn_ref_gdn_conv_qkv_bf16,
    .gated_delta_rule_bf16 = kn_ref_gated_delta_rule_bf16,
    .qk_prep            = kn_ref_qk_prep,
    .cast2d             = kn_ref_cast2d,
    .matmul             = kn_ref_matmul,
    .swiglu_typed       = kn_ref_swiglu_typed,
    .swiglu_bwd_typed   = kn_ref_swiglu_bwd_typed,
    .swiglu_fwd_bwd_typed = kn_ref_swiglu_fwd_bwd_typed,
    .rmsnorm_bwd_acc    = kn_ref_rmsnorm_bwd_acc,
    .rmsnorm_typed      = kn_ref_rmsnorm_typed,
    .rmsnorm_bwd_typed  = kn_ref_rmsnorm_bwd_typed,
    .head_norm_rope     = kn_ref_head_norm_rope,
    .head_norm_rope_bwd = kn_ref_head_norm_rope_bwd,
    .kv_cache_write     = kn_ref_kv_cache_write,
    .attention_cached   = kn_ref_attention_cached,
    .conv1d_silu_cached = kn_ref_conv1d_silu_cached,
    .gdn_cached         = kn_ref_gdn_cached,
    .sumsq_multi        = kn_ref_sumsq_multi,
    .adamw_multi        = kn_ref_adamw_multi,
    .fp8_quantize_weight = kn_ref_fp8_quantize_weight,
    .gemm_fp8            = kn_ref_gemm_fp8,
    .fp8_quantize_rows   = kn_ref_fp8_quantize_rows,
    .gemm_fp8q           = kn_ref_gemm_fp8q,
    .gemm_fp8q_acc       = kn_ref_gemm_fp8q_acc,
    .swiglu_fp8          = kn_ref_swiglu_fp8,
    .add_rmsnorm_fp8     = kn_ref_add_rmsnorm_fp8,
    .rmsnorm_gated_fp8   = kn_ref_rmsnorm_gated_fp8,
    .fp8_supported       = kn_ref_fp8_supported,
    .moe_route           = kn_ref_moe_route,
    .moe_group           = kn_ref_moe_group,
    .moe_gather          = kn_ref_moe_gather,
    .moe_combine         = kn_ref_moe_combine,
    .moe_gemm            = kn_ref_moe_gemm,
    .moe_gemm_swiglu     = kn_ref_moe_gemm_swiglu,
    .moe_gemm_fp8        = kn_ref_moe_gemm_fp8,
};

const kn_backend *kn_backend_cpu(void) { return &cpu_backend; }

#ifndef TANDEM_HAVE_CUDA
const kn_backend *kn_backend_cuda(void) { return NULL; }
#endif

cm_status kn_backend_get(const char *name, const kn_backend **out) {
    if (!out) return CM_FAIL(CM_ERR_INVALID_ARG, "kn_backend_get: out is NULL");
    *out = NULL;
    if (!name) return CM_FAIL(CM_ERR_INVALID_ARG, "no backend name given (use \"cpu\" or \"cuda\")");
    if (strcmp(name, "cpu") == 0) {
        *out = kn_backend_cpu();
        return CM_OK;
    }
    if (strcmp(name, "cuda") == 0) {
#ifdef TANDEM_HAVE_CUDA
        *out = kn_backend_cuda();
        if (*out) return CM_OK;
#endif
        return CM_FAIL(CM_ERR_UNSUPPORTED, "this build has no cuda backend (rebuild where nvcc is found)");
    }
    return CM_FAIL(CM_ERR_INVALID_ARG, "unknown backend '%s' (use \"cpu\" or \"cuda\")", name);
}
