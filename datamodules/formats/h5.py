"""HDF5 files of arrays (the ModelNet40 and ShapeNetPart HDF5 releases): read whole, shapes and dtypes checked."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from datamodules.base import DataError

DTYPE_KINDS = {"f": "floating point", "iu": "integer"}


def read_h5(path: Path, spec: dict[str, tuple[list[tuple], str]], fix: str) -> dict[str, np.ndarray]:
    """Read and check datasets of one HDF5 file; every failure is a :class:`DataError` naming ``path``.

    Args:
        path: the file.
        spec: dataset name -> (allowed shapes, dtype kinds). A shape is a tuple whose
            entries are ints (exact sizes) or names (free sizes that must agree across
            the datasets, e.g. ``"n"`` for the sample count); kinds are numpy dtype
            kinds, ``"f"`` (floating point) or ``"iu"`` (integer).
        fix: appended to every message: how to get a good file.

    Returns:
        Each dataset of ``spec`` read into memory, with its stored dtype.
    """
    sizes: dict[str, tuple[int, str]] = {}  # named dimension -> (size, first dataset that had it)

    def bad(what: str, short: str | None = None) -> DataError:
        return DataError(f"{path}{what}. {fix}", f"{path}: {short or what.lstrip(': ')}")

    try:
        with h5py.File(path, "r") as f:
            for key in spec:
                if not isinstance(f.get(key), h5py.Dataset):
                    found = sorted(f.keys())
                    raise bad(f" has no '{key}' dataset (found keys: {found})", f"no '{key}' dataset")
            for key, (shapes, kinds) in spec.items():
                shape, dtype = f[key].shape, f[key].dtype
                if shape is None:  # an empty (null dataspace) dataset
                    shape = ()
                shape_ok = [s for s in shapes if len(s) == len(shape) and all(
                    isinstance(want, str) or want == got for want, got in zip(s, shape))]  # fmt: skip
                if not shape_ok:
                    expected = " or ".join("(" + ", ".join(str(d) for d in s) + ("," if len(s) == 1 else "") + ")"
                                           for s in shapes)  # fmt: skip
                    raise bad(f": '{key}' has shape {shape}, expected {expected}")
                if dtype.kind not in kinds:
                    raise bad(f": '{key}' has dtype {dtype}, expected {DTYPE_KINDS[kinds]}")
                for name, size in zip(shape_ok[0], shape):
                    if isinstance(name, str):
                        known, first = sizes.setdefault(name, (size, key))
                        if known != size:
                            raise bad(f": '{first}' has {name}={known} but '{key}' has {name}={size} "
                                      f"(shapes must agree)")  # fmt: skip
            return {key: f[key][()] for key in spec}
    except DataError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:  # h5py's errors on corrupt files
        raise DataError(
            f"{path} cannot be read as HDF5, it is truncated or corrupt ({type(err).__name__}: {err}). {fix}",
            f"{path}: unreadable, truncated or corrupt HDF5 ({type(err).__name__}: {err})",
        ) from None
