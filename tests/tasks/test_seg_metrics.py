"""Segmentation confusion matrix, scores and slide / multi-scale inference against hand and reference values."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, cohen_kappa_score, f1_score, jaccard_score

from attention.errors import UserError
from tasks.metrics.segmentation import SegConfusion, predict, predict_slide, predict_whole, scores, undefined_scores

# ---------------------------------------------------------------- hand-computed 3-class case
# 15 pixels, 4 of them ignored (255, predictions 0, 1, 2, 2 must not count).
TARGET = torch.tensor([[[0, 0, 0, 0, 1],
                        [1, 1, 1, 2, 2],
                        [2, 255, 255, 255, 255]]])
PRED = torch.tensor([[[0, 0, 1, 2, 0],
                      [1, 1, 1, 1, 2],
                      [2, 0, 1, 2, 2]]])
# Kept (true, pred) pairs: (0,0) x2, (0,1), (0,2), (1,0), (1,1) x3, (2,1), (2,2) x2.
CONFUSION = torch.tensor([[2, 1, 1],
                          [1, 3, 0],
                          [0, 1, 2]])
# rows (true) 4, 4, 3; columns (pred) 3, 5, 3; total 11; trace 7.
IOU = [2 / 5, 3 / 6, 2 / 4]  # TP / (row + col - TP)
RECALL = [2 / 4, 3 / 4, 2 / 3]  # TP / row
F1 = [4 / 7, 6 / 9, 4 / 6]  # 2 TP / (row + col)
MIOU = 7 / 15
PIXEL_ACC = 7 / 11
AA = 23 / 36
KAPPA = 9 / 20  # p_o = 77/121, p_e = (4*3 + 4*5 + 3*3)/121 = 41/121 -> 36/80
F1_MEAN = 40 / 63


def _close(actual, expected):
    actual = actual.item() if isinstance(actual, torch.Tensor) else actual
    assert math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-12), (actual, expected)


def test_hand_computed_confusion_and_scores():
    metric = SegConfusion(3)
    metric.update(PRED, TARGET)
    cm = metric.compute()
    assert cm.dtype == torch.int64
    assert torch.equal(cm, CONFUSION)
    out = scores(cm)
    _close(out["miou"], MIOU)
    _close(out["pixel_acc"], PIXEL_ACC)
    _close(out["aa"], AA)
    _close(out["kappa"], KAPPA)
    _close(out["f1"], F1_MEAN)
    assert out["iou"].dtype == torch.float64
    torch.testing.assert_close(out["iou"], torch.tensor(IOU, dtype=torch.float64))
    torch.testing.assert_close(out["acc"], torch.tensor(RECALL, dtype=torch.float64))
    # the derived means agree with the per-class literals
    _close(out["miou"], sum(IOU) / 3)
    _close(out["aa"], sum(RECALL) / 3)
    _close(out["f1"], sum(F1) / 3)


def test_class_names_add_per_class_floats():
    out = scores(CONFUSION, ["road", "tree", "water"])
    assert out["iou/road"] == pytest.approx(2 / 5) and isinstance(out["iou/road"], float)
    assert out["acc/water"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="class names"):
        scores(CONFUSION, ["road"])


def test_ignored_pixels_never_counted_whatever_their_prediction():
    metric = SegConfusion(3)
    metric.update(torch.tensor([[[255, 255, 1]]]), torch.tensor([[[255, 255, 255]]]))  # all ignored
    assert metric.compute().sum() == 0
    other = PRED.clone()
    other[TARGET == 255] = torch.tensor([2, 2, 0, 1])
    metric.update(other, TARGET)
    assert torch.equal(metric.compute(), CONFUSION)
    custom = SegConfusion(3, ignore_index=-1)
    custom.update(PRED, torch.where(TARGET == 255, -1, TARGET))
    assert torch.equal(custom.compute(), CONFUSION)


def test_logits_input_equals_argmax_input():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, 7, generator=g)
    target = torch.randint(0, 4, (2, 6, 7), generator=g)
    target[0, :2] = 255
    a, b = SegConfusion(4), SegConfusion(4)
    a.update(logits, target)
    b.update(logits.argmax(1), target)
    assert torch.equal(a.compute(), b.compute())
    assert a.compute().sum() == (target != 255).sum()


def test_accumulation_equals_single_update_and_merge_sums():
    g = torch.Generator().manual_seed(1)
    preds = torch.randint(0, 5, (6, 8, 9), generator=g)
    target = torch.randint(0, 5, (6, 8, 9), generator=g)
    target[torch.rand(6, 8, 9, generator=g) < 0.2] = 255
    whole = SegConfusion(5)
    whole.update(preds, target)
    parts = SegConfusion(5)
    for i in range(0, 6, 2):
        parts.update(preds[i:i + 2], target[i:i + 2])
    assert torch.equal(parts.compute(), whole.compute())
    # the state reduces by sum across ranks: two ranks' halves, stacked and reduced as torchmetrics' sync does (its
    # gathered states, then the state's dist_reduce_fx), give the whole
    left, right = SegConfusion(5), SegConfusion(5)
    left.update(preds[:3], target[:3])
    right.update(preds[3:], target[3:])
    reduced = left._reductions["confmat"](torch.stack([left.confmat, right.confmat]))
    assert torch.equal(reduced, whole.compute())
    whole.reset()
    assert whole.confmat.sum() == 0


def test_out_of_range_labels_raise_naming_them():
    metric = SegConfusion(3)
    with pytest.raises(ValueError, match=r"target.*\[-1, 7\]"):
        metric.update(torch.zeros(1, 2, 3, dtype=torch.long),
                      torch.tensor([[[0, 7, 255], [-1, 2, 7]]]))
    with pytest.raises(ValueError, match=r"preds.*\[3\]"):
        metric.update(torch.tensor([[[0, 3]]]), torch.tensor([[[0, 1]]]))
    with pytest.raises(ValueError, match="3 classes"):
        metric.update(torch.randn(1, 4, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="differ"):
        metric.update(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 2, dtype=torch.long))
    assert metric.compute().sum() == 0  # nothing partially counted


def test_absent_class_is_nan_and_left_out_of_means():
    cm = torch.zeros(4, 4, dtype=torch.long)
    cm[:3, :3] = CONFUSION  # class 3 in neither target nor prediction
    out = scores(cm)
    assert math.isnan(out["iou"][3]) and math.isnan(out["acc"][3])
    _close(out["miou"], MIOU)
    _close(out["aa"], AA)
    _close(out["f1"], F1_MEAN)
    _close(out["kappa"], KAPPA)
    assert "iou/d" not in scores(cm, ["a", "b", "c", "d"])
    # a class only predicted counts with IoU 0 in miou but is absent from aa
    cm[0, 3] = 1
    out = scores(cm)
    assert out["iou"][3] == 0 and math.isnan(out["acc"][3])
    _close(out["miou"], (2 / 6 + 3 / 6 + 2 / 4 + 0) / 4)
    _close(out["aa"], (2 / 5 + 3 / 4 + 2 / 3) / 3)


def test_empty_matrix_gives_nan():
    out = scores(torch.zeros(3, 3, dtype=torch.long))
    assert all(math.isnan(out[key]) for key in ("miou", "pixel_acc", "aa", "kappa", "f1"))


def test_kappa_of_one_class_everywhere_is_undefined_and_said_so():
    """Target and prediction one class in every pixel: p_o = p_e = 1, kappa 0 / 0 (scikit-learn: NaN too). It is
    NaN, and undefined_scores names it, the class and why, so that trainer.on_nan's check does not take it for a
    diverged network. Every other score is defined there, and nothing is undefined once a second class appears."""
    cm = torch.zeros(3, 3, dtype=torch.long)
    cm[1, 1] = 7
    out = scores(cm)
    with warnings.catch_warnings():  # scikit-learn warns that the score is undefined, and gives NaN
        warnings.simplefilter("ignore")
        assert math.isnan(out["kappa"]) and math.isnan(cohen_kappa_score([1] * 7, [1] * 7))
    assert float(out["miou"]) == 1.0 and float(out["pixel_acc"]) == 1.0 and float(out["f1"]) == 1.0
    assert undefined_scores(cm, ["a", "b", "c"]) == {
        "kappa": "undefined: every one of the split's 7 scored pixels is class 1 (b) in both the target and the "
                 "prediction, so Cohen's kappa (p_o - p_e) / (1 - p_e) is 0 / 0"}
    assert "class 1 in both" in undefined_scores(cm)["kappa"]
    cm[1, 2] = 1  # one pixel predicted otherwise: p_e < 1, kappa defined (0 here: no agreement beyond chance)
    assert undefined_scores(cm) == {} and float(scores(cm)["kappa"]) == pytest.approx(
        cohen_kappa_score([1] * 8, [1] * 7 + [2]), abs=1e-12)
    cm[:] = 0
    cm[0, 0], cm[2, 2] = 3, 4  # two classes, both right: kappa 1
    assert undefined_scores(cm) == {} and float(scores(cm)["kappa"]) == 1.0
    assert undefined_scores(torch.zeros(3, 3, dtype=torch.long)) == {}  # nothing scored: not "undefined by the data"


def test_random_case_matches_sklearn():
    g = torch.Generator().manual_seed(2)
    k = 6  # labels drawn from 0..4 only: class 5 absent, class 4 only predicted
    target = torch.randint(0, 4, (3, 10, 11), generator=g)
    preds = torch.where(torch.rand(3, 10, 11, generator=g) < 0.6, target,
                        torch.randint(0, 5, (3, 10, 11), generator=g))
    target[torch.rand(3, 10, 11, generator=g) < 0.1] = 255
    metric = SegConfusion(k)
    metric.update(preds, target)
    out = scores(metric.compute())
    keep = target != 255
    t, p = target[keep].numpy(), preds[keep].numpy()
    present = sorted(set(t.tolist()) | set(p.tolist()))
    assert present == [0, 1, 2, 3, 4]
    _close(out["kappa"], cohen_kappa_score(t, p))
    _close(out["f1"], f1_score(t, p, labels=present, average="macro"))
    _close(out["miou"], jaccard_score(t, p, labels=present, average="macro"))
    _close(out["pixel_acc"], (t == p).mean())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "y_pred contains classes not in y_true"
        _close(out["aa"], balanced_accuracy_score(t, p))
    assert math.isnan(out["iou"][5]) and out["iou"][4] == 0


# ---------------------------------------------------------------- inference helpers
K = 4


def _pointwise():
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, K, 1)


class WindowMean(torch.nn.Module):
    """Pointwise logits plus the window's mean logit: output depends on the window."""

    def __init__(self):
        super().__init__()
        self.conv = _pointwise()

    def forward(self, x):
        y = self.conv(x)
        return y + y.mean(dim=(2, 3), keepdim=True)


