"""Run directories: no run overwrites another run's results.

- A **training run** (``mode=train``) writes into its run directory, and holds it while it trains (:func:`hold`: no
  second training run there at the same time). A directory that already holds a run's
  checkpoints or results (``checkpoints/*.ckpt``, ``hpc_ckpt_*.ckpt``, ``metrics.json``) is refused
  (:func:`check_fresh_run`; for a single run by :class:`CheckRunDir` as soon as Hydra has composed it, before
  Hydra writes its ``.hydra/`` files over the old run's) unless this run continues that one (``resume=true``,
  ``ckpt_path=last`` or a checkpoint of that directory, a requeued SLURM job: :func:`slurm_restart`) or
  is told to replace it (``overwrite=true``, which deletes the old run's checkpoints, ``metrics.json``, logged
  history and the ``test-<time>`` records of tests of its checkpoints first, so that no old best checkpoint or
  result is left beside the new ones).
- What a finished or running training run's folder says it ran (``resolved_config.yaml``, ``.hydra/*.yaml``) is
  kept as it was when a run there ends without training (:func:`keep_run_record`, :func:`put_back_run_record`): a
  job of a multirun refused there (Hydra writes the job's ``.hydra/`` files before any check can run), a finished
  run resumed (its ``metrics.json`` is kept, and was labelled with the new command's config), a resumed run refused
  because its checkpoint is past the new ``trainer.max_epochs``.
- A **test** (``mode=test``/``eval``) in a directory that holds a run already, as
  ``mode=test ckpt_path=last hydra.run.dir=<a training run>`` does, writes its own record into
  ``<run dir>/test-<time>/`` (:func:`record_dir`): ``metrics.json``, ``resolved_config.yaml``, Hydra's ``.hydra/``
  (``hydra.output_subdir`` in configs/config.yaml asks :func:`hydra_subdir`) and its loggers' files. The training
  run's files stay as they were; its log lines are appended to the run's ``run.log``. ``mode=report`` reads the
  training run's record and does not descend into the test records of a run folder. ``mode=summary``, ``bench``
  and ``report`` there write theirs (``.hydra/``, a summary's ``resolved_config.yaml``) into ``<mode>-<time>/``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)
TESTS = ("test", "eval")
_RECORDS: dict[str, Path] = {}  # run directory -> this process's record directory, decided once per run
HYDRA_RECORD = (".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml")
RUN_RECORD = ("resolved_config.yaml", "csv/metrics.csv", *HYDRA_RECORD)  # what a run's folder says it ran and logged
_KEPT: dict[str, dict[str, bytes | None]] = {}  # run directory -> its RUN_RECORD files as this run found them


def register_resolvers() -> None:
    """The resolvers the configs name, registered before Hydra composes them (run.py does this first):
    ``${run_stamp:}`` (the run directory's last part), ``${hydra_subdir:...}`` (where Hydra writes .hydra/) and
    ``${batches:STEPS,ACCUMULATE}`` (optimizer steps as the training batches Lightning counts them)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)
    OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir, replace=True)
    OmegaConf.register_new_resolver("batches", batches, replace=True)


def batches(steps, accumulate):
    """``${batches:${eval.every_n_steps},${oc.select:trainer.accumulate_grad_batches,1}}``: the training batches
    of ``steps`` optimizer steps, for ``trainer.val_check_interval``, which Lightning counts in batches. Under
    ``trainer.accumulate_grad_batches=2`` a validation "every 2000 iterations" (mmseg's, the poly schedule's)
    came every 1000. Anything but two whole numbers (a float fraction of an epoch, null) passes through as
    ``steps``, for the trainer's own checks to judge."""
    whole = all(isinstance(x, int) and not isinstance(x, bool) for x in (steps, accumulate))
    return steps * accumulate if whole and accumulate > 0 else steps


