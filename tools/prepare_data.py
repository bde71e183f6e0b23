#!/usr/bin/env python3
"""tools/prepare_data.py — conversations to a Tandem tokenized dataset (drafter-trainer/feed/dt_dataset.h).

Reads ShareGPT ({"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}) or OpenAI
messages ({"messages": [{"role": ..., "content": ...}]}) JSONL, renders each conversation with a
Hugging Face tokenizer's chat template, tokenizes it, and sets loss_mask 1 exactly on the
assistant tokens: each assistant turn's text and its end-of-turn marker, not the role header the
template puts before it (nor the empty <think></think> a Qwen3 template adds with thinking off),
never the system, user or tool turns.

Spans come from rendering prefixes of the conversation, which works for any template: the
assistant turn i is the text between render(messages[:i]) and render(messages[:i + 1]), less the
header that render(messages[:i], add_generation_prompt=True) adds. Templates that rewrite history
(Qwen3 drops the reasoning of assistant turns before the last user message) make a prefix's
rendering differ from the whole; such turns are found by their content, searched in order.

    python3 tools/prepare_data.py --tokenizer Qwen/Qwen3-8B --input chats.jsonl --output data.jsonl
    python3 tools/prepare_data.py --tokenizer DIR --input a.jsonl,b.jsonl --output data.safetensors \\
        --thinking drop --max-length 8192

--thinking keep (default) keeps <think>...</think> reasoning in assistant turns (and a message's
"reasoning_content" as a <think> block) and renders with enable_thinking=True; drop strips it and
renders with enable_thinking=False. --max-length truncates documents (counted). Output: JSONL
{"input_ids", "loss_mask"}, or the binary form when OUTPUT ends in .safetensors (needs numpy and
safetensors). One summary line on stderr; exit 1 with one message on bad input, 2 on bad usage.
"""
import argparse
import json
import os
import re
import sys

THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool"}


class DataError(Exception):
    pass


def messages_of(record, where):
    """The record's conversation as [{"role", "content", ...}] (ShareGPT or OpenAI form)."""
    if isinstance(record.get("messages"), list):
        msgs = []
        for k, m in enumerate(record["messages"]):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise DataError(f"{where}: messages[{k}] has no \"role\"")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            msgs.append(dict(m, content=content if isinstance(content, str) else ""))
        return msgs
    if isinstance(record.get("conversations"), list):
        msgs = []
        for k, m in enumerate(record["conversations"]):
            who = m.get("from") if isinstance(m, dict) else None
            if who not in SHAREGPT_ROLES:
                raise DataError(f"{where}: conversations[{k}] has \"from\" {who!r}; expected one of "
                                f"{', '.join(sorted(SHAREGPT_ROLES))}")
            value = m.get("value")
            msgs.append({"role": SHAREGPT_ROLES[who], "content": value if isinstance(value, str) else ""})
        return msgs
    raise DataError(f"{where}: neither \"messages\" (OpenAI) nor \"conversations\" (ShareGPT)")


def apply_thinking(msgs, thinking):
    out = []
    for m in msgs:
        m = dict(m)
        if m["role"] == "assistant":
            reasoning = m.pop("reasoning_content", None)
            if thinking == "drop":
                m["content"] = THINK.sub("", m["content"]).lstrip()
            elif isinstance(reasoning, str) and reasoning and "<think>" not in m["content"]:
                m["content"] = f"<think>\n{reasoning.strip()}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


