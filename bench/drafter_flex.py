#!/usr/bin/env python3
"""bench/drafter_flex.py - the PyTorch reference step for the drafter benchmark of docs/goals.md.

A PyTorch implementation of docs/drafter.md written from the specification (not from our C code):
Qwen3-style DFlash layers (plain-weight RMSNorm, q/k norm, full-head half-split RoPE, GQA, SwiGLU),
ctx = hidden_norm(F . fc^T), keys/values [ctx rows ; block rows], queries from block rows only,
torch.compile'd flex_attention with a BlockMask built from the section 5 visibility rules
(context: same document and p < a_j, sliding layers also p >= a_j + k - (W - 1); block rows: all
slots of the own block on full layers, slots <= k on sliding ones), then the frozen LM head with a
chunked, checkpointed cross-entropy over the trained slots (weight exp(-(k-1)/gamma)), loss =
sum w.CE / sum w, backward, clip_grad_norm_(1.0) and fused AdamW on fp32 master weights. Matmuls
run under bf16 autocast and attention in bf16, as the seeds' SpecForge-style trainer does.

It trains on the batch layout bench_dt_step wrote (--layout: input_ids, cu_seqlens, loss_mask,
anchors), so both implementations train the same rows; weights and hidden states are random.
Prints one JSON line: step seconds (median, mean), peak allocator memory, the block-mask build
time (once per batch; outside the step here, as a dataloader could build it ahead).
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def rms(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    # x [rows, heads, hd]; NeoX half-split over the full head
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd // 2, device=x.device, dtype=torch.float64) * 2.0 / hd)
    ang = (pos.double()[:, None] * inv[None, :]).float()
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter-config")
    ap.add_argument("--layout")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lm-chunk", type=int, default=2048, help="rows of logits per checkpointed CE chunk")
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--no-compile", action="store_true", help="eager flex_attention (the seeds' OOM)")
    ap.add_argument("--check-fixture", metavar="DIR",
                    help="instead of timing: one fp32 step on a tests/fixtures/drafter case (its drafter weights "
                         "and batch), loss and gradients compared with the float64 oracle's ref.safetensors")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    fx = None
    if a.check_fixture:
        fx = {**load_file(a.check_fixture + "/drafter/model.safetensors"),
              **{"batch." + k: v for k, v in load_file(a.check_fixture + "/batch.safetensors").items()}}
        a.drafter_config = a.check_fixture + "/drafter/config.json"
        a.layout = a.check_fixture + "/batch.safetensors"
    if not a.drafter_config or not a.layout:
        ap.error("--drafter-config and --layout are required (or --check-fixture)")
    cfg = json.load(open(a.drafter_config))
    dev = torch.device(a.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    D, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    V, B, eps, theta = cfg["vocab_size"], cfg["block_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    Wn = cfg.get("sliding_window") or 0
    types = cfg["layer_types"]
    taps = cfg["dflash_config"]["target_layer_ids"]
    mask_id = cfg["dflash_config"]["mask_token_id"]

    lay = {k: v.to(dev) for k, v in load_file(a.layout).items()}
    if fx is not None and "loss_decay_gamma" in cfg:
        a.gamma = cfg["loss_decay_gamma"]
    ids, cu, lmask, anchors = lay["input_ids"].long(), lay["cu_seqlens"].long(), lay["loss_mask"].long(), lay["anchors"].long()
    T, A = ids.numel(), anchors.numel()
    R = A * B

    # ---- host-side layout of section 5 (done on the GPU here)
    doc = torch.searchsorted(cu[1:], torch.arange(T, device=dev), right=True)
    ctx_pos = torch.arange(T, device=dev) - cu[doc]
    doc_a = doc[anchors]
    lo, hi = cu[doc_a], cu[doc_a + 1]
    k = torch.arange(B, device=dev)
    blk_ids = torch.where(k[None, :] == 0, ids[anchors][:, None], torch.full_like(k[None, :], mask_id)).reshape(-1)
    blk_pos = ((anchors - lo)[:, None] + k[None, :]).reshape(-1)
    tgt = anchors[:, None] + k[None, :]
    valid = (k[None, :] >= 1) & (tgt < hi[:, None]) & (lmask[tgt.clamp(max=T - 1)] == 1)
    w = torch.exp(-(k.double() - 1) / a.gamma)[None, :] * valid
    sel = valid.reshape(-1).nonzero().squeeze(1)
    labels = ids[tgt.clamp(max=T - 1)].reshape(-1)[sel]
    wsel = w.reshape(-1)[sel].float()
    wsum = wsel.double().sum().float()

    # ---- block masks (one per distinct window)
    doc_ext = torch.cat([doc, torch.full((R,), -1, device=dev, dtype=doc.dtype)])

    def make_mask(window):
        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // B
            kk = q_idx % B
            aj = anchors[j]
            is_ctx = kv_idx < T
            ctx_ok = is_ctx & (doc_ext[kv_idx] == doc_a[j]) & (kv_idx < aj)
            r = kv_idx - T
            blk_ok = (~is_ctx) & (r // B == j)
            if window > 0:
                ctx_ok = ctx_ok & (kv_idx >= aj + kk - (window - 1))
                blk_ok = blk_ok & (r % B <= kk)
            return ctx_ok | blk_ok

        if dev.type == "cpu":  # flex_attention has no backward on cpu: the same rules as a dense mask
            return mask_mod(None, None, torch.arange(R, device=dev)[:, None], torch.arange(T + R, device=dev)[None, :])
        return create_block_mask(mask_mod, None, None, R, T + R, device=dev)

    sync()
    t0 = time.perf_counter()
    masks = {}
    for t in types:
        win = Wn if t == "sliding_attention" else 0
        if win not in masks:
            masks[win] = make_mask(win)
    sync()
    mask_s = time.perf_counter() - t0

    # ---- parameters: fp32 masters (HF scale: std 0.02), frozen bf16 embedding and LM head
    g = torch.Generator(device=dev).manual_seed(0)

    def lin(o, i):
        return torch.nn.Parameter((torch.rand(o, i, device=dev, generator=g) * 2 - 1) * (0.02 * math.sqrt(3)))

    def ones(n):
        return torch.nn.Parameter(torch.ones(n, device=dev))

    P = {"fc": lin(D, len(taps) * D), "hn": ones(D), "norm": ones(D), "layers": []}
    for _ in range(L):
        P["layers"].append(
            {"in": ones(D), "q": lin(nq * hd, D), "k": lin(nkv * hd, D), "v": lin(nkv * hd, D), "o": lin(D, nq * hd),
             "qn": ones(hd), "kn": ones(hd), "post": ones(D), "gate": lin(I, D), "up": lin(I, D), "down": lin(D, I)})
    params = [P["fc"], P["hn"], P["norm"]] + [p for l in P["layers"] for p in l.values()]
    embed = ((torch.rand(V, D, device=dev, generator=g) * 2 - 1) * 0.02).to(torch.bfloat16)
    lm_head = ((torch.rand(V, D, device=dev, generator=g) * 2 - 1) * 0.02).to(torch.bfloat16)
    Fh = (torch.rand(T, len(taps) * D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
    if fx is not None:  # the fixture's weights, all fp32
        def put(p, key):
            p.data = fx[key].float().to(dev).reshape(p.shape).clone()
        put(P["fc"], "fc.weight"), put(P["hn"], "hidden_norm.weight"), put(P["norm"], "norm.weight")
        names = {"in": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "qn": "self_attn.q_norm", "kn": "self_attn.k_norm",
                 "post": "post_attention_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
        for l, Lp in enumerate(P["layers"]):
            for k_, n_ in names.items():
                put(Lp[k_], f"layers.{l}.{n_}.weight")
        embed = fx["batch.embed_tokens"].float().to(dev)
        lm_head = fx["batch.lm_head"].float().to(dev)
        Fh = fx["batch.target_hidden"].float().to(dev)
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=dev.type == "cuda")
    flex = flex_attention if a.no_compile or fx is not None else torch.compile(flex_attention, dynamic=False)
    wdt = torch.float32 if fx is not None else torch.bfloat16  # attention and LM-head operand dtype
    print(f"reference: {sum(p.numel() for p in params)/1e9:.3f}B trainable parameters, T={T}, anchors={A}, "
          f"rows={R}, trained slots={sel.numel()}, mask build {mask_s:.3f} s", flush=True)

    def ce_chunk(h, lab, wc):
        logits = (h.to(wdt) @ lm_head.t()).float()
        return (F.cross_entropy(logits, lab, reduction="none") * wc).sum()

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=fx is None):
            ctx = rms(Fh @ P["fc"].t(), P["hn"], eps)
            x = embed[blk_ids].float()
            for l, Lp in enumerate(P["layers"]):
                win = Wn if types[l] == "sliding_attention" else 0
                h = rms(x, Lp["in"], eps)
                q = rope(rms((h @ Lp["q"].t()).view(R, nq, hd), Lp["qn"], eps), blk_pos, theta)
                kc = rope(rms((ctx @ Lp["k"].t()).view(T, nkv, hd), Lp["kn"], eps), ctx_pos, theta)
                vc = (ctx @ Lp["v"].t()).view(T, nkv, hd)
                kb = rope(rms((h @ Lp["k"].t()).view(R, nkv, hd), Lp["kn"], eps), blk_pos, theta)
                vb = (h @ Lp["v"].t()).view(R, nkv, hd)
                Kt = torch.cat([kc, kb]).to(wdt).transpose(0, 1)[None]
                Vt = torch.cat([vc, vb]).to(wdt).transpose(0, 1)[None]
                Qt = q.to(wdt).transpose(0, 1)[None]
                if dev.type == "cpu":
                    o = F.scaled_dot_product_attention(Qt, Kt.repeat_interleave(nq // nkv, 1),
                                                       Vt.repeat_interleave(nq // nkv, 1), attn_mask=masks[win],
                                                       scale=hd ** -0.5)
                else:
                    o = flex(Qt, Kt, Vt, block_mask=masks[win], scale=hd ** -0.5, enable_gqa=True)
                o = o[0].transpose(0, 1).reshape(R, nq * hd)
                x = x + o @ Lp["o"].t()
                h2 = rms(x, Lp["post"], eps)
                x = x + (F.silu(h2 @ Lp["gate"].t()) * (h2 @ Lp["up"].t())) @ Lp["down"].t()
            hf = rms(x, P["norm"], eps)[sel]
            total = 0
            for i in range(0, sel.numel(), a.lm_chunk):
                total = total + checkpoint.checkpoint(ce_chunk, hf[i:i + a.lm_chunk], labels[i:i + a.lm_chunk],
                                                      wsel[i:i + a.lm_chunk], use_reentrant=False)
            loss = total / wsum
        loss.backward()
        if fx is not None:
            return loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if fx is not None:
        ref = load_file(a.check_fixture + "/ref.safetensors")
        loss = float(step())
        got = {"fc.weight": P["fc"], "norm.weight": P["norm"], "hidden_norm.weight": P["hn"],
               "layers.0.self_attn.q_proj.weight": P["layers"][0]["q"],
               "layers.0.self_attn.k_proj.weight": P["layers"][0]["k"],
               f"layers.{L - 1}.mlp.down_proj.weight": P["layers"][L - 1]["down"]}
        worst = 0.0
        for name, p in got.items():
            r = ref["grad." + name].double().reshape(p.shape).to(p.device)
            e = ((p.grad.double() - r).norm() / r.norm().clamp(min=1e-30)).item()
            worst = max(worst, e)
            print(f"  grad.{name}: relative L2 error {e:.2e}")
        rl = float(ref["loss"].double().item())
        print(json.dumps({"check": a.check_fixture, "loss": loss, "oracle_loss": rl,
                          "loss_rel_err": abs(loss - rl) / abs(rl), "grad_rel_l2_worst": worst}))
        ok = abs(loss - rl) <= 1e-4 * abs(rl) and worst <= 1e-3
        raise SystemExit(0 if ok else 1)

    secs, losses = [], []
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= a.warmup:
            secs.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"reference step {i + 1}: {time.perf_counter() - t0:.4f} s loss {losses[-1]:.5f}", flush=True)
    out = {"impl": "pytorch-flex", "compiled": not a.no_compile, "steps": a.steps,
           "step_s_median": statistics.median(secs), "step_s_mean": statistics.fmean(secs),
           "step_s_min": min(secs), "step_s_max": max(secs),
           "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
           "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "mask_build_s": mask_s,
           "loss_first": losses[0], "loss_last": losses[-1], "torch": torch.__version__}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
