"""``python run.py mode=report report.runs=<dir>[,<dir>...]``: finished runs turned into a comparison.

Reads every run folder under the given Hydra run or multirun folders (``metrics.json`` + ``resolved_config.yaml``,
as ``run.py`` writes them), or W&B runs (``report.wandb=<entity>/<project>[/<sweep id>]``), and writes
``report.md``, ``report.csv``, ``metrics.csv``, ``report.json`` and plots to ``report.out`` (default
``<first runs folder>/report``). Nothing is trained. User documentation: ``docs/report.md``.

Top to bottom:

1. statistics: pure functions of lists of numbers (:func:`describe`, :func:`compare`, :func:`pareto_front`);
2. reading runs from folders or W&B, with every run that cannot be used kept, with its reason (:class:`LeftOut`);
3. grouping: runs agree on task, data, protocol and every config key that varies across them, except the seed;
4. rows: aggregates, the comparison with the baseline, cost and protocol per group;
5. output files and plots; 6. :func:`report`, the entry point.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import sys
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
import yaml

from attention.errors import UserError
from suite import strict_json
from suite.run_dirs import in_use
from suite.run_record import RECORD_KEYS, RESOLVED_KEY, data_name, protocol as derive_protocol, read_metrics

log = logging.getLogger(__name__)

NATIVE_BASELINE = {"modelnet": "offset", "shapenet": "offset"}  # PCT's own attention; every other task: self
COST_KEYS = ("params", "flops", "train_samples_per_sec", "peak_memory_bytes", "wall_time_s")
# What suite.callbacks.TrainThroughput logs (when a logger was on); then the key of Lightning's ThroughputMonitor,
# which runs logged before the suite had its own meter
THROUGHPUT_HISTORY_KEYS = ("train/samples_per_sec", "train/device/samples_per_sec")
TOO_FEW = 3  # fewer seeds than this on either side: flagged, not concluded
# Config keys that never split groups: the seed (and anything equal to it), where files live, what is logged or
# shown while a run trains, how many processes read its data, and the suite's own throughput meter (a callback a
# run adds, such as stochastic weight averaging, does split them).
IGNORED_KEYS = {"seed", "data_dir", "ckpt_path", "resume", "overwrite", "metrics.inception_weights",
                "eval.save_samples", "trainer.enable_progress_bar", "trainer.enable_model_summary",
                "trainer.log_every_n_steps", "data.num_workers"}
IGNORED_PREFIXES = ("logger.", "callbacks.throughput.", "bench.", "report.", "hydra.")
IGNORED_SUFFIXES = ("_dir", ".root")
# Options added after runs were recorded, each with the value under which today's code computes what the code before
# the option did (checked against the commit that added it): a record without the key, shown `<unset>`, is read
# with that value, so that it shares a row with the runs that have it. Not the options whose default changed what a
# run computes: `callbacks.validate_at_end` (f39896b, 3b4d2c8) validates the last step, which runs before it never
# did, so its records stay `<unset>`, in rows of their own; nor an option whose old behaviour cannot be told.
ADDED_OPTIONS = {
    "trainer.tf32": None,  # 1303ac7: null leaves torch's TF32 switches, which no code set before it
}
# The weights files a run starts from, compared by file name: a run fine-tuned from published weights is not a run
# from scratch, while the same file lies under another path on another machine.
WEIGHTS_KEYS = {"model.weights", "model.g_weights", "model.d_weights", "model.g_ema_weights"}
NOT_TRAINING = ("summary", "bench", "report")  # run folders of these modes hold no results
SECTIONS = ("task", "data", "attn", "model", "monitor", "trainer", "optim")  # mappings in every run's config
PRUNE = {"wandb", "checkpoints", ".submitit", "csv", "wandb_fallback", "samples", ".hydra"}
# The metrics that are fractions in [0, 1], by the last part of their key (``test/oa``, ``val/oa_best``): accuracies,
# IoUs (with the per-category ``test/iou/<category>``), F1, precision and recall. A run holding one outside [0, 1]
# (a percentage, a hand-edited or corrupt file) is left out, named, rather than averaged as an accuracy.
FRACTIONS = ("oa", "macc", "imiou", "cmiou", "miou", "pixel_acc", "aa", "f1", "top1", "top5", "precision", "recall")


# --- 1. statistics -------------------------------------------------------------------------------------------------
def t_quantile(confidence: float, df: float) -> float:
    from scipy import stats

    return float(stats.t.ppf((1 + confidence) / 2, df))


def describe(values, higher_is_better: bool | None = True, confidence: float = 0.95) -> dict:
    """n, mean, standard deviation (ddof=1), Student-t confidence interval of the mean, min, max and best of n (NaN
    for a metric with no better direction, ``higher_is_better=None``).

    With one value the spread and the interval are NaN: one run says nothing about seed-to-seed variation."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    mean = float(x.mean())
    std = float(x.std(ddof=1)) if n > 1 else math.nan
    half = t_quantile(confidence, n - 1) * std / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half,
            "min": float(x.min()), "max": float(x.max()), "best_of_n": math.nan if higher_is_better is None
            else float(x.max() if higher_is_better else x.min())}


def compare(variant: list[tuple], baseline: list[tuple], confidence: float = 0.95) -> dict:
    """Difference of means (variant - baseline), its confidence interval and a t-test.

    ``variant`` and ``baseline`` are lists of (seed, value). When both hold the same seeds, once each, the runs are
    paired by seed (paired t-test on the differences); otherwise Welch's unequal-variance t-test. Fewer than
    ``TOO_FEW`` runs on either side are flagged as too few to conclude; values (or paired differences) without
    spread get no test."""
    from scipy import stats

    a = np.array([v for _, v in variant], dtype=float)
    b = np.array([v for _, v in baseline], dtype=float)
    seeds_a, seeds_b = [s for s, _ in variant], [s for s, _ in baseline]
    paired = (len(set(seeds_a)) == len(a) >= 2 and len(set(seeds_b)) == len(b) and set(seeds_a) == set(seeds_b))
    out = {"diff": float(a.mean() - b.mean()), "ci_low": math.nan, "ci_high": math.nan, "test": "none",
           "p_value": math.nan, "df": math.nan, "n_variant": len(a), "n_baseline": len(b)}
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # identical values: scipy's precision warning, p is NaN
        if paired:
            order = sorted(seeds_a, key=repr)
            x = np.array([dict(variant)[s] for s in order], dtype=float)
            y = np.array([dict(baseline)[s] for s in order], dtype=float)
            d = x - y
            se, df = d.std(ddof=1) / math.sqrt(len(d)), len(d) - 1
            out.update(test="paired t", df=float(df), p_value=float(stats.ttest_rel(x, y).pvalue))
        elif len(a) >= 2 and len(b) >= 2:
            va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
            se = math.sqrt(va + vb)
            df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else math.nan
            out.update(test="Welch t", df=float(df),
                       p_value=float(stats.ttest_ind(a, b, equal_var=False).pvalue))
        else:
            se = math.nan
        # no spread (to rounding: 0.7 - 0.6 is not 0.8 - 0.7 in floats): scipy's t is infinite or 0/0, its p void
        flat = out["test"] != "none" and not se > 1e-12 * max(np.abs(a).max(), np.abs(b).max(), 1e-300)
        if flat:
            out.update(test="none", p_value=math.nan, df=math.nan)
        if out["test"] != "none" and math.isfinite(out["df"]):
            half = t_quantile(confidence, out["df"]) * se
            out.update(ci_low=out["diff"] - half, ci_high=out["diff"] + half)
    if min(len(a), len(b)) < TOO_FEW:
        out["note"] = f"n < {TOO_FEW}: too few runs to conclude"
    elif flat:
        out["note"] = "no spread over the seeds: no test"
    else:
        out["note"] = verdict(out["p_value"], 1 - confidence)
    return out


