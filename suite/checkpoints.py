"""A run's checkpoints: which weights they hold (identity), and that a run always leaves them.

- Every checkpoint stores the task name and attention config it was trained with (``checkpoint["suite"]``,
  :class:`RunIdentity`); :func:`check_checkpoint` refuses to resume or test one from another task or variant,
  naming what it was trained with.
- ``checkpoints/best-epoch<e>-step<s>.ckpt``: the best so far by ``monitor`` (Lightning's ModelCheckpoint, which
  here follows a run folder that was moved or copied: :class:`RunCheckpoint`).
- ``checkpoints/last.ckpt`` (:class:`LastCheckpoint`): rewritten after every validation, improved or not, and at
  the end of fit however it ends: normally, at ``max_steps`` or ``max_time``, or interrupted (Ctrl-C, SIGTERM),
  so a run that never validates still leaves its weights. The run logs where it is.

Checkpoints are written through the trainer's checkpoint IO (``suite/checkpoint_io.py``: temporary file, fsync,
rename), so a kill during a write keeps the previous file whole.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

import attention
from attention.errors import UserError

log = logging.getLogger(__name__)
LAST = "last"
# What ends fit early but leaves consistent weights worth keeping: Ctrl-C and SIGTERM as Lightning handles them.
# Errors do not count (a non-finite loss with trainer.on_nan=stop names the last checkpoint written before it).
INTERRUPTS = (KeyboardInterrupt, SIGTERMException)


def checkpoint_callbacks(out_dir: Path, monitor: dict, identity: dict) -> tuple[ModelCheckpoint, LastCheckpoint,
                                                                                   RunIdentity]:
    """The best checkpoint by ``monitor`` (``{"metric", "mode"}``), ``last.ckpt`` and the identity they carry."""
    best = RunCheckpoint(dirpath=out_dir / "checkpoints", filename="best-epoch{epoch:03d}-step{step:06d}",
                         monitor=monitor["metric"], mode=monitor["mode"], auto_insert_metric_name=False)
    return best, LastCheckpoint(out_dir / "checkpoints"), RunIdentity(identity)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, which follows its run folder when the folder moves.

    Lightning keeps the absolute path of the checkpoint folder in every checkpoint. A run resumed from another path
    to that folder keeps only ``best_model_path``, still the old path, and drops the best score and the best
    checkpoints. This happens when the folder was copied or moved (scratch to project storage, another cluster), or
    when another node mounts the file system elsewhere. The first validation after the resume was then "best"
    whatever its score, and the run tested it instead of the better checkpoint from before the move. Here the paths
    that named files of the old folder name the same files in this one, and everything is restored."""

    _said_moved = False

    # A NaN or infinite monitored value is the worst there is, never the best. Lightning compares it as it is when it
    # already holds its top k: an infinite one in the better direction (-inf with mode=min, +inf with mode=max) was
    # best from then on, and the run tested that checkpoint whatever came after. (A NaN it saves only while it holds
    # fewer than k, scored as the worst; that stays so: a run whose every validation is non-finite keeps its first,
    # and fails at its end, suite/guard.py.)
    def check_monitor_top_k(self, trainer, current=None) -> bool:
        return super().check_monitor_top_k(trainer, self._worst_unless_finite(current))

    def _update_best_and_save(self, current, trainer, monitor_candidates) -> None:
        super()._update_best_and_save(self._worst_unless_finite(current), trainer, monitor_candidates)

    def _worst_unless_finite(self, current):
        if isinstance(current, torch.Tensor) and not bool(torch.isfinite(current).all()):
            return torch.tensor(float("inf") if self.mode == "min" else float("-inf"), device=current.device)
        return current

    def load_state_dict(self, state_dict: dict) -> None:
        old, best = state_dict.get("dirpath"), state_dict.get("best_model_path")
        # the folder moved when its best checkpoint is here (or it had none yet); a run started elsewhere from this
        # checkpoint (ckpt_path= into a new folder) keeps Lightning's behaviour: a new folder, a new best
        here = not best or (Path(self.dirpath or "") / Path(best).name).is_file()
        if old and self.dirpath and old != self.dirpath and here:
            def moved(path):
                if isinstance(path, str) and path and Path(path).parent == Path(old):
                    return str(Path(self.dirpath) / Path(path).name)
                return path

            paths = ("best_model_path", "kth_best_model_path", "last_model_path")
            state_dict = {**state_dict, "dirpath": self.dirpath,
                          "best_k_models": {moved(k): v for k, v in (state_dict.get("best_k_models") or {}).items()},
                          **{key: moved(state_dict[key]) for key in paths if key in state_dict}}
            if self.monitor and not self._said_moved:  # once, for the best checkpoint (not for last.ckpt's too)
                log.info("checkpoint folder moved from %s to %s: its best checkpoints are read here", old, self.dirpath)
                self._said_moved = True
        super().load_state_dict(state_dict)


