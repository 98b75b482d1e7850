"""``run.py mode=bench``: the outputs are well formed (never the timings), the exponent fit is exact on
synthetic data, and sizes over the memory budget are estimated, skipped and marked without running."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attention
from benchmarks import cost, measure
from benchmarks.baselines import BASELINES
from fixture_cache import once_per_worker
import warm_python

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------

def test_fit_exponent_is_exact_on_power_laws():
    ns = [256, 1024, 4096, 16384]
    assert measure.fit_exponent(ns, [3e-6 * n ** 1.5 for n in ns]) == pytest.approx(1.5, abs=1e-12)
    assert measure.fit_exponent(ns, [7.0 * n ** 2 for n in ns]) == pytest.approx(2.0, abs=1e-12)
    assert measure.fit_exponent(ns, [0.5] * 4) == pytest.approx(0.0, abs=1e-12)
    # least squares, not the end points: one point off the line moves the slope by its share
    assert measure.fit_exponent([1, 2, 4], [1, 2 * 2 ** 0.5, 4]) == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(measure.fit_exponent([256], [1.0]))
    assert math.isnan(measure.fit_exponent([256, 1024], [1.0, None]))


def test_estimate_calibrates_fake_counts_and_extrapolates():
    seen = cost.Measured()
    assert seen.estimate(256, None) == (None, None)  # nothing known: the smallest size runs
    assert seen.estimate(256, {"peak": 100, "flops": 1, "bytes_moved": 1}) == (150, None)  # 1.5x safety
    seen.add(1024, 0.01, 2e6, {"peak": 1e6, "flops": 1e9, "bytes_moved": 1e8})
    # the fake estimate scaled by what the last size measured against its own estimate (2x), with a 1.2 margin...
    peak, seconds = seen.estimate(4096, {"peak": 4e6, "flops": 16e9, "bytes_moved": 4e8})
    assert peak == pytest.approx(1.2 * 8e6)
    assert seconds == pytest.approx(0.16)  # ... and time by the larger growth of FLOPs and bytes
    # without a fake count: the last two sizes' slope, at least linear, with a 1.25 margin on memory
    seen.add(4096, 0.04, 8e6, None)
    peak, seconds = seen.estimate(16384, None)
    assert peak == pytest.approx(1.25 * 8e6 * 4)
    assert seconds == pytest.approx(0.16)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fake_count_matches_a_real_step(one_thread):
    mixer = cost.build_mixer("external", 64)
    fake = cost.fake_count(mixer, 1024, "grid", 1, "cpu", torch.float32)
    real = cost.Case(mixer, 1024, "grid", 1, "cpu", torch.float32).count()
    assert fake["flops"] == real["flops"] > fake["flops_fwd"] == real["flops_fwd"] > 0
    assert fake["bytes_moved"] == real["bytes_moved"] > 0
    assert fake["peak"] == real["peak"] > 0


def test_over_budget_sizes_are_skipped_and_marked_without_running(monkeypatch, one_thread):
    mixer = cost.build_mixer("materialised", 64)
    n = 65536
    fake = cost.fake_count(mixer, n, "points", 1, "cpu", torch.float32)
    assert fake["peak"] >= mixer.heads * n * n * 4  # the N x N matrix is in the estimate: 64 GiB
    ran = []
    real_measure = cost.measure_case
    monkeypatch.setattr(cost, "measure_case", lambda case, *a: ran.append(len(case.layout)) or real_measure(case, *a))
    s = {"sizes": [256, n], "batch": 1, "warmup": 1, "repeats": 1, "min_seconds": 0, "max_seconds": 1e9}
    rows = cost.sweep_sizes(mixer, "materialised", "baseline", "points", 64, "float32", torch.float32, s,
                            torch.device("cpu"), max_bytes=64 * measure.MiB)
    assert ran == [256]
    small, big = rows
    assert small["status"] == "ok" and small["time_ms"] > 0 and small["peak_mib"] > 0
    assert big["status"] == "skipped: memory" and "max_gb" in big["note"]
    assert big["est_peak_mib"] * measure.MiB >= fake["peak"] and big.get("time_ms") is None
    assert big["flops"] == fake["flops"]  # counted on fake tensors all the same


def bench_settings(*overrides: str) -> dict:
    """``cost.settings`` as ``run.py mode=bench`` makes them: the command line's paths win over bench.quick's."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return cost.settings(compose("config", overrides=["mode=bench", *overrides]), cost.given_paths(overrides))


