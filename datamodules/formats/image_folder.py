"""Folders of image files: listing them and decoding them, for every module that reads such folders.

The GAN's ``image_folder`` (``<root>/<class>/<image>`` or ``<root>/<image>``) and the classification
folders (``<root>/<split>/<class>/<image>``, ImageNet's layout) list entries and decode images here.
For the GAN every non-hidden regular file is a candidate image (:func:`visible_entries`, and :func:`file_tree`
in class folders, sub-folders searched); the classification folders list theirs as torchvision's ``ImageFolder``
does, the reference of the published recipes (:func:`image_tree`: image extensions, sub-folders searched). Hidden
names (``.DS_Store``) are ignored everywhere. PIL's errors for files that are not images are
:data:`~datamodules.base.DECODE_ERRORS`; images of more than 8 bits a channel are refused
(:class:`HighBitDepthImage`, one of them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def visible_entries(folder: Path) -> tuple[list[str], list[str]]:
    """Names of the non-hidden sub-folders and regular files directly in ``folder``, each sorted; a dangling
    symbolic link counts as a file (opening it fails, and the caller names it as a bad file, not dropping it)."""
    dirs, files = [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                dirs.append(entry.name)
            elif entry.is_file() or (entry.is_symlink() and not os.path.exists(entry.path)):
                files.append(entry.name)
    return sorted(dirs), sorted(files)


def visible_files(folder: Path) -> list[Path]:
    """The non-hidden regular files directly in ``folder``, sorted by name."""
    return [folder / name for name in visible_entries(folder)[1]]


def is_image_name(name: str) -> bool:
    """Whether ``name`` is an image's by torchvision ``ImageFolder``'s rule: it ends in one of its
    ``IMG_EXTENSIONS`` (.jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp), in any case."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension  # slow: imported here

    return has_file_allowed_extension(name, IMG_EXTENSIONS)


def loose_images(folder: Path) -> list[str]:
    """Names of the non-hidden image files (:func:`is_image_name`; dangling links too) directly in ``folder``,
    sorted."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries
                      if not e.name.startswith(".") and not e.is_dir() and is_image_name(e.name))  # fmt: skip


def _tree(folder: Path, keep: Callable[[os.DirEntry, bool], bool]) -> list[tuple[Path, bool]]:
    """The files under ``folder`` that ``keep(entry, dangling)`` accepts, each with whether it is a dangling symbolic
    link, at any depth (linked folders followed), in torchvision ``ImageFolder``'s order (folders by path, then files
    by name); hidden files and folders are left out."""
    found = []  # (folder, [(name, dangling)])
    pending = [(str(folder), frozenset())]  # (folder, real paths of it and the folders above it)
    while pending:
        top, above = pending.pop()
        here = above | {os.path.realpath(top)}
        files = []
        with os.scandir(top) as entries:  # entry types come from the listing: only links cost a stat
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    # A link back to a folder above would repeat the tree until the path grew too long.
                    if os.path.realpath(entry.path) not in here:
                        pending.append((entry.path, here))
                    continue
                dangling = entry.is_symlink() and not os.path.exists(entry.path)
                if keep(entry, dangling):
                    files.append((entry.name, dangling))
        found.append((top, sorted(files)))
    return [(Path(top) / name, gone) for top, files in sorted(found) for name, gone in files]


def image_tree(folder: Path) -> tuple[list[Path], list[Path]]:
    """The image files under ``folder`` as torchvision's ``ImageFolder`` lists a class folder: every file of it
    and of its sub-folders, at any depth (linked folders followed), whose name passes :func:`is_image_name`,
    in its order (folders by path, then files by name). Returned apart: the dangling symbolic links among them
    (their target is gone), for the caller to name or skip. Hidden files and folders are left out."""
    found = _tree(folder, lambda entry, _: is_image_name(entry.name))
    return [p for p, gone in found if not gone], [p for p, gone in found if gone]


def file_tree(folder: Path) -> list[Path]:
    """Every non-hidden regular file under ``folder``, at any depth, in :func:`image_tree`'s order; a dangling
    symbolic link counts as a file (opening it fails and the caller names it, as for :func:`visible_entries`).
    The GAN's class folders, which take any file as a candidate image, are listed so."""
    return [p for p, _ in _tree(folder, lambda entry, dangling: dangling or entry.is_file())]


class HighBitDepthImage(ValueError):
    """An image of more than 8 bits a channel (PIL modes ``I;16*``, ``I``, ``F``): ``convert("RGB")`` clips it
    (16-bit values to white, floats in 0..1 to black), and the range its values use (10, 12 or 16 bits; floats in
    0..1 or 0..255) is not in the file, so no conversion is right for every file. A ValueError, as PIL's decoding
    errors are (:data:`~datamodules.base.DECODE_ERRORS`): callers name the file, and ``data.on_bad_file`` applies."""


def refuse_high_bit_depth(img: Image.Image) -> None:
    """:class:`HighBitDepthImage` when ``img`` has more than 8 bits a channel; from the header, nothing decoded."""
    mode = img.mode
    if mode in ("I", "F") or mode.startswith("I;"):  # 8-bit modes (L, P, RGB, ...) pass two string tests
        kind = "32-bit floating-point" if mode == "F" else "16-bit" if mode.startswith("I;16") else "32-bit integer"
        raise HighBitDepthImage(
            f"a {kind} greyscale image (PIL mode {mode}); only 8-bit images are read, since converting it to 8-bit "
            f"RGB clips it to white or black and the range of its values is not recorded in the file: convert it "
            f"to an 8-bit image (RGB or greyscale) first, scaling its values to 0..255"
        )


def open_rgb(path: Path, upright: bool = False) -> Image.Image:
    """The image at ``path`` in RGB; PIL's errors and :class:`HighBitDepthImage` propagate (callers name the file).

    ``upright`` applies the camera's EXIF orientation tag. Classification leaves it off, as torchvision's
    and timm's folder datasets (and so the published ImageNet recipes) do."""
    with Image.open(path) as img:
        refuse_high_bit_depth(img)
        if upright:
            img = ImageOps.exif_transpose(img)
        return img.convert("RGB")


def check_image(path: Path) -> None:
    """Decode ``path`` cheaply (JPEGs at 1/8 scale through PIL's draft mode); PIL's errors and
    :class:`HighBitDepthImage` propagate."""
    with Image.open(path) as img:
        refuse_high_bit_depth(img)
        if img.format == "JPEG":
            img.draft("RGB", (max(1, img.size[0] // 8), max(1, img.size[1] // 8)))
        img.load()


def square_crop(img: Image.Image, resolution: int) -> np.ndarray:
    """Shorter side resized to ``resolution`` (bicubic, antialiased), centre square kept: uint8 (3, R, R)."""
    w, h = img.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    if size != (w, h):
        img = img.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    img = img.crop((left, top, left + resolution, top + resolution))
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)  # (R, R, 3) -> (3, R, R)
