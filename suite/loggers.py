"""Loggers from the ``logger`` config: W&B (default), CSV, or none.

W&B never prompts: ``mode=auto`` logs online only when credentials exist
(``WANDB_API_KEY`` or a ``wandb login`` entry in ~/.netrc) and offline
otherwise, and says how to upload the offline run later. An explicit
``WANDB_MODE`` in the environment wins, as it does for wandb itself.

W&B is never a reason to lose a run: :class:`ResilientWandbLogger` catches any
failure of wandb (a service process gone, a network error that wandb raises, a
refused ``wandb.init``), says once that W&B is unavailable, and goes on without
it; the metrics it could not send from then on go to
``<run dir>/wandb_fallback/metrics.csv`` (Lightning's CSV logger), and
``metrics.json`` is written at the end as always.

Every W&B run also keeps its history in ``<run dir>/csv/metrics.csv`` (Lightning's CSV logger beside it,
``logger.csv_history=true``): a plain local copy that ``mode=report`` draws learning curves from without W&B
online, and that does not depend on the format of wandb's offline ``.wandb`` files, which is wandb's own.

A resumed run keeps its whole history: W&B continues the same run (its id is kept beside the checkpoints,
``suite/resume.py``), and :class:`HistoryCSVLogger` keeps the rows logged before the interruption, which
Lightning's CSV logger would delete. Its rows reach the disk with every checkpoint, so that a run killed without
warning has them up to its newest checkpoint, and the file is never left cut short (:class:`AtomicHeaderWriter`).
"""

from __future__ import annotations

import csv
import json
import logging
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from attention.errors import UserError
from suite.run_record import RESOLVED_KEY
from suite.secrets import scrubbed_argv

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


