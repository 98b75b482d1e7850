"""Dilated (DilateFormer) attention on a grid as three fused Triton kernels: one launch forward, two backward.

:func:`attention.functional.dilated_attention`'s torch kernel runs each of the k*k window offsets as its own
``mul`` + ``sum`` (and ``mul``/``addcmul_``) over shifted views, about 35 launches forward and 60 backward for a
3 x 3 window: on a GPU the op then costs its launches, whatever the grid's size (issue 28 §4). Here each pass is one
launch. Program i takes ``BQ`` consecutive tokens (row-major positions of the h x w grid) of one (sample, head):

- :func:`_forward_kernel`: per query, the k*k logits ``q . k_(y + p r, x + q r) * scale`` go into a (BQ, KK) tile in
  registers (KK = k*k rounded up to a power of two; padding columns are -inf), a key outside the grid being a zero
  vector with logit 0 (border "zeros") or -inf (border "mask"); softmax over the tile; the weights are stored as the
  attention map (B, H, k*k, h, w), offset o = (p + k//2) * k + (q + k//2), the layout the torch kernel returns
  (and its backward reads); then ``out = sum_o weight_o v_(key o)`` (a zero value outside the grid adds nothing).
- :func:`_backward_query_kernel`: per query, ``dattn_o = g . v_(key o)`` into a tile, ``D = sum_o attn_o dattn_o``,
  ``dlogits_o = attn_o (dattn_o - D) scale`` stored in a (B, H, k*k, N) buffer, ``dq = sum_o dlogits_o k_(key o)``.
- :func:`_backward_key_kernel`: per *key* (y, x), the query that reaches it through offset o sits at
  (y - p r, x - q r), the same window mirrored: ``dk = sum_o dlogits[query, o] q_query`` and
  ``dv = sum_o attn[query, o] g_query`` over those queries inside the grid.

Every sum runs in a fixed order in one program: no atomics, so gradients are bit-reproducible run to run (the
trainer's ``deterministic=true``). Everything is float32 (:func:`attention.functional.float32_kernel` has upcast half
precision before the op); ``enable_fp_fusion`` stays on (a multiply-add rounded once is at least as exact as one
rounded twice, and the tests measure against float64 with a tolerance, not bit for bit against the torch kernel).
The head dims d and d_v are padded to powers of two (DP, DVP) with masked loads; where every row of q, k, v, the
gradient and the outputs starts on 16 bytes and d, d_v are multiples of 4 (the module's layouts), the kernels know
it (``ALIGN``, :func:`alignment`) and load and store 16 bytes at a time. The window's offsets are a
``tl.static_range`` over the constexpr k*k (unrolled when compiled; plain Python ints in the interpreter, which
takes no runtime scalar as a ``range`` bound under Triton 3.6: no loop here has a runtime bound).

q, k, v and the upstream gradient are read through their strides (the module hands over head-group slices of
one qkv tensor, and autograd may hand a stride-0 gradient): nothing is copied, as the torch kernel promises. The
attention map the backward reads is the forward's own, contiguous output; another layout is copied once. Memory:
what the kernels return (output and map; dq, dk, dv, all contiguous) plus, in the backward, the dlogits buffer of
the map's size. Token indices are int64 in the address arithmetic; a dilation at least max(h, w) is passed as
max(h, w) (the same windows: every offset but the centre lies outside), so no index overflows int32. Each program
reads its head's rate from a (heads,) table (:func:`rate_table`): DilateFormer's head groups, one rate each, take
one launch together, where a launch per group paid each launch's fixed cost (on an H200, a mixer's forward and
backward took 4 ms at any size up to 4,096 tokens with 4 groups).

This module imports Triton at its top; :mod:`attention.functional` imports it only when the kernel is wanted
(``DILATED_KERNELS``, :mod:`attention.triton_kernels`). tests/attention/test_dilated_triton.py runs the kernels on
CPU tensors under ``TRITON_INTERPRET=1`` against the torch kernel, compiles them for sm_90 as they are launched,
and, marked ``cuda``, runs them on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from attention.functional import _dilated_groups
from attention.tensor_cache import tensor_cache
from attention.triton_kernels import cdiv, pow2

# Programs a launch aims for (about two per SM of an H100, 132 SMs): the block of queries shrinks, down to
# ``MIN_BLOCK``, until the launch has this many, so that a small grid (one 56 x 56 head) still spreads over the GPU.
TARGET_PROGRAMS = 264
MIN_BLOCK = 16
MAX_BLOCK = 64
# Largest (BQ, DP) tile, in elements, a program holds: 1024 float32 over 4 warps is 8 registers a tile, and with
# the 3 x 3 window's loads unrolled, compiled for sm_90 at d = 24 or 32 (BQ = 32), the kernels take 87 to 110
# registers and spill nothing (at 2048, BQ = 64, the key kernel took 255 and spilled). Wider heads take fewer
# queries a program; above 1024 / MIN_BLOCK = 64 channels, more warps (:func:`launch_config`).
MAX_TILE = 1024
NUM_WARPS = 4


@triton.jit
def _key_at(y, x, valid, o, h, w, dilation, KS: tl.constexpr, SIGN: tl.constexpr):
    """The token (int64) at window offset o from (y, x) (SIGN 1: the key a query sees; -1: the query that sees a
    key), and whether it lies inside the h x w grid (and the row is a real token)."""
    ty = y + SIGN * (o // KS - KS // 2) * dilation
    tx = x + SIGN * (o % KS - KS // 2) * dilation
    inside = valid & (ty >= 0) & (ty < h) & (tx >= 0) & (tx < w)
    return (ty * w + tx).to(tl.int64), inside


@triton.jit
def _column(tile, cols, o):
    """Column o of a (BQ, KK) tile, as (BQ,)."""
    return tl.sum(tl.where(cols[None, :] == o, tile, 0.0), axis=1)


@triton.jit
def _tokens(blocks, heads, h, w, BQ: tl.constexpr):
    """This program's (sample, head) and block of BQ tokens: the programs are (bh, block) flattened, the blocks of
    one bh = sample * heads + head consecutive. Returns bh, sample and head (int64), the tokens rn (BQ,) in row-major
    order, which of them lie on the grid, and their rows y and columns x."""
    pid = tl.program_id(0)
    bh = pid // blocks
    rn = (pid % blocks) * BQ + tl.arange(0, BQ)  # (BQ,) tokens
    return bh.to(tl.int64), (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), rn, rn < h * w, rn // w, rn % w


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, attn_ptr,
                    q_sb, q_sh, q_sn, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
                    heads, h, w, d, d_v, rate_ptr, scale, blocks,
                    KS: tl.constexpr, KK: tl.constexpr, MASK: tl.constexpr,
                    BQ: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, ALIGN: tl.constexpr):
    """Program (bh, block) (flattened, the blocks of one (sample, head) consecutive): out (B, H, N, d_v) and attn
    (B, H, k*k, N) for queries block*BQ ... + BQ of q (B, H, N, d), k (B, H, N, d), v (B, H, N, d_v) (strided).
    The strides but the last, d and d_v come divided by ALIGN (:func:`alignment`)."""
    q_sb, q_sh, q_sn = q_sb * ALIGN, q_sh * ALIGN, q_sn * ALIGN
    k_sb, k_sh, k_sn = k_sb * ALIGN, k_sh * ALIGN, k_sn * ALIGN
    v_sb, v_sh, v_sn = v_sb * ALIGN, v_sh * ALIGN, v_sn * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    bhl, b, hd, rn, valid, y, x = _tokens(blocks, heads, h, w, BQ)  # rn: (BQ,) query tokens
    dilation = tl.load(rate_ptr + hd)  # this head's rate: its group's
    n = h * w
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    cols = tl.arange(0, KK)
    md = (cd < d)[None, :]  # (1, DP)
    q_base = q_ptr + b * q_sb + hd * q_sh
    k_base = k_ptr + b * k_sb + hd * k_sh
    v_base = v_ptr + b * v_sb + hd * v_sh
    qt = tl.load(q_base + rn.to(tl.int64)[:, None] * q_sn + cd[None, :] * q_sd, mask=valid[:, None] & md,
                 other=0.0)  # (BQ, DP)
    logits = tl.full((BQ, KK), float("-inf"), tl.float32)  # padding columns stay -inf
    for o in tl.static_range(KS * KS):
        key, inside = _key_at(y, x, valid, o, h, w, dilation, KS, 1)
        kt = tl.load(k_base + key[:, None] * k_sn + cd[None, :] * k_sd, mask=inside[:, None] & md,
                     other=0.0)  # (BQ, DP): a zero key outside the grid
        s = tl.sum(qt * kt, axis=1) * scale  # (BQ,)
        if MASK:  # outside the grid: out of the softmax (rows past the grid keep 0: no NaN)
            s = tl.where(inside | (rn >= n), s, float("-inf"))
        logits = tl.where(cols[None, :] == o, s[:, None], logits)
    top = tl.max(logits, axis=1)  # (BQ,): finite, the centre is always a candidate
    e = tl.exp(logits - top[:, None])
    attn = e / tl.sum(e, axis=1)[:, None]  # (BQ, KK)
    tl.store(attn_ptr + (bhl * (KS * KS) + cols[None, :]) * n + rn[:, None], attn,
             mask=valid[:, None] & (cols[None, :] < KS * KS))
    acc = tl.zeros((BQ, DVP), tl.float32)
    mv = (cv < d_v)[None, :]  # (1, DVP)
    for o in tl.static_range(KS * KS):
        key, inside = _key_at(y, x, valid, o, h, w, dilation, KS, 1)
        vt = tl.load(v_base + key[:, None] * v_sn + cv[None, :] * v_sd, mask=inside[:, None] & mv,
                     other=0.0)  # (BQ, DVP): a zero value outside the grid
        acc += _column(attn, cols, o)[:, None] * vt
    tl.store(out_ptr + (bhl * n + rn[:, None]) * d_v + cv[None, :], acc, mask=valid[:, None] & mv)


@triton.jit
def _backward_query_kernel(g_ptr, k_ptr, v_ptr, attn_ptr, dlogits_ptr, dq_ptr,
                           g_sb, g_sh, g_sn, g_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
                           heads, h, w, d, d_v, rate_ptr, scale, blocks,
                           KS: tl.constexpr, KK: tl.constexpr,
                           BQ: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, ALIGN: tl.constexpr):
    """Program (bh, block): dlogits (B, H, k*k, N) and dq (B, H, N, d) of queries block*BQ ... + BQ, from the
    upstream gradient g (B, H, N, d_v), k, v (strided) and the forward's attention map attn (B, H, k*k, N)."""
    g_sb, g_sh, g_sn = g_sb * ALIGN, g_sh * ALIGN, g_sn * ALIGN
    k_sb, k_sh, k_sn = k_sb * ALIGN, k_sh * ALIGN, k_sn * ALIGN
    v_sb, v_sh, v_sn = v_sb * ALIGN, v_sh * ALIGN, v_sn * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    bhl, b, hd, rn, valid, y, x = _tokens(blocks, heads, h, w, BQ)  # rn: (BQ,) query tokens
    dilation = tl.load(rate_ptr + hd)  # this head's rate: its group's
    n = h * w
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    cols = tl.arange(0, KK)
    md = (cd < d)[None, :]
    mv = (cv < d_v)[None, :]
    g_base = g_ptr + b * g_sb + hd * g_sh
    k_base = k_ptr + b * k_sb + hd * k_sh
    v_base = v_ptr + b * v_sb + hd * v_sh
    map_at = (bhl * (KS * KS) + cols[None, :]) * n + rn[:, None]  # (BQ, KK) into attn and dlogits
    map_mask = valid[:, None] & (cols[None, :] < KS * KS)
    attn = tl.load(attn_ptr + map_at, mask=map_mask, other=0.0)  # (BQ, KK)
    gt = tl.load(g_base + rn.to(tl.int64)[:, None] * g_sn + cv[None, :] * g_sd, mask=valid[:, None] & mv,
                 other=0.0)  # (BQ, DVP)
    dattn = tl.zeros((BQ, KK), tl.float32)  # a zero value outside the grid: dattn 0
    for o in tl.static_range(KS * KS):
        key, inside = _key_at(y, x, valid, o, h, w, dilation, KS, 1)
        vt = tl.load(v_base + key[:, None] * v_sn + cv[None, :] * v_sd, mask=inside[:, None] & mv, other=0.0)
        dattn = tl.where(cols[None, :] == o, tl.sum(gt * vt, axis=1)[:, None], dattn)
    total = tl.sum(attn * dattn, axis=1)  # (BQ,): D = sum_o attn_o dattn_o (= g . out)
    dlogits = attn * (dattn - total[:, None]) * scale  # (BQ, KK): softmax's backward
    tl.store(dlogits_ptr + map_at, dlogits, mask=map_mask)
    acc = tl.zeros((BQ, DP), tl.float32)
    for o in tl.static_range(KS * KS):
        key, inside = _key_at(y, x, valid, o, h, w, dilation, KS, 1)
        kt = tl.load(k_base + key[:, None] * k_sn + cd[None, :] * k_sd, mask=inside[:, None] & md, other=0.0)
        acc += _column(dlogits, cols, o)[:, None] * kt
    tl.store(dq_ptr + (bhl * n + rn[:, None]) * d + cd[None, :], acc, mask=valid[:, None] & md)


