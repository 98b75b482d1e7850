"""Training transforms (random scale, pad, crop, flip; steps 1-4 of :mod:`datamodules.segmentation`),
normalisation, and the collation that pads evaluation batches of images of different sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from datamodules.base import IMAGENET_MEAN, IMAGENET_STD
from datamodules.segmentation.labels import IGNORE_INDEX


class TrainTransform:
    """Random scale, pad, crop and flip of a float image (3, H, W) in [0, 255] and its int64 mask (H, W)
    (steps 1-4 of :mod:`datamodules.segmentation`); random numbers from torch's default generator."""

    def __init__(self, crop: tuple[int, int], scale_range: tuple[float, float], flip: bool):
        self.crop = crop
        self.scale_range = scale_range
        self.flip = flip

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = mask.shape
        lo, hi = self.scale_range
        scale = lo + (hi - lo) * float(torch.rand(()))
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        if size != (h, w):
            image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]
            mask = F.interpolate(mask[None, None].to(torch.float32), size=size, mode="nearest-exact")[0, 0]
            mask = mask.to(torch.int64)
        ch, cw = self.crop
        pad_h, pad_w = max(ch - size[0], 0), max(cw - size[1], 0)
        if pad_h or pad_w:  # bottom / right
            image = F.pad(image, (0, pad_w, 0, pad_h), value=0.0)
            mask = F.pad(mask, (0, pad_w, 0, pad_h), value=IGNORE_INDEX)
        h, w = mask.shape
        top = int(torch.randint(0, h - ch + 1, ()))
        left = int(torch.randint(0, w - cw + 1, ()))
        image = image[:, top : top + ch, left : left + cw]
        mask = mask[top : top + ch, left : left + cw]
        if self.flip and float(torch.rand(())) < 0.5:
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


def normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(image / 255 - mean) / std`` per channel of a float (3, H, W) image in [0, 255]."""
    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (image / 255.0 - m) / s


class PadCollate:
    """Stack samples, padding each at the bottom / right to the largest in the batch: images with
    black (``-mean / std``, i.e. 0 before normalisation), masks with 255. ``sizes`` lists each sample's
    ``(h, w)`` before padding (plain ints, left on the host): evaluation predicts a padded batch's images
    one by one at their own sizes (``tasks/segmentation.py``), since the padding would change what the
    network sees of each (its borders, global attention, the flip and the scales of the padded size)."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.fill = [-m / s for m, s in zip(mean, std)]

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        each = [tuple(s["mask"].shape) for s in samples]
        sizes = set(each)
        if len(sizes) == 1:
            return {"image": torch.stack([s["image"] for s in samples]),
                    "mask": torch.stack([s["mask"] for s in samples]), "sizes": each}  # fmt: skip
        h = max(size[0] for size in sizes)
        w = max(size[1] for size in sizes)
        images = torch.tensor(self.fill, dtype=torch.float32)[None, :, None, None].repeat(len(samples), 1, h, w)
        masks = torch.full((len(samples), h, w), IGNORE_INDEX, dtype=torch.int64)
        for i, s in enumerate(samples):
            sh, sw = s["mask"].shape
            images[i, :, :sh, :sw] = s["image"]
            masks[i, :sh, :sw] = s["mask"]
        return {"image": images, "mask": masks, "sizes": each}
