"""Running a composed config: what ``python run.py`` does once Hydra has composed it.

:func:`run` dispatches on ``mode``:

- ``train`` (default): fit, then test the best checkpoint (:func:`fit_and_test`);
- ``test``: test ``ckpt_path`` (``eval`` is the same: the GAN task's name for it);
- ``summary``: per-module parameters and FLOPs (``suite/summary.py``);
- ``bench``: what every attention variant costs on this machine (``benchmarks/cost.py``);
- ``report``: the comparison of finished runs (``suite/report.py``).

Train and test print their metrics and write ``metrics.json`` to the run directory (a test of a directory holding
a run already: to its ``test-<time>/`` folder), with the run's wall time, peak memory, params and FLOPs per sample,
training throughput and evaluation protocol (``suite/run_record.py``). No run overwrites another's results
(``suite/run_dirs.py``). Checkpoints (best by ``monitor``, ``last.ckpt`` however fit ends, the run's identity in
each) are ``suite/checkpoints.py``'s; resuming is ``suite/resume.py``'s. A run stopped by SIGTERM says so and exits
with code 143; one that took no training step is refused; one whose validation or test metrics are NaN or
infinite fails once its record is written, with exit code 2 (``trainer.on_nan``, ``suite/guard.py``).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
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
    import_what_it_runs(cfg)
    started = time.perf_counter()
    from suite.run_record import code_version, reset_peak_memory

    reset_peak_memory()  # before the data is read: a run's peak includes its data and network
    code_version()  # the code as it starts (kept): what ran, whatever is edited while it trains
    quiet_libraries()
    from suite.compose import compose
    from suite.distributed import is_rank_zero
    from suite.run_dirs import (HYDRA_RECORD, check_fresh_run, forget_run_record, hold, identity_of,
                                put_back_run_record, record_dir, release, slurm_restart)

    # Where this run's record goes (a test of a finished run's directory: a test-<time>/ folder in it), and for a
    # training run, that it does not overwrite another run's results (checked by Hydra's callback already for a
    # single run; here for the jobs of a multirun, whose .hydra/ files Hydra has written over the run's there:
    # a refused job puts them back): both before anything else of the run is written.
    run_dir, out_dir = out_dir, record_dir(out_dir, cfg.mode)
    held = False
    from suite import determinism, tf32

    # torch's TF32 and determinism switches as this run found them, put back as it ends: trainer.tf32 and
    # trainer.deterministic set them for this run alone (a local multirun's next job, in this process, starts from
    # these)
    arithmetic, repeatable = tf32.state(), determinism.state()
    try:
        if cfg.mode == "train":
            try:
                if is_rank_zero():  # the directory is this run's while it trains (a single run's: Hydra's callback's)
                    hold(run_dir)
                    held = True
                check_training_length(cfg.trainer)
                check_fresh_run(run_dir, resume=bool(cfg.get("resume")), ckpt_path=cfg.get("ckpt_path"),
                                overwrite=bool(cfg.get("overwrite")), slurm_restart=slurm_restart(run_dir),
                                delete=is_rank_zero(), identity=identity_of(cfg))
                from suite.resume import check_same_recipe

                check_same_recipe(cfg, run_dir, resume=bool(cfg.get("resume")),
                                  slurm_restart=slurm_restart(run_dir))
            except UserError:
                if is_rank_zero():
                    put_back_run_record(run_dir, HYDRA_RECORD)
                raise
        composed = compose(cfg, overrides, out_dir)
        if cfg.mode == "summary":
            from suite.summary import print_summaries

            return print_summaries(composed.module)
        return fit_and_test(cfg, composed, run_dir, out_dir, started)
    finally:
        tf32.restore(arithmetic)
        determinism.restore(repeatable)
        forget_run_record(run_dir)
        if held:
            release(run_dir)


def check_training_length(trainer: DictConfig) -> None:
    """Refuse ``trainer.max_epochs=0`` / ``max_steps=0`` in mode=train: fit would return at once and the untrained
    network be tested as if it were the run's result."""
    for key in ("max_epochs", "max_steps"):
        if trainer.get(key) == 0:
            raise UserError(f"trainer.{key}=0 trains nothing, and mode=train would then test the untrained network as "
                            f"its result. Give a positive trainer.{key} (-1: no limit), or test a checkpoint or "
                            "published weights with mode=test (ckpt_path=... or model.weights=...).")


