/* kernels/kn_backend_cuda.c — the cuda backend table: the kn_cuda_* launchers (kn_*.cu)
 * behind the kn_backend contract. Compiled only in builds with CUDA (kn_backend.c defines
 * kn_backend_cuda() as NULL otherwise). The table is const and shared by all threads; its
 * contexts are not (one thread at a time per kn_ctx). */
#include "kn_backend.h"

#include "kn_cuda_ops.h"

static const kn_backend cuda_backend = {
    .name = "cuda",
    .ctx_create = kn_cuda_ctx_create,
    .ctx_destroy = kn_cuda_ctx_destroy,
    .alloc = kn_cuda_alloc,
    .free = kn_cuda_free,
    .upload = kn_cuda_upload,
    .download = kn_cuda_download,
    .sync = kn_cuda_sync,
    .zero = kn_cuda_zero,
    .host_pin = kn_cuda_host_pin,
    .host_unpin = kn_cuda_host_unpin,
    .copy2d = kn_cuda_copy2d,
    .add = kn_cuda_add,
    .swiglu = kn_cuda_swiglu,
    .embed = kn_cuda_embed,
    .gemm = kn_cuda_gemm,
    .rmsnorm = kn_cuda_rmsnorm,
    .rmsnorm_gated = kn_cuda_rmsnorm_gated,
    .l2norm = kn_cuda_l2norm,
    .rope = kn_cuda_rope,
    .attention = kn_cuda_attention,
    .conv1d_silu = kn_cuda_conv1d_silu,
    .gdn_gate = kn_cuda_gdn_gate,
    .gated_delta_rule = kn_cuda_gated_delta_rule,
    .gemm_dx = kn_cuda_gemm_dx,
    .gemm_dw = kn_cuda_gemm_dw,
    .rmsnorm_bwd = kn_cuda_rmsnorm_bwd,
    .rope_bwd = kn_cuda_rope_bwd,
    .swiglu_bwd = kn_cuda_swiglu_bwd,
    .dflash_attn_fwd = kn_cuda_dflash_attn_fwd,
    .dflash_attn_bwd = kn_cuda_dflash_attn_bwd,
    .dynconv_fwd     = kn_cuda_dynconv_fwd,
    .dynconv_bwd     = kn_cuda_dynconv_bwd,
    .selector_fwd    = kn_cuda_selector_fwd,
    .selector_bwd    = kn_cuda_selector_bwd,
    .lm_ce = kn_cuda_lm_ce,
    .lm_ce_topk = kn_cuda_lm_ce_topk,
    .sumsq = kn_cuda_sumsq,
    .adamw = kn_cuda_adamw,
    .fill_uniform = kn_cuda_fill_uniform,
    .gemm_rounds_input = kn_cuda_gemm_rounds_input,
    .gemm_bf16in = kn_cuda_gemm_bf16in,
    .add_rmsnorm_bf16 = kn_cuda_add_rmsnorm_bf16,
    .rmsnorm_gated_bf16 = kn_cuda_rmsnorm_gated_bf16,
    .swiglu_bf16 = kn_cuda_swiglu_bf16,
    .gdn_conv_qkv = kn_cuda_gdn_conv_qkv,
    .qk_prep = kn_cuda_qk_prep,
    .cast2d = kn_cuda_cast2d,
    .matmul = kn_cuda_matmul,
    .swiglu_typed = kn_cuda_swiglu_typed,
    .swiglu_bwd_typed = kn_cuda_swiglu_bwd_typed,
    .rmsnorm_bwd_acc = kn_cuda_rmsnorm_bwd_acc,
    .kv_cache_write = kn_cuda_kv_cache_write,
    .attention_cached = kn_cuda_attention_cached,
    .conv1d_silu_cached = kn_cuda_conv1d_silu_cached,
    .gdn_cached = kn_cuda_gdn_cached,
    .sumsq_multi = kn_cuda_sumsq_multi,
    .adamw_multi = kn_cuda_adamw_multi,
};

const kn_backend *kn_backend_cuda(void) {
    return &cuda_backend;
}
