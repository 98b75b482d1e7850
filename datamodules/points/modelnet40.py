"""ModelNet40 point-cloud classification, the official HDF5 release (config ``modelnet40``).

It is the release used by PointNet, DGCNN and PCT. ``root`` is either the folder that contains it or
the release folder itself::

    <root>/modelnet40_ply_hdf5_2048/
        ply_data_train0.h5 ... ply_data_train4.h5   "data": (n, 2048, 3) float32
        ply_data_test0.h5, ply_data_test1.h5        "label": (n, 1) uint8 in [0, 40)
        shape_names.txt                             40 class names, one a line
        train_files.txt, test_files.txt             the shards of each split, one a line: when present they
                                                    decide which files are read (every file they list must be
                                                    there; one listed by both is refused; an unlisted .h5, e.g.
                                                    "ply_data_train0 (1).h5", is named in a warning, not read)

Get it with ``data.download=true`` (fetches ``url``, ~415 MB) or unzip
``modelnet40_ply_hdf5_2048.zip`` into ``data.root`` by hand. The ShapeNet part HDF5 release has files of the same
names: a folder without ``shape_names.txt`` and the two lists that holds it is refused (``data=shapenet_part_h5``
reads it), and a file with no samples is a bad file (``data.on_bad_file``).

``num_classes == 40`` and ``class_names`` are available right after construction;
``setup()`` replaces ``class_names`` by the contents of ``shape_names.txt`` when present
(identical for the official release). The meshes of the same data set: :mod:`datamodules.points.modelnet40_pyg`.
See :mod:`datamodules.points.base` for the batch contract, the train augmentation and the
validation protocol.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from attention.errors import UserError
from datamodules.base import BadFiles, DataError, bool_option
from datamodules.download import ReleaseMissing, ensure_release, how_to_get, release_files
from datamodules.formats.h5 import read_h5
from datamodules.points.base import ArraySource, PointCloudDataModule, PointSource

MODELNET40_CLASSES = [
    "airplane", "bathtub", "bed", "bench", "bookshelf", "bottle", "bowl", "car", "chair", "cone",
    "cup", "curtain", "desk", "door", "dresser", "flower_pot", "glass_box", "guitar", "keyboard", "lamp",
    "laptop", "mantel", "monitor", "night_stand", "person", "piano", "plant", "radio", "range_hood", "sink",
    "sofa", "stairs", "stool", "table", "tent", "toilet", "tv_stand", "vase", "wardrobe", "xbox",
]  # fmt: skip
HDF5_FOLDER = "modelnet40_ply_hdf5_2048"
HDF5_URL = "https://shapenet.cs.stanford.edu/media/modelnet40_ply_hdf5_2048.zip"
FILE_LISTS = ("train_files.txt", "test_files.txt")  # the release's lists of its shards: they decide, when present


class ModelNet40(PointCloudDataModule):
    """ModelNet40, official HDF5 release, loaded into memory once in :meth:`setup`.

    Args:
        root: folder containing ``modelnet40_ply_hdf5_2048/``, or that folder itself.
        download: in :meth:`prepare_data`, fetch ``url`` into ``root`` when the
            release folder is missing.
        url: where to download the release zip from.
        md5: expected md5 of the zip (None: only check that it is a valid zip).
        options: those of :class:`~datamodules.points.base.PointCloudDataModule`; with
            ``on_bad_file="skip"`` an unreadable or malformed file is dropped whole, a sample with a
            label outside 0..39 or NaN / infinite coordinates alone.
    """

    def __init__(self, root: str, download: bool = False, url: str = HDF5_URL, md5: str | None = None, **options):
        super().__init__(root, **options)
        self.download = bool_option("download", download)
        self.url = url
        self.md5 = md5
        self.num_classes = len(MODELNET40_CLASSES)
        self.class_names = list(MODELNET40_CLASSES)

    def _folder(self) -> Path:
        """The release folder: ``root`` itself when it holds ``ply_data_*.h5``, else ``root/HDF5_FOLDER``."""
        root = Path(self.root).expanduser()
        if root.is_dir() and any(root.glob("ply_data_*.h5")):
            return root
        return root / HDF5_FOLDER

    def _files(self) -> tuple[Path, list[Path], list[Path]]:
        """The release folder and its train and test files (those ``train_files.txt`` / ``test_files.txt`` list,
        else the sorted ``ply_data_{train,test}*.h5``); UserError if missing."""
        folder = self._folder()
        _refuse_shapenet_part(folder)
        train = sorted(folder.glob("ply_data_train*.h5"))
        test = sorted(folder.glob("ply_data_test*.h5"))
        if not (train and test):
            state = "has no ply_data_train*.h5 or no ply_data_test*.h5 files" if folder.is_dir() else "does not exist"
            raise ReleaseMissing(
                f"ModelNet40 HDF5 data not found: {folder} {state}. Expected {HDF5_FOLDER}/ with "
                f"ply_data_train0.h5..ply_data_train4.h5, ply_data_test0.h5, ply_data_test1.h5 and "
                f"shape_names.txt under data.root={self.root}. "
                + how_to_get(self.download, self.url, f"{HDF5_FOLDER}.zip", offline="shapes")
            )
        splits = {"train": (FILE_LISTS[0], "ply_data_train*.h5"), "test": (FILE_LISTS[1], "ply_data_test*.h5")}
        files = release_files(folder, splits, "ModelNet40", f"{HDF5_FOLDER}.zip", self.root, self.url)
        return folder, files["train"], files["test"]

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _load(self) -> tuple[PointSource, None, PointSource]:
        folder, train_files, test_files = self._files()
        self.class_names = _read_shape_names(folder / "shape_names.txt")
        train = ArraySource(*_load_h5_files(train_files, self.npoints, self.bad, len(self.skipped)))
        test = ArraySource(*_load_h5_files(test_files, self.npoints, self.bad, len(self.skipped)))
        return train, None, test


def _refuse_shapenet_part(folder: Path) -> None:
    """UserError when ``folder`` holds the ShapeNet part HDF5 release: its ``ply_data_{train,test}*.h5`` match the
    ModelNet40 globs and pass the ModelNet40 checks (16 categories are valid labels), so it would train as ModelNet40.

    A folder with one of the ModelNet40 release's own files (``shape_names.txt``, ``train_files.txt``,
    ``test_files.txt``) is ModelNet40: its lists decide what is read. Without them (a hand-made or trimmed copy) the
    ShapeNet part release shows by its split lists, its val split or the part labels ("pid") in its files."""
    if not folder.is_dir() or any((folder / name).is_file() for name in ("shape_names.txt", *FILE_LISTS)):
        return
    signs = [p.name for p in sorted(folder.glob("*_hdf5_file_list.txt"))] + \
        [p.name for p in sorted(folder.glob("ply_data_val*.h5"))]  # fmt: skip
    first = min(folder.glob("ply_data_*.h5"), default=None)
    if not signs and first is not None:
        try:
            with h5py.File(first, "r") as f:
                if "pid" in f:
                    signs = [f"a 'pid' (part label) dataset in {first.name}"]
        except (OSError, ValueError):  # a corrupt file: the reader names it when it loads it
            pass
    if signs:
        raise UserError(
            f"data.root={folder} looks like the ShapeNet part HDF5 release, not ModelNet40: it holds "
            f"{', '.join(signs[:3])}{' ...' if len(signs) > 3 else ''} and none of the ModelNet40 release's "
            f"shape_names.txt, train_files.txt, test_files.txt. For part segmentation use task=shapenet "
            f"data=shapenet_part_h5 data.root={folder}; for ModelNet40 set data.root to the folder that holds "
            f"{HDF5_FOLDER}/ (unzipped from {HDF5_FOLDER}.zip, or fetched with data.download=true)."
        )


def _read_shape_names(path: Path) -> list[str]:
    """Class names from ``shape_names.txt``, or the canonical sorted names when it is absent."""
    if not path.is_file():
        return list(MODELNET40_CLASSES)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read as text ({err}). Restore it from the official {HDF5_FOLDER}.zip, "
                        f"or delete it to use the standard names.") from None  # fmt: skip
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(names) != len(MODELNET40_CLASSES):
        raise UserError(
            f"{path} lists {len(names)} class names, expected {len(MODELNET40_CLASSES)} (one a line). "
            f"Restore it from the official {HDF5_FOLDER}.zip, or delete it to use the standard names."
        )
    return names


def _load_h5_files(files: list[Path], npoints: int, bad: BadFiles, skipped_before: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Concatenate validated files: points (n, npoints, 3) float32 and labels (n,) int64.

    Bad files and samples go to ``bad``; UserError when no sample is left."""
    parts = [_load_h5(path, npoints, bad) for path in files]
    points = np.concatenate([p for p, _ in parts])
    labels = np.concatenate([lab for _, lab in parts])
    if len(labels) == 0:
        dropped = len(bad.skipped) - skipped_before
        why = f"all {dropped} bad file(s) or sample(s) were skipped (data.on_bad_file=skip)" if dropped else \
            "they hold no samples"  # fmt: skip
        raise UserError(
            f"ModelNet40 files {', '.join(str(f) for f in files)}: nothing left to train or test on, {why}. "
            f"Restore the release from the official {HDF5_FOLDER}.zip (or delete the folder and use "
            f"data.download=true)."
        )
    return points, labels


