"""Which exceptions reach the user as one message and exit code 2.

``run.py`` calls :func:`as_user_error` on whatever a run raised. A user error is

- a :class:`UserError` anywhere in the chain (Hydra's ``instantiate`` wraps what constructors raise): the suite's
  own message;
- a full disk or quota, or a read-only file system, met while writing a file (:func:`disk_error`);
- memory run out, a GPU's or the machine's (:func:`memory_error`): a run too large for the machine as configured;
  also a data-loading worker killed for it, by SIGKILL (the kernel's out-of-memory killer, a job's memory limit)
  or SIGBUS (shared memory full) (:func:`worker_error`);
- an option that Lightning or torch refused, told apart by where it was raised, not by its type alone (a
  ``ValueError`` elsewhere is a bug and keeps its traceback):
  - Lightning's ``MisconfigurationException`` raised while the ``Trainer`` is built, or anywhere when its message
    names a Trainer argument (``val_check_interval`` longer than the epoch, found at ``fit``);
  - a ``ValueError``/``TypeError`` raised by ``Trainer.__init__`` naming one of its arguments, or Python's
    "unexpected keyword argument" for a ``++trainer.<typo>``;
  - a ``ValueError``/``TypeError`` raised inside a ``torch.optim`` optimiser's constructor naming one of its
    arguments (torch's "Invalid learning rate: -1"), or an argument the optimiser does not take.

Each is turned into a UserError naming the config option (``trainer.<arg>``, ``optim.optimizer.<arg>``), the
value given, Lightning's or torch's own reason and an example fix. Most of these values are refused earlier, by the
schemas of ``suite.schema`` (``suite.validate``); this is the net for what those do not know.
"""

from __future__ import annotations

import errno
import inspect
import io
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from attention.errors import UserError

PROJECT = Path(__file__).resolve().parents[1]  # the checkout: frames of the suite's own code, for messages

UNEXPECTED = re.compile(r"^(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")
# Trainer arguments that run.py fills itself: never a config option, so never the one to blame.
NOT_OPTIONS = {"self", "logger", "callbacks", "plugins", "default_root_dir"}
# torch's wording for an optimiser argument, where it is not the argument's name.
TORCH_WORDS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "nesterov": "nesterov"}
# Lightning's wording for a Trainer argument, where it is not the argument's name.
LIGHTNING_WORDS = {"Timer(duration": "max_time", "gpu backend": "accelerator"}


def as_user_error(err: BaseException) -> UserError | None:
    """The user-facing error behind ``err``, or None when ``err`` is a bug (it keeps its traceback)."""
    for cause in chain(err):
        if (original := wrapped_user_error(cause)) is not None:
            return original
        if isinstance(cause, UserError):
            return cause
        mapped = trainer_option_error(cause) or optimizer_option_error(cause) or disk_error(cause) \
            or memory_error(cause) or worker_error(cause)
        if mapped is not None:
            return mapped
    return None


# torch's ExceptionWrapper (torch._utils), which carries an exception out of a DataLoader worker (or the pin-memory
# thread): it raises a new exception of the same type whose message is "Caught <type> <where>.\nOriginal " and the
# worker's whole traceback, or a RuntimeError with that message when the type takes other arguments (DataError).
WRAPPED = re.compile(r"\ACaught (\w+) (.+?)\.\nOriginal Traceback \(most recent call last\):\n")


def wrapped_user_error(err: BaseException) -> UserError | None:
    """The user error raised in a DataLoader worker, with its own message, when ``err`` is torch's re-raised copy
    of it: that copy's message is the worker's traceback followed by the message, some 20 lines where the user
    should read one paragraph. None for anything else, a bug in a worker included (its traceback is kept)."""
    text = str(err)
    match = WRAPPED.match(text)
    if match is None:
        return None
    # The traceback's last section is the raised exception's (what it was raised while handling comes first); its
    # frames are indented, the exception's "module.Type: message" starts its first unindented line.
    last = text[match.end():].rsplit("Traceback (most recent call last):\n", 1)[-1].splitlines()
    start = next((i for i, line in enumerate(last) if line and not line.startswith(" ")), None)
    if start is None:
        return None
    qualified, _, first = last[start].partition(": ")
    module, _, name = qualified.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None) if module else None
    if name != match.group(1) or not (isinstance(cls, type) and issubclass(cls, UserError)):
        return None
    message = "\n".join([first, *last[start + 1:]]).strip()
    return UserError(message) if message else None


