"""Farthest point sampling and kNN against brute-force float64 loops."""

import numpy as np
import pytest
import torch

from attention.pointops import farthest_point_sample, gather, knn, square_distance


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
