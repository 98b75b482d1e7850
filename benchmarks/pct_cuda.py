"""PCT on a GPU against PCT_Pytorch as its users run it, with pointnet2_ops' CUDA FPS (issue 28 §1-3).

    python -m benchmarks.pct_cuda --reference DIR     # writes benchmarks/pct-cuda.md and pct-cuda.json
    python -m benchmarks.pct_cuda --quick ...         # batch 2, small FPS/kNN sizes: prints unless --out is given

``DIR`` is a checkout of PCT_Pytorch (github: Strawberry-Eat-Mango/PCT_Pytorch) whose ``pointnet2_ops_lib`` was
built in place (``python setup.py build_ext --inplace``; docs/scale.md#benchmarks-on-a-gpu): its ``model.Pct`` and
``pointnet2_ops.pointnet2_utils.furthest_point_sample`` are what this compares with. Nothing of it is copied here; it
is imported from ``DIR`` at run time. Without ``--reference`` (or where pointnet2_ops is not built) the sections that
need it say so and the others still run.

What it measures, each pair alternating step by step in one process, timed with CUDA events after warm-up (a step
is queued after the GPU has drained, so host overhead counts as the user sees it), the median over rounds:

1. ModelNet40's PCT at batch 16 and 32 (1,024 points, 512/256 centres, 32 neighbours): a training step (forward,
   label-smoothed cross-entropy 0.2, backward, SGD with momentum) and an eval forward, in float32, under bf16
   autocast and both ``torch.compile``d (the suite also with inductor's CUDA graphs, ``mode="reduce-overhead"``);
   float32 three times: in torch's defaults (the reference's 1x1 convolutions
   in TF32, the suite's ``nn.Linear`` products in IEEE float32) and like for like, both IEEE and both TF32
   (``trainer.tf32``, ``suite/tf32.py``). The suite's network is ``tasks.nets.pct.PCT`` (``attn=offset``,
   ``fps=kernel``: pointnet2_ops' indices); the reference is ``model.Pct``. Goals: train and eval >= 1.5x the
   reference's float32 step, bf16 >= 2x the reference's float32 step, compiled >= 2x the reference's float32 step
   (both-compiled beside it). Beside the defaults, the other form of each choice that a GPU's host decides (the
   switches of :func:`patched`): in training, the grouping and fuse layers' batch norm + max (NormActMax or plain
   ops), the offset mixers as one Python autograd function or in plain ops (float32 and bf16) and the batch norms
   on channels-last views that reach cuDNN; in eval, the batch norms folded layer by layer; in both, the 1x1
   convolutions as cuDNN convolutions (the reference's arithmetic under torch's defaults, TF32).
2. ShapeNet part's network (2,048 points, batch 16) against ``benchmarks.baselines.ChannelFirstPCTPartSeg``, the
   authors' Jittor network in PyTorch with the suite's weights (PCT_Pytorch has no part segmentation): >= 1.3x,
   in the same three float32 forms, and with the 1x1 convolutions through cuDNN under torch's defaults.
3. Host synchronisations inside one training step of the suite's PCT (CUDA's sync debug mode): the goal is none.
4. FPS: the suite's Triton kernel (``like_kernel``) against pointnet2_ops from 512 to 65,536 points, and whether
   the two return the same indices (issue 27 §5): points uniform in [-1, 1]^3, one of them near the origin; the
   kernel also at each warp count and with each step's argmax carrying the next centre (``fps_triton.CARRY``).
5. kNN: ``attention.pointops.knn`` against the reference's matmul + ``topk``, time and peak memory, at PCT's sizes
   and at 65,536 points.
6. Where the suite's float32 training step spends its GPU time (``torch.profiler``), the top kernels.
7. Where each side's float32 training step spends its host time: the ops with the most self CPU time, and each
   step's aten ops, host and GPU totals; the same for the suite's step under bf16 autocast. At batch 16 the suite's
   step is bound by the host's launches (about 8 ms of GPU time in a 19 ms step on an H200), so this is the table
   that says which ops to fuse or leave out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import statistics
import sys
import time
import warnings
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from benchmarks.baselines import channel_first, topk_knn  # noqa: E402
from benchmarks.pct import interleaved  # noqa: E402
from suite.strict_json import strict  # noqa: E402
from suite.tf32 import arithmetic  # noqa: E402

GOALS = {"float32": 1.5, "bfloat16": 2.0, "compiled": 2.0, "partseg": 1.3}  # issue 28: reference fp32 / suite
FPS_SIZES = [(32, 512, 256), (32, 1024, 512), (16, 2048, 1024), (8, 8192, 2048), (2, 65536, 8192)]  # (B, N, M)
KNN_SIZES = [(32, 512, 1024, 32), (32, 256, 512, 32), (1, 16384, 16384, 16), (1, 65536, 65536, 36)]  # (B, M, N, k)


# --------------------------------------------------------------------------------------------
# The reference, imported from its checkout
# --------------------------------------------------------------------------------------------

def load_reference(path: Path | None) -> tuple[object | None, Callable | None, str]:
    """(PCT_Pytorch's ``model`` module or None, pointnet2_ops' FPS or None, what was found) from a checkout."""
    if path is None:
        return None, None, "no --reference given"
    path = Path(path).resolve()
    if not (path / "model.py").is_file():
        raise SystemExit(f"--reference {path}: no model.py there; expected a checkout of PCT_Pytorch "
                         "(github: Strawberry-Eat-Mango/PCT_Pytorch) with pointnet2_ops_lib built in place.")
    for p in (path / "pointnet2_ops_lib", path):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    try:
        fps = importlib.import_module("pointnet2_ops.pointnet2_utils").furthest_point_sample
        model = importlib.import_module("model")
    except Exception as error:  # pointnet2_ops not built: model.py imports util, which imports it
        first = (str(error).strip().splitlines() or [""])[0][:200]  # a failed JIT build's error is its whole log
        return None, None, (f"PCT_Pytorch at {path} does not import ({type(error).__name__}: {first}); build "
                            "pointnet2_ops_lib in place")
    version = getattr(sys.modules.get("pointnet2_ops"), "__version__", "?")
    return model, fps, f"PCT_Pytorch at {path}, pointnet2_ops {version}"


class ReferencePCT(torch.nn.Module):
    """PCT_Pytorch's ``Pct`` taking the suite's (B, N, 3) points: its own forward on the (B, 3, N) transpose, as its
    ``main.py`` feeds it (``data.permute(0, 2, 1)``, inside the step, as there)."""

    def __init__(self, model_module, classes: int = 40):
        super().__init__()
        self.net = model_module.Pct(Namespace(dropout=0.5, emb_dims=1024, k=20), output_channels=classes)

    def forward(self, xyz):
        return self.net(xyz.permute(0, 2, 1))


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call of ``step``, queued once the device is idle (CUDA events on a GPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def alternate(steps: dict[str, Callable[[], None]], rounds: int, device, warmup: int = 3) -> dict[str, list[float]]:
    """:func:`benchmarks.pct.interleaved` timed by :func:`timed` (the first call of a compiled step compiles: the
    caller times it apart, before)."""
    return interleaved(steps, rounds, warmup, seconds=lambda step: timed(step, device))


def train_step(net, loss, inputs, target, autocast: bool, tf32: bool | None = None) -> Callable[[], None]:
    """One SGD step; ``tf32``: the float32 arithmetic of its products and convolutions (``suite.tf32``; None:
    torch's defaults), set for the step and restored after it, so that steps of several forms can alternate."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    device = inputs[0].device.type

    def step():
        net.train()
        opt.zero_grad(set_to_none=True)
        with arithmetic(tf32):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = net(*inputs)
            loss(out.float(), target).backward()
            opt.step()

    return step


def other_max(step: Callable[[], None], device: torch.device) -> tuple[str, Callable[[], None]]:
    """(label, ``step``) with PCT's grouping and fuse layers in the form that ``device`` does not take by default
    (``tasks.nets.pct.FUSED_NORM_ACT_MAX``: NormActMax on the CPU, the plain batch norm, activation and max
    elsewhere), to time that form beside the default one."""
    from tasks.nets import pct

    fused = not pct.takes_norm_act_max(torch.device(device))  # the other form
    label = "float32, NormActMax" if fused else "float32, plain batch norm + max"
    return label, patched(step, pct, "FUSED_NORM_ACT_MAX", fused)


def patched(step: Callable[[], None], module, name: str, value) -> Callable[[], None]:
    """``step`` with ``module.name`` set to ``value`` for its duration: a switch of the suite's forms, so that the
    other form of a choice that a GPU's host decides is timed beside the default, step by step. The switches:
    ``tasks.nets.pct.FUSED_NORM_ACT_MAX`` (:func:`other_max`); ``attention.functional.OFFSET_PROJECTED = False``:
    PCT's offset mixers in plain ops (two ``nn.Linear`` and the attention kernel, about a dozen C++ autograd nodes a
    block) instead of one Python autograd function (:class:`attention.functional.OffsetProjected`: fewer products
    and nodes, one Python backward); ``tasks.nets.pct.BATCH_NORM_CHANNELS_LAST = True``: the batch norms of a
    training forward on (1, C, R, 1) channels-last views of their rows, which torch hands to cuDNN (its native
    kernels take the 2-D rows); ``tasks.nets.pct.CONVOLUTIONS = True``: the 1x1 convolutions as ``F.conv2d`` on such
    views (cuDNN, TF32 under torch's defaults) instead of ``F.linear`` (cuBLAS, IEEE float32 there)."""

    def other():
        default = getattr(module, name)
        setattr(module, name, value)
        try:
            step()
        finally:
            setattr(module, name, default)

    return other


def eval_step(net, inputs, autocast: bool, tf32: bool | None = None, at_once: bool = True) -> Callable[[], None]:
    """One inference forward; ``at_once=False``: the suite's batch norms folded layer by layer
    (``tasks.nets.pct.FOLD_AT_ONCE``), to time that form beside the default one."""
    from tasks.nets import pct

    device = inputs[0].device.type

    def step():
        net.eval()
        pct.FOLD_AT_ONCE = at_once
        try:
            with arithmetic(tf32), torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                net(*inputs)
        finally:
            pct.FOLD_AT_ONCE = True

    return step


# The suite's 1x1 convolutions as cuDNN convolutions (tasks.nets.pct.CONVOLUTIONS) under torch's defaults: then
# its arithmetic there is the reference's (convolutions in TF32, the attention's products in IEEE float32)
CONVOLUTIONS_FORM = "float32, 1x1 convolutions through cuDNN"

# The float32 forms: torch's defaults (the reference's 1x1 convolutions in TF32, the suite's nn.Linear products in
# IEEE float32: not the same arithmetic) and the two like-for-like ones (``trainer.tf32``, suite/tf32.py).
# (form, tf32, what the reference runs in that form)
FLOAT32_FORMS = [("float32", None, "reference fp32 (torch's defaults)"),
                 ("float32, both IEEE", False, "reference fp32, IEEE"),
                 ("float32, both TF32", True, "reference fp32, TF32")]


# --------------------------------------------------------------------------------------------
# 1-3: the networks
# --------------------------------------------------------------------------------------------

def pct_rows(model_module, batch: int, points: int, rounds: int, device, samples=(512, 256), neighbours: int = 32,
             compile_too: bool = True) -> list[dict]:
    """Rows {network, batch, mode, form, reference_s, suite_s, ratio, goal, ...} of ModelNet40's PCT."""
    from attention import functional
    from tasks.modelnet import reference_smoothing
    from tasks.nets import pct
    from tasks.nets.pct import PCT

    torch.manual_seed(0)
    suite = PCT(40, {"name": "offset"}, samples=list(samples), neighbours=neighbours).to(device)
    reference = ReferencePCT(model_module).to(device)
    g = torch.Generator().manual_seed(batch)
    xyz = (torch.rand(batch, points, 3, generator=g) * 2 - 1).to(device)
    target = torch.randint(0, 40, (batch,), generator=g).to(device)
    smoothing = reference_smoothing(0.2, 40)

    def loss(logits, y):  # PCT_Pytorch's cal_loss, as the suite computes it (tests/test_bench.py: the same)
        return F.cross_entropy(logits, y, label_smoothing=smoothing)

    rows = []
    for mode in ("train", "eval"):
        def make(net, bf16=False, tf32=None):
            return (train_step(net, loss, (xyz,), target, bf16, tf32) if mode == "train"
                    else eval_step(net, (xyz,), bf16, tf32))

        steps = {"reference_bf16": make(reference, True), "suite_bf16": make(suite, True)}
        for form, tf32, _ in FLOAT32_FORMS:
            steps[_key("reference", form)] = make(reference, tf32=tf32)
            steps[_key("suite", form)] = make(suite, tf32=tf32)
        # the 1x1 convolutions through cuDNN (its TF32 under torch's defaults, as the reference's convolutions)
        steps["suite_convolutions"] = patched(make(suite), pct, "CONVOLUTIONS", True)
        if mode == "eval":  # the batch norms folded layer by layer, beside fold_all's form (the default)
            steps["suite_layerwise"] = eval_step(suite, (xyz,), False, at_once=False)
            steps["suite_bf16_layerwise"] = eval_step(suite, (xyz,), True, at_once=False)
        else:  # NormActMax beside the plain batch norm + max, whichever is not the device's default; the offset
            # mixers in plain ops beside OffsetProjected, in float32 and bf16
            other_label, steps["suite_other_max"] = other_max(make(suite), device)
            steps["suite_plain_offset"] = patched(make(suite), functional, "OFFSET_PROJECTED", False)
            steps["suite_bf16_plain_offset"] = patched(make(suite, True), functional, "OFFSET_PROJECTED", False)
            steps["suite_channels_last"] = patched(make(suite), pct, "BATCH_NORM_CHANNELS_LAST", True)
        first = {}
        if compile_too:
            compiled = {"reference_compiled": make(torch.compile(reference)),
                        "suite_compiled": make(torch.compile(suite)),
                        # inductor's CUDA graphs (reduce-overhead: trainer.compile_mode) of the whole forward and
                        # backward, the remedy for a host-bound small batch, now that the network is one graph; a
                        # copy, so that the suite's two compiled forms share no cache entries of dynamo's
                        "suite_graphs": make(torch.compile(copy.deepcopy(suite), mode="reduce-overhead"))}
            first = {k: timed(s, device) for k, s in compiled.items()}  # compiles, then steps
            steps.update(compiled)
        times = {k: statistics.median(v) for k, v in alternate(steps, rounds, device).items()}
        base = times["reference"]
        forms = [(form, _key("suite", form), times[_key("reference", form)], against)
                 for form, _, against in FLOAT32_FORMS]
        forms += [("bfloat16", "suite_bf16", base, "reference fp32"),
                  (CONVOLUTIONS_FORM, "suite_convolutions", base, "reference fp32 (torch's defaults)")]
        if mode == "eval":
            forms += [("float32, folded layer by layer", "suite_layerwise", base, "reference fp32"),
                      ("bfloat16, folded layer by layer", "suite_bf16_layerwise", base, "reference fp32")]
        else:
            forms += [(other_label, "suite_other_max", base, "reference fp32"),
                      ("float32, offset mixer in plain ops", "suite_plain_offset", base, "reference fp32"),
                      ("bfloat16, offset mixer in plain ops", "suite_bf16_plain_offset", base, "reference fp32"),
                      ("float32, batch norms on channels-last views", "suite_channels_last", base, "reference fp32")]
        if compile_too:
            forms += [("compiled", "suite_compiled", base, "reference fp32"),
                      ("compiled, CUDA graphs", "suite_graphs", base, "reference fp32")]
        for form, key, ref, against in forms:
            goal = GOALS[form.split(",")[0]]
            row = {"network": "PCT", "batch": batch, "points": points, "mode": mode, "form": form,
                   "against": against, "reference_s": ref, "suite_s": times[key], "ratio": ref / times[key],
                   "goal": goal}
            twin = {"bfloat16": "reference_bf16", "compiled": "reference_compiled"}.get(form)
            if twin:  # the reference in the same form, for the like-for-like ratio
                row["same_form_reference_s"] = times[twin]
                row["same_form_ratio"] = times[twin] / times[key]
            if form.startswith("compiled"):  # first compiled step - steady step, each side
                row["compile_s"] = {"reference": first["reference_compiled"] - times["reference_compiled"],
                                    "suite": first[key] - times[key]}
            rows.append(row)
    return rows


def _key(side: str, form: str) -> str:
    """The step's name of one side in one float32 form: ``reference``, ``suite_ieee``, ``reference_tf32``."""
    return side + {"float32": "", "float32, both IEEE": "_ieee", "float32, both TF32": "_tf32"}[form]


def partseg_rows(batch: int, points: int, rounds: int, device) -> list[dict]:
    """Rows of ShapeNet part's network against the channel-first formulation of the authors' network, in the three
    float32 forms and with the suite's 1x1 convolutions through cuDNN under torch's defaults."""
    from tasks.nets import pct
    from tasks.nets.pct import PCTPartSeg

    torch.manual_seed(0)
    suite = PCTPartSeg(50, 16, {"name": "offset"}).to(device)
    reference = channel_first(suite)
    g = torch.Generator().manual_seed(batch)
    xyz = (torch.rand(batch, points, 3, generator=g) * 2 - 1).to(device)
    category = torch.randint(0, 16, (batch,), generator=g).to(device)
    target = torch.randint(0, 50, (batch, points), generator=g).to(device)
    rows = []
    for mode in ("train", "eval"):
        steps = {_key(name, form): (train_step(net, F.cross_entropy, (xyz, category), target, False, tf32)
                                    if mode == "train" else eval_step(net, (xyz, category), False, tf32))
                 for name, net in (("reference", reference), ("suite", suite)) for form, tf32, _ in FLOAT32_FORMS}
        steps["suite_convolutions"] = patched(steps["suite"], pct, "CONVOLUTIONS", True)
        times = {k: statistics.median(v) for k, v in alternate(steps, rounds, device).items()}
        forms = [(form, _key("suite", form), times[_key("reference", form)], against)
                 for form, _, against in FLOAT32_FORMS]
        forms.append((CONVOLUTIONS_FORM, "suite_convolutions", times["reference"], "reference fp32 (torch's defaults)"))
        for form, key, ref, against in forms:
            ours = times[key]
            rows.append({"network": "PCTPartSeg", "batch": batch, "points": points, "mode": mode, "form": form,
                         "against": "channel-first (authors' network)" + against.removeprefix("reference fp32"),
                         "reference_s": ref, "suite_s": ours, "ratio": ref / ours, "goal": GOALS["partseg"]})
    return rows


def host_syncs(batch: int, points: int, device, samples=(512, 256), neighbours: int = 32) -> list[str]:
    """The synchronising CUDA calls inside one training step of the suite's PCT (after a warm-up step), as CUDA's
    sync debug mode reports them: where each was called from."""
    from tasks.modelnet import reference_smoothing
    from tasks.nets.pct import PCT

    net = PCT(40, {"name": "offset"}, samples=list(samples), neighbours=neighbours).to(device)
    xyz = (torch.rand(batch, points, 3) * 2 - 1).to(device)
    target = torch.randint(0, 40, (batch,)).to(device)
    smoothing = reference_smoothing(0.2, 40)
    step = train_step(net, lambda o, y: F.cross_entropy(o, y, label_smoothing=smoothing), (xyz,), target, False)
    step()
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice that the mode is a prototype is not a synchronisation (it was counted as one, H200 run)
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught
            if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]