class LastCheckpoint(RunCheckpoint):
    """``last.ckpt`` after every validation and at the end of fit (module docstring).

    Lightning's ``save_last=True`` rewrites it only when a best checkpoint is saved, so a pre-empted run would lose
    every epoch since its last improvement; and a run without validation (``limit_val_batches=0``) or one that
    stops between validations would end with no checkpoint at all.
    """

    def __init__(self, dirpath: Path):
        super().__init__(dirpath=dirpath, filename=LAST, monitor=None, save_top_k=1, enable_version_counter=False)
        self._cut_validation = False  # saving on an interruption inside a validation of fit
        self._interrupted = False  # saving on an interruption of fit
        self._saved_validating = False  # the last save was at a validation's end

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from suite.validate import check_validation_batches

        super().on_train_start(trainer, pl_module)
        check_validation_batches(trainer)  # no validation, so no last.ckpt, inside an accumulation window

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_final(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, INTERRUPTS) and trainer.state.fn == "fit":
            self._cut_validation, self._interrupted = trainer.validating, True
            try:
                self._save_final(trainer)
            finally:
                self._cut_validation = self._interrupted = False

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._cut_validation:
            validate_again_on_resume(checkpoint)
        elif self._interrupted:
            start_next_epoch_on_resume(checkpoint)

    def _save_final(self, trainer: L.Trainer) -> None:
        """Save unless nothing was trained since the last save (or this is a ``fast_dev_run``), then say where.
        Every rank takes part (the save ends with a barrier): Lightning calls these hooks on all of them, and on a
        SIGTERM all ranks stop together."""
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        path = Path(self.format_checkpoint_name({}, LAST))
        # Saved again at the step of the last save when that was at a validation's end, in the last batch of a run
        # limited by epochs (callbacks.validate_at_end, or an interval landing there): resumed from those loops,
        # Lightning takes one more training batch and validates it, so a finished run resumed trained on. A run
        # ended by trainer.max_steps is finished at its step count whatever its loops say.
        again = self._saved_validating and not self._interrupted and not 0 < trainer.max_steps <= trainer.global_step
        if self._last_global_step_saved != trainer.global_step or again:  # the same decision on every rank
            # Lightning's own save: through the checkpoint IO, and loggers (W&B) told of it.
            self._save_checkpoint(trainer, str(path))
            self.last_model_path = str(path)
        if trainer.is_global_zero and path.is_file():  # a run that took no step has nothing to keep
            log.info("last checkpoint: %s (step %d)", path, trainer.global_step)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._saved_validating = trainer.validating


