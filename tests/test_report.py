"""``mode=report``: a real multirun of two variants x two seeds, reported, and every number checked by hand.

The expected values are computed here from the runs' own metrics.json files with explicit formulas (numpy for
sums, scipy only for the Student t distribution's quantile and tail), never with suite/report.py's helpers.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from scipy.stats import t as student_t

from attention.errors import UserError
from fixture_cache import once_per_worker
from suite import report as rep
from suite.run_record import code_version, protocol
import warm_python

ROOT = Path(__file__).resolve().parents[1]
# Two epochs of three generated classes at 128 points: about 5 s a run on 2 CPU cores.
SWEEP = ["-m", "experiment=demo", "trainer.max_epochs=2", "data.num_classes=3", "data.train_per_class=6",
         "data.val_per_class=2", "data.test_per_class=4", "data.batch_size=6", "data.eval_batch_size=12",
         "data.npoints=128", "model.samples=[32,16]", "trainer.enable_progress_bar=false", "logger=csv",
         "attn=self,offset", "seed=0,1"]
VARIANTS, SEEDS = ("offset", "self"), (0, 1)
PNG = b"\x89PNG\r\n\x1a\n"


def run_py(args, cwd: Path, check=True):
    # The caller's environment, as tests/test_run.py's runs have it, without W&B settings: a stripped one broke on
    # the GPU machine, where packages sit beside the interpreter's (PYTHONPATH) and Lightning's MPI detection starts
    # Open MPI, which aborts the run without the launcher settings of the caller's environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(cwd), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = warm_python.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The multirun (4 runs), plus a second folder holding a crashed run and a corrupt one, then
    ``mode=report report.runs=<multirun>,<broken> report.metric=test/loss`` through run.py."""

    def build(out: Path):
        runs = out / "multirun"
        run_py([*SWEEP, f"hydra.sweep.dir={runs}"], out)
        broken = out / "broken"
        for name in ("crashed", "corrupt"):  # copies of a real run folder, without / with a bad metrics.json
            shutil.copytree(runs / "0_modelnet_self", broken / name, ignore=shutil.ignore_patterns("checkpoints"))
        (broken / "crashed" / "metrics.json").unlink()
        (broken / "corrupt" / "metrics.json").write_text('{"test/oa": 0.5, ')
        return run_py(["mode=report", f"report.runs={runs},{broken}", "report.metric=test/loss", "logger=none",
                       f"hydra.run.dir={out / 'report-run'}"], out)

    return once_per_worker(tmp_path_factory, "report-sweep", build)


def job_dirs(runs: Path) -> dict[tuple[str, int], Path]:
    """(attn, seed) -> run folder, read from what Hydra saved (not from the report)."""
    out = {}
    for job in sorted(runs.glob("*_modelnet_*")):
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        out[(config["attn"]["name"], config["seed"])] = job
    return out


def by_hand(values) -> dict:
    x = np.asarray(values, dtype=float)
    n = len(x)
    mean = x.sum() / n
    std = math.sqrt(((x - mean) ** 2).sum() / (n - 1))
    half = student_t.ppf(0.975, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "min": x.min(),
            "max": x.max()}


def paired_by_hand(x, y) -> dict:
    d = np.asarray(x, dtype=float) - np.asarray(y, dtype=float)
    n = len(d)
    mean = d.sum() / n
    se = math.sqrt(((d - mean) ** 2).sum() / (n - 1)) / math.sqrt(n)
    t = mean / se
    half = student_t.ppf(0.975, n - 1) * se
    return {"diff": mean, "ci_low": mean - half, "ci_high": mean + half, "p": 2 * student_t.sf(abs(t), n - 1)}


def welch_by_hand(x, y) -> dict:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    diff = x.mean() - y.mean()
    half = student_t.ppf(0.975, df) * se
    return {"diff": diff, "ci_low": diff - half, "ci_high": diff + half, "p": 2 * student_t.sf(abs(diff / se), df)}


def close(a, b, rel=1e-9):
    if a is None or b is None:
        return a is None and b is None
    if isinstance(b, float) and math.isnan(b):
        return a is None or math.isnan(a)
    return a == pytest.approx(b, rel=rel, abs=1e-12)


def cfg(**report) -> OmegaConf:
    base = {"runs": None, "wandb": None, "baseline": None, "metric": None, "out": None, "confidence": 0.95,
            "plots": False, "log_wandb": False}
    return OmegaConf.create({"report": {**base, **report}, "logger": {"name": "none"}})


# --- what every run records ------------------------------------------------------------------------------------------
def test_runs_record_cost_and_protocol(sweep):
    out, _ = sweep
    for (attn, seed), job in job_dirs(out / "multirun").items():
        m = json.loads((job / "metrics.json").read_text())
        # the demo's `accelerator: auto` takes the GPU where there is one (the GPU machine's make test-gpu)
        source = "cuda_max_memory_allocated" if torch.cuda.is_available() else "cpu_peak_rss"
        assert m["wall_time_s"] > 0 and m["peak_memory_bytes"] > 2**20 and m["peak_memory_source"] == source
        assert m["params"] > 0 and m["flops"] > 0 and m["train_samples_per_sec"] > 0
        assert m["protocol"] == {"checkpoint": "best val/oa (max)", "split": "test", "selected_on": "val",
                                 "tta": "none", "points": 128}
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        assert m["provenance"] == {"code": [code_version()], "torch": torch.__version__, "device": device}
    jobs = job_dirs(out / "multirun")
    a, b = (json.loads((jobs[(v, 0)] / "metrics.json").read_text()) for v in VARIANTS)
    assert a["params"] != b["params"]  # offset and self attention differ in size


def test_peak_memory_is_counted_from_the_runs_start():
    """reset_peak_memory (called when a run starts) drops the process's earlier peak: each job of a local multirun,
    which shares one process with the jobs before it, records its own."""
    from suite.run_record import peak_memory, reset_peak_memory

    block = bytearray(b"\x01") * (256 * 2**20)  # written, so resident
    high, source = peak_memory("cpu")
    assert source == "cpu_peak_rss" and high > 256 * 2**20
    del block
    reset_peak_memory()
    assert peak_memory("cpu")[0] < high - 200 * 2**20


def test_starting_a_run_creates_no_cuda_context(monkeypatch):
    """reset_peak_memory reset CUDA's statistics wherever CUDA was available, which creates a CUDA context: on the
    current device before a DDP process had chosen its own (every process's on GPU 0), and for a CPU run on a GPU
    machine (its peak RSS then held the context). Only a process that has used CUDA already resets them."""
    import torch

    from suite.run_record import reset_peak_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    reset_peak_memory()
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # an earlier job of a multirun used the GPU
    reset_peak_memory()
    assert calls == [()]


def test_peak_memory_is_the_runs_own_not_its_launchers():
    """A process started by one that holds 1 GiB (a second DDP process, a launcher's job, a test's run) records its
    own peak: getrusage's ru_maxrss starts at the launcher's peak (the kernel folds it in at exec), and recorded
    at least the launcher's 1 GiB for a run that never held it."""
    block = bytearray(b"\x01") * (1024 * 2**20)  # written, so resident in this, the launching process
    code = "from suite.run_record import peak_memory; print(peak_memory('cpu')[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    del block
    own = int(out.stdout)
    assert 10 * 2**20 < own < 1024 * 2**20  # the child imports torch (a few hundred MiB), never 1 GiB


def test_throughput_meter_logs_its_window_and_keeps_the_whole_run_rate(monkeypatch):
    """One meter for both readers: the logged rate over the last `window` counted batches, and the whole run's
    rate for metrics.json; the epoch's first batch (warm-up) is not counted, the loading time before a batch is."""
    import suite.callbacks as callbacks

    now = [0.0]
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: now[0])
    batch = {"points": torch.zeros(4, 3)}

    class Connector:  # Lightning's logger connector, as the trainer holds it
        should_update_logs = True

        def __init__(self):
            self.logged = []

        def log_metrics(self, metrics):
            self.logged += metrics.items()

    class Trainer:
        def __init__(self):
            self._logger_connector = Connector()

    for window, expected in ((1, [4 / 1.5, 4 / 0.5]), (10, [4 / 1.5, 8 / 2.0])):
        meter, trainer = callbacks.TrainThroughput(window), Trainer()
        meter.on_train_epoch_start(trainer, None)
        for start, end in ((0.0, 1.0), (1.5, 2.5), (2.5, 3.0)):  # the 2nd waited 0.5 s for its data
            now[0] = start
            meter.on_train_batch_start(trainer, None, batch, 0)
            now[0] = end
            meter.on_train_batch_end(trainer, None, None, batch, 0)
        logged = trainer._logger_connector.logged
        assert [k for k, _ in logged] == ["train/samples_per_sec"] * 2
        assert [v for _, v in logged] == pytest.approx(expected)
        assert meter.rate() == pytest.approx(8 / 2.0)
        # A validation, then 5 s of checkpoint writes before the next batch: that batch is left out, not counted as
        # having waited 5 s for its data; the one after it counts again.
        meter.on_validation_start(trainer, None)
        meter.on_validation_end(trainer, None)
        for start, end in ((8.0, 9.0), (9.0, 9.5)):
            now[0] = start
            meter.on_train_batch_start(trainer, None, batch, 0)
            now[0] = end
            meter.on_train_batch_end(trainer, None, None, batch, 0)
        assert meter.rate() == pytest.approx(12 / 2.5)
    silent = callbacks.TrainThroughput(window=0)
    assert silent.rate() is None