# --------------------------------------------------------------------------------------------
# 4-5: FPS and kNN
# --------------------------------------------------------------------------------------------

FPS_WARPS = (1, 2, 4, 8, 16)  # the kernel's warps a program, timed beside its default (attention.fps_triton.WARPS)


def fps_rows(op: Callable, rounds: int, device, sizes=FPS_SIZES) -> list[dict]:
    """The suite's FPS (Triton, ``like_kernel``) against pointnet2_ops' ``furthest_point_sample``; and the kernel
    with each of ``FPS_WARPS`` warps a program, and with ``fps_triton.CARRY`` (each argmax carrying the next
    centre's coordinates, where the points fit in registers), to choose its defaults from."""
    from attention import fps_triton
    from attention.pointops import farthest_point_sample

    def suite(xyz, m, warps=None, carry=False):
        fps_triton.WARPS, fps_triton.CARRY = warps, carry
        try:
            return farthest_point_sample(xyz, m, like_kernel=True)
        finally:
            fps_triton.WARPS, fps_triton.CARRY = None, False

    rows = []
    for b, n, m in sizes:
        g = torch.Generator().manual_seed(n)
        xyz = torch.rand(b, n, 3, generator=g) * 2 - 1
        xyz[:, 1] = 1e-3  # a point near the origin: pointnet2_ops never samples it
        xyz = xyz.to(device)
        theirs = op(xyz, m).long()
        ours = suite(xyz, m)
        steps = {"pointnet2_ops": lambda: op(xyz, m), "suite": lambda: suite(xyz, m),
                 "carry": lambda: suite(xyz, m, carry=True),
                 **{f"warps_{w}": (lambda w=w: suite(xyz, m, w)) for w in FPS_WARPS}}
        times = {k: statistics.median(v) for k, v in alternate(steps, max(3, rounds // (4 if n > 8192 else 1)),
                                                                device, warmup=1).items()}
        same = (theirs == ours).all(dim=1)  # (B,)
        rows.append({"batch": b, "points": n, "samples": m, "reference_s": times["pointnet2_ops"],
                     "suite_s": times["suite"], "ratio": times["pointnet2_ops"] / times["suite"],
                     "same_samples": int(same.sum()), "first_difference": _first_difference(theirs, ours),
                     "warps_s": {w: times[f"warps_{w}"] for w in FPS_WARPS},
                     "same_with_warps": all(torch.equal(suite(xyz, m, w), ours) for w in FPS_WARPS),
                     "carry_s": times["carry"], "same_with_carry": torch.equal(suite(xyz, m, carry=True), ours)})
    return rows


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if len(diff) else None


def knn_rows(rounds: int, device, sizes=KNN_SIZES) -> list[dict]:
    """``attention.pointops.knn`` against matmul + ``topk`` (PCT_Pytorch's ``knn_point``): time and peak memory."""
    from attention.pointops import knn

    rows = []
    for b, m, n, k in sizes:
        g = torch.Generator().manual_seed(m + n)
        points = (torch.rand(b, n, 3, generator=g) * 2 - 1).to(device)
        query = points[:, :m].contiguous()
        steps = {"reference": lambda: topk_knn(query, points, k), "suite": lambda: knn(query, points, k)}
        if device.type == "cuda":  # the Triton kernel's two paths (knn_triton.SORTED_FROM chooses), to tune it by
            from attention import knn_triton

            steps.update(simple=lambda: knn_triton.knn(query, points, k, sort=False),
                         sorted=lambda: knn_triton.knn(query, points, k, sort=True))
        times = {k_: statistics.median(v) for k_, v in alternate(steps, rounds, device, warmup=1).items()}
        peak = {k_: measure.peak_bytes(steps[k_], device) for k_ in ("reference", "suite")}
        rows.append({"batch": b, "queries": m, "points": n, "k": k, "reference_s": times["reference"],
                     "suite_s": times["suite"], "ratio": times["reference"] / times["suite"],
                     "reference_peak_bytes": peak["reference"], "suite_peak_bytes": peak["suite"],
                     "simple_s": times.get("simple"), "sorted_s": times.get("sorted")})
    return rows


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.3f}"