def verdict(p: float, alpha: float, adjusted: str = "") -> str:
    """A comparison's note from its p-value (``adjusted``: the correction that gave it, named in the note)."""
    if math.isfinite(p) and p < alpha:
        return f"differs ({adjusted + ' ' if adjusted else ''}p < {alpha:.2g})"
    return "no significant difference"


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (NaN: no test, not counted in the family): the
    k-th smallest of m p-values times m - k + 1, made non-decreasing in that order, at most 1. Rejecting where the
    adjusted p < alpha keeps the chance of any false "differs" in the family at most alpha."""
    ranked = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    out, running = [math.nan] * len(p_values), 0.0
    for k, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - k) * p))
        out[i] = running
    return out


def pareto_front(xs, ys, x_lower_is_better: bool = True, y_higher_is_better: bool = True) -> list[int]:
    """Indices of the points no other point beats on both axes (at least as good on both, better on one), by x."""
    def better_eq(i, j):  # i at least as good as j on both axes
        x_ok = xs[i] <= xs[j] if x_lower_is_better else xs[i] >= xs[j]
        y_ok = ys[i] >= ys[j] if y_higher_is_better else ys[i] <= ys[j]
        return x_ok and y_ok

    valid = [i for i in range(len(xs)) if math.isfinite(xs[i]) and math.isfinite(ys[i])]
    front = [j for j in valid
             if not any(better_eq(i, j) and (xs[i], ys[i]) != (xs[j], ys[j]) for i in valid if i != j)]
    return sorted(front, key=lambda i: xs[i])


#: Logged values that are neither better higher nor lower: the learning rate (Lightning's ``lr-SGD``), a spread
#: over splits (``is_std``, ``kid_std``), the discriminator's mean outputs, the counters. Their best of n was the
#: largest, as if a larger learning rate were a better result.
UNDIRECTED = re.compile(r"(lr|lr-.*|.*_std|d_real|d_fake|epoch|step)")


def higher_is_better(metric: str, config: dict) -> bool | None:
    """Whether ``metric`` (``test/kid``, ``val/oa_best``) improves upwards in a run of ``config``: the monitored
    metric's direction, else the one its task declares for the metric on the validation split
    (``Task.validation_metrics``: KID and FID are distances), else None for one with no better direction
    (:data:`UNDIRECTED`), lower for a loss (``loss``, ``loss_epoch``, ``loss_d``, ``aux_loss``) and higher for
    the rest."""
    tail = metric.split("/", 1)[-1].removesuffix("_best")
    monitor = config.get("monitor") or {}
    if tail == str(monitor.get("metric", "")).split("/", 1)[-1]:
        return monitor.get("mode", "max") == "max"
    declared = {name.split("/", 1)[-1]: way for name, way in task_directions(config).items()}
    if tail in declared:
        return declared[tail] == "max"
    if UNDIRECTED.fullmatch(tail):
        return None
    return not ("loss" in tail.split("_") or tail in ("fid", "kid"))


def task_directions(config: dict) -> dict[str, str]:
    """The validation metrics a run's task declares, with their directions; empty when its class cannot be imported
    (a run of another version) or its config is not what the task reads."""
    from hydra.utils import get_class

    try:
        return dict(get_class(str((config.get("task") or {}).get("_target_"))).validation_metrics(config))
    except Exception:  # noqa: BLE001 - a task that says nothing leaves the names to decide
        return {}


# --- 2. reading runs -----------------------------------------------------------------------------------------------
@dataclass
class Run:
    path: str                      # folder, or wandb:<entity>/<project>/<id>
    config: dict                   # the resolved config
    metrics: dict[str, float]      # every numeric entry of metrics.json but the cost
    cost: dict[str, float]         # COST_KEYS present
    protocol: dict
    protocol_recorded: bool = True  # False: derived from the config (runs from before protocols were recorded)
    history: object = None          # a metrics.csv path, or a W&B run (scan_history)
    provenance: dict | None = None  # code, torch, device (suite.run_record.provenance); None: not recorded
    trained_seed: object = None     # a test's (mode=test/eval): its checkpoint's run's seed (metrics.json tested)

    @property
    def seed(self):
        """The seed the tested network was trained with: a test's own ``seed`` is its command's."""
        return self.trained_seed if self.trained_seed is not None else self.config.get("seed")

    @property
    def task(self) -> str:
        return str((self.config.get("task") or {}).get("name"))


@dataclass
class LeftOut:
    path: str
    reason: str


def find_run_dirs(root: Path) -> list[Path]:
    """Run folders under ``root`` (itself included): those holding ``metrics.json``, ``resolved_config.yaml`` or
    Hydra's ``.hydra/``. A run's own subfolders (checkpoints, wandb, csv) are not searched."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if "metrics.json" in filenames or "resolved_config.yaml" in filenames or ".hydra" in dirnames:
            found.append(Path(dirpath))
            dirnames[:] = []
        else:
            dirnames[:] = sorted(d for d in dirnames if d not in PRUNE)
    return sorted(found)