def validate_again_on_resume(checkpoint: dict) -> None:
    """Make a checkpoint saved inside a validation of fit (interrupted: Ctrl-C, SIGTERM) run that whole validation
    again when resumed, before training on.

    A SIGTERM during the last training batch of an epoch, or during the validation that follows it, stops the run
    at the end of a validation batch (Lightning, ``suite/sigterm.py``). Lightning's loops then hold a finished
    training batch and a validation begun: resumed, they took the validation for done, and skipped it. That epoch
    was never validated nor a candidate for the best checkpoint, and a run that exited 0 had another best
    checkpoint and test score than the run that never stopped. Lightning validates again on resume only from the
    stage it records as "inside a validation batch" (its batch progress one batch started and not processed); the
    validation's progress is set to that stage, at its first batch, so the resumed run validates from the start."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]
    done = progress["current"]["completed"]  # the validation batches finished before the interruption
    for counts, before in ((progress["total"], progress["total"]["completed"] - done), (progress["current"], 0)):
        counts.update(ready=before + 1, started=before + 1, processed=before, completed=before)
    progress["is_last_batch"] = False


def start_next_epoch_on_resume(checkpoint: dict) -> None:
    """Make a checkpoint saved between two epochs (interrupted after an epoch's last batch and its end) start the
    next epoch at its first batch when resumed.

    A SIGTERM or Ctrl-C during an epoch's last training batch stops the run once that epoch has ended (Lightning
    checks for it at the end of the epoch), before the next one has started: its loops count the epoch complete,
    with the epoch's batches still counted as served in it. A run limited by ``trainer.max_steps`` (segmentation,
    the GAN) is always restarted as if inside an epoch (Lightning's ``FitLoop.restarting``), so those counts were
    kept: the resumed run's next epoch ended after one batch, the rest of its samples never seen, and the run that
    exited 0 had other weights, another best checkpoint and test score than the run that never stopped. Set here as
    Lightning sets them when a new epoch starts (``_TrainingEpochLoop.reset``), which an epoch-limited run gets."""
    loops = checkpoint["loops"]["fit_loop"]
    epochs = loops["epoch_progress"]["current"]
    if not epochs["ready"] == epochs["started"] == epochs["processed"] == epochs["completed"]:
        return  # inside an epoch: its counts are where it continues
    batches = loops["epoch_loop.batch_progress"]
    batches["current"] = {key: 0 for key in batches["current"]}
    batches["is_last_batch"] = False
    schedulers = loops["epoch_loop.scheduler_progress"]
    schedulers["current"] = {key: 0 for key in schedulers["current"]}
    optimizer = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    for event in optimizer.values():  # step, zero_grad
        event["current"] = {key: 0 for key in event["current"]}
    validation = loops["epoch_loop.val_loop.batch_progress"]
    validation["total"] = {key: 0 for key in validation["total"]}  # counts the validations of one epoch


class RunIdentity(L.pytorch.callbacks.Callback):
    """Stores the task name and attention config in every checkpoint (``checkpoint["suite"]``)."""

    def __init__(self, identity: dict):
        self.identity = identity

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["suite"] = self.identity


def checkpoint_step(path: str | Path) -> int | None:
    """The global step a checkpoint was saved at (None if it records none)."""
    from suite.checkpoint_io import safe_torch_load

    step = safe_torch_load(path, f"ckpt_path={path}", mmap=True).get("global_step")
    return int(step) if step is not None else None


def check_checkpoint(path: str, identity: dict, module=None, config: dict | None = None) -> None:
    """Refuse a checkpoint written by another task or attention variant, naming what it was trained with; given
    the run's ``module`` (and composed ``config``), one whose weights do not fit it (:func:`check_fit`)."""
    from suite.checkpoint_io import safe_torch_load

    state = safe_torch_load(path, f"ckpt_path={path}", mmap=True)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise UserError(f"ckpt_path={path} is not a Lightning checkpoint (no 'state_dict' entry): pass a checkpoint "
                        "written by run.py (outputs/<task>/<attn>/<run>/checkpoints/*.ckpt).")
    stored = state.get("suite")
    if not stored:
        return  # written before checkpoints carried their identity: Lightning reports any mismatch
    if stored["task"] != identity["task"]:
        raise UserError(f"ckpt_path={path} was trained with task={stored['task']}, but this run has "
                        f"task={identity['task']}: pass task={stored['task']} (and its attn) or another checkpoint.")
    want, have = stored["attn"], identity["attn"]
    # An option added to a variant after the checkpoint was written counts as its default there.
    default = attention.options(want.get("name")) if want.get("name") in attention.names() else {}

    def value(cfg, key):
        v = cfg.get(key, default.get(key))
        return list(v) if isinstance(v, tuple) else v

    keys = sorted(k for k in set(want) | set(have) if value(want, k) != value(have, k))
    if keys:
        diff = ", ".join(f"attn.{k}={value(want, k)!r} (here {value(have, k)!r})" for k in keys)
        raise UserError(f"ckpt_path={path} was trained with attn={want.get('name')} and options differing from this "
                        f"run's: {diff}. Pass attn={want.get('name')} with the same options to load it.")
    if module is not None:
        check_fit(path, state["state_dict"], module, config or {})


# Options that do not shape a network: left out when a checkpoint's run config is compared with this run's.
OPERATIONAL = {"root", "download", "url", "md5", "num_workers", "batch_size", "eval_batch_size", "on_bad_file",
               "seed", "verify_images", "verify_limit", "weights", "g_weights", "cache_dir"}


def check_fit(path: str, saved: dict, module, config: dict) -> None:
    """Refuse a checkpoint whose weights do not fit ``module`` (the same task and attention with other model,
    task or data options: a layer width, the number of classes), which Lightning reported as a traceback of
    every mismatched tensor. The message names the first mismatches and, from the run folder the checkpoint is
    in (its ``resolved_config.yaml``), the options that differ from this run's."""
    own = module.state_dict()
    best = getattr(module, "_is_best_key", lambda key: False)  # best-so-far states: reconciled on load (tasks/base)
    wrong = [f"{k}: {tuple(v.shape)} in the checkpoint, {tuple(own[k].shape)} here" for k, v in saved.items()
             if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)]
    wrong += [f"{k}: not in the checkpoint" for k in own if k not in saved and not best(k)]
    wrong += [f"{k}: not in this run's network" for k in saved if k not in own and not best(k)]
    if not wrong:
        return
    shown = "; ".join(wrong[:3]) + (f"; {len(wrong) - 3} more" if len(wrong) > 3 else "")
    differ = options_differing(path, config)
    said = (f" Its run ({differ[0]}) had " + ", ".join(differ[1:]) + ": pass those options to load it.") \
        if differ else (" Pass the model, task and data options it was trained with (its run folder's "
                         "resolved_config.yaml has them).")
    raise UserError(f"ckpt_path={path} does not fit this run's network ({shown}).{said}")


