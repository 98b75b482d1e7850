"""Semantic-segmentation metrics and evaluation-time inference (whole / slide / multi-scale + flip).

Metrics. :class:`SegConfusion` accumulates one (K, K) confusion matrix over a
whole split (rows = true class, columns = predicted class, ``ignore_index``
pixels dropped) and sums it across DDP ranks; :func:`scores` turns that matrix
into the usual numbers: mIoU and pixel accuracy (ADE20K / Cityscapes, mmseg's
conventions) and OA, AA, Kappa, mIoU, F1 (the LAM paper's GID protocol).
Scoring the summed matrix, not averaging per-batch scores, is what makes the
numbers independent of batch size and rank count.

The metric is written here rather than taken from torchmetrics'
``MulticlassConfusionMatrix``: that class does the same bincount, but its
argument validation only counts *distinct* target values (a target holding
{0, 7} with K = 3 passes and then fails inside ``reshape`` with an unrelated
message) and costs a ``torch.unique`` sort per batch, while without validation
an out-of-range label silently corrupts or crashes the count. Here a min/max
range check (one device sync per batch) raises a ValueError naming the bad
labels.

Inference. ``model`` is any callable mapping an image batch (B, 3, H, W) to
logits (B, K, h, w) at any resolution; every helper upsamples logits
bilinearly (``align_corners=False``) to the size of the image it fed in.
:func:`predict_slide` is mmseg's ``slide_inference``; :func:`predict` adds
test-time augmentation as mmseg's aug_test does it (image rescaled by each
ratio, optional horizontal flip, softmax probabilities averaged), but from the
image at its original size: mmseg's test pipelines for ADE20K and VOC first
resize it to fit (2048, 512), which is not done here (docs/recipes.md). The helpers do not change the
grad mode: call them under ``torch.inference_mode()`` (Lightning's
validation/test loops already do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from attention.errors import UserError

Model = Callable[[Tensor], Tensor]


class SegConfusion(Metric):
    """(K, K) int64 confusion matrix over a split; rows = true class, columns = predicted.

    ``update(preds, target)``: ``target`` (B, H, W) integer labels in [0, K) or
    ``ignore_index``; ``preds`` either predicted indices with the target's
    shape or logits / probabilities (B, K, H, W) (argmax over dim 1). Pixels
    whose target is ``ignore_index`` are never counted, whatever their
    prediction. ``compute()`` returns the matrix (states are summed across
    ranks); feed it to :func:`scores`.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, num_classes: int, ignore_index: int | None = 255, **kwargs):
        super().__init__(**kwargs)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes = int(num_classes)
        self.ignore_index = ignore_index
        self.add_state("confmat", torch.zeros(num_classes, num_classes, dtype=torch.int64),
                       dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        k = self.num_classes
        if preds.ndim == target.ndim + 1:
            if preds.shape[1] != k or preds.shape[:1] + preds.shape[2:] != target.shape:
                raise ValueError(f"logits {tuple(preds.shape)} do not match target {tuple(target.shape)} "
                                 f"with {k} classes; expected (B, {k}, ...) for target (B, ...)")
            preds = preds.argmax(dim=1)
        elif preds.shape != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} differ; expected "
                             f"class indices with the target's shape or logits (B, {k}, ...)")
        elif preds.is_floating_point():
            raise ValueError("preds with the target's shape must be integer class indices, "
                             f"got {preds.dtype}; pass logits as (B, {k}, ...)")
        if target.is_floating_point():
            raise ValueError(f"target must hold integer labels, got {target.dtype}")
        target = target.reshape(-1).long()
        preds = preds.reshape(-1).long()
        if self.ignore_index is not None:
            keep = target != self.ignore_index
            target, preds = target[keep], preds[keep]
        if target.numel() == 0:
            return
        bad_target = (target < 0) | (target >= k)
        bad_preds = (preds < 0) | (preds >= k)
        if bool(bad_target.any() | bad_preds.any()):  # one sync for both checks
            for name, values, bad in (("target", target, bad_target), ("preds", preds, bad_preds)):
                if bool(bad.any()):
                    found = torch.unique(values[bad]).tolist()
                    ignore = "" if self.ignore_index is None else f" or ignore_index={self.ignore_index}"
                    raise ValueError(f"{name} holds class ids {found[:20]} outside [0, {k}){ignore}")
        counts = torch.bincount(target * k + preds, minlength=k * k)
        self.confmat += counts.reshape(k, k)

    def compute(self) -> Tensor:
        return self.confmat


