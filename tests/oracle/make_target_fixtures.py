#!/usr/bin/env python3
"""tests/oracle/make_target_fixtures.py — Hugging Face Transformers oracle for the target model.

Builds tiny random Qwen3.5 models with Transformers (seeded), saves them in the real Hugging Face layouts
(multimodal sharded / single file, flat Qwen3_5ForCausalLM; bf16+F32, bf16, fp32), loads each SAVED checkpoint
back, runs it in float64 one packed sequence at a time on the pure-torch paths, and writes float64 references:
tests/fixtures/target/<name>/{model/, input.safetensors, ref.safetensors} and manifest.json, plus the embedded
default model models/tiny-qwen35/. See tests/oracle/README.md for how to run it and what each fixture covers.
"""

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import platform
import shutil
import tempfile

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import transformers
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIN, FULL = "linear_attention", "full_attention"
SEQLENS_A = [1, 63, 64, 65, 200, 130]    # straddle the GDN chunk size 64 (and 2 chunks + 2, 3 chunks + 8)
SEQLENS_B = [200, 1, 65, 64, 130, 63]    # same lengths, other packing order

# Tiny vision tower: only there so that model.visual.* exists in the multimodal files (the loader skips it).
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)

FIXTURES = [
    dict(
        name="qwen35_mm_sharded",
        about="Qwen3.5 shipping form: multimodal layout sharded over several files, bf16 weights with F32 "
              "A_log and linear_attn.norm.weight, mtp.* tensors present; GVA nv=3*nk, dk!=dv; partial rotary "
              "0.25 with theta 1e7; explicit layer pattern [lin, full, lin, lin, lin, full]; conv kernel 4; "
              "untied lm_head",
        layout="multimodal", sharded=True, max_shard_size=100_000, weights="bf16+f32gdn", add_mtp=True,
        seed=1001, seqlens=SEQLENS_A,
        text=dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                  layer_types=[LIN, FULL, LIN, LIN, LIN, FULL],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                  rope_theta=1e7, tie_word_embeddings=False),
    ),
    dict(
        name="qwen36_mm_single_bf16",
        about="Qwen3.6 form: multimodal layout in one model.safetensors, every tensor bf16 (A_log and the GDN "
              "norm too); nv=nk, odd head dims (12); partial rotary 0.5; the default 3:1 pattern "
              "(full_attention_interval 4) over 5 layers; conv kernel 4; untied lm_head; vocab 160",
        layout="multimodal", sharded=False, weights="bf16", add_mtp=False,
        seed=2002, seqlens=SEQLENS_B,
        text=dict(vocab_size=160, hidden_size=40, intermediate_size=80, num_hidden_layers=5,
                  full_attention_interval=4,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                  linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=12,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4, partial_rotary_factor=0.5,
                  rope_theta=10000.0, tie_word_embeddings=False),
    ),
    dict(
        name="qwen35_flat_f32_tied",
        about="flat Qwen3_5ForCausalLM layout (keys model.layers.*, no text_config nesting), fp32 weights, tied "
              "embeddings (no lm_head.weight in the file); pattern [full, lin, lin, full, lin]; full rotary; "
              "nv=2*nk with dk<dv; MHA (nq=nkv); conv kernel 3",
        layout="flat", sharded=False, weights="f32", add_mtp=False,
        seed=3003, seqlens=SEQLENS_A,
        text=dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                  layer_types=[FULL, LIN, LIN, FULL, LIN],
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=16, linear_conv_kernel_dim=3, partial_rotary_factor=1.0,
                  rope_theta=10000.0, tie_word_embeddings=True),
    ),
]

TINY_DEFAULT = dict(
    name="tiny-qwen35",
    about="embedded default model: Qwen3.5 multimodal layout, one file, bf16 weights with F32 A_log and "
          "linear_attn.norm.weight (as Qwen3.5 ships), 6 layers [lin, lin, full, lin, lin, full]",
    layout="multimodal", sharded=False, weights="bf16+f32gdn", add_mtp=False,
    seed=4004, seqlens=[5, 70, 1, 33],
    text=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              full_attention_interval=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
              linear_value_head_dim=32, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
              rope_theta=1e7, tie_word_embeddings=False),
)

