"""``data=tiny``: scikit-learn's digits for classification, offline (the demo and the tests)."""

from __future__ import annotations

import numpy as np

from attention.errors import UserError
from datamodules.base import int_option
from datamodules.classification.base import ArraySource, ClassificationDataModule
from datamodules.formats.digits import CLASS_NAMES, NUM_CLASSES, NUM_DIGITS, read_digits

TINY_AUGMENT = {"scale": (0.6, 1.0), "ratio": (0.8, 1.25), "hflip": None, "color_jitter": None,
                "auto_augment": None, "re_prob": None}


class TinyDigits(ClassificationDataModule):
    """scikit-learn's 1,797 handwritten digits as 32x32 RGB images (bilinear upscale of the 8x8
    originals, the same images as the GAN's ``digits``), 10 classes; a fixed split (seed 0) of
    ``val_size`` and ``test_size`` images, the rest (1,297 by default) for training. Offline.

    Args:
        val_size, test_size: held-out images.
        Others: see :class:`ClassificationDataModule`; the config sets light augmentation
            (random-resized crops of 60-100 % of the area, no flips, no RandAugment, no erasing).
    """

    name = "tiny digits"
    num_classes = NUM_CLASSES
    class_names = CLASS_NAMES

    def __init__(self, val_size: int = 250, test_size: int = 250, img_size: int = 32, augment=TINY_AUGMENT,
                 num_workers: int = 0, crop_pct: float = 1.0, **options):  # fmt: skip
        super().__init__(img_size=img_size, augment=augment, num_workers=num_workers, crop_pct=crop_pct, **options)
        self.val_size = int_option("val_size", val_size, 1, 250)
        self.test_size = int_option("test_size", test_size, 1, 250)
        if self.val_size + self.test_size >= NUM_DIGITS:
            raise UserError(f"data.val_size + data.test_size = {self.val_size + self.test_size} leaves no training "
                            "digits of the 1,797; use smaller values (e.g. 250 each).")

    def _sources(self) -> dict[str, ArraySource]:
        images, labels = read_digits(32)
        images = images.permute(0, 2, 3, 1).contiguous().numpy()  # (N, 3, 32, 32) -> (N, 32, 32, 3) uint8
        labels = labels.numpy()
        order = np.random.RandomState(0).permutation(len(images))
        val, test = np.sort(order[:self.val_size]), np.sort(order[self.val_size:self.val_size + self.test_size])
        train = np.sort(order[self.val_size + self.test_size:])
        return {split: ArraySource(images[idx], labels[idx], f"digits {split}")
                for split, idx in (("train", train), ("val", val), ("test", test))}
