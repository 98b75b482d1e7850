"""The ShapeNetPart txt release's shape files: one shape a file, rows ``x y z nx ny nz part``.

Read by :class:`datamodules.partseg.shapenet_part.ShapeNetPart`; torch-geometric's own reader parses the same
files for :class:`datamodules.partseg.shapenet_part_pyg.ShapeNetPartPyG`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datamodules.base import DataError


def read_shape_txt(path: Path, category: str, parts: tuple[int, int], fix: str) -> np.ndarray:
    """Parse and check one shape file of category ``category`` (a name), whose global part ids are
    ``parts[0]..parts[1]``: (P, 7) float64 rows ``x y z nx ny nz part`` (coordinates as stored); every
    problem is a :class:`~datamodules.base.DataError` naming the file and line, ending with ``fix``."""
    def bad(where: str, what: str) -> DataError:
        return DataError(f"{path}{where}: {what}. {fix}", f"{path}{where}: {what}")

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise bad("", f"cannot be read as text ({type(err).__name__}: {err})") from None
    lines = text.splitlines()
    fields = [line.split() for line in lines]
    numbers = [n for n, f in enumerate(fields, start=1) if f]  # line number of every non-blank line
    tokens = [tok for f in fields if f for tok in f]
    values = None
    if len(tokens) == 7 * len(numbers) and all(len(f) == 7 for f in fields if f):
        try:
            values = np.array(tokens, dtype=np.float64).reshape(-1, 7)
        except ValueError:
            pass
    if values is None:  # find the first bad line
        for number in numbers:
            row = fields[number - 1]
            try:
                ok = len(row) == 7 and [float(t) for t in row]
            except ValueError:
                ok = False
            if not ok:
                raise bad(f", line {number}", f"expected 7 numbers 'x y z nx ny nz part', got "
                                              f"{lines[number - 1].strip()[:80]!r}")  # fmt: skip
        raise bad("", "cannot be parsed as rows of 7 numbers")  # unreachable: some line failed above
    if len(values) == 0:
        raise bad("", "holds no points (expected rows 'x y z nx ny nz part')")
    with np.errstate(over="ignore"):
        finite = np.isfinite(values[:, :3]).all(axis=1) & np.isfinite(values[:, 3:6].astype(np.float32)).all(axis=1)
    bad_rows = np.flatnonzero(~finite)
    if len(bad_rows):
        raise bad(f", line {numbers[bad_rows[0]]}", "NaN or infinite coordinates or normal")
    lo, hi = parts
    part = values[:, 6]
    bad_rows = np.flatnonzero((part != np.round(part)) | (part < lo) | (part > hi))
    if len(bad_rows):
        raise bad(f", line {numbers[bad_rows[0]]}", f"part label {part[bad_rows[0]]:g} is outside the "
                  f"{category} range {lo}..{hi} (global ShapeNetPart part ids)")  # fmt: skip
    return values
