"""A SIGTERM under DDP: every process stops at the same batch boundary (:class:`AgreedSigterm`), writes
``last.ckpt`` with the others and exits with code 143 (``suite/train.py``). Ctrl-C while training stops the
same way (exit code 130); a second Ctrl-C stops at once."""

from __future__ import annotations

import logging
import signal
import threading

import lightning as L
import torch

log = logging.getLogger(__name__)


class AgreedSigterm(L.pytorch.callbacks.Callback):
    """A SIGTERM under DDP (a scheduler's pre-emption, ``scancel``, a time limit) ends every process at the same
    batch boundary, so that all of them write ``last.ckpt`` together (``suite/checkpoints.py``) and exit with code
    143, whichever processes got the signal and however many times.

    Lightning's own SIGTERM handler (2.6) broadcasts from inside the signal handler, at whatever point each process
    was interrupted. A collective there pairs with whatever collective the other processes are in: a scheduler
    signals every process, Lightning's first process forwards the signal to the processes it started, so those run
    the handler twice, and the run hung in mismatched collectives, found with ``timeout 300 python run.py
    trainer.devices=4 ...`` on CPU: killed after 20 minutes with no exit. Here the handler only notes the signal,
    and the processes agree where all of them are in step: after every training batch and at the end of each
    validation and test loop, over a CPU process group (one 4-byte all-reduce, no wait for a GPU). Once one process
    had the signal, all of them set Lightning's ``received_sigterm`` at the same point, and Lightning stops them
    there together: at the end of that training batch, or at the end of the epoch or the next training batch after
    a validation. A test loop runs to its end.
    One process stops the same way; while it evaluates, at once (at the end of the evaluation batch, as Lightning's
    own handler has it).

    **Never inside an accumulation window** (``trainer.accumulate_grad_batches`` > 1): a checkpoint holds no
    gradients, so a run stopped after batch 2 of a window of 4 and resumed stepped with the last 2 batches' alone,
    and was not the run that never stopped (exit code 0 all the same). The stop waits for the window's last batch.

    **SLURM's time-limit warning** (``sbatch --signal=USR1@<seconds>``, auto-requeue on): Lightning's handler saved
    ``hpc_ckpt_<n>.ckpt`` from inside the signal handler, wherever the process was: between two parameters'
    updates of an optimizer step (a checkpoint holding half a step), inside a window, and under DDP with a
    collective (``save_checkpoint``'s barrier) that paired with whatever the other processes were in. Here the
    handler only notes it, and Lightning's own save and ``scontrol requeue`` run at the next point where every
    process agrees, as for SIGTERM: a training batch that ends a window, or the end of an evaluation loop.

    **Ctrl-C** (SIGINT) while training stops at the end of the batch too, with ``last.ckpt`` and a line saying how
    to resume (exit code 130), on one process or many (a terminal's Ctrl-C reaches every process of the run).
    Python's default raised KeyboardInterrupt wherever the process was, and the ``last.ckpt`` then written could
    hold half a step: parameters updated up to the one the interrupt came between, the step not counted. A second
    Ctrl-C stops at once (Lightning's KeyboardInterrupt shutdown, exit code 1). Only while fitting, and only where
    SIGINT still has Python's default handler (not under a debugger's or a launcher's own): from the first training
    batch (a Ctrl-C during the sanity check stops at once)."""

    def __init__(self):
        self.pending = False  # this process got SIGTERM (or Ctrl-C)
        self.ctrl_c = False  # this process got Ctrl-C while fitting
        self.requeue = None  # the SLURM requeue signal this process got, not yet acted on
        self._first = threading.Lock()  # taken by the first SIGTERM: its handler alone logs
        self._group = None  # the CPU (gloo) group the processes agree over; None: one process
        self._trainer = None
        self._sigint_before = None  # SIGINT's handler before fit, while this one is installed

    def setup(self, trainer, pl_module, stage: str) -> None:
        import torch.distributed as dist

        self._trainer = trainer
        # Lightning registers its handlers after the setup hooks (Trainer._run), from these attributes: SIGTERM's
        # and SLURM's requeue signal's then only take note.
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = self._note
        connector._slurm_sigusr_handler_fn = self._note_requeue
        if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return
        if self._group is None:  # every process calls setup in the same order: new_group is a collective
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def on_train_start(self, trainer, pl_module) -> None:
        # Here, not in on_fit_start: Lightning takes note of every signal's handler after that hook, and puts those
        # back when the trainer is done; this one then stayed installed for the test and after.
        self._trainer = trainer
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._sigint_before = signal.signal(signal.SIGINT, self._ctrl_c)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore_sigint()  # testing after the fit: Ctrl-C is Python's again

    def on_exception(self, trainer, pl_module, exception) -> None:
        from suite.errors import chain, worker_error

        self._restore_sigint()  # Lightning skips the teardown hooks then (a SIGTERM's stop, a failure)
        if any(worker_error(cause) for cause in chain(exception)):
            # A loader worker was killed (suite.errors.worker_error): torch's SIGCHLD handler raises again at each
            # other worker's end, inside the loaders' __del__ as Lightning tears them down next, which printed a
            # traceback ("Exception ignored in ...") beside the run's message. The run is ending on it.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def _restore_sigint(self) -> None:
        if self._sigint_before is not None:
            signal.signal(signal.SIGINT, self._sigint_before)
            self._sigint_before = None

    def _ctrl_c(self, signum, frame) -> None:
        """The SIGINT handler while fitting: the first notes it as a SIGTERM is noted; the second stops at once."""
        if self.ctrl_c:
            raise KeyboardInterrupt
        self.ctrl_c = self.pending = True
        log.warning("Ctrl-C: stopping at the end of this batch, with a checkpoint to resume from (Ctrl-C again to "
                    "stop at once)")
        self._one_process_stops_now()

    def _note(self, signum, frame) -> None:
        """The SIGTERM handler: only notes the signal (no collective, no I/O but a log line; safe to run twice).

        A second SIGTERM can interrupt the first one's handler between any two bytecodes (Python runs handlers
        there, inside a handler too): a test of ``pending`` followed by the log line logged twice. A lock's
        non-blocking acquire is one atomic step."""
        self.pending = True
        if self._first.acquire(blocking=False):
            log.info("received SIGTERM: stopping %s", "at the next batch" if self._group is None else
                     "with the other processes at the next batch")
        self._one_process_stops_now()

    def _note_requeue(self, signum, frame) -> None:
        """The handler of SLURM's requeue signal, in place of Lightning's (which saves and requeues): only notes it."""
        if self.requeue is None:
            log.info("received the SLURM requeue signal (%s): saving a checkpoint and requeueing at the next batch",
                     signal.Signals(signum).name)
        self.requeue = signum

    def _one_process_stops_now(self) -> None:
        """One process, not training (evaluating): Lightning stops at the end of the batch, as its own handler has
        it. Training, the stop waits for the end of the batch that ends an accumulation window
        (:meth:`on_train_batch_end`); several processes, for their agreement."""
        trainer = self._trainer
        if self._group is None and trainer is not None and not trainer.training:
            trainer._signal_connector.received_sigterm = True

    def _agree(self, trainer) -> None:
        """Where every process is in step: a SIGTERM (Ctrl-C) any of them got stops all of them here, and a requeue
        signal any of them got has all of them save Lightning's hpc checkpoint, then rank zero requeue the job."""
        stop, requeue = self.pending or trainer.received_sigterm, self.requeue
        if self._group is not None:
            import torch.distributed as dist

            flags = torch.tensor([int(stop), requeue or 0], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            stop, requeue = bool(flags[0].item()), int(flags[1].item()) or None
        if requeue is not None:
            self.requeue = None
            connector = trainer._signal_connector
            type(connector)._slurm_sigusr_handler_fn(connector, requeue, None)  # Lightning's: save, then requeue
        if stop:
            trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop._should_accumulate():  # inside an accumulation window (the same on every process)
            return
        self._agree(trainer)

    # Not at every evaluation batch: the processes may see different numbers of them (each sample scored once,
    # no padding: datamodules/loaders.py), so they agree once an evaluation loop has ended.
    def on_validation_end(self, trainer, pl_module) -> None:
        self._agree(trainer)

    def on_test_end(self, trainer, pl_module) -> None:
        self._agree(trainer)
