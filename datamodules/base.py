"""The one base of every data module: options, splits, bad files, loaders and shared constants.

Every data module of the suite (point clouds, part segmentation, semantic segmentation, image
generation, image classification) is a :class:`DataModule`. What a family or dataset fills in:

- ``name`` (class attribute, optional): how messages name the data set; default the class name.
- ``__init__``: call ``super().__init__(batch_size=..., eval_batch_size=..., num_workers=..., seed=...,
  on_bad_file=...)``, which checks those options (examples in messages are the subclass's own
  defaults), then check its own options with :func:`int_option`, :func:`float_option`,
  :func:`bool_option`, :func:`choice_option` (:func:`split_sizes_option` for generated splits). A data set
  of a family takes only its own options and passes the rest on (``**options``) to the family base,
  where each shared default lives once.
- :meth:`DataModule._build` (required): load the splits and set ``train_set``, ``val_set`` and
  ``test_set``. :meth:`DataModule.setup` calls it once, with an empty ``skipped``, and then warns
  once about whatever was skipped and not yet reported.
- Bad data goes through ``self.bad`` (:class:`BadFiles`), which applies ``data.on_bad_file``:
  :meth:`BadFiles.file` for a bad file, :meth:`BadFiles.samples` for per-sample checks of one file,
  :meth:`BadFiles.problems` for a list of ``(file, what is wrong)``. Readers raise :class:`DataError`.
  A sample found bad only where it is loaded (a DataLoader worker) is dropped by the collate function, which
  lists its entry under :data:`SKIPPED` in the batch; :meth:`DataModule.on_before_batch_transfer` counts it.
- Loaders: ``train_dataloader`` / ``val_dataloader`` / ``test_dataloader`` are built by
  :meth:`DataModule.build_loader` from the split's dataset; a family sets :meth:`DataModule.collate`
  (default: PyTorch's) and ``full_train_batches`` (see there), or calls ``build_loader`` itself for
  other datasets (e.g. a generative model's index set).
"""

from __future__ import annotations

import inspect
import logging
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from attention.errors import UserError
from datamodules.loaders import Loader, ResumableLoader, WorkerInit, eval_loading, train_sampling

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Constants shared by the families: one home each.

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# What PIL raises for unreadable, non-image, truncated, malformed or oversized files (plugins differ).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, KeyError, TypeError,
                 Image.DecompressionBombError)  # fmt: skip
MAX_NAMES = 5  # names listed in one message or warning
# Split -> index: the order of the splits, and the stream index of seeded per-split randomness
# (``np.random.default_rng([seed, SPLITS[split], ...])``), so splits never share a random stream.
SPLITS = {"train": 0, "val": 1, "test": 2}
ON_BAD_FILE = ("error", "skip")
SKIP_HINT = "Or set data.on_bad_file=skip to drop bad files and samples (they are counted and named)."
# The key under which a collate function lists the samples of a batch that its worker dropped (data.on_bad_file=skip,
# "<file>: <reason>" each): DataModule.on_before_batch_transfer takes them out and counts them in the run's process.
SKIPPED = "skipped"


def describe(names: Iterable) -> str:
    """The first :data:`MAX_NAMES` of ``names``, and how many there are in all when that is more."""
    names = [str(n) for n in names]
    return "; ".join(names[:MAX_NAMES]) + (f"; ... ({len(names)} in all)" if len(names) > MAX_NAMES else "")


# ---------------------------------------------------------------------------
# Option checks: one message style for every ``data.<option>``.


def int_option(name: str, value, minimum: int, example) -> int:
    """``value`` as an int >= ``minimum``; UserError naming ``data.<name>`` with an example value otherwise."""
    try:
        ok = not isinstance(value, bool) and int(value) == value and int(value) >= minimum
    except (TypeError, ValueError):
        ok = False
    if not ok:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(
            f"data.{name} must be {what}, got {value!r}; fix it in the data config or override it, "
            f"e.g. data.{name}={example}."
        )
    return int(value)


