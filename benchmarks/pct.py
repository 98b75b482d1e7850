"""PCT's networks, the suite's token-major formulation against the channel-first one it replaces (issue 20 §1).

    .venv/bin/python -m benchmarks.pct                  # writes benchmarks/pct.md (batch 16 and 32, eager)
    .venv/bin/python -m benchmarks.pct --compile        # ... and both networks under torch.compile
    .venv/bin/python -m benchmarks.pct --quick          # small and fast, prints only

The reference is PCT_Pytorch's ``Pct`` as the issue measured it, its CUDA FPS replaced by a torch loop from point 0:
``benchmarks.baselines.ChannelFirstPCT`` (1x1 ``Conv1d`` + ``BatchNorm1d`` on (B, C, N), the grouped
[g - c, c] rows through the first conv, PCT's SA layer on (B, C, N), kNN by ``topk`` of squared distances), with the
weights of the suite's ``tasks.nets.pct.PCT`` (``attn=offset``, ``fps=plain``: the same function; tests/test_bench.py
holds them equal in float64). A training step is the forward, PCT's label-smoothed cross-entropy (eps 0.2), the
backward and an SGD step (momentum 0.9); eval is a forward in eval mode under ``no_grad``.

Both networks take the same inputs and alternate, step by step (reference, suite, reference, suite, ...), so that a
machine shared with other jobs slows both alike; a ratio is the median over rounds of the per-round ratio
(reference time / suite time; > 1: the suite is faster), with the ratio of the two fastest steps beside it.
Compiled: ``torch.compile`` of each network (default inductor backend; FPS and kNN run eagerly in both: the suite's
as a library op inside its one graph, ``tasks.nets.pct.neighbourhoods``, the reference's as a graph break); its
compile time is the first compiled step's time minus the steady step's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from benchmarks.baselines import channel_first, plain_fps, topk_knn  # noqa: E402

GOALS = {"eager": 1.3, "compiled": 1.6}  # issue 20: reference time / suite time, at least


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------

def train_step(net: torch.nn.Module, loss: Callable, inputs: tuple, target: torch.Tensor, device,
               lr: float = 0.01) -> Callable[[], None]:
    """One SGD step (momentum 0.9) of ``net`` on ``loss(net(*inputs), target)``, device-synchronised."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)

    def step():
        net.train()
        opt.zero_grad(set_to_none=True)
        loss(net(*inputs), target).backward()
        opt.step()
        measure.sync(device)

    return step


def eval_step(net: torch.nn.Module, inputs: tuple, device) -> Callable[[], None]:
    def step():
        net.eval()
        with torch.no_grad():
            net(*inputs)
        measure.sync(device)

    return step


