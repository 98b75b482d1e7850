"""The end of fit always leaves ``checkpoints/last.ckpt`` (suite/checkpoints.py's LastCheckpoint), and says where:
at max_steps and at max_time without any validation, when a run is interrupted (Ctrl-C, SIGTERM) between
validations, and at the normal end (max_epochs reached, the interrupted runs' resumption). A SIGTERM ends the run
with exit code 143 and one line saying how to resume (suite/train.py). The last training batch is validated
whatever limit ends the run (suite/callbacks.py's ValidateAtEnd), and a run resumed at that end trains nothing more."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch

from test_reliability import launch
from test_run import GAN_TINY, ROOT, TINY, env, run  # noqa: F401 - env is a fixture

# A config callback that interrupts the run after the training batch that reaches global step `step`: as Ctrl-C
# does (KeyboardInterrupt, which Lightning handles gracefully and ends with exit code 1) or with a SIGTERM to the
# process (Lightning stops at the end of that batch).
INTERRUPT = r"""
import os, signal, subprocess, sys, types
import lightning as L

class InterruptAt(L.Callback):
    def __init__(self, step, how):
        self.step, self.how = step, how

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            if self.how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif self.how == "sigterm_all":  # as a scheduler signals a job: every process, data workers too, from
                # another process (a worker exits quietly when the signal comes from its own main process)
                subprocess.run(["kill", "-s", "TERM", "--", f"-{os.getpgid(0)}"])
            elif self.how == "sigint_all":  # Ctrl-C in a terminal: SIGINT to its foreground group, workers too
                subprocess.run(["kill", "-s", "INT", "--", f"-{os.getpgid(0)}"])
            else:
                raise KeyboardInterrupt

sys.modules["interrupt_at"] = types.ModuleType("interrupt_at")
sys.modules["interrupt_at"].InterruptAt = InterruptAt
"""


def saved_step(path: Path) -> int:
    """The global step of a complete checkpoint that loads as the suite loads checkpoints (weights only)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["state_dict"] and state["suite"]["task"]  # weights and the run's identity
    return state["global_step"]


def test_run_that_never_validates_leaves_its_weights(env, tmp_path):
    """The issue's command: a GAN stopped by max_steps with validation off wrote no checkpoint before."""
    proc = run([*GAN_TINY, "attn=external", "++trainer.max_steps=2", "++trainer.limit_val_batches=0",
                "eval.num_samples=4", f"metrics.cache_dir={tmp_path / 'fid'}", "logger=none",
                f"hydra.run.dir={tmp_path}"], env)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert saved_step(last) == 2
    assert f"last checkpoint: {last}" in proc.stdout + proc.stderr
    assert not list(last.parent.glob(".last.ckpt.tmp-*"))  # written through the atomic checkpoint IO


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm", "sigterm_all", "sigint_all"])
def test_interrupted_run_leaves_last_checkpoint_and_resumes_from_it(env, tmp_path, how):
    """Interrupted at step 3 of a 10-step epoch (no validation yet, so no checkpoint before): last.ckpt holds step
    3, and `ckpt_path=last` continues from there to the end of the epoch. `sigterm_all` signals the run's whole
    process group, two data-loading workers included, as a scheduler does: the workers died of it and the run
    crashed ("DataLoader worker ... is killed by signal: Terminated", exit 1, no checkpoint). `sigint_all` is
    Ctrl-C in a terminal: the run stops at the end of the batch as on SIGTERM (exit 130), where Python's
    KeyboardInterrupt stopped it wherever it was (`ctrl_c`: a second Ctrl-C still does, exit 1)."""
    args = [*TINY, "logger=none", f"hydra.run.dir={tmp_path}"]
    if how.endswith("_all"):
        args.append("data.num_workers=2")
    proc = launch(INTERRUPT, [*args, "+callbacks.interrupt._target_=interrupt_at.InterruptAt",
                              "+callbacks.interrupt.step=3", f"+callbacks.interrupt.how={how}"], env, check=False,
                  start_new_session=True)  # its own process group, which sigterm_all signals
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert saved_step(last) == 3
    assert f"last checkpoint: {last}" in proc.stdout + proc.stderr
    assert not (tmp_path / "metrics.json").exists()  # the run did not go on to test
    if how == "ctrl_c":
        assert proc.returncode == 1  # Lightning's graceful shutdown after Ctrl-C
    else:  # as a process killed by SIGTERM (SIGINT): a scheduler must not take the job as finished (it exited 0)
        name, code = ("Ctrl-C (SIGINT)", 130) if how == "sigint_all" else ("SIGTERM", 143)
        assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
        (said,) = [line for line in (proc.stdout + proc.stderr).splitlines() if f"interrupted by {name}" in line]
        assert "at step 3 (epoch 0)" in said and f"its weights are in {last} (step 3)" in said
        # said once: not by the workers too, which had inherited the main process's handler
        assert (proc.stdout + proc.stderr).count("Ctrl-C: stopping") == (how == "sigint_all")
        assert f"hydra.run.dir={tmp_path} resume=true" in said and "Traceback" not in proc.stderr
    resumed = run([*args, "ckpt_path=last"], env)
    out = resumed.stdout + resumed.stderr
    assert f"resuming from {last}" in out
    # The normal end: max_epochs reached, last.ckpt holds the last step and the run says where.
    assert "`max_epochs=1` reached" in out
    assert saved_step(last) == 10  # 40 generated shapes in batches of 4: the epoch finished
    assert f"last checkpoint: {last} (step 10)" in out
    assert (tmp_path / "metrics.json").is_file()