def scores(confusion: Tensor, class_names: Sequence[str] | None = None) -> dict[str, Tensor | float]:
    """Segmentation scores from one (K, K) confusion matrix (rows = true, columns = predicted).

    Computed in float64; scalars come back as 0-dim float64 tensors:

    * ``miou``: mean over classes of IoU = TP / (TP + FP + FN). A class absent
      from both target and prediction (denominator 0) has no IoU and is left
      out of the mean (mmseg's nanmean convention); a class only predicted, or
      only in the target, counts with IoU 0.
    * ``pixel_acc``: overall accuracy (OA) = trace / total.
    * ``aa``: average accuracy = mean over classes present in the target of
      the per-class recall TP / (TP + FN).
    * ``kappa``: Cohen's kappa (p_o - p_e) / (1 - p_e), p_o = OA,
      p_e = sum_k row_k * col_k / total^2 (NaN when p_e = 1, e.g. a single class).
    * ``f1``: mean over classes present in target or prediction of
      2 TP / (2 TP + FP + FN) (the macro F1).
    * ``iou`` (K,): per-class IoU, NaN for absent classes; ``acc`` (K,):
      per-class recall, NaN for classes absent from the target.

    With ``class_names`` (length K), also ``"iou/<name>"`` and ``"acc/<name>"``
    as Python floats, only for the classes that have that score (no NaNs to log).
    An empty matrix gives NaN everywhere.
    """
    if confusion.ndim != 2 or confusion.shape[0] != confusion.shape[1]:
        raise ValueError(f"confusion must be a square (K, K) matrix, got {tuple(confusion.shape)}")
    k = confusion.shape[0]
    if class_names is not None and len(class_names) != k:
        raise ValueError(f"{len(class_names)} class names for a {k}-class confusion matrix")
    cm = confusion.detach().to(torch.float64)
    tp = cm.diagonal()
    rows = cm.sum(1)  # true pixels per class: TP + FN
    cols = cm.sum(0)  # predicted pixels per class: TP + FP
    total = cm.sum()
    nan = torch.tensor(torch.nan, dtype=torch.float64, device=cm.device)

    union = rows + cols - tp
    iou = torch.where(union > 0, tp / union.clamp_min(1), nan)
    acc = torch.where(rows > 0, tp / rows.clamp_min(1), nan)
    f1_per = torch.where(union > 0, 2 * tp / (rows + cols).clamp_min(1), nan)

    def nanmean(x: Tensor) -> Tensor:
        seen = ~x.isnan()
        return x[seen].mean() if bool(seen.any()) else nan

    p_o = tp.sum() / total if total > 0 else nan
    p_e = (rows * cols).sum() / total**2 if total > 0 else nan
    kappa = (p_o - p_e) / (1 - p_e) if bool(p_e < 1) else nan
    out: dict[str, Tensor | float] = {
        "miou": nanmean(iou),
        "pixel_acc": p_o,
        "aa": nanmean(acc),
        "kappa": kappa,
        "f1": nanmean(f1_per),
        "iou": iou,
        "acc": acc,
    }
    if class_names is not None:
        for prefix, values in (("iou", iou), ("acc", acc)):
            for name, value in zip(class_names, values.tolist()):
                if value == value:  # not NaN
                    out[f"{prefix}/{name}"] = value
    return out


