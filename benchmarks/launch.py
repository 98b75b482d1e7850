"""What one call costs the host: a torch op, a bare Triton launch, and each of the suite's kernel wrappers at a size
where the device's work is nothing (issue 28 §4: the fixed costs).

    python -m benchmarks.launch                  # writes benchmarks/launch-<device>.md
    python -m benchmarks.launch --quick          # fewer calls; prints only

On an H200, steps that launch few kernels still took milliseconds: the dilated mixer 4 ms at any N up to 4,096
(12 Triton launches a step then), focal 7 ms, and in PCT's profile FPS's and kNN's ops held 380 and 260 us of host
time a call. Whether that is Triton's launcher (binding and specialising some 30 arguments in Python at every
call), the ``torch.library`` dispatch around it, or the torch ops beside it decides what to remove. Each row here
times ``calls`` back-to-back calls with the wall clock and one synchronisation after them: the device's work is
tiny, so it keeps up and the time is the host's. The rows:

- ``torch add``: one aten op on a 16-element tensor, the floor of any launch through torch; ``torch mul + sum +
  backward``: the floor of a forward and backward through autograd's engine (on CUDA its device thread);
  ``python autograd.Function + sum + backward``: the same with the multiplication a ``torch.autograd.Function``
  whose backward is Python, as the suite's written-out functions' are (dilated, offset, linear attention): an
  H200's profile of PCT's step had 150-210 us of self host time in each such backward node, 15 us in a C++ one;
- ``triton, 2 arguments`` / ``triton, 30 arguments``: a kernel that stores one value, launched with a pointer and
  1 or 29 integer arguments (strides, sizes: what the suite's kernels take), so that the difference is the
  launcher's cost per argument (CUDA only);
- ``knn``, ``fps``, ``dilated forward``, ``dilated forward + backward``, ``index attention forward``: the suite's
  public functions at tiny sizes, what a model calls (on CUDA their Triton kernels, on the CPU the torch paths);
  dilated's backward alone (``torch.autograd.grad`` on a kept graph: an H200 took 165 us for its forward and
  1,007 us for forward + backward, 2026-11-27, with 3 launches in all), its backward's kernels called directly
  (``_dilated_backward``: the wrapper and its 2 launches, no autograd), its forward + backward once more
  through its ``torch.library`` op, as compiled code and dispatch modes call it (:func:`through_op`), for what the
  eager path saves, and (CUDA) once with its 3 launches left out (:func:`without_launches`: the wrappers,
  allocations and autograd alone).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attention import functional as AF  # noqa: E402
from attention.pointops import farthest_point_sample, knn  # noqa: E402
from benchmarks import measure  # noqa: E402


def host_us(call, device, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` calls, then one synchronisation, per call (us)."""
    for _ in range(3):
        call()
    measure.sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        measure.sync(device)
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def triton_kernels():
    """Two kernels that store one value: with a pointer and 1, and with a pointer and 29 integer arguments."""
    import triton
    import triton.language as tl

    @triton.jit
    def few(out_ptr, n):
        tl.store(out_ptr, n)

    @triton.jit
    def many(out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
             c0, c1, c2, c3, c4, c5, c6, c7, c8):
        tl.store(out_ptr, a0 + b9 + c8)

    return few, many


class Twice(torch.autograd.Function):
    """x * 2 with its backward in Python: what a written-out function's autograd costs beyond its ops (on CUDA its
    backward runs on autograd's device thread, which takes the GIL for it)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _NoLaunch:
    """A Triton kernel's stand-in: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def without_launches(call):
    """``call()`` with dilated attention's three Triton kernels replaced by calls that launch nothing: the host's
    time of everything around the launches (the wrappers, the allocations, autograd), which with the bare launches'
    rows splits dilated's forward + backward (CUDA only: elsewhere the torch kernel runs)."""
    from attention import dilated_triton

    names = ("_forward_kernel", "_backward_query_kernel", "_backward_key_kernel")
    kernels = [getattr(dilated_triton, name) for name in names]
    for name in names:
        setattr(dilated_triton, name, _NoLaunch())
    try:
        return call()
    finally:
        for name, kernel in zip(names, kernels):
            setattr(dilated_triton, name, kernel)


