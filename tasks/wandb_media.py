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


def palette(ids) -> np.ndarray:
    """RGB colours (..., 3) for integer ids (class or part), cycling through tab10."""
    return _PALETTE[np.asarray(ids) % len(_PALETTE)]


def log_point_clouds(loggers, key: str, clouds):
    """Log (xyz (N, 3), rgb (N, 3) or (3,), caption) triples as ``wandb.Object3D`` point clouds."""
    runs = _wandb_runs(loggers)
    if not runs or not clouds:
        return
    import wandb

    objects = []
    for xyz, rgb, caption in clouds:
        xyz = np.asarray(xyz, dtype=np.float32)
        rgb = np.broadcast_to(rgb, xyz.shape)
        objects.append(wandb.Object3D(np.concatenate([xyz, rgb], axis=1), caption=caption))
    for run in runs:
        run.log({key: objects})


def log_table(loggers, key: str, columns, rows):
    """Log a ``wandb.Table`` (e.g. per-category IoU)."""
    runs = _wandb_runs(loggers)
    if not runs:
        return
    import wandb

    for run in runs:
        run.log({key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
