"""Resuming a run in its own directory: which checkpoint, the same W&B run, the same random numbers, the whole
run's wall time.

``ckpt_path=last`` continues from ``<run dir>/checkpoints/last.ckpt`` and
fails if there is none; ``resume=true`` does the same but starts afresh when
there is nothing yet (what a job script that may be requeued wants). Under
SLURM, Lightning's own ``hpc_ckpt_<n>.ckpt`` (written on the pre-emption
signal) counts too, whichever is newest wins, and a requeued job resumes
without being told (:func:`suite.run_dirs.slurm_restart`). The W&B run id is kept in
``checkpoints/wandb_run_id`` so a resumed run logs into the same W&B run.

Lightning restores model, optimisers, schedulers, loops and callbacks, but not
the random number generators; :class:`RandomState` stores them in every
checkpoint and puts them back when training restarts, so a run resumed at an
epoch boundary draws the same shuffles, augmentations and dropout masks as one
that never stopped (exactly so with ``data.num_workers=0``; worker processes
are seeded afresh when they are restarted).

:class:`FitRecord` keeps the seconds a run has spent and its fit's metrics in its checkpoints, so that
``metrics.json`` of a resumed run has the time of all its parts, not of its last one, and the fit's metrics also when
the checkpoint was written at the fit's end.
"""

from __future__ import annotations

import logging
import secrets
import string
import time
from pathlib import Path

import lightning as L

from attention.errors import UserError
from suite.run_record import floats
from suite.distributed import is_rank_zero

log = logging.getLogger(__name__)
WANDB_ID_FILE = "wandb_run_id"


def resume_checkpoint(ckpt_path: str | None, resume: bool, out_dir: Path) -> str | None:
    """The checkpoint this run starts from: ``ckpt_path`` as given, or the newest of the run directory's own."""
    if not resume and ckpt_path != "last":
        return ckpt_path
    if ckpt_path is not None and ckpt_path != "last":
        raise UserError(f"resume=true continues from this run directory's own checkpoints; it cannot be combined "
                        f"with ckpt_path={ckpt_path}. Pass one or the other.")
    if (newest := newest_checkpoint(out_dir)) is not None:
        log.info("resuming from %s", newest)
        return str(newest)
    if ckpt_path == "last":
        raise UserError(f"ckpt_path=last found no checkpoint in {out_dir / 'checkpoints'}: it takes the newest "
                        "checkpoint of the run whose directory is given as `hydra.run.dir=<run dir>` (by default "
                        "outputs/<task>/<attn>/<start time>/, the folder holding that run's checkpoints/ and .hydra/; "
                        "a run logs its `last checkpoint: <run dir>/checkpoints/last.ckpt`), or pass a checkpoint "
                        "file as `ckpt_path=<file>.ckpt`. In a job script that may start from nothing, use "
                        "resume=true, which starts afresh when there is nothing to resume.")
    log.info("resume=true: no checkpoint in %s yet, starting from scratch", out_dir / "checkpoints")
    # A part of this run killed while it wrote its first last.ckpt, its best checkpoint written just before: the
    # run trains that part again, and its own best then lay beside that one (two best-*.ckpt of one run).
    stale = sorted((out_dir / "checkpoints").glob("best-*.ckpt"))
    if stale and is_rank_zero():
        log.warning("resume=true: deleting %s, written by a part of this run stopped before its first last.ckpt, "
                    "which this run trains again from scratch", ", ".join(p.name for p in stale))
        for path in stale:
            path.unlink(missing_ok=True)
    return None


