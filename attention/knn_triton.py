"""k nearest neighbours as one Triton kernel: distances and a running top-k in registers, no (M, N) tensor.

:func:`attention.pointops.knn` calls :func:`knn` for float32 (and half, upcast) CUDA tensors where Triton works.
Program (b, j) takes BQ queries of sample b and sweeps the points in tiles of KP (k rounded up to a power of
two, at least 16). Each pair's squared distance is ``(dx*dx + dy*dy) + dz*dz`` with every operation rounded
(launched with ``enable_fp_fusion=False``: no fused multiply-add), the bits of
:func:`attention.pointops.square_distance`; with its index it makes one int64 key, ``bits << 32 | index``, that
orders as (distance, index) (a float32 >= 0 orders as its bit pattern). The tile's keys are sorted and merged
with the KP best so far by one bitonic step (the elementwise minimum of the best, ascending, and the tile,
descending, holds the KP smallest of both), then sorted again. Memory: the (B, M, k) output only.

This module imports Triton at its top; :mod:`attention.pointops` imports it only when the kernel is wanted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Queries a program takes.
BQ = 16
# Largest k the kernel takes (its running top-k is BQ x KP int64 in registers); above, the torch search.
MAX_K = 128
# The key of "no point": above every real key.
NO_KEY = tl.constexpr(0x7FFFFFFFFFFFFFFF)


@triton.jit
def _knn_kernel(q_ptr, p_ptr, out_ptr, m, n, k, BQ: tl.constexpr, KP: tl.constexpr):
    """out[b, j*BQ : (j+1)*BQ, :k] for query planes q (B, 3, M) and point planes p (B, 3, N), float32."""
    b = tl.program_id(0)
    rq = tl.program_id(1) * BQ + tl.arange(0, BQ)  # (BQ,) query indices
    mq = rq < m
    qx = tl.load(q_ptr + (b * 3 + 0) * m + rq, mask=mq, other=0.0)
    qy = tl.load(q_ptr + (b * 3 + 1) * m + rq, mask=mq, other=0.0)
    qz = tl.load(q_ptr + (b * 3 + 2) * m + rq, mask=mq, other=0.0)
    best = tl.full((BQ, KP), NO_KEY, tl.int64)  # ascending
    start = 0
    while start < n:  # a while loop: Triton 3.6's interpreter too
        rp = start + tl.arange(0, KP)  # (KP,) point indices
        mp = rp < n
        px = tl.load(p_ptr + (b * 3 + 0) * n + rp, mask=mp, other=0.0)
        py = tl.load(p_ptr + (b * 3 + 1) * n + rp, mask=mp, other=0.0)
        pz = tl.load(p_ptr + (b * 3 + 2) * n + rp, mask=mp, other=0.0)
        d = qx[:, None] - px[None, :]  # (BQ, KP)
        s = d * d
        d = qy[:, None] - py[None, :]
        s = s + d * d
        d = qz[:, None] - pz[None, :]
        s = s + d * d
        key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | rp.to(tl.int64)[None, :]
        key = tl.sort(tl.where(mp[None, :], key, NO_KEY), dim=1)
        best = tl.sort(tl.minimum(best, tl.flip(key, dim=1)), dim=1)
        start += KP
    cols = tl.arange(0, KP)
    tl.store(out_ptr + (b * m + rq[:, None]) * k + cols[None, :], best & 0xFFFFFFFF,
             mask=mq[:, None] & (cols[None, :] < k))


def knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, M, k) of the k nearest points (B, N, 3) of each query (B, M, 3), float32 (half is upcast):
    :func:`attention.pointops.knn`'s rule, index for index. k <= ``MAX_K``; N < 2^31."""
    b, m, _ = query.shape
    n = points.shape[1]
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"knn_triton: k must be in [1, min(N, {MAX_K})], got {k} (N = {n}).")
    q = query.float().permute(0, 2, 1).contiguous()  # (B, 3, M)
    p = points.float().permute(0, 2, 1).contiguous()  # (B, 3, N)
    out = torch.empty(b, m, k, dtype=torch.int64, device=query.device)
    kp = max(16, triton.next_power_of_2(k))
    _knn_kernel[(b, triton.cdiv(m, BQ))](q, p, out, m, n, k, BQ=BQ, KP=kp, enable_fp_fusion=False)
    return out
