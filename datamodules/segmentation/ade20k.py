"""ADE20K SceneParsing (ADEChallengeData2016), in its official layout."""

from __future__ import annotations

from pathlib import Path

from attention.errors import UserError
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.files import files_in_the_way, find_folder, root_state, visible_files
from datamodules.segmentation.labels import IGNORE_INDEX, LabelMap, bit_colormap
from datamodules.segmentation.sources import FileSource

ADE20K_CLASSES = [
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass", "cabinet",
    "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water",
    "painting", "sofa", "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk",
    "rock", "wardrobe", "lamp", "bathtub", "railing", "cushion", "base", "box", "column", "signboard",
    "chest of drawers", "counter", "sand", "sink", "skyscraper", "fireplace", "refrigerator", "grandstand",
    "path", "stairs", "runway", "case", "pool table", "pillow", "screen door", "stairway", "river", "bridge",
    "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench", "countertop", "stove",
    "palm", "kitchen island", "computer", "swivel chair", "boat", "bar", "arcade machine", "hovel", "bus",
    "towel", "light", "truck", "tower", "chandelier", "awning", "streetlight", "booth", "television receiver",
    "airplane", "dirt track", "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle",
    "buffet", "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven",
    "ball", "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake",
    "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light", "tray",
    "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board", "shower", "radiator", "glass",
    "clock", "flag",
]  # fmt: skip  (objectInfo150 order; annotation value i + 1 is class i)
ADE20K_LABELS = LabelMap({0: IGNORE_INDEX, **{i: i - 1 for i in range(1, 151)}},
                         "0..150 (0 = other, ignored; 1..150 = the classes)")  # fmt: skip
ADE20K_SPLITS = {"train": "training", "val": "validation"}
ADE20K_LAYOUT = (
    "<root>/ADEChallengeData2016/ with images/{training,validation}/<name>.jpg and "
    "annotations/{training,validation}/<name>.png (grey PNGs, 0 = other, 1..150 = classes)"
)
ADE20K_SOURCE = (
    "Get ADEChallengeData2016.zip (SceneParsing benchmark) from "
    "http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip and unpack it in data.root."
)


class ADE20K(SegDataModule):
    """ADE20K SceneParsing (150 classes), config ``ade20k``::

        <root>/ADEChallengeData2016/           (root may also be that folder itself)
            images/{training,validation}/<name>.jpg
            annotations/{training,validation}/<name>.png   grey, 0 = other, 1..150 = classes

    Annotation 0 becomes 255 (ignored) and 1..150 become 0..149. Images and masks
    are paired by file stem. Splits: training, validation; test = validation.

    Args: ``root`` (above); the others: see :class:`SegDataModule`.
    """

    test_split_is_val = True  # no public test labels: "test" is the validation split

    name = "ade20k"
    class_names = ADE20K_CLASSES
    palette = bit_colormap(len(ADE20K_CLASSES) + 1)[1:]  # skip black

    def _check(self) -> Path:
        root = Path(self.root).expanduser()
        required = [f"{kind}/{split}" for kind in ("images", "annotations") for split in ADE20K_SPLITS.values()]
        candidates = [root / "ADEChallengeData2016", root]
        folder = find_folder(candidates, required)
        if folder is None:
            near = find_folder(candidates, ["images", "annotations"])
            what = (f"{near} lacks some of {', '.join(required)}" if near else
                    f"data.root={root} {root_state(root)}") + files_in_the_way(candidates, required)  # fmt: skip
            raise UserError(f"ADE20K not found: {what}. Expected {ADE20K_LAYOUT}. {ADE20K_SOURCE}")
        return folder

    def _split(self, folder: Path, split: str) -> FileSource:
        images = {p.stem: p for p in visible_files(folder / "images" / split, (".jpg", ".jpeg"))}
        masks = {p.stem: p for p in visible_files(folder / "annotations" / split, (".png",))}
        problems = [(images[s], f"image without mask: annotations/{split}/{s}.png does not exist")
                    for s in sorted(images.keys() - masks.keys())]  # fmt: skip
        problems += [(masks[s], f"mask without image: images/{split}/{s}.jpg does not exist")
                     for s in sorted(masks.keys() - images.keys())]  # fmt: skip
        self._drop(problems, "Restore them from ADEChallengeData2016.zip, or delete the unpaired files.")
        pairs = [(images[s], masks[s], ADE20K_LABELS) for s in sorted(images.keys() & masks.keys())]
        return FileSource(pairs, "Replace it from the official ADEChallengeData2016.zip, or delete the pair.")

    def _sources(self) -> dict[str, FileSource]:
        folder = self._check()
        train = self._split(folder, ADE20K_SPLITS["train"])
        val = self._split(folder, ADE20K_SPLITS["val"])
        return {"train": train, "val": val, "test": val}
