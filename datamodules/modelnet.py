"""ModelNet40 point-cloud classification: the official HDF5 release and PyG meshes.

``ModelNet40`` (config ``modelnet40``) reads the official HDF5 release used by
PointNet, DGCNN and PCT. ``root`` is either the folder that contains it or the
release folder itself::

    <root>/modelnet40_ply_hdf5_2048/
        ply_data_train0.h5 ... ply_data_train4.h5   "data": (n, 2048, 3) float32
        ply_data_test0.h5, ply_data_test1.h5        "label": (n, 1) uint8 in [0, 40)
        shape_names.txt                             40 class names, one a line

Get it with ``data.download=true`` (fetches ``url``, ~415 MB) or unzip
``modelnet40_ply_hdf5_2048.zip`` into ``data.root`` by hand.

``ModelNet40PyG`` (config ``modelnet40_pyg``) reads the Princeton OFF meshes
through ``torch_geometric.datasets.ModelNet`` and samples ``npoints`` points
on the surfaces, area-weighted, on every access (so test points are
resampled each epoch too)::

    <root>/raw/<category>/train/<category>_0001.off ...   40 category folders
    <root>/raw/<category>/test/<category>_0627.off ...
    <root>/processed/training.pt, test.pt                 written by PyG once

``raw`` is the ``ModelNet40`` folder of Princeton's ``ModelNet40.zip``,
renamed. Labels are the indices of the sorted category names.

Both modules: ``num_classes == 40`` and ``class_names`` are available right
after construction; ``ModelNet40.setup()`` replaces ``class_names`` by the
contents of ``shape_names.txt`` when present (identical for the official
release). See :mod:`datamodules.points` for the batch contract, the train
augmentation and the validation protocol.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.download import ensure_release
from datamodules.points import ArraySource, PointCloudDataModule, PointSource, read_h5

MODELNET40_CLASSES = [
    "airplane", "bathtub", "bed", "bench", "bookshelf", "bottle", "bowl", "car", "chair", "cone",
    "cup", "curtain", "desk", "door", "dresser", "flower_pot", "glass_box", "guitar", "keyboard", "lamp",
    "laptop", "mantel", "monitor", "night_stand", "person", "piano", "plant", "radio", "range_hood", "sink",
    "sofa", "stairs", "stool", "table", "tent", "toilet", "tv_stand", "vase", "wardrobe", "xbox",
]  # fmt: skip
HDF5_FOLDER = "modelnet40_ply_hdf5_2048"
HDF5_URL = "https://shapenet.cs.stanford.edu/media/modelnet40_ply_hdf5_2048.zip"


class ModelNet40(PointCloudDataModule):
    """ModelNet40, official HDF5 release, loaded into memory once in :meth:`setup`.

    Args:
        root: folder containing ``modelnet40_ply_hdf5_2048/``, or that folder itself.
        npoints: the first ``npoints`` of the 2048 stored points are used.
        download: in :meth:`prepare_data`, fetch ``url`` into ``root`` when the
            release folder is missing.
        url: where to download the release zip from.
        md5: expected md5 of the zip (None: only check that it is a valid zip).
        batch_size, eval_batch_size, num_workers, augment, val_fraction, seed:
            see :class:`~datamodules.points.PointCloudDataModule`.
    """

    def __init__(
        self,
        root: str,
        npoints: int = 1024,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        val_fraction: float = 0.0,
        seed: int = 0,
        download: bool = False,
        url: str = HDF5_URL,
        md5: str | None = None,
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, val_fraction, seed)
        self.save_hyperparameters()
        self.download = bool(download)
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
        """The release folder and its sorted train and test files; UserError if missing."""
        folder = self._folder()
        train = sorted(folder.glob("ply_data_train*.h5"))
        test = sorted(folder.glob("ply_data_test*.h5"))
        if not (train and test):
            state = "has no ply_data_train*.h5 or no ply_data_test*.h5 files" if folder.is_dir() else "does not exist"
            raise UserError(
                f"ModelNet40 HDF5 data not found: {folder} {state}. Expected {HDF5_FOLDER}/ with "
                f"ply_data_train0.h5..ply_data_train4.h5, ply_data_test0.h5, ply_data_test1.h5 and "
                f"shape_names.txt under data.root={self.root}. Set data.download=true to fetch it "
                f"({self.url}), unzip {HDF5_FOLDER}.zip there by hand, or run offline with data=shapes."
            )
        return folder, train, test

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _load(self) -> tuple[PointSource, None, PointSource]:
        folder, train_files, test_files = self._files()
        self.class_names = _read_shape_names(folder / "shape_names.txt")
        train = ArraySource(*_load_h5_files(train_files, self.npoints))
        test = ArraySource(*_load_h5_files(test_files, self.npoints))
        return train, None, test


def _read_shape_names(path: Path) -> list[str]:
    """Class names from ``shape_names.txt``, or the canonical sorted names when it is absent."""
    if not path.is_file():
        return list(MODELNET40_CLASSES)
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(names) != len(MODELNET40_CLASSES):
        raise UserError(
            f"{path} lists {len(names)} class names, expected {len(MODELNET40_CLASSES)} (one a line). "
            f"Restore it from the official {HDF5_FOLDER}.zip, or delete it to use the standard names."
        )
    return names


def _load_h5_files(files: list[Path], npoints: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate validated files: points (n, npoints, 3) float32 and labels (n,) int64."""
    parts = [_load_h5(path, npoints) for path in files]
    points = np.concatenate([p for p, _ in parts])
    labels = np.concatenate([lab for _, lab in parts])
    if len(labels) == 0:
        raise UserError(f"ModelNet40 files {', '.join(str(f) for f in files)} hold no samples; restore the release.")
    return points, labels


