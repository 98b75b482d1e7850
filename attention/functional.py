"""Pure attention kernels on per-head tensors.

Every kernel takes ``q`` of shape (B, heads, N, d) and keys/values of shape
(B, heads, M, d) / (B, heads, M, d_v) unless its docstring says otherwise, and
implements its paper's formula and nothing else: projections, heads and
layouts belong to the modules in ``attention.variants``. Each kernel is tested
against a brute-force O(N^2) float64 reference in ``tests/attention``.

Mixed precision: every kernel but ``softmax_attention`` computes in float32
when it gets float16/bfloat16 tensors or runs under autocast, and returns
``q``'s dtype (see :func:`float32_kernel`); ``softmax_attention`` is SDPA, whose
kernels accumulate in float32 themselves.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from .eager import autocast_off, below_autograd, skips_dispatch
from .tensor_cache import tensor_cache
from .triton_kernels import Kernels

HALF = (torch.float16, torch.bfloat16)


def _upcast(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t


def float32_kernel(kernel):
    """Run ``kernel`` in float32 when it is given float16/bfloat16 tensors or called under autocast.

    Half precision cannot hold what the kernels' normalisations need: eps = 1e-9 is 0 in float16, so a column
    or row of attention weights that underflows gives 0 / 0; exp, and sums over thousands of tokens, overflow
    float16's 65504; bfloat16's 8-bit mantissa counts a sum of 4096 terms in steps of 32; autocast would also
    run the logits' matmuls in half precision. So half tensors are upcast (exactly) to float32, autocast is
    switched off on their device for the whole kernel, and the result is cast to ``q``'s dtype (the first
    argument): under autocast the projections around the kernel stay in half precision, and SDPA does the same
    (half inputs, float32 accumulation). float32 and float64 inputs outside autocast take the unchanged path.
    """
    @functools.wraps(kernel)
    def wrapper(q, *args, **kwargs):
        device = q.device.type
        tensors = (q, *args, *kwargs.values())
        if not torch.is_autocast_enabled(device) and not any(
                isinstance(t, torch.Tensor) and t.dtype in HALF for t in tensors):
            return kernel(q, *args, **kwargs)
        made = {}  # one upcast per tensor: PCT passes its one projection as both q and k

        def upcast(t):
            if id(t) not in made:
                made[id(t)] = _upcast(t)
            return made[id(t)]

        with autocast_off(device):
            out = kernel(upcast(q), *map(upcast, args), **{k: upcast(v) for k, v in kwargs.items()})
        return out.to(q.dtype)

    return wrapper


def _eager_function(name: str, kernel, setup_context, grad) -> type[torch.autograd.Function]:
    """A ``torch.library`` op's kernel and autograd (the functions it registers) as a plain autograd.Function
    without the op's dispatch, for eager calls (:func:`attention.eager.skips_dispatch`); its ``apply`` takes the
    op's arguments."""

    def forward(ctx, *inputs):
        with below_autograd():
            output = kernel(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(grad)})


def softmax_attention(q, k, v, scale: float | None = None, fused: bool = True):
    """softmax(q k^T * scale) v, scale = d^-0.5 by default: q (..., N, d), k (..., M, d), v (..., M, d_v).

    ``fused``: through SDPA's fused kernels (flash, memory-efficient: no N x M map held), whose backward has no
    derivative of its own, so a gradient penalty (R1, WGAN-GP: ``create_graph``) fails in it. ``fused=False``: the
    plain products and softmax, which autograd differentiates twice, at the cost of the (N, M) map in memory.
    """
    if fused:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (..., N, d_v)
    # focal's kernel without bias or mask is exactly this, in plain ops, in float32 for half precision (as SDPA
    # accumulates)
    return focal_attention(q, k, v, scale=scale)  # (..., N, d_v)


# Above this many entries of the attention map (B h N M), offset_attention runs in query chunks (:class:`OffsetChunked`)
# instead of forming the map: 2^28 entries are 1 GiB of float32, and the full form holds about four maps in training.
OFFSET_FULL_MAX_ELEMENTS = 1 << 28
# Entries of the map (B h rows M) that one chunk of OffsetChunked holds: 2^25 float32 = 128 MiB a tensor.
OFFSET_CHUNK_ELEMENTS = 1 << 25


@float32_kernel
def offset_attention(q, k, v, eps: float = 1e-9):
    """PCT's attention (Guo et al., 2021), as in its reference code.

    A = softmax(q k^T) over the keys, no scaling; then each column of A is
    divided by (eps + its sum over the queries); output_j = sum_i A_ij v_i.

    The output is indexed by the *key* position j and sums over query positions
    i, so ``v`` has the queries' length N and the output the keys' length M:
    q (B, h, N, d), k (B, h, M, d), v (B, h, N, d_v) -> (B, h, M, d_v).
    In PCT q and k come from one shared projection of the same tokens (N = M).

    Up to ``OFFSET_FULL_MAX_ELEMENTS`` entries of A it is formed whole (fastest); above, :class:`OffsetChunked`
    computes the same in O(N d + chunk M) memory (at N = 65,536 the map alone is 16 GiB a head).
    """
    b, h, n, _ = q.shape
    m = k.shape[-2]
    if b * h * n * m > OFFSET_FULL_MAX_ELEMENTS:
        return OffsetChunked.apply(q, k, v, eps, max(1, OFFSET_CHUNK_ELEMENTS // (b * h * m)))
    if torch.compiler.is_compiling():  # inductor fuses the plain ops itself
        return _offset_full(q, k, v, eps)
    return OffsetFull.apply(q, k, v, eps)


def recomputed_grads(plain, grad, inputs):
    """The gradients of ``plain(*inputs)`` (differentiable ops) w.r.t. ``inputs``, with their own graph: what a
    kernel's written-out backward returns under ``create_graph`` (a gradient penalty), so that its gradients can be
    differentiated again. None for an input that does not require grad. Each tensor once: a tensor passed as two
    of the inputs (PCT's one projection as q and k) gets its whole gradient at every repeat from autograd.grad,
    which autograd would then add up twice."""
    first = [t.requires_grad and not any(t is u for u in inputs[:i]) for i, t in enumerate(inputs)]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(plain(*inputs), [t for t, take in zip(inputs, first) if take], grad,
                                         create_graph=True))
    return [next(grads) if take else None for take in first]


def _offset_full(q, k, v, eps):
    """:func:`offset_attention` with the whole (N, M) map, as plain differentiable ops."""
    attn = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # (B, h, N, M)
    colsum = attn.sum(dim=-2)  # (B, h, M): each column's sum over the queries
    # out_j = sum_i A_ij v_i / (eps + c_j): the division by the column sums comes after the product, on the
    # (d_v, M) result instead of the (N, M) map (equal in exact arithmetic, ~1e-16 apart in float64), and the
    # product is v^T A rather than A^T v, so that the map's gradient, v dY, comes out (N, M) contiguous. Through
    # A / (eps + c) and A^T, the map was divided, saved twice and its gradient reached the division's and the
    # softmax's backward transposed (a copy each, strided passes): forward + backward at B=8, N=2048 took 1.38x
    # as long on the CPU, PCT's part segmentation training step 1.5x.
    out = (v.transpose(-2, -1) @ attn) / (eps + colsum).unsqueeze(-2)  # (B, h, d_v, M)
    return out.transpose(-2, -1)  # (B, h, M, d_v)


def _offset_map_backward(grad, v, attn, denom, out):
    """The shared part of offset attention's written-out backwards (:class:`OffsetFull`, :class:`OffsetProjected`),
    on the (B h) matrices: from the output's gradient G (B h, M, d_v), the values v (B h, N, d_v), the map A
    (B h, N, M), D = eps + its column sums (B h, M) and the output (B h, M, d_v): dU = G / D (B h, M, d_v) and the
    logits' gradient dS (B h, N, M), through dA = v dU^T - dD (one baddbmm: the column sums' gradient
    dD_j = (dU_j . out_j) its bias, broadcast over N) and softmax's backward."""
    d_u = grad / denom.unsqueeze(-1)  # (B h, M, d_v)
    d_denom = (d_u * out).sum(-1)  # (B h, M): minus the gradient of D
    d_attn = torch.baddbmm(d_denom.unsqueeze(1), v, d_u.transpose(1, 2), beta=-1)  # (B h, N, M)
    return d_u, torch._softmax_backward_data(d_attn, attn, -1, attn.dtype)


def _float32_backward(backward, ctx, grad):
    """A written-out autograd function's ``backward(ctx, grad, *saved tensors)`` with autocast off: in float32 as
    its forward (:func:`float32_kernel`), also when the caller runs backward() inside its autocast block."""
    with autocast_off(grad.device.type):
        return backward(ctx, grad, *ctx.saved_tensors)


class OffsetFull(torch.autograd.Function):
    """:func:`offset_attention` with the whole (N, M) map A held, and a backward written out: with D = eps + c
    (c the column sums) and G the output's gradient, dU = G / D, dA = v dU^T - rowvec((dU . out)) (one ``baddbmm``:
    the column sums' gradient added as the product's bias), dS = softmax's backward of dA, dq = dS k, dk = dS^T q,
    dv = A dU. Autograd's chain of the plain ops (:func:`_offset_full`) spends 13 kernels on this and passes over
    the (N, M) map once more: the column sums' gradient reaches it as a separate broadcast add, and the division's
    backward takes five ops on (B, h, d_v, M). On a GPU each kernel is a launch of a step bound by its launches
    (PCT at batch 16), and at part segmentation's N = 2,048 each (N, M) pass is 16 MiB a shape.

    ``create_graph`` (a gradient penalty) differentiates the plain ops again, recomputed from the inputs: the
    written-out backward holds A without its graph.
    """

    @staticmethod
    def forward(ctx, q, k, v, eps):
        # on the (B h) matrices: bmm, where matmul on (B, h, ., .) wraps each product in about ten more dispatched
        # ops (its expands and reshapes; host time, in a step bound by its launches); views where h = 1 (PCT)
        q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))  # (B h, N | M, d)
        attn = torch.softmax(torch.bmm(q3, k3.transpose(1, 2)), dim=-1)  # (B h, N, M)
        denom = attn.sum(dim=1).add_(eps)  # (B h, M): eps + each column's sum over the queries
        out = torch.bmm(attn.transpose(1, 2), v3).div_(denom.unsqueeze(-1))  # (B h, M, d_v): A^T v / D
        ctx.save_for_backward(q, k, v, attn, denom, out)
        ctx.eps = eps
        return out.view(*k.shape[:-1], v.shape[-1])  # (B, h, M, d_v)

    @staticmethod
    def backward(ctx, grad):
        return _float32_backward(OffsetFull._backward, ctx, grad)

    @staticmethod
    def _backward(ctx, grad, q, k, v, attn, denom, out):
        if torch.is_grad_enabled():  # create_graph: the plain ops' graph, recomputed
            return (*recomputed_grads(lambda *t: _offset_full(*t, ctx.eps), grad, (q, k, v)), None)
        q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))  # (B h, N | M, d)
        d_u, d_logits = _offset_map_backward(grad.flatten(0, 1), v3, attn, denom, out)
        dq = torch.bmm(d_logits, k3).view(q.shape) if ctx.needs_input_grad[0] else None
        dk = torch.bmm(d_logits.transpose(1, 2), q3).view(k.shape) if ctx.needs_input_grad[1] else None
        dv = torch.bmm(attn, d_u).view(v.shape) if ctx.needs_input_grad[2] else None
        return dq, dk, dv, None


