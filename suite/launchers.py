"""A sweep through Hydra's submitit launchers (``hydra/launcher=local``, ``slurm``) that outlasts a failed job.

The plugin's launcher waits for its jobs' results in order and raises at the first failed one: the sweep's command
ended with a traceback (submitit's ``UncompletedJobError`` quoting the job's error stream), exit code 1, and never
collected the jobs after it. Under :func:`failed_jobs_recorded` a failed job (its process ended
without a result, as a run's user error does with exit code 2, or its run raised) is recorded as a job of the sweep
(``suite.cli.SweepJob``: its number, folder, message and log), the launcher waits for every other job, and run.py's
end lists the failed ones with the exit code an in-process sweep gives (``suite.cli.end_sweep``). Each job's own exit
code, what SLURM's accounting shows, is unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus

from suite import cli


@contextmanager
def failed_jobs_recorded(multirun: bool):
    """Around run.py's ``main()`` in a multirun: while a submitit launcher collects its jobs' results, a failed job is
    recorded (``suite.cli.SWEEP_JOBS``) and stood in for by a finished ``JobReturn`` without a value, so that the
    collection, and Hydra's sweeper after it, go on. A scoped replacement of ``submitit.Job.results`` because the
    plugin's ``launch`` creates its jobs and waits for them in one expression, with no hook between (and a subclass
    of the launcher would have to live in the ``hydra_plugins`` namespace package to be accepted by Hydra)."""
    if not multirun:
        yield
        return
    from submitit.core.core import Job
    from submitit.core.utils import UncompletedJobError

    original = Job.results

    def results(job):
        # The plugin submits itself with (overrides, "hydra.sweep.dir", job number, job id, Hydra's state).
        submission = job.submission()
        overrides, _, number = submission.args[:3]
        sweep_dir = str(submission.function.config.hydra.sweep.dir)
        cli.SWEEP_BASE = sweep_dir
        message, bug = None, False
        try:
            returned = original(job)
        except UncompletedJobError as err:  # the job's process ended without a result: a run's exit code 2, a kill
            message, bug = job_error(job.stderr() or "", str(err))
        else:
            ret = returned[0]
            if isinstance(ret, JobReturn) and ret.status == JobStatus.FAILED:  # a run's bug (the job caught it)
                message, bug = f"{type(ret._return_value).__name__}: {ret._return_value}", True
        folder = next(iter(sorted(Path(sweep_dir).glob(f"{number}_*"))), Path(sweep_dir) / str(number))  # the job's
        cli.SWEEP_JOBS.append(cli.SweepJob(number, str(folder), list(overrides), message, bug,
                                           None if message is None else str(job.paths.stderr)))
        if message is None:
            return returned
        return [JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)]

    Job.results = results
    try:
        yield
    finally:
        Job.results = original


def job_error(stderr: str, fallback: str) -> tuple[str, bool]:
    """What a job that ended without a result says on its error stream: a run's user error (its ``error: `` line,
    run.py's one paragraph), else the last line (a traceback's exception: a bug), else submitit's own account."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: "), False
    if lines:
        return lines[-1].strip(), True
    return " ".join(fallback.split("\n")[:2]), True
