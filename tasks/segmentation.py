"""Semantic segmentation with a dilated ResNet and an attention head (``task=segmentation``).

Batches are ``{"image": normalised (B, 3, H, W), "mask": (B, H, W)}`` with 255
ignored. Training: cross-entropy on the main logits plus ``aux_weight`` (0.4)
times the auxiliary FCN head's; SGD with momentum, no weight decay on
normalisation layers and biases, poly schedule (power 0.9) over
``trainer.max_steps`` iterations (with ``max_steps=-1``, the steps of ``trainer.max_epochs``). Evaluation: whole images or sliding windows,
optionally multi-scale and flipped (``eval``); one confusion matrix over the
whole split (synced across ranks) gives mIoU, pixel accuracy, average accuracy,
kappa, F1 and per-class IoU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from hydra.utils import instantiate
from torch import nn
from torchmetrics import SumMetric

from attention.errors import UserError

from . import deterministic
from .base import Task, TrainLoss
from .nets.segnet import SegNet
from .metrics.segmentation import SegConfusion, check_eval, predict, scores, undefined_scores
from .wandb_media import log_table

SCALARS = ("miou", "pixel_acc", "aa", "kappa", "f1")
NO_END = ("task=segmentation's poly schedule decays the rate to 0 at the end of training, and this run has none "
          "(trainer.max_steps=-1 with trainer.max_epochs=-1): give trainer.max_steps (the papers' iterations, e.g. "
          "40000) or trainer.max_epochs.")
log = logging.getLogger(__name__)


def poly_lambda(max_steps, power: float = 0.9):
    """The poly schedule factor (1 - step / max_steps) ** power (0 after max_steps). ``max_steps``: the count, or a
    function giving it, called once, at the first step after 0 (the factor at step 0 is 1 whatever the count)."""
    total = [max_steps if isinstance(max_steps, int) else None]

    def factor(step: int) -> float:
        if step == 0:
            return 1.0
        if total[0] is None:
            total[0] = int(max_steps())
        return max(0.0, 1.0 - step / total[0]) ** power
    return factor


def param_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv/linear weights only: none on normalisation layers and biases."""
    decay, no_decay = [], []
    for module in net.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_norm = isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm))
            (no_decay if is_norm or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "weights"},
            {"params": no_decay, "weight_decay": 0.0, "name": "norms_biases"}]


