#!/usr/bin/env python3
"""tests/test_decode_badinput.py — what goes wrong around decoding gets one clear message each.

A real `target-server serve` of the embedded tiny target with room for 2 decoding sequences and a 2 s idle limit,
and real `drafter-trainer eval` processes:
  - prompts: a token outside the vocabulary, a dataset without a prompt;
  - capacity: --batch above the server's --decode-seqs, a prompt + --max-new past --decode-max-len, and a second
    client while the first holds every sequence (the server's "too many decoding sequences"; the second starts once
    the server's debug log shows both of the first one's sequences opened, so a slow machine cannot reorder them);
  - identity: a drafter whose training state names other target weights, a --target directory of other weights;
  - a vanished client: a client killed mid-run loses its sequences once it has been silent for the idle limit (the
    server says so), and the next client gets them.
usage: test_decode_badinput.py BUILD_DIR
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FAILS = []


def expect(name, r, *words):
    text = r.stderr
    ok = r.returncode not in (0, None) and all(w in text for w in words)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {r.returncode}: {text.strip().splitlines()[-1] if text.strip() else ''}")
    if not ok:
        FAILS.append(name)


def write_state(path, weights):
    """A training_state.safetensors holding only the metadata eval reads."""
    head = json.dumps({"__metadata__": {"format": "tandem.dflash.training_state", "version": "1",
                                        "target_weights": weights}}).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    ts = os.path.join(build, "target-server", "target-server")
    dt = os.path.join(build, "drafter-trainer", "drafter-trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    model = os.path.join(ROOT, "models/tandem-tiny")
    valid = os.path.join(ROOT, "data/tiny/valid.jsonl")
    ckpt = os.path.join(ROOT, "tests/fixtures/decode/dflash")
    with tempfile.TemporaryDirectory(prefix="tandem-decode-bad-") as tmp:
        ep = f"ipc://{tmp}/t.ipc"
        log = open(f"{tmp}/serve.err", "w")
        srv = subprocess.Popen([ts, "serve", "--model", model, "--bind", ep, "--decode-seqs", "2", "--decode-idle-s",
                                "2", "--log-level", "debug"], env=env, stderr=log)

        def ev(*args, target=model, checkpoint=ckpt, timeout=120):
            cmd = [dt, "eval", "--checkpoint", checkpoint, "--target", target, "--server", ep, "--log-level", "warn",
                   *args]
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

        try:
            for _ in range(100):
                if os.path.exists(f"{tmp}/t.ipc"):
                    break
                time.sleep(0.05)
            with open(f"{tmp}/bad.jsonl", "w") as f:
                f.write('{"input_ids":[1,3,900,4,5,6],"loss_mask":[0,0,0,0,1,1]}\n')
            expect("token outside the vocabulary", ev("--data", f"{tmp}/bad.jsonl"), "token 900", "vocabulary")
            with open(f"{tmp}/none.jsonl", "w") as f:
                f.write('{"input_ids":[1,3,9,4,5,6],"loss_mask":[1,1,1,1,1,1]}\n')
            expect("no prompt", ev("--data", f"{tmp}/none.jsonl"), "has no prompt")
            expect("--batch above --decode-seqs", ev("--data", valid, "--batch", "4"), "decodes at most 2 sequences",
                   "--decode-seqs")
            expect("past --decode-max-len", ev("--data", valid, "--max-new", "5000"), "--decode-max-len")
            # a drafter trained on other weights (its training state says so)
            other = os.path.join(tmp, "other-drafter")
            shutil.copytree(ckpt, other)
            write_state(os.path.join(other, "training_state.safetensors"), "0123456789abcdef")
            expect("drafter of another target", ev("--data", valid, checkpoint=other), "trained on the hidden states",
                   "0123456789abcdef")
            # a --target of other weights (one byte of a tensor changed)
            tgt = os.path.join(tmp, "other-target")
            shutil.copytree(model, tgt)
            for f in os.listdir(tgt):
                if f.startswith(".tandem-fingerprint"):
                    os.remove(os.path.join(tgt, f))
            with open(os.path.join(tgt, "model.safetensors"), "r+b") as f:
                f.seek(0, os.SEEK_END)
                mid = f.tell() // 2
                f.seek(mid)
                b = f.read(1)
                f.seek(mid)
                f.write(bytes([b[0] ^ 1]))
            expect("--target of other weights", ev("--data", valid, target=tgt), "--target", "serves")
            # one client holds both sequences: another is refused; killed, it loses them after the idle limit
            hog = subprocess.Popen([dt, "eval", "--checkpoint", ckpt, "--target", model, "--server", ep, "--data", valid,
                                    "--batch", "2", "--max-new", "400", "--log-level", "warn"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # the second client goes once the server has opened both of the hog's sequences (its debug log says so)
            for _ in range(1200):
                if open(f"{tmp}/serve.err").read().count("opened for") >= 2 or hog.poll() is not None:
                    break
                time.sleep(0.05)
            print(f"hog holds its sequences: {open(f'{tmp}/serve.err').read().count('opened for') >= 2}, "
                  f"hog still running: {hog.poll() is None}")
            expect("a second client while the first holds every sequence", ev("--data", valid, "--prompts", "1"),
                   "too many decoding sequences")
            hog.send_signal(signal.SIGKILL)
            hog.wait()
            time.sleep(3.5)
            r = ev("--data", valid, "--prompts", "2", "--batch", "2", "--max-new", "8")
            dropped = "dropped" in open(f"{tmp}/serve.err").read()
            ok = r.returncode == 0 and dropped
            print(f"{'ok  ' if ok else 'FAIL'} a vanished client's sequences dropped and reused: server log says "
                  f"dropped: {dropped}; next eval exit {r.returncode}")
            if not ok:
                FAILS.append("vanished client")
                print(r.stderr[-1500:])
        finally:
            srv.terminate()
            srv.wait(timeout=30)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