def _brute_force_slide(model, image, crop, stride):
    """Independent enumeration: starts range(0, H - ch + 1, sh) plus H - ch; along a side shorter than the crop
    the window is that whole side, run unpadded (mmseg's slide_inference: "the small patch will be used to decode
    without padding")."""
    b, _, h, w = image.shape
    (ch, cw), (sh, sw) = crop, stride

    def starts(size, c, s):
        if size <= c:
            return [0]
        out = list(range(0, size - c + 1, s))
        return out if out[-1] == size - c else out + [size - c]

    total = torch.zeros(b, K, h, w, dtype=image.dtype)
    count = torch.zeros(h, w, dtype=image.dtype)
    for y in starts(h, ch, sh):
        for x in starts(w, cw, sw):
            wh, ww = min(ch, h), min(cw, w)
            logits = model(image[:, :, y:y + wh, x:x + ww].clone())
            for i in range(wh):
                for j in range(ww):
                    total[:, :, y + i, x + j] += logits[:, :, i, j]
                    count[y + i, x + j] += 1
    return total / count


SIZES = [(20, 24), (45, 50), (64, 64), (10, 70)]  # smaller than crop, not divisible, exact grid, mixed


@pytest.mark.parametrize("size", SIZES)
@torch.no_grad()
def test_slide_equals_whole_for_pointwise_model(size):
    model = _pointwise()
    image = torch.randn(2, 3, *size)
    crop, stride = (32, 32), (20, 12)
    if size == (64, 64):
        stride = (16, 16)
    torch.testing.assert_close(predict_slide(model, image, crop, stride, K), predict_whole(model, image))