class _GuardedRun:
    """A wandb run whose methods never raise: a failure switches the owning logger to its fallback."""

    def __init__(self, run, owner: ResilientWandbLogger):
        self._run, self._owner = run, owner

    def __getattr__(self, name):
        attr = getattr(self._run, name)
        if not callable(attr):
            return attr

        def guarded(*args, **kwargs):
            if self._owner.failed:
                return None
            try:
                return attr(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - whatever wandb raises, the run goes on
                self._owner.fail(err, f"run.{name}")
                return None

        return guarded


class _NullRun:
    """Stands for the run once W&B has failed: every method call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _guard(method):
    name = method.__name__

    def guarded(self, *args, **kwargs):
        if self.failed:
            return self._fallback_call(name, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - whatever wandb raises, the run goes on
            self.fail(err, name)
            return self._fallback_call(name, *args, **kwargs)

    guarded.__name__ = name
    guarded.__doc__ = method.__doc__
    return guarded


class ResilientWandbLogger(WandbLogger):
    """Lightning's WandbLogger that survives W&B failing at start-up or mid-run (see the module docstring)."""

    def __init__(self, *args, fallback_dir: str | Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed = False
        self._fallback_dir = Path(fallback_dir)
        self._fallback: CSVLogger | None = None

    def fail(self, err: BaseException, where: str) -> None:
        if self.failed:
            return
        self.failed = True
        log.warning("W&B is unavailable (%s in %s: %s). The run continues without it; metrics from now on go to %s "
                    "and metrics.json is written at the end.", type(err).__name__, where,
                    str(err).splitlines()[0] if str(err) else "", self._fallback_dir / "metrics.csv")

    def _fallback_call(self, name: str, *args, **kwargs):
        if name not in ("log_metrics", "finalize", "save"):
            return None  # media, tables and artifacts have no fallback
        if self._fallback is None:
            self._fallback = CSVLogger(save_dir=str(self._fallback_dir.parent), name=self._fallback_dir.name,
                                       version="")
        return getattr(self._fallback, name)(*args, **kwargs)

    @property
    def experiment(self):
        if self.failed:
            return _NullRun()
        try:
            with scrubbed_argv():  # wandb.init records sys.argv: no credentials given as overrides in it
                run = WandbLogger.experiment.fget(self)
        except Exception as err:  # noqa: BLE001 - wandb.init refused: train without W&B
            self.fail(err, "wandb.init")
            return _NullRun()
        return _GuardedRun(run, self)

    @_guard
    def log_hyperparams(self, params, *args, **kwargs):
        """Lightning's, plus the values that wandb refused to set: under ``wandb agent`` the sweep's parameters
        (task, attn, seed) are locked in the run's config, and the resolved sections logged over them are ignored
        ("locked by 'sweep'"), leaving e.g. attn='external'. Those go under ``RESOLVED_KEY`` as well, which no
        sweep parameter is, and ``mode=report report.wandb=`` reads them from there."""
        WandbLogger.log_hyperparams(self, params, *args, **kwargs)
        config = self.experiment.config
        if not hasattr(config, "get"):  # W&B has failed (a _NullRun): nothing was logged, nothing to check
            return

        def same(value) -> str:
            return json.dumps(value, sort_keys=True, default=str)

        given = dict(params)
        refused = {k: v for k, v in given.items() if k != RESOLVED_KEY and same(config.get(k)) != same(v)}
        if refused:
            config.update({RESOLVED_KEY: refused}, allow_val_change=True)

    log_metrics = _guard(WandbLogger.log_metrics)
    log_table = _guard(WandbLogger.log_table)
    log_text = _guard(WandbLogger.log_text)
    log_image = _guard(WandbLogger.log_image)
    log_audio = _guard(WandbLogger.log_audio)
    log_video = _guard(WandbLogger.log_video)
    after_save_checkpoint = _guard(WandbLogger.after_save_checkpoint)
    finalize = _guard(WandbLogger.finalize)
    save = _guard(WandbLogger.save)


class HistoryCSVLogger(CSVLogger):
    """Lightning's CSV logger (``<save_dir>/csv/metrics.csv``) for a run that may be resumed.

    Lightning's writer deletes an existing ``metrics.csv`` when it starts ("previous log files ... will be
    deleted"). With ``resume_step`` (the global step of the checkpoint the run resumes from) the rows logged before
    that step are read first and written back ahead of the new ones; rows from that step on (an epoch's end is
    logged at the step before the checkpoint's, the next epoch's start at its step), which the resumed run logs
    again, are dropped. Rows are written to disk with every checkpoint (``after_save_checkpoint``), not only
    every ``flush_logs_every_n_steps``, so a killed run leaves them up to its newest checkpoint.
    """

    def __init__(self, save_dir: str | Path, resume_step: int | None = None):
        super().__init__(save_dir=str(save_dir), name="csv", version="")
        self._kept: list[dict] = []
        path = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        if resume_step is not None and path.is_file():
            try:
                text = path.read_text()
                if not text.endswith("\n"):  # a row cut short by the kill: not a row
                    text = text[:text.rfind("\n") + 1]
                self._kept = [{k: v for k, v in row.items() if v not in ("", None)}
                              for row in csv.DictReader(text.splitlines())
                              if row.get("step") and int(float(row["step"])) < resume_step]
            except (OSError, ValueError, csv.Error) as err:  # a history is never a reason to stop a run
                log.warning("the history of the interrupted run in %s is unreadable (%s): it starts again", path, err)

    @property
    def experiment(self):
        fresh = self._experiment is None
        if fresh and rank_zero_only.rank == 0:  # CSVLogger.experiment's writer, with the atomic rewrite
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AtomicHeaderWriter(log_dir=self.log_dir)
        writer = CSVLogger.experiment.fget(self)  # on rank zero: the writer, which deleted the old file
        if fresh and isinstance(writer, ExperimentWriter) and self._kept:
            writer.metrics[:0], self._kept = self._kept, []
        return writer

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self.save()


class AtomicHeaderWriter(ExperimentWriter):
    """Lightning's CSV writer, whose rewrite of the whole file (when a new metric name widens the header, e.g. the
    first step-level loss after an epoch's rows) goes through a temporary file and ``os.replace``. Lightning opens
    metrics.csv for writing first: a SIGKILL during that rewrite left it truncated, and the resumed run lost the
    rows before the interruption (tests/test_resume.py, once in four CI runs). Appends stay appends; a row cut
    short by a kill is dropped when a resumed run reads the file (:class:`HistoryCSVLogger`)."""

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        partial = self.metrics_file_path + ".tmp"
        with open(partial, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(partial, self.metrics_file_path)  # the old file or the new one, never a part of either


def build_loggers(cfg: Mapping, save_dir: str | Path, config: Mapping, run_id: str | None = None,
                  resuming: bool = False, resume_step: int | None = None, job_type: str | None = None) -> list:
    """Instantiate the configured logger(s) writing under ``save_dir``; ``config`` is logged whole.

    ``run_id`` fixes the W&B run id; with ``resuming`` the run continues that W&B run (``resume="allow"``) and the
    CSV history keeps its rows up to ``resume_step`` (the resumed checkpoint's global step). ``job_type``: the W&B
    run's (``test`` for ``mode=test``, which otherwise looks like one more training run of its variant).
    """
    kind = cfg.get("name", "none")
    save_dir = Path(save_dir)
    if kind == "none":
        return []
    history = resume_step if resuming else None
    if kind == "csv":
        logger = HistoryCSVLogger(save_dir, resume_step=history)
    elif kind == "wandb":
        mode = wandb_mode(cfg.get("mode", "auto"))
        logger = ResilientWandbLogger(project=cfg["project"], entity=cfg.get("entity"), group=cfg.get("group"),
                                      name=cfg.get("run_name"), tags=list(cfg.get("tags") or []),
                                      save_dir=str(save_dir), mode=mode, log_model=False, id=run_id,
                                      resume="allow" if resuming else None, fallback_dir=save_dir / "wandb_fallback",
                                      job_type=job_type)
        if mode == "offline":
            log.warning("W&B is logging offline (no credentials found; `wandb login` or WANDB_API_KEY enables "
                        "online logging). Upload this run later with: wandb sync %s", save_dir / "wandb")
    else:
        raise UserError(f"logger={kind!r} is not known: use logger=wandb, logger=csv or logger=none.")
    loggers = [logger]
    if kind == "wandb" and cfg.get("csv_history", True):
        loggers.append(HistoryCSVLogger(save_dir, resume_step=history))
    for each in loggers:
        each.log_hyperparams(dict(config))
    return loggers


def started_wandb_run_id(loggers) -> str | None:
    """The id of the W&B run that ``loggers`` log into; None without W&B or once it failed. Under a sweep agent
    (``wandb agent``) it is the agent's run's: wandb.init ignores the ``id`` it is given there."""
    for logger in loggers:
        if isinstance(logger, ResilientWandbLogger) and not logger.failed:
            run_id = getattr(logger.experiment, "id", None)
            return run_id if isinstance(run_id, str) else None
    return None


def close_loggers(loggers, exit_code: int = 0) -> None:
    """Finish W&B runs explicitly: in a Hydra multirun every job shares one process, and an unfinished
    run would otherwise be reused by the next job's ``wandb.init`` (a sweep goes on past a failed run:
    ``suite.cli.sweep_job_ended``). ``exit_code``: the run's, non-zero when it failed or was interrupted (W&B
    then shows it as failed). Closing twice does nothing the second time."""
    for logger in loggers:
        if getattr(logger, "_suite_closed", False):
            continue
        logger._suite_closed = True
        if isinstance(logger, WandbLogger) and (exit_code == 0 or logger._experiment is not None):
            logger.experiment.finish(exit_code=exit_code)  # a failed run that never reached W&B: nothing to close
        if isinstance(logger, ResilientWandbLogger) and logger._fallback is not None:
            logger._fallback.save()
        if isinstance(logger, CSVLogger):
            logger.save()