GENERATOR = "tests/oracle/make_target_fixtures.py"
TOL_SELF = 1e-10      # float64 self-checks (packed vs padded, chunked vs recurrent)
TOL_STOCK = 1e-4      # float64 promoted casts vs stock HF (fp32 internals), relative to max |ref|


def log(msg):
    print(msg, flush=True)


def fail(msg):
    raise SystemExit("make_target_fixtures: " + msg)


# --------------------------------------------------------------------------------------------------------------
# Building and saving
# --------------------------------------------------------------------------------------------------------------

def text_config_dict(fx):
    t = dict(fx["text"])
    prf = t.pop("partial_rotary_factor")
    theta = t.pop("rope_theta")
    rot_half = int(t["head_dim"] * prf) // 2
    # mrope sections must cover the rotary frequency slots; text-only input makes t = h = w anyway
    sec = [rot_half - 2 * (rot_half // 4), rot_half // 4, rot_half // 4]
    t["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf,
                            "mrope_interleaved": True, "mrope_section": sec}
    if "layer_types" in t:
        t["num_hidden_layers"] = len(t["layer_types"])
    t.setdefault("max_position_embeddings", 4096)
    t.setdefault("rms_norm_eps", 1e-6)
    return t


def build_config(fx):
    t = text_config_dict(fx)
    if fx["layout"] == "multimodal":
        v = dict(TINY_VISION, out_hidden_size=t["hidden_size"])
        return Qwen3_5Config(text_config=t, vision_config=v, tie_word_embeddings=t["tie_word_embeddings"])
    return Qwen3_5TextConfig(**t)


def text_model(model):
    """The decoder stack: model.model.language_model in the multimodal layouts, model.model in the flat ones."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


# The helpers below reach HF's modeling code through `hf_qwen` and name its classes with CLASS_PREFIX
# (hf_class("RMSNorm") is Qwen3_5RMSNorm). make_moe_fixtures.py points them at modeling_qwen3_5_moe or
# modeling_qwen3_next, which have the same structure, with family().
CLASS_PREFIX = "Qwen3_5"


def hf_class(suffix):
    return getattr(hf_qwen, CLASS_PREFIX + suffix)


@contextlib.contextmanager
def family(module, prefix):
    """Within the block, hf_qwen is `module` and its classes are named `prefix` + suffix."""
    global hf_qwen, CLASS_PREFIX
    saved = hf_qwen, CLASS_PREFIX
    hf_qwen, CLASS_PREFIX = module, prefix
    try:
        yield
    finally:
        hf_qwen, CLASS_PREFIX = saved


@torch.no_grad()
def randomise(model, seed, extra=None):
    """Replace HF's near-identity init (std 0.02, zero norms) by O(1) random weights, so that every sublayer
    moves the residual stream and every norm weight matters. extra(module, randn, rand) initialises the modules of
    other kinds (the MoE router and experts) from the same stream and returns the parameters it set."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    def rand(shape):
        return torch.rand(shape, generator=gen, dtype=torch.float64)

    tm = text_model(model)
    done = set()
    for mname, mod in sorted(tm.named_modules(), key=lambda kv: kv[0]):
        if isinstance(mod, nn.Embedding):
            mod.weight.copy_(randn(mod.weight.shape))
            done.add(mod.weight)
        elif isinstance(mod, nn.Linear):
            mod.weight.copy_(randn(mod.weight.shape) / math.sqrt(mod.in_features))
            done.add(mod.weight)
        elif isinstance(mod, hf_class("RMSNorm")):             # zero-centred: scale is (1 + w)
            mod.weight.copy_(0.1 * randn(mod.weight.shape))
            done.add(mod.weight)
        elif isinstance(mod, hf_class("RMSNormGated")):        # plain w
            mod.weight.copy_(1.0 + 0.1 * randn(mod.weight.shape))
            done.add(mod.weight)
        elif isinstance(mod, hf_class("GatedDeltaNet")):
            k = mod.conv1d.weight.shape[-1]
            mod.conv1d.weight.copy_(randn(mod.conv1d.weight.shape) / math.sqrt(k))
            # A in [0.005, 4] log-uniform: some heads keep their state across many chunks, some forget fast
            lo, hi = math.log(0.005), math.log(4.0)
            mod.A_log.copy_(lo + (hi - lo) * rand(mod.A_log.shape))
            mod.dt_bias.copy_(0.5 * randn(mod.dt_bias.shape))
            done.update([mod.conv1d.weight, mod.A_log, mod.dt_bias])
        elif extra is not None:
            done.update(extra(mod, randn, rand))
    lm = model.lm_head
    if lm.weight is not tm.embed_tokens.weight:
        lm.weight.copy_(randn(lm.weight.shape) / math.sqrt(lm.in_features))
        done.add(lm.weight)
    missed = [n for n, p in tm.named_parameters() if p not in done]
    if missed:
        fail("randomise() left parameters at their init: " + ", ".join(missed))


def apply_weight_dtypes(model, policy):
    """policy: 'f32' | 'bf16' (everything, Qwen3.6) | 'bf16+f32gdn' (A_log and linear_attn.norm.weight F32)."""
    if policy == "f32":
        return
    keep = {}
    if policy == "bf16+f32gdn":
        for mod in model.modules():
            if isinstance(mod, hf_class("GatedDeltaNet")):
                keep[mod.A_log] = mod.A_log.detach().clone()
                keep[mod.norm.weight] = mod.norm.weight.detach().clone()
    elif policy != "bf16":
        fail(f"unknown weight dtype policy '{policy}'")
    model.to(torch.bfloat16)
    for p, orig in keep.items():
        p.data = orig.to(torch.float32)


def mtp_tensors(fx, dtype):
    """A few mtp.* tensors as Qwen3.5 checkpoints carry them; every loader must ignore them."""
    d = fx["text"]["hidden_size"]
    gen = torch.Generator().manual_seed(fx["seed"] + 7)
    return {
        "mtp.fc.weight": torch.randn(d, 2 * d, generator=gen).to(dtype),
        "mtp.norm.weight": (0.1 * torch.randn(d, generator=gen)).to(dtype),
        "mtp.pre_fc_norm_embedding.weight": (0.1 * torch.randn(d, generator=gen)).to(dtype),
        "mtp.pre_fc_norm_hidden.weight": (0.1 * torch.randn(d, generator=gen)).to(dtype),
    }


def add_mtp(fx, model_dir):
    idx_path = os.path.join(model_dir, "model.safetensors.index.json")
    extra = mtp_tensors(fx, torch.bfloat16)
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            index = json.load(f)
        shard = sorted(set(index["weight_map"].values()))[0]
        path = os.path.join(model_dir, shard)
        tensors = load_file(path)
        tensors.update(extra)
        save_file(tensors, path, metadata={"format": "pt"})
        for k, t in extra.items():
            index["weight_map"][k] = shard
            index["metadata"]["total_size"] += t.numel() * t.element_size()
            if "total_parameters" in index["metadata"]:
                index["metadata"]["total_parameters"] += t.numel()
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        with open(idx_path, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    else:
        path = os.path.join(model_dir, "model.safetensors")
        tensors = load_file(path)
        tensors.update(extra)
        save_file(tensors, path, metadata={"format": "pt"})
    # the shipping config says how many MTP layers the checkpoint has; HF ignores the weights either way
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    tc = cfg.get("text_config", cfg)
    tc["mtp_num_hidden_layers"] = 1
    tc["mtp_use_dedicated_embeddings"] = False
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return sorted(extra)


def build_and_save(fx, model_dir):
    cfg = build_config(fx)
    torch.manual_seed(fx["seed"])          # HF init of everything randomise() does not touch (vision tower)
    cls = Qwen3_5ForConditionalGeneration if fx["layout"] == "multimodal" else Qwen3_5ForCausalLM
    model = cls(cfg).eval()
    randomise(model, fx["seed"])
    apply_weight_dtypes(model, fx["weights"])
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    kw = {"max_shard_size": fx["max_shard_size"]} if fx["sharded"] else {"max_shard_size": "10GB"}
    model.save_pretrained(model_dir, **kw)
    mtp = add_mtp(fx, model_dir) if fx["add_mtp"] else []
    return cls, mtp


# --------------------------------------------------------------------------------------------------------------
# Checking what was saved
# --------------------------------------------------------------------------------------------------------------

def checkpoint_files(model_dir):
    idx_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def file_dtypes(model_dir):
    """{key: (file, dtype string, shape)} from the safetensors headers."""
    out = {}
    for fn in checkpoint_files(model_dir):
        with open(os.path.join(model_dir, fn), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            hdr = json.loads(f.read(n))
        for k, v in hdr.items():
            if k != "__metadata__":
                out[k] = (fn, v["dtype"], v["shape"])
    return out


def expected_dtype(key, policy):
    if policy == "f32":
        return "F32"
    if policy == "bf16":
        return "BF16"
    if key.endswith("linear_attn.A_log") or key.endswith("linear_attn.norm.weight"):
        return "F32"
    return "BF16"


def check_saved_dtypes(name, model_dir, policy):
    table = file_dtypes(model_dir)
    log(f"  [{name}] saved tensors by file and dtype:")
    per = {}
    for k, (fn, dt, _) in table.items():
        per.setdefault(fn, {}).setdefault(dt, 0)
        per[fn][dt] += 1
    for fn in sorted(per):
        log(f"    {fn:40s} " + "  ".join(f"{dt}:{n}" for dt, n in sorted(per[fn].items())))
    groups = {}
    for k, (fn, dt, _) in sorted(table.items()):
        group = k.split(".layers.")[0] + (".layers.*." + k.split(".layers.")[1].split(".", 1)[1]
                                          if ".layers." in k else "")
        groups.setdefault((group, dt), 0)
        groups[(group, dt)] += 1
    log(f"    {'tensor (layers collapsed)':70s} dtype  count")
    for (g, dt), n in sorted(groups.items()):
        log(f"    {g:70s} {dt:5s}  {n}")
    bad = [f"{k}: {dt} (want {expected_dtype(k, policy)})" for k, (_, dt, _) in table.items()
           if dt != expected_dtype(k, policy)]
    if bad:
        fail(f"{name}: saved dtypes are not what was intended:\n  " + "\n  ".join(bad))
    counts = {}
    for _, dt, _ in table.values():
        counts[dt] = counts.get(dt, 0) + 1
    return table, counts


# --------------------------------------------------------------------------------------------------------------
# float64 execution of HF's own code
# --------------------------------------------------------------------------------------------------------------

class _Torch64:
    """Stands in for `torch` inside modeling_qwen3_5: the module's explicit float32 casts (RMSNorm statistics,
    softmax, RoPE tables, the whole gated delta rule) become float64; every other name is torch's own."""
    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def hf_float64():
    orig_float = torch.Tensor.float

    def to64(self, memory_format=torch.preserve_format):
        return self.to(torch.float64, memory_format=memory_format)

    hf_qwen.torch = _Torch64()
    torch.Tensor.float = to64
    try:
        yield
    finally:
        hf_qwen.torch = torch
        torch.Tensor.float = orig_float


class DtypeAudit(TorchDispatchMode):
    """Records every aten op that produced a floating tensor other than float64."""

    def __init__(self):
        super().__init__()
        self.bad = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                key = (str(func), str(t.dtype))
                self.bad[key] = self.bad.get(key, 0) + 1
        return out


@contextlib.contextmanager
def swapped(name, fn):
    orig = getattr(hf_qwen, name)
    setattr(hf_qwen, name, fn)
    try:
        yield
    finally:
        setattr(hf_qwen, name, orig)


def hf_recurrent_as_chunk(query, key, value, g, beta, chunk_size=64, **kw):
    return hf_qwen.torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, **kw)


def naive_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kw):
    """Our own float64 per-token recurrence, written from docs/target.md (not HF code):
    S~ = e^g S;  u = beta (v - S~^T k);  S = S~ + k u^T;  o = S^T q / sqrt(dk);  v-head j uses k-head j // r."""
    if initial_state is not None:
        fail("naive_gated_delta_rule: no initial state expected in prefill")
    B, L, HK, DK = key.shape
    HV, DV = value.shape[-2:]
    r = HV // HK
    q, k, v = query.double(), key.double(), value.double()
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(DK)
    out = torch.zeros(B, L, HV, DV, dtype=torch.float64)
    for b in range(B):
        for h in range(HV):
            kh = h // r
            S = torch.zeros(DK, DV, dtype=torch.float64)
            for t in range(L):
                S = torch.exp(g[b, t, h].double()) * S
                u = beta[b, t, h].double() * (v[b, t, h] - S.T @ k[b, t, kh])
                S = S + torch.outer(k[b, t, kh], u)
                out[b, t, h] = S.T @ q[b, t, kh]
    return out.to(query.dtype), None


def read_checkpoint(model_dir):
    """{key: tensor} of every tensor in the checkpoint's files, as stored."""
    out = {}
    for fn in checkpoint_files(model_dir):
        with safe_open(os.path.join(model_dir, fn), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def load_f64(cls, model_dir, name, load_kw=None, as_model_keys=None):
    """load_kw: more from_pretrained arguments; as_model_keys(stored) maps the files' {key: tensor} to the model's
    keys and layouts (our own conversion, e.g. per-expert to fused) for the check that the loaded values are the
    files' values."""
    model, info = cls.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager",
                                      output_loading_info=True, **(load_kw or {}))
    model = model.to(torch.float64).eval()
    if info.get("missing_keys"):
        fail(f"{name}: keys missing when loading the saved checkpoint: {sorted(info['missing_keys'])}")
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    if unexpected:
        fail(f"{name}: unexpected keys when loading: {sorted(unexpected)}")
    if model.config._attn_implementation != "eager":
        fail(f"{name}: attention implementation is {model.config._attn_implementation}, want eager")
    # RoPE inverse frequencies: HF computes them in float32 at init; recompute with HF's formula in float64
    tm = text_model(model)
    rot = tm.rotary_emb
    rp = rot.config.rope_parameters
    dim = int(rot.config.head_dim * rp.get("partial_rotary_factor", 1.0))
    inv64 = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not torch.allclose(rot.inv_freq.double(), inv64, rtol=1e-6, atol=0):
        fail(f"{name}: HF inv_freq differs from the float64 recomputation")
    rot.inv_freq = inv64
    rot.original_inv_freq = inv64.clone()
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dtype != torch.float64:
            fail(f"{name}: {n} is {t.dtype} after .to(float64)")
    # every loaded weight equals the file's value exactly
    sd = model.state_dict()
    stored = read_checkpoint(model_dir)
    if as_model_keys is not None:
        stored = as_model_keys(stored)
    file_keys = set(stored)
    for k, t in stored.items():
        if k.startswith("mtp."):
            if k in sd:
                fail(f"{name}: {k} was loaded into the model")
            continue
        if k not in sd:
            fail(f"{name}: file key {k} has no parameter in the model")
        if not torch.equal(sd[k], t.to(torch.float64)):
            fail(f"{name}: {k} differs between file and loaded float64 model")
    absent = sorted(k for k in sd if k not in file_keys)
    tied = model.config.get_text_config().tie_word_embeddings
    if absent != (["lm_head.weight"] if tied else []):
        fail(f"{name}: model keys not in the files: {absent}")
    if tied and not torch.equal(model.lm_head.weight, tm.embed_tokens.weight):
        fail(f"{name}: tied lm_head differs from embed_tokens")
    return model


def capture(model):
    """Forward hooks on every decoder layer, the final norm and the lm_head."""
    tm = text_model(model)
    store = {}
    handles = []

    def hook(key):
        def fn(_mod, _inp, out):
            store[key] = (out[0] if isinstance(out, (tuple, list)) else out).detach()
        return fn

    for i, layer in enumerate(tm.layers):
        handles.append(layer.register_forward_hook(hook(f"layer_{i}")))
    handles.append(tm.norm.register_forward_hook(hook("final_norm")))
    handles.append(model.lm_head.register_forward_hook(hook("logits")))
    return store, handles


@torch.no_grad()
def run_packed(model, ids, seqlens, audit=None):
    """One forward per sequence (positions from 0), outputs concatenated in packed order."""
    store, handles = capture(model)
    parts = {}
    try:
        off = 0
        for L in seqlens:
            store.clear()
            x = ids[off:off + L].to(torch.long)[None]
            ctx = audit if audit is not None else contextlib.nullcontext()
            with ctx:
                out = model(input_ids=x, use_cache=False)
            if not torch.equal(out.logits, store["logits"]):
                fail("lm_head hook output differs from the model's logits")
            for k, v in store.items():
                if v.shape[:2] != (1, L):
                    fail(f"captured {k} has shape {tuple(v.shape)}, want (1, {L}, ...)")
                parts.setdefault(k, []).append(v[0])
            off += L
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v, 0).contiguous() for k, v in parts.items()}


