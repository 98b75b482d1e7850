"""The part-segmentation family: its base data module, packed shapes and sample dataset.

A dataset of this family (:mod:`~datamodules.partseg.shapenet_part`, :mod:`~datamodules.partseg.shapenet_part_h5`,
:mod:`~datamodules.partseg.shapenet_part_pyg`, :mod:`~datamodules.partseg.parts`) subclasses
:class:`PartSegDataModule`, calls ``_set_categories`` in ``__init__`` and implements ``_load``, which
returns the (train, val or None, test) :class:`PackedSource` objects.

Batch contract (every part-segmentation module)::

    sample = {"points": FloatTensor (N, 3), "parts": LongTensor (N,) global part ids,
              "category": LongTensor () category index, "index": LongTensor () the shape's row in its split,
              "normals": FloatTensor (N, 3)}          # only when normals=True
    batch["points"]: (B, N, 3) float32, batch["parts"]: (B, N) int64, batch["category"]: (B,) int64,
    batch["index"]: (B,) int64

``index`` says which shape a sample is, whatever the batch and process it lands in: test-time voting draws each
shape's scales from it (:mod:`tasks.voting`).

Part ids are global: each category owns a contiguous range (:func:`contiguous_parts`).
``num_categories``, ``num_parts``, ``category_names`` and ``category_parts`` are available
right after construction.

Point sampling (per access, :func:`sample_indices`): a shape with P >= N stored
points yields N distinct points chosen at random (without replacement); a shape
with P < N yields all its P points plus N - P repeats drawn with replacement, in
random order (the PCT / PointNet++ reference loaders draw all N with replacement;
ours never leaves a point out). Train samples draw from the torch-seeded
per-sample generator of :func:`datamodules.points.ops.sample_rng` (new points every
epoch, reproducible under ``seed_everything(seed, workers=True)``); validation and
test samples draw from ``np.random.default_rng([seed, split, index])``, identical
in every epoch and run. The same selection is applied to points, parts and normals.

Training augmentation (train split, ``augment=True``, on a copy): the reference
``translate_pointcloud``, per-axis scale ~ U(2/3, 3/2) and shift ~ U(-0.2, 0.2)
(:func:`datamodules.points.ops.scale_shift`). No point dropout (it would misalign the
labels) and no rotation; normals are returned unchanged (they are not rescaled,
so after a non-uniform scale they are only approximately normal).

Validation: the data set's val split when it has one, else the test split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from attention.errors import UserError
from datamodules.base import SPLITS, PointSetDataModule, bool_option
from datamodules.points.ops import sample_rng, scale_shift


def contiguous_parts(counts: Sequence[int]) -> list[list[int]]:
    """Global part ids per category when category ``c`` owns ``counts[c]`` consecutive ids."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [list(range(starts[c], starts[c + 1])) for c in range(len(counts))]


