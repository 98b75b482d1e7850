"""A new data set in an existing family is one module file and one yaml: nothing else is edited (no export in
``datamodules/__init__.py``, no list of data sets anywhere) for ``run.py data=<name>`` to build and train on it.

The proof is done on a copy of the repository (never on the repository itself): ``datamodules/points/shapes.py``
is copied to ``datamodules/points/shapes_copy.py`` with its class renamed ``ShapesCopy``, and
``configs/data/shapes.yaml`` to ``configs/data/shapes_copy.yaml`` naming that class by its module path; nothing
else in the copy changes. Then ``run.py experiment=demo data=shapes_copy trainer.fast_dev_run=true`` runs in the
copy, on the copy's class.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
UNUSED = {".venv", ".git", "data", "outputs", "multirun", "wandb", "docs"}  # top level, not needed
TARGET = "datamodules.points.shapes_copy.ShapesCopy"


def skip(folder, names):
    """What the copy leaves out: the environment, data, run outputs and caches."""
    top = {n for n in names if n in UNUSED} if Path(folder) == ROOT else set()
    return top | set(shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "*.png", "*.ckpt")(
        folder, names))


def test_a_copied_dataset_module_and_yaml_train_with_no_other_edit(tmp_path):
    repo = tmp_path / "suite"
    shutil.copytree(ROOT, repo, ignore=skip)
    source = (ROOT / "datamodules" / "points" / "shapes.py").read_text()
    assert source.count("class Shapes(") == 1
    (repo / "datamodules" / "points" / "shapes_copy.py").write_text(source.replace("class Shapes(",
                                                                                   "class ShapesCopy("))
    config = (ROOT / "configs" / "data" / "shapes.yaml").read_text()
    assert config.count("_target_: datamodules.points.shapes.Shapes\n") == 1
    (repo / "configs" / "data" / "shapes_copy.yaml").write_text(
        config.replace("_target_: datamodules.points.shapes.Shapes\n", f"_target_: {TARGET}\n"))
    assert "ShapesCopy" not in (repo / "datamodules" / "__init__.py").read_text()

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PYTEST_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "run.py", "experiment=demo", "data=shapes_copy", "data.train_per_class=4",
         "data.val_per_class=2", "data.test_per_class=2", "data.batch_size=4", "data.eval_batch_size=8",
         "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false", "logger=none", f"hydra.run.dir={out}"],
        cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert yaml.safe_load((out / "resolved_config.yaml").read_text())["data"]["_target_"] == TARGET
    metrics = json.loads((out / "metrics.json").read_text())
    assert "test/oa" in metrics and metrics["protocol"]["points"] == 256
