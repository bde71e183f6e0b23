#!/usr/bin/env python3
"""bench/hf_decode_bench.py: the Hugging Face Transformers side of bench/decode_bench.sh.

The same model as bench/hf_fla_bench.py (Qwen3_5TextModel of the config in bf16 on one GPU, random weights of the
same ranges; FLA's kernels when importable) plus an LM head, decoding a batch the way bench_ts_decode does: N
prompts of --prompt tokens prefilled with the model's cache, then
  - target-only decoding: one token per sequence per step (cache in, argmax of the last logits out);
  - verification-shaped steps: B tokens per sequence per step through the cache (what a speculative decoder's
    verify forward costs; Transformers' hybrid cache cannot roll the GDN state back to an accepted prefix, so
    the step is timed without a roll-back and the cache simply grows by B).
Prints the per-step latency and tokens/s per (N, B); --json writes them.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_fla_bench import build  # noqa: E402  (the same model and weight ranges)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--seqs", default="1,8,32")
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model, cfg, tver = build(a.config, dev)
    try:
        import fla  # noqa: F401

        fla_ver = getattr(fla, "__version__", "?")
    except Exception:
        fla_ver = None
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.uniform_(-0.0346, 0.0346)
    print(f"transformers {tver}, fla {fla_ver}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}", flush=True)
    res = []
    g = torch.Generator(device=dev).manual_seed(1)
    for n in [int(x) for x in a.seqs.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (n, a.prompt), device=dev, generator=g)
        try:
            with torch.inference_mode():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(input_ids=ids, use_cache=True)
                cache = out.past_key_values
                nxt = head(out.last_hidden_state[:, -1:]).argmax(-1)
                torch.cuda.synchronize()
                prefill_ms = 1e3 * (time.perf_counter() - t0)
                print(f"  {n:2d} sequences: prefill {prefill_ms:.1f} ms", flush=True)
                for b in [1] + [int(x) for x in a.blocks.split(",")]:
                    total = 0.0
                    for k in range(a.steps + 2):
                        blk = torch.cat([nxt, torch.randint(0, cfg.vocab_size, (n, b - 1), device=dev, generator=g)], 1)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out = model(input_ids=blk, past_key_values=cache, use_cache=True)
                        cache = out.past_key_values
                        am = head(out.last_hidden_state).argmax(-1)
                        nxt = am[:, :1]
                        torch.cuda.synchronize()
                        if k >= 2:
                            total += time.perf_counter() - t0
                    ms = 1e3 * total / a.steps
                    res.append({"seqs": n, "block": b, "ms": ms, "tokens_per_s": n / (ms / 1e3)})
                    what = "target-only decode" if b == 1 else f"verify B = {b:2d}"
                    print(f"    {what}: {ms:.2f} ms per step" + (f", {n / (ms / 1e3):.0f} tokens/s" if b == 1 else ""),
                          flush=True)
                del cache, out
        except Exception as e:  # out of memory at a batch, say: the others stand
            print(f"  {n} sequences: {type(e).__name__}: {e}", flush=True)
            res.append({"seqs": n, "error": str(e)[:300]})
        torch.cuda.empty_cache()
    if a.json:
        json.dump({"transformers": tver, "fla": fla_ver, "prompt": a.prompt, "steps": a.steps, "results": res},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