def test_report_falls_back_to_the_logged_throughput(tmp_path):
    """A run whose metrics.json has no train_samples_per_sec: the mean of its logged history, under the suite's key,
    else under the key of Lightning's ThroughputMonitor (runs logged before the suite had its own meter)."""
    from suite.report import Run, logged_throughput

    for key in ("train/samples_per_sec", "train/device/samples_per_sec"):
        history = tmp_path / f"{key.replace('/', '_')}.csv"
        history.write_text(f"step,{key},train/loss\n10,4.0,\n20,,0.5\n30,8.0,\n")
        run = Run(path=str(tmp_path), config={}, metrics={}, cost={}, protocol={}, history=history)
        assert logged_throughput(run) == pytest.approx(6.0)
    history.write_text("step,train/loss\n10,0.5\n")
    assert logged_throughput(Run(str(tmp_path), {}, {}, {}, {}, history=history)) is None


# --- the report, end to end ------------------------------------------------------------------------------------------
def test_report_aggregates_and_compares_as_computed_by_hand(sweep):
    out, proc = sweep
    jobs = job_dirs(out / "multirun")
    assert sorted(jobs) == [(v, s) for v in VARIANTS for s in SEEDS]
    metrics = {key: json.loads((job / "metrics.json").read_text()) for key, job in jobs.items()}
    document = json.loads((out / "multirun" / "report" / "report.json").read_text())
    rows = {row["attn"]: row for row in document["rows"]}
    assert sorted(rows) == sorted(VARIANTS)
    loss = {v: [metrics[(v, s)]["test/loss"] for s in SEEDS] for v in VARIANTS}
    for variant in VARIANTS:
        row, expected = rows[variant], by_hand(loss[variant])
        assert row["metric"] == "test/loss" and row["higher_is_better"] is False
        assert row["variant"] == f"attn={variant}" and row["seeds"] == list(SEEDS)
        for key, value in expected.items():
            assert close(row[key], value), (variant, key, row[key], value)
        assert close(row["best_of_n"], min(loss[variant]))  # lower is better
        for key in ("params", "flops", "train_samples_per_sec", "peak_memory_bytes", "wall_time_s"):
            assert close(row[key], np.mean([metrics[(variant, s)][key] for s in SEEDS])), key
        assert row["protocol"] == metrics[(variant, 0)]["protocol"]
        assert sorted(row["runs"]) == sorted(str(jobs[(variant, s)]) for s in SEEDS)
    # The default baseline of task=modelnet is offset; the seeds match, so the test is paired.
    assert rows["offset"]["note"] == "baseline" and rows["offset"]["baseline"] == "attn=offset"
    self_row, paired = rows["self"], paired_by_hand(loss["self"], loss["offset"])
    assert self_row["baseline"] == "attn=offset" and self_row["test"] == "paired t"
    assert close(self_row["diff"], paired["diff"])
    assert close(self_row["diff_ci_low"], paired["ci_low"]) and close(self_row["diff_ci_high"], paired["ci_high"])
    assert close(self_row["p_value"], paired["p"], rel=1e-6)
    assert self_row["note"] == "n < 3: too few runs to conclude"
    # Every other metric, aggregated (metrics.csv / the JSON's "metrics").
    for entry in document["metrics"]:
        values = [metrics[(entry["variant"].removeprefix("attn="), s)][entry["metric"]] for s in SEEDS]
        expected = by_hand(values)
        for key in ("n", "mean", "min", "max"):
            assert close(entry[key], expected[key]), (entry, key)
        if expected["std"] > 0:
            assert close(entry["std"], expected["std"]) and close(entry["ci_low"], expected["ci_low"])
    assert {e["metric"] for e in document["metrics"]} >= {"test/oa", "test/macc", "test/loss", "val/oa_best"}
    # The same numbers in the CSV.
    with (out / "multirun" / "report" / "report.csv").open() as f:
        table = {r["attn"]: r for r in csv.DictReader(f)}
    assert float(table["self"]["p_value"]) == pytest.approx(paired["p"], rel=1e-6)
    assert float(table["offset"]["mean"]) == pytest.approx(np.mean(loss["offset"]), rel=1e-9)


def test_report_lists_runs_left_out_and_writes_plots(sweep):
    out, proc = sweep
    folder = out / "multirun" / "report"
    broken = out / "broken"
    document = json.loads((folder / "report.json").read_text())
    reasons = {x["path"]: x["reason"] for x in document["left_out"]}
    assert set(reasons) == {str(broken / "crashed"), str(broken / "corrupt")}
    assert "no metrics.json" in reasons[str(broken / "crashed")]
    assert "corrupt metrics.json" in reasons[str(broken / "corrupt")]
    text = (folder / "report.md").read_text()
    section = text[text.index("## Runs left out"):]
    for path in reasons:
        assert path in section and path in proc.stdout  # in the report and on stdout, never dropped silently
    assert "| `attn=self` | 2 | 0, 1 |" in text and "paired t" in text and "## modelnet on Shapes" in text
    assert "report written to" in proc.stdout
    for name in ("modelnet-shapes-flops.png", "modelnet-shapes-throughput.png", "modelnet-shapes-curves.png"):
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
        assert f"({name})" in text
    assert (folder / "metrics.csv").is_file()


def test_a_report_run_again_into_its_folder_replaces_the_earlier_one_whole(sweep, tmp_path):
    """The earlier report's plots go (its report.json lists them) when a report is written into its folder again;
    before, a report without them (here plots=false, or one whose tasks changed) left them beside its report.md.
    Files the earlier report did not write stay."""
    out, _ = sweep
    runs = [str(out / "multirun")]
    first = rep.report(cfg(runs=runs, out=str(tmp_path), plots=True))
    assert first["plots"] and all((tmp_path / name).is_file() for name in first["plots"])
    (tmp_path / "notes.png").write_bytes(PNG)  # the user's, not the report's
    second = rep.report(cfg(runs=runs, out=str(tmp_path), plots=False))
    assert second["plots"] == [] and not any((tmp_path / name).exists() for name in first["plots"])
    assert (tmp_path / "notes.png").is_file() and (tmp_path / "report.md").is_file()


