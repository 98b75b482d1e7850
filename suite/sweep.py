"""W&B sweeps over every registered attention variant, built from ``configs/sweep/<name>.yaml``.

The sweep files name no variants: a W&B sweep file is static YAML, and a hand-kept list would have to be edited for
each new variant. This module adds ``attn: {values: attention.names()}`` (every registered variant, in registry
order) to a sweep file that does not list its own, and prints the result or registers it with W&B::

    python -m suite.sweep modelnet                       # the complete sweep config, to read or to save
    python -m suite.sweep modelnet --out sweep.yaml      # saved: `wandb sweep sweep.yaml` as usual
    python -m suite.sweep modelnet --create              # registered with W&B (online): prints the agent command

A sweep file that lists ``attn`` values itself (a chosen subset) keeps them; one without a ``command`` gets the
suite's (``${args_no_hyphens}``: its parameters reach ``run.py`` as Hydra overrides). Bad input exits with code 2
and one message, before anything is written or registered: an unknown sweep name; a file that is not a W&B sweep
of ``run.py`` (a ``method`` other than grid, random or bayes; bayes without a ``metric``; a grid parameter without
``value``/``values``; a ``program`` other than ``run.py``; a ``command`` that passes ``--key=value`` arguments,
which Hydra refuses); a value of a config-group parameter (``attn``, ``task``, ``data``, ``model``, ...) that names
no ``configs/<group>/<name>.yaml``; an ``--out`` file whose folder does not exist; no W&B credentials for
``--create``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

import attention
from attention.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SWEEPS = CONFIGS / "sweep"
METHODS = ("grid", "random", "bayes")  # W&B's search methods
COMMAND = ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}"]  # run.py takes Hydra overrides


def available() -> list[str]:
    return sorted(p.stem for p in SWEEPS.glob("*.yaml"))


def sweep_config(name_or_path: str | Path) -> dict:
    """The W&B sweep config of ``configs/sweep/<name>.yaml`` (or a path), with every registered variant."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SWEEPS / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(f"no sweep file {path}. Sweeps: {', '.join(available())} (configs/sweep/), or a path to a "
                        "W&B sweep YAML file. Example: `python -m suite.sweep modelnet`.")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML ({str(err).splitlines()[0]}): fix the file.") from err
    if not isinstance(config, dict) or not isinstance(config.get("parameters"), dict):
        raise UserError(f"{path} is not a W&B sweep file: expected a mapping with `program`, `method` and "
                        "`parameters` (see configs/sweep/modelnet.yaml).")
    check_sweep(config, path)
    config["parameters"].setdefault("attn", {"values": attention.names()})
    config.setdefault("command", list(COMMAND))
    return config


def check_sweep(config: dict, path: Path) -> None:
    """Refuse what W&B would refuse when the sweep is registered, or what would fail in every run it starts."""
    method = config.get("method")
    if method not in METHODS:
        given = "has no `method`" if method is None else f"method={method!r} is not a W&B search method"
        raise UserError(f"{path} {given}: expected one of "
                        f"{', '.join(METHODS)} (`method: grid` runs every combination, as configs/sweep/*.yaml).")
    metric = config.get("metric")
    if metric is not None and not (isinstance(metric, dict) and metric.get("name")
                                   and metric.get("goal", "minimize") in ("minimize", "maximize")):
        raise UserError(f"{path}: metric={metric!r} is not a W&B sweep metric: expected {{name: <logged metric>, "
                        "goal: maximize or minimize}, e.g. `metric: {name: val/oa_best, goal: maximize}`.")
    if method == "bayes" and metric is None:
        raise UserError(f"{path}: method: bayes optimises a metric, and the file has none: add one, e.g. "
                        "`metric: {name: val/oa_best, goal: maximize}` (the task's val/<monitor>_best), or use "
                        "method: grid or random.")
    program = config.get("program")
    if not isinstance(program, str) or Path(program).name != "run.py":
        raise UserError(f"{path}: program={program!r}: the suite's sweeps run run.py (`program: run.py`, started "
                        "in the repository), with their parameters as Hydra overrides.")
    command = config.get("command")
    if command is not None and (not isinstance(command, list) or "${args_no_hyphens}" not in command
                                or "${args}" in command or "${args_json}" in command):
        raise UserError(f"{path}: command={command!r} does not pass the parameters as Hydra overrides: run.py "
                        "takes `task=modelnet`, not W&B's default `--task=modelnet`. Use the command of "
                        "configs/sweep/*.yaml (the items ${env}, ${interpreter}, ${program}, ${args_no_hyphens}), or "
                        "leave `command` out.")
    groups = sorted(d.name for d in CONFIGS.iterdir() if d.is_dir() and d.name not in ("hydra", "sweep"))
    for name, spec in config["parameters"].items():
        if not isinstance(spec, dict) or not ({"value", "values"} & set(spec) or method != "grid" and spec):
            raise UserError(f"{path}: parameter {name}={spec!r} has no values: expected `{name}: {{value: X}}` or "
                            f"`{name}: {{values: [X, Y]}}`" + ("" if method == "grid" else " (or a W&B "
                                                                 "distribution, min and max)") + ".")
        if "values" in spec and not (isinstance(spec["values"], list) and spec["values"]):
            raise UserError(f"{path}: parameter {name} has values={spec['values']!r}: expected a non-empty list, "
                            f"e.g. `{name}: {{values: [X, Y]}}`.")
        if name in groups:
            choices = spec["values"] if "values" in spec else [spec["value"]] if "value" in spec else []
            known = sorted(p.stem for p in (CONFIGS / name).glob("*.yaml"))
            unknown = [v for v in choices if str(v) not in known]
            if unknown:
                raise UserError(f"{path}: parameter {name} names {', '.join(map(str, unknown))}, which is no "
                                f"configs/{name}/<name>.yaml: expected one of {', '.join(known)}. Fix the name, or add "
                                f"the config first.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m suite.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help=f"a sweep of configs/sweep/ ({', '.join(available())}) or a YAML path")
    parser.add_argument("--out", type=Path, help="write the sweep config to this file instead of printing it")
    parser.add_argument("--create", action="store_true", help="register the sweep with W&B (needs credentials)")
    args = parser.parse_args(argv)
    try:
        config = sweep_config(args.sweep)
        text = yaml.safe_dump(config, sort_keys=False)
        if args.out:
            if not args.out.parent.is_dir():
                raise UserError(f"--out {args.out}: the folder {args.out.parent} does not exist. Create it first "
                                "(mkdir -p), or write the file into an existing folder.")
            args.out.write_text(text)
            print(f"sweep config written to {args.out}: wandb sweep {args.out}")
        elif not args.create:
            print(text, end="")
        if args.create:
            create(config)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def create(config: dict) -> str:
    import wandb

    from suite.loggers import wandb_has_credentials

    if not wandb_has_credentials():
        raise UserError("--create registers the sweep with W&B, which needs credentials: `wandb login` or "
                        "WANDB_API_KEY. Without them, save the config with --out and run `wandb sweep` later.")
    sweep_id = wandb.sweep(config, project=config.get("project"), entity=config.get("entity"))
    print(f"wandb agent {config.get('entity') or '<entity>'}/{config.get('project')}/{sweep_id}")
    return sweep_id


if __name__ == "__main__":
    sys.exit(main())
