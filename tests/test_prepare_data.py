#!/usr/bin/env python3
"""tests/test_prepare_data.py — tools/prepare_data.py with the offline word-level tokenizer of
tests/data/dataset/tokenizer (a Qwen3-style chat template that rewrites history): loss_mask is 1
exactly on the assistant tokens for --thinking keep and drop, over multi-turn OpenAI-messages and
ShareGPT input (both forms give the same documents); --max-length truncates and counts; the
binary output equals `drafter-trainer dataset convert` of the JSONL output; bad input stops with
one message naming the line. Argument: the drafter-trainer binary. Exits 77 (skipped) without
transformers, tokenizers, numpy or safetensors."""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import safetensors.numpy
    import tokenizers  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:
    print(f"skipped: {e}", file=sys.stderr)
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "tools", "prepare_data.py")
TOKENIZER = os.path.join(HERE, "data", "dataset", "tokenizer")
failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print(f"check failed: {what}", file=sys.stderr)


def load_tool():
    spec = importlib.util.spec_from_file_location("prepare_data", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL_MOD = None


class Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def run(args):
    """prepare_data.main in this process (importing transformers once keeps the test fast)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = TOOL_MOD.main(["--tokenizer", TOKENIZER] + args)
        except SystemExit as e:
            rc = e.code
    return Result(rc, err.getvalue())


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def supervised(tok, doc):
    return [t for t, m in zip(tok.convert_ids_to_tokens(doc["input_ids"]), doc["loss_mask"]) if m]


def main():
    global TOOL_MOD
    from transformers import AutoTokenizer

    TOOL_MOD = load_tool()

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tmp = tempfile.mkdtemp(prefix="tandem-prepare-")
    openai = os.path.join(tmp, "openai.jsonl")
    sharegpt = os.path.join(tmp, "sharegpt.jsonl")
    conv = [("system", "you are a helpful bot"), ("user", "hi"), ("assistant", "<think>let me think</think>hello"),
            ("user", "what is two plus three"), ("assistant", "<think>it is five</think>five")]
    short = [("user", "hello"), ("assistant", "hi how are you")]
    no_answer = [("user", "bye")]
    with open(openai, "w") as f:
        for c in (conv, short, no_answer):
            f.write(json.dumps({"id": 1, "messages": [{"role": r, "content": t} for r, t in c]}) + "\n\n")
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    with open(sharegpt, "w") as f:
        for c in (conv, short, no_answer):
            f.write(json.dumps({"conversations": [{"from": names[r], "value": t} for r, t in c]}) + "\n")

    # --thinking keep: earlier turns lose their reasoning (the template's doing), the last keeps it
    out = os.path.join(tmp, "keep.jsonl")
    r = run(["--input", openai, "--output", out, "--thinking", "keep"])
    check(r.returncode == 0, f"keep exit {r.returncode}: {r.stderr}")
    docs = read_jsonl(out)
    check(len(docs) == 2 and "1 without an assistant turn skipped" in r.stderr, f"keep docs {len(docs)}: {r.stderr}")
    got = supervised(tok, docs[0])
    want = ["hello", "<|im_end|>", "<think>", "it", "is", "five", "</think>", "five", "<|im_end|>"]
    check(got == want, f"keep supervised {got}, expected {want}")
    toks = tok.convert_ids_to_tokens(docs[0]["input_ids"])
    check(toks[:2] == ["<|im_start|>", "system"] and toks.count("assistant") == 2, f"keep tokens {toks}")
    # a single turn: the template's empty think block is the model's own output with thinking on
    want = ["<think>", "</think>", "hi", "how", "are", "you", "<|im_end|>"]
    check(supervised(tok, docs[1]) == want, f"short {supervised(tok, docs[1])}")
    check(all(len(d["input_ids"]) == len(d["loss_mask"]) for d in docs), "lengths")

    # --thinking drop: no reasoning anywhere; the empty think block the template adds after the
    # generation prompt is prompt, not supervised
    out = os.path.join(tmp, "drop.jsonl")
    r = run(["--input", openai, "--output", out, "--thinking", "drop"])
    check(r.returncode == 0, f"drop exit {r.returncode}: {r.stderr}")
    docs_drop = read_jsonl(out)
    got = supervised(tok, docs_drop[0])
    check(got == ["hello", "<|im_end|>", "five", "<|im_end|>"], f"drop supervised {got}")
    check(supervised(tok, docs_drop[1]) == ["hi", "how", "are", "you", "<|im_end|>"], "drop short")
    toks = tok.convert_ids_to_tokens(docs_drop[0]["input_ids"])
    check("let" not in toks and "it" not in toks and toks.count("<think>") == 1, f"drop tokens {toks}")

    # ShareGPT gives the same documents
    out = os.path.join(tmp, "sharegpt-out.jsonl")
    r = run(["--input", sharegpt, "--output", out])
    check(r.returncode == 0 and read_jsonl(out) == docs, f"sharegpt: {r.stderr}")

    # --max-length, and the binary form equal to drafter-trainer's conversion of the JSONL
    out_j, out_b = os.path.join(tmp, "cut.jsonl"), os.path.join(tmp, "cut.safetensors")
    r = run(["--input", f"{openai},{sharegpt}", "--output", out_j, "--max-length", "13"])
    check(r.returncode == 0 and "2 truncated" in r.stderr, f"max-length: {r.stderr}")
    cut = read_jsonl(out_j)
    check(len(cut) == 4 and max(len(d["input_ids"]) for d in cut) == 13 and len(cut[1]["input_ids"]) == 13, "max-length lengths")
    r = run(["--input", f"{openai},{sharegpt}", "--output", out_b, "--max-length", "13"])
    check(r.returncode == 0, f"binary: {r.stderr}")
    if len(sys.argv) > 1:
        conv_b = os.path.join(tmp, "conv.safetensors")
        c = subprocess.run([sys.argv[1], "dataset", "convert", out_j, conv_b], capture_output=True, text=True)
        check(c.returncode == 0, f"dataset convert: {c.stderr}")
        a, b = safetensors.numpy.load_file(out_b), safetensors.numpy.load_file(conv_b)
        for k in ("input_ids", "loss_mask", "doc_offsets"):
            check(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"binary {k} differs")
        c = subprocess.run([sys.argv[1], "dataset", "inspect", out_b, "--token-budget", "32"], capture_output=True,
                           text=True)
        check(c.returncode == 0 and "4 documents" in c.stdout, f"inspect: {c.stdout}{c.stderr}")

    # bad input: one message naming the line
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{\"messages\": [\n")
    r = run(["--input", bad, "--output", os.path.join(tmp, "x.jsonl")])
    check(r.returncode == 1 and "line 2: not valid JSON" in r.stderr and r.stderr.count("\n") == 1, r.stderr)
    with open(bad, "w") as f:
        f.write(json.dumps({"conversations": [{"from": "robot", "value": "hi"}]}) + "\n")
    r = run(["--input", bad, "--output", os.path.join(tmp, "x.jsonl")])
    check(r.returncode == 1 and "line 1" in r.stderr and "robot" in r.stderr, r.stderr)
    r = run(["--input", os.path.join(tmp, "missing.jsonl"), "--output", os.path.join(tmp, "x.jsonl")])
    check(r.returncode == 1 and "cannot open" in r.stderr, r.stderr)

    # the command line itself, once
    r = subprocess.run([sys.executable, TOOL, "--tokenizer", TOKENIZER, "--input", openai, "--output",
                        os.path.join(tmp, "cli.jsonl")], capture_output=True, text=True)
    check(r.returncode == 0 and read_jsonl(os.path.join(tmp, "cli.jsonl")) == docs, f"cli: {r.stderr}")

    if failures == 0:
        subprocess.run(["rm", "-rf", tmp])
    print(f"{failures} failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
