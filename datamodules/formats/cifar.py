"""The CIFAR-10 and CIFAR-100 python releases: one safe reader for both, used by every task that trains on them.

Each release is a folder of pickled dicts (written by Python 2, so keys are bytes)::

    cifar-10-batches-py/  data_batch_1 ... data_batch_5, test_batch  {b"data": uint8 (n, 3072), b"labels": [0..9]}
                          batches.meta                               {b"label_names": [10 names]}
    cifar-100-python/     train, test                {b"data": uint8 (n, 3072), b"fine_labels": [0..99]}
                          meta                       {b"fine_label_names": [100 names]}

A row of ``data`` is the R, G, B planes of a 32x32 image, each row-major. :class:`Release` describes one
release (where its files are, which keys hold what, how to get it); :func:`read_batch` and :func:`read_names`
read and validate its files. Unpickling goes through :class:`_ArrayUnpickler`, which can only rebuild numpy
arrays: a pickle that names any other global is refused before anything runs.

A malformed file raises :class:`~datamodules.base.DataError` (a UserError) whose message names the file and the
fix and whose ``entry`` is the one line a module lists in ``skipped`` when it drops the file
(``data.on_bad_file=skip``). Readers that meet several problems hand each to a ``bad`` callable: a module's
``self.bad.file`` (which applies ``data.on_bad_file``), or one that always raises.
"""

from __future__ import annotations

import codecs
import importlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attention.errors import UserError
from datamodules.base import DataError
from datamodules.download import ReleaseMissing, ensure_release, how_to_get

IMAGE_SHAPE = (3, 32, 32)  # a row of b"data" is these planes, row-major
ROW = 3 * 32 * 32


