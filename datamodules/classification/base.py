"""The base of the image classification data modules (``task=classification``).

Right after construction every module has ``num_classes``, ``img_size``
(the side S of the square network input), ``batch_size``, ``mean`` / ``std``
and ``class_names`` (``None`` for ``imagenet`` until :meth:`setup` has read
the class folders, so that ``mode=summary data=imagenet`` needs no data).
Batches are dicts::

    {"image": float32 (B, 3, S, S), normalised with mean / std, "label": int64 (B,)}

Images are decoded with PIL in :meth:`ClassificationDataset.__getitem__`, i.e.
in the DataLoader workers (``data.num_workers``), and transformed there by
timm's ``create_transform``: for training a bicubic random-resized crop,
horizontal flip, RandAugment (``rand-m9-mstd0.5-inc1``) and random erasing
(0.25), DeiT's recipe (``data.augment``); for evaluation a bicubic resize to
S / crop_pct and a centre crop of S. Mixup and CutMix act on whole batches,
on the accelerator, in the task (:mod:`tasks.classification`).

The random numbers come from python's and torch's generators in the process
that loads the sample (a DataLoader worker, seeded by ``seed_everything``, or
the main process). The training order depends on (seed, epoch) only
(:mod:`datamodules.loaders`), so DDP shards and resumed runs keep it.

Bad input raises :class:`~attention.errors.UserError` naming the file or
option: a missing folder or file, class folders that differ between train and
val (the extra and missing classes are named), empty class folders, an
unreadable image. Images are checked in :meth:`setup` by decoding them at
reduced size (JPEG draft mode), when a split holds at most ``verify_limit``
files (``verify_images: auto``; ``true`` / ``false`` force it), so small data
sets fail before training; ``on_bad_file=skip`` drops them there with one
warning and their count. A file that is found unreadable only when a worker
decodes it (ImageNet is too large to check up front) raises a UserError naming
it with ``on_bad_file=error``, and is dropped from its batch with a warning
with ``skip``; the batch lists it (``datamodules.base.SKIPPED``) for the data
module, which counts it once in ``skipped`` (the run's ``data/skipped``).

A new data set is a subclass that sets ``name``, ``num_classes`` and ``class_names`` and implements
:meth:`ClassificationDataModule._sources`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from attention.errors import UserError
from datamodules.base import (DECODE_ERRORS, IMAGENET_MEAN, IMAGENET_STD, MAX_NAMES, SKIPPED, DataError,
                              DataModule, choice_option, float_option, int_option)
from datamodules.formats.image_folder import check_image, open_rgb

log = logging.getLogger(__name__)

VERIFY_CHOICES = ("auto", True, False)
# DeiT's training augmentation (timm create_transform keyword arguments); data.augment overrides keys.
DEIT_AUGMENT = {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "hflip": 0.5, "color_jitter": 0.3,
                "auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25, "re_mode": "pixel", "re_count": 1}
AUGMENT_KEYS = (*DEIT_AUGMENT, "vflip", "train_crop_mode")


def names(items: Sequence) -> str:
    """The first :data:`~datamodules.base.MAX_NAMES` of ``items``, comma-separated, and how many in all."""
    items = [str(n) for n in items]
    return ", ".join(items[:MAX_NAMES]) + (f", ... ({len(items)} in all)" if len(items) > MAX_NAMES else "")


# ---------------------------------------------------------------------------
# samples


class FileSource:
    """``(path, label)`` samples under ``folder``, decoded on access.

    The paths are kept as one numpy array of bytes relative to ``folder`` and the labels as an int64
    array: a list of 1.28M Path objects would be copied page by page into every DataLoader worker as
    their reference counts change (copy-on-write), numpy buffers are shared."""

    def __init__(self, folder: Path, samples: list[tuple[Path, int]]):
        self.folder = Path(folder)
        self.names = np.array([os.fsencode(p.relative_to(self.folder)) for p, _ in samples], dtype=bytes)
        self.labels = np.array([label for _, label in samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> Path:
        return self.folder / os.fsdecode(self.names[index])

    def image(self, index: int) -> Image.Image:
        """The RGB image; PIL's errors propagate (the dataset names the file)."""
        return open_rgb(self.path(index))

    def name(self, index: int) -> str:
        return str(self.path(index))


