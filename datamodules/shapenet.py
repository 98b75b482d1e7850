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
from datamodules.points import (
    BadData,
    DataError,
    PointCloudDataModule,
    pyg_offsets,
    read_h5,
    sample_rng,
    scale_shift,
    warn_skipped,
)

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
CACHE_VERSION = 2  # bump when the parsing or preprocessing of the txt release changes
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

    A shape whose points all coincide is only centred. Every shape needs >= 1 point. The
    arithmetic is done in float64 when ``points`` is float64 (then any finite input gives a
    finite result), else in float32 (huge coordinates may then overflow: callers check).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    counts, starts = np.diff(offsets), offsets[:-1]  # (n,) each
    dtype = np.float64 if np.asarray(points).dtype == np.float64 else np.float32
    pts = np.asarray(points, dtype=dtype)
    centroid = np.add.reduceat(pts, starts, axis=0, dtype=np.float64) / counts[:, None]  # (n, 3)
    with np.errstate(over="ignore", invalid="ignore"):
        centred = pts - np.repeat(centroid.astype(dtype), counts, axis=0)  # (T, 3)
        scale = np.maximum.reduceat(np.abs(centred).max(axis=1), starts)  # (n,), keeps the norms in range
        scale[scale == 0] = 1.0
        centred /= np.repeat(scale, counts)[:, None]
        radius = np.maximum.reduceat(np.linalg.norm(centred, axis=1), starts)  # (n,)
        radius[radius == 0] = 1.0
        centred /= np.repeat(radius, counts)[:, None]
    return centred.astype(np.float32, copy=False)


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
        batch_size, eval_batch_size, num_workers, augment, seed, on_bad_file: as in
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
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, batch_size, eval_batch_size, num_workers, augment, 0.0, seed, on_bad_file)
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
        self.skipped = []
        train, val, test = self._load()
        warn_skipped(type(self).__name__, self.skipped)
        for split, source in (("train", train), ("val", val), ("test", test)):
            if source is not None and len(source) == 0:
                raise UserError(
                    f"The {type(self).__name__} {split} split has no usable shapes (data.root={self.root}"
                    f"{f', {len(self.skipped)} bad files or samples skipped' if self.skipped else ''}); "
                    f"restore the dataset files, or run offline with data=parts."
                )
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
        on_bad_file: ``"error"``, or ``"skip"``: a split-list entry that is malformed, names an
            unknown synset or a missing file, and a shape file that is unreadable, has a bad line,
            NaN / infinite values or a part label outside its category's range, are dropped.
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
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed,
                         on_bad_file)  # fmt: skip
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

    def _entries(self, folder: Path, split: str, synsets: dict[str, int], bad: BadData
                 ) -> list[tuple[str, int, Path]]:  # fmt: skip
        """(entry, category, txt path) of every good entry of the split's JSON list; a malformed
        entry, an unknown synset or a missing shape file goes to ``bad``."""
        path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}). {self._fix()}") from None
        except (OSError, UnicodeDecodeError, RecursionError) as err:
            raise UserError(
                f"{path} cannot be read as a JSON text file ({type(err).__name__}). {self._fix()}"
            ) from None
        if not isinstance(entries, list):
            raise UserError(f"{path}: expected a JSON list of 'shape_data/<synset>/<id>' entries. {self._fix()}")
        out = []
        for i, entry in enumerate(entries):
            match = ENTRY.fullmatch(entry) if isinstance(entry, str) else None
            if match is None:
                bad.file(DataError(f"{path}: entry {i} is {entry!r:.80}, expected 'shape_data/<synset>/<id>'. "
                                   f"{self._fix()}", f"{path}[{i}]: malformed entry {entry!r:.80}"))  # fmt: skip
                continue
            synset, shape_id = match.groups()
            if synset not in synsets:
                bad.file(DataError(
                    f"{path}: entry {i} '{entry}' names synset {synset}, which is not a ShapeNetPart category "
                    f"of {folder / 'synsetoffset2category.txt'} (category id outside 0-{len(SYNSETS) - 1}). "
                    f"{self._fix()}", f"{path}[{i}]: unknown synset {synset} in '{entry}'"))  # fmt: skip
                continue
            txt = folder / synset / f"{shape_id}.txt"
            if not txt.is_file():
                bad.file(DataError(f"{path}: entry {i} '{entry}' refers to {txt}, which does not exist. {self._fix()}",
                                   f"{txt}: missing (entry {i} of {path.name})"))  # fmt: skip
                continue
            out.append((entry, synsets[synset], txt))
        return out

    def _split(self, split: str, load: bool = True) -> PackedSource | None:
        """The split's shapes from the cache, (re)building it when missing or stale. Bad entries and
        shapes raise, or with ``on_bad_file=skip`` are dropped (recorded in ``skipped`` when ``load``)."""
        folder = self._check()
        bad = BadData(self.on_bad_file, self.skipped if load else [])
        json_path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
        entries = self._entries(folder, split, self._synsets(folder), bad)
        if not entries:
            why = f"all {len(bad.skipped)} entries are bad (data.on_bad_file=skip)" if bad.skipped else "it lists none"
            raise UserError(f"No usable shapes in {json_path}: {why}. {self._fix()}")
        stats = []
        for entry, _, txt in entries:
            st = txt.stat()
            stats.append((entry, st.st_size, st.st_mtime_ns))
        fingerprint = hashlib.sha256(json.dumps([CACHE_VERSION, split, stats]).encode()).hexdigest()
        cache = Path(self.root).expanduser() / "processed" / f"shapenet_part_{split}.npz"
        keys = ("points", "parts", "offsets", "categories", "skipped", "skipped_messages") + (
            ("normals",) if self.normals else ()) if load else ()  # fmt: skip
        arrays = read_cache(cache, fingerprint, keys)
        if arrays is None:
            log.info("Parsing %d ShapeNetPart %s files into %s (once).", len(entries), split, cache)
            arrays = self._parse(entries, json_path, bad)
            write_cache(cache, fingerprint, arrays)
        elif load:  # shapes the cache was built without (on_bad_file=skip then): the same policy now
            for entry, message in zip(arrays["skipped"], arrays["skipped_messages"]):
                bad.file(DataError(str(message), str(entry)))
        if not load:
            return None
        return PackedSource(arrays["points"], arrays["parts"], arrays["offsets"], arrays["categories"],
                            arrays.get("normals") if self.normals else None)  # fmt: skip

    def _parse(self, entries: list[tuple[str, int, Path]], json_path: Path, bad: BadData) -> dict[str, np.ndarray]:
        shapes, kept, skipped = [], [], []
        for entry, category, txt in entries:
            try:
                values = _read_txt(txt, category, self._fix())  # (P, 7) float64
                points = unit_sphere(values[:, :3], [0, len(values)])  # (P, 3) float32, finite
            except DataError as err:
                bad.file(err)  # raises with on_bad_file=error
                skipped.append((err.entry, str(err)))
                continue
            shapes.append((points, values[:, 3:6].astype(np.float32), values[:, 6].astype(np.uint8)))
            kept.append((entry, category))
        if not shapes:
            raise UserError(
                f"No usable shapes in {json_path}: all {len(skipped)} shape files are bad (data.on_bad_file=skip). "
                f"{self._fix()}"
            )
        offsets = np.concatenate([[0], np.cumsum([len(p) for p, _, _ in shapes])]).astype(np.int64)
        return {
            "points": np.concatenate([p for p, _, _ in shapes]),
            "normals": np.concatenate([n for _, n, _ in shapes]),
            "parts": np.concatenate([q for _, _, q in shapes]),
            "offsets": offsets,
            "categories": np.array([c for _, c in kept], dtype=np.int64),
            "entries": np.array([e for e, _ in kept]),
            "skipped": np.array([e for e, _ in skipped], dtype=str),
            "skipped_messages": np.array([m for _, m in skipped], dtype=str),
        }

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        train, val, test = (self._split(split) for split in SPLITS)
        if self.trainval:
            return PackedSource.concat([train, val]), None, test
        return train, val, test