def newest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint a resumed run in ``out_dir`` starts from: the newer of ``checkpoints/last.ckpt`` and
    Lightning's ``hpc_ckpt_<n>.ckpt`` (SLURM), or None."""
    candidates = [p for p in [out_dir / "checkpoints" / "last.ckpt", *out_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


# The config sections that make up a run's recipe, compared when a run trains on from a checkpoint
# (:func:`check_same_recipe`); ``attn`` is checked against the checkpoint itself (suite.checkpoints), the seed and
# data set by suite.run_dirs.check_same_run.
RECIPE = ("optim", "model", "task", "data", "monitor")
# Leaves a run may change when it trains on: where files are and how they are read (the OPERATIONAL keys of
# suite.checkpoints, data.batch_size included: the advice for a run out of memory is a smaller batch, then
# resume=true), the weights a fresh run starts from (a checkpoint replaces them), what is logged, and how the
# network is tested (whose settings each record's protocol names), less the options validation uses too
# (a task's ``validation_options``: they decide which checkpoint is the best).
START_ONLY = {"pretrained", "d_weights", "g_ema_weights"}
EVALUATION = {"eval", "metrics", "val_samples", "test_samples", "grid_per_class", "log_samples", "log_images"}


def free_to_change(key: str, validation: tuple[str, ...] = ()) -> bool:
    """Whether leaf ``key`` (``data.num_workers``, ``task.eval.votes``) may differ in a run that trains on;
    ``validation``: the task's ``validation_options`` (``eval.mode``), which may not (also as ``task.eval.mode``,
    the task's copy)."""
    from suite.checkpoints import OPERATIONAL

    parts = key.split(".")
    bare = key.removeprefix("task.")
    if any(bare == option or bare.startswith(option + ".") for option in validation):
        return False
    return parts[-1] in OPERATIONAL | START_ONLY or any(part in EVALUATION for part in parts)


def recipe_differences(cfg, saved, training: bool = True) -> tuple[dict, dict, dict, list[str]] | None:
    """``(before, now, given, differ)``: the :data:`RECIPE` leaves of the run config ``saved`` (a checkpoint's run's
    ``resolved_config.yaml``) and of ``cfg`` (resolved, and as given), and the keys whose values differ, less those
    :func:`free_to_change` (``training``: to train on, when the task's validation options are not; to test, they
    are); None when ``saved`` cannot be read."""
    from omegaconf import OmegaConf

    from suite.checkpoints import leaves
    from suite.secrets import redact

    def recipe(config, resolve: bool = True) -> dict:  # {dotted key: value} of the RECIPE sections
        return {key: value for section in RECIPE if config.get(section) is not None
                for key, value in leaves(OmegaConf.to_container(config[section], resolve=resolve), f"{section}.")}

    try:
        before = recipe(OmegaConf.load(saved))
    except Exception:  # noqa: BLE001 - missing or unreadable
        return None
    # this run's values as its resolved_config.yaml would hold them (credentials redacted: suite/secrets.py)
    now = {k: redact(v, key=k.rsplit(".", 1)[-1]) for k, v in recipe(cfg).items()}
    given = recipe(cfg, resolve=False)
    validation = validation_options(cfg) if training else ()
    return before, now, given, sorted(k for k in set(before) & set(now) if before[k] != now[k]
                                      and not free_to_change(k, validation))


def validation_options(cfg) -> tuple[str, ...]:
    """The ``validation_options`` of the task ``cfg`` runs (tasks.base.Task), () when it cannot be imported."""
    from hydra.utils import get_class

    try:
        return tuple(get_class(str(cfg.task._target_)).validation_options)
    except Exception:  # noqa: BLE001 - not a task class: its own error comes when it is built
        return ()


def sources(keys: list[str], given: dict) -> dict[str, str]:
    """{the option a user passes: the key of ``keys`` it sets}: a value interpolated from another option, itself or
    through a parent (``task.input_points: ${data.npoints}``, ``task.eval: ${eval}``), is named by that option."""
    import re

    out: dict[str, str] = {}
    for key in keys:
        parts, name = key.split("."), key
        for n in range(len(parts), 0, -1):  # the leaf, then each parent
            found = re.fullmatch(r"\$\{([A-Za-z_][\w.]*)\}", str(given.get(".".join(parts[:n]), "")))
            if found:
                name = ".".join([found.group(1), *parts[n:]])
                break
        out.setdefault(name, key)
    return out


def warn_tested_recipe(cfg, ckpt: str) -> None:
    """Warn when ``mode=test`` (``eval``) tests checkpoint ``ckpt`` under other ``model`` or ``task`` values than
    its run was trained with (a number of neighbours; of points, through ``task.input_points``): the weights fit,
    so nothing failed, and a test command that left out an option its training run was given
    (``model.neighbours=16``, an ``experiment=``) measured the network under the defaults, silently. Testing under
    other values is an experiment of its own (robustness to fewer points), so it is not refused; the record
    (``resolved_config.yaml`` of the test) names the values it used."""
    from suite.checkpoints import run_config_of

    if (saved := run_config_of(ckpt)) is None or (found := recipe_differences(cfg, saved, training=False)) is None:
        return
    before, now, given, differ = found
    warn_tested_seed(cfg, saved, ckpt)
    # the network and its task's computation; data values are mostly the training split's (its augmentation, size)
    named = sources([k for k in differ if k.startswith(("model.", "task."))], given)
    if named:
        log.warning("%s is tested under other values than its run (%s) was trained with: %s. To test it as it was "
                    "trained, pass its values (%s).", ckpt, saved.parent,
                    ", ".join(f"{n}={before[k]!r} (this command: {now[k]!r})" for n, k in named.items()),
                    " ".join(f"{n}={before[k]}" for n, k in named.items()))


# Point-cloud data sets whose splits are generated from ``seed`` (no files): another seed, another test set.
GENERATED_POINT_SETS = ("datamodules.points.shapes.Shapes", "datamodules.partseg.parts.Parts")


def seed_decides_the_test(cfg) -> list[str]:
    """What ``seed`` decides in a point-cloud test (``task=modelnet``/``shapenet``) under ``cfg``: the generated test
    set (data=shapes, data=parts), the points each ShapeNet-part shape is scored on (datamodules.partseg.base: drawn
    from ``(seed, split, index)``), the points sampled on each ModelNet40 mesh (data=modelnet40_pyg), the votes'
    scales (tasks.voting); [] when nothing (the ModelNet40 HDF5 files, one pass), or another task."""
    task = str((cfg.get("task") or {}).get("name"))
    if task not in ("modelnet", "shapenet"):
        return []
    reasons = []
    if str((cfg.get("data") or {}).get("_target_")) in GENERATED_POINT_SETS:
        reasons.append("the generated test set itself (another seed, other shapes)")
    elif task == "shapenet":
        reasons.append("which points of each test shape are scored (data.npoints drawn per shape from the seed)")
    elif str((cfg.get("data") or {}).get("_target_")) == "datamodules.points.modelnet40_pyg.ModelNet40PyG":
        reasons.append("the points sampled on each test mesh")
    if int(((cfg.get("eval") or {}).get("votes")) or 1) > 1:
        reasons.append("the random scales of the eval.votes votes")
    return reasons


def warn_tested_seed(cfg, saved: Path, ckpt: str) -> None:
    """Warn when a point-cloud test (mode=test/eval) runs under another ``seed`` than its checkpoint's run and the
    seed decides its numbers (:func:`seed_decides_the_test`). ``seed`` is an operational option, never compared
    (the test command's own seed is its default, 42, unless given): `mode=test ckpt_path=<a seed-0 run's best>`
    scored the network on another generated test set, other ShapeNet points or other votes than its run's own
    test, and exited 0 with other numbers than that run's metrics.json, saying nothing."""
    from omegaconf import OmegaConf

    try:
        trained = OmegaConf.load(saved).get("seed")
    except Exception:  # noqa: BLE001 - missing or unreadable: nothing to compare
        return
    now = cfg.get("seed")
    if trained is None or now is None or trained == now or not (reasons := seed_decides_the_test(cfg)):
        return
    log.warning("%s is tested under seed=%s, its run (%s) under seed=%s; the seed decides %s, so this test does "
                "not repeat its run's. To test it as its run did, pass seed=%s.", ckpt, now, saved.parent, trained,
                "; ".join(reasons), trained)


def check_same_recipe(cfg, run_dir: Path, *, resume: bool, slurm_restart: bool) -> None:
    """Refuse a training run that loads a checkpoint (``resume=true``, ``ckpt_path=last``, a requeued job, or
    ``ckpt_path=<file>``) under another recipe than that checkpoint's run was trained with (the :data:`RECIPE`
    values of its ``resolved_config.yaml``, less those :func:`free_to_change`). Lightning restores the optimizer's
    and scheduler's states from the checkpoint (their learning rates, momentum, weight decay, the schedule's
    length): new ``optim`` values were recorded as the run's (``resolved_config.yaml``, the checkpoints'
    hyper-parameters, W&B) but never used. Resumed with ``optim.optimizer.lr=0.5`` a run went on at 0.01, and its
    record said 0.5. New ``model``, ``task`` or ``data`` values (a dropout, the label smoothing, the number of
    points, an augmentation: what a sweep re-run in its folder with its values in another order gives each job)
    were used from then on, and the record named them alone: half of the run was trained under values it does not
    mention. A value that follows a ``trainer`` option (``T_max: ${trainer.max_epochs}``: the run's length, which a
    resumed run may change, to stop sooner or go on longer) is not refused: the checkpoint's value is put in
    ``cfg`` (what the run records) with a warning, since it is what the restored scheduler uses. Keys only one side
    has are not compared (a key a later version of the suite added)."""
    from omegaconf import OmegaConf

    from suite.checkpoints import run_config_of

    ckpt = cfg.get("ckpt_path")
    if ckpt not in (None, "last"):
        where, saved = f"ckpt_path={ckpt} was", run_config_of(ckpt)
    elif (resume or ckpt == "last" or slurm_restart) and newest_checkpoint(run_dir) is not None:
        where, saved = f"hydra.run.dir={run_dir} holds a run", run_dir / "resolved_config.yaml"
    else:
        return  # nothing loaded: a fresh start
    if (found := recipe_differences(cfg, saved)) is None:
        return  # no readable config beside the checkpoint: nothing to compare
    before, now, given, differ = found

    def follows(key):  # the trainer option this value is an interpolation of (T_max: ${trainer.max_epochs}), or None
        source = given.get(key)
        if key.startswith("optim.") and isinstance(source, str) and source.startswith("${trainer.") \
                and source.endswith("}"):
            return source[2:-1]
        return None

    kept = [k for k in differ if follows(k)]
    named = sources([k for k in differ if k not in kept], given)
    if named:
        said = ", ".join(f"{n}={before[k]!r} (this command: {now[k]!r})" for n, k in list(named.items())[:8]) + (
            f", and {len(named) - 8} more" if len(named) > 8 else "")
        why = []
        if any(k.startswith("optim.") for k in named.values()):
            why.append("Training from that checkpoint goes on with its own optimizer and schedule, restored from it: "
                       "this command's optim values would be recorded as the run's and not used.")
        if any(not k.startswith("optim.") for k in named.values()):
            why.append("It would train on under this command's model, task, data or validation values, and its "
                       "record (resolved_config.yaml, metrics.json, W&B) would name them alone, for a network "
                       "trained under both (its best checkpoint chosen among validations under both).")
        weights = ckpt if ckpt not in (None, "last") else str(run_dir / "checkpoints" / "last.ckpt")
        raise UserError(
            f"{where} trained with {said}. {' '.join(why)} To continue it, pass the values it was trained with "
            f"({' '.join(f'{n}={before[k]}' for n, k in named.items())}). To train on from its weights under this "
            f"command's values, start a new run from them instead: `model.weights={weights}` (the GAN: "
            f"`model.g_weights={weights} model.d_weights={weights}`), without resume=true or ckpt_path, in a new "
            "folder.")
    for key in kept:  # the run's length changed: the schedule keeps the checkpoint's, and the record says so
        OmegaConf.update(cfg, key, before[key], merge=False)
    if kept:
        log.warning("This run goes on with the schedule of the checkpoint it resumes: %s. %s changes where it stops, "
                    "not the schedule's length (past its end a scheduler does what it does there: a cosine rises "
                    "back). To train on under a schedule of the new length, start a new run from its weights "
                    "(model.weights=<checkpoint>).", ", ".join(f"{k}={before[k]!r}" for k in kept),
                    " and ".join(sorted({f"{follows(k)}={now[k]!r}" for k in kept})))


def keep_checkpoint_rates(ckpt: str, optim) -> None:
    """A run trained on from checkpoint ``ckpt`` keeps its learning rates: with ``optim.scale_lr``, a resumed run on
    another number of processes (or another ``trainer.accumulate_grad_batches``: another global batch) scaled them
    anew in ``optim`` (the module's hyper-parameters, what checkpoints and W&B record), but Lightning restores the
    optimizer's rates from the checkpoint, and those are what it trains with. ``optim``'s rates are put back to the
    checkpoint's, with a warning, so that the record says what is used."""
    from omegaconf import OmegaConf

    from suite.checkpoint_io import safe_torch_load
    from suite.checkpoints import leaves

    saved = (safe_torch_load(ckpt, f"ckpt_path={ckpt}", mmap=True).get("hyper_parameters") or {}).get("optim")
    if not isinstance(saved, dict):
        return  # a checkpoint without the run's optim (older, or not run.py's): nothing to compare
    plain = OmegaConf.to_container(optim, resolve=True) if OmegaConf.is_config(optim) else optim
    before, now = dict(leaves(dict(saved))), dict(leaves(dict(plain)))
    differ = sorted(k for k in set(before) & set(now) if k.rsplit(".", 1)[-1] == "lr" and before[k] != now[k])
    for key in differ:
        node = optim
        for part in key.split(".")[:-1]:
            node = node[part]
        node["lr"] = before[key]
    if differ:
        log.warning("This run goes on with the learning rates of the checkpoint it resumes: %s (optim.scale_lr=%s "
                    "gave %s for this run's global batch). The optimizer's rates are restored from the checkpoint; "
                    "to train with the new ones, start a new run from its weights (model.weights=<checkpoint>).",
                    ", ".join(f"optim.{k}={before[k]:.6g}" for k in differ), now.get("scale_lr"),
                    ", ".join(f"{now[k]:.6g}" for k in differ))


def wandb_run_id(out_dir: Path, resuming: bool) -> str:
    """The W&B run id of a resumed run (saved beside its checkpoints), or a new one for a new run."""
    path = out_dir / "checkpoints" / WANDB_ID_FILE
    if resuming and path.is_file():
        return path.read_text().strip()
    # W&B's own id format (8 characters of [a-z0-9]), from `secrets`: drawing it from `random` would move the
    # seeded python generator and make a run with W&B differ from one without.
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def save_wandb_run_id(out_dir: Path, run_id: str) -> None:
    path = out_dir / "checkpoints" / WANDB_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")


class RandomState(L.pytorch.callbacks.Callback):
    """Each process's own random draws while training, kept in checkpoints and put back on resume.

    **Per process.** ``seed_everything(seed)`` seeds every process of a run alike (the networks and data are built
    alike), so under DDP every process drew the same random numbers while training: the same Mixup/CutMix weight
    and box, drop-path and dropout masks, and augmentations made in the main process (``data.num_workers=0``), on
    different samples. The recipes these tasks follow seed each process apart (DeiT, timm, mmseg: seed + rank).
    At the start of a fresh fit every process but the first is reseeded from the run's seed and its rank
    (:func:`rank_seed`); the first keeps the single-process run's draws.

    **Resume.** Lightning restores model, optimisers, schedulers, loops and callbacks, but not the random number
    generators: python's, numpy's and torch's (CPU and CUDA) states of every process are gathered into each
    checkpoint and each process's own is put back at ``on_train_start``: after the sanity-check validation (which
    draws from the generators too) and before the first training batch, where the uninterrupted run stood when it
    saved them. A run resumed on more processes than it was saved with reseeds the new ones. A checkpoint of
    before holds one state, which every process takes.
    """

    def __init__(self):
        self._pending = None

    @staticmethod
    def _own_state() -> dict:
        import random

        import numpy as np
        import torch

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        # Tensors and plain python values only: checkpoints are read with torch.load(weights_only=True).
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
                "python": random.getstate()}

    def state_dict(self):
        import torch.distributed as dist

        own = self._own_state()
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return {"ranks": [own]}
        # Every process saves a checkpoint together (Lightning's save ends with a barrier): a collective is safe.
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, own)
        return {"ranks": states}

    def load_state_dict(self, state_dict):
        self._pending = state_dict

    def on_train_start(self, trainer, pl_module):
        state, self._pending = self._pending, None
        if state and "ranks" not in state:  # a checkpoint of before: one state, which every process drew alike
            self._put_back(state)
            return
        states, rank = (state or {}).get("ranks") or [], trainer.global_rank
        if rank < len(states):
            self._put_back(states[rank])
        elif rank > 0:  # a fresh fit, or a process the checkpoint holds no state of
            reseed(rank_seed(rank))

    @staticmethod
    def _put_back(state: dict) -> None:
        import random

        import numpy as np
        import torch

        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))


