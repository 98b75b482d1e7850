"""Run directories (suite/run_dirs.py): no run overwrites another run's results, runs that train nothing are refused,
and a normal run prints each line once without a warning. (A resumed run's whole history: tests/test_resume.py.)"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixture_cache import once_per_worker, user_error_in_process
from suite.report import read_folders
from test_run import ROOT, TINY, env, run, user_error  # noqa: F401 - env is a fixture
import warm_python

# Two epochs of 10 steps, logged to W&B (offline) with the CSV history beside it.
ARGS = [*TINY, "trainer.max_epochs=2", "logger=wandb"]
# What a run leaves that no later run in its directory may change.
KEPT = ("metrics.json", "resolved_config.yaml", "csv/metrics.csv", ".hydra/config.yaml", ".hydra/overrides.yaml",
        "checkpoints/last.ckpt")


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
    """(run directory, its run.py process) of one training run, made once per worker; copy it before changing it."""
    return once_per_worker(tmp_path_factory, "run-dirs-trained", lambda out: run([*ARGS, f"hydra.run.dir={out}"], env))


def copy_run(trained, tmp_path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(trained[0], folder)
    return folder


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in KEPT}


def test_a_normal_run_prints_each_line_once_and_no_directory_warning(trained):
    """A fresh W&B run writes its W&B id beside the checkpoints first: Lightning's "Checkpoint directory ... exists
    and is not empty" warning printed on every such run, and Lightning's own console handler printed each of its
    INFO lines a second time (as `INFO: ...` on stderr)."""
    out = trained[1].stdout + trained[1].stderr
    assert "exists and is not empty" not in out
    for line in ("Seed set to 42", "`Trainer.fit` stopped: `max_epochs=2` reached.", "GPU available: False"):
        assert out.count(line) == 1, (line, out[-3000:])


def test_a_test_of_a_training_run_writes_its_own_record(trained, env, tmp_path):
    """`mode=test ckpt_path=last hydra.run.dir=<a training run>` (the documented way to test a run's last
    checkpoint) writes test-<time>/ in it and changes none of the training run's files; mode=report still reads
    the training run, once."""
    folder = copy_run(trained, tmp_path)
    before = digests(folder)
    training = json.loads((folder / "metrics.json").read_text())
    proc = run([*TINY, "logger=csv", "mode=test", "ckpt_path=last", f"hydra.run.dir={folder}"], env)
    assert digests(folder) == before
    (record,) = folder.glob("test-*")
    tested = json.loads((record / "metrics.json").read_text())
    assert tested["protocol"]["checkpoint"] == "last" and 0.0 <= tested["test/oa"] <= 1.0
    assert (record / "resolved_config.yaml").is_file() and (record / ".hydra" / "overrides.yaml").is_file()
    assert "mode=test" in (record / ".hydra" / "overrides.yaml").read_text()
    assert f"metrics written to {record / 'metrics.json'}" in proc.stdout
    runs, left_out, _ = read_folders([folder])
    assert [r.path for r in runs] == [str(folder)] and not left_out
    assert runs[0].metrics["test/oa"] == training["test/oa"] and runs[0].config["mode"] == "train"



def test_summary_and_report_runs_in_a_training_runs_folder_leave_it_as_it_was(trained, env, tmp_path):
    """`mode=summary` or `mode=report` with `hydra.run.dir=<a training run>` (a job script that sets one folder for
    every command) wrote their .hydra/ over the run's, and summary its resolved_config.yaml (`mode: summary`):
    mode=report then skipped the finished run as a summary's folder. They now write <mode>-<time>/ in it."""
    folder = copy_run(trained, tmp_path)
    before = digests(folder)
    run([*TINY, "mode=summary", "logger=none", f"hydra.run.dir={folder}"], env)
    run(["mode=report", f"report.runs={folder}", f"report.out={tmp_path / 'report'}", "logger=none",
         f"hydra.run.dir={folder}"], env)
    assert digests(folder) == before
    for mode in ("summary", "report"):
        (record,) = folder.glob(f"{mode}-*")
        assert f"mode={mode}" in (record / ".hydra" / "overrides.yaml").read_text()
    runs, left_out, skipped = read_folders([folder])
    assert [r.path for r in runs] == [str(folder)] and not left_out and skipped == 0

