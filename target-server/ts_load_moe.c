/* target-server/ts_load_moe.c — the parts of a Qwen3.5-MoE or Qwen3-Next checkpoint that a
 * dense Qwen3.5 does not have (docs/moe.md):
 *
 * - a sparse MoE block per layer: the router mlp.gate.weight [E, D]; the experts, stored either
 *   fused as Transformers saves Qwen3.5-MoE (mlp.experts.gate_up_proj [E, 2·Ie, D], gate rows
 *   first, and mlp.experts.down_proj [E, D, Ie], no .weight suffix) or per expert as the FP8
 *   releases and Qwen3-Next store them (mlp.experts.{e}.{gate,up,down}_proj.weight); the shared
 *   expert mlp.shared_expert.{gate,up,down}_proj.weight and its gate
 *   mlp.shared_expert_gate.weight [1, D]. Each expert becomes its own gate, up and down matrix
 *   whatever the layout, so the FP8 rules of the dense projections apply to them unchanged;
 * - Qwen3-Next's fused GDN input projections, un-interleaved here once so that the forward is
 *   Qwen3.5's: in_proj_qkvz holds, for each of the nk key-head groups g in turn, the rows
 *   [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)] with r = nv / nk, and in_proj_ba the rows
 *   [b_g (r) | a_g (r)]. Qwen3.5's in_proj_qkv is [q (nk·dk) | k (nk·dk) | v (nv·dv)], in_proj_z
 *   [z (nv·dv)], in_proj_b and in_proj_a [nv]: the groups' pieces in group order. */
#include "ts_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ts_moe_free(ts_model *m, ts_layer *L) {
    const int E = m->cfg.n_experts;
    ts_mat   *stacks[3] = {L->ex_gate, L->ex_up, L->ex_down};
    for (int k = 0; k < 3; k++) {
        for (int e = 0; stacks[k] && e < E; e++) ts_mat_free(m, &stacks[k][e]);
        free(stacks[k]);
    }
    L->ex_gate = L->ex_up = L->ex_down = NULL;
    m->be->free(m->ctx, L->ex_ptrs);
    L->ex_ptrs = NULL;
    ts_mat *w[] = {&L->router, &L->sh_gate, &L->sh_up, &L->sh_down, &L->sh_router};
    for (size_t j = 0; j < sizeof w / sizeof w[0]; j++) ts_mat_free(m, w[j]);
}

/* A stored tensor read whole to the host in BF16 (stored so, or bf16_weights) or F32; shape
 * checked. FP8 is refused: Qwen's FP8 releases store these per expert / unfused. */
static cm_status read_host(ts_loader *ld, const char *full, int n_dims, const int64_t *shape, void **host,
                           cm_dtype *dt) {
    const cm_st_tensor *t;
    CM_TRY(cm_st_expect(ld->st, full, n_dims, shape, &t));
    if (t->dtype == CM_DTYPE_F8_E4M3)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "tensor '%s' in '%s' is F8_E4M3: Tandem reads FP8 experts per expert and "
                       "Qwen3-Next's in_proj_ba in bf16, as Qwen's FP8 releases store them; use the bf16 checkpoint",
                       full, t->file);
    *dt = ts_load_dtype(ld, t->dtype);
    size_t n = 1;
    for (int i = 0; i < n_dims; i++) n *= (size_t)shape[i];
    *host = malloc(n * cm_dtype_size(*dt) + 1);
    if (!*host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu values for '%s'", n, full);
    cm_status st = cm_st_read(ld->st, full, n_dims, shape, *host, *dt);
    if (st != CM_OK) {
        free(*host);
        *host = NULL;
    }
    return st;
}

