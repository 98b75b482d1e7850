"""Shapes: a generated point-cloud classification data set (config ``shapes``).

No files: every split is generated with numpy in :meth:`Shapes.setup`,
deterministically from ``seed``. Each class is a parametric surface or curve
(see :data:`SHAPE_NAMES`); a sample is ``npoints`` points drawn on it
(uniformly by area or arc length, except for the ellipsoid and the trefoil,
which are only roughly uniform), with per-sample shape parameters jittered in
class-specific ranges, then

1. a uniformly random 3-D rotation,
2. a uniform random scale in [0.5, 1.5],
3. Gaussian jitter of standard deviation ``noise``,
4. normalisation to the unit sphere (centroid at the origin, farthest point at
   distance 1).

The classes differ in geometry alone (no orientation or size cue survives
steps 1-4). Split ``s`` of class ``c`` is drawn from
``np.random.default_rng([seed, s, c])`` with s = 0, 1, 2 for train, val, test,
so the splits never share a random stream, and changing ``num_classes`` or
another split's size leaves a class's samples unchanged.

``num_classes`` and ``class_names`` are available right after construction.
Batches, train augmentation and validation protocol: see
:mod:`datamodules.points.base`; validation uses the generated val split, or, when
``val_per_class == 0``, follows ``val_fraction`` like the other modules.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from attention.errors import UserError
from datamodules.base import SPLITS, float_option, split_sizes_option
from datamodules.points.base import ArraySource, PointCloudDataModule, PointSource
from datamodules.points.ops import random_rotations

SCALE_RANGE = (0.5, 1.5)


def _unit_vectors(rng: np.random.Generator, m: int, n: int) -> np.ndarray:
    """Uniform points on the unit sphere, (m, n, 3)."""
    v = rng.standard_normal((m, n, 3))
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _choose(rng: np.random.Generator, weights: np.ndarray, n: int) -> np.ndarray:
    """Per sample, n part indices drawn with probabilities proportional to ``weights`` (m, k); returns (m, n)."""
    cum = np.cumsum(weights, axis=1)
    cum = cum / cum[:, -1:]  # (m, k), last column 1
    u = rng.random((len(weights), n))
    return (u[:, :, None] > cum[:, None, :-1]).sum(axis=-1)


def _mix(parts: list[np.ndarray], which: np.ndarray) -> np.ndarray:
    """Pick, per point, the candidate of part ``which`` (m, n) from ``parts``, each (m, n, 3)."""
    stacked = np.stack(parts)  # (k, m, n, 3)
    return np.take_along_axis(stacked, which[None, :, :, None], axis=0)[0]


def _disk(rng: np.random.Generator, m: int, n: int, inner: np.ndarray | float, outer: np.ndarray | float, z):
    """Area-uniform points on an annulus in the plane z (radii and z: scalars or (m, 1)); (m, n, 3)."""
    inner2, outer2 = np.square(inner), np.square(outer)
    r = np.sqrt(inner2 + rng.random((m, n)) * (outer2 - inner2))
    theta = rng.uniform(0, 2 * np.pi, (m, n))
    return np.stack([r * np.cos(theta), r * np.sin(theta), np.broadcast_to(z, (m, n))], axis=-1)


def _tube(rng: np.random.Generator, m: int, n: int, radius, z0, z1) -> np.ndarray:
    """Uniform points on the side of a z-axis cylinder from z0 to z1; (m, n, 3)."""
    theta = rng.uniform(0, 2 * np.pi, (m, n))
    z = z0 + rng.random((m, n)) * (z1 - z0)
    return np.stack([radius * np.cos(theta), radius * np.sin(theta), z], axis=-1)


def _triangles(rng: np.random.Generator, verts: np.ndarray, n: int) -> np.ndarray:
    """Area-uniform points on triangle meshes ``verts`` (m, T, 3 corners, 3); (m, n, 3)."""
    a, b, c = verts[:, :, 0], verts[:, :, 1], verts[:, :, 2]  # each (m, T, 3)
    area = 0.5 * np.linalg.norm(np.cross(b - a, c - a), axis=-1)  # (m, T)
    face = _choose(rng, area, n)  # (m, n)
    rows = np.arange(len(verts))[:, None]
    tri = verts[rows, face]  # (m, n, 3 corners, 3)
    uv = rng.random((len(verts), n, 2))
    flip = uv.sum(axis=-1) > 1
    uv[flip] = 1 - uv[flip]
    return tri[:, :, 0] + uv[..., :1] * (tri[:, :, 1] - tri[:, :, 0]) + uv[..., 1:] * (tri[:, :, 2] - tri[:, :, 0])


def _sphere(rng, m, n):
    return _unit_vectors(rng, m, n)


def _cube(rng, m, n):
    half = np.column_stack([np.ones(m), rng.uniform(0.85, 1.0, (m, 2))])  # (m, 3) half extents
    face_area = np.prod(half, axis=1, keepdims=True) / half  # (m, 3): area of the faces normal to x, y, z
    axis = _choose(rng, face_area, n)  # (m, n)
    pts = rng.uniform(-1, 1, (m, n, 3)) * half[:, None, :]
    sign = rng.choice([-1.0, 1.0], (m, n))
    on_face = axis[:, :, None] == np.arange(3)  # (m, n, 3)
    return np.where(on_face, sign[:, :, None] * half[:, None, :], pts)


def _cylinder(rng, m, n):
    r, h = 0.5, rng.uniform(1.0, 1.2, (m, 1))  # radius, half height
    parts = [_tube(rng, m, n, r, -h, h), _disk(rng, m, n, 0, r, -h), _disk(rng, m, n, 0, r, h)]
    weights = np.hstack([4 * np.pi * r * h, np.full((m, 2), np.pi * r**2)])
    return _mix(parts, _choose(rng, weights, n))


def _cone(rng, m, n):
    r, height = 1.0, rng.uniform(2.2, 2.8, (m, 1))
    t = np.sqrt(rng.random((m, n)))  # distance from the apex along the side, as a fraction
    theta = rng.uniform(0, 2 * np.pi, (m, n))
    side = np.stack([r * t * np.cos(theta), r * t * np.sin(theta), height * (1 - t)], axis=-1)
    parts = [side, _disk(rng, m, n, 0, r, 0.0)]
    weights = np.hstack([np.pi * r * np.sqrt(r**2 + height**2), np.full((m, 1), np.pi * r**2)])
    return _mix(parts, _choose(rng, weights, n))


def _torus(rng, m, n):
    big, small = 1.0, rng.uniform(0.25, 0.4, (m, 1))
    # Tube angle phi has density proportional to big + small*cos(phi): rejection from
    # 3n candidates, accepted ones first (acceptance >= 0.43, so almost always n of them).
    phi = rng.uniform(0, 2 * np.pi, (m, 3 * n))
    accept = rng.random((m, 3 * n)) * (big + small) < big + small * np.cos(phi)
    phi = np.take_along_axis(phi, np.argsort(~accept, axis=1, kind="stable")[:, :n], axis=1)  # (m, n)
    theta = rng.uniform(0, 2 * np.pi, (m, n))
    ring = big + small * np.cos(phi)
    return np.stack([ring * np.cos(theta), ring * np.sin(theta), small * np.sin(phi)], axis=-1)


def _ellipsoid(rng, m, n):
    axes = np.array([1.0, 0.8, 0.25]) * rng.uniform(0.95, 1.05, (m, 3))  # (m, 3) semi-axes
    # A stretched sphere: denser near the flat sides than uniform by area, which is fine here.
    return _unit_vectors(rng, m, n) * axes[:, None, :]


def _helix(rng, m, n):
    turns, half_height = rng.uniform(2.5, 3.5, (m, 1)), rng.uniform(1.0, 1.4, (m, 1))
    t = rng.random((m, n))  # constant speed curve: uniform t is uniform in arc length
    angle = 2 * np.pi * turns * t
    return np.stack([np.cos(angle), np.sin(angle), half_height * (2 * t - 1)], axis=-1)


def _annulus(rng, m, n):
    return _disk(rng, m, n, rng.uniform(0.35, 0.5, (m, 1)), 1.0, 0.0)


def _dumbbell(rng, m, n):
    ball, bar, center = 0.5, 0.1, rng.uniform(1.1, 1.3, (m, 1, 1))  # radii, ball center distance
    offset = center * np.array([0.0, 0.0, 1.0])  # (m, 1, 3)
    reach = center[:, :, 0] - ball  # (m, 1): bar half length
    parts = [ball * _unit_vectors(rng, m, n) + offset, ball * _unit_vectors(rng, m, n) - offset,
             _tube(rng, m, n, bar, -reach, reach)]  # fmt: skip
    weights = np.hstack([np.full((m, 2), 4 * np.pi * ball**2), 4 * np.pi * bar * reach])
    return _mix(parts, _choose(rng, weights, n))


def _tetrahedron(rng, m, n):
    v = np.array([[1, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]], dtype=float)
    faces = v[[[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]]]  # (4 faces, 3 corners, 3)
    return _triangles(rng, np.broadcast_to(faces, (m, *faces.shape)), n)


def _capsule(rng, m, n):
    r, h = 0.5, rng.uniform(0.5, 0.8, (m, 1))  # radius, half length of the straight part
    cap = r * _unit_vectors(rng, m, n)
    cap[..., 2] = np.abs(cap[..., 2])
    top = cap + np.stack([np.zeros_like(h), np.zeros_like(h), h], axis=-1)
    parts = [_tube(rng, m, n, r, -h, h), top, -top]
    weights = np.hstack([4 * np.pi * r * h, np.full((m, 2), 2 * np.pi * r**2)])
    return _mix(parts, _choose(rng, weights, n))


def _square_pyramid(rng, m, n):
    height = rng.uniform(1.2, 1.6, m)
    base = np.array([[-1, -1, 0], [1, -1, 0], [1, 1, 0], [-1, 1, 0]], dtype=float)
    verts = np.zeros((m, 5, 3))
    verts[:, :4] = base
    verts[:, 4, 2] = height  # apex
    faces = [[0, 1, 2], [0, 2, 3], [0, 1, 4], [1, 2, 4], [2, 3, 4], [3, 0, 4]]
    return _triangles(rng, verts[:, faces], n)  # (m, 6 faces, 3 corners, 3)


def _trefoil(rng, m, n):
    t = rng.uniform(0, 2 * np.pi, (m, n))
    return np.stack([np.sin(t) + 2 * np.sin(2 * t), np.cos(t) - 2 * np.cos(2 * t), -np.sin(3 * t)], axis=-1)


SAMPLERS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "sphere": _sphere,
    "cube": _cube,
    "cylinder": _cylinder,
    "cone": _cone,
    "torus": _torus,
    "ellipsoid": _ellipsoid,
    "helix": _helix,
    "annulus": _annulus,
    "dumbbell": _dumbbell,
    "tetrahedron": _tetrahedron,
    "capsule": _capsule,
    "square_pyramid": _square_pyramid,
    "trefoil": _trefoil,
}
SHAPE_NAMES = list(SAMPLERS)


def generate_shapes(
    num_classes: int, per_class: int, npoints: int, noise: float, seed: int, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """Generate one split: points (num_classes * per_class, npoints, 3) float32, labels int64.

    Samples are grouped by class (label c occupies rows c*per_class .. (c+1)*per_class - 1).
    """
    points, labels = [], []
    for label, sampler in enumerate(list(SAMPLERS.values())[:num_classes]):
        rng = np.random.default_rng([seed, SPLITS[split], label])
        pts = sampler(rng, per_class, npoints)  # (m, n, 3) canonical shape
        pts = np.einsum("mij,mnj->mni", random_rotations(rng, per_class), pts)
        pts = pts * rng.uniform(*SCALE_RANGE, (per_class, 1, 1))
        pts = pts + noise * rng.standard_normal(pts.shape)
        pts = pts - pts.mean(axis=1, keepdims=True)
        pts = pts / np.linalg.norm(pts, axis=-1).max(axis=1)[:, None, None]
        points.append(pts.astype(np.float32))
        labels.append(np.full(per_class, label, dtype=np.int64))
    return np.concatenate(points), np.concatenate(labels)


class Shapes(PointCloudDataModule):
    """Generated parametric shapes (see the module docstring); config name ``shapes``.

    Args:
        root: unused (nothing is read or cached); accepted so all data configs share it.
        num_classes: use the first ``num_classes`` entries of :data:`SHAPE_NAMES`.
        train_per_class, val_per_class, test_per_class: samples per class and split;
            ``val_per_class=0`` makes validation follow ``val_fraction``.
        noise: standard deviation of the Gaussian jitter (before normalisation).
        options: those of :class:`~datamodules.points.base.PointCloudDataModule` (``npoints``: points
            per shape; ``seed`` also seeds the generation; there are no files, so nothing to skip).
    """

    def __init__(self, root: str | None = None, num_classes: int = 10, train_per_class: int = 100,
                 val_per_class: int = 20, test_per_class: int = 30, noise: float = 0.01, **options):  # fmt: skip
        super().__init__(root, **options)
        if num_classes not in range(1, len(SHAPE_NAMES) + 1):
            raise UserError(
                f"data.num_classes must be in 1..{len(SHAPE_NAMES)} for Shapes ({', '.join(SHAPE_NAMES)}), "
                f"got {num_classes!r}."
            )
        per_class = split_sizes_option("per_class", train_per_class, val_per_class, test_per_class, 100)
        if per_class["val"] > 0 and self.val_fraction > 0:
            raise UserError(
                f"Shapes generates its own validation split (data.val_per_class={val_per_class}), so "
                f"data.val_fraction={self.val_fraction} is ambiguous; set one of them to 0."
            )
        self.num_classes = int(num_classes)
        self.class_names = SHAPE_NAMES[: self.num_classes]
        self.per_class = per_class
        self.noise = float_option("noise", noise, 0.01, low_closed=True)

    def _generate(self, split: str) -> ArraySource:
        per_class = self.per_class[split]
        return ArraySource(*generate_shapes(self.num_classes, per_class, self.npoints, self.noise, self.seed, split))

    def _load(self) -> tuple[PointSource, PointSource | None, PointSource]:
        val = self._generate("val") if self.per_class["val"] > 0 else None
        return self._generate("train"), val, self._generate("test")
