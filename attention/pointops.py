"""Point-set neighbourhoods in plain batched torch, on the data's device.

torch-geometric's ``fps``/``knn`` need pyg-lib or torch-cluster, which have no
wheels for every torch build (none for the one we install), so the two
operations PCT and the local variants need are written here; both run under
``no_grad`` because indices carry no gradient. On a GPU, farthest point sampling
runs as one Triton kernel (attention/fps_triton.py) instead of m steps of torch ops. Both are ``torch.library``
ops, so that ``torch.compile`` keeps a network that samples in one graph.
"""

from __future__ import annotations

import math

import torch

from .eager import below_autograd, skips_dispatch
from .tensor_cache import tensor_cache
from .triton_kernels import Kernels


def farthest_point_sample(xyz: torch.Tensor, m: int, start: int | torch.Tensor = 0,
                          like_kernel: bool = False, backend: str = "auto") -> torch.Tensor:
    """Indices (B, m) of m points picked by farthest point sampling, from point ``start``.

    ``start`` is one index for every sample, or a (B,) LongTensor of one start
    per sample (e.g. a point chosen by geometry, so that the result does not
    depend on the order of the points). Ties go to the lowest index. Every squared
    distance is ``(dx*dx + dy*dy) + dz*dz`` in the points' dtype, each operation
    rounded on its own.

    ``like_kernel=True`` gives what pointnet2_ops' CUDA kernel
    (``furthest_point_sampling_kernel`` in ``sampling_gpu.cu``, which PCT_Pytorch
    calls) returns, index for index, as nvcc builds it (``-fmad=true``, its
    default), for float32 points (half precision ones are taken to float32,
    as the op takes float32 only):

    - it starts at point 0 (``start`` must then be 0);
    - it never picks nor updates a point whose squared norm ``mag`` is <= 1e-3 in
      double precision (the C++ compares the float with the double literal); if
      only such points are left, it picks point 0 again;
    - nvcc contracts ``mag = x*x + y*y + z*z`` into ``fma(z, z, fma(x, x, y*y))``
      and the squared distance into ``fma(dz, dz, fma(dx, dx, dy*dy))`` with
      ``dx = x - cx`` (so read from the PTX nvcc 13.0 writes for sm_90): the
      product y*y rounded, each fused multiply-add rounded once. :func:`fma32`
      computes exactly that rounding without an FMA instruction;
    - ties go as its block reduction decides them (:func:`kernel_order`).

    Float64 points (the op has no float64 version) keep the start, the skipped
    points and the tie order, with the plain rule's float64 distances
    (``(dx*dx + dy*dy) + dz*dz``, ``mag`` likewise): the float64 tests compare
    whole networks in float64.

    ``backend``: ``"torch"`` runs m steps of a few torch ops each (:func:`fps_loop`); ``"triton"`` runs one
    Triton kernel that loops over the m steps itself (:mod:`attention.fps_triton`: one launch instead of
    about 7 m, which on a GPU cost more than the network FPS feeds); ``"auto"`` takes the kernel for float32
    and float64 CUDA tensors where Triton works, the torch loop otherwise (CPU, half precision, no Triton).
    Both round every operation alike (``like_kernel``: the same fused multiply-adds), so they return the
    same indices, ties included.

    Under ``torch.compile`` (and dispatch modes) it is one op of the graph (``attention_suite::farthest_point_sample``,
    with a fake kernel for its shape; eager calls run its kernel without the op's dispatch, :mod:`attention.eager`):
    dynamo would otherwise unroll the m steps into the graph (about 20 ms of tracing a step, so seconds for PCT's
    512) and hand the Triton launch to inductor, which need not keep enable_fp_fusion=False; a
    ``torch.compiler.disable`` (as before) broke the graph of every network that samples. It runs as in eager mode.
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
    elif not 0 <= start < n:
        raise ValueError(f"farthest_point_sample: start {start} is not a point index (N = {n}).")
    if like_kernel and not (isinstance(start, int) and start == 0):
        raise ValueError("farthest_point_sample: like_kernel=True starts at point 0, as the CUDA kernel does.")
    given = start if isinstance(start, torch.Tensor) else None
    args = (xyz, m, given, 0 if given is not None else start, like_kernel, backend)
    if skips_dispatch(xyz, *(() if given is None else (given,))):  # the op's kernel, without its dispatch
        with below_autograd():
            return _farthest_point_sample(*args)  # (B, m)
    return torch.ops.attention_suite.farthest_point_sample(*args)  # (B, m)


@torch.no_grad()
def farthest_from_centroid(xyz: torch.Tensor) -> torch.Tensor:
    """The index (B,) of each sample's point farthest from its centroid: a :func:`farthest_point_sample` start
    chosen by geometry, so that the sampled set, and whatever is pooled over it, does not depend on the order of
    the points (start 0 would pick another first point for every permutation). Ties to the lowest index."""
    return (xyz - xyz.mean(dim=1, keepdim=True)).square().sum(-1).argmax(-1)  # (B,)


@torch.no_grad()
def _farthest_point_sample(xyz: torch.Tensor, m: int, start: torch.Tensor | None, start_index: int,
                           like_kernel: bool, backend: str) -> torch.Tensor:
    """The op's kernel (arguments checked by :func:`farthest_point_sample`): ``start`` a (B,) LongTensor, or None
    for ``start_index`` in every sample."""
    b, n, _ = xyz.shape
    # like_kernel: the kernel's tie order becomes "first maximum" (argmax's rule) on the points permuted by
    # kernel_order; its skipped points start at distance -1 (initial_distances)
    order = kernel_order(n, xyz.device) if like_kernel else None  # (N,), order[0] == 0
    fused = like_kernel and xyz.dtype != torch.float64
    if fused:
        xyz = xyz.float()
    if backend == "triton" or (backend == "auto" and xyz.is_cuda and xyz.dtype in TRITON_DTYPES
                               and FPS_KERNELS.wanted((xyz,))):
        # one launch: the kernel permutes the points by the order itself and maps its picks back
        first = start if start is not None else start_index
        if fused:  # the kernel tests for the skipped points itself (its fused squared norm against KERNEL_MIN_MAG32)
            idx = FPS_KERNELS.call("farthest_point_sample", xyz, m, first, None, fused=True,
                                   min_mag=KERNEL_MIN_MAG32, order=order, fallback=backend == "auto")
        else:
            dist = initial_distances(xyz, like_kernel)  # (B, N)
            idx = FPS_KERNELS.call("farthest_point_sample", xyz, m, first,
                                   dist if order is None else dist.index_select(1, order), fused=False, order=order,
                                   fallback=backend == "auto")
        if idx is not None:  # None: the kernel failed, the torch loop takes over
            return idx  # (B, m)
    if start is not None:
        farthest = start.to(xyz.device)  # (B,)
    else:
        farthest = torch.full((b,), start_index, dtype=torch.long, device=xyz.device)  # (B,)
    if like_kernel:
        xyz = xyz.index_select(1, order)  # (B, N, 3) permuted
    idx = fps_loop(xyz, m, farthest, initial_distances(xyz, like_kernel), fused=fused)  # (B, m)
    # contiguous, as the fake kernel says (the loop builds it (m, B)); take: one gather of the 1-D order
    return order.take(idx) if like_kernel else idx.contiguous()


def initial_distances(xyz: torch.Tensor, like_kernel: bool) -> torch.Tensor:
    """(B, N) the running distances FPS starts from: infinity, or with ``like_kernel`` pointnet2_ops' start, 1e10,
    or -1 for the points it skips (squared norm <= 1e-3 in double precision: float32 points by its fused
    multiply-adds, float64 ones by the plain sum). Skipped points hold -1, below every real distance, so they win
    only when nothing else is left, and then the first of the order (point 0), as the kernel's besti = 0."""
    b, n, _ = xyz.shape
    if not like_kernel:
        return torch.full((b, n), math.inf, dtype=xyz.dtype, device=xyz.device)  # (B, N)
    if xyz.dtype == torch.float32:
        x, y, z = xyz.unbind(-1)  # (B, N) each
        kept = fma32(z, z, fma32(x, x, y * y)).double() > KERNEL_MIN_SQUARED_NORM  # (B, N)
    else:
        kept = xyz.square().sum(-1) > KERNEL_MIN_SQUARED_NORM  # (B, N)
    return torch.where(kept, 1e10, -1.0).to(xyz.dtype)  # (B, N)


