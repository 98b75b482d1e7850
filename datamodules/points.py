"""Shared pieces of the point-cloud classification data modules (the part-segmentation
modules of :mod:`datamodules.shapenet` reuse :func:`scale_shift`, :func:`sample_rng`,
:func:`read_h5` and the loaders of :class:`PointCloudDataModule`).

Every sample is a plain dict, so PyTorch's default collate batches it::

    {"points": FloatTensor (N, 3), "label": LongTensor ()}
    batch["points"]: (B, N, 3) float32, batch["label"]: (B,) int64

Training augmentation follows the PCT / DGCNN ModelNet40 reference code
(``random_point_dropout``, ``translate_pointcloud``, ``np.random.shuffle``),
applied per sample to the train split only, on a copy (the reference code
corrupts its cached array in place; we never do):

1. point dropout: ratio ~ U(0, 0.875); each point whose U(0, 1) <= ratio is
   replaced by the first point;
2. per-axis scale ~ U(2/3, 3/2) and shift ~ U(-0.2, 0.2);
3. shuffle the point order.

Randomness comes from a numpy Generator seeded per sample from torch's default
generator, which ``lightning.seed_everything(seed, workers=True)`` seeds in the
main process and DataLoader seeds per worker; two identically seeded runs see
identical batches, with or without workers.

Bad data (``on_bad_file``): the file readers check what they read in :meth:`setup`
(files readable, dataset names, shapes, dtypes, label ranges, finite coordinates).
With ``on_bad_file="error"`` (the default) the first problem raises a
:class:`~attention.errors.UserError` naming the file, the sample and the fix; with
``"skip"`` a bad file (all its samples) or a bad sample is dropped and recorded in
``skipped`` (one line each, e.g. ``"ply_data_train1.h5: unreadable (...)"`` or
``"ply_data_train0.h5[17]: NaN or infinite coordinates"``), and a warning gives the
count. A split left with no samples is a UserError either way. ``skipped`` exists on
every data module and is empty when nothing was skipped.

Validation protocol: with ``val_fraction == 0`` (the default) validation uses
the *test* set, as the PCT/ModelNet reference code does (it reports the best
test accuracy over training). With ``val_fraction > 0`` a seeded, stratified
fraction of the train split is held out (unaugmented) for validation.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Protocol

import h5py
import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from attention.errors import UserError
from datamodules.loaders import ResumableLoader, eval_loading, train_sampling
from datamodules.options import on_bad_file_option

log = logging.getLogger(__name__)

MAX_DROPOUT_RATIO = 0.875
SCALE_RANGE = (2.0 / 3.0, 3.0 / 2.0)
SHIFT_RANGE = (-0.2, 0.2)


def augment_points(points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return an augmented float32 copy of ``points`` (N, 3); the input is never modified."""
    pts = np.array(points, dtype=np.float32, copy=True)  # (N, 3)
    ratio = rng.random() * MAX_DROPOUT_RATIO
    drop = rng.random(len(pts)) <= ratio  # (N,)
    pts[drop] = pts[0].copy()
    pts = scale_shift(pts, rng)
    rng.shuffle(pts)  # permutes rows (points)
    return pts


