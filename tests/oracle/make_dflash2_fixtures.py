#!/usr/bin/env python3
"""tests/oracle/make_dflash2_fixtures.py — float64 PyTorch oracle for one DFlash2 drafter training step.

Written from shared/reference/dflash2.md (§2 grouped dynamic causal convolution, §3 candidate selector, §4 loss,
§6 checkpoint) on top of the DFlash step of docs/drafter.md, not from the C code. The DFlash parts (packed batch,
dense loop-built masks, positions, RoPE, attention, MLP, labels and weights, unary loss and metrics) are imported
from make_drafter_fixtures.py; the convolution and the selector are written here with plain Python loops (per
row and tap, per row and candidate). Builds tiny random DFlash2 drafters and packed batches (seeded), saves them in
the serving format plus the `grad` batch format, reads the SAVED files back as float64, runs the step with
autograd and writes tests/fixtures/drafter2/<name>/{drafter/, batch.safetensors, ref.safetensors} and
manifest.json. See tests/oracle/README.md (DFlash2 section).
"""

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_drafter_fixtures as d1                                          # noqa: E402
from make_drafter_fixtures import FULL, SLIDE, DEFAULT_GAMMA, log, rms_norm  # noqa: E402

REPO = d1.REPO
GEN = "tests/oracle/make_dflash2_fixtures.py"
DFLASH_KEYS = ("gamma", "n_blocks", "selector_alpha", "selector_miss")

# Each fixture: the DFlash fields of make_drafter_fixtures.FIXTURES (drafter shape, packing, anchors, batch dtype,
# gamma), plus the DFlash2 ones: Kc (conv_kernel_size), G (conv_group_size), R (selector_rank), K
# (selector_top_k), miss (target outside the unary top-K: "inject" or "drop"), alpha (selector loss weight), and
# how the labels are steered (the model reads input_ids only at the anchors, so labels can be set after one
# forward without changing any logit): `sel_hits` blocks get their leading labels set one by one to the selector's
# own argmax (teacher-forced predecessor), `unary_hits` blocks to the unary argmax, and `in_topk` further trained
# slots to a random member of their unary top-K; every other label stays random (mostly outside the top-K).
FIXTURES = [
    dict(
        name="b8_k2_g4_sw5_full_inject",
        about="block 8, 2 layers [sliding W=5 causal, full]; conv Kc=2, G=4 (6 groups of D=24); selector R=6, "
              "K=8 of V=80, miss=inject; GQA 2 q / 1 kv x 8; 2 taps [1, 3] of 6; 4 documents 17, 50, 1, 30; "
              "F32 batch; gamma 4; alpha 1",
        seed=6101, D=24, V=80, I=16, nq=2, nkv=1, hd=8, layer_types=[SLIDE, FULL], window=5, B=8,
        Lt=6, taps=[1, 3], mask_token_id=79, theta=10000.0, eps=1e-6,
        docs=[17, 50, 1, 30], prompt=[0.0, 0.2, 0.0, 0.0], holes=0.1,
        n_anchors=20, near_end=[2, 4], at_start=[0, 3], off_rule=[], dtype="f32", gamma=None,
        Kc=2, G=4, R=6, K=8, miss="inject", alpha=1.0, sel_hits=5, unary_hits=3, in_topk=12,
    ),
    dict(
        name="b16_k2_g1_sw11_noncausal_bf16_inject",
        about="the published DFlash2 attention in miniature: is_causal false, sliding W=11 < B=16 (one layer); "
              "conv Kc=2, G=1 (one group per channel); selector R=4, K=16 of V=128, miss=inject; 2 q = 2 kv "
              "heads x 8 (q width 16 < D 24); 3 taps [0, 2, 4] of 6; 3 documents 60, 9, 40; BF16 batch; "
              "gamma 7; alpha 1",
        seed=6202, D=24, V=128, I=16, nq=2, nkv=2, hd=8, layer_types=[SLIDE], window=11, B=16,
        Lt=6, taps=[0, 2, 4], mask_token_id=5, theta=1e7, eps=1e-6, is_causal=False,
        docs=[60, 9, 40], prompt=[0.2, 0.0, 0.25], holes=0.1,
        n_anchors=12, near_end=[2, 3], at_start=[1], off_rule=[], dtype="bf16", gamma=None,
        Kc=2, G=1, R=4, K=16, miss="inject", alpha=1.0, sel_hits=4, unary_hits=2, in_topk=12,
    ),
    dict(
        name="b8_k1_gD_full_full_drop",
        about="block 8, 2 full (non-causal) layers; conv Kc=1 (a per-row dynamic scale), G=D=24 (one group); "
              "selector R=4, K=4 of V=64, miss=drop (slots whose target is outside the top-4 leave the selector "
              "term); GQA 2 q / 1 kv x 8; 2 taps [1, 3] of 5; 4 documents 40, 1, 25, 30; F32 batch; gamma 4; "
              "alpha 1",
        seed=6303, D=24, V=64, I=16, nq=2, nkv=1, hd=8, layer_types=[FULL, FULL], window=None, B=8,
        Lt=5, taps=[1, 3], mask_token_id=0, theta=1e6, eps=1e-6,
        docs=[40, 1, 25, 30], prompt=[0.2, 0.0, 0.0, 0.3], holes=0.1,
        n_anchors=18, near_end=[2, 3], at_start=[2], off_rule=[], dtype="f32", gamma=None,
        Kc=1, G=24, R=4, K=4, miss="drop", alpha=1.0, sel_hits=4, unary_hits=2, in_topk=10,
    ),
    dict(
        name="b16_k2_g8_full_alpha05_bf16_inject",
        about="selector_loss_alpha 0.5; block 16, one full (non-causal) layer; conv Kc=2, G=8 (3 groups); "
              "selector R=6, K=12 of V=96, miss=inject; GQA 2 q / 1 kv x 12 (q width 24 = D); 3 taps [1, 4, 6] of 8; 4 documents "
              "70, 17, 1, 45; BF16 batch; rms_norm_eps 1e-5; gamma 7",
        seed=6404, D=24, V=96, I=16, nq=2, nkv=1, hd=12, layer_types=[FULL], window=None, B=16,
        Lt=8, taps=[1, 4, 6], mask_token_id=95, theta=10000.0, eps=1e-5,
        docs=[70, 17, 1, 45], prompt=[0.25, 0.0, 0.0, 0.2], holes=0.1,
        n_anchors=14, near_end=[2, 5], at_start=[1], off_rule=[], dtype="bf16", gamma=None,
        Kc=2, G=8, R=6, K=12, miss="inject", alpha=0.5, sel_hits=4, unary_hits=2, in_topk=12,
    ),
    dict(
        name="b8_k3_g3_sw3_noncausal_drop",
        about="is_causal false, one sliding layer W=3 < B=8 (slot k sees slots |k - s| < 3 and context >= "
              "a + k - 2); conv Kc=3, G=3 (8 groups); selector R=6, K=6 of V=72, miss=drop; 2 q = 2 kv heads "
              "x 8; 2 taps [1, 3] of 5; 4 documents 30, 1, 45, 17; F32 batch; gamma 4; alpha 1",
        seed=6505, D=24, V=72, I=16, nq=2, nkv=2, hd=8, layer_types=[SLIDE], window=3, B=8,
        Lt=5, taps=[1, 3], mask_token_id=71, theta=1e7, eps=1e-6, is_causal=False,
        docs=[30, 1, 45, 17], prompt=[0.0, 0.0, 0.2, 0.0], holes=0.1,
        n_anchors=16, near_end=[2, 4], at_start=[0, 3], off_rule=[], dtype="f32", gamma=None,
        Kc=3, G=3, R=6, K=6, miss="drop", alpha=1.0, sel_hits=4, unary_hits=2, in_topk=8,
    ),
    dict(
        name="b16_k3_g6_sw5_causal_inject",
        about="block 16, one sliding layer W=5 causal (by layer type): slots k >= 5 see no context; conv Kc=3, "
              "G=6 (4 groups); selector R=6, K=10 of V=112, miss=inject; GQA 3 q / 1 kv x 8; 2 taps [1, 2] of 4; "
              "3 documents 45, 17, 40; F32 batch; gamma 7; alpha 1",
        seed=6606, D=24, V=112, I=16, nq=3, nkv=1, hd=8, layer_types=[SLIDE], window=5, B=16,
        Lt=4, taps=[1, 2], mask_token_id=111, theta=10000.0, eps=1e-6,
        docs=[45, 17, 40], prompt=[0.2, 0.0, 0.0], holes=0.1,
        n_anchors=12, near_end=[2, 6], at_start=[1], off_rule=[], dtype="f32", gamma=None,
        Kc=3, G=6, R=6, K=10, miss="inject", alpha=1.0, sel_hits=4, unary_hits=2, in_topk=10,
    ),
]

