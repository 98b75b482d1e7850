"""Where samples come from: image / mask file pairs decoded on access, or arrays held in memory; and the
dataset that turns a source's samples into normalised tensors (through the training transform)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attention.errors import UserError
from datamodules.base import IMAGENET_MEAN, IMAGENET_STD
from datamodules.segmentation.files import read_image, read_index_mask
from datamodules.segmentation.labels import LabelMap
from datamodules.segmentation.transforms import TrainTransform, normalize


class FileSource:
    """Image / mask file pairs, decoded on access.

    Args:
        pairs: ``(image, mask, label_map)`` per sample, in the split's fixed order.
        fix: how to repair a bad file, appended to per-sample errors.
    """

    def __init__(self, pairs: list[tuple[Path, Path, LabelMap]], fix: str):
        self.pairs = pairs
        self.fix = fix

    def __len__(self) -> int:
        return len(self.pairs)

    def name(self, index: int) -> str:
        return str(self.pairs[index][0])

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Image uint8 (H, W, 3) and mask uint8 (H, W) of class indices / 255; UserError naming the file."""
        image_path, mask_path, label_map = self.pairs[index]
        image = read_image(image_path, self.fix)
        raw = read_index_mask(mask_path, self.fix)
        if raw.shape != image.shape[:2]:
            raise UserError(
                f"{image_path} is {image.shape[1]}x{image.shape[0]} (width x height) but its mask {mask_path} "
                f"is {raw.shape[1]}x{raw.shape[0]}; they must match pixel for pixel. {self.fix}"
            )
        return image, label_map(raw, mask_path, self.fix)


class ArraySource:
    """Samples held in memory: ``images`` uint8 (N, H, W, 3) and ``masks`` uint8 (N, H, W), already
    mapped to class indices / 255, of which the rows ``indices`` are this split."""

    def __init__(self, images: np.ndarray, masks: np.ndarray, indices: np.ndarray, names: Sequence[str]):
        self.images = images
        self.masks = masks
        self.indices = np.asarray(indices, dtype=np.int64)
        self.names = names  # per row of images / masks

    def __len__(self) -> int:
        return len(self.indices)

    def name(self, index: int) -> str:
        return str(self.names[self.indices[index]])

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        row = self.indices[index]
        return self.images[row], self.masks[row]


class SegmentationDataset(Dataset):
    """``{"image": float32 (3, H, W) normalised, "mask": int64 (H, W)}`` samples of a source, through
    ``transform`` (a :class:`TrainTransform`) when given; decoding happens here, in the worker."""

    def __init__(self, source, transform: TrainTransform | None = None,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):  # fmt: skip
        self.source = source
        self.transform = transform
        self.mean = tuple(mean)
        self.std = tuple(std)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, mask = self.source.load(index)  # uint8 (H, W, 3), uint8 (H, W)
        x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).to(torch.float32)  # a copy
        y = torch.from_numpy(np.asarray(mask, dtype=np.int64))  # a copy: the source stays intact
        if self.transform is not None:
            x, y = self.transform(x, y)
        return {"image": normalize(x, self.mean, self.std).contiguous(), "mask": y.contiguous()}
