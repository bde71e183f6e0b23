#!/usr/bin/env python3
"""tests/oracle/make_decode_fixtures.py — the decoding oracle: z-lab's speculative decoder, step by step.

For each drafter checkpoint given (the serving format: config.json + model.safetensors), decodes the first
--prompts prompts of the held-out split greedily with z-lab's `dflash.model.dflash_generate` (dflash 0.1.0) against
the target run by Hugging Face Transformers (float32, CPU, one thread), with tests/interop/zlab_decode.py's loader
and its cache-rollback fix (imported, not copied: on a hybrid target z-lab's `DynamicCache.crop` leaves the
rejected tokens in the Gated DeltaNet state; the fix restores the cache and re-runs the kept tokens). The target's
own greedy output (Transformers `generate`, do_sample=False, the same cap and eos) is recorded beside it. Writes
one JSON fixture per checkpoint. Tandem's decoder (`drafter-trainer eval` against `target-server`) must reproduce
every step of it.

  make_decode_fixtures.py [--target DIR] [--valid FILE.jsonl] [--prompts N] [--max-new-tokens N] [--jobs J]
                          [--command TEXT ...] --case CHECKPOINT_DIR OUT.json [--case ...]

The prompt is the tokens before the first supervised token (loss_mask 1) of each line of --valid, lines with none
before it skipped (as tests/interop does); the block size is the checkpoint's (config.json's dflash_config).

The fixture: one JSON object, every list of token ids a flat array of ints (cJSON reads it as it is).
  format, version             "tandem-decode-oracle", 1
  checkpoint                  the drafter's directory as given (relative to the repository root)
  checkpoint_sha256           {file name: sha256} of config.json and model.safetensors
  architecture                "DFlashDraftModel" or "DFlash2DraftModel" (config.json's architectures)
  block_size, mask_token_id   from the checkpoint; a verify forward holds at most block_size tokens
  target_layer_ids            the taps the drafter reads
  target, target_sha256       the target's directory and the sha256 of its model.safetensors
  valid, n_prompts            the split and how many of its prompts were decoded
  max_new_tokens              the cap on new tokens per prompt (the first, from the prefill, included)
  eos_token_ids               the stop tokens (the target's generation_config); a stop token ends the output
  temperature, dtype, device, torch_threads   0 (greedy), "float32", "cpu", 1
  decoder, reference          what produced output_ids and target_ids, in words
  tau                         sum of acceptance_lengths / number of verify steps, over every prompt
  tokens, steps               those two sums
  mean_accepted               sum of accepted / steps (drafted tokens the target agreed with, per step)
  n_lossless, not_lossless    prompts whose output_ids equal target_ids; the indices of those that do not
  versions                    python, torch, transformers, dflash, huggingface_hub, tokenizers, safetensors, numpy
  git_commit                  the repository's HEAD when the fixture was made (git status dirty or not)
  commands                    the command lines that made the checkpoint (--command) and this fixture
  prompts                     one object per prompt, in order:
    index                     the prompt's position among the prompts of --valid (0-based)
    prompt_ids                the prompt's token ids
    output_ids                the speculative decode's new tokens: the prefill's token, then every verify step's
                              accepted drafts and bonus token, up to max_new_tokens or a stop token (included)
    target_ids                the target's own greedy new tokens, the same cap and stop tokens
    lossless                  output_ids == target_ids
    first_diff                -1, or the index into output_ids of the first token that differs (a length
                              difference counts at the shorter one's end)
    logit_gap                 null, or at first_diff: the target's logit of target_ids' token minus that of
                              output_ids' token, from one plain forward of prompt + target_ids[:first_diff] (no
                              cache); a gap near 0 means a near tie that the two orders of summation break apart
    steps                     the number of verify steps
    acceptance_lengths        per verify step, z-lab's count: tokens that step added to the output, the bonus
                              token included (accepted + 1, cut at max_new_tokens and after a stop token);
                              the prefill's token is not counted
    accepted                  per verify step, the raw count of drafted tokens accepted: the length of the
                              leading run of drafts equal to the target's argmax at the position before each
    verify_sizes              per verify step, the tokens of the verify forward: the anchor (the last token
                              committed) and verify_size - 1 drafted tokens; block_size but near the cap
    draft_ids                 every verify step's drafted tokens, concatenated (sum of verify_sizes - 1 ints)

Exit status 0 when every fixture is written (a prompt that is not lossless is reported, not a failure; the
fixture says which), 1 otherwise.
"""

