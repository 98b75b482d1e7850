"""The point-cloud classification family: its base data module, dataset and validation split.

A dataset of this family (:mod:`datamodules.points.modelnet40`, :mod:`~datamodules.points.modelnet40_pyg`,
:mod:`~datamodules.points.shapes`) subclasses :class:`PointCloudDataModule`, sets ``num_classes`` and
``class_names`` and implements ``_load``, which returns the (train, val or None, test) point sources.

Every sample is a plain dict, so PyTorch's default collate batches it::

    {"points": FloatTensor (N, 3), "label": LongTensor (), "index": LongTensor ()}
    batch["points"]: (B, N, 3) float32, batch["label"]: (B,) int64, batch["index"]: (B,) int64

``index`` is the sample's row in its source (which shape it is, whatever the batch and process it lands in): test-time
voting draws each shape's scales from it (:mod:`tasks.voting`).

Training augmentation (:func:`datamodules.points.ops.augment_points`, the PCT / DGCNN ModelNet40
reference), per sample, on the train split only:

1. point dropout: ratio ~ U(0, 0.875); each point whose U(0, 1) <= ratio is
   replaced by the first point;
2. per-axis scale ~ U(2/3, 3/2) and shift ~ U(-0.2, 0.2);
3. shuffle the point order.

Bad data (``on_bad_file``): the file readers check what they read in :meth:`setup`
(files readable, dataset names, shapes, dtypes, label ranges, finite coordinates).
With ``on_bad_file="error"`` (the default) the first problem raises a
:class:`~attention.errors.UserError` naming the file, the sample and the fix; with
``"skip"`` a bad file (all its samples) or a bad sample is dropped and recorded in
``skipped`` (one line each, e.g. ``"ply_data_train1.h5: unreadable (...)"`` or
``"ply_data_train0.h5[17]: NaN or infinite coordinates"``), and a warning gives the
count (:class:`datamodules.base.BadFiles`). A split left with no samples is a UserError
either way. ``skipped`` exists on every data module and is empty when nothing was skipped.

Validation protocol: with ``val_fraction == 0`` (the default) validation uses
the *test* set, as the PCT/ModelNet reference code does (it reports the best
test accuracy over training). With ``val_fraction > 0`` a seeded, stratified
fraction of the train split is held out (unaugmented) for validation.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from attention.errors import UserError
from datamodules.base import PointSetDataModule, float_option
from datamodules.points.ops import augment_points, sample_rng


class PointSource(Protocol):
    """Indexable point clouds with known labels: what :class:`PointCloudDataset` reads."""

    labels: np.ndarray  # (n,) int64

    def points(self, index: int) -> np.ndarray:
        """The stored points of sample ``index``, (P, 3); callers must not modify them."""


class ArraySource:
    """Point clouds held in memory: ``points`` (n, P, 3) float32 and ``labels`` (n,) int64."""

    def __init__(self, points: np.ndarray, labels: np.ndarray):
        if len(points) != len(labels):
            raise ValueError(f"{len(points)} point clouds but {len(labels)} labels")
        self._points = points
        self.labels = labels

    def points(self, index: int) -> np.ndarray:
        return self._points[index]


class PointCloudDataset(Dataset):
    """Dict samples ``{"points": (npoints, 3) float32, "label": () int64}`` from a source.

    Args:
        source: where the point clouds and labels live.
        npoints: keep the first ``npoints`` stored points of each sample.
        augment: apply the training augmentation (see the module docstring).
        indices: which source samples this dataset exposes (default: all).
    """

    def __init__(self, source: PointSource, npoints: int, augment: bool, indices: np.ndarray | None = None):
        self.source = source
        self.npoints = npoints
        self.augment = augment
        self.indices = np.arange(len(source.labels)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def labels(self) -> np.ndarray:
        """Labels of the exposed samples, (len(self),) int64."""
        return self.source.labels[self.indices]

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        index = int(self.indices[item])
        points = self.source.points(index)[: self.npoints]  # (npoints, 3), a view of the source
        if self.augment:
            points = augment_points(points, sample_rng())
        return {
            "points": torch.tensor(points, dtype=torch.float32),  # copies: the source stays intact
            "label": torch.tensor(int(self.source.labels[index]), dtype=torch.long),
            "index": torch.tensor(index, dtype=torch.long),
        }


def split_train_val(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of ``range(len(labels))`` into sorted (train, val) index arrays.

    The validation set gets ``max(1, round(val_fraction * n))`` samples, spread over
    the classes in proportion to their sizes (largest remainders first).
    """
    n = len(labels)
    n_val = max(1, round(val_fraction * n))
    if n_val >= n:
        raise UserError(
            f"val_fraction={val_fraction} leaves no training samples out of {n}; "
            f"use a smaller data.val_fraction (or 0 to validate on the test set)."
        )
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (n_val / n)  # (C,) ideal per-class validation sizes
    take = np.floor(quota).astype(int)
    remainder_order = np.argsort(-(quota - take), kind="stable")
    take[remainder_order[: n_val - take.sum()]] += 1
    val = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    val_idx = np.sort(np.concatenate(val))
    train_idx = np.setdiff1d(np.arange(n), val_idx)
    return train_idx, val_idx


