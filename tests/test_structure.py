"""The project's structure: who imports whom, and the task contract (tasks/base.py).

Imports are read with ``ast`` from every module of attention/, tasks/, datamodules/, suite/, benchmarks/, tests/
and run.py, at any depth (function-level imports count: they run too). From them:

- no module imports ``run`` (run.py is the Hydra shim; the library is suite/);
- the graph of imports between the project's modules has no cycle at all (module level, not only package level);
  an import of a package counts as an import of its ``__init__``, and ``from package import name`` as an import of
  the submodule ``package.name`` when there is one;
- the layers hold: attention/ imports no other package of the project; tasks/ and datamodules/ never import suite/
  or benchmarks/; suite/ never imports tasks/ (tasks arrive through the configs' ``_target_``).
"""

from __future__ import annotations

import ast
import graphlib
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf

from tasks.base import Task
from tasks.gan import GAN
from tasks.modelnet import PointCloudClassification

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention", "tasks", "datamodules", "suite", "benchmarks", "tests")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file for every project module. Test modules are imported by their file name (tests/ and its
    folders are on the path: ``from test_run import ...``), so they are named so, unless two share one."""
    modules = {"run": ROOT / "run.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    stems = Counter(p.stem for name, p in modules.items() if name.startswith("tests."))
    for name, path in list(modules.items()):
        if name.startswith("tests.") and stems[path.stem] == 1 and path.stem != "conftest":
            modules[path.stem] = modules.pop(name)
    return modules


MODULES = project_modules()


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name ``path`` imports, anywhere in it, relative imports made absolute."""
    names = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, when there is one
    return names


