"""The contract between a task and the runtime that trains it (``suite/``): :class:`Task`.

The runtime builds every task the same way and asks it only what this class declares, so a new task is a
subclass that fills these in (nothing is looked up with ``getattr``):

- ``layout`` (required): where the attention tokens sit, ``"grid"`` (an image's pixels) or ``"points"`` (a
  point set); the start-up checks refuse attention options that act on the other layout;
- ``check_config(cfg)``: the task's own start-up checks of the composed config, before any data is read;
- ``summaries()``: the networks that ``mode=summary`` and the run record count, with one example input each;
- ``networks()``: the networks that do the work, which ``trainer.compile=true`` compiles (``suite/compile.py``);
  by default those of ``summaries()``;
- ``ddp_find_unused_parameters``: whether DDP must look for parameters without gradients (a GAN's D update
  leaves G out);
- ``validation_options``: the ``eval.*`` / ``metrics.*`` options its validation uses (a resumed run keeps
  them: they decide the best checkpoint);
- ``validation_metrics(cfg)``: the metrics each validation logs, with the direction they improve in: what
  ``monitor`` may choose the best checkpoint by (checked at start-up, ``suite/validate.py``);
- ``step_metrics``: the training metrics it logs per step only (their value at the end of fit is one batch's),
  which ``metrics.json`` leaves out as it leaves out every last-batch value (``*_step``): its ``train/*`` are
  epoch means (``train/loss_epoch``) or nothing;
- ``weights_options``: which ``model.<option>=PATH`` loads published weights into which of its networks
  (``{"weights": "net"}`` by default); the runtime takes these options out of ``model`` before building the
  task and then calls :meth:`Task.load_weights` (``tasks/nets/weights.py`` reads the files).

Best-so-far validation metrics are tracked here, once: the metric the run monitors (``monitor``: the
``metric`` and ``mode`` that select the best checkpoint) and any the task adds in ``also_best``, each logged
as ``<metric>_best`` by :meth:`Task.log_best`, and kept in checkpoints, so a resumed run keeps its best.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import lightning as L
import torch
from torchmetrics import MaxMetric, MeanMetric, MinMetric

LAYOUTS = ("grid", "points")


class BestMixin:
    """The best so far of a validation metric, NaN until a value that is not NaN has come. torchmetrics' maximum
    and minimum drop NaN values (with a warning at every update) and, having seen no other, report where they
    start, -inf and +inf: a metric the data leaves undefined at every validation (segmentation's kappa where one
    class fills every image, ``Task.undefined_metrics``) logged ``val/kappa_best=-inf``, a value no epoch had.
    ``seen`` (1 once a value was not NaN) is a state beside the best: synced across processes (max) and kept in
    checkpoints."""

    def __init__(self):
        super().__init__(nan_strategy="ignore")  # NaN is dropped, as before, without a warning per validation
        self.add_state("seen", default=torch.tensor(0.0), dist_reduce_fx="max")

    def update(self, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float32, device=self.seen.device)
        super().update(value)
        self.seen = torch.maximum(self.seen, (~value.isnan()).any().float())  # on the device: no host sync

    def compute(self) -> torch.Tensor:
        best = super().compute()
        return torch.where(self.seen > 0, best, torch.full_like(best, float("nan")))


class BestMax(BestMixin, MaxMetric):
    pass


class BestMin(BestMixin, MinMetric):
    pass


MODES = {"max": BestMax, "min": BestMin}


def best_attribute(metric: str) -> str:
    """The module attribute holding a metric's best so far: ``val/oa`` -> ``val_oa_best`` (checkpoint keys)."""
    return metric.replace("/", "_") + "_best"


