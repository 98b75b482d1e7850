"""Start-up checks of the composed config: impossible combinations caught before any data is read.

Each check raises a UserError naming the options involved. ``suite.compose`` calls
:func:`validate_config` right after composing the config; a task class may add
its own checks as a ``check_config(cfg)`` classmethod of ``tasks.base.Task`` (called here too).

- an attention option given on the command line that the task's layout ignores
  (``attn.expand_size=5`` on a point-cloud task: focal's expand band exists on
  grids only), from each variant's ``layout_options`` and the task class's
  ``layout``;
- more processes than evaluation samples (``data.num_test=1 trainer=ddp``): a
  rank would get no sample;
- ``trainer.on_nan`` not one of stop | skip | off;
- ``trainer.tf32`` not true, false or null;
- ``trainer.compile_backend`` not a torch.compile backend, or ``trainer.compile_mode`` given to another backend
  than inductor (``suite/compile.py``);
- a trainer, optim, data or model option of the wrong type or out of range (``trainer.max_epochs=abc``,
  ``optim.optimizer.lr=-1``, ``data.num_workers=-1``, ``model.neighbours=0``), against the schemas of
  ``suite.schema``;
- ``trainer.val_check_interval`` (batches) not a multiple of ``trainer.accumulate_grad_batches``; as a fraction of
  the epoch, checked when training starts (:func:`check_validation_batches`);
- ``monitor`` (the metric and direction that choose the best checkpoint, which the test uses) naming a metric the
  task's validation does not log, or the direction it does not improve in (``monitor.metric=val/loss
  monitor.mode=max``), against the task's ``validation_metrics``: Lightning found the first at the end of the first
  epoch (a traceback), and took the second as asked (the worst checkpoint tested, exit 0);
- ``ckpt_path`` a file that is no torch checkpoint at all (``ckpt_path=/etc/passwd``);
- a weights file of the task's ``weights_options`` (``model.weights=PATH``) that does not exist or is no torch
  file (whether its tensors fit the network is checked when they are loaded, after the data).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

import attention
from attention.errors import UserError

EVAL_SIZE_KEYS = ("num_val", "num_test", "val_samples", "test_samples")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def validate_config(cfg: DictConfig, overrides: Iterable[str]) -> None:
    from suite.compile import check_options as check_compile_options
    from suite.guard import MODES

    on_nan = cfg.trainer.get("on_nan", "stop")
    if on_nan not in MODES:
        raise UserError(f"trainer.on_nan={on_nan!r} is not known: use stop (end the run at the first NaN/inf "
                        "loss), skip (drop such batches and count them) or off (no check).")
    check_option_types(cfg, overrides)
    check_compile_options(OmegaConf.to_container(cfg.trainer, resolve=True))
    check_accumulation(cfg.trainer)
    check_precision_available(cfg.trainer)
    check_half_precision_eps(cfg)
    check_checkpoint_format(cfg.get("ckpt_path"))
    task_cls = get_class(cfg.task._target_)
    check_weights_files(cfg, task_cls)
    check_layout_options(cfg, overrides, task_cls.layout)
    check_eval_sizes(cfg)
    check_monitor(cfg, task_cls)
    task_cls.check_config(cfg)


def check_monitor(cfg: DictConfig, task_cls) -> None:
    """``monitor.metric`` one of the metrics the task's validation logs, ``monitor.mode`` the direction it improves
    in (module docstring). A task that declares no ``validation_metrics`` is not checked."""
    monitor = cfg.get("monitor") or {}
    metric, mode = monitor.get("metric"), monitor.get("mode")
    logged = dict(task_cls.validation_metrics(cfg))
    choices = ", ".join(f"{name} ({way})" for name, way in logged.items())
    task = f"task={cfg.task.get('name', task_cls.__name__)}"
    if mode not in ("max", "min"):
        raise UserError(f"monitor.mode={mode!r} is not known: use max (a metric that improves upwards, such as an "
                        "accuracy) or min (one that improves downwards, such as a loss)"
                        + (f"; {task} validates {choices}." if logged else "."))
    if not logged:
        return
    if metric not in logged:
        raise UserError(f"monitor.metric={metric!r} is not a metric that {task}'s validation logs: it chooses the "
                        "best checkpoint (the one the test uses), and the run would fail at its first validation, "
                        f"its training until then lost. Choose one of {choices}, e.g. "
                        f"`monitor.metric={next(iter(logged))} monitor.mode={next(iter(logged.values()))}`.")
    if mode != logged[metric]:
        better = "higher" if logged[metric] == "max" else "lower"
        raise UserError(f"monitor.mode={mode} with monitor.metric={metric}, which is better {better}: the "
                        f"\"best\" checkpoint, the one the test uses, would be the worst validation's. Use "
                        f"`monitor.mode={logged[metric]}`.")


def check_accumulation(trainer: DictConfig) -> None:
    """A validation every ``trainer.val_check_interval`` training batches (Lightning counts batches, not optimizer
    steps) that falls inside a gradient accumulation window: its checkpoints (``last.ckpt``) hold no gradients, so a
    run resumed from one steps with the rest of the window's batches alone, not the run that never stopped."""
    every, accumulate = trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches") or 1
    if isinstance(every, int) and not isinstance(every, bool) and isinstance(accumulate, int) and accumulate > 1 \
            and every % accumulate:
        raise UserError(f"trainer.val_check_interval={every} is not a multiple of trainer.accumulate_grad_batches="
                        f"{accumulate}: Lightning counts training batches, so validations and the checkpoints written "
                        "with them would fall inside an accumulation window, whose gradients no checkpoint holds (a "
                        "run resumed there would not be the run that never stopped). Give a multiple, e.g. "
                        f"trainer.val_check_interval={every - every % accumulate or accumulate}.")


