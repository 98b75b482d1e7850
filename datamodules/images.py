"""Image data modules for image generation (GANs), 32x32 by default.

Every module holds its whole training split in memory after :meth:`setup`::

    train_images   uint8 (N, 3, R, R), R = resolution, no augmentation
                   (also the reference set for FID)
    train_labels   int64 (N,), values in [0, num_classes)
    fingerprint    "<name>-<R>px-n<N>-<sha1[:12]>", the hash taken over the
                   uint8 images and the labels: a cache key for FID statistics

``num_classes`` (>= 1), ``class_names`` and ``resolution`` are available right
after construction. :meth:`ImageDataModule.train_dataloader` is shuffled, drops the last
partial batch and yields::

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

Datasets:

* ``Digits`` (config ``digits``): the 1,797 8x8 handwritten digits that ship
  with scikit-learn, upscaled bilinearly; offline, for demos and tests.
* ``CIFAR10`` (config ``cifar10``): the python release, ``<root>/cifar-10-batches-py/``
  (``data.download=true`` fetches it); the five data batches are the train split.
* ``ImageFolder`` (config ``image_folder``): any folder of images, optionally
  one sub-folder per class; shorter side resized to R, then centre-cropped.

Bad files (``on_bad_file``, CIFAR10 and ImageFolder): with ``"error"`` (the default)
the first unreadable or malformed file or sample raises a
:class:`~attention.errors.UserError` naming it and the fix; with ``"skip"`` it is
dropped, one warning gives the count, and ``skipped`` lists one line per dropped
file or sample (``"<file>: <reason>"``, ``"<file>[<i>]: <reason>"``). ``skipped``
exists on every module (empty when nothing was skipped); no usable image at all
is a UserError either way.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib
import logging
import pickle
import struct
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from attention.errors import UserError
from datamodules.loaders import ResumableLoader, eval_loading, train_sampling
from datamodules.download import ensure_release
from datamodules.options import int_option, on_bad_file_option

log = logging.getLogger(__name__)

MIN_RESOLUTION = 8
OPTION_EXAMPLES = {"resolution": 32, "batch_size": 64, "batches_per_step": 1, "num_workers": 0, "seed": 0,
                   "val_samples": 10000, "test_samples": 50000, "eval_batch_size": 50}


def _int_option(name: str, value, minimum: int) -> int:
    return int_option(name, value, minimum, OPTION_EXAMPLES.get(name, minimum))


def _fingerprint(name: str, images: torch.Tensor, labels: torch.Tensor) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(images.contiguous().numpy().tobytes())
    digest.update(labels.to(torch.int64).contiguous().numpy().tobytes())
    return f"{name}-{images.shape[-1]}px-n{len(images)}-{digest.hexdigest()[:12]}"


def _resize_uint8(images: torch.Tensor, resolution: int, antialias: bool, chunk: int = 1024) -> torch.Tensor:
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
    """(uint8 image (3, R, R), int64 label) pairs; :class:`_Collate` batches them."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class _Collate:
    """Stack samples into ``{"image": float32 in [-1, 1], "label": int64}``, flipping when asked.

    Runs where the batch is fetched (main process or worker), so the flips come from
    that process's torch generator, which ``seed_everything`` / DataLoader seed."""

    def __init__(self, flip: bool):
        self.flip = flip

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        images = torch.stack([image for image, _ in samples])  # (B, 3, R, R) uint8
        labels = torch.stack([label for _, label in samples])  # (B,) int64
        x = images.to(torch.float32).div_(127.5).sub_(1.0)
        if self.flip:
            mirror = torch.rand(len(x)) < 0.5  # (B,)
            x[mirror] = x[mirror].flip(-1)
        return {"image": x, "label": labels}


