#!/usr/bin/env python3
"""tests/oracle/make_drafter_fixtures.py — float64 PyTorch oracle for one DFlash drafter training step.

Written from docs/drafter.md (packed-batch rules, visibility, labels, weights) and its serving format
(serving format), not from the C code. Builds tiny random drafters and packed batches (seeded), saves them in the
serving format plus the `grad` batch format of docs/checks.md, reads the SAVED files back as float64, runs the forward
with an explicit dense boolean mask and autograd, and writes tests/fixtures/drafter/<name>/{drafter/, batch.
safetensors, ref.safetensors} and manifest.json. See tests/oracle/README.md for how to run it and what each
fixture covers.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEN = "tests/oracle/make_drafter_fixtures.py"
FULL, SLIDE = "full_attention", "sliding_attention"
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}     # docs/drafter.md

# Each fixture: drafter shape, packing (document lengths in pack order; `prompt` = fraction of each document
# whose loss_mask is 0 at its start, then `holes` = probability of a 0 inside the rest), anchors (`n_anchors`
# in all: forced ones — `at_start` documents whose first token is a candidate and gets an anchor, `near_end`
# offsets from each document's end (the nearest candidate at or before), `off_rule` anchors that break the
# candidate rule — then random candidates of the docs/drafter.md rule drawn without replacement), the dtype of target_hidden/embed/lm_head, and `hits`
# (how many blocks get their leading labels set to the model's own argmax, so that tau and the accuracies are
# not trivially 1 and 0).
FIXTURES = [
    dict(
        name="b16_sw5_full_gqa2",
        about="block 16, layers [sliding W=5, full]: on the sliding layer slots k >= 5 see no context at all and "
              "slot k sees its own slots k-4 .. k (the window bounds block slots too); GQA 4 q / 2 kv heads x 8; 2 taps [1, 3] of 6; 4 documents "
              "17, 90, 1, 40; F32 batch; gamma 7 (default for 16)",
        seed=5101, D=32, V=96, I=64, nq=4, nkv=2, hd=8, layer_types=[SLIDE, FULL], window=5, B=16,
        Lt=6, taps=[1, 3], mask_token_id=90, theta=10000.0, eps=1e-6,
        docs=[17, 90, 1, 40], prompt=[0.0, 0.3, 0.0, 0.0], holes=0.1,
        n_anchors=30, near_end=[2, 3, 6], at_start=[0, 3], off_rule=[], dtype="f32", gamma=None, hits=10,
    ),
    dict(
        name="b8_full_sw9_sw9_gqa3",
        about="block 8, layers [full, sliding W=9, sliding W=9] (the window cuts context for every slot and "
              "reaches past document starts), GQA 6 q / 2 kv heads x 8 (q width 48 = D), 3 taps [1, 3, 5] of "
              "8; 5 documents 40, 90, 17, 1, 120 (T 268), 48 anchors; F32 batch; gamma 4 (default for 8)",
        seed=5202, D=48, V=128, I=64, nq=6, nkv=2, hd=8, layer_types=[FULL, SLIDE, SLIDE], window=9, B=8,
        Lt=8, taps=[1, 3, 5], mask_token_id=3, theta=1e6, eps=1e-6,
        docs=[40, 90, 17, 1, 120], prompt=[0.2, 0.0, 0.3, 0.0, 0.0], holes=0.12,
        n_anchors=48, near_end=[2, 4], at_start=[1, 4], off_rule=[], dtype="f32", gamma=None, hits=16,
    ),
    dict(
        name="b16_full_sw9_full_mha_bf16",
        about="BF16 target_hidden, embed_tokens and lm_head; block 16, layers [full, sliding W=9, full], no GQA "
              "(2 q = 2 kv heads x 16), head_dim 16, 3 taps [1, 2, 3] of 6; 5 documents 90, 1, 40, 17, 60; "
              "rms_norm_eps 1e-5; gamma 7",
        seed=5303, D=32, V=64, I=48, nq=2, nkv=2, hd=16, layer_types=[FULL, SLIDE, FULL], window=9, B=16,
        Lt=6, taps=[1, 2, 3], mask_token_id=63, theta=10000.0, eps=1e-5,
        docs=[90, 1, 40, 17, 60], prompt=[0.25, 0.0, 0.0, 0.2, 0.3], holes=0.1,
        n_anchors=36, near_end=[2, 5], at_start=[2], off_rule=[], dtype="bf16", gamma=None, hits=10,
    ),
    dict(
        name="b8_sw5_sw5_full_mha_offrule",
        about="anchors that break the sampling rule (a document's last token: every label outside; the single "
              "token of a length-1 document; a loss_mask-0 prompt token; a token whose successor has "
              "loss_mask 0), accepted by the grad interface; block 8, layers [sliding W=5, sliding W=5, full], "
              "no GQA (4 = 4 heads x 8, q width 32 < D 40), 2 taps [1, 2] of 5; documents 1, 17, 40, 90; "
              "non-default gamma 2.5",
        seed=5404, D=40, V=80, I=64, nq=4, nkv=4, hd=8, layer_types=[SLIDE, SLIDE, FULL], window=5, B=8,
        Lt=5, taps=[1, 2], mask_token_id=79, theta=10000.0, eps=1e-6,
        docs=[1, 17, 40, 90], prompt=[0.0, 0.0, 0.25, 0.2], holes=0.15,
        n_anchors=28, near_end=[3], at_start=[1], off_rule=["doc_last:1", "doc_last:0", "prompt:3",
                                                            "next_masked:2"],
        dtype="f32", gamma=2.5, hits=8,
    ),
    dict(
        name="b16_sw7_full_sw7_gqa2_long",
        about="the largest pack: T 298 in 5 documents 90, 40, 1, 17, 150, 64 anchors (blocks overlap heavily), "
              "block 16, layers [sliding W=7, full, sliding W=7], GQA 4 q / 2 kv heads x 16 (q width 64 > D 40), "
              "3 taps [1, 4, 7] of 10; F32 batch; gamma 7",
        seed=5505, D=40, V=112, I=56, nq=4, nkv=2, hd=16, layer_types=[SLIDE, FULL, SLIDE], window=7, B=16,
        Lt=10, taps=[1, 4, 7], mask_token_id=0, theta=1e6, eps=1e-6,
        docs=[90, 40, 1, 17, 150], prompt=[0.2, 0.0, 0.0, 0.0, 0.3], holes=0.1,
        n_anchors=64, near_end=[2, 3, 7], at_start=[1, 3], off_rule=[], dtype="f32", gamma=None, hits=20,
    ),
    dict(
        name="b8_sw3_sw3_full_noncausal",
        about="is_causal false (every layer sees its whole block), layers [sliding W=3, sliding W=3, full], "
              "block 8: on the sliding layers slot k sees block slots s with |k - s| < 3 in both directions "
              "and context rows >= a + k - 2; GQA 4 q / 2 kv heads x 8; 2 taps [1, 3] of 5; 4 documents "
              "30, 1, 60, 17; F32 batch; gamma 4",
        seed=5606, D=32, V=88, I=48, nq=4, nkv=2, hd=8, layer_types=[SLIDE, SLIDE, FULL], window=3, B=8,
        Lt=5, taps=[1, 3], mask_token_id=87, theta=1e7, eps=1e-6, is_causal=False,
        docs=[30, 1, 60, 17], prompt=[0.0, 0.0, 0.0, 0.3], holes=0.1,
        n_anchors=24, near_end=[2, 4], at_start=[0, 2], off_rule=[], dtype="f32", gamma=None, hits=8,
    ),
    dict(
        name="b16_sw11_sw11_noncausal_bf16",
        about="the published DFlash2 attention layout in miniature: is_causal false, every layer sliding "
              "(W=11 < B=16, so the window cuts block slots both ways and the context), BF16 target_hidden, "
              "embed_tokens and lm_head; no GQA (2 = 2 heads x 16); 3 taps [0, 2, 4] of 6; 3 documents 70, 9, "
              "45; gamma 7",
        seed=5707, D=32, V=72, I=40, nq=2, nkv=2, hd=16, layer_types=[SLIDE, SLIDE], window=11, B=16,
        Lt=6, taps=[0, 2, 4], mask_token_id=5, theta=1e7, eps=1e-6, is_causal=False,
        docs=[70, 9, 45], prompt=[0.2, 0.0, 0.25], holes=0.1,
        n_anchors=20, near_end=[2, 3], at_start=[1], off_rule=[], dtype="bf16", gamma=None, hits=6,
    ),
]

FD_COORDS = 3           # finite-difference coordinates per parameter
FD_TOL = 1e-6           # |fd - autograd| / max(|autograd|, 1e-3 * max |grad of that parameter|)
MASK_TOL = 0            # loop mask == vectorised mask exactly
PERM_TOL = 1e-12        # loss invariant to the document order, relative
PERM_GRAD_TOL = 1e-10   # gradients too, relative to the largest entry
HF_TOL = 2e-5           # vs transformers' Qwen3, which computes RMSNorm and the RoPE angles in fp32 (positions < 200)
MIN_MARGIN = 1e-4       # top-1 minus top-2 logit on every weighted slot, so an fp32 argmax agrees


def log(msg):
    print(msg, flush=True)


def fail(msg):
    raise SystemExit("make_drafter_fixtures: " + msg)


# --------------------------------------------------------------------------------------------------------------
# Drafter: config and weights in the serving format (docs/drafter.md, docs/formats.md)
# --------------------------------------------------------------------------------------------------------------

def param_specs(fx):
    """(name, shape, kind) in the serving-key order; kind is 'norm' or the matrix's fan-in."""
    D, I, nq, nkv, hd = fx["D"], fx["I"], fx["nq"], fx["nkv"], fx["hd"]
    n = len(fx["taps"])
    specs = [("fc.weight", (D, n * D)), ("hidden_norm.weight", (D,)), ("norm.weight", (D,))]
    for l in range(len(fx["layer_types"])):
        p = f"layers.{l}."
        specs += [
            (p + "input_layernorm.weight", (D,)),
            (p + "post_attention_layernorm.weight", (D,)),
            (p + "self_attn.q_proj.weight", (nq * hd, D)),
            (p + "self_attn.k_proj.weight", (nkv * hd, D)),
            (p + "self_attn.v_proj.weight", (nkv * hd, D)),
            (p + "self_attn.o_proj.weight", (D, nq * hd)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "mlp.gate_proj.weight", (I, D)),
            (p + "mlp.up_proj.weight", (I, D)),
            (p + "mlp.down_proj.weight", (D, I)),
        ]
    return specs


