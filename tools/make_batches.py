#!/usr/bin/env python3
"""tools/make_batches.py — batch files for `drafter-trainer train --data` from a tokenized JSONL dataset.

Reads documents ({"input_ids": [...], "loss_mask": [...]} one a line, e.g. data/tiny/train.jsonl), packs them in
file order into batches of at most --tokens tokens (a document never spans two batches), runs
`target-server dump` of the target on each batch for the drafter's taps and writes OUT_DIR/batch-<i>.safetensors
in the format of drafter-trainer/feed/dt_data.h: input_ids, cu_seqlens, loss_mask (I32) and target_hidden
([T, taps x D], the taps in target_layer_ids order; F32, or BF16 with --bf16). Prints the comma-separated list of
files for --data on its last line. Needs numpy and safetensors (no torch).

  python3 tools/make_batches.py --dataset data/tiny/train.jsonl --config models/tandem-tiny-drafter.json \\
      --target models/tandem-tiny --target-server build/target-server/target-server --out /tmp/tiny-batches
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file, save_file


def fail(msg):
    raise SystemExit("make_batches: " + msg)


def read_jsonl(path, vocab_size):
    docs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids, mask = d["input_ids"], d["loss_mask"]
            except (ValueError, KeyError, TypeError) as e:
                fail(f"{path}:{n}: not a {{\"input_ids\": [...], \"loss_mask\": [...]}} line ({e})")
            if not ids or len(ids) != len(mask):
                fail(f"{path}:{n}: input_ids has {len(ids)} tokens and loss_mask {len(mask)} (want equal, > 0)")
            if min(ids) < 0 or max(ids) >= vocab_size:
                fail(f"{path}:{n}: token id {max(ids)} is out of range for vocab_size {vocab_size} "
                     f"(was the data tokenized for another model?)")
            if any(m not in (0, 1) for m in mask):
                fail(f"{path}:{n}: loss_mask holds values other than 0 and 1")
            docs.append((ids, mask))
    if not docs:
        fail(f"{path} holds no document")
    return docs


def pack(docs, budget):
    out, cur, used = [], [], 0
    for i, (ids, _) in enumerate(docs):
        if len(ids) > budget:
            fail(f"document {i + 1} has {len(ids)} tokens, more than --tokens {budget}; raise --tokens")
        if cur and used + len(ids) > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += len(ids)
    if cur:
        out.append(cur)
    return out


def to_bf16(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_bf16(path, tensors, hidden_name):
    """safetensors.numpy has no bfloat16: write the header by hand for the one BF16 tensor."""
    items, off, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = tensors[name]
        dt = "BF16" if name == hidden_name else "I32"
        b = arr.tobytes()
        items[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hdr = json.dumps(items, separators=(",", ":")).encode()
    hdr += b" " * ((8 - len(hdr) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(len(hdr).to_bytes(8, "little"))
        f.write(hdr)
        for b in blobs:
            f.write(b)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="tokenized JSONL: input_ids and loss_mask per line")
    ap.add_argument("--config", required=True, help="drafter config.json (its dflash_config.target_layer_ids)")
    ap.add_argument("--target", required=True, help="target model directory")
    ap.add_argument("--target-server", required=True, help="path to the built target-server binary")
    ap.add_argument("--out", required=True, help="directory for batch-<i>.safetensors")
    ap.add_argument("--tokens", type=int, default=1024, help="token budget of one packed batch (default 1024)")
    ap.add_argument("--bf16", action="store_true", help="store target_hidden as BF16 (default F32)")
    args = ap.parse_args()

    with open(args.config) as f:
        dcfg = json.load(f)
    taps = dcfg["dflash_config"]["target_layer_ids"]
    docs = read_jsonl(args.dataset, dcfg["vocab_size"])
    groups = pack(docs, args.tokens)
    os.makedirs(args.out, exist_ok=True)
    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        for b, g in enumerate(groups):
            ids = np.array([x for i in g for x in docs[i][0]], dtype=np.int32)
            mask = np.array([x for i in g for x in docs[i][1]], dtype=np.int32)
            cu = np.cumsum([0] + [len(docs[i][0]) for i in g]).astype(np.int32)
            inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            save_file({"input_ids": ids, "cu_seqlens": cu}, inp)
            cmd = [args.target_server, "dump", "--model", args.target, "--input", inp, "--out", out,
                   "--layers", ",".join(str(t) for t in taps), "--log-level", "warn"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                fail(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
            layers = load_file(out)
            hidden = np.concatenate([layers[f"layer_{t}"] for t in taps], axis=1).astype(np.float32)
            path = os.path.join(args.out, f"batch-{b:04d}.safetensors")
            t = {"input_ids": ids, "cu_seqlens": cu, "loss_mask": mask}
            if args.bf16:
                t["target_hidden"] = to_bf16(hidden)
                write_bf16(path, t, "target_hidden")
            else:
                t["target_hidden"] = hidden
                save_file(t, path)
            paths.append(path)
            print(f"{path}: {len(g)} documents, {len(ids)} tokens, {int(mask.sum())} supervised",
                  file=sys.stderr, flush=True)
    print(",".join(paths))


if __name__ == "__main__":
    main()