def test_a_run_still_running_is_told_from_a_crashed_one(tmp_path):
    """A folder without metrics.json: its run still running (its process holds the run folder's lock, as
    suite.run_dirs.hold does while a run trains and tests) is listed as such; once that process is gone (here
    killed), as crashed or stopped. A folder whose lock is held is running even with a metrics.json: a finished run
    resumed for more epochs keeps its earlier part's until its first training batch, and was averaged as
    finished under its new config."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.yaml").write_text("mode: train\nseed: 0\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from suite.run_dirs import hold; hold(Path(sys.argv[1])); print('held', flush=True); "
                               "sys.stdin.read()", str(run)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert rep.read_run_dir(run).reason == "still running (no metrics.json yet; its process holds .run.lock)"
        (run / "metrics.json").write_text('{"test/oa": 0.5}')
        assert rep.read_run_dir(run).reason == ("still running (its metrics.json is an earlier part's, replaced "
                                               "when it ends; its process holds .run.lock)")
    finally:
        holder.kill()
        holder.wait()
    assert isinstance(rep.read_run_dir(run), rep.Run)  # its process gone: finished
    (run / "metrics.json").unlink()
    assert rep.read_run_dir(run).reason == ("no metrics.json (the run crashed or was stopped: no process holds its "
                                           ".run.lock)")

# --- more of the same runs, in the process ----------------------------------------------------------------------------
def copy_runs(out: Path, dest: Path) -> dict:
    jobs = {}
    for key, job in job_dirs(out / "multirun").items():
        jobs[key] = dest / job.name
        shutil.copytree(job, jobs[key], ignore=shutil.ignore_patterns("checkpoints"))
    return jobs



def test_each_run_is_counted_once(sweep, tmp_path):
    """A folder under two report.runs roots is read once; a run repeated in another folder (same row, same seed) is
    left out, naming the one counted: before, both counted as seeds, which made n 3 and the spread a repeat's."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    repeat = tmp_path / "again" / "self-0"
    shutil.copytree(jobs[("self", 0)], repeat)
    document = rep.report(cfg(runs=[str(tmp_path / "runs"), str(jobs[("offset", 0)]), str(tmp_path / "again")],
                              out=str(tmp_path / "rep"), baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["offset"]["seeds"] == [0, 1] and rows["self"]["seeds"] == [0, 1]
    scores = [json.loads((jobs[("self", s)] / "metrics.json").read_text())["test/oa"] for s in SEEDS]
    assert close(rows["self"]["mean"], np.mean(scores))
    assert document["left_out"] == [{"path": str(repeat), "reason": (
        f"seed 0 again in the row attn=self (one run per seed: {jobs[('self', 0)]}, read first, is counted)")}]


def test_tests_of_checkpoints_count_under_the_seeds_they_were_trained_with(sweep, tmp_path):
    """`mode=test ckpt_path=<run>/checkpoints/...` for the runs of seeds 0 and 1: each test's own seed is its
    command's (42 unless given), and the report took them for one seed tested twice and left one out. A test's
    metrics.json names the seed its checkpoint was trained with (`tested.seed`), which the report counts."""
    out, _ = sweep
    trained = copy_runs(out, tmp_path / "trained")
    tests = make_tests(trained, tmp_path / "tests", record_config=True)
    document = rep.report(cfg(runs=[str(tests[s]) for s in SEEDS], out=str(tmp_path / "rep"), baseline="self"))
    (row,) = document["rows"]
    assert row["seeds"] == list(SEEDS) and document["left_out"] == []


def make_tests(trained: dict, dest: Path, record_config: bool) -> dict[int, Path]:
    """seed -> a `mode=test` record (seed 42, its command's) of the best checkpoint of the self run of that seed
    in ``trained``: its metrics.json as run.py writes it, ``tested.config`` (the training run's config) included
    when ``record_config``, as in records from before it was recorded otherwise."""
    tests = {}
    for seed in SEEDS:
        job = trained[("self", seed)]
        tests[seed] = dest / job.name
        shutil.copytree(job, tests[seed])
        set_config(tests[seed], mode="test", seed=42, ckpt_path=str(job / "checkpoints" / "best.ckpt"))
        record = json.loads((job / "metrics.json").read_text())
        record["tested"] = {"checkpoint": "best.ckpt", "epoch": 1, "step": 2, "seed": seed}
        if record_config:
            record["tested"]["config"] = yaml.safe_load((job / "resolved_config.yaml").read_text())
        (tests[seed] / "metrics.json").write_text(json.dumps(record))
    return tests


def test_tests_are_grouped_by_how_their_checkpoints_were_trained(sweep, tmp_path):
    """The tests of two checkpoints, one of a full run, one of a 1-epoch debug run, at one test command: grouped by
    the test command's config they were one row, the debug checkpoint averaged in as a seed. They are grouped by
    the config of the run that trained each checkpoint (tested.config of the record, else the
    resolved_config.yaml beside the checkpoint); a test whose training config is in neither is left out, said."""
    out, _ = sweep
    trained = copy_runs(out, tmp_path / "trained")
    set_config(trained[("self", 1)], trainer__max_epochs=1)
    for record_config in (True, False):
        tests = make_tests(trained, tmp_path / f"tests-{record_config}", record_config)
        document = rep.report(cfg(runs=[str(tests[s]) for s in SEEDS], out=str(tmp_path / f"rep-{record_config}"),
                                  baseline="self"))
        rows = {row["variant"]: row["seeds"] for row in document["rows"]}
        assert rows == {"attn=self trainer.max_epochs=1": [1], "attn=self trainer.max_epochs=2": [0]}, rows
    shutil.rmtree(trained[("self", 1)])  # the debug run's folder gone: its test, from before, cannot be grouped
    document = rep.report(cfg(runs=[str(tests[s]) for s in SEEDS], out=str(tmp_path / "rep-gone")))
    assert [row["seeds"] for row in document["rows"]] == [[0]]
    ((path, reason),) = [(x["path"], x["reason"]) for x in document["left_out"]]
    assert path == str(tests[1]) and reason.startswith(
        f"a mode=test record of ckpt_path={trained[('self', 1)] / 'checkpoints' / 'best.ckpt'} without the config "
        "its checkpoint was trained with")


def test_rows_say_what_code_produced_them_and_flag_mixed_code(sweep, tmp_path):
    """Each table says which code, torch and device produced its runs (metrics.json's provenance). A row whose
    seeds ran different code (half the seeds before a fix, a run resumed after a commit) or uncommitted changes is
    flagged in bold: its runs are averaged as seeds, yet differ by more than the seed."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    ran = json.loads((jobs[("self", 0)] / "metrics.json").read_text())["provenance"]
    clean = {**ran, "code": ["0123456789ab"]}
    for job in jobs.values():
        path = job / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "provenance": clean}))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "same"), baseline="offset"))
    text = (tmp_path / "same" / "report.md").read_text()
    assert f"All runs: code `0123456789ab`; torch `{ran['torch']}`; device `{ran['device']}`." in text
    assert all(row["mixed"] == [] and not row["uncommitted"] for row in document["rows"])

    path = jobs[("self", 1)] / "metrics.json"  # its second seed resumed under a later commit, with local changes
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "provenance": {**clean, "code": ["0123456789ab", "fedcba987654+dirty"]}}))
    (jobs[("offset", 1)] / "metrics.json").write_text(json.dumps(  # a run from before provenance was recorded
        {k: v for k, v in json.loads((jobs[("offset", 1)] / "metrics.json").read_text()).items()
         if k != "provenance"}))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "mixed"), baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["self"]["code"] == {"0123456789ab": 1, "0123456789ab -> fedcba987654+dirty": 1}
    assert rows["self"]["mixed"] == ["code"] and rows["self"]["uncommitted"]
    assert rows["offset"]["code"] == {"0123456789ab": 1, "unknown": 1} and rows["offset"]["torch"] == {
        ran["torch"]: 1, "unknown": 1} and rows["offset"]["mixed"] == ["code", "torch", "device"]
    text = (tmp_path / "mixed" / "report.md").read_text()
    assert ("- `attn=self`: code `0123456789ab` (1 runs), `0123456789ab -> fedcba987654+dirty` (1 runs); "
            f"torch `{ran['torch']}`; device `{ran['device']}` (**its runs differ in code; uncommitted changes: the "
            "commit does not name the code**)") in text
    assert "- `attn=offset`: code `0123456789ab` (1 runs), `unknown` (1 runs); " in text


def test_code_version_is_the_checkouts_commit_and_says_when_it_was_changed(tmp_path, monkeypatch):
    from suite import run_record

    def version_of(folder: Path):
        monkeypatch.setattr(run_record, "CHECKOUT", folder.resolve())
        run_record.code_version.cache_clear()
        try:
            return run_record.code_version()
        finally:
            run_record.code_version.cache_clear()

    repo = tmp_path / "repo"
    (repo / "suite").mkdir(parents=True)
    (repo / "suite" / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert version_of(repo) == commit[:12]
    (repo / "notes.txt").write_text("untracked files are not the code")
    assert version_of(repo) == commit[:12]
    (repo / "suite" / "code.py").write_text("x = 2\n")
    assert version_of(repo) == commit[:12] + "+dirty"
    assert version_of(repo / "suite") is None  # a copy inside another repository: not its commit
    assert version_of(tmp_path) is None  # no repository at all


def test_a_resumed_run_keeps_the_code_of_each_part(monkeypatch):
    from suite import run_record
    from suite.resume import FitRecord

    monkeypatch.setattr(run_record, "code_version", lambda: "bbbbbbbbbbbb")
    first = FitRecord(started=0.0)
    assert first.code() == ["bbbbbbbbbbbb"]
    resumed = FitRecord(started=0.0)
    resumed.load_state_dict({"seconds": 1.0, "metrics": {}, "code": ["aaaaaaaaaaaa"]})
    assert resumed.code() == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    again = FitRecord(started=0.0)  # requeued once more under the same code: one entry per version change
    again.load_state_dict({"seconds": 2.0, "metrics": {}, "code": resumed.code()})
    assert again.code() == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    old = FitRecord(started=0.0)  # a checkpoint from before the code was recorded
    old.load_state_dict({"seconds": 1.0, "metrics": {}})
    assert old.code() == [None, "bbbbbbbbbbbb"]

def test_default_metric_and_welch_when_the_seeds_differ(sweep, tmp_path, capsys):
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    # Say the second offset run had seed 5: the seed sets differ, so the runs cannot be paired.
    resolved = jobs[("offset", 1)] / "resolved_config.yaml"
    config = yaml.safe_load(resolved.read_text())
    config["seed"] = config["data"]["seed"] = 5
    if "seed" in config["task"]:  # the task's own copy (${seed}: the votes' scales), as a run with seed=5 has it
        config["task"]["seed"] = 5
    resolved.write_text(yaml.safe_dump(config))
    # Tiny runs may all score chance, which leaves nothing to test: give the copies' test/oa distinct values, so that
    # Welch's test on the default metric always runs (the report reads them as it reads any run's).
    for (attn, seed), oa in {("self", 0): 0.75, ("self", 1): 0.5, ("offset", 0): 0.25, ("offset", 1): 0.5}.items():
        path = jobs[(attn, seed)] / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "test/oa": oa}))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep"), baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["offset"]["seeds"] == [0, 5] and rows["offset"]["n"] == 2  # data.seed follows seed: one group
    metrics = {k: json.loads((j / "metrics.json").read_text()) for k, j in jobs.items()}
    name = "test/oa"  # the task's monitored metric, on the test split
    x = [metrics[("self", s)][name] for s in SEEDS]
    y = [metrics[("offset", s)][name] for s in SEEDS]
    row = rows["self"]
    assert row["metric"] == name and row["higher_is_better"] is True
    assert close(row["mean"], np.mean(x)) and close(row["best_of_n"], max(x))
    assert close(row["diff"], np.mean(x) - np.mean(y))
    expected = welch_by_hand(x, y)
    assert row["test"] == "Welch t" and 0 < expected["p"] < 1
    assert close(row["p_value"], expected["p"], rel=1e-6) and close(row["diff_ci_low"], expected["ci_low"])
    assert close(row["diff_ci_high"], expected["ci_high"])
    # Every run scoring the same leaves nothing to test, and no number pretends otherwise.
    for job in jobs.values():
        path = job / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "test/oa": 0.5}))
    same = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "same"), baseline="offset"))
    row = next(r for r in same["rows"] if r["attn"] == "self")
    assert row["diff"] == 0 and row["p_value"] is None and row["diff_ci_low"] is None
    assert "report written to" in capsys.readouterr().out


@pytest.mark.parametrize("confidence", [2, 0, 1, -0.5, "high", True])
def test_confidence_outside_zero_one_is_refused(confidence):
    with pytest.raises(UserError) as err:
        rep.report(cfg(confidence=confidence))  # refused before any run is read
    assert f"report.confidence={confidence!r}" in str(err.value) and "strictly between 0 and 1" in str(err.value)


def test_accuracy_outside_zero_one_is_left_out_naming_file_and_key(sweep, tmp_path):
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    wrong = jobs[("self", 1)] / "metrics.json"
    wrong.write_text(json.dumps({**json.loads(wrong.read_text()), "test/oa": 7.5}))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep"), baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["self"]["n"] == 1 and rows["self"]["seeds"] == [0]  # 7.5 is not averaged as an accuracy
    (left,) = document["left_out"]
    assert left["path"] == str(jobs[("self", 1)]) and str(wrong) in left["reason"] and "test/oa=7.5" in left["reason"]
    for job in jobs.values():  # every run out of range: one error naming each run, its file and key
        path = job / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "test/macc": -0.25}))
    with pytest.raises(UserError) as err:
        rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep2")))
    for job in jobs.values():
        assert f"{job}: metrics.json ({job / 'metrics.json'}) holds" in str(err.value)
    assert "test/macc=-0.25" in str(err.value)
    assert rep.is_fraction("val/oa_best") and rep.is_fraction("test/iou/Airplane") and not rep.is_fraction("test/fid")


@pytest.mark.parametrize("written", ["strict", "bare"])
def test_a_seed_that_diverged_is_named_in_its_row(sweep, tmp_path, written):
    """A run whose compared metric is NaN was only listed at the end of the report: its row showed the other seeds'
    mean as the variant's result, with nothing to say a seed of it had diverged. Both as run.py writes the NaN
    (null, named under "non_finite") and as records from before that hold it (Python's bare NaN token)."""
    from suite.run_record import metrics_text

    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    nan = jobs[("self", 1)] / "metrics.json"
    diverged = {**json.loads(nan.read_text()), "test/loss": math.nan}
    nan.write_text(metrics_text(diverged) if written == "strict" else json.dumps(diverged))
    assert ("NaN" in nan.read_text()) == (written == "bare")
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep"), metric="test/loss",
                              baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["self"]["seeds"] == [0] and rows["self"]["lost_seeds"] == [1] and rows["offset"]["lost_seeds"] == []
    (left,) = document["left_out"]
    assert left["path"] == str(jobs[("self", 1)]) and "no finite test/loss" in left["reason"]
    text = (tmp_path / "rep" / "report.md").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("| `attn=self` |")]
    assert "1 more seed(s) (1) ended with a non-finite test/loss, not in n" in line
    assert "non-finite" not in next(x for x in text.splitlines() if x.startswith("| `attn=offset` |"))


def test_runs_without_any_metric_are_listed_with_what_is_wrong(sweep, tmp_path):
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    for job in jobs.values():  # valid JSON, but no number in it
        (job / "metrics.json").write_text(json.dumps({"test/oa": "n/a", "protocol": {}}))
    with pytest.raises(UserError) as err:
        rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep")))
    message = str(err.value)
    assert "Metrics they have: none" not in message
    for job in jobs.values():
        assert f"{job}: no finite test/oa in its metrics" in message


def test_baseline_by_name_and_unknown_baseline(sweep, tmp_path):
    out, _ = sweep
    runs = str(out / "multirun")
    document = rep.report(cfg(runs=[runs], out=str(tmp_path / "a"), baseline="self", metric="test/loss"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["self"]["note"] == "baseline" and rows["offset"]["baseline"] == "attn=self"
    before = {r["attn"]: r for r in json.loads((out / "multirun" / "report" / "report.json").read_text())["rows"]}
    assert close(rows["offset"]["diff"], -before["self"]["diff"])  # the other way round: the same test
    assert close(rows["offset"]["p_value"], before["self"]["p_value"])
    with pytest.raises(UserError, match=r"report.baseline='softmax'.*Known variants: offset, self"):
        rep.report(cfg(runs=[runs], out=str(tmp_path / "b"), baseline="softmax"))


def test_bad_input_is_one_clear_error(sweep, tmp_path):
    out, _ = sweep
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    with pytest.raises(UserError, match="no runs under"):
        rep.report(cfg(runs=[str(empty)]))
    with pytest.raises(UserError, match="is not a folder"):
        rep.report(cfg(runs=[str(tmp_path / "missing")]))
    with pytest.raises(UserError, match="needs runs"):
        rep.report(cfg())
    with pytest.raises(UserError, match="report.metric="):
        rep.report(cfg(runs=[str(out / "multirun")], out=str(tmp_path / "o"), metric="test/nothing"))
    only_broken = out / "broken"  # every run there is left out: one error listing each, with its reason
    with pytest.raises(UserError, match="corrupt metrics.json") as err:
        rep.report(cfg(runs=[str(only_broken)]))
    assert str(only_broken / "crashed") in str(err.value)
    # Through run.py: exit code 2, one paragraph, no traceback.
    proc = run_py(["mode=report", f"report.runs={empty}", "logger=none", f"hydra.run.dir={tmp_path / 'h'}"],
                  tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no runs under" in proc.stderr and str(empty) in proc.stderr


# --- W&B ------------------------------------------------------------------------------------------------------------
class FakeWandbRun:
    """What the report reads of a ``wandb.apis.public.Run``: id, state, config, summary, scan_history."""

    def __init__(self, job: Path, state="finished"):
        self.id, self.state = job.name, state
        self.config = yaml.safe_load((job / "resolved_config.yaml").read_text())
        data = json.loads((job / "metrics.json").read_text())
        self.config["protocol"] = data.pop("protocol")  # run.py logs these as config
        self.config["provenance"] = data.pop("provenance")
        if "tested" in data:  # a test's
            self.config["tested"] = data.pop("tested")
        self.summary = {**data, "_runtime": 3.0, "media": {"_type": "image-file"}}
        with (job / "csv" / "metrics.csv").open() as f:
            self._rows = [{"trainer/global_step": float(r["step"]), **{k: float(v) for k, v in r.items()
                                                                      if v and k != "step"}}
                          for r in csv.DictReader(f)]

    def scan_history(self, keys):
        return [r for r in self._rows if all(k in r for k in keys)]


class FakeApi:
    def __init__(self, runs):
        self._runs, self.asked = runs, []

    def runs(self, path):
        self.asked.append(("runs", path))
        return self._runs

    def sweep(self, path):
        self.asked.append(("sweep", path))
        return type("Sweep", (), {"runs": self._runs})()


def test_report_from_wandb_matches_the_folders(sweep, tmp_path, monkeypatch):
    out, _ = sweep
    import wandb

    jobs = job_dirs(out / "multirun")
    fake = FakeApi([FakeWandbRun(j) for j in jobs.values()] + [FakeWandbRun(jobs[("self", 0)], state="running")])
    monkeypatch.setattr(wandb, "Api", lambda *a, **k: fake)
    document = rep.report(cfg(wandb="me/attention-suite/abc123", out=str(tmp_path), metric="test/loss",
                              plots=True))
    assert fake.asked == [("sweep", "me/attention-suite/abc123")]
    folders = json.loads((out / "multirun" / "report" / "report.json").read_text())
    for mine, theirs in zip(document["rows"], folders["rows"]):
        for key in ("variant", "n", "mean", "std", "ci_low", "ci_high", "diff", "p_value", "test", "params",
                    "flops", "protocol", "code", "torch", "device", "mixed"):
            assert close(mine[key], theirs[key]) if isinstance(theirs[key], float) else mine[key] == theirs[key]
    assert [x["reason"] for x in document["left_out"]] == ["W&B state running (crashed, stopped or still running)"]
    assert (tmp_path / "modelnet-shapes-curves.png").read_bytes().startswith(PNG)  # from W&B's history
    rep.report(cfg(wandb="me/attention-suite", out=str(tmp_path / "p"), metric="test/loss"))
    assert fake.asked[-1] == ("runs", "me/attention-suite")
    with pytest.raises(UserError, match="<entity>/<project>"):
        rep.report(cfg(wandb="just-a-name"))


def test_wandb_groups_tests_and_provenance_as_the_folders(sweep, tmp_path):
    """Read from W&B, the run record logged as config (protocol, provenance, a test's tested) split rows: a
    test counted under its command's seed 42 and grouped by its command's config, a row whose runs ran on two
    devices split in two (the folders: one row, flagged mixed). Both readers make the same rows."""
    out, _ = sweep
    trained = copy_runs(out, tmp_path / "runs" / "trained")
    set_config(trained[("self", 1)], trainer__max_epochs=1)
    make_tests(trained, tmp_path / "runs" / "tests", record_config=True)
    record = json.loads((trained[("offset", 1)] / "metrics.json").read_text())
    record["provenance"]["device"] = "another device"
    (trained[("offset", 1)] / "metrics.json").write_text(json.dumps(record))
    folders = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "folders"), baseline="offset"))
    fake = FakeApi([FakeWandbRun(job) for job in sorted((tmp_path / "runs").glob("*/*"))])
    from_wandb = rep.report(cfg(wandb="me/attention-suite", out=str(tmp_path / "wandb"), baseline="offset"), api=fake)

    def rows(document):
        return [(r["variant"], r["seeds"], r["mixed"], r["mean"]) for r in document["rows"]]

    assert rows(from_wandb) == rows(folders) and from_wandb["left_out"] == folders["left_out"] == []
    assert ("attn=offset mode=train trainer.max_epochs=2", [0, 1], ["device"]) == rows(folders)[0][:3]
    assert [r[:2] for r in rows(folders) if "mode=test" in r[0]] == [
        ("attn=self mode=test trainer.max_epochs=1", [1]), ("attn=self mode=test trainer.max_epochs=2", [0])]


def test_a_seed_that_is_not_one_number_is_left_out_said(sweep, tmp_path):
    """A list as a run's seed (a hand-edited config, a malformed tested.seed) ended the report in a TypeError
    traceback; such a record is left out, named, with what is wrong (one bad record does not cost the others)."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    set_config(jobs[("self", 1)], seed=[0, 1])
    tests = make_tests(jobs, tmp_path / "tests", record_config=True)
    record = json.loads((tests[0] / "metrics.json").read_text())
    record["tested"]["seed"] = [0, 1]
    (tests[0] / "metrics.json").write_text(json.dumps(record))
    document = rep.report(cfg(runs=[str(tmp_path / "runs"), str(tests[0])], out=str(tmp_path / "rep")))
    assert {x["path"]: x["reason"] for x in document["left_out"]} == {
        str(path): f"seed [0, 1] ({path / 'metrics.json'} or {path / 'resolved_config.yaml'}) is not one integer, "
                   "as `python run.py seed=<n>` records it (a hand-edited or corrupt record): a row counts its runs "
                   "by seed; fix or remove the record" for path in (jobs[("self", 1)], tests[0])}
    assert {r["attn"]: r["seeds"] for r in document["rows"]} == {"offset": [0, 1], "self": [0]}


def test_small_values_keep_their_digits(sweep, tmp_path):
    """KID (about 1e-3) printed to 4 decimals read 0.0007 ± 0.0000 in both rows, and the difference -0.0000 beside
    "differs". A row whose mean is below 0.01 keeps 4 significant digits; a difference the row's decimals round to
    zero gets its own; ordinary values print as before (0.7200 ± 0.0800)."""
    assert [rep.places(v) for v in (0.72, 0.01, 0.0099, 7.123e-4, 0.0, math.nan, -3e-6)] == [4, 4, 6, 7, 4, 4, 9]
    row = {"mean": 0.72, "diff": 0.0511, "diff_ci_low": -0.0936, "diff_ci_high": 0.1958}
    assert rep.fmt_diff(row) == "+0.0511 [-0.0936, 0.1958]"  # as docs/results/compare/report.md prints it
    assert rep.fmt_diff({**row, "diff": -2e-5, "diff_ci_low": -3e-5, "diff_ci_high": -1e-5}) == (
        "-0.00002000 [-0.00003000, -0.00001000]")
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    kid = {("offset", 0): 7.10e-4, ("offset", 1): 7.30e-4, ("self", 0): 6.80e-4, ("self", 1): 6.95e-4}
    for key, value in kid.items():
        record = json.loads((jobs[key] / "metrics.json").read_text())
        record["test/kid"] = value
        (jobs[key] / "metrics.json").write_text(json.dumps(record))
    rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep"), metric="test/kid", baseline="offset"))
    text = (tmp_path / "rep" / "report.md").read_text()
    self_values = [kid[("self", s)] for s in SEEDS]
    mine, diff = by_hand(self_values), paired_by_hand(self_values, [kid[("offset", s)] for s in SEEDS])
    assert (f"| `attn=self` | 2 | 0, 1 | {mine['mean']:.7f} ± {mine['std']:.7f} | [{mine['ci_low']:.7f}, "
            f"{mine['ci_high']:.7f}] | 0.0006800 | 0.0006950 | 0.0006800 | `attn=offset` | {diff['diff']:+.7f} "
            f"[{diff['ci_low']:.7f}, {diff['ci_high']:.7f}] |") in text


def test_holm_adjusts_each_tables_p_values(sweep, tmp_path):
    """Each row's "differs (p < 0.05)" was judged alone: with six variants against one baseline a false one is
    likely. Holm's step-down adjustment by hand: sorted p 0.01, 0.02, 0.04 (m = 3) -> 0.03, max(0.03, 0.04),
    max(0.04, 0.04); NaN (no test) is not in the family. Each table is a family; the verdict is the adjusted p's."""
    assert rep.holm([0.04, math.nan, 0.01, 0.02]) == pytest.approx([0.04, math.nan, 0.03, 0.04], nan_ok=True)
    assert rep.holm([0.3, 0.5]) == pytest.approx([0.6, 0.6]) and rep.holm([0.9, 0.8]) == [1.0, 1.0]
    assert rep.holm([]) == [] and rep.holm([0.2]) == [0.2]
    # The committed docs/results/compare/report.json: six p-values against offset, and the column made of them.
    committed = json.loads((ROOT / "docs" / "results" / "compare" / "report.json").read_text())["rows"]
    adjusted = dict(zip([r["variant"] for r in committed],
                        rep.holm([math.nan if r["p_value"] is None else r["p_value"] for r in committed])))
    assert {r["variant"]: r["p_holm"] for r in committed if r["p_holm"] is not None} == pytest.approx(
        {k: v for k, v in adjusted.items() if not math.isnan(v)})
    p_values = {r["variant"]: r["p_value"] for r in committed if r["p_value"] is not None}
    smallest = min(p_values.values())  # linear_taylor's 0.33, as README.md and docs/recipes.md say: 6 x 0.33 > 1
    assert p_values["attn=linear_taylor"] == smallest and round(smallest, 2) == 0.33
    assert adjusted["attn=linear_taylor"] == min(1.0, 6 * smallest) == 1.0
    rows = [{"task": "t", "data": "d", "metric": "m", "p_value": p, "note": rep.verdict(p, 0.05)}
            for p in (0.01, 0.02, 0.04, math.nan)]
    rows[3]["note"] = "baseline"
    rep.judge_per_table(rows, 0.05)
    assert [r["note"] for r in rows] == ["differs (Holm p < 0.05)", "differs (Holm p < 0.05)",
                                         "differs (Holm p < 0.05)", "baseline"]
    rows = [{"task": "t", "data": "d", "metric": "m", "p_value": p, "note": rep.verdict(p, 0.05)}
            for p in (0.01, 0.02, 0.045, math.nan, 0.6)]
    rows[3]["note"] = "n < 3: too few runs to conclude"
    rep.judge_per_table(rows, 0.05)  # m = 4: 0.04, 0.06, 0.09, 0.6 -> only the first survives
    assert [r["note"] for r in rows][:3] == ["differs (Holm p < 0.05)"] + ["no significant difference"] * 2
    assert [r["p_holm"] for r in rows] == pytest.approx([0.04, 0.06, 0.09, math.nan, 0.6], nan_ok=True)
    out, _ = sweep  # through the report: the column, and in report.csv / report.json
    document = rep.report(cfg(runs=[str(out / "multirun")], out=str(tmp_path / "rep"), baseline="offset"))
    assert [r["p_holm"] for r in document["rows"]] == [r["p_value"] for r in document["rows"]]  # a family of one
    with (tmp_path / "rep" / "report.csv").open() as f:
        assert [r["p_holm"] for r in csv.DictReader(f)] == ["nan", "nan" if document["rows"][1]["p_value"] is None
                                                            else str(document["rows"][1]["p_value"])]
    assert "| p | p (Holm) | note |" in (tmp_path / "rep" / "report.md").read_text()


# --- the pure parts ---------------------------------------------------------------------------------------------------
def test_statistics_edge_cases():
    one = rep.describe([0.5])
    assert one["n"] == 1 and math.isnan(one["std"]) and math.isnan(one["ci_low"]) and one["best_of_n"] == 0.5
    three = rep.describe([1.0, 2.0, 4.0], higher_is_better=False)
    assert three["std"] == pytest.approx(math.sqrt(7 / 3)) and three["best_of_n"] == 1.0
    c = rep.compare([(0, 1.0), (1, 2.0), (2, 3.5)], [(0, 0.5), (1, 1.0), (2, 2.0)])
    expected = paired_by_hand([1.0, 2.0, 3.5], [0.5, 1.0, 2.0])
    assert c["test"] == "paired t" and c["p_value"] == pytest.approx(expected["p"]) and c["note"] != "n < 3"
    lone = rep.compare([(0, 1.0)], [(0, 0.5), (1, 0.7)])
    assert lone["test"] == "none" and math.isnan(lone["p_value"]) and "too few" in lone["note"]
    # FLOPs lower-better, accuracy higher-better: (1, .9) and (3, .95) are the front; (2, .8) and (4, .95) are not.
    assert rep.pareto_front([2, 1, 3, 4], [0.8, 0.9, 0.95, 0.95]) == [1, 2]
    assert rep.pareto_front([10, 20, 5], [1.0, 2.0, 3.0], x_lower_is_better=False) == [2, 1]  # throughput, higher


def test_protocol_per_task():
    gan = {"task": {"name": "gan"}, "data": {"_target_": "datamodules.CIFAR10"}, "monitor": {"metric": "val/fid",
           "mode": "min"}, "metrics": {"num_samples": 10000, "inception_weights": None, "isc_splits": 1},
           "eval": {"num_samples": None}, "ema": {"enabled": True}}
    p = protocol(gan, "/x/checkpoints/best-epoch000-step002000.ckpt")
    assert p["checkpoint"] == "best val/fid (min)" and p["feature_extractor"] == "inception-v3-compat"
    assert p["fid_reference"] == "train split" and p["ema"] is True
    seg = {"task": {"name": "segmentation"}, "data": {"_target_": "datamodules.VOC"}, "mode": "test",
           "ckpt_path": "run/checkpoints/last.ckpt", "eval": {"mode": "slide", "scales": [0.5, 1.0], "flip": True}}
    p = protocol(seg)
    assert p["checkpoint"] == "last" and p["split"] == "val" and p["selected_on"] == "test"
    assert p["eval_mode"] == "slide" and p["scales"] == [0.5, 1.0] and p["flip"] is True
    pct = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.ModelNet40", "val_fraction": 0.0}}
    assert protocol(pct)["selected_on"] == "test"  # PCT's reference validates on the test split
    # The data module's class says whether its "test" split is its validation split (no public test labels).
    for target, split in (("datamodules.classification.imagenet.ImageNet", "val"),  # inherited from folders
                          ("datamodules.points.shapes.Shapes", "test"), ("no.such.DataModule", "test")):
        p = protocol({"task": {"name": "classification"}, "data": {"_target_": target}})
        assert p["split"] == split and p["selected_on"] == ("test" if split == "val" else "val"), target


def test_a_test_of_part_of_the_split_says_so_in_its_protocol():
    """Test metrics over part of the test split (`++trainer.limit_test_batches`, `trainer.fast_dev_run`) were
    recorded as the whole split's, and mode=report averaged them with whole-split runs: the protocol differs now."""
    base = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.points.shapes.Shapes"}}
    for trainer, part in (({}, None), ({"limit_test_batches": 1.0}, None), ({"limit_test_batches": None}, None),
                          ({"limit_test_batches": 0.25}, "first 25% of the batches (trainer.limit_test_batches=0.25)"),
                          ({"limit_test_batches": 3}, "first 3 batches (trainer.limit_test_batches=3)"),
                          ({"fast_dev_run": True}, "1 batch (trainer.fast_dev_run)"),
                          ({"fast_dev_run": 2}, "2 batches (trainer.fast_dev_run)"),
                          ({"fast_dev_run": False, "limit_test_batches": 1.0}, None)):
        assert protocol({**base, "trainer": trainer}).get("tested_part") == part, trainer
    # Under DDP a limit is each process's, on its strided share: not the first batches, and more of them.
    for trainer, part in (({"limit_test_batches": 3}, "3 batches of each of 2 processes' shares "
                           "(trainer.limit_test_batches=3)"),
                          ({"limit_test_batches": 0.25}, "25% of the batches of each of 2 processes' shares "
                           "(trainer.limit_test_batches=0.25)"),
                          ({"fast_dev_run": True}, "1 batch of each of 2 processes' shares (trainer.fast_dev_run)"),
                          ({"limit_test_batches": 1.0}, None)):
        assert protocol({**base, "trainer": trainer}, world_size=2).get("tested_part") == part, trainer
    gan = {"task": {"name": "gan"}, "trainer": {"limit_test_batches": 2}, "metrics": {}, "eval": {}}
    assert protocol(gan)["tested_part"] == "first 2 batches (trainer.limit_test_batches=2)"
    # The checkpoint chosen on part of the validation split says so too.
    p = protocol({**base, "trainer": {"limit_val_batches": 0.5}})
    assert p["selected_on_part"] == "first 50% of the batches (trainer.limit_val_batches=0.5)"
    assert "tested_part" not in p and "selected_on_part" not in protocol({**base, "trainer": {}})
    # Both parts: the test part hid the validation part (an elif), and such runs grouped with full validations.
    p = protocol({**base, "trainer": {"limit_val_batches": 1, "limit_test_batches": 2}})
    assert p["tested_part"] == "first 2 batches (trainer.limit_test_batches=2)"
    assert p["selected_on_part"] == "first 1 batches (trainer.limit_val_batches=1)"


def test_the_protocol_says_where_the_checkpoint_was_chosen(tmp_path):
    """`data=shapes data.val_per_class=0` validates on the test split, but its config has no val_fraction: the
    protocol said selected_on=val. The data module, set up, now says. And `mode=test` of another run's best
    checkpoint recorded this command's monitor and validation (`best val/oa (max)` for a checkpoint chosen by
    val/loss): the run that chose it says now, from its metrics.json or else its resolved_config.yaml."""
    from datamodules.points.shapes import Shapes
    from suite.run_record import checkpoint_origin
    from suite.train import validates_on_test

    tiny = dict(num_classes=2, train_per_class=4, test_per_class=2, npoints=16, batch_size=2)
    for val_per_class, on_test in ((0, True), (2, False)):
        shapes = Shapes(val_per_class=val_per_class, **tiny)
        shapes.setup("fit")
        assert validates_on_test(shapes) is on_test
        config = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.points.shapes.Shapes",
                                                         "val_per_class": val_per_class}}
        assert protocol(config, val_is_test=validates_on_test(shapes))["selected_on"] == ("test" if on_test else "val")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    best = str(run / "checkpoints" / "best-epoch001-step000020.ckpt")
    trained = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.points.shapes.Shapes"},
               "monitor": {"metric": "val/loss", "mode": "min"}, "trainer": {"limit_val_batches": 0.5}}
    (run / "resolved_config.yaml").write_text(yaml.safe_dump(trained))
    command = {**trained, "mode": "test", "ckpt_path": best, "monitor": {"metric": "val/oa", "mode": "max"},
               "trainer": {}}
    assert protocol(command, best)["checkpoint"] == "best val/oa (max)"  # what this command alone says
    origin = checkpoint_origin(best)  # no metrics.json (a run killed before its end): its config
    p = protocol(command, best, chosen_in=origin)
    assert p["checkpoint"] == "best val/loss (min)" and p["selected_on"] == "val"
    assert p["selected_on_part"] == "first 50% of the batches (trainer.limit_val_batches=0.5)"
    recorded = {"checkpoint": "best val/loss (min)", "split": "test", "selected_on": "test"}
    (run / "metrics.json").write_text(json.dumps({"test/oa": 0.5, "protocol": recorded}))
    p = protocol(command, best, chosen_in=checkpoint_origin(best))  # its record, which its data module told
    assert p["checkpoint"] == "best val/loss (min)" and p["selected_on"] == "test" and "selected_on_part" not in p
    assert checkpoint_origin(str(tmp_path / "elsewhere.ckpt")) is None
    assert protocol(command, str(run / "checkpoints" / "last.ckpt"), chosen_in=recorded)["checkpoint"] == "last"