/* Experts from the fused 3-D tensors (full names gu and dn). */
static cm_status experts_fused(ts_loader *ld, const char *gu, const char *dn, ts_layer *L) {
    const cm_target_cfg *c = &ld->m->cfg;
    const int64_t        E = c->n_experts, Ie = c->moe_intermediate_size, D = c->hidden_size;
    const int64_t        gu_shape[3] = {E, 2 * Ie, D}, dn_shape[3] = {E, D, Ie};
    void                *host = NULL;
    cm_dtype             dt;
    char                 nm[360];
    CM_TRY(read_host(ld, gu, 3, gu_shape, &host, &dt));
    const size_t el = cm_dtype_size(dt);
    cm_status    st = CM_OK;
    for (int64_t e = 0; e < E && st == CM_OK; e++) {
        const char *base = (const char *)host + (size_t)(e * 2 * Ie * D) * el;
        snprintf(nm, sizeof nm, "%.300s[%lld].gate", gu, (long long)e);
        st = ts_load_mat_host(ld, nm, base, dt, TS_MAT_ROLE_QUANT, Ie, D, &L->ex_gate[e]);
        snprintf(nm, sizeof nm, "%.300s[%lld].up", gu, (long long)e);
        if (st == CM_OK)
            st = ts_load_mat_host(ld, nm, base + (size_t)(Ie * D) * el, dt, TS_MAT_ROLE_QUANT, Ie, D, &L->ex_up[e]);
    }
    free(host);
    CM_TRY(st);
    CM_TRY(read_host(ld, dn, 3, dn_shape, &host, &dt));
    for (int64_t e = 0; e < E && st == CM_OK; e++) {
        snprintf(nm, sizeof nm, "%.300s[%lld]", dn, (long long)e);
        st = ts_load_mat_host(ld, nm, (const char *)host + (size_t)(e * D * Ie) * el, dt, TS_MAT_ROLE_QUANT, D, Ie,
                              &L->ex_down[e]);
    }
    free(host);
    return st;
}

/* The experts' matrices as the grouped GEMMs read them (ts_layer.ex_ptrs), when every one is BF16
 * (moe_gemm) or every one is FP8 (moe_gemm_fp8: the 3E scale tables follow the 3E matrices) and the
 * backend has the entry; otherwise nothing (the forward runs one GEMM per expert). */
static cm_status expert_table(ts_model *m, int i, ts_layer *L) {
    const int      E  = m->cfg.n_experts;
    const cm_dtype dt = L->ex_gate[0].dtype;
    const int      fp8 = dt == CM_DTYPE_F8_E4M3;
    if (fp8 ? !m->be->moe_gemm_fp8 : dt != CM_DTYPE_BF16 || !m->be->moe_gemm) return CM_OK;
    for (int e = 0; e < E; e++)
        if (L->ex_gate[e].dtype != dt || L->ex_up[e].dtype != dt || L->ex_down[e].dtype != dt) return CM_OK;
    const size_t bytes = (size_t)((fp8 ? 6 : 3) * E) * sizeof(void *);
    void       **host  = malloc(bytes);
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate layer %d's table of %d experts", i, E);
    for (int e = 0; e < E; e++) {
        const ts_mat *w[3] = {&L->ex_gate[e], &L->ex_up[e], &L->ex_down[e]};
        for (int j = 0; j < 3; j++) {
            host[j * E + e] = w[j]->data;
            if (fp8) host[(3 + j) * E + e] = w[j]->scale;
        }
    }
    cm_status st = m->be->alloc(m->ctx, (void **)&L->ex_ptrs, bytes);
    if (st == CM_OK) st = m->be->upload(m->ctx, L->ex_ptrs, host, bytes);
    L->ex_fp8 = fp8;
    free(host);
    return st;
}