def config_dict(fx):
    B = fx["B"]
    has_sliding = SLIDE in fx["layer_types"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": B,
        "num_target_layers": fx["Lt"],
        "dflash_config": {"mask_token_id": fx["mask_token_id"], "target_layer_ids": list(fx["taps"]),
                          "block_size": B},
        "hidden_size": fx["D"],
        "intermediate_size": fx["I"],
        "num_hidden_layers": len(fx["layer_types"]),
        "num_attention_heads": fx["nq"],
        "num_key_value_heads": fx["nkv"],
        "head_dim": fx["hd"],
        "hidden_act": "silu",
        "rms_norm_eps": fx["eps"],
        "rope_theta": fx["theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "layer_types": list(fx["layer_types"]),
        "use_sliding_window": has_sliding,
        "sliding_window": fx["window"] if has_sliding else None,
        **({"is_causal": fx["is_causal"]} if fx.get("is_causal") is not None else {}),
        "tie_word_embeddings": False,
        "vocab_size": fx["V"],
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    }


def check_config_with_transformers(cfg):
    """The config must also be a valid transformers Qwen3Config with the same meaning."""
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    want = dict(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                layer_types=cfg["layer_types"], tie_word_embeddings=False, attention_bias=False)
    for k, v in want.items():
        if getattr(hf, k) != v:
            fail(f"transformers reads {k} = {getattr(hf, k)!r} from the config, expected {v!r}")
    if SLIDE in cfg["layer_types"] and hf.sliding_window != cfg["sliding_window"]:
        fail(f"transformers reads sliding_window = {hf.sliding_window}, expected {cfg['sliding_window']}")


def random_weights(fx, gen):
    """Matrices N(0, 1/fan_in) (= 0.02·k with k = 50/sqrt(fan_in)), norm weights 1 + 0.1·randn; bf16."""
    out = {}
    for name, shape in param_specs(fx):
        if len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            w = torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(shape[1])
        out[name] = w.to(torch.bfloat16).contiguous()
    return out


# --------------------------------------------------------------------------------------------------------------
# Packed batch (docs/drafter.md, docs/checks.md)
# --------------------------------------------------------------------------------------------------------------

def doc_tables(cu):
    T = cu[-1]
    doc_of, start_of = [0] * T, [0] * T
    for d in range(len(cu) - 1):
        for p in range(cu[d], cu[d + 1]):
            doc_of[p], start_of[p] = d, cu[d]
    return doc_of, start_of


def is_candidate(p, cu, doc_of, loss_mask):
    """docs/drafter.md anchor rule: loss_mask[p] = 1 and p + 1 in the same document with loss_mask[p + 1] = 1."""
    T = cu[-1]
    return loss_mask[p] == 1 and p + 1 < T and doc_of[p + 1] == doc_of[p] and loss_mask[p + 1] == 1


def make_loss_mask(fx, cu, gen):
    T = cu[-1]
    m = [0] * T
    for d, n in enumerate(fx["docs"]):
        s = cu[d]
        prompt = int(round(fx["prompt"][d] * n))
        for i in range(n):
            if i < prompt:
                continue
            hole = torch.rand((), generator=gen).item() < fx["holes"]
            m[s + i] = 0 if (hole and i > prompt + 1) else 1
    return m


def pick_anchors(fx, cu, doc_of, loss_mask, gen):
    """Forced anchors (document starts, near document ends, off-rule ones), then random candidates drawn without
    replacement; sorted. Returns the anchors and the list of the off-rule ones."""
    T = cu[-1]
    cands = [p for p in range(T) if is_candidate(p, cu, doc_of, loss_mask)]
    chosen = set()
    for d in fx["at_start"]:
        s = cu[d]
        if not is_candidate(s, cu, doc_of, loss_mask):
            fail(f"{fx['name']}: the first token of document {d} is not an anchor candidate; fix 'prompt'/seed")
        chosen.add(s)
    for d in range(len(fx["docs"])):
        for off in fx["near_end"]:
            # the candidate nearest to end - off (at or before it): labels from slot off on fall outside
            p = cu[d + 1] - off
            while p >= cu[d] and not is_candidate(p, cu, doc_of, loss_mask):
                p -= 1
            if p >= cu[d]:
                chosen.add(p)
    off_rule = []
    for spec in fx["off_rule"]:
        kind, d = spec.split(":")
        d = int(d)
        s, e = cu[d], cu[d + 1]
        if kind == "doc_last":
            p = e - 1
        elif kind == "prompt":
            p = next((q for q in range(s, e) if loss_mask[q] == 0), None)
        elif kind == "next_masked":
            p = next((q for q in range(s, e - 1) if loss_mask[q] == 1 and loss_mask[q + 1] == 0), None)
        else:
            fail(f"unknown off-rule anchor kind '{kind}'")
        if p is None:
            fail(f"{fx['name']}: document {d} has no position for the off-rule anchor '{spec}'; change the seed")
        if is_candidate(p, cu, doc_of, loss_mask):
            fail(f"{fx['name']}: off-rule anchor {spec} at {p} is a candidate after all")
        chosen.add(p)
        off_rule.append(p)
    rest = [p for p in cands if p not in chosen]
    order = torch.randperm(len(rest), generator=gen).tolist()
    if len(chosen) > fx["n_anchors"] or len(chosen) + len(rest) < fx["n_anchors"]:
        fail(f"{fx['name']}: {len(chosen)} forced anchors and {len(rest)} other candidates cannot make "
             f"{fx['n_anchors']} anchors")
    for i in order[: fx["n_anchors"] - len(chosen)]:
        chosen.add(rest[i])
    anchors = sorted(chosen)
    return anchors, sorted(off_rule)


def make_batch(fx, gen):
    docs = fx["docs"]
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    T = cu[-1]
    V, D, n = fx["V"], fx["D"], len(fx["taps"])
    ids = torch.randint(0, V - 1, (T,), generator=gen, dtype=torch.int64)
    ids = torch.where(ids >= fx["mask_token_id"], ids + 1, ids)     # never the mask token itself
    loss_mask = make_loss_mask(fx, cu, gen)
    doc_of, _ = doc_tables(cu)
    anchors, off_rule = pick_anchors(fx, cu, doc_of, loss_mask, gen)
    dt = torch.bfloat16 if fx["dtype"] == "bf16" else torch.float32
    hidden = torch.randn((T, n * D), generator=gen, dtype=torch.float32).to(dt)
    embed = torch.randn((V, D), generator=gen, dtype=torch.float32).to(dt)
    lm_head = (torch.randn((V, D), generator=gen, dtype=torch.float32) * (2.0 / math.sqrt(D))).to(dt)
    return {
        "input_ids": ids.to(torch.int32),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int32),
        "target_hidden": hidden.contiguous(),
        "anchors": torch.tensor(anchors, dtype=torch.int32),
        "embed_tokens": embed.contiguous(),
        "lm_head": lm_head.contiguous(),
    }, off_rule