def run_bench(tmp_path, *args, small_limits=True, timeout=300):
    """``run.py mode=bench`` at its smallest (one variant, one size, one step), in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PYTEST_"))}
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    small = ["mode=bench", "bench.device=cpu", "logger=none", "bench.variants=[self]", "bench.baselines=[]",
             "bench.layouts=[grid]", "bench.sizes=[256]", "bench.channels=[64]", "bench.warmup=1", "bench.repeats=1",
             "bench.min_seconds=0", f"hydra.run.dir={tmp_path}/run"]
    small += ["bench.limits={matmul:256,copy_mb:8,repeats:1}"] if small_limits else []
    return warm_python.run([sys.executable, str(ROOT / "run.py"), *small, *args], cwd=tmp_path, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def test_bench_options_are_taken_and_a_variant_that_cannot_be_built_is_refused():
    """bench.options={dilated:{heads:4}}, configs/bench/default.yaml's own example, composes (Hydra refused it,
    adding a key to a {}) and builds dilated with 4 heads. An option's typo, or a C the heads do not divide, is refused
    at the start: the sweep left such a variant out of the table with a log line, and the run exited 0."""
    from attention.errors import UserError

    s = bench_settings("bench.options={dilated:{heads:4},materialised:{heads:2}}", "bench.channels=[64]")
    assert cost.build_mixer("dilated", 64, s["options"]).heads == 4
    assert cost.build_mixer("materialised", 64, s["options"]).heads == 2
    assert cost.build_mixer("self", 64, s["options"]).heads == 4  # configs/attn/self.yaml's, as given
    for overrides, needle in ((["bench.options={external:{head:2}}"], "attn.head"),
                              (["bench.options={materialised:{bogus:1}}"], "no option bogus"),
                              (["bench.channels=[63]", "bench.variants=[self]", "bench.baselines=[]"],
                               "self at C=63")):
        with pytest.raises(UserError, match=needle):
            bench_settings(*overrides)


def test_bench_options_one_at_a_time_and_the_dotted_form_refused_naming_it(tmp_path):
    """bench.options.external.heads=5 was refused as "bench.options has no key 'external'", with no word of the form
    that works (++, as for any key the config lacks: bench.options is null so that the dict form composes). The
    message now gives both forms; ++ sets one option, and a baseline's entry its own, the rest following its
    variant."""
    proc = run_bench(tmp_path, "bench.options.external.heads=5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "`python run.py mode=bench ++bench.options.external.heads=5`" in proc.stderr, proc.stderr
    assert "'bench.options={external:{heads:5}}'" in proc.stderr, proc.stderr
    s = bench_settings("++bench.options.external.heads=2", "++bench.options.dilated.dilations=[1,2]")
    assert cost.build_mixer("external", 64, s["options"]).heads == 2
    assert tuple(cost.build_mixer("dilated", 64, s["options"]).dilations) == (1, 2)
    assert tuple(cost.build_mixer("unfold", 64, s["options"]).dilations) == (1, 2)  # its baseline follows it
    assert cost.build_mixer("focal", 64, s["options"]).heads == 4  # configs/attn/focal.yaml's
    s = bench_settings("++bench.options.self.heads=2")
    heads = {name: cost.build_mixer(name, 64, s["options"]).heads for name in ("self", "materialised")}
    assert heads == {"self": 2, "materialised": 2}
    s = bench_settings("++bench.options.materialised.heads=2")
    heads = {name: cost.build_mixer(name, 64, s["options"]).heads for name in ("self", "materialised")}
    assert heads == {"self": 4, "materialised": 2}


def test_quick_keeps_its_other_settings_under_a_nested_override(tmp_path):
    """bench.quick=true bench.limits.matmul=256 ran with the full bench's copy_mb=512 and repeats=5: the command
    line's key counted by its first part, so quick's whole limits (and with bench.task_overrides.gan=[...], its
    smaller recipes of the other tasks) were dropped. Now only the paths given win."""
    quick = cost.OmegaConf.to_container(cost.OmegaConf.load(ROOT / "configs" / "bench" / "default.yaml"))[
        "quick_overrides"]
    s = bench_settings("bench.quick=true", "bench.limits.matmul=256",
                       "bench.task_overrides.gan=['experiment=gan_demo']")
    assert s["limits"] == {**quick["limits"], "matmul": 256}
    assert s["task_overrides"] == {**quick["task_overrides"], "gan": ["experiment=gan_demo"]}
    assert s["sizes"] == quick["sizes"] and s["repeats"] == quick["repeats"]
    s = bench_settings("bench.quick=true", "bench.limits={copy_mb:32}", "bench.sizes=[256]")  # a dict merges
    assert s["limits"] == {**quick["limits"], "copy_mb": 32} and s["sizes"] == [256]
    # end to end: the settings run.py measured with
    proc = run_bench(tmp_path, "bench.quick=true", "bench.limits.matmul=128", small_limits=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = json.loads((tmp_path / "run" / "cost-cpu.json").read_text())["settings"]
    assert settings["limits"] == {**quick["limits"], "matmul": 128}


def _table_there(folder: Path, settings: dict) -> dict:
    """A bench table in ``folder`` (cost-cpu.md, .csv, .json) measured with ``settings``; its files' texts."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"cost-cpu.md": "# the full table\n", "cost-cpu.csv": "variant\nall of them\n",
             "cost-cpu.json": json.dumps({"settings": settings})}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def test_a_partial_bench_does_not_replace_a_fuller_table(tmp_path):
    """bench.variants=[self] with bench.table_dir=benchmarks copied a one-variant table over the committed
    cost-cpu.md, .csv, .json and plots, exit code 0. Such a run is refused before it measures, naming what the
    table there holds that it would not; bench.replace_tables=true replaces it, and a name of its own keeps both."""
    full = bench_settings("bench.tasks=true")  # make bench's settings
    tables = tmp_path / "tables"
    files = _table_there(tables, full)
    proc = run_bench(tmp_path, f"bench.table_dir={tables}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    for needle in ("bench.table_dir=", "bench.variants=[self] lacks dilated", "bench.sizes=[256] lacks 1024",
                   "bench.tasks=false", "bench.replace_tables=true", "bench.name="):
        assert needle in message, message
    assert {p.name: p.read_text() for p in tables.iterdir()} == files  # untouched
    assert not (tmp_path / "run" / "cost-cpu.csv").exists()  # nothing measured
    proc = run_bench(tmp_path, f"bench.table_dir={tables}", "bench.name=cost-self")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tables / "cost-self-cpu.md").is_file() and (tables / "cost-cpu.md").read_text() == files["cost-cpu.md"]
    stale = [tables / "cost-cpu-float32-time.png", tables / "cost-cpu-bfloat16-memory.png"]  # a two-dtype table's
    for path in [*stale, tables / "notes.png"]:
        path.write_bytes(b"png")
    proc = run_bench(tmp_path, f"bench.table_dir={tables}", "bench.replace_tables=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "self" in (tables / "cost-cpu.md").read_text() and (tables / "cost-cpu-time.png").is_file()
    assert not any(p.exists() for p in stale) and (tables / "notes.png").is_file()  # the old table's plots only
    assert json.loads((tables / "cost-cpu.json").read_text())["plots"] == ["cost-cpu-time.png", "cost-cpu-memory.png"]


def test_a_replaced_table_takes_the_plots_its_json_lists_with_it(tmp_path):
    (tmp_path / "cost-cuda.json").write_text(json.dumps({"plots": ["cost-cuda-x.png", "../outside.png"]}))
    for name in ("cost-cuda-x.png", "cost-cuda-y.png"):
        (tmp_path / name).write_bytes(b"png")
    (tmp_path.parent / "outside.png").write_bytes(b"png")
    cost.clear_earlier_plots(tmp_path, "cost-cuda")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["cost-cuda-y.png"]  # listed: gone; others: kept
    assert (tmp_path.parent / "outside.png").is_file()  # never outside the folder


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.json")), ids=lambda p: p.name)
def test_committed_benchmark_json_is_strict_json(path):
    """What jq, JavaScript or pandas read: no bare NaN or Infinity (Python's json writes them, and reads them
    back, unless told not to; the writers go through suite.strict_json, a table written before it did not)."""
    def refuse(word):
        raise ValueError(f"{path.name} holds a bare {word}: write it through suite.strict_json.strict (null)")

    assert isinstance(json.loads(path.read_text(), parse_constant=refuse), dict)


def test_table_dir_check_names_what_a_run_would_lose(tmp_path):
    full = bench_settings("bench.tasks=true", f"bench.table_dir={tmp_path}")
    _table_there(tmp_path, full)
    cost.check_table_dir(full, "cost-cpu")  # the same run again: replaced
    cost.check_table_dir(bench_settings("bench.tasks=true", f"bench.table_dir={tmp_path}",
                                        "bench.dtypes=[float32,bfloat16]"), "cost-cpu")  # more: replaced
    cost.check_table_dir(bench_settings("bench.tasks=true", f"bench.table_dir={tmp_path}", "bench.max_seconds=60",
                                        "bench.max_gb=1000", "bench.repeats=9"), "cost-cpu")  # a larger budget
    cost.check_table_dir(bench_settings(f"bench.table_dir={tmp_path}", "bench.quick=true", "bench.replace_tables=true"),
                         "cost-cpu")
    cost.check_table_dir(bench_settings(f"bench.table_dir={tmp_path}", "bench.quick=true"), "cost-other")
    for overrides, needle in ((["bench.quick=true", "bench.tasks=true"], "bench.quick=true"),
                              (["bench.tasks=true", "++bench.options.external.heads=2"],
                               "bench.options.external: heads=2 (the table's: 1)"),
                              (["bench.tasks=true", "bench.task_names=[gan]"], "bench.task_names=[gan] lacks modelnet"),
                              (["bench.tasks=true", "bench.batch=2"], "bench.batch=2"),
                              (["bench.tasks=true", "bench.layouts=[points]"], "bench.layouts=[points] lacks grid"),
                              # a smaller budget skips rows the table measured; fewer repeats give noisier medians
                              (["bench.tasks=true", "bench.max_seconds=1"], "bench.max_seconds=1 (the table's: 30)"),
                              (["bench.tasks=true", "bench.max_gb=0.001"], "bench.max_gb=0.001 (the table's: "),
                              (["bench.tasks=true", "bench.repeats=2"], "bench.repeats=2 (the table's: 5)"),
                              (["bench.tasks=true", "bench.task_batches=3"], "bench.task_batches=3 (the table's: 30)"),
                              (["bench.tasks=true", "bench.limits.matmul=256"],
                               "bench.limits.matmul=256 (the table's: 4096)")):
        with pytest.raises(cost.UserError, match=re.escape(needle)):
            cost.check_table_dir(bench_settings(f"bench.table_dir={tmp_path}", *overrides), "cost-cpu")
    (tmp_path / "cost-cpu.json").unlink()  # a table there whose settings are not known
    with pytest.raises(cost.UserError, match="no readable settings"):
        cost.check_table_dir(full, "cost-cpu")


@pytest.mark.parametrize("stem, overrides", [
    ("cost-cpu", ["bench.tasks=true"]),  # make bench
    ("cost-cuda", ["bench.device=cuda", "bench.dtypes=[float32,bfloat16]", "bench.tasks=true"]),  # make bench-gpu
    ("deterministic-cuda", ["bench.device=cuda", "bench.variants=[]", "bench.baselines=[]", "bench.tasks=true",
                            "bench.task_deterministic=true", "bench.task_pct=false", "bench.name=deterministic"])])
def test_make_bench_replaces_the_committed_tables(stem, overrides):
    """The Makefile's full runs (the settings, not the measurement) pass the check against benchmarks/."""
    assert (ROOT / "benchmarks" / f"{stem}.json").is_file()
    cost.check_table_dir(bench_settings(*overrides, f"bench.table_dir={ROOT / 'benchmarks'}"), stem)


@pytest.mark.parametrize("override", ["bench.sizes=[-4]", "bench.sizes=[]", "bench.channels=[0]", "bench.batch=0",
                                      "bench.repeats=0"])
def test_bench_counts_below_one_are_refused(override):
    """bench.repeats=0 ran, timed nothing and marked every row failed; bench.batch=0 timed empty tensors (exit code 0
    both); bench.sizes=[-4] crashed with a traceback."""
    from attention.errors import UserError

    with pytest.raises(UserError, match=override.split("=")[0].replace(".", r"\.")):
        bench_settings(override)


def test_baselines_compute_what_their_variants_compute():
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))
    for name, (cls, like) in BASELINES.items():
        torch.manual_seed(0)
        ours = cost.build_mixer(like, 32)
        torch.manual_seed(0)
        base = cost.build_mixer(name, 32)
        assert isinstance(base, cls) and name not in attention.names()
        base.load_state_dict(ours.state_dict())
        grid = attention.Grid(8, 8)
        torch.testing.assert_close(base(x, grid), ours(x, grid), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["pct", "spct", "partseg"])