OFFSET_PROJECTED = True
"""Whether :func:`offset_projected` may run as one autograd function (:class:`OffsetProjected`); ``False``: always
the ``nn.Linear`` products and :func:`offset_attention`, the same function (``benchmarks.pct_cuda`` times both
forms on a GPU, whose host pays for a Python backward node what it saves in products and nodes)."""


def offset_projected(x, w_qk, w_v, b_v, heads: int = 1, eps: float = 1e-9):
    """PCT's offset mixer with its projections: ``offset_attention(qk, qk, v)`` of qk = x W_qk^T and
    v = x W_v^T + b_v split into ``heads``, on x (B, N, C) -> (B, N, C_v) (the heads merged), C_v = W_v's rows.

    Where it runs as one autograd function (:class:`OffsetProjected`: float32 or float64, or float32 under autocast;
    not under torch.compile; the map whole), it is the same function in fewer host ops: one product for both
    projections (the weights concatenated) and, backward, one product each for the input's and the weights'
    gradients, where two ``nn.Linear`` and the kernel made about a dozen autograd nodes (views, transposes, products
    and the sums of the gradients of q and k, and of x's two uses), and under autocast about fourteen casts a
    call where it takes seven. PCT's training step at batch 16 is bound by those on a GPU (an H200 spent 40 us of
    host time a matrix product, 15 us an autograd node: docs/cost.md). Elsewhere it runs the ``nn.Linear`` products
    and :func:`offset_attention`, as the mixer did.
    """
    b, n, _ = x.shape
    device = x.device.type
    half = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    weights = [t.dtype for t in (w_qk, w_v, b_v) if t is not None]
    if half is None:  # x and the weights of one dtype, float32 or float64
        fits = x.dtype in (torch.float32, torch.float64) and all(dtype == x.dtype for dtype in weights)
    else:  # AMP's float32 weights, x in float32 or in autocast's dtype (the output of a layer before it)
        fits = half in HALF and x.dtype in (torch.float32, half) and all(dtype == torch.float32 for dtype in weights)
    if (not OFFSET_PROJECTED or not fits or torch.compiler.is_compiling()
            or b * heads * n * n > OFFSET_FULL_MAX_ELEMENTS):
        return _offset_projected_plain(x, w_qk, w_v, b_v, heads, eps)
    return OffsetProjected.apply(x, w_qk, w_v, b_v, heads, eps, half)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (B, N, C) as a (B N, C) matrix: a view (one op; ``reshape`` dispatches two), or a copy if not contiguous."""
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])


def _heads(t: torch.Tensor, b: int, n: int, heads: int) -> torch.Tensor:
    """t (B N, h d), rows of a wider matrix or not -> (B h, N, d): a view for one head, a copy for more."""
    if heads == 1:
        return t.view(b, n, t.shape[-1])  # (B, N, d): splitting the rows is a view whatever the row stride
    return t.reshape(b, n, heads, -1).transpose(1, 2).reshape(b * heads, n, -1)  # (B h, N, d)


def _merge_heads(t: torch.Tensor, b: int, heads: int) -> torch.Tensor:
    """t (B h, N, d) -> (B, N, h d): a view for one head."""
    if heads == 1:
        return t
    return t.view(b, heads, *t.shape[1:]).transpose(1, 2).reshape(b, t.shape[1], -1)


def _offset_projected_plain(x, w_qk, w_v, b_v, heads, eps):
    """:func:`offset_projected` as the mixer computed it: two ``F.linear`` on the rows, then
    :func:`offset_attention` (the plain ops under torch.compile, its float32 kernel under autocast)."""
    b, n, _ = x.shape
    rows = _rows(x)  # (B N, C)
    qk = F.linear(rows, w_qk).view(b, n, heads, -1).transpose(1, 2)  # (B, h, N, d)
    v = F.linear(rows, w_v, b_v).view(b, n, heads, -1).transpose(1, 2)  # (B, h, N, d_v)
    return offset_attention(qk, qk, v, eps).transpose(1, 2).reshape(b, n, -1)  # (B, N, h d_v)


class OffsetProjected(torch.autograd.Function):
    """:func:`offset_projected` as one function: apply(x, w_qk, w_v, b_v, heads, eps, half).

    Forward: qkv = x [W_qk; W_v]^T (one product; + b_v on v's columns), then :class:`OffsetFull`'s forward on the
    (B h) matrices. Backward: OffsetFull's, with q = k: dqk = dS qk + dS^T qk (one product and one accumulating
    product, written into the qk columns of one (B N, d_qk + C_v) gradient), dv = A dU into its v columns; then
    dx = dqkv [W_qk; W_v] and d[W_qk; W_v] = dqkv^T x, one product each, and db_v = the v columns' sum.

    ``half`` (autocast's dtype, or None): the products of the projections and of their gradients in it, as autocast
    runs ``nn.Linear``, the attention between in float32 (:func:`float32_kernel`), the output in it, as the plain
    form returns it. ``create_graph`` (a gradient penalty) differentiates the plain ops, recomputed (under autocast
    where the forward was).
    """

    @staticmethod
    def forward(ctx, x, w_qk, w_v, b_v, heads, eps, half):
        b, n, _ = x.shape
        d_qk = w_qk.shape[0]
        with autocast_off(x.device.type):  # the casts below are the only ones
            rows = _rows(x)  # (B N, C)
            weight = torch.cat([w_qk, w_v])  # (d_qk + C_v, C)
            if half is not None:  # the projections in autocast's dtype, the kernel in float32
                rows, weight = rows.to(half), weight.to(half)
            qkv = torch.mm(rows, weight.t())  # (B N, d_qk + C_v)
            if half is not None:
                qkv = qkv.float()
            if b_v is not None:
                qkv[:, d_qk:].add_(b_v)  # in place on the view (``qkv[...] += b_v`` copies it back into itself)
            qk, v = _heads(qkv[:, :d_qk], b, n, heads), _heads(qkv[:, d_qk:], b, n, heads)  # (B h, N, d | d_v)
            attn = torch.softmax(torch.bmm(qk, qk.transpose(1, 2)), dim=-1)  # (B h, N, N)
            denom = attn.sum(dim=1).add_(eps)  # (B h, N): eps + each column's sum over the queries
            out = torch.bmm(attn.transpose(1, 2), v).div_(denom.unsqueeze(-1))  # (B h, N, d_v): A^T v / D
        ctx.save_for_backward(x, w_qk, w_v, b_v, rows, weight, qk, v, attn, denom, out)
        ctx.heads, ctx.eps, ctx.half = heads, eps, half
        merged = _merge_heads(out, b, heads)  # (B, N, h d_v)
        return merged if half is None else merged.to(half)

    @staticmethod
    def backward(ctx, grad):
        x, w_qk, w_v, b_v, rows, weight, qk, v, attn, denom, out = ctx.saved_tensors
        heads, eps, half = ctx.heads, ctx.eps, ctx.half
        if torch.is_grad_enabled():  # create_graph: the plain ops' graph, recomputed
            def plain(x, w_qk, w_v, b_v=None):  # b_v is not among the inputs where there is none
                with torch.autocast(x.device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                    return _offset_projected_plain(x, w_qk, w_v, b_v, heads, eps)

            inputs = (x, w_qk, w_v) if b_v is None else (x, w_qk, w_v, b_v)
            return (*recomputed_grads(plain, grad, inputs), *[None] * (7 - len(inputs)))
        with autocast_off(x.device.type):
            return OffsetProjected._backward(ctx, grad.to(out.dtype), x, w_qk, b_v, rows, weight, qk, v, attn,
                                             denom, out)

    @staticmethod
    def _backward(ctx, grad, x, w_qk, b_v, rows, weight, qk, v, attn, denom, out):
        heads = ctx.heads
        b, n, _ = x.shape
        d_qk = w_qk.shape[0]
        g = _heads(grad.reshape(b * n, -1), b, n, heads)  # (B h, N, d_v)
        d_u, d_logits = _offset_map_backward(g, v, attn, denom, out)  # (B h, N, d_v), (B h, N, N)
        d_qkv = out.new_empty(b * n, weight.shape[0])  # (B N, d_qk + C_v): both projections' gradients
        if heads == 1:  # written in place: the column blocks of d_qkv, viewed (B, N, .)
            d_qk_out, d_v_out = _heads(d_qkv[:, :d_qk], b, n, 1), _heads(d_qkv[:, d_qk:], b, n, 1)
            torch.bmm(d_logits, qk, out=d_qk_out)  # dS qk, then + dS^T qk (out=, not baddbmm_: the FLOP counter
            torch.baddbmm(d_qk_out, d_logits.transpose(1, 2), qk, out=d_qk_out)  # counts no in-place baddbmm_)
            torch.bmm(attn, d_u, out=d_v_out)  # A dU
        else:  # (B h, N, .) products copied into the column blocks, viewed (B, N, h, .)
            d_qk_heads = torch.baddbmm(torch.bmm(d_logits, qk), d_logits.transpose(1, 2), qk)
            for cols, t in ((slice(None, d_qk), d_qk_heads), (slice(d_qk, None), torch.bmm(attn, d_u))):
                d_qkv[:, cols].view(b, n, heads, -1).copy_(t.view(b, heads, n, -1).transpose(1, 2))
        d_b_v = d_qkv[:, d_qk:].sum(0) if b_v is not None and ctx.needs_input_grad[3] else None
        products = d_qkv if ctx.half is None else d_qkv.to(ctx.half)  # as the projections ran
        dx = torch.mm(products, weight).view(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None  # (B, N, C)
        d_w_qk = d_w_v = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            d_w = torch.mm(products.t(), rows).to(w_qk.dtype)  # (d_qk + C_v, C)
            d_w_qk, d_w_v = d_w.split([d_qk, weight.shape[0] - d_qk])
        return dx, d_w_qk, d_w_v, d_b_v, None, None, None


class OffsetChunked(torch.autograd.Function):
    """:func:`offset_attention` over chunks of ``rows`` queries, never holding the (N, M) map; apply(q, k, v, eps,
    rows).

    Each query's softmax row needs only its own row, and the column sums c_j are sums over the rows, so
    one pass over the chunks accumulates both c and U = A^T v; out_j = U_j / (eps + c_j) (the division
    moved after the sum: equal in exact arithmetic, about 1e-16 relative apart in float64). Backward, with
    D = eps + c and G the output's gradient: dU = G / D and dD_j = -(G_j . out_j) / D_j; per chunk of rows,
    recomputing A: dv = A dU, dA_ij = v_i . dU_j + dD_j, dS = A (dA - rowsum(A dA)) (softmax's backward, row by
    row), dq = dS k, dk += dS^T q. Every tensor is (rows, M) or (N or M, d): memory O((N + M) d + rows M).

    ``create_graph`` (a gradient penalty) differentiates the plain ops of the same chunked passes
    (:func:`_offset_chunked_plain`), recomputed from the inputs: autograd's graph of them keeps every chunk's
    (rows, M) map, so the second derivative takes O(N M) memory, as the full form's does.
    """

    @staticmethod
    def forward(ctx, q, k, v, eps, rows):
        n = q.shape[-2]
        kt = k.transpose(-2, -1)  # (B, h, d, M)
        colsum = q.new_zeros(*k.shape[:-1])  # (B, h, M)
        out = v.new_zeros(*k.shape[:-1], v.shape[-1])  # (B, h, M, d_v)
        out_3d = out.view(-1, *out.shape[-2:])  # (B h, M, d_v)
        for i in range(0, n, rows):  # one pass: the division by the column sums comes after both sums
            attn = torch.softmax(q[..., i:i + rows, :] @ kt, dim=-1)  # (B, h, rows, M)
            colsum += attn.sum(dim=-2)
            out_3d.baddbmm_(attn.flatten(0, 1).transpose(1, 2), v[..., i:i + rows, :].flatten(0, 1))  # += A^T v
        out /= (colsum + eps).unsqueeze(-1)
        ctx.save_for_backward(q, k, v, colsum, out)
        ctx.eps, ctx.rows = eps, rows
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph: the plain ops' graph, recomputed
            q, k, v = ctx.saved_tensors[:3]
            plain = functools.partial(_offset_chunked_plain, eps=ctx.eps, rows=ctx.rows)
            with autocast_off(grad.device.type):
                return (*recomputed_grads(plain, grad, (q, k, v)), None, None)
        with autocast_off(grad.device.type):  # in float32 as the forward (float32_kernel), also
            return OffsetChunked._backward(ctx, grad)  # when the caller's backward is under autocast

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, colsum, out = ctx.saved_tensors
        denom = (colsum + ctx.eps).unsqueeze(-1)  # (B, h, M, 1)
        d_u = grad / denom  # (B, h, M, d_v)
        d_denom = -(grad * out).sum(-1, keepdim=True) / denom  # (B, h, M, 1)
        d_u_t, d_denom_t, kt = d_u.transpose(-2, -1), d_denom.transpose(-2, -1), k.transpose(-2, -1)
        dq, dv = torch.empty_like(q), torch.empty_like(v)
        dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)  # contiguous, whatever k's strides
        dk_3d = dk.view(-1, *dk.shape[-2:])  # (B h, M, d)
        for i in range(0, q.shape[-2], ctx.rows):
            qc, vc = q[..., i:i + ctx.rows, :], v[..., i:i + ctx.rows, :]  # (B, h, rows, d), (B, h, rows, d_v)
            attn = torch.softmax(qc @ kt, dim=-1)  # (B, h, rows, M)
            dv[..., i:i + ctx.rows, :] = attn @ d_u
            d_attn = torch.baddbmm(d_denom_t.flatten(0, 1), vc.flatten(0, 1), d_u_t.flatten(0, 1)) \
                .view_as(attn)  # (B, h, rows, M): v_i . dU_j + dD_j
            # dS = A (dA - rowsum(A dA)) in one op: three passes over the (rows, M) chunk where the mul + sum, the
            # subtraction and the product took eight (at N = 65,536 a chunk is 128 MiB, past a GPU's L2)
            d_logits = torch._softmax_backward_data(d_attn, attn, -1, attn.dtype)
            dq[..., i:i + ctx.rows, :] = d_logits @ k
            dk_3d.baddbmm_(d_logits.flatten(0, 1).transpose(1, 2), qc.flatten(0, 1))  # += dS^T q
        return dq, dk, dv, None, None


def _offset_chunked_plain(q, k, v, eps, rows):
    """:class:`OffsetChunked`'s forward as plain differentiable ops (no in-place accumulation), for its
    ``create_graph`` backward: the column sums and A^T v summed over chunks of ``rows`` queries, then divided."""
    kt = k.transpose(-2, -1)  # (B, h, d, M)
    colsum, u = 0, 0
    for i in range(0, q.shape[-2], rows):
        attn = torch.softmax(q[..., i:i + rows, :] @ kt, dim=-1)  # (B, h, rows, M)
        colsum = colsum + attn.sum(dim=-2)  # (B, h, M)
        u = u + attn.transpose(-2, -1) @ v[..., i:i + rows, :]  # (B, h, M, d_v): += A^T v
    return u / (colsum + eps).unsqueeze(-1)  # (B, h, M, d_v)


@float32_kernel
def external_attention(q, mem_k, mem_v, eps: float = 1e-9, dropout: float = 0.0, training: bool = False):
    """External attention (Guo et al., 2021) with double normalisation.

    A = q M_k^T over S memory slots, softmax over the N tokens, then each
    token's row divided by (eps + its sum over the S slots); output = A M_v.
    q (B, h, N, d), mem_k and mem_v (S, d), shared by all heads -> (B, h, N, d).
    ``dropout`` drops entries of the normalised A in training (EAMLP's ``attn_drop``).

    A is held as its transpose (B, h, S, N), so that the softmax over the N tokens runs along the contiguous last
    dimension. Over dim -2 of (B, h, N, S), torch's CUDA softmax takes its "spatial" kernel, made for a short
    softmax dimension and a long inner one: it spreads its blocks over B h and the S slots only (one block at
    B = h = 1, S = 64, for all N = 65,536 tokens; the H200 measured external at 11% of the machine's bound, 11 ms
    forward + backward). Along the last dim one block reduces each of the B h S rows. The matrix products take the
    transposes as they are (no copy). Not timed on a GPU in this form yet.
    """
    # External attention is offset attention with the memory's slots as the queries and the tokens as the keys:
    # softmax over the tokens, then each token's column divided by its sum over the slots, out_n = sum_s A_sn M_v[s]
    # / D_n. So it takes OffsetFull's written-out backward (the memories expanded over (B, h): their gradients
    # summed by the expansion's backward), which divides the (N, d_v) output where the plain ops divide the (S, N)
    # map: the smaller wins (on the CPU at N = 65,536, S = 64: 1.3x forward + backward at d_v = 64, 0.97x at
    # d_v = 256). Under torch.compile inductor fuses the plain ops itself.
    if (dropout and training) or mem_v.shape[-1] > mem_k.shape[0] or torch.compiler.is_compiling():
        return _external_plain(q, mem_k, mem_v, eps, dropout, training)
    lead = q.shape[:-2]
    return OffsetFull.apply(mem_k.expand(*lead, *mem_k.shape), q, mem_v.expand(*lead, *mem_v.shape), eps)


def _external_plain(q, mem_k, mem_v, eps, dropout=0.0, training=False):
    """:func:`external_attention` as plain differentiable ops."""
    attn = torch.softmax(mem_k @ q.transpose(-1, -2), dim=-1)  # (B, h, S, N), normalised over tokens
    attn = attn / (eps + attn.sum(dim=-2, keepdim=True))  # then over slots
    attn = F.dropout(attn, dropout, training) if dropout else attn
    return attn.transpose(-1, -2) @ mem_v  # (B, h, N, d)


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., n, k) @ b (..., k, m) -> (..., n, m), as one ``bmm`` over the flattened leading dims where they are
    equal: ``matmul`` on tensors of more than three dims wraps the product in about ten more dispatched ops (its
    expands and reshapes, forward and backward), host time a small N's step is bound by on a GPU. Broadcast
    leading dims go to ``matmul``."""
    lead = a.shape[:-2]
    if a.dim() < 3 or lead != b.shape[:-2]:
        return a @ b
    if a.dim() == 3:
        return torch.bmm(a, b)
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))  # (prod(...), n, m)
    return out.view(*lead, *out.shape[-2:])