def undefined_scores(confusion: Tensor, class_names: Sequence[str] | None = None) -> dict[str, str]:
    """The scalar scores that :func:`scores` leaves NaN because the split's pixels leave them undefined, not because
    of a non-finite prediction: name -> why. Kappa, where the chance agreement p_e is 1: target and prediction are
    one and the same class in every scored pixel, so p_o = 1 too and (p_o - p_e) / (1 - p_e) is 0 / 0 (scikit-learn
    and torchmetrics give NaN there as well; the field is split between NaN, 0 and 1, and NaN claims nothing). An
    empty matrix (no pixel scored) is not listed: nothing was evaluated, every score is NaN."""
    cm = confusion.detach().to(torch.float64)
    total = cm.sum()
    if not bool(total > 0):
        return {}
    p_e = (cm.sum(1) * cm.sum(0)).sum() / total**2
    if bool(p_e < 1):
        return {}
    (cls,) = torch.nonzero(cm.sum(1)).flatten().tolist()
    named = f"class {cls}" + (f" ({class_names[cls]})" if class_names is not None else "")
    return {"kappa": f"undefined: every one of the split's {int(total)} scored pixels is {named} in both the "
                     "target and the prediction, so Cohen's kappa (p_o - p_e) / (1 - p_e) is 0 / 0"}


def _resize(x: Tensor, size: tuple[int, int]) -> Tensor:
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def _pair(value, option: str) -> tuple[int, int]:
    # ints only: int() would turn "3", 2.7 or true into a window size without a word
    try:
        h, w = (value, value) if isinstance(value, int) else value
    except (TypeError, ValueError):
        h = w = None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (h, w)):
        raise UserError(f"{option}={value!r} is not valid: {option} must be positive, an integer or a pair "
                        f"[height, width] of integers, e.g. {option}=341 or {option}=[341,341]. Fix it on the "
                        "command line or in its config (configs/task/segmentation.yaml, configs/data/).")
    return h, w


def _windows(crop, stride) -> tuple[tuple[int, int], tuple[int, int]]:
    """``data.crop`` and ``eval.stride`` of slide inference, checked: positive pairs, the stride no larger."""
    (ch, cw), (sh, sw) = _pair(crop, "data.crop"), _pair(stride, "eval.stride")
    if sh > ch or sw > cw:
        raise UserError(f"eval.stride={[sh, sw]} is larger than data.crop={[ch, cw]}: slide windows would "
                        "leave gaps; use a stride <= the crop (mmseg: about 2/3 of it).")
    return (ch, cw), (sh, sw)


def check_eval(mode: str = "whole", crop=None, stride=None, scales: Sequence[float] = (1.0,),
               flip: bool = False) -> list[float]:
    """The ``eval`` options of :func:`predict` checked, each refusal a UserError naming the option; returns the
    scale ratios as floats. The one home of these rules: :func:`predict` applies them, and so does
    ``task=segmentation`` at start-up (``Segmentation.check_config``), before any data is read or trained on.
    ``stride``: None is the caller's default (2/3 of the crop); a value given must be positive. ``crop`` None:
    not known yet (a data set whose crop defaults to its size), checked when known."""
    if mode not in ("whole", "slide"):
        raise UserError(f"eval.mode={mode!r} is not one of 'whole', 'slide'.")
    try:
        ratios = [scales] if isinstance(scales, (int, float)) else list(scales)
    except TypeError:
        ratios = []
    if not ratios or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s < float("inf")
                             for s in ratios):
        raise UserError(f"eval.scales={scales!r} must be a non-empty list of positive ratios, e.g. [1.0] "
                        "or [0.5, 0.75, 1.0, 1.25, 1.5, 1.75].")
    if not isinstance(flip, bool):  # bool("false"), bool("no") are True: flip testing would run, recorded as on
        raise UserError(f"eval.flip={flip!r} is not valid: eval.flip must be true (also predict the horizontally "
                        "flipped image and average the probabilities) or false, a boolean, not a string or a "
                        "number. Write eval.flip=true or eval.flip=false, unquoted, on the command line or in "
                        "configs/task/segmentation.yaml.")
    if stride is not None:
        _pair(stride, "eval.stride")
    if mode == "slide" and crop is not None and stride is not None:  # crop None: a data set's default (blobs)
        _windows(crop, stride)
    return [float(s) for s in ratios]


def predict_whole(model: Model, image: Tensor) -> Tensor:
    """Logits (B, K, H, W) of the whole image (B, 3, H, W), upsampled to its size."""
    return _resize(model(image), tuple(image.shape[-2:]))