def project_target(imported: str) -> str | None:
    """The project module an imported name lands in (its longest known prefix), or None for a library."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        targets = {project_target(i) for i in imported_names(name, path)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


GRAPH = import_graph()


def package_of(module: str) -> str:
    """The top-level folder of a module (``run`` for run.py)."""
    return MODULES[module].relative_to(ROOT).parts[0].removesuffix(".py")


def test_the_graph_sees_the_imports_it_must():
    """The parser finds what is there: run.py imports suite.cli, a function-level import and a relative one."""
    assert "suite.cli" in GRAPH["run"] and "suite.train" in GRAPH["run"]  # the second inside main()
    assert "tasks.base" in GRAPH["tasks.gan"]  # `from .base import Task`
    assert "suite.compose" in GRAPH["benchmarks.throughput"]


def test_no_module_imports_run():
    importers = sorted(name for name, targets in GRAPH.items() if "run" in targets)
    assert not importers, f"{importers} import run.py: import the library function from suite/ instead"


def test_no_import_cycles():
    try:
        tuple(graphlib.TopologicalSorter(GRAPH).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


@pytest.mark.parametrize("package, forbidden", [
    ("attention", {"tasks", "datamodules", "suite", "benchmarks"}),
    ("tasks", {"suite", "benchmarks"}),
    ("datamodules", {"suite", "benchmarks"}),
    ("suite", {"tasks"}),
])
def test_layers(package, forbidden):
    crossing = sorted(f"{name} -> {target}" for name, targets in GRAPH.items() if package_of(name) == package
                      for target in targets if package_of(target) in forbidden)
    assert not crossing, crossing


# --- the task contract -------------------------------------------------------------------------------------------
TASKS = sorted(p.stem for p in (ROOT / "configs" / "task").glob("*.yaml"))


@pytest.mark.parametrize("task", TASKS)
def test_every_configured_task_is_a_task(task):
    cls = get_class(OmegaConf.load(ROOT / "configs" / "task" / f"{task}.yaml").task._target_)
    assert issubclass(cls, Task) and cls.layout in ("grid", "points")
    assert isinstance(cls.ddp_find_unused_parameters, bool)
    assert callable(cls.check_config) and callable(cls.summaries)


def test_a_task_without_layout_is_refused_at_definition():
    with pytest.raises(TypeError, match="must declare `layout`"):
        class NoLayout(Task):  # noqa: F841
            pass

    class Points(Task):
        layout = "points"

    assert Points.check_config(OmegaConf.create({})) is None  # the default checks nothing
    assert not Points.ddp_find_unused_parameters and GAN.ddp_find_unused_parameters


def point_task(monitor=None):
    return PointCloudClassification(3, ["a", "b", "c"], model={"samples": [16, 8], "neighbours": 4, "layers": 1},
                                    attn={"name": "self", "heads": 1}, optim={}, input_points=32, monitor=monitor)


def test_best_so_far_is_tracked_from_monitor_with_the_checkpoint_keys_of_before():
    module = point_task({"metric": "val/oa", "mode": "max"})
    assert module.best_modes == {"val/oa": "max", "val/macc": "max"}
    best = {k for k in module.state_dict() if "_best." in k}
    assert best == {"val_oa_best.max_value", "val_macc_best.max_value", "val_oa_best.seen", "val_macc_best.seen"}
    assert module.summaries() == [("", module.net, module.example_input_array)]
    loss = point_task({"metric": "val/loss", "mode": "min"})
    assert loss.best_modes == {"val/oa": "max", "val/macc": "max", "val/loss": "min"}
    with pytest.raises(ValueError, match="monitor.mode='best'"):
        point_task({"metric": "val/oa", "mode": "best"})


def test_a_best_is_nan_until_a_value_is_not_and_keeps_the_best_of_the_others(monkeypatch):
    """torchmetrics' maximum (minimum) drops NaN values and, having seen no other, reports its start: a tracked
    metric NaN at every validation (``monitor.metric=val/kappa`` on one-class data) logged ``<metric>_best=-inf``,
    a value no epoch had. Now NaN until a value is not NaN; the NaN values after are passed over, as before, and
    the minimum of infinite losses is inf."""
    module = point_task({"metric": "val/loss", "mode": "min"})
    logged = []
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.append((name, float(value))))
    module._trainer = SimpleNamespace(sanity_checking=False)
    nan = math.nan
    for oa, loss in ((nan, nan), (0.5, math.inf), (nan, 2.0), (0.25, 3.0)):
        module.log_best({"val/oa": torch.tensor(oa), "val/loss": torch.tensor(loss)})
    oa, loss = [[v for k, v in logged if k == name] for name in ("val/oa_best", "val/loss_best")]
    assert math.isnan(oa[0]) and oa[1:] == [0.5, 0.5, 0.5], oa
    assert math.isnan(loss[0]) and loss[1:] == [math.inf, 2.0, 2.0], loss
    module._trainer = SimpleNamespace(sanity_checking=True)  # not an epoch: nothing is tracked
    module.log_best({"val/oa": torch.tensor(0.9)})
    assert len(logged) == 8 and float(module.val_oa_best.compute()) == 0.5


def test_a_checkpoint_written_before_the_best_knew_what_it_had_seen_loads():
    """Checkpoints of before hold ``<metric>_best.max_value`` alone: they load, a finite best counting as seen, and
    the start value (nothing seen) not."""
    old = point_task({"metric": "val/oa", "mode": "max"})
    old.val_oa_best(torch.tensor(0.75))
    state = {k: v for k, v in old.state_dict().items() if not k.endswith(".seen")}
    new = point_task({"metric": "val/oa", "mode": "max"})
    new.on_load_checkpoint({"state_dict": state})
    new.load_state_dict(state)
    assert float(new.val_oa_best.max_value) == 0.75 and float(new.val_oa_best.seen) == 1
    assert float(new.val_macc_best.max_value) == -math.inf and float(new.val_macc_best.seen) == 0


@pytest.mark.parametrize("before, after", [("val/oa", "val/loss"), ("val/loss", "val/oa")])
def test_checkpoint_written_with_another_monitor_loads(before, after):
    """Tested (or resumed) under another monitor, a checkpoint loads strictly, as Lightning loads it: the best
    values both runs track are kept, the others dropped or started afresh."""
    old = point_task({"metric": before, "mode": "max" if before == "val/oa" else "min"})
    old.val_oa_best(torch.tensor(0.75))
    checkpoint = {"state_dict": old.state_dict()}
    new = point_task({"metric": after, "mode": "max" if after == "val/oa" else "min"})
    new.on_load_checkpoint(checkpoint)
    new.load_state_dict(checkpoint["state_dict"])
    assert float(new.val_oa_best.max_value) == 0.75
