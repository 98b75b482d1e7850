"""Processed-data caches: ``.npz`` files tagged with a fingerprint of their sources, written atomically; and
:func:`one_at_a_time`, the lock under which one run downloads or processes a data folder while the others wait."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

log = logging.getLogger(__name__)


def read_cache(path: Path, fingerprint: str, keys: Sequence[str] | None = None) -> dict[str, np.ndarray] | None:
    """The arrays ``keys`` (None: all) of the cache when ``path`` exists, reads and matches ``fingerprint``;
    else None (an unreadable file is logged and treated as missing, so the caller rebuilds it)."""
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


def write_cache(path: Path, fingerprint: str, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically (a temporary file, then a rename), so concurrent readers never see half a file."""
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