def _load_h5(path: Path, npoints: int) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate one HDF5 file; return its first ``npoints`` points and its labels."""
    fix = (
        f"Replace {path.name} with the file from the official {HDF5_FOLDER}.zip "
        f"(or delete the folder and use data.download=true)."
    )
    arrays = read_h5(path, {"data": ([("n", "points", 3)], "f"), "label": ([("n", 1), ("n",)], "iu")}, fix)
    points = np.asarray(arrays["data"], dtype=np.float32)  # (n, P, 3)
    labels = np.asarray(arrays["label"], dtype=np.int64).reshape(-1)  # (n, 1) or (n,) -> (n,)
    if points.shape[1] < npoints:
        raise UserError(f"{path}: 'data' has {points.shape[1]} points per sample but data.npoints={npoints}; "
                        f"use data.npoints <= {points.shape[1]}.")
    bad = np.flatnonzero((labels < 0) | (labels >= len(MODELNET40_CLASSES)))
    if len(bad):
        raise UserError(
            f"{path}: sample {bad[0]} has label {labels[bad[0]]}, expected 0..{len(MODELNET40_CLASSES) - 1}. {fix}"
        )
    bad = np.flatnonzero(~np.isfinite(points).all(axis=(1, 2)))
    if len(bad):
        raise UserError(f"{path}: sample {bad[0]} has NaN or infinite coordinates. {fix}")
    return np.ascontiguousarray(points[:, :npoints]), labels


class PyGSource:
    """A torch-geometric dataset seen as a :class:`~datamodules.points.PointSource`."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.labels = dataset.y.numpy().astype(np.int64).reshape(-1)  # (n,); no transform runs

    def points(self, index: int) -> np.ndarray:
        return self.dataset[int(index)].pos.numpy()  # (npoints, 3), freshly sampled


class ModelNet40PyG(PointCloudDataModule):
    """ModelNet40 meshes through ``torch_geometric.datasets.ModelNet`` (layout in the module docstring).

    :meth:`prepare_data` processes the raw meshes once into ``<root>/processed``
    (the first run parses all 12,311 OFF files and takes minutes). Nothing is
    ever downloaded: a missing or incomplete ``<root>/raw`` raises UserError.

    Args:
        root: folder holding ``raw/`` (and, after processing, ``processed/``).
        npoints: points sampled on each mesh per access.
        batch_size, eval_batch_size, num_workers, augment, val_fraction, seed:
            see :class:`~datamodules.points.PointCloudDataModule`.
    """

    def __init__(
        self,
        root: str,
        npoints: int = 1024,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        val_fraction: float = 0.0,
        seed: int = 0,
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, val_fraction, seed)
        self.save_hyperparameters()
        self.num_classes = len(MODELNET40_CLASSES)
        self.class_names = list(MODELNET40_CLASSES)

    def _check_raw(self) -> Path:
        """Check ``<root>/raw`` has exactly the 40 category folders and some meshes per split."""
        raw = Path(self.root).expanduser() / "raw"
        how = (
            f"Unzip Princeton's ModelNet40.zip (http://modelnet.cs.princeton.edu/ModelNet40.zip) and rename its "
            f"ModelNet40 folder to {raw}, so that {raw}/airplane/train/airplane_0001.off exists; or use "
            f"data=modelnet40 (HDF5, supports data.download=true) or data=shapes offline."
        )
        if not raw.is_dir():
            raise UserError(f"ModelNet40 meshes not found: {raw} does not exist. {how}")
        present = {p.name for p in raw.iterdir() if p.is_dir()}
        missing = sorted(set(MODELNET40_CLASSES) - present)
        extra = sorted(present - set(MODELNET40_CLASSES))
        if missing or extra:
            raise UserError(
                f"{raw} must hold exactly the 40 ModelNet40 category folders (labels are their sorted "
                f"indices); missing: {missing or 'none'}, unexpected: {extra or 'none'}. {how}"
            )
        for split in ("train", "test"):
            if not any(next((raw / c / split).glob(f"{c}_*.off"), None) for c in MODELNET40_CLASSES):
                raise UserError(f"No {split} meshes under {raw}/<category>/{split}/<category>_*.off. {how}")
        return raw

    def _dataset(self, train: bool):
        from torch_geometric.datasets import ModelNet
        from torch_geometric.transforms import SamplePoints

        raw = self._check_raw()
        try:
            return ModelNet(str(raw.parent), name="40", train=train, transform=SamplePoints(self.npoints))
        except (OSError, ValueError, IndexError, RuntimeError) as err:
            raise UserError(
                f"torch-geometric could not process the ModelNet40 meshes under {raw} ({type(err).__name__}: "
                f"{err}). A mesh file is probably malformed; restore the original ModelNet40.zip contents "
                f"and delete {raw.parent / 'processed'} to reprocess."
            ) from None

    def prepare_data(self) -> None:
        """Process the raw meshes into ``<root>/processed`` (once; later runs load it)."""
        self._dataset(train=True)

    def _load(self) -> tuple[PointSource, None, PointSource]:
        return PyGSource(self._dataset(train=True)), None, PyGSource(self._dataset(train=False))