def test_a_fresh_run_refuses_a_directory_holding_a_run(trained, env, tmp_path):
    folder = copy_run(trained, tmp_path)
    before = digests(folder)
    user_error([*ARGS, f"hydra.run.dir={folder}"], env, f"hydra.run.dir={folder} holds another run's results",
               "checkpoints/last.ckpt", "resume=true", "overwrite=true")
    assert digests(folder) == before  # Hydra's .hydra/ files too: refused before Hydra writes them
    # Told to: the old run's checkpoints and results are gone, none of them left beside the new ones.
    old_best = {p.name for p in (folder / "checkpoints").glob("best-*.ckpt")}
    (folder / "test-2026-01-01_00-00-00").mkdir()  # a test of the old run's checkpoint (its record)
    (folder / "test-2026-01-01_00-00-00" / "metrics.json").write_text("{}")
    (folder / "metrics-step10.json").write_text("{}")  # the record of an earlier end, set aside when it trained on
    (folder / "wandb" / "offline-run-20260101_000000-oldrunid").mkdir(parents=True)  # its W&B run, for wandb sync
    run([*TINY, "logger=none", "++trainer.limit_train_batches=3", "overwrite=true", f"hydra.run.dir={folder}"], env)
    assert not list(folder.glob("test-*")) and not list(folder.glob("metrics-step*"))  # none of the old run's left
    assert {p.name for p in (folder / "checkpoints").glob("*.ckpt")} == {"best-epoch000-step000003.ckpt", "last.ckpt"}
    assert old_best and not old_best & {"best-epoch000-step000003.ckpt"}
    assert not (folder / "csv").exists() and not (folder / "wandb").exists()  # the old history (this run logs nothing)
    assert json.loads((folder / "metrics.json").read_text())["protocol"]["checkpoint"].startswith("best")


def test_a_run_that_trains_nothing_is_refused(env, tmp_path, capsys):
    user_error_in_process([*TINY, "trainer.max_epochs=0", "logger=none", f"hydra.run.dir={tmp_path / 'a'}"], capsys,
                          env["HOME"], tmp_path / "a", "trainer.max_epochs=0 trains nothing", "mode=test")
    # No training batch at all: refused after fit instead of testing the untrained network as "last".
    # in a process of its own: this refusal comes after a fit, whose state must not stay in the test process
    user_error([*TINY, "++trainer.limit_train_batches=0", "logger=none", f"hydra.run.dir={tmp_path / 'b'}"], env,
               "took no training step", "no checkpoint was written")
    assert not (tmp_path / "b" / "metrics.json").exists() and not (tmp_path / "b" / "checkpoints").exists()


# run.py with its start time fixed (tests/test_run_dirs.py: every run "starts within the same second"): the run
# directory's stamp, and the clock of Hydra's ${now:} (a sweep's directory).
FROZEN = ("import datetime, runpy, sys; import hydra.core.utils as h; import suite.run_dirs as r; "
          "r.run_stamp = lambda: '2026-01-01_00-00-00'; "
          "h.datetime = type('Frozen', (datetime.datetime,), "
          "{{'now': classmethod(lambda cls, tz=None: datetime.datetime(2026, 1, 1))}}); "
          "sys.argv = [{run!r}, *sys.argv[1:]]; runpy.run_path({run!r}, run_name='__main__')")


def seed(folder: Path) -> str:
    """The seed= override of the run in ``folder``, from its .hydra/overrides.yaml."""
    return (folder / ".hydra" / "overrides.yaml").read_text().split("seed=")[1].split()[0]