def _read_txt(path: Path, category: int, fix: str) -> np.ndarray:
    """Parse and check one shape file: (P, 7) float64 rows ``x y z nx ny nz part`` (coordinates as
    stored); every problem is a :class:`~datamodules.points.DataError` naming the file and line."""
    def bad(where: str, what: str) -> DataError:
        return DataError(f"{path}{where}: {what}. {fix}", f"{path}{where}: {what}")

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise bad("", f"cannot be read as text ({type(err).__name__}: {err})") from None
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
                raise bad(f", line {number}", f"expected 7 numbers 'x y z nx ny nz part', got "
                                              f"{lines[number - 1].strip()[:80]!r}")  # fmt: skip
        raise bad("", "cannot be parsed as rows of 7 numbers")  # unreachable: some line failed above
    if len(values) == 0:
        raise bad("", "holds no points (expected rows 'x y z nx ny nz part')")
    with np.errstate(over="ignore"):
        finite = np.isfinite(values[:, :3]).all(axis=1) & np.isfinite(values[:, 3:6].astype(np.float32)).all(axis=1)
    bad_rows = np.flatnonzero(~finite)
    if len(bad_rows):
        raise bad(f", line {numbers[bad_rows[0]]}", "NaN or infinite coordinates or normal")
    lo, hi = _part_range(category)
    part = values[:, 6]
    bad_rows = np.flatnonzero((part != np.round(part)) | (part < lo) | (part > hi))
    if len(bad_rows):
        raise bad(f", line {numbers[bad_rows[0]]}", f"part label {part[bad_rows[0]]:g} is outside the "
                  f"{CATEGORY_NAMES[category]} range {lo}..{hi} (global ShapeNetPart part ids)")  # fmt: skip
    return values


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
        on_bad_file: ``"error"``, or ``"skip"``: an unreadable or malformed file is dropped whole,
            a sample with a bad category, a bad part label or NaN / infinite coordinates alone.
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
        on_bad_file: str = "error",
    ):
        if normals:
            raise UserError(
                f"data.normals=true, but the ShapeNetPart HDF5 release ({H5_FOLDER}) stores no normals; "
                f"set data.normals=false, or use data=shapenet_part (the txt release, with normals)."
            )
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed,
                         on_bad_file)  # fmt: skip
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
        train, val, test = (PackedSource.concat([_load_part_h5(p, self.bad) for p in files[s]]) for s in SPLITS)
        if self.trainval:
            return PackedSource.concat([train, val]), None, test
        return train, val, test


