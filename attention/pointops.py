"""Point-set neighbourhoods in plain batched torch, on the data's device.

torch-geometric's ``fps``/``knn`` need pyg-lib or torch-cluster, which have no
wheels for every torch build (none for the one we install), so the two
operations PCT and the local variants need are written here; both run under
``no_grad`` because indices carry no gradient.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def farthest_point_sample(xyz: torch.Tensor, m: int, start: int | torch.Tensor = 0) -> torch.Tensor:
    """Indices (B, m) of m points picked by farthest point sampling, from point ``start``.

    ``start`` is one index for every sample, or a (B,) LongTensor of one start
    per sample (e.g. a point chosen by geometry, so that the result does not
    depend on the order of the points). A deterministic start (the reference
    code draws it at random) keeps evaluation reproducible; the data pipeline
    shuffles points during training.
    """
    b, n, _ = xyz.shape
    if not 1 <= m <= n:
        raise ValueError(f"farthest_point_sample: cannot pick {m} of {n} points.")
    idx = torch.empty(b, m, dtype=torch.long, device=xyz.device)
    dist = torch.full((b, n), float("inf"), dtype=xyz.dtype, device=xyz.device)
    batch = torch.arange(b, device=xyz.device)
    if isinstance(start, torch.Tensor):
        if start.shape != (b,) or start.dtype != torch.long:
            raise ValueError(f"farthest_point_sample: start must be an int or a ({b},) LongTensor, "
                             f"got {start.dtype} of shape {tuple(start.shape)}.")
        farthest = start.to(xyz.device)
    else:
        farthest = torch.full((b,), start, dtype=torch.long, device=xyz.device)
    for i in range(m):
        idx[:, i] = farthest
        centre = xyz[batch, farthest].unsqueeze(1)  # (B, 1, 3)
        dist = torch.minimum(dist, (xyz - centre).square().sum(-1))  # (B, N)
        farthest = dist.argmax(-1)
    return idx


def square_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared distances (B, N, M) between a (B, N, 3) and b (B, M, 3), in float32 at least.

    Under autocast the matmul would run in half precision, whose rounding (about 1e-3 of |a|^2 in float16,
    4e-3 in bfloat16) reorders near neighbours; so half inputs are upcast and autocast is off here.
    """
    with torch.autocast(a.device.type, enabled=False):
        a, b = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (a, b))
        d = -2 * a @ b.transpose(1, 2)  # (B, N, M)
        d += a.square().sum(-1, keepdim=True)
        d += b.square().sum(-1).unsqueeze(1)
        return d.clamp_min_(0)


@torch.no_grad()
def knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, M, k) of the k nearest ``points`` (B, N, 3) of each ``query`` (B, M, 3), nearest first."""
    if not 1 <= k <= points.shape[1]:
        raise ValueError(f"knn: cannot take {k} neighbours among {points.shape[1]} points.")
    return square_distance(query, points).topk(k, dim=-1, largest=False, sorted=True).indices


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, C) gathered at idx (B, *S) -> (B, *S, C)."""
    b = x.shape[0]
    flat = idx.reshape(b, -1)  # (B, S)
    out = torch.gather(x, 1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, S, C)
    return out.reshape(*idx.shape, x.shape[-1])
