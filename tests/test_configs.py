"""Each default has one home in ``configs/``: the options every task shares are set once in ``config.yaml`` and a
task states only what differs; the benchmark's and the report's settings join the config of their own mode only."""

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TASKS = sorted(p.stem for p in (CONFIGS / "task").glob("*.yaml"))
MODES = sorted(p.stem for p in (CONFIGS / "mode").glob("*.yaml"))


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_shared_optim_options_have_one_home():
    shared = yaml.safe_load((CONFIGS / "config.yaml").read_text())["optim"]
    assert shared == {"scale_lr": None, "base_batch_size": None}
    for task in TASKS:
        cfg = composed(f"task={task}")
        stated = yaml.safe_load((CONFIGS / "task" / f"{task}.yaml").read_text())["optim"]
        for key, default in shared.items():
            assert key in cfg.optim  # every run has them, for suite.distributed and the run record
            if key in stated:  # a task states only what differs from the shared default
                assert stated[key] != default, f"configs/task/{task}.yaml repeats optim.{key}={default!r}"
    assert composed("task=classification").optim.scale_lr == "linear"
    assert composed("task=classification").optim.base_batch_size == 512
    assert composed("task=modelnet").optim.scale_lr is None


def test_modes_are_a_group_and_default_to_train():
    assert MODES == ["bench", "eval", "report", "summary", "test", "train"]
    assert composed().mode == "train"
    for mode in MODES:
        assert composed(f"mode={mode}").mode == mode


@pytest.mark.parametrize("task", TASKS)
def test_a_training_config_carries_no_bench_or_report_settings(task):
    for mode in ("train", "test", "summary"):
        cfg = composed(f"task={task}", f"mode={mode}")
        assert "bench" not in cfg and "report" not in cfg


def test_bench_and_report_settings_join_their_mode_and_stay_overridable():
    bench = composed("mode=bench", "bench.sizes=[256,4096]", "bench.quick=true")
    assert bench.bench.sizes == [256, 4096] and bench.bench.quick and "report" not in bench
    assert OmegaConf.to_container(bench.bench).keys() == yaml.safe_load(
        (CONFIGS / "bench" / "default.yaml").read_text()).keys()
    report = composed("mode=report", "report.runs=[a,b]", "report.baseline=external")
    assert list(report.report.runs) == ["a", "b"] and report.report.baseline == "external" and "bench" not in report
