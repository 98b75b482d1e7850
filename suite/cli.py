"""What ``run.py`` does with the command line before Hydra composes it.

- :func:`run_stamp`: the ``${run_stamp:}`` resolver of ``configs/config.yaml`` (the run directory's last part);
- :func:`quote_report_runs`: ``report.runs=a,b`` as a list rather than a Hydra sweep;
- :func:`check_group_choices`: ``group=unknown`` refused with the group's choices, exit code 2;
- :func:`exit_with_message`: how every user error ends: one message on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("mode", "task", "attn", "data", "model", "trainer", "logger", "experiment")


def exit_with_message(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_stamp() -> str:
    """The last part of a run's directory (``${run_stamp:}`` in configs/config.yaml): the start time, or
    ``slurm-<job id>`` inside a SLURM batch job (interactive ``bash`` / ``interactive`` allocations, which host
    many runs, keep the time, as Lightning's SLURM detection does)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"slurm-{job}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def quote_report_runs(argv: list[str]) -> list[str]:
    """``report.runs=a,b`` as the list ``report.runs=['a','b']``: Hydra would read the commas as a sweep (and any
    path holding ``:``, ``=`` or spaces needs quoting), so each folder is passed quoted."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "report.runs" and value and value[0] not in "[\"'" and value != "null":
            folders = ",".join("'" + v.replace("'", "\\'") + "'" for v in value.split(",") if v)
            arg = f"{key}=[{folders}]"
        out.append(arg)
    return out


def check_group_choices(argv: list[str]) -> None:
    """Reject ``group=unknown`` before Hydra does, listing the choices, with exit code 2. Sweeps are parsed as
    Hydra parses them: each choice of ``attn=self,offset`` or ``choice(...)`` is checked, and ``glob(...)`` must
    match at least one config of the group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # not ours to report: Hydra's own message names the bad override
        key = override.key_or_group
        if key not in GROUPS or override.value() is None:
            continue
        available = sorted(p.stem for p in (CONFIGS / key).glob("*.yaml"))
        value = override.value()
        if isinstance(value, Glob):
            if not value.filter(available):
                exit_with_message(f"{arg!r} matches no {key} config. Available {key} choices: "
                                  f"{', '.join(available)} (configs/{key}/). Example: "
                                  f"`python run.py -m '{key}=glob(*)'`.")
            continue
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(value)]
        for choice in choices:
            if choice and choice != "null" and choice not in available:
                exit_with_message(f"unknown {key} {choice!r}. Available {key} choices: {', '.join(available)} "
                                  f"(configs/{key}/). Example: `python run.py {key}={available[0]}`.")
