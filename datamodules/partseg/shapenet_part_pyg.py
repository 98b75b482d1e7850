"""ShapeNetPart, the txt release read by ``torch_geometric.datasets.ShapeNet`` (config ``shapenet_part_pyg``).

PyG processes ``<root>/raw`` into ``<root>/processed``, once and again when the raw files change (points
normalised to the unit sphere like :mod:`datamodules.partseg.shapenet_part`)::

    <root>/raw/   the release folder, renamed: 16 synset folders and train_test_split/

Categories, batches, point sampling and augmentation: :mod:`datamodules.partseg.shapenet`,
:mod:`datamodules.partseg.base`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from attention.errors import UserError
from datamodules.base import SPLITS, DataError
from datamodules.formats.pyg import PyGRaw, pyg_offsets
from datamodules.partseg.base import PackedSource
from datamodules.partseg.shapenet import (CATEGORY_NAMES, SYNSETS, TXT_FOLDER, TXT_URL, ShapeNetPartModule,
                                          check_disjoint_lists, part_bounds, part_range)
from datamodules.points.ops import unit_sphere


class ShapeNetPartPyG(PyGRaw, ShapeNetPartModule):
    """ShapeNetPart through ``torch_geometric.datasets.ShapeNet`` (all 16 categories).

    PyG processes ``<root>/raw`` into ``<root>/processed/<cats>_{train,val,test,trainval}.pt`` (again when
    the raw files change);
    its ``y`` are the global part ids and ``category`` the category index, as here.
    Points are normalised to the unit sphere like :class:`ShapeNetPart`. Nothing is ever
    downloaded: a missing or incomplete ``<root>/raw`` raises UserError first.

    Args:
        root: folder holding ``raw/`` (and, after processing, ``processed/``).
        trainval: train on PyG's ``trainval`` split and validate on test.
        options: those of :class:`~datamodules.partseg.shapenet.ShapeNetPartModule`; with
            ``on_bad_file="skip"`` shapes with a part label outside their category's range or NaN /
            infinite values are dropped. A file torch-geometric cannot parse at all stops processing
            either way.
    """

    raw_what = "ShapeNetPart files"
    raw_archive = f"{TXT_FOLDER}.zip"
    raw_cause = "A split list or shape file is probably malformed or missing"
    raw_how = (f"Unzip {TXT_FOLDER}.zip ({TXT_URL}) and rename its {TXT_FOLDER} folder to {{raw}}, so that "
               "{raw}/02691156/<id>.txt and {raw}/train_test_split/shuffled_train_file_list.json exist; or use "
               "data=shapenet_part (same release, supports data.download=true) or data=parts offline.")

    def _raw_problem(self, raw: Path) -> str | None:
        """PyG needs all 16 synset folders and the three split lists in ``raw``."""
        needed = [raw / synset for synset in SYNSETS] + [
            raw / "train_test_split" / f"shuffled_{split}_file_list.json" for split in SPLITS
        ]
        missing = [str(p.relative_to(raw)) for p in needed if not p.exists()]
        if not missing:
            return None
        state = "does not exist" if not raw.is_dir() else f"lacks {', '.join(missing[:4])}"
        more = f" (and {len(missing) - 4} more)" if raw.is_dir() and len(missing) > 4 else ""
        return (f"ShapeNetPart (PyG) raw data not found: {raw} {state}{more}; PyG needs all 16 synset "
                f"folders and the three split lists.")

    def _dataset(self, split: str):
        from torch_geometric.datasets import ShapeNet

        # PyG reads the release's split lists as they are: lists sharing shapes would train on test shapes
        check_disjoint_lists(self._check_raw(), f"Restore the lists from the official {TXT_FOLDER}.zip.")
        # include_normals only drops columns when loading: the processed files are the same either way.
        return self._process(lambda root: ShapeNet(root, categories=None, include_normals=self.normals, split=split),
                             "ShapeNet categories=all")

    def prepare_data(self) -> None:
        """Process the raw files into ``<root>/processed`` (when missing or stale; later runs load it)."""
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
                            "restore the original files (the next run processes them again).")
        lo, hi = np.repeat(np.stack(part_bounds(categories)), counts, axis=1)  # (T,) each
        unit = unit_sphere(pos, offsets)  # (T, 3) float32; huge coordinates may overflow: checked
        finite = np.isfinite(pos).all(axis=1) & np.isfinite(unit).all(axis=1)
        if normals is not None:
            finite &= np.isfinite(normals).all(axis=1)
        bad_row = (parts < lo) | (parts > hi) | ~finite  # (T,)
        shape_of = np.repeat(np.arange(len(counts)), counts)  # (T,)
        bad_shape = np.bincount(shape_of[bad_row], minlength=len(counts)) > 0  # (n,)
        fix = "Restore the original file (the next run processes the changed raw files again)."
        for shape in np.flatnonzero(bad_shape):
            row = int(np.flatnonzero(bad_row[offsets[shape] : offsets[shape + 1]])[0])
            c, at = categories[shape], offsets[shape] + row
            what = (f"part label {parts[at]} outside the {CATEGORY_NAMES[c]} range "
                    f"{part_range(c)[0]}..{part_range(c)[1]}" if finite[at] else "NaN, infinite or too large values")
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
