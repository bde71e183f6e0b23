#!/usr/bin/env python3
"""tests/test_ts_moe_load.py — every bad MoE / Qwen3-Next checkpoint ends `target-server dump` with exit 1 and one
message naming the problem (docs/moe.md).

Each case copies a committed oracle fixture (tests/fixtures/target/<name>/model) into a temporary directory, breaks
one thing in its safetensors or its config.json (rewritten here with the standard library: header JSON + raw bytes,
index.json kept consistent), and runs a real `target-server dump` process on the cpu:
  - per-expert layout: a missing expert's matrix; num_experts disagreeing with the router; an expert beyond
    num_experts (config and router say fewer); one expert short (config and router say more); a layer with no
    experts at all;
  - fused layout: num_experts disagreeing with gate_up_proj's shape; a truncated down_proj;
  - both: a router (mlp.gate.weight) of the wrong shape; a shared expert missing;
  - Qwen3-Next: in_proj_qkvz of the wrong shape; in_proj_ba missing.
The unbroken copies must still load and run (exit 0), so a message cannot come from the copying itself.
usage: test_ts_moe_load.py BUILD_DIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIX = os.path.join(ROOT, "tests/fixtures/target")
PER_EXPERT = "qwen35moe_flat_experts"
FUSED = "qwen35moe_mm_fused"
NEXT = "qwen3next_flat"
FAILS = []


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    meta = head.pop("__metadata__", None)
    tensors = {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in head.items()}
    return tensors, meta


def write_st(path, tensors, meta):
    head, blobs, off = {}, [], 0
    for k, (dt, shape, b) in tensors.items():
        head[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta is not None:
        head["__metadata__"] = meta
    hb = json.dumps(head).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


class Model:
    """A copy of a fixture's model directory whose tensors can be edited, then saved back shard by shard."""

    def __init__(self, src, dst):
        shutil.copytree(src, dst)
        self.dir = dst
        self.shards = {}
        for f in sorted(os.listdir(dst)):
            if f.endswith(".safetensors"):
                self.shards[f] = read_st(os.path.join(dst, f))
        self.config = json.load(open(os.path.join(dst, "config.json")))

    def text(self):
        return self.config.get("text_config", self.config)

    def find(self, name):
        for f, (t, _) in self.shards.items():
            if name in t:
                return f, t
        raise KeyError(name)

    def names(self):
        return [k for t, _ in self.shards.values() for k in t]

    def drop(self, name):
        _, t = self.find(name)
        del t[name]

    def truncate(self, name, rows):
        """Keeps the first `rows` entries of the tensor's first dimension."""
        _, t = self.find(name)
        dt, shape, b = t[name]
        per = len(b) // shape[0]
        t[name] = (dt, [rows] + shape[1:], b[:rows * per])

    def save(self):
        for f, (t, meta) in self.shards.items():
            write_st(os.path.join(self.dir, f), t, meta)
        idx = os.path.join(self.dir, "model.safetensors.index.json")
        if os.path.exists(idx):
            j = json.load(open(idx))
            j["weight_map"] = {k: f for f, (t, _) in self.shards.items() for k in t}
            json.dump(j, open(idx, "w"))
        json.dump(self.config, open(os.path.join(self.dir, "config.json"), "w"))
        for f in os.listdir(self.dir):
            if f.startswith(".tandem-fingerprint"):
                os.remove(os.path.join(self.dir, f))


def dump(ts, model, fix, out):
    return subprocess.run([ts, "dump", "--model", model, "--input", os.path.join(FIX, fix, "input.safetensors"),
                           "--out", out, "--precision", "fp32", "--log-level", "warn"],
                          capture_output=True, text=True, timeout=300)


def expect(name, r, *words):
    text = r.stderr.strip()
    lines = text.splitlines()
    ok = r.returncode == 1 and len(lines) == 1 and all(w in text for w in words)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {r.returncode}: {text}")
    if not ok:
        FAILS.append(name)


