"""A scripted run of bad inputs (issue 29): each ends in one clear ``error:`` paragraph naming the option and a fix,
exit code 2, no traceback.

One case of each kind runs as a real ``python run.py`` subprocess (:func:`refused`); the others go through the same
steps in this process (:func:`refused_in_process`: run.py's checks of the command line, Hydra's composition, the
run, and run.py's way of ending a user error), since a process start costs seconds and adds nothing to them."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from attention.errors import UserError
from fixture_cache import user_error_in_process

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A scratch working folder (Hydra's default run directories land there) and environment without W&B."""
    folder = tmp_path_factory.mktemp("bad-inputs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "LOCAL_RANK", "NODE_RANK", "SLURM_"))}
    env.update(HOME=str(folder), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return folder, env


def refused(home, args: list[str], *needles: str) -> str:
    """Run ``run.py args``: exit code 2, one ``error:`` paragraph (stderr's last line, the only one), no traceback,
    every needle in it. Returns the message."""
    folder, env = home
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "logger=none", *args], cwd=folder, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert proc.stderr.count("error:") == 1 and lines[-1].startswith("error: "), proc.stderr[-3000:]
    message = lines[-1]
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def refused_in_process(args: list[str], capsys, out_dir: Path, *needles: str) -> str:
    """What ``run.py args`` does, in this process (``fixture_cache.user_error_in_process``: the same checks,
    composition, run and ending as in run.py), ending in one ``error:`` paragraph on stderr. Returns the message."""
    err = user_error_in_process(["logger=none", *args], capsys, os.getcwd(), out_dir)
    lines = err.strip().splitlines()
    assert len([line for line in lines if "error:" in line]) == 1 and lines[-1].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


# --- values and combinations refused at start-up ----------------------------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["seed=abc"], ["seed='abc'", "whole number", "`python run.py seed=0`"]),
    (["seed=-1"], ["seed=-1", "from 0 to 4294967295"]),
    (["task=modelnet", "data=ade20k"], ["task.input_points", "${data.npoints}", "data config chosen (ade20k)",
                                        "`python run.py task=modelnet data=modelnet40`"]),
    (["experiment=demo", "data=ade20k"], ["data.npoints is not an option of data=ade20k", "~data.npoints"]),
    (["experiment=demo", "model.neighbours=0"], ["model.neighbours=0", "an integer >= 1",
                                                 "`python run.py model.neighbours=32`"]),
    (["+trainer.limit_train_batches=1.5"], ["trainer.limit_train_batches=1.5",
                                            "`python run.py ++trainer.limit_train_batches=0.25`"]),
], ids=["seed-abc", "seed-negative", "data-of-another-task", "data-option-of-another-data-set", "neighbours-0",
        "added-trainer-argument-out-of-range"])
def test_bad_values_are_refused_at_start_up(args, needles, capsys, tmp_path):
    refused_in_process(args, capsys, tmp_path, *needles)


# task=gan's options: each failed with a traceback (a ZeroDivisionError, Hydra's "Error in call to target"), at the
# first validation up to metrics.every_n_steps steps in and before any last.ckpt, after training (eval.save_samples
# on a file), or not at all (a KID of 0.0 from kid_degree=0). The data folder is absent: refused before it is read.
GAN_BAD = [
    (["metrics.every_n_steps=0"], ["metrics.every_n_steps=0", "an integer >= 1"]),
    (["task.grid_per_class=0"], ["task.grid_per_class=0", "an integer >= 1"]),
    (["metrics.cache_dir=/proc/nope"], ["metrics.cache_dir=/proc/nope", "cannot be written"]),
    (["metrics.isc_splits=abc"], ["metrics.isc_splits='abc'", "an integer >= 1"]),
    (["metrics.isc_splits=0"], ["metrics.isc_splits=0", "an integer >= 1"]),
    (["metrics.num_samples=8", "metrics.isc_splits=20"], ["metrics.isc_splits=20", "metrics.num_samples=8"]),
    (["metrics.kid_subsets=abc"], ["metrics.kid_subsets='abc'", "an integer >= 1"]),
    (["metrics.kid_gamma=abc"], ["metrics.kid_gamma='abc'", "a number > 0 or null"]),
    (["metrics.kid_degree=0"], ["metrics.kid_degree=0", "an integer >= 1"]),
    (["metrics.reference_samples=abc"], ["metrics.reference_samples='abc'", "an integer >= 2 or null"]),
    (["metrics.reference_samples=0"], ["metrics.reference_samples=0", "an integer >= 2 or null"]),
    (["metrics.reference_samples=1"], ["metrics.reference_samples=1", "an integer >= 2 or null"]),
    (["metrics.num_samples=1"], ["metrics.num_samples=1 is too few images for FID"]),
    (["data.val_samples=1"], ["data.val_samples=1 is too few images for FID"]),
    (["eval.num_samples=1"], ["eval.num_samples=1 is too few images for FID"]),
    (["ema.enabled=true", "ema.start=abc"], ["ema.start='abc'", "an integer >= 0"]),
    (["ema.enabled=true", "ema.decay=abc"], ["ema.decay='abc'", "a number >= 0 and < 1"]),
    (["data.batches_per_step=3"], ["data.batches_per_step=3 differs from task.d_steps=5"]),
    (["task.d_steps=2", "data.batches_per_step=1"], ["data.batches_per_step=1 differs from task.d_steps=2"]),
]


