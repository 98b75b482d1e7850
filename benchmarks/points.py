"""Forward + backward of ``focal`` and ``dilated`` on one point set, one thread: time and peak memory.

``python -m benchmarks.points [variant ...]`` runs each (variant, N) in a fresh process (so that ru_maxrss is
that size's own peak) and prints a markdown table and the exponent of time against N; benchmarks/points.md
holds its output. Mixers are built as ``make bench`` builds them (``benchmarks.cost.build_mixer``: options of
configs/attn/<name>.yaml), on x (1, N, 64) and points uniform in the unit cube.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

SIZES = (4096, 16384, 65536)
CHANNELS = 64


def one(name: str, n: int) -> dict:
    import torch

    from attention import Points
    from benchmarks.cost import build_mixer
    from benchmarks.measure import fit_exponent  # noqa: F401  (imported here to load everything before the clock)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mixer = build_mixer(name, CHANNELS)
    x = torch.randn(1, n, CHANNELS, requires_grad=True)
    layout = Points(torch.rand(1, n, 3))
    grad = torch.randn(1, n, CHANNELS)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    times = []
    for _ in range(3 if n < 65536 else 2):
        start = time.perf_counter()
        mixer(x, layout).backward(grad)
        times.append(time.perf_counter() - start)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"variant": name, "n": n, "seconds": statistics.median(times[1:] if len(times) > 2 else times[-1:]),
            "rss_growth_mib": grown / 1024}


def main(names: list[str]) -> None:
    from benchmarks.measure import fit_exponent

    rows = []
    for name in names:
        for n in SIZES:
            out = subprocess.run([sys.executable, "-m", "benchmarks.points", "--one", name, str(n)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    print("| variant | N | forward + backward (s) | growth of max RSS (MiB) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['n']} | {r['seconds']:.3f} | {r['rss_growth_mib']:.0f} |")
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        ns, ts = [r["n"] for r in mine], [r["seconds"] for r in mine]
        print(f"\n{name}: exponent of time in N, {ns[0]}..{ns[-1]}: {fit_exponent(ns, ts):.2f}; "
              f"{ns[-2]}..{ns[-1]}: {fit_exponent(ns[-2:], ts[-2:]):.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1:] or ["focal", "dilated"])
