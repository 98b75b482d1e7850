"""``trainer.deterministic=true``: two runs of one seed give identical metrics, on a GPU as on the CPU.

What makes a run repeatable, and who does it:

- the seed of every random stream (python, numpy, torch, the data-loader workers): ``suite/compose.py``;
- Lightning's ``Trainer(deterministic=True)``: ``torch.use_deterministic_algorithms(True)`` (every op runs a
  deterministic kernel or raises a ``RuntimeError`` naming itself), cuDNN's deterministic convolutions and no cuDNN
  benchmarking; it also sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when the Trainer is built;
- :func:`configure` here, called by ``suite/train.py`` before the Trainer is built: ``CUBLAS_WORKSPACE_CONFIG``
  (cuBLAS reads it when its first handle is made: with several cuBLAS workspaces its reductions are not
  repeatable) set already then, when the user has not set it, and a warning when CUDA was used before, so that the
  setting may come too late for this process;
- the two ops of the training paths with no deterministic CUDA kernel (cross-entropy over (B, K, ...) logits and
  bilinear upsampling's backward) are computed another way in deterministic mode: ``tasks/deterministic.py``,
  which lists the accumulating ops that torch makes deterministic itself. Flash and memory-efficient attention
  (``F.scaled_dot_product_attention``) run their deterministic backward in this mode.

``trainer.deterministic=warn`` (Lightning's ``warn_only``) runs a nondeterministic kernel with a warning instead of
raising: a run that completes, with no promise of repeatability. What deterministic mode costs in throughput on a
GPU: docs/scale.md.

These switches are the process's, and Lightning sets them only for ``true``, ``false`` and ``warn``: a
``trainer.deterministic=null`` job after a ``true`` one in a local multirun (one process) trained in deterministic
mode. Each run puts them back as it ends (:func:`state` and :func:`restore`, ``suite.train.run``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)
CUBLAS_WORKSPACE = ":4096:8"  # one of the two settings NVIDIA documents for reproducible cuBLAS results


Switches = tuple[bool, bool, bool, str | None]


def state() -> Switches:
    """(deterministic algorithms, their warn-only mode, cuDNN benchmarking, ``CUBLAS_WORKSPACE_CONFIG``) as the
    process has them now."""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            bool(torch.backends.cudnn.benchmark), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def restore(before: Switches) -> None:
    """The switches as :func:`state` returned them (the environment variable unset if it was)."""
    enabled, warn_only, benchmark, workspace = before
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def configure(trainer: Mapping) -> None:
    """What ``trainer.deterministic`` (``trainer``: the trainer config as Lightning will get it) needs before the
    Trainer and CUDA start: ``CUBLAS_WORKSPACE_CONFIG``, unless the user set it."""
    if not trainer.get("deterministic"):
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") is not None:
        return  # the user's own, set before python started (what the warning below asks for): cuBLAS read it
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("trainer.deterministic=true: CUDA was initialised before the run set CUBLAS_WORKSPACE_CONFIG=%s; "
                    "if cuBLAS was used already, its results may not repeat. Set it in the environment before "
                    "starting python.", os.environ["CUBLAS_WORKSPACE_CONFIG"])