def check_precision_available(trainer: DictConfig) -> None:
    """``trainer.precision=transformer-engine[-float16]`` needs NVIDIA's Transformer Engine: without it Lightning
    raised a ModuleNotFoundError when the Trainer was built, after the data was set up, as a traceback (exit 1)."""
    precision = str(trainer.get("precision"))
    if not precision.startswith("transformer-engine"):
        return
    from lightning.fabric.plugins.precision.transformer_engine import _TRANSFORMER_ENGINE_AVAILABLE

    if not _TRANSFORMER_ENGINE_AVAILABLE:
        raise UserError(f"trainer.precision={precision} runs the networks' linear layers through NVIDIA's Transformer "
                        "Engine (FP8, on NVIDIA GPUs of the Hopper generation and later), which is not installed "
                        "here (Lightning needs transformer_engine>=0.11). Install it on a GPU machine (`pip install "
                        "transformer_engine[pytorch]`), or use trainer.precision=bf16-mixed (or 16-mixed), which "
                        "every task runs, e.g. `python run.py trainer.precision=bf16-mixed`.")


def check_half_precision_eps(cfg: DictConfig) -> None:
    """``trainer.precision=16-true`` keeps the optimiser's state in float16, where an Adam ``eps`` below float16's
    smallest number (6e-8; classification's AdamW has 1e-8) is 0: the first update divides by zero where a
    gradient's second moment is 0, the weights become NaN or infinite, and the run exited 0 with a NaN val/test loss
    (the non-finite guard watches the training loss, which the first steps still had finite)."""
    import torch

    if str(cfg.trainer.get("precision")) != "16-true" or not cfg.get("optim"):
        return
    problems = []

    def walk(node, path: str) -> None:
        if not isinstance(node, dict):
            return
        target = f"{node.get('_target_', '')} {node.get('opt', '')}".lower()
        eps = node.get("eps", 1e-8 if "_target_" in node and "adam" in target else None)  # torch's and timm's default
        if isinstance(eps, (int, float)) and eps > 0 and torch.tensor(float(eps), dtype=torch.float16).item() == 0:
            problems.append(f"{path}.eps={eps:g}" + ("" if "eps" in node else " (the default)"))
        for key, value in node.items():
            walk(value, f"{path}.{key}")

    walk(OmegaConf.to_container(cfg.optim, resolve=True), "optim")
    if problems:
        raise UserError("trainer.precision=16-true keeps the optimiser's state in float16, where "
                        f"{', '.join(problems)} is 0: the first update divides by zero and the weights become NaN. Use "
                        "trainer.precision=16-mixed or bf16-mixed (float32 weights and optimiser state), bf16-true, or "
                        f"an eps float16 holds, e.g. {problems[0].split('=')[0]}=1e-4.")


