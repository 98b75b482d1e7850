"""The base of the image-generation (GAN) data modules: the training split in memory, batches for a GAN.

After :meth:`~ImageDataModule.setup` every module holds::

    train_images   uint8 (N, 3, R, R), R = resolution, no augmentation
                   (also the reference set for FID)
    train_labels   int64 (N,), values in [0, num_classes)
    fingerprint    "<name>-<R>px-n<N>-<sha1[:12]>", the hash taken over the
                   uint8 images and the labels: a cache key for FID statistics

``num_classes`` (>= 1), ``class_names`` and ``resolution`` are available right
after construction. The training loader is shuffled, drops the last partial
batch and yields::

    {"image": float32 (B, 3, R, R) in [-1, 1] (= uint8 / 127.5 - 1), "label": int64 (B,)}

with B = batch_size * batches_per_step, each image mirrored left-right with
probability 1/2 when ``flip`` is set. The flip is drawn from torch's default
generator in the process that collates the batch (the main process, or a
DataLoader worker, which DataLoader seeds from the main process), so
``lightning.seed_everything`` makes the batches reproducible.

The evaluation loaders serve what a generative model evaluates on, the
indices of its fixed latents: ``{"index": int64 (B,)}`` over
``range(val_samples)`` and ``range(test_samples)`` (``None``: as many as
training images), in order, so Lightning's distributed sampler splits them.

Bad files (``on_bad_file``, modules that read files): with ``"error"`` (the default)
the first unreadable or malformed file or sample raises a
:class:`~attention.errors.UserError` naming it and the fix; with ``"skip"`` it is
dropped, one warning gives the count, and ``skipped`` lists one line per dropped
file or sample (``"<file>: <reason>"``, ``"<file>[<i>]: <reason>"``). ``skipped``
exists on every module (empty when nothing was skipped); no usable image at all
is a UserError either way.

A new data set is a subclass that sets ``name`` (and ``num_classes`` / ``class_names``, as class
attributes or in ``__init__`` when they depend on the files) and implements :meth:`ImageDataModule._load`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

from datamodules.base import DataModule, bool_option, int_option

MIN_RESOLUTION = 8


def fingerprint(name: str, images: torch.Tensor, labels: torch.Tensor) -> str:
    """``"<name>-<R>px-n<N>-<sha1 of images and labels, 12 hex digits>"``."""
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(images.contiguous().numpy().tobytes())
    digest.update(labels.to(torch.int64).contiguous().numpy().tobytes())
    return f"{name}-{images.shape[-1]}px-n{len(images)}-{digest.hexdigest()[:12]}"


def resize_uint8(images: torch.Tensor, resolution: int, antialias: bool, chunk: int = 1024) -> torch.Tensor:
    """Bilinear resize of uint8 (N, C, H, W) to (N, C, R, R) uint8, in chunks to bound memory."""
    if images.shape[-2:] == (resolution, resolution):
        return images.clone()
    out = []
    for part in images.split(chunk):
        x = F.interpolate(part.to(torch.float32), size=(resolution, resolution), mode="bilinear",
                          align_corners=False, antialias=antialias)  # fmt: skip
        out.append(x.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out)


class _TrainSet(Dataset):
    """``{"image": uint8 (3, R, R), "label": int64}`` samples; :class:`_Collate` batches them."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


class _IndexSet(Dataset):
    """``{"index": int64}``: which of a generative model's fixed latents to generate."""

    def __init__(self, count: int):
        self.indices = torch.arange(count)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        return {"index": self.indices[item]}


class _Collate:
    """PyTorch's default collate, then ``image`` (when the batch has one) as float32 in [-1, 1], flipped
    when asked: training batches ``{"image", "label"}``; evaluation batches ``{"index"}`` pass unchanged.

    Runs where the batch is fetched (main process or worker), so the flips come from
    that process's torch generator, which ``seed_everything`` / DataLoader seed."""

    def __init__(self, flip: bool):
        self.flip = flip

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(samples)
        if "image" in batch:
            x = batch["image"].to(torch.float32).div_(127.5).sub_(1.0)  # (B, 3, R, R) uint8 -> [-1, 1]
            if self.flip:
                mirror = torch.rand(len(x)) < 0.5  # (B,)
                x[mirror] = x[mirror].flip(-1)
            batch["image"] = x
        return batch