# --------------------------------------------------------------------------------------------------------------
# The step in float64 (docs/drafter.md)
# --------------------------------------------------------------------------------------------------------------

_MASKS = {}


def layer_causal(fx, lt):
    """Is a layer of type lt causal within the block? The top-level is_causal where given, else sliding."""
    return fx["is_causal"] if fx.get("is_causal") is not None else lt == SLIDE


def loop_mask(cu, anchors, B, sliding, W, causal):
    """Dense visibility [n_blocks·B, T + n_blocks·B] from the rules, one entry at a time (memoised)."""
    key = (tuple(cu), tuple(anchors), B, sliding, W, causal)
    if key not in _MASKS:
        _MASKS[key] = build_loop_mask(cu, anchors, B, sliding, W, causal)
    return _MASKS[key]


def build_loop_mask(cu, anchors, B, sliding, W, causal):
    T = cu[-1]
    doc_of, _ = doc_tables(cu)
    nb = len(anchors)
    rows = []
    for j, a in enumerate(anchors):
        for k in range(B):
            row = [False] * (T + nb * B)
            for p in range(T):
                vis = doc_of[p] == doc_of[a] and p < a
                if sliding:
                    vis = vis and p >= a + k - (W - 1)
                row[p] = vis
            for jj in range(nb):
                for kk in range(B):
                    # the window bounds every key by position, the block's own slots too (both
                    # directions; a causal layer sees only kk <= k anyway)
                    row[T + jj * B + kk] = (jj == j and (not causal or kk <= k)
                                            and (not sliding or abs(kk - k) < W))
            if not any(row):
                fail(f"query (block {j}, slot {k}) sees nothing")
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(nb * B, T + nb * B)