def run_stamp() -> str:
    """The last part of a run's directory (``${run_stamp:}`` in configs/config.yaml): the start time, or
    ``slurm-<job id>-<command digest>`` inside a SLURM batch job (interactive ``bash`` / ``interactive``
    allocations, which host many runs, keep the time, as Lightning's SLURM detection does).

    Every task of a job (``srun``: one process per GPU) and the job requeued after a pre-emption run the same
    command, so they find the same directory, and a requeued job resumes there. The digest of the command's
    overrides (:func:`command_digest`) keeps apart the runs of one job that are not the same run: a W&B agent's
    runs, or a script's loop over seeds, one after the other in one job, or several side by side. With the job id
    alone they shared ``slurm-<job id>``: the second run took the first one's results for its own requeued job,
    "resumed" them and reported the first run's network under its own seed."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"slurm-{job}-{command_digest()}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def command_digest() -> str:
    """Eight hex digits of the command line's arguments (the same for every task of a job and its requeue)."""
    return hashlib.sha1("\0".join(sys.argv[1:]).encode()).hexdigest()[:8]


def results_in(run_dir: Path) -> list[str]:
    """What of a run's results ``run_dir`` holds (paths relative to it): checkpoints and metrics.json."""
    found = sorted(p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.is_file())
    found += sorted(p for p in run_dir.glob("hpc_ckpt_*.ckpt") if p.is_file())
    if (run_dir / "metrics.json").is_file():
        found.append(run_dir / "metrics.json")
    return [str(p.relative_to(run_dir)) for p in found]


def record_dir(run_dir: Path, mode: str) -> Path:
    """Where a run writes its record: the run directory, or for a run of another mode than ``train`` in a
    directory holding a run's results or config, a new folder in it: ``test-<time>`` for a test, ``<mode>-<time>``
    for ``summary``, ``bench`` and ``report``, which wrote their ``.hydra/`` (and ``summary`` its
    ``resolved_config.yaml``, ``mode: summary``) over the training run's: ``mode=report`` then skipped that run as
    a summary's folder. Decided on the first call for a directory (Hydra's, through :func:`hydra_subdir`, before
    anything of this run is written) and the same for the rest of the process."""
    run_dir = Path(run_dir).absolute()
    if mode == "train":
        keep_run_record(run_dir)
        return run_dir
    if str(run_dir) not in _RECORDS:
        record = run_dir
        if results_in(run_dir) or (run_dir / "resolved_config.yaml").is_file():
            # claimed with one mkdir: tests started within the same second (eval options tried side by side) get
            # test-<time>, test-<time>-1, ...
            kind = "test" if mode in TESTS else mode
            record = claim(run_dir / f"{kind}-{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}")
        _RECORDS[str(run_dir)] = record
    return _RECORDS[str(run_dir)]


def keep_run_record(run_dir: Path) -> None:
    """Keep (in memory, once per run of this process) what ``run_dir`` says its run ran, when it holds a run's
    results: called through :func:`hydra_subdir` as Hydra is about to write this run's ``.hydra/`` files there."""
    key = str(Path(run_dir).absolute())
    if key in _KEPT or not results_in(Path(key)):
        return
    kept = {}
    for name in RUN_RECORD:
        try:
            kept[name] = (Path(key) / name).read_bytes()
        except FileNotFoundError:
            kept[name] = None
    _KEPT[key] = kept


def put_back_run_record(run_dir: Path, names: tuple[str, ...] = RUN_RECORD) -> None:
    """Write back the files ``names`` of what :func:`keep_run_record` kept of ``run_dir`` (this run trained nothing
    there: its record stays the old run's), and forget it. ``names``: the files this run may have written (a run
    refused before it started: Hydra's alone, as the run training there now, if any, writes its history)."""
    kept = _KEPT.pop(str(Path(run_dir).absolute()), None)
    for name, data in (kept or {}).items():
        if name not in names:
            continue
        path = Path(run_dir) / name
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)


def forget_run_record(run_dir: Path) -> None:
    """This run trains in ``run_dir`` (or its process runs another job next): its own record stands."""
    _KEPT.pop(str(Path(run_dir).absolute()), None)


