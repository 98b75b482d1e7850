"""Multi-device settings applied by the runtime (``suite/train.py``) around Lightning's Trainer (``trainer=ddp``).

Batch size semantics: ``data.batch_size`` is per process, as in Lightning;
the global batch is ``data.batch_size x devices x num_nodes x
accumulate_grad_batches``. ``optim.scale_lr`` (``null`` | ``linear`` |
``sqrt``) multiplies every learning rate in ``optim`` by (global batch /
``optim.base_batch_size``) or its square root, the batch the rates were
tuned for (by default one process's ``data.batch_size``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import MutableMapping

import torch

from attention.errors import UserError

log = logging.getLogger(__name__)
SCALE_RULES = (None, "linear", "sqrt")


def adjust_trainer_kwargs(trainer: MutableMapping, module) -> None:
    """In place: DDP finds unused parameters for modules that ask for it; no sync BN where torch has none."""
    if trainer.get("strategy") == "ddp" and module.ddp_find_unused_parameters:
        # Parameters without a gradient in some backward pass (a GAN's D update leaves G out): DDP must be told.
        trainer["strategy"] = "ddp_find_unused_parameters_true"
    on_cpu = trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()
    if trainer.get("sync_batchnorm") and on_cpu:
        log.warning("trainer.sync_batchnorm=true needs GPUs (torch's SyncBatchNorm has no CPU kernel): BatchNorm "
                    "statistics stay per process on CPU.")
        trainer["sync_batchnorm"] = False


def check_launch(trainer) -> None:
    """Refuse a local multirun that would start DDP processes itself: Lightning re-runs the command line per
    process, which inside ``-m`` would start the whole sweep again."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if (isinstance(launcher, _SubprocessScriptLauncher) and trainer.world_size > 1
            and not trainer.strategy.cluster_environment.creates_processes_externally
            and HydraConfig.get().mode == RunMode.MULTIRUN):
        raise UserError("trainer=ddp with several devices cannot run inside a local multirun (-m): Lightning starts "
                        "the other processes by re-running the command, which would start the sweep again. Send "
                        "the sweep to SLURM with hydra/launcher=slurm, or run each configuration as its own command.")


def check_scale_rule(rule) -> None:
    if rule not in SCALE_RULES:
        raise UserError(f"optim.scale_lr={rule!r} is not known: use null (off), linear or sqrt.")


def lr_scale(rule: str | None, global_batch: int, base_batch: int) -> float:
    check_scale_rule(rule)
    if rule is None:
        return 1.0
    if base_batch <= 0:
        raise UserError(f"optim.base_batch_size={base_batch} must be a positive batch size.")
    ratio = global_batch / base_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def scale_learning_rates(optim: MutableMapping, factor: float) -> list[str]:
    """Multiply every ``lr`` of the optimiser factories in ``optim`` by ``factor``; returns the keys changed."""
    changed = []
    for name, value in optim.items():
        if isinstance(value, MutableMapping) and "lr" in value and "_target_" in value:
            value["lr"] = float(value["lr"]) * factor
            changed.append(f"optim.{name}.lr")
    return changed


def apply_lr_scaling(optim: MutableMapping, trainer, batch_size: int) -> None:
    """``optim.scale_lr`` applied to ``optim`` (the module's hyper-parameters) for the trainer's world size."""
    rule = optim.get("scale_lr")
    global_batch = batch_size * trainer.world_size * int(trainer.accumulate_grad_batches)
    factor = lr_scale(rule, global_batch, int(optim.get("base_batch_size") or batch_size))
    if factor != 1.0:
        changed = scale_learning_rates(optim, factor)
        log.info("optim.scale_lr=%s: global batch %d, learning rates x %.4g (%s)", rule, global_batch, factor,
                 ", ".join(changed))


def is_rank_zero() -> bool:
    """Before the Trainer exists: the first process of the first node (Lightning's and SLURM's variables)."""
    return all(int(os.environ.get(v, 0)) == 0 for v in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))
