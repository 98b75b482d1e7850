"""Test-time voting (``eval.votes``, ``tasks/voting.py``) on ModelNet40 and ShapeNet part, against float64
transliterations of the reference loops (PAConv ``obj_cls/eval_voting.py`` and ``part_seg/eval_voting.py`` at
b392e45e64db3c03c270c599d73c10c636670d11, RS-CNN ``voting_evaluate_partseg.py`` at
6464eb8bb4efc686adec9da437112ef888e55684), with the scales redrawn here from the documented seed rule (each shape's
from the seed and its index alone, so the score does not depend on the batches or processes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score
from torchmetrics.functional.classification import multiclass_accuracy

from tasks.modelnet import PointCloudClassification
from tasks.shapenet import PartSegmentation
from test_config_checks import compose_run, refused
from test_run import TINY, assert_declares_what_it_logs, env, run, user_error  # noqa: F401 - env is a fixture

SEED = 7
SCALE = (0.8, 1.18)
OPTIM = {"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01}}


def calibrated(task, *inputs):
    """The task with its batch norms' running statistics set from one training-mode pass over ``inputs``: at their
    initial values (mean 0, variance 1) PCT's output hardly depends on its input, and votes could not differ."""
    for m in task.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.momentum = None  # a cumulative average: after one pass, that pass's statistics
    with torch.no_grad():
        task.net.train()(*inputs)
    return task.eval()


def reference_scales(seed: int, votes: int, indices, low: float, high: float) -> torch.Tensor:
    """The documented rule: shape i's (votes-1, 3) factors are low + (high - low) * default_rng([seed, i]).random();
    stacked over the batch's shapes to (votes-1, B, 3)."""
    per_shape = [low + (high - low) * np.random.default_rng([seed, int(i)]).random((votes - 1, 3)) for i in indices]
    return torch.from_numpy(np.stack(per_shape, axis=1))


def classifier(votes: int, cumulative: bool = False, seed: int = SEED) -> PointCloudClassification:
    torch.manual_seed(0)
    task = PointCloudClassification(4, list("abcd"), model={"samples": [16, 8], "neighbours": 4, "layers": 1},
                                    attn={"name": "offset"}, optim=OPTIM, input_points=64, seed=seed,
                                    eval={"votes": votes, "vote_scale": list(SCALE), "vote_cumulative": cumulative})
    return task.double().eval()


def paconv_cls_vote(model, data: torch.Tensor, scales: torch.Tensor, NUM_VOTE: int, in_place: bool) -> torch.Tensor:
    """PAConv's loop: vote 0 as loaded, later votes scaled per shape (pointscale's per-sample loop); PAConv scales
    ``data`` itself in place (``new_data = data``), ``in_place=False`` scales a fresh copy of the original."""
    data = data.clone()
    pred = 0
    for v in range(NUM_VOTE):
        new_data = data if in_place else data.clone()
        if v > 0:
            for i in range(new_data.size()[0]):
                new_data[i, :, 0:3] = torch.mul(new_data[i, :, 0:3], scales[v - 1, i])
        with torch.no_grad():
            pred += F.softmax(model(new_data), dim=1)  # sum NUM_VOTE preds
    pred /= NUM_VOTE  # avg the preds
    return pred


@pytest.mark.parametrize("cumulative", [False, True])
def test_modelnet_vote_is_the_mean_softmax_over_the_scaled_copies(cumulative):
    votes = 5
    points = torch.rand(6, 64, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    task = calibrated(classifier(votes, cumulative), points)
    labels, index = torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([5, 0, 9, 2, 11, 3])
    ref = paconv_cls_vote(task.net, points, reference_scales(SEED, votes, index, *SCALE), votes, in_place=cumulative)
    task.on_test_epoch_start()
    with torch.no_grad():
        probs, logits = task._test_logits({"points": points, "index": index})
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, task.net(points), rtol=0, atol=0)  # test/loss: the unscaled pass
    assert (probs - logits.softmax(-1)).abs().max() > 1e-4  # the scaled votes changed the prediction
    # Through test_step: the metrics score the argmax of the mean softmax.
    task.on_test_epoch_start()
    with torch.no_grad():
        task.test_step({"points": points, "label": labels, "index": index}, 0)
    pred = ref.argmax(-1)
    assert task.test_oa.compute() == multiclass_accuracy(pred, labels, 4, average="micro")
    assert task.test_macc.compute().item() == pytest.approx(balanced_accuracy_score(labels, pred), abs=1e-12)


