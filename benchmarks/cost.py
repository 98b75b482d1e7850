"""``python run.py mode=bench``: what each attention variant costs, measured by the suite itself.

For every registered variant and the baselines (``benchmarks/baselines.py``), each layout, token count N and
width C (``configs/bench/default.yaml``), one mixer built as a task builds it (options from
``configs/attn/<name>.yaml``) runs forward + backward on x (B, N, C) with an upstream gradient:

- time: the median over ``repeats`` device-synchronised steps after ``warmup`` ones;
- peak memory: the most allocated at once during one step beyond the parameters, x and the gradient
  (``benchmarks.measure.peak_bytes``: CUDA's allocator statistics, the CPU allocator's events via torch.profiler);
- FLOPs: ``torch.utils.flop_counter`` (forward and backward; the suite's custom ops register their formulas),
  and the bytes its ops move (``benchmarks.measure.OpCounter``), counted during the first warm-up step;
- parameters.

Before a size runs, its peak memory and FLOPs are estimated by running the step on fake tensors (nothing
allocated or computed), scaled by what the previous size measured against its own estimate; where a variant
cannot run on fake tensors (data-dependent shapes), the previous sizes are extrapolated. Sizes estimated
above ``max_gb`` or ``max_seconds`` are skipped and marked; a size that still fails is marked, not fatal.

Scaling exponents are least-squares slopes of log time (and log memory) against log N. The machine's own
limits (a large matrix product, a large copy) are measured in the same run, and each variant at its largest
N is placed against the bound that applies (FLOPs per byte moved against the machine's balance).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import shutil
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

import attention
from attention.errors import UserError
from attention.layout import Points
from benchmarks import measure
from benchmarks.baselines import BASELINES
from benchmarks.measure import GiB, MiB
from suite.strict_json import strict

log = logging.getLogger("bench")
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = ["variant", "kind", "layout", "channels", "heads", "n", "grid", "batch", "dtype", "params", "flops_fwd",
           "flops", "bytes_moved", "time_ms", "time_min_ms", "time_max_ms", "peak_mib", "est_peak_mib", "status",
           "note"]
EXPONENT_GOALS = {"linear": (0.85, 1.15), "quadratic": (1.75, 2.25)}  # time ~ N^k, per declared complexity


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------

def given_paths(overrides) -> set[str]:
    """The ``bench`` keys that command-line overrides set, as dotted paths below ``bench`` down to each value they
    give: ``bench.limits.matmul=256`` -> ``limits.matmul``; ``bench.limits={matmul:256}`` -> ``limits.matmul`` too
    (Hydra merges a dict into the node); a list or any other value is one path."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def leaves(path, value):
        if isinstance(value, dict) and value:
            return set().union(*(leaves(f"{path}.{k}", v) for k, v in value.items()))
        return {path}

    parser, paths = OverridesParser.create(), set()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except Exception:  # noqa: BLE001 - Hydra has refused it already; the key alone
            key, value = text.split("=", 1)[0].lstrip("+~"), None
        else:
            key = override.key_or_group
            value = None if override.is_sweep_override() or override.is_delete() else override.value()
        if key.startswith("bench."):
            paths |= leaves(key.removeprefix("bench."), value)
    return paths


def _without(tree: dict, given: set[str], prefix: str = "") -> dict:
    """``tree`` less the paths in ``given`` (and what lies below them); the rest of a node of which only some keys
    were given is kept."""
    out = {}
    for key, value in tree.items():
        path = prefix + str(key)
        if path in given:
            continue
        if isinstance(value, dict) and any(g.startswith(path + ".") for g in given):
            out[key] = _without(value, given, path + ".")
        else:
            out[key] = value
    return out


def settings(cfg: DictConfig, given: set[str] = frozenset()) -> dict:
    """``cfg.bench`` as a plain dict, with ``quick_overrides`` merged in when ``quick`` is set, except the paths in
    ``given`` (:func:`given_paths` of the command line: what it sets wins, and only that: with
    ``bench.limits.matmul=256`` quick's other limits still apply)."""
    bench = OmegaConf.create(OmegaConf.to_container(cfg.bench, resolve=True))
    if bench.quick:
        bench = OmegaConf.merge(bench, _without(OmegaConf.to_container(bench.quick_overrides), set(given)))
    out = OmegaConf.to_container(bench, resolve=True)
    out.pop("quick_overrides", None)
    if isinstance(out.get("options"), dict):  # each entry is configs/attn/<name>.yaml: its name is not an option
        out["options"] = {k: ({o: x for o, x in v.items() if o != "name"} if isinstance(v, dict) else v)
                          for k, v in out["options"].items()}
    if not isinstance(out.get("replace_tables", False), bool):
        raise UserError(f"bench.replace_tables={out['replace_tables']!r}: give true or false (true: a bench.table_dir "
                        "table of the same name is replaced even by one that measures less).")
    known = set(attention.names())
    variants = out["variants"] if out["variants"] is not None else attention.names()
    unknown = [v for v in variants if v not in known] + [v for v in out["options"] or {}
                                                         if v not in known | set(BASELINES)]
    if unknown:
        raise UserError(f"bench: unknown attention variant(s) {', '.join(map(repr, unknown))}. "
                        f"Available: {', '.join(sorted(known))}; baselines: {', '.join(BASELINES)}.")
    bad = [b for b in out["baselines"] or [] if b not in BASELINES]
    if bad:
        raise UserError(f"bench.baselines: unknown {', '.join(map(repr, bad))}; available: {', '.join(BASELINES)}.")
    out["variants"] = list(variants)
    out["baselines"] = list(out["baselines"] or [])
    # Counts below 1 ran: bench.repeats=0 timed nothing and marked every row failed, bench.batch=0 timed empty
    # tensors, exit code 0 both; a negative size crashed in the square check below.
    for key in ("sizes", "channels", "batch", "repeats"):
        values = out[key] if isinstance(out[key], list) else [out[key]]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise UserError(f"bench.{key}={out[key]!r}: give " + ("a list of positive whole numbers, e.g. "
                            f"bench.{key}=[256,1024]" if isinstance(out[key], list) else
                            f"a positive whole number, e.g. bench.{key}=1") + ".")
    for n in out["sizes"]:
        if "grid" in out["layouts"] and math.isqrt(n) ** 2 != n:
            raise UserError(f"bench.sizes: {n} is not a square, so no square grid holds it; use squares "
                            f"(e.g. 256, 1024, 4096) or bench.layouts=[points].")
    bad = [d for d in out["dtypes"] if d not in DTYPES]
    if bad:
        raise UserError(f"bench.dtypes: {bad} not known; use {', '.join(DTYPES)}.")
    bad = [k for k in out["layouts"] if k not in ("grid", "points")]
    if bad:
        raise UserError(f"bench.layouts: {bad} not known; use grid and/or points.")
    check_buildable(out)
    return out


