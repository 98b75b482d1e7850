"""k nearest neighbours as one Triton kernel: distances and a running top-k in registers, no (M, N) tensor.

:func:`attention.pointops.knn` calls :func:`knn` for float32 (and half, upcast) CUDA tensors where Triton works.
Program (b, j) takes BQ queries of sample b and sweeps the points in tiles of KP (k rounded up to a power of
two, at least 16). Each pair's squared distance is ``(dx*dx + dy*dy) + dz*dz`` with every operation rounded
(launched with ``enable_fp_fusion=False``: no fused multiply-add), the bits of
:func:`attention.pointops.square_distance`; with the point's index it makes one int64 key, ``bits << 32 | index``,
that orders as (distance, index) (a float32 >= 0 orders as its bit pattern) and is unique. The tile's keys are
sorted and merged with the KP best so far by one bitonic step (the elementwise minimum of the best, ascending,
and the tile, descending, holds the KP smallest of both), then sorted again. Memory: the (B, M, k) output, plus
O(B (N + M)) for the spatial order below.

Skipping what cannot change the answer. A program keeps each query's k-th best key (column k - 1 of the running
best; the later columns only pad the bitonic step). A tile is sorted and merged only if some query of the
program has a key in it below its k-th best: the keys are unique, so a tile with none leaves every query's k
best as they are (the first k columns stay the k smallest of all points seen; columns k.. may then miss keys,
which is harmless, as only the first k are ever compared or returned). That test is exact and costs one row
minimum; it saves the two sorts, not the distances.

The spatially sorted path (``n >= SORTED_FROM``). A tile is skipped only once the k-th bests are tight, which takes a
near point early; in index order, with points in no particular order, a program of BQ = 16 queries finds a point of
some query's current top k in almost every tile (about 1 - exp(-BQ k / t) for the t-th tile), so the test alone saves
little (at N = 65,536, k = 36: 30% of the merges, see below). So, per sample, in torch: points and queries are sorted
by a Morton (Z-order) code of their coordinates quantised to 1024 cells per axis in the points' bounding cube
(:func:`spatial_order`; ties of code keep index order), so a program's BQ consecutive queries are close together;
each program starts its sweep at the tile holding its middle query's place in the sorted points and widens outward
(t0, t0 + 1, t0 - 1, t0 + 2, ..., then the remaining side: :func:`visit_order` models it), so the k-th bests are
tight after a few tiles. Each tile also carries the bounding box of its points (precomputed in torch); for query q
the squared distance to the box, computed as the kernel computes a distance (per axis ``max(lo - q, q - hi, 0)``,
squared and summed in the same order, each operation rounded), is <= the computed distance of every point in the box,
because rounding is monotone (|fl(q - p)| >= fl(lo - q) when q < lo <= p, and so on through the squares and sums). A
tile whose bound key ``bound_bits << 32`` is >= the k-th best key of every query of the program holds no key below
any of them: its distances are not even computed. A box or a query with a coordinate that is not finite
(``x - x != 0``) is never skipped by the bound (no monotone bound there; NaN bits may be negative keys). Keys carry
the ORIGINAL point index (loaded from the permutation), so ties still go to the lower original index, and each
program stores its rows at the queries' original places: the result is the simple path's, index for index; only the
work differs.

When to sort. The sort is a fixed few dozen small torch launches (codes, two argsorts, gathers, a searchsorted,
the boxes: of order 0.1 ms on a GPU at B x N = 32 x 1024, launch-bound) plus O(N log N) per sample; what it saves
is tile merges in each program's sweep, and the saving grows with the sweep's length N / KP (model counts, k = 32,
uniform points: at N = 1,024 a program merges 32 of 32 tiles in index order and about 13 sorted, 2.5 times fewer;
at N = 4,096, 128 of 128 against 16, 8 times fewer; at 65,536 (k = 36), 715 of 1,024 against 15). At PCT's sizes
(B = 32, 512 queries x 1,024 points, k = 32: 1,024 programs of 32 merges, two 16 x 32 int64 bitonic sorts each,
itself of order 0.1 ms) saving 60% of the merges would roughly pay for the sort's launches: no clear gain, so
PCT keeps the simple path. From N = 4,096 on, the sweep costs 4 times PCT's per query and the sort saves
7/8 of it: ``SORTED_FROM = 4096``. (Estimates, not yet timed on a GPU; the tests force the sorted path at small
N by lowering the threshold.)

Work, counted in tile merges (two BQ x KP int64 sorts each) and distance evaluations, before -> after. The
"after" counts come from a torch model of the kernel's loop on uniform points (same tiles, visit order, bounds
and tests; on the interpreter's small cases it gives the kernel's own counts, see the tests):

- N = M = 65,536, k = 36 (KP = 64), B = 1: 4,096 programs x 1,024 tiles. Before: 4.2 M tile merges (8.4 M sorts
  of 16 x 64 int64) and 4.3e9 distances. The k-th-best test alone, in index order, would still merge about 715
  tiles a program (2.9 M). The sorted path computes 26.6 tiles a program on average (at most 61) and merges 14.7
  (at most 29): 6.0e4 merges (70 times fewer) and 1.1e8 distances (39 times fewer), plus 4.2 M box tests
  (6.7e7 query-box bounds of about ten flops each), which now make most of the loop's iterations.
- PCT: B = 32, M = 512, N = 1,024, k = 32 (KP = 32): 1,024 programs x 32 tiles. Before: 32,768 merges and
  1.7e7 distances; after, the same (N < SORTED_FROM: the simple path, and with queries in no spatial order the
  k-th-best test skips no tile there: 32 of 32 merged in the model). The sorted path would merge about 13 of 32
  (18 computed) a program, 2.5 times fewer merges for the launches of the sort: no clear gain.

What is left: every program of the sorted path still tests all N / KP boxes (latency-bound scalar loads, about
1,000 iterations at N = 65,536); visiting the tiles in the order of their bound and stopping at the first one
beyond every k-th best would cut that to the tens the counts above show, at the cost of sorting bounds.

This module imports Triton at its top; :mod:`attention.pointops` imports it only when the kernel is wanted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pointops import MORTON_BITS, morton_codes
from .triton_kernels import cdiv, pow2

# Queries a program takes.
BQ = 16
# Largest k the kernel takes (its running top-k is BQ x KP int64 in registers); above, the torch search.
MAX_K = 128
# From this many points per sample on, knn sorts points and queries spatially first (see the module docstring).
SORTED_FROM = 4096
# The key of "no point": above every real key.
NO_KEY = tl.constexpr(0x7FFFFFFFFFFFFFFF)


@triton.jit
def _knn_kernel(q_ptr, p_ptr, out_ptr, m, n, k, stride_qb, stride_qm, stride_qc, row_ptr, index_ptr, box_ptr,
                start_ptr, stats_ptr, BQ: tl.constexpr, KP: tl.constexpr, SORTED: tl.constexpr, STATS: tl.constexpr):
    """out[b, rows of queries j*BQ .. (j+1)*BQ - 1, :k] for queries q (B, M, 3) of strides (stride_qb, stride_qm,
    stride_qc) and point planes p (B, 3, N), float32. The queries are read once a program, so any strides do (no
    copy into planes: a launch less a call); the points, read by every program, come as contiguous planes.

    SORTED: q and p are in spatial order; row (B, M) int32 is each query's original row, index (B, N) int32 each
    point's original index, box (B, 6, T) float32 each tile's (lo x, y, z, hi x, y, z), start (B, programs) int32
    each program's first tile. Otherwise those four are not read and the tiles go in index order. STATS: stats
    (B, programs, 3) int32 gets the tiles visited, computed (distances evaluated) and merged.
    """
    b = tl.program_id(0)
    j = tl.program_id(1)
    programs = tl.num_programs(1)
    rq = j * BQ + tl.arange(0, BQ)  # (BQ,) query positions
    mq = rq < m
    q_at = q_ptr + b.to(tl.int64) * stride_qb + rq * stride_qm  # (BQ,) pointers to the queries' x
    qx = tl.load(q_at, mask=mq, other=0.0)
    qy = tl.load(q_at + stride_qc, mask=mq, other=0.0)
    qz = tl.load(q_at + 2 * stride_qc, mask=mq, other=0.0)
    cols = tl.arange(0, KP)
    best = tl.full((BQ, KP), NO_KEY, tl.int64)  # ascending
    kth = tl.full((BQ,), NO_KEY, tl.int64)  # best[:, k - 1]
    tiles = tl.cdiv(n, KP)
    if SORTED:
        t0 = tl.load(start_ptr + b * programs + j)
        below = t0  # tiles before the first one
        above = tiles - 1 - t0  # and after it
        both = tl.minimum(below, above)
        q_finite = ((qx - qx == 0.0) & (qy - qy == 0.0) & (qz - qz == 0.0)).to(tl.int32)  # (BQ,) 1: finite
    computed = 0
    merged = 0
    i = 0
    while i < tiles:  # a while loop: Triton 3.6's interpreter too
        if SORTED:
            # outward from t0, alternating sides while both have tiles left, then the side that has
            step = (i + 1) // 2
            near = tl.where(i % 2 == 1, t0 + step, t0 - step)
            far = tl.where(above > below, t0 + (i - both), t0 - (i - both))
            tile = tl.where(i <= 2 * both, near, far)
            lox = tl.load(box_ptr + (b * 6 + 0) * tiles + tile)
            loy = tl.load(box_ptr + (b * 6 + 1) * tiles + tile)
            loz = tl.load(box_ptr + (b * 6 + 2) * tiles + tile)
            hix = tl.load(box_ptr + (b * 6 + 3) * tiles + tile)
            hiy = tl.load(box_ptr + (b * 6 + 4) * tiles + tile)
            hiz = tl.load(box_ptr + (b * 6 + 5) * tiles + tile)
            gap = tl.maximum(tl.maximum(lox - qx, qx - hix), 0.0)  # (BQ,)
            bound = gap * gap
            gap = tl.maximum(tl.maximum(loy - qy, qy - hiy), 0.0)
            bound = bound + gap * gap
            gap = tl.maximum(tl.maximum(loz - qz, qz - hiz), 0.0)
            bound = bound + gap * gap
            # 1 if every coordinate of the box is finite (x - x == 0); as int32: the interpreter cannot & a
            # scalar bool with a vector
            box_finite = ((lox - lox == 0.0) & (loy - loy == 0.0) & (loz - loz == 0.0) & (hix - hix == 0.0)
                          & (hiy - hiy == 0.0) & (hiz - hiz == 0.0)).to(tl.int32)
            bound_key = bound.to(tl.int32, bitcast=True).to(tl.int64) << 32
            reach = mq & ((bound_key < kth) | (q_finite * box_finite == 0))  # (BQ,) the tile may hold a better key
            look = tl.max(reach.to(tl.int32), axis=0) > 0
        else:
            tile = i
            look = True
        if look:
            computed += 1
            rp = tile * KP + cols  # (KP,) point positions
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
            if SORTED:
                index = tl.load(index_ptr + b * n + rp, mask=mp, other=0).to(tl.int64)  # original indices
            else:
                index = rp.to(tl.int64)
            key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | index[None, :]
            key = tl.where(mp[None, :], key, NO_KEY)
            gain = mq & (tl.min(key, axis=1) < kth)  # (BQ,) keys are unique: strict < is exact
            if tl.max(gain.to(tl.int32), axis=0) > 0:
                merged += 1
                key = tl.sort(key, dim=1)
                best = tl.sort(tl.minimum(best, tl.flip(key, dim=1)), dim=1)
                kth = tl.min(tl.where(cols[None, :] == k - 1, best, NO_KEY), axis=1)
        i += 1
    if SORTED:
        row = tl.load(row_ptr + b * m + rq, mask=mq, other=0)  # (BQ,) original query rows
    else:
        row = rq
    tl.store(out_ptr + (b * m + row[:, None]).to(tl.int64) * k + cols[None, :], best & 0xFFFFFFFF,
             mask=mq[:, None] & (cols[None, :] < k))
    if STATS:
        tl.store(stats_ptr + (b * programs + j) * 3 + 0, i)
        tl.store(stats_ptr + (b * programs + j) * 3 + 1, computed)
        tl.store(stats_ptr + (b * programs + j) * 3 + 2, merged)


def spatial_order(query: torch.Tensor, points: torch.Tensor, kp: int) -> tuple[torch.Tensor, ...]:
    """What the kernel's sorted path reads, for float32 query (B, M, 3) and points (B, N, 3) and tiles of kp:
    the queries (B, M, 3) and point planes (B, 3, N) in Morton order, each query's original row (B, M) int32,
    each point's original index (B, N) int32, the tiles' boxes (B, 6, T) and each program's first tile
    (B, programs) int32 (the tile where its middle query's code falls among the points' codes). O(B (N + M))
    memory, no host synchronisation."""
    b, m, _ = query.shape
    n = points.shape[1]
    tiles = cdiv(n, kp)
    lo = points.amin(1, keepdim=True)  # (B, 1, 3) the points' bounding cube
    side = (points.amax(1, keepdim=True) - lo).amax(-1, keepdim=True)  # (B, 1, 1)
    scale = (1 << MORTON_BITS) / side.clamp_min(torch.finfo(torch.float32).tiny)
    code = morton_codes(torch.cat([points, query], 1), lo, scale)  # (B, N + M): one pass for both
    p_code, p_order = code[:, :n].sort(dim=1, stable=True)  # (B, N) each
    q_code, q_order = code[:, n:].sort(dim=1, stable=True)  # (B, M) each
    p_sorted = points.gather(1, p_order[..., None].expand(-1, -1, 3))  # (B, N, 3)
    q_sorted = query.gather(1, q_order[..., None].expand(-1, -1, 3))  # (B, M, 3)
    programs = cdiv(m, BQ)
    middle = (torch.arange(programs, device=query.device) * BQ + BQ // 2).clamp_(max=m - 1)  # (programs,)
    place = torch.searchsorted(p_code, q_code[:, middle].contiguous())  # (B, programs) in [0, N]
    start = (place // kp).clamp_(max=tiles - 1).int()  # (B, programs)
    # the tiles' boxes: pad the last tile with copies of the last point (no wider box), then (B, T, kp, 3)
    padded = torch.cat([p_sorted, p_sorted[:, -1:].expand(-1, tiles * kp - n, -1)], 1).view(b, tiles, kp, 3)
    box = torch.cat([padded.amin(2), padded.amax(2)], -1)  # (B, T, 6); NaN spreads: that box is not finite
    return (q_sorted, p_sorted.permute(0, 2, 1).contiguous(), q_order.int(), p_order.int(),
            box.permute(0, 2, 1).contiguous(), start)  # (B, M, 3), (B, 3, N), ..., (B, 6, T)


def visit_order(start: int, tiles: int) -> list[int]:
    """The tiles in the order a program of the sorted path visits them from tile ``start``: a model of the
    kernel's loop, for tests and reasoning."""
    below, above = start, tiles - 1 - start
    both = min(below, above)
    order = []
    for i in range(tiles):
        step = (i + 1) // 2
        near = start + step if i % 2 == 1 else start - step
        far = start + (i - both) if above > below else start - (i - both)
        order.append(near if i <= 2 * both else far)
    return order


