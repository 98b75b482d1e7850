"""ShapeNet part segmentation (ShapeNetPart): the txt release with normals, the HDF5 release, and PyG.

Batch contract (every part-segmentation module, including :class:`datamodules.parts.Parts`)::

    sample = {"points": FloatTensor (N, 3), "parts": LongTensor (N,) global part ids,
              "category": LongTensor () category index,
              "normals": FloatTensor (N, 3)}          # only when normals=True
    batch["points"]: (B, N, 3) float32, batch["parts"]: (B, N) int64, batch["category"]: (B,) int64

16 categories, 50 parts; category index = position in the official
``synsetoffset2category.txt`` (sorted by name), part ids are global and each
category owns a contiguous range (:data:`CATEGORY_PARTS`: Airplane 0-3, Bag 4-5,
Cap 6-7, Car 8-11, Chair 12-15, Earphone 16-18, Guitar 19-21, Knife 22-23,
Lamp 24-27, Laptop 28-29, Motorbike 30-35, Mug 36-37, Pistol 38-40, Rocket
41-43, Skateboard 44-46, Table 47-49). ``num_categories``, ``num_parts``,
``category_names`` and ``category_parts`` are available right after construction.

Point sampling (per access, :func:`sample_indices`): a shape with P >= N stored
points yields N distinct points chosen at random (without replacement); a shape
with P < N yields all its P points plus N - P repeats drawn with replacement, in
random order (the PCT / PointNet++ reference loaders draw all N with replacement;
ours never leaves a point out). Train samples draw from the torch-seeded
per-sample generator of :func:`datamodules.points.sample_rng` (new points every
epoch, reproducible under ``seed_everything(seed, workers=True)``); validation and
test samples draw from ``np.random.default_rng([seed, split, index])``, identical
in every epoch and run. The same selection is applied to points, parts and normals.

Training augmentation (train split, ``augment=True``, on a copy): the reference
``translate_pointcloud``, per-axis scale ~ U(2/3, 3/2) and shift ~ U(-0.2, 0.2)
(:func:`datamodules.points.scale_shift`). No point dropout (it would misalign the
labels) and no rotation; normals are returned unchanged (they are not rescaled,
so after a non-uniform scale they are only approximately normal).

Validation: the official val split; ``trainval=True`` trains on train + val (as the
PCT / PointNet++ references do) and then validates on the test split.

``ShapeNetPart`` (config ``shapenet_part``) reads the official txt release;
``root`` is the folder that contains it or the release folder itself::

    <root>/shapenetcore_partanno_segmentation_benchmark_v0_normal/
        synsetoffset2category.txt            "Airplane<TAB>02691156", one category a line
        02691156/<id>.txt ...                one folder per synset; rows "x y z nx ny nz part"
        train_test_split/shuffled_{train,val,test}_file_list.json   ["shape_data/<synset>/<id>", ...]
    <root>/processed/shapenet_part_{train,val,test}.npz   parse cache, written once

Points are centred at their centroid and divided by their largest norm (the unit
sphere), before sampling. Parsing the ~17k txt files takes about two minutes (~7 ms
a file), once: the parsed split is cached (one float32 array of all points, one of normals, the
labels and per-shape offsets) and rebuilt automatically when the split list, a
file's size or modification time, or :data:`CACHE_VERSION` changes.

``ShapeNetPartH5`` (config ``shapenet_part_h5``) reads the HDF5 release (points
used as stored; it has no normals); the folder may also be ``<root>/hdf5_data/``,
which is what the official zip unpacks to, or ``root`` itself::

    <root>/shapenet_part_seg_hdf5_data/
        ply_data_train0.h5 ... ply_data_train5.h5, ply_data_val0.h5, ply_data_test0.h5, ply_data_test1.h5
            "data": (n, 2048, 3) float32, "label": (n, 1) uint8 category, "pid": (n, 2048) uint8 global part

``ShapeNetPartPyG`` (config ``shapenet_part_pyg``) reads the txt release through
``torch_geometric.datasets.ShapeNet`` (processed once into ``<root>/processed``;
points normalised like ``ShapeNetPart``)::

    <root>/raw/   the release folder, renamed: 16 synset folders and train_test_split/
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attention.errors import UserError
from datamodules.cache import read_cache, write_cache
from datamodules.download import ensure_release
from datamodules.points import PointCloudDataModule, read_h5, sample_rng, scale_shift

log = logging.getLogger(__name__)

# (name, synset, number of parts), in the official synsetoffset2category.txt order.
SHAPENET_CATEGORIES = [
    ("Airplane", "02691156", 4), ("Bag", "02773838", 2), ("Cap", "02954340", 2), ("Car", "02958343", 4),
    ("Chair", "03001627", 4), ("Earphone", "03261776", 3), ("Guitar", "03467517", 3), ("Knife", "03624134", 2),
    ("Lamp", "03636649", 4), ("Laptop", "03642806", 2), ("Motorbike", "03790512", 6), ("Mug", "03797390", 2),
    ("Pistol", "03948459", 3), ("Rocket", "04099429", 3), ("Skateboard", "04225987", 3), ("Table", "04379243", 3),
]  # fmt: skip
CATEGORY_NAMES = [name for name, _, _ in SHAPENET_CATEGORIES]
SYNSETS = [synset for _, synset, _ in SHAPENET_CATEGORIES]


def contiguous_parts(counts: Sequence[int]) -> list[list[int]]:
    """Global part ids per category when category ``c`` owns ``counts[c]`` consecutive ids."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [list(range(starts[c], starts[c + 1])) for c in range(len(counts))]


