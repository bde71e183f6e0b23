#!/usr/bin/env python3
"""Writes a random-weights checkpoint of a Qwen3.5/3.6 hybrid config in the real Hugging Face
layout (Qwen3_5ForConditionalGeneration keys, model.language_model.*; BF16; sharded into
~5 GB files with model.safetensors.index.json), for timing a cold start from real files at a
real size (the 27B config gives 53.8 GB). The values mean nothing: each tensor is a 1 MiB block
of Gaussian BF16 values (std 0.02) repeated from a per-tensor offset, so writing is I/O-bound.

    make_checkpoint.py CONFIG.json OUT_DIR [--shard-gb 5]

Plain Python (no torch, numpy or safetensors package): header JSON + raw bytes."""
import argparse
import json
import os
import shutil
import struct
import sys
import random
import time
import zlib


def tensors(cfg):
    t = cfg.get("text_config", cfg)
    D, I, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    nq, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    gate = 2 if t.get("attn_output_gate", True) else 1
    conv = 2 * nk * dk + nv * dv
    p = "model.language_model."
    out = [(p + "embed_tokens.weight", [V, D])]
    for i, kind in enumerate(t["layer_types"]):
        L = f"{p}layers.{i}."
        out += [(L + "input_layernorm.weight", [D]), (L + "post_attention_layernorm.weight", [D]),
                (L + "mlp.gate_proj.weight", [I, D]), (L + "mlp.up_proj.weight", [I, D]),
                (L + "mlp.down_proj.weight", [D, I])]
        if kind == "linear_attention":
            a = L + "linear_attn."
            out += [(a + "in_proj_qkv.weight", [conv, D]), (a + "in_proj_z.weight", [nv * dv, D]),
                    (a + "in_proj_b.weight", [nv, D]), (a + "in_proj_a.weight", [nv, D]),
                    (a + "out_proj.weight", [D, nv * dv]), (a + "conv1d.weight", [conv, 1, K]),
                    (a + "A_log", [nv]), (a + "dt_bias", [nv]), (a + "norm.weight", [dv])]
        else:
            a = L + "self_attn."
            out += [(a + "q_proj.weight", [nq * hd * gate, D]), (a + "k_proj.weight", [nkv * hd, D]),
                    (a + "v_proj.weight", [nkv * hd, D]), (a + "o_proj.weight", [D, nq * hd]),
                    (a + "q_norm.weight", [hd]), (a + "k_norm.weight", [hd])]
    out += [(p + "norm.weight", [D])]
    if not t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
        out += [("lm_head.weight", [V, D])]
    return out


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    os.makedirs(a.out, exist_ok=True)
    shutil.copy(a.config, os.path.join(a.out, "config.json"))
    ts = tensors(cfg)
    limit = int(a.shard_gb * 1e9)
    shards, cur, size = [], [], 0
    for name, shape in ts:
        b = numel(shape) * 2
        if cur and size + b > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += b
    shards.append(cur)
    rng = random.Random(1)
    vals = struct.pack(f"<{1 << 19}f", *(rng.gauss(0.0, 0.02) for _ in range(1 << 19)))
    block = bytes(b for i in range(0, len(vals), 4) for b in vals[i + 2:i + 4])  # the BF16 halves
    block2 = block * 2
    weight_map, total, t0 = {}, 0, time.time()
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape in group:
            n = numel(shape) * 2
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(a.out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for name, shape in group:
                n, start = numel(shape) * 2, (zlib.crc32(name.encode()) & 0xFFFF) * 2
                piece = block2[start:start + len(block)]
                for _ in range(n // len(piece)):
                    f.write(piece)
                f.write(piece[:n % len(piece)])
        total += off
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    print(f"wrote {len(ts)} tensors, {total / 1e9:.1f} GB in {len(shards)} files to {a.out} "
          f"in {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