def hydra_subdir(output_dir: str, mode: str) -> str:
    """``hydra.output_subdir`` (the ``${hydra_subdir:...}`` resolver): ``.hydra`` in the run's record directory."""
    return str((record_dir(Path(output_dir), str(mode)) / ".hydra").relative_to(Path(output_dir).absolute()))


def check_fresh_run(run_dir: Path, *, resume: bool, ckpt_path: str | None, overwrite: bool,
                    slurm_restart: bool, delete: bool = True, identity: dict | None = None) -> None:
    """Refuse a fresh training run in a directory holding another run's results, unless told (module docstring);
    with ``overwrite=true`` delete those results first (when ``delete``: rank zero of a multi-process run). A run
    that continues the one there must be that run (:func:`check_same_run`, ``identity``). Called before this run
    writes anything."""
    from attention.errors import UserError  # here, not at the top: run.py imports this module before every
    # check, and the attention package brings torch (3 s a start, for a refusal that needs none of it)

    found = results_in(run_dir)
    if resume and overwrite:
        raise UserError("resume=true continues the run in hydra.run.dir and overwrite=true replaces it: pass one "
                        "of them.")
    continuing = resume or ckpt_path == "last" or slurm_restart or (
        ckpt_path is not None and Path(ckpt_path).absolute().is_relative_to(run_dir.absolute()))
    if found and continuing and identity:
        check_same_run(run_dir, identity)
    if not found or continuing:
        return
    if not overwrite:
        listed = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "")
        raise UserError(f"hydra.run.dir={run_dir} holds another run's results ({listed}): a fresh training run "
                        "would overwrite them. Add `resume=true` to continue that run from its newest checkpoint, "
                        "or `overwrite=true` to delete its checkpoints, metrics.json and logged history and start "
                        "afresh there; or leave hydra.run.dir out to start in a new directory.")
    if not delete:
        return
    log.warning("overwrite=true: deleting the previous run's results in %s (%s)", run_dir, ", ".join(found))
    for path in [*run_dir.glob("hpc_ckpt_*.ckpt"), run_dir / "metrics.json", *run_dir.glob("metrics-step*.json")]:
        path.unlink(missing_ok=True)
    tests = [p.name for p in run_dir.glob("test-*") if p.is_dir()]  # the records of tests of its checkpoints
    # wandb/: the old run's offline W&B runs, which `wandb sync <run dir>/wandb` uploaded beside the new one's
    for folder in ("checkpoints", "csv", "wandb", "wandb_fallback", *tests):
        shutil.rmtree(run_dir / folder, ignore_errors=True)


RUN_LOCK = ".run.lock"  # held by a training run's first process for as long as it trains in its directory
_HELD: dict = {}  # lock file -> this process's FileLock: a lock object let go of unlocks (filelock frees on __del__)


def hold(run_dir: Path) -> None:
    """Hold ``<run dir>/.run.lock`` (re-entrant in a process; the operating system lets go when the process ends,
    however it ends), or refuse the run when another process holds it: two training runs in one directory (a
    job submitted twice with one hydra.run.dir and resume=true, overwrite=true on a run still training) wrote their
    checkpoints and metrics.json over each other's, or deleted the running one's. Where the file system cannot
    lock files, nothing is held, as before."""
    from filelock import FileLock, Timeout

    from attention.errors import UserError

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _HELD.setdefault(str(run_dir / RUN_LOCK), FileLock(run_dir / RUN_LOCK, fallback_to_soft=False))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(
            f"hydra.run.dir={run_dir} is in use: another run is training there now (it holds {run_dir / RUN_LOCK}). "
            "Two runs in one directory write their checkpoints and metrics.json over each other's. Wait for it to "
            "end, or stop it, and run this again (resume=true continues it); or leave hydra.run.dir out to start "
            "in a new directory."
        ) from None
    except OSError as err:
        log.warning("%s cannot be locked (%s): nothing stops a second run from using this directory at once.",
                    run_dir / RUN_LOCK, err)


