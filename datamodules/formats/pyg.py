"""torch-geometric's datasets: :class:`PyGRaw`, what every data module read through one shares (``<root>/raw``
checked, processed into ``<root>/processed`` once and again whenever the raw files change, nothing downloaded);
and their collated storage (``InMemoryDataset``): where each item's rows are, and which meshes of a processed
mesh dataset (ModelNet's OFF files) ``SamplePoints`` cannot sample."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attention.errors import UserError
from datamodules.cache import one_at_a_time

log = logging.getLogger(__name__)

# Beside PyG's processed files: the fingerprint of the raw files and processing they were made from. PyG itself
# only checks that processed/*.pt exist, so without it raw files added, edited or removed later were ignored.
FINGERPRINT_FILE = "raw_fingerprint.txt"

# What a torch-geometric dataset raises while processing a raw file it cannot parse (a malformed mesh, split
# list or shape file; json.JSONDecodeError is a ValueError).
PROCESS_ERRORS = (OSError, ValueError, IndexError, RuntimeError, KeyError)


class PyGRaw:
    """Mixin of a data module (``self.root``) read through a torch-geometric dataset, which processes
    ``<root>/raw`` once into ``<root>/processed``. PyG would download a missing or incomplete ``raw``:
    :meth:`_check_raw` refuses it first, saying what is wrong and how to get it right.

    A data module sets ``raw_what`` (how messages name the raw files, e.g. "ModelNet40 meshes"),
    ``raw_archive`` (the release to restore them from), ``raw_cause`` (what a failed processing probably
    means), ``raw_how`` (how to get ``<root>/raw`` right, ``{raw}`` standing for its path) and implements
    :meth:`_raw_problem`; it builds its PyG datasets with :meth:`_process`.

    ``<root>/processed`` is rebuilt when its fingerprint (every non-hidden file under ``raw``: relative name,
    size, modification time; the processing options; ``process_version``) no longer matches, or it has none
    (written by an older version): the stale ``*.pt`` files are deleted first, so PyG processes ``raw`` again.
    A data module bumps ``process_version`` when what it makes of the processed files changes.
    """

    root: str
    raw_what: str
    raw_archive: str
    raw_cause: str
    raw_how: str
    process_version = 1

    def _raw_problem(self, raw: Path) -> str | None:
        """What keeps PyG from processing ``raw`` offline (a sentence), or None when nothing does."""
        raise NotImplementedError

    def _check_raw(self) -> Path:
        """``<root>/raw``, checked: a UserError when :meth:`_raw_problem` finds something wrong with it."""
        raw = Path(self.root).expanduser() / "raw"
        problem = self._raw_problem(raw)
        if problem:
            raise UserError(f"{problem} {self.raw_how.format(raw=raw)}")
        return raw

    def _process(self, make: Callable[[str], Any], options: str = ""):
        """``make(<root>)``, the PyG dataset (processed from the checked ``raw`` when ``processed/`` is missing
        or stale, loaded after); ``options`` names what ``make`` processes with (part of the fingerprint). A
        file PyG cannot parse is a UserError naming it as far as PyG does, and how to reprocess."""
        raw = self._check_raw()
        processed = raw.parent / "processed"
        try:
            # One run processes (PyG writes processed/ with plain torch.save); the others wait, then load it.
            with one_at_a_time(raw.parent, ".process.lock", f"processing {raw} into {processed}"):
                fingerprint = self._fingerprint(raw, options)
                if _read_fingerprint(processed) == fingerprint:
                    return make(str(raw.parent))
                self._drop_stale(processed, raw)
                dataset = make(str(raw.parent))
                _write_fingerprint(processed, fingerprint)  # only once processing succeeded
                return dataset
        except PROCESS_ERRORS as err:
            raise UserError(
                f"torch-geometric could not process the {self.raw_what} under {raw} ({type(err).__name__}: "
                f"{err}). {self.raw_cause}; restore the original {self.raw_archive} contents (the next run "
                f"processes them again)."
            ) from None

    def _fingerprint(self, raw: Path, options: str) -> str:
        """Of every non-hidden file under ``raw`` (relative name, size, mtime), the processing ``options`` and
        ``process_version``. Hidden files (.DS_Store) are skipped: PyG reads none, and they change often."""
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"pyg-v{self.process_version}\t{options}\n".encode())
        for top, dirs, files in os.walk(raw):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            here = Path(top)
            for name in sorted(files):
                if name.startswith("."):
                    continue
                path = here / name
                st = path.stat() if path.exists() else path.lstat()  # a dangling link: PyG fails on it, named
                digest.update(f"{path.relative_to(raw).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
            for name in dirs:  # an empty category folder is a label to ModelNet
                digest.update(f"{(here / name).relative_to(raw).as_posix()}/\n".encode())
        return digest.hexdigest()[:16]

    def _drop_stale(self, processed: Path, raw: Path) -> None:
        """Delete PyG's files in ``processed`` (made from other raw files, options or version), so it rebuilds."""
        stale = sorted(processed.glob("*.pt")) if processed.is_dir() else []
        if stale:
            why = ("the raw files or the processing changed since they were made"
                   if (processed / FINGERPRINT_FILE).is_file() else
                   "they carry no fingerprint of the raw files (made by an older version)")  # fmt: skip
            log.info("Reprocessing %s into %s: %s.", raw, processed, why)
        for path in stale:
            path.unlink(missing_ok=True)
        (processed / FINGERPRINT_FILE).unlink(missing_ok=True)


