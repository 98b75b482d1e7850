"""The CIFAR python releases for classification: in memory, the test file as validation and test split.

:class:`CIFARClassification` is the base of ``cifar10_cls`` and ``cifar100``; a release is read by
:mod:`datamodules.formats.cifar`, and a data set only names its :class:`~datamodules.formats.cifar.Release`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import DataError, int_option
from datamodules.classification.base import ArraySource, ClassificationDataModule
from datamodules.formats import cifar

OFFICIAL = "official"  # md5: the release's own


def _fatal(err: DataError) -> None:
    """A damaged release file stops classification whatever ``on_bad_file`` says (it is about image files)."""
    raise err


def _split_off(images: np.ndarray, labels: np.ndarray, val_size: int, name: str):
    """(train, val) ArraySources holding ``val_size`` training images out (a fixed permutation, seed 0)."""
    order = np.random.RandomState(0).permutation(len(images))
    val, train = np.sort(order[:val_size]), np.sort(order[val_size:])
    return (ArraySource(images[train], labels[train], f"{name} train"),
            ArraySource(images[val], labels[val], f"{name} held-out val"))


class CIFARClassification(ClassificationDataModule):
    """A CIFAR python release (``release``): ``<root>/<release folder>/`` (``root`` may be that folder
    itself), read with the safe unpickler of :mod:`datamodules.formats.cifar`.

    Args:
        root: see above.
        download: fetch ``url`` (md5-checked, safely extracted into ``root``) when the release is incomplete.
        url: the archive; None = the official one.
        md5: the archive's md5; "official" = the official archive's, None = only check it is a valid archive.
        val_size: training images held out for validation (a fixed choice); 0 = validate on the test split.
        Others: see :class:`ClassificationDataModule` (``img_size`` defaults to 32).
    """

    release: cifar.Release

    def __init__(self, root: str, download: bool = False, url: str | None = None, md5: str | None = OFFICIAL,
                 val_size: int = 0, img_size: int = 32, **options):  # fmt: skip
        super().__init__(img_size=img_size, **options)
        self.root = str(root)
        self.download = bool(download)
        self.url = self.release.url if url is None else url
        self.md5 = self.release.md5 if md5 == OFFICIAL else md5
        self.val_size = int_option("val_size", val_size, 0, 5000)
        self.num_classes = self.release.num_classes
        self.class_names = list(self.release.default_names) or None  # else read from the meta file in setup

    def _folder(self) -> Path:
        """The release folder; UserError listing the expected layout if a file is missing (the download is
        :meth:`prepare_data`'s, which Lightning runs on one process per node only)."""
        return self.release.locate(self.root, self.url, "tiny", self.download)

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        self.release.fetch(self.root, self.download, self.url, self.md5, offline="tiny")

    def _sources(self) -> dict[str, ArraySource]:
        release = self.release
        folder = self._folder()
        self.class_names = cifar.read_names(folder / release.meta_file, release)
        train_x, train_y = cifar.read_split(folder, release, release.train_files, _fatal)
        test_x, test_y = cifar.read_split(folder, release, (release.test_file,), _fatal)
        train_x, test_x = cifar.planes_to_hwc(train_x), cifar.planes_to_hwc(test_x)  # (n, 32, 32, 3)
        test = ArraySource(test_x, test_y, f"{self.name} test")
        if self.val_size:
            if self.val_size >= len(train_x):
                raise UserError(f"data.val_size={self.val_size} holds out all {len(train_x)} training images; use "
                                "fewer (e.g. data.val_size=5000), or 0 to validate on the test batch.")
            train, val = _split_off(train_x, train_y, self.val_size, self.name)
            return {"train": train, "val": val, "test": test}
        return {"train": ArraySource(train_x, train_y, f"{self.name} train"), "val": test, "test": test}
