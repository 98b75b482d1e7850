"""Running a composed config: what ``python run.py`` does once Hydra has composed it.

:func:`run` dispatches on ``mode``:

- ``train`` (default): fit, then test the best checkpoint (:func:`fit_and_test`);
- ``test``: test ``ckpt_path`` (``eval`` is the same: the GAN task's name for it);
- ``summary``: per-module parameters and FLOPs (``suite/summary.py``);
- ``bench``: what every attention variant costs on this machine (``benchmarks/cost.py``);
- ``report``: the comparison of finished runs (``suite/report.py``).

Train and test print their metrics and write ``metrics.json`` to the run directory, with the run's wall time, peak
memory, params and FLOPs per sample, training throughput and evaluation protocol (``suite/run_record.py``).
Checkpoints (best by ``monitor``, ``last.ckpt`` however fit ends, the run's identity in each) are
``suite/checkpoints.py``'s; resuming is ``suite/resume.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path

from omegaconf import DictConfig

from attention.errors import UserError

MODES = ("train", "test", "eval", "summary", "bench", "report")
log = logging.getLogger("run")


def run(cfg: DictConfig, out_dir: Path, overrides: list[str]) -> dict:
    """Run ``cfg`` (``overrides``: the command line's, which presets and checks need; ``out_dir``: the run
    directory). Returns the run's metrics (a summary's counts, a report's or benchmark's result)."""
    if cfg.mode not in MODES:
        raise UserError(f"mode={cfg.mode!r} is not known: use one of {', '.join(MODES)}.")
    if cfg.mode == "report":  # reads finished runs: trains nothing, needs neither Lightning nor data
        from suite.report import report

        return report(cfg)
    if cfg.mode == "bench":  # no data or task: the attention package and the machine
        from benchmarks.cost import bench

        return bench(cfg)
    started = time.perf_counter()
    from suite.run_record import reset_peak_memory

    reset_peak_memory()  # before the data is read: a run's peak includes its data and network
    quiet_libraries()
    from suite.compose import compose

    composed = compose(cfg, overrides, out_dir)
    if cfg.mode == "summary":
        from suite.summary import print_summaries

        return print_summaries(composed.module)
    return fit_and_test(cfg, composed, out_dir, started)


def quiet_libraries() -> None:
    """Library chatter a user cannot act on: Lightning's own pytree deprecation and the litlogger advertisement.
    Lightning's messages (restored checkpoints, SLURM requeues) go once each through Hydra's console and run.log
    handlers: any handler of Lightning's own, which would print every line twice, is dropped."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "litlogger" not in r.getMessage())
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def fit_and_test(cfg: DictConfig, composed, out_dir: Path, started: float) -> dict:
    """``mode=train``: fit (resuming when asked), then test the best checkpoint; ``mode=test``/``eval``: test
    ``ckpt_path``. Writes ``metrics.json`` on rank zero and returns the metrics."""
    from suite.checkpoints import check_checkpoint
    from suite.distributed import is_rank_zero
    from suite.loggers import build_loggers, close_loggers
    from suite.resume import resume_checkpoint, save_wandb_run_id, wandb_run_id

    config, datamodule, module = composed.config, composed.datamodule, composed.module
    ckpt = cfg.get("ckpt_path")
    if cfg.mode == "train" or ckpt == "last":
        ckpt = resume_checkpoint(ckpt, cfg.mode == "train" and bool(cfg.get("resume")), out_dir)
    # Published weights (model.weights=PATH, loaded when the task was built) are a model to test on their own.
    weights = [f"model.{k}" for k in type(module).weights_options if config["model"].get(k)]
    if (ckpt or (cfg.mode in ("test", "eval") and not weights)) and not (ckpt and Path(ckpt).is_file()):
        raise UserError(f"mode={cfg.mode} needs an existing checkpoint: ckpt_path={ckpt!r} is "
                        f"{'not set' if not ckpt else 'not a file'}. Pass e.g. "
                        "`ckpt_path=outputs/.../checkpoints/last.ckpt`, or published weights with "
                        "`model.weights=PATH` (the GAN: model.g_weights=PATH).")
    identity = {"task": cfg.task.name, "attn": config["attn"]}
    if ckpt:
        check_checkpoint(ckpt, identity)
    # A resumed run (ckpt_path=last / resume=true, or a SLURM requeue, whose hpc checkpoint Lightning finds
    # itself) logs into the W&B run it started, whose id is kept beside its checkpoints.
    resuming = cfg.mode == "train" and (ckpt is not None or (
        bool(os.environ.get("SLURM_JOB_ID")) and any(out_dir.glob("hpc_ckpt_*.ckpt"))))
    run_id = wandb_run_id(out_dir, resuming) if cfg.logger.get("name") == "wandb" else None
    if run_id and cfg.mode == "train" and is_rank_zero():
        save_wandb_run_id(out_dir, run_id)
    loggers = build_loggers(cfg.logger, out_dir, config, run_id=run_id, resuming=resuming)
    trainer, parts = build_trainer(config, module, out_dir, loggers, identity)
    if cfg.mode == "train":
        from suite.distributed import apply_lr_scaling

        apply_lr_scaling(module.hparams.optim, trainer, int(datamodule.batch_size))

    metrics: dict[str, float] = {}
    if cfg.mode == "train":
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)  # resumes when ckpt_path is given
        metrics.update(_floats(trainer.callback_metrics))
        best = parts["best"].best_model_path or None
        results = trainer.test(module, datamodule=datamodule, ckpt_path=best, weights_only=True)
        if best:
            log.info("tested best checkpoint %s", best)
        tested = best
    else:
        results = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
        tested = ckpt
    for result in results:
        metrics.update(_floats(result))
    metrics = finish_metrics(metrics, parts["guard"], datamodule)
    log.info("rank %d metrics: %s", trainer.global_rank, json.dumps(metrics))  # each process logs what it saw
    if trainer.is_global_zero:
        write_metrics(metrics, module, config, tested, trainer, started,
                      parts["meter"] if cfg.mode == "train" else None, out_dir, loggers, parts["compiler"])
    close_loggers(loggers)
    return metrics


