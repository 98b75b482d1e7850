"""Loggers from the ``logger`` config: W&B (default), CSV, or none.

W&B never prompts: ``mode=auto`` logs online only when credentials exist
(``WANDB_API_KEY`` or a ``wandb login`` entry in ~/.netrc) and offline
otherwise, and says how to upload the offline run later. An explicit
``WANDB_MODE`` in the environment wins, as it does for wandb itself.
"""

from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from attention.errors import UserError

log = logging.getLogger(__name__)


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested not in ("auto", "online", "offline", "disabled"):
        raise UserError(f"logger.mode={requested!r} is not known: use auto, online, offline or disabled.")
    if requested == "auto":
        return "online" if wandb_has_credentials() else "offline"
    return requested


def build_loggers(cfg: Mapping, save_dir: str | Path, config: Mapping, run_id: str | None = None,
                  resuming: bool = False) -> list:
    """Instantiate the configured logger(s) writing under ``save_dir``; ``config`` is logged whole.

    ``run_id`` fixes the W&B run id; with ``resuming`` the run continues that W&B run (``resume="allow"``).
    """
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    kind = cfg.get("name", "none")
    save_dir = Path(save_dir)
    if kind == "none":
        return []
    if kind == "csv":
        logger = CSVLogger(save_dir=str(save_dir), name="csv", version="")
    elif kind == "wandb":
        mode = wandb_mode(cfg.get("mode", "auto"))
        logger = WandbLogger(project=cfg["project"], entity=cfg.get("entity"), group=cfg.get("group"),
                             name=cfg.get("run_name"), tags=list(cfg.get("tags") or []), save_dir=str(save_dir),
                             mode=mode, log_model=False, id=run_id, resume="allow" if resuming else None)
        if mode == "offline":
            log.warning("W&B is logging offline (no credentials found; `wandb login` or WANDB_API_KEY enables "
                        "online logging). Upload this run later with: wandb sync %s", save_dir / "wandb")
    else:
        raise UserError(f"logger={kind!r} is not known: use logger=wandb, logger=csv or logger=none.")
    logger.log_hyperparams(dict(config))
    return [logger]


def close_loggers(loggers) -> None:
    """Finish W&B runs explicitly: in a Hydra multirun every job shares one process, and an unfinished
    run would otherwise be reused by the next job's ``wandb.init``."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