FD_COORDS = 3            # finite-difference coordinates per parameter (1 uniform, 2 among the non-zero gradients)
FD_STEPS = (1e-4, 1e-6)  # the first step whose 4 points keep every candidate set is used
FD_TOL = {1e-4: 1e-6, 1e-6: 1e-4}   # |fd - autograd| / max(|autograd|, 1e-3 max |grad of that parameter|)
MIN_MARGIN = 1e-4        # unary top-1/top-2, unary K-th/(K+1)-th and selector top-1/top-2 margins
MAX_TRIES = 30           # seeds tried (seed + 1000·t) until every margin holds
ZLAB_TOL = 1e-12         # convolution and candidate scores against z-lab (float64 both), relative
ZLAB_MODEL_TOL = 1e-4    # the whole z-lab model per block (its RMSNorm and RoPE tables compute in fp32)
PERM_TOL = 1e-12         # loss invariant to the document order, relative
PERM_GRAD_TOL = 1e-10


def fail(msg):
    raise SystemExit("make_dflash2_fixtures: " + msg)


class Retry(Exception):
    """A margin is too small for an fp32 implementation to agree: try the next seed."""


# --------------------------------------------------------------------------------------------------------------
# Drafter: config and weights (dflash2.md §6)
# --------------------------------------------------------------------------------------------------------------

def n_groups(fx):
    return fx["D"] // fx["G"]


def param_specs2(fx):
    """The DFlash parameters, then per layer the two convolutions, then the selector (dflash2.md §2, §3, §6)."""
    D, Kc, V, R = fx["D"], fx["Kc"], fx["V"], fx["R"]
    specs = list(d1.param_specs(fx))
    for l in range(len(fx["layer_types"])):
        for conv in ("attention_conv", "mlp_conv"):
            specs += [(f"layers.{l}.{conv}.base_kernel", (2, Kc, D)),
                      (f"layers.{l}.{conv}.kernel_projection.weight", (2 * Kc * n_groups(fx), D))]
    specs += [("candidate_selector.predecessor_codebook", (V, R)),
              ("candidate_selector.successor_codebook", (V, R)),
              ("candidate_selector.hidden_projection.weight", (R, D))]
    return specs


def config2(fx):
    """The DFlash config (Qwen3 fields, layer types, window, is_causal where set) with the DFlash2 architecture;
    block_size only inside dflash_config, as in the published DFlash2 config."""
    cfg = d1.config_dict(fx)
    cfg["architectures"] = ["DFlash2DraftModel"]
    del cfg["block_size"]
    cfg["dflash_config"] = {
        "block_size": fx["B"], "target_layer_ids": list(fx["taps"]), "mask_token_id": fx["mask_token_id"],
        "conv_kernel_size": fx["Kc"], "conv_group_size": fx["G"], "selector_rank": fx["R"],
        "selector_top_k": fx["K"],
    }
    return cfg