@triton.jit
def _backward_key_kernel(q_ptr, g_ptr, attn_ptr, dlogits_ptr, dk_ptr, dv_ptr,
                         q_sb, q_sh, q_sn, q_sd, g_sb, g_sh, g_sn, g_sd,
                         heads, h, w, d, d_v, rate_ptr, blocks,
                         KS: tl.constexpr, BQ: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
                         ALIGN: tl.constexpr):
    """Program (bh, block): dk (B, H, N, d) and dv (B, H, N, d_v) of keys block*BQ ... + BQ, gathering from each
    offset o the query that sees the key through it (the window mirrored), its dlogits and attention weight."""
    q_sb, q_sh, q_sn = q_sb * ALIGN, q_sh * ALIGN, q_sn * ALIGN
    g_sb, g_sh, g_sn = g_sb * ALIGN, g_sh * ALIGN, g_sn * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    bhl, b, hd, rn, valid, y, x = _tokens(blocks, heads, h, w, BQ)  # rn: (BQ,) key tokens
    dilation = tl.load(rate_ptr + hd)  # this head's rate: its group's
    n = h * w
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    md = (cd < d)[None, :]
    mv = (cv < d_v)[None, :]
    q_base = q_ptr + b * q_sb + hd * q_sh
    g_base = g_ptr + b * g_sb + hd * g_sh
    dk = tl.zeros((BQ, DP), tl.float32)
    dv = tl.zeros((BQ, DVP), tl.float32)
    for o in tl.static_range(KS * KS):
        query, inside = _key_at(y, x, valid, o, h, w, dilation, KS, -1)
        map_at = (bhl * (KS * KS) + o) * n + query  # (BQ,) int64 into attn and dlogits
        dl = tl.load(dlogits_ptr + map_at, mask=inside, other=0.0)  # (BQ,)
        a = tl.load(attn_ptr + map_at, mask=inside, other=0.0)  # (BQ,)
        qt = tl.load(q_base + query[:, None] * q_sn + cd[None, :] * q_sd, mask=inside[:, None] & md, other=0.0)
        gt = tl.load(g_base + query[:, None] * g_sn + cv[None, :] * g_sd, mask=inside[:, None] & mv, other=0.0)
        dk += dl[:, None] * qt
        dv += a[:, None] * gt
    tl.store(dk_ptr + (bhl * n + rn[:, None]) * d + cd[None, :], dk, mask=valid[:, None] & md)
    tl.store(dv_ptr + (bhl * n + rn[:, None]) * d_v + cv[None, :], dv, mask=valid[:, None] & mv)


