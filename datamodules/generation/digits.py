"""``data=digits``: scikit-learn's handwritten digits for a GAN, offline (demos and tests)."""

from __future__ import annotations

import torch

from datamodules.formats.digits import CLASS_NAMES, NUM_CLASSES, read_digits
from datamodules.generation.base import ImageDataModule


class Digits(ImageDataModule):
    """scikit-learn's 1,797 handwritten digits (8x8, values 0..16, 10 classes), all for training.

    Upscaled bilinearly (``align_corners=False``, no antialias) to R x R, 0..16 mapped
    to 0..255, replicated to 3 channels (:func:`~datamodules.formats.digits.read_digits`).
    Offline: the data ships with scikit-learn. Args: see :class:`ImageDataModule` (``flip``
    defaults to False in the config: digits are not mirror-symmetric).
    """

    name = "digits"
    num_classes = NUM_CLASSES
    class_names = CLASS_NAMES

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        return read_digits(self.resolution)
