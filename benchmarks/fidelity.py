"""What the GAN's validation scores cost after its images are generated: FID against a cached reference and KID,
the host's form (torch-fidelity's numpy; FID's trace term by ``frechet_distance``) against the device's (torch in
float64 there: ``fid.fid_against_reference``, ``fid._kid_on_device``), side by side in one process.

    python -m benchmarks.fidelity                # writes benchmarks/fidelity-<device>.md
    python -m benchmarks.fidelity --quick        # 3,000 generated features, 10 KID pairs; prints only

The GAN task's defaults: 10,000 generated images' pool features (D = 2048) against a reference of 12,000 (the
training split's statistics and their covariance root, as ``reference_statistics`` keeps them, made once and not
timed), KID over 100 pairs of 1,000-image subsets. Features are random (a gamma distribution, as post-ReLU pool
features are non-negative); the scores' cost does not depend on their values. Each row: the median of ``--rounds``
calls, device-synchronised, the two forms alternating; the values of both forms are printed beside, and must
agree (relative 1e-9). The host's numpy uses the threads it finds (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from tasks.metrics import fid  # noqa: E402


def features(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """(n, d) float64 features, non-negative as Inception's pool features."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.gamma(1.0, scale, size=(n, d)))


def cases(generated: torch.Tensor, reference: dict, device, subsets: int, size: int) -> dict[str, tuple]:
    """{score: (host form, device form)}: callables returning the score, the generated features where the GAN's
    validation holds them (on the device)."""
    on_device = generated.to(device)
    return {
        "FID against the reference": (
            lambda: fid.frechet_distance(fid.fid_statistics(generated), reference),
            lambda: fid._fid_on_device(on_device, reference, device)),
        f"KID, {subsets} pairs of {size}": (
            lambda: fid.kernel_inception_distance(generated, reference["features"], subsets=subsets,
                                                  subset_size=size)[0],
            lambda: fid._kid_on_device(on_device, torch.as_tensor(reference["features"]), subsets, size, 3, None,
                                       1.0, device)[0]),
    }


def timed(call, device) -> tuple[float, float]:
    """(seconds, value) of one call, the device synchronised before and after."""
    measure.sync(device)
    start = time.perf_counter()
    value = call()
    measure.sync(device)
    return time.perf_counter() - start, value


def markdown(rows: list[dict], info: dict, device, argv: list[str], started: str) -> str:
    lines = [
        *measure.report_header("The GAN validation's scores: host against device", "fidelity", argv, started,
                               device),
        f"- {info['generated']:,} generated against {info['reference']:,} reference features of D = {info['d']}; host "
        f"threads: {torch.get_num_threads()} (torch), numpy's BLAS as it finds them; median of {info['rounds']} "
        "calls each, the two forms alternating; ratio = host / device (> 1: the device's form is faster)", "",
        "| score | host s | device s | ratio | host value | device value |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r['score']} | {r['host_s']:.3f} | {r['device_s']:.3f} | **{r['ratio']:.1f}x** | "
              f"{r['host_value']:.10g} | {r['device_value']:.10g} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--generated", type=int, help="generated features (default 10,000; --quick 3,000): more "
                                                          "than --dim, where the device's FID form applies")
    parser.add_argument("--reference", type=int, default=12_000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--subsets", type=int, help="KID's pairs (default 100; --quick 10)")
    parser.add_argument("--subset-size", type=int, help="KID's subset size (default 1,000; --quick 500)")
    parser.add_argument("--rounds", type=int, help="timed calls of each form (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="the smaller defaults above; prints unless --out")
    parser.add_argument("--out", type=Path, help="default: benchmarks/fidelity-<device>.md")
    args = parser.parse_args(argv)
    for name, full, quick in (("generated", 10_000, 3000), ("subsets", 100, 10), ("subset_size", 1000, 500),
                              ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.generated <= args.dim:
        parser.error(f"--generated {args.generated} must exceed --dim {args.dim}: with fewer images than features "
                     "the validation's FID takes the low-rank factor's form on the host, not the device's")
    device = torch.device(args.device)
    started = time.strftime("%Y-%m-%d %H:%M")
    reference_features = features(args.reference, args.dim, seed=0)
    reference = fid.with_root(fid.fid_statistics(reference_features))           # made once, as the cache does
    reference["features"] = reference_features.float().numpy()                  # float32, as the cache holds them
    generated = features(args.generated, args.dim, seed=1, scale=1.1)
    rows = []
    for score, (host, dev) in cases(generated, reference, device, args.subsets, args.subset_size).items():
        timed(dev, device)  # warm-up: the device's kernels and solver workspaces
        host_times, device_times = [], []
        for _ in range(args.rounds):
            seconds, host_value = timed(host, device)
            host_times.append(seconds)
            seconds, device_value = timed(dev, device)
            device_times.append(seconds)
        row = {"score": score, "host_s": statistics.median(host_times), "device_s": statistics.median(device_times),
               "host_value": float(host_value), "device_value": float(device_value)}
        row["ratio"] = row["host_s"] / row["device_s"]
        rows.append(row)
        print(f"{score:32s} host {row['host_s']:8.3f} s  device {row['device_s']:8.3f} s  {row['ratio']:6.1f}x  "
              f"values {row['host_value']:.10g} / {row['device_value']:.10g}", flush=True)
    info = {"generated": args.generated, "reference": args.reference, "d": args.dim, "rounds": args.rounds}
    text = markdown(rows, info, device, sys.argv[1:] if argv is None else list(argv), started)
    measure.publish(text, args.out, ROOT / "benchmarks" / f"fidelity-{device.type}.md", args.quick)
    return rows


if __name__ == "__main__":
    main()
