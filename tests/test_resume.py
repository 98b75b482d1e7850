"""Resume after pre-emption: a run killed with SIGKILL and resumed ends exactly where an uninterrupted one does, with
the uninterrupted run's whole metric history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from suite.run_record import quality_metrics
from fixture_cache import once_per_worker, user_error_in_process
from test_last_checkpoint import INTERRUPT
from test_reliability import launch
from test_run import GAN_TINY, ROOT, TINY, env, run, user_error  # noqa: F401  (env is a fixture)
import warm_python

# 5 epochs of a small PCT on 3 generated classes, a checkpoint after each: slow enough to be killed mid-run. On the
# CPU (pinned: a GPU repeats only with trainer.deterministic=true, tests/gpu/test_cuda_tasks.py resumes there).
ARGS = [*TINY, "data.num_classes=3", "data.train_per_class=12", "data.val_per_class=3", "data.test_per_class=3",
        "data.batch_size=4", "trainer.max_epochs=5", "logger=wandb", "trainer.accelerator=cpu"]


def checkpoint_epoch(path: Path) -> int | None:
    """The epoch of a complete checkpoint file, None while it is missing or still being written."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["epoch"]
    except Exception:  # noqa: BLE001  (absent, empty or half-written)
        return None


def wandb_ids(out: Path) -> set[str]:
    return {p.name.rsplit("-", 1)[-1] for p in (out / "wandb").glob("offline-run-*")}


def history(out: Path) -> list[str]:
    """The rows of a run's csv/metrics.csv without the training throughput, which differs between any two runs."""
    lines = (out / "csv" / "metrics.csv").read_text().splitlines()
    drop = lines[0].split(",").index("train/samples_per_sec")
    return [",".join(v for i, v in enumerate(line.split(",")) if i != drop) for line in lines]


