"""Composing a run: from the config Hydra composed to the data module and the task that will be trained.

:func:`compose` does, in this order:

1. the task's ``attn_presets`` for the chosen variant (the options its paper uses), under any ``attn.<option>=``
   given on the command line (:func:`apply_attn_preset`);
2. the seed (python, numpy, torch and the data-loader workers), once every interpolation is known to resolve and
   the seed to be a seed;
3. the redacted, resolved config (no API keys or tokens from the environment): everything that is logged, saved or
   printed comes from it; rank zero saves it as ``resolved_config.yaml`` and redacts Hydra's own copies;
4. the start-up checks (``suite/validate.py`` and the task's ``check_config``), before any data is read;
5. the data module, prepared (``prepare_data``: the download of ``data.download=true``, on the process Lightning
   prepares data on) and set up for the run's stage, so that a missing data set is reported before any weights are
   fetched;
6. the task, given what it asks for by name from the data module (``num_classes``, ``category_parts``, ...),
   then the published weights its ``weights_options`` name (``model.weights=PATH``, ...), if given.

``benchmarks/throughput.py`` builds its data and task through :func:`build_datamodule` and :func:`build_task` too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from attention.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class ComposedRun:
    config: dict  # the resolved, redacted config: what is logged and saved
    datamodule: Any
    module: Any  # a tasks.base.Task


def compose(cfg: DictConfig, overrides: list[str], out_dir: Path) -> ComposedRun:
    """The data module and task of ``cfg`` (module docstring); ``overrides`` as given on the command line."""
    import lightning as L

    from suite.distributed import check_scale_rule
    from suite.validate import check_resolves, check_seed, validate_config

    apply_attn_preset(cfg, overrides)
    check_resolves(cfg)  # a group of another task (task=modelnet data=ade20k) leaves interpolations unresolved
    check_seed(cfg.seed)
    L.seed_everything(cfg.seed, workers=True)
    config = record_config(cfg, out_dir)
    check_scale_rule((cfg.get("optim") or {}).get("scale_lr"))  # before any data is read
    validate_config(cfg, overrides)
    # setup() loads once; Lightning's own call later finds it done. A summary reads no data.
    stage = {"train": "fit", "summary": None}.get(cfg.mode, "test")
    datamodule = build_datamodule(cfg, stage)
    module = build_task(config, datamodule)
    # What the loggers record is this run's whole config, redacted, logged once (suite.loggers.build_loggers).
    # Lightning would log the task's and the data module's constructor arguments over it: the task's `model` without
    # its weights options (fine-tuned runs then grouped with runs from scratch by mode=report's report.wandb), the
    # data module's options as top-level keys, unredacted (it is built from the config as given). Checkpoints keep
    # both, redacted (suite.checkpoint_io.SafeCheckpointIO).
    for part in (module, datamodule):
        part._log_hyperparams = False
    return ComposedRun(config, datamodule, module)


def apply_attn_preset(cfg: DictConfig, overrides: Iterable[str]) -> None:
    """Merge ``cfg.attn_presets[<attn name>]`` into ``cfg.attn``, except options given as ``attn.<key>=`` overrides."""
    preset = (cfg.get("attn_presets") or {}).get(cfg.attn.name)
    if not preset:
        return
    given = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("attn."):
            given.add(key.removeprefix("attn."))
    with open_dict(cfg):
        for key, value in preset.items():
            if key not in given:
                cfg.attn[key] = value


def record_config(cfg: DictConfig, out_dir: Path) -> dict:
    """The resolved config with secrets redacted; on rank zero also ``resolved_config.yaml`` (what actually ran:
    interpolations resolved and presets applied; ``.hydra/config.yaml`` holds the input) and Hydra's files
    redacted. Only the data module sees the config as given."""
    from suite.distributed import is_rank_zero
    from suite.secrets import redact, redact_file

    config = redact(OmegaConf.to_container(cfg, resolve=True))
    if is_rank_zero():
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, out_dir / "resolved_config.yaml")
        for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
            redact_file(out_dir / ".hydra" / name)
    return config


def build_datamodule(cfg: DictConfig, stage: str | None):
    """The data module of ``cfg.data``, prepared and set up for ``stage`` (``fit``/``test``; None: neither).

    ``prepare_data`` (where a data module downloads and checks its release) runs before ``setup``, as Lightning
    orders them, and only on the process Lightning runs it on (:func:`prepares_data`); Lightning's own later calls
    find the data there."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from suite.errors import UNEXPECTED
    from suite.validate import chosen

    try:
        datamodule = instantiate(cfg.data, _convert_="all")
    except InstantiationException as err:
        unexpected = UNEXPECTED.match(str(err.__cause__ or ""))
        if not isinstance(err.__cause__, TypeError) or unexpected is None:
            raise
        option, name = unexpected.group(2), chosen("data") or cfg.data._target_
        raise UserError(f"data.{option} is not an option of data={name} ({unexpected.group(1)} takes no "
                        f"{option}): it was set for another data set, by the task, the experiment or the command line "
                        f"(e.g. experiment=demo sets data.npoints for its point sets). Drop it (`~data.{option}`), "
                        "or choose a data set that takes it; `python run.py --cfg job` prints the composed data "
                        "config.") from None
    if stage is not None:
        if prepares_data(datamodule):
            datamodule.prepare_data()
        datamodule.setup(stage)
    return datamodule


def prepares_data(datamodule) -> bool:
    """Whether this process is the one Lightning's ``prepare_data`` runs on: the first process of each node
    (``prepare_data_per_node``, Lightning's default) or of the first node only. The Trainer and its barrier do not
    exist yet: processes that Lightning starts itself (``trainer=ddp``) start after this one has prepared the data;
    those started beside it (``srun``) are told by the data set's missing-data message to download first."""
    local = ("LOCAL_RANK", "SLURM_LOCALID")
    names = local if getattr(datamodule, "prepare_data_per_node", True) else local + ("NODE_RANK", "SLURM_NODEID")
    return all(int(os.environ.get(name, 0) or 0) == 0 for name in names)


def build_task(config: dict, datamodule):
    """The task of ``config["task"]`` with the run's model, attn, optim and monitor configs, and whatever else its
    constructor names that the data module has (``num_classes``, ``class_names``, ``category_parts``, ...)."""
    import inspect

    from hydra.utils import get_class, instantiate

    task = {k: v for k, v in config["task"].items() if k != "name"}
    wanted = inspect.signature(get_class(task["_target_"])).parameters
    from_data = {k: getattr(datamodule, k) for k in wanted if k not in task and hasattr(datamodule, k)}
    # Published weights are loaded after the networks are built; the networks never see these options.
    options = get_class(task["_target_"]).weights_options
    model = {k: v for k, v in config["model"].items() if k not in options}
    # _recursive_=False: the optimisers are built by the module, from its optim config.
    module = instantiate(task, **from_data, model=model, attn=config["attn"], optim=config["optim"],
                         monitor=config["monitor"], _convert_="all", _recursive_=False)
    for option, layout in module.load_weights({k: config["model"].get(k) for k in options}).items():
        log.info("model.%s: loaded %s (%s key layout)", option, config["model"][option], layout)
    return module
