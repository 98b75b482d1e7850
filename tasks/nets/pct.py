"""PCT: Point Cloud Transformer (Guo et al., 2021) for shape classification.

Follows the reference PyTorch port (PCT_Pytorch, model.py ``Pct``) layer for
layer, with every attention layer's mixer built from the ``attn`` config:

    xyz (B, N, 3)
    point embedding   conv 3->64->64 + BN + ReLU
    neighbour embed.  2 x sample-and-group (FPS to 512 then 256 points, 32-NN,
                      [neighbour - centre, centre]) -> 2 x (conv + BN + ReLU) -> max
                      over neighbours: 128 then 256 channels
    transformer       conv 256->256 x 2 + BN + ReLU, then 4 offset blocks
                      x + ReLU(BN(conv(x - mixer(x)))), outputs concatenated (1024)
    head              [1024, 256 skip] -> conv 1280->1024 + BN + LeakyReLU(0.2) -> max
                      pool -> 1024->512->256->classes, BN, LeakyReLU(0.2), dropout

``embedding="point"`` is SPCT: a point embedding 3->128->128 and attention over
all input points at 128 channels, no neighbour embedding.
With ``attn=offset`` and the defaults the network has 2,876,136 trainable
parameters, the paper's 2.88M.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import attention
from attention import pointops
from attention.eager import below_autograd, skips_dispatch
from attention.errors import UserError
from attention.pointops import farthest_point_sample, gather, knn
from attention.tensor_cache import tensor_cache

from .weights import take

FPS_RULES = ("kernel", "plain")

# Layout. The parameters are PCT_Pytorch's (1x1 ``Conv1d`` weights (O, I, 1), ``BatchNorm1d`` buffers), so state dicts
# and ``from_official`` are those of the reference; the computation is token-major: features are (..., C) rows, a 1x1
# conv is ``F.linear`` with the weight's (O, I) view and batch norm normalises over the rows. On CPU that runs the
# network's layers as plain GEMMs (mkldnn's 1x1 ``Conv1d`` forward and backward are slower than ``mm`` on the same
# numbers), with no transposes between (B, C, N) and the mixers' (B, N, C). In eval mode each batch norm is folded
# into the linear layer before it: one ``addmm`` and an in-place activation per layer. Max pooling is ``max`` with
# indices, as the reference's ``adaptive_max_pool1d`` / ``max``: its backward scatters the gradient to the indices,
# where ``amax``'s compares every input with the maximum again (several passes over the (B, S, K, C) groups).


def conv_bn(cin: int, cout: int, act: nn.Module | None = None) -> ConvBN:
    """1x1 conv (no bias) + BN + activation (ReLU by default), on token-major (..., C) features."""
    return ConvBN(cin, cout, act)


class ConvBN(nn.Sequential):
    """``Conv1d(cin, cout, 1, bias=False)``, ``BatchNorm1d(cout)``, activation: the reference's layer and its keys
    (``.0.weight``, ``.1.running_mean``, ...), computed on rows: (..., cin) -> (..., cout)."""

    def __init__(self, cin: int, cout: int, act: nn.Module | None = None):
        super().__init__(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout), act or nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_bn_act(x, self[0], self[1], self[2])


class ConvBNMax(ConvBN):
    """:class:`ConvBN` followed by the max over the second-to-last dim, (..., K, cin) -> (..., cout), by
    :func:`conv_bn_act_max`: PCT's fuse layer before its max over the points (a module, so that ``mode=summary``
    counts its FLOPs under its own name)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv_bn_act_max(x, self)


def fold(conv: nn.Module, bn: nn.Module, cast: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight (O, I), bias or None, normalised) of ``conv`` as a linear layer, with ``bn`` folded in when it uses
    its running statistics (eval mode): then ``F.linear`` with them is the conv and the batch norm at once
    (``normalised``). In training the batch statistics are needed, and the conv's own weight and bias come back.
    Inside :func:`folded_for_inference` the pair's folding was made for every layer at once (and kept while the
    parameters do not change), and under autocast, with ``cast``, comes in autocast's dtype, as ``F.linear`` would
    cast it (``cast=False``: float32, for a caller that computes with the weight before its product); otherwise
    :func:`fold_all` makes this one's."""
    if bn.training or bn.running_mean is None:
        return conv.weight.reshape(conv.weight.shape[0], -1), conv.bias, False  # (O, I, 1) -> (O, I)
    made = None if torch.compiler.is_compiling() else _FOLDED.get()  # compiled: inductor fuses the per-layer form
    folded = made.get(conv) if made is not None else None
    if folded is None:
        return (*fold_all([(conv, bn)])[conv], True)
    return (*(made.cast(conv) if cast else folded), True)


# False: the inference forward folds layer by layer at every call, as before fold_all and Folded. Timed side by side
# on an H200 (benchmarks/pct-cuda-b16.md, batch 16): the kept folding's eval forward 4.04 ms, layer by layer 5.94 ms
FOLD_AT_ONCE = True
# Which form PCT's grouping and fuse layers take in training: True NormActMax, False the plain batch norm, activation
# and max, None (the default) NormActMax on the CPU and the plain form on other devices. NormActMax moves a third of
# the plain form's bytes over the (B, S, K, C) groups but dispatches about 24 ops a layer where the plain form takes
# 10. Measured side by side in one process: on the 2-core CPU (bytes-bound) a training step at batch 8 took 825 ms
# with it and 1,095 ms without; on an H200 (torch 2.11, batch 16, bound by its launches: 7.8 ms of GPU time in a
# 19.8 ms step) 19.8 ms with it and 17.4 ms without (benchmarks/pct-cuda-b16.md, which times the other form too).
FUSED_NORM_ACT_MAX: bool | None = None


def takes_norm_act_max(device: torch.device) -> bool:
    """Whether training on ``device`` takes NormActMax where it can (:data:`FUSED_NORM_ACT_MAX`)."""
    return device.type == "cpu" if FUSED_NORM_ACT_MAX is None else FUSED_NORM_ACT_MAX