cm_status ts_load_moe(ts_loader *ld, int i, ts_layer *L) {
    const cm_target_cfg *c = &ld->m->cfg;
    const int64_t        E = c->n_experts, Ie = c->moe_intermediate_size, Is = c->shared_expert_intermediate_size;
    const int64_t        D = c->hidden_size;
    char                 nm[160], gu[300], dn[300], e0[300];
    L->moe = 1;
    snprintf(nm, sizeof nm, "layers.%d.mlp.gate.weight", i);
    snprintf(gu, sizeof gu, "%s%s", ld->prefix, nm);
    const cm_st_tensor *r = ld->random ? NULL : cm_st_find(ld->st, gu);
    if (r && r->n_dims == 2 && r->shape[1] == D && r->shape[0] != E) /* the likeliest mistake, named as such */
        return CM_FAIL(CM_ERR_FORMAT, "the router '%s' in '%s' has %lld experts, but config.json's num_experts is %lld; "
                       "the checkpoint and its config disagree", gu, r->file, (long long)r->shape[0], (long long)E);
    CM_TRY(ts_load_mat(ld, nm, 0, TS_MAT_ROLE_GEMM, E, D, &L->router));
    L->ex_gate = calloc((size_t)E, sizeof *L->ex_gate);
    L->ex_up   = calloc((size_t)E, sizeof *L->ex_up);
    L->ex_down = calloc((size_t)E, sizeof *L->ex_down);
    if (!L->ex_gate || !L->ex_up || !L->ex_down)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate layer %d's %lld experts", i, (long long)E);
    snprintf(gu, sizeof gu, "%slayers.%d.mlp.experts.gate_up_proj", ld->prefix, i);
    snprintf(dn, sizeof dn, "%slayers.%d.mlp.experts.down_proj", ld->prefix, i);
    snprintf(e0, sizeof e0, "%slayers.%d.mlp.experts.0.gate_proj.weight", ld->prefix, i);
    if (!ld->random && cm_st_find(ld->st, gu)) {
        CM_TRY(experts_fused(ld, gu, dn, L));
    } else if (!ld->random && !cm_st_find(ld->st, e0)) {
        return CM_FAIL(CM_ERR_FORMAT, "layer %d has no experts in '%s': neither '%s' (the fused layout) nor '%s' (one "
                       "tensor per expert); is this checkpoint of the model its config.json names (model_type '%s')?",
                       i, ld->dir, gu, e0, c->model_type);
    } else {
        for (int64_t e = 0; e < E; e++) {
            static const char *const what[3] = {"gate_proj", "up_proj", "down_proj"};
            ts_mat *out[3] = {&L->ex_gate[e], &L->ex_up[e], &L->ex_down[e]};
            for (int k = 0; k < 3; k++) {
                snprintf(nm, sizeof nm, "layers.%d.mlp.experts.%lld.%s.weight", i, (long long)e, what[k]);
                CM_TRY(ts_load_mat(ld, nm, 0, TS_MAT_ROLE_QUANT, k < 2 ? Ie : D, k < 2 ? D : Ie, out[k]));
            }
        }
        snprintf(e0, sizeof e0, "%slayers.%d.mlp.experts.%lld.gate_proj.weight", ld->prefix, i, (long long)E);
        if (!ld->random && cm_st_find(ld->st, e0))
            return CM_FAIL(CM_ERR_FORMAT, "'%s' holds '%s', an expert beyond the num_experts %lld of its config.json; "
                           "the checkpoint and its config disagree", ld->dir, e0, (long long)E);
    }
    CM_TRY(expert_table(ld->m, i, L));
    if (Is == 0) return CM_OK;
    snprintf(nm, sizeof nm, "layers.%d.mlp.shared_expert.gate_proj.weight", i);
    CM_TRY(ts_load_mat(ld, nm, 0, TS_MAT_ROLE_QUANT, Is, D, &L->sh_gate));
    snprintf(nm, sizeof nm, "layers.%d.mlp.shared_expert.up_proj.weight", i);
    CM_TRY(ts_load_mat(ld, nm, 0, TS_MAT_ROLE_QUANT, Is, D, &L->sh_up));
    snprintf(nm, sizeof nm, "layers.%d.mlp.shared_expert.down_proj.weight", i);
    CM_TRY(ts_load_mat(ld, nm, 0, TS_MAT_ROLE_QUANT, D, Is, &L->sh_down));
    snprintf(nm, sizeof nm, "layers.%d.mlp.shared_expert_gate.weight", i);
    return ts_load_mat(ld, nm, 0, TS_MAT_ROLE_GEMM, 1, D, &L->sh_router);
}