def test_channel_first_pct_computes_what_the_suite_networks_compute(kind, one_thread):
    """The channel-first baselines of benchmarks/pct.py and bench.task_pct, given the suite network's weights, in
    float64: the same logits in training and eval mode, the same gradients and running statistics."""
    from benchmarks.baselines import ChannelFirstPCT, ChannelFirstPCTPartSeg, channel_first
    from tasks.nets.pct import PCT, PCTPartSeg

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xyz = torch.rand(3, 256, 3, generator=g, dtype=torch.float64) * 2 - 1
    if kind == "partseg":  # its dropout acts on (B, N, C) in one and (B, C, N) in the other: masks differ
        ours, inputs = PCTPartSeg(7, 4, {"name": "offset"}, dropout=0.0), (xyz, torch.tensor([0, 3, 1]))
    else:
        ours = PCT(10, {"name": "offset"}, samples=[64, 32], neighbours=16, fps="plain",
                   embedding="neighbor" if kind == "pct" else "point")
        inputs = (xyz,)
    ours = ours.double()
    base = channel_first(ours)
    assert isinstance(base, ChannelFirstPCTPartSeg if kind == "partseg" else ChannelFirstPCT)
    torch.manual_seed(5)  # the same dropout masks: the head's dropout sees (B, C) in both
    expected = base(*inputs)
    torch.manual_seed(5)
    logits = ours(*inputs)
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    weights = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    (expected * weights).sum().backward()
    (logits * weights).sum().backward()
    grads = dict(base.named_parameters())
    top = max(p.grad.abs().max() for p in base.parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad.reshape(p.shape), rtol=1e-9, atol=1e-9 * top, msg=name)
    buffers = dict(base.named_buffers())
    for name, b in ours.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=1e-12, atol=1e-12, msg=name)
    base.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), base(*inputs), rtol=1e-9, atol=1e-9)


