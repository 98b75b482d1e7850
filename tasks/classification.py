"""Image classification with the seed papers' backbones (``task=classification``), DeiT's recipe.

Batches are ``{"image": normalised float (B, 3, S, S), "label": int64 (B,)}``.
The network is ``tasks.nets.backbones.build_backbone(model, attn)``: the
``model`` config names the backbone (``model=focal_t``), ``attn=X`` replaces
the mixer of its local-attention stages.

Training (Touvron et al., 2021, with timm's pieces): Mixup (alpha 0.8) or
CutMix (alpha 1.0), switched half and half per batch and applied on the
accelerator to the whole batch (``timm.data.Mixup``), mixed targets smoothed
by 0.1 and a soft-target cross-entropy; with ``mixup.enabled=false`` a
label-smoothed cross-entropy instead. The optimiser and scheduler are timm's
factories (``optim.optimizer`` / ``optim.scheduler``, Hydra partials): AdamW,
lr 5e-4 x global batch / 512 (``optim.scale_lr=linear``,
``optim.base_batch_size=512``), weight decay 0.05 except on norms, biases and
position embeddings (``filter_bias_and_bn`` and the net's
``no_weight_decay()``), cosine decay per epoch after a linear warm-up (with
``optim.scheduler.step_on_epochs=false``, after every update: timm's ``--sched-on-updates``; ``sched=plateau``
after each validation, on the monitored metric). Drop
path comes from ``model.drop_path_rate``. ``ema.enabled=true`` keeps
``timm.utils.ModelEmaV3`` weights (in the checkpoint, as ``ema.module.*``),
and validation and test then score the EMA weights.

Metrics: ``train/loss``, ``val/loss`` and ``test/loss`` (plain cross-entropy
on evaluation), top-1 and top-5 accuracy (``val/top1``, ``val/top5``,
``test/top1``, ``test/top5``; top-k with k = min(5, classes)), and
``val/top1_best``, all torchmetrics states synced across ranks. Throughput
(``train/samples_per_sec``, images/s of one process) comes from the
``suite.callbacks.TrainThroughput`` meter of ``configs/config.yaml``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torchmetrics.classification import MulticlassAccuracy

from attention.errors import UserError

from .base import EvalLoss, Task, TrainLoss
from .nets.backbones import build_backbone
from .optim import updates_per_epoch

MIXUP_DEFAULTS = {"enabled": True, "mixup_alpha": 0.8, "cutmix_alpha": 1.0, "cutmix_minmax": None, "prob": 1.0,
                  "switch_prob": 0.5, "mode": "batch"}
EMA_DEFAULTS = {"enabled": False, "decay": 0.99996, "warmup": False}
log = logging.getLogger(__name__)


def topk_accuracy(num_classes: int, k: int) -> MulticlassAccuracy:
    """Micro top-k accuracy (the fraction of samples whose label is among the k highest logits)."""
    return MulticlassAccuracy(num_classes, top_k=min(k, num_classes), average="micro")


class ImageClassification(Task):
    """Classifies images with a backbone of :mod:`tasks.nets.backbones` (recipe in the module docstring).

    Args:
        num_classes, img_size, class_names: from the data module.
        model: the ``model`` config (``name`` and architecture overrides, ``drop_path_rate``).
        attn: the ``attn`` config.
        optim: ``scale_lr``, ``base_batch_size``, ``optimizer`` (a partial taking the network) and
            ``scheduler`` (a partial taking the optimiser; timm's ``create_scheduler_v2``, stepped per epoch).
        label_smoothing: applied to the mixed targets (or to the cross-entropy without mixup).
        mixup: ``enabled`` and ``timm.data.Mixup``'s options.
        ema: ``enabled``, ``decay``, ``warmup`` (timm.utils.ModelEmaV3's decay warm-up).
        monitor: the run's ``monitor`` (:class:`tasks.base.Task`).
    """

    layout = "grid"

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        return {"val/top1": "max", "val/top5": "max", "val/loss": "min"}

    @classmethod
    def check_config(cls, cfg) -> None:
        """Before any data is read (suite/validate.py): Mixup/CutMix pair each image with another of its batch."""
        # a schedule or an optimiser timm would refuse, or a cool-down training never reaches: before data
        check_factories(cfg.get("optim") or {}, (cfg.get("trainer") or {}).get("max_epochs"))
        mixup, batch = (cfg.task.get("mixup") or {}), cfg.data.get("batch_size")
        if mixup.get("enabled", True) and isinstance(batch, int) and batch % 2:
            raise UserError(f"Mixup/CutMix (task.mixup) needs an even batch: data.batch_size={batch}. Use an even "
                            "batch size, or task.mixup.enabled=false.")
        size = cfg.data.get("img_size")
        if isinstance(size, int):  # an input size the model cannot take (model.pad=false), before data
            from omegaconf import OmegaConf

            model, attn = (OmegaConf.to_container(c, resolve=True) for c in (cfg.model, cfg.attn))
            model = {k: v for k, v in model.items() if k not in cls.weights_options}
            try:
                with torch.device("meta"):  # no weights allocated: only the sizes matter
                    net = build_backbone(model, attn, num_classes=1, img_size=size)
            except UserError:
                raise
            except Exception:  # noqa: BLE001 - Focal's index tables need real tensors: checked in __init__
                return
            net.check_input(size, size)

    def __init__(self, model: Mapping, attn: Mapping, optim: Mapping, num_classes: int | None = None,
                 img_size: int | None = None, class_names: Sequence[str] | None = None, in_chans: int = 3,
                 label_smoothing: float = 0.1, mixup: Mapping | None = None, ema: Mapping | None = None,
                 monitor: Mapping | None = None):
        super().__init__(monitor)
        if num_classes is None or img_size is None:
            raise UserError("task=classification needs a classification data set (one with img_size and "
                            "num_classes): use data=tiny, imagenet, folder_cls, cifar10_cls or cifar100.")
        self.save_hyperparameters(ignore=["class_names"])
        self.net = build_backbone(dict(model), dict(attn), num_classes=num_classes, img_size=img_size,
                                  in_chans=in_chans)
        self.net.check_input(img_size, img_size)  # an impossible size fails here, before any training
        self.class_names = list(class_names) if class_names is not None else None
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise UserError(f"task.label_smoothing={label_smoothing} must be in [0, 1) (DeiT: 0.1).")
        self.label_smoothing = float(label_smoothing)
        self.mixup = self._build_mixup(dict(MIXUP_DEFAULTS, **dict(mixup or {})), num_classes)
        if self.mixup is not None:
            from timm.loss import SoftTargetCrossEntropy
            self.train_criterion = SoftTargetCrossEntropy()
        elif self.label_smoothing > 0:
            from timm.loss import LabelSmoothingCrossEntropy
            self.train_criterion = LabelSmoothingCrossEntropy(self.label_smoothing)
        else:
            self.train_criterion = torch.nn.CrossEntropyLoss()
        self.ema = self._build_ema(dict(EMA_DEFAULTS, **dict(ema or {})))
        self._per_update = False  # the schedule set after every update (configure_optimizers)
        self._ema_step = 0  # the optimiser step the EMA last saw
        self.train_loss = TrainLoss()  # updated on the device: no host sync in the step
        # Evaluation losses: means over the split weighted by batch size, NaN kept (EvalLoss)
        self.val_loss, self.test_loss = EvalLoss(), EvalLoss()
        self.val_top1, self.val_top5 = topk_accuracy(num_classes, 1), topk_accuracy(num_classes, 5)
        self.test_top1, self.test_top5 = topk_accuracy(num_classes, 1), topk_accuracy(num_classes, 5)
        self.example_input_array = torch.zeros(1, in_chans, img_size, img_size)  # one sample, for summaries

    # -- parts ------------------------------------------------------------------------------------------------
    def _build_mixup(self, cfg: dict, num_classes: int):
        enabled = cfg.pop("enabled")
        if not enabled:
            return None
        from timm.data import Mixup

        if not (cfg.get("mixup_alpha", 0) > 0 or cfg.get("cutmix_alpha", 0) > 0 or cfg.get("cutmix_minmax")):
            raise UserError("task.mixup.enabled=true needs task.mixup.mixup_alpha > 0 or task.mixup.cutmix_alpha > 0 "
                            "(DeiT: 0.8 and 1.0); set task.mixup.enabled=false to train without mixing.")
        try:
            return Mixup(**cfg, label_smoothing=self.label_smoothing, num_classes=num_classes)
        except (AssertionError, TypeError, ValueError) as err:
            raise UserError(f"task.mixup={cfg} is not valid for timm.data.Mixup ({type(err).__name__}: {err}); "
                            "its options are mixup_alpha, cutmix_alpha, cutmix_minmax, prob, switch_prob and mode "
                            "(batch, pair or elem).") from None

    def load_weights(self, paths):
        """As :meth:`Task.load_weights`; the EMA copy, made when the network was built, starts from the weights."""
        loaded = super().load_weights(paths)
        if loaded and self.ema is not None:
            self.ema.module.load_state_dict(self.net.state_dict())
        return loaded

    def _build_ema(self, cfg: dict):
        if not cfg["enabled"]:
            return None
        from timm.utils import ModelEmaV3

        decay = float(cfg["decay"])
        if not 0.0 <= decay < 1.0:
            raise UserError(f"task.ema.decay={decay} must be in [0, 1) (DeiT: 0.99996).")
        ema = ModelEmaV3(self.net, decay=decay, use_warmup=bool(cfg["warmup"]))
        ema.requires_grad_(False)  # a copy, updated in place: no gradients, nothing for DDP to reduce
        # The copy stays in eval mode on purpose (no drop path when it is scored): Lightning's notice about
        # modules in eval mode at the start of training says nothing a user can act on.
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
        return ema

    @property
    def eval_net(self) -> torch.nn.Module:
        """The network that validation and test score: the EMA weights when enabled."""
        return self.ema.module if self.ema is not None else self.net

    # -- steps ------------------------------------------------------------------------------------------------
    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)

    def on_fit_start(self):
        if self.mixup is not None and self.trainer.datamodule is not None:
            size = getattr(self.trainer.datamodule, "batch_size", 0)
            if size % 2:
                raise UserError(f"Mixup/CutMix (task.mixup) needs an even batch: data.batch_size={size}. Use an "
                                "even batch size, or task.mixup.enabled=false.")

    def training_step(self, batch, batch_idx):
        image, label = batch["image"], batch["label"]  # (B, 3, S, S), (B,)
        if self.mixup is not None:
            if len(image) == 1:  # a batch shortened to one image by skipped files (data.on_bad_file=skip):
                image, label = image.repeat(2, 1, 1, 1), label.repeat(2)  # mixed with itself, it is itself
            elif len(image) % 2:  # shortened by skipped files: Mixup pairs the images
                image, label = image[:-1], label[:-1]
            image, target = self.mixup(image, label)  # on this device; target (B, K) mixed and smoothed
        else:
            target = label
        loss = self.train_criterion(self.net(image), target)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # After every optimiser step (not every micro-batch when gradients accumulate).
        if self.ema is not None and self.global_step != self._ema_step:
            self._ema_step = self.global_step
            self.ema.update(self.net, step=self.global_step)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ema_step"] = self._ema_step

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """The optimiser step the EMA last saw comes back with the weights: left at 0, a resumed run under gradient
        accumulation took its first micro-batch (global step N, no optimiser step yet) for a new step and updated
        the EMA once more than the run that never stopped. A checkpoint saved between the step and the EMA's update
        (SLURM's requeue checkpoint, from a callback's batch end) holds the step before, so the update it missed is
        made. Checkpoints written before this key hold an updated EMA: their global step."""
        super().on_load_checkpoint(checkpoint)
        self._ema_step = int(checkpoint.get("ema_step", checkpoint.get("global_step", 0)))

    def _evaluate(self, batch, stage: str):
        logits = self.eval_net(batch["image"])  # (B, K)
        label = batch["label"]
        loss = F.cross_entropy(logits, label)
        top1, top5, mean = (getattr(self, f"{stage}_{name}") for name in ("top1", "top5", "loss"))
        top1(logits, label)
        top5(logits, label)
        mean(loss, len(label))
        self.log(f"{stage}/loss", mean)
        self.log(f"{stage}/top1", top1, prog_bar=stage == "val")
        self.log(f"{stage}/top5", top5)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self):
        self.log_best({"val/top1": self.val_top1.compute(), "val/top5": self.val_top5.compute()})

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    # -- optimisation -----------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optim = self.hparams.optim  # the runtime has applied optim.scale_lr to these by now
        optimizer = instantiate(optim["optimizer"])(self.net)
        if not optim.get("scheduler"):
            return optimizer
        scheduler_cfg = dict(optim["scheduler"])
        self._per_update = per_update_schedule(scheduler_cfg)
        plateau = scheduler_cfg.get("sched") == "plateau"
        monitor = self.hparams.get("monitor") or {}
        if plateau:  # timm's default plateau_mode is max: a monitored loss must shrink, not grow
            scheduler_cfg.setdefault("plateau_mode", monitor.get("mode", "max"))
        scheduler = instantiate(scheduler_cfg)(optimizer)
        if isinstance(scheduler, tuple):  # timm's create_scheduler_v2 returns (scheduler, epochs)
            scheduler = scheduler[0]
        config = {"scheduler": scheduler, "interval": "step" if self._per_update else "epoch"}
        if plateau:
            # timm's plateau only reduces the rate when stepped with a metric: Lightning passes one (the run's
            # monitor, after validation) to lr_scheduler_step only for a scheduler marked reduce_on_plateau. An
            # epoch without validation (trainer.check_val_every_n_epoch > 1) is skipped with Lightning's warning.
            config.update(reduce_on_plateau=True, monitor=monitor.get("metric", "val/top1"), strict=False)
        return {"optimizer": optimizer, "lr_scheduler": config}

    def lr_scheduler_step(self, scheduler, metric):
        """timm schedulers take the epoch to set the rate for: at the end of epoch e, that is e + 1; stepped per
        update (:func:`per_update_schedule`), the fractional epoch of the updates done."""
        if hasattr(scheduler, "step_update") and hasattr(scheduler, "t_in_epochs"):  # a timm scheduler
            if self._per_update:
                scheduler.step(epoch=self.trainer.global_step / self.updates_per_epoch())
            else:  # the metric: a plateau schedule's (configure_optimizers), None for the others
                scheduler.step(epoch=self.current_epoch + 1, metric=metric)
        elif metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def updates_per_epoch(self) -> int:
        """Optimizer steps in one epoch of this process (:func:`tasks.optim.updates_per_epoch`)."""
        if (updates := updates_per_epoch(self.trainer)) is None:
            raise UserError("optim.scheduler.step_on_epochs=false needs a training loader with a length (the "
                            "schedule is in epochs); step the schedule per epoch (step_on_epochs=true).")
        return updates


FACTORY_ERRORS = (AssertionError, ValueError, TypeError, KeyError)  # what timm's factories raise on bad options


def check_factories(optim: Mapping, max_epochs: int | None = None) -> None:
    """``optim.optimizer`` and ``optim.scheduler`` built once on a one-weight stand-in, so that what timm refuses
    (an unknown ``opt`` or ``sched`` name, an argument it does not take, a schedule of no epochs) stops the run
    before any data is read with the option named, not with timm's traceback after the data is set up.
    ``num_epochs`` is ``${trainer.max_epochs}``: -1 in a run bounded by ``trainer.max_steps`` alone. timm's
    ``cooldown_epochs`` (T2T-ViT's 10 at ``min_lr``) come after ``num_epochs``: under ``max_epochs`` (the trainer
    stops there) they would never be trained, and the option would do nothing."""
    from hydra.errors import InstantiationException
    from omegaconf import DictConfig, OmegaConf

    def container(node):
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)

    weight = torch.nn.Parameter(torch.zeros(1))
    if optim.get("scheduler"):
        scheduler = container(optim["scheduler"])
        per_update_schedule(scheduler)  # what timm cannot step per update, refused; rewritten as it is built
        epochs = scheduler.get("num_epochs")
        if isinstance(epochs, int) and epochs < 1:
            raise UserError(f"optim.scheduler.num_epochs={epochs} is not a schedule's length: timm's schedules are "
                            "made in epochs, and configs/task/classification.yaml takes it from trainer.max_epochs "
                            "(-1 when the run is bounded by trainer.max_steps alone). Give a positive number of "
                            "epochs: trainer.max_epochs=300, or optim.scheduler.num_epochs=300 beside max_steps.")
        cooldown = scheduler.get("cooldown_epochs") or 0
        if cooldown and isinstance(epochs, int) and isinstance(max_epochs, int) and 0 < max_epochs < epochs + cooldown:
            raise UserError(f"optim.scheduler.cooldown_epochs={cooldown} adds {cooldown} epochs at min_lr after the "
                            f"schedule's num_epochs={epochs}, but training stops at trainer.max_epochs={max_epochs}: "
                            "the cool-down would never be trained. Give the two lengths apart, e.g. trainer.max_epochs="
                            f"{epochs + cooldown} optim.scheduler.num_epochs={epochs}, or drop the cool-down "
                            "(optim.scheduler.cooldown_epochs=0).")
        parts = [("scheduler", scheduler, lambda f: f(torch.optim.SGD([weight], lr=1.0)))]
    else:
        parts = []
    if optim.get("optimizer"):
        parts.insert(0, ("optimizer", container(optim["optimizer"]), lambda f: f(torch.nn.Linear(1, 1))))
    for name, options, build in parts:
        if "_target_" not in options:  # not a factory (a partial config of a test): nothing to build
            continue
        try:
            build(instantiate(options))
        except (InstantiationException, *FACTORY_ERRORS) as err:
            err = err.__cause__ or err if isinstance(err, InstantiationException) else err
            given = {k: v for k, v in options.items() if k not in ("_target_", "_partial_")}
            raise UserError(f"optim.{name} is not valid for {options.get('_target_')} ({type(err).__name__}: "
                            f"{str(err) or 'refused'}); it was given {given}. Fix the option named there on the "
                            "command line or in configs/task/classification.yaml (e.g. optim.optimizer.opt=adamw, "
                            "optim.scheduler.sched=cosine).") from None


def per_update_schedule(scheduler_cfg: dict) -> bool:
    """Whether ``scheduler_cfg`` (timm's ``create_scheduler_v2`` partial) asks for a rate set after every optimizer
    step (``step_on_epochs: false``, timm's ``--sched-on-updates``); rewrites it for the form the task steps.

    timm makes such a schedule from the number of updates per epoch (``updates_per_epoch``, which it then requires),
    which is not known when Lightning calls ``configure_optimizers``: the training loader is set up after it (one set
    up there would not be given a resumed run's position). The schedule is made in epochs instead and set after every
    update at the fractional epoch (updates done / updates per epoch): the same rates, since timm's per-update form
    is the per-epoch one with every time constant multiplied by the updates per epoch. A ``updates_per_epoch`` given
    is dropped (the loader's own count is used)."""
    if scheduler_cfg.get("step_on_epochs", True) is not False:
        return False
    if scheduler_cfg.get("sched") == "plateau":
        raise UserError("optim.scheduler.sched=plateau is stepped on a validation metric, once per epoch: it "
                        "cannot take step_on_epochs=false. Drop that option, or use another schedule (cosine, step, "
                        "multistep, poly, tanh).")
    if scheduler_cfg.get("noise") is not None:
        # timm seeds its noise with noise_seed + t, an integer update count in its own per-update form: at the
        # fractional epoch this task steps with, torch.Generator.manual_seed failed at the first update in range
        raise UserError(f"optim.scheduler.noise={scheduler_cfg['noise']} (timm's learning-rate noise) cannot be "
                        "combined with step_on_epochs=false here: the schedule is set at fractional epochs, which "
                        "timm's noise cannot seed. Step the schedule per epoch (step_on_epochs=true), or drop the "
                        "noise (optim.scheduler.noise=null).")
    given = scheduler_cfg.pop("updates_per_epoch", None)
    if given:
        log.info("optim.scheduler.updates_per_epoch=%s is not used: the schedule follows the training "
                 "loader's own number of updates per epoch", given)
    scheduler_cfg["step_on_epochs"] = True
    return True
