"""Processed-data caches: ``.npz`` files tagged with a fingerprint of their sources, written atomically (in the
user's cache folder when the data folder cannot be written: a shared, read-only data set); and
:func:`one_at_a_time`, the lock under which one run downloads or processes a data folder while the others wait."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

log = logging.getLogger(__name__)


# Why a cache cannot be written where its data is: a shared data set the user may read but not write (EACCES; EPERM
# for an immutable folder), a read-only mount (EROFS). A normal situation, not an error: the cache goes to the user's
# cache folder (:func:`user_cache`) instead.
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_said: set[tuple[Path, Path | None]] = set()  # (folder, fallback or None) said: once a process, not once a split


def user_cache(path: Path) -> Path:
    """Where the cache ``path`` goes when its folder cannot be written: ``$XDG_CACHE_HOME`` (else ``~/.cache``)
    ``/attention-suite/data/<hash of the folder's absolute path>/<name>``, so that two data folders never share one."""
    folder = path.parent.expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attention-suite" / "data"
    return base / hashlib.sha1(str(folder).encode(), usedforsecurity=False).hexdigest()[:16] / path.name


def cache_exists(path: Path) -> bool:
    """Whether the cache ``path`` was written, where its data is or in the user's cache folder."""
    return path.is_file() or user_cache(path).is_file()


def read_cache(path: Path, fingerprint: str, keys: Sequence[str] | None = None) -> dict[str, np.ndarray] | None:
    """The arrays ``keys`` (None: all) of the cache when ``path`` (else its :func:`user_cache`, where it goes when
    the data folder cannot be written) exists, reads and matches ``fingerprint``; else None (an unreadable file is
    logged and treated as missing, so the caller rebuilds it)."""
    for candidate in (path, user_cache(path)):
        arrays = _read(candidate, fingerprint, keys)
        if arrays is not None:
            return arrays
    return None


def _read(path: Path, fingerprint: str, keys: Sequence[str] | None) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            if str(npz["fingerprint"]) != fingerprint:
                return None
            return {key: npz[key] for key in (npz.files if keys is None else keys)}
    except (OSError, ValueError, KeyError, EOFError) as err:
        log.warning("Rebuilding unreadable cache %s (%s).", path, err)
        return None


def write_cache(path: Path, fingerprint: str, arrays: dict[str, np.ndarray]) -> Path | None:
    """Write atomically (a temporary file, then a rename), so concurrent readers never see half a file; returns
    where it was written.

    A data folder the user cannot write (:data:`UNWRITABLE`: a shared data set) gets its cache in the user's cache
    folder instead (:func:`user_cache`, where :func:`read_cache` finds it), said in one warning; when that cannot
    be written either, the run goes on without a cache (None), said in a warning too: the next run processes the
    files again."""
    try:
        _write(path, fingerprint, arrays)
        return path
    except OSError as err:
        if err.errno not in UNWRITABLE:
            raise
        denied = err
    fallback = user_cache(path)
    try:
        _write(fallback, fingerprint, arrays)
    except OSError as err:
        if err.errno not in UNWRITABLE:
            raise
        if (path.parent, None) in _said:
            return None
        _said.add((path.parent, None))
        log.warning("Cannot write the processed-data cache %s (%s) nor %s (%s): going on without it, so every run "
                    "processes the files again. Make one of them writable, or set XDG_CACHE_HOME to a writable "
                    "folder.", path, denied.strerror, fallback, err.strerror)
        return None
    if (path.parent, fallback.parent) not in _said:
        _said.add((path.parent, fallback.parent))
        log.warning("%s cannot be written (%s: a shared or read-only data set), so its processed-data cache is "
                    "kept in %s instead, where later runs find it.", path.parent, denied.strerror, fallback.parent)
    return fallback


def _write(path: Path, fingerprint: str, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **{**arrays, "fingerprint": np.array(fingerprint)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def one_at_a_time(folder: Path, lock_name: str, doing: str) -> Iterator[None]:
    """Hold the lock file ``<folder>/<lock_name>`` (one lock per file and process, re-entrant), saying what the
    other run is ``doing`` while it holds it. Runs of a sweep started together (on one machine, or on several
    sharing a file system) download or process the same data: one does, the others wait and then find it done."""
    folder.mkdir(parents=True, exist_ok=True)
    # No soft (file-exists) fallback where the file system has no flock: a run killed while holding such a lock
    # would leave every later run waiting for ever. There the work goes on unlocked, as it always did.
    lock = FileLock(folder / lock_name, is_singleton=True, fallback_to_soft=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("Another run is %s: waiting for it to finish.", doing)
        lock.acquire()
    except OSError as err:
        log.warning("No lock while %s (%s: the file system of %s cannot lock files); runs started together may "
                    "do the same work at once.", doing, err, folder)
        yield
        return
    try:
        yield
    finally:
        lock.release()