def _load_h5(path: Path, npoints: int, bad: BadFiles) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate one HDF5 file; return the first ``npoints`` points and the labels of its good
    samples (none when the file is skipped)."""
    fix = (
        f"Replace {path.name} with the file from the official {HDF5_FOLDER}.zip "
        f"(or delete the folder and use data.download=true)."
    )
    none = np.empty((0, npoints, 3), np.float32), np.empty(0, np.int64)
    try:
        arrays = read_h5(path, {"data": ([("n", "points", 3)], "f"), "label": ([("n", 1), ("n",)], "iu")}, fix)
        if len(arrays["label"]) == 0:  # a listed shard emptied (an interrupted re-export): its samples are missing
            raise DataError(f"{path} holds no samples ('data' has shape {arrays['data'].shape}). {fix}",
                            f"{path}: holds no samples")  # fmt: skip
    except DataError as err:
        bad.file(err)
        return none
    with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf: reported below
        points = np.asarray(arrays["data"], dtype=np.float32)  # (n, P, 3)
    raw = arrays["label"].reshape(-1)  # (n, 1) or (n,) -> (n,), stored dtype
    if points.shape[1] < npoints:
        raise UserError(f"{path}: 'data' has {points.shape[1]} points per sample but data.npoints={npoints}; "
                        f"use data.npoints <= {points.shape[1]}.")  # fmt: skip
    in_range = (raw >= 0) & (raw < len(MODELNET40_CLASSES))  # compared in the stored dtype: no wrap-around
    keep = bad.samples(path, len(raw), [
        (~in_range, lambda i: f"sample {i} has label {raw[i]}, expected 0..{len(MODELNET40_CLASSES) - 1}"),
        (~np.isfinite(points).all(axis=(1, 2)), lambda i: f"sample {i} has NaN or infinite coordinates"),
    ], fix)  # fmt: skip
    labels = raw[keep].astype(np.int64)
    return np.ascontiguousarray(points[keep, :npoints]), labels