# --------------------------------------------------------------------------------------------
# 6: profile
# --------------------------------------------------------------------------------------------

def profile_table(batch: int, points: int, device, samples=(512, 256), neighbours: int = 32, rows: int = 15) -> str:
    """torch.profiler's table of one float32 training step of the suite's PCT, by GPU time (CPU: CPU time)."""
    from tasks.nets.pct import PCT

    net = PCT(40, {"name": "offset"}, samples=list(samples), neighbours=neighbours).to(device)
    prof = measure.profiled(_warm_step(net, batch, points, device), device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def host_profile(model_module, batch: int, points: int, device, samples=(512, 256), neighbours: int = 32,
                 rows: int = 20) -> str:
    """Section 7: for the suite's PCT and (with ``model_module``) the reference, one float32 training step's aten
    ops, host time (self CPU time of every op, profiler overhead included: compare the two, not the absolute
    numbers), GPU time, then its ops by self CPU time; and the suite's step under bf16 autocast (its ratio misses
    most: casts and the products' host time)."""
    from tasks.nets.pct import PCT

    torch.manual_seed(0)
    suite = PCT(40, {"name": "offset"}, samples=list(samples), neighbours=neighbours).to(device)
    steps = {"suite": _warm_step(suite, batch, points, device)}
    if model_module is not None:
        steps["reference"] = _warm_step(ReferencePCT(model_module).to(device), batch, points, device)
    steps["suite, bf16 autocast"] = _warm_step(suite, batch, points, device, autocast=True)
    return "\n".join(f"{side}: " + measure.host_profile(step, device, rows) for side, step in steps.items())


def _warm_step(net, batch: int, points: int, device, autocast: bool = False) -> Callable[[], None]:
    """One float32 SGD step of ``net`` on uniform points (``autocast``: under bf16 autocast), after three untimed
    ones."""
    xyz = (torch.rand(batch, points, 3) * 2 - 1).to(device)
    target = torch.randint(0, 40, (batch,)).to(device)
    step = train_step(net, F.cross_entropy, (xyz,), target, autocast)
    for _ in range(3):
        step()
    return step


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def markdown(out: dict) -> str:
    lines = [
        "# PCT on a GPU against PCT_Pytorch with pointnet2_ops (issue 28)", "",
        f"Generated by `python -m benchmarks.pct_cuda {' '.join(out['argv'])}`".rstrip() + f" on {out['date']}; do not "
        "edit by hand (`benchmarks/pct_cuda.py` says what each section measures).", "",
        f"- device: {out['device']}",
        f"- libraries: {out['libraries']}",
        f"- reference: {out['reference']}",
        f"- method: each pair alternates step by step, {out['rounds']} timed rounds after 3 untimed, "
        + ("CUDA events around each step queued on an idle GPU" if out["cuda"] else "wall time (a CPU trial run)")
        + "; ratio = reference median / suite median (> 1: the suite is faster)",
        "",
    ]
    if out["pct"]:
        lines += ["## Networks", "",
                  "In float32, torch's defaults give the two sides different arithmetic on a GPU with TF32: cuDNN "
                  "runs the reference's 1x1 convolutions in TF32, cuBLAS the suite's `nn.Linear` products in IEEE "
                  "float32. The rows `both IEEE` and `both TF32` set one arithmetic for both (`trainer.tf32=false` / "
                  "`true`, `suite/tf32.py`); `float32` is torch's defaults, as each side's users run it.", "",
                  "| network | batch x points | step | suite form | against | reference ms | suite ms | ratio | goal | "
                  "result | same form: reference ms, ratio | compile s (reference / suite) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in out["pct"]:
            same = (f"{1e3 * r['same_form_reference_s']:.1f}, {r['same_form_ratio']:.2f}x"
                    if "same_form_ratio" in r else "")
            comp = r.get("compile_s", {})
            comp = f"{comp['reference']:.0f} / {comp['suite']:.0f}" if comp else ""
            lines.append(f"| {r['network']} | {r['batch']} x {r['points']} | {r['mode']} | {r['form']} | "
                         f"{r['against']} "
                         f"| {1e3 * r['reference_s']:.2f} | {1e3 * r['suite_s']:.2f} | **{r['ratio']:.2f}x** | "
                         f">= {r['goal']}x | **{'pass' if r['ratio'] >= r['goal'] else 'miss'}** | {same} | {comp} |")
        lines.append("")
    else:
        lines += [f"## Networks\n\nNot measured: {out['why_no_reference']}.", ""]
    lines += ["## Host synchronisations in a training step", ""]
    if out["syncs"] is None:
        lines += ["Not measured: only a CUDA device reports them (`torch.cuda.set_sync_debug_mode`).", ""]
    else:
        lines += [f"{len(out['syncs'])} in one float32 training step of the suite's PCT (goal: none)."
                  + "".join(f"\n- `{s}`" for s in out["syncs"]), ""]
    lines += ["## FPS: the suite's Triton kernel (`like_kernel`) against pointnet2_ops", ""]
    if out["fps"]:
        lines += ["| B | N | M | pointnet2_ops ms | suite ms | ratio | samples with the op's indices | first differing "
                  "pick | " + " | ".join(f"{w} warps ms" for w in FPS_WARPS) + " | same indices at every warp count | "
                  "centre carried (`CARRY`) ms | same indices carried |",
                  "| --- " * (11 + len(FPS_WARPS)) + "|"]
        lines += [f"| {r['batch']} | {r['points']} | {r['samples']} | {1e3 * r['reference_s']:.3f} | "
                  f"{1e3 * r['suite_s']:.3f} | **{r['ratio']:.2f}x** | {r['same_samples']} of {r['batch']} | "
                  f"{'' if r['first_difference'] is None else r['first_difference']} | "
                  + " | ".join(f"{1e3 * r['warps_s'][w]:.3f}" for w in FPS_WARPS)
                  + f" | {'yes' if r['same_with_warps'] else '**no**'} | {_ms(r.get('carry_s'))} | "
                  + {True: "yes", False: "**no**", None: ""}[r.get("same_with_carry")] + " |" for r in out["fps"]]
    else:
        lines.append(f"Not measured: {out['why_no_reference']}.")
    lines += ["", "## kNN: `attention.pointops.knn` against matmul + `topk`", "",
              "| B | queries | points | k | matmul + topk ms | suite ms | ratio | peak MiB (matmul + topk / suite) | "
              "Triton, index order ms | Triton, sorted ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['queries']} | {r['points']} | {r['k']} | {1e3 * r['reference_s']:.3f} | "
              f"{1e3 * r['suite_s']:.3f} | **{r['ratio']:.2f}x** | {r['reference_peak_bytes'] / 2 ** 20:.0f} / "
              f"{r['suite_peak_bytes'] / 2 ** 20:.0f} | {_ms(r.get('simple_s'))} | {_ms(r.get('sorted_s'))} |"
              for r in out["knn"]]
    lines += ["", "## Where the suite's float32 training step spends its time", "", "```", out["profile"].rstrip(),
              "```", "", "## Where each side's float32 training step spends its host time", "",
              "Self CPU time under torch.profiler (its overhead included: compare the sides, not the numbers).", "",
              "```", out.get("host_profile", "(not reached)").rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, help="PCT_Pytorch checkout with pointnet2_ops built in place")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled networks (minutes)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script out")
    parser.add_argument("--quick", action="store_true",
                        help="batch 2, 2 rounds, small FPS/kNN sizes; prints the table unless --out is given")
    parser.add_argument("--points", type=int, default=1024,
                        help="points a cloud (centres: a half and a quarter of them); PCT_Pytorch's code fixes 1024")
    parser.add_argument("--out", type=Path, help="default: benchmarks/pct-cuda.md (and .json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.pct_cuda measures on a GPU, and torch.cuda.is_available() is False here; "
                         "--device cpu only tries the script out.")
    points, neighbours = args.points, 32
    samples = (points // 2, points // 4)  # PCT_Pytorch's 512 and 256 of 1,024, fixed in its code
    fps_sizes, knn_sizes = FPS_SIZES, KNN_SIZES
    if args.quick:
        args.batch, args.rounds = [2], 2
        fps_sizes, knn_sizes = [(2, 512, 64)], [(2, 64, 256, 16)]
    model_module, fps_op, found = load_reference(args.reference)
    out = {"argv": sys.argv[1:] if argv is None else list(argv), "date": time.strftime("%Y-%m-%d %H:%M"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else measure.cpu_name(),
           "libraries": measure.environment_line(), "reference": found, "rounds": args.rounds,
           "why_no_reference": found, "cuda": device.type == "cuda", "pct": [], "fps": [], "knn": [], "syncs": None,
           "profile": "(not reached)"}
    if not args.quick or args.out is not None:
        args.out = args.out or ROOT / "benchmarks" / "pct-cuda.md"

    def save() -> None:  # after every section: a run cut short by a time limit still leaves what it measured
        if args.out is None:
            return
        args.out.write_text(markdown(out))
        args.out.with_suffix(".json").write_text(json.dumps(strict({k: v for k, v in out.items()
                                                                    if k not in ("profile", "host_profile")}),
                                                            indent=2, default=str) + "\n")  # NaN: null

    if model_module is not None:
        for batch in args.batch:
            for row in pct_rows(model_module, batch, points, args.rounds, device, samples, neighbours,
                                not args.no_compile):
                out["pct"].append(row)
                print(f"PCT batch {batch} {row['mode']:5s} {row['form']:8s} reference {1e3 * row['reference_s']:.2f} "
                      f"ms, suite {1e3 * row['suite_s']:.2f} ms: {row['ratio']:.2f}x", flush=True)
            save()
        out["pct"] += partseg_rows(2 if args.quick else 16, 2 * points, args.rounds, device)
        save()
        if device.type == "cuda":
            out["fps"] = fps_rows(fps_op, args.rounds, device, fps_sizes)
            save()
    if device.type == "cuda":
        out["syncs"] = host_syncs(max(args.batch), points, device, samples, neighbours)
    out["knn"] = knn_rows(args.rounds, device, knn_sizes)
    save()
    out["profile"] = profile_table(max(args.batch), points, device, samples, neighbours)
    save()
    out["host_profile"] = host_profile(model_module, max(args.batch), points, device, samples, neighbours)
    if args.out is None:
        print(markdown(out))
    else:
        save()
        print(f"written to {args.out}", flush=True)
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