def float_option(name: str, value, example, low: float = 0.0, high: float = math.inf,
                 low_closed: bool = False, why: str = "", high_closed: bool = False) -> float:  # fmt: skip
    """``value`` as a finite float in ``(low, high)`` (``[low, ...`` when ``low_closed``, ``..., high]`` when
    ``high_closed``); UserError naming ``data.<name>``, the range, ``why`` (if given) and an example otherwise."""
    try:
        number = float(value)
        ok = not isinstance(value, bool) and math.isfinite(number) and \
            (low <= number if low_closed else low < number) and \
            (number <= high if high_closed else number < high)  # fmt: skip
    except (TypeError, ValueError):
        ok = False
    if not ok:
        if high < math.inf:
            what = f"a number in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
        elif low_closed:
            what = f"a number >= {low:g}"
        else:
            what = "a positive number" if low == 0 else f"a number > {low:g}"
        raise UserError(f"data.{name} must be {what}{why}, got {value!r}; e.g. data.{name}={example}.")
    return number


def bool_option(name: str, value) -> bool:
    """``value`` as a bool; UserError naming ``data.<name>`` when it is anything else (a string, a number)."""
    if not isinstance(value, (bool, np.bool_)):
        raise UserError(f"data.{name} must be true or false, got {value!r}.")
    return bool(value)


