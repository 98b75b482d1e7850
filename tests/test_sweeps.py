"""W&B sweep files: each is the command a person types, over every registered variant (added from the registry by
``suite.sweep``, never listed by hand) and three seeds (what ``mode=report`` needs to aggregate), and composes."""

import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import attention
from suite import sweep as sweeps

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
    assert "attn" not in yaml.safe_load(path.read_text())["parameters"]  # the registry's, not a hand-kept list
    sweep = sweeps.sweep_config(path.stem)
    assert sweep["program"] == "run.py" and sweep["method"] == "grid"
    assert sweep["command"] == ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}"]
    assert set(sweep["parameters"]["attn"]["values"]) == set(attention.names())  # every registered variant
    assert sweep["parameters"]["seed"] == {"values": [0, 1, 2]}  # seeds as well as variants: reports need them


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_combination_composes(path):
    """Each run's overrides (what ${args_no_hyphens} passes) compose into a valid config."""
    sweep = sweeps.sweep_config(path.stem)
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


def test_a_new_variant_is_swept_without_editing_a_sweep_file(monkeypatch):
    monkeypatch.setattr(attention, "names", lambda: ["self", "brand_new"])
    assert sweeps.sweep_config("modelnet")["parameters"]["attn"] == {"values": ["self", "brand_new"]}


def test_a_sweep_file_may_choose_its_own_subset(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("program: run.py\nmethod: grid\nparameters:\n  attn: {values: [self, external]}\n")
    assert sweeps.sweep_config(path)["parameters"]["attn"] == {"values": ["self", "external"]}


def test_sweep_cli_prints_writes_and_refuses(tmp_path, capsys, monkeypatch):
    assert sweeps.main(["gan"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["parameters"]["attn"]["values"] == attention.names() and printed["parameters"]["task"] == {"value": "gan"}
    assert sweeps.main(["gan", "--out", str(tmp_path / "s.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "s.yaml").read_text()) == printed
    assert sweeps.main(["nope"]) == 2
    assert "no sweep file" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("- just a list\n")
    assert sweeps.main([str(tmp_path / "bad.yaml")]) == 2
    assert "is not a W&B sweep file" in capsys.readouterr().err
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert sweeps.main(["gan", "--create"]) == 2  # never prompts for a login
    assert "needs credentials" in capsys.readouterr().err


NOT_A_SWEEP = {  # a sweep file, and what the refusal says: each exited 0 with the config printed, for W&B or every
    # run it started to refuse later
    "program: run.py\nmethod: bayes\nparameters: {task: {value: modelnet}, seed: {values: [0, 1]}}\n":
        "method: bayes optimises a metric, and the file has none",
    "program: train.py\nparameters: {task: {value: modelnet}}\n": "has no `method`: expected one of grid, random",
    "program: run.py\nmethod: hyperband\nparameters: {task: {value: modelnet}}\n":
        "method='hyperband' is not a W&B search method",
    "program: train.py\nmethod: grid\nparameters: {task: {value: modelnet}}\n":
        "program='train.py': the suite's sweeps run run.py",
    "program: run.py\nmethod: grid\ncommand: ['${env}', '${interpreter}', '${program}', '${args}']\n"
    "parameters: {task: {value: modelnet}}\n": "does not pass the parameters as Hydra overrides",
    "program: run.py\nmethod: grid\nparameters: {attn: {values: [self, nonesuch]}, task: {value: modelnet}}\n":
        "parameter attn names nonesuch, which is no configs/attn/<name>.yaml: expected one of dilated,",
    "program: run.py\nmethod: grid\nparameters: {task: {value: modelnett}}\n":
        "parameter task names modelnett, which is no configs/task/<name>.yaml",
    "program: run.py\nmethod: grid\nparameters: {task: {value: classification}, model: {values: [vit_s, vit_x]}}\n":
        "parameter model names vit_x",
    "program: run.py\nmethod: grid\nparameters: {task: {value: modelnet}, seed: {min: 0, max: 3}}\n":
        "parameter seed={'min': 0, 'max': 3} has no values",
    "program: run.py\nmethod: bayes\nmetric: {name: val/oa_best, goal: up}\nparameters: {task: {value: modelnet}}\n":
        "is not a W&B sweep metric",
}


@pytest.mark.parametrize("text", NOT_A_SWEEP, ids=range(len(NOT_A_SWEEP)))
def test_a_file_that_is_not_a_sweep_of_run_py_is_refused(text, tmp_path, capsys):
    (tmp_path / "sweep.yaml").write_text(text)
    assert sweeps.main([str(tmp_path / "sweep.yaml"), "--out", str(tmp_path / "out.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'sweep.yaml'}") and NOT_A_SWEEP[text] in err, err
    assert not (tmp_path / "out.yaml").exists()


def test_random_and_bayes_sweeps_of_run_py_are_accepted(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("program: run.py\nmethod: bayes\nmetric: {name: val/oa_best, goal: maximize}\n"
                    "parameters: {task: {value: modelnet}, optim.optimizer.lr: {min: 0.0001, max: 0.01}}\n")
    config = sweeps.sweep_config(path)
    assert config["command"] == ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}"]  # the suite's
    path.write_text("program: run.py\nmethod: random\nparameters: {task: {value: modelnet}, seed: {values: [0, 1]}}\n")
    assert sweeps.sweep_config(path)["method"] == "random"


def test_out_into_a_missing_folder_is_a_user_error(tmp_path, capsys):
    """It was a bare FileNotFoundError traceback, exit code 1."""
    assert sweeps.main(["modelnet", "--out", str(tmp_path / "missing" / "sweep.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'missing' / 'sweep.yaml'}: the folder {tmp_path / 'missing'} does not exist" in err
