"""A new attention variant is one module file and one yaml: nothing else is edited for it to be built, tested by the
registry-parametrised tests, swept and benchmarked.

The proof is done on a copy of the repository (never on the repository itself): ``attention/variants/external.py``
is copied to a module registering ``external_copy`` and ``configs/attn/external.yaml`` to
``configs/attn/external_copy.yaml``; nothing else in the copy changes. Then, each in a fresh process in the copy:

- ``pytest tests/attention/test_mixers.py -k external_copy``: the contract tests run on it, and pass; so do the
  task networks' registry-parametrised tests (segmentation head, SAGAN G and D, every backbone; half precision);
- ``python -m suite.sweep modelnet``: the sweep's ``attn`` values list it;
- ``benchmarks.cost`` at the smallest sizes (its ``mode=bench`` settings, composed as ``run.py`` composes them):
  it is measured, and held to the exponent goal of the complexity its class declares.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import warm_python

ROOT = Path(__file__).resolve().parents[1]
NEW = "external_copy"
UNUSED = {".venv", ".git", "data", "outputs", "multirun", "wandb", "docs", "datamodules"}  # top level, not needed


def skip(folder, names):
    """What the copy leaves out: the environment, data, run outputs and caches."""
    top = {n for n in names if n in UNUSED} if Path(folder) == ROOT else set()
    return top | set(shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "*.png", "*.ckpt")(
        folder, names))

BENCH = f"""
import json, torch
from hydra import compose, initialize_config_dir
import attention
from benchmarks import cost
torch.set_num_threads(1)
overrides = ["mode=bench", "bench.variants=[external,{NEW}]", "bench.baselines=[]", "bench.layouts=[points]",
             "bench.sizes=[64,256]", "bench.channels=[16]", "bench.warmup=1", "bench.repeats=1",
             "bench.min_seconds=0", "bench.device=cpu"]
with initialize_config_dir(config_dir=str(__import__("pathlib").Path("configs").resolve()), version_base="1.3"):
    cfg = compose("config", overrides=overrides)
s = cost.settings(cfg)
rows = cost.sweep(s, torch.device("cpu"), max_bytes=2 ** 30)
exps = cost.exponents(rows)
print(json.dumps({{"module": attention.get("{NEW}").__module__, "file": attention.__file__, "rows": rows,
                  "targets": cost.targets(rows, exps, [], [], s)}}, default=str))
"""


def run(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PYTEST_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    proc = warm_python.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """The repository with the copied variant: two files added, nothing else changed."""
    repo = tmp_path_factory.mktemp("repo") / "suite"
    shutil.copytree(ROOT, repo, ignore=skip)
    source = (ROOT / "attention" / "variants" / "external.py").read_text()
    assert source.count('@register("external")') == 1
    (repo / "attention" / "variants" / f"{NEW}.py").write_text(source.replace('@register("external")',
                                                                              f'@register("{NEW}")'))
    config = (ROOT / "configs" / "attn" / "external.yaml").read_text()
    assert config.count("name: external\n") == 1
    (repo / "configs" / "attn" / f"{NEW}.yaml").write_text(config.replace("name: external\n", f"name: {NEW}\n"))
    return repo


def test_the_registry_parametrised_tests_take_it(copy):
    out = run(["-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/attention/test_mixers.py",
               "-k", NEW], copy)
    passed = {line.split("::")[1].split()[0] for line in out.splitlines() if " PASSED" in line}
    for test in ("test_forward_shape_and_finite[{}-grid]", "test_forward_shape_and_finite[{}-points]",
                 "test_registered_class_is_a_mixer[{}]", "test_yaml_defaults_are_the_class_defaults[{}]",
                 "test_linear_variants_flops_linear_in_n[{}]", "test_gradients_reach_every_parameter[{}]",
                 "test_unknown_option[{}]"):
        assert test.format(NEW) in passed, f"{test.format(NEW)} did not pass:\n{out[-3000:]}"
    assert "failed" not in out.splitlines()[-1]


def test_the_task_networks_take_it(copy):
    """Every task network's registry-parametrised test builds it and trains a step through it."""
    files = ["tests/tasks/test_segnet.py", "tests/tasks/test_sagan.py", "tests/tasks/test_backbones.py",
             "tests/test_precision.py"]
    out = run(["-m", "pytest", "-v", "-p", "no:cacheprovider", *files, "-k", NEW], copy)
    passed = {line.split(" PASSED")[0].strip() for line in out.splitlines() if " PASSED" in line}
    for test in ("tests/tasks/test_segnet.py::test_every_variant_in_the_head[{}]",
                 "tests/tasks/test_sagan.py::test_every_variant_in_generator_and_discriminator[True-{}]",
                 "tests/tasks/test_backbones.py::test_every_variant_in_every_model[dilateformer_t-{}]"):
        assert test.format(NEW) in passed, f"{test.format(NEW)} did not pass:\n{out[-3000:]}"
    assert any(name.startswith("tests/test_precision.py::") for name in passed), out[-3000:]
    assert "failed" not in out.splitlines()[-1] and "error" not in out.splitlines()[-1]


def test_the_sweeps_take_it(copy):
    sweep = yaml.safe_load(run(["-m", "suite.sweep", "modelnet"], copy))
    assert NEW in sweep["parameters"]["attn"]["values"] and "external" in sweep["parameters"]["attn"]["values"]


def test_the_benchmark_measures_it_and_holds_it_to_its_declared_complexity(copy):
    result = json.loads(run(["-c", BENCH], copy).splitlines()[-1])
    assert result["module"] == f"attention.variants.{NEW}"
    assert Path(result["file"]).resolve().is_relative_to(copy.resolve())  # the copy's package, not the repository's
    mine = [r for r in result["rows"] if r["variant"] == NEW]
    assert [r["n"] for r in mine] == [64, 256] and all(r["status"] == "ok" and r["time_ms"] > 0 for r in mine)
    # the same FLOPs as the module it was copied from: it is that variant under another name
    theirs = [r for r in result["rows"] if r["variant"] == "external"]
    assert [r["flops"] for r in mine] == [r["flops"] for r in theirs]
    assert any(t["target"] == f"{NEW}: exponent of time in N" and t["goal"] == "0.85 .. 1.15"
               for t in result["targets"])