def disk_error(err: BaseException) -> UserError | None:
    """A full disk or quota (``ENOSPC``, ``EDQUOT``) or a read-only file system (``EROFS``) while the run wrote a
    file: the machine's state, not a bug. The message names the file being written (the error's own, else the
    file object open in the innermost frame that had one)."""
    if not isinstance(err, OSError) or err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return None
    path = err.filename or next((f.f_locals[name].name for f in reversed(frames(err)) for name in f.f_locals
                                 if isinstance(f.f_locals[name], io.IOBase)
                                 and isinstance(getattr(f.f_locals[name], "name", None), str)), None)
    from suite.checkpoint_io import TMP_MARK

    if path and TMP_MARK in os.path.basename(path):  # an atomic write's temporary file: name the file it replaces
        folder, name = os.path.split(path)
        path = os.path.join(folder, name.split(TMP_MARK)[0].removeprefix("."))
    what = f"while writing {path}" if path else "while writing the run's files"
    if err.errno == errno.EROFS:
        return UserError(f"The file system is read-only ({os.strerror(err.errno)}) {what}. Run again with a run "
                         "directory on a writable disk, e.g. `hydra.run.dir=/scratch/$USER/my-run`.")
    return UserError(
        f"The disk is full ({os.strerror(err.errno)}) {what}. Files written before are intact: checkpoints are "
        "written to a temporary file and renamed into place, so the last one is whole. Free space on that disk "
        "and continue the run with the same command plus `resume=true hydra.run.dir=<its run directory>`, or start "
        "it on a disk with room, e.g. `hydra.run.dir=/scratch/$USER/my-run`."
    )


# How a run that ran out of memory goes on, once made smaller.
RESUME = ("Checkpoints written so far are kept: after a change that keeps the network, the same command plus "
          "`resume=true hydra.run.dir=<its run directory>` continues from the newest.")


