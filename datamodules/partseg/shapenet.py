"""What the three ShapeNetPart modules share: the 16 categories, their part ranges and where the releases live.

16 categories, 50 parts; category index = position in the official ``synsetoffset2category.txt``
(sorted by name), part ids are global and each category owns a contiguous range (:data:`CATEGORY_PARTS`:
Airplane 0-3, Bag 4-5, Cap 6-7, Car 8-11, Chair 12-15, Earphone 16-18, Guitar 19-21, Knife 22-23,
Lamp 24-27, Laptop 28-29, Motorbike 30-35, Mug 36-37, Pistol 38-40, Rocket 41-43, Skateboard 44-46,
Table 47-49). The releases, each a :class:`ShapeNetPartModule`: the txt release with normals
(:mod:`datamodules.partseg.shapenet_part`), the HDF5 release (:mod:`~datamodules.partseg.shapenet_part_h5`)
and the txt release read by torch-geometric (:mod:`~datamodules.partseg.shapenet_part_pyg`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import SPLITS, bool_option, describe
from datamodules.partseg.base import PartSegDataModule, contiguous_parts

# (name, synset, number of parts), in the official synsetoffset2category.txt order.
SHAPENET_CATEGORIES = [
    ("Airplane", "02691156", 4), ("Bag", "02773838", 2), ("Cap", "02954340", 2), ("Car", "02958343", 4),
    ("Chair", "03001627", 4), ("Earphone", "03261776", 3), ("Guitar", "03467517", 3), ("Knife", "03624134", 2),
    ("Lamp", "03636649", 4), ("Laptop", "03642806", 2), ("Motorbike", "03790512", 6), ("Mug", "03797390", 2),
    ("Pistol", "03948459", 3), ("Rocket", "04099429", 3), ("Skateboard", "04225987", 3), ("Table", "04379243", 3),
]  # fmt: skip
CATEGORY_NAMES = [name for name, _, _ in SHAPENET_CATEGORIES]
SYNSETS = [synset for _, synset, _ in SHAPENET_CATEGORIES]
CATEGORY_PARTS = contiguous_parts([n for _, _, n in SHAPENET_CATEGORIES])
NUM_PARTS = 50

TXT_FOLDER = "shapenetcore_partanno_segmentation_benchmark_v0_normal"
TXT_URL = f"https://shapenet.cs.stanford.edu/media/{TXT_FOLDER}.zip"
H5_FOLDER = "shapenet_part_seg_hdf5_data"
H5_URL = f"https://shapenet.cs.stanford.edu/media/{H5_FOLDER}.zip"
H5_ZIP_FOLDER = "hdf5_data"  # what the official shapenet_part_seg_hdf5_data.zip unpacks to


def split_listing(folder: Path, split: str, fix: str) -> tuple[Path, list]:
    """The release's JSON list of a split's shapes (``<folder>/train_test_split/shuffled_<split>_file_list.json``)
    and its entries, as stored; UserError naming the file when it is not a JSON list (``fix``: how to restore it)."""
    path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}). {fix}") from None
    except (OSError, UnicodeDecodeError, RecursionError) as err:
        raise UserError(f"{path} cannot be read as a JSON text file ({type(err).__name__}). {fix}") from None
    if not isinstance(entries, list):
        raise UserError(f"{path}: expected a JSON list of 'shape_data/<synset>/<id>' entries. {fix}")
    return path, entries


def check_disjoint_lists(folder: Path, fix: str) -> None:
    """UserError when a split list of the release in ``folder`` names a shape twice or two lists share a shape: a
    shape of the test (or val) list that the train list names too is trained on and then scored, silently."""
    listings = {split: split_listing(folder, split, fix) for split in SPLITS}
    named = {}
    for split, (path, entries) in listings.items():
        entries = [e for e in entries if isinstance(e, str)]  # malformed ones are the entry checks' business
        repeated = [e for e, count in Counter(entries).items() if count > 1]
        if repeated:
            raise UserError(f"{path} names {len(repeated)} shape(s) more than once: {describe(repeated)}. Each shape "
                            f"must be listed once (a repeated one weighs twice): remove the repeated entries. {fix}")
        named[split] = set(entries)
    for i, first in enumerate(SPLITS):
        for second in list(SPLITS)[i + 1:]:
            shared = [e for e in listings[first][1] if isinstance(e, str) and e in named[second]]
            if shared:
                raise UserError(
                    f"{listings[first][0]} and {listings[second][0]} share {len(shared)} shape(s): "
                    f"{describe(shared)}. The train, val and test lists must be disjoint, else the same shapes are "
                    f"trained on and scored. Remove each shape from the list of the split it does not belong to "
                    f"(the official lists are disjoint). {fix}")


def part_range(category: int) -> tuple[int, int]:
    """Lowest and highest global part id of category index ``category``."""
    parts = CATEGORY_PARTS[category]
    return parts[0], parts[-1]


def part_bounds(categories: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest allowed global part id of each category index, (n,) each."""
    table = np.array([part_range(c) for c in range(len(CATEGORY_PARTS))])
    return table[categories, 0], table[categories, 1]


class ShapeNetPartModule(PartSegDataModule):
    """A ShapeNetPart release: all 16 categories, and the choice of training split.

    Args:
        root: where the release is (see the subclass).
        trainval: train on train + val (as the PCT / PointNet++ references do) and validate on test.
        options: those of :class:`~datamodules.partseg.base.PartSegDataModule`.
    """

    def __init__(self, root: str, trainval: bool = False, **options):
        super().__init__(root, **options)
        self.trainval = bool_option("trainval", trainval)
        self._set_categories(CATEGORY_NAMES, CATEGORY_PARTS)