class ImageDataModule(L.LightningDataModule):
    """Base image data module (contract in the module docstring).

    Subclasses set ``name``, ``num_classes`` and ``class_names`` in ``__init__``
    and implement :meth:`_load`, which returns the training images uint8
    (N, 3, R, R) and labels int64 (N,); :meth:`setup` calls it once.

    Args:
        resolution: side R of the square images, >= 8.
        batch_size: real images per update (of the discriminator, say).
        batches_per_step: the loader yields ``batch_size * batches_per_step`` images
            at once (e.g. one batch for each of the discriminator updates of one
            training step); the task splits them.
        num_workers: DataLoader workers (persistent when > 0).
        flip: random horizontal flips in the train loader.
        seed: kept with the hyper-parameters; the randomness itself (shuffle, flips)
            comes from torch's generator, seeded by ``seed_everything``.
        val_samples: images a model generates per validation (GAN: FID samples);
            None = as many as training images.
        test_samples: the same for test / ``mode=eval``; None = as many as
            training images (StudioGAN's protocol: 50k for CIFAR-10).
        eval_batch_size: batch of the evaluation loaders.

    After :meth:`setup`, ``skipped`` lists the bad files and samples that were dropped
    (``on_bad_file="skip"``; empty otherwise).
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
    ):
        super().__init__()
        self.resolution = _int_option("resolution", resolution, MIN_RESOLUTION)
        self.batch_size = _int_option("batch_size", batch_size, 1)
        self.batches_per_step = _int_option("batches_per_step", batches_per_step, 1)
        self.num_workers = _int_option("num_workers", num_workers, 0)
        self.seed = _int_option("seed", seed, 0)
        if not isinstance(flip, (bool, np.bool_)):
            raise UserError(f"data.flip must be true or false, got {flip!r}.")
        self.flip = bool(flip)
        self.val_samples = None if val_samples is None else _int_option("val_samples", val_samples, 1)
        self.test_samples = None if test_samples is None else _int_option("test_samples", test_samples, 1)
        self.eval_batch_size = _int_option("eval_batch_size", eval_batch_size, 1)
        self.train_images: torch.Tensor | None = None
        self.train_labels: torch.Tensor | None = None
        self.fingerprint: str | None = None
        self.on_bad_file = "error"  # subclasses that read files take it as an option
        self.skipped: list[str] = []  # filled in setup: one line per dropped file or sample

    def _bad(self, entry: str, message: str) -> None:
        """A bad file or sample: raise (on_bad_file=error) or record it in ``skipped`` (skip)."""
        if self.on_bad_file != "skip":
            raise UserError(f"{message} Or set data.on_bad_file=skip to drop bad files (they are counted and named).")
        self.skipped.append(entry)

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training split: images uint8 (N, 3, R, R) and labels int64 (N,)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Load the training split once (later calls do nothing)."""
        if self.train_images is not None:
            return
        self.skipped = []
        images, labels = self._load()
        if self.skipped:
            shown = "; ".join(self.skipped[:5]) + ("; ..." if len(self.skipped) > 5 else "")
            log.warning("Skipped %d bad file(s) or image(s) of %s (data.on_bad_file=skip): %s", len(self.skipped),
                        self.name, shown)  # fmt: skip
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, self.resolution, self.resolution)
        assert labels.dtype == torch.int64 and labels.shape == (len(images),)
        self.train_images = images.contiguous()
        self.train_labels = labels.contiguous()
        self.fingerprint = _fingerprint(self.name, self.train_images, self.train_labels)

    def train_dataloader(self) -> DataLoader:
        """Shuffled, last partial batch dropped, ``batch_size * batches_per_step`` images a batch."""
        self.setup()
        size = self.batch_size * self.batches_per_step
        if len(self.train_images) < size:
            raise UserError(
                f"The {self.name} training set has {len(self.train_images)} images, fewer than one batch of "
                f"data.batch_size * data.batches_per_step = {self.batch_size} * {self.batches_per_step} = {size}; "
                f"lower data.batch_size or data.batches_per_step, or add images."
            )
        dataset = _TrainSet(self.train_images, self.train_labels)
        return ResumableLoader(
            dataset,
            batch_size=size,
            **train_sampling(dataset),
            drop_last=True,
            collate_fn=_Collate(self.flip),
            num_workers=self.num_workers,
            persistent_workers=False,  # new workers every epoch, seeded by (seed, epoch): exact resumes
            pin_memory=torch.cuda.is_available(),
        )


    def eval_samples(self, stage: str) -> int:
        """How many images a model generates for ``stage`` ('val' or 'test')."""
        wanted = self.val_samples if stage == "val" else self.test_samples
        if wanted is None:
            self.setup()
            return len(self.train_images)
        return wanted

    def _eval_loader(self, stage: str) -> DataLoader:
        # What a generative model evaluates on is which of its fixed latents to generate: batches
        # {"index": (B,)} in order, so that Lightning's distributed sampler splits them across ranks.
        dataset = _IndexSet(torch.arange(self.eval_samples(stage)))
        return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False,
                          **eval_loading(dataset, f"{stage} sample set ({stage}_samples)"))

    def val_dataloader(self) -> DataLoader:
        """``{"index": (B,)}`` over ``range(val_samples)``, in order."""
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        """``{"index": (B,)}`` over ``range(test_samples)`` (default: the training-set size), in order."""
        return self._eval_loader("test")


