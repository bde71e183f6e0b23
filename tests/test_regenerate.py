#!/usr/bin/env python3
"""tests/test_regenerate.py — tools/regenerate.py against a stub OpenAI-compatible server on 127.0.0.1 (a thread
of this process) that serves /v1/models, /v1/chat/completions and /v1/completions deterministically: its chat
template for models/tandem-tiny is `<bos> (<user> TEXT | <assistant> TEXT <eos>)... <assistant>` and its answer
is the last user turn's words reversed, then <eos>. Checked: the documents of tokenized input (data/tiny, and
two-turn documents under --turns all and last) and of chat input (OpenAI and ShareGPT, multi-turn, --turns all
and last) against ones computed here; the request fields (model, per-sample seed, sampling, thinking); retries
through an injected 500, 429 and dropped connection; a 400 skips its sample, and so does a sample whose retries
run out under --on-error skip; input order kept under concurrency; a server that leaves <eos> out of its ids;
a template that rewrites earlier replies ("server-partial"); a run killed midway (and a torn last line), one
stopped by SIGTERM and one stopped by exhausted retries, each then rerun, end byte for byte as an uninterrupted
run; refusals (unreachable endpoint, unknown model, another input, other settings, a server without token ids
under --token-ids server, an output regenerate.py did not write); replies cut at --max-tokens. With
transformers: the text path gives the same documents, equal to tools/prepare_data.py's on the regenerated
conversations, and is the fallback where the server's template rewrote a reply. Argument (optional): the
drafter-trainer binary, which must read the output (`dataset inspect`)."""
import contextlib
import http.server
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
TOOL = os.path.join(ROOT, "tools", "regenerate.py")
TARGET = os.path.join(ROOT, "models", "tandem-tiny")
TOKENS = os.path.join(ROOT, "data", "tiny", "valid.jsonl")
OTHER = os.path.join(ROOT, "data", "tiny", "train.jsonl")
with open(os.path.join(TARGET, "vocab.txt")) as f:
    VOCAB = [w.rstrip("\n") for w in f]
ID = {w: i for i, w in enumerate(VOCAB)}
BOS, EOS, USER, ASSISTANT = ID["<bos>"], ID["<eos>"], ID["<user>"], ID["<assistant>"]
TEMPLATE = ("<bos>{% for m in messages %}{% if m.role == 'assistant' %} <assistant> {{ m.content }} <eos>"
            "{% else %} <user> {{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %} <assistant>"
            "{% endif %}")
failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print(f"check failed: {what}", file=sys.stderr)


def words(text):
    return [ID[w] for w in text.split()]


def text_of(ids):
    return " ".join(VOCAB[t] for t in ids)


