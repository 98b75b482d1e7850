"""Part IoU and the point-cloud training accuracy against hand-computed cases."""

import math

import pytest
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


# --- mean class accuracy (tasks.metrics.classification) -----------------------------------------------------------
@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")  # the case this test is about
@pytest.mark.filterwarnings("ignore:The ``compute`` method")  # computed with no targets, on purpose
def test_mean_class_accuracy_averages_the_classes_in_the_targets_only():
    """PCT's mAcc is scikit-learn's balanced accuracy: targets 0 0 1 1 2, predictions 0 3 1 1 2 -> recalls 1/2, 1, 1
    over the three classes present = 5/6. Class 3, predicted once but never a target, is not averaged in as a 0 (as
    torchmetrics' macro accuracy does: 0.625)."""
    from sklearn.metrics import balanced_accuracy_score
    from torchmetrics.functional.classification import multiclass_accuracy

    from tasks.metrics.classification import BalancedAccuracy

    target, pred = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 3, 1, 1, 2])
    metric = BalancedAccuracy(5)
    metric.update(pred[:2], target[:2])  # accumulated over batches
    metric.update(pred[2:], target[2:])
    assert metric.compute().item() == pytest.approx(5 / 6, abs=1e-7)
    assert balanced_accuracy_score(target, pred) == pytest.approx(5 / 6)
    assert multiclass_accuracy(pred, target, 5, average="macro").item() == pytest.approx(0.625)

    # logits (the validation step's input) are scored by their argmax; random sets lacking classes agree with sklearn
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(1, 40, (), generator=gen))
        target = torch.randint(0, 8, (n,), generator=gen)
        logits = torch.randn(n, 10, generator=gen)
        metric = BalancedAccuracy(10)
        metric.update(logits, target)
        assert metric.compute().item() == pytest.approx(balanced_accuracy_score(target, logits.argmax(-1)), abs=1e-6)

    assert math.isnan(BalancedAccuracy(3).compute().item())  # no targets: nothing to average


def test_modelnet_scores_mean_class_accuracy_like_the_reference():
    """The task's val/test macc on a set without class 3 that the network predicts: the reference's number."""
    from tasks.modelnet import PointCloudClassification

    task = PointCloudClassification(4, list("abcd"), model={"samples": [8, 4], "neighbours": 2, "layers": 1},
                                    attn={"name": "offset"}, optim={"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01}}, input_points=16)
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 5.0], [0, 5.0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]])
    task.val_macc(logits, torch.tensor([0, 0, 1, 1, 2]))
    assert task.val_macc.compute().item() == pytest.approx(5 / 6, abs=1e-7)
    assert type(task.test_macc) is type(task.val_macc)


def test_modelnet_train_oa_is_the_accuracy_over_the_epochs_batches():
    """``train/oa`` (updated without computing a batch value, so without a host sync in the step) is the accuracy
    over every training batch of the epoch, as the steps' own logits say, counted by hand."""
    import lightning as L

    from task_steps import TASKS, build

    datamodule, task = build(TASKS["modelnet"])
    seen = []
    step = task._step

    def recorded(batch):
        loss, logits = step(batch)
        seen.append((logits.detach().argmax(1), batch["label"]))
        return loss, logits

    task._step = recorded
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)
    trainer.fit(task, datamodule=datamodule)
    assert len(seen) >= 2  # more than one batch: the value is the epoch's, not the last batch's
    right = sum(int((p == y).sum()) for p, y in seen)
    total = sum(len(y) for _, y in seen)
    assert float(trainer.callback_metrics["train/oa"]) == pytest.approx(right / total, abs=1e-7)