def fps_loop(xyz: torch.Tensor, m: int, start: torch.Tensor, dist: torch.Tensor,
             fused: bool = False) -> torch.Tensor:
    """:func:`farthest_point_sample`'s steps in torch: indices (B, m) from xyz (B, N, 3), start (B,), dist (B, N).

    dist holds each point's initial distance (inf, or the kernel's 1e10 / -1) and is updated in place. The
    points are laid out as coordinate planes (3, B, N) so that every op runs over contiguous rows, and each step
    writes into buffers allocated once: about 4 times fewer CPU cycles than indexing xyz[batch, farthest] and
    summing (B, N, 3) over its last dimension of 3 (benchmarks/fps.md). The squared distance is summed in a
    fixed order, (dx^2 + dy^2) + dz^2, as the Triton kernel does; on the CPU ``sum(-1)`` gave exactly that, so
    the indices are those of before (a CUDA reduction may sum 3 numbers in another order). Half precision keeps
    ``sum``, which accumulates in float32 and rounds once, as before.

    ``fused`` (float32 points only): the squared distance is pointnet2_ops' ``fma(dz, dz, fma(dx, dx, dy*dy))``
    instead, each multiply-add rounded once, as :func:`fma32` computes it: each step sums dx^2 (exact in
    float64) and the float32 dy*dy in float64, rounds to float32, and likewise adds dz^2; only if one of the
    two float64 sums lies where a second rounding can go wrong (:func:`halfway32`: rare), the step is redone
    with :func:`fma32` itself. About 3 times the cost of a plain step on the CPU (benchmarks/fps.md).
    """
    b, n, _ = xyz.shape
    planes = xyz.permute(2, 0, 1).contiguous()  # (3, B, N)
    idx = torch.empty(m, b, dtype=torch.long, device=xyz.device)  # (m, B): step i writes a contiguous row
    idx[0] = start
    diff = torch.empty_like(planes)  # (3, B, N)
    dx, dy, dz = diff.unbind(0)  # (B, N) each
    d = torch.empty_like(dist)  # (B, N)
    reduced = xyz.dtype in (torch.float16, torch.bfloat16)
    if fused:
        if xyz.dtype != torch.float32:
            raise ValueError(f"fps_loop: fused distances are float32 only, got {xyz.dtype}.")
        fused_distance = FusedSquaredDistance(planes)
    for i in range(m - 1):
        centre = torch.gather(planes, 2, idx[i].view(1, b, 1).expand(3, b, 1))  # (3, B, 1)
        torch.sub(planes, centre, out=diff)
        if fused:
            fused_distance(diff, out=d)
        elif reduced:
            torch.sum(diff.square_(), 0, out=d)
        else:
            diff.square_()
            torch.add(dx, dy, out=d).add_(dz)
        torch.minimum(dist, d, out=dist)  # skipped points stay -1
        torch.argmax(dist, 1, out=idx[i + 1])  # the first maximum
    return idx.t()


