"""Blobs: generated shapes on textured backgrounds, no files (demos and tests)."""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np

from datamodules.base import SPLITS, bool_option, int_option
from datamodules.segmentation.base import SegDataModule
from datamodules.segmentation.sources import ArraySource

BLOBS_CLASSES = ["background", "disc", "square", "triangle", "ring"]
BLOBS_HUES = (None, 0.0, 0.25, 0.5, 0.75)  # per class: fill hue centre (red, chartreuse, cyan, violet)
BLOBS_HUE_JITTER = 0.14  # +-50 degrees: neighbouring classes overlap a little, so shape has to help
BLOBS_PALETTE = np.array([(0, 0, 0), (230, 25, 25), (128, 230, 25), (25, 230, 230), (128, 25, 230)], np.uint8)


def _smooth_noise(rng: np.random.Generator, size: int, cell: int) -> np.ndarray:
    """Smooth noise (size, size) in about [-1, 1]: a random (size / cell + 2)^2 grid, bilinearly upsampled."""
    n = size // cell + 2
    grid = rng.uniform(-1, 1, (n, n))
    t = (np.arange(size) + 0.5) / cell
    i = np.floor(t).astype(int)
    f = t - i
    rows = grid[i] * (1 - f)[:, None] + grid[i + 1] * f[:, None]  # (size, n)
    return rows[:, i] * (1 - f) + rows[:, i + 1] * f


def blob_sample(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One Blobs image uint8 (S, S, 3) and mask uint8 (S, S) drawn from ``rng``.

    A textured grey background (random level, smooth noise, slight tint, pixel noise)
    under 1-3 shapes of distinct classes, painted in order (later ones occlude):
    disc, square (rotated), triangle (equilateral, rotated) or ring (annulus, its hole
    shows the background), circumradius in [S/8, 5S/16] (8-20 px at S = 64). The fill
    colour is saturated, its hue the class's (:data:`BLOBS_HUES`) +-50 degrees, with
    random saturation and brightness and pixel noise."""
    s = size
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float32) + 0.5
    level = rng.uniform(70, 180)
    texture = 35 * _smooth_noise(rng, s, max(2, s // 8)) + 12 * _smooth_noise(rng, s, max(1, s // 32))
    tint = rng.uniform(-10, 10, 3)
    image = level + texture[..., None] + tint + rng.normal(0, 6, (s, s, 3))
    mask = np.zeros((s, s), np.uint8)
    n_shapes = int(rng.integers(1, 4))
    for cls in rng.permutation(np.arange(1, len(BLOBS_CLASSES)))[:n_shapes]:
        r = rng.uniform(s / 8, 5 * s / 16)
        cx, cy = rng.uniform(0.6 * r, s - 0.6 * r, 2)
        theta = rng.uniform(0, 2 * np.pi)
        dx, dy = xx - cx, yy - cy
        if cls == 1:  # disc
            inside = dx**2 + dy**2 <= r**2
        elif cls == 2:  # square, half side 0.8 r
            u = dx * np.cos(theta) + dy * np.sin(theta)
            v = -dx * np.sin(theta) + dy * np.cos(theta)
            inside = np.maximum(np.abs(u), np.abs(v)) <= 0.8 * r
        elif cls == 3:  # equilateral triangle, circumradius r: inside all three edges at distance r / 2
            normals = theta + np.pi / 3 + 2 * np.pi * np.arange(3) / 3
            reach = dx[..., None] * np.cos(normals) + dy[..., None] * np.sin(normals)
            inside = reach.max(axis=-1) <= r / 2
        else:  # ring
            d2 = dx**2 + dy**2
            inside = (d2 <= r**2) & (d2 >= (r * rng.uniform(0.45, 0.6)) ** 2)
        hue = (BLOBS_HUES[cls] + rng.uniform(-BLOBS_HUE_JITTER, BLOBS_HUE_JITTER)) % 1.0
        colour = 255 * np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 0.9), rng.uniform(0.55, 0.95)))
        image[inside] = colour + rng.normal(0, 10, (int(inside.sum()), 3))
        mask[inside] = cls
    return np.clip(np.rint(image), 0, 255).astype(np.uint8), mask


class Blobs(SegDataModule):
    """Generated shapes on textured backgrounds (5 classes: background, disc, square,
    triangle, ring), config ``blobs``; no files, for demos and tests.

    Each split is generated in :meth:`setup` as uint8 arrays held in memory,
    ``images`` (N, S, S, 3) and ``masks`` (N, S, S), sample i of split s (0, 1, 2 for
    train, val, test) from ``np.random.default_rng([seed, s, i])``: deterministic
    per seed, and a sample does not depend on the split sizes. See :func:`blob_sample`.
    Colour mostly separates the classes and shape settles the rest: a 4-layer dilated
    CNN reaches a mIoU of about 0.8 after one minute on one CPU core.

    Args:
        num_train, num_val, num_test: samples per split.
        size: image side S.
        crop: training crop; None = ``size``.
        pretrained: stored only, for the task config (``model.pretrained`` reads
            ``data.pretrained``): ImageNet weights do not help on generated data, and
            the default false keeps a Blobs run offline.
        scale_range, batch_size, eval_batch_size, num_workers: as in :class:`SegDataModule`, with
            small defaults for a laptop.
        options: the others (on_bad_file has nothing to skip here), see :class:`SegDataModule`.
    """

    name = "blobs"
    class_names = BLOBS_CLASSES
    palette = BLOBS_PALETTE

    def __init__(self, num_train: int = 2000, num_val: int = 200, num_test: int = 200, size: int = 64,
                 crop: int | Sequence[int] | None = None, *, scale_range: Sequence[float] = (0.75, 1.5),
                 batch_size: int = 8, eval_batch_size: int = 8, num_workers: int = 0, pretrained: bool = False,
                 **options):  # fmt: skip
        size = int_option("size", size, 16, 64)  # before super(): the hyper-parameters record the int
        super().__init__(None, crop=size if crop is None else crop, scale_range=scale_range, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, num_workers=num_workers, **options)  # fmt: skip
        self.size = size
        self.pretrained = bool_option("pretrained", pretrained)
        self.num_train = int_option("num_train", num_train, 1, 2000)
        self.num_val = int_option("num_val", num_val, 1, 200)
        self.num_test = int_option("num_test", num_test, 1, 200)

    def generate(self, split: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``count`` samples of ``split``: images uint8 (count, S, S, 3), masks uint8 (count, S, S)."""
        samples = [blob_sample(np.random.default_rng([self.seed, SPLITS[split], i]), self.size)
                   for i in range(count)]  # fmt: skip
        return np.stack([im for im, _ in samples]), np.stack([m for _, m in samples])

    def _sources(self) -> dict[str, ArraySource]:
        sources = {}
        for split, count in (("train", self.num_train), ("val", self.num_val), ("test", self.num_test)):
            images, masks = self.generate(split, count)
            sources[split] = ArraySource(images, masks, np.arange(count), [f"blobs {split} {i}" for i in range(count)])
        return sources
