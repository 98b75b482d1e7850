"""Image generation with SAGAN / EAGAN (``task=gan``), FID, IS, KID and precision/recall from torch-fidelity.

Manual optimisation as StudioGAN: one training step is ``d_steps``
discriminator updates, each on its own real batch and fresh fakes, then one
generator update; a "step" (``trainer.max_steps``, ``trainer.global_step``,
``metrics.every_n_steps``) counts generator updates. The data module
therefore delivers ``batch_size * d_steps`` real images per training step.

Evaluation generates images from fixed latents and labels (seeded, the same
at every evaluation), scores them with torch-fidelity's TF-compatible
Inception against reference statistics of the training split (cached on disk,
keyed by the data fingerprint and the weights) and logs a fixed-noise sample
grid. KID (``metrics.kid``) is computed from the same Inception pool features
as FID; precision/recall (``metrics.prc``, off by default) needs a second
network, torch-fidelity's VGG16, run on the same samples. Validation (every
``metrics.every_n_steps``) uses ``metrics.num_samples`` images; test
(``mode=eval``) follows StudioGAN's protocol with as many images as the
training split unless ``eval.num_samples`` says otherwise. With
``ema.enabled`` the exponential moving average of the generator is evaluated.
Batches of the evaluation loaders are ``{"index": (B,)}``: which of the fixed
latents to generate, so ranks under DDP split the work and features are
gathered, de-duplicated by index and scored once. The features (and their
indices) are kept on the CPU, where the extractors return them and the
metrics are computed, so that a whole test split's features never hold GPU
memory; under DDP they visit the device only to be gathered.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torchvision.utils import make_grid, save_image

from attention.errors import UserError

from .base import Task
from .metrics import fid, prc
from .nets.sagan import Discriminator, Generator

log = logging.getLogger(__name__)
LOSSES = ("hinge", "nonsaturating")


def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32 when they are half precision (D's under autocast or ``bf16-true``): the losses are
    float32 there; float64 logits (``trainer.precision=64-true``) stay float64, as the rest of such a run."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def d_loss_real(kind: str, real: torch.Tensor) -> torch.Tensor:
    """The discriminator loss's term of its logits on real images."""
    real = at_least_float32(real)
    return F.relu(1 - real).mean() if kind == "hinge" else F.softplus(-real).mean()


def d_loss_fake(kind: str, fake: torch.Tensor) -> torch.Tensor:
    """The discriminator loss's term of its logits on generated images."""
    fake = at_least_float32(fake)
    return F.relu(1 + fake).mean() if kind == "hinge" else F.softplus(fake).mean()


def g_loss(kind: str, fake: torch.Tensor) -> torch.Tensor:
    fake = at_least_float32(fake)
    return -fake.mean() if kind == "hinge" else F.softplus(-fake).mean()