def numbers(mapping: dict) -> dict[str, float]:
    return {k: float(v) for k, v in mapping.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def is_fraction(key: str) -> bool:
    """Whether metric ``key`` is a fraction in [0, 1] (:data:`FRACTIONS`)."""
    parts = key.split("/")
    return parts[-1].removesuffix("_best") in FRACTIONS or (len(parts) > 2 and parts[-2] == "iou")


def out_of_range(metrics: dict[str, float]) -> str | None:
    """The reason to leave out a run whose fractions (:func:`is_fraction`) are not in [0, 1], naming them."""
    bad = [f"{k}={v:g}" for k, v in sorted(metrics.items()) if is_fraction(k) and math.isfinite(v)
           and not 0.0 <= v <= 1.0]
    if not bad:
        return None
    return (f"{', '.join(bad)} outside [0, 1], where accuracies and IoUs are: not a fraction (a percentage, a "
            "hand-edited or corrupt record); fix or remove the record")


def split_record(values: dict[str, float]) -> tuple[dict, dict]:
    """(metrics, cost): the run record's other numbers (compile time and graphs) are neither."""
    return ({k: v for k, v in values.items() if k not in COST_KEYS and k not in RECORD_KEYS},
            {k: v for k, v in values.items() if k in COST_KEYS})


def recorded_provenance(record: dict) -> dict | None:
    """A run's ``provenance`` (metrics.json, or the W&B config), None where it was not recorded or is malformed."""
    value = record.get("provenance")
    if not isinstance(value, dict) or not isinstance(value.get("code"), list):
        return None
    return value


TESTS = ("test", "eval")  # the modes that test a checkpoint (eval: the GAN task's name for it)


def trained_config(command: dict, tested) -> dict | str:
    """The config a test's results are grouped by: for a ``mode=test``/``eval`` run of a checkpoint, that of the
    run that trained it (``tested.config`` of its record, else, for records from before it was recorded, the
    ``resolved_config.yaml`` beside ``ckpt_path`` now), with the test command's mode and the model, task and data
    options it changed (``suite.checkpoints.changed_options``: another network, an experiment of its own); its
    evaluation options are its protocol's. A test command composes its own defaults (``trainer.max_epochs``,
    ``optim``): grouped by them, a 1-epoch checkpoint's test was averaged with 100-epoch ones'. Any other run,
    and a test of published weights (``model.weights``, no checkpoint): its own config. A string: why the
    training run's config cannot be found."""
    from suite.checkpoints import changed_options, run_config_of

    ckpt = command.get("ckpt_path")
    if command.get("mode") not in TESTS or not (ckpt or tested):
        return command
    trained = tested.get("config") if isinstance(tested, dict) else None
    if not isinstance(trained, dict) and ckpt and (saved := run_config_of(str(ckpt))) is not None:
        try:
            trained = yaml.safe_load(saved.read_text())
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            trained = None
    if not isinstance(trained, dict):
        return (f"a mode={command['mode']} record of ckpt_path={ckpt} without the config its checkpoint was "
                "trained with (not recorded as tested.config, which runs of this version record, nor a "
                "resolved_config.yaml beside the checkpoint now): how its network was trained is unknown, so it "
                "has no row. Put the training run's folder back where the checkpoint was, or test it again "
                "with this version")
    config = json.loads(json.dumps(trained))  # a copy: the overrides below are this record's
    config["mode"] = command["mode"]
    for key, (_, now) in changed_options(trained, command).items():
        *parents, last = key.split(".")
        section = config
        for part in parents:  # mappings in both configs: changed_options compares their leaves
            section = section[part]
        section[last] = now
    return config


def as_run(where: str, command: dict, tested, metrics: dict, cost: dict, proto: dict, recorded: bool, history,
           provenance: dict | None, source: str) -> Run | LeftOut:
    """A record read from a folder or W&B as a :class:`Run` grouped by :func:`trained_config`, or left out when
    that config is unknown or its seed is not one value (``source``: where the seed was read)."""
    config = trained_config(command, tested)
    if isinstance(config, str):
        return LeftOut(where, config)
    trained_seed = tested.get("seed") if isinstance(tested, dict) and command.get("mode") in TESTS else None
    run = Run(where, config, metrics, cost, proto, recorded, history, provenance, trained_seed)
    if isinstance(run.seed, bool) or not isinstance(run.seed, (int, str, type(None))):
        return LeftOut(where, f"seed {json.dumps(run.seed)} ({source}) is not one integer, as `python run.py "
                              "seed=<n>` records it (a hand-edited or corrupt record): a row counts its runs by "
                              "seed; fix or remove the record")
    return run


def read_run_dir(folder: Path) -> Run | LeftOut | None:
    """One run folder as a :class:`Run`, a :class:`LeftOut` saying why it cannot be used, or None for the folder
    of a ``mode=summary|bench|report`` run (no results by design)."""
    resolved, hydra_config, metrics_file = (folder / "resolved_config.yaml", folder / ".hydra" / "config.yaml",
                                            folder / "metrics.json")
    config = None
    for candidate in (resolved, hydra_config):
        if candidate.is_file():
            try:
                config = yaml.safe_load(candidate.read_text())
            except (yaml.YAMLError, OSError, UnicodeDecodeError) as err:
                return LeftOut(str(folder), f"unreadable {candidate.name} ({type(err).__name__})")
            break
    if isinstance(config, dict) and config.get("mode") in NOT_TRAINING:
        return None
    # The lock before the record: a finished run resumed for longer holds it, with its new resolved_config.yaml,
    # while its earlier part's metrics.json stays until its first training batch (suite/resume.py).
    if in_use(folder):
        return LeftOut(str(folder), "still running (" + (
            "its metrics.json is an earlier part's, replaced when it ends" if metrics_file.is_file()
            else "no metrics.json yet") + "; its process holds .run.lock)")
    if not metrics_file.is_file():
        return LeftOut(str(folder), "no metrics.json (the run crashed or was stopped: no process holds its .run.lock)")
    try:
        data = read_metrics(metrics_file)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        return LeftOut(str(folder), f"corrupt metrics.json ({str(err).splitlines()[0] if str(err) else err!r})")
    if not resolved.is_file() or not isinstance(config, dict):
        return LeftOut(str(folder), "no resolved_config.yaml (not a run.py run folder)")
    if wrong := [k for k in SECTIONS if k in config and not isinstance(config[k], (dict, type(None)))]:
        return LeftOut(str(folder), f"resolved_config.yaml's {', '.join(wrong)} not a mapping, as run.py writes it "
                                    "(a hand-edited or foreign file): fix or remove it")
    metrics, cost = split_record(numbers(data))
    if (wrong := out_of_range(metrics)) is not None:
        return LeftOut(str(folder), f"metrics.json ({metrics_file}) holds {wrong}")
    recorded = isinstance(data.get("protocol"), dict)
    if recorded:
        proto = data["protocol"]
    else:  # before runs recorded it: run.py tested the best checkpoint when there was one
        best = sorted((folder / "checkpoints").glob("best-*.ckpt")) if config.get("mode", "train") == "train" else []
        proto = derive_protocol(config, str(best[-1]) if best else None)
    history = next((p for p in (folder / "csv" / "metrics.csv", folder / "wandb_fallback" / "metrics.csv")
                    if p.is_file()), None)
    return as_run(str(folder), config, data.get("tested"), metrics, cost, proto, recorded, history,
                  recorded_provenance(data), f"{metrics_file} or {resolved}")


def progress(items, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="run", file=sys.stderr, mininterval=0.5, disable=len(items) < 2)


def read_folders(roots: list[Path]) -> tuple[list[Run], list[LeftOut], int]:
    """Every run under ``roots``: (runs, left out, folders of non-training modes skipped)."""
    runs, left_out, skipped = [], [], 0
    for root in roots:
        if not root.is_dir():
            raise UserError(f"report.runs: {root} is not a folder. Pass the Hydra run or multirun folders of "
                            "finished runs, e.g. `report.runs=multirun/2026-11-23_10-00-00,outputs/modelnet`.")
    # Each folder once: roots that overlap (`report.runs=multirun,multirun/<time>`) read its runs twice, and each
    # then counted as two seeds.
    folders, seen = [], set()
    for folder in (d for root in roots for d in find_run_dirs(root)):
        if folder.resolve() not in seen:
            seen.add(folder.resolve())
            folders.append(folder)
    for folder in progress(folders, "reading runs"):
        result = read_run_dir(folder)
        if result is None:
            skipped += 1
        elif isinstance(result, LeftOut):
            left_out.append(result)
        else:
            runs.append(result)
    if not runs and not left_out:
        raise UserError(f"no runs under {', '.join(map(str, roots))}: expected run folders holding metrics.json and "
                        "resolved_config.yaml, as `python run.py ...` writes them (outputs/<task>/<attn>/<time>/) "
                        "or `python run.py -m ...` (multirun/<time>/<n>_<task>_<attn>/). Pass such folders to "
                        "report.runs.")
    return runs, left_out, skipped


def read_wandb(path: str, api=None) -> tuple[list[Run], list[LeftOut], int]:
    """Runs of a W&B project or sweep through the public API (online): config, summary, history."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) not in (2, 3):
        raise UserError(f"report.wandb={path!r}: expected <entity>/<project> or <entity>/<project>/<sweep id>.")
    if api is None:
        import wandb

        try:
            api = wandb.Api()
        except Exception as err:  # noqa: BLE001 - no credentials, no network: a user's fix
            raise UserError(f"report.wandb needs W&B online (`wandb login` or WANDB_API_KEY): {err}") from err
    try:
        found = list(api.sweep("/".join(parts)).runs if len(parts) == 3 else api.runs("/".join(parts)))
    except Exception as err:  # noqa: BLE001
        raise UserError(f"report.wandb={path!r}: W&B could not list its runs ({err}). Check the entity, project "
                        "and sweep id (`wandb sweep` printed them).") from err
    runs, left_out, skipped = [], [], 0
    for wrun in progress(found, "reading W&B runs"):
        where = f"wandb:{'/'.join(parts[:2])}/{wrun.id}"
        config = {k: v for k, v in dict(wrun.config).items() if not k.startswith("_")}
        # Under `wandb agent` the sweep's parameters hold the sweep's values (attn='external'); the resolved
        # sections are logged beside them (suite.loggers.RESOLVED_KEY).
        resolved = config.pop(RESOLVED_KEY, None)
        if isinstance(resolved, dict):
            config.update(resolved)
        if config.get("mode") in NOT_TRAINING:
            skipped += 1
            continue
        summary = numbers({k: v for k, v in dict(wrun.summary).items() if not k.startswith("_")})
        if getattr(wrun, "state", "finished") != "finished":
            left_out.append(LeftOut(where, f"W&B state {wrun.state} (crashed, stopped or still running)"))
            continue
        if not config.get("task"):
            left_out.append(LeftOut(where, "no task in its config (not a run.py run)"))
            continue
        if wrong := [k for k in SECTIONS if k in config and not isinstance(config[k], (dict, type(None)))]:
            left_out.append(LeftOut(where, f"its W&B config's {', '.join(f'{k}={config[k]!r}' for k in wrong)} "
                                           "not the resolved section run.py logs: a `wandb agent` run logged by a "
                                           "version that lost them to the sweep's locked parameters, so its "
                                           "settings are unknown; report its folder instead (report.runs=...)"))
            continue
        metrics, cost = split_record(summary)
        if (wrong := out_of_range(metrics)) is not None:
            left_out.append(LeftOut(where, f"its W&B summary holds {wrong}"))
            continue
        # The run record (suite/train.py log_record) is logged as config, and is no setting of the run.
        record = {k: config.pop(k) for k in RECORD_KEYS if k in config}
        recorded = isinstance(record.get("protocol"), dict)
        proto = record["protocol"] if recorded else derive_protocol(config, "best")
        run = as_run(where, config, record.get("tested"), metrics, cost, proto, recorded, wrun,
                     recorded_provenance(record), "its W&B config")
        (left_out if isinstance(run, LeftOut) else runs).append(run)
    if not runs and not left_out:
        raise UserError(f"no runs in W&B {'sweep' if len(parts) == 3 else 'project'} {path}.")
    return runs, left_out, skipped


def learning_curve(run: Run, key: str) -> list[tuple[float, float]]:
    """(step, value) of ``key`` from the run's logged history: Lightning's metrics.csv or W&B's history, one value a
    step, the last logged. A run killed (SIGKILL: no checkpoint at the kill) and resumed from its last checkpoint
    logs the steps since that checkpoint again, and W&B keeps both: its curve counted those steps twice, as two
    seeds, in the report's mean and spread. The last is the resumed run's, whose weights went on. (The CSV history
    drops the rows past the checkpoint when it resumes: ``suite.loggers.HistoryCSVLogger``.)"""
    points = []
    if isinstance(run.history, Path):
        try:
            with run.history.open(newline="") as f:
                for row in csv.DictReader(f):
                    if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                        points.append((float(row["step"]), float(row[key])))
        except (OSError, ValueError, csv.Error) as err:
            log.warning("history of %s unreadable: %s", run.path, err)
    elif run.history is not None:
        try:
            for row in run.history.scan_history(keys=[key, "trainer/global_step"]):
                points.append((float(row["trainer/global_step"]), float(row[key])))
        except Exception as err:  # noqa: BLE001 - a curve is not worth losing the report
            log.warning("W&B history of %s unreadable: %s", run.path, err)
    return list(dict(points).items())  # the last value of each step, steps in the order first logged


# --- 3. grouping ---------------------------------------------------------------------------------------------------
def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"attn": {"name": "self"}}`` -> ``{"attn.name": "self"}``; values as JSON text (comparable, hashable)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


def settings(run: Run) -> dict[str, str]:
    """A run's config as the groups compare it: :func:`flatten`, the :data:`WEIGHTS_KEYS` by file name, and the
    :data:`ADDED_OPTIONS` its record has not at their old behaviour's value."""
    flat = flatten(run.config)
    for key, value in ADDED_OPTIONS.items():
        if key not in flat and not any(k.startswith(key + ".") for k in flat):
            flat[key] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    for key in WEIGHTS_KEYS & flat.keys():
        if flat[key] != "null":
            flat[key] = PurePath(flat[key]).name
    return flat


def ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES) or key.endswith(IGNORED_SUFFIXES)


