#!/usr/bin/env python3
"""tests/interop/zlab_decode.py — Tandem's drafter checkpoints in z-lab's `dflash` package, decoding for real.

For each drafter checkpoint given (a trained one and an untrained one per case):

1. Load: z-lab's `DFlashDraftModel.from_pretrained` (`DFlash2DraftModel` where config.json's architectures says
   so), in float32. Any missing, unexpected or mismatched key fails the run, and so does a parameter whose loaded
   value is not the checkpoint's tensor (a loader that silently re-initialised something).
2. Decode: z-lab's own decoder, `dflash.model.dflash_generate`, greedy, against the target loaded by Hugging Face
   Transformers (`AutoModelForCausalLM`: the Qwen3.5 classes, float32, CPU), on every prompt of the held-out split
   (the prompt = the tokens before the first supervised token), at most --max-new-tokens new tokens, stopping at
   the target's eos.
3. Check it is lossless: each prompt's speculative output must equal the target's own greedy output
   (Transformers `generate`, do_sample=False, the same cap and eos), token for token.
4. Measure the real τ: tokens produced by verify steps (accepted drafts plus the bonus token) / verify steps,
   pooled over the prompts (z-lab's `acceptance_lengths`; the first token, from the prefill, is not counted).

The fix. dflash 0.1.0's loop verifies a block, then rolls the target's cache back to the accepted length with
`DynamicCache.crop`. On a hybrid target that crop is not a rollback: a Gated DeltaNet layer's crop trims its
convolution window but its recurrent state keeps every token of the block, the rejected ones included, so the
next step decodes from a state that has seen tokens that are not in the output. This script wraps the target
(`RollbackTarget`: it deep-copies the cache before every verify forward) and patches `dflash.model._crop_to`: when
a crop would drop tokens of a verified block, the cache is restored to the copy and the kept tokens are run
through the target again, so every layer's state is exactly that of the committed tokens. With --unfixed the same
prompts are also decoded without the fix, and the number of lossless prompts is reported (not a failure).
Nothing else of z-lab's code is changed; `_cuda_time` is pointed at the CPU clock so `return_stats` works
without a GPU.

  zlab_decode.py --target DIR --valid FILE.jsonl --max-new-tokens N [--jobs J] [--unfixed] [--untrained-every K]
                 [--prompts N] [--tandem-tau HELDOUT.json] [--table-note TEXT]
                 --case NAME TRAINED_DIR UNTRAINED_DIR [--case ...]
  zlab_decode.py --config-check CONFIG.json     # builds z-lab's model from a drafter config, prints what it read

Exit status 0 when every checkpoint loads cleanly, every decode is lossless and each case's trained drafter has a
higher real τ than its untrained one; 1 otherwise (the reasons are printed).
"""

import argparse
import copy
import json
import multiprocessing as mp
import os
import sys
import time

import torch

import dflash.model as zl
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

# ----------------------------------------------------------------------------------------------------------------
# z-lab's decoder on a hybrid target: the rollback fix
# ----------------------------------------------------------------------------------------------------------------