def prefix_of(m):
    return "model.language_model." if any(k.startswith("model.language_model.") for k in m.names()) else "model."


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    ts = os.path.join(build, "target-server", "target-server")
    with tempfile.TemporaryDirectory(prefix="tandem-moe-load-") as tmp:
        out = os.path.join(tmp, "out.safetensors")
        n = [0]

        def case(fix, edit):
            n[0] += 1
            m = Model(os.path.join(FIX, fix, "model"), os.path.join(tmp, f"m{n[0]}"))
            p = prefix_of(m)
            detail = edit(m, p)
            m.save()
            return m.dir, detail

        for fix in (PER_EXPERT, FUSED, NEXT):  # the copies themselves load and run
            d, _ = case(fix, lambda m, p: None)
            r = dump(ts, d, fix, out)
            ok = r.returncode == 0
            print(f"{'ok  ' if ok else 'FAIL'} unbroken copy of {fix}: exit {r.returncode} {r.stderr.strip()[-300:]}")
            if not ok:
                FAILS.append(f"copy {fix}")

        # per-expert layout
        def missing_expert(m, p):
            m.drop(f"{p}layers.1.mlp.experts.1.up_proj.weight")
        d, _ = case(PER_EXPERT, missing_expert)
        expect("a missing expert", dump(ts, d, PER_EXPERT, out), "layers.1.mlp.experts.1.up_proj.weight")

        def fewer_in_config(m, p):
            m.text()["num_experts"] -= 1
        d, _ = case(PER_EXPERT, fewer_in_config)
        expect("num_experts below the router's", dump(ts, d, PER_EXPERT, out), "the router", "num_experts is",
               "disagree")

        def more_in_config(m, p):
            m.text()["num_experts"] += 1
        d, _ = case(PER_EXPERT, more_in_config)
        expect("num_experts above the router's", dump(ts, d, PER_EXPERT, out), "the router", "num_experts is")

        def one_beyond(m, p):  # config and routers say E - 1; the experts' tensors still hold E
            m.text()["num_experts"] -= 1
            for k in [k for k in m.names() if k.endswith(".mlp.gate.weight")]:
                _, t = m.find(k)
                m.truncate(k, t[k][1][0] - 1)
        d, _ = case(PER_EXPERT, one_beyond)
        expect("an expert beyond num_experts", dump(ts, d, PER_EXPERT, out), "beyond the num_experts", "disagree")

        def one_short(m, p):  # config and routers say E + 1; the checkpoint holds E experts
            m.text()["num_experts"] += 1
            for k in [k for k in m.names() if k.endswith(".mlp.gate.weight")]:
                f, t = m.find(k)
                dt, shape, b = t[k]
                t[k] = (dt, [shape[0] + 1] + shape[1:], b + b[:len(b) // shape[0]])
        d, _ = case(PER_EXPERT, one_short)
        E = Model(os.path.join(FIX, PER_EXPERT, "model"), os.path.join(tmp, "probe")).text()["num_experts"]
        expect("an expert missing at the end", dump(ts, d, PER_EXPERT, out), f"experts.{E}.gate_proj.weight")

        def no_experts(m, p):
            for k in [k for k in m.names() if k.startswith(f"{p}layers.0.mlp.experts.")]:
                m.drop(k)
        d, _ = case(PER_EXPERT, no_experts)
        expect("a layer without experts", dump(ts, d, PER_EXPERT, out), "layer 0 has no experts", "fused layout",
               "one tensor per expert")

        # fused layout
        def fused_count(m, p):
            m.text()["num_experts"] -= 2
        d, _ = case(FUSED, fused_count)
        expect("num_experts against the fused checkpoint's", dump(ts, d, FUSED, out), "mlp.gate.weight",
               "num_experts is")

        def fused_down(m, p):
            name = f"{p}layers.0.mlp.experts.down_proj"
            _, t = m.find(name)
            m.truncate(name, t[name][1][0] - 1)
        d, _ = case(FUSED, fused_down)
        expect("a truncated down_proj", dump(ts, d, FUSED, out), "layers.0.mlp.experts.down_proj")

        # both
        for fix in (PER_EXPERT, FUSED):
            def router(m, p):
                name = f"{p}layers.0.mlp.gate.weight"
                _, t = m.find(name)
                m.truncate(name, t[name][1][0] - 1)
            d, _ = case(fix, router)
            expect(f"router of the wrong shape ({fix})", dump(ts, d, fix, out), "layers.0.mlp.gate.weight")

            def shared(m, p):
                m.drop(f"{p}layers.0.mlp.shared_expert.down_proj.weight")
            d, _ = case(fix, shared)
            expect(f"shared expert missing ({fix})", dump(ts, d, fix, out), "shared_expert.down_proj.weight")

        # Qwen3-Next
        def qkvz(m, p):
            name = f"{p}layers.0.linear_attn.in_proj_qkvz.weight"
            _, t = m.find(name)
            m.truncate(name, t[name][1][0] - 1)
        d, _ = case(NEXT, qkvz)
        expect("in_proj_qkvz of the wrong shape", dump(ts, d, NEXT, out), "in_proj_qkvz")

        def ba(m, p):
            m.drop(f"{p}layers.0.linear_attn.in_proj_ba.weight")
        d, _ = case(NEXT, ba)
        expect("in_proj_ba missing", dump(ts, d, NEXT, out), "in_proj_ba")
    print(f"{len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