def vector_mask(cu, anchors, B, sliding, W, causal):
    """The same mask with broadcast tensor ops (an independent second implementation)."""
    cu_t = torch.tensor(cu)
    T = int(cu_t[-1])
    doc = torch.bucketize(torch.arange(T), cu_t[1:], right=True)
    a = torch.tensor(anchors).repeat_interleave(B)            # anchor of every query row
    qk = torch.arange(B).repeat(len(anchors))                 # slot of every query row
    qj = torch.arange(len(anchors)).repeat_interleave(B)      # block of every query row
    p = torch.arange(T)
    ctx = (doc[None, :] == doc[a][:, None]) & (p[None, :] < a[:, None])
    if sliding:
        ctx &= p[None, :] >= (a + qk - (W - 1))[:, None]
    blk = qj[:, None] == qj[None, :]
    if causal:
        blk &= qk[None, :] <= qk[:, None]
    if sliding:
        blk &= (qk[None, :] - qk[:, None]).abs() < W
    return torch.cat([ctx, blk], dim=1)


def positions(cu, anchors, B):
    T = cu[-1]
    _, start_of = doc_tables(cu)
    ctx = [p - start_of[p] for p in range(T)]
    blk = [a - start_of[a] + k for a in anchors for k in range(B)]
    return torch.tensor(ctx, dtype=torch.float64), torch.tensor(blk, dtype=torch.float64)