class RollbackTarget:
    """The Transformers target as dflash_generate sees it (every attribute is the target's), counting verify
    forwards and, when `rollback` is set, keeping a deep copy of the cache from before each one."""

    def __init__(self, target, rollback, trace=None):
        self._target = target
        self.rollback = rollback
        self._snap = None
        self.verify_steps = 0
        self.restores = 0
        self.trace = trace  # a list: gets (the verified block's ids, the target's argmax ids) per verify forward

    def __getattr__(self, name):  # device, config, get_input_embeddings, lm_head, generation_config, ...
        return getattr(self._target, name)

    def __call__(self, input_ids, past_key_values=None, position_ids=None, **kwargs):
        self._snap = None
        if past_key_values is not None and past_key_values.get_seq_length() > 0:  # a verify (not the prefill)
            self.verify_steps += 1
            if self.rollback:
                self._snap = (past_key_values, past_key_values.get_seq_length(),
                              copy.deepcopy(past_key_values.layers), input_ids, position_ids)
            out = self._target(input_ids, past_key_values=past_key_values, position_ids=position_ids, **kwargs)
            if self.trace is not None:
                self.trace.append((input_ids[0].tolist(), out.logits[0].argmax(-1).tolist()))
            return out
        return self._target(input_ids, past_key_values=past_key_values, position_ids=position_ids, **kwargs)

    def restore(self, cache, length):
        """Before z-lab crops `cache` to `length`: if that drops tokens of the block just verified, put the
        cache back as it was before the verify and run the kept tokens again."""
        snap = self._snap
        if snap is None or snap[0] is not cache:  # the prefill's crop, or the drafter's own cache
            return
        self._snap = None
        if cache.get_seq_length() <= length:  # every drafted token accepted: nothing to take back
            return
        _, before, layers, input_ids, position_ids = snap
        cache.layers = layers
        keep = length - before
        if keep > 0:
            self._target(input_ids[:, :keep], position_ids=position_ids[:, :keep], past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.restores += 1


_ZLAB_CROP = zl._crop_to
_ACTIVE = None  # the RollbackTarget of the decode in progress


def _crop_with_rollback(cache, length):
    if _ACTIVE is not None:
        _ACTIVE.restore(cache, length)
    _ZLAB_CROP(cache, length)  # z-lab's crop: a no-op on the restored cache but for trimming the conv windows


zl._crop_to = _crop_with_rollback
zl._cuda_time = time.perf_counter  # return_stats times with torch.cuda.synchronize(); there is no GPU here


def speculative(draft, target, prompt, max_new, eos, rollback, trace=None):
    """z-lab's dflash_generate, greedy; returns (output ids, tokens from verify steps, verify steps). With a dict
    `trace`, also fills trace["acceptance_lengths"] (dflash_generate's, per verify step) and trace["verify"] (per
    verify forward: the block's ids, the anchor first, and the target's argmax at each of its positions)."""
    global _ACTIVE
    wrapped = RollbackTarget(target, rollback, None if trace is None else trace.setdefault("verify", []))
    _ACTIVE = wrapped
    try:
        r = zl.dflash_generate(draft, wrapped, prompt, max_new, eos, temperature=0.0, return_stats=True)
    finally:
        _ACTIVE = None
    out = r.output_ids[0].tolist()
    produced, steps = sum(r.acceptance_lengths), len(r.acceptance_lengths)
    if trace is not None:
        trace["acceptance_lengths"] = list(r.acceptance_lengths)
    if steps != wrapped.verify_steps or produced != len(out) - prompt.shape[1] - 1:
        raise RuntimeError(f"dflash_generate's stats disagree with the output: {steps} steps for "
                           f"{wrapped.verify_steps} verify forwards, {produced} tokens for "
                           f"{len(out) - prompt.shape[1] - 1}")
    return out, produced, steps


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------


def draft_class(config_path):
    with open(config_path) as f:
        arch = json.load(f).get("architectures") or []
    if "DFlash2DraftModel" in arch:
        return zl.DFlash2DraftModel
    if "DFlashDraftModel" in arch:
        return zl.DFlashDraftModel
    raise ValueError(f"'{config_path}': architectures {arch} names neither DFlashDraftModel nor DFlash2DraftModel")


def load_draft(path):
    """z-lab's from_pretrained; returns (model, problems): problems lists every key the loader missed, did not
    expect or could not fit, and every parameter whose loaded value differs from the file's tensor."""
    from safetensors.torch import load_file

    cls = draft_class(os.path.join(path, "config.json"))
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        for k in sorted(str(x) for x in info.get(what, ())):
            problems.append(f"{what[:-1].replace('_', ' ')}: {k}")
    params = dict(model.named_parameters())
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        p = params.get(name, params.get(name + ".weight"))  # DFlash2's codebooks are stored without .weight
        if p is None:
            if not any(name in x for x in problems):
                problems.append(f"tensor {name} is not a parameter of {cls.__name__}")
        elif tuple(p.shape) != tuple(t.shape) or not torch.equal(p.detach(), t.to(p.dtype)):
            problems.append(f"parameter {name} does not hold the checkpoint's tensor after loading")
    return model.eval(), problems


def describe(model):
    c = model.config
    attn = [(l.self_attn.is_causal, l.self_attn.sliding_window) for l in model.layers]
    s = (f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} parameters, block {model.block_size}, "
         f"mask {model.mask_token_id}, taps {list(model.target_layer_ids)}, rope theta "
         f"{(getattr(c, 'rope_parameters', None) or {}).get('rope_theta', getattr(c, 'rope_theta', None))}, "
         f"layers (causal, window) {attn}")
    if isinstance(model, zl.DFlash2DraftModel):
        conv = model.layers[0].attention_conv
        s += (f", conv kernel {conv.kernel_size} group {conv.group_size}, selector rank "
              f"{model.candidate_selector.hidden_projection.out_features} top-k {model.candidate_selector.top_k}")
    return s


def config_check(path):
    """Builds z-lab's model from a drafter config.json (random init) and prints what z-lab made of it."""
    from transformers import Qwen3Config

    cls = draft_class(path)
    cfg = Qwen3Config.from_json_file(path)
    torch.manual_seed(0)
    model = cls(cfg)
    print(f"zlab_decode: '{path}' builds z-lab's {describe(model)}")
    names = sorted(model.state_dict().keys())
    print(f"zlab_decode: its {len(names)} tensors: {', '.join(n for n in names if not n.startswith('layers.1'))}"
          f"{' (and the same for layers 1..)' if len(model.layers) > 1 else ''}"
          f"{'; published checkpoints store the two codebooks without .weight' if cls is zl.DFlash2DraftModel else ''}")