@pytest.mark.parametrize("args, needles", GAN_BAD, ids=[" ".join(args) for args, _ in GAN_BAD])
def test_gan_bad_values_are_refused_at_start_up(args, needles, capsys, tmp_path):
    refused_in_process(["task=gan", "data=image_folder", f"data.root={tmp_path / 'absent'}", *args], capsys,
                       tmp_path / "run", *needles)


def test_gan_samples_folder_on_a_file_is_refused_at_start_up(capsys, tmp_path):
    """eval.save_samples on a file failed with FileExistsError when the test wrote its first image, after
    training."""
    (tmp_path / "file").write_text("")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        refused_in_process(["task=gan", "data=image_folder", f"data.root={tmp_path / 'absent'}",
                            f"eval.save_samples={folder}"], capsys, tmp_path / "run", f"eval.save_samples={folder}",
                           f"{tmp_path / 'file'} is a file, not a folder")


def test_bad_value_through_run_py(home):
    refused(home, ["seed=abc"], "seed='abc'", "`python run.py seed=0`")


# --- overrides Hydra refuses: a fix that works, not "+key=" -----------------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["trainer.max_epoch=3"], ["trainer.max_epoch is not an option", "Did you mean trainer.max_epochs?",
                               "`python run.py trainer.max_epochs=3`"]),
    (["attn.head=4"], ["attn.head is not an option", "Did you mean attn.heads?", "`python run.py attn.heads=4`"]),
    (["trainr.max_epochs=3"], ["Did you mean trainer.max_epochs?"]),
    (["trainer.limit_train_batches=0.1"], ["trainer.limit_train_batches is not an option",
                                           "`python run.py ++trainer.limit_train_batches=0.1`"]),
    (["+trainer.max_epochs=3"], ["+trainer.max_epochs=3", "`trainer.max_epochs=3`", "`++trainer.max_epochs=3`"]),
    (["-m", "attn=self,offset", "attn.head=4"], ["attn.head is not an option", "attn.heads"]),
    (["data.root=[a"], ["'data.root=[a'", "key=value"]),
    # a dict value: Hydra names only the key it sets, which exists ("bench has no key 'limits'" was said)
    (["mode=bench", "bench.limits={matmull:256,repeats:3}"],
     ["bench.limits.matmull is not an option: bench.limits has no key 'matmull'", "Did you mean bench.limits.matmul?",
      "`python run.py bench.limits.matmul=256`"]),
    (["mode=bench", "bench={limits:{bogus:{a:1}}}"], ["bench.limits.bogus is not an option", "matmul, copy_mb"]),
], ids=["trainer-typo", "attn-typo", "group-typo", "unlisted-trainer-argument", "plus-on-existing-key",
        "typo-in-a-sweep", "unparsable", "typo-inside-a-dict", "nested-dict"])
def test_key_typos_say_which_keys_exist(args, needles, capsys, tmp_path):
    message = refused_in_process(args, capsys, tmp_path, *needles)
    assert "+key" not in message and "To append to your config" not in message