def varying_keys(runs: list[Run]) -> list[str]:
    """Config keys whose value differs between runs, except the ignored ones and any that equals the seed in every
    run (``data.seed: ${seed}``)."""
    flats = [settings(r) for r in runs]
    keys = sorted(set().union(*flats))
    out = []
    for key in keys:
        values = [f.get(key, "<unset>") for f in flats]
        if len(set(values)) < 2 or ignored(key):
            continue
        if all(v == json.dumps(r.seed) or v == str(r.seed) for v, r in zip(values, runs)):
            continue
        out.append(key)
    return out


def label_keys(runs: list[Run], keys: list[str]) -> list[str]:
    """The keys a row's label shows: ``attn.name`` first, then every other varying key but the attention options
    that the keys shown before them determine (``attn.memory`` comes with ``attn=external``: shown only when external
    runs differ in it). A varying key outside ``attn`` is always shown, even where the variant determines it (all
    external runs at 50 epochs, all offset runs at 1): rows are compared only under the same such keys."""
    flats = [settings(r) for r in runs]
    order = ["attn.name"] + [k for k in ("model.name",) if k in keys] + [k for k in keys
                                                                         if k not in ("attn.name", "model.name")]
    shown = []
    for key in order:
        seen = {}
        determined = True
        for f in flats:
            context = tuple(f.get(k, "<unset>") for k in shown)
            if seen.setdefault(context, f.get(key, "<unset>")) != f.get(key, "<unset>"):
                determined = False
                break
        if key == "attn.name" or not key.startswith("attn.") or not determined:
            shown.append(key)
    return shown


def label(run: Run, keys: list[str]) -> str:
    flat = settings(run)
    return " ".join(f"attn={flat.get(k)}" if k == "attn.name" else f"{k}={flat.get(k, '<unset>')}" for k in keys)


