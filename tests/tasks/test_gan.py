"""The GAN LightningModule: manual optimisation counts generator steps, evaluation scores what it generates."""

import math

import lightning as L
import pytest
import torch
from PIL import Image

from datamodules import Digits
from tasks.metrics import fid
from tasks.gan import GAN, first_of_each, reference_subset

ADAM = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 2e-4, "betas": [0.5, 0.999], "eps": 1e-6}


def make(tmp_path, d_steps=2, ema=False, save_samples=None):
    dm = Digits(batch_size=8, batches_per_step=d_steps, val_samples=12, test_samples=10, eval_batch_size=4,
                flip=False, seed=0)
    module = GAN(num_classes=dm.num_classes, class_names=dm.class_names, resolution=32,
                 model={"conditional": True, "z_dim": 16, "g_channels": 16, "d_channels": 16},
                 attn={"name": "external", "heads": 1, "memory": 8},
                 optim={"generator": ADAM, "discriminator": ADAM}, d_steps=d_steps,
                 ema={"enabled": ema, "decay": 0.5, "start": 1},
                 metrics={"inception_weights": "random", "reference_samples": 12, "cache_dir": str(tmp_path / "c"),
                          "batch_size": 4, "isc_splits": 1},
                 eval={"save_samples": save_samples}, grid_per_class=2, monitor={"metric": "val/fid", "mode": "min"})
    trainer = L.Trainer(max_steps=3, val_check_interval=3, check_val_every_n_epoch=None, logger=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, enable_progress_bar=False,
                        default_root_dir=str(tmp_path), accelerator="cpu", devices=1)
    return dm, module, trainer


def test_fit_counts_generator_updates_and_evaluates(tmp_path):
    torch.manual_seed(0)
    dm, module, trainer = make(tmp_path, d_steps=2, ema=True)
    g_before = [p.detach().clone() for p in module.G.parameters()]
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3  # generator updates only
    opt_g, opt_d = trainer.optimizers
    assert {int(s["step"]) for s in opt_g.state.values()} == {3}
    assert {int(s["step"]) for s in opt_d.state.values()} == {6}  # d_steps per generator update
    assert any(not torch.equal(a, b) for a, b in zip(g_before, module.G.parameters()))
    # EMA (decay 0.5 from step 1) lags the generator: different from it, from its start, and finite
    ema_params = list(module.G_ema.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(ema_params, module.G.parameters()))
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["val/fid"])) and float(metrics["val/fid"]) > 0
    assert float(metrics["val/is"]) >= 1.0 - 1e-6
    assert float(metrics["val/fid_best"]) == float(metrics["val/fid"])
    grid = Image.open(tmp_path / "samples" / "val_step000003.png")
    assert grid.size == (2 * 33 + 1, 10 * 33 + 1)  # 2 samples per class, one row per class, 1 px padding


