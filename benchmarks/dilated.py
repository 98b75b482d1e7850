"""Dilated attention: our shifted-view kernel against DilateFormer's ``nn.Unfold`` implementation.

    .venv/bin/python benchmarks/dilated.py            # writes benchmarks/dilated.md
    .venv/bin/python benchmarks/dilated.py --quick    # one size, fewer repeats, prints only

For each size, forward + backward of the attention kernel alone (no projections)
on one head group, three ways:

- ``unfold``: DilateFormer's ``DilateAttention`` as published (``nn.Unfold`` copies
  K and V k*k times), on the (B, C, H, W) tensors it takes;
- ``shifted, autograd``: our shifted-view formula under plain autograd (shows
  what the custom backward saves);
- ``ours``: ``attention.functional.dilated_attention`` (shifted views, custom backward).

Time: median wall time of forward + backward over repeats after warm-up.
Peak memory: the most memory allocated at once during one forward + backward
beyond what was allocated before it (the inputs and the upstream gradient).
On CUDA that is ``torch.cuda.max_memory_allocated``. On CPU it is read from
``torch.profiler`` (``profile_memory=True``): every allocation and free of the
CPU allocator is an event with its byte count; their running sum, in time
order, peaks at the reported value. It is cross-checked by the peak resident
set size of a fresh subprocess (VmHWM reset through /proc/self/clear_refs,
minus VmRSS before the step, with glibc's mmap threshold at 64 KiB so that freed
blocks leave the RSS), which also sees allocator slack and page-level effects.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attention import functional  # noqa: E402
from benchmarks.baselines import DilateAttention, unfold_dilated_attention  # noqa: E402,F401 (re-exported)
from benchmarks.measure import cpu_name, cuda_peak_bytes, environment_line, median_ms, profiler_peak_bytes  # noqa: E402

MiB = 2 ** 20

# (label, batch, heads, head_dim, h, w, kernel_size, dilation); the first is the target.
SIZES = [
    ("C=72 (3x24), 56x56, r=2", 8, 3, 24, 56, 56, 3, 2),
    ("C=144 (6x24), 28x28, r=3", 8, 6, 24, 28, 28, 3, 3),
    ("C=72 (3x24), 56x56, r=1", 8, 3, 24, 56, 56, 3, 1),
]
IMPLS = ["unfold", "shifted, autograd", "ours"]


def shifted_autograd_attention(q, k, v, grid, kernel_size=3, dilation=1, scale=None):
    """Our shifted-view formula (zero borders) under plain autograd, without the custom backward."""
    (h, w), (B, H, N, d) = grid, q.shape
    scale = d ** -0.5 if scale is None else scale
    pad = dilation * (kernel_size // 2)
    kp, vp = (F.pad(t.reshape(B, H, h, w, d), (0, 0, pad, pad, pad, pad)) for t in (k, v))  # (B, H, h+2p, w+2p, d)
    qg = q.reshape(B, H, h, w, d)
    shifts = [(a * dilation, b * dilation) for a in range(kernel_size) for b in range(kernel_size)]
    logits = torch.stack([(qg * kp[:, :, y:y + h, x:x + w]).sum(-1) for y, x in shifts], dim=-1)  # (B,H,h,w,k*k)
    attn = (logits * scale).softmax(dim=-1)
    out = sum(attn[..., o, None] * vp[:, :, y:y + h, x:x + w] for o, (y, x) in enumerate(shifts))  # (B,H,h,w,d)
    return out.reshape(B, H, N, d)


# --------------------------------------------------------------------------------------------
# Measurement (timing and peak memory: benchmarks/measure.py, shared with `run.py mode=bench`)
# --------------------------------------------------------------------------------------------

def make_case(impl, batch, heads, d, h, w, kernel_size, dilation, device="cpu"):
    """Inputs (leaf tensors, upstream gradient) and a closure running one forward + backward."""
    gen = torch.Generator().manual_seed(0)
    if impl == "unfold":  # DilateFormer's own layout: (B, C, H, W) straight from its 1x1 qkv conv
        shape = (batch, heads * d, h, w)
        fn = DilateAttention(d, None, 0, kernel_size, dilation)
        out_shape = (batch, h, w, heads * d)
    else:
        shape = (batch, heads, h * w, d)
        kernel = functional.dilated_attention if impl == "ours" else shifted_autograd_attention
        fn = lambda q, k, v: kernel(q, k, v, (h, w), kernel_size, dilation)  # noqa: E731
        out_shape = shape
    q, k, v = (torch.randn(shape, generator=gen).to(device).requires_grad_() for _ in range(3))
    grad = torch.randn(out_shape, generator=gen).to(device)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad)

    return step, (q, k, v, grad)


def _status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_peak_bytes_here(impl, size_index):
    """Run in a fresh process: peak RSS growth of one forward + backward after a warm-up step."""
    step, tensors = make_case(impl, *SIZES[size_index][1:])
    step()  # warm-up: lazy initialisation
    step()
    for t in tensors[:3]:  # free the warm-up's gradients before the baseline is read
        t.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024


def rss_peak_bytes(impl, size_index, threads):
    """Peak RSS growth measured in a fresh subprocess, or None where /proc does not allow it."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    cmd = [sys.executable, __file__, "--rss-case", impl, str(size_index), "--threads", str(threads)]
    # Large blocks through mmap, returned to the OS on free: RSS then follows the live allocations
    # instead of glibc's cached heap (whose reuse would hide the step's peak after the warm-up).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return None
    return int(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def run(sizes, device, threads, warmup, repeats, rss):
    rows = []
    for index, (label, *spec) in sizes:
        results = {}
        for impl in IMPLS:
            step, tensors = make_case(impl, *spec, device=device)
            ms = median_ms(step, device, warmup, repeats)
            for t in tensors[:3]:  # the previous step's gradients go before the baseline
                t.grad = None
            peak = cuda_peak_bytes(step) if device == "cuda" else profiler_peak_bytes(step)
            rss_peak = rss_peak_bytes(impl, index, threads) if (rss and device == "cpu") else None
            del step, tensors
            results[impl] = (ms, peak, rss_peak)
            print(f"{label:28s} {impl:18s} {ms:9.1f} ms  {peak / MiB:8.1f} MiB"
                  + (f"  (RSS {rss_peak / MiB:.1f} MiB)" if rss_peak is not None else ""), flush=True)
        base_ms, base_peak, base_rss = results["unfold"]
        for impl, (ms, peak, rss_peak) in results.items():
            rows.append((label, impl, ms, peak, rss_peak, base_ms / ms, peak / base_peak,
                         None if rss_peak is None or not base_rss else rss_peak / base_rss))
    return rows


def result_floor_bytes(batch, heads, d, h, w, *_):
    """What any implementation allocates during forward + backward: the output and the q, k, v gradients."""
    return 4 * batch * heads * h * w * d * 4


def markdown(rows, device, threads, warmup, repeats, batch, command):
    if device == "cuda":
        machine = torch.cuda.get_device_name()
        memory = "`torch.cuda.max_memory_allocated` during one forward + backward, minus the memory allocated before it"
    else:
        machine = f"{cpu_name()}, {os.cpu_count()} cores, {threads} torch thread(s)"
        memory = ("the peak of the running sum of the CPU allocator's allocation/free events recorded by "
                  "`torch.profiler` (`profile_memory=True`) during one forward + backward, i.e. the most memory "
                  "allocated at once beyond the inputs and the upstream gradient; cross-checked by the peak RSS "
                  "growth of the same step in a fresh subprocess (VmHWM reset via /proc/self/clear_refs)")
    lines = [
        "# Dilated attention: shifted views vs `nn.Unfold`",
        "",
        f"Generated by `{command}`; do not edit by hand.",
        "",
        f"- machine: {machine}; device: {device}; date {datetime.date.today().isoformat()}",
        f"- libraries: {environment_line()}",
        f"- task: forward + backward of the attention kernel alone (no projections) on one head group, "
        f"float32, batch {batch}, kernel 3",
        f"- time: median over {repeats} repeats after {warmup} warm-up steps",
        f"- peak memory: {memory}",
        "- `unfold`: DilateFormer's `DilateAttention` as published (written out in `benchmarks/baselines.py`); "
        "`shifted, autograd`: our shifted-view formula under plain autograd; `ours`: "
        "`attention.functional.dilated_attention` (shifted views, custom backward)",
        f"- any implementation allocates the output and the gradients of q, k and v: "
        f"{result_floor_bytes(*SIZES[0][1:]) / MiB:.1f} MiB of the peak at the first size",
        "- targets for `ours` at the first size: peak memory <= 1/4 of unfold's and >= 3x faster",
        "",
    ]
    has_rss = any(r[4] is not None for r in rows)
    head = "| size | impl | time ms | peak MiB | " + ("peak RSS MiB | " if has_rss else "") + \
        "speed-up vs unfold | peak vs unfold |"
    lines += [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, impl, ms, peak, rss_peak, speed, mem, rss_ratio in rows:
        cells = [label, impl, f"{ms:.1f}", f"{peak / MiB:.1f}"]
        if has_rss:
            cells.append("n/a" if rss_peak is None else f"{rss_peak / MiB:.1f}")
        cells += [f"{speed:.2f}x", f"{mem:.3f}" + ("" if rss_ratio is None else f" (RSS {rss_ratio:.3f})")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first size only, 3 repeats, print, write nothing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-rss", action="store_true", help="skip the subprocess RSS cross-check")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    parser.add_argument("--rss-case", nargs=2, metavar=("IMPL", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rss_case:
        print(rss_peak_bytes_here(args.rss_case[0], int(args.rss_case[1])))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = list(enumerate(SIZES))
    repeats, warmup = args.repeats, args.warmup
    if args.quick:
        sizes, repeats, warmup = sizes[:1], 3, 1
    rows = run(sizes, device, args.threads, warmup, repeats, rss=not args.no_rss)
    if not args.quick:
        command = " ".join([".venv/bin/python", "benchmarks/dilated.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(markdown(rows, device, args.threads, warmup, repeats, SIZES[0][1], command))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