def check_validation_batches(trainer) -> None:
    """:func:`check_accumulation` for a ``trainer.val_check_interval`` given as a fraction of the epoch (0.25:
    four validations an epoch), once Lightning has turned it into a number of training batches (``val_check_batch``,
    known when training starts, after the data is set up): a validation inside an accumulation window writes
    ``last.ckpt`` there. Validations at the end of the epoch are fine (Lightning steps with the epoch's last batch)."""
    every, accumulate = trainer.val_check_batch, trainer.accumulate_grad_batches
    interval = trainer.val_check_interval
    if (accumulate > 1 and isinstance(interval, float) and isinstance(every, int)
            and every < trainer.num_training_batches and every % accumulate):
        raise UserError(f"trainer.val_check_interval={interval} validates every {every} training batches (of "
                        f"{trainer.num_training_batches} an epoch here), not a multiple of "
                        f"trainer.accumulate_grad_batches={accumulate}: the validations, and the checkpoints written "
                        "with them, would fall inside an accumulation window, whose gradients no checkpoint holds (a "
                        "run resumed there would not be the run that never stopped). Give the number of batches "
                        "instead, a multiple, e.g. "
                        f"trainer.val_check_interval={every - every % accumulate or accumulate}.")


def check_seed(seed) -> None:
    """``seed``: a whole number in the range Lightning's ``seed_everything`` takes (numpy's 32 bits)."""
    from lightning.fabric.utilities.seed import max_seed_value, min_seed_value

    if isinstance(seed, bool) or not isinstance(seed, int) or not min_seed_value <= seed <= max_seed_value:
        raise UserError(f"seed={seed!r} is not a seed: it must be a whole number from {min_seed_value} to "
                        f"{max_seed_value} (it seeds python, numpy, torch and the data-loader workers). Fix it on the "
                        "command line or in configs/config.yaml, e.g. `python run.py seed=0` (several seeds: "
                        "`python run.py -m seed=0,1,2`).")


def check_resolves(cfg: DictConfig) -> None:
    """Every interpolation of the composed config resolves; one that names a key the chosen groups lack (a data set
    of another task: task=modelnet data=ade20k has no ``data.npoints``) is a UserError naming both ends."""
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationKeyError as err:
        key, missing = err.full_key, str(err.msg).split("'")[1] if "'" in str(err.msg) else str(err.msg)
        group = missing.split(".", 1)[0]
        choice = chosen(group)
        having = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml")
                        if missing.split(".", 1)[-1] in (OmegaConf.load(p) or {})) if (CONFIGS / group).is_dir() else []
        raise UserError(
            f"{key} is set to ${{{missing}}}, but the {group} config chosen"
            + (f" ({choice})" if choice else "") + f" has no {missing}: it does not fit task={cfg.task.name}. "
            + (f"Choose a {group} config that has it ({', '.join(having)}), e.g. `python run.py task={cfg.task.name} "
               f"{group}={having[0]}`, or drop the {group}= override to use the task's default."
               if having else f"Drop the {group}= override to use the task's default.")
        ) from None
    except InterpolationResolutionError as err:
        raise UserError(f"{err.full_key} cannot be resolved: {' '.join(str(err.msg).split())}. Fix it (or the option "
                        "it refers to) on the command line or in configs/; `python run.py --cfg job` prints the "
                        "composed config.") from None


