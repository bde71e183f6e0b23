#!/usr/bin/env python3
"""Builds tests/data/dataset/tokenizer/: a tiny word-level Hugging Face tokenizer
(PreTrainedTokenizerFast) with a Qwen3-style chat template, for testing tools/prepare_data.py
offline. The template behaves like Qwen3's where it matters: <|im_start|>ROLE ... <|im_end|>
turns, an assistant turn after the last user message carries a <think>...</think> block
(empty when enable_thinking is false), earlier assistant turns drop their reasoning, so the
rendering of a prefix is not always a prefix of the whole conversation.
Run: python3 tests/data/dataset/make_tokenizer.py (needs tokenizers and transformers)."""
import os

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
WORDS = ("[UNK] system user assistant tool you are a helpful bot hi hello how what is two plus "
         "three four five six the answer sum of and then more again thanks bye ok sure let me think "
         "it yes no why because").split()

TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1].strip() -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}")


def main():
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:])
    fast.chat_template = TEMPLATE
    out = os.path.join(HERE, "tokenizer")
    fast.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