@torch.no_grad()
def run_padded(model, ids, seqlens):
    """All sequences in one right-padded batch with an attention mask; valid rows re-packed."""
    n, Lmax = len(seqlens), max(seqlens)
    x = torch.zeros(n, Lmax, dtype=torch.long)
    mask = torch.zeros(n, Lmax, dtype=torch.long)
    off = 0
    for i, L in enumerate(seqlens):
        x[i, :L] = ids[off:off + L]
        mask[i, :L] = 1
        off += L
    store, handles = capture(model)
    try:
        model(input_ids=x, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat([v[i, :L] for i, L in enumerate(seqlens)], 0) for k, v in store.items()}


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def compare(tag, got, ref, tol):
    worst = 0.0
    for k in ref:
        e = max_rel(got[k], ref[k])
        worst = max(worst, e)
        if not e <= tol:
            fail(f"self-check '{tag}' failed on {k}: max |diff| / max |ref| = {e:.3e} > {tol:.0e}")
    log(f"    self-check {tag:46s} worst max|diff|/max|ref| = {worst:.2e} (tol {tol:.0e})")
    return worst


# --------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------

def cu_seqlens(seqlens):
    """I32 [N + 1]: 0 and the running sums of the sequence lengths."""
    return torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)


def make_input(fx):
    gen = torch.Generator().manual_seed(fx["seed"] + 1)
    T = sum(fx["seqlens"])
    ids = torch.randint(0, fx["text"]["vocab_size"], (T,), generator=gen, dtype=torch.int64).to(torch.int32)
    return ids, cu_seqlens(fx["seqlens"])


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


