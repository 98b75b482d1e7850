"""FLOP formulas that ``torch.utils.flop_counter`` leaves out: the SDPA kernels of some torch builds, and the
in-place forms of its matrix products.

``F.scaled_dot_product_attention`` dispatches to one of several fused kernels (the CPU flash kernel, CUDA's
flash, memory-efficient and cuDNN kernels, the overrideable kernel of out-of-tree backends, MPS's math kernel),
and the flop counter counts an op only if it has a formula registered for it. torch 2.14.1, the release
``requirements/lock.txt`` pins, has formulas for the CUDA kernels but none for the CPU flash kernel: without this
module, ``attn=self`` on a CPU counts its projections and not its attention, by a factor that grows with N.

So every SDPA kernel of the running torch that has no formula gets the one below, at import of ``attention``.
Kernels torch already counts keep torch's formula (``tests/attention/test_flops.py`` checks that the two
agree). Convention, torch's own: a multiply-add is 2 FLOPs; softmax, scaling and masking are not counted; a
causal mask does not halve the count.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

# Forward kernels take (query, key, value, ...), backward kernels (grad_out, query, key, value, ...); all of them
# see (B, heads, N, d) tensors. The MPS math kernel has no backward op of its own.
FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps")
BACKWARD = tuple(f"{name}_backward" for name in FORWARD[:5])


def sdpa_flops(query_shape, key_shape, value_shape) -> int:
    """Forward: Q K^T (B H N M d) and A V (B H N M d_v), 2 FLOPs per multiply-add."""
    *batch, n, d = query_shape
    m, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * n * m * (d + d_v)


def sdpa_backward_flops(query_shape, key_shape, value_shape) -> int:
    """Backward: the fused kernels keep no attention matrix, so they recompute Q K^T (d), then
    dP = dO V^T and dV = P^T dO (d_v each), dQ = dS K and dK = dS^T Q (d each)."""
    *batch, n, d = query_shape
    m, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * n * m * (3 * d + 2 * d_v)


def _forward_formula(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flops(query_shape, key_shape, value_shape)


def _backward_formula(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flops(query_shape, key_shape, value_shape)


def sdpa_ops() -> list[tuple[object, bool]]:
    """(op packet, is backward) for every SDPA kernel this torch build has."""
    return [(getattr(torch.ops.aten, name), backward)
            for names, backward in ((FORWARD, False), (BACKWARD, True))
            for name in names if hasattr(torch.ops.aten, name)]


def register_missing() -> list[str]:
    """Register a formula for every SDPA kernel that torch's counter lacks; returns the names registered."""
    missing = [(op, backward) for op, backward in sdpa_ops() if op not in flop_registry]
    for op, backward in missing:
        register_flop_formula(op)(_backward_formula if backward else _forward_formula)
    return [op.__name__ for op, _ in missing]


REGISTERED = register_missing()


# The counter has formulas for addmm and baddbmm but none for their in-place forms, which a chunked kernel
# accumulates with (offset attention's OffsetChunked: A^T v forward, dS^T q backward). Uncounted, offset attention at
# N = 65,536 (C = 256) counted 704 of its 1,024 units of 2 N^2 multiply-adds, and the bench's fraction of the
# machine's bound read 36% on an H200 where the work done was 51% of it (benchmarks/cost-part-cuda.md's 317 ms).
IN_PLACE = {"addmm_": "addmm", "baddbmm_": "baddbmm"}


def register_in_place() -> list[str]:
    """Give each in-place product of :data:`IN_PLACE` its out-of-place op's formula, where torch has none for it."""
    added = []
    for name, like in IN_PLACE.items():
        op, formula = getattr(torch.ops.aten, name), flop_registry.get(getattr(torch.ops.aten, like))
        if op not in flop_registry and formula is not None:
            flop_registry[op] = formula
            added.append(name)
    return added


IN_PLACE_REGISTERED = register_in_place()
