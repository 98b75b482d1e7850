"""Image classification data modules (``task=classification``).

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

Datasets:

* ``ImageNet`` (config ``imagenet``): the standard folder layout
  ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG``; 1,000 classes.
  The validation split is also the test split (ImageNet has no public test labels).
* ``FolderClassification`` (config ``folder_cls``): the same layout with any
  class names and any number of classes (``<root>/train/<class>/*``, ``<root>/val/<class>/*``).
* ``CIFAR10Classification`` / ``CIFAR100`` (configs ``cifar10_cls`` / ``cifar100``): the python
  releases (``cifar-10-batches-py/``, ``cifar-100-python/``); the test batch is
  the validation and test split unless ``val_size`` holds some training images out.
* ``TinyDigits`` (config ``tiny``): scikit-learn's 1,797 handwritten digits
  (8x8, upscaled to 32x32 RGB, 10 classes), split 1,297 / 250 / 250; offline,
  for the demo and the tests, with light augmentation (no RandAugment, no flips).

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
with ``skip``.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from attention.errors import UserError
from datamodules.loaders import ResumableLoader, eval_loading, train_sampling
from datamodules.download import ensure_release
from datamodules.images import (CIFAR10_CLASSES, CIFAR10_FILES, CIFAR10_FOLDER, CIFAR10_MD5, CIFAR10_TRAIN_FILES,
                                CIFAR10_URL, DECODE_ERRORS, _ArrayUnpickler, _read_cifar_batch, _read_cifar_meta)
from datamodules.options import int_option, on_bad_file_option

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
VERIFY_CHOICES = ("auto", True, False)
MAX_NAMES = 5  # names listed in one message
# DeiT's training augmentation (timm create_transform keyword arguments); data.augment overrides keys.
DEIT_AUGMENT = {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "hflip": 0.5, "color_jitter": 0.3,
                "auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25, "re_mode": "pixel", "re_count": 1}
AUGMENT_KEYS = (*DEIT_AUGMENT, "vflip", "train_crop_mode")


def _describe(names: Sequence) -> str:
    names = [str(n) for n in names]
    return ", ".join(names[:MAX_NAMES]) + (f", ... ({len(names)} in all)" if len(names) > MAX_NAMES else "")


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
        with Image.open(self.path(index)) as img:
            return img.convert("RGB")

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
    yields ``None`` with a warning (``"skip"``), which :func:`collate` drops."""

    def __init__(self, source: FileSource | ArraySource, transform, on_bad_file: str = "error"):
        self.source, self.transform, self.on_bad_file = source, transform, on_bad_file

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor] | None:
        try:
            image = self.source.image(index)
        except DECODE_ERRORS + (Image.DecompressionBombError,) as err:
            if self.on_bad_file == "skip":
                log.warning("Skipped unreadable image %s (data.on_bad_file=skip): %s", self.source.name(index), err)
                return None
            raise UserError(f"{self.source.name(index)} cannot be decoded as an image ({type(err).__name__}: "
                            f"{err}). Remove or replace it, or set data.on_bad_file=skip to skip unreadable "
                            "files.") from None
        return {"image": self.transform(image), "label": torch.tensor(int(self.source.labels[index]))}


def collate(samples: list[dict | None]) -> dict[str, torch.Tensor]:
    """Stack samples into ``{"image": (B, 3, S, S), "label": (B,)}``, dropping skipped (``None``) ones."""
    kept = [s for s in samples if s is not None]
    if not kept:
        raise UserError(f"Every image of a batch of {len(samples)} was unreadable (data.on_bad_file=skip): check "
                        "the data set's files (see the warnings above).")
    return {"image": torch.stack([s["image"] for s in kept]), "label": torch.stack([s["label"] for s in kept])}


