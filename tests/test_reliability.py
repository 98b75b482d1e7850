"""Fault injection through run.py: NaN batches, W&B failing mid-run, a kill during a checkpoint write, checkpoints
that would run code, credentials in the environment, impossible configurations. Each fault is injected by a small
launcher that patches one thing and then runs run.py as `python run.py ...` would."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from attention.errors import UserError
from suite.checkpoint_io import SafeCheckpointIO, atomic_torch_save, safe_torch_load
from suite.run_record import quality_metrics
from suite.secrets import redact, redact_file, redact_override
from suite.validate import validate_config
from test_run import TINY, env, run, user_error  # noqa: F401 - env is a fixture
import warm_python

ROOT = Path(__file__).resolve().parents[1]
TWO_EPOCHS = [*TINY, "trainer.max_epochs=2"]  # 40 training clouds in batches of 4: 10 steps an epoch

# `python -c LAUNCHER <run.py> <patch> <args...>`: exec the patch, then run run.py as __main__.
LAUNCHER = r"""
import os, runpy, sys
run_py, patch = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(run_py))
exec(patch)
sys.argv = [run_py, *sys.argv[3:]]
runpy.run_path(run_py, run_name="__main__")
"""

# NaN in the points of the batch at global step 12 (the third batch of the second epoch).
NAN_AT_STEP_12 = r"""
import torch
from tasks.modelnet import PointCloudClassification
step = PointCloudClassification.training_step
def training_step(self, batch, batch_idx):
    if self.global_step == 12:
        batch["points"] = batch["points"].clone()
        batch["points"][0, 0, 0] = float("nan")
    return step(self, batch, batch_idx)
PointCloudClassification.training_step = training_step
"""

# Memory runs out at global step 12: the machine's (torch's CPU allocator refuses 128 TiB) or a GPU's (torch's
# CUDA out-of-memory error, as a GPU raises it).
OUT_OF_MEMORY_AT_STEP_12 = r"""
import torch
from tasks.modelnet import PointCloudClassification
step = PointCloudClassification.training_step
def training_step(self, batch, batch_idx):
    if self.global_step == 12:
        if os.environ["OUT_OF"] == "gpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.23 GiB is free.")
        torch.empty(2**45)
    return step(self, batch, batch_idx)
PointCloudClassification.training_step = training_step
"""

# At global step 12 every child process (the data-loading workers: data.num_workers=1, no W&B) is killed with
# SIGKILL, or SIGBUS, from outside, as the kernel's out-of-memory killer kills a worker.
KILL_WORKERS_AT_STEP_12 = r"""
import glob, signal
from tasks.modelnet import PointCloudClassification
step = PointCloudClassification.training_step
def training_step(self, batch, batch_idx):
    if self.global_step == 12:
        for children in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            for pid in open(children).read().split():
                os.kill(int(pid), getattr(signal, os.environ["KILL_WITH"]))
    return step(self, batch, batch_idx)
PointCloudClassification.training_step = training_step
"""

# wandb's Run.log raises from its fourth call on, as when its service process is gone.
WANDB_GONE = r"""
import wandb.sdk.wandb_run as wr
log = wr.Run.log
calls = [0]
def failing_log(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] > 3:
        raise ConnectionResetError("[Errno 104] Connection reset by peer (wandb service)")
    return log(self, *args, **kwargs)
wr.Run.log = failing_log
"""

# The second write of last.ckpt hangs after its bytes are in the temporary file and before the rename: the test
# kills the process there (os.fsync is the last step before os.replace).
HANG_IN_SECOND_LAST_CKPT = r"""
import os, time
import suite.checkpoint_io as cio
fsync, seen = os.fsync, []
def hanging_fsync(fd):
    name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
    if ".last.ckpt.tmp-" in name:
        seen.append(name)
        if len(seen) == 2:
            open(os.environ["MARKER"], "w").write(name)
            time.sleep(600)
    return fsync(fd)