# conv -> (weight, shift) of every layer folded at once, while a network's inference forward runs
_FOLDED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pct_folded", default=None)


def fold_all(pairs) -> dict:
    """{conv: (weight (O, I), shift (O,))} for every (conv, batch norm) pair whose batch norm uses its running
    statistics: scale = bn.weight / sqrt(running_var + eps), weight * scale and shift = bn.bias - running_mean * scale
    (+ the conv's bias * scale), each term where the module has it. All layers at once, as a few
    ``torch._foreach_*`` calls instead of about seven ops a layer: on a GPU, PCT's inference forward is bound by its
    launches (13 layers, about 80 launches less of its ~200, counted on the CPU). The weights' scaling stays one op a
    layer (a foreach op wants equal shapes within a pair: (O, I) by (O, 1) is not)."""
    groups: dict[tuple, list] = {}
    for conv, bn in pairs:  # one foreach call per device and dtype
        if not bn.training and bn.running_mean is not None:
            groups.setdefault((bn.running_var.device, bn.running_var.dtype, conv.weight.dtype), []).append((conv, bn))
    out = {}
    for group in groups.values():
        convs, bns = zip(*group)
        scale = torch._foreach_add([b.running_var for b in bns], [b.eps for b in bns])
        torch._foreach_rsqrt_(scale)
        scale = _where_given(scale, [b.weight for b in bns], torch._foreach_mul)  # bn.weight * rsqrt(var + eps)
        shift = torch._foreach_mul([b.running_mean for b in bns], scale)
        torch._foreach_neg_(shift)  # -mean * scale
        shift = _where_given(shift, [b.bias for b in bns], torch._foreach_add)  # + bn.bias
        biases = [c.bias for c in convs]
        products = _where_given(biases, [s if b is not None else None for b, s in zip(biases, scale)],
                                torch._foreach_mul)  # conv bias * scale, None without one
        shift = _where_given(shift, products, torch._foreach_add)  # + conv bias * scale
        for conv, s, t in zip(convs, scale, shift):
            out[conv] = (conv.weight.reshape(conv.weight.shape[0], -1) * s.unsqueeze(1), t)  # (O, I)
    return out


def _where_given(values: list, others: list, op) -> list:
    """``values`` with ``op(values[i], others[i])`` (a foreach op over those i) wherever ``others[i]`` is not None."""
    at = [i for i, other in enumerate(others) if other is not None]
    out = list(values)
    if at:
        for i, result in zip(at, op([values[i] for i in at], [others[i] for i in at])):
            out[i] = result
    return out


@contextlib.contextmanager
def folded_for_inference(net: nn.Module) -> Iterator[None]:
    """Every batch norm of ``net`` (its ``fold_pairs()``: each (1x1 conv, batch norm) pair whose folding
    :func:`fold` is asked for, listed by the network, not found by walking its modules: that walk took 0.2 ms a
    forward) folded into its conv at once (:func:`fold_all`) for the block, when that is what
    the forward would do layer by layer: eval mode, no gradient (a folded weight made here carries none), not under
    torch.compile (inductor fuses the per-layer form itself). Otherwise, and inside another network's block, a
    no-op. The folding is kept on the network (:class:`Folded`) and made again only when a parameter or running
    statistic has changed."""
    if (not FOLD_AT_ONCE or net.training or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or _FOLDED.get() is not None):
        yield
        return
    pairs = net.fold_pairs()
    try:
        state = Folded.state(pairs)
    except RuntimeError:  # parameters made under torch.inference_mode keep no version: fold at every forward
        kept = Folded(fold_all(pairs), None)
    else:
        kept = net.__dict__.get("_folded")  # a plain attribute: not in the state dict (FoldingNetwork.train drops it)
        if kept is None or kept.key != state:
            kept = net.__dict__["_folded"] = Folded(fold_all(pairs), state)
    token = _FOLDED.set(kept)
    try:
        yield
    finally:
        _FOLDED.reset(token)


