"""Part-segmentation IoU (ShapeNet part protocol), as a torchmetrics Metric.

torchmetrics' JaccardIndex averages over classes across the whole dataset;
the ShapeNet part protocol instead scores each *shape* over its own
category's parts and then averages shapes (instance mIoU) or categories
(class mIoU), so it is written here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric


def category_part_mask(category_parts: Sequence[Sequence[int]], num_parts: int) -> torch.Tensor:
    """(categories, parts) bool: which global part ids belong to each category."""
    mask = torch.zeros(len(category_parts), num_parts, dtype=torch.bool)
    for c, parts in enumerate(category_parts):
        mask[c, list(parts)] = True
    return mask


def restrict_to_category(logits: torch.Tensor, category: torch.Tensor, part_mask: torch.Tensor) -> torch.Tensor:
    """Predicted parts (B, N): argmax of logits (B, parts, N) over each shape's own category's parts."""
    allowed = part_mask.to(logits.device)[category].unsqueeze(-1)  # (B, parts, 1)
    return logits.masked_fill(~allowed, float("-inf")).argmax(dim=1)


def shape_ious(pred: torch.Tensor, target: torch.Tensor, category: torch.Tensor,
               part_mask: torch.Tensor) -> torch.Tensor:
    """Per-shape IoU (B,): mean over the category's parts of |pred & gt| / |pred | gt|.

    A part absent from both prediction and ground truth counts as IoU 1.
    pred, target (B, N) global part ids; category (B,).
    """
    num_parts = part_mask.shape[1]
    p = torch.nn.functional.one_hot(pred, num_parts).bool()  # (B, N, parts)
    t = torch.nn.functional.one_hot(target, num_parts).bool()  # (B, N, parts)
    inter = (p & t).sum(1).double()  # (B, parts); float64 keeps per-shape IoUs exact
    union = (p | t).sum(1).double()  # (B, parts)
    iou = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))  # (B, parts)
    mask = part_mask.to(pred.device)[category]  # (B, parts)
    return (iou * mask).sum(1) / mask.sum(1)


class PartIoU(Metric):
    """Instance mIoU (mean over shapes) and class mIoU (mean over categories of their shapes' mean)."""

    full_state_update = False

    def __init__(self, category_parts: Sequence[Sequence[int]], num_parts: int, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("part_mask", category_part_mask(category_parts, num_parts), persistent=False)
        n = len(category_parts)
        self.add_state("iou_sum", torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("shapes", torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, target: torch.Tensor, category: torch.Tensor) -> None:
        ious = shape_ious(pred, target, category, self.part_mask)
        self.iou_sum.index_add_(0, category, ious)
        self.shapes.index_add_(0, category, torch.ones_like(ious))

    def compute(self) -> dict[str, torch.Tensor]:
        seen = self.shapes > 0
        per_category = torch.where(seen, self.iou_sum / self.shapes.clamp_min(1), torch.nan)
        return {
            "instance_miou": self.iou_sum.sum() / self.shapes.sum().clamp_min(1),
            "class_miou": per_category.nanmean(),  # over seen categories (NaN if none), on the states' device
            "per_category": per_category,
        }
