"""ModelNet40 meshes through torch-geometric (config ``modelnet40_pyg``).

Reads the Princeton OFF meshes through ``torch_geometric.datasets.ModelNet`` and samples ``npoints``
points on the surfaces, area-weighted, on every access; each sampled cloud is centred and scaled to the unit
sphere, as the HDF5 release's are (the meshes have arbitrary units and offsets). Training clouds are new every
epoch (torch's generator, seeded per worker). Evaluation clouds (test, and a ``val_fraction`` held out of train)
are drawn from a generator of their own seeded by ``(seed, split, index)`` (:func:`draw_seed`): the same points in
every epoch, run, process count and worker count, as the other point data sets' evaluation samples. They were
drawn from the global generator, so every validation scored other points, a test under two processes scored other
points than one process, and ``mode=test`` of a checkpoint other points than its run's own test::

    <root>/raw/<category>/train/<category>_0001.off ...   40 category folders
    <root>/raw/<category>/test/<category>_0627.off ...
    <root>/processed/training.pt, test.pt                 written by PyG, again when the raw files change

``raw`` is the ``ModelNet40`` folder of Princeton's ``ModelNet40.zip``, renamed. Labels are the indices
of the sorted category names; ``num_classes == 40`` and ``class_names`` are available right after
construction. See :mod:`datamodules.points.base` for the batch contract, the train augmentation and the
validation protocol.
"""

from __future__ import annotations

import copy
import glob
from pathlib import Path

import numpy as np
import torch

from attention.errors import UserError
from datamodules.base import SPLITS, DataError
from datamodules.formats.pyg import PyGRaw, mesh_problems
from datamodules.points.base import PointCloudDataModule, PointSource
from datamodules.points.modelnet40 import MODELNET40_CLASSES
from datamodules.points.ops import unit_sphere


def draw_seed(key: tuple[int, ...], index: int) -> int:
    """The torch seed an evaluation cloud is sampled with: a function of ``key`` (seed, split) and the row
    ``index`` alone."""
    return int(np.random.SeedSequence([*key, int(index)]).generate_state(1, np.uint64)[0] % 2**63)


class PyGSource:
    """A torch-geometric dataset seen as a :class:`~datamodules.points.base.PointSource`, restricted to
    the meshes ``keep`` (default: all); each sampled cloud centred and scaled to the unit sphere. ``key``:
    None samples from torch's global generator (training: new points every access); a tuple of ints samples row
    ``index`` with a generator seeded by :func:`draw_seed` (evaluation: the same points every time)."""

    def __init__(self, dataset, keep: np.ndarray | None = None, key: tuple[int, ...] | None = None):
        self.dataset = dataset
        labels = dataset._data.y.numpy().astype(np.int64).reshape(-1)  # (n,); no transform runs
        self.index = np.arange(len(labels)) if keep is None else np.flatnonzero(keep)
        self.labels = labels[self.index]
        self.key = key

    def seeded(self, key: tuple[int, ...]) -> PyGSource:
        """The same meshes, each sampled the same way on every access (``key``: seed, split)."""
        source = copy.copy(self)
        source.key = tuple(int(k) for k in key)
        return source

    def points(self, index: int) -> np.ndarray:
        if self.key is None:
            pos = self.dataset[int(self.index[index])].pos.numpy()  # (npoints, 3), freshly sampled, in mesh units
        else:  # PyG's SamplePoints draws from torch's global CPU generator: a seeded one here, put back after
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(draw_seed(self.key, index))
                pos = self.dataset[int(self.index[index])].pos.numpy()
        # float64: a mesh in huge units still gives finite unit-sphere points.
        return unit_sphere(pos.astype(np.float64), np.array([0, len(pos)]))


class ModelNet40PyG(PyGRaw, PointCloudDataModule):
    """ModelNet40 meshes through ``torch_geometric.datasets.ModelNet`` (layout in the module docstring).

    :meth:`prepare_data` processes the raw meshes into ``<root>/processed``, once and again when
    the raw files change (the first run parses all 12,311 OFF files and takes minutes). Nothing is
    ever downloaded: a missing or incomplete ``<root>/raw`` raises UserError.

    Args:
        root: folder holding ``raw/`` (and, after processing, ``processed/``).
        options: those of :class:`~datamodules.points.base.PointCloudDataModule` (``npoints``: points
            sampled on each mesh per access); with ``on_bad_file="skip"`` meshes that cannot be sampled
            (NaN vertices, no faces, faces naming missing vertices, zero area) are dropped. A file
            torch-geometric cannot parse at all stops processing either way.
    """

    raw_what = "ModelNet40 meshes"
    raw_archive = "ModelNet40.zip"
    raw_cause = "A mesh file is probably malformed"
    raw_how = ("Unzip Princeton's ModelNet40.zip (http://modelnet.cs.princeton.edu/ModelNet40.zip) and rename its "
               "ModelNet40 folder to {raw}, so that {raw}/airplane/train/airplane_0001.off exists; or use "
               "data=modelnet40 (HDF5, supports data.download=true) or data=shapes offline.")

    def __init__(self, root: str, **options):
        super().__init__(root, **options)
        self.num_classes = len(MODELNET40_CLASSES)
        self.class_names = list(MODELNET40_CLASSES)

    def _raw_problem(self, raw: Path) -> str | None:
        """``raw`` must hold exactly the 40 category folders and some meshes per split."""
        if not raw.is_dir():
            return f"ModelNet40 meshes not found: {raw} does not exist."
        present = {p.name for p in raw.iterdir() if p.is_dir()}
        missing = sorted(set(MODELNET40_CLASSES) - present)
        extra = sorted(present - set(MODELNET40_CLASSES))
        if missing or extra:
            return (f"{raw} must hold exactly the 40 ModelNet40 category folders (labels are their sorted "
                    f"indices); missing: {missing or 'none'}, unexpected: {extra or 'none'}.")
        for split in ("train", "test"):
            if not any(next((raw / c / split).glob(f"{c}_*.off"), None) for c in MODELNET40_CLASSES):
                return f"No {split} meshes under {raw}/<category>/{split}/<category>_*.off."
        return None

    def _dataset(self, train: bool):
        from torch_geometric.datasets import ModelNet
        from torch_geometric.transforms import SamplePoints

        return self._process(lambda root: ModelNet(root, name="40", train=train, transform=SamplePoints(self.npoints)),
                             "ModelNet name=40")

    def prepare_data(self) -> None:
        """Process the raw meshes into ``<root>/processed`` (when missing or stale; later runs load it)."""
        self._dataset(train=True)

    def _source(self, train: bool) -> PyGSource:
        """The split's meshes, those that cannot be sampled raised or (skip) dropped and recorded."""
        dataset = self._dataset(train)
        raw = self._check_raw()
        split = "train" if train else "test"
        problems = mesh_problems(dataset)
        files = [Path(p) for c in MODELNET40_CLASSES for p in glob.glob(f"{raw / c / split}/{c}_*.off")]  # PyG's order
        name = (lambda i: str(files[i])) if len(files) == len(dataset) else (lambda i: f"mesh {i} of {raw} ({split})")
        fix = ("Repair or remove the mesh (restore it from the original ModelNet40.zip); the next run "
               "processes the changed raw files again.")
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

    def _build(self) -> None:
        """The splits of the base class, the evaluation ones sampled from ``(seed, split, index)``."""
        super()._build()
        self.test_set.source = self.test_set.source.seeded((self.seed, SPLITS["test"]))
        if self.val_set is not self.test_set:  # a val_fraction held out of the train meshes
            self.val_set.source = self.val_set.source.seeded((self.seed, SPLITS["val"]))
