"""GID-15 (Gaofen Image Dataset, fine land-cover classification): large tiles cut into cached patches."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import DataError, int_option
from datamodules.cache import cache_exists, read_cache, write_cache
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.files import (files_in_the_way, find_folder, header_size, large_images, read_image,
                                            root_state, visible_files)
from datamodules.segmentation.labels import IGNORE_INDEX
from datamodules.segmentation.sources import ArraySource

log = logging.getLogger(__name__)

GID_CLASSES = [
    "industrial land", "urban residential", "rural residential", "traffic land", "paddy field",
    "irrigated land", "dry cropland", "garden plot", "arbor woodland", "shrub land", "natural grassland",
    "artificial grassland", "river", "lake", "pond",
]  # fmt: skip
GID_PALETTE = np.array([
    (200, 0, 0), (250, 0, 150), (200, 150, 150), (250, 150, 150), (0, 200, 0), (150, 250, 0), (150, 200, 150),
    (200, 0, 200), (150, 0, 250), (150, 150, 250), (250, 200, 0), (200, 200, 0), (0, 0, 200), (0, 150, 200),
    (0, 200, 250),
], dtype=np.uint8)  # fmt: skip  (label colours; black (0, 0, 0) = unlabelled, ignored)
GID_LAYOUTS = ("GID/Fine_Image_Dataset", "GID")  # under root, each with image_RGB/ and label_15classes/
GID_SUFFIXES = (".tif", ".tiff", ".png")
GID_UNKNOWN = 254  # marks a colour that is no class (never a valid index: 15 classes)
GID_CACHE_VERSION = 1
GID_LAYOUT = (
    "<root>/GID/Fine_Image_Dataset/image_RGB/<stem>.tif with <root>/GID/Fine_Image_Dataset/label_15classes/"
    "<stem>_label.tif (RGB colour labels; .png also accepted), or the same two folders directly in <root>/GID/"
)
GID_SOURCE = (
    "Get the fine land-cover classification set (15 classes) of GID from https://x-ytong.github.io/project/GID.html "
    "and put its image_RGB/ and label_15classes/ folders there."
)


def _colour_table() -> np.ndarray:
    """uint8 (2**24,): packed RGB -> class index, 255 for black, GID_UNKNOWN otherwise."""
    table = np.full(1 << 24, GID_UNKNOWN, np.uint8)
    for index, (r, g, b) in enumerate(GID_PALETTE.astype(np.int64)):
        table[(r << 16) | (g << 8) | b] = index
    table[0] = IGNORE_INDEX
    return table


def gid_colours_to_index(label: np.ndarray, path: Path, rows: int = 256) -> np.ndarray:
    """Class indices uint8 (H, W) of an RGB label uint8 (H, W, 3) (black -> 255), ``rows`` rows at a
    time to bound memory; UserError naming ``path`` and the colour for any other colour."""
    table = _colour_table()
    out = np.empty(label.shape[:2], np.uint8)
    for top in range(0, label.shape[0], rows):
        band = label[top : top + rows].astype(np.int32)
        out[top : top + rows] = table[(band[..., 0] << 16) | (band[..., 1] << 8) | band[..., 2]]
        unknown = np.argwhere(out[top : top + rows] == GID_UNKNOWN)
        if len(unknown):
            r, c = unknown[0]
            colour = tuple(int(v) for v in label[top + r, c])
            raise UserError(
                f"{path} has colour {colour} at row {top + r}, column {c} ({len(unknown)} such pixels in rows "
                f"{top}..{top + band.shape[0] - 1}), which is none of the 15 GID class colours nor black "
                f"(0, 0, 0, unlabelled); expected an RGB label of label_15classes (lossless .tif or .png)."
            )
    return out


def _gid_split(n: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded 60/20/20 split of range(n) into sorted index arrays (val and test round(0.2 n) each)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = n_test = round(0.2 * n)
    parts = {"val": perm[:n_val], "test": perm[n_val : n_val + n_test], "train": perm[n_val + n_test :]}
    return {split: np.sort(idx) for split, idx in parts.items()}


class GID(SegDataModule):
    """GID-15, fine land-cover classification (15 classes), config ``gid``::

        <root>/GID/Fine_Image_Dataset/         (or the two folders directly in <root>/GID/)
            image_RGB/<stem>.tif                    large RGB tiles (6800 x 7200)
            label_15classes/<stem>_label.tif        RGB colour labels (.png also accepted)
        <root>/GID/processed/patches_<patch>_<fingerprint>.npz   the patch cache (written here; in the user's cache
                                                 folder when <root> cannot be written: datamodules.cache)

    Label colours map to the classes in :data:`GID_CLASSES` order (colours in
    ``palette``); black is unlabelled (255, ignored); any other colour is an error.
    Each tile is cut into non-overlapping ``patch`` x ``patch`` patches, row-major,
    the right / bottom remainders dropped. The patches are decoded once and cached
    as uint8 arrays (images (N, P, P, 3), masks (N, P, P)) in the npz named by a
    fingerprint of the tile file names, sizes and mtimes (so a changed tile gives
    a new cache; stale ones are deleted), written atomically; the whole cache is
    held in memory (about 2 GB for the 10 tiles of GID-15 at patch 256). The patches
    are then split 60/20/20 into train / val / test by a permutation seeded with
    ``split_seed`` (patches of one tile land in every split).

    After setup, ``tile_names`` lists the tiles (sorted by stem) and ``patch_origin``
    int32 (N, 3) gives (tile, patch row, patch column) of every cached patch; a split's
    ``source.indices`` index it.

    Every tile is decoded in setup (or in :meth:`prepare_data` on rank 0), so all
    bad-file problems (unpaired, unreadable, sizes differ, unknown colour) are setup
    problems: ``on_bad_file=skip`` drops the tile. The cache records skipped tiles;
    loading it with ``on_bad_file=error`` raises for them again.

    Args:
        root: see above.
        patch: patch side P.
        split_seed: seed of the 60/20/20 split.
        crop: the training crop (256 here, the patch side).
        options: the others, see :class:`SegDataModule`.
    """

    name = "gid"
    class_names = GID_CLASSES
    palette = GID_PALETTE

    def __init__(self, root: str, patch: int = 256, split_seed: int = 0, *, crop: int | Sequence[int] = 256,
                 **options):  # fmt: skip
        super().__init__(root, crop=crop, **options)
        self.patch = int_option("patch", patch, 8, 256)
        self.split_seed = int_option("split_seed", split_seed, 0, 0)
        self._cache: tuple[Path, str, list[tuple[Path, Path]]] | None = None

    def _check(self) -> Path:
        root = Path(self.root).expanduser()
        candidates, required = [root / layout for layout in GID_LAYOUTS], ["image_RGB", "label_15classes"]
        folder = find_folder(candidates, required)
        if folder is None:
            raise UserError(
                f"GID-15 not found: data.root={root} {root_state(root)}{files_in_the_way(candidates, required)}. "
                f"Accepted layouts: {GID_LAYOUT}. {GID_SOURCE}"
            )
        return folder

    def _pairs(self, folder: Path) -> list[tuple[Path, Path]]:
        images = {p.stem: p for p in visible_files(folder / "image_RGB", GID_SUFFIXES)}
        labels = {p.stem[: -len("_label")]: p for p in visible_files(folder / "label_15classes", GID_SUFFIXES)
                  if p.stem.endswith("_label")}  # fmt: skip
        problems = [(images[s], f"image without label: label_15classes/{s}_label.tif (or .png) does not exist")
                    for s in sorted(images.keys() - labels.keys())]  # fmt: skip
        problems += [(labels[s], f"label without image: image_RGB/{s}.tif (or .png) does not exist")
                     for s in sorted(labels.keys() - images.keys())]  # fmt: skip
        self._drop(problems, "Restore the missing files from the GID release, or delete the unpaired ones.")
        pairs = [(images[s], labels[s]) for s in sorted(images.keys() & labels.keys())]
        if not pairs:
            raise UserError(
                f"{folder} holds no tile / label pairs. Accepted layouts: {GID_LAYOUT}. {GID_SOURCE}"
            )
        return pairs

    def _fingerprint(self, folder: Path, pairs: list[tuple[Path, Path]]) -> str:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"gid-v{GID_CACHE_VERSION}-patch{self.patch}\n".encode())
        for paths in pairs:
            for p in paths:
                st = p.stat()
                digest.update(f"{p.relative_to(folder)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        return digest.hexdigest()[:16]

    def _cache_path(self) -> tuple[Path, str, list[tuple[Path, Path]]]:
        """(cache file, fingerprint, tile / label pairs), worked out once per instance (prepare_data, setup)."""
        if self._cache is None:
            folder = self._check()
            pairs = self._pairs(folder)
            fingerprint = self._fingerprint(folder, pairs)
            path = Path(self.root).expanduser() / "GID" / "processed" / f"patches_{self.patch}_{fingerprint}.npz"
            self._cache = path, fingerprint, pairs
        return self._cache

    def prepare_data(self) -> None:
        """Check the layout and build the patch cache if it is missing (on rank 0, before the workers start)."""
        path, fingerprint, pairs = self._cache_path()
        if not cache_exists(path):
            self._store(path, self._cut(pairs, fingerprint))

    def _store(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        written = write_cache(path, str(arrays["fingerprint"]), arrays)  # elsewhere when the data is read-only
        if written is None:  # neither the data folder nor the user's cache folder could be written
            return
        for stale in written.parent.glob(f"patches_{self.patch}_*.npz"):
            if stale != written:
                log.info("Deleting stale GID patch cache %s.", stale)
                stale.unlink(missing_ok=True)

    def _patches(self) -> dict[str, np.ndarray]:
        """The cached patches, built first when the cache is missing, stale or unreadable."""
        path, fingerprint, pairs = self._cache_path()
        arrays = read_cache(path, fingerprint)
        if arrays is None:
            arrays = self._cut(pairs, fingerprint)
            self._store(path, arrays)
        # Tiles the cache was cut without: raise for the first (error; a cache cut with on_bad_file=skip) or
        # record them all (skip).
        for entry, reason in zip(arrays["skipped_files"], arrays["skipped_reasons"]):
            self.bad.file(DataError(str(reason), str(entry)))
        self.bad.warn(self.title, "bad tile(s)")
        return arrays

    def _cut(self, pairs: list[tuple[Path, Path]], fingerprint: str) -> dict[str, np.ndarray]:
        """Decode every tile and cut it into patches; bad tiles raise (error) or are recorded in the
        cache (skip), which :meth:`_patches` reports.

        The patch arrays are allocated once from the tile sizes in the file headers, so
        the peak memory is the cache plus one decoded tile."""
        from tqdm.auto import tqdm

        p = self.patch
        fix = "Replace it from the GID release, or delete the tile and its label."
        with large_images():
            capacity = sum((w // p) * (h // p) for w, h in map(header_size, (image for image, _ in pairs)))
            images = np.empty((capacity, p, p, 3), np.uint8)
            masks = np.empty((capacity, p, p), np.uint8)
            origin = np.empty((capacity, 3), np.int32)  # tile, patch row, patch column
            n, skipped = 0, []
            for t, (image_path, label_path) in enumerate(tqdm(pairs, desc="Cutting GID tiles", unit="tile",
                                                              disable=len(pairs) < 3)):  # fmt: skip
                try:
                    image = read_image(image_path, fix)
                    label = read_image(label_path, fix)
                    if label.shape != image.shape:
                        raise UserError(
                            f"{image_path} is {image.shape[1]}x{image.shape[0]} (width x height) but its label "
                            f"{label_path} is {label.shape[1]}x{label.shape[0]}; they must match. {fix}"
                        )
                    mask = gid_colours_to_index(label, label_path)
                except UserError as err:
                    entry = str(err).replace(f" {fix}", "")  # "<file> <what is wrong>", without the fix
                    entry = entry if entry.startswith(str(image_path)) else f"{image_path}: {entry}"
                    if not self.bad.skip:  # stop at the first bad tile rather than decode the others first
                        self.bad.file(DataError(str(err), entry))  # raises, with the data.on_bad_file hint
                    skipped.append((entry, str(err)))
                    continue
                del label
                nh, nw = image.shape[0] // p, image.shape[1] // p
                k = min(nh * nw, capacity - n)  # the header said as much, unless the file changed meanwhile
                if nh * nw == 0:
                    log.warning("GID tile %s is smaller than one %dx%d patch; it gives no patches.", image_path, p, p)
                    continue
                cut = np.s_[: nh * p, : nw * p]
                # (nh p, nw p[, 3]) -> (nh, p, nw, p[, 3]) -> (nh, nw, p, p[, 3]) -> (nh nw, p, p[, 3]), row-major
                images[n : n + k] = image[cut].reshape(nh, p, nw, p, 3).swapaxes(1, 2).reshape(-1, p, p, 3)[:k]
                masks[n : n + k] = mask[cut].reshape(nh, p, nw, p).swapaxes(1, 2).reshape(-1, p, p)[:k]
                origin[n : n + k] = np.stack(np.meshgrid([t], np.arange(nh), np.arange(nw), indexing="ij"),
                                             axis=-1).reshape(-1, 3)[:k]  # fmt: skip
                n += k
        return {
            "fingerprint": np.array(fingerprint),
            "images": images[:n],
            "masks": masks[:n],
            "tile": origin[:n, 0],
            "row": origin[:n, 1],
            "col": origin[:n, 2],
            "tiles": np.array([str(image_path.name) for image_path, _ in pairs]),
            "skipped_files": np.array([f for f, _ in skipped], dtype=str),
            "skipped_reasons": np.array([r for _, r in skipped], dtype=str),
        }

    def _sources(self) -> dict[str, ArraySource]:
        arrays = self._patches()
        n = len(arrays["images"])
        if n < 3:
            raise UserError(
                f"GID under data.root={self.root} gives {n} patch(es) of {self.patch}x{self.patch}, fewer than the "
                f"3 needed for a train / val / test split; add tiles or lower data.patch."
            )
        self.tile_names = [str(t) for t in arrays["tiles"]]
        self.patch_origin = np.stack([arrays["tile"], arrays["row"], arrays["col"]], axis=1)  # (N, 3)
        names = [f"{self.tile_names[t]} patch (row {r}, col {c})" for t, r, c in self.patch_origin]
        return {split: ArraySource(arrays["images"], arrays["masks"], idx, names)
                for split, idx in _gid_split(n, self.split_seed).items()}  # fmt: skip
