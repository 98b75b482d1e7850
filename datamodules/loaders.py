"""Sampling and worker processes that survive DDP, resumption and a scheduler's SIGTERM.

Training: the shuffle of epoch ``e`` is a function of (seed, e), as
``DistributedSampler``'s is, and no loader draws from the global torch
generator. A run resumed from an end-of-epoch checkpoint therefore gets the
same order as one that never stopped (the global generators, which draw the
augmentations and dropout masks, are restored by ``suite.resume``), and under
DDP Lightning swaps in its ``DistributedSampler`` with the same rule.

Evaluation: every sample scored exactly once.

Lightning gives evaluation loaders a ``DistributedSampler`` when it runs on
several processes, and that sampler pads the last round by repeating samples
so every rank gets as many; a metric summed over ranks then counts those
samples twice. Our evaluation loaders use Lightning's own
``UnrepeatedDistributedSampler`` instead (ranks may differ by one sample;
safe because evaluation does no per-batch collective), and metrics are
torchmetrics states summed across ranks.

Workers: every loader's worker processes start with :class:`WorkerInit`, which leaves a scheduler's signals to
the main process, and start with those signals blocked until it has run (:class:`Loader`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from attention.errors import UserError

log = logging.getLogger(__name__)


class WorkerInit:
    """Every DataLoader worker's start (its ``worker_init_fn``): a scheduler's signals left to the run's main
    process, then Lightning's seeding.

    A scheduler signals every process of the job, the loaders' workers too: SIGTERM (a time limit, pre-emption,
    ``scancel``), SIGUSR1 (``sbatch --signal=USR1@<s>``: Lightning's requeue, configs/hydra/launcher/slurm.yaml) and
    SIGUSR2 (submitit's time-out warning). PyTorch's workers die of a SIGTERM that their main process did not send
    (and of SIGUSR1 and SIGUSR2, whose default is to end the process), and the main process then raised
    "DataLoader worker (pid ...) is killed by signal" wherever it was: a traceback and exit code 1, with no
    checkpoint of the interrupted step, where a run stops at the end of the batch, saves and exits 143
    (``suite/sigterm.py``), or saves and requeues itself on SIGUSR1 under SLURM. The workers now ignore SIGUSR1 and
    SIGUSR2 and take SIGTERM from their own main process only (:func:`_sigterm_from_the_run_only`), which ends
    them when it stops (a worker also exits by itself once its main process is gone). Ctrl-C in a terminal
    reaches the workers too (SIGINT, to its foreground group), which ran the main process's Ctrl-C handler that
    they had inherited (suite.sigterm: one "stopping" line per worker), or died of KeyboardInterrupt; they ignore
    it too.

    A worker runs PyTorch's own signal handlers, and the main process's Python ones, until this function runs: a
    signal in between killed it all the same, and a run with short epochs (training workers start each epoch) was
    often there. :class:`Loader` therefore starts its workers with these signals blocked, and they are let through
    here, once they are handled.

    Lightning adds its own ``worker_init_fn`` (``seed_everything(workers=True)``: each worker's generators seeded
    from the loader's base seed, the worker and the process's rank) only to loaders without one, so it is called
    here as Lightning would call it."""

    def __init__(self, rank: int | None = None):
        self.rank = rank  # the process's global rank; None: Lightning's rank_zero_only.rank in the worker

    def __call__(self, worker_id: int) -> None:
        for ignored in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):  # also drops one that came before (blocked:
            signal.signal(ignored, signal.SIG_IGN)  # see Loader)
        if hasattr(signal, "sigwaitinfo"):  # Linux: SIGTERM waited for by a thread that knows who sent it
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            threading.Thread(target=_sigterm_from_the_run_only, name="sigterm", daemon=True).start()
        if hasattr(signal, "pthread_sigmask"):  # the worker started with them blocked (Loader); SIGTERM stays so
            keep_blocked = {signal.SIGTERM} if hasattr(signal, "sigwaitinfo") else set()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(JOB_SIGNALS) - keep_blocked)
        if int(os.environ.get("PL_SEED_WORKERS", 0)):
            from lightning.fabric.utilities.seed import pl_worker_init_function

            pl_worker_init_function(worker_id, rank=self.rank)


# Signals sent to every process of a job (a scheduler), or of a terminal's foreground group (Ctrl-C: SIGINT).
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2) if hasattr(signal, "SIGUSR1") else ()


class Loader(DataLoader):
    """A ``DataLoader`` whose worker processes start with the job's signals blocked (:data:`JOB_SIGNALS`), until their
    :class:`WorkerInit` has set up how they take them (it unblocks them).

    A forked worker inherits the starting thread's signal mask, and a blocked signal waits: SIGTERM for the thread
    that checks who sent it, SIGINT, SIGUSR1 and SIGUSR2 to be dropped once ignored. Without this, a signal to the
    job in the first milliseconds of a worker (at every epoch's start for training workers) ended it, with PyTorch's
    handler or the inherited one: "DataLoader worker ... is killed by signal", exit 1. The main process gets its
    own signals once its workers are started (they wait meanwhile). Only with :class:`WorkerInit`, which unblocks
    them: a worker that never did would outlive its loader's ``terminate()``."""

    def _get_iterator(self):  # starts the worker processes (persistent ones once)
        if not (self.num_workers > 0 and isinstance(self.worker_init_fn, WorkerInit) and JOB_SIGNALS
                and hasattr(signal, "pthread_sigmask")):
            return super()._get_iterator()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def processes() -> int:
    """The number of processes training together (DDP's world size; 1 without it)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sigterm_from_the_run_only() -> None:
    """A worker's SIGTERM, taken by this thread (every thread blocks it): sent by the worker's own main process (its
    ``terminate()`` when the loader shuts down, and at exit), the worker ends at once, as PyTorch's own handler does;
    sent by anyone else (a scheduler signalling the whole job), it is left to the main process. Ignoring it outright
    left a worker that the main process never shut down (an evaluation loader's persistent workers at interpreter
    exit) waiting for ever, and the run with it."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == os.getppid():
            os._exit(0)


def eval_loading(dataset: Dataset, what: str) -> dict:
    """Keyword arguments of an evaluation ``DataLoader``: :func:`eval_sampler` and a generator of its own.

    A loader without one draws its worker seed from the global torch generator each time it is iterated, so
    how often (and, after a resume, whether) validation ran would shift the random numbers of training.
    """
    return {"sampler": eval_sampler(dataset, what), "generator": torch.Generator().manual_seed(0)}


def eval_sampler(dataset: Dataset, what: str) -> Sampler | None:
    """An unpadded rank slice of ``dataset`` in order under DDP; ``None`` (the default sequential one) otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    world = dist.get_world_size()
    if len(dataset) < world:
        raise UserError(f"The {what} has {len(dataset)} samples, fewer than the {world} processes evaluating it: "
                        "every process needs at least one. Use fewer devices (trainer.devices) or more samples.")
    return UnrepeatedDistributedSampler(dataset, shuffle=False)


class EpochRandomSampler(RandomSampler):
    """A random permutation seeded by ``seed + epoch`` (Lightning calls ``set_epoch`` before every epoch).

    ``worker_generator``, the loader's own generator, is re-seeded with the epoch too: the worker processes
    of an epoch get seeds that depend on (seed, epoch) alone.
    """

    def __init__(self, data_source: Dataset, seed: int, worker_generator: torch.Generator | None = None):
        super().__init__(data_source, generator=torch.Generator())
        self.seed = seed
        self.worker_generator = worker_generator
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.generator.manual_seed(self.seed + epoch)
        seed_workers(self.worker_generator, self.seed, epoch)


def seed_workers(generator: torch.Generator | None, seed: int, epoch: int) -> None:
    """The loader's worker-seed generator for epoch ``epoch``: its workers' seeds a function of (seed, epoch)."""
    if generator is not None:
        generator.manual_seed((seed + epoch) * 1_000_003 % 2**63)


class _SkipFirst:
    """The batches of ``batches`` (a ``BatchSampler``) made of its sampler's indices after the first ``skip``, whose
    samples are never loaded; full length.

    Skipped by samples, not batches, so that a run resumed with another batch size (a smaller one, after running out
    of memory) goes on with exactly the samples the epoch had not served, in their order: skipping as many batches
    of the new size as were served of the old one served samples twice (a smaller batch) or never (a larger one)."""

    def __init__(self, batches: Iterable, skip: int):
        self.batches, self.skip = batches, skip

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator:
        skip, self.skip = self.skip, 0  # once: a persistent-worker iterator re-iterates this object every epoch
        if not isinstance(self.batches, BatchSampler):  # one sample per "batch" (batch_size=None)
            yield from itertools.islice(self.batches, skip, None)
            return
        indices = itertools.islice(iter(self.batches.sampler), skip, None)
        size, drop_last = self.batches.batch_size, self.batches.drop_last
        while batch := list(itertools.islice(indices, size)):
            if len(batch) < size and drop_last:
                return
            yield batch


class ResumableLoader(Loader):
    """A training ``DataLoader`` whose position is saved in checkpoints.

    Lightning stores ``state_dict()`` of every training loader that has one and hands it back on resume:
    here the epoch and the samples already served (of this process's share), so a run resumed from a mid-epoch
    checkpoint (the GAN and segmentation validate every N steps) continues with the next sample of the same
    permutation instead of starting the epoch over, as a plain loader would, in batches of its own size. Works
    with the sampler Lightning puts in under DDP.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._served = 0  # samples of this epoch served (or skipped on resume)
        self._skip = 0
        self._skip_epoch = None  # the epoch the saved position is in: a later epoch starts at its beginning
        self._resumed_from = None  # (samples, batch size) of a mid-epoch position saved with another batch size

    def _epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def _epoch_done(self) -> bool:
        """Whether this epoch has no batch left to serve (a dropped last partial batch is none)."""
        left = len(self.sampler) - self._served
        return left <= 0 or (self.drop_last and left < (self.batch_size or 1))

    def state_dict(self) -> dict:
        if self._epoch_done():  # the epoch is complete: the next one starts at its beginning
            return {"epoch": self._epoch() + 1, "samples": 0, "batch_size": self.batch_size,
                    "processes": processes()}
        return {"epoch": self._epoch(), "samples": self._served, "batch_size": self.batch_size,
                "processes": processes()}

    def load_state_dict(self, state: dict) -> None:
        epoch = int(state["epoch"])
        if hasattr(self.sampler, "set_epoch"):  # worker processes draw indices as soon as they start
            self.sampler.set_epoch(epoch)
        self._skip_epoch = epoch
        if "samples" in state:
            self._skip = int(state["samples"])
            saved_size = state.get("batch_size")
            if self._skip and saved_size and saved_size != self.batch_size:
                self._resumed_from = (self._skip, int(saved_size))
        else:  # written before the position was kept in samples: batches, of a size it did not record
            self._skip = int(state["batches"]) * (self.batch_size or 1)
            if self._skip and (processes() == 1 or dist.get_rank() == 0):
                log.warning(
                    "Resumed in the middle of epoch %d from a checkpoint that records the %d batches served in it, "
                    "not their size: the rest of the epoch skips %d batches of data.batch_size=%s. If the run was "
                    "stopped with another data.batch_size, the rest of this epoch sees some samples twice or misses "
                    "some; resuming with the data.batch_size it was stopped with continues it exactly.",
                    epoch, int(state["batches"]), int(state["batches"]), self.batch_size)
        saved, now = state.get("processes"), processes()
        if self._skip and saved is not None and int(saved) != now and (now == 1 or dist.get_rank() == 0):
            log.warning(
                "Resumed in the middle of epoch %d on %d process(es), from a checkpoint written on %d: each process "
                "skips the %d samples it served before, but of another split of the samples among the processes, "
                "so the rest of this epoch may see some samples twice and miss others, and the run is not the one "
                "that never stopped. Resuming on %d process(es) (trainer.devices, trainer.num_nodes) continues it "
                "exactly.", epoch, now, int(saved), self._skip, int(saved))
        elif self._skip and state.get("batch_size") not in (None, self.batch_size):
            log.info("Resumed in the middle of epoch %d after %d samples served in batches of %s: the rest of the "
                     "epoch comes in batches of data.batch_size=%s.", epoch, self._skip, state["batch_size"],
                     self.batch_size)

    def batches_before(self, epoch_batches: int) -> int | None:
        """Where a mid-epoch position saved with another batch size puts this epoch's batch count: the batches of
        this size the epoch of ``epoch_batches`` (Lightning's, ``trainer.limit_train_batches`` applied) counts
        before the rest it will serve; None where Lightning's own count, batches of the saved size, is right.

        Lightning restores how many batches of the epoch were served and ends the epoch (validates, steps the
        schedule) when its count reaches the epoch's number of batches, now of another size: 5 batches of 8 served,
        then 6 of 4 to serve in an epoch of 16, it ended at batch 11, never validated. :class:`LoaderPosition`
        moves its count here."""
        if self._resumed_from is None or self._epoch() != self._skip_epoch:
            return None
        size, left = self.batch_size or 1, max(0, len(self.sampler) - self._resumed_from[0])
        rest = left // size if self.drop_last else -(-left // size)
        return max(0, epoch_batches - rest)

    def served_before(self) -> int | None:
        """The batches of the saved size served before a position :meth:`batches_before` moves."""
        return None if self._resumed_from is None else self._resumed_from[0] // self._resumed_from[1]

    @property
    def _index_sampler(self):
        base = super()._index_sampler
        if self._skip and self._skip_epoch is not None and self._epoch() != self._skip_epoch:
            self._skip = 0  # the saved epoch ended before this loader was iterated again (trainer.limit_train_batches)
        return _SkipFirst(base, self._skip) if self._skip else base

    def __iter__(self) -> Iterator:
        iterator = super().__iter__()  # builds its index iterator from _index_sampler, skipping what was served
        self._served, self._skip, self._resumed_from = self._skip, 0, None
        total, size = len(self.sampler), self.batch_size or 1
        for batch in iterator:
            self._served = min(self._served + size, total)  # every batch full but an undropped last one
            yield batch


class LoaderPosition(Callback):
    """Moves Lightning's count of the batches an epoch has served to where a training loader resumed with another
    ``data.batch_size`` (:meth:`ResumableLoader.batches_before`): the resumed epoch then ends, validates and steps
    its schedule after its last sample, as an epoch of the new size does. The count is moved as a whole (each stage
    of Lightning's progress by as many), before the epoch loop reads it."""

    def on_train_start(self, trainer, pl_module) -> None:
        loader = trainer.train_dataloader
        if not isinstance(loader, ResumableLoader) or math.isinf(trainer.num_training_batches):
            return
        now = loader.batches_before(int(trainer.num_training_batches))
        if now is None:
            return
        shift = now - loader.served_before()
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        for stage in ("ready", "started", "processed", "completed"):
            setattr(progress, stage, getattr(progress, stage) + shift)


def train_sampling(dataset: Dataset, sampler: type = EpochRandomSampler, **options) -> dict:
    """Keyword arguments of a shuffled training split's :class:`ResumableLoader`: ``sampler`` (its arguments:
    the dataset, the seed, ``options``, the worker generator; :class:`EpochRandomSampler`'s by default) and a
    generator of its own for the loader's worker seeds, both seeded from the run's seed (``seed_everything``,
    read when the loader is made) and the epoch."""
    seed = torch.initial_seed()
    workers = torch.Generator()
    return {"sampler": sampler(dataset, seed, worker_generator=workers, **options), "generator": workers}