@dataclass
class Group:
    task: str
    data: str
    label: str
    attn: str
    context: tuple          # the varying keys outside attn: a row is compared only with a baseline of the same
    protocol: dict
    runs: list[Run] = field(default_factory=list)
    lost: list[Run] = field(default_factory=list)  # its runs whose compared metric is NaN or infinite (diverged)


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs of one task and data set that agree on the protocol and on every varying key but the seed."""
    blocks = defaultdict(list)
    for run in runs:
        blocks[(run.task, data_name(run.config))].append(run)
    groups = []
    for (task, data), members in sorted(blocks.items()):
        keys = varying_keys(members)
        shown = label_keys(members, keys)
        by_key: dict[tuple, Group] = {}
        for run in members:
            flat = settings(run)
            key = (json.dumps(run.protocol, sort_keys=True), tuple(flat.get(k, "<unset>") for k in keys))
            if key not in by_key:
                context = tuple((k, flat.get(k, "<unset>")) for k in keys if not k.startswith("attn."))
                by_key[key] = Group(task, data, label(run, shown), str(flat.get("attn.name")), context, run.protocol)
            by_key[key].runs.append(run)
        for group in by_key.values():  # seeds in order, whichever order the folders were read in
            group.runs.sort(key=lambda r: (not isinstance(r.seed, int), r.seed if isinstance(r.seed, int) else 0,
                                           str(r.seed), r.path))
        groups += sorted(by_key.values(), key=lambda g: (g.label, json.dumps(g.protocol, sort_keys=True)))
    return groups


def one_run_per_seed(groups: list[Group], runs: list[Run]) -> list[LeftOut]:
    """Keep one run per seed in each group; the others are returned, left out, each naming the run kept.

    A seed twice in one row is one experiment counted twice (a run repeated in another folder, the same runs read
    from their folders and from W&B): n, the spread, the interval and the test would all be wrong, and a
    deterministic run's copy narrows the interval to nothing. The first run read is kept, in the order of
    ``report.runs``, then W&B, so the order chooses."""
    read_at = {id(run): i for i, run in enumerate(runs)}
    left_out = []
    for group in groups:
        kept: dict[str, Run] = {}
        repeated = set()
        for run in sorted(group.runs, key=lambda r: read_at[id(r)]):
            seed = json.dumps(run.seed, default=str)
            if run.seed is None or seed not in kept:  # a run without a seed: nothing to tell a repeat by
                kept.setdefault(seed, run)
                continue
            repeated.add(id(run))
            left_out.append(LeftOut(run.path, f"seed {run.seed} again in the row {group.label} (one run per seed: "
                                              f"{kept[seed].path}, read first, is counted)"))
        group.runs = [r for r in group.runs if id(r) not in repeated]
    return left_out


def find_baseline(group: Group, groups: list[Group], baseline: str) -> tuple[Group | None, str]:
    """(the group ``group`` is compared with, or None and the row's note saying why): the one with the same task,
    data and protocol, ``baseline`` as its attn name or label, and the same varying keys outside ``attn`` (the
    context). A baseline under another context (another number of epochs) would credit the variant with the
    difference of that setting; several under this one (``attn.heads`` 1 and 4) leave the choice to the user."""
    candidates = [g for g in groups if g.task == group.task and g.data == group.data and g.protocol == group.protocol
                  and baseline in (g.attn, g.label)]
    same = [g for g in candidates if g.context == group.context]
    if len(same) == 1:
        return same[0], ""
    if same:
        return None, (f"{len(same)} {baseline} rows ({'; '.join(g.label for g in same)}): choose one with "
                      "report.baseline=<its label>")
    if not candidates:
        return None, f"no {baseline} runs with this protocol to compare with"
    mine = dict(group.context)
    differ = [k for k in mine if all(dict(g.context).get(k) != mine[k] for g in candidates)] or list(mine)
    return None, f"no {baseline} runs with {' '.join(f'{k}={mine[k]}' for k in differ)} to compare with"


# --- 4. rows -------------------------------------------------------------------------------------------------------
def task_metric(run: Run, requested: str | None) -> str:
    if requested:
        return requested
    monitored = str((run.config.get("monitor") or {}).get("metric", "val/loss"))
    return "test/" + monitored.split("/", 1)[-1]


def mean_of(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


def cost_of(group: Group) -> dict:
    """Cost per row: params and FLOPs per sample (recorded at train time, the mode=summary count), then the means
    over the seeds of training throughput (metrics.json, else the mean of the logged history), peak memory
    and wall time."""
    out = {}
    for key in COST_KEYS:
        values = [r.cost.get(key) for r in group.runs]
        if key == "train_samples_per_sec":
            values = [v if v is not None else logged_throughput(r) for v, r in zip(values, group.runs)]
        out[key] = mean_of([v for v in values if v is not None])
    return out


def logged_throughput(run) -> float | None:
    """The mean of a run's logged training throughput (the first of THROUGHPUT_HISTORY_KEYS it has), or None."""
    for key in THROUGHPUT_HISTORY_KEYS:
        history = [y for _, y in learning_curve(run, key)]
        if history:
            return mean_of(history)
    return None


def logs_to_wandb(cfg) -> bool:
    """``report.log_wandb``: true or false as set; null (the default) logs the report to W&B when W&B is on, i.e.
    the runs were read from it (``report.wandb=``) and ``logger=wandb``."""
    flag = cfg.report.get("log_wandb")
    if flag is None:
        return bool(cfg.report.get("wandb")) and (cfg.get("logger") or {}).get("name") == "wandb"
    return bool(flag)


def build_rows(groups: list[Group], baseline: str | None, metric: str | None, confidence: float) -> list[dict]:
    rows = []
    for group in groups:
        first = group.runs[0]
        name = task_metric(first, metric)
        higher = higher_is_better(name, first.config)
        chosen = baseline or NATIVE_BASELINE.get(group.task, "self")
        values = [(r.seed, r.metrics[name]) for r in group.runs]
        row = {"task": group.task, "data": group.data, "variant": group.label, "attn": group.attn,
               "metric": name, "higher_is_better": higher, "seeds": [s for s, _ in values],
               "lost_seeds": [r.seed for r in group.lost],
               **describe([v for _, v in values], higher, confidence), "baseline": chosen}
        base, why = find_baseline(group, groups, chosen)
        if base is group:
            row.update(baseline=group.label, diff=0.0, diff_ci_low=math.nan, diff_ci_high=math.nan, test="",
                       p_value=math.nan, p_holm=math.nan, note="baseline")
        elif base is None:
            row.update(diff=math.nan, diff_ci_low=math.nan, diff_ci_high=math.nan, test="", p_value=math.nan,
                       p_holm=math.nan, note=why)
        else:
            c = compare(values, [(r.seed, r.metrics[name]) for r in base.runs], confidence)
            row.update(baseline=base.label, diff=c["diff"], diff_ci_low=c["ci_low"], diff_ci_high=c["ci_high"],
                       test=c["test"], p_value=c["p_value"], p_holm=math.nan, note=c["note"])
        row.update(cost_of(group))
        row["protocol"] = group.protocol
        row["protocol_recorded"] = all(r.protocol_recorded for r in group.runs)
        row["runs"] = [r.path for r in group.runs]
        row.update(versions_of(group))
        rows.append(row)
    judge_per_table(rows, 1 - confidence)
    return rows


def row_blocks(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """The rows by (task, data set, compared metric): one table and one set of plots each. Runs of one data set
    chosen by different monitors compare different metrics (test/oa, test/loss), which shared the first row's
    title, direction and axes."""
    blocks = defaultdict(list)
    for row in rows:
        blocks[(row["task"], row["data"], row["metric"])].append(row)
    return blocks


def judge_per_table(rows: list[dict], alpha: float) -> None:
    """Each table's comparisons (:func:`row_blocks`: every row against its baseline) are one family: their
    p-values get Holm's adjustment (``p_holm``), and a row "differs" only where the adjusted p < ``alpha``. Judged
    alone, with six variants against one baseline a false "differs" somewhere is likely (1 - 0.95**6 = 26%).
    Rows flagged otherwise (too few runs, no spread) keep their note."""
    for members in row_blocks(rows).values():
        family = sum(math.isfinite(r["p_value"]) for r in members)
        for row, adjusted in zip(members, holm([r["p_value"] for r in members])):
            row["p_holm"] = adjusted
            if row["note"] in (verdict(0.0, alpha), verdict(1.0, alpha)):
                row["note"] = verdict(adjusted, alpha, "Holm" if family > 1 else "")


def versions_of(group: Group) -> dict:
    """What produced a row's runs: ``code``, ``torch`` and ``device``, each ``{version: runs}`` (``unknown``: not
    recorded; a run resumed under other code counts as ``<first> -> <next>``); ``mixed``: the keys on which the
    runs differ (such a row averages as seeds runs that differ by more than the seed); ``uncommitted``: whether
    some ran uncommitted changes (``+dirty``: the commit does not name their code)."""
    counts: dict[str, Counter] = {"code": Counter(), "torch": Counter(), "device": Counter()}
    for run in group.runs:
        found = run.provenance or {}
        code = " -> ".join(str(v) if v else "unknown" for v in found.get("code") or [None])
        for key, value in (("code", code), ("torch", found.get("torch")), ("device", found.get("device"))):
            counts[key][str(value or "unknown")] += 1
    counts = {key: dict(seen) for key, seen in counts.items()}  # in the order first seen, as plain JSON objects
    return {**counts, "mixed": [k for k, seen in counts.items() if len(seen) > 1],
            "uncommitted": any("+dirty" in version for version in counts["code"]),
            "resumed_under": changed_settings(group.runs)}


def changed_settings(runs: list[Run]) -> list[str]:
    """The settings (``batch_size``, ``precision``, ...) that some of ``runs`` changed when resumed
    (``provenance.settings``: suite.resume.FitRecord): their configs hold the last part's alone."""
    changed: list[str] = []
    for run in runs:
        parts = [p for p in (run.provenance or {}).get("settings") or [] if isinstance(p, dict)]
        for part, after in zip(parts, parts[1:]):
            changed += [k for k in after if k != "from_step" and after[k] != part.get(k) and k not in changed]
    return changed


def all_metrics(groups: list[Group], confidence: float) -> list[dict]:
    """Every metric every run of a group has, aggregated over the seeds (metrics.csv)."""
    out = []
    for group in groups:
        names = sorted(set.intersection(*(set(r.metrics) for r in group.runs)))
        for name in names:
            higher = higher_is_better(name, group.runs[0].config)
            out.append({"task": group.task, "data": group.data, "variant": group.label, "metric": name,
                        **describe([r.metrics[name] for r in group.runs], higher, confidence)})
    return out


# --- 5. output -----------------------------------------------------------------------------------------------------
def fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def places(value: float, digits: int = 4) -> int:
    """Decimals for a row's numbers: ``digits``, or for a value below 0.01 (KID's 7e-4) as many as keep ``digits``
    significant digits, which 4 decimals printed as 0.0007 ± 0.0000."""
    if not math.isfinite(value) or value == 0 or abs(value) >= 0.01:
        return digits
    return min(12, digits - 1 - math.floor(math.log10(abs(value))))


def fmt_diff(row: dict) -> str:
    """A row's difference from its baseline with its interval, to the row's decimals (:func:`places`), or to more
    where those round a difference to zero (-0.0000 beside "differs")."""
    digits = places(row["mean"])
    if row["diff"] != 0 and round(row["diff"], digits) == 0:
        digits = places(row["diff"])
    return (f"{row['diff']:+.{digits}f} [{fmt(row['diff_ci_low'], digits)}, {fmt(row['diff_ci_high'], digits)}]"
            if math.isfinite(row["diff"]) else "n/a")


def fmt_p(p: float, alpha: float) -> str:
    """``p`` to 3 decimals, or to as many more as keep it on its side of ``alpha`` (the significance level of the
    row's note): 0.04997 printed 0.050 beside "differs (p < 0.05)"."""
    if not math.isfinite(p):
        return "n/a"
    if p < 0.001:
        return "< 0.001"
    digits = 3
    while (round(p, digits) < alpha) != (p < alpha) and digits < 8:
        digits += 1
    return f"{p:.{digits}f}"


def lost_text(row: dict) -> str:
    """The note on a row's seeds whose compared metric was not finite (they are not in its n)."""
    lost = row.get("lost_seeds") or []
    if not lost:
        return ""
    return (f"{'; ' if row['note'] else ''}{len(lost)} more seed(s) ({', '.join(map(str, lost))}) ended with a "
            f"non-finite {row['metric']}, not in n")


def fmt_count(value: float, unit: str = "") -> str:
    if not math.isfinite(value):
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".strip()


def fmt_bytes(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def fmt_seconds(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    minutes, seconds = divmod(value, 60)
    return f"{int(minutes)} min {seconds:02.0f} s" if minutes else f"{seconds:.1f} s"


def protocol_text(protocol: dict) -> str:
    return "; ".join(f"{k} {v}" for k, v in protocol.items())


def versions_text(rows: list[dict]) -> list[str]:
    """A table's provenance: one line when all its runs share the code, torch and device (committed code);
    otherwise a line per row, with a warning in bold where its runs differ or ran uncommitted changes."""
    def text(row: dict) -> str:
        return "; ".join(f"{key} " + ", ".join(f"`{v}`" + (f" ({n} runs)" if len(row[key]) > 1 else "")
                                               for v, n in row[key].items()) for key in ("code", "torch", "device"))

    def warnings(row: dict) -> list[str]:
        return ([f"its runs differ in {', '.join(row['mixed'])}"] if row["mixed"] else []) + (
            ["uncommitted changes: the commit does not name the code"] if row["uncommitted"] else []) + (
            [f"resumed under another {', '.join(row['resumed_under'])} (each part's: provenance.settings in "
             "metrics.json)"] if row.get("resumed_under") else [])

    if not any(warnings(r) for r in rows) and len({text(r) for r in rows}) == 1:
        return [f"All runs: {text(rows[0])}."]
    return [f"- `{r['variant']}`: {text(r)}" + (f" (**{'; '.join(w)}**)" if (w := warnings(r)) else "")
            for r in rows]


def markdown(rows: list[dict], left_out: list[LeftOut], sources: list[str], plots: dict, confidence: float) -> str:
    pct = f"{confidence:.0%}"
    lines = ["# Report", "", f"Sources: {', '.join(sources)}. {sum(len(r['runs']) for r in rows)} runs in "
             f"{len(rows)} rows; {len(left_out)} left out (listed at the end).", "",
             f"Per row: the seeds aggregated (mean, standard deviation, {pct} Student-t interval of the mean, min, "
             f"max; best of n is not the result). Difference = row mean - baseline mean, with its {pct} interval and "
             "a paired t-test across seeds when both rows hold the same seeds, Welch's t-test otherwise; the rows "
             "of a table are one family of comparisons: \"differs\" means its Holm-adjusted p (p (Holm)) < "
             f"{1 - confidence:.2g}. Cost: "
             "params and FLOPs for one sample (mode=summary's count), training samples/s of one process, peak "
             "memory (CUDA max allocated, or the process's peak RSS on CPU) and wall time, means over the seeds. "
             "Rows whose protocols differ are never averaged together.", ""]
    for (task, data, metric), members in row_blocks(rows).items():
        direction = {True: "higher is better", False: "lower is better", None: "no better direction"}[
            members[0]["higher_is_better"]]
        lines += [f"## {task} on {data}: {metric} ({direction})", "",
                  f"| variant | n | seeds | mean ± std | {pct} CI | min | max | best of n | vs baseline | "
                  f"difference [{pct} CI] | test | p | p (Holm) | note | params | FLOPs/sample | samples/s | "
                  "peak memory | wall time | protocol |",
                  "|" + " --- |" * 20]
        for r in members:
            d = places(r["mean"])
            p = "" if r["note"] == "baseline" else (f"{fmt_p(r['p_value'], 1 - confidence)} | "
                                                    f"{fmt_p(r['p_holm'], 1 - confidence)}")
            lines.append(
                f"| `{r['variant']}` | {r['n']} | {', '.join(map(str, r['seeds']))} | {fmt(r['mean'], d)} ± "
                f"{fmt(r['std'], d)} | [{fmt(r['ci_low'], d)}, {fmt(r['ci_high'], d)}] | {fmt(r['min'], d)} | "
                f"{fmt(r['max'], d)} | {fmt(r['best_of_n'], d)} | `{r['baseline']}` | "
                f"{'' if r['note'] == 'baseline' else fmt_diff(r)} | {r['test'] or ''} | {p or ' | '} | {r['note']}"
                f"{lost_text(r)} | "
                f"{fmt_count(r['params'])} | {fmt_count(r['flops'])} | {fmt(r['train_samples_per_sec'], 1)} | "
                f"{fmt_bytes(r['peak_memory_bytes'])} | {fmt_seconds(r['wall_time_s'])} | "
                f"{protocol_text(r['protocol'])}{'' if r['protocol_recorded'] else ' (from config)'} |")
        lines += ["", *versions_text(members), ""]
        for title, path in plots.get((task, data, metric), []):
            lines += [f"![{title}]({path})", ""]
    lines += ["## Runs left out", ""]
    lines += [f"- `{x.path}`: {x.reason}" for x in left_out] or ["None."]
    return "\n".join(lines) + "\n"


def csv_value(value):
    if isinstance(value, (list, tuple)):
        return ";".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return value


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: csv_value(v) for k, v in row.items()})


def clear_earlier_report(out: Path) -> None:
    """Delete the plots of the report ``out`` holds (the ones its ``report.json`` lists), before a new report is
    written there: a report run again into its folder (``mode=report`` with the same runs, as after more runs
    finished) left the earlier report's plots whose names the new one does not use beside it, such as the
    curves of a task no longer reported. Its other files are rewritten whole."""
    try:
        earlier = json.loads((out / "report.json").read_text()).get("plots", [])
    except (OSError, ValueError, AttributeError):  # no earlier report, or not one of ours
        return
    for name in earlier:
        if isinstance(name, str) and name.endswith(".png") and Path(name).name == name:  # a file of the folder only
            (out / name).unlink(missing_ok=True)


def plot_blocks(rows: list[dict], groups: list[Group], out: Path) -> dict:
    """Per task and data set: the metric against FLOPs and against throughput (mean with its confidence interval,
    Pareto front dashed), and learning curves (the monitored validation metric, mean +/- std over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = defaultdict(list)
    by_label = {(g.task, g.data, g.label, json.dumps(g.protocol, sort_keys=True)): g for g in groups}
    blocks = row_blocks(rows)
    for (task, data, metric), members in blocks.items():
        several = sum((t, d) == (task, data) for t, d, _ in blocks) > 1  # then the metric names the files apart
        slug = (f"{task}-{data}" + (f"-{metric}" if several else "")).lower().replace("/", "_")
        higher = members[0]["higher_is_better"]
        for axis, key, x_lower in (("FLOPs per sample", "flops", True),
                                   ("training samples/s (one process)", "train_samples_per_sec", False)):
            xs = [r[key] for r in members]
            if not any(math.isfinite(x) for x in xs):
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            ys = [r["mean"] for r in members]
            for r, x, y in zip(members, xs, ys):
                if not math.isfinite(x):
                    continue
                err = [[y - r["ci_low"]], [r["ci_high"] - y]] if math.isfinite(r["ci_low"]) else None
                ax.errorbar([x], [y], yerr=err, fmt="o", capsize=4, label=r["variant"])
            front = [] if higher is None else pareto_front(xs, ys, x_lower, higher)
            if len(front) > 1:
                ax.plot([xs[i] for i in front], [ys[i] for i in front], "k--", lw=1, label="Pareto front")
            elif front:
                ax.plot([xs[front[0]]], [ys[front[0]]], "k*", ms=12, label="Pareto front")
            finite = [x for x in xs if math.isfinite(x) and x > 0]
            if finite and max(finite) / min(finite) > 20:
                ax.set_xscale("log")
            ax.set_xlabel(axis)
            way = "" if higher is None else f", {'higher' if higher else 'lower'} is better"
            ax.set_ylabel(f"{metric} (mean{way})")
            ax.set_title(f"{task} on {data}: error bars = confidence interval over seeds", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            name = f"{slug}-{key.split('_')[0] if key == 'flops' else 'throughput'}.png"
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            made[(task, data, metric)].append((f"{metric} vs {axis}", name))
        block_groups = [by_label[(task, data, r["variant"], json.dumps(r["protocol"], sort_keys=True))]
                        for r in members]
        # The compared metric on the validation split (test/loss -> val/loss), else the monitored one.
        monitored = str((block_groups[0].runs[0].config.get("monitor") or {}).get("metric", ""))
        curves = []
        for key in dict.fromkeys(["val/" + metric.split("/", 1)[-1], monitored]):
            for r, group in zip(members, block_groups):
                per_step = defaultdict(list)
                for run in group.runs:
                    for step, value in learning_curve(run, key):
                        per_step[step].append(value)
                if per_step:
                    curves.append((r["variant"], sorted(per_step.items())))
            if curves:
                monitored = key
                break
        if curves:
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            for variant, points in curves:
                steps = np.array([s for s, _ in points])
                mean = np.array([np.mean(v) for _, v in points])
                std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for _, v in points])
                line, = ax.plot(steps, mean, marker="o", ms=3, label=variant)
                ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
            ax.set_xlabel("training step")
            ax.set_ylabel(f"{monitored} (mean ± std over seeds)")
            ax.set_title(f"{task} on {data}: learning curves", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / f"{slug}-curves.png", dpi=110)
            plt.close(fig)
            made[(task, data, metric)].append((f"{monitored} learning curves", f"{slug}-curves.png"))
    return made


def log_to_wandb(cfg, rows: list[dict], out: Path, plots: dict) -> None:
    """The tables and plots as one W&B run (job_type=report), with the logger's project and mode."""
    import wandb

    from suite.loggers import wandb_mode

    logger = cfg.get("logger") or {}
    try:
        run = wandb.init(project=logger.get("project") or "attention-suite", entity=logger.get("entity"),
                         job_type="report", dir=str(out), mode=wandb_mode(logger.get("mode", "auto")),
                         config={"report": dict(cfg.report)})
        columns = [k for k in rows[0] if k not in ("runs", "protocol", "seeds")] + ["protocol", "seeds"]
        run.log({"report": wandb.Table(columns=columns, data=[[csv_value(strict_json.strict(r.get(c)))
                                                               for c in columns] for r in rows])})
        for items in plots.values():
            for title, name in items:
                run.log({name.removesuffix(".png"): wandb.Image(str(out / name), caption=title)})
        run.finish()
    except Exception as err:  # noqa: BLE001 - the files are written; W&B is extra
        log.warning("the report was not logged to W&B: %s", err)


# --- 6. entry point ------------------------------------------------------------------------------------------------
def as_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return [str(v) for v in value]


def check_metric(runs: list[Run], left_out: list[LeftOut], metric: str | None) -> tuple[list[Run], list[Run]]:
    """The runs with a finite compared metric, and those whose metric is NaN or infinite (a diverged seed: its row
    names it, :func:`set_aside_lost`); runs without it are left out, by path; none with it at all is a user
    error."""
    kept, lost = [], []
    for run in runs:
        name = task_metric(run, metric)
        if name in run.metrics and math.isfinite(run.metrics[name]):
            kept.append(run)
        else:
            left_out.append(LeftOut(run.path, f"no finite {name} in its metrics"))
            if name in run.metrics:
                lost.append(run)
    if not kept:
        available = sorted(set().union(*(r.metrics for r in runs))) if runs else []
        wanted = task_metric(runs[0], metric) if runs else metric
        if available:
            raise UserError(f"none of the runs has the compared metric ({wanted}). Metrics they have: "
                            f"{', '.join(available)}. Pass one with report.metric=.")
        raise UserError(f"none of the runs has the compared metric ({wanted}), nor any other metric: "
                        + "; ".join(f"{x.path}: {x.reason}" for x in left_out)
                        + ". Check that these are finished runs (each metrics.json holds the test metrics that "
                        "`python run.py` printed at its end), or pass other folders to report.runs.")
    return kept, lost


def set_aside_lost(groups: list[Group], lost: list[Run]) -> list[Group]:
    """Moves each group's ``lost`` runs (:func:`check_metric`) out of its runs; a group with no run left has no row.

    Grouped with the others, so a diverged seed is named in the row of its variant: left out only at the end of
    the report, a variant that diverged in 2 of 5 seeds showed the mean of its 3 survivors as its result."""
    ids = {id(run) for run in lost}
    kept = []
    for group in groups:
        group.lost = [r for r in group.runs if id(r) in ids]
        group.runs = [r for r in group.runs if id(r) not in ids]
        if group.runs:
            kept.append(group)
    return kept


def check_confidence(value) -> float:
    """``report.confidence``, the level of every confidence interval: a number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise UserError(f"report.confidence={value!r} is not a confidence level: it must be a number strictly "
                        "between 0 and 1 (0.95 gives 95% intervals). Fix it on the command line or in "
                        "configs/report/default.yaml, e.g. `python run.py mode=report report.confidence=0.95`.")
    return float(value)


def check_baseline(baseline: str | None, groups: list[Group]) -> None:
    if baseline and not any(baseline in (g.attn, g.label) for g in groups):
        variants = sorted({g.attn for g in groups})
        labels = sorted({g.label for g in groups} - set(variants))
        raise UserError(f"report.baseline={baseline!r} is none of the variants in these runs. Known variants: "
                        f"{', '.join(variants)}" + (f"; rows: {'; '.join(labels)}" if labels else "")
                        + f". Example: `report.baseline={variants[0]}`.")


def report(cfg, api=None) -> dict:
    """``mode=report``: read, group, compare, write. Returns the JSON document it writes (NaN as None)."""
    rc = cfg.report
    confidence = check_confidence(rc.get("confidence", 0.95))
    roots = [Path(p) for p in as_list(rc.get("runs"))]
    if not roots and not rc.get("wandb"):
        raise UserError("mode=report needs runs: `report.runs=<dir>[,<dir>...]` (Hydra run or multirun folders) or "
                        "`report.wandb=<entity>/<project>[/<sweep id>]`.")
    runs, left_out, skipped, sources = [], [], 0, []
    if roots:
        found = read_folders(roots)
        runs += found[0]
        left_out += found[1]
        skipped += found[2]
        sources += [str(r) for r in roots]
    if rc.get("wandb"):
        found = read_wandb(str(rc.wandb), api)
        runs += found[0]
        left_out += found[1]
        skipped += found[2]
        sources.append(f"wandb:{rc.wandb}")
    if not runs:
        raise UserError(f"none of the {len(left_out)} runs found can be used: "
                        + "; ".join(f"{x.path}: {x.reason}" for x in left_out))
    metric = rc.get("metric")
    runs, lost = check_metric(runs, left_out, metric)
    groups = set_aside_lost(group_runs(runs + lost), lost)
    left_out += one_run_per_seed(groups, runs)
    baseline = rc.get("baseline")
    check_baseline(baseline, groups)
    rows = build_rows(groups, baseline, metric, confidence)

    if rc.get("out"):
        out = Path(rc.out)
    elif roots:
        out = roots[0] / "report"
    else:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir) / "report"
    if out.exists() and not out.is_dir():
        raise UserError(f"report.out={out} is a file, not a folder: the report writes report.md, report.csv, "
                        "metrics.csv, report.json and its plots into a folder. Pass a new or existing folder, e.g. "
                        f"`report.out={out.with_suffix('')}-report`.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"report.out={out} cannot be created ({err.strerror or err}). Pass a folder where this user "
                        "can write, e.g. `report.out=reports/<name>`.") from err
    clear_earlier_report(out)
    plots = plot_blocks(rows, groups, out) if rc.get("plots", True) else {}
    document = {"sources": sources, "confidence": confidence, "rows": rows,
                "metrics": all_metrics(groups, confidence),
                "left_out": [{"path": x.path, "reason": x.reason} for x in left_out],
                "skipped_non_training_runs": skipped,
                "plots": [name for items in plots.values() for _, name in items]}
    (out / "report.json").write_text(strict_json.dumps(document, indent=2) + "\n")
    write_csv(out / "report.csv", rows)
    write_csv(out / "metrics.csv", document["metrics"])
    text = markdown(rows, left_out, sources, plots, confidence)
    (out / "report.md").write_text(text)
    if logs_to_wandb(cfg):
        log_to_wandb(cfg, rows, out, plots)

    print(text[text.index("## "):text.index("## Runs left out")] if "## " in text else text)
    if left_out:
        print(f"{len(left_out)} run(s) left out:")
        print("\n".join(f"  {x.path}: {x.reason}" for x in left_out))
    if skipped:
        print(f"{skipped} folder(s) of mode=summary/bench/report runs skipped (they hold no results)")
    print(f"report written to {out / 'report.md'} (and report.csv, metrics.csv, report.json, "
          f"{len(document['plots'])} plots)")
    return strict_json.strict(document)