def labels_weights(cu, ids, loss_mask, anchors, B, gamma):
    """Slot k >= 1 of block j: label ids[a_j + k], weight exp(-(k-1)/gamma) when a_j + k is in a_j's document
    and loss_mask[a_j + k] = 1, else 0 (label then set to -1); slot 0 never trained."""
    T = cu[-1]
    doc_of, _ = doc_tables(cu)
    lab, w = [], []
    for a in anchors:
        for k in range(B):
            p = a + k
            ok = k >= 1 and p < T and doc_of[p] == doc_of[a] and loss_mask[p] == 1
            lab.append(ids[p] if ok else -1)
            w.append(math.exp(-(k - 1) / gamma) if ok else 0.0)
    return torch.tensor(lab, dtype=torch.int64), torch.tensor(w, dtype=torch.float64)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(pos, hd, theta):
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)     # theta^(-2i/hd)
    f = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rope(x, cos, sin):
    """NeoX half-split over the full head dim; x [rows, heads, hd], cos/sin [rows, hd]."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class Step:
    """Everything about one batch that does not depend on the parameters."""

    def __init__(self, fx, batch, gamma):
        self.fx = fx
        self.cu = batch["cu_seqlens"].tolist()
        self.ids = batch["input_ids"].tolist()
        self.loss_mask = batch["loss_mask"].tolist()
        self.anchors = batch["anchors"].tolist()
        B, W = fx["B"], fx["window"]
        self.T, self.nb = self.cu[-1], len(self.anchors)
        self.F = batch["target_hidden"].to(torch.float64)
        self.embed = batch["embed_tokens"].to(torch.float64)
        self.lm_head = batch["lm_head"].to(torch.float64)
        # one mask per (layer type, causal) that occurs, and the full bidirectional one that
        # check_masks measures the window's cut against
        self.masks = {(FULL, False): loop_mask(self.cu, self.anchors, B, False, W, False)}
        for lt in fx["layer_types"]:
            key = (lt, layer_causal(fx, lt))
            if key not in self.masks:
                self.masks[key] = loop_mask(self.cu, self.anchors, B, lt == SLIDE, W, key[1])
        pos_ctx, pos_blk = positions(self.cu, self.anchors, B)
        self.pos_blk = pos_blk
        self.cos_q, self.sin_q = rope_tables(pos_blk, fx["hd"], fx["theta"])
        self.cos_k, self.sin_k = rope_tables(torch.cat([pos_ctx, pos_blk]), fx["hd"], fx["theta"])
        blk_ids = []
        for a in self.anchors:
            blk_ids += [self.ids[a]] + [fx["mask_token_id"]] * (B - 1)
        self.blk_ids = torch.tensor(blk_ids, dtype=torch.int64)
        self.labels, self.w = labels_weights(self.cu, self.ids, self.loss_mask, self.anchors, B, gamma)

    def context(self, P):
        """ctx = hidden_norm(F · fcᵀ) [T, D], shared by every layer."""
        return rms_norm(self.F @ P["fc.weight"].T, P["hidden_norm.weight"], self.fx["eps"])

    def attention(self, P, l, lt, h, ctx):
        """o_proj(block attention) of layer l: queries and block keys/values from the block rows h [Q, D],
        context keys/values from ctx [T, D] (no input norm on ctx)."""
        fx = self.fx
        eps, nq, nkv, hd = fx["eps"], fx["nq"], fx["nkv"], fx["hd"]
        Q, T = h.shape[0], self.T
        p = f"layers.{l}."
        q = (h @ P[p + "self_attn.q_proj.weight"].T).reshape(Q, nq, hd)
        q = rope(rms_norm(q, P[p + "self_attn.q_norm.weight"], eps), self.cos_q, self.sin_q)
        kv_in = torch.cat([ctx, h], dim=0)
        k = (kv_in @ P[p + "self_attn.k_proj.weight"].T).reshape(T + Q, nkv, hd)
        k = rope(rms_norm(k, P[p + "self_attn.k_norm.weight"], eps), self.cos_k, self.sin_k)
        v = (kv_in @ P[p + "self_attn.v_proj.weight"].T).reshape(T + Q, nkv, hd)
        group = nq // nkv
        k = k.repeat_interleave(group, dim=1)        # q head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        s = s.masked_fill(~self.masks[(lt, layer_causal(fx, lt))][None, :, :], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(Q, nq * hd)
        return attn @ P[p + "self_attn.o_proj.weight"].T

    def mlp(self, P, l, m):
        """down(silu(gate(m)) · up(m)) of layer l."""
        p = f"layers.{l}."
        g, u = m @ P[p + "mlp.gate_proj.weight"].T, m @ P[p + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T

    def logits(self, P):
        fx = self.fx
        eps = fx["eps"]
        ctx = self.context(P)
        x = self.embed[self.blk_ids]
        for l, lt in enumerate(fx["layer_types"]):
            p = f"layers.{l}."
            h = rms_norm(x, P[p + "input_layernorm.weight"], eps)
            x = x + self.attention(P, l, lt, h, ctx)
            m = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
            x = x + self.mlp(P, l, m)
        return rms_norm(x, P["norm.weight"], eps) @ self.lm_head.T

    def loss(self, P, logits=None):
        if logits is None:
            logits = self.logits(P)
        sel = self.w > 0
        ce = torch.nn.functional.cross_entropy(logits[sel], self.labels[sel], reduction="none")
        return (self.w[sel] * ce).sum() / self.w[sel].sum()

    def metrics(self, logits):
        """acc_hits/acc_count per slot over weighted slots, tau = mean over blocks of 1 + the leading run of
        slots k = 1, 2, ... with argmax == label (a weight-0 slot ends the run), min top-1/top-2 margin."""
        B = self.fx["B"]
        pred = logits.argmax(-1).reshape(self.nb, B)
        top2 = logits.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).reshape(self.nb, B)
        lab, w = self.labels.reshape(self.nb, B), self.w.reshape(self.nb, B)
        hits, count = [0] * B, [0] * B
        runs = []
        min_margin = math.inf
        for j in range(self.nb):
            run, going = 0, True
            for k in range(1, B):
                live = w[j, k] > 0
                ok = live and pred[j, k].item() == lab[j, k].item()
                if live:
                    count[k] += 1
                    hits[k] += int(ok)
                    min_margin = min(min_margin, margin[j, k].item())
                if going and ok:
                    run += 1
                else:
                    going = False
            runs.append(run)
        tau = sum(1 + r for r in runs) / len(runs)
        return dict(tau=tau, hits=hits, count=count, runs=runs, min_margin=min_margin, pred=pred)


def read_params(drafter_dir):
    with safe_open(os.path.join(drafter_dir, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k).to(torch.float64) for k in f.keys()}


def grads(step, P):
    leaf = {k: v.clone().requires_grad_(True) for k, v in P.items()}
    logits = step.logits(leaf)
    loss = step.loss(leaf, logits)
    names = list(leaf)
    g = torch.autograd.grad(loss, [leaf[k] for k in names])
    return loss.detach(), {k: gi.detach() for k, gi in zip(names, g)}, logits.detach()


# --------------------------------------------------------------------------------------------------------------
# Self-checks
# --------------------------------------------------------------------------------------------------------------

def check_masks(step):
    fx, worst = step.fx, 0
    for (lt, causal), m in step.masks.items():
        vm = vector_mask(step.cu, step.anchors, fx["B"], lt == SLIDE, fx["window"], causal)
        diff = int((vm != m).sum())
        if diff > MASK_TOL:
            fail(f"{fx['name']}: loop and vectorised {lt} (causal {causal}) masks differ in {diff} entries")
        worst = max(worst, diff)
    cut = cut_blk = 0
    full = step.masks[(FULL, False)]
    for (lt, causal), m in step.masks.items():
        if lt != SLIDE:
            continue
        cut = int((full[:, :step.T] & ~m[:, :step.T]).sum())
        if cut == 0:
            fail(f"{fx['name']}: the sliding window never hides a context row; make it smaller")
        # block slots the window hides beyond what causality hides
        own = loop_mask(step.cu, step.anchors, fx["B"], False, fx["window"], causal)  # memoised
        cut_blk = int((own[:, step.T:] & ~m[:, step.T:]).sum())
        if fx["window"] < fx["B"] and cut_blk == 0:
            fail(f"{fx['name']}: W < B but the window hides no block slot")
    zl = check_masks_against_zlab(step)
    log(f"    self-check loop mask == vectorised mask: {sum(int(m.numel()) for m in step.masks.values())} "
        f"entries equal; the window hides {cut} context entries and {cut_blk} block-slot entries; z-lab's "
        f"_attention_mask differs in {zl} entries")
    return dict(mask_entries_differing=worst, window_hidden_context_entries=cut,
                window_hidden_block_entries=cut_blk, zlab_mask_entries_differing=zl)


def check_masks_against_zlab(step):
    """Every block's rows of every layer's mask against z-lab's decoder (dflash.model._attention_mask, the
    mask its DFlashDraftModel applies at inference): keys = the anchor's document before the anchor, then the
    block; queries = the block. An outside implementation of the same rule; entries differing must be 0."""
    try:
        from dflash.model import _attention_mask
    except ImportError as e:
        fail(f"z-lab's dflash package is needed for the mask cross-check (pip install --no-deps dflash==0.1.0): {e}")
    fx, B, T = step.fx, step.fx["B"], step.T
    _, start_of = doc_tables(step.cu)
    bad = 0
    for (lt, causal), m in step.masks.items():
        W = fx["window"] if lt == SLIDE else None
        for j, a in enumerate(step.anchors):
            lo = start_of[a]
            q = torch.zeros(1, 1, B, 1)
            k = torch.zeros(1, 1, (a - lo) + B, 1)
            z = _attention_mask(q, k, is_causal=causal, sliding_window=W)[0, 0]
            ours = torch.cat([m[j * B:(j + 1) * B, lo:a], m[j * B:(j + 1) * B, T + j * B:T + (j + 1) * B]], dim=1)
            bad += int((z != ours).sum())
            # and nothing outside the document and the own block
            rest = m[j * B:(j + 1) * B].clone()
            rest[:, lo:a] = False
            rest[:, T + j * B:T + (j + 1) * B] = False
            bad += int(rest.sum())
    if bad:
        fail(f"{fx['name']}: our masks differ from z-lab's _attention_mask in {bad} entries")
    return bad


def check_finite_differences(step, P, g, gen):
    """4-point central differences (O(h^4)) on FD_COORDS random coordinates of every parameter."""
    worst, worst_at = 0.0, ""
    h = 1e-4
    with torch.no_grad():
        for name, val in P.items():
            flat = val.reshape(-1)
            gmax = g[name].abs().max().item()
            idx = torch.randperm(flat.numel(), generator=gen)[:FD_COORDS].tolist()
            for i in idx:
                def f(delta):
                    Q = dict(P)
                    t = flat.clone()
                    t[i] += delta
                    Q[name] = t.reshape(val.shape)
                    return step.loss(Q).item()
                fd = (8 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12 * h)
                ad = g[name].reshape(-1)[i].item()
                rel = abs(fd - ad) / max(abs(ad), 1e-3 * gmax, 1e-300)
                if rel > worst:
                    worst, worst_at = rel, f"{name}[{i}]"
                if not rel <= FD_TOL:
                    fail(f"{step.fx['name']}: gradient of {name}[{i}]: autograd {ad:.12e}, finite differences "
                         f"{fd:.12e} (rel {rel:.2e} > {FD_TOL:.0e})")
    log(f"    self-check autograd == finite differences ({FD_COORDS} coords x {len(P)} params): worst rel "
        f"{worst:.2e} at {worst_at} (tol {FD_TOL:.0e})")
    return worst


def permuted_batch(batch, perm):
    """The same documents packed in the order perm, anchors remapped to the new absolute indices."""
    cu = batch["cu_seqlens"].tolist()
    segs = [(cu[d], cu[d + 1]) for d in range(len(cu) - 1)]
    new_start, cu2, pos = {}, [0], 0
    for d in perm:
        new_start[d] = pos
        pos += segs[d][1] - segs[d][0]
        cu2.append(pos)
    order = torch.cat([torch.arange(*segs[d]) for d in perm])
    doc_of, _ = doc_tables(cu)
    anchors = sorted(a - cu[doc_of[a]] + new_start[doc_of[a]] for a in batch["anchors"].tolist())
    out = {k: batch[k][order] for k in ("input_ids", "loss_mask", "target_hidden")}
    out.update(cu_seqlens=torch.tensor(cu2, dtype=torch.int32), anchors=torch.tensor(anchors, dtype=torch.int32),
               embed_tokens=batch["embed_tokens"], lm_head=batch["lm_head"])
    return out


def check_permutation(fx, batch, gamma, P, loss, g, gen):
    nd = len(fx["docs"])
    perm = torch.randperm(nd, generator=gen).tolist()
    if perm == list(range(nd)):
        perm = perm[::-1]
    step2 = Step(fx, permuted_batch(batch, perm), gamma)
    loss2, g2, _ = grads(step2, P)
    rel = abs(loss2.item() - loss.item()) / abs(loss.item())
    if not rel <= PERM_TOL:
        fail(f"{fx['name']}: loss changes when the documents are packed in order {perm}: {loss.item():.17g} vs "
             f"{loss2.item():.17g}")
    grel = max(((g2[k] - g[k]).abs().max() / g[k].abs().max()).item() for k in g)
    if not grel <= PERM_GRAD_TOL:
        fail(f"{fx['name']}: gradients change with the document order {perm} (rel {grel:.2e})")
    log(f"    self-check documents packed as {perm}: loss rel diff {rel:.2e} (tol {PERM_TOL:.0e}), "
        f"gradients {grel:.2e} (tol {PERM_GRAD_TOL:.0e})")
    return dict(order=perm, loss_rel=rel, grad_rel=grel)


def check_building_blocks(step, P):
    """RMSNorm, RoPE (tables and rotation) and the MLP against transformers' Qwen3 modules."""
    fx = step.fx
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((5, fx["D"]), generator=gen, dtype=torch.float64)
    worst = 0.0
    norm = hf_qwen3.Qwen3RMSNorm(fx["D"], eps=fx["eps"]).to(torch.float64)
    with torch.no_grad():
        norm.weight.copy_(P["norm.weight"])
        worst = max(worst, ((norm(x) - rms_norm(x, P["norm.weight"], fx["eps"])).abs().max()).item())
    cfg = Qwen3Config(**{k: v for k, v in config_dict(fx).items() if k not in ("architectures", "model_type")})
    rot = hf_qwen3.Qwen3RotaryEmbedding(cfg)
    pos = step.pos_blk[None, :].to(torch.int64)
    cos, sin = rot(torch.zeros(1, dtype=torch.float64), pos)
    worst = max(worst, (cos[0] - step.cos_q).abs().max().item(), (sin[0] - step.sin_q).abs().max().item())
    q = torch.randn((step.pos_blk.numel(), fx["nq"], fx["hd"]), generator=gen, dtype=torch.float64)
    hq, _ = hf_qwen3.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], step.cos_q[None],
                                          step.sin_q[None])
    e_rot = (hq[0].transpose(0, 1) - rope(q, step.cos_q, step.sin_q)).abs().max().item()
    if e_rot != 0.0:
        fail(f"{fx['name']}: RoPE rotation differs from transformers' apply_rotary_pos_emb by {e_rot:.3e}")
    mlp = hf_qwen3.Qwen3MLP(cfg).to(torch.float64)
    with torch.no_grad():
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.copy_(P[f"layers.0.mlp.{n}.weight"])
        m = rms_norm(x, P["layers.0.post_attention_layernorm.weight"], fx["eps"])
        mine = (torch.nn.functional.silu(m @ P["layers.0.mlp.gate_proj.weight"].T) *
                (m @ P["layers.0.mlp.up_proj.weight"].T)) @ P["layers.0.mlp.down_proj.weight"].T
        e_mlp = (mlp(m) - mine).abs().max().item()
    if e_mlp > 1e-13:
        fail(f"{fx['name']}: the MLP differs from transformers' Qwen3MLP by {e_mlp:.3e}")
    if not worst <= HF_TOL:
        fail(f"{fx['name']}: RMSNorm or the RoPE tables differ from transformers' Qwen3 by {worst:.3e}")
    log(f"    self-check RMSNorm, RoPE tables vs transformers Qwen3 (fp32 inside): {worst:.1e}; "
        f"rotate_half/apply_rotary_pos_emb exact; Qwen3MLP {e_mlp:.1e}")
    return worst


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------