def test_eval_scores_exactly_the_generated_images(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "samples_out"
    dm, module, trainer = make(tmp_path, save_samples=str(out))
    result = trainer.test(module, datamodule=dm, verbose=False)[0]
    assert result["test/samples"] == 10
    # the same fixed latents, generated and scored directly
    module.eval()
    z, y = module._eval_inputs("test", 10)
    with torch.no_grad():
        images = fid.to_uint8(module.generator(z, y))
    extractor = fid.load_inception("random")
    pool, logits = fid.inception_features(extractor, images)
    chosen = reference_subset(len(dm.train_images), 12)  # metrics.reference_samples=12
    reference = fid.fid_statistics(fid.inception_features(extractor, dm.train_images[chosen])[0])
    assert result["test/fid"] == pytest.approx(fid.frechet_distance(fid.fid_statistics(pool), reference), rel=1e-6)
    assert result["test/is"] == pytest.approx(fid.inception_score(logits, splits=1)[0], rel=1e-6)
    saved = sorted(out.glob("*.png"))
    assert [p.name for p in saved] == [f"{i:06d}.png" for i in range(10)]
    assert torch.equal(torch.from_numpy(__import__("numpy").array(Image.open(saved[3]))).permute(2, 0, 1), images[3])


def test_first_of_each_drops_padding_duplicates():
    index = torch.tensor([4, 0, 2, 4, 1, 3, 0])  # e.g. two ranks' shards with the sampler's padding
    keep = first_of_each(index)
    assert index[keep].tolist() == [0, 1, 2, 3, 4]
    assert keep.tolist() == [1, 4, 2, 5, 0]


def test_a_samples_folder_holding_files_is_refused(tmp_path, monkeypatch):
    """eval.save_samples=DIR writes <index>.png: into a folder holding an earlier evaluation's 10 files, an
    evaluation of 4 overwrote 4 of them and left 6, and the folder mixed the two. Refused when it holds anything,
    unless the run continues itself (a resumed or requeued training run may have written part of them)."""
    from omegaconf import OmegaConf

    from attention.errors import UserError

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def checked(**cfg):
        GAN.check_config(OmegaConf.create({"eval": {"save_samples": str(tmp_path / "samples")}, **cfg}))

    checked(mode="eval")  # no folder yet
    (tmp_path / "samples").mkdir()
    checked(mode="eval")  # an empty one
    (tmp_path / "samples" / "000000.png").write_bytes(b"")
    for cfg in ({"mode": "eval"}, {"mode": "train"}, {"mode": "test", "ckpt_path": "x.ckpt"}):
        with pytest.raises(UserError, match=r"eval.save_samples=.*samples holds files already \(000000.png\)"):
            checked(**cfg)
    checked(mode="train", resume=True)
    checked(mode="train", ckpt_path="last")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    checked(mode="train")


def test_the_generator_ema_is_studiogans(tmp_path):
    """StudioGAN's Ema (src/utils/ema.py): parameters and buffers (BN statistics, spectral-norm vectors) averaged,
    num_batches_tracked copied, decay 0 while the 0-based update index is below start. The EMA copied the buffers
    (averaged weights run with the raw generator's BN statistics: its images, and so FID, differed by up to 0.68)
    and averaged from one update early. Here replayed in float64 from the generator's state after each update."""
    torch.manual_seed(0)
    dm, module, _ = make(tmp_path, d_steps=1, ema=True)  # decay 0.5 from update 1
    trainer = L.Trainer(max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        accelerator="cpu", devices=1)  # no evaluation: the EMA alone
    expected = {k: v.detach().double().clone() for k, v in module.G.state_dict().items()}  # the EMA starts a copy
    seen, update = [], module.G_ema.update

    def recording(model, step):
        seen.append((step, {k: v.detach().double().clone() for k, v in model.state_dict().items()}))
        update(model, step)

    module.G_ema.update = recording
    trainer.fit(module, datamodule=dm)
    assert [step for step, _ in seen] == [0, 1, 2]
    for step, state in seen:
        decay = 0.0 if step < 1 else 0.5
        expected = {k: v if k.endswith("num_batches_tracked") else v.lerp(expected[k], decay) for k, v in state.items()}
    ema = module.G_ema.module.state_dict()
    assert any("running_mean" in k for k in ema) and any(k.endswith("_u") for k in ema)  # buffers of both kinds
    for key, value in expected.items():
        torch.testing.assert_close(ema[key].double(), value, rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(ema[next(k for k in ema if "running_mean" in k)].double(),
                           seen[-1][1][next(k for k in ema if "running_mean" in k)])  # averaged, not the last copy


def test_reference_samples_are_drawn_from_every_class_with_a_fixed_seed():
    """metrics.reference_samples=N took the first N training images: an image folder lists its files class by class,
    so the reference set was the first class alone. Now N drawn at random with a seed of their own (not the run's:
    runs of every seed share one reference set and cache file), named in the cache key."""
    from types import SimpleNamespace

    labels = torch.arange(3).repeat_interleave(30)  # class by class, as datamodules.generation.ImageFolder
    dm = SimpleNamespace(train_images=torch.arange(90)[:, None].expand(90, 4), train_labels=labels, fingerprint="fp")
    task = SimpleNamespace(metrics_cfg={"reference_samples": 30}, trainer=SimpleNamespace(datamodule=dm))
    keys = set()
    for seed in (0, 1):
        torch.manual_seed(seed)  # the run's seed
        images, key = GAN._reference_images(task)
        keys.add(key)
        assert len(images) == 30 and len(set(images[:, 0].tolist())) == 30
        assert torch.bincount(labels[images[:, 0]], minlength=3).min() >= 5  # every class, about a third each
    assert len(keys) == 1 and keys.pop() not in ("fp", "fp-first30")
    task.metrics_cfg["reference_samples"] = None
    assert GAN._reference_images(task)[1] == "fp" and len(GAN._reference_images(task)[0]) == 90
    task.metrics_cfg["reference_samples"] = 90  # all of them: the whole split's set and cache file
    assert GAN._reference_images(task)[1] == "fp"
    assert reference_subset(90, 30).tolist() == sorted(reference_subset(90, 30).tolist())


def test_only_generator_updates_move_its_batchnorm_statistics(tmp_path):
    """StudioGAN's train_discriminator untracks G's BN statistics (misc.untrack_bn_statistics): the fakes of the
    discriminator's updates use batch statistics but leave the running ones, which evaluation and the EMA use, to
    the generator's updates. They took d_steps + 1 updates a step. Replayed by hand from the inputs of the G steps'
    BN calls: momentum 0.1, unbiased variance, over every BN layer of G (the conditional ones' too)."""
    torch.manual_seed(0)
    dm, module, _ = make(tmp_path, d_steps=3)
    layers = {n: m for n, m in module.G.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert any(".bn1.bn" in n for n in layers) and "bn" in layers  # conditional and plain BN
    inputs = {n: [] for n in layers}
    for name, layer in layers.items():
        layer.register_forward_pre_hook(
            lambda m, args, name=name: inputs[name].append(args[0].detach().double().clone())
            if torch.is_grad_enabled() else None)  # the G steps' calls (the D steps' run without gradients)
    steps = 3
    trainer = L.Trainer(max_steps=steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        accelerator="cpu", devices=1)
    trainer.fit(module, datamodule=dm)
    for name, layer in layers.items():
        assert len(inputs[name]) == steps and int(layer.num_batches_tracked) == steps, name
        mean = torch.zeros(layer.num_features, dtype=torch.float64)
        var = torch.ones(layer.num_features, dtype=torch.float64)
        for x in inputs[name]:
            mean = 0.9 * mean + 0.1 * x.mean((0, 2, 3))
            var = 0.9 * var + 0.1 * x.var((0, 2, 3), unbiased=True)
        torch.testing.assert_close(layer.running_mean.double(), mean, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(layer.running_var.double(), var, rtol=1e-5, atol=1e-6, msg=name)
        assert layer.track_running_stats  # restored after the D steps