@float32_kernel
def taylor_linear_attention(q, k, v, eps: float = 1e-6):
    """LAM (Li et al., 2021): softmax approximated by its first-order Taylor expansion.

    sim(q, k) = 1 + q^T k with q and k L2-normalised, so
    out_i = (sum_j v_j + q_i (K^T V)) / (M + q_i . (sum_j k_j + eps)), in O(N + M).
    """
    return _linear_attention(q, k, v, eps, taylor=True)


@float32_kernel
def elu_linear_attention(q, k, v, eps: float = 1e-6):
    """Linear attention (Katharopoulos et al., 2020) with phi(x) = elu(x) + 1.

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps), in O(N + M).
    """
    return _linear_attention(q, k, v, eps, taylor=False)


def _linear_attention(q, k, v, eps, taylor):
    if torch.compiler.is_compiling():  # inductor fuses the plain ops itself
        return _linear_plain(q, k, v, eps, taylor)
    return LinearAttention.apply(q, k, v, eps, taylor)


def _linear_plain(q, k, v, eps, taylor):
    """:func:`taylor_linear_attention` (``taylor``) or :func:`elu_linear_attention` as plain differentiable ops."""
    if taylor:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    else:
        q, k = F.elu(q) + 1, F.elu(k) + 1
    kv = batched_matmul(k.transpose(-2, -1), v)  # (B, h, d, d_v)
    if taylor:
        num = v.sum(dim=-2, keepdim=True) + batched_matmul(q, kv)  # (B, h, N, d_v)
        den = k.shape[-2] + batched_matmul(q, (k.sum(dim=-2) + eps).unsqueeze(-1))  # (B, h, N, 1)
        return num / den
    den = batched_matmul(q, k.sum(dim=-2).unsqueeze(-1)) + eps  # (B, h, N, 1)
    return batched_matmul(q, kv) / den  # (B, h, N, d_v)


