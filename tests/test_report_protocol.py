"""A limit on the test or validation batches that covers the whole split is the whole split (``protocol``'s
``tested_part`` / ``selected_on_part``, by which ``mode=report`` keeps runs apart).

``trainer.limit_test_batches=3`` on a test loader of 3 batches ran every batch, but the protocol said "first 3
batches" and the report put the run in a row of its own, apart from the runs it equals. The recorded protocol now
compares an int limit with the loader's batch count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from datamodules.points.shapes import Shapes
from suite.run_record import protocol
from suite.run_record import tested_part as part_of
import warm_python

ROOT = Path(__file__).resolve().parents[1]
# 3 classes: 12 test clouds and 6 validation clouds in batches of 4 -> 3 test batches, 2 validation batches
TINY = ["experiment=demo", "trainer.max_epochs=1", "data.num_classes=3", "data.train_per_class=4",
        "data.val_per_class=2", "data.test_per_class=4", "data.batch_size=4", "data.eval_batch_size=4",
        "data.npoints=64", "model.samples=[16,8]", "model.neighbours=8", "trainer.enable_progress_bar=false",
        "logger=none"]


def run_py(args, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(cwd), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = warm_python.run([sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd,
                           env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"run.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((cwd / "run" / "metrics.json").read_text())


def test_a_limit_of_every_batch_is_recorded_as_the_whole_split(tmp_path):
    """A real run: 3 of 3 test batches and at most 5 of 2 validation batches are the whole splits."""
    metrics = run_py([*TINY, "++trainer.limit_test_batches=3", "++trainer.limit_val_batches=5"], tmp_path)
    p = metrics["protocol"]
    assert "tested_part" not in p and "selected_on_part" not in p, p
    config = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    for key in ("limit_test_batches", "limit_val_batches"):
        del config["trainer"][key]
    assert p == protocol(config, metrics["tested"]["checkpoint"])   # an unlimited run's protocol


def test_an_int_limit_is_a_part_only_below_the_loaders_batch_count():
    shapes = Shapes(num_classes=3, train_per_class=4, val_per_class=2, test_per_class=4, npoints=16, batch_size=4,
                    eval_batch_size=4)
    shapes.setup("test")
    batches = len(shapes.test_dataloader())
    assert batches == 3
    for limit, part in ((1, "first 1 batches (trainer.limit_test_batches=1)"),
                        (2, "first 2 batches (trainer.limit_test_batches=2)"), (3, None), (4, None), (1.0, None),
                        (0.99, "first 99% of the batches (trainer.limit_test_batches=0.99)"),
                        (0, "no batches (trainer.limit_test_batches=0)")):
        assert part_of({"limit_test_batches": limit}, batches=batches) == part, limit
    # unknown count (a record derived from a config alone): an int limit stays a part, as before
    assert part_of({"limit_test_batches": 3}) == "first 3 batches (trainer.limit_test_batches=3)"
    # under DDP the count is the first process's share, the largest: a limit covering it covers every share
    assert part_of({"limit_test_batches": 3}, world_size=2, batches=3) is None
    assert part_of({"limit_test_batches": 2}, world_size=2, batches=3) == (
        "2 batches of each of 2 processes' shares (trainer.limit_test_batches=2)")
    # fast_dev_run is a smoke run whatever the loader holds
    assert part_of({"fast_dev_run": 3}, batches=3) == "3 batches (trainer.fast_dev_run)"
    # the validation split the checkpoint was chosen on, likewise
    base = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.points.shapes.Shapes"}}
    p = protocol({**base, "trainer": {"limit_val_batches": 2, "limit_test_batches": 3}},
                 batches={"limit_val_batches": 2, "limit_test_batches": 4})
    assert "selected_on_part" not in p and p["tested_part"] == "first 3 batches (trainer.limit_test_batches=3)"


def test_a_record_from_before_an_option_shares_the_row_of_the_value_that_reproduces_it():
    """A run recorded before ``trainer.tf32`` existed ran under torch's own TF32 switches, which is what
    ``trainer.tf32=null`` runs now: it was a row of its own (``trainer.tf32=<unset>``), apart from the runs it equals.
    ``callbacks.validate_at_end`` stays apart: the runs before it never validated their last step, its default does."""
    from suite import report as rep

    def run(path, seed, **trainer_or_callbacks):
        config = {"task": {"name": "modelnet"}, "data": {"_target_": "datamodules.points.shapes.Shapes"},
                  "attn": {"name": "self"}, "trainer": {"max_epochs": 2}, "seed": seed}
        for section, options in trainer_or_callbacks.items():
            config.setdefault(section, {}).update(options)
        return rep.Run(path, config, {"test/oa": 0.5 + seed / 10}, {}, {"split": "test"})

    validate = {"validate_at_end": {"_target_": "suite.callbacks.ValidateAtEnd"}}
    old, null, on = run("old", 0), run("null", 1, trainer={"tf32": None}), run("on", 2, trainer={"tf32": True})
    rows = {g.label: sorted(r.path for r in g.runs) for g in rep.group_runs([old, null, on])}
    assert rows == {"attn=self trainer.tf32=null": ["null", "old"], "attn=self trainer.tf32=true": ["on"]}
    assert [g.label for g in rep.group_runs([old, null])] == ["attn=self"]   # nothing varies
    rows = {g.label: [r.path for r in g.runs]
            for g in rep.group_runs([run("old", 0), run("new", 1, callbacks=validate, trainer={"tf32": None})])}
    assert rows == {"attn=self callbacks.validate_at_end._target_=<unset>": ["old"],
                    "attn=self callbacks.validate_at_end._target_=suite.callbacks.ValidateAtEnd": ["new"]}
