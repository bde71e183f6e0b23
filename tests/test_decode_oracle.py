#!/usr/bin/env python3
"""tests/test_decode_oracle.py — Tandem's speculative decoder against z-lab's, step for step.

Starts `target-server serve` on the embedded tiny target (real process, ipc:// socket) and runs `drafter-trainer
eval --trace --compare-target-only` for each drafter of tests/fixtures/decode/ (DFlash and DFlash2, the checkpoints
the oracle tests/oracle/make_decode_fixtures.py decoded with z-lab's `dflash_generate` under Transformers), on the
same prompts with the same block size and max_new, greedy. Checks, per prompt:
  - lossless: the speculative tokens equal the target-only run's and the oracle's output (which the oracle found
    equal to the target's own greedy `generate` on every prompt);
  - the same verify steps: drafts sent and drafts accepted per step equal the oracle's on every prompt. The server
    sends F32 hidden states here, as the oracle's drafter reads them: with the default BF16 answers one DFlash step
    of one prompt differs (prompt 1, step 25), where z-lab's drafter itself puts the end token 0.004 above the
    right token (logits 6.568 and 6.564) and the BF16 rounding of the context is enough to swap them;
  - τ (tokens per verify step, z-lab's count) within 0.01 of the oracle's;
and then, on all 100 held-out prompts of data/tiny/valid.jsonl (64 new tokens), that each drafter's output equals
the target's own decoding (--compare-target-only) on every one; and last the DFlash checks again through a server
whose target is split over 3 pipeline stages (`serve --stages 3`), which must decode exactly as one context.
usage: test_decode_oracle.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ALLOW_DIFF = 0


def start_server(ts, tmp, name, extra, env):
    """target-server serve on the tiny target at ipc://TMP/NAME.ipc, once its socket is there."""
    ep = f"ipc://{tmp}/{name}.ipc"
    # F32 hidden states, as the oracle's drafter reads them (the default BF16 rounding moves drafter logits by
    # ~1e-3: enough to flip a near tie)
    srv = subprocess.Popen([ts, "serve", "--model", os.path.join(ROOT, "models/tandem-tiny"), "--bind", ep,
                            "--dtype", "f32", "--log-level", "warn"] + extra, env=env,
                           stderr=open(f"{tmp}/{name}.err", "w"))
    for _ in range(100):
        if os.path.exists(f"{tmp}/{name}.ipc"):
            break
        time.sleep(0.05)
    return srv, ep


def check_oracle(dt, kind, ep, tmp, env, failures, label=""):
    """The oracle's prompts of one drafter decoded through the server at ep: tokens, verify steps and tau."""
    fx = json.load(open(os.path.join(ROOT, f"tests/fixtures/decode/{kind}.json")))
    out = f"{tmp}/{kind}{label}.json"
    cmd = [dt, "eval", "--checkpoint", os.path.join(ROOT, fx["checkpoint"]), "--target",
           os.path.join(ROOT, fx["target"]), "--server", ep, "--data", os.path.join(ROOT, fx["valid"]),
           "--prompts", str(fx["n_prompts"]), "--max-new", str(fx["max_new_tokens"]), "--block",
           str(fx["block_size"]), "--batch", "8", "--trace", "--compare-target-only", "--json", out,
           "--log-level", "warn"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    name = kind + label
    if r.returncode != 0:
        failures.append(f"{name}: eval exited {r.returncode}: {r.stderr[-2000:]}")
        return
    ours = json.load(open(out))
    steps_same, diff = 0, []
    for f, o in zip(fx["prompts"], ours["prompts"]):
        if o["tokens"] != f["output_ids"] or not o.get("identical"):
            failures.append(f"{name} prompt {f['index']}: tokens differ from the oracle's or the "
                            f"target-only run's (first_diff {o.get('first_diff')})")
        nd = [v - 1 for v in f["verify_sizes"]]
        if o["accepted"] == f["accepted"] and o["n_draft"] == nd:
            steps_same += 1
        else:
            i = next((k for k, (x, y) in enumerate(zip(o["accepted"], f["accepted"])) if x != y),
                     min(len(o["accepted"]), len(f["accepted"])))
            diff.append(f"prompt {f['index']} from step {i} of {len(f['accepted'])}")
    n = len(fx["prompts"])
    print(f"{name}: {n} prompts, outputs identical to the oracle's and the target's; verify steps "
          f"identical on {steps_same}; tau {ours['overall']['tau']:.4f} (oracle {fx['tau']:.4f})"
          + (f"; differing: {', '.join(diff)}" if diff else ""))
    if len(ours["prompts"]) != n:
        failures.append(f"{name}: {len(ours['prompts'])} prompts decoded, the oracle has {n}")
    if len(diff) > ALLOW_DIFF:
        failures.append(f"{name}: verify steps differ on {len(diff)} prompts (at most {ALLOW_DIFF})")
    if abs(ours["overall"]["tau"] - fx["tau"]) > 0.01:
        failures.append(f"{name}: tau {ours['overall']['tau']:.4f}, the oracle's {fx['tau']:.4f}")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    ts = os.path.join(build, "target-server", "target-server")
    dt = os.path.join(build, "drafter-trainer", "drafter-trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []
    with tempfile.TemporaryDirectory(prefix="tandem-decode-oracle-") as tmp:
        srv, ep = start_server(ts, tmp, "t", [], env)
        try:
            for kind in ("dflash", "dflash2"):
                check_oracle(dt, kind, ep, tmp, env, failures)
            # lossless on every held-out prompt, not only the oracle's: all of data/tiny/valid.jsonl, 64 new tokens
            for kind in ("dflash", "dflash2"):
                out = f"{tmp}/{kind}-all.json"
                r = subprocess.run([dt, "eval", "--checkpoint", os.path.join(ROOT, f"tests/fixtures/decode/{kind}"),
                                    "--target", os.path.join(ROOT, "models/tandem-tiny"), "--server", ep, "--data",
                                    os.path.join(ROOT, "data/tiny/valid.jsonl"), "--max-new", "64", "--batch", "8",
                                    "--compare-target-only", "--json", out, "--log-level", "warn"],
                                   env=env, capture_output=True, text=True, timeout=600)
                rep = json.load(open(out)) if r.returncode == 0 else None
                same = rep["target_only_run"]["identical"] if rep else -1
                n = rep["overall"]["prompts"] if rep else 0
                print(f"{kind}: every held-out prompt: {same} of {n} identical to the target's own decoding, "
                      f"tau {rep['overall']['tau'] if rep else 0:.3f}")
                if not rep or same != n or n != 100:
                    failures.append(f"{kind}: {same} of {n} held-out prompts identical ({r.stderr[-500:]})")
        finally:
            srv.terminate()
            srv.wait(timeout=30)
        # the same oracle through a target split over pipeline stages (docs/target.md): its decoding state
        # spread over the stages' contexts
        srv, ep = start_server(ts, tmp, "split", ["--stages", "3"], env)
        try:
            check_oracle(dt, "dflash", ep, tmp, env, failures, " (serve --stages 3)")
        finally:
            srv.terminate()
            srv.wait(timeout=30)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