class Task(L.LightningModule):
    """A trainable task: a LightningModule with the declarations the runtime relies on (module docstring).

    Args:
        monitor: ``{"metric": "val/oa", "mode": "max"}``, the run's ``monitor`` config; ``None`` tracks only
            ``also_best`` (a task built outside a run, as in unit tests).
    """

    layout: ClassVar[str]
    ddp_find_unused_parameters: ClassVar[bool] = False
    # Validation metrics whose best so far is logged beside the monitored one, with their direction.
    also_best: ClassVar[Mapping[str, str]] = {}
    # Training metrics logged per step only: their final value is the last batch's, so metrics.json leaves them out.
    step_metrics: ClassVar[tuple[str, ...]] = ()
    # model.<option> -> the attribute (dotted) of the network its weights file is loaded into.
    weights_options: ClassVar[Mapping[str, str]] = {"weights": "net"}
    # Evaluation options (under eval / metrics) that validation uses too, so that they decide the best checkpoint:
    # a run trains on from a checkpoint only under its own (suite.resume.check_same_recipe), while options of the
    # test alone (a number of votes) may change.
    validation_options: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if getattr(cls, "layout", None) not in LAYOUTS:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} must declare `layout` as one of {LAYOUTS} "
                            "(where its attention tokens sit: an image grid or a point set); the runtime checks "
                            "attention options against it.")

    def __init__(self, monitor: Mapping | None = None):
        super().__init__()
        # "<split>/<metric>" -> why: the evaluation metrics whose last value this process logged is NaN because the
        # split's data leaves them undefined (a task's scores say so), not because the network's output was not a
        # number. trainer.on_nan's check of the evaluation (suite/guard.py) passes over them and metrics.json
        # records them under "undefined".
        self.undefined_metrics: dict[str, str] = {}
        tracked = dict(self.also_best)
        if monitor:
            tracked[str(monitor["metric"])] = str(monitor.get("mode", "min"))
        self.best_modes: dict[str, str] = {}
        for metric, mode in tracked.items():
            if mode not in MODES:
                raise ValueError(f"monitor.mode={mode!r} for {metric} is not known: use max or min.")
            best = MODES[mode]()
            best.persistent(True)  # in the checkpoint: a resumed run keeps its best so far
            setattr(self, best_attribute(metric), best)
            self.best_modes[metric] = mode

    def load_weights(self, paths: Mapping[str, str | None]) -> dict[str, str]:
        """Load each given ``model.<option>`` weights file (``paths``: option -> PATH or None) into its network;
        returns option -> the key layout the file was in (``own`` or ``official``)."""
        from .nets.weights import load_weights

        loaded = {}
        for option, path in paths.items():
            if path:
                net = self
                for name in self.weights_options[option].split("."):
                    net = getattr(net, name)
                loaded[option] = load_weights(net, str(path), f"model.{option}",
                                              prefixes=[self.weights_options[option] + "."])  # this task's ckpt
        return loaded

    @classmethod
    def check_config(cls, cfg) -> None:
        """Start-up checks of the composed config (``cfg``: the whole run config), before any data is read.
        Raise :class:`attention.errors.UserError` naming the option; the default checks nothing."""

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        """The metrics each validation of a run under ``cfg`` logs, each with the direction it improves in
        (``"max"`` or ``"min"``): the choices of ``monitor.metric`` and the ``monitor.mode`` each needs. Empty (the
        default): not declared, and ``monitor`` is not checked before the first validation."""
        return {}

    @classmethod
    def released_weights(cls, cfg, option: str) -> str | None:
        """The released files that ``model.<option>`` loads (e.g. PCT_Pytorch's model.t7), named by the start-up
        checks' messages before any network is built; None when the network has none."""
        from .nets.weights import released_weights

        return released_weights(cfg.task.name, cfg.model, option)

    @property
    def example_input_array(self):
        """One sample for summaries (Lightning's at the start of fit), as the trainer's precision plugin gives the
        network its batches: in ``trainer.precision=64-true`` float64, in ``bf16-true`` bfloat16 (Lightning passes
        it as it was made, float32, to the converted network, and every task crashed at the start of fit)."""
        example = self._example_input_array
        if example is None or self._trainer is None:
            return example
        return self._trainer.precision_plugin.convert_input(example)

    @example_input_array.setter
    def example_input_array(self, example) -> None:
        self._example_input_array = example

    def summaries(self) -> list[tuple[str, torch.nn.Module, torch.Tensor | tuple]]:
        """(name, network, example input for one sample) of each network counted by ``mode=summary``; a task
        with one network returns it unnamed."""
        return [("", self.net, self.example_input_array)]

    def networks(self) -> list[tuple[str, torch.nn.Module]]:
        """(name, network) of each network that ``trainer.compile=true`` compiles in place (``suite/compile.py``):
        by default those :meth:`summaries` counts, the ones a training step runs. A network only evaluated (an EMA
        copy) may be added by a task whose evaluation is worth compiling."""
        return [(name, net) for name, net, _ in self.summaries()]

    def log_best(self, values: Mapping[str, float | torch.Tensor]) -> None:
        """Update the best so far of every tracked metric in ``values`` (this validation's epoch values) and log
        it as ``<metric>_best``. Nothing happens during Lightning's sanity check, which is not an epoch."""
        if self.trainer.sanity_checking:
            return
        for metric, value in values.items():
            if metric in self.best_modes:
                best = getattr(self, best_attribute(metric))
                best(value)
                self.log(f"{metric}_best", best.compute(), sync_dist=True)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Best-so-far states are kept for the metrics this run tracks: a checkpoint written while another
        metric was monitored loads, its other best values dropped and this run's starting afresh."""
        state = checkpoint.get("state_dict")
        if state is None:
            return
        mine = {k: v for k, v in self.state_dict().items() if self._is_best_key(k)}
        for key in [k for k in state if self._is_best_key(k) and k not in mine]:
            del state[key]
        for key, value in mine.items():
            head, _, tail = key.partition(".")
            kept = [state[f"{head}.{t}"] for t in ("max_value", "min_value") if f"{head}.{t}" in state]
            if tail == "seen" and key not in state and kept:  # written before `seen`: a finite best was a value
                state[key] = torch.isfinite(kept[0]).to(value)
            state.setdefault(key, value)

    @staticmethod
    def _is_best_key(key: str) -> bool:
        head, _, tail = key.partition(".")
        return head.endswith("_best") and tail in ("max_value", "min_value", "seen")