# ----------------------------------------------------------------------------------------------------------------
# workers: one prompt at a time
# ----------------------------------------------------------------------------------------------------------------

_W = {}


def _worker_init(target_dir, drafters, max_new, unfixed):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    _W.update(target=target, eos=eos, max_new=max_new, unfixed=unfixed,
              drafts=[load_draft(d)[0] for d in drafters])


@torch.inference_mode()
def _decode_prompt(job):
    i, prompt_ids, which = job  # which: the drafters (indices) to decode this prompt with
    target, eos, max_new = _W["target"], _W["eos"], _W["max_new"]
    prompt = torch.tensor([prompt_ids], dtype=torch.long)
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0])[0].tolist()
    rows = []
    for j, draft in enumerate(_W["drafts"]):
        if j not in which:
            rows.append(None)
            continue
        out, produced, steps = speculative(draft, target, prompt, max_new, eos, rollback=True)
        row = {"produced": produced, "steps": steps, "lossless": out == ref, "diff": first_diff(out, ref, len(prompt_ids))}
        if _W["unfixed"]:
            out_u, _, _ = speculative(draft, target, prompt, max_new, eos, rollback=False)
            row["lossless_unfixed"] = out_u == ref
        rows.append(row)
    return i, len(ref) - len(prompt_ids), rows


def first_diff(out, ref, n_prompt):
    for k, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return f"new token {k - n_prompt}: {a} where the target gives {b}"
    if len(out) != len(ref):
        return f"{len(out) - n_prompt} new tokens where the target gives {len(ref) - n_prompt}"
    return None


# ----------------------------------------------------------------------------------------------------------------