@pytest.mark.parametrize("size", SIZES)
@torch.no_grad()
def test_slide_averages_overlaps_like_brute_force(size):
    model = WindowMean()
    image = torch.randn(2, 3, *size)
    crop, stride = (32, 32), (20, 12)
    got = predict_slide(model, image, crop, stride, K)
    torch.testing.assert_close(got, _brute_force_slide(model, image, crop, stride))
    if size[0] > 32 and size[1] > 32:  # windows overlap, so the result is not the whole-image one
        assert not torch.allclose(got, predict_whole(model, image))


@pytest.mark.parametrize("size", [(20, 28), (32, 32), (17, 40)])  # smaller than the crop, equal, smaller in height
@torch.no_grad()
def test_image_no_larger_than_crop_scores_as_whole_image(size):
    """mmseg decodes a window smaller than the crop without padding, so with eval.mode=slide an image no larger
    than the crop (every VOC image at crop 512) gets exactly its whole-mode logits; zero-padding it to the crop
    (as this helper once did) let the network see the padding and changed the VOC numbers. A real SegNet (global
    attention: every pixel sees the whole window), bit for bit."""
    from tasks.nets.segnet import SegNet

    torch.manual_seed(0)
    net = SegNet(K, {"name": "self"}, backbone="resnet18", head_channels=32, crop=32).eval()
    image = torch.randn(2, 3, *size)
    slide = predict_slide(net, image, (32, 40), (21, 27), K)
    assert torch.equal(slide, predict_whole(net, image))
    for flip, scales in ((False, (1.0,)), (True, (0.75, 1.0))):  # the probabilities of the task's predict too
        got = predict(net, image, mode="slide", crop=(48, 48), stride=(32, 32), num_classes=K, flip=flip,
                      scales=scales)
        assert torch.equal(got, predict(net, image, flip=flip, scales=scales))