@dataclass(frozen=True)
class Release:
    """One CIFAR python release: its folder, files, keys, class count and where to get it."""

    name: str  # "CIFAR-10"
    folder: str  # the folder the archive unpacks to
    archive: str  # the official archive's file name
    url: str
    md5: str
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str
    listing: str  # the files, as the "not found" message names them
    unit: str  # what one data file is called: "batch" or "split"
    labels_key: bytes
    names_key: bytes
    num_classes: int
    default_names: tuple[str, ...] = ()

    @property
    def files(self) -> list[str]:
        return [*self.train_files, self.test_file, self.meta_file]

    def fix(self, path: Path) -> str:
        """How to repair a bad file of the release at ``path``."""
        return f"Delete {path.parent} and use data.download=true, or unpack the official {self.archive} there."

    def locate(self, root: str, url: str, offline: str, download: bool = False) -> Path:
        """The release folder under ``root`` (or ``root`` itself when it holds the files); UserError naming the
        missing files, ``data.root``, the download (``download``: whether ``data.download`` is set) and ``offline``
        (the data config to run without it)."""
        base = Path(root).expanduser()
        folder = base if any((base / n).is_file() for n in self.files) else base / self.folder
        missing = [n for n in self.files if not (folder / n).is_file()]
        if missing:
            state = f"lacks {', '.join(missing)}" if folder.is_dir() else "does not exist"
            raise ReleaseMissing(f"{self.name} not found: {folder} {state}. Expected {self.folder}/ with "
                                 f"{self.listing} under data.root={root}. "
                                 + how_to_get(download, url, self.archive, offline))
        return folder

    def fetch(self, root: str, download: bool, url: str, md5: str | None, offline: str) -> Path:
        """The release folder (:meth:`locate`); when it is incomplete and ``download`` is set, ``url`` is
        downloaded (md5-checked unless ``md5`` is None) and safely extracted into ``root`` first."""
        return ensure_release(lambda: self.locate(root, url, offline, download), download, url, Path(root).expanduser(),
                              md5)


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10 = Release(
    name="CIFAR-10", folder="cifar-10-batches-py", archive="cifar-10-python.tar.gz",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", md5="c58f30108f718f92721af3b95e74349a",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)), test_file="test_batch", meta_file="batches.meta",
    listing="data_batch_1 ... data_batch_5, test_batch and batches.meta", unit="batch",
    labels_key=b"labels", names_key=b"label_names", num_classes=10, default_names=tuple(CIFAR10_CLASSES),
)  # fmt: skip
CIFAR100 = Release(
    name="CIFAR-100", folder="cifar-100-python", archive="cifar-100-python.tar.gz",
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", md5="eb9058c3a382ffc7106e4002c42a8d85",
    train_files=("train",), test_file="test", meta_file="meta", listing="train, test and meta", unit="split",
    labels_key=b"fine_labels", names_key=b"fine_label_names", num_classes=100,
)  # fmt: skip


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
    files. The CIFAR files need only numpy's array reconstruction (and ``_codecs.encode``,
    which Python 3 uses for bytes at protocol 2); every other global is refused.
    """

    def __init__(self, file, path: Path, release: Release):
        super().__init__(file, encoding="bytes")  # the releases were pickled by Python 2
        self.path, self.release = path, release
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
                f"{self.path} is not a {self.release.name} {self.release.unit}: its pickle refers to {module}.{name}, "
                f"which only numpy arrays may (refused, nothing was run). {self.release.fix(self.path)}"
            ) from None


def _unpickle(path: Path, release: Release):
    """The object pickled in ``path``, through :class:`_ArrayUnpickler`; DataError if unreadable."""
    try:
        with open(path, "rb") as f:
            return _ArrayUnpickler(f, path, release).load()
    except UserError as err:  # a refused global
        raise DataError(str(err), f"{path}: refers to a global other than numpy arrays (refused)") from None
    except Exception as err:  # noqa: BLE001 - anything a corrupt pickle makes the allowed constructors raise
        raise DataError(
            f"{path} cannot be read as a {release.name} pickle, it is truncated or corrupt ({type(err).__name__}: "
            f"{err}). {release.fix(path)}",
            f"{path}: unreadable, truncated or corrupt pickle ({type(err).__name__})",
        ) from None


def read_batch(path: Path, release: Release, bad: Callable[[DataError], None]) -> tuple[np.ndarray, np.ndarray]:
    """Data uint8 (n, 3072) and labels int64 (n,) of one validated data file.

    A bad file raises :class:`~datamodules.base.DataError`; each image with a label outside
    ``0..num_classes-1`` goes to ``bad`` as one (which raises, or records it and returns: the image is dropped)."""
    fix, what, key = release.fix(path), f"{release.name} {release.unit}", release.labels_key
    batch = _unpickle(path, release)
    if not isinstance(batch, dict) or b"data" not in batch or key not in batch:
        keys = list(batch)[:10] if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{path} is not a {what}: expected a dict with b'data' and {key!r}, got {keys}. {fix}",
                      f"{path}: not a {what} (no b'data' and {key!r})")  # fmt: skip
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != ROW:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: b'data' must be a uint8 array of shape (n, {ROW}), got {got}. {fix}",
                      f"{path}: b'data' is {got}, expected uint8 (n, {ROW})")  # fmt: skip
    try:
        raw = np.asarray(batch[key]).reshape(-1)
        ok = raw.dtype.kind in "iu"
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise DataError(f"{path}: {key!r} must be a list of integers. {fix}", f"{path}: {key!r} are not integers")
    if len(raw) != len(data):
        raise DataError(f"{path} has {len(data)} images but {len(raw)} labels. {fix}",
                      f"{path}: {len(data)} images but {len(raw)} labels")  # fmt: skip
    top = release.num_classes - 1
    in_range = (raw >= 0) & (raw <= top)  # in the stored dtype: no wrap-around
    for i in np.flatnonzero(~in_range):
        bad(DataError(f"{path}: image {i} has label {raw[i]}, expected 0..{top}. {fix}",
                      f"{path}[{i}]: label {raw[i]} outside 0..{top}"))  # fmt: skip
    return np.ascontiguousarray(data[in_range]), raw[in_range].astype(np.int64)


def read_names(path: Path, release: Release) -> list[str]:
    """The class names of the release's meta file; DataError unless it holds ``num_classes`` names."""
    meta = _unpickle(path, release)
    key, n = release.names_key, release.num_classes
    names = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != n or not all(isinstance(x, (bytes, str)) for x in names):
        raise DataError(f"{path} must hold {key!r}, a list of {n} names. Restore it from the official "
                      f"{release.archive}, or delete {path.parent} and use data.download=true.",
                      f"{path}: no list of {n} {key!r} (standard names used)")  # fmt: skip
    return [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in names]


def read_split(folder: Path, release: Release, files: tuple[str, ...] | list[str],
               bad: Callable[[DataError], None]) -> tuple[np.ndarray, np.ndarray]:
    """Data uint8 (N, 3072) and labels int64 (N,) of ``files`` concatenated.

    A bad file goes whole to ``bad`` as well (which raises, or records it: the file is left out)."""
    parts = []
    for name in files:
        try:
            parts.append(read_batch(folder / name, release, bad))
        except DataError as err:
            bad(err)
    data = np.concatenate([d for d, _ in parts] or [np.empty((0, ROW), np.uint8)])  # (N, 3072) uint8
    labels = np.concatenate([lab for _, lab in parts] or [np.empty(0, np.int64)])
    return data, labels


def planes_to_hwc(data: np.ndarray) -> np.ndarray:
    """Rows (n, 3072: R, G, B planes of 32x32) -> uint8 (n, 32, 32, 3), as PIL and timm take them."""
    planes = data.reshape(-1, *IMAGE_SHAPE)  # (n, 3, 32, 32)
    return np.ascontiguousarray(planes.transpose(0, 2, 3, 1))  # (n, 32, 32, 3)