class FusedSquaredDistance:
    """pointnet2_ops' squared distance ``fma(dz, dz, fma(dx, dx, dy*dy))``, each multiply-add rounded once to
    float32, for :func:`fps_loop`'s steps over float32 points planes (3, B, N), with its buffers allocated once.

    A step sums dx^2 (exact in float64) and the float32 dy*dy in float64 and rounds that to float32, then adds
    dz^2 alike: the once-rounded results, unless a float64 sum was inexact and a second rounding went wrong
    (:func:`fma32`), which :meth:`double_rounding` looks for; the step is then redone with :func:`fma32`.
    It need not look where the coordinates are multiples of 2^(r - 24) below 2^r (torch.rand's, a grid's):
    every difference, square and sum is then a multiple of 2^(2r - 48) below 2^(2r + 4), 52 bits, so every
    float64 sum is exact.
    """

    def __init__(self, planes: torch.Tensor):
        _, b, n = planes.shape
        self.squares = torch.empty(2, b, n, dtype=torch.float64, device=planes.device)  # (2, B, N): dx^2, dz^2
        self.addends = torch.empty_like(self.squares)  # (2, B, N): dy*dy, then the first sum, as float32 values
        self.sums = torch.empty_like(self.squares)  # (2, B, N): the two sums, rounded to float64
        self.bits = torch.empty_like(self.squares, dtype=torch.int64)  # (2, B, N)
        r = int(torch.frexp(planes.abs().max().double()).exponent)  # |coordinates| < 2^r
        self.exact = bool(((planes.double() * 2.0 ** (24 - r)).frac() == 0).all())
        # a float32 sum below 2^-126 (subnormal) needs a difference below 2^-63: a nonzero coordinate below 2^-40
        self.tiny = bool(((planes != 0) & (planes.abs() < 2.0 ** -40)).any())

    def __call__(self, diff: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The squared distances (B, N) into ``out`` (float32) from the differences diff (3, B, N)."""
        dx, dy, dz = diff.unbind(0)  # (B, N) each
        self.squares.copy_(diff[::2]).square_()
        torch.add(self.squares[0], self.addends[0].copy_(torch.mul(dy, dy, out=out)), out=self.sums[0])
        torch.add(self.squares[1], self.addends[1].copy_(out.copy_(self.sums[0])), out=self.sums[1])
        out.copy_(self.sums[1])
        if not self.exact and self.double_rounding():
            out.copy_(fma32(dz, dz, fma32(dx, dx, dy * dy)))
        return out

    def double_rounding(self) -> bool:
        """Whether a float64 sum of this step may round to another float32 than its exact value would: one
        exactly halfway between two float32 that is inexact (:func:`fma32`; halfway sums are rare, and exact
        ones do no harm), or, with coordinates that small, one in float32's subnormal range."""
        if self.tiny and bool(halfway32(self.sums).any()):
            return True
        bits = torch.bitwise_and(self.sums.view(torch.int64), HALFWAY_MASK, out=self.bits)
        if bits.bitwise_xor_(HALFWAY_BITS).min() > 0:
            return False
        at = (bits.view(-1) == 0).nonzero()[:, 0]  # (K,): a few
        p, c, s = (torch.take(t, at).tolist() for t in (self.squares, self.addends, self.sums))
        return any(math.fsum((a, b, -ab)) != 0 for a, b, ab in zip(p, c, s))  # fsum: exact here


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c of float32 tensors (broadcast) rounded once to float32, as a GPU's ``fma.rn.f32``.

    torch has no fused multiply-add op. The product of two float32 is exact in float64 (24 + 24 bits of 53).
    Its sum with c rounded to float64 and then to float32 is the once-rounded sum except where the float64 sum
    lies exactly halfway between two float32 (its own rounding then picked the side, not the exact value) or in
    float32's subnormal range (:func:`halfway32`): a monotonic rounding to float64 keeps the exact sum on the
    same side of every other float32 halfway point. Those elements take the sum with its exact error (TwoSum)
    rounded to odd in float64, which a second rounding to float32 cannot spoil (53 >= 24 + 2 bits; Boldo and
    Melquiond, "When double rounding is odd", 2005). Chosen elementwise, with no question to the host: on a GPU,
    ``like_kernel``'s mag test runs this in every forward.
    """
    p, c = torch.broadcast_tensors(a.double() * b.double(), c.double())
    s = p + c
    return torch.where(halfway32(s), sum_rounded_to_odd(p, c), s).float()


# A float64 lies exactly halfway between two adjacent normal float32 iff the low 29 of its 52 fraction bits
# read 1 and then 28 zeros (float32 keeps 23 fraction bits; a halfway point has a 24th, set, and no more).
HALFWAY_MASK, HALFWAY_BITS = (1 << 29) - 1, 1 << 28


def halfway32(s: torch.Tensor) -> torch.Tensor:
    """Where rounding the float64 s to float32 may not round the exact value s stands for (bool, like s): s
    exactly halfway between two normal float32, or nonzero below 2^-126 (float32's subnormals, a coarser grid)."""
    bits = s.view(torch.int64)
    return ((bits & HALFWAY_MASK) == HALFWAY_BITS) | (s != 0) & (s.abs() < 2.0 ** -126)


def sum_rounded_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (float64) rounded to odd: the float64 sum where exact, else of the two float64 around the exact sum
    the one whose last bit is 1."""
    s = a + b
    a_part = s - b  # TwoSum (Knuth): s + e == a + b exactly
    e = (a - a_part) + (b - (s - a_part))
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(e > 0, math.inf, -math.inf).to(s.dtype)
    return torch.where((e != 0) & even, torch.nextafter(s, toward), s)


# Dtypes the Triton kernel takes; half precision stays on the torch loop (its sum accumulates in float32).
TRITON_DTYPES = (torch.float32, torch.float64)


# The Triton kernel's family (attention.triton_kernels: imported when wanted, off for the process once it failed).
FPS_KERNELS = Kernels("attention.fps_triton", "farthest_point_sample", "the torch loop")


# pointnet2_ops' FPS kernel: points with squared norm <= this are never sampled (``if (mag <= 1e-3) continue``:
# a float compared with a double literal, so in double precision).
KERNEL_MIN_SQUARED_NORM = 1e-3
# The same test on a float32 squared norm, as a float32 comparison: mag > 1e-3 (double) <=> mag >= this, the
# smallest float32 above 1e-3 (float32(1e-3) itself, which rounds up). The Triton kernel compares with it.
KERNEL_MIN_MAG32 = float(torch.tensor(KERNEL_MIN_SQUARED_NORM, dtype=torch.float32))
if KERNEL_MIN_MAG32 <= KERNEL_MIN_SQUARED_NORM:
    KERNEL_MIN_MAG32 = float(torch.nextafter(torch.tensor(KERNEL_MIN_MAG32, dtype=torch.float32),
                                             torch.tensor(math.inf)))


def kernel_order(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The order (N,) in which pointnet2_ops' FPS kernel prefers tied points: the first of it wins a tie.

    The kernel runs T = 2^floor(log2 N) threads (at most 512, ``opt_n_threads``); thread t scans points
    t, t + T, ... keeping the first maximum, then a tree reduction halves the threads, the lower half
    winning ties (``__update``), so the last halving (stride 1) decides on bit 0 of t, the one before on
    bit 1, and so on: among tied threads, the one whose bits read backwards are smallest wins.

    Made once per (N, device) and shared: callers only read it. (Made at every call, it was built on the CPU
    and copied to the GPU in every like_kernel forward, a copy from pageable memory that waits for the GPU.)
    """
    return _kernel_order(n, torch.device(device))


@tensor_cache(maxsize=64)
def _kernel_order(n: int, device: torch.device) -> torch.Tensor:
    threads = max(min(1 << int(math.log(n) / math.log(2.0)), 512), 1)  # the kernel's double arithmetic
    bits = threads.bit_length() - 1
    k = torch.arange(n)
    t = k % threads
    reversed_t = sum(((t >> i) & 1) << (bits - 1 - i) for i in range(bits)) if bits else torch.zeros_like(t)
    return torch.argsort(reversed_t * n + k).to(device)  # key (bit-reversed thread, index)


# Bits per axis of the cells a Morton code quantises coordinates to (1024 cells: :func:`morton_codes` spreads 10).
MORTON_BITS = 10


def morton_codes(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Z-order codes (B, L) int64 of x (B, L, 3): each coordinate quantised to ``(x - lo) * scale`` cells, clamped
    to [0, 2^MORTON_BITS), and the three cell numbers' bits interleaved (x lowest). Non-finite coordinates get
    some cell: a code orders work (the Triton kNN's tiles, focal's queries), never an answer. About 20 ops
    whatever the bits (a loop over the 30 bits took 120: launches, on a GPU)."""
    c = ((x - lo) * scale).clamp_(0, (1 << MORTON_BITS) - 1).nan_to_num_(0).long()  # (B, L, 3) cell numbers
    # spread each 10-bit cell number so that its bit i lands on bit 3 i, in four shift-and-mask steps
    for shift, mask in ((16, 0x030000FF), (8, 0x0300F00F), (4, 0x030C30C3), (2, 0x09249249)):
        c = c.bitwise_or_(c << shift).bitwise_and_(mask)
    return c[..., 0] | (c[..., 1] << 1) | (c[..., 2] << 2)  # (B, L)


# On the CPU, square_distance fills its output this many entries at a time (1 MiB of float32): the eight
# elementwise passes then run in the L2 cache, 1.7x faster than cdist's kernel; a GPU takes the whole at once.
SQUARE_DISTANCE_CPU_CHUNK = 1 << 18


def square_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances (B, N, M) between a (B, N, 3) and b (B, M, 3), in float32 at least.

    Each pair on its own, from its coordinate differences, as ``(dx*dx + dy*dy) + dz*dz`` with every
    operation rounded (separate elementwise ops: nothing fuses them into an FMA), the order and rounding
    :func:`farthest_point_sample` uses. So a pair's distance is the same bits on every device and whatever
    the shapes it is computed among (knn's blocks and grid rely on it), and near points far from the origin
    keep their distances (no |a|^2 + |b|^2 - 2 a.b cancellation, no matrix product that rounds differently
    per shape). It replaces ``torch.cdist(..., compute_mode="donot_use_mm_for_euclid_dist")``, whose generic
    kernel took 13.8 ms a call at PCT's sizes on an H100 (83% of the eval forward) and rounds differently
    per device (an FMA chain and a square root on the CPU). Half inputs are upcast and autocast is off, as
    half precision (about 1e-3 relative) would reorder near neighbours. The device decides only how the
    output is filled: on the CPU in chunks of ``SQUARE_DISTANCE_CPU_CHUNK`` entries, elsewhere at once.
    """
    with torch.autocast(a.device.type, enabled=False):
        a, b = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (a, b))
        a, b = a.permute(2, 0, 1).contiguous(), b.permute(2, 0, 1).contiguous()  # (3, B, N), (3, B, M)
        (_, batch, n), m = a.shape, b.shape[2]
        out = torch.empty(batch, n, m, dtype=torch.result_type(a, b), device=a.device)  # (B, N, M)
        if a.device.type != "cpu" or out.numel() <= SQUARE_DISTANCE_CPU_CHUNK:
            square_distance_into(a, b, out, torch.empty_like(out))
            return out
        rows = max(1, min(n, SQUARE_DISTANCE_CPU_CHUNK // m))
        term = out.new_empty(1, rows, m)  # (1, rows, M) scratch
        for s in range(batch):
            for i in range(0, n, rows):
                block = out[s:s + 1, i:i + rows]  # (1, rows, M)
                square_distance_into(a[:, s:s + 1, i:i + rows], b[:, s:s + 1], block, term[:, :block.shape[1]])
        return out


def square_distance_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, term: torch.Tensor) -> None:
    """out (B, N, M) = (dx*dx + dy*dy) + dz*dz for coordinate planes a (3, B, N) and b (3, B, M); term: scratch
    of out's shape."""
    torch.sub(a[0, :, :, None], b[0, :, None, :], out=out)  # dx
    out.mul_(out)
    torch.sub(a[1, :, :, None], b[1, :, None, :], out=term)  # dy
    out.add_(term.mul_(term))
    torch.sub(a[2, :, :, None], b[2, :, None, :], out=term)  # dz
    out.add_(term.mul_(term))


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances (B, N, M): the square root of :func:`square_distance`."""
    return square_distance(a, b).sqrt_()


# Entries of a distance block that knn holds at once: 2**24 float32 = 64 MiB, whatever N is.
KNN_BLOCK_ELEMENTS = 1 << 24
# Above this many distances per sample (M * N), knn searches a grid of cells instead of every pair.
KNN_GRID_ABOVE = 1 << 24
# Devices on which code never asks the host about a tensor's values where an answer would only save work: knn's
# brute force picks the k smallest without asking about ties (:func:`smallest_without_sync`), PCT's NormActMax
# reduces twice where it could learn that once is enough (tasks/nets/pct.py). A GPU would wait for each question;
# the CPU answers it for free (:func:`smallest` is about 3 times faster there than building the int64 keys).
SYNC_FREE_DEVICES = ("cuda",)


def knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, M, k) of the k nearest ``points`` (B, N, 3) of each ``query`` (B, M, 3).

    Nearest first, ties to the lower index: the neighbours are the first k of the points sorted by
    (:func:`square_distance`, index), whatever the device, the block size or the search. Peak memory is
    O(B M k) plus one block of at most ``KNN_BLOCK_ELEMENTS`` distances (or one row of N per sample if
    larger), never the M x N matrix. Up to ``KNN_GRID_ABOVE`` distances a sample every pair is compared
    (:func:`knn_blocks`); above, a grid of cells prunes the pairs (:func:`knn_grid`), in time about
    O(M k) for evenly spread points. On CUDA, float32 (and half) points go to one Triton kernel
    (:mod:`attention.knn_triton`: the same indices, O(B M k) memory, no distance matrix in memory at all); float64,
    or k above the kernel's limit, take the torch search, which runs there as it is.

    Under ``torch.compile`` it is one op of the graph (``attention_suite::knn``), as :func:`farthest_point_sample`:
    dynamo would hand the Triton kernel's launch to inductor, which need not keep enable_fp_fusion=False (the
    distances' exact rounding, so the indices), and the torch search's tie handling branches on tensor values.
    """
    n = points.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"knn: cannot take {k} neighbours among {n} points.")
    if skips_dispatch(query, points):  # the op's kernel, without its dispatch
        with below_autograd():
            return _knn(query, points, k)  # (B, M, k)
    return torch.ops.attention_suite.knn(query, points, k)  # (B, M, k)


@torch.no_grad()
def _knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """The op's kernel (k checked by :func:`knn`)."""
    m, n = query.shape[1], points.shape[1]
    if (query.is_cuda and query.dtype in KNN_TRITON_DTYPES and points.dtype in KNN_TRITON_DTYPES
            and KNN_KERNELS.wanted((query, points))):
        idx = KNN_KERNELS.call("knn_if_supported", query, points, k)  # (B, M, k); None: k too large, or it failed
        if idx is not None:
            return idx.contiguous()
    if m * n <= KNN_GRID_ABOVE:
        return knn_blocks(query, points, k).contiguous()
    return torch.stack([knn_grid(q, p, k) for q, p in zip(query, points)])  # (B, M, k)


# The two as torch.library ops: leaves of torch.compile's graph, with fake kernels for their shapes (define + impl, as
# attention/functional.py's ops, and why not custom_op: there). Indices carry no gradient.
_LIB = torch.library.Library("attention_suite", "FRAGMENT")
_LIB.define("farthest_point_sample(Tensor xyz, SymInt m, Tensor? start, SymInt start_index, bool like_kernel, "
            "str backend) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("farthest_point_sample", _farthest_point_sample, "CompositeExplicitAutograd")
_LIB.define("knn(Tensor query, Tensor points, SymInt k) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("knn", _knn, "CompositeExplicitAutograd")


@torch.library.register_fake("attention_suite::farthest_point_sample", lib=_LIB)
def _farthest_point_sample_fake(xyz, m, start, start_index, like_kernel, backend):
    return xyz.new_empty(xyz.shape[0], m, dtype=torch.long)  # (B, m)


@torch.library.register_fake("attention_suite::knn", lib=_LIB)
def _knn_fake(query, points, k):
    return query.new_empty(query.shape[0], query.shape[1], k, dtype=torch.long)  # (B, M, k)


# Dtypes knn's Triton kernel takes: float32 and half (upcast exactly to float32, as square_distance does).
KNN_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The Triton kernel's family (attention.triton_kernels: imported when wanted, off for the process once it failed).
KNN_KERNELS = Kernels("attention.knn_triton", "knn", "the torch search")


def knn_blocks(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`knn` by brute force: every query against every point, queries in blocks of rows."""
    b, m, _ = query.shape
    rows = max(1, KNN_BLOCK_ELEMENTS // (b * points.shape[1]))
    pick = smallest_without_sync if query.device.type in SYNC_FREE_DEVICES else smallest
    if rows >= m:
        return pick(square_distance(query, points), k)
    out = torch.empty(b, m, k, dtype=torch.long, device=query.device)
    for i in range(0, m, rows):
        out[:, i:i + rows] = pick(square_distance(query[:, i:i + rows], points), k)  # (B, rows, k)
    return out


def knn_grid(query: torch.Tensor, points: torch.Tensor, k: int, cell: float | None = None) -> torch.Tensor:
    """:func:`knn` of one sample, query (M, 3) and points (N, 3) -> (M, k), through a grid of cubic cells.

    The cells (side ``cell``; by default about 0.3 k points each) are grouped in blocks of 2 x 2 x 2; the
    queries of a block are compared, with :func:`square_distance` and :func:`smallest` as the brute force,
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
    eps = torch.finfo(square_distance(query[None, :1], points[None, :1]).dtype).eps
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
            d = square_distance(q[None, i:i + step], points[None, candidates])[0]  # (rows, P)
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
        retry[rows] = ~(kth * (1 + 16 * eps) < margin * margin)  # squared distances, squared margin
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


def smallest_without_sync(d: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`smallest`, the same indices, with no host synchronisation: what :func:`knn_blocks` runs on CUDA.

    :func:`smallest` asks the host whether any row has ties (``if tied.any()``), two waits for the GPU a call,
    four a PCT training step. Here the rule is built into the key instead: a float32 distance d >= 0 has an
    int32 bit pattern that orders as d does, so ``bits << 32 | index`` (int64) orders as (d, index) and is
    unique, and ``topk`` of it is the answer, ties included. Other dtypes (float64) sort each row stably.
    """
    n = d.shape[-1]
    if d.dtype != torch.float32:
        return d.sort(dim=-1, stable=True).indices[..., :k]
    key = d.view(torch.int32).to(torch.int64).bitwise_left_shift_(32)  # (..., N)
    key.bitwise_or_(torch.arange(n, device=d.device))
    return key.topk(k, dim=-1, largest=False, sorted=True).values.bitwise_and_(0xFFFFFFFF)


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, C) gathered at idx (B, *S) -> (B, *S, C)."""
    b = x.shape[0]
    flat = idx.reshape(b, -1)  # (B, S)
    out = torch.gather(x, 1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, S, C)
    return out.reshape(*idx.shape, x.shape[-1])