class LinearAttention(torch.autograd.Function):
    """Both linear attentions, out = (phi(q) KV + a) / (phi(q) s + c), with a backward written out; apply(q, k, v,
    eps, taylor).

    phi is elu(x) + 1 (a = 0, s = sum_j phi(k_j), c = eps) or, ``taylor``, the L2 normalisation (a = sum_j v_j,
    s = sum_j phi(k_j) + eps, c = M). KV = phi(k)^T v and s are one (d, d_v + 1) matrix [KV | s], so that phi(q)
    is read once for numerator and denominator (one ``bmm``), and in the backward, with G the output's gradient,
    dU = [G / den | -(G . out) / den] gives d[KV | s] = phi(q)^T dU and dphi(q) = dU [KV | s]^T in one product
    each; dphi(k) = v dKV^T + ds and dv = phi(k) dKV (+ da) are one ``baddbmm`` each (the sums' gradients as their
    bias); phi's own backward is dphi * min(phi, 1) for elu (its derivative is 1 where x > 0, else exp(x) =
    phi(x)), (dphi - (y . dphi) y) / max(|x|, 1e-12) for the normalisation y = phi(x) (the norm's gradient only
    where it is not clamped, as ``F.normalize``). Autograd's chain of the plain ops (:func:`_linear_plain`) passes
    over the (N, d) tensors more often: elu's backward recomputes exp, the division's backward takes five ops,
    q goes through two products, the normalisation's backward about ten, and its gradients reach the caller's
    views of one projection contiguous, to be copied into its layout (here dq and dk are written in q's and
    k's). On the CPU (2 threads), the mixers' forward + backward at N = 65,536, C = 64 (projections included)
    went from 163 to 108 ms (elu) and from 155 to 99 ms (Taylor), 1.2-1.3x at 4,096; bytes moved fell by 7%
    (elu) and 34% (Taylor), dispatched kernels from 72 to 57 (Taylor). On a GPU these kernels are bound by
    memory at C = 64 and by their launches at small N.

    ``create_graph`` (a gradient penalty) differentiates the plain ops again, recomputed from the inputs.
    """

    @staticmethod
    def _phi(x, taylor):
        """phi(x) (R, N, d), and for Taylor what its backward needs: the reciprocal norms 1 / max(|x|, 1e-12) and
        the same where the norm is not clamped, else 0 (R, N, 1) each; None for elu (its backward needs phi)."""
        if not taylor:
            return F.elu(x).add_(1), None, None
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (R, N, 1)
        unclamped = norm > 1e-12  # F.normalize's eps: the norm's gradient flows only there
        r = norm.clamp_min_(1e-12).reciprocal_()
        return x * r, r, r * unclamped

    @staticmethod
    def forward(ctx, q, k, v, eps, taylor):
        lead, n, m, d_v = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
        q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))  # (R, N | M, d): R = prod(lead)
        pq, rq, uq = LinearAttention._phi(q3, taylor)  # (R, N, d), (R, N, 1) twice or None
        pk, rk, uk = LinearAttention._phi(k3, taylor)
        kvs = torch.empty(pk.shape[0], pk.shape[-1], d_v + 1, dtype=pk.dtype, device=pk.device)  # (R, d, d_v + 1)
        torch.bmm(pk.transpose(1, 2), v3, out=kvs[..., :d_v])  # KV
        torch.sum(pk, dim=1, out=kvs[..., d_v])  # s
        if taylor:
            kvs[..., d_v].add_(eps)
        res = torch.bmm(pq, kvs)  # (R, N, d_v + 1): [phi(q) KV | phi(q) s]
        num, den = res[..., :d_v], res[..., d_v:]  # views
        if taylor:
            num += v3.sum(dim=1, keepdim=True)  # + a
            den += m
        else:
            den += eps
        out = num / den  # (R, N, d_v)
        # res, not out: the backward's -(G . out) / den is -(G . num) / den^2, and the caller's copy of out (its heads
        # joined for the output projection) does not keep this one alive; v3 (a copy of v's heads where the batch
        # and head strides do not merge) so that the backward need not copy v again
        ctx.save_for_backward(q, k, v, v3, pq, pk, rq, rk, uq, uk, kvs, res)
        ctx.eps, ctx.taylor = eps, taylor
        return out.view(*lead, n, d_v)

    @staticmethod
    def backward(ctx, grad):
        return _float32_backward(LinearAttention._backward, ctx, grad)

    @staticmethod
    def _backward(ctx, grad, q, k, v, v3, pq, pk, rq, rk, uq, uk, kvs, res):
        taylor = ctx.taylor
        if torch.is_grad_enabled():  # create_graph: the plain ops' graph, recomputed
            return (*recomputed_grads(lambda *t: _linear_plain(*t, ctx.eps, taylor), grad, (q, k, v)), None, None)
        d_v = v.shape[-1]
        num, den = res[..., :d_v], res[..., d_v:]  # (R, N, d_v), (R, N, 1)
        d_res = torch.empty_like(res)  # (R, N, d_v + 1)
        d_num = torch.div(grad.reshape(num.shape), den, out=d_res[..., :d_v])  # G / den
        d_den = d_res[..., d_v:]
        torch.sum(d_num * num, dim=-1, keepdim=True, out=d_den).div_(den).neg_()  # -(G . out) / den
        d_kvs = torch.bmm(pq.transpose(1, 2), d_res)  # (R, d, d_v + 1): [dKV | ds]
        d_kv, d_s = d_kvs[..., :d_v], d_kvs[..., d_v:].transpose(1, 2)  # (R, d, d_v), (R, 1, d)
        dq = dk = dv = None
        if ctx.needs_input_grad[0]:
            dq = LinearAttention._phi_backward(torch.bmm(d_res, kvs.transpose(1, 2)), pq, rq, uq, q)
        if ctx.needs_input_grad[1]:
            d_pk = torch.baddbmm(d_s, v3, d_kv.transpose(1, 2))  # (R, M, d)
            dk = LinearAttention._phi_backward(d_pk, pk, rk, uk, k)
        if ctx.needs_input_grad[2]:
            d_a = d_num.sum(dim=1, keepdim=True) if taylor else None  # (R, 1, d_v)
            dv = (torch.bmm(pk, d_kv) if d_a is None else torch.baddbmm(d_a, pk, d_kv)).view(v.shape)
        return dq, dk, dv, None, None

    @staticmethod
    def _phi_backward(d_phi, phi, r, ru, x):
        """x's gradient (x's shape, in x's dimension order) from phi(x)'s (R, N, d): written in the layout of x,
        so that a caller's view of its projection (heads split off the channels) takes it back as a view, where
        a contiguous (R, N, d) gradient is copied."""
        dx = _empty_in_layout(x)
        d_phi, phi = d_phi.view(x.shape), phi.view(x.shape)
        if r is None:  # elu + 1: 1 where x > 0 (phi > 1), else exp(x) = phi
            return torch.mul(d_phi, phi.clamp(max=1), out=dx)
        # the normalisation y = x r: dx = dy r - (y . dy) r y, the second term only where |x| is not clamped
        w = (phi * d_phi).sum(dim=-1, keepdim=True).mul_(ru.view(*x.shape[:-1], 1))  # (..., N, 1)
        return torch.addcmul(d_phi.mul_(r.view(*x.shape[:-1], 1)), w, phi, value=-1, out=dx)


def _empty_in_layout(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised dense tensor of t's shape whose dimensions lie in memory in t's order (by stride), also
    where t has gaps (a view of some channels of a projection), where ``empty_like`` falls back to row-major."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))  # outermost first
    dense = torch.empty([t.shape[i] for i in order], dtype=t.dtype, device=t.device)
    return dense.permute(*sorted(range(t.dim()), key=order.__getitem__))

@float32_kernel
def focal_attention(q, k, v, mask=None, bias=None, scale: float | None = None):
    """Focal self-attention's kernel (Yang et al., 2021): softmax attention of a group of queries
    over the keys gathered for that group (fine tokens and pooled tokens of every level).

    softmax(q k^T * scale + bias) v, scale = d^-0.5 by default, one softmax over all M keys;
    entries where ``mask`` is False are left out of the softmax (every row must keep one).
    Leading dimensions are free: q (..., Q, d), k (..., M, d), v (..., M, d_v) -> (..., Q, d_v),
    e.g. (B, heads, windows, window area, d) queries against (B, heads, windows, M, d) keys;
    ``bias`` (float) and ``mask`` (bool) broadcast to (..., Q, M).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = batched_matmul(q * scale, k.transpose(-2, -1))  # (..., Q, M)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return batched_matmul(torch.softmax(logits, dim=-1), v)  # (..., Q, d_v)


# --------------------------------------------------------------------------------------------
# Multi-scale dilated attention (DilateFormer, Jiao et al., 2023)
# --------------------------------------------------------------------------------------------

DILATED_BORDERS = ("zeros", "mask")


@float32_kernel
def dilated_attention(q, k, v, grid: tuple[int, int], kernel_size: int = 3, dilation: int | Sequence[int] = 1,
                      border: str = "zeros", scale: float | None = None):
    """DilateFormer's sliding-window dilated attention (DilateAttention) on a grid.

    q, k (B, heads, N, d) and v (B, heads, N, d_v) hold the pixels of an
    h x w ``grid = (h, w)`` in row-major order (N = h * w). The query at (i, j)
    attends to the k x k keys at (i + p*r, j + q*r), |p|, |q| <= k // 2
    (k = ``kernel_size``, odd; r = ``dilation``), with logits q.k * scale
    (scale = d^-0.5 by default) and a softmax over those k*k keys. A sequence of
    rates splits the heads into that many equal groups, group g at rate
    ``dilation[g]`` (DilateFormer's multi-scale attention in one call: one launch
    of each kernel on a GPU, not one per group).

    ``border`` says what a key outside the grid is: "zeros" (the paper's zero
    padding, as ``nn.Unfold`` does it: a zero key and value with logit 0 that
    still takes part in the softmax) or "mask" (left out of the softmax).
    Returns (B, heads, N, d_v).

    Unlike the reference's ``nn.Unfold``, which copies K and V k*k times, the
    kernel multiplies shifted views of K and V; its custom backward saves only
    q, k, v and the (k*k)-wide attention map. Forward and backward allocate what
    they return (the output, the attention map; dq, dk, dv) and buffers for one
    chunk of (sample, head) pairs (``DILATED_CHUNK_BYTES``), never a temporary
    of q's size, and never copy strided q, k, v or upstream gradients (issue 20).
    On a GPU, float32 tensors (half precision too, upcast) take fused Triton kernels instead
    (:mod:`attention.dilated_triton`: one launch forward and two backward, deterministic, where the torch kernel
    launches a few per window offset: issue 28); float64 and the CPU keep the torch kernel (``DILATED_BACKEND``).
    It is a ``torch.library`` op with a FLOP formula, so ``torch.utils.flop_counter``
    counts it (2 FLOPs per multiply-add over all k*k window positions, as the
    unfold form computes them).
    """
    if border not in DILATED_BORDERS:
        raise ValueError(f"dilated_attention: border={border!r}, expected one of {DILATED_BORDERS}.")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"dilated_attention: kernel_size={kernel_size}, expected an odd integer >= 1.")
    rates = _dilated_rates(dilation, q.shape[1])
    h, w = grid
    n = q.shape[-2]
    if h * w != n or k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"dilated_attention: grid {h}x{w} holds {h * w} tokens; q, k, v hold "
                         f"{n}, {k.shape[-2]}, {v.shape[-2]}.")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    run = _DilatedFunction.apply if skips_dispatch(q, k, v) else _dilated_op
    out, _ = run(q, k, v, h, w, kernel_size, rates, border == "mask", scale)
    return out  # (B, heads, N, d_v)


def _dilated_rates(dilation, heads: int) -> list[int]:
    """The rates of :func:`dilated_attention`'s head groups, as a list (the op's ``dilations``), checked."""
    rates = [dilation] if isinstance(dilation, int) else list(dilation)
    if not rates or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in rates):
        raise ValueError(f"dilated_attention: dilation={dilation!r}, expected an integer >= 1 or a non-empty "
                         "sequence of them (one per head group).")
    if heads % len(rates):
        raise ValueError(f"dilated_attention: {heads} heads do not split into {len(rates)} equal groups, one per "
                         f"rate of dilation={dilation!r}.")
    return rates


def _dilated_groups(heads: int, dilations) -> list[tuple[slice, int]]:
    """(head slice, rate) of each head group: ``dilations`` an int (one group) or a sequence of rates."""
    rates = [dilations] if isinstance(dilations, int) else list(dilations)
    per = heads // len(rates)
    return [(slice(g * per, (g + 1) * per), int(r)) for g, r in enumerate(rates)]


def _dilated_windows(h: int, w: int, kernel_size: int, dilation: int):
    """The k*k window offsets of a dilated window, as a list of (o, query slices, key slices), the centre first.

    Offset o = (p + k//2) * k + (q + k//2) pairs the query at (i, j) with the
    key at (i + p*r, j + q*r). The query slices select the queries whose key
    lies inside the grid, the key slices those keys: two same-shaped views, no
    copy. Offsets with no key inside the grid are left out. The centre (every
    query with its own key) covers the whole grid: a sum over the offsets
    writes it first and needs no zero-filled buffer (:func:`_dilated_weighted_sum`).
    """
    half = kernel_size // 2
    windows = []
    for a in range(kernel_size):
        dy = (a - half) * dilation
        rows = slice(max(0, -dy), min(h, h - dy))
        if rows.start >= rows.stop:
            continue
        for b in range(kernel_size):
            dx = (b - half) * dilation
            cols = slice(max(0, -dx), min(w, w - dx))
            if cols.start >= cols.stop:
                continue
            windows.append((a * kernel_size + b, (rows, cols),
                            (slice(rows.start + dy, rows.stop + dy), slice(cols.start + dx, cols.stop + dx))))
    return sorted(windows, key=lambda window: window[0] != half * kernel_size + half)  # stable: the centre first


DILATED_CHUNK_BYTES = 2 ** 20
"""On the CPU, the most bytes one chunk's slice of q (or k, v, the upstream gradient) holds in the dilated kernels,
at least one (sample, head): about a core's L2 cache. On the 2-core CPU machine (one thread; 56 x 56 and 64 x 64
grids, d = 24 and 32) 1-2 MiB chunks ran forward + backward fastest, ~1.2-1.4x faster than one chunk of everything
or than chunks of one (sample, head); each chunk adds its buffers, ~1.2 chunks' bytes, to the peak memory."""
DILATED_CHUNK_BYTES_ACCELERATOR = 2 ** 26
"""The same on other devices (CUDA): each op of a chunk is one kernel launch, so chunks are large enough to fill the
device, and still bound the temporaries for large inputs. Not tuned: no GPU was available."""