def through_op(call):
    """``call()`` with attention.functional's eager calls sent through their ``torch.library`` op, as under
    torch.compile or a dispatch mode (its ``skips_dispatch`` off): what the eager path saves is the difference."""
    skips = AF.skips_dispatch
    AF.skips_dispatch = lambda *tensors: False
    try:
        return call()
    finally:
        AF.skips_dispatch = skips


def cases(device) -> dict:
    """name -> a call of that work, at sizes where the device's work is nothing."""
    g = torch.Generator().manual_seed(0)
    small = torch.zeros(16, device=device)
    xyz = torch.rand(1, 64, 3, generator=g).to(device)
    q, k, v = (torch.randn(1, 4, 64, 8, generator=g).to(device) for _ in range(3))  # 4 heads on an 8 x 8 grid
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rows, keys = torch.randn(64, 32, generator=g).to(device), torch.randn(64, 32, generator=g).to(device)
    index = torch.randint(0, 64, (64, 8), generator=g).to(device)
    kept = AF.dilated_attention(*leaves, (8, 8), 3, [1, 2, 3, 4])  # a graph that the backward row runs again
    seed = torch.ones_like(kept)
    attn = AF._dilated_forward(q, k, v, 8, 8, 3, [1, 2, 3, 4], False, 8 ** -0.5)[1]  # the map its backward reads
    out = {"torch add": lambda: small.add_(1),
           "torch mul + sum + backward (one leaf)": lambda: (leaves[0] * 2).sum().backward(),
           "python autograd.Function + sum + backward (one leaf)": lambda: Twice.apply(leaves[0]).sum().backward()}
    if device.type == "cuda":
        few, many = triton_kernels()
        out["triton, 2 arguments"] = lambda: few[(1,)](small, 3)
        out["triton, 30 arguments"] = lambda: many[(1,)](small, *range(3, 32))
    out.update({
        "knn (64 points, k = 8)": lambda: knn(xyz, xyz, 8),
        "fps (16 of 64 points)": lambda: farthest_point_sample(xyz, 16),
        "dilated forward (4 heads at rates 1-4, 8 x 8)": lambda: AF.dilated_attention(q, k, v, (8, 8), 3, [1, 2, 3, 4]),
        "dilated forward + backward": lambda: AF.dilated_attention(*leaves, (8, 8), 3, [1, 2, 3, 4]).sum().backward(),
        "dilated backward alone (its graph kept)": lambda: torch.autograd.grad(kept, leaves, seed, retain_graph=True),
        "dilated backward kernel, called directly (no autograd)": lambda: AF._dilated_backward(
            seed, q, k, v, attn, 8, 8, 3, [1, 2, 3, 4], 8 ** -0.5),
        "dilated forward + backward, through the op's dispatch": lambda: through_op(
            lambda: AF.dilated_attention(*leaves, (8, 8), 3, [1, 2, 3, 4]).sum().backward()),
    })
    if device.type == "cuda":
        out["dilated forward + backward, its 3 launches left out"] = lambda: without_launches(
            lambda: AF.dilated_attention(*leaves, (8, 8), 3, [1, 2, 3, 4]).sum().backward())
    out.update({
        "index attention forward (64 rows, 8 keys)": lambda: AF.index_attention(rows, keys, keys, index, 4),
    })
    return out


def markdown(results: list[dict], device, argv: list[str], started: str) -> str:
    lines = [
        *measure.report_header("What one call costs the host", "launch", argv, started, device),
        "- each row: the median over 5 repeats of the wall time of back-to-back calls and one synchronisation, per "
        "call; the device's work is tiny, so this is the host's time", "",
        "| work | calls | us a call |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['work']} | {r['calls']} | {r['us']:.1f} |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 calls a row; prints unless --out")
    parser.add_argument("--out", type=Path, help="default: benchmarks/launch-<device>.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    calls = 20 if args.quick else args.calls
    started = time.strftime("%Y-%m-%d %H:%M")
    results = []
    for work, call in cases(device).items():
        results.append({"work": work, "calls": calls, "us": host_us(call, device, calls)})
        print(f"{work:50s} {results[-1]['us']:9.1f} us", flush=True)
    text = markdown(results, device, sys.argv[1:] if argv is None else list(argv), started)
    measure.publish(text, args.out, ROOT / "benchmarks" / f"launch-{device.type}.md", args.quick)
    return results


if __name__ == "__main__":
    main()