def kill_after_a_checkpoint(args: list[str], env: dict, run_dir: Path) -> int:
    """Start ``run.py args`` in ``run_dir``, SIGKILL it as soon as its last.ckpt holds an epoch before the run's end
    (of 4), and return that epoch (tests/gpu/test_cuda_tasks.py does the same on a GPU)."""
    proc = warm_python.popen([sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={run_dir}"],
                             cwd=env["HOME"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    last, deadline = run_dir / "checkpoints" / "last.ckpt", time.monotonic() + 300
    while checkpoint_epoch(last) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stopped_at = checkpoint_epoch(last)
    assert stopped_at is not None and stopped_at < 4, "the run was not interrupted before its end"
    return stopped_at


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory) -> Path:
    """The uninterrupted run of ARGS, which the interrupted ones are compared with."""
    out, _ = once_per_worker(tmp_path_factory, "straight", lambda out: run([*ARGS, f"hydra.run.dir={out}"], env))
    return out


@pytest.mark.xdist_group("resume")
def test_sigkill_then_resume_matches_an_uninterrupted_run(env, straight, tmp_path):
    killed = tmp_path / "killed"
    kill_after_a_checkpoint(ARGS, env, killed)
    assert not (killed / "metrics.json").exists()
    first_id = (killed / "checkpoints" / "wandb_run_id").read_text().strip()

    # The seconds the killed part had spent when it wrote the checkpoint it is resumed from (suite.resume.FitRecord).
    spent = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["FitRecord"]["seconds"]
    started = time.monotonic()
    resumed = run([*ARGS, f"hydra.run.dir={killed}", "resume=true"], env)
    took = time.monotonic() - started
    assert f"resuming from {killed / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    # Its wall time is both parts': the resumed part alone made a run killed and resumed look cheaper than it was.
    wall = json.loads((killed / "metrics.json").read_text())["wall_time_s"]
    assert 0 < spent < wall < spent + took

    a = quality_metrics(json.loads((straight / "metrics.json").read_text()))
    b = quality_metrics(json.loads((killed / "metrics.json").read_text()))
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    steps = [torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
             for d in (straight, killed)]
    assert steps[0] == steps[1] == 5 * 9  # 5 epochs of 36 shapes in batches of 4
    # One W&B run: the resumed process logged into the run the killed one started.
    assert wandb_ids(killed) == {first_id}
    # The whole history in CSV too: every epoch's rows, those before the kill included, each once.
    assert history(killed) == history(straight)


@pytest.mark.xdist_group("resume")
def test_a_validation_cut_by_sigterm_runs_again_on_resume(env, straight, tmp_path):
    """A SIGTERM during an epoch's last training batch (or the validation after it) stops the run at the end of a
    validation batch. Resumed, Lightning took that validation for done: the epoch was never validated nor a
    candidate for the best checkpoint, and the run exited 0 with another best checkpoint and test score than the
    run that never stopped. Now the resumed run validates that epoch first and ends as the uninterrupted one."""
    stopped = tmp_path / "stopped"
    interrupt = ["+callbacks.interrupt._target_=interrupt_at.InterruptAt", "+callbacks.interrupt.step=18",
                 "+callbacks.interrupt.how=sigterm"]  # 9 steps an epoch
    proc = launch(INTERRUPT, [*ARGS, f"hydra.run.dir={stopped}", *interrupt], env, check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 18  # epoch 1's end
    assert not list((stopped / "checkpoints").glob("best-*-step000018.ckpt"))  # its validation was cut short
    run([*ARGS, f"hydra.run.dir={stopped}", "resume=true"], env)
    a = quality_metrics(json.loads((straight / "metrics.json").read_text()))
    b = quality_metrics(json.loads((stopped / "metrics.json").read_text()))
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    names = [sorted(p.name for p in (d / "checkpoints").glob("best-*.ckpt")) for d in (straight, stopped)]
    assert names[0] == names[1]
    # Every row of the history but epoch 1's training means (loss, accuracy), which Lightning accumulates over the
    # epoch's batches and keeps in no checkpoint (a run stopped inside an epoch loses them).
    full, resumed = history(straight), history(stopped)
    (lost,) = [row for row in full if row not in resumed]
    assert resumed == [row for row in full if row != lost]
    fields = {k: v for k, v in zip(full[0].split(","), lost.split(",")) if v}
    assert sorted(fields) == ["epoch", "step", "train/loss_epoch", "train/oa"] and fields["step"] == "17"


@pytest.mark.xdist_group("resume")
def test_a_run_stopped_inside_an_epoch_logs_that_epochs_means_over_all_its_batches(env, straight, tmp_path):
    """A SIGTERM inside an epoch (step 13 of epochs of 9): resumed, the epoch's training means (train/loss_epoch,
    train/oa) averaged the batches after the resume only, as Lightning keeps no metric state in checkpoints; now
    the running sums are in the checkpoint (suite.resume.EpochMeans) and the whole history is the uninterrupted
    run's, row for row."""
    stopped = tmp_path / "stopped"
    interrupt = ["+callbacks.interrupt._target_=interrupt_at.InterruptAt", "+callbacks.interrupt.step=13",
                 "+callbacks.interrupt.how=sigterm"]
    proc = launch(INTERRUPT, [*ARGS, f"hydra.run.dir={stopped}", *interrupt], env, check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 13 and saved["callbacks"]["EpochMeans"]["batches"] == 4
    run([*ARGS, f"hydra.run.dir={stopped}", "resume=true"], env)
    assert history(stopped) == history(straight)
    a = quality_metrics(json.loads((straight / "metrics.json").read_text()))
    b = quality_metrics(json.loads((stopped / "metrics.json").read_text()))
    assert {k: pytest.approx(v, abs=1e-6) for k, v in a.items()} == b


@pytest.mark.xdist_group("resume")
def test_a_step_limited_run_stopped_between_epochs_resumes_with_a_whole_epoch(env, tmp_path):
    """A run limited by trainer.max_steps (segmentation's and the GAN's recipes), stopped by a SIGTERM during an
    epoch's last batch, with no validation there: Lightning restarts such a run as if inside an epoch and kept the
    ended epoch's batch counts, so the next epoch ended after one batch (8 of its 9 batches never trained) and the
    run exited 0 with other weights than the run that never stopped. Now it resumes as that run, bit for bit."""
    # One validation, after epoch 1 (step 18), and none at the end (step 27): the best checkpoint is an earlier one
    # than the last whatever the scores (they differ between CPUs: the same seed trains another trajectory on an AMD
    # EPYC's AVX2 than on an AVX-512 machine), which the record's check below needs.
    args = [*ARGS, "logger=csv", "trainer.max_epochs=-1", "++trainer.max_steps=27",
            "++trainer.check_val_every_n_epoch=2", "callbacks.validate_at_end=null"]
    straight = tmp_path / "straight"
    started = time.monotonic()
    run([*args, f"hydra.run.dir={straight}"], env)
    took = time.monotonic() - started
    # The record is the whole fit's, not that of the best checkpoint, which is tested after the fit (Lightning
    # restores callbacks from it: its older wall time was added to the run's, and its throughput replaced the run's).
    record = json.loads((straight / "metrics.json").read_text())
    (best,) = (straight / "checkpoints").glob("best-*.ckpt")
    last = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    assert (torch.load(best, weights_only=True)["global_step"], last["global_step"]) == (18, 27)
    assert last["callbacks"]["FitRecord"]["seconds"] < record["wall_time_s"] < took
    fit = last["callbacks"]["TrainThroughput"]  # last.ckpt: written after the fit's last batch
    assert record["train_samples_per_sec"] == pytest.approx(fit["samples"] / fit["seconds"], rel=1e-9)

    stopped = tmp_path / "stopped"
    interrupt = ["+callbacks.interrupt._target_=interrupt_at.InterruptAt", "+callbacks.interrupt.step=9",
                 "+callbacks.interrupt.how=sigterm"]  # epoch 0's last batch; its validation comes after epoch 1
    proc = launch(INTERRUPT, [*args, f"hydra.run.dir={stopped}", *interrupt], env, check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    run([*args, f"hydra.run.dir={stopped}", "resume=true"], env)
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
            for d in (straight, stopped))
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]) and a["global_step"] == 27
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    names = [sorted(p.name for p in (d / "checkpoints").glob("best-*.ckpt")) for d in (straight, stopped)]
    assert names[0] == names[1]


def test_ckpt_path_last_needs_a_checkpoint_in_the_run_directory(env, tmp_path, capsys):
    """The message says where a run's directory is (it claimed "it is printed at the start of every run", which it
    is not) and the other ways: a checkpoint file, or resume=true."""
    err = user_error_in_process([*TINY, "ckpt_path=last", "logger=none", f"hydra.run.dir={tmp_path}"], capsys,
                                env["HOME"], tmp_path,
                                "ckpt_path=last", str(tmp_path / "checkpoints"), "hydra.run.dir=<run dir>",
                                "outputs/<task>/<attn>/<start time>/",
                                "last checkpoint: <run dir>/checkpoints/last.ckpt", "ckpt_path=<file>.ckpt",
                                "resume=true")
    assert "printed at the start" not in err


def test_resume_true_starts_afresh_when_nothing_to_resume(env, tmp_path):
    """... and a best checkpoint of a part killed while writing its first last.ckpt (trained again now) is not left
    beside the run's own best."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best-epoch000-step000099.ckpt").write_bytes(b"the killed part's")
    proc = run([*TINY, "resume=true", "logger=none", f"hydra.run.dir={tmp_path}"], env)
    assert "no checkpoint" in proc.stdout + proc.stderr
    assert (tmp_path / "metrics.json").is_file()
    (best,) = (tmp_path / "checkpoints").glob("best-*.ckpt")
    assert best.name != "best-epoch000-step000099.ckpt"


def test_resuming_a_finished_run_keeps_its_record(env, tmp_path):
    """A job script run again with resume=true (a sweep's script re-run to finish its unfinished runs, a SLURM job
    requeued after it had finished) resumed each finished run from its final checkpoint, trained nothing, tested
    again and rewrote metrics.json with the test metrics alone: the training and validation metrics were lost. A
    run killed while testing (after its final checkpoint) lost them the same way when resumed. Now the first
    keeps metrics.json byte for byte, and the second writes every metric of the uninterrupted run."""
    args = [*TINY, "logger=csv", f"hydra.run.dir={tmp_path}"]
    run(args, env)
    written = (tmp_path / "metrics.json").read_bytes()
    first = json.loads(written)
    assert {"train/loss", "val/oa", "val/oa_best", "test/oa", "train_samples_per_sec"} <= first.keys()

    again = run([*args, "resume=true"], env)
    assert "this run had finished already" in again.stdout + again.stderr
    assert (tmp_path / "metrics.json").read_bytes() == written

    (tmp_path / "metrics.json").unlink()  # as if killed while testing
    run([*args, "resume=true"], env)
    tested = json.loads((tmp_path / "metrics.json").read_text())
    assert tested.keys() == first.keys()
    assert quality_metrics(tested) == pytest.approx(quality_metrics(first), abs=1e-6)
    # The whole-run training rate of the fit, kept in the checkpoint (nothing trained in the resumed part).
    assert tested["train_samples_per_sec"] == pytest.approx(first["train_samples_per_sec"], rel=1e-9)


def test_a_refused_resume_leaves_the_finished_wandb_run_as_it_was(env, tmp_path):
    """A finished run resumed shorter (`resume=true trainer.max_epochs=1` after 2 epochs) is refused, exit 2. Its
    W&B run (the same id, checkpoints/wandb_run_id) had been reopened before that and finished with exit code 2
    and the refused command's config: report.wandb= then left the good run out ("W&B state failed"). Now it is
    refused before W&B is opened: one offline W&B run, finished as trained."""
    from test_run import wandb_config, wandb_records

    args = [*TINY, "trainer.max_epochs=2", f"hydra.run.dir={tmp_path}"]
    run(args, env)
    user_error([*args, "trainer.max_epochs=1", "resume=true"], env, "2 epochs, past trainer.max_epochs=1")
    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    (exit_record,) = [r.exit for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0 and wandb_config(wandb_file)["trainer"]["max_epochs"] == 2


SIGTERM_AFTER_A_STEP = """
import os, signal
import lightning as L

class SigtermAfterAStep(L.Callback):  # as a scheduler stops a job: SIGTERM, here after one training step
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_finished_run_that_trains_on_sets_its_record_aside(env, tmp_path):
    """`resume=true trainer.max_epochs=<more>` trains a finished run longer. Its metrics.json stayed in place while
    it trained: stopped before its new end, the folder held the earlier end's numbers beside a resolved_config.yaml
    of the new length and checkpoints past it, and mode=report read it as a finished run of the new length. The
    record is now set aside as metrics-step<N>.json at the first step, byte for byte; the report leaves the stopped
    run out; metrics.json comes back when the run ends again."""
    (tmp_path / "sigterm_after_a_step.py").write_text(SIGTERM_AFTER_A_STEP)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])}
    folder = tmp_path / "run"
    args = [*TINY, "logger=csv", f"hydra.run.dir={folder}"]
    run(args, env)
    written = (folder / "metrics.json").read_bytes()
    step = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    stopped = run([*args, "trainer.max_epochs=3", "resume=true",
                   "+callbacks.stop._target_=sigterm_after_a_step.SigtermAfterAStep"], env, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert not (folder / "metrics.json").exists()
    assert (folder / f"metrics-step{step}.json").read_bytes() == written
    assert f"the record of that end is kept as {folder / f'metrics-step{step}.json'}" in stopped.stdout + stopped.stderr
    report = run(["mode=report", f"report.runs={folder}", f"report.out={tmp_path / 'report'}", "logger=none"], env,
                 check=False)
    assert report.returncode == 2 and f"{folder}: no metrics.json" in report.stderr
    run([*args, "trainer.max_epochs=3", "resume=true"], env)
    assert json.loads((folder / "metrics.json").read_text())["test/oa"] >= 0
    assert (folder / f"metrics-step{step}.json").read_bytes() == written


def test_a_checkpoint_is_trained_on_only_under_its_own_recipe(env, tmp_path, capsys):
    """Lightning restores a checkpoint's optimizer and scheduler states: resumed with optim.optimizer.lr=0.5 the run
    went on at 0.01 while resolved_config.yaml and the checkpoint's hyper-parameters said 0.5. Such a command is
    refused before anything is written, naming the value and the ways on: the run's value to continue it, or a new
    run from its weights (model.weights=, which does train at 0.5); ckpt_path=<file> the same. A longer
    trainer.max_epochs is not refused, but the cosine schedule keeps its T_max=1 from the checkpoint (past it the
    rate rises back to 0.01, as the restored scheduler does), and the run's record now says T_max=1, not 2. New model,
    task or data values (a dropout, the number of points) are refused the same way; those of its evaluation are not.
    With optim.scale_lr, a resumed run on another global batch (here twice the accumulation) keeps the checkpoint's
    rate, 0.01, and now records it: its checkpoints' hyper-parameters said 0.02, scaled anew but never used."""
    recipe = [*TINY, "optim.scale_lr=linear", "optim.base_batch_size=4"]  # x 1 at data.batch_size=4
    first = tmp_path / "first"
    run([*recipe, "logger=csv", f"hydra.run.dir={first}"], env)
    before = {p: p.read_bytes() for p in [first / "resolved_config.yaml", first / "checkpoints" / "last.ckpt"]}
    changed = ["optim.optimizer.lr=0.5", "trainer.max_epochs=2", "logger=csv"]
    err = user_error_in_process(
        [*recipe, *changed, "resume=true", f"hydra.run.dir={first}"], capsys, env["HOME"], first,
        f"hydra.run.dir={first} holds a run trained with optim.optimizer.lr=0.01 (this command: 0.5). ",
        "(optim.optimizer.lr=0.01)", f"model.weights={first}/checkpoints/last.ckpt")
    assert "resuming" not in err and "T_max" not in err
    assert {p: p.read_bytes() for p in before} == before  # nothing written
    ckpt = first / "checkpoints" / "last.ckpt"
    user_error_in_process(
        [*recipe, *changed, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'second'}"], capsys, env["HOME"],
        tmp_path / "second", f"ckpt_path={ckpt} was trained with optim.optimizer.lr=0.01 (this command: 0.5)",
        f"model.weights={ckpt}")
    # model, task and data values are the recipe too: a run resumed with them trained on under them, and recorded
    # them alone (the order of a sweep's values changed between its first run and the one that finishes it)
    err = user_error_in_process(
        [*recipe, "data.npoints=128", "model.dropout=0.1", "task.label_smoothing=0", "data.num_workers=1",
         "eval.votes=2", "logger=csv", "resume=true", f"hydra.run.dir={first}"], capsys, env["HOME"], first,
        f"hydra.run.dir={first} holds a run trained with data.npoints=256 (this command: 128), "
        "model.dropout=0.5 (this command: 0.1), task.label_smoothing=0.2 (this command: 0). It would "
        "train on under this command's model, task, data or validation values",
        "(data.npoints=256 model.dropout=0.5 task.label_smoothing=0.2)",
        f"model.weights={first}/checkpoints/last.ckpt")
    assert "input_points" not in err and "num_workers" not in err and "votes" not in err and "optim" not in err
    assert {p: p.read_bytes() for p in before} == before

    def rates(folder):
        rows = (folder / "csv" / "metrics.csv").read_text().splitlines()
        column = rows[0].split(",").index("lr-SGD")
        return [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]

    longer = run([*recipe, "trainer.max_epochs=3", "++trainer.accumulate_grad_batches=2", "logger=csv",
                  "eval.votes=2", "task.log_samples=2",  # how it is tested and logged may change
                  "resume=true", f"hydra.run.dir={first}"], env)
    said = longer.stdout + longer.stderr
    assert "goes on with the learning rates of the checkpoint it resumes: optim.optimizer.lr=0.01 " \
           "(optim.scale_lr=linear gave 0.02" in said
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["optim"]["optimizer"]["lr"] == 0.01
    assert "goes on with the schedule of the checkpoint it resumes: optim.scheduler.T_max=1" in said
    assert "trainer.max_epochs=3 changes where it stops" in said
    assert "T_max: 1\n" in (first / "resolved_config.yaml").read_text()
    assert rates(first) == pytest.approx([0.01, 1e-4, 0.01])  # cosine with T_max=1: down, then back up
    # Trained on under another accumulation: resolved_config.yaml holds the last part's, metrics.json each part's,
    # and mode=report flags the row
    assert "this run goes on under other settings than its part before: accumulate_grad_batches 1 -> 2" in said
    parts = json.loads((first / "metrics.json").read_text())["provenance"]["settings"]
    assert [(p["from_step"], p["accumulate_grad_batches"], p["batch_size"]) for p in parts] == [(0, 1, 4), (10, 2, 4)]
    from suite.report import changed_settings, read_folders

    assert changed_settings(read_folders([first])[0]) == ["accumulate_grad_batches"]

    third = tmp_path / "third"
    run([*recipe, *changed, f"model.weights={ckpt}", f"hydra.run.dir={third}"], env)  # what the message advises
    assert rates(third) == pytest.approx([0.5, 0.5 / 2 + 1e-4 / 2])  # this command's rate, a schedule of 2 epochs


@pytest.mark.xdist_group("resume")
def test_gan_resumed_mid_epoch_continues_where_it_stopped(env, tmp_path, capsys):
    """GAN checkpoints fall mid-epoch (validation every 2 steps of a 224-step epoch): stopping at step 2 and
    continuing to step 6 gives the 6-step run, batch for batch (the loader's position is in the checkpoint)."""
    args = [*GAN_TINY, "attn=external", "metrics.every_n_steps=2", "metrics.num_samples=4", "eval.num_samples=4",
            f"metrics.cache_dir={tmp_path / 'fid'}", "logger=none", "+trainer.num_sanity_val_steps=0",
            "trainer.accelerator=cpu"]  # the CPU; on a GPU: tests/gpu/test_cuda_tasks.py
    run([*args, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'straight'}"], env)
    run([*args, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'split'}"], env)
    # Validation's FID of another number of samples would choose the best checkpoint among FIDs of two sizes (FID
    # is biased by it): refused.
    user_error_in_process([*args, "trainer.max_steps=6", "metrics.num_samples=8", "ckpt_path=last",
                           f"hydra.run.dir={tmp_path / 'split'}"], capsys, env["HOME"], tmp_path / "split",
               "holds a run trained with metrics.num_samples=4 (this command: 8)", "(metrics.num_samples=4)")
    proc = run([*args, "trainer.max_steps=6", "ckpt_path=last", f"hydra.run.dir={tmp_path / 'split'}"], env)
    assert "resuming from" in proc.stdout + proc.stderr
    a = quality_metrics(json.loads((tmp_path / "straight" / "metrics.json").read_text()))
    b = quality_metrics(json.loads((tmp_path / "split" / "metrics.json").read_text()))
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    steps = [torch.load(tmp_path / d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
             for d in ("straight", "split")]
    assert steps[0]["global_step"] == steps[1]["global_step"] == 6
    for key, value in steps[0]["state_dict"].items():  # G, D and the EMA generator, bit for bit
        assert torch.equal(value, steps[1]["state_dict"][key]), key


def test_segmentation_keeps_its_checkpoints_schedule_length(tmp_path, caplog):
    """The poly schedule read trainer.max_steps itself: a 24-step run resumed with trainer.max_steps=48 went on at
    the rate of a poly over 48 steps (0.0081 at step 10 where its own schedule gives 0.0062), without a word, where
    the other tasks keep their checkpoint's schedule (T_max) and say so. Its length is now optim.schedule_steps
    (${trainer.max_steps}), which a resumed run keeps from its checkpoint's run, with that warning."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from suite.resume import check_same_recipe
    from tasks.segmentation import Segmentation
    from test_config_checks import compose_run

    common = ["task=segmentation", "data=blobs", "trainer.max_epochs=-1"]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    OmegaConf.save(compose_run([*common, "trainer.max_steps=24"]), tmp_path / "resolved_config.yaml", resolve=True)
    cfg = compose_run([*common, "trainer.max_steps=48"])
    with caplog.at_level("WARNING"):
        check_same_recipe(cfg, tmp_path, resume=True, slurm_restart=False)
    assert "optim.schedule_steps=24. trainer.max_steps=48 changes where it stops" in caplog.text
    assert cfg.trainer.max_steps == 48 and cfg.optim.schedule_steps == 24
    optim = {**OmegaConf.to_container(cfg.optim, resolve=True), "optimizer": {
        "_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01}}
    task = Segmentation(2, ["a", "b"], {"backbone": "resnet18", "head_channels": 8, "pretrained": False},
                        {"name": "external"}, optim, crop=(32, 32))
    task._trainer = SimpleNamespace(max_steps=48, max_epochs=-1)
    scheduler = task.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.lr_lambdas[0](10) == pytest.approx((1 - 10 / 24) ** 0.9, rel=1e-12)


def test_what_a_resumed_run_may_change():
    """Where files are, batch sizes, logging and the test's options may change when a run trains on; the options a
    task's validation uses too (they choose the best checkpoint) may not, also as the task's interpolated copy."""
    from suite.resume import free_to_change
    from tasks.segmentation import Segmentation

    validation = Segmentation.validation_options
    assert all(free_to_change(k, validation) for k in (
        "data.root", "data.num_workers", "data.batch_size", "model.weights", "model.pretrained", "task.log_images",
        "task.eval.every_n_steps", "data.val_samples"))
    assert not any(free_to_change(k, validation) for k in (
        "task.eval.mode", "task.eval.scales", "task.eval.flip", "model.dropout", "data.crop_size", "task.aux_weight"))
    assert free_to_change("task.eval.scales") and not free_to_change("task.metrics.num_samples",
                                                                     ("metrics.num_samples",))
    # the GAN's validation FID of another sample count, through metrics.num_samples or data.val_samples itself
    from tasks.gan import GAN

    assert not any(free_to_change(k, GAN.validation_options) for k in (
        "metrics.num_samples", "data.val_samples", "metrics.reference_samples", "metrics.isc_splits"))
    assert all(free_to_change(k, GAN.validation_options) for k in ("eval.num_samples", "data.test_samples"))



@pytest.mark.parametrize("case", ["parts", "shapes", "shapenet_part", "modelnet40_pyg", "voted_modelnet40",
                                  "modelnet40", "same_seed", "segmentation"])
def test_a_point_test_under_another_seed_says_what_the_seed_decides(tmp_path, caplog, case):
    """`mode=test ckpt_path=<a seed-0 run's checkpoint>` runs under the command's own seed (42 unless given), which
    is never compared with the run's (an operational option). Where the seed decides the test (the generated test
    set of data=shapes/parts, the points of each ShapeNet-part shape, the votes' scales), the test scored the
    network on other shapes, points or votes than its run's own test and exited 0 with other numbers, saying
    nothing (a parts_demo network: test/imiou 0.0976 against its run's 0.1000). Now it says so, naming seed=0."""
    import logging

    from omegaconf import OmegaConf

    from suite.resume import warn_tested_recipe

    data = {"parts": ("datamodules.partseg.parts.Parts", "shapenet"),
            "shapes": ("datamodules.points.shapes.Shapes", "modelnet"),
            "shapenet_part": ("datamodules.partseg.shapenet_part.ShapeNetPart", "shapenet"),
            "modelnet40_pyg": ("datamodules.points.modelnet40_pyg.ModelNet40PyG", "modelnet"),
            "voted_modelnet40": ("datamodules.points.modelnet40.ModelNet40", "modelnet"),
            "modelnet40": ("datamodules.points.modelnet40.ModelNet40", "modelnet"),
            "same_seed": ("datamodules.partseg.parts.Parts", "shapenet"),
            "segmentation": ("datamodules.segmentation.blobs.Blobs", "segmentation")}
    target, task = data[case]
    votes = 10 if case == "voted_modelnet40" else 1

    def config(seed):
        return OmegaConf.create({"seed": seed, "task": {"name": task, "seed": seed}, "eval": {"votes": votes},
                                 "data": {"_target_": target, "seed": seed}, "model": {}})

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    OmegaConf.save(config(0), run / "resolved_config.yaml")
    ckpt = run / "checkpoints" / "best.ckpt"
    ckpt.touch()
    with caplog.at_level(logging.WARNING, logger="suite.resume"):
        warn_tested_recipe(config(0 if case == "same_seed" else 42), str(ckpt))
    said = [r.getMessage() for r in caplog.records if "is tested under seed=" in r.getMessage()]
    if case in ("modelnet40", "same_seed", "segmentation"):  # the seed decides nothing here (or is the same)
        assert not said
        return
    (said,) = said
    assert f"{ckpt} is tested under seed=42, its run ({run}) under seed=0" in said and "pass seed=0." in said
    decides = {"parts": "generated test set", "shapes": "generated test set", "shapenet_part": "which points",
               "modelnet40_pyg": "each test mesh", "voted_modelnet40": "eval.votes"}[case]
    assert decides in said


def test_the_recipe_compares_credentials_as_they_were_written(tmp_path, monkeypatch):
    """resolved_config.yaml holds credentials redacted (suite/secrets.py): this run's values are compared in that
    form, so an option holding a token, or the value of a credential-like variable, does not differ from itself.
    Options of validation count to train on, not to test."""
    from omegaconf import OmegaConf

    from suite.resume import recipe_differences
    from suite.secrets import redact

    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-0123456789")
    cfg = OmegaConf.create({"task": {"_target_": "tasks.modelnet.PointCloudClassification", "label_smoothing": 0.2},
                            "model": {"api_key": "k-0123456789", "path": "/x/tok-0123456789", "dropout": 0.5}})
    saved = tmp_path / "resolved_config.yaml"
    saved.write_text(OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg)))))
    assert "0123456789" not in saved.read_text()
    assert recipe_differences(cfg, saved)[3] == []
    cfg.model.dropout = 0.1
    assert recipe_differences(cfg, saved)[3] == ["model.dropout"]

    # segmentation's validation infers with eval.scales: refused to train on under others, not warned to test with
    seg = OmegaConf.create({"task": {"_target_": "tasks.segmentation.Segmentation", "eval": {"scales": [1.0]}}})
    saved.write_text(OmegaConf.to_yaml(seg))
    seg.task.eval.scales = [0.5, 1.0]
    assert recipe_differences(seg, saved)[3] == ["task.eval.scales"]
    assert recipe_differences(seg, saved, training=False)[3] == []


def test_history_survives_a_kill_while_its_header_widens(tmp_path, monkeypatch):
    """A new metric name makes Lightning's CSV writer rewrite metrics.csv whole (a wider header). It opened the file
    for writing first, so a SIGKILL during the rewrite left it cut short, and the resumed run lost every row before
    the interruption (seen once in CI). Here the rewrite stops halfway (the rows' write raises, as a kill stops it):
    the file still holds every row of before, which the resumed run keeps; a rewrite that completes widens the
    header with every row kept; a last row cut short by a kill is not read back."""
    import csv

    from suite.loggers import HistoryCSVLogger

    def logged(directory: Path) -> HistoryCSVLogger:  # three rows on disk, a fourth with a new name pending
        logger = HistoryCSVLogger(directory)
        for step in range(3):
            logger.log_metrics({"train/loss": 1.0 + step}, step=step)
        logger.save()
        logger.log_metrics({"val/loss": 0.5}, step=3)
        return logger

    logger = logged(tmp_path / "killed")
    path = Path(logger.log_dir) / "metrics.csv"
    before = path.read_text()
    assert before.splitlines()[0] == "step,train/loss" and len(before.splitlines()) == 4
    writerows = csv.DictWriter.writerows

    def killed(self, rows):
        raise KeyboardInterrupt("killed during the rewrite")

    monkeypatch.setattr(csv.DictWriter, "writerows", killed)
    with pytest.raises(KeyboardInterrupt):
        logger.save()
    monkeypatch.setattr(csv.DictWriter, "writerows", writerows)
    assert path.read_text() == before  # not cut short: the old file whole
    resumed = HistoryCSVLogger(tmp_path / "killed", resume_step=10)
    assert [row["step"] for row in resumed._kept] == ["0", "1", "2"]

    logger = logged(tmp_path / "whole")
    logger.save()
    path = Path(logger.log_dir) / "metrics.csv"
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"] and rows[3]["val/loss"] == "0.5"
    assert rows[0]["train/loss"] == "1.0" and rows[0]["val/loss"] == ""
    with path.open("a") as f:  # a row the kill cut short
        f.write("4,2.0")
    resumed = HistoryCSVLogger(tmp_path / "whole", resume_step=10)
    assert [row["step"] for row in resumed._kept] == ["0", "1", "2", "3"]


# A two-process CPU fit (Lightning's DDP launcher runs this file again for rank 1) recording each rank's training
# draws: python, numpy and torch. argv: out folder, devices, steps, checkpoint to resume from or "-", step to save at.
RANK_DRAWS = r"""
import json, os, random, sys
import numpy as np, torch, lightning as L
sys.path.insert(0, os.environ["SUITE_ROOT"])
from suite.resume import RandomState

out, devices, steps, resume, save_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])

class Draws(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
    def training_step(self, batch, batch_idx):
        draw = [random.random(), float(np.random.rand()), float(torch.rand(1))]
        with open(os.path.join(out, f"rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([self.global_step, draw]) + "\n")
        return (self.w * batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class SaveAt(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == save_at:
            trainer.save_checkpoint(os.path.join(out, "mid.ckpt"))

L.seed_everything(7, workers=True)
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=steps,
                    callbacks=[RandomState(), SaveAt()], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(Draws(), torch.utils.data.DataLoader(torch.ones(64, 1), batch_size=2),
            ckpt_path=None if resume == "-" else resume)
# No interpreter shutdown: a gloo worker thread still dropping the last collective's state as Python finalizes
# aborts the process ("terminate called without an active exception", about 1 run in 20 with torch 2.14).
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
"""


def test_each_process_draws_its_own_numbers_and_resumes_them(env, tmp_path):
    """Under DDP every process was seeded alike and drew the same numbers while training (Mixup weights and boxes,
    drop-path masks, main-process augmentations), where the recipes seed each process apart. Now the second draws
    its own; the first draws what a single-process run draws. A run resumed mid-epoch draws on every process what
    the uninterrupted one drew: each process's generators are in the checkpoint (only the first's were)."""
    script = tmp_path / "rank_draws.py"
    script.write_text(RANK_DRAWS)
    env = {**env, "SUITE_ROOT": str(ROOT)}

    def fit(name, devices, steps, resume="-", save_at=-1):
        out = tmp_path / name
        out.mkdir()
        done = warm_python.run([sys.executable, str(script), str(out), str(devices), str(steps), str(resume),
                                str(save_at)], cwd=tmp_path, env=env, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return {rank: [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
                for rank in range(devices)}

    whole = fit("whole", 2, 6, save_at=3)
    single = fit("single", 1, 6)
    assert [d for _, d in whole[0]] == [d for _, d in single[0]]
    assert all(x != y for (_, a), (_, b) in zip(whole[0], whole[1]) for x, y in zip(a, b))  # python, numpy, torch
    resumed = fit("resumed", 2, 6, resume=tmp_path / "whole" / "mid.ckpt")
    for rank in (0, 1):
        assert resumed[rank] == whole[rank][3:], rank


def test_random_states_of_older_checkpoints_and_new_processes():
    """A checkpoint written before per-process states holds one state: every process takes it, as every process
    drew alike then. A process the checkpoint holds no state of (resumed on more processes) is reseeded from
    (seed, rank), as at a fresh start."""
    from types import SimpleNamespace

    from suite.resume import RandomState, rank_seed

    torch.manual_seed(11)
    flat = RandomState()._own_state()
    expected = torch.rand(3)
    for rank in (0, 1):
        callback = RandomState()
        callback.load_state_dict(flat)  # the format of before: no "ranks"
        callback.on_train_start(SimpleNamespace(global_rank=rank, world_size=2), None)
        assert torch.equal(torch.rand(3), expected), rank
    callback = RandomState()
    callback.load_state_dict({"ranks": [flat]})  # written by one process, resumed on two: rank 1 has none
    callback.on_train_start(SimpleNamespace(global_rank=1, world_size=2), None)
    drawn = torch.rand(3)
    torch.manual_seed(rank_seed(1))
    assert torch.equal(drawn, torch.rand(3)) and not torch.equal(drawn, expected)