def test_every_mistyped_key_is_named_at_once(capsys, tmp_path):
    """Hydra names the first key the config lacks; the message names each (a fix for the typos), and lists a
    section's keys once however many of its keys were mistyped."""
    message = refused_in_process(["experiment=demo", "data.num_train=64", "trainer.max_epoch=1", "data.num_val=8"],
                                 capsys, tmp_path, "data.num_train is not an option: data has no key 'num_train'",
                                 "data.num_val is not an option: data has no key 'num_val'",
                                 "Did you mean trainer.max_epochs?", "`python run.py trainer.max_epochs=1`",
                                 "The keys of trainer: ", "train_per_class")
    assert message.count("The keys of data: ") == 1 and "another override fails" not in message
    # a typo beside an override that fails otherwise (a group option that does not exist): Hydra's turn to say it
    refused_in_process(["data.num_train=64", "attn=nope"], capsys, tmp_path, "unknown attn 'nope'")


def test_key_typo_through_run_py(home):
    refused(home, ["trainer.max_epoch=3"], "Did you mean trainer.max_epochs?")


def test_the_override_the_messages_suggest_works(capsys):
    """``++trainer.limit_train_batches=0.1``, what the messages and docs/running.md suggest, passes run.py's checks
    and composes, setting the Trainer argument."""
    from hydra import compose, initialize_config_dir

    from suite.cli import check_overrides

    args = ["experiment=demo", "++trainer.limit_train_batches=0.1", "++trainer.max_epochs=3"]
    check_overrides(args)  # no SystemExit
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    assert cfg.trainer.limit_train_batches == 0.1 and cfg.trainer.max_epochs == 3
    assert capsys.readouterr().err == ""


# --- where the run writes ---------------------------------------------------------------------------------------------
def test_run_directory_under_a_file_is_refused(home, tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    refused(home, [f"hydra.run.dir={tmp_path / 'a-file' / 'run'}"], f"hydra.run.dir={tmp_path / 'a-file' / 'run'}",
            f"{tmp_path / 'a-file'} is a file, not a folder", "Nothing was run")
    refused_in_process(["-m", f"hydra.sweep.dir={tmp_path / 'a-file'}"], capsys, tmp_path, "hydra.sweep.dir=",
                       "is a file")


def test_unwritable_run_directory_is_refused(tmp_path, capsys):
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        read_only.chmod(0o555)
    else:  # root writes through permission bits: /proc/1 refuses even root
        read_only = Path("/proc/1")
    refused_in_process([f"hydra.run.dir={read_only / 'run'}"], capsys, tmp_path, f"{read_only} is not writable",
                       "hydra.run.dir=")


def test_full_disk_names_the_file_and_loses_nothing(tmp_path, monkeypatch):
    """ENOSPC while a checkpoint is written: a UserError (run.py: `error:`, exit 2) naming the checkpoint, and the
    checkpoint written before is intact (the write goes to a temporary file)."""
    import torch

    import suite.checkpoint_io as checkpoint_io
    from suite.errors import as_user_error

    target = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint_io.atomic_torch_save({"step": 1}, target)
    real_open = open

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk(path, mode="r", *args, **kwargs):
        return FullDisk(str(path), "wb") if "w" in mode else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io, "open", full_disk, raising=False)
    with pytest.raises(OSError) as raised:
        checkpoint_io.atomic_torch_save({"step": 2, "weights": torch.zeros(1 << 18)}, target)
    assert raised.value.errno == errno.ENOSPC
    message = str(as_user_error(raised.value))
    assert f"while writing {target}." in message and "disk is full" in message and "resume=true" in message
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # no temporary file left


# --- data ------------------------------------------------------------------------------------------------------------
class _RaisesInWorker:
    """A data set whose sample 1 raises ``error`` (in a DataLoader worker)."""

    def __init__(self, error: Exception):
        self.error = error

    def __len__(self):
        return 2

    def __getitem__(self, index):
        if index == 1:
            raise self.error
        return index


def test_a_user_error_in_a_loader_worker_keeps_its_one_paragraph(capsys):
    """torch re-raises a worker's exception with "Caught UserError in DataLoader worker process 0. Original
    Traceback ..." and the worker's stack as its message: run.py printed those 20 lines before the message. A
    DataError (two arguments: torch makes it a RuntimeError) the same; a bug in a worker keeps its traceback."""
    import torch

    from datamodules.base import DataError
    from suite.cli import exit_with_message
    from suite.errors import as_user_error

    said = "/data/x.png has label value(s) 30; expected 0..20 or 255. Replace it, or set data.on_bad_file=skip."
    def raised_by_a_worker(error: Exception) -> Exception:
        batches = iter(torch.utils.data.DataLoader(_RaisesInWorker(error), batch_size=1, num_workers=2))
        try:
            list(batches)
        except Exception as err:  # noqa: BLE001 - what run.py meets
            return err.with_traceback(None)  # its frames hold the loader: its workers end now, not at teardown
        raise AssertionError("the worker raised nothing")

    for error in (UserError(said), DataError(said, "/data/x.png: label 30")):
        raised = raised_by_a_worker(error)
        assert "Original Traceback" in str(raised)  # torch's wrapping, as run.py meets it
        with pytest.raises(SystemExit):
            exit_with_message(str(as_user_error(raised)))
        assert capsys.readouterr().err == f"error: {said}\n"
    assert as_user_error(raised_by_a_worker(ValueError("a bug"))) is None


