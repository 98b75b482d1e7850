"""Classification metrics the point-cloud papers report and torchmetrics does not compute as they do."""

from __future__ import annotations

import torch
from torchmetrics.classification import MulticlassStatScores


class BalancedAccuracy(MulticlassStatScores):
    """Mean class accuracy as PCT's and DGCNN's reference code reports it (``mAcc``, ``avg per class acc``):
    scikit-learn's ``balanced_accuracy_score``, the mean recall over the classes present in the targets.

    torchmetrics' ``MulticlassAccuracy(average="macro")`` averages in, with recall 0, every class that was predicted
    but is not among the targets: a lower number whenever an evaluation set lacks a class (a held-out validation
    split, ``limit_test_batches``, a small or generated data set). On a set holding every class the two agree.
    Counts are torchmetrics' (summed over processes under DDP); NaN when there were no targets."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, top_k=1, average=None, multidim_average="global", **kwargs)

    def compute(self) -> torch.Tensor:
        tp, _, _, fn = self._final_state()
        support = tp + fn  # (num_classes,) targets of each class
        present = support > 0
        recall = torch.where(present, tp / support.clamp(min=1), 0.0)  # no boolean indexing: no host sync
        return recall.sum() / present.sum()
