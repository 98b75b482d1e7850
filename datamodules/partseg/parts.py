"""Parts: a generated part-segmentation data set of composite shapes (config ``parts``).

No files: every split is generated with numpy in :meth:`Parts.setup`,
deterministically from ``seed``. Each category is an object assembled from
analytic surfaces (boxes, cylinders, cones, an ellipsoid, a torus arc), each
surface labelled with its part; per shape the proportions are drawn from
category-specific ranges. Categories, in order, and their parts (global ids
are contiguous, category by category: the first four categories have 12 parts)::

    airplane  fuselage (ellipsoid), wing (two swept plates), tail (fin + stabiliser), engine (two nacelles)
    lamp      base (flat cylinder), pole (thin cylinder), shade (open cone frustum)
    rocket    body (cylinder), nose (cone), fin (3 or 4 plates)
    table     top (plate), leg (four legs)
    mug       body (cylinder, open top), handle (torus arc)
    chair     back (plate), seat (plate), leg (four legs), arm (two rails on posts)

A shape of ``npoints`` points is sampled uniformly by area over its surfaces (the
counts per surface are proportional to the surface areas, so every part is
present once ``npoints`` is a few dozen), with the analytic outward normals, then

1. a rotation (``rotation``: ``"z"``, uniform about the vertical z axis, the
   default: objects stay upright as in ShapeNet; ``"so3"``, uniformly random;
   ``"none"``),
2. Gaussian jitter of standard deviation ``noise`` on the points (not the normals),
3. normalisation to the unit sphere (centroid at the origin, farthest point at 1).

Split ``s`` of category ``c`` is drawn from ``np.random.default_rng([seed, s, c])``
with s = 0, 1, 2 for train, val, test, so changing ``num_categories`` or another
split's size leaves a category's shapes unchanged. Batches, point sampling and
train augmentation: see :mod:`datamodules.partseg.base`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attention.errors import UserError
from datamodules.base import SPLITS, choice_option, float_option, split_sizes_option
from datamodules.partseg.base import PackedSource, PartSegDataModule, contiguous_parts
from datamodules.points.ops import random_rotations, unit_sphere

ROTATIONS = ("z", "so3", "none")

Sample = tuple[np.ndarray, np.ndarray]  # points (k, 3), normals (k, 3)
# A placed surface: (local part id, area, sampler(rng, k) -> Sample in its own frame, rotation (3, 3), translation (3,))
Surface = tuple[int, float, Callable[[np.random.Generator, int], Sample], np.ndarray, np.ndarray]

EYE = np.eye(3)


def _rot(axis: int, angle: float) -> np.ndarray:
    """Rotation by ``angle`` about coordinate axis ``axis`` (0 = x, 1 = y, 2 = z), (3, 3)."""
    c, s = np.cos(angle), np.sin(angle)
    i, j = [(1, 2), (2, 0), (0, 1)][axis]
    m = np.eye(3)
    m[i, i], m[i, j], m[j, i], m[j, j] = c, -s, s, c
    return m


# ---------------------------------------------------------------------------
# Surfaces in their own frames: points and unit outward normals.


def _box(rng: np.random.Generator, k: int, half: np.ndarray) -> Sample:
    """Area-uniform points on the surface of an axis-aligned box with half extents ``half`` (3,)."""
    face_area = np.prod(half) / half  # (3,): area (/4) of the faces normal to x, y, z
    axis = rng.choice(3, k, p=face_area / face_area.sum())
    sign = rng.choice([-1.0, 1.0], k)
    on_face = axis[:, None] == np.arange(3)  # (k, 3)
    pts = np.where(on_face, sign[:, None] * half, rng.uniform(-1, 1, (k, 3)) * half)
    return pts, on_face * sign[:, None]


def _box_area(half) -> float:
    hx, hy, hz = half
    return 8.0 * (hx * hy + hy * hz + hx * hz)


def _frustum(rng: np.random.Generator, k: int, r0: float, r1: float, z0: float, z1: float) -> Sample:
    """Area-uniform points on the side of a z-axis cone frustum (radius r0 at z0, r1 at z1; cylinder if equal)."""
    u = rng.random(k)
    r = np.sqrt(r0**2 + u * (r1**2 - r0**2))  # inverse CDF of the density, proportional to the radius
    t = (r - r0) / (r1 - r0) if abs(r1 - r0) > 1e-9 else u
    theta = rng.uniform(0, 2 * np.pi, k)
    cos, sin = np.cos(theta), np.sin(theta)
    pts = np.stack([r * cos, r * sin, z0 + t * (z1 - z0)], axis=1)
    nrm = np.stack([cos, sin, np.full(k, (r0 - r1) / (z1 - z0))], axis=1)
    return pts, nrm / np.linalg.norm(nrm, axis=1, keepdims=True)


def _disk(rng: np.random.Generator, k: int, radius: float, z: float, up: bool) -> Sample:
    """Area-uniform points on a disk in the plane z, normal +z (``up``) or -z."""
    r = radius * np.sqrt(rng.random(k))
    theta = rng.uniform(0, 2 * np.pi, k)
    pts = np.stack([r * np.cos(theta), r * np.sin(theta), np.full(k, z)], axis=1)
    return pts, np.tile([0.0, 0.0, 1.0 if up else -1.0], (k, 1))


def _ellipsoid(rng: np.random.Generator, k: int, axes: np.ndarray) -> Sample:
    """Points on an ellipsoid with semi-axes ``axes`` (a stretched sphere: roughly uniform by area)."""
    u = rng.standard_normal((k, 3))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    nrm = u / axes
    return u * axes, nrm / np.linalg.norm(nrm, axis=1, keepdims=True)


def _ellipsoid_area(axes) -> float:
    a, b, c = np.power(axes, 1.6075)
    return 4 * np.pi * ((a * b + a * c + b * c) / 3) ** (1 / 1.6075)  # Knud Thomsen's approximation


def _torus_arc(rng: np.random.Generator, k: int, big: float, small: float, a0: float, a1: float) -> Sample:
    """Area-uniform points on a torus (ring radius ``big`` in the xy plane, tube ``small``), ring angles a0..a1."""
    phi = np.zeros(0)  # tube angle, density ~ big + small cos(phi): rejection sampling
    while len(phi) < k:
        candidate = rng.uniform(0, 2 * np.pi, 2 * k + 8)
        accept = rng.random(len(candidate)) * (big + small) < big + small * np.cos(candidate)
        phi = np.concatenate([phi, candidate[accept]])
    phi = phi[:k]
    theta = rng.uniform(a0, a1, k)
    nrm = np.stack([np.cos(phi) * np.cos(theta), np.cos(phi) * np.sin(theta), np.sin(phi)], axis=1)
    centre = np.stack([big * np.cos(theta), big * np.sin(theta), np.zeros(k)], axis=1)
    return centre + small * nrm, nrm


# Placed surfaces.


def box(part: int, half, at=(0.0, 0.0, 0.0), rot: np.ndarray = EYE) -> list[Surface]:
    half = np.asarray(half, dtype=float)
    return [(part, _box_area(half), lambda rng, k: _box(rng, k, half), rot, np.asarray(at, dtype=float))]


def frustum(part: int, r0: float, r1: float, z0: float, z1: float, bottom: bool = False, top: bool = False,
            at=(0.0, 0.0, 0.0), rot: np.ndarray = EYE) -> list[Surface]:  # fmt: skip
    """A z-axis frustum side (cylinder when r0 == r1, cone when r1 == 0) with optional end disks."""
    at = np.asarray(at, dtype=float)
    side = np.pi * (r0 + r1) * np.hypot(r1 - r0, z1 - z0)
    out = [(part, side, lambda rng, k: _frustum(rng, k, r0, r1, z0, z1), rot, at)]
    if bottom:
        out.append((part, np.pi * r0**2, lambda rng, k: _disk(rng, k, r0, z0, up=False), rot, at))
    if top:
        out.append((part, np.pi * r1**2, lambda rng, k: _disk(rng, k, r1, z1, up=True), rot, at))
    return out


def ellipsoid(part: int, axes, at=(0.0, 0.0, 0.0)) -> list[Surface]:
    axes = np.asarray(axes, dtype=float)
    return [(part, _ellipsoid_area(axes), lambda rng, k: _ellipsoid(rng, k, axes), EYE, np.asarray(at, float))]


def torus_arc(part: int, big: float, small: float, a0: float, a1: float, at, rot: np.ndarray) -> list[Surface]:
    area = (a1 - a0) * big * 2 * np.pi * small
    return [(part, area, lambda rng, k: _torus_arc(rng, k, big, small, a0, a1), rot, np.asarray(at, float))]


# ---------------------------------------------------------------------------
# Categories: canonical pose, z up, roughly 1-2 units across.


def _airplane(rng: np.random.Generator) -> list[Surface]:
    fuselage, wing, tail, engine = range(4)
    length, radius = rng.uniform(0.9, 1.1), rng.uniform(0.09, 0.13)  # half length, fuselage radius
    span, chord, sweep = rng.uniform(0.75, 1.0), rng.uniform(0.13, 0.2), rng.uniform(0.0, 0.5)  # half span
    xw, zw = rng.uniform(-0.1, 0.15), rng.uniform(-0.5, 0.2) * radius  # wing root position
    out = ellipsoid(fuselage, [length, radius, radius * rng.uniform(1.0, 1.2)])
    for side in (1, -1):  # wings swept back by `sweep`, each half a span long
        out += box(wing, [chord, span / 2, 0.015], rot=_rot(2, side * sweep),
                   at=[xw - np.sin(sweep) * span / 2, side * np.cos(sweep) * span / 2, zw])  # fmt: skip
    xt, fin_height = -0.85 * length, rng.uniform(0.15, 0.22)
    out += box(tail, [rng.uniform(0.1, 0.15), 0.015, fin_height], at=[xt, 0, 0.5 * radius + fin_height])
    stabiliser = [rng.uniform(0.08, 0.12), rng.uniform(0.25, 0.35), 0.015]
    out += box(tail, stabiliser, at=[xt, 0, rng.uniform(0, 0.5) * radius])
    r_eng, l_eng, y_eng = rng.uniform(0.06, 0.085), rng.uniform(0.14, 0.2), rng.uniform(0.3, 0.5) * span
    for side in (1, -1):  # nacelles under the wings, along x
        at = [xw - np.sin(sweep) * y_eng + 0.05, side * np.cos(sweep) * y_eng, zw - r_eng - 0.02]
        out += frustum(engine, r_eng, r_eng, -l_eng, l_eng, bottom=True, top=True, at=at, rot=_rot(1, np.pi / 2))
    return out


def _lamp(rng: np.random.Generator) -> list[Surface]:
    base, pole, shade = range(3)
    r_base, h_base = rng.uniform(0.3, 0.45), rng.uniform(0.04, 0.09)
    top, r_pole = rng.uniform(1.1, 1.5), rng.uniform(0.025, 0.045)
    h_shade, r_low, r_high = rng.uniform(0.3, 0.45), rng.uniform(0.3, 0.45), rng.uniform(0.12, 0.22)
    return (
        frustum(base, r_base, r_base, 0.0, h_base, bottom=True, top=True)
        + frustum(pole, r_pole, r_pole, h_base, top)
        + frustum(shade, r_low, r_high, top - 0.7 * h_shade, top + 0.3 * h_shade)  # open at both ends
    )


def _rocket(rng: np.random.Generator) -> list[Surface]:
    body, nose, fin = range(3)
    radius, length, nose_length = rng.uniform(0.13, 0.2), rng.uniform(1.2, 1.6), rng.uniform(0.25, 0.45)
    out = frustum(body, radius, radius, 0.0, length, bottom=True)
    out += frustum(nose, radius, 0.0, length, length + nose_length)
    fins, phase = rng.choice([3, 4]), rng.uniform(0, 2 * np.pi)
    reach, height = rng.uniform(0.15, 0.25), rng.uniform(0.15, 0.25)  # radial length, half height
    for i in range(fins):
        angle = phase + 2 * np.pi * i / fins
        centre = (radius + reach / 2) * np.array([np.cos(angle), np.sin(angle), 0.0]) + [0, 0, height - 0.08]
        out += box(fin, [reach / 2, 0.012, height], at=centre, rot=_rot(2, angle))
    return out


def _table(rng: np.random.Generator) -> list[Surface]:
    top, leg = range(2)
    a = rng.uniform(0.6, 0.9)
    b, thick, height = a * rng.uniform(0.5, 1.0), rng.uniform(0.025, 0.045), rng.uniform(0.6, 0.85)
    width, inset, round_legs = rng.uniform(0.03, 0.05), rng.uniform(0.05, 0.15), rng.random() < 0.5
    out = box(top, [a, b, thick], at=[0, 0, height])
    for sx in (1, -1):
        for sy in (1, -1):
            at = [sx * (a - inset), sy * (b - inset), 0.0]
            if round_legs:
                out += frustum(leg, width, width, 0.0, height - thick, bottom=True, at=at)
            else:
                out += box(leg, [width, width, (height - thick) / 2], at=[at[0], at[1], (height - thick) / 2])
    return out


def _mug(rng: np.random.Generator) -> list[Surface]:
    body, handle = range(2)
    radius, height = rng.uniform(0.35, 0.45), rng.uniform(0.8, 1.1)
    big, small = rng.uniform(0.28, 0.36) * height, rng.uniform(0.06, 0.085)
    # torus ring in the xz plane (rotate the xy ring about x), outer half, ends on the wall
    return frustum(body, radius, radius, 0.0, height, bottom=True) + torus_arc(
        handle, big, small, -np.pi / 2, np.pi / 2, at=[radius - 0.02, 0, height / 2], rot=_rot(0, np.pi / 2))


def _chair(rng: np.random.Generator) -> list[Surface]:
    back, seat, leg, arm = range(4)
    w, d, h, t = rng.uniform(0.4, 0.5), rng.uniform(0.4, 0.5), rng.uniform(0.4, 0.5), rng.uniform(0.03, 0.05)
    back_thick, back_half = rng.uniform(0.025, 0.04), rng.uniform(0.3, 0.45)
    out = box(seat, [d, w, t], at=[0, 0, h])
    out += box(back, [back_thick, w, back_half], at=[-d + back_thick, 0, h + t + back_half],
               rot=_rot(1, -rng.uniform(0.0, 0.25)))  # fmt: skip
    r_leg = rng.uniform(0.025, 0.04)
    for sx in (1, -1):
        for sy in (1, -1):
            out += frustum(leg, r_leg, r_leg, 0.0, h - t, bottom=True, at=[sx * (d - 0.05), sy * (w - 0.05), 0.0])
    arm_height, arm_half = rng.uniform(0.18, 0.28), rng.uniform(0.02, 0.035)
    for sy in (1, -1):
        y = sy * (w - arm_half)
        out += box(arm, [0.8 * d, arm_half, arm_half], at=[0, y, h + t + arm_height])
        out += box(arm, [arm_half, arm_half, arm_height / 2], at=[0.6 * d, y, h + t + arm_height / 2])
    return out


CATEGORIES: dict[str, tuple[list[str], Callable[[np.random.Generator], list[Surface]]]] = {
    "airplane": (["fuselage", "wing", "tail", "engine"], _airplane),
    "lamp": (["base", "pole", "shade"], _lamp),
    "rocket": (["body", "nose", "fin"], _rocket),
    "table": (["top", "leg"], _table),
    "mug": (["body", "handle"], _mug),
    "chair": (["back", "seat", "leg", "arm"], _chair),
}
CATEGORY_NAMES = list(CATEGORIES)


def _allocate(areas: np.ndarray, n: int) -> np.ndarray:
    """Split n into integer counts proportional to ``areas`` (largest remainders)."""
    quota = areas / areas.sum() * n
    counts = np.floor(quota).astype(int)
    counts[np.argsort(-(quota - counts), kind="stable")[: n - counts.sum()]] += 1
    return counts


def _sample_surfaces(rng: np.random.Generator, surfaces: list[Surface], n: int):
    """n points over the surfaces, uniform by area: points (n, 3), normals (n, 3), local part ids (n,)."""
    counts = _allocate(np.array([s[1] for s in surfaces]), n)
    pts, nrm, lab = [], [], []
    for (part, _, sampler, rot, at), k in zip(surfaces, counts):
        if k:
            p, q = sampler(rng, k)
            pts.append(p @ rot.T + at)
            nrm.append(q @ rot.T)
            lab.append(np.full(k, part))
    return np.concatenate(pts), np.concatenate(nrm), np.concatenate(lab)


def generate_parts(
    num_categories: int, per_category: int, npoints: int, noise: float, seed: int, split: str, rotation: str = "z"
) -> PackedSource:
    """Generate one split: ``num_categories * per_category`` shapes of ``npoints`` points, grouped by category.

    Returns a :class:`~datamodules.partseg.base.PackedSource` with points (normalised),
    normals, global part ids (uint8) and categories.
    """
    parts = contiguous_parts([len(CATEGORIES[name][0]) for name in CATEGORY_NAMES])
    points, normals, labels, categories = [], [], [], []
    for c, name in enumerate(CATEGORY_NAMES[:num_categories]):
        rng = np.random.default_rng([seed, SPLITS[split], c])
        build = CATEGORIES[name][1]
        if rotation == "so3":
            rotations = random_rotations(rng, per_category)
        elif rotation == "z":
            rotations = np.stack([_rot(2, a) for a in rng.uniform(0, 2 * np.pi, per_category)]) if per_category else []
        else:
            rotations = [EYE] * per_category
        for rot in rotations:
            pts, nrm, lab = _sample_surfaces(rng, build(rng), npoints)
            pts = pts @ rot.T + noise * rng.standard_normal(pts.shape)
            points.append(pts)
            normals.append(nrm @ rot.T)
            labels.append(lab + parts[c][0])
        categories.append(np.full(per_category, c, dtype=np.int64))
    n = num_categories * per_category
    offsets = np.arange(n + 1, dtype=np.int64) * npoints
    flat = np.concatenate(points) if n else np.zeros((0, 3))
    return PackedSource(
        unit_sphere(flat, offsets) if n else flat.astype(np.float32),
        (np.concatenate(labels) if n else np.zeros(0)).astype(np.uint8),
        offsets,
        np.concatenate(categories),
        (np.concatenate(normals) if n else np.zeros((0, 3))).astype(np.float32),
    )


class Parts(PartSegDataModule):
    """Generated composite shapes with labelled parts (see the module docstring); config name ``parts``.

    Args:
        root: unused (nothing is read or cached); accepted so all data configs share it.
        num_categories: use the first ``num_categories`` of :data:`CATEGORY_NAMES` (1..6).
        train_per_category, val_per_category, test_per_category: shapes per category and
            split; ``val_per_category=0`` validates on the test split.
        noise: standard deviation of the Gaussian jitter (before normalisation).
        rotation: ``"z"`` (about the vertical axis), ``"so3"`` or ``"none"``.
        options: those of :class:`~datamodules.partseg.base.PartSegDataModule` (``npoints``: points
            generated per shape, each sample is a permutation of them; ``normals``: the analytic surface
            normals; ``seed`` also seeds the generation; there are no files, so nothing to skip).
    """

    def __init__(self, root: str | None = None, num_categories: int = 4, train_per_category: int = 100,
                 val_per_category: int = 10, test_per_category: int = 20, noise: float = 0.005, rotation: str = "z",
                 **options):  # fmt: skip
        super().__init__(root, **options)
        if num_categories not in range(1, len(CATEGORY_NAMES) + 1):
            raise UserError(
                f"data.num_categories must be in 1..{len(CATEGORY_NAMES)} for Parts "
                f"({', '.join(CATEGORY_NAMES)}), got {num_categories!r}."
            )
        per_category = split_sizes_option("per_category", train_per_category, val_per_category,
                                          test_per_category, 100)  # fmt: skip
        self.noise = float_option("noise", noise, 0.005, low_closed=True)
        self.rotation = choice_option("rotation", rotation, ROTATIONS)
        k = int(num_categories)
        self._set_categories(CATEGORY_NAMES[:k], contiguous_parts([len(CATEGORIES[c][0]) for c in CATEGORY_NAMES[:k]]))
        self.part_names = [f"{c}/{p}" for c in self.category_names for p in CATEGORIES[c][0]]
        self.per_category = per_category

    def _generate(self, split: str) -> PackedSource:
        return generate_parts(self.num_categories, self.per_category[split], self.npoints, self.noise, self.seed,
                              split, self.rotation)  # fmt: skip

    def _load(self) -> tuple[PackedSource, PackedSource | None, PackedSource]:
        val = self._generate("val") if self.per_category["val"] > 0 else None
        return self._generate("train"), val, self._generate("test")
