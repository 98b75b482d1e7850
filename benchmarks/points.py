"""Forward + backward of ``focal`` and ``dilated`` on one point set, one thread: time and peak memory.

``python -m benchmarks.points [variant ...]`` runs each (variant, N) in a fresh process (so that the peak RSS is
that size's own) and prints a markdown table and the exponent of time against N; benchmarks/points.md
holds its output. Mixers are built as ``make bench`` builds them (``benchmarks.cost.build_mixer``: options of
configs/attn/<name>.yaml), on x (1, N, 64) and points uniform in the unit cube. ``--repeat R`` runs each
size R times (fresh processes) and reports the medians; ``--one VARIANT N`` measures one size in this
process; ``--searches N`` times the neighbour searches inside focal's step (its calls of
``attention.pointops``), to tell what of the step is theirs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

SIZES = (4096, 16384, 65536)
CHANNELS = 64


def one(name: str, n: int) -> dict:
    """One (variant, N): wall and CPU seconds of a forward + backward step, and the growth of the peak RSS.

    Both times are the median of the steps after the first (3 steps, 2 at N >= 65536: there the second
    step's). On one thread the CPU time (``time.process_time``, user + system) is the wall time without the
    waits for a core, so it is the steadier of the two on a machine shared with other jobs.
    """
    import torch

    from attention import Points
    from benchmarks.cost import build_mixer
    from benchmarks.measure import fit_exponent  # noqa: F401  (imported here to load everything before the clock)
    from suite.run_record import peak_rss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mixer = build_mixer(name, CHANNELS)
    x = torch.randn(1, n, CHANNELS, requires_grad=True)
    xyz = torch.rand(1, n, 3)
    grad = torch.randn(1, n, CHANNELS)
    before = peak_rss()  # VmHWM: ru_maxrss would start at the launching process's peak
    times, cpu = [], []
    for _ in range(3 if n < 65536 else 2):
        start, start_cpu = time.perf_counter(), time.process_time()
        mixer(x, Points(xyz)).backward(grad)  # a fresh layout: one layer's step includes its searches (Points.memo)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    grown = peak_rss() - before
    timed = slice(1, None) if len(times) > 2 else slice(-1, None)
    return {"variant": name, "n": n, "seconds": statistics.median(times[timed]),
            "cpu_seconds": statistics.median(cpu[timed]), "rss_growth_mib": grown / 2**20}


def searches(n: int) -> dict:
    """CPU seconds of each neighbour search focal's ``point_regions`` runs on N points (the second of two runs).

    The searches are timed where focal calls them (its module's ``knn`` and ``farthest_point_sample``
    wrapped), so the split follows the mixer's own calls: fine kNN (N queries), farthest point sampling,
    the regions' kNN (m queries) and each point's nearest centres (N queries among m points).
    """
    import torch

    from attention.variants import focal
    from benchmarks.cost import build_mixer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mixer = build_mixer("focal", CHANNELS)
    xyz = torch.rand(1, n, 3)
    seconds: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            out = fn(*args, **kwargs)
            what = (f"{name} {args[0].shape[1]} queries, {args[1].shape[1]} points, k={args[2]}" if name == "knn"
                    else f"{name} {args[1]} of {args[0].shape[1]}")
            seconds[what] = seconds.get(what, 0.0) + time.process_time() - start
            return out
        return wrapper

    knn, fps = focal.knn, focal.farthest_point_sample
    focal.knn, focal.farthest_point_sample = timed("knn", knn), timed("farthest_point_sample", fps)
    try:
        for _ in range(2):
            seconds.clear()
            start = time.process_time()
            mixer.point_regions(xyz)
            total = time.process_time() - start
    finally:
        focal.knn, focal.farthest_point_sample = knn, fps
    return {"n": n, "point_regions": total, **seconds}


def main(names: list[str], repeat: int = 1) -> None:
    """Each (variant, N) ``repeat`` times, each run in a fresh process; the table holds each column's median."""
    from benchmarks.measure import fit_exponent

    rows = []
    for name in names:
        for n in SIZES:
            runs = []
            for _ in range(repeat):
                out = subprocess.run([sys.executable, "-m", "benchmarks.points", "--one", name, str(n)],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(runs[-1], file=sys.stderr, flush=True)
            rows.append({key: statistics.median(r[key] for r in runs) if key not in ("variant", "n") else runs[0][key]
                         for key in runs[0]})
    print("| variant | N | forward + backward, wall (s) | CPU (s) | growth of max RSS (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['n']} | {r['seconds']:.3f} | {r['cpu_seconds']:.3f} | "
              f"{r['rss_growth_mib']:.0f} |")
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        ns = [r["n"] for r in mine]
        for key in ("seconds", "cpu_seconds"):
            ts = [r[key] for r in mine]
            print(f"\n{name}: exponent of {key} in N, {ns[0]}..{ns[-1]}: {fit_exponent(ns, ts):.2f}; "
                  f"{ns[-2]}..{ns[-1]}: {fit_exponent(ns[-2:], ts[-2:]):.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1:2] == ["--searches"]:
        print(json.dumps(searches(int(sys.argv[2]))))
    else:
        args = sys.argv[1:]
        repeat = 1
        if args[:1] == ["--repeat"]:
            repeat, args = int(args[1]), args[2:]
        main(args or ["focal", "dilated"], repeat)