def template_ids(messages, rewrite=False):
    """The stub's chat template with the generation prompt, in token ids; rewrite: an assistant turn before the
    last user turn loses its first word (as Qwen3's template drops the reasoning of such turns)."""
    ids, last_user = [BOS], max((k for k, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            ids += [ASSISTANT] + words(m["content"])[1 if rewrite and k < last_user else 0:] + [EOS]
        else:
            ids += [USER] + words(m["content"])
    return ids + [ASSISTANT]


def answer(prompt):
    """The stub's reply to a prompt: the last user turn's words reversed, then <eos>."""
    u = max(k for k, t in enumerate(prompt) if t == USER)
    a = next((k for k in range(u + 1, len(prompt)) if prompt[k] == ASSISTANT), len(prompt))
    return prompt[u + 1: a][::-1] + [EOS]


# ----------------------------------------------------------------------------------------------------------
# The stub server


class Stub(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # socketserver's 5 drops the SYNs of 64 connecting workers: 1 s retransmits

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.reset()

    def reset(self, **kw):
        with getattr(self, "lock", threading.Lock()):
            self.models, self.fail, self.requests = ["tandem-tiny"], {}, []
            self.no_ids, self.omit_eos, self.rewrite, self.delay_ms = False, False, False, lambda seed: 0
            for k, v in kw.items():
                setattr(self, k, v)

    def handle_error(self, request, client_address):
        pass  # a client killed mid-request (the resume check) breaks its pipe

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

    def log_message(self, *args):
        pass

    def send_json(self, status, obj, headers=()):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            models = [{"id": m, "object": "model"} for m in self.server.models]
            self.send_json(200, {"object": "list", "data": models})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.requests.append((self.path, body))
            todo = srv.fail.get(body.get("seed"), [])
            fail = todo.pop(0) if todo else None
        if fail == "drop":
            self.close_connection = True  # no answer at all: the client sees the connection closed
            return
        if fail in ("500", "400"):
            return self.send_json(int(fail), {"error": {"message": f"injected {fail}"}})
        if fail == "429":
            return self.send_json(429, {"error": {"message": "slow down"}}, [("Retry-After", "0")])
        if body.get("model") not in srv.models:
            return self.send_json(404, {"error": {"message": f"model {body.get('model')} does not exist"}})
        time.sleep(srv.delay_ms(body.get("seed", 0)) / 1000.0)
        chat = self.path == "/v1/chat/completions"
        prompt = template_ids(body["messages"], srv.rewrite) if chat else body["prompt"]
        reply, finish = answer(prompt), "stop"
        if len(reply) > body["max_tokens"]:
            reply, finish = reply[: body["max_tokens"]], "length"
        text = text_of([t for t in reply if t != EOS])
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        resp = {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": body["model"],
                "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(reply)}}
        if body.get("return_token_ids") and not srv.no_ids:
            choice["token_ids"] = reply[:-1] if srv.omit_eos and reply[-1] == EOS else reply
            if chat:
                resp["prompt_token_ids"] = prompt  # vLLM's chat form; per choice for completions
            else:
                choice["prompt_token_ids"] = prompt
        self.send_json(200, resp)


# ----------------------------------------------------------------------------------------------------------
# Expected documents, computed without the tool


def expect_tokens(doc, max_tokens=1 << 30):
    ids, mask = doc["input_ids"], doc["loss_mask"]
    s = mask.index(1)
    reply = answer(ids[:s])
    finish = "stop"
    if len(reply) > max_tokens:
        reply, finish = reply[:max_tokens], "length"
    return ids[:s] + reply, [0] * s + [1] * len(reply), finish


def expect_chat(msgs, turns, rewrite=False):
    """(ids, mask) of a conversation regenerated by the stub, or None when it has no user turn; rewrite: the
    stub's template rewrote the earlier replies (they stay unsupervised: "server-partial")."""
    users = [k for k, m in enumerate(msgs) if m["role"] == "user"]
    if not users:
        return None
    if turns == "last":
        msgs = msgs[: users[-1] + 1]
    ids, mask, last_user = [BOS], [0], None
    for k, m in enumerate(msgs):
        if m["role"] == "assistant" and (turns == "last" or k <= users[0]):  # context, unsupervised
            part = [ASSISTANT] + words(m["content"]) + [EOS]
            ids, mask = ids + part, mask + [0] * len(part)
        elif m["role"] == "assistant":
            reply, old = last_user[::-1] + [EOS], rewrite and k < users[-1]
            ids, mask = ids + [ASSISTANT] + reply[old:], mask + [0] + [0 if old else 1] * len(reply[old:])
        else:
            ids, mask = ids + [USER] + words(m["content"]), mask + [0] * (1 + len(words(m["content"])))
            last_user = words(m["content"]) if m["role"] == "user" else last_user
    if msgs[-1]["role"] != "assistant":
        reply = last_user[::-1] + [EOS]
        ids, mask = ids + [ASSISTANT] + reply, mask + [0] + [1] * len(reply)
    return ids, mask


# ----------------------------------------------------------------------------------------------------------
# Running the tool


def load_tool():
    spec = importlib.util.spec_from_file_location("regenerate", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL_MOD = None


class Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def run(stub, args, endpoint=None):
    """regenerate.main in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = TOOL_MOD.main(["--endpoint", endpoint or stub.url, "--target", TARGET, "--backoff", "0.01"] + args)
        except SystemExit as e:
            rc = e.code
    return Result(rc, err.getvalue())


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def count_lines(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def main():
    global TOOL_MOD
    TOOL_MOD = load_tool()
    tmp = tempfile.mkdtemp(prefix="tandem-regenerate-")
    stub = Stub()
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    token_docs = read_jsonl(TOKENS)
    n_tok = len(token_docs)

    # ---- tokenized input: retries through a 500, a 429, a dropped connection; order under concurrency
    ref = os.path.join(tmp, "ref.jsonl")
    stub.reset(fail={3: ["500"], 5: ["429"], 7: ["drop"], 11: ["500", "drop"]}, delay_ms=lambda s: (s * 7) % 5)
    r = run(stub, ["--input", TOKENS, "--output", ref, "--concurrency", "8", "--token-ids", "server"])
    check(r.returncode == 0, f"tokens exit {r.returncode}: {r.stderr}")
    got = read_jsonl(ref)
    check([d["index"] for d in got] == list(range(n_tok)), "tokens: one line per sample, in input order")
    for i, (d, src) in enumerate(zip(got, token_docs)):
        ids, mask, _ = expect_tokens(src)
        if d["input_ids"] != ids or d["loss_mask"] != mask or d["source"] != "server" or "finish" in d:
            check(False, f"tokens doc {i}: {d} expected {ids} {mask}")
            break
    check("retries 5" in r.stderr and f"{n_tok} documents" in r.stderr and "0 skipped" in r.stderr,
          f"tokens summary: {r.stderr}")
    seeds = sorted(b["seed"] for p, b in stub.requests if p == "/v1/completions")
    check(seeds == sorted(list(range(n_tok)) + [3, 5, 7, 11, 11]), f"seeds {seeds[:20]}")
    body = stub.requests[0][1]
    check(body["temperature"] == 0.0 and body["top_p"] == 1.0 and body["max_tokens"] == 4096
          and body["model"] == "tandem-tiny" and body["return_token_ids"] is True and "stop" not in body,
          f"request body {body}")
    ref_bytes = read_bytes(ref)
    meta = json.load(open(ref + ".regen.json"))
    check(meta["format"] == "tandem-regenerate" and meta["input"]["samples"] == n_tok
          and meta["settings"]["model"] == "tandem-tiny", f"sidecar {meta}")

    # the server leaves <eos> out of token_ids: the tool closes the turn with it; a second rerun is a no-op
    out = os.path.join(tmp, "omit.jsonl")
    stub.reset(omit_eos=True)
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server"])
    check(r.returncode == 0 and read_bytes(out) == read_bytes(ref), f"omitted eos: {r.stderr}")
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server"])
    check(r.returncode == 0 and "is complete" in r.stderr and read_bytes(out) == read_bytes(ref),
          f"rerun: {r.stderr}")

    # ---- killed midway (and a torn last line), then resumed: the same bytes as the uninterrupted run
    out = os.path.join(tmp, "killed.jsonl")
    stub.reset(delay_ms=lambda s: 15)
    cmd = [sys.executable, TOOL, "--endpoint", stub.url, "--target", TARGET, "--input", TOKENS, "--output", out,
           "--concurrency", "2", "--token-ids", "server"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while count_lines(out) < 30 and p.poll() is None and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    k = count_lines(out)
    check(0 < k < n_tok, f"killed after {k} lines")
    with open(out, "ab") as f:
        f.write(b'{"index":%d,"source":"server","input_ids":[1,3,' % k)
    r = subprocess.run(cmd, capture_output=True, text=True)
    check(r.returncode == 0 and f"resumed at sample {k}" in r.stderr, f"resume exit {r.returncode}: {r.stderr}")
    check(read_bytes(out) == read_bytes(ref), "killed + resumed differs from the uninterrupted run")
    check(read_bytes(out + ".regen.json") == read_bytes(ref + ".regen.json"), "sidecars differ")

    # ---- retries exhausted: stops with the prefix written; the rerun ends as the uninterrupted run
    out = os.path.join(tmp, "stopped.jsonl")
    stub.reset(fail={40: ["500"] * 3})
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server", "--max-retries", "2"])
    check(r.returncode == 1 and "stopped: sample 40" in r.stderr and "HTTP 500" in r.stderr
          and "rerun the same command" in r.stderr, f"exhausted: {r.stderr}")
    got = read_jsonl(out)
    check([d["index"] for d in got] == list(range(len(got))) and len(got) <= 40, f"stopped prefix {len(got)}")
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server"])
    check(r.returncode == 0 and read_bytes(out) == read_bytes(ref), f"rerun after stop: {r.stderr}")

    # ---- SIGTERM: exit 130 with the prefix written; the rerun ends the same
    out = os.path.join(tmp, "term.jsonl")
    stub.reset(delay_ms=lambda s: 15)
    cmd[cmd.index("--output") + 1] = out
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while count_lines(out) < 20 and p.poll() is None and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate()
    check(p.returncode == 130 and "interrupted" in err and 0 < count_lines(out) < n_tok,
          f"sigterm {p.returncode}: {err}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    check(r.returncode == 0 and read_bytes(out) == read_bytes(ref), f"resume after SIGTERM: {r.stderr}")

    # ---- --on-error skip: a sample whose retries run out is listed and left out
    out = os.path.join(tmp, "onerror.jsonl")
    stub.reset(fail={40: ["500"] * 3})
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server", "--max-retries", "2", "--on-error",
                   "skip"])
    skipped = read_jsonl(out + ".skipped")
    check(r.returncode == 0 and [d["index"] for d in read_jsonl(out)] == [i for i in range(n_tok) if i != 40]
          and len(skipped) == 1 and skipped[0]["index"] == 40 and skipped[0]["kind"] == "failed",
          f"on-error: {r.stderr}")

    # ---- tokenized documents of two turns (--turns all and last), one without a mask, one without a prompt
    two = [BOS, USER] + words("copy 1 2") + [ASSISTANT] + words("1 2") + [EOS, USER] + words("say 3") + [ASSISTANT] \
        + words("3") + [EOS]
    first, second = two.index(ASSISTANT) + 1, len(two) - 2
    two_mask = [1 if first <= k < first + 3 or k >= second else 0 for k in range(len(two))]
    multi = os.path.join(tmp, "multi.jsonl")
    with open(multi, "w") as f:
        for d in ({"input_ids": two, "loss_mask": two_mask}, {"input_ids": two}, {"input_ids": two, "loss_mask":
                  [1] * len(two)}, token_docs[0]):
            f.write(json.dumps(d) + "\n")
    for turns in ("all", "last"):
        out = os.path.join(tmp, f"multi-{turns}.jsonl")
        stub.reset()
        r = run(stub, ["--input", multi, "--output", out, "--turns", turns])
        got = read_jsonl(out)
        if turns == "all":
            p1 = two[:first]
            r1 = answer(p1)
            p2 = p1 + r1 + two[first + 3: second]
            want_ids, want_mask = p2 + answer(p2), [0] * len(p1) + [1] * len(r1) + [0] * (second - first - 3)
        else:
            p2 = two[:second]
            want_ids, want_mask = p2 + answer(p2), [0] * len(p2)
        want_mask += [1] * len(answer(p2))
        skipped = {d["index"]: d["kind"] for d in read_jsonl(out + ".skipped")}
        check(r.returncode == 0 and len(got) == 2 and got[0]["input_ids"] == want_ids and got[0]["loss_mask"] ==
              want_mask and got[1]["index"] == 3 and skipped == {1: "bad-record", 2: "no-prompt"},
              f"multi {turns}: {got[:1]} {skipped} expected {want_ids} {want_mask}: {r.stderr}")

    # ---- refusals
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    r = run(stub, ["--input", TOKENS, "--output", os.path.join(tmp, "x.jsonl"), "--max-retries", "1"], closed)
    check(r.returncode == 1 and "cannot reach the endpoint" in r.stderr and r.stderr.count("\n") == 1, r.stderr)
    r = run(stub, ["--input", TOKENS, "--output", os.path.join(tmp, "x.jsonl"), "--model", "nope"])
    check(r.returncode == 1 and "does not serve the model 'nope'" in r.stderr and "tandem-tiny" in r.stderr,
          r.stderr)
    stub.reset(models=["a", "b"])
    r = run(stub, ["--input", TOKENS, "--output", os.path.join(tmp, "x.jsonl")])
    check(r.returncode == 1 and "pick one with --model" in r.stderr, r.stderr)
    stub.reset()
    r = run(stub, ["--input", OTHER, "--output", ref, "--token-ids", "server"])
    check(r.returncode == 1 and "belongs to another input" in r.stderr, r.stderr)
    r = run(stub, ["--input", TOKENS, "--output", ref, "--token-ids", "server", "--max-tokens", "8"])
    check(r.returncode == 1 and "other settings: max_tokens 4096 (now 8)" in r.stderr, r.stderr)
    check(read_bytes(ref) == ref_bytes, "a refused resume changed the output")
    stub.reset(no_ids=True)
    out = os.path.join(tmp, "noids.jsonl")
    r = run(stub, ["--input", TOKENS, "--output", out, "--token-ids", "server"])
    check(r.returncode == 1 and "returned no token ids" in r.stderr and count_lines(out) == 0, r.stderr)
    stranger = os.path.join(tmp, "stranger.jsonl")
    with open(stranger, "w") as f:
        f.write('{"input_ids": [1]}\n')
    r = run(stub, ["--input", TOKENS, "--output", stranger])
    check(r.returncode == 1 and "not written by regenerate.py" in r.stderr, r.stderr)

    # ---- replies cut at --max-tokens: kept with "finish": "length" (no <eos> added), or skipped
    stub.reset()
    out = os.path.join(tmp, "cut.jsonl")
    cut = ["--input", TOKENS, "--output", out, "--max-tokens", "3", "--token-ids", "server"]
    r = run(stub, cut + ["--limit", "10"])
    got = read_jsonl(out)
    check(r.returncode == 0 and len(got) == 10, f"cut: {r.stderr}")
    for d, src in zip(got, token_docs):
        ids, mask, finish = expect_tokens(src, 3)
        check(d["input_ids"] == ids and d["loss_mask"] == mask and d.get("finish", "stop") == finish, f"cut {d}")
    r = run(stub, cut + ["--limit", "20"])
    check(r.returncode == 0 and len(read_jsonl(out)) == 20 and "resumed at sample 10" in r.stderr,
          f"limit: {r.stderr}")
    out = os.path.join(tmp, "cut-skip.jsonl")
    r = run(stub, ["--input", TOKENS, "--output", out, "--max-tokens", "3", "--skip-truncated", "--limit", "10"])
    n_cut = sum(expect_tokens(d, 3)[2] == "length" for d in token_docs[:10])
    check(r.returncode == 0 and len(read_jsonl(out)) == 10 - n_cut and len(read_jsonl(out + ".skipped")) == n_cut,
          f"skip-truncated: {r.stderr}")

    # ---- chat input: OpenAI and ShareGPT, multi-turn, a skip (no user turn), a refused sample, a bad line
    chats = []
    for d in token_docs[:20]:
        ids, mask = d["input_ids"], d["loss_mask"]
        s = mask.index(1)
        chats.append([{"role": "user", "content": text_of(ids[2: s - 1])},
                      {"role": "assistant", "content": text_of(ids[s:-1])}])
    chats[3] = [{"role": "system", "content": "please"}] + chats[3] + [{"role": "user", "content": "repeat 1 2 3"},
                                                                      {"role": "assistant", "content": "ok"}]
    chats[4] = [{"role": "user", "content": "say 4 5 6"}]
    chats[6] = [{"role": "system", "content": "please"}, {"role": "assistant", "content": "ok"}]
    chats[8] = chats[8] + [{"role": "user", "content": "copy 1 2"}]
    chat_in = os.path.join(tmp, "chats.jsonl")
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    with open(chat_in, "w") as f:
        for i, c in enumerate(chats):
            if i == 10:
                f.write('{"messages": [\n')
            elif i % 2:
                conv = [{"from": names[m["role"]], "value": m["content"]} for m in c]
                f.write(json.dumps({"conversations": conv}) + "\n")
            else:
                f.write(json.dumps({"messages": c}) + "\n\n")
    for turns in ("all", "last"):
        out = os.path.join(tmp, f"chat-{turns}.jsonl")
        stub.reset(fail={12: ["400"]})
        r = run(stub, ["--input", chat_in, "--output", out, "--turns", turns, "--seed", "0", "--concurrency", "3"])
        check(r.returncode == 0, f"chat {turns} exit {r.returncode}: {r.stderr}")
        got = {d["index"]: d for d in read_jsonl(out)}
        skipped = {d["index"]: d["kind"] for d in read_jsonl(out + ".skipped")}
        check(skipped == {6: "no-user-turn", 10: "bad-record", 12: "refused"}, f"chat {turns} skipped {skipped}")
        for i, c in enumerate(chats):
            if i in skipped:
                continue
            want = expect_chat(c, turns)
            d = got.get(i)
            check(d is not None and (d["input_ids"], d["loss_mask"]) == want and d["source"] == "server",
                  f"chat {turns} doc {i}: {d}, expected {want}")
        n_req = sum(p == "/v1/chat/completions" for p, _ in stub.requests)
        check(n_req == (20 if turns == "all" else 18), f"chat {turns}: {n_req} requests")
    seeds = sorted({b["seed"] for p, b in stub.requests})
    check(seeds == [i for i in range(20) if i not in (6, 10)], f"chat seeds {seeds}")
    # a template that rewrites earlier replies: they cannot be found in the last prompt's ids
    out = os.path.join(tmp, "chat-rewrite.jsonl")
    stub.reset(rewrite=True)
    r = run(stub, ["--input", chat_in, "--output", out, "--token-ids", "server", "--limit", "10"])
    got = {d["index"]: d for d in read_jsonl(out)}
    for i in (3, 8, 0):
        want = expect_chat(chats[i], "all", rewrite=True)
        check(r.returncode == 0 and (got[i]["input_ids"], got[i]["loss_mask"]) == want
              and got[i]["source"] == ("server" if i == 0 else "server-partial"), f"rewrite {i}: {got[i]} {want}")
    out = os.path.join(tmp, "chat-drop.jsonl")
    stub.reset()
    r = run(stub, ["--input", chat_in, "--output", out, "--thinking", "drop", "--temperature", "0.7", "--top-p",
                   "0.9", "--seed", "100", "--limit", "3", "--max-tokens", "64"])
    b = stub.requests[-1][1]
    check(r.returncode == 0 and b["chat_template_kwargs"] == {"enable_thinking": False} and b["temperature"] == 0.7
          and b["top_p"] == 0.9 and b["max_tokens"] == 64
          and sorted(x["seed"] for _, x in stub.requests) == [100, 101, 102],
          f"chat request {b}: {r.stderr}")

    # ---- the text path (needs transformers): the same documents, equal to prepare_data.py's
    try:
        import transformers  # noqa: F401
        have_tf = True
    except ImportError:
        have_tf = False
        print("text path skipped: no transformers", file=sys.stderr)
    if have_tf:
        tpl = os.path.join(tmp, "template.jinja")
        with open(tpl, "w") as f:
            f.write(TEMPLATE)
        stub.reset(no_ids=True)
        out = os.path.join(tmp, "tokens-text.jsonl")
        r = run(stub, ["--input", TOKENS, "--output", out])  # auto: the server has no ids, the text is tokenized
        strip = lambda docs: [(d["index"], d["input_ids"], d["loss_mask"]) for d in docs]  # noqa: E731
        check(r.returncode == 0 and strip(read_jsonl(out)) == strip(read_jsonl(ref))
              and all(d["source"] == "text" for d in read_jsonl(out)), f"tokens text: {r.stderr}")
        for turns in ("all", "last"):
            out = os.path.join(tmp, f"chat-text-{turns}.jsonl")
            stub.reset(fail={12: ["400"]})
            r = run(stub, ["--input", chat_in, "--output", out, "--turns", turns, "--token-ids", "text",
                           "--chat-template", tpl])
            ids_docs = read_jsonl(os.path.join(tmp, f"chat-{turns}.jsonl"))
            check(r.returncode == 0 and strip(read_jsonl(out)) == strip(ids_docs), f"chat text {turns}: {r.stderr}")
        # auto, and the earlier replies rewritten by the server's template: those samples fall back to the text
        stub.reset(rewrite=True)
        out = os.path.join(tmp, "chat-rewrite-auto.jsonl")
        r = run(stub, ["--input", chat_in, "--output", out, "--chat-template", tpl, "--limit", "10"])
        got = {d["index"]: d for d in read_jsonl(out)}
        for i in (3, 8, 0):
            check(r.returncode == 0 and (got[i]["input_ids"], got[i]["loss_mask"]) == expect_chat(chats[i], "all")
                  and got[i]["source"] == ("server" if i == 0 else "text"), f"rewrite auto {i}: {got[i]}")
        r = run(stub, ["--input", chat_in, "--output", os.path.join(tmp, "y.jsonl"), "--token-ids", "text"])
        check(r.returncode == 1 and "no chat template" in r.stderr, f"no template: {r.stderr}")
        # prepare_data.py on the regenerated conversations (--turns all: every assistant turn is the target's)
        regen_chats = os.path.join(tmp, "regen-chats.jsonl")
        with open(regen_chats, "w") as f:
            for i, c in enumerate(chats):
                if i in (6, 10, 12):
                    continue
                conv = []
                for m in c + ([{"role": "assistant"}] if c[-1]["role"] != "assistant" else []):
                    if m["role"] == "assistant":
                        last_user = [x for x in conv if x["role"] == "user"][-1]
                        m = {"role": "assistant", "content": text_of(words(last_user["content"])[::-1])}
                    conv.append(m)
                f.write(json.dumps({"messages": conv}) + "\n")
        spec = importlib.util.spec_from_file_location("prepare_data",
                                                      os.path.join(ROOT, "tools", "prepare_data.py"))
        prep = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prep)
        out = os.path.join(tmp, "prepared.jsonl")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = prep.main(["--tokenizer", TARGET, "--chat-template", tpl, "--input", regen_chats, "--output", out])
        want = [(d["input_ids"], d["loss_mask"]) for d in read_jsonl(out)]
        got = [(d["input_ids"], d["loss_mask"]) for d in read_jsonl(os.path.join(tmp, "chat-text-all.jsonl"))]
        check(rc == 0 and got == want, f"prepare_data differs: {err.getvalue()}")

    # ---- drafter-trainer reads the output as it is
    if len(sys.argv) > 1:
        c = subprocess.run([sys.argv[1], "dataset", "inspect", ref, "--token-budget", "256"], capture_output=True,
                           text=True)
        check(c.returncode == 0 and f"{n_tok} documents" in c.stdout, f"inspect: {c.stdout}{c.stderr}")

    stub.shutdown()
    if failures == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{failures} failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