def check_buildable(s: dict) -> None:
    """Every variant and baseline asked for builds at every ``bench.channels`` with its ``bench.options``: the sweep
    left out one that did not with a log line alone, so an option's typo or a C its heads do not divide ended with
    exit code 0 and a table without that variant (copied over the committed one with ``bench.table_dir``)."""
    import inspect

    problems = []
    for name in [*s["variants"], *s["baselines"]]:
        if name in BASELINES:  # a baseline takes its variant's options: attention.build's check does not see it
            accepted = set(inspect.signature(BASELINES[name][0]).parameters) - {"dim"}
            if unknown := sorted(set(baseline_options(name, s["options"])) - accepted):
                problems.append(f"baseline {name!r} has no option {', '.join(unknown)} (its options: "
                                f"{', '.join(sorted(accepted))})")
                continue
        for c in s["channels"]:
            try:
                build_mixer(name, c, s["options"])
            except UserError as err:
                problems.append(f"{name} at C={c}: {str(err).rstrip('.')}")
    if problems:
        raise UserError("bench: these cannot be built, so the table would leave them out: " + "; ".join(problems)
                        + ". Fix bench.options (e.g. bench.options={dilated:{heads:4}}), give bench.channels that "
                        "each variant's heads divide (e.g. [64, 256]), or leave the variant out of bench.variants.")


def table_dir(s: dict) -> Path | None:
    """``bench.table_dir`` as an absolute path (relative to the working directory), or None."""
    if not s.get("table_dir"):
        return None
    folder = Path(s["table_dir"]).expanduser()
    return folder if folder.is_absolute() else Path.cwd() / folder


# Settings whose smaller value measures less: fewer timed repeats or warm-up steps, a shorter minimum, a smaller
# memory or time budget (rows skipped), fewer task batches or PCT rounds.
BUDGETS = ("warmup", "repeats", "min_seconds", "max_gb", "max_seconds", "task_warmup", "task_batches",
           "task_pct_rounds")


def table_losses(old: dict, s: dict) -> list[str]:
    """What a table measured with settings ``old`` holds that one measured with ``s`` would not: each as the
    option and what it lacks or changes."""
    losses = []
    known = {"variants": set(attention.names()), "baselines": set(BASELINES)}  # a variant since removed is no loss
    for key in ("variants", "baselines", "layouts", "sizes", "channels", "dtypes"):
        missing = [v for v in old.get(key) or [] if v not in (s.get(key) or []) and v in known.get(key, [v])]
        if missing:
            losses.append(f"bench.{key}={_listed(s.get(key))} lacks {', '.join(map(str, missing))}")
    if old.get("batch", s["batch"]) != s["batch"]:
        losses.append(f"bench.batch={s['batch']} (the table's: {old['batch']})")
    if s.get("quick") and not old.get("quick"):
        losses.append("bench.quick=true (the smoke run's sizes, repeats and budget)")
    else:  # fewer repeats are noisier medians; a smaller budget skips rows that the table measured
        budgets = [(f"bench.{k}", s.get(k), old.get(k)) for k in BUDGETS if k in old] + \
            [(f"bench.limits.{k}", (s.get("limits") or {}).get(k), v) for k, v in (old.get("limits") or {}).items()]
        for option, mine, theirs in budgets:
            if option == "bench.max_gb" and (mine is None) != (theirs is None):  # null: half the free memory
                free = 0.5 * measure.available_bytes(pick_device(s.get("device") or "auto")) / GiB
                mine, theirs = (free if v is None else v for v in (mine, theirs))
            if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and mine < theirs:
                losses.append(f"{option}={mine:g} (the table's: {theirs:g})")
    for name in [v for v in s["variants"] + s["baselines"] if v in old.get("variants", []) + old.get("baselines", [])]:
        mine, theirs = mixer_options(name, s.get("options")), mixer_options(name, old.get("options"))
        if mine != theirs and mine != mixer_options(name, None):  # the table's files changed since: no loss
            changed = [f"{k}={mine.get(k)!r} (the table's: {theirs.get(k)!r})" for k in sorted({*mine, *theirs})
                       if mine.get(k) != theirs.get(k)]
            losses.append(f"bench.options.{name}: {', '.join(changed)}")
    if old.get("tasks"):
        if not s.get("tasks"):
            losses.append("bench.tasks=false (the table has each task's training throughput)")
        else:
            for key in ("task_names", "task_attn"):
                if missing := [v for v in old.get(key) or [] if v not in (s.get(key) or [])]:
                    losses.append(f"bench.{key}={_listed(s.get(key))} lacks {', '.join(map(str, missing))}")
            for key in ("task_pct", "task_compile", "task_deterministic"):
                if old.get(key) and not s.get(key):
                    losses.append(f"bench.{key}=false (the table's: true)")
    return losses


def _listed(values) -> str:
    return "[" + ",".join(map(str, values or [])) + "]"


def check_table_dir(s: dict, stem: str) -> None:
    """Refuse, before anything is measured, to copy a table over ``bench.table_dir``'s table of the same name
    (``<stem>.md``, ``.csv``, ``.json``, plots: the committed ones with make bench) when this run measures less
    than that table holds, unless ``bench.replace_tables=true``. The other table's settings are read from its
    JSON; a table there without a readable one is refused too (what it holds is not known)."""
    folder = table_dir(s)
    if folder is None or s.get("replace_tables"):
        return
    there = [p for p in (folder / f"{stem}.{ext}" for ext in ("md", "csv", "json")) if p.is_file()]
    if not there:
        return
    try:
        old = json.loads((folder / f"{stem}.json").read_text())["settings"]
        assert isinstance(old, dict)
        losses = table_losses(old, s)
        what = "measured more than this run would: " + "; ".join(losses)
    except Exception:  # noqa: BLE001 - no JSON, or not the bench's: what it holds is unknown
        losses, what = ["unknown"], "has no readable settings (its JSON), so what it holds is not known"
    if not losses:
        return
    raise UserError(
        f"bench.table_dir={s['table_dir']}: {folder / stem}.md (with its .csv, .json and plots) would be replaced by "
        f"this run's table, and that table {what}. Nothing was measured. To keep it, write this run's table "
        f"elsewhere (bench.table_dir=null: the run directory only, or bench.table_dir=<another folder>) or under a "
        f"name of its own (bench.name=<name>, e.g. bench.name={s['name']}-partial); to replace it on purpose, add "
        "bench.replace_tables=true.")


