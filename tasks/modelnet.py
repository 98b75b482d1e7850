"""ModelNet40 (or any point-cloud classification data) with PCT.

Metrics follow the PCT reference: overall accuracy (``oa``, micro) and mean
class accuracy (``macc``: the mean recall over the classes in the evaluated set, the reference's
``balanced_accuracy_score``), per epoch on validation with their best
values so far, and on test for the checkpoint that is tested. The loss is the
reference's label-smoothed cross-entropy.

Testing may vote (``eval.votes``, ``tasks/voting.py``): the argmax of the softmax averaged over the cloud as it is
and votes - 1 randomly scaled copies (PAConv's ``eval_voting.py``); validation is always one pass. ``test/loss``
is the unscaled pass's loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from attention.errors import UserError

from .base import EvalLoss, Task, TrainLoss
from .metrics.classification import BalancedAccuracy
from .nets.pct import PCT
from .optim import build_optimizers
from .voting import check_voting, draw_scales, shape_indices, voted_probabilities
from .wandb_media import log_confusion_matrix, log_point_clouds, palette


def reference_smoothing(eps: float, num_classes: int) -> float:
    """torch's ``label_smoothing`` equal to PCT's ``cal_loss(smoothing=eps)``.

    The reference gives the true class 1 - eps and every other class
    eps / (K - 1); torch gives the true class 1 - s + s / K and the others
    s / K. They agree for s = eps * K / (K - 1).
    """
    return eps * num_classes / (num_classes - 1)


class PointCloudClassification(Task):
    """Classifies point clouds with PCT; batches are dicts with ``points`` (B, N, 3) and ``label`` (B,)."""
    layout = "points"
    also_best = {"val/oa": "max", "val/macc": "max"}  # PCT reports both

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        return {"val/oa": "max", "val/macc": "max", "val/loss": "min"}

    def __init__(self, num_classes: int, class_names: Sequence[str], model: Mapping, attn: Mapping,
                 optim: Mapping, label_smoothing: float = 0.2, log_samples: int = 8, input_points: int = 1024,
                 eval: Mapping | None = None, seed: int = 0, monitor: Mapping | None = None):
        super().__init__(monitor)
        self.save_hyperparameters()
        self.eval_cfg = dict(eval or {})  # votes, vote_scale, vote_cumulative (configs/task/modelnet.yaml)
        self.seed = seed  # seeds the votes' scales
        self.net = PCT(num_classes, attn=dict(attn), **dict(model))
        self.class_names = list(class_names)
        self.smoothing = reference_smoothing(label_smoothing, num_classes)
        if self.smoothing > 1:  # torch's bound: the reference's eps gives the other classes more than the true one
            raise UserError(f"task.label_smoothing={label_smoothing} is too large for {num_classes} classes: the "
                            f"reference's smoothing gives each other class eps / (K - 1), so eps <= (K - 1) / K = "
                            f"{(num_classes - 1) / num_classes:.4g} (PCT: 0.2).")
        self.log_samples = log_samples
        self.train_loss = TrainLoss()  # updated on the device: no host sync in the step
        # Evaluation losses: means over the split weighted by batch size, NaN kept (EvalLoss)
        self.val_loss, self.test_loss = EvalLoss(), EvalLoss()
        # No argument checks in the training step: torchmetrics 1.3's count the target's distinct labels with
        # torch.unique, a host sync every step on a GPU (later releases skip that count for logits). The data modules
        # check the labels' range as they read them.
        self.train_oa = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_oa = MulticlassAccuracy(num_classes, average="micro")
        self.val_macc = BalancedAccuracy(num_classes)
        self.test_oa = MulticlassAccuracy(num_classes, average="micro")
        self.test_macc = BalancedAccuracy(num_classes)
        self.test_confusion = MulticlassConfusionMatrix(num_classes)
        self._samples: list[tuple] = []
        self.example_input_array = torch.zeros(1, input_points, 3)  # one sample, for summaries

    @classmethod
    def check_config(cls, cfg) -> None:
        from omegaconf import OmegaConf

        check_voting(OmegaConf.to_container(cfg.get("eval") or OmegaConf.create({}), resolve=True), "modelnet")

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.net(points)

    def _step(self, batch):
        logits = self(batch["points"])
        loss = F.cross_entropy(logits, batch["label"], label_smoothing=self.smoothing)
        return loss, logits

    def training_step(self, batch, batch_idx):
        loss, logits = self._step(batch)
        self.train_loss(loss)
        # update, not forward: no batch value to compute (it is logged per epoch), which torchmetrics 1.3 divided
        # through a boolean mask, a host sync
        self.train_oa.update(logits, batch["label"])
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/oa", self.train_oa, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits = self._step(batch)
        self.val_oa(logits, batch["label"])
        self.val_macc(logits, batch["label"])
        self.val_loss(loss, len(batch["label"]))
        self.log("val/loss", self.val_loss)
        self.log("val/oa", self.val_oa, prog_bar=True)
        self.log("val/macc", self.val_macc)

    def on_validation_epoch_end(self):
        self.log_best({"val/oa": self.val_oa.compute(), "val/macc": self.val_macc.compute()})

    def on_test_epoch_start(self):
        self._samples = []

    def _test_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores whose argmax is the prediction, logits of the unscaled pass): one pass when eval.votes=1, else
        the softmax averaged over the votes."""
        points, votes = batch["points"], int(self.eval_cfg.get("votes", 1))
        if votes == 1:
            logits = self(points)
            return logits, logits
        scales = draw_scales(self.seed, shape_indices(batch, "modelnet"), votes, self.eval_cfg["vote_scale"],
                             bool(self.eval_cfg.get("vote_cumulative", False)), points.device, points.dtype)
        return voted_probabilities(self, points, scales, dim=-1)

    def test_step(self, batch, batch_idx):
        scores, logits = self._test_logits(batch)
        loss = F.cross_entropy(logits, batch["label"], label_smoothing=self.smoothing)
        pred = scores.argmax(-1)
        self.test_oa(pred, batch["label"])
        self.test_macc(pred, batch["label"])
        self.test_confusion(pred, batch["label"])
        self.test_loss(loss, len(batch["label"]))
        self.log("test/loss", self.test_loss)
        self.log("test/oa", self.test_oa)
        self.log("test/macc", self.test_macc)
        room = self.log_samples - len(self._samples)
        for points, label, p in list(zip(batch["points"], batch["label"], pred))[:max(room, 0)]:
            self._samples.append((points.cpu(), int(label), int(p)))

    def on_test_epoch_end(self):
        confusion = self.test_confusion.compute().cpu()
        self.test_confusion.reset()
        log_confusion_matrix(self.loggers, "test/confusion_matrix", confusion, self.class_names)
        names = self.class_names
        clouds = [(points.float().numpy(), palette(pred),
                   f"true: {names[true]} | pred: {names[pred]}" + ("" if true == pred else " (wrong)"))
                  for points, true, pred in self._samples]
        log_point_clouds(self.loggers, "test/samples", clouds)

    def configure_optimizers(self):
        return build_optimizers(self.parameters(), self.hparams.optim, self.trainer)
