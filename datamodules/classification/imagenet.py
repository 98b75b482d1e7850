"""``data=imagenet``: ImageNet-1k (ILSVRC 2012) in the standard folder layout."""

from __future__ import annotations

from datamodules.classification.folder import FolderClassification


class ImageNet(FolderClassification):
    """ImageNet-1k (ILSVRC 2012) in the standard folder layout, 1,000 classes (see :class:`FolderClassification`)::

        <root>/train/n01440764/n01440764_10026.JPEG ...
        <root>/val/n01440764/ILSVRC2012_val_00000293.JPEG ...

    ``num_classes`` is 1000 without reading the disk.
    """

    name = "ImageNet"
    how_to_get = ("Download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from image-net.org, unpack train/ "
                  "(one tar per class) and sort val/ into one folder per class (the devkit's labels, e.g. "
                  "valprep.sh), then set data.root to the folder holding train/ and val/.")
    flat_hint = (" (ImageNet's validation archive unpacks flat: sort it into val/<wnid>/ with the devkit's "
                 "labels, e.g. valprep.sh)")

    def __init__(self, root: str, num_classes: int | None = 1000, **options):
        super().__init__(root, num_classes=num_classes, **options)