def test_report_runs_with_commas_become_a_list():
    from suite.cli import quote_report_runs

    assert quote_report_runs(["report.runs=/a/b,/c d/e:1", "attn=self,offset", "report.runs=[x]"]) == [
        "report.runs=['/a/b','/c d/e:1']", "attn=self,offset", "report.runs=[x]"]


def test_the_report_goes_to_wandb_when_wandb_is_on():
    """report.log_wandb=null: logged when the runs come from W&B and logger=wandb; true/false as set."""
    def config(log_wandb, wandb, logger):
        return OmegaConf.create({"report": {"log_wandb": log_wandb, "wandb": wandb}, "logger": {"name": logger}})

    assert rep.logs_to_wandb(config(None, "me/attention-suite", "wandb"))
    assert not rep.logs_to_wandb(config(None, None, "wandb"))  # runs from folders: nothing read from W&B
    assert not rep.logs_to_wandb(config(None, "me/attention-suite", "none"))
    assert rep.logs_to_wandb(config(True, None, "none")) and not rep.logs_to_wandb(config(False, "e/p", "wandb"))


def test_log_wandb_logs_the_table_and_plots(sweep, tmp_path, monkeypatch):
    out, _ = sweep
    import wandb

    logged, inits = {}, []

    class FakeRun:
        def log(self, data):
            logged.update(data)

        def finish(self):
            logged["finished"] = True

    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or FakeRun())
    config = cfg(runs=[str(out / "multirun")], out=str(tmp_path), plots=True, log_wandb=True)
    config.logger = {"name": "wandb", "project": "attention-suite", "entity": None, "mode": "offline"}
    rep.report(config)
    assert inits[0]["job_type"] == "report" and inits[0]["mode"] == "offline"
    assert len(logged["report"].data) == 2 and logged["finished"]
    assert {"modelnet-shapes-flops", "modelnet-shapes-throughput", "modelnet-shapes-curves"} <= set(logged)