class ArraySource:
    """Images held in memory: uint8 (N, H, W, 3) and int64 labels (N,)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, name: str):
        assert images.dtype == np.uint8 and images.ndim == 4 and images.shape[-1] == 3, images.shape
        self.images, self.labels, self._name = images, np.asarray(labels, dtype=np.int64), name

    def __len__(self) -> int:
        return len(self.images)

    def image(self, index: int) -> Image.Image:
        return Image.fromarray(self.images[index])

    def name(self, index: int) -> str:
        return f"{self._name}[{index}]"


class ClassificationDataset(Dataset):
    """``{"image": transform(PIL image), "label": int64}`` per sample, decoded here (in the worker).

    An image that cannot be decoded raises a UserError naming it (``on_bad_file="error"``) or
    yields ``{SKIPPED: "<file>: <reason>"}`` with a warning (``"skip"``), which :func:`collate` drops from
    the batch and lists in it, for the run's count."""

    def __init__(self, source: FileSource | ArraySource, transform, on_bad_file: str = "error"):
        self.source, self.transform, self.on_bad_file = source, transform, on_bad_file

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | str]:
        try:
            image = self.source.image(index)
        except DECODE_ERRORS as err:
            if self.on_bad_file == "skip":
                log.warning("Skipped unreadable image %s (data.on_bad_file=skip): %s", self.source.name(index), err)
                return {SKIPPED: f"{self.source.name(index)}: cannot be decoded as an image ({type(err).__name__})"}
            raise UserError(f"{self.source.name(index)} cannot be decoded as an image ({type(err).__name__}: "
                            f"{err}). Remove or replace it, or set data.on_bad_file=skip to skip unreadable "
                            "files.") from None
        return {"image": self.transform(image), "label": torch.tensor(int(self.source.labels[index]))}


def collate(samples: list[dict]) -> dict:
    """Stack samples into ``{"image": (B, 3, S, S), "label": (B,)}``, dropping skipped ones (listed under
    ``SKIPPED``, which the data module counts)."""
    kept = [s for s in samples if SKIPPED not in s]
    if not kept:
        raise UserError(f"Every image of a batch of {len(samples)} was unreadable (data.on_bad_file=skip): check "
                        "the data set's files (see the warnings above).")
    batch = {"image": torch.stack([s["image"] for s in kept]), "label": torch.stack([s["label"] for s in kept])}
    if len(kept) < len(samples):
        batch[SKIPPED] = [s[SKIPPED] for s in samples if SKIPPED in s]
    return batch


# ---------------------------------------------------------------------------
# the base data module


