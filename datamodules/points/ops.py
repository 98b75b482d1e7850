"""Point-cloud operations shared by the classification and part-segmentation families.

Training augmentation follows the PCT / DGCNN ModelNet40 reference code (``random_point_dropout``,
``translate_pointcloud``, ``np.random.shuffle``), applied to a copy (the reference code corrupts its cached
array in place; we never do). Randomness comes from :func:`sample_rng`, a numpy Generator seeded per sample
from torch's default generator, which ``lightning.seed_everything(seed, workers=True)`` seeds in the main
process and DataLoader seeds per worker: two identically seeded runs see identical samples, with or
without workers.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_DROPOUT_RATIO = 0.875
SCALE_RANGE = (2.0 / 3.0, 3.0 / 2.0)
SHIFT_RANGE = (-0.2, 0.2)


def augment_points(points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return an augmented float32 copy of ``points`` (N, 3); the input is never modified."""
    pts = np.array(points, dtype=np.float32, copy=True)  # (N, 3)
    ratio = rng.random() * MAX_DROPOUT_RATIO
    drop = rng.random(len(pts)) <= ratio  # (N,)
    pts[drop] = pts[0].copy()
    pts = scale_shift(pts, rng)
    rng.shuffle(pts)  # permutes rows (points)
    return pts


def scale_shift(points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The reference ``translate_pointcloud``: a float32 copy of ``points`` (N, 3) times a
    per-axis scale ~ U(2/3, 3/2) plus a per-axis shift ~ U(-0.2, 0.2) (drawn in that order)."""
    scale = rng.uniform(*SCALE_RANGE, size=3)
    shift = rng.uniform(*SHIFT_RANGE, size=3)
    return (points * scale + shift).astype(np.float32)


def sample_rng() -> np.random.Generator:
    """A fresh numpy Generator seeded from torch's default generator (per process / worker)."""
    return np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))


def random_rotations(rng: np.random.Generator, m: int) -> np.ndarray:
    """Uniformly random rotation matrices from unit quaternions, (m, 3, 3)."""
    q = rng.standard_normal((m, 4))
    w, x, y, z = (q / np.linalg.norm(q, axis=1, keepdims=True)).T
    return np.stack([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]).transpose(2, 0, 1)  # (3, 3, m) -> (m, 3, 3)


def unit_sphere(points: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each packed shape centred at its centroid and divided by its largest norm; float32 (T, 3).

    A shape whose points all coincide is only centred. Every shape needs >= 1 point. The
    arithmetic is done in float64 when ``points`` is float64 (then any finite input gives a
    finite result), else in float32 (huge coordinates may then overflow: callers check).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    counts, starts = np.diff(offsets), offsets[:-1]  # (n,) each
    dtype = np.float64 if np.asarray(points).dtype == np.float64 else np.float32
    pts = np.asarray(points, dtype=dtype)
    centroid = np.add.reduceat(pts, starts, axis=0, dtype=np.float64) / counts[:, None]  # (n, 3)
    with np.errstate(over="ignore", invalid="ignore"):
        centred = pts - np.repeat(centroid.astype(dtype), counts, axis=0)  # (T, 3)
        scale = np.maximum.reduceat(np.abs(centred).max(axis=1), starts)  # (n,), keeps the norms in range
        scale[scale == 0] = 1.0
        centred /= np.repeat(scale, counts)[:, None]
        radius = np.maximum.reduceat(np.linalg.norm(centred, axis=1), starts)  # (n,)
        radius[radius == 0] = 1.0
        centred /= np.repeat(radius, counts)[:, None]
    return centred.astype(np.float32, copy=False)