def prompts_of(path):
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            mask = d.get("loss_mask") or [1] * len(d["input_ids"])
            first = mask.index(1) if 1 in mask else len(mask)
            if first == 0:
                continue  # no prompt to condition on
            out.append(d["input_ids"][:first])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="target model directory (Transformers Qwen3.5)")
    ap.add_argument("--valid", help="held-out tokenized JSONL: input_ids, loss_mask")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=0, help="only the first N prompts (default: all)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    ap.add_argument("--untrained-every", type=int, default=1,
                    help="decode the untrained drafters on every K-th prompt only (default 1: all); the trained "
                         "one's τ is then compared on the same prompts")
    ap.add_argument("--unfixed", action="store_true", help="also decode without the rollback fix, and report it")
    ap.add_argument("--tandem-tau", help="heldout_tau.py's JSON: Tandem's teacher-forced τ per checkpoint")
    ap.add_argument("--case", nargs=3, action="append", default=[], metavar=("NAME", "TRAINED", "UNTRAINED"))
    ap.add_argument("--table-note", action="append", default=[], help="a line printed under the table")
    ap.add_argument("--config-check", help="only build z-lab's model from this drafter config and describe it")
    a = ap.parse_args()

    if a.config_check:
        config_check(a.config_check)
        return 0
    if not (a.target and a.valid and a.case):
        ap.error("--target, --valid and at least one --case are needed")

    failures = []
    drafters, labels, every = [], [], []
    for name, trained, untrained in a.case:
        for label, path in ((f"{name} trained", trained), (f"{name} untrained", untrained)):
            try:
                model, problems = load_draft(path)
            except Exception as e:  # noqa: BLE001 - any load error is the finding
                failures.append(f"{label}: z-lab's loader failed on '{path}': {type(e).__name__}: {e}")
                continue
            for p in problems:
                failures.append(f"{label}: '{path}': {p}")
            print(f"zlab_decode: {label}: '{path}' loads as z-lab's {describe(model)}"
                  f"{'' if not problems else f' — {len(problems)} PROBLEMS'}", flush=True)
            drafters.append(path)
            labels.append(label)
            every.append(1 if label.endswith(" trained") else max(1, a.untrained_every))
    if failures:
        for f in failures:
            print(f"zlab_decode: FAIL: {f}", file=sys.stderr)
        return 1

    prompts = prompts_of(a.valid)
    if a.prompts > 0:
        prompts = prompts[:a.prompts]
    print(f"zlab_decode: decoding {len(prompts)} held-out prompts of '{a.valid}' with dflash_generate (greedy, at "
          f"most {a.max_new_tokens} new tokens) for {len(drafters)} drafters{' (fixed and unfixed)' if a.unfixed else ''}"
          f" against Transformers' greedy generate, {a.jobs} worker processes", flush=True)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    results = [None] * len(prompts)
    ref_tokens = 0
    with ctx.Pool(a.jobs, initializer=_worker_init, initargs=(a.target, drafters, a.max_new_tokens, a.unfixed)) as pool:
        done = 0
        jobs = [(i, p, [j for j, e in enumerate(every) if i % e == 0]) for i, p in enumerate(prompts)]
        for i, n_ref, rows in pool.imap_unordered(_decode_prompt, jobs):
            results[i] = rows
            ref_tokens += n_ref
            done += 1
            if done % 25 == 0 or done == len(prompts):
                print(f"zlab_decode: {done}/{len(prompts)} prompts ({time.time() - t0:.0f} s)", flush=True)

    tandem = {}
    if a.tandem_tau:
        with open(a.tandem_tau) as f:
            tandem = json.load(f).get("drafters", {})

    stats = []
    for j, (label, path) in enumerate(zip(labels, drafters)):
        rows = [r[j] for r in results if r[j] is not None]
        produced, steps = sum(r["produced"] for r in rows), sum(r["steps"] for r in rows)
        ok = sum(r["lossless"] for r in rows)
        st = {"label": label, "path": path, "tau": produced / steps if steps else float("nan"), "produced": produced,
              "steps": steps, "lossless": ok, "n": len(rows)}
        if a.unfixed:
            st["lossless_unfixed"] = sum(r["lossless_unfixed"] for r in rows)
        t = tandem.get(path, {})
        st["tandem"] = t.get("tau")
        stats.append(st)
        for k, r in enumerate(results):
            r = r[j]
            if r is not None and not r["lossless"]:
                failures.append(f"{label}: prompt {k + 1} is not lossless with the fix: {r['diff']}")

    # the table
    print()
    wl = max(len("drafter"), *(len(st["label"]) for st in stats))
    hdr = f"{'drafter':<{wl}} {'real τ':>7} {'Tandem τ':>9} {'tokens':>7} {'verify steps':>13} {'lossless':>9}"
    if a.unfixed:
        hdr += f" {'without fix':>12}"
    print(hdr)
    print("-" * len(hdr))
    for st in stats:
        tt = f"{st['tandem']:.3f}" if st["tandem"] is not None else "n/a"
        line = (f"{st['label']:<{wl}} {st['tau']:>7.3f} {tt:>9} {st['produced']:>7} {st['steps']:>13} "
                f"{st['lossless']:>5}/{st['n']:<3}")
        if a.unfixed:
            line += f" {st['lossless_unfixed']:>8}/{st['n']:<3}"
        print(line)
    print(f"real τ: tokens produced by verify steps / verify steps (bonus included) over {len(prompts)} held-out "
          f"prompts, z-lab dflash_generate greedy, ≤ {a.max_new_tokens} new tokens, with the rollback fix; the "
          f"target's own greedy decode gave {ref_tokens} new tokens"
          + (f"; untrained drafters on every {a.untrained_every}th prompt only" if a.untrained_every > 1 else ""))
    print("Tandem τ: drafter-trainer grad's teacher-forced τ over every anchor of the same held-out split")
    for n in a.table_note:
        print(n)
    print(f"({time.time() - t0:.0f} s of decoding)")

    by = {st["label"]: (j, st) for j, st in enumerate(stats)}
    for name, _, _ in a.case:
        (jt, tr), (ju, un) = by[f"{name} trained"], by[f"{name} untrained"]
        same = [r[jt] for r in results if r[ju] is not None]  # the trained drafter on the untrained one's prompts
        tau_same = sum(r["produced"] for r in same) / max(1, sum(r["steps"] for r in same))
        print(f"{name}: trained real τ {tau_same:.3f} vs untrained {un['tau']:.3f} on the same {len(same)} prompts")
        if not tau_same > un["tau"]:
            failures.append(f"{name}: the trained drafter's real τ {tau_same:.3f} is not above the untrained "
                            f"one's {un['tau']:.3f} on the same {len(same)} prompts")
    if len(a.case) > 1:
        base = by[f"{a.case[0][0]} trained"][1]
        for name, _, _ in a.case[1:]:
            o = by[f"{name} trained"][1]
            tt = (f"; Tandem τ {o['tandem']:.3f} vs {base['tandem']:.3f}"
                  if o["tandem"] is not None and base["tandem"] is not None else "")
            print(f"{name} vs {a.case[0][0]} at the same training budget: real τ {o['tau']:.3f} vs {base['tau']:.3f} "
                  f"({o['tau'] / base['tau']:.2f}x){tt}")
    if failures:
        print()
        for f in failures[:20]:
            print(f"zlab_decode: FAIL: {f}", file=sys.stderr)
        if len(failures) > 20:
            print(f"zlab_decode: ... and {len(failures) - 20} more", file=sys.stderr)
        return 1
    print(f"zlab_decode: ok: every checkpoint loads in z-lab's dflash, every decode is lossless, each trained "
          f"drafter beats its untrained one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