def knn(query: torch.Tensor, points: torch.Tensor, k: int, sort: bool | None = None,
        stats: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Indices (B, M, k) of the k nearest points (B, N, 3) of each query (B, M, 3), float32 (half is upcast):
    :func:`attention.pointops.knn`'s rule, index for index. k <= ``MAX_K``; N < 2^31.

    ``sort``: take the spatially sorted path (None: for N >= ``SORTED_FROM``); either way the same indices.
    ``stats``: also return, per program, (tiles visited, tiles whose distances were computed, tiles merged),
    a (B, programs, 3) int32 tensor: the work the skips saved.
    """
    b, m, _ = query.shape
    n = points.shape[1]
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"knn_triton: k must be in [1, min(N, {MAX_K})], got {k} (N = {n}).")
    if sort is None:
        sort = n >= SORTED_FROM
    kp = max(16, pow2(k))
    programs = cdiv(m, BQ)
    out = torch.empty(b, m, k, dtype=torch.int64, device=query.device)
    counts = torch.zeros(b, programs, 3, dtype=torch.int32, device=query.device) if stats else out
    if sort:
        q, p, row, index, box, start = spatial_order(query.float(), points.float(), kp)
    else:
        q = query.float()  # (B, M, 3), any strides
        p = points.float().permute(0, 2, 1).contiguous()  # (B, 3, N)
        row = index = box = start = out  # not read
    _knn_kernel[(b, programs)](q, p, out, m, n, k, *q.stride(), row, index, box, start, counts, BQ=BQ, KP=kp,
                               SORTED=sort, STATS=stats, enable_fp_fusion=False)
    return (out, counts) if stats else out


def knn_if_supported(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor | None:
    """:func:`knn`, or None where k is above ``MAX_K``: what :func:`attention.pointops.knn` calls (the torch search
    takes what this returns None for)."""
    return knn(query, points, k) if k <= MAX_K else None
