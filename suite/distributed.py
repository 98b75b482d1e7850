"""Multi-device settings applied by the runtime (``suite/train.py``) around Lightning's Trainer (``trainer=ddp``).

Batch size semantics: ``data.batch_size`` is per process, as in Lightning;
the global batch is ``data.batch_size x devices x num_nodes x
accumulate_grad_batches``. ``optim.scale_lr`` (``null`` | ``linear`` |
``sqrt``) multiplies every learning rate in ``optim`` by (global batch /
``optim.base_batch_size``) or its square root, the batch the rates were
tuned for (by default one process's ``data.batch_size``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import MutableMapping

import torch

from attention.errors import UserError

log = logging.getLogger(__name__)
SCALE_RULES = (None, "linear", "sqrt")


def adjust_trainer_kwargs(trainer: MutableMapping, module) -> None:
    """In place: DDP finds unused parameters for modules that ask for it; no sync BN where torch has none."""
    if trainer.get("strategy") == "ddp" and module.ddp_find_unused_parameters:
        # Parameters without a gradient in some backward pass (a GAN's D update leaves G out): DDP must be told.
        trainer["strategy"] = "ddp_find_unused_parameters_true"
    on_cpu = trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()
    if trainer.get("sync_batchnorm") and on_cpu:
        log.warning("trainer.sync_batchnorm=true needs GPUs (torch's SyncBatchNorm has no CPU kernel): BatchNorm "
                    "statistics stay per process on CPU.")
        trainer["sync_batchnorm"] = False


def check_launch(trainer, strategy: str | None = None) -> None:
    """Refuse a local multirun that would start DDP processes itself: Lightning re-runs the command line per
    process, which inside ``-m`` would start the whole sweep again. Refuse a strategy that spawns or forks its
    processes (``strategy``: the ``trainer.strategy`` given, for the message)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, _MultiProcessingLauncher):
        # The run (its checks, callbacks, record) lives in this process; spawned or forked processes train apart
        raise UserError(
            f"trainer.strategy={strategy or type(trainer.strategy).__name__} starts its processes from this one "
            f"(start method '{launcher._start_method}', as ddp_spawn, ddp_fork and ddp_notebook do), and a run of "
            "the suite is not built for that: ddp_spawn cannot start (this run's state cannot be pickled), and under "
            "ddp_fork the training happened in the forked processes while this one, which writes the run's record, "
            "saw none of it. Use trainer=ddp (Lightning's ddp strategy, which starts each process by running this "
            "command again; under SLURM or torchrun the processes are started for it), e.g. `python run.py "
            "trainer=ddp trainer.devices=2`.")
    starts_processes = (isinstance(launcher, _SubprocessScriptLauncher) and trainer.world_size > 1
                        and not trainer.strategy.cluster_environment.creates_processes_externally)
    if starts_processes and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise UserError("trainer=ddp with several devices cannot run inside a local multirun (-m): Lightning starts "
                        "the other processes by re-running the command, which would start the sweep again. Send "
                        "the sweep to SLURM with hydra/launcher=slurm, or run each configuration as its own command.")
    if starts_processes:
        watch_started_processes(launcher)


# The launcher of the processes this one starts (Lightning's, in the first process of a run it launches).
_LAUNCHER: list = []
ENDED_WELL = (0, 130, 143)  # success, and the agreed stops: suite.train's SIGINT_EXIT, SIGTERM_EXIT


def watch_started_processes(launcher) -> None:
    """The first process of a DDP run that Lightning launches (``trainer=ddp`` without SLURM or torchrun) keeps its
    launcher, for :func:`failed_process`, and watches the processes it starts with Lightning's observer changed
    in two ways (below)."""
    import lightning.fabric.strategies.launchers.subprocess_script as launching

    class ProcessObserver(launching._ChildProcessObserver):
        """Lightning's watch over the processes it started (the first process polls them every 5 s), with two
        changes. A process that ended with an agreed stop (SIGTERM: 143, Ctrl-C: 130; suite/sigterm.py) is not a
        failure: every process stops at the same batch, and the first one exits by itself. Lightning SIGKILLed it,
        and with it the lines and files it was still writing. Any other ending kills the others, as Lightning's
        does, and ends this process with that process's exit code and a line naming it (:func:`stop_with`), not
        with SIGKILL's 137: a user error seen by one process only ends the run with exit code 2."""

        def _run(self) -> bool:
            codes = [proc.poll() for proc in self._child_processes]
            if all(code in ENDED_WELL for code in codes):
                return True  # every started process is done: nothing left to watch
            failed = first_failure(codes)
            if failed is None:
                return False
            for proc in self._child_processes:
                if proc.poll() is None:
                    proc.send_signal(self._termination_signal)
            stop_with(*failed)
            return True

    _LAUNCHER[:] = [launcher]
    launching._ChildProcessObserver = ProcessObserver