def test_download_is_attempted_by_the_run(home, tmp_path):
    """data.download=true reaches the download on the run's path (it did nothing for ModelNet40 before): an
    unreachable URL is reported, naming it."""
    url = "http://127.0.0.1:1/modelnet40_ply_hdf5_2048.zip"  # nothing listens on port 1
    refused(home, ["experiment=demo", "data=modelnet40", f"data.root={tmp_path / 'data'}", "data.download=true",
                   f"data.url={url}"], f"Could not download {url}", "data.root=")


def test_release_missing_a_listed_shard_is_refused(tmp_path, capsys):
    folder = tmp_path / "modelnet40_ply_hdf5_2048"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("ply_data_train0.h5", "ply_data_test0.h5"):
        with h5py.File(folder / name, "w") as f:
            f["data"] = rng.uniform(-1, 1, (4, 256, 3)).astype(np.float32)
            f["label"] = rng.integers(0, 40, (4, 1)).astype(np.uint8)
    (folder / "train_files.txt").write_text("data/modelnet40_ply_hdf5_2048/ply_data_train0.h5\n"
                                            "data/modelnet40_ply_hdf5_2048/ply_data_train1.h5\n")
    refused_in_process(["experiment=demo", "data=modelnet40", f"data.root={tmp_path}"], capsys, tmp_path / "run",
                       "ply_data_train1.h5 listed in train_files.txt is missing", "modelnet40_ply_hdf5_2048.zip")


def test_weights_message_names_the_networks_own_release(tmp_path, capsys):
    garbage = tmp_path / "weights.pth"
    garbage.write_bytes(b"not a checkpoint" * 8)
    message = refused_in_process(["task=classification", "model=dilateformer_t", f"model.weights={garbage}"],
                                 capsys, tmp_path / "run", f"model.weights={garbage}",
                                 "DilateFormer's ImageNet-1K checkpoints")
    assert "PCT_Pytorch" not in message
    refused_in_process(["experiment=demo", f"model.weights={garbage}"], capsys, tmp_path / "run",
                       "PCT_Pytorch's model.t7")
    refused_in_process(["task=gan", f"model.d_weights={garbage}"], capsys, tmp_path / "run",
                       "StudioGAN's discriminator checkpoints")


# --- reports ----------------------------------------------------------------------------------------------------------
def fake_run(folder: Path, metrics: str) -> Path:
    """A run folder as run.py writes it, with ``metrics`` as its metrics.json."""
    folder.mkdir(parents=True)
    config = {"mode": "train", "seed": 0, "task": {"name": "modelnet"}, "attn": {"name": "offset"},
              "data": {"_target_": "datamodules.points.shapes.Shapes"}, "monitor": {"metric": "val/oa", "mode": "max"}}
    (folder / "resolved_config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.json").write_text(metrics)
    return folder


def test_report_confidence_outside_zero_one(home, tmp_path):
    fake_run(tmp_path / "runs" / "a", json.dumps({"test/oa": 0.5}))
    refused(home, ["mode=report", f"report.runs={tmp_path / 'runs'}", "report.confidence=2"],
            "report.confidence=2", "strictly between 0 and 1", "report.confidence=0.95")


def test_report_whose_runs_hold_no_metric_lists_them(tmp_path, capsys):
    runs = [fake_run(tmp_path / "runs" / name, text) for name, text in
            (("words", json.dumps({"test/oa": "high"})), ("empty", "{}"), ("percent", json.dumps({"test/oa": 75.0})))]
    message = refused_in_process(["mode=report", f"report.runs={tmp_path / 'runs'}"], capsys, tmp_path / "run",
                                 "test/oa")
    assert "Metrics they have: none" not in message
    for run in runs:
        assert str(run) in message, run
    assert "test/oa=75 outside [0, 1]" in message
