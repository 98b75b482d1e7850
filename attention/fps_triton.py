"""Farthest point sampling as one Triton kernel: one program per sample loops over the m steps itself.

:func:`attention.pointops.fps_loop` launches about 7 torch ops a step, so a GPU spends PCT's 512 + 256 steps
a forward waiting on launches (each step is a few microseconds of work over 1024 points). Here one launch does
every step of every sample: program b keeps sample b's running distances in registers (N up to
``MAX_ONE_BLOCK``) or sweeps them in chunks of ``CHUNK`` through a scratch row in global memory (larger N), and
picks the next point with an argmax whose ties go to the lowest position, as ``torch.argmax`` does.

The arithmetic is the torch loop's, operation for operation, so that the indices are the same, ties included:
``dx = x - cx`` (each coordinate), ``d = (dx*dx + dy*dy) + dz*dz`` with every product and sum rounded on its own
(the kernel is compiled with ``enable_fp_fusion=False``: a fused multiply-add would round once where torch
rounds twice), ``dist = min(dist, d)``. For ``like_kernel`` (``FUSED``, float32) it is pointnet2_ops' as nvcc
builds it: ``d = fma(dz, dz, fma(dx, dx, dy*dy))``, written with ``tl.fma`` (``fma.rn.f32`` in the PTX, whatever
the compiler would contract), which the torch loop computes exactly with :func:`attention.pointops.fma32`.
pointnet2_ops' tie order is an order of the points (``kernel_order``) in which it is argmax's first maximum: the
kernel samples the points in that order (``PERMUTED``: its prologue gathers them into its coordinate planes) and
maps its picks back to indices at its end. Its skipped points (``SKIP``) are the
kernel's own test, made here: the initial distance of a point is 1e10, or -1 where its squared norm
``mag = fma(z, z, fma(x, x, y*y))`` is at most 1e-3 in double precision, that is below ``MIN_MAG``, the float32
value just above 1e-3. (Made in torch on the host, that test was about 80 small ops: the fused multiply-adds
emulated exactly by :func:`attention.pointops.fma32`, each op a launch on a GPU; an H200 took 0.9 ms for FPS at
PCT's sizes whatever the size, against 0.25-0.5 ms for pointnet2_ops.)

This module imports Triton at its top; :mod:`attention.pointops` imports it only when the kernel is wanted.
The tests run the kernel on CPU tensors under ``TRITON_INTERPRET=1`` (tests/attention/test_fps_triton.py; the
interpreter's ``tl.fma`` rounds twice, so they give it a once-rounded one), compile it for sm_90 and read its PTX,
and, marked ``cuda``, run it on a GPU.
Points with NaN coordinates are not supported: ``torch.argmax`` takes a NaN as the maximum, the kernel does not.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .triton_kernels import pow2

# Up to this many points a sample (half as many in float64), its coordinates and distances stay in registers for
# all m steps: at 8 to 16 points a thread, compiled for sm_90, about 106 registers and no spills (float64 spills
# at 8192).
MAX_ONE_BLOCK = 8192
# Above, each step sweeps the points in chunks of this many, its distances kept in a (B, N) scratch tensor.
CHUNK = 4096
# Warps a program runs with; None: ``warps_for``'s rule. Every step ends in an argmax over the program's lanes, a
# chain of dependent steps (argmax, load the new centre, distances, argmax), so fewer warps reduce with fewer
# shared-memory round trips and barriers, more warps hold fewer points a thread. benchmarks/pct_cuda.py times the
# kernel with 1 to 16 warps beside pointnet2_ops; the rule is what two H200 leases measured (pct-cuda-b16.md,
# pct-cuda-compiled.md): 4 warps at 2,048 points (0.51 ms against 0.58-0.60 with the 8 of the rule before), 8 at
# 8,192 (1.62-1.79 against 1.70-1.84 with 16) and in chunks at 65,536 (98 against 105 ms), 2 at 1,024 (3% faster
# than 4 in both); at 512, 1 warp took 0.21 ms against 0.26 with 4 in one lease and 0.27 against 0.26 in the
# other.
WARPS: int | None = None
# Whether a step's argmax carries the picked point's coordinates with it (one reduction over (distance, index, x,
# y, z), points held in registers only), instead of reading them from the planes after it: that read is a
# dependent load on the chain of every step (argmax, load, distances, argmax), and at 512 points, where the kernel
# took the same 0.26-0.28 ms at every warp count, that chain is its time (pointnet2_ops: 0.27 ms). The same picks.
# Off until a GPU has timed it (``benchmarks.pct_cuda``'s FPS rows time both).
CARRY = False


def warps_for(block: int) -> int:
    """Warps for a program sweeping ``block`` lanes: 16 points a thread, 1 to 8 warps (32 points a thread at 8,192
    in registers: 200 registers, no spills, compiled for sm_90), unless ``WARPS``."""
    return WARPS or min(8, max(1, block // 512))


@triton.jit
def _squared_distance(dx, dy, dz, FUSED: tl.constexpr):
    """(dx*dx + dy*dy) + dz*dz, every operation rounded (the kernel is compiled without FMA contraction); with
    ``FUSED``, pointnet2_ops' ``fma(dz, dz, fma(dx, dx, dy*dy))``, the fused multiply-adds nvcc makes of it."""
    if FUSED:
        return tl.fma(dz, dz, tl.fma(dx, dx, dy * dy))
    else:
        return dx * dx + dy * dy + dz * dz