# --- which rows are compared, and how ---------------------------------------------------------------------------------
def set_config(job: Path, **values) -> None:
    """Set dotted keys of a run folder's resolved_config.yaml (``trainer__max_epochs=50``: trainer.max_epochs)."""
    path = job / "resolved_config.yaml"
    config = OmegaConf.create(yaml.safe_load(path.read_text()))
    for key, value in values.items():
        OmegaConf.update(config, key.replace("__", "."), value, merge=True, force_add=True)
    path.write_text(yaml.safe_dump(OmegaConf.to_container(config)))


def test_a_row_is_compared_only_with_a_baseline_under_its_settings(sweep, tmp_path):
    """All self runs at 50 epochs, all offset runs at 2: the self row was compared with offset and credited with
    the difference the epochs made (its label did not even show them, attn=self determining them). Now the label
    shows every varying key outside attn, and a row without a baseline under the same ones says so."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    for seed in SEEDS:
        set_config(jobs[("self", seed)], trainer__max_epochs=50)
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "a"), baseline="offset"))
    rows = {row["attn"]: row for row in document["rows"]}
    assert rows["self"]["variant"] == "attn=self trainer.max_epochs=50"
    assert rows["self"]["note"] == "no offset runs with trainer.max_epochs=50 to compare with"
    assert rows["self"]["diff"] is None and rows["offset"]["note"] == "baseline"  # NaN in JSON
    for seed in SEEDS:  # offset at 50 epochs too: the self row is compared with it, not with offset at 2
        shutil.copytree(jobs[("offset", seed)], tmp_path / "runs" / f"offset-50-{seed}")
        set_config(tmp_path / "runs" / f"offset-50-{seed}", trainer__max_epochs=50)
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "b"), baseline="offset"))
    rows = {row["variant"]: row for row in document["rows"]}
    assert rows["attn=self trainer.max_epochs=50"]["baseline"] == "attn=offset trainer.max_epochs=50"
    assert rows["attn=offset trainer.max_epochs=2"]["note"] == "baseline"


def test_several_baseline_rows_are_named_not_compared_with(sweep, tmp_path):
    """Offset runs with one head and with four: which is the baseline is the user's choice. Every row said "no
    offset runs with this protocol to compare with", which was not so; it now names the rows to choose from."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    for seed in SEEDS:
        shutil.copytree(jobs[("offset", seed)], tmp_path / "runs" / f"offset-4-{seed}")
        set_config(tmp_path / "runs" / f"offset-4-{seed}", attn__heads=4)
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "a"), baseline="offset"))
    rows = {row["variant"]: row for row in document["rows"]}
    assert rows["attn=self attn.heads=4"]["note"] == ("2 offset rows (attn=offset attn.heads=1; attn=offset "
                                                      "attn.heads=4): choose one with report.baseline=<its label>")
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "b"),
                              baseline="attn=offset attn.heads=4"))
    rows = {row["variant"]: row for row in document["rows"]}
    assert rows["attn=self attn.heads=4"]["baseline"] == "attn=offset attn.heads=4"