CATEGORY_PARTS = contiguous_parts([n for _, _, n in SHAPENET_CATEGORIES])
NUM_PARTS = 50

TXT_FOLDER = "shapenetcore_partanno_segmentation_benchmark_v0_normal"
TXT_URL = f"https://shapenet.cs.stanford.edu/media/{TXT_FOLDER}.zip"
H5_FOLDER = "shapenet_part_seg_hdf5_data"
H5_URL = f"https://shapenet.cs.stanford.edu/media/{H5_FOLDER}.zip"
H5_ZIP_FOLDER = "hdf5_data"  # what the official shapenet_part_seg_hdf5_data.zip unpacks to
SPLITS = {"train": 0, "val": 1, "test": 2}
CACHE_VERSION = 1  # bump when the parsing or preprocessing of the txt release changes
ENTRY = re.compile(r"shape_data/([^/]+)/([^/]+)")


# ---------------------------------------------------------------------------
# Shared pieces: packed shapes, the sample dataset, the data module base.


class PackedSource:
    """Shapes of varying sizes packed into flat arrays (shape ``i`` is rows ``offsets[i]:offsets[i+1]``).

    Args:
        points: (T, 3) float32, all shapes' points concatenated.
        parts: (T,) integer global part ids.
        offsets: (n + 1,) int64, ``offsets[0] == 0`` and ``offsets[-1] == T``.
        categories: (n,) int64 category indices.
        normals: (T, 3) float32, or None.
    """

    def __init__(self, points, parts, offsets, categories, normals=None):
        self.points, self.parts, self.normals = points, parts, normals
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.categories = np.asarray(categories, dtype=np.int64)
        if len(self.offsets) != len(self.categories) + 1 or not self.offsets[-1] == len(points) == len(parts):
            raise ValueError(f"inconsistent packed arrays: {len(points)} points, offsets {self.offsets[[0, -1]]}")

    def __len__(self) -> int:
        return len(self.categories)

    def shape(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Views of shape ``index``: points (P, 3), parts (P,), normals (P, 3) or None; do not modify."""
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.points[lo:hi], self.parts[lo:hi], None if self.normals is None else self.normals[lo:hi]

    @staticmethod
    def concat(sources: Sequence[PackedSource]) -> PackedSource:
        """All shapes of ``sources``, in order (normals only if every source has them)."""
        normals = [s.normals for s in sources]
        ends = np.cumsum([0] + [s.offsets[-1] for s in sources])
        return PackedSource(
            np.concatenate([s.points for s in sources]),
            np.concatenate([s.parts for s in sources]),
            np.concatenate([[0]] + [s.offsets[1:] + end for s, end in zip(sources, ends)]),
            np.concatenate([s.categories for s in sources]),
            None if any(n is None for n in normals) else np.concatenate(normals),
        )


def unit_sphere(points: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each packed shape centred at its centroid and divided by its largest norm; float32 (T, 3).

    A shape whose points all coincide is only centred. Every shape needs >= 1 point.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    counts, starts = np.diff(offsets), offsets[:-1]  # (n,) each
    pts = np.asarray(points, dtype=np.float32)
    centroid = np.add.reduceat(pts, starts, axis=0, dtype=np.float64) / counts[:, None]  # (n, 3)
    centred = pts - np.repeat(centroid.astype(np.float32), counts, axis=0)  # (T, 3) float32
    radius = np.maximum.reduceat(np.linalg.norm(centred, axis=1), starts)  # (n,)
    radius[radius == 0] = 1.0
    centred /= np.repeat(radius, counts)[:, None]
    return centred


def sample_indices(count: int, npoints: int, rng: np.random.Generator) -> np.ndarray:
    """``npoints`` row indices into a shape of ``count`` points (see the module docstring)."""
    if count >= npoints:
        return rng.choice(count, npoints, replace=False)
    idx = np.concatenate([np.arange(count), rng.integers(0, count, npoints - count)])
    rng.shuffle(idx)
    return idx


class PartDataset(Dataset):
    """Dict samples of the batch contract (module docstring) from a :class:`PackedSource`.

    Args:
        source: the shapes.
        npoints: points per sample (:func:`sample_indices`).
        augment: apply the training augmentation (scale and shift of the points).
        normals: include ``"normals"`` (the source must have them).
        eval_seed: None for training (torch-seeded draws, new every epoch); otherwise
            a tuple of ints prefixing the per-index seed of the deterministic draws.
    """

    def __init__(self, source: PackedSource, npoints: int, augment: bool, normals: bool,
                 eval_seed: tuple[int, ...] | None = None):  # fmt: skip
        if normals and source.normals is None:
            raise ValueError("normals requested from a source without normals")
        self.source = source
        self.npoints = npoints
        self.augment = augment
        self.normals = normals
        self.eval_seed = eval_seed

    def __len__(self) -> int:
        return len(self.source)

    @property
    def categories(self) -> np.ndarray:
        """Category of every sample, (len(self),) int64."""
        return self.source.categories

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        points, parts, normals = self.source.shape(index)
        rng = sample_rng() if self.eval_seed is None else np.random.default_rng([*self.eval_seed, index])
        choice = sample_indices(len(points), self.npoints, rng)
        pts = points[choice]  # fancy indexing copies: the source stays intact
        if self.augment:
            pts = scale_shift(pts, rng)
        sample = {
            "points": torch.from_numpy(np.ascontiguousarray(pts, dtype=np.float32)),
            "parts": torch.from_numpy(parts[choice].astype(np.int64)),
            "category": torch.tensor(int(self.source.categories[index]), dtype=torch.long),
        }
        if self.normals:
            sample["normals"] = torch.from_numpy(np.ascontiguousarray(normals[choice], dtype=np.float32))
        return sample


class PartSegDataModule(PointCloudDataModule):
    """Base data module for part segmentation (see the module docstring).

    Subclasses set ``num_categories``, ``num_parts``, ``category_names`` and
    ``category_parts`` in ``__init__`` and implement :meth:`_load`, returning
    ``(train, val or None, test)`` :class:`PackedSource` objects (None: validate on
    test). Loaders come from :class:`~datamodules.points.PointCloudDataModule`.

    Args:
        root: dataset folder (meaning depends on the subclass).
        npoints: points per sample.
        normals: add per-point ``"normals"`` to every sample.
        batch_size, eval_batch_size, num_workers, augment, seed: as in
            :class:`~datamodules.points.PointCloudDataModule`; ``seed`` also fixes
            the validation/test point selection.
    """

    num_categories: int
    num_parts: int
    category_names: list[str]
    category_parts: list[list[int]]

    def __init__(
        self,
        root: str | None,
        npoints: int = 2048,
        normals: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        seed: int = 0,
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, 0.0, seed)
        self.normals = bool(normals)
        self.train_set: PartDataset | None = None
        self.val_set: PartDataset | None = None
        self.test_set: PartDataset | None = None

    def _set_categories(self, names: list[str], parts: list[list[int]]) -> None:
        self.category_names = list(names)
        self.category_parts = [list(p) for p in parts]
        self.num_categories = len(names)
        self.num_parts = sum(len(p) for p in parts)

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val, test = self._load()
        self.train_set = PartDataset(train, self.npoints, self.augment, self.normals)
        self.test_set = PartDataset(test, self.npoints, False, self.normals, (self.seed, SPLITS["test"]))
        self.val_set = self.test_set if val is None else PartDataset(
            val, self.npoints, False, self.normals, (self.seed, SPLITS["val"]))  # fmt: skip

    def val_dataloader(self):
        """In order, every sample exactly once (the test set when training on train + val)."""
        return self._loader("val")


def _part_range(category: int) -> tuple[int, int]:
    parts = CATEGORY_PARTS[category]
    return parts[0], parts[-1]


def _part_bounds(categories: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest allowed global part id of each category index, (n,) each."""
    table = np.array([_part_range(c) for c in range(len(CATEGORY_PARTS))])
    return table[categories, 0], table[categories, 1]


# ---------------------------------------------------------------------------
# ShapeNetPart: the official txt release with normals.


def _txt_layout(where: str, url: str) -> str:
    return (
        f"Expected under data.root={where}:\n"
        f"  {TXT_FOLDER}/\n"
        f"    synsetoffset2category.txt\n"
        f"    02691156/<id>.txt ...  (16 synset folders; rows 'x y z nx ny nz part')\n"
        f"    train_test_split/shuffled_{{train,val,test}}_file_list.json\n"
        f"Set data.download=true to fetch it ({url}), unzip {TXT_FOLDER}.zip there by hand, "
        f"or run offline with data=parts."
    )


class ShapeNetPart(PartSegDataModule):
    """ShapeNetPart, official txt release with normals (layout, caching: module docstring).

    Args:
        root: folder containing the release folder, or the release folder itself;
            the parse cache goes to ``<root>/processed``.
        npoints: points per sample (shapes have ~2.6k points, 500 to 3k).
        normals: add the release's per-point normals.
        trainval: train on train + val and validate on test (the reference protocol).
        download: in :meth:`prepare_data`, fetch ``url`` into ``root`` when the release is missing.
        url: where to download the release zip from.
        md5: expected md5 of the zip (None: only check that it is a valid zip).
        batch_size, eval_batch_size, num_workers, augment, seed: see :class:`PartSegDataModule`.
    """

    def __init__(
        self,
        root: str,
        npoints: int = 2048,
        normals: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        seed: int = 0,
        trainval: bool = False,
        download: bool = False,
        url: str = TXT_URL,
        md5: str | None = None,
    ):
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed)
        self.save_hyperparameters()
        self.trainval = bool(trainval)
        self.download = bool(download)
        self.url = url
        self.md5 = md5
        self._set_categories(CATEGORY_NAMES, CATEGORY_PARTS)

    def _folder(self) -> Path:
        root = Path(self.root).expanduser()
        if (root / "synsetoffset2category.txt").is_file() or (root / "train_test_split").is_dir():
            return root
        return root / TXT_FOLDER

    def _fix(self) -> str:
        return (
            f"Restore it from the official {TXT_FOLDER}.zip (or delete {self._folder()} and use "
            f"data.download=true), or run offline with data=parts."
        )

    def _check(self) -> Path:
        """The release folder, after checking its index files exist; UserError otherwise."""
        folder = self._folder()
        needed = [folder, folder / "synsetoffset2category.txt"] + [
            folder / "train_test_split" / f"shuffled_{split}_file_list.json" for split in SPLITS
        ]
        for path in needed:
            if not path.exists():
                raise UserError(
                    f"ShapeNetPart data not found: {path} does not exist. {_txt_layout(self.root, self.url)}"
                )
        return folder

    def prepare_data(self) -> None:
        """Check the layout (downloading first if allowed and needed), then build the parse caches."""
        ensure_release(self._check, self.download, self.url, Path(self.root).expanduser(), self.md5)
        for split in SPLITS:
            self._split(split, load=False)

    def _synsets(self, folder: Path) -> dict[str, int]:
        """synset -> category index from ``synsetoffset2category.txt``, checked against the official table."""
        path = folder / "synsetoffset2category.txt"
        mapping = {}
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            fields = line.split()
            known = len(fields) == 2 and fields[0] in CATEGORY_NAMES
            if not known or SYNSETS[CATEGORY_NAMES.index(fields[0])] != fields[1]:
                raise UserError(
                    f"{path}, line {number}: expected '<Category><TAB><synset>' with one of the 16 official "
                    f"ShapeNetPart pairs (e.g. 'Airplane\\t02691156'), got {line.strip()[:80]!r}. {self._fix()}"
                )
            mapping[fields[1]] = CATEGORY_NAMES.index(fields[0])
        return mapping

    def _entries(self, folder: Path, split: str, synsets: dict[str, int]) -> list[tuple[str, int, Path]]:
        """(entry, category, txt path) of every entry of the split's JSON list, all checked."""
        path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}). {self._fix()}") from None
        if not isinstance(entries, list):
            raise UserError(f"{path}: expected a JSON list of 'shape_data/<synset>/<id>' entries. {self._fix()}")
        out = []
        for i, entry in enumerate(entries):
            match = ENTRY.fullmatch(entry) if isinstance(entry, str) else None
            if match is None:
                raise UserError(
                    f"{path}: entry {i} is {entry!r}, expected 'shape_data/<synset>/<id>'. {self._fix()}"
                )
            synset, shape_id = match.groups()
            if synset not in synsets:
                raise UserError(
                    f"{path}: entry {i} '{entry}' names synset {synset}, which is not a ShapeNetPart category "
                    f"of {folder / 'synsetoffset2category.txt'} (category id outside 0-{len(SYNSETS) - 1}). "
                    f"{self._fix()}"
                )
            out.append((entry, synsets[synset], folder / synset / f"{shape_id}.txt"))
        return out

    def _split(self, split: str, load: bool = True) -> PackedSource | None:
        """The split's shapes from the cache, (re)building it when missing or stale."""
        folder = self._check()
        entries = self._entries(folder, split, self._synsets(folder))
        json_path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
        stats = []
        for i, (entry, _, txt) in enumerate(entries):
            try:
                st = txt.stat()
            except OSError:
                raise UserError(
                    f"{json_path}: entry {i} '{entry}' refers to {txt}, which does not exist. {self._fix()}"
                ) from None
            stats.append((entry, st.st_size, st.st_mtime_ns))
        fingerprint = hashlib.sha256(json.dumps([CACHE_VERSION, split, stats]).encode()).hexdigest()
        cache = Path(self.root).expanduser() / "processed" / f"shapenet_part_{split}.npz"
        keys = ("points", "parts", "offsets", "categories") + (("normals",) if self.normals else ()) if load else ()
        arrays = read_cache(cache, fingerprint, keys)
        if arrays is None:
            log.info("Parsing %d ShapeNetPart %s files into %s (once).", len(entries), split, cache)
            arrays = self._parse(entries, split)
            write_cache(cache, fingerprint, arrays)
        if not load:
            return None
        return PackedSource(arrays["points"], arrays["parts"], arrays["offsets"], arrays["categories"],
                            arrays.get("normals") if self.normals else None)  # fmt: skip

    def _parse(self, entries: list[tuple[str, int, Path]], split: str) -> dict[str, np.ndarray]:
        if not entries:
            raise UserError(
                f"{self._folder() / 'train_test_split' / f'shuffled_{split}_file_list.json'} lists no shapes. "
                f"{self._fix()}"
            )
        rows = [_read_txt(txt, category, self._fix()) for _, category, txt in entries]  # (P, 7) float32 each
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        points, normals = np.empty((offsets[-1], 3), np.float32), np.empty((offsets[-1], 3), np.float32)
        parts = np.empty(offsets[-1], np.uint8)
        for lo, hi, r in zip(offsets[:-1], offsets[1:], rows):
            points[lo:hi] = unit_sphere(r[:, :3], [0, len(r)])
            normals[lo:hi], parts[lo:hi] = r[:, 3:6], r[:, 6]
        return {
            "points": points,
            "normals": normals,
            "parts": parts,
            "offsets": offsets,
            "categories": np.array([c for _, c, _ in entries], dtype=np.int64),
            "entries": np.array([e for e, _, _ in entries]),
        }

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        train, val, test = (self._split(split) for split in SPLITS)
        if self.trainval:
            return PackedSource.concat([train, val]), None, test
        return train, val, test