/* Copies rows [from, from + n) of src to row to of dst (both [.., D] in el-byte values). */
static void rows(void *dst, int64_t to, const void *src, int64_t from, int64_t n, int64_t D, size_t el) {
    memcpy((char *)dst + (size_t)(to * D) * el, (const char *)src + (size_t)(from * D) * el, (size_t)(n * D) * el);
}

/* in_proj_qkvz (full name qkvz) stored FP8: the rows of q, k, v (into in_qkv) and z (into in_z)
 * picked out of each key-head group, moved whole with their 128-row block scales. */
static cm_status qkvz_fp8(ts_loader *ld, const char *qkvz, const cm_st_tensor *t, const cm_st_tensor *s, ts_layer *L) {
    const cm_target_cfg *c  = &ld->m->cfg;
    const int64_t        nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t        D = c->hidden_size, r = nv / nk, grp = 2 * dk + 2 * r * dv, conv_dim = 2 * nk * dk + nv * dv;
    int64_t             *map = malloc((size_t)(nk * grp) * sizeof *map);
    if (!map) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the row map of '%s'", qkvz);
    for (int64_t g = 0; g < nk; g++) {
        const int64_t b0 = g * grp;
        for (int64_t j = 0; j < dk; j++) {
            map[g * dk + j]           = b0 + j;      /* q_g */
            map[nk * dk + g * dk + j] = b0 + dk + j; /* k_g */
        }
        for (int64_t j = 0; j < r * dv; j++) {
            map[2 * nk * dk + g * r * dv + j] = b0 + 2 * dk + j;          /* v_g */
            map[conv_dim + g * r * dv + j]    = b0 + 2 * dk + r * dv + j; /* z_g */
        }
    }
    const int64_t   pieces[2] = {conv_dim, nv * dv};
    ts_mat *const   outs[2]   = {&L->in_qkv, &L->in_z};
    const cm_status st        = ts_fp8_load_rows(ld, qkvz, t, s, nk * grp, D, map, 2, pieces, outs);
    free(map);
    return st;
}

/* in_proj_qkvz (full name qkvz) in bf16 or f32: read, un-interleaved on the host, loaded. */
static cm_status qkvz_float(ts_loader *ld, const char *qkvz, ts_layer *L) {
    const cm_target_cfg *c  = &ld->m->cfg;
    const int64_t        nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t        D = c->hidden_size, r = nv / nk, grp = 2 * dk + 2 * r * dv, conv_dim = 2 * nk * dk + nv * dv;
    const int64_t        shape[2] = {nk * grp, D};
    void                *src = NULL, *qkv = NULL, *z = NULL;
    cm_dtype             dt;
    CM_TRY(read_host(ld, qkvz, 2, shape, &src, &dt));
    const size_t el = cm_dtype_size(dt);
    qkv             = malloc((size_t)(conv_dim * D) * el);
    z               = malloc((size_t)(nv * dv * D) * el);
    cm_status st    = CM_OK;
    if (!qkv || !z) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the un-interleaved '%s'", qkvz);
    for (int64_t g = 0; g < nk && st == CM_OK; g++) {
        const int64_t b0 = g * grp;
        rows(qkv, g * dk, src, b0, dk, D, el);                                /* q_g */
        rows(qkv, nk * dk + g * dk, src, b0 + dk, dk, D, el);                 /* k_g */
        rows(qkv, 2 * nk * dk + g * r * dv, src, b0 + 2 * dk, r * dv, D, el); /* v_g */
        rows(z, g * r * dv, src, b0 + 2 * dk + r * dv, r * dv, D, el);        /* z_g */
    }
    if (st == CM_OK) st = ts_load_mat_host(ld, qkvz, qkv, dt, TS_MAT_ROLE_QUANT, conv_dim, D, &L->in_qkv);
    if (st == CM_OK) st = ts_load_mat_host(ld, qkvz, z, dt, TS_MAT_ROLE_QUANT, nv * dv, D, &L->in_z);
    free(src);
    free(qkv);
    free(z);
    return st;
}