def memory_error(err: BaseException) -> UserError | None:
    """Out of memory: a GPU's (``torch.OutOfMemoryError``) or the machine's (torch's CPU allocator, Python's
    ``MemoryError``). The run is too large for the machine as configured, and the message says which options make
    it smaller, and where it ran out (the innermost frame of the suite's own code, for a run that should fit)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        device = "The GPU"
    elif isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and "DefaultCPUAllocator" in str(err)):
        device = "This machine"
    else:
        return None
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    detail = detail.split(" See documentation for Memory Management")[0].strip()  # torch's link: not the run's
    detail = detail if detail.endswith(".") else detail + "."
    ours = [(f, own_file(f)) for f in frames(err) if own_file(f) is not None]
    place = f" in {ours[-1][1]}:{ours[-1][0].f_lineno} ({ours[-1][0].f_code.co_name})" if ours else ""
    return UserError(
        f"{device} ran out of memory{place}: {detail} The run is too large for it as configured: lower "
        "data.batch_size (evaluation uses data.eval_batch_size), or keep the effective batch with a smaller "
        "data.batch_size and ++trainer.accumulate_grad_batches=<n>; on a GPU, trainer.precision=bf16-mixed halves "
        f"activations; smaller inputs (data.npoints, data.img_size) or a smaller model also fit. {RESUME}"
    )


# torch.utils.data's words when a loader worker dies of a signal (its SIGCHLD check, _error_if_any_worker_fails)
WORKER_SIGNAL = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)\.")


def worker_error(err: BaseException) -> UserError | None:
    """A data-loading worker killed by SIGKILL, almost always for memory (the kernel's out-of-memory killer, or the
    scheduler enforcing the job's memory limit), or by SIGBUS, which torch's workers meet when the shared memory they
    hand batches over in (``/dev/shm``) is full: the machine's limits as the run is configured, not a bug. torch
    says only which signal; the message says what it means and what to lower or raise. Other signals (a worker's
    own crash) keep their traceback."""
    match = WORKER_SIGNAL.search(str(err)) if isinstance(err, RuntimeError) else None
    if match is None or match.group(2) not in ("Killed", "Bus error"):
        return None
    pid = match.group(1)
    if match.group(2) == "Killed":
        return UserError(
            f"A data-loading worker (pid {pid}) was killed with SIGKILL: almost always for memory, by the kernel's "
            "out-of-memory killer or by the scheduler enforcing the job's memory limit (`dmesg` or the job's log "
            "says which). The run as configured needs more memory than it has: lower data.num_workers (each "
            "worker holds its own copy of the data set's arrays and its prefetched batches), data.batch_size or "
            f"data.eval_batch_size, or ask for more memory (SLURM: --mem). {RESUME}")
    return UserError(
        f"A data-loading worker (pid {pid}) was killed with SIGBUS: the shared memory the workers hand their "
        "batches over in (/dev/shm) is full. Give it more room (in a container: `docker run --shm-size=16g` or "
        "`--ipc=host`), or lower data.num_workers, data.batch_size or data.eval_batch_size; data.num_workers=0 "
        f"loads in the run's own process, without shared memory. {RESUME}")


def own_file(frame: FrameType) -> str | None:
    """The frame's file relative to the checkout when it is the suite's own code (not an installed package in
    the checkout's .venv, not generated code), else None."""
    name = frame.f_code.co_filename
    if name.startswith("<"):
        return None
    path = Path(name).resolve()
    if not path.is_relative_to(PROJECT):
        return None
    relative = path.relative_to(PROJECT)
    return None if relative.parts[0].startswith(".") or "site-packages" in relative.parts else str(relative)


def chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and what it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def frames(err: BaseException) -> list[FrameType]:
    """The frames ``err`` passed through, outermost first."""
    return [frame for frame, _ in traceback.walk_tb(err.__traceback__)]


def trainer_option_error(err: BaseException) -> UserError | None:
    trainer_module = sys.modules.get("lightning.pytorch.trainer.trainer")
    if trainer_module is None:
        return None  # Lightning was never imported: the exception is not its
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    init = trainer_module.Trainer.__init__  # Lightning's env-var wrapper around the real constructor
    real_init = inspect.unwrap(init)
    arguments = [p for p in inspect.signature(real_init).parameters if p not in NOT_OPTIONS]
    message = sentence(err)
    unexpected = UNEXPECTED.match(message)
    if isinstance(err, TypeError) and unexpected and unexpected.group(1) == "Trainer":
        name = unexpected.group(2)
        return UserError(
            f"trainer.{name} is not an argument of Lightning's Trainer ({message[:-1]}). Check its spelling against "
            "https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-class-api and fix or drop "
            f"trainer.{name} on the command line or in {where('TrainerOptions')}; any Trainer argument is passed "
            "as e.g. `python run.py ++trainer.max_time=00:12:00:00`."
        )
    in_init = [f for f in frames(err) if f.f_code is real_init.__code__]
    option = named_option(message, arguments, LIGHTNING_WORDS)
    if isinstance(err, MisconfigurationException):
        if not in_init and option is None:
            return None  # Lightning's complaint about a module or callback: the code's fault, not an option
    elif not (isinstance(err, (ValueError, TypeError)) and in_init and option is not None):
        return None
    if option is None:
        return UserError(
            f"Lightning's Trainer refused the trainer options: {message} Fix them on the command line or in "
            f"{where('TrainerOptions')}; `python run.py --cfg job` prints them as composed."
        )
    given = f"={in_init[0].f_locals[option]!r}" if in_init and option in in_init[0].f_locals else ""
    return UserError(
        f"Lightning's Trainer refused trainer.{option}{given}: {message} Fix trainer.{option} on the command line "
        f"or in {where('TrainerOptions')}, e.g. `python run.py ++trainer.{option}="
        f"{example('TrainerOptions', option)}` (++ sets it whether the config lists it or not)."
    )


def optimizer_option_error(err: BaseException) -> UserError | None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(err, (ValueError, TypeError)):
        return None
    message = sentence(err)
    unexpected = UNEXPECTED.match(message)
    if isinstance(err, TypeError) and unexpected:  # raised where the optimiser is called, before its __init__ runs
        cls = getattr(torch.optim, unexpected.group(1), None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            return None
        name = unexpected.group(2)
        return UserError(
            f"torch.optim.{cls.__name__} takes no argument {name} ({message[:-1]}), so optim.<optimizer>.{name} "
            f"(optim.optimizer.{name}; task=gan: optim.generator.{name} / optim.discriminator.{name}) cannot be "
            f"passed to it. Drop it, or pick an optimiser that takes it, on the command line or in "
            f"{where('OptimizerOptions')}, e.g. `python run.py ~optim.optimizer.{name}`."
        )
    # The outermost torch.optim constructor on the way: the optimiser being built (AdamW, whose __init__ calls Adam's).
    optim_dir = torch.optim.__file__.rsplit("/", 1)[0] + "/"
    inits = [f for f in frames(err) if f.f_code.co_name == "__init__" and f.f_code.co_filename.startswith(optim_dir)
             and isinstance(f.f_locals.get("self"), torch.optim.Optimizer)]
    if not inits or not frames(err)[-1].f_code.co_filename.startswith(optim_dir):
        return None
    frame = inits[0]
    arguments = [p for p in inspect.signature(type(frame.f_locals["self"]).__init__).parameters
                 if p not in ("self", "params")]
    option = named_option(message, arguments, TORCH_WORDS)
    if option is None:
        return None  # not about an option (an empty parameter list): the task's bug
    cls = type(frame.f_locals["self"])
    given = f"={frame.f_locals[option]!r}" if option in frame.f_locals else ""
    return UserError(
        f"torch.optim.{cls.__name__} refused {option}{given}: {message} It comes from optim.<optimizer>.{option} "
        f"(optim.optimizer.{option}; task=gan: optim.generator.{option} / optim.discriminator.{option}): fix it on "
        f"the command line or in {where('OptimizerOptions')}, e.g. "
        f"`python run.py optim.optimizer.{option}={example('OptimizerOptions', option)}`."
    )


def sentence(err: BaseException) -> str:
    """The exception's message as one sentence, ending with its full stop."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if text[-1] in ".!?" else text + "."


def named_option(message: str, arguments: list[str], words: dict[str, str] | None = None) -> str | None:
    """The first of ``arguments`` that ``message`` names (as a word, in any case, or by one of ``words``)."""
    found = []
    for name in arguments:
        match = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message, re.IGNORECASE)
        if match:
            found.append((match.start(), name))
    for word, name in (words or {}).items():
        match = re.search(rf"\b{re.escape(word)}", message, re.IGNORECASE)
        if match and name in arguments:
            found.append((match.start(), name))
    return min(found)[1] if found else None


def where(options: str) -> str:
    """Where the options of ``suite.schema``'s class ``options`` are set (its ``WHERE``)."""
    from suite import schema

    return getattr(schema, options).WHERE


def example(options: str, option: str) -> str:
    """The example value ``suite.schema``'s class ``options`` gives for ``option`` ("<value>" where it has none)."""
    import dataclasses

    from suite import schema

    for field in dataclasses.fields(getattr(schema, options)):
        if field.name == option:
            return str(field.metadata["example"])
    return "<value>"