def first_failure(codes: list) -> tuple[int, int] | None:
    """(rank, exit code) of the first started process (ranks from 1) that ended neither well nor by an agreed
    stop; None while none has."""
    return next(((rank, code) for rank, code in enumerate(codes, start=1)
                 if code is not None and code not in ENDED_WELL), None)


def failed_process(wait_s: float = 10.0) -> tuple[int, int] | None:
    """In the first process of a run Lightning launched: (rank, exit code) of a started process that ended badly,
    waiting up to ``wait_s`` for one to end; None when they all run on or ended well. A collective that fails in
    this process ("Connection closed by peer") is most often another process's failure, whose message is its own."""
    import time

    if not _LAUNCHER:
        return None
    procs = list(getattr(_LAUNCHER[0], "procs", []))
    deadline = time.monotonic() + wait_s
    while procs:
        codes = [proc.poll() for proc in procs]
        failed = first_failure(codes)
        if failed is not None or all(code is not None for code in codes) or time.monotonic() > deadline:
            return failed
        time.sleep(0.1)
    return None


def stop_with(rank: int, code: int, at_once: bool = True) -> None:
    """End this process (the first of the run) because process ``rank`` ended with ``code``: one line, its code.
    ``at_once`` (from the observer's thread): ``os._exit``, as Lightning's SIGKILL ended it; else ``SystemExit``
    once the started processes still running are killed."""
    import signal
    import sys

    code = 128 - code if code < 0 else code  # killed by signal n: as a shell reports it
    print(f"error: process {rank} of the run (rank {rank}) ended with exit code {code}: its message is above. The "
          f"other processes were stopped with it. Exit code {code}.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if at_once:
        os._exit(code)
    for proc in getattr(_LAUNCHER[0], "procs", []) if _LAUNCHER else []:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    raise SystemExit(code)


def check_scale_rule(rule) -> None:
    if rule not in SCALE_RULES:
        raise UserError(f"optim.scale_lr={rule!r} is not known: use null (off), linear or sqrt.")


def lr_scale(rule: str | None, global_batch: int, base_batch: int) -> float:
    check_scale_rule(rule)
    if rule is None:
        return 1.0
    if base_batch <= 0:
        raise UserError(f"optim.base_batch_size={base_batch} must be a positive batch size.")
    ratio = global_batch / base_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def scale_learning_rates(optim: MutableMapping, factor: float) -> list[str]:
    """Multiply every ``lr`` of the optimiser factories in ``optim`` by ``factor``; returns the keys changed."""
    changed = []
    for name, value in optim.items():
        if isinstance(value, MutableMapping) and "lr" in value and "_target_" in value:
            value["lr"] = float(value["lr"]) * factor
            changed.append(f"optim.{name}.lr")
    return changed


def apply_lr_scaling(optim: MutableMapping, trainer, batch_size: int) -> None:
    """``optim.scale_lr`` applied to ``optim`` (the module's hyper-parameters) for the trainer's world size."""
    rule = optim.get("scale_lr")
    global_batch = batch_size * trainer.world_size * int(trainer.accumulate_grad_batches)
    factor = lr_scale(rule, global_batch, int(optim.get("base_batch_size") or batch_size))
    if factor != 1.0:
        changed = scale_learning_rates(optim, factor)
        log.info("optim.scale_lr=%s: global batch %d, learning rates x %.4g (%s)", rule, global_batch, factor,
                 ", ".join(changed))


def is_rank_zero() -> bool:
    """Before the Trainer exists: the first process of the first node (Lightning's and SLURM's variables)."""
    return all(int(os.environ.get(v, 0)) == 0 for v in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))
