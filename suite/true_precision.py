"""``trainer.precision=bf16-true`` / ``16-true``: Lightning converts the whole LightningModule to that dtype
(``module.to(dtype=...)``), and with it the floating states of the task's torchmetrics metrics, which torchmetrics
guards against ``.half()`` and ``.double()`` (``64-true`` converts with the latter) but not ``.to(dtype)``. In
bfloat16 a running sum of losses stops growing at 256 (its next representable value is 2 away), so a validation
loss averaged in it is wrong while the run exits 0; PCT part segmentation's IoU sums (float64) refused their float64
updates, and the run crashed at its first validation. :class:`MetricDtypes` puts every metric back in the dtype it
was built with after each conversion (``Strategy.setup``, before any hook that updates a metric). The networks'
example inputs follow the precision as the batches do (``tasks.base.Task.example_input_array``), and every task
trains and tests at ``bf16-true`` and ``64-true`` (``tests/test_precision.py``).

``trainer.precision=16-mixed`` on a CPU: :func:`float16_on_cpu`."""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import Metric


def float_dtype(metric: Metric) -> torch.dtype | None:
    """The one dtype of ``metric``'s tensor states where they are all floating point and of one dtype, else None
    (no tensor state, an integer count, or several dtypes: ``Metric.set_dtype`` would convert them all)."""
    states = [getattr(metric, name) for name in metric._defaults]
    dtypes = {s.dtype for s in states if isinstance(s, torch.Tensor)}
    if len(dtypes) != 1 or not all(isinstance(s, torch.Tensor) for s in states):
        return None
    (dtype,) = dtypes
    return dtype if dtype.is_floating_point else None


def float16_on_cpu(trainer_kwargs: dict) -> None:
    """In place, on the trainer's keyword arguments: ``trainer.precision=16-mixed`` (or its alias 16) on a CPU is
    float16 autocast with a GradScaler, as on a GPU (Lightning's ``MixedPrecision("16-mixed", "cpu")``, given as
    a plugin). Lightning by itself runs ``bf16-mixed`` there instead, with a warning, while the run's
    resolved_config.yaml, W&B config and report row said 16-mixed: a 16-mixed and a bf16-mixed run of one seed were
    the same computation under two names. torch has float16 autocast and a GradScaler on CPU."""
    if str(trainer_kwargs.get("precision")) not in ("16-mixed", "16"):
        return
    accelerator = trainer_kwargs.get("accelerator") or "auto"
    if accelerator == "auto":  # as Lightning resolves it (a GPU when there is one)
        from lightning.fabric.utilities.device_parser import _select_auto_accelerator

        accelerator = _select_auto_accelerator()
    if accelerator != "cpu":
        return
    from lightning.pytorch.plugins.precision import MixedPrecision

    del trainer_kwargs["precision"]  # Lightning takes a precision or a precision plugin, not both
    trainer_kwargs["plugins"] = [*(trainer_kwargs.get("plugins") or []), MixedPrecision("16-mixed", "cpu")]


class MetricDtypes(L.pytorch.callbacks.Callback):
    """The task's metrics keep the dtypes they were built with under a ``*-true`` precision (module docstring)."""

    def __init__(self):
        self.built: dict[int, tuple[Metric, torch.dtype]] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        # before Strategy.setup converts the module (Trainer._run calls the setup hooks first)
        for metric in pl_module.modules():
            if isinstance(metric, Metric) and id(metric) not in self.built:
                dtype = float_dtype(metric)
                if dtype is not None:
                    self.built[id(metric)] = metric, dtype

    def _restore(self) -> None:
        for metric, dtype in self.built.values():
            if float_dtype(metric) != dtype:
                metric.set_dtype(dtype)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._restore()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._restore()

    def on_test_start(self, trainer, pl_module) -> None:
        self._restore()
