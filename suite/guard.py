"""``trainer.on_nan``: what a non-finite training loss does to a run.

- ``stop`` (default): the run stops before the bad loss reaches the weights, with
  a UserError (exit code 2) naming the step, the batch and the newest checkpoint
  on disk, all of which were written from finite weights.
- ``skip``: the batch is dropped (no backward, no optimizer step; normalisation
  buffers such as BatchNorm running statistics are restored to their values
  before the batch, since its forward pass already updated them) and counted;
  the count is logged as ``train/skipped_batches`` and reported at the end.
- ``off``: no check (Lightning's own behaviour).

The check reads the loss on the host before the update, one device-to-host
synchronisation per step; ``off`` saves it where a GPU pipeline matters more.

:class:`NonFiniteGuard` is a callback that works for every task without their
cooperation: it wraps the module's ``training_step`` (automatic optimisation:
returning ``None`` makes Lightning skip the batch) or ``manual_backward`` (manual
optimisation, the GAN: a skipped backward sets every gradient to ``None``, also
those of earlier backward calls of the same update (the GAN's discriminator backs
up its real and fake terms one after the other), so the task's
``optimizer.step()`` changes nothing). Under DDP the ranks agree first (one boolean all-reduce per check), so
all of them skip or stop together instead of deadlocking.

Evaluation is checked too, unless ``off``: a validation or test metric (``val/*``, ``test/*``) that is NaN or
infinite in the run's record fails the run once everything is written (``metrics.json``, the checkpoints, the
loggers' files), with a :class:`NonFiniteMetrics` (exit code 2, as a non-finite training loss) naming the
metrics, their split and the checkpoint they scored (:meth:`NonFiniteGuard.evaluation_error`), so that a sweep or a
script sees the failure. ``skip`` drops training batches only: an evaluation has no batch to drop without changing
its metric, so it fails as under ``stop``. Each non-finite validation during fit is also logged when it happens
(:meth:`NonFiniteGuard.on_validation_end`); it does not stop training (the weights are what the training loss
check guards), and the best checkpoint passes over it (``suite.checkpoints.RunCheckpoint``). Under DDP the ranks
agree on the failure (one boolean all-reduce). A metric that the split's data leaves undefined is NaN without any
fault (segmentation's kappa where target and prediction are one class in every pixel): the task lists it in
``undefined_metrics`` with the reason, it is logged as a warning and recorded in metrics.json (``"undefined"``), and
the check passes over it.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import lightning as L
import torch

from attention.errors import UserError

MODES = ("stop", "skip", "off")
log = logging.getLogger(__name__)


class NonFiniteLoss(UserError):
    """A training loss was NaN or infinite and ``trainer.on_nan=stop``."""


class NonFiniteMetrics(UserError):
    """A validation or test metric of the run's record was NaN or infinite and ``trainer.on_nan`` is not ``off``."""


EVALUATED = {"val/": "the validation split", "test/": "the test split"}  # metric prefix -> the split it scores


def non_finite(metrics, undefined=()) -> dict[str, float]:
    """The evaluation metrics (``val/*``, ``test/*``) of ``metrics`` that are NaN or infinite, but for those in
    ``undefined`` (and their ``_best``): NaN where the data leaves them undefined (``Task.undefined_metrics``)."""
    return {k: float(v) for k, v in metrics.items()
            if k.startswith(tuple(EVALUATED)) and isinstance(v, (int, float)) and not math.isfinite(v)
            and k not in undefined and k.removesuffix("_best") not in undefined}


def undefined_metrics(module, record=None) -> dict[str, str]:
    """The evaluation metrics that ``module`` (a task) logged NaN because its data leaves them undefined, and those
    a run ``record`` (metrics.json) lists under ``"undefined"``: name -> why."""
    kept = (record or {}).get("undefined")
    return {**(kept if isinstance(kept, dict) else {}), **getattr(module, "undefined_metrics", {})}


