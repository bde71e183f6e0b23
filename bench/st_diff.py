#!/usr/bin/env python3
"""bench/st_diff.py REF GOT [-v]: the worst relative L2 error, sqrt(sum (g - r)^2 / sum r^2), over the F32 tensors
of REF (a safetensors file) against those of the same name in GOT; -v prints every tensor's. Standard library only
(the dumps of the tiny targets are small)."""
import array
import json
import math
import struct
import sys


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data, out = json.loads(raw[8:8 + n]), raw[8 + n:], {}
    for name, t in header.items():
        if name != "__metadata__" and t["dtype"] == "F32":
            a = array.array("f")
            a.frombytes(data[t["data_offsets"][0]:t["data_offsets"][1]])
            out[name] = a
    return out


def main():
    ref, got = load(sys.argv[1]), load(sys.argv[2])
    worst = 0.0
    for name, r in ref.items():
        if name not in got or len(got[name]) != len(r):
            sys.exit(f"st_diff: {sys.argv[2]} lacks '{name}' or has another shape")
        num = sum((g - x) ** 2 for g, x in zip(got[name], r))
        den = sum(x * x for x in r)
        e = math.sqrt(num / den) if den else math.sqrt(num)
        worst = max(worst, e)
        if "-v" in sys.argv[3:]:
            print(f"{name:16s} {e:.3e}")
    print(f"{worst:.3e}")


main()
