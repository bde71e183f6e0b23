#!/usr/bin/env python3
"""tests/oracle/bf16_baseline.py — how far Hugging Face Transformers' own bf16 (and fp32) forward is from the
float64 references of the target fixtures: the error a correct bf16 implementation can be expected to reach.

For each fixture of tests/fixtures/target (the three MoE ones of make_moe_fixtures.py and the three dense ones of
make_target_fixtures.py) it loads the SAVED checkpoint with the oracle's class, in torch.bfloat16 and then in
torch.float32 (from_pretrained(dtype=..., attn_implementation="eager"), as the oracle's float32 check does; the
experts run HF's per-expert loop, experts_implementation="eager", as in the float64 reference: Transformers'
default, grouped_mm, refuses bf16 experts whose rows are not a multiple of 16 bytes, as in qwen35moe_flat_experts
and qwen3next_flat; --experts default asks for it anyway), runs the oracle's packed
forward (mt.run_packed: one forward per packed sequence, positions from 0, hooks on every decoder layer, the final
norm and the lm_head) on input.safetensors and prints, per tensor of ref.safetensors, the relative L2
||got - ref|| / ||ref|| (in float64); for MoE fixtures the router's choices are captured as the oracle does
(route_capture: hooks on every MoE layer's router) and compared with experts_<i> by the rule of
tests/test_ts_dump.c's routing_mismatches (a (token, layer) row differs when the SET of its chosen experts
differs; the order is ignored). Rows whose order alone differs are shown in brackets. CPU only, seconds on 2 cores.

With --write it also writes, for each fixture it measured, tests/fixtures/target/<name>/hf_bf16.json: the bf16
figures (4 significant digits) with the versions and experts implementation that gave them,
    {"transformers": ..., "torch": ..., "experts_implementation": "eager", "tensors": {"layer_0": 0.01193, ...},
     "routing_rows": 3138, "routing_differ": 115}
(experts_implementation and the routing fields for MoE fixtures only). tests/test_ts_dump.c's cuda bf16 run
prints them beside its own figures; they do not loosen its tolerances. Regenerating a fixture
(make_*_fixtures.py) removes its directory and so this file: rerun with --write after it.

Run it in the oracle's environment (torch 2.15.0, transformers 5.24.0, no fla / causal_conv1d / kernels /
flash_attn; see tests/oracle/README.md), from the repository root:

    /tmp/venv-oracle/bin/python tests/oracle/bf16_baseline.py [--only NAME]... [--experts eager|default] [--write]
"""

import argparse
import contextlib
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_moe_fixtures as moe  # noqa: E402  (the MoE oracle: classes, router capture)
import make_target_fixtures as mt  # noqa: E402  (the dense oracle: packed runs)

FIXTURE_DIR = os.path.join(mt.REPO, "tests", "fixtures", "target")
FIXTURES = {fx["name"]: fx for fx in moe.FIXTURES + mt.FIXTURES}
ORDER = ["qwen35moe_mm_fused", "qwen35moe_flat_experts", "qwen3next_flat",
         "qwen35_flat_f32_tied", "qwen35_mm_sharded", "qwen36_mm_single_bf16"]
DTYPES = [("bf16", torch.bfloat16), ("fp32", torch.float32)]


def model_class(fx):
    """The class the oracle built and loads the fixture with."""
    if "family" in fx:
        return moe.build_config(fx)[1]
    return mt.Qwen3_5ForConditionalGeneration if fx["layout"] == "multimodal" else mt.Qwen3_5ForCausalLM


def family_of(fx):
    return moe.family_of(fx) if "family" in fx else contextlib.nullcontext()


def load_input(fdir):
    inp = load_file(os.path.join(fdir, "input.safetensors"))
    cu = inp["cu_seqlens"].tolist()
    return inp["input_ids"], [b - a for a, b in zip(cu, cu[1:])]


def rel_l2(got, ref):
    g, r = got.to(torch.float64), ref.to(torch.float64)
    return (torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r)).item()


def routing_diffs(got, ref):
    """(rows whose chosen-expert set differs, rows whose set or order differs, rows) against the reference."""
    by_set = by_order = rows = 0
    for name, r in ref.items():
        g = got[int(name.split("_")[1])].to(torch.int32)
        if g.shape != r.shape:
            raise SystemExit(f"bf16_baseline: routing {name} has shape {tuple(g.shape)}, want {tuple(r.shape)}")
        by_set += int((g.sort(-1).values != r.sort(-1).values).any(-1).sum())
        by_order += int((g != r).any(-1).sum())
        rows += r.shape[0]
    return by_set, by_order, rows