def scale_shift(points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The reference ``translate_pointcloud``: a float32 copy of ``points`` (N, 3) times a
    per-axis scale ~ U(2/3, 3/2) plus a per-axis shift ~ U(-0.2, 0.2) (drawn in that order)."""
    scale = rng.uniform(*SCALE_RANGE, size=3)
    shift = rng.uniform(*SHIFT_RANGE, size=3)
    return (points * scale + shift).astype(np.float32)


DTYPE_KINDS = {"f": "floating point", "iu": "integer"}
SKIP_HINT = "Or set data.on_bad_file=skip to drop bad files and samples (they are counted and named)."
MAX_NAMES = 5  # entries named in a "skipped" warning


class DataError(UserError):
    """A bad file or sample: the message says what and how to fix it; ``entry`` is the one-line
    record that ``on_bad_file=skip`` keeps in ``skipped`` (``"<file>: <reason>"``, ``"<file>[<i>]: <reason>"``)."""

    def __init__(self, message: str, entry: str):
        super().__init__(message)
        self.entry = entry


class BadData:
    """Applies ``data.on_bad_file``: with ``"error"`` the first problem raises (with a hint at
    ``skip``), with ``"skip"`` every problem is appended to ``skipped`` instead."""

    def __init__(self, on_bad_file: str, skipped: list[str]):
        self.skip = on_bad_file == "skip"
        self.skipped = skipped

    def file(self, err: DataError) -> None:
        """A bad file: raise ``err`` (error) or record it (skip)."""
        if not self.skip:
            raise DataError(f"{err} {SKIP_HINT}", err.entry) from None
        self.skipped.append(err.entry)

    def samples(self, path: Path, n: int, checks: list[tuple[np.ndarray, Callable[[int], str]]],
                fix: str) -> np.ndarray:  # fmt: skip
        """Keep-mask (n,) bool of the samples of ``path`` that pass every check.

        Each check is ``(bad, say)``: ``bad`` (n,) bool marks failing samples, ``say(i)`` describes
        the failure of sample ``i`` ("sample 3 has label 57, expected 0..39"). With ``error``
        the first failing sample of the first failing check raises; with ``skip`` every failing
        sample is recorded once, as ``"<path>[i]: <say(i)>"``.
        """
        keep = np.ones(n, dtype=bool)
        for bad, say in checks:
            bad = np.asarray(bad, dtype=bool) & keep
            hits = np.flatnonzero(bad)
            if not len(hits):
                continue
            if not self.skip:
                i = int(hits[0])
                more = f" ({len(hits)} such samples in this file)" if len(hits) > 1 else ""
                raise DataError(f"{path}: {say(i)}{more}. {fix} {SKIP_HINT}", f"{path}[{i}]: {say(i)}")
            self.skipped.extend(f"{path}[{int(i)}]: {say(int(i))}" for i in hits)
            keep &= ~bad
        return keep


def warn_skipped(what: str, skipped: list[str]) -> None:
    """One warning with the count and the first few entries (nothing when empty)."""
    if skipped:
        shown = "; ".join(skipped[:MAX_NAMES]) + ("; ..." if len(skipped) > MAX_NAMES else "")
        log.warning("Skipped %d bad file(s) or sample(s) of %s (data.on_bad_file=skip): %s", len(skipped), what, shown)


def read_h5(path: Path, spec: dict[str, tuple[list[tuple], str]], fix: str) -> dict[str, np.ndarray]:
    """Read and check datasets of one HDF5 file; every failure is a :class:`DataError` naming ``path``.

    Args:
        path: the file.
        spec: dataset name -> (allowed shapes, dtype kinds). A shape is a tuple whose
            entries are ints (exact sizes) or names (free sizes that must agree across
            the datasets, e.g. ``"n"`` for the sample count); kinds are numpy dtype
            kinds, ``"f"`` (floating point) or ``"iu"`` (integer).
        fix: appended to every message: how to get a good file.

    Returns:
        Each dataset of ``spec`` read into memory, with its stored dtype.
    """
    sizes: dict[str, tuple[int, str]] = {}  # named dimension -> (size, first dataset that had it)

    def bad(what: str, short: str | None = None) -> DataError:
        return DataError(f"{path}{what}. {fix}", f"{path}: {short or what.lstrip(': ')}")

    try:
        with h5py.File(path, "r") as f:
            for key in spec:
                if not isinstance(f.get(key), h5py.Dataset):
                    found = sorted(f.keys())
                    raise bad(f" has no '{key}' dataset (found keys: {found})", f"no '{key}' dataset")
            for key, (shapes, kinds) in spec.items():
                shape, dtype = f[key].shape, f[key].dtype
                if shape is None:  # an empty (null dataspace) dataset
                    shape = ()
                shape_ok = [s for s in shapes if len(s) == len(shape) and all(
                    isinstance(want, str) or want == got for want, got in zip(s, shape))]  # fmt: skip
                if not shape_ok:
                    expected = " or ".join("(" + ", ".join(str(d) for d in s) + ("," if len(s) == 1 else "") + ")"
                                           for s in shapes)  # fmt: skip
                    raise bad(f": '{key}' has shape {shape}, expected {expected}")
                if dtype.kind not in kinds:
                    raise bad(f": '{key}' has dtype {dtype}, expected {DTYPE_KINDS[kinds]}")
                for name, size in zip(shape_ok[0], shape):
                    if isinstance(name, str):
                        known, first = sizes.setdefault(name, (size, key))
                        if known != size:
                            raise bad(f": '{first}' has {name}={known} but '{key}' has {name}={size} "
                                      f"(shapes must agree)")  # fmt: skip
            return {key: f[key][()] for key in spec}
    except DataError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:  # h5py's errors on corrupt files
        raise DataError(
            f"{path} cannot be read as HDF5, it is truncated or corrupt ({type(err).__name__}: {err}). {fix}",
            f"{path}: unreadable, truncated or corrupt HDF5 ({type(err).__name__}: {err})",
        ) from None


def pyg_offsets(dataset, key: str) -> torch.Tensor:
    """Offsets (n + 1,) of ``key`` in a collated PyG dataset's storage (PyG keeps no slices for a
    dataset of one item, nor for an attribute no item has)."""
    slices = dataset.slices.get(key) if dataset.slices else None
    if slices is not None:
        return slices
    value = getattr(dataset._data, key, None)
    size = 0 if value is None else value.shape[-1 if key == "face" else 0]
    return torch.tensor([0, size]) if len(dataset) == 1 else torch.zeros(len(dataset) + 1, dtype=torch.long)


def sample_rng() -> np.random.Generator:
    """A fresh numpy Generator seeded from torch's default generator (per process / worker)."""
    return np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))


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