def make_fixture(fx, out_dir, with_ref=True):
    name = fx["name"]
    log(f"== {name}: {fx['about']}")
    fdir = out_dir
    model_dir = os.path.join(fdir, "model") if with_ref else fdir
    os.makedirs(fdir, exist_ok=True)
    cls, mtp = build_and_save(fx, model_dir)
    files = checkpoint_files(model_dir)
    if fx["sharded"] and len(files) < 2:
        fail(f"{name}: wanted a sharded checkpoint, got {files}")
    table, counts = check_saved_dtypes(name, model_dir, fx["weights"])

    ids, cu = make_input(fx)
    input_name = "input.safetensors" if with_ref else "example_input.safetensors"
    save_file({"input_ids": ids, "cu_seqlens": cu}, os.path.join(fdir, input_name))

    model = load_f64(cls, model_dir, name)
    cfg = model.config.get_text_config()
    summary = dict(
        name=name, about=fx["about"], layout=fx["layout"] + ("-sharded" if fx["sharded"] else "-single"),
        architecture=type(model).__name__, model_type=model.config.model_type,
        weight_dtype_policy=fx["weights"], weight_dtype_counts=counts,
        f32_tensors=sorted(k for k, v in table.items() if v[1] == "F32") if fx["weights"] != "f32" else "all",
        checkpoint_files=files, mtp_keys=mtp,
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types), intermediate_size=cfg.intermediate_size,
        attention=dict(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_parameters["partial_rotary_factor"],
                       rope_theta=cfg.rope_parameters["rope_theta"]),
        gdn=dict(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                 k_head_dim=cfg.linear_key_head_dim, v_head_dim=cfg.linear_value_head_dim,
                 conv_kernel=cfg.linear_conv_kernel_dim),
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        seqlens=list(fx["seqlens"]), T=int(cu[-1]), cu_seqlens=cu.tolist(),
    )
    if not with_ref:
        return summary

    seqlens = fx["seqlens"]
    audit = DtypeAudit()
    with hf_float64():
        ref = run_packed(model, ids, seqlens, audit=audit)
    if audit.bad:
        fail(f"{name}: the float64 forward produced non-float64 tensors: {audit.bad}")
    log(f"    float64 end-to-end: parameters, buffers and every floating aten result of the forward are float64")
    nl = cfg.num_hidden_layers
    want = [f"layer_{i}" for i in range(nl)] + ["final_norm", "logits"]
    if sorted(ref) != sorted(want):
        fail(f"{name}: captured {sorted(ref)}, want {want}")

    checks = {}
    with hf_float64():
        checks["packed_vs_padded"] = compare("packed per sequence == batch-padded", run_padded(model, ids, seqlens),
                                             ref, TOL_SELF)
        with swapped("torch_chunk_gated_delta_rule", hf_recurrent_as_chunk):
            checks["chunked_vs_hf_recurrent"] = compare("HF chunked == HF recurrent",
                                                        run_packed(model, ids, seqlens), ref, TOL_SELF)
        with swapped("torch_chunk_gated_delta_rule", naive_gated_delta_rule):
            checks["chunked_vs_naive_recurrence"] = compare("HF chunked == own naive recurrence (spec 2.4)",
                                                            run_packed(model, ids, seqlens), ref, TOL_SELF)
    checks["stock_hf_fp32_internals"] = compare("stock HF (fp32 internal casts) ~= float64",
                                                run_packed(model, ids, seqlens), ref, TOL_STOCK)
    rt = {k: v.to(torch.float64).contiguous() for k, v in ref.items()}
    meta = {"generator": "tests/oracle/make_target_fixtures.py", "torch": torch.__version__,
            "transformers": transformers.__version__}
    save_file({k: rt[k] for k in want}, os.path.join(fdir, "ref.safetensors"), metadata=meta)
    summary["ref_tensors"] = {k: dict(dtype="F64", shape=list(rt[k].shape)) for k in want}
    summary["self_checks_max_rel"] = {k: float(f"{v:.3e}") for k, v in checks.items()}
    return summary


