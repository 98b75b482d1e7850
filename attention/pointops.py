"""Point-set neighbourhoods in plain batched torch, on the data's device.

torch-geometric's ``fps``/``knn`` need pyg-lib or torch-cluster, which have no
wheels for every torch build (none for the one we install), so the two
operations PCT and the local variants need are written here; both run under
``no_grad`` because indices carry no gradient.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def farthest_point_sample(xyz: torch.Tensor, m: int, start: int | torch.Tensor = 0,
                          like_kernel: bool = False) -> torch.Tensor:
    """Indices (B, m) of m points picked by farthest point sampling, from point ``start``.

    ``start`` is one index for every sample, or a (B,) LongTensor of one start
    per sample (e.g. a point chosen by geometry, so that the result does not
    depend on the order of the points). Ties go to the lowest index.

    ``like_kernel=True`` gives what pointnet2_ops' CUDA kernel
    (``furthest_point_sampling_kernel`` in ``sampling_gpu.cu``, which PCT_Pytorch
    calls) returns, index for index: it starts at point 0, never picks nor
    updates a point whose squared norm is <= 1e-3 (such points are skipped; if
    only they remain, it picks point 0 again), and breaks ties as its block
    reduction does (see :func:`kernel_order`). ``start`` must then be 0.
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
    if like_kernel:
        if not (isinstance(start, int) and start == 0):
            raise ValueError("farthest_point_sample: like_kernel=True starts at point 0, as the CUDA kernel does.")
        # The kernel's tie order becomes "first maximum" (argmax's rule) on points permuted by kernel_order;
        # skipped points hold -1, below every real distance, so they win only when nothing else is left,
        # and then the first of the order (point 0), as the kernel's besti = 0.
        order = kernel_order(n, xyz.device)  # (N,), order[0] == 0
        xyz = xyz[:, order]  # (B, N, 3)
        dist = torch.where(xyz.square().sum(-1) > KERNEL_MIN_SQUARED_NORM, 1e10, -1.0).to(xyz.dtype)  # (B, N)
    for i in range(m):
        idx[:, i] = farthest
        centre = xyz[batch, farthest].unsqueeze(1)  # (B, 1, 3)
        dist = torch.minimum(dist, (xyz - centre).square().sum(-1))  # (B, N); skipped stay -1
        farthest = dist.argmax(-1)
    return order[idx] if like_kernel else idx


# pointnet2_ops' FPS kernel: points with squared norm <= this are never sampled (``if (mag <= 1e-3) continue``).
KERNEL_MIN_SQUARED_NORM = 1e-3


def kernel_order(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The order (N,) in which pointnet2_ops' FPS kernel prefers tied points: the first of it wins a tie.

    The kernel runs T = 2^floor(log2 N) threads (at most 512, ``opt_n_threads``); thread t scans points
    t, t + T, ... keeping the first maximum, then a tree reduction halves the threads, the lower half
    winning ties (``__update``), so the last halving (stride 1) decides on bit 0 of t, the one before on
    bit 1, and so on: among tied threads, the one whose bits read backwards are smallest wins.
    """
    threads = max(min(1 << int(math.log(n) / math.log(2.0)), 512), 1)  # the kernel's double arithmetic
    bits = threads.bit_length() - 1
    k = torch.arange(n)
    t = k % threads
    reversed_t = sum(((t >> i) & 1) << (bits - 1 - i) for i in range(bits)) if bits else torch.zeros_like(t)
    return torch.argsort(reversed_t * n + k).to(device)  # key (bit-reversed thread, index)


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


# Entries of the (B, rows, N) distance block that knn holds at once: 2**24 float32 = 64 MiB, whatever N is.
KNN_BLOCK_ELEMENTS = 1 << 24


@torch.no_grad()
def knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, M, k) of the k nearest ``points`` (B, N, 3) of each ``query`` (B, M, 3).

    Nearest first, ties to the lower index: the neighbours are the first k of the points sorted by
    (:func:`square_distance`, index), whatever the device or the block size. The queries are taken in
    blocks of rows whose distance matrix holds at most ``KNN_BLOCK_ELEMENTS`` entries, so the peak memory
    is O(B M k) plus one block, not O(B M N); the time stays O(B M N). Plain torch: runs as is on CUDA.
    """
    b, m, _ = query.shape
    n = points.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"knn: cannot take {k} neighbours among {n} points.")
    rows = max(1, KNN_BLOCK_ELEMENTS // (b * n))
    if rows >= m:
        return smallest(square_distance(query, points), k)
    out = torch.empty(b, m, k, dtype=torch.long, device=query.device)
    for i in range(0, m, rows):
        out[:, i:i + rows] = smallest(square_distance(query[:, i:i + rows], points), k)  # (B, rows, k)
    return out


def smallest(d: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the k smallest entries of each row of d (..., N), ordered by (value, index).

    ``topk`` finds the k smallest values in order, but neither its order among equal values nor which of
    the entries tied with the k-th value it picks is specified; rows with ties are redone by the rule.
    d serves as scratch space and is left as it came.
    """
    n = d.shape[-1]
    # One more than k tells whether an entry left out ties the k-th: nearly free once k > 16 (torch's
    # CPU topk leaves its fast small-k path there); below, a scatter and a min over the row cost less.
    more = n > k > 16
    values, idx = d.topk(k + more, dim=-1, largest=False, sorted=True)  # (..., k or k + 1)
    if more:
        spill = values[..., k] == values[..., k - 1]  # (...,)
        values, idx = values[..., :k], idx[..., :k]
    elif k < n:
        spill = d.scatter_(-1, idx, math.inf).amin(-1) <= values[..., -1]  # (...,) an entry left out ties
        d.scatter_(-1, idx, values)  # restores d
    else:
        spill = torch.zeros(d.shape[:-1], dtype=torch.bool, device=d.device)
    tied = (values[..., 1:] == values[..., :-1]).any(-1) | spill  # (...,) ties among the k taken
    if spill.any():  # take every entry below the k-th value and the lowest-indexed of those equal to it
        rows = spill.nonzero(as_tuple=True)
        dr, kth = d[rows], values[rows][:, -1:]  # (R, N), (R, 1)
        below, equal = dr < kth, dr == kth
        take = below | (equal & (equal.cumsum(-1) <= k - below.sum(-1, keepdim=True)))  # (R, N), k a row
        idx[rows] = take.nonzero()[:, 1].view(-1, k)  # (R, k), increasing index
        values[rows] = dr.gather(-1, idx[rows])
    if tied.any():  # order by (value, index): by index, then stably by value
        rows = tied.nonzero(as_tuple=True)
        i, order = idx[rows].sort(dim=-1)  # (R, k)
        idx[rows] = i.gather(-1, values[rows].gather(-1, order).sort(dim=-1, stable=True).indices)
    return idx


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, C) gathered at idx (B, *S) -> (B, *S, C)."""
    b = x.shape[0]
    flat = idx.reshape(b, -1)  # (B, S)
    out = torch.gather(x, 1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, S, C)
    return out.reshape(*idx.shape, x.shape[-1])
