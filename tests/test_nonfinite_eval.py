"""Runs whose evaluation is not a number: a NaN or infinite ``val/*`` or ``test/*`` metric ended the run with exit
code 0 (``trainer.on_nan`` watched the training loss alone), and a sweep or script took it as finished. Now the run
writes everything (metrics.json, checkpoints, the loggers' files) and then fails with one paragraph, exit code 2
(``suite/guard.py``); ``trainer.on_nan=off`` keeps the old behaviour. A non-finite monitored value never becomes the
best checkpoint (``suite/checkpoints.py``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from suite.checkpoints import RunCheckpoint
from suite.guard import NonFiniteGuard
from suite.run_record import metrics_text, read_metrics
from test_reliability import launch
from test_run import SEG_TINY, TINY, env, run  # noqa: F401 - env is a fixture

# One SGD step at lr=1e30 from a finite loss: that last update makes the weights so large that the forward pass
# overflows, which the training-loss check (before the update) cannot see; the validation after it and the test of
# its checkpoint are NaN. No injection: a learning rate too high, found out at the end of the run.
DIVERGED_AT_THE_END = [*TINY, "++trainer.max_steps=1", "optim.optimizer.lr=1e30"]

# NaN in every test batch (as bad test data the readers did not catch would give); training and validation finite.
NAN_IN_TEST = r"""
from tasks.modelnet import PointCloudClassification
step = PointCloudClassification.test_step
def test_step(self, batch, batch_idx):
    return step(self, {**batch, "points": batch["points"] * float("nan")}, batch_idx)
PointCloudClassification.test_step = test_step
"""

# Every blob mask all background, and the network's evaluation logits all but certain of it: target and prediction
# are one class in every pixel of both splits, as in a one-class tile set (training untouched but for its masks).
ONE_CLASS = r"""
import torch
from datamodules.segmentation.blobs import Blobs
from tasks.nets.segnet import SegNet
generate, forward = Blobs.generate, SegNet.forward
def blank(self, split, count):
    images, masks = generate(self, split, count)
    return images, masks * 0
def background(self, image):
    out = forward(self, image)
    return out if self.training else out + 1e4 * (torch.arange(out.shape[1]) == 0).to(out).view(1, -1, 1, 1)