class NonFiniteGuard(L.pytorch.callbacks.Callback):
    def __init__(self, mode: str = "stop"):
        if mode not in MODES:
            raise UserError(f"trainer.on_nan={mode!r} is not known: use stop (end the run at the first NaN/inf "
                            "loss), skip (drop such batches and count them) or off (no check).")
        self.mode = mode
        self.skipped: list[int] = []  # global steps whose batch was dropped
        self._snapshot: list[torch.Tensor] | None = None
        self.validated_at: int | None = None  # the global step of the fit's last validation
        self.bad_validations: list[int] = []  # global steps of validations with a non-finite metric

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.mode == "off" or stage != "fit" or getattr(pl_module, "_nan_guarded", False):
            return
        pl_module._nan_guarded = True
        if pl_module.automatic_optimization:
            step = pl_module.training_step

            @functools.wraps(step)
            def training_step(*args, **kwargs):
                out = step(*args, **kwargs)
                loss = out["loss"] if isinstance(out, dict) else out
                if loss is None or self._finite(trainer, pl_module, loss, "loss"):
                    return out
                return None  # Lightning: no backward, no optimizer step for this batch

            pl_module.training_step = training_step
        else:
            backward = pl_module.manual_backward

            @functools.wraps(backward)
            def manual_backward(loss, *args, **kwargs):
                if self._finite(trainer, pl_module, loss, "loss"):
                    return backward(loss, *args, **kwargs)
                for p in pl_module.parameters():  # no part of this update may reach the weights
                    p.grad = None
                return None

            pl_module.manual_backward = manual_backward

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.mode == "skip":  # the forward pass updates BatchNorm statistics before the loss is known
            self._snapshot = [b.detach().clone() for b in pl_module.buffers()]

    def on_train_end(self, trainer, pl_module) -> None:
        if self.skipped:
            shown = ", ".join(map(str, self.skipped[:10])) + (" ..." if len(self.skipped) > 10 else "")
            log.warning("skipped %d training batch(es) with a NaN or infinite loss (trainer.on_nan=skip), at "
                        "step(s) %s", len(self.skipped), shown)

    def on_validation_end(self, trainer, pl_module) -> None:
        """Note (and log at once: a long run's log says so when it happens) a validation whose metrics are not all
        finite; the run fails at its end (:meth:`evaluation_error`). One host read of the logged values per
        validation."""
        if self.mode == "off" or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.validated_at = int(trainer.global_step)
        bad = non_finite({k: float(v) for k, v in trainer.callback_metrics.items()}, undefined_metrics(pl_module))
        bad = {k: v for k, v in bad.items() if k.startswith("val/")}
        if not bad:
            return
        self.bad_validations.append(self.validated_at)
        if trainer.is_global_zero:
            monitor = getattr(trainer.checkpoint_callback, "monitor", None)
            passed = f"; the best checkpoint (by {monitor}) passes over it" if monitor in bad else ""
            log.warning("the validation at step %d (epoch %d) gave %s: the run will end with an error once it has "
                        "written its results (trainer.on_nan=%s)%s", trainer.global_step, trainer.current_epoch,
                        _listed(bad), self.mode, passed)

    def evaluation_error(self, metrics: dict, trainer, tested: str, record: Path | None) -> NonFiniteMetrics | None:
        """The error for a run whose recorded ``metrics`` hold a NaN or infinite validation or test metric (None:
        all finite, or ``trainer.on_nan=off``). ``tested``: what the test scored (a checkpoint, or words for the
        weights it used); ``record``: the metrics.json written. Every rank must call it: under DDP they agree
        (a rank whose own values are finite fails too when another's are not)."""
        if self.mode == "off":
            return None
        bad = non_finite(metrics, undefined_metrics(trainer.lightning_module, metrics))
        failed = bool(bad)
        if trainer.world_size > 1:  # every rank raises, or none: the others would wait in the next collective
            failed = bool(trainer.strategy.reduce_boolean_decision(failed, all=False))
        if not failed:
            return None
        parts = []
        for prefix, split in EVALUATED.items():
            these = {k: v for k, v in bad.items() if k.startswith(prefix)}
            if not these:
                continue
            if prefix == "test/":
                parts.append(f"{_listed(these)} on {split}, scoring {tested}")
                continue
            when = f" at step {self.validated_at}" if self.validated_at is not None else ""
            first = self.bad_validations[0] if self.bad_validations else None
            earlier = f", non-finite since the validation at step {first}" if first is not None \
                and first != self.validated_at else ""
            parts.append(f"{_listed(these)} on {split}, from the last validation{when}{earlier}")
        found = "; ".join(parts) if parts else "NaN or infinite values on another process"
        module = trainer.lightning_module
        if module is not None and not all(bool(torch.isfinite(t).all()) for t in
                                          [*module.parameters(), *module.buffers()] if t.is_floating_point()):
            found += (". The weights evaluated last hold NaN or infinite values themselves: the training diverged "
                      "in its last updates")
        written = f"{record}, the checkpoints and the loggers' files are written" if record is not None else \
            "the checkpoints and the loggers' files are written (no metrics.json: it is rank zero's)"
        return NonFiniteMetrics(
            f"The run's evaluation is not a number: {found}. Nothing is lost ({written}), but its result cannot be "
            f"compared, so the run fails (trainer.on_nan={self.mode}: skip drops training batches only; off accepts "
            "such a run). Usual causes: weights that diverged in the last updates, after the last finite training "
            "loss (lower optim.optimizer.lr, or clip gradients with ++trainer.gradient_clip_val=1.0); float16 "
            "overflow in evaluation (trainer.precision=bf16-mixed or 32); NaN or infinite values in the validation "
            "or test data; normalisation statistics (BatchNorm running means and variances, used only in "
            "evaluation) gone non-finite."
        )

    def _finite(self, trainer, pl_module, loss: torch.Tensor, name: str) -> bool:
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:  # every rank takes the same branch, or DDP's next all-reduce hangs
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return True
        where = f"step {trainer.global_step} (epoch {trainer.current_epoch}, batch {trainer.fit_loop.batch_idx})"
        if self.mode == "stop":
            raise NonFiniteLoss(
                f"The training {name} became {float(loss.detach().float().flatten()[0])} at {where}, so the run "
                f"stopped before it reached the weights (trainer.on_nan=stop). {_last_checkpoint(trainer)} Usual "
                "causes: a learning rate too high for this batch size (lower optim.optimizer.lr), float16 overflow "
                "(use trainer.precision=bf16-mixed or 32), or bad input values. To drop such batches and go on, "
                "set trainer.on_nan=skip."
            )
        if self._snapshot is not None:
            with torch.no_grad():
                for buf, saved in zip(pl_module.buffers(), self._snapshot):
                    buf.copy_(saved)
        self.skipped.append(int(trainer.global_step))
        log.warning("non-finite %s at %s: batch skipped (trainer.on_nan=skip)", name, where)
        pl_module.log("train/skipped_batches", float(len(self.skipped)), on_step=True, on_epoch=False,
                      reduce_fx="max")
        return False


def _listed(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(values.items()))


def _last_checkpoint(trainer) -> str:
    """The newest checkpoint on disk, for the stop message: written before the bad step, so from finite weights."""
    paths = {Path(p) for cb in trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path) if p}
    paths = [p for p in paths if p.is_file()]
    if not paths:
        return "No checkpoint had been written yet."
    newest = max(paths, key=lambda p: p.stat().st_mtime)
    return (f"The last checkpoint, from finite weights, is {newest}; resume with resume=true (same run directory) "
            "once the cause is fixed.")