def run_config_of(path: str) -> Path | None:
    """The ``resolved_config.yaml`` of the run that wrote checkpoint ``path`` (``<run>/checkpoints/*.ckpt``, or
    ``<run>/hpc_ckpt_<n>.ckpt``), or None when it is not beside it."""
    ckpt = Path(path)
    return next((c for c in (ckpt.parent.parent / "resolved_config.yaml", ckpt.parent / "resolved_config.yaml")
                 if c.is_file()), None)


def leaves(tree, prefix: str = ""):
    """``(dotted key, value)`` of each leaf of a nested config container: ``{"a": {"b": 1}}`` -> ``("a.b", 1)``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def changed_options(before: dict, config: dict) -> dict[str, tuple]:
    """``{key: (value in before, value in config)}`` for each model, task or data option (not an
    :data:`OPERATIONAL` one) that both configs set to different values: how a test command's network differs from
    the one its checkpoint's run trained."""
    out = {}
    for section in ("model", "task", "data"):
        was, now = dict(leaves(before.get(section) or {}, f"{section}.")), dict(leaves(config.get(section) or {},
                                                                                       f"{section}."))
        out.update({k: (was[k], now[k]) for k in sorted(was.keys() & now.keys())
                    if was[k] != now[k] and k.rsplit(".", 1)[-1] not in OPERATIONAL})
    return out


def options_differing(path: str, config: dict) -> list[str]:
    """[the run config beside checkpoint ``path``, then ``key=<its value> (here <this run's>)`` for each option
    :func:`changed_options` finds], or [] when there is no such config or nothing differs."""
    from omegaconf import OmegaConf

    if (saved := run_config_of(path)) is None:
        return []
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
    except Exception:  # noqa: BLE001 - unreadable: the tensors' message stands alone
        return []
    out = [f"{k}={was!r} (here {now!r})" for k, (was, now) in changed_options(before, config).items()]
    return [str(saved), *out[:6]] if out else []
