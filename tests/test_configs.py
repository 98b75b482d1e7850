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


def _documented_overrides(experiment: str) -> list[str]:
    """The overrides docs/recipes.md says ``experiment=<experiment>`` stands for."""
    import re

    text = (ROOT / "docs" / "recipes.md").read_text()
    found = (re.search(rf"experiment/{experiment}\.yaml`: `([^`]*)`", text)
             or re.search(rf"experiment={experiment} \(([^)]*)\)", text))
    assert found, f"docs/recipes.md does not list what experiment={experiment} sets"
    return re.sub(r"\n# ?", " ", found.group(1)).split()


@pytest.mark.parametrize("experiment", ["imagenet_dilateformer", "imagenet_focal"])
def test_the_papers_imagenet_recipes_are_the_overrides_the_docs_give(experiment):
    """``experiment=imagenet_dilateformer|imagenet_focal`` compose exactly the documented command-line recipe under
    ``trainer=ddp`` (whose BatchNorm synchronisation DilateFormer's turns off), the papers' setting; a model given on
    the command line wins over the experiment's."""
    overrides = _documented_overrides(experiment)
    assert len(overrides) >= 5 and all("=" in o for o in overrides), overrides
    assert composed(f"experiment={experiment}", "trainer=ddp") == composed("task=classification", "trainer=ddp",
                                                                          *overrides)
    assert composed("experiment=imagenet_dilateformer", "trainer=ddp").trainer.sync_batchnorm is False
    larger = "dilateformer_s" if "dilate" in experiment else "focal_s"
    assert composed(f"experiment={experiment}", "trainer=ddp", f"model={larger}") == composed(
        "task=classification", "trainer=ddp", *overrides, f"model={larger}")
