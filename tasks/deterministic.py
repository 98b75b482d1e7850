"""Deterministic formulations of the two ops of the training paths that have no deterministic CUDA kernel.

With ``trainer.deterministic=true`` Lightning calls ``torch.use_deterministic_algorithms(True)``
(``suite/determinism.py`` says what else is set): every op then either runs a deterministic kernel or raises a
``RuntimeError``. Of the ops the tasks train through, two raise on a GPU, both because their CUDA kernels accumulate
with ``atomicAdd`` in an order that changes from run to run:

- ``F.cross_entropy`` over (B, K, ...) logits with a ``mean`` or ``sum`` reduction (``nll_loss2d``'s forward):
  part segmentation (B, parts, N) and semantic segmentation (B, K, H, W);
- ``F.interpolate(mode="bilinear")``'s backward: the segmentation network's upsampling of its logits and features.

Each function below is the torch op, except when deterministic algorithms are on and the input is on a GPU: then it
computes the same function from ops that have deterministic kernels (per-element losses summed by a reduction,
matrix products). Elsewhere (every CPU run, every GPU run without ``trainer.deterministic``) the torch op runs, so
nothing changes there; the two forms agree to float rounding (``tests/tasks/test_deterministic.py``).

The other accumulating ops of the suite have deterministic CUDA kernels that torch selects itself in deterministic
mode: ``index_add_``, ``scatter_add_`` and ``gather``'s backward (PCT's fused grouping and max, focal attention on
point sets), ``index_put_`` with ``accumulate=True`` (the backward of advanced indexing), ``index_select``'s and
``nn.Embedding``'s backward; nearest-neighbour upsampling (SAGAN's generator) and 2-D max and average pooling
accumulate per input element.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _needs_replacement(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.are_deterministic_algorithms_enabled()


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, force: bool = False) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., label_smoothing=...)`` with its mean reduction over the
    targets that are not ``ignore_index``. logits (B, K, ...) and target (B, ...) of class ids. Replaced where the
    torch op would be nondeterministic (or with ``force``, for tests) by per-element losses and their sum."""
    if not force and (logits.dim() <= 2 or not _needs_replacement(logits)):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)
    per_element = F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  reduction="none")  # (B, ...), 0 where ignored; no atomics
    counted = (target != ignore_index).sum()
    return per_element.sum() / counted.to(per_element.dtype)  # NaN when every target is ignored, as torch's mean


def _bilinear_matrix(size_in: int, size_out: int, like: torch.Tensor) -> torch.Tensor:
    """(size_out, size_in) weights of ``align_corners=False`` bilinear resampling along one axis, as torch computes
    them when an output size is given: source coordinate (i + 0.5) * size_in / size_out - 0.5, clamped at 0."""
    scale = size_in / size_out
    src = ((torch.arange(size_out, device=like.device, dtype=torch.float64) + 0.5) * scale - 0.5).clamp(min=0)
    low = src.floor().long().clamp(max=size_in - 1)  # (size_out,)
    high = (low + 1).clamp(max=size_in - 1)
    frac = src - low
    weights = torch.zeros(size_out, size_in, device=like.device, dtype=torch.float64)
    rows = torch.arange(size_out, device=like.device)
    weights.index_put_((rows, low), 1 - frac, accumulate=True)
    weights.index_put_((rows, high), frac, accumulate=True)
    return weights.to(like.dtype)


def resize_bilinear(x: torch.Tensor, size, force: bool = False) -> torch.Tensor:
    """``F.interpolate(x, size=size, mode="bilinear", align_corners=False)`` of x (B, C, H, W) -> (B, C, *size).

    Replaced, where its backward would be nondeterministic (or with ``force``, for tests), by the separable form
    ``A_h @ x @ A_w^T`` with (out, in) interpolation matrices, whose backward is two matrix products."""
    if not force and not (x.requires_grad and _needs_replacement(x)):
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    (h, w), (out_h, out_w) = x.shape[-2:], tuple(size)
    with torch.autocast(x.device.type, enabled=False):  # in x's own dtype, as F.interpolate computes
        rows = _bilinear_matrix(h, out_h, x)  # (out_h, H)
        cols = _bilinear_matrix(w, out_w, x)  # (out_w, W)
        return rows @ x @ cols.T  # (B, C, out_h, W) then (B, C, out_h, out_w)