def _dilated_chunks(batch: int, heads: int, pair_bytes: int, device: torch.device):
    """Chunks of (sample, head) pairs, as (batch slice, head slice), of at most DILATED_CHUNK_BYTES each on the CPU
    (DILATED_CHUNK_BYTES_ACCELERATOR elsewhere), counting one pair as ``pair_bytes``.

    A query attends only to keys of its own sample and head, so the kernels run chunk by chunk: every
    intermediate (a product q * k, the gradient of the attention map) then has one chunk's size, not the whole
    tensor's, and a chunk's q, k, v are re-read from cache by the k*k window offsets instead of from memory.
    Whole samples where one fits (contiguous slices of the attention map), else heads of one sample.
    """
    budget = DILATED_CHUNK_BYTES if device.type == "cpu" else DILATED_CHUNK_BYTES_ACCELERATOR
    pairs = max(1, budget // max(1, pair_bytes))
    if pairs >= heads:
        step = pairs // max(1, heads)
        for b in range(0, batch, step):
            yield slice(b, min(batch, b + step)), slice(0, heads)
    else:
        for b in range(batch):
            for h0 in range(0, heads, pairs):
                yield slice(b, b + 1), slice(h0, min(heads, h0 + pairs))


def _dilated_group_chunks(batch: int, heads: int, dilations, pair_bytes: int, device) -> list:
    """:func:`_dilated_chunks` within each head group (:func:`_dilated_groups`), as (batch slice, head slice,
    rate): a chunk's heads share one rate."""
    return [(bs, slice(group.start + hs.start, group.start + hs.stop), r)
            for group, r in _dilated_groups(heads, dilations)
            for bs, hs in _dilated_chunks(batch, group.stop - group.start, pair_bytes, device)]


def _dilated_outside(windows, kernel_size: int, h: int, w: int, device) -> torch.Tensor:
    """(k*k, h, w) bool: where the key at window offset o of the query at (i, j) lies outside the grid, for the
    rate's ``windows`` (:func:`_dilated_windows`; border "mask": the centre key never does)."""
    inside = torch.zeros(kernel_size ** 2, h, w, dtype=torch.bool, device=device)
    for o, (qi, qj), _ in windows:
        inside[o, qi, qj] = True
    return ~inside


def _dilated_dots(x, y, windows, out, buf):
    """out[:, :, o, i, j] = x[:, :, i, j] . y[:, :, i + p*r, j + q*r] for each window offset o.

    x, y (b, H', h, w, d) are views of one chunk, out (b, H', k*k, h, w); the products go into ``buf``, a flat
    buffer of at least x.numel() elements, and are summed straight into ``out``'s slice: no allocation.
    (``torch.linalg.vecdot`` would allocate the whole product, as large as x, for every offset.)
    """
    for o, (qi, qj), (ki, kj) in windows:
        xs = x[:, :, qi, qj]  # (b, H', rows, cols, d): the queries whose key at offset o is inside the grid
        prod = buf[:xs.numel()].view(xs.shape)
        torch.mul(xs, y[:, :, ki, kj], out=prod)
        torch.sum(prod, dim=-1, out=out[:, :, o, qi, qj])


def _dilated_weighted_sum(dst, weights, src, windows, to_keys: bool = False):
    """dst = the sum over window offsets o of weights[:, :, o] * src shifted by o, written into ``dst``.

    weights (b, H', k*k, h, w) hold one weight per query and offset; dst and src are (b, H', h, w, .) views of
    one chunk. to_keys=False: dst at the queries, src at their keys (the output from v, dq from k);
    to_keys=True: dst at the keys, src at the queries (dv from the upstream gradient, dk from q). The first
    window, the centre, covers every position and writes dst: no zero fill, no temporary.
    """
    for n, (o, (qi, qj), (ki, kj)) in enumerate(windows):
        (di, dj), (si, sj) = ((ki, kj), (qi, qj)) if to_keys else ((qi, qj), (ki, kj))
        weight = weights[:, :, o, qi, qj].unsqueeze(-1)  # (b, H', rows, cols, 1): each query's weight
        if n == 0:
            torch.mul(weight, src[:, :, si, sj], out=dst[:, :, di, dj])
        else:
            dst[:, :, di, dj].addcmul_(weight, src[:, :, si, sj])


_LIB = torch.library.Library("attention_suite", "FRAGMENT")
# torch.library.define + impl rather than torch.library.custom_op: a custom_op's kernel is wrapped in
# torch._dynamo.disable, whose first call imports torch._dynamo (and sympy), ~70 MiB of resident memory and
# ~0.5 s that a process without torch.compile would pay for its first dilated attention. A kernel registered
# with impl runs as it is; under torch.compile the op is a leaf of the graph either way (register_fake).
_LIB.define("dilated_attention(Tensor q, Tensor k, Tensor v, SymInt h, SymInt w, SymInt kernel_size, "
            "SymInt[] dilations, bool mask, float scale) -> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("dilated_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor attn, SymInt h, "
            "SymInt w, SymInt kernel_size, SymInt[] dilations, float scale) -> (Tensor, Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))


DILATED_BACKEND = "auto"
"""Which kernel runs :func:`dilated_attention` (forward and backward): "auto" runs the fused Triton kernels
(:mod:`attention.dilated_triton`) on float32 CUDA tensors where Triton works and the torch kernel otherwise (CPU,
float64); "torch" always the torch kernel; "triton" always the Triton kernels, on any device (CPU tensors under
``TRITON_INTERPRET=1``: the tests), and a kernel that fails then raises instead of handing over to torch."""
# The Triton kernels' family (attention.triton_kernels: imported when wanted, off for the process once one failed).
DILATED_KERNELS = Kernels("attention.dilated_triton", "dilated_attention", "the torch kernel")


def _dilated_backend(tensors, backend: str | None) -> str:
    """"triton" or "torch": the kernel that ``backend`` (None: ``DILATED_BACKEND``) picks for these tensors."""
    return DILATED_KERNELS.pick(DILATED_BACKEND if backend is None else backend, tensors, (torch.float32,))


def _dilated_forward(q, k, v, h, w, kernel_size, dilation, mask, scale, backend=None):
    """Forward of :func:`dilated_attention`: the output and the attention map (B, heads, k*k, h, w).

    The op's kernel: the fused Triton kernel where ``backend`` (None: ``DILATED_BACKEND``) picks it
    (:func:`_dilated_backend`), else :func:`_dilated_forward_torch`.
    """
    if _dilated_backend((q, k, v), backend) == "triton":
        result = DILATED_KERNELS.call("forward", q, k, v, h, w, kernel_size, dilation, mask, scale,
                                      fallback=(DILATED_BACKEND if backend is None else backend) == "auto")
        if result is not None:
            return result
    return _dilated_forward_torch(q, k, v, h, w, kernel_size, dilation, mask, scale)


def _dilated_forward_torch(q, k, v, h, w, kernel_size, dilation, mask, scale):
    """:func:`_dilated_forward` in torch ops, a few launches per window offset (the CPU, float64, no Triton); small
    inputs gather the windows instead (:data:`DILATED_GATHER_ELEMENTS`).

    Allocates only what it returns, and one chunk's product buffer (:func:`_dilated_chunks`): the logits are
    computed in the attention map's memory and turned into weights there (softmax in place).
    """
    if _dilated_gathers(q, v, kernel_size):
        return _dilated_forward_gathered(q, k, v, h, w, kernel_size, dilation, mask, scale)
    B, H = q.shape[:2]
    d, d_v = q.shape[-1], v.shape[-1]
    qg, kg, vg = (t.reshape(B, H, h, w, t.shape[-1]) for t in (q, k, v))  # (B, H, h, w, .): views (one dim split)
    attn = q.new_empty(B, H, kernel_size ** 2, h, w)  # the logits, then the weights
    out = v.new_empty(B, H, h, w, d_v)
    chunks = _dilated_group_chunks(B, H, dilation, h * w * max(d, d_v) * q.element_size(), q.device)
    pairs = max(((bs.stop - bs.start) * (hs.stop - hs.start) for bs, hs, _ in chunks), default=0)  # 0: no tensor
    buf = q.new_empty(pairs * h * w * d)  # one chunk's products q * k
    windows, outside = {}, {}  # per rate
    for bs, hs, r in chunks:
        if r not in windows:
            windows[r] = _dilated_windows(h, w, kernel_size, r)
            outside[r] = _dilated_outside(windows[r], kernel_size, h, w, q.device) if mask else None
        a = attn[bs, hs]  # (b, H', k*k, h, w)
        a.zero_()  # a key outside the grid is a zero vector: logit 0
        _dilated_dots(qg[bs, hs], kg[bs, hs], windows[r], a, buf)
        a.mul_(scale)
        if mask:  # keys outside the grid leave the softmax
            a.masked_fill_(outside[r], float("-inf"))
        a.sub_(a.amax(dim=2, keepdim=True)).exp_()  # softmax over the k*k keys, in place
        a.div_(a.sum(dim=2, keepdim=True))
        _dilated_weighted_sum(out[bs, hs], a, vg[bs, hs], windows[r])  # zero values outside the grid add nothing
    return out.view(B, H, h * w, d_v), attn


def _dilated_backward(grad, q, k, v, attn, h, w, kernel_size, dilation, scale, backend=None):
    """Gradients of :func:`dilated_attention` w.r.t. q, k, v from the upstream gradient and the forward's
    attention map: the fused Triton kernels where ``backend`` picks them (as in :func:`_dilated_forward`), else
    :func:`_dilated_backward_torch`."""
    if _dilated_backend((grad, q, k, v, attn), backend) == "triton":
        result = DILATED_KERNELS.call("backward", grad, q, k, v, attn, h, w, kernel_size, dilation, scale,
                                      fallback=(DILATED_BACKEND if backend is None else backend) == "auto")
        if result is not None:
            return result
    return _dilated_backward_torch(grad, q, k, v, attn, h, w, kernel_size, dilation, scale)


def _dilated_backward_torch(grad, q, k, v, attn, h, w, kernel_size, dilation, scale):
    """:func:`_dilated_backward` in torch ops, recomputing the shifted products; small inputs gather the windows
    instead (:data:`DILATED_GATHER_ELEMENTS`).

    Allocates only dq, dk, dv and one chunk's buffers (the products grad * v, the attention map's gradient):
    the whole (B, heads, k*k, h, w) gradient of the attention map never exists at once.
    """
    if _dilated_gathers(q, v, kernel_size):
        return _dilated_backward_gathered(grad, q, k, v, attn, h, w, kernel_size, dilation, scale)
    B, H = q.shape[:2]
    d, d_v = q.shape[-1], v.shape[-1]
    qg, kg, vg, gg = (t.reshape(B, H, h, w, t.shape[-1]) for t in (q, k, v, grad))  # (B, H, h, w, .): views
    dq, dk, dv = qg.new_empty(qg.shape), kg.new_empty(kg.shape), vg.new_empty(vg.shape)  # (B, H, h, w, .)
    chunks = _dilated_group_chunks(B, H, dilation, h * w * max(d, d_v) * q.element_size(), q.device)
    pairs = max(((bs.stop - bs.start) * (hs.stop - hs.start) for bs, hs, _ in chunks), default=0)  # 0: no tensor
    buf = q.new_empty(pairs * h * w * d_v)  # one chunk's products grad * v
    dattn_buf = q.new_empty(pairs * kernel_size ** 2 * h * w)  # one chunk's gradient of the attention map
    rates = {r: _dilated_windows(h, w, kernel_size, r) for _, _, r in chunks}
    for bs, hs, r in chunks:
        windows = rates[r]
        a, g_c, q_c, k_c = attn[bs, hs], gg[bs, hs], qg[bs, hs], kg[bs, hs]  # a: (b, H', k*k, h, w)
        da = dattn_buf[:a.numel()].view(a.shape).zero_()  # keys outside the grid have zero values: dattn 0
        _dilated_dots(g_c, vg[bs, hs], windows, da, buf)
        _dilated_weighted_sum(dv[bs, hs], a, g_c, windows, to_keys=True)
        # softmax backward in place: dlogits = attn * dattn - attn * sum_o(attn * dattn), times the scale
        da.mul_(a)
        da.addcmul_(a, da.sum(dim=2, keepdim=True), value=-1).mul_(scale)
        _dilated_weighted_sum(dq[bs, hs], da, k_c, windows)
        _dilated_weighted_sum(dk[bs, hs], da, q_c, windows, to_keys=True)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


DILATED_GATHER_ELEMENTS = 1 << 19
"""Up to this many elements of the gathered keys (B heads N k*k max(d, d_v)), the torch kernels gather each query's
k*k keys and values by one index (:func:`_dilated_forward_gathered`) instead of looping over the window offsets:
at small N the loops' Python and dispatch were the time (about 300 ops a forward + backward with 4 rates). The
mixer's forward + backward on the CPU (2 threads, C = 64, 8 heads, 4 rates) went from 3.3 to 1.0 ms at N = 64 and
from 4.2 to 2.3 ms at N = 256; at 2^19 gathered elements the two forms take the same time, above it the offsets'
loops over cache-sized chunks (:func:`_dilated_chunks`) win (0.6x at N = 4,096) and hold no k*k copies."""


def _dilated_gathers(q, v, kernel_size: int) -> bool:
    b, heads, n, d = q.shape
    return b * heads * n * kernel_size ** 2 * max(d, v.shape[-1]) <= DILATED_GATHER_ELEMENTS


@tensor_cache(maxsize=64)
def _dilated_tables(batch: int, heads: int, h: int, w: int, kernel_size: int, rates: tuple, device: torch.device):
    """Index tables of the gathered kernels, each head at its group's rate, over (sample, head, query, offset o)
    flattened (B heads N k*k): ``keys``, the row of query's offset-o key in the keys padded with a zero row per
    (sample, head) (B heads (N + 1) rows; the zero row where the key lies outside the grid); ``queries``, the same
    for the query whose offset-o key a token is (the mirrored window); ``slots``, that query's (query, o) entry
    of a flattened (B, heads, N, k*k) map, or its last entry + 1 (a zero appended) where there is none; and
    ``outside`` (heads, N, k*k, bool), where the key lies outside the grid (border "mask")."""
    n, kk, half = h * w, kernel_size ** 2, kernel_size // 2
    a, b = torch.arange(kk) // kernel_size - half, torch.arange(kk) % kernel_size - half  # (k*k,) offsets
    i, j = torch.arange(h).repeat_interleave(w)[:, None], torch.arange(w).repeat(h)[:, None]  # (N, 1) row-major

    def token(y, x):  # (N, k*k): the token at (y, x), or n outside the grid
        return torch.where((y >= 0) & (y < h) & (x >= 0) & (x < w), y * w + x, n)

    keys, queries = [], []
    for group, r in _dilated_groups(heads, rates):
        size = group.stop - group.start
        keys.append(token(i + a * r, j + b * r).expand(size, -1, -1))  # (heads of the group, N, k*k)
        queries.append(token(i - a * r, j - b * r).expand(size, -1, -1))
    keys, queries = torch.cat(keys), torch.cat(queries)  # (heads, N, k*k)
    pair = torch.arange(batch * heads).view(batch, heads, 1, 1)  # (B, heads, 1, 1): (sample, head) pairs
    slots = torch.where(queries < n, (pair * n + queries) * kk + torch.arange(kk), batch * heads * n * kk)
    return (*(t.reshape(-1).to(device) for t in (pair * (n + 1) + keys, pair * (n + 1) + queries, slots)),
            (keys == n).to(device))


def _rate_tuple(dilation) -> tuple:
    """The kernels' ``dilation`` (one rate, or one per head group) as a tuple, the tables' cache key."""
    return (dilation,) if isinstance(dilation, int) else tuple(dilation)


def _dilated_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t (B, heads, N, c) at ``rows`` of :func:`_dilated_tables` -> (B, heads, N, k*k, c), zeros at the padding."""
    b, heads, n, c = t.shape
    padded = F.pad(t, (0, 0, 0, 1)).view(-1, c)  # (B heads (N + 1), c): a zero row after each (sample, head)
    return padded.index_select(0, rows).view(b, heads, n, -1, c)


def _dilated_forward_gathered(q, k, v, h, w, kernel_size, dilation, mask, scale):
    """:func:`_dilated_forward_torch` for small inputs (:data:`DILATED_GATHER_ELEMENTS`): a dozen ops whatever
    the window and the rates, every query's k*k keys and values gathered at once (zero vectors outside the grid,
    as the offsets' loops read them) and multiplied as (k*k, d) matrices."""
    B, H, n, _ = q.shape
    keys, _, _, outside = _dilated_tables(B, H, h, w, kernel_size, _rate_tuple(dilation), q.device)
    logits = (_dilated_rows(k, keys) @ q.unsqueeze(-1)).squeeze(-1).mul_(scale)  # (B, H, N, k*k)
    if mask:  # keys outside the grid leave the softmax
        logits.masked_fill_(outside, float("-inf"))
    attn = torch.softmax(logits, dim=-1)  # (B, H, N, k*k)
    out = (attn.unsqueeze(-2) @ _dilated_rows(v, keys)).squeeze(-2)  # (B, H, N, d_v)
    return out, attn.transpose(2, 3).contiguous().view(B, H, kernel_size ** 2, h, w)  # the map's layout


def _dilated_backward_gathered(grad, q, k, v, attn, h, w, kernel_size, dilation, scale):
    """:func:`_dilated_backward_torch` for small inputs: dq and the map's gradient from the gathered keys and
    values, dk and dv from each token's queries through the mirrored window (gathers only, no scattered sums)."""
    B, H, n, _ = q.shape
    keys, queries, slots, _ = _dilated_tables(B, H, h, w, kernel_size, _rate_tuple(dilation), q.device)
    a = attn.reshape(B, H, kernel_size ** 2, n).transpose(2, 3).contiguous()  # (B, H, N, k*k), whatever its strides
    d_attn = (_dilated_rows(v, keys) @ grad.unsqueeze(-1)).squeeze(-1)  # (B, H, N, k*k)
    d_logits = torch._softmax_backward_data(d_attn, a, -1, a.dtype).mul_(scale)  # (B, H, N, k*k)
    dq = (d_logits.unsqueeze(-2) @ _dilated_rows(k, keys)).squeeze(-2)  # (B, H, N, d)
    zero = a.new_zeros(1)
    d_logits_m, a_m = (torch.cat([t.view(-1), zero]).index_select(0, slots).view(a.shape).unsqueeze(-2)
                       for t in (d_logits, a))  # (B, H, N, 1, k*k): each token's queries' entries, 0 for none
    dk = (d_logits_m @ _dilated_rows(q, queries)).squeeze(-2)  # (B, H, N, d)
    dv = (a_m @ _dilated_rows(grad, queries)).squeeze(-2)  # (B, H, N, d_v)
    return dq, dk, dv


_LIB.impl("dilated_attention", _dilated_forward, "CompositeExplicitAutograd")
_LIB.impl("dilated_attention_backward", _dilated_backward, "CompositeExplicitAutograd")
_dilated_op = torch.ops.attention_suite.dilated_attention.default
_dilated_backward_op = torch.ops.attention_suite.dilated_attention_backward.default


@torch.library.register_fake("attention_suite::dilated_attention", lib=_LIB)
def _(q, k, v, h, w, kernel_size, dilation, mask, scale):
    B, H, N, _ = q.shape
    return v.new_empty(B, H, N, v.shape[-1]), q.new_empty(B, H, kernel_size ** 2, h, w)


@torch.library.register_fake("attention_suite::dilated_attention_backward", lib=_LIB)
def _(grad, q, k, v, attn, h, w, kernel_size, dilation, scale):
    # Contiguous, as both kernels return them: empty_like would keep the strides of a q split from a fused qkv
    # projection, and inductor's stride check then fails the compiled backward on CUDA.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dilated_plain(q, k, v, h, w, kernel_size, dilation, mask, scale):
    """:func:`dilated_attention`'s output by autograd's ops on shifted views of the zero-padded keys and values, per
    head group: what a gradient of its gradients (``create_graph``) differentiates, recomputed from the inputs
    (:func:`_dilated_grad`). Holds k*k shifted products: for that pass only."""
    B, H = q.shape[:2]
    outs = []
    for heads, r in _dilated_groups(H, dilation):
        r = min(r, max(h, w))  # the same windows: every offset but the centre lies outside (as rate_table)
        qg, kg, vg = (t[:, heads].reshape(B, -1, h, w, t.shape[-1]) for t in (q, k, v))  # (B, H', h, w, .)
        pad = (kernel_size // 2) * r
        kp, vp = (F.pad(t, (0, 0, pad, pad, pad, pad)) for t in (kg, vg))  # outside: zero keys and values
        shifts = [(a * r, b * r) for a in range(kernel_size) for b in range(kernel_size)]  # offset o = a k + b
        logits = torch.stack([(qg * kp[:, :, i:i + h, j:j + w]).sum(-1) for i, j in shifts], 2) * scale
        if mask:  # (B, H', k*k, h, w): keys outside the grid leave the softmax
            outside = _dilated_outside(_dilated_windows(h, w, kernel_size, r), kernel_size, h, w, q.device)
            logits = logits.masked_fill(outside, float("-inf"))
        weights = logits.softmax(2)
        out = sum(weights[:, :, o, ..., None] * vp[:, :, i:i + h, j:j + w] for o, (i, j) in enumerate(shifts))
        outs.append(out.flatten(2, 3))  # (B, H', N, d_v)
    return torch.cat(outs, 1)  # (B, H, N, d_v)


def _dilated_setup_context(ctx, inputs, output):
    q, k, v, h, w, kernel_size, dilation, mask, scale = inputs
    ctx.save_for_backward(q, k, v, output[1])  # the attention map, not the k*k shifted products
    ctx.mask = mask  # for the plain form only (create_graph): the map holds the mask as zero weights
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the attention map
    ctx.args = (h, w, kernel_size, dilation, scale)


def _dilated_grad(ctx, grad, grad_attn):
    if grad is None:
        return (None,) * 9
    q, k, v, attn = ctx.saved_tensors  # float32 or float64: dilated_attention upcasts half precision
    with autocast_off(q.device.type):  # a backward called under autocast stays in q's dtype
        if torch.is_grad_enabled():  # create_graph (a gradient penalty): the plain ops' graph, recomputed
            h, w, kernel_size, dilation, scale = ctx.args
            plain = lambda *t: _dilated_plain(*t, h, w, kernel_size, dilation, ctx.mask, scale)  # noqa: E731
            return (*recomputed_grads(plain, grad.to(q.dtype), (q, k, v)), None, None, None, None, None, None)
        # the kernel itself (as the eager forward), or the op where a mode must see it
        direct = skips_dispatch(grad, q)
        with below_autograd() if direct else contextlib.nullcontext():
            dq, dk, dv = (_dilated_backward if direct else _dilated_backward_op)(grad.to(q.dtype), q, k, v, attn,
                                                                                *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


def _dilated_double_grad(ctx, *grads):
    raise RuntimeError("dilated_attention_backward: not differentiable; a gradient of dilated_attention's gradients "
                       "(create_graph) differentiates the plain ops instead (recomputed_grads).")


torch.library.register_autograd("attention_suite::dilated_attention", _dilated_grad,
                                setup_context=_dilated_setup_context, lib=_LIB)
# The backward op's own autograd kernel: with create_graph=True its kernel runs below autograd (its in-place and
# out= ops would refuse inputs that require grad) and the gradients it returns fail only if differentiated again.
torch.library.register_autograd("attention_suite::dilated_attention_backward", _dilated_double_grad, lib=_LIB)

_DilatedFunction = _eager_function("_DilatedFunction", _dilated_forward, _dilated_setup_context, _dilated_grad)


@register_flop_formula(torch.ops.attention_suite.dilated_attention)
def _dilated_flops(q_shape, k_shape, v_shape, h, w, kernel_size, *args, out_shape=None, **kwargs):
    B, H, N, d = q_shape
    return 2 * B * H * N * kernel_size ** 2 * (d + v_shape[-1])  # q.k and attn * v per window position


@register_flop_formula(torch.ops.attention_suite.dilated_attention_backward)
def _dilated_backward_flops(grad_shape, q_shape, k_shape, v_shape, attn_shape, h, w, kernel_size, *args,
                            out_shape=None, **kwargs):
    B, H, N, d = q_shape
    return 4 * B * H * N * kernel_size ** 2 * (d + v_shape[-1])  # dattn, dv, dq, dk


# --------------------------------------------------------------------------------------------
# Attention over indexed keys (point sets: focal's neighbours and pooled tokens, dilated kNN)
# --------------------------------------------------------------------------------------------

INDEX_BACKEND = "auto"
"""Which kernel :func:`index_attention` (the point-set paths of ``focal`` and ``dilated``) runs: "auto" the fused
Triton kernels (:mod:`attention.index_attention_triton`) on float32 CUDA tensors where Triton works, and its chunked
torch kernel otherwise (CPU, float64); "torch" always the torch kernel; "triton" always the Triton kernels, on any
device (CPU tensors under ``TRITON_INTERPRET=1``: the tests), and a kernel that fails then raises instead of handing
over to torch."""
# The Triton kernels' family (attention.triton_kernels: imported when wanted, off for the process once one failed:
# the op's torch kernel then finishes the failed call and takes every later one).
INDEX_KERNELS = Kernels("attention.index_attention_triton", "index_attention", "the torch path")
# Entries (rows x M x max(C, C_v)) of the keys gathered for one chunk of rows by the op's torch kernel
# (:func:`_index_forward_torch`: the CPU's and float64's path, and wherever a Triton kernel failed). On a CPU about
# 2 MiB of float32, so that a chunk's keys, values and gradients stay in cache (focal's point path: chunks 2 and 4
# times larger ran slower); elsewhere (CUDA) large enough that the chunks' kernel launches stay few.
INDEX_CHUNK_ELEMENTS = {"cpu": 1 << 19}
INDEX_CHUNK_ELEMENTS_ELSEWHERE = 1 << 24


def index_backend(tensors, backend: str | None = None) -> str:
    """"triton" or "torch": the kernel ``backend`` (None: ``INDEX_BACKEND``) picks for these tensors in
    :func:`index_attention`. Half precision counts as float32: ``float32_kernel`` upcasts it before the op."""
    return INDEX_KERNELS.pick(INDEX_BACKEND if backend is None else backend, tensors, (torch.float32, *HALF))


def _index_fallback(backend) -> bool:
    return (INDEX_BACKEND if backend is None else backend) != "triton"


def _index_forward(q, k, v, index, heads, scale, backend=None):
    """The op's kernel: the output (R, C_v) and the log-sum-exp (R, heads) of the scaled logits, by the Triton
    kernel unless ``backend`` (None: ``INDEX_BACKEND``) is "torch" or it failed (``INDEX_KERNELS``)."""
    if index_backend((q, k, v), backend) == "triton":
        # the kernels read k[index], v[index] unchecked; torch's gathers would raise on an index out of range: an
        # asynchronous device assert does the same without waiting for the GPU (two reductions over the indices)
        torch._assert_async(((index >= 0) & (index < k.shape[0])).all(),
                            f"index_attention: an index lies outside the {k.shape[0]} key rows")
        result = INDEX_KERNELS.call("forward", q, k, v, index, heads, scale, fallback=_index_fallback(backend))
        if result is not None:
            return result
    return _index_forward_torch(q, k, v, index, heads, scale)


def _index_chunks(rows: int, m: int, width: int, device: torch.device):
    budget = INDEX_CHUNK_ELEMENTS.get(device.type, INDEX_CHUNK_ELEMENTS_ELSEWHERE)
    step = max(1, budget // max(1, m * width))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _per_table(index, heads, d, d_v):
    """G index tables (G, R, M): per table g, its heads' channel slices of q and k (d each) and of v (d_v each)
    and of lse (one each), as (table, heads per table, q/k columns, v columns, lse columns)."""
    per = heads // index.shape[0]
    return [(index[g], per, slice(g * per * d, (g + 1) * per * d), slice(g * per * d_v, (g + 1) * per * d_v),
             slice(g * per, (g + 1) * per)) for g in range(index.shape[0])]


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows t (r, C) as (r heads, 1, d): one single-row matrix per (row, head)."""
    return t.reshape(t.shape[0] * heads, 1, -1)


def _gathered(t: torch.Tensor, idx: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of t (T, C) at idx (r, M), per head: (r heads, M, d), the matrices ``bmm`` takes."""
    r, m = idx.shape
    rows = t.index_select(0, idx.reshape(-1)).view(r, m, heads, -1)  # (r, M, heads, d)
    return rows.transpose(1, 2).reshape(r * heads, m, -1)  # (r heads, M, d)


def _scatter_add_(acc: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, heads: int) -> None:
    """acc (T, C) += g (r heads, M, d) at the rows idx (r, M): the transpose of :func:`_gathered`."""
    r, m = idx.shape
    acc.index_add_(0, idx.reshape(-1), g.view(r, heads, m, -1).transpose(1, 2).reshape(r * m, -1))  # (r M, C)


def _index_forward_torch(q, k, v, index, heads, scale):
    """:func:`_index_forward` in torch ops, in chunks of rows whose keys are gathered, used and dropped; G tables
    (G, R, M) as G calls on their heads' channels. Per (row, head) the products are (1, d) x (d, M) matrices of
    one ``bmm`` (einsum over (r, M, heads, d) took contractions that copied the gathered keys around them: 6x
    slower at focal's M = 98 on the CPU)."""
    if index.dim() == 3:
        parts = [_index_forward_torch(q[:, c], k[:, c], v[:, cv], table, per, scale)
                 for table, per, c, cv, _ in _per_table(index, heads, q.shape[1] // heads, v.shape[1] // heads)]
        return torch.cat([out for out, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)
    rows, m = index.shape
    d, d_v = q.shape[1] // heads, v.shape[1] // heads
    out, lse = v.new_empty(rows, heads * d_v), q.new_empty(rows, heads)
    for sl in _index_chunks(rows, m, max(d, d_v) * heads, q.device):
        idx = index[sl]  # (r, M)
        r = idx.shape[0]
        # q scaled first, then softmax: focal_attention's operations, so the same bits as its gathered form
        logits = torch.bmm(_per_head(q[sl] * scale, heads), _gathered(k, idx, heads).transpose(1, 2))  # (r h, 1, M)
        lse[sl] = torch.logsumexp(logits, dim=-1).view(r, heads)
        out[sl] = torch.bmm(torch.softmax(logits, dim=-1), _gathered(v, idx, heads)).view(r, -1)  # (r, C_v)
    return out, lse


def _index_backward(grad, q, k, v, index, out, lse, heads, scale, backend=None):
    """Gradients of :func:`index_attention` w.r.t. q, k, v: the Triton kernels (as in :func:`_index_forward`) or
    :func:`_index_backward_torch`."""
    if index_backend((grad, q, k, v), backend) == "triton":
        result = INDEX_KERNELS.call("backward", grad, q, k, v, index, out, lse, heads, scale,
                                    fallback=_index_fallback(backend))
        if result is not None:
            return result
    return _index_backward_torch(grad, q, k, v, index, out, lse, heads, scale)


def _index_backward_torch(grad, q, k, v, index, out, lse, heads, scale):
    """:func:`_index_backward` in torch ops: per chunk of rows p from lse, ds = p (dp - D), dq, and dk, dv summed
    into the keys by ``index_add_`` (on CUDA in no fixed order: the Triton kernels are the deterministic path); G
    tables as G calls, as :func:`_index_forward_torch`."""
    if index.dim() == 3:
        parts = [_index_backward_torch(grad[:, cv], q[:, c], k[:, c], v[:, cv], table, out[:, cv], lse[:, cl], per,
                                       scale)
                 for table, per, c, cv, cl in _per_table(index, heads, q.shape[1] // heads, v.shape[1] // heads)]
        return tuple(torch.cat(grads, 1) for grads in zip(*parts))
    rows, m = index.shape
    d, d_v = q.shape[1] // heads, v.shape[1] // heads
    dq, dk, dv = q.new_empty(rows, heads * d), k.new_zeros(k.shape), v.new_zeros(v.shape)
    delta = (grad * out).view(rows, heads, d_v).sum(-1)  # (R, heads) D = dO . O
    for sl in _index_chunks(rows, m, max(d, d_v) * heads, q.device):
        idx = index[sl]  # (r, M)
        r = idx.shape[0]
        kg, vg = _gathered(k, idx, heads), _gathered(v, idx, heads)  # (r h, M, d), (r h, M, d_v)
        qc, gc = _per_head(q[sl] * scale, heads), _per_head(grad[sl], heads)  # (r h, 1, d), (r h, 1, d_v)
        p = torch.bmm(qc, kg.transpose(1, 2)).sub_(lse[sl].reshape(-1, 1, 1)).exp_()  # (r h, 1, M)
        ds = torch.bmm(gc, vg.transpose(1, 2)).sub_(delta[sl].reshape(-1, 1, 1)).mul_(p)  # p (dp - D)
        dq[sl] = torch.bmm(ds, kg).view(r, -1).mul_(scale)  # (r, C)
        _scatter_add_(dk, idx, torch.bmm(ds.transpose(1, 2), qc), heads)  # (r h, M, d) outer products (q scaled)
        _scatter_add_(dv, idx, torch.bmm(p.transpose(1, 2), gc), heads)
    return dq, dk, dv


def _index_plain(q, k, v, index, heads, scale):
    """:func:`index_attention` by autograd's ops on the gathered (R, M, C) keys and values: what a gradient of its
    gradients (``create_graph``) differentiates, recomputed from the inputs (:func:`_index_grad`); O(R M C)."""
    if index.dim() == 3:
        return torch.cat([_index_plain(q[:, c], k[:, c], v[:, cv], table, per, scale)
                          for table, per, c, cv, _ in _per_table(index, heads, q.shape[1] // heads,
                                                                 v.shape[1] // heads)], 1)
    rows, m = index.shape
    kg = k[index].view(rows, m, heads, -1)  # (R, M, heads, d)
    vg = v[index].view(rows, m, heads, -1)  # (R, M, heads, d_v)
    logits = torch.einsum("rhd,rmhd->rhm", q.reshape(rows, heads, -1), kg) * scale  # (R, heads, M)
    return torch.einsum("rhm,rmhd->rhd", logits.softmax(-1), vg).reshape(rows, -1)  # (R, C_v)


_LIB.define("index_attention(Tensor q, Tensor k, Tensor v, Tensor index, SymInt heads, float scale) "
            "-> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("index_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor index, Tensor out, "
            "Tensor lse, SymInt heads, float scale) -> (Tensor, Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("index_attention", _index_forward, "CompositeExplicitAutograd")
_LIB.impl("index_attention_backward", _index_backward, "CompositeExplicitAutograd")
_index_op = torch.ops.attention_suite.index_attention.default
_index_backward_op = torch.ops.attention_suite.index_attention_backward.default


@torch.library.register_fake("attention_suite::index_attention", lib=_LIB)
def _(q, k, v, index, heads, scale):
    return v.new_empty(q.shape[0], v.shape[1]), q.new_empty(q.shape[0], heads)


@torch.library.register_fake("attention_suite::index_attention_backward", lib=_LIB)
def _(grad, q, k, v, index, out, lse, heads, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _index_setup_context(ctx, inputs, output):
    q, k, v, index, heads, scale = inputs
    ctx.save_for_backward(q, k, v, index, *output)  # the output (for D = dO . O) and lse: no (R, M) tensor
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.args = (heads, scale)


def _index_grad(ctx, grad, grad_lse):
    if grad is None:
        return (None,) * 6
    q, k, v, index, out, lse = ctx.saved_tensors
    device = q.device.type  # a backward called under autocast stays in q's dtype; "meta" (FLOP counts) has none
    with autocast_off(device):
        if torch.is_grad_enabled():  # create_graph (a gradient penalty): the plain ops' graph, recomputed
            return (*recomputed_grads(lambda *t: _index_plain(*t, index, *ctx.args), grad.to(q.dtype), (q, k, v)),
                    None, None, None)
        # the kernel itself (as the eager forward), or the op where a mode must see it (as in _dilated_grad)
        direct = skips_dispatch(grad, q)
        with below_autograd() if direct else contextlib.nullcontext():
            dq, dk, dv = (_index_backward if direct else _index_backward_op)(grad.to(q.dtype), q, k, v, index, out,
                                                                            lse, *ctx.args)
    return dq, dk, dv, None, None, None


def _index_double_grad(ctx, *grads):
    raise RuntimeError("index_attention_backward: not differentiable; a gradient of index_attention's gradients "
                       "(create_graph) differentiates the plain ops instead (recomputed_grads).")


torch.library.register_autograd("attention_suite::index_attention", _index_grad,
                                setup_context=_index_setup_context, lib=_LIB)
torch.library.register_autograd("attention_suite::index_attention_backward", _index_double_grad, lib=_LIB)

_IndexFunction = _eager_function("_IndexFunction", _index_forward, _index_setup_context, _index_grad)


@register_flop_formula(torch.ops.attention_suite.index_attention)
def _index_flops(q_shape, k_shape, v_shape, index_shape, *args, out_shape=None, **kwargs):
    rows, m = index_shape[-2:]  # G tables: each head reads M slots of its own
    return 2 * rows * m * (q_shape[1] + v_shape[1])  # q.k and p v per slot, all heads: as the gathered bmm's


@register_flop_formula(torch.ops.attention_suite.index_attention_backward)
def _index_backward_flops(grad_shape, q_shape, k_shape, v_shape, index_shape, *args, out_shape=None, **kwargs):
    rows, m = index_shape[-2:]
    return 2 * rows * m * (3 * q_shape[1] + 2 * v_shape[1])  # recomputed q.k, dp and dv (C_v), dq and dk (C)


@float32_kernel
def index_attention(q, k, v, index, heads: int, scale: float | None = None):
    """Softmax attention of each query row over the key rows its row of ``index`` names, one softmax per head.

    q (R, C), k (T, C), v (T, C_v), index (R, M) integer rows of k and v (repeats count once per slot):
    out[r, h] = sum_j softmax_j(q[r, h] . k[index[r, j], h] * scale) v[index[r, j], h], per head of
    d = C / heads channels (scale d^-0.5 by default) -> (R, C_v). Or G tables (G, R, M), G dividing ``heads``:
    table g for the g-th group of heads / G consecutive heads (dilated's head groups, each at its rate, in one
    call: one launch forward and two backward for all). A ``torch.library`` op (a leaf under
    torch.compile, its FLOPs counted as the gathered form's): on the Triton path (:mod:`attention.index_attention_
    triton`: one launch forward, two backward, deterministic, nothing of size R M C held), where ``INDEX_BACKEND``
    picks it, else in chunked torch ops (``INDEX_CHUNK_ELEMENTS``). ``focal`` and ``dilated`` on point sets call it on
    every device. A gradient of its gradients (``create_graph``: a gradient penalty) differentiates the plain ops,
    recomputed from the inputs (O(R M C) memory for that pass only).
    """
    if index.dim() not in (2, 3) or (index.dim() == 3 and heads % index.shape[0]):
        raise ValueError(f"index_attention: index must be (R, M), or (G, R, M) with G dividing heads = {heads}; got "
                         f"{tuple(index.shape)}.")
    scale = (q.shape[1] // heads) ** -0.5 if scale is None else float(scale)
    run = _IndexFunction.apply if skips_dispatch(q, k, v, index) else _index_op
    return run(q, k, v, index, heads, scale)[0]  # (R, C_v)