@torch.no_grad()
def test_low_resolution_logits_are_upsampled_bilinearly():
    conv = _pointwise()

    def model(x):
        return F.avg_pool2d(conv(x), 4)

    image = torch.randn(1, 3, 32, 48)
    expected = F.interpolate(model(image), size=(32, 48), mode="bilinear", align_corners=False)
    torch.testing.assert_close(predict_whole(model, image), expected)
    slide = predict_slide(model, image, (32, 32), (32, 16), K)
    assert slide.shape == (1, K, 32, 48)


@torch.no_grad()
def test_flip_on_flip_equivariant_model_changes_nothing():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(3, K, 3, padding=1)
    conv.weight.data = (conv.weight.data + conv.weight.data.flip(-1)) / 2  # horizontally symmetric kernel
    image = torch.randn(2, 3, 17, 23)
    plain = predict(conv, image)
    torch.testing.assert_close(plain, predict_whole(conv, image).softmax(1))
    torch.testing.assert_close(predict(conv, image, flip=True), plain)
    # slide: equivariant only if the window grid is mirror-symmetric; width 20, crop 12, stride 8 ->
    # windows [0, 12) and [8, 20) (width 23 would give 0, 8, 11: flipped windows see other borders)
    image = image[..., :20]
    slide = dict(mode="slide", crop=(12, 12), stride=(8, 8), num_classes=K)
    torch.testing.assert_close(predict(conv, image, flip=True, **slide), predict(conv, image, **slide))


@pytest.mark.parametrize("mode", ["whole", "slide"])
@torch.no_grad()
def test_float64_network_predicts_in_float64(mode):
    """trainer.precision=64-true: a float64 network's probabilities stay float64 (they were cast to float32, and
    its slide windows summed in float32), equal to a float64 reference; half-precision logits give float32."""
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(3, K, 3, padding=1).double()
    image = torch.randn(2, 3, 20, 28, dtype=torch.float64)
    slide = dict(mode="slide", crop=(12, 12), stride=(8, 8), num_classes=K) if mode == "slide" else {}
    got = predict(conv, image, **slide)
    assert got.dtype == torch.float64
    logits = predict_whole(conv, image) if mode == "whole" else _brute_force_slide(conv, image, (12, 12), (8, 8))
    torch.testing.assert_close(got, logits.double().softmax(1), rtol=1e-12, atol=1e-12)
    half = predict(conv.to(torch.bfloat16), image.to(torch.bfloat16), **slide)
    assert half.dtype == torch.float32


