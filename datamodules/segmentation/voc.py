"""PASCAL VOC 2012 (+ SBD's augmented training masks), in its official layout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from attention.errors import UserError
from datamodules.base import bool_option, describe
from datamodules.download import read_lines
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.files import files_in_the_way, find_folder, root_state
from datamodules.segmentation.labels import LabelMap, bit_colormap
from datamodules.segmentation.sources import FileSource

VOC_CLASSES = [
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
]  # fmt: skip
VOC_LABELS = LabelMap({**{i: i for i in range(21)}, 255: 255}, "0..20 (classes) or 255 (boundary, ignored)")
VOC_AUG_LISTS = ("trainaug.txt", "aug.txt")  # the usual name, and mmsegmentation's
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # a split-list line ending so names a file, not an id
VOC_LAYOUT = (
    "<root>/VOCdevkit/VOC2012/ with JPEGImages/<id>.jpg, SegmentationClass/<id>.png (palette PNGs of class "
    "indices, 255 = boundary) and ImageSets/Segmentation/{train,val}.txt (one id a line); with data.aug=true "
    "also SegmentationClassAug/<id>.png (grey PNGs of class indices, from SBD) and "
    "ImageSets/Segmentation/trainaug.txt (10,582 ids)"
)
VOC_SOURCE = (
    "Get VOCtrainval_11-May-2012.tar from http://host.robots.ox.ac.uk/pascal/VOC/voc2012/ and unpack it in "
    "data.root; for data.aug=true add SBD's augmented masks (SegmentationClassAug, e.g. as converted by "
    "DeepLab or mmsegmentation's voc_aug.py) and the trainaug.txt id list."
)


class VOC(SegDataModule):
    """PASCAL VOC 2012 segmentation (21 classes: background + 20), config ``voc``::

        <root>/VOCdevkit/VOC2012/              (root may also be VOCdevkit/ or VOC2012/ itself)
            JPEGImages/<id>.jpg
            SegmentationClass/<id>.png         palette PNGs: index = class, 255 = boundary (ignored)
            ImageSets/Segmentation/train.txt, val.txt
            SegmentationClassAug/<id>.png      aug=true: grey PNGs of class indices (SBD-derived)
            ImageSets/Segmentation/trainaug.txt   aug=true: 10,582 ids (mmsegmentation's aug.txt also works)

    Masks are read without converting to RGB (a palette PNG gives its indices).
    Splits: train (``aug``: trainaug with SegmentationClassAug masks), val; test = val. The lists hold one image id
    a line (UTF-8, each id once), and the train list shares no id with val.txt (a shared one is refused: it would be
    a test image trained on).

    Args:
        root: see above.
        aug: train on the SBD-augmented trainaug split.
        lr: the recipe's learning rate (0.009 here).
        options: the others, see :class:`SegDataModule`.
    """

    test_split_is_val = True  # no public test labels: "test" is the validation split

    name = "voc"
    class_names = VOC_CLASSES
    palette = bit_colormap(len(VOC_CLASSES))

    def __init__(self, root: str, aug: bool = False, *, lr: float = 0.009, **options):
        super().__init__(root, lr=lr, **options)
        self.aug = bool_option("aug", aug)

    def _check(self) -> Path:
        root = Path(self.root).expanduser()
        required = ["JPEGImages", "SegmentationClass", "ImageSets/Segmentation"]
        candidates = [root / "VOCdevkit" / "VOC2012", root / "VOC2012", root]
        folder = find_folder(candidates, required)
        if folder is None:
            raise UserError(
                f"PASCAL VOC 2012 not found: data.root={root} {root_state(root)}"
                f"{files_in_the_way(candidates, required)}. Expected {VOC_LAYOUT}. "
                f"{VOC_SOURCE}"
            )
        if self.aug and not (folder / "SegmentationClassAug").is_dir():
            raise UserError(
                f"data.aug=true needs {folder / 'SegmentationClassAug'}/<id>.png (SBD-augmented masks), which does "
                f"not exist. Expected {VOC_LAYOUT}. {VOC_SOURCE} Or set data.aug=false."
            )
        return folder

    def _list(self, folder: Path, names: Sequence[str]) -> tuple[Path, list[str]]:
        """The first of the split files ``names`` that exists, and its ids; UserError when it is missing, not
        UTF-8, holds paths instead of ids (DeepLab's format), lists no id or one id twice."""
        lists = folder / "ImageSets" / "Segmentation"
        path = next((lists / n for n in names if (lists / n).is_file()), None)
        if path is None:
            raise UserError(
                f"Split file {lists / names[0]} does not exist. Expected {VOC_LAYOUT}. {VOC_SOURCE}"
            )
        ids = []
        for number, line in enumerate(read_lines(path, "one image id a line (e.g. 2007_000032)", VOC_SOURCE), 1):
            if not line.strip():
                continue
            id_ = line.split()[0]
            if "/" in id_ or "\\" in id_ or id_.lower().endswith(IMAGE_SUFFIXES):
                # DeepLab's train_aug.txt ("/JPEGImages/<id>.jpg /SegmentationClassAug/<id>.png"): its ids would
                # become paths that exist nowhere, a misleading "file missing" for every line
                raise UserError(
                    f"{path}, line {number}: {line.strip()[:120]!r} is a file path, not an image id. The list must "
                    f"hold one image id per line (e.g. 2007_000032), not image and mask paths as DeepLab's "
                    f"train_aug.txt does. Keep each line's file name without its extension, e.g. "
                    f"awk '{{n = split($1, p, \"/\"); sub(/\\.jpg$/, \"\", p[n]); print p[n]}}' train_aug.txt > "
                    f"{path.name}."
                )
            ids.append(id_)
        if not ids:
            raise UserError(f"Split file {path} lists no ids; expected one image id a line. {VOC_SOURCE}")
        repeated = [id_ for id_, count in Counter(ids).items() if count > 1]
        if repeated:
            raise UserError(
                f"Split file {path} lists {len(repeated)} id(s) more than once: {describe(repeated)}. Each image must "
                f"be listed once (a repeated one weighs twice in training and in the scores): remove the repeated "
                "lines."
            )
        return path, ids

    def _split(self, folder: Path, path: Path, ids: list[str], mask_dir: str) -> FileSource:
        pairs, problems = [], []
        for id_ in ids:
            image, mask = folder / "JPEGImages" / f"{id_}.jpg", folder / mask_dir / f"{id_}.png"
            if not image.is_file() and not mask.is_file():
                problems.append((image, f"listed in {path.name} but neither it nor {mask} exists"))
            elif not image.is_file():
                problems.append((mask, f"mask without image: {image} (listed in {path.name}) does not exist"))
            elif not mask.is_file():
                problems.append((image, f"image without mask: {mask} (listed in {path.name}) does not exist"))
            else:
                pairs.append((image, mask, VOC_LABELS))
        fix = f"Restore the missing files or remove their ids from {path}."
        drop = self._drop(problems, fix)
        pairs = [p for p in pairs if p[0] not in drop and p[1] not in drop]
        return FileSource(pairs, f"Replace it from the official release or remove its id from {path}.")

    def _sources(self) -> dict[str, FileSource]:
        folder = self._check()
        train_path, train_ids = self._list(folder, VOC_AUG_LISTS if self.aug else ["train.txt"])
        val_path, val_ids = self._list(folder, ["val.txt"])
        val_set = set(val_ids)
        shared = [id_ for id_ in train_ids if id_ in val_set]
        if shared:
            # val is also the test split here: a shared id is a test image that was trained on, and the scores lie
            usual = (" (the usual trainaug list of 10,582 ids, SBD's train and val images without them, has none of "
                     "them)" if self.aug else " (the official train.txt has none of them)")
            raise UserError(
                f"Split files {train_path} and {val_path} share {len(shared)} id(s): {describe(shared)}. "
                f"{val_path.name} is also the test split (VOC has no public test labels), so these test images "
                "would be trained on. "
                f"Remove the VOC2012 val ids from {train_path}{usual}."
            )
        mask_dir = "SegmentationClassAug" if self.aug else "SegmentationClass"
        train = self._split(folder, train_path, train_ids, mask_dir)
        val = self._split(folder, val_path, val_ids, "SegmentationClass")
        return {"train": train, "val": val, "test": val}