def clear_earlier_plots(folder: Path, stem: str) -> None:
    """Delete the plots of the table ``<stem>`` that ``folder`` holds, before this run's are copied there: a table
    replaced by one of other dtypes left the earlier plots beside it (``<stem>-float32-time.png`` and
    ``-bfloat16-`` under one of ``<stem>-time.png``). The names come from that table's JSON (``plots``), or for a
    table written before it listed them, are the names this bench gives."""
    try:
        names = json.loads((folder / f"{stem}.json").read_text())["plots"]
        assert isinstance(names, list)
    except Exception:  # noqa: BLE001 - no JSON, or one without the list
        names = [f"{stem}{suffix}-{metric}.png" for suffix in ["", *(f"-{d}" for d in DTYPES)]
                 for metric in ("time", "memory")]
    for name in names:
        if isinstance(name, str) and name.endswith(".png") and Path(name).name == name:  # a file of the folder only
            (folder / name).unlink(missing_ok=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"bench.device={name} but torch sees no CUDA device; use bench.device=cpu or auto.")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"bench.device={name!r} is not known: use auto, cpu or cuda.")
    return torch.device(name)


def file_options(name: str) -> dict:
    """configs/attn/<name>.yaml, less its name; {} for a variant without one."""
    path = CONFIGS / "attn" / f"{name}.yaml"
    opts = OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.is_file() else {}
    opts.pop("name", None)
    return opts


def variant_options(name: str, overrides: dict | None) -> dict:
    """The options a task would build ``name`` with: configs/attn/<name>.yaml, then ``bench.options.<name>``."""
    opts = file_options(name)
    opts.update({k: v for k, v in ((overrides or {}).get(name) or {}).items() if k != "name"})
    return opts


def baseline_options(name: str, overrides: dict | None) -> dict:
    """What ``bench.options.<baseline>`` sets for the baseline alone; the rest follows its variant's
    ``bench.options`` entry (``++bench.options.self.heads=2``: self and materialised)."""
    return {k: v for k, v in ((overrides or {}).get(name) or {}).items() if k != "name"}


def mixer_options(name: str, overrides: dict | None) -> dict:
    """The options ``name`` (a variant or a baseline) is built with."""
    if name in BASELINES:
        return {**variant_options(BASELINES[name][1], overrides), **baseline_options(name, overrides)}
    return variant_options(name, overrides)


def mixer_class(name: str) -> type:
    """The class of a registered variant or of a baseline (which declares its complexity as a variant does)."""
    return BASELINES[name][0] if name in BASELINES else attention.get(name)


def build_mixer(name: str, dim: int, overrides: dict | None = None, **extra):
    """A registered variant, or a baseline with the options of the variant it stands beside."""
    if name in BASELINES:
        return BASELINES[name][0](dim, **{**mixer_options(name, overrides), **extra})
    return attention.build(name, dim, **{**mixer_options(name, overrides), **extra})


# --------------------------------------------------------------------------------------------
# One forward + backward
# --------------------------------------------------------------------------------------------

class Case:
    """One mixer on x (B, N, C) and a layout of ``kind``, with an upstream gradient; ``call(x, layout)`` runs it
    (the mixer itself, or the mixer on fake parameters)."""

    def __init__(self, mixer, n: int, kind: str, batch: int, device, dtype: torch.dtype, call=None, fake=False):
        self.mixer, self.call = mixer, call or mixer
        self.device, self.dtype = torch.device(device), dtype
        gen = torch.Generator().manual_seed(0)
        c = mixer.dim
        if fake:  # inside a FakeTensorMode: shapes only
            self.x = torch.empty(batch, n, c, device=device).requires_grad_()
            self.grad = torch.empty(batch, n, c, device=device)
        else:
            self.x = torch.randn(batch, n, c, generator=gen).to(device).requires_grad_()
            self.grad = torch.randn(batch, n, c, generator=gen).to(device)
        layout = mixer.example_layout(n, batch, kind, gen)
        self.layout = Points(layout.xyz.to(device)) if isinstance(layout, Points) else layout

    def forward(self):
        # a fresh layout of the same points each step: a layout keeps the neighbour searches it was given
        # (attention.Points.memo, so that a network's layers share them), and one layer's step includes its search
        layout = Points(self.layout.xyz) if isinstance(self.layout, Points) else self.layout
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.call(self.x, layout)

    def backward(self, y):
        y.backward(self.grad.to(y.dtype))

    def clear(self):
        self.x.grad = None
        self.mixer.zero_grad(set_to_none=True)

    def fwd_bwd(self):
        self.backward(self.forward())

    def step(self):
        self.clear()
        self.fwd_bwd()

    def count(self) -> dict:
        """One step under the FLOP counter and :class:`~benchmarks.measure.OpCounter`."""
        self.clear()
        with measure.OpCounter() as ops:
            with FlopCounterMode(display=False) as fwd:
                y = self.forward()
            with FlopCounterMode(display=False) as bwd:
                self.backward(y)
            del y
        flops_fwd = int(fwd.get_total_flops())
        return {"flops_fwd": flops_fwd, "flops": flops_fwd + int(bwd.get_total_flops()),
                "bytes_moved": ops.bytes_moved, "peak": ops.peak}