class ImageDataModule(DataModule):
    """Base image-generation data module (contract in the module docstring).

    Args:
        resolution: side R of the square images, >= 8.
        batch_size: real images per update (of the discriminator, say).
        batches_per_step: the loader yields ``batch_size * batches_per_step`` images
            at once (e.g. one batch for each of the discriminator updates of one
            training step); the task splits them.
        num_workers: DataLoader workers of the training loader.
        flip: random horizontal flips in the train loader.
        seed: kept with the hyper-parameters; the randomness itself (shuffle, flips)
            comes from torch's generator, seeded by ``seed_everything``.
        val_samples: images a model generates per validation (GAN: FID samples);
            None = as many as training images.
        test_samples: the same for test / ``mode=eval``; None = as many as
            training images (StudioGAN's protocol: 50k for CIFAR-10).
        eval_batch_size: batch of the evaluation loaders.
        on_bad_file: ``"error"`` or ``"skip"`` (modules that read files).
    """

    name: str = "images"
    num_classes: int
    class_names: list[str]

    def __init__(
        self,
        resolution: int = 32,
        batch_size: int = 64,
        batches_per_step: int = 1,
        num_workers: int = 0,
        flip: bool = True,
        seed: int = 0,
        val_samples: int | None = 10000,
        test_samples: int | None = None,
        eval_batch_size: int = 50,
        on_bad_file: str = "error",
    ):
        super().__init__(batch_size, eval_batch_size, num_workers, seed, on_bad_file)
        self.save_hyperparameters()
        example = self._example  # the data set's own default, else the family's
        self.resolution = int_option("resolution", resolution, MIN_RESOLUTION, example("resolution", 32))
        self.batches_per_step = int_option("batches_per_step", batches_per_step, 1, example("batches_per_step", 1))
        self.flip = bool_option("flip", flip)
        self.val_samples = None if val_samples is None else \
            int_option("val_samples", val_samples, 1, example("val_samples", 10000))
        self.test_samples = None if test_samples is None else \
            int_option("test_samples", test_samples, 1, example("test_samples", 50000))
        self.train_images: torch.Tensor | None = None
        self.train_labels: torch.Tensor | None = None
        self.fingerprint: str | None = None
        if isinstance(getattr(self, "class_names", None), list):
            self.class_names = list(self.class_names)  # an instance's own copy of a class-level list

    # -- to implement -----------------------------------------------------------------------------------------
    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training split: images uint8 (N, 3, R, R) and labels int64 (N,); bad data goes to ``self.bad``."""
        raise NotImplementedError

    # -- setup and loaders ------------------------------------------------------------------------------------
    def _build(self) -> None:
        images, labels = self._load()
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, self.resolution, self.resolution)
        assert labels.dtype == torch.int64 and labels.shape == (len(images),)
        self.train_images = images.contiguous()
        self.train_labels = labels.contiguous()
        self.fingerprint = fingerprint(self.name, self.train_images, self.train_labels)
        self.train_set = _TrainSet(self.train_images, self.train_labels)
        self.val_set = _IndexSet(self.eval_samples("val"))
        self.test_set = _IndexSet(self.eval_samples("test"))

    def eval_samples(self, stage: str) -> int:
        """How many images a model generates for ``stage`` ('val' or 'test')."""
        wanted = self.val_samples if stage == "val" else self.test_samples
        if wanted is None:
            self.setup()
            return len(self.train_images)
        return wanted

    def collate(self) -> _Collate:
        return _Collate(self.flip)

    def _too_small(self, size: int, batch_size: int) -> str:
        return (f"The {self.name} training set has {size} images, fewer than one batch of data.batch_size * "
                f"data.batches_per_step = {self.batch_size} * {self.batches_per_step} = {batch_size}; lower "
                "data.batch_size or data.batches_per_step, or add images.")  # fmt: skip

    def _loader(self, split: str) -> DataLoader:
        """Training: shuffled, last partial batch dropped, ``batch_size * batches_per_step`` images a batch.
        Evaluation: ``{"index": (B,)}`` over ``range(<split>_samples)`` in order, in the main process."""
        self.setup()
        if split == "train":
            return self.build_loader(self.train_set, split, batch_size=self.batch_size * self.batches_per_step)
        return self.build_loader(getattr(self, f"{split}_set"), split, what=f"{split} sample set ({split}_samples)",
                                 num_workers=0)  # fmt: skip
