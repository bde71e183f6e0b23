#!/usr/bin/env python3
"""bench/optim_overlap.py — could the optimizer hide under the next step's forward? A PyTorch measurement, not
Tandem code: a fused AdamW (torch.optim.AdamW(fused=True)) over 1.73e9 fp32 parameters, the Qwen3.6-27B drafter's
count, alone; a forward-like chain of bf16 GEMMs at the drafter's shapes (8192 x 5120 activations; 5 layers of
gate/up/down and two attention-sized projections), alone; then both at once on two streams, with the optimizer's
stream at normal and at high priority, and with the GEMMs' at high priority. "hidden" is how much of the
optimizer's time the concurrent run saves over running the two one after the other.
   usage: python3 bench/optim_overlap.py   (one CUDA GPU with 40 GB free)"""
import torch, time
torch.backends.cuda.matmul.allow_tf32 = False
dev = 'cuda'
n = 1_730_213_120
chunks = [n // 16] * 16
params = [torch.nn.Parameter(torch.randn(c, device=dev) * 0.01) for c in chunks]
for p in params: p.grad = torch.randn_like(p) * 1e-3
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
x = torch.randn(8192, 5120, device=dev, dtype=torch.bfloat16)
ws = [torch.randn(5120, 17408, device=dev, dtype=torch.bfloat16) * 0.01, torch.randn(17408, 5120, device=dev, dtype=torch.bfloat16) * 0.01,
      torch.randn(5120, 6144, device=dev, dtype=torch.bfloat16) * 0.01, torch.randn(6144, 5120, device=dev, dtype=torch.bfloat16) * 0.01]
def fwd():
    h = x
    for _ in range(5):
        a = h @ ws[0]; b = h @ ws[0]; a = torch.nn.functional.silu(a) * b; h = a @ ws[1]
        q = h @ ws[2]; h = q @ ws[3]
        h = torch.nn.functional.rms_norm(h, (5120,))
    return h
def timeit(f, reps=5):
    f(); torch.cuda.synchronize(); t = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize(); t.append(time.perf_counter() - t0)
    t.sort(); return t[len(t) // 2]
for prio in (0, -1):
    side = torch.cuda.Stream(priority=prio)
    def both():
        with torch.cuda.stream(side): opt.step()
        fwd()
    tf, ta, tb = timeit(fwd), timeit(opt.step), timeit(both)
    print(f"side priority {prio}: forward-like GEMMs {tf*1e3:.1f} ms, AdamW {ta*1e3:.1f} ms, both on two streams {tb*1e3:.1f} ms "
          f"(sequential {1e3*(tf+ta):.1f}); hidden {100*(tf+ta-tb)/ta:.0f} % of AdamW")
lo = torch.cuda.Stream(priority=0)
hi = torch.cuda.Stream(priority=-1)
def both_lo_side():
    with torch.cuda.stream(lo): opt.step()
    with torch.cuda.stream(hi): fwd()
    torch.cuda.current_stream().wait_stream(hi); torch.cuda.current_stream().wait_stream(lo)
tb = timeit(both_lo_side)
print(f"AdamW low priority, GEMMs high: both {tb*1e3:.1f} ms")