class DeviceMean(MeanMetric):
    """A weighted mean updated on the device, without a host synchronisation: ``mean(value, weight)``. A base: its
    subclasses say what a NaN or infinite value does (``drop_non_finite``).

    torchmetrics' ``MeanMetric`` drops NaN values by asking the host (``if nans.any()``), a wait for the GPU in every
    step; its ``nan_strategy="disable"`` does not ask, but ignores the weights (every value counts once). Both are
    wrong here: a dropped NaN would hide a diverged network, an unweighted mean would be wrong across batch sizes.
    """

    drop_non_finite: ClassVar[bool]

    def update(self, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        value = value.detach().to(self.mean_value.dtype)
        if isinstance(weight, torch.Tensor):
            weight = torch.broadcast_to(weight.to(device=value.device, dtype=self.weight.dtype), value.shape)
        # a number stays a scalar operand: torch.as_tensor(number, device="cuda") would be a blocking copy
        if self.drop_non_finite:  # decided on the device: weight 0 and value 0 (NaN * 0 is NaN)
            finite = torch.isfinite(value)
            weight = finite.to(self.weight.dtype) * weight
            value = torch.where(finite, value, 0.0)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum() if isinstance(weight, torch.Tensor) else weight * value.numel()


class TrainLoss(DeviceMean):
    """The running mean of the training loss: ``train_loss(loss)``. A non-finite loss (NaN or infinite: a batch
    that ``trainer.on_nan=skip`` drops) enters with weight 0: the mean is that of the finite losses, and a step's own
    value (the ``on_step`` log) is NaN when its loss was not finite."""

    drop_non_finite = True


class EvalLoss(DeviceMean):
    """An evaluation loss, the mean over a split weighted by batch size: ``val_loss(loss, len(batch))``; exact
    across ranks that evaluate different numbers of samples (``self.log``'s ``sync_dist`` would average the ranks'
    means). A NaN or infinite batch makes the split's mean NaN or infinite, as it is: dropped, it would leave a
    finite loss over fewer samples that ``trainer.on_nan``'s check of the evaluation (``suite/guard.py``) cannot
    see."""

    drop_non_finite = False
