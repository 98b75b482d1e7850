"""``trainer=ddp``: two processes on CPU (gloo) for every task, as ``python run.py trainer=ddp ...`` runs them.

Each run must finish, every process must end with the same metrics, only the first writes ``metrics.json``,
and evaluation must score every sample exactly once: the test metrics equal those of a single process testing
the same checkpoint. The evaluation sets have odd sizes, so a sampler that pads the last round by repeating a
sample (Lightning's default) would change them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_reliability import launch
from test_run import GAN_TINY, ROOT, SEG_TINY, TINY, env, run, user_error  # noqa: F401  (env is a fixture)
from fixture_cache import user_error_in_process

from suite.distributed import lr_scale, scale_learning_rates
from suite.run_record import quality_metrics

DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=csv"]
RANK_METRICS = re.compile(r"rank (\d+) metrics: (\{.*\})")

CASES = {
    # 3 classes x 3 = 9 validation and 9 test shapes
    "modelnet": [*TINY, "data.num_classes=3", "data.train_per_class=8", "data.val_per_class=3",
                 "data.test_per_class=3", "data.eval_batch_size=2", "trainer.max_epochs=2", "optim.scale_lr=linear",
                 "++trainer.limit_val_batches=2"],
    "shapenet": ["experiment=parts_demo", "data.num_categories=3", "data.train_per_category=4",
                 "data.val_per_category=3", "data.test_per_category=3", "data.npoints=64", "data.batch_size=4",
                 "data.eval_batch_size=2", "trainer.max_epochs=2", "trainer.enable_progress_bar=false"],
    "gan": [*GAN_TINY, "attn=external", "trainer.max_steps=2", "metrics.every_n_steps=2", "metrics.num_samples=9",
            "eval.num_samples=9", "+trainer.num_sanity_val_steps=0"],
    "segmentation": [*SEG_TINY, "attn=external", "data.num_val=5", "data.num_test=5", "data.eval_batch_size=2",
                     "trainer.max_steps=4", "eval.every_n_steps=2"],
}


# `mode=test` that validates the checkpoint instead (one process scoring the validation samples).
VALIDATE_INSTEAD_OF_TEST = r"""
import lightning.pytorch as pl
def test(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None, weights_only=None):
    return self.validate(model, ckpt_path=ckpt_path, verbose=verbose, datamodule=datamodule, weights_only=weights_only)
