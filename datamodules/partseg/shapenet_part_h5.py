"""ShapeNetPart, the HDF5 release (config ``shapenet_part_h5``): points used as stored, no normals.

The folder may be ``<root>/shapenet_part_seg_hdf5_data/``, ``<root>/hdf5_data/`` (what the official
zip unpacks to) or ``root`` itself::

    <root>/shapenet_part_seg_hdf5_data/
        ply_data_train0.h5 ... ply_data_train5.h5, ply_data_val0.h5, ply_data_test0.h5, ply_data_test1.h5
            "data": (n, 2048, 3) float32, "label": (n, 1) uint8 category, "pid": (n, 2048) uint8 global part
        {train,val,test}_hdf5_file_list.txt   the files of each split, one a line: when present they decide which
                                              files are read (every file they list must be there; one listed by
                                              two splits is refused; an unlisted .h5 is named in a warning)

Validation: the release's val split; ``trainval=True`` trains on train + val and validates on test.
Categories, batches, point sampling and augmentation: :mod:`datamodules.partseg.shapenet`,
:mod:`datamodules.partseg.base`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import SPLITS, BadFiles, DataError, bool_option
from datamodules.download import ReleaseMissing, ensure_release, how_to_get, release_files
from datamodules.formats.h5 import read_h5
from datamodules.partseg.base import PackedSource
from datamodules.partseg.shapenet import (CATEGORY_NAMES, H5_FOLDER, H5_URL, H5_ZIP_FOLDER, ShapeNetPartModule,
                                          part_bounds)


def _natural(path: Path):
    digits = re.findall(r"\d+", path.stem)
    return (int(digits[-1]) if digits else -1, path.name)


class ShapeNetPartH5(ShapeNetPartModule):
    """ShapeNetPart, HDF5 release (layout: module docstring), loaded into memory in :meth:`setup`.

    Args:
        root: folder containing ``shapenet_part_seg_hdf5_data/``, or that folder itself.
        download, url, md5: as in :class:`~datamodules.partseg.shapenet_part.ShapeNetPart`.
        options: those of :class:`~datamodules.partseg.shapenet.ShapeNetPartModule` (``npoints`` out of the
            2048 stored; ``normals`` must be false: the release has none); with ``on_bad_file="skip"``
            an unreadable or malformed file is dropped whole, a sample with a bad category, a bad part
            label or NaN / infinite coordinates alone.
    """

    def __init__(self, root: str, download: bool = False, url: str = H5_URL, md5: str | None = None, **options):
        if options.get("normals"):
            raise UserError(
                f"data.normals=true, but the ShapeNetPart HDF5 release ({H5_FOLDER}) stores no normals; "
                f"set data.normals=false, or use data=shapenet_part (the txt release, with normals)."
            )
        super().__init__(root, **options)
        self.download = bool_option("download", download)
        self.url = url
        self.md5 = md5

    def _folder(self) -> Path:
        """``root`` when it holds ``ply_data_*.h5``, else ``root/shapenet_part_seg_hdf5_data``, else
        ``root/hdf5_data`` (the folder the official zip unpacks to) when that one holds them."""
        root = Path(self.root).expanduser()
        for folder in (root, root / H5_FOLDER, root / H5_ZIP_FOLDER):
            if folder.is_dir() and any(folder.glob("ply_data_*.h5")):
                return folder
        return root / H5_FOLDER

    def _files(self) -> dict[str, list[Path]]:
        """The files of every split (those its ``<split>_hdf5_file_list.txt`` lists, else ``ply_data_<split>*.h5`` in
        natural order); UserError when a split has none."""
        folder = self._folder()
        files = {split: sorted(folder.glob(f"ply_data_{split}*.h5"), key=_natural) for split in SPLITS}
        missing = [split for split, found in files.items() if not found]
        if missing:
            state = "does not exist" if not folder.is_dir() else f"has no ply_data_{missing[0]}*.h5 files"
            raise ReleaseMissing(
                f"ShapeNetPart HDF5 data not found: {folder} {state}. Expected {H5_FOLDER}/ with "
                f"ply_data_train0.h5..ply_data_train5.h5, ply_data_val0.h5, ply_data_test0.h5 and "
                f"ply_data_test1.h5 under data.root={self.root} ({H5_ZIP_FOLDER}/, as the zip unpacks, works too). "
                + how_to_get(self.download, self.url, f"{H5_FOLDER}.zip", offline="parts")
            )
        lists = {split: (f"{split}_hdf5_file_list.txt", f"ply_data_{split}*.h5") for split in SPLITS}
        return release_files(folder, lists, "ShapeNetPart HDF5", f"{H5_FOLDER}.zip", self.root, self.url,
                             order=lambda found: sorted(found, key=_natural))

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        files = self._files()
        train, val, test = (PackedSource.concat([_load_part_h5(p, self.bad) for p in files[s]]) for s in SPLITS)
        if self.trainval:
            return PackedSource.concat([train, val]), None, test
        return train, val, test


def _load_part_h5(path: Path, bad: BadFiles) -> PackedSource:
    """Read and validate one file of the HDF5 release; its good samples (none when the file is bad and
    skipped)."""
    fix = (
        f"Replace {path.name} with the file from the official {H5_FOLDER}.zip "
        f"(or delete the folder and use data.download=true), or run offline with data=parts."
    )
    spec = {
        "data": ([("n", "points", 3)], "f"),
        "label": ([("n", 1), ("n",)], "iu"),
        "pid": ([("n", "points")], "iu"),
    }
    empty = PackedSource(np.empty((0, 3), np.float32), np.empty(0, np.uint8), [0], np.empty(0, np.int64))
    try:
        arrays = read_h5(path, spec, fix)
        n, p = arrays["pid"].shape
        if n == 0 or p == 0:
            raise DataError(f"{path} holds no points ('data' has shape {arrays['data'].shape}). {fix}",
                            f"{path}: holds no points")  # fmt: skip
    except DataError as err:
        bad.file(err)
        return empty
    with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf: reported below
        points = np.asarray(arrays["data"], dtype=np.float32)  # (n, P, 3)
    raw_cat, raw_pid = arrays["label"].reshape(-1), arrays["pid"]  # stored dtypes: compared without wrap-around
    cat_ok = (raw_cat >= 0) & (raw_cat < len(CATEGORY_NAMES))  # (n,)
    categories = np.where(cat_ok, raw_cat, 0).astype(np.int64)
    lo, hi = part_bounds(categories)  # (n,) each
    part_bad = (raw_pid < lo[:, None]) | (raw_pid > hi[:, None])  # (n, P)
    first_part = part_bad.argmax(axis=1)  # (n,) first bad point per sample
    nonfinite = ~np.isfinite(points).all(axis=2)  # (n, P)
    first_nan = nonfinite.argmax(axis=1)

    def say_part(i: int) -> str:
        j = first_part[i]
        return (f"sample {i}, point {j} has part label {raw_pid[i, j]}, outside the {CATEGORY_NAMES[categories[i]]} "
                f"range {lo[i]}..{hi[i]} (category {categories[i]})")  # fmt: skip

    keep = bad.samples(path, n, [
        (~cat_ok, lambda i: f"sample {i} has category label {raw_cat[i]}, expected 0..{len(CATEGORY_NAMES) - 1}"),
        (part_bad.any(axis=1), say_part),
        (nonfinite.any(axis=1), lambda i: f"sample {i}, point {first_nan[i]} has NaN or infinite coordinates"),
    ], fix)  # fmt: skip
    k = int(keep.sum())
    return PackedSource(points[keep].reshape(-1, 3), raw_pid[keep].reshape(-1).astype(np.uint8),
                        np.arange(k + 1) * p, categories[keep])  # fmt: skip
