"""ShapeNet part segmentation (or any part-labelled point clouds) with PCT.

Batches are dicts with ``points`` (B, N, 3), ``parts`` (B, N) global part ids,
``category`` (B,) and, when the data module provides normals, ``normals``
(B, N, 3). Predictions take the argmax over the shape's own category's parts
(the standard protocol; ``restrict_to_category=false`` allows all parts).
Metrics: instance mIoU (``imiou``, mean over shapes) and class mIoU
(``cmiou``, mean over categories), with per-category IoU at test time.

Testing may vote (``eval.votes``, ``tasks/voting.py``): the softmax averaged over the shape as it is and votes - 1
copies with randomly scaled xyz (normals unscaled), then the same restricted argmax (RS-CNN's
``voting_evaluate_partseg.py``, PAConv's ``part_seg/eval_voting.py``); validation is always one pass.
``test/loss`` is the unscaled pass's loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import deterministic
from .base import EvalLoss, Task, TrainLoss
from .metrics.part_iou import PartIoU, category_part_mask, restrict_to_category
from .nets.pct import PCTPartSeg
from .optim import build_optimizers
from .voting import check_voting, draw_scales, shape_indices, voted_probabilities
from .wandb_media import log_point_clouds, log_table, palette


class PartSegmentation(Task):
    layout = "points"
    also_best = {"val/imiou": "max", "val/cmiou": "max"}  # both reported, as in PCT

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        return {"val/imiou": "max", "val/cmiou": "max", "val/loss": "min"}

    def __init__(self, num_parts: int, num_categories: int, category_names: Sequence[str],
                 category_parts: Sequence[Sequence[int]], model: Mapping, attn: Mapping, optim: Mapping,
                 normals: bool = False, restrict_to_category: bool = True, label_smoothing: float = 0.0,
                 input_points: int = 2048, log_samples: int = 4, eval: Mapping | None = None, seed: int = 0,
                 monitor: Mapping | None = None):
        super().__init__(monitor)
        self.save_hyperparameters()
        self.eval_cfg = dict(eval or {})  # votes, vote_scale, vote_cumulative (configs/task/shapenet.yaml)
        self.seed = seed  # seeds the votes' scales
        self.net = PCTPartSeg(num_parts, num_categories, attn=dict(attn), in_channels=6 if normals else 3,
                              **dict(model))
        self.normals = normals
        self.restrict = restrict_to_category
        self.category_names = list(category_names)
        self.register_buffer("part_mask", category_part_mask(category_parts, num_parts), persistent=False)
        self.train_loss = TrainLoss()  # updated on the device: no host sync in the step
        # Evaluation losses: means over the split weighted by batch size, NaN kept (EvalLoss)
        self.val_loss, self.test_loss = EvalLoss(), EvalLoss()
        self.val_iou = PartIoU(category_parts, num_parts)
        self.test_iou = PartIoU(category_parts, num_parts)
        self.example_input_array = (torch.zeros(1, input_points, 6 if normals else 3),
                                    torch.zeros(1, dtype=torch.long))
        self._samples: list[tuple] = []

    @classmethod
    def check_config(cls, cfg) -> None:
        from omegaconf import OmegaConf

        check_voting(OmegaConf.to_container(cfg.get("eval") or OmegaConf.create({}), resolve=True), "shapenet")

    def forward(self, points: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.net(points, category)  # (B, parts, N)

    def _inputs(self, batch) -> torch.Tensor:
        return torch.cat([batch["points"], batch["normals"]], -1) if self.normals else batch["points"]

    def _step(self, batch, scores: torch.Tensor | None = None, logits: torch.Tensor | None = None):
        """(loss, predicted parts); ``scores`` (B, parts, N), when given, decide the prediction instead of the
        logits (the votes' mean softmax), and ``logits`` the loss (the unscaled pass)."""
        if logits is None:
            logits = self(self._inputs(batch), batch["category"])
        scores = logits if scores is None else scores
        loss = deterministic.cross_entropy(logits, batch["parts"], label_smoothing=self.hparams.label_smoothing)
        pred = restrict_to_category(scores, batch["category"], self.part_mask) if self.restrict \
            else scores.argmax(1)
        return loss, pred

    def training_step(self, batch, batch_idx):
        loss, _ = self._step(batch)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, pred = self._step(batch)
        self.val_iou.update(pred, batch["parts"], batch["category"])
        self.val_loss(loss, len(batch["parts"]))
        self.log("val/loss", self.val_loss)

    def on_validation_epoch_end(self):
        out = self.val_iou.compute()
        self.val_iou.reset()
        if self.trainer.sanity_checking:
            return
        scores = {"val/imiou": out["instance_miou"], "val/cmiou": out["class_miou"]}
        self.log_dict(scores, prog_bar=True)
        self.log_best(scores)

    def on_test_epoch_start(self):
        self._samples = []

    def _voted(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean softmax over the eval.votes votes, logits of the unscaled pass), both (B, parts, N)."""
        points = self._inputs(batch)
        scales = draw_scales(self.seed, shape_indices(batch, "shapenet"), int(self.eval_cfg["votes"]),
                             self.eval_cfg["vote_scale"], bool(self.eval_cfg.get("vote_cumulative", False)),
                             points.device, points.dtype)
        return voted_probabilities(lambda x: self(x, batch["category"]), points, scales, dim=1)

    def test_step(self, batch, batch_idx):
        if int(self.eval_cfg.get("votes", 1)) == 1:
            loss, pred = self._step(batch)
        else:
            loss, pred = self._step(batch, *self._voted(batch))
        self.test_iou.update(pred, batch["parts"], batch["category"])
        self.test_loss(loss, len(batch["parts"]))
        self.log("test/loss", self.test_loss)
        for i in range(min(self.hparams.log_samples - len(self._samples), len(pred))):
            self._samples.append((batch["points"][i].float().cpu(), batch["parts"][i].cpu(), pred[i].cpu(),
                                  int(batch["category"][i])))

    def on_test_epoch_end(self):
        out = self.test_iou.compute()
        self.test_iou.reset()
        per_category = out["per_category"].tolist()
        self.log_dict({"test/imiou": out["instance_miou"], "test/cmiou": out["class_miou"]})
        seen = {name: iou for name, iou in zip(self.category_names, per_category) if iou == iou}
        self.log_dict({f"test/iou/{name}": iou for name, iou in seen.items()})
        log_table(self.loggers, "test/per_category_iou", ["category", "iou"], seen.items())
        clouds = []
        for points, true, pred, cat in self._samples:
            name = self.category_names[cat]
            clouds.append((points.numpy(), palette(true.numpy()), f"{name}: true parts"))
            clouds.append((points.numpy(), palette(pred.numpy()), f"{name}: predicted parts"))
        log_point_clouds(self.loggers, "test/samples", clouds)

    def configure_optimizers(self):
        return build_optimizers(self.parameters(), self.hparams.optim, self.trainer)