class EMA(nn.Module):
    """StudioGAN's generator EMA (``src/utils/ema.py``, ``Ema``): ``x_ema = decay * x_ema + (1 - decay) * x`` for
    every parameter and buffer (BN statistics, spectral-norm vectors) from update ``start`` on (0-based), a plain
    copy before it; the integer ``num_batches_tracked`` is copied. Written here because
    ``torch.optim.swa_utils.AveragedModel`` has no start step and averages buffers only with its own BN update."""

    def __init__(self, model: nn.Module, decay: float, start: int):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise UserError(f"ema.decay={decay} must be in [0, 1) (StudioGAN: 0.9999).")
        self.decay, self.start = decay, start
        self.module = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Average ``model`` in after its update ``step`` (0-based: StudioGAN's ``current_step``)."""
        decay = self.decay if step >= self.start else 0.0
        ema_params = list(self.module.parameters())
        torch._foreach_lerp_(ema_params, [p.detach() for p in model.parameters()], 1.0 - decay)
        for ema_b, b in zip(self.module.buffers(), model.buffers()):
            if ema_b.is_floating_point():
                ema_b.lerp_(b, 1.0 - decay)
            else:  # num_batches_tracked
                ema_b.copy_(b)


def first_of_each(index: torch.Tensor) -> torch.Tensor:
    """Positions of the first occurrence of each value of ``index``, ordered by value (drops sampler padding)."""
    order = torch.argsort(index, stable=True)
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = index[order][1:] != index[order][:-1]
    return order[first]


def reference_subset(count: int, limit: int | None, seed: int = 0) -> torch.Tensor | None:
    """Indices (ascending) of ``limit`` of ``count`` training images drawn at random with ``seed``
    (``metrics.reference_seed``: fixed, not the run's seed, so that the runs of every seed score against one
    reference set and share one cache file), or None for all of them. Not the first ``limit``: an image folder
    lists its files class by class, and those were the first class alone, against which samples of every class
    were scored."""
    if limit is None or int(limit) >= count:
        return None
    return torch.randperm(count, generator=torch.Generator().manual_seed(int(seed)))[:int(limit)].sort().values


@contextmanager
def bn_statistics_untracked(module: nn.Module):
    """Run ``module``'s BatchNorm layers (the conditional ones' inner ``bn`` too) on batch statistics without
    updating their running statistics, as StudioGAN's ``untrack_bn_statistics`` does to G for the discriminator's
    updates (``src/worker.py``): the running statistics, which evaluation (and the EMA copy) uses, then follow the
    generator updates alone, not d_steps + 1 batches a step."""
    layers = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for layer in layers:
        layer.track_running_stats = False
    try:
        yield module
    finally:
        for layer in layers:
            layer.track_running_stats = True


@contextmanager
def not_counted(optimizer):
    """Step ``optimizer`` without advancing ``trainer.global_step``.

    In manual optimisation Lightning counts every ``LightningOptimizer.step`` as a global step; the hooks it
    injects for that are swapped out here so that only generator updates count (tested in tests/tasks/test_gan.py).
    """
    before, after = optimizer._on_before_step, optimizer._on_after_step
    optimizer._on_before_step = optimizer._on_after_step = lambda: None
    try:
        yield optimizer
    finally:
        optimizer._on_before_step, optimizer._on_after_step = before, after


def plain(node, resolve: bool = True) -> dict:
    """A config group as a dict (resolved, or as written with ``resolve=False``); {} when absent."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=resolve)
    return dict(node or {})


def sample_counts(cfg) -> dict[str, int]:
    """{the option that sets it: count} of the image sets FID compares: each evaluation's generated images
    (``data.val_samples`` and ``data.test_samples``, what the data module generates, named by
    ``metrics.num_samples`` / ``eval.num_samples`` while they follow them as configs/task/gan.yaml has it) and the
    reference images (``metrics.reference_samples``). A count left null (the training split's size) is not known
    before the data is read and is left out."""
    data, given = plain(cfg.get("data")), plain(cfg.get("data"), resolve=False)
    metrics, evaluation = plain(cfg.get("metrics")), plain(cfg.get("eval"))
    counts = {}
    for key, follows, value in (("val_samples", "metrics.num_samples", metrics.get("num_samples")),
                                ("test_samples", "eval.num_samples", evaluation.get("num_samples"))):
        set_here = key in data and given.get(key) != "${" + follows + "}"
        value = data[key] if key in data else value
        if isinstance(value, int) and not isinstance(value, bool):
            counts[f"data.{key}" if set_here else follows] = value
    reference = metrics.get("reference_samples")
    if isinstance(reference, int) and not isinstance(reference, bool):
        counts["metrics.reference_samples"] = reference
    return counts


def check_writable(option: str, folder, why: str) -> None:
    """Refuse a folder that cannot be created or written, now rather than when it is first written (after
    training, or at the first validation, with a traceback). Tried by creating (and removing) a temporary folder in
    its nearest existing ancestor: permissions alone do not tell (root may write anywhere but /proc)."""
    import tempfile

    path = Path(str(folder))
    existing = next(p for p in [path, *path.parents] if p.exists())  # a relative path ends at ".", which does
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is a file, not a folder"
    else:
        try:
            tempfile.TemporaryDirectory(dir=existing, prefix=".write-test-").cleanup()
        except OSError as err:
            problem = f"{existing} cannot be written ({err.strerror or err})"
    if problem:
        raise UserError(f"{option}={folder}: {problem}; {why}. Give a folder this user can create and write, on the "
                        f"command line or in configs/task/gan.yaml, e.g. `python run.py {option}=/tmp/{path.name}`.")


def check_samples_folder(cfg) -> None:
    """Refuse an ``eval.save_samples`` folder that holds files already, unless the run continues itself (a resumed
    or requeued training run, which may have written part of them): the evaluation wrote ``<index>.png`` among them,
    overwriting those of its numbers and leaving the others, so a folder scored again by another tool (the reason
    to save them) mixed two evaluations, and an earlier evaluation's samples were lost. A path that cannot be a
    folder (a file, under a file, not writable) is refused too: it failed only when the test wrote its first
    image, after training."""
    import os

    folder = (cfg.get("eval") or {}).get("save_samples")
    if not folder:
        return
    check_writable("eval.save_samples", folder, "every image the test scores is written there as <index>.png")
    if not Path(str(folder)).is_dir():
        return
    continues = cfg.get("mode", "train") == "train" and (cfg.get("resume") or cfg.get("ckpt_path") or
                                                         int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0)
    held = sorted(p.name for p in Path(str(folder)).iterdir())
    if held and not continues:
        shown = ", ".join(held[:3]) + (f", ... ({len(held)} files)" if len(held) > 3 else "")
        raise UserError(
            f"eval.save_samples={folder} holds files already ({shown}): this evaluation's samples would be written "
            "among them (000000.png, 000001.png, ...: those of the same numbers overwritten, the others left "
            "beside them), and the folder would mix two evaluations. Give a new or empty folder, or delete this "
            "one's files first.")


class GAN(Task):
    """SAGAN-style conditional/unconditional GAN; batches ``{"image": (B, 3, H, W) in [-1, 1], "label": (B,)}``."""
    layout = "grid"
    # StudioGAN releases G, D and G_ema as separate files; G's weights also start the EMA unless it has its own.
    weights_options = {"g_weights": "G", "d_weights": "D", "g_ema_weights": "G_ema.module"}
    # per generator update; their last values say little of the run: metrics.json leaves them out
    step_metrics = ("train/loss_d", "train/loss_g", "train/d_real", "train/d_fake")
    # validation's FID and IS (the best checkpoint's choice) depend on these; data.val_samples is the count
    # generated (metrics.num_samples unless set itself)
    validation_options = ("metrics.num_samples", "data.val_samples", "metrics.reference_samples",
                          "metrics.isc_splits")

    # Under DDP each backward pass leaves one network without gradients (D's update does not reach G).
    ddp_find_unused_parameters = True

    @classmethod
    def validation_metrics(cls, cfg) -> Mapping[str, str]:
        metrics = cfg.get("metrics") or {}
        return {"val/fid": "min", "val/is": "max", **({"val/kid": "min"} if metrics.get("kid") else {}),
                **({"val/precision": "max", "val/recall": "max"} if metrics.get("prc") else {})}

    def __init__(self, num_classes: int, class_names: Sequence[str], resolution: int, model: Mapping,
                 attn: Mapping, optim: Mapping, loss: str = "hinge", d_steps: int = 5, ema: Mapping | None = None,
                 metrics: Mapping | None = None, eval: Mapping | None = None, grid_per_class: int = 8,
                 monitor: Mapping | None = None):
        super().__init__(monitor)
        self.save_hyperparameters()
        if loss not in LOSSES:
            raise UserError(f"task.loss={loss!r} is not known: use one of {', '.join(LOSSES)}.")
        if int(d_steps) < 1:
            raise UserError(f"task.d_steps={d_steps} must be >= 1 (StudioGAN's SAGAN: 5).")
        self.automatic_optimization = False
        model = dict(model)
        conditional = bool(model.pop("conditional", True)) and num_classes > 1
        self.num_classes = num_classes if conditional else 0
        self.class_names = list(class_names)
        self.z_dim = int(model.get("z_dim", 128))
        self.G = Generator(dict(attn), z_dim=self.z_dim, channels=model.get("g_channels", 256),
                           num_classes=self.num_classes, resolution=resolution,
                           attn_block=model.get("g_attn_block", 2))
        self.D = Discriminator(dict(attn), channels=model.get("d_channels", 128), num_classes=self.num_classes,
                               resolution=resolution, attn_block=model.get("d_attn_block", 1),
                               shortcut=model.get("d_shortcut", "studiogan"))
        ema = dict(ema or {})
        self.G_ema = EMA(self.G, float(ema.get("decay", 0.9999)), int(ema.get("start", 1000))) \
            if ema.get("enabled", False) else None
        self.loss, self.d_steps = loss, int(d_steps)
        self.metrics_cfg = dict(metrics or {})
        self.eval_cfg = dict(eval or {})
        self._aux: dict = {}  # the Inception network: kept out of the module so it is never checkpointed
        self._features: list[tuple[torch.Tensor, ...]] = []
        # Fixed inputs of the logged sample grid: grid_per_class samples of each class (or a square of them).
        rows = max(self.num_classes, 1)
        gen = torch.Generator().manual_seed(1234)
        self.register_buffer("grid_z", torch.randn(rows * grid_per_class, self.z_dim, generator=gen),
                             persistent=False)
        self.register_buffer("grid_y", torch.arange(rows).repeat_interleave(grid_per_class), persistent=False)
        self.grid_per_class = grid_per_class

    @classmethod
    def check_config(cls, cfg) -> None:
        """Every option the GAN reads, before any data is read or any step trained (a bad value otherwise failed with
        a traceback, or at the first validation, up to ``metrics.every_n_steps`` steps in, before any checkpoint):
        the task's, metrics' (KID's only with ``metrics.kid``, PRC's with ``metrics.prc``) and EMA's (with
        ``ema.enabled``) types and ranges (``suite.schema.Gan*Options``); the discriminator's batch against
        ``task.d_steps``; the sample counts against what FID, IS, KID and PRC need; the folders written; no gradient
        accumulation (the GAN steps its optimizers itself)."""
        accumulate = (cfg.get("trainer") or {}).get("accumulate_grad_batches") or 1
        if isinstance(accumulate, int) and accumulate > 1:
            raise UserError(
                f"trainer.accumulate_grad_batches={accumulate}: task=gan steps its optimizers itself (task.d_steps "
                f"discriminator updates, each on a batch of its own, then one generator update, as StudioGAN), so "
                f"Lightning's gradient accumulation does not apply. Leave it out; for a larger batch raise "
                f"data.batch_size (per process) or train on more processes (trainer.devices).")
        # the options' types and ranges are checked before this, by suite.validate (suite.schema.Gan*Options)
        metrics, task, data = plain(cfg.get("metrics")), plain(cfg.get("task")), plain(cfg.get("data"))
        d_steps, per_step = task.get("d_steps"), data.get("batches_per_step")
        if isinstance(d_steps, int) and isinstance(per_step, int) and d_steps != per_step:
            # training_step splits each loader batch into d_steps real batches: another count changes their size
            raise UserError(
                f"data.batches_per_step={per_step} differs from task.d_steps={d_steps}: each training step takes "
                f"data.batch_size * data.batches_per_step real images and splits them among its task.d_steps "
                f"discriminator updates, so every update would see {per_step}/{d_steps} of data.batch_size real "
                f"images instead of data.batch_size. Leave data.batches_per_step out (configs/task/gan.yaml sets it "
                f"to ${{task.d_steps}}) and set task.d_steps alone.")
        counts = sample_counts(cfg)
        for name, value in counts.items():
            if value < 2:
                raise UserError(
                    f"{name}={value} is too few images for FID, whose covariance needs 2 at least (hundreds for a "
                    f"usable estimate, 10k during training and 50k for numbers comparable with papers). Raise it"
                    + (" or set it to null (the whole training split)." if "reference" in name else "."))
        generated = {k: v for k, v in counts.items() if "reference" not in k}
        splits = metrics.get("isc_splits", 1)
        if any(splits > v for v in generated.values()):
            raise UserError(
                f"metrics.isc_splits={splits} is more than the images generated for it "
                f"({', '.join(f'{k}={v}' for k, v in generated.items())}): the Inception Score is averaged over "
                f"that many equal parts of the samples. Lower it (1 as StudioGAN, 10 the classic protocol) or "
                f"raise the sample count.")
        size = metrics.get("kid_subset_size")
        if metrics.get("kid", False) and size is not None and any(int(size) > v for v in counts.values()):
            sizes = ", ".join(f"{k}={v}" for k, v in counts.items())
            raise UserError(
                f"metrics.kid_subset_size={size} must be at least 2 and at most every sample count ({sizes}): KID "
                f"draws subsets of that many images without replacement from the generated and the reference "
                f"images. Lower it, set it to null (torch-fidelity's 1000, capped at the image counts), or turn "
                f"KID off with metrics.kid=false.")
        check_samples_folder(cfg)
        if metrics.get("cache_dir") is not None:
            check_writable("metrics.cache_dir", metrics["cache_dir"], "the reference statistics (fid_ref_*.npz) "
                           "and features (prc_ref_*.npz) are written there at the first evaluation")
        k = metrics.get("prc_neighborhood", 3)
        if metrics.get("prc", False) and any(int(k) >= v for v in counts.values()):
            raise UserError(
                f"metrics.prc_neighborhood={k} must be at least 1 and below every sample count "
                f"({', '.join(f'{n}={v}' for n, v in counts.items())}): a sample's radius is the distance to its k-th "
                f"nearest other sample. Use the paper's k=3 with more samples, or metrics.prc=false.")

    def load_weights(self, paths):
        """As :meth:`Task.load_weights`; with the EMA on and no ``model.g_ema_weights``, G's file starts the EMA."""
        if paths.get("g_ema_weights") and self.G_ema is None:
            raise UserError("model.g_ema_weights is given but the generator EMA is off: set ema.enabled=true to "
                            "evaluate the EMA generator, or pass the file as model.g_weights.")
        loaded = super().load_weights(paths)
        if "g_weights" in loaded and self.G_ema is not None and "g_ema_weights" not in loaded:
            self.G_ema.module.load_state_dict(self.G.state_dict())
        return loaded

    # -- generation -------------------------------------------------------------------------------------------
    @property
    def generator(self) -> nn.Module:
        """The generator that is evaluated: the EMA copy when enabled."""
        return self.G_ema.module if self.G_ema is not None else self.G

    def sample_inputs(self, n: int, generator: torch.Generator | None = None):
        """n latents (n, z_dim) and uniformly drawn labels (n,), from ``generator`` (on the CPU) when given. Drawn in
        float32 and given in G's dtype: the same latents under every ``trainer.precision`` (``64-true`` runs the
        steps with float64 as torch's default dtype, which drew other numbers)."""
        device = "cpu" if generator is not None else self.device
        z = torch.randn(n, self.z_dim, generator=generator, device=device, dtype=torch.float32)
        y = torch.randint(max(self.num_classes, 1), (n,), generator=generator, device=device)
        return z.to(self.device, next(self.generator.parameters()).dtype), y.to(self.device)

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.generator(z, y)

    def summaries(self):
        """(name, network, example input) of each network, for ``mode=summary``."""
        z, y = torch.zeros(1, self.z_dim), torch.zeros(1, dtype=torch.long)
        image = torch.zeros(1, 3, self.hparams.resolution, self.hparams.resolution)
        return [("G", self.G, (z, y)), ("D", self.D, (image, y))]

    # -- training ---------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        images, labels = batch["image"], batch["label"]
        if len(images) < self.d_steps:
            raise UserError(f"a training batch holds {len(images)} images, fewer than task.d_steps={self.d_steps}; "
                            "the data module must deliver batch_size * d_steps images (data.batches_per_step).")
        size = len(images) // self.d_steps
        self.toggle_optimizer(opt_d)
        for i in range(self.d_steps):
            real, y_real = images[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]
            z, y_fake = self.sample_inputs(size)
            with torch.no_grad(), bn_statistics_untracked(self.G):
                fake = self.G(z, y_fake)
            opt_d.zero_grad(set_to_none=True)
            # StudioGAN's two discriminator calls, each followed by the backward of its term of the loss: D's
            # gradient is the sum of the two terms' (one backward of the sum gives the same, up to the order of
            # that floating-point sum). Each call's
            # spectral-norm power iteration updates D's u and v in place, so the second call must come after the
            # first call's backward: with one backward after both calls, torch.compile's graph of the first had
            # saved u and v, and the run failed ("modified by an inplace operation", torch 2.11 and 2.14).
            out_real = self.D(real, y_real)
            loss_real = d_loss_real(self.loss, out_real)
            self.manual_backward(loss_real)
            out_fake = self.D(fake, y_fake)
            loss_d = loss_real.detach() + d_loss_fake(self.loss, out_fake)
            # the fake term's gradient; trainer.on_nan checks the whole loss (a skipped backward drops the real
            # term's gradient too: suite/guard.py)
            self.manual_backward(loss_d)
            with not_counted(opt_d):
                opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        z, y_fake = self.sample_inputs(size)
        loss_g = g_loss(self.loss, self.D(self.G(z, y_fake), y_fake))
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(loss_g)
        opt_g.step()  # counted: global_step = generator updates
        self.untoggle_optimizer(opt_g)
        if self.G_ema is not None:
            self.G_ema.update(self.G, self.global_step - 1)  # the update just made, 0-based

        self.log_dict({"train/loss_d": loss_d.detach(), "train/loss_g": loss_g.detach(),
                       "train/d_real": out_real.detach().mean(), "train/d_fake": out_fake.detach().mean()},
                      prog_bar=True, on_step=True, on_epoch=False, sync_dist=True)  # means over ranks

    def configure_optimizers(self):
        optim = self.hparams.optim
        opt_g = instantiate(optim["generator"])(self.G.parameters())
        opt_d = instantiate(optim["discriminator"])(self.D.parameters())
        return [opt_g, opt_d]

    # -- evaluation ------------------------------------------------------------------------------------------
    def _inception(self):
        if "inception" not in self._aux:
            self._aux["inception"] = fid.load_inception(self.metrics_cfg.get("inception_weights"))
        return self._aux["inception"].to(self.device)

    def _vgg16(self):
        if "vgg16" not in self._aux:
            self._aux["vgg16"] = prc.load_vgg16(self.metrics_cfg.get("vgg16_weights"))
        return self._aux["vgg16"].to(self.device)

    def _eval_inputs(self, stage: str, n: int):
        """Fixed latents and labels of the ``n`` evaluation samples of ``stage`` (cached, on this module's device)."""
        key = (stage, n, self.device)
        if self._aux.get("inputs_key") != key:
            gen = torch.Generator().manual_seed(2026 if stage == "val" else 2027)
            self._aux["inputs_key"], self._aux["inputs"] = key, self.sample_inputs(n, generator=gen)
        return self._aux["inputs"]

    def _reference_images(self):
        """(the real images FID, KID and PRC compare with, their cache key): the training split, or
        ``metrics.reference_samples`` of its images drawn by :func:`reference_subset`."""
        dm = self.trainer.datamodule
        limit = self.metrics_cfg.get("reference_samples")
        seed = self.metrics_cfg.get("reference_seed", 0)
        chosen = reference_subset(len(dm.train_images), limit, seed)
        if chosen is None:
            return dm.train_images, dm.fingerprint
        return dm.train_images[chosen], f"{dm.fingerprint}-random{len(chosen)}s{seed}"

    def _reference(self):
        """FID statistics of the real images, with their pool features when KID is on."""
        if "reference" not in self._aux:
            images, key = self._reference_images()
            self._aux["reference"] = fid.reference_statistics(
                self._inception(), images, key, self.metrics_cfg.get("inception_weights"),
                self.metrics_cfg.get("cache_dir"), batch_size=int(self.metrics_cfg.get("batch_size", 50)),
                keep_features=bool(self.metrics_cfg.get("kid", False)))
        return self._aux["reference"]

    def _prc_reference(self):
        """VGG16 features of the real images (cached on disk like the FID statistics)."""
        if "prc_reference" not in self._aux:
            images, key = self._reference_images()
            self._aux["prc_reference"] = prc.reference_features(
                self._vgg16(), images, key, self.metrics_cfg.get("vgg16_weights"), self.metrics_cfg.get("cache_dir"),
                batch_size=int(self.metrics_cfg.get("batch_size", 50)))
        return self._aux["prc_reference"]

    def _eval_step(self, stage: str, batch):
        index = batch["index"]
        n = self.trainer.datamodule.eval_samples(stage)
        z, y = self._eval_inputs(stage, n)
        images = fid.to_uint8(self.generator(z[index], y[index] if self.num_classes else None))
        # The features stay on the device until _score: a copy to the host per batch waited for the extractors,
        # and the GPU idled while the host queued the next batch's generator and Inception.
        with torch.autocast(self.device.type, enabled=False):  # float32 features, as the reference statistics
            pool, logits = fid.inception_features(self._inception(), images, batch_size=len(images),
                                                  keep_on_device=True)            # (B, 2048), (B, 1008) float64
            vgg = prc.vgg16_features(self._vgg16(), images, batch_size=len(images), keep_on_device=True) \
                if self.metrics_cfg.get("prc", False) else pool.new_empty(len(images), 0)  # (B, 4096) or (B, 0)
        self._features.append((index.to(pool.device), pool, logits, vgg))
        folder = self.eval_cfg.get("save_samples") if stage == "test" else None
        if folder:
            for i, image in zip(index.tolist(), images.cpu()):
                fid.save_pngs(image[None], folder, start=i)

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``t``, on the device (which NCCL needs). Ranks may hold one more or one fewer
        (torchmetrics' gather allows that, Lightning's all_gather does not)."""
        from torchmetrics.utilities.distributed import gather_all_tensors

        return torch.cat(gather_all_tensors(t.to(self.device)))

    def _score(self, stage: str) -> dict[str, float]:
        index, pool, logits, vgg = (torch.cat(t) for t in zip(*self._features))  # on the device (_eval_step)
        self._features = []
        if self.trainer.world_size > 1:  # every rank's samples; de-duplicating by index undoes sampler padding
            index, pool, logits = (self._gathered(t) for t in (index, pool, logits))
            vgg = self._gathered(vgg) if self.metrics_cfg.get("prc") else vgg.new_empty(len(index), 0)
        keep = first_of_each(index)
        pool, logits, vgg = pool[keep], logits[keep], vgg[keep]
        cfg = self.metrics_cfg
        names = ["fid", "is", "is_std"] + (["kid", "kid_std"] if cfg.get("kid") else []) \
            + (["precision", "recall"] if cfg.get("prc") else [])
        scores = torch.zeros(len(names), dtype=torch.float64)
        if self.trainer.is_global_zero:
            reference = self._reference()
            values = [fid.fid_against_reference(pool, reference, device=self.device),
                      *fid.inception_score(logits, splits=int(cfg.get("isc_splits", 1)))]
            if cfg.get("kid"):
                values += fid.kernel_inception_distance(
                    pool, reference["features"], subsets=int(cfg.get("kid_subsets", 100)),
                    subset_size=cfg.get("kid_subset_size"), degree=int(cfg.get("kid_degree", 3)),
                    gamma=cfg.get("kid_gamma"), coef0=float(cfg.get("kid_coef0", 1)), device=self.device)
            if cfg.get("prc"):
                values += prc.precision_recall(vgg.to(self.device), self._prc_reference(),
                                               neighborhood=int(cfg.get("prc_neighborhood", 3)))[:2]
            scores = torch.tensor(values, dtype=torch.float64)
        scores = self.trainer.strategy.broadcast(scores, src=0)
        return {**{f"{stage}/{name}": float(v) for name, v in zip(names, scores)},
                f"{stage}/samples": float(len(keep))}

    @torch.no_grad()
    def _log_grid(self, stage: str) -> None:
        images = self.generator(self.grid_z, self.grid_y if self.num_classes else None)
        grid = make_grid((images + 1) / 2, nrow=self.grid_per_class, padding=1)
        if self.trainer.is_global_zero:
            folder = Path(self.trainer.default_root_dir) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{stage}_step{self.global_step:06d}.png"
            save_image(grid, path)
            for logger in self.loggers:
                if hasattr(logger, "log_image"):
                    logger.log_image(key=f"{stage}/samples", images=[str(path)],
                                     caption=[f"step {self.global_step}"], step=self.global_step)

    def on_validation_epoch_start(self):
        self._features = []
        self._share_generator_buffers()

    def _share_generator_buffers(self) -> None:
        """Every process evaluates with the first process's generator buffers (BatchNorm statistics; the EMA copy's),
        which its checkpoints hold. Under DDP without synchronised BatchNorm (``sync_batchnorm``, off on the CPU)
        each process kept statistics of its own batches, and DDP, which copies buffers from the first process
        before a forward it wraps, never does for this manually optimised module after its first step: each
        process generated its share of the validation samples with its own generator, and the FID that chose the
        best checkpoint (7.41) was no generator's (the checkpoint's: 7.30)."""
        import torch.distributed as dist

        if self.trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return
        for module in dict.fromkeys([self.G, self.generator]):  # the EMA copy's are averaged from each process's own
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def validation_step(self, batch, batch_idx):
        self._eval_step("val", batch)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            self._features = []
            return
        scores = self._score("val")
        self.log_dict({k: v for k, v in scores.items() if not k.endswith("samples")}, prog_bar=True)
        self.log_best(scores)
        self._log_grid("val")

    def on_test_epoch_start(self):
        self._features = []

    def test_step(self, batch, batch_idx):
        self._eval_step("test", batch)

    def on_test_epoch_end(self):
        self.log_dict(self._score("test"))
        self._log_grid("test")