cio.os = type("os_with_hanging_fsync", (), {k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
cio.os.fsync = staticmethod(hanging_fsync)
"""


def launch(patch: str, args: list[str], env: dict, check: bool = True, **popen) -> subprocess.CompletedProcess:
    proc = warm_python.run([sys.executable, "-c", LAUNCHER, str(ROOT / "run.py"), patch, *args], cwd=env["HOME"],
                           env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, **popen)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.parametrize("out_of", ["cpu", "gpu"])
def test_running_out_of_memory_says_which_options_make_the_run_smaller(env, tmp_path, out_of):
    """A batch too large for the machine ended the run with torch's traceback; it is the run's size, not a bug:
    one paragraph, exit code 2, naming where it ran out (the suite's innermost frame), torch's own account and the
    options that make the run smaller. The checkpoint of the first epoch is kept."""
    proc = launch(OUT_OF_MEMORY_AT_STEP_12, [*TWO_EPOCHS, "logger=none", f"hydra.run.dir={tmp_path}"],
                  {**env, "OUT_OF": out_of}, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if out_of == "gpu":
        assert "The GPU ran out of memory in suite/guard.py:" in said and "Tried to allocate 20.00 GiB." in said
    else:
        assert "This machine ran out of memory in suite/guard.py:" in said and "DefaultCPUAllocator" in said
    for option in ("data.batch_size", "data.eval_batch_size", "++trainer.accumulate_grad_batches",
                   "trainer.precision=bf16-mixed", "resume=true"):
        assert option in said, option
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGBUS"])
def test_a_data_worker_killed_for_memory_says_what_to_lower(env, tmp_path, signal_name):
    """A loader worker killed by the out-of-memory killer (SIGKILL) or by a full /dev/shm (SIGBUS) ended the run
    with torch's traceback naming only the signal: one paragraph now, exit code 2, saying what the signal means and
    which options make the run fit. The checkpoint of the first epoch is kept."""
    proc = launch(KILL_WORKERS_AT_STEP_12, [*TWO_EPOCHS, "logger=none", "data.num_workers=1",
                                            f"hydra.run.dir={tmp_path}"], {**env, "KILL_WITH": signal_name},
                  check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # torch's SIGBUS handler in the worker writes its own line first, ending in a NUL byte
    (said,) = [line.lstrip("\x00") for line in proc.stderr.splitlines() if line.lstrip("\x00").startswith("error:")]
    assert re.search(rf"A data-loading worker \(pid \d+\) was killed with {signal_name}: ", said), said
    needles = ["out-of-memory killer", "--mem"] if signal_name == "SIGKILL" else ["/dev/shm", "--shm-size"]
    for needle in [*needles, "data.num_workers", "data.batch_size", "resume=true"]:
        assert needle in said, needle
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def finite_weights(path: Path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


# --- non-finite losses ---------------------------------------------------------------------------------------------
def test_nan_batch_stops_the_run_naming_the_step_and_last_checkpoint(env, tmp_path):
    proc = launch(NAN_AT_STEP_12, [*TWO_EPOCHS, "logger=none", f"hydra.run.dir={tmp_path}"], env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    err = proc.stderr
    assert "step 12 (epoch 1, batch 2)" in err and "trainer.on_nan=stop" in err and "trainer.on_nan=skip" in err
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert str(last) in err
    # The checkpoint it names was written before the bad step, from finite weights.
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 10
    assert finite_weights(last)


def test_nan_batch_skipped_wandb_failing_and_no_credentials_written(env, tmp_path):
    """One run, four faults (each run.py start costs seconds): a NaN batch with trainer.on_nan=skip, W&B's
    Run.log failing from its fourth call on, credentials in the environment and on the command line (one of them
    in a data set option: the data module is built from the config as given), and a W&B sweep agent's run."""
    secret_env = {"WANDB_API_KEY": "0123456789abcdef-SECRET-KEY", "MY_TOKEN": "tok-SECRET-abcdefgh",
                  "WANDB_MODE": "offline", "WANDB_SWEEP_ID": "sweep123", "WANDB_RUN_ID": "agentrun"}
    proc = launch(NAN_AT_STEP_12 + WANDB_GONE,
                  [*TWO_EPOCHS, "trainer.on_nan=skip", "logger=wandb", f"hydra.run.dir={tmp_path}",
                   "+notes=${oc.env:MY_TOKEN}", "+logger.api_key=plain-SECRET-123",
                   "++data.root=/data/${oc.env:MY_TOKEN}"], {**env, **secret_env})
    # The NaN batch: dropped, counted, reported; BatchNorm statistics and weights stay finite.
    metrics = quality_metrics(json.loads((tmp_path / "metrics.json").read_text()))
    assert metrics["train/skipped_batches"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert "skipped 1 training batch(es) with a NaN or infinite loss" in proc.stdout  # Hydra logs to stdout
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    # Lightning still counts the dropped batch's optimizer call; with no gradient it changes no weight.
    assert ckpt["global_step"] == 20
    assert finite_weights(tmp_path / "checkpoints" / "last.ckpt")
    # W&B gone mid-run: said once, training went on, what W&B missed is in the fallback CSV.
    assert proc.stdout.count("W&B is unavailable (ConnectionResetError in run.log") == 1
    rows = (tmp_path / "wandb_fallback" / "metrics.csv").read_text().splitlines()
    assert "epoch" in rows[0] and "val/oa" in rows[0] and len(rows) >= 3  # both epochs' metrics
    # Credentials: nowhere on disk or in the output. The config logged says where the value came from.
    secrets = [b"0123456789abcdef-SECRET-KEY", b"tok-SECRET-abcdefgh", b"plain-SECRET-123"]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "resolved_config.yaml" for p in files)
    for path in files:
        data = path.read_bytes()
        assert not any(s in data for s in secrets), path
    assert not any(s.decode() in proc.stdout + proc.stderr for s in secrets)
    resolved = (tmp_path / "resolved_config.yaml").read_text()
    assert "notes: <redacted:$MY_TOKEN>" in resolved and "api_key: <redacted>" in resolved
    # The id a resumed run logs into is the agent's run's (wandb.init ignores the id asked for in a sweep): the
    # suite's own made a resumed run start a second W&B run, outside the sweep.
    assert (tmp_path / "checkpoints" / "wandb_run_id").read_text() == "agentrun\n"


# --- checkpoints -----------------------------------------------------------------------------------------------------
def test_kill_during_checkpoint_write_keeps_the_previous_one(env, tmp_path):
    marker = tmp_path / "marker"
    run_dir = tmp_path / "run"
    args = [*TWO_EPOCHS, "logger=none", f"hydra.run.dir={run_dir}"]
    # one process (no data-loading workers): the kill reaches all of it
    proc = warm_python.popen([sys.executable, "-c", LAUNCHER, str(ROOT / "run.py"), HANG_IN_SECOND_LAST_CKPT, *args],
                             cwd=env["HOME"], env={**env, "MARKER": str(marker)}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0]
    assert marker.exists(), output[-3000:]
    ckpts = run_dir / "checkpoints"
    stray = list(ckpts.glob(".last.ckpt.tmp-*"))
    assert len(stray) == 1 and stray[0].stat().st_size > 0  # the killed write, complete but never renamed
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 10
    # The run resumes from the intact checkpoint; its next write clears the stray file.
    run([*TWO_EPOCHS, "logger=none", f"hydra.run.dir={run_dir}", "resume=true"], env)
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 20
    assert not list(ckpts.glob(".last.ckpt.tmp-*"))


class Evil:  # pickled by reference: unpickling it would call os.system
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_holding_pickled_code_is_refused(env, tmp_path):
    bad = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "callback": Evil()}, bad)
    err = user_error(["mode=test", f"ckpt_path={bad}", *TINY, "logger=none"], env,
                     f"Refusing to load ckpt_path={bad}", "weights_only=True", "posix.system")
    assert "pwned" not in err
    with pytest.raises(UserError, match="arbitrary code"):
        SafeCheckpointIO().load_checkpoint(bad, weights_only=False)  # whatever Lightning asks for
    (tmp_path / "cut.ckpt").write_bytes(open(ROOT / "README.md", "rb").read()[:100])
    with pytest.raises(UserError, match="truncated, corrupt or not a torch file"):
        safe_torch_load(tmp_path / "cut.ckpt")


def test_atomic_save_replaces_only_when_complete(tmp_path):
    path = tmp_path / "c" / "last.ckpt"
    atomic_torch_save({"x": torch.ones(3)}, path)
    stray = path.parent / ".last.ckpt.tmp-999999"
    stray.write_bytes(b"half a checkpoint")

    class Broken:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_torch_save({"x": torch.zeros(3), "y": Broken()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))
    assert not stray.exists() and list(path.parent.iterdir()) == [path]  # stray and failed temp both gone


def test_metrics_json_is_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    """metrics.json was written in place: a kill while it was written left it cut short, and mode=report set the
    finished run aside as corrupt. Now it is the old file until the new one is whole."""
    from suite import checkpoint_io

    path = tmp_path / "metrics.json"
    checkpoint_io.atomic_write_text(path, '{"test/oa": 0.5}\n')
    assert json.loads(path.read_text()) == {"test/oa": 0.5}

    def killed(src, dst):  # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_io.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_io.atomic_write_text(path, '{"test/oa": 0.75}\n')
    assert json.loads(path.read_text()) == {"test/oa": 0.5} and list(tmp_path.iterdir()) == [path]


# --- credentials -----------------------------------------------------------------------------------------------------
def test_redaction_rules(tmp_path):
    secrets = {"verysecretvalue": "HF_TOKEN"}
    cfg = {"logger": {"api_key": "abc", "project": "p"}, "model": {"class_token": True, "token": "t"},
           "notes": "x verysecretvalue y", "list": ["verysecretvalue"], "n": 3}
    assert redact(cfg, secrets) == {"logger": {"api_key": "<redacted>", "project": "p"},
                                    "model": {"class_token": True, "token": "<redacted>"},
                                    "notes": "x <redacted:$HF_TOKEN> y", "list": ["<redacted:$HF_TOKEN>"], "n": 3}
    assert redact_override("+logger.api_key=abc", secrets) == "+logger.api_key=<redacted>"
    assert redact_override("model.class_token=false", secrets) == "model.class_token=false"
    f = tmp_path / "overrides.yaml"
    f.write_text("- +logger.api_key=abc\n- model.class_token=false\n- +x=verysecretvalue\n")
    redact_file(f, secrets)
    assert f.read_text() == "- +logger.api_key=<redacted>\n- model.class_token=false\n- +x=<redacted:$HF_TOKEN>\n"


# --- impossible configurations ---------------------------------------------------------------------------------------
def compose_run(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("overrides, needles", [
    (["task=modelnet", "attn=focal", "attn.expand_size=2"], ["attn.expand_size", "task=modelnet", "attn.neighbours"]),
    (["task=shapenet", "attn=dilated", "attn.border=mask"], ["attn.border", "point sets"]),
    (["task=segmentation", "attn=dilated", "attn.neighbours=16"], ["attn.neighbours", "image grids"]),
    (["task=segmentation", "data=blobs", "trainer=ddp", "trainer.devices=4", "data.num_test=3"],
     ["data.num_test=3", "4 = trainer.devices"]),
    (["task=gan", "trainer.devices=2", "++trainer.num_nodes=2", "data.val_samples=2"], ["data.val_samples=2"]),
    (["trainer.on_nan=sometimes"], ["trainer.on_nan='sometimes'", "skip"]),
])
def test_impossible_configurations_are_refused(overrides, needles):
    cfg = compose_run(overrides)
    with pytest.raises(UserError) as err:
        validate_config(cfg, overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_valid_configurations_pass():
    for overrides in (["task=modelnet", "attn=focal", "attn.neighbours=16"], ["task=segmentation", "attn=focal",
                      "attn.expand_size=2"], ["task=gan", "trainer=ddp"], ["task=shapenet", "attn=external"]):
        validate_config(compose_run(overrides), overrides)


def test_config_is_checked_before_any_data_is_read(env, tmp_path):
    user_error(["task=modelnet", "data=modelnet40", f"data.root={tmp_path / 'absent'}", "attn=dilated",
                "attn.border=mask", "logger=none"], env, "attn.border")


def test_classification_size_a_model_cannot_take_is_refused_before_data(env, tmp_path):
    user_error(["task=classification", "model=dilateformer_t", "data=imagenet", f"data.root={tmp_path / 'absent'}",
                "data.img_size=200", "logger=none"], env, "data.img_size", "200", "model.pad=true")


def test_checkpoint_identity_takes_options_added_later_at_their_default(tmp_path):
    """A checkpoint written before a variant gained an option (external's `expand`) still loads when the run uses
    the option's default, and is refused, naming the option, when it does not."""
    from suite.checkpoints import check_checkpoint

    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, "suite": {"task": "modelnet",
                                            "attn": {"name": "external", "heads": 1, "memory": 64}}}, path)
    now = {"name": "external", "heads": 1, "memory": 64, "expand": 1}
    check_checkpoint(str(path), {"task": "modelnet", "attn": now})
    with pytest.raises(UserError, match=r"attn.expand=1 \(here 4\)"):
        check_checkpoint(str(path), {"task": "modelnet", "attn": {**now, "expand": 4}})


@pytest.mark.parametrize("bad", [False, True])
def test_a_skipped_backward_drops_the_gradients_of_the_whole_update(bad, tmp_path):
    """Manual optimisation with two backward calls an update (the GAN's discriminator: its real term, then its fake
    term checked with the whole loss): with trainer.on_nan=skip a non-finite second loss leaves no gradient at all,
    so the optimizer step changes nothing, not the first term's half of the update."""
    import lightning as L
    from torch.utils.data import DataLoader

    from suite.guard import NonFiniteGuard

    class TwoTerms(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.w = torch.nn.Parameter(torch.ones(2))

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad(set_to_none=True)
            first = self.w.sum()
            self.manual_backward(first)
            self.manual_backward(first.detach() + self.w.square().sum() * (math.nan if bad else 1.0))
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module, guard = TwoTerms(), NonFiniteGuard("skip")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[guard],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(torch.zeros(2, 1), batch_size=1))
    if bad:
        assert torch.equal(module.w.detach(), torch.ones(2)) and len(guard.skipped) == 2
    else:  # two SGD steps of 0.1 * (1 + 2w)
        assert torch.allclose(module.w.detach(), torch.full((2,), 0.7 - 0.1 * (1 + 2 * 0.7)))
