"""Farthest point sampling: the loop of before against today's torch loop on the CPU, the torch loop against
the Triton kernel on a GPU; writes benchmarks/fps.md.

``python -m benchmarks.fps [--repeats R] [--threads T ...]``. Each row times both implementations on the same
points in one process, alternating them repeat by repeat (a busy machine slows both alike), and checks that they
return the same indices. Sizes: PCT's two samplings a forward (512 of 1024 points, then 256 of 512; batch 16 and
32, and ``like_kernel`` as ``fps=kernel`` runs it) and focal's centres at N=65,536 (ceil(N / 49) = 1338, batch 1).
The GPU rows need CUDA and Triton; without them the file says they were not measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from attention.pointops import KERNEL_MIN_SQUARED_NORM, farthest_point_sample, kernel_order
from benchmarks.measure import cpu_count, cpu_name, environment_line, step_times

OUT = Path(__file__).with_suffix(".md")
# (B, N, m, like_kernel): PCT's first and second sampling at batch 16 and 32, its kernel mode, focal at N = 2^16
CASES = [(16, 1024, 512, False), (16, 512, 256, False), (32, 1024, 512, False), (32, 512, 256, False),
         (16, 1024, 512, True), (1, 65536, 1338, False)]


@torch.no_grad()
def fps_before(xyz: torch.Tensor, m: int, like_kernel: bool = False) -> torch.Tensor:
    """attention.pointops.farthest_point_sample as it was before issue #20 §2 (start 0): a step indexes
    xyz[batch, farthest] and sums (B, N, 3) over its last dimension, each op allocating its result."""
    b, n, _ = xyz.shape
    idx = torch.empty(b, m, dtype=torch.long, device=xyz.device)
    dist = torch.full((b, n), float("inf"), dtype=xyz.dtype, device=xyz.device)
    batch = torch.arange(b, device=xyz.device)
    farthest = torch.zeros(b, dtype=torch.long, device=xyz.device)
    if like_kernel:
        order = kernel_order(n, xyz.device)
        xyz = xyz[:, order]
        dist = torch.where(xyz.square().sum(-1) > KERNEL_MIN_SQUARED_NORM, 1e10, -1.0).to(xyz.dtype)
    for i in range(m):
        idx[:, i] = farthest
        centre = xyz[batch, farthest].unsqueeze(1)  # (B, 1, 3)
        dist = torch.minimum(dist, (xyz - centre).square().sum(-1))
        farthest = dist.argmax(-1)
    return order[idx] if like_kernel else idx


def side_by_side(first, second, device, repeats: int) -> tuple[float, float]:
    """Median seconds of first() and second(), called alternately after one untimed call of each."""
    a, b = [], []
    for i in range(repeats + 1):
        ta = step_times(first, device, warmup=0, repeats=1)[0]
        tb = step_times(second, device, warmup=0, repeats=1)[0]
        if i:
            a.append(ta)
            b.append(tb)
    return statistics.median(a), statistics.median(b)


def points(b: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(b * n)
    return (torch.rand(b, n, 3, generator=g) * 2 - 1).to(device)  # (B, N, 3) uniform in [-1, 1]^3


def cpu_rows(repeats: int, threads: int) -> list[str]:
    torch.set_num_threads(threads)
    rows = []
    for b, n, m, like_kernel in CASES:
        xyz = points(b, n, "cpu")
        before, now = fps_before(xyz, m, like_kernel), farthest_point_sample(xyz, m, like_kernel=like_kernel)
        same = torch.equal(before, now)
        r = max(1, repeats // 3) if n > 8192 else repeats
        old, new = side_by_side(lambda: fps_before(xyz, m, like_kernel),
                                lambda: farthest_point_sample(xyz, m, like_kernel=like_kernel, backend="torch"),
                                "cpu", r)
        mode = "kernel" if like_kernel else "plain"
        rows.append(f"| {threads} | {b} | {n} | {m} | {mode} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x "
                    f"| {'yes' if same else '**NO**'} | {r} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def gpu_rows(repeats: int, device: str = "cuda", cases: list = CASES) -> list[str]:
    """Rows of the GPU table (another device and smaller cases: a dry run under TRITON_INTERPRET=1 on the CPU)."""
    rows = []
    for dtype in (torch.float32, torch.float64):
        for b, n, m, like_kernel in cases:
            xyz = points(b, n, device).to(dtype)
            loop = farthest_point_sample(xyz, m, like_kernel=like_kernel, backend="torch")
            kernel = farthest_point_sample(xyz, m, like_kernel=like_kernel, backend="triton")  # compiles
            same = torch.equal(loop, kernel)
            old, new = side_by_side(lambda: farthest_point_sample(xyz, m, like_kernel=like_kernel, backend="torch"),
                                    lambda: farthest_point_sample(xyz, m, like_kernel=like_kernel, backend="triton"),
                                    device, repeats)
            rows.append(f"| {str(dtype)[6:]} | {b} | {n} | {m} | {'kernel' if like_kernel else 'plain'} "
                        f"| {old * 1e3:.2f} | {new * 1e3:.2f} | {old / new:.1f}x | {'yes' if same else '**NO**'} |")
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each implementation a row")
    # one thread by default: on a shared machine, threads beyond the idle cores time the waiting, not the loops
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="torch intra-op threads on the CPU, one block of rows each")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")  # other jobs slow both alike
    cpu = [row for threads in args.threads for row in cpu_rows(args.repeats, threads)]
    torch.set_num_threads(args.threads[0])
    gpu, why_not = [], None
    if not torch.cuda.is_available():
        why_not = "there is no GPU on this machine (torch.cuda.is_available() is False)"
    else:
        from attention.triton_kernels import available

        if not available():
            why_not = "Triton has no usable GPU backend here"
        else:
            gpu = gpu_rows(args.repeats)
    gpu_name = torch.cuda.get_device_name() if gpu else None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    lines = [
        "# Farthest point sampling: one Triton kernel on the GPU, a leaner torch loop on the CPU",
        "",
        f"Generated by `{' '.join(['.venv/bin/python -m benchmarks.fps', *sys.argv[1:]])}` (`benchmarks/fps.py`,"
        " issue #20 §2); do not edit by hand.",
        "",
        f"- machine: {cpu_name()}, {cpu_count()} cores (torch threads on the CPU: the first column)"
        + (f"; GPU: {gpu_name}" if gpu_name else "; no GPU") + f"; date {started}; load average {load:.1f} when it"
        " started (other jobs share the cores: the alternation keeps the ratios fair, the absolute times are noisy)",
        f"- libraries: {environment_line()}; triton {triton_version}",
        "- call: `attention.pointops.farthest_point_sample(xyz, m, like_kernel=...)` from point 0, points uniform in"
        " [-1, 1]^3, float32 unless said; B, N, m: PCT's two samplings a forward (512 of 1024 points, then 256 of"
        " 512) at batch 16 and 32, its `fps=kernel` mode (pointnet2_ops' tie order), and focal's ceil(N / 49) = 1338"
        " centres of N = 65,536 points",
        f"- time: the median of {args.repeats} calls of each implementation (N = 65,536: {max(1, args.repeats // 3)}),"
        " after one untimed call of each, the two called alternately on the same points in one process"
        " (device-synchronised on the GPU); 'same indices': the two returned equal (B, m) index tensors",
        "",
        "## CPU: the loop of before against today's torch loop",
        "",
        "Before: each step indexes `xyz[batch, farthest]` and computes `(xyz - centre).square().sum(-1)` over"
        " (B, N, 3), allocating every result; the sum over a last dimension of 3 and the broadcast subtraction are"
        " its slowest ops. Now (`attention.pointops.fps_loop`): the points as coordinate planes (3, B, N), a gather"
        " of the centre, and `sub`, `square_`, two `add`s, `minimum` and `argmax` writing into buffers allocated"
        " once (7 ops a step, contiguous rows, no allocation).",
        "",
        "| threads | B | N | m | mode | before (ms) | now (ms) | speed-up | same indices | repeats |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *cpu,
        "",
        *(["With more threads than idle cores (other jobs run beside), both loops mostly wait on each other's"
           " threads: compare within a thread count."] if len(args.threads) > 1 else []),
        *([""] if len(args.threads) > 1 else []),
        "## GPU: the torch loop against the Triton kernel",
        "",
    ]
    if gpu:
        lines += [
            "Torch loop: `backend=\"torch\"` (7 launches a step); kernel: `backend=\"triton\"`"
            " (`attention/fps_triton.py`, one launch, one program a sample), after its compilation.",
            "",
            "| dtype | B | N | m | mode | torch loop (ms) | Triton kernel (ms) | speed-up | same indices |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *gpu,
        ]
    else:
        lines += [f"Not measured: {why_not}. On a machine with CUDA and Triton, `python -m benchmarks.fps` adds"
                  " this table (float32 and float64, the same sizes)."]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