class _IndexSet(Dataset):
    def __init__(self, indices: torch.Tensor):
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        return {"index": self.indices[item]}


# ---------------------------------------------------------------------------
# scikit-learn digits


class Digits(ImageDataModule):
    """scikit-learn's 1,797 handwritten digits (8x8, values 0..16, 10 classes), all for training.

    Upscaled bilinearly (``align_corners=False``, no antialias) to R x R, 0..16 mapped
    to 0..255, replicated to 3 channels. Offline: the data ships with scikit-learn.
    Args: see :class:`ImageDataModule` (``flip`` defaults to False in the config: digits
    are not mirror-symmetric).
    """

    name = "digits"

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
    ):
        super().__init__(resolution, batch_size, batches_per_step, num_workers, flip, seed,
                         val_samples, test_samples, eval_batch_size)
        self.save_hyperparameters()
        self.num_classes = 10
        self.class_names = [str(d) for d in range(10)]

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.from_numpy(np.asarray(digits.images, dtype=np.float64))[:, None]  # (N, 1, 8, 8) in 0..16
        if x.shape[-1] != self.resolution:
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear",
                              align_corners=False, antialias=False)  # fmt: skip
        x = (x * (255.0 / 16.0)).round_().clamp_(0, 255).to(torch.uint8)
        images = x.expand(-1, 3, -1, -1).contiguous()  # (N, 3, R, R)
        labels = torch.from_numpy(np.asarray(digits.target, dtype=np.int64))
        return images, labels


# ---------------------------------------------------------------------------
# CIFAR-10, python release

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR10_FILES = [*CIFAR10_TRAIN_FILES, "test_batch", "batches.meta"]


