"""Farthest point sampling and kNN against brute-force float64 loops."""

import math
import os
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from attention.pointops import (KERNEL_MIN_SQUARED_NORM, farthest_point_sample, fma32, fps_loop, gather, kernel_order,
                                knn, knn_blocks,
                                knn_grid, square_distance)

ROOT = Path(__file__).resolve().parents[2]


def fps_reference(xyz: np.ndarray, m: int, start: int = 0) -> list[int]:
    chosen = [start]
    for _ in range(m - 1):
        best, best_d = -1, -1.0
        for i in range(len(xyz)):
            d = min(float(np.sum((xyz[i] - xyz[c]) ** 2)) for c in chosen)
            if d > best_d:
                best, best_d = i, d
        chosen.append(best)
    return chosen


@pytest.mark.parametrize("n,m", [(40, 10), (64, 64), (17, 1)])
def test_fps_matches_brute_force(n, m):
    g = torch.Generator().manual_seed(n + m)
    xyz = torch.rand(3, n, 3, generator=g, dtype=torch.float64)
    idx = farthest_point_sample(xyz, m)
    assert idx.shape == (3, m)
    for b in range(3):
        assert idx[b].tolist() == fps_reference(xyz[b].numpy(), m)


def test_fps_rejects_impossible_counts():
    with pytest.raises(ValueError, match="cannot pick"):
        farthest_point_sample(torch.rand(1, 5, 3), 6)


def test_knn_matches_sorted_distances():
    g = torch.Generator().manual_seed(0)
    pts = torch.rand(2, 50, 3, generator=g, dtype=torch.float64)
    query = torch.rand(2, 7, 3, generator=g, dtype=torch.float64)
    idx = knn(query, pts, 5)
    for b in range(2):
        for q in range(7):
            d = [float(((query[b, q] - pts[b, j]) ** 2).sum()) for j in range(50)]
            assert idx[b, q].tolist() == sorted(range(50), key=d.__getitem__)[:5]
    ref = ((query[:, :, None] - pts[:, None]) ** 2).sum(-1)
    torch.testing.assert_close(square_distance(query, pts), ref)


def test_gather_multi_index():
    x = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    idx = torch.tensor([[[0, 5], [2, 2]], [[1, 3], [4, 0]]])
    out = gather(x, idx)
    assert out.shape == (2, 2, 2, 4)
    for b in range(2):
        for i in range(2):
            for j in range(2):
                assert torch.equal(out[b, i, j], x[b, idx[b, i, j]])


def test_fps_per_sample_start():
    g = torch.Generator().manual_seed(7)
    xyz = torch.rand(3, 30, 3, generator=g, dtype=torch.float64)
    start = torch.tensor([4, 0, 29])
    idx = farthest_point_sample(xyz, 8, start)
    for b in range(3):
        assert idx[b].tolist() == fps_reference(xyz[b].numpy(), 8, start=int(start[b]))
    # an int start is shared by the batch, as before
    assert torch.equal(farthest_point_sample(xyz, 8, 5), farthest_point_sample(xyz, 8, torch.full((3,), 5)))
    with pytest.raises(ValueError, match="start"):
        farthest_point_sample(xyz, 8, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="start"):
        farthest_point_sample(xyz, 8, torch.tensor([1.0, 2.0, 3.0]))


# Exact arithmetic on float32 values as Python ints: a float32 is an integer number of units of 2^-149 (its
# smallest subnormal), a product of two an integer number of 2^-298; sums of those are exact.
F32_UNIT = 149