def force_hits(fx, batch, step, logits, gen):
    """Set the labels of the leading slots of some blocks to the model's own argmax (never at an anchor: the
    model's output depends on input_ids only through the anchors' tokens, so the logits stay the same)."""
    B = fx["B"]
    ids = batch["input_ids"].clone()
    pred = logits.argmax(-1).reshape(step.nb, B)
    w = step.w.reshape(step.nb, B)
    anchors = set(step.anchors)
    taken = set()
    blocks = torch.randperm(step.nb, generator=gen).tolist()[: fx["hits"]]
    for j in blocks:
        want = int(torch.randint(1, B, (), generator=gen))
        a = step.anchors[j]
        for k in range(1, want + 1):
            p = a + k
            if w[j, k] == 0 or p in anchors or p in taken:
                break
            ids[p] = int(pred[j, k])
            taken.add(p)
    batch["input_ids"] = ids
    return len(taken)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def dir_files(root):
    out = []
    for d, _, fs in os.walk(root):
        for f in fs:
            out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def make_fixture(fx, fdir):
    name = fx["name"]
    log(f"== {name}: {fx['about']}")
    B = fx["B"]
    gamma = fx["gamma"] if fx["gamma"] is not None else DEFAULT_GAMMA[B]
    gen = torch.Generator().manual_seed(fx["seed"])
    os.makedirs(os.path.join(fdir, "drafter"), exist_ok=True)

    cfg = config_dict(fx)
    check_config_with_transformers(cfg)
    with open(os.path.join(fdir, "drafter", "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(random_weights(fx, gen), os.path.join(fdir, "drafter", "model.safetensors"),
              metadata={"format": "pt"})
    batch, off_rule = make_batch(fx, gen)

    # read the drafter back exactly as stored; keys must be those of docs/drafter.md
    P = read_params(os.path.join(fdir, "drafter"))
    specs = param_specs(fx)
    if sorted(P) != sorted(n for n, _ in specs):
        fail(f"{name}: saved keys {sorted(P)} differ from the serving keys")
    for n, shape in specs:
        if tuple(P[n].shape) != shape:
            fail(f"{name}: {n} has shape {tuple(P[n].shape)}, expected {shape}")
    P = {n: P[n] for n, _ in specs}

    # labels of some blocks := the model's own argmax, so that tau and the accuracies are not trivial
    step0 = Step(fx, batch, gamma)
    with torch.no_grad():
        logits0 = step0.logits(P)
    n_forced = force_hits(fx, batch, step0, logits0, gen)
    save_file(dict(batch), os.path.join(fdir, "batch.safetensors"))
    stored = load_file(os.path.join(fdir, "batch.safetensors"))
    for k in batch:
        if stored[k].dtype != batch[k].dtype or not torch.equal(stored[k], batch[k]):
            fail(f"{name}: batch tensor {k} did not read back as written")

    step = Step(fx, stored, gamma)
    loss, g, logits = grads(step, P)
    if not torch.equal(logits, logits0):
        fail(f"{name}: forcing labels changed the logits (a forced position is an anchor?)")
    met = step.metrics(logits)
    if not met["min_margin"] >= MIN_MARGIN:
        fail(f"{name}: a weighted slot's top-1/top-2 logit margin is {met['min_margin']:.2e} < {MIN_MARGIN:.0e}; "
             f"an fp32 argmax could differ; change the seed")
    wsum = step.w.sum().item()
    nz = [k for k in g if g[k].abs().max().item() == 0.0]
    if nz:
        fail(f"{name}: zero gradients for {nz}")
    log(f"    T {step.T}, {step.nb} anchors ({len(off_rule)} off-rule), sum w {wsum:.6f}, loss {loss.item():.12f}, "
        f"tau {met['tau']:.4f}, hits {sum(met['hits'])}/{sum(met['count'])} ({n_forced} labels forced)")

    checks = dict(masks=check_masks(step))
    checks["finite_differences_worst_rel"] = float(f"{check_finite_differences(step, P, g, gen):.3e}")
    checks["document_permutation"] = check_permutation(fx, stored, gamma, P, loss, g, gen)
    checks["transformers_blocks_max_abs"] = float(f"{check_building_blocks(step, P):.3e}")

    ref = {"loss": loss.reshape(1).to(torch.float64)}
    for n, _ in specs:
        ref["grad." + n] = g[n].to(torch.float64).contiguous()
    ref["tau"] = torch.tensor([met["tau"]], dtype=torch.float64)
    ref["acc_hits"] = torch.tensor(met["hits"], dtype=torch.int32)
    ref["acc_count"] = torch.tensor(met["count"], dtype=torch.int32)
    meta = {"gamma": repr(float(gamma)), "torch": torch.__version__, "generator": GEN,
            "weight_sum": repr(wsum), "n_blocks": str(step.nb), "min_margin": f"{met['min_margin']:.6e}"}
    save_file(ref, os.path.join(fdir, "ref.safetensors"), metadata=meta)

    lt = fx["layer_types"]
    return dict(
        name=name, about=fx["about"], seed=fx["seed"],
        drafter=dict(hidden_size=fx["D"], intermediate_size=fx["I"], vocab_size=fx["V"], num_layers=len(lt),
                     layer_types=lt, sliding_window=fx["window"] if SLIDE in lt else None,
                     is_causal=fx.get("is_causal"), causal_layers=[layer_causal(fx, t) for t in lt],
                     num_attention_heads=fx["nq"], num_key_value_heads=fx["nkv"], head_dim=fx["hd"],
                     block_size=B, mask_token_id=fx["mask_token_id"], num_target_layers=fx["Lt"],
                     target_layer_ids=fx["taps"], rope_theta=fx["theta"], rms_norm_eps=fx["eps"],
                     n_params=sum(v.numel() for v in P.values())),
        batch=dict(T=step.T, seqlens=fx["docs"], cu_seqlens=step.cu, n_anchors=step.nb, anchors=step.anchors,
                   off_rule_anchors=off_rule, loss_mask_zeros=step.loss_mask.count(0),
                   target_hidden=dict(dtype=fx["dtype"].upper(), shape=list(stored["target_hidden"].shape)),
                   embed_lm_head_dtype=fx["dtype"].upper(), forced_labels=n_forced),
        gamma=gamma, gamma_is_default=fx["gamma"] is None,
        ref=dict(loss=loss.item(), weight_sum=wsum, tau=met["tau"], acc_hits=met["hits"], acc_count=met["count"],
                 weighted_slots=int((step.w > 0).sum()), min_argmax_margin=met["min_margin"],
                 grads={"grad." + n: list(s) for n, s in specs}),
        self_checks=checks,
    )


def finish_summary(summary, fdir, root):
    summary["files"] = {f: sha256(os.path.join(fdir, f)) for f in dir_files(fdir)}
    summary["bytes"] = sum(os.path.getsize(os.path.join(fdir, f)) for f in dir_files(fdir))
    summary["dir"] = os.path.relpath(fdir, root)
    return summary


def verify(committed_root, fresh_root, names, meta_keys=("gamma", "n_blocks")):
    """Drafter and batch files bitwise, references to 1e-12 (relative to the largest entry), same metadata."""
    bad = []
    for n in names:
        a, b = os.path.join(committed_root, n), os.path.join(fresh_root, n)
        fa, fb = dir_files(a) if os.path.isdir(a) else [], dir_files(b)
        if fa != fb:
            bad.append(f"{n}: file lists differ: {sorted(set(fa) ^ set(fb))}")
            continue
        for f in fa:
            if f.endswith("ref.safetensors"):
                ra, rb = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
                if sorted(ra) != sorted(rb):
                    bad.append(f"{n}/{f}: tensor names differ")
                    continue
                for k in rb:
                    x, y = ra[k].to(torch.float64), rb[k].to(torch.float64)
                    if x.shape != y.shape or ((x - y).abs().max() / y.abs().max().clamp_min(1e-300)) > 1e-12:
                        bad.append(f"{n}/{f}: {k} differs")
                with safe_open(os.path.join(a, f), "pt") as fa_, safe_open(os.path.join(b, f), "pt") as fb_:
                    ma, mb = fa_.metadata(), fb_.metadata()
                for k in meta_keys:
                    if ma.get(k) != mb.get(k):
                        bad.append(f"{n}/{f}: metadata {k} differs")
            elif sha256(os.path.join(a, f)) != sha256(os.path.join(b, f)):
                bad.append(f"{n}/{f}: bytes differ")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "fixtures", "drafter"),
                    help="where the fixtures go (default: tests/fixtures/drafter)")
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
            bad = verify(args.out_dir, tmp, [f["name"] for f in selected])
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
        if os.path.isdir(fdir):
            shutil.rmtree(fdir)
        entries[fx["name"]] = finish_summary(make_fixture(fx, fdir), fdir, args.out_dir)
    manifest["generator"] = GEN
    manifest["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}
    manifest["conventions"] = {
        "drafter": "drafter/config.json + drafter/model.safetensors: the serving format (docs/drafter.md"
                   "), BF16, keys fc.weight, hidden_norm.weight, norm.weight, layers.{l}.*",
        "batch": "batch.safetensors (docs/checks.md): input_ids, cu_seqlens, loss_mask, anchors I32; target_hidden "
                 "[T, n_taps*D], embed_tokens [V, D], lm_head [V, D] in F32 or BF16 (per fixture)",
        "ref": "ref.safetensors, F64: loss [1], grad.<name> (parameter shape) for every parameter; tau F64 [1]; "
               "acc_hits, acc_count I32 [block_size] (slot 0 always 0); metadata gamma, torch, weight_sum, "
               "n_blocks, min_margin",
        "math": "float64 with autograd, weights/batch read back from the saved files and converted to float64; "
                "explicit dense boolean mask per layer type built with Python loops from docs/drafter.md",
        "tau": "mean over blocks of 1 + the number of leading slots k = 1, 2, ... whose argmax equals the label; "
               "a slot with weight 0 ends the run; acc over slots with weight > 0",
        "tolerances": {"finite_differences_rel": FD_TOL, "permutation_loss_rel": PERM_TOL,
                       "permutation_grad_rel": PERM_GRAD_TOL, "transformers_blocks_abs": HF_TOL,
                       "min_argmax_margin": MIN_MARGIN},
    }
    manifest["fixtures"] = [entries[n] for n in names if n in entries]
    manifest["total_bytes"] = sum(e.get("bytes", 0) for e in manifest["fixtures"])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"wrote {manifest_path} ({manifest['total_bytes']} bytes of fixtures)")


if __name__ == "__main__":
    main()