def _read_txt(path: Path, category: int, fix: str) -> np.ndarray:
    """Parse and check one shape file: (P, 7) float32 rows ``x y z nx ny nz part`` (coordinates as stored)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read as text ({err}). {fix}") from None
    lines = text.splitlines()
    fields = [line.split() for line in lines]
    numbers = [n for n, f in enumerate(fields, start=1) if f]  # line number of every non-blank line
    tokens = [tok for f in fields if f for tok in f]
    values = None
    if len(tokens) == 7 * len(numbers) and all(len(f) == 7 for f in fields if f):
        try:
            values = np.array(tokens, dtype=np.float64).reshape(-1, 7)
        except ValueError:
            pass
    if values is None:  # find the first bad line
        for number in numbers:
            row = fields[number - 1]
            try:
                ok = len(row) == 7 and [float(t) for t in row]
            except ValueError:
                ok = False
            if not ok:
                raise UserError(
                    f"{path}, line {number}: expected 7 numbers 'x y z nx ny nz part', got "
                    f"{lines[number - 1].strip()[:80]!r}. {fix}"
                )
    if len(values) == 0:
        raise UserError(f"{path} holds no points (expected rows 'x y z nx ny nz part'). {fix}")
    bad = np.flatnonzero(~np.isfinite(values[:, :6]).all(axis=1))
    if len(bad):
        raise UserError(f"{path}, line {numbers[bad[0]]}: NaN or infinite coordinates or normal. {fix}")
    lo, hi = _part_range(category)
    part = values[:, 6]
    bad = np.flatnonzero((part != np.round(part)) | (part < lo) | (part > hi))
    if len(bad):
        raise UserError(
            f"{path}, line {numbers[bad[0]]}: part label {part[bad[0]]:g} is outside the "
            f"{CATEGORY_NAMES[category]} range {lo}..{hi} (global ShapeNetPart part ids). {fix}"
        )
    return values.astype(np.float32)


# ---------------------------------------------------------------------------
# ShapeNetPartH5: the HDF5 release (no normals).


def _natural(path: Path):
    digits = re.findall(r"\d+", path.stem)
    return (int(digits[-1]) if digits else -1, path.name)


class ShapeNetPartH5(PartSegDataModule):
    """ShapeNetPart, HDF5 release (layout: module docstring), loaded into memory in :meth:`setup`.

    Args:
        root: folder containing ``shapenet_part_seg_hdf5_data/``, or that folder itself.
        npoints: points per sample out of the 2048 stored.
        normals: must be False (the release has none).
        trainval: train on train + val and validate on test.
        download, url, md5: as in :class:`ShapeNetPart`.
        batch_size, eval_batch_size, num_workers, augment, seed: see :class:`PartSegDataModule`.
    """

    def __init__(
        self,
        root: str,
        npoints: int = 2048,
        normals: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        seed: int = 0,
        trainval: bool = False,
        download: bool = False,
        url: str = H5_URL,
        md5: str | None = None,
    ):
        if normals:
            raise UserError(
                f"data.normals=true, but the ShapeNetPart HDF5 release ({H5_FOLDER}) stores no normals; "
                f"set data.normals=false, or use data=shapenet_part (the txt release, with normals)."
            )
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed)
        self.save_hyperparameters()
        self.trainval = bool(trainval)
        self.download = bool(download)
        self.url = url
        self.md5 = md5
        self._set_categories(CATEGORY_NAMES, CATEGORY_PARTS)

    def _folder(self) -> Path:
        """``root`` when it holds ``ply_data_*.h5``, else ``root/shapenet_part_seg_hdf5_data``, else
        ``root/hdf5_data`` (the folder the official zip unpacks to) when that one holds them."""
        root = Path(self.root).expanduser()
        for folder in (root, root / H5_FOLDER, root / H5_ZIP_FOLDER):
            if folder.is_dir() and any(folder.glob("ply_data_*.h5")):
                return folder
        return root / H5_FOLDER

    def _files(self) -> dict[str, list[Path]]:
        """The sorted files of every split; UserError when a split has none."""
        folder = self._folder()
        files = {split: sorted(folder.glob(f"ply_data_{split}*.h5"), key=_natural) for split in SPLITS}
        missing = [split for split, found in files.items() if not found]
        if missing:
            state = "does not exist" if not folder.is_dir() else f"has no ply_data_{missing[0]}*.h5 files"
            raise UserError(
                f"ShapeNetPart HDF5 data not found: {folder} {state}. Expected {H5_FOLDER}/ with "
                f"ply_data_train0.h5..ply_data_train5.h5, ply_data_val0.h5, ply_data_test0.h5 and "
                f"ply_data_test1.h5 under data.root={self.root} ({H5_ZIP_FOLDER}/, as the zip unpacks, works too). "
                f"Set data.download=true to fetch it ({self.url}), unzip {H5_FOLDER}.zip there by hand, or run "
                f"offline with data=parts."
            )
        return files

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        files = self._files()
        train, val, test = (PackedSource.concat([_load_part_h5(p) for p in files[s]]) for s in SPLITS)
        if self.trainval:
            return PackedSource.concat([train, val]), None, test
        return train, val, test


def _load_part_h5(path: Path) -> PackedSource:
    """Read and validate one file of the HDF5 release."""
    fix = (
        f"Replace {path.name} with the file from the official {H5_FOLDER}.zip "
        f"(or delete the folder and use data.download=true), or run offline with data=parts."
    )
    spec = {
        "data": ([("n", "points", 3)], "f"),
        "label": ([("n", 1), ("n",)], "iu"),
        "pid": ([("n", "points")], "iu"),
    }
    arrays = read_h5(path, spec, fix)
    points = np.asarray(arrays["data"], dtype=np.float32)  # (n, P, 3)
    categories = np.asarray(arrays["label"], dtype=np.int64).reshape(-1)  # (n,)
    pid = np.asarray(arrays["pid"], dtype=np.int64)  # (n, P)
    n, p = pid.shape
    if n == 0 or p == 0:
        raise UserError(f"{path} holds no points ('data' has shape {points.shape}). {fix}")
    bad = np.flatnonzero((categories < 0) | (categories >= len(CATEGORY_NAMES)))
    if len(bad):
        raise UserError(
            f"{path}: sample {bad[0]} has category label {categories[bad[0]]}, "
            f"expected 0..{len(CATEGORY_NAMES) - 1}. {fix}"
        )
    lo, hi = _part_bounds(categories)
    bad = np.argwhere((pid < lo[:, None]) | (pid > hi[:, None]))
    if len(bad):
        i, j = bad[0]
        raise UserError(
            f"{path}: sample {i}, point {j} has part label {pid[i, j]}, outside the "
            f"{CATEGORY_NAMES[categories[i]]} range {lo[i]}..{hi[i]} (category {categories[i]}). {fix}"
        )
    bad = np.argwhere(~np.isfinite(points).all(axis=2))
    if len(bad):
        raise UserError(f"{path}: sample {bad[0][0]}, point {bad[0][1]} has NaN or infinite coordinates. {fix}")
    return PackedSource(points.reshape(-1, 3), pid.reshape(-1).astype(np.uint8), np.arange(n + 1) * p, categories)


# ---------------------------------------------------------------------------
# ShapeNetPartPyG: the txt release through torch_geometric.datasets.ShapeNet.


class ShapeNetPartPyG(PartSegDataModule):
    """ShapeNetPart through ``torch_geometric.datasets.ShapeNet`` (all 16 categories).

    PyG processes ``<root>/raw`` once into ``<root>/processed/<cats>_{train,val,test,trainval}.pt``;
    its ``y`` are the global part ids and ``category`` the category index, as here.
    Points are normalised to the unit sphere like :class:`ShapeNetPart`. Nothing is ever
    downloaded: a missing or incomplete ``<root>/raw`` raises UserError first.

    Args:
        root: folder holding ``raw/`` (and, after processing, ``processed/``).
        npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed:
            see :class:`PartSegDataModule`.
        trainval: train on PyG's ``trainval`` split and validate on test.
    """

    def __init__(
        self,
        root: str,
        npoints: int = 2048,
        normals: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        augment: bool = True,
        seed: int = 0,
        trainval: bool = False,
    ):
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed)
        self.save_hyperparameters()
        self.trainval = bool(trainval)
        self._set_categories(CATEGORY_NAMES, CATEGORY_PARTS)

    def _check_raw(self) -> Path:
        """Check ``<root>/raw`` holds what PyG needs to process offline (else it would try to download)."""
        raw = Path(self.root).expanduser() / "raw"
        how = (
            f"Unzip {TXT_FOLDER}.zip ({TXT_URL}) and rename its {TXT_FOLDER} folder to {raw}, so that "
            f"{raw}/02691156/<id>.txt and {raw}/train_test_split/shuffled_train_file_list.json exist; or use "
            f"data=shapenet_part (same release, supports data.download=true) or data=parts offline."
        )
        needed = [raw / synset for synset in SYNSETS] + [
            raw / "train_test_split" / f"shuffled_{split}_file_list.json" for split in SPLITS
        ]
        missing = [str(p.relative_to(raw)) for p in needed if not p.exists()]
        if missing:
            state = "does not exist" if not raw.is_dir() else f"lacks {', '.join(missing[:4])}"
            more = f" (and {len(missing) - 4} more)" if raw.is_dir() and len(missing) > 4 else ""
            raise UserError(
                f"ShapeNetPart (PyG) raw data not found: {raw} {state}{more}; PyG needs all 16 synset "
                f"folders and the three split lists. {how}"
            )
        return raw

    def _dataset(self, split: str):
        from torch_geometric.datasets import ShapeNet

        raw = self._check_raw()
        try:
            return ShapeNet(str(raw.parent), categories=None, include_normals=self.normals, split=split)
        except (OSError, ValueError, IndexError, RuntimeError, KeyError, json.JSONDecodeError) as err:
            raise UserError(
                f"torch-geometric could not process the ShapeNetPart files under {raw} ({type(err).__name__}: "
                f"{err}). A split list or shape file is probably malformed or missing; restore the original "
                f"{TXT_FOLDER}.zip contents and delete {raw.parent / 'processed'} to reprocess."
            ) from None

    def prepare_data(self) -> None:
        """Process the raw files into ``<root>/processed`` (once; later runs load it)."""
        self._dataset("train")

    def _source(self, split: str) -> PackedSource:
        dataset = self._dataset(split)
        offsets = dataset.slices["pos"].numpy().astype(np.int64)
        categories = dataset.category.numpy().astype(np.int64).reshape(-1)
        pos = dataset.pos.numpy()
        parts = dataset.y.numpy()
        if (np.diff(offsets) < 1).any():
            raise UserError(f"A shape of the PyG {split} split under {self._check_raw()} has no points; "
                            f"restore the original files and delete {Path(self.root) / 'processed'}.")  # fmt: skip
        lo, hi = np.repeat(np.stack(_part_bounds(categories)), np.diff(offsets), axis=1)  # (T,) each
        bad = np.flatnonzero((parts < lo) | (parts > hi) | ~np.isfinite(pos).all(axis=1))
        if len(bad):
            shape = int(np.searchsorted(offsets, bad[0], side="right") - 1)
            c = categories[shape]
            raise UserError(
                f"{self._raw_file(split, shape)}, line {bad[0] - offsets[shape] + 1}: part label "
                f"{parts[bad[0]]} outside the {CATEGORY_NAMES[c]} range {_part_range(c)[0]}..{_part_range(c)[1]}, "
                f"or NaN/infinite coordinates (shape {shape} of PyG's {split} split). Restore the original "
                f"file and delete {Path(self.root) / 'processed'} to reprocess."
            )
        normals = dataset.x.numpy().astype(np.float32) if self.normals else None
        return PackedSource(unit_sphere(pos, offsets), parts.astype(np.uint8), offsets, categories, normals)

    def _raw_file(self, split: str, shape: int) -> Path | str:
        """The raw file PyG read as shape ``shape`` of ``split`` (PyG keeps the split lists' order)."""
        raw = self._check_raw()
        names = []
        for s in ("train", "val") if split == "trainval" else (split,):
            entries = json.loads((raw / "train_test_split" / f"shuffled_{s}_file_list.json").read_text())
            names += [e.split("/", 1)[1] + ".txt" for e in entries if e.split("/")[1] in SYNSETS]
        return raw / names[shape] if shape < len(names) else f"shape {shape} of {raw}"

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        if self.trainval:
            return self._source("trainval"), None, self._source("test")
        return self._source("train"), self._source("val"), self._source("test")