def fake_count(mixer, n: int, kind: str, batch: int, device, dtype) -> dict | None:
    """:meth:`Case.count` on fake tensors: FLOPs, bytes moved and the peak of live op outputs, nothing computed.
    None where the mixer cannot run on fake tensors (an op whose output shape depends on data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    try:
        state = {k: mode.from_tensor(t) for k, t in [*mixer.named_parameters(), *mixer.named_buffers()]}
        for k, p in mixer.named_parameters():
            state[k].requires_grad_(p.requires_grad)
        with mode:
            case = Case(mixer, n, kind, batch, device, dtype, fake=True,
                        call=lambda x, layout: torch.func.functional_call(mixer, state, (x, layout)))
            return case.count()
    except Exception as err:  # noqa: BLE001 - any failure only means "no estimate"
        log.debug("no fake-tensor estimate for %s at N=%d: %s", mixer.name, n, err)
        return None


@dataclass
class Measured:
    """What the sizes measured so far of one (variant, layout, C, dtype) tell about the next."""

    ns: list = field(default_factory=list)
    times: list = field(default_factory=list)  # seconds
    peaks: list = field(default_factory=list)  # bytes
    fakes: list = field(default_factory=list)  # fake_count of each, or None
    first_slope: float = 2.0  # before two sizes are measured: the declared complexity's exponent (N^1 or N^2)

    def add(self, n, seconds, peak, fake):
        self.ns.append(n), self.times.append(seconds), self.peaks.append(peak), self.fakes.append(fake)

    def slope(self, values, floor):
        if len(self.ns) < 2:
            return self.first_slope  # one size measured: what the variant's class declares
        return max(floor, measure.fit_exponent(self.ns[-2:], values[-2:]))

    def estimate(self, n: int, fake: dict | None) -> tuple[float | None, float | None]:
        """(peak bytes, seconds) estimated for size n; None where nothing is known."""
        if fake is not None:
            calibrated = [(p / f["peak"]) for p, f in zip(self.peaks, self.fakes) if f and f["peak"]]
            peak = fake["peak"] * (1.2 * max(1.0, calibrated[-1]) if calibrated else 1.5)
        elif self.ns:
            peak = 1.25 * self.peaks[-1] * (n / self.ns[-1]) ** self.slope(self.peaks, 1.0)
        else:
            peak = None
        if not self.ns:
            return peak, None
        last = self.fakes[-1]
        if fake is not None and last and last["flops"] and last["bytes_moved"]:
            growth = max(fake["flops"] / last["flops"], fake["bytes_moved"] / last["bytes_moved"])
        else:
            growth = (n / self.ns[-1]) ** self.slope(self.times, 1.0)
        return peak, self.times[-1] * growth


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err)))


def measure_case(case: Case, warmup: int, repeats: int, min_seconds: float = 0.0) -> dict:
    """Counts (first warm-up step), median / min / max time and peak memory of one forward + backward."""
    counts = case.count()
    times = measure.step_times(case.step, case.device, max(0, warmup - 1), repeats, min_seconds)
    case.clear()
    peak = measure.peak_bytes(case.fwd_bwd, case.device)
    case.clear()
    return {**counts, "time": statistics.median(times), "time_min": min(times), "time_max": max(times),
            "measured_peak": peak}


def sweep(s: dict, device, max_bytes: float) -> list[dict]:
    """Every (dtype, C, layout, variant) over the sizes, ascending; one row per size."""
    rows = []
    names = [(v, "variant") for v in s["variants"]] + [(b, "baseline") for b in s["baselines"]]
    for dtype_name in s["dtypes"]:
        dtype = DTYPES[dtype_name]
        for c in s["channels"]:
            for kind in s["layouts"]:
                for name, role in names:
                    torch.manual_seed(0)
                    try:
                        mixer = build_mixer(name, c, s["options"]).to(device)
                    except UserError as err:
                        log.warning("bench: %s cannot be built at C=%d: %s", name, c, err)
                        continue
                    if kind not in mixer.layouts:
                        continue
                    rows += sweep_sizes(mixer, name, role, kind, c, dtype_name, dtype, s, device, max_bytes)
                    del mixer
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


def sweep_sizes(mixer, name, role, kind, c, dtype_name, dtype, s, device, max_bytes) -> list[dict]:
    rows, seen = [], Measured(first_slope=1.0 if type(mixer).complexity == "linear" else 2.0)
    for n in sorted(s["sizes"]):
        side = math.isqrt(n)
        row = {"variant": name, "kind": role, "layout": kind, "channels": c, "heads": mixer.heads, "n": n,
               "grid": f"{side}x{side}" if kind == "grid" else "", "batch": s["batch"], "dtype": dtype_name,
               "params": mixer.num_params(), "status": "ok", "note": ""}
        fake = fake_count(mixer, n, kind, s["batch"], device, dtype)
        est_peak, est_time = seen.estimate(n, fake)
        if fake:
            row.update(flops_fwd=fake["flops_fwd"], flops=fake["flops"], bytes_moved=fake["bytes_moved"])
        row["est_peak_mib"] = None if est_peak is None else est_peak / MiB
        if est_peak is not None and est_peak > max_bytes:
            row.update(status="skipped: memory",
                       note=f"estimated {est_peak / GiB:.2f} GiB > max_gb {max_bytes / GiB:.2f}")
        elif est_time is not None and est_time > s["max_seconds"]:
            row.update(status="skipped: time", note=f"estimated {est_time:.1f} s > max_seconds {s['max_seconds']}")
        else:
            try:
                case = Case(mixer, n, kind, s["batch"], device, dtype)
                got = measure_case(case, s["warmup"], s["repeats"], s["min_seconds"])
                del case
                row.update(flops_fwd=got["flops_fwd"], flops=got["flops"], bytes_moved=got["bytes_moved"],
                           time_ms=1e3 * got["time"], time_min_ms=1e3 * got["time_min"],
                           time_max_ms=1e3 * got["time_max"], peak_mib=got["measured_peak"] / MiB)
                seen.add(n, got["time"], got["measured_peak"], fake)
            except Exception as err:  # noqa: BLE001 - one failed size must not lose the rest of the run
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if is_oom(err):
                    row.update(status="failed: out of memory", note=str(err).splitlines()[0][:120])
                else:
                    log.error("bench: %s %s C=%d N=%d failed:\n%s", name, kind, c, n, traceback.format_exc())
                    row.update(status="failed: error", note=f"{type(err).__name__}: {str(err).splitlines()[0][:100]}")
        rows.append(row)
        log.info("%-14s %-6s C=%-4d N=%-6d %-9s %s", name, kind, c, n, dtype_name,
                 f"{row['time_ms']:10.2f} ms {row['peak_mib']:10.1f} MiB" if row["status"] == "ok"
                 else f"{row['status']} ({row['note']})")
    return rows


# --------------------------------------------------------------------------------------------
# Dilated against unfold at the point, and the machine's limits
# --------------------------------------------------------------------------------------------

def dilated_point(s: dict, device) -> list[dict]:
    """dilated vs the nn.Unfold baseline at (C, side x side, dilation): the two mixers and the two kernels alone
    (benchmarks/dilated.py's cases), B=1, float32."""
    from benchmarks.dilated import make_case

    t = s["targets"]["dilated"]
    c, side, heads, rate = t["channels"], t["side"], t["heads"], t["dilation"]
    rows = []
    opts = {"heads": heads, "dilations": [rate]}
    for impl, name in (("unfold", "unfold"), ("ours", "dilated")):
        torch.manual_seed(0)
        mixer = build_mixer(name, c, {}, **opts).to(device)
        case = Case(mixer, side * side, "grid", 1, device, torch.float32)
        got = measure_case(case, s["warmup"], s["repeats"], s["min_seconds"])
        rows.append({"level": "mixer", "impl": name, "time_ms": 1e3 * got["time"],
                     "peak_mib": got["measured_peak"] / MiB})
        step, tensors = make_case(impl, 1, heads, c // heads, side, side, 3, rate, device=str(device))
        ms = 1e3 * statistics.median(measure.step_times(step, device, s["warmup"], s["repeats"], s["min_seconds"]))
        for x in tensors[:3]:
            x.grad = None
        peak = measure.peak_bytes(step, device)
        rows.append({"level": "kernel", "impl": name, "time_ms": ms, "peak_mib": peak / MiB})
    for row in rows:
        row.update(channels=c, side=side, heads=heads, dilation=rate)
    return rows


def machine_limits(s: dict, device) -> dict:
    lim = s["limits"]
    side = lim["matmul"] * (4 if device.type == "cuda" else 1)
    out = {"matmul_side": side, "copy_mib": lim["copy_mb"],
           "bytes_per_s": measure.copy_bytes_per_s(device, lim["copy_mb"] * MiB, lim["repeats"])}
    for name in s["dtypes"]:
        out[f"flops_per_s_{name}"] = measure.matmul_flops_per_s(device, DTYPES[name], side, lim["repeats"])
    return out


# --------------------------------------------------------------------------------------------
# Analysis: exponents, roofline, targets
# --------------------------------------------------------------------------------------------

def groups(rows):
    """(variant, kind, layout, channels, dtype) -> rows of that series, by N."""
    out = {}
    for r in rows:
        out.setdefault((r["variant"], r["kind"], r["layout"], r["channels"], r["dtype"]), []).append(r)
    return out


def exponents(rows, fit_min_n: int = 0) -> list[dict]:
    out = []
    for (name, role, kind, c, dtype), series in groups(rows).items():
        ok = [r for r in series if r["status"] == "ok" and r["n"] >= fit_min_n]
        ns = [r["n"] for r in ok]
        out.append({"variant": name, "kind": role, "layout": kind, "channels": c, "dtype": dtype,
                    "params": series[0]["params"], "sizes": len(ok), "n_min": min(ns, default=None),
                    "n_max": max(ns, default=None),
                    "time_exponent": measure.fit_exponent(ns, [r["time_ms"] for r in ok]),
                    "memory_exponent": measure.fit_exponent(ns, [r["peak_mib"] for r in ok]),
                    # the asymptote: where a step's fixed cost (Python, dispatch, small-op overheads) weighs least
                    "time_exponent_top3": measure.fit_exponent(ns[-3:], [r["time_ms"] for r in ok[-3:]])
                    if len(ok) >= 3 else float("nan")})
    return out


def roofline(rows, limits) -> list[dict]:
    """Each series at its largest measured N against the machine: achieved FLOP/s and bytes/s, the bound that
    applies (arithmetic intensity against the machine balance) and the fraction of that bound reached."""
    out = []
    for (name, role, kind, c, dtype), series in groups(rows).items():
        ok = [r for r in series if r["status"] == "ok" and r.get("flops") is not None]
        if not ok:
            continue
        r = max(ok, key=lambda r: r["n"])
        seconds = r["time_ms"] / 1e3
        peak_flops, peak_bw = limits[f"flops_per_s_{dtype}"], limits["bytes_per_s"]
        flops_s, bytes_s = r["flops"] / seconds, r["bytes_moved"] / seconds
        intensity = r["flops"] / max(r["bytes_moved"], 1)
        bound = "compute" if intensity >= peak_flops / peak_bw else "memory"
        fraction = flops_s / peak_flops if bound == "compute" else bytes_s / peak_bw
        out.append({"variant": name, "kind": role, "layout": kind, "channels": c, "dtype": dtype, "n": r["n"],
                    "gflops_per_s": flops_s / 1e9, "gbytes_per_s": bytes_s / 1e9, "intensity": intensity,
                    "bound": bound, "fraction": fraction})
    return out


def _pass(ok: bool) -> str:
    return "pass" if ok else "miss"


def _find(rows, name, kind, n, c, dtype):
    for r in rows:
        if (r["variant"], r["layout"], r["n"], r["channels"], r["dtype"]) == (name, kind, n, c, dtype) \
                and r["status"] == "ok":
            return r
    return None


def targets(rows, exps, roof, dil, s) -> list[dict]:
    """The issue's targets, each with what was measured, the goal, pass/miss and the margin."""
    out = []
    dtype = s["dtypes"][0]
    goal_n, goal_c = s["targets"]["n"], s["targets"]["channels"]

    def speedup(name, goal):
        for kind in s["layouts"]:
            point = (goal_n, goal_c)
            fast, slow = _find(rows, name, kind, *point, dtype), _find(rows, "self", kind, *point, dtype)
            note = ""
            if not (fast and slow):  # fall back to the largest (N, C) both measured
                common = sorted({(r["n"], r["channels"]) for r in rows if r["variant"] == name and
                                 r["layout"] == kind and r["dtype"] == dtype and r["status"] == "ok"} &
                                {(r["n"], r["channels"]) for r in rows if r["variant"] == "self" and
                                 r["layout"] == kind and r["dtype"] == dtype and r["status"] == "ok"},
                                key=lambda p: (p[1], p[0]))
                if not common:
                    continue
                point = common[-1]
                fast, slow = _find(rows, name, kind, *point, dtype), _find(rows, "self", kind, *point, dtype)
                note = f"indicative: N={goal_n}, C={goal_c} not measured"
            ratio = slow["time_ms"] / fast["time_ms"]
            out.append({"target": f"{name} vs self, forward+backward time", "layout": kind,
                        "where": f"N={point[0]}, C={point[1]}, {dtype}", "measured": f"{ratio:.1f}x faster",
                        "goal": f">= {goal}x", "result": _pass(ratio >= goal),
                        "margin": f"{ratio / goal:.2f}x the goal", "note": note})

    for name, goal in (s["targets"].get("speedup") or {}).items():
        speedup(name, goal)

    def exponent(e, lo, hi):
        k = e["time_exponent"]
        if not math.isfinite(k):
            return
        if lo <= k <= hi:
            margin = f"{min(k - lo, hi - k):.2f} inside"
        else:
            margin = f"{lo - k:.2f} below" if k < lo else f"{k - hi:.2f} above"
        top = e["time_exponent_top3"]
        note = f"3 largest N: {top:.2f}" if math.isfinite(top) else "indicative: fewer than 3 sizes"
        out.append({"target": f"{e['variant']}: exponent of time in N", "layout": e["layout"],
                    "where": f"C={e['channels']}, N={e['n_min']}..{e['n_max']} ({e['sizes']} sizes), {e['dtype']}",
                    "measured": f"{k:.2f}", "goal": f"{lo} .. {hi}", "result": _pass(lo <= k <= hi),
                    "margin": margin, "note": note})

    # Each variant's claim is its class's ``complexity``: a linear one is held to N^1. A quadratic variant makes
    # no claim to test (its fused kernels may beat N^2 at these N); the reference N^2 is the baseline that
    # materialises the matrix.
    for e in exps:
        complexity = mixer_class(e["variant"]).complexity
        if (e["kind"], complexity) in (("variant", "linear"), ("baseline", "quadratic")):
            exponent(e, *EXPONENT_GOALS[complexity])

    if dil:
        by = {(r["level"], r["impl"]): r for r in dil}
        r0 = dil[0]
        where = f"C={r0['channels']} ({r0['heads']} heads), {r0['side']}x{r0['side']}, dilation {r0['dilation']}, B=1"
        for level in ("mixer", "kernel"):
            ours, theirs = by[(level, "dilated")], by[(level, "unfold")]
            mem, speed = ours["peak_mib"] / theirs["peak_mib"], theirs["time_ms"] / ours["time_ms"]
            out.append({"target": f"dilated vs unfold ({level}): peak memory", "layout": "grid", "where": where,
                        "measured": f"{mem:.3f} of unfold's", "goal": "<= 0.25", "result": _pass(mem <= 0.25),
                        "margin": f"{0.25 / mem:.2f}x the goal", "note": ""})
            out.append({"target": f"dilated vs unfold ({level}): time", "layout": "grid", "where": where,
                        "measured": f"{speed:.1f}x faster", "goal": ">= 3x", "result": _pass(speed >= 3),
                        "margin": f"{speed / 3:.2f}x the goal", "note": ""})

    for r in roof:
        if r["kind"] != "variant":
            continue
        out.append({"target": f"{r['variant']}: fraction of the machine's {r['bound']} bound", "layout": r["layout"],
                    "where": f"N={r['n']}, C={r['channels']}, {r['dtype']}", "measured": f"{100 * r['fraction']:.0f}%",
                    "goal": ">= 50%", "result": _pass(r["fraction"] >= 0.5),
                    "margin": f"{r['fraction'] / 0.5:.2f}x the goal", "note": ""})
    return out


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------

def _fmt(v, digits=2):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else "nan"
    return str(v)


def write_csv(path: Path, rows, columns) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


def plots(rows, exps, s, out_dir: Path, stem: str) -> list[Path]:
    """Log-log time and memory against N, one line per variant and subplot per (layout, C), per dtype;
    each legend entry carries the fitted exponent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:  # a tasks-only bench: nothing to plot
        return []
    exp = {(e["variant"], e["layout"], e["channels"], e["dtype"]): e for e in exps}
    paths = []
    names = s["variants"] + s["baselines"]
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    for dtype in s["dtypes"]:
        for metric, column, key, unit in (("time", "time_ms", "time_exponent", "forward + backward (ms)"),
                                           ("memory", "peak_mib", "memory_exponent", "peak memory (MiB)")):
            layouts, channels = s["layouts"], s["channels"]
            fig, axes = plt.subplots(len(layouts), len(channels), figsize=(5.5 * len(channels), 4.2 * len(layouts)),
                                     squeeze=False)
            for i, kind in enumerate(layouts):
                for j, c in enumerate(channels):
                    ax = axes[i][j]
                    for name in names:
                        ok = [r for r in rows if (r["variant"], r["layout"], r["channels"], r["dtype"]) ==
                              (name, kind, c, dtype) and r["status"] == "ok"]
                        if not ok:
                            continue
                        k = exp[(name, kind, c, dtype)][key]
                        ax.plot([r["n"] for r in ok], [r[column] for r in ok], marker="o", color=colours[name],
                                linestyle="--" if name in s["baselines"] else "-",
                                label=f"{name} (N^{k:.2f})" if math.isfinite(k) else name)
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_title(f"{kind}, C={c}, {dtype}")
                    ax.set_xlabel("tokens N")
                    ax.set_ylabel(unit)
                    ax.grid(True, which="both", alpha=0.3)
                    ax.legend(fontsize=7)
            fig.suptitle(f"{metric} against N (fitted exponent in the legend); dashed: baselines")
            fig.tight_layout()
            suffix = "" if len(s["dtypes"]) == 1 else f"-{dtype}"
            path = out_dir / f"{stem}{suffix}-{metric}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def _cell(r, column, digits):
    if r is None:
        return ""
    if r["status"] == "ok":
        return _fmt(r[column], digits)
    short = {"skipped: memory": "skip (mem)", "skipped: time": "skip (time)"}.get(r["status"], r["status"])
    est = r.get("est_peak_mib")
    return short + (f" ~{est / 1024:.1f} GiB" if r["status"] == "skipped: memory" and est else "")


def markdown(rows, exps, roof, tgts, dil, limits, info, s, tasks, plot_paths, command, max_bytes, pct=()) -> str:
    device = info["device"]
    machine = f"{info['cpu']}, {info['cores']} cores, {info['threads']} torch thread(s)"
    if info.get("gpu"):
        machine = f"{info['gpu']} (CUDA {info['cuda']}); host {machine}"
    lines = [
        f"# What each attention variant costs ({device})" if rows else f"# Training throughput per task ({device})", "",
        f"Generated by `{command}` on {info['date']}; do not edit by hand.", "",
        f"- machine: {machine}; {info['os']}",
        f"- libraries: {info['environment']}",
    ]
    if rows:  # the attention cases' method (a tasks-only bench, such as the deterministic one, has none)
        lines += [
            f"- each case: one mixer (options of `configs/attn/<name>.yaml`) on x of shape (B={s['batch']}, N, C) "
            f"and a layout (grid: a square image; points: uniform in the unit cube), forward + backward with an "
            f"upstream gradient; dtypes: {', '.join(s['dtypes'])}" + (" (bfloat16 = autocast, float32 weights)"
                                                                      if "bfloat16" in s["dtypes"] else ""),
            f"- time: median of at least {s['repeats']} device-synchronised steps (more, up to 200, until they add up "
            f"to {s['min_seconds']} s) after {s['warmup']} warm-up step(s)",
            f"- peak memory: {measure.PEAK_METHOD['cuda' if device.startswith('cuda') else 'cpu']}",
            "- FLOPs: `torch.utils.flop_counter` over forward + backward (a multiply-add is 2 FLOPs); bytes moved: the "
            "inputs and outputs of every aten op that is not a view (no cache reuse between ops; a custom op such as "
            "the dilated kernel counts as one fused op)",
            f"- skipped: sizes whose peak memory, estimated beforehand on fake tensors (or extrapolated from the "
            f"smaller sizes), exceeds {max_bytes / GiB:.2f} GiB (`bench.max_gb`), or whose estimated step exceeds "
            f"{s['max_seconds']} s (`bench.max_seconds`)",
            "- scaling exponent: least-squares slope of log time (log memory) against log N over the measured sizes"
            + (f" with N >= {s['fit_min_n']}" if s.get("fit_min_n") else ""),
            "- baselines: `materialised` = `self`'s mixer computing softmax(QK^T)V with the N x N matrix in memory; "
            "`unfold` = `dilated`'s mixer with DilateFormer's `nn.Unfold` kernel (grids only)",
        ]
    lines += ["", "## Machine limits (measured in the same run)", ""]
    lim_rows = [[f"{d} matrix product {limits['matmul_side']}^2", f"{limits[f'flops_per_s_{d}'] / 1e9:.1f} GFLOP/s"]
                for d in s["dtypes"]]
    lim_rows.append([f"copy of {limits['copy_mib']} MiB (read + write)", f"{limits['bytes_per_s'] / 1e9:.1f} GB/s"])
    lim_rows += [[f"machine balance ({d})", f"{limits[f'flops_per_s_{d}'] / limits['bytes_per_s']:.1f} FLOP/byte"]
                 for d in s["dtypes"]]
    lines += _table(["limit", "value"], lim_rows)
    if rows:
        lines += _attention_sections(rows, exps, roof, tgts, dil, s, plot_paths)
    if tasks:
        lines += ["", "## Training throughput per task", "",
                  "One short epoch of generated data (the task's demo recipe), data loading included; the first "
                  "batches are warm-up. Attention share: time inside the attention modules' forward and backward "
                  "(module hooks) over the measured steps' time.", ""]
        if s.get("task_deterministic"):
            lines += ["Each task twice: `trainer.deterministic` off, then on (`bench.task_deterministic=true`); the "
                      "last column is the deterministic run's samples/s over the other's.", ""]
        speed = {(t["task"], t["attn"], t.get("deterministic")): t["samples_per_s"] for t in tasks}
        lines += _table(["task", "attn", "recipe", "deterministic", "batches", "samples/s", "step ms",
                         "attention share", "status", "deterministic / not"],
                        [[t["task"], t["attn"], t["recipe"], "yes" if t.get("deterministic") else "no", t["batches"],
                          f"{t['samples_per_s']:.1f}", f"{t['step_ms']:.1f}", f"{100 * t['attention_share']:.0f}%",
                          t["status"], f"{t['samples_per_s'] / speed[(t['task'], t['attn'], False)]:.2f}x"
                          if t.get("deterministic") and (t["task"], t["attn"], False) in speed else ""]
                         for t in tasks])
    if pct:
        lines += ["", "## PCT against its channel-first formulation", "",
                  "The task's network (`attn=offset`, `bench.task_pct_overrides`) and the channel-first formulation it "
                  "replaces (`benchmarks.baselines.channel_first`: 1x1 `Conv1d` + `BatchNorm1d` on (B, C, N), the same "
                  "weights), training steps on one batch of the task's data (forward, the task's loss, backward, SGD "
                  "with momentum 0.9), alternating; speed-up = median over rounds of channel-first time / suite time. "
                  "Compiled (`bench.task_compile=true`): both under `torch.compile`, steady steps; compile time = "
                  "first step - median step. `python -m benchmarks.pct` has the full comparison "
                  "(`benchmarks/pct.md`).", ""]
        lines += _table(["task", "batch", "points", "form", "channel-first samples/s", "suite samples/s", "speed-up",
                         "of minima", "compile s (channel-first / suite)", "status"],
                        [[p["task"], p["batch"], p["points"], p["form"], f"{p['reference_samples_per_s']:.2f}",
                          f"{p['suite_samples_per_s']:.2f}", f"{p['speedup']:.2f}x", f"{p['speedup_of_minima']:.2f}x",
                          f"{p['compile_s_reference']:.0f} / {p['compile_s_suite']:.0f}"
                          if p["compile_s_suite"] is not None else "", p["status"]] for p in pct])
    return "\n".join(lines) + "\n"


def _attention_sections(rows, exps, roof, tgts, dil, s, plot_paths) -> list[str]:
    """The markdown sections of the attention cases: targets, exponents, roofline, plots, time and memory."""
    lines = ["", "## Targets", ""]
    lines += _table(["target", "layout", "where", "measured", "goal", "result", "margin", "note"],
                    [[t["target"], t["layout"], t["where"], t["measured"], t["goal"], f"**{t['result']}**",
                      t["margin"], t["note"]] for t in tgts])
    if dil:
        lines += ["", "Dilated against unfold at the target point (float32):", ""]
        lines += _table(["level", "impl", "time ms", "peak MiB"],
                        [[r["level"], r["impl"], f"{r['time_ms']:.2f}", f"{r['peak_mib']:.2f}"] for r in dil])
    lines += ["", "## Scaling exponents", "",
              "Time ~ N^k and peak memory ~ N^m, fitted over the sizes each series measured; k over its three "
              "largest N shows the asymptote, where a step's fixed cost weighs least.", ""]
    lines += _table(["variant", "layout", "C", "dtype", "params", "sizes", "k (time)", "k (3 largest N)",
                     "m (memory)"],
                    [[e["variant"] + (" (baseline)" if e["kind"] == "baseline" else ""), e["layout"], e["channels"],
                      e["dtype"], f"{e['params']:,}", e["sizes"], _fmt(e["time_exponent"]),
                      _fmt(e["time_exponent_top3"]), _fmt(e["memory_exponent"])] for e in exps])
    lines += ["", "## Against the machine's limits, at each series' largest measured N", ""]
    lines += _table(["variant", "layout", "C", "dtype", "N", "GFLOP/s", "GB/s", "FLOP/byte", "bound",
                     "fraction of bound"],
                    [[r["variant"], r["layout"], r["channels"], r["dtype"], r["n"], f"{r['gflops_per_s']:.1f}",
                      f"{r['gbytes_per_s']:.1f}", f"{r['intensity']:.1f}", r["bound"], f"{100 * r['fraction']:.0f}%"]
                     for r in roof])
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plot_paths]
    sizes = sorted(s["sizes"])
    for title, column, digits in (("Time, forward + backward (ms)", "time_ms", 2),
                                  ("Peak memory (MiB)", "peak_mib", 1)):
        lines += ["", f"## {title}", ""]
        body = []
        for (name, role, kind, c, dtype), series in groups(rows).items():
            by_n = {r["n"]: r for r in series}
            body.append([name + (" (baseline)" if role == "baseline" else ""), kind, c, dtype]
                        + [_cell(by_n.get(n), column, digits) for n in sizes])
        lines += _table(["variant", "layout", "C", "dtype"] + [f"N={n}" for n in sizes], body)
    return lines


def log_wandb(loggers, rows, exps, tgts, tasks, plot_paths, pct=()) -> None:
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            continue
        logger.log_table(key="bench/results", columns=COLUMNS, data=[[r.get(k) for k in COLUMNS] for r in rows])
        cols = list(exps[0]) if exps else []
        logger.log_table(key="bench/exponents", columns=cols, data=[[e[k] for k in cols] for e in exps])
        if tgts:
            cols = list(tgts[0])
            logger.log_table(key="bench/targets", columns=cols, data=[[t[k] for k in cols] for t in tgts])
        if tasks:
            cols = list(tasks[0])
            logger.log_table(key="bench/tasks", columns=cols, data=[[t[k] for k in cols] for t in tasks])
        if pct:
            cols = list(pct[0])
            logger.log_table(key="bench/pct", columns=cols, data=[[p[k] for k in cols] for p in pct])
        logger.log_image(key="bench/plots", images=[str(p) for p in plot_paths], caption=[p.stem for p in plot_paths])


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def bench(cfg: DictConfig) -> dict:
    """``run.py mode=bench``: measure, analyse, write the table, CSV, JSON and plots, log them."""
    from hydra.core.hydra_config import HydraConfig

    from suite.loggers import build_loggers, close_loggers

    started = time.perf_counter()
    overrides = HydraConfig.get().overrides.task
    s = settings(cfg, given_paths(overrides))
    device = pick_device(s["device"])
    stem = f"{s['name']}-{device.type}"
    check_table_dir(s, stem)
    if s["threads"]:
        torch.set_num_threads(int(s["threads"]))
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_bytes = s["max_gb"] * GiB if s["max_gb"] is not None else 0.5 * measure.available_bytes(device)
    info = measure.machine_info(device)
    log.info("bench on %s (%s), %d thread(s); budget %.2f GiB, %s s per step; output %s", device, info["cpu"],
             info["threads"], max_bytes / GiB, s["max_seconds"], out_dir)

    limits = machine_limits(s, device)
    log.info("machine limits: %s", ", ".join(f"{k}={v:.3g}" for k, v in limits.items()))
    rows = sweep(s, device, max_bytes)
    dil = dilated_point(s, device) if "dilated" in s["variants"] else []
    exps = exponents(rows, s.get("fit_min_n") or 0)
    roof = roofline(rows, limits)
    tgts = targets(rows, exps, roof, dil, s)
    task_rows = []
    if s["tasks"]:
        from benchmarks.throughput import task_throughput

        task_rows = task_throughput(s, device)
    pct_rows = []
    if s["tasks"] and s.get("task_pct"):
        from benchmarks.throughput import pct_throughput

        pct_rows = pct_throughput(s, device)

    write_csv(out_dir / f"{stem}.csv", rows, COLUMNS)
    plot_paths = plots(rows, exps, s, out_dir, stem)
    command = " ".join(["python run.py", *(a for a in overrides if not a.startswith("hydra."))])
    (out_dir / f"{stem}.md").write_text(markdown(rows, exps, roof, tgts, dil, limits, info, s, task_rows,
                                                 plot_paths, command, max_bytes, pct_rows))
    summary = {"machine": info, "settings": s, "limits": limits, "exponents": exps, "roofline": roof,
               "targets": tgts, "dilated": dil, "tasks": task_rows, "pct": pct_rows,
               "seconds": time.perf_counter() - started, "plots": [p.name for p in plot_paths]}
    (out_dir / f"{stem}.json").write_text(json.dumps(strict(summary), indent=2, default=str) + "\n")  # NaN: null
    written = [out_dir / f"{stem}.{ext}" for ext in ("md", "csv", "json")] + plot_paths
    if (folder := table_dir(s)) is not None:
        folder.mkdir(parents=True, exist_ok=True)
        clear_earlier_plots(folder, stem)
        for path in written:
            shutil.copyfile(path, folder / path.name)
        log.info("copied %s to %s", ", ".join(p.name for p in written), folder)

    logger_cfg = OmegaConf.to_container(cfg.logger, resolve=True)
    if logger_cfg.get("name") == "wandb":
        logger_cfg.update(run_name=f"bench-{device.type}", group="bench", tags=["mode:bench", f"device:{device.type}"])
    loggers = build_loggers(logger_cfg, out_dir, {"bench": s, "machine": info})
    log_wandb(loggers, rows, exps, tgts, task_rows, plot_paths, pct_rows)
    close_loggers(loggers)

    print("\nscaling exponents (time ~ N^k, memory ~ N^m):")
    for e in exps:
        print(f"  {e['variant']:14s} {e['layout']:6s} C={e['channels']:<4d} {e['dtype']:9s} "
              f"k={_fmt(e['time_exponent'])} m={_fmt(e['memory_exponent'])} ({e['sizes']} sizes)")
    print("targets:")
    for t in tgts:
        print(f"  {t['result']:4s} {t['target']} [{t['layout']}, {t['where']}]: {t['measured']} (goal {t['goal']}, "
              f"{t['margin']}){' - ' + t['note'] if t['note'] else ''}")
    print(f"bench written to {out_dir / (stem + '.md')} ({time.perf_counter() - started:.0f} s)")
    return summary