def test_a_failed_pct_comparison_is_a_row_not_a_lost_benchmark(monkeypatch):
    """bench.task_pct: a task whose comparison raises gives one row naming the error, with nothing measured."""
    from benchmarks import throughput

    def fail(*args):
        raise RuntimeError("no data\nsecond line")

    monkeypatch.setattr(throughput, "measure_pct", fail)
    (row,) = throughput.pct_throughput({"task_names": ["modelnet", "gan"], "task_pct_overrides": {}}, "cpu")
    assert row["task"] == "modelnet" and row["status"] == "failed: RuntimeError: no data" and row["rounds"] == 0
    assert math.isnan(row["speedup"]) and math.isnan(row["suite_samples_per_s"])


def test_attention_clock_spans_each_mixers_forward_and_backward(one_thread):
    """bench.tasks' attention share: one (start, end) span per mixer forward and per mixer backward, their seconds
    within the step's."""
    import attention
    from benchmarks.throughput import AttentionClock, Marks

    net = torch.nn.Sequential(attention.build("external", dim=16), attention.build("linear_elu", dim=16))
    clock = AttentionClock(net, Marks("cpu"))

    def forward(x):
        for mixer in net:
            x = mixer(x, None)
        return x

    x = torch.randn(2, 32, 16, requires_grad=True)
    start = clock.marks.now()
    forward(x).square().sum().backward()
    end = clock.marks.now()
    assert len(clock.mixers) == 2 and len(clock.spans) == 4
    assert all(clock.marks.seconds(a, b) > 0 for a, b in clock.spans)
    assert 0 < clock.seconds(clock.spans) < clock.marks.seconds(start, end)
    clock.remove()
    forward(x).sum().backward()
    assert len(clock.spans) == 4  # hooks removed


def test_task_throughput_measures_deterministic_mode_beside_the_default(monkeypatch, one_thread):
    """bench.task_deterministic: each task twice, the second with trainer.deterministic on (Lightning turns torch's
    deterministic algorithms on during its steps), and torch left as it was found."""
    from hydra import initialize_config_dir

    from benchmarks import throughput

    seen = []
    make_timer = throughput._timer_callback

    def timer(clock):
        t = make_timer(clock)
        start = t.on_train_batch_start

        def on_start(*args):
            seen.append(torch.are_deterministic_algorithms_enabled())
            start(*args)

        t.on_train_batch_start = on_start
        return t

    monkeypatch.setattr(throughput, "_timer_callback", timer)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    s = {"task_names": ["modelnet"], "task_attn": ["external"], "task_deterministic": True, "task_warmup": 1,
         "task_batches": 2, "task_overrides": {"modelnet": ["experiment=demo", "data.train_per_class=1",
                                                            "data.val_per_class=1", "data.test_per_class=1",
                                                            "data.npoints=64", "data.batch_size=2"]}}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        rows = throughput.task_throughput(s, torch.device("cpu"))
    assert [(r["task"], r["deterministic"], r["status"]) for r in rows] == [("modelnet", False, "ok"),
                                                                           ("modelnet", True, "ok")]
    assert all(r["samples_per_s"] > 0 for r in rows)
    half = len(seen) // 2
    assert seen and seen[:half] == [False] * half and seen[half:] == [True] * (len(seen) - half)
    assert not torch.are_deterministic_algorithms_enabled()


def test_pct_comparison_times_both_networks_alternately(one_thread):
    """benchmarks.pct.compare: one row per mode, ratios of the alternating steps' times, finite and positive."""
    from benchmarks import pct

    ours, base, inputs, target, loss = pct.modelnet_pair(2, 64, classes=5, samples=(16, 8), neighbours=4)
    rows = pct.compare(ours, base, inputs, target, loss, rounds=2, device="cpu")
    assert [(r["mode"], r["form"]) for r in rows] == [("train", "eager"), ("eval", "eager")]
    for r in rows:
        assert r["rounds"] == 2 and r["reference_s"] > 0 and r["suite_s"] > 0
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and math.isfinite(r["ratio_min"])
    assert ours.blocks[0].norm.num_batches_tracked == base.blocks[0].norm.num_batches_tracked > 0  # both trained


