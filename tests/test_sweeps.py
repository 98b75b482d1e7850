"""W&B sweep files: each is the command a person types, over every registered variant and three seeds (what
``mode=report`` needs to aggregate), and composes."""

import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import attention

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted((ROOT / "configs" / "sweep").glob("*.yaml"))
TASKS = sorted(p.stem for p in (ROOT / "configs" / "task").glob("*.yaml"))


def combinations(sweep: dict):
    params = sweep["parameters"]
    names = sorted(params)
    values = [params[n]["values"] if "values" in params[n] else [params[n]["value"]] for n in names]
    return [dict(zip(names, combo)) for combo in itertools.product(*values)]


def test_a_sweep_per_task_and_a_combined_one():
    assert {p.stem for p in SWEEPS} == {*TASKS, "all"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_runs_the_command_a_person_types(path):
    sweep = yaml.safe_load(path.read_text())
    assert sweep["program"] == "run.py" and sweep["method"] == "grid"
    assert sweep["command"] == ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}"]
    assert set(sweep["parameters"]["attn"]["values"]) == set(attention.names())  # every registered variant
    assert sweep["parameters"]["seed"] == {"values": [0, 1, 2]}  # seeds as well as variants: reports need them


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_combination_composes(path):
    """Each run's overrides (what ${args_no_hyphens} passes) compose into a valid config."""
    sweep = yaml.safe_load(path.read_text())
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        seeds = sweep["parameters"]["seed"]["values"]
        # The seed changes no choice of config: one seed per task x attn keeps this test as fast as before.
        for combo in (c for c in combinations(sweep) if c["seed"] == seeds[-1]):
            cfg = compose("config", overrides=[f"{k}={v}" for k, v in combo.items()])
            assert cfg.seed == combo["seed"]
            assert cfg.task.name == combo["task"] and cfg.attn.name == combo["attn"]
            metric = sweep.get("metric", {}).get("name")
            if metric:  # the sweep optimises what the task monitors (its best-so-far value)
                assert metric == f"{cfg.monitor.metric}_best"
