"""Dilated attention: our shifted-view kernel against DilateFormer's ``nn.Unfold`` implementation.

    .venv/bin/python benchmarks/dilated.py --threads 1   # writes benchmarks/dilated.md
    .venv/bin/python benchmarks/dilated.py --quick       # first size, fewer repeats, prints only

For each size, forward + backward of the attention kernel alone (no projections) on one head group, four ways:

- ``unfold``: DilateFormer's ``DilateAttention`` as published (``nn.Unfold`` copies
  K and V k*k times), on the (B, C, H, W) tensors it takes;
- ``shifted, autograd``: our shifted-view formula under plain autograd (shows
  what the custom backward saves);
- ``ours``: ``attention.functional.dilated_attention`` (shifted views, custom backward);
- ``element-wise``: q * k + v, no attention at all: the floor. Any forward + backward
  over these q, k, v allocates the output and the three gradients, and pays what a
  process pays once for its first forward + backward.

Time: median wall time of forward + backward over repeats after warm-up, all four in this process.

Peak memory, three ways, all "beyond what existed before the step" (the inputs and the upstream gradient):

- allocator: the most bytes of tensors allocated at once during one step after warm-up. On CUDA
  ``torch.cuda.max_memory_allocated``; on CPU the peak of the running sum of the CPU allocator's allocation and
  free events recorded by ``torch.profiler`` (``profile_memory=True``), exact byte counts.
- RSS, first step (the method of issue 20): a fresh subprocess per size and implementation, with glibc's mmap
  threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``: larger blocks are mapped on allocation and unmapped on
  free, so the RSS follows the live allocations instead of glibc's cached heap), builds the inputs and measures
  the peak resident set size (VmHWM, reset through /proc/self/clear_refs) over its first forward + backward, minus
  the RSS before it. Nothing has run before that step, with one exception: the subprocess first imports
  ``torch.fx.experimental.symbolic_shapes``, which ``Tensor.backward(gradient)`` imports (with sympy, ~33 MiB) on
  its first call in any process, whatever ran forward; without it a row is charged for autograd's import or not
  depending on whether its peak comes before or after the backward starts (unfold's comes in its forward). The
  numbers with nothing imported beforehand are measured at the first size too and given under the table.
- RSS, steady: the second step of the same subprocess, measured the same way.

The three agree up to what a process pays once: steady RSS = the allocator's peak (plus page rounding), and first
step = steady + the file-backed pages of libtorch's code that the first call of each kernel faults in (the column
"code pages": RssFile's growth over the first step) + the modules that the first step imports (counted; each costs
resident memory for its code objects, e.g. ~35 MiB for torch._dynamo, which torch.library.custom_op's kernel
wrapper imports on its first call).
"""

from __future__ import annotations

import argparse
import datetime
import json
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
IMPLS = ["unfold", "shifted, autograd", "ours", "element-wise"]
BACKWARD_IMPORT = "torch.fx.experimental.symbolic_shapes"  # what Tensor.backward(gradient) imports on first use


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


def elementwise(q, k, v):
    """The floor: no attention, one element-wise product and sum over the same tensors (B, heads, N, d)."""
    return q * k + v


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
        if impl == "element-wise":
            fn = elementwise
        else:
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


def _status_kib(*fields):
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name in fields:
            values[name] = int(line.split()[1])
    return [values[f] for f in fields]