def test_what_splits_rows_and_what_does_not(sweep, tmp_path):
    """Seeds re-run with a progress bar, another logging interval, overwrite=true or more loader workers were put
    in rows of their own (a 4-seed comparison became two rows of 3 and 1, and lost its pairing); weights files were
    compared by path (one run per machine, one row per machine) or not at all (`model.weights`: runs fine-tuned from
    published weights averaged with runs from scratch); every callback was ignored (stochastic weight averaging
    averaged with plain training)."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    set_config(jobs[("self", 0)], trainer__enable_progress_bar=True, trainer__log_every_n_steps=7, overwrite=True,
               data__num_workers=3, model__weights="/cluster-a/weights/pct_model.t7")
    set_config(jobs[("self", 1)], model__weights="/home/me/pct_model.t7")
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "a"), baseline="offset"))
    rows = {row["variant"]: row for row in document["rows"]}
    assert rows["attn=self model.weights=pct_model.t7"]["seeds"] == [0, 1]
    assert rows["attn=offset model.weights=null"]["seeds"] == [0, 1]
    assert rows["attn=self model.weights=pct_model.t7"]["note"] == "no offset runs with model.weights=pct_model.t7 " \
                                                                   "to compare with"
    set_config(jobs[("self", 1)], model__weights="/cluster-a/weights/pct_model.t7",
               callbacks__swa___target_="lightning.pytorch.callbacks.StochasticWeightAveraging")
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "b"), baseline="offset"))
    assert sorted(row["variant"].split(" ", 1)[-1] for row in document["rows"] if row["attn"] == "self") == [
        'callbacks.swa._target_=<unset> model.weights=pct_model.t7',
        'callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging model.weights=pct_model.t7']


def test_runs_on_two_folders_of_images_are_two_data_sets():
    """Class folders (data=folder_cls) and image folders (the GAN's data=image_folder) are whatever data.root names:
    runs on /data/flowers and /data/pets were one table, their scores averaged. A published data set found at
    another path on another machine stays one."""
    from suite.run_record import data_name

    folders = "datamodules.classification.folder.FolderClassification"
    assert data_name({"data": {"_target_": folders, "root": "/data/flowers/"}}) == "FolderClassification(flowers)"
    assert data_name({"data": {"_target_": folders, "root": "/data/pets"}}) == "FolderClassification(pets)"
    images = "datamodules.generation.image_folder.ImageFolder"
    assert data_name({"data": {"_target_": images, "root": "~/faces"}}) == "ImageFolder(faces)"
    assert data_name({"data": {"_target_": "datamodules.segmentation.voc.VOC", "root": "/scratch/me"}}) == "VOC"


def test_each_metric_is_judged_in_its_own_direction():
    """KID is a distance and `train/loss_epoch` a loss: both counted as higher-better, so their best of n was the
    worst seed. The task's declared directions (Task.validation_metrics) decide, then the name."""
    gan = {"task": {"_target_": "tasks.gan.GAN", "name": "gan"}, "metrics": {"kid": True, "prc": True},
           "monitor": {"metric": "val/fid", "mode": "min"}}
    lower = ["test/kid", "val/kid_best", "test/fid", "train/loss_epoch", "train/loss_step", "train/loss_d",
             "train/loss_aux"]
    assert not any(rep.higher_is_better(name, gan) for name in lower)
    assert all(rep.higher_is_better(name, gan) for name in ["test/is", "test/precision", "test/recall"])
    modelnet = {"task": {"_target_": "tasks.modelnet.PointCloudClassification"}, "monitor": {"metric": "val/loss",
                "mode": "min"}}
    assert not rep.higher_is_better("test/loss", modelnet) and rep.higher_is_better("test/macc", modelnet)
    assert rep.describe([0.01, 0.04, 0.02], rep.higher_is_better("test/kid", gan))["best_of_n"] == 0.01
    # The learning rate, a spread over splits, D's mean outputs: no better direction, so no best of n (it was the
    # largest learning rate, the widest IS spread).
    for name in ["train/lr-SGD", "train/lr-AdamW/pg1", "test/is_std", "val/kid_std", "train/d_real", "epoch"]:
        assert rep.higher_is_better(name, gan) is None, name
        assert math.isnan(rep.describe([0.1, 0.3], rep.higher_is_better(name, gan))["best_of_n"])
    assert rep.higher_is_better("test/is", gan) is True and rep.higher_is_better("test/lr_like", gan) is True


def test_values_without_spread_get_no_test():
    """Identical values on both sides had a paired t with the interval [0, 0]; constant sides differing had a Welch
    p < 0.001 from scipy's infinite t, beside an interval of n/a. The docs promise no made-up p."""
    same = rep.compare([(0, 0.5), (1, 0.5), (2, 0.5)], [(0, 0.5), (1, 0.5), (2, 0.5)])
    apart = rep.compare([(0, 1.0), (1, 1.0), (2, 1.0)], [(3, 0.5), (4, 0.5), (5, 0.5)])
    shifted = rep.compare([(0, 0.6), (1, 0.7), (2, 0.8)], [(0, 0.5), (1, 0.6), (2, 0.7)])  # differences all 0.1
    for c in (same, apart, shifted):
        assert c["test"] == "none" and math.isnan(c["p_value"]) and math.isnan(c["ci_low"]), c
        assert c["note"] == "no spread over the seeds: no test"
    assert apart["diff"] == 0.5 and shifted["diff"] == pytest.approx(0.1)


def test_an_output_folder_that_cannot_be_one_and_a_foreign_config_are_said(sweep, tmp_path):
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"report.out=.*afile is a file, not a folder"):
        rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "afile")))
    with pytest.raises(UserError, match=r"report.out=.*/under cannot be created"):
        rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "afile" / "under")))
    config = yaml.safe_load((jobs[("self", 1)] / "resolved_config.yaml").read_text())
    (jobs[("self", 1)] / "resolved_config.yaml").write_text(yaml.safe_dump({**config, "task": "modelnet"}))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "rep")))
    assert document["left_out"] == [{"path": str(jobs[("self", 1)]), "reason": (
        "resolved_config.yaml's task not a mapping, as run.py writes it (a hand-edited or foreign file): fix or "
        "remove it")}]


