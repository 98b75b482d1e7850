"""Farthest point sampling and kNN against brute-force float64 loops."""

import numpy as np
import pytest
import torch

from attention.pointops import (KERNEL_MIN_SQUARED_NORM, farthest_point_sample, gather, kernel_order, knn, knn_blocks,
                                knn_grid, square_distance)


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


def fps_kernel_reference(xyz: np.ndarray, m: int) -> list[int]:
    """pointnet2_ops' ``furthest_point_sampling_kernel`` simulated thread by thread, in float64.

    T threads (``opt_n_threads``: 2^floor(log2 n), at most 512); thread t scans points t, t+T, ...,
    skipping points of squared norm <= 1e-3 and keeping its first maximum (best starts at -1, besti at 0);
    then the shared-memory tree reduction with strides T/2, ..., 1, where slot i takes slot i+s's pair
    only if its distance is strictly larger.
    """
    n = len(xyz)
    threads = max(min(1 << int(np.log(n) / np.log(2.0)), 512), 1)
    temp = [1e10] * n
    idxs, old = [0], 0
    for _ in range(1, m):
        dists, dists_i = [], []
        for t in range(threads):
            best, besti = -1.0, 0
            for k in range(t, n, threads):
                if float(np.sum(xyz[k] ** 2)) <= 1e-3:
                    continue
                d = float(np.sum((xyz[k] - xyz[old]) ** 2))
                temp[k] = min(d, temp[k])
                if temp[k] > best:
                    best, besti = temp[k], k
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


@pytest.mark.parametrize("n,m", [(40, 12), (100, 30), (600, 20)])
def test_fps_like_kernel_matches_the_cuda_kernel(n, m):
    g = torch.Generator().manual_seed(n)
    xyz = torch.rand(2, n, 3, generator=g, dtype=torch.float64) * 2 - 1
    xyz[:, 3] = 0.01  # squared norm 3e-4: skipped by the kernel
    xyz[:, 0] = 0.0  # the start is taken even at the origin
    idx = farthest_point_sample(xyz, m, like_kernel=True)
    for b in range(2):
        want = fps_kernel_reference(xyz[b].numpy(), m)
        assert idx[b].tolist() == want
        assert 3 not in want


def test_fps_like_kernel_breaks_ties_as_the_kernel():
    # 8 points: 8 threads, so thread t holds point t; points 3, 5 and 6 tie for farthest from point 0.
    # The reduction prefers threads by their bits read backwards: 6 (011) < 5 (101) < 3 (110).
    xyz = torch.zeros(1, 8, 3, dtype=torch.float64)
    xyz[0, :, 0] = torch.tensor([0.5, 0.6, 0.7, 2.0, 0.8, 2.0, 2.0, 0.9])
    xyz[0, :, 1] = 1.0
    assert fps_kernel_reference(xyz[0].numpy(), 2) == [0, 6]
    assert farthest_point_sample(xyz, 2, like_kernel=True).tolist() == [[0, 6]]
    assert farthest_point_sample(xyz, 2).tolist() == [[0, 3]]  # plain: the lowest index


def test_fps_like_kernel_with_only_near_origin_points_left_repeats_point_0():
    xyz = torch.zeros(1, 6, 3, dtype=torch.float64)
    xyz[0, 2] = torch.tensor([1.0, 0.0, 0.0])
    assert fps_kernel_reference(xyz[0].numpy(), 4) == [0, 2, 2, 2]  # point 2 at distance 0 still beats -1
    assert farthest_point_sample(xyz, 4, like_kernel=True).tolist() == [[0, 2, 2, 2]]
    line = torch.tensor([[[1.0, 0, 0], [0.02, 0, 0], [-1.0, 0, 0]]], dtype=torch.float64)
    assert fps_kernel_reference(line[0].numpy(), 3) == [0, 2, 0]
    assert farthest_point_sample(line, 3, like_kernel=True).tolist() == [[0, 2, 0]]
    assert farthest_point_sample(line, 3).tolist() == [[0, 2, 1]]  # the plain rule takes the point near 0
    assert farthest_point_sample(torch.zeros(1, 5, 3), 3, like_kernel=True).tolist() == [[0, 0, 0]]
    with pytest.raises(ValueError, match="starts at point 0"):
        farthest_point_sample(xyz, 2, start=1, like_kernel=True)


@torch.no_grad()
def fps_before(xyz, m, start=0, like_kernel=False):
    """farthest_point_sample as it was before issue #20 §2 (one indexing and a sum over (B, N, 3) a step)."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1 << 24, 64, 1])  # one block; 64 entries (a row or two); one row per block
@pytest.mark.parametrize("k", [1, 6, 7, 19, 27, 64])
def test_knn_ties_go_to_the_lower_index(monkeypatch, dtype, block, k):
    # integer grid coordinates: every distance is an integer, computed exactly, and tied many times over
    # (6 neighbours at distance 1, 12 at 2, 8 at 3 ...), so k = 7, 19, 27 cut through ties; duplicates too
    monkeypatch.setattr("attention.pointops.KNN_BLOCK_ELEMENTS", block)
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
