"""colora's own host time per grouped-LoRA call, this tree against a baseline revision.

    python3 reports/cpu/lora_host.py 55d1330 > reports/cpu/lora_host.txt    (repository root)

The trainer's step on the H200 is bound by host work (reports/h200, ninth session: the GPU busy 54%
of the step, `_GroupedLoRABackward` 0.84 ms and `_GroupedLoRA` 0.33 ms of self CPU time a call, four
calls a layer). This measures the part of that which is colora's Python, on the CPU: the Triton
launches are replaced by no-ops (Triton's own launch cost is not in these figures), the tensors are
tiny (so the CPU's arithmetic is not either), and one transformer layer's four calls (q|k|v packed,
o, gate|up packed, down; 8 jobs, rank 16) run forward and backward 300 times: the fastest and the
median of the last 250, and the Python function calls of one more (cProfile's count, which does not
vary from run to run). Each tree runs in its own process (`git worktree` for the baseline),
alternating, seven times.
A CPU figure, not an H200 one: it says how much of colora's Python a change removed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import cProfile, pstats, statistics, time, torch
import colora.kernels.lora_ops as ops
from colora.kernels import LoRABatchMeta
from colora.kernels.lora import grouped_lora, grouped_lora_packed

class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

for name in ("lora_shrink_kernel", "lora_expand_kernel", "lora_sgrad_kernel", "lora_reduce_kernel"):
    setattr(ops, name, NoLaunch())
J, r, T, d = 8, 16, 256, 64
meta = LoRABatchMeta.build([T * j // J for j in range(J + 1)], [r * j for j in range(J + 1)], [2.0] * J, "cpu")
x = torch.randn(T, d, dtype=torch.bfloat16, requires_grad=True)
cases = []
for outs in ((128, 64, 64), (64,), (192, 192), (64,)):  # q|k|v, o, gate|up, down (scaled down)
    As = [torch.randn(J * r, d, dtype=torch.bfloat16, requires_grad=True) for _ in outs]
    Bs = [torch.randn(n, J * r, dtype=torch.bfloat16, requires_grad=True) for n in outs]
    bases = [torch.zeros(T, n, dtype=torch.bfloat16, requires_grad=True) for n in outs]
    cases.append((As, Bs, bases))

def layer():
    for As, Bs, bases in cases:
        add_to = [b.clone() for b in bases]
        grads = [torch.ones_like(b) for b in bases]
        if len(As) > 1:
            ys = grouped_lora_packed(x, As, Bs, meta, backend="triton", add_to=add_to)
        else:
            ys = [grouped_lora(x, As[0], Bs[0], meta=meta, backend="triton", add_to=add_to[0])]
        torch.autograd.backward(ys, grads)

times = []
for i in range(300):
    t0 = time.perf_counter()
    layer()
    times.append(time.perf_counter() - t0)
prof = cProfile.Profile()
prof.enable()
layer()
prof.disable()
assert hasattr(ops, "__file__") and "/shims/" in ops.__file__, ops.__file__  # the tree's own code
print(min(times[50:]) * 1e6, statistics.median(times[50:]) * 1e6, pstats.Stats(prof).total_calls)
'''


def measure(tree: Path, shims: Path) -> tuple[float, float, float]:
    """The child's (fastest, median) layer in us and its Python function calls, with `tree`'s
    folders importable as colora, colora.kernels (no install)."""
    shim = shims / tree.name / "colora"  # not inside the tree: its own colora/ lacks kernels/ and tasks/
    if not shim.exists():
        shim.mkdir(parents=True)
        for f in (tree / "colora").iterdir():
            (shim / f.name).symlink_to(f)
        for sub in ("kernels", "tasks"):
            (shim / sub).symlink_to(tree / sub)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(shim.parent)}
    out = subprocess.run([sys.executable, "-P", "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return tuple(float(v) for v in out.stdout.split()[-3:])


def main() -> None:
    base_rev = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), base_rev], check=True)
        try:
            here, then = [], []
            for _ in range(7):
                then.append(measure(base, Path(tmp) / "shims"))
                here.append(measure(ROOT, Path(tmp) / "shims"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print("one layer's four grouped-LoRA calls, forward + backward, with the Triton launches stubbed out:")
    print("colora's host time (the fastest and the median of 250 layers, us) and Python function calls")
    for name, ms in ((f"{base_rev} (baseline)", then), (f"this tree (HEAD {head} + changes if any)", here)):
        print(f"  {name}: fastest {' '.join(f'{m[0]:.0f}' for m in ms)}; median "
              f"{' '.join(f'{m[1]:.0f}' for m in ms)}; calls {ms[0][2]:.0f}")
    fast = [min(m[0] for m in ms) for ms in (then, here)]
    med = [statistics.median(m[1] for m in ms) for ms in (then, here)]
    print(f"  baseline / this tree: fastest {fast[0] / fast[1]:.2f}x, median {med[0] / med[1]:.2f}x, "
          f"function calls {then[0][2] / here[0][2]:.2f}x")

if __name__ == "__main__":
    main()
