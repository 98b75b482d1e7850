"""Types and ranges of the options every run shares: ``trainer`` (Lightning's and the suite's own ``compile*``),
``optim``, the data modules' common options and the point networks' sampling options.

Each group is a dataclass whose fields are the options it knows, annotated with the type the consumer accepts
(Lightning's ``Trainer`` signature, torch's optimiser and scheduler constructors, the data modules) and, in
``option(...)``, the range and an example value for the message. :func:`check` holds a composed config group against
its schema before anything is built (``suite.validate.validate_config``), so ``trainer.max_epochs=abc`` or
``optim.optimizer.lr=-1`` is refused at once, naming the option, instead of failing after the data is loaded.

Why not ``OmegaConf.structured``: OmegaConf 2.3 has no ``Union`` (``devices``, ``limit_val_batches``, ``precision``
are unions in Lightning) and it converts what it can (``"5"`` to 5), while the values here go to Lightning and torch
unconverted, so the check must be the one they apply. Only the options listed are checked: any other key stays
allowed (``++trainer.<any Lightning argument>``, a new optimiser's arguments), as before. The dataclasses carry no
defaults on purpose: the defaults live in ``configs/`` and in the consumers' signatures, not here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT

from attention.errors import UserError


def option(example: Any, ge: float | None = None, gt: float | None = None, lt: float | None = None,
           batches: bool = False, note: str = "") -> Any:
    """A schema field: bounds for its numbers (each element of a list), ``batches`` for Lightning's batch-count rule
    (a fraction in [0, 1] or a whole number), an example value for the message and a note saying what it means."""
    return dataclasses.field(metadata={"example": example, "ge": ge, "gt": gt, "lt": lt, "batches": batches,
                                       "note": note})


@dataclass
class TrainerOptions:
    """``lightning.Trainer`` arguments a config can hold (its signature's types; ranges from its own checks)."""

    WHERE = "configs/trainer/ (or the trainer block of the task or experiment file that sets it)"

    accelerator: str = option("cpu")
    strategy: str = option("ddp")
    devices: Union[int, str, list[int]] = option(1)
    num_nodes: int = option(1, ge=1)
    precision: Optional[_PRECISION_INPUT] = option("16-mixed")
    fast_dev_run: Union[bool, int] = option("true", ge=0, note="true runs one batch of each stage, n runs n")
    max_epochs: Optional[int] = option(10, ge=-1, note="-1 trains without an epoch limit")
    min_epochs: Optional[int] = option(1, ge=0)
    max_steps: int = option(1000, ge=-1, note="-1 trains without a step limit")
    min_steps: Optional[int] = option(100, ge=0)
    max_time: Union[str, dict[str, int], None] = option("00:12:00:00", note="DD:HH:MM:SS")
    limit_train_batches: Union[int, float, None] = option(0.25, batches=True)
    limit_val_batches: Union[int, float, None] = option(0.25, batches=True)
    limit_test_batches: Union[int, float, None] = option(0.25, batches=True)
    limit_predict_batches: Union[int, float, None] = option(0.25, batches=True)
    overfit_batches: Union[int, float] = option(10, batches=True)
    val_check_interval: Union[int, float, str, dict[str, int], None] = option(
        1.0, batches=True, gt=0, note="a fraction of an epoch, a number of training batches or a time DD:HH:MM:SS")
    check_val_every_n_epoch: Optional[int] = option(1, ge=1)
    num_sanity_val_steps: Optional[int] = option(2, ge=-1, note="-1 runs the whole validation set")
    log_every_n_steps: Optional[int] = option(10, ge=0)
    enable_checkpointing: Optional[bool] = option("true")
    enable_progress_bar: Optional[bool] = option("false")
    enable_model_summary: Optional[bool] = option("false")
    accumulate_grad_batches: int = option(4, ge=1)
    gradient_clip_val: Union[int, float, None] = option(1.0, ge=0)
    gradient_clip_algorithm: Optional[Literal["value", "norm"]] = option("norm")
    deterministic: Union[bool, Literal["warn"], None] = option("true")
    benchmark: Optional[bool] = option("true")
    inference_mode: bool = option("true")
    use_distributed_sampler: bool = option("true")
    profiler: Optional[str] = option("simple")
    detect_anomaly: bool = option("true")
    barebones: bool = option("true")
    sync_batchnorm: bool = option("true")
    reload_dataloaders_every_n_epochs: int = option(1, ge=0)


@dataclass
class CompileOptions:
    """The suite's own trainer options for ``torch.compile`` (``suite/compile.py``), taken out of the trainer group
    before it reaches Lightning; the backend's name is checked against torch's list by ``suite.compile``."""

    WHERE = TrainerOptions.WHERE

    compile: bool = option("true", note="the task's networks under torch.compile")
    compile_backend: str = option("inductor")
    compile_mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = \
        option("max-autotune", note="inductor's; null is its default")
    compile_dynamic: Optional[bool] = option(
        "true", note="null: static, then dynamic sizes where they change; true: dynamic from the start")


@dataclass
class ArithmeticOptions:
    """The suite's own trainer option for float32 arithmetic on GPUs (``suite/tf32.py``), taken out of the trainer
    group before it reaches Lightning."""

    WHERE = TrainerOptions.WHERE

    tf32: Optional[bool] = option("true", note="null: torch's defaults (convolutions TF32, matrix products IEEE); "
                                               "true: both TF32; false: both IEEE float32")


@dataclass
class OptimizerOptions:
    """Each optimiser factory in ``optim`` (``optim.optimizer``, the GAN's ``optim.generator`` and
    ``optim.discriminator``): the arguments torch's optimisers (and timm's ``create_optimizer_v2``) check."""

    WHERE = "the optim block of configs/task/<task>.yaml (or of the experiment file that sets it)"

    lr: float = option(0.01, gt=0, note="the learning rate")
    momentum: float = option(0.9, ge=0)
    dampening: float = option(0.0, ge=0)
    weight_decay: float = option(1.0e-4, ge=0)
    betas: tuple[float, float] = option("[0.9,0.999]", ge=0, lt=1)
    eps: float = option(1.0e-8, ge=0)
    nesterov: bool = option("false", note="true needs momentum > 0 and dampening 0")
    amsgrad: bool = option("true")
    opt: str = option("adamw", note="timm's optimiser name")


@dataclass
class SchedulerOptions:
    """``optim.scheduler``: torch's ``CosineAnnealingLR`` and timm's ``create_scheduler_v2`` arguments."""

    WHERE = OptimizerOptions.WHERE

    T_max: int = option(100, note="epochs of the cosine (usually ${trainer.max_epochs})")
    eta_min: float = option(1.0e-4, ge=0)
    sched: str = option("cosine")
    num_epochs: int = option(300)
    warmup_epochs: int = option(5, ge=0)
    warmup_lr: float = option(1.0e-6, ge=0)
    min_lr: float = option(1.0e-5, ge=0)


@dataclass
class OptimOptions:
    """The ``optim`` block's own options (``optim.scale_lr`` is checked by ``suite.distributed.check_scale_rule``)."""

    WHERE = OptimizerOptions.WHERE

    base_batch_size: Optional[int] = option(512, ge=1, note="the global batch the learning rates were tuned for")
    weight_decay: float = option(1.0e-4, ge=0)
    power: float = option(0.9, ge=0, note="the poly schedule's exponent")
    schedule_steps: int = option(40000, ge=-1, note="the poly schedule's length in steps (-1: by schedule_epochs)")
    schedule_epochs: int = option(100, ge=-1, note="the poly schedule's length in epochs, when schedule_steps=-1")


@dataclass
class ModelOptions:
    """The task networks' sizes and rates that the networks would only refuse in their first forward pass (``knn``
    of 0 neighbours) or with torch's traceback (a dropout of 1.5), or take silently (a GAN without a latent): the
    point networks' sampling (task=modelnet / shapenet), the heads' dropout (and segmentation's head width), the
    GAN's latent and widths, the backbones' stochastic depth. Checked here, before any data is read; a task's
    network without a key skips it."""

    WHERE = "the model block of configs/task/<task>.yaml (or of the experiment file that sets it)"

    samples: list[int] = option("[512,256]", ge=1, note="the farthest-point-sampled centres of each stage")
    neighbours: int = option(32, ge=1, note="the nearest neighbours grouped around each centre")
    dropout: float = option(0.5, ge=0, lt=1, note="the probability of zeroing an activation in the head")
    head_channels: int = option(512, ge=1, note="the segmentation head's width")
    z_dim: int = option(128, ge=1, note="the GAN's latent size")
    g_channels: int = option(256, ge=1, note="the GAN generator's width")
    d_channels: int = option(128, ge=1, note="the GAN discriminator's width")
    drop_path_rate: float = option(0.1, ge=0, lt=1, note="stochastic depth of the transformer backbones")
    token_drop: float = option(0.1, ge=0, lt=1, note="EAMLP's dropout on its token blocks")


@dataclass
class GanTaskOptions:
    """task=gan's own options in the ``task`` block (checked by ``suite.validate``; ``tasks.gan.GAN.check_config``
    checks how they go together)."""

    WHERE = "configs/task/gan.yaml (or the experiment file that sets it)"

    d_steps: int = option(5, ge=1, note="discriminator updates per generator update")
    grid_per_class: int = option(8, ge=1, note="samples of each class in the logged grid")


@dataclass
class SegmentationTaskOptions:
    """task=segmentation's own options in the ``task`` block (checked by ``suite.validate``)."""

    WHERE = "configs/task/segmentation.yaml (or the experiment file that sets it)"

    # a negative weight trained the auxiliary head to be wrong, with exit code 0
    aux_weight: float = option(0.4, ge=0, note="the auxiliary FCN head's loss weight; model.aux=false drops the head")
    log_images: int = option(4, ge=0, note="validation/test images logged to W&B with their masks")


@dataclass
class PointTaskOptions:
    """task=modelnet's and task=shapenet's own options in the ``task`` block (checked by ``suite.validate``)."""

    WHERE = "configs/task/<task>.yaml (or the experiment file that sets it)"

    # torch refused 1.5 in the first training step (a traceback); a negative value trained with exit code 0
    label_smoothing: float = option(0.2, ge=0, lt=1, note="the reference's smoothing: true class 1 - eps")


@dataclass
class SegmentationEvalOptions:
    """task=segmentation's ``eval`` block, where ``suite.validate`` checks it (the rest: ``check_eval``)."""

    WHERE = "configs/task/segmentation.yaml (or the experiment file that sets it)"

    every_n_steps: int = option(2000, ge=1, note="iterations between validations; trainer.val_check_interval's")


# The blocks' schemas of each task that has its own (the GAN's options are checked with its metrics), by block.
TASK_OPTIONS = {"segmentation": {"task": SegmentationTaskOptions, "eval": SegmentationEvalOptions},
                "modelnet": {"task": PointTaskOptions}, "shapenet": {"task": PointTaskOptions}}


@dataclass
class GanMetricsOptions:
    """task=gan's evaluation options (``metrics``); the sample counts themselves are held against what FID, IS and
    KID need by ``tasks.gan.GAN.check_config``."""

    WHERE = "the metrics block of configs/task/gan.yaml (or of the experiment file that sets it)"

    every_n_steps: int = option(2000, ge=1, note="generator steps between validations")
    isc_splits: int = option(1, ge=1, note="the Inception Score's parts, 1 as StudioGAN, 10 the classic protocol")
    batch_size: int = option(50, ge=1)
    reference_samples: Optional[int] = option(10000, ge=2, note="null: the whole training split; a number: that "
                                              "many of its images, drawn at random (FID's covariance needs 2)")
    reference_seed: int = option(0, ge=0, note="the seed of reference_samples' draw, the same for every run seed")
    cache_dir: Optional[str] = option("data/fid_stats", note="null: no cache")
    kid: bool = option("true")
    prc: bool = option("false")


@dataclass
class GanKidOptions:
    """``metrics.kid_*`` of task=gan, checked when ``metrics.kid`` is on."""

    WHERE = GanMetricsOptions.WHERE

    kid_subsets: int = option(100, ge=1, note="torch-fidelity's default 100")
    kid_subset_size: Optional[int] = option(1000, ge=2, note="null: min(1000, generated, reference images)")
    kid_degree: int = option(3, ge=1, note="the polynomial kernel's degree; 0 makes KID 0 for any images")
    kid_gamma: Optional[float] = option(0.001, gt=0, note="null: 1 / feature size (1/2048)")
    kid_coef0: float = option(1)


@dataclass
class GanPrcOptions:
    """``metrics.prc_*`` of task=gan, checked when ``metrics.prc`` is on."""

    WHERE = GanMetricsOptions.WHERE

    prc_neighborhood: int = option(3, ge=1, note="k of the k-th nearest neighbour radius")


@dataclass
class GanEmaOptions:
    """task=gan's generator EMA (``ema``), checked when ``ema.enabled`` is on."""

    WHERE = "the ema block of configs/task/gan.yaml (or of the experiment file that sets it)"

    decay: float = option(0.9999, ge=0, lt=1, note="StudioGAN: 0.9999")
    start: int = option(1000, ge=0, note="the generator update the averaging starts at, a copy before")


@dataclass
class DataOptions:
    """Options common to the data modules (``configs/data/*.yaml``); each module checks its own ones itself."""

    WHERE = "configs/data/<name>.yaml"

    batch_size: int = option(32, ge=1, note="per process")
    eval_batch_size: Optional[int] = option(16, ge=1)
    num_workers: int = option(2, ge=0)
    on_bad_file: Literal["error", "skip"] = option(  # datamodules.base.ON_BAD_FILE (a test holds them equal)
        "skip", note="error stops at the first bad file, skip drops bad files and samples (counted)")
    batches_per_step: int = option(1, ge=1)
    val_samples: Optional[int] = option(10000, ge=1)
    test_samples: Optional[int] = option(10000, ge=1)
    npoints: int = option(1024, ge=1)
    download: bool = option("true")
    lr: float = option(0.01, gt=0, note="the recipe's learning rate, read by the task")


def check(values: Mapping, schema: type, prefix: str, given: Mapping | None = None,
          added: Collection[str] = ()) -> None:
    """Every option of ``schema`` present in ``values`` (a resolved config group, ``prefix`` its path) has its
    type and range; the first that has not raises a UserError naming it, what it must be and an example.
    ``given``, the group unresolved, lets the message name the interpolation a bad value came through; ``added``,
    the keys the command line added with ``+``, get their example as ``++key=`` (a plain ``key=`` is refused by
    Hydra for a key the config files lack)."""
    hints = typing.get_type_hints(schema, include_extras=False)
    for field in dataclasses.fields(schema):
        if field.name not in values:
            continue
        value, meta = values[field.name], field.metadata
        if conforms(value, hints[field.name], meta):
            continue
        key = f"{prefix}.{field.name}"
        note = f" ({meta['note']})" if meta["note"] else ""
        source = (given or {}).get(field.name)
        through = f" (set through {source}: fix that one)" if isinstance(source, str) and "${" in source else ""
        raise UserError(
            f"{key}={value!r}{through} is not valid: {key} must be {describe(hints[field.name], meta)}{note}. Fix it "
            f"on the command line or in {schema.WHERE}, e.g. `python run.py {'++' if key in added else ''}{key}="
            f"{meta['example']}`."
        )


def conforms(value: Any, tp: Any, meta: Mapping) -> bool:
    """Whether ``value`` (plain Python, as Lightning/torch will get it) is of type ``tp`` and in ``meta``'s range."""
    if tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(conforms(value, arg, meta) for arg in args)
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in args)  # 32 is not '32', True is not 1
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            return len(value) == len(args) and all(conforms(v, a, meta) for v, a in zip(value, args))
        return all(conforms(v, args[0], meta) for v in value)
    if origin is dict:
        return isinstance(value, Mapping) and all(isinstance(k, str) and conforms(v, args[1], {}) for k, v in
                                                  value.items())
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and in_range(value, meta)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and in_range(value, meta)
    return isinstance(value, tp)


