#!/usr/bin/env python3
"""tests/oracle/make_fp8_fixtures.py — float64 oracle for `target-server --precision fp8` (W8A8, block-scaled).

For each target fixture of make_target_fixtures.py (tests/fixtures/target/<name>/) it writes an FP8 copy in Qwen's
"fine-grained FP8" format under tests/fixtures/target_fp8/<name>/: the same layout and files, every FP8 Linear as
F8_E4M3 `X.weight` + `X.weight_scale_inv` (F32, BF16 or F16 by fixture), `quantization_config` in config.json, the
same input.safetensors, and ref.safetensors with the float64 W8A8 forward (weights dequantized from the SAVED
files, activations quantized per token in 1 x 128 groups at every FP8 Linear input), plus manifest.json with the
FP8-vs-bf16 differences, self-checks and a measure of the rounding "flips" a float32 forward can hit.
See tests/oracle/README.md for how to run it and exactly what it computes.
"""

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers
from transformers import FineGrainedFP8Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from transformers.integrations import finegrained_fp8 as hf_fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_target_fixtures as mt  # noqa: E402  (the bf16 oracle: loading, float64 promotion, packed runs)

REPO = mt.REPO
SRC_ROOT = os.path.join(REPO, "tests", "fixtures", "target")
BLOCK = 128
E4M3_MAX = 448.0
INV448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)       # float32(1/448), as the activation scale uses it
F32 = torch.float32

# fixture -> dtype of weight_scale_inv (all three occur in Qwen's releases; the loader upcasts each to fp32)
SCALE_DTYPES = {"qwen35_mm_sharded": "F32", "qwen36_mm_single_bf16": "BF16", "qwen35_flat_f32_tied": "F16"}
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# The FP8 Linears of a Qwen3.5/3.6 decoder layer (Qwen's own FP8 releases); everything else stays as it was.
FP8_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYER_PREFIXES = ("model.language_model.layers.", "model.layers.")

TOL_SELF = 1e-10          # float64 self-checks
NEAR = (1e-7, 1e-6, 1e-5)  # relative distances to a rounding midpoint that are counted as "near"


def log(msg):
    print(msg, flush=True)


def fail(msg):
    raise SystemExit("make_fp8_fixtures: " + msg)


def fp8_module_of(key):
    """'...layers.3.mlp.up_proj' for an FP8 Linear's weight key, else None."""
    if not key.endswith(".weight"):
        return None
    for p in LAYER_PREFIXES:
        if key.startswith(p):
            rest = key[len(p):-len(".weight")].split(".", 1)
            if len(rest) == 2 and rest[0].isdigit() and rest[1] in FP8_MODULES:
                return key[:-len(".weight")]
    return None


def not_converted_name(key):
    """The modules_to_not_convert entry of a tensor that stays unquantized (Qwen lists parameters such as
    linear_attn.A_log by their own name)."""
    for suffix in (".weight", ".bias"):
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return key


# --------------------------------------------------------------------------------------------------------------
# The quantizers (the spec; each step an fp32 operation where the spec says so)
# --------------------------------------------------------------------------------------------------------------

def quantize_weight(w, torch_rdiv=False):
    """Fp8Quantize per 128 x 128 block of w (as float32), ragged last blocks included:
    a = max(amax|block|, 1e-12), r = 448/a, q = e4m3(clamp(w r, +-448)), scale_inv = 1/r, each an fp32 operation.
    Transformers writes r = 448 / a with a tensor a, which torch computes as 448 * (1/a) (two roundings; r can
    differ in its last bit): torch_rdiv=True does the same, for the bitwise check against Transformers."""
    w = w.to(F32)
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    sinv = torch.empty((N + BLOCK - 1) // BLOCK, (K + BLOCK - 1) // BLOCK, dtype=F32)
    for i in range(sinv.shape[0]):
        for j in range(sinv.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            a = blk.abs().amax().clamp_min(1e-12)
            r = a.reciprocal() * E4M3_MAX if torch_rdiv else torch.tensor(E4M3_MAX, dtype=F32) / a
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = \
                torch.clamp(blk * r, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            sinv[i, j] = torch.tensor(1.0, dtype=F32) / r
    return q, sinv


def expand_blocks(s, N, K):
    return s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:N, :K]


def dequantize_weight(q, sinv_stored):
    """W[n, k] = float(q[n, k]) * scale_inv[n/128, k/128], in float64 (exact) from the STORED scale."""
    return q.to(torch.float64) * expand_blocks(sinv_stored.to(torch.float64), *q.shape)


def round_bf16(x):
    """float64 -> the nearest bfloat16 value (ties to even), directly, without a float32 step; as float64."""
    m, e = torch.frexp(x)                       # x = m 2^e, 0.5 <= |m| < 1; bf16 keeps 8 significant bits
    return torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, 8))), e - 8)


