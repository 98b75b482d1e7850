"""Every attention variant at small N, eager against compiled: how much of a step is kernel launches (issue 28 §4).

    python -m benchmarks.small_n                 # writes benchmarks/small-n-<device>.md
    python -m benchmarks.small_n --quick         # external only, N = 64, C = 32: prints only

At a few hundred tokens a mixer's forward + backward is a few dozen small kernels, and on a GPU the time goes to
launching them, not to the work (linear_elu and external measured at 22% and 10% of the H100's bound). Eager
PyTorch cannot remove that; ``torch.compile`` fuses the elementwise kernels (inductor) and, with
``mode="reduce-overhead"``, replays the step as one CUDA graph. This times each variant's forward + backward
(B=1, grid layout where the variant serves one, else points) eagerly, compiled with inductor, and (on CUDA) as a
CUDA graph, the three alternating in one process (``benchmarks.pct.interleaved``, CUDA events), and counts the
eager step's kernels (aten ops that are not views, :class:`benchmarks.measure.OpCounter`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attention  # noqa: E402
from benchmarks import measure  # noqa: E402
from benchmarks.pct import interleaved  # noqa: E402
from benchmarks.pct_cuda import timed  # noqa: E402


def kernels(mixer, x, layout) -> int:
    """aten ops of one eager forward + backward that launch work (views excluded), gradients starting at None as
    after a training step's ``zero_grad``."""
    x.grad = None
    mixer.zero_grad(set_to_none=True)
    if isinstance(layout, attention.Points):
        layout = attention.Points(layout.xyz)  # fresh: its searches counted (attention.Points.memo)
    with measure.OpCounter() as ops:
        mixer(x, layout).sum().backward()
    return ops.kernels


def rows(variants, n: int, c: int, rounds: int, device, profile: bool = False) -> Iterator[dict]:
    """One row per variant at N = n, yielded as each is measured; ``profile``: with its eager step's host profile
    (:func:`benchmarks.measure.host_profile`)."""
    for name in variants:
        torch.manual_seed(0)
        mixer = attention.build(name, dim=c).to(device)
        kind = "grid" if "grid" in mixer.layouts else "points"
        layout = mixer.example_layout(n, 1, kind)
        if kind == "points":
            layout = attention.Points(layout.xyz.to(device))
        x = torch.randn(1, n, c, device=device, requires_grad=True)
        forms = {"eager": mixer, "compiled": torch.compile(mixer)}
        if device.type == "cuda":
            forms["cuda graph"] = torch.compile(mixer, mode="reduce-overhead")

        def step(fn):
            def run():  # a training step's: gradients set to None, then forward and backward
                x.grad = None
                mixer.zero_grad(set_to_none=True)
                # a fresh point layout each step: one layer's step includes its searches (attention.Points.memo)
                fn(x, attention.Points(layout.xyz) if kind == "points" else layout).sum().backward()
            return run

        steps = {form: step(fn) for form, fn in forms.items()}
        started = time.perf_counter()
        for run in steps.values():  # compiles
            run()
        compile_s = time.perf_counter() - started
        times = interleaved(steps, rounds, warmup=2, seconds=lambda run: timed(run, device))
        median = {form: statistics.median(t) for form, t in times.items()}
        yield {"variant": name, "layout": kind, "n": n, "channels": c, "kernels": kernels(mixer, x, layout),
               "compile_s": compile_s, **{f"{form}_s": s for form, s in median.items()},
               "profile": measure.host_profile(steps["eager"], device, rows=12) if profile else None}
        print(f"{name:14s} {kind:6s} eager {1e3 * median['eager']:.3f} ms, compiled {1e3 * median['compiled']:.3f} ms"
              + (f", CUDA graph {1e3 * median['cuda graph']:.3f} ms" if "cuda graph" in median else ""), flush=True)


def markdown(results: list[dict], device, argv: list[str], started: str) -> str:
    graph = device.type == "cuda"
    lines = [
        *measure.report_header("Attention variants at small N: eager, compiled and as a CUDA graph", "small_n", argv,
                               started, device),
        "- forward + backward of one mixer, B = 1; medians of the three forms alternating; kernels: aten ops of the "
        "eager step that are not views", "",
        "| variant | layout | N | C | eager kernels | eager ms | compiled ms | compiled speed-up |"
        + (" CUDA graph ms | CUDA graph speed-up |" if graph else ""),
        "| --- " * (8 + 2 * graph) + "|",
    ]
    for r in results:
        line = (f"| {r['variant']} | {r['layout']} | {r['n']} | {r['channels']} | {r['kernels']} | "
                f"{1e3 * r['eager_s']:.3f} | {1e3 * r['compiled_s']:.3f} | {r['eager_s'] / r['compiled_s']:.2f}x |")
        if graph:
            line += f" {1e3 * r['cuda graph_s']:.3f} | {r['eager_s'] / r['cuda graph_s']:.2f}x |"
        lines.append(line)
    profiled = [r for r in results if r.get("profile")]
    if profiled:
        lines += ["", "## Where each eager step's host time goes", "",
                  "torch.profiler over one eager forward + backward (`benchmarks.measure.host_profile`): ops by self "
                  "CPU time, the profiler's overhead included (compare the variants, not the numbers).", ""]
        for r in profiled:
            lines += [f"### {r['variant']}, {r['layout']}, N = {r['n']}", "", "```", r["profile"].rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=None, help="default: every registered variant")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="external at N = 64, C = 32, 2 rounds; prints unless --out")
    parser.add_argument("--out", type=Path, help="default: benchmarks/small-n-<device>.md")
    parser.add_argument("--profile", action="store_true", help="add each eager step's host profile to the table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.variants, args.sizes, args.channels, args.rounds = args.variants or ["external"], [64], 32, 2
    variants = args.variants or attention.names()
    started = time.strftime("%Y-%m-%d %H:%M")
    results = []
    with contextlib.suppress(KeyboardInterrupt):  # a time limit's SIGINT: the rows measured so far are written
        for n in args.sizes:
            for row in rows(variants, n, args.channels, args.rounds, device, args.profile):
                results.append(row)
    text = markdown(results, device, sys.argv[1:] if argv is None else list(argv), started)
    measure.publish(text, args.out, ROOT / "benchmarks" / f"small-n-{device.type}.md", args.quick)
    return results


if __name__ == "__main__":
    main()