@triton.jit
def _initial_distance(x, y, z, MIN_MAG: tl.constexpr):
    """pointnet2_ops' start: 1e10, or -1 for a point whose squared norm (its fused multiply-adds) is below
    ``MIN_MAG``: a point it never picks nor updates."""
    mag = tl.fma(z, z, tl.fma(x, x, y * y))
    return tl.where(mag >= MIN_MAG, 1e10, -1.0)


@triton.jit
def _first_max(d1, i1, x1, y1, z1, d2, i2, x2, y2, z2):
    """``tl.argmax(..., tie_break_left=True)``'s combine (the larger distance, on a tie the lower index; NaN as it
    does) carrying the point's coordinates along."""
    take = (d1 > d2) | ((d1 == d2) & (i1 < i2))
    return (tl.where(take, d1, d2), tl.where(take, i1, i2), tl.where(take, x1, x2), tl.where(take, y1, y2),
            tl.where(take, z1, z2))


@triton.jit
def _fps_kernel(xyz_ptr, order_ptr, planes_ptr, dist_ptr, start_ptr, out_ptr, n, m, start_index, stride_b, stride_n,
                stride_c, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, FUSED: tl.constexpr, SKIP: tl.constexpr,
                MIN_MAG: tl.constexpr, GIVEN: tl.constexpr, PERMUTED: tl.constexpr, CARRY: tl.constexpr):
    """Program b: out[b, :m] from xyz (B, N, 3) of any strides, dist (B, N) (initial distances, unless ``SKIP``
    makes them here; with ``ONE_BLOCK`` False also the scratch row, overwritten) and the first pick, start[b]
    (``GIVEN``) or ``start_index``. ``PERMUTED``: the kernel samples the points in the order ``order`` (N,) int64
    (dist in that order too; the first pick a position in it) and writes the picks back as indices of xyz.

    It first copies the sample's points (in that order) into its coordinate planes, a (B, 3, N) scratch tensor
    whose rows every step's centre is read from (with ``CARRY`` and ``ONE_BLOCK`` only the first: each argmax then
    carries the next centre's coordinates): one launch where the torch ops around it took three (the permuting
    gather and the planes' copy before, the indices mapped back after).

    The loops are ``while`` loops: Triton 3.6's interpreter cannot take a runtime scalar as a ``range`` bound
    (its scalars are 1-element arrays, which NumPy 2.4 no longer converts to an int). Compiled for sm_90, they
    give the PTX the ``range`` loops gave, line for line."""
    b = tl.program_id(0).to(tl.int64)
    x_ptr = planes_ptr + b * 3 * n  # the sample's x (N,), then y, then z
    y_ptr = x_ptr + n
    z_ptr = y_ptr + n
    dist_row = dist_ptr + b * n
    out_row = out_ptr + b * m
    if GIVEN:
        far = tl.load(start_ptr + b)  # int64 scalar
    else:
        far = b * 0 + start_index  # int64 scalar (start_index may come specialised as a constant)
    offs = tl.arange(0, BLOCK)  # (BLOCK,)
    # the planes, and with SKIP in chunks the scratch row's initial distances: one sweep
    src_row = xyz_ptr + b * stride_b
    lo = 0
    while lo < n:
        at = lo + offs  # (BLOCK,)
        mask = at < n
        if PERMUTED:
            src = tl.load(order_ptr + at, mask=mask, other=0)  # (BLOCK,) int64: the points at these positions
        else:
            src = at
        x = tl.load(src_row + src * stride_n, mask=mask, other=0.0)
        y = tl.load(src_row + src * stride_n + stride_c, mask=mask, other=0.0)
        z = tl.load(src_row + src * stride_n + 2 * stride_c, mask=mask, other=0.0)
        tl.store(x_ptr + at, x, mask=mask)
        tl.store(y_ptr + at, y, mask=mask)
        tl.store(z_ptr + at, z, mask=mask)
        if SKIP and not ONE_BLOCK:
            tl.store(dist_row + at, _initial_distance(x, y, z, MIN_MAG), mask=mask)
        lo += BLOCK
    tl.debug_barrier()  # every thread's planes written before any step reads a centre from them
    i = 0
    if ONE_BLOCK:
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)  # (BLOCK,)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0)
        if SKIP:
            dist = tl.where(mask, _initial_distance(x, y, z, MIN_MAG), float("-inf"))  # lanes past N: never picked
        else:
            dist = tl.load(dist_row + offs, mask=mask, other=float("-inf"))  # lanes past N: never the maximum
        if CARRY:  # the first centre; each argmax then gives the next
            cx = tl.load(x_ptr + far)
            cy = tl.load(y_ptr + far)
            cz = tl.load(z_ptr + far)
        while i < m - 1:
            tl.store(out_row + i, far)
            if not CARRY:
                cx = tl.load(x_ptr + far)
                cy = tl.load(y_ptr + far)
                cz = tl.load(z_ptr + far)
            dist = tl.minimum(dist, _squared_distance(x - cx, y - cy, z - cz, FUSED))  # -inf and -1 stay
            if CARRY:  # the first maximum and its coordinates, in one reduction
                _, at, cx, cy, cz = tl.reduce((dist, offs, x, y, z), 0, _first_max)
                far = at.to(tl.int64)
            else:
                far = tl.argmax(dist, 0, tie_break_left=True).to(tl.int64)  # the first maximum
            i += 1
    else:
        while i < m - 1:
            tl.store(out_row + i, far)
            cx = tl.load(x_ptr + far)
            cy = tl.load(y_ptr + far)
            cz = tl.load(z_ptr + far)
            # per lane, the first maximum over the chunks (they go by increasing index, so only a strictly
            # larger value moves it); one reduction a step, after the sweep, not one a chunk
            best = tl.full((BLOCK,), float("-inf"), dist_ptr.dtype.element_ty)  # (BLOCK,)
            best_at = tl.zeros((BLOCK,), tl.int32)  # (BLOCK,)
            lo = 0
            while lo < n:
                at = lo + offs  # (BLOCK,)
                mask = at < n
                dx = tl.load(x_ptr + at, mask=mask, other=0.0) - cx
                dy = tl.load(y_ptr + at, mask=mask, other=0.0) - cy
                dz = tl.load(z_ptr + at, mask=mask, other=0.0) - cz
                dist = tl.load(dist_row + at, mask=mask, other=float("-inf"))
                dist = tl.minimum(dist, _squared_distance(dx, dy, dz, FUSED))
                tl.store(dist_row + at, dist, mask=mask)
                better = dist > best
                best_at = tl.where(better, at, best_at)
                best = tl.where(better, dist, best)
                lo += BLOCK
            # lanes hold indices out of lane order: the lowest index among the lanes at the maximum
            top = tl.max(best, 0)
            far = tl.min(tl.where(best == top, best_at, n), 0).to(tl.int64)
            # each thread reads back what it stored, but make the next step's reads of dist_row safe anyway
            tl.debug_barrier()
            i += 1
    tl.store(out_row + m - 1, far)  # the last pick: no distances to update after it
    if PERMUTED:  # positions -> the points' indices, each lane its own entries
        tl.debug_barrier()
        lo = 0
        while lo < m:
            at = lo + offs  # (BLOCK,)
            mask = at < m
            pos = tl.load(out_row + at, mask=mask, other=0)
            tl.store(out_row + at, tl.load(order_ptr + pos, mask=mask, other=0), mask=mask)
            lo += BLOCK


