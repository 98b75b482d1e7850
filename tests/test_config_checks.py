"""Values checked where they are composed (``suite.schema`` through ``suite.validate``), the options Lightning and
torch refuse turned into the suite's message (``suite.errors``), and a ``ckpt_path`` that is no checkpoint."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException

from attention.errors import UserError
from suite import schema
from suite.checkpoint_io import check_torch_file, safe_torch_load
from suite.errors import as_user_error
from suite.validate import validate_config
from test_run import SEG_TINY, TINY, env, run, user_error  # noqa: F401 - env is a fixture

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def compose_run(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides)


def refused(overrides: list[str]) -> str:
    with pytest.raises(UserError) as err:
        validate_config(compose_run(overrides), overrides)
    return str(err.value)


# --- python run.py: exit 2, one message, before any data is read ------------------------------------------------------
@pytest.fixture(scope="module")
def absent_data(env, tmp_path_factory):  # noqa: F811 - env is a fixture
    """ModelNet40 from a folder that does not exist: a run that read its data would end with that error instead."""
    args = ["task=modelnet", "data=modelnet40", f"data.root={tmp_path_factory.mktemp('data') / 'absent'}",
            "logger=none"]
    proc = run(args, env, check=False)
    assert proc.returncode == 2 and "modelnet40" in proc.stderr.lower(), proc.stderr[-2000:]  # the data is needed
    return args, proc.stderr.strip().splitlines()[-1]


def test_trainer_option_of_the_wrong_type_is_refused_before_the_data(env, absent_data):  # noqa: F811
    args, data_error = absent_data
    err = user_error([*args, "trainer.max_epochs=abc"], env, "trainer.max_epochs='abc'", "an integer >= -1",
                     "e.g. `python run.py trainer.max_epochs=10`")
    assert data_error not in err and err.count("error:") == 1


def test_negative_learning_rate_is_refused_before_the_data(env, absent_data):  # noqa: F811
    args, data_error = absent_data
    err = user_error([*args, "optim.optimizer.lr=-1"], env, "optim.optimizer.lr=-1", "a number > 0",
                     "e.g. `python run.py optim.optimizer.lr=0.01`")
    assert data_error not in err and "Invalid learning rate" not in err


def test_checkpoint_that_is_no_torch_file_is_named(env, absent_data, tmp_path):  # noqa: F811
    args, data_error = absent_data
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    err = user_error([*args, "mode=test", f"ckpt_path={text}"], env, f"ckpt_path={text} is not a PyTorch checkpoint",
                     "zip archive", "b'root:x:0:0:root:'", "ckpt_path=outputs/")
    assert data_error not in err and "_use_new_zipfile_serialization" not in err


# --- the schemas ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needles", [
    (["trainer.max_epochs=abc"], ["trainer.max_epochs='abc'", "an integer >= -1 or null"]),
    (["trainer.max_epochs=2.5"], ["trainer.max_epochs=2.5"]),
    (["++trainer.max_steps=-5"], ["trainer.max_steps=-5", ">= -1"]),
    (["++trainer.limit_val_batches=1.5"], ["trainer.limit_val_batches=1.5", "a fraction in [0.0, 1.0]"]),
    (["++trainer.limit_train_batches=-1"], ["trainer.limit_train_batches=-1"]),
    (["trainer.precision=99"], ["trainer.precision=99", "'bf16-mixed'"]),
    (["++trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0", ">= 1"]),
    (["trainer.gradient_clip_val=-1.0"], ["trainer.gradient_clip_val=-1.0", "a number >= 0"]),
    (["trainer.enable_progress_bar=maybe"], ["trainer.enable_progress_bar='maybe'", "true, false or null"]),
    (["++trainer.gradient_clip_algorithm=sum"], ["trainer.gradient_clip_algorithm='sum'", "'value', 'norm'"]),
    (["trainer=ddp", "trainer.num_nodes=0"], ["trainer.num_nodes=0"]),
    (["optim.optimizer.lr=-1"], ["optim.optimizer.lr=-1", "a number > 0", "configs/task/"]),
    (["optim.optimizer.lr=abc"], ["optim.optimizer.lr='abc'"]),
    (["optim.optimizer.weight_decay=-0.1"], ["optim.optimizer.weight_decay=-0.1", ">= 0"]),
    (["optim.optimizer.momentum=-0.9"], ["optim.optimizer.momentum=-0.9"]),
    (["optim.scheduler.eta_min=-1"], ["optim.scheduler.eta_min=-1"]),
    (["optim.base_batch_size=0"], ["optim.base_batch_size=0", "an integer >= 1 or null"]),
    (["task=gan", "optim.discriminator.betas=[0.5,1.5]"], ["optim.discriminator.betas=[0.5, 1.5]",
                                                           "a list of 2 numbers, each >= 0 and < 1"]),
    (["task=gan", "optim.generator.betas=[0.5]"], ["optim.generator.betas=[0.5]"]),
    (["task=gan", "optim.generator.eps=-1e-6"], ["optim.generator.eps=-1e-06"]),
    (["task=classification", "optim.scheduler.warmup_epochs=-1"], ["optim.scheduler.warmup_epochs=-1"]),
    (["task=segmentation", "data=blobs", "optim.power=-1"], ["optim.power=-1"]),
    (["task=segmentation", "data=blobs", "data.lr=-0.01"], ["optim.optimizer.lr=-0.01", "set through ${data.lr}"]),
    (["data.batch_size=0"], ["data.batch_size=0", "an integer >= 1", "configs/data/"]),
    (["data.num_workers=abc"], ["data.num_workers='abc'", "an integer >= 0"]),
    (["data.on_bad_file=sometimes"], ["data.on_bad_file='sometimes'", "'error', 'skip'"]),
    (["task=gan", "data.val_samples=0"], ["data.val_samples=0"]),
    (["model.neighbours=0"], ["model.neighbours=0", "an integer >= 1", "`python run.py model.neighbours=32`"]),
    (["model.samples=[512,0]"], ["model.samples=[512, 0]", "a list of integers, each >= 1"]),
    (["model.dropout=1.5"], ["model.dropout=1.5", "a number >= 0 and < 1"]),  # torch's traceback before
    (["task=gan", "model.z_dim=0"], ["model.z_dim=0", "an integer >= 1"]),  # trained a GAN without a latent
    (["task=segmentation", "data=blobs", "model.head_channels=0"], ["model.head_channels=0"]),
    (["task.label_smoothing=1.5"], ["task.label_smoothing=1.5", "a number >= 0 and < 1", "configs/task/<task>.yaml"]),
    (["task=shapenet", "data=parts", "task.label_smoothing=-0.1"], ["task.label_smoothing=-0.1"]),
    (["task=segmentation", "data=blobs", "task.aux_weight=-1"], ["task.aux_weight=-1", "a number >= 0",
                                                                "configs/task/segmentation.yaml"]),
    (["task=classification", "model.drop_path_rate=1"], ["model.drop_path_rate=1", "< 1"]),
    (["++trainer.limit_train_batches=1.5"], ["`python run.py ++trainer.limit_train_batches=0.25`"]),
    # Lightning divides the batch index by it: ZeroDivisionError after the first training batch
    (["++trainer.val_check_interval=0"], ["trainer.val_check_interval=0", "a fraction in (0.0, 1.0]"]),
    (["++trainer.val_check_interval=0.0"], ["trainer.val_check_interval=0.0", "a fraction in (0.0, 1.0]"]),
    (["task=segmentation", "data=blobs", "eval.every_n_steps=0"], ["eval.every_n_steps=0", "an integer >= 1"]),
    (["trainer.compile=maybe"], ["trainer.compile='maybe'", "true or false"]),
    (["trainer.compile_mode=fast"], ["trainer.compile_mode='fast'", "'reduce-overhead', 'max-autotune'"]),
    (["trainer.compile_dynamic=sometimes"], ["trainer.compile_dynamic='sometimes'", "true, false or null"]),
    (["trainer.compile=true", "trainer.compile_backend=nonsense"], ["trainer.compile_backend='nonsense'",
                                                                   "aot_eager", "inductor"]),
    (["trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.compile_mode=max-autotune"],
     ["trainer.compile_mode='max-autotune'", "trainer.compile_backend='aot_eager'", "trainer.compile_mode=null"]),
])
def test_wrong_type_or_range_is_refused_naming_the_option(overrides, needles):
    message = refused(overrides)
    for needle in needles:
        assert needle in message, (needle, message)
    assert "e.g. `python run.py " in message


@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_transformer_engine_precision_without_the_package_is_refused(monkeypatch, precision):
    """Lightning raised its ModuleNotFoundError when the Trainer was built, after the data: a traceback, exit 1."""
    monkeypatch.setattr("lightning.fabric.plugins.precision.transformer_engine._TRANSFORMER_ENGINE_AVAILABLE", False)
    message = refused([f"trainer.precision={precision}"])
    for needle in (f"trainer.precision={precision}", "not installed", "`python run.py trainer.precision=bf16-mixed`"):
        assert needle in message, (needle, message)


def test_an_adam_eps_that_float16_rounds_to_zero_is_refused_under_16_true():
    """classification's AdamW (eps 1e-8) under trainer.precision=16-true: eps is 0 in its float16 state, the first
    update divides by zero, and the run exited 0 with a NaN val/test loss."""
    message = refused(["task=classification", "data=digits", "model=vit_s", "trainer.precision=16-true"])
    for needle in ("optim.optimizer.eps=1e-08 is 0", "trainer.precision=16-mixed", "optim.optimizer.eps=1e-4"):
        assert needle in message, (needle, message)
    assert "optim.optimizer.eps=1e-08 (the default)" in refused(
        ["task=classification", "data=digits", "model=vit_s", "trainer.precision=16-true", "~optim.optimizer.eps"])
    for fine in (["task=classification", "data=digits", "model=vit_s", "trainer.precision=16-true",
                  "optim.optimizer.eps=1e-4"], ["task=gan", "trainer.precision=16-true"],  # the GAN's Adam: 1e-6
                 ["task=classification", "data=digits", "model=vit_s", "trainer.precision=16-mixed"],
                 ["trainer.precision=16-true"]):  # PCT's SGD has no eps
        validate_config(compose_run(fine), fine)


@pytest.mark.parametrize("overrides", [
    ["trainer.devices=auto"], ["trainer.devices=[0]"], ["trainer.precision=16"], ["trainer.precision=bf16-mixed"],
    ["trainer.precision=32"], ["++trainer.limit_val_batches=0"], ["++trainer.limit_val_batches=2.0"],
    ["++trainer.limit_train_batches=0.5"], ["trainer.fast_dev_run=true"], ["trainer.fast_dev_run=3"],
    ["trainer.max_epochs=-1", "++trainer.max_steps=10"], ["++trainer.max_time=00:00:10:00"],
    ["++trainer.max_time={minutes: 5}"], ["trainer.deterministic=warn"], ["trainer.gradient_clip_val=1"],
    ["++trainer.val_check_interval=0.25"], ["++trainer.some_future_lightning_argument=anything"],
    ["optim.optimizer.lr=1"], ["+optim.optimizer.nesterov=true"], ["++optim.optimizer.foo=bar"],
    ["data.eval_batch_size=null"], ["data.on_bad_file=skip"], ["task=gan", "trainer=ddp"],
    ["trainer.compile=true"], ["trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs"],
    ["trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.compile_dynamic=true"],
])
def test_valid_and_unknown_options_pass(overrides):
    validate_config(compose_run(overrides), overrides)


CONFIG_FILES = sorted(f"{p.parent.name}={p.stem}" for folder in ("experiment", "task")
                      for p in (CONFIGS / folder).glob("*.yaml"))


@pytest.mark.parametrize("choice", CONFIG_FILES)
def test_every_experiment_and_task_config_composes_and_validates(choice):
    validate_config(compose_run([choice]), [choice])


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml")))
def test_every_data_config_has_valid_common_options(name):
    cfg = compose_run([f"data={name}"])
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg.data, resolve=True)
    schema.check(values, schema.DataOptions, "data")
    assert any(f.name in values for f in dataclasses.fields(schema.DataOptions))  # the check saw something


def test_schemas_name_real_arguments():
    """Every trainer option of the schema is an argument of Lightning's Trainer, every optimiser option one of some
    torch optimiser (or timm's factory), and data.on_bad_file's choices are the data modules' own."""
    import lightning as L

    from datamodules.base import ON_BAD_FILE

    trainer_args = inspect.signature(inspect.unwrap(L.Trainer.__init__)).parameters
    assert [f.name for f in dataclasses.fields(schema.TrainerOptions) if f.name not in trainer_args] == []
    torch_args = {p for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
                  for p in inspect.signature(cls.__init__).parameters}
    assert [f.name for f in dataclasses.fields(schema.OptimizerOptions) if f.name not in torch_args] == ["opt"]
    hints = typing.get_type_hints(schema.DataOptions)
    assert typing.get_args(hints["on_bad_file"]) == ON_BAD_FILE


def test_type_checks_follow_what_lightning_receives():
    meta = {"ge": None, "gt": None, "lt": None, "batches": False}
    precision = typing.get_type_hints(schema.TrainerOptions)["precision"]
    assert schema.conforms(16, precision, meta) and schema.conforms("16", precision, meta)
    assert not schema.conforms(True, int, meta) and not schema.conforms(16.0, int, meta)  # no silent conversion
    assert not schema.conforms("5", int, meta) and schema.conforms(5, float, meta)
    batches = {**meta, "batches": True}
    assert [schema.conforms(v, float, batches) for v in (0, 0.5, 1.0, 3, 3.0, 1.5, -1)] == [True] * 5 + [False] * 2


# --- Lightning's and torch's option errors ----------------------------------------------------------------------------
def raised(build) -> BaseException:
    try:
        build()
    except Exception as err:  # noqa: BLE001 - the exception is what is tested
        return err
    raise AssertionError("nothing was raised")


def trainer(**kwargs):
    import lightning as L

    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


def params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("build, needles", [
    (lambda: trainer(limit_val_batches=1.5), ["trainer.limit_val_batches=1.5", "[0.0, 1.0]",
                                               "`python run.py ++trainer.limit_val_batches=0.25`"]),
    (lambda: trainer(precision="99"), ["trainer.precision='99'", "Precision '99' is invalid"]),
    (lambda: trainer(max_epochs=-2), ["trainer.max_epochs=-2", "non-negative integer or -1"]),
    (lambda: trainer(strategy="nonsense"), ["trainer.strategy='nonsense'"]),
    (lambda: trainer(max_time="abc"), ["trainer.max_time='abc'", "DD:HH:MM:SS"]),
    (lambda: trainer(no_such_argument=1), ["trainer.no_such_argument is not an argument of Lightning's Trainer"]),
    (lambda: torch.optim.SGD(params(), lr=-1), ["torch.optim.SGD refused lr=-1", "Invalid learning rate: -1",
                                                "optim.optimizer.lr", "`python run.py optim.optimizer.lr=0.01`"]),
    (lambda: torch.optim.AdamW(params(), lr=1e-3, betas=(1.5, 0.999)), ["AdamW refused betas=(1.5, 0.999)",
                                                                         "optim.generator.betas"]),
    (lambda: torch.optim.Adam(params(), eps=-1.0), ["Adam refused eps=-1.0", "optim.optimizer.eps"]),
    (lambda: torch.optim.SGD(params(), lr=0.1, betas=(0.9, 0.99)), ["SGD takes no argument betas",
                                                                     "optim.optimizer.betas"]),
])
def test_option_errors_of_lightning_and_torch_become_the_suites_message(build, needles):
    err = raised(build)
    assert not isinstance(err, UserError)
    mapped = as_user_error(err)
    assert isinstance(mapped, UserError), (type(err), err)
    for needle in needles:
        assert needle in str(mapped), (needle, str(mapped))
    wrapped = raised(lambda: _reraise(err))  # as Hydra's instantiate or Lightning's hooks pass it on
    assert str(as_user_error(wrapped)) == str(mapped)


def _reraise(err: BaseException):
    raise InstantiationException("Error in call to target") from err


def invalid_learning_rate(lr):
    if lr < 0:
        raise ValueError(f"Invalid learning rate: {lr}")  # torch's words, raised by our code: a bug


def test_errors_that_are_not_about_an_option_keep_their_traceback():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    assert as_user_error(raised(lambda: int("abc"))) is None
    assert as_user_error(raised(lambda: invalid_learning_rate(-1))) is None  # same message, not from torch.optim
    assert as_user_error(raised(lambda: torch.optim.SGD([], lr=0.1))) is None  # empty parameter list: a task bug

    def module_bug():
        raise MisconfigurationException("No `training_step()` method defined.")

    assert as_user_error(raised(module_bug)) is None

    def at_fit():
        raise MisconfigurationException("`val_check_interval` (2000) must be less than or equal to the number of "
                                        "the training batches (5).")

    assert "trainer.val_check_interval" in str(as_user_error(raised(at_fit)))
    ours = UserError("data.root is missing")
    assert as_user_error(raised(lambda: _reraise(ours))) is ours


# --- checkpoint files -------------------------------------------------------------------------------------------------
def test_checkpoint_files_are_told_from_other_files(tmp_path):
    text, empty, zipped, legacy = (tmp_path / n for n in ("passwd", "empty.ckpt", "new.ckpt", "old.ckpt"))
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    empty.write_bytes(b"")
    torch.save({"state_dict": {"w": torch.ones(2)}}, zipped)
    torch.save({"state_dict": {"w": torch.ones(2)}}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UserError, match=r"ckpt_path=.*passwd is not a PyTorch checkpoint.*starts with b'root:x"):
        safe_torch_load(text, f"ckpt_path={text}", mmap=True)
    with pytest.raises(UserError, match="is empty"):
        check_torch_file(empty, "ckpt_path=empty.ckpt")
    assert check_torch_file(zipped, "x") == "zip" and check_torch_file(legacy, "x") == "legacy"
    for path in (zipped, legacy):  # mmap where torch can map: the legacy format is read whole
        assert torch.equal(safe_torch_load(path, mmap=True)["state_dict"]["w"], torch.ones(2))
    with pytest.raises(UserError, match="not a PyTorch checkpoint"):
        validate_config(compose_run(["mode=test", f"ckpt_path={text}"]), [])


@pytest.mark.parametrize("overrides, needles", [
    # a typo trained a whole epoch and ended in Lightning's traceback at its validation
    (["monitor.metric=val/acc"], ["monitor.metric='val/acc' is not a metric that task=modelnet's validation logs",
                                  "val/oa (max), val/macc (max), val/loss (min)", "`monitor.metric=val/oa "
                                  "monitor.mode=max`"]),
    (["task=segmentation", "monitor.metric=val/loss"], ["task=segmentation", "val/miou (max)"]),  # it logs no loss
    (["task=gan", "metrics.kid=false", "monitor.metric=val/kid"],  # KID not computed
     ["Choose one of val/fid (min), val/is (max), e.g."]),
    # taken as asked: the worst validation's checkpoint was tested, exit 0
    (["monitor.metric=val/loss", "monitor.mode=max"], ["monitor.mode=max with monitor.metric=val/loss, which is "
                                                       "better lower", "`monitor.mode=min`"]),
    (["task=gan", "monitor.mode=max"], ["monitor.metric=val/fid, which is better lower"]),
    (["task=shapenet", "monitor.mode=min"], ["monitor.metric=val/imiou, which is better higher",
                                             "`monitor.mode=max`"]),
    (["monitor.mode=maximum"], ["monitor.mode='maximum' is not known: use max", "val/oa (max)"]),
])
def test_monitor_is_a_metric_validation_logs_in_its_direction(overrides, needles):
    message = refused(overrides)
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("overrides", [
    ["monitor.metric=val/loss", "monitor.mode=min"], ["monitor.metric=val/macc"],
    ["task=gan", "monitor.metric=val/kid"], ["task=gan", "metrics.prc=true",
                                                                 "monitor.metric=val/recall", "monitor.mode=max"],
    ["task=segmentation", "monitor.metric=val/kappa"], ["task=classification", "monitor.metric=val/top5"],
    ["task=shapenet", "monitor.metric=val/cmiou"],
])
def test_every_metric_validation_logs_may_be_monitored(overrides):
    validate_config(compose_run(overrides), overrides)


def test_validations_inside_an_accumulation_window_are_refused():
    """Lightning counts trainer.val_check_interval in training batches: 250 with windows of 3 validates, and writes
    last.ckpt, inside a window, whose gradients no checkpoint holds."""
    message = refused(["experiment=seg_demo", "++trainer.accumulate_grad_batches=3", "trainer.val_check_interval=250"])
    assert "trainer.val_check_interval=250" in message and "accumulate_grad_batches=3" in message
    assert "val_check_interval=249" in message
    for fine in (["experiment=seg_demo", "++trainer.accumulate_grad_batches=3"],  # eval.every_n_steps: 750 batches
                 ["task=modelnet", "++trainer.accumulate_grad_batches=3"]):  # once an epoch (its last batch steps)
        validate_config(compose_run(fine), fine)


def test_validations_a_fraction_of_an_epoch_apart_inside_a_window_are_refused(env, tmp_path):  # noqa: F811
    """trainer.val_check_interval=0.5 is a number of batches only once the data is known: 5 of the demo's 10 batches,
    inside a window of 2, is refused when training starts, with the run's numbers and a multiple to give (exit 2,
    nothing trained, no checkpoint); fractions that fall on a window's end, and validations once an epoch, pass."""
    from types import SimpleNamespace

    from suite.validate import check_validation_batches

    err = user_error([*TINY, "logger=none", "++trainer.val_check_interval=0.5", "++trainer.accumulate_grad_batches=2",
                      f"hydra.run.dir={tmp_path}"], env,
                     "trainer.val_check_interval=0.5 validates every 5 training batches (of 10 an epoch here)",
                     "trainer.accumulate_grad_batches=2", "e.g. trainer.val_check_interval=4.")
    assert err.count("error:") == 1 and not (tmp_path / "checkpoints").exists()

    def trainer(interval, every, accumulate, batches=10):
        return SimpleNamespace(val_check_interval=interval, val_check_batch=every, accumulate_grad_batches=accumulate,
                               num_training_batches=batches)

    for fine in (trainer(0.5, 5, 1), trainer(0.4, 4, 2), trainer(1.0, 10, 3), trainer(0.7, 7, 2, batches=7),
                 trainer(4, 4, 2)):  # a whole number of batches: checked before the data (above)
        check_validation_batches(fine)
    with pytest.raises(UserError, match="validates every 3 training batches"):
        check_validation_batches(trainer(0.3, 3, 2))


def test_gradient_accumulation_is_refused_for_the_gan():
    """The GAN steps its own optimizers: Lightning refused accumulation only when the trainer was built, after the
    data set-up, with a generic hint to try another value."""
    message = refused(["task=gan", "++trainer.accumulate_grad_batches=2"])
    assert "trainer.accumulate_grad_batches=2" in message and "task.d_steps" in message
    assert "data.batch_size" in message
    validate_config(compose_run(["task=gan", "++trainer.accumulate_grad_batches=1"]), [])


@pytest.mark.parametrize("accumulate", [None, 1, 3])
def test_eval_every_n_steps_counts_optimizer_steps(accumulate):
    """eval.every_n_steps=250 validates every 250 optimizer steps: trainer.val_check_interval (which Lightning counts
    in training batches) is 250 x trainer.accumulate_grad_batches; it was 250 batches, every 83 steps under 3."""
    args = ["experiment=seg_demo", *([f"++trainer.accumulate_grad_batches={accumulate}"] if accumulate else [])]
    cfg = compose_run(args)
    assert cfg.eval.every_n_steps == 250 and cfg.trainer.val_check_interval == 250 * (accumulate or 1)
    assert compose_run([*args, "trainer.val_check_interval=0.5"]).trainer.val_check_interval == 0.5  # as given


SEG_EVAL = ["task=segmentation", "data=blobs", "eval.mode=slide", "data.crop=24"]


@pytest.mark.parametrize("bad, needles", [
    ("eval.flip=no", ["eval.flip='no'", "a boolean"]),  # bool('no') is True: flip testing ran, recorded as on
    ("eval.flip=off", ["eval.flip='off'"]), ("eval.flip='false'", ["eval.flip='false'"]),
    ("eval.flip=0", ["eval.flip=0"]),
    ("eval.stride=0", ["eval.stride=0", "must be positive"]),  # was the default stride, recorded as stride: 0
    ("eval.stride=[0,8]", ["eval.stride=[0, 8]", "must be positive"]), ("eval.stride=2.5", ["eval.stride=2.5"]),
    ("eval.stride=[30,30]", ["larger than data.crop"]),
    ("eval.scales=[]", ["eval.scales=[]", "non-empty"]),  # was [1.0] without a word
    ("eval.scales=['1.0']", ["eval.scales=['1.0']"]), ("eval.mode=sliding", ["eval.mode='sliding'"])])
def test_segmentation_eval_options_are_refused_at_start_up(bad, needles):
    message = refused([*SEG_EVAL, bad])
    for needle in needles:
        assert needle in message, (needle, message)
    assert "\n" not in message  # one paragraph


@pytest.mark.parametrize("fine", ["eval.flip=true", "eval.flip=false", "eval.stride=null", "eval.stride=8",
                                  "eval.stride=[16,12]", "eval.scales=[0.5,1,1.5]", "eval.mode=whole"])
def test_segmentation_eval_options_pass(fine):
    validate_config(compose_run([*SEG_EVAL, fine]), [])


def test_segmentation_eval_flip_string_exits_2_without_traceback(env, tmp_path):  # noqa: F811
    user_error([*SEG_TINY, "trainer.max_steps=1", "logger=none", "eval.flip=no", f"hydra.run.dir={tmp_path}"], env,
               "eval.flip='no'", "eval.flip=false")  # a 1-step run (exit 0) before the check


def test_modelnets_smoothing_beyond_torchs_bound_for_its_classes_is_refused_naming_the_bound(capsys, tmp_path):
    """The reference's eps gives every other class eps / (K - 1): above (K - 1) / K torch refused its equivalent in
    the first training step, a traceback."""
    from fixture_cache import user_error_in_process
    from test_run import TINY

    user_error_in_process([*TINY, "task.label_smoothing=0.95", "logger=none"], capsys, tmp_path, tmp_path / "run",
                          "task.label_smoothing=0.95 is too large for 10 classes", "<= (K - 1) / K = 0.9")
