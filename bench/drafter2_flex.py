#!/usr/bin/env python3
"""bench/drafter2_flex.py - the PyTorch reference of one DFlash2 training step (bench/drafter2_bench.sh).

Written from the DFlash2 reference notes (shared/reference/dflash2.md; not from our C code) on top of
bench/drafter_flex.py, whose pieces it imports: the DFlash step (config, batch layout, flex_attention
BlockMasks from docs/drafter.md's rules, compiled; the attention and MLP sublayers; the chunked,
checkpointed LM head) plus

- per layer, a grouped dynamic causal convolution around the attention (attention_conv) and around the
  MLP (mlp_conv): base_kernel [2, Kc, D] and kernel_projection [2.Kc.n_g, D] (n_g = D / G groups), on
  block rows only. For the normed sublayer input u: delta = u . Wp^T viewed [rows, 2, Kc, n_g];
  prepare u'[i] = sum_t [slot(i) >= t] (base[0,t] + delta[i,0,t,group]) * u[i-t]; the sublayer runs on
  u' giving s; finish o[i] = sum_t [slot(i) >= t] (base[1,t] + delta[i,1,t,group]) * s[i-t] with the
  same delta; x += o. Vectorised: block rows viewed [n_blocks, B, n_g, G], tap t = the rows shifted by
  t inside each block with zeros at its start, the group coefficient broadcast over its G channels.
  Identity init (base tap 0 = 1, the rest and the projection 0): an untrained DFlash2 is DFlash;
- the candidate selector: predecessor_codebook and successor_codebook [V, R] (fp32 parameters, dense
  gradients and AdamW, as PyTorch trainers do), hidden_projection [R, D];
- loss = unary + alpha . selector. unary: the DFlash hard CE, sum w.CE / sum w. selector, per trained
  slot: candidates = top-K of the unary logits z, taken inside the chunked LM-head pass (so [rows, V]
  never exists for all rows; no gradient through the selection), z[cand] gathered there too (its
  gradient flows back through the chunk's recomputed logits); predecessor = the true token of the
  previous slot (slot 1: the anchor token); a target missing from the top-K replaces the K-th
  candidate (speculators; default) or the slot leaves the selector term (--selector-missing drop,
  SpecForge's strict top-K); score = z[cand] + ((P[pred] * (h . W_h^T)) . S[cand]^T); K-way CE with
  the slot weights, normalised by the weights of the slots it covers.

bf16 autocast, backward, clip_grad_norm_(1.0), fused AdamW on fp32 masters. Trains on the --layout batch
file bench_dt_step writes and prints one JSON line like drafter_flex.py, plus an estimate of the step's
FLOPs (dt_plan's method with the convolution projections and the selector added) and the TF/s it gives.

--make-tiny DIR writes a tiny DFlash2 config and batch layout for CPU runs; --check runs the self-checks
there (identity convs + alpha 0 against drafter_flex.py's step; the convolution and the selector loss
against per-row loops of the formulas).
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import drafter_flex as df  # noqa: E402


def dflash2_sizes(cfg):
    dc = cfg.raw.get("dflash_config") or {}

    def get(k):
        v = dc.get(k, cfg.raw.get(k))
        if v is None:
            raise SystemExit(f"drafter config: missing dflash_config.{k} (a DFlash2DraftModel config needs it)")
        return int(v)
    Kc, G, R, K = get("conv_kernel_size"), get("conv_group_size"), get("selector_rank"), get("selector_top_k")
    if Kc > cfg.B or cfg.D % G or K > cfg.V:
        raise SystemExit(f"drafter config: conv_kernel_size {Kc} > block {cfg.B}, or group {G} not dividing "
                         f"{cfg.D}, or top_k {K} > vocab {cfg.V}")
    return Kc, G, R, K


# ---- parameters

def init_dflash2(cfg, dev, g, identity=True):
    """Per layer {"attn", "mlp"}: {"base" [2, Kc, D], "proj" [2.Kc.n_g, D]}; the selector {"pred", "succ" [V, R],
    "hproj" [R, D]}. identity: the trainers' init (the conv is the identity); else random (for checks)."""
    Kc, G, R, _ = dflash2_sizes(cfg)
    D, ng = cfg.D, cfg.D // G

    def uni(*shape, scale=0.02 * math.sqrt(3)):
        return (torch.rand(*shape, device=dev, generator=g) * 2 - 1) * scale

    convs = []
    for _ in range(cfg.L):
        layer = {}
        for side in ("attn", "mlp"):
            base = torch.zeros(2, Kc, D, device=dev)
            base[:, 0, :] = 1
            proj = torch.zeros(2 * Kc * ng, D, device=dev)
            if not identity:
                base += uni(2, Kc, D, scale=0.5)
                proj += uni(2 * Kc * ng, D, scale=0.1)
            layer[side] = {"base": torch.nn.Parameter(base), "proj": torch.nn.Parameter(proj)}
        convs.append(layer)
    selector = {"pred": torch.nn.Parameter(uni(cfg.V, R)), "succ": torch.nn.Parameter(uni(cfg.V, R)),
                "hproj": torch.nn.Parameter(uni(R, D))}
    return convs, selector


