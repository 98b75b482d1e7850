"""Cityscapes, fine annotations (gtFine), in its official layout."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.files import files_ending, files_in_the_way, find_folder, root_state
from datamodules.segmentation.labels import IGNORE_INDEX, LabelMap
from datamodules.segmentation.sources import FileSource

CITYSCAPES_CLASSES = [
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign", "vegetation",
    "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle",
]  # fmt: skip
CITYSCAPES_PALETTE = np.array([
    (128, 64, 128), (244, 35, 232), (70, 70, 70), (102, 102, 156), (190, 153, 153), (153, 153, 153),
    (250, 170, 30), (220, 220, 0), (107, 142, 35), (152, 251, 152), (70, 130, 180), (220, 20, 60), (255, 0, 0),
    (0, 0, 142), (0, 0, 70), (0, 60, 100), (0, 80, 100), (0, 0, 230), (119, 11, 32),
], dtype=np.uint8)  # fmt: skip  (the official colours of the 19 train ids)
CITYSCAPES_TRAIN_IDS = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11,
                        25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}  # fmt: skip
# Official labelIds hold ids 0..33 (cityscapesScripts' labels.py; json2labelImg does not write license plate's -1):
# the ids without a train id are ignored, any value above 33 refused. A train-id file (0..18, 255) saved under the
# labelIds name would otherwise be mapped a second time without a word (7 traffic light -> 0 road, 0 road -> 255).
CITYSCAPES_LABEL_IDS = LabelMap({**{i: IGNORE_INDEX for i in range(34)}, **CITYSCAPES_TRAIN_IDS},
                                "0..33 (Cityscapes label ids; values such as 255 with others <= 18 are train ids: "
                                "a *_gtFine_labelTrainIds.png saved under the *_gtFine_labelIds.png name is the likely "
                                "cause, so rename it to *_gtFine_labelTrainIds.png, which is used as is)")
CITYSCAPES_LABEL_TRAIN_IDS = LabelMap({**{i: i for i in range(19)}, 255: 255}, "0..18 or 255 (train ids)")
CITYSCAPES_SPLITS = ("train", "val")
CITYSCAPES_IMAGE = "_leftImg8bit.png"
CITYSCAPES_MASKS = ("_gtFine_labelTrainIds.png", "_gtFine_labelIds.png")  # preferred first
CITYSCAPES_LAYOUT = (
    "<root>/leftImg8bit/{train,val}/<city>/<stem>_leftImg8bit.png and "
    "<root>/gtFine/{train,val}/<city>/<stem>_gtFine_labelIds.png (or _gtFine_labelTrainIds.png)"
)
CITYSCAPES_SOURCE = (
    "Get leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip from https://www.cityscapes-dataset.com/downloads/ "
    "(free registration) and unpack both in data.root."
)


class Cityscapes(SegDataModule):
    """Cityscapes, fine annotations, 19 train classes, config ``cityscapes``::

        <root>/                                  (or <root>/cityscapes/)
            leftImg8bit/{train,val}/<city>/<stem>_leftImg8bit.png
            gtFine/{train,val}/<city>/<stem>_gtFine_labelIds.png
            gtFine/{train,val}/<city>/<stem>_gtFine_labelTrainIds.png   optional, used as is

    ``labelIds`` are mapped to train ids with the official table (7 road -> 0, ...,
    33 bicycle -> 18, every other id 0..33 -> 255; a value above 33 is refused as
    a bad file: no official labelIds holds one); a ``labelTrainIds`` file (from
    cityscapesScripts' createTrainIdLabelImgs) is used instead when present.
    Splits: train, val (sorted by city, then stem); test = val.
    ``crop`` is [512, 1024] by default; 769 x 769 is the other common choice.

    Args:
        root: see above.
        crop: the training crop ([512, 1024] here).
        options: the others, see :class:`SegDataModule`.
    """

    test_split_is_val = True  # no public test labels: "test" is the validation split

    name = "cityscapes"
    class_names = CITYSCAPES_CLASSES
    palette = CITYSCAPES_PALETTE

    def __init__(self, root: str, *, crop: int | Sequence[int] = (512, 1024), **options):
        super().__init__(root, crop=crop, **options)

    def _check(self) -> Path:
        root = Path(self.root).expanduser()
        required = [f"{kind}/{split}" for kind in ("leftImg8bit", "gtFine") for split in CITYSCAPES_SPLITS]
        candidates = [root, root / "cityscapes"]
        folder = find_folder(candidates, required)
        if folder is None:
            near = find_folder(candidates, ["leftImg8bit"]) or find_folder(candidates, ["gtFine"])
            what = f"{near} lacks some of {', '.join(required)}" if near else f"data.root={root} {root_state(root)}"
            what += files_in_the_way(candidates, required)
            raise UserError(f"Cityscapes not found: {what}. Expected {CITYSCAPES_LAYOUT}. {CITYSCAPES_SOURCE}")
        return folder

    def _split(self, folder: Path, split: str) -> FileSource:
        image_dir, mask_dir = folder / "leftImg8bit" / split, folder / "gtFine" / split
        cities = sorted({p.name for d in (image_dir, mask_dir) for p in d.iterdir()
                         if p.is_dir() and not p.name.startswith(".")})  # fmt: skip
        pairs, problems = [], []
        for city in cities:
            images = {p.name[: -len(CITYSCAPES_IMAGE)]: p for p in files_ending(image_dir / city, CITYSCAPES_IMAGE)}
            masks: dict[str, Path] = {}
            for suffix in reversed(CITYSCAPES_MASKS):  # the preferred suffix last, so it wins
                masks.update({p.name[: -len(suffix)]: p for p in files_ending(mask_dir / city, suffix)})
            for stem in sorted(images.keys() | masks.keys()):
                if stem not in masks:
                    problems.append((images[stem], f"image without mask: gtFine/{split}/{city}/{stem}"
                                                   f"{CITYSCAPES_MASKS[1]} does not exist"))  # fmt: skip
                elif stem not in images:
                    problems.append((masks[stem], f"mask without image: leftImg8bit/{split}/{city}/{stem}"
                                                  f"{CITYSCAPES_IMAGE} does not exist"))  # fmt: skip
                else:
                    train_ids = masks[stem].name.endswith(CITYSCAPES_MASKS[0])
                    labels = CITYSCAPES_LABEL_TRAIN_IDS if train_ids else CITYSCAPES_LABEL_IDS
                    pairs.append((images[stem], masks[stem], labels))
        self._drop(problems, "Restore the missing files from the official zips, or delete the unpaired ones.")
        return FileSource(pairs, "Replace it from the official zips (or regenerate labelTrainIds), or delete the pair.")

    def _sources(self) -> dict[str, FileSource]:
        folder = self._check()
        train = self._split(folder, "train")
        val = self._split(folder, "val")
        return {"train": train, "val": val, "test": val}