def wall_seconds(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def interleaved(steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 1,
                seconds: Callable[[Callable[[], None]], float] = wall_seconds) -> dict[str, list[float]]:
    """Seconds of each step over ``rounds`` rounds, one call of every step per round in turn, after ``warmup``
    untimed rounds; ``seconds(step)`` times one call (wall time: the steps synchronise the device themselves)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(seconds(step))
    return times


def ratio(reference: list[float], suite: list[float]) -> dict:
    """Reference over suite: the median of the per-round ratios, and the ratio of the fastest steps."""
    return {"reference_s": statistics.median(reference), "suite_s": statistics.median(suite),
            "ratio": statistics.median(r / s for r, s in zip(reference, suite)),
            "ratio_min": min(reference) / min(suite), "rounds": len(suite)}


def compiled_first(step: Callable[[], None]) -> float:
    """Seconds of a compiled step's first call (compilation and the step)."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------

def modelnet_pair(batch: int, points: int = 1024, classes: int = 40, samples=(512, 256), neighbours: int = 32,
                  seed: int = 0, device="cpu"):
    """(suite PCT, reference with its weights, inputs, target, loss): ModelNet40's network and recipe."""
    from tasks.modelnet import reference_smoothing
    from tasks.nets.pct import PCT

    torch.manual_seed(seed)
    ours = PCT(classes, {"name": "offset"}, samples=list(samples), neighbours=neighbours, fps="plain").to(device)
    g = torch.Generator().manual_seed(seed)
    xyz = (torch.rand(batch, points, 3, generator=g) * 2 - 1).to(device)
    target = torch.randint(0, classes, (batch,), generator=g).to(device)
    smoothing = reference_smoothing(0.2, classes)

    def loss(logits, y):
        return F.cross_entropy(logits, y, label_smoothing=smoothing)

    return ours, channel_first(ours), (xyz,), target, loss


def partseg_pair(batch: int, points: int = 2048, parts: int = 50, categories: int = 16, seed: int = 0, device="cpu"):
    """(suite PCTPartSeg, reference with its weights, inputs, target, loss): ShapeNet part's network (xyz input),
    plain cross-entropy over every point's parts."""
    from tasks.nets.pct import PCTPartSeg

    torch.manual_seed(seed)
    ours = PCTPartSeg(parts, categories, {"name": "offset"}).to(device)
    g = torch.Generator().manual_seed(seed)
    xyz = (torch.rand(batch, points, 3, generator=g) * 2 - 1).to(device)
    category = torch.randint(0, categories, (batch,), generator=g).to(device)
    target = torch.randint(0, parts, (batch, points), generator=g).to(device)
    return ours, channel_first(ours), (xyz, category), target, F.cross_entropy


def compare(ours, reference, inputs, target, loss, rounds: int, device, compile_too: bool = False,
            modes=("train", "eval")) -> list[dict]:
    """Rows {mode, form, reference_s, suite_s, ratio, ratio_min, rounds[, compile_s_*, eager_reference_s,
    ratio_vs_eager_reference]}: eager, then compiled. Compiled rows also time the reference run eagerly, as its
    code runs it, in the same rounds: ``ratio_vs_eager_reference`` = the median over rounds of eager reference time
    / compiled suite time."""
    rows = []
    nets = {"reference": reference, "suite": ours}
    forms = [("eager", nets)]
    if compile_too:
        forms.append(("compiled", {**{k: torch.compile(v) for k, v in nets.items()}, "eager_reference": reference}))
    for form, pair in forms:
        for mode in modes:
            steps = {k: train_step(n, loss, inputs, target, device) if mode == "train" else eval_step(n, inputs, device)
                     for k, n in pair.items()}
            first = ({k: compiled_first(s) for k, s in steps.items() if k != "eager_reference"}
                     if form == "compiled" else {})
            times = interleaved(steps, rounds, warmup=1)
            row = {"mode": mode, "form": form, **ratio(times["reference"], times["suite"])}
            for k, seconds in first.items():
                row[f"compile_s_{k}"] = seconds - statistics.median(times[k])
            if "eager_reference" in times:
                vs = ratio(times["eager_reference"], times["suite"])
                row.update(eager_reference_s=vs["reference_s"], ratio_vs_eager_reference=vs["ratio"])
            rows.append(row)
    return rows


def neighbourhood_times(xyz: torch.Tensor, samples, neighbours: int, rounds: int) -> dict:
    """Seconds per batch of FPS and of kNN over both groups (indices only, inside every step of both networks):
    the suite's (``attention.pointops``, FPS on one thread as ``tasks.nets.pct.neighbourhoods`` runs it) and the
    reference's loop and ``topk``, interleaved; and the suite's FPS on all of torch's threads, as it ran before."""
    from attention.pointops import farthest_point_sample, gather, knn
    from tasks.nets.pct import one_cpu_thread

    def suite_fps(x, s):
        with one_cpu_thread(x.device):
            return farthest_point_sample(x, s)

    clouds = [xyz]  # the clouds each group samples from: xyz, then the first group's centres
    for s in samples[:-1]:
        clouds.append(gather(clouds[-1], plain_fps(clouds[-1], s)))
    centres = [gather(x, plain_fps(x, s)) for x, s in zip(clouds, samples)]
    steps = {"reference_fps": lambda: [plain_fps(x, s) for x, s in zip(clouds, samples)],
             "suite_fps": lambda: [suite_fps(x, s) for x, s in zip(clouds, samples)],
             "suite_fps_all_threads": lambda: [farthest_point_sample(x, s) for x, s in zip(clouds, samples)],
             "reference_knn": lambda: [topk_knn(c, x, neighbours) for c, x in zip(centres, clouds)],
             "suite_knn": lambda: [knn(c, x, neighbours) for c, x in zip(centres, clouds)]}
    return {k: statistics.median(v) for k, v in interleaved(steps, rounds).items()}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def verdict(row: dict) -> tuple[str, str]:
    goal = GOALS[row["form"]]
    measured = row.get("ratio_vs_eager_reference", row["ratio"])  # compiled: against the reference as it runs
    return f">= {goal}x", "pass" if measured >= goal else "miss"


def markdown(results: list[dict], fps: list[dict], args, started: str, loads: tuple) -> str:
    lines = [
        "# PCT: the suite's network against the channel-first formulation it replaces", "",
        f"Generated by `python -m benchmarks.pct {' '.join(sys.argv[1:])}`".rstrip() + f" on {started}; "
        "do not edit by hand.", "",
        f"- machine: {measure.cpu_name()}, {measure.cpu_count()} cores, {args.threads} torch thread(s); load "
        f"average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
        + (" (**shared with other jobs while measured**)" if max(loads) > measure.cpu_count() + 0.5 else "")
        + ": compare the ratios, measured side by side, not the seconds",
        f"- libraries: {measure.environment_line()}",
        "- networks: the suite's `tasks.nets.pct.PCT` (40 classes, `attn=offset`, `fps=plain`) and "
        "`benchmarks.baselines.ChannelFirstPCT` with its weights: PCT_Pytorch's `Pct` channel-first (1x1 `Conv1d` + "
        "`BatchNorm1d` on (B, C, N), the first grouping conv on the concatenated [g - c, c] rows, torch FPS from "
        "point 0, kNN by `topk`); the suite's `PCTPartSeg` (50 parts, 16 categories, xyz input) and "
        "`ChannelFirstPCTPartSeg` (the authors' `Point_Transformer_partseg`: the head's conv on the (B, 3136, N) "
        "concatenation); each pair equal in float64 (tests/test_bench.py)",
        "- inputs: points uniform in [-1, 1]^3, float32; train: forward, cross-entropy (PCT: label-smoothed, 0.2; "
        "part segmentation: plain, over every point), backward, SGD step (momentum 0.9); eval: forward in eval mode "
        "under `no_grad`",
        f"- method: the two networks alternate step by step, {args.rounds} timed rounds after one untimed; ratio = "
        "median over rounds of (reference time / suite time), > 1 when the suite is faster; `ratio of minima` = "
        "fastest reference step / fastest suite step" + ("; compiled: `torch.compile` of each network (inductor), "
                                                        "FPS and kNN eager in both, compile time = first compiled "
                                                        "step - median step; the reference also runs eagerly in "
                                                        "the compiled rounds, and `vs eager reference` = median "
                                                        "over rounds of (eager reference time / compiled suite "
                                                        "time), which the compiled goal is judged on"
                                                        if args.compile else ""),
        f"- goals (issue 20): eager >= {GOALS['eager']}x, compiled >= {GOALS['compiled']}x, train and eval, at "
        "batch 16 and 32",
        "",
        "| network | batch x points | step | form | reference s | suite s | ratio | ratio of minima | "
        "vs eager reference | goal | result | compile s (reference / suite) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        goal, result = verdict(r)
        comp = (f"{r['compile_s_reference']:.0f} / {r['compile_s_suite']:.0f}" if "compile_s_suite" in r else "")
        lines.append(f"| {r['network']} | {r['batch']} x {r['points']} | {r['mode']} | {r['form']} | "
                     f"{r['reference_s']:.2f} | {r['suite_s']:.2f} | **{r['ratio']:.2f}x** | {r['ratio_min']:.2f}x | "
                     + (f"**{r['ratio_vs_eager_reference']:.2f}x** | " if "ratio_vs_eager_reference" in r else " | ")
                     + f"{goal} | **{result}** | {comp} |")
    if fps:
        lines += ["", "FPS and kNN of both groups per batch, seconds (indices only; inside every step above, in both "
                  "networks): the suite's `attention.pointops` against the reference's loop and `topk`, interleaved. "
                  "Both networks run FPS on one thread (`tasks.nets.pct.one_cpu_thread`); the last column is the "
                  "suite's FPS on all of torch's threads, as the network ran it before.", "",
                  "| batch | reference FPS | suite FPS | reference kNN | suite kNN | suite FPS, all threads |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {f['batch']} | {f['reference_fps']:.3f} | {f['suite_fps']:.3f} | {f['reference_knn']:.3f} | "
                  f"{f['suite_knn']:.3f} | {f['suite_fps_all_threads']:.3f} |" for f in fps]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--points", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each network per round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--partseg-batch", type=int, nargs="*", default=[16],
                        help="batches of the part-segmentation network (2 x --points points); none: skip it")
    parser.add_argument("--compile", action="store_true", help="also both networks under torch.compile (slow)")
    parser.add_argument("--quick", action="store_true", help="batch 4, 256 points, 2 rounds, prints only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "pct.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    samples, neighbours = (512, 256), 32
    if args.quick:
        args.batch, args.points, args.rounds, samples, neighbours = [4], 256, 2, (64, 32), 16
        args.partseg_batch = [2]
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    results, fps = [], []
    runs = [("PCT", b, args.points) for b in args.batch] + [("PCTPartSeg", b, 2 * args.points)
                                                            for b in args.partseg_batch]
    for network, batch, points in runs:
        if network == "PCT":
            ours, reference, inputs, target, loss = modelnet_pair(batch, points, samples=samples,
                                                                  neighbours=neighbours)
        else:
            ours, reference, inputs, target, loss = partseg_pair(batch, points)
        for row in compare(ours, reference, inputs, target, loss, args.rounds, "cpu", args.compile):
            results.append({"network": network, "batch": batch, "points": points, **row})
            print(f"{network} batch {batch} {row['mode']:5s} {row['form']:8s} reference {row['reference_s']:.2f} s, "
                  f"suite {row['suite_s']:.2f} s: {row['ratio']:.2f}x (minima {row['ratio_min']:.2f}x)", flush=True)
        if network != "PCT":
            continue
        fps.append({"batch": batch, **neighbourhood_times(inputs[0], samples, neighbours, args.rounds)})
        print(f"batch {batch} FPS / kNN: reference {fps[-1]['reference_fps']:.3f} / {fps[-1]['reference_knn']:.3f} s, "
              f"suite {fps[-1]['suite_fps']:.3f} / {fps[-1]['suite_knn']:.3f} s, suite FPS on all threads "
              f"{fps[-1]['suite_fps_all_threads']:.3f} s", flush=True)
    text = markdown(results, fps, args, started, (load_start, os.getloadavg()[0]))
    if args.quick:
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"written to {args.out}")
    return results


if __name__ == "__main__":
    main()