def rank_seed(rank: int) -> int:
    """The training seed of process ``rank`` > 0: from the run's seed (``PL_GLOBAL_SEED``, set by
    ``seed_everything``) and the rank, through numpy's ``SeedSequence`` (well apart from seed + 1, another run's)."""
    import os

    import numpy as np

    base = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return int(np.random.SeedSequence([base, rank]).generate_state(1)[0])


def reseed(seed: int) -> None:
    """python's, numpy's and torch's (CPU and every CUDA device's) generators from ``seed``."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SupersededRecord(L.pytorch.callbacks.Callback):
    """A finished run resumed to train longer (``resume=true`` with a higher ``trainer.max_epochs``) sets its
    ``metrics.json`` aside as ``metrics-step<N>.json`` (N: the step it had finished at) when it takes its first
    training step, on the first process. The file stayed in place while the run trained on: killed before its new
    end, the folder held the record of its earlier end beside a ``resolved_config.yaml`` of the new length and
    checkpoints far past it, and ``mode=report`` (or a job script that takes ``metrics.json`` as "finished") counted
    it as a finished run of the new length with the earlier numbers. Resumed at its end with nothing to train (the
    same length), nothing is moved and the record is kept (:func:`suite.train.finished_already`)."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.checked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.checked:
            return
        self.checked = True
        record = self.out_dir / "metrics.json"
        if trainer.is_global_zero and record.is_file():
            kept = self.out_dir / f"metrics-step{trainer.global_step}.json"
            record.replace(kept)
            log.info("this run had finished at step %d and trains on: the record of that end is kept as %s, and "
                     "metrics.json is written when it ends again", trainer.global_step, kept)


