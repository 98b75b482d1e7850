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

import glob
from pathlib import Path

import numpy as np
import torch

from attention.errors import UserError
from datamodules.download import ensure_release
from datamodules.points import (
    ArraySource,
    BadData,
    DataError,
    PointCloudDataModule,
    PointSource,
    pyg_offsets,
    read_h5,
)

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
        on_bad_file: ``"error"``, or ``"skip"``: an unreadable or malformed file is dropped
            whole, a sample with a label outside 0..39 or NaN / infinite coordinates alone.
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
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, val_fraction, seed,
                         on_bad_file)  # fmt: skip
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
        train = ArraySource(*_load_h5_files(train_files, self.npoints, self.bad, len(self.skipped)))
        test = ArraySource(*_load_h5_files(test_files, self.npoints, self.bad, len(self.skipped)))
        return train, None, test


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


def _load_h5_files(files: list[Path], npoints: int, bad: BadData, skipped_before: int = 0
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


def _load_h5(path: Path, npoints: int, bad: BadData) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate one HDF5 file; return the first ``npoints`` points and the labels of its good
    samples (none when the file is skipped)."""
    fix = (
        f"Replace {path.name} with the file from the official {HDF5_FOLDER}.zip "
        f"(or delete the folder and use data.download=true)."
    )
    none = np.empty((0, npoints, 3), np.float32), np.empty(0, np.int64)
    try:
        arrays = read_h5(path, {"data": ([("n", "points", 3)], "f"), "label": ([("n", 1), ("n",)], "iu")}, fix)
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


class PyGSource:
    """A torch-geometric dataset seen as a :class:`~datamodules.points.PointSource`, restricted to
    the meshes ``keep`` (default: all)."""

    def __init__(self, dataset, keep: np.ndarray | None = None):
        self.dataset = dataset
        labels = dataset._data.y.numpy().astype(np.int64).reshape(-1)  # (n,); no transform runs
        self.index = np.arange(len(labels)) if keep is None else np.flatnonzero(keep)
        self.labels = labels[self.index]

    def points(self, index: int) -> np.ndarray:
        return self.dataset[int(self.index[index])].pos.numpy()  # (npoints, 3), freshly sampled


def mesh_problems(dataset) -> dict[int, str]:
    """Meshes of a processed PyG ModelNet dataset that ``SamplePoints`` cannot sample: mesh index ->
    what is wrong (non-finite vertices, no faces, a face naming a missing vertex, zero area)."""
    data = dataset._data
    pos = data.pos.to(torch.float64)  # (T, 3)
    face = data.face if data.face is not None else torch.empty((3, 0), dtype=torch.long)  # (3, F), per-mesh indices
    nv, nf = pyg_offsets(dataset, "pos").diff(), pyg_offsets(dataset, "face").diff()  # (n,) each
    n = len(nv)
    vert_mesh = torch.repeat_interleave(torch.arange(n), nv)  # (T,)
    face_mesh = torch.repeat_interleave(torch.arange(n), nf)  # (F,)
    nonfinite = torch.zeros(n).index_add_(0, vert_mesh, (~torch.isfinite(pos).all(dim=1)).to(torch.float32))
    outside = ((face < 0) | (face >= nv[face_mesh])).any(dim=0)  # (F,)
    bad_faces = torch.zeros(n).index_add_(0, face_mesh, outside.to(torch.float32))
    scale = torch.zeros(n, dtype=torch.float64).scatter_reduce_(
        0, vert_mesh, pos.abs().amax(dim=1).nan_to_num(0.0, 0.0, 0.0), "amax")  # (n,) as SamplePoints divides
    ok_face = ~outside
    corner = (face.clamp(min=0) + pyg_offsets(dataset, "pos")[:-1][face_mesh]).clamp(max=max(len(pos) - 1, 0))  # (3, F)
    unit = pos / scale[vert_mesh].clamp(min=1e-300)[:, None]
    area = torch.zeros(n, dtype=torch.float64)
    if face.shape[1] and len(pos):
        cross = torch.linalg.cross(unit[corner[1]] - unit[corner[0]], unit[corner[2]] - unit[corner[0]], dim=1)
        area.index_add_(0, face_mesh, torch.where(ok_face, cross.norm(dim=1), 0.0).nan_to_num(0.0))
    problems = {}
    for i in range(n):
        if nonfinite[i]:
            problems[i] = "NaN or infinite vertex coordinates"
        elif nf[i] == 0:
            problems[i] = "no faces"
        elif bad_faces[i]:
            problems[i] = "a face refers to a vertex that does not exist"
        elif not float(area[i]) / 2 > 1e-12:
            problems[i] = "zero surface area (all faces degenerate), nothing to sample points on"
    return problems


class ModelNet40PyG(PointCloudDataModule):
    """ModelNet40 meshes through ``torch_geometric.datasets.ModelNet`` (layout in the module docstring).

    :meth:`prepare_data` processes the raw meshes once into ``<root>/processed``
    (the first run parses all 12,311 OFF files and takes minutes). Nothing is
    ever downloaded: a missing or incomplete ``<root>/raw`` raises UserError.

    Args:
        root: folder holding ``raw/`` (and, after processing, ``processed/``).
        npoints: points sampled on each mesh per access.
        on_bad_file: ``"error"``, or ``"skip"``: meshes that cannot be sampled (NaN vertices, no
            faces, faces naming missing vertices, zero area) are dropped. A file torch-geometric
            cannot parse at all stops processing either way.
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
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, val_fraction, seed,
                         on_bad_file)  # fmt: skip
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

    def _source(self, train: bool) -> PyGSource:
        """The split's meshes, those that cannot be sampled raised or (skip) dropped and recorded."""
        dataset = self._dataset(train)
        raw = self._check_raw()
        split = "train" if train else "test"
        problems = mesh_problems(dataset)
        files = [Path(p) for c in MODELNET40_CLASSES for p in glob.glob(f"{raw / c / split}/{c}_*.off")]  # PyG's order
        name = (lambda i: str(files[i])) if len(files) == len(dataset) else (lambda i: f"mesh {i} of {raw} ({split})")
        fix = (f"Repair or remove the mesh (restore it from the original ModelNet40.zip), then delete "
               f"{raw.parent / 'processed'} to reprocess.")  # fmt: skip
        keep = np.ones(len(dataset), dtype=bool)
        for i, what in problems.items():
            self.bad.file(DataError(f"{name(i)}: {what}. {fix}", f"{name(i)}: {what}"))
            keep[i] = False
        if not keep.any():
            raise UserError(
                f"No usable ModelNet40 {split} mesh under {raw}: all {len(keep)} were skipped "
                f"(data.on_bad_file=skip). {fix}"
            )
        return PyGSource(dataset, keep)

    def _load(self) -> tuple[PointSource, None, PointSource]:
        return self._source(train=True), None, self._source(train=False)