def random_weights2(fx, gen):
    """The DFlash weights of make_drafter_fixtures (same draws), then non-identity convolutions — base tap 0
    1 + 0.25·randn, later taps 0.4·randn, projection N(0, 0.25/D) so that δ is O(0.3) — and the selector:
    codebooks N(0, 1), hidden_projection N(0, 2.25/(D·R)) (the transition term is then O(1.5), comparable to the
    unary logits' spread). All BF16."""
    out = d1.random_weights(fx, gen)
    D, Kc = fx["D"], fx["Kc"]
    for l in range(len(fx["layer_types"])):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.4 * torch.randn((2, Kc, D), generator=gen, dtype=torch.float32)
            base[:, 0, :] = 1.0 + 0.25 * torch.randn((2, D), generator=gen, dtype=torch.float32)
            proj = torch.randn((2 * Kc * n_groups(fx), D), generator=gen, dtype=torch.float32) * (0.5 / math.sqrt(D))
            out[f"layers.{l}.{conv}.base_kernel"] = base.to(torch.bfloat16).contiguous()
            out[f"layers.{l}.{conv}.kernel_projection.weight"] = proj.to(torch.bfloat16).contiguous()
    V, R = fx["V"], fx["R"]
    sel = "candidate_selector."
    out[sel + "predecessor_codebook"] = torch.randn((V, R), generator=gen).to(torch.bfloat16).contiguous()
    out[sel + "successor_codebook"] = torch.randn((V, R), generator=gen).to(torch.bfloat16).contiguous()
    out[sel + "hidden_projection.weight"] = (torch.randn((R, D), generator=gen) * (1.5 / math.sqrt(D * R))).to(
        torch.bfloat16).contiguous()
    return out


def identity_convs(fx, P):
    """The same weights with every convolution at its identity initialisation (dflash2.md §2)."""
    Q = dict(P)
    for name in P:
        if name.endswith(".base_kernel"):
            base = torch.zeros_like(P[name])
            base[:, 0, :] = 1.0
            Q[name] = base
        elif name.endswith(".kernel_projection.weight"):
            Q[name] = torch.zeros_like(P[name])
    return Q


# --------------------------------------------------------------------------------------------------------------
# The step in float64
# --------------------------------------------------------------------------------------------------------------

def topk_order(values, K):
    """Indices of the K largest values, largest first (a plain sort; ties by index, never met: margins ≥ 1e-4)."""
    return sorted(range(len(values)), key=lambda c: (-values[c], c))[:K]