Blobs.generate, SegNet.forward = blank, background
"""


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    (said,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    return said


def test_weights_diverged_in_the_last_update_fail_the_run_after_it_wrote_everything(env, tmp_path):
    args = [*DIVERGED_AT_THE_END, "logger=csv", f"hydra.run.dir={tmp_path}"]
    proc = run(args, env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = error_line(proc.stderr)
    (best,) = (tmp_path / "checkpoints").glob("best-*.ckpt")
    for needle in ("val/loss=nan on the validation split, from the last validation at step 1",
                   f"test/loss=nan on the test split, scoring checkpoint {best}", str(tmp_path / "metrics.json"),
                   "optim.optimizer.lr", "trainer.precision=bf16-mixed",
                   "trainer.on_nan=stop", "off accepts"):
        assert needle in said, (needle, said)
    assert "val/oa" not in said  # finite values are not named
    # Nothing lost: the record, both checkpoints and the CSV log are written as in a finished run.
    record = read_metrics(tmp_path / "metrics.json")
    assert math.isnan(record["val/loss"]) and math.isnan(record["test/loss"])
    assert record["tested"]["checkpoint"] == best.name
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert "val/loss" in (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "the validation at step 1 (epoch 0) gave val/loss=nan" in proc.stdout  # logged when it happened
    # Resumed at its end (a sweep resumed to finish its unfinished runs), it fails again instead of passing.
    again = run([*args, "resume=true"], env, check=False)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "val/loss=nan" in error_line(again.stderr) and "this run had finished already" in again.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["tested"] == record["tested"]  # kept as it was


def test_a_non_finite_test_names_the_test_split_and_the_checkpoint_it_scored(env, tmp_path):
    proc = launch(NAN_IN_TEST, [*TINY, "logger=none", f"hydra.run.dir={tmp_path}"], env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = error_line(proc.stderr)
    (best,) = (tmp_path / "checkpoints").glob("best-*.ckpt")
    assert f"test/loss=nan on the test split, scoring checkpoint {best}" in said, said
    assert "validation split" not in said and "themselves" not in said  # validation and weights are finite
    assert math.isnan(read_metrics(tmp_path / "metrics.json")["test/loss"])
    assert strict_json(tmp_path / "metrics.json")["test/loss"] is None


def test_on_nan_off_accepts_a_non_finite_evaluation(env, tmp_path):
    proc = run([*DIVERGED_AT_THE_END, "logger=none", "trainer.on_nan=off", f"hydra.run.dir={tmp_path}"], env)
    assert proc.returncode == 0 and "error:" not in proc.stderr
    assert math.isnan(read_metrics(tmp_path / "metrics.json")["val/loss"])


def test_a_one_class_split_scores_kappa_nan_says_why_and_the_run_passes(env, tmp_path):
    """Target and prediction one class in every pixel leave kappa 0 / 0: the run failed at its end with exit 2,
    blaming a learning rate or bf16. Now it passes; the log says once a split why kappa is NaN, metrics.json keeps
    the NaN and lists the reason under "undefined", and the run resumed once finished passes again."""
    args = [*SEG_TINY, "attn=external", "trainer.max_epochs=2", "logger=none", f"hydra.run.dir={tmp_path}"]
    proc = launch(ONE_CLASS, args, env)
    log = proc.stdout + proc.stderr
    record = read_metrics(tmp_path / "metrics.json")
    assert record["val/miou"] == 1.0 and record["test/pixel_acc"] == 1.0
    assert math.isnan(record["val/kappa"]) and math.isnan(record["test/kappa"])
    written = strict_json(tmp_path / "metrics.json")  # what jq or JavaScript read: null, and the word beside it
    assert written["val/kappa"] is None and written["non_finite"] == {"test/kappa": "nan", "val/kappa": "nan"}
    pixels = {split: count * 32 * 32 for split, count in (("val", 4), ("test", 4))}  # SEG_TINY: 4 images of 32 x 32
    assert record["undefined"] == {
        f"{split}/kappa": f"undefined: every one of the split's {pixels[split]} scored pixels is class 0 (background) "
                          "in both the target and the prediction, so Cohen's kappa (p_o - p_e) / (1 - p_e) is 0 / 0"
        for split in ("val", "test")}
    assert log.count("val/kappa is NaN, undefined") == 1 and log.count("test/kappa is NaN, undefined") == 1  # 2 epochs
    assert "error:" not in proc.stderr and "gave val/kappa" not in log
    again = launch(ONE_CLASS, [*args, "resume=true"], env)
    assert "this run had finished already" in again.stdout and "error:" not in again.stderr


def strict_json(path):
    """``path`` read as a strict JSON reader reads it (RFC 8259: no NaN, Infinity or -Infinity tokens)."""
    def refuse(token):
        raise AssertionError(f"{path} holds the bare token {token}, which strict JSON readers refuse")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_metrics_json_is_strict_json_and_reads_back_every_non_finite_value(tmp_path):
    """Python's json wrote NaN and inf as bare tokens, which jq, JavaScript, Go and strict readers refuse (the whole
    record unreadable for one undefined kappa). metrics.json writes them null, names each under "non_finite", and
    the suite's reader restores them; a nested non-finite value (a protocol's) is null; an older record's bare
    tokens read as before."""
    record = {"test/oa": 0.5, "test/loss": math.nan, "val/loss": math.inf, "val/x": -math.inf, "params": 3,
              "protocol": {"split": "test", "scale": [math.nan, 1.0]}, "tested": None}
    path = tmp_path / "metrics.json"
    path.write_text(metrics_text(record))
    written = strict_json(path)
    assert {k: written[k] for k in ("test/oa", "test/loss", "val/loss", "val/x", "params", "tested")} == {
        "test/oa": 0.5, "test/loss": None, "val/loss": None, "val/x": None, "params": 3, "tested": None}
    assert written["non_finite"] == {"test/loss": "nan", "val/loss": "inf", "val/x": "-inf"}
    assert written["protocol"] == {"split": "test", "scale": [None, 1.0]}
    back = read_metrics(path)
    assert "non_finite" not in back and back["test/oa"] == 0.5 and back["params"] == 3 and back["tested"] is None
    assert math.isnan(back["test/loss"]) and back["val/loss"] == math.inf and back["val/x"] == -math.inf
    path.write_text(metrics_text(back))  # written again (a resumed run's record): the same file
    assert strict_json(path) == written
    assert metrics_text({"test/oa": 0.5}) == '{\n  "test/oa": 0.5\n}\n'  # nothing non-finite: no key
    path.write_text('{"test/loss": NaN, "test/oa": 0.25}')  # a record from before: Python's bare token
    old = read_metrics(path)
    assert math.isnan(old["test/loss"]) and old["test/oa"] == 0.25
    path.write_text('{"test/loss": null, "non_finite": {"test/loss": "bogus", "val/oa": "nan"}}')  # hand-edited
    assert read_metrics(path) == {"test/loss": None}  # no value invented
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an object"):
        read_metrics(path)


def test_strict_json_writes_every_non_finite_float_null_wherever_it_is():
    """The one serialiser of metrics.json, report.json and the benchmarks' JSON: NaN and +-inf at any depth (dict
    values, list and tuple items, a numpy float64: a float subclass) become null; everything else is kept."""
    from suite import strict_json

    value = {"a": math.nan, "b": [1.0, math.inf, (2, -math.inf)], "c": {"d": np.float64("nan"), "e": "nan"},
             "f": 3, "g": None, "h": True}
    assert strict_json.strict(value) == {"a": None, "b": [1.0, None, [2, None]], "c": {"d": None, "e": "nan"},
                                         "f": 3, "g": None, "h": True}
    text = strict_json.dumps(value)
    assert "NaN" not in text and "Infinity" not in text and json.loads(text) == strict_json.strict(value)


def fake_trainer(world_size: int = 1, others_bad: bool = False):
    """What :meth:`NonFiniteGuard.evaluation_error` reads of a trainer: its size, the ranks' agreement (a boolean
    all-reduce, "any": ``others_bad`` says another rank saw a non-finite value) and the module evaluated."""
    strategy = SimpleNamespace(reduce_boolean_decision=lambda decision, all=True: decision or others_bad)
    return SimpleNamespace(world_size=world_size, strategy=strategy, lightning_module=torch.nn.Linear(2, 2))


def test_the_processes_agree_and_skip_fails_as_stop_does():
    finite, nan = {"val/oa": 0.5, "test/oa": 0.5, "train/loss": 1.0}, {"val/oa": 0.5, "test/loss": math.nan}
    stop = NonFiniteGuard("stop")
    assert stop.evaluation_error(finite, fake_trainer(), "checkpoint x", None) is None
    # A process whose own values are finite fails with the one that saw a NaN: under DDP every rank raises or none.
    error = stop.evaluation_error(finite, fake_trainer(world_size=2, others_bad=True), "checkpoint x", None)
    assert error is not None and "another process" in str(error)
    # skip drops training batches; an evaluation has none to drop, so it fails as under stop.
    assert "test/loss=nan on the test split" in str(NonFiniteGuard("skip").evaluation_error(
        nan, fake_trainer(), "checkpoint x", None))
    assert NonFiniteGuard("off").evaluation_error(nan, fake_trainer(), "checkpoint x", None) is None
    assert "test/loss=inf" in str(stop.evaluation_error({"test/loss": math.inf}, fake_trainer(), "x", None))
    assert "themselves" not in str(stop.evaluation_error(nan, fake_trainer(), "x", None))
    diverged = fake_trainer()
    with torch.no_grad():
        diverged.lightning_module.weight[0, 0] = math.nan
    assert "The weights evaluated last hold NaN or infinite values themselves" in str(
        stop.evaluation_error(nan, diverged, "x", None))


def test_a_metric_the_data_leaves_undefined_fails_nothing_and_the_others_still_do():
    """Segmentation's kappa is NaN where target and prediction are one class in every pixel (0 / 0): the run failed
    on it with exit 2 and a hint at learning rates and bf16, none of them the cause. A metric that the task lists in
    ``undefined_metrics`` (or a finished run's metrics.json under "undefined", as a resumed run finds it) is passed
    over, its ``_best`` too; any other NaN still fails the run."""
    stop, why = NonFiniteGuard("stop"), {"val/kappa": "undefined: one class", "test/kappa": "undefined: one class"}
    one_class = {"val/miou": 1.0, "val/kappa": math.nan, "val/kappa_best": -math.inf, "test/kappa": math.nan}
    assert "val/kappa=nan" in str(stop.evaluation_error(one_class, fake_trainer(), "x", None))  # not declared
    trainer = fake_trainer()
    trainer.lightning_module.undefined_metrics = why
    assert stop.evaluation_error(one_class, trainer, "x", None) is None
    assert stop.evaluation_error({**one_class, "undefined": why}, fake_trainer(), "x", None) is None  # the record's
    error = str(stop.evaluation_error({**one_class, "test/miou": math.nan}, trainer, "x", None))
    assert "test/miou=nan on the test split" in error and "kappa" not in error


class Scripted(L.LightningModule):
    """Logs the given value of ``val/x`` at each epoch's validation."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/x", torch.tensor(self.values[self.current_epoch]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 1)), batch_size=2)

    val_dataloader = train_dataloader


@pytest.mark.parametrize("mode, values, best_epoch", [
    ("min", [1.0, -math.inf, 0.5, math.nan], 2),  # -inf was best for good, whatever came after
    ("max", [0.2, math.inf, 0.4, math.nan], 2),
    ("min", [math.nan, 2.0, math.inf], 1),  # (Lightning's own: a NaN first, then beaten by any finite value)
])
def test_a_non_finite_monitored_value_is_never_the_best_checkpoint(tmp_path, mode, values, best_epoch):
    best = RunCheckpoint(dirpath=tmp_path, filename="best-{epoch}", monitor="val/x", mode=mode)
    trainer = L.Trainer(max_epochs=len(values), callbacks=[best], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(Scripted(values))
    assert best.best_model_path.endswith(f"best-epoch={best_epoch}.ckpt"), best.best_model_path
    assert float(best.best_model_score) == pytest.approx(values[best_epoch])


# --- metrics.json's train/* are epoch means, never one batch's values ---------------------------------------------
def test_segmentation_records_the_epoch_mean_of_its_training_loss_not_the_last_batch(env, tmp_path):
    """Segmentation logged train/* per step only, and metrics.json's train/loss was the last batch's loss, where the
    other tasks' are epoch means: now it records the epoch mean (train/loss_epoch) and leaves the last values out."""
    from test_run import SEG_TINY

    run([*SEG_TINY, "attn=external", "trainer.max_steps=4", "logger=csv", "trainer.log_every_n_steps=1",
         f"hydra.run.dir={tmp_path}"], env)  # 16 images in batches of 4: one epoch of 4 steps
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert not {"train/loss", "train/loss_main", "train/loss_aux"} & metrics.keys(), sorted(metrics)
    import csv

    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    steps = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(steps) == 4 and len(set(steps)) > 1
    assert metrics["train/loss_epoch"] == pytest.approx(sum(steps) / len(steps), rel=1e-5)


def test_the_gans_last_step_values_are_left_out_of_the_record():
    from suite.train import finish_metrics
    from tasks.gan import GAN

    trainer = SimpleNamespace(world_size=1, is_global_zero=True, lightning_module=SimpleNamespace(
        step_metrics=GAN.step_metrics))
    fit = {"train/loss_d": 0.7, "train/loss_g": 1.2, "train/d_real": 0.3, "train/d_fake": -0.2, "val/fid": 80.0,
           "train/samples_per_sec": 10.0}
    kept = finish_metrics(fit, SimpleNamespace(skipped=[]), None, trainer)
    assert kept == {"val/fid": 80.0, "train/samples_per_sec": 10.0}


NAN_BATCH = {"modelnet": "points", "shapenet": "points", "classification": "image", "segmentation": "image"}
SCORED = {"modelnet": "val/loss", "shapenet": "val/loss", "classification": "val/loss", "segmentation": "val/miou"}


@pytest.mark.parametrize("task", sorted(NAN_BATCH))
def test_one_non_finite_evaluation_batch_makes_the_splits_score_nan(task):
    """One batch whose prediction is NaN (bad data, or weights that overflow on some inputs) among finite ones: the
    evaluation losses were torchmetrics means that dropped it, and segmentation's argmax made a class of NaN logits,
    so the split scored finite (a loss over fewer samples, an mIoU of a constant prediction) and trainer.on_nan's
    check passed. Now the split's score is NaN. The same batches, all finite, score finite."""
    from task_steps import TASKS, build

    datamodule, module = build(TASKS[task])
    datamodule.setup("validate")
    whole = next(iter(datamodule.val_dataloader()))  # the runs' tiny splits are one batch: made two here
    half = len(whole[NAN_BATCH[task]]) // 2
    assert half >= 1
    batches = [{k: v[:half] for k, v in whole.items()}, {k: v[half:] for k, v in whole.items()}]
    key, metric = NAN_BATCH[task], SCORED[task]
    poisoned = [{**b, key: b[key] * float("nan")} if i == 1 else b for i, b in enumerate(batches)]
    scored = {}
    for name, loader in (("finite", batches), ("poisoned", poisoned)):
        trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1)
        trainer.validate(module, dataloaders=DataLoader(loader, batch_size=None), verbose=False)
        scored[name] = float(trainer.callback_metrics[metric])
    assert math.isfinite(scored["finite"]), scored
    assert math.isnan(scored["poisoned"]), scored