def _load_part_h5(path: Path, bad: BadData) -> PackedSource:
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
    lo, hi = _part_bounds(categories)  # (n,) each
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
        on_bad_file: ``"error"``, or ``"skip"``: shapes with a part label outside their category's
            range or NaN / infinite values are dropped. A file torch-geometric cannot parse at all
            stops processing either way.
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
        on_bad_file: str = "error",
    ):
        super().__init__(root, npoints, normals, batch_size, eval_batch_size, num_workers, augment, seed,
                         on_bad_file)  # fmt: skip
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
        offsets = pyg_offsets(dataset, "pos").numpy().astype(np.int64)
        data = dataset._data  # the collated storage (attribute access on a one-shape dataset gives that shape)
        categories = torch.as_tensor(data.category).numpy().astype(np.int64).reshape(-1)  # an int for one shape
        pos = data.pos.numpy()
        parts = data.y.numpy()
        normals = data.x.numpy().astype(np.float32) if self.normals else None
        counts = np.diff(offsets)
        if (counts < 1).any():
            raise UserError(f"A shape of the PyG {split} split under {self._check_raw()} has no points; "
                            f"restore the original files and delete {Path(self.root) / 'processed'}.")  # fmt: skip
        lo, hi = np.repeat(np.stack(_part_bounds(categories)), counts, axis=1)  # (T,) each
        unit = unit_sphere(pos, offsets)  # (T, 3) float32; huge coordinates may overflow: checked
        finite = np.isfinite(pos).all(axis=1) & np.isfinite(unit).all(axis=1)
        if normals is not None:
            finite &= np.isfinite(normals).all(axis=1)
        bad_row = (parts < lo) | (parts > hi) | ~finite  # (T,)
        shape_of = np.repeat(np.arange(len(counts)), counts)  # (T,)
        bad_shape = np.bincount(shape_of[bad_row], minlength=len(counts)) > 0  # (n,)
        fix = f"Restore the original file and delete {Path(self.root) / 'processed'} to reprocess."
        for shape in np.flatnonzero(bad_shape):
            row = int(np.flatnonzero(bad_row[offsets[shape] : offsets[shape + 1]])[0])
            c, at = categories[shape], offsets[shape] + row
            what = (f"part label {parts[at]} outside the {CATEGORY_NAMES[c]} range "
                    f"{_part_range(c)[0]}..{_part_range(c)[1]}" if finite[at] else "NaN, infinite or too large values")
            where = f"{self._raw_file(split, int(shape))}, line {row + 1}"
            self.bad.file(DataError(f"{where}: {what} (shape {shape} of PyG's {split} split). {fix}",
                                    f"{where}: {what}"))  # fmt: skip
        keep = np.repeat(~bad_shape, counts)  # (T,)
        new_offsets = np.concatenate([[0], np.cumsum(counts[~bad_shape])]).astype(np.int64)
        return PackedSource(unit[keep], parts[keep].astype(np.uint8), new_offsets, categories[~bad_shape],
                            None if normals is None else normals[keep])  # fmt: skip

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
