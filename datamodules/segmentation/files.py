"""Reading the official files: images and index masks decoded with PIL (with the checks that name a bad
file), their headers, and the folder look-ups every layout uses."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from attention.errors import UserError
from datamodules.base import DECODE_ERRORS
from datamodules.formats.image_folder import refuse_high_bit_depth

MASK_MODES = ("P", "L")  # single-channel 8-bit index images (palette PNGs decode to their indices)


def read_image(path: Path, fix: str) -> np.ndarray:
    """RGB uint8 (H, W, 3) of ``path``; UserError naming it if PIL cannot decode it, or if it has more than 8 bits
    a channel (:class:`~datamodules.formats.image_folder.HighBitDepthImage`).

    No EXIF rotation: the masks are aligned with the stored pixels."""
    try:
        with Image.open(path) as img:
            refuse_high_bit_depth(img)
            return np.array(img.convert("RGB"), dtype=np.uint8)  # writable (asarray is read-only)
    except DECODE_ERRORS as err:
        raise UserError(f"{path} cannot be decoded as an image ({type(err).__name__}: {err}). {fix}") from None


def read_index_mask(path: Path, fix: str) -> np.ndarray:
    """Raw values uint8 (H, W) of a single-channel mask: a palette PNG gives its indices (not its
    colours), a grey PNG its values. UserError naming ``path`` otherwise."""
    try:
        with Image.open(path) as img:
            if img.mode not in MASK_MODES:
                raise UserError(
                    f"{path} is a {img.mode} image; a mask must be a single-channel 8-bit image (palette or "
                    f"grey PNG) of class indices, not colours. {fix}"
                )
            return np.array(img, dtype=np.uint8)
    except DECODE_ERRORS as err:
        raise UserError(f"{path} cannot be decoded as a mask ({type(err).__name__}: {err}). {fix}") from None


def header_problem(image: Path, mask: Path) -> tuple[Path, str] | None:
    """``(file, what is wrong)`` when the headers of an image / mask pair show a problem, else None:
    a file PIL cannot identify, an image of more than 8 bits a channel, a mask that is not single-channel 8-bit,
    sizes that differ. Reads the headers only; truncated pixel data is found when the sample is decoded."""
    try:
        with Image.open(image) as img:
            size = img.size
            refuse_high_bit_depth(img)
    except DECODE_ERRORS as err:
        return image, f"cannot be opened as an image ({type(err).__name__}: {err})"
    try:
        with Image.open(mask) as img:
            mode, mask_size = img.mode, img.size
    except DECODE_ERRORS as err:
        return mask, f"cannot be opened as a mask ({type(err).__name__}: {err})"
    if mode not in MASK_MODES:
        return mask, (f"is a {mode} image; a mask must be a single-channel 8-bit image (palette or grey PNG) of "
                      f"class indices, not colours")  # fmt: skip
    if mask_size != size:
        return image, (f"is {size[0]}x{size[1]} (width x height) but its mask {mask} is {mask_size[0]}x{mask_size[1]}; "
                       f"they must match pixel for pixel")  # fmt: skip
    return None


@contextmanager
def large_images():
    """Let PIL decode huge images in this block: GID tiles are 6800 x 7200 (49 Mpx) and PIL's
    decompression-bomb guard (a warning from 89 Mpx, an error from 179 Mpx) only protects
    against hostile files, not a dataset we were pointed at. Restored afterwards."""
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = previous



def header_size(path: Path) -> tuple[int, int]:
    """(width, height) from the image header without decoding it; (0, 0) if unreadable (decoding reports it)."""
    try:
        with Image.open(path) as img:
            return img.size
    except DECODE_ERRORS:
        return 0, 0



# ---------------------------------------------------------------------------
# folders


def find_folder(candidates: list[Path], required: Sequence[str]) -> Path | None:
    """The first candidate folder holding every folder of ``required`` (a file of that name does not count: listing
    it would fail)."""
    for folder in candidates:
        if all((folder / r).is_dir() for r in required):
            return folder
    return None


def files_in_the_way(candidates: list[Path], required: Sequence[str]) -> str:
    """For a layout not found: ``" (<path> is a file, not a folder: ...)"`` naming the required folders that are
    files (a stray download, an archive not unpacked, a partial unzip), else ``""``."""
    found = sorted({str(c / r) for c in candidates for r in required if (c / r).exists() and not (c / r).is_dir()})
    if not found:
        return ""
    return (f" ({', '.join(found)} {'is a file' if len(found) == 1 else 'are files'}, not a folder: move it away and "
            f"unpack the release there again)")


def visible_files(folder: Path, suffixes: Sequence[str]) -> list[Path]:
    """Non-hidden regular files in ``folder`` with one of ``suffixes`` (lower case), sorted by name."""
    return sorted(p for p in folder.iterdir()
                  if not p.name.startswith(".") and p.suffix.lower() in suffixes and p.is_file())  # fmt: skip


def root_state(root: Path) -> str:
    return "does not exist" if not root.exists() else "does not hold it"



def files_ending(folder: Path, suffix: str) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(suffix) and not p.name.startswith(".") and p.is_file())