def build_trainer(config: dict, module, out_dir: Path, loggers: list, identity: dict):
    """The Trainer of ``config["trainer"]`` with the suite's callbacks: the config's own (``callbacks``), the
    checkpoints, random-state saving, the non-finite loss guard, the throughput meter, with ``trainer.compile`` the
    networks' compilation (``suite/compile.py``) and, with a logger, the learning rate monitor. The suite's own
    trainer options (``on_nan``, ``compile*``) are taken out before the rest reaches Lightning's Trainer. Returns the
    trainer and ``{"best", "guard", "meter", "compiler"}``, read after the run (``compiler`` None when not
    compiling)."""
    import lightning as L
    from hydra.utils import instantiate

    from suite.checkpoint_io import SafeCheckpointIO
    from suite.checkpoints import checkpoint_callbacks
    from suite.compile import CompileNetworks, take_options
    from suite.distributed import adjust_trainer_kwargs, check_launch
    from suite.guard import NonFiniteGuard
    from suite.resume import RandomState
    from suite.callbacks import TrainThroughput

    callbacks = [instantiate(c) for c in (config.get("callbacks") or {}).values() if c]
    best, last, run_identity = checkpoint_callbacks(out_dir, config["monitor"], identity)
    trainer_kwargs = dict(config["trainer"])
    guard = NonFiniteGuard(trainer_kwargs.pop("on_nan", "stop"))
    # metrics.json's throughput is the configured meter's whole-run rate (callbacks.throughput); without one, a
    # meter that logs nothing still measures it
    meter = next((c for c in callbacks if isinstance(c, TrainThroughput)), None)
    if meter is None:
        meter = TrainThroughput(window=0)
        callbacks.append(meter)
    callbacks += [best, last, run_identity, RandomState(), guard]
    compiling = take_options(trainer_kwargs)
    compiler = CompileNetworks(compiling["backend"], compiling["mode"], compiling["dynamic"]) \
        if compiling["compile"] else None
    if compiler is not None:
        callbacks.append(compiler)
    if loggers:
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(logging_interval="epoch"))
    adjust_trainer_kwargs(trainer_kwargs, module)
    # Checkpoints are written atomically (temporary file, fsync, rename) and read with weights_only=True.
    plugins = list(trainer_kwargs.pop("plugins", None) or []) + [SafeCheckpointIO()]
    trainer = L.Trainer(**trainer_kwargs, callbacks=callbacks, logger=loggers or False, plugins=plugins,
                        default_root_dir=str(out_dir))
    check_launch(trainer)
    return trainer, {"best": best, "guard": guard, "meter": meter, "compiler": compiler}


def finish_metrics(metrics: dict[str, float], guard, datamodule) -> dict[str, float]:
    """The run's final metrics: skipped batches and files counted (and the files named again at the end, where
    they are seen); last-batch values (``*_step``), which differ per process and say little, left out."""
    if guard.skipped:
        metrics["train/skipped_batches"] = float(len(guard.skipped))
    skipped = list(getattr(datamodule, "skipped", None) or [])
    if skipped:  # data.on_bad_file=skip: what was left out
        metrics["data/skipped"] = float(len(skipped))
        log.warning("data.on_bad_file=skip left out %d bad file(s)/sample(s): %s%s", len(skipped),
                    "; ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    return {k: v for k, v in sorted(metrics.items()) if not k.endswith("_step")}


def write_metrics(metrics: dict, module, config: dict, tested: str | None, trainer, started: float, meter,
                  out_dir: Path, loggers: list, compiler=None) -> None:
    """``metrics.json`` (the metrics and, beside them, what mode=report needs: wall time, peak memory,
    params/FLOPs, throughput, protocol; with ``trainer.compile``, the compile time), printed too, and the run
    record sent to W&B."""
    from suite.run_record import record

    extra = record(module, config, tested, trainer.strategy.root_device.type, started, meter, compiler)
    (out_dir / "metrics.json").write_text(json.dumps({**metrics, **extra}, indent=2) + "\n")
    print("\n".join(f"{k:>24} {v:.4f}" for k, v in metrics.items()))
    print("\n".join(f"{k:>24} {v:.6g}" for k, v in extra.items() if isinstance(v, (int, float))))
    print(f"{'protocol':>24} {json.dumps(extra['protocol'])}")
    print(f"metrics written to {out_dir / 'metrics.json'}")
    log_record(loggers, extra)


def log_record(loggers, extra: dict) -> None:
    """The run's cost (as metrics: in the run's summary) and protocol (as config) to W&B, so that
    ``report.wandb=`` finds there what metrics.json holds."""
    from lightning.pytorch.loggers import WandbLogger

    numbers = {k: float(v) for k, v in extra.items() if isinstance(v, (int, float))}
    for logger in loggers:
        if not isinstance(logger, WandbLogger):  # a CSV logger is finalised already; metrics.json has it all
            continue
        try:
            logger.log_metrics(numbers)
            logger.log_hyperparams({"protocol": extra["protocol"]})
        except Exception as err:  # noqa: BLE001 - a logger never loses a run
            log.warning("could not log the run record to %s: %s", type(logger).__name__, err)


def _floats(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}
