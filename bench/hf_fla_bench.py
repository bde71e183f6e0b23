#!/usr/bin/env python3
"""bench/hf_fla_bench.py: the Hugging Face Transformers side of bench/target_bench.sh.

Builds the text model of a Qwen3.5/3.6, Qwen3.5-MoE or Qwen3-Next config (Qwen3_5TextModel,
Qwen3_5MoeTextModel or Qwen3NextModel: all decoder layers and the final norm, no LM head, as the
target-server's forward; MoE experts through Transformers' default experts implementation) in bf16 on one GPU with random
weights of the same ranges as `target-server --init random`, and times its forward over the
same packed batch as bench_ts_target (--pack: the cu_seqlens JSON of `bench_ts_target
--mix-only`). The flash-linear-attention (FLA) wheel supplies chunk_gated_delta_rule and
the fused gated norm when it is importable (Transformers picks it up by itself); attention is
PyTorch SDPA; the causal conv1d is Transformers' torch path unless causal-conv1d is installed.

Two ways to run a pack:
  per-seq  each sequence as its own batch of one (the packing-correct way: Transformers'
           torch conv path ignores sequence boundaries)
  packed   the whole pack as one row, position ids restarting per sequence and FLA's
           cu_seqlens (attention then uses a block-causal mask; the conv leaks 3 tokens
           across boundaries, which changes no cost)
Per-layer times come from CUDA events in forward hooks on every mixer (linear_attn /
self_attn) and MLP. Prints a table; --json writes the numbers.
"""
import argparse
import json
import math
import sys
import time

import torch


def log(*a):
    print(*a, flush=True)


# The text model of each config family Tandem serves, by the text model's model_type.
TEXT_MODELS = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5TextModel"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeTextModel"),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextModel"),
}


def build(cfg_path, device):
    import importlib

    import transformers

    raw = json.load(open(cfg_path))
    tc = dict(raw.get("text_config", raw))
    mt = tc.pop("model_type", None) or "qwen3_5_text"
    mt = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(mt, mt)
    pkg, cfg_cls, model_cls = TEXT_MODELS[mt]
    conf = importlib.import_module(f"transformers.models.{pkg}.configuration_{pkg}")
    mq = importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")
    cfg = getattr(conf, cfg_cls)(**tc)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = getattr(mq, model_cls)(cfg)
    model = model.to_empty(device=device)
    bound = 0.02 * math.sqrt(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.9, 1.1)
            elif name.endswith("A_log"):
                p.uniform_(0.0, math.log(16.0))
            elif name.endswith("dt_bias"):
                p.uniform_(0.5, 1.5)
            elif "conv1d" in name:
                p.uniform_(-0.5, 0.5)
            elif p.dim() >= 2:
                p.uniform_(-bound, bound)
            else:
                p.uniform_(-0.1, 0.1)
    # buffers made on the meta device (the rotary inv_freq) are recomputed on the GPU
    model.rotary_emb = type(model.rotary_emb)(config=cfg, device=device)
    model.eval()
    return model, cfg, transformers.__version__


def which_kernels(model, device):
    """Names of the CUDA kernels one short forward launches (FLA's are Triton kernels named chunk_*)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, 1000, (1, 256), device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()})
    fla = [n for n in names if "chunk" in n or "fused" in n.lower() or "gated" in n.lower() or "l2norm" in n]
    return fla, names


class LayerTimer:
    """CUDA events around every mixer and MLP of the decoder layers."""

    def __init__(self, model, cfg):
        self.ev = []
        self.handles = []
        for i, layer in enumerate(model.layers):
            kind = "gdn" if cfg.layer_types[i] == "linear_attention" else "attention"
            mixer = layer.linear_attn if kind == "gdn" else layer.self_attn
            for mod, k in ((mixer, kind), (layer.mlp, "mlp")):
                rec = {"kind": k, "start": [], "end": []}
                self.ev.append(rec)
                self.handles.append(mod.register_forward_pre_hook(self._pre(rec)))
                self.handles.append(mod.register_forward_hook(self._post(rec)))

    @staticmethod
    def _pre(rec):
        def f(mod, args):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            rec["start"].append(e)

        return f

    @staticmethod
    def _post(rec):
        def f(mod, args, out):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            rec["end"].append(e)

        return f

    def summary(self):
        torch.cuda.synchronize()
        tot = {}
        for rec in self.ev:
            ms = sum(s.elapsed_time(e) for s, e in zip(rec["start"], rec["end"]))
            k = rec["kind"]
            n, t = tot.get(k, (0, 0.0))
            tot[k] = (n + 1, t + ms)
        return {k: t / n for k, (n, t) in tot.items()}  # ms per layer per forward

    def remove(self):
        for h in self.handles:
            h.remove()


def run_pack(model, lens, mode, device, gen):
    T = sum(lens)
    ids = torch.randint(0, 248000, (T,), device=device, generator=gen)
    if mode == "per-seq":
        off = 0
        for L in lens:
            model(input_ids=ids[off:off + L].unsqueeze(0), use_cache=False)
            off += L
    else:
        pos = torch.cat([torch.arange(L, device=device) for L in lens]).unsqueeze(0)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        model(input_ids=ids.unsqueeze(0), position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=max(lens), max_length_k=max(lens))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--pack", required=True, help="JSON with cu_seqlens (bench_ts_target --mix-only)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--modes", default="per-seq,packed")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = "cuda"
    t0 = time.time()
    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # the comparison is meaningless without FLA: say so loudly
        fla_version = f"NOT IMPORTABLE ({e})"
    cu = json.load(open(a.pack))["cu_seqlens"]
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    T = cu[-1]
    model, cfg, tf_version = build(a.config, device)
    torch.cuda.synchronize()
    t_built = time.time() - t0
    log(f"transformers {tf_version}, torch {torch.__version__}, fla {fla_version}; model built in {t_built:.1f} s, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    fla_kernels, all_kernels = which_kernels(model, device)
    log("FLA/Triton kernels seen in a short forward:", ", ".join(fla_kernels[:12]) or "none")
    res = {"transformers": tf_version, "torch": torch.__version__, "fla": fla_version, "tokens": T, "lens": lens,
           "fla_kernels": fla_kernels, "modes": {}}
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    for mode in a.modes.split(","):
        try:
            with torch.inference_mode():
                tw = time.time()
                run_pack(model, lens, mode, device, gen)  # warm-up: Triton compiles and autotunes here
                torch.cuda.synchronize()
                warm = time.time() - tw
                run_pack(model, lens, mode, device, gen)
                torch.cuda.synchronize()
                times = []
                for _ in range(a.iters):
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    run_pack(model, lens, mode, device, gen)
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                times.sort()
                ms = times[len(times) // 2]
                timer = LayerTimer(model, cfg)
                run_pack(model, lens, mode, device, gen)
                per_layer = timer.summary()
                timer.remove()
            r = {"forward_ms": ms, "tokens_per_s": T / (ms / 1e3), "first_call_s": warm, "per_layer_ms": per_layer,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            log(f"{mode}: forward {ms:.1f} ms = {T / (ms / 1e3):.0f} tok/s (first call {warm:.1f} s); per layer ms: "
                + ", ".join(f"{k} {v:.3f}" for k, v in per_layer.items()))
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
            log(f"{mode}: FAILED {r['error']}")
        res["modes"][mode] = r
        torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
