"""Checkpoint files that survive a crash and never run code when read.

:class:`SafeCheckpointIO` is the Trainer's ``CheckpointIO`` plugin (run.py adds it):

- **Atomic writes.** A checkpoint is written to ``.<name>.tmp-<pid>`` in the
  target folder, flushed to disk (``fsync``), then renamed over the target
  (``os.replace``, atomic on POSIX and Windows) and the folder entry synced.
  A process killed mid-write (pre-emption, OOM killer, Ctrl-C twice) leaves the
  previous ``last.ckpt`` intact next to a stray temporary file, which the next
  save in that folder removes. Lightning's own writer goes through fsspec's
  transaction (a temporary file moved into place) without the ``fsync``, so a
  machine crash right after a save could leave an empty file behind; this one
  is written by hand for that guarantee and for the refusal below. A run's
  ``metrics.json`` is written the same way (:func:`atomic_write_text`).
- **Safe reads.** Every load is ``torch.load(..., weights_only=True)``, whatever
  the caller asks for: a checkpoint that needs arbitrary code to unpickle (a
  pickled callable, a whole ``nn.Module``) is refused with a UserError naming
  the file instead of being executed. Our own checkpoints hold tensors and
  plain Python values only (see ``suite.resume.RandomState``). A file that is
  no torch file at all (``ckpt_path=/etc/passwd``) is told apart by its first
  bytes before torch reads it, so the message says so instead of passing on
  torch's advice about ``_use_new_zipfile_serialization``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.plugins.io import TorchCheckpointIO

from attention.errors import UserError
from suite.secrets import redact

TMP_MARK = ".tmp-"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6: a zip archive
PICKLE_MAGIC = b"\x80"      # the legacy format (torch < 1.6): a pickle, protocol 2 or later


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a synced temporary file renamed over ``path``."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` (UTF-8) into ``path`` as :func:`atomic_write` writes: a run's ``metrics.json``, which a kill while it
    was written left cut short (mode=report then set the finished run aside as corrupt)."""
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """``write(file)`` into a synced temporary file beside ``path``, then renamed over it: ``path`` is the old file
    or the new one, never a part of either."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stray in path.parent.glob(f".{path.name}{TMP_MARK}*"):  # left by a process killed mid-write
        if stray.name != f".{path.name}{TMP_MARK}{os.getpid()}":
            stray.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}{TMP_MARK}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_torch_load(path: str | os.PathLike, what: str | None = None, map_location: Any = "cpu", **kwargs) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs code to unpickle, or is not a torch file at all,
    raises a UserError naming the file (``what``, e.g. "ckpt_path=<path>"; default "checkpoint <path>")."""
    what = what or f"checkpoint {path}"
    try:
        if check_torch_file(path, what) == "legacy":
            kwargs.pop("mmap", None)  # torch maps zip archives only; a legacy file is read whole
        return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        first = next((line for line in str(err).splitlines() if "GLOBAL" in line), None)
        if first is None:  # not a refused global: junk where a pickle should be
            raise _unreadable(what, err) from None
        raise UserError(
            f"Refusing to load {what}: it needs arbitrary code to unpickle ({first.strip()}). Files are read "
            "with torch.load(weights_only=True), which accepts tensors and plain Python values only, so a file "
            "holding pickled functions or objects cannot run code on this machine. Use a checkpoint written by "
            "run.py, or re-save the weights you trust as a plain state dict (torch.save(model.state_dict(), ...))."
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError) as err:
        raise _unreadable(what, err) from None


def check_torch_file(path: str | os.PathLike, what: str) -> str:
    """"zip" or "legacy", the format of the torch file at ``path`` from its first bytes; a UserError naming
    ``what`` when it is neither (a text file, an image, an empty file). Reads the first bytes only: cheap enough to
    run on ``ckpt_path`` at start-up, before any data is read."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head.startswith(PICKLE_MAGIC):
        return "legacy"
    raise UserError(
        f"{what} is not a PyTorch checkpoint: a checkpoint is the file torch.save writes, a zip archive whose first "
        f"bytes are {ZIP_MAGIC!r} (run.py writes them to outputs/<task>/<attn>/<run>/checkpoints/, last.ckpt and "
        f"best-*.ckpt), and this file {f'starts with {head!r}' if head else 'is empty'}, so it is truncated, "
        "corrupt or not a torch file at all. Pass the path of a checkpoint, e.g. "
        "ckpt_path=outputs/<task>/<attn>/<run>/checkpoints/last.ckpt (or ckpt_path=last with "
        "hydra.run.dir=<run dir>)."
    )


def _unreadable(what: str, err: BaseException) -> UserError:
    return UserError(
        f"Cannot read {what} ({str(err).splitlines()[0] if str(err) else type(err).__name__}): it is truncated, "
        "corrupt or not a torch file. Pass another checkpoint (an earlier best-*.ckpt, or last.ckpt of the run)."
    )


def redacted_hparams(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with the task's and the data module's constructor arguments redacted (suite/secrets.py): the
    data module is built from the config as given, so that a data set option needing a credential gets it, and
    Lightning stores its arguments in every checkpoint."""
    keys = (LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY)
    return {**checkpoint, **{key: redact(checkpoint[key]) for key in keys if key in checkpoint}}


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint plugin: atomic ``save_checkpoint``, ``weights_only`` ``load_checkpoint``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("SafeCheckpointIO.save_checkpoint takes no storage_options.")
        atomic_torch_save(redacted_hparams(checkpoint), path)

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return safe_torch_load(path, map_location=map_location or "cpu")