import argparse
import hashlib
import importlib.metadata as md
import json
import multiprocessing as mp
import os
import platform
import shlex
import subprocess
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "interop"))
import zlab_decode as zd  # noqa: E402 - z-lab's loader, the rollback fix (applied on import), prompts_of

# ----------------------------------------------------------------------------------------------------------------
# one prompt, every drafter: in a worker process
# ----------------------------------------------------------------------------------------------------------------

_W = {}


def _worker_init(target_dir, drafters, max_new):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    _W.update(target=target, eos=eos, max_new=max_new, drafts=[zd.load_draft(d)[0] for d in drafters])


def first_diff(out, ref):
    for k, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return k
    return -1 if len(out) == len(ref) else min(len(out), len(ref))


@torch.inference_mode()
def logit_gap(target, prompt_ids, ref, out, k):
    """At new token k: the target's logit of ref[k] minus that of out[k], one plain forward without a cache."""
    if k >= len(ref) or k >= len(out):
        return None
    ids = torch.tensor([prompt_ids + ref[:k]], dtype=torch.long)
    logits = target(ids, use_cache=False).logits[0, -1].double()
    return float(logits[ref[k]] - logits[out[k]])


@torch.inference_mode()
def _decode_prompt(job):
    i, prompt_ids = job
    target, eos, max_new = _W["target"], _W["eos"], _W["max_new"]
    n = len(prompt_ids)
    prompt = torch.tensor([prompt_ids], dtype=torch.long)
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0])[0].tolist()[n:]
    rows = []
    for draft in _W["drafts"]:
        trace = {}
        out, produced, steps = zd.speculative(draft, target, prompt, max_new, eos, rollback=True, trace=trace)
        out = out[n:]
        verify = trace["verify"]
        if len(verify) != steps:
            raise RuntimeError(f"prompt {i}: {len(verify)} verify forwards traced for {steps} steps")
        accepted, sizes, drafts = [], [], []
        for block, argmax in verify:
            a = 0
            while a + 1 < len(block) and block[a + 1] == argmax[a]:
                a += 1
            accepted.append(a)
            sizes.append(len(block))
            drafts += block[1:]
        d = first_diff(out, ref)
        rows.append({
            "index": i, "prompt_ids": prompt_ids, "output_ids": out, "target_ids": ref, "lossless": out == ref,
            "first_diff": d, "logit_gap": None if d < 0 else logit_gap(target, prompt_ids, ref, out, d),
            "steps": steps, "acceptance_lengths": trace["acceptance_lengths"], "accepted": accepted,
            "verify_sizes": sizes, "draft_ids": drafts,
        })
        if produced != len(out) - 1:
            raise RuntimeError(f"prompt {i}: {produced} tokens from verify steps for {len(out)} new tokens")
    return i, rows


# ----------------------------------------------------------------------------------------------------------------
# the fixture
# ----------------------------------------------------------------------------------------------------------------


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions():
    v = {"python": platform.python_version()}
    for p in ("torch", "transformers", "dflash", "huggingface_hub", "tokenizers", "safetensors", "numpy"):
        try:
            v[p] = md.version(p)
        except md.PackageNotFoundError:
            v[p] = None
    return v