@functools.lru_cache(maxsize=256)
def launch_config(pairs: int, n: int, d: int, d_v: int, kernel_size: int) -> Mapping[str, int]:
    """The constexprs and warps of a launch over ``pairs`` (sample, head) pairs of n tokens: BQ queries a program
    (a power of two in [MIN_BLOCK, MAX_BLOCK], BQ * max(DP, DVP, KK) <= MAX_TILE where it can, halved while the
    launch has under TARGET_PROGRAMS programs), DP, DVP, KK, and 4 warps per MAX_TILE tile entries (more for heads
    wider than 64). Chosen from the compiled code's registers, not timed: no GPU was available. Kept per shape
    (read-only): a launch's host time is what a small step costs on a GPU."""
    dp, dvp, kk = (pow2(max(1, m)) for m in (d, d_v, kernel_size ** 2))
    widest = max(dp, dvp, kk)
    block = min(MAX_BLOCK, max(MIN_BLOCK, MAX_TILE // widest))
    while block > MIN_BLOCK and pairs * cdiv(n, block) < TARGET_PROGRAMS:
        block //= 2
    warps = min(16, NUM_WARPS * max(1, block * widest // MAX_TILE))  # 8 tile entries a thread up to 256 channels
    return MappingProxyType(dict(BQ=block, DP=dp, DVP=dvp, KK=kk, num_warps=warps))


def alignment(tensors, dims) -> int:
    """ALIGN: the largest of 4, 2, 1 elements that divides ``dims`` (d, d_v), every stride but the last of
    ``tensors`` (of dimensions longer than 1), and their data pointers (in float32 elements), the last strides being
    1. The kernels take those strides and dims divided by it and multiply them back by the constexpr: Triton then
    knows every row of d (d_v) floats starts on a multiple of 4 floats and its mask ``c < d`` is constant over 4
    lanes, and loads and stores 16 bytes at a time (ld.global.v4) instead of 4. At the module's layout (rows of
    the qkv projection, 3C floats apart) it is 4 for every C and head width divisible by 4."""
    align = math.gcd(4, *dims)
    for t in tensors:
        ptr, size = t.data_ptr(), t.element_size()
        align = math.gcd(align, _stride_alignment(t.shape, t.stride()), ptr // size if ptr % size == 0 else 1)
        if align == 1:
            return 1
    return align


@functools.lru_cache(maxsize=1024)
def _stride_alignment(shape: tuple, strides: tuple) -> int:
    """:func:`alignment`'s part that depends on a tensor's geometry only (kept: the same few layouts come back at
    every call): 1 where a stride reaches 2^31 (stride // align could pass as int32 and its product with ALIGN
    overflow: as they are, such strides pass and multiply as int64) or the last is not 1, else the gcd of 4 and the
    other strides of dimensions longer than 1."""
    if max(strides, default=0) >= 2 ** 31 or not strides or strides[-1] != 1:
        return 1
    return math.gcd(4, *(st for st, size in zip(strides[:-1], shape[:-1]) if size > 1))


def _strides(t: torch.Tensor, align: int) -> tuple:
    """The strides of t (B, H, N, .), all but the last divided by ``align`` (:func:`alignment`: exact, or of a
    dimension of one)."""
    sb, sh, sn, sd = t.stride()
    return sb // align, sh // align, sn // align, sd


def _check(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError(f"dilated_triton: float32 tensors only, got {[t.dtype for t in tensors]} "
                         "(the torch kernel takes float64; dilated_attention upcasts half precision).")


def _device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rate_table(heads: int, dilation, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(heads,) int32 on ``device``: each head's rate, ``dilation`` an int or one rate per equal head group
    (:func:`attention.functional._dilated_groups`), a rate at least max(h, w) passed as max(h, w) (the same windows:
    every offset but the centre lies outside), so that no index overflows int32. Made once per (rates, device) and
    kept (:func:`_rate_table`): a copy to the GPU at every call would wait for it."""
    return _rate_table(heads, dilation if isinstance(dilation, int) else tuple(dilation), max(h, w), device)


@tensor_cache(maxsize=64)
def _rate_table(heads: int, dilation, most: int, device: torch.device) -> torch.Tensor:
    per_head = [min(r, most) for group, r in _dilated_groups(heads, dilation) for _ in range(group.stop - group.start)]
    return torch.tensor(per_head, dtype=torch.int32).to(device)


def forward(q, k, v, h: int, w: int, kernel_size: int, dilation, mask: bool, scale: float):
    """What ``attention.functional._dilated_forward`` returns: the output (B, H, N, d_v) and the attention map
    (B, H, k*k, h, w), from float32 q, k (B, H, N, d) and v (B, H, N, d_v), any strides; ``dilation`` an int or
    one rate per equal head group (:func:`rate_table`): one launch whatever the groups."""
    _check(q, k, v)
    B, H, n, d = q.shape
    d_v = v.shape[-1]
    out = q.new_empty(B, H, n, d_v)
    attn = q.new_empty(B, H, kernel_size ** 2, h, w)
    if B * H * n == 0:
        return out, attn
    config = launch_config(B * H, n, d, d_v, kernel_size)
    blocks = cdiv(n, config["BQ"])
    align = alignment((q, k, v, out), (d, d_v))
    with _device(q):
        _forward_kernel[(B * H * blocks,)](
            q, k, v, out, attn, *_strides(q, align), *_strides(k, align), *_strides(v, align),
            H, h, w, d // align, d_v // align, rate_table(H, dilation, h, w, q.device), float(scale), blocks,
            KS=kernel_size, MASK=bool(mask), ALIGN=align, **config)
    return out, attn


def backward(grad, q, k, v, attn, h: int, w: int, kernel_size: int, dilation, scale: float):
    """What ``attention.functional._dilated_backward`` returns: dq, dk, dv (contiguous, of q's, k's, v's shapes)
    for the upstream gradient grad (B, H, N, d_v) and the forward's attention map attn (B, H, k*k, h, w), float32."""
    _check(grad, q, k, v, attn)
    B, H, n, d = q.shape
    d_v = v.shape[-1]
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if B * H * n == 0:
        return dq, dk, dv
    attn = attn.contiguous()  # the forward's map is: no copy
    dlogits = torch.empty_like(attn)  # (B, H, k*k, h, w)
    config = launch_config(B * H, n, d, d_v, kernel_size)
    blocks = cdiv(n, config["BQ"])
    align = alignment((grad, q, k, v, dq), (d, d_v))
    dims = (H, h, w, d // align, d_v // align, rate_table(H, dilation, h, w, q.device))
    with _device(q):
        _backward_query_kernel[(B * H * blocks,)](
            grad, k, v, attn, dlogits, dq, *_strides(grad, align), *_strides(k, align), *_strides(v, align),
            *dims, float(scale), blocks, KS=kernel_size, ALIGN=align, **config)
        _backward_key_kernel[(B * H * blocks,)](
            q, grad, attn, dlogits, dk, dv, *_strides(q, align), *_strides(grad, align),
            *dims, blocks, KS=kernel_size, ALIGN=align, **{k: v for k, v in config.items() if k != "KK"})
    return dq, dk, dv
