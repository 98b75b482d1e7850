"""``data=image_folder``: any folder of images for a GAN, optionally one sub-folder per class."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from attention.errors import UserError
from datamodules.base import DECODE_ERRORS, DataError
from datamodules.formats.image_folder import file_tree, open_rgb, square_crop, visible_entries, visible_files
from datamodules.generation.base import ImageDataModule

log = logging.getLogger(__name__)

PROGRESS_THRESHOLD = 500  # show a progress bar when loading more files than this


class ImageFolder(ImageDataModule):
    """Every image of a folder, optionally one sub-folder per class::

        <root>/<class>/<any name>     sub-folders (sorted names) are the classes; files
        <root>/<class>/<sub>/.../<any name>   directly in <root> are then ignored (with a warning)
        <root>/<any name>             no sub-folders with files: one class, named after <root>

    Every non-hidden regular file is a candidate, decoded with PIL (RGB, EXIF orientation
    applied). Class folders are searched recursively, as torchvision's ``ImageFolder`` and the
    classification folders (:mod:`datamodules.classification.folder`) do: a class whose images
    sit in sub-folders is a class, not dropped; a sub-folder with no file at any depth is not a
    class (named in a warning). Images may have any size: the
    shorter side is resized to R (bicubic, antialiased) and the centre R x R is kept. Files
    that cannot be decoded raise a UserError, or with ``on_bad_file="skip"`` are skipped
    and reported in one warning. Classes and files are listed in ``__init__``; the
    images are decoded in :meth:`setup`.

    Args:
        root: the folder.
        Others: see :class:`ImageDataModule`.
    """

    name = "image_folder"
    root_is_the_data = True  # any folder of images: its name tells runs on two image sets apart (mode=report)

    def __init__(self, root: str, **options):
        super().__init__(**options)
        self.root = root
        self.files, self.class_names = self._scan()
        self.num_classes = len(self.class_names)

    def _scan(self) -> tuple[list[tuple[Path, int]], list[str]]:
        """(file, label) candidates and the class names; UserError if there are none."""
        root = Path(self.root).expanduser()
        if not root.is_dir():
            state = "is not a folder" if root.exists() else "does not exist"
            raise UserError(
                f"Image folder {root} {state}. Set data.root=/path/to/folder, a folder of images or of "
                f"one sub-folder of images per class."
            )
        subfolders, _ = visible_entries(root)
        trees = {name: file_tree(root / name) for name in subfolders}
        classes = [(name, files) for name, files in trees.items() if files]
        loose = visible_files(root)
        empty = [name for name, files in trees.items() if not files]
        if classes and empty:  # an empty folder is no class: said, as a class that lost its files would be
            log.warning("%s: ignoring %d sub-folder(s) that hold no files, so are not classes: %s%s.", root,
                        len(empty), ", ".join(empty[:5]), ", ..." if len(empty) > 5 else "")
        if classes:
            if loose:
                log.warning(
                    "%s has class sub-folders; ignoring the %d file(s) directly in it (%s%s).", root, len(loose),
                    ", ".join(p.name for p in loose[:5]), ", ..." if len(loose) > 5 else "",
                )
            files = [(path, label) for label, (_, paths) in enumerate(classes) for path in paths]
            return files, [name for name, _ in classes]
        if not loose:
            raise UserError(
                f"Image folder {root} holds no files (hidden files are ignored). Put images in it, or one "
                f"sub-folder of images per class, and set data.root to it."
            )
        return [(path, 0) for path in loose], [root.resolve().name or "images"]

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        from tqdm.auto import tqdm

        images, labels, bad = [], [], []
        files = tqdm(self.files, desc=f"Loading {self.root}", unit="img", disable=len(self.files) <= PROGRESS_THRESHOLD)
        for path, label in files:
            try:
                image = square_crop(open_rgb(path, upright=True), self.resolution)
            except DECODE_ERRORS as err:
                why = f"cannot be decoded as an image ({type(err).__name__}: {err})"
                self.bad.file(DataError(f"{path} {why}. Remove or replace it.", f"{path}: {why}"))
                bad.append(path)
                continue
            images.append(image)
            labels.append(label)
        used = set(labels)
        empty = [name for label, name in enumerate(self.class_names) if label not in used]
        if images and empty:
            log.warning("Class folder(s) with no usable image in %s: %s.", self.root, ", ".join(empty))
        if not images:
            raise UserError(
                f"Image folder {self.root} has no usable images: all {len(bad)} file(s) failed to decode. "
                f"Point data.root at a folder of images (PNG, JPEG, ...)."
            )
        return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)