class Segmentation(Task):
    layout = "grid"
    weights_options = {}  # model.weights is the backbone's, loaded by SegNet itself
    validation_options = ("eval.mode", "eval.stride", "eval.scales", "eval.flip")  # validation infers as the test
    # per iteration (mmseg's log); metrics.json has the epoch mean, train/loss_epoch, instead of the last batch's
    step_metrics = ("train/loss", "train/loss_main", "train/loss_aux")

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        return {f"val/{k}": "max" for k in SCALARS}

    def __init__(self, num_classes: int, class_names: Sequence[str], model: Mapping, attn: Mapping,
                 optim: Mapping, mean: Sequence[float] = (0.485, 0.456, 0.406),
                 std: Sequence[float] = (0.229, 0.224, 0.225), palette=None, ignore_index: int = 255,
                 crop: Sequence[int] = (512, 512), aux_weight: float = 0.4, eval: Mapping | None = None,
                 log_images: int = 4, monitor: Mapping | None = None):
        super().__init__(monitor)
        self.save_hyperparameters(ignore=["palette", "crop"])  # crop: the data module logs its own
        self.crop = tuple(crop) if not isinstance(crop, int) else (crop, crop)
        # Transformer backbones are built for the training crop (Focal's window sizes depend on the map size).
        self.net = SegNet(num_classes, dict(attn), **{"crop": min(self.crop), **dict(model)})
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.class_names = list(class_names)
        self.eval_cfg = dict(eval or {})
        self.aux_weight = float(aux_weight)
        self.log_images = log_images
        self.palette = None if palette is None else np.asarray(palette, dtype=np.uint8)
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.val_confusion = SegConfusion(num_classes, ignore_index)
        self.test_confusion = SegConfusion(num_classes, ignore_index)
        # Pixels whose logits hold a NaN or an infinity, per split: such a split's scores are NaN (_log_scores). The
        # argmax of NaN logits is still a class, and the scores of a diverged network would look like a constant
        # prediction's, finite, for trainer.on_nan's check of the evaluation to pass. Counted on the device
        # ("disable": torchmetrics' NaN check of the count would ask the host).
        self.val_nonfinite, self.test_nonfinite = SumMetric(nan_strategy="disable"), SumMetric(nan_strategy="disable")
        self._images: list = []
        self.train_loss = TrainLoss()  # the epoch mean, updated on the device: no host sync in the step
        self.example_input_array = torch.zeros(1, 3, *self.crop)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Before any data: the poly schedule decays to 0 at the end of training, which needs an end; the eval
        options (``check_eval``: eval.flip=no would otherwise run flip testing, eval.stride=0 the default)."""
        from omegaconf import OmegaConf

        trainer = cfg.get("trainer") or {}
        if trainer.get("max_steps") in (None, -1) and trainer.get("max_epochs") == -1:
            raise UserError(NO_END)
        evaluation = OmegaConf.to_container(cfg.get("eval") or OmegaConf.create({}), resolve=True)
        check_eval(evaluation.get("mode", "whole"), (cfg.get("data") or {}).get("crop"), evaluation.get("stride"),
                   evaluation.get("scales", (1.0,)), evaluation.get("flip", False))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)

    def training_step(self, batch, batch_idx):
        out = self.net(batch["image"])
        logits, aux = out if isinstance(out, tuple) else (out, None)
        loss = deterministic.cross_entropy(logits, batch["mask"], ignore_index=self.ignore_index)
        self.log("train/loss_main", loss.detach(), on_step=True, on_epoch=False, sync_dist=True)
        if aux is not None:
            aux_loss = deterministic.cross_entropy(aux, batch["mask"], ignore_index=self.ignore_index)
            self.log("train/loss_aux", aux_loss.detach(), on_step=True, on_epoch=False, sync_dist=True)
            loss = loss + self.aux_weight * aux_loss
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)
        self.train_loss(loss)
        self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def _predict(self, image: torch.Tensor) -> torch.Tensor:
        cfg = self.eval_cfg
        # null is the default stride; any value given goes to predict's checks as it is (0 is refused there)
        stride = cfg.get("stride")
        if stride is None:
            stride = [max(1, int(c * 2 / 3)) for c in self.crop]
        return predict(self.net, image, mode=cfg.get("mode", "whole"), crop=self.crop, stride=stride,
                       scales=cfg.get("scales", (1.0,)), flip=cfg.get("flip", False), num_classes=self.num_classes)

    def _eval_step(self, stage: str, batch):
        confusion = self.val_confusion if stage == "val" else self.test_confusion
        nonfinite = self.val_nonfinite if stage == "val" else self.test_nonfinite

        def predicted(image: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> the classes (B, H, W)
            logits = self._predict(image)  # (B, K, H, W)
            nonfinite.update((~torch.isfinite(logits)).any(dim=1).sum())
            return logits.argmax(dim=1)

        images, masks = batch["image"], batch["mask"]
        padded = tuple(images.shape[-2:])
        if all(size == padded for size in batch.get("sizes", [padded])):
            preds = predicted(images)  # (B, H, W)
            confusion.update(preds, masks)
        else:  # images of several sizes: each predicted at its own, as alone (PadCollate's docstring says why)
            images = [image[:, :h, :w] for image, (h, w) in zip(images, batch["sizes"])]
            masks = [mask[:h, :w] for mask, (h, w) in zip(masks, batch["sizes"])]
            preds = [predicted(image[None])[0] for image in images]  # B x (h, w)
            for pred, mask in zip(preds, masks):
                confusion.update(pred[None], mask[None])
        room = self.log_images - len(self._images)
        for image, mask, p in list(zip(images, masks, preds))[:max(room, 0)]:
            self._images.append((image.cpu(), mask.cpu(), p.cpu()))

    def _log_scores(self, stage: str) -> dict:
        confusion = self.val_confusion if stage == "val" else self.test_confusion
        nonfinite = self.val_nonfinite if stage == "val" else self.test_nonfinite
        matrix = confusion.compute().cpu()
        result = scores(matrix, self.class_names)
        bad = int(nonfinite.compute())  # summed over the ranks: every rank takes the same branch
        confusion.reset()
        nonfinite.reset()
        undefined = {} if bad else undefined_scores(matrix, self.class_names)
        for name in SCALARS:
            key, why = f"{stage}/{name}", undefined.get(name)
            if why is not None and key not in self.undefined_metrics:  # said once a run, not at every validation
                log.warning("%s is NaN, %s; trainer.on_nan's check passes over it", key, why)
            if why is None:
                self.undefined_metrics.pop(key, None)
            else:
                self.undefined_metrics[key] = why
        if bad:
            log.warning("%s: the logits of %d pixel(s) were NaN or infinite, so the split's scores are NaN", stage, bad)
            result = {k: torch.full_like(v, math.nan) if isinstance(v, torch.Tensor) else math.nan
                      for k, v in result.items()}
        self.log_dict({f"{stage}/{k}": float(result[k]) for k in SCALARS}, prog_bar=stage == "val")
        if self.trainer.is_global_zero:
            rows = [[name, float(iou), float(acc)] for name, iou, acc in
                    zip(self.class_names, result["iou"].tolist(), result["acc"].tolist())]
            log_table(self.loggers, f"{stage}/per_class", ["class", "iou", "acc"], rows)
            self._log_overlays(stage)
        self._images = []
        return result

    def _log_overlays(self, stage: str) -> None:
        from lightning.pytorch.loggers import WandbLogger

        runs = [lg.experiment for lg in self.loggers if isinstance(lg, WandbLogger)]
        if not runs or not self._images:
            return
        import wandb

        labels = {i: name for i, name in enumerate(self.class_names)}
        labels[self.ignore_index] = "ignore"
        images = []
        for image, mask, pred in self._images:
            rgb = ((image[None] * self.std.cpu() + self.mean.cpu()).clamp(0, 1)[0] * 255).byte()
            images.append(wandb.Image(rgb.permute(1, 2, 0).numpy(), masks={
                "prediction": {"mask_data": pred.numpy().astype(np.uint8), "class_labels": labels},
                "ground_truth": {"mask_data": mask.numpy().astype(np.uint8), "class_labels": labels}}))
        for run in runs:
            run.log({f"{stage}/overlays": images})

    def on_validation_epoch_start(self):
        self._images = []

    def validation_step(self, batch, batch_idx):
        self._eval_step("val", batch)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            self.val_confusion.reset()
            self.val_nonfinite.reset()
            self._images = []
            return
        result = self._log_scores("val")
        self.log_best({f"val/{k}": float(result[k]) for k in SCALARS})

    def on_test_epoch_start(self):
        self._images = []

    def test_step(self, batch, batch_idx):
        self._eval_step("test", batch)

    def on_test_epoch_end(self):
        self._log_scores("test")

    def configure_optimizers(self):
        optim = self.hparams.optim
        optimizer = instantiate(optim["optimizer"])(param_groups(self.net, float(optim.get("weight_decay", 1e-4))))
        trainer = self.trainer

        # The schedule's length: optim.schedule_steps/schedule_epochs (the run's trainer.max_steps/max_epochs, or a
        # resumed run's checkpoint's, suite.resume.check_same_recipe); the trainer's where a config lacks them.
        steps, epochs = (int(optim.get(k, default)) for k, default in (("schedule_steps", trainer.max_steps),
                                                                         ("schedule_epochs", trainer.max_epochs)))

        def max_steps() -> int:
            # Of an epoch-based run (schedule_steps=-1), Lightning's estimate scaled to the schedule's epochs, read
            # once training has started: made here it would set up the training loader before a resumed run's state
            # is restored, and Lightning then leaves the loader's saved position out (the resumed epoch would start
            # again from its first batch).
            if steps > 0:
                return steps
            trainer.estimated_stepping_batches  # sets up the training loader, which counts its batches
            if epochs <= 0 or math.isinf(trainer.num_training_batches):
                raise UserError(NO_END)
            return math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches) * epochs

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly_lambda(max_steps, float(optim.get("power", 0.9))))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
