"""Optimiser and scheduler from the ``optim`` config (Hydra ``_partial_`` factories)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from hydra.utils import instantiate

from attention.errors import UserError


def build_optimizers(params, optim: Mapping, trainer=None):
    """``optim.optimizer`` and optional ``optim.scheduler`` are partials taking params / the optimiser.

    A cosine ``T_max`` below 1 is ``${trainer.max_epochs}`` of a run bounded by ``trainer.max_steps`` alone
    (``max_epochs=-1``): the run's length in epochs (:func:`run_epochs` of ``trainer``) stands for it. Taken as
    it was, torch's cosine with ``T_max=-1`` swung the rate between ``lr`` and ``eta_min`` every epoch, exit 0."""
    optimizer = instantiate(optim["optimizer"])(params)
    if not optim.get("scheduler"):
        return optimizer
    factory = instantiate(optim["scheduler"])
    t_max = (optim["scheduler"] or {}).get("T_max")
    if isinstance(t_max, int) and t_max < 1:
        if trainer is None or (epochs := run_epochs(trainer)) is None:
            raise UserError(f"optim.scheduler.T_max={t_max}: the cosine schedule needs its length in epochs, taken "
                            "from trainer.max_epochs (-1 when the run is bounded by trainer.max_steps alone). Give "
                            "it, e.g. optim.scheduler.T_max=250, or bound the run by trainer.max_epochs.")
        factory = functools.partial(factory, T_max=epochs)
    scheduler = factory(optimizer)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def updates_per_epoch(trainer) -> int | None:
    """Optimizer steps in one epoch of this process (the last, partial accumulation steps too); None when an epoch
    has no length (an iterable loader)."""
    batches = trainer.num_training_batches
    return None if math.isinf(batches) else max(1, math.ceil(batches / trainer.accumulate_grad_batches))


def run_epochs(trainer) -> int | None:
    """The epochs a run of ``trainer`` trains: its optimizer steps (``estimated_stepping_batches``, which
    ``trainer.max_steps`` bounds) over one epoch's; None when an epoch has no length (an iterable loader)."""
    if trainer.train_dataloader is None:  # as Lightning's estimated_stepping_batches does where it needs the length
        trainer.fit_loop.setup_data()
    steps, per_epoch = trainer.estimated_stepping_batches, updates_per_epoch(trainer)
    if per_epoch is None or math.isinf(steps):
        return None
    return max(1, math.ceil(steps / per_epoch))