@torch.no_grad()
def run(fx, fdir, dtype, experts):
    """Packed forward of the saved checkpoint in `dtype`: ({tensor: output}, {moe layer: indices [T, K]} or None,
    the experts implementation used)."""
    ids, seqlens = load_input(fdir)
    kw = {"experts_implementation": experts} if experts != "default" and "family" in fx else {}
    model = model_class(fx).from_pretrained(os.path.join(fdir, "model"), dtype=dtype,
                                            attn_implementation="eager", **kw).eval()
    impl = getattr(model.config, "_experts_implementation", None) if "family" in fx else None
    with family_of(fx):
        if "family" not in fx:
            return mt.run_packed(model, ids, seqlens), None, impl
        with moe.route_capture(model) as calls:
            out = mt.run_packed(model, ids, seqlens)
        return out, {i: idx for i, (_, idx) in moe.packed_routes(calls).items()}, impl


def measure(name, experts):
    """{dtype label: ({tensor: rel L2}, routing diffs or None, experts impl)} for one fixture."""
    fdir = os.path.join(FIXTURE_DIR, name)
    ref = load_file(os.path.join(fdir, "ref.safetensors"))
    hidden = {k: v for k, v in ref.items() if not k.startswith("experts_")}
    routes = {k: v for k, v in ref.items() if k.startswith("experts_")}
    res = {}
    for label, dtype in DTYPES:
        out, got_routes, impl = run(FIXTURES[name], fdir, dtype, experts)
        if sorted(out) != sorted(hidden):
            raise SystemExit(f"bf16_baseline: {name}: captured {sorted(out)}, reference has {sorted(hidden)}")
        errs = {k: rel_l2(out[k], hidden[k]) for k in hidden}
        res[label] = errs, (routing_diffs(got_routes, routes) if routes else None), impl
    return res


def tensor_order(names):
    layers = sorted((n for n in names if n.startswith("layer_")), key=lambda n: int(n.split("_")[1]))
    return layers + ["final_norm", "logits"]


def fmt_routes(r):
    return "-" if r is None else f"{r[0]}/{r[2]} [{r[1]}]"


def report(name, res):
    errs = {label: res[label][0] for label, _ in DTYPES}
    impl = res["bf16"][2]
    print(f"\n== {name}" + (f"  (experts_implementation {impl})" if impl else ""))
    print(f"   {'tensor':12s} {'bf16 rel L2':>15s} {'fp32 rel L2':>15s}")
    for k in tensor_order(errs["bf16"]):
        print(f"   {k:12s} {errs['bf16'][k]:15.3e} {errs['fp32'][k]:15.3e}")
    if res["bf16"][1] is not None:
        print(f"   {'routing':12s} {fmt_routes(res['bf16'][1]):>15s} {fmt_routes(res['fp32'][1]):>15s}"
              f"   (rows whose expert set differs / rows [set or order])")


def summary_line(name, res):
    parts = []
    for label, _ in DTYPES:
        errs, routes, _ = res[label]
        k = max(errs, key=errs.get)
        r = "" if routes is None else f", routing {routes[0]}/{routes[2]} differ [{routes[1]} incl. order]"
        parts.append(f"{label} worst {errs[k]:.3e} ({k}){r}")
    return f"{name:24s} " + "; ".join(parts)


def sig4(x):
    """x to 4 significant digits (a float, written by json as its shortest repr)."""
    return float(f"{x:.3e}")


def write_baseline(name, res):
    """tests/fixtures/target/<name>/hf_bf16.json: the bf16 figures test_ts_dump's cuda bf16 run reads."""
    errs, routes, impl = res["bf16"]
    doc = {"transformers": mt.transformers.__version__, "torch": torch.__version__}
    if impl:
        doc["experts_implementation"] = impl
    doc["tensors"] = {k: sig4(errs[k]) for k in tensor_order(errs)}
    if routes is not None:
        doc["routing_rows"], doc["routing_differ"] = routes[2], routes[0]
    path = os.path.join(FIXTURE_DIR, name, "hf_bf16.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, mt.REPO)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[], choices=ORDER, help="this fixture only (repeatable)")
    ap.add_argument("--experts", choices=["eager", "default"], default="eager",
                    help="MoE experts: HF's per-expert loop (eager, the default) or Transformers' default (grouped_mm)")
    ap.add_argument("--write", action="store_true",
                    help="write each measured fixture's bf16 figures to tests/fixtures/target/<name>/hf_bf16.json")
    args = ap.parse_args()
    mt.check_environment()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {mt.transformers.__version__}; relative L2 = "
          f"||got - ref|| / ||ref|| in float64 against tests/fixtures/target/<name>/ref.safetensors")
    results = {n: measure(n, args.experts) for n in ORDER if not args.only or n in args.only}
    for n, res in results.items():
        report(n, res)
    print("\nsummary (worst relative L2 over layers, final_norm, logits; routing rows differing by set)")
    for n, res in results.items():
        print(summary_line(n, res))
    if args.write:
        print()
        for n, res in results.items():
            write_baseline(n, res)


if __name__ == "__main__":
    main()
