#!/usr/bin/env python3
"""bench/drafter_flex.py - the PyTorch reference step for the drafter benchmark of docs/goals.md.

A PyTorch implementation of docs/drafter.md written from the specification (not from our C code):
Qwen3-style DFlash layers (plain-weight RMSNorm, q/k norm, full-head half-split RoPE, GQA, SwiGLU),
ctx = hidden_norm(F . fc^T), keys/values [ctx rows ; block rows], queries from block rows only,
torch.compile'd flex_attention with a BlockMask built from docs/drafter.md's visibility rules (context:
same document and p < a_j, sliding layers also p >= a_j + k - (W - 1); block rows: the own block's
slots, only slots <= k on a causal layer, and on a sliding layer only slots s with |k - s| < W: the
window bounds every key; which layers are causal: the top-level is_causal where the config gives it,
else the sliding ones), then the frozen LM head with a chunked, checkpointed cross-entropy over the
trained slots (weight exp(-(k-1)/gamma)), loss = sum w.CE / sum w, backward, clip_grad_norm_(1.0) and
fused AdamW on fp32 master weights. Matmuls run under bf16 autocast and attention in bf16, as the
seeds' SpecForge-style trainer does.

It trains on the batch layout bench_dt_step wrote (--layout: input_ids, cu_seqlens, loss_mask,
anchors), so both implementations train the same rows; weights and hidden states are random.
Prints one JSON line: step seconds (median, mean), peak allocator memory, the block-mask build
time (once per batch; outside the step here, as a dataloader could build it ahead).

The pieces (config, batch layout, masks, parameters, the attention and MLP sublayers, the chunked
CE, the timing loop) are module-level functions so bench/drafter2_flex.py (DFlash2) imports them.
"""
import argparse
import json
import math
import os
import resource
import statistics
import time
from types import SimpleNamespace

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


# ---- the config

def read_config(path):
    """The drafter config.json as a namespace: the Qwen3 shape, block size (top level or dflash_config),
    taps, mask id, and per layer its window (0 = full) and causality (docs/drafter.md: the top-level
    is_causal where given, for every layer, else sliding layers causal and full ones not)."""
    raw = json.load(open(path))
    dc = raw.get("dflash_config") or {}
    B = raw.get("block_size", dc.get("block_size"))
    if B is None or dc.get("block_size", B) != B:
        raise SystemExit(f"{path}: block_size missing, or top level and dflash_config disagree")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    Wn = raw.get("sliding_window") or 0
    causal = raw.get("is_causal")
    return SimpleNamespace(
        raw=raw, D=raw["hidden_size"], L=raw["num_hidden_layers"], I=raw["intermediate_size"],
        nq=raw["num_attention_heads"], nkv=raw["num_key_value_heads"],
        hd=raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
        V=raw["vocab_size"], B=B, eps=raw["rms_norm_eps"], theta=theta, types=types, Wn=Wn,
        taps=dc["target_layer_ids"], mask_id=dc.get("mask_token_id", raw.get("mask_token_id")),
        window=[Wn if t == "sliding_attention" else 0 for t in types],
        causal=[bool(causal) if causal is not None else t == "sliding_attention" for t in types])


# ---- the batch layout (docs/drafter.md: blocks, positions, labels, weights; host-side, done on the device)

def build_batch(lay, cfg, gamma, dev):
    B = cfg.B
    ids, cu, lmask, anchors = (lay["input_ids"].long(), lay["cu_seqlens"].long(), lay["loss_mask"].long(),
                               lay["anchors"].long())
    T, A = ids.numel(), anchors.numel()
    R = A * B
    doc = torch.searchsorted(cu[1:], torch.arange(T, device=dev), right=True)
    ctx_pos = torch.arange(T, device=dev) - cu[doc]
    doc_a = doc[anchors]
    lo, hi = cu[doc_a], cu[doc_a + 1]
    k = torch.arange(B, device=dev)
    blk_ids = torch.where(k[None, :] == 0, ids[anchors][:, None],
                          torch.full_like(k[None, :], cfg.mask_id)).reshape(-1)
    blk_pos = ((anchors - lo)[:, None] + k[None, :]).reshape(-1)
    tgt = anchors[:, None] + k[None, :]
    valid = (k[None, :] >= 1) & (tgt < hi[:, None]) & (lmask[tgt.clamp(max=T - 1)] == 1)
    w = torch.exp(-(k.double() - 1) / gamma)[None, :] * valid
    sel = valid.reshape(-1).nonzero().squeeze(1)
    tgt_sel = tgt.clamp(max=T - 1).reshape(-1)[sel]  # packed index of each trained slot's label
    labels = ids[tgt_sel]
    wsel = w.reshape(-1)[sel].float()
    wsum = wsel.double().sum().float()
    return SimpleNamespace(ids=ids, cu=cu, anchors=anchors, T=T, A=A, R=R, doc=doc, ctx_pos=ctx_pos, doc_a=doc_a,
                           blk_ids=blk_ids, blk_pos=blk_pos, sel=sel, tgt_sel=tgt_sel, labels=labels, wsel=wsel,
                           wsum=wsum)


