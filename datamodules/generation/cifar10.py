"""``data=cifar10``: CIFAR-10's python release for a GAN; the five data batches are the training split."""

from __future__ import annotations

from pathlib import Path

import torch

from attention.errors import UserError
from datamodules.base import DataError
from datamodules.formats import cifar
from datamodules.generation.base import ImageDataModule, resize_uint8


class CIFAR10(ImageDataModule):
    """CIFAR-10, python release; the five data batches (50,000 images) are the train split.

    ``root`` is the folder that contains ``cifar-10-batches-py/`` or that folder itself::

        <root>/cifar-10-batches-py/
            data_batch_1 ... data_batch_5, test_batch   pickled {b"data": uint8 (n, 3072),
                                                         b"labels": [int in 0..9] * n}
            batches.meta                                 pickled {b"label_names": [10 bytes]}

    read by :mod:`datamodules.formats.cifar`. Other resolutions are resized bilinearly with
    antialias. ``num_classes`` is 10 and ``class_names`` the standard names right away;
    :meth:`setup` takes the names from ``batches.meta``.

    Args:
        root: see above.
        download: fetch ``url`` (md5-checked, safely extracted into ``root``) when the
            release is incomplete; in :meth:`prepare_data` (and in :meth:`setup` if
            that was skipped).
        url, md5: the archive and its md5 (None: only check it is a valid archive).
        on_bad_file: ``"error"``, or ``"skip"``: an unreadable or malformed batch file is
            dropped whole, an image with a label outside 0..9 alone; a bad ``batches.meta``
            gives the standard class names.
        Others: see :class:`ImageDataModule`.
    """

    name = "cifar10"
    num_classes = cifar.CIFAR10.num_classes

    def __init__(self, root: str, download: bool = False, url: str = cifar.CIFAR10.url,
                 md5: str | None = cifar.CIFAR10.md5, **options):  # fmt: skip
        super().__init__(**options)
        self.root = root
        self.download = bool(download)
        self.url = url
        self.md5 = md5
        self.class_names = list(cifar.CIFAR10_CLASSES)

    def _folder(self) -> Path:
        """The release folder; UserError listing the expected layout if a file is missing (the download is
        :meth:`prepare_data`'s, which Lightning runs on one process per node only)."""
        return cifar.CIFAR10.locate(self.root, self.url, "digits", self.download)

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        cifar.CIFAR10.fetch(self.root, self.download, self.url, self.md5, offline="digits")

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        folder = self._folder()
        try:
            self.class_names = cifar.read_names(folder / cifar.CIFAR10.meta_file, cifar.CIFAR10)
        except DataError as err:
            self.bad.file(err)
            self.class_names = list(cifar.CIFAR10_CLASSES)
        data, labels = cifar.read_split(folder, cifar.CIFAR10, cifar.CIFAR10.train_files, self.bad.file)
        if len(data) == 0:
            why = f"all {len(self.skipped)} bad file(s) or image(s) were skipped" if self.skipped else "they are empty"
            raise UserError(f"CIFAR-10 under {folder} has no usable training image: {why}. "
                            f"{cifar.CIFAR10.fix(folder / 'x')}")  # fmt: skip
        images = torch.from_numpy(data).view(-1, *cifar.IMAGE_SHAPE)  # (N, 3072) -> (N, 3, 32, 32)
        return resize_uint8(images, self.resolution, antialias=True), torch.from_numpy(labels)