def quantize_act_groups(a):
    """a: bf16 values as float32 [..., K]. Per 1 x 128 group along K (last one ragged):
    s = max(amax|a|, 1e-10) * float32(1/448), q = e4m3(clamp(a / s, +-448)). Returns q [..., K], s [..., G]."""
    K = a.shape[-1]
    qs, ss = [], []
    for j in range(0, K, BLOCK):
        g = a[..., j:j + BLOCK]
        s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) * INV448
        qs.append(torch.clamp(g / s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
        ss.append(s)
    return torch.cat(qs, -1), torch.cat(ss, -1)


def dequantize_act(q, s):
    K = q.shape[-1]
    return q.to(torch.float64) * s.to(torch.float64).repeat_interleave(BLOCK, -1)[..., :K]


def check_casts():
    """torch's float32 -> e4m3 cast rounds to nearest even (every midpoint between two neighbouring codes goes to
    the even one, the float32 values either side of it to the nearer code) and saturates at +-448 (we clamp before
    it anyway); round_bf16 equals torch's float32 -> bf16 cast on float32 values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(F32)
    vals = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])               # 0 .. 448, ascending
    lo, hi = vals[:-1], vals[1:]
    mid = ((lo.double() + hi.double()) / 2).to(F32)                                   # exact in float32
    even = torch.arange(len(vals), dtype=torch.int64)[:-1] % 2 == 0                  # codes ascend with the value
    want = torch.where(even, lo, hi)
    for sign in (1.0, -1.0):
        got = (sign * mid).to(torch.float8_e4m3fn).to(F32)
        below = (sign * torch.nextafter(mid, lo)).to(torch.float8_e4m3fn).to(F32)
        above = (sign * torch.nextafter(mid, hi)).to(torch.float8_e4m3fn).to(F32)
        if not (torch.equal(got, sign * want) and torch.equal(below, sign * lo) and torch.equal(above, sign * hi)):
            fail("torch's float32 -> float8_e4m3fn cast is not round-to-nearest-even")
    big = torch.tensor([448.0, 463.9, 464.0, 1e30], dtype=F32).to(torch.float8_e4m3fn).to(F32)
    if not torch.equal(big, torch.full_like(big, 448.0)):
        fail("torch's float32 -> float8_e4m3fn cast does not saturate at 448")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5), dtype=F32) * \
        torch.exp2(torch.randint(-30, 30, (1 << 20,), generator=torch.Generator().manual_seed(6))).to(F32)
    if not torch.equal(round_bf16(x.double()), x.to(torch.bfloat16).double()):
        fail("round_bf16 differs from torch's float32 -> bfloat16 cast")


# --------------------------------------------------------------------------------------------------------------
# Distances to rounding midpoints (the flip risk of a float32 forward)
# --------------------------------------------------------------------------------------------------------------

def bf16_midpoint_distance(x):
    """|x - nearest bf16 rounding midpoint| / |x| (inf for 0) and the other bf16 neighbour of x."""
    m, e = torch.frexp(x)
    y = torch.ldexp(m, torch.full_like(e, 8))   # |y| in [128, 256): bf16 values are the integers
    fl = torch.floor(y)
    d = (y - (fl + 0.5)).abs() / y.abs()
    r = torch.round(y)
    alt = torch.where(r == fl, fl + 1, fl)      # the neighbour that rounding did not choose
    return torch.where(x == 0, torch.full_like(x, float("inf")), d), torch.ldexp(alt, e - 8)


def e4m3_midpoint_distance(v):
    """|v - nearest e4m3 rounding midpoint| / |v| for v = a/s (|v| <= 448); subnormals have spacing 2^-9."""
    av = v.abs()
    m, e = torch.frexp(av)
    normal = av >= 2.0 ** -6
    y = torch.where(normal, torch.ldexp(m, torch.full_like(e, 4)), av * 2.0 ** 9)
    d = (y - (torch.floor(y) + 0.5)).abs() / y
    return torch.where(av == 0, torch.full_like(v, float("inf")), d)


class FlipStats:
    """Per fixture: quantized elements, and those whose float64 activation (bf16 step) or whose a/s (e4m3 step)
    lies within NEAR of a rounding midpoint; for the bf16 step also whether the other rounding changes q or s."""

    def __init__(self):
        self.n = 0
        self.bf16 = {t: 0 for t in NEAR}
        self.bf16_consequential = {t: 0 for t in NEAR}
        self.e4m3 = {t: 0 for t in NEAR}
        self.e4m3_ties = 0
        self.bf16_double_rounding = 0

    def add(self, x64, a, q, s):
        self.n += x64.numel()
        self.bf16_double_rounding += int((x64.to(F32).to(torch.bfloat16).to(torch.float64) != a.double()).sum())
        d, alt = bf16_midpoint_distance(x64)
        for t in NEAR:
            self.bf16[t] += int((d < t).sum())
        for idx in (d < max(NEAR)).nonzero().tolist():
            a2 = a.clone()
            a2[tuple(idx)] = alt[tuple(idx)].to(F32)
            row = tuple(idx[:-1])
            q2, s2 = quantize_act_groups(a2[row])
            changed = (not torch.equal(q2.view(torch.uint8), q[row].view(torch.uint8))) or \
                (not torch.equal(s2, s[row]))
            if changed:
                for t in NEAR:
                    self.bf16_consequential[t] += int(d[tuple(idx)] < t)
        de = e4m3_midpoint_distance((a / s.repeat_interleave(BLOCK, -1)[..., :a.shape[-1]]).double())
        self.e4m3_ties += int((de == 0).sum())
        for t in NEAR:
            self.e4m3[t] += int((de < t).sum())

    def summary(self):
        return {"quantized_elements": self.n,
                "bf16_near_midpoint": {f"{t:.0e}": v for t, v in self.bf16.items()},
                "bf16_near_midpoint_changing_q_or_s": {f"{t:.0e}": v for t, v in self.bf16_consequential.items()},
                "e4m3_near_midpoint": {f"{t:.0e}": v for t, v in self.e4m3.items()},
                "e4m3_exact_ties": self.e4m3_ties,
                "bf16_double_rounding_f64_f32_bf16": self.bf16_double_rounding}


# --------------------------------------------------------------------------------------------------------------
# The FP8 Linear in the HF model
# --------------------------------------------------------------------------------------------------------------

class Recorder:
    """What every FP8 Linear call quantized: (module, call) -> (q bytes, s); the worst |q s - a| against the e4m3
    half-ulp bound; flip statistics; a pause for the dtype audit while the quantizer runs."""

    def __init__(self, stats=None):
        self.calls = {}
        self.count = {}
        self.stats = stats
        self.audit_paused = False
        self.worst_bound = 0.0

    @contextlib.contextmanager
    def unaudited(self):
        saved, self.audit_paused = self.audit_paused, True
        try:
            yield
        finally:
            self.audit_paused = saved


class FP8Audit(mt.DtypeAudit):
    """mt.DtypeAudit that ignores the quantizer's own bf16/fp32/e4m3 steps."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.rec.audit_paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


# The FP8 Linears whose products the forward writes in bf16 (then read by SwiGLU), as a serving engine's FP8
# linear writes its output; every other product stays float64 here (the C forward keeps it in f32).
BF16_OUT = ("mlp.gate_proj", "mlp.up_proj")


def install_fp8_linears(model, wdeq, rec, quantize_act=True):
    """Replace the forward of every FP8 Linear: out = dequant(quant(x)) @ W_deq^T in float64 (cast to x's dtype),
    W_deq = wdeq[module name] (float64, dequantized from the saved file). quantize_act=False: out = x @ W^T in
    float64 (the self-check with the original weights, and the weight-only part of the FP8 error)."""
    patched = []
    for name, mod in model.named_modules():
        if name not in wdeq:
            continue
        if not isinstance(mod, torch.nn.Linear) or mod.bias is not None:
            fail(f"{name} is not a bias-free nn.Linear")

        def forward(x, _name=name):
            if not quantize_act:
                return F.linear(x.to(torch.float64), wdeq[_name]).to(x.dtype)
            with rec.unaudited():
                x64 = x.detach().to(torch.float64)
                a = round_bf16(x64).to(F32)
                q, s = quantize_act_groups(a)
                k = rec.count.get(_name, 0)
                rec.count[_name] = k + 1
                rec.calls[(_name, k)] = (q.view(torch.uint8).clone(), s.clone())
                if rec.stats is not None:
                    rec.stats.add(x64, a, q, s)
                xq = dequantize_act(q, s)
                # e4m3 keeps 4 significant bits: |q s - a| <= 2^-4 |a| (normal) or 2^-10 s (subnormal)
                bound = torch.maximum(a.double().abs() * 2.0 ** -4,
                                      s.double().repeat_interleave(BLOCK, -1)[..., :a.shape[-1]] * 2.0 ** -10)
                rec.worst_bound = max(rec.worst_bound, float(((xq - a.double()).abs() / bound).max()))
                out = F.linear(xq, wdeq[_name])
                if _name.endswith(BF16_OUT):  # the product written in bf16, as the C forward writes it
                    out = round_bf16(out)
                out = out.to(x.dtype)
            return out

        mod.forward = forward
        patched.append(name)
    missing = sorted(set(wdeq) - set(patched))
    if missing:
        fail(f"FP8 weights without a module in the model: {missing}")
    return patched


def block_formula(xq_q, xq_s, q, sinv):
    """out[m, n] = sum_j sa[m, j] sw[n/128, j] sum_{k in j} qa[m, k] qw[n, k] (the C kernels' formula), float64."""
    M, K = xq_q.shape
    N = q.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64)
    qa, qw = xq_q.to(torch.float64), q.to(torch.float64)
    sw = sinv.to(torch.float64).repeat_interleave(BLOCK, 0)[:N]
    for j in range(0, K, BLOCK):
        part = qa[:, j:j + BLOCK] @ qw[:, j:j + BLOCK].T
        out += part * xq_s[:, j // BLOCK:j // BLOCK + 1].double() * sw[:, j // BLOCK][None, :]
    return out


# --------------------------------------------------------------------------------------------------------------
# Writing the FP8 checkpoint
# --------------------------------------------------------------------------------------------------------------

def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def write_fp8_checkpoint(src, dst, scale_dtype):
    """Copies the model directory src to dst with every FP8 Linear quantized; same files, same shards."""
    os.makedirs(dst)
    files = mt.checkpoint_files(src)
    where, sizes, n_el, not_converted = {}, 0, 0, set()
    for fn in files:
        out = {}
        for k, t in load_file(os.path.join(src, fn)).items():
            mod = fp8_module_of(k)
            if mod is None:
                out[k] = t
                not_converted.add(not_converted_name(k))
                continue
            q, sinv = quantize_weight(t)
            out[k] = q
            out[mod + ".weight_scale_inv"] = sinv.to(ST_DTYPES[scale_dtype])
        save_file(dict(sorted(out.items())), os.path.join(dst, fn), metadata={"format": "pt"})
        for k, t in out.items():
            where[k] = fn
            sizes += t.numel() * t.element_size()
            n_el += t.numel()
    idx_src = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(idx_src):
        with open(idx_src) as f:
            index = json.load(f)
        index["metadata"]["total_size"] = sizes
        if "total_parameters" in index["metadata"]:
            index["metadata"]["total_parameters"] = n_el
        index["weight_map"] = dict(sorted(where.items()))
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK],
                                  "modules_to_not_convert": sorted(not_converted)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copy(os.path.join(src, "generation_config.json"), os.path.join(dst, "generation_config.json"))


def read_fp8_checkpoint(model_dir):
    """{module: (q, stored scale)} by the loader's rule (F8_E4M3 with a `_scale_inv` companion), the other tensors,
    and the dtype counts from the headers."""
    counts, fp8, other = {}, {}, {}
    for fn in mt.checkpoint_files(model_dir):
        for k, v in header(os.path.join(model_dir, fn)).items():
            if k != "__metadata__":
                counts[v["dtype"]] = counts.get(v["dtype"], 0) + 1
        with safe_open(os.path.join(model_dir, fn), "pt") as f:
            keys = set(f.keys())
            for k in sorted(keys):
                t = f.get_tensor(k)
                if k.endswith(".weight_scale_inv"):
                    continue
                if t.dtype == torch.float8_e4m3fn:
                    sk = k[:-len("weight")] + "weight_scale_inv"
                    if sk not in keys:
                        fail(f"{model_dir}: {k} is F8_E4M3 without {sk} in the same file")
                    fp8[k[:-len(".weight")]] = (t, f.get_tensor(sk))
                else:
                    other[k] = t
    return fp8, other, counts


# --------------------------------------------------------------------------------------------------------------
# Checks against Transformers' own FP8 code
# --------------------------------------------------------------------------------------------------------------

def pad_blocks(t):
    N, K = t.shape
    out = torch.zeros((N + BLOCK - 1) // BLOCK * BLOCK, (K + BLOCK - 1) // BLOCK * BLOCK, dtype=t.dtype)
    out[:N, :K] = t
    return out


def check_against_transformers(src_model_dir, fp8):
    """Our quantizer (with torch's 448 * (1/a)) == Fp8Quantize and our dequantization == Fp8Dequantize, bit for
    bit, on the weights padded with zeros to whole 128 x 128 blocks (Transformers skips ragged shapes; zeros do not
    change a block's amax). Returns the number of weights, and of blocks and codes where the two ways to compute
    r = 448/a give different results."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(BLOCK, BLOCK), scale_fmt="float"))
    quant, dequant = hf_fp8.Fp8Quantize(cfg), hf_fp8.Fp8Dequantize(cfg)
    orig = {}
    for fn in mt.checkpoint_files(src_model_dir):
        orig.update(load_file(os.path.join(src_model_dir, fn)))
    blocks = codes = n_blocks = n_codes = 0
    for mod, (q, s) in fp8.items():
        N, K = q.shape
        w = orig[mod + ".weight"]
        tq, ts = quantize_weight(w, torch_rdiv=True)
        hf = quant._quantize_one(mod + ".weight", pad_blocks(w.to(F32)))
        if not torch.equal(hf[mod + ".weight"][:N, :K].view(torch.uint8), tq.view(torch.uint8)) or \
                not torch.equal(hf[mod + ".weight_scale_inv"], ts):
            fail(f"{mod}: our weight quantizer differs from Transformers' Fp8Quantize")
        mine_q, mine_s = quantize_weight(w)
        if not torch.equal(q.view(torch.uint8), mine_q.view(torch.uint8)):
            fail(f"{mod}: the saved FP8 weight differs from a fresh quantization")
        blocks += int((mine_s != ts).sum())
        codes += int((mine_q.view(torch.uint8) != tq.view(torch.uint8)).sum())
        n_blocks, n_codes = n_blocks + ts.numel(), n_codes + tq.numel()
        hf_w = dequant._dequantize_one(pad_blocks(q), s.to(F32), torch.float32)[:N, :K]
        if not torch.equal(hf_w, dequantize_weight(q, s).to(F32)):
            fail(f"{mod}: our dequantization differs from Transformers' Fp8Dequantize")
    return len(fp8), dict(blocks=blocks, of_blocks=n_blocks, codes=codes, of_codes=n_codes)


def check_transformers_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    c = FineGrainedFP8Config.from_dict(dict(qc))
    if list(c.weight_block_size) != [BLOCK, BLOCK] or c.activation_scheme != "dynamic" or \
            sorted(c.modules_to_not_convert) != qc["modules_to_not_convert"]:
        fail(f"{model_dir}: FineGrainedFP8Config reads the quantization_config differently")


# --------------------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------------------

def rel_l2(a, b):
    return float(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)))


def load_reference_model(name, src_model_dir, fp8_dir):
    """The HF model from the original checkpoint in float64 (make_target_fixtures' loader and checks), every
    non-FP8 tensor of the FP8 files checked equal to it, and the dequantized FP8 weights (float64) by module."""
    with open(os.path.join(src_model_dir, "config.json")) as f:
        cfg_src = json.load(f)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg_fp8 = json.load(f)
    cfg_fp8.pop("quantization_config")
    if cfg_fp8 != cfg_src:
        fail(f"{name}: the FP8 config.json is not the original plus quantization_config")
    cls = Qwen3_5ForConditionalGeneration if cfg_src["architectures"][0] == "Qwen3_5ForConditionalGeneration" \
        else Qwen3_5ForCausalLM
    model = mt.load_f64(cls, src_model_dir, name)
    fp8, other, counts = read_fp8_checkpoint(fp8_dir)
    sd = model.state_dict()
    for k, t in other.items():
        if k.startswith("mtp."):
            continue
        if k not in sd or not torch.equal(sd[k], t.to(torch.float64)):
            fail(f"{name}: non-FP8 tensor {k} differs from the original checkpoint")
    want = sorted(fp8_module_of(k) for k in sd if fp8_module_of(k))
    if sorted(fp8) != want:
        fail(f"{name}: FP8 tensors {sorted(set(fp8) ^ set(want))} are not the intended set")
    wdeq = {}
    for mod, (q, s) in fp8.items():
        wdeq[mod] = dequantize_weight(q, s)
        sd[mod + ".weight"].copy_(wdeq[mod])                   # so that nothing reads the bf16 weight
    return model, fp8, wdeq, counts


@torch.no_grad()
def make_fixture(name, src, dst):
    scale_dtype = SCALE_DTYPES[name]
    log(f"== {name}: FP8 copy of {os.path.relpath(src, REPO)}, weight_scale_inv {scale_dtype}")
    os.makedirs(dst, exist_ok=True)
    write_fp8_checkpoint(os.path.join(src, "model"), os.path.join(dst, "model"), scale_dtype)
    shutil.copy(os.path.join(src, "input.safetensors"), os.path.join(dst, "input.safetensors"))
    check_transformers_config(os.path.join(dst, "model"))
    model, fp8, wdeq, counts = load_reference_model(name, os.path.join(src, "model"), os.path.join(dst, "model"))
    n_hf, rdiv = check_against_transformers(os.path.join(src, "model"), fp8)
    log(f"    {n_hf} FP8 weights: quantizer == Transformers' Fp8Quantize, dequantization == Fp8Dequantize; "
        f"r = 448/a vs 448*(1/a): {rdiv['blocks']} of {rdiv['of_blocks']} scales, {rdiv['codes']} of "
        f"{rdiv['of_codes']} codes differ")
    inp = load_file(os.path.join(dst, "input.safetensors"))
    ids, cu = inp["input_ids"], inp["cu_seqlens"]
    seqlens = (cu[1:] - cu[:-1]).tolist()

    stats = FlipStats()
    rec = Recorder(stats)
    install_fp8_linears(model, wdeq, rec)
    audit = FP8Audit(rec)
    with mt.hf_float64():
        ref = mt.run_packed(model, ids, seqlens, audit=audit)
    if audit.bad:
        fail(f"{name}: the float64 forward produced non-float64 tensors outside the quantizer: {audit.bad}")
    if any(rec.count.get(m, 0) != len(seqlens) for m in wdeq):
        fail(f"{name}: some FP8 Linear was not called once per sequence: {rec.count}")
    if not rec.worst_bound <= 1.0:
        fail(f"{name}: |q s - a| exceeds the e4m3 half-ulp bound ({rec.worst_bound:.3f})")
    cfg = model.config.get_text_config()
    want = [f"layer_{i}" for i in range(cfg.num_hidden_layers)] + ["final_norm", "logits"]

    checks = {}
    worst = 0.0
    for (mod, k), (qa, sa) in rec.calls.items():
        qw, sw = fp8[mod]
        qa, sa = qa.view(torch.float8_e4m3fn).reshape(-1, qa.shape[-1]), sa.reshape(-1, sa.shape[-1])
        direct = F.linear(dequantize_act(qa, sa), wdeq[mod])
        worst = max(worst, mt.max_rel(block_formula(qa, sa, qw, sw), direct))
    if not worst <= 1e-12:
        fail(f"{name}: the block-scaled formula differs from dequantize-then-multiply ({worst:.2e})")
    checks["block_formula_vs_dequantized"] = worst
    with mt.hf_float64():
        rec_p = Recorder()
        install_fp8_linears(model, wdeq, rec_p)
        checks["packed_vs_padded"] = mt.compare("packed per sequence == batch-padded (FP8 Linears)",
                                                mt.run_padded(model, ids, seqlens), ref, TOL_SELF)

    # the patched Linears with the original weights and no quantization give the original reference; with the
    # FP8 weights alone they give the weight-only part of the FP8 error
    orig = {}
    for fn in mt.checkpoint_files(os.path.join(src, "model")):
        orig.update(load_file(os.path.join(src, "model", fn)))
    base = load_file(os.path.join(src, "ref.safetensors"))
    with mt.hf_float64():
        install_fp8_linears(model, {m: orig[m + ".weight"].to(torch.float64) for m in wdeq}, None, False)
        checks["unquantized_vs_source_ref"] = mt.compare("patched Linears, original weights == source ref",
                                                         mt.run_packed(model, ids, seqlens), base, TOL_SELF)
        install_fp8_linears(model, wdeq, None, False)
        w_only = mt.run_packed(model, ids, seqlens)
    # what a float32 forward (HF's stock float32 model, the same quantizer) reaches, and how many quantized
    # activations it rounds differently from the float64 one
    model.to(torch.float32)
    rec32 = Recorder()
    install_fp8_linears(model, wdeq, rec32)
    sim = mt.run_packed(model, ids, seqlens)
    q_diff = s_diff = n_q = n_s = 0
    per_module = {}
    for key, (qa, sa) in rec.calls.items():
        qb, sb = rec32.calls[key]
        dq, ds = int((qa != qb).sum()), int((sa != sb).sum())
        q_diff, s_diff, n_q, n_s = q_diff + dq, s_diff + ds, n_q + qa.numel(), n_s + sa.numel()
        if dq or ds:
            per_module[key[0]] = per_module.get(key[0], 0) + dq
    sim_err = {k: float(f"{rel_l2(sim[k], ref[k]):.3e}") for k in want}
    log(f"    float32 simulation: worst relative L2 {max(sim_err.values()):.2e}; "
        f"{q_diff} of {n_q} activation codes and {s_diff} of {n_s} group scales differ from float64")

    vs_bf16 = {k: float(f"{rel_l2(ref[k], base[k]):.3e}") for k in want}
    w_only_vs_bf16 = {k: float(f"{rel_l2(w_only[k], base[k]):.3e}") for k in want}
    log(f"    FP8 vs the original reference: relative L2 layer_0 {vs_bf16['layer_0']:.2e}, "
        f"final_norm {vs_bf16['final_norm']:.2e}, logits {vs_bf16['logits']:.2e}")
    meta = {"generator": "tests/oracle/make_fp8_fixtures.py", "torch": torch.__version__,
            "transformers": transformers.__version__, "scale_dtype": scale_dtype}
    save_file({k: ref[k].to(torch.float64).contiguous() for k in want}, os.path.join(dst, "ref.safetensors"),
              metadata=meta)

    shapes = sorted({tuple(q.shape) for q, _ in fp8.values()})
    return dict(
        name=name, source=os.path.relpath(src, REPO), scale_dtype=scale_dtype,
        quantization_config={k: v for k, v in json.load(open(os.path.join(dst, "model", "config.json")))
                             ["quantization_config"].items() if k != "modules_to_not_convert"},
        n_modules_to_not_convert=len(json.load(open(os.path.join(dst, "model", "config.json")))
                                     ["quantization_config"]["modules_to_not_convert"]),
        tensor_dtype_counts=counts, n_fp8_weights=len(fp8), fp8_weight_shapes=[list(s) for s in shapes],
        checkpoint_files=mt.checkpoint_files(os.path.join(dst, "model")), T=int(cu[-1]), seqlens=seqlens,
        ref_tensors={k: dict(dtype="F64", shape=list(ref[k].shape)) for k in want},
        fp8_vs_bf16_rel_l2=vs_bf16, fp8_weights_only_vs_bf16_rel_l2=w_only_vs_bf16,
        self_checks=dict({k: float(f"{v:.3e}") for k, v in checks.items()}, weights_vs_transformers_fp8="bitwise (with torch's 448*(1/a))",
                         act_quant_half_ulp_bound=round(rec.worst_bound, 4)),
        weight_r_448_div_a_vs_torch_rdiv=rdiv,
        float32_simulation=dict(rel_l2=sim_err, act_codes_differing=q_diff, act_codes=n_q,
                                group_scales_differing=s_diff, group_scales=n_s,
                                modules_with_differences=dict(sorted(per_module.items()))),
        flip_risk=stats.summary(),
    )


def verify(committed_root, fresh_root, names):
    bad = []
    for n in names:
        a, b = os.path.join(committed_root, n), os.path.join(fresh_root, n)
        fa, fb = mt.dir_files(a), mt.dir_files(b)
        if fa != fb:
            bad.append(f"{n}: file lists differ: {sorted(set(fa) ^ set(fb))}")
            continue
        for f in fa:
            if f == "ref.safetensors":
                ra, rb = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
                for k in rb:
                    if k not in ra or ra[k].shape != rb[k].shape or mt.max_rel(ra[k], rb[k]) > 1e-12:
                        bad.append(f"{n}/{f}: {k} differs")
            elif mt.sha256(os.path.join(a, f)) != mt.sha256(os.path.join(b, f)):
                bad.append(f"{n}/{f}: bytes differ")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src-dir", default=SRC_ROOT, help="the bf16 fixtures (default: tests/fixtures/target)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "fixtures", "target_fp8"),
                    help="where the FP8 fixtures go (default: tests/fixtures/target_fp8)")
    ap.add_argument("--only", action="append", default=[], help="build only this fixture (repeatable)")
    ap.add_argument("--verify", action="store_true",
                    help="rebuild into a temporary directory and compare with what --out-dir holds")
    args = ap.parse_args()

    mt.check_environment()
    check_casts()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    names = list(SCALE_DTYPES)
    for n in args.only:
        if n not in names:
            fail(f"unknown fixture '{n}'; known: {', '.join(names)}")
    selected = [n for n in names if not args.only or n in args.only]
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")

    if args.verify:
        with tempfile.TemporaryDirectory() as tmp:
            for n in selected:
                make_fixture(n, os.path.join(args.src_dir, n), os.path.join(tmp, n))
            bad = verify(args.out_dir, tmp, selected)
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
    for n in selected:
        fdir = os.path.join(args.out_dir, n)
        if os.path.isdir(fdir):
            shutil.rmtree(fdir)
        entries[n] = mt.finish_summary(make_fixture(n, os.path.join(args.src_dir, n), fdir), fdir, args.out_dir)
    manifest["generator"] = "tests/oracle/make_fp8_fixtures.py"
    manifest["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}
    manifest["conventions"] = {
        "fp8_linears": "per decoder layer: " + ", ".join(FP8_MODULES) + "; every other tensor as in the source",
        "weights": "per 128x128 block (ragged last blocks): a = max(amax, 1e-12), r = 448/a (fp32), "
                   "q = e4m3(clamp(w r, +-448)) (nearest even), weight_scale_inv = 1/r stored as scale_dtype; "
                   "the reference uses q * float(stored scale)",
        "activations": "at every FP8 Linear input, per token in 1x128 groups along K (last ragged): a = bf16(x) "
                       "(nearest even, from float64), s = max(amax|a|, 1e-10) * float32(1/448) (fp32), "
                       "q = e4m3(clamp(a/s, +-448)) (fp32 divide, nearest even); out = (q s) @ W_deq^T in float64",
        "ref": "F64 layer_<i> [T, D], final_norm [T, D], logits [T, V]; everything else float64 as "
               "make_target_fixtures.py (one forward per sequence, HF's float32 casts promoted)",
        "fp8_vs_bf16_rel_l2": "||ref_fp8 - ref_source|| / ||ref_source|| per tensor (the source fixture's "
                              "float64 reference of the unquantized model)",
        "flip_risk": "elements whose float64 activation lies within 1e-7/1e-6/1e-5 (relative) of a bf16 rounding "
                     "midpoint (and how many of those would change a code or a group scale if rounded the other "
                     "way), and whose a/s lies within that of an e4m3 midpoint",
        "float32_simulation": "the same model in float32 (HF's stock float32 code, FP8 Linears as above with the "
                              "product in float64): relative L2 against ref, activation codes and scales differing",
    }
    manifest["fixtures"] = [entries[n] for n in names if n in entries]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"wrote {manifest_path}")


if __name__ == "__main__":
    main()
