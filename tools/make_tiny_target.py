#!/usr/bin/env python3
"""tools/make_tiny_target.py — the embedded default target and dataset: a tiny *trained* Qwen3.6-layout model.

Generates a synthetic chat corpus (seeded, word-level vocabulary of 512 tokens) whose assistant answers are
largely predictable from the conversation (counting with a step, times tables, copying / reversing / repeating a
list the user gave, key-value recall, sorting digits), trains a tiny hybrid Qwen3.5 text model on it with Hugging
Face Transformers on the CPU, and writes:

  models/tandem-tiny/    config.json (Qwen3_5ForConditionalGeneration, text_config, Qwen3.6 dtypes: every
                         tensor bf16), model.safetensors (model.language_model.*, lm_head, a tiny model.visual.*
                         tower that loaders skip), generation_config.json, vocab.txt (token id = line number - 1),
                         tokenizer.json + tokenizer_config.json (a word-level Hugging Face tokenizer: load it with
                         PreTrainedTokenizerFast.from_pretrained; AutoTokenizer picks Qwen3_5Tokenizer from the
                         config's model_type, which does not put the spaces back)
  data/tiny/train.jsonl  {"input_ids": [...], "loss_mask": [...]} one document a line, loss_mask 1 on the
  data/tiny/valid.jsonl  assistant answer (and its <eos>), drawn from the same generator with other seeds

Then it checks what it wrote: the saved bf16 checkpoint loaded back gives the train / held-out losses printed at
the end, and (with --check-dump, given a built target-server) `target-server dump` of the saved model agrees with
a float64 Transformers forward (relative L2 of every layer ≤ 1e-4).

Run from anywhere (CPU: 450 steps of 1024 tokens took 357 s of CPU time on one thread, 620 s wall on a loaded
2-core machine; the checks take a minute more):
  python3 tools/make_tiny_target.py [--check-dump build/target-server/target-server]
Rerunning with the same torch/transformers on the same kind of CPU and thread count reproduces every file
bit-exactly (see --threads); the corpus files do not depend on torch at all.
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------------------------
# Vocabulary: 512 word-level tokens. Ids are fixed by this list (vocab.txt is written from it).
# ----------------------------------------------------------------------------------------------------------------

SPECIAL = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>", "<mask>"]
PUNCT = [".", ",", ":", "=", "?", "+", "*", "-", ";"]
KEYWORDS = ["count", "from", "by", "to", "copy", "reverse", "repeat", "times", "table", "of", "what", "is",
            "the", "list", "value", "and", "then", "say", "sort", "digits", "please", "up", "down", "step",
            "words", "these", "back", "all", "keys", "values", "give", "me", "each", "once", "twice", "thrice",
            "ok", "here", "sure", "done", "in", "order", "a", "an", "it", "are"]
NUMBERS = [str(i) for i in range(200)]
# content words the lists are made of (nouns, colours, adjectives, verbs); readable token ids
WORDS = """
apple banana cherry grape lemon mango melon olive peach pear plum berry bread butter cheese honey rice salt sugar
tea coffee milk water juice soup cake cookie egg bean corn
cat dog horse cow sheep goat pig duck goose hen fox wolf bear lion tiger mouse rat rabbit deer frog fish whale
shark seal owl eagle crow snake bee ant moth
red blue green yellow orange purple pink brown black white gray gold silver
big small tall short long wide quick slow hot cold warm cool dark bright soft hard old new happy sad loud quiet
rich poor clean dirty sharp round flat thin thick heavy light
house door window table2 chair bed lamp clock book pen paper cup plate spoon fork knife box bag hat shoe coat
shirt ring key2 rope wheel boat car train bus bike road bridge river lake sea hill mountain tree flower grass
leaf stone sand cloud rain snow wind star moon sun sky fire ice
run walk jump swim fly sing dance read write draw cook eat drink sleep wake open close push pull throw catch
build break fix paint wash climb
north south east west left right top bottom front middle
""".split()
# pad with made-up syllable words up to 512 tokens in all (deterministic)
_SYL = ["ba", "ko", "mi", "ru", "te", "zo", "la", "ne", "pi", "su"]


def build_vocab():
    words = [w.replace("2", "") if w.endswith("2") else w for w in WORDS]
    vocab = SPECIAL + PUNCT + KEYWORDS + NUMBERS
    seen = set(vocab)
    content = []
    for w in words:
        if w not in seen:
            seen.add(w)
            content.append(w)
    i = 0
    while len(vocab) + len(content) < 512:
        w = _SYL[i % 10] + _SYL[(i // 10) % 10] + _SYL[(i // 100) % 10]
        i += 1
        if w not in seen:
            seen.add(w)
            content.append(w)
    vocab = vocab + content
    if len(vocab) != 512 or len(set(vocab)) != 512:
        raise SystemExit(f"make_tiny_target: vocabulary has {len(vocab)} tokens ({len(set(vocab))} distinct)")
    return vocab, content


VOCAB, CONTENT = build_vocab()
TOK = {w: i for i, w in enumerate(VOCAB)}
PAD, BOS, EOS, USER, ASSISTANT, MASK = (TOK[s] for s in SPECIAL)


def ids(words):
    return [TOK[w] for w in words]


# ----------------------------------------------------------------------------------------------------------------
# The corpus: chat-like documents. <bos> <user> QUESTION <assistant> ANSWER <eos>; loss_mask 1 on ANSWER + <eos>.
# ----------------------------------------------------------------------------------------------------------------

def task_count(r):
    step = r.choice([1, 1, 1, 2, 2, 3, 5, 10])
    n = min(r.randint(8, 40), 199 // step + 1)
    start = r.randint(0, 199 - step * (n - 1))
    end = start + step * (n - 1)
    if r.random() < 0.2:            # counting down
        start, end = end, start
        q = ["count", "down", "from", str(start), "by", str(step), "to", str(end)]
        a = [str(start - step * i) for i in range(n)]
    else:
        q = ["count", "from", str(start), "by", str(step), "to", str(end)]
        a = [str(start + step * i) for i in range(n)]
    return q, a


def task_table(r):
    k = r.randint(2, 19)
    n = min(199 // k, r.randint(8, 30))
    q = ["say", "the", "table", "of", str(k)]
    a = []
    for i in range(1, n + 1):
        a += [str(i), "*", str(k), "=", str(i * k), ";"]
    return q, a


def word_list(r, lo, hi):
    n = r.randint(lo, hi)
    return [r.choice(CONTENT) for _ in range(n)]


def task_copy(r):
    w = word_list(r, 4, 16)
    return ["copy", "these", "words", ":"] + w, w


def task_reverse(r):
    w = word_list(r, 3, 10)
    return ["reverse", "the", "list", ":"] + w, list(reversed(w))


def task_repeat(r):
    w = word_list(r, 2, 6)
    n = r.randint(3, 8)
    q = ["repeat"] + w + [str(n), "times"]
    a = []
    for i in range(n):
        a += w + ([","] if i + 1 < n else [])
    return q, a


def task_recall(r):
    n = r.randint(4, 12)
    keys = r.sample(CONTENT, n)
    vals = [str(r.randint(0, 199)) for _ in range(n)]
    q = []
    for k, v in zip(keys, vals):
        q += [k, "=", v, ","]
    order = list(range(n))
    r.shuffle(order)
    m = r.randint(2, n)
    q += ["what", "are"] + [keys[i] for i in order[:m]] + ["?"]
    a = []
    for i in order[:m]:
        a += [keys[i], "is", vals[i], ","]
    return q, a[:-1] + ["."]


def task_sort(r):
    n = r.randint(5, 24)
    d = [r.randint(0, 9) for _ in range(n)]
    return ["sort", "digits", ":"] + [str(x) for x in d], [str(x) for x in sorted(d)]


TASKS = [(task_count, 4), (task_table, 2), (task_copy, 2), (task_reverse, 1), (task_repeat, 4), (task_recall, 1),
         (task_sort, 1)]
OPENERS = [[], [], ["please"], ["ok"]]      # in the user part (loss_mask 0): some noise the answer must not copy


def make_doc(r):
    fn = r.choices([t for t, _ in TASKS], weights=[w for _, w in TASKS])[0]
    q, a = fn(r)
    user = [BOS, USER] + ids(r.choice(OPENERS) + q)
    answer = ids(a) + [EOS]
    toks = user + [ASSISTANT] + answer
    mask = [0] * (len(user) + 1) + [1] * len(answer)
    return toks, mask


def make_docs(seed, n):
    r = random.Random(seed)
    return [make_doc(r) for _ in range(n)]


def write_jsonl(path, docs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for toks, mask in docs:
            f.write(json.dumps({"input_ids": toks, "loss_mask": mask}, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# The model: a tiny hybrid Qwen3.5 text model (3 Gated DeltaNet layers : 1 gated attention layer), trained on CPU
# ----------------------------------------------------------------------------------------------------------------

TEXT = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, full_attention_interval=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
# tiny vision tower: only there so that the checkpoint has the real multimodal layout (loaders skip model.visual.*)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=TEXT["hidden_size"])


ROW = 256        # tokens per training row (sequences are at most this long)


def log(msg):
    print(msg, flush=True)


def fail(msg):
    raise SystemExit("make_tiny_target: " + msg)


def batches_of(docs, max_tokens, r):
    """Groups documents of similar length into right-padded batches of at most max_tokens padded tokens."""
    order = sorted(range(len(docs)), key=lambda i: (len(docs[i][0]), i))
    out, cur = [], []
    for i in order:
        L = len(docs[i][0])
        if cur and (len(cur) + 1) * L > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    r.shuffle(out)
    return out


def to_tensors(torch, docs, idx):
    L = max(len(docs[i][0]) for i in idx)
    x = torch.full((len(idx), L), PAD, dtype=torch.long)
    y = torch.full((len(idx), L), -100, dtype=torch.long)
    m = torch.zeros((len(idx), L), dtype=torch.bool)
    for row, i in enumerate(idx):
        t, mk = docs[i]
        x[row, :len(t)] = torch.tensor(t)
        y[row, :len(t) - 1] = torch.tensor(t[1:])          # next-token labels; right padding never leaks back
        m[row, :len(t) - 1] = torch.tensor(mk[1:], dtype=torch.bool)
    return x, y, m


def packed_rows(docs, row_len, r):
    """Training rows of row_len tokens: documents in random order laid end to end (a document that does not fit
    starts the next row; the rest is padding). Rows mix every task, and a multiple of the GDN chunk (64) wastes no
    chunk padding. Documents are not masked from each other; each starts with <bos>, which the model learns."""
    order = list(range(len(docs)))
    r.shuffle(order)
    rows, cur = [], []
    for i in order:
        if cur and sum(len(docs[j][0]) for j in cur) + len(docs[i][0]) > row_len:
            rows.append(cur)
            cur = []
        cur.append(i)
    if cur:
        rows.append(cur)
    return rows


def row_tensors(torch, docs, rows, row_len):
    x = torch.full((len(rows), row_len), PAD, dtype=torch.long)
    y = torch.full((len(rows), row_len), -100, dtype=torch.long)
    m = torch.zeros((len(rows), row_len), dtype=torch.bool)
    for k, row in enumerate(rows):
        off = 0
        for i in row:
            t, mk = docs[i]
            x[k, off:off + len(t)] = torch.tensor(t)
            y[k, off:off + len(t) - 1] = torch.tensor(t[1:])
            m[k, off:off + len(t) - 1] = torch.tensor(mk[1:], dtype=torch.bool)
            off += len(t)
    return x, y, m


def evaluate(torch, model, docs, max_tokens=2048):
    """Mean next-token cross-entropy over all tokens and over assistant tokens, and assistant argmax accuracy."""
    tot = [0.0, 0, 0.0, 0, 0]
    with torch.no_grad():
        for idx in batches_of(docs, max_tokens, random.Random(0)):
            x, y, m = to_tensors(torch, docs, idx)
            logits = model(input_ids=x, use_cache=False).logits.float()
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none", ignore_index=-100)
            valid = y != -100
            tot[0] += ce[valid].sum().item()
            tot[1] += int(valid.sum())
            tot[2] += ce[m].sum().item()
            tot[3] += int(m.sum())
            tot[4] += int((logits.argmax(-1) == y)[m].sum())
    return tot[0] / tot[1], tot[2] / tot[3], tot[4] / tot[3]


def train_target(args, train_docs, valid_docs):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(args.seed)
    cfg = Qwen3_5TextConfig(**TEXT)
    model = Qwen3_5ForCausalLM(cfg)
    model.train()
    n_par = sum(p.numel() for p in model.parameters())
    log(f"target: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
        f"{n_par / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    r = random.Random(args.seed)
    rows, per_step = [], args.batch_tokens // ROW
    while len(rows) < args.steps * per_step:
        rows += packed_rows(train_docs, ROW, r)
    plan = [rows[i * per_step:(i + 1) * per_step] for i in range(args.steps)]
    warm = max(1, args.steps // 20)
    t0, c0 = time.time(), time.process_time()
    for step, idx in enumerate(plan, 1):
        lr = args.lr * (step / warm if step <= warm else 0.5 * (1 + math.cos(math.pi * (step - warm) /
                                                                                 (args.steps - warm))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, m = row_tensors(torch, train_docs, idx, ROW)
        logits = model(input_ids=x, use_cache=False).logits
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none", ignore_index=-100)
        valid = y != -100
        # the whole document is language-modelled; the assistant answer (what drafters are trained on) counts
        # double so that the model spends its small capacity there
        w = valid.float() + m.float()
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            log(f"  step {step:5d}/{args.steps}  loss {loss.item():.4f}  lr {lr:.2e}  {time.time() - t0:6.1f} s "
                f"({time.process_time() - c0:6.1f} s cpu)")
    model.eval()
    return model


def save_target(model, out_dir, seed):
    """Writes the trained text model in the Qwen3.6 multimodal layout: every tensor bf16, keys
    model.language_model.*, lm_head.weight and a tiny model.visual.* tower."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(TEXT)
    cfg = Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    torch.manual_seed(seed + 1)                     # the vision tower's HF init
    mm = Qwen3_5ForConditionalGeneration(cfg).eval()
    missing = mm.model.language_model.load_state_dict(model.model.state_dict(), strict=True)
    if missing.missing_keys or missing.unexpected_keys:
        fail(f"text model keys do not match the multimodal model: {missing}")
    mm.lm_head.load_state_dict(model.lm_head.state_dict(), strict=True)
    mm.to(torch.bfloat16)                           # Qwen3.6: A_log and linear_attn.norm bf16 too
    mm.generation_config.bos_token_id = BOS
    mm.generation_config.eos_token_id = EOS
    mm.generation_config.pad_token_id = PAD
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    mm.save_pretrained(out_dir, max_shard_size="10GB")
    with open(os.path.join(out_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    save_tokenizer(out_dir)
    # the safetensors header must say bf16 for every tensor (Qwen3.6), and hold no F32 leftovers
    with open(os.path.join(out_dir, "model.safetensors"), "rb") as f:
        hdr = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    bad = sorted(k for k, v in hdr.items() if k != "__metadata__" and v["dtype"] != "BF16")
    if bad:
        fail(f"saved tensors that are not bf16: {bad}")
    n_text = sum(1 for k in hdr if k.startswith("model.language_model."))
    log(f"saved {out_dir}: {n_text} model.language_model.* tensors + lm_head + "
        f"{sum(1 for k in hdr if k.startswith('model.visual.'))} model.visual.* tensors, all BF16")


def save_tokenizer(out_dir):
    """A word-level Hugging Face tokenizer (whitespace split) with the same ids as vocab.txt."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        log("tokenizers is not installed: writing vocab.txt only")
        return
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with one space
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "mask_token": "<mask>", "unk_token": "<pad>",
                   "model_max_length": TEXT["max_position_embeddings"]}, f, indent=2, sort_keys=True)
        f.write("\n")


def load_saved(out_dir):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration
    model = Qwen3_5ForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32)
    return model.eval()


def check_dump(ts_bin, model_dir, docs, threads):
    """target-server dump of the saved model against a float64 Transformers forward of the same files
    (tests/oracle/make_target_fixtures.py's oracle: one forward per document, HF's fp32 casts made float64)."""
    import importlib.util
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration

    spec = importlib.util.spec_from_file_location(
        "make_target_fixtures", os.path.join(REPO, "tests", "oracle", "make_target_fixtures.py"))
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    seqlens = [len(t) for t, _ in docs]
    flat = [x for t, _ in docs for x in t]
    ids = torch.tensor(flat, dtype=torch.int32)
    cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(len(seqlens))], dtype=torch.int32)
    model = oracle.load_f64(Qwen3_5ForConditionalGeneration, model_dir, "tandem-tiny")
    with oracle.hf_float64():
        ref = oracle.run_packed(model, ids, seqlens)
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
        save_file({"input_ids": ids, "cu_seqlens": cu}, inp)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [ts_bin, "dump", "--model", model_dir, "--input", inp, "--out", out, "--logits",
               "--log-level", "warn"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
        got = load_file(out)
    worst = 0.0
    names = [f"layer_{i}" for i in range(TEXT["num_hidden_layers"])] + ["final_norm", "logits"]
    for k in names:
        a, b = got[k].double(), ref[k].double()
        if a.shape != b.shape:
            fail(f"dump {k} has shape {tuple(a.shape)}, Transformers {tuple(b.shape)}")
        rel = ((a - b).norm() / b.norm()).item()
        worst = max(worst, rel)
        if not rel <= 1e-4:
            fail(f"target-server dump differs from Transformers on {k}: relative L2 {rel:.3e} > 1e-4")
    log(f"check: target-server dump == float64 Transformers on {len(docs)} documents ({len(flat)} tokens), "
        f"worst relative L2 over {len(names)} outputs {worst:.2e} (tolerance 1e-4)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(REPO, "models", "tandem-tiny"))
    ap.add_argument("--data-dir", default=os.path.join(REPO, "data", "tiny"))
    ap.add_argument("--seed", type=int, default=1234, help="weights init and batch order")
    ap.add_argument("--steps", type=int, default=450, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024, help="tokens per step (rows of 256)")
    ap.add_argument("--corpus", type=int, default=20000, help="training documents for the target")
    ap.add_argument("--n-train", type=int, default=400, help="documents in data/tiny/train.jsonl")
    ap.add_argument("--n-valid", type=int, default=100, help="documents in data/tiny/valid.jsonl")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (results are bit-exact for one thread count on one kind of CPU)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--data-only", action="store_true", help="write only the corpus files (no torch needed)")
    ap.add_argument("--check-only", action="store_true", help="skip training; check the saved model")
    ap.add_argument("--check-dump", metavar="TARGET_SERVER",
                    help="also hold `TARGET_SERVER dump` of the saved model to float64 Transformers")
    args = ap.parse_args()

    # seeds: the target's corpus, the tiny dataset and its held-out part are disjoint draws of one generator
    corpus = make_docs(1, args.corpus)
    held_out = make_docs(2, 300)
    train_set = make_docs(3, args.n_train)
    valid_set = make_docs(4, args.n_valid)
    write_jsonl(os.path.join(args.data_dir, "train.jsonl"), train_set)
    write_jsonl(os.path.join(args.data_dir, "valid.jsonl"), valid_set)
    for n in ("train.jsonl", "valid.jsonl"):
        p = os.path.join(args.data_dir, n)
        d = train_set if n == "train.jsonl" else valid_set
        log(f"wrote {p}: {len(d)} documents, {sum(len(t) for t, _ in d)} tokens, "
            f"{sum(sum(m) for _, m in d)} with loss_mask 1, {os.path.getsize(p)} bytes")
    if args.data_only:
        return

    import torch
    import transformers
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads")
    if not args.check_only:
        t0 = time.time()
        model = train_target(args, corpus, held_out)
        log(f"trained in {time.time() - t0:.0f} s")
        save_target(model, args.model_dir, args.seed)
    saved = load_saved(args.model_dir)
    for name, d in (("target corpus (first 300)", corpus[:300]), ("held-out", held_out),
                    ("data/tiny/train.jsonl", train_set), ("data/tiny/valid.jsonl", valid_set)):
        lm, la, acc = evaluate(torch, saved, d)
        log(f"saved bf16 model on {name:26s}: loss {lm:.4f} (all tokens), {la:.4f} (assistant tokens), "
            f"assistant next-token accuracy {acc:.3f}")
    total = sum(os.path.getsize(os.path.join(args.model_dir, f)) for f in os.listdir(args.model_dir))
    log(f"{args.model_dir}: {total} bytes")
    if args.check_dump:
        check_dump(args.check_dump, args.model_dir, valid_set[:8], args.threads)


if __name__ == "__main__":
    main()