def predict_slide(model: Model, image: Tensor, crop: tuple[int, int], stride: tuple[int, int],
                  num_classes: int) -> Tensor:
    """mmseg's slide inference (``EncoderDecoder.slide_inference``): logits (B, K, H, W) averaged over windows.

    Windows of size ``crop`` = (ch, cw) every ``stride`` = (sh, sw) pixels; the
    grid has ``max(H - ch + sh - 1, 0) // sh + 1`` rows (likewise columns) and
    the last window is shifted back to end at the border (``y1 = min(y1, H - ch)``),
    so every pixel is covered. Along a side shorter than the crop, the window is
    the whole side, run as it is (mmseg: "the small patch will be used to decode
    without padding"; the network pads to its own size divisor, as in whole
    mode), so an image no larger than the crop gives its whole-mode logits. Each
    window's logits are upsampled to the window size, summed into place, and
    divided by the number of windows covering each pixel.
    """
    (ch, cw), (sh, sw) = _windows(crop, stride)
    b, _, h, w = image.shape
    h_grids = max(h - ch + sh - 1, 0) // sh + 1
    w_grids = max(w - cw + sw - 1, 0) // sw + 1
    # float32 sums of half-precision windows (autocast); float64 under trainer.precision=64-true
    dtype = torch.promote_types(image.dtype, torch.float32)
    logits = image.new_zeros((b, num_classes, h, w), dtype=dtype)
    count = image.new_zeros((1, 1, h, w), dtype=dtype)
    for i in range(h_grids):
        for j in range(w_grids):
            y1, x1 = i * sh, j * sw
            y2, x2 = min(y1 + ch, h), min(x1 + cw, w)
            y1, x1 = max(y2 - ch, 0), max(x2 - cw, 0)
            out = _resize(model(image[:, :, y1:y2, x1:x2]), (y2 - y1, x2 - x1))
            if out.shape[1] != num_classes:
                raise ValueError(f"model gave {out.shape[1]} channels, expected num_classes={num_classes}")
            logits[:, :, y1:y2, x1:x2] += out.to(dtype)
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


def predict(model: Model, image: Tensor, mode: str = "whole", crop: tuple[int, int] | None = None,
            stride: tuple[int, int] | None = None, scales: Sequence[float] = (1.0,), flip: bool = False,
            num_classes: int | None = None) -> Tensor:
    """Class probabilities (B, K, H, W) for image (B, 3, H, W), with test-time augmentation as mmseg's (applied
    to the image as given: mmseg's ADE20K/VOC test pipelines resize it to fit (2048, 512) first, not done here).

    For each ratio in ``scales`` the image is resized (bilinear,
    ``align_corners=False``) to ``(int(H * s + 0.5), int(W * s + 0.5))``, run
    with :func:`predict_whole` (``mode="whole"``) or :func:`predict_slide`
    (``mode="slide"``, needs ``crop``, ``stride`` and ``num_classes``), its
    logits resized back to (H, W) and softmaxed; with ``flip`` the horizontally
    flipped image is run too and its output flipped back. The result is the
    mean of those probabilities (always probabilities, even for one scale
    without flip; the argmax is the same as the logits').
    """
    ratios = check_eval(mode, crop, stride, scales, flip)
    if mode == "slide":
        if crop is None:
            raise UserError("eval.mode='slide' needs data.crop (the window size [height, width]).")
        if stride is None:
            raise UserError("eval.mode='slide' needs eval.stride (the window step [height, width]).")
        if num_classes is None:
            raise ValueError("predict(mode='slide') needs num_classes")
    h, w = image.shape[-2:]
    total = None
    runs = 0
    for s in ratios:
        scaled = image if s == 1 else _resize(image, (max(1, int(h * s + 0.5)), max(1, int(w * s + 0.5))))
        for flipped in (False, True) if flip else (False,):
            x = scaled.flip(-1) if flipped else scaled
            if mode == "whole":
                out = predict_whole(model, x)
            else:
                out = predict_slide(model, x, crop, stride, num_classes)
            out = out.to(torch.promote_types(out.dtype, torch.float32))  # half to float32; float64 stays
            out = _resize(out, (h, w)).softmax(dim=1)
            if flipped:
                out = out.flip(-1)
            total = out if total is None else total + out
            runs += 1
    return total / runs