def f32_units(x: float) -> int:
    """A float32 value (given as a Python float) in units of 2^-149, exactly."""
    num, den = float(x).as_integer_ratio()
    assert (1 << F32_UNIT) % den == 0, x
    return num * ((1 << F32_UNIT) // den)


def round_f32(v: int, unit: int = F32_UNIT) -> float:
    """v * 2^-unit rounded once to float32 (to nearest, ties to even; subnormals kept), as a Python float."""
    a = abs(v)
    shift = max(a.bit_length() - 24, unit - F32_UNIT)  # drop all but 24 bits, never below 2^-149
    if shift > 0:
        q, r = divmod(a, 1 << shift)
        half = 1 << (shift - 1)
        a = q + (r > half or r == half and q & 1)
    else:
        a, shift = a << -shift, 0
    return math.copysign(math.ldexp(a, shift - unit), v)


def fma_f32(a: float, b: float, c: float) -> float:
    """a * b + c of float32 values rounded once to float32 (the GPU's fma.rn.f32), exactly."""
    return round_f32(f32_units(a) * f32_units(b) + (f32_units(c) << F32_UNIT), 2 * F32_UNIT)


def mul_f32(a: float, b: float) -> float:
    return round_f32(f32_units(a) * f32_units(b), 2 * F32_UNIT)


def sub_f32(a: float, b: float) -> float:
    return round_f32(f32_units(a) - f32_units(b))


def fps_kernel_reference(xyz: torch.Tensor, m: int) -> list[int]:
    """pointnet2_ops' ``furthest_point_sampling_kernel`` (sampling_gpu.cu) transliterated line by line, thread by
    thread, in exact arithmetic, as nvcc compiles it (``-fmad=true``) for one sample xyz (N, 3) taken to float32.

    ``opt_n_threads`` threads (2^floor(log2 N) in double arithmetic, at most 512); each step, thread t scans
    points t, t+T, ... (``mag = x*x + y*y + z*z``, contracted by nvcc into ``fma(z, z, fma(x, x, y*y))``, skips a
    point if ``mag <= 1e-3`` compared in double; ``d = fma(dz, dz, fma(dx, dx, dy*dy))``, both contractions read
    from nvcc 13.0's PTX for sm_90; ``d2 = min(d, temp[k])``; a strictly larger d2 replaces best, which starts at
    -1 with besti 0), then the shared-memory tree reduction with strides T/2, ..., 1: slot i takes slot i+s's
    pair only if its distance is strictly larger (``__update``).
    """
    pts = [tuple(float(c) for c in p) for p in xyz.float().tolist()]  # float32 values
    n = len(pts)
    threads = max(min(1 << int(math.log(n) / math.log(2.0)), 512), 1)
    temp = [1e10] * n  # torch::full(..., 1e10) in float32: 1e10 is a float32
    mag = [fma_f32(z, z, fma_f32(x, x, mul_f32(y, y))) for x, y, z in pts]
    idxs, old = [0], 0
    for _ in range(1, m):
        x1, y1, z1 = pts[old]
        dists, dists_i = [], []
        for t in range(threads):
            best, besti = -1.0, 0
            for k in range(t, n, threads):
                if mag[k] <= 1e-3:
                    continue
                x2, y2, z2 = pts[k]
                dx, dy, dz = sub_f32(x2, x1), sub_f32(y2, y1), sub_f32(z2, z1)
                d = fma_f32(dz, dz, fma_f32(dx, dx, mul_f32(dy, dy)))
                temp[k] = d2 = min(d, temp[k])
                besti = k if d2 > best else besti
                best = d2 if d2 > best else best
            dists.append(best)
            dists_i.append(besti)
        s = threads // 2
        while s >= 1:
            for i in range(s):
                if dists[i + s] > dists[i]:
                    dists[i], dists_i[i] = dists[i + s], dists_i[i + s]
            s //= 2
        old = dists_i[0]
        idxs.append(old)
    return idxs


def fraction_f32(q: Fraction) -> float:
    """An exact rational rounded once to float32 (ties to even, subnormals kept): the rounding by definition."""
    if q == 0:
        return 0.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e -= Fraction(2) ** e > a  # 2^e <= a < 2^(e+1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    k = a / ulp
    whole, rest = divmod(k.numerator, k.denominator)
    whole += 2 * rest > k.denominator or 2 * rest == k.denominator and whole & 1
    return math.copysign(float(whole * ulp), q)


def fma_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 a, b, c: random magnitudes; c +- (half an ulp of c minus a sliver), where rounding the float64 sum
    again to float32 goes wrong (the sliver is below float64's precision: the sum lands on the halfway point, and
    the tie goes to even, which is the wrong side when c's last bit is 1); sums in the subnormal range."""
    g = torch.Generator().manual_seed(0)

    def scaled(count, lo, hi):
        return (torch.rand(count, generator=g, dtype=torch.float64) * 2 - 1) * 2.0 ** torch.randint(lo, hi, (count,),
                                                                                                    generator=g)
    a, b, c = [scaled(3000, -30, 30), scaled(3000, -30, 30), scaled(3000, -60, 60)]
    # near halfway: a = 1 + k 2^-23, b = +-2^e (1 - k 2^-23), a b = +-2^e (1 - k^2 2^-46), 2^e half c's ulp
    c2 = (torch.rand(3000, generator=g, dtype=torch.float64) + 1) * 2.0 ** torch.randint(-20, 20, (3000,), generator=g)
    c2 = c2.float().double() * (torch.randint(0, 2, (3000,), generator=g) * 2 - 1)
    k = torch.randint(1, 300, (3000,), generator=g).double()
    e = torch.frexp(c2).exponent.double() - 25  # c2 in [2^E, 2^(E+1)), E = exponent - 1: half an ulp is 2^(E-24)
    a2 = 1 + k * 2.0 ** -23
    b2 = 2.0 ** e * (1 - k * 2.0 ** -23) * (torch.randint(0, 2, (3000,), generator=g) * 2 - 1)
    tiny = [scaled(500, -72, -68), scaled(500, -72, -68), scaled(500, -149, -125)]
    a, b, c = (torch.cat(t).float() for t in zip((a, b, c), (a2, b2, c2), tiny))
    assert torch.equal(a2.float().double(), a2) and torch.equal(b2.float().double(), b2)  # exact float32 values
    return a, b, c


def test_fma32_rounds_once_as_the_gpu_fma():
    a, b, c = fma_cases()
    got = fma32(a, b, c)
    assert got.dtype == torch.float32
    triples = list(zip(a.tolist(), b.tolist(), c.tolist()))
    want = [fraction_f32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in triples]
    assert got.tolist() == want
    # the transliteration's integer arithmetic rounds the same
    assert [fma_f32(x, y, z) for x, y, z in triples] == want
    # the cases reach what a plain float64 sum rounded again gets wrong, and the subnormal range
    double_rounded = (a.double() * b.double() + c.double()).float()
    assert (double_rounded != got).sum() > 1000
    assert (got != 0).logical_and(got.abs() < 2.0 ** -126).sum() > 100


def edge_point() -> tuple[float, float, float]:
    """A float32 point (x, y, 0) whose fused squared norm fma(x, x, y*y) is float32(1e-3), which is above 1e-3:
    the kernel compares it in double and keeps it (a float32 comparison with float32(1e-3) would skip it)."""
    target = float(np.float32(1e-3))
    for y in np.arange(0.010, 0.020, 0.0005, dtype=np.float32):
        yy = mul_f32(float(y), float(y))
        x = np.float32(math.sqrt(target - yy))
        for _ in range(64):
            x = np.nextafter(x, np.float32(0 if fma_f32(float(x), float(x), yy) > target else 1))
            if fma_f32(float(x), float(x), yy) == target > 1e-3:
                return float(x), float(y), 0.0
    raise AssertionError("no float32 point with a squared norm of float32(1e-3) found")


def kernel_cases() -> dict:
    """name -> (xyz (B, N, 3) float32, m): every block size ``opt_n_threads`` picks (N = 1 ... 1500: 1 to 512
    threads); random points in [-1, 1]^3 with point 0 at the origin, a point near it (skipped) and one whose
    squared norm is the float32 nearest 1e-3 (above 1e-3 in double: kept), a duplicate; the integer grid
    (ties everywhere, the origin skipped); a grid of linspace(-1, 1, 8) (exact ties that the FMA rounding, not
    symmetric in dx and dy, breaks) and points about 1 from (3, -2, 5) (near ties)."""
    g = torch.Generator().manual_seed(1)
    edge = edge_point()
    out = {}
    for n in (1, 3, 6, 13, 27, 50, 100, 200, 400, 700, 1500):
        xyz = torch.rand(2, n, 3, generator=g) * 2 - 1
        xyz[:, 0] = 0.0
        if n > 4:
            xyz[:, 3] = 0.01  # squared norm 3e-4: skipped
            xyz[:, 4] = torch.tensor(edge)  # kept
            xyz[:, n - 1] = xyz[:, 1]
        out[f"random-{n}"] = xyz, min(n, 12 if n < 1000 else 6)
    grid = torch.cartesian_prod(*[torch.arange(8.0)] * 3)  # (512, 3): the origin first
    out["grid-512"] = torch.stack([grid, grid[torch.randperm(512, generator=g)]]), 40
    out["grid-linspace"] = torch.cartesian_prod(*[torch.linspace(-1, 1, 8)] * 3)[None], 40  # (1, 512, 3)
    u = torch.randn(2, 300, 3, generator=g, dtype=torch.float64)
    shell = torch.tensor([3.0, -2.0, 5.0], dtype=torch.float64) + u / u.norm(dim=-1, keepdim=True)
    shell[:, 0] = torch.tensor([3.0, -2.0, 5.0])
    out["shell"] = shell.float(), 60
    return out


KERNEL_CASES = kernel_cases()


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_fps_like_kernel_matches_the_cuda_kernel(name):
    xyz, m = KERNEL_CASES[name]
    idx = farthest_point_sample(xyz, m, like_kernel=True)
    for b in range(len(xyz)):
        want = fps_kernel_reference(xyz[b], m)
        assert idx[b].tolist() == want
        if name.startswith("random") and xyz.shape[1] > 4:
            assert 3 not in want


def test_fps_like_kernel_rounds_as_the_fused_kernel():
    # on the shell and the linspace grid, the kernel's fused multiply-adds pick other points than the same kernel
    # with every product rounded (fps_loop with fused=False); half precision points are taken to float32 (the op
    # takes float32 only)
    differs = []
    for name, (xyz, m) in KERNEL_CASES.items():
        order = kernel_order(xyz.shape[1])
        points = xyz[:, order]
        kept = points.square().sum(-1) > KERNEL_MIN_SQUARED_NORM
        unfused = order[fps_loop(points, m, torch.zeros(len(xyz), dtype=torch.long), torch.where(kept, 1e10, -1.0))]
        fused = farthest_point_sample(xyz, m, like_kernel=True)
        differs += [name] * (not torch.equal(fused, unfused))
        half = xyz.half()
        assert torch.equal(farthest_point_sample(half, m, like_kernel=True),
                           farthest_point_sample(half.float(), m, like_kernel=True))
    assert {"shell", "grid-linspace"} <= set(differs), differs


def test_fps_like_kernel_breaks_ties_as_the_kernel():
    # 8 points: 8 threads, so thread t holds point t; points 3, 5 and 6 tie for farthest from point 0.
    # The reduction prefers threads by their bits read backwards: 6 (011) < 5 (101) < 3 (110).
    xyz = torch.zeros(1, 8, 3, dtype=torch.float64)
    xyz[0, :, 0] = torch.tensor([0.5, 0.6, 0.7, 2.0, 0.8, 2.0, 2.0, 0.9])
    xyz[0, :, 1] = 1.0
    assert fps_kernel_reference(xyz[0], 2) == [0, 6]
    assert farthest_point_sample(xyz, 2, like_kernel=True).tolist() == [[0, 6]]
    assert farthest_point_sample(xyz, 2).tolist() == [[0, 3]]  # plain: the lowest index


def test_fps_like_kernel_with_only_near_origin_points_left_repeats_point_0():
    xyz = torch.zeros(1, 6, 3, dtype=torch.float64)
    xyz[0, 2] = torch.tensor([1.0, 0.0, 0.0])
    assert fps_kernel_reference(xyz[0], 4) == [0, 2, 2, 2]  # point 2 at distance 0 still beats -1
    assert farthest_point_sample(xyz, 4, like_kernel=True).tolist() == [[0, 2, 2, 2]]
    line = torch.tensor([[[1.0, 0, 0], [0.02, 0, 0], [-1.0, 0, 0]]], dtype=torch.float64)
    assert fps_kernel_reference(line[0], 3) == [0, 2, 0]
    assert farthest_point_sample(line, 3, like_kernel=True).tolist() == [[0, 2, 0]]
    assert farthest_point_sample(line, 3).tolist() == [[0, 2, 1]]  # the plain rule takes the point near 0
    assert farthest_point_sample(torch.zeros(1, 5, 3), 3, like_kernel=True).tolist() == [[0, 0, 0]]
    # (x, 0, 0) with x*x the float32 nearest 1e-3, which is above 1e-3: the kernel compares in double, so it keeps it
    near = torch.tensor([[[0.0, 0, 0], edge_point(), [0.01, 0, 0]]])
    assert fps_kernel_reference(near[0], 3) == [0, 1, 1]
    assert farthest_point_sample(near, 3, like_kernel=True).tolist() == [[0, 1, 1]]
    with pytest.raises(ValueError, match="starts at point 0"):
        farthest_point_sample(xyz, 2, start=1, like_kernel=True)


@torch.no_grad()
def fps_before(xyz, m, start=0, like_kernel=False):
    """farthest_point_sample as it was before issue #20 §2 (one indexing and a sum over (B, N, 3) a step); its
    like_kernel had no fused multiply-adds, which float64 points keep."""
    b, n, _ = xyz.shape
    idx = torch.empty(b, m, dtype=torch.long)
    dist = torch.full((b, n), float("inf"), dtype=xyz.dtype)
    batch = torch.arange(b)
    farthest = start if isinstance(start, torch.Tensor) else torch.full((b,), start, dtype=torch.long)
    if like_kernel:
        order = kernel_order(n)
        xyz = xyz[:, order]
        dist = torch.where(xyz.square().sum(-1) > KERNEL_MIN_SQUARED_NORM, 1e10, -1.0).to(xyz.dtype)
    for i in range(m):
        idx[:, i] = farthest
        dist = torch.minimum(dist, (xyz - xyz[batch, farthest].unsqueeze(1)).square().sum(-1))
        farthest = dist.argmax(-1)
    return order[idx] if like_kernel else idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fps_torch_loop_gives_the_indices_of_before(dtype):
    # the loop now sums (dx^2 + dy^2) + dz^2 itself over coordinate planes (half precision: sum, as before); on
    # the CPU sum(-1) over (B, N, 3) rounded the same, so nothing moves: near ties on a shell of radius 1 around
    # point 0 (the picks depend on the last bits), the integer grid with a duplicate (exact ties), random points
    g = torch.Generator().manual_seed(5)
    u = torch.randn(3, 200, 3, generator=g, dtype=torch.float64)
    shell = torch.tensor([3.0, -2.0, 5.0], dtype=torch.float64) + u / u.norm(dim=-1, keepdim=True)
    shell[:, 0] = torch.tensor([3.0, -2.0, 5.0])
    grid = torch.cartesian_prod(*[torch.arange(5)] * 3)[None].repeat(3, 1, 1)
    grid[:, 10] = grid[:, 11]
    spread = torch.rand(3, 300, 3, generator=g, dtype=torch.float64) * 4 - 2
    for xyz in (shell, grid, spread):
        xyz = xyz.to(dtype)
        m = 60
        start = torch.randint(0, xyz.shape[1], (3,), generator=g)
        assert torch.equal(farthest_point_sample(xyz, m), fps_before(xyz, m))
        assert torch.equal(farthest_point_sample(xyz, m, start), fps_before(xyz, m, start))
        if dtype == torch.float64:  # float32 and half: pointnet2_ops' fused multiply-adds (tests below)
            assert torch.equal(farthest_point_sample(xyz, m, like_kernel=True), fps_before(xyz, m, like_kernel=True))


def test_fps_stays_out_of_compiled_graphs():
    # torch.compile runs it eagerly (a graph break) instead of unrolling its m steps into the graph
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    xyz = torch.rand(2, 40, 3, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(lambda x: farthest_point_sample(x * 2, 12) + 1, backend=backend)
    assert torch.equal(compiled(xyz), farthest_point_sample(xyz * 2, 12) + 1)
    ops = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert graphs and not any("argmax" in op or "minimum" in op for op in ops), ops


def test_eager_calls_run_the_ops_kernels_without_their_dispatch():
    """FPS, kNN and PCT's neighbourhoods run their op's kernel directly in eager code (attention.eager: the op's
    dispatch cost 20-40 us a call on the CPU, and PCT's step makes six), with the op's indices; under a dispatch mode
    (here one that records the ops it sees) the op itself runs, as torch.compile and fake tensors need."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tasks.nets.pct import neighbourhoods

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    xyz = torch.rand(2, 40, 3, generator=torch.Generator().manual_seed(31)) * 2 - 1
    calls = {"farthest_point_sample": lambda: farthest_point_sample(xyz, 9, like_kernel=True),
             "knn": lambda: knn(xyz[:, :7], xyz, 5),
             "pct_neighbourhoods": lambda: neighbourhoods(xyz, 9, 5, True)}
    for name, call in calls.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            direct = call()
        assert not [e for e in prof.events() if e.name.startswith("attention_suite::")], name
        with Seen() as seen:
            through_op = call()
        assert name in seen.ops, (name, seen.ops)
        for a, b in zip(*((t if isinstance(t, tuple) else (t,)) for t in (direct, through_op))):
            assert torch.equal(a, b), name


def test_fps_rejects_bad_backend_and_start():
    xyz = torch.rand(2, 5, 3)
    with pytest.raises(ValueError, match="backend"):
        farthest_point_sample(xyz, 2, backend="cuda")
    for start in (5, -1):
        with pytest.raises(ValueError, match="not a point index"):
            farthest_point_sample(xyz, 2, start)


def knn_reference(query: torch.Tensor, points: torch.Tensor, k: int) -> list:
    """Per sample and query, the first k points sorted by (squared distance in float64, index)."""
    out = []
    for qs, ps in zip(query.double(), points.double()):
        rows = []
        for q in qs:
            d = ((ps - q) ** 2).sum(-1).tolist()
            rows.append(sorted(range(len(ps)), key=lambda j: (d[j], j))[:k])
        out.append(rows)
    return out


@pytest.mark.parametrize("sync_free", [False, True])  # smallest (CPU) or smallest_without_sync (CUDA's), on the CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1 << 24, 64, 1])  # one block; 64 entries (a row or two); one row per block
@pytest.mark.parametrize("k", [1, 6, 7, 19, 27, 64])
def test_knn_ties_go_to_the_lower_index(monkeypatch, dtype, block, k, sync_free):
    # integer grid coordinates: every distance is an integer, computed exactly, and tied many times over
    # (6 neighbours at distance 1, 12 at 2, 8 at 3 ...), so k = 7, 19, 27 cut through ties; duplicates too
    monkeypatch.setattr("attention.pointops.KNN_BLOCK_ELEMENTS", block)
    monkeypatch.setattr("attention.pointops.SYNC_FREE_DEVICES", ("cpu",) if sync_free else ("cuda",))
    grid = torch.cartesian_prod(*[torch.arange(4)] * 3).to(dtype)  # (64, 3)
    g = torch.Generator().manual_seed(k)
    points = torch.stack([grid, grid[torch.randperm(64, generator=g)]])  # (2, 64, 3), two orders
    points[:, 10] = points[:, 11]  # a duplicate point
    query = torch.randint(-1, 5, (2, 9, 3), generator=g).to(dtype)  # off the grid too
    query[:, 0] = points[:, 11]
    idx = knn(query, points, k)
    assert idx.shape == (2, 9, k)
    assert idx.tolist() == knn_reference(query, points, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_knn_blocks_change_nothing(monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    points = torch.rand(2, 300, 3, generator=g).to(dtype)
    query = torch.rand(2, 70, 3, generator=g).to(dtype)
    whole = knn(query, points, 16)
    # no ties among random floats: the brute force of before (one matrix, topk) gives the same indices
    assert torch.equal(whole, square_distance(query, points).topk(16, largest=False).indices)
    if dtype == torch.float64:
        assert whole.tolist() == knn_reference(query, points, 16)
    for block in (600, 601, 1):  # one row per block, a row and a bit, one entry
        monkeypatch.setattr("attention.pointops.KNN_BLOCK_ELEMENTS", block)
        assert torch.equal(knn(query, points, 16), whole)


def knn_float32_reference(query: np.ndarray, points: np.ndarray, k: int) -> list:
    """Per query, the first k points sorted by (squared distance, index), the squared distance rounded as the rule
    says: float32 differences, then (dx*dx + dy*dy) + dz*dz, each operation rounded to float32 (numpy's float32
    ufuncs, one rounding each)."""
    rows = []
    for q in query:
        d = points - q  # (N, 3) float32
        s = (d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1]) + d[:, 2] * d[:, 2]  # (N,) float32
        rows.append(sorted(range(len(points)), key=lambda j: (float(s[j]), j))[:k])
    return rows


@pytest.mark.parametrize("sync_free", [False, True])
def test_knn_near_ties_follow_the_float32_rule(monkeypatch, sync_free):
    """Points on a thin shell around each query: their float32 squared distances differ by an ulp or two or tie
    exactly, so any other rounding (cdist's FMA chain and square root, a matrix product, float64) reorders them."""
    monkeypatch.setattr("attention.pointops.SYNC_FREE_DEVICES", ("cpu",) if sync_free else ("cuda",))
    g = torch.Generator().manual_seed(5)
    query = (torch.rand(2, 6, 3, generator=g) * 4 - 2).float()  # (2, 6, 3)
    u = torch.nn.functional.normalize(torch.randn(2, 6, 40, 3, generator=g), dim=-1)  # (2, 6, 40, 3) directions
    points = (query[:, :, None] + 0.3 * u).reshape(2, 240, 3).float()  # 40 on a shell around each query
    points = torch.cat([points, points[:, :30]], 1)  # (2, 270, 3): exact duplicates, ties to the lower index
    idx = knn(query, points, 45)
    for b in range(2):
        assert idx[b].tolist() == knn_float32_reference(query[b].numpy(), points[b].numpy(), 45)


@pytest.mark.parametrize("chunk", [1 << 18, 7, 270])  # at once; a few entries at a time; one row at a time
def test_square_distance_is_the_float32_rule_bit_for_bit(monkeypatch, chunk):
    monkeypatch.setattr("attention.pointops.SQUARE_DISTANCE_CPU_CHUNK", chunk)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(2, 9, 3, generator=g) * 100, torch.randn(2, 270, 3, generator=g) * 100 + 1
    d = (a.numpy()[:, :, None] - b.numpy()[:, None]).astype(np.float32)  # (2, 9, 270, 3)
    expected = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    assert np.array_equal(square_distance(a, b).numpy(), expected)
    assert np.array_equal(square_distance(a.half(), b.half()).numpy(),  # half: upcast, then the same
                          square_distance(a.half().float(), b.half().float()).numpy())


def test_knn_memory_stays_within_its_block_budget(monkeypatch):
    """8,192 points against themselves (the grid search): no tensor of more than the block budget or N k entries
    is ever created (a dispatch mode sees every op's outputs), far below N x N; and no cdist."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest, self.ops = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.add(str(func.overloadpacket))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    budget, n, k = 1 << 18, 8192, 16
    monkeypatch.setattr("attention.pointops.KNN_BLOCK_ELEMENTS", budget)
    points = torch.rand(1, n, 3, generator=torch.Generator().manual_seed(2))
    with Record() as record:
        idx = knn(points, points, k)
    assert idx.shape == (1, n, k) and torch.equal(idx[0, :, 0], torch.arange(n))  # each point its own nearest
    assert record.largest <= max(budget, n * k) < n * n // 64, record.largest
    assert not any("cdist" in op for op in record.ops), sorted(record.ops)
    rows = torch.arange(0, n, 509)  # a sample of queries against the float32 rule by brute force
    assert idx[0, rows].tolist() == knn_float32_reference(points[0, rows].numpy(), points[0].numpy(), k)


def test_knn_rejects_impossible_counts():
    with pytest.raises(ValueError, match="cannot take"):
        knn(torch.rand(1, 2, 3), torch.rand(1, 5, 3), 6)


def cloud(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.rand(n, 3, generator=g)
    if kind == "clusters":  # two dense blobs in a sparse haze, far from the origin
        blobs = torch.randn(n, 3, generator=g) * 0.01 + (torch.arange(n) % 2)[:, None] * 0.5
        haze = torch.rand(n, 3, generator=g)
        return torch.where((torch.arange(n) % 5 == 0)[:, None], haze, blobs) + 10
    if kind == "plane":  # a flat set: one cell thick
        return torch.cat([torch.rand(n, 2, generator=g), torch.zeros(n, 1)], dim=1)
    if kind == "line":
        return torch.cat([torch.rand(n, 1, generator=g), torch.full((n, 2), 0.5)], dim=1)
    grid = torch.cartesian_prod(*[torch.arange(8)] * 3).float()  # "grid": integer points, ties everywhere
    return torch.cat([grid, grid[:n - len(grid)]])  # and duplicates


@pytest.mark.parametrize("kind", ["uniform", "clusters", "plane", "line", "grid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_knn_grid_search_is_the_brute_force(monkeypatch, kind, dtype):
    g = torch.Generator().manual_seed(1)
    points = torch.stack([cloud(kind, 700, g) for _ in range(2)]).to(dtype)  # (2, 700, 3)
    query = torch.cat([points[:, :300], points[:, :20] + torch.randn(2, 20, 3, generator=g).to(dtype)], 1)
    if kind == "grid":
        query = query.round()
    expected = {k: knn_blocks(query, points, k) for k in (1, 10, 17, 49)}
    monkeypatch.setattr("attention.pointops.KNN_GRID_ABOVE", 1000)  # the grid path from here on
    monkeypatch.setattr("attention.pointops.KNN_BLOCK_ELEMENTS", 2000)  # ... with small blocks of distances
    for k, want in expected.items():
        assert torch.equal(knn(query, points, k), want)
        if kind == "grid" or dtype == torch.float64 and kind == "uniform":
            assert want.tolist() == knn_reference(query, points, k)
    # cells too small for anyone: every query searches again with larger ones, down to brute force
    assert torch.equal(knn_grid(query[0], points[0], 10, cell=1e-4), expected[10][0])


# --- kNN's Triton kernel (attention/knn_triton.py) ------------------------------------------------------------------
# Under Triton's interpreter (TRITON_INTERPRET=1 takes effect when the kernel is defined, at import, so in a
# subprocess) the kernel runs on CPU tensors, each float32 operation rounded as the GPU rounds it with
# enable_fp_fusion=False; it must return knn's torch search, index for index, on either path. The interpreter
# takes about half a second a merged tile (two sorts), a few ms a skipped one: the cases are small, and all run in
# one subprocess (the fixture below), which also hands back the kernel's per-program work counts.
KNN_INTERPRET = """
import sys
import torch
import triton
from triton.runtime import interpreter
from attention import knn_triton, pointops

assert triton.knobs.runtime.interpret and isinstance(knn_triton._knn_kernel, interpreter.InterpretedFunction)
torch.set_num_threads(1)
default = knn_triton.SORTED_FROM
out = {}
for name, (q, p, k, sorted_path) in torch.load(sys.argv[1]).items():
    knn_triton.SORTED_FROM = 1 if sorted_path else default  # the threshold knn_triton.knn goes by
    got, work = knn_triton.knn(q, p, k, stats=True)
    out[name] = (got, pointops.knn(q, p, k), work)
torch.save(out, sys.argv[2])
"""


def morton_neighbours(points: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The indices (count,) of points (N, 3) at places first .. first + count - 1 of their Morton order: queries
    like those one program takes when the queries are the points (M = N)."""
    from attention.pointops import morton_codes

    lo = points.amin(0)
    side = (points.amax(0) - lo).max()
    return morton_codes(points[None], lo, 1024 / side)[0].argsort()[first:first + count]


@pytest.fixture(scope="module")
def knn_interpreted(tmp_path_factory) -> tuple[dict, dict]:
    """The cases {name: (query, points, k, sorted path?)} and what one interpreter subprocess made of them,
    {name: (kernel's indices, knn's torch search, kernel's work (B, programs, 3))}. A case's flag forces the
    spatially sorted path (SORTED_FROM = 1); without it, N < SORTED_FROM takes the simple one."""
    g = torch.Generator().manual_seed(9)
    grid = torch.cartesian_prod(*[torch.arange(4)] * 3).float()  # integer points: ties everywhere
    tied = grid[torch.randperm(64, generator=g)][None].clone()  # (1, 64, 3)
    tied[:, 10] = tied[:, 11]  # a duplicate
    tied_queries = torch.randint(-1, 5, (1, 17, 3), generator=g).float()  # 17: two programs, one partial
    centre = torch.rand(1, 3, 3, generator=g)
    shell = (centre[:, :, None] + 0.3 * torch.nn.functional.normalize(torch.randn(1, 3, 13, 3, generator=g), dim=-1))
    grid5 = torch.cartesian_prod(*[torch.arange(5)] * 3).float()[torch.randperm(125, generator=g)][None]  # (1, 125, 3)
    base = torch.rand(1, 40, 3, generator=g)
    copies = torch.cat([base] * 3, 1)[:, torch.randperm(120, generator=g)]  # (1, 120, 3): each point three times
    mixed = torch.stack([cloud("clusters", 64, g), cloud("line", 64, g)])  # (2, 64, 3)
    uniform = torch.rand(1, 2048, 3, generator=g)
    near = torch.cat([morton_neighbours(uniform[0], 800, 16), morton_neighbours(uniform[0], 1400, 16)])  # (32,)
    cases = {
        # the simple path (tiles in index order), as before
        "ties, k=7 (one tile of 16 at a time)": (tied_queries, tied[:, :32], 7, False),
        "ties, k=19 (tiles of 32)": (tied_queries[:, :9], tied, 19, False),
        "near ties on shells, N=39 (a partial tile), half": (centre.half(), shell.reshape(1, 39, 3).half(), 17, False),
        "k = N": (tied_queries[:, :3], tied[:, :20], 20, False),
        # queries of any strides, read in place (every other row; a transposed (B, 3, M) tensor)
        "strided queries, k=5": (torch.rand(1, 34, 3, generator=g)[:, ::2], tied, 5, False),
        "transposed queries, k=5": (torch.rand(1, 3, 17, generator=g).transpose(1, 2), tied, 5, False),
        # the spatially sorted path
        "sorted: ties, k=19 (tiles of 32)": (tied_queries[:, :9], tied, 19, True),
        "sorted: random, B=2, M != N, N=150 (a partial tile)":
            (torch.rand(2, 24, 3, generator=g), torch.rand(2, 150, 3, generator=g), 6, True),
        "sorted: a 5^3 grid (exact ties), queries on and off it":
            (torch.randint(-1, 6, (1, 20, 3), generator=g).float(), grid5, 7, True),
        "sorted: every point three times, queries on them": (copies[:, :16], copies, 9, True),
        "sorted: clusters far from the origin and a line, B=2, queries are the points, k=1": (mixed, mixed, 1, True),
        "sorted: k = N": (torch.rand(1, 5, 3, generator=g), torch.rand(1, 18, 3, generator=g), 18, True),
        "sorted: 2048 uniform points, two programs of Morton neighbours, k=4": (uniform[:, near], uniform, 4, True),
    }
    path = tmp_path_factory.mktemp("knn_interpreted")
    torch.save(cases, path / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KNN_INTERPRET, str(path / "cases.pt"), str(path / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return cases, torch.load(path / "out.pt")


def test_knn_triton_kernel_is_the_torch_search_index_for_index(knn_interpreted):
    cases, results = knn_interpreted
    assert set(results) == set(cases)
    strided, transposed = cases["strided queries, k=5"][0], cases["transposed queries, k=5"][0]
    assert strided.stride() == (102, 6, 1) and transposed.stride() == (51, 1, 17)
    for name, (kernel, search, _) in results.items():
        assert kernel.shape == search.shape and torch.equal(kernel, search), name
    for name in ["ties, k=7 (one tile of 16 at a time)", "sorted: a 5^3 grid (exact ties), queries on and off it",
                 "sorted: every point three times, queries on them"]:  # and the float64 loops' order, ties included
        query, points, k, _ = cases[name]
        assert results[name][1].tolist() == knn_reference(query, points, k), name


def merges_in_index_order(query: torch.Tensor, points: torch.Tensor, k: int, kp: int) -> list[int]:
    """A model of the simple path's merges, per program of 16 queries of query (M, 3): the tiles of kp points,
    in index order, holding a key below some query's k-th best key over the tiles before (none before k keys)."""
    d = square_distance(query[None], points[None])[0]  # (M, N)
    key = (d.view(torch.int32).long() << 32) | torch.arange(len(points))  # (M, N) the kernel's keys
    merges = []
    for rows in key.split(16):  # (16, N): a program's
        kth = torch.full((len(rows),), 2 ** 63 - 1)
        count = 0
        for start in range(0, len(points), kp):
            count += bool((rows[:, start:start + kp].amin(1) < kth).any())
            if start + kp >= k:
                kth = rows[:, :start + kp].kthvalue(k, dim=1).values
        merges.append(count)
    return merges


def test_knn_triton_sorted_path_skips_the_far_tiles(knn_interpreted):
    # The kernel's own counts, per program: tiles visited, tiles whose distances it computed (the others were
    # ruled out by their bounding boxes), tiles it merged (a key below some query's k-th best).
    cases, results = knn_interpreted
    name = "sorted: 2048 uniform points, two programs of Morton neighbours, k=4"
    work = results[name][2][0]  # (2 programs, 3)
    assert work[:, 0].tolist() == [128, 128]  # every tile of 16 considered once ...
    assert (work[:, 1] <= 32).all() and (work[:, 2] <= 16).all(), work  # ... a quarter computed, an eighth merged
    # the same queries in index order: the model of the simple path, checked against the kernel below
    query, points, k, _ = cases[name]
    assert min(merges_in_index_order(query[0], points[0], k, 16)) >= 2 * work[:, 2].max()
    for name in ["ties, k=7 (one tile of 16 at a time)", "ties, k=19 (tiles of 32)", "k = N"]:
        query, points, k, _ = cases[name]
        work = results[name][2][0]  # (programs, 3)
        assert (work[:, 0] == work[:, 1]).all()  # no boxes on the simple path: every tile computed
        kp = max(16, 1 << (k - 1).bit_length())
        assert work[:, 2].tolist() == merges_in_index_order(query[0], points[0], k, kp), name


def test_knn_triton_visit_order_takes_every_tile_once_nearest_first():
    from attention.knn_triton import visit_order

    assert visit_order(3, 9) == [3, 4, 2, 5, 1, 6, 0, 7, 8]
    assert visit_order(7, 9) == [7, 8, 6, 5, 4, 3, 2, 1, 0]
    for tiles in range(1, 12):
        for start in range(tiles):
            order = visit_order(start, tiles)
            assert sorted(order) == list(range(tiles))
            assert [abs(t - start) for t in order] == sorted(abs(t - start) for t in order)  # widening


def test_knn_triton_morton_codes_interleave_the_cells_bits():
    from attention.pointops import morton_codes

    cells = torch.tensor([[[1023, 0, 0], [0, 1023, 0], [5, 3, 1], [2000, -5, float("nan")]]])  # (1, 4, 3)
    codes = morton_codes(cells, torch.zeros(1, 1, 3), torch.ones(1, 1, 1))[0].tolist()
    x_bits = sum(1 << (3 * i) for i in range(10))
    assert codes == [x_bits, x_bits << 1, 0b1010111, x_bits]  # 5, 3, 1 -> bits z1 y1 x1 | z0 y1 x0 | x1; clamped


KNN_COMPILE = """
import re
import sys
import torch
from attention import knn_triton

sys.path.insert(0, "tests")
from triton_sm90 import compile_launch, record_launches

launches = record_launches(knn_triton._knn_kernel)  # knn_triton.knn's launches, recorded, not run
for sorted_path, k in [(False, 32), (True, 36)]:
    knn_triton.knn(torch.rand(2, 300, 3)[:, ::2], torch.rand(2, 500, 3), k, sort=sorted_path)  # strided queries
for kernel, args, options in launches:
    ptx = compile_launch(kernel, args, options).asm["ptx"]
    ops = " ".join(sorted(set(re.findall(r"^\\s*((?:fma|mul|add|sub)\\.\\S*f32)", ptx, re.M))))
    print(options["SORTED"], options["KP"], options["enable_fp_fusion"], ops)
"""


def test_knn_triton_kernel_compiles_for_sm90_without_fused_multiply_add(tmp_path):
    # On a GPU, a fused dx*dx + dy*dy would round once where square_distance rounds twice, and reorder near ties;
    # the interpreter cannot show it. Compiled for an H100 (no GPU needed) as knn_triton.knn launches it (the
    # simple path at PCT's k = 32, the sorted one at the dilated variant's k = 36), the float arithmetic is rounded
    # subtractions, multiplications and additions only (the sorted path's box bounds included).
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", KNN_COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"{path} {kp} False add.rn.f32 mul.rn.f32 sub.rn.f32"
                                        for path, kp in [(False, 32), (True, 64)]]


def test_knn_kernel_failure_warns_and_hands_over_to_torch(monkeypatch):
    from attention import knn_triton, pointops

    def broken(*args):
        raise RuntimeError("no driver")

    monkeypatch.setattr(pointops.KNN_KERNELS, "usable", True)
    q, p = torch.rand(1, 4, 3), torch.rand(1, 9, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # above the kernel's k: no kernel, no warning
        assert pointops.KNN_KERNELS.call("knn_if_supported", q, p, knn_triton.MAX_K + 1) is None
    monkeypatch.setattr(knn_triton, "knn", broken)
    with pytest.warns(UserWarning, match="torch search takes over"):
        assert pointops.KNN_KERNELS.call("knn_if_supported", q, p, 3) is None
    assert pointops.KNN_KERNELS.usable is False


@pytest.mark.cuda
@pytest.mark.parametrize("b,m,n,k,kind", [(32, 512, 1024, 32, "uniform"), (32, 256, 512, 32, "uniform"),
                                          (4, 4096, 4096, 16, "clusters"), (1, 65536, 65536, 36, "uniform")])
def test_knn_triton_kernel_on_the_gpu_is_the_torch_search(monkeypatch, b, m, n, k, kind):
    from attention import knn_triton, pointops

    g = torch.Generator().manual_seed(m)
    points = torch.stack([cloud(kind, n, g) for _ in range(b)]).cuda()  # (B, N, 3)
    query = points[:, :m] if m == n else torch.rand(b, m, 3, generator=g).cuda()
    got = {sort: knn_triton.knn(query, points, k, sort=sort) for sort in (False, True)}  # both paths
    monkeypatch.setattr(pointops.KNN_KERNELS, "usable", False)  # knn's torch search, on the GPU
    want = pointops.knn(query, points, k)
    assert torch.equal(got[False], want) and torch.equal(got[True], want)


def test_fake_cuda_tensors_never_reach_a_triton_kernel(monkeypatch):
    """The bench estimates FLOPs and memory on fake tensors (``benchmarks.cost.fake_count``): kNN and FPS on fake
    CUDA points must take the torch path, which computes shapes. Launched on a fake tensor's "pointer", the Triton
    kernels read arbitrary addresses: on an H200 an illegal memory access, after which every CUDA call of the
    process failed. Here Triton is made to look available and the kernels' entry is recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attention import pointops, triton_kernels

    monkeypatch.setattr(triton_kernels, "AVAILABLE", True)
    launched = []
    for family in (pointops.KNN_KERNELS, pointops.FPS_KERNELS):
        monkeypatch.setattr(family, "call", lambda name, *args, **kwargs: launched.append(name))
    with FakeTensorMode():
        xyz = torch.empty(2, 64, 3, device="cuda")
        idx, centres = pointops.knn(xyz, xyz, 4), farthest_point_sample(xyz, 8)
    assert idx.shape == (2, 64, 4) and idx.device.type == "cuda" and centres.shape == (2, 8)
    assert launched == []
    # real CUDA-looking tensors still ask for the kernels (the recorded call returns None: the torch path finishes)
    assert pointops.KNN_KERNELS.wanted((torch.empty(1),)) and not pointops.KNN_KERNELS.wanted((xyz,))
