"""task=classification: metrics, the DeiT recipe's pieces (mixup, EMA, timm optimiser and schedule), run.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import attention
from attention.errors import UserError
from datamodules import TinyDigits
from suite.resume import RandomState
from tasks.classification import ImageClassification, topk_accuracy
from test_run import env, run, user_error  # noqa: F401  (env is a fixture; tests/ is on the path)
from fixture_cache import user_error_in_process

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SELF = OmegaConf.to_container(OmegaConf.load(CONFIGS / "attn" / "self.yaml"))
SMALL = {"name": "vit_s", "patch_size": 8, "embed_dim": 32, "depth": 1, "heads": 2, "drop_path_rate": 0.0}


def optim(lr=1e-3, warmup=0, epochs=3, scale_lr=None):
    return {"scale_lr": scale_lr, "base_batch_size": 512,
            "optimizer": {"_target_": "timm.optim.create_optimizer_v2", "_partial_": True, "opt": "adamw",
                          "lr": lr, "weight_decay": 0.05},
            "scheduler": {"_target_": "timm.scheduler.create_scheduler_v2", "_partial_": True, "sched": "cosine",
                          "num_epochs": epochs, "warmup_epochs": warmup, "warmup_lr": 1e-5, "min_lr": 1e-5}}


def task(model=None, **kwargs):
    kwargs.setdefault("optim", optim())
    kwargs.setdefault("monitor", {"metric": "val/top1", "mode": "max"})
    return ImageClassification(model=model or SMALL, attn=SELF, num_classes=10, img_size=32, **kwargs)


def trainer(**kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


@pytest.fixture(scope="module")
def digits():
    dm = TinyDigits(batch_size=32, eval_batch_size=250)
    dm.setup()
    return dm


@pytest.fixture(autouse=True, scope="module")
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------
# metrics


def test_top1_top5_on_a_hand_computed_case():
    logits = torch.tensor([
        [9.0, 8, 7, 6, 5, 4, 0],   # label 0: top-1 and top-5
        [9.0, 8, 7, 6, 5, 4, 0],   # label 4: 5th highest -> top-5 only
        [9.0, 8, 7, 6, 5, 4, 0],   # label 5: 6th highest -> neither
        [0.0, 1, 2, 3, 4, 5, 6],   # label 6: top-1 and top-5
    ])
    labels = torch.tensor([0, 4, 5, 6])
    top1, top5 = topk_accuracy(7, 1), topk_accuracy(7, 5)
    assert top1(logits, labels).item() == pytest.approx(2 / 4)
    assert top5(logits, labels).item() == pytest.approx(3 / 4)
    assert topk_accuracy(3, 5).top_k == 3  # fewer classes than 5: top-k over all of them


# ---------------------------------------------------------------------------
# losses: mixup on and off


NO_TRAINER = pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # steps called by hand


@NO_TRAINER
def test_mixup_path_mixes_batch_and_soft_targets():
    torch.manual_seed(0)
    module = task(mixup={"mixup_alpha": 0.8, "cutmix_alpha": 0.0})  # Mixup only, so lambda can be read back
    seen = []
    mix = module.mixup

    def spy(x, y):
        before = x.clone()
        mixed, target = mix(x, y)
        seen.append((before, mixed.clone(), target))
        return mixed, target

    module.mixup = spy
    image, label = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 3, 4, 5])
    np.random.seed(3)
    loss = module.training_step({"image": image, "label": label}, 0)
    x, mixed, target = seen[0]
    lam = ((mixed - x.flip(0)) / (x - x.flip(0))).median().item()
    assert 0 < lam < 1 and torch.allclose(mixed, lam * x + (1 - lam) * x.flip(0), atol=1e-5)
    off, on = 0.1 / 10, 1 - 0.1 + 0.1 / 10  # label smoothing 0.1 over 10 classes
    smooth = lambda y: torch.full((6, 10), off).scatter_(1, y[:, None], on)  # noqa: E731
    assert torch.allclose(target, lam * smooth(label) + (1 - lam) * smooth(label.flip(0)), atol=1e-5)
    expected = torch.sum(-target * F.log_softmax(module.net(mixed), -1), -1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@NO_TRAINER
def test_without_mixup_the_loss_is_label_smoothed_cross_entropy():
    module = task(mixup={"enabled": False})
    assert module.mixup is None
    image, label = torch.randn(5, 3, 32, 32), torch.tensor([0, 1, 2, 3, 9])  # odd batches are fine
    loss = module.training_step({"image": image, "label": label}, 0)
    expected = F.cross_entropy(module.net(image), label, label_smoothing=0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_bad_recipe_options_are_user_errors():
    with pytest.raises(UserError, match="task.mixup"):
        task(mixup={"mixup_alpha": 0.0, "cutmix_alpha": 0.0})
    with pytest.raises(UserError, match="task.ema.decay"):
        task(ema={"enabled": True, "decay": 1.5})
    odd = OmegaConf.create({"task": {"mixup": {"enabled": True}}, "data": {"batch_size": 63}})
    with pytest.raises(UserError, match="data.batch_size=63"):  # run.py's start-up check, before any data
        ImageClassification.check_config(odd)
    odd.task.mixup.enabled = False
    ImageClassification.check_config(odd)
    with pytest.raises(UserError, match="data=tiny"):  # a data module without img_size (the GAN's digits)
        ImageClassification(model=SMALL, attn=SELF, optim=optim(), num_classes=10)
    with pytest.raises(UserError, match=r"data.img_size.*36.*8"):  # patch 8: refused before any training
        ImageClassification(model=SMALL, attn=SELF, optim=optim(), num_classes=10, img_size=36)


# ---------------------------------------------------------------------------
# a short fit: EMA, optimiser groups, the per-epoch schedule


class LearningRates(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_ema_schedule_and_weight_decay_in_a_short_fit(digits, tmp_path):
    L.seed_everything(0, verbose=False)
    module = task(ema={"enabled": True, "decay": 0.9}, optim=optim(lr=1e-3, warmup=1, epochs=3))
    start = {k: v.clone() for k, v in module.net.state_dict().items()}
    lrs = LearningRates()
    fit = trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                  callbacks=[lrs])
    fit.fit(module, datamodule=digits)
    # cosine over 3 epochs after one warm-up epoch starting at 1e-5 (timm: t_initial = 3, no warm-up prefix)
    cosine = [1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * t / 3)) for t in range(3)]
    assert lrs.lrs == pytest.approx([1e-5, cosine[1], cosine[2]], rel=1e-6)
    groups = fit.optimizers[0].param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.05 for p in g["params"]}
    for name, p in module.net.named_parameters():
        no_decay = p.ndim <= 1 or name in getattr(module.net, "no_weight_decay", lambda: set())()
        assert (id(p) in decayed) != no_decay, name  # norms and biases undecayed
    live, ema = module.net.state_dict(), module.ema.module.state_dict()
    weights = [k for k, v in live.items() if v.is_floating_point()]
    assert all(not torch.equal(live[k], ema[k]) for k in weights if not torch.equal(live[k], start[k]))
    assert any(not torch.equal(ema[k], start[k]) for k in weights)  # the EMA moved too
    assert module.eval_net is module.ema.module
    assert not any(p.requires_grad for p in module.ema.parameters())
    fit.save_checkpoint(tmp_path / "c.ckpt")
    state = torch.load(tmp_path / "c.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(state["ema.module.head.weight"], ema["head.weight"])


class SaveAt(L.Callback):
    """Checkpoints of a fit: after each validation (as last.ckpt is written: what a SIGKILL leaves, and what a
    SIGTERM writes, after the batch's hooks), and at the end of the batch of optimizer step ``step`` from this
    callback's hook (as SLURM's requeue checkpoint: before the task's own hook, which updates the EMA)."""

    def __init__(self, folder: Path, step: int):
        self.folder, self.step = folder, step

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            trainer.save_checkpoint(self.folder / f"val-{trainer.global_step}.ckpt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not (self.folder / f"batch-{self.step}.ckpt").exists():
            trainer.save_checkpoint(self.folder / f"batch-{self.step}.ckpt")


def test_ema_of_a_resumed_run_under_accumulation_is_the_uninterrupted_ones(digits, tmp_path):
    """Under trainer.accumulate_grad_batches > 1 every resume added one EMA update: the step the EMA last saw was
    not in the checkpoint, and the resumed run's first micro-batch (no optimizer step yet) counted as a new step.
    Resumed mid-epoch, at an epoch's end, and from a checkpoint saved before the EMA's update of its step, the net
    and its EMA equal the uninterrupted run's, bit for bit."""
    def fit(ckpt_path=None, callbacks=()):
        L.seed_everything(0, verbose=False)
        module = task(mixup={"enabled": False}, ema={"enabled": True, "decay": 0.5})
        run = trainer(max_epochs=2, limit_train_batches=8, limit_val_batches=1, val_check_interval=4,
                      num_sanity_val_steps=0, accumulate_grad_batches=2, callbacks=[RandomState(), *callbacks])
        run.fit(module, datamodule=digits, ckpt_path=ckpt_path)
        assert run.global_step == 8  # 2 epochs of 4 windows of 2 batches
        return module

    straight = fit(callbacks=[SaveAt(tmp_path, step=2)])
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["batch-2.ckpt", "val-2.ckpt", "val-4.ckpt",
                                                               "val-6.ckpt", "val-8.ckpt"]
    for name in ("val-2.ckpt", "val-4.ckpt", "batch-2.ckpt"):  # mid-epoch 0, its end, before the EMA's update
        resumed = fit(ckpt_path=tmp_path / name)
        for net in ("net", "ema"):
            want, got = getattr(straight, net).state_dict(), getattr(resumed, net).state_dict()
            assert all(torch.equal(want[key], got[key]) for key in want), (name, net)


class StepRates(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_schedule_per_update_gives_timms_rates(digits, accumulate):
    """optim.scheduler.step_on_epochs=false (timm's --sched-on-updates): the rate changes after every optimizer
    step, with the values of timm's own per-update scheduler (made with the loader's updates per epoch and stepped
    by step_update(updates), as timm's train.py does). It used to fail in timm (updates_per_epoch required), and with
    updates_per_epoch given the rate never left its warm-up start."""
    from timm.scheduler import create_scheduler_v2

    L.seed_everything(0, verbose=False)
    schedule = optim(lr=1e-3, warmup=1, epochs=3)
    schedule["scheduler"].update(step_on_epochs=False, updates_per_epoch=99)  # 99: dropped, the loader's count used
    module = task(mixup={"enabled": False}, optim=schedule)
    rates = StepRates()
    fit = trainer(max_epochs=3, limit_train_batches=5, limit_val_batches=1, num_sanity_val_steps=0,
                  accumulate_grad_batches=accumulate, callbacks=[rates])
    fit.fit(module, datamodule=digits)
    updates = math.ceil(5 / accumulate)  # per epoch: the last, partial accumulation steps too
    assert fit.global_step == 3 * updates
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    timm_schedule, _ = create_scheduler_v2(reference, sched="cosine", num_epochs=3, warmup_epochs=1, warmup_lr=1e-5,
                                           min_lr=1e-5, step_on_epochs=False, updates_per_epoch=updates)
    expected, done = [], 0
    for epoch in range(3):
        for batch in range(5):
            expected.append(reference.param_groups[0]["lr"])
            if (batch + 1) % accumulate == 0 or batch == 4:  # an optimizer step
                done += 1
                timm_schedule.step_update(num_updates=done)
    assert rates.lrs == pytest.approx(expected, rel=1e-9)
    assert len(set(rates.lrs)) > 3 * updates - 2  # it moved after (nearly) every update: not per epoch


def test_a_plateau_schedule_per_update_is_refused_before_data():
    cfg = OmegaConf.create({"task": {"mixup": {"enabled": False}}, "data": {"batch_size": 8},
                            "optim": {"scheduler": {"sched": "plateau", "step_on_epochs": False}}})
    with pytest.raises(UserError, match="step_on_epochs=false"):
        ImageClassification.check_config(cfg)


def test_a_plateau_schedule_is_stepped_on_the_monitored_metric(digits):
    """optim.scheduler.sched=plateau (timm's PlateauLRScheduler) reduces the rate only when stepped with a metric:
    the task stepped it with none, so the rate never left its start and the run exited 0 on a constant rate. At a
    rate too small to change a prediction, val/top1 stays put: with patience 0 every epoch after the first halves the
    rate. The plateau's direction follows monitor.mode (timm's default is max)."""
    schedule = optim(lr=1e-6, epochs=4)
    schedule["scheduler"].update(sched="plateau", patience_epochs=0, decay_rate=0.5, min_lr=0.0)
    L.seed_everything(0, verbose=False)
    module = task(mixup={"enabled": False}, optim=schedule)
    rates = LearningRates()
    trainer(max_epochs=4, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0,
            callbacks=[rates]).fit(module, datamodule=digits)
    assert rates.lrs == pytest.approx([1e-6, 1e-6, 0.5e-6, 0.25e-6], rel=1e-9)
    loss = task(optim=schedule, monitor={"metric": "val/loss", "mode": "min"}).configure_optimizers()
    assert loss["lr_scheduler"]["monitor"] == "val/loss"
    assert loss["lr_scheduler"]["scheduler"].lr_scheduler.mode == "min"


def test_learning_rate_noise_per_update_is_refused_before_data():
    """timm's noise seeds a generator with noise_seed + t: at the fractional epoch the task steps a per-update
    schedule with, the run ended in torch's "manual_seed expected a long" at the first update in the noise range."""
    from timm.scheduler import create_scheduler_v2

    noisy = {"sched": "cosine", "num_epochs": 4, "warmup_epochs": 0, "noise": [0.5, 1.0]}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(RuntimeError, match="manual_seed expected a long"):  # what the run met
        create_scheduler_v2(optimizer, **noisy)[0].step(epoch=2.5)
    cfg = OmegaConf.create({"task": {"mixup": {"enabled": False}}, "data": {"batch_size": 8},
                            "optim": {"scheduler": {**noisy, "step_on_epochs": False}}})
    with pytest.raises(UserError, match=r"optim.scheduler.noise=\[0.5, 1.0\].*step_on_epochs=true"):
        ImageClassification.check_config(cfg)
    ImageClassification.check_config(OmegaConf.create({**cfg, "optim": {"scheduler": noisy}}))  # per epoch: fine


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.max_epochs=-1", "++trainer.max_steps=100"], "optim.scheduler.num_epochs=-1 .*trainer.max_steps"),
    (["optim.scheduler.sched=cosinee"], r"optim.scheduler .*Unknown scheduler 'cosinee'"),
    (["optim.optimizer.opt=adamww"], "optim.optimizer .*adamww"),
    (["+optim.scheduler.cooldown_epochs=10"], "cooldown_epochs=10 .*trainer.max_epochs=310 optim.scheduler.num"),
])
def test_schedules_and_optimisers_timm_refuses_are_user_errors_before_data(overrides, needle):
    """A run bounded by trainer.max_steps alone (max_epochs=-1, the schedule's num_epochs) ended in timm's bare
    AssertionError, an unknown sched or opt name in its ValueError, with a traceback (exit 1) after the data was set
    up; now check_config names the option (exit 2). timm's cool-down epochs come after num_epochs, which is
    trainer.max_epochs: they were silently never trained."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["task=classification", *overrides])
        with pytest.raises(UserError, match=needle):
            ImageClassification.check_config(cfg)
        ImageClassification.check_config(compose("config", overrides=["task=classification"]))  # the recipe: fine
        ImageClassification.check_config(compose("config", overrides=[  # a cool-down inside the run: fine
            "task=classification", "trainer.max_epochs=310", "optim.scheduler.num_epochs=300",
            "+optim.scheduler.cooldown_epochs=10"]))


def test_learns_tiny_digits_quickly(digits):
    """480 steps of a small ViT (about 20 s; not timed here: the CI machine's speed varies) beat chance (10 %) by far
    (0.66 when written); no mixup in so short a run."""
    L.seed_everything(0, verbose=False)
    model = {"name": "vit_s", "patch_size": 8, "embed_dim": 64, "depth": 2, "heads": 2, "drop_path_rate": 0.0}
    module = task(model=model, mixup={"enabled": False}, optim=optim(lr=3e-3, warmup=0, epochs=12))
    fit = trainer(max_epochs=12, num_sanity_val_steps=0)
    fit.fit(module, datamodule=digits)
    top1 = fit.callback_metrics["val/top1"].item()
    assert top1 > 0.4, top1
    assert fit.callback_metrics["val/top1_best"].item() >= top1
    # what monitor may choose (suite.validate.check_monitor) is what validation logs
    assert set(ImageClassification.validation_metrics(None)) <= set(fit.callback_metrics)


# ---------------------------------------------------------------------------
# configs


def model_names():
    return sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))


def native_attn(model: str) -> str:
    for entry in yaml.safe_load((CONFIGS / "model" / f"{model}.yaml").read_text()).get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                if "/attn" in key:
                    return value
    raise AssertionError(f"configs/model/{model}.yaml names no native attn")


def test_every_model_composes_with_each_attention_variant():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        for model in model_names():
            cfg = compose("config", overrides=["task=classification", f"model={model}"])
            assert cfg.model.name == model and cfg.attn.name == native_attn(model)  # the model's own mixer
            for variant in attention.names():
                cfg = compose("config", overrides=["task=classification", f"model={model}", f"attn={variant}"])
                assert (cfg.model.name, cfg.attn.name, cfg.monitor.metric) == (model, variant, "val/top1")
        for data in ("tiny", "imagenet", "folder_cls", "cifar10_cls", "cifar100"):
            cfg = compose("config", overrides=["task=classification", f"data={data}"])
            assert cfg.data._target_.startswith("datamodules.")
        cfg = compose("config", overrides=["experiment=cls_demo"])
        assert cfg.task.name == "classification"


# ---------------------------------------------------------------------------
# run.py end to end


def test_run_fast_dev_run_and_bad_size(env, tmp_path, capsys):  # noqa: F811
    """Every model at full size with its own mixer: `trainer.fast_dev_run=true` on tiny (one multirun, one start;
    every model x every variant is covered at reduced depth in tests/tasks/test_backbones.py)."""
    from tasks.nets.backbones import MODELS, NATIVE_ATTN

    run(["-m", "task=classification", f"model={','.join(MODELS)}", "trainer.fast_dev_run=true", "logger=none",
         "data.batch_size=4", "data.eval_batch_size=4", "trainer.enable_progress_bar=false",
         f"hydra.sweep.dir={tmp_path}"], env)
    for i, model in enumerate(MODELS):
        out = tmp_path / f"{i}_classification_{NATIVE_ATTN[model]}"
        metrics = json.loads((out / "metrics.json").read_text())
        for key in ("train/loss", "val/top1", "val/top5", "val/top1_best", "test/top1", "test/top5", "test/loss"):
            assert key in metrics and metrics[key] == metrics[key], (model, key)
        assert 0 <= metrics["test/top1"] <= metrics["test/top5"] <= 1
    user_error_in_process(["task=classification", "model=vit_s", "data.img_size=40", "logger=none"], capsys,
                          env["HOME"], tmp_path / "bad-size", "data.img_size", "40", "16")
    user_error(["task=classification", "model=resnet9000"], env, "resnet9000", "vit_s", "model=")


def test_files_dropped_by_the_workers_are_counted_in_the_record(env, tmp_path):  # noqa: F811
    """data.on_bad_file=skip on a data set too large to check up front (verify_images=false): two processes, two
    workers each, a bad image in train/ and one in val/ (also the test split). The workers dropped them with a
    warning, and metrics.json said nothing (no data/skipped); each process now counts what its workers dropped,
    and the run records both, once, whatever process and epoch met them. A batch of two left with one image still
    trains under Mixup (it was cut to no image at all, and its loss was NaN)."""
    from PIL import Image

    root = tmp_path / "images"
    for split in ("train", "val"):
        for name, colour in (("a", (200, 10, 10)), ("b", (10, 10, 200))):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 40), colour).save(folder / f"{i}.png")
        (root / split / "a" / "bad.png").write_bytes(b"not an image")
    out = tmp_path / "run"
    proc = run(["task=classification", "data=folder_cls", f"data.root={root}", "data.img_size=32", "model=vit_s",
                "data.verify_images=false", "data.on_bad_file=skip", "data.num_workers=2", "data.batch_size=2",
                "data.eval_batch_size=2", "trainer.max_epochs=2", "trainer.devices=2", "logger=none",
                "trainer.enable_progress_bar=false", f"hydra.run.dir={out}"], env)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data/skipped"] == 2.0 and math.isfinite(metrics["train/loss"])
    (said,) = [line for line in (out / "run.log").read_text().splitlines() if "left out 2 bad file" in line]
    assert str(root / "train" / "a" / "bad.png") in said and str(root / "val" / "a" / "bad.png") in said
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model", ["focal_t", "vit_s", "eamlp"])
def test_dilated_is_one_override_away_on_every_model(model):
    """`task=classification model=X attn=dilated`: the task's preset gives DilateFormer's rates [1, 2, 3], which
    divide every stage's heads (configs/attn/dilated.yaml's four rates would not), unless attn.dilations is given."""
    from suite.compose import apply_attn_preset
    from tasks.nets.backbones import build_backbone

    overrides = ["task=classification", f"model={model}", "attn=dilated"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    apply_attn_preset(cfg, overrides)
    assert list(cfg.attn.dilations) == [1, 2, 3]
    spec = {"name": model, **({"depths": [1, 1, 1, 1]} if model.startswith("focal") else {"depth": 1})}
    net = build_backbone(spec, OmegaConf.to_container(cfg.attn), num_classes=10, img_size=32)
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    given = [*overrides, "attn.dilations=[1,2,3,4]"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=given)
    apply_attn_preset(cfg, given)
    assert list(cfg.attn.dilations) == [1, 2, 3, 4]  # what the user gives wins