class PointCloudDataModule(PointSetDataModule):
    """Base data module for point-cloud classification (see the module docstring).

    Subclasses set ``num_classes`` and ``class_names`` and implement :meth:`_load`, which
    returns ``(train, val_or_None, test)`` sources. :meth:`setup` loads once; the datasets
    are then ``train_set``, ``val_set`` and ``test_set``. A subclass's constructor takes its own
    options and passes ``**options`` on to this one, which holds the defaults of the rest.

    Args:
        root: dataset folder (meaning depends on the subclass).
        npoints: points per sample (the first ``npoints`` stored points).
        augment: apply the training augmentation to the train split.
        val_fraction: 0 validates on the test set; in (0, 1) holds out that
            seeded, stratified fraction of the train split.
        batch_size, eval_batch_size, num_workers, seed, on_bad_file: see
            :class:`datamodules.base.DataModule`; ``seed`` seeds the validation split (and
            generated data, if any); generated data has nothing to skip.

    ``root``, ``npoints``, ``augment`` and the partial train batch: :class:`datamodules.base.PointSetDataModule`.
    """

    num_classes: int
    class_names: list[str]

    def __init__(
        self,
        root: str | None,
        npoints: int = 1024,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        val_fraction: float = 0.0,
        seed: int = 0,
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, augment, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, on_bad_file=on_bad_file)
        self.save_hyperparameters()  # this constructor's arguments and those of the data set's own constructor
        self.val_fraction = float_option("val_fraction", val_fraction, 0.1, 0.0, 1.0, low_closed=True,
                                         why=" (0 validates on the test set)")  # fmt: skip

    def _load(self) -> tuple[PointSource, PointSource | None, PointSource]:
        """Return the (train, val or None, test) sources; bad data goes through ``self.bad``."""
        raise NotImplementedError

    def _build(self) -> None:
        train, val, test = self._load()
        self.bad.warn(self.title)
        self.test_set = PointCloudDataset(test, self.npoints, augment=False)
        if val is not None:
            self.train_set = PointCloudDataset(train, self.npoints, self.augment)
            self.val_set = PointCloudDataset(val, self.npoints, augment=False)
        elif self.val_fraction > 0:
            train_idx, val_idx = split_train_val(train.labels, self.val_fraction, self.seed)
            self.train_set = PointCloudDataset(train, self.npoints, self.augment, train_idx)
            self.val_set = PointCloudDataset(train, self.npoints, augment=False, indices=val_idx)
        else:
            self.train_set = PointCloudDataset(train, self.npoints, self.augment)
            self.val_set = self.test_set

    def val_dataloader(self):
        """In order, every sample exactly once (the test set when ``val_fraction == 0``)."""
        return self._loader("val")
