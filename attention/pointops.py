"""Point-set neighbourhoods in plain batched torch, on the data's device.

torch-geometric's ``fps``/``knn`` need pyg-lib or torch-cluster, which have no
wheels for every torch build (none for the one we install), so the two
operations PCT and the local variants need are written here; both run under
``no_grad`` because indices carry no gradient. On a GPU, farthest point sampling
runs as one Triton kernel (attention/fps_triton.py) instead of m steps of torch ops.
"""

from __future__ import annotations

import math
import warnings

import torch


# Not traced by torch.compile: dynamo would unroll the m steps into the graph (about 20 ms of tracing a step, so
# seconds for PCT's 512) and hand the Triton launch to inductor, which need not keep enable_fp_fusion=False; run
# eagerly, it is one kernel launch on a GPU and indices (no gradient) either way.
@torch.compiler.disable
@torch.no_grad()
def farthest_point_sample(xyz: torch.Tensor, m: int, start: int | torch.Tensor = 0,
                          like_kernel: bool = False, backend: str = "auto") -> torch.Tensor:
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

    ``backend``: ``"torch"`` runs m steps of a few torch ops each (:func:`fps_loop`); ``"triton"`` runs one
    Triton kernel that loops over the m steps itself (:mod:`attention.fps_triton`: one launch instead of
    about 7 m, which on a GPU cost more than the network FPS feeds); ``"auto"`` takes the kernel for float32
    and float64 CUDA tensors where Triton works, the torch loop otherwise (CPU, half precision, no Triton).
    Both compute every squared distance as ``(dx*dx + dy*dy) + dz*dz`` with each operation rounded, so they
    return the same indices, ties included.
    """
    b, n, _ = xyz.shape
    if not 1 <= m <= n:
        raise ValueError(f"farthest_point_sample: cannot pick {m} of {n} points.")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"farthest_point_sample: backend must be 'auto', 'torch' or 'triton', got {backend!r}.")
    if isinstance(start, torch.Tensor):
        if start.shape != (b,) or start.dtype != torch.long:
            raise ValueError(f"farthest_point_sample: start must be an int or a ({b},) LongTensor, "
                             f"got {start.dtype} of shape {tuple(start.shape)}.")
        farthest = start.to(xyz.device)  # (B,)
    else:
        if not 0 <= start < n:
            raise ValueError(f"farthest_point_sample: start {start} is not a point index (N = {n}).")
        farthest = torch.full((b,), start, dtype=torch.long, device=xyz.device)  # (B,)
    if like_kernel:
        if not (isinstance(start, int) and start == 0):
            raise ValueError("farthest_point_sample: like_kernel=True starts at point 0, as the CUDA kernel does.")
        # The kernel's tie order becomes "first maximum" (argmax's rule) on points permuted by kernel_order;
        # skipped points hold -1, below every real distance, so they win only when nothing else is left,
        # and then the first of the order (point 0), as the kernel's besti = 0.
        order = kernel_order(n, xyz.device)  # (N,), order[0] == 0
        xyz = xyz[:, order]  # (B, N, 3)
        dist = torch.where(xyz.square().sum(-1) > KERNEL_MIN_SQUARED_NORM, 1e10, -1.0).to(xyz.dtype)  # (B, N)
    else:
        dist = torch.full((b, n), math.inf, dtype=xyz.dtype, device=xyz.device)  # (B, N)
    idx = None
    if backend == "triton" or backend == "auto" and xyz.is_cuda and xyz.dtype in TRITON_DTYPES and triton_usable():
        idx = fps_triton(xyz, m, farthest, dist, fallback=backend == "auto")  # (B, m), None if it failed
    if idx is None:
        idx = fps_loop(xyz, m, farthest, dist)  # (B, m)
    return order[idx] if like_kernel else idx


def fps_loop(xyz: torch.Tensor, m: int, start: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """:func:`farthest_point_sample`'s steps in torch: indices (B, m) from xyz (B, N, 3), start (B,), dist (B, N).

    dist holds each point's initial distance (inf, or the kernel's 1e10 / -1) and is updated in place. The
    points are laid out as coordinate planes (3, B, N) so that every op runs over contiguous rows, and each step
    writes into buffers allocated once: about 4 times fewer CPU cycles than indexing xyz[batch, farthest] and
    summing (B, N, 3) over its last dimension of 3 (benchmarks/fps.md). The squared distance is summed in a
    fixed order, (dx^2 + dy^2) + dz^2, as the Triton kernel does; on the CPU ``sum(-1)`` gave exactly that, so
    the indices are those of before (a CUDA reduction may sum 3 numbers in another order). Half precision keeps
    ``sum``, which accumulates in float32 and rounds once, as before.
    """
    b, n, _ = xyz.shape
    planes = xyz.permute(2, 0, 1).contiguous()  # (3, B, N)
    idx = torch.empty(m, b, dtype=torch.long, device=xyz.device)  # (m, B): step i writes a contiguous row
    idx[0] = start
    diff = torch.empty_like(planes)  # (3, B, N)
    dx, dy, dz = diff.unbind(0)  # (B, N) each
    d = torch.empty_like(dist)  # (B, N)
    reduced = xyz.dtype in (torch.float16, torch.bfloat16)
    for i in range(m - 1):
        centre = torch.gather(planes, 2, idx[i].view(1, b, 1).expand(3, b, 1))  # (3, B, 1)
        torch.sub(planes, centre, out=diff).square_()
        if reduced:
            torch.sum(diff, 0, out=d)
        else:
            torch.add(dx, dy, out=d).add_(dz)
        torch.minimum(dist, d, out=dist)  # skipped points stay -1
        torch.argmax(dist, 1, out=idx[i + 1])  # the first maximum
    return idx.t()


# Dtypes the Triton kernel takes; half precision stays on the torch loop (its sum accumulates in float32).
TRITON_DTYPES = (torch.float32, torch.float64)


# Whether backend="auto" may use the Triton kernel: None until :func:`triton_usable` first looks.
TRITON_USABLE: bool | None = None


def triton_usable() -> bool:
    """Whether Triton imports and finds a GPU driver (looked up once): ``backend="auto"`` uses the kernel only
    then, and not after it once failed (:func:`fps_triton`)."""
    global TRITON_USABLE
    if TRITON_USABLE is None:
        try:
            import triton

            triton.runtime.driver.active.get_current_target()
            TRITON_USABLE = True
        except Exception:  # not installed, no driver, no GPU: the torch loop does the work
            TRITON_USABLE = False
    return TRITON_USABLE


def fps_triton(xyz: torch.Tensor, m: int, start: torch.Tensor, dist: torch.Tensor,
               fallback: bool = False) -> torch.Tensor | None:
    """:func:`attention.fps_triton.farthest_point_sample`, imported here only, so that attention imports and
    runs without Triton. With ``fallback`` (backend="auto"), a kernel that fails to compile or launch warns,
    turns the kernel off for the process and returns None: the torch loop then does the work."""
    global TRITON_USABLE
    try:
        from . import fps_triton as kernel

        return kernel.farthest_point_sample(xyz, m, start, dist)
    except Exception as error:
        if not fallback or isinstance(error, torch.cuda.OutOfMemoryError):  # out of memory: not the kernel's fault
            raise
        warnings.warn(f"farthest_point_sample: the Triton kernel failed ({error!r}); the torch loop takes over.",
                      stacklevel=3)
        TRITON_USABLE = False
        return None


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


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances (B, N, M) between a (B, N, 3) and b (B, M, 3), in float32 at least.

    ``torch.cdist`` from the coordinate differences, not through |a|^2 + |b|^2 - 2 a.b: a matrix product
    rounds differently for different shapes, whereas this computes each pair alone, so a pair's distance
    is the same whatever the shapes it is computed among (knn's blocks and grid rely on it), and near
    points far from the origin keep their distances (no cancellation). Half inputs are upcast and
    autocast is off, as half precision (about 1e-3 relative) would reorder near neighbours.
    """
    with torch.autocast(a.device.type, enabled=False):
        a, b = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (a, b))
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def square_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared distances (B, N, M): :func:`distance` squared."""
    return distance(a, b).square_()


# Entries of a distance block that knn holds at once: 2**24 float32 = 64 MiB, whatever N is.
KNN_BLOCK_ELEMENTS = 1 << 24
# Above this many distances per sample (M * N), knn searches a grid of cells instead of every pair.
KNN_GRID_ABOVE = 1 << 24


@torch.no_grad()
def knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, M, k) of the k nearest ``points`` (B, N, 3) of each ``query`` (B, M, 3).

    Nearest first, ties to the lower index: the neighbours are the first k of the points sorted by
    (:func:`distance`, index), whatever the device, the block size or the search. Peak memory is
    O(B M k) plus one block of at most ``KNN_BLOCK_ELEMENTS`` distances, never the M x N matrix. Up to
    ``KNN_GRID_ABOVE`` distances a sample every pair is compared (:func:`knn_blocks`); above, a grid of
    cells prunes the pairs (:func:`knn_grid`), in time about O(M k) for evenly spread points. Plain torch:
    both run as they are on CUDA.
    """
    b, m, _ = query.shape
    n = points.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"knn: cannot take {k} neighbours among {n} points.")
    if m * n <= KNN_GRID_ABOVE:
        return knn_blocks(query, points, k)
    return torch.stack([knn_grid(q, p, k) for q, p in zip(query, points)])  # (B, M, k)