def quiet_libraries() -> None:
    """Library chatter a user cannot act on: Lightning's own pytree deprecation and the litlogger advertisement.
    Lightning's messages (restored checkpoints, SLURM requeues) go once each through Hydra's console and run.log
    handlers: the console handler that ``import lightning`` adds, which would print every line twice, is dropped
    (after that import, which adds it). Lightning's warnings about a non-empty checkpoint or CSV log directory are
    dropped too: ``suite/run_dirs.py`` refuses a fresh run in a directory holding another run's results, and a
    resumed run's files there are its own (``suite.loggers.HistoryCSVLogger`` keeps its history)."""
    import lightning  # noqa: F401 - adds the handler removed below

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "litlogger" not in r.getMessage())
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def fit_and_test(cfg: DictConfig, composed, run_dir: Path, out_dir: Path, started: float) -> dict:
    """``mode=train``: fit (resuming when asked), then test the best checkpoint; ``mode=test``/``eval``: test
    ``ckpt_path``. Checkpoints and resuming use ``run_dir``; the record (``metrics.json``, loggers' files) goes to
    ``out_dir`` (the same for a training run, ``suite/run_dirs.py``). Writes ``metrics.json`` on rank zero and
    returns the metrics. A SIGTERM ends the run with exit code 143 and a line saying how to resume
    (:func:`interrupted`)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from suite.checkpoints import check_checkpoint, checkpoint_step
    from suite.distributed import is_rank_zero
    from suite.loggers import build_loggers, close_loggers, started_wandb_run_id
    from suite.resume import resume_checkpoint, save_wandb_run_id, wandb_run_id
    from suite.run_dirs import put_back_run_record, slurm_restart
    from suite.run_record import floats

    config, datamodule, module = composed.config, composed.datamodule, composed.module
    ckpt = cfg.get("ckpt_path")
    if cfg.mode == "train" or ckpt == "last":  # a requeued SLURM job resumes as with resume=true
        resume = cfg.mode == "train" and (bool(cfg.get("resume")) or (ckpt is None and slurm_restart(run_dir)))
        ckpt = resume_checkpoint(ckpt, resume, run_dir)
    # Published weights (model.weights=PATH, loaded when the task was built) are a model to test on their own.
    weights = [f"model.{k}" for k in type(module).weights_options if config["model"].get(k)]
    if (ckpt or (cfg.mode in ("test", "eval") and not weights)) and not (ckpt and Path(ckpt).is_file()):
        raise UserError(f"mode={cfg.mode} needs an existing checkpoint: ckpt_path={ckpt!r} is "
                        f"{'not set' if not ckpt else 'not a file'}. Pass e.g. "
                        "`ckpt_path=outputs/.../checkpoints/last.ckpt`, or published weights with "
                        "`model.weights=PATH` (the GAN: model.g_weights=PATH).")
    identity = {"task": cfg.task.name, "attn": config["attn"]}
    if ckpt:
        check_checkpoint(ckpt, identity, module, config)
        if cfg.mode != "train" and is_rank_zero():
            from suite.resume import warn_tested_recipe

            warn_tested_recipe(cfg, ckpt)
    # A resumed run (ckpt_path=last, resume=true, a requeued SLURM job) logs into the W&B run it started, whose id
    # is kept beside its checkpoints, and keeps its CSV history up to the step it resumes from.
    resuming = cfg.mode == "train" and ckpt is not None
    # Refused before the loggers are built: W&B would reopen the finished run (its id is kept) and end it as failed,
    # under the refused command's config.
    if resuming and (past := past_its_length(checkpoint_length(ckpt), config["trainer"], ckpt)):
        if is_rank_zero():
            put_back_run_record(run_dir)
        raise UserError(past)
    run_id = wandb_run_id(run_dir, resuming) if cfg.logger.get("name") == "wandb" else None
    # A test (mode=test/eval) is a W&B run of its own kind: with the training runs' name, group and tags it was one
    # more training run of its variant.
    loggers = build_loggers(cfg.logger, out_dir, config, run_id=run_id, resuming=resuming,
                            resume_step=checkpoint_step(ckpt) if resuming else None,
                            job_type=None if cfg.mode == "train" else str(cfg.mode))
    if run_id and cfg.mode == "train" and is_rank_zero():  # the run W&B started: a sweep agent's has its own id
        save_wandb_run_id(run_dir, started_wandb_run_id(loggers) or run_id)
    try:  # however the run ends, its W&B run is finished (a failed one as failed): a sweep's next job, in this
        # process, would otherwise log into it
        trainer, parts = build_trainer(config, module, run_dir, loggers, identity, started)
        if cfg.mode == "train":
            from suite.distributed import apply_lr_scaling

            apply_lr_scaling(module.hparams.optim, trainer, int(datamodule.batch_size))
            if ckpt:  # trained on from a checkpoint: its optimizer's rates, restored by Lightning, are the run's
                from suite.resume import keep_checkpoint_rates

                keep_checkpoint_rates(ckpt, module.hparams.optim)

        metrics: dict[str, float] = {}
        try:
            if cfg.mode == "train":
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)  # resumes when ckpt_path is given
                if trainer.global_step == 0:
                    raise UserError(trained_nothing(trainer))
                record = parts["record"]
                # Trained nothing: what the folder says its run ran and logged is put back as it was, after the
                # loggers have closed (the CSV logger rewrites the history it resumed, without the test's rows).
                if record.steps == 0 and (past := past_its_length((trainer.current_epoch, trainer.global_step),
                                                                  trainer, ckpt)):
                    close_loggers(loggers, exit_code=2)  # past the length of a run not stopped at an epoch's end
                    if trainer.is_global_zero:
                        put_back_run_record(run_dir)
                    raise UserError(past)
                if record.steps == 0 and (kept := finished_already(trainer, out_dir)) is not None:
                    # resumed at its end, with its record written: nothing to do, but a record that is not a number
                    # fails again (a sweep resumed to finish its unfinished runs took such a run as finished)
                    failure = parts["guard"].evaluation_error(
                        kept, trainer, "the checkpoint its metrics.json names ('tested')", out_dir / "metrics.json")
                    close_loggers(loggers, exit_code=2 if failure else 0)
                    if trainer.is_global_zero:  # its record stays the finished run's, as its metrics.json does
                        put_back_run_record(run_dir)
                    if failure:
                        raise failure
                    return kept
                metrics.update(record.fit_metrics(trainer))
                best = parts["best"].best_model_path or None
                results = trainer.test(module, datamodule=datamodule, ckpt_path=best, weights_only=True)
                if best:
                    log.info("tested best checkpoint %s", best)
                tested = best
            else:
                results = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
                tested = ckpt
        except SIGTERMException:  # Lightning stopped at the end of a batch; last.ckpt is written (suite/checkpoints.py)
            raise SystemExit(interrupted(trainer, run_dir, cfg.mode, parts["stop"].ctrl_c)) from None
        for result in results:
            metrics.update(floats(result))
        metrics = finish_metrics(metrics, parts["guard"], datamodule, trainer)
        log.info("rank %d metrics: %s", trainer.global_rank, json.dumps(metrics))  # each process logs what it saw
        if trainer.is_global_zero:
            from suite.run_record import checkpoint_origin

            training = cfg.mode == "train"
            write_metrics(metrics, module, config, tested, trainer, parts["record"].seconds(),
                          parts["meter"] if training else None, out_dir, loggers, parts["compiler"],
                          parts["record"].code(), parts["record"].settings() if training else None,
                          validates_on_test(datamodule) if training else None,
                          None if training else checkpoint_origin(tested))
        # A NaN or infinite val/* or test/* metric fails the run once all is written (suite/guard.py), exit code 2.
        failure = parts["guard"].evaluation_error(metrics, trainer, tested_words(tested, cfg.mode, weights),
                                                  out_dir / "metrics.json" if trainer.is_global_zero else None)
        close_loggers(loggers, exit_code=2 if failure else 0)
        if failure:
            raise failure
        return metrics
    except BaseException as err:
        from suite.errors import as_user_error

        # The process's own exit code: a refused run (a UserError, or an option error as_user_error turns into one)
        # exits 2 (run.py), a bug 1.
        if isinstance(err, SystemExit):
            code = err.code if isinstance(err.code, int) else 1
        else:
            code = 2 if as_user_error(err) is not None else 1
        close_loggers(loggers, exit_code=code)
        raise


# A run ended by SIGTERM (Ctrl-C) exits as a process killed by it would (128 + 15, 128 + 2): a scheduler sees it
# did not finish.
SIGTERM_EXIT, SIGINT_EXIT = 143, 130


def interrupted(trainer, run_dir: Path, mode: str, ctrl_c: bool = False) -> int:
    """Say, once (rank zero), that a SIGTERM (``ctrl_c``: Ctrl-C, suite.sigterm.AgreedSigterm) stopped the run,
    where its weights are and how it continues; returns the exit code. A requeued SLURM job (Lightning's handler
    of the time-limit signal has saved an hpc checkpoint and called ``scontrol requeue``) resumes by itself
    (``suite.run_dirs.slurm_restart``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    signal_name, code = ("Ctrl-C (SIGINT)", SIGINT_EXIT) if ctrl_c else ("SIGTERM", SIGTERM_EXIT)
    if trainer.is_global_zero and mode != "train":
        log.error("interrupted by %s while testing: no metrics.json was written; run the same command again. "
                  "Exit code %d.", signal_name, code)
    elif trainer.is_global_zero:
        last = run_dir / "checkpoints" / "last.ckpt"
        kept = f"its weights are in {last} (step {trainer.global_step})" if last.is_file() else \
            "it wrote no checkpoint (no training step was taken)"
        how = f"continue it with the same command plus `hydra.run.dir={run_dir} resume=true`"
        if (sweep := sweep_of_this_job()) is not None:  # a job of a multirun: Hydra ignores hydra.run.dir there
            how = (f"continue the sweep with the same command plus `resume=true hydra.sweep.dir={sweep}` (its "
                   "finished runs are kept as they are)")
        if SLURMEnvironment.detect():
            how = f"a requeued SLURM job resumes by itself from its newest checkpoint there; by hand, {how}"
        if trainer.state.fn == "test":
            how = f"{how} (training had finished; that tests its best checkpoint)"
        log.error("interrupted by %s at step %d (epoch %d), before the run finished (no metrics.json): %s; %s. "
                  "Exit code %d.", signal_name, trainer.global_step, trainer.current_epoch, kept, how, code)
    return code


def tested_words(tested: str | None, mode: str, weights: list[str]) -> str:
    """What a test scored, for messages: its checkpoint, or the weights it used without one."""
    if tested:
        return f"checkpoint {tested}"
    if mode != "train":
        return f"the published weights ({', '.join(weights)})" if weights else "the network as built"
    return "the weights at the end of fit (no best checkpoint: no validation chose one)"


def checkpoint_length(ckpt: str) -> tuple[int, int]:
    """How far the fit of ``ckpt`` went: (epochs completed, global step), as a Trainer resumed from it counts them
    (``current_epoch``: the epochs its fit loop processed, counted complete on restore)."""
    from suite.checkpoint_io import safe_torch_load

    saved = safe_torch_load(ckpt, f"ckpt_path={ckpt}", mmap=True)
    try:
        epochs = int(saved["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):  # a checkpoint without loops: its epoch, counted as begun
        epochs = int(saved.get("epoch") or 0)
    return epochs, int(saved.get("global_step") or 0)


def past_its_length(length: tuple[int, int], limits, ckpt: str) -> str | None:
    """For a fit resumed from ``ckpt`` at ``length`` (epochs, global step): why it is refused, when the checkpoint is
    past the run's length (``limits``: a trainer or the ``trainer`` config; ``max_epochs``/``max_steps`` lowered
    on resume, or a sweep resumed with its values in another order): the run would be tested, or its finished
    record kept, under a config it was not trained with. None when the checkpoint is at or before the run's end."""
    (epochs, steps), get = length, (limits.get if isinstance(limits, Mapping) else
                                    lambda key, default=None: getattr(limits, key, default))
    max_epochs, max_steps, over = get("max_epochs"), get("max_steps", -1), []
    if max_epochs is not None and 0 <= max_epochs < epochs:
        over.append(f"{epochs} epochs, past trainer.max_epochs={max_epochs}")
    if max_steps is not None and 0 <= max_steps < steps:
        over.append(f"{steps} steps, past trainer.max_steps={max_steps}")
    if not over:
        return None
    return (f"ckpt_path={ckpt} has trained {' and '.join(over)}: this run would train nothing and record a length it "
            "was not trained for. Resume it with its own trainer.max_epochs/max_steps (its resolved_config.yaml "
            "has them) or a longer one; to test it, `mode=test ckpt_path=" + str(ckpt) + "`; or start afresh in a "
            "new directory (leave hydra.run.dir out).")


def sweep_of_this_job() -> Path | None:
    """The folder of the multirun (``-m``) this run is a job of; None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(str(HydraConfig.get().sweep.dir)).absolute()


def import_what_it_runs(cfg: DictConfig) -> None:
    """Import, before the run's clock starts, the modules a run of ``cfg`` imports: Lightning, the suite's
    machinery, its task's and its data's, W&B's. Imports are the process's cost, not the run's: a single run
    imported Lightning before its clock (Hydra's run-start callback), the first job of a local multirun inside it,
    so that job's ``wall_time_s`` was 4 s longer than the same job's after it (a run of 4 s: twice as long), and
    the first variant's wall time in ``mode=report`` the longer."""
    import contextlib

    import lightning  # noqa: F401
    from hydra.utils import get_class

    import suite.compose  # noqa: F401
    import suite.run_dirs  # noqa: F401

    for section in ("task", "data"):
        target = (cfg.get(section) or {}).get("_target_")
        with contextlib.suppress(Exception):  # an unknown class: the run's own checks say so, with the fix
            get_class(str(target))
    # W&B's import; not its service process, which the first wandb.init of a process starts (1 s)
    if (cfg.get("logger") or {}).get("name") == "wandb":
        with contextlib.suppress(Exception):  # a W&B that does not import: suite.loggers says so and goes on
            import wandb  # noqa: F401


def finished_already(trainer, out_dir: Path) -> dict | None:
    """For a run resumed (``resume=true``, ``ckpt_path=last``, a requeued SLURM job) from a checkpoint at the end of
    its fit: its recorded metrics when its ``metrics.json`` is written (it is finished, and its record stays as it
    was: it was rewritten with the test metrics alone, so the job script of a sweep run again to finish its
    unfinished runs lost the training and validation metrics of every finished one); None when there is none
    to keep (killed while testing: the run tests and writes it)."""
    from suite.run_record import read_metrics

    metrics_file = out_dir / "metrics.json"
    try:
        recorded = read_metrics(metrics_file)
    except (OSError, ValueError):
        return None
    if trainer.is_global_zero:
        log.info("this run had finished already (step %d, epoch %d; its checkpoint is at the end of the fit): "
                 "%s is kept as it is, nothing was trained or tested. To train it longer, raise trainer.max_epochs "
                 "(or trainer.max_steps) with resume=true; to test it again, `mode=test ckpt_path=last "
                 "hydra.run.dir=%s` writes its own record.", trainer.global_step, trainer.current_epoch,
                 metrics_file, out_dir)
    kept = {k: v for k, v in recorded.items() if isinstance(v, (int, float))}
    if isinstance(recorded.get("undefined"), dict):  # metrics its data left undefined: its check passes over them
        kept["undefined"] = recorded["undefined"]
    return kept


def trained_nothing(trainer) -> str:
    """The message for a fit that ended without a single training step (nothing to test as a trained network)."""
    return (f"mode=train took no training step: the training loop got no batch (on {trainer.world_size} "
            "process(es)), so there is no trained network to test and no checkpoint was written. Typical causes: "
            "++trainer.limit_train_batches=0, or fewer training batches than processes (lower trainer.devices or "
            "data.batch_size, or use more training data). To test weights without training, use mode=test with "
            "ckpt_path=... or model.weights=....")


def build_trainer(config: dict, module, out_dir: Path, loggers: list, identity: dict, started: float):
    """The Trainer of ``config["trainer"]`` with the suite's callbacks: the config's own (``callbacks``), the
    checkpoints, random-state saving, the run's record (from ``started``, ``time.perf_counter()`` at the run's start),
    the non-finite loss guard, the throughput meter, with ``trainer.compile`` the networks' compilation
    (``suite/compile.py``) and, with a logger, the learning rate monitor. The suite's own trainer options
    (``on_nan``, ``compile*``, ``tf32``) are taken out before the rest reaches Lightning's Trainer. Returns the
    trainer and ``{"best", "guard", "meter", "compiler", "record"}``, read after the run (``compiler`` None when not
    compiling)."""
    import lightning as L
    from hydra.utils import instantiate

    from suite.checkpoint_io import SafeCheckpointIO
    from suite.checkpoints import checkpoint_callbacks
    from suite.compile import CompileNetworks, take_options
    from suite.determinism import configure as configure_determinism
    from suite.distributed import adjust_trainer_kwargs, check_launch
    from suite.guard import NonFiniteGuard
    from suite.resume import EpochMeans, FitRecord, RandomState, SupersededRecord
    from suite.sigterm import AgreedSigterm
    from suite.true_precision import MetricDtypes, float16_on_cpu
    from suite.tf32 import apply as apply_tf32
    from suite.tf32 import describe as describe_tf32
    from suite.tf32 import install_hint_filter
    from suite.tf32 import take_option as take_tf32
    from suite.callbacks import TrainThroughput
    from datamodules.loaders import LoaderPosition

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
    record = FitRecord(started)
    stop = AgreedSigterm()
    callbacks += [best, last, run_identity, RandomState(), EpochMeans(), record, guard, stop, MetricDtypes(),
                  SupersededRecord(out_dir), LoaderPosition()]
    compiling = take_options(trainer_kwargs)
    tf32 = take_tf32(trainer_kwargs)
    install_hint_filter(tf32)  # Lightning's Tensor Cores hint names trainer.tf32
    if tf32 is not None:  # float32 matrix products and convolutions alike, before anything runs
        apply_tf32(tf32)
        log.info("trainer.tf32=%s: float32 matrix products and cuDNN convolutions in %s", str(tf32).lower(),
                 describe_tf32(tf32))
    compiler = CompileNetworks(compiling["backend"], compiling["mode"], compiling["dynamic"]) \
        if compiling["compile"] else None
    if compiler is not None:
        callbacks.append(compiler)
    if loggers:
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(logging_interval="epoch"))
    adjust_trainer_kwargs(trainer_kwargs, module)
    configure_determinism(trainer_kwargs)  # trainer.deterministic: CUBLAS_WORKSPACE_CONFIG before CUDA starts
    float16_on_cpu(trainer_kwargs)  # 16-mixed on a CPU is float16, not Lightning's bf16 under the name 16-mixed
    # Checkpoints are written atomically (temporary file, fsync, rename) and read with weights_only=True.
    plugins = list(trainer_kwargs.pop("plugins", None) or []) + [SafeCheckpointIO()]
    trainer = L.Trainer(**trainer_kwargs, callbacks=callbacks, logger=loggers or False, plugins=plugins,
                        default_root_dir=str(out_dir))
    check_launch(trainer, str(trainer_kwargs.get("strategy") or "") or None)
    return trainer, {"best": best, "guard": guard, "meter": meter, "compiler": compiler, "record": record,
                     "stop": stop}


def finish_metrics(metrics: dict[str, float], guard, datamodule, trainer) -> dict[str, float]:
    """The run's final metrics: skipped batches and files counted (and the files named again at the end, where
    they are seen; under DDP those of every process: each loads its own share, and drops its own bad ones when it
    loads them); last-batch values (``*_step``, and the training metrics a task logs per step only, its
    ``step_metrics``: segmentation's and the GAN's), which differ per process and say little, left out."""
    if guard.skipped:
        metrics["train/skipped_batches"] = float(len(guard.skipped))
    skipped = list(getattr(datamodule, "skipped", None) or [])
    if trainer.world_size > 1:
        import torch.distributed as dist

        shares: list = [None] * trainer.world_size
        dist.all_gather_object(shares, skipped)
        skipped = list(dict.fromkeys(entry for share in shares for entry in share))
    if skipped:  # data.on_bad_file=skip: what was left out
        metrics["data/skipped"] = float(len(skipped))
    if skipped and trainer.is_global_zero:
        log.warning("data.on_bad_file=skip left out %d bad file(s)/sample(s): %s%s", len(skipped),
                    "; ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    per_step = set(getattr(trainer.lightning_module, "step_metrics", ()))
    return {k: v for k, v in sorted(metrics.items()) if not k.endswith("_step") and k not in per_step}


def write_metrics(metrics: dict, module, config: dict, tested: str | None, trainer, wall_time: float, meter,
                  out_dir: Path, loggers: list, compiler=None, code: list | None = None,
                  settings: list | None = None, val_is_test: bool | None = None,
                  chosen_in: dict | None = None) -> None:
    """``metrics.json`` (the metrics and, beside them, what mode=report needs: wall time, peak memory,
    params/FLOPs, throughput, protocol; with ``trainer.compile``, the compile time), printed too, and the run
    record sent to W&B."""
    from suite.checkpoint_io import atomic_write_text
    from suite.run_record import metrics_text, record

    extra = record(module, config, tested, trainer.strategy.root_device.type, wall_time, meter, compiler, code,
                   settings, val_is_test, chosen_in, trainer.world_size)
    atomic_write_text(out_dir / "metrics.json", metrics_text({**metrics, **extra}))
    print("\n".join(f"{k:>24} {v:.4f}" for k, v in metrics.items()))
    print("\n".join(f"{k:>24} {v:.6g}" for k, v in extra.items() if isinstance(v, (int, float))))
    print(f"{'protocol':>24} {json.dumps(extra['protocol'])}")
    if "provenance" in extra:
        print(f"{'provenance':>24} {json.dumps(extra['provenance'])}")
    print(f"metrics written to {out_dir / 'metrics.json'}")
    log_record(loggers, extra)


def validates_on_test(datamodule) -> bool | None:
    """Whether the data module, set up, validates on its test split (one data set for both); None where it has no
    such splits (the GAN's)."""
    val, test = getattr(datamodule, "val_set", None), getattr(datamodule, "test_set", None)
    return None if val is None or test is None else val is test


def log_record(loggers, extra: dict) -> None:
    """The run's cost (as metrics: in the run's summary), protocol, provenance and tested checkpoint (as config) to
    W&B, so that ``report.wandb=`` finds there what metrics.json holds (a test's ``tested``: the seed and config its
    checkpoint was trained with, by which the report groups it)."""
    from lightning.pytorch.loggers import WandbLogger

    numbers = {k: float(v) for k, v in extra.items() if isinstance(v, (int, float))}
    for logger in loggers:
        if not isinstance(logger, WandbLogger):  # a CSV logger is finalised already; metrics.json has it all
            continue
        try:
            logger.log_metrics(numbers)
            logger.log_hyperparams({k: extra[k] for k in ("protocol", "provenance", "tested") if k in extra})
        except Exception as err:  # noqa: BLE001 - a logger never loses a run
            log.warning("could not log the run record to %s: %s", type(logger).__name__, err)


