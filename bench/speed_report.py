#!/usr/bin/env python3
"""bench/speed_report.py — the report of bench/speed_bench.sh: issue 21's figures from one call's raw outputs.

    speed_report.py OUT_DIR   (writes OUT_DIR/speed.md and prints it)

Reads what speed_bench.sh left in OUT_DIR: target.json / target.md (bench_ts_target, this build), target-ref.json /
target-ref.md (the reference build, when given), target-fp8.json and target-ref-fp8.json (the same at --precision
fp8), step.json (bench_dt_step), flex.json (bench/drafter_flex.py),
*.smi (peak MiB sampled by nvidia-smi), profile.txt (bench_dt_step --profile), pipeline/metrics-*.jsonl (one per
trainer rank) and pipeline/balance.txt (tandem-launch's supply-and-demand report). A part that did not run or failed
is said so; every goal line shows the figure beside its goal, each measured in this call."""
import glob
import json
import os
import re
import sys

SPECFORGE_TOK_PER_GPU = 6.0e3  # SpecForge's published DFlash2 recipe: 8 x H200, FP8 target (tokens/s per GPU)
STEADY_SKIP = 3  # pipeline steps left out at the start (start-up, the first answers)


def load_json(out, name):
    try:
        with open(os.path.join(out, name)) as f:
            lines = [ln for ln in f if ln.lstrip().startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def read(out, name):
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return None


def smi_gb(out, name):
    text = read(out, name + ".smi")
    try:
        return float(text.split()[0]) / 1024 if text else None
    except (ValueError, IndexError):
        return None


def attn_tflops(md):
    """The attention kernel's TF/s alone (1 x T tokens, the mix) from bench_ts_target's table."""
    if not md:
        return None, None
    one = re.search(r"flash attention kernel alone, 1 x \d+ tokens \| [\d.]+ ms \((\d+) TF/s\)", md)
    mix = re.search(r"flash attention kernel alone, the mix \| [\d.]+ ms \((\d+) TF/s\)", md)
    return (float(one.group(1)) if one else None, float(mix.group(1)) if mix else None)


def verdict(ok):
    return "yes" if ok else "no"


def target_part(out, L, goals):
    t, r = load_json(out, "target.json"), load_json(out, "target-ref.json")
    L += ["## Target forward (bench_ts_target, bf16, 8192-token packs of the usual length mix)", ""]
    if not t:
        L += ["Did not run or failed: see target.err.", ""]
        return None
    rows = [("this build", t, read(out, "target.md"))] + ([("reference build", r, read(out, "target-ref.md"))] if r else [])
    L += ["| build | forward | tokens/s | GEMM-only bound | forward / bound | GDN core in the forward | "
          "GDN kernel alone, 1 x T / mix | attention kernel alone, 1 x T / mix |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, j, md in rows:
        a1, am = attn_tflops(md)
        L.append(f"| {name} | {j['forward_ms']:.1f} ms | {j['tokens_per_s']:.0f} | {j['bound_bf16_ms']:.0f} ms | "
                 f"{100 * j['bound_bf16_ms'] / j['forward_ms']:.1f} % | {j['gdn_core_ms']:.3f} ms | "
                 f"{j['gdn_kernel_single_ms']:.3f} / {j['gdn_kernel_mix_ms']:.3f} ms | "
                 f"{j['attn_kernel_single_ms']:.3f} ms ({a1 or 0:.0f} TF/s) / {j['attn_kernel_mix_ms']:.3f} ms "
                 f"({am or 0:.0f} TF/s) |")
    L += ["", f"cuBLASLt's 8192^3 bf16 ceiling in this call: {t['ceiling_tflops']:.0f} TF/s "
          "(the bound is the forward's GEMMs at it).", ""]
    pct = 100 * t["bound_bf16_ms"] / t["forward_ms"]
    goals.append(("target forward >= 85 % of the same-run GEMM-only bound", f"{pct:.2f} %", verdict(pct >= 85)))
    goals.append(("GDN chunked core <= 0.40 ms per layer at 8192 tokens",
                  f"{t['gdn_core_ms']:.3f} ms in the forward, {t['gdn_kernel_single_ms']:.3f} ms alone",
                  verdict(t["gdn_core_ms"] <= 0.40)))
    return t


def fp8_part(out, L, goals):
    """Issue 19's figures: each build's fp8 forward against its FP8 GEMM-only bound and its bf16 forward."""
    L += ["## Target forward at --precision fp8 (bench_ts_target, the same packs; issue 19)", ""]
    rows = [(name, load_json(out, f"{stem}-fp8.json"), load_json(out, f"{stem}.json"))
            for name, stem in (("this build", "target"), ("reference build", "target-ref"))]
    rows = [r for r in rows if r[1] or r[0] == "this build"]
    if not rows[0][1]:
        L += ["Did not run or failed: see target-fp8.err.", ""]
        return
    L += ["| build | fp8 forward | tokens/s | FP8 GEMM-only bound | forward / bound | bf16 forward | fp8 speed-up |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for name, j, b in rows:
        if not j:
            L.append(f"| {name} | failed | | | | | |")
            continue
        up = f"{b['forward_ms'] / j['forward_ms']:.3f}x" if b else "n/a"
        L.append(f"| {name} | {j['forward_ms']:.1f} ms | {j['tokens_per_s']:.0f} | {j['bound_fp8_ms']:.0f} ms | "
                 f"{100 * j['bound_fp8_ms'] / j['forward_ms']:.1f} % | "
                 + (f"{b['forward_ms']:.1f} ms" if b else "n/a") + f" | {up} |")
    j, b = rows[0][1], rows[0][2]
    L += ["", f"cuBLASLt's block-scaled fp8 8192^3 ceiling in the fp8 run: {j['ceiling_fp8_tflops']:.0f} TF/s, "
          f"Tandem's wgmma FP8 kernel {j['wgmma_fp8_tflops']:.0f} TF/s (the bound takes the faster one; "
          "in_proj_a/b stay bf16). Each forward is its own process, one after the other.", ""]
    if b:
        up = b["forward_ms"] / j["forward_ms"]
        goals.append(("fp8 forward >= 1.5x the bf16 forward in the same call (issue 19)",
                      f"{up:.3f}x ({j['forward_ms']:.1f} against {b['forward_ms']:.1f} ms)", verdict(up >= 1.5)))
    pct = 100 * j["bound_fp8_ms"] / j["forward_ms"]
    goals.append(("fp8 forward >= 85 % of its FP8 GEMM-only bound (issue 19)", f"{pct:.1f} %", verdict(pct >= 85)))


def drafter_part(out, L, goals, t):
    s, f = load_json(out, "step.json"), load_json(out, "flex.json")
    L += ["## Drafter step (bench_dt_step bf16 against bench/drafter_flex.py, the same batch layout)", ""]
    if not s:
        L += ["Did not run or failed: see step.err.", ""]
        return
    gemm_tflop = s["tflop_per_step"] - s["tflop_attn"]
    L += ["| program | step s (median) | TF/s (dt_plan FLOPs) | peak GB (own) | peak GiB (nvidia-smi) |",
          "|---|---:|---:|---:|---:|"]
    for name, j, own, key in (("tandem bf16", s, "mem_used_gb", "step"), ("PyTorch flex (compiled)", f,
                                                                          "peak_reserved_gb", "flex")):
        if not j:
            L.append(f"| {name} | failed or skipped | | | |")
            continue
        peak = smi_gb(out, key)
        L.append(f"| {name} | {j['step_s_median']:.4f} | {s['tflop_per_step'] / j['step_s_median']:.0f} | "
                 f"{j[own]:.1f} | " + (f"{peak:.1f}" if peak else "n/a") + " |")
    L += ["", f"{s['tflop_per_step']:.1f} TFLOP a step, of which attention {s['tflop_attn']:.1f} and the LM head "
          f"{s['tflop_lm']:.1f}; {gemm_tflop:.1f} TFLOP in GEMMs and the LM head.", ""]
    if f:
        ratio = f["step_s_median"] / s["step_s_median"]
        goals.append(("drafter step >= 1.5x drafter_flex.py", f"{ratio:.2f}x ({s['step_s_median']:.4f} s against "
                      f"{f['step_s_median']:.4f} s)", verdict(ratio >= 1.5)))
    goals.append(("drafter step peak memory <= 40 GB", f"{s['mem_used_gb']:.2f} GB", verdict(s["mem_used_gb"] <= 40)))
    if t:
        at_ceiling = gemm_tflop / t["ceiling_tflops"]
        goals.append(("drafter step <= 1.2x its GEMMs' time at the same-run cuBLASLt ceiling",
                      f"{s['step_s_median'] / at_ceiling:.2f}x ({gemm_tflop:.1f} TFLOP at {t['ceiling_tflops']:.0f} "
                      f"TF/s = {at_ceiling:.4f} s)", verdict(s["step_s_median"] <= 1.2 * at_ceiling)))
    prof = read(out, "profile.txt")
    if prof:
        L += ["Profile (each backend entry between two synchronises, so the sum exceeds the step):", "", "```",
              prof.rstrip(), "```", ""]


def pipeline_part(out, L, goals):
    files = sorted(glob.glob(os.path.join(out, "pipeline", "metrics-*.jsonl")))
    L += ["## The pipeline at tandem-launch's split (FP8 target, the GPUs of this machine)", ""]
    if not files:
        L += ["Did not run or failed: see pipeline/launch.log.", ""]
        return
    n_gpus = len((read(out, "pipeline/gpus.txt") or "").split(",")) or 1
    tok_s, wait, secs = 0.0, 0.0, 0.0
    L += ["| trainer rank | steps (steady) | tokens/s | step | waiting | computing |", "|---|---:|---:|---:|---:|---:|"]
    for path in files:
        rows = []
        with open(path) as fh:
            for ln in fh:
                try:
                    j = json.loads(ln)
                except ValueError:
                    continue
                if "seconds" in j:
                    rows.append(j)
        rows = rows[STEADY_SKIP:]
        if not rows:
            continue
        sec = sum(j["seconds"] for j in rows)
        w = sum(j["wait_s"] for j in rows)
        tok = sum(j["tokens"] for j in rows)
        tok_s += tok / sec
        wait += w
        secs += sec
        L.append(f"| {os.path.basename(path)[8:-6]} | {len(rows)} | {tok / sec:.0f} | {sec / len(rows):.3f} s | "
                 f"{100 * w / sec:.1f} % | {(sec - w) / len(rows):.3f} s |")
    if secs <= 0:
        L += ["", "No steady steps.", ""]
        return
    per_gpu = tok_s / n_gpus
    L += ["", f"{tok_s:.0f} tokens trained per second on {n_gpus} GPU(s): {per_gpu:.0f} per GPU, against SpecForge's "
          f"published DFlash2 recipe (8 x H200, FP8 target) at about {SPECFORGE_TOK_PER_GPU:.0f} per GPU "
          f"({per_gpu / SPECFORGE_TOK_PER_GPU:.2f}x).", ""]
    balance = read(out, "pipeline/balance.txt")
    if balance:
        L += ["tandem-launch's supply and demand:", "", "```", balance.rstrip(), "```", ""]
    goals.append(("trainer waiting <= 5 % of wall time at the launcher's split", f"{100 * wait / secs:.1f} %",
                  verdict(wait / secs <= 0.05)))
    goals.append(("tokens trained per second per GPU, beside SpecForge's ~6.0k", f"{per_gpu:.0f}", "measured"))


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: speed_report.py OUT_DIR")
    out = sys.argv[1]
    gpu = (read(out, "gpu.txt") or "unknown").strip()
    L = ["# Issue 21's figures (and issue 19's fp8 forward) in one call", "",
         f"GPU: {gpu}. Shapes: deploy/configs/qwen3.6-27b (the 27B target, "
         "random weights; its DFlash drafter, 8192-token packs in 4 documents, 512 anchors x 16).", ""]
    goals = []
    t = target_part(out, L, goals)
    if t:
        fp8_part(out, L, goals)
    drafter_part(out, L, goals, t)
    pipeline_part(out, L, goals)
    L += ["## Against the goals", "", "| goal | figure in this call | met? |", "|---|---|---|"]
    L += [f"| {g} | {v} | {m} |" for g, v, m in goals]
    text = "\n".join(L) + "\n"
    with open(os.path.join(out, "speed.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
