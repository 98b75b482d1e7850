"""Test helpers shared by modules (a module of its own: ``conftest`` is ambiguous on sys.path, since
tests/attention has one too)."""

from __future__ import annotations

import json
import subprocess


def once_per_worker(tmp_path_factory, name: str, build):
    """``build(out)`` -> CompletedProcess (or None), run once per xdist worker and session in ``<basetemp>/<name>``;
    later calls return ``(out, the same CompletedProcess)`` from disk.

    Module-scoped fixtures are torn down whenever a worker switches modules, and xdist does not run a module's
    tests (even one xdist_group) back to back: without this, expensive end-to-end runs were repeated."""
    out = tmp_path_factory.getbasetemp() / f"once-{name}"
    record = out.parent / f".once-{name}.json"
    if record.is_file():
        r = json.loads(record.read_text())
        return out, subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], r["stderr"])
    out.mkdir(parents=True, exist_ok=True)
    proc = build(out) or subprocess.CompletedProcess([], 0, "", "")
    record.write_text(json.dumps({"args": [str(a) for a in proc.args], "returncode": proc.returncode,
                                  "stdout": proc.stdout, "stderr": proc.stderr}))
    return out, proc


def user_error_in_process(args: list[str], capsys, cwd, out_dir, *needles: str) -> str:
    """What ``tests/test_run.py``'s ``user_error`` checks of ``run.py args`` (exit code 2, no traceback, every needle
    on stderr), in this process: run.py's checks of the command line, Hydra's composition, the run and run.py's way
    of ending a user error, as tests/test_bad_inputs.py ``refused_in_process`` goes through them, from ``cwd`` (the
    subprocess's working folder: relative paths such as data_dir=data resolve there) into ``out_dir`` (the run
    directory: hydra.run.dir where ``args`` give one). A bug (no user error) raises here, as its traceback would end
    the process. A process start (seconds of imports) adds nothing to these checks; the real process path of a user
    error stays covered by the tests that still run ``run.py`` (tests/test_bad_inputs.py ``refused``, test_run.py).
    Returns what was printed on stderr."""
    import os
    from pathlib import Path

    import pytest
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from suite.cli import check_group_choices, check_overrides, exit_with_message, quote_report_runs
    from suite.errors import as_user_error
    from suite.run_dirs import register_resolvers
    from suite.train import run

    register_resolvers()  # as run.py does first
    configs = str(Path(__file__).resolve().parents[1] / "configs")
    args = quote_report_runs(list(args))
    capsys.readouterr()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with pytest.raises(SystemExit) as ended:
            check_group_choices(args)
            check_overrides(args)
            with initialize_config_dir(config_dir=configs, version_base="1.3"):
                cfg = compose("config", overrides=args, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # as Hydra's run_job does
            with open_dict(cfg):
                del cfg["hydra"]
            try:
                run(cfg, Path(out_dir), args)
            except Exception as err:  # noqa: BLE001 - run.py's main: a user error is a message, a bug a traceback
                cause = as_user_error(err)
                if cause is None:
                    raise
                exit_with_message(str(cause))
    finally:
        HydraConfig.instance().cfg = None
        os.chdir(before)
    err = capsys.readouterr().err
    assert ended.value.code == 2, (ended.value.code, err[-2000:])
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
