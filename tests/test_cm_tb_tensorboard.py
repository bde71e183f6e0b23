#!/usr/bin/env python3
"""TensorBoard itself reads the event files cm_tb writes (tests/test_cm_tb.c --write DIR):
EventAccumulator must list the three scalar tags with steps 1..5 and the written values; after a
resumed writer (--write-resumed DIR: SessionLog START at step 4, then steps 4..5 with loss
100 + step) it must show steps 1..5 once each, the resumed values replacing the old ones.
Exits 77 (skipped) where the tensorboard package is not importable (CI machines).
usage: test_cm_tb_tensorboard.py PATH/TO/test_cm_tb"""
import math
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("skipped: the tensorboard python package is not importable", file=sys.stderr)
    sys.exit(77)


def write(mode, run):
    path = subprocess.run([sys.argv[1], mode, run], check=True, capture_output=True,
                          text=True).stdout.strip()
    print("wrote", path)


def check(run, loss):
    acc = EventAccumulator(run + "/tb")
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    print("scalar tags:", tags)
    assert tags == ["train/loss", "train/lr", "train/tau"], tags
    for tag, fn in (("train/loss", loss), ("train/tau", lambda s: 1.0 + 0.25 * s),
                    ("train/lr", lambda s: 6e-4 * s)):
        ev = acc.Scalars(tag)
        print(tag, [(e.step, e.wall_time, round(e.value, 7)) for e in ev])
        assert [e.step for e in ev] == [1, 2, 3, 4, 5], ev
        for e in ev:
            assert math.isclose(e.value, fn(e.step), rel_tol=1e-6), (tag, e)
            assert e.wall_time == 1.7e9 + e.step, e


def main():
    with tempfile.TemporaryDirectory() as run:
        write("--write", run)
        check(run, lambda s: 10.0 / s)
        write("--write-resumed", run)
        check(run, lambda s: 10.0 / s if s <= 3 else 100.0 + s)
    print("tensorboard read every scalar, and the resumed file replaced steps 4..5")


if __name__ == "__main__":
    main()
