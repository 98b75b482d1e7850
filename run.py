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

from suite.cli import check_group_choices, check_overrides, exit_with_message, quote_report_runs
from suite.run_dirs import register_resolvers

register_resolvers()  # ${run_stamp:} and ${hydra_subdir:...}: before Hydra composes the run directory


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from suite.errors import as_user_error
    from suite.train import run

    hydra_cfg = HydraConfig.get()
    try:
        run(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    except Exception as err:  # a UserError (or an option error of Lightning/torch) is a message, a bug a traceback
        cause = as_user_error(err)
        if cause is None:
            from suite.distributed import failed_process, stop_with

            if (failed := failed_process()) is not None:  # another process's failure broke this one's collective
                stop_with(*failed, at_once=False)
            raise
        exit_with_message(str(cause))


if __name__ == "__main__":
    sys.argv[1:] = quote_report_runs(sys.argv[1:])
    check_group_choices(sys.argv[1:])  # Hydra's own message for an unknown choice lists nothing
    check_overrides(sys.argv[1:])  # Hydra's own advice for an unknown key (+key=) adds a key nothing reads
    main()