def test_run_ended_by_max_time_leaves_its_weights(env, tmp_path):
    """Stopped by ``trainer.max_time`` (1 s of training; 1000 epochs would take minutes) with validation off, so
    that only the end of fit can write last.ckpt: it loads and holds the step the run reached."""
    proc = run([*TINY, "trainer.max_epochs=1000", "++trainer.max_time={seconds:1}", "++trainer.limit_val_batches=0",
                "logger=none", f"hydra.run.dir={tmp_path}"], env)
    out = proc.stdout + proc.stderr
    assert "Time limit reached" in out  # Lightning's Timer ended it, not max_epochs
    last = tmp_path / "checkpoints" / "last.ckpt"
    (step,) = {int(s) for s in re.findall(rf"last checkpoint: {re.escape(str(last))} \(step (\d+)\)", out)}
    assert 1 <= step < 1000 * 10 and saved_step(last) == step
    assert not list(last.parent.glob(".last.ckpt.tmp-*"))


class ScoredByEpoch(L.LightningModule):
    """A network whose validation score is set per epoch: 0.9, 0.5, then 0.7 (after a resume, below the best)."""

    SCORES = (0.9, 0.5, 0.7)

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/oa", self.SCORES[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 1)), batch_size=2)

    val_dataloader = train_dataloader


def fit_scored(folder: Path, epochs: int, ckpt_path: Path | None = None):
    """ScoredByEpoch fitted with the run's checkpoint callbacks in ``folder``; the best checkpoint's callback."""
    from suite.checkpoints import checkpoint_callbacks

    best, last, identity = checkpoint_callbacks(folder, {"metric": "val/oa", "mode": "max"}, {"task": "t", "attn": {}})
    L.Trainer(max_epochs=epochs, callbacks=[best, last, identity], logger=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0).fit(ScoredByEpoch(), ckpt_path=ckpt_path)
    return best


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_run_resumed_in_a_moved_folder_keeps_its_best_checkpoint(tmp_path, how):
    """A run folder copied or moved elsewhere (or seen through another mount point) and resumed there: the best of
    the epochs before the move stays the best (0.9, not the 0.7 of the epoch after), found in the new folder.
    Lightning keeps the old absolute folder and drops the best score, so the first validation after the resume was
    best whatever its score, and the run tested it."""
    import shutil

    first = fit_scored(tmp_path / "a", 2)
    assert first.best_model_score == pytest.approx(0.9)
    (shutil.copytree if how == "copied" else shutil.move)(tmp_path / "a", tmp_path / "b")
    best = fit_scored(tmp_path / "b", 3, ckpt_path=tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert best.best_model_score == pytest.approx(0.9)
    assert Path(best.best_model_path) == tmp_path / "b" / "checkpoints" / Path(first.best_model_path).name
    assert Path(best.best_model_path).is_file() and "epoch000" in Path(best.best_model_path).name
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [
        Path(first.best_model_path).name, "last.ckpt"]  # no second "best" beside the first


def test_a_run_started_from_another_folders_checkpoint_starts_its_own_best(tmp_path):
    """ckpt_path= of another run's checkpoint into a new folder (not a move: its best is not there) keeps
    Lightning's behaviour: the new folder's best is chosen among its own validations."""
    fit_scored(tmp_path / "a", 2)
    best = fit_scored(tmp_path / "b", 3, ckpt_path=tmp_path / "a" / "checkpoints" / "last.ckpt")
    assert best.best_model_score == pytest.approx(0.7)
    assert Path(best.best_model_path).parent == tmp_path / "b" / "checkpoints"


def test_an_interrupted_sweep_job_says_how_to_continue_the_sweep(tmp_path, caplog):
    """A job of a multirun stopped by SIGTERM said to rerun with `hydra.run.dir=<job dir> resume=true`, which Hydra
    ignores under -m: followed, it started the whole sweep afresh in a new folder (seed 0 trained twice, the stopped
    run left unfinished). It now names the sweep's own form."""
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from suite.train import interrupted

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.sweep.dir={tmp_path / 'sweep'}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    trainer = SimpleNamespace(is_global_zero=True, global_step=3, current_epoch=0, state=SimpleNamespace(fn="fit"))
    job = tmp_path / "sweep" / "1_modelnet_external"
    try:
        HydraConfig.instance().set_config(cfg)
        with caplog.at_level("ERROR"):
            assert interrupted(trainer, job, "train") == 143
    finally:
        HydraConfig.instance().cfg = None
    assert f"continue the sweep with the same command plus `resume=true hydra.sweep.dir={tmp_path / 'sweep'}`" \
        in caplog.text and "hydra.run.dir" not in caplog.text
    with caplog.at_level("ERROR"):  # a single run: its own folder
        interrupted(trainer, job, "train")
    assert f"`hydra.run.dir={job} resume=true`" in caplog.text


class Validated(L.LightningModule):
    """8 samples in batches of 2 (4 batches an epoch); records the global step of each validation. ``d_steps`` > 0:
    manual optimisation as the GAN's, that many discriminator updates not counted (tasks.gan.not_counted) before
    each counted generator update."""

    def __init__(self, d_steps: int = 0):
        super().__init__()
        self.g, self.d, self.d_steps, self.validated = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), d_steps, []
        self.automatic_optimization = not d_steps

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self.g(batch[0]).pow(2).mean()
        from tasks.gan import not_counted

        opt_g, opt_d = self.optimizers()
        for _ in range(self.d_steps):
            opt_d.zero_grad()
            self.manual_backward(self.d(batch[0]).pow(2).mean())
            with not_counted(opt_d):
                opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(self.g(batch[0]).pow(2).mean())
        opt_g.step()

    def validation_step(self, batch, batch_idx):
        self.log("val/oa", float(self.global_step))

    def on_validation_epoch_end(self):
        self.validated.append(self.global_step)

    def configure_optimizers(self):
        opt_g = torch.optim.SGD(self.g.parameters(), lr=0.1)
        return opt_g if self.automatic_optimization else (opt_g, torch.optim.SGD(self.d.parameters(), lr=0.1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 1)), batch_size=2)

    val_dataloader = train_dataloader