# What a resumed run may train on under, besides its recipe (check_same_recipe), recorded per part by FitRecord
PART_SETTINGS = ("batch_size", "processes", "accumulate_grad_batches", "precision", "gradient_clip_val")


def part_settings(trainer) -> dict:
    """The :data:`PART_SETTINGS` of the fit ``trainer`` runs (the batch per process, and what makes the global one)."""
    batch = getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule is not None else None
    return {"batch_size": int(batch) if isinstance(batch, int) else None, "processes": int(trainer.world_size),
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches), "precision": str(trainer.precision),
            "gradient_clip_val": trainer.gradient_clip_val}


class FitState(L.pytorch.callbacks.Callback):
    """A callback whose checkpointed state is the fit's record: restored when a fit resumes from a checkpoint,
    left alone when a checkpoint is tested. Subclasses load it in :meth:`load_fit_state`.

    Lightning restores every callback's ``state_dict`` from the checkpoint that ``trainer.test(ckpt_path=...)``
    loads too. The best checkpoint, tested after the fit, then put its older counts in place of the whole run's:
    ``metrics.json``'s wall time counted the seconds up to the best epoch twice, and the throughput was the best
    epoch's, in every run whose best checkpoint was not its last."""

    stage: str | None = None  # the trainer's current stage ("fit", "test", ...), from setup, before any restore

    def setup(self, trainer, pl_module, stage):
        self.stage = stage

    def load_state_dict(self, state_dict):
        if self.stage in (None, "fit"):
            self.load_fit_state(state_dict)

    def load_fit_state(self, state_dict) -> None:
        raise NotImplementedError


