#!/usr/bin/env python3
"""tests/interop/heldout_tau.py — Tandem's own τ estimate of trained drafters on a held-out split.

What it computes: the teacher-forced τ of `drafter-trainer grad` (docs/drafter.md, "τ and accuracy": the mean
over blocks of 1 + the number of leading slots whose argmax equals the label, a slot without a label ending the
run) over ONE packed batch holding every document of the split, with EVERY valid anchor: each packed position p
with loss_mask[p] = 1 whose successor p + 1 is in the same document with loss_mask[p + 1] = 1 (the trainer's
candidate rule; training draws --max-anchors of them, this takes them all). The target's taps come from
`target-server dump` of the same target (tools/make_batches.py, F32), the frozen embedding and LM head from
--target. The trainer's own metrics.jsonl logs τ only on the training batches it steps on (sampled anchors, the
weights of that moment); this is the same statistic on data it never trained on. Beside it, `grad`'s τ_chain over
the same anchors: the τ a greedy decoder reports on this text, anchoring where its last block stopped (from each
response's first token to its end, max_new = the response's length; docs/drafter.md). It predicts the real τ when
the responses are the target's own greedy text.

  heldout_tau.py --target-server BIN --drafter-trainer BIN --target DIR --valid FILE.jsonl --work DIR
                 --json OUT.json DRAFTER_DIR [DRAFTER_DIR ...]

Writes OUT.json: {"anchors": N, "documents": D, "tokens": T, "drafters": {DIR: {"tau": x, "unary_tau": y,
"tau_chain": z, "unary_tau_chain": w, "chain_tokens": n, "chain_steps": s, "acc": [...]}}} and prints one line per
drafter. For a DFlash2 drafter "tau" and "tau_chain" are those of its greedy selector path (`grad`'s sel_tau and
sel_tau_chain: what its decoder proposes; chain_tokens and chain_steps are that chain's), the "unary_" ones the
unary argmax's; for DFlash both are the same.
Needs numpy and safetensors (no torch). A failure of `grad` or of building the batch is an error (exit 1).
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(msg):
    raise SystemExit("heldout_tau: " + msg)


def all_anchors(ids, mask, cu):
    """Every anchor candidate of a packed batch (drafter-trainer/model/dt_anchor.c's rule), ascending."""
    out = []
    for d in range(len(cu) - 1):
        for p in range(int(cu[d]), int(cu[d + 1]) - 1):
            if mask[p] and mask[p + 1]:
                out.append(p)
    return np.array(out, dtype=np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-server", required=True)
    ap.add_argument("--drafter-trainer", required=True)
    ap.add_argument("--target", required=True, help="target model directory")
    ap.add_argument("--valid", required=True, help="held-out tokenized JSONL (input_ids, loss_mask)")
    ap.add_argument("--work", required=True, help="scratch directory (the batch files go here)")
    ap.add_argument("--json", required=True, help="where the results go")
    ap.add_argument("drafters", nargs="+", help="drafter checkpoint directories (config.json + model.safetensors)")
    a = ap.parse_args()

    taps = None
    for d in a.drafters:
        with open(os.path.join(d, "config.json")) as f:
            t = json.load(f)["dflash_config"]["target_layer_ids"]
        if taps is not None and t != taps:
            fail(f"'{d}' taps layers {t}, another drafter {taps}: one batch serves drafters of the same taps")
        taps = t
    cfg = os.path.join(a.drafters[0], "config.json")

    # the split as one packed batch (target_hidden from `target-server dump`)
    with open(a.valid) as f:
        total = sum(len(json.loads(line)["input_ids"]) for line in f if line.strip())
    os.makedirs(a.work, exist_ok=True)
    bdir = os.path.join(a.work, "heldout-batch")
    cmd = [sys.executable, os.path.join(REPO, "tools", "make_batches.py"), "--dataset", a.valid, "--config", cfg,
           "--target", a.target, "--target-server", a.target_server, "--out", bdir, "--tokens", str(total)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        fail(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
    paths = res.stdout.strip().splitlines()[-1].split(",")
    if len(paths) != 1:
        fail(f"make_batches wrote {len(paths)} batches; expected the whole split in one")
    b = load_file(paths[0])
    anchors = all_anchors(b["input_ids"], b["loss_mask"], b["cu_seqlens"])
    if anchors.size == 0:
        fail(f"'{a.valid}' has no anchor (no two consecutive supervised tokens)")
    b["anchors"] = anchors
    gpath = os.path.join(a.work, "heldout-grad-batch.safetensors")
    save_file(b, gpath)
    docs, tokens = len(b["cu_seqlens"]) - 1, int(b["input_ids"].shape[0])

    result = {"anchors": int(anchors.size), "documents": docs, "tokens": tokens, "drafters": {}}
    for i, d in enumerate(a.drafters):
        out = os.path.join(a.work, f"heldout-grad-{i}.safetensors")
        cmd = [a.drafter_trainer, "grad", "--drafter", d, "--batch", gpath, "--target", a.target, "--out", out,
               "--log-level", "warn"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            msg = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
            fail(f"drafter-trainer grad failed on '{d}': {msg}")
        g = load_file(out)
        # DFlash2 decodes with its selector: the estimate is τ of the greedy selector path (teacher forced);
        # the unary argmax's τ is kept beside it
        sel = "sel_" if "sel_tau" in g else ""
        if sel + "tau_chain" not in g:
            fail(f"drafter-trainer grad wrote no {sel}tau_chain for '{d}' although every anchor was given")
        tau, chain = float(g[sel + "tau"][0]), float(g[sel + "tau_chain"][0])
        hits, count = g["acc_hits"].astype(np.int64), g["acc_count"].astype(np.int64)
        acc = [float(h) / c if c else None for h, c in zip(hits[1:], count[1:])]
        result["drafters"][d] = {"tau": tau, "acc": acc, "unary_tau": float(g["tau"][0]), "tau_chain": chain,
                                 "unary_tau_chain": float(g["tau_chain"][0]),
                                 "chain_tokens": int(g[sel + "chain_tokens"][0]),
                                 "chain_steps": int(g[sel + "chain_steps"][0])}
        os.remove(out)
        print(f"heldout_tau: {d}: teacher-forced τ {tau:.3f}, τ_chain {chain:.3f} over {anchors.size} anchors of "
              f"{docs} held-out documents ({tokens} tokens)", file=sys.stderr)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