class Folded(dict):
    """{conv: (weight (O, I), shift (O,))} of :func:`fold_all`, for the parameters and running statistics whose
    (storage, version) are ``key``: an evaluation over many batches (validation, test, the bench's eval step) folds
    once, not at every forward (about 20 launches of PCT's ~120 on a GPU, where its inference forward at batch 16
    is bound by its launches). Every in-place change (an optimizer step, a training forward's running statistics,
    ``load_state_dict``'s copy) bumps a tensor's version, a new tensor moves its storage: either makes the key
    stale. Under autocast, :meth:`cast` keeps each weight and shift in autocast's dtype too, cast once as
    ``F.linear`` would cast it at every call (about 26 launches more of a bfloat16 forward)."""

    def __init__(self, folded: dict, key: tuple):
        super().__init__(folded)
        self.key = key
        self.casts: dict = {}

    @staticmethod
    def state(pairs) -> tuple:
        """(data pointer, version) of every tensor a folding reads, in the pairs' order."""
        return tuple((t.data_ptr(), t._version) for conv, bn in pairs
                     for t in (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var)
                     if t is not None)

    def cast(self, conv: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """conv's (weight, shift) in the dtype autocast gives ``F.linear`` on their device, where it is on."""
        weight, shift = self[conv]
        device = weight.device.type
        if not torch.is_autocast_enabled(device) or weight.dtype != torch.float32:
            return weight, shift
        dtype = torch.get_autocast_dtype(device)
        if (conv, dtype) not in self.casts:
            self.casts[conv, dtype] = (weight.to(dtype), shift.to(dtype))
        return self.casts[conv, dtype]


class FoldingNetwork(nn.Module):
    """A network whose inference forward runs inside :func:`folded_for_inference`: it lists its (conv, batch norm)
    pairs (``fold_pairs``), and its kept folding (:class:`Folded`) goes when it is put in training mode, so that a
    change the version counters miss (an in-place write through ``.data``, as some weight-averaging code does)
    reaches the next evaluation after training."""

    def fold_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        raise NotImplementedError

    def train(self, mode: bool = True):
        if mode:
            self.__dict__.pop("_folded", None)
        return super().train(mode)


RELU = nn.ReLU()  # the offset block's activation (it holds no module for it, as the reference's SA_Layer)


def act_(y: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """``act`` applied in place where it is ReLU or LeakyReLU (y is a fresh result, not a view: in place on a view
    autograd would copy the base back in the backward; their own backward needs only their output)."""
    if type(act) is nn.ReLU:
        return F.relu_(y)
    if type(act) is nn.LeakyReLU and act.negative_slope > 0:
        return F.leaky_relu_(y, act.negative_slope)
    return act(y)


def bn_act(h: torch.Tensor, bn: nn.Module, act: nn.Module) -> torch.Tensor:
    """act(bn(h)) over the rows of h (..., C). BatchNorm1d on (R, C) is BatchNorm1d on (B, C, N) with R = B N rows:
    the same statistics and running-stat updates. The module itself runs (so SyncBatchNorm works too), or its
    function where :func:`batch_norm_act` counts the batch once for the whole forward."""
    out = batch_norm_act(rows(h), bn, act)  # (R, C)
    return out if h.dim() == 2 else out.view(h.shape)  # (..., C)


# The ``num_batches_tracked`` counters of the batch norms a training forward has run (:func:`counted_once`)
_COUNTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("pct_counted", default=None)


@contextlib.contextmanager
def counted_once(net: nn.Module) -> Iterator[None]:
    """A training forward of ``net`` whose plain batch norms leave their ``num_batches_tracked += 1`` to one
    ``torch._foreach_add_`` at its end (:func:`batch_norm_act`): ``nn.BatchNorm1d.forward`` adds to it in a launch of
    its own, 13 launches of PCT's step on a GPU, where its batch of 16 is bound by its launches. The counters end
    the same, also when the forward fails halfway. Not under torch.compile (inductor fuses the additions itself),
    and a no-op in eval mode and inside another network's block."""
    if not net.training or torch.compiler.is_compiling() or _COUNTED.get() is not None:
        yield
        return
    counters: list[torch.Tensor] = []
    token = _COUNTED.set(counters)
    try:
        yield
    finally:
        _COUNTED.reset(token)
        if counters:
            with torch.no_grad():
                torch._foreach_add_(counters, 1)


# Whether a training forward's plain batch norms (:func:`batch_norm_act`) see their rows (R, C) as a (1, C, R, 1)
# channels-last view (no copy either way). torch hands 2-D inputs to its native kernels and inputs of 3 or more
# dimensions on CUDA to cuDNN, whose batch norm took 66 and 55 us of an H200's host time a call forward and backward
# where the native one took 95 and 113 (the fourth lease's profile of the reference's and the suite's steps; 13 a
# step). The same function (a test holds the two forms equal in float64); off until a GPU has timed it
# (``benchmarks.pct_cuda`` times the other form).
BATCH_NORM_CHANNELS_LAST = False


def batch_norm_act(x: torch.Tensor, bn: nn.Module, act: nn.Module) -> torch.Tensor:
    """act(bn(x)) on rows x (R, C): the module, or inside :func:`counted_once`, for a plain ``nn.BatchNorm1d`` in
    training with a momentum and no hooks, its function, the counter's increment left to the forward's end
    (:data:`BATCH_NORM_CHANNELS_LAST`: on a (1, C, R, 1) view, the activation in place before the view back)."""
    # under torch.compile counted_once is off (inductor fuses the additions), and torch 2.11's dynamo cannot trace
    # ContextVar.get: the call broke PCT's graph at every batch norm (30 graphs instead of 1)
    counters = None if torch.compiler.is_compiling() else _COUNTED.get()
    if (counters is None or type(bn) is not nn.BatchNorm1d or not bn.training or not bn.track_running_stats
            or bn.momentum is None or bn.num_batches_tracked is None or bn._forward_hooks or bn._forward_pre_hooks):
        return act_(bn(x), act)
    counters.append(bn.num_batches_tracked)
    args = (bn.running_mean, bn.running_var, bn.weight, bn.bias, True, bn.momentum, bn.eps)
    if not BATCH_NORM_CHANNELS_LAST:
        return act_(F.batch_norm(x, *args), act)
    return image_rows(act_(F.batch_norm(row_image(x), *args), act))  # (1, C, R, 1) channels-last, then (R, C)


def row_image(x: torch.Tensor) -> torch.Tensor:
    """Rows x (R, C) as a (1, C, R, 1) channels-last image, a view (of a contiguous copy where x is not
    contiguous): the layout in which torch hands batch norms and convolutions to cuDNN without copying."""
    r, c = x.shape
    return (x if x.is_contiguous() else x.contiguous()).view(1, r, 1, c).permute(0, 3, 1, 2)


def image_rows(y: torch.Tensor) -> torch.Tensor:
    """A (1, C, R, 1) image back as rows (R, C): a view where y is channels-last (:func:`row_image`)."""
    return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


# Whether PCT's 1x1 convolutions run as convolutions (``F.conv2d`` on :func:`row_image` views: cuDNN on a GPU) instead
# of matrix products on their rows (``F.linear``: cuBLAS). The same function, in another arithmetic on a GPU with TF32
# under torch's defaults: cuDNN's convolutions take TF32 there (``torch.backends.cudnn.allow_tf32``), as the
# reference's ``nn.Conv1d`` layers do, and cuBLAS's products IEEE float32 (``suite/tf32.py``). So under torch's
# defaults this form does the reference's arithmetic, which the default form does only with ``trainer.tf32`` set.
# Off until a GPU has timed it (``benchmarks.pct_cuda`` times the other form: cuDNN's host time against cuBLAS's).
CONVOLUTIONS = False


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the rows of x (..., I) -> (R, O). On a (R, I) matrix ``F.linear`` is one ``addmm`` or ``mm``
    and its backward two products; on (..., I) it goes through ``matmul``, whose reshapes and transposes
    around the product are more host ops each way (PCT's eager step at batch 16 is bound by its host).
    With :data:`CONVOLUTIONS`, the 1x1 convolution that it is, on a channels-last image of the rows."""
    if CONVOLUTIONS:
        o, i = weight.shape
        kernel = weight.view(o, 1, 1, i).permute(0, 3, 1, 2)  # (O, I, 1, 1), channels-last: cuDNN copies nothing
        return image_rows(F.conv2d(row_image(rows(x)), kernel, bias))  # (1, O, R, 1) -> (R, O)
    return F.linear(rows(x), weight, bias)


def rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., C) as a (R, C) matrix: x itself, a view (one op: ``reshape`` is two) or, not contiguous, a copy."""
    if x.dim() == 2:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])


def linear_bn_act(x: torch.Tensor, conv: nn.Module, bn: nn.Module, act: nn.Module) -> torch.Tensor:
    """act(bn(conv(x))) on token-major x (..., I) -> (..., O)."""
    weight, bias, normalised = fold(conv, bn)
    y = linear_rows(x, weight, bias)  # (R, O)
    y = act_(y, act) if normalised else bn_act(y, bn, act)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])  # (..., O)