class EpochMeans(FitState):
    """The running sums of the epoch-level training metrics (the module's torchmetrics named ``train_*``:
    ``train/loss`` and ``train/oa``'s epoch means) of every process, kept in checkpoints written inside an epoch
    and put back when the fit resumes inside that epoch.

    Lightning checkpoints a module's weights, not its metrics' states: a run stopped inside an epoch (SIGTERM,
    SLURM pre-emption, SIGKILL after a mid-epoch ``last.ckpt``) and resumed logged that epoch's
    ``train/loss_epoch`` and ``train/oa`` over the batches after the resume only (1.355 where the uninterrupted
    run logged 1.282), into W&B, ``csv/metrics.csv`` and, for the last epoch, ``metrics.json``. Per process, as
    :class:`RandomState` keeps the generators: each process's sums are its own share, summed across the processes
    when the epoch ends. Put back only when the fit resumes inside the epoch they were saved in: from a checkpoint
    of an epoch's last batch Lightning goes on with the next epoch, whose sums start at zero (and logs no means of
    the stopped one: ``test_a_validation_cut_by_sigterm_runs_again_on_resume``)."""

    def __init__(self):
        self._pending = None
        self._trainer = None

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._trainer = trainer

    @staticmethod
    def metrics(module) -> dict:
        from torchmetrics import Metric

        return {name: m for name, m in module.named_children() if name.startswith("train_") and isinstance(m, Metric)}

    def state_dict(self):
        import torch
        import torch.distributed as dist

        trainer = self._trainer
        if trainer is None or trainer.lightning_module is None:
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        own = {name: {"count": int(m._update_count),
                      "state": {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                for k, v in m.metric_state.items()}}
               for name, m in self.metrics(trainer.lightning_module).items()} if batches else {}
        states = [own]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()  # every process saves together: a collective is safe here
            dist.all_gather_object(states, own)
        return {"epoch": int(trainer.current_epoch), "batches": int(batches), "ranks": states}

    def load_fit_state(self, state_dict) -> None:
        self._pending = state_dict

    def on_train_start(self, trainer, pl_module):  # after the restore; a fit resumed mid-epoch starts no epoch
        state, self._pending = self._pending, None
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if (not state or state.get("epoch") != trainer.current_epoch or not state.get("batches")
                or progress.is_last_batch):  # stopped in an epoch's last batch: Lightning goes on with the next
            return
        ranks = state.get("ranks") or []
        if trainer.global_rank >= len(ranks):  # resumed on more processes: the new ones' shares start at zero
            return
        metrics = self.metrics(pl_module)
        for name, saved in ranks[trainer.global_rank].items():
            if (metric := metrics.get(name)) is None:
                continue
            for key, value in saved["state"].items():
                setattr(metric, key, value.to(metric.device) if hasattr(value, "to") else value)
            metric._update_count = saved["count"]
            metric._computed = None