pl.Trainer.test = test
"""


def rank_metrics(out: Path) -> dict[int, dict]:
    """What each process logged as its final metrics (Hydra gives every process its own log file)."""
    found = {}
    for log in out.glob("*.log"):
        for rank, metrics in RANK_METRICS.findall(log.read_text()):
            found[int(rank)] = json.loads(metrics)
    return found


@pytest.mark.parametrize("task", list(CASES))
def test_two_process_ddp(task, env, tmp_path):
    out = tmp_path / "ddp"
    extra = [f"metrics.cache_dir={tmp_path / 'fid'}"] if task == "gan" else []
    proc = run([*CASES[task], *extra, *DDP, f"hydra.run.dir={out}"], env)

    per_rank = rank_metrics(out)
    assert sorted(per_rank) == [0, 1], proc.stdout[-2000:]
    assert per_rank[0] == per_rank[1]  # synced: every process ends with the same numbers
    written = quality_metrics(json.loads((out / "metrics.json").read_text()))
    assert written == per_rank[0]
    assert proc.stdout.count("metrics written to") == 1  # by the first process only
    assert all(math.isfinite(v) for v in written.values())

    best = sorted((out / "checkpoints").glob("best-*.ckpt"))
    assert best, list((out / "checkpoints").iterdir())
    single = tmp_path / "single"
    run([*CASES[task], *extra, "mode=test", f"ckpt_path={best[-1]}", "logger=none", f"hydra.run.dir={single}"], env)
    alone = json.loads((single / "metrics.json").read_text())
    tested = {k: v for k, v in written.items() if k.startswith("test/")}
    assert tested and set(tested) == {k for k in alone if k.startswith("test/")}
    for key, value in tested.items():
        assert value == pytest.approx(alone[key], rel=1e-5, abs=1e-6), key
    if task == "gan":
        assert written["test/samples"] == 9  # each generated image scored once, none twice
        # The validation that chose the checkpoint scored it as one process does: each process generated its share
        # with BatchNorm statistics of its own batches (no synchronised BatchNorm on the CPU), not the checkpoint's.
        launch(VALIDATE_INSTEAD_OF_TEST, [*CASES[task], *extra, "mode=test", f"ckpt_path={best[-1]}", "logger=none",
                                          f"hydra.run.dir={tmp_path / 'validated'}"], env)
        validated = json.loads((tmp_path / "validated" / "metrics.json").read_text())
        for key in ("val/fid", "val/is", "val/kid"):
            if key in written:
                assert written[key] == pytest.approx(validated[key], rel=1e-5, abs=1e-6), key
        assert "val/fid" in written
    if task == "modelnet":  # the checkpoint was chosen on 2 batches of each process's share: 4 batches, strided
        part = "2 batches of each of 2 processes' shares (trainer.limit_val_batches=2)"
        assert json.loads((out / "metrics.json").read_text())["protocol"]["selected_on_part"] == part
        assert alone["protocol"]["selected_on_part"] == part  # the test of its checkpoint, from the run's record
    if task == "modelnet":  # optim.scale_lr=linear: 2 processes x batch 4 = 8, twice the batch lr=0.01 was set for
        state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert state["hyper_parameters"]["optim"]["optimizer"]["lr"] == pytest.approx(0.02)
        assert state["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(0.02)


def test_lr_scaling_rules():
    assert lr_scale(None, 512, 64) == 1.0
    assert lr_scale("linear", 512, 64) == 8.0
    assert lr_scale("sqrt", 512, 128) == 2.0
    optim = {"scale_lr": "linear", "generator": {"_target_": "torch.optim.Adam", "lr": 2e-4},
             "discriminator": {"_target_": "torch.optim.Adam", "lr": 1e-4}, "weight_decay": 1e-4}
    assert sorted(scale_learning_rates(optim, 4.0)) == ["optim.discriminator.lr", "optim.generator.lr"]
    assert optim["generator"]["lr"] == pytest.approx(8e-4) and optim["discriminator"]["lr"] == pytest.approx(4e-4)
    assert optim["weight_decay"] == 1e-4


def test_bad_scaling_rule_and_ddp_inside_a_local_multirun_are_refused(env, tmp_path, capsys):
    user_error_in_process([*TINY, "optim.scale_lr=cubic", "logger=none", f"hydra.run.dir={tmp_path / 'a'}"], capsys,
                          env["HOME"], tmp_path / "a", "optim.scale_lr", "linear", "sqrt")
    user_error(["-m", *TINY, *DDP, "attn=self,external", f"hydra.sweep.dir={tmp_path / 'b'}"], env,
               "trainer=ddp", "multirun", "hydra/launcher=slurm")
    # Strategies that start their processes from this one: ddp_spawn failed with a traceback (a lock cannot be
    # pickled), ddp_fork trained in the forked processes and then said "took no training step" (exit 2, the wrong
    # message), the run's record having seen none of it.
    for strategy, method in (("ddp_spawn", "spawn"), ("ddp_fork", "fork")):
        user_error([*TINY, *DDP, f"++trainer.strategy={strategy}", "logger=none",
                    f"hydra.run.dir={tmp_path / strategy}"], env,
                   f"trainer.strategy={strategy} starts its processes from this one (start method '{method}'",
                   "Use trainer=ddp")


# A config callback, importable by every process (Lightning starts the others as `python run.py ...`, so it lives in
# a module on PYTHONPATH), that sends SIGTERM after the training batch that reaches global step `step`: "all": to
# every process of the job, as a scheduler does (the first process signals its process group), and the second
# process once more, as Lightning's own handler in the first process forwarded it; "second": to the second process
# only; "validating": to the second process during the validation after that step (the processes see different
# numbers of evaluation batches: each sample is scored once); "ctrl_c": SIGINT to every process, as Ctrl-C in a
# terminal sends it (the first process signals its process group).
SIGTERM_AT = r"""
import os, signal
import lightning as L

