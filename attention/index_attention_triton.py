"""Attention over indexed keys as fused Triton kernels: one launch forward, two backward, no atomics.

What it computes. Queries q (R, C), keys k (T, C) and values v (T, C_v), and an index table (R, M) of rows of k
and v: per head h of d = C / heads channels (d_v = C_v / heads of v),
``out[r, h] = sum_j softmax_j(q[r, h] . k[index[r, j], h] * scale) v[index[r, j], h]`` over the M slots of row r.
A key named twice in a row takes part twice (its weight counted once per slot), exactly as gathering
k[index] and v[index] and calling softmax attention does (the op's torch kernel,
``attention.functional._index_forward_torch``, which has no masked slot or sentinel row either: every slot is a real
key). Two variants on point sets are this operation:
``focal`` (index: each point's fine neighbours, then its nearest pooled tokens; R = N queries over T = N + pooled
tokens) and ``dilated`` (each point's K dilated nearest neighbours, one table per head group at its rate; the batch
flattened, the rows of sample b at b N + j). G tables (G, R, M) serve G equal groups of consecutive heads in one
call, table g for group g: dilated's groups take one launch forward and two backward together, where a call per
group paid each launch, and the inverse index's dozen small torch ops, once a group.

Why. Their torch paths gathered (rows, M, C) keys and values chunk by chunk (focal: ``index_select``, small
``bmm``, ``index_add_`` backward; the op's torch kernel now) or whole (dilated, then: ``pointops.gather`` to
(B, h, N, K, d), einsum, softmax, einsum): on an H100 at N = 65,536, C = 256, forward + backward took 1.26 s
(dilated) and 1.95 s (focal), 2 % and 5 % of the machine's memory bound (issue 28 §4). Here nothing of size
R x M x C is ever written.

Design. Programs are (block of rows, head), heads fastest, so the programs of one block of rows run together and
share the index and the keys' rows through L2.

- :func:`_forward_kernel`: a program holds its BR queries (BR, DP) and walks the M slots BM at a time: the index
  tile (BR, BM), the gathered keys (BR, BM, DP), the logits, an online softmax (running maximum and sum, the
  accumulator rescaled, as in FlashAttention), the gathered values (BR, BM, DVP). It writes the output and the
  log-sum-exp lse (R, heads) float32 of the scaled logits, which is all the backward needs of the softmax.
- :func:`_backward_query_kernel`: per row, D = rowsum(dO o O) (the softmax's correction term), then over the slots
  again p = exp(s - lse), dp = dO . v, ds = p (dp - D), ``dq = scale sum_j ds_j k_j``. It writes dq and D.
- :func:`_backward_key_kernel`: dk and dv are sums over the edges INTO a key, so the index is inverted once in
  torch (:func:`inverse_index`): a STABLE sort of the flattened index groups the edges by key, each key's edges in
  (row, slot) order, ``edge_row`` (E,) names each edge's query row and ``offsets`` (T + 1,) (searchsorted: no host
  synchronisation) where each key's edges start. A program takes BK keys and walks their edges BE at a time
  (a ``while`` loop up to the block's largest in-degree: keys differ, a pooled token of focal is seen by thousands
  of rows), gathers q, dO, lse and D of those rows (BK, BE, .), recomputes s, p, dp, ds, and accumulates
  ``dk = scale sum ds q`` and ``dv = sum p dO``. A key no row names gets zeros. Blocks are launched in order of
  decreasing work (``schedule``: the blocks of high in-degree first, so that they do not make the launch's tail).

Determinism: every sum runs in a fixed order inside one program (over a key's edges in (row, slot) order), no
atomics: gradients are bit-reproducible run to run (the trainer's ``deterministic=true``). The sort is stable.
Everything is float32 (:func:`attention.functional.float32_kernel` has upcast half precision before the op);
``enable_fp_fusion`` stays on (a multiply-add rounded once is at least as exact; the tests compare against
float64 with a tolerance). The results differ from the torch paths by float32 rounding only (the softmax is
evaluated online, the logits scaled after the dot product).

Inputs: q, k, v and the upstream gradient are read through their strides (dilated hands over (B N, h_g d) views of
its qkv projection: rows 3C apart), never copied; the index is read as it is where it is contiguous int32 or
int64 (the variants' are int64), the backward sorts an int32 copy (R, T and R M must stay below 2^31); the
forward's output and lse are its own contiguous tensors. As in
:mod:`attention.dilated_triton`, where every row starts on 16 bytes and d, d_v are multiples of 4, the kernels know
it (``ALIGN``) and move 16 bytes at a time. Loops whose bound is a runtime value are ``while`` loops: Triton 3.6's
interpreter takes no runtime scalar as a ``range`` bound.

Cost at N = 65,536 points, C = 256, float32, B = 1 (estimates from the sizes; not timed: no GPU was available):

- focal (4 heads, d = 64; 49 fine neighbours + 49 pooled tokens of m = 1,338: M = 98, T = 66,874, E = R M = 6.4 M
  edges). Forward: one launch. DRAM: q 64 MiB, k and v 65 MiB each, index 49 MiB (int64), output 64 MiB, lse
  1 MiB: about 0.33 GiB, ~0.1 ms at 3.35 TB/s.
  Gathered through L1/L2: R M (C + C_v) 4 B = 13.2 GB (each slot's key and value rows of one head; neighbouring
  queries, consecutive in Morton order, share most of them, so most of it is cache hits). Backward: the query
  kernel re-gathers the same 13.2 GB, the key kernel gathers q and dO per edge, another 13.2 GB, plus lse and D
  (E heads 8 B = 0.2 GB); DRAM about 1.2 GiB (q, k, v, dO, O, lse, D read; dq, dk, dv written; the CSR: a radix
  sort of E (int32 key, int64 position) pairs, a few passes of 75 MiB, ~0.6 GiB, edge rows 25 MiB, offsets
  0.5 MiB). Extra memory: lse and D
  (2 MiB) and the CSR (E 4 B for edge rows, E 12 B transiently in the sort, T 8 B offsets): ~0.1 GiB, where the
  torch path holds a chunk of gathered keys (2^24 entries, 64 MiB) and their gradients.
  Launches: forward 1 Triton; backward 2 Triton + about 15 small torch ones (the index's int32 copy, the
  stable sort, division, searchsorted, the schedule's diff, pad, amax and argsort). Programs: forward and query
  kernel R / BR x heads = 131,072 (BR = 2), key kernel T x heads = 267,496 (BK = 1).
- dilated (8 heads in 4 groups of 2, d = 32, K = 9 per group, E = 0.6 M edges a group): for all groups at once,
  forward 1 launch, backward 2 + one CSR of the four tables; gathered bytes R K (C_g + C_g) 4 B = 302 MB a group,
  1.2 GB in all (the grid kernel of :mod:`attention.dilated_triton` reads its k*k = 9 neighbours the same number of
  times), DRAM ~0.75 GiB forward + backward for all groups; extra memory per group ~10 MiB (CSR) instead of the
  (B, 2, N, 9, 32) gathered keys and values (2 x 151 MiB) and their gradients.

At the H100's ~3.35 TB/s of DRAM (~1 ms for focal's 1.5 GiB, ~0.2 ms for dilated's) and ~5-7 TB/s of L2,
forward + backward is bound by the gathers' cache traffic: focal ~40 GB (3 x 13.2), 6-8 ms if every gather came
from L2, less with L1 hits (a block's rows share most keys: all their pooled tokens, many fine neighbours);
dilated ~3.6 GB, under 1 ms. Against 1.95 s and 1.26 s before; focal's gathers, d = 64 per head and M = 98 per
row, are what remains between it and the grid variant (where a window's 49 queries share one set of keys).

This module imports Triton at its top; :mod:`attention.functional` imports it only when the kernels are wanted
(``INDEX_KERNELS``, :mod:`attention.triton_kernels`). tests/attention/test_index_attention_triton.py runs them on
CPU tensors under ``TRITON_INTERPRET=1``, compiles them for sm_90, and, marked ``cuda``, runs them on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dilated_triton import alignment
from .triton_kernels import cdiv, pow2

# Largest gathered tile a program holds, in elements: (rows, slots, channels) in the forward and the query kernel,
# (keys, edges, channels) in the key kernel. 2048 float32 over 4 warps are 16 registers a tile; the kernels hold
# two (keys and values, or queries and upstream gradients) and their products. Compiled for sm_90 at C = 256
# (dilated's groups of 2 heads, d = 32: BR = 4, BM = 16; focal's 4 heads, d = 64: BR = 2) the forward takes 96 and
# 64 registers, the query kernel 120 and 80; the key kernel took 165 at 2048 (d = 32), so it takes KEY_TILE, half
# (96 and 64 registers: BK = 4, BE = 8 and BK = 1, BE = 16); none spills. Chosen from the compiled code, not
# timed: no GPU was available.
MAX_TILE = 2048
KEY_TILE = 1024
# Slots (forward, query kernel) or edges (key kernel) a step of the loop takes, at most.
MAX_STEP = 16
MAX_BLOCK = 64
NUM_WARPS = 4


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, index_ptr, out_ptr, lse_ptr,
                    q_sr, q_sc, k_sr, k_sc, v_sr, v_sc,
                    rows, m, heads, group_heads, d, d_v, scale,
                    BR: tl.constexpr, BM: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, ALIGN: tl.constexpr):
    """Program (block, head) (flattened, heads fastest): out (R, heads d_v) and lse (R, heads) of rows
    block*BR ... + BR, for q (R, heads d), k (T, heads d), v (T, heads d_v) (strided: row stride, channel stride)
    and index (G, R, M) int32 or int64, contiguous, table g for heads g*group_heads ... + group_heads. Row
    strides, d and d_v come divided by ALIGN."""
    q_sr, k_sr, v_sr = q_sr * ALIGN, k_sr * ALIGN, v_sr * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    pid = tl.program_id(0)
    hd = pid % heads
    index_ptr = index_ptr + (hd // group_heads).to(tl.int64) * rows * m  # this head's group's table
    rr = (pid // heads) * BR + tl.arange(0, BR)  # (BR,) query rows
    valid = rr < rows
    rl = rr.to(tl.int64)
    cd = hd * d + tl.arange(0, DP)  # (DP,) this head's channels of q and k
    cv = hd * d_v + tl.arange(0, DVP)  # (DVP,) and of v
    md = tl.arange(0, DP) < d
    mv = tl.arange(0, DVP) < d_v
    cm = tl.arange(0, BM)
    qt = tl.load(q_ptr + rl[:, None] * q_sr + cd[None, :] * q_sc, mask=valid[:, None] & md[None, :],
                 other=0.0)  # (BR, DP)
    top = tl.full((BR,), float("-inf"), tl.float32)  # running maximum of the scaled logits
    total = tl.zeros((BR,), tl.float32)  # running sum of exp(logit - top)
    acc = tl.zeros((BR, DVP), tl.float32)  # running sum of exp(logit - top) v
    j = 0
    while j < m:  # a while loop: Triton 3.6's interpreter too
        slot = j + cm  # (BM,)
        live_slot = (slot < m)[None, :]  # (1, BM)
        live = valid[:, None] & live_slot  # (BR, BM)
        key = tl.load(index_ptr + rl[:, None] * m + slot[None, :], mask=live, other=0).to(tl.int64)  # (BR, BM)
        kt = tl.load(k_ptr + key[:, :, None] * k_sr + cd[None, None, :] * k_sc,
                     mask=live[:, :, None] & md[None, None, :], other=0.0)  # (BR, BM, DP)
        # padding slots leave the softmax; rows past the end keep logits 0 (finite: no NaN), and are not stored
        s = tl.where(live_slot, tl.sum(qt[:, None, :] * kt, axis=2) * scale, float("-inf"))  # (BR, BM)
        new_top = tl.maximum(top, tl.max(s, axis=1))  # (BR,): finite, slot j is live
        alpha = tl.exp(top - new_top)  # (BR,) 0 at the first step
        p = tl.exp(s - new_top[:, None])  # (BR, BM), 0 at padding slots
        total = total * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + key[:, :, None] * v_sr + cv[None, None, :] * v_sc,
                     mask=live[:, :, None] & mv[None, None, :], other=0.0)  # (BR, BM, DVP)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt, axis=1)
        top = new_top
        j += BM
    out = acc / total[:, None]  # (BR, DVP)
    tl.store(out_ptr + rl[:, None] * (heads * d_v) + cv[None, :], out, mask=valid[:, None] & mv[None, :])
    tl.store(lse_ptr + rl * heads + hd, top + tl.log(total), mask=valid)


@triton.jit
def _backward_query_kernel(q_ptr, k_ptr, v_ptr, index_ptr, g_ptr, out_ptr, lse_ptr, dq_ptr, delta_ptr,
                           q_sr, q_sc, k_sr, k_sc, v_sr, v_sc, g_sr, g_sc,
                           rows, m, heads, group_heads, d, d_v, scale,
                           BR: tl.constexpr, BM: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
                           ALIGN: tl.constexpr):
    """Program (block, head): dq (R, heads d) and D = rowsum(dO o O) (R, heads) of rows block*BR ... + BR, from the
    upstream gradient g (R, heads d_v) (strided), the forward's out (R, heads d_v) and lse (R, heads)."""
    q_sr, k_sr, v_sr, g_sr = q_sr * ALIGN, k_sr * ALIGN, v_sr * ALIGN, g_sr * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    pid = tl.program_id(0)
    hd = pid % heads
    index_ptr = index_ptr + (hd // group_heads).to(tl.int64) * rows * m  # this head's group's table
    rr = (pid // heads) * BR + tl.arange(0, BR)  # (BR,) query rows
    valid = rr < rows
    rl = rr.to(tl.int64)
    cd = hd * d + tl.arange(0, DP)
    cv = hd * d_v + tl.arange(0, DVP)
    md = tl.arange(0, DP) < d
    mv = tl.arange(0, DVP) < d_v
    cm = tl.arange(0, BM)
    rmd = valid[:, None] & md[None, :]  # (BR, DP)
    rmv = valid[:, None] & mv[None, :]  # (BR, DVP)
    qt = tl.load(q_ptr + rl[:, None] * q_sr + cd[None, :] * q_sc, mask=rmd, other=0.0)  # (BR, DP)
    gt = tl.load(g_ptr + rl[:, None] * g_sr + cv[None, :] * g_sc, mask=rmv, other=0.0)  # (BR, DVP)
    ot = tl.load(out_ptr + rl[:, None] * (heads * d_v) + cv[None, :], mask=rmv, other=0.0)  # (BR, DVP)
    delta = tl.sum(gt * ot, axis=1)  # (BR,) D = dO . O = sum_j p_j dp_j
    lse = tl.load(lse_ptr + rl * heads + hd, mask=valid, other=0.0)  # (BR,)
    acc = tl.zeros((BR, DP), tl.float32)
    j = 0
    while j < m:
        slot = j + cm
        live = valid[:, None] & (slot < m)[None, :]  # (BR, BM)
        key = tl.load(index_ptr + rl[:, None] * m + slot[None, :], mask=live, other=0).to(tl.int64)  # (BR, BM)
        kt = tl.load(k_ptr + key[:, :, None] * k_sr + cd[None, None, :] * k_sc,
                     mask=live[:, :, None] & md[None, None, :], other=0.0)  # (BR, BM, DP)
        p = tl.where(live, tl.exp(tl.sum(qt[:, None, :] * kt, axis=2) * scale - lse[:, None]), 0.0)  # (BR, BM)
        vt = tl.load(v_ptr + key[:, :, None] * v_sr + cv[None, None, :] * v_sc,
                     mask=live[:, :, None] & mv[None, None, :], other=0.0)  # (BR, BM, DVP)
        ds = p * (tl.sum(gt[:, None, :] * vt, axis=2) - delta[:, None])  # (BR, BM): softmax's backward
        acc += tl.sum(ds[:, :, None] * kt, axis=1)
        j += BM
    tl.store(dq_ptr + rl[:, None] * (heads * d) + cd[None, :], acc * scale, mask=rmd)
    tl.store(delta_ptr + rl * heads + hd, delta, mask=valid)


@triton.jit
def _backward_key_kernel(q_ptr, k_ptr, v_ptr, g_ptr, lse_ptr, delta_ptr, edge_row_ptr, offsets_ptr, schedule_ptr,
                         dk_ptr, dv_ptr, q_sr, q_sc, k_sr, k_sc, v_sr, v_sc, g_sr, g_sc,
                         keys, heads, group_heads, d, d_v, scale,
                         BK: tl.constexpr, BE: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
                         ALIGN: tl.constexpr):
    """Program (i, head): dk (T, heads d) and dv (T, heads d_v) of keys block*BK ... + BK, block = schedule[i],
    summing over each key's incoming edges in its head's group g (edge_row[offsets[g T + key]:offsets[g T + key
    + 1]], in (row, slot) order) BE at a time."""
    q_sr, k_sr, v_sr, g_sr = q_sr * ALIGN, k_sr * ALIGN, v_sr * ALIGN, g_sr * ALIGN
    d, d_v = d * ALIGN, d_v * ALIGN
    pid = tl.program_id(0)
    hd = pid % heads
    block = tl.load(schedule_ptr + pid // heads)
    kk = block * BK + tl.arange(0, BK)  # (BK,) keys
    valid = kk < keys
    kl = kk.to(tl.int64)
    cd = hd * d + tl.arange(0, DP)
    cv = hd * d_v + tl.arange(0, DVP)
    md = tl.arange(0, DP) < d
    mv = tl.arange(0, DVP) < d_v
    ce = tl.arange(0, BE)
    kmd = valid[:, None] & md[None, :]  # (BK, DP)
    kmv = valid[:, None] & mv[None, :]  # (BK, DVP)
    kt = tl.load(k_ptr + kl[:, None] * k_sr + cd[None, :] * k_sc, mask=kmd, other=0.0)  # (BK, DP)
    vt = tl.load(v_ptr + kl[:, None] * v_sr + cv[None, :] * v_sc, mask=kmv, other=0.0)  # (BK, DVP)
    slot = (hd // group_heads).to(tl.int64) * keys + kl  # (BK,) the keys in this head's group's CSR
    start = tl.load(offsets_ptr + slot, mask=valid, other=0)  # (BK,) int64: first edge of each key
    count = tl.load(offsets_ptr + slot + 1, mask=valid, other=0) - start  # (BK,) its in-degree
    longest = tl.max(count, axis=0)
    dk = tl.zeros((BK, DP), tl.float32)
    dv = tl.zeros((BK, DVP), tl.float32)
    e = 0
    while e < longest:  # each key's edges in (row, slot) order, BE at a time
        at = e + ce  # (BE,)
        live = at[None, :] < count[:, None]  # (BK, BE)
        row = tl.load(edge_row_ptr + start[:, None] + at[None, :], mask=live, other=0).to(tl.int64)  # (BK, BE)
        qe = tl.load(q_ptr + row[:, :, None] * q_sr + cd[None, None, :] * q_sc,
                     mask=live[:, :, None] & md[None, None, :], other=0.0)  # (BK, BE, DP)
        ge = tl.load(g_ptr + row[:, :, None] * g_sr + cv[None, None, :] * g_sc,
                     mask=live[:, :, None] & mv[None, None, :], other=0.0)  # (BK, BE, DVP)
        lse = tl.load(lse_ptr + row * heads + hd, mask=live, other=0.0)  # (BK, BE)
        delta = tl.load(delta_ptr + row * heads + hd, mask=live, other=0.0)  # (BK, BE)
        p = tl.where(live, tl.exp(tl.sum(qe * kt[:, None, :], axis=2) * scale - lse), 0.0)  # (BK, BE)
        ds = p * (tl.sum(ge * vt[:, None, :], axis=2) - delta)  # (BK, BE)
        dk += tl.sum(ds[:, :, None] * qe, axis=1)
        dv += tl.sum(p[:, :, None] * ge, axis=1)
        e += BE
    tl.store(dk_ptr + kl[:, None] * (heads * d) + cd[None, :], dk * scale, mask=kmd)
    tl.store(dv_ptr + kl[:, None] * (heads * d_v) + cv[None, :], dv, mask=kmv)


def _block(step: int, widest: int, tile: int) -> int:
    """Rows (keys) a program takes: a power of two, (block, step, widest) within ``tile``, 1 to MAX_BLOCK."""
    return max(1, min(MAX_BLOCK, tile // (step * widest)))


@functools.lru_cache(maxsize=256)
def forward_config(m: int, d: int, d_v: int) -> Mapping[str, int]:
    """Constexprs and warps of the forward and the query kernel: BM slots a step (M rounded up to a power of two,
    at most MAX_STEP), BR rows a program, DP and DVP (d and d_v rounded up to powers of two)."""
    dp, dvp = pow2(max(1, d)), pow2(max(1, d_v))
    bm = min(MAX_STEP, pow2(max(1, m)))
    return MappingProxyType(dict(BR=_block(bm, max(dp, dvp), MAX_TILE), BM=bm, DP=dp, DVP=dvp, num_warps=NUM_WARPS))


@functools.lru_cache(maxsize=256)
def key_config(edges: int, keys: int, d: int, d_v: int) -> Mapping[str, int]:
    """Constexprs and warps of the key kernel: BE edges a step (half the mean in-degree rounded up to a power of
    two, 1 to MAX_STEP: a key of mean in-degree takes about two steps), BK keys a program ((BK, BE, widest)
    within KEY_TILE), DP, DVP."""
    dp, dvp = pow2(max(1, d)), pow2(max(1, d_v))
    be = min(MAX_STEP, pow2(max(1, -(-edges // max(1, 2 * keys)))))
    return MappingProxyType(dict(BK=_block(be, max(dp, dvp), KEY_TILE), BE=be, DP=dp, DVP=dvp, num_warps=NUM_WARPS))


def inverse_index(index: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The index tables (G, R, M) (or one, (R, M)) inverted, as one CSR over the G T slots (g, key), T = ``keys``:
    ``edge_row`` (G R M,) int32, the query row of every edge grouped by (table, key), each key's edges in (row,
    slot) order (a stable sort of the flattened tables, whose order is (table, row, slot), by g T + key), and
    ``offsets`` (G T + 1,) int64, where each slot's edges start (searchsorted of 0 .. G T in the sorted keys: no
    host synchronisation, unlike bincount)."""
    tables, rows, m = index.reshape(-1, *index.shape[-2:]).shape
    flat = index.reshape(tables, -1)  # (G, R M)
    if tables > 1:  # table g's keys as g T + key: one sort for every table
        flat = flat + torch.arange(tables, device=index.device, dtype=index.dtype).unsqueeze(1) * keys
    sorted_keys, edge = torch.sort(flat.reshape(-1), stable=True)  # (E,) each: keys ascending, ties in edge order
    edge_row = torch.div(edge % (rows * m), m, rounding_mode="floor").to(torch.int32)  # edge (g, r, j): row r
    bounds = torch.arange(tables * keys + 1, device=index.device, dtype=sorted_keys.dtype)  # (G T + 1,)
    return edge_row, torch.searchsorted(sorted_keys, bounds)  # offsets (G T + 1,) int64


def _check(q, k, v, index, heads) -> None:
    if any(t.dtype != torch.float32 for t in (q, k, v)):
        raise ValueError(f"index_attention_triton: float32 tensors only, got {[t.dtype for t in (q, k, v)]} "
                         "(the torch path takes float64; index_attention upcasts half precision).")
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2 or index.dim() not in (2, 3) or index.shape[-2] != q.shape[0] \
            or k.shape[0] != v.shape[0] or q.shape[1] != k.shape[1] or q.shape[1] % heads or v.shape[1] % heads \
            or heads % (index.shape[0] if index.dim() == 3 else 1):
        raise ValueError(f"index_attention_triton: expected q (R, C), k (T, C), v (T, C_v), index (R, M) or (G, R, M) "
                         f"with heads = {heads} dividing C and C_v and G dividing heads; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(index.shape)}.")
    tables = index.shape[0] if index.dim() == 3 else 1
    if max(q.shape[0], tables * k.shape[0], index.numel()) >= 2 ** 31:
        raise ValueError("index_attention_triton: rows, G keys and G R M must stay below 2^31 (int32 indices).")


def _index(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The index tables as the kernels read them, contiguous int32 or int64 (either is loaded and widened to int64),
    copied only if they are neither, and how many (G: one for (R, M))."""
    if not (index.dtype in (torch.int32, torch.int64) and index.is_contiguous()):
        index = index.to(torch.int64).contiguous()
    return index, index.shape[0] if index.dim() == 3 else 1


def _strides(t: torch.Tensor, align: int) -> tuple[int, int]:
    """(row stride / align, channel stride) of a 2-D tensor (exact: :func:`alignment`)."""
    return t.stride(0) // align if t.shape[0] > 1 else t.stride(0), t.stride(1)


def _device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _align(tensors, d: int, d_v: int) -> int:
    """ALIGN (:func:`attention.dilated_triton.alignment`) of 2-D row tensors and head widths d, d_v."""
    return alignment(tensors, (d, d_v))


def forward(q, k, v, index, heads: int, scale: float):
    """The output (R, C_v) and the log-sum-exp lse (R, heads) of the scaled logits, float32, contiguous, for
    float32 q (R, C), k (T, C), v (T, C_v) (any strides) and an integer index (R, M) of rows of k and v, or G such
    tables (G, R, M), table g for the g-th of G equal groups of consecutive heads (one launch for all)."""
    _check(q, k, v, index, heads)
    rows, m = index.shape[-2:]
    d, d_v = q.shape[1] // heads, v.shape[1] // heads
    out = q.new_empty(rows, v.shape[1])  # (R, C_v)
    lse = q.new_empty(rows, heads)  # (R, heads)
    if rows == 0 or m == 0 or k.shape[0] == 0:  # no slot: softmax over nothing, as the torch path (zeros)
        return out.zero_(), lse.fill_(float("-inf"))
    index, tables = _index(index)  # (G, R, M) or (R, M): as it is (the variants' are contiguous int64)
    config = forward_config(m, d, d_v)
    align = _align((q, k, v, out), d, d_v)
    with _device(q):
        _forward_kernel[(cdiv(rows, config["BR"]) * heads,)](
            q, k, v, index, out, lse, *_strides(q, align), *_strides(k, align), *_strides(v, align),
            rows, m, heads, heads // tables, d // align, d_v // align, float(scale), ALIGN=align, **config)
    return out, lse


def backward(grad, q, k, v, index, out, lse, heads: int, scale: float):
    """dq (R, C), dk (T, C), dv (T, C_v), contiguous float32, for the upstream gradient grad (R, C_v) (any strides)
    and the forward's out and lse: two launches, and the CSR of :func:`inverse_index` in torch between them."""
    _check(q, k, v, index, heads)
    rows, m = index.shape[-2:]
    keys = k.shape[0]
    d, d_v = q.shape[1] // heads, v.shape[1] // heads
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if rows == 0 or m == 0 or keys == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    index, tables = _index(index)  # (G, R, M) or (R, M)
    out, lse = out.contiguous(), lse.contiguous()  # the forward's: no copy
    delta = torch.empty_like(lse)  # (R, heads) D = dO . O
    align = _align((grad, q, k, v, out, dq, dk, dv), d, d_v)
    strides = (*_strides(q, align), *_strides(k, align), *_strides(v, align), *_strides(grad, align))
    config = forward_config(m, d, d_v)
    with _device(q):
        _backward_query_kernel[(cdiv(rows, config["BR"]) * heads,)](
            q, k, v, index, grad, out, lse, dq, delta, *strides, rows, m, heads, heads // tables, d // align,
            d_v // align, float(scale), ALIGN=align, **config)
        edge_row, offsets = inverse_index(index.to(torch.int32), keys)  # int32 keys: a shorter radix sort
        config = key_config(rows * m, keys, d, d_v)
        blocks = cdiv(keys, config["BK"])
        # each block's largest in-degree over the tables (its loop's length), blocks of most work first
        work = F.pad(offsets.diff().view(tables, keys), (0, blocks * config["BK"] - keys)) \
            .view(tables, blocks, -1).amax((0, 2))  # (blocks,)
        schedule = torch.argsort(work, descending=True, stable=True).to(torch.int32)  # (blocks,)
        _backward_key_kernel[(blocks * heads,)](
            q, k, v, grad, lse, delta, edge_row, offsets, schedule, dk, dv, *strides, keys, heads,
            heads // tables, d // align, d_v // align, float(scale), ALIGN=align, **config)
    return dq, dk, dv