def fit_validated(module=None, callbacks=(), ckpt_path=None, **limits):
    """``module`` (a Validated) fitted under ``limits`` with callbacks.validate_at_end; the module and trainer."""
    from suite.callbacks import ValidateAtEnd

    module = module or Validated()
    trainer = L.Trainer(callbacks=[ValidateAtEnd(), *callbacks], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", **limits)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


# (trainer limits, the global steps validated); d_steps: the GAN's discriminator updates per generator update
LIMITS_VALIDATED = [
    # check_val_every_n_epoch=2 over 5 epochs: after epochs 2 and 4 only, before
    ({"max_epochs": 5, "check_val_every_n_epoch": 2}, [8, 16, 20]),
    # 3 batches an epoch (limit_train_batches), every 2nd of each: batch 3 of the last epoch was never validated
    ({"max_epochs": 3, "limit_train_batches": 3, "val_check_interval": 2}, [2, 5, 8, 9]),
    ({"max_epochs": 3}, [4, 8, 12]),  # every epoch's end: the last one validated once
    # the GAN: 3 discriminator updates per counted generator step; max_steps counts the generator's
    ({"max_steps": 5, "val_check_interval": 2, "check_val_every_n_epoch": None, "d_steps": 3}, [2, 4, 5]),
    ({"max_steps": 4, "val_check_interval": 2, "check_val_every_n_epoch": None, "d_steps": 3}, [2, 4]),
]


def test_the_last_training_step_is_validated_once_under_any_limit_in_every_task():
    """callbacks.validate_at_end validated after trainer.max_steps only, and in segmentation alone: a run limited by
    trainer.max_epochs whose validations did not land on its last batch (check_val_every_n_epoch not dividing
    max_epochs, a val_check_interval in batches), or a GAN whose max_steps was no multiple of metrics.every_n_steps,
    never validated its final weights, so its best checkpoint, metrics.json and test could not be them. Now every
    limit is, in every task; a last batch validated anyway is validated once."""
    from hydra import compose, initialize_config_dir

    for limits, validated in LIMITS_VALIDATED:
        limits = dict(limits)
        module, trainer = fit_validated(Validated(limits.pop("d_steps", 0)), **limits)
        assert module.validated == validated, limits
        assert trainer.global_step == validated[-1]
        # lifted for the last epoch's validation only: the trainer keeps its setting
        assert trainer.check_val_every_n_epoch == limits.get("check_val_every_n_epoch", 1)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):  # the default of every task
        for task in sorted(p.stem for p in (ROOT / "configs" / "task").glob("*.yaml")):
            target = compose("config", overrides=[f"task={task}"]).callbacks.validate_at_end._target_
            assert target == "suite.callbacks.ValidateAtEnd", task


def test_a_run_resumed_at_its_validated_end_trains_nothing_more(tmp_path):
    """last.ckpt written by the validation of an epoch-limited run's last batch (as callbacks.validate_at_end adds
    when check_val_every_n_epoch does not divide max_epochs) was kept at the end of fit (same step): resumed from
    those loops, Lightning took a 13th step of a 12-step run and validated it, so a finished run resumed with
    resume=true trained on. Now last.ckpt is written again at the end of fit."""
    from suite.checkpoints import LastCheckpoint

    limits = {"max_epochs": 3, "check_val_every_n_epoch": 2}
    first, _ = fit_validated(callbacks=[LastCheckpoint(tmp_path)], **limits)
    assert first.validated == [8, 12]
    again, trainer = fit_validated(callbacks=[LastCheckpoint(tmp_path)], ckpt_path=tmp_path / "last.ckpt", **limits)
    assert trainer.global_step == 12 and again.validated == []
