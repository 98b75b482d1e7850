"""PASCAL VOC 2012 (+ SBD's augmented training masks), in its official layout."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from attention.errors import UserError
from datamodules.base import bool_option
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.files import find_folder, root_state
from datamodules.segmentation.labels import LabelMap, bit_colormap
from datamodules.segmentation.sources import FileSource

VOC_CLASSES = [
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
]  # fmt: skip
VOC_LABELS = LabelMap({**{i: i for i in range(21)}, 255: 255}, "0..20 (classes) or 255 (boundary, ignored)")
VOC_AUG_LISTS = ("trainaug.txt", "aug.txt")  # the usual name, and mmsegmentation's
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
    Splits: train (``aug``: trainaug with SegmentationClassAug masks), val; test = val.

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
        folder = find_folder([root / "VOCdevkit" / "VOC2012", root / "VOC2012", root], required)
        if folder is None:
            raise UserError(
                f"PASCAL VOC 2012 not found: data.root={root} {root_state(root)}. Expected {VOC_LAYOUT}. "
                f"{VOC_SOURCE}"
            )
        if self.aug and not (folder / "SegmentationClassAug").is_dir():
            raise UserError(
                f"data.aug=true needs {folder / 'SegmentationClassAug'}/<id>.png (SBD-augmented masks), which does "
                f"not exist. Expected {VOC_LAYOUT}. {VOC_SOURCE} Or set data.aug=false."
            )
        return folder

    def _list(self, folder: Path, names: Sequence[str]) -> tuple[Path, list[str]]:
        lists = folder / "ImageSets" / "Segmentation"
        path = next((lists / n for n in names if (lists / n).is_file()), None)
        if path is None:
            raise UserError(
                f"Split file {lists / names[0]} does not exist. Expected {VOC_LAYOUT}. {VOC_SOURCE}"
            )
        ids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
        if not ids:
            raise UserError(f"Split file {path} lists no ids; expected one image id a line. {VOC_SOURCE}")
        return path, ids

    def _split(self, folder: Path, list_names: Sequence[str], mask_dir: str) -> FileSource:
        path, ids = self._list(folder, list_names)
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
        if self.aug:
            train = self._split(folder, VOC_AUG_LISTS, "SegmentationClassAug")
        else:
            train = self._split(folder, ["train.txt"], "SegmentationClass")
        val = self._split(folder, ["val.txt"], "SegmentationClass")
        return {"train": train, "val": val, "test": val}
