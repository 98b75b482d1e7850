#!/usr/bin/env python
"""The suite's one command: ``python run.py task=modelnet attn=external``.

Composes ``configs/config.yaml`` with the groups task, attn, data, trainer,
logger and experiment, then runs ``mode``:

- ``train`` (default): fit, then test the best checkpoint;
- ``test``: test ``ckpt_path`` (``eval`` is the same: the GAN task's name for it);
- ``summary``: per-module parameters and FLOPs, ending ``params=<int> flops=<int>``
  (a task with several networks, like the GAN's G and D, prints each first).
- ``bench``: what every attention variant costs on this machine (``benchmarks/cost.py``, ``configs/bench``).
- ``report``: the comparison of finished runs (``report.runs=<dir>[,<dir>...]`` or ``report.wandb=``): seeds
  aggregated, every variant against a baseline, cost and protocol per row (``suite/report.py``, ``configs/report``).

A task may carry ``attn_presets: {<variant>: {option: value}}``: the options
its paper uses for that variant (SAGAN's block for ``self``), applied under
any ``attn.<option>=`` given on the command line.

Train and test print their metrics and write ``metrics.json`` to Hydra's run
directory, with the run's wall time, peak memory, params and FLOPs per sample, training
throughput and evaluation protocol (``suite/run_record.py``). User errors print one
message and exit with code 2.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from attention.errors import UserError

CONFIGS = Path(__file__).resolve().parent / "configs"
GROUPS = ("task", "attn", "data", "model", "trainer", "logger", "experiment")
MODES = ("train", "test", "eval", "summary", "bench", "report")
log = logging.getLogger("run")


def user_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_stamp() -> str:
    """The last part of a run's directory (``${run_stamp:}`` in configs/config.yaml): the start time, or
    ``slurm-<job id>`` inside a SLURM batch job (interactive ``bash`` / ``interactive`` allocations, which host
    many runs, keep the time, as Lightning's SLURM detection does)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"slurm-{job}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)


def check_group_choices(argv: list[str]) -> None:
    """Reject ``group=unknown`` before Hydra does, listing the choices, with exit code 2. Sweeps are parsed as
    Hydra parses them: each choice of ``attn=self,offset`` or ``choice(...)`` is checked, and ``glob(...)`` must
    match at least one config of the group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # not ours to report: Hydra's own message names the bad override
        key = override.key_or_group
        if key not in GROUPS or override.value() is None:
            continue
        available = sorted(p.stem for p in (CONFIGS / key).glob("*.yaml"))
        value = override.value()
        if isinstance(value, Glob):
            if not value.filter(available):
                user_error(f"{arg!r} matches no {key} config. Available {key} choices: {', '.join(available)} "
                           f"(configs/{key}/). Example: `python run.py -m '{key}=glob(*)'`.")
            continue
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(value)]
        for choice in choices:
            if choice and choice != "null" and choice not in available:
                user_error(f"unknown {key} {choice!r}. Available {key} choices: {', '.join(available)} "
                           f"(configs/{key}/). Example: `python run.py {key}={available[0]}`.")


def run(cfg: DictConfig) -> dict:
    if cfg.mode not in MODES:
        raise UserError(f"mode={cfg.mode!r} is not known: use one of {', '.join(MODES)}.")
    if cfg.mode == "report":  # reads finished runs: trains nothing, needs neither Lightning nor data
        from suite.report import report

        return report(cfg)

    import lightning as L
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class, instantiate

    from suite.loggers import build_loggers, close_loggers

    if cfg.mode == "bench":  # no data or task: the attention package and the machine
        from benchmarks.cost import bench

        return bench(cfg)
    started = time.perf_counter()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    # Library chatter a user cannot act on: Lightning's own pytree deprecation, ThroughputMonitor's request
    # for a FLOP count (samples/s is what we log), and the litlogger advertisement.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r".*you need to define a `flops_per_batch`.*")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "litlogger" not in r.getMessage())
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        # Lightning's messages (restored checkpoints, SLURM requeues) once each, through Hydra's console and
        # run.log handlers: drop any handler of Lightning's own, which would print every line twice.
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    overrides = list(HydraConfig.get().overrides.task)
    apply_attn_preset(cfg, overrides)
    L.seed_everything(cfg.seed, workers=True)
    from suite.secrets import redact, redact_file

    # Everything that is logged, saved or printed comes from the redacted copy (no API keys or tokens from
    # the environment); only the data module sees the config as given.
    container = redact(OmegaConf.to_container(cfg, resolve=True))
    if is_rank_zero():
        # What actually ran: interpolations resolved and task presets applied (.hydra/config.yaml holds the input).
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(container, out_dir / "resolved_config.yaml")
        for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
            redact_file(out_dir / ".hydra" / name)

    from suite.distributed import check_scale_rule
    from suite.validate import validate_config

    check_scale_rule((cfg.get("optim") or {}).get("scale_lr"))  # before any data is read
    validate_config(cfg, overrides)
    datamodule = instantiate(cfg.data, _convert_="all")
    if cfg.mode != "summary":
        # Check the data before building the network: a missing data set is reported before any weights
        # are fetched. setup() loads once; Lightning's own call later finds it done.
        datamodule.setup("fit" if cfg.mode == "train" else "test")
    task_kwargs = {k: v for k, v in container["task"].items() if k != "name"}
    # The task gets what it asks for by name from the data module (num_classes, category_parts, ...).
    wanted = inspect.signature(get_class(task_kwargs["_target_"])).parameters
    from_data = {k: getattr(datamodule, k) for k in wanted if k not in task_kwargs and hasattr(datamodule, k)}
    module = instantiate(task_kwargs, **from_data, model=container["model"], attn=container["attn"],
                         optim=container["optim"], _convert_="all", _recursive_=False)  # optim built in the module

    if cfg.mode == "summary":
        from suite.summary import summarize

        parts = module.summaries() if hasattr(module, "summaries") else [("", module.net, module.example_input_array)]
        result = {"params": 0, "flops": 0}
        for name, net, example in parts:
            table, params, flops = summarize(net, example)
            print(table)
            if name:
                print(f"params_{name}={params} flops_{name}={flops}\n")
                result.update({f"params_{name}": params, f"flops_{name}": flops})
            result["params"] += params
            result["flops"] += flops
        print(f"params={result['params']} flops={result['flops']}")
        return result

    from suite.checkpoint_io import SafeCheckpointIO
    from suite.distributed import adjust_trainer_kwargs, apply_lr_scaling, check_launch
    from suite.guard import NonFiniteGuard
    from suite.resume import RandomState, resume_checkpoint, save_wandb_run_id, wandb_run_id
    from suite.run_record import record, reset_peak_memory, throughput_meter

    reset_peak_memory()

    ckpt = cfg.get("ckpt_path")
    if cfg.mode == "train" or ckpt == "last":
        ckpt = resume_checkpoint(ckpt, cfg.mode == "train" and bool(cfg.get("resume")), out_dir)
    if (cfg.mode in ("test", "eval") or ckpt) and not (ckpt and Path(ckpt).is_file()):
        raise UserError(f"mode={cfg.mode} needs an existing checkpoint: ckpt_path={ckpt!r} is "
                        f"{'not set' if not ckpt else 'not a file'}. Pass e.g. "
                        "`ckpt_path=outputs/.../checkpoints/last.ckpt`.")
    identity = {"task": cfg.task.name, "attn": container["attn"]}
    if ckpt:
        check_checkpoint(ckpt, identity)
    # A resumed run (ckpt_path=last / resume=true, or a SLURM requeue, whose hpc checkpoint Lightning finds
    # itself) logs into the W&B run it started, whose id is kept beside its checkpoints.
    resuming = cfg.mode == "train" and (ckpt is not None or (
        bool(os.environ.get("SLURM_JOB_ID")) and any(out_dir.glob("hpc_ckpt_*.ckpt"))))
    run_id = wandb_run_id(out_dir, resuming) if cfg.logger.get("name") == "wandb" else None
    if run_id and cfg.mode == "train" and is_rank_zero():
        save_wandb_run_id(out_dir, run_id)
    loggers = build_loggers(cfg.logger, out_dir, container, run_id=run_id, resuming=resuming)
    callbacks = [instantiate(c) for c in (container.get("callbacks") or {}).values() if c]
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out_dir / "checkpoints", filename="best-epoch{epoch:03d}-step{step:06d}", monitor=cfg.monitor.metric,
        mode=cfg.monitor.mode, auto_insert_metric_name=False)
    # last.ckpt after every validation, improved or not: Lightning's save_last=True rewrites it only when a
    # best checkpoint is saved, so a pre-empted run would lose every epoch since its last improvement.
    last = L.pytorch.callbacks.ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="last", monitor=None,
                                               save_top_k=1, enable_version_counter=False)
    trainer_kwargs = dict(container["trainer"])
    guard = NonFiniteGuard(trainer_kwargs.pop("on_nan", "stop"))
    meter = throughput_meter()
    callbacks += [checkpoint, last, identity_callback(identity), RandomState(), guard, meter]
    if loggers:
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(logging_interval="epoch"))
    adjust_trainer_kwargs(trainer_kwargs, module)
    # Checkpoints are written atomically (temporary file, fsync, rename) and read with weights_only=True.
    plugins = list(trainer_kwargs.pop("plugins", None) or []) + [SafeCheckpointIO()]
    trainer = L.Trainer(**trainer_kwargs, callbacks=callbacks, logger=loggers or False, plugins=plugins,
                        default_root_dir=str(out_dir))
    check_launch(trainer)
    if cfg.mode == "train":
        apply_lr_scaling(module.hparams.optim, trainer, int(datamodule.batch_size))

    metrics: dict[str, float] = {}
    if cfg.mode == "train":
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)  # resumes when ckpt_path is given
        metrics.update(_floats(trainer.callback_metrics))
        best = checkpoint.best_model_path or None
        results = trainer.test(module, datamodule=datamodule, ckpt_path=best, weights_only=True)
        if best:
            log.info("tested best checkpoint %s", best)
        tested = best
    else:
        results = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
        tested = ckpt
    for result in results:
        metrics.update(_floats(result))
    if guard.skipped:
        metrics["train/skipped_batches"] = float(len(guard.skipped))
    skipped = list(getattr(datamodule, "skipped", None) or [])
    if skipped:  # data.on_bad_file=skip: what was left out, reported again at the end where it is seen
        metrics["data/skipped"] = float(len(skipped))
        log.warning("data.on_bad_file=skip left out %d bad file(s)/sample(s): %s%s", len(skipped),
                    "; ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    # Last-batch values (``*_step``) differ per process and say little about a run: epoch means stand for them.
    metrics = {k: v for k, v in sorted(metrics.items()) if not k.endswith("_step")}
    log.info("rank %d metrics: %s", trainer.global_rank, json.dumps(metrics))  # each process logs what it saw
    if trainer.is_global_zero:
        # Beside the metrics, what mode=report needs: wall time, peak memory, params/FLOPs, throughput, protocol.
        extra = record(module, container, tested, trainer.strategy.root_device.type, started,
                       meter if cfg.mode == "train" else None)
        (out_dir / "metrics.json").write_text(json.dumps({**metrics, **extra}, indent=2) + "\n")
        print("\n".join(f"{k:>24} {v:.4f}" for k, v in metrics.items()))
        print("\n".join(f"{k:>24} {v:.6g}" for k, v in extra.items() if isinstance(v, (int, float))))
        print(f"{'protocol':>24} {json.dumps(extra['protocol'])}")
        print(f"metrics written to {out_dir / 'metrics.json'}")
        log_record(loggers, extra)
    close_loggers(loggers)
    return metrics


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


def is_rank_zero() -> bool:
    """Before the Trainer exists: the first process of the first node (Lightning's and SLURM's variables)."""
    return all(int(os.environ.get(v, 0)) == 0 for v in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))


def apply_attn_preset(cfg: DictConfig, overrides) -> None:
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


def identity_callback(identity: dict):
    """A callback storing the task name and attention config in every checkpoint (``checkpoint["suite"]``)."""
    import lightning as L

    class RunIdentity(L.pytorch.callbacks.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            checkpoint["suite"] = identity

    return RunIdentity()


def check_checkpoint(path: str, identity: dict) -> None:
    """Refuse a checkpoint written by another task or attention variant, naming what it was trained with."""
    import attention
    from suite.checkpoint_io import safe_torch_load

    state = safe_torch_load(path, f"ckpt_path={path}", mmap=True)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise UserError(f"ckpt_path={path} is not a Lightning checkpoint (no 'state_dict' entry): pass a checkpoint "
                        "written by run.py (outputs/<task>/<attn>/<run>/checkpoints/*.ckpt).")
    stored = state.get("suite")
    if not stored:
        return  # written before checkpoints carried their identity: Lightning reports any mismatch
    if stored["task"] != identity["task"]:
        raise UserError(f"ckpt_path={path} was trained with task={stored['task']}, but this run has "
                        f"task={identity['task']}: pass task={stored['task']} (and its attn) or another checkpoint.")
    want, have = stored["attn"], identity["attn"]
    # An option added to a variant after the checkpoint was written counts as its default there.
    default = attention.options(want.get("name")) if want.get("name") in attention.names() else {}

    def value(cfg, key):
        v = cfg.get(key, default.get(key))
        return list(v) if isinstance(v, tuple) else v

    keys = sorted(k for k in set(want) | set(have) if value(want, k) != value(have, k))
    if keys:
        diff = ", ".join(f"attn.{k}={value(want, k)!r} (here {value(have, k)!r})" for k in keys)
        raise UserError(f"ckpt_path={path} was trained with attn={want.get('name')} and options differing from this "
                        f"run's: {diff}. Pass attn={want.get('name')} with the same options to load it.")


def _floats(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from suite.errors import as_user_error

    try:
        run(cfg)
    except Exception as err:  # a UserError (or an option error of Lightning/torch) is a message, a bug a traceback
        cause = as_user_error(err)
        if cause is None:
            raise
        user_error(str(cause))


def quote_report_runs(argv: list[str]) -> list[str]:
    """``report.runs=a,b`` as the list ``report.runs=['a','b']``: Hydra would read the commas as a sweep (and any
    path holding ``:``, ``=`` or spaces needs quoting), so each folder is passed quoted."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "report.runs" and value and value[0] not in "[\"'" and value != "null":
            folders = ",".join("'" + v.replace("'", "\\'") + "'" for v in value.split(",") if v)
            arg = f"{key}=[{folders}]"
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.argv[1:] = quote_report_runs(sys.argv[1:])
    check_group_choices(sys.argv[1:])
    main()