def release(run_dir: Path) -> None:
    """Let go of :func:`hold` once (the Hydra callback's hold lasts until the process ends)."""
    lock = _HELD.get(str(run_dir / RUN_LOCK))
    if lock is not None and lock.is_locked:
        lock.release()


def in_use(run_dir: Path) -> bool:
    """Whether a run holds ``run_dir``'s lock now (:func:`hold`: while it trains and tests). Read-only (a shared
    lock tried on the file opened for reading: it works on a read-only copy of results too); False where it cannot
    be told (no lock file, no ``flock``)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return False
    try:
        fd = os.open(run_dir / RUN_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # filelock's lock is an exclusive flock on this file
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the shared lock, if taken
    return False


# What makes a run the run it is, beyond the task and attention its checkpoints name (suite.checkpoints): a run
# continued under another seed or on another data set would report that run's network under this one's name.
# data.seed (${seed} unless given) draws a generated data set and a held-out split: resumed under another, a run
# trained on other samples and validated on others (data's seed is operational for a test, suite.checkpoints).
IDENTITY = ("seed", "data._target_", "data.seed")


def identity_of(config) -> dict:
    """The :data:`IDENTITY` values of a (composed, or saved and loaded) config."""
    from omegaconf import OmegaConf

    return {key: OmegaConf.select(config, key, default=None) for key in IDENTITY}


def check_same_run(run_dir: Path, identity: dict) -> None:
    """Refuse to continue the run in ``run_dir`` (``resume=true``, ``ckpt_path=last``, a requeued job) under another
    seed or data set than it was started with (its ``resolved_config.yaml``): a job script that keeps one
    hydra.run.dir for a loop over seeds continued the first seed's run for every other seed, and recorded its
    network under their seeds. Nothing to compare (no saved config): nothing refused."""
    from omegaconf import OmegaConf

    from attention.errors import UserError

    saved = run_dir / "resolved_config.yaml"
    try:
        before = identity_of(OmegaConf.load(saved))
    except Exception:  # noqa: BLE001 - missing or unreadable: the checkpoint checks still apply
        return
    differ = {k: (before[k], identity.get(k)) for k in IDENTITY
              if before[k] is not None and identity.get(k) is not None and before[k] != identity.get(k)}
    if differ:
        said = ", ".join(f"{k}={was} (this command: {k}={now})" for k, (was, now) in differ.items())
        raise UserError(
            f"hydra.run.dir={run_dir} holds a run started with {said}, and this command would continue it: its "
            "results would be that run's, recorded under this command's values. Give this run a directory of its "
            "own (leave hydra.run.dir out, or one per seed), or pass the values the run was started with to "
            "continue it, or overwrite=true (without resume=true) to replace it."
        )


def slurm_restart(run_dir: Path) -> bool:
    """Whether this is a SLURM job started again (requeued) in its run directory, which then resumes as with
    resume=true: under SLURM (as Lightning detects it), with Lightning's ``hpc_ckpt_*.ckpt`` in the directory, or in
    the job's own ``slurm-<job id>-<command digest>`` directory (:func:`run_stamp`) holding its checkpoints, or in
    any directory holding them once SLURM has requeued the job (``SLURM_RESTART_COUNT`` > 0: the same job id and
    command, so the same directory). The last two are a job requeued without the SIGUSR1 warning, on pre-emption or
    a node failure; without the third, a ``hydra/launcher=slurm`` job (``<sweep dir>/<n>_<task>_<attn>``) or a
    script's ``hydra.run.dir=`` run requeued so was refused as a fresh run in another run's directory (exit 2)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return False
    run_dir = Path(run_dir)
    own = run_dir.name == run_stamp()
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")  # SLURM's count of requeues
    return any(run_dir.glob("hpc_ckpt_*.ckpt")) or ((own or requeued) and bool(results_in(run_dir)))