def chosen(group: str) -> str | None:
    """The config of ``group`` that Hydra composed this run with (``data=ade20k``: ade20k); None outside a run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def check_option_types(cfg: DictConfig, overrides: Iterable[str] = ()) -> None:
    """The trainer, optim, data and model groups against their schemas (known options only; others pass through).
    An option that the command line added (``+trainer.limit_train_batches=...``) is not in the config files, so
    its example fix is given as ``++key=``, which Hydra accepts whether the key is there or not."""
    from suite import schema

    added = {o.split("=", 1)[0].lstrip("+") for o in overrides if o.startswith("+")}

    def group(node: DictConfig, options: type, prefix: str) -> None:
        schema.check(OmegaConf.to_container(node, resolve=True), options, prefix,
                     given=OmegaConf.to_container(node, resolve=False), added=added)

    for prefix, options in schema.TASK_OPTIONS.get((cfg.get("task") or {}).get("name"), {}).items():
        if isinstance(cfg.get(prefix), DictConfig):
            group(cfg[prefix], options, prefix)
    if (cfg.get("task") or {}).get("name") == "gan":  # a feature's options only where it is on: off, not read
        metrics, ema = cfg.get("metrics") or {}, cfg.get("ema") or {}
        for options, prefix, on in ((schema.GanTaskOptions, "task", True), (schema.GanMetricsOptions, "metrics", True),
                                    (schema.GanKidOptions, "metrics", metrics.get("kid", False)),
                                    (schema.GanPrcOptions, "metrics", metrics.get("prc", False)),
                                    (schema.GanEmaOptions, "ema", ema.get("enabled", False))):
            if on and isinstance(cfg.get(prefix), DictConfig):
                group(cfg[prefix], options, prefix)
    # A task's own blocks first: a trainer option set through one of theirs (trainer.val_check_interval through
    # metrics.every_n_steps or eval.every_n_steps) is named as that option; the trainer's before the optim, data and
    # model options set through it (optim.scheduler.T_max through trainer.max_epochs).
    group(cfg.trainer, schema.TrainerOptions, "trainer")
    group(cfg.trainer, schema.CompileOptions, "trainer")
    group(cfg.trainer, schema.ArithmeticOptions, "trainer")
    optim = cfg.get("optim") or {}
    for name, factory in optim.items():  # optim.optimizer, optim.scheduler; the GAN's generator, discriminator
        if isinstance(factory, DictConfig) and "_target_" in factory:
            group(factory, schema.SchedulerOptions if name == "scheduler" else schema.OptimizerOptions, f"optim.{name}")
    if optim:
        group(optim, schema.OptimOptions, "optim")
    group(cfg.data, schema.DataOptions, "data")
    if isinstance(cfg.get("model"), DictConfig):
        group(cfg.model, schema.ModelOptions, "model")


def check_checkpoint_format(ckpt_path) -> None:
    """A ``ckpt_path`` that exists but is no torch file is refused now, not after the data is loaded (a missing one
    is reported by the run, which also resolves ``ckpt_path=last``)."""
    from suite.checkpoint_io import check_torch_file

    if ckpt_path and ckpt_path != "last" and Path(ckpt_path).is_file():
        check_torch_file(ckpt_path, f"ckpt_path={ckpt_path}")


def check_weights_files(cfg: DictConfig, task_cls) -> None:
    from suite.checkpoint_io import check_torch_file

    for option in task_cls.weights_options:
        path = (cfg.get("model") or {}).get(option)
        if path and not Path(str(path)).is_file():
            raise UserError(f"model.{option}={path} is not a file: pass the path of a weights file (a published "
                            f"checkpoint or a state dict of the network), or drop model.{option}.")
        if path:
            try:
                check_torch_file(str(path), f"model.{option}={path}")
            except UserError:
                released = task_cls.released_weights(cfg, option)
                expected = (f"the released weights ({released}) or a state dict of the network saved with torch.save"
                            if released else "a state dict of the network saved with torch.save")
                raise UserError(f"model.{option}={path} is not a PyTorch file (torch.save writes a zip archive that "
                                f"starts with b'PK'): it is truncated, corrupt or something else. Pass {expected}."
                                ) from None


def given_options(overrides: Iterable[str], prefix: str) -> list[str]:
    """Option names given on the command line as ``prefix.<name>=...`` (also with + or ++)."""
    names = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith(prefix + "."):
            names.append(key[len(prefix) + 1:].split(".", 1)[0])
    return names


def check_layout_options(cfg: DictConfig, overrides: Iterable[str], layout: str | None) -> None:
    if layout is None or cfg.attn.name not in attention.names():
        return
    variant = attention.get(cfg.attn.name)
    for option in given_options(overrides, "attn"):
        acts_on = variant.layout_options.get(option)
        if acts_on is not None and layout not in acts_on:
            where = "image grids" if acts_on == {"grid"} else "point sets"
            raise UserError(
                f"attn.{option} was given, but attention variant {cfg.attn.name!r} uses it on {where} only and "
                f"task={cfg.task.name} attends over {'point sets' if layout == 'points' else 'image grids'}, so it "
                f"would be ignored. Drop attn.{option}"
                + (f", or set the option that {cfg.attn.name} uses on {layout}: "
                   + ", ".join(f"attn.{o}" for o, on in variant.layout_options.items() if layout in on)
                   if any(layout in on for on in variant.layout_options.values()) else "")
                + "."
            )


def processes(trainer: DictConfig) -> int | None:
    """devices x num_nodes when both are known numbers (None for devices=auto / -1)."""
    devices = trainer.get("devices", 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer.get("num_nodes", 1) or 1)


def check_eval_sizes(cfg: DictConfig) -> None:
    world = processes(cfg.trainer)
    if not world or world == 1:
        return
    for key in EVAL_SIZE_KEYS:
        value = cfg.data.get(key)
        if isinstance(value, int) and value < world:
            raise UserError(
                f"data.{key}={value} is smaller than the number of processes ({world} = trainer.devices x "
                f"trainer.num_nodes): every process needs at least one evaluation sample. Raise data.{key} to "
                f"at least {world} or run on fewer devices."
            )