def _numpy_reconstruct():
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy >= 2, numpy 1.x
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("numpy's multiarray._reconstruct not found")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild numpy arrays and builtin containers.

    Unpickling runs arbitrary code (any global a pickle names can be called with any
    arguments), and torchvision's CIFAR reader uses plain ``pickle.load`` on downloaded
    files. The CIFAR batches need only numpy's array reconstruction (and ``_codecs.encode``,
    which Python 3 uses for bytes at protocol 2); every other global is refused.
    """

    def __init__(self, file, path: Path):
        super().__init__(file, encoding="bytes")  # the release was pickled by Python 2
        self.path = path
        reconstruct = _numpy_reconstruct()
        self.allowed = {
            ("numpy.core.multiarray", "_reconstruct"): reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): reconstruct,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): codecs.encode,
        }

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UserError(
                f"{self.path} is not a CIFAR-10 batch: its pickle refers to {module}.{name}, which only numpy "
                f"arrays may (refused, nothing was run). Delete {self.path.parent} and use data.download=true, "
                f"or unpack the official cifar-10-python.tar.gz there."
            ) from None


class CIFAR10(ImageDataModule):
    """CIFAR-10, python release; the five data batches (50,000 images) are the train split.

    ``root`` is the folder that contains ``cifar-10-batches-py/`` or that folder itself::

        <root>/cifar-10-batches-py/
            data_batch_1 ... data_batch_5, test_batch   pickled {b"data": uint8 (n, 3072),
                                                         b"labels": [int in 0..9] * n}
            batches.meta                                 pickled {b"label_names": [10 bytes]}

    A row of ``data`` is the R, G, B planes, each 32x32 row-major. Other resolutions
    are resized bilinearly with antialias. ``num_classes`` is 10 and ``class_names``
    the standard names right away; :meth:`setup` takes the names from ``batches.meta``.

    Args:
        root: see above.
        download: fetch ``url`` (md5-checked, safely extracted into ``root``) when the
            release is incomplete; in :meth:`prepare_data` (and in :meth:`setup` if
            that was skipped).
        url, md5: the archive and its md5 (None: only check it is a valid archive).
        on_bad_file: ``"error"``, or ``"skip"``: an unreadable or malformed batch file is
            dropped whole, an image with a label outside 0..9 alone; a bad ``batches.meta``
            gives the standard class names.
        resolution, batch_size, batches_per_step, num_workers, flip, seed: see
            :class:`ImageDataModule`.
    """

    name = "cifar10"

    def __init__(
        self,
        root: str,
        resolution: int = 32,
        batch_size: int = 64,
        batches_per_step: int = 1,
        num_workers: int = 0,
        flip: bool = True,
        seed: int = 0,
        val_samples: int | None = 10000,
        test_samples: int | None = None,
        eval_batch_size: int = 50,
        download: bool = False,
        url: str = CIFAR10_URL,
        md5: str | None = CIFAR10_MD5,
        on_bad_file: str = "error",
    ):
        super().__init__(resolution, batch_size, batches_per_step, num_workers, flip, seed,
                         val_samples, test_samples, eval_batch_size)
        self.save_hyperparameters()
        self.on_bad_file = on_bad_file_option(on_bad_file)
        self.root = root
        self.download = bool(download)
        self.url = url
        self.md5 = md5
        self.num_classes = len(CIFAR10_CLASSES)
        self.class_names = list(CIFAR10_CLASSES)

    def _folder(self) -> Path:
        root = Path(self.root).expanduser()
        if any((root / name).is_file() for name in CIFAR10_FILES):  # root is the release folder itself
            return root
        return root / CIFAR10_FOLDER

    def _files(self) -> Path:
        """The release folder; UserError listing the expected layout if a file is missing."""
        folder = self._folder()
        missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
        if missing:
            state = f"lacks {', '.join(missing)}" if folder.is_dir() else "does not exist"
            raise UserError(
                f"CIFAR-10 not found: {folder} {state}. Expected {CIFAR10_FOLDER}/ with data_batch_1 ... "
                f"data_batch_5, test_batch and batches.meta under data.root={self.root}. Set "
                f"data.download=true to fetch it ({self.url}), unpack cifar-10-python.tar.gz there by hand, "
                f"or run offline with data=digits."
            )
        return folder

    def prepare_data(self) -> None:
        """Check the layout; when it is incomplete and ``download`` is set, download and extract first."""
        ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        folder = ensure_release(self._files, self.download, self.url, Path(self.root).expanduser(), self.md5)
        try:
            self.class_names = _read_cifar_meta(folder / "batches.meta")
        except _BadFile as err:
            self._bad(err.entry, str(err))
            self.class_names = list(CIFAR10_CLASSES)
        parts = []
        for name in CIFAR10_TRAIN_FILES:
            try:
                parts.append(_read_cifar_batch(folder / name, self._bad))
            except _BadFile as err:
                self._bad(err.entry, str(err))
        data = np.concatenate([d for d, _ in parts] or [np.empty((0, 3072), np.uint8)])  # (N, 3072) uint8
        labels = np.concatenate([lab for _, lab in parts] or [np.empty(0, np.int64)])
        if len(data) == 0:
            why = f"all {len(self.skipped)} bad file(s) or image(s) were skipped" if self.skipped else "they are empty"
            raise UserError(
                f"CIFAR-10 under {folder} has no usable training image: {why}. {_cifar_fix(folder / 'x')}"
            )
        images = torch.from_numpy(data).view(-1, 3, 32, 32)  # R, G, B planes, row-major
        return _resize_uint8(images, self.resolution, antialias=True), torch.from_numpy(labels)


def _cifar_fix(path: Path) -> str:
    return f"Delete {path.parent} and use data.download=true, or unpack the official cifar-10-python.tar.gz there."


class _BadFile(UserError):
    """A bad CIFAR-10 file; ``entry`` is its line in ``skipped``."""

    def __init__(self, message: str, entry: str):
        super().__init__(message)
        self.entry = entry


def _unpickle(path: Path):
    """The object pickled in ``path``, through :class:`_ArrayUnpickler`; UserError if unreadable."""
    try:
        with open(path, "rb") as f:
            return _ArrayUnpickler(f, path).load()
    except UserError as err:  # a refused global
        raise _BadFile(str(err), f"{path}: refers to a global other than numpy arrays (refused)") from None
    except Exception as err:  # noqa: BLE001 - anything a corrupt pickle makes the allowed constructors raise
        raise _BadFile(
            f"{path} cannot be read as a CIFAR-10 pickle, it is truncated or corrupt ({type(err).__name__}: {err}). "
            f"{_cifar_fix(path)}",
            f"{path}: unreadable, truncated or corrupt pickle ({type(err).__name__})",
        ) from None


def _read_cifar_batch(path: Path, bad) -> tuple[np.ndarray, np.ndarray]:
    """Data uint8 (n, 3072) and labels int64 (n,) of one validated batch file; a bad file raises
    :class:`_BadFile`, images with a bad label go to ``bad(entry, message)`` (which raises or records)."""
    fix = _cifar_fix(path)
    batch = _unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = list(batch)[:10] if isinstance(batch, dict) else type(batch).__name__
        raise _BadFile(f"{path} is not a CIFAR-10 batch: expected a dict with b'data' and b'labels', got {keys}. {fix}",
                       f"{path}: not a CIFAR-10 batch (no b'data' and b'labels')")  # fmt: skip
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise _BadFile(f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {got}. {fix}",
                       f"{path}: b'data' is {got}, expected uint8 (n, 3072)")  # fmt: skip
    try:
        raw = np.asarray(batch[b"labels"]).reshape(-1)
        ok = raw.dtype.kind in "iu"
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise _BadFile(f"{path}: b'labels' must be a list of integers. {fix}", f"{path}: b'labels' are not integers")
    if len(raw) != len(data):
        raise _BadFile(f"{path} has {len(data)} images but {len(raw)} labels. {fix}",
                       f"{path}: {len(data)} images but {len(raw)} labels")  # fmt: skip
    in_range = (raw >= 0) & (raw < len(CIFAR10_CLASSES))  # in the stored dtype: no wrap-around
    for i in np.flatnonzero(~in_range):
        bad(f"{path}[{i}]: label {raw[i]} outside 0..9", f"{path}: image {i} has label {raw[i]}, expected 0..9. {fix}")
    return np.ascontiguousarray(data[in_range]), raw[in_range].astype(np.int64)


def _read_cifar_meta(path: Path) -> list[str]:
    meta = _unpickle(path)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != len(CIFAR10_CLASSES) or \
            not all(isinstance(n, (bytes, str)) for n in names):  # fmt: skip
        raise _BadFile(
            f"{path} must hold b'label_names', a list of {len(CIFAR10_CLASSES)} names. Restore it from the "
            f"official cifar-10-python.tar.gz, or delete {path.parent} and use data.download=true.",
            f"{path}: no list of {len(CIFAR10_CLASSES)} b'label_names' (standard names used)",
        )
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names]


# ---------------------------------------------------------------------------
# A folder of images

# what PIL raises for unreadable, non-image, truncated or malformed files (plugins differ)
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, KeyError, TypeError)
PROGRESS_THRESHOLD = 500  # show a progress bar when loading more files than this


def _visible_files(folder: Path) -> list[Path]:
    """Non-hidden regular files directly in ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file())