cm_status ts_load_next_gdn(ts_loader *ld, int i, ts_layer *L) {
    const cm_target_cfg *c  = &ld->m->cfg;
    const int64_t        nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t        D = c->hidden_size, r = nv / nk, grp = 2 * dk + 2 * r * dv;
    const int64_t        conv_dim = 2 * nk * dk + nv * dv;
    char                 qkvz[300], ba[300], scale[320];
    snprintf(qkvz, sizeof qkvz, "%slayers.%d.linear_attn.in_proj_qkvz.weight", ld->prefix, i);
    snprintf(ba, sizeof ba, "%slayers.%d.linear_attn.in_proj_ba.weight", ld->prefix, i);
    if (ld->random) { /* the un-interleaved matrices drawn directly, named after their source */
        char nm[320];
        snprintf(nm, sizeof nm, "%s:qkv", qkvz);
        CM_TRY(ts_load_mat(ld, nm, 1, TS_MAT_ROLE_QUANT, conv_dim, D, &L->in_qkv));
        snprintf(nm, sizeof nm, "%s:z", qkvz);
        CM_TRY(ts_load_mat(ld, nm, 1, TS_MAT_ROLE_QUANT, nv * dv, D, &L->in_z));
        snprintf(nm, sizeof nm, "%s:b", ba);
        CM_TRY(ts_load_mat(ld, nm, 1, TS_MAT_ROLE_GEMM, nv, D, &L->in_b));
        snprintf(nm, sizeof nm, "%s:a", ba);
        return ts_load_mat(ld, nm, 1, TS_MAT_ROLE_GEMM, nv, D, &L->in_a);
    }
    const int64_t qkvz_shape[2] = {nk * grp, D}, ba_shape[2] = {2 * nv, D};
    snprintf(scale, sizeof scale, "%s_scale_inv", qkvz);
    const cm_st_tensor *tq = cm_st_find(ld->st, qkvz), *sq = cm_st_find(ld->st, scale);
    if (tq && (tq->dtype == CM_DTYPE_F8_E4M3 || sq)) {
        CM_TRY(cm_st_expect(ld->st, qkvz, 2, qkvz_shape, &tq));
        CM_TRY(qkvz_fp8(ld, qkvz, tq, sq, L));
    } else {
        CM_TRY(qkvz_float(ld, qkvz, L));
    }
    void     *src = NULL;
    cm_dtype  dt;
    cm_status st = CM_OK;
    CM_TRY(read_host(ld, ba, 2, ba_shape, &src, &dt));
    const size_t elb = cm_dtype_size(dt);
    void        *b = malloc((size_t)(nv * D) * elb + 1), *a = malloc((size_t)(nv * D) * elb + 1);
    if (!a || !b) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the un-interleaved '%s'", ba);
    for (int64_t g = 0; g < nk && st == CM_OK; g++) {
        rows(b, g * r, src, g * 2 * r, r, D, elb);
        rows(a, g * r, src, g * 2 * r + r, r, D, elb);
    }
    if (st == CM_OK) st = ts_load_mat_host(ld, ba, b, dt, TS_MAT_ROLE_GEMM, nv, D, &L->in_b);
    if (st == CM_OK) st = ts_load_mat_host(ld, ba, a, dt, TS_MAT_ROLE_GEMM, nv, D, &L->in_a);
    free(src);
    free(a);
    free(b);
    return st;
}