# A stand-in for a PCT_Pytorch checkout, as benchmarks.pct_cuda imports one: ``model.Pct(args, output_channels)`` on
# (B, 3, N) points and ``pointnet2_ops.pointnet2_utils.furthest_point_sample``. It counts its forward calls and the
# float32 arithmetic each ran in (suite/tf32.py's switches).
STUB_MODEL = """
import torch
from torch import nn
from pointnet2_ops import pointnet2_utils

CALLS, ARITHMETIC = [], []


class Pct(nn.Module):
    def __init__(self, args, output_channels=40):
        super().__init__()
        self.dropout = args.dropout
        self.head = nn.Linear(3, output_channels)

    def forward(self, x):  # (B, 3, N)
        CALLS.append(tuple(x.shape))
        ARITHMETIC.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        centres = pointnet2_utils.furthest_point_sample(x.transpose(1, 2).contiguous(), 4).long()  # (B, 4)
        return self.head(x.transpose(1, 2).gather(1, centres[..., None].expand(-1, -1, 3)).mean(1))
"""
STUB_FPS = """
from attention.pointops import farthest_point_sample


def furthest_point_sample(xyz, m):
    return farthest_point_sample(xyz, m, like_kernel=True).int()
"""


def test_pct_cuda_benchmark_runs_against_a_reference_checkout(tmp_path):
    """benchmarks.pct_cuda (make bench-gpu's PCT table) on the CPU, against a stand-in checkout: the reference is
    imported from the folder given and called in every mode, and the markdown and JSON carry every section."""
    ref = tmp_path / "PCT_Pytorch"
    (ref / "pointnet2_ops_lib" / "pointnet2_ops").mkdir(parents=True)
    (ref / "model.py").write_text(STUB_MODEL)
    (ref / "pointnet2_ops_lib" / "pointnet2_ops" / "__init__.py").write_text('__version__ = "stub"\n')
    (ref / "pointnet2_ops_lib" / "pointnet2_ops" / "pointnet2_utils.py").write_text(STUB_FPS)
    out = tmp_path / "pct-cuda.md"
    code = ("import sys, json; from benchmarks import pct_cuda; pct_cuda.main(sys.argv[1:]); import model; "
            "print('CALLS', json.dumps(model.CALLS)); print('ARITHMETIC', json.dumps(model.ARITHMETIC))")
    # the checkout first, and whatever the caller's PYTHONPATH carries (a GPU machine's staged hydra, say)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--quick", "--no-compile", "--points", "64",
                           "--reference", str(ref), "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(proc.stdout.split("CALLS", 1)[1].split("ARITHMETIC", 1)[0])
    assert calls and all(shape[1:] == [3, 64] for shape in calls)  # the reference took (B, 3, N)
    # the reference's float32 steps ran in each arithmetic: torch's defaults, both IEEE, both TF32
    arithmetic = {tuple(a) for a in json.loads(proc.stdout.split("ARITHMETIC", 1)[1])}
    assert arithmetic == {("highest", True), ("highest", False), ("high", True)}, arithmetic
    text, data = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert "PCT_Pytorch at" in data["reference"] and "pointnet2_ops stub" in data["reference"]
    forms = ["float32", "float32, both IEEE", "float32, both TF32"]
    convolutions = "float32, 1x1 convolutions through cuDNN"
    assert [(r["network"], r["mode"], r["form"]) for r in data["pct"]] == [
        *(("PCT", "train", f) for f in [*forms, "bfloat16", convolutions, "float32, plain batch norm + max",
                                        "float32, offset mixer in plain ops", "bfloat16, offset mixer in plain ops",
                                        "float32, batch norms on channels-last views"]),
        *(("PCT", "eval", f) for f in [*forms, "bfloat16", convolutions, "float32, folded layer by layer",
                                       "bfloat16, folded layer by layer"]),
        *(("PCTPartSeg", "train", f) for f in [*forms, convolutions]),
        *(("PCTPartSeg", "eval", f) for f in [*forms, convolutions])]
    for r in data["pct"]:
        assert r["reference_s"] > 0 and r["suite_s"] > 0
        assert r["ratio"] == pytest.approx(r["reference_s"] / r["suite_s"])
        assert f"| {r['network']} | 2 x {r['points']} | {r['mode']} | {r['form']} |" in text
    assert data["knn"] and data["knn"][0]["suite_s"] > 0 and data["fps"] == [] and data["syncs"] is None
    assert "Not measured: only a CUDA device" in text and "aten::" in text  # no sync count on a CPU; the profile
    host = text.split("## Where each side's float32 training step spends its host time")[1]
    assert "suite: " in host and "reference: " in host and "suite, bf16 autocast: " in host  # section 7: both sides
    assert host.count("aten ops, host") == 3  # and the suite's bf16 step


def test_pct_cuda_fps_rows_compare_indices_and_warp_counts(one_thread):
    """The FPS section (a GPU's, run here on the CPU's torch loop): the op's indices compared sample by sample, the
    first differing pick found, every warp count timed, and the table carries them."""
    from attention.pointops import farthest_point_sample
    from benchmarks import pct_cuda

    def op(xyz, m):  # pointnet2_ops' signature; differs from like_kernel in sample 1 from pick 3 on
        idx = farthest_point_sample(xyz, m, like_kernel=True).int()
        idx[1, 3:] = 0
        return idx

    (row,) = pct_cuda.fps_rows(op, 1, torch.device("cpu"), [(2, 64, 8)])
    assert row["same_samples"] == 1 and row["first_difference"] == 3 and row["same_with_warps"]
    assert set(row["warps_s"]) == set(pct_cuda.FPS_WARPS) and min(row["warps_s"].values()) > 0
    assert row["carry_s"] > 0 and row["same_with_carry"]
    out = {"argv": [], "date": "now", "device": "cpu", "libraries": "", "reference": "stub", "rounds": 1,
           "cuda": False, "why_no_reference": "", "pct": [], "fps": [row], "knn": [], "syncs": None, "profile": ""}
    table = pct_cuda.markdown(out).split("## FPS")[1].split("\n## ")[0]
    lines = [line for line in table.splitlines() if line.startswith("| 2 | 64 | 8 |")]
    assert len(lines) == 1 and "| 1 of 2 | 3 |" in lines[0]
    assert lines[0].endswith(f"| yes | {1e3 * row['carry_s']:.3f} | yes |"), lines[0]  # every warp count, carried


