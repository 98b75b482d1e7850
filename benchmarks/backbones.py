"""DeiT-S: the suite's ``vit_s`` against timm's ``deit_small_patch16_224``, same weights, side by side (issue 28 §4).

    python -m benchmarks.backbones                   # writes benchmarks/backbones-<device>.md (a GPU: cuda)
    python -m benchmarks.backbones --quick           # batch 2 at 64 x 64, 2 rounds: prints only

timm is the reference DeiT-S's users run (and the suite's lock pins it): ``timm.create_model`` builds it, its
state dict loads into the suite's network through ``VisionTransformer.from_official`` (the same function:
tests/tasks/test_vit_official.py), both with the same stochastic depth (timm's default for this model is none;
DeiT's recipe, and the suite's config, train with 0.1: ``--drop-path`` sets both). A training step is the forward,
cross-entropy, the backward and an SGD step (momentum 0.9); eval is a forward in eval mode under ``no_grad``; each
in float32 and under bf16 autocast (the suite's ``trainer.precision=bf16-mixed``), the two networks alternating
step by step (``benchmarks.pct.interleaved``; CUDA events on a GPU: ``benchmarks.pct_cuda.timed``). Goal: the
suite at least timm's speed in every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from benchmarks.pct import interleaved  # noqa: E402
from benchmarks.pct_cuda import eval_step, timed, train_step  # noqa: E402


def pair(img_size: int, drop_path: float, device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(timm's DeiT-S, the suite's vit_s with its weights), 1000 classes, on ``device``."""
    import timm

    from tasks.nets.backbones import build_backbone

    torch.manual_seed(0)
    reference = timm.create_model("deit_small_patch16_224", pretrained=False, img_size=img_size,
                                  drop_path_rate=drop_path).to(device)
    suite = build_backbone({"name": "vit_s", "drop_path_rate": drop_path}, {"name": "self"}, num_classes=1000,
                           img_size=img_size).to(device)
    suite.load_state_dict(suite.from_official(reference.state_dict()))
    return reference, suite


def rows(batch: int, img_size: int, drop_path: float, rounds: int, device) -> list[dict]:
    reference, suite = pair(img_size, drop_path, device)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, img_size, img_size, generator=g).to(device)
    target = torch.randint(0, 1000, (batch,), generator=g).to(device)
    out = []
    for mode in ("train", "eval"):
        for bf16 in (False, True):
            steps = {name: (train_step(net, F.cross_entropy, (images,), target, bf16) if mode == "train"
                            else eval_step(net, (images,), bf16))
                     for name, net in (("reference", reference), ("suite", suite))}
            times = interleaved(steps, rounds, warmup=3, seconds=lambda step: timed(step, device))
            ref, ours = statistics.median(times["reference"]), statistics.median(times["suite"])
            out.append({"mode": mode, "dtype": "bf16" if bf16 else "float32", "batch": batch, "img_size": img_size,
                        "drop_path": drop_path, "reference_s": ref, "suite_s": ours, "ratio": ref / ours})
            print(f"DeiT-S {mode:5s} {out[-1]['dtype']:7s} timm {1e3 * ref:.1f} ms, suite {1e3 * ours:.1f} ms: "
                  f"{ref / ours:.2f}x", flush=True)
    return out


def markdown(results: list[dict], device, argv: list[str], started: str) -> str:
    lines = [
        *measure.report_header("DeiT-S: the suite's vit_s against timm's deit_small_patch16_224", "backbones", argv,
                               started, device),
        "- the same weights (timm's state dict loaded through `VisionTransformer.from_official`), the same stochastic "
        "depth; ratio = timm's median step / the suite's (> 1: the suite is faster); goal: >= 1.0x", "",
        "| step | dtype | batch | image | drop path | timm ms | suite ms | ratio | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r['mode']} | {r['dtype']} | {r['batch']} | {r['img_size']} | {r['drop_path']} | "
              f"{1e3 * r['reference_s']:.2f} | {1e3 * r['suite_s']:.2f} | **{r['ratio']:.2f}x** | "
              f"**{'pass' if r['ratio'] >= 1.0 else 'miss'}** |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--drop-path", type=float, nargs="+", default=[0.1, 0.0],
                        help="stochastic depth of both networks, one block of rows each")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="batch 2 at 64 x 64, 2 rounds; prints unless --out")
    parser.add_argument("--out", type=Path, help="default: benchmarks/backbones-<device>.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.batch, args.img_size, args.rounds = 2, 64, 2
    started = time.strftime("%Y-%m-%d %H:%M")
    results = [r for dp in args.drop_path for r in rows(args.batch, args.img_size, dp, args.rounds, device)]
    text = markdown(results, device, sys.argv[1:] if argv is None else list(argv), started)
    measure.publish(text, args.out, ROOT / "benchmarks" / f"backbones-{device.type}.md", args.quick)
    return results


if __name__ == "__main__":
    main()