def git_commit():
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def dump(value, indent=0):
    """JSON with every list of scalars on one line, objects one key a line: short, diffable, plain JSON."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{pad}  {json.dumps(k)}: {dump(v, indent + 2)}' for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and any(isinstance(x, (dict, list)) for x in value):
        items = [pad + "  " + dump(x, indent + 2) for x in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def rel(path):
    p = os.path.abspath(path)
    return os.path.relpath(p, REPO) if p.startswith(REPO + os.sep) else p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="models/tandem-tiny", help="target model directory (default %(default)s)")
    ap.add_argument("--valid", default="data/tiny/valid.jsonl", help="tokenized JSONL (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=24, help="the first N prompts (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="default %(default)s")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    ap.add_argument("--command", action="append", default=[],
                    help="a command line that made the checkpoints, recorded in every fixture")
    ap.add_argument("--case", nargs=2, action="append", default=[], metavar=("CHECKPOINT", "OUT_JSON"),
                    required=True)
    a = ap.parse_args()

    drafters, metas = [], []
    for ckpt, _ in a.case:
        model, problems = zd.load_draft(ckpt)
        if problems:
            for p in problems:
                print(f"make_decode_fixtures: FAIL: '{ckpt}': {p}", file=sys.stderr)
            return 1
        with open(os.path.join(ckpt, "config.json")) as f:
            arch = json.load(f)["architectures"][0]
        metas.append({"architecture": arch, "block_size": int(model.block_size),
                      "mask_token_id": int(model.mask_token_id),
                      "target_layer_ids": [int(x) for x in model.target_layer_ids]})
        print(f"make_decode_fixtures: '{ckpt}' loads as z-lab's {zd.describe(model)}", flush=True)
        drafters.append(ckpt)

    prompts = zd.prompts_of(a.valid)[:a.prompts]
    if len(prompts) < a.prompts:
        print(f"make_decode_fixtures: FAIL: '{a.valid}' has {len(prompts)} prompts, not {a.prompts}", file=sys.stderr)
        return 1
    print(f"make_decode_fixtures: {len(prompts)} prompts of '{a.valid}', at most {a.max_new_tokens} new tokens, "
          f"{len(drafters)} drafters, {a.jobs} worker processes", flush=True)
    t0 = time.time()
    results = [None] * len(prompts)
    with mp.get_context("spawn").Pool(a.jobs, initializer=_worker_init,
                                      initargs=(a.target, drafters, a.max_new_tokens)) as pool:
        for i, rows in pool.imap_unordered(_decode_prompt, list(enumerate(prompts))):
            results[i] = rows

    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(a.target).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    this = " ".join(shlex.quote(x) for x in [rel(sys.executable), rel(sys.argv[0])] + sys.argv[1:])
    common = {
        "target": rel(a.target), "target_sha256": sha256(os.path.join(a.target, "model.safetensors")),
        "valid": rel(a.valid), "n_prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "eos_token_ids": eos,
        "temperature": 0, "dtype": "float32", "device": "cpu", "torch_threads": 1,
        "decoder": "dflash.model.dflash_generate (dflash 0.1.0), greedy, with tests/interop/zlab_decode.py's "
                   "cache-rollback fix; drafter and target in float32",
        "reference": "transformers generate(do_sample=False) of the target, float32",
    }
    for j, ((ckpt, out_path), meta) in enumerate(zip(a.case, metas)):
        rows = [r[j] for r in results]
        tokens = sum(sum(r["acceptance_lengths"]) for r in rows)
        steps = sum(r["steps"] for r in rows)
        bad = [r["index"] for r in rows if not r["lossless"]]
        fx = {"format": "tandem-decode-oracle", "version": 1, "checkpoint": rel(ckpt),
              "checkpoint_sha256": {n: sha256(os.path.join(ckpt, n)) for n in ("config.json", "model.safetensors")}}
        fx.update(meta)
        fx.update(common)
        fx.update({"tau": tokens / steps, "tokens": tokens, "steps": steps,
                   "mean_accepted": sum(sum(r["accepted"]) for r in rows) / steps,
                   "n_lossless": len(rows) - len(bad), "not_lossless": bad, "versions": versions(),
                   "git_commit": git_commit(), "commands": a.command + [this], "prompts": rows})
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(dump(fx) + "\n")
        os.replace(tmp, out_path)
        print(f"make_decode_fixtures: {out_path}: {meta['architecture']} τ {fx['tau']:.3f} ({tokens} tokens in "
              f"{steps} verify steps), mean accepted {fx['mean_accepted']:.3f}, lossless {fx['n_lossless']}/"
              f"{len(rows)}", flush=True)
        for r in rows:
            if not r["lossless"]:
                print(f"make_decode_fixtures:   prompt {r['index']}: new token {r['first_diff']} differs from the "
                      f"target's greedy output (logit gap {r['logit_gap']})", flush=True)
    print(f"make_decode_fixtures: done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