def test_runs_and_sweeps_started_together_get_a_directory_each(env, tmp_path):
    """Runs started within the same second with the same task and attention (W&B agents started together, a shell
    loop of `run.py ... &`) were given one directory, outputs/<task>/<attn>/<time>, and wrote their checkpoints
    and metrics over each other's; two sweeps started together shared multirun/<time> and its job folders. Each
    now claims its own (`<time>`, `<time>-1`, ...) with one mkdir. Here three runs and two sweeps start at once,
    with their start time fixed."""
    code = FROZEN.format(run=str(ROOT / "run.py"))
    home = tmp_path  # the working directory of every run: outputs/ and sweeps/ are made here
    common = ["task=modelnet", "mode=summary", "data=shapes"]
    # (forked from a warm interpreter: five cold starts' imports took most of this test's 40-50 s on 2 cores)
    procs = [warm_python.popen([sys.executable, "-c", code, *common, f"seed={seed}"], cwd=home, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for seed in range(3)]
    procs += [warm_python.popen([sys.executable, "-c", code, "-m", *common, "attn=self,external", f"seed={seed}"],
                                cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
              for seed in (10, 11)]
    for proc in procs:
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, out[-3000:]
    runs = home / "outputs" / "modelnet" / "offset"
    names = sorted(p.name for p in runs.iterdir())
    assert names == ["2026-01-01_00-00-00", "2026-01-01_00-00-00-1", "2026-01-01_00-00-00-2"]
    assert sorted(seed(runs / name) for name in names) == ["0", "1", "2"]  # each its own record, none another's
    for name in names:  # and its own log only
        assert (runs / name / "run.log").read_text().count("Seed set to") == 1
    sweeps = sorted(p.name for p in (home / "multirun").iterdir())
    assert sweeps == ["2026-01-01_00-00-00", "2026-01-01_00-00-00-1"]
    for job in ("0_modelnet_self", "1_modelnet_external"):
        assert sorted(seed(home / "multirun" / s / job) for s in sweeps) == ["10", "11"]
    # A folder named on the command line is used as given, a pattern too: the way to finish a sweep with resume=true.
    named = warm_python.run([sys.executable, "-c", code, "-m", *common, "attn=self", "seed=12",
                             "hydra.sweep.dir=multirun/${now:%Y-%m-%d_%H-%M-%S}"], cwd=home, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert named.returncode == 0, named.stderr[-3000:]
    assert sorted(p.name for p in (home / "multirun").iterdir()) == sweeps
    # (its job, a summary, writes its record into summary-<time>/ in the job folder that holds an earlier summary)
    (record,) = (home / "multirun" / sweeps[0] / "0_modelnet_self").glob("summary-*")
    assert seed(record) == "12"


def test_tests_of_one_run_started_together_get_a_record_each(tmp_path, monkeypatch):
    """Two tests of one training run's checkpoint started within the same second (eval options tried side by
    side) were both given test-<time>/: the name was only checked, and made later, by Hydra. Each process now
    claims its own with one mkdir. (Each process decides once; two processes are two fresh decisions here.)"""
    import datetime

    import suite.run_dirs as run_dirs

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 1, 1)

    monkeypatch.setattr(run_dirs, "datetime", Frozen)
    (tmp_path / "metrics.json").write_text("{}")  # a finished training run
    records = []
    for _process in range(2):
        monkeypatch.setattr(run_dirs, "_RECORDS", {})
        records.append(run_dirs.record_dir(tmp_path, "test"))
    assert [r.name for r in records] == ["test-2026-01-01_00-00-00", "test-2026-01-01_00-00-00-1"]
    assert all(r.is_dir() for r in records)


def test_a_run_is_not_continued_under_another_seed(trained, env, tmp_path):
    """A job script looping over seeds with one hydra.run.dir and resume=true continued the first seed's run for
    every other seed, and recorded that network under their seeds. Refused, before anything is written; the
    seed it was started with continues it."""
    folder = copy_run(trained, tmp_path)
    before = digests(folder)
    err = user_error([*ARGS, "seed=7", "resume=true", f"hydra.run.dir={folder}"], env,
                     f"hydra.run.dir={folder} holds a run started with seed=42 (this command: seed=7)",
                     "overwrite=true")
    assert "Traceback" not in err
    assert digests(folder) == before
    again = run([*ARGS, "seed=42", "resume=true", f"hydra.run.dir={folder}"], env)
    assert "this run had finished already" in again.stdout + again.stderr
    # Its metrics.json is kept, and so is what says what it ran (.hydra/overrides.yaml had this command's).
    assert digests(folder) == before


def test_a_run_is_not_continued_under_another_data_seed(tmp_path):
    """data.seed draws the generated data set and the held-out split: resumed with data.seed=7 (the top-level seed
    the same), a run went on training on other samples and validating on others."""
    from omegaconf import OmegaConf

    from attention.errors import UserError
    from suite import run_dirs

    started = OmegaConf.create({"seed": 42, "data": {"_target_": "datamodules.points.shapes.Shapes", "seed": 42}})
    (tmp_path / "resolved_config.yaml").write_text(OmegaConf.to_yaml(started))
    again = OmegaConf.create({"seed": 42, "data": {"_target_": "datamodules.points.shapes.Shapes", "seed": "${seed}"}})
    run_dirs.check_same_run(tmp_path, run_dirs.identity_of(again))  # data.seed: ${seed}, resolved to 42
    again.data.seed = 7
    with pytest.raises(UserError, match=r"started with data\.seed=42 \(this command: data\.seed=7\)"):
        run_dirs.check_same_run(tmp_path, run_dirs.identity_of(again))


def test_a_finished_run_resumed_shorter_is_refused_and_keeps_its_record(trained, env, tmp_path):
    """A finished 2-epoch run resumed with trainer.max_epochs=1 (a sweep resumed with its values in another order)
    trained nothing, kept its metrics.json and rewrote resolved_config.yaml and .hydra/ to say max_epochs=1: its
    2-epoch result was reported as a 1-epoch run's. Refused, and its record left as it was."""
    folder = copy_run(trained, tmp_path)
    before = digests(folder)
    user_error([*ARGS, "trainer.max_epochs=1", "resume=true", f"hydra.run.dir={folder}"], env,
               f"ckpt_path={folder / 'checkpoints' / 'last.ckpt'} has trained 2 epochs, past trainer.max_epochs=1",
               "mode=test")
    assert digests(folder) == before
    assert "max_epochs: 2" in (folder / "resolved_config.yaml").read_text()


def test_a_refused_sweep_job_keeps_the_record_of_the_run_in_its_folder(trained, env, tmp_path):
    """The same sweep run again into its folder (another value changed): each job is refused, but Hydra had written
    the job's .hydra/ files over the finished run's first (its config.yaml then said what the refused command
    asked). They are put back."""
    sweep = tmp_path / "sweep"
    shutil.copytree(trained[0], sweep / "0_modelnet_external")
    before = digests(sweep / "0_modelnet_external")
    proc = run(["-m", *ARGS, "optim.optimizer.lr=0.5", f"hydra.sweep.dir={sweep}"], env, check=False)
    assert proc.returncode == 2 and "holds another run's results" in proc.stderr, proc.stderr[-2000:]
    assert digests(sweep / "0_modelnet_external") == before


def test_a_directory_is_not_used_by_two_training_runs_at_once(env, tmp_path, capsys):
    """A job submitted twice with one hydra.run.dir and resume=true, or overwrite=true on a run still training: two
    processes wrote their checkpoints and metrics.json over each other's, or deleted the running one's. While a run
    trains, its directory is refused to another; once it has ended (even killed), it is free."""
    import signal
    import time

    folder = tmp_path / "run"
    first = warm_python.popen([sys.executable, str(ROOT / "run.py"), *TINY, "trainer.max_epochs=50", "logger=none",
                               f"hydra.run.dir={folder}"], cwd=env["HOME"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        last, deadline = folder / "checkpoints" / "last.ckpt", time.monotonic() + 300
        while not last.is_file():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.1)
        for option in ("resume=true", "overwrite=true"):  # refused in this process: another one than the first
            user_error_in_process([*TINY, "logger=none", option, f"hydra.run.dir={folder}"], capsys, env["HOME"],
                                  folder, f"hydra.run.dir={folder} is in use: another run is training there now")
        assert first.poll() is None and last.is_file()  # untouched: not deleted by overwrite=true
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    import torch

    epoch = torch.load(last, map_location="cpu", weights_only=True)["epoch"]  # how far it got before the kill
    resumed = run([*TINY, "logger=none", "resume=true", f"trainer.max_epochs={epoch + 2}",
                   f"hydra.run.dir={folder}"], env)
    assert f"resuming from {last}" in resumed.stdout + resumed.stderr


def test_a_sweep_into_an_earlier_sweeps_folder_keeps_its_record(env, tmp_path):
    """A sweep given the folder of an earlier one (`hydra.sweep.dir=`, to resume it or to add runs beside its runs)
    had Hydra write its multirun.yaml over the earlier sweep's, its record of what it ran. That one is kept as
    multirun-<its time>.yaml."""
    sweep = tmp_path / "sweep"
    common = ["-m", "task=modelnet", "mode=summary", "data=shapes", f"hydra.sweep.dir={sweep}"]
    run([*common, "attn=self"], env)
    first = (sweep / "multirun.yaml").read_text()
    run([*common, "attn=external,offset"], env)
    (kept,) = sweep.glob("multirun-*.yaml")
    assert kept.read_text() == first and "attn=self" in first
    assert "attn=external,offset" in (sweep / "multirun.yaml").read_text()
    run([*common, "attn=self"], env)
    assert len(list(sweep.glob("multirun-*.yaml"))) == 2  # a second one, whatever the clock says