def choice_option(name: str, value, choices: Sequence):
    """``value`` when it is one of ``choices``; UserError naming ``data.<name>`` and the choices (booleans spelt
    as on the command line: true, false) otherwise."""
    if value not in choices:
        spelt = (str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise UserError(f"data.{name} must be one of {', '.join(spelt)}, got {value!r}.")
    return value


def is_sequence(value) -> bool:
    """A list, tuple or OmegaConf ListConfig (not a string)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def split_sizes_option(suffix: str, train, val, test, example: int) -> dict[str, int]:
    """``{"train": ..., "val": ..., "test": ...}`` from ``data.train_<suffix>``, ``data.val_<suffix>`` and
    ``data.test_<suffix>`` (generated data sets): train and test >= 1, val >= 0 (0: no val split)."""
    return {split: int_option(f"{split}_{suffix}", value, least, example)
            for split, value, least in [("train", train, 1), ("val", val, 0), ("test", test, 1)]}  # fmt: skip


def on_bad_file_option(value) -> str:
    """``data.on_bad_file`` checked: "error" (stop at the first bad file) or "skip" (drop bad files and samples)."""
    if value not in ON_BAD_FILE:
        raise UserError(
            f"data.on_bad_file must be 'error' (stop at the first bad file) or 'skip' (drop bad files and "
            f"samples, counted), got {value!r}; e.g. data.on_bad_file=skip."
        )
    return str(value)


# ---------------------------------------------------------------------------
# Bad files and samples: one policy for ``data.on_bad_file``.


class DataError(UserError):
    """A bad file or sample: the message says what and how to fix it; ``entry`` is the one-line record
    that ``on_bad_file=skip`` keeps in ``skipped`` (``"<file>: <reason>"``, ``"<file>[<i>]: <reason>"``)."""

    def __init__(self, message: str, entry: str):
        super().__init__(message)
        self.entry = entry


class BadFiles:
    """Applies ``data.on_bad_file``: with ``"error"`` the first problem raises (its message ends with
    :data:`SKIP_HINT`), with ``"skip"`` every problem is recorded in ``skipped``, one line each, and
    :meth:`warn` reports them: ``Skipped <n> <kind> of <data set> (data.on_bad_file=skip): <names>``."""

    def __init__(self, on_bad_file: str):
        self.on_bad_file = on_bad_file_option(on_bad_file)
        self.skip = self.on_bad_file == "skip"
        self.skipped: list[str] = []
        self._warned = 0  # entries of ``skipped`` already reported by warn()

    def reset(self) -> None:
        """Forget what was skipped (a fresh setup)."""
        self.skipped = []
        self._warned = 0

    def loaded(self, entries: Iterable[str]) -> None:
        """Record samples dropped where they were loaded (a DataLoader worker, which warned already), each once
        however often it is met (every epoch): :data:`SKIPPED` of a batch."""
        known = set(self.skipped)
        for entry in entries:
            if entry not in known:
                known.add(entry)
                self.skipped.append(entry)

    def file(self, err: DataError) -> None:
        """A bad file (or sample): raise ``err`` with the hint (error) or record its entry (skip)."""
        if not self.skip:
            raise DataError(f"{err} {SKIP_HINT}", err.entry) from None
        self.skipped.append(err.entry)

    def samples(self, path: Path, n: int, checks: list[tuple[np.ndarray, Callable[[int], str]]],
                fix: str) -> np.ndarray:  # fmt: skip
        """Keep-mask (n,) bool of the samples of ``path`` that pass every check.

        Each check is ``(bad, say)``: ``bad`` (n,) bool marks failing samples, ``say(i)`` describes
        the failure of sample ``i`` ("sample 3 has label 57, expected 0..39"). With ``error``
        the first failing sample of the first failing check raises; with ``skip`` every failing
        sample is recorded once, as ``"<path>[i]: <say(i)>"``.
        """
        keep = np.ones(n, dtype=bool)
        for bad, say in checks:
            bad = np.asarray(bad, dtype=bool) & keep
            hits = np.flatnonzero(bad)
            if not len(hits):
                continue
            if not self.skip:
                i = int(hits[0])
                more = f" ({len(hits)} such samples in this file)" if len(hits) > 1 else ""
                raise DataError(f"{path}: {say(i)}{more}. {fix} {SKIP_HINT}", f"{path}[{i}]: {say(i)}")
            self.skipped.extend(f"{path}[{int(i)}]: {say(int(i))}" for i in hits)
            keep &= ~bad
        return keep

    def problems(self, problems: Sequence[tuple[Path | str, str]], fix: str) -> set:
        """Problems found while checking a split, ``(file, what is wrong)`` each: the first raises, naming
        how many there are in all (error), or all are recorded as ``"<file>: <what>"`` (skip).
        Returns the files to drop."""
        if not problems:
            return set()
        path, what = problems[0]
        if not self.skip:
            more = f" ({len(problems)} such problems in all)" if len(problems) > 1 else ""
            raise DataError(f"{path}: {what}{more}. {fix} {SKIP_HINT}", f"{path}: {what}")
        self.skipped.extend(f"{p}: {what}" for p, what in problems)
        return {p for p, _ in problems}

    def warn(self, what: str, kind: str = "bad file(s) or sample(s)") -> None:
        """One warning for the entries skipped since the last one (nothing when there are none)."""
        new = self.skipped[self._warned :]
        self._warned = len(self.skipped)
        if new:
            log.warning("Skipped %d %s of %s (data.on_bad_file=skip): %s", len(new), kind, what, describe(new))


# ---------------------------------------------------------------------------
# The data module base.


class DataModule(L.LightningDataModule):
    """Base of every data module (what to fill in: the module docstring).

    Args:
        batch_size: training batch size.
        eval_batch_size: validation / test batch size; None = ``batch_size``.
        num_workers: DataLoader workers (evaluation workers persist; training ones are new every
            epoch, seeded by (seed, epoch), so resumed runs see the same batches).
        seed: the data module's own seed (held-out splits, generated data, evaluation draws).
        on_bad_file: ``"error"`` or ``"skip"`` (:class:`BadFiles`).

    After :meth:`setup`, ``skipped`` lists the bad files and samples that were dropped (empty when none).
    """

    name: str | None = None
    # True: a training split smaller than one batch is a UserError and the last partial batch is
    # dropped. False: the last partial batch is dropped only when the split exceeds one batch.
    full_train_batches: bool = True
    sample_noun: str = "samples"  # what messages call one sample
    # True: the data set has no public test labels, so its "test" split is its validation split; the run's recorded
    # protocol then says the test metrics were measured on val (suite/run_record.py).
    test_split_is_val: bool = False
    # True: the data set is whatever folder ``root`` names (class folders, a folder of images), not a published data
    # set found at some path: ``mode=report`` tells runs on two such folders apart by the folder's name.
    root_is_the_data: bool = False

    def __init__(self, batch_size: int, eval_batch_size: int | None, num_workers: int, seed: int,
                 on_bad_file: str = "error"):  # fmt: skip
        super().__init__()
        self.batch_size = int_option("batch_size", batch_size, 1, self._example("batch_size", 32))
        self.eval_batch_size = self.batch_size if eval_batch_size is None else \
            int_option("eval_batch_size", eval_batch_size, 1, self._example("eval_batch_size", self.batch_size))
        self.num_workers = int_option("num_workers", num_workers, 0, self._example("num_workers", 0))
        self.seed = int_option("seed", seed, 0, self._example("seed", 0))
        self.bad = BadFiles(on_bad_file)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    @classmethod
    def _example(cls, option: str, fallback):
        """The default of ``option`` in the most derived signature that names it (an example value for messages)."""
        for klass in cls.__mro__:
            parameter = inspect.signature(klass.__init__).parameters.get(option)
            if parameter is not None:
                default = parameter.default
                return fallback if default is None or default is inspect.Parameter.empty else default
        return fallback

    @property
    def title(self) -> str:
        """How messages name this data set."""
        return self.name or type(self).__name__

    @property
    def on_bad_file(self) -> str:
        return self.bad.on_bad_file

    @property
    def skipped(self) -> list[str]:
        """One line per bad file or sample dropped by the last :meth:`setup` (``on_bad_file=skip``)."""
        return self.bad.skipped

    # -- to fill in ------------------------------------------------------------------------------------------
    def _build(self) -> None:
        """Load the splits and set ``train_set``, ``val_set`` and ``test_set``; bad data goes to ``self.bad``."""
        raise NotImplementedError

    def _built(self) -> bool:
        """Whether :meth:`_build` has run (then :meth:`setup` does nothing)."""
        return self.train_set is not None

    def collate(self) -> Callable | None:
        """The loaders' ``collate_fn`` (None: PyTorch's default, which stacks dicts of tensors)."""
        return None

    # -- setup and loaders -----------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Build the splits once (later calls do nothing), then warn about what was skipped."""
        if self._built():
            return
        self.bad.reset()
        self._build()
        self.bad.warn(self.title)

    def build_loader(self, dataset: Dataset, split: str, batch_size: int | None = None, what: str | None = None,
                     num_workers: int | None = None) -> DataLoader:  # fmt: skip
        """The loader of ``dataset`` as split ``split``.

        ``"train"``: a :class:`~datamodules.loaders.ResumableLoader`, shuffled by (seed, epoch), new
        workers every epoch (see ``full_train_batches`` for the last partial batch). Other splits: in
        order, every sample exactly once (also under DDP), workers kept between evaluations.
        ``batch_size`` defaults to ``batch_size`` / ``eval_batch_size``, ``what`` (how a DDP error names
        the set) to "<title> <split> split", ``num_workers`` to ``num_workers``.
        """
        train = split == "train"
        batch_size = batch_size or (self.batch_size if train else self.eval_batch_size)
        workers = self.num_workers if num_workers is None else num_workers
        if train and self.full_train_batches and len(dataset) < batch_size:
            raise UserError(self._too_small(len(dataset), batch_size))
        return (ResumableLoader if train else Loader)(
            dataset,
            batch_size=batch_size,
            **(self.train_sampling(dataset) if train else eval_loading(dataset, what or f"{self.title} {split} split")),
            drop_last=train and (self.full_train_batches or len(dataset) > batch_size),
            collate_fn=self.collate(),
            num_workers=workers,
            persistent_workers=workers > 0 and not train,  # training: new workers seeded per epoch
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=WorkerInit(self.trainer.global_rank if self.trainer is not None else None),
        )

    def train_sampling(self, dataset: Dataset) -> dict:
        """The training loader's sampler and worker-seed generator (:func:`datamodules.loaders.train_sampling`)."""
        return train_sampling(dataset)

    def _too_small(self, size: int, batch_size: int) -> str:
        """The message for a training split smaller than one batch (``full_train_batches``)."""
        return (f"The {self.title} training split has {size} {self.sample_noun}, fewer than one batch of "
                f"data.batch_size={batch_size}; lower data.batch_size or add data.")  # fmt: skip

    def _loader(self, split: str) -> DataLoader:
        self.setup()
        return self.build_loader(getattr(self, f"{split}_set"), split)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Count the samples a worker dropped from ``batch`` (:data:`SKIPPED`) with the other bad files: decoding
        happens in the workers, whose own records never reach the run's ``data/skipped``."""
        if isinstance(batch, dict) and SKIPPED in batch:
            self.bad.loaded(batch.pop(SKIPPED))
        return batch

    def train_dataloader(self) -> DataLoader:
        """Shuffled by (seed, epoch), resumable mid-epoch."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """In order, every sample exactly once."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """In order, every sample exactly once."""
        return self._loader("test")


class PointSetDataModule(DataModule):
    """What the point-set families (:mod:`datamodules.points`, :mod:`datamodules.partseg`) share on top of
    :class:`DataModule`, checked once: ``root`` (the dataset folder, meaning depends on the data set),
    ``npoints`` (points per sample) and ``augment`` (the training augmentation, on the train split). A train
    split smaller than one batch gives one partial batch (the last partial batch is dropped only when the split
    exceeds one batch). The family base keeps the defaults (its signature) and calls ``save_hyperparameters``."""

    full_train_batches = False

    def __init__(self, root: str | None, npoints: int, augment: bool, **options):
        super().__init__(**options)
        self.root = root
        self.npoints = int_option("npoints", npoints, 1, self._example("npoints", 1024))
        self.augment = bool_option("augment", augment)
