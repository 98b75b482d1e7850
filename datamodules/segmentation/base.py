"""The base of the semantic-segmentation data modules (the contract: :mod:`datamodules.segmentation`).

A dataset subclasses :class:`SegDataModule` and fills in ``name``, the classes and their colours,
:meth:`SegDataModule._check` (where its folder is) and :meth:`SegDataModule._sources` (its splits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from attention.errors import UserError
from datamodules.loaders import ResumableLoader, eval_loading, train_sampling
from datamodules.options import int_option, on_bad_file_option
from datamodules.segmentation.files import header_problem
from datamodules.segmentation.labels import IGNORE_INDEX
from datamodules.segmentation.sources import ArraySource, FileSource, SegmentationDataset
from datamodules.segmentation.transforms import IMAGENET_MEAN, IMAGENET_STD, PadCollate, TrainTransform

log = logging.getLogger(__name__)

MAX_NAMES = 5  # files named in a "skipped" warning


# ---------------------------------------------------------------------------
# option checks


def _float_option(name: str, value, example) -> float:
    try:
        ok = not isinstance(value, bool) and float(value) > 0 and np.isfinite(float(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"data.{name} must be a positive number, got {value!r}; e.g. data.{name}={example}.")
    return float(value)


def _bool_option(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise UserError(f"data.{name} must be true or false, got {value!r}.")
    return bool(value)


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))  # lists, tuples, ListConfig


def _crop_option(value) -> tuple[int, int]:
    """``crop`` as (h, w): an int (square) or [h, w], each >= 1."""
    fix = "data.crop must be a positive integer or a list [height, width] of them"
    if _is_sequence(value):
        if len(value) != 2:
            raise UserError(f"{fix}, got {list(value)!r}; e.g. data.crop=512 or data.crop=[512,1024].")
        return (int_option("crop", value[0], 1, "[512,1024]"), int_option("crop", value[1], 1, "[512,1024]"))
    size = int_option("crop", value, 1, 512)
    return size, size


def _scale_range_option(value) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value) if _is_sequence(value) and len(value) == 2 else (None, None)
        ok = lo is not None and 0 < lo <= hi and np.isfinite(hi)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(
            f"data.scale_range must be [low, high] with 0 < low <= high, got {value!r}; e.g. "
            f"data.scale_range=[0.5,2.0] (or [1,1] for no scaling)."
        )
    return lo, hi


def _describe(names: Sequence) -> str:
    names = [str(n) for n in names]
    return ", ".join(names[:MAX_NAMES]) + (", ..." if len(names) > MAX_NAMES else "")


# ---------------------------------------------------------------------------
# the base data module


class SegDataModule(L.LightningDataModule):
    """Base semantic-segmentation data module (the contract: :mod:`datamodules.segmentation`).

    Subclasses set ``name``, ``num_classes``, ``class_names`` and ``palette`` in
    ``__init__`` and implement :meth:`_sources`, which returns the ``train``,
    ``val`` and ``test`` sources (``test`` may be the ``val`` object itself).

    Args:
        root: where the dataset lives (see the subclass); None for generated data.
        crop: training crop, an int (square) or [h, w].
        scale_range: [low, high] of the random training scale.
        flip: random horizontal flips in training.
        batch_size: training batch size (the last partial batch is dropped).
        eval_batch_size: validation / test batch size (images padded to the largest).
        num_workers: DataLoader workers (persistent when > 0).
        on_bad_file: ``"error"`` or ``"skip"`` (drop samples found bad in setup, with a warning).
        lr: the dataset's recipe learning rate, stored for the task.
        seed: kept with the hyper-parameters (and seeds generated data); the augmentation
            randomness comes from torch's generator, seeded by ``seed_everything``.
    """

    name: str = "segmentation"
    num_classes: int
    class_names: list[str]
    palette: np.ndarray
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
        super().__init__()
        self.root = None if root is None else str(root)
        self.crop = _crop_option(crop)
        self.scale_range = _scale_range_option(scale_range)
        self.flip = _bool_option("flip", flip)
        self.batch_size = int_option("batch_size", batch_size, 1, 16)
        self.eval_batch_size = int_option("eval_batch_size", eval_batch_size, 1, 1)
        self.num_workers = int_option("num_workers", num_workers, 0, 4)
        self.on_bad_file = on_bad_file_option(on_bad_file)
        self.lr = _float_option("lr", lr, 0.01)
        self.seed = int_option("seed", seed, 0, 0)
        self.skipped: list[str] = []  # "<file>: <what is wrong>" per sample dropped in setup (on_bad_file=skip)
        self.train_set: SegmentationDataset | None = None
        self.val_set: SegmentationDataset | None = None
        self.test_set: SegmentationDataset | None = None

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

    def setup(self, stage: str | None = None) -> None:
        """Check the files and build the three splits once (later calls do nothing)."""
        if self.train_set is not None:
            return
        self.skipped = []
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

    def _problems(self, problems: list[tuple[Path, str]], fix: str) -> set[Path]:
        """Handle the setup-time problems ``(file, what is wrong)``: raise for the first with
        ``on_bad_file=error``, else count them, warn once and return the files to drop."""
        if not problems:
            return set()
        path, what = problems[0]
        if self.on_bad_file == "error":
            more = f" ({len(problems)} such problems in all)" if len(problems) > 1 else ""
            raise UserError(
                f"{path}: {what}{more}. {fix} Or set data.on_bad_file=skip to drop such samples."
            )
        files = [p for p, _ in problems]
        self.skipped.extend(f"{p}: {what}" for p, what in problems)
        log.warning(
            "Skipped %d bad sample(s) of %s (data.on_bad_file=skip): %s", len(files), self.name, _describe(files)
        )
        return set(files)

    def _check_headers(self, source: FileSource) -> FileSource:
        """``source`` without the pairs whose image or mask header is bad (see :mod:`datamodules.segmentation`):
        the first raises (on_bad_file=error) or all are dropped and recorded (skip)."""
        problems, bad_images = [], set()
        for image, mask, _ in source.pairs:
            problem = header_problem(image, mask)
            if problem is not None:
                problems.append(problem)
                bad_images.add(image)
        self._problems(problems, source.fix)
        if not problems:
            return source
        return FileSource([p for p in source.pairs if p[0] not in bad_images], source.fix)

    def _loader(self, split: str) -> DataLoader:
        self.setup()
        dataset = getattr(self, f"{split}_set")
        train = split == "train"
        if train and len(dataset) < self.batch_size:
            raise UserError(
                f"The {self.name} training split has {len(dataset)} samples, fewer than one batch of "
                f"data.batch_size={self.batch_size}; lower data.batch_size or add data."
            )
        return (ResumableLoader if train else DataLoader)(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            **(train_sampling(dataset) if train else
               eval_loading(dataset, f"{self.name} {split} split")),
            drop_last=train,
            collate_fn=PadCollate(self.mean, self.std),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0 and not train,  # training: new ones seeded per epoch
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented crops; the last partial batch is dropped."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """Whole images in a fixed order, each exactly once."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Whole images in a fixed order (the validation split for VOC, ADE20K and Cityscapes)."""
        return self._loader("test")