def conv_bn_act_max(x: torch.Tensor, layer: nn.Sequential) -> torch.Tensor:
    """max over the second-to-last dim of act(bn(conv(x))): x (..., K, I) -> (..., O), ``layer`` a (Conv1d,
    BatchNorm1d, activation) triple; PCT's last grouping layer before the max over the K neighbours, and its fuse
    layer before the max over the points.

    ReLU and LeakyReLU after an affine map a h + c are monotone in h, increasing where a >= 0 and decreasing where
    a < 0, so the max over K is act(a h* + c), h* the max (a >= 0) or the min (a < 0) of h over K: the normalised
    (..., K, O) tensor is never formed. In training (:class:`NormActMax`) the batch statistics of h still take every
    row, and so does their gradient; the rest of the gradient goes to the selected rows only.
    """
    conv, bn, act = layer
    weight, bias, normalised = fold(conv, bn)
    *lead, k, _ = x.shape
    h = linear_rows(x, weight, bias)  # (R K, O)
    c = h.shape[-1]
    monotone = type(act) is nn.ReLU or (type(act) is nn.LeakyReLU and act.negative_slope >= 0)
    if normalised and monotone:  # act(max) = max(act): the scale is folded in, h is a h + c
        return act_(max_over(h.view(-1, k, c)), act).view(*lead, c)
    # Under torch.compile the plain form: the compiler fuses it itself, and batch_norm_update_stats (below) has no
    # fake-tensor kernel, so the fused form would break the graph there.
    fused = (takes_norm_act_max(h.device) and monotone and type(bn) is nn.BatchNorm1d and bn.affine
             and h.dtype in (torch.float32, torch.float64)
             and not torch.is_autocast_enabled(h.device.type) and not torch.compiler.is_compiling())
    if not fused:
        return max_over((act_(h, act) if normalised else bn_act(h, bn, act)).view(-1, k, c)).view(*lead, c)
    mean, invstd = batch_statistics(h, bn)
    slope = act.negative_slope if type(act) is nn.LeakyReLU else 0.0
    return NormActMax.apply(h.view(-1, k, c), bn.weight, bn.bias, mean, invstd, slope).view(*lead, c)


def max_over(h: torch.Tensor) -> torch.Tensor:
    """The max over dim 1 of h (P, K, C) -> (P, C): ``amax`` where no gradient is asked for (an evaluation), which
    on the CPU took a fifth of the time of ``max`` with its indices (PCT's first grouping, 2048 x 16 x 128); the
    values are the same. With a gradient, ``max``'s: to the first maximal row, where ``amax`` splits it over ties."""
    if torch.is_grad_enabled() and h.requires_grad:
        return h.max(dim=1).values
    return h.amax(dim=1)