def _load_image(path: Path, resolution: int) -> np.ndarray:
    """Decode ``path`` to RGB, resize its shorter side to ``resolution`` (bicubic, antialiased),
    centre-crop to a square; uint8 (3, R, R). PIL errors propagate."""
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")  # honour the camera's orientation tag
    w, h = img.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    if size != (w, h):
        img = img.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    img = img.crop((left, top, left + resolution, top + resolution))
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


class ImageFolder(ImageDataModule):
    """Every image of a folder, optionally one sub-folder per class::

        <root>/<class>/<any name>     sub-folders (sorted names) are the classes; files
                                      directly in <root> are then ignored (with a warning)
        <root>/<any name>             no sub-folders with files: one class, named after <root>

    Every non-hidden regular file is a candidate, decoded with PIL (RGB); class
    folders are not searched recursively. Images may have any size: the shorter side
    is resized to R (bicubic, antialiased) and the centre R x R is kept. Files that
    cannot be decoded raise a UserError, or with ``on_bad_file="skip"`` are skipped
    and reported in one warning. Classes and files are listed in ``__init__``; the
    images are decoded in :meth:`setup`.

    Args:
        root: the folder.
        on_bad_file: ``"error"`` or ``"skip"``.
        resolution, batch_size, batches_per_step, num_workers, flip, seed: see
            :class:`ImageDataModule`.
    """

    name = "image_folder"

    def __init__(
        self,
        root: str,
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
        super().__init__(resolution, batch_size, batches_per_step, num_workers, flip, seed,
                         val_samples, test_samples, eval_batch_size)
        self.save_hyperparameters()
        self.root = root
        self.on_bad_file = on_bad_file_option(on_bad_file)
        self.files, self.class_names = self._scan()
        self.num_classes = len(self.class_names)

    def _scan(self) -> tuple[list[tuple[Path, int]], list[str]]:
        """(file, label) candidates and the class names; UserError if there are none."""
        root = Path(self.root).expanduser()
        if not root.is_dir():
            state = "is not a folder" if root.exists() else "does not exist"
            raise UserError(
                f"Image folder {root} {state}. Set data.root=/path/to/folder, a folder of images or of "
                f"one sub-folder of images per class."
            )
        subfolders = sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())
        classes = [(p.name, files) for p in subfolders if (files := _visible_files(p))]
        loose = _visible_files(root)
        if classes:
            if loose:
                log.warning(
                    "%s has class sub-folders; ignoring the %d file(s) directly in it (%s%s).", root, len(loose),
                    ", ".join(p.name for p in loose[:5]), ", ..." if len(loose) > 5 else "",
                )
            files = [(path, label) for label, (_, paths) in enumerate(classes) for path in paths]
            return files, [name for name, _ in classes]
        if not loose:
            raise UserError(
                f"Image folder {root} holds no files (hidden files are ignored). Put images in it, or one "
                f"sub-folder of images per class, and set data.root to it."
            )
        return [(path, 0) for path in loose], [root.resolve().name or "images"]

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image
        from tqdm.auto import tqdm

        images, labels, bad = [], [], []
        files = tqdm(self.files, desc=f"Loading {self.root}", unit="img", disable=len(self.files) <= PROGRESS_THRESHOLD)
        for path, label in files:
            try:
                image = _load_image(path, self.resolution)
            except DECODE_ERRORS + (Image.DecompressionBombError,) as err:
                self._bad(f"{path}: cannot be decoded as an image ({type(err).__name__}: {err})",
                          f"{path} cannot be decoded as an image ({type(err).__name__}: {err}). Remove or "
                          f"replace it.")  # fmt: skip
                bad.append(path)
                continue
            images.append(image)
            labels.append(label)
        used = set(labels)
        empty = [name for label, name in enumerate(self.class_names) if label not in used]
        if images and empty:
            log.warning("Class folder(s) with no usable image in %s: %s.", self.root, ", ".join(empty))
        if not images:
            raise UserError(
                f"Image folder {self.root} has no usable images: all {len(bad)} file(s) failed to decode. "
                f"Point data.root at a folder of images (PNG, JPEG, ...)."
            )
        return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)
