"""``data=folder_cls``: images in class folders, one tree per split (ImageNet's layout, any classes)."""

from __future__ import annotations

import os
from pathlib import Path

from attention.errors import UserError
from datamodules.base import describe, int_option
from datamodules.classification.base import ClassificationDataModule, FileSource, names
from datamodules.formats.image_folder import image_tree, loose_images, visible_entries


class FolderClassification(ClassificationDataModule):
    """Images in class folders, one tree per split::

        <root>/train/<class>/<image>     <image> may be in sub-folders of <class> too
        <root>/val/<class>/<image>       the same class folders; also the test split

    Class names are the sorted folder names of ``train/``; ``val/`` must have the same
    ones (the differences are named) and no class folder may be empty. A class's images are
    the files of its folder and its sub-folders named as images, as torchvision's
    ``ImageFolder`` lists them (:func:`~datamodules.formats.image_folder.image_tree`); other
    files and hidden ones are ignored. Image files beside the class folders of a split (an
    unfinished sort of ImageNet's flat val/) are refused; a dangling symbolic link is a bad
    file (``on_bad_file``: an error naming it, or skipped and counted).

    Args:
        root: the folder holding ``train/`` and ``val/``.
        num_classes: the number of classes the data set must have (ImageNet: 1000), known
            without reading the disk; None = as many as ``train/`` has (read in ``__init__``).
        train_dir, val_dir: the split folders' names under ``root``.
        Others: see :class:`ClassificationDataModule`.
    """

    test_split_is_val = True  # no public test labels: "test" is the validation split
    root_is_the_data = True  # any tree of class folders: its folder tells runs on two data sets apart

    name = "image folder"
    how_to_get = ("Arrange the images as <root>/train/<class>/<image> and <root>/val/<class>/<image> "
                  "and set data.root to <root>.")
    flat_hint = ""  # what to do with a split folder of loose files, after "sort them into one sub-folder per class"

    def __init__(self, root: str, num_classes: int | None = None, train_dir: str = "train", val_dir: str = "val",
                 **options):  # fmt: skip
        super().__init__(**options)
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
            present = visible_entries(self._root())[0]
            raise UserError(f"The {self.name} data set at {self._root()} has no {split}/ folder (it has "
                            f"{names(present) if present else 'no folders'}). {self.how_to_get}")
        return folder

    @staticmethod
    def _classes(folder: Path) -> list[str]:
        return visible_entries(folder)[0]

    def _no_classes(self, folder: Path) -> None:
        files = visible_entries(folder)[1]
        hint = (f" It holds {len(files)} loose files: sort them into one sub-folder per class"
                f"{self.flat_hint}.") if files else ""
        raise UserError(f"{folder} has no class folders.{hint} {self.how_to_get}")

    def _check_classes(self, train_folder: Path, val_folder: Path) -> list[str]:
        """The class names, the same in both splits and as many as ``num_classes``; UserError naming the
        differences otherwise."""
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
                             f"{names(only_train)}")
            if only_val:
                parts.append(f"{len(only_val)} class folder(s) of {val_folder} are not in {train_folder}: "
                             f"{names(only_val)}")
            raise UserError(f"The class folders of train and val differ: {'; '.join(parts)}. Both splits need the "
                            "same classes: add the missing folders or remove the extra ones.")
        if self.class_names is not None and self.class_names != train_classes:
            raise UserError(f"The class folders of {train_folder} changed since the data module was built; "
                            "build it again.")  # pragma: no cover - only when files move during a run
        if len(train_classes) != self.num_classes:
            raise UserError(f"{train_folder} has {len(train_classes)} class folders, but the {self.name} data set has "
                            f"{self.num_classes} (data.num_classes={self.num_classes}). Restore the missing classes, "
                            "or use data=folder_cls for a folder with other classes.")
        return train_classes

    def _sources(self) -> dict[str, FileSource]:
        train_folder, val_folder = self._split_folder(self.train_dir), self._split_folder(self.val_dir)
        self.class_names = self._check_classes(train_folder, val_folder)
        fix = f"Remove or replace it under {self._root()}."
        sources = {}
        for split, folder in ((self.train_dir, train_folder), (self.val_dir, val_folder)):
            self._refuse_loose(split, folder)
            samples, empty, dangling = [], [], []
            for label, name in enumerate(self.class_names):
                files, broken = image_tree(folder / name)
                if not files and not broken:
                    empty.append(name)
                samples += [(f, label) for f in files]
                dangling += broken
            if empty:
                raise UserError(f"{len(empty)} class folder(s) of {folder} hold no images: {names(empty)} (images "
                                "are files named .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff or .webp, as for "
                                "torchvision's ImageFolder). Every class needs images in train and val: add some or "
                                "remove the class from both.")
            # Known without decoding anything, so named here even where the images are not checked (ImageNet).
            self.bad.problems([(p, f"a symbolic link to {os.readlink(p)}, which does not exist") for p in dangling],
                              "Point the link at its image again, or remove it.")  # fmt: skip
            self.bad.warn(f"{self.name} {split}", "dangling symbolic link(s)")
            samples = self._verify(split, samples, fix)
            used = {label for _, label in samples}
            if len(used) < len(self.class_names):
                gone = [n for i, n in enumerate(self.class_names) if i not in used]
                raise UserError(f"After skipping unreadable files, {len(gone)} class folder(s) of {folder} hold no "
                                f"readable images: {names(gone)}. Replace the files or remove the class.")
            sources[split] = FileSource(folder, samples)
        return {"train": sources[self.train_dir], "val": sources[self.val_dir], "test": sources[self.val_dir]}

    def _refuse_loose(self, split: str, folder: Path) -> None:
        """UserError when image files lie directly in the split folder, beside its class folders: they belong to
        no class, and were left out of the split without a word (an interrupted valprep.sh leaves most of
        ImageNet's val/ so)."""
        loose = loose_images(folder)
        if loose:
            raise UserError(f"{folder} holds {len(loose)} image file(s) beside its class folders, in no class: "
                            f"{describe(loose)}. They would be left out of the {split} split. "
                            f"Move each into its class folder{self.flat_hint}, or delete them.")
