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
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import lightning as L
import torch

from attention.errors import UserError

MODES = ("stop", "skip", "off")
log = logging.getLogger(__name__)


class NonFiniteLoss(UserError):
    """A training loss was NaN or infinite and ``trainer.on_nan=stop``."""


class NonFiniteGuard(L.pytorch.callbacks.Callback):
    def __init__(self, mode: str = "stop"):
        if mode not in MODES:
            raise UserError(f"trainer.on_nan={mode!r} is not known: use stop (end the run at the first NaN/inf "
                            "loss), skip (drop such batches and count them) or off (no check).")
        self.mode = mode
        self.skipped: list[int] = []  # global steps whose batch was dropped
        self._snapshot: list[torch.Tensor] | None = None

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


def _last_checkpoint(trainer) -> str:
    """The newest checkpoint on disk, for the stop message: written before the bad step, so from finite weights."""
    paths = {Path(p) for cb in trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path) if p}
    paths = [p for p in paths if p.is_file()]
    if not paths:
        return "No checkpoint had been written yet."
    newest = max(paths, key=lambda p: p.stat().st_mtime)
    return (f"The last checkpoint, from finite weights, is {newest}; resume with resume=true (same run directory) "
            "once the cause is fixed.")