def test_backbones_benchmark_times_vit_s_against_timms_deit_s(tmp_path, one_thread):
    """benchmarks.backbones: both networks (the same weights: the suite's output is timm's) in every step, dtype and
    drop path, and the table carries each row."""
    from benchmarks import backbones

    reference, suite = backbones.pair(32, 0.0, torch.device("cpu"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(suite.eval()(x), reference.eval()(x), rtol=1e-4, atol=1e-5)
    out = tmp_path / "backbones.md"
    rows = backbones.main(["--quick", "--drop-path", "0.1", "--out", str(out)])
    assert [(r["mode"], r["dtype"]) for r in rows] == [("train", "float32"), ("train", "bf16"), ("eval", "float32"),
                                                       ("eval", "bf16")]
    assert all(r["reference_s"] > 0 and r["suite_s"] > 0 and r["drop_path"] == 0.1 for r in rows)
    text = out.read_text()
    assert all(f"| {r['mode']} | {r['dtype']} | 2 | 64 | 0.1 |" in text for r in rows)


def test_small_n_benchmark_times_eager_and_compiled_and_counts_kernels(tmp_path, one_thread):
    """benchmarks.small_n (make bench-gpu's launch-bound check) on the CPU: both forms timed, the eager step's
    kernels counted as the OpCounter counts them, the table written."""
    from benchmarks import small_n

    out = tmp_path / "small-n.md"
    (row,) = small_n.main(["--quick", "--variants", "linear_elu", "--device", "cpu", "--out", str(out), "--profile"])
    mixer = attention.build("linear_elu", dim=32)
    x = torch.randn(1, 64, 32, requires_grad=True)
    with measure.OpCounter() as ops:
        mixer(x, mixer.example_layout(64, 1, "grid")).sum().backward()
    assert row["kernels"] == ops.kernels > 10 and row["layout"] == "grid"
    assert row["eager_s"] > 0 and row["compiled_s"] > 0 and "cuda graph_s" not in row
    text = out.read_text()
    assert f"| linear_elu | grid | 64 | 32 | {row['kernels']} |" in text
    # the eager step's host profile: its ops counted (views too: at least the kernels), named, in the table
    profile = text.split("### linear_elu, grid, N = 64")[1]
    assert int(profile.split(" aten ops, host ")[0].split()[-1]) >= row["kernels"] and "aten::" in profile


def test_launch_benchmark_times_each_call_on_the_host(tmp_path, one_thread):
    """benchmarks.launch (what one call costs the host) on the CPU: the torch floor and every wrapper timed, the
    Triton-only rows left out without a GPU, the table written; a torch op is cheaper than any wrapper."""
    from benchmarks import launch

    out = tmp_path / "launch.md"
    rows = launch.main(["--quick", "--device", "cpu", "--out", str(out)])
    works = [r["work"] for r in rows]
    assert works[0] == "torch add" and not any(w.startswith("triton") for w in works) and len(works) == 11, works
    assert all(r["us"] > 0 and r["calls"] == 20 for r in rows)
    assert rows[0]["us"] < min(r["us"] for r in rows[1:]), rows
    text = out.read_text()
    assert all(f"| {w} | 20 |" in text for w in works)


def test_fidelity_benchmark_times_both_forms_of_each_score_and_they_agree(tmp_path, one_thread):
    """benchmarks.fidelity (the GAN validation's FID and KID, host against device) on the CPU, small: both forms
    timed, their values equal to 1e-9 (the device's form run here on the CPU), the table written."""
    from benchmarks import fidelity

    out = tmp_path / "fidelity.md"
    rows = fidelity.main(["--quick", "--device", "cpu", "--dim", "64", "--reference", "1500", "--out", str(out)])
    assert [r["score"] for r in rows] == ["FID against the reference", "KID, 10 pairs of 500"]
    for r in rows:
        assert r["host_s"] > 0 and r["device_s"] > 0 and r["ratio"] == r["host_s"] / r["device_s"], r
        assert r["device_value"] == pytest.approx(r["host_value"], rel=1e-9), r
    assert rows[0]["host_value"] > 0  # features of another scale: not the same distribution
    text = out.read_text()
    assert "3,000 generated against 1,500 reference features of D = 64" in text
    assert all(f"| {r['score']} |" in text for r in rows)
    with pytest.raises(SystemExit):  # fewer images than features: the device's FID form does not apply
        fidelity.main(["--quick", "--device", "cpu", "--dim", "64", "--generated", "64"])


def test_launch_benchmark_leaves_dilated_launches_out_and_puts_them_back(monkeypatch):
    """The CUDA row "dilated forward + backward, its 3 launches left out" (benchmarks.launch.without_launches), run
    on CPU tensors with the Triton backend forced: the wrappers and autograd run with the stand-ins in place of the
    kernels, gradients come back, and the kernels are back after."""
    from attention import dilated_triton
    from attention import functional as AF
    from benchmarks import launch

    monkeypatch.setattr(AF, "DILATED_BACKEND", "triton")
    kernels = (dilated_triton._forward_kernel, dilated_triton._backward_query_kernel,
               dilated_triton._backward_key_kernel)
    q, k, v = (torch.randn(1, 4, 64, 8, requires_grad=True) for _ in range(3))
    seen = []

    def call():
        seen.append(type(dilated_triton._forward_kernel).__name__)
        out = AF.dilated_attention(q, k, v, (8, 8), 3, [1, 2, 3, 4])
        out.sum().backward()
        return out

    launch.without_launches(call)
    assert seen == ["_NoLaunch"] and q.grad is not None and q.grad.shape == q.shape
    assert (dilated_triton._forward_kernel, dilated_triton._backward_query_kernel,
            dilated_triton._backward_key_kernel) == kernels


def test_small_n_benchmark_writes_what_it_measured_when_interrupted(tmp_path, monkeypatch):
    """A time limit's SIGINT (gpu_lease.sh's `timeout -s INT`) in the middle of the variants: the rows measured
    before it are written, not lost with the rest (an H200 run lost all of them, 2026-11-26)."""
    from benchmarks import small_n

    row = {"variant": "external", "layout": "grid", "n": 64, "channels": 32, "kernels": 7, "compile_s": 1.0,
           "eager_s": 2e-3, "compiled_s": 1e-3}

    def rows(variants, n, c, rounds, device, profile=False):
        yield row
        raise KeyboardInterrupt

    monkeypatch.setattr(small_n, "rows", rows)
    out = tmp_path / "small-n.md"
    assert small_n.main(["--quick", "--device", "cpu", "--out", str(out)]) == [row]
    assert "| external | grid | 64 | 32 | 7 |" in out.read_text()


def test_pct_cuda_benchmark_refuses_a_folder_that_is_no_checkout(tmp_path):
    from benchmarks import pct_cuda

    with pytest.raises(SystemExit, match="no model.py there"):
        pct_cuda.load_reference(tmp_path)
    assert pct_cuda.load_reference(None)[0] is None


# --------------------------------------------------------------------------------------------
# End to end: python run.py mode=bench bench.quick=true
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return once_per_worker(tmp_path_factory, "bench", _quick_bench)


def _quick_bench(out):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers on two cores, one thread each
        env["OMP_NUM_THREADS"] = "1"
    # the CPU's tables (cost-cpu.*) whatever the machine has: tests/gpu runs the quick bench on CUDA
    args = ["mode=bench", "bench.quick=true", "bench.device=cpu", "logger=none", f"hydra.run.dir={out}",
            "bench.tasks=true", "bench.task_names=[modelnet,segmentation]", f"bench.table_dir={out / 'table'}"]
    proc = warm_python.run([sys.executable, str(ROOT / "run.py"), *args], cwd=out, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.xdist_group("bench")  # one worker runs the quick bench, once
def test_quick_bench_writes_a_well_formed_csv(quick_run):
    out, _ = quick_run
    with (out / "cost-cpu.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == cost.COLUMNS
        rows = list(reader)
    names = set(attention.names()) | set(BASELINES)
    assert {r["variant"] for r in rows} == names
    for name in attention.names():  # every variant on both layouts at every quick size
        assert {(r["layout"], int(r["n"])) for r in rows if r["variant"] == name} == \
            {(k, n) for k in ("grid", "points") for n in (256, 1024, 4096)}
    assert {r["layout"] for r in rows if r["variant"] == "unfold"} == {"grid"}
    for r in rows:
        assert int(r["params"]) > 0, r
        if r["status"] == "ok" or r["flops"]:  # skipped sizes have counts where fake tensors could run them
            assert int(r["flops"]) >= int(r["flops_fwd"]) > 0, r
        if r["status"] == "ok":
            assert float(r["time_ms"]) > 0 and float(r["peak_mib"]) > 0 and int(r["bytes_moved"]) > 0, r
            assert float(r["time_min_ms"]) <= float(r["time_ms"]) <= float(r["time_max_ms"]), r
        else:
            assert r["status"].startswith("skipped: ") and r["note"] and r["time_ms"] == "", r
    skipped = {(r["variant"], r["layout"]) for r in rows if r["status"] == "skipped: memory"}
    # quick's 0.2 GiB budget: the N x N matrices at N=4096 (4 heads: 256 MiB each) do not fit
    assert ("materialised", "grid") in skipped and ("materialised", "points") in skipped


def refuse_bare_tokens(token):
    raise AssertionError(f"the bench's JSON holds the bare token {token}, which strict JSON readers refuse")


@pytest.mark.xdist_group("bench")  # one worker runs the quick bench, once
def test_quick_bench_reports_exponents_targets_and_tasks(quick_run):
    out, proc = quick_run
    summary = json.loads((out / "cost-cpu.json").read_text(), parse_constant=refuse_bare_tokens)  # strict JSON
    exps = summary["exponents"]
    assert {e["variant"] for e in exps} == set(attention.names()) | set(BASELINES)
    for e in exps:
        if e["sizes"] >= 2:
            assert math.isfinite(e["time_exponent"]) and math.isfinite(e["memory_exponent"]), e
        if e["sizes"] < 3:  # no exponent of the top three sizes: NaN, written null
            assert e["time_exponent_top3"] is None, e
    assert all(e["sizes"] >= 2 for e in exps if e["variant"] in attention.names())
    assert "scaling exponents" in proc.stdout and "targets:" in proc.stdout
    results = {t["result"] for t in summary["targets"]}
    assert results <= {"pass", "miss"} and results
    kinds = " ".join(t["target"] for t in summary["targets"])
    for needle in ("external vs self", "linear_elu vs self", "exponent of time", "dilated vs unfold (kernel)",
                   "fraction of the machine"):
        assert needle in kinds
    assert summary["limits"]["flops_per_s_float32"] > 0 and summary["limits"]["bytes_per_s"] > 0
    assert {r["bound"] for r in summary["roofline"]} <= {"compute", "memory"}
    tasks = {t["task"]: t for t in summary["tasks"]}
    assert set(tasks) == {"modelnet", "segmentation"}
    for t in tasks.values():
        assert t["status"] == "ok" and t["samples_per_s"] > 0 and 0 < t["attention_share"] < 1 and t["mixers"] > 0
    # bench.task_pct: PCT's network against its channel-first formulation, for the PCT task among task_names
    (pct,) = summary["pct"]
    assert pct["task"] == "modelnet" and pct["form"] == "eager" and pct["status"] == "ok", pct
    assert pct["batch"] == 4 and pct["points"] == 128 and pct["rounds"] == 2
    assert pct["reference_samples_per_s"] > 0 and pct["suite_samples_per_s"] > 0 and pct["speedup"] > 0


@pytest.mark.xdist_group("bench")  # one worker runs the quick bench, once
def test_quick_bench_markdown_and_plots(quick_run):
    from PIL import Image

    out, _ = quick_run
    md = (out / "cost-cpu.md").read_text()
    for section in ("## Machine limits", "## Targets", "## Scaling exponents", "## Time, forward + backward (ms)",
                    "## Peak memory (MiB)", "## Training throughput per task",
                    "## PCT against its channel-first formulation"):
        assert section in md
    time_table = md.split("## Time, forward + backward (ms)")[1].split("\n## ")[0]
    lines = [line for line in time_table.splitlines() if line.startswith("| ") and "---" not in line]
    assert lines[0].startswith("| variant | layout | C | dtype | N=256 | N=1024 | N=4096 |")
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    assert {row[0].replace(" (baseline)", "") for row in body} == set(attention.names()) | set(BASELINES)
    assert all(len(row) == 7 for row in body)
    assert any(cell.startswith("skip (mem)") for row in body for cell in row[4:])
    assert f"torch {torch.__version__}" in md and "torch thread(s)" in md
    for metric in ("time", "memory"):
        png = out / f"cost-cpu-{metric}.png"
        assert f"]({png.name})" in md
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.size[0] > 200 and image.size[1] > 200
    copied = sorted(p.name for p in (out / "table").iterdir())
    assert copied == sorted(["cost-cpu.md", "cost-cpu.csv", "cost-cpu.json", "cost-cpu-time.png",
                             "cost-cpu-memory.png"])


@pytest.mark.xdist_group("bench")
def test_results_reach_wandb_as_tables_and_images(quick_run, tmp_path, monkeypatch):
    from suite.loggers import build_loggers, close_loggers

    out, _ = quick_run
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = json.loads((out / "cost-cpu.json").read_text())
    with (out / "cost-cpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    plots = [out / "cost-cpu-time.png", out / "cost-cpu-memory.png"]
    loggers = build_loggers({"name": "wandb", "mode": "offline", "project": "attention-suite", "run_name": "bench"},
                            tmp_path, {"bench": summary["settings"]})
    cost.log_wandb(loggers, rows, summary["exponents"], summary["targets"], summary["tasks"], plots, summary["pct"])
    close_loggers(loggers)
    media = next((tmp_path / "wandb").glob("offline-run-*")) / "files" / "media"
    tables = sorted(p.name.split("_")[0] for p in (media / "table" / "bench").glob("*.table.json"))
    assert tables == ["exponents", "pct", "results", "targets", "tasks"]
    results = json.loads(next((media / "table" / "bench").glob("results_*.table.json")).read_text())
    assert results["columns"] == cost.COLUMNS and len(results["data"]) == len(rows)
    assert len(list((media / "images" / "bench").glob("plots_*.png"))) == 2


def test_a_tasks_only_table_has_no_empty_attention_sections():
    """bench.variants=[] with bench.tasks=true (make bench-gpu's deterministic step): the table is the tasks', with
    no empty targets, exponents, roofline, plots, time or memory sections, and the deterministic ratio as computed."""
    from benchmarks import cost

    info = {"device": "cuda", "cpu": "host", "cores": 16, "threads": 16, "gpu": "GPU", "cuda": "13.0", "os": "Linux",
            "date": "2026-11-26 06:34", "environment": "torch 2.11"}
    s = {"dtypes": ["float32"], "task_deterministic": True}
    limits = {"matmul_side": 4096, "flops_per_s_float32": 5e13, "copy_mib": 512, "bytes_per_s": 4e12}
    tasks = [{"task": "modelnet", "attn": "external", "recipe": "experiment=demo", "deterministic": det,
              "batches": 28, "samples_per_s": sps, "step_ms": 1.0, "attention_share": 0.25, "status": "ok"}
             for det, sps in ((False, 800.0), (True, 600.0))]
    assert cost.plots([], [], {"variants": [], "baselines": []}, Path("/nonexistent"), "x") == []
    md = cost.markdown([], [], [], [], [], limits, info, s, tasks, [], "python run.py mode=bench", 2**30)
    assert md.startswith("# Training throughput per task (cuda)")
    for gone in ("## Targets", "## Scaling exponents", "## Plots", "## Time", "## Peak memory", "- each case"):
        assert gone not in md, gone
    assert "| modelnet | external | experiment=demo | yes | 28 | 600.0 | 1.0 | 25% | ok | 0.75x |" in md
    assert "## Machine limits" in md and "50000.0 GFLOP/s" in md


def test_pct_cuda_compiled_forms_are_rows_with_their_compile_times(monkeypatch, one_thread):
    """benchmarks.pct_cuda with the compiled networks: both compiled by default, the suite also with CUDA graphs
    (reduce-overhead), each compiled row with both sides' compile times, and the table showing them. torch.compile is
    replaced by the network itself here (compiling PCT takes minutes on a CPU; the GPU lease runs it for real)."""
    import types

    from benchmarks import pct_cuda

    fps = types.ModuleType("pointnet2_ops.pointnet2_utils")
    exec(STUB_FPS, fps.__dict__)
    package = types.ModuleType("pointnet2_ops")
    package.pointnet2_utils = fps
    monkeypatch.setitem(sys.modules, "pointnet2_ops", package)
    monkeypatch.setitem(sys.modules, "pointnet2_ops.pointnet2_utils", fps)
    model = types.ModuleType("stub_model")
    exec(STUB_MODEL, model.__dict__)
    modes = []
    monkeypatch.setattr(torch, "compile", lambda net, **kw: modes.append(kw.get("mode")) or net)
    rows = pct_cuda.pct_rows(model, 2, 64, 1, torch.device("cpu"), samples=(32, 16), neighbours=4)
    assert modes == [None, None, "reduce-overhead"] * 2  # the reference, the suite, the suite's CUDA graphs; 2 modes
    for mode in ("train", "eval"):
        compiled = [r for r in rows if r["mode"] == mode and r["form"].startswith("compiled")]
        assert [r["form"] for r in compiled] == ["compiled", "compiled, CUDA graphs"]
        for r in compiled:
            assert set(r["compile_s"]) == {"reference", "suite"} and r["goal"] == pct_cuda.GOALS["compiled"]
    out = {"argv": [], "date": "now", "device": "cpu", "libraries": "torch", "reference": "stub", "rounds": 1,
           "cuda": False, "pct": rows, "why_no_reference": "", "syncs": None, "fps": [], "knn": [], "profile": ""}
    assert "| PCT | 2 x 64 | train | compiled, CUDA graphs | reference fp32 |" in pct_cuda.markdown(out)