def make_mask(bt, B, window, causal, dev):
    """docs/drafter.md's visibility for one (window, causal) pair: a BlockMask for flex_attention on cuda,
    the same rules as a dense [R, T + R] bool mask on cpu (flex_attention has no backward there)."""
    T, R, anchors, doc_a = bt.T, bt.R, bt.anchors, bt.doc_a
    doc_ext = torch.cat([bt.doc, torch.full((R,), -1, device=dev, dtype=bt.doc.dtype)])

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // B
        kk = q_idx % B
        aj = anchors[j]
        is_ctx = kv_idx < T
        ctx_ok = is_ctx & (doc_ext[kv_idx] == doc_a[j]) & (kv_idx < aj)
        r = kv_idx - T
        s = r % B
        blk_ok = (~is_ctx) & (r // B == j)
        if causal:
            blk_ok = blk_ok & (s <= kk)
        if window > 0:  # the window bounds every key: context rows and the block's own slots
            ctx_ok = ctx_ok & (kv_idx >= aj + kk - (window - 1))
            blk_ok = blk_ok & (s - kk < window) & (kk - s < window)
        return ctx_ok | blk_ok

    if dev.type == "cpu":
        return mask_mod(None, None, torch.arange(R, device=dev)[:, None], torch.arange(T + R, device=dev)[None, :])
    return create_block_mask(mask_mod, None, None, R, T + R, device=dev)


def build_masks(cfg, bt, dev):
    """One mask per distinct (window, causal) of the layers; returns the dict and its build seconds."""
    sync(dev)
    t0 = time.perf_counter()
    masks = {}
    for l in range(cfg.L):
        key = (cfg.window[l], cfg.causal[l])
        if key not in masks:
            masks[key] = make_mask(bt, cfg.B, key[0], key[1], dev)
    sync(dev)
    return masks, time.perf_counter() - t0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ---- parameters: fp32 masters (HF scale: std 0.02), frozen bf16 embedding and LM head, bf16 taps

def init_params(cfg, T, dev, g):
    def lin(o, i):
        return torch.nn.Parameter((torch.rand(o, i, device=dev, generator=g) * 2 - 1) * (0.02 * math.sqrt(3)))

    def ones(n):
        return torch.nn.Parameter(torch.ones(n, device=dev))

    D, I, nq, nkv, hd, V = cfg.D, cfg.I, cfg.nq, cfg.nkv, cfg.hd, cfg.V
    P = {"fc": lin(D, len(cfg.taps) * D), "hn": ones(D), "norm": ones(D), "layers": []}
    for _ in range(cfg.L):
        P["layers"].append(
            {"in": ones(D), "q": lin(nq * hd, D), "k": lin(nkv * hd, D), "v": lin(nkv * hd, D), "o": lin(D, nq * hd),
             "qn": ones(hd), "kn": ones(hd), "post": ones(D), "gate": lin(I, D), "up": lin(I, D), "down": lin(D, I)})
    embed = ((torch.rand(V, D, device=dev, generator=g) * 2 - 1) * 0.02).to(torch.bfloat16)
    lm_head = ((torch.rand(V, D, device=dev, generator=g) * 2 - 1) * 0.02).to(torch.bfloat16)
    Fh = (torch.rand(T, len(cfg.taps) * D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
    return P, embed, lm_head, Fh


def param_list(P):
    return [P["fc"], P["hn"], P["norm"]] + [p for l in P["layers"] for p in l.values()]


LAYER_NAMES = {"in": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "qn": "self_attn.q_norm", "kn": "self_attn.k_norm",
               "post": "post_attention_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
               "down": "mlp.down_proj"}


# ---- the model (M: config, batch, masks, frozen tensors, attention function, operand dtype)

def make_model(cfg, bt, masks, embed, lm_head, Fh, dev, wdt, flex):
    return SimpleNamespace(cfg=cfg, bt=bt, masks=masks, embed=embed, lm_head=lm_head, Fh=Fh, dev=dev, wdt=wdt,
                           flex=flex)


def ctx_features(M, P):
    return rms(M.Fh @ P["fc"].t(), P["hn"], M.cfg.eps)


def attn_sublayer(M, Lp, l, h, ctx):
    """o_proj(block_attention(q, k, v)) for block rows h [R, D] (the layer's normed input) and ctx [T, D]."""
    c, bt = M.cfg, M.bt
    R, T, nq, nkv, hd = bt.R, bt.T, c.nq, c.nkv, c.hd
    q = rope(rms((h @ Lp["q"].t()).view(R, nq, hd), Lp["qn"], c.eps), bt.blk_pos, c.theta)
    kc = rope(rms((ctx @ Lp["k"].t()).view(T, nkv, hd), Lp["kn"], c.eps), bt.ctx_pos, c.theta)
    vc = (ctx @ Lp["v"].t()).view(T, nkv, hd)
    kb = rope(rms((h @ Lp["k"].t()).view(R, nkv, hd), Lp["kn"], c.eps), bt.blk_pos, c.theta)
    vb = (h @ Lp["v"].t()).view(R, nkv, hd)
    Kt = torch.cat([kc, kb]).to(M.wdt).transpose(0, 1)[None]
    Vt = torch.cat([vc, vb]).to(M.wdt).transpose(0, 1)[None]
    Qt = q.to(M.wdt).transpose(0, 1)[None]
    mask = M.masks[(c.window[l], c.causal[l])]
    if M.dev.type == "cpu":
        o = F.scaled_dot_product_attention(Qt, Kt.repeat_interleave(nq // nkv, 1), Vt.repeat_interleave(nq // nkv, 1),
                                           attn_mask=mask, scale=hd ** -0.5)
    else:
        o = M.flex(Qt, Kt, Vt, block_mask=mask, scale=hd ** -0.5, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(R, nq * hd) @ Lp["o"].t()


def mlp_sublayer(Lp, h2):
    return (F.silu(h2 @ Lp["gate"].t()) * (h2 @ Lp["up"].t())) @ Lp["down"].t()


def dflash_hidden(M, P):
    """The DFlash stack: the final-normed hidden of every block row [R, D]."""
    c = M.cfg
    ctx = ctx_features(M, P)
    x = M.embed[M.bt.blk_ids].float()
    for l, Lp in enumerate(P["layers"]):
        x = x + attn_sublayer(M, Lp, l, rms(x, Lp["in"], c.eps), ctx)
        x = x + mlp_sublayer(Lp, rms(x, Lp["post"], c.eps))
    return rms(x, P["norm"], c.eps)


def unary_loss_sum(M, hf, chunk):
    """sum over trained slots of w.CE(lm_head(h), label): chunked, each chunk checkpointed, so the
    [rows, V] logits exist for one chunk at a time."""
    bt = M.bt

    def ce_chunk(h, lab, wc):
        logits = (h.to(M.wdt) @ M.lm_head.t()).float()
        return (F.cross_entropy(logits, lab, reduction="none") * wc).sum()

    total = 0
    for i in range(0, bt.sel.numel(), chunk):
        total = total + checkpoint.checkpoint(ce_chunk, hf[i:i + chunk], bt.labels[i:i + chunk],
                                              bt.wsel[i:i + chunk], use_reentrant=False)
    return total


def dflash_loss(M, P, chunk):
    return unary_loss_sum(M, dflash_hidden(M, P)[M.bt.sel], chunk) / M.bt.wsum


def train_step(M, params, opt, loss_fn, autocast=True, clip=1.0):
    """loss_fn() under bf16 autocast, backward, clip_grad_norm_(clip), AdamW; opt None: gradients only."""
    with torch.autocast(M.dev.type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn()
    loss.backward()
    if opt is None:
        return loss.detach()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(params, dev, lr=6e-4):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=dev.type == "cuda")


def timed_steps(step, dev, steps, warmup, label="reference"):
    """warmup + steps calls of step(); returns the timing part of the JSON line and the losses."""
    secs, losses = [], []
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        loss = step()
        sync(dev)
        if i >= warmup:
            secs.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"{label} step {i + 1}: {time.perf_counter() - t0:.4f} s loss {losses[-1]:.5f}", flush=True)
    out = {"steps": steps, "step_s_median": statistics.median(secs), "step_s_mean": statistics.fmean(secs),
           "step_s_min": min(secs), "step_s_max": max(secs)}
    if dev.type == "cuda":
        out.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    else:  # the process's peak resident set (Linux: KiB)
        out.update(peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    out.update(loss_first=losses[0], loss_last=losses[-1], torch=torch.__version__)
    return out, losses


def fixture_gamma(fixture_dir, cfg_raw):
    """A fixture's gamma: its manifest.json entry (the oracle's), else the config's loss_decay_gamma,
    else docs/drafter.md's default for the block size."""
    try:
        man = json.load(open(os.path.join(os.path.dirname(os.path.abspath(fixture_dir)), "manifest.json")))
        for f in man["fixtures"]:
            if f["name"] == os.path.basename(os.path.abspath(fixture_dir)):
                return float(f["gamma"])
    except (OSError, KeyError, ValueError):
        pass
    if "loss_decay_gamma" in cfg_raw:
        return float(cfg_raw["loss_decay_gamma"])
    B = cfg_raw.get("block_size", (cfg_raw.get("dflash_config") or {}).get("block_size"))
    return 7.0 if B >= 16 else 4.0 if B <= 8 else 5.0


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
    cfg = read_config(a.drafter_config)
    dev = torch.device(a.device)
    if fx is not None:
        a.gamma = fixture_gamma(a.check_fixture, cfg.raw)

    lay = {k: v.to(dev) for k, v in load_file(a.layout).items()}
    bt = build_batch(lay, cfg, a.gamma, dev)
    masks, mask_s = build_masks(cfg, bt, dev)

    g = torch.Generator(device=dev).manual_seed(0)
    P, embed, lm_head, Fh = init_params(cfg, bt.T, dev, g)
    params = param_list(P)
    if fx is not None:  # the fixture's weights, all fp32
        def put(p, key):
            p.data = fx[key].float().to(dev).reshape(p.shape).clone()
        put(P["fc"], "fc.weight"), put(P["hn"], "hidden_norm.weight"), put(P["norm"], "norm.weight")
        for l, Lp in enumerate(P["layers"]):
            for k_, n_ in LAYER_NAMES.items():
                put(Lp[k_], f"layers.{l}.{n_}.weight")
        embed = fx["batch.embed_tokens"].float().to(dev)
        lm_head = fx["batch.lm_head"].float().to(dev)
        Fh = fx["batch.target_hidden"].float().to(dev)
    opt = make_optimizer(params, dev)
    flex = flex_attention if a.no_compile or fx is not None else torch.compile(flex_attention, dynamic=False)
    wdt = torch.float32 if fx is not None else torch.bfloat16  # attention and LM-head operand dtype
    M = make_model(cfg, bt, masks, embed, lm_head, Fh, dev, wdt, flex)
    print(f"reference: {sum(p.numel() for p in params)/1e9:.3f}B trainable parameters, T={bt.T}, anchors={bt.A}, "
          f"rows={bt.R}, trained slots={bt.sel.numel()}, mask build {mask_s:.3f} s", flush=True)

    def step():
        return train_step(M, params, None if fx is not None else opt, lambda: dflash_loss(M, P, a.lm_chunk),
                          autocast=fx is None)

    if fx is not None:
        ref = load_file(a.check_fixture + "/ref.safetensors")
        loss = float(step())
        L = cfg.L
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
        print(json.dumps({"check": a.check_fixture, "gamma": a.gamma, "loss": loss, "oracle_loss": rl,
                          "loss_rel_err": abs(loss - rl) / abs(rl), "grad_rel_l2_worst": worst}))
        ok = abs(loss - rl) <= 1e-4 * abs(rl) and worst <= 1e-3
        raise SystemExit(0 if ok else 1)

    timing, _ = timed_steps(step, dev, a.steps, a.warmup)
    out = {"impl": "pytorch-flex", "compiled": not a.no_compile, **timing, "mask_build_s": mask_s}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