def claim(folder: Path) -> Path:
    """A new, empty folder for one run or sweep: ``folder``, or ``folder-1``, ``folder-2``, ... when another run
    has it. Each try is one ``mkdir``, which fails when the folder exists, also on a shared file system: the one
    check-and-create that two processes cannot both pass."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = folder, 0
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = folder.with_name(f"{folder.name}-{n}")


def claim_stamped_dir(config, kind: str) -> None:
    """Give a run (``kind="run"``) or sweep (``"sweep"``) whose directory is named by its start time a directory
    of its own (:func:`claim`), written into ``config`` as a plain path for Hydra, the run and Lightning's DDP
    processes. Runs started within the same second with the same task and attention (W&B agents or a shell loop
    started together, two sweeps) shared one directory, and overwrote each other's checkpoints and results.
    A directory given on the command line, and a SLURM job's ``slurm-<job id>-<digest>`` (shared by the job's
    tasks and its requeue on purpose), are left as they are."""
    from omegaconf import OmegaConf, read_write

    node = config.hydra[kind]
    given = str(OmegaConf.to_container(node, resolve=False).get("dir"))
    stamp = "${run_stamp:}" if kind == "run" else "${now:"
    named = any(o.lstrip("+").startswith(f"hydra.{kind}.dir=") for o in config.hydra.overrides.hydra)
    if named or stamp not in given or (kind == "run" and run_stamp().startswith("slurm-")):
        return  # a folder named on the command line (a pattern too, e.g. a sweep to be resumed) is used as given
    folder = claim(Path(str(node.dir)))
    with read_write(node):
        node.dir = str(folder)
    if kind == "sweep":  # each job's config is composed again from the sweep's overrides: add the directory to them
        quoted = str(folder).replace("'", "\\'")  # Hydra's quoted string; backslashes stay as they are
        with read_write(config.hydra.overrides):
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir='{quoted}'")


def keep_sweep_record(sweep_dir: Path) -> None:
    """A sweep into a folder that holds an earlier sweep (``hydra.sweep.dir`` named again: to resume it, to add
    runs beside its runs, or refused at its first job that would overwrite one) keeps that sweep's
    ``multirun.yaml``, its record of what it ran, as ``multirun-<its time>.yaml``: Hydra writes the new sweep's
    over it, before any job starts."""
    record = sweep_dir / "multirun.yaml"
    try:
        stamp = datetime.fromtimestamp(record.stat().st_mtime).strftime("%Y-%m-%d_%H-%M-%S")
    except FileNotFoundError:
        return
    kept, n = sweep_dir / f"multirun-{stamp}.yaml", 0
    while kept.exists():
        n += 1
        kept = sweep_dir / f"multirun-{stamp}-{n}.yaml"
    try:
        os.replace(record, kept)
    except FileNotFoundError:  # another sweep started at once moved it first
        pass


class CheckRunDir(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/config.yaml): a directory of its own for a run or sweep named
    by its start time (:func:`claim_stamped_dir`); :func:`check_fresh_run` for a single training run before Hydra
    writes anything into its directory, where a refusal ends the run as every user error does."""

    def on_multirun_start(self, config, **kwargs) -> None:
        claim_stamped_dir(config, "sweep")
        keep_sweep_record(Path(str(config.hydra.sweep.dir)))

    def on_run_start(self, config, **kwargs) -> None:
        claim_stamped_dir(config, "run")
        if config.get("mode") != "train":
            return
        from attention.errors import UserError
        from suite.cli import exit_with_message
        from suite.distributed import is_rank_zero

        run_dir = Path(str(config.hydra.run.dir)).absolute()
        try:
            if is_rank_zero():  # the other processes of a DDP run share the directory with it
                hold(run_dir)
            check_fresh_run(run_dir, resume=bool(config.get("resume")), ckpt_path=config.get("ckpt_path"),
                            overwrite=bool(config.get("overwrite")), slurm_restart=slurm_restart(run_dir),
                            delete=is_rank_zero(), identity=identity_of(config))
        except UserError as err:
            exit_with_message(str(err))