def knn_blocks(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`knn` by brute force: every query against every point, queries in blocks of rows."""
    b, m, _ = query.shape
    rows = max(1, KNN_BLOCK_ELEMENTS // (b * points.shape[1]))
    if rows >= m:
        return smallest(distance(query, points), k)
    out = torch.empty(b, m, k, dtype=torch.long, device=query.device)
    for i in range(0, m, rows):
        out[:, i:i + rows] = smallest(distance(query[:, i:i + rows], points), k)  # (B, rows, k)
    return out


def knn_grid(query: torch.Tensor, points: torch.Tensor, k: int, cell: float | None = None) -> torch.Tensor:
    """:func:`knn` of one sample, query (M, 3) and points (N, 3) -> (M, k), through a grid of cubic cells.

    The cells (side ``cell``; by default about 0.3 k points each) are grouped in blocks of 2 x 2 x 2; the
    queries of a block are compared, with :func:`distance` and :func:`smallest` as the brute force,
    to the points of the block's cells and of one ring of cells around them, taken in index order. A query
    keeps what it found when its k-th distance (plus a bound on the rounding of the distances) is below
    the distance from it to the nearest face of that region beyond which points lie: every point
    outside is then farther, so the result is the brute force's. The other queries search again with
    cells twice as large, and by brute force once one cell would hold every point.
    """
    m, n = len(query), len(points)
    lo = points.amin(0)
    extent = (points.amax(0) - lo).tolist()
    if cell is None:  # the side at which the occupied box holds about n / (0.3 k) cells
        target, a, z = n / max(0.3 * k, 1.0), 1e-30, max(max(extent), 1e-30)
        for _ in range(60):
            mid = math.sqrt(a * z)
            cells = math.prod(max(1.0, e / mid) for e in extent)
            a, z = (mid, z) if cells > target else (a, mid)
        cell = z
    dims = [int(e // cell) + 1 for e in extent]  # cells per axis
    if math.prod(dims) <= 8 or m * n <= KNN_BLOCK_ELEMENTS:
        return knn_blocks(query[None], points[None], k)[0]
    high = torch.tensor(dims, device=points.device) - 1
    pc = ((points - lo) / cell).floor().long().clamp_(min=0).minimum(high)  # (N, 3) cell of each point
    cell_key = (pc[:, 0] * dims[1] + pc[:, 1]) * dims[2] + pc[:, 2]  # (N,), z fastest
    by_cell = cell_key.argsort(stable=True)  # (N,) points in cell order
    cell_key = cell_key[by_cell]
    qb = ((query - lo) / cell).floor().long().clamp_(min=0).minimum(high) // 2  # (M, 3) block of each query
    nb = [(d + 1) // 2 for d in dims]  # blocks per axis
    key = (qb[:, 0] * nb[1] + qb[:, 1]) * nb[2] + qb[:, 2]  # (M,)
    order = key.argsort(stable=True)
    keys, counts = key[order].unique_consecutive(return_counts=True)
    # rounding: a computed distance is within a few eps of the exact one, relatively; the faces are placed
    # within ~eps of the region's extent; both bounds are taken 16 times over
    eps = torch.finfo(distance(query[None, :1], points[None, :1]).dtype).eps
    slack = 16 * eps * (float(lo.abs().max()) + max(extent) + 2 * cell)
    out = torch.empty(m, k, dtype=torch.long, device=query.device)
    retry = torch.zeros(m, dtype=torch.bool, device=query.device)
    for block, rows in zip(keys.tolist(), order.split(counts.tolist())):
        b3 = [block // (nb[1] * nb[2]), block // nb[2] % nb[1], block % nb[2]]
        c_lo = [max(2 * c - 1, 0) for c in b3]  # the block's cells and one ring around them, per axis
        c_hi = [min(2 * c + 2, d - 1) for c, d in zip(b3, dims)]
        # the region's points: for each of its (x, y) columns of cells, one run of the points in cell order
        columns = [x * dims[1] + y for x in range(c_lo[0], c_hi[0] + 1) for y in range(c_lo[1], c_hi[1] + 1)]
        first = torch.tensor([[c * dims[2] + c_lo[2], c * dims[2] + c_hi[2] + 1] for c in columns],
                             device=points.device)  # (columns, 2) first keys in and after each run
        start, end = torch.searchsorted(cell_key, first).unbind(1)  # (columns,)
        length = end - start
        offset = torch.repeat_interleave(start - (length.cumsum(0) - length), length)  # (P,)
        candidates = by_cell[offset + torch.arange(len(offset), device=points.device)].sort().values  # (P,)
        if len(candidates) < k:
            retry[rows] = True
            continue
        q = query[rows]  # (R, 3)
        found, kth, step = [], [], max(1, KNN_BLOCK_ELEMENTS // len(candidates))
        for i in range(0, len(rows), step):
            d = distance(q[None, i:i + step], points[None, candidates])[0]  # (rows, P)
            found.append(smallest(d, k))  # (rows, k), positions among the candidates
            kth.append(d.gather(1, found[-1][:, -1:])[:, 0])  # (rows,)
        found, kth = torch.cat(found), torch.cat(kth)  # (R, k), (R,)
        # distance to the nearest face with points beyond it (none beyond the grid's outer cells)
        margin = torch.full_like(kth, math.inf)
        for axis in range(3):
            if c_lo[axis] > 0:
                margin = margin.minimum(q[:, axis] - (lo[axis] + c_lo[axis] * cell))
            if c_hi[axis] < dims[axis] - 1:
                margin = margin.minimum(lo[axis] + (c_hi[axis] + 1) * cell - q[:, axis])
        margin = (margin - slack).clamp_min(0)
        out[rows] = candidates[found]
        retry[rows] = ~(kth * (1 + 16 * eps) < margin)
    if retry.any():
        rows = retry.nonzero()[:, 0]
        out[rows] = knn_grid(query[rows], points, k, 2 * cell)
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
