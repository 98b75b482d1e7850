"""The suite's training-throughput meter, a Lightning callback configured in ``configs/config.yaml``
(``callbacks.throughput``), and the batch-size rule it counts samples with.

One meter serves both readers of throughput: the logged history (``train/samples_per_sec``, a rate over the last
``window`` batches, every ``trainer.log_every_n_steps``) and ``metrics.json``'s ``train_samples_per_sec`` (the
whole run's rate, ``suite/run_record.py``). Written here rather than taken from Lightning's ``ThroughputMonitor``:
that one times from the epoch's start, so a batch during which ``torch.compile`` compiled (``trainer.compile``: the
first call, a new batch size) counts as training, and its whole-run rate is not kept.
"""

from __future__ import annotations

import collections
import sys
import time

import lightning as L
import torch

from suite.resume import FitState

HISTORY_KEY = "train/samples_per_sec"


def batch_size(batch) -> int:
    """Samples in a dict batch (the leading size of its first tensor)."""
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def compile_clock() -> float:
    """Seconds torch.compile has spent compiling in this process (``suite.compile.compile_seconds``); 0 while dynamo
    was never imported, so that an uncompiled run does not import it."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    from suite.compile import compile_seconds

    return compile_seconds()


class TrainThroughput(FitState):
    """Training samples per second of this process: the time from each training batch's start to the next one's
    (data loading included); validation, each epoch's first batch, the batch after each validation (which waited
    for the checkpoints) and batches during which ``torch.compile`` compiled are left out.

    ``window`` > 0: ``train/samples_per_sec`` goes to the loggers every ``log_every_n_steps`` as the rate over the
    last ``window`` counted batches; 0: nothing is logged, the whole-run :meth:`rate` is still kept.
    """

    def __init__(self, window: int = 10):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.window = window
        self.samples, self.seconds = 0, 0.0
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=max(window, 1))
        self._start, self._first, self._loading, self._compiled, self._pending = None, True, 0.0, 0.0, 0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start, self._first = None, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        self._pending = batch_size(batch)
        self._loading = now - self._start if self._start is not None and not self._first else 0.0
        self._compiled = compile_clock()
        self._start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # warm-up (allocations, lazy initialisation), or a compilation: not the steady state
        if not self._first and compile_clock() == self._compiled:
            seconds = self._loading + time.perf_counter() - self._start
            self.samples += self._pending
            self.seconds += seconds
            self._recent.append((self._pending, seconds))
            if self.window and trainer._logger_connector.should_update_logs:
                samples, spent = map(sum, zip(*self._recent))
                if spent > 0:  # to the loggers only, as Lightning's ThroughputMonitor logs: a measurement of this
                    # run, not a result, so not among the metrics that metrics.json and checkpoints compare
                    trainer._logger_connector.log_metrics({HISTORY_KEY: samples / spent})
        self._first = False
        self._start = time.perf_counter()

    def on_validation_start(self, trainer, pl_module):
        self._start = None  # validation inside an epoch does not count

    def on_validation_end(self, trainer, pl_module):
        # The batch after a validation is left out as an epoch's first is: the checkpoints written after this hook
        # (Lightning runs ModelCheckpoint last) were counted as its data loading, 0.4 s a batch in a segmentation
        # run validating every 4 steps against 0.002 s of real loading.
        self._start, self._first = None, True

    def state_dict(self):  # in checkpoints: a resumed run's whole-run rate counts its earlier parts' batches too
        return {"samples": self.samples, "seconds": self.seconds}

    def load_fit_state(self, state_dict):  # not when a checkpoint is tested (FitState)
        self.samples, self.seconds = int(state_dict["samples"]), float(state_dict["seconds"])

    def rate(self) -> float | None:
        """The whole run's samples per second, or None before any batch was counted."""
        return self.samples / self.seconds if self.samples and self.seconds > 0 else None