def test_a_p_value_is_printed_on_its_side_of_the_level():
    """p = 0.04997 was printed 0.050 beside "differs (p < 0.05)"."""
    assert rep.fmt_p(0.04997, 0.05) == "0.04997" and rep.fmt_p(0.0503, 0.05) == "0.050"
    assert rep.fmt_p(0.0999, 0.1) == "0.0999" and rep.fmt_p(0.2, 0.05) == "0.200"
    assert rep.fmt_p(0.0004, 0.05) == "< 0.001" and rep.fmt_p(math.nan, 0.05) == "n/a"


def test_runs_chosen_by_different_monitors_get_a_table_each(sweep, tmp_path):
    """The self runs chose their checkpoints by val/loss, the offset runs by val/oa: each row compares its own
    metric (test/loss, test/oa), and they shared one table under the first row's title and direction ("test/oa
    (higher is better)" over a row of test/loss values) and one set of plots. Now a table and plots per metric."""
    out, _ = sweep
    jobs = copy_runs(out, tmp_path / "runs")
    for seed in SEEDS:
        set_config(jobs[("self", seed)], monitor__metric="val/loss", monitor__mode="min")
        record = json.loads((jobs[("self", seed)] / "metrics.json").read_text())
        record["protocol"]["checkpoint"] = "best val/loss (min)"
        (jobs[("self", seed)] / "metrics.json").write_text(json.dumps(record))
    document = rep.report(cfg(runs=[str(tmp_path / "runs")], out=str(tmp_path / "a"), plots=True))
    assert {row["attn"]: row["metric"] for row in document["rows"]} == {"self": "test/loss", "offset": "test/oa"}
    text = (tmp_path / "a" / "report.md").read_text()
    tables = {part.split("\n", 1)[0]: part for part in text.split("\n## ")[1:]}
    oa, loss = tables["modelnet on Shapes: test/oa (higher is better)"], tables["modelnet on Shapes: test/loss "
                                                                                 "(lower is better)"]
    assert "| `attn=offset " in oa and "`attn=self " not in oa
    assert "| `attn=self " in loss and "| `attn=offset " not in loss
    assert "(modelnet-shapes-test_oa-flops.png)" in oa and "(modelnet-shapes-test_loss-flops.png)" in loss
    assert (tmp_path / "a" / "modelnet-shapes-test_loss-flops.png").is_file()


def test_a_curve_has_one_value_a_step_the_resumed_runs():
    """A run SIGKILLed after its last checkpoint and resumed logs the steps since that checkpoint again; W&B's history
    keeps both, and the report's learning curve counted those steps twice, as two seeds would be."""
    from suite.report import Run, learning_curve

    class History:  # what a W&B run's scan_history gives, in logged order
        def scan_history(self, keys):
            rows = [(10, 0.5), (20, 0.6), (30, 0.2), (20, 0.65), (30, 0.7), (40, 0.75)]  # killed at 30, resumed at 10
            return [{"trainer/global_step": step, keys[0]: value} for step, value in rows]

    run = Run(path="wandb:e/p/id", config={}, metrics={}, cost={}, protocol={}, history=History())
    assert learning_curve(run, "val/oa") == [(10.0, 0.5), (20.0, 0.65), (30.0, 0.7), (40.0, 0.75)]
