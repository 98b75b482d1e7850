"""ShapeNetPart, the official txt release with normals (config ``shapenet_part``).

``root`` is the folder that contains the release or the release folder itself::

    <root>/shapenetcore_partanno_segmentation_benchmark_v0_normal/
        synsetoffset2category.txt            "Airplane<TAB>02691156", one category a line
        02691156/<id>.txt ...                one folder per synset; rows "x y z nx ny nz part"
        train_test_split/shuffled_{train,val,test}_file_list.json   ["shape_data/<synset>/<id>", ...]: disjoint,
                                             each shape once (a shape in two lists is refused)
    <root>/processed/shapenet_part_{train,val,test}.npz   parse cache, written once

Points are centred at their centroid and divided by their largest norm (the unit
sphere), before sampling. Parsing the ~17k txt files takes about two minutes (~7 ms
a file), once: the parsed split is cached (one float32 array of all points, one of normals, the
labels and per-shape offsets) and rebuilt automatically when the split list, a
file's size or modification time, or :data:`CACHE_VERSION` changes.

Validation: the official val split; ``trainval=True`` trains on train + val (as the
PCT / PointNet++ references do) and then validates on the test split. Categories, batches, point
sampling and augmentation: :mod:`datamodules.partseg.shapenet`, :mod:`datamodules.partseg.base`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import SPLITS, BadFiles, DataError, bool_option
from datamodules.cache import read_cache, write_cache
from datamodules.download import ReleaseMissing, ensure_release, how_to_get, read_lines
from datamodules.formats.shapenet_txt import read_shape_txt
from datamodules.partseg.base import PackedSource
from datamodules.partseg.shapenet import (CATEGORY_NAMES, SYNSETS, TXT_FOLDER, TXT_URL, ShapeNetPartModule,
                                          check_disjoint_lists, part_range, split_listing)
from datamodules.points.ops import unit_sphere

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the parsing or preprocessing of the txt release changes
ENTRY = re.compile(r"shape_data/([^/]+)/([^/]+)")


def _txt_layout(where: str, url: str, download: bool) -> str:
    return (
        f"Expected under data.root={where}:\n"
        f"  {TXT_FOLDER}/\n"
        f"    synsetoffset2category.txt\n"
        f"    02691156/<id>.txt ...  (16 synset folders; rows 'x y z nx ny nz part')\n"
        f"    train_test_split/shuffled_{{train,val,test}}_file_list.json\n"
        + how_to_get(download, url, f"{TXT_FOLDER}.zip", offline="parts")
    )


class ShapeNetPart(ShapeNetPartModule):
    """ShapeNetPart, official txt release with normals (layout, caching: module docstring).

    Args:
        root: folder containing the release folder, or the release folder itself;
            the parse cache goes to ``<root>/processed`` (to the user's cache folder, with a warning, when
            ``root`` cannot be written: :func:`datamodules.cache.write_cache`).
        download: in :meth:`prepare_data`, fetch ``url`` into ``root`` when the release is missing.
        url: where to download the release zip from.
        md5: expected md5 of the zip (None: only check that it is a valid zip).
        options: those of :class:`~datamodules.partseg.shapenet.ShapeNetPartModule` (shapes have ~2.6k
            points, 500 to 3k; ``normals``: the release's); with ``on_bad_file="skip"`` a split-list
            entry that is malformed, names an unknown synset or a missing file, and a shape file that
            is unreadable, has a bad line, NaN / infinite values or a part label outside its
            category's range, are dropped.
    """

    def __init__(self, root: str, download: bool = False, url: str = TXT_URL, md5: str | None = None, **options):
        super().__init__(root, **options)
        self.download = bool_option("download", download)
        self.url = url
        self.md5 = md5

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
                raise ReleaseMissing(f"ShapeNetPart data not found: {path} does not exist. "
                                     + _txt_layout(self.root, self.url, self.download))
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
        lines = read_lines(path, "one '<Category><TAB><synset>' pair a line", self._fix())
        for number, line in enumerate(lines, start=1):
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

    def _entries(self, folder: Path, split: str, synsets: dict[str, int], bad: BadFiles
                 ) -> list[tuple[str, int, Path]]:  # fmt: skip
        """(entry, category, txt path) of every good entry of the split's JSON list; a malformed
        entry, an unknown synset or a missing shape file goes to ``bad``."""
        path, entries = split_listing(folder, split, self._fix())
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
        bad = self.bad if load else BadFiles(self.on_bad_file)  # prepare_data: nothing is recorded
        json_path = folder / "train_test_split" / f"shuffled_{split}_file_list.json"
        check_disjoint_lists(folder, self._fix())
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

    def _parse(self, entries: list[tuple[str, int, Path]], json_path: Path, bad: BadFiles) -> dict[str, np.ndarray]:
        shapes, kept, skipped = [], [], []
        for entry, category, txt in entries:
            try:
                # (P, 7) float64 rows x y z nx ny nz part
                values = read_shape_txt(txt, CATEGORY_NAMES[category], part_range(category), self._fix())
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
