"""Small helpers for Lightning callbacks configured in ``configs/config.yaml``."""

from __future__ import annotations

import torch


def batch_size(batch) -> int:
    """Samples in a dict batch (the leading size of its first tensor), for ThroughputMonitor."""
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