def dflash2_param_list(convs, selector):
    return [p for l in convs for s in ("attn", "mlp") for p in l[s].values()] + list(selector.values())


# ---- the grouped dynamic causal convolution

def dynconv(base, delta, x, side, B, G):
    """out[i, c] = sum_{t < Kc, t <= slot(i)} (base[side, t, c] + delta[i, side, t, c // G]) * x[i - t, c].
    x [R, D] block rows (block-major, R = n_blocks.B); delta [R, 2, Kc, n_g]; base [2, Kc, D]."""
    Rr, D = x.shape
    Kc, ng = base.shape[1], D // G
    xb = x.view(Rr // B, B, ng, G)
    db = delta.view(Rr // B, B, 2, Kc, ng)
    out = 0
    for t in range(Kc):
        xs = xb if t == 0 else F.pad(xb[:, :B - t], (0, 0, 0, 0, t, 0))  # zeros at each block's start
        coef = base[side, t].view(ng, G) + db[:, :, side, t, :, None]  # [n_blocks, B, n_g, G]
        out = out + coef * xs
    return out.reshape(Rr, D)


def conv_delta(cp, u, Kc, ng):
    return (u @ cp["proj"].t()).view(u.shape[0], 2, Kc, ng)


def dflash2_hidden(M, P, convs):
    """The DFlash2 stack: every sublayer wrapped in its dynamic convolution; the final-normed hidden [R, D]."""
    c = M.cfg
    Kc, G, _, _ = dflash2_sizes(c)
    ng = c.D // G
    ctx = df.ctx_features(M, P)
    x = M.embed[M.bt.blk_ids].float()
    for l, Lp in enumerate(P["layers"]):
        cv = convs[l]["attn"]
        u = df.rms(x, Lp["in"], c.eps)
        d = conv_delta(cv, u, Kc, ng)
        s = df.attn_sublayer(M, Lp, l, dynconv(cv["base"], d, u, 0, c.B, G), ctx)
        x = x + dynconv(cv["base"], d, s, 1, c.B, G)
        cv = convs[l]["mlp"]
        u = df.rms(x, Lp["post"], c.eps)
        d = conv_delta(cv, u, Kc, ng)
        s = df.mlp_sublayer(Lp, dynconv(cv["base"], d, u, 0, c.B, G))
        x = x + dynconv(cv["base"], d, s, 1, c.B, G)
    return df.rms(x, P["norm"], c.eps)


# ---- the loss: unary CE and the selector's candidates in one chunked pass, then the selector CE

def unary_and_candidates(M, hf, chunk, K, inject):
    """Per chunk of trained slots (checkpointed): the logits, sum w.CE, and without gradient the top-K
    candidates with the target injected at rank K (inject) and its index among them; z[cand] gathered
    from the same logits (with gradient). Returns (unary sum, z_cand [S, K], cand, label index, kept)."""
    bt = M.bt

    def chunk_fn(h, lab, wc):
        logits = (h.to(M.wdt) @ M.lm_head.t()).float()
        ce = (F.cross_entropy(logits, lab, reduction="none") * wc).sum()
        with torch.no_grad():
            cand = logits.topk(K, dim=1).indices
            hit = cand == lab[:, None]
            present = hit.any(1)
            if inject:
                last = torch.arange(K, device=cand.device)[None, :] == K - 1
                cand = torch.where(last & ~present[:, None], lab[:, None], cand)
                hit = cand == lab[:, None]
            idx = hit.int().argmax(1)
        return ce, logits.gather(1, cand), cand, idx, present

    total, parts = 0, []
    for i in range(0, bt.sel.numel(), chunk):
        ce, zc, cand, idx, present = checkpoint.checkpoint(
            chunk_fn, hf[i:i + chunk], bt.labels[i:i + chunk], bt.wsel[i:i + chunk], use_reentrant=False)
        total = total + ce
        parts.append((zc, cand, idx, present))
    zc, cand, idx, present = (torch.cat(t) for t in zip(*parts))
    kept = torch.ones_like(present) if inject else present
    return total, zc, cand, idx, kept, present


def selector_scores(M, S, hf, zc, cand):
    """score = z[cand] + ((P[pred] * (h . W_h^T)) . S[cand]^T), predecessor = the true token of the previous slot."""
    pred = M.bt.ids[M.bt.tgt_sel - 1]  # slot k's predecessor ids[a + k - 1]; slot 1: the anchor token
    hw = hf @ S["hproj"].t()  # [S, R]
    trans = torch.bmm(S["succ"][cand], (S["pred"][pred] * hw).unsqueeze(-1)).squeeze(-1)  # [S, K]
    return zc + trans.float()


def dflash2_loss(M, P, convs, S, chunk, K, alpha, inject, stats=None):
    bt = M.bt
    hf = dflash2_hidden(M, P, convs)[bt.sel]
    unary, zc, cand, idx, kept, present = unary_and_candidates(M, hf, chunk, K, inject)
    score = selector_scores(M, S, hf, zc, cand)
    wk = bt.wsel * kept
    sel_ce = (F.cross_entropy(score, idx, reduction="none") * wk).sum() / wk.sum().clamp(min=1e-30)
    if stats is not None:  # speculators' metrics: recall@K of the unary top-K, teacher-forced selector accuracy
        stats.update(unary=float(unary / bt.wsum), selector=float(sel_ce), recall_at_k=float(present.float().mean()),
                     selector_acc=float(((score.argmax(1) == idx) & present).float().mean()))
    return unary / bt.wsum + alpha * sel_ce


# ---- FLOPs: dt_plan's count (drafter-trainer/cmd/dt_plan.c) plus the convolutions' projections and the selector

def flops_step(cfg, T, A, seq_len, K, R, Kc, G):
    D, hd, H, KV, I, B, V = cfg.D, cfg.hd, cfg.nq, cfg.nkv, cfg.I, cfg.B, cfg.V
    Q, Kr, nD = A * B, T + A * B, len(cfg.taps) * D
    fc = 2 * T * nD * D
    lin = attn = 0
    for l in range(cfg.L):
        W = cfg.window[l]
        vis = (seq_len / 2 if W <= 0 or seq_len <= W else W - W * W / (2 * seq_len)) + \
            ((B + 1) / 2 if cfg.causal[l] else B)
        lin += 2 * 2 * Q * D * H * hd + 2 * 2 * Kr * D * KV * hd + 2 * 3 * Q * D * I
        lin += 2 * 2 * Q * D * (2 * Kc * (D // G))  # two kernel projections per layer
        attn += 4 * Q * H * hd * vis
    lm = 2 * A * (B - 1) * D * V
    sel = 2 * A * (B - 1) * (D * R + K * R)  # h . W_h^T and the K transition scores
    fwd = fc + lin + attn + lm + sel
    return fwd + fc + 2 * lin + 2.5 * attn + lm + 2 * sel, 3.5 * attn, 2 * lm


# ---- a tiny case for cpu runs, and the self-checks

def make_tiny(d):
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "block_size": 8, "num_target_layers": 6,
           "dflash_config": {"block_size": 8, "target_layer_ids": [1, 3], "mask_token_id": 500,
                             "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16,
                             "selector_top_k": 8},
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "rope_theta": 10000000, "attention_bias": False, "max_position_embeddings": 4096,
           # W 5 < B 8: the window cuts block slots both ways, as at the 27B shape it cuts the context
           "layer_types": ["sliding_attention", "sliding_attention"], "use_sliding_window": True,
           "sliding_window": 5, "is_causal": False, "tie_word_embeddings": False, "vocab_size": 512}
    json.dump(cfg, open(os.path.join(d, "drafter.json"), "w"), indent=2)
    g = torch.Generator().manual_seed(1)
    seqlens = [70, 9, 1, 45, 67]
    cu = torch.tensor([0] + seqlens).cumsum(0).int()
    T = int(cu[-1])
    ids = torch.randint(0, 500, (T,), generator=g).int()
    lmask = (torch.rand(T, generator=g) > 0.15).int()
    doc = torch.searchsorted(cu[1:].long(), torch.arange(T), right=True)
    cand = [p for p in range(T - 1) if lmask[p] and lmask[p + 1] and doc[p] == doc[p + 1]]
    pick = torch.randperm(len(cand), generator=g)[:40].sort().values
    anchors = torch.tensor([cand[i] for i in pick.tolist()]).int()
    save_file({"input_ids": ids, "cu_seqlens": cu, "loss_mask": lmask, "anchors": anchors},
              os.path.join(d, "layout.safetensors"))
    print(f"wrote {d}/drafter.json and {d}/layout.safetensors (T {T}, {len(seqlens)} documents, "
          f"{anchors.numel()} anchors x 8)")


def loop_dynconv(base, delta, x, side, B, G):
    out = torch.zeros_like(x)
    Kc = base.shape[1]
    for i in range(x.shape[0]):
        for t in range(min(Kc, i % B + 1)):
            for c in range(x.shape[1]):
                out[i, c] += (base[side, t, c] + delta[i, side, t, c // G]) * x[i - t, c]
    return out


def loop_selector(M, S, hf, K, inject):
    """The selector term slot by slot from the definition: full logits, top-K, injection, score, K-way CE."""
    bt = M.bt
    num = den = 0.0
    for r in range(hf.shape[0]):
        z = hf[r].double() @ M.lm_head.double().t()
        lab = int(bt.labels[r])
        cand = z.topk(K).indices.tolist()
        if lab not in cand:
            if not inject:
                continue
            cand[K - 1] = lab
        p = int(bt.ids[bt.tgt_sel[r] - 1])
        hw = S["hproj"].double() @ hf[r].double()
        score = torch.stack([z[c] + (S["pred"][p].double() * hw * S["succ"][c].double()).sum() for c in cand])
        w = float(bt.wsel[r])
        num += w * float(torch.logsumexp(score, 0) - score[cand.index(lab)])
        den += w
    return num / den


def run_checks(a, cfg, bt, masks, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    P, embed, lm_head, Fh = df.init_params(cfg, bt.T, dev, g)
    Kc, G, R, K = dflash2_sizes(cfg)
    convs, S = init_dflash2(cfg, dev, g, identity=True)
    base_params = df.param_list(P)
    ok = True
    # 1. identity convs + alpha 0 = drafter_flex.py's DFlash step, same weights and batch: fp32, then bf16 autocast
    for name, wdt, autocast in (("fp32", torch.float32, False), ("bf16 autocast", torch.bfloat16, True)):
        fr = [t.to(wdt) for t in (embed, lm_head, Fh)]  # fp32: the frozen tensors widened, as --check-fixture
        M = df.make_model(cfg, bt, masks, *fr, dev, wdt, flex_attention)
        for p in base_params:
            p.grad = None
        l1 = float(df.train_step(M, base_params, None, lambda: df.dflash_loss(M, P, a.lm_chunk), autocast))
        g1 = [p.grad.clone() for p in base_params]
        for p in base_params:
            p.grad = None
        l2 = float(df.train_step(M, base_params, None, lambda: dflash2_loss(M, P, convs, S, a.lm_chunk, K, 0.0,
                                                                           True), autocast))
        gerr = max(float((p.grad - q).norm() / q.norm().clamp(min=1e-30)) for p, q in zip(base_params, g1))
        print(f"check identity convs + alpha 0 ({name}): drafter_flex.py loss {l1:.9f}, drafter2_flex.py loss "
              f"{l2:.9f}, |diff| {abs(l1 - l2):.3e}; shared parameters' gradients worst relative L2 {gerr:.3e}")
        ok &= abs(l1 - l2) <= 1e-6 * abs(l1) and gerr <= 1e-5
    # 2. the vectorised convolution against the loop of its formula, random kernels and projections
    rc, _ = init_dflash2(cfg, dev, g, identity=False)
    x = torch.randn(bt.R, cfg.D, generator=g, device=dev, dtype=torch.float64)
    cp = {k: v.detach().double() for k, v in rc[0]["attn"].items()}
    d = conv_delta(cp, x, Kc, cfg.D // G)
    for side in (0, 1):
        e = float((dynconv(cp["base"], d, x, side, cfg.B, G) - loop_dynconv(cp["base"], d, x, side, cfg.B, G)).abs()
                  .max())
        print(f"check dynconv side {side} vs the loop of the formula (float64, random kernels): max |diff| {e:.3e}")
        ok &= e <= 1e-12
    # 3. the selector term (vectorised, chunked; small chunks so several are cat'ed) against the slot-by-slot loop
    M = df.make_model(cfg, bt, masks, embed.float(), lm_head.float(), Fh.float(), dev, torch.float32, flex_attention)
    with torch.no_grad():
        hf = dflash2_hidden(M, P, rc)[bt.sel]
        for inject in (True, False):
            st = {}
            _, zc, cand, idx, kept, present = unary_and_candidates(M, hf, 7, K, inject)
            wk = bt.wsel * kept
            vec = float((F.cross_entropy(selector_scores(M, S, hf, zc, cand), idx, reduction="none") * wk).sum()
                        / wk.sum())
            ref = loop_selector(M, S, hf, K, inject)
            dflash2_loss(M, P, rc, S, 7, K, 1.0, inject, st)
            print(f"check selector CE ({'inject' if inject else 'drop'}): vectorised {vec:.9f}, slot loop {ref:.9f}, "
                  f"rel diff {abs(vec - ref) / abs(ref):.3e}; recall@{K} {st['recall_at_k']:.3f}, teacher-forced "
                  f"selector accuracy {st['selector_acc']:.3f}, unary {st['unary']:.5f}")
            ok &= abs(vec - ref) <= 1e-5 * abs(ref)
    # 4. gradients through the checkpointed chunks (z[cand] is a chunk output) against one unchunked,
    #    uncheckpointed pass over the full [slots, V] logits, alpha 1, random convolutions, fp32
    allp = df.param_list(P) + dflash2_param_list(rc, S)

    def direct():
        hf = dflash2_hidden(M, P, rc)[bt.sel]
        logits = hf @ M.lm_head.t()
        unary = (F.cross_entropy(logits, bt.labels, reduction="none") * bt.wsel).sum() / bt.wsum
        cand = logits.detach().topk(K, dim=1).indices
        miss = ~(cand == bt.labels[:, None]).any(1)
        cand[miss, K - 1] = bt.labels[miss]
        idx = (cand == bt.labels[:, None]).int().argmax(1)
        score = selector_scores(M, S, hf, logits.gather(1, cand), cand)
        return unary + (F.cross_entropy(score, idx, reduction="none") * bt.wsel).sum() / bt.wsel.sum()

    grads = []
    for fn in (direct, lambda: dflash2_loss(M, P, rc, S, 7, K, 1.0, True)):
        for p in allp:
            p.grad = None
        grads.append((float(df.train_step(M, allp, None, fn, autocast=False)), [p.grad.clone() for p in allp]))
    (ld, gd), (lc, gc) = grads
    gerr = max(float((p - q).norm() / q.norm().clamp(min=1e-30)) for p, q in zip(gc, gd))
    print(f"check chunked + checkpointed vs direct (alpha 1, random convs): loss {lc:.9f} vs {ld:.9f}, all "
          f"gradients worst relative L2 {gerr:.3e}")
    ok &= abs(lc - ld) <= 1e-6 * abs(ld) and gerr <= 1e-5
    print(json.dumps({"check": "drafter2_flex", "ok": bool(ok)}))
    raise SystemExit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter-config")
    ap.add_argument("--layout")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lm-chunk", type=int, default=2048, help="rows of logits per checkpointed CE chunk")
    ap.add_argument("--gamma", type=float, default=7.0, help="slot weight exp(-(k-1)/gamma) (bench_dt_step uses 7)")
    ap.add_argument("--alpha", type=float, default=1.0, help="selector loss weight (speculators, NeMo: 1)")
    ap.add_argument("--selector-missing", choices=("inject", "drop"), default="inject",
                    help="a target outside the top-K: replaces the K-th candidate (speculators) or leaves the "
                         "selector term (SpecForge strict top-K)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--no-compile", action="store_true", help="eager flex_attention")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--make-tiny", metavar="DIR", help="write a tiny DFlash2 config and layout to DIR and exit")
    ap.add_argument("--check", action="store_true",
                    help="self-checks instead of timing (small shapes: the loops are slow)")
    a = ap.parse_args()
    if a.make_tiny:
        make_tiny(a.make_tiny)
        return
    if not a.drafter_config or not a.layout:
        ap.error("--drafter-config and --layout are required")
    cfg = df.read_config(a.drafter_config)
    Kc, G, R, K = dflash2_sizes(cfg)
    dev = torch.device(a.device)
    lay = {k: v.to(dev) for k, v in load_file(a.layout).items()}
    bt = df.build_batch(lay, cfg, a.gamma, dev)
    masks, mask_s = df.build_masks(cfg, bt, dev)
    if a.check:
        run_checks(a, cfg, bt, masks, dev)

    g = torch.Generator(device=dev).manual_seed(0)
    P, embed, lm_head, Fh = df.init_params(cfg, bt.T, dev, g)  # the same draws as drafter_flex.py
    convs, S = init_dflash2(cfg, dev, g, identity=True)
    params = df.param_list(P) + dflash2_param_list(convs, S)
    opt = df.make_optimizer(params, dev, a.lr)
    flex = flex_attention if a.no_compile else torch.compile(flex_attention, dynamic=False)
    M = df.make_model(cfg, bt, masks, embed, lm_head, Fh, dev, torch.bfloat16, flex)
    n2 = sum(p.numel() for p in dflash2_param_list(convs, S))
    print(f"reference (DFlash2): {sum(p.numel() for p in params)/1e9:.3f}B trainable parameters "
          f"({n2/1e6:.1f}M in the convolutions and the selector), T={bt.T}, anchors={bt.A}, block {cfg.B}, "
          f"rows={bt.R}, trained slots={bt.sel.numel()}, Kc {Kc}, G {G}, R {R}, K {K}, alpha {a.alpha}, "
          f"missing target: {a.selector_missing}, mask build {mask_s:.3f} s", flush=True)
    inject = a.selector_missing == "inject"

    def step():
        return df.train_step(M, params, opt, lambda: dflash2_loss(M, P, convs, S, a.lm_chunk, K, a.alpha, inject))

    timing, _ = df.timed_steps(step, dev, a.steps, a.warmup, "reference (DFlash2)")
    st = {}
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        dflash2_loss(M, P, convs, S, a.lm_chunk, K, a.alpha, inject, st)
    n_docs = bt.cu.numel() - 1
    tf, tf_attn, tf_lm = flops_step(cfg, bt.T, bt.A, bt.T / n_docs, K, R, Kc, G)
    out = {"impl": "pytorch-flex-dflash2", "compiled": not a.no_compile and dev.type == "cuda", **timing,
           "mask_build_s": mask_s, "tokens": bt.T, "docs": n_docs, "anchors": bt.A, "block": cfg.B,
           "alpha": a.alpha, "selector_missing": a.selector_missing, "lr": a.lr,
           "tflop_per_step_est": tf / 1e12, "tflop_attn_est": tf_attn / 1e12, "tflop_lm_est": tf_lm / 1e12,
           "tflops_est": tf / timing["step_s_median"] / 1e12,
           "after": {k: round(v, 6) for k, v in st.items()}}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