def farthest_point_sample(xyz: torch.Tensor, m: int, start: torch.Tensor | int, dist: torch.Tensor | None,
                          fused: bool = False, min_mag: float | None = None,
                          order: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (B, m) for xyz (B, N, 3) float32/float64 (any strides), start (B,) int64 or one int for every
    sample, dist (B, N) initial distances.

    What :func:`attention.pointops.fps_loop` returns for the same arguments (``fused``: float32 only, the
    distances as pointnet2_ops' fused multiply-adds); start must hold indices in [0, N) (unchecked: checking
    would wait for the GPU). The inputs are left as they are. ``min_mag`` (with ``fused``; ``dist`` None): the
    kernel makes the initial distances itself, 1e10, or -1 where a point's fused squared norm is below it
    (float32). ``order`` (N,) int64, a permutation: the result of ``order[fps_loop(xyz[:, order], ...)]``, start
    and dist then in that order (``like_kernel``'s tie order, :func:`attention.pointops.kernel_order`).
    """
    b, n, _ = xyz.shape
    if xyz.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fps_triton: float32 or float64 points only, got {xyz.dtype} (the torch loop takes it).")
    if fused and xyz.dtype != torch.float32:
        raise ValueError(f"fps_triton: fused distances are float32 only, got {xyz.dtype}.")
    skip = min_mag is not None
    if skip and not fused:
        raise ValueError("fps_triton: min_mag (the kernel's own initial distances) needs fused float32 distances.")
    if skip == (dist is not None):
        raise ValueError("fps_triton: give either the initial distances (dist) or min_mag, not both or neither.")
    planes = torch.empty(b, 3, n, dtype=xyz.dtype, device=xyz.device)  # (B, 3, N): the kernel fills it
    one_block = n <= MAX_ONE_BLOCK * 4 // xyz.element_size()
    if skip:  # made by the kernel: no row to read with one block, a scratch row with chunks
        dist = planes if one_block else torch.empty(b, n, dtype=xyz.dtype, device=xyz.device)  # (B, N)
    else:  # one block: the kernel only reads dist; chunks: it writes its running distances there, so a copy
        dist = dist.to(xyz.dtype).contiguous() if one_block else dist.to(xyz.dtype, copy=True).contiguous()
    given = isinstance(start, torch.Tensor)
    if given:
        start = start.to(device=xyz.device, dtype=torch.long).contiguous()  # (B,)
    permuted = order is not None
    if permuted:
        order = order.to(device=xyz.device, dtype=torch.long).contiguous()  # (N,)
    out = torch.empty(b, m, dtype=torch.long, device=xyz.device)
    block = pow2(n) if one_block else CHUNK
    warps = warps_for(block)
    # Triton launches on the current CUDA device: make it the points' one
    with torch.cuda.device(xyz.device) if xyz.is_cuda else contextlib.nullcontext():
        _fps_kernel[(b,)](xyz, order if permuted else out, planes, dist, start if given else out, out, n, m,
                          0 if given else int(start), *xyz.stride(), BLOCK=block, ONE_BLOCK=one_block,
                          FUSED=fused, SKIP=skip, MIN_MAG=min_mag if skip else 0.0, GIVEN=given,
                          PERMUTED=permuted, CARRY=CARRY and one_block, num_warps=warps, enable_fp_fusion=False)
    return out
