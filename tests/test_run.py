"""``run.py`` end to end, as a user runs it: subprocesses, exit codes, files written and read back."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import attention
from fixture_cache import once_per_worker, user_error_in_process
from suite.run_record import quality_metrics
import warm_python

ROOT = Path(__file__).resolve().parents[1]
# A small but real PCT run on generated shapes: a few seconds per run on 2 CPU cores.
TINY = ["experiment=demo", "trainer.max_epochs=1", "data.train_per_class=4", "data.val_per_class=2",
        "data.test_per_class=2", "data.batch_size=4", "data.eval_batch_size=8", "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """No W&B credentials anywhere: runs must go offline by themselves and never prompt."""
    home = tmp_path_factory.mktemp("home")
    e = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    e.update(HOME=str(home), NETRC=str(home / "netrc-missing"), PYTHONUNBUFFERED="1")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on 2 cores: one thread each,
        e["OMP_NUM_THREADS"] = "1"               # or two multi-threaded runs spin-wait on each other
    return e


def run(args, env, check=True, cold=False):
    """``python run.py args`` (from a warm interpreter, tests/warm_python.py, unless ``cold``)."""
    start = subprocess.run if cold else warm_python.run
    # From a scratch folder: Hydra's default run dirs (outputs/...) must not litter the checkout.
    proc = start([sys.executable, str(ROOT / "run.py"), *args], cwd=env["HOME"], env=env,
                 stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def user_error(args, env, *needles):
    proc = run(args, env, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


# --- W&B transaction log reader -------------------------------------------------------------------------------
# Offline runs keep everything in run-<id>.wandb: a 7-byte header (":W&B", magic, version) then LevelDB's log
# format (32 KiB blocks of chunks with crc32, length, type) holding wandb's protobuf Records.
def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        space = block - pos % block
        if space < 7:
            pos += space
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += space
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


# --- bad input ------------------------------------------------------------------------------------------------
def test_unknown_attention_lists_choices(env):
    err = user_error(["attn=softmaxx"], env, "softmaxx", "external", "linear_taylor", "offset", "self")
    assert "attn" in err


def test_sweeps_over_groups_are_checked_as_hydra_expands_them(env):
    user_error(["-m", "attn=self,softmaxx"], env, "unknown attn 'softmaxx'", "external")
    user_error(["-m", "attn=choice(offset,softmaxx)"], env, "unknown attn 'softmaxx'")
    user_error(["-m", "attn=glob(soft*)"], env, "'attn=glob(soft*)' matches no attn config", "linear_elu")
    from suite.cli import check_group_choices

    # glob(*) is every variant's yaml, and a list of known ones is fine: both pass the check and reach Hydra
    check_group_choices(["attn=glob(*)", "attn=self,offset", "task=choice(modelnet,gan)", "seed=0,1,2"])


def test_unknown_task_lists_choices(env):
    user_error(["task=detection"], env, "detection", "modelnet")


def test_missing_dataset_says_how_to_get_it(env, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    user_error_in_process(["task=modelnet", f"data_dir={missing}", "logger=none"], capsys, env["HOME"], tmp_path,
                          str(missing), "data.download=true", "data=shapes")


def test_invalid_attention_option_names_it(env, tmp_path, capsys):
    user_error_in_process([*TINY, "attn=self", "attn.heads=3", "logger=none"], capsys, env["HOME"], tmp_path,
                          "attn.heads")


def test_test_mode_needs_a_checkpoint(env, tmp_path, capsys):
    user_error_in_process([*TINY, "mode=test", f"ckpt_path={tmp_path / 'none.ckpt'}", "logger=none"], capsys,
                          env["HOME"], tmp_path / "run", "ckpt_path")


def test_unknown_mode(env):
    user_error([*TINY, "mode=fly", "logger=none"], env, "mode", "summary")


# --- modes ----------------------------------------------------------------------------------------------------
def test_summary_reports_published_pct_size(env):
    out = run(["task=modelnet", "attn=offset", "mode=summary", "logger=none"], env).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("params=2876136 flops=")
    flops = int(last.split("flops=")[1])
    # The paper's ~4.5 GFLOPs for one 1024-point sample (2.32 G multiply-adds) count the first conv of each grouping
    # layer on the S K concatenated [g - c, c] rows; the suite computes the same function as W_d g and
    # (W_c - W_d) g on the N points, one product (tasks/nets/pct.py SampleAndGroup; a centre is one of the points),
    # which saves exactly this many FLOPs:
    saving = sum(2 * c_out * c_in * (s * k * 2 - 2 * n)
                 for n, s, k, c_in, c_out in ((1024, 512, 32, 64, 128), (512, 256, 32, 128, 256)))
    assert 4.3e9 < flops + saving < 4.6e9
    assert flops == 2_929_348_608
    assert "blocks" in out and "mixer" in out and "groups" in out  # a per-module table precedes it


def test_fast_dev_run_every_variant(env, tmp_path):
    """`task=modelnet attn=X data=shapes trainer.fast_dev_run=true` for every registered X, as one Hydra
    multirun (one process start for all); a batch of 4 keeps the full-size network quick on CPU."""
    variants = attention.names()
    run(["-m", "task=modelnet", f"attn={','.join(variants)}", "data=shapes", "trainer.fast_dev_run=true",
         "data.batch_size=4", "data.eval_batch_size=4", "logger=none", f"hydra.sweep.dir={tmp_path}"], env)
    for i, variant in enumerate(variants):
        job = tmp_path / f"{i}_modelnet_{variant}"
        assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["attn"]["name"] == variant
        metrics = json.loads((job / "metrics.json").read_text())
        assert 0.0 <= metrics["test/oa"] <= 1.0 and "test/macc" in metrics, variant


def test_shapenet_fast_dev_run_every_variant(env, tmp_path):
    """`task=shapenet attn=X data=parts trainer.fast_dev_run=true` for every registered X (one multirun),
    each job with its own offline W&B run tagged with its variant (jobs share one process)."""
    variants = attention.names()
    run(["-m", "task=shapenet", f"attn={','.join(variants)}", "data=parts", "trainer.fast_dev_run=true",
         "data.batch_size=4", "data.eval_batch_size=4", "data.npoints=512", "data.train_per_category=4",
         "data.val_per_category=2", "data.test_per_category=2", f"hydra.sweep.dir={tmp_path}"], env)
    run_ids = set()
    for i, variant in enumerate(variants):
        job = tmp_path / f"{i}_shapenet_{variant}"
        metrics = json.loads((job / "metrics.json").read_text())
        assert 0.0 <= metrics["test/imiou"] <= 1.0 and "test/cmiou" in metrics, variant
        (wandb_file,) = (job / "wandb").glob("offline-run-*/run-*.wandb")
        run_rec = next(r.run for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "run")
        assert f"attn:{variant}" in run_rec.tags
        run_ids.add(run_rec.run_id)
    assert len(run_ids) == len(variants)


def test_a_sweep_goes_on_past_a_failed_job(env, tmp_path):
    """A multirun's jobs share one process (Hydra's default launcher). Its first job's loss goes NaN (lr=1e30): the
    sweep used to end there, exit 2, with the second job never started. Now the second job runs to its
    metrics.json, the first one's message is printed when it fails, the sweep's end lists it with the override that
    sets it apart and how to run it again, and the exit code is still 2. Each job has its own W&B run: the failed
    one finished as failed (exit code 1), not left open for the next job's wandb.init to log into. The advised
    command (resume=true in the same sweep folder) keeps the finished job byte for byte and runs the failed one
    again. What a failed job held (its network, through its error's traceback) is freed before the next starts: on
    a GPU, a variant that ran out of memory would otherwise leave the next one less."""
    args = ["-m", *TINY, "optim.optimizer.lr=1e30,0.01", f"hydra.sweep.dir={tmp_path}"]
    counting = ("import atexit, gc, runpy, sys, lightning, suite.cli as cli; release, live = cli.release_memory, []; "
                "cli.release_memory = lambda: (release(), live.append(sum(isinstance(o, lightning.LightningModule) "
                "for o in gc.get_objects()))); atexit.register(lambda: print('live after each job:', live)); "
                f"sys.argv = [{str(ROOT / 'run.py')!r}, *sys.argv[1:]]; "
                f"runpy.run_path({str(ROOT / 'run.py')!r}, run_name='__main__')")
    proc = warm_python.run([sys.executable, "-c", counting, *args], cwd=env["HOME"], env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "live after each job: [0, 0]" in proc.stdout  # no task module of a job alive once it ended
    assert "Traceback" not in proc.stderr
    assert "error: The training loss became nan at step 1" in proc.stderr
    summary = proc.stderr[proc.stderr.index("error: 1 of the sweep's 2 jobs failed (1 finished)"):]
    assert "#0 0_modelnet_external (optim.optimizer.lr=1e+30): The training loss became nan" in summary
    assert f"resume=true hydra.sweep.dir={tmp_path}" in summary
    failed, finished = tmp_path / "0_modelnet_external", tmp_path / "1_modelnet_external"
    assert not (failed / "metrics.json").exists()
    kept = (finished / "metrics.json").read_bytes()
    alone = tmp_path / "alone"  # the finished job run by itself: the failed one before it left nothing behind
    run([*TINY, "logger=none", f"hydra.run.dir={alone}"], env)
    by_itself, in_sweep = (quality_metrics(json.loads(m)) for m in [(alone / "metrics.json").read_bytes(), kept])
    assert by_itself.keys() < in_sweep.keys()  # the sweep's also logs lr-SGD (a logger's learning rate monitor)
    assert {k: in_sweep[k] for k in by_itself} == pytest.approx(by_itself, abs=1e-6)

    def wandb_run_of(job):
        (wandb_file,) = (job / "wandb").glob("offline-run-*/run-*.wandb")
        records = wandb_records(wandb_file)
        run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
        (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
        logged = {i.key or i.nested_key[0] for r in records if r.WhichOneof("record_type") == "history"
                  for i in r.history.item}
        return run_id, exit_record.exit_code, logged

    failed_id, failed_code, failed_logged = wandb_run_of(failed)
    finished_id, finished_code, finished_logged = wandb_run_of(finished)
    # The failed job was refused (a UserError, exit code 2), and W&B records the code it exited with.
    assert failed_id != finished_id and (failed_code, finished_code) == (2, 0)
    assert "test/oa" in finished_logged and "test/oa" not in failed_logged

    again = run([*args, "resume=true"], env, check=False)
    assert again.returncode == 2 and "error: 1 of the sweep's 2 jobs failed (1 finished)" in again.stderr
    assert (finished / "metrics.json").read_bytes() == kept


def test_shapenet_summary_reports_published_size(env):
    out = run(["task=shapenet", "attn=offset", "mode=summary", "logger=none"], env).stdout
    assert out.strip().splitlines()[-1].startswith("params=2446130 flops=")


def test_shapenet_missing_dataset_says_how_to_get_it(env, tmp_path, capsys):
    user_error_in_process(["task=shapenet", f"data_dir={tmp_path}", "logger=none"], capsys, env["HOME"],
                          tmp_path / "run", "shapenetcore_partanno_segmentation_benchmark_v0_normal",
                          "data.download=true", "data=parts")


def assert_declares_what_it_logs(run_dir: Path, metrics: dict) -> None:
    """Every metric a task declares its validation logs (the choices of `monitor`, checked at start-up against
    them: suite.validate.check_monitor) is in the run's metrics.json."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "resolved_config.yaml")
    declared = get_class(cfg.task._target_).validation_metrics(cfg)
    assert declared and set(declared) <= set(metrics), (sorted(declared), sorted(metrics))


# Tests sharing the module fixtures wandb_run / gan_run carry one xdist group, so one worker builds them once.
@pytest.fixture(scope="module")
def wandb_run(env, tmp_path_factory):
    return once_per_worker(tmp_path_factory, "wandb-run", lambda out: run(
        [*TINY, "data.batch_size=2", "trainer.log_every_n_steps=5", f"hydra.run.dir={out}"], env))


@pytest.mark.xdist_group("runs")
def test_train_writes_metrics_and_checkpoints(wandb_run):
    out, proc = wandb_run
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("train/loss_epoch", "val/oa", "val/oa_best", "val/macc", "val/macc_best", "test/oa", "test/macc"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["val/oa_best"] >= metrics["val/oa"] - 1e-6
    assert_declares_what_it_logs(out, metrics)
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert "test/oa" in proc.stdout and "metrics.json" in proc.stdout
    (best,) = (out / "checkpoints").glob("best-*.ckpt")  # the tested weights, and where in the fit they stood
    saved = torch.load(best, weights_only=True, mmap=True)
    assert metrics["tested"] == {"checkpoint": best.name, "epoch": saved["epoch"], "step": saved["global_step"],
                                 "seed": 42}  # the seed its run was trained with


@pytest.mark.xdist_group("runs")
def test_wandb_offline_without_credentials_and_readable(wandb_run):
    out, proc = wandb_run
    assert "wandb sync" in proc.stdout + proc.stderr  # says how to upload
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    records = wandb_records(next(run_dir.glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_rec.run_group == "modelnet" and "attn:external" in run_rec.tags and run_rec.project == "attention-suite"
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            # wandb keeps its own entries (the confusion matrix's chart) under nested keys of _wandb
            config.update({i.key: json.loads(i.value_json) for i in r.config.update if i.key})
    assert config["attn"]["name"] == "external" and config["model"]["neighbours"] == 16
    recorded = json.loads((out / "metrics.json").read_text())
    for key in ("protocol", "provenance", "tested"):  # the run record, where report.wandb= reads it
        assert config.pop(key) == recorded[key], key
    # The whole resolved config and nothing else: Lightning logged the task's arguments over it (its `model` without
    # model.weights) and the data module's as top-level keys, so report.wandb= grouped runs unlike their folders.
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert config == resolved and "weights" in config["model"]
    assert yaml.safe_load((out / "csv" / "hparams.yaml").read_text()) == resolved
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                key = item.key or item.nested_key[0]  # media are logged as nested fields
                history.setdefault(key, []).append(json.loads(item.value_json))
    for key in ("train/loss_step", "val/oa", "test/oa", "lr-SGD", "train/samples_per_sec"):
        assert key in history, (key, sorted(history))
    assert history["lr-SGD"][0] == pytest.approx(0.01)
    assert all(v > 0 for v in history["train/samples_per_sec"])
    assert "test/confusion_matrix_table" in history and "test/samples" in history
    table = json.loads(next((run_dir / "files" / "media" / "table").rglob("*.table.json")).read_text())
    assert table["columns"] == ["Actual", "Predicted", "nPredictions"]
    assert sum(row[2] for row in table["data"]) == 20  # every test sample counted once (10 classes x 2)
    clouds = list((run_dir / "files" / "media" / "object3D").rglob("*.pts.json"))
    assert len(clouds) == 8
    assert "history" in kinds


@pytest.mark.xdist_group("runs")
def test_test_mode_reproduces_the_tested_checkpoint(wandb_run, env, tmp_path):
    out, _ = wandb_run
    trained = json.loads((out / "metrics.json").read_text())
    # One epoch: the best checkpoint is the last one, so testing last.ckpt must give the same numbers.
    last = out / "checkpoints" / "last.ckpt"
    proc = run([*TINY, "mode=test", f"ckpt_path={last}", "logger=none", "data.eval_batch_size=5",
                f"hydra.run.dir={tmp_path}"], env)
    assert "tested under other values" not in proc.stdout + proc.stderr
    tested = json.loads((tmp_path / "metrics.json").read_text())
    assert tested["test/oa"] == pytest.approx(trained["test/oa"])
    assert tested["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
    # A test command that leaves out a training option the weights do not depend on (experiment=demo's 16 neighbours)
    # tested the network under the default, silently: now it says so (not refused: an experiment of its own).
    proc = run([*TINY, "model.neighbours=8", "mode=test", f"ckpt_path={last}", "logger=none",
                f"hydra.run.dir={tmp_path / 'other'}"], env)
    assert (f"{last} is tested under other values than its run ({out}) was trained with: model.neighbours=16 "
            "(this command: 8). To test it as it was trained, pass its values (model.neighbours=16).") \
        in proc.stdout + proc.stderr


@pytest.mark.xdist_group("runs")
def test_a_test_logs_its_tested_checkpoint_to_wandb_as_the_report_reads_it(wandb_run, env, tmp_path):
    """A `mode=test` run records the seed and config its checkpoint was trained with (metrics.json's tested),
    by which mode=report groups it, and logs them to W&B: W&B had its protocol and provenance only, and
    `report.wandb=` counted the tests of seeds 0, 1, 2 as the command's seed three times, left out two. Read back
    from what offline W&B wrote, the report's W&B reader makes the run the folder reader makes."""
    from suite import report as rep

    out, _ = wandb_run
    run([*TINY, "mode=test", f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}", "seed=7",
         f"hydra.run.dir={tmp_path}"], env)
    recorded = json.loads((tmp_path / "metrics.json").read_text())
    assert recorded["tested"]["seed"] == 42  # the training run's; the command's is 7
    assert recorded["tested"]["config"] == yaml.safe_load((out / "resolved_config.yaml").read_text())
    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    config = {}
    for r in wandb_records(wandb_file):
        if r.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update if i.key})
    assert config["tested"] == recorded["tested"] and config["seed"] == 7
    # A W&B run of its own kind: the training runs' name, group and tags made it one more training run.
    (run_rec,) = [r.run for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "run"]
    assert run_rec.job_type == "test" and run_rec.display_name == "modelnet-external"
    logged = type("WandbRun", (), {"id": "t", "state": "finished", "config": config, "summary": recorded,
                                   "scan_history": lambda self, keys: []})()
    api = type("Api", (), {"runs": lambda self, path: [logged]})()
    (from_wandb,), left_out, _ = rep.read_wandb("me/attention-suite", api)
    from_folder = rep.read_run_dir(tmp_path)
    assert left_out == [] and from_wandb.seed == from_folder.seed == 42
    assert rep.settings(from_wandb) == rep.settings(from_folder) and from_wandb.protocol == from_folder.protocol
    assert from_wandb.provenance == from_folder.provenance and from_wandb.metrics == from_folder.metrics


def wandb_config(wandb_file: Path) -> dict:
    """The config a W&B run holds as wandb wrote it: the run record's (where wandb.init put the values a sweep
    agent locked), updated by every later config record."""
    config = {}
    for r in wandb_records(wandb_file):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config.update({i.key: json.loads(i.value_json) for i in items if i.key and not i.key.startswith("_")})
    return config


def test_a_wandb_agent_run_logs_its_resolved_config_as_the_report_reads_it(env, tmp_path):
    """Under `wandb agent` (a W&B sweep of configs/sweep/*.yaml) wandb locks the sweep's parameters in the run's
    config and ignored the resolved sections logged over them: W&B held attn='external', without the attention's
    options and the task's settings, and `mode=report report.wandb=<sweep>` stopped with an AttributeError. The agent
    is simulated as wandb_agent.py sets it up (WANDB_SWEEP_PARAM_PATH); read back from what offline W&B wrote, the
    report's W&B reader makes the run its folder reader makes, and a run logged without the resolved sections (by
    an earlier version) is left out with the reason."""
    from suite import report as rep

    params = tmp_path / "sweep-params.yaml"
    params.write_text("wandb_version: 1\ntask:\n  value: modelnet\nattn:\n  value: external\nseed:\n  value: 1\n")
    out = tmp_path / "run"
    run([*TINY, "task=modelnet", "attn=external", "seed=1", f"hydra.run.dir={out}"],
        {**env, "WANDB_SWEEP_PARAM_PATH": str(params)})
    (wandb_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    config = wandb_config(wandb_file)
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert config["attn"] == "external" and config["seed"] == 1  # locked by the agent, as on W&B
    assert config["resolved"] == {"task": resolved["task"], "attn": resolved["attn"]}
    summary = json.loads((out / "metrics.json").read_text())

    def read(logged: dict):
        wrun = type("WandbRun", (), {"id": "a", "state": "finished", "config": logged, "summary": summary,
                                     "scan_history": lambda self, keys: []})()
        return rep.read_wandb("me/attention-suite/sweep1", type("Api", (), {"sweep": lambda self, path: type(
            "Sweep", (), {"runs": [wrun]})()})())

    (from_wandb,), left_out, _ = read(config)
    from_folder = rep.read_run_dir(out)
    assert left_out == [] and from_wandb.seed == from_folder.seed == 1 and from_wandb.task == "modelnet"
    assert rep.settings(from_wandb) == rep.settings(from_folder) and from_wandb.metrics == from_folder.metrics
    runs, (why,), _ = read({k: v for k, v in config.items() if k != "resolved"})
    assert runs == [] and "its W&B config's task='modelnet', attn='external' not the resolved section" in why.reason


def test_a_refused_run_is_recorded_in_wandb_with_its_exit_code(env, tmp_path):
    """A run refused once W&B is open (a UserError: here the loss going NaN at the first step) exits with code 2,
    and its W&B run was finished with exit code 1, as a crash."""
    user_error([*TINY, "optim.optimizer.lr=1e30", f"hydra.run.dir={tmp_path}"], env, "training loss became nan")
    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    (exit_record,) = [r.exit for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 2


@pytest.mark.xdist_group("runs")
def test_a_checkpoint_that_does_not_fit_the_network_names_the_options(wandb_run, env, tmp_path, capsys):
    """Same task and attention, other model or data options (PCT's point embedding, the number of classes): the
    weights do not fit, and Lightning's traceback listed every tensor. One paragraph names the first mismatches
    and, from the checkpoint's run folder, the options it was trained with."""
    last = wandb_run[0] / "checkpoints" / "last.ckpt"
    for option, said in (("model.embedding=point", "model.embedding='neighbor' (here 'point')"),
                         ("data.num_classes=5", "data.num_classes=10 (here 5)")):
        folder = tmp_path / option.split("=")[0]
        err = user_error_in_process([*TINY, option, "mode=test", f"ckpt_path={last}", "logger=none",
                                     f"hydra.run.dir={folder}"], capsys, env["HOME"], folder,
                                    f"ckpt_path={last} does not fit this run's network (", "in the checkpoint",
                                    f"Its run ({wandb_run[0] / 'resolved_config.yaml'}) had", said)
        assert "size mismatch" not in err  # Lightning's own list


CLOCK_STARTS = r"""
import sys, time
from omegaconf import OmegaConf
import suite.run_record, suite.train
real, seen = time.perf_counter, []
def clock():  # the run's clock: what has been imported when it starts
    if not seen:
        seen.append(sorted(m for m in ("lightning", "tasks.modelnet", "datamodules.points.shapes") if m in sys.modules))
    return real()
def stop():  # the first thing the run does after starting its clock
    print(seen[0]); sys.exit(0)
suite.train.time.perf_counter, suite.run_record.reset_peak_memory = clock, stop
cfg = OmegaConf.create({"mode": "train", "task": {"_target_": "tasks.modelnet.PointCloudClassification"},
                        "data": {"_target_": "datamodules.points.shapes.Shapes"}})
assert "lightning" not in sys.modules
suite.train.run(cfg, None, [])
"""


def test_a_run_starts_its_clock_after_importing_what_it_runs(env):
    """A single run imported Lightning before its clock started (Hydra's run-start callback), the first job of a
    local multirun after: its wall_time_s was 4 s longer than the same job's run after it (5 s runs of
    experiment=compare: 8.3 s against 4.1 and 4.2), and its variant's wall time in mode=report the longer. Lightning,
    the task's and the data's modules are imported first now (measured the same way: 5.1, 4.5 and 5.0 s)."""
    proc = subprocess.run([sys.executable, "-c", CLOCK_STARTS], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "['datamodules.points.shapes', 'lightning', 'tasks.modelnet']", proc.stdout


def test_seed_makes_cpu_runs_reproducible(env, tmp_path):
    """On the CPU (pinned: with a GPU, accelerator=auto would take it; GPU runs repeat with trainer.deterministic=true,
    tests/gpu/test_cuda_tasks.py). Run b starts cold, a and c from the warm interpreter the tests' runs start from
    (tests/warm_python.py), which shares its hash seed with them: a warm start is the cold one's run."""
    results = []
    for name in ("a", "b", "c"):
        seed = "seed=7" if name != "c" else "seed=8"
        run([*TINY, seed, "trainer.accelerator=cpu", "logger=csv", f"hydra.run.dir={tmp_path / name}"], env,
            cold=name == "b")
        results.append(quality_metrics(json.loads((tmp_path / name / "metrics.json").read_text())))
    assert results[0] == results[1]
    assert results[0] != results[2]


@pytest.mark.xdist_group("runs")
def test_hydra_config_saved_for_the_run(wandb_run):
    out, _ = wandb_run
    saved = yaml.safe_load((out / ".hydra" / "config.yaml").read_text())
    assert saved["attn"]["name"] == "external" and saved["task"]["name"] == "modelnet"


# --- task=gan ---------------------------------------------------------------------------------------------------
# Small networks and a random-weights Inception (metrics.inception_weights=random): the whole pipeline, offline.
GAN_TINY = ["task=gan", "data=digits", "model.g_channels=16", "model.d_channels=16", "model.z_dim=16",
            "data.batch_size=4", "task.d_steps=2", "metrics.batch_size=4", "metrics.inception_weights=random",
            "metrics.reference_samples=8", "task.grid_per_class=2", "trainer.enable_progress_bar=false"]


def test_gan_fast_dev_run_every_variant(env, tmp_path):
    """`task=gan attn=X data=digits trainer.fast_dev_run=true` for every registered X (one multirun)."""
    variants = attention.names()
    run(["-m", *GAN_TINY, f"attn={','.join(variants)}", "trainer.fast_dev_run=true", "logger=none",
         f"metrics.cache_dir={tmp_path / 'fid'}", f"hydra.sweep.dir={tmp_path}"], env)
    for i, variant in enumerate(variants):
        job = tmp_path / f"{i}_gan_{variant}"
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["test/fid"] > 0 and metrics["test/is"] >= 1 - 1e-6, variant
        assert metrics["test/samples"] == 4  # fast_dev_run: one evaluation batch
    # the reference statistics were computed once and shared through the cache
    assert len(list((tmp_path / "fid").glob("*.npz"))) == 1
    # attn=self got SAGAN's block (the task's preset), other variants their own options
    saved = yaml.safe_load((tmp_path / f"{variants.index('self')}_gan_self" / "resolved_config.yaml").read_text())
    assert saved["attn"]["qk_ratio"] == 8 and saved["attn"]["kv_pool"] == 2 and saved["attn"]["heads"] == 1


def test_gan_summary_prints_generator_and_discriminator(env):
    out = run(["task=gan", "attn=self", "mode=summary", "logger=none"], env).stdout
    lines = out.strip().splitlines()
    g = next(line for line in lines if line.startswith("params_G="))
    d = next(line for line in lines if line.startswith("params_D="))
    params_g, params_d = int(g.split()[0].split("=")[1]), int(d.split()[0].split("=")[1])
    assert lines[-1].startswith(f"params={params_g + params_d} ")
    assert 4e6 < params_g < 5e6 and 1e6 < params_d < 1.5e6  # StudioGAN's 32x32 SAGAN: 256 / 128 channels
    # a command-line option beats the task's preset for attn=self
    out = run(["task=gan", "attn=self", "attn.qk_ratio=4", "mode=summary", "logger=none"], env).stdout
    g4 = next(line for line in out.splitlines() if line.startswith("params_G="))
    assert int(g4.split()[0].split("=")[1]) == params_g + 2 * 256 * (64 - 32)  # q and k: 64 instead of 32 channels


@pytest.fixture(scope="module")
def gan_run(env, tmp_path_factory):
    """4 generator steps, FID every 2 (8 samples), W&B offline."""
    return once_per_worker(tmp_path_factory, "gan-run", lambda out: run(
        [*GAN_TINY, "attn=external", "trainer.max_steps=4", "metrics.every_n_steps=2", "metrics.num_samples=8",
         "eval.num_samples=8", f"metrics.cache_dir={out / 'fid'}", "trainer.log_every_n_steps=1",
         f"hydra.run.dir={out}"], env))


@pytest.mark.xdist_group("runs")
def test_gan_train_logs_fid_grid_and_checkpoints(gan_run):
    out, proc = gan_run
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("val/fid", "val/fid_best", "val/is", "test/fid", "test/is", "test/is_std"):
        assert key in metrics and metrics[key] == metrics[key], key
    assert metrics["test/samples"] == 8
    assert_declares_what_it_logs(out, metrics)  # with KID, as configs/task/gan.yaml has it
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in ckpts and any(name.startswith("best-") for name in ckpts)
    assert sorted(p.name for p in (out / "samples").glob("val_*.png")) == ["val_step000002.png", "val_step000004.png"]
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = {}
    for r in wandb_records(next(run_dir.glob("run-*.wandb"))):
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                history.setdefault(item.key or item.nested_key[0], []).append(json.loads(item.value_json))
    assert len(history["val/fid"]) == 2 and "val/samples" in history and "test/samples" in history
    assert "train/loss_d" in history and "train/loss_g" in history
    assert len(list((run_dir / "files" / "media" / "images" / "val").glob("samples_*.png"))) == 2


@pytest.mark.xdist_group("runs")
def test_gan_eval_mode_reproduces_and_saves_samples(gan_run, env, tmp_path):
    out, _ = gan_run
    trained = json.loads((out / "metrics.json").read_text())
    best = next((out / "checkpoints").glob("best-*.ckpt"))
    samples = tmp_path / "pngs"
    run([*GAN_TINY, "attn=external", "mode=eval", f"ckpt_path={best}", "eval.num_samples=8",
         f"eval.save_samples={samples}", f"metrics.cache_dir={out / 'fid'}", "logger=none",
         f"hydra.run.dir={tmp_path}"], env)
    evaluated = json.loads((tmp_path / "metrics.json").read_text())
    assert evaluated["test/fid"] == pytest.approx(trained["test/fid"], rel=1e-6)
    assert len(list(samples.glob("*.png"))) == 8


@pytest.mark.xdist_group("runs")
def test_gan_checkpoint_of_another_variant_or_task_is_refused(gan_run, wandb_run, env, tmp_path, capsys):
    out, _ = gan_run
    last = out / "checkpoints" / "last.ckpt"
    user_error_in_process([*GAN_TINY, "attn=self", "mode=eval", f"ckpt_path={last}", "logger=none"], capsys,
                          env["HOME"], tmp_path / "self", "attn=external", str(last))
    modelnet = wandb_run[0] / "checkpoints" / "last.ckpt"
    user_error_in_process([*GAN_TINY, "attn=external", "mode=eval", f"ckpt_path={modelnet}", "logger=none"], capsys,
                          env["HOME"], tmp_path / "modelnet", "task=modelnet")


def test_gan_bad_input(env, tmp_path, capsys):
    user_error_in_process([*GAN_TINY, "attn=self", "data.resolution=64", "trainer.fast_dev_run=true", "logger=none"],
                          capsys, env["HOME"], tmp_path / "a", "data.resolution=64", "32")
    user_error_in_process([*GAN_TINY, "attn=self", f"metrics.inception_weights={tmp_path / 'nope.pth'}",
                           "trainer.fast_dev_run=true", "logger=none"], capsys, env["HOME"], tmp_path / "b",
                          "metrics.inception_weights")
    user_error_in_process(["task=gan", "data=image_folder", f"data.root={tmp_path / 'missing'}", "logger=none"],
                          capsys, env["HOME"], tmp_path / "c", "missing")


# --- task=segmentation ------------------------------------------------------------------------------------------
SEG_TINY = ["task=segmentation", "data=blobs", "data.num_train=16", "data.num_val=4", "data.num_test=4",
            "data.size=32", "data.batch_size=4", "data.eval_batch_size=4", "model.backbone=resnet18",
            "model.head_channels=32", "trainer.enable_progress_bar=false"]


def test_segmentation_fast_dev_run_every_variant_and_plain_fcn(env, tmp_path):
    """`task=segmentation data=blobs attn=X trainer.fast_dev_run=true` for every X, and `model.head=none`."""
    variants = attention.names()
    run(["-m", *SEG_TINY, f"attn={','.join(variants)}", "trainer.fast_dev_run=true", "logger=none",
         f"hydra.sweep.dir={tmp_path / 'm'}"], env)
    for i, variant in enumerate(variants):
        metrics = json.loads((tmp_path / "m" / f"{i}_segmentation_{variant}" / "metrics.json").read_text())
        for key in ("test/miou", "test/pixel_acc", "test/aa", "test/kappa", "test/f1"):
            assert key in metrics, (variant, key)
        assert 0 <= metrics["test/miou"] <= 1 and 0 <= metrics["test/pixel_acc"] <= 1
    # the literal command: default backbone (ResNet-50, random weights for blobs), plain FCN head
    run(["task=segmentation", "data=blobs", "model.head=none", "trainer.fast_dev_run=true", "logger=none",
         "data.num_train=8", "data.num_val=2", "data.num_test=2", "trainer.enable_progress_bar=false",
         f"hydra.run.dir={tmp_path / 'fcn'}"], env)
    resolved = yaml.safe_load((tmp_path / "fcn" / "resolved_config.yaml").read_text())
    assert resolved["model"]["backbone"] == "resnet50" and resolved["model"]["pretrained"] is False


def test_segmentation_train_logs_overlays_and_per_class_table(env, tmp_path):
    run([*SEG_TINY, "attn=external", "trainer.max_steps=4", "eval.every_n_steps=2", "eval.mode=slide",
         "data.crop=24", "trainer.log_every_n_steps=1", f"hydra.run.dir={tmp_path}"], env)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val/miou_best"] >= metrics["val/miou"] - 1e-9 and "test/kappa" in metrics
    assert_declares_what_it_logs(tmp_path, metrics)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = {}
    for r in wandb_records(next(run_dir.glob("run-*.wandb"))):
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                history.setdefault(item.key or item.nested_key[0], []).append(json.loads(item.value_json))
    assert len(history["val/miou"]) == 2 and "train/loss_aux" in history
    assert history["lr-SGD/weights"][0] == pytest.approx(0.01) and "val/overlays" in history
    tables = list((run_dir / "files" / "media" / "table").rglob("*per_class*.table.json"))
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["class", "iou", "acc"] and len(table["data"]) == 5
    masks = list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert len(masks) >= 3 * 4  # image + predicted and true masks for 4 images


def _validated_steps(run_dir: Path) -> dict[int, float]:
    """{optimizer step (1-based): val/miou} of a run, read back from its csv/metrics.csv."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]) + 1: float(row["val/miou"]) for row in csv.DictReader(f) if row.get("val/miou")}


@pytest.mark.parametrize("max_steps, validated", [(5, [2, 4, 5]), (4, [2, 4])])
def test_segmentation_validates_the_last_step_once(env, tmp_path, max_steps, validated):
    """trainer.max_steps=5 with eval.every_n_steps=2 validated at steps 2 and 4 only: the final weights (the poly
    schedule's end) were never validated, checkpointed as best or tested; mmengine validates at max_iters too.
    Now also at step 5, and the best checkpoint is chosen among all three (at lr 0.05 the last is the best);
    with max_steps a multiple there is no second validation at the end."""
    run([*SEG_TINY, "attn=external", f"trainer.max_steps={max_steps}", "eval.every_n_steps=2", "data.lr=0.05",
         "logger=csv", f"hydra.run.dir={tmp_path}"], env)
    scores = _validated_steps(tmp_path)
    assert sorted(scores) == validated, scores
    best = max(scores, key=lambda step: (scores[step], -step))  # Lightning keeps the first of equal scores
    (ckpt,) = (tmp_path / "checkpoints").glob("best-*.ckpt")
    assert ckpt.name.endswith(f"-step{best:06d}.ckpt")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["tested"]["checkpoint"] == ckpt.name and metrics["val/miou_best"] == max(scores.values())
    if max_steps == 5:
        assert best == 5, scores


def test_segmentation_missing_dataset_shows_layout(env, tmp_path, capsys):
    user_error_in_process(["task=segmentation", "data=voc", f"data_dir={tmp_path}", "logger=none"], capsys,
                          env["HOME"], tmp_path / "run", "VOCdevkit", "SegmentationClass")


@pytest.mark.slow
def test_demo_reaches_target_accuracy(env, tmp_path):
    """What `make demo` runs (W&B offline by itself): PCT + external attention on shapes, test OA >= 0.85. A cold
    process, as `make demo` starts (the few seconds of imports are nothing beside its training)."""
    run(["experiment=demo", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], env, cold=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["test/oa"] >= 0.85, metrics
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_parts_demo_reaches_target_miou(env, tmp_path):
    """PCT part segmentation with external attention on generated parts: test instance mIoU >= 0.7 (~2 min)."""
    proc = run(["experiment=parts_demo", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], env,
               cold=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["test/imiou"] >= 0.7, metrics
    assert "test/iou/lamp" in metrics  # per-category IoU
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    clouds = list((run_dir / "files" / "media" / "object3D").rglob("*.pts.json"))
    assert len(clouds) == 8, proc.stdout[-2000:]  # 4 shapes, coloured by true and by predicted part
