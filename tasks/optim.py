"""Optimiser and scheduler from the ``optim`` config (Hydra ``_partial_`` factories)."""

from __future__ import annotations

from collections.abc import Mapping

from hydra.utils import instantiate


def build_optimizers(params, optim: Mapping):
    """``optim.optimizer`` and optional ``optim.scheduler`` are partials taking params / the optimiser."""
    optimizer = instantiate(optim["optimizer"])(params)
    if not optim.get("scheduler"):
        return optimizer
    scheduler = instantiate(optim["scheduler"])(optimizer)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