class SigtermAt(L.Callback):
    def __init__(self, step, who):
        self.step, self.who = step, who

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or self.who == "validating":
            return
        if self.who == "ctrl_c":  # Ctrl-C in a terminal: SIGINT to every process of its foreground group
            if trainer.global_rank == 0:
                os.killpg(os.getpgid(0), signal.SIGINT)
            return
        if self.who == "all" and trainer.global_rank == 0:
            os.killpg(os.getpgid(0), signal.SIGTERM)
        if trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if (self.who == "validating" and trainer.global_step == self.step and not trainer.sanity_checking
                and trainer.global_rank == 1 and batch_idx == 0):
            os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_second_sigterm_inside_the_first_ones_handler_logs_nothing_more(caplog):
    """The handler notes the signal and logs once. A second SIGTERM (a scheduler's, then Lightning's forwarded one)
    can land while the first handler is still logging: Python runs the second handler between two bytecodes of the
    first. A check of ``pending`` before the log line logged twice then (the run above, once in CI)."""
    from suite.sigterm import AgreedSigterm

    callback = AgreedSigterm()

    class SecondSignalWhileLogging(logging.Handler):
        def emit(self, record):  # the second signal, arriving while the first handler's line is written
            if not getattr(self, "fired", False):
                self.fired = True
                callback._note(signal.SIGTERM, None)

    handler = SecondSignalWhileLogging()
    logging.getLogger("suite.sigterm").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="suite.sigterm"):
            callback._note(signal.SIGTERM, None)
            callback._note(signal.SIGTERM, None)
    finally:
        logging.getLogger("suite.sigterm").removeHandler(handler)
    assert handler.fired and callback.pending
    assert [r.getMessage().startswith("received SIGTERM: stopping") for r in caplog.records].count(True) == 1


@pytest.mark.parametrize("fails", [False, True])
def test_ctrl_c_is_taken_while_training_only(fails):
    """The Ctrl-C handler is in place while the fit trains and Python's is back once the trainer is done, after a
    fit that ended or failed (installed in on_fit_start, Lightning put it back as the process's "original" handler
    after the fit, and it stayed for the test and after)."""
    import lightning as L

    from suite.sigterm import AgreedSigterm

    seen = []

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            seen.append(signal.getsignal(signal.SIGINT))
            if fails and batch_idx == 1:
                raise RuntimeError("a failure in the fit")
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    stop = AgreedSigterm()
    trainer = L.Trainer(max_epochs=1, callbacks=[stop], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    before = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2))
    except RuntimeError:
        assert fails
    assert seen and all(h == stop._ctrl_c for h in seen)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("who", ["all", "second", "validating", "ctrl_c"])
