#!/usr/bin/env python3
"""The floor check: every #include "…" in the product code goes down the floors, never up, and
no header includes itself through others.

    common/base  <  common/format  <  common/chan  <  kernels  <  target-server | drafter-trainer

and inside the programs: target-server  <  target-server/cmd, and drafter-trainer/model  <
drafter-trainer/feed  <  drafter-trainer/cmd. A file may include headers of its own floor and of
the floors below it. The two programs never include each other. Headers are found by name anywhere in these folders
(names are unique in the tree; a name found twice is an error too, since the include would be
ambiguous). System headers (<…>) and headers not in the tree (cJSON, zstd, NCCL) are ignored.

Usage: scripts/check_floors.py [ROOT]   (default: the repository this script is in)
Exit 0 when the tree is clean, 1 with one line per violation otherwise.
"""
import os
import re
import sys

FLOORS = [  # (folder, floor), the most specific folder first; floors from 4 up are a program's own
    ("common/base", 0),
    ("common/format", 1),
    ("common/chan", 2),
    ("kernels", 3),
    ("target-server/cmd", 5),
    ("target-server", 4),
    ("drafter-trainer/model", 4),
    ("drafter-trainer/feed", 5),
    ("drafter-trainer/cmd", 6),
    ("drafter-trainer", 4),
]
PROGRAMS = ("target-server", "drafter-trainer")


def program_of(folder):
    return folder.split("/")[0] if folder.split("/")[0] in PROGRAMS else None
SOURCES = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder_of(rel):
    for folder, floor in FLOORS:
        if rel == folder or rel.startswith(folder + "/"):
            return folder, floor
    return None, None


def scan(root):
    """{relative path: (folder, floor, [included names])} for every source on a floor, plus the
    flat-common files that belong to no floor (reported)."""
    files, stray = {}, []
    for top in ("common", "kernels", "target-server", "drafter-trainer"):
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in sorted(names):
                if not n.endswith(SOURCES):
                    continue
                rel = os.path.relpath(os.path.join(d, n), root)
                folder, floor = folder_of(rel)
                if folder is None:
                    stray.append(rel)
                    continue
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                files[rel] = (folder, floor, INCLUDE.findall(text))
    return files, stray


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files, stray = scan(root)
    errors = [f"{rel}: in common/ but on no floor (move it to common/base, common/format or common/chan)"
              for rel in stray]
    by_name = {}
    for rel in files:
        by_name.setdefault(os.path.basename(rel), []).append(rel)
    for name, rels in sorted(by_name.items()):
        if len(rels) > 1 and name.endswith((".h", ".cuh")):
            errors.append(f"{name}: the header name is used twice ({', '.join(rels)}); includes would be ambiguous")
    graph = {}
    for rel, (folder, floor, incs) in sorted(files.items()):
        graph[rel] = []
        for inc in incs:
            hits = by_name.get(os.path.basename(inc))
            if not hits:
                continue  # not ours (a system or third-party header)
            dep = hits[0]
            graph[rel].append(dep)
            dfolder, dfloor, _ = files[dep]
            cross = program_of(folder) and program_of(dfolder) and program_of(folder) != program_of(dfolder)
            if cross:
                errors.append(f"{rel}: includes \"{inc}\" from {dfolder}: the two programs never include each "
                              "other (move the shared part into common/ or kernels/)")
            elif dfloor > floor:
                errors.append(f"{rel}: includes \"{inc}\" from {dfolder}, a higher floor than {folder} "
                              "(move the shared part down, or call through a lower interface)")
    # Include circles: a depth-first walk over header edges.
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, []):
            if state.get(m) == 1:
                cyc = stack[stack.index(m):] + [m]
                errors.append("include circle: " + " -> ".join(cyc))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    sys.setrecursionlimit(10000)
    for n in sorted(graph):
        if n not in state:
            visit(n)
    for e in errors:
        print("check_floors: " + e)
    if errors:
        print(f"check_floors: {len(errors)} problem(s) in {len(files)} files; the floors are "
              "common/base < common/format < common/chan < kernels < target-server | drafter-trainer "
              "(inside: target-server < its cmd/; model < feed < cmd)")
        return 1
    print(f"check_floors: {len(files)} files, every include goes down the floors, no include circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
