#!/usr/bin/env python3
"""tests/oracle/forced_routing.py — a dump of a MoE fixture against the float64 oracle made to route as the dump
did: the error of the numbers alone, apart from the top-k calls that bf16 rounding flips.

On an input with close calls, a bf16 forward of these tiny random MoE models chooses another expert for a few
(token, layer) rows, where the K-th and (K+1)-th router logits are close (with uniform random tokens: 74 of 3138
rows for qwen35moe_mm_fused on CUDA, 115 for Transformers' own bf16; the committed inputs are chosen to leave no
such call, make_moe_fixtures.py's decisive_input), and a flipped expert moves that token's output and, through
attention and the GDN state, the tokens after it: the free-running relative L2 then measures the flips as much as the arithmetic.
Here the float64 reference is computed again with every MoE layer's router forced to the dump's experts
(experts_<i>, I32 [T, K]): each router call keeps its float64 logits and softmax, and its top-k is replaced by
the dump's choice, with the weights those experts get from the same softmax (renormalised where the model
renormalises), so what is left between the dump and this reference is the dump's arithmetic.

Self-check first: forced to the reference's own routing (ref.safetensors' experts_<i>), the float64 forward
must equal the unforced one bit for bit, or the forcing is wrong. Then, for each dump given, per tensor: the
relative L2 against the free reference (ref.safetensors) and against the forced one. Exits 1 when a forced
error is above --tol (default 3e-2, the bound of a bf16 run) or the self-check fails.

Run in the oracle's environment (tests/oracle/README.md), from the repository root; a dump is written by
    target-server dump --model F/model --input F/input.safetensors --out D --device cuda --precision bf16 --logits

    python tests/oracle/forced_routing.py NAME DUMP.safetensors [DUMP ...] [--tol 3e-2]
"""

import argparse
import contextlib
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bf16_baseline as bb  # noqa: E402  (fixture table, inputs, relative L2, tensor order)
import make_moe_fixtures as moe  # noqa: E402  (the MoE oracle: classes, MoE layers, per-expert conversion)
import make_target_fixtures as mt  # noqa: E402  (float64 loading and promotion, packed runs)


@contextlib.contextmanager
def forced_routes(model, routes, renorm):
    """Hooks on every MoE layer's router: its k-th call (one per packed sequence, in order) takes its top-k from
    routes[layer] (I32 [T, K], packed order) instead of its own, with the weights softmax(logits)[chosen]."""
    tm = mt.text_model(model)
    layers = moe.moe_layers(model)
    missing = [i for i in layers if i not in routes]
    if missing:
        raise SystemExit(f"forced_routing: no routing for MoE layers {missing} (experts_<i> in the dump)")
    offset = {i: 0 for i in layers}
    handles = []

    def hook(i):
        def fn(_mod, _inp, out):
            logits, _scores, idx = out
            n = logits.shape[0]
            chosen = routes[i][offset[i]:offset[i] + n].to(device=idx.device, dtype=idx.dtype)
            if chosen.shape != idx.shape:
                raise SystemExit(f"forced_routing: layer {i} rows {offset[i]}..{offset[i] + n}: routing "
                                 f"{tuple(chosen.shape)}, the router gives {tuple(idx.shape)}")
            offset[i] += n
            w = torch.softmax(logits, dim=-1).gather(-1, chosen)
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            return logits, w.to(logits.dtype), chosen
        return fn

    for i in layers:
        handles.append(tm.layers[i].mlp.gate.register_forward_hook(hook(i)))
    try:
        yield offset
    finally:
        for h in handles:
            h.remove()


def load_model(name, fdir):
    fx = bb.FIXTURES[name]
    as_model = moe.fuse_experts if fx["experts"] == "per-expert" else None
    model = mt.load_f64(bb.model_class(fx), os.path.join(fdir, "model"), name,
                        load_kw={"experts_implementation": "eager"}, as_model_keys=as_model)
    return model, getattr(model.config.get_text_config(), "norm_topk_prob", True)


@torch.no_grad()
def forced_forward(model, renorm, ids, seqlens, routes):
    with mt.hf_float64(), forced_routes(model, routes, renorm) as used:
        out = mt.run_packed(model, ids, seqlens)
    short = {i: (used[i], routes[i].shape[0]) for i in used if used[i] != routes[i].shape[0]}
    if short:
        raise SystemExit(f"forced_routing: rows the routers took against rows of routing, by layer: {short}")
    return out


def routes_of(tensors):
    return {int(k.split("_")[1]): v for k, v in tensors.items() if k.startswith("experts_")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=[n for n in bb.ORDER if "family" in bb.FIXTURES[n]], help="MoE fixture")
    ap.add_argument("dumps", nargs="+", help="target-server dump outputs of that fixture (with experts_<i>)")
    ap.add_argument("--tol", type=float, default=3e-2, help="largest forced relative L2 allowed (default 3e-2)")
    args = ap.parse_args()
    mt.check_environment()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # as the references were made: the float64 sums in the same order
    fdir = os.path.join(bb.FIXTURE_DIR, args.name)
    ids, seqlens = bb.load_input(fdir)
    ref = load_file(os.path.join(fdir, "ref.safetensors"))
    hidden = {k: v for k, v in ref.items() if not k.startswith("experts_")}
    order = bb.tensor_order(hidden)
    ok = True
    with bb.family_of(bb.FIXTURES[args.name]):
        model, renorm = load_model(args.name, fdir)
        with torch.no_grad(), mt.hf_float64():
            free = mt.run_packed(model, ids, seqlens)
        own = forced_forward(model, renorm, ids, seqlens, routes_of(ref))
        same = all(torch.equal(own[k], free[k]) for k in order)
        print(f"{args.name}: forced to the reference's own routing, the float64 forward equals the unforced one bit "
              f"for bit: {'yes' if same else 'NO'} (both {max(bb.rel_l2(free[k], hidden[k]) for k in order):.1e} "
              f"from ref.safetensors, made on another machine)")
        ok &= same
        for path in args.dumps:
            got = load_file(path)
            routes = routes_of(got)
            by_set, _, rows = bb.routing_diffs(routes, {k: v for k, v in ref.items() if k.startswith("experts_")})
            forced = forced_forward(model, renorm, ids, seqlens, routes)
            print(f"\n== {os.path.basename(path)}: {by_set} of {rows} (token, layer) expert sets differ from the "
                  f"oracle's")
            print(f"   {'tensor':12s} {'free rel L2':>12s} {'forced rel L2':>14s}")
            worst = ("", 0.0)
            for k in order:
                free, fo = bb.rel_l2(got[k], hidden[k]), bb.rel_l2(got[k], forced[k])
                print(f"   {k:12s} {free:12.3e} {fo:14.3e}")
                worst = max(worst, (k, fo), key=lambda t: t[1])
            bad = worst[1] > args.tol
            ok &= not bad
            print(f"   worst forced relative L2 {worst[1]:.3e} ({worst[0]}), tolerance {args.tol:.0e}: "
                  f"{'FAILED' if bad else 'ok'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