def test_sigterm_stops_every_process_at_one_batch(env, tmp_path, who):
    """A SIGTERM to some or all processes of a two-process run (twice to one of them) ends all of them at the same
    batch with code 143 and one last.ckpt (suite/sigterm.py). Lightning's own handler, which broadcast from inside
    the signal handler, left such runs hanging in mismatched collectives. Ctrl-C in a terminal (SIGINT to every
    process) does the same with code 130."""
    (tmp_path / "sigterm_at.py").write_text(SIGTERM_AT)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])}
    out = tmp_path / "run"
    args = [*CASES["modelnet"], "trainer.max_epochs=3", *DDP, "logger=none", f"hydra.run.dir={out}",
            "+callbacks.sigterm._target_=sigterm_at.SigtermAt", "+callbacks.sigterm.step=3",
            f"+callbacks.sigterm.who={who}"]
    # A session of its own: the signal to the process group must not reach pytest, and a hung run is killed whole.
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=env["HOME"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the run hung after SIGTERM:\n{stdout[-2000:]}\n{stderr[-2000:]}") from None
    assert proc.returncode == (130 if who == "ctrl_c" else 143), stdout[-2000:] + stderr[-2000:]
    last = out / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 3  # both stopped at the end of the batch (or the validation) that got the signal
    logs = "".join(p.read_text() for p in out.glob("*.log"))
    assert not (out / "metrics.json").exists()
    if who == "ctrl_c":  # each process says it once
        assert logs.count("Ctrl-C: stopping at the end of this batch") == 2
        assert "interrupted by Ctrl-C (SIGINT) at step 3" in stdout + stderr
        return
    assert logs.count("received SIGTERM: stopping with the other processes") == (2 if who == "all" else 1)
    assert "interrupted by SIGTERM at step 3" in stdout + stderr


class _Counted(__import__("lightning").LightningModule):
    """Two scalar weights, one sample a batch; records the batches it trains on."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.tensor(2.0))
        self.batches = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch_idx)
        return (self.a * batch.sum() + self.b) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_a_stop_waits_for_the_end_of_the_accumulation_window(how):
    """A SIGTERM (Ctrl-C) during batch 1 of a window of 3 stops after batch 2, with its optimizer step: a checkpoint
    holds no gradients, and the run stopped after batch 1 (Lightning's handler) and resumed stepped at batch 2 with
    that batch's gradient alone, not the uninterrupted run."""
    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from suite.sigterm import AgreedSigterm

    class Signal(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                signal.raise_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)

    module = _Counted()
    trainer = L.Trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[Signal(), AgreedSigterm()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    with pytest.raises(SIGTERMException):
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(12, 2), batch_size=1))
    assert module.batches == [0, 1, 2] and trainer.global_step == 1


REPEATED = r"""
import json, os, sys
import torch, lightning as L
sys.path.insert(0, os.environ["SUITE_ROOT"])
from datamodules.classification.repeated import RepeatedAugmentation
from datamodules.loaders import ResumableLoader

out = sys.argv[1]

class Indices(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
    def training_step(self, batch, batch_idx):
        with open(os.path.join(out, f"rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(batch.tolist()) + "\n")
        return (self.w * batch.float()).sum()
    def train_dataloader(self):  # made after the processes joined, as the data modules make theirs
        return ResumableLoader(list(range(600)), batch_size=8, sampler=RepeatedAugmentation(list(range(600)), 5, 3))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Indices())
# No interpreter shutdown: a gloo worker thread still dropping the last collective's state as Python finalizes
# aborts the process ("terminate called without an active exception", about 1 run in 20 with torch 2.14).
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
"""


def test_repeated_augmentation_is_not_split_again_under_ddp(env, tmp_path):
    """Two processes: each trains on its own share of timm's repeated-augmentation stream (32 batches of 8). A
    sampler of another kind Lightning would have split among the processes once more (16 batches of a half)."""
    from timm.data.distributed_sampler import RepeatAugSampler

    (tmp_path / "repeated.py").write_text(REPEATED)
    subprocess.run([sys.executable, str(tmp_path / "repeated.py"), str(tmp_path)], cwd=tmp_path, check=True,
                   env={**env, "SUITE_ROOT": str(ROOT)}, capture_output=True, timeout=300)
    for rank in (0, 1):
        served = [i for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines() for i in json.loads(line)]
        timm = RepeatAugSampler(list(range(600)), num_replicas=2, rank=rank, num_repeats=3)
        timm.set_epoch(5)
        assert served == list(timm), rank


FAIL_AT = r"""
import lightning as L
from attention.errors import UserError

class FailAt(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and trainer.global_rank == 1:
            raise UserError("shard-1.h5 is not a ModelNet40 file (bad input that one process alone reads)")
"""


def test_a_user_error_in_another_process_ends_the_run_with_its_code(env, tmp_path):
    """A user error that only the second process meets after the start (a bad file in its share of the data): the
    first process's next collective failed ("Connection closed by peer") and it ended with that traceback and exit
    code 1 (with NCCL it would wait until Lightning's observer SIGKILLed it: 137). Now the run ends with the
    failing process's message, one line naming it, and its exit code 2."""
    (tmp_path / "fail_at.py").write_text(FAIL_AT)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])}
    args = [*CASES["modelnet"], "trainer.max_epochs=3", *DDP, "logger=none", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.fail._target_=fail_at.FailAt"]
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=env["HOME"], env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=300, start_new_session=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "error: shard-1.h5 is not a ModelNet40 file" in output
    assert "error: process 1 of the run (rank 1) ended with exit code 2" in output
    assert "Traceback" not in output and "Connection closed" not in output, output[-3000:]
