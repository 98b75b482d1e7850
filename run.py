#!/usr/bin/env python
"""The suite's one command: ``python run.py task=modelnet attn=external``.

Hydra composes ``configs/config.yaml`` with the groups task, attn, data, model, trainer, logger and experiment;
``suite/train.py`` runs it according to ``mode`` (train, test/eval, summary, bench, report: see there). A user
error prints one message and exits with code 2; a bug keeps its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from suite.cli import (check_group_choices, check_overrides, end_sweep, exit_with_message, in_process_sweep,
                       quote_report_runs, release_memory, sweep_job_ended)
from suite.launchers import failed_jobs_recorded
from suite.run_dirs import register_resolvers

register_resolvers()  # ${run_stamp:} and ${hydra_subdir:...}: before Hydra composes the run directory


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from suite.errors import as_user_error
    from suite.train import run

    hydra_cfg = HydraConfig.get()
    sweep = in_process_sweep(hydra_cfg)
    try:
        run(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    except Exception as err:  # a UserError (or an option error of Lightning/torch) is a message, a bug a traceback
        cause = as_user_error(err)
        if sweep:  # the sweep goes on with its next job; its end lists the failed ones (suite.cli)
            sweep_job_ended(hydra_cfg, err, None if cause is None else str(cause))
            del cause  # its traceback holds the failed job's frames: its network, optimizer and data, freed below
        elif cause is None:
            from suite.distributed import failed_process, stop_with

            if (failed := failed_process()) is not None:  # another process's failure broke this one's collective
                stop_with(*failed, at_once=False)
            raise
        else:
            exit_with_message(str(cause))
    else:
        if sweep:
            sweep_job_ended(hydra_cfg)
    if sweep:
        release_memory()


if __name__ == "__main__":
    sys.argv[1:] = quote_report_runs(sys.argv[1:])
    check_group_choices(sys.argv[1:])  # Hydra's own message for an unknown choice lists nothing
    check_overrides(sys.argv[1:])  # Hydra's own advice for an unknown key (+key=) adds a key nothing reads
    try:
        with failed_jobs_recorded(multirun=bool({"-m", "--multirun"} & set(sys.argv[1:]))):  # hydra/launcher=slurm
            main()
    except SystemExit:  # an interrupted sweep (SIGTERM, Ctrl-C) or a run's error: the jobs that failed before it
        end_sweep()
        raise
    if (code := end_sweep()) is not None:  # a sweep some of whose jobs failed
        sys.exit(code)