@torch.no_grad()
def test_flip_and_scales_average_probabilities():
    model = WindowMean()
    image = torch.randn(1, 3, 21, 30)
    got = predict(model, image, scales=(0.5, 1.5), flip=True)
    assert got.shape == (1, K, 21, 30)
    torch.testing.assert_close(got.sum(1), torch.ones(1, 21, 30))
    expected = 0
    for size in ((11, 15), (32, 45)):  # int(21 * s + 0.5), int(30 * s + 0.5)
        x = F.interpolate(image, size=size, mode="bilinear", align_corners=False)
        for flip in (False, True):
            y = model(x.flip(-1) if flip else x)
            y = F.interpolate(y, size=(21, 30), mode="bilinear", align_corners=False).softmax(1)
            expected = expected + (y.flip(-1) if flip else y)
    torch.testing.assert_close(got, expected / 4)
    slide = predict(model, image, mode="slide", crop=(16, 16), stride=(10, 10), scales=(0.75, 1.25),
                    num_classes=K)
    assert slide.shape == (1, K, 21, 30)


def test_bad_options_raise_user_error_naming_them():
    model, image = _pointwise(), torch.randn(1, 3, 8, 8)
    with pytest.raises(UserError, match="eval.mode"):
        predict(model, image, mode="sliding")
    for bad in ((), (0.0,), (1.0, -0.5), (float("nan"),), None):
        with pytest.raises(UserError, match="eval.scales"):
            predict(model, image, scales=bad)
    with pytest.raises(UserError, match="data.crop"):
        predict(model, image, mode="slide", stride=(4, 4), num_classes=K)
    with pytest.raises(UserError, match="eval.stride"):
        predict(model, image, mode="slide", crop=(4, 4), num_classes=K)
    with pytest.raises(UserError, match="eval.stride"):
        predict_slide(model, image, (4, 4), (6, 6), K)
    with pytest.raises(UserError, match="data.crop"):
        predict_slide(model, image, (0, 4), (1, 1), K)
    with pytest.raises(ValueError, match="num_classes"):
        predict_slide(model, image, (4, 4), (4, 4), K + 1)


@pytest.mark.parametrize("evaluation", [{}, {"flip": True}, {"scales": [0.75, 1.0, 1.25]}])
def test_an_image_scores_the_same_alone_and_in_a_padded_batch(evaluation):
    """With data.eval_batch_size > 1 on images of several sizes (VOC, ADE20K), PadCollate pads a batch to its
    largest image. The network saw the padding (convolutions at the border, global attention and pooling; the
    flip moved it to the left, the scales resized the padded size): an image's prediction, and the run's mIoU,
    depended on what it was batched with (0.48 alone, 0.27 in a batch, measured). Each image of a padded batch
    is now predicted at its own size: the confusion matrix is the one of the images evaluated one by one."""
    from task_steps import TASKS, build

    from datamodules.segmentation import PadCollate

    dm, task = build([*TASKS["segmentation"], "attn=self"])  # global attention: every pixel sees the padding
    torch.manual_seed(0)
    with torch.no_grad():  # a network whose predictions vary over the image (an untrained one predicts one class)
        for p in task.net.parameters():
            p.add_(torch.randn_like(p) * p.detach().std().nan_to_num(0.1).clamp(min=0.1))
    task.eval()
    task.eval_cfg = dict(evaluation)
    first, second = dm.val_set[0], dm.val_set[1]
    small = {"image": first["image"][:, :24, :28], "mask": first["mask"][:24, :28]}
    large = {"image": F.interpolate(second["image"][None], size=(48, 40), mode="bilinear")[0],
             "mask": F.interpolate(second["mask"][None, None].float(), size=(48, 40), mode="nearest")[0, 0].long()}
    collate = PadCollate(dm.mean, dm.std)

    def confusion(*batches):
        task.val_confusion.reset()
        task._images = []
        with torch.inference_mode():
            for batch in batches:
                task._eval_step("val", batch)
        return task.val_confusion.compute().clone()

    alone = confusion(collate([small]), collate([large]))
    assert (alone.sum(dim=0) > 0).sum() >= 2  # the predictions vary: the padding could change them
    batched = collate([small, large])
    assert batched["image"].shape[-2:] == (48, 40) and batched["sizes"] == [(24, 28), (48, 40)]
    assert torch.equal(confusion(batched), alone)
    with torch.inference_mode():  # what the padded batch itself gives: another matrix, so the test can fail
        padded = SegConfusion(task.num_classes)
        padded.update(task._predict(batched["image"]).argmax(dim=1), batched["mask"])
    assert not torch.equal(padded.compute(), alone)
    assert [tuple(mask.shape) for _, mask, _ in task._images] == [(24, 28), (48, 40)]  # logged at their own sizes