@torch.no_grad()
def batch_statistics(h: torch.Tensor, bn: nn.BatchNorm1d) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1 / sqrt(biased variance + eps)) over the rows of h (R, C), and ``bn``'s running statistics
    updated as its training forward updates them (unbiased variance, momentum or cumulative average)."""
    if bn.track_running_stats and bn.running_mean is not None:
        counters = _COUNTED.get()
        if counters is not None and bn.momentum is not None:
            counters.append(bn.num_batches_tracked)  # added to at the forward's end (counted_once)
        else:
            bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        mean, var = torch.batch_norm_update_stats(h, bn.running_mean, bn.running_var, factor)
    else:
        var, mean = torch.var_mean(h, dim=0, correction=0)
    return mean, torch.rsqrt(var + bn.eps)


class NormActMax(torch.autograd.Function):
    """max over K of act(BN(h)) for h (P, K, C), BN with the batch statistics of h's P K rows (given, with their
    dependence on h in the backward), act ReLU (slope 0) or LeakyReLU(slope).

    Backward: with g the gradient at the selected rows after the activation, BN's gradient
    dh = a (g - mean(g) - x^ mean(g x^)) over all rows (a = weight / std, x^ the normalised h) is
    k2 h + k3 everywhere (the statistics' share, one pass) plus a g at the selected rows (a scatter):
    one (P, K, C) tensor where max's, the activation's and batch norm's backward make four.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, mean, invstd, slope):
        up = weight >= 0  # the sign of a = weight * invstd (invstd > 0): the max over K where up, else the min
        if h.device.type not in pointops.SYNC_FREE_DEVICES and bool(up.all()):  # usual: batch norm's weights start at 1
            chosen, idx = h.max(dim=1)  # (P, C)
        else:
            # min over K of h = -(max over K of -h), at the same first index (negation is exact): one reduction
            # with indices, not a max and a min (on the CPU such a reduction over a middle dim costs several times
            # an elementwise pass: PCT's first grouping, 2048 x 16 x 128, 15-30 ms where the product by the sign
            # takes ~3)
            sign = torch.where(up, 1.0, -1.0).to(h.dtype)  # (C,)
            signed, idx = (h * sign).max(dim=1)  # (P, C)
            chosen = signed * sign
        xhat = (chosen - mean).mul_(invstd)  # (P, C): the selected rows normalised
        pre = torch.addcmul(bias, xhat, weight)  # (P, C): BN's output at the selected rows
        ctx.save_for_backward(h, weight, mean, invstd, xhat, idx, pre)
        ctx.slope = slope
        return F.leaky_relu(pre, slope) if slope else F.relu(pre)

    @staticmethod
    def backward(ctx, grad):
        h, weight, mean, invstd, xhat, idx, pre = ctx.saved_tensors
        # (P, C), after the activation: one op, as the activation's own backward
        g = (torch.ops.aten.leaky_relu_backward(grad, pre, ctx.slope, False) if ctx.slope
             else torch.ops.aten.threshold_backward(grad, pre, 0))
        rows = h.shape[0] * h.shape[1]
        d_bias = g.sum(0)
        d_weight = (xhat * g).sum(0)
        # the (C,) coefficients in few launches (a foreach op is one on a GPU, where this step is bound by its
        # launches): a = weight invstd, u = invstd d_weight, k2 = -a u / rows, k3 = -a (d_bias - mean u) / rows
        a, u = torch._foreach_mul([weight, invstd], [invstd, d_weight])
        w = torch.addcmul(d_bias, mean, u, value=-1)
        k2, k3 = torch._foreach_mul([u, w], [a, a])
        torch._foreach_mul_([k2, k3], -1.0 / rows)
        dh = torch.addcmul(k3, h, k2)  # (P, K, C): through the batch statistics, every row
        dh.scatter_add_(1, idx.unsqueeze(1), (g * a).unsqueeze(1))  # the selected rows' own gradient
        return dh, d_weight, d_bias, None, None, None


# Where GroupRows' backward adds the rows' gradients: True into the two column halves of one (R, 2C) gradient, in
# place; False into two contiguous (R, C) gradients, then one cat; None (the default) in place on CUDA, whose
# index_add reads any strides (one launch less), and with the cat on the CPU, where index_add_ into a strided half
# took 4x as long as into a contiguous matrix (29 against 7.5 ms at PCT's first grouping, batch 8).
GROUP_ROWS_IN_PLACE: bool | None = None


def adds_in_place(device: torch.device) -> bool:
    """Whether GroupRows' backward on ``device`` adds into the halves of one gradient (:data:`GROUP_ROWS_IN_PLACE`)."""
    return device.type == "cuda" if GROUP_ROWS_IN_PLACE is None else GROUP_ROWS_IN_PLACE


class GroupRows(torch.autograd.Function):
    """Both projections of the points' rows (R, 2C): the first C columns at the row indices idx (..., K), plus the
    last C columns at the centres' rows centre (...) (and ``bias``, or None) added to each of the K rows ->
    (..., K, C): a gather and an add in place forward; backward, one (R, 2C) gradient (two index-adds into it, and
    the sum over K), so that the product before takes it in one matrix product for its input's gradient and one
    for its weights'. The output is a fresh tensor, not a view, so the activation after it may act in place."""

    @staticmethod
    def forward(ctx, both, idx, centre, bias):
        c = both.shape[1] // 2
        rows = both[:, c:][centre]  # (..., C): the centres' own projection
        if bias is not None:
            rows += bias
        out = both[:, :c][idx]  # (..., K, C): advanced indexing allocates it (index_select + view: a view)
        out += rows.unsqueeze(-2)
        ctx.save_for_backward(idx, centre)
        ctx.rows, ctx.bias = both.shape[0], bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        idx, centre = ctx.saved_tensors
        c = grad.shape[-1]
        d_centre = grad.sum(-2)  # (..., C)
        d_both = None
        if ctx.needs_input_grad[0] and adds_in_place(grad.device):  # into the halves of one (R, 2C) gradient
            d_both = grad.new_zeros(ctx.rows, 2 * c)
            d_both[:, :c].index_add_(0, idx.reshape(-1), grad.reshape(-1, c))
            d_both[:, c:].index_add_(0, centre.reshape(-1), d_centre.reshape(-1, c))
        elif ctx.needs_input_grad[0]:  # into two (R, C) gradients, then side by side
            halves = [grad.new_zeros(ctx.rows, c).index_add_(0, i.reshape(-1), g.reshape(-1, c))
                      for i, g in ((idx, grad), (centre, d_centre))]
            d_both = torch.cat(halves, dim=1)  # (R, 2C)
        d_bias = d_centre.reshape(-1, c).sum(0) if ctx.bias and ctx.needs_input_grad[3] else None
        return d_both, None, None, d_bias


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """torch's intra-op threads set to 1 inside (on CPU), restored after.

    For FPS: each of its S steps is a few elementwise ops on (B, N, 3) and (B, N) tensors, above torch's grain
    size (32,768 elements) at PCT's B = 16, N = 1024, so each runs on every thread, and each waits for all of them.
    The work of one op is microseconds; on 2 cores shared with another busy process a thread can wait a scheduler
    slice (milliseconds) per op: FPS of 16 x 1024 points to 512 took 0.4 to 8 s on 2 threads and 14 ms on one.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def neighbourhoods(xyz: torch.Tensor, samples: int, neighbours: int, like_kernel: bool):
    """FPS centres (B, S), their coordinates (B, S, 3) and their k nearest points (B, S, K) of xyz (B, N, 3).

    FPS and kNN run as one ``torch.library`` op (``attention_suite::pct_neighbourhoods``): a leaf of the graph under
    ``torch.compile``, with a fake kernel for its shapes, so that the network compiles as one graph (FPS and kNN are
    ops themselves, ``attention.pointops``; this one also holds FPS to one CPU thread, :func:`one_cpu_thread`, which
    traced code could not). A ``torch.compiler.disable`` there instead (as before) broke the graph inside the
    network's loop over its two groupings, and dynamo then ran the whole ``PCT.forward`` eagerly, compiling only the
    pieces (7 graphs; CUDA graphs could not take the step whole). The indices carry no gradient; the centres'
    coordinates are gathered outside the op, so a gradient to the points still flows.
    """
    if skips_dispatch(xyz):  # eager: the op's kernel, without its dispatch
        with below_autograd():
            centres, groups = _neighbourhoods(xyz, samples, neighbours, like_kernel)
    else:
        centres, groups = torch.ops.attention_suite.pct_neighbourhoods(xyz, samples, neighbours, like_kernel)
    return centres, gather(xyz, centres), groups  # (B, S), (B, S, 3), (B, S, K)


def _neighbourhoods(xyz: torch.Tensor, samples: int, neighbours: int, like_kernel: bool):
    """The op's kernel, on any device: FPS on one CPU thread (:func:`one_cpu_thread`), kNN on them all. Both come
    back contiguous, as the fake kernel says (FPS's torch loop builds its (B, S) indices transposed): inductor checks
    the strides."""
    with one_cpu_thread(xyz.device):
        centres = farthest_point_sample(xyz, samples, like_kernel=like_kernel)  # (B, S)
    return centres.contiguous(), knn(gather(xyz, centres), xyz, neighbours).contiguous()  # (B, S), (B, S, K)


# torch.library.define + impl, as attention/functional.py's ops (and why not custom_op: there)
_LIB = torch.library.Library("attention_suite", "FRAGMENT")
_LIB.define("pct_neighbourhoods(Tensor xyz, SymInt samples, SymInt neighbours, bool like_kernel) -> (Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("pct_neighbourhoods", _neighbourhoods, "CompositeExplicitAutograd")


@torch.library.register_fake("attention_suite::pct_neighbourhoods", lib=_LIB)
def _neighbourhoods_fake(xyz, samples, neighbours, like_kernel):
    b = xyz.shape[0]
    return xyz.new_empty(b, samples, dtype=torch.long), xyz.new_empty(b, samples, neighbours, dtype=torch.long)


def group_rows(both: torch.Tensor, groups: torch.Tensor, centres: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """both (B N, 2C), B samples of n points: [W_d g | (W_c - W_d) g] of every point, at groups (B, S, K), plus
    its second half at the centres (B, S) (+ bias) -> (B, S, K, C), by :class:`GroupRows`: rows of the (B N, .)
    matrix by indexing, a quarter faster, forward and backward, than ``torch.gather`` with an index expanded over
    the channels (``attention.pointops.gather``)."""
    b = groups.shape[0]
    offset = first_rows(b, n, groups.device)  # (B,): each sample's first row
    return GroupRows.apply(both, groups + offset.view(b, 1, 1), centres + offset.view(b, 1), bias)  # (B, S, K, C)


@tensor_cache(maxsize=16)
def first_rows(b: int, n: int, device: torch.device) -> torch.Tensor:
    """(B,) int64: each of B samples' first row in a (B n, .) matrix, 0, n, 2n, ... Kept per (B, n, device): two
    launches a grouping layer at every step, where a step is bound by its launches on a GPU."""
    return torch.arange(0, b * n, n, device=device)


class SampleAndGroup(nn.Module):
    """PCT's ``sample_and_group`` + ``Local_op``: FPS centres, kNN groups, shared MLP, max over neighbours.

    The first layer maps each neighbour's [g - c, c] (2C) through W = [W_d | W_c]; that is W_d g + (W_c - W_d) c,
    so both run on the N points once (a centre is one of them), as one product with [W_d; W_c - W_d], and the
    (B, S, K, C_out) rows are a gather plus a broadcast add: S K / N times fewer rows (16x in PCT's first group) at
    half the width, and no (B, S, K, 2C) tensor. One product where W_c - W_d on the gathered centres took a second
    (and its backward two more, and a scatter for the gather): on a GPU PCT's batch-16 step is bound by its host,
    which an H200 spent ~40 us on a matrix product. Equal in exact arithmetic; in floating point the rounding
    differs (about 1e-16 relative in float64). Batch norm after it still takes its statistics over the S K grouped
    rows.
    """

    def __init__(self, cin: int, cout: int, samples: int, neighbours: int, fps: str = "kernel"):
        super().__init__()
        self.samples, self.neighbours, self.like_kernel = samples, neighbours, fps == "kernel"
        self.mlp = nn.Sequential(conv_bn(2 * cin, cout), conv_bn(cout, cout))

    def forward(self, xyz: torch.Tensor, feats: torch.Tensor):
        # xyz (B, N, 3), feats (B, N, C) -> new_xyz (B, S, 3), out (B, S, C_out)
        centres, new_xyz, groups = neighbourhoods(xyz, self.samples, self.neighbours, self.like_kernel)
        first, second = self.mlp
        c = feats.shape[-1]
        weight, bias, normalised = fold(first[0], first[1], cast=False)  # (C_out, 2C): [W_d | W_c] on [g - c, c]
        w_d, w_c = weight.split(c, dim=1)  # split, not sliced: a split's backward is one cat, each slice's a zero fill
        both = linear_rows(feats, torch.cat([w_d, w_c - w_d]))  # (B N, 2 C_out): W_d g, (W_c - W_d) g, every point
        h = group_rows(both, groups, centres, feats.shape[1], bias)  # (B, S, K, C_out) (+ BN's shift in eval)
        x = act_(h, first[2]) if normalised else bn_act(h, first[1], first[2])
        return new_xyz, conv_bn_act_max(x, second)  # (B, S, C_out)


class OffsetBlock(nn.Module):
    """PCT's offset-attention block ``x + ReLU(BN(conv(x - mixer(x))))`` around any mixer, on x (B, N, C)."""

    def __init__(self, channels: int, attn: Mapping):
        super().__init__()
        self.mixer = attention.build(**attn, dim=channels)
        self.conv = nn.Conv1d(channels, channels, 1)
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, layout) -> torch.Tensor:
        # x (B, N, C) -> (B, N, C)
        return x + linear_bn_act(x - self.mixer(x, layout), self.conv, self.norm, RELU)


def official_offset_blocks(state: Mapping[str, torch.Tensor], renames: list[tuple[str, str]],
                           prefix: str) -> dict[str, torch.Tensor]:
    """``state``, a PCT_Pytorch network's state dict, renamed by ``renames`` plus its four SA_Layers
    (``{prefix}sa1.`` ... ``sa4.``) as the offset blocks (``blocks.0.`` ...): each SA_Layer's ``q_conv.weight``,
    tied to (and saved beside) its ``k_conv.weight``, is the mixer's one ``qk``, and its 1x1 ``Conv1d`` projections
    (O, I, 1) are the mixer's ``Linear`` (O, I)."""
    for j in range(4):
        sa, block = f"{prefix}sa{j + 1}.", f"blocks.{j}."
        renames = [*renames, (sa + "q_conv.", block + "mixer.qk."), (sa + "v_conv.", block + "mixer.v."),
                   (sa + "trans_conv.", block + "conv."), (sa + "after_norm.", block + "norm.")]
    tied = {k for k in state if ".k_conv." in k and k.replace("k_conv", "q_conv") in state
            and torch.equal(state[k], state[k.replace("k_conv", "q_conv")])}
    out = take({k: v for k, v in state.items() if k not in tied}, renames)  # an untied k_conv stays unexpected
    for key in [k for k in out if ".mixer." in k and out[k].dim() == 3]:
        out[key] = out[key].squeeze(-1)  # Conv1d (O, I, 1) -> Linear (O, I)
    return out


class PCT(FoldingNetwork):
    official_weights: ClassVar[str] = ("PCT_Pytorch's model.t7 (Strawberry-Eat-Mango/PCT_Pytorch, its Pct network, "
                                       "saved from nn.DataParallel; attn=offset with its defaults)")

    def __init__(self, num_classes: int, attn: Mapping, embedding: str = "neighbor",
                 samples: Sequence[int] = (512, 256), neighbours: int = 32, dropout: float = 0.5,
                 layers: int = 4, fps: str = "kernel"):
        super().__init__()
        if embedding not in ("neighbor", "point"):
            raise UserError(f"model.embedding={embedding!r} is not known: use `neighbor` (PCT) or `point` (SPCT).")
        if fps not in FPS_RULES:
            raise UserError(f"model.fps={fps!r} is not known: use `kernel` (pointnet2_ops' CUDA kernel, which the "
                            "reference calls: points within sqrt(1e-3) of the origin are never sampled) or `plain` "
                            "(every point may be sampled).")
        if len(samples) != 2 or any(int(s) < 1 for s in samples):
            raise UserError(f"model.samples={list(samples)} must be two positive point counts, e.g. [512, 256].")
        if embedding == "neighbor" and (samples[1] > samples[0] or not 1 <= neighbours <= samples[0]):
            # the second stage samples its centres, and groups their neighbours, among the first stage's centres
            raise UserError(f"model.samples={list(samples)} with model.neighbours={neighbours}: the second stage "
                            "picks its centres and their neighbours among the first stage's centres, so it needs "
                            "model.samples[1] <= model.samples[0] and 1 <= model.neighbours <= model.samples[0] "
                            "(PCT: [512, 256] and 32).")
        self.embedding = embedding
        if embedding == "neighbor":
            self.embed = nn.Sequential(conv_bn(3, 64), conv_bn(64, 64))
            self.groups = nn.ModuleList([SampleAndGroup(64, 128, samples[0], neighbours, fps),
                                         SampleAndGroup(128, 256, samples[1], neighbours, fps)])
            width = 256
        else:
            self.embed = nn.Sequential(conv_bn(3, 128), conv_bn(128, 128))
            self.groups = nn.ModuleList()
            width = 128
        self.pre = nn.Sequential(conv_bn(width, width), conv_bn(width, width))
        self.blocks = nn.ModuleList([OffsetBlock(width, attn) for _ in range(layers)])
        self.fuse = ConvBNMax(width * (layers + 1), 1024, nn.LeakyReLU(0.2))  # then the max over the points
        self.head = nn.Sequential(
            nn.Linear(1024, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )
        self.min_points = max(samples) if embedding == "neighbor" else 1
        self.neighbours = neighbours

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PCT_Pytorch's ``Pct`` state dict in this network's keys (``module.`` already dropped by the loader).

        Its SA_Layer ties ``q_conv.weight`` to ``k_conv.weight`` (both saved), which is the offset mixer's one
        ``qk``; its 1x1 ``Conv1d`` projections (O, I, 1) are the mixer's ``Linear`` (O, I).
        """
        renames = [("conv1.", "embed.0.0."), ("bn1.", "embed.0.1."), ("conv2.", "embed.1.0."), ("bn2.", "embed.1.1."),
                   ("pt_last.conv1.", "pre.0.0."), ("pt_last.bn1.", "pre.0.1."), ("pt_last.conv2.", "pre.1.0."),
                   ("pt_last.bn2.", "pre.1.1."), ("conv_fuse.0.", "fuse.0."), ("conv_fuse.1.", "fuse.1."),
                   ("linear1.", "head.0."), ("bn6.", "head.1."), ("linear2.", "head.4."), ("bn7.", "head.5."),
                   ("linear3.", "head.8.")]
        for i in range(2):
            local, group = f"gather_local_{i}.", f"groups.{i}.mlp."
            renames += [(local + "conv1.", group + "0.0."), (local + "bn1.", group + "0.1."),
                        (local + "conv2.", group + "1.0."), (local + "bn2.", group + "1.1.")]
        return official_offset_blocks(state, renames, "pt_last.")

    def fold_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """Every (1x1 conv, batch norm) pair that :func:`fold` folds in eval mode (:func:`folded_for_inference`)."""
        layers = [*self.embed, *(layer for group in self.groups for layer in group.mlp), *self.pre, self.fuse]
        return [(layer[0], layer[1]) for layer in layers] + [(block.conv, block.norm) for block in self.blocks]

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        # xyz (B, N, 3) -> logits (B, classes)
        if xyz.shape[1] < self.min_points or xyz.shape[1] < self.neighbours:
            raise UserError(f"PCT got {xyz.shape[1]} points per shape but samples {self.min_points} centres with "
                            f"{self.neighbours} neighbours; raise data.npoints or lower model.samples/model.neighbours.")
        with folded_for_inference(self), counted_once(self):
            b, n, _ = xyz.shape
            feats = self.embed(rows(xyz)).view(b, n, -1)  # (B, N, C): the layers on (B N, .) rows, one view each way
            for group in self.groups:
                xyz, feats = group(xyz, feats)  # (B, S, 3), (B, S, C)
            layout = attention.Points(xyz)
            x = self.pre(rows(feats)).view(feats.shape[0], feats.shape[1], -1)  # (B, S, C)
            outs = []
            for block in self.blocks:
                x = block(x, layout)
                outs.append(x)
            return self.head(self.fuse(torch.cat(outs + [feats], dim=-1)))  # (B, 1024) -> (B, classes)


class PCTPartSeg(FoldingNetwork):
    """PCT part segmentation, as the reference (Jittor PCT and its PyTorch ports, ``Point_Transformer_partseg``).

        xyz (+ normals) (B, N, 3|6)
        point embedding   conv 3->128->128 + BN + ReLU (no neighbour embedding)
        transformer       4 offset blocks at 128 channels, concatenated (512)
                          -> conv 512->1024 + BN + LeakyReLU(0.2)
        global features   max and mean over points (1024 each), the category one-hot
                          through conv C->64 + BN + LeakyReLU(0.2), repeated over points
        head              [3136] -> conv 512 + BN + ReLU -> dropout -> conv 256 + BN + ReLU
                          -> conv parts

    With ``attn=offset``, 16 categories and 50 parts: 2,446,130 trainable parameters. Equal, in float64, to the
    authors' Jittor ``Point_Transformer_partseg`` (MenghaoGuo/PCT@b7152d6, networks/seg/pct_partseg.py, xyz input)
    in torch's key layout: tests/tasks/test_pct_partseg_official.py.
    """

    official_weights: ClassVar[str] = ("the authors' Point_Transformer_partseg keys (MenghaoGuo/PCT, "
                                       "networks/seg/pct_partseg.py, as a PyTorch state dict; no checkpoint is "
                                       "released; attn=offset with its defaults, 16 categories, xyz input)")

    def __init__(self, num_parts: int, num_categories: int, attn: Mapping, in_channels: int = 3,
                 dropout: float = 0.5, layers: int = 4, width: int = 128):
        super().__init__()
        self.num_categories = num_categories
        self.embed = nn.Sequential(conv_bn(in_channels, width), conv_bn(width, width))
        self.blocks = nn.ModuleList([OffsetBlock(width, attn) for _ in range(layers)])
        self.fuse = conv_bn(width * layers, 1024, nn.LeakyReLU(0.2))
        self.category = conv_bn(num_categories, 64, nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Conv1d(3 * 1024 + 64, 512, 1), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(dropout),
            nn.Conv1d(512, 256, 1), nn.BatchNorm1d(256), nn.ReLU(),
            nn.Conv1d(256, num_parts, 1),
        )

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``Point_Transformer_partseg``'s state dict (torch layout: Conv1d weights (O, I, 1)) in this network's keys.

        As in ``PCT.from_official``, each SA_Layer's tied ``q_conv``/``k_conv`` weight is the offset mixer's ``qk``.
        """
        renames = [("conv1.", "embed.0.0."), ("bn1.", "embed.0.1."), ("conv2.", "embed.1.0."), ("bn2.", "embed.1.1."),
                   ("conv_fuse.", "fuse."), ("label_conv.", "category."), ("convs1.", "head.0."),
                   ("bns1.", "head.1."), ("convs2.", "head.4."), ("bns2.", "head.5."), ("convs3.", "head.7.")]
        return official_offset_blocks(state, renames, "")

    def fold_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """Every (1x1 conv, batch norm) pair that :func:`fold` folds in eval mode (:func:`folded_for_inference`)."""
        layers = [*self.embed, self.fuse, self.category]
        return ([(layer[0], layer[1]) for layer in layers] + [(block.conv, block.norm) for block in self.blocks]
                + [(self.head[0], self.head[1]), (self.head[4], self.head[5])])

    def forward(self, points: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        # points (B, N, 3 or 6) with xyz first, category (B,) -> part logits (B, parts, N)
        with folded_for_inference(self), counted_once(self):
            layout = attention.Points(points[..., :3])
            b, n, _ = points.shape
            x = self.embed(rows(points)).view(b, n, -1)  # (B, N, 128): the layers on (B N, .) rows
            outs = []
            for block in self.blocks:
                x = block(x, layout)
                outs.append(x)
            x = self.fuse(torch.cat(outs, dim=-1))  # (B, N, 1024)
            # one-hot by a scatter: F.one_hot reads the categories' min and max on the host (a GPU sync); a scatter
            # checks its indices itself (an IndexError on the CPU, a device-side assert on a GPU)
            one_hot = x.new_zeros(len(category), self.num_categories).scatter_(1, category[:, None], 1.0)  # (B, cats)
            glob = torch.cat([max_over(x), x.mean(dim=1), self.category(one_hot)], dim=-1)  # (B, 2048 + 64)
            # The head's first conv sees [x, glob] at every point: W = [W_x | W_g] gives W_x x + W_g glob, W_g glob
            # once per shape, instead of a (B, N, 3136) input (equal in exact arithmetic).
            conv, bn, act, drop, *rest = self.head
            weight, bias, normalised = fold(conv, bn)  # (512, 3136)
            c = x.shape[-1]
            w_x, w_g = weight.split([c, weight.shape[1] - c], dim=1)  # (512, 1024), (512, 2112): split, not sliced
            h = linear_rows(x, w_x).view(b, n, -1) + F.linear(glob, w_g, bias).unsqueeze(1)  # (B, N, 512)
            x = drop(act_(h.view(b * n, -1), act) if normalised else bn_act(h.view(b * n, -1), bn, act))  # (B N, 512)
            x = linear_bn_act(x, *rest[:3])  # (B N, 256)
            logits = F.linear(x, rest[3].weight.squeeze(-1), rest[3].bias)  # (B N, parts)
            return logits.view(b, n, -1).transpose(1, 2)  # (B, parts, N)