def common_prefix(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def assistant_spans(msgs, render):
    """[(start, end)] character spans of the assistant turns in render(msgs)."""
    full = render(msgs, False)
    spans, cursor = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prev = render(msgs[:i], False) if i else ""
        gen = render(msgs[:i], True) if i else ""
        upto = render(msgs[: i + 1], False)
        if full.startswith(upto) and upto.startswith(prev) and len(prev) >= cursor:
            head = common_prefix(upto[len(prev):], gen[len(prev):]) if gen.startswith(prev) else 0
            start, end = len(prev) + head, len(upto)
        else:  # the template rewrote this turn in the whole conversation: find it by content
            start, content = -1, ""
            for c in (m["content"].strip(), THINK.sub("", m["content"]).strip()):  # reasoning may be dropped
                start = full.find(c, cursor) if c else -1
                if start >= 0:
                    content = c
                    break
            if start < 0:
                raise DataError("cannot find an assistant turn in the rendered conversation; the chat "
                                "template changes its text (try --thinking drop)")
            end = start + len(content)
            k = upto.rfind(content)
            tail = upto[k + len(content):] if k >= 0 else ""
            end += common_prefix(tail, full[end:])  # the end-of-turn marker, as in the prefix
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return full, spans


def tokenize(tok, text, spans):
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask, s = list(enc["input_ids"]), [], 0
    for a, _ in enc["offset_mapping"]:
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        mask.append(1 if s < len(spans) and spans[s][0] <= a < spans[s][1] else 0)
    return ids, mask


def load_tokenizer(name, chat_template=None, need_template=True):
    """A fast Hugging Face tokenizer with a chat template (chat_template: a Jinja file overriding the
    tokenizer's; need_template=False accepts one without); DataError with one message when transformers,
    the tokenizer or the template is missing."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise DataError("needs the transformers package (pip install transformers)")
    loader = AutoTokenizer
    try:  # a plain tokenizer.json (models/tandem-tiny): transformers 5's AutoTokenizer would take the class of
        # config.json's model_type instead (Qwen3.5's, which rebuilds a BPE this file does not hold)
        with open(os.path.join(name, "tokenizer_config.json")) as f:
            if json.load(f).get("tokenizer_class") == "PreTrainedTokenizerFast":
                loader = PreTrainedTokenizerFast
    except (OSError, ValueError, AttributeError):
        pass
    try:
        tok = loader.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 — one message, whatever the loader raised
        raise DataError(f"cannot load tokenizer '{name}': {e}")
    if chat_template:
        with open(chat_template) as f:
            tok.chat_template = f.read()
    if need_template and not getattr(tok, "chat_template", None):
        raise DataError(f"tokenizer '{name}' has no chat template; pass --chat-template FILE")
    if not getattr(tok, "is_fast", False):
        raise DataError(f"tokenizer '{name}' is not a fast tokenizer (offsets are needed)")
    return tok


def renderer(tok, thinking):
    """render(msgs, add_generation_prompt) -> text, with enable_thinking set from --thinking keep|drop."""
    enable = thinking == "keep"

    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, enable_thinking=enable)

    return render


def write_binary(path, docs):
    import numpy as np
    from safetensors.numpy import save_file

    ids = np.concatenate([np.asarray(d[0], dtype=np.int32) for d in docs])
    mask = np.concatenate([np.asarray(d[1], dtype=np.uint8) for d in docs])
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d[0]) for d in docs])
    tmp = path + ".tmp"
    save_file({"input_ids": ids, "loss_mask": mask, "doc_offsets": offsets}, tmp,
              metadata={"format": "tandem-tokens", "version": "1"})
    os.replace(tmp, path)


def write_jsonl(path, docs):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for ids, mask in docs:
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer name or directory")
    ap.add_argument("--input", required=True, help="JSONL file(s), comma-separated")
    ap.add_argument("--output", required=True, help="OUT.jsonl, or OUT.safetensors for the binary form")
    ap.add_argument("--thinking", choices=["keep", "drop"], default="keep")
    ap.add_argument("--max-length", type=int, default=0, help="truncate documents to N tokens (0: off)")
    ap.add_argument("--chat-template", help="a Jinja chat template file overriding the tokenizer's")
    a = ap.parse_args(argv)
    if a.max_length < 0:
        ap.error("--max-length must be >= 0")

    try:
        tok = load_tokenizer(a.tokenizer, a.chat_template)
    except DataError as e:
        print(f"prepare_data.py: {e}", file=sys.stderr)
        return 1
    render = renderer(tok, a.thinking)

    docs, n_conv, n_skipped, n_truncated, n_tokens, n_sup = [], 0, 0, 0, 0, 0
    try:
        for path in a.input.split(","):
            try:
                f = open(path)
            except OSError as e:
                raise DataError(f"cannot open '{path}': {e.strerror}")
            with f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"'{path}' line {line_no}"
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{where}: not valid JSON ({e.msg})")
                    if not isinstance(record, dict):
                        raise DataError(f"{where}: not a JSON object")
                    msgs = apply_thinking(messages_of(record, where), a.thinking)
                    n_conv += 1
                    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
                        n_skipped += 1
                        continue
                    try:
                        text, spans = assistant_spans(msgs, render)
                    except DataError as e:
                        raise DataError(f"{where}: {e}")
                    except Exception as e:  # noqa: BLE001 — template errors name the conversation
                        raise DataError(f"{where}: the chat template fails on this conversation: {e}")
                    ids, mask = tokenize(tok, text, spans)
                    if a.max_length and len(ids) > a.max_length:
                        ids, mask = ids[: a.max_length], mask[: a.max_length]
                        n_truncated += 1
                    docs.append((ids, mask))
                    n_tokens += len(ids)
                    n_sup += sum(mask)
    except DataError as e:
        print(f"prepare_data.py: {e}", file=sys.stderr)
        return 1
    if not docs:
        print(f"prepare_data.py: no conversation of '{a.input}' has an assistant turn; nothing to write",
              file=sys.stderr)
        return 1
    if a.output.endswith(".safetensors"):
        write_binary(a.output, docs)
    else:
        write_jsonl(a.output, docs)
    print(f"prepare_data.py: {n_conv} conversations -> {len(docs)} documents in '{a.output}' "
          f"({n_skipped} without an assistant turn skipped, {n_truncated} truncated to --max-length "
          f"{a.max_length}), {n_tokens} tokens, {n_sup} supervised", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
