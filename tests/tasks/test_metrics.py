"""Part IoU against hand-computed cases."""

import math

import torch

from tasks.metrics.part_iou import PartIoU, restrict_to_category, shape_ious

# Two categories: 0 owns parts {0, 1}, 1 owns parts {2, 3, 4}.
CATS = [[0, 1], [2, 3, 4]]


def test_shape_iou_hand_computed():
    # Shape A (cat 0): gt 0 0 1 1, pred 0 1 1 1 -> part 0: 1/2, part 1: 2/3 -> (1/2 + 2/3) / 2
    # Shape B (cat 1): gt 2 2 3 3, pred 2 2 3 3; part 4 absent from both counts 1 -> 1
    # Shape C (cat 1): gt 2 2 2 2, pred 3 3 2 2 -> part 2: 2/4, part 3: 0/2, part 4: 1 -> (0.5 + 0 + 1) / 3
    pred = torch.tensor([[0, 1, 1, 1], [2, 2, 3, 3], [3, 3, 2, 2]])
    gt = torch.tensor([[0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 2, 2]])
    cat = torch.tensor([0, 1, 1])
    from tasks.metrics.part_iou import category_part_mask

    got = shape_ious(pred, gt, cat, category_part_mask(CATS, 5))
    expected = torch.tensor([(1 / 2 + 2 / 3) / 2, 1.0, 1.5 / 3], dtype=torch.float64)
    torch.testing.assert_close(got, expected)


def test_instance_and_class_miou_accumulate_over_batches():
    metric = PartIoU(CATS, 5)
    metric.update(torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]]), torch.tensor([0]))
    metric.update(torch.tensor([[2, 2, 3, 3], [3, 3, 2, 2]]), torch.tensor([[2, 2, 3, 3], [2, 2, 2, 2]]),
                  torch.tensor([1, 1]))
    out = metric.compute()
    a, b, c = (1 / 2 + 2 / 3) / 2, 1.0, 0.5
    assert math.isclose(out["instance_miou"].item(), (a + b + c) / 3)
    assert math.isclose(out["class_miou"].item(), (a + (b + c) / 2) / 2)
    assert math.isclose(out["per_category"][1].item(), (b + c) / 2)


def test_unseen_category_is_left_out_of_class_miou():
    metric = PartIoU(CATS, 5)
    metric.update(torch.tensor([[0, 0]]), torch.tensor([[0, 0]]), torch.tensor([0]))
    out = metric.compute()
    assert out["class_miou"].item() == 1.0 and math.isnan(out["per_category"][1].item())


def test_prediction_restricted_to_own_category():
    from tasks.metrics.part_iou import category_part_mask

    logits = torch.zeros(2, 5, 3)
    logits[:, 4] = 10.0  # part 4 wins everywhere if unrestricted
    logits[:, 1] = 5.0
    logits[:, 2] = 1.0
    pred = restrict_to_category(logits, torch.tensor([0, 1]), category_part_mask(CATS, 5))
    assert pred.tolist() == [[1, 1, 1], [4, 4, 4]]