class FitRecord(FitState):
    """What a run's checkpoints keep of its record: the seconds spent and the fit's latest metrics.

    - **Wall time** (``metrics.json``'s ``wall_time_s``) over all the run's parts: a run resumed from a checkpoint
      (``resume=true``, a requeued SLURM job) continues from the seconds it holds. So a run pre-empted twice reports
      the time of its three parts, each earlier one up to the checkpoint the next resumed from (the work after it
      was lost and done again), where it reported its last part only and looked as cheap as a run that never
      stopped.
    - **The fit's metrics** (``train/*``, ``val/*``, as Lightning's ``callback_metrics`` held them): a run resumed
      from a checkpoint written at the end of its fit (killed while testing) trains nothing more, and its
      ``metrics.json`` got the test metrics only; :meth:`fit_metrics` gives them back.
    - ``steps``: the training steps taken in this process (0: the checkpoint was at the end of the fit already).
    - **The code** each part ran (``suite.run_record.code_version``): a run requeued after a commit continued under
      other code, and its ``metrics.json`` says so (:meth:`code`).
    - **The settings** each part trained under that a resumed run may change (:data:`PART_SETTINGS`: the batch, the
      number of processes, the accumulation, the precision, gradient clipping; the advice for a run out of memory
      is a smaller batch or bf16, then ``resume=true``): its ``resolved_config.yaml`` holds the last part's alone,
      so ``metrics.json`` lists every part's where they differ (:meth:`settings`) and ``mode=report`` flags it.

    Restored only when a fit resumes (:class:`FitState`): testing a checkpoint changes none of this."""

    def __init__(self, started: float):
        self.started = started  # time.perf_counter() at this process's start of the run
        self.before = 0.0  # seconds of the run's earlier parts
        self.saved: dict[str, float] = {}  # the fit's metrics in the checkpoint resumed from
        self.steps = 0
        self.earlier_code: list = []  # the code versions of the run's earlier parts (None: not recorded)
        self.parts: list[dict] = []  # the settings of each part, with the step it started at
        self._trainer = None

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._trainer = trainer

    def on_train_start(self, trainer, pl_module):
        now = part_settings(trainer)
        before = {k: v for k, v in self.parts[-1].items() if k != "from_step"} if self.parts else None
        if before == now:
            return  # resumed under the settings of its part before: the same part goes on
        if before is not None and trainer.is_global_zero:
            log.warning("this run goes on under other settings than its part before: %s. Its resolved_config.yaml "
                        "holds this part's; metrics.json lists each part's (provenance.settings).",
                        ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in now.items() if before.get(k) != v))
        self.parts.append({"from_step": trainer.global_step, **now})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.started

    def fit_metrics(self, trainer) -> dict[str, float]:
        """The fit's final metrics: this process's; when it trained nothing, those of the checkpoint, updated by
        whatever this process still logged (the last epoch's validation, when the checkpoint was written after
        the epoch's last batch)."""
        current = floats(trainer.callback_metrics)
        return {**self.saved, **current} if self.steps == 0 else current

    def code(self) -> list:
        """The code version of each of the run's parts, in order, a repeat of the previous one left out."""
        from suite.run_record import code_version

        parts = [*self.earlier_code, code_version()]
        return [v for i, v in enumerate(parts) if i == 0 or v != parts[i - 1]]

    def settings(self) -> list[dict] | None:
        """Each part's :data:`PART_SETTINGS` and the step it started at, when they changed between parts; None when
        the run trained under one setting (or its earlier parts did not record theirs)."""
        return [dict(p) for p in self.parts] if len(self.parts) > 1 else None

    def state_dict(self):
        metrics = floats(self._trainer.callback_metrics) if self._trainer is not None else {}
        return {"seconds": self.seconds(), "metrics": metrics, "code": self.code(), "parts": self.parts}

    def load_fit_state(self, state_dict):
        self.parts = [dict(p) for p in state_dict.get("parts", [])]  # none before they were recorded
        self.before = float(state_dict["seconds"])
        self.earlier_code = list(state_dict.get("code", [None]))  # a checkpoint from before this was recorded
        self.saved = {str(k): float(v) for k, v in state_dict.get("metrics", {}).items()}