class ClassificationDataModule(DataModule):
    """Base classification data module (contract in the module docstring).

    Subclasses set ``name``, ``num_classes`` and ``class_names`` and implement :meth:`_sources`,
    returning the ``train``, ``val`` and ``test`` sources (``test`` may be the ``val`` object
    itself); :meth:`setup` calls it once. Their ``__init__`` names only its own options and those whose
    default differs (e.g. ``img_size``) and passes the rest on as ``**options``: the defaults live here.

    Args:
        img_size: side S of the square images the network sees.
        batch_size: training images per process and step (the last partial batch is dropped).
        eval_batch_size: validation / test batch; None = batch_size.
        num_workers: DataLoader workers decoding and augmenting images.
        augment: timm ``create_transform`` options for training over DeiT's (``DEIT_AUGMENT``):
            scale, ratio, hflip, vflip, color_jitter, auto_augment, re_prob, re_mode, re_count,
            train_crop_mode; ``null`` values switch a part off.
        interpolation: resampling of the crops ("bicubic", DeiT's).
        crop_pct: evaluation: resize to S / crop_pct, then centre-crop S (0.875 for ImageNet).
        mean, std: normalisation.
        on_bad_file: ``"error"`` or ``"skip"`` for unreadable images.
        verify_images: ``auto`` (decode every file of a split in :meth:`setup` if it holds at
            most ``verify_limit`` files), true or false.
        verify_limit: see ``verify_images``.
        repeated_aug: DeiT's repeated augmentation: each training image this many times an epoch, its copies on
            different processes (``datamodules.classification.repeated``); 0 (or 1): off.
        seed: kept with the hyper-parameters; the randomness comes from the seeded generators.
    """

    name: str = "classification"
    num_classes: int
    class_names: list[str] | None
    sample_noun = "images"

    def __init__(
        self,
        img_size: int = 224,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 8,
        augment: Mapping | None = None,
        interpolation: str = "bicubic",
        crop_pct: float = 0.875,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        on_bad_file: str = "error",
        verify_images: str | bool = "auto",
        verify_limit: int = 20000,
        repeated_aug: int = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size, eval_batch_size, num_workers, seed, on_bad_file)
        self.save_hyperparameters()
        self.img_size = int_option("img_size", img_size, 1, self._example("img_size", 224))
        unknown = sorted(set(augment or {}) - set(AUGMENT_KEYS))
        if unknown:
            raise UserError(f"data.augment.{unknown[0]} is not an augmentation option; the options are "
                            f"{', '.join(AUGMENT_KEYS)} (timm's create_transform), e.g. data.augment.re_prob=0.25.")
        self.augment = {**DEIT_AUGMENT, **dict(augment or {})}
        self.interpolation = str(interpolation)
        self.crop_pct = float_option("crop_pct", crop_pct, "0.875 (ImageNet) or 1.0 (no border cropped)",
                                     high=1.0, high_closed=True)
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.verify_images = choice_option("verify_images", verify_images, VERIFY_CHOICES)
        self.verify_limit = int_option("verify_limit", verify_limit, 0, self._example("verify_limit", 20000))
        self.repeated_aug = int_option("repeated_aug", repeated_aug, 0, self._example("repeated_aug", 3))
        if isinstance(getattr(self, "class_names", None), list):
            self.class_names = list(self.class_names)  # an instance's own copy of a class-level list

    def train_sampling(self, dataset: Dataset) -> dict:
        """With ``repeated_aug`` > 1, DeiT's repeated augmentation; else shuffled by (seed, epoch)."""
        if self.repeated_aug > 1:
            from datamodules.classification.repeated import RepeatedAugmentation
            from datamodules.loaders import train_sampling

            return train_sampling(dataset, RepeatedAugmentation, repeats=self.repeated_aug)
        return super().train_sampling(dataset)

    # -- to implement -----------------------------------------------------------------------------------------
    def _sources(self) -> dict[str, FileSource | ArraySource]:
        """``{"train": ..., "val": ..., "test": ...}``; called once by :meth:`setup`."""
        raise NotImplementedError

    # -- transforms -------------------------------------------------------------------------------------------
    def train_transform(self):
        """timm's training transform: random-resized crop, flip, RandAugment, normalise, random erasing."""
        from timm.data import create_transform

        options = {k: v for k, v in self.augment.items() if v is not None}
        options.setdefault("color_jitter", 0.0)
        if options.get("hflip") is None:
            options["hflip"] = 0.0
        for key in ("scale", "ratio"):
            if key in options:
                options[key] = tuple(float(v) for v in options[key])
        try:
            return create_transform(self.img_size, is_training=True, interpolation=self.interpolation,
                                    mean=self.mean, std=self.std, **options)
        except (AssertionError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"data.augment {options} is not a valid timm augmentation ({type(err).__name__}: "
                            f"{err}); e.g. data.augment.auto_augment=rand-m9-mstd0.5-inc1, "
                            "data.augment.re_prob=0.25, data.augment.scale=[0.08,1.0].") from None

    def eval_transform(self):
        """Resize to img_size / crop_pct (bicubic), centre-crop img_size, normalise."""
        from timm.data import create_transform

        return create_transform(self.img_size, is_training=False, interpolation=self.interpolation,
                                crop_pct=self.crop_pct, mean=self.mean, std=self.std)

    # -- setup and loaders ------------------------------------------------------------------------------------
    def _build(self) -> None:
        """Read and check the splits; the datasets decode and transform their images when loaded."""
        sources = self._sources()
        for split, source in sources.items():
            if len(source) == 0:
                raise UserError(f"The {self.name} {split} split has no usable images"
                                f"{f' ({len(self.skipped)} skipped)' if self.skipped else ''}; check the data set.")
        train, evaluate = self.train_transform(), self.eval_transform()
        self.train_set = ClassificationDataset(sources["train"], train, self.on_bad_file)
        self.val_set = ClassificationDataset(sources["val"], evaluate, self.on_bad_file)
        self.test_set = self.val_set if sources["test"] is sources["val"] else \
            ClassificationDataset(sources["test"], evaluate, self.on_bad_file)

    def collate(self):
        return collate

    # -- checks shared by the folder data sets ----------------------------------------------------------------
    def _verify(self, split: str, samples: list[tuple[Path, int]], fix: str) -> list[tuple[Path, int]]:
        """Decode every file of ``samples`` when asked (``verify_images``); returns the usable ones."""
        wanted = self.verify_images is True or (self.verify_images == "auto" and len(samples) <= self.verify_limit)
        if not wanted:
            return samples
        bad = []
        for path, _ in samples:
            try:
                check_image(path)
            except DECODE_ERRORS as err:
                bad.append((path, f"{type(err).__name__}: {err}"))
        if not bad:
            return samples
        if not self.bad.skip:
            more = f" ({len(bad)} unreadable files in {split}/ in all: {names([p for p, _ in bad])})" \
                if len(bad) > 1 else ""
            raise UserError(f"{bad[0][0]} cannot be decoded as an image ({bad[0][1]}){more}. {fix} Or set "
                            "data.on_bad_file=skip to skip unreadable files.")
        for path, why in bad:
            self.bad.file(DataError(f"{path} cannot be decoded as an image ({why}).", str(path)))
        self.bad.warn(f"{self.name} {split}", "unreadable image(s)")
        dropped = {p for p, _ in bad}
        return [(p, label) for p, label in samples if p not in dropped]
