#!/usr/bin/env python3
"""bench/make_tiny_moe.py — a Qwen3.5-MoE tiny target upcycled from the trained dense models/tandem-tiny.

Every layer's dense SwiGLU MLP becomes the shared expert (shared_expert_intermediate_size = intermediate_size),
its down_proj doubled and mlp.shared_expert_gate.weight all zeros: sigmoid(0) = 0.5, so the shared branch is the
dense MLP exactly. Beside it, E routed experts of moe_intermediate_size Ie, top-K, with seeded pseudo-random
weights (gate and up N(0, 1/D), down N(0, scale^2/Ie)) and a router N(0, router_std^2): the routed sum moves the
hidden states by a few percent of the dense model's (see bench/moe_live_tiny.sh), and which experts a token picks
matters. Experts are written fused as the Hub's bf16 checkpoints store them (docs/moe.md): mlp.experts.gate_up_proj
[E, 2*Ie, D] (gate rows first) and mlp.experts.down_proj [E, D, Ie]. Python 3 standard library only.
  usage: bench/make_tiny_moe.py OUT_DIR [--src models/tandem-tiny] [--experts 8] [--top-k 2] [--moe-inter 32]
                                [--scale 0.05] [--router-std 0.1] [--seed 0]
"""
import argparse, array, json, math, os, random, shutil, struct, sys


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    meta = header.pop("__metadata__", None)
    return meta, {k: (v["dtype"], v["shape"], blob[v["data_offsets"][0]:v["data_offsets"][1]])
                  for k, v in header.items()}


def write_safetensors(path, meta, tensors):
    header, off = {"__metadata__": meta} if meta else {}, 0
    for k in sorted(tensors):
        dt, shape, data = tensors[k]
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for k in sorted(tensors):
            f.write(tensors[k][2])


def bf16_to_f32(data):
    u = array.array("H", data)
    return array.array("f", array.array("I", (x << 16 for x in u)).tobytes())


def f32_to_bf16(xs):
    """The top 16 bits of each f32, rounded to nearest even (no NaNs here)."""
    u = array.array("I", array.array("f", xs).tobytes())
    return array.array("H", ((x + 0x7FFF + ((x >> 16) & 1)) >> 16 for x in u)).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "models", "tandem-tiny"))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.05, help="routed down_proj std times sqrt(moe_inter)")
    ap.add_argument("--router-std", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    assert sys.byteorder == "little", "safetensors is little-endian; so must this host be"

    cfg = json.load(open(os.path.join(a.src, "config.json")))
    tc = cfg["text_config"]
    D, I, L, E, Ie = tc["hidden_size"], tc.pop("intermediate_size"), tc["num_hidden_layers"], a.experts, a.moe_inter
    meta, src = read_safetensors(os.path.join(a.src, "model.safetensors"))
    rng = random.Random(a.seed)

    def noise(n, std):
        return f32_to_bf16(rng.gauss(0.0, std) for _ in range(n))

    out = {k: v for k, v in src.items() if not (k.startswith("model.language_model.layers.") and ".mlp." in k)}
    for l in range(L):
        p = f"model.language_model.layers.{l}.mlp."
        for w in ("gate_proj", "up_proj"):
            out[p + f"shared_expert.{w}.weight"] = src[p + f"{w}.weight"]
        down = src[p + "down_proj.weight"]
        assert down[0] == "BF16" and down[1] == [D, I], down[:2]
        out[p + "shared_expert.down_proj.weight"] = ("BF16", [D, I], f32_to_bf16(2 * x for x in bf16_to_f32(down[2])))
        out[p + "shared_expert_gate.weight"] = ("BF16", [1, D], bytes(2 * D))
        out[p + "gate.weight"] = ("BF16", [E, D], noise(E * D, a.router_std))
        out[p + "experts.gate_up_proj"] = ("BF16", [E, 2 * Ie, D], noise(E * 2 * Ie * D, 1 / math.sqrt(D)))
        out[p + "experts.down_proj"] = ("BF16", [E, D, Ie], noise(E * D * Ie, a.scale / math.sqrt(Ie)))

    os.makedirs(a.out, exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), meta, out)
    cfg["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    cfg["model_type"] = "qwen3_5_moe"
    cfg["vision_config"]["model_type"] = "qwen3_5_moe_vision"
    tc.update(model_type="qwen3_5_moe_text", num_experts=E, num_experts_per_tok=a.top_k, moe_intermediate_size=Ie,
              shared_expert_intermediate_size=I, mlp_only_layers=[], output_router_logits=False,
              router_aux_loss_coef=0.001)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for name in os.listdir(a.src):
        if name.startswith("tokenizer") or name in ("vocab.txt", "generation_config.json"):
            shutil.copy(os.path.join(a.src, name), a.out)
    print(f"{a.out}: qwen3_5_moe, {L} layers, {E} experts of {Ie} (top-{a.top_k}) + a shared expert of {I}, "
          f"routed down std {a.scale / math.sqrt(Ie):.4g}, router std {a.router_std}, seed {a.seed}")


if __name__ == "__main__":
    main()