def test_cumulative_and_independent_scales_differ():
    points = torch.rand(3, 64, 3, dtype=torch.float64)
    outs = []
    for cumulative in (False, True):
        task = calibrated(classifier(4, cumulative), points)
        task.on_test_epoch_start()
        with torch.no_grad():
            outs.append(task._test_logits({"points": points, "index": torch.arange(3)})[0])
    assert not torch.allclose(*outs)


def test_votes_follow_the_seed_and_the_shape_not_the_batches(tmp_path):
    """A test set's voted scores are the same whatever the batch size and order (so whatever the number of processes
    it is spread over); another seed draws other scales. Batches from the real data module, which names each shape."""
    from datamodules.points.shapes import Shapes

    shapes = Shapes(root=str(tmp_path), num_classes=4, train_per_class=1, val_per_class=1, test_per_class=3,
                    npoints=64, batch_size=5, eval_batch_size=5, num_workers=0)
    shapes.setup("test")
    task = calibrated(classifier(3), torch.stack([s["points"] for s in shapes.test_set]).double())

    def scores(seed: int, batch_size: int, reverse: bool = False) -> torch.Tensor:
        task.seed, rows = seed, {}
        order = list(range(len(shapes.test_set)))[::-1 if reverse else 1]
        for start in range(0, len(order), batch_size):
            batch = torch.utils.data.default_collate([shapes.test_set[i] for i in order[start:start + batch_size]])
            with torch.no_grad():
                probs = task._test_logits({**batch, "points": batch["points"].double()})[0]
            rows.update(zip(batch["index"].tolist(), probs))
        assert sorted(rows) == list(range(12))  # each shape names its row
        return torch.stack([rows[i] for i in range(12)])

    one = scores(SEED, 12)
    torch.testing.assert_close(scores(SEED, 5), one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scores(SEED, 4, reverse=True), one, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scores(SEED + 1, 12), one)  # another seed, other scales
    with torch.no_grad():
        plain = task.net(torch.stack([shapes.test_set[i]["points"] for i in range(12)]).double()).softmax(-1)
    assert (one - plain).abs().max() > 1e-4  # and the votes did change the scores


def test_voting_needs_the_shapes_index():
    from attention.errors import UserError

    task = classifier(2)
    with pytest.raises(UserError, match="'index'") as err, torch.no_grad():
        task._test_logits({"points": torch.rand(2, 64, 3, dtype=torch.float64), "label": torch.tensor([0, 1])})
    assert "eval.votes=1" in str(err.value) and "['label', 'points']" in str(err.value)


def test_one_vote_is_the_single_pass_exactly():
    points, labels = torch.rand(5, 64, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 3])
    task = calibrated(classifier(1), points)
    task.on_test_epoch_start()
    with torch.no_grad():
        scores, logits = task._test_logits({"points": points})  # no index needed: nothing is drawn
        task.test_step({"points": points, "label": labels}, 0)
        plain = task.net(points)  # what test_step computed before voting existed
    assert torch.equal(scores, plain) and torch.equal(logits, plain)
    pred = plain.argmax(-1)
    assert task.test_oa.compute() == multiclass_accuracy(pred, labels, 4, average="micro")
    loss = F.cross_entropy(plain, labels, label_smoothing=task.smoothing)
    assert float(task.test_loss.compute()) == pytest.approx(float(loss), rel=1e-7)  # the metric keeps float32


# --- ShapeNet part ----------------------------------------------------------------------------------------------------
SEG_SCALE = (0.87, 1.15)
seg_classes = {"A": [0, 1], "B": [2, 3, 4]}  # the references' {category: its global part ids}


