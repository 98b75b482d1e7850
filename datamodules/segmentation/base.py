"""The base of the semantic-segmentation data modules (the contract: :mod:`datamodules.segmentation`).

A dataset is one module that subclasses :class:`SegDataModule` and fills in:

- ``name`` (how messages name it; also its config name), ``class_names`` and ``palette`` (class attributes);
- :meth:`SegDataModule._check`: where its folder is under ``root``, or a UserError showing the layout;
- :meth:`SegDataModule._sources`: its ``train`` / ``val`` / ``test`` sources (``test`` may be ``val`` itself).

An ``__init__`` only where the dataset has options of its own or other defaults: it names those and passes
the rest on (``**options``), so the shared options, their checks and their defaults live here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import (IMAGENET_MEAN, IMAGENET_STD, DataModule, bool_option, float_option, int_option,
                              is_sequence)
from datamodules.segmentation.files import header_problem
from datamodules.segmentation.labels import IGNORE_INDEX
from datamodules.segmentation.sources import ArraySource, FileSource, SegmentationDataset
from datamodules.segmentation.transforms import PadCollate, TrainTransform


def crop_option(value) -> tuple[int, int]:
    """``data.crop`` as (h, w): an int (square) or [h, w], each >= 1."""
    fix = "data.crop must be a positive integer or a list [height, width] of them"
    if is_sequence(value):
        if len(value) != 2:
            raise UserError(f"{fix}, got {list(value)!r}; e.g. data.crop=512 or data.crop=[512,1024].")
        return (int_option("crop", value[0], 1, "[512,1024]"), int_option("crop", value[1], 1, "[512,1024]"))
    size = int_option("crop", value, 1, 512)
    return size, size


def scale_range_option(value) -> tuple[float, float]:
    """``data.scale_range`` as (low, high) with 0 < low <= high, both finite."""
    try:
        lo, hi = (float(v) for v in value) if is_sequence(value) and len(value) == 2 else (None, None)
        ok = lo is not None and 0 < lo <= hi and np.isfinite(hi)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(
            f"data.scale_range must be [low, high] with 0 < low <= high, got {value!r}; e.g. "
            f"data.scale_range=[0.5,2.0] (or [1,1] for no scaling)."
        )
    return lo, hi


class SegDataModule(DataModule):
    """Base semantic-segmentation data module (the contract: :mod:`datamodules.segmentation`).

    Args:
        root: where the dataset lives (see the subclass); None for generated data.
        crop: training crop, an int (square) or [h, w].
        scale_range: [low, high] of the random training scale.
        flip: random horizontal flips in training.
        batch_size: training batch size (the last partial batch is dropped).
        eval_batch_size: validation / test batch size (images padded to the largest).
        num_workers: DataLoader workers (persistent for evaluation when > 0).
        on_bad_file: ``"error"`` or ``"skip"`` (drop samples found bad in setup, with a warning).
        lr: the dataset's recipe learning rate, stored for the task.
        seed: kept with the hyper-parameters (and seeds generated data); the augmentation
            randomness comes from torch's generator, seeded by ``seed_everything``.
    """

    name: str = "segmentation"
    class_names: Sequence[str]  # per class index, declared by each dataset
    palette: np.ndarray  # uint8 (num_classes, 3), declared by each dataset
    ignore_index: int = IGNORE_INDEX
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __init__(
        self,
        root: str | None,
        crop: int | Sequence[int] = 512,
        scale_range: Sequence[float] = (0.5, 2.0),
        flip: bool = True,
        batch_size: int = 16,
        eval_batch_size: int = 1,
        num_workers: int = 4,
        on_bad_file: str = "error",
        lr: float = 0.01,
        seed: int = 0,
    ):
        super().__init__(batch_size, eval_batch_size, num_workers, seed, on_bad_file)
        # The arguments of this call and of the subclass's __init__ (generated data has no root to record).
        self.save_hyperparameters(ignore=["root"] if root is None else None)
        self.root = None if root is None else str(root)
        self.crop = crop_option(crop)
        self.scale_range = scale_range_option(scale_range)
        self.flip = bool_option("flip", flip)
        self.lr = float_option("lr", lr, self._example("lr", 0.01))
        # The instance's own copies of the class's declarations (callers may edit them).
        self.class_names = list(self.class_names)
        self.palette = np.array(self.palette, dtype=np.uint8)
        self.num_classes = len(self.class_names)

    def _sources(self) -> dict[str, FileSource | ArraySource]:
        """``{"train": ..., "val": ..., "test": ...}``; called once by :meth:`setup`."""
        raise NotImplementedError

    def _check(self) -> Path:
        """The dataset folder; UserError with the expected layout when it is missing."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Fail early (before any worker starts) when the dataset is not where ``root`` says."""
        if self.root is not None:
            self._check()

    def _build(self) -> None:
        """Check the files (headers of every pair) and build the three splits (``setup`` calls this once)."""
        sources = self._sources()
        checked: dict[int, FileSource] = {}  # test is often val itself: check it once
        for split, source in sources.items():
            if isinstance(source, FileSource):
                if id(source) not in checked:
                    checked[id(source)] = self._check_headers(source)
                sources[split] = checked[id(source)]
        for split, source in sources.items():
            if len(source) == 0:
                raise UserError(
                    f"The {self.name} {split} split has no usable samples (data.root={self.root}"
                    f"{f', {len(self.skipped)} skipped' if self.skipped else ''}); check the dataset layout."
                )
        transform = TrainTransform(self.crop, self.scale_range, self.flip)
        self.train_set = SegmentationDataset(sources["train"], transform, self.mean, self.std)
        self.val_set = SegmentationDataset(sources["val"], None, self.mean, self.std)
        if sources["test"] is sources["val"]:
            self.test_set = self.val_set
        else:
            self.test_set = SegmentationDataset(sources["test"], None, self.mean, self.std)

    def collate(self) -> PadCollate:
        """Evaluation images differ in size: pad a batch to the largest (black images, masks 255)."""
        return PadCollate(self.mean, self.std)

    def _drop(self, problems: list[tuple[Path, str]], fix: str) -> set[Path]:
        """Setup-time problems ``(file, what is wrong)`` through ``data.on_bad_file``: the first raises
        (error), or all are recorded in ``skipped`` and reported in one warning per check (skip).
        Returns the files to drop."""
        drop = self.bad.problems(problems, fix)
        self.bad.warn(self.title, "bad sample(s)")
        return drop

    def _check_headers(self, source: FileSource) -> FileSource:
        """``source`` without the pairs whose image or mask header is bad (see :mod:`datamodules.segmentation`):
        the first raises (on_bad_file=error) or all are dropped and recorded (skip)."""
        problems, bad_images = [], set()
        for image, mask, _ in source.pairs:
            problem = header_problem(image, mask)
            if problem is not None:
                problems.append(problem)
                bad_images.add(image)
        self._drop(problems, source.fix)
        if not problems:
            return source
        return FileSource([p for p in source.pairs if p[0] not in bad_images], source.fix)