class PointCloudDataModule(L.LightningDataModule):
    """Base data module for point-cloud classification (see the module docstring).

    Subclasses set ``num_classes`` and ``class_names`` and implement
    :meth:`_load`, which returns ``(train, val_or_None, test)`` sources.
    :meth:`setup` loads once; the datasets are then ``train_set``, ``val_set``
    and ``test_set``.

    Args:
        root: dataset folder (meaning depends on the subclass).
        npoints: points per sample (the first ``npoints`` stored points).
        batch_size: training batch size.
        eval_batch_size: validation/test batch size; defaults to ``batch_size``.
        num_workers: DataLoader workers (persistent when > 0).
        augment: apply the training augmentation to the train split.
        val_fraction: 0 validates on the test set; in (0, 1) holds out that
            seeded, stratified fraction of the train split.
        seed: seed of the validation split (and of generated data, if any).
        on_bad_file: ``"error"`` or ``"skip"`` (see the module docstring; generated data has nothing to skip).

    After :meth:`setup`, ``skipped`` lists the bad files and samples that were dropped.
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
        super().__init__()
        for name, value in [("npoints", npoints), ("batch_size", batch_size)]:
            if int(value) < 1:
                raise UserError(f"data.{name} must be a positive integer, got {value}.")
        if eval_batch_size is not None and int(eval_batch_size) < 1:
            raise UserError(f"data.eval_batch_size must be a positive integer or null, got {eval_batch_size}.")
        if int(num_workers) < 0:
            raise UserError(f"data.num_workers must be >= 0, got {num_workers}.")
        if not 0.0 <= float(val_fraction) < 1.0:
            raise UserError(f"data.val_fraction must be in [0, 1) (0 validates on the test set), got {val_fraction}.")
        if int(seed) < 0:
            raise UserError(f"data.seed must be >= 0, got {seed}.")
        self.root = root
        self.npoints = int(npoints)
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size) if eval_batch_size is not None else self.batch_size
        self.num_workers = int(num_workers)
        self.augment = bool(augment)
        self.val_fraction = float(val_fraction)
        self.seed = int(seed)
        self.on_bad_file = on_bad_file_option(on_bad_file)
        self.skipped: list[str] = []  # filled in setup: one line per dropped file or sample
        self.train_set: PointCloudDataset | None = None
        self.val_set: PointCloudDataset | None = None
        self.test_set: PointCloudDataset | None = None

    def _load(self) -> tuple[PointSource, PointSource | None, PointSource]:
        """Return the (train, val or None, test) sources; called once by :meth:`setup`, which has
        emptied ``skipped``; bad data goes through :attr:`bad`."""
        raise NotImplementedError

    @property
    def bad(self) -> BadData:
        """Where the readers send bad files and samples (``on_bad_file`` applied, ``skipped`` filled)."""
        return BadData(self.on_bad_file, self.skipped)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.skipped = []
        train, val, test = self._load()
        warn_skipped(type(self).__name__, self.skipped)
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

    def _loader(self, split: str) -> DataLoader:
        if self.train_set is None:
            self.setup()
        dataset = getattr(self, f"{split}_set")
        train = split == "train"
        batch_size = self.batch_size if train else self.eval_batch_size
        return (ResumableLoader if train else DataLoader)(
            dataset,
            batch_size=batch_size,
            **(train_sampling(dataset) if train else
               eval_loading(dataset, f"{type(self).__name__} {split} split")),
            drop_last=train and len(dataset) > batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0 and not train,  # training: new ones seeded per epoch
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled; drops the last partial batch only when the train set exceeds one batch."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """In order, every sample exactly once (the test set when ``val_fraction == 0``)."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """In order, every sample exactly once."""
        return self._loader("test")