def segmenter(votes: int, normals: bool = True) -> PartSegmentation:
    torch.manual_seed(0)
    task = PartSegmentation(5, 2, ["A", "B"], list(seg_classes.values()), model={"layers": 1, "width": 16},
                            attn={"name": "offset"}, optim=OPTIM, normals=normals, input_points=48, seed=SEED,
                            eval={"votes": votes, "vote_scale": list(SEG_SCALE)})
    return task.double().eval()


def rscnn_partseg_vote(model, points, norm_plt, cls, scales, NUM_VOTE):
    """RS-CNN/PAConv part-seg voting in float64: vote 0 on the shape as it is (the references pass an all-zero
    ``new_points`` there, a bug not reproduced), later votes scale xyz only (PAConv: normals unscaled), the softmax
    over parts averaged, then each shape's argmax over its category's parts (``seg_classes[cat]``)."""
    pred = 0
    for v in range(NUM_VOTE):
        new_points = points.clone()
        if v > 0:
            for i in range(points.size()[0]):
                new_points[i, :, 0:3] = torch.mul(points[i, :, 0:3], scales[v - 1, i])
        with torch.no_grad():
            pred += F.softmax(model(torch.cat([new_points, norm_plt], -1), cls), dim=1)  # (B, parts, N)
    pred /= NUM_VOTE
    cats = list(seg_classes)
    pred_val = torch.zeros(len(cls), points.size()[1], dtype=torch.long)
    for b in range(len(cls)):
        cat = cats[int(cls[b])]
        logits = pred[b, :, :].T  # (num_points, num_classes)
        pred_val[b, :] = logits[:, seg_classes[cat]].max(1)[1] + seg_classes[cat][0]
    return pred, pred_val


def test_shapenet_vote_is_the_mean_softmax_and_scales_xyz_only():
    votes = 4
    g = torch.Generator().manual_seed(2)
    xyz, normals = torch.rand(3, 48, 3, generator=g).double(), F.normalize(torch.randn(3, 48, 3, generator=g)).double()
    category = torch.tensor([0, 1, 1])
    task = calibrated(segmenter(votes), torch.cat([xyz, normals], -1), category)
    parts = torch.tensor([0, 2, 3])[:, None].expand(3, 48).clone()
    batch = {"points": xyz, "normals": normals, "category": category, "parts": parts, "index": torch.tensor([4, 1, 7])}
    ref_probs, ref_pred = rscnn_partseg_vote(task.net, xyz, normals, category,
                                             reference_scales(SEED, votes, [4, 1, 7], *SEG_SCALE), votes)
    task.on_test_epoch_start()
    with torch.no_grad():
        probs, logits = task._voted(batch)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-12, atol=1e-12)
    assert (probs - logits.softmax(1)).abs().max() > 1e-4
    task.on_test_epoch_start()
    with torch.no_grad():
        loss, pred = task._step(batch, *task._voted(batch))
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(loss, F.cross_entropy(task.net(torch.cat([xyz, normals], -1), category), parts))


def test_shapenet_one_vote_is_the_single_pass_exactly():
    xyz, category = torch.rand(2, 48, 3, dtype=torch.float64), torch.tensor([1, 0])
    task = calibrated(segmenter(1, normals=False), xyz, category)
    parts = torch.tensor([[2] * 24 + [4] * 24, [1] * 48])
    task.on_test_epoch_start()
    with torch.no_grad():
        task.test_step({"points": xyz, "category": category, "parts": parts}, 0)
        logits = task.net(xyz, category)
    out = task.test_iou.compute()
    # Before voting: the argmax over each shape's own parts of the single pass's logits.
    allowed = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)[category][..., None]
    pred = logits.masked_fill(~allowed, float("-inf")).argmax(1)
    ious = []
    for b, cat in enumerate(category.tolist()):
        ids = seg_classes[list(seg_classes)[cat]]
        ious.append(np.mean([1.0 if not ((parts[b] == p) | (pred[b] == p)).any() else
                             float(((parts[b] == p) & (pred[b] == p)).sum() / ((parts[b] == p) | (pred[b] == p)).sum())
                             for p in ids]))
    assert float(out["instance_miou"]) == pytest.approx(np.mean(ious), abs=1e-7)