def check_image(path: Path) -> None:
    """Decode ``path`` cheaply (JPEGs at 1/8 scale through PIL's draft mode); PIL's errors propagate."""
    with Image.open(path) as img:
        if img.format == "JPEG":
            img.draft("RGB", (max(1, img.size[0] // 8), max(1, img.size[1] // 8)))
        img.load()


# ---------------------------------------------------------------------------
# the base data module


class ClassificationDataModule(L.LightningDataModule):
    """Base classification data module (contract in the module docstring).

    Subclasses set ``name``, ``num_classes`` and ``class_names`` in ``__init__`` and implement
    :meth:`_sources`, returning the ``train``, ``val`` and ``test`` sources (``test`` may be the
    ``val`` object itself); :meth:`setup` calls it once.

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
        seed: kept with the hyper-parameters; the randomness comes from the seeded generators.
    """

    name: str = "classification"
    num_classes: int
    class_names: list[str] | None

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
        seed: int = 0,
    ):
        super().__init__()
        self.img_size = int_option("img_size", img_size, 1, 224)
        self.batch_size = int_option("batch_size", batch_size, 1, 128)
        self.eval_batch_size = self.batch_size if eval_batch_size is None else \
            int_option("eval_batch_size", eval_batch_size, 1, 256)
        self.num_workers = int_option("num_workers", num_workers, 0, 8)
        self.seed = int_option("seed", seed, 0, 0)
        unknown = sorted(set(augment or {}) - set(AUGMENT_KEYS))
        if unknown:
            raise UserError(f"data.augment.{unknown[0]} is not an augmentation option; the options are "
                            f"{', '.join(AUGMENT_KEYS)} (timm's create_transform), e.g. data.augment.re_prob=0.25.")
        self.augment = {**DEIT_AUGMENT, **dict(augment or {})}
        self.interpolation = str(interpolation)
        try:
            ok = 0 < float(crop_pct) <= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"data.crop_pct must be in (0, 1], got {crop_pct!r}; e.g. data.crop_pct=0.875 "
                            "(ImageNet) or 1.0 (no border cropped).")
        self.crop_pct = float(crop_pct)
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.on_bad_file = on_bad_file_option(on_bad_file)
        if verify_images not in VERIFY_CHOICES:
            raise UserError(f"data.verify_images must be auto, true or false, got {verify_images!r}.")
        self.verify_images = verify_images
        self.verify_limit = int_option("verify_limit", verify_limit, 0, 20000)
        self.skipped: list[str] = []  # files dropped in setup (on_bad_file=skip)
        self.train_set: ClassificationDataset | None = None
        self.val_set: ClassificationDataset | None = None
        self.test_set: ClassificationDataset | None = None

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
    def setup(self, stage: str | None = None) -> None:
        """Read and check the splits once (later calls do nothing)."""
        if self.train_set is not None:
            return
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

    def _loader(self, split: str) -> DataLoader:
        self.setup()
        dataset = getattr(self, f"{split}_set")
        train = split == "train"
        if train and len(dataset) < self.batch_size:
            raise UserError(f"The {self.name} training split has {len(dataset)} images, fewer than one batch of "
                            f"data.batch_size={self.batch_size}; lower data.batch_size or add images.")
        return (ResumableLoader if train else DataLoader)(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            **(train_sampling(dataset) if train else eval_loading(dataset, f"{self.name} {split} split")),
            drop_last=train,
            collate_fn=collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0 and not train,  # training: new workers seeded per epoch
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented; the last partial batch is dropped."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """Every validation image once, in a fixed order."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Every test image once, in a fixed order."""
        return self._loader("test")

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
            except DECODE_ERRORS + (Image.DecompressionBombError,) as err:
                bad.append((path, f"{type(err).__name__}: {err}"))
        if not bad:
            return samples
        if self.on_bad_file == "error":
            more = f" ({len(bad)} unreadable files in {split}/ in all: {_describe(p for p, _ in bad)})" \
                if len(bad) > 1 else ""
            raise UserError(f"{bad[0][0]} cannot be decoded as an image ({bad[0][1]}){more}. {fix} Or set "
                            "data.on_bad_file=skip to skip unreadable files.")
        self.skipped.extend(str(p) for p, _ in bad)
        log.warning("Skipped %d unreadable image(s) of %s %s (data.on_bad_file=skip): %s", len(bad), self.name,
                    split, _describe(p for p, _ in bad))
        dropped = {p for p, _ in bad}
        return [(p, label) for p, label in samples if p not in dropped]


# ---------------------------------------------------------------------------
# folders: ImageNet and any image folder


def _visible_entries(folder: Path) -> tuple[list[str], list[str]]:
    """Names of the non-hidden sub-folders and regular files directly in ``folder``, each sorted."""
    dirs, files = [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                dirs.append(entry.name)
            elif entry.is_file():
                files.append(entry.name)
    return sorted(dirs), sorted(files)


class FolderClassification(ClassificationDataModule):
    """Images in class folders, one tree per split::

        <root>/train/<class>/<image>     every non-hidden file of a class folder is an image
        <root>/val/<class>/<image>       the same class folders; also the test split

    Class names are the sorted folder names of ``train/``; ``val/`` must have the same
    ones (the differences are named) and no class folder may be empty.

    Args:
        root: the folder holding ``train/`` and ``val/``.
        num_classes: the number of classes the data set must have (ImageNet: 1000), known
            without reading the disk; None = as many as ``train/`` has (read in ``__init__``).
        train_dir, val_dir: the split folders' names under ``root``.
        Others: see :class:`ClassificationDataModule`.
    """

    name = "image folder"
    how_to_get = ("Arrange the images as <root>/train/<class>/<image> and <root>/val/<class>/<image> "
                  "and set data.root to <root>.")

    def __init__(self, root: str, num_classes: int | None = None, train_dir: str = "train", val_dir: str = "val",
                 **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.root = str(root)
        self.train_dir, self.val_dir = str(train_dir), str(val_dir)
        if num_classes is None:
            self.class_names = self._classes(self._split_folder(self.train_dir))
            self.num_classes = len(self.class_names)
            if self.num_classes == 0:
                self._no_classes(self._split_folder(self.train_dir))
        else:
            self.num_classes = int_option("num_classes", num_classes, 1, 1000)
            self.class_names = None  # read in setup

    def _root(self) -> Path:
        root = Path(self.root).expanduser()
        if not root.is_dir():
            state = "is not a folder" if root.exists() else "does not exist"
            raise UserError(f"The {self.name} data set was not found: {root} {state} (data.root). {self.how_to_get}")
        return root

    def _split_folder(self, split: str) -> Path:
        folder = self._root() / split
        if not folder.is_dir():
            present = _visible_entries(self._root())[0]
            raise UserError(f"The {self.name} data set at {self._root()} has no {split}/ folder (it has "
                            f"{_describe(present) if present else 'no folders'}). {self.how_to_get}")
        return folder

    @staticmethod
    def _classes(folder: Path) -> list[str]:
        return _visible_entries(folder)[0]

    def _no_classes(self, folder: Path) -> None:
        files = _visible_entries(folder)[1]
        hint = (f" It holds {len(files)} loose files: sort them into one sub-folder per class"
                f"{self.flat_hint if hasattr(self, 'flat_hint') else ''}.") if files else ""
        raise UserError(f"{folder} has no class folders.{hint} {self.how_to_get}")

    def _sources(self) -> dict[str, FileSource]:
        train_folder, val_folder = self._split_folder(self.train_dir), self._split_folder(self.val_dir)
        classes = {}
        for split, folder in ((self.train_dir, train_folder), (self.val_dir, val_folder)):
            classes[split] = self._classes(folder)
            if not classes[split]:
                self._no_classes(folder)
        train_classes, val_classes = classes[self.train_dir], classes[self.val_dir]
        if train_classes != val_classes:
            only_train = sorted(set(train_classes) - set(val_classes))
            only_val = sorted(set(val_classes) - set(train_classes))
            parts = []
            if only_train:
                parts.append(f"{len(only_train)} class folder(s) of {train_folder} are missing from {val_folder}: "
                             f"{_describe(only_train)}")
            if only_val:
                parts.append(f"{len(only_val)} class folder(s) of {val_folder} are not in {train_folder}: "
                             f"{_describe(only_val)}")
            raise UserError(f"The class folders of train and val differ: {'; '.join(parts)}. Both splits need the "
                            "same classes: add the missing folders or remove the extra ones.")
        if self.class_names is not None and self.class_names != train_classes:
            raise UserError(f"The class folders of {train_folder} changed since the data module was built; "
                            "build it again.")  # pragma: no cover - only when files move during a run
        if len(train_classes) != self.num_classes:
            raise UserError(f"{train_folder} has {len(train_classes)} class folders, but the {self.name} data set has "
                            f"{self.num_classes} (data.num_classes={self.num_classes}). Restore the missing classes, "
                            "or use data=folder_cls for a folder with other classes.")
        self.class_names = train_classes
        fix = f"Remove or replace it under {self._root()}."
        sources = {}
        for split, folder in ((self.train_dir, train_folder), (self.val_dir, val_folder)):
            samples, empty = [], []
            for label, name in enumerate(train_classes):
                files = _visible_entries(folder / name)[1]
                if not files:
                    empty.append(name)
                samples += [(folder / name / f, label) for f in files]
            if empty:
                raise UserError(f"{len(empty)} class folder(s) of {folder} hold no images: {_describe(empty)}. Every "
                                "class needs images in train and val: add some or remove the class from both.")
            samples = self._verify(split, samples, fix)
            used = {label for _, label in samples}
            if len(used) < len(train_classes):
                gone = [n for i, n in enumerate(train_classes) if i not in used]
                raise UserError(f"After skipping unreadable files, {len(gone)} class folder(s) of {folder} hold no "
                                f"readable images: {_describe(gone)}. Replace the files or remove the class.")
            sources[split] = FileSource(folder, samples)
        return {"train": sources[self.train_dir], "val": sources[self.val_dir], "test": sources[self.val_dir]}


class ImageNet(FolderClassification):
    """ImageNet-1k (ILSVRC 2012) in the standard folder layout, 1,000 classes (see :class:`FolderClassification`)::

        <root>/train/n01440764/n01440764_10026.JPEG ...
        <root>/val/n01440764/ILSVRC2012_val_00000293.JPEG ...

    ``num_classes`` is 1000 without reading the disk.
    """

    name = "ImageNet"
    how_to_get = ("Download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from image-net.org, unpack train/ "
                  "(one tar per class) and sort val/ into one folder per class (the devkit's labels, e.g. "
                  "valprep.sh), then set data.root to the folder holding train/ and val/.")
    flat_hint = (" (ImageNet's validation archive unpacks flat: sort it into val/<wnid>/ with the devkit's "
                 "labels, e.g. valprep.sh)")

    def __init__(self, root: str, num_classes: int | None = 1000, **kwargs):
        super().__init__(root, num_classes=num_classes, **kwargs)


# ---------------------------------------------------------------------------
# CIFAR-10 and CIFAR-100, python releases


def _split_off(images: np.ndarray, labels: np.ndarray, val_size: int, name: str):
    """(train, val) ArraySources holding ``val_size`` training images out (a fixed permutation, seed 0)."""
    order = np.random.RandomState(0).permutation(len(images))
    val, train = order[:val_size], np.sort(order[val_size:])
    return (ArraySource(images[train], labels[train], f"{name} train"),
            ArraySource(images[np.sort(val)], labels[np.sort(val)], f"{name} held-out val"))


def _planes_to_hwc(data: np.ndarray) -> np.ndarray:
    """CIFAR rows (n, 3072: R, G, B planes of 32x32) -> uint8 (n, 32, 32, 3)."""
    return np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


class _CIFARBase(ClassificationDataModule):
    def __init__(self, root: str, download: bool = False, url: str = "", md5: str | None = None, val_size: int = 0,
                 **kwargs):
        kwargs.setdefault("img_size", 32)
        super().__init__(**kwargs)
        self.root = str(root)
        self.download = bool(download)
        self.url, self.md5 = url, md5
        self.val_size = int_option("val_size", val_size, 0, 5000)

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _files(self) -> Path:
        raise NotImplementedError

    def _read(self, folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Train images, train labels, test images, test labels."""
        raise NotImplementedError

    def _sources(self) -> dict[str, ArraySource]:
        folder = ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)
        train_x, train_y, test_x, test_y = self._read(folder)
        test = ArraySource(test_x, test_y, f"{self.name} test")
        if self.val_size:
            if self.val_size >= len(train_x):
                raise UserError(f"data.val_size={self.val_size} holds out all {len(train_x)} training images; use "
                                "fewer (e.g. data.val_size=5000), or 0 to validate on the test batch.")
            train, val = _split_off(train_x, train_y, self.val_size, self.name)
            return {"train": train, "val": val, "test": test}
        return {"train": ArraySource(train_x, train_y, f"{self.name} train"), "val": test, "test": test}


class CIFAR10Classification(_CIFARBase):
    """CIFAR-10, python release: ``<root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``
    (``root`` may be that folder itself); read with the safe unpickler of :mod:`datamodules.images`.

    Args:
        root, download, url, md5: as the GAN's ``datamodules.CIFAR10`` (``data.download=true`` fetches it).
        val_size: training images held out for validation (a fixed choice); 0 = validate on the test batch.
        Others: see :class:`ClassificationDataModule` (``img_size`` defaults to 32).
    """

    name = "CIFAR-10"

    def __init__(self, root: str, download: bool = False, url: str = CIFAR10_URL, md5: str | None = CIFAR10_MD5,
                 val_size: int = 0, **kwargs):
        super().__init__(root, download, url, md5, val_size, **kwargs)
        self.save_hyperparameters()
        self.num_classes = len(CIFAR10_CLASSES)
        self.class_names = list(CIFAR10_CLASSES)

    def _files(self) -> Path:
        root = Path(self.root).expanduser()
        folder = root if any((root / n).is_file() for n in CIFAR10_FILES) else root / CIFAR10_FOLDER
        missing = [n for n in CIFAR10_FILES if not (folder / n).is_file()]
        if missing:
            state = f"lacks {', '.join(missing)}" if folder.is_dir() else "does not exist"
            raise UserError(f"CIFAR-10 not found: {folder} {state}. Expected {CIFAR10_FOLDER}/ with data_batch_1 ... "
                            f"data_batch_5, test_batch and batches.meta under data.root={self.root}. Set "
                            f"data.download=true to fetch it ({self.url}), unpack cifar-10-python.tar.gz there by "
                            "hand, or run offline with data=tiny.")
        return folder

    def _read(self, folder: Path):
        def bad(entry: str, message: str):  # a label outside 0..9: the release is damaged, always fatal here
            raise UserError(message)

        self.class_names = _read_cifar_meta(folder / "batches.meta")
        parts = [_read_cifar_batch(folder / n, bad) for n in CIFAR10_TRAIN_FILES]
        test_data, test_labels = _read_cifar_batch(folder / "test_batch", bad)
        return (_planes_to_hwc(np.concatenate([d for d, _ in parts])), np.concatenate([lab for _, lab in parts]),
                _planes_to_hwc(test_data), test_labels)


CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = ["train", "test", "meta"]
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"


def _cifar100_fix(path: Path) -> str:
    return f"Delete {path.parent} and use data.download=true, or unpack the official cifar-100-python.tar.gz there."


def _unpickle_cifar100(path: Path):
    """The object pickled in ``path`` (numpy arrays and builtins only); UserError naming it otherwise."""
    try:
        with open(path, "rb") as f:
            return _ArrayUnpickler(f, path).load()
    except UserError:
        raise UserError(f"{path} is not a CIFAR-100 file: its pickle refers to objects other than numpy arrays "
                        f"(refused, nothing was run). {_cifar100_fix(path)}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, OSError) as err:  # fmt: skip
        raise UserError(f"{path} cannot be read as a CIFAR-100 pickle, it is truncated or corrupt ({err}). "
                        f"{_cifar100_fix(path)}") from None


def read_cifar100_split(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (n, 32, 32, 3) and fine labels int64 (n,) of ``train`` or ``test``, validated."""
    fix = _cifar100_fix(path)
    split = _unpickle_cifar100(path)
    if not isinstance(split, dict) or b"data" not in split or b"fine_labels" not in split:
        keys = list(split) if isinstance(split, dict) else type(split).__name__
        raise UserError(f"{path} is not a CIFAR-100 split: expected a dict with b'data' and b'fine_labels', got "
                        f"{keys}. {fix}")
    data = split[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise UserError(f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {got}. {fix}")
    try:
        labels = np.asarray(split[b"fine_labels"], dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise UserError(f"{path}: b'fine_labels' must be a list of integers. {fix}") from None
    if len(labels) != len(data):
        raise UserError(f"{path} has {len(data)} images but {len(labels)} labels. {fix}")
    bad = np.flatnonzero((labels < 0) | (labels >= 100))
    if len(bad):
        raise UserError(f"{path}: image {bad[0]} has label {labels[bad[0]]}, expected 0..99. {fix}")
    return _planes_to_hwc(data), labels


def read_cifar100_meta(path: Path) -> list[str]:
    meta = _unpickle_cifar100(path)
    names = meta.get(b"fine_label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != 100 or not all(isinstance(n, (bytes, str)) for n in names):
        raise UserError(f"{path} must hold b'fine_label_names', a list of 100 names. {_cifar100_fix(path)}")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names]


class CIFAR100(_CIFARBase):
    """CIFAR-100, python release: ``<root>/cifar-100-python/{train, test, meta}`` (``root`` may be that
    folder itself), pickled dicts with ``b"data"`` (n, 3072) uint8 and ``b"fine_labels"``; the 100 fine
    classes, named by ``meta``'s ``b"fine_label_names"``.

    Args:
        root, download (fetches ``url``, md5-checked), url, md5, val_size: as :class:`CIFAR10Classification`.
        Others: see :class:`ClassificationDataModule` (``img_size`` defaults to 32).
    """

    name = "CIFAR-100"

    def __init__(self, root: str, download: bool = False, url: str = CIFAR100_URL, md5: str | None = CIFAR100_MD5,
                 val_size: int = 0, **kwargs):
        super().__init__(root, download, url, md5, val_size, **kwargs)
        self.save_hyperparameters()
        self.num_classes = 100
        self.class_names = None  # read from meta in setup

    def _files(self) -> Path:
        root = Path(self.root).expanduser()
        folder = root if any((root / n).is_file() for n in CIFAR100_FILES) else root / CIFAR100_FOLDER
        missing = [n for n in CIFAR100_FILES if not (folder / n).is_file()]
        if missing:
            state = f"lacks {', '.join(missing)}" if folder.is_dir() else "does not exist"
            raise UserError(f"CIFAR-100 not found: {folder} {state}. Expected {CIFAR100_FOLDER}/ with train, test "
                            f"and meta under data.root={self.root}. Set data.download=true to fetch it ({self.url}), "
                            "unpack cifar-100-python.tar.gz there by hand, or run offline with data=tiny.")
        return folder

    def _read(self, folder: Path):
        self.class_names = read_cifar100_meta(folder / "meta")
        return (*read_cifar100_split(folder / "train"), *read_cifar100_split(folder / "test"))


# ---------------------------------------------------------------------------
# tiny: scikit-learn's digits

TINY_AUGMENT = {"scale": (0.6, 1.0), "ratio": (0.8, 1.25), "hflip": None, "color_jitter": None,
                "auto_augment": None, "re_prob": None}


class TinyDigits(ClassificationDataModule):
    """scikit-learn's 1,797 handwritten digits as 32x32 RGB images (bilinear upscale of the 8x8
    originals, as the GAN's ``digits``), 10 classes; a fixed split (seed 0) of ``val_size`` and
    ``test_size`` images, the rest (1,297 by default) for training. Offline.

    Args:
        val_size, test_size: held-out images.
        Others: see :class:`ClassificationDataModule`; the config sets light augmentation
            (random-resized crops of 60-100 % of the area, no flips, no RandAugment, no erasing).
    """

    name = "tiny digits"

    def __init__(self, val_size: int = 250, test_size: int = 250, **kwargs):
        kwargs.setdefault("img_size", 32)
        kwargs.setdefault("augment", TINY_AUGMENT)
        kwargs.setdefault("num_workers", 0)
        kwargs.setdefault("crop_pct", 1.0)
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.val_size = int_option("val_size", val_size, 1, 250)
        self.test_size = int_option("test_size", test_size, 1, 250)
        if self.val_size + self.test_size >= 1797:
            raise UserError(f"data.val_size + data.test_size = {self.val_size + self.test_size} leaves no training "
                            "digits of the 1,797; use smaller values (e.g. 250 each).")
        self.num_classes = 10
        self.class_names = [str(d) for d in range(10)]

    def _sources(self) -> dict[str, ArraySource]:
        from datamodules.images import Digits

        digits = Digits(resolution=32, flip=False)
        digits.setup()
        images = digits.train_images.permute(0, 2, 3, 1).contiguous().numpy()  # (N, 32, 32, 3) uint8
        labels = digits.train_labels.numpy()
        order = np.random.RandomState(0).permutation(len(images))
        val, test = np.sort(order[:self.val_size]), np.sort(order[self.val_size:self.val_size + self.test_size])
        train = np.sort(order[self.val_size + self.test_size:])
        return {split: ArraySource(images[idx], labels[idx], f"digits {split}")
                for split, idx in (("train", train), ("val", val), ("test", test))}
