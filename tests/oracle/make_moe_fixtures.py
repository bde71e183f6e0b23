#!/usr/bin/env python3
"""tests/oracle/make_moe_fixtures.py — Hugging Face Transformers oracle for the MoE hybrid targets.

Builds tiny random Qwen3.5-MoE (qwen3_5_moe multimodal, qwen3_5_moe_text flat) and Qwen3-Next (qwen3_next) models
with Transformers (seeded), saves them in the real Hugging Face layouts (experts fused as the BF16 Hub checkpoints
hold them, or per expert as the FP8 and Qwen3-Next checkpoints do), loads each SAVED checkpoint back, chooses
input tokens that leave every router a clear top-k (decisive_input), runs it in float64 one packed sequence at
a time on the pure-torch paths and writes float64 references plus the router's choices:
tests/fixtures/target/<name>/{model/, input.safetensors, ref.safetensors}, appended to manifest.json.
It imports make_target_fixtures.py for everything that is not MoE (randomising, dtype policies, loading and its
checks, the float64 promotion of HF's float32 casts, the dtype audit, the packed and padded runs, the gated delta
rule checks). See tests/oracle/README.md for how to run it and what each fixture covers.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen35moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3next

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_target_fixtures as mt  # noqa: E402  (the dense oracle: loading, float64 promotion, packed runs)

REPO = mt.REPO
GENERATOR = "tests/oracle/make_moe_fixtures.py"
LIN, FULL = mt.LIN, mt.FULL

# family -> (modeling module, class prefix of its classes) for mt.family()
FAMILIES = {
    "qwen3_5_moe": (hf_qwen35moe, "Qwen3_5Moe"),
    "qwen3_next": (hf_qwen3next, "Qwen3Next"),
}

FIXTURES = [
    dict(
        name="qwen35moe_mm_fused",
        about="Qwen3.5-MoE BF16 Hub form: multimodal layout (model.language_model.*, tiny model.visual.*) in one "
              "model.safetensors, bf16 with F32 A_log and linear_attn.norm.weight; experts FUSED as the Hub "
              "checkpoints hold them (mlp.experts.gate_up_proj [E, 2I, D] gate rows first, mlp.experts.down_proj "
              "[E, D, I], no .weight suffix; written with save_pretrained(save_original_format=False)); every "
              "layer MoE, E 12, top-3, renormalised; shared expert with sigmoid gate; pattern [lin, full, lin, lin, "
              "lin, full]; GVA nv=3*nk, dk!=dv; partial rotary 0.25 with theta 1e7; untied lm_head",
        family="qwen3_5_moe", layout="multimodal", sharded=False, weights="bf16+f32gdn", experts="fused",
        seed=5033, seqlens=mt.SEQLENS_A,
        text=dict(vocab_size=48, hidden_size=24,
                  layer_types=[LIN, FULL, LIN, LIN, LIN, FULL],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                  rope_theta=1e7, tie_word_embeddings=False,
                  num_experts=12, num_experts_per_tok=3, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24),
    ),
    dict(
        name="qwen35moe_flat_experts",
        about="flat Qwen3_5MoeForCausalLM layout (model_type qwen3_5_moe_text, keys model.layers.*), experts PER "
              "EXPERT (mlp.experts.<e>.{gate,up,down}_proj.weight, as the official FP8 and older checkpoints; "
              "Transformers 5.24's default save_pretrained writes them so, checked against our own split of the "
              "fused tensors), sharded over several files with model.safetensors.index.json; fp32 weights; tied "
              "embeddings (no lm_head.weight); E 8, top-2, renormalised; the default pattern of "
              "full_attention_interval 2 over 4 layers; nv=2*nk with dk<dv; partial rotary 0.5; conv kernel 3",
        family="qwen3_5_moe", layout="flat", sharded=True, max_shard_size=40_000, weights="f32", experts="per-expert",
        seed=6007, seqlens=mt.SEQLENS_B,
        text=dict(vocab_size=32, hidden_size=16, num_hidden_layers=4, full_attention_interval=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_conv_kernel_dim=3, partial_rotary_factor=0.5,
                  rope_theta=10000.0, tie_word_embeddings=True,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                  shared_expert_intermediate_size=20),
    ),
    dict(
        name="qwen3next_flat",
        about="Qwen3-Next form: Qwen3NextForCausalLM (model_type qwen3_next, keys model.layers.*), one "
              "model.safetensors, every tensor bf16; GDN with the fused, per-key-head-group interleaved "
              "linear_attn.in_proj_qkvz and in_proj_ba; experts per expert; decoder_sparse_step 2 and "
              "mlp_only_layers [5]: layers 1 and 3 MoE (E 10, top-4, norm_topk_prob false: NOT renormalised), "
              "layers 0, 2, 4, 5 dense MLP (intermediate_size 40); pattern [lin, lin, lin, full, lin, full]; "
              "nv=2*nk, dk!=dv; plain 1-D partial rotary 0.25 with theta 1e7; untied lm_head",
        family="qwen3_next", layout="flat", sharded=False, weights="bf16", experts="per-expert",
        seed=7020, seqlens=mt.SEQLENS_A,
        text=dict(vocab_size=40, hidden_size=20, intermediate_size=40,
                  layer_types=[LIN, LIN, LIN, FULL, LIN, FULL],
                  num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                  rope_theta=1e7, tie_word_embeddings=False,
                  num_experts=10, num_experts_per_tok=4, moe_intermediate_size=12,
                  shared_expert_intermediate_size=20, norm_topk_prob=False,
                  decoder_sparse_step=2, mlp_only_layers=[5]),
    ),
]

ROUTER_SCALE = 3.0    # router logits ~ N(0, 3^2): softmax top-k well separated (the gaps are checked)
MIN_GAP = 1e-6        # smallest allowed (p_K - p_K+1) / p_K, and between consecutive chosen experts
# Every (token, MoE layer) of the input: the K-th largest router logit exceeds the (K+1)-th by at least this
# (logit units; the logits' spread is ROUTER_SCALE). The input's tokens are chosen for it (decisive_input).
# A bf16 forward moves these logits by a few 1e-2 here, so no close call is left for it to flip.
MIN_LOGIT_GAP = 0.25
TOL_SELF = mt.TOL_SELF
TOL_STOCK = mt.TOL_STOCK
TOL_F32 = 1e-3        # float32 model (HF's grouped_mm experts) vs the float64 reference, relative to max |ref|


def log(msg):
    print(msg, flush=True)


def fail(msg):
    raise SystemExit("make_moe_fixtures: " + msg)


@contextlib.contextmanager
def family_of(fx):
    module, prefix = FAMILIES[fx["family"]]
    with mt.family(module, prefix):
        yield


# --------------------------------------------------------------------------------------------------------------
# Building and saving
# --------------------------------------------------------------------------------------------------------------

def build_config(fx):
    t = mt.text_config_dict(fx)
    if fx["family"] == "qwen3_next":           # plain 1-D RoPE: no mrope fields
        t["rope_parameters"] = {k: v for k, v in t["rope_parameters"].items() if not k.startswith("mrope")}
        return Qwen3NextConfig(**t), Qwen3NextForCausalLM
    if fx["layout"] == "multimodal":
        v = dict(mt.TINY_VISION, out_hidden_size=t["hidden_size"])
        cfg = Qwen3_5MoeConfig(text_config=t, vision_config=v, tie_word_embeddings=t["tie_word_embeddings"])
        return cfg, Qwen3_5MoeForConditionalGeneration
    return Qwen3_5MoeTextConfig(**t), Qwen3_5MoeForCausalLM


def init_moe(mod, randn, rand):
    """mt.randomise's hook for the modules it does not know: router N(0, ROUTER_SCALE^2 / D), experts like
    Linears (N(0, 1/fan_in)). The shared expert and its gate are Linears (randomise does them)."""
    if isinstance(mod, mt.hf_class("TopKRouter")):
        mod.weight.copy_(ROUTER_SCALE * randn(mod.weight.shape) / math.sqrt(mod.hidden_dim))
        return [mod.weight]
    if isinstance(mod, mt.hf_class("Experts")):
        mod.gate_up_proj.copy_(randn(mod.gate_up_proj.shape) / math.sqrt(mod.hidden_dim))
        mod.down_proj.copy_(randn(mod.down_proj.shape) / math.sqrt(mod.intermediate_dim))
        return [mod.gate_up_proj, mod.down_proj]
    return []


EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(sd):
    """Our own fused -> per-expert conversion (what the FP8 / Qwen3-Next / older checkpoints hold):
    X.experts.gate_up_proj [E, 2I, D] -> X.experts.<e>.gate_proj.weight = [e, :I], up_proj.weight = [e, I:];
    X.experts.down_proj [E, D, I] -> X.experts.<e>.down_proj.weight = [e]."""
    out = {}
    for k, t in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            p, half = k[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{p}.{e}.up_proj.weight"] = t[e, half:]
        elif k.endswith(".mlp.experts.down_proj"):
            p = k[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = t[e]
        else:
            out[k] = t
    return out


def fuse_experts(stored):
    """The inverse of split_experts (our own, for the check that the loaded model holds the files' values)."""
    out, groups = {}, {}
    for k, t in stored.items():
        m = EXPERT_KEY.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[k] = t
    for p, g in groups.items():
        n = len(g["down_proj"])
        if any(sorted(g[w]) != list(range(n)) for w in ("gate_proj", "up_proj", "down_proj")):
            fail(f"{p}: the per-expert tensors do not cover experts 0..{n - 1}")
        out[p + ".gate_up_proj"] = torch.stack([torch.cat([g["gate_proj"][e], g["up_proj"][e]], 0) for e in range(n)])
        out[p + ".down_proj"] = torch.stack([g["down_proj"][e] for e in range(n)])
    return out


def build_and_save(fx, model_dir):
    cfg, cls = build_config(fx)
    torch.manual_seed(fx["seed"])          # HF init of everything randomise() does not touch (vision tower)
    model = cls(cfg).eval()
    with family_of(fx):
        mt.randomise(model, fx["seed"], extra=init_moe)
        mt.apply_weight_dtypes(model, fx["weights"])
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    kw = {"max_shard_size": fx["max_shard_size"] if fx["sharded"] else "10GB"}
    if fx["experts"] == "fused":
        # Transformers 5.24's save_pretrained reverts its load-time conversion (qwen2_moe: per-expert -> fused) and
        # so writes per-expert experts by default; without that revert it writes its own (the Hub's BF16) layout
        kw["save_original_format"] = False
    model.save_pretrained(model_dir, **kw)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get_text_config().tie_word_embeddings:
        del sd["lm_head.weight"]
    return cls, sd


def check_expert_layout(fx, model_dir, built):
    """The files hold exactly the built model's tensors, bitwise: in its own keys (fused) or in our per-expert
    split of them."""
    stored = mt.read_checkpoint(model_dir)
    want = built if fx["experts"] == "fused" else split_experts(built)
    if sorted(stored) != sorted(want):
        fail(f"{fx['name']}: saved keys differ from the {fx['experts']} layout: "
             f"{sorted(set(stored) ^ set(want))[:8]}")
    for k, t in want.items():
        if stored[k].dtype != t.dtype or not torch.equal(stored[k], t):
            fail(f"{fx['name']}: saved {k} differs from the built model's tensor")
    keys = [k for k in stored if ".mlp.experts" in k]
    fused = [k for k in keys if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    if fx["experts"] == "fused" and len(fused) != len(keys):
        fail(f"{fx['name']}: non-fused expert keys in a fused checkpoint")
    if fx["experts"] == "per-expert" and fused:
        fail(f"{fx['name']}: fused expert keys in a per-expert checkpoint")
    shapes = {}
    for k in sorted(keys):
        pat = re.sub(r"\.layers\.\d+\.", ".layers.*.", re.sub(r"\.experts\.\d+\.", ".experts.*.", k))
        shapes.setdefault(pat, list(stored[k].shape))
    return shapes


# --------------------------------------------------------------------------------------------------------------
# Routing: capture, gaps, our own MoE block
# --------------------------------------------------------------------------------------------------------------

def moe_layers(model):
    moe = mt.hf_class("SparseMoeBlock")
    return [i for i, layer in enumerate(mt.text_model(model).layers) if isinstance(layer.mlp, moe)]


@contextlib.contextmanager
def route_capture(model):
    """Hooks on every MoE layer's router; yields {layer: [(logits, indices), ...]}, one entry per router call."""
    tm = mt.text_model(model)
    calls = {i: [] for i in moe_layers(model)}
    handles = []

    def hook(i):
        def fn(_mod, _inp, out):
            logits, _scores, idx = out
            calls[i].append((logits.detach(), idx.detach()))
        return fn

    for i in calls:
        handles.append(tm.layers[i].mlp.gate.register_forward_hook(hook(i)))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def packed_routes(calls):
    """{layer: (logits [T, E], indices [T, K])} from a packed run (one router call per sequence)."""
    return {i: (torch.cat([c[0] for c in v]), torch.cat([c[1] for c in v])) for i, v in calls.items()}


def padded_routes(calls, seqlens):
    out = {}
    for i, v in calls.items():
        (logits, idx), = v
        n, lmax = len(seqlens), max(seqlens)
        lg, ix = logits.reshape(n, lmax, -1), idx.reshape(n, lmax, -1)
        out[i] = (torch.cat([lg[s, :L] for s, L in enumerate(seqlens)]),
                  torch.cat([ix[s, :L] for s, L in enumerate(seqlens)]))
    return out


def routing_gaps(routes, k):
    """Smallest relative gap (p_K - p_K+1) / p_K over all tokens and MoE layers, and the smallest gap between
    consecutive chosen experts (p_j - p_j+1) / p_j, j < K, from float64 softmax probabilities; with the number
    of (token, layer) pairs whose gaps are below 1e-3."""
    kth = dict(gap=math.inf, below_1e3=0)
    order = dict(gap=math.inf, below_1e3=0)
    for i, (logits, _) in routes.items():
        p = torch.softmax(logits.double(), -1).sort(-1, descending=True).values
        g = (p[:, k - 1] - p[:, k]) / p[:, k - 1]
        kth["below_1e3"] += int((g < 1e-3).sum())
        t = int(g.argmin())
        if g[t] < kth["gap"]:
            kth.update(gap=float(g[t]), layer=i, token=t)
        if k > 1:
            go = (p[:, : k - 1] - p[:, 1:k]) / p[:, : k - 1]
            order["below_1e3"] += int((go.min(-1).values < 1e-3).sum())
            t, j = divmod(int(go.argmin()), k - 1)
            if go[t, j] < order["gap"]:
                order.update(gap=float(go[t, j]), layer=i, token=t, rank=j)
    return kth, order


def kth_logit_gaps(logits, k):
    """Per row of router logits [N, E]: l_K - l_K+1, l in descending order."""
    lg = logits.double().sort(-1, descending=True).values
    return lg[:, k - 1] - lg[:, k]


def min_logit_gap(routes, k):
    """Smallest l_K - l_K+1 over every token and MoE layer."""
    return min(float(kth_logit_gaps(logits, k).min()) for logits, _ in routes.values())


@torch.no_grad()
def decisive_input(model, fx, top_k):
    """input_ids and cu_seqlens for fx's sequence lengths, the tokens chosen one position at a time (seeded)
    so that every MoE router's top-k is decided by at least MIN_LOGIT_GAP: at position t every token of the
    vocabulary is tried after the sequence's t tokens so far (one batched float64 forward), in a seeded random
    order, and the first whose routing clears the gap at every MoE layer is kept. Causal, so the choices made
    stay valid. Fails when some position has no such token (then lower the gap or change the seed)."""
    gen = torch.Generator().manual_seed(fx["seed"] + 1)
    V = fx["text"]["vocab_size"]
    ids, tried = [], 0
    for L in fx["seqlens"]:
        seq = torch.zeros(0, dtype=torch.long)
        for t in range(L):
            order = torch.randperm(V, generator=gen)
            x = torch.cat([seq.repeat(V, 1), order[:, None]], 1)
            with mt.hf_float64(), route_capture(model) as calls:
                model(input_ids=x, use_cache=False)
            gaps = torch.full((V,), math.inf, dtype=torch.float64)
            for (logits, _), in calls.values():
                gaps = torch.minimum(gaps, kth_logit_gaps(logits.reshape(V, t + 1, -1)[:, -1], top_k))
            ok = (gaps >= MIN_LOGIT_GAP).nonzero().flatten()
            if len(ok) == 0:
                fail(f"{fx['name']}: no token clears a router logit gap of {MIN_LOGIT_GAP} at position {t} of a "
                     f"sequence of {L} (best {float(gaps.max()):.3f})")
            tried += int(ok[0]) + 1
            seq = torch.cat([seq, order[ok[0]].reshape(1)])
        ids.append(seq)
    ids, cu = torch.cat(ids).to(torch.int32), mt.cu_seqlens(fx["seqlens"])
    log(f"    input: {len(ids)} tokens chosen for router logit gaps >= {MIN_LOGIT_GAP}, "
        f"{tried / len(ids):.2f} tried per position")
    return ids, cu


def same_routes(a, b):
    return all(torch.equal(a[i][1], b[i][1]) for i in a)


def naive_moe(block, x, top_k, renorm):
    """Our own float64 sparse MoE block, written from the spec (not HF code): p = softmax(x Wr^T);
    the top_k experts by p, weights p (divided by their sum if renorm);
    y = sum_j w_j down_e(silu(gate_e x) * up_e x) + sigmoid(x . w_sg) * down_s(silu(gate_s x) * up_s x)."""
    h = x.reshape(-1, x.shape[-1]).double()
    p = torch.softmax(h @ block.gate.weight.double().T, -1)
    w, idx = torch.topk(p, top_k, -1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    gu, dn = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    inter = dn.shape[-1]
    y = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            a = gu[e] @ h[t]
            y[t] += w[t, j] * (dn[e] @ (F.silu(a[:inter]) * a[inter:]))
    s = block.shared_expert
    shared = F.linear(F.silu(F.linear(h, s.gate_proj.weight.double())) * F.linear(h, s.up_proj.weight.double()),
                      s.down_proj.weight.double())
    y = y + torch.sigmoid(F.linear(h, block.shared_expert_gate.weight.double())) * shared
    return y.reshape(x.shape)


@contextlib.contextmanager
def moe_spec_check(model, top_k, renorm):
    """Hooks on every MoE block: its output against naive_moe of its input; yields [worst max rel diff]."""
    tm = mt.text_model(model)
    worst = [0.0]
    handles = []

    def fn(mod, inp, out):
        worst[0] = max(worst[0], mt.max_rel(naive_moe(mod, inp[0], top_k, renorm), out))

    for i in moe_layers(model):
        handles.append(tm.layers[i].mlp.register_forward_hook(fn))
    try:
        yield worst
    finally:
        for h in handles:
            h.remove()


def split_qkvz(w_qkvz, w_ba, nk, dk, nv, dv):
    """Our own un-interleaving of Qwen3-Next's fused GDN input projections into Qwen3.5's separate ones.
    in_proj_qkvz [nk * (2 dk + 2 r dv), D], r = nv / nk, is nk key-head groups of rows, group g =
    [q_g (dk) | k_g (dk) | v of v-heads g r .. g r + r - 1 (r dv, head-major) | z of the same heads (r dv)];
    in_proj_ba [nk * 2 r, D] is nk groups of [b of v-heads g r .. g r + r - 1 (r) | a of the same (r)].
    Returns q [nk dk, D], k [nk dk, D], v [nv dv, D], z [nv dv, D], b [nv, D], a [nv, D]; the convolution runs
    over [q | k | v] in this order (conv1d.weight's channels)."""
    r = nv // nk
    g = w_qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k = g[:, :dk].reshape(nk * dk, -1), g[:, dk:2 * dk].reshape(nk * dk, -1)
    v, z = g[:, 2 * dk:2 * dk + r * dv].reshape(nv * dv, -1), g[:, 2 * dk + r * dv:].reshape(nv * dv, -1)
    ba = w_ba.reshape(nk, 2 * r, -1)
    return q, k, v, z, ba[:, :r].reshape(nv, -1), ba[:, r:].reshape(nv, -1)


def check_qkvz_layout(model, seed):
    """HF's fix_query_key_value_ordering == split_qkvz on every GDN layer, for random inputs."""
    worst = 0.0
    gen = torch.Generator().manual_seed(seed + 3)
    for layer in mt.text_model(model).layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        x = torch.randn(1, 7, gdn.hidden_size, generator=gen, dtype=torch.float64)
        hf = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        parts = split_qkvz(gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight, gdn.num_k_heads, gdn.head_k_dim,
                           gdn.num_v_heads, gdn.head_v_dim)
        for h, w in zip(hf, parts):
            worst = max(worst, mt.max_rel(h.reshape(1, 7, -1), F.linear(x, w)))
    log(f"    self-check {'HF in_proj_qkvz/ba ordering == own split':46s} worst max|diff|/max|ref| = "
        f"{worst:.2e} (tol {TOL_SELF:.0e})")
    if not worst <= TOL_SELF:
        fail("HF's in_proj_qkvz/in_proj_ba ordering differs from split_qkvz")
    return float(f"{worst:.3e}")


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------

def make_fixture(fx, fdir):
    name = fx["name"]
    log(f"== {name}: {fx['about']}")
    model_dir = os.path.join(fdir, "model")
    os.makedirs(fdir, exist_ok=True)
    cls, built = build_and_save(fx, model_dir)
    files = mt.checkpoint_files(model_dir)
    if fx["sharded"] and len(files) < 2:
        fail(f"{name}: wanted a sharded checkpoint, got {files}")
    table, counts = mt.check_saved_dtypes(name, model_dir, fx["weights"])
    expert_shapes = check_expert_layout(fx, model_dir, built)
    log(f"    experts as saved: " + ", ".join(f"{k} {v}" for k, v in expert_shapes.items()))

    seqlens = fx["seqlens"]
    as_model = fuse_experts if fx["experts"] == "per-expert" else None

    with family_of(fx):
        model = mt.load_f64(cls, model_dir, name, load_kw={"experts_implementation": "eager"}, as_model_keys=as_model)
        if model.config._experts_implementation != "eager":
            fail(f"{name}: experts implementation is {model.config._experts_implementation}, want eager")
        for k, v in model.state_dict().items():       # the loaded model is the built one
            if k in built and not torch.equal(v, built[k].to(torch.float64)):
                fail(f"{name}: loaded {k} differs from the built model")
        cfg = model.config.get_text_config()
        top_k = cfg.num_experts_per_tok
        renorm = getattr(cfg, "norm_topk_prob", True)      # qwen3_5_moe always renormalises (no such field)
        moe = moe_layers(model)
        if fx["family"] == "qwen3_next":
            want = [i for i in range(cfg.num_hidden_layers)
                    if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0]
            if moe != want:
                fail(f"{name}: MoE layers {moe}, want {want}")
        elif moe != list(range(cfg.num_hidden_layers)):
            fail(f"{name}: every qwen3_5_moe layer should be MoE, got {moe}")
        dense = [i for i in range(cfg.num_hidden_layers) if i not in moe]
        ids, cu = decisive_input(model, fx, top_k)
        save_file({"input_ids": ids, "cu_seqlens": cu}, os.path.join(fdir, "input.safetensors"))

        audit = mt.DtypeAudit()
        with mt.hf_float64(), route_capture(model) as calls:
            ref = mt.run_packed(model, ids, seqlens, audit=audit)
        if audit.bad:
            fail(f"{name}: the float64 forward produced non-float64 tensors: {audit.bad}")
        log(f"    float64 end-to-end: parameters, buffers and every floating aten result of the forward are float64")
        routes = packed_routes(calls)
        kth, order = routing_gaps(routes, top_k)
        log(f"    routing: smallest (p_K - p_K+1)/p_K = {kth['gap']:.3e} (layer {kth['layer']}, token {kth['token']}); "
            f"between chosen experts {order['gap']:.3e}")
        if not kth["gap"] >= MIN_GAP or not order["gap"] >= MIN_GAP:
            fail(f"{name}: routing near a tie (gap < {MIN_GAP:.0e}); change the seed")
        logit_gap = min_logit_gap(routes, top_k)
        log(f"    routing: smallest router logit gap l_K - l_K+1 = {logit_gap:.3f} (wanted >= {MIN_LOGIT_GAP})")
        if not logit_gap >= MIN_LOGIT_GAP * (1 - 1e-9):
            fail(f"{name}: the packed run's smallest router logit gap {logit_gap:.3f} < {MIN_LOGIT_GAP}")

        nl = cfg.num_hidden_layers
        want = [f"layer_{i}" for i in range(nl)] + ["final_norm", "logits"]
        if sorted(ref) != sorted(want):
            fail(f"{name}: captured {sorted(ref)}, want {want}")
        checks, routing = {}, {}
        if fx["family"] == "qwen3_next":
            checks["qkvz_ba_layout_vs_own_split"] = check_qkvz_layout(model, fx["seed"])
        with mt.hf_float64():
            with route_capture(model) as pc:
                got = mt.run_padded(model, ids, seqlens)
            checks["packed_vs_padded"] = mt.compare("packed per sequence == batch-padded", got, ref, TOL_SELF)
            routing["padded_topk_equals"] = same_routes(padded_routes(pc, seqlens), routes)
            with moe_spec_check(model, top_k, renorm) as worst:
                got = mt.run_packed(model, ids, seqlens)
            checks["moe_block_vs_own_spec"] = float(f"{worst[0]:.3e}")
            log(f"    self-check {'HF MoE block == own MoE block (spec)':46s} worst max|diff|/max|ref| = "
                f"{worst[0]:.2e} (tol {TOL_SELF:.0e})")
            if not worst[0] <= TOL_SELF:
                fail(f"{name}: HF's MoE block differs from our own")
            with mt.swapped("torch_chunk_gated_delta_rule", mt.hf_recurrent_as_chunk):
                checks["chunked_vs_hf_recurrent"] = mt.compare("HF chunked == HF recurrent",
                                                               mt.run_packed(model, ids, seqlens), ref, TOL_SELF)
            with mt.swapped("torch_chunk_gated_delta_rule", mt.naive_gated_delta_rule):
                checks["chunked_vs_naive_recurrence"] = mt.compare("HF chunked == own naive recurrence (spec 2.4)",
                                                                   mt.run_packed(model, ids, seqlens), ref, TOL_SELF)
        with route_capture(model) as sc:
            got = mt.run_packed(model, ids, seqlens)
        checks["stock_hf_fp32_internals"] = mt.compare("stock HF (fp32 internal casts) ~= float64", got, ref, TOL_STOCK)
        routing["stock_topk_equals"] = same_routes(packed_routes(sc), routes)

        # a float32 copy of the checkpoint, as Transformers runs it by default (grouped_mm experts)
        m32 = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        routing["f32_experts_implementation"] = m32.config._experts_implementation
        with route_capture(m32) as fc:
            got = mt.run_packed(m32, ids, seqlens)
        got = {k: v.double() for k, v in got.items()}
        checks["float32_model"] = mt.compare("float32 model ~= float64", got, ref, TOL_F32)
        f32_routes = packed_routes(fc)
        routing["f32_topk_equals"] = same_routes(f32_routes, routes)
        routing["f32_min_rel_gap_kth"] = float(f"{routing_gaps(f32_routes, top_k)[0]['gap']:.3e}")
        del m32
    for k in ("padded_topk_equals", "stock_topk_equals", "f32_topk_equals"):
        log(f"    routing {k}: {routing[k]}")
        if not routing[k]:
            fail(f"{name}: {k} is false: the routing differs from the float64 reference's")

    rt = {k: v.to(torch.float64).contiguous() for k, v in ref.items()}
    for i in moe:
        rt[f"experts_{i}"] = routes[i][1].to(torch.int32).contiguous()
    names = want + [f"experts_{i}" for i in moe]
    meta = {"generator": GENERATOR, "torch": torch.__version__, "transformers": transformers.__version__}
    save_file({k: rt[k] for k in names}, os.path.join(fdir, "ref.safetensors"), metadata=meta)

    load = {i: torch.bincount(routes[i][1].flatten(), minlength=cfg.num_experts).tolist() for i in moe}
    summary = dict(
        name=name, about=fx["about"], generator=GENERATOR,
        layout=fx["layout"] + ("-sharded" if fx["sharded"] else "-single"),
        architecture=type(model).__name__, model_type=model.config.model_type, text_model_type=cfg.model_type,
        weight_dtype_policy=fx["weights"], weight_dtype_counts=counts,
        f32_tensors=sorted(k for k, v in table.items() if v[1] == "F32") if fx["weights"] != "f32" else "all",
        checkpoint_files=files,
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=nl, layer_types=list(cfg.layer_types),
        moe=dict(num_experts=cfg.num_experts, num_experts_per_tok=top_k,
                 moe_intermediate_size=cfg.moe_intermediate_size,
                 shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                 renormalise_topk=renorm, norm_topk_prob=getattr(cfg, "norm_topk_prob", None),
                 decoder_sparse_step=getattr(cfg, "decoder_sparse_step", None),
                 mlp_only_layers=getattr(cfg, "mlp_only_layers", None),
                 moe_layers=moe, dense_layers=dense,
                 dense_intermediate_size=cfg.intermediate_size if dense else None,
                 expert_layout=fx["experts"], expert_tensors=expert_shapes, router_logit_scale=ROUTER_SCALE),
        attention=dict(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_parameters["partial_rotary_factor"],
                       rope_theta=cfg.rope_parameters["rope_theta"],
                       mrope=any(k.startswith("mrope") for k in cfg.rope_parameters)),
        gdn=dict(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                 k_head_dim=cfg.linear_key_head_dim, v_head_dim=cfg.linear_value_head_dim,
                 conv_kernel=cfg.linear_conv_kernel_dim,
                 in_proj="fused in_proj_qkvz / in_proj_ba (per key-head group)" if fx["family"] == "qwen3_next"
                 else "in_proj_qkv / in_proj_z / in_proj_b / in_proj_a"),
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        seqlens=list(seqlens), T=int(cu[-1]), cu_seqlens=cu.tolist(),
        ref_tensors={k: dict(dtype="I32" if k.startswith("experts_") else "F64", shape=list(rt[k].shape))
                     for k in names},
        routing=dict(min_rel_gap_kth=float(f"{kth['gap']:.3e}"), min_rel_gap_kth_at=dict(layer=kth["layer"],
                     token=kth["token"]), min_rel_gap_within_topk=float(f"{order['gap']:.3e}"),
                     **{"kth_gaps_below_1e-3": kth["below_1e3"], "within_topk_gaps_below_1e-3": order["below_1e3"]},
                     required_min_gap=MIN_GAP, min_logit_gap_kth=float(f"{logit_gap:.4f}"),
                     required_min_logit_gap=MIN_LOGIT_GAP,
                     input="tokens chosen position by position so that every router logit gap l_K - l_K+1 >= "
                           "required_min_logit_gap (make_moe_fixtures.py decisive_input)",
                     **routing, tokens_per_expert=load),
        self_checks_max_rel=checks,
        versions={"torch": torch.__version__, "transformers": transformers.__version__,
                  "python": platform.python_version()},
    )
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "fixtures", "target"),
                    help="where the fixtures go (default: tests/fixtures/target)")
    ap.add_argument("--only", action="append", default=[], help="build only this fixture (repeatable)")
    ap.add_argument("--verify", action="store_true",
                    help="rebuild into a temporary directory and compare with what --out-dir holds")
    args = ap.parse_args()

    mt.check_environment()
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
            bad = mt.verify(args.out_dir, tmp, [f["name"] for f in selected])
        if bad:
            fail("fresh build differs from the committed fixtures:\n  " + "\n  ".join(bad))
        log("verify: fresh build matches the committed fixtures")
        return

    # the manifest is make_target_fixtures.py's: its entries and top-level fields stay as they are, ours are
    # replaced in place or appended
    manifest_path = os.path.join(args.out_dir, "manifest.json")
    manifest = {"fixtures": []}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    fixtures = manifest.setdefault("fixtures", [])
    for fx in selected:
        fdir = os.path.join(args.out_dir, fx["name"])
        if os.path.isdir(fdir):
            shutil.rmtree(fdir)
        entry = mt.finish_summary(make_fixture(fx, fdir), fdir, args.out_dir)
        total = sum(os.path.getsize(os.path.join(fdir, f)) for f in mt.dir_files(fdir))
        log(f"    {fx['name']}: {total} bytes")
        at = [i for i, e in enumerate(fixtures) if e["name"] == fx["name"]]
        if at:
            fixtures[at[0]] = entry
        else:
            fixtures.append(entry)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"wrote {manifest_path}")


if __name__ == "__main__":
    main()