class PackedSource:
    """Shapes of varying sizes packed into flat arrays (shape ``i`` is rows ``offsets[i]:offsets[i+1]``).

    Args:
        points: (T, 3) float32, all shapes' points concatenated.
        parts: (T,) integer global part ids.
        offsets: (n + 1,) int64, ``offsets[0] == 0`` and ``offsets[-1] == T``.
        categories: (n,) int64 category indices.
        normals: (T, 3) float32, or None.
    """

    def __init__(self, points, parts, offsets, categories, normals=None):
        self.points, self.parts, self.normals = points, parts, normals
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.categories = np.asarray(categories, dtype=np.int64)
        if len(self.offsets) != len(self.categories) + 1 or not self.offsets[-1] == len(points) == len(parts):
            raise ValueError(f"inconsistent packed arrays: {len(points)} points, offsets {self.offsets[[0, -1]]}")

    def __len__(self) -> int:
        return len(self.categories)

    def shape(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Views of shape ``index``: points (P, 3), parts (P,), normals (P, 3) or None; do not modify."""
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.points[lo:hi], self.parts[lo:hi], None if self.normals is None else self.normals[lo:hi]

    @staticmethod
    def concat(sources: Sequence[PackedSource]) -> PackedSource:
        """All shapes of ``sources``, in order (normals only if every source has them)."""
        normals = [s.normals for s in sources]
        ends = np.cumsum([0] + [s.offsets[-1] for s in sources])
        return PackedSource(
            np.concatenate([s.points for s in sources]),
            np.concatenate([s.parts for s in sources]),
            np.concatenate([[0]] + [s.offsets[1:] + end for s, end in zip(sources, ends)]),
            np.concatenate([s.categories for s in sources]),
            None if any(n is None for n in normals) else np.concatenate(normals),
        )


def sample_indices(count: int, npoints: int, rng: np.random.Generator) -> np.ndarray:
    """``npoints`` row indices into a shape of ``count`` points (see the module docstring)."""
    if count >= npoints:
        return rng.choice(count, npoints, replace=False)
    idx = np.concatenate([np.arange(count), rng.integers(0, count, npoints - count)])
    rng.shuffle(idx)
    return idx


class PartDataset(Dataset):
    """Dict samples of the batch contract (module docstring) from a :class:`PackedSource`.

    Args:
        source: the shapes.
        npoints: points per sample (:func:`sample_indices`).
        augment: apply the training augmentation (scale and shift of the points).
        normals: include ``"normals"`` (the source must have them).
        eval_seed: None for training (torch-seeded draws, new every epoch); otherwise
            a tuple of ints prefixing the per-index seed of the deterministic draws.
    """

    def __init__(self, source: PackedSource, npoints: int, augment: bool, normals: bool,
                 eval_seed: tuple[int, ...] | None = None):  # fmt: skip
        if normals and source.normals is None:
            raise ValueError("normals requested from a source without normals")
        self.source = source
        self.npoints = npoints
        self.augment = augment
        self.normals = normals
        self.eval_seed = eval_seed

    def __len__(self) -> int:
        return len(self.source)

    @property
    def categories(self) -> np.ndarray:
        """Category of every sample, (len(self),) int64."""
        return self.source.categories

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        points, parts, normals = self.source.shape(index)
        rng = sample_rng() if self.eval_seed is None else np.random.default_rng([*self.eval_seed, index])
        choice = sample_indices(len(points), self.npoints, rng)
        pts = points[choice]  # fancy indexing copies: the source stays intact
        if self.augment:
            pts = scale_shift(pts, rng)
        sample = {
            "points": torch.from_numpy(np.ascontiguousarray(pts, dtype=np.float32)),
            "parts": torch.from_numpy(parts[choice].astype(np.int64)),
            "category": torch.tensor(int(self.source.categories[index]), dtype=torch.long),
            "index": torch.tensor(index, dtype=torch.long),
        }
        if self.normals:
            sample["normals"] = torch.from_numpy(np.ascontiguousarray(normals[choice], dtype=np.float32))
        return sample


class PartSegDataModule(PointSetDataModule):
    """Base data module for part segmentation (see the module docstring).

    Subclasses call :meth:`_set_categories` in ``__init__`` and implement :meth:`_load`, returning
    ``(train, val or None, test)`` :class:`PackedSource` objects (None: validate on test). A
    subclass's constructor takes its own options and passes ``**options`` on to this one, which
    holds the defaults of the rest.

    Args:
        root: dataset folder (meaning depends on the subclass).
        npoints: points per sample.
        normals: add per-point ``"normals"`` to every sample.
        augment: apply the training augmentation (scale and shift) to the train split.
        batch_size, eval_batch_size, num_workers, seed, on_bad_file: see
            :class:`datamodules.base.DataModule`; ``seed`` also fixes the validation/test
            point selection.

    ``root``, ``npoints``, ``augment`` and the partial train batch: :class:`datamodules.base.PointSetDataModule`.
    """

    num_categories: int
    num_parts: int
    category_names: list[str]
    category_parts: list[list[int]]

    def __init__(
        self,
        root: str | None,
        npoints: int = 2048,
        normals: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        seed: int = 0,
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, augment, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, on_bad_file=on_bad_file)
        self.save_hyperparameters()  # this constructor's arguments and those of the data set's own constructor
        self.normals = bool_option("normals", normals)

    def _set_categories(self, names: list[str], parts: list[list[int]]) -> None:
        self.category_names = list(names)
        self.category_parts = [list(p) for p in parts]
        self.num_categories = len(names)
        self.num_parts = sum(len(p) for p in parts)

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        """Return the (train, val or None, test) shapes; bad data goes through ``self.bad``."""
        raise NotImplementedError

    def _build(self) -> None:
        train, val, test = self._load()
        self.bad.warn(self.title)
        for split, source in (("train", train), ("val", val), ("test", test)):
            if source is not None and len(source) == 0:
                raise UserError(
                    f"The {self.title} {split} split has no usable shapes (data.root={self.root}"
                    f"{f', {len(self.skipped)} bad files or samples skipped' if self.skipped else ''}); "
                    f"restore the dataset files, or run offline with data=parts."
                )
        self.train_set = PartDataset(train, self.npoints, self.augment, self.normals)
        self.test_set = PartDataset(test, self.npoints, False, self.normals, (self.seed, SPLITS["test"]))
        self.val_set = self.test_set if val is None else PartDataset(
            val, self.npoints, False, self.normals, (self.seed, SPLITS["val"]))  # fmt: skip

    def val_dataloader(self):
        """In order, every sample exactly once (the test set when there is no val split)."""
        return self._loader("val")