class ValidateAtEnd(L.pytorch.callbacks.Callback):
    """A validation after the run's last training batch when the last one came earlier, whichever limit ends the run:
    ``trainer.max_steps`` (the GAN's steps are its generator updates, ``trainer.global_step`` there) or
    ``trainer.max_epochs`` (its last epoch's last batch, as ``trainer.limit_train_batches`` counts them).

    Lightning validates every ``val_check_interval`` batches of every ``check_val_every_n_epoch``-th epoch only: with
    ``trainer.max_steps=5`` and ``eval.every_n_steps=2`` the validations were at steps 2 and 4, with
    ``trainer.max_epochs=5`` and ``check_val_every_n_epoch=2`` after epochs 2 and 4, and the best checkpoint, the
    run's validation metrics and the test never saw the final weights (which, under a poly or cosine schedule
    decaying to 0, are the ones the recipe trains for). mmengine's ``IterBasedTrainLoop`` validates at ``max_iters``
    too. Asking the trainer to stop after the last batch makes Lightning's own check validate then (``should_stop``:
    "validation when asked to stop", as for early stopping), so the checkpoint callbacks see that validation as any
    other; when the batch is a validation batch anyway it is validated once. That check is skipped in an epoch
    ``check_val_every_n_epoch`` leaves out, so for the last epoch the trainer's ``check_val_every_n_epoch`` is
    None (every epoch) until that validation ends. Nothing is kept in checkpoints: a run resumed at its end takes
    no batch, so it is not validated again; one resumed before it validates at its end as a fresh one; one
    stopped inside that validation validates again, once (:meth:`on_train_start`)."""

    def __init__(self):
        self._held: dict[str, object] = {}  # the trainer's settings while they are lifted, by name

    def on_train_start(self, trainer, pl_module):
        # Resumed inside the validation of the last batch (a SIGTERM during it; suite.checkpoints'
        # validate_again_on_resume): Lightning runs it again when its check says so, which it does not where only
        # should_stop had made it validate (it took one more batch instead, past the run's length). Not
        # should_stop here: asked to stop before the loop has begun, Lightning ends it without that validation;
        # the batch check is lifted instead (a validation that had ended is not repeated: Lightning skips it).
        loop = trainer.fit_loop.epoch_loop
        if loop.restarting and last_batch(trainer, loop.batch_idx):
            self._open_last_epoch(trainer)
            if trainer.val_check_batch not in (None, float("inf")):
                self._lift(trainer, "val_check_batch", 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if last_batch(trainer, batch_idx):
            trainer.should_stop = True
            self._open_last_epoch(trainer)

    def _open_last_epoch(self, trainer):
        every = trainer.check_val_every_n_epoch
        if every is not None and (trainer.current_epoch + 1) % every:
            self._lift(trainer, "check_val_every_n_epoch", None)

    def _lift(self, trainer, name: str, value):
        self._held.setdefault(name, getattr(trainer, name))
        setattr(trainer, name, value)

    def on_validation_end(self, trainer, pl_module):
        self._restore(trainer)

    def on_train_end(self, trainer, pl_module):
        self._restore(trainer)  # validation off (limit_val_batches=0), or skipped on resume: none ended

    def _restore(self, trainer):
        for name, value in self._held.items():
            setattr(trainer, name, value)
        self._held.clear()


def last_batch(trainer, batch_idx: int) -> bool:
    """Whether the training batch ``batch_idx``, just taken, is the fit's last: its optimizer step is the
    ``trainer.max_steps``-th, or it ends the ``trainer.max_epochs``-th epoch (``num_training_batches`` counts
    ``limit_train_batches``; ``batch_idx`` goes on counting in an epoch resumed mid-way; a loader without a length
    says it is exhausted through ``is_last_batch``)."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    if epochs is None or epochs < 0 or trainer.current_epoch + 1 < epochs:
        return False
    return batch_idx + 1 >= trainer.num_training_batches or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