def in_range(number: float, meta: Mapping) -> bool:
    if meta.get("batches"):  # Lightning's _determine_batch_limits: a fraction, or a whole number of batches
        whole_or_fraction = 0 <= number <= 1 or (number > 1 and number % 1 == 0)
        return whole_or_fraction and (meta.get("gt") is None or number > meta["gt"])
    return not ((meta.get("ge") is not None and number < meta["ge"]) or
                (meta.get("gt") is not None and number <= meta["gt"]) or
                (meta.get("lt") is not None and number >= meta["lt"]))


def describe(tp: Any, meta: Mapping) -> str:
    """``tp`` and ``meta``'s range in words: "an integer >= -1 or null"."""
    if tp is None or tp is type(None):
        return "null"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        literals = [a for arg in args if typing.get_origin(arg) is Literal for a in typing.get_args(arg)]
        numbers = float in args  # a float option takes ints too: say "a number" once
        parts = [part for arg in args if typing.get_origin(arg) is not Literal and not (numbers and arg is int)
                 for part in (("true", "false") if arg is bool else (describe(arg, meta),))]
        if literals:
            parts.insert(0, "one of " + ", ".join(repr(a) for a in literals))
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        count = f"{len(args)} " if origin is tuple and Ellipsis not in args else ""
        each = bounds(meta)
        return f"a list of {count}{'numbers' if args[0] is float else 'integers'}" + (f", each {each}" if each else "")
    if origin is dict:
        return "a mapping such as {days: 1, hours: 2}"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if meta.get("batches"):
        if meta.get("gt") == 0:  # none is not a choice (val_check_interval: Lightning divides by it)
            return "a fraction in (0.0, 1.0] or a whole number of batches" if tp is float else \
                "a number of batches >= 1"
        return "a fraction in [0.0, 1.0] or a whole number of batches" if tp is float else "a number of batches >= 0"
    word = {int: "an integer", float: "a number"}.get(tp, f"a {getattr(tp, '__name__', tp)}")
    return f"{word} {bounds(meta)}".rstrip()


def bounds(meta: Mapping) -> str:
    parts = [f"{sign} {meta[key]:g}" for key, sign in (("ge", ">="), ("gt", ">"), ("lt", "<"))
             if meta.get(key) is not None]
    return " and ".join(parts)
