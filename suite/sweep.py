"""W&B sweeps over every registered attention variant, built from ``configs/sweep/<name>.yaml``.

The sweep files name no variants: a W&B sweep file is static YAML, and a hand-kept list would have to be edited for
each new variant. This module adds ``attn: {values: attention.names()}`` (every registered variant, in registry
order) to a sweep file that does not list its own, and prints the result or registers it with W&B::

    python -m suite.sweep modelnet                       # the complete sweep config, to read or to save
    python -m suite.sweep modelnet --out sweep.yaml      # saved: `wandb sweep sweep.yaml` as usual
    python -m suite.sweep modelnet --create              # registered with W&B (online): prints the agent command

A sweep file that lists ``attn`` values itself (a chosen subset) keeps them. Bad input (an unknown sweep name, a
file that is not a W&B grid, no W&B credentials for ``--create``) exits with code 2 and one message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

import attention
from attention.errors import UserError

SWEEPS = Path(__file__).resolve().parents[1] / "configs" / "sweep"


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
    config["parameters"].setdefault("attn", {"values": attention.names()})
    return config


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