def _read_fingerprint(processed: Path) -> str | None:
    try:
        return (processed / FINGERPRINT_FILE).read_text().strip()
    except OSError:  # none (never processed, or by an older version) or unreadable: reprocess
        return None


def _write_fingerprint(processed: Path, fingerprint: str) -> None:
    """Atomically (a temporary file, then a rename): a run killed here leaves none, and so reprocesses."""
    path = processed / FINGERPRINT_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(fingerprint + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def pyg_offsets(dataset, key: str) -> torch.Tensor:
    """Offsets (n + 1,) of ``key`` in a collated PyG dataset's storage (PyG keeps no slices for a
    dataset of one item, nor for an attribute no item has)."""
    slices = dataset.slices.get(key) if dataset.slices else None
    if slices is not None:
        return slices
    value = getattr(dataset._data, key, None)
    size = 0 if value is None else value.shape[-1 if key == "face" else 0]
    return torch.tensor([0, size]) if len(dataset) == 1 else torch.zeros(len(dataset) + 1, dtype=torch.long)


def mesh_problems(dataset) -> dict[int, str]:
    """Meshes of a processed PyG ModelNet dataset that ``SamplePoints`` cannot sample: mesh index ->
    what is wrong (non-finite vertices, no faces, a face naming a missing vertex, zero area)."""
    data = dataset._data
    pos = data.pos.to(torch.float64)  # (T, 3)
    face = data.face if data.face is not None else torch.empty((3, 0), dtype=torch.long)  # (3, F), per-mesh indices
    nv, nf = pyg_offsets(dataset, "pos").diff(), pyg_offsets(dataset, "face").diff()  # (n,) each
    n = len(nv)
    vert_mesh = torch.repeat_interleave(torch.arange(n), nv)  # (T,)
    face_mesh = torch.repeat_interleave(torch.arange(n), nf)  # (F,)
    nonfinite = torch.zeros(n).index_add_(0, vert_mesh, (~torch.isfinite(pos).all(dim=1)).to(torch.float32))
    outside = ((face < 0) | (face >= nv[face_mesh])).any(dim=0)  # (F,)
    bad_faces = torch.zeros(n).index_add_(0, face_mesh, outside.to(torch.float32))
    scale = torch.zeros(n, dtype=torch.float64).scatter_reduce_(
        0, vert_mesh, pos.abs().amax(dim=1).nan_to_num(0.0, 0.0, 0.0), "amax")  # (n,) as SamplePoints divides
    ok_face = ~outside
    corner = (face.clamp(min=0) + pyg_offsets(dataset, "pos")[:-1][face_mesh]).clamp(max=max(len(pos) - 1, 0))  # (3, F)
    unit = pos / scale[vert_mesh].clamp(min=1e-300)[:, None]
    area = torch.zeros(n, dtype=torch.float64)
    if face.shape[1] and len(pos):
        cross = torch.linalg.cross(unit[corner[1]] - unit[corner[0]], unit[corner[2]] - unit[corner[0]], dim=1)
        area.index_add_(0, face_mesh, torch.where(ok_face, cross.norm(dim=1), 0.0).nan_to_num(0.0))
    problems = {}
    for i in range(n):
        if nonfinite[i]:
            problems[i] = "NaN or infinite vertex coordinates"
        elif nf[i] == 0:
            problems[i] = "no faces"
        elif bad_faces[i]:
            problems[i] = "a face refers to a vertex that does not exist"
        elif not float(area[i]) / 2 > 1e-12:
            problems[i] = "zero surface area (all faces degenerate), nothing to sample points on"
    return problems
