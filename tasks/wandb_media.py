"""Rich W&B media (confusion matrices, 3-D point clouds); no-ops for other loggers."""

from __future__ import annotations

import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger

# Class colours for point clouds: matplotlib's tab10, repeated.
_PALETTE = np.array([[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189],
                     [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207]])


def _wandb_runs(loggers):
    return [lg.experiment for lg in loggers if isinstance(lg, WandbLogger)]


def log_confusion_matrix(loggers, key: str, confusion: torch.Tensor, class_names):
    """Log a (K, K) count matrix (rows true, columns predicted) as W&B's confusion-matrix chart."""
    runs = _wandb_runs(loggers)
    if not runs:
        return
    import wandb

    # wandb.plot.confusion_matrix takes label sequences; expand the counts back into them.
    k = confusion.shape[0]
    true = torch.arange(k).repeat_interleave(k)  # (K*K,) row index of each cell
    pred = torch.arange(k).repeat(k)  # (K*K,) column index of each cell
    counts = confusion.flatten()
    y_true = true.repeat_interleave(counts).tolist()
    y_pred = pred.repeat_interleave(counts).tolist()
    chart = wandb.plot.confusion_matrix(y_true=y_true, preds=y_pred, class_names=list(class_names))
    for run in runs:
        run.log({key: chart})


def log_point_clouds(loggers, key: str, samples, class_names):
    """Log (points (N, 3), true, pred) samples as coloured ``wandb.Object3D`` with a caption."""
    runs = _wandb_runs(loggers)
    if not runs or not samples:
        return
    import wandb

    objects = []
    for points, true, pred in samples:
        xyz = points.float().numpy()
        rgb = np.broadcast_to(_PALETTE[pred % len(_PALETTE)], xyz.shape)
        caption = f"true: {class_names[true]} | pred: {class_names[pred]}" + ("" if true == pred else " (wrong)")
        objects.append(wandb.Object3D(np.concatenate([xyz, rgb], axis=1), caption=caption))
    for run in runs:
        run.log({key: objects})