# --- configuration ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["modelnet", "shapenet"])
@pytest.mark.parametrize("override, needles", [
    ("eval.votes=0", ["eval.votes=0", "an integer >= 1"]),
    ("eval.votes=2.5", ["eval.votes=2.5", "an integer >= 1"]),
    ("eval.votes=abc", ["eval.votes='abc'"]),
    ("eval.vote_scale=[1.2,0.8]", ["eval.vote_scale=[1.2, 0.8]", "0 < low <= high"]),
    ("eval.vote_scale=[-1,1]", ["eval.vote_scale=[-1, 1]", "0 < low <= high"]),
    ("eval.vote_scale=[0.8]", ["eval.vote_scale=[0.8]", "a list of 2 numbers"]),
    ("eval.vote_cumulative=maybe", ["eval.vote_cumulative='maybe'", "true"]),
])
def test_bad_voting_options_are_refused_at_composition(task, override, needles):
    message = refused([f"task={task}", override])
    for needle in needles:
        assert needle in message, (needle, message)
    assert f"configs/task/{task}.yaml" in message and "\n" not in message


def test_defaults_are_one_pass_with_the_references_ranges():
    for task, scale in (("modelnet", [0.8, 1.18]), ("shapenet", [0.87, 1.15])):
        cfg = compose_run([f"task={task}"])
        assert dict(cfg.eval) == {"votes": 1, "vote_scale": scale, "vote_cumulative": False}
        assert cfg.task.eval == cfg.eval and cfg.task.seed == cfg.seed


# --- run.py -----------------------------------------------------------------------------------------------------------
def test_run_records_the_votes_in_metrics_json(env, tmp_path):  # noqa: F811 - env is a fixture
    run([*TINY, "logger=none", "eval.votes=3", f"hydra.run.dir={tmp_path / 'run'}"], env)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["protocol"]["tta"] == "vote x3, anisotropic scale [0.8, 1.18]"
    assert metrics["protocol"]["votes"] == 3 and 0.0 <= metrics["test/oa"] <= 1.0 and "test/macc" in metrics
    user_error(["task=shapenet", "data=parts", "eval.vote_scale=[1.2,0.8]", "logger=none"], env,
               "eval.vote_scale=[1.2, 0.8] is not valid", "configs/task/shapenet.yaml")



def test_shapenet_run_records_the_votes_in_metrics_json(env, tmp_path):  # noqa: F811 - env is a fixture
    run(["experiment=parts_demo", "data.num_categories=2", "data.train_per_category=2", "data.val_per_category=2",
         "data.test_per_category=2", "data.npoints=64", "data.batch_size=4", "data.eval_batch_size=4",
         "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "logger=none", "eval.votes=2",
         f"hydra.run.dir={tmp_path / 'run'}"], env)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    p = metrics["protocol"]
    assert p["tta"] == "vote x2, anisotropic scale [0.87, 1.15]" and p["votes"] == 2
    assert p["points"] == 64 and p["restrict_to_category"] is True and p["split"] == "test"
    assert 0.0 <= metrics["test/imiou"] <= 1.0 and 0.0 <= metrics["test/cmiou"] <= 1.0
    assert_declares_what_it_logs(tmp_path / "run", metrics)

def test_protocol_names_votes_range_and_rule():
    from suite.run_record import protocol

    def record(task, **evaluation):
        return protocol({"task": {"name": task}, "data": {"_target_": "datamodules.Parts", "npoints": 256},
                         "eval": {"vote_scale": [0.87, 1.15], "vote_cumulative": False, **evaluation}})

    assert record("shapenet", votes=1)["tta"] == "none" and "votes" not in record("shapenet", votes=1)
    assert "votes" not in protocol({"task": {"name": "modelnet"}, "data": {}})  # runs from before voting
    voted = record("shapenet", votes=10, vote_cumulative=True)
    assert voted["tta"] == "vote x10, anisotropic scale [0.87, 1.15], cumulative" and voted["votes"] == 10
