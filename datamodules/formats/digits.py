"""scikit-learn's handwritten digits as RGB images: the one reader behind ``data=digits`` (GAN) and ``data=tiny``.

The 1,797 digits ship with scikit-learn (no download): 8x8 greyscale, values 0..16, 10 classes. Both tasks
see them the same way, so a digit a GAN learns to draw is the digit a classifier learns to read.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

NUM_DIGITS = 1797
NUM_CLASSES = 10
CLASS_NAMES = [str(d) for d in range(NUM_CLASSES)]


def read_digits(resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images uint8 (N, 3, R, R) and labels int64 (N,), N = 1,797, in scikit-learn's order.

    Upscaled bilinearly (``align_corners=False``, no antialias) to R x R, 0..16 mapped to 0..255
    (rounded), replicated to 3 channels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(np.asarray(digits.images, dtype=np.float64))[:, None]  # (N, 1, 8, 8) in 0..16
    if x.shape[-1] != resolution:
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear",
                          align_corners=False, antialias=False)  # fmt: skip
    x = (x * (255.0 / 16.0)).round_().clamp_(0, 255).to(torch.uint8)
    images = x.expand(-1, 3, -1, -1).contiguous()  # (N, 1, R, R) -> (N, 3, R, R)
    labels = torch.from_numpy(np.asarray(digits.target, dtype=np.int64))
    return images, labels
