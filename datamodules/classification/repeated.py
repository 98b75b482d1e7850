"""DeiT's repeated augmentation for ``task=classification`` (``data.repeated_aug``), around timm's sampler."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import Dataset, DistributedSampler

from datamodules.loaders import seed_workers


class RepeatedAugmentation(RepeatAugSampler, DistributedSampler):
    """DeiT's repeated augmentation (``data.repeated_aug=3``): every image ``repeats`` times an epoch, the copies
    given to consecutive processes (so to different ones with at least ``repeats`` processes), each augmented on
    its own; an epoch serves each process len(dataset) / processes images (rounded down to a multiple of 256
    first). These are the indices of timm's ``RepeatAugSampler`` (DeiT's ``RASampler``) with its generator seeded
    by (seed, epoch): timm seeds it with the epoch alone, the same order for every ``seed``. Written around timm's
    for that and to be a ``DistributedSampler``: Lightning leaves those alone under DDP, and would split another
    sampler among the processes once more. ``processes``/``rank`` default to the DDP world's (1 and 0 without)."""

    def __init__(self, dataset: Dataset, seed: int, repeats: int, worker_generator: torch.Generator | None = None,
                 processes: int | None = None, rank: int | None = None):
        ddp = dist.is_available() and dist.is_initialized()
        RepeatAugSampler.__init__(self, dataset, shuffle=True, num_repeats=repeats,
                                  num_replicas=processes or (dist.get_world_size() if ddp else 1),
                                  rank=rank if rank is not None else (dist.get_rank() if ddp else 0))
        self.seed, self.worker_generator = seed, worker_generator
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        seed_workers(self.worker_generator, self.seed, epoch)

    def __iter__(self) -> Iterator[int]:
        epoch, self.epoch = self.epoch, self.seed + self.epoch  # timm's __iter__ seeds its shuffle with self.epoch
        try:
            return RepeatAugSampler.__iter__(self)  # a list's iterator, made here
        finally:
            self.epoch = epoch