class Step2(d1.Step):
    """The DFlash step plus the convolutions, the selector and its loss."""

    def __init__(self, fx, batch, gamma, alpha, miss):
        super().__init__(fx, batch, gamma)
        self.alpha, self.miss = alpha, miss
        B, D, G = fx["B"], fx["D"], fx["G"]
        self.group_of = torch.tensor([c // G for c in range(D)], dtype=torch.int64)   # channel -> group
        # teacher-forced predecessor of slot k >= 1: the true token of slot k - 1 (slot 1: the anchor token)
        self.pred = []
        for a in self.anchors:
            for k in range(B):
                self.pred.append(self.ids[a + k - 1] if 1 <= k and a + k - 1 < self.T else -1)
        # selector rows: the trained slots (k >= 1, w > 0)
        self.sel_rows = [i for i in range(self.nb * B) if self.w[i].item() > 0]

    def conv(self, x, base_s, delta_s):
        """One side of the grouped dynamic causal convolution, row by row and tap by tap:
        out[i, c] = Σ_{t ≤ min(Kc−1, slot(i))} (base_s[t, c] + delta_s[i, t, c // G]) · x[i − t, c]."""
        B, Kc = self.fx["B"], self.fx["Kc"]
        rows = []
        for i in range(x.shape[0]):
            slot = i % B
            acc = torch.zeros(x.shape[1], dtype=x.dtype)
            for t in range(min(Kc - 1, slot) + 1):
                coef = base_s[t] + delta_s[i, t][self.group_of]
                acc = acc + coef * x[i - t]
            rows.append(acc)
        return torch.stack(rows)

    def sublayer_with_conv(self, P, name, u, run, trace=None):
        """δ = u · kernel_projectionᵀ as [rows, 2, Kc, n_g]; u' = prepare(u) (side 0); s = run(u');
        o = finish(s) (side 1, coefficients from the same δ). Returns o."""
        fx = self.fx
        base = P[name + ".base_kernel"]
        delta = (u @ P[name + ".kernel_projection.weight"].T).reshape(u.shape[0], 2, fx["Kc"], n_groups(fx))
        u1 = self.conv(u, base[0], delta[:, 0])
        s = run(u1)
        o = self.conv(s, base[1], delta[:, 1])
        if trace is not None:
            trace[name] = dict(u=u.detach(), u1=u1.detach(), s=s.detach(), o=o.detach())
        return o

    def final_hidden(self, P, trace=None):
        fx = self.fx
        eps = fx["eps"]
        ctx = self.context(P)
        x = self.embed[self.blk_ids]
        for l, lt in enumerate(fx["layer_types"]):
            p = f"layers.{l}."
            u = rms_norm(x, P[p + "input_layernorm.weight"], eps)
            x = x + self.sublayer_with_conv(P, p + "attention_conv", u,
                                            lambda v: self.attention(P, l, lt, v, ctx), trace)
            m = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
            x = x + self.sublayer_with_conv(P, p + "mlp_conv", m, lambda v: self.mlp(P, l, v), trace)
        return rms_norm(x, P["norm.weight"], eps)

    def forward(self, P, trace=None):
        h = self.final_hidden(P, trace)
        return h, h @ self.lm_head.T

    def candidate_scores(self, P, h_i, z_i, p, cands):
        """score(c) = z[c] + Σ_r P[p, r] · (h · W_hᵀ)_r · S[c, r], one candidate at a time."""
        sel = "candidate_selector."
        hp = P[sel + "hidden_projection.weight"] @ h_i
        pre = P[sel + "predecessor_codebook"][p] * hp
        S = P[sel + "successor_codebook"]
        return torch.stack([z_i[c] + (pre * S[c]).sum() for c in cands])

    def selector(self, P, h, z):
        """The K-way selector term over the trained slots (dflash2.md §4), row by row. Returns the term
        (Σ w·CE_K / Σ w over the rows in it, 0 when none) and per row what happened."""
        K, miss = self.fx["K"], self.miss
        num = torch.zeros((), dtype=torch.float64)
        den = 0.0
        rows = {}
        for i in self.sel_rows:
            zi = z[i]
            top = topk_order(zi.detach().tolist(), K)      # the selection carries no gradient
            tgt = int(self.labels[i])
            if tgt in top:
                cands, lab, kind = top, top.index(tgt), "in"
            elif miss == "inject":
                cands, lab, kind = top[:K - 1] + [tgt], K - 1, "injected"
            else:
                rows[i] = dict(kind="dropped", top=top)
                continue
            sc = self.candidate_scores(P, h[i], zi, self.pred[i], cands)
            ce = torch.logsumexp(sc, dim=0) - sc[lab]
            wi = self.w[i].item()
            num = num + wi * ce
            den += wi
            rows[i] = dict(kind=kind, top=top, cands=cands, label=lab, scores=sc.detach())
        term = num / den if den > 0 else num
        return term, dict(rows=rows, weight_sum=den)

    def losses(self, P, trace=None):
        h, z = self.forward(P, trace)
        unary = self.loss(P, z)
        sel, info = self.selector(P, h, z)
        return unary + self.alpha * sel, unary, sel, info, h, z

    def signature(self, info):
        """The candidate sets and what happened to every selector row: constant where the loss is smooth."""
        return tuple((i, r["kind"], tuple(r.get("cands", r["top"]))) for i, r in sorted(info["rows"].items()))

    def metrics2(self, P, h, z, info):
        """Unary tau/accuracy (make_drafter_fixtures), and the selector's: per slot the trained slots whose
        target is in the unary top-K (sel_in_topk) and of those the ones whose selector argmax (teacher-forced
        predecessor) is the target (sel_hits); sel_tau = mean over blocks of 1 + the leading run of slots
        k = 1, 2, ... that are trained, in the top-K and selector-correct. Margins: unary top-1/top-2 (trained
        slots), unary K-th/(K+1)-th (selector rows), selector top-1/top-2 (rows with the target in the top-K)."""
        B, K = self.fx["B"], self.fx["K"]
        met = self.metrics(z)
        in_topk, hits = [0] * B, [0] * B
        ok = [False] * (self.nb * B)
        min_topk, min_sel = math.inf, math.inf
        with torch.no_grad():
            for i in self.sel_rows:
                vals = sorted(z[i].tolist(), reverse=True)
                min_topk = min(min_topk, vals[K - 1] - vals[K])
                top = topk_order(z[i].tolist(), K)
                tgt = int(self.labels[i])
                if tgt not in top:
                    continue
                k = i % B
                in_topk[k] += 1
                sc = self.candidate_scores(P, h[i], z[i], self.pred[i], top).tolist()
                best = max(range(K), key=lambda c: sc[c])
                s2 = sorted(sc, reverse=True)
                min_sel = min(min_sel, s2[0] - s2[1])
                if top[best] == tgt:
                    hits[k] += 1
                    ok[i] = True
        runs = []
        for j in range(self.nb):
            run = 0
            for k in range(1, B):
                if not ok[j * B + k]:
                    break
                run += 1
            runs.append(run)
        sel_tau = sum(1 + r for r in runs) / len(runs)
        kinds = [r["kind"] for r in info["rows"].values()]
        return dict(met, sel_in_topk=in_topk, sel_hits=hits, sel_tau=sel_tau, min_topk_margin=min_topk,
                    min_selector_margin=min_sel, rows_in=kinds.count("in"), rows_injected=kinds.count("injected"),
                    rows_dropped=kinds.count("dropped"))


def grads2(step, P):
    leaf = {k: v.clone().requires_grad_(True) for k, v in P.items()}
    total, unary, sel, info, h, z = step.losses(leaf)
    names = list(leaf)
    g = torch.autograd.grad(total, [leaf[k] for k in names], allow_unused=True)
    g = {k: (gi.detach() if gi is not None else torch.zeros_like(P[k])) for k, gi in zip(names, g)}
    return dict(loss=total.detach(), unary=unary.detach(), sel=sel.detach(), info=info, h=h.detach(),
                z=z.detach()), g


# --------------------------------------------------------------------------------------------------------------
# Labels steered so that the metrics are worth checking
# --------------------------------------------------------------------------------------------------------------

def steer_labels(fx, batch, step, P, h, z, gen):
    """Set some labels (never an anchor position, never the mask token) so that the selector and unary metrics
    are not trivially 0: chains of leading slots to the selector's argmax (with the predecessor already in place)
    or the unary argmax, then single slots to a random member of their top-K. A position is set once, and never
    one whose successor was set already (it would change that successor's predecessor)."""
    B, K = fx["B"], fx["K"]
    ids = batch["input_ids"].tolist()
    anchors = set(step.anchors)
    taken = set()
    order = torch.randperm(step.nb, generator=gen).tolist()
    sel_blocks = set(order[:fx["sel_hits"]])
    un_blocks = set(order[fx["sel_hits"]:fx["sel_hits"] + fx["unary_hits"]])

    def free(p):
        return p not in anchors and p not in taken and p + 1 not in taken

    with torch.no_grad():
        for j in sorted(sel_blocks | un_blocks):
            want = int(torch.randint(1, B, (), generator=gen))
            a = step.anchors[j]
            for k in range(1, want + 1):
                i, p = j * B + k, a + k
                if step.w[i].item() == 0 or not free(p):
                    break
                top = topk_order(z[i].tolist(), K)
                if j in sel_blocks:
                    sc = step.candidate_scores(P, h[i], z[i], ids[p - 1], top)
                    tok = top[int(sc.argmax())]
                else:
                    tok = top[0]
                if tok == fx["mask_token_id"]:
                    break
                ids[p] = tok
                taken.add(p)
        rows = [step.sel_rows[r] for r in torch.randperm(len(step.sel_rows), generator=gen).tolist()]
        n = 0
        for i in rows:
            if n == fx["in_topk"]:
                break
            p = step.anchors[i // B] + i % B
            if not free(p):
                continue
            top = topk_order(z[i].tolist(), K)
            tok = top[int(torch.randint(0, K, (), generator=gen))]
            if tok == fx["mask_token_id"]:
                continue
            ids[p] = tok
            taken.add(p)
            n += 1
    batch["input_ids"] = torch.tensor(ids, dtype=torch.int32)
    return len(taken)


# --------------------------------------------------------------------------------------------------------------
# Self-checks
# --------------------------------------------------------------------------------------------------------------

def check_finite_differences2(step, P, g, base_sig, gen):
    """4-point central differences on FD_COORDS coordinates of every parameter (one uniform, two among the
    non-zero gradient entries: the codebooks' gradients are sparse rows). The top-K selection is piecewise
    constant: a step is used only if none of its 4 points changes a candidate set or a row's fate; h = 1e-4
    first, else 1e-6 (looser tolerance: round-off)."""
    worst, worst_at, used = 0.0, "", {h: 0 for h in FD_STEPS}
    with torch.no_grad():
        for name, val in P.items():
            flat = val.reshape(-1)
            gflat = g[name].reshape(-1)
            gmax = gflat.abs().max().item()
            idx = [int(torch.randint(0, flat.numel(), (), generator=gen))]
            nz = torch.nonzero(gflat).reshape(-1)
            if nz.numel():
                idx += [int(nz[r]) for r in torch.randperm(nz.numel(), generator=gen)[:FD_COORDS - 1].tolist()]
            for i in idx:
                def f(delta):
                    Q = dict(P)
                    t = flat.clone()
                    t[i] += delta
                    Q[name] = t.reshape(val.shape)
                    total, _, _, info, _, _ = step.losses(Q)
                    return total.item(), step.signature(info) == base_sig
                for h in FD_STEPS:
                    pts = [f(h), f(-h), f(2 * h), f(-2 * h)]
                    if all(s for _, s in pts):
                        break
                else:
                    fail(f"{step.fx['name']}: {name}[{i}]: every finite-difference step changes a candidate set")
                used[h] += 1
                (fp, _), (fm, _), (f2p, _), (f2m, _) = pts
                fd = (8 * (fp - fm) - (f2p - f2m)) / (12 * h)
                ad = gflat[i].item()
                rel = abs(fd - ad) / max(abs(ad), 1e-3 * gmax, 1e-300)
                if rel > worst:
                    worst, worst_at = rel, f"{name}[{i}] (h {h:.0e})"
                if not rel <= FD_TOL[h]:
                    fail(f"{step.fx['name']}: gradient of {name}[{i}]: autograd {ad:.12e}, finite differences "
                         f"{fd:.12e} (h {h:.0e}, rel {rel:.2e} > {FD_TOL[h]:.0e})")
    log(f"    self-check autograd == finite differences (up to {FD_COORDS} coords x {len(P)} params, steps used "
        f"{ {f'{h:.0e}': n for h, n in used.items()} }): worst rel {worst:.2e} at {worst_at}")
    return dict(worst_rel=float(f"{worst:.3e}"), worst_at=worst_at,
                steps_used={f"{h:.0e}": n for h, n in used.items()})


def check_identity(step, P, fx):
    """Identity convolutions (base tap 0 = 1, rest 0, projection 0) give exactly the DFlash forward of
    make_drafter_fixtures on the same weights (no convolution, no selector)."""
    Pid = identity_convs(fx, P)
    with torch.no_grad():
        _, z2 = step.forward(Pid)
        z1 = d1.Step.logits(step, {n: P[n] for n, _ in d1.param_specs(fx)})
        u2, u1 = step.loss(Pid, z2).item(), step.loss(P, z1).item()
    diff = (z2 - z1).abs().max().item()
    if not torch.equal(z1, z2) or u1 != u2:
        fail(f"{fx['name']}: identity convolutions differ from the DFlash forward by {diff:.3e} (unary loss "
             f"{u2!r} vs {u1!r})")
    log("    self-check identity convolutions == DFlash forward: logits and unary loss bit for bit")
    return dict(logits_max_abs_diff=diff, unary_loss_equal=True)


def check_permutation2(fx, batch, gamma, P, res, g, gen):
    nd = len(fx["docs"])
    perm = torch.randperm(nd, generator=gen).tolist()
    if perm == list(range(nd)):
        perm = perm[::-1]
    step2 = Step2(fx, d1.permuted_batch(batch, perm), gamma, fx["alpha"], fx["miss"])
    res2, g2 = grads2(step2, P)
    rel = abs(res2["loss"].item() - res["loss"].item()) / abs(res["loss"].item())
    grel = max(((g2[k] - g[k]).abs().max() / g[k].abs().max().clamp_min(1e-300)).item() for k in g)
    if not rel <= PERM_TOL or not grel <= PERM_GRAD_TOL:
        fail(f"{fx['name']}: documents packed in order {perm}: loss rel {rel:.2e}, gradients rel {grel:.2e}")
    log(f"    self-check documents packed as {perm}: loss rel diff {rel:.2e}, gradients {grel:.2e}")
    return dict(order=perm, loss_rel=rel, grad_rel=grel)


def zlab_selector_scores(sel_mod, hidden, logits, preds):
    """Run z-lab's CandidateSelector.select on rows (batch = rows, one position each, the predecessor given) and
    capture the K scores it computes: its sampling helpers are swapped for ones that record their input (the
    scores / temperature, temperature 1) and pick the argmax, for the duration of the call."""
    import dflash.model as zm
    seen = []
    orig = zm._sampling_probs, zm._sample_probs

    def probs(scores, temperature, *a, **k):
        seen.append(scores.clone())
        return scores / temperature

    def pick(q):
        return q.argmax(-1)
    zm._sampling_probs, zm._sample_probs = probs, pick
    try:
        path, cands, _ = sel_mod.select(hidden, logits, preds, 1.0)
    finally:
        zm._sampling_probs, zm._sample_probs = orig
    return seen[0][:, 0], cands[:, 0], path[:, 0]


def check_against_zlab(step, P, fx, ddir, trace, h, z):
    """Against z-lab dflash 0.1.0 (the serving reference): (1) DFlash2DraftModel.from_pretrained reads the saved
    drafter with no missing or unexpected key and the same values; (2) GroupedDynamicCausalConv, instantiated
    with each conv's weights, on our u (blocks as its batch): prepare == our u', finish(our s) == our o;
    (3) CandidateSelector with the selector's weights on every selector row (teacher-forced predecessor): the
    same top-K set, the same scores per candidate, the same greedy choice; (4) the whole z-lab model, block by
    block (context = the anchor's document before the anchor), against our final hidden states."""
    try:
        import dflash.model as zm
    except ImportError as e:
        fail(f"z-lab's dflash package is needed (pip install --no-deps dflash==0.1.0): {e}")
    B, D, nb, T = fx["B"], fx["D"], step.nb, step.T
    out = {}
    # (1) the loader
    model, info = zm.DFlash2DraftModel.from_pretrained(ddir, dtype=torch.float64, output_loading_info=True)
    model.eval()
    bad_keys = [k for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)]
    if bad_keys:
        fail(f"{fx['name']}: z-lab's loader: {[(k, info[k]) for k in bad_keys]}")
    sd = model.state_dict()
    for n, v in P.items():
        zn = n + ".weight" if n.endswith("_codebook") else n
        if zn not in sd or sd[zn].dtype != torch.float64 or not torch.equal(sd[zn], v):
            fail(f"{fx['name']}: z-lab's loader reads {n} differently")
    out["loader"] = dict(keys=len(P), missing=0, unexpected=0, values_equal=True)
    # (2) the convolutions, each instantiated afresh with the fixture's weights
    worst_c = 0.0
    with torch.no_grad():
        for name, t in trace.items():
            mod = zm.GroupedDynamicCausalConv(D, fx["Kc"], fx["G"]).to(torch.float64)
            mod.base_kernel.copy_(P[name + ".base_kernel"])
            mod.kernel_projection.weight.copy_(P[name + ".kernel_projection.weight"])
            u1, dyn = mod.prepare(t["u"].reshape(nb, B, D))
            o = mod.finish(t["s"].reshape(nb, B, D), dyn)
            for mine, theirs in ((t["u1"], u1), (t["o"], o)):
                worst_c = max(worst_c, ((mine - theirs.reshape(nb * B, D)).abs().max()
                                        / mine.abs().max()).item())
    if not worst_c <= ZLAB_TOL:
        fail(f"{fx['name']}: our convolution differs from z-lab's GroupedDynamicCausalConv by {worst_c:.3e}")
    out["conv_max_rel"] = worst_c
    # (3) the selector on every selector row, pure top-K set, teacher-forced predecessor
    rows = step.sel_rows
    cfg = SimpleNamespace(vocab_size=fx["V"], hidden_size=D, dflash_config=config2(fx)["dflash_config"])
    sel = zm.CandidateSelector(cfg).to(torch.float64)
    with torch.no_grad():
        sel.predecessor_codebook.weight.copy_(P["candidate_selector.predecessor_codebook"])
        sel.successor_codebook.weight.copy_(P["candidate_selector.successor_codebook"])
        sel.hidden_projection.weight.copy_(P["candidate_selector.hidden_projection.weight"])
        preds = torch.tensor([step.pred[i] for i in rows], dtype=torch.int64)
        scores, cands, _ = zlab_selector_scores(sel, h[rows][:, None, :], z[rows][:, None, :], preds)
        greedy, _, _ = sel.select(h[rows][:, None, :], z[rows][:, None, :], preds, 0.0)
        worst_s, set_diff, choice_diff = 0.0, 0, 0
        for r, i in enumerate(rows):
            top = topk_order(z[i].tolist(), fx["K"])
            theirs = dict(zip(cands[r].tolist(), scores[r].tolist()))
            if sorted(theirs) != sorted(top):
                set_diff += 1
                continue
            mine = step.candidate_scores(P, h[i], z[i], step.pred[i], top)
            worst_s = max(worst_s, max(abs(mine[c].item() - theirs[tok]) for c, tok in enumerate(top))
                          / mine.abs().max().item())
            choice_diff += int(top[int(mine.argmax())] != int(greedy[r, 0]))
    if set_diff or choice_diff or not worst_s <= ZLAB_TOL:
        fail(f"{fx['name']}: z-lab's CandidateSelector: {set_diff} top-K sets and {choice_diff} greedy choices "
             f"differ, scores by {worst_s:.3e}")
    out["selector"] = dict(rows=len(rows), topk_sets_differing=set_diff, greedy_choices_differing=choice_diff,
                           scores_max_rel=worst_s)
    # (4) the whole model, block by block
    _, start_of = d1.doc_tables(step.cu)
    worst_m = 0.0
    with torch.no_grad():
        for j, a in enumerate(step.anchors):
            s0 = start_of[a]
            hz = model(position_ids=torch.arange(a - s0 + B)[None],
                       noise_embedding=step.embed[step.blk_ids[j * B:(j + 1) * B]][None],
                       target_hidden=step.F[s0:a][None])[0]
            worst_m = max(worst_m, (hz - h[j * B:(j + 1) * B]).abs().max().item())
    worst_m /= h.abs().max().item()
    if not worst_m <= ZLAB_MODEL_TOL:
        fail(f"{fx['name']}: z-lab's DFlash2DraftModel per block differs from our final hidden by {worst_m:.3e}")
    out["model_per_block_max_rel"] = worst_m
    log(f"    self-check vs z-lab dflash 0.1.0: loader reads all {len(P)} tensors; GroupedDynamicCausalConv "
        f"{worst_c:.1e}; CandidateSelector on {len(rows)} rows: sets and greedy choices equal, scores "
        f"{worst_s:.1e}; whole model per block {worst_m:.1e} (its RMSNorm/RoPE in fp32)")
    return out


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------

def build(fx, fdir, seed, gamma):
    """One attempt with one seed: files written, references computed, margins checked (Retry if one fails)."""
    name, B = fx["name"], fx["B"]
    gen = torch.Generator().manual_seed(seed)
    if os.path.isdir(fdir):
        shutil.rmtree(fdir)
    os.makedirs(os.path.join(fdir, "drafter"))
    cfg = config2(fx)
    d1.check_config_with_transformers(cfg)
    with open(os.path.join(fdir, "drafter", "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(random_weights2(fx, gen), os.path.join(fdir, "drafter", "model.safetensors"),
              metadata={"format": "pt"})
    batch, off_rule = d1.make_batch(fx, gen)

    P = d1.read_params(os.path.join(fdir, "drafter"))
    specs = param_specs2(fx)
    if sorted(P) != sorted(n for n, _ in specs):
        fail(f"{name}: saved keys {sorted(P)} differ from the serving keys")
    for n, shape in specs:
        if tuple(P[n].shape) != shape:
            fail(f"{name}: {n} has shape {tuple(P[n].shape)}, expected {shape}")
    P = {n: P[n] for n, _ in specs}

    step0 = Step2(fx, batch, gamma, fx["alpha"], fx["miss"])
    with torch.no_grad():
        h0, z0 = step0.forward(P)
    n_steered = steer_labels(fx, batch, step0, P, h0, z0, gen)
    save_file(dict(batch), os.path.join(fdir, "batch.safetensors"))
    stored = load_file(os.path.join(fdir, "batch.safetensors"))
    for k in batch:
        if stored[k].dtype != batch[k].dtype or not torch.equal(stored[k], batch[k]):
            fail(f"{name}: batch tensor {k} did not read back as written")

    step = Step2(fx, stored, gamma, fx["alpha"], fx["miss"])
    res, g = grads2(step, P)
    if not torch.equal(res["z"], z0):
        fail(f"{name}: steering labels changed the logits (a steered position is an anchor?)")
    met = step.metrics2(P, res["h"], res["z"], res["info"])
    for what in ("min_margin", "min_topk_margin", "min_selector_margin"):
        if not met[what] >= MIN_MARGIN:
            raise Retry(f"{what} {met[what]:.2e} < {MIN_MARGIN:.0e}")
    return P, stored, step, res, g, met, off_rule, n_steered


def make_fixture(fx, fdir):
    name, B = fx["name"], fx["B"]
    log(f"== {name}: {fx['about']}")
    gamma = fx["gamma"] if fx["gamma"] is not None else DEFAULT_GAMMA[B]
    for t in range(MAX_TRIES):
        seed = fx["seed"] + 1000 * t
        try:
            P, stored, step, res, g, met, off_rule, n_steered = build(fx, fdir, seed, gamma)
            break
        except Retry as e:
            log(f"    seed {seed}: {e}; next seed")
    else:
        fail(f"{name}: no seed in {MAX_TRIES} tries gives every margin >= {MIN_MARGIN:.0e}")
    info = res["info"]
    wsum = step.w.sum().item()
    nz = [k for k in g if g[k].abs().max().item() == 0.0]
    if nz:
        fail(f"{name}: zero gradients for {nz}")
    if met["rows_in"] == 0 or met["rows_injected"] + met["rows_dropped"] == 0:
        fail(f"{name}: want selector rows with the target both inside and outside the top-K")
    log(f"    seed {seed}: T {step.T}, {step.nb} anchors, sum w {wsum:.6f}; loss {res['loss'].item():.12f} = unary "
        f"{res['unary'].item():.12f} + {fx['alpha']} x selector {res['sel'].item():.12f}; selector rows "
        f"{len(step.sel_rows)}: {met['rows_in']} in top-{fx['K']}, {met['rows_injected']} injected, "
        f"{met['rows_dropped']} dropped; tau {met['tau']:.4f}, sel_tau {met['sel_tau']:.4f}, "
        f"sel hits {sum(met['sel_hits'])}/{sum(met['sel_in_topk'])} ({n_steered} labels steered)")

    trace = {}
    with torch.no_grad():
        step.forward(P, trace)
    checks = dict(masks=d1.check_masks(step))
    checks["finite_differences"] = check_finite_differences2(step, P, g, step.signature(info),
                                                             torch.Generator().manual_seed(seed + 17))
    checks["identity_conv_equals_dflash"] = check_identity(step, P, fx)
    checks["document_permutation"] = check_permutation2(fx, stored, gamma, P, res, g,
                                                         torch.Generator().manual_seed(seed + 29))
    checks["zlab"] = check_against_zlab(step, P, fx, os.path.join(fdir, "drafter"), trace, res["h"], res["z"])
    checks["transformers_blocks_max_abs"] = float(f"{d1.check_building_blocks(step, P):.3e}")

    specs = param_specs2(fx)
    ref = {"loss": res["loss"].reshape(1), "loss_unary": res["unary"].reshape(1),
           "loss_selector": res["sel"].reshape(1)}
    for n, _ in specs:
        ref["grad." + n] = g[n].to(torch.float64).contiguous()
    ref["tau"] = torch.tensor([met["tau"]], dtype=torch.float64)
    ref["acc_hits"] = torch.tensor(met["hits"], dtype=torch.int32)
    ref["acc_count"] = torch.tensor(met["count"], dtype=torch.int32)
    ref["sel_in_topk"] = torch.tensor(met["sel_in_topk"], dtype=torch.int32)
    ref["sel_hits"] = torch.tensor(met["sel_hits"], dtype=torch.int32)
    ref["sel_tau"] = torch.tensor([met["sel_tau"]], dtype=torch.float64)
    meta = {"gamma": repr(float(gamma)), "selector_alpha": repr(float(fx["alpha"])), "selector_miss": fx["miss"],
            "torch": torch.__version__, "generator": GEN, "weight_sum": repr(wsum),
            "selector_weight_sum": repr(info["weight_sum"]), "n_blocks": str(step.nb),
            "min_margin": f"{met['min_margin']:.6e}", "min_topk_margin": f"{met['min_topk_margin']:.6e}",
            "min_selector_margin": f"{met['min_selector_margin']:.6e}"}
    save_file(ref, os.path.join(fdir, "ref.safetensors"), metadata=meta)

    lt = fx["layer_types"]
    return dict(
        name=name, about=fx["about"], seed=seed, seed_tries=(seed - fx["seed"]) // 1000 + 1,
        drafter=dict(hidden_size=fx["D"], intermediate_size=fx["I"], vocab_size=fx["V"], num_layers=len(lt),
                     layer_types=lt, sliding_window=fx["window"] if SLIDE in lt else None,
                     is_causal=fx.get("is_causal"), causal_layers=[d1.layer_causal(fx, t) for t in lt],
                     num_attention_heads=fx["nq"], num_key_value_heads=fx["nkv"], head_dim=fx["hd"],
                     block_size=B, mask_token_id=fx["mask_token_id"], num_target_layers=fx["Lt"],
                     target_layer_ids=fx["taps"], rope_theta=fx["theta"], rms_norm_eps=fx["eps"],
                     conv_kernel_size=fx["Kc"], conv_group_size=fx["G"], conv_groups=n_groups(fx),
                     selector_rank=fx["R"], selector_top_k=fx["K"],
                     n_params=sum(v.numel() for v in P.values())),
        batch=dict(T=step.T, seqlens=fx["docs"], cu_seqlens=step.cu, n_anchors=step.nb, anchors=step.anchors,
                   off_rule_anchors=off_rule, loss_mask_zeros=step.loss_mask.count(0),
                   target_hidden=dict(dtype=fx["dtype"].upper(), shape=list(stored["target_hidden"].shape)),
                   embed_lm_head_dtype=fx["dtype"].upper(), steered_labels=n_steered),
        gamma=gamma, gamma_is_default=fx["gamma"] is None, selector_alpha=fx["alpha"], selector_miss=fx["miss"],
        ref=dict(loss=res["loss"].item(), loss_unary=res["unary"].item(), loss_selector=res["sel"].item(),
                 weight_sum=wsum, selector_weight_sum=info["weight_sum"], tau=met["tau"], acc_hits=met["hits"],
                 acc_count=met["count"], weighted_slots=int((step.w > 0).sum()),
                 selector_rows=dict(trained=len(step.sel_rows), target_in_topk=met["rows_in"],
                                    injected=met["rows_injected"], dropped=met["rows_dropped"]),
                 sel_in_topk=met["sel_in_topk"], sel_hits=met["sel_hits"], sel_tau=met["sel_tau"],
                 min_argmax_margin=met["min_margin"], min_topk_margin=met["min_topk_margin"],
                 min_selector_margin=met["min_selector_margin"],
                 grads={"grad." + n: list(s) for n, s in specs}),
        self_checks=checks,
    )


def write_manifest(manifest, entries, names, manifest_path):
    manifest["generator"] = GEN
    manifest["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "dflash": _zlab_version()}
    manifest["conventions"] = {
        "drafter": "drafter/config.json + drafter/model.safetensors: the DFlash2 serving format "
                   "(shared/reference/dflash2.md §6), BF16: the DFlash keys plus layers.{l}.{attention,mlp}_conv."
                   "{base_kernel [2, Kc, D], kernel_projection.weight [2*Kc*D/G, D]} and candidate_selector."
                   "{predecessor_codebook, successor_codebook} [V, R] (no .weight), candidate_selector."
                   "hidden_projection.weight [R, D]; config architectures [DFlash2DraftModel], dflash_config "
                   "{block_size, target_layer_ids, mask_token_id, conv_kernel_size, conv_group_size, "
                   "selector_rank, selector_top_k}",
        "batch": "batch.safetensors as the DFlash fixtures: input_ids, cu_seqlens, loss_mask, anchors I32; "
                 "target_hidden [T, n_taps*D], embed_tokens [V, D], lm_head [V, D] in F32 or BF16 (per fixture)",
        "ref": "ref.safetensors: F64 loss, loss_unary, loss_selector [1]; F64 grad.<name> (parameter shape) for "
               "every parameter; F64 tau [1]; I32 acc_hits, acc_count [block_size]; I32 sel_in_topk, sel_hits "
               "[block_size]; F64 sel_tau [1]; metadata gamma, selector_alpha, selector_miss, torch, generator, "
               "weight_sum, selector_weight_sum, n_blocks, min_margin, min_topk_margin, min_selector_margin",
        "loss": "loss = unary + alpha * selector; unary = sum w*CE / sum w over the trained slots (full "
                "vocabulary); selector = sum w*CE_K / sum w over the trained slots in the selector term (0 when "
                "none); candidates = the unary top-K (no gradient through the choice); score(c) = z[c] + "
                "sum_r P[pred, r] (h W_h^T)_r S[c, r], pred = the true token of the previous slot (slot 1: the "
                "anchor token); target outside the top-K: inject (the K-th candidate replaced by the target, "
                "label K-1) or drop (the slot leaves the selector term)",
        "conv": "block rows only; delta = u W_p^T as [rows, 2, Kc, D/G] from the sublayer input u; u' = sum_{t <= "
                "min(Kc-1, slot)} (base[0,t,c] + delta[i,0,t,c//G]) u[i-t,c]; the sublayer runs on u' (queries "
                "and block keys/values; context keys/values from ctx unconvolved); o = the same with side 1 on "
                "the sublayer output; x += o",
        "metrics": "tau, acc as the DFlash fixtures (unary argmax); sel_in_topk[k]: trained slots k with the "
                   "target in the unary top-K; sel_hits[k]: of those, the ones whose selector argmax (teacher-"
                   "forced predecessor, pure top-K set) is the target; sel_tau: mean over blocks of 1 + the "
                   "leading run of slots k = 1, 2, ... counted in sel_hits",
        "tolerances": {"finite_differences_rel": {f"{h:.0e}": t for h, t in FD_TOL.items()},
                       "zlab_conv_and_scores_rel": ZLAB_TOL, "zlab_model_rel": ZLAB_MODEL_TOL,
                       "permutation_loss_rel": PERM_TOL, "permutation_grad_rel": PERM_GRAD_TOL,
                       "min_margins": MIN_MARGIN},
    }
    manifest["fixtures"] = [entries[n] for n in names if n in entries]
    manifest["total_bytes"] = sum(e.get("bytes", 0) for e in manifest["fixtures"])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"wrote {manifest_path} ({manifest['total_bytes']} bytes of fixtures)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "fixtures", "drafter2"),
                    help="where the fixtures go (default: tests/fixtures/drafter2)")
    ap.add_argument("--only", action="append", default=[], help="build only this fixture (repeatable)")
    ap.add_argument("--verify", action="store_true",
                    help="rebuild into a temporary directory and compare with what --out-dir holds")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    names = [f["name"] for f in FIXTURES]
    for n in args.only:
        if n not in names:
            fail(f"unknown fixture '{n}'; known: {', '.join(names)}")
    selected = [f for f in FIXTURES if not args.only or f["name"] in args.only]
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")

    if args.verify:
        with tempfile.TemporaryDirectory() as tmp:
            for fx in selected:
                make_fixture(fx, os.path.join(tmp, fx["name"]))
            bad = d1.verify(args.out_dir, tmp, [f["name"] for f in selected], meta_keys=DFLASH_KEYS)
        if bad:
            fail("fresh build differs from the committed fixtures:\n  " + "\n  ".join(bad))
        log("verify: fresh build matches the committed fixtures")
        return

    manifest_path = os.path.join(args.out_dir, "manifest.json")
    manifest = {"fixtures": []}
    if args.only and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    entries = {e["name"]: e for e in manifest.get("fixtures", [])}
    for fx in selected:
        fdir = os.path.join(args.out_dir, fx["name"])
        entries[fx["name"]] = d1.finish_summary(make_fixture(fx, fdir), fdir, args.out_dir)
        write_manifest(manifest, entries, names, manifest_path)     # after each fixture: a stop keeps it


def _zlab_version():
    try:
        from importlib.metadata import version
        return version("dflash")
    except Exception:
        return None


if __name__ == "__main__":
    main()