def finish_summary(summary, fdir, root):
    summary["files"] = {f: sha256(os.path.join(fdir, f)) for f in dir_files(fdir)}
    summary["dir"] = os.path.relpath(fdir, root)
    return summary


def check_environment():
    for pkg in ("fla", "causal_conv1d", "kernels", "flash_attn"):
        if importlib.util.find_spec(pkg) is not None:
            fail(f"package '{pkg}' is installed; the oracle must use the pure-torch paths of transformers. "
                 f"Run it in an environment without {pkg} (e.g. a fresh venv with only torch and transformers)")
    tv = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if tv < (5, 2):
        fail(f"transformers {transformers.__version__} has no working Qwen3.5 classes; install >= 5.2")


NOT_GENERATED = ("hf_bf16.json", ".tandem-fingerprint")


def verify(committed_root, fresh_root, names):
    """Compare a fresh build with the committed one: weights and inputs bitwise, references to 1e-12.
    Files no generator writes are left out: hf_bf16.json (bf16_baseline.py's) and .tandem-fingerprint (the
    weights fingerprint cache target-server leaves beside a checkpoint it has loaded; git ignores it)."""
    bad = []
    for n in names:
        a, b = os.path.join(committed_root, n), os.path.join(fresh_root, n)
        fa, fb = ([f for f in dir_files(d) if os.path.basename(f) not in NOT_GENERATED] for d in (a, b))
        if fa != fb:
            bad.append(f"{n}: file lists differ: {sorted(set(fa) ^ set(fb))}")
            continue
        for f in fa:
            if f.endswith("ref.safetensors"):
                ra, rb = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
                for k in rb:
                    if k not in ra or ra[k].shape != rb[k].shape or max_rel(ra[k], rb[k]) > 1e-12:
                        bad.append(f"{n}/{f}: {k} differs")
            elif sha256(os.path.join(a, f)) != sha256(os.path.join(b, f)):
                bad.append(f"{n}/{f}: bytes differ")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "fixtures", "target"),
                    help="where the fixtures go (default: tests/fixtures/target)")
    ap.add_argument("--model-dir", default=os.path.join(REPO, "models", "tiny-qwen35"),
                    help="where the embedded default model goes (default: models/tiny-qwen35)")
    ap.add_argument("--only", action="append", default=[], help="build only this fixture (repeatable)")
    ap.add_argument("--verify", action="store_true",
                    help="rebuild into a temporary directory and compare with what --out-dir/--model-dir hold")
    args = ap.parse_args()

    check_environment()
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
            out_dir, model_dir = os.path.join(tmp, "target"), os.path.join(tmp, "tiny-qwen35")
            for fx in selected:
                make_fixture(fx, os.path.join(out_dir, fx["name"]))
            if not args.only:
                make_fixture(TINY_DEFAULT, model_dir, with_ref=False)
            bad = verify(args.out_dir, out_dir, [f["name"] for f in selected])
            if not args.only:
                bad += verify(os.path.dirname(args.model_dir), tmp, [os.path.basename(args.model_dir)])
        if bad:
            fail("fresh build differs from the committed fixtures:\n  " + "\n  ".join(bad))
        log("verify: fresh build matches the committed fixtures")
        return

    manifest_path = os.path.join(args.out_dir, "manifest.json")
    manifest = {"fixtures": []}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    # entries that name another generator (make_moe_fixtures.py) are kept as they are, after ours
    others = [e for e in manifest.get("fixtures", []) if e.get("generator", GENERATOR) != GENERATOR]
    if not args.only:
        manifest = {"fixtures": []}
    entries = {e["name"]: e for e in manifest.get("fixtures", []) if e.get("generator", GENERATOR) == GENERATOR}
    for fx in selected:
        fdir = os.path.join(args.out_dir, fx["name"])
        if os.path.isdir(fdir):
            shutil.rmtree(fdir)
        entries[fx["name"]] = finish_summary(make_fixture(fx, fdir), fdir, args.out_dir)
    if not args.only:
        if os.path.isdir(args.model_dir):
            shutil.rmtree(args.model_dir)
        tiny = make_fixture(TINY_DEFAULT, args.model_dir, with_ref=False)
        total = sum(os.path.getsize(os.path.join(args.model_dir, f)) for f in dir_files(args.model_dir))
        log(f"  embedded default model: {total} bytes")
        manifest["embedded_default_model"] = finish_summary(tiny, args.model_dir, REPO)
    manifest["generator"] = GENERATOR
    manifest["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}
    manifest["conventions"] = {
        "input": "input_ids I32 [T], cu_seqlens I32 [N+1]; token ids uniform in [0, vocab)",
        "ref": "F64: layer_<i> [T, D] = output of decoder layer i (HF hidden_states[i+1], before the final norm); "
               "final_norm [T, D]; logits [T, V] from lm_head",
        "how": "saved checkpoint loaded with from_pretrained, .to(float64), eager attention, pure-torch GDN "
               "(no fla/causal_conv1d/kernels), HF's float32 casts promoted to float64, one forward per sequence "
               "(positions from 0), concatenated in packed order",
        "tolerances": {"packed_vs_padded": TOL_SELF, "chunked_vs_recurrent": TOL_SELF,
                       "stock_hf_vs_float64": TOL_STOCK},
    }
    manifest["fixtures"] = [entries[n] for n in names if n in entries] + others
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"wrote {manifest_path}")


if __name__ == "__main__":
    main()
