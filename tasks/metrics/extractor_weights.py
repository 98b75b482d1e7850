"""Weights of torch-fidelity's feature extractors, one rule for all: ``metrics.inception_weights`` (FID, IS, KID)
and ``metrics.vgg16_weights`` (precision/recall).

A choice is

- ``None``: the official file, fetched once into torch hub's cache as torch-fidelity does (a file already there
  is vetted like a user's);
- a path: read with ``torch.load(weights_only=True)`` and checked key by key against the extractor's state dict;
- ``"random"`` / ``"random:SEED"``: a seeded random initialisation, for offline smoke runs and tests only.

Written here because torch-fidelity reads weight files with ``weights_only=False`` (a file could run code) and has
no loader that takes a state dict; each extractor module (:mod:`.fid`, :mod:`.prc`) hands the vetted dict to
torch-fidelity's constructor through its ``build`` function.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import Tensor

from attention.errors import UserError

log = logging.getLogger(__name__)

_FILE_SHA1: dict[tuple, str] = {}   # file_id's cache, keyed by path + stat


def file_id(path: Path) -> str:
    """The first 12 hex digits of the SHA-1 of a file's bytes (cached per path, size and mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA1:
        sha1 = hashlib.sha1()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha1.update(block)
        _FILE_SHA1[key] = sha1.hexdigest()[:12]
    return _FILE_SHA1[key]


def load_error_reason(error: Exception) -> str:
    """The informative line of a torch.load error (weights-only refusals open with advice to unpickle anyway)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (specific or lines or ["no details"])[0]


@dataclass(frozen=True)
class ExtractorWeights:
    """The weights option of one extractor. ``expected``: what the file must be, for messages; ``uses``: what the
    extractor computes (``FID/IS``); ``off``: how to do without it (``metrics.prc=false``), if anything."""

    option: str
    url: str
    official_id: str
    expected: str
    uses: str
    off: str = ""

    def hub_path(self) -> str:
        """Where the official download lands: ``torch.hub.get_dir()/checkpoints/<file name of the URL>``."""
        return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(self.url).path))

    def _fixes(self) -> str:
        return (f"use {self.option}=random for an offline smoke run with meaningless scores"
                + (f", or turn the metric off with {self.off}" if self.off else ""))

    def random_seed(self, weights: str) -> int | None:
        """The seed of a ``"random"`` / ``"random:SEED"`` choice, None for anything else."""
        if weights == "random":
            return 0
        if not weights.startswith("random:"):
            return None
        try:
            return int(weights.split(":", 1)[1])
        except ValueError:
            raise UserError(
                f"{self.option}={weights!r} is not understood: random weights are written 'random' or 'random:SEED' "
                f"with an integer SEED (e.g. random:0). Use a path to {self.expected}, or leave the option unset "
                f"(null) for the official weights."
            ) from None

    def existing_file(self, weights: str) -> Path:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise UserError(
                f"{self.option}={weights!r}: no such file ({path.resolve()}). Expected {self.expected} (the file at "
                f"{self.url}); fix the path, leave the option unset (null) to download them, or {self._fixes()}."
            )
        return path

    def id(self, weights: str | None) -> str:
        """Short identifier of a choice, for cache keys: the official id, ``random-<seed>``, or the first 12 hex
        digits of the file's SHA-1 (a renamed copy shares its cache entries, a changed file does not)."""
        if weights is None:
            return self.official_id
        weights = os.fspath(weights)
        seed = self.random_seed(weights)
        return f"random-{seed}" if seed is not None else file_id(self.existing_file(weights))

    def vetted(self, weights: str, expected: Mapping[str, tuple[int, ...]], hint: str = "") -> dict[str, Tensor]:
        """Load a weights file without executing anything and check it is the extractor's state dict
        (``expected``: its names and shapes; ``hint``: how to convert other ports' files)."""
        path = self.existing_file(weights)
        what = (f"{self.option}={weights!r} ({path.resolve()}) must be {self.expected}: a plain state dict saved "
                f"with torch.save, as the file at {self.url}")
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for pickled code, RuntimeError/EOFError for corrupt or non-torch files
            raise UserError(
                f"{what}; it could not be loaded safely (torch.load with weights_only=True refused it: "
                f"{type(e).__name__}: {load_error_reason(e)}). Files that need arbitrary code to unpickle are refused "
                f"on purpose; re-download the weights or re-save them as a state dict of tensors."
            ) from None
        if not isinstance(state_dict, Mapping) or not all(torch.is_tensor(v) for v in state_dict.values()):
            raise UserError(f"{what}; this file holds a {type(state_dict).__name__}, not a dict of tensors. "
                            f"Re-download the weights or save model.state_dict() instead.")
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        wrong = [f"{k} {tuple(state_dict[k].shape)} (expected {tuple(expected[k])})"
                 for k in expected if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k])]
        if missing or unexpected or wrong:
            details = "; ".join(
                f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''} ({len(items)} in all)"
                for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                     ("wrong shapes", wrong)) if items)
            raise UserError(f"{what}; its state dict does not match the extractor's ({details}).{hint}")
        return dict(state_dict)

    def load(self, weights: str | None, cache: dict, build: Callable[[Mapping[str, Tensor] | None], torch.nn.Module],
             random_state: Callable[[int], dict[str, Tensor]], expected: Callable[[], Mapping[str, tuple[int, ...]]],
             hint: str = "") -> torch.nn.Module:
        """The extractor for a weights choice (module docstring), eval mode, no grad, cached in ``cache`` per choice.

        ``build(state_dict)`` constructs torch-fidelity's extractor (None: its own download); ``random_state(seed)``
        is the random initialisation; ``expected()`` the names and shapes a file must have.
        """
        if weights is not None:
            weights = os.fspath(weights)
        seed = self.random_seed(weights) if weights is not None else None
        if weights is None or seed is not None:
            key: object = weights
        else:
            st = self.existing_file(weights).stat()
            key = (str(Path(weights).expanduser().resolve()), st.st_size, st.st_mtime_ns)
        if key in cache:
            return cache[key]
        if weights is None and os.path.exists(self.hub_path()):
            # Already fetched: vet the cached file like a user's (torch-fidelity would unpickle it unrestricted).
            extractor = build(self.vetted(self.hub_path(), expected(), hint))
        elif weights is None:
            try:
                extractor = build(None)
            except (OSError, http.client.HTTPException) as e:   # URLError, timeouts, refused connections
                raise UserError(
                    f"Could not download the weights for {self.uses} from {self.url} ({type(e).__name__}: {e}). "
                    f"Pass {self.option}=PATH pointing at a copy of that file, or put the file at {self.hub_path()} "
                    f"(where it is looked for first); or {self._fixes()}."
                ) from None
            except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
                if not os.path.exists(self.hub_path()):
                    raise
                raise UserError(
                    f"The cached weights {self.hub_path()} for {self.uses} cannot be loaded ({type(e).__name__}: "
                    f"{e}); the file is probably truncated or corrupt. Delete it so that it is downloaded again from "
                    f"{self.url}, or pass {self.option}=PATH pointing at a good copy."
                ) from None
        elif seed is not None:
            log.warning("The extractor for %s uses random weights (%s, seed %d): the scores are only good for smoke "
                        "tests and are not comparable with published numbers.", self.uses, weights, seed)
            extractor = build(random_state(seed))
        else:
            extractor = build(self.vetted(weights, expected(), hint))
        extractor.eval().requires_grad_(False)
        cache[key] = extractor
        return extractor