def _rss_step(step):
    """Peak RSS growth (bytes) over one call of ``step``, and the growth of its file-backed part (code pages)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before, file_before = _status_kib("VmRSS", "RssFile")
    step()
    peak, file_after = _status_kib("VmHWM", "RssFile")
    return (peak - before) * 1024, (file_after - file_before) * 1024


def rss_here(impl, size_index, preimport=True):
    """Run in a fresh process: the RSS of its first forward + backward, then of its second (see the docstring)."""
    if preimport:
        __import__(BACKWARD_IMPORT)
    step, tensors = make_case(impl, *SIZES[size_index][1:])
    modules = set(sys.modules)
    first, code = _rss_step(step)
    imported = len(set(sys.modules) - modules)
    for t in tensors[:3]:  # the first step's gradients go before the second step's baseline
        t.grad = None
    steady, _ = _rss_step(step)
    return {"first": first, "code": code, "imports": imported, "steady": steady}


def rss(impl, size_index, threads, preimport=True):
    """:func:`rss_here` in a fresh subprocess, or None where /proc does not allow it."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    cmd = [sys.executable, __file__, "--rss-case", impl, str(size_index), "--threads", str(threads)]
    if not preimport:
        cmd.append("--no-preimport")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def run(sizes, device, threads, warmup, repeats, with_rss):
    """One row per (size, implementation): time, allocator peak, the subprocess RSS, ratios against unfold."""
    rows = []
    for index, (label, *spec) in sizes:
        cases = {impl: make_case(impl, *spec, device=device) for impl in IMPLS}
        for _ in range(warmup):
            for step, _ in cases.values():
                step()
        times = {impl: [] for impl in IMPLS}
        for _ in range(repeats):  # interleaved: a load change on the shared machine hits every implementation
            for impl, (step, _) in cases.items():
                times[impl].append(median_ms(step, device, 0, 1))
        results = {}
        for impl, (step, tensors) in cases.items():
            for t in tensors[:3]:  # the previous step's gradients go before the baseline
                t.grad = None
            peak = cuda_peak_bytes(step) if device == "cuda" else profiler_peak_bytes(step)
            got = rss(impl, index, threads) if (with_rss and device == "cpu") else None
            ms = sorted(times[impl])[len(times[impl]) // 2]
            results[impl] = {"ms": ms, "peak": peak, "rss": got}
            print(f"{label:26s} {impl:18s} {ms:9.1f} ms  allocator {peak / MiB:7.1f} MiB" + (
                "" if got is None else f"  RSS steady {got['steady'] / MiB:7.1f}  first step {got['first'] / MiB:7.1f}"
                f"  code pages {got['code'] / MiB:5.1f}  imports {got['imports']}"), flush=True)
        del cases
        base = results["unfold"]
        for impl, res in results.items():
            ratios = {"speed": base["ms"] / res["ms"], "peak": res["peak"] / base["peak"]}
            if res["rss"] is not None and base["rss"] is not None:
                ratios.update({key: res["rss"][key] / base["rss"][key] for key in ("steady", "first")})
            rows.append({"label": label, "impl": impl, **res, "ratios": ratios})
    return rows


def literal(threads):
    """The first size's first-step RSS with nothing imported beforehand (issue 20's harness, literally)."""
    return {impl: rss(impl, 0, threads, preimport=False) for impl in ("unfold", "ours", "element-wise")}


def result_floor_bytes(batch, heads, d, h, w, *_):
    """What any implementation allocates during forward + backward: the output and the q, k, v gradients."""
    return 4 * batch * heads * h * w * d * 4


def _load(threads):
    """The load average, and whether it says that other jobs shared the machine (more runnable threads than ours)."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # pragma: no cover - not on Unix
        return "n/a", False
    return f"{one:.1f} (1 min), {five:.1f} (5 min)", max(one, five) > threads + 0.5


def markdown(rows, lit, device, threads, warmup, repeats, batch, command, loads):
    first = [r for r in rows if r["label"] == SIZES[0][0]]
    by_impl = {r["impl"]: r for r in first}
    has_rss = any(r["rss"] is not None for r in rows)
    if device == "cuda":
        machine = torch.cuda.get_device_name()
        memory = "`torch.cuda.max_memory_allocated` during one forward + backward, minus the memory allocated before it"
    else:
        machine = f"{cpu_name()}, {os.cpu_count()} cores, {threads} torch thread(s)"
        memory = ("allocator: the peak of the running sum of the CPU allocator's allocation/free events recorded by "
                  "`torch.profiler` (`profile_memory=True`) during one forward + backward after warm-up, i.e. the most "
                  "bytes of tensors allocated at once beyond the inputs and the upstream gradient")
    shared = any(flag for _, flag in loads)
    lines = [
        "# Dilated attention: shifted views vs `nn.Unfold`",
        "",
        f"Generated by `{command}`; do not edit by hand.",
        "",
        f"- machine: {machine}; device: {device}; date {datetime.date.today().isoformat()}",
        f"- load average at the start: {loads[0][0]}; at the end: {loads[1][0]}"
        + (" -- the machine was shared with other jobs: times are noisy; every ratio below is measured side by side "
           "(times interleaved in one process, memory per fresh process)" if shared else ""),
        f"- libraries: {environment_line()}",
        f"- task: forward + backward of the attention kernel alone (no projections) on one head group, "
        f"float32, batch {batch}, kernel 3",
        f"- time: median over {repeats} interleaved repeats after {warmup} warm-up steps",
        f"- peak memory, {memory}",
    ]
    if has_rss:
        imports = sum(r["rss"]["imports"] for r in rows if r["rss"] is not None)
        lines += [
            "- RSS first step (issue 20's method): a fresh process per row (`MALLOC_MMAP_THRESHOLD_=65536`), peak RSS "
            "(VmHWM, reset via /proc/self/clear_refs) over its first forward + backward minus the RSS before it; the "
            f"process imports `{BACKWARD_IMPORT}` beforehand (see below); RSS steady: its second step. code pages: "
            "the growth of the file-backed RSS (libtorch's code faulted in by first calls) over the first step; "
            "imports: modules the first step imported",
            "- how they agree: RSS steady = allocator (+ page rounding); RSS first step = RSS steady + code pages "
            + ("(no row's first step imported a module)" if not imports else "+ the memory of the imported modules")
            + ". The one-time part is the process's, not the step's: `element-wise` pays it too",
        ]
    lines += [
        "- `unfold`: DilateFormer's `DilateAttention` as published (written out in `benchmarks/baselines.py`); "
        "`shifted, autograd`: our shifted-view formula under plain autograd; `ours`: "
        "`attention.functional.dilated_attention` (shifted views, custom backward, chunks of (sample, head) pairs); "
        "`element-wise`: q * k + v, the floor of any forward + backward over these tensors",
        f"- any implementation allocates the output and the gradients of q, k and v: "
        f"{result_floor_bytes(*SIZES[0][1:]) / MiB:.1f} MiB of the peak at the first size; `ours` also keeps its "
        f"attention map for the backward ({4 * 9 * SIZES[0][1] * SIZES[0][2] * SIZES[0][4] * SIZES[0][5] / MiB:.1f} "
        "MiB)",
        "- targets for `ours` at the first size: peak memory <= 1/4 of unfold's by the first-step RSS, and >= 3x "
        "faster",
        "",
    ]
    head = ["size", "impl", "time ms", "speed-up vs unfold", "allocator MiB"]
    if has_rss:
        head += ["RSS steady MiB", "RSS first step MiB", "code pages MiB", "imports"]
    head += ["vs unfold: allocator" + (" / RSS steady / RSS first step" if has_rss else "")]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["label"], r["impl"], f"{r['ms']:.1f}", f"{r['ratios']['speed']:.2f}x", f"{r['peak'] / MiB:.1f}"]
        ratio = f"{r['ratios']['peak']:.3f}"
        if has_rss:
            got = r["rss"]
            cells += (["n/a"] * 4 if got is None else
                      [f"{got['steady'] / MiB:.1f}", f"{got['first'] / MiB:.1f}", f"{got['code'] / MiB:.1f}",
                       str(got["imports"])])
            if "first" in r["ratios"]:
                ratio += f" / {r['ratios']['steady']:.3f} / {r['ratios']['first']:.3f}"
        lines.append("| " + " | ".join(cells + [ratio]) + " |")
    ours = by_impl.get("ours")
    if ours is not None:
        lines += ["", "At the first size:", ""]
        speed = ours["ratios"]["speed"]
        lines.append(f"- speed: `ours` is {speed:.1f}x faster than unfold: {'pass' if speed >= 3 else 'miss'} (>= 3x)")
        if "first" in ours["ratios"]:
            first_ratio = ours["ratios"]["first"]
            lines.append(f"- memory by the first-step RSS: {first_ratio:.3f} of unfold's: "
                         f"{'pass' if first_ratio <= 0.25 else 'miss'} (<= 0.25); by the steady RSS "
                         f"{ours['ratios']['steady']:.3f}, by the allocator {ours['ratios']['peak']:.3f}")
        if lit and all(lit.values()):
            u, o, e = (lit[k]["first"] / MiB for k in ("unfold", "ours", "element-wise"))
            extra = o - ours["rss"]["first"] / MiB if ours["rss"] else float("nan")
            lines.append(
                f"- with nothing imported before the first step: {o:.1f} MiB for `ours`, {u:.1f} for unfold "
                f"({o / u:.3f}), {e:.1f} for `element-wise` ({e / u:.3f}). The {extra:.1f} MiB "
                f"more than in the table is `Tensor.backward(gradient)` importing `{BACKWARD_IMPORT}` and sympy, "
                "which any first backward with an explicit gradient pays, whatever ran forward; unfold's peak is in "
                "its forward, before that import, so its row does not show it")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first size only, 3 repeats, print, write nothing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS measurements")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    parser.add_argument("--rss-case", nargs=2, metavar=("IMPL", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--no-preimport", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rss_case:
        print(json.dumps(rss_here(args.rss_case[0], int(args.rss_case[1]), preimport=not args.no_preimport)))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = list(enumerate(SIZES))
    repeats, warmup = args.repeats, args.warmup
    if args.quick:
        sizes, repeats, warmup = sizes[:1], 3, 1
    loads = [_load(args.threads)]
    with_rss = not args.no_rss and device == "cpu"
    rows = run(sizes, device, args.threads, warmup, repeats, with_rss)
    lit = literal(args.threads) if with_rss else None
    if lit:
        print("nothing imported beforehand, first step:",
              {impl: None if got is None else round(got["first"] / MiB, 1) for impl, got in lit.items()})
    loads.append(_load(args.threads))
    if not args.quick:
        command = " ".join([".venv/bin/python", "benchmarks/dilated.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(markdown(rows, lit, device, args.threads, warmup, repeats, SIZES[0][1], command, loads))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
